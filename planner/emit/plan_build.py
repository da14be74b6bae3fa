"""Turn a solver ``Layout`` into a ``Plan`` (pure: no solving, no I/O)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from hplan.planner.cost.islands import island_names
from hplan.planner.cost.layout import IslandSync, Layout
from hplan.planner.cost.offload import device_offloads
from hplan.planner.cost.problem import PlanningProblem
from hplan.planner.frontend.cost_graph import ModelGraph, UnitCost
from hplan.runtime.contract.errors import InfeasiblePlanError
from hplan.runtime.contract.holders import grad_sync_reports, outer_groups
from hplan.runtime.contract.memory import memory_problems, plan_memory
from hplan.runtime.contract.plan import (
    ClusterSpec,
    CutSpec,
    IslandSpec,
    LossConvention,
    MemoryModelSpec,
    ModelSpec,
    OuterSyncSpec,
    ParameterSpec,
    Plan,
    Precision,
    RankPlan,
    Report,
    SyncSpec,
    TrainingSpec,
    UnitMemorySpec,
)


def model_spec(
    graph: ModelGraph,
    *,
    path: str,
    sha256: str,
    loss_convention: LossConvention = LossConvention.SAMPLE_MEAN,
) -> ModelSpec:
    """The plan's record of the model, how to re-trace it, what its loss averages over
    (the trains check's finding) and its tensor-parallel plan (empty when refused)."""
    return ModelSpec(
        path=path,
        sha256=sha256,
        trace_method=graph.trace_method,
        leaf_modules=graph.leaf_modules,
        graph_fingerprint=graph.graph_fingerprint,
        inputs=graph.inputs,
        param_dtype=graph.param_dtype,
        loss_convention=loss_convention,
        tp_plan=graph.tp_plan,
    )


def rank_of_device(layout: Layout) -> dict[int, int]:
    """Global rank of each used device index: ranks follow device order (node by node)."""
    return {d: rank for rank, d in enumerate(sorted(layout.device_indices))}


def build_plan(
    *,
    graph: ModelGraph,
    model: ModelSpec,
    cluster: ClusterSpec,
    device_names: tuple[str, ...],
    layout: Layout,
    global_batch_size: int,
    report: Report,
    training: TrainingSpec,
    precisions: Mapping[str, Precision] | None = None,
    tp_members: tuple[tuple[str, ...], ...] = (),
) -> Plan:
    """Assemble and verify the plan.

    Ranks are numbered by node (in cluster order), then by device index on the node, so the
    ranks of one node are contiguous and every launch script can compute them statically.

    Args:
        device_names: the problem's device names; ``layout`` indexes into them.
        precisions: device name -> the precision its rank computes in (default fp32).
        tp_members: the cards of each device's TP group, lead first
            (``PlanningProblem.tp_members``; empty: no TP): each stage becomes a TP group of
            consecutive ranks in ``tp_rank`` order, and each of ``report``'s ranks (numbered
            as ``rank_of_device`` numbers the devices) the same report for each of them.

    Raises:
        PlanFileError: the assembled plan is inconsistent (a bug upstream).
    """
    members = tp_members or tuple((name,) for name in device_names)
    ranks, cut_idx = _rank_plans(graph, cluster, members, layout, precisions or {})
    report = expanded_report(report, layout, tuple(len(m) for m in members))
    unit_names = [u.name for u in graph.units]
    cuts = tuple(CutSpec(after_unit=unit_names[i], tensors=graph.cuts[i]) for i in cut_idx)
    plan = Plan(
        model=model,
        global_batch_size=global_batch_size,
        units=graph.units,
        cuts=cuts,
        cluster=cluster,
        training=training,
        ranks=ranks,
        report=report,
    )
    device_of = {name: d for d, names in enumerate(members) for name in names}
    plan = with_islands(plan, layout.sync, device_of)
    plan.verify()
    return plan


def with_islands(
    plan: Plan, sync: IslandSync | None, device_of: Mapping[str, int] | None = None
) -> Plan:
    """``plan`` whose ``TrainingSpec.sync`` holds the islands of ``sync`` (named by
    ``islands.island_names``) and every holder set spanning them (``holders.outer_groups``)
    syncing by its own mode, H, fragments, overlap and wire format (``IslandSync.of`` its
    devices; ``device_of``: device name -> the problem's device index, None: the plan's
    ranks are the device indices); ``plan`` itself without local sync."""
    if sync is None or not sync.local:
        return plan
    islands = tuple(
        IslandSpec(name=name, nodes=nodes)
        for name, nodes in zip(island_names(sync.islands), sync.islands, strict=True)
    )
    spec = SyncSpec(islands=islands)
    spanning = outer_groups(replace(plan, training=replace(plan.training, sync=spec)))
    groups = []
    for ranks in sorted(spanning):
        devices = tuple(
            sorted({r if device_of is None else device_of[plan.ranks[r].device] for r in ranks})
        )
        how = sync.of(devices)
        groups.append(
            OuterSyncSpec(
                ranks=ranks,
                mode=how.mode,
                local_steps=how.local_steps,
                num_fragments=how.num_fragments,
                wire_dtype=how.wire_dtype,
                overlap_steps=how.overlap_steps,
            )
        )
    return replace(plan, training=replace(plan.training, sync=replace(spec, groups=tuple(groups))))


def expanded_report(report: Report, layout: Layout, degrees: Sequence[int]) -> Report:
    """``report`` (numbered by ``rank_of_device``) with each device's rank report repeated
    for every card of its TP group (``degrees``: the group size of each device index), the
    ranks renumbered as :func:`_rank_plans` numbers them; ``report`` itself without TP."""
    if all(d == 1 for d in degrees):
        return report
    first: dict[int, int] = {}
    next_rank = 0
    for old, device in enumerate(sorted(layout.device_indices)):
        first[old] = next_rank
        next_rank += degrees[device]
    size = {old: degrees[d] for old, d in enumerate(sorted(layout.device_indices))}
    ranks = tuple(
        replace(r, rank=first[r.rank] + i) for r in report.ranks for i in range(size[r.rank])
    )
    sync = tuple(
        replace(c, ranks=tuple(first[r] + i for r in c.ranks for i in range(size[r])))
        for c in report.sync_choices
    )
    return replace(
        report,
        ranks=ranks,
        bottleneck_rank=first[report.bottleneck_rank],
        sync_choices=sync,
    )


def _rank_plans(
    graph: ModelGraph,
    cluster: ClusterSpec,
    members: tuple[tuple[str, ...], ...],
    layout: Layout,
    precisions: Mapping[str, Precision],
) -> tuple[tuple[RankPlan, ...], tuple[int, ...]]:
    """Every stage of every replica as a rank, or as a TP group of consecutive ranks (the
    cards of ``members`` of its device, in ``tp_rank`` order), in cluster device order of
    their first card; and the sorted indices of the cuts that fall between two stages."""
    unit_names = [u.name for u in graph.units]
    device_order = {d.name: i for i, d in enumerate(cluster.devices)}
    placed = []
    for replica_idx, replica in enumerate(layout.replicas):
        for stage_idx, stage in enumerate(replica.stages):
            for tp_rank, name in enumerate(members[stage.device_idx]):
                placed.append((name, tp_rank, replica_idx, stage_idx, replica, stage))
    lead = {item[0]: members[item[5].device_idx][0] for item in placed}
    placed.sort(key=lambda item: (device_order[lead[item[0]]], item[1]))
    local_counts: dict[str, int] = {}
    ranks = []
    cut_idx: set[int] = set()
    for rank, (device_name, tp_rank, replica_idx, stage_idx, replica, stage) in enumerate(placed):
        device = cluster.devices[device_order[device_name]]
        local_rank = local_counts.get(device.node, 0)
        local_counts[device.node] = local_rank + 1
        if stage_idx < replica.num_stages - 1:
            cut_idx.add(stage.unit_stop - 1)
        ranks.append(
            RankPlan(
                rank=rank,
                node=device.node,
                local_rank=local_rank,
                device=device_name,
                device_kind=device.kind,
                replica=replica_idx,
                stage=stage_idx,
                units=tuple(unit_names[stage.unit_start : stage.unit_stop]),
                micro_batch_size=replica.micro_batch_size,
                num_microbatches=replica.num_microbatches,
                num_samples=replica.num_samples,
                precision=precisions.get(device_name, Precision.FP32),
                memory_strategy=stage.memory_strategy,
                recompute_units=tuple(unit_names[u] for u in stage.recompute_units),
                optimizer_shard_weight=(
                    layout.optimizer_shard_weights[stage.device_idx]
                    if layout.optimizer_shard_weights
                    else 1.0
                ),
                optimizer_offload=device_offloads(layout, stage.device_idx),
                tp_degree=len(members[stage.device_idx]),
                tp_rank=tp_rank,
            )
        )
    return tuple(ranks), tuple(sorted(cut_idx))


def parameter_specs(graph: ModelGraph) -> tuple[ParameterSpec, ...]:
    """Each trainable parameter's name, elements and element bytes, as a plan carries them."""
    return tuple(
        ParameterSpec(name=name, num_elements=size.numel, element_bytes=size.element_bytes)
        for name, size in graph.trainable_param_sizes.items()
    )


def frozen_bytes(cost: UnitCost) -> int:
    """A unit's bytes that no optimizer updates: frozen parameters and buffers."""
    return cost.param_bytes - cost.trainable_param_bytes + cost.buffer_bytes


def memory_model_spec(graph: ModelGraph, problem: PlanningProblem) -> MemoryModelSpec:
    """The sizes a plan carries for its memory check (``contract.memory``): each trainable
    parameter's elements, each unit's activations per sample as the problem counts them
    (at its widest precision) and its frozen bytes (buffers and frozen parameters)."""
    factor = 0.0
    trainable = sum(c.trainable_param_bytes for c in graph.unit_costs)
    if problem.optimizer_state_bytes is not None and trainable > 0:
        factor = float(problem.optimizer_state_bytes.sum()) / trainable
    return MemoryModelSpec(
        optimizer_state_bytes_per_param_byte=factor,
        parameters=parameter_specs(graph),
        units=tuple(
            UnitMemorySpec(
                unit=unit.name,
                activation_bytes_per_sample=float(problem.activation_bytes_per_sample[u]),
                frozen_bytes=frozen_bytes(cost),
                input_bytes_per_sample=float(problem.cut_bytes_per_sample[u - 1]) if u else 0.0,
                tp_split_activation_bytes_per_sample=(
                    0.0
                    if problem.tensor_parallel is None
                    else float(problem.tensor_parallel.split_activation_bytes_per_sample[u])
                ),
            )
            for u, (unit, cost) in enumerate(zip(graph.units, graph.unit_costs, strict=True))
        ),
    )


def with_memory(plan: Plan, memory: MemoryModelSpec) -> Plan:
    """``plan`` carrying ``memory``, each rank's report holding its predicted memory by part
    (``contract.memory.rank_memory``: the formula every command re-checks at load).

    Raises:
        InfeasiblePlanError: some rank does not fit its device under the plan's own schedule
            (the solver sizes in-flight micro-batches the 1F1B way; GPipe keeps all of
            them): names the rank, and what to change.
    """
    plan = replace(plan, memory=memory)
    problems = memory_problems(plan)
    if problems:
        raise InfeasiblePlanError(
            f"the solver's layout does not fit under the plan's own schedule: {problems[0]}; "
            "use --schedule 1f1b, smaller micro-batches (--micro-batch-sizes) or "
            "--recompute always"
        )
    parts = plan_memory(plan)
    assert parts is not None
    ranks = tuple(
        replace(
            report,
            memory_bytes=round(part.total_bytes),
            parameter_memory_bytes=round(part.parameter_bytes),
            gradient_memory_bytes=round(part.gradient_bytes),
            optimizer_state_memory_bytes=round(part.optimizer_state_bytes),
            activation_memory_bytes=round(part.activation_bytes),
            workspace_memory_bytes=round(part.workspace_bytes),
            host_memory_bytes=round(part.host_bytes),
        )
        for report, part in zip(plan.report.ranks, parts, strict=True)
    )
    return replace(plan, report=replace(plan.report, ranks=ranks))


def with_grad_sync(
    plan: Plan, wire_bytes: Mapping[str, int], simulated_step_time_s: float | None
) -> Plan:
    """``plan`` whose report records its gradient buckets (``holders.grad_sync_reports``)
    and the simulated step time of its layout (the solver simulated it, with the bytes
    this plan sends: ``sim.spec.RuntimeBytes``; None when it was too large to simulate)."""
    report = replace(
        plan.report,
        grad_sync=grad_sync_reports(plan, wire_bytes),
        simulated_step_time_s=simulated_step_time_s,
    )
    return replace(plan, report=report)
