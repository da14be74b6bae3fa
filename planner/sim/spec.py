"""Build the simulator's input (``SimSpec``) from a plan or from a solver layout.

:func:`spec_from_plan` reads a ``Plan`` alone (what ``hplan simulate`` reads);
:func:`spec_from_layout` reads the solver's ``(PlanningProblem, Layout)`` with the cost
model's arrays, or with the bytes the plan's runtime will send and sum
(:class:`RuntimeBytes`): then a layout simulates to exactly what its plan will, and the
solver's simulation of the chosen layout is the plan's ``simulated_step_time_s``. Both
follow the runtime: the all-reduce groups are holder sets (tied parameters included), and
under local sync a holder set spanning islands sums every step only inside each island
(``holders.step_holders``) and syncs its pseudo-gradients in the outer round
(``SimSpec.outer_syncs``). :func:`param_wire_bytes` gives the per-parameter bytes the
runtime all-reduces, from which ``holders.grad_sync_reports`` computes a report's bytes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import TYPE_CHECKING

import numpy as np

from hplan.planner.cost.evaluate import (
    island_index,
    largest_unit_share,
    outer_link,
    outer_sync_groups,
    set_unit_bytes,
    slowest_link,
    step_sync_groups,
)
from hplan.planner.cost.layout import Layout, ReplicaLayout
from hplan.planner.cost.microbatch import stage_passes
from hplan.planner.cost.offload import stage_optimizer_time_s
from hplan.planner.cost.problem import PlanningProblem
from hplan.planner.cost.sync_cost import (
    OuterLink,
    outer_codec_time_s,
    outer_transfer_time_s,
    pseudo_gradient_bytes,
    split_by_island,
)
from hplan.planner.sim.engine import (
    SimChannel,
    SimLink,
    SimOuterSync,
    SimReplica,
    SimSpec,
    SimStage,
    SimSyncGroup,
    simulate,
)
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.holders import (
    RankSet,
    holders,
    island_of_rank,
    outer_groups,
    outer_island_holders,
    parameter_holders,
    shared_bytes,
)
from hplan.runtime.contract.link_model import ring_all_reduce_time_s
from hplan.runtime.contract.plan import (
    OuterSyncSpec,
    Plan,
    Precision,
    RankPlan,
    RankReport,
    Schedule,
    SyncMode,
    TensorSpec,
    microbatch_sizes,
    wire_spec,
)

if TYPE_CHECKING:
    from hplan.planner.frontend.cost_graph import ModelGraph

WIRE_BYTES_MIN = 4
"""The runtime sums gradients in float32 or wider (``grad_sync.wire_dtype``)."""

MAX_SIMULATED_MICROBATCHES = 4096
"""Replicas with more micro-batches per step than this are not simulated (the event list
grows with micro-batches x stages; such plans are far from pipeline-bubble territory, where
the cost model's closed form is exact enough)."""


def too_many_microbatches(num_samples: int, micro_batch_size: int) -> bool:
    """True when a replica's micro-batch count exceeds ``MAX_SIMULATED_MICROBATCHES``."""
    return math.ceil(num_samples / micro_batch_size) > MAX_SIMULATED_MICROBATCHES


# --------------------------------------------------------------------------- from a plan
def spec_from_plan(plan: Plan, *, scale_partial_microbatches: bool = False) -> SimSpec:
    """The simulator's view of ``plan``.

    Compute times are the report's per-rank predictions (``RankReport.forward_time_s`` ...);
    link bytes are the exact bytes the runtime sends for each micro-batch (``CutSpec``
    tensors, gradients only for those that need one); the all-reduce groups are the holder
    sets the runtime buckets by (``Report.grad_sync``). A last micro-batch smaller than the
    others is charged what the report predicts for it (``RankReport.last_forward_time_s``);
    without that prediction a full one, as a rehearsal of a GPU plan replays it;
    ``scale_partial_microbatches=True`` scales it by its size instead (what stretched CPU
    compute does in a rehearsal of a cpu plan). A stage run by a TP group is simulated on
    its lead (``Plan.replica_ranks``), with the lead's report times, which price the
    group's per-layer collectives in (the plan records no TP bytes to time them apart);
    its gradient groups are those of TP position 0 (``Report.grad_sync``), the other
    positions' rings running beside them on their own cards.

    Raises:
        ConfigError: the report has no per-rank forward/backward prediction (a plan from an
            older hplan or a placeholder report), re-run ``hplan solve``; or a replica has
            more than ``MAX_SIMULATED_MICROBATCHES`` micro-batches per step.
    """
    for rank in plan.ranks:
        if too_many_microbatches(rank.num_samples, rank.micro_batch_size):
            count = math.ceil(rank.num_samples / rank.micro_batch_size)
            raise ConfigError(
                f"rank {rank.rank} runs {count} micro-batches per step; the simulator handles "
                f"at most {MAX_SIMULATED_MICROBATCHES}: solve with a smaller global batch or "
                "larger micro-batches"
            )
    reports = {r.rank: r for r in plan.report.ranks}
    missing = [r.rank for r in plan.ranks if _no_prediction(reports.get(r.rank))]
    if missing:
        raise ConfigError(
            f"plan report has no forward/backward time for rank {missing[0]}; re-run "
            "`hplan solve` with this hplan to get per-rank predictions"
        )
    replicas = tuple(
        _plan_replica(plan, plan.replica_ranks(r), reports, scale_partial_microbatches)
        for r in range(plan.num_replicas)
    )
    notes: tuple[str, ...] = ()
    recorded = plan.report.grad_sync
    if recorded is None and plan.world_size > 1:
        notes = (
            "the plan's report has no gradient sizes, so the all-reduce is not simulated; "
            "re-run `hplan solve` with this hplan",
        )
    leads = {r.rank for r in plan.ranks if r.tp_rank == 0}
    groups, outer = _plan_groups(
        plan, {g.ranks: float(g.num_bytes) for g in recorded or () if set(g.ranks) <= leads}
    )
    if plan.training.zero_stage >= 1:
        replicas = _with_allgather(replicas, groups)
    return SimSpec(
        replicas=replicas,
        sync_groups=groups,
        schedule=plan.training.schedule,
        notes=notes,
        outer_syncs=outer,
    )


def _no_prediction(report: RankReport | None) -> bool:
    return report is None or report.forward_time_s + report.backward_time_s <= 0


def _plan_replica(
    plan: Plan,
    ranks: Sequence[RankPlan],
    reports: Mapping[int, RankReport],
    scale_partial: bool,
) -> SimReplica:
    first = ranks[0]
    sizes = microbatch_sizes(first.num_samples, first.micro_batch_size)
    factors = _compute_factors(sizes, first.micro_batch_size, scale_partial)
    stages = []
    for rank in ranks:
        report = reports[rank.rank]
        forward = [report.forward_time_s * f for f in factors]
        backward = [report.backward_time_s * f for f in factors]
        if report.last_forward_time_s > 0 and not scale_partial:
            forward[-1], backward[-1] = report.last_forward_time_s, report.last_backward_time_s
        stages.append(
            SimStage(
                rank=rank.rank,
                device=rank.device_kind,
                forward_s=tuple(forward),
                backward_s=tuple(backward),
                optimizer_s=report.optimizer_time_s,
                tp_degree=rank.tp_degree,
            )
        )
    links = tuple(_plan_link(plan, a, b, sizes) for a, b in pairwise(ranks))
    return SimReplica(stages=tuple(stages), links=links, microbatch_sizes=sizes)


def _compute_factors(sizes: Sequence[int], full: int, scale_partial: bool) -> tuple[float, ...]:
    return tuple(size / full if scale_partial else 1.0 for size in sizes)


def _plan_link(plan: Plan, a: RankPlan, b: RankPlan, sizes: Sequence[int]) -> SimLink:
    spec = plan.link(a.device, b.device)
    cut = plan.cut_after(a.units[-1])
    forward, backward = cut_bytes([wire_spec(t, a.precision) for t in cut.tensors], sizes)
    channel = SimChannel(spec.bandwidth_bytes_per_s, spec.latency_s)
    return SimLink(channel, channel, forward, backward)


def cut_bytes(
    tensors: Sequence[TensorSpec], sizes: Sequence[int]
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Bytes the runtime sends across a cut for each micro-batch of ``sizes`` samples:
    (activations forward, gradients back: only the tensors that need one)."""
    forward = tuple(float(sum(t.num_bytes(n) for t in tensors)) for n in sizes)
    backward = tuple(float(sum(t.num_bytes(n) for t in tensors if t.requires_grad)) for n in sizes)
    return forward, backward


def _plan_groups(
    plan: Plan, recorded: Mapping[RankSet, float]
) -> tuple[tuple[SimSyncGroup, ...], tuple[SimOuterSync, ...]]:
    """The recorded holder sets as what sums every step and, under local sync, the outer
    syncs of the sets spanning islands (``holders.outer_groups``)."""
    local = {
        ranks: spec
        for ranks, spec in outer_groups(plan).items()
        if spec.mode is not SyncMode.ALL_REDUCE and ranks in recorded
    }
    names = island_of_rank(plan)
    index = {name: i for i, name in enumerate(sorted(set(names.values())))}
    inner, spanning = split_by_island(
        {r: b for r, b in recorded.items() if r in local}, {r: index[n] for r, n in names.items()}
    )
    for ranks, num_bytes in recorded.items():
        if ranks not in local and len(ranks) > 1:
            inner[ranks] = inner.get(ranks, 0.0) + num_bytes
    groups = tuple(_plan_group(plan, ranks, b) for ranks, b in sorted(inner.items()))
    outer = tuple(_plan_outer(plan, local[ranks], b) for ranks, b in sorted(spanning.items()))
    return groups, outer


def _plan_group(plan: Plan, ranks: RankSet, num_bytes: float) -> SimSyncGroup:
    bandwidth_bytes_per_s, latency_s = plan.ring_channel([plan.ranks[r].device for r in ranks])
    return SimSyncGroup(
        ranks=tuple(sorted(ranks)),
        num_bytes=num_bytes,
        bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        latency_s=latency_s,
    )


def _plan_outer(plan: Plan, spec: OuterSyncSpec, gradient_bytes: float) -> SimOuterSync:
    """The outer sync of ``spec`` whose gradients are ``gradient_bytes`` (float32), its T
    over the plan's links (``sync_cost.outer_transfer_time_s``)."""
    wire_bytes = pseudo_gradient_bytes(gradient_bytes, spec.wire_dtype)
    group = _plan_group(plan, spec.ranks, wire_bytes)
    link = _plan_outer_link(plan, spec)
    return SimOuterSync(
        ranks=group.ranks,
        num_bytes=wire_bytes,
        bandwidth_bytes_per_s=group.bandwidth_bytes_per_s,
        latency_s=group.latency_s,
        mode=spec.mode,
        local_steps=spec.local_steps,
        num_fragments=spec.num_fragments,
        overlap_steps=spec.overlap_steps,
        transfer_s=outer_transfer_time_s(spec.wire_dtype, gradient_bytes, link),
        largest_share=_largest_parameter_share(plan, spec.ranks),
        codec_s=outer_codec_time_s(spec.wire_dtype, gradient_bytes, len(link.island_links)),
    )


def _largest_parameter_share(plan: Plan, ranks: RankSet) -> float:
    """The largest parameter held by exactly ``ranks`` as a share of their bytes (what
    ``holders.outer_fragments`` cannot cut); 0 when the plan records no parameter sizes."""
    recorded = plan.memory.parameters if plan.memory is not None else ()
    sizes = {p.name: p.num_elements * max(WIRE_BYTES_MIN, p.element_bytes) for p in recorded}
    held = [
        sizes.get(name, 0) for name, owners in parameter_holders(plan).items() if owners == ranks
    ]
    total = sum(held)
    return max(held) / total if total > 0 else 0.0


def _plan_outer_link(plan: Plan, spec: OuterSyncSpec) -> OuterLink:
    """The links of a spanning set of ``plan``: its ring's, its island leads' and each
    island's (``holders.outer_island_holders``, the runtime's exchange;
    ``Plan.ring_channel``)."""
    parts = list(outer_island_holders(plan, spec).values())

    def channel(members: Sequence[int]) -> tuple[float, float]:
        if len(members) < 2:
            return math.inf, 0.0
        return plan.ring_channel([plan.ranks[r].device for r in members])

    return OuterLink(
        len(spec.ranks),
        *channel(spec.ranks),
        *channel([part[0] for part in parts]),
        tuple((len(part), *channel(part)) for part in parts),  # type: ignore[misc]
    )


# --------------------------------------------------------------------------- from a layout
@dataclass(frozen=True)
class RuntimeBytes:
    """The bytes the runtime of a plan sends across each cut and sums per bucket.

    With them a layout is simulated exactly as the plan built from it will be
    (:func:`spec_from_plan`): cut tensors at each micro-batch's real size, gradients in
    their wire dtype, grouped by the ranks holding each parameter. Without them the cost
    model's arrays stand in (``PlanningProblem.cut_bytes``, ``cut_grad_bytes``,
    ``grad_bytes``).
    """

    cuts: tuple[tuple[TensorSpec, ...], ...]
    """cuts[i]: the tensors crossing the cut after unit i (``ModelGraph.cuts``)."""
    unit_params: tuple[tuple[str, ...], ...]
    """Canonical names of each unit's parameters (``UnitSpec.params``)."""
    wire_bytes: Mapping[str, int]
    """Canonical name -> bytes all-reduced per trainable parameter (:func:`param_wire_bytes`)."""

    @staticmethod
    def of(graph: ModelGraph, sender: Precision = Precision.FP32) -> RuntimeBytes:
        """What a model graph's plans will send and sum, cut tensors as ranks computing
        in ``sender`` precision send them (``contract.plan.wire_spec``)."""
        return RuntimeBytes(
            cuts=tuple(tuple(wire_spec(t, sender) for t in cut) for cut in graph.cuts),
            unit_params=tuple(u.params for u in graph.units),
            wire_bytes=param_wire_bytes(graph),
        )


def spec_from_layout(
    problem: PlanningProblem,
    layout: Layout,
    schedule: Schedule = Schedule.ONE_F_ONE_B,
    runtime: RuntimeBytes | None = None,
) -> SimSpec:
    """The simulator's view of a solver layout, from the cost model's arrays.

    Ranks are numbered like the plan's (sorted device indices). Gradient groups are the
    holder sets of each unit, merged by holder set (as ``evaluate.allreduce_time_s``). Every
    micro-batch is charged the compute of its own size, as the cost model does
    (``cost.microbatch``).

    Args:
        runtime: the bytes the plan's runtime will send and sum; given, the layout is
            simulated exactly as :func:`spec_from_plan` simulates its plan.
    """
    rank_of = {d: r for r, d in enumerate(sorted(layout.device_indices))}
    replicas = tuple(_layout_replica(problem, r, rank_of, runtime, layout) for r in layout.replicas)
    groups, outer = (
        _layout_groups(problem, layout, rank_of)
        if runtime is None
        else _runtime_groups(problem, layout, rank_of, runtime)
    )
    if layout.optimizer_shard_weights:
        replicas = _with_allgather(replicas, groups)
    return SimSpec(replicas=replicas, sync_groups=groups, schedule=schedule, outer_syncs=outer)


def _with_allgather(
    replicas: tuple[SimReplica, ...], groups: Sequence[SimSyncGroup]
) -> tuple[SimReplica, ...]:
    """ZeRO stage 1: every rank waits, after its optimizer step, for the slowest rank's
    all-gathers of its holder sets' updated parameters (each half a ring all-reduce of the
    set's bytes over its channel, as ``cost.zero.allgather_time_s``), which start once the
    slowest optimizer step is done: each rank's optimizer time becomes the slowest one's
    plus the gathers."""
    per_rank: dict[int, float] = defaultdict(float)
    for group in groups:
        if len(group.ranks) < 2:
            continue
        ring_s = ring_all_reduce_time_s(
            len(group.ranks), group.num_bytes, group.bandwidth_bytes_per_s, group.latency_s
        )
        for rank in group.ranks:
            per_rank[rank] += ring_s / 2
    gather_s = max(per_rank.values(), default=0.0)
    if gather_s <= 0:
        return replicas
    slowest_s = max(s.optimizer_s for r in replicas for s in r.stages)
    return tuple(
        replace(r, stages=tuple(replace(s, optimizer_s=slowest_s + gather_s) for s in r.stages))
        for r in replicas
    )


def _layout_replica(
    problem: PlanningProblem,
    replica: ReplicaLayout,
    rank_of: Mapping[int, int],
    runtime: RuntimeBytes | None,
    layout: Layout | None = None,
) -> SimReplica:
    """One replica of a layout (``layout``: whose devices offload their optimizer step,
    ``cost.offload``; None: none does)."""
    sizes = microbatch_sizes(replica.num_samples, replica.micro_batch_size)
    # Each micro-batch at its size (``cost.microbatch``); a recomputing stage runs its
    # forward (selective: its recomputed units') again inside each backward.
    passes = stage_passes(problem, replica.stages, np.array(sizes, dtype=float))
    stages = []
    for s, stage in enumerate(replica.stages):
        d = stage.device_idx
        stages.append(
            SimStage(
                rank=rank_of[d],
                device=problem.device_kinds[d],
                forward_s=tuple(float(x) for x in passes.forward_s[s]),
                backward_s=tuple(float(x) for x in passes.backward_s[s]),
                optimizer_s=stage_optimizer_time_s(
                    problem, layout or Layout(()), d, stage.unit_start, stage.unit_stop
                ),
            )
        )
    links = []
    for a, b in pairwise(replica.stages):
        cut = a.unit_stop - 1
        if runtime is None:
            forward = tuple(problem.cut_bytes(cut, n) for n in sizes)
            backward = tuple(problem.cut_grad_bytes(cut, n) for n in sizes)
        else:
            forward, backward = cut_bytes(runtime.cuts[cut], sizes)
        links.append(
            SimLink(
                forward=_problem_channel(problem, a.device_idx, b.device_idx),
                backward=_problem_channel(problem, b.device_idx, a.device_idx),
                forward_bytes=forward,
                backward_bytes=backward,
            )
        )
    return SimReplica(stages=tuple(stages), links=tuple(links), microbatch_sizes=sizes)


def _problem_channel(problem: PlanningProblem, a: int, b: int) -> SimChannel:
    return SimChannel(
        float(problem.bandwidth_bytes_per_s[a, b]) if a != b else math.inf,
        float(problem.latency_s[a, b]) if a != b else 0.0,
    )


def _sync_group(
    problem: PlanningProblem, devices: Sequence[int], ranks: Sequence[int], num_bytes: float
) -> SimSyncGroup:
    bandwidth_bytes_per_s, latency_s = slowest_link(problem, tuple(devices))
    return SimSyncGroup(
        ranks=tuple(sorted(ranks)),
        num_bytes=num_bytes,
        bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        latency_s=latency_s,
    )


def _layout_groups(
    problem: PlanningProblem, layout: Layout, rank_of: Mapping[int, int]
) -> tuple[tuple[SimSyncGroup, ...], tuple[SimOuterSync, ...]]:
    """The cost model's holder sets: what sums every step, and the outer syncs."""
    groups = [
        _sync_group(problem, devices, [rank_of[d] for d in devices], num_bytes)
        for devices, num_bytes in step_sync_groups(problem, layout).items()
    ]
    outer = [
        _outer_sync(problem, layout, devices, [rank_of[d] for d in devices], num_bytes)
        for devices, num_bytes in outer_sync_groups(problem, layout).items()
    ]
    return tuple(sorted(groups, key=lambda g: g.ranks)), tuple(sorted(outer, key=lambda g: g.ranks))


def _outer_sync(
    problem: PlanningProblem,
    layout: Layout,
    devices: Sequence[int],
    ranks: Sequence[int],
    gradient_bytes: float,
) -> SimOuterSync:
    """The outer sync of the spanning set of ``devices`` (ranks ``ranks``) whose gradients
    are ``gradient_bytes`` (float32), in its own sync (``IslandSync.of``)."""
    sync = layout.sync
    assert sync is not None
    key = tuple(sorted(devices))
    how = sync.of(key)
    link = outer_link(problem, sync, key)
    wire_bytes = pseudo_gradient_bytes(gradient_bytes, how.wire_dtype)
    group = _sync_group(problem, devices, ranks, wire_bytes)
    return SimOuterSync(
        ranks=group.ranks,
        num_bytes=wire_bytes,
        bandwidth_bytes_per_s=group.bandwidth_bytes_per_s,
        latency_s=group.latency_s,
        mode=how.mode,
        local_steps=how.local_steps,
        num_fragments=how.num_fragments,
        overlap_steps=how.overlap_steps,
        transfer_s=outer_transfer_time_s(how.wire_dtype, gradient_bytes, link),
        largest_share=largest_unit_share(set_unit_bytes(problem, layout).get(key, ())),
        codec_s=outer_codec_time_s(how.wire_dtype, gradient_bytes, len(link.island_links)),
    )


def _runtime_groups(
    problem: PlanningProblem, layout: Layout, rank_of: Mapping[int, int], runtime: RuntimeBytes
) -> tuple[tuple[SimSyncGroup, ...], tuple[SimOuterSync, ...]]:
    """The buckets the plan's runtime will sum, as ``holders.grad_sync_reports`` records them
    (split by island under local sync, as ``spec_from_plan`` splits them)."""
    stages = [s for replica in layout.replicas for s in replica.stages]
    held = holders(
        (
            rank_of[s.device_idx],
            (p for u in range(s.unit_start, s.unit_stop) for p in runtime.unit_params[u]),
        )
        for s in stages
    )
    device_of = {r: d for d, r in rank_of.items()}
    split = set(problem.tp_split_params)  # a rank of a tp-d group sums 1/d of each
    wire = {
        name: float(runtime.wire_bytes[name])
        / (problem.degree(device_of[held[name][0]]) if name in split else 1)
        for name in sorted(held)
        if name in runtime.wire_bytes
    }
    by_set = {ranks: float(int(b)) for ranks, b in shared_bytes(held, wire).items()}
    spanning: dict[RankSet, float] = {}
    if layout.sync is not None and layout.sync.local:
        islands = island_index(problem, layout.sync)
        by_set, spanning = split_by_island(by_set, {r: islands[d] for d, r in rank_of.items()})
    groups = [
        _sync_group(problem, [device_of[r] for r in ranks], ranks, num_bytes)
        for ranks, num_bytes in by_set.items()
    ]
    outer = [
        _outer_sync(
            problem,
            layout,
            [device_of[r] for r in ranks],
            ranks,
            num_bytes,
        )
        for ranks, num_bytes in spanning.items()
    ]
    return tuple(sorted(groups, key=lambda g: g.ranks)), tuple(sorted(outer, key=lambda g: g.ranks))


def simulated_step_time_s(
    problem: PlanningProblem,
    layout: Layout,
    schedule: Schedule = Schedule.ONE_F_ONE_B,
    runtime: RuntimeBytes | None = None,
) -> float | None:
    """Simulated step time of a solver layout (see :func:`spec_from_layout`); None when a
    replica has more than ``MAX_SIMULATED_MICROBATCHES`` micro-batches."""
    if any(too_many_microbatches(r.num_samples, r.micro_batch_size) for r in layout.replicas):
        return None
    return simulate(spec_from_layout(problem, layout, schedule, runtime)).step_time_s


# --------------------------------------------------------------------------- gradient sizes
def param_wire_bytes(graph: ModelGraph) -> dict[str, int]:
    """Canonical name -> bytes the runtime all-reduces for each trainable parameter.

    Elements times the wire dtype's size: float32, or the parameter's dtype when wider
    (``grad_sync.wire_dtype``). Names are canonical as in ``StageModule``.
    """
    return {
        name: size.numel * max(WIRE_BYTES_MIN, size.element_bytes)
        for name, size in graph.trainable_param_sizes.items()
    }
