"""Cost model: fill the solver's ``PlanningProblem`` from the cost graph and the cluster.

For every (device, partition unit, micro-batch size) it predicts the forward and backward
time; for every (device, unit) the optimizer-step time; for every unit the memory it needs
(:func:`static_memory_bytes`, activations per sample from the cost graph); for every device
pair the link (alpha-beta, from the cluster). Unit times come from a ``UnitTimeSource``:
the default, :class:`RooflineSource`, estimates them from the device catalog's peaks; a
measured profile (``cost.profiled_times``) plugs in as another, and its ``name`` goes into
the plan's report as ``cost_source``. The constants below are the roofline's assumptions,
each with its source.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from hplan.planner.cost.offload import (
    OPTIMIZER_STATE_PASSES,
    OPTIMIZER_WEIGHT_GRAD_PASSES,
    PCIE_BANDWIDTH_BYTES_PER_S,
    offload_step_time_s,
)
from hplan.planner.cost.problem import (
    PlanningProblem,
    Policy,
    TensorParallelInput,
    TiedParams,
)
from hplan.planner.hardware.catalog import (
    DeviceClass,
    DeviceType,
    compute_dtype,
    peak_flops_per_s,
    runs_on_tensor_cores,
)
from hplan.planner.hardware.cluster import Cluster, Device
from hplan.runtime.contract.errors import ConfigError, ModelFileError
from hplan.runtime.contract.memory import (
    OPTIMIZER_STEP_WORKSPACE,
    offload_device_saving_bytes,
    offload_host_bytes,
    usable_host_memory_bytes,
    usable_memory_bytes,
)
from hplan.runtime.contract.plan import DTYPE_BYTES, Precision, Schedule, wire_spec

if TYPE_CHECKING:
    from hplan.planner.frontend.cost_graph import ModelGraph, UnitCost
    from hplan.runtime.capture.model_file import ModelFile

# Fraction of the dtype's peak FLOP/s that the matmul and convolution kernels reach. This
# is a kernel's efficiency, not a whole step's (model FLOPs utilisation): the step's other
# kernels are costed apart (the serial memory-bound term), so Megatron-LM's 52% of A100
# peak end to end (Narayanan et al., SC 2021) counts them twice. 0.7 was fitted to
# published single-GPU training throughput (bench/roofline_accuracy.py): an in-sample fit,
# not a validation. A measured profile replaces it.
COMPUTE_EFFICIENCY = 0.7

# Fraction of the peak DRAM bandwidth that memory-bound kernels reach. Jia et al.,
# "Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking" (2018) measure
# about 750 of V100's 900 GB/s (83%); STREAM-style copies on Ampere/Ada reach similar
# fractions. 0.8 rounds that down.
MEMORY_EFFICIENCY = 0.8

# cuDNN's tensor-core convolutions compute in channels-last (NHWC); given channels-first
# (NCHW) tensors, the library transposes the input in and the output back, each a read and
# a write of the tensor (NVIDIA, "Convolutional Layers User's Guide", Deep Learning
# Performance documentation, "Tensor Layouts In Memory: NCHW vs NHWC"). So a
# channels-first convolution on tensor cores moves twice its activation input and output
# bytes more, at memory speed; backward like the forward (BACKWARD_TO_FORWARD_RATIO).
LAYOUT_TRANSPOSE_PASSES = 2.0

# Fixed cost per graph op: PyTorch eager dispatch plus a CUDA kernel launch, each a few
# microseconds (the CUDA C++ Best Practices Guide puts kernel launch overhead in the
# microseconds). 5 us is an assumed round figure, used for CPU ops too (dispatch alone).
OP_OVERHEAD_S = 5e-6

# Backward costs twice the forward: for each matmul, one product for the input gradient
# and one for the weight gradient (Kaplan et al., "Scaling Laws for Neural Language
# Models", 2020, section 2.1; Narayanan et al. 2021, section 5.1: 3x forward in total).
# Applied alike to FLOPs, bytes moved and op count.
BACKWARD_TO_FORWARD_RATIO = 2.0


@dataclass(frozen=True, slots=True)
class Numerics:
    """How a device computes a unit: the model's parameter dtype and the rank's precision
    (``contract.plan.Precision``)."""

    param_dtype: str
    """torch dtype name of the model's parameters, e.g. ``float32``."""
    precision: Precision = Precision.FP32

    @property
    def compute_dtype(self) -> str:
        """dtype name the matmuls run in (whose catalog peak applies)."""
        return compute_dtype(self.precision, self.param_dtype)

    @property
    def allow_tf32(self) -> bool:
        return self.precision is Precision.TF32

    @property
    def activation_bytes_factor(self) -> float:
        """Bytes of a traced activation under this precision / traced bytes: 0.5 for a
        float32 model under bf16/fp16 autocast (matmul and convolution inputs and outputs
        are half precision; the reductions autocast keeps in float32 are a small share of a
        transformer's or CNN's saved bytes, so the estimate errs low there), else 1.0."""
        if self.precision.autocast_dtype is not None and self.param_dtype == "float32":
            return 0.5
        return 1.0


def device_numerics(
    devices: Sequence[Device], param_dtype: str, precisions: Mapping[str, Precision] | None
) -> tuple[Numerics, ...]:
    """Per device (in order), its ``Numerics``; devices missing from ``precisions`` (or all,
    when it is None) compute in fp32."""
    chosen = precisions or {}
    return tuple(Numerics(param_dtype, chosen.get(d.name, Precision.FP32)) for d in devices)


@dataclass(frozen=True, slots=True)
class UnitTimes:
    """Forward and backward time of one unit for one micro-batch, seconds."""

    fwd_time_s: float
    bwd_time_s: float


class UnitTimeSource(Protocol):
    """Where unit times come from: the roofline, or (later) a measured profile."""

    @property
    def name(self) -> str:
        """Short name recorded in the plan report as ``cost_source``."""
        ...

    def unit_times(
        self, device: Device, cost: UnitCost, micro_batch_size: int, numerics: Numerics
    ) -> UnitTimes:
        """Forward and backward time of ``cost``'s unit on ``device`` for one micro-batch
        computed in ``numerics``."""
        ...

    def optimizer_time_s(
        self, device: Device, cost: UnitCost, optimizer_state_bytes_per_param_byte: float
    ) -> float:
        """Optimizer-step time of the unit's trainable parameters on ``device``."""
        ...

    def time_spread(self, device: Device) -> float:
        """Relative spread of ``device``'s measured times (``PlanningProblem.time_spread``);
        0 for estimates."""
        ...


def roofline_time_s(
    *,
    flops: float,
    num_bytes: float,
    num_ops: float,
    peak_flops_per_s: float,
    memory_bandwidth_bytes_per_s: float,
    compute_efficiency: float = COMPUTE_EFFICIENCY,
    memory_efficiency: float = MEMORY_EFFICIENCY,
    op_overhead_s: float = OP_OVERHEAD_S,
) -> float:
    """Roofline time of a piece of work plus per-op overhead (Williams et al. 2009).

    ``max(flops / (peak * compute_eff), num_bytes / (bandwidth * memory_eff)) +
    num_ops * op_overhead_s``, in seconds.
    """
    compute_s = flops / (peak_flops_per_s * compute_efficiency)
    memory_s = num_bytes / (memory_bandwidth_bytes_per_s * memory_efficiency)
    return max(compute_s, memory_s) + num_ops * op_overhead_s


@dataclass(frozen=True, slots=True)
class RooflineSource:
    """Unit times from catalog peaks, by a roofline (Williams, Waterman and Patterson,
    "Roofline: an insightful visual performance model for multicore architectures", CACM
    2009)::

        time_s = max(flops / (peak_flops_per_s * COMPUTE_EFFICIENCY),
                     bytes / (memory_bandwidth_bytes_per_s * MEMORY_EFFICIENCY))
                 + serial_bytes / (memory_bandwidth_bytes_per_s * MEMORY_EFFICIENCY)
                 + num_ops * OP_OVERHEAD_S

        forward:  flops = fwd_flops_per_sample * b                   (b: micro-batch size)
                  serial_bytes = memory_bound_io_bytes_per_sample * b
                  bytes = param_bytes + io_bytes_per_sample * b - serial_bytes
        backward: BACKWARD_TO_FORWARD_RATIO times the forward flops, bytes and ops

    The bytes of ops without FLOPs (elementwise, normalisation, softmax) are a serial term:
    each is a kernel of its own between the matmuls, at memory speed, so summing per-kernel
    rooflines (as in Yang et al., "Hierarchical Roofline Analysis", 2020) is closer to a step
    than one roofline of the unit's totals, which would hide them under the matmuls."""

    compute_efficiency: float = COMPUTE_EFFICIENCY
    memory_efficiency: float = MEMORY_EFFICIENCY
    op_overhead_s: float = OP_OVERHEAD_S

    @property
    def name(self) -> str:
        return "roofline"

    def time_spread(self, device: Device) -> float:
        """0: an estimate has no measurement spread."""
        return 0.0

    def unit_times(
        self, device: Device, cost: UnitCost, micro_batch_size: int, numerics: Numerics
    ) -> UnitTimes:
        """Roofline forward and backward time of one micro-batch of ``micro_batch_size``:
        matmuls at the peak of ``numerics.compute_dtype``, activation traffic scaled by
        ``numerics.activation_bytes_factor``; convolutions by the faster of the ways cuDNN
        may run them (:func:`convolution_paths`: on tensor cores, channels-first ones pay
        :data:`LAYOUT_TRANSPOSE_PASSES` more passes over their activations)."""
        peak = peak_flops_per_s(
            device.type,
            numerics.compute_dtype,
            allow_tf32=numerics.allow_tf32,
        )
        factor = numerics.activation_bytes_factor * micro_batch_size
        overlapped_bytes = (
            cost.param_bytes
            + (cost.io_bytes_per_sample - cost.memory_bound_io_bytes_per_sample) * factor
        )
        bandwidth = device.type.memory_bandwidth_bytes_per_s * self.memory_efficiency
        matmul_flops = (cost.fwd_flops_per_sample - cost.conv_flops_per_sample) * micro_batch_size
        best: list[float] | None = None
        for conv_peak, transposed in convolution_paths(device.type, numerics):
            # the convolutions' FLOPs in matmul-peak FLOPs, so one roofline takes both
            flops = matmul_flops + cost.conv_flops_per_sample * micro_batch_size * peak / conv_peak
            serial_per_sample = cost.memory_bound_io_bytes_per_sample
            if transposed:
                serial_per_sample += (
                    LAYOUT_TRANSPOSE_PASSES * cost.channels_first_conv_io_bytes_per_sample
                )
            times = [
                self._time_s(
                    device.type, peak, ratio * flops, ratio * overlapped_bytes, ratio * cost.num_ops
                )
                + ratio * serial_per_sample * factor / bandwidth
                for ratio in (1.0, BACKWARD_TO_FORWARD_RATIO)
            ]
            if best is None or sum(times) < sum(best):
                best = times
        assert best is not None
        return UnitTimes(fwd_time_s=best[0], bwd_time_s=best[1])

    def optimizer_time_s(
        self, device: Device, cost: UnitCost, optimizer_state_bytes_per_param_byte: float
    ) -> float:
        """Memory-bound optimizer step: weights read and written, gradients read, state
        read and written, at the device's effective memory bandwidth."""
        passes = (
            OPTIMIZER_WEIGHT_GRAD_PASSES
            + OPTIMIZER_STATE_PASSES * optimizer_state_bytes_per_param_byte
        )
        num_bytes = cost.trainable_param_bytes * passes
        bandwidth = device.type.memory_bandwidth_bytes_per_s * self.memory_efficiency
        return num_bytes / bandwidth

    def _time_s(
        self, device: DeviceType, peak: float, flops: float, num_bytes: float, num_ops: float
    ) -> float:
        return roofline_time_s(
            flops=flops,
            num_bytes=num_bytes,
            num_ops=num_ops,
            peak_flops_per_s=peak,
            memory_bandwidth_bytes_per_s=device.memory_bandwidth_bytes_per_s,
            compute_efficiency=self.compute_efficiency,
            memory_efficiency=self.memory_efficiency,
            op_overhead_s=self.op_overhead_s,
        )


def convolution_paths(device: DeviceType, numerics: Numerics) -> tuple[tuple[float, bool], ...]:
    """The ways convolutions may run on ``device``: (peak FLOP/s, whether channels-first
    activations pay cuDNN's layout transposes) each; the cost model takes the faster, as
    cuDNN's algorithm choice does.

    On a GPU: CUDA cores at the fp32 peak, no transposes; and, where the convolution's dtype
    runs on tensor cores, at the tensor-core peak with transposes. A float32 convolution
    may take TF32 tensor cores whatever ``numerics.precision`` says of matmuls:
    ``torch.backends.cudnn.allow_tf32`` is True by default. Elsewhere one way: the
    matmuls' peak.
    """
    dtype = numerics.compute_dtype
    if device.device_class is not DeviceClass.GPU:
        return ((peak_flops_per_s(device, dtype, allow_tf32=numerics.allow_tf32), False),)
    paths = [(device.fp32_flops_per_s, False)]
    if runs_on_tensor_cores(device, dtype, allow_tf32=True):
        paths.append((peak_flops_per_s(device, dtype, allow_tf32=True), True))
    return tuple(paths)


def static_memory_bytes(
    cost: UnitCost,
    optimizer_state_bytes_per_param_byte: float,
    numerics: Numerics | None = None,
) -> float:
    """Parameters, gradients and optimizer state of one unit, bytes.

    trainable x (1 + 1 + state factor) + non-trainable parameters + buffers; for an fp32
    model that is 16 bytes per trainable parameter under AdamW, as mixed precision keeps it
    (fp32 master weights, gradients and Adam moments; Rajbhandari et al., "ZeRO", SC 2020,
    section 3.1, count 16 with fp16 weights and gradients plus an fp32 copy). Under
    autocast add the half-precision copy of the weights autocast makes for the forward
    (``activation_bytes_factor`` x parameter bytes; one copy: each micro-batch in flight
    holds its own until its backward, so pipelines with several in flight hold more).
    Workspace the runtime allocates for them is counted too (``contract.memory``): the flat
    copy of the gradients an all-reduce bucket takes (counted for every unit, shared or
    not: conservative) and the optimizer step's temporaries.
    """
    trainable = cost.trainable_param_bytes
    frozen = cost.param_bytes - trainable
    workspace = trainable * (
        1.0 + (OPTIMIZER_STEP_WORKSPACE if optimizer_state_bytes_per_param_byte > 0 else 0.0)
    )
    total = (
        trainable * (2.0 + optimizer_state_bytes_per_param_byte)
        + frozen
        + cost.buffer_bytes
        + workspace
    )
    if numerics is not None:
        total += cost.param_bytes * autocast_copy_factor(numerics)
    return total


def autocast_copy_factor(numerics: Numerics) -> float:
    """Bytes of the half-precision weight copy autocast makes per parameter byte: its dtype's
    bytes over the parameters' (0.5 for float32 weights under bf16/fp16), 0 when the weights
    are no wider than the autocast dtype (bf16 weights are used as they are) or without
    autocast; ``contract.memory`` counts the same."""
    half = numerics.precision.autocast_dtype
    if half is None:
        return 0.0
    ratio = DTYPE_BYTES[half] / DTYPE_BYTES[numerics.param_dtype]
    return ratio if ratio < 1.0 else 0.0


BATCH_STATISTICS_MIN_SAMPLES = 2
"""The fewest samples a micro-batch of a model with BatchNorm in train mode may hold
(``ModelGraph.batch_statistics``): one sample has no variance."""


def default_micro_batch_sizes(global_batch_size: int) -> tuple[int, ...]:
    """Micro-batch-size candidates: powers of two up to ``global_batch_size``, plus
    ``global_batch_size`` itself when it is not a power of two (so one replica can take the
    whole batch in one micro-batch). Example: 24 -> (1, 2, 4, 8, 16, 24).

    Raises:
        ConfigError: ``global_batch_size < 1``.
    """
    _check_global_batch(global_batch_size)
    sizes = [2**i for i in range(global_batch_size.bit_length()) if 2**i <= global_batch_size]
    if sizes[-1] != global_batch_size:
        sizes.append(global_batch_size)
    return tuple(sizes)


def build_problem(
    graph: ModelGraph,
    cluster: Cluster,
    *,
    global_batch_size: int,
    micro_batch_sizes: Sequence[int] | None = None,
    optimizer_state_bytes_per_param_byte: float = 2.0,
    time_source: UnitTimeSource | None = None,
    precisions: Mapping[str, Precision] | None = None,
    recompute: Policy = Policy.AUTO,
    schedule: Schedule = Schedule.ONE_F_ONE_B,
) -> PlanningProblem:
    """Fill and verify the solver's input for ``graph`` on ``cluster``.

    Args:
        graph: the model's cost graph (only ``units``, ``unit_costs``, ``cuts`` and
            ``param_dtype`` are read).
        micro_batch_sizes: candidates (any order, duplicates dropped); default
            ``default_micro_batch_sizes(global_batch_size)``.
        optimizer_state_bytes_per_param_byte: 2.0 for Adam/AdamW, 0.0 for plain SGD; see
            ``optimizer_state_factor``.
        time_source: default ``RooflineSource()``.
        precisions: device name -> the precision it computes in (default: fp32 for all).
            Unit times use each device's own; memory and cut bytes are per unit, not per
            device, in the solver's problem, so they take the widest precision present
            (one fp32 device counts every device's activations and cut tensors in fp32).
        recompute: which stages may recompute their activations (``--recompute``).
        schedule: the pipeline schedule the plan will run (``--schedule``).

    Returns:
        A verified ``PlanningProblem`` (D devices in cluster order, U units, K sizes).

    Raises:
        ConfigError: a batch size < 1, a micro-batch size outside 1..global_batch_size, a
            negative optimizer-state factor, or a parameter dtype with no catalog peak.
    """
    _check_global_batch(global_batch_size)
    floor = BATCH_STATISTICS_MIN_SAMPLES if graph.batch_statistics else 1
    sizes = _floored_candidates(
        _micro_batch_candidates(global_batch_size, micro_batch_sizes),
        floor,
        graph,
        global_batch_size,
    )
    factor = _checked_optimizer_factor(optimizer_state_bytes_per_param_byte)
    source = time_source if time_source is not None else RooflineSource()
    costs = graph.unit_costs
    num_units = len(costs)
    assert len(graph.units) == num_units and len(graph.cuts) == max(num_units - 1, 0)
    devices = cluster.devices
    numerics = device_numerics(devices, graph.param_dtype, precisions)
    widest = max(numerics, key=lambda n: n.activation_bytes_factor)
    fwd, bwd = _unit_time_arrays(source, devices, costs, sizes, numerics)
    bandwidth, latency = _link_arrays(cluster)
    problem = PlanningProblem(
        unit_names=tuple(u.name for u in graph.units),
        device_names=tuple(d.name for d in devices),
        device_nodes=tuple(d.node for d in devices),
        device_kinds=tuple(d.kind for d in devices),
        global_batch_size=global_batch_size,
        micro_batch_sizes=sizes,
        memory_capacity_bytes=_array(
            [usable_memory_bytes(d.type.memory_bytes, d.kind) for d in devices]
        ),
        fwd_time_s=fwd,
        bwd_time_s=bwd,
        optimizer_time_s=_array(
            [[source.optimizer_time_s(d, c, factor) for c in costs] for d in devices]
        ),
        static_memory_bytes=_array([static_memory_bytes(c, factor, widest) for c in costs]),
        activation_bytes_per_sample=_array(
            [c.activation_bytes_per_sample * widest.activation_bytes_factor for c in costs]
        ),
        grad_bytes=_array([c.trainable_param_bytes for c in costs]),
        bandwidth_bytes_per_s=bandwidth,
        latency_s=latency,
        tied_params=tuple(
            TiedParams(units, float(num_bytes))
            for units, num_bytes in sorted(graph.tied_trainable_bytes.items())
        ),
        recompute=recompute,
        schedule=schedule,
        optimizer_state_bytes=_array([c.trainable_param_bytes * factor for c in costs]),
        time_spread=_array([source.time_spread(d) for d in devices]),
        **_cut_arrays(graph, widest.precision),
        min_microbatch_samples=floor,
        **_collective_arrays(cluster),
        **_offload_arrays(cluster, costs, factor),
        tensor_parallel=tensor_parallel_input(graph, cluster, factor, widest),
    )
    problem.verify()
    return problem


def tensor_parallel_input(
    graph: ModelGraph, cluster: Cluster, factor: float, numerics: Numerics
) -> TensorParallelInput | None:
    """What TP groups would split in each unit (``UnitCost.tp``), sized as the problem
    sizes the whole unit (:func:`static_memory_bytes` of the split parameters alone,
    activations and all-reduced bytes at ``numerics``' activation precision), and which
    cards NVLink joins; None when the model offers no TP or no unit has a split."""
    costs = graph.unit_costs
    if graph.tp_max_degree < 2 or all(c.tp is None for c in costs):
        return None
    act = numerics.activation_bytes_factor
    split_static, split_state, split_grad, split_act, share, fwd, bwd, count = (
        [] for _ in range(8)
    )
    for cost in costs:
        tp = cost.tp
        split = 0 if tp is None else min(tp.split_param_bytes, cost.param_bytes)
        trainable = min(split, cost.trainable_param_bytes)
        part = replace(cost, param_bytes=split, trainable_param_bytes=trainable, buffer_bytes=0)
        split_static.append(static_memory_bytes(part, factor, numerics) if split else 0.0)
        split_state.append(trainable * factor)
        split_grad.append(float(trainable))
        if tp is None:
            split_act.append(0.0)
            share.append(0.0)
            fwd.append(0.0)
            bwd.append(0.0)
            count.append(0.0)
            continue
        flops = cost.fwd_flops_per_sample
        split_act.append(
            min(tp.split_activation_bytes_per_sample, cost.activation_bytes_per_sample) * act
        )
        share.append(min(tp.split_flops_per_sample / flops, 1.0) if flops > 0 else 0.0)
        fwd.append(tp.fwd_allreduce_bytes_per_sample * act)
        bwd.append(tp.bwd_allreduce_bytes_per_sample * act)
        count.append(float(tp.num_allreduces))
    devices = cluster.devices
    names = dict.fromkeys(p for unit in graph.units for p in unit.params)
    return TensorParallelInput(
        max_degree=graph.tp_max_degree,
        split_params=tuple(n for n in names if any(r.splits(n) for r in graph.tp_plan)),
        refusal=graph.tp_refusal,
        split_static_bytes=_array(split_static),
        split_optimizer_state_bytes=_array(split_state),
        split_grad_bytes=_array(split_grad),
        split_activation_bytes_per_sample=_array(split_act),
        split_time_share=_array(share),
        fwd_allreduce_bytes_per_sample=_array(fwd),
        bwd_allreduce_bytes_per_sample=_array(bwd),
        num_allreduces=_array(count),
        nvlink=np.array(
            [[a is not b and cluster.nvlink(a.name, b.name) for b in devices] for a in devices],
            dtype=bool,
        ),
        consumer_card=np.array([d.type.consumer_card for d in devices], dtype=bool),
    )


def _offload_arrays(cluster: Cluster, costs: Sequence[UnitCost], factor: float) -> dict[str, Any]:
    """The problem's offload figures (``PlanningProblem.offload_*``, ``cost.offload``): a
    GPU copies over PCIe, a ``cpu`` device within its own memory; each node's host memory
    as ``contract.memory.usable_host_memory_bytes`` counts it, a rank on every device."""
    trainable = [c.trainable_param_bytes for c in costs]
    host = {
        n.name: usable_host_memory_bytes(
            n.host_memory_bytes, [d.type.memory_bytes for d in n.devices], len(n.devices)
        )
        for n in cluster.nodes
    }

    def transfer_bytes_per_s(device: Device) -> float:
        if device.type.device_class is DeviceClass.CPU:
            return device.type.memory_bandwidth_bytes_per_s
        return PCIE_BANDWIDTH_BYTES_PER_S

    return {
        "offload_optimizer_time_s": _array(
            [
                [offload_step_time_s(t, factor, transfer_bytes_per_s(d)) for t in trainable]
                for d in cluster.devices
            ]
        ),
        "offload_saving_bytes": _array([offload_device_saving_bytes(t, factor) for t in trainable]),
        "offload_host_bytes": _array([offload_host_bytes(t, factor) for t in trainable]),
        "host_capacity_bytes": _array([host[d.node] for d in cluster.devices]),
    }


def _checked_optimizer_factor(factor: float) -> float:
    if not (math.isfinite(factor) and factor >= 0):
        raise ConfigError(f"optimizer state factor {factor!r} must be a finite number >= 0")
    return factor


def _cut_arrays(graph: ModelGraph, sender: Precision) -> dict[str, Any]:
    """The problem's ``cut_*`` arrays: bytes crossing each cut as a ``sender`` rank sends
    them (``contract.plan.wire_spec``), forward (activations) and backward (gradients); per
    sample for batched tensors, per micro-batch for the others (``batch_dim`` None)."""
    wire = [[wire_spec(t, sender) for t in cut] for cut in graph.cuts]

    def total(batched: bool, grad: bool) -> np.ndarray:
        return _array(
            [
                sum(
                    t.num_bytes(1)
                    for t in cut
                    if (t.batch_dim is not None) == batched and (t.requires_grad or not grad)
                )
                for cut in wire
            ]
        )

    return {
        "cut_bytes_per_sample": total(batched=True, grad=False),
        "cut_grad_bytes_per_sample": total(batched=True, grad=True),
        "cut_fixed_bytes": total(batched=False, grad=False),
        "cut_grad_fixed_bytes": total(batched=False, grad=True),
    }


def _check_global_batch(global_batch_size: int) -> None:
    if global_batch_size < 1:
        raise ConfigError(f"global batch size {global_batch_size} must be >= 1")


def _micro_batch_candidates(
    global_batch_size: int, micro_batch_sizes: Sequence[int] | None
) -> tuple[int, ...]:
    if micro_batch_sizes is None:
        return default_micro_batch_sizes(global_batch_size)
    if not micro_batch_sizes:
        raise ConfigError("micro-batch sizes are empty; give at least one, e.g. 1")
    for size in micro_batch_sizes:
        if not 1 <= size <= global_batch_size:
            raise ConfigError(
                f"micro-batch size {size} must be between 1 and the global batch size "
                f"{global_batch_size}"
            )
    return tuple(sorted(set(micro_batch_sizes)))


def _floored_candidates(
    sizes: tuple[int, ...], floor: int, graph: ModelGraph, global_batch_size: int
) -> tuple[int, ...]:
    """``sizes`` of at least ``floor`` samples.

    Raises:
        ConfigError: the global batch, or every size given, is below the floor.
    """
    kept = tuple(b for b in sizes if b >= floor)
    if kept:
        return kept
    layers = ", ".join(graph.batch_statistics[:3]) + (
        ", ..." if len(graph.batch_statistics) > 3 else ""
    )
    what = (
        f"global batch size {global_batch_size} (-b)"
        if global_batch_size < floor
        else f"micro-batch sizes {', '.join(map(str, sizes))} (--micro-batch-sizes)"
    )
    raise ConfigError(
        f"{what}: the model's batch norm ({layers}) normalises by the batch in training and "
        f"needs at least {floor} samples a micro-batch; give {floor} or more"
    )


def _array(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.float64)


def _unit_time_arrays(
    source: UnitTimeSource,
    devices: Sequence[Device],
    costs: Sequence[UnitCost],
    sizes: Sequence[int],
    numerics: Sequence[Numerics],
) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward times, each of shape (D, U, K), seconds."""
    fwd = np.zeros((len(devices), len(costs), len(sizes)))
    bwd = np.zeros_like(fwd)
    for d, device in enumerate(devices):
        for u, cost in enumerate(costs):
            for k, size in enumerate(sizes):
                times = source.unit_times(device, cost, size, numerics[d])
                fwd[d, u, k] = times.fwd_time_s
                bwd[d, u, k] = times.bwd_time_s
    return fwd, bwd


def _collective_arrays(cluster: Cluster) -> dict[str, Any]:
    """Per device, its node's measured all-reduce ring (latency per step, bus bandwidth);
    no entries when no node was measured."""
    if not cluster.node_collectives:
        return {}
    rings = [cluster.node_collectives.get(d.node) for d in cluster.devices]
    return {
        "collective_latency_s": _array([0.0 if r is None else r.latency_per_step_s for r in rings]),
        "collective_bus_bandwidth_bytes_per_s": _array(
            [np.inf if r is None else r.bus_bandwidth_bytes_per_s for r in rings]
        ),
    }


def _link_arrays(cluster: Cluster) -> tuple[np.ndarray, np.ndarray]:
    """Bandwidth (bytes/s) and latency (s), each (D, D). The diagonal, unused by the solver,
    holds the device's own node link so that every entry is finite and positive."""
    devices = cluster.devices
    bandwidth = np.zeros((len(devices), len(devices)))
    latency = np.zeros_like(bandwidth)
    for i, a in enumerate(devices):
        for j, b in enumerate(devices):
            link = cluster.node(a.node).intra_link if i == j else cluster.link(a.name, b.name)
            bandwidth[i, j] = link.bandwidth_bytes_per_s
            latency[i, j] = link.latency_s
    return bandwidth, latency


# A probe parameter big enough that per-tensor scalars would show if they were counted.
_PROBE_SHAPE = (16, 16)


def optimizer_state_factor(model_file: ModelFile, *, param_dtype: str = "float32") -> float:
    """Bytes of optimizer state per byte of parameter, for the model file's optimizer.

    Builds ``make_optimizer`` (or the convention's default, AdamW with lr 1e-3) on one probe
    parameter of ``param_dtype``, takes one step, and divides the bytes of the state tensors
    by the parameter's bytes. Zero-dimensional state (Adam's ``step`` counter) is a
    per-tensor constant, not per-parameter-byte, and is not counted. AdamW gives 2.0, SGD
    with momentum 1.0, SGD without momentum 0.0.

    Raises:
        ModelFileError: ``make_optimizer`` fails on the probe or does not return a
            ``torch.optim.Optimizer``.
        ConfigError: ``param_dtype`` is not a torch floating-point dtype name.
    """
    import torch  # deferred: the rest of the cost model needs no torch

    dtype = getattr(torch, param_dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"parameter dtype {param_dtype!r} is not a torch floating dtype")
    param = torch.nn.Parameter(torch.zeros(_PROBE_SHAPE, dtype=dtype))
    make = model_file.make_optimizer
    try:
        optimizer = make([param]) if make is not None else torch.optim.AdamW([param], lr=1e-3)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"it returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
        param.grad = torch.ones_like(param)
        optimizer.step()
    except Exception as exc:
        raise ModelFileError(
            f"make_optimizer in {str(model_file.path)!r} failed on a probe parameter "
            f"({type(exc).__name__}: {exc}); it must take a list of parameters and return an "
            "optimizer whose step() needs no closure"
        ) from None
    state_bytes = sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )
    return state_bytes / (param.numel() * param.element_size())
