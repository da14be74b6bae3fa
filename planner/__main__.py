"""``python -m hplan.planner ARGS``: the ``hplan`` command (what the runtime runs as a child
process to re-plan during an elastic run, with the Python it runs in)."""

from hplan.planner.cli.main import main

if __name__ == "__main__":
    main()
