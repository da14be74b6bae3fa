"""Memory of each rank of a plan, from the plan alone (no torch), and the check at load.

One formula (:func:`rank_memory`), used by the planner for the report and its last check
before a plan is written, and by every command that loads a plan (``show``, ``rehearse``,
``run``), so that a plan edited by hand (a larger micro-batch, GPipe, a stage moved to a
small device) is refused where it no longer fits. Capacity: :func:`usable_memory_bytes`
(the device's memory less a framework reserve, times ``USABLE_MEMORY_FRACTION``) and, for
optimizer offload, a node's host memory (:func:`host_capacity_bytes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hplan.runtime.contract.errors import PlanFileError
from hplan.runtime.contract.holders import (
    OptimizerShards,
    RankSet,
    grad_buckets,
    optimizer_shards,
    step_holders,
)
from hplan.runtime.contract.link_model import BUCKET_CAP_BYTES
from hplan.runtime.contract.plan import (
    CPU_KIND,
    DTYPE_BYTES,
    DeviceSpec,
    MemoryModelSpec,
    MemoryStrategy,
    Plan,
    RankPlan,
    Schedule,
    TensorSpec,
    UnitMemorySpec,
    ZeroStage,
    wire_spec,
)
from hplan.runtime.contract.quantities import BYTES_PER_GIB, format_bytes_pair

OPTIMIZER_STEP_WORKSPACE: float = 0.65
"""Temporaries of one optimizer step per byte of the parameters it steps, for optimizers
with state: the peak above its state measured for torch's foreach AdamW/Adam on CPU."""

# Memory a GPU process cannot plan with: the CUDA context, cuBLAS workspaces and NCCL
# communicator buffers. 1 GiB is an assumed round figure.
GPU_RESERVE_BYTES: float = 1.0 * BYTES_PER_GIB
# Memory a CPU rank process holds besides its training state: the interpreter, torch, hplan's
# runtime and gloo's process groups before its stage is built (``baseline_memory_bytes`` in
# the metrics), plus what first use adds (tracing, autograd, gloo buffers). A ``cpu``
# device's declared memory is what its process may hold in all (a cgroup's limit, say).
CPU_RESERVE_BYTES: float = 360e6

# Share of the remaining memory a plan may fill; the rest is headroom for the caching
# allocator's fragmentation and temporary buffers (assumed).
USABLE_MEMORY_FRACTION: float = 0.9


HOST_MEMORY_PER_DEVICE_MEMORY: float = 2.0
"""Host memory assumed on a node whose plan declares none (``NodeSpec.host_memory_bytes``):
this many times the memory of its devices. An assumption, the one place it is made: a
common sizing of GPU servers, below NVIDIA's DGX H100 (2 TB of system memory for 8 x 80 GB
of GPU memory, 3.2x; DGX H100 datasheet)."""


def device_reserve_bytes(kind: str) -> float:
    """The framework reserve of a device kind (``cpu`` or a GPU catalog key), bytes."""
    return CPU_RESERVE_BYTES if kind == CPU_KIND else GPU_RESERVE_BYTES


def usable_memory_bytes(memory_bytes: float, kind: str) -> float:
    """Memory a plan may fill on a device of ``memory_bytes`` and ``kind``: (memory -
    reserve) x ``USABLE_MEMORY_FRACTION``, >= 0."""
    return max(0.0, (memory_bytes - device_reserve_bytes(kind)) * USABLE_MEMORY_FRACTION)


def device_capacity_bytes(device: DeviceSpec) -> float:
    """:func:`usable_memory_bytes` of a plan's device."""
    return usable_memory_bytes(device.memory_bytes, device.kind)


def offload_host_bytes(trainable_bytes: float, state_factor: float) -> float:
    """Host memory of a rank that offloads its optimizer, bytes: a copy of its trainable
    parameters and one of their gradients (pinned on CUDA), the optimizer state
    (``state_factor`` x the parameter bytes) and the step's temporaries
    (:data:`OPTIMIZER_STEP_WORKSPACE`, for an optimizer with state)."""
    temporaries = OPTIMIZER_STEP_WORKSPACE if state_factor > 0 else 0.0
    return trainable_bytes * (2.0 + state_factor + temporaries)


def offload_device_saving_bytes(trainable_bytes: float, state_factor: float) -> float:
    """Device memory an offloading rank does not need, bytes: the optimizer state and the
    step's temporaries."""
    temporaries = OPTIMIZER_STEP_WORKSPACE if state_factor > 0 else 0.0
    return trainable_bytes * (state_factor + temporaries)


def host_capacity_bytes(plan: Plan, node: str) -> float:
    """Host memory the offloading ranks of ``node`` may fill, bytes: its
    ``host_memory_bytes`` (else :data:`HOST_MEMORY_PER_DEVICE_MEMORY` x its devices' memory)
    less ``CPU_RESERVE_BYTES`` per rank it runs, times ``USABLE_MEMORY_FRACTION``."""
    spec = next(n for n in plan.cluster.nodes if n.name == node)
    memory = {d.name: d.memory_bytes for d in plan.cluster.devices}
    num_ranks = sum(1 for r in plan.ranks if r.node == node)
    return usable_host_memory_bytes(
        spec.host_memory_bytes, [memory[d] for d in spec.devices], num_ranks
    )


def usable_host_memory_bytes(
    host_memory_bytes: float | None, device_memory_bytes: Sequence[float], num_ranks: int
) -> float:
    """Host memory a node's offloading ranks may fill: its host memory (None: assumed,
    :data:`HOST_MEMORY_PER_DEVICE_MEMORY` x the sum of ``device_memory_bytes``) less
    ``CPU_RESERVE_BYTES`` for each of its ``num_ranks`` processes, times
    ``USABLE_MEMORY_FRACTION``, >= 0."""
    total = host_memory_bytes
    if total is None:
        total = HOST_MEMORY_PER_DEVICE_MEMORY * float(sum(device_memory_bytes))
    return max(0.0, (total - num_ranks * CPU_RESERVE_BYTES) * USABLE_MEMORY_FRACTION)


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Predicted peak memory of one rank, by part, bytes (``total_bytes``: on its device)."""

    parameter_bytes: float
    gradient_bytes: float
    optimizer_state_bytes: float
    activation_bytes: float
    workspace_bytes: float
    host_bytes: float = 0.0
    """Host memory of its optimizer offload (not part of ``total_bytes``)."""

    @property
    def total_bytes(self) -> float:
        return (
            self.parameter_bytes
            + self.gradient_bytes
            + self.optimizer_state_bytes
            + self.activation_bytes
            + self.workspace_bytes
        )


def in_flight_microbatches(
    schedule: Schedule, stage: int, num_stages: int, num_microbatches: int | None = None
) -> int:
    """Micro-batches whose activations stage ``stage`` of ``num_stages`` holds at once: the
    one rule of the planner (search, evaluator, validator, baselines) and the plan's check.

    1F1B: ``min(num_stages - stage, num_microbatches)`` (S - s - 1 warm-up forwards plus one
    before its first backward; Narayanan et al., SC 2021); ``num_microbatches`` None: the
    most any number of them can hold, ``num_stages - stage``. GPipe: every micro-batch (all
    forwards run before the first backward; Huang et al., NeurIPS 2019).

    Raises:
        ValueError: GPipe without ``num_microbatches`` (its in-flight count is the share's).
    """
    if schedule is Schedule.GPIPE:
        if num_microbatches is None:
            raise ValueError(
                "under GPipe the micro-batches in flight are all of them: give the count"
            )
        return num_microbatches
    most = num_stages - stage
    return most if num_microbatches is None else min(most, num_microbatches)


def stage_activation_bytes(
    activation_bytes_per_sample: Sequence[float],
    input_bytes_per_sample: Sequence[float],
    recomputed: Sequence[bool],
    micro_batch_size: int,
    in_flight: int,
    full_recompute: bool = False,
) -> float:
    """Activation bytes a stage holds at its peak, by memory strategy.

    Args:
        activation_bytes_per_sample: per unit of the stage, in order: what autograd saves
            per sample.
        input_bytes_per_sample: per unit: bytes per sample of the boundary before it (0 for
            the model's first unit); ``[0]`` is the stage's input.
        recomputed: per unit: whether it is recomputed (``selective``; ignored when
            ``full_recompute``).
        micro_batch_size: samples per micro-batch, b.
        in_flight: micro-batches in flight, m (:func:`in_flight_microbatches`).
        full_recompute: the stage recomputes as a whole (``recompute``).

    Returns:
        keep: ``b m sum_u A_u``; ``recompute``: ``b m I_0 + b sum_u A_u``; ``selective``:
        ``b m (sum_kept A_u + sum_recomputed I_u) + b max_recomputed A_u`` (A: activations
        per sample, I: input per sample; a checkpointed unit saves its inputs, and its
        backward re-runs its forward alone: Chen et al. 2016, ``torch.utils.checkpoint``).
    """
    b = float(micro_batch_size)
    if full_recompute:
        stage_input = input_bytes_per_sample[0] if input_bytes_per_sample else 0.0
        return b * in_flight * stage_input + b * float(sum(activation_bytes_per_sample))
    kept = 0.0
    largest = 0.0
    for act, inp, again in zip(
        activation_bytes_per_sample, input_bytes_per_sample, recomputed, strict=True
    ):
        kept += inp if again else act
        largest = max(largest, act) if again else largest
    return b * in_flight * kept + b * largest


def parameter_numels(memory: MemoryModelSpec) -> dict[str, int]:
    """Canonical name -> elements of every trainable parameter (what ZeRO shards)."""
    return {p.name: p.num_elements for p in memory.parameters}


def rank_memory(
    plan: Plan,
    rank: RankPlan,
    memory: MemoryModelSpec,
    shards: Mapping[RankSet, OptimizerShards] | None = None,
) -> RankMemory:
    """The predicted peak memory of ``rank``, bytes by part.

    - parameters: every trainable parameter its units use (each once), plus its units'
      frozen parameters and buffers;
    - gradients: its trainable parameters, whole even under ZeRO stage 2: they accumulate in
      ``.grad`` over the step's micro-batches, and no reduction can start before the last
      backward (replicas run different numbers of micro-batches, so per-micro-batch
      reductions would not pair up; ``executor/memory/zero.py``);
    - optimizer state: trainable bytes x ``optimizer_state_bytes_per_param_byte``, each
      holder set's part reduced to this rank's shard under ZeRO stage 1 or 2
      (``holders.optimizer_shards``);
    - activations: :func:`stage_activation_bytes` by memory strategy, for
      :func:`in_flight_microbatches`, and the received tensors without a batch dimension,
      whole for each micro-batch in flight (the activation measurement, a slope over batch
      sizes, never sees batch-independent bytes);
    - workspace: one receive and one send buffer of the boundary tensors on each side; the
      flat copy of every gradient it all-reduces with other ranks every step
      (:func:`summed_every_step`; not a local group's across islands; each bucket one
      ``torch.cat``, alive until the step's all-reduces are done; under ZeRO stage 2 only
      the largest bucket, :func:`largest_bucket_bytes`: a bucket's flat copy replaces the
      gradients it was made of and only the rank's shard of the sum is kept); the optimizer
      step's temporaries (:data:`OPTIMIZER_STEP_WORKSPACE` x the bytes it steps, for an
      optimizer with state); under autocast the half-precision copy of the weights.

    On a rank of a TP group (``RankPlan.tp_degree`` > 1) every parameter the model's TP
    plan splits counts 1/d (with its gradient, state and copies), and so does the split
    part of each unit's activations (:func:`tp_activation_bytes_per_sample`).

    Under optimizer offload (``RankPlan.optimizer_offload``) the state and the step's
    temporaries leave the device for the host, which also keeps a copy of the trainable
    parameters and of their gradients (:func:`offload_host_bytes`, ``host_bytes``); on a
    ``cpu`` device the host is the device, so the state stays counted there and the two
    copies join its workspace.

    Args:
        shards: ``holders.optimizer_shards`` of the plan (computed when None).
    """
    units = {u.name: u for u in plan.units}
    unit_memory = {u.unit: u for u in memory.units}
    sizes = {p.name: p for p in memory.parameters}
    # the trainable parameters it holds (``memory.parameters`` lists only those)
    trainable = [
        n for n in dict.fromkeys(p for u in rank.units for p in units[u].params) if n in sizes
    ]
    held = held_fractions(plan, rank, trainable)
    grad_bytes = sum(sizes[n].num_elements * sizes[n].element_bytes * held[n] for n in trainable)
    param_bytes = grad_bytes
    state_factor = memory.optimizer_state_bytes_per_param_byte
    state_bytes = grad_bytes * state_factor
    if plan.training.zero_stage is not ZeroStage.NONE:
        state_bytes = _sharded_state_bytes(plan, rank, memory, trainable, shards)
    frozen = sum(unit_memory[u].frozen_bytes for u in rank.units)
    replica = plan.replica_ranks(rank.replica)
    b = rank.micro_batch_size
    in_flight = in_flight_microbatches(
        plan.training.schedule, rank.stage, len(replica), rank.num_microbatches
    )
    inputs = _boundary_bytes(plan, replica, rank.stage - 1) if rank.stage > 0 else _NO_BOUNDARY
    unit_inputs = [inputs.per_sample] + [
        unit_memory[u].input_bytes_per_sample for u in rank.units[1:]
    ]
    activations = in_flight * inputs.per_microbatch + stage_activation_bytes(
        [tp_activation_bytes_per_sample(unit_memory[u], rank.tp_degree) for u in rank.units],
        unit_inputs,
        [u in rank.recompute_units for u in rank.units],
        b,
        in_flight,
        full_recompute=rank.memory_strategy is MemoryStrategy.RECOMPUTE,
    )
    last = rank.stage + 1 == len(replica)
    outputs = _NO_BOUNDARY if last else _boundary_bytes(plan, replica, rank.stage)
    workspace = 2.0 * (inputs.at(b) + outputs.at(b))
    if plan.training.zero_stage is ZeroStage.GRADIENTS:
        workspace += largest_bucket_bytes(plan, rank.rank, memory, trainable)
    else:
        summed = summed_every_step(plan, rank.rank)
        workspace += sum(
            sizes[n].num_elements * sizes[n].element_bytes * held[n]
            for n in trainable
            if n in summed  # all-reduced: its bucket holds a flat copy
        )
    step_temporaries = (
        OPTIMIZER_STEP_WORKSPACE * state_bytes / state_factor if state_factor else 0.0
    )
    workspace += step_temporaries
    if rank.precision.autocast_dtype is not None:
        workspace += sum(
            sizes[n].num_elements * DTYPE_BYTES[rank.precision.autocast_dtype] * held[n]
            for n in trainable
            if sizes[n].element_bytes > DTYPE_BYTES[rank.precision.autocast_dtype]
        )
    host = 0.0
    if rank.optimizer_offload and rank.device_kind == CPU_KIND:
        workspace += 2.0 * grad_bytes  # the host copies, in the same memory
    elif rank.optimizer_offload:
        workspace -= step_temporaries  # the state and the step move to the host
        state_bytes = 0.0
        host = offload_host_bytes(grad_bytes, state_factor)
    return RankMemory(
        parameter_bytes=float(param_bytes + frozen),
        gradient_bytes=float(grad_bytes),
        optimizer_state_bytes=float(state_bytes),
        activation_bytes=float(activations),
        workspace_bytes=float(workspace),
        host_bytes=float(host),
    )


def summed_every_step(plan: Plan, rank: int) -> frozenset[str]:
    """Canonical names of the parameters ``rank`` sums with another rank every step (its
    gradient buckets' parameters, ``holders.grad_buckets``): not one it alone holds, nor,
    under ``local_sgd``/``async``, one whose other holders are all in other islands."""
    return frozenset(
        name
        for name, sets in step_holders(plan).items()
        if any(rank in ranks and len(ranks) > 1 for ranks in sets)
    )


def held_fractions(plan: Plan, rank: RankPlan, names: Sequence[str]) -> dict[str, float]:
    """The share of each parameter of ``names`` that ``rank`` holds: 1 / its ``tp_degree``
    where the model's TP plan splits it (``TpRule.splits``), else 1."""
    degree = rank.tp_degree
    rules = plan.model.tp_plan
    return {
        n: 1.0 / degree if degree > 1 and any(r.splits(n) for r in rules) else 1.0 for n in names
    }


def tp_activation_bytes_per_sample(unit: UnitMemorySpec, tp_degree: int) -> float:
    """A unit's saved activations per sample on one rank of a TP group of ``tp_degree``:
    its split part / the degree, the rest whole."""
    split = unit.tp_split_activation_bytes_per_sample
    return unit.activation_bytes_per_sample - split * (1.0 - 1.0 / tp_degree)


def largest_bucket_bytes(
    plan: Plan, rank: int, memory: MemoryModelSpec, trainable: Sequence[str]
) -> float:
    """Wire bytes of the largest gradient bucket ``rank`` sums with other ranks
    (``holders.grad_buckets`` at ``link_model.BUCKET_CAP_BYTES``; half-precision gradients
    travel as float32, ``executor/grad_sync.py``); 0 when it shares no trainable parameter.

    Args:
        trainable: the canonical names of the rank's trainable parameters.
    """
    sizes = {p.name: p for p in memory.parameters}
    wire = {n: sizes[n].num_elements * max(4, sizes[n].element_bytes) for n in trainable}
    buckets = grad_buckets(plan, wire, BUCKET_CAP_BYTES)
    return float(max((b.num_bytes for b in buckets if rank in b.ranks), default=0))


def _sharded_state_bytes(
    plan: Plan,
    rank: RankPlan,
    memory: MemoryModelSpec,
    trainable: list[str],
    shards: Mapping[RankSet, OptimizerShards] | None,
) -> float:
    """Optimizer state of ``rank`` under ZeRO stage 1 or 2: the parameters only it holds in full,
    its slice of every holder set it is in."""
    if shards is None:
        shards = optimizer_shards(plan, parameter_numels(memory))
    sizes = {p.name: p for p in memory.parameters}
    factor = memory.optimizer_state_bytes_per_param_byte
    sharded = {n for s in shards.values() for n in s.names}
    total = sum(
        sizes[n].num_elements * sizes[n].element_bytes * factor
        for n in trainable
        if n not in sharded
    )
    for shard in shards.values():
        if rank.rank not in shard.bounds:
            continue
        start, stop = shard.bounds[rank.rank]
        offset = 0
        for name in shard.names:
            size = sizes[name].num_elements
            overlap = max(0, min(stop, offset + size) - max(start, offset))
            total += overlap * sizes[name].element_bytes * factor
            offset += size
    return total


@dataclass(frozen=True, slots=True)
class _Boundary:
    """Bytes crossing one cut, as sent: batched tensors per sample, the tensors without a
    batch dimension once per micro-batch (they travel whole with each)."""

    per_sample: float
    per_microbatch: float

    def at(self, micro_batch_size: int) -> float:
        """Bytes of one micro-batch of ``micro_batch_size`` samples."""
        return self.per_sample * micro_batch_size + self.per_microbatch


_NO_BOUNDARY = _Boundary(0.0, 0.0)


def _boundary_bytes(plan: Plan, replica: tuple[RankPlan, ...], stage: int) -> _Boundary:
    """What crosses the cut after stage ``stage`` of ``replica``, as sent."""
    cut = plan.cut_after(replica[stage].units[-1])
    sender = replica[stage].precision
    sent = [wire_spec(t, sender) for t in cut.tensors]
    return _Boundary(
        per_sample=float(sum(_tensor_bytes(t) for t in sent if t.batch_dim is not None)),
        per_microbatch=float(sum(_tensor_bytes(t) for t in sent if t.batch_dim is None)),
    )


def _tensor_bytes(spec: TensorSpec) -> int:
    elements = 1
    for dim in spec.shape_for(1):
        elements *= dim
    return elements * DTYPE_BYTES.get(spec.dtype, 4)


def plan_memory(plan: Plan) -> tuple[RankMemory, ...] | None:
    """Every rank's :class:`RankMemory` in rank order; None when the plan carries no sizes."""
    if plan.memory is None:
        return None
    shards = (
        optimizer_shards(plan, parameter_numels(plan.memory))
        if plan.training.zero_stage is not ZeroStage.NONE
        else None
    )
    return tuple(rank_memory(plan, r, plan.memory, shards) for r in plan.ranks)


def memory_problems(plan: Plan) -> list[str]:
    """One line per rank whose predicted peak exceeds its device's usable memory (empty: it
    fits, or the plan carries no sizes)."""
    found = plan_memory(plan)
    if found is None:
        return []
    devices = {d.name: d for d in plan.cluster.devices}
    problems = []
    for rank, need in zip(plan.ranks, found, strict=True):
        capacity = device_capacity_bytes(devices[rank.device])
        if need.total_bytes > capacity:
            need_text, capacity_text = format_bytes_pair(need.total_bytes, capacity)
            problems.append(
                f"rank {rank.rank} on {rank.device} needs {need_text} under "
                f"{plan.training.schedule.value} with micro-batch {rank.micro_batch_size} x "
                f"{rank.num_microbatches} ({strategy_text(rank)}), its device has "
                f"{capacity_text} usable"
            )
    return problems + host_memory_problems(plan, found)


HOST_PROBLEM = "the optimizer offload of ranks"
"""How a line of :func:`host_memory_problems` starts."""


def host_memory_problems(plan: Plan, found: tuple[RankMemory, ...]) -> list[str]:
    """One line per node whose offloading ranks' host memory (``RankMemory.host_bytes``)
    exceeds :func:`host_capacity_bytes`."""
    need: dict[str, float] = {}
    for rank, part in zip(plan.ranks, found, strict=True):
        if part.host_bytes > 0:
            need[rank.node] = need.get(rank.node, 0.0) + part.host_bytes
    problems = []
    for node, num_bytes in need.items():
        capacity = host_capacity_bytes(plan, node)
        if num_bytes > capacity:
            ranks = [r.rank for r in plan.ranks if r.node == node and r.optimizer_offload]
            need_text, capacity_text = format_bytes_pair(num_bytes, capacity)
            problems.append(
                f"{HOST_PROBLEM} {ranks} needs {need_text} of node "
                f"{node}'s host memory, it has {capacity_text} usable"
            )
    return problems


def strategy_text(rank: RankPlan) -> str:
    """E.g. ``keep_activations``, ``recompute``, ``selective 3/8`` (units recomputed)."""
    if rank.memory_strategy is MemoryStrategy.SELECTIVE:
        return f"selective {len(rank.recompute_units)}/{len(rank.units)}"
    return rank.memory_strategy.value


def check_fits(plan: Plan, where: str = "the plan") -> Plan:
    """``plan`` itself when every rank fits its device (:func:`memory_problems`).

    Raises:
        PlanFileError: one line naming the first rank that does not fit, its bytes and its
            device's capacity, and what to change.
    """
    problems = memory_problems(plan)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        fix = (
            "set optimizer_offload false on some of those ranks, or re-run `hplan solve` "
            "(with the node's host_memory_gb in cluster.yaml, if it has more)"
            if problems[0].startswith(HOST_PROBLEM)
            else "lower the micro-batch size, recompute more units on that rank (memory_strategy "
            "selective with more recompute_units, or recompute), set optimizer_offload on it, "
            "or re-run `hplan solve`"
        )
        raise PlanFileError(f"{where} does not fit in memory: {problems[0]}{more}; {fix}")
    return plan


def load_checked(path: str | Path) -> Plan:
    """``Plan.load(path)``, refused when it does not fit (:func:`check_fits`): what
    ``hplan show``, ``hplan rehearse`` and ``hplan run`` load a plan with.

    Raises:
        PlanFileError: the file is not a valid plan, or it does not fit in memory.
    """
    return check_fits(Plan.load(path), str(path))
