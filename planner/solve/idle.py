"""Why a device the plan leaves idle is idle, computed from the cost model.

For each device no stage uses (:func:`idle_reasons`): *memory*, when the smallest stage
there is (one unit, the smallest micro-batch size, one micro-batch in flight, its boundary
buffers) does not fit it, with both figures; otherwise the best of the chosen layout's
one-step extensions with the device (one more data-parallel replica holding the whole
model, at every batch share it could take, or the tail of any stage's units), costed by
``evaluate`` and checked by ``validate``, against the chosen step time, naming what grows
(the gradient all-reduce over its slowest link, or the pipeline: the device's stage, its
slowest link, the bubble). These answer "would it help as a replica or a stage", not a
re-solve with the device forced in; a faster extension is reported as such.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from hplan.planner.cost.evaluate import (
    Evaluation,
    evaluate,
    slowest_link,
    stage_memory_bytes,
    step_sync_groups,
)
from hplan.planner.cost.layout import Layout, ReplicaLayout, StageLayout
from hplan.planner.cost.problem import PlanningProblem
from hplan.planner.solve.validate import layout_problems
from hplan.planner.textfmt import format_seconds
from hplan.runtime.contract.quantities import format_bytes_pair, format_link_speed

__all__ = ["IdleReason", "idle_reasons", "smallest_stage_bytes"]

_MAX_REPLICA_SHARES = 16
"""Batch shares tried for the device as a new replica (evenly spaced up to half the batch)."""


@dataclass(frozen=True, slots=True)
class IdleReason:
    """One idle device and why, in words."""

    device_idx: int
    reason: str


def smallest_stage_bytes(problem: PlanningProblem, device_idx: int | None = None) -> float:
    """Bytes of the smallest stage any layout can have on a card of ``device_idx`` (None: a
    single card): one unit at the smallest micro-batch size, one micro-batch in flight, with
    its boundary buffers (``stage_memory_bytes``)."""
    b = problem.micro_batch_sizes[0]
    return min(
        stage_memory_bytes(problem, u, u + 1, b, 1, device_idx=device_idx)
        for u in range(problem.num_units)
    )


def idle_reasons(
    problem: PlanningProblem, layout: Layout, evaluation: Evaluation
) -> tuple[IdleReason, ...]:
    """Why each device that ``layout`` leaves idle is idle (module docstring), in device
    order; empty when every device is used."""
    used = set(layout.device_indices)
    reasons = []
    for d in range(problem.num_devices):
        if d in used:
            continue
        smallest = smallest_stage_bytes(problem, d)
        capacity = float(problem.memory_capacity_bytes[d])
        if smallest > capacity:
            need, has = format_bytes_pair(smallest, capacity)
            reason = f"the model's smallest stage needs {need}, the card has {has} usable"
        else:
            reason = _costed_reason(problem, layout, evaluation, d)
        reasons.append(IdleReason(d, reason))
    return tuple(reasons)


def _costed_reason(
    problem: PlanningProblem, layout: Layout, chosen: Evaluation, device_idx: int
) -> str:
    best = _best_extension(problem, layout, device_idx)
    used_degrees = {problem.degree(d) for d in layout.device_indices}
    if best is None and problem.degree(device_idx) not in used_degrees:
        degrees = "/".join(f"tp{g}" for g in sorted(used_degrees))
        return (
            f"as a replica, or as a stage holding some of the plan's units, it would hold "
            f"them at tp{problem.degree(device_idx)} beside the plan's {degrees} stages: "
            "every holder of a unit (and of a parameter tied between units) has one TP degree"
        )
    if best is None:
        return (
            "no layout with it fits: as a replica the whole model does not fit it, and no "
            "stage's units split onto it fit"
        )
    how, with_layout, ev = best
    if ev.step_time_s < chosen.step_time_s:
        return (
            f"{how} would take {format_seconds(ev.step_time_s)} per step, less than the "
            f"plan's {format_seconds(chosen.step_time_s)} (the search missed it)"
        )
    if ev.step_time_s - chosen.step_time_s < _SAME_STEP * chosen.step_time_s:
        return (
            f"{how} takes as long per step as the plan ({format_seconds(ev.step_time_s)}): "
            "the step is bound elsewhere, so another device adds nothing"
        )
    sync_s = ev.allreduce_time_s - chosen.allreduce_time_s
    longer_s = max(ev.replica_times_s) - max(chosen.replica_times_s)
    head = (
        f"{how} takes {format_seconds(ev.step_time_s)} per step, the plan "
        f"{format_seconds(chosen.step_time_s)}"
    )
    if sync_s > _SAME_STEP * chosen.step_time_s and sync_s >= longer_s:
        link = format_link_speed(_sync_link_bytes_per_s(problem, with_layout, device_idx))
        saving = (
            f"more than its compute saves ({format_seconds(-longer_s)})"
            if longer_s < 0
            else f"and the pipeline gets {format_seconds(longer_s)} longer"
        )
        return (
            f"{head}: syncing gradients over the {link} link costs "
            f"{format_seconds(sync_s)} more per step, {saving}"
        )
    if longer_s <= 0:  # its compute saves time; what it adds is elsewhere in the step
        others = _other_costs(ev, chosen).removeprefix(", ") or "the rest of the step more"
        return f"{head}: its compute saves {format_seconds(-longer_s)}, but {others}"
    replica, stage = ev.bottleneck
    if with_layout.replicas[replica].stages[stage].device_idx == device_idx:
        return f"{head}: its stage would be the slowest of its pipeline"
    link_bytes_per_s = _pipeline_link_bytes_per_s(problem, with_layout, device_idx)
    sync = f", and gradient sync {format_seconds(sync_s)} more" if sync_s > 0 else ""
    sync += _other_costs(ev, chosen)
    if not math.isfinite(link_bytes_per_s):  # its replica has no pipeline link
        return f"{head}: the slowest replica gets {format_seconds(longer_s)} longer{sync}"
    link = format_link_speed(link_bytes_per_s)
    return (
        f"{head}: the pipeline gets {format_seconds(longer_s)} longer (transfers over the "
        f"{link} link and the bubble){sync}"
    )


def _other_costs(ev: Evaluation, chosen: Evaluation) -> str:
    """ ", the optimizer step ... more, the outer sync ... more": the parts of the longer step
    besides its replicas and gradient sync (empty where neither grows)."""
    parts = [
        ("the optimizer step", ev.optimizer_time_s - chosen.optimizer_time_s),
        ("the outer sync (per step)", ev.outer_sync_time_s - chosen.outer_sync_time_s),
    ]
    return "".join(
        f", {name} {format_seconds(more_s)} more"
        for name, more_s in parts
        if more_s > _SAME_STEP * chosen.step_time_s
    )


_SAME_STEP = 0.01
"""Step times within 1% of the plan's count as the same (no reason worth naming)."""


def _best_extension(
    problem: PlanningProblem, layout: Layout, device_idx: int
) -> tuple[str, Layout, Evaluation] | None:
    best: tuple[str, Layout, Evaluation] | None = None
    for how, candidate in _extensions(problem, layout, device_idx):
        if layout_problems(problem, candidate):
            continue
        ev = evaluate(problem, candidate)
        if best is None or ev.step_time_s < best[2].step_time_s:
            best = (how, candidate, ev)
    return best


def _extensions(
    problem: PlanningProblem, layout: Layout, device_idx: int
) -> Iterator[tuple[str, Layout]]:
    """The chosen layout with ``device_idx`` added as a replica or as a split-off stage."""
    yield from _as_replica(problem, layout, device_idx)
    for r, replica in enumerate(layout.replicas):
        for s, stage in enumerate(replica.stages):
            for cut in range(stage.unit_start + 1, stage.unit_stop):
                stages = (
                    *replica.stages[:s],
                    StageLayout(stage.device_idx, stage.unit_start, cut),
                    StageLayout(device_idx, cut, stage.unit_stop),
                    *replica.stages[s + 1 :],
                )
                new = ReplicaLayout(
                    stages, replica.micro_batch_size, replica.num_microbatches, replica.num_samples
                )
                replicas = (*layout.replicas[:r], new, *layout.replicas[r + 1 :])
                yield (
                    "with it as one more pipeline stage, the best layout",
                    replace(layout, replicas=replicas),
                )


def _as_replica(
    problem: PlanningProblem, layout: Layout, device_idx: int
) -> Iterator[tuple[str, Layout]]:
    total = problem.global_batch_size
    shares = sorted({max(1, round(i * total / 2 / _MAX_REPLICA_SHARES)) for i in range(1, 17)})
    for share in shares:
        if share >= total or total - share < len(layout.replicas):
            continue
        rest = _reduced(problem, layout, total - share)
        sizes = [b for b in problem.micro_batch_sizes if b <= share]
        for b in sizes:
            own = ReplicaLayout(
                (StageLayout(device_idx, 0, problem.num_units),), b, math.ceil(share / b), share
            )
            yield "as one more replica, the best layout", replace(layout, replicas=(*rest, own))


def _reduced(problem: PlanningProblem, layout: Layout, total: int) -> tuple[ReplicaLayout, ...]:
    """The replicas with their shares scaled to sum to ``total`` (largest remainder), each
    at least one sample, each micro-batch the largest candidate up to its old size and share."""
    old = [r.num_samples for r in layout.replicas]
    scaled = [max(1, math.floor(n * total / sum(old))) for n in old]
    for i in range(total - sum(scaled)):
        scaled[i % len(scaled)] += 1
    while sum(scaled) > total:  # the max(1, ...) floor can overshoot by a few
        scaled[max(range(len(scaled)), key=lambda j: scaled[j])] -= 1
    out = []
    for replica, samples in zip(layout.replicas, scaled, strict=True):
        limit = min(replica.micro_batch_size, samples)
        fitting = [size for size in problem.micro_batch_sizes if size <= limit]
        b = max(fitting, default=problem.micro_batch_sizes[0])  # too large: validate says so
        out.append(ReplicaLayout(replica.stages, b, math.ceil(samples / b), samples))
    return tuple(out)


def _sync_link_bytes_per_s(problem: PlanningProblem, layout: Layout, device_idx: int) -> float:
    """Slowest link (bytes/s) of the all-reduce groups ``device_idx`` would be in (its units'
    and tied parameters' holders that sum every step, ``step_sync_groups``); inf when it would be in none."""
    groups = [g for g in step_sync_groups(problem, layout) if device_idx in g]
    return min((slowest_link(problem, g)[0] for g in groups), default=math.inf)


def _pipeline_link_bytes_per_s(problem: PlanningProblem, layout: Layout, device_idx: int) -> float:
    """Slowest link (bytes/s) between ``device_idx`` and its neighbouring stages."""
    slowest = math.inf
    for replica in layout.replicas:
        devices = [s.device_idx for s in replica.stages]
        if device_idx not in devices:
            continue
        at = devices.index(device_idx)
        for other in devices[max(at - 1, 0) : at + 2]:
            if other != device_idx:
                slowest = min(slowest, float(problem.bandwidth_bytes_per_s[device_idx, other]))
    return slowest
