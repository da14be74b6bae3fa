"""A run's measured metrics against its plan's prediction: what ``hplan metrics`` prints.

The run is what ``--metrics-dir`` holds (``rank-<r>.jsonl``), read as ``hplan calibrate``
reads it (``profiling.calibrate.load_runs``). For every rank, the median over the steps
after each run's first (which warms up) of each part of a step: compute, wait (blocked in
receives: bubbles and transfers), point-to-point, all-reduce, optimizer, other (data,
Python), each also as its share of the rank's median step; the outer sync of local SGD /
async plans is the mean per step (it runs once a round). For the job: the median step time
(the slowest rank's, step by step; the mean when outer syncs ran, so that whole rounds
count) and samples/s, against the plan report's prediction. A rehearsal's emulated seconds
are divided by its recorded time scale (``emulation.json``): every figure is in seconds of
the plan's hardware.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich import box
from rich.console import JustifyMethod
from rich.table import Table

from hplan.planner.profiling.calibrate import Run, check_runs_of_plan, load_runs
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.metrics_file import (
    StepMetrics,
    has_outer_syncs,
    summarize_records,
    typical_step_time_s,
)
from hplan.runtime.contract.plan import Plan
from hplan.runtime.contract.quantities import MS_PER_S

PARTS = ("compute", "wait", "p2p", "allreduce", "outer_sync", "optimizer", "other")
"""The parts of a step, in the order they are shown (``StepMetrics.<part>_time_s``)."""
MEAN_PARTS = frozenset({"outer_sync"})
"""Parts shown as their mean per step, not their median: an outer sync (local SGD, async)
runs at one step in H, so its median is 0; the mean is its amortised cost per step."""
_HEADERS = {"p2p": "point-to-point", "allreduce": "all-reduce", "outer_sync": "outer sync"}


@dataclass(frozen=True, slots=True)
class RankBreakdown:
    """One rank's median step and its parts, in ms of the plan's hardware."""

    rank: int
    replica: int
    stage: int
    device: str | None
    """Its device in the plan (None without a plan)."""
    step_ms: float
    parts_ms: dict[str, float]
    """``PARTS`` -> median ms."""

    def share(self, part: str) -> float:
        """``part``'s median as a fraction of the median step (0 for an empty step)."""
        return self.parts_ms[part] / self.step_ms if self.step_ms > 0 else 0.0


@dataclass(frozen=True, slots=True)
class RunMetrics:
    """What ``hplan metrics`` shows about one or more runs of a plan."""

    runs: tuple[Path, ...]
    time_scales: tuple[float, ...]
    """Each run's seconds per second of the plan's hardware (1: a real run)."""
    num_steps: int
    """Steps measured, over every run."""
    timed_steps: int
    """Of those, the steps the medians are over (each run's first left out)."""
    ranks: tuple[RankBreakdown, ...]
    step_time_s: float
    """Median job step time (the slowest rank's step)."""
    samples_per_s: float
    """Samples per step / ``step_time_s``."""
    final_loss: float | None
    """The last step's loss over the global batch (the last run's)."""
    plan: Path | None = None
    predicted_step_time_s: float | None = None
    predicted_samples_per_s: float | None = None

    @property
    def ratio(self) -> float | None:
        """Measured / predicted samples/s (None without a prediction)."""
        predicted = self.predicted_samples_per_s
        return self.samples_per_s / predicted if predicted else None


def find_plan(runs_dir: Path, plan_path: Path | None) -> Path | None:
    """``plan_path``, else the ``plan.json`` a rehearsal wrote into ``runs_dir`` (or into
    its first run folder), else None."""
    if plan_path is not None:
        return plan_path
    for folder in (runs_dir, *sorted(p for p in runs_dir.glob("*") if p.is_dir())):
        if (folder / "plan.json").is_file():
            return folder / "plan.json"
    return None


def run_metrics(runs_dir: Path, plan_path: Path | None = None) -> RunMetrics:
    """Summarise the runs in ``runs_dir`` (module docstring), against ``plan_path`` (default:
    :func:`find_plan`) when there is a plan.

    Raises:
        ConfigError: no metrics; the runs are not runs of the plan; a run misses a rank.
        PlanFileError: the plan cannot be read.
    """
    return runs_metrics(load_runs(runs_dir), find_plan(runs_dir, plan_path))


def runs_metrics(runs: Sequence[Run], plan_path: Path | None) -> RunMetrics:
    """:func:`run_metrics` of runs already read, against ``plan_path`` (None: no plan).

    Raises:
        ConfigError: see :func:`run_metrics`.
        PlanFileError: the plan cannot be read.
    """
    plan = Plan.load(plan_path) if plan_path is not None else None
    if plan is not None:
        _check_ranks(plan, runs)
        check_runs_of_plan(plan, runs, "give the plan that ran (--plan PLAN)")
    ranks = sorted({r.rank for run in runs for r in run.records})
    step_s, samples_s, loss = _job_figures(runs)
    return RunMetrics(
        runs=tuple(run.path for run in runs),
        time_scales=tuple(run.time_scale for run in runs),
        num_steps=sum(len({r.step for r in run.records}) for run in runs),
        timed_steps=sum(max(1, len({r.step for r in run.records}) - 1) for run in runs),
        ranks=tuple(_breakdown(rank, runs, plan) for rank in ranks),
        step_time_s=step_s,
        samples_per_s=samples_s,
        final_loss=loss,
        plan=plan_path,
        predicted_step_time_s=plan.report.predicted_step_time_s if plan else None,
        predicted_samples_per_s=plan.report.predicted_samples_per_s if plan else None,
    )


def _check_ranks(plan: Plan, runs: Sequence[Run]) -> None:
    expected = {r.rank for r in plan.ranks}
    for run in runs:
        seen = {r.rank for r in run.records}
        if seen != expected:
            odd = sorted(seen ^ expected)
            raise ConfigError(
                f"{run.path} has metrics of ranks {sorted(seen)}, the plan runs "
                f"{sorted(expected)} (rank {odd[0]} differs); give the plan that ran "
                "(--plan), and a folder with every rank's rank-<r>.jsonl"
            )


def _timed(records: Sequence[StepMetrics]) -> list[StepMetrics]:
    """A rank's records of one run without its first step, unless that is all there is."""
    ordered = sorted(records, key=lambda r: r.step)
    return ordered[1:] or ordered


def _breakdown(rank: int, runs: Sequence[Run], plan: Plan | None) -> RankBreakdown:
    values: dict[str, list[float]] = {part: [] for part in ("step", *PARTS)}
    first: StepMetrics | None = None
    for run in runs:
        mine = [r for r in run.records if r.rank == rank]
        first = first or (mine[0] if mine else None)
        for record in _timed(mine):
            values["step"].append(record.step_time_s / run.time_scale)
            for part in PARTS:
                values[part].append(getattr(record, f"{part}_time_s") / run.time_scale)
    assert first is not None  # the rank came from the records
    medians = {
        part: (statistics.fmean(v) if part in MEAN_PARTS else statistics.median(v)) * MS_PER_S
        for part, v in values.items()
    }
    return RankBreakdown(
        rank=rank,
        replica=first.replica,
        stage=first.stage,
        device=plan.ranks[rank].device if plan is not None and rank < plan.world_size else None,
        step_ms=medians.pop("step"),
        parts_ms=medians,
    )


def _job_figures(runs: Sequence[Run]) -> tuple[float, float, float | None]:
    """(median job step time in plan seconds, samples/s, the last run's final loss)."""
    step_times_s: list[float] = []
    samples = 0
    loss = None
    for run in runs:
        steps = summarize_records(list(run.records)).steps
        if not steps:
            continue
        timed = steps[1:] or steps
        step_times_s += [s.step_time_s / run.time_scale for s in timed]
        samples, loss = steps[0].samples, steps[-1].loss
    if not step_times_s:
        raise ConfigError(
            f"no step that every rank reported in {', '.join(str(r.path) for r in runs)}; "
            "did the run end before its first step?"
        )
    rounds = any(has_outer_syncs(run.records) for run in runs)
    step_s = typical_step_time_s(step_times_s, rounds=rounds)
    return step_s, samples / step_s if step_s > 0 else 0.0, loss


# --------------------------------------------------------------------------- views
def breakdown_table(metrics: RunMetrics) -> Table:
    """The per-rank table: the median step and each part, in ms and as a share of it."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for header in ("rank", "device", "replica", "stage", "step ms", *PARTS):
        justify: JustifyMethod = "left" if header == "device" else "right"
        table.add_column(_HEADERS.get(header, header), justify=justify, no_wrap=True)
    for r in metrics.ranks:
        parts = [f"{r.parts_ms[p]:.1f} {100 * r.share(p):.0f}%" for p in PARTS]
        table.add_row(
            str(r.rank), r.device or "-", str(r.replica), str(r.stage), f"{r.step_ms:.1f}", *parts
        )
    return table


def summary_lines(metrics: RunMetrics) -> list[str]:
    """The lines around the table: what was read, the legend, measured vs predicted."""
    scales = sorted(set(metrics.time_scales))
    units = (
        "ms of the run's wall clock"
        if scales == [1.0]
        else "ms of the plan's hardware (the rehearsal's emulated times divided by its time "
        f"scale {', '.join(f'{s:g}' for s in scales)})"
    )
    runs = ", ".join(str(p) for p in metrics.runs)
    lines = [
        f"{runs}: {metrics.num_steps} steps, medians over {metrics.timed_steps} "
        f"(each run's first step left out); {units}, and share of the rank's median step",
    ]
    loss = "-" if metrics.final_loss is None else f"{metrics.final_loss:.4g}"
    measured = (
        f"measured   {metrics.samples_per_s:.1f} samples/s · "
        f"{metrics.step_time_s * MS_PER_S:.1f} ms per step · final loss {loss}"
    )
    lines.append(measured)
    if metrics.predicted_samples_per_s is None or metrics.predicted_step_time_s is None:
        lines.append("predicted  - (no plan: give --plan plan.json)")
        return lines
    if metrics.predicted_samples_per_s <= 0:
        lines.append(f"predicted  - ({metrics.plan} predicts no throughput)")
        return lines
    ratio = metrics.ratio
    lines.append(
        f"predicted  {metrics.predicted_samples_per_s:.1f} samples/s · "
        f"{metrics.predicted_step_time_s * MS_PER_S:.1f} ms per step ({metrics.plan})"
        + ("" if ratio is None else f" · measured/predicted {ratio:.2f}x")
    )
    return lines


def metrics_json(metrics: RunMetrics) -> dict[str, object]:
    """JSON-native view of :class:`RunMetrics` (``hplan metrics --json``), times in seconds."""
    return {
        "runs": [str(p) for p in metrics.runs],
        "time_scales": list(metrics.time_scales),
        "plan": None if metrics.plan is None else str(metrics.plan),
        "num_steps": metrics.num_steps,
        "timed_steps": metrics.timed_steps,
        "step_time_s": metrics.step_time_s,
        "samples_per_s": metrics.samples_per_s,
        "final_loss": metrics.final_loss,
        "predicted_step_time_s": metrics.predicted_step_time_s,
        "predicted_samples_per_s": metrics.predicted_samples_per_s,
        "measured_over_predicted": metrics.ratio,
        "ranks": [
            {
                "rank": r.rank,
                "replica": r.replica,
                "stage": r.stage,
                "device": r.device,
                "step_time_s": r.step_ms / MS_PER_S,
                **{f"{p}_time_s": r.parts_ms[p] / MS_PER_S for p in PARTS},
                **{f"{p}_share": r.share(p) for p in PARTS},
            }
            for r in metrics.ranks
        ],
    }
