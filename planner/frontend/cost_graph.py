"""Cost graph of a traced model: per-node and per-unit FLOPs, bytes and boundaries.

``build_model_graph`` traces the model, measures every node at two batch sizes (see
``measure.py``: output shapes and dtypes, FLOPs, bytes read and written, bytes saved for
backward, per sample), groups the nodes into partition units and sums their costs, and
records the tensors that would cross each possible cut between units.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import networkx as nx
import torch

from hplan.planner.frontend.node_costs import NodeCost, measure_node_costs, tensor_nbytes
from hplan.planner.frontend.partition_units import assign_units, module_path
from hplan.runtime.capture.cuts import crossing_values, node_units, replicable_nodes
from hplan.runtime.capture.model_file import ModelFile
from hplan.runtime.capture.trace import TracedModel, bind_inputs, trace_model
from hplan.runtime.contract.errors import HplanError, ModelFileError, one_line
from hplan.runtime.contract.plan import DTYPE_BYTES, InputSpec, TensorSpec, UnitSpec


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
    tied_trainable_bytes: Mapping[tuple[int, ...], int] = field(default_factory=dict)
    """Indices of units sharing trainable parameters (a parameter listed by several
    units' ``UnitSpec.params``; GPT-2 ties its token embedding to its LM head) -> bytes
    of those parameters, counted once."""

    def cut_bytes_per_sample(self, cut_idx: int) -> float:
        """Bytes per sample crossing cut ``cut_idx`` (batched tensors only), forward."""
        return float(sum(t.num_bytes(1) for t in self.cuts[cut_idx]))

    def cut_grad_bytes_per_sample(self, cut_idx: int) -> float:
        """Bytes per sample of gradients sent back across cut ``cut_idx``."""
        return float(sum(t.num_bytes(1) for t in self.cuts[cut_idx] if t.requires_grad))


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a torch dtype name (``float32`` -> 4; see ``plan.DTYPE_BYTES``)."""
    return DTYPE_BYTES[dtype]


# ----------------------------------------------------------------------- the builder
def build_model_graph(
    model_file: ModelFile,
    *,
    batch_sizes: tuple[int, int] = (2, 3),
    leaf_modules: Sequence[str] = (),
    seed: int = 0,
) -> ModelGraph:
    """Trace a model file's model and measure what each node and unit costs.

    Args:
        model_file: the loaded model file; ``build_model`` runs after
            ``torch.manual_seed(seed)`` and ``sample_batch`` gives the example inputs.
        batch_sizes: the two batch sizes to measure at (distinct, >= 1).
        leaf_modules: module paths or class names to keep whole, besides the model
            file's ``LEAF_MODULES``.
        seed: RNG seed for building the model and the sample batches.

    Returns:
        The model graph: units, per-unit costs (per-sample figures for one sample),
        the tensors crossing every possible cut, the graph inputs and a networkx DiGraph
        (node attributes ``op``, ``unit``, ``flops``, ``output_bytes``, ``module_path``,
        per sample; edge attribute ``bytes``, per sample).

    Raises:
        ModelFileError: ``build_model``/``sample_batch`` raise or give unusable inputs.
        TraceError: the model cannot be traced or its graph cannot run.
        ValueError: ``batch_sizes`` are not two distinct positive integers.
    """
    small, large = _check_batch_sizes(batch_sizes)
    with torch.random.fork_rng(devices=[]):
        model = _build(model_file, seed)
        inputs = {b: _sample_inputs(model_file, model, b) for b in (small, large)}
    leaves = (*leaf_modules, *model_file.leaf_modules)
    traced = trace_model(model, inputs[small], leaf_modules=leaves)
    costs, measure_notes = measure_node_costs(model_file, traced, inputs, seed)
    specs = {name: c.spec for name, c in costs.items() if c.spec is not None}
    units, unit_notes = assign_units(traced, set(specs))
    gm = traced.graph_module
    node_unit = node_units(gm, units)
    replicable = replicable_nodes(gm)
    cuts = tuple(
        tuple(specs[n] for n in crossing_values(gm, node_unit, i, replicable=replicable))
        for i in range(len(units) - 1)
    )
    return ModelGraph(
        traced=traced,
        units=units,
        unit_costs=_unit_costs(model, traced, units, node_unit, costs),
        cuts=cuts,
        inputs=_input_specs(traced, units, node_unit, costs, replicable),
        param_dtype=_param_dtype(model),
        graph=_nx_graph(traced, units, node_unit, costs),
        notes=tuple(dict.fromkeys((*traced.notes, *unit_notes, *measure_notes))),  # no repeats
        tied_trainable_bytes=_tied_trainable_bytes(model, units),
    )


def _tied_trainable_bytes(
    model: torch.nn.Module, units: Sequence[UnitSpec]
) -> dict[tuple[int, ...], int]:
    params = dict(model.named_parameters())
    users: dict[str, set[int]] = {}
    for idx, unit in enumerate(units):
        for name in unit.params:
            users.setdefault(name, set()).add(idx)
    tied: dict[tuple[int, ...], int] = {}
    for name, idxs in users.items():
        if len(idxs) > 1 and params[name].requires_grad:
            key = tuple(sorted(idxs))
            tied[key] = tied.get(key, 0) + tensor_nbytes(params[name])
    return tied


def _check_batch_sizes(batch_sizes: tuple[int, int]) -> tuple[int, int]:
    small, large = sorted(batch_sizes)
    if small < 1 or small == large:
        raise ValueError(f"batch_sizes {batch_sizes} must be two distinct integers >= 1")
    return small, large


def _build(model_file: ModelFile, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    try:
        model = model_file.build_model()
    except HplanError:
        raise
    except Exception as exc:
        raise ModelFileError(
            f"build_model() in {str(model_file.path)!r} raised {one_line(exc)}; fix model.py"
        ) from None
    if not isinstance(model, torch.nn.Module):
        raise ModelFileError(
            f"build_model() returned a {type(model).__name__}; return a torch.nn.Module"
        )
    return model


def _sample_inputs(
    model_file: ModelFile, model: torch.nn.Module, batch_size: int
) -> dict[str, torch.Tensor]:
    try:
        batch = model_file.sample_batch(batch_size)
    except Exception as exc:
        raise ModelFileError(
            f"sample_batch({batch_size}) in {str(model_file.path)!r} raised "
            f"{one_line(exc)}; fix model.py"
        ) from None
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ModelFileError(
            f"sample_batch({batch_size}) must return (inputs, targets), got "
            f"{type(batch).__name__}; fix model.py"
        )
    return bind_inputs(model, batch[0])


# ----------------------------------------------------------------------- assembling
def _unit_costs(
    model: torch.nn.Module,
    traced: TracedModel,
    units: Sequence[UnitSpec],
    node_unit: Mapping[str, int],
    costs: Mapping[str, NodeCost],
) -> tuple[UnitCost, ...]:
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    held = _output_bytes_by_unit(traced.graph_module, node_unit, costs)
    ops = {n.name: n.op for n in traced.graph_module.graph.nodes}
    result = []
    for idx, unit in enumerate(units):
        nodes = [costs[n] for n in unit.nodes]
        calls = [n for n in unit.nodes if ops[n].startswith("call_")]
        result.append(
            UnitCost(
                name=unit.name,
                fwd_flops_per_sample=sum(c.flops for c in nodes),
                param_bytes=sum(tensor_nbytes(params[p]) for p in unit.params),
                trainable_param_bytes=sum(
                    tensor_nbytes(params[p]) for p in unit.params if params[p].requires_grad
                ),
                buffer_bytes=sum(tensor_nbytes(buffers[b]) for b in unit.buffers),
                activation_bytes_per_sample=sum(c.saved_bytes for c in nodes) + held[idx],
                io_bytes_per_sample=sum(c.io_bytes for c in nodes),
                num_ops=len(calls),
            )
        )
    return tuple(result)


def _output_bytes_by_unit(
    gm: torch.fx.GraphModule, node_unit: Mapping[str, int], costs: Mapping[str, NodeCost]
) -> list[float]:
    """Per-sample bytes of the graph outputs, charged to the unit that produces each.

    The outputs (e.g. the logits, batch x seq x vocab) stay alive until the loss and its
    backward have run, like saved activations.
    """
    held = [0.0] * (max(node_unit.values(), default=0) + 1)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for node in output.all_input_nodes:
        if node.name in node_unit:
            held[node_unit[node.name]] += costs[node.name].output_bytes
    return held


def _input_specs(
    traced: TracedModel,
    units: Sequence[UnitSpec],
    node_unit: Mapping[str, int],
    costs: Mapping[str, NodeCost],
    replicable: frozenset[str],
) -> tuple[InputSpec, ...]:
    """Graph inputs with the units that read them (directly or via replicated nodes)."""
    gm = traced.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    readers: dict[str, set[int]] = {n.name: set() for n in placeholders}
    for node in gm.graph.nodes:
        if node.name not in node_unit:
            continue
        for placeholder in _placeholders_read(node, replicable):
            readers[placeholder].add(node_unit[node.name])
    specs = []
    for node, name in zip(placeholders, traced.input_names, strict=True):
        spec = costs[node.name].spec
        if spec is None or spec.batch_dim is None:
            raise ModelFileError(
                f"input {name!r} from sample_batch does not grow with the batch size; "
                "make dim 0 of every input the sample dimension"
            )
        tensor = TensorSpec(
            name=name, shape=spec.shape, dtype=spec.dtype, batch_dim=spec.batch_dim,
            requires_grad=False,
        )  # fmt: skip
        read_by = tuple(units[i].name for i in sorted(readers[node.name]))
        specs.append(InputSpec(tensor=tensor, read_by_units=read_by))
    return tuple(specs)


def _placeholders_read(node: torch.fx.Node, replicable: frozenset[str]) -> set[str]:
    """Placeholders a node reads directly or through replicable nodes."""
    found: set[str] = set()
    work = list(node.all_input_nodes)
    seen: set[torch.fx.Node] = set()
    while work:
        current = work.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder":
            found.add(current.name)
        elif current.name in replicable:
            work.extend(current.all_input_nodes)
    return found


def _param_dtype(model: torch.nn.Module) -> str:
    """The dtype holding most parameter bytes (``float32`` for a model without any)."""
    totals: dict[str, int] = {}
    for param in model.parameters():
        dtype = str(param.dtype).removeprefix("torch.")
        totals[dtype] = totals.get(dtype, 0) + tensor_nbytes(param)
    return max(totals, key=lambda d: totals[d]) if totals else "float32"


def _nx_graph(
    traced: TracedModel,
    units: Sequence[UnitSpec],
    node_unit: Mapping[str, int],
    costs: Mapping[str, NodeCost],
) -> nx.DiGraph:
    """One node per fx node; per-sample FLOPs and bytes on nodes, bytes on edges."""
    graph: nx.DiGraph[str] = nx.DiGraph()
    for node in traced.graph_module.graph.nodes:
        cost = costs.get(node.name)
        unit = node_unit.get(node.name)
        graph.add_node(
            node.name,
            op=node.op,
            unit=units[unit].name if unit is not None else None,
            flops=cost.flops if cost else 0.0,
            output_bytes=cost.output_bytes if cost else 0.0,
            module_path=module_path(node, traced.module_classes),
        )
        for source in node.all_input_nodes:
            source_cost = costs.get(source.name)
            graph.add_edge(
                source.name, node.name, bytes=source_cost.output_bytes if source_cost else 0.0
            )
    return graph
