"""The cost-graph pass: per-node and per-unit FLOPs, bytes and boundaries of a captured model.

:func:`model_graph` builds the networkx graph of the captured fx graph (``graph.py``: its
structure), adds every node's costs measured at two batch sizes (``node_costs.py``: FLOPs,
output and saved bytes, bytes read and written, per sample), groups the nodes into
partition units by reading that graph (``partition_units.py``), and from it sums the units'
costs and records the tensors that would cross each possible cut between units. The graph
is the structure later steps read: after this pass every node carries its ``unit``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from hplan.planner.frontend.capture import (
    DEFAULT_BATCH_SIZES,
    CapturedModel,
    CaptureTensors,
    capture_model,
)
from hplan.planner.frontend.graph import (
    OUTPUT,
    PLACEHOLDER,
    CostGraph,
    batch_statistics_layers,
    crossing_values,
    in_unit,
    structure_graph,
)
from hplan.planner.frontend.node_costs import NodeCost, measure_node_costs, tensor_nbytes
from hplan.planner.frontend.partition_units import assign_units
from hplan.planner.frontend.tp_costs import (
    UnitTensorParallel,
    module_nodes,
    split_values,
    unit_tensor_parallel,
    untraced_module,
)
from hplan.planner.frontend.tp_plan import TpModules, max_degree, read_tp_plan, split_dimensions
from hplan.planner.frontend.trains_check import LossMemory
from hplan.runtime.capture.model_file import ModelFile
from hplan.runtime.capture.trace import TracedModel
from hplan.runtime.contract.errors import ModelFileError
from hplan.runtime.contract.plan import (
    TP_DEGREES,
    InputSpec,
    TensorSpec,
    TpRule,
    TraceMethod,
    UnitSpec,
)


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
    memory_bound_io_bytes_per_sample: float = 0.0
    """The part of ``io_bytes_per_sample`` moved by ops that do no counted FLOPs
    (elementwise, normalisation, softmax, copies: ``FlopCounterMode`` counts only matmuls,
    convolutions and attention). They run as kernels of their own, between the matmuls,
    so the cost model adds their time instead of hiding it under the matmuls'."""
    channels_first_conv_io_bytes_per_sample: float = 0.0
    """Activation input plus output bytes of the unit's channels-first (NCHW) convolutions,
    per sample: what cuDNN transposes to and from channels-last around a tensor-core
    convolution (``node_costs.py``)."""
    conv_flops_per_sample: float = 0.0
    """The part of ``fwd_flops_per_sample`` done by convolutions (cuDNN's: they may run on
    tensor cores where the matmuls do not, ``problem_builder.RooflineSource``)."""
    tp: UnitTensorParallel | None = None
    """How the model's tensor-parallel plan splits this unit; None: the plan splits none of
    its modules (or the model has no plan), and a TP group runs the unit whole on every
    member."""


@dataclass(frozen=True, slots=True)
class ParamSize:
    """Size of one trainable parameter (what its gradient holds)."""

    numel: int
    """Elements."""
    element_bytes: int
    """Bytes per element of the parameter's dtype."""


@dataclass(frozen=True)
class ModelGraph:
    """The traced model, split into partition units, with costs and cut tensors.

    Every field but :attr:`traced` is plain data (what a capture file holds, see
    ``capture_file.py``); the passes after the cost graph read only those.
    """

    units: tuple[UnitSpec, ...]
    unit_costs: tuple[UnitCost, ...]
    cuts: tuple[tuple[TensorSpec, ...], ...]
    """cuts[i]: tensors crossing a boundary placed between unit i and unit i+1."""
    inputs: tuple[InputSpec, ...]
    param_dtype: str
    """torch dtype name of most parameter bytes, e.g. ``float32``."""
    graph: CostGraph
    """One node per fx node: the structure (``graph.structure_graph``) plus, per sample,
    ``flops``, ``output_bytes``, ``saved_bytes``, ``io_bytes``,
    ``channels_first_conv_bytes``, ``conv_flops``, ``tensor`` (the output's
    ``TensorSpec`` when it may cross a cut, else None) and ``unit`` (None for placeholders
    and the output); edge attribute ``bytes``, per sample."""
    notes: tuple[str, ...]
    """Human-readable notes (trace fallbacks, merged units)."""
    trace_method: TraceMethod
    """How the graph was traced (the plan records it; ranks re-trace with it)."""
    leaf_modules: tuple[str, ...]
    """Module paths the trace kept whole (given + found automatically)."""
    graph_fingerprint: str
    """``TracedModel.fingerprint()`` of the traced graph (sha256 hex)."""
    trainable_param_sizes: Mapping[str, ParamSize]
    """Canonical parameter name (as in ``StageModule``) -> its size, for every trainable
    parameter, in ``named_parameters`` order."""
    tied_trainable_bytes: Mapping[tuple[int, ...], int] = field(default_factory=dict)
    """Indices of units sharing trainable parameters (a parameter listed by several
    units' ``UnitSpec.params``; GPT-2 ties its token embedding to its LM head) -> bytes
    of those parameters, counted once."""
    batch_statistics: tuple[str, ...] = ()
    """Layers that normalise by the batch's statistics in training (BatchNorm in train mode,
    ``graph.batch_statistics_layers``): no micro-batch of one sample for them."""
    tp_plan: tuple[TpRule, ...] = ()
    """The model's tensor-parallel plan (``ModelSpec.tp_plan``); empty: none."""
    tp_max_degree: int = 1
    """The largest degree of ``TP_DEGREES`` that divides every split dimension (features,
    attention heads, vocabulary) of the plan; 1: tensor parallelism is not offered."""
    tp_refusal: str | None = None
    """Why tensor parallelism is not offered for this model, one line for the summary
    (``the model has no TP_PLAN and no Hugging Face base_model_tp_plan``); None when it is."""
    tp_split_cuts: tuple[int, ...] = ()
    """Indices of the cuts (:attr:`cuts`) that values the TP plan splits cross: the output
    of a ``colwise`` module, or of an op between it and its ``rowwise`` partner. A stage of
    degree > 1 that ends or starts there gathers them whole (an all-gather of their bytes
    in its group, ``tp_costs.split_values``); a cut elsewhere moves whole activations."""
    traced: TracedModel | None = None
    """The traced module, when this graph was measured in this process; None when it was
    read from a capture file. Only what runs the graph (``hplan profile``) needs it."""

    def traced_module(self) -> TracedModel:
        """:attr:`traced`; ValueError when the graph was read from a capture file (a caller
        that runs the graph must capture the model itself)."""
        if self.traced is None:
            raise ValueError("this model graph was read from a capture file; it has no module")
        return self.traced

    def cut_bytes_per_sample(self, cut_idx: int) -> float:
        """Bytes per sample crossing cut ``cut_idx`` (batched tensors only), forward."""
        return float(sum(t.num_bytes(1) for t in self.cuts[cut_idx] if t.batch_dim is not None))

    def cut_grad_bytes_per_sample(self, cut_idx: int) -> float:
        """Bytes per sample of gradients sent back across cut ``cut_idx`` (batched only)."""
        return float(
            sum(
                t.num_bytes(1)
                for t in self.cuts[cut_idx]
                if t.requires_grad and t.batch_dim is not None
            )
        )

    def verify(self) -> None:
        """Check the graph's invariants; raise ValueError naming the first broken one.

        Every node of a unit is a graph node whose ``unit`` attribute names it, every other
        graph node is a placeholder or the output; one cut between each pair of units, each
        of tensors the graph produces (batch-linear, or without a batch dimension: sent
        whole with every micro-batch); one cost per unit, every figure finite and >= 0.
        """
        placed = {n: u.name for u in self.units for n in u.nodes}
        for name, data in self.graph.nodes(data=True):
            if data.get("unit") != placed.get(name):
                raise ValueError(
                    f"graph node {name!r} has unit {data.get('unit')!r}, want {placed.get(name)!r}"
                )
            if name not in placed and in_unit(self.graph, name):
                raise ValueError(f"graph node {name!r} belongs to no unit")
        if len(self.cuts) != max(len(self.units) - 1, 0) or len(self.unit_costs) != len(self.units):
            raise ValueError(
                f"{len(self.units)} units need {len(self.units) - 1} cuts and {len(self.units)} "
                f"costs, got {len(self.cuts)} and {len(self.unit_costs)}"
            )
        for cut in self.cuts:
            for tensor in cut:
                if tensor.name not in self.graph:
                    raise ValueError(f"cut tensor {tensor.name!r} is not a graph value")
        for cost in self.unit_costs:
            numbers = (
                cost.fwd_flops_per_sample,
                cost.activation_bytes_per_sample,
                cost.io_bytes_per_sample,
            )
            if not all(math.isfinite(v) and v >= 0 for v in numbers):
                raise ValueError(f"unit {cost.name!r} has a cost that is not finite and >= 0")
        self._verify_tp()

    def _verify_tp(self) -> None:
        """Tensor parallelism offered (a plan, a degree > 1, no refusal) or not (degree 1,
        no unit split, no split cut; a refusal comes without a plan); split cuts are cuts;
        a unit splits no more than it has."""
        offered = self.tp_refusal is None and bool(self.tp_plan)
        if self.tp_max_degree not in TP_DEGREES:
            raise ValueError(f"tp_max_degree {self.tp_max_degree} is not one of {TP_DEGREES}")
        if offered != (self.tp_max_degree > 1) or (self.tp_refusal and self.tp_plan):
            raise ValueError(
                f"tp_refusal {self.tp_refusal!r} disagrees with tp_max_degree "
                f"{self.tp_max_degree} and a TP plan of {len(self.tp_plan)} rules"
            )
        if not all(0 <= i < len(self.cuts) for i in self.tp_split_cuts) or (
            self.tp_split_cuts and not offered
        ):
            raise ValueError(f"tp_split_cuts {self.tp_split_cuts} name no cut of a TP plan")
        for cost in self.unit_costs:
            tp = cost.tp
            if tp is None:
                continue
            if not offered:
                raise ValueError(
                    f"unit {cost.name!r} is split but tensor parallelism is not offered"
                )
            pairs = (
                (tp.split_param_bytes, cost.param_bytes),
                (tp.split_flops_per_sample, cost.fwd_flops_per_sample),
                (tp.split_activation_bytes_per_sample, cost.activation_bytes_per_sample),
            )
            if any(part > whole * (1 + 1e-9) for part, whole in pairs):  # sums' rounding
                raise ValueError(f"unit {cost.name!r} splits more than it has")


# ----------------------------------------------------------------------- the builders
def build_model_graph(
    model_file: ModelFile,
    *,
    batch_sizes: tuple[int, int] = DEFAULT_BATCH_SIZES,
    leaf_modules: Sequence[str] = (),
    seed: int = 0,
    tensors: CaptureTensors = CaptureTensors.FAKE,
) -> ModelGraph:
    """Capture a model file's model (``capture.capture_model``) and build its cost graph.

    Args:
        model_file: the loaded model file; ``build_model`` runs after
            ``torch.manual_seed(seed)`` and ``sample_batch`` gives the example inputs.
        batch_sizes: the two batch sizes to measure at (distinct, >= 1).
        leaf_modules: module paths or class names to keep whole, besides the model
            file's ``LEAF_MODULES``.
        seed: RNG seed for building the model and the sample batches.
        tensors: FAKE to capture on fake tensors as a solve does (the graph's module then
            holds fake tensors); CPU for a graph that runs on real tensors (profiling).

    Raises:
        ModelFileError: ``build_model``/``sample_batch`` raise or give unusable inputs.
        TraceError: the model cannot be traced or its graph cannot run.
        ValueError: ``batch_sizes`` are not two distinct positive integers.
    """
    captured = capture_model(
        model_file,
        leaf_modules=tuple(leaf_modules),
        seed=seed,
        batch_sizes=batch_sizes,
        tensors=tensors,
    )
    return model_graph(captured)


def model_graph(captured: CapturedModel, loss_memory: LossMemory | None = None) -> ModelGraph:
    """The cost graph of a captured model (see the module docstring).

    ``loss_memory``: what ``loss_fn`` saves (the trains check's measurement), charged with
    the model outputs to the unit that produces them (:func:`_output_bytes_by_unit`).

    Returns:
        The model graph: units, per-unit costs (per-sample figures for one sample), the
        tensors crossing every possible cut, the graph inputs, and the networkx graph.

    Raises:
        ModelFileError: the traced graph cannot run at a batch size, or an input does not
            grow with the batch size.
    """
    traced, model = captured.traced, captured.model
    costs, measure_notes = measure_node_costs(captured)
    graph = structure_graph(traced)
    _add_costs(graph, costs)
    specs = {name: c.spec for name, c in costs.items() if c.spec is not None}
    units, unit_notes = assign_units(traced, set(specs), graph)
    node_unit = {n: i for i, unit in enumerate(units) for n in unit.nodes}
    for name in graph.nodes:
        graph.nodes[name]["unit"] = units[node_unit[name]].name if name in node_unit else None
    cuts = tuple(
        tuple(specs[n] for n in crossing_values(graph, node_unit, i)) for i in range(len(units) - 1)
    )
    tp = _tensor_parallel(captured, graph, units, cuts)
    unit_costs = _unit_costs(model, graph, units, node_unit, loss_memory)
    return ModelGraph(
        units=units,
        unit_costs=tuple(replace(c, tp=t) for c, t in zip(unit_costs, tp.units, strict=True)),
        cuts=cuts,
        inputs=_input_specs(traced, graph, units, node_unit),
        param_dtype=_param_dtype(model),
        graph=graph,
        notes=tuple(
            dict.fromkeys(
                (
                    *captured.notes,
                    *traced.notes,
                    *unit_notes,
                    *measure_notes,
                    *_uncosted_notes(costs, graph),
                )
            )
        ),  # no repeats
        trace_method=traced.method,
        leaf_modules=traced.leaf_modules,
        graph_fingerprint=traced.fingerprint(),
        trainable_param_sizes=_trainable_param_sizes(traced),
        tied_trainable_bytes=_tied_trainable_bytes(model, units),
        batch_statistics=batch_statistics_layers(model, traced.graph_module),
        tp_plan=tp.rules,
        tp_max_degree=tp.max_degree,
        tp_refusal=tp.refusal,
        tp_split_cuts=tp.split_cuts,
        traced=traced,
    )


@dataclass(frozen=True)
class _ModelTp:
    """The model's tensor-parallel plan, what it splits per unit and its largest degree."""

    units: tuple[UnitTensorParallel | None, ...]
    rules: tuple[TpRule, ...] = ()
    max_degree: int = 1
    refusal: str | None = None
    split_cuts: tuple[int, ...] = ()


def _tensor_parallel(
    captured: CapturedModel,
    graph: CostGraph,
    units: Sequence[UnitSpec],
    cuts: Sequence[Sequence[TensorSpec]],
) -> _ModelTp:
    """The model's TP plan (``tp_plan.py``), what it splits in each unit (``tp_costs.py``),
    the largest degree dividing what it splits and the cuts its split values cross; a
    refusal leaves every unit whole."""
    whole = (None,) * len(units)
    plan: TpModules = read_tp_plan(captured.model_file, captured.model)
    if plan.refusal is not None:
        return _ModelTp(whole, refusal=plan.refusal)
    nodes = module_nodes(graph, plan.modules)
    refusal = untraced_module(nodes)
    if refusal is not None:
        return _ModelTp(whole, refusal=refusal)
    degree, refusal = max_degree(split_dimensions(captured.model, plan, graph, nodes))
    if refusal is not None:
        return _ModelTp(whole, refusal=refusal)
    split = unit_tensor_parallel(
        graph, units, captured.model, plan.modules, nodes, captured.traced.param_names
    )
    sharded = split_values(graph, plan.modules, nodes)
    split_cuts = tuple(i for i, cut in enumerate(cuts) if any(t.name in sharded for t in cut))
    return _ModelTp(split, plan.rules, degree, split_cuts=split_cuts)


def _uncosted_notes(costs: Mapping[str, NodeCost], graph: CostGraph) -> tuple[str, ...]:
    """One note per op that computes without a FLOP figure, naming the units that run it."""
    units: dict[str, list[str]] = {}
    for name, cost in costs.items():
        for op in cost.uncosted_ops:
            unit = graph.nodes[name]["unit"] if name in graph else None
            units.setdefault(op, [])
            if unit is not None and unit not in units[op]:
                units[op].append(unit)
    return tuple(
        f"no FLOP figure for {op} (in {', '.join(where) or 'the model'}): the cost model "
        "charges it only for the bytes it moves, so its compute time is missing"
        for op, where in units.items()
    )


def _trainable_param_sizes(traced: TracedModel) -> dict[str, ParamSize]:
    """Canonical name -> size of every trainable parameter of the traced module."""
    out: dict[str, ParamSize] = {}
    for name, param in traced.graph_module.named_parameters(remove_duplicate=False):
        if param.requires_grad:
            canonical = traced.param_names.get(name, name)
            out[canonical] = ParamSize(param.numel(), param.element_size())
    return out


def _add_costs(graph: CostGraph, costs: Mapping[str, NodeCost]) -> None:
    """Per-sample costs on the nodes (0 where unmeasured); source output bytes on edges."""
    for name, data in graph.nodes(data=True):
        cost = costs.get(name)
        data["flops"] = cost.flops if cost else 0.0
        data["output_bytes"] = cost.output_bytes if cost else 0.0
        data["saved_bytes"] = cost.saved_bytes if cost else 0.0
        data["io_bytes"] = cost.io_bytes if cost else 0.0
        data["channels_first_conv_bytes"] = cost.channels_first_conv_bytes if cost else 0.0
        data["conv_flops"] = cost.conv_flops if cost else 0.0
        data["tensor"] = cost.spec if cost else None
    for source, _, data in graph.edges(data=True):
        data["bytes"] = graph.nodes[source]["output_bytes"]


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


# ----------------------------------------------------------------------- assembling
def _unit_costs(
    model: torch.nn.Module,
    graph: CostGraph,
    units: Sequence[UnitSpec],
    node_unit: Mapping[str, int],
    loss_memory: LossMemory | None,
) -> tuple[UnitCost, ...]:
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    held = _output_bytes_by_unit(graph, node_unit, len(units), loss_memory)
    result = []
    for idx, unit in enumerate(units):
        nodes = [graph.nodes[n] for n in unit.nodes]
        result.append(
            UnitCost(
                name=unit.name,
                fwd_flops_per_sample=sum(d["flops"] for d in nodes),
                param_bytes=sum(tensor_nbytes(params[p]) for p in unit.params),
                trainable_param_bytes=sum(
                    tensor_nbytes(params[p]) for p in unit.params if params[p].requires_grad
                ),
                buffer_bytes=sum(tensor_nbytes(buffers[b]) for b in unit.buffers),
                activation_bytes_per_sample=sum(d["saved_bytes"] for d in nodes) + held[idx],
                io_bytes_per_sample=sum(d["io_bytes"] for d in nodes),
                memory_bound_io_bytes_per_sample=sum(
                    d["io_bytes"] for d in nodes if d["flops"] == 0
                ),
                channels_first_conv_io_bytes_per_sample=sum(
                    d["channels_first_conv_bytes"] for d in nodes
                ),
                conv_flops_per_sample=sum(d["conv_flops"] for d in nodes),
                num_ops=sum(1 for d in nodes if d["op"].startswith("call_")),
            )
        )
    return tuple(result)


def _output_bytes_by_unit(
    graph: CostGraph, node_unit: Mapping[str, int], num_units: int, loss: LossMemory | None
) -> list[float]:
    """Per-sample bytes the loss holds at the start of the backward, charged to the unit
    that produces each graph output (the loss's own to the unit of the largest output).

    The outputs (e.g. the logits, batch x seq x vocab) stay alive until the loss and its
    backward have run, like saved activations. With ``loss`` (what ``loss_fn`` saved),
    the loss's backward adds, while every activation of the last stage is still saved:
    the loss's saved tensors, the gradient of the outputs (their bytes again) and one
    gradient the size of the loss's largest saved tensor, which its backward makes before
    freeing the one it reads (cross-entropy: the gradient of its log-softmax, logits-sized;
    so logits-sized tensors peak at four: logits, log-softmax, and their two gradients).
    """
    held = [0.0] * max(num_units, 1)
    output = next(n for n, d in graph.nodes(data=True) if d["op"] == OUTPUT)
    produced = [n for n in graph.predecessors(output) if n in node_unit]
    factor = 1 if loss is None else 2  # the outputs and, with a loss, their gradient
    for name in produced:
        held[node_unit[name]] += factor * graph.nodes[name]["output_bytes"]
    if loss is not None and produced:
        largest = max(produced, key=lambda n: graph.nodes[n]["output_bytes"])
        held[node_unit[largest]] += loss.saved_bytes_per_sample + (
            loss.largest_saved_bytes_per_sample
        )
    return held


def _input_specs(
    traced: TracedModel,
    graph: CostGraph,
    units: Sequence[UnitSpec],
    node_unit: Mapping[str, int],
) -> tuple[InputSpec, ...]:
    """Graph inputs with the units that read them (directly or via replicated nodes)."""
    placeholders = [n for n, d in graph.nodes(data=True) if d["op"] == PLACEHOLDER]
    readers: dict[str, set[int]] = {n: set() for n in placeholders}
    for name in graph.nodes:
        if name not in node_unit:
            continue
        for placeholder in _placeholders_read(graph, name):
            readers[placeholder].add(node_unit[name])
    specs = []
    for node, name in zip(placeholders, traced.input_names, strict=True):
        spec = graph.nodes[node]["tensor"]
        if spec is None or spec.batch_dim is None:
            raise ModelFileError(
                f"input {name!r} from sample_batch does not grow with the batch size; "
                "make dim 0 of every input the sample dimension"
            )
        tensor = TensorSpec(
            name=name, shape=spec.shape, dtype=spec.dtype, batch_dim=spec.batch_dim,
            requires_grad=False,
        )  # fmt: skip
        read_by = tuple(units[i].name for i in sorted(readers[node]))
        specs.append(InputSpec(tensor=tensor, read_by_units=read_by))
    return tuple(specs)


def _placeholders_read(graph: CostGraph, name: str) -> set[str]:
    """Placeholders a node reads directly or through replicable nodes."""
    found: set[str] = set()
    work = list(graph.predecessors(name))
    seen: set[str] = set()
    while work:
        current = work.pop()
        if current in seen:
            continue
        seen.add(current)
        data = graph.nodes[current]
        if data["op"] == PLACEHOLDER:
            found.add(current)
        elif data["replicable"]:
            work.extend(graph.predecessors(current))
    return found


def _param_dtype(model: torch.nn.Module) -> str:
    """The dtype holding most parameter bytes (``float32`` for a model without any)."""
    totals: dict[str, int] = {}
    for param in model.parameters():
        dtype = str(param.dtype).removeprefix("torch.")
        totals[dtype] = totals.get(dtype, 0) + tensor_nbytes(param)
    return max(totals, key=lambda d: totals[d]) if totals else "float32"
