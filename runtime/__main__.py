"""``python -m hplan.runtime run PLAN ...``: what the launch scripts run on every rank.

The command lives in :mod:`hplan.runtime.executor.cli`; this module only runs it.
"""

from hplan.runtime.executor.cli import run_main

if __name__ == "__main__":
    run_main()
