"""Import the study's measured plans as hplan ``Plan`` s, and simulate them as the study ran.

One node per (replica, stage) machine, holding one logical device (the tp group, see
``data.py``); the hplan replicas are the study's pipeline replicas, each processing
``gbs / replicas`` samples in micro-batches of ``mbs``. A cut carries what the study's runtime
(Megatron-DeepSpeed's pipeline engine) sends: the float32 hidden state ``(mbs, 2048, 1024)``
and back its gradient, no attention mask. Links are alpha-beta fits of the study's curves over
the message sizes the plan sends; the report's times are the imported profile's at
``(mbs, tp)``. :func:`study_sim_spec` adds what a plan cannot say: blocking point-to-point
(``SimSpec.blocking_p2p``) and the gradient all-reduce after the schedule.
"""

from __future__ import annotations

import math
from dataclasses import replace

from hplan.planner.sim.ir import SimSpec
from hplan.planner.sim.spec import spec_from_plan
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.holders import holders, shared_bytes
from hplan.runtime.contract.plan import (
    ClusterSpec,
    CutSpec,
    DeviceSpec,
    GradSyncReport,
    LinkSpec,
    MemoryModelSpec,
    ModelSpec,
    NodeSpec,
    Plan,
    RankPlan,
    RankReport,
    Report,
    SolverStatus,
    TensorSpec,
    TraceMethod,
    TrainingSpec,
    UnitMemorySpec,
    UnitSpec,
)

from .data import (
    ADAM_MIXED_BYTES_PER_PARAM,
    MODEL,
    TRAINING_DTYPE,
    BandwidthCurve,
    SailorData,
    curves_alpha_beta,
    device_kind,
    inter_node_curve,
    kind_figures,
    unit_name,
)
from .study import Machine, StudyPlan, StudyStage

GRAD_WIRE_BYTES = 4
"""Gradients are all-reduced in fp32 (checked: the study's ``red_grads`` of
``mit/plan_config_N4_D4`` is the ring time of 4 bytes per parameter)."""


# --------------------------------------------------------------------------- sizes
def hidden_state(data: SailorData) -> TensorSpec:
    """The one tensor that crosses a cut of the study's model, per sample."""
    return TensorSpec(
        name="hidden_states",
        shape=(1, data.seq_len, data.hidden),
        dtype=TRAINING_DTYPE,
        batch_dim=0,
        requires_grad=True,
    )


def grad_bytes(data: SailorData, layers: tuple[int, ...]) -> int:
    """fp32 gradient bytes of ``layers`` (the whole tp group's shards together)."""
    return sum(data.params_floats(layer, 1) for layer in layers) * GRAD_WIRE_BYTES


def stage_times_s(
    data: SailorData, machine: Machine, mbs: int, layers: tuple[int, ...]
) -> tuple[float, float, float]:
    """(forward, backward, optimizer) seconds of ``layers`` for one micro-batch (a size the
    study did not profile at this tp is fitted, see ``SailorData.fitted_layer_times``).

    Raises:
        ConfigError: the study did not profile this GPU at this (mbs, tp).
    """
    times = data.fitted_layer_times(machine.gpu, mbs, machine.tp)
    if times is None:
        raise ConfigError(
            f"the study has no profile of {machine.gpu} at tp {machine.tp}; choose a "
            "measured combination"
        )
    rows = [times[str(layer)] for layer in layers]
    return (sum(r[0] for r in rows), sum(r[1] for r in rows), sum(r[2] for r in rows))


def study_stage_memory_bytes(
    data: SailorData, machine: Machine, mbs: int, layers: tuple[int, ...], in_flight: int
) -> int:
    """Predicted peak of one GPU of the tp group: mixed-precision Adam state of its shard
    plus ``in_flight`` micro-batches of the study's per-layer activation memory."""
    info = data.llm_info[str(machine.tp)]
    state = sum(int(info[str(x)]["params_floats"]) for x in layers) * ADAM_MIXED_BYTES_PER_PARAM
    acts = sum(int(info[str(x)]["act_mem_bytes"]) for x in layers) * mbs * in_flight
    return state + acts


# --------------------------------------------------------------------------- plan
def import_study_plan(data: SailorData, study: StudyPlan) -> Plan:
    """The study plan as a verified hplan ``Plan`` (see the module docstring).

    Raises:
        ConfigError: a GPU, (mbs, tp) or network pair the study did not measure.
    """
    cluster, device_of = _cluster(data, study)
    ranks: list[RankPlan] = []
    reports: list[RankReport] = []
    for r, replica in enumerate(study.replicas):
        for s, stage in enumerate(replica):
            device = device_of[(r, s)]
            ranks.append(_rank(len(ranks), device, stage, r, s, study))
            reports.append(_rank_report(data, len(reports), stage, len(replica) - s, study))
    cut_after = sorted({stage.layers[-1] for replica in study.replicas for stage in replica[:-1]})
    cuts = tuple(CutSpec(after_unit=unit_name(x), tensors=(hidden_state(data),)) for x in cut_after)
    plan = Plan(
        model=_model_spec(),
        global_batch_size=study.gbs,
        units=tuple(
            UnitSpec(name=unit_name(i), nodes=(), params=(), buffers=())
            for i in range(data.num_layers)
        ),
        cuts=cuts,
        cluster=cluster,
        training=TrainingSpec(),
        ranks=tuple(ranks),
        report=_report(data, study, tuple(ranks), tuple(reports)),
        memory=_memory_spec(data),
    )
    plan.verify()
    return plan


def _memory_spec(data: SailorData) -> MemoryModelSpec:
    """The study model's sizes for the memory check at load (``plan.memory``). Its units
    name no parameters (the study gives counts, not tensors), so each layer's
    mixed-precision Adam state (``ADAM_MIXED_BYTES_PER_PARAM`` per parameter) is its
    ``frozen_bytes``, and its activations per sample are the study's ``act_mem_bytes``;
    both at tp 1, the whole layer (a tp group is one device with its GPUs' memory summed).
    """
    info = data.llm_info["1"]
    return MemoryModelSpec(
        optimizer_state_bytes_per_param_byte=0.0,
        parameters=(),
        units=tuple(
            UnitMemorySpec(
                unit=unit_name(i),
                activation_bytes_per_sample=float(info[str(i)]["act_mem_bytes"]),
                frozen_bytes=int(info[str(i)]["params_floats"]) * ADAM_MIXED_BYTES_PER_PARAM,
            )
            for i in range(data.num_layers)
        ),
    )


def _model_spec() -> ModelSpec:
    return ModelSpec(
        path=f"sailor:{MODEL}",
        sha256="",
        trace_method=TraceMethod.MODULES,
        leaf_modules=(),
        graph_fingerprint=f"sailor-{MODEL}",
        inputs=(),
        param_dtype=TRAINING_DTYPE,
    )


def _rank(
    rank: int, device: DeviceSpec, stage: StudyStage, replica: int, stage_idx: int, study: StudyPlan
) -> RankPlan:
    samples = study.samples_per_replica
    return RankPlan(
        rank=rank,
        node=device.node,
        local_rank=0,
        device=device.name,
        device_kind=device_kind(stage.machine.gpu, stage.machine.tp),
        replica=replica,
        stage=stage_idx,
        units=tuple(unit_name(x) for x in stage.layers),
        micro_batch_size=study.mbs,
        num_microbatches=math.ceil(samples / study.mbs),
        num_samples=samples,
    )


def _rank_report(
    data: SailorData, rank: int, stage: StudyStage, stages_left: int, study: StudyPlan
) -> RankReport:
    """``stages_left``: this stage and those after it (its 1F1B in-flight micro-batches)."""
    fwd_s, bwd_s, opt_s = stage_times_s(data, stage.machine, study.mbs, stage.layers)
    source = "imported (Sailor profile)"
    if data.layer_times(stage.machine.gpu, study.mbs, stage.machine.tp) is None:
        source = "imported (Sailor profile, fitted in micro-batch size)"
    num_mb = math.ceil(study.samples_per_replica / study.mbs)
    in_flight = min(stages_left, num_mb)
    return RankReport(
        rank=rank,
        stage_time_per_microbatch_s=fwd_s + bwd_s,
        busy_time_s=(fwd_s + bwd_s) * num_mb + opt_s,
        memory_bytes=study_stage_memory_bytes(
            data, stage.machine, study.mbs, stage.layers, in_flight
        ),
        memory_capacity_bytes=data.memory_per_gpu_bytes(stage.machine.gpu),
        forward_time_s=fwd_s,
        backward_time_s=bwd_s,
        optimizer_time_s=opt_s,
        cost_source=source,
    )


def study_grad_sync_reports(
    data: SailorData, ranks: tuple[RankPlan, ...]
) -> tuple[GradSyncReport, ...]:
    """The fp32 gradient all-reduce groups: per layer the ranks that hold it, merged by
    holder set (sorted by ranks), as hplan's runtime buckets them."""
    layer_holders = holders(
        (rank.rank, [int(u.removeprefix("layer")) for u in rank.units]) for rank in ranks
    )
    sizes = {layer: float(grad_bytes(data, (layer,))) for layer in layer_holders}
    groups = shared_bytes(layer_holders, sizes)
    return tuple(GradSyncReport(ranks=k, num_bytes=int(v)) for k, v in sorted(groups.items()))


def _report(
    data: SailorData,
    study: StudyPlan,
    ranks: tuple[RankPlan, ...],
    reports: tuple[RankReport, ...],
) -> Report:
    busiest = max(reports, key=lambda r: r.busy_time_s)
    return Report(
        predicted_step_time_s=0.0,
        predicted_samples_per_s=0.0,
        physical_bound_samples_per_s=0.0,
        efficiency=0.0,
        bottleneck_rank=busiest.rank,
        ranks=reports,
        solver_status=SolverStatus.HEURISTIC,
        optimality_gap=None,
        solver_backend="sailor (imported)",
        cost_source="imported (Sailor profile)",
        reference_time_per_sample_s=0.0,
        reference_micro_batch_size=study.mbs,
        notes=(
            f"imported from the Sailor study plan {study.name}: measured {study.real_s:g} s "
            "per iteration",
        ),
        grad_sync=study_grad_sync_reports(data, ranks),
    )


# --------------------------------------------------------------------------- cluster
def _cluster(
    data: SailorData, study: StudyPlan
) -> tuple[ClusterSpec, dict[tuple[int, int], DeviceSpec]]:
    """One node per (replica, stage) machine; ``device_of[(replica, stage)]``."""
    nodes, device_of, machine_of = [], {}, {}
    for r, replica in enumerate(study.replicas):
        for s, stage in enumerate(replica):
            node = f"r{r}s{s}-{stage.machine.gpu.lower()}"
            device = _device(data, node, stage.machine)
            nodes.append(NodeSpec(name=node, host=node, devices=(device.name,)))
            device_of[(r, s)] = device
            machine_of[device.name] = stage.machine
    devices = tuple(device_of.values())
    lo_bytes, hi_bytes = message_size_range(data, study)
    links = []
    for i, a in enumerate(devices):
        for b in devices[i + 1 :]:
            ma, mb = machine_of[a.name], machine_of[b.name]
            curves = [_curve(data, study, ma, mb), _curve(data, study, mb, ma)]
            bandwidth, latency = curves_alpha_beta(curves, lo_bytes, hi_bytes)
            links.append(
                LinkSpec(a=a.name, b=b.name, bandwidth_bytes_per_s=bandwidth, latency_s=latency)
            )
    name = f"sailor-{study.name.replace('/', '-')}"
    cluster = ClusterSpec(name=name, nodes=tuple(nodes), devices=devices, links=tuple(links))
    return cluster, device_of


def _curve(data: SailorData, study: StudyPlan, src: Machine, dst: Machine) -> BandwidthCurve:
    return inter_node_curve(
        data,
        (study.zone_of(src), src.gpu, src.tp),
        (study.zone_of(dst), dst.gpu, dst.tp),
    )


def _device(data: SailorData, node: str, machine: Machine) -> DeviceSpec:
    flops, bandwidth, consumer = kind_figures(device_kind(machine.gpu))
    return DeviceSpec(
        name=f"{node}/0",
        node=node,
        local_index=0,
        kind=device_kind(machine.gpu, machine.tp),
        memory_bytes=machine.tp * data.memory_per_gpu_bytes(machine.gpu),
        peak_flops=machine.tp * flops,
        memory_bandwidth_bytes_per_s=machine.tp * bandwidth,
        consumer_card=consumer,
    )


def message_size_range(data: SailorData, study: StudyPlan) -> tuple[float, float]:
    """Smallest and largest message (bytes) of the plan: a micro-batch's boundary gradient
    and the largest ring all-reduce chunk (a stage's gradients / replicas)."""
    smallest = hidden_state(data).num_bytes(study.mbs)
    stages = [stage.layers for replica in study.replicas for stage in replica]
    largest = max(grad_bytes(data, layers) / study.dp for layers in stages)
    return float(smallest), float(max(largest, smallest))


# --------------------------------------------------------------------------- simulation
def study_sim_spec(plan: Plan) -> SimSpec:
    """The simulator's view of an imported study plan as the study's runtime runs it:
    ``spec_from_plan(plan)`` (the plan's cuts carry exactly what that runtime sends) with
    blocking point-to-point transfers and the all-reduce after the schedule."""
    return replace(spec_from_plan(plan), blocking_p2p=True, bucket_cap_bytes=None)
