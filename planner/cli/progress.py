"""Progress of ``hplan solve`` by phase, with each phase's wall time (on stderr).

On a terminal, a live spinner names the running pass and the phase's elapsed time, and when
a phase ends one line gives its time (``capture   12.3 s  loading and tracing the model``).
Elsewhere (a log, a pipe) nothing is printed while planning, so an error stays the only
line; the command's last line gives every phase's time either way. The phases and
their passes are ``hplan.planner.api.PHASES``; the pass runner reports each pass's start
and end (``hplan.planner.passes.PassObserver``). Nothing goes to stdout, so ``--json``
stays parseable.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

from hplan.planner.textfmt import format_seconds

_PHASE_WIDTH = 9
"""Columns of a phase name in the finished-phase lines (``capture`` and two spaces)."""


class PhaseProgress:
    """Shows the running phase live and prints each finished phase with its time.

    Use as a context manager around the planning call; it is a ``PassObserver``. Times are
    ``time.monotonic`` seconds; :attr:`times_s` holds every finished phase's total.
    """

    def __init__(self, console: Console, phase_of: Callable[[str], str]) -> None:
        self._console = console
        self._phase_of = phase_of
        self.created_s = time.monotonic()
        """When planning began (``time.monotonic``): what came before is the command's
        start (imports, option checks)."""
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self._phase: str | None = None
        self._label = ""
        self._task: TaskID | None = None
        self.times_s: dict[str, float] = {}
        """Finished phases' wall time in seconds, in the order they ran."""
        self.pass_times_s: dict[str, float] = {}
        """Finished passes' wall time in seconds, in the order they ran."""

    def __enter__(self) -> PhaseProgress:
        if self._console.is_terminal:  # elsewhere a live display only leaves a blank line
            self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self._end_phase()
        if self._console.is_terminal:
            self._progress.stop()

    # ------------------------------------------------------------------ PassObserver
    def started(self, name: str, says: str | None) -> None:
        """A pass starts: a new phase begins when the pass belongs to another phase."""
        phase = self._phase_of(name)
        if phase != self._phase:
            self._end_phase()
            self._begin_phase(phase)
        if says is not None:
            self._label = self._label or says
            self._describe(says)

    def finished(self, name: str, time_s: float) -> None:
        """A pass ended after ``time_s`` seconds: added to its phase's time."""
        phase = self._phase_of(name)
        self.times_s[phase] = self.times_s.get(phase, 0.0) + time_s
        self.pass_times_s[name] = time_s

    # ------------------------------------------------------------------ other phases
    @contextmanager
    def phase(self, name: str, says: str) -> Iterator[None]:
        """Time a phase the pass runner does not run (``write``): shown and recorded alike."""
        self._end_phase()
        self._begin_phase(name)
        self._label = says
        self._describe(says)
        started_s = time.monotonic()
        yield
        self.times_s[name] = self.times_s.get(name, 0.0) + time.monotonic() - started_s

    def tell(self, says: str) -> None:
        """Replace the running phase's progress line by ``says`` (a phase run in steps)."""
        self._describe(says)

    # ------------------------------------------------------------------ helpers
    def _begin_phase(self, phase: str) -> None:
        self._phase, self._label = phase, ""
        self._task = self._progress.add_task(phase, total=None)

    def _describe(self, says: str) -> None:
        if self._task is not None and self._phase is not None:
            self._progress.update(self._task, description=f"{self._phase}: {says}...")

    def _end_phase(self) -> None:
        if self._phase is None or self._task is None:
            return
        self._progress.remove_task(self._task)
        phase, label = self._phase, f"  {self._label}" if self._label else ""
        self._phase, self._task = None, None
        if self._console.is_terminal:
            time_s = format_seconds(self.times_s.get(phase, 0.0))
            self._console.print(f"{phase:<{_PHASE_WIDTH}}{time_s:>9}{label}")
