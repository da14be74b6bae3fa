"""Predict the step time and memory of a layout under hplan's cost model.

One optimizer step in the steady state of step after step (:func:`evaluate`)::

    step_time = max over replicas of (optimizer time + pipeline_time)
              + gradient all-reduce time left after the pipelines (``allreduce_time_s``)
              + outer sync exposed per inner step under local sync (``outer_sync_time_s``)
    pipeline_time = (num_microbatches - 1) * period + fill_time

The all-reduce is where every replica meets, so a replica's own optimizer step counts with
its own pipeline (ZeRO's all-gather is a second meeting point). Sources: the 1F1B period
and fill, ``cost.microbatch`` (Narayanan et al., SC 2021, section 2.2); the bucketed ring
all-reduce, ``link_model.exposed_all_reduce_s`` (Patarasuk and Yuan, JPDC 2009); a stage's
memory, ``contract.memory.stage_activation_bytes`` (the one a plan is checked against).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from hplan.planner.cost.layout import IslandSync, Layout, ReplicaLayout, StageLayout
from hplan.planner.cost.microbatch import (
    StagePasses,
    pipeline_time_s,
    stage_passes,
    units_time_s,
)
from hplan.planner.cost.offload import device_saving_bytes, stage_optimizer_time_s
from hplan.planner.cost.problem import FloatArray, PlanningProblem
from hplan.planner.cost.sync_cost import (
    OuterLink,
    device_outer_s,
    exposed_outer_s,
    outer_codec_time_s,
    outer_transfer_time_s,
    split_by_island,
)
from hplan.planner.cost.zero import allgather_time_s, gradient_saving_bytes, state_saving_bytes
from hplan.runtime.contract.holders import holders, shared_bytes
from hplan.runtime.contract.link_model import (
    BUCKET_CAP_BYTES,
    bucket_rings_s,
    exposed_all_reduce_s,
    overlap_window_s,
    transfer_time_s,
)
from hplan.runtime.contract.memory import in_flight_microbatches, stage_activation_bytes
from hplan.runtime.contract.plan import Schedule, microbatch_sizes


@dataclass(frozen=True, slots=True)
class MicrobatchTimes:
    """Seconds one micro-batch spends on a stage."""

    forward_s: float
    backward_s: float
    """With the forward again on a stage that recomputes."""
    send_s: float
    """Its activations to the next stage (0 on the last)."""
    return_s: float
    """Its gradients back from the next stage (0 on the last)."""

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def link_s(self) -> float:
        return self.send_s + self.return_s


@dataclass(frozen=True, slots=True)
class StageCost:
    """Predicted figures of one stage (one device)."""

    device_idx: int
    full: MicrobatchTimes
    """One full micro-batch (the replica's micro-batch size)."""
    last: MicrobatchTimes
    """The replica's last micro-batch, smaller when the size does not divide its share
    (``contract.plan.microbatch_sizes``); ``full`` otherwise."""
    memory_bytes: float
    busy_time_s: float
    """Compute time over the whole step (every micro-batch at its size)."""

    @property
    def compute_time_s(self) -> float:
        """Forward + backward of one full micro-batch."""
        return self.full.compute_s

    @property
    def link_time_s(self) -> float:
        """Transfers to the next stage and gradients back, per full micro-batch (0 for the
        last stage)."""
        return self.full.link_s


@dataclass(frozen=True, slots=True)
class Evaluation:
    """Predicted step time of a layout and its parts."""

    step_time_s: float
    samples_per_s: float
    replica_times_s: tuple[float, ...]
    allreduce_time_s: float
    """Gradient all-reduce left after the slowest pipeline ends (the part the last backward
    passes did not hide; see ``allreduce_time_s``)."""
    optimizer_time_s: float
    stages: tuple[tuple[StageCost, ...], ...]
    """stages[r][s] for replica r, stage s."""
    memory_ok: bool
    outer_sync_time_s: float = 0.0
    """What the outer syncs of a layout with local sync leave exposed per inner step
    (:func:`outer_sync_time_s`; included in ``step_time_s``; 0 without, or when hidden)."""
    replica_starts_s: tuple[float, ...] = ()
    """Per replica, what precedes its pipeline in a step: its optimizer step (its slowest
    stage's), or under ZeRO the slowest one's plus the all-gather (module docstring)."""

    @property
    def inner_step_time_s(self) -> float:
        """The step without the amortised outer sync."""
        return self.step_time_s - self.outer_sync_time_s

    @property
    def bottleneck(self) -> tuple[int, int]:
        """(replica, stage) of the stage that bounds the slowest replica."""
        replica = int(np.argmax(self.replica_times_s))
        costs = [max(c.compute_time_s, c.link_time_s) for c in self.stages[replica]]
        return replica, int(np.argmax(costs))


def candidate_index(problem: PlanningProblem, micro_batch_size: int) -> int:
    """Index of ``micro_batch_size`` among the problem's candidates; for a size between
    them (a replica's micro-batch cut to its share), of the next larger one (the largest
    above them all): whose time labels stand for it."""
    sizes = problem.micro_batch_sizes
    return next((k for k, b in enumerate(sizes) if b >= micro_batch_size), len(sizes) - 1)


def link_time_s(problem: PlanningProblem, a: int, b: int, num_bytes: float) -> float:
    """Alpha-beta transfer time of ``num_bytes`` between devices ``a`` and ``b``."""
    if a == b or num_bytes <= 0:
        return 0.0
    return transfer_time_s(
        num_bytes, float(problem.bandwidth_bytes_per_s[a, b]), float(problem.latency_s[a, b])
    )


def stage_compute_time_s(
    problem: PlanningProblem,
    device_idx: int,
    start: int,
    stop: int,
    k: int,
    recompute: bool = False,
    recompute_units: Sequence[int] = (),
) -> float:
    """Forward + backward time of units ``[start, stop)`` for one micro-batch (candidate k),
    plus the forward the backward runs again: of every unit with ``recompute``, of the units
    ``recompute_units`` (problem indices) under selective recomputation."""
    fwd = problem.fwd_time_s[device_idx, start:stop, k].sum()
    bwd = problem.bwd_time_s[device_idx, start:stop, k].sum()
    again = fwd if recompute else problem.fwd_time_s[device_idx, list(recompute_units), k].sum()
    return float(fwd + again + bwd)


def stage_memory_bytes(
    problem: PlanningProblem,
    start: int,
    stop: int,
    micro_batch_size: int,
    in_flight: int,
    recompute: bool = False,
    recompute_units: Sequence[int] = (),
    *,
    device_idx: int | None = None,
) -> float:
    """Peak memory of a stage holding units ``[start, stop)``, per card of device
    ``device_idx`` (a TP group's card holds ``PlanningProblem.static_bytes_on``'s share;
    None: a single card).

    Static state + activations (``contract.memory.stage_activation_bytes``, the formula a
    plan is checked with at load: ``in_flight`` micro-batches of them; with ``recompute``
    the stage's input of each micro-batch in flight plus one micro-batch's activations;
    with ``recompute_units`` those units' inputs instead of their activations, plus one
    micro-batch of the largest one's) + the received tensors without a batch dimension,
    whole for each micro-batch in flight (:func:`received_unbatched_bytes`) + one receive
    and one send buffer of the boundary tensors on each side.
    """
    degree = 1 if device_idx is None else problem.degree(device_idx)
    static = problem.static_bytes_at(degree)[start:stop].sum()
    activations = problem.activation_bytes_at(degree)
    chosen = set(recompute_units)
    b = micro_batch_size
    inputs = [unit_input_bytes(problem, u, b) / b for u in range(start, stop)]
    if start > 0:
        inputs[0] = float(problem.cut_bytes_per_sample[start - 1])  # the rest: held below
    acts = stage_activation_bytes(
        [float(activations[u]) for u in range(start, stop)],
        inputs,
        [u in chosen for u in range(start, stop)],
        micro_batch_size,
        in_flight,
        full_recompute=recompute,
    )
    acts += received_unbatched_bytes(problem, start) * in_flight
    buffers = 0.0
    if start > 0:
        buffers += 2 * problem.cut_bytes(start - 1, micro_batch_size)
    if stop < problem.num_units:
        buffers += 2 * problem.cut_bytes(stop - 1, micro_batch_size)
    return float(static + acts + buffers)


def max_microbatches(
    problem: PlanningProblem, stages: Sequence[StageLayout], micro_batch_size: int
) -> int | None:
    """The most micro-batches of ``micro_batch_size`` that every stage of one pipeline holds
    in flight within its device's memory, where the schedule keeps all of them (GPipe; 0 when
    not even one fits). None: no limit (1F1B holds at most ``S - s`` at any count; or
    memory that does not grow with them).

    A stage's memory is linear in the micro-batches in flight (:func:`stage_memory_bytes`),
    so two points give the line."""
    if problem.schedule is not Schedule.GPIPE:
        return None
    most: int | None = None
    for stage in stages:
        one, two = (
            stage_memory_bytes(
                problem,
                stage.unit_start,
                stage.unit_stop,
                micro_batch_size,
                in_flight,
                stage.recompute,
                stage.recompute_units,
                device_idx=stage.device_idx,
            )
            for in_flight in (1, 2)
        )
        capacity = float(problem.memory_capacity_bytes[stage.device_idx]) * (1 + 1e-12)
        if one > capacity:
            return 0
        if two <= one:
            continue
        fits = 1 + int((capacity - one) / (two - one))
        most = fits if most is None else min(most, fits)
    return most


def received_unbatched_bytes(problem: PlanningProblem, start: int) -> float:
    """Bytes of the tensors without a batch dimension a stage starting at unit ``start``
    receives with each micro-batch (0 for the first stage). The stage holds them for each
    micro-batch in flight, until its backward; the activation measurement, a slope over two
    batch sizes, never sees batch-independent bytes."""
    return problem.cut_bytes(start - 1, 0) if start > 0 else 0.0


def unit_input_bytes(problem: PlanningProblem, unit: int, micro_batch_size: int) -> float:
    """Bytes of one micro-batch of the boundary before ``unit`` (the cut after ``unit - 1``,
    ``PlanningProblem.cut_bytes``; 0 for the first): what a recomputed unit keeps of each
    micro-batch in flight."""
    return problem.cut_bytes(unit - 1, micro_batch_size) if unit > 0 else 0.0


@functools.lru_cache(maxsize=1 << 16)
def _replica_costs(problem: PlanningProblem, replica: ReplicaLayout) -> tuple[StageCost, ...]:
    """Each stage's costs in ``replica`` (pure: cached by the problem's identity and the
    replica, so that re-costing a layout whose replicas are mostly unchanged is cheap)."""
    b = min(replica.micro_batch_size, replica.num_samples)
    sizes = microbatch_sizes(replica.num_samples, b)
    passes = stage_passes(problem, replica.stages, np.array([b, sizes[-1]], dtype=float))
    costs = []
    num_stages = replica.num_stages
    for s, stage in enumerate(replica.stages):
        full, last = (
            MicrobatchTimes(
                float(passes.forward_s[s, i]),
                float(passes.backward_s[s, i]),
                float(passes.send_s[s, i]),
                float(passes.return_s[s, i]),
            )
            for i in (0, 1)
        )
        memory = stage_memory_bytes(
            problem,
            stage.unit_start,
            stage.unit_stop,
            b,
            in_flight_microbatches(problem.schedule, s, num_stages, replica.num_microbatches),
            stage.recompute,
            stage.recompute_units,
            device_idx=stage.device_idx,
        )
        busy = full.compute_s * (len(sizes) - 1) + last.compute_s
        costs.append(StageCost(stage.device_idx, full, last, memory, busy))
    return tuple(costs)


@functools.lru_cache(maxsize=1 << 16)
def _replica_time_s(problem: PlanningProblem, replica: ReplicaLayout) -> float:
    """:func:`replica_pipeline_time_s` of ``replica`` (cached like :func:`_replica_costs`)."""
    return replica_pipeline_time_s(_replica_costs(problem, replica), replica.num_microbatches)


def replica_pipeline_time_s(costs: tuple[StageCost, ...], num_microbatches: int) -> float:
    """Seconds of one step of a replica's pipeline, its stages' ``costs``, of
    ``num_microbatches``, every one full but the last (``StageCost.last``):
    ``cost.microbatch.pipeline_time_s`` (``(m - 1) * period + fill`` when the last is full
    too, module docstring)."""
    full = _passes([c.full for c in costs])
    last = _passes([c.last for c in costs])
    return pipeline_time_s(full, last, num_microbatches)


def _passes(times: Sequence[MicrobatchTimes]) -> StagePasses:
    return StagePasses(
        np.array([t.forward_s for t in times]),
        np.array([t.backward_s for t in times]),
        np.array([t.send_s for t in times]),
        np.array([t.return_s for t in times]),
    )


def allreduce_time_s(
    problem: PlanningProblem, layout: Layout, replica_times_s: Sequence[float]
) -> float:
    """Seconds of gradient all-reduce left after the slowest replica's pipeline ends.

    Groups of devices holding the same parameters, merged by holder set, that sum every
    step (:func:`step_sync_groups`), each a ring per bucket over its slowest link
    (``link_model.bucketed_all_reduce_time_s``); a device runs its groups one after
    another, ``T_d`` in all. They start inside the device's last backward pass (its
    stage's backward of the replica's last micro-batch, at that one's size, ``b_d``), so
    the device is done
    ``link_model.exposed_all_reduce_s(T_d, overlap_window_s(b_d, B_d), L_d)`` after its
    replica's pipeline ends (``B_d``: the bytes it sums; ``L_d``: the ring of the largest
    last bucket of its groups). Every stage's last backward pass is taken to end with its
    replica's pipeline (a later stage's ends earlier: conservative by that drain).

    Args:
        replica_times_s: each replica's pipeline time (:func:`replica_pipeline_time_s`), in the
            order of ``layout.replicas``.

    Returns:
        How far the latest device's all-reduce ends after the slowest pipeline (>= 0).
    """
    rings = _device_rings(problem, tuple(r.stages for r in layout.replicas), layout.sync)
    slowest_s = max(replica_times_s, default=0.0)
    end_s = slowest_s
    for replica, pipeline_s in zip(layout.replicas, replica_times_s, strict=True):
        last = microbatch_sizes(replica.num_samples, replica.micro_batch_size)[-1]
        for stage in replica.stages:
            if stage.device_idx not in rings:
                continue
            total_s, synced_bytes, last_s = rings[stage.device_idx]
            backward_s = _backward_s(problem, stage, last)
            window_s = overlap_window_s(backward_s, synced_bytes, BUCKET_CAP_BYTES)
            exposed_s = exposed_all_reduce_s(total_s, window_s, last_s)
            end_s = max(end_s, pipeline_s + exposed_s)
    return end_s - slowest_s


@functools.lru_cache(maxsize=1 << 14)
def _device_rings(
    problem: PlanningProblem,
    placement: tuple[tuple[StageLayout, ...], ...],
    sync: IslandSync | None,
) -> dict[int, tuple[float, float, float]]:
    """Device -> (seconds of its every-step rings, the bytes they sum, the ring of its
    largest last bucket), for a layout of these stages and sync (the shares do not change
    them: cached by the problem's identity). Read-only."""
    rings: dict[int, tuple[float, float, float]] = {}
    for group, num_bytes in step_sync_groups(
        problem, Layout(_placement_replicas(placement), sync)
    ).items():
        bandwidth_bytes_per_s, latency_s = slowest_link(problem, group)
        t, last = bucket_rings_s(len(group), num_bytes, bandwidth_bytes_per_s, latency_s)
        for d in group:
            total_s, synced, last_s = rings.get(d, (0.0, 0.0, 0.0))
            rings[d] = (total_s + t, synced + num_bytes, max(last_s, last))
    return rings


def _placement_replicas(
    placement: tuple[tuple[StageLayout, ...], ...],
) -> tuple[ReplicaLayout, ...]:
    """Replicas of these stages with one sample each (for what depends on placement only)."""
    return tuple(ReplicaLayout(stages, 1, 1, 1) for stages in placement)


@functools.lru_cache(maxsize=1 << 16)
def _backward_s(problem: PlanningProblem, stage: StageLayout, num_samples: int) -> float:
    """The stage's backward of one micro-batch of ``num_samples`` (no recomputed forward)."""
    _, backward = units_time_s(
        problem, stage.device_idx, stage.unit_start, stage.unit_stop, num_samples
    )
    return float(backward)


def grad_sync_groups(problem: PlanningProblem, layout: Layout) -> dict[tuple[int, ...], float]:
    """Sorted device indices holding the same parameters -> gradient bytes they all-reduce.

    A unit's own parameters are held by the devices holding the unit; parameters tied
    across units (``PlanningProblem.tied_params``) by every device holding one of those
    units, in one group, as the runtime buckets them. Only holder sets of two or more
    devices (a parameter on one device needs no sync).
    """
    return dict(_grad_sync_groups(problem, tuple(r.stages for r in layout.replicas)))


@functools.lru_cache(maxsize=1 << 14)
def _grad_sync_groups(
    problem: PlanningProblem, placement: tuple[tuple[StageLayout, ...], ...]
) -> dict[tuple[int, ...], float]:
    """:func:`grad_sync_groups` of a placement (cached by the problem's identity; read-only)."""
    ties = problem.tied_params
    # every holder of a unit has one TP degree (``solve.validate``): its bytes per card
    # are what each of its d rings all-reduces, side by side
    own_bytes = {g: _own_grad_bytes(problem, g) for g in problem.distinct_degrees}

    def items(stage: StageLayout) -> list[tuple[str, int]]:
        units = range(stage.unit_start, stage.unit_stop)
        tied = [("tie", i) for i, tie in enumerate(ties) if set(tie.units) & set(units)]
        return tied + [("unit", u) for u in units]

    stages = [s for stages in placement for s in stages]
    item_holders = holders((s.device_idx, items(s)) for s in stages)
    num_bytes = {("tie", i): tie.num_bytes for i, tie in enumerate(ties)}
    num_bytes.update(
        {
            ("unit", u): float(own_bytes[problem.degree(owners[0])][u])
            for u in range(problem.num_units)
            if (owners := item_holders.get(("unit", u)))
        }
    )
    return shared_bytes(item_holders, num_bytes)


def _own_grad_bytes(problem: PlanningProblem, degree: int) -> FloatArray:
    """Per unit, a tp-``degree`` card's gradient bytes less its tied parameters' (synced
    in the tie's own group), shape (U,)."""
    own = problem.grad_bytes_at(degree).astype(float)
    for tie in problem.tied_params:
        own[list(tie.units)] -= tie.num_bytes
    return own


def island_index(problem: PlanningProblem, sync: IslandSync) -> tuple[int, ...]:
    """Island index of each device of ``problem`` (``sync.islands`` by node), shape (D,)."""
    of_node = {node: i for i, island in enumerate(sync.islands) for node in island}
    return tuple(of_node[node] for node in problem.device_nodes)


def step_sync_groups(problem: PlanningProblem, layout: Layout) -> dict[tuple[int, ...], float]:
    """Sorted device indices that sum gradients every step -> their bytes:
    :func:`grad_sync_groups`, where under local sync every holder set spanning islands is
    replaced by its members in each island (``sync_cost.split_by_island``)."""
    groups = grad_sync_groups(problem, layout)
    if layout.sync is None or not layout.sync.local:
        return groups
    inner, _ = split_by_island(groups, island_index(problem, layout.sync))
    return inner


def outer_sync_groups(problem: PlanningProblem, layout: Layout) -> dict[tuple[int, ...], float]:
    """Holder sets (sorted devices) spanning islands -> the gradient bytes (float32) of the
    pseudo-gradients one outer sync averages; empty without local sync (the wire bytes:
    ``sync_cost.pseudo_gradient_bytes`` in the set's own wire format)."""
    if layout.sync is None or not layout.sync.local:
        return {}
    _, outer = split_by_island(
        grad_sync_groups(problem, layout), island_index(problem, layout.sync)
    )
    return outer


def outer_link(problem: PlanningProblem, sync: IslandSync, group: tuple[int, ...]) -> OuterLink:
    """The links the outer sync of the spanning holder set ``group`` crosses: its ring's
    (:func:`slowest_link`), its island leads' (lowest device of each island) and each
    island's members'."""
    island = island_index(problem, sync)
    members: dict[int, list[int]] = {}
    for d in group:
        members.setdefault(island[d], []).append(d)
    parts = [tuple(members[i]) for i in sorted(members)]
    leads = tuple(part[0] for part in parts)
    islands = tuple(
        (len(part), *(slowest_link(problem, part) if len(part) > 1 else (math.inf, 0.0)))
        for part in parts
    )
    return OuterLink(
        len(group),
        *slowest_link(problem, group),
        *slowest_link(problem, leads),
        islands,  # type: ignore[arg-type]
    )


def outer_ring_times_s(problem: PlanningProblem, layout: Layout) -> dict[tuple[int, ...], float]:
    """Each spanning holder set -> seconds T of one of its outer syncs in its own wire format
    (``sync_cost.outer_transfer_time_s`` over :func:`outer_link`)."""
    sync = layout.sync
    return {
        group: outer_transfer_time_s(
            sync.of(group).wire_dtype, num_bytes, outer_link(problem, sync, group)
        )
        for group, num_bytes in outer_sync_groups(problem, layout).items()
        if sync is not None
    }


def set_unit_bytes(
    problem: PlanningProblem, layout: Layout
) -> dict[tuple[int, ...], tuple[float, ...]]:
    """Holder set (sorted devices of the stages holding a unit) -> the gradient bytes of each
    unit it holds, a tied parameter counted once, in its first unit (the runtime syncs it
    once, as one piece of a fragment: ``holders.outer_fragments``)."""
    held: dict[int, list[int]] = {}
    for replica in layout.replicas:
        for stage in replica.stages:
            for u in range(stage.unit_start, stage.unit_stop):
                held.setdefault(u, []).append(stage.device_idx)
    grad = problem.grad_bytes_at(1).astype(float)
    for tie in problem.tied_params:
        grad[list(tie.units)[1:]] -= tie.num_bytes
    out: dict[tuple[int, ...], list[float]] = {}
    for u, devices in sorted(held.items()):
        out.setdefault(tuple(sorted(devices)), []).append(float(grad[u]))
    return {group: tuple(num_bytes) for group, num_bytes in out.items()}


def largest_unit_share(units: tuple[float, ...]) -> float:
    """The largest of a set's unit bytes ``units`` as a share of their sum (0 without)."""
    total = sum(units)
    return max(units) / total if total > 0 else 0.0


def outer_costs_s(
    problem: PlanningProblem, layout: Layout, inner_step_s: float
) -> dict[tuple[int, ...], tuple[float, float]]:
    """Each spanning holder set -> (seconds exposed per inner step of ``inner_step_s``,
    ``sync_cost.exposed_outer_s``, its fragments no smaller than its largest unit; seconds
    its link carries per inner step, T / H)."""
    sync = layout.sync
    units = set_unit_bytes(problem, layout)
    grads = outer_sync_groups(problem, layout)
    out = {}
    for group, transfer_s in outer_ring_times_s(problem, layout).items():
        assert sync is not None
        g = sync.of(group)
        exposed = exposed_outer_s(
            g.mode,
            g.local_steps,
            g.num_fragments,
            g.overlap_steps,
            transfer_s,
            inner_step_s,
            largest_unit_share(units.get(group, ())),
            outer_codec_time_s(
                g.wire_dtype, grads[group], len(outer_link(problem, sync, group).island_links)
            ),
        )
        out[group] = (exposed, transfer_s / g.local_steps)
    return out


def outer_sync_time_s(problem: PlanningProblem, layout: Layout, inner_step_s: float) -> float:
    """Seconds the outer syncs add to each inner step of ``inner_step_s``: the largest over
    devices of ``sync_cost.device_outer_s``; 0 without local sync."""
    sync = layout.sync
    if sync is None or not sync.local:
        return 0.0
    per_device = device_outer_s(outer_costs_s(problem, layout, inner_step_s), inner_step_s)
    return max(per_device.values(), default=0.0)


def slowest_link(problem: PlanningProblem, group: tuple[int, ...]) -> tuple[float, float]:
    """(lowest bandwidth in bytes/s, highest latency in s) of a ring over ``group``: over
    its device pairs, and no faster than the measured all-reduce of any member's node
    (``PlanningProblem.collective_*``; ``Plan.ring_channel`` on a plan)."""
    idx = np.array(group)
    off = ~np.eye(len(group), dtype=bool)
    ring_bandwidth, ring_latency = measured_ring(problem, group)
    bandwidth = float(problem.bandwidth_bytes_per_s[np.ix_(idx, idx)][off].min())
    latency = float(problem.latency_s[np.ix_(idx, idx)][off].max())
    return min(bandwidth, ring_bandwidth), max(latency, ring_latency)


def measured_ring(problem: PlanningProblem, devices: Sequence[int]) -> tuple[float, float]:
    """(lowest bus bandwidth, highest latency per step) of the measured all-reduces of the
    nodes of ``devices``; (inf, 0) when none was measured."""
    idx = list(devices)
    bus = problem.collective_bus_bandwidth_bytes_per_s
    step = problem.collective_latency_s
    return (
        math.inf if bus is None else float(bus[idx].min()),
        0.0 if step is None else float(step[idx].max()),
    )


def replica_optimizer_times_s(problem: PlanningProblem, layout: Layout) -> tuple[float, ...]:
    """Per replica (in ``layout.replicas`` order), its slowest stage's optimizer step."""
    return tuple(
        max(
            (
                stage_optimizer_time_s(problem, layout, s.device_idx, s.unit_start, s.unit_stop)
                for s in r.stages
            ),
            default=0.0,
        )
        for r in layout.replicas
    )


def evaluate(problem: PlanningProblem, layout: Layout) -> Evaluation:
    """Predicted step time, per-stage costs and memory of ``layout``.

    A replica runs ``contract.plan.microbatch_sizes(num_samples, micro_batch_size)``: every
    micro-batch is charged by its size (``cost.microbatch``), memory at the full size (the
    peak); a micro-batch size above the share is the share (what the runtime runs).
    """
    stages = tuple(_replica_costs(problem, r) for r in layout.replicas)
    replica_times = tuple(_replica_time_s(problem, r) for r in layout.replicas)
    optimizers = replica_optimizer_times_s(problem, layout)
    gather = allgather_time_s(problem, layout)
    optimizer = max(optimizers, default=0.0) + gather
    # a replica starts its pipeline once its own devices have stepped; under ZeRO the
    # all-gather after the optimizer steps is a second meeting point: once the slowest
    # step and the gathers are done
    starts = (optimizer,) * len(replica_times) if layout.optimizer_shard_weights else optimizers
    started = tuple(o + t for o, t in zip(starts, replica_times, strict=True))
    allreduce = allreduce_time_s(problem, layout, started)
    inner = max(started) + allreduce
    if layout.optimizer_shard_weights:
        stages = _sharded(problem, layout, stages)
    if layout.optimizer_offload:
        stages = _less(stages, device_saving_bytes(problem, layout))
    stages = _less(stages, unsummed_flat_copy_bytes(problem, layout))
    outer = outer_sync_time_s(problem, layout, inner)
    step = inner + outer
    memory_ok = all(
        c.memory_bytes <= problem.memory_capacity_bytes[c.device_idx]
        for costs in stages
        for c in costs
    )
    total = sum(r.num_samples for r in layout.replicas)
    return Evaluation(
        step_time_s=step,
        samples_per_s=total / step if step > 0 else float("inf"),
        replica_times_s=replica_times,
        allreduce_time_s=allreduce,
        optimizer_time_s=optimizer,
        stages=stages,
        memory_ok=memory_ok,
        outer_sync_time_s=outer,
        replica_starts_s=tuple(starts),
    )


def _sharded(
    problem: PlanningProblem, layout: Layout, stages: tuple[tuple[StageCost, ...], ...]
) -> tuple[tuple[StageCost, ...], ...]:
    """``stages`` with each stage's memory less the optimizer state ZeRO stage 1 leaves on
    other devices, and under stage 2 less the flat gradient copies (``cost.zero``)."""
    saving = state_saving_bytes(problem, layout, layout.optimizer_shard_weights)
    if layout.zero_stage == 2:
        for d, num_bytes in gradient_saving_bytes(problem, layout).items():
            saving[d] += num_bytes
    return tuple(
        tuple(replace(c, memory_bytes=c.memory_bytes - saving[c.device_idx]) for c in costs)
        for costs in stages
    )


def _less(
    stages: tuple[tuple[StageCost, ...], ...], saving: dict[int, float]
) -> tuple[tuple[StageCost, ...], ...]:
    """``stages`` with each device's memory less its ``saving`` (offload: ``cost.offload``)."""
    return tuple(
        tuple(
            replace(c, memory_bytes=c.memory_bytes - saving.get(c.device_idx, 0.0)) for c in costs
        )
        for costs in stages
    )


def unsummed_flat_copy_bytes(problem: PlanningProblem, layout: Layout) -> dict[int, float]:
    """Device index -> the flat gradient copy its stage's static memory counts but no
    all-reduce makes: every unit's static memory holds one (``problem_builder``,
    conservative), the runtime's buckets only the gradients a rank sums every step with
    another (``holders.grad_buckets``: not those of a unit it alone holds, nor under local
    sync those whose other holders are all in other islands). Per single card (a TP
    group's card keeps the conservative count)."""
    summed: dict[int, float] = defaultdict(float)
    for group, num_bytes in step_sync_groups(problem, layout).items():
        for d in group:
            summed[d] += num_bytes
    out = {}
    for replica in layout.replicas:
        for stage in replica.stages:
            d = stage.device_idx
            if problem.degree(d) > 1:
                continue
            counted = float(problem.grad_bytes[stage.unit_start : stage.unit_stop].sum())
            out[d] = max(0.0, counted - summed.get(d, 0.0))
    return out


def standalone_samples_per_s(problem: PlanningProblem, device_idx: int) -> float:
    """Samples/s of one device training the whole model alone at its best micro-batch size.

    When the whole model does not fit the device, its compute-only rate at the best
    micro-batch whose activations fit is used instead. A relative speed only (the report's
    ``relative_speed``), not a bound: a device holding part of the model in a pipeline can
    run larger micro-batches than fit it alone (the bound is ``solve.bound``'s).
    """
    best = 0.0
    fallback = 0.0
    u = problem.num_units
    for k, b in enumerate(problem.micro_batch_sizes):
        compute = stage_compute_time_s(problem, device_idx, 0, u, k)
        rate = b / compute if compute > 0 else 0.0
        capacity = problem.memory_capacity_bytes[device_idx]
        acts = problem.activation_bytes_on(device_idx).sum() * b
        if stage_memory_bytes(problem, 0, u, b, 1, device_idx=device_idx) <= capacity:
            best = max(best, rate)
        if acts <= capacity or k == 0:
            fallback = max(fallback, rate)
    return best if best > 0 else fallback
