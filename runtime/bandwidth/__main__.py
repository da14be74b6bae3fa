"""``python -m hplan.runtime.bandwidth``: measure the link matrix (see :mod:`.job`)."""

from hplan.runtime.bandwidth.job import main
from hplan.runtime.executor.cli import exit_with

if __name__ == "__main__":
    exit_with(main())
