"""An elastic run's segments, each against its own plan: what ``hplan metrics`` prints for a
metrics folder of ``segment-<NNN>/`` folders.

An elastic run (``hplan solve --elastic``) restarts under another plan when a node is lost,
joins or slows. Each (re)start that trained wrote, into one ``--metrics-dir``,
``segment-<NNN>/segment.json`` (``contract.elastic.SegmentRecord``: its cause, nodes, plan,
prediction and the restart before it), a copy of its ``plan.json`` and its ranks'
``rank-<r>.jsonl``. Each segment is summarised as one run of its own plan
(:func:`run_metrics.runs_metrics`: the same figures as a single run's); a segment with no
step measured is shown as such. Between segments, the restart: its downtime and the steps
redone, as the segment record gives them, else as the metrics show them (from the previous
segment's last step end to this one's first; the previous segment's steps at or past this
one's first step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from rich import box
from rich.console import JustifyMethod
from rich.table import Table

from hplan.planner.emit.run_metrics import RunMetrics, metrics_json, runs_metrics
from hplan.planner.profiling.calibrate import Run, load_runs
from hplan.runtime.contract.elastic import SegmentRecord, read_segments
from hplan.runtime.contract.errors import ConfigError, HplanError
from hplan.runtime.contract.metrics_file import StepMetrics

NO_RANK_FILES = "no rank files"
NO_STEPS = "no step measured (its rank files are empty)"


@dataclass(frozen=True, slots=True)
class SegmentMetrics:
    """One segment of an elastic run: its record and what its ranks measured."""

    folder: Path
    record: SegmentRecord
    metrics: RunMetrics | None
    """Its ranks' figures against its plan (None: nothing to summarise; ``missing`` says
    why)."""
    missing: str | None
    """Why there are no figures (no rank files, no step, or the one-line error)."""
    first_step: int | None
    """The first step any of its ranks measured (None: none)."""
    last_step: int | None
    first_end_unix_s: float | None
    """When its first measured step ended (None: not recorded)."""
    last_end_unix_s: float | None
    """When its last measured step ended (None: not recorded)."""
    downtime_s: float | None = None
    """The restart before it: the record's, else measured (None: the first segment, or
    unknown)."""
    steps_redone: int | None = None
    """The restart before it: the record's, else measured (None: first, or unknown)."""

    @property
    def predicted_samples_per_s(self) -> float | None:
        """The record's prediction, else its plan's (None: neither gives one)."""
        if self.record.predicted_samples_per_s is not None:
            return self.record.predicted_samples_per_s
        return None if self.metrics is None else self.metrics.predicted_samples_per_s

    @property
    def ratio(self) -> float | None:
        """Measured / predicted samples/s (None: either is missing)."""
        predicted = self.predicted_samples_per_s
        if self.metrics is None or not predicted:
            return None
        return self.metrics.samples_per_s / predicted


def segment_metrics(metrics_dir: Path, plan_path: Path | None = None) -> tuple[SegmentMetrics, ...]:
    """Every segment of the elastic run in ``metrics_dir``, in order, with the restarts
    between them; () when ``metrics_dir`` holds no segments (not an elastic run's).

    Args:
        plan_path: ``--plan``, refused for an elastic run (each segment has its own plan).

    Raises:
        ConfigError: ``plan_path`` given for an elastic run's folder.
    """
    found = read_segments(metrics_dir)
    if found and plan_path is not None:
        raise ConfigError(
            f"--plan {str(plan_path)!r}: {str(metrics_dir)!r} holds an elastic run's segments, "
            "each with its own plan.json; leave --plan out, or give one segment's folder "
            f"({found[-1][0]}) with it"
        )
    segments: list[SegmentMetrics] = []
    for folder, record in found:
        segment = _segment(folder, record)
        previous = segments[-1] if segments else None
        segments.append(_with_restart(segment, previous))
    return tuple(segments)


def _segment(folder: Path, record: SegmentRecord) -> SegmentMetrics:
    runs, missing = _runs(folder)
    records = [r for run in runs for r in run.records]
    metrics = None
    if missing is None:
        plan = folder / "plan.json"
        try:
            metrics = runs_metrics(runs, plan if plan.is_file() else None)
        except HplanError as exc:
            missing = str(exc)
    steps = [r.step for r in records]
    ends = [r.end_unix_time_s for r in records if r.end_unix_time_s > 0]
    return SegmentMetrics(
        folder=folder,
        record=record,
        metrics=metrics,
        missing=missing,
        first_step=min(steps, default=None),
        last_step=max(steps, default=None),
        first_end_unix_s=_first_step_end(records),
        last_end_unix_s=max(ends, default=None),
    )


def _runs(folder: Path) -> tuple[tuple[Run, ...], str | None]:
    """The segment's metrics as one run (none: why)."""
    if not any(folder.glob("rank-*.jsonl")):
        return (), NO_RANK_FILES
    try:
        runs = load_runs(folder)
    except HplanError as exc:
        return (), str(exc)
    if not any(run.records for run in runs):
        return runs, NO_STEPS
    return runs, None


def _first_step_end(records: Sequence[StepMetrics]) -> float | None:
    """When the segment's first step ended on its last rank to end it (None: unrecorded)."""
    if not records:
        return None
    first = min(r.step for r in records)
    ends = [r.end_unix_time_s for r in records if r.step == first and r.end_unix_time_s > 0]
    return max(ends, default=None)


def _with_restart(segment: SegmentMetrics, previous: SegmentMetrics | None) -> SegmentMetrics:
    """``segment`` with the restart before it: the record's figures, else measured."""
    if previous is None:
        return segment
    downtime_s = segment.record.downtime_s
    first_end_s, last_end_s = segment.first_end_unix_s, previous.last_end_unix_s
    if downtime_s is None and first_end_s is not None and last_end_s is not None:
        downtime_s = max(0.0, first_end_s - last_end_s)
    redone = segment.record.steps_redone
    if redone is None and previous.last_step is not None:
        redone = max(0, previous.last_step + 1 - segment.record.first_step)
    return replace(segment, downtime_s=downtime_s, steps_redone=redone)


def latest_measured(segments: Sequence[SegmentMetrics]) -> SegmentMetrics | None:
    """The last segment with figures (None: no segment measured a step)."""
    return next((s for s in reversed(segments) if s.metrics is not None), None)


# --------------------------------------------------------------------------- views
_COLUMNS = ("segment", "cause", "nodes", "ranks", "steps", "samples/s", "predicted", "ratio")


def segments_table(segments: Sequence[SegmentMetrics]) -> Table:
    """One row per segment (cause, nodes, ranks, steps, measured against predicted
    samples/s), and between two rows the restart (downtime, steps redone)."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for header in _COLUMNS:
        justify: JustifyMethod = "left" if header in ("cause", "nodes") else "right"
        table.add_column(header, justify=justify, no_wrap=True)
    for index, segment in enumerate(segments):
        if index > 0:
            table.add_row("", restart_text(segment), *[""] * (len(_COLUMNS) - 2), style="dim")
        table.add_row(*_row(segment))
    return table


def restart_text(segment: SegmentMetrics) -> str:
    """``restart: 7.1 s down, 2 steps redone`` (``?`` where unknown)."""
    down = "?" if segment.downtime_s is None else f"{segment.downtime_s:.1f}"
    redone = "?" if segment.steps_redone is None else str(segment.steps_redone)
    return f"restart: {down} s down, {redone} steps redone"


def _row(segment: SegmentMetrics) -> list[str]:
    record = segment.record
    predicted = segment.predicted_samples_per_s
    ratio = segment.ratio
    steps = "-" if segment.first_step is None else f"{segment.first_step}..{segment.last_step}"
    return [
        f"{record.segment:03d}",
        record.cause,
        "+".join(record.members),
        str(record.world_size),
        steps,
        _measured_text(segment),
        "-" if predicted is None else f"{predicted:.1f}",
        "-" if ratio is None else f"{ratio:.2f}x",
    ]


def _measured_text(segment: SegmentMetrics) -> str:
    if segment.metrics is not None:
        return f"{segment.metrics.samples_per_s:.1f}"
    short = {NO_RANK_FILES: NO_RANK_FILES, NO_STEPS: "no step measured"}
    return short.get(segment.missing or "", "none (see below)")


def segments_lines(metrics_dir: Path, segments: Sequence[SegmentMetrics]) -> list[str]:
    """The line above the table, and below it why a segment has no figures."""
    lines = [
        f"{metrics_dir}: an elastic run, {len(segments)} segment(s) (one per (re)start that "
        "trained); each segment's samples/s against its own plan's prediction"
    ]
    for segment in segments:
        if segment.missing not in (None, NO_RANK_FILES, NO_STEPS):
            lines.append(f"segment {segment.record.segment:03d}: {segment.missing}")
    return lines


def segments_json(metrics_dir: Path, segments: Sequence[SegmentMetrics]) -> dict[str, object]:
    """JSON-native view of the segments (``hplan metrics --json`` on an elastic run)."""
    return {
        "metrics_dir": str(metrics_dir),
        "segments": [_segment_json(s) for s in segments],
    }


def _segment_json(segment: SegmentMetrics) -> dict[str, object]:
    record = segment.record
    metrics = segment.metrics
    return {
        "segment": record.segment,
        "folder": str(segment.folder),
        "cause": record.cause,
        "members": list(record.members),
        "world_size": record.world_size,
        "plan_path": record.plan_path,
        "plan_digest": record.plan_digest,
        "first_step": segment.first_step,
        "last_step": segment.last_step,
        "samples_per_s": None if metrics is None else metrics.samples_per_s,
        "predicted_samples_per_s": segment.predicted_samples_per_s,
        "measured_over_predicted": segment.ratio,
        "downtime_s": segment.downtime_s,
        "steps_redone": segment.steps_redone,
        "missing": segment.missing,
        "metrics": None if metrics is None else metrics_json(metrics),
    }
