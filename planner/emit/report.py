"""The plan's ``report``: predictions, solver facts and baselines (the "why" of a plan)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from hplan.planner.cost.evaluate import (
    candidate_index,
    evaluate,
    standalone_samples_per_s,
)
from hplan.planner.cost.layout import GroupSync, Layout, StageLayout
from hplan.planner.cost.microbatch import recomputed_forward_s, units_time_s
from hplan.planner.cost.offload import device_offloads, stage_optimizer_time_s
from hplan.planner.cost.problem import PlanningProblem
from hplan.planner.cost.zero import allgather_time_s
from hplan.planner.emit.plan_build import rank_of_device
from hplan.planner.frontend.tp_plan import NO_PLAN
from hplan.planner.solve.baselines import (
    data_parallel_equal,
    pipeline_possible,
    uniform_pipeline,
)
from hplan.planner.solve.bound import throughput_bound_samples_per_s
from hplan.planner.solve.idle import idle_reasons
from hplan.planner.solve.previous import PREVIOUS_BACKEND
from hplan.planner.solve.solver import SolveResult
from hplan.planner.solve.sync_choice import DEFAULT_MAX_LOCAL_STEPS, group_choices
from hplan.planner.textfmt import count
from hplan.runtime.contract.plan import (
    BaselineReport,
    IdleDeviceReport,
    RankReport,
    Report,
    SyncChoiceReport,
    microbatch_sizes,
)

_BASELINES = (
    ("data parallel, equal batches (DDP)", data_parallel_equal),
    ("uniform pipeline, equal layers and batches (Megatron/DeepSpeed)", uniform_pipeline),
)


def baseline_reports(problem: PlanningProblem) -> tuple[BaselineReport, ...]:
    """Predicted samples/s of each baseline on the same cluster (None: it does not fit).

    The uniform pipeline is left out where no pipeline of two stages exists (one device or
    one unit): it would be the data-parallel baseline under another name.
    """
    out = []
    for name, make in _BASELINES:
        if make is uniform_pipeline and not pipeline_possible(problem):
            continue
        layout = make(problem)
        if layout is None:
            out.append(BaselineReport(name=name, samples_per_s=None, note="does not fit in memory"))
            continue
        ev = evaluate(problem, layout)
        devices = len(layout.device_indices)
        replicas, stages = len(layout.replicas), layout.replicas[0].num_stages
        note = (
            f"{count(replicas, 'replica')} x {count(stages, 'stage')}, {count(devices, 'device')}"
        )
        out.append(BaselineReport(name=name, samples_per_s=ev.samples_per_s, note=note))
    return tuple(out)


def _rank_reports(
    problem: PlanningProblem, layout: Layout, result: SolveResult
) -> tuple[RankReport, ...]:
    ranks = rank_of_device(layout)
    speed = {d: standalone_samples_per_s(problem, d) for d in layout.device_indices}
    fastest = max(speed.values())
    reports = []
    gather_s = allgather_time_s(problem, layout)  # ZeRO-1: every rank waits for the shards
    for replica, replica_costs in zip(layout.replicas, result.evaluation.stages, strict=True):
        sizes = microbatch_sizes(
            replica.num_samples, min(replica.micro_batch_size, replica.num_samples)
        )
        for stage, cost in zip(replica.stages, replica_costs, strict=True):
            device = stage.device_idx
            again_s = recomputed_forward_s(problem, stage, (sizes[0], sizes[-1]))
            recomputed_s = float(again_s[0] * (replica.num_microbatches - 1) + again_s[1])
            reports.append(
                RankReport(
                    rank=ranks[device],
                    stage_time_per_microbatch_s=cost.compute_time_s + cost.link_time_s,
                    busy_time_s=cost.busy_time_s,
                    memory_bytes=round(cost.memory_bytes),
                    memory_capacity_bytes=round(float(problem.memory_capacity_bytes[device])),
                    relative_speed=speed[device] / fastest if fastest > 0 else 1.0,
                    forward_time_s=cost.full.forward_s,
                    backward_time_s=cost.full.backward_s,
                    last_forward_time_s=cost.last.forward_s if cost.last != cost.full else 0.0,
                    last_backward_time_s=cost.last.backward_s if cost.last != cost.full else 0.0,
                    optimizer_time_s=stage_optimizer_time_s(
                        problem, layout, device, stage.unit_start, stage.unit_stop
                    ),
                    memory_strategy_time_s=recomputed_s
                    + gather_s
                    + _offload_extra_s(problem, layout, stage),
                )
            )
    return tuple(sorted(reports, key=lambda r: r.rank))


def _offload_extra_s(problem: PlanningProblem, layout: Layout, stage: StageLayout) -> float:
    """What offloading the stage's optimizer step adds to it (0 where it does not)."""
    if not device_offloads(layout, stage.device_idx):
        return 0.0
    start, stop = stage.unit_start, stage.unit_stop
    own = float(problem.optimizer_time_s[stage.device_idx, start:stop].sum())
    return max(0.0, stage_optimizer_time_s(problem, layout, stage.device_idx, start, stop) - own)


REQUESTED = "requested: "
"""Prefix of ``SolveResult.source`` for a layout the user asked for (``--strategy ddp``)."""


def _source_note(result: SolveResult) -> tuple[str, ...]:
    """Where the layout came from; nothing for a baseline the user asked for (its own note
    says so)."""
    source = result.source
    if source.startswith(REQUESTED) or result.backend == PREVIOUS_BACKEND:
        return ()
    if source.startswith("baseline"):
        return (f"the {source} was the fastest layout found",)
    return (f"found by the search scenario: {source}",)


SMALL_BATCH_STATISTICS_SAMPLES = 16
"""Below this many samples a micro-batch's BatchNorm statistics are noisy enough to cost
accuracy (Wu and He, "Group Normalization", ECCV 2018, Figure 1: ResNet-50's ImageNet error
grows as BatchNorm's batch falls from 32 to 16 samples and below)."""


def batch_statistics_notes(layers: Sequence[str], layout: Layout) -> tuple[str, ...]:
    """The note on batch norm (``layers``: ``ModelGraph.batch_statistics``) when the layout
    splits the global batch: each micro-batch is normalised by its own statistics, the
    sizes it has, and the advice when they are small (empty without batch norm or split)."""
    sizes = [
        n for r in layout.replicas for n in microbatch_sizes(r.num_samples, r.micro_batch_size)
    ]
    total = sum(r.num_samples for r in layout.replicas)
    if not layers or max(sizes) >= total:
        return ()
    shown = ", ".join(layers[:3]) + (", ..." if len(layers) > 3 else "")
    span = f"{min(sizes)}" if min(sizes) == max(sizes) else f"{min(sizes)} to {max(sizes)}"
    small = (
        f"; below {SMALL_BATCH_STATISTICS_SAMPLES} samples its statistics are noisy (give "
        "larger --micro-batch-sizes where memory allows, or use GroupNorm)"
        if min(sizes) < SMALL_BATCH_STATISTICS_SAMPLES
        else ""
    )
    return (
        f"batch norm ({count(len(layers), 'layer')}: {shown}) normalises each micro-batch by "
        f"its own statistics (as under DDP without SyncBatchNorm): this plan's micro-batches "
        f"hold {span} of the {total} samples of a step, never fewer than 2{small}; the "
        "replicas average their running statistics after every step",
    )


def tp_notes(
    problem: PlanningProblem,
    result: SolveResult,
    *,
    forced: bool = False,
    refusal: str | None = None,
) -> tuple[str, ...]:
    """The report's lines on tensor parallelism: the TP groups chosen, and ONE line when
    they are GeForce cards over PCIe (chosen because nothing else fits, or because
    ``forced``: ``--tensor-parallel always``); without TP groups, why the model's own TP
    plan is not offered, when it has one (``refusal``: ``ModelGraph.tp_refusal``; a model
    without any plan gets no line). ``problem``: the solve's own (single cards). (``always``
    without TP is an error, ``api.generate_pass``, naming why.)"""
    tp_problem = result.tp_problem
    if tp_problem is None:
        if refusal is None or refusal == NO_PLAN:
            return ()
        return (f"tensor parallel: not offered: {refusal}",)
    used = sorted(set(result.layout.device_indices))
    grouped = [d for d in used if tp_problem.degree(d) > 1]
    groups = ", ".join("+".join(tp_problem.tp_members[d]) for d in grouped)
    degrees = "/".join(str(g) for g in sorted({tp_problem.degree(d) for d in grouped}))
    singles = len(used) - len(grouped)
    outside = problem.num_devices - sum(tp_problem.degree(d) for d in used)
    lines = [
        f"tensor parallel: stages on TP groups of {degrees} cards ({groups})"
        + (f", {count(singles, 'single card')} at tp1 beside them" if singles else "")
        + (f"; {count(outside, 'device')} of the cluster unused" if outside else "")
    ]
    if result.tp_over_pcie:
        why = (
            "as --tensor-parallel always asks"
            if forced
            else "because nothing else fits: without it no layout was found, or a layer fits "
            "no card alone"
        )
        lines.append(
            f"tensor parallelism over PCIe on GeForce cards (no peer-to-peer, no NVLink) {why}; "
            "its all-reduces are costed over the PCIe link"
        )
    return tuple(lines)


def build_report(
    problem: PlanningProblem,
    result: SolveResult,
    *,
    cost_source: str,
    notes: tuple[str, ...] = (),
    max_local_steps: int = DEFAULT_MAX_LOCAL_STEPS,
    baseline_problem: PlanningProblem | None = None,
) -> Report:
    """The report of the plan made from ``result``; ``problem`` is the one its layout
    indexes (``SolveResult.solved_problem``), ``baseline_problem`` the single cards' the
    baselines run on (default ``problem``).

    ``reference_time_per_sample_s``: forward + backward per sample of the whole model on the
    plan's fastest device at the plan's largest micro-batch size (rehearsal's time unit).
    ``sync_choices``: one per holder set spanning the islands of a local layout
    (``sync_choice.group_choices``; ``max_local_steps``: the bound its H was chosen under).
    """
    layout = result.layout
    ev = result.evaluation
    bound = result.bound_samples_per_s
    if bound is None or result.tp_problem is not None:
        # TP groups fit what single cards cannot: the bound of their problem counts too
        bound = max(bound or 0.0, throughput_bound_samples_per_s(problem))
    bound = bound if math.isfinite(bound) else 0.0
    replica, stage = ev.bottleneck
    bottleneck_device = layout.replicas[replica].stages[stage].device_idx
    fastest = max(layout.device_indices, key=lambda d: (standalone_samples_per_s(problem, d), -d))
    reference_mbs = max(r.micro_batch_size for r in layout.replicas)
    reference_s = float(sum(units_time_s(problem, fastest, 0, problem.num_units, reference_mbs)))
    return Report(
        predicted_step_time_s=ev.step_time_s,
        predicted_samples_per_s=ev.samples_per_s,
        physical_bound_samples_per_s=bound,
        efficiency=ev.samples_per_s / bound if bound > 0 else 0.0,
        bottleneck_rank=rank_of_device(layout)[bottleneck_device],
        ranks=_rank_reports(problem, layout, result),
        solver_status=result.status,
        optimality_gap=result.gap,
        solver_backend=result.backend,
        cost_source=cost_source,
        reference_time_per_sample_s=reference_s / reference_mbs,
        reference_micro_batch_size=reference_mbs,
        baselines=baseline_reports(baseline_problem or problem),
        notes=(*notes, *_source_note(result), *result.notes),
        idle_devices=idle_device_reports(problem, result),
        sync_choices=sync_choice_reports(problem, layout, max_local_steps),
    )


def sync_choice_reports(
    problem: PlanningProblem, layout: Layout, max_local_steps: int
) -> tuple[SyncChoiceReport, ...]:
    """The report's ``sync_choices`` of ``layout``, in its plan's ranks, sorted by ranks."""
    ranks = rank_of_device(layout)
    reports = (
        SyncChoiceReport(
            ranks=tuple(sorted(ranks[d] for d in choice.devices)),
            mode=choice.mode,
            local_steps=choice.local_steps,
            all_reduce_time_s=choice.all_reduce_time_s,
            outer_sync_time_s=choice.outer_sync_time_s,
            exposed_time_per_step_s=choice.exposed_time_per_step_s,
            reason=choice.reason,
            **_sync_fields(choice.sync),
        )
        for choice in group_choices(problem, layout, max_local_steps)
    )
    return tuple(sorted(reports, key=lambda r: r.ranks))


def _sync_fields(how: GroupSync | None) -> dict[str, Any]:
    """A choice's fragments, overlap and wire format (the defaults without one)."""
    if how is None:
        return {}
    return {
        "num_fragments": how.num_fragments,
        "overlap_steps": how.overlap_steps,
        "wire_dtype": how.wire_dtype,
    }


def idle_device_reports(
    problem: PlanningProblem, result: SolveResult
) -> tuple[IdleDeviceReport, ...]:
    """Every device the layout leaves idle, with the reason ``solve.idle`` computes."""
    return tuple(
        IdleDeviceReport(
            device=problem.device_names[idle.device_idx],
            kind=problem.device_kinds[idle.device_idx],
            reason=idle.reason,
        )
        for idle in idle_reasons(problem, result.layout, result.evaluation)
    )


def with_cost_sources(
    report: Report,
    problem: PlanningProblem,
    layout: Layout,
    labels: Sequence[Sequence[Sequence[str]]],
    *,
    source_name: str,
) -> Report:
    """``report`` with each rank's ``cost_source`` and an overall summary filled in.

    Args:
        labels: where each number came from, indexed (device, unit, micro-batch size index)
            like ``problem.fwd_time_s``.
        source_name: the time source's name (``profile prof/``).

    Returns:
        The report; a rank's ``cost_source`` joins the distinct labels of its units at its
        micro-batch size with ``"; "``, and ``Report.cost_source`` is ``"<source_name>:
        <every label used>"``.
    """
    ranks = rank_of_device(layout)
    by_rank: dict[int, list[str]] = {}
    for replica in layout.replicas:
        k = candidate_index(problem, replica.micro_batch_size)
        for stage in replica.stages:
            device = stage.device_idx
            units = range(stage.unit_start, stage.unit_stop)
            by_rank[ranks[device]] = list(dict.fromkeys(labels[device][u][k] for u in units))
    rank_reports = tuple(
        replace(r, cost_source="; ".join(by_rank[r.rank])) if r.rank in by_rank else r
        for r in report.ranks
    )
    used = dict.fromkeys(label for rank in sorted(by_rank) for label in by_rank[rank])
    return replace(report, ranks=rank_reports, cost_source=f"{source_name}: {'; '.join(used)}")
