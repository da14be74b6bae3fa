"""Cost graph of a traced model: per-node and per-unit FLOPs, bytes and boundaries.

(Types are fixed here; the builder is implemented by the frontend work.)
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from hplan.runtime.plan import InputSpec, TensorSpec, UnitSpec
from hplan.runtime.trace import TracedModel


@dataclass(frozen=True, slots=True)
class UnitCost:
    """What one partition unit costs, independent of the device.

    All per-sample figures are for one sample of the model's input (e.g. one sequence).
    """

    name: str
    fwd_flops_per_sample: float
    """Forward FLOPs per sample (backward is estimated by the cost model)."""
    param_bytes: int
    """Bytes of the parameters the unit uses (a tied parameter counts in every unit using it)."""
    trainable_param_bytes: int
    """Bytes of the unit's parameters with requires_grad (what gradients and optimizer hold)."""
    buffer_bytes: int
    activation_bytes_per_sample: float
    """Bytes saved for backward per sample (measured with saved-tensor hooks)."""
    io_bytes_per_sample: float
    """Bytes the unit's ops read and write per sample (memory-traffic estimate)."""
    num_ops: int
    """Graph nodes in the unit (a proxy for kernel-launch overhead)."""


@dataclass(frozen=True)
class ModelGraph:
    """The traced model, split into partition units, with costs and cut tensors."""

    traced: TracedModel
    units: tuple[UnitSpec, ...]
    unit_costs: tuple[UnitCost, ...]
    cuts: tuple[tuple[TensorSpec, ...], ...]
    """cuts[i]: tensors crossing a boundary placed between unit i and unit i+1."""
    inputs: tuple[InputSpec, ...]
    param_dtype: str
    """torch dtype name of most parameter bytes, e.g. ``float32``."""
    graph: nx.DiGraph
    """One node per fx node (attributes: op, unit, flops, output_bytes, module_path)."""
    notes: tuple[str, ...]
    """Human-readable notes (trace fallbacks, merged units)."""

    def cut_bytes_per_sample(self, cut_idx: int) -> float:
        """Bytes per sample crossing cut ``cut_idx`` (batched tensors only), forward."""
        return float(sum(_bytes_per_sample(t) for t in self.cuts[cut_idx]))

    def cut_grad_bytes_per_sample(self, cut_idx: int) -> float:
        """Bytes per sample of gradients sent back across cut ``cut_idx``."""
        return float(sum(_bytes_per_sample(t) for t in self.cuts[cut_idx] if t.requires_grad))


_DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a torch dtype name (``float32`` -> 4)."""
    return _DTYPE_BYTES[dtype]


def _bytes_per_sample(spec: TensorSpec) -> float:
    numel = 1
    for dim in spec.shape:
        numel *= dim
    return float(numel * dtype_bytes(spec.dtype))
