"""Memory a run measured, against what its plan predicted and what its devices offer.

Three uses of one set of figures (no torch): :func:`memory_use` puts each rank's predicted
peak beside the training memory it measured, for ``hplan calibrate``; :func:`budget_problem`
is ``hplan rehearse --enforce-memory``'s check of one step against the rank's device;
:func:`killed_description` says what to tell about a rank the kernel killed (SIGKILL), with
the evidence that it was for memory (:func:`oom_kill_counts`).

A rank over its device's budget (:func:`memory_budget_bytes`) would have run out on the
real device. In a rehearsal of a GPU plan the measured bytes are host memory standing in for
the GPU's (the same tensors, held by CPU kernels and the host allocator): an estimate,
compared with the same budget. The check tests whether the rank fits, not the prediction
(``hplan calibrate`` shows measured / predicted).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hplan.runtime.contract.memory import device_reserve_bytes
from hplan.runtime.contract.metrics_file import MemoryMeasure, StepMetrics
from hplan.runtime.contract.plan import CPU_KIND, DeviceSpec, Plan, RankReport
from hplan.runtime.contract.quantities import format_bytes, format_bytes_pair

_MEASURES = {
    MemoryMeasure.CUDA_ALLOCATED: "CUDA allocated",
    MemoryMeasure.RSS_HIGH_WATER: "resident-set high-water",
    MemoryMeasure.RSS_LIFETIME_PEAK: "lifetime resident-set peak",
}
"""How each measure reads in a message."""


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """A rank's predicted peak by part (``RankReport.*_memory_bytes``), bytes."""

    parameter_bytes: float
    gradient_bytes: float
    optimizer_state_bytes: float
    activation_bytes: float
    workspace_bytes: float


@dataclass(frozen=True, slots=True)
class RankMemoryUse:
    """One rank's predicted and measured memory, bytes."""

    rank: int
    node: str
    device: str
    kind: str
    predicted_bytes: float
    """The plan report's predicted peak (``RankReport.memory_bytes``; 0: none recorded)."""
    breakdown: MemoryBreakdown | None
    """Its parts, where the report records them."""
    budget_bytes: float
    """The device's memory less its kind's reserve (:func:`memory_budget_bytes`)."""
    baseline_bytes: int | None
    """What the process held before its stage was built (None: not measured)."""
    peak_bytes: int | None
    """The largest measured peak over every step and run (None: no step measured)."""
    measured_bytes: int | None
    """The largest training memory (peak - baseline) over every step and run (None: the
    metrics carry no baseline)."""
    measure: MemoryMeasure | None

    @property
    def ratio(self) -> float | None:
        """Measured / predicted training memory (None: either is missing)."""
        if self.measured_bytes is None or self.predicted_bytes <= 0:
            return None
        return self.measured_bytes / self.predicted_bytes


def memory_budget_bytes(device: DeviceSpec) -> float:
    """The training memory ``device`` offers a rank, >= 0: its memory less the reserve the
    planner keeps for what a process holds outside the plan's tensors
    (``memory.device_reserve_bytes``: on a ``cpu`` device the interpreter, torch and the
    process groups, which the measurement's baseline leaves out; on a GPU the CUDA context
    and communicator buffers). The planner's headroom (``USABLE_MEMORY_FRACTION``) is not
    taken off: it is a margin for the prediction's errors, not memory the device lacks."""
    return max(0.0, device.memory_bytes - device_reserve_bytes(device.kind))


def report_breakdown(report: RankReport) -> MemoryBreakdown | None:
    """The report's five parts of a rank's peak; None when it records none (all 0)."""
    parts = MemoryBreakdown(
        parameter_bytes=report.parameter_memory_bytes,
        gradient_bytes=report.gradient_memory_bytes,
        optimizer_state_bytes=report.optimizer_state_memory_bytes,
        activation_bytes=report.activation_memory_bytes,
        workspace_bytes=report.workspace_memory_bytes,
    )
    values = (
        parts.parameter_bytes,
        parts.gradient_bytes,
        parts.optimizer_state_bytes,
        parts.activation_bytes,
        parts.workspace_bytes,
    )
    return parts if any(v > 0 for v in values) else None


def memory_use(plan: Plan, records: Iterable[StepMetrics]) -> tuple[RankMemoryUse, ...]:
    """Every rank of ``plan``, in rank order, with what ``records`` (any runs, any steps)
    measured of it; records of ranks the plan lacks are ignored."""
    by_rank: dict[int, list[StepMetrics]] = {}
    for record in records:
        by_rank.setdefault(record.rank, []).append(record)
    reports = {r.rank: r for r in plan.report.ranks}
    rows = []
    for rank in plan.ranks:
        mine = by_rank.get(rank.rank, [])
        report = reports.get(rank.rank)
        trained = [m for r in mine if (m := r.training_memory_bytes) is not None]
        baselines = [r.baseline_memory_bytes for r in mine if r.baseline_memory_bytes is not None]
        rows.append(
            RankMemoryUse(
                rank=rank.rank,
                node=rank.node,
                device=rank.device,
                kind=rank.device_kind,
                predicted_bytes=float(report.memory_bytes) if report is not None else 0.0,
                breakdown=report_breakdown(report) if report is not None else None,
                budget_bytes=memory_budget_bytes(plan.device(rank.device)),
                baseline_bytes=max(baselines) if baselines else None,
                peak_bytes=max(r.peak_memory_bytes for r in mine) if mine else None,
                measured_bytes=max(trained) if trained else None,
                measure=next((r.memory_measure for r in mine if r.memory_measure), None),
            )
        )
    return tuple(rows)


def budget_problem(plan: Plan, record: StepMetrics) -> str | None:
    """One line when the memory of ``record`` exceeds its rank's device; None when it fits
    or was not measured.

    On a GPU the training memory (peak less baseline) is compared with the device's budget
    (:func:`memory_budget_bytes`). A ``cpu`` device is the host process itself: what a
    cgroup memory limit holds it to is the whole process, so its resident-set peak is
    compared with the declared memory (the reserve is the planner's estimate of the part
    before the stage is built; the measurement has the real one).
    """
    if not 0 <= record.rank < plan.world_size:
        return None
    rank = plan.ranks[record.rank]
    device = plan.device(rank.device)
    if device.kind == CPU_KIND and record.memory_measure is not MemoryMeasure.CUDA_ALLOCATED:
        return _process_problem(plan, record, device)
    measured = record.training_memory_bytes
    budget = memory_budget_bytes(device)
    if measured is None or measured <= budget:
        return None
    reserve = device_reserve_bytes(device.kind)
    predicted = _predicted_text(plan, record.rank)
    measured_text, budget_text = format_bytes_pair(measured, budget)
    return (
        f"rank {rank.rank} on {rank.device} ({device.kind}) measured "
        f"{measured_text} of training memory by step {record.step} "
        f"({_measured_how(record)}), over its device's budget of {budget_text} "
        f"(its declared {format_bytes(device.memory_bytes)} less the {device.kind} reserve "
        f"{format_bytes(reserve)}){predicted}: {_remedy(rank.device)}"
    )


def _process_problem(plan: Plan, record: StepMetrics, device: DeviceSpec) -> str | None:
    """:func:`budget_problem` for a ``cpu`` device: the process's peak against the
    declared memory."""
    if record.baseline_memory_bytes is None or record.peak_memory_bytes <= device.memory_bytes:
        return None  # metrics without a baseline predate the measurement: unmeasured
    rank = plan.ranks[record.rank]
    how = _MEASURES.get(record.memory_measure, "peak") if record.memory_measure else "peak"
    measured_text, declared_text = format_bytes_pair(record.peak_memory_bytes, device.memory_bytes)
    return (
        f"rank {rank.rank} on {rank.device} (cpu) measured a {how} of {measured_text} "
        f"for its whole process by step {record.step} "
        f"({format_bytes(record.baseline_memory_bytes)} before its stage was built), over "
        f"the {declared_text} its device declares{_predicted_text(plan, record.rank)}: "
        f"{_remedy(rank.device)}"
    )


def _remedy(device: str) -> str:
    return (
        f"declare the memory {device} really has in the cluster file and re-solve, or "
        "rehearse without --enforce-memory"
    )


def _measured_how(record: StepMetrics) -> str:
    """``resident-set high-water 363.0 MB less the 326.7 MB its process held before its
    stage was built``."""
    how = _MEASURES.get(record.memory_measure, "peak") if record.memory_measure else "peak"
    baseline = record.baseline_memory_bytes or 0
    return (
        f"{how} {format_bytes(record.peak_memory_bytes)} less the {format_bytes(baseline)} "
        "its process held before its stage was built"
    )


def _predicted_text(plan: Plan, rank: int) -> str:
    """``; the plan predicted 7.1 MB`` (empty without a prediction)."""
    report = next((r for r in plan.report.ranks if r.rank == rank), None)
    if report is None or report.memory_bytes <= 0:
        return ""
    return f"; the plan predicted {format_bytes(report.memory_bytes)}"


# ---------------------------------------------------------------------------- killed ranks
_OOM_KILL = "oom_kill"
"""The counter's name in ``memory.events`` (cgroup v2), ``memory.oom_control`` (v1) and
``/proc/vmstat`` (the whole machine)."""


def oom_kill_counts(root: Path = Path("/")) -> dict[str, int]:
    """The kernel's out-of-memory kill counters that this process can read, by file.

    Its memory cgroup's (v2 ``memory.events``, v1 ``memory.oom_control``: every OOM kill of
    a process in the group, whether the group's limit or the machine's memory ran out),
    found from ``/proc/self/cgroup`` under ``/sys/fs/cgroup``, else at the mount's root (the
    group a container sees as its own); where none is readable, the machine's
    (``/proc/vmstat``, which counts every process of the machine). Empty: none readable
    (not Linux).
    """
    counts = {}
    for candidates in _cgroup_files(root):
        for path in candidates:
            count = _count(path)
            if count is not None:
                counts[str(path)] = count
                break
    if counts:
        return counts
    vmstat = root / "proc/vmstat"
    count = _count(vmstat)
    return {} if count is None else {str(vmstat): count}


def _cgroup_files(root: Path) -> list[tuple[Path, Path]]:
    """Per memory hierarchy of this process (v2, v1), its group's OOM counter file and the
    one at the hierarchy's mount root."""
    groups = _read(root / "proc/self/cgroup") or ""
    files = []
    for line in groups.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        group = parts[2].strip().strip("/")
        if parts[0] == "0" and parts[1] == "":
            base, name = root / "sys/fs/cgroup", "memory.events"
        elif "memory" in parts[1].split(","):
            base, name = root / "sys/fs/cgroup/memory", "memory.oom_control"
        else:
            continue
        files.append((base / group / name, base / name))
    return files


def _count(path: Path) -> int | None:
    """The ``oom_kill N`` line of ``path`` (None: no file, or no such line)."""
    text = _read(path)
    if text is None:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == _OOM_KILL and value.strip().isdigit():
            return int(value)
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def oom_cause(before: Mapping[str, int], after: Mapping[str, int]) -> str:
    """Why a process was SIGKILLed, from the OOM counters before it started and after it
    died (:func:`oom_kill_counts`): ``out of memory: ...`` (a counter rose), ``not by the
    kernel's OOM killer: ...`` (none did) or ``most likely out of memory; ...`` (none
    readable)."""
    common = [name for name in after if name in before]
    risen = {name: after[name] - before[name] for name in common if after[name] > before[name]}
    if risen:
        name, count = next(iter(risen.items()))
        kills = "1 kill" if count == 1 else f"{count} kills"
        return f"out of memory: the kernel's OOM killer counted {kills} meanwhile in {name}"
    if common:
        return (
            f"not by the kernel's OOM killer, which counted none meanwhile in {common[0]}; a "
            "memory watchdog such as systemd-oomd or earlyoom, the batch system, or a user "
            "sent it"
        )
    return "most likely out of memory; no OOM kill counter is readable here to tell"


def killed_description(
    plan: Plan, rank: int, cause: str, last: StepMetrics | None, metrics: Path | None
) -> str:
    """One line about plan rank ``rank``, killed by SIGKILL: ``cause`` (:func:`oom_cause`),
    its node and device, its predicted peak (plan report) and its last measured peak (``last``,
    the last record of its metrics file ``metrics``; None: none written), what to change."""
    rank_plan = plan.ranks[rank]
    report = next((r for r in plan.report.ranks if r.rank == rank), None)
    predicted = (
        f"predicted peak {format_bytes(report.memory_bytes)} of training memory (plan report)"
        if report is not None and report.memory_bytes > 0
        else "no predicted peak in the plan report"
    )
    if last is not None:
        measured = f"last measured {_last_measured(last, metrics)}"
    elif metrics is not None:
        measured = f"no step measured before it died ({metrics} has none)"
    else:
        measured = "nothing measured (run with --metrics-dir DIR to record its memory per step)"
    device = plan.device(rank_plan.device)
    return (
        f"killed by SIGKILL ({cause}) on node {rank_plan.node}, device {rank_plan.device} "
        f"({device.kind}, {format_bytes(device.memory_bytes)} declared): {predicted}, "
        f"{measured}; if it ran out of memory, give it more (cluster file, re-solve) or "
        "make the plan need less (smaller micro-batches, recompute, ZeRO)"
    )


def _last_measured(record: StepMetrics, metrics: Path | None) -> str:
    """``36.2 MB of training memory at step 3 (peak 363.0 MB over a 326.7 MB baseline;
    m/rank-1.jsonl)``, or the peak alone without a baseline."""
    where = "" if metrics is None else f"; {metrics}"
    measured = record.training_memory_bytes
    if measured is None:
        return (
            f"peak {format_bytes(record.peak_memory_bytes)} at step {record.step} (no "
            f"baseline recorded{where})"
        )
    return (
        f"{format_bytes(measured)} of training memory at step {record.step} (peak "
        f"{format_bytes(record.peak_memory_bytes)} over a "
        f"{format_bytes(record.baseline_memory_bytes or 0)} baseline{where})"
    )


def last_record(records: Sequence[StepMetrics]) -> StepMetrics | None:
    """The record of the latest step (None: none)."""
    return max(records, key=lambda r: r.step, default=None)
