"""``python -m hplan.runtime.bandwidth``: measure the link matrix (see :mod:`.job`)."""

from hplan.runtime.bandwidth.job import run_main

if __name__ == "__main__":
    run_main()
