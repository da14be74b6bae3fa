"""Per-rank, per-step metrics as JSON lines, and a summary of a metrics directory.

Each rank appends one :class:`StepMetrics` per optimizer step to ``<dir>/rank-<r>.jsonl``.
Times are wall-clock seconds measured on that rank; they split the step as

``step = compute + p2p + wait + all-reduce + optimizer + outer sync + other``

(each field's docstring says what it counts). Fields added after the first version default
to 0 or None, so that older metrics still read. A rehearsal's metrics folder also holds its
emulation record (``emulation.json``, :class:`EmulationRecord`). This module needs no torch.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from functools import cache
from pathlib import Path
from typing import Annotated, Final, Literal

from pydantic import Field, TypeAdapter

from hplan.runtime.contract.cpus import quota_binds
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.versioned_file import parse_versioned, record


class MemoryMeasure(StrEnum):
    """How a rank measured its memory (``StepMetrics.memory_measure``)."""

    CUDA_ALLOCATED = "cuda_allocated"
    """``torch.cuda.max_memory_allocated`` since its peak was reset before the build, over
    ``torch.cuda.memory_allocated`` then (tensors only: no CUDA context, no allocator cache)."""
    RSS_HIGH_WATER = "rss_high_water"
    """Linux: the resident-set high-water mark (``VmHWM``) since it was reset (``5`` written
    to ``/proc/self/clear_refs``) before the build, over the resident set (``VmRSS``) then."""
    RSS_LIFETIME_PEAK = "rss_lifetime_peak"
    """Where the high-water mark cannot be reset (not Linux): the process's lifetime
    resident-set peak (``ru_maxrss``), now and before the build. An underestimate when the
    process peaked higher before its build (while importing) than it held at the build."""


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """What one rank measured in one optimizer step."""

    rank: int
    replica: int
    stage: int
    step: int
    step_time_s: float
    """The step's wall time: the sum of the six parts below and ``outer_sync_time_s``."""
    compute_time_s: float
    """Forward and backward passes (in emulation, including the stretch that slows this rank
    to its device's speed)."""
    p2p_time_s: float
    """Posting and completing point-to-point sends, and emulated link delays."""
    wait_time_s: float
    """Blocked in point-to-point receives, waiting for a peer (pipeline bubbles and transfer
    time show up here)."""
    allreduce_time_s: float
    """Blocked in gradient all-reduces after the schedule: the part the backward pass did not
    hide (waiting for the slowest holder included), plus clipping's gradient-norm sum and,
    under ZeRO stage 1, the all-gather of the updated shards."""
    optimizer_time_s: float
    """The optimizer step."""
    other_time_s: float
    """The rest (data loading, Python overhead)."""
    loss: float | None
    """Mean loss over this replica's samples (last stages only; None elsewhere)."""
    samples: int
    """Samples this rank's replica processed in the step."""
    peak_memory_bytes: int
    """Peak memory from just before the stage was built to the end of this step: on CPU the
    resident-set high-water mark, on a GPU ``torch.cuda.max_memory_allocated``
    (``memory_measure``; in metrics without a baseline, on CPU, the process's lifetime
    peak)."""
    forward_time_s: float = 0.0
    """The forward part of ``compute_time_s`` (0: not recorded)."""
    grad_norm: float | None = None
    """Global gradient L2 norm before clipping (``MAX_GRAD_NORM`` only; None: no clipping,
    or not recorded)."""
    end_unix_time_s: float = 0.0
    """Wall-clock Unix time at the end of the step (after its optimizer step): the spacing of
    consecutive steps is the real throughput, every per-step overhead included (0: not
    recorded)."""
    allreduce_overlapped_time_s: float = 0.0
    """Gradient all-reduce running beside the last backward pass, from the first bucket's
    launch to the end of the schedule; outside the step's sum (0: none, or not recorded)."""
    outer_sync_time_s: float = 0.0
    """Waited for cross-island outer syncs (``local_sgd``, ``async``) after the optimizer
    step (``executor/outer/outer_sync.py``): exposed time, part of the step's sum; an ``async``
    all-reduce running beside the steps counts only when a sync point waited for it (0:
    none, or not recorded)."""
    baseline_memory_bytes: int | None = None
    """Memory the process held just before its stage was built: on CPU its resident set (the
    interpreter, torch, hplan and the process groups), on a GPU what the caching allocator
    had allocated, usually 0 (None: not recorded)."""
    memory_measure: MemoryMeasure | None = None
    """How ``baseline_memory_bytes`` and ``peak_memory_bytes`` were measured (None: not
    recorded)."""
    compute_cpu_time_s: float = 0.0
    """CPU seconds (every thread of the process) the forwards and backwards used (0: not
    recorded, or a GPU rank)."""
    optimizer_cpu_time_s: float = 0.0
    """CPU seconds the optimizer step used (0: not recorded, or a GPU rank)."""
    cpu_time_s: float = 0.0
    """CPU seconds the process used in the whole step, communication threads included
    (0: not recorded)."""
    cpu_quota_cores: float | None = None
    """This rank's share of its cgroup's CPU quota, in cores (the quota over the plan's
    ranks on its node; ``contract/cpus.py``); None: no quota."""
    num_threads: int = 0
    """torch intra-op threads the rank ran (0: not recorded). A quota below it binds: the
    rank's sustained compute time is its CPU time over the quota
    (``profiling/windows.sustained``)."""

    def sustained_s(self, wall_s: float, cpu_s: float) -> float:
        """A CPU block's sustained seconds: ``cpu_s / cpu_quota_cores`` where this rank's quota
        binds (below its threads) and the CPU time was recorded, else ``wall_s``."""
        quota = self.cpu_quota_cores
        if quota is not None and quota_binds(quota, self.num_threads) and cpu_s > 0:
            return cpu_s / quota
        return wall_s

    @property
    def training_memory_bytes(self) -> int | None:
        """``peak_memory_bytes - baseline_memory_bytes`` (>= 0): what the stage, its optimizer
        and its steps added to the process; None without a baseline."""
        if self.baseline_memory_bytes is None:
            return None
        return max(0, self.peak_memory_bytes - self.baseline_memory_bytes)


def metrics_path(metrics_dir: Path, rank: int) -> Path:
    """``<metrics_dir>/rank-<rank>.jsonl``."""
    return metrics_dir / f"rank-{rank}.jsonl"


def check_fresh_metrics_dir(metrics_dir: Path, ranks: Sequence[int]) -> None:
    """Refuse a metrics folder that already holds metrics of one of ``ranks`` (an earlier
    run's): a run writes its ``rank-<r>.jsonl`` from scratch and would overwrite them.

    Raises:
        ConfigError: naming the folder, the first such file and the fix.
    """
    found = [metrics_path(metrics_dir, r) for r in ranks if metrics_path(metrics_dir, r).exists()]
    if found:
        raise ConfigError(
            f"--metrics-dir {str(metrics_dir)!r} already holds an earlier run's metrics "
            f"({found[0].name}); give each run a new folder (a resumed run too), or remove "
            "that run's rank-*.jsonl to overwrite it"
        )


class MetricsWriter:
    """Appends :class:`StepMetrics` as JSON lines, one flushed line per step."""

    def __init__(self, metrics_dir: Path, rank: int) -> None:
        metrics_dir.mkdir(parents=True, exist_ok=True)
        self.path = metrics_path(metrics_dir, rank)
        self._file = self.path.open("w", encoding="utf-8")

    def write(self, record: StepMetrics) -> None:
        """Append one record as a JSON line and flush it (readers may tail the file).

        A non-finite loss or gradient norm (a diverging run) is written as the string
        ``"nan"``, ``"inf"`` or ``"-inf"``: strict JSON has no such numbers.
        """
        self._file.write(metrics_line(record))
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


_MAYBE_NONFINITE = ("loss", "grad_norm")
"""Fields a diverging run can make non-finite (written as strings)."""


def metrics_line(record: StepMetrics) -> str:
    """One record as its JSON line (see :meth:`MetricsWriter.write`)."""
    data = asdict(record)
    for name in _MAYBE_NONFINITE:
        value = data[name]
        if value is not None and not math.isfinite(value):
            data[name] = str(value)
    return json.dumps(data, allow_nan=False) + "\n"


def parse_metrics_line(line: str) -> StepMetrics:
    """Inverse of :func:`metrics_line`.

    Raises:
        ValueError: not JSON. TypeError: not a metrics record.
    """
    data = json.loads(line)
    if isinstance(data, dict):
        for name in _MAYBE_NONFINITE:
            if isinstance(data.get(name), str):
                data[name] = float(data[name])
        measure = data.get("memory_measure")
        if measure is not None:
            data["memory_measure"] = _memory_measure(measure)
    return StepMetrics(**data)


def _memory_measure(value: object) -> MemoryMeasure:
    """``value`` as a :class:`MemoryMeasure`.

    Raises:
        ValueError: naming the value and the known ones.
    """
    try:
        return MemoryMeasure(str(value))
    except ValueError:
        known = ", ".join(m.value for m in MemoryMeasure)
        raise ValueError(f"memory_measure {value!r} is none of {known}") from None


def read_rank_metrics(path: Path) -> list[StepMetrics]:
    """Parse one ``rank-<r>.jsonl`` (complete lines only; a partial last line is ignored).

    Raises:
        ConfigError: a complete line is not a metrics record.
    """
    records = []
    text = path.read_text(encoding="utf-8")
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        try:
            records.append(parse_metrics_line(line))
        except (ValueError, TypeError) as exc:
            raise ConfigError(
                f"{path}: not a metrics line ({exc}); was it written by hplan?"
            ) from None
    return records


@dataclass(frozen=True, slots=True)
class StepSummary:
    """One optimizer step across all ranks."""

    step: int
    loss: float | None
    """Mean loss over the global batch (sample-weighted over replicas)."""
    step_time_s: float
    """Slowest rank's step time."""
    samples: int
    samples_per_s: float
    grad_norm: float | None = None
    """Global gradient L2 norm before clipping (``MAX_GRAD_NORM`` only, else None)."""
    outer_sync_time_s: float = 0.0
    """The longest outer-sync wait of any rank in this step (local SGD / async; else 0)."""


@dataclass(frozen=True, slots=True)
class RankSummary:
    """One rank over the run (means exclude the first step, which warms up, if there are more)."""

    rank: int
    replica: int
    stage: int
    num_steps: int
    step_time_s: float
    compute_time_s: float
    p2p_time_s: float
    wait_time_s: float
    allreduce_time_s: float
    optimizer_time_s: float
    peak_memory_bytes: int
    allreduce_overlapped_time_s: float = 0.0
    """Mean of ``StepMetrics.allreduce_overlapped_time_s``."""
    outer_sync_time_s: float = 0.0
    """Mean of ``StepMetrics.outer_sync_time_s``."""
    baseline_memory_bytes: int | None = None
    """The process's memory before its stage was built (None: not recorded)."""
    training_memory_bytes: int | None = None
    """The largest ``StepMetrics.training_memory_bytes`` (None: no baseline recorded)."""


@dataclass(frozen=True, slots=True)
class MetricsSummary:
    """A whole metrics directory."""

    steps: tuple[StepSummary, ...]
    """Steps every rank reported, in order."""
    ranks: tuple[RankSummary, ...]
    samples_per_s: float
    """Global batch / typical step time (:func:`typical_step_time_s`), over steps after the
    first (all if only one)."""


def summarize_metrics(metrics_dir: Path) -> MetricsSummary:
    """Summarise every ``rank-*.jsonl`` in ``metrics_dir``.

    Raises:
        ConfigError: the directory has no metrics files.
    """
    files = sorted(metrics_dir.glob("rank-*.jsonl"))
    if not files:
        raise ConfigError(f"no rank-*.jsonl files in {str(metrics_dir)!r}; run with --metrics-dir")
    per_rank = {path: read_rank_metrics(path) for path in files}
    records = [r for rs in per_rank.values() for r in rs]
    return summarize_records(records)


def has_outer_syncs(records: Sequence[StepMetrics]) -> bool:
    """Whether some step waited for an outer sync (a local SGD or async plan's rounds)."""
    return any(r.outer_sync_time_s > 0 for r in records)


def typical_step_time_s(step_times_s: Sequence[float], *, rounds: bool) -> float:
    """The median step time, robust to a stray slow step; with ``rounds`` (outer syncs ran,
    :func:`has_outer_syncs`) the mean instead: a round's steps differ by design (one in H
    syncs), and a median would leave the syncs out.

    Raises:
        statistics.StatisticsError: ``step_times_s`` is empty.
    """
    return statistics.fmean(step_times_s) if rounds else statistics.median(step_times_s)


def summarize_records(records: list[StepMetrics]) -> MetricsSummary:
    """Summarise metrics records of any number of ranks (see :func:`summarize_metrics`)."""
    ranks = sorted({r.rank for r in records})
    by_rank = {rank: sorted((r for r in records if r.rank == rank), key=_step_of) for rank in ranks}
    num_common = min((len(v) for v in by_rank.values()), default=0)
    steps = tuple(step_summary([by_rank[rank][i] for rank in ranks]) for i in range(num_common))
    timed = [s.step_time_s for s in steps[1:]] or [s.step_time_s for s in steps]
    samples = steps[0].samples if steps else 0
    typical_s = typical_step_time_s(timed, rounds=has_outer_syncs(records)) if timed else 0.0
    rate = samples / typical_s if typical_s > 0 else 0.0
    return MetricsSummary(
        steps=steps,
        ranks=tuple(rank_summary(by_rank[rank]) for rank in ranks),
        samples_per_s=rate,
    )


def _step_of(record: StepMetrics) -> int:
    return record.step


def step_summary(records: list[StepMetrics]) -> StepSummary:
    """Combine the records of one step from every rank."""
    last_stage = [r for r in records if r.loss is not None]
    total = sum(r.samples for r in last_stage)
    loss = (
        sum(r.loss * r.samples for r in last_stage if r.loss is not None) / total if total else None
    )
    step_time_s = max(r.step_time_s for r in records)
    return StepSummary(
        step=records[0].step,
        loss=loss,
        step_time_s=step_time_s,
        samples=total,
        samples_per_s=total / step_time_s if step_time_s > 0 else 0.0,
        grad_norm=next((r.grad_norm for r in records if r.grad_norm is not None), None),
        outer_sync_time_s=max(r.outer_sync_time_s for r in records),
    )


def rank_summary(records: list[StepMetrics]) -> RankSummary:
    """Mean times of one rank's records (after the first step when there are several)."""
    timed = records[1:] or records
    first = records[0]

    def mean(attr: str) -> float:
        """Mean of one field over the timed records."""
        return statistics.fmean(getattr(r, attr) for r in timed)

    return RankSummary(
        rank=first.rank,
        replica=first.replica,
        stage=first.stage,
        num_steps=len(records),
        step_time_s=mean("step_time_s"),
        compute_time_s=mean("compute_time_s"),
        p2p_time_s=mean("p2p_time_s"),
        wait_time_s=mean("wait_time_s"),
        allreduce_time_s=mean("allreduce_time_s"),
        optimizer_time_s=mean("optimizer_time_s"),
        peak_memory_bytes=max(r.peak_memory_bytes for r in records),
        allreduce_overlapped_time_s=mean("allreduce_overlapped_time_s"),
        outer_sync_time_s=mean("outer_sync_time_s"),
        baseline_memory_bytes=first.baseline_memory_bytes,
        training_memory_bytes=max_training_memory_bytes(records),
    )


def max_training_memory_bytes(records: Sequence[StepMetrics]) -> int | None:
    """The largest training memory of ``records`` (one rank's), None when none has a
    baseline."""
    known = [m for r in records if (m := r.training_memory_bytes) is not None]
    return max(known) if known else None


# --------------------------------------------------------------------------- emulation record
# The emulation record: how a rehearsal stood in for the plan's hardware.
#
# ``hplan rehearse`` writes ``<metrics_dir>/emulation.json`` before its ranks start; the
# ranks read their stragglers' slowdowns from it, and ``hplan calibrate`` reads the time
# scale to turn the measured seconds back into seconds of the plan's hardware. One JSON
# object, versioned like every hplan file.
#
# This module does not import torch.
EMULATION_FILE: Final = "emulation.json"
"""The record's name inside a rehearsal's metrics folder."""
EMULATION_SCHEMA_VERSION: Final = 1


PositiveFactor = Annotated[float, Field(gt=0, allow_inf_nan=False)]


@record
class EmulationRecord:
    """One rehearsal's emulation settings (the defaults: no emulation)."""

    schema_version: Literal[1] = EMULATION_SCHEMA_VERSION
    dilation: Annotated[float, Field(ge=1, allow_inf_nan=False)] = 1.0
    """Global time-dilation factor that made the ranks' CPU demand fit the cores."""
    time_scale: PositiveFactor = 1.0
    """Emulated seconds per second of the plan's hardware."""
    slowdown: dict[str, PositiveFactor] = field(default_factory=dict)
    """Emulated stragglers: cluster device name -> factor its compute was slowed by."""

    def save(self, metrics_dir: Path) -> Path:
        """Write the record into ``metrics_dir``; return its path."""
        path = metrics_dir / EMULATION_FILE
        data = _adapter().dump_python(self, mode="json")
        path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")
        return path

    @staticmethod
    def load(metrics_dir: Path | None) -> EmulationRecord | None:
        """The record in ``metrics_dir``; None when there is none (not a rehearsal).

        A record without ``schema_version`` (hplan before it had one) reads as version 1.

        Raises:
            ConfigError: the file is not an emulation record (one line naming the field).
        """
        path = None if metrics_dir is None else metrics_dir / EMULATION_FILE
        if path is None or not path.is_file():
            return None
        try:
            text = path.read_text(encoding="utf-8")
            data = json.loads(text)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: not a rehearsal's emulation record ({exc})") from None
        if isinstance(data, dict) and "schema_version" not in data:
            text = json.dumps({"schema_version": EMULATION_SCHEMA_VERSION, **data})
        return parse_versioned(
            text,
            _adapter(),
            what="emulation record",
            source=str(path),
            version=EMULATION_SCHEMA_VERSION,
            fix="rehearse again with this hplan (`hplan rehearse --metrics-dir`)",
        )


@cache
def _adapter() -> TypeAdapter[EmulationRecord]:
    return TypeAdapter(EmulationRecord)
