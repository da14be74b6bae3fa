"""Rank 0's progress lines during a run and its summary line at the end: their format and
their parser (:func:`parse_line`), so that logs can be read back.

On a terminal rank 0 shows one live ``rich`` progress line. Elsewhere (a log file, a pipe,
Slurm's output) it prints a plain line when the first loss is known, then every
``PROGRESS_EVERY_S`` seconds or every ``PROGRESS_EVERY_FRACTION`` of the steps, whichever
comes first; in both cases one summary line after the last step (here broken in two; the
fields are explained in :class:`RunProgress`)::

    hplan: progress step=40/400 loss=2.3104 samples_per_s=512.3 step_time_s=0.0625 elapsed_s=2.6 eta_s=22.5
    hplan: summary steps=400 timed_steps=399 samples_per_s=510.2 step_time_s=0.0627
        final_loss=1.2345 predicted_samples_per_s=600.0 measured_over_predicted=0.85 elapsed_s=25.6

This module needs no torch: the executor feeds it numbers.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from hplan.runtime.contract.plan import Plan

PROGRESS_EVERY_S = 10.0
"""A plain progress line at least this often (seconds of rank 0's clock) ..."""
PROGRESS_EVERY_FRACTION = 0.1
"""... and at least every this fraction of the run's steps."""
_PREFIX = "hplan: "


def format_line(kind: str, fields: Sequence[tuple[str, object]]) -> str:
    """``hplan: <kind> key=value ...``; floats with 4 significant digits (whole numbers from
    10^4 on), None as ``none``."""
    return _PREFIX + " ".join([kind, *(f"{key}={_value(value)}" for key, value in fields)])


def parse_line(line: str) -> tuple[str, dict[str, str]] | None:
    """``(kind, {key: value})`` of a :func:`format_line` line; None for any other line."""
    if not line.startswith(_PREFIX):
        return None
    kind, *pairs = line[len(_PREFIX) :].split()
    if not pairs or not all("=" in p for p in pairs):
        return None
    return kind, dict(p.split("=", 1) for p in pairs)


def _value(value: object) -> str:
    if value is None:
        return "none"
    if not isinstance(value, float):
        return str(value)
    if not math.isfinite(value):
        return str(value)  # inf, -inf, nan
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"


def job_loss(
    plan: Plan, losses: Sequence[float | None], shares: Sequence[int] | None = None
) -> float | None:
    """The global batch's mean loss from each replica's mean loss, weighted by its samples
    (``shares``, one per replica: the ones the step ran with; default the plan's); None
    while a replica's is missing."""
    if len(losses) != plan.num_replicas or any(loss is None for loss in losses):
        return None
    if shares is None:
        shares = [plan.replica_ranks(r)[0].num_samples for r in range(plan.num_replicas)]
    total = sum(
        loss * samples for loss, samples in zip(losses, shares, strict=True) if loss is not None
    )
    return total / plan.global_batch_size


class RunProgress:
    """Rank 0's progress and summary lines (format: the module docstring).

    Fields: ``step=k/N``: the step whose loss is shown (counted from 1, with the steps before
    a resumed run's first) of the last step the run trains. ``loss``: that step's mean loss
    over the global batch (sample-weighted over replicas; ``none`` until known, ``inf`` when
    not finite); it reaches rank 0 one step late, with the ranks' agreement after every step
    (no collective of its own). ``samples_per_s``: global batch / rank 0's step time, the
    mean over the steps since the previous line (the live line: the last 20; the summary:
    the run's steps after the first, which warms up, or the first when it is alone).
    ``eta_s``: steps left times the mean step time so far. ``predicted_samples_per_s``: the
    plan's report, ``measured_over_predicted`` the ratio. Times are rank 0's wall clock.

    Call :meth:`step_done` after every step, :meth:`loss_known` when a step's loss arrives,
    then :meth:`summary` after the last step; :meth:`close` in any case (it stops the live
    line).

    Args:
        first_step: the run's first step (a resumed run's is the checkpoint's).
        num_steps: the steps the run trains.
        interactive: a live line (default: when ``stream`` is a terminal).
        compare: compare with the plan's prediction (False when the run is not on the
            plan's hardware: a rehearsal's ranks run on this machine's CPUs).
    """

    def __init__(
        self,
        plan: Plan,
        *,
        first_step: int,
        num_steps: int,
        stream: TextIO | None = None,
        interactive: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        compare: bool = True,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.batch = plan.global_batch_size
        self.predicted = plan.report.predicted_samples_per_s if compare else 0.0
        self.first_step, self.last_step = first_step, first_step + num_steps - 1
        self.clock = clock
        self.started_s = self.printed_s = clock()
        self.times_s: list[float] = []
        """Rank 0's time of each step of this run, in order."""
        self.loss: float | None = None
        self.printed_steps = 0
        """Steps done at the last plain line."""
        self.every_steps = max(1, math.ceil(num_steps * PROGRESS_EVERY_FRACTION))
        self.live = self._live() if self._interactive(interactive) else None

    def _interactive(self, asked: bool | None) -> bool:
        if asked is not None:
            return asked
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def _live(self) -> tuple[Progress, TaskID]:
        console = Console(file=self.stream, highlight=False)
        progress = Progress(
            TextColumn("step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("loss {task.fields[loss]} · {task.fields[rate]} samples/s · ETA"),
            TimeRemainingColumn(),
            console=console,
            refresh_per_second=2,
        )
        task = progress.add_task(
            "train", total=self.last_step + 1, completed=self.first_step, loss="-", rate="-"
        )
        progress.start()
        return progress, task

    # ----------------------------------------------------------------- feeding
    def step_done(self, step: int, step_time_s: float) -> None:
        """Step ``step`` took ``step_time_s`` on rank 0."""
        self.times_s.append(step_time_s)
        if self.live is not None:
            progress, task = self.live
            recent = self.times_s[-20:] if len(self.times_s) > 20 else self._timed(self.times_s)
            rate = self._rate(recent)
            progress.update(task, completed=step + 1, rate=_value(rate))

    def loss_known(self, step: int | None, loss: float | None) -> None:
        """The job's loss of ``step`` arrived (one step after it ran); maybe print a line."""
        if step is None or step < 0:
            return
        self.loss = loss
        if self.live is not None:
            progress, task = self.live
            progress.update(task, loss=_value(loss))
            return
        done = len(self.times_s)
        due = (
            self.printed_steps == 0
            or self.clock() - self.printed_s >= PROGRESS_EVERY_S
            or done - self.printed_steps >= self.every_steps
        )
        if step >= self.last_step or not due:
            return  # the last step's figures are the summary's
        window = self.times_s[max(1, self.printed_steps) :] or self.times_s[-1:]
        mean_s = _mean(self._timed(self.times_s)) or 0.0
        left = self.last_step + 1 - self.first_step - done
        fields: list[tuple[str, object]] = [
            ("step", f"{step + 1}/{self.last_step + 1}"),
            ("loss", loss),
            ("samples_per_s", self._rate(window)),
            ("step_time_s", _mean(window)),
            ("elapsed_s", self.clock() - self.started_s),
            ("eta_s", left * mean_s),
        ]
        self._print(format_line("progress", fields))
        self.printed_s, self.printed_steps = self.clock(), done

    # ----------------------------------------------------------------- ending
    def summary(self) -> str:
        """The summary line (class docstring); stops the live line and prints it."""
        self.close()
        timed = self._timed(self.times_s)
        rate = self._rate(timed)
        ratio = rate / self.predicted if rate is not None and self.predicted > 0 else None
        line = format_line(
            "summary",
            [
                ("steps", len(self.times_s)),
                ("timed_steps", len(timed)),
                ("samples_per_s", rate),
                ("step_time_s", _mean(timed)),
                ("final_loss", self.loss),
                ("predicted_samples_per_s", self.predicted if self.predicted > 0 else None),
                ("measured_over_predicted", ratio),
                ("elapsed_s", self.clock() - self.started_s),
            ],
        )
        self._print(line)
        return line

    def close(self) -> None:
        """Stop the live line (if any); idempotent."""
        if self.live is not None:
            self.live[0].stop()
            self.live = None

    # ----------------------------------------------------------------- helpers
    @staticmethod
    def _timed(times_s: list[float]) -> list[float]:
        """The steps after the run's first (warm-up), or the first when it is alone."""
        return times_s[1:] or times_s

    def _rate(self, times_s: Sequence[float]) -> float | None:
        mean_s = _mean(times_s)
        return self.batch / mean_s if mean_s is not None and mean_s > 0 else None

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None
