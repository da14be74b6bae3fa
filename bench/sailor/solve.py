"""Plan against the study: hplan's planning problem on the machines of a measured plan.

:func:`study_problem` builds the ``PlanningProblem`` for OPT-350 on the same machines as a
study plan (same global batch, the micro-batch sizes the study profiled on every device kind)
from the imported profile and network curves, at one of two granularities:
``Granularity.GPU`` (every GPU a device, as hplan's runtime runs them) or
``Granularity.MACHINE`` (each machine one tensor-parallel device, as the study ran them).
Static memory is 16 bytes per parameter (mixed-precision Adam), a cut carries the float32
hidden state only, and gradients are all-reduced in fp32.
"""

from __future__ import annotations

from dataclasses import replace
from enum import StrEnum
from itertools import pairwise

import numpy as np

from hplan.planner.cost.layout import Layout, ReplicaLayout, StageLayout
from hplan.planner.cost.problem import PlanningProblem
from hplan.planner.sim.ir import SimChannel, SimSpec, SimSyncGroup
from hplan.planner.sim.spec import spec_from_layout
from hplan.runtime.contract.errors import ConfigError

from .data import (
    ADAM_MIXED_BYTES_PER_PARAM,
    BandwidthCurve,
    SailorData,
    curves_alpha_beta,
    device_kind,
    inter_node_curve,
    intra_node_curve,
    unit_name,
)
from .plan import GRAD_WIRE_BYTES, hidden_state
from .study import Machine, StudyPlan

UNMEASURED_S = 1e6
"""Time given to a (device, micro-batch size) the study did not profile: never chosen."""


class Granularity(StrEnum):
    """What one hplan device is."""

    GPU = "gpu"
    MACHINE = "machine"


def study_machines(study: StudyPlan) -> list[Machine]:
    """The plan's machines, replica by replica, stage by stage (the import's node order)."""
    return [stage.machine for replica in study.replicas for stage in replica]


def study_problem(
    data: SailorData,
    study: StudyPlan,
    granularity: Granularity = Granularity.GPU,
    *,
    micro_batch_size: int | None = None,
    shared_nic: bool = False,
) -> PlanningProblem:
    """The planning problem of OPT-350 on the machines of ``study``.

    Args:
        shared_nic: divide every inter-node link's bandwidth by the number of the problem's
            devices on the busier of its two machines (they share its network card). For the
            solver, whose cost model times each link alone: it then sees that 8 GPUs
            all-reducing across machines at once get 1/8 of the card each. Simulate the
            layout on the problem without it (``layout_sim_spec`` queues the real card).
        micro_batch_size: plan at this one micro-batch size; None: every profiled size.

    Raises:
        ConfigError: no micro-batch size was profiled on every device kind, or
            ``micro_batch_size`` is not one of them.
    """
    devices = _devices(study, granularity)
    sizes = _micro_batch_sizes(data, devices, study.gbs)
    if micro_batch_size is not None:
        if micro_batch_size not in sizes:
            raise ConfigError(
                f"micro-batch size {micro_batch_size} was not profiled on every device kind; "
                f"choose one of {sizes}"
            )
        sizes = (micro_batch_size,)
    num_units = data.num_layers
    fwd = np.full((len(devices), num_units, len(sizes)), UNMEASURED_S)
    bwd = np.full_like(fwd, UNMEASURED_S)
    opt = np.zeros((len(devices), num_units))
    for d, (_, machine) in enumerate(devices):
        for k, mbs in enumerate(sizes):
            times = data.layer_times(machine.gpu, mbs, machine.tp)
            assert times is not None  # sizes are measured for every kind
            for u in range(num_units):
                fwd[d, u, k], bwd[d, u, k], opt[d, u] = times[str(u)]
    params = np.array([data.params_floats(u, 1) for u in range(num_units)], dtype=float)
    act = np.array([int(data.llm_info["1"][str(u)]["act_mem_bytes"]) for u in range(num_units)])
    cut = float(hidden_state(data).num_bytes(1))
    bandwidth, latency = _links(data, study, devices, cut * sizes[0], params)
    if shared_nic:
        bandwidth = _share_cards(bandwidth, [node for node, _ in devices])
    problem = PlanningProblem(
        unit_names=tuple(unit_name(u) for u in range(num_units)),
        device_names=tuple(f"{node}/{i}" for i, (node, _) in enumerate(devices)),
        device_nodes=tuple(node for node, _ in devices),
        device_kinds=tuple(device_kind(m.gpu, m.tp) for _, m in devices),
        global_batch_size=study.gbs,
        micro_batch_sizes=sizes,
        memory_capacity_bytes=np.array(
            [m.tp * data.memory_per_gpu_bytes(m.gpu) for _, m in devices], dtype=float
        ),
        fwd_time_s=fwd,
        bwd_time_s=bwd,
        optimizer_time_s=opt,
        static_memory_bytes=params * ADAM_MIXED_BYTES_PER_PARAM,
        activation_bytes_per_sample=act.astype(float),
        cut_bytes_per_sample=np.full(num_units - 1, cut),
        cut_grad_bytes_per_sample=np.full(num_units - 1, cut),
        grad_bytes=params * GRAD_WIRE_BYTES,
        bandwidth_bytes_per_s=bandwidth,
        latency_s=latency,
    )
    problem.verify()
    return problem


def profiled_micro_batch_sizes(
    data: SailorData, study: StudyPlan, granularity: Granularity
) -> tuple[int, ...]:
    """Micro-batch sizes (<= the global batch) the study profiled on every device kind.

    Raises:
        ConfigError: there is none.
    """
    return _micro_batch_sizes(data, _devices(study, granularity), study.gbs)


def _devices(study: StudyPlan, granularity: Granularity) -> list[tuple[str, Machine]]:
    """(node name, machine as one device) per hplan device."""
    out = []
    for idx, machine in enumerate(study_machines(study)):
        node = f"m{idx}-{machine.gpu.lower()}"
        if granularity is Granularity.MACHINE:
            out.append((node, machine))
        else:
            out.extend((node, Machine(machine.gpu, 1, machine.zone)) for _ in range(machine.tp))
    return out


def _micro_batch_sizes(
    data: SailorData, devices: list[tuple[str, Machine]], gbs: int
) -> tuple[int, ...]:
    kinds = {(m.gpu, m.tp) for _, m in devices}
    measured = [
        {int(mbs) for mbs, per_tp in data.profiles.get(gpu, {}).items() if str(tp) in per_tp}
        for gpu, tp in kinds
    ]
    sizes = sorted(x for x in set.intersection(*measured) if x <= gbs)
    if not sizes:
        raise ConfigError(
            f"no micro-batch size was profiled on every device kind of {sorted(kinds)}"
        )
    return tuple(sizes)


def _links(
    data: SailorData,
    study: StudyPlan,
    devices: list[tuple[str, Machine]],
    smallest_bytes: float,
    params: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    largest_bytes = max(float(params.sum()) * GRAD_WIRE_BYTES / 2, smallest_bytes)
    n = len(devices)
    bandwidth = np.ones((n, n))
    latency = np.zeros((n, n))
    fits: dict[tuple[str, str, bool], tuple[float, float]] = {}
    for i, (node_a, ma) in enumerate(devices):
        for j, (node_b, mb) in enumerate(devices):
            if i == j:
                continue
            same = node_a == node_b
            key = (device_kind(ma.gpu, ma.tp), device_kind(mb.gpu, mb.tp), same)
            if key not in fits:
                curves = _curves(data, study.zone, ma, mb, same)
                fits[key] = curves_alpha_beta(curves, smallest_bytes, largest_bytes)
            bandwidth[i, j], latency[i, j] = fits[key]
    return bandwidth, latency


def _share_cards(bandwidth: np.ndarray, nodes: list[str]) -> np.ndarray:
    per_node = {node: nodes.count(node) for node in nodes}
    out = bandwidth.copy()
    for i, a in enumerate(nodes):
        for j, b in enumerate(nodes):
            if a != b:
                out[i, j] /= max(per_node[a], per_node[b])
    return out


def _curves(
    data: SailorData, zone: str, a: Machine, b: Machine, same_node: bool
) -> list[BandwidthCurve]:
    if same_node:  # the node's every GPU at once: what a node-wide all-reduce sees
        return [intra_node_curve(data, a.gpu, data.gpus_per_node(a.gpu))]
    ends = ((a.zone or zone, a.gpu, a.tp), (b.zone or zone, b.gpu, b.tp))
    return [inter_node_curve(data, *ends), inter_node_curve(data, *reversed(ends))]


def study_layout(study: StudyPlan) -> Layout:
    """The study's own layout on ``study_problem(..., Granularity.MACHINE)`` devices."""
    samples = study.samples_per_replica
    num_mb = -(-samples // study.mbs)
    replicas, device_idx = [], 0
    for replica in study.replicas:
        stages = []
        for stage in replica:
            stages.append(StageLayout(device_idx, stage.layers[0], stage.layers[-1] + 1))
            device_idx += 1
        replicas.append(ReplicaLayout(tuple(stages), study.mbs, num_mb, samples))
    return Layout(tuple(replicas))


def layout_sim_spec(problem: PlanningProblem, layout: Layout, *, study_runtime: bool) -> SimSpec:
    """The simulator's view of a layout of ``problem`` (``spec_from_layout``), with every
    machine's outgoing inter-node transfers queued on its one network card.

    ``study_runtime`` runs it as the study's runtime would, with blocking point-to-point and
    the all-reduce after the schedule (see ``plan.py``); otherwise as hplan's runtime
    does (``isend``, buckets launched during the last backward pass). Both send the same
    bytes: the cut's hidden state and its gradient.
    """
    spec = spec_from_layout(problem, layout)
    replicas = []
    for replica, sim in zip(layout.replicas, spec.replicas, strict=True):
        links = []
        for (a, b), link in zip(pairwise(replica.stages), sim.links, strict=True):
            forward = _nic(link.forward, problem, a.device_idx, b.device_idx)
            backward = _nic(link.backward, problem, b.device_idx, a.device_idx)
            links.append(replace(link, forward=forward, backward=backward))
        replicas.append(replace(sim, links=tuple(links)))
    groups = _share_network_cards(problem, layout, spec.sync_groups)
    cap = None if study_runtime else spec.bucket_cap_bytes
    return replace(
        spec,
        replicas=tuple(replicas),
        sync_groups=groups,
        blocking_p2p=study_runtime,
        bucket_cap_bytes=cap,
    )


def _share_network_cards(
    problem: PlanningProblem, layout: Layout, groups: tuple[SimSyncGroup, ...]
) -> tuple[SimSyncGroup, ...]:
    """Divide an inter-node all-reduce group's bandwidth by the number of inter-node groups
    that share one of its machines' network card (they run at the same time after the last
    backward; fair sharing)."""
    devices = sorted(layout.device_indices)
    node_of = {rank: problem.device_nodes[d] for rank, d in enumerate(devices)}
    nodes = {g.ranks: {node_of[r] for r in g.ranks} for g in groups}
    crossing = [g for g in groups if len(nodes[g.ranks]) > 1]
    users: dict[str, int] = {}
    for group in crossing:
        for node in nodes[group.ranks]:
            users[node] = users.get(node, 0) + 1
    out = []
    for group in groups:
        share = max((users.get(n, 1) for n in nodes[group.ranks]), default=1)
        if len(nodes[group.ranks]) > 1 and share > 1:
            group = replace(group, bandwidth_bytes_per_s=group.bandwidth_bytes_per_s / share)
        out.append(group)
    return tuple(out)


def _nic(channel: SimChannel, problem: PlanningProblem, src: int, dst: int) -> SimChannel:
    if problem.device_nodes[src] == problem.device_nodes[dst]:
        return channel
    return replace(channel, key=f"nic-out:{problem.device_nodes[src]}")
