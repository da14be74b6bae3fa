"""The solver's input: flat arrays, no torch, no files.

The cost model (``hplan.planner.cost.problem_builder``) fills a ``PlanningProblem`` from the model's
cost graph and the cluster; the solver reads only this. Indices: ``d`` device, ``u``
partition unit, ``k`` micro-batch-size candidate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

import numpy as np
from numpy.typing import NDArray

from hplan.runtime.contract.plan import Schedule

FloatArray = NDArray[np.float64]


class Policy(StrEnum):
    """How the solver may use one memory strategy (``hplan solve --recompute``, ``--zero``,
    ``--offload``): ``auto`` where it pays (the solver weighs it against the other layouts),
    ``never``, or ``always`` (every rank). Under ``--recompute auto`` a stage that does not
    fit recomputes the fewest of its units that make it fit (``cost.recompute``: cheapest per
    byte first), else all of them."""

    AUTO = "auto"
    NEVER = "never"
    ALWAYS = "always"


@dataclass(frozen=True, slots=True)
class TiedParams:
    """Trainable parameters that several units share (GPT-2's token embedding and LM head).

    Every device holding one of ``units`` holds a copy, and their gradients are summed
    over all those devices in one all-reduce (the runtime's ``grad_sync``).
    """

    units: tuple[int, ...]
    """Indices of the units using the parameters, ascending, at least two."""
    num_bytes: float
    """Bytes of those parameters' gradients, counted once; each unit's ``grad_bytes``
    includes them too."""


@dataclass(frozen=True, eq=False)
class TensorParallelInput:
    """What a tensor-parallel group would split, per unit, and which cards may form one
    (``cost.tensor_parallel`` builds the groups' problem from it). Shapes: U units, D
    devices of the problem it belongs to."""

    max_degree: int
    """The largest degree the model allows (``ModelGraph.tp_max_degree``); 1: none."""
    split_params: tuple[str, ...]
    """Canonical names of the parameters the TP plan splits (``TpRule.splits``)."""
    refusal: str | None
    """Why the model offers no TP (``ModelGraph.tp_refusal``); None when it does."""
    split_static_bytes: FloatArray
    """Of ``static_memory_bytes``: the split parameters' part, with their gradients,
    optimizer state and workspace, shape (U,)."""
    split_optimizer_state_bytes: FloatArray
    """Of ``optimizer_state_bytes``: the split parameters' state, shape (U,)."""
    split_grad_bytes: FloatArray
    """Of ``grad_bytes``: the split parameters' gradients, shape (U,)."""
    split_activation_bytes_per_sample: FloatArray
    """Of ``activation_bytes_per_sample``: the split ops' saved activations, shape (U,)."""
    split_time_share: FloatArray
    """Share of the unit's compute the split modules do (split FLOPs / all), shape (U,)."""
    fwd_allreduce_bytes_per_sample: FloatArray
    """Bytes all-reduced in the forward per sample, shape (U,)."""
    bwd_allreduce_bytes_per_sample: FloatArray
    """Bytes all-reduced in the backward per sample, shape (U,)."""
    num_allreduces: FloatArray
    """Collectives per micro-batch, forward and backward together, shape (U,)."""
    nvlink: NDArray[np.bool_]
    """Whether NVLink joins two devices, shape (D, D)."""
    consumer_card: NDArray[np.bool_]
    """GeForce-class card (no peer-to-peer over PCIe), shape (D,)."""

    def rows(self, idx: NDArray[np.int_]) -> TensorParallelInput:
        """The same for the devices ``idx`` only."""
        return replace(
            self, nvlink=self.nvlink[np.ix_(idx, idx)], consumer_card=self.consumer_card[idx]
        )


@dataclass(frozen=True, eq=False)
class SplitBytes:
    """The parts of a unit's memory and gradients that a TP group divides among its cards
    (the model's TP plan splits them), shape (U,) each; a card of a tp-d group holds
    ``whole - split * (1 - 1/d)`` of each (``PlanningProblem.static_bytes_on`` and the
    other accessors)."""

    static_bytes: FloatArray
    """Of ``static_memory_bytes``."""
    activation_bytes_per_sample: FloatArray
    """Of ``activation_bytes_per_sample``."""
    optimizer_state_bytes: FloatArray
    """Of ``optimizer_state_bytes``."""
    grad_bytes: FloatArray
    """Of ``grad_bytes``."""


def per_card_bytes(whole: FloatArray, split: FloatArray, degree: int) -> FloatArray:
    """``whole`` with its ``split`` part divided by ``degree``: what one card of a tp-
    ``degree`` group holds, shape (U,); ``whole`` itself at degree 1."""
    if degree == 1:
        return whole
    return np.maximum(whole - split * (1.0 - 1.0 / degree), 0.0)


@dataclass(frozen=True, eq=False)
class PlanningProblem:
    """Everything the solver needs, as arrays with units in their names.

    Shapes: D devices, U units, K micro-batch-size candidates.
    """

    unit_names: tuple[str, ...]
    device_names: tuple[str, ...]
    device_nodes: tuple[str, ...]
    """Node of each device, shape (D,)."""
    device_kinds: tuple[str, ...]
    """Catalog key of each device, shape (D,)."""
    global_batch_size: int
    micro_batch_sizes: tuple[int, ...]
    """Candidate micro-batch sizes, ascending, shape (K,)."""
    memory_capacity_bytes: FloatArray
    """Usable memory per device after framework reserve, shape (D,)."""
    fwd_time_s: FloatArray
    """Forward time of one micro-batch, shape (D, U, K)."""
    bwd_time_s: FloatArray
    """Backward time of one micro-batch, shape (D, U, K)."""
    optimizer_time_s: FloatArray
    """Optimizer-step time of each unit's parameters, shape (D, U)."""
    static_memory_bytes: FloatArray
    """Parameters + gradients + optimizer state per unit, shape (U,)."""
    activation_bytes_per_sample: FloatArray
    """Activations kept for backward per sample, shape (U,)."""
    cut_bytes_per_sample: FloatArray
    """Forward bytes crossing the cut after unit u, per sample, shape (U-1,)."""
    cut_grad_bytes_per_sample: FloatArray
    """Gradient bytes sent back across the cut after unit u, per sample, shape (U-1,)."""
    grad_bytes: FloatArray
    """Bytes of trainable-parameter gradients per unit to all-reduce, shape (U,)."""
    bandwidth_bytes_per_s: FloatArray
    """Link bandwidth between devices, shape (D, D); the diagonal is unused."""
    latency_s: FloatArray
    """Link latency between devices, shape (D, D)."""
    tied_params: tuple[TiedParams, ...] = ()
    """Parameters shared by several units, one entry per set of units."""
    collective_latency_s: FloatArray | None = None
    """Per ring step of an all-reduce on each device's node, as measured, shape (D,);
    0 where not measured; None: nothing measured (see ``CollectiveSpec``)."""
    collective_bus_bandwidth_bytes_per_s: FloatArray | None = None
    """The measured bus bandwidth of that all-reduce, shape (D,); inf where not measured."""
    recompute: Policy = Policy.AUTO
    """Which stages may recompute (``hplan solve --recompute``)."""
    schedule: Schedule = Schedule.ONE_F_ONE_B
    """The pipeline schedule the runtime runs: how many micro-batches each stage holds in
    flight (``contract.memory.in_flight_microbatches``)."""
    optimizer_state_bytes: FloatArray | None = None
    """The optimizer state part of ``static_memory_bytes`` per unit, shape (U,) (what ZeRO
    stage 1 shards); None: not split out (no sharding considered)."""
    offload_optimizer_time_s: FloatArray | None = None
    """The optimizer step of each unit's parameters when the device offloads it to host
    memory (``cost.offload.offload_step_time_s``), shape (D, U); None: offload not
    considered."""
    offload_saving_bytes: FloatArray | None = None
    """Device memory of each unit that offload moves to the host (optimizer state and the
    step's temporaries), shape (U,)."""
    offload_host_bytes: FloatArray | None = None
    """Host memory of each unit under offload (``contract.memory.offload_host_bytes``),
    shape (U,)."""
    host_capacity_bytes: FloatArray | None = None
    """Usable host memory of each device's node, shared by the node's devices, shape (D,)
    (``contract.memory.host_capacity_bytes``)."""
    cut_fixed_bytes: FloatArray | None = None
    """Forward bytes crossing the cut after unit u once per micro-batch of any size: its
    tensors without a batch dimension (T5's position bias, an auxiliary-loss scalar), shape
    (U-1,); None: none. ``cut_bytes_per_sample`` holds the batched ones."""
    cut_grad_fixed_bytes: FloatArray | None = None
    """Gradient bytes of those tensors sent back per micro-batch, shape (U-1,); None: none."""
    time_spread: FloatArray | None = None
    """How far apart a device's measured times lie, shape (D,): the p10-p90 width of its
    whole model's forward + backward over the profile's rounds, relative to the median, the
    median over its profiled micro-batch sizes (0.05: 5%); 0 for an estimated device; None:
    nothing measured. Predictions closer than this cannot be ranked
    (``cost.even_microbatches``)."""
    min_microbatch_samples: int = 1
    """The fewest samples a micro-batch may hold: 2 for a model with BatchNorm in train
    mode (``ModelGraph.batch_statistics``), else 1 (``TrainingSpec.min_microbatch_samples``)."""
    tensor_parallel: TensorParallelInput | None = None
    """What TP groups would split (None: the model offers no TP, or this problem's devices
    are already TP groups)."""
    tp_degrees: tuple[int, ...] = ()
    """The TP degree of each device, shape (D,): a device of degree d is a TP group of d
    cards (``cost.tensor_parallel.grouped_problem``) whose times are the group's and whose
    memory per card the accessors give (:meth:`static_bytes_on`, ...); empty: every device
    is a single card. The memory arrays above stay the whole units' (degree 1)."""
    tp_split: SplitBytes | None = None
    """The per-unit parts a TP group divides (None: no device is a TP group)."""
    tp_members: tuple[tuple[str, ...], ...] = ()
    """The cards of each device's TP group, lead first, shape (D,) of ``degree(d)`` names;
    empty when every degree is 1 (each device is its own name's card)."""
    tp_split_params: tuple[str, ...] = ()
    """Canonical names of the parameters the model's TP plan splits (a rank of a TP group
    of degree d all-reduces 1/d of each with its data-parallel peers; the simulator's
    buckets)."""
    _per_card: dict[tuple[str, int], FloatArray] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """Cache of the accessors' arrays by (quantity, degree)."""

    def degree(self, device_idx: int) -> int:
        """The TP degree of device ``device_idx`` (1: a single card)."""
        return self.tp_degrees[device_idx] if self.tp_degrees else 1

    @property
    def tp_degree(self) -> int:
        """The largest TP degree of this problem's devices (1: no TP group)."""
        return max(self.tp_degrees, default=1)

    @property
    def distinct_degrees(self) -> tuple[int, ...]:
        """The TP degrees of this problem's devices, ascending, once each."""
        return tuple(sorted(set(self.tp_degrees))) or (1,)

    def _card(self, name: str, whole: FloatArray, degree: int) -> FloatArray:
        split = self.tp_split
        if split is None or degree == 1:
            return whole
        key = (name, degree)
        if key not in self._per_card:
            self._per_card[key] = per_card_bytes(whole, getattr(split, name), degree)
        return self._per_card[key]

    def static_bytes_on(self, device_idx: int) -> FloatArray:
        """``static_memory_bytes`` per card of device ``device_idx``, shape (U,)."""
        return self.static_bytes_at(self.degree(device_idx))

    def static_bytes_at(self, degree: int) -> FloatArray:
        """``static_memory_bytes`` per card of a tp-``degree`` device, shape (U,)."""
        return self._card("static_bytes", self.static_memory_bytes, degree)

    def activation_bytes_on(self, device_idx: int) -> FloatArray:
        """``activation_bytes_per_sample`` per card of device ``device_idx``, shape (U,)."""
        return self.activation_bytes_at(self.degree(device_idx))

    def activation_bytes_at(self, degree: int) -> FloatArray:
        """``activation_bytes_per_sample`` per card of a tp-``degree`` device, shape (U,)."""
        return self._card("activation_bytes_per_sample", self.activation_bytes_per_sample, degree)

    def optimizer_state_on(self, device_idx: int) -> FloatArray | None:
        """``optimizer_state_bytes`` per card of device ``device_idx``, shape (U,)."""
        return self.optimizer_state_at(self.degree(device_idx))

    def optimizer_state_at(self, degree: int) -> FloatArray | None:
        """``optimizer_state_bytes`` per card of a tp-``degree`` device, shape (U,)."""
        if self.optimizer_state_bytes is None:
            return None
        return self._card("optimizer_state_bytes", self.optimizer_state_bytes, degree)

    def grad_bytes_on(self, device_idx: int) -> FloatArray:
        """``grad_bytes`` per card of device ``device_idx``, shape (U,): what each of the
        group's d data-parallel rings all-reduces (they run side by side)."""
        return self.grad_bytes_at(self.degree(device_idx))

    def grad_bytes_at(self, degree: int) -> FloatArray:
        """``grad_bytes`` per card of a tp-``degree`` device, shape (U,)."""
        return self._card("grad_bytes", self.grad_bytes, degree)

    def cut_bytes(self, cut_idx: int, micro_batch_size: float) -> float:
        """Forward bytes of one micro-batch of ``micro_batch_size`` samples crossing the cut
        after unit ``cut_idx``: the batched tensors' bytes per sample times the size, plus
        the unbatched ones' fixed bytes (sent with every micro-batch)."""
        fixed = 0.0 if self.cut_fixed_bytes is None else float(self.cut_fixed_bytes[cut_idx])
        return float(self.cut_bytes_per_sample[cut_idx]) * micro_batch_size + fixed

    def cut_grad_bytes(self, cut_idx: int, micro_batch_size: float) -> float:
        """Gradient bytes of one micro-batch sent back across the cut after unit
        ``cut_idx`` (as :meth:`cut_bytes`, for the tensors that require a gradient)."""
        fixed = self.cut_grad_fixed_bytes
        per_microbatch = 0.0 if fixed is None else float(fixed[cut_idx])
        return float(self.cut_grad_bytes_per_sample[cut_idx]) * micro_batch_size + per_microbatch

    def cut_fixed_array(self) -> FloatArray:
        """``cut_fixed_bytes`` with zeros for None, shape (U-1,)."""
        if self.cut_fixed_bytes is None:
            return np.zeros(max(self.num_units - 1, 0))
        return self.cut_fixed_bytes

    @property
    def num_devices(self) -> int:
        return len(self.device_names)

    @property
    def num_units(self) -> int:
        return len(self.unit_names)

    def verify(self) -> None:
        """Check array shapes and signs; raise ValueError naming the bad field."""
        d, u, k = self.num_devices, self.num_units, len(self.micro_batch_sizes)
        expected = {
            "memory_capacity_bytes": (d,),
            "fwd_time_s": (d, u, k),
            "bwd_time_s": (d, u, k),
            "optimizer_time_s": (d, u),
            "static_memory_bytes": (u,),
            "activation_bytes_per_sample": (u,),
            "cut_bytes_per_sample": (max(u - 1, 0),),
            "cut_grad_bytes_per_sample": (max(u - 1, 0),),
            "grad_bytes": (u,),
            "bandwidth_bytes_per_s": (d, d),
            "latency_s": (d, d),
        }
        for name, shape in expected.items():
            value = getattr(self, name)
            if value.shape != shape:
                raise ValueError(f"PlanningProblem.{name} has shape {value.shape}, want {shape}")
            if np.any(value < 0) or not np.all(np.isfinite(value)):
                raise ValueError(f"PlanningProblem.{name} must be finite and >= 0")
        if len(self.device_nodes) != d or len(self.device_kinds) != d:
            raise ValueError("device_nodes and device_kinds need one entry per device")
        if list(self.micro_batch_sizes) != sorted(set(self.micro_batch_sizes)):
            raise ValueError(f"micro_batch_sizes {self.micro_batch_sizes} must be ascending")
        if not self.micro_batch_sizes or self.micro_batch_sizes[0] < 1:
            raise ValueError("micro_batch_sizes must be >= 1")
        if self.micro_batch_sizes[0] < self.min_microbatch_samples:
            raise ValueError(
                f"micro_batch_sizes {self.micro_batch_sizes} go below min_microbatch_samples "
                f"{self.min_microbatch_samples}"
            )
        if self.global_batch_size < 1:
            raise ValueError(f"global_batch_size {self.global_batch_size} must be >= 1")
        if d == 0 or u == 0:
            raise ValueError("a problem needs at least one device and one unit")
        if self.time_spread is not None and (
            self.time_spread.shape != (d,)
            or not np.all(np.isfinite(self.time_spread) & (self.time_spread >= 0))
        ):
            raise ValueError(f"PlanningProblem.time_spread must have shape {(d,)}, finite, >= 0")
        for name in ("collective_latency_s", "collective_bus_bandwidth_bytes_per_s"):
            value = getattr(self, name)
            if value is not None and (value.shape != (d,) or np.any(np.isnan(value))):
                raise ValueError(f"PlanningProblem.{name} must have shape {(d,)}, no NaN")
        if self.collective_latency_s is not None and not np.all(
            np.isfinite(self.collective_latency_s) & (self.collective_latency_s >= 0)
        ):
            raise ValueError("PlanningProblem.collective_latency_s must be finite and >= 0")
        if self.collective_bus_bandwidth_bytes_per_s is not None and np.any(
            self.collective_bus_bandwidth_bytes_per_s <= 0
        ):
            raise ValueError("PlanningProblem.collective_bus_bandwidth_bytes_per_s must be > 0")
        optional = {
            "cut_fixed_bytes": (max(u - 1, 0),),
            "cut_grad_fixed_bytes": (max(u - 1, 0),),
            "offload_optimizer_time_s": (d, u),
            "offload_saving_bytes": (u,),
            "offload_host_bytes": (u,),
            "host_capacity_bytes": (d,),
        }
        for name, shape in optional.items():
            value = getattr(self, name)
            if value is not None and (
                value.shape != shape or np.any(value < 0) or not np.all(np.isfinite(value))
            ):
                raise ValueError(f"PlanningProblem.{name} must have shape {shape}, finite, >= 0")
        if self.tp_degrees and (len(self.tp_degrees) != d or min(self.tp_degrees) < 1):
            raise ValueError(f"tp_degrees needs {d} degrees >= 1, has {self.tp_degrees}")
        if self.tp_members and (
            len(self.tp_members) != d
            or any(len(m) != self.degree(i) for i, m in enumerate(self.tp_members))
        ):
            raise ValueError(f"tp_members needs {d} groups of each device's degree")
        for tie in self.tied_params:
            units = list(tie.units)
            if len(units) < 2 or units != sorted(set(units)) or not 0 <= units[0] < units[-1] < u:
                raise ValueError(f"tied_params units {tie.units} must be >= 2 ascending indices")
            if not (math.isfinite(tie.num_bytes) and tie.num_bytes >= 0):
                raise ValueError(f"tied_params bytes {tie.num_bytes} must be finite and >= 0")
            if any(self.grad_bytes[i] < tie.num_bytes for i in units):
                raise ValueError(f"tied_params bytes {tie.num_bytes} exceed a unit's grad_bytes")


def restrict(
    problem: PlanningProblem, devices: Sequence[int], global_batch_size: int | None = None
) -> PlanningProblem:
    """``problem`` on ``devices`` only (indices into it, in order), for a global batch of
    ``global_batch_size`` (default: the same).

    Every per-device array keeps the rows (and link matrix entries) of ``devices``; with a
    smaller batch, the micro-batch-size candidates above it are dropped (the smallest one
    always stays), so a layout of the result indexes the same sizes.
    """
    idx = np.array(devices)
    batch = problem.global_batch_size if global_batch_size is None else global_batch_size
    keep = [k for k, b in enumerate(problem.micro_batch_sizes) if b <= batch] or [0]

    def rows(value: FloatArray | None) -> FloatArray | None:
        return None if value is None else value[idx]

    return replace(
        problem,
        device_names=tuple(problem.device_names[d] for d in devices),
        device_nodes=tuple(problem.device_nodes[d] for d in devices),
        device_kinds=tuple(problem.device_kinds[d] for d in devices),
        global_batch_size=batch,
        micro_batch_sizes=tuple(problem.micro_batch_sizes[k] for k in keep),
        memory_capacity_bytes=problem.memory_capacity_bytes[idx],
        fwd_time_s=problem.fwd_time_s[idx][:, :, keep],
        bwd_time_s=problem.bwd_time_s[idx][:, :, keep],
        optimizer_time_s=problem.optimizer_time_s[idx],
        bandwidth_bytes_per_s=problem.bandwidth_bytes_per_s[np.ix_(idx, idx)],
        latency_s=problem.latency_s[np.ix_(idx, idx)],
        collective_latency_s=rows(problem.collective_latency_s),
        collective_bus_bandwidth_bytes_per_s=rows(problem.collective_bus_bandwidth_bytes_per_s),
        offload_optimizer_time_s=rows(problem.offload_optimizer_time_s),
        tensor_parallel=(
            None if problem.tensor_parallel is None else problem.tensor_parallel.rows(idx)
        ),
        tp_members=tuple(problem.tp_members[d] for d in devices) if problem.tp_members else (),
        tp_degrees=tuple(problem.tp_degrees[d] for d in devices) if problem.tp_degrees else (),
        host_capacity_bytes=rows(problem.host_capacity_bytes),
        time_spread=rows(problem.time_spread),
    )
