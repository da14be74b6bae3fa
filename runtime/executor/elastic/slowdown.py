"""A node that slows: detect it from the segment's own metrics, re-plan with the measured
speeds, and restart under the new plan when that pays.

Plan rank 0 of an elastic segment reads, every few seconds, the tail of every rank's
``rank-<r>.jsonl`` in the segment's metrics folder (every rank flushes a line per step; the
folder is shared): no collective is added. Per rank it keeps a baseline, the median compute
seconds per sample over :data:`SPEED_WINDOW_STEPS` steps after :data:`WARMUP_STEPS` of warm-up, and
compares the median of the last :data:`SPEED_WINDOW_STEPS` with it. A rank whose compute per sample
rose more than :data:`SLOW_THRESHOLD` over its baseline (beyond the least changed rank's rise),
in :data:`CONFIRM_POLLS` windows in a row, while the job's step (rank 0's spacing of step ends,
the real throughput) is more than :data:`JOB_THRESHOLD` above its own baseline, is slowed:
the share balancing (``control/rebalance.py``) did not absorb it.

Then, in a background thread (training goes on): the recent window of each rank written as
a runs folder, ``hplan calibrate`` (a corrected profile with the slowed device's factor) and
``hplan replan --profile`` for the same members, both as child processes of the planner's own
command (the runtime never imports the planner). The re-plan is taken when its gain over
the rest of the run beats the restart's cost (:func:`decide_restart`); the job then stops at
a checkpoint (``StepFlags.REPLAN``) and torchrun's agents restart it under the new plan.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hplan.runtime.contract.elastic import (
    PlanFamily,
    SharedRunDir,
    calibration_command,
    members_key,
    read_segments,
    replan_command,
)
from hplan.runtime.contract.errors import HplanError, error_reason
from hplan.runtime.contract.metrics_file import (
    StepMetrics,
    metrics_line,
    metrics_path,
    parse_metrics_line,
)
from hplan.runtime.contract.plan import Plan

__all__ = [
    "DEFAULT_RESTART_COST_S",
    "JOB_THRESHOLD",
    "POLL_S",
    "SLOW_THRESHOLD",
    "SPEED_WINDOW_STEPS",
    "WARMUP_STEPS",
    "RankSpeed",
    "Replan",
    "Replanner",
    "RestartDecision",
    "Slowdown",
    "SpeedWatch",
    "decide_restart",
    "detect_slowdown",
    "plan_step_measured_s",
    "read_tail",
    "restart_cost_s",
]

WARMUP_STEPS = 10
"""A segment's first steps, left out of its baselines (caches, allocator, first shares)."""
SPEED_WINDOW_STEPS = 20
"""Steps in a baseline and in a recent window: a median over them ignores a few slow steps
(a checkpoint save, an outer sync), so a rank is slowed only when most of them are."""
SLOW_THRESHOLD = 0.30
"""A rank's compute per sample this much above its baseline is off its speed."""
JOB_THRESHOLD = 0.10
"""The job's step this much above its baseline: the share balancing did not absorb it."""
POLL_S = 3.0
"""How often plan rank 0 reads the ranks' metrics."""
CONFIRM_POLLS = 2
"""Polls in a row (windows apart) that must find a rank slowed before the job re-plans: a
rank that stays off, not a burst of other work on its machine."""
DEFAULT_RESTART_COST_S = 20.0
"""A restart's cost when the run has not measured one yet (its segments' ``downtime_s``)."""
TAIL_BYTES = 64 * 1024
"""How much of the end of a rank's file a poll reads (a line is under 1 kB)."""
REPLAN_TIMEOUT_S = 600.0
CALIBRATED_FILE = "calibrated.json"
"""What ``hplan calibrate -o DIR`` writes in DIR."""
CRITICAL_SHARE = 0.8
"""A slowed rank counts when its compute a step is at least this share of the busiest
rank's: it is on the job's critical path (a rank the shares left with little work slows
nothing)."""


@dataclass(frozen=True, slots=True)
class RankSpeed:
    """One rank's compute seconds per sample, at the baseline and now."""

    rank: int
    baseline_s: float
    recent_s: float

    @property
    def factor(self) -> float:
        """Its speed now relative to the baseline (0.5: half as fast)."""
        return self.baseline_s / self.recent_s if self.recent_s > 0 else math.inf


@dataclass(frozen=True, slots=True)
class Slowdown:
    """Ranks whose speed stayed off their baseline, and the job's step then."""

    ranks: tuple[RankSpeed, ...]
    """Off by more than the threshold, slowest first."""
    job_baseline_s: float
    job_recent_s: float
    """The job's step time (seconds), at the baseline and now."""

    def describe(self, nodes: Mapping[int, str]) -> str:
        """``c 0.52x`` for each slowed rank (its node)."""
        return ", ".join(f"{nodes.get(r.rank, r.rank)} {r.factor:.2f}x" for r in self.ranks)


def _per_sample_s(records: Sequence[StepMetrics]) -> float:
    return statistics.median(r.compute_time_s / max(r.samples, 1) for r in records)


def job_step_s(records: Sequence[StepMetrics]) -> float:
    """The job's step time over ``records`` (one rank's, consecutive): the spacing of their
    ends (every per-step overhead and wait included), else the median step time."""
    ordered = sorted(records, key=lambda r: r.step)
    first, last = ordered[0], ordered[-1]
    if len(ordered) > 1 and first.end_unix_time_s > 0 and last.step > first.step:
        return (last.end_unix_time_s - first.end_unix_time_s) / (last.step - first.step)
    return statistics.median(r.step_time_s for r in ordered)


def detect_slowdown(
    baseline: Mapping[int, Sequence[StepMetrics]],
    recent: Mapping[int, Sequence[StepMetrics]],
    *,
    job_rank: int = 0,
    threshold: float = SLOW_THRESHOLD,
    job_threshold: float = JOB_THRESHOLD,
) -> Slowdown | None:
    """The ranks slowed between ``baseline`` and ``recent`` (each {rank: its records}), or
    None: no rank's compute per sample rose more than ``threshold``, or the job's step
    (``job_rank``'s) did not rise more than ``job_threshold`` (the shares absorbed it).

    A rank's change counts relative to the least changed rank's, so that what slows every
    rank alike (the machine, the data) is no rank's slowdown and a re-plan could not help;
    and only on the job's critical path (its compute a step at least :data:`CRITICAL_SHARE`
    of the busiest rank's).
    """
    if job_rank not in baseline or job_rank not in recent:
        return None
    job_baseline_s = job_step_s(baseline[job_rank])
    job_recent_s = job_step_s(recent[job_rank])
    if not job_recent_s > job_baseline_s * (1 + job_threshold):
        return None
    speeds = [
        RankSpeed(rank, _per_sample_s(baseline[rank]), _per_sample_s(records))
        for rank, records in sorted(recent.items())
        if records and baseline.get(rank)
    ]
    if not speeds:
        return None
    least = min(s.recent_s / s.baseline_s for s in speeds if s.baseline_s > 0)
    busy_s = {rank: statistics.median(r.compute_time_s for r in recent[rank]) for rank in recent}
    critical_s = CRITICAL_SHARE * max(busy_s.values())
    slowed = [
        s
        for s in speeds
        if s.recent_s > s.baseline_s * least * (1 + threshold) and busy_s[s.rank] >= critical_s
    ]
    if not slowed:
        return None
    slowed.sort(key=lambda s: s.factor)
    return Slowdown(tuple(slowed), job_baseline_s, job_recent_s)


def plan_step_measured_s(plan: Plan, recent: Mapping[int, Sequence[StepMetrics]]) -> float:
    """``plan``'s predicted step with its bottleneck's compute replaced by the slowest rank's
    measured compute (median of ``recent``, per step): the old plan in the units the
    calibrated profile predicts the new one (measured compute, modelled communication), so
    that their ratio is the model's gain without the model's error on this machine.
    """
    busy_s = max((r.busy_time_s for r in plan.report.ranks), default=0.0)
    measured_s = max(
        statistics.median(r.compute_time_s for r in records) for records in recent.values()
    )
    return max(plan.report.predicted_step_time_s - busy_s, 0.0) + measured_s


@dataclass(frozen=True, slots=True)
class RestartDecision:
    """Whether restarting under a re-plan pays over the rest of the run."""

    measured_step_s: float
    """The job's step now (seconds)."""
    predicted_step_s: float
    """The job's step under the new plan (seconds, on this machine)."""
    steps_left: int
    cost_s: float

    @property
    def gain_s(self) -> float:
        """Seconds the new plan saves over the steps left (negative: it loses)."""
        return (self.measured_step_s - self.predicted_step_s) * self.steps_left

    @property
    def restart(self) -> bool:
        return self.gain_s > self.cost_s

    def describe(self) -> str:
        """The numbers behind it, one clause."""
        return (
            f"step {self.measured_step_s * 1e3:.1f} ms measured, {self.predicted_step_s * 1e3:.1f}"
            f" ms under the new plan (predicted), {self.steps_left} steps left: gain "
            f"{self.gain_s:.1f} s against a restart's {self.cost_s:.1f} s"
        )


def decide_restart(
    *,
    measured_step_s: float,
    predicted_step_s: float,
    old_predicted_step_s: float | None = None,
    steps_left: int,
    cost_s: float,
) -> RestartDecision:
    """Restart when (measured step - the new plan's step) x steps left exceeds ``cost_s``
    (the downtime of a restart; the stop saves a checkpoint, so no step is redone).

    Args:
        measured_step_s: the job's step now.
        predicted_step_s: the new plan's predicted step (its report).
        old_predicted_step_s: the old plan's step in the same units
            (:func:`plan_step_measured_s`): the new plan's step on this machine is then
            ``measured_step_s x predicted / old_predicted`` (None: ``predicted_step_s`` as is).
    """
    if old_predicted_step_s is not None and old_predicted_step_s > 0:
        predicted_step_s = measured_step_s * predicted_step_s / old_predicted_step_s
    return RestartDecision(measured_step_s, predicted_step_s, max(steps_left, 0), cost_s)


def restart_cost_s(metrics_root: Path | None) -> float:
    """A restart's cost in this run: the newest downtime its segments measured, else
    :data:`DEFAULT_RESTART_COST_S`."""
    if metrics_root is None or not metrics_root.is_dir():
        return DEFAULT_RESTART_COST_S
    measured = [r.downtime_s for _, r in read_segments(metrics_root) if r.downtime_s is not None]
    return measured[-1] if measured else DEFAULT_RESTART_COST_S


def read_tail(path: Path, max_bytes: int = TAIL_BYTES) -> list[StepMetrics]:
    """The complete records in the last ``max_bytes`` of a ``rank-<r>.jsonl`` (none: no
    file yet); lines that do not parse are skipped (a reader never stops the run)."""
    try:
        with path.open("rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - max_bytes))
            data = handle.read()
    except OSError:
        return []
    lines = data.split(b"\n")
    if size > max_bytes:
        lines = lines[1:]  # the first is cut
    records = []
    for line in lines[:-1]:  # the last has no newline yet (or is empty)
        try:
            records.append(parse_metrics_line(line.decode("utf-8")))
        except (ValueError, TypeError):
            continue
    return records


class SpeedWatch:
    """Plan rank 0's view of the segment's ranks' speeds (module docstring).

    Args:
        metrics_dir: the segment's metrics folder (its ranks' ``rank-<r>.jsonl``).
        ranks: the plan's ranks.
        first_step: the step the segment resumed at.
    """

    def __init__(self, metrics_dir: Path, ranks: Sequence[int], first_step: int) -> None:
        self.metrics_dir = metrics_dir
        self.ranks = tuple(ranks)
        self.first_step = first_step
        self._baseline: dict[int, list[StepMetrics]] | None = None
        self.recent: dict[int, list[StepMetrics]] = {}
        """The last window read (what a re-plan calibrates with)."""
        self._seen = 0
        """Polls in a row that found a slowdown."""
        self._last_window = -1

    def _window(self, start: int) -> range:
        return range(start, start + SPEED_WINDOW_STEPS)

    def poll(self, steps_done: int) -> Slowdown | None:
        """Read the ranks' files; the slowdown, if any (None also before the windows are full)."""
        baseline_steps = self._window(self.first_step + WARMUP_STEPS)
        if steps_done < baseline_steps.stop + SPEED_WINDOW_STEPS:
            return None  # the recent window must not overlap the baseline
        if self._baseline is None:
            self._baseline = self._read(baseline_steps, whole=True)
            if self._baseline is None:
                return None
        tails = {r: read_tail(metrics_path(self.metrics_dir, r)) for r in self.ranks}
        if not all(tails.values()):
            return None
        newest = min(max(rec.step for rec in records) for records in tails.values())
        steps = self._window(newest - SPEED_WINDOW_STEPS + 1)  # the newest steps every rank wrote
        if steps.start < baseline_steps.stop:
            return None
        recent = {r: [rec for rec in records if rec.step in steps] for r, records in tails.items()}
        if any(len(records) < SPEED_WINDOW_STEPS for records in recent.values()):
            return None
        self.recent = recent
        slowdown = detect_slowdown(self._baseline, recent)
        if steps.start > self._last_window:  # a new window: another confirmation
            self._seen = self._seen + 1 if slowdown is not None else 0
            self._last_window = steps.stop - 1
        return slowdown if self._seen >= CONFIRM_POLLS else None

    def _read(self, steps: range, *, whole: bool) -> dict[int, list[StepMetrics]] | None:
        """Each rank's records of ``steps`` (None: a rank has not written them all yet)."""
        found = {}
        for rank in self.ranks:
            path = metrics_path(self.metrics_dir, rank)
            records = read_tail(path, max_bytes=1 << 40 if whole else TAIL_BYTES)
            window = [r for r in records if r.step in steps]
            if len(window) < len(steps):
                return None
            found[rank] = window
        return found


@dataclass(frozen=True)
class Replan:
    """A plan solved with the measured speeds."""

    plan_path: Path
    plan: Plan
    slowdown: Slowdown

    @property
    def predicted_step_s(self) -> float:
        return self.plan.report.predicted_step_time_s


class Replanner:
    """At most one re-plan at a time, in a background thread (module docstring).

    Args:
        family: the run's plan family; ``family_dir`` its folder.
        shared: the run's shared folder (the plan is solved under its ``plans/``).
        members: the segment's nodes.
        plan_path: the segment's plan (the calibration's reference).
    """

    def __init__(
        self,
        family: PlanFamily,
        family_dir: Path,
        shared: SharedRunDir,
        members: Sequence[str],
        plan_path: Path,
    ) -> None:
        self.family = family
        self.family_dir = family_dir
        self.shared = shared
        self.members = tuple(members)
        self.plan_path = plan_path
        self._thread: threading.Thread | None = None
        self._result: Replan | str | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def begin(self, slowdown: Slowdown, recent: Mapping[int, Sequence[StepMetrics]]) -> None:
        """Start solving with ``recent`` (each rank's window of records)."""
        assert not self.running
        self._result = None
        out = self._out_dir()
        self._thread = threading.Thread(
            target=self._solve, args=(slowdown, dict(recent), out), name="hplan-replan", daemon=True
        )
        self._thread.start()

    def take(self) -> Replan | str | None:
        """The finished re-plan, or why it failed (one line); None while running or idle."""
        if self.running:
            return None
        result, self._result = self._result, None
        return result

    def _out_dir(self) -> Path:
        key = members_key(self.members)
        n = 1
        while (self.shared.plans_dir / f"{key}-r{n}").exists():
            n += 1
        return self.shared.plans_dir / f"{key}-r{n}"

    def _solve(self, slowdown: Slowdown, recent: dict[int, list[StepMetrics]], out: Path) -> None:
        try:
            self._result = self._solved(slowdown, recent, out)
        except (HplanError, OSError, subprocess.SubprocessError) as exc:
            self._result = error_reason(exc)

    def _solved(
        self, slowdown: Slowdown, recent: dict[int, list[StepMetrics]], out: Path
    ) -> Replan | str:
        measured = out / "measured"
        measured.mkdir(parents=True, exist_ok=True)
        for rank, records in recent.items():
            text = "".join(metrics_line(r) for r in records)
            metrics_path(measured, rank).write_text(text, encoding="utf-8")
        calibrated = out / "calibrated"
        log = out / "replan.log"
        profiles = solved_with(self.plan_path, self.family, self.family_dir)
        command = calibration_command(self.plan_path, measured, calibrated, profiles=profiles)
        failed = _run(command, log)
        if failed is not None:
            return f"calibrate: {failed}"
        profile = calibrated / CALIBRATED_FILE
        plan_dir = out / "plan"
        command = replan_command(
            self.family_dir, self.family, self.members, plan_dir, profile=profile
        )
        failed = _run(command, log)
        if failed is not None:
            return f"replan: {failed}"
        plan_file = plan_dir / "plan.json"
        return Replan(plan_file, Plan.load(plan_file), slowdown)


def solved_with(plan_path: Path, family: PlanFamily, family_dir: Path) -> tuple[Path, ...]:
    """The profiles ``plan_path`` was solved with: the calibrated one of a plan re-planned
    during the run (``<out>/plan/plan.json`` beside ``<out>/calibrated/calibrated.json``),
    else the family's solve's own (``--profile``; none: the catalog's estimates)."""
    profile = plan_path.parent.parent / "calibrated" / CALIBRATED_FILE
    if profile.is_file():
        return (profile,)
    return tuple(family_dir / path for path in family.replan_files.get("--profile", ()))


def _run(command: list[str], log: Path) -> str | None:
    """Run a planner command, its output appended to ``log``; None, or its last line of
    error."""
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=REPLAN_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return f"took longer than {REPLAN_TIMEOUT_S:g} s"
    with log.open("a", encoding="utf-8") as out:
        out.write(f"$ {' '.join(command)}\n{done.stdout}{done.stderr}\n")
    if done.returncode == 0:
        return None
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else f"exited {done.returncode}"
