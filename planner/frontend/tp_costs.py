"""What the model's tensor-parallel plan splits in each partition unit, read off the cost
graph, and the collectives it adds (Megatron-LM's accounting: Shoeybi et al., 2019).

The split modules are found by their nodes' ``module_path`` (a symbolic trace keeps an
``nn.Linear`` as one ``call_module`` node; ``torch.export`` inlines it into an aten
``linear`` whose ``nn_module_stack`` names the module). Between a column-split module and
its row-split partner every op works on 1/d of the features (an MLP's activation;
attention's heads): the nodes reached forward from a column-split output without passing a
split module, that also lead to a row-split input without passing one. Their FLOPs and
saved activations are split with the modules'. The collectives, per micro-batch:

- forward: an all-reduce of each row-split linear's output; a gather of each
  ``colwise_rep`` output, of a ``colwise`` output that reaches no ``rowwise`` partner, and
  of each embedding's output (the runtime splits an embedding by features, ``TpStyle``);
- backward: an all-reduce of the input gradient of the column-split modules, one per
  input they share (q, k and v read one normalised input: one all-reduce, as a fused qkv);
  a gather of a ``rowwise_rep`` linear's input gradient.

A Megatron transformer block has two all-reduces forward and two backward.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from hplan.planner.frontend.graph import OUTPUT, PLACEHOLDER, CostGraph
from hplan.planner.frontend.node_costs import tensor_nbytes
from hplan.runtime.contract.plan import TpStyle, UnitSpec

COLUMN_STYLES = (TpStyle.COLWISE, TpStyle.COLWISE_REP)
"""Styles that split a module's outputs (its weight's rows)."""
ROW_STYLES = (TpStyle.ROWWISE, TpStyle.ROWWISE_REP)
"""Styles that split a module's inputs and sum its partial outputs."""


@dataclass(frozen=True, slots=True)
class UnitTensorParallel:
    """What the model's tensor-parallel plan (``ModelSpec.tp_plan``) splits in one unit,
    per sample of the model's input, for the cost model of a TP group of degree ``d``
    (Megatron-LM's accounting, Shoeybi et al., 2019; Korthikanti et al., 2022).

    On each member of a group of degree ``d``: the split parameters' bytes / ``d`` plus the
    unit's other parameters whole; likewise the split FLOPs and the split saved
    activations; and the all-reduces below, each moving ``2 (d - 1) / d`` x its bytes
    around the group's ring (a gather, which moves ``(d - 1) / d`` x its bytes, is counted
    as an all-reduce of half its bytes).
    """

    split_param_bytes: int
    """Bytes of the unit's parameters the TP plan splits (every trainable one of them is
    split the same way with its gradient and optimizer state): the weights of the split
    modules and the biases of the column-split ones (a row-split bias stays whole)."""
    split_flops_per_sample: float
    """Forward FLOPs of the split modules and of the ops between a column-split module
    and its row-split partner (attention's heads, an MLP's activation), which each member
    runs on its 1/d."""
    split_activation_bytes_per_sample: float
    """Of ``activation_bytes_per_sample``: the bytes saved by those ops and by the
    row-split linears (whose saved input is split); a column-split module saves its whole
    input."""
    fwd_allreduce_bytes_per_sample: float
    """Bytes all-reduced in the forward: the output of every row-split module, and half
    the output gathered by a ``colwise_rep`` module."""
    bwd_allreduce_bytes_per_sample: float
    """Bytes all-reduced in the backward: the input gradient of the column-split modules
    whose input needs one (once per input they share), and half the input gradient a
    ``rowwise_rep`` linear gathers."""
    num_allreduces: int
    """Collectives per micro-batch, forward and backward together (their latency)."""


def module_nodes(graph: CostGraph, modules: Iterable[str]) -> dict[str, list[str]]:
    """Module path -> its computing nodes in graph order (not its parameters' get_attr)."""
    found: dict[str, list[str]] = {m: [] for m in modules}
    for name, data in graph.nodes(data=True):
        if data["op"] in ("get_attr", PLACEHOLDER, OUTPUT):
            continue
        if data["module_path"] in found:
            found[data["module_path"]].append(name)
    return found


def untraced_module(nodes: Mapping[str, list[str]]) -> str | None:
    """The refusal when a split module has no node of its own (the trace kept it whole
    inside another module, or it never runs): its split cannot be costed."""
    missing = next((m for m, found in nodes.items() if not found), None)
    if missing is None:
        return None
    return (
        f"the TP plan splits {missing!r}, which has no node of its own in the traced graph "
        "(kept whole inside another module, or never called); tensor parallelism is not "
        "offered"
    )


class _Sums:
    """Per-unit running totals of the split figures."""

    def __init__(self) -> None:
        self.param_bytes = 0
        self.flops = 0.0
        self.saved = 0.0
        self.fwd = 0.0
        self.bwd = 0.0
        self.collectives = 0

    def result(self) -> UnitTensorParallel:
        return UnitTensorParallel(
            split_param_bytes=self.param_bytes,
            split_flops_per_sample=self.flops,
            split_activation_bytes_per_sample=self.saved,
            fwd_allreduce_bytes_per_sample=self.fwd,
            bwd_allreduce_bytes_per_sample=self.bwd,
            num_allreduces=self.collectives,
        )


def unit_tensor_parallel(
    graph: CostGraph,
    units: Sequence[UnitSpec],
    model: nn.Module,
    modules: Mapping[str, TpStyle],
    nodes: Mapping[str, list[str]],
    param_names: Mapping[str, str],
) -> tuple[UnitTensorParallel | None, ...]:
    """Per unit, what the plan splits in it (None for a unit it splits nothing of).

    Args:
        graph: the cost graph, every node with its ``unit`` and per-sample costs.
        modules: split module path -> style (``tp_plan.TpModules.modules``).
        nodes: module path -> its nodes (:func:`module_nodes`), every list non-empty.
        param_names: a parameter's every name -> its canonical name (``TracedModel``).
    """
    index = {unit.name: idx for idx, unit in enumerate(units)}
    sums: dict[int, _Sums] = {}

    def at(node: str) -> _Sums:
        return sums.setdefault(index[graph.nodes[node]["unit"]], _Sums())

    in_module = {n: m for m, found in nodes.items() for n in found}
    for node in _between_pairs(graph, modules, nodes, in_module):
        at(node).flops += graph.nodes[node]["flops"]
        at(node).saved += graph.nodes[node]["saved_bytes"]
    reduced_inputs: set[str] = set()
    for path, style in modules.items():
        module = model.get_submodule(path)
        first = nodes[path][0]
        unit = units[index[graph.nodes[first]["unit"]]]
        total = at(first)
        total.param_bytes += _split_param_bytes(module, path, style, unit, param_names)
        total.flops += sum(graph.nodes[n]["flops"] for n in nodes[path])
        linear_rows = style in ROW_STYLES and isinstance(module, nn.Linear)
        if linear_rows:
            total.saved += sum(graph.nodes[n]["saved_bytes"] for n in nodes[path])
        source = _input(graph, nodes[path])
        output_bytes = _output_bytes(graph, nodes[path])
        if isinstance(module, nn.Embedding):  # split by features, gathered (TpStyle)
            total.fwd += output_bytes / 2
            total.collectives += 1
        elif style in ROW_STYLES:
            total.fwd += output_bytes
            total.collectives += 1
        elif style is TpStyle.COLWISE_REP or (
            style is TpStyle.COLWISE and not _reaches_rows(graph, nodes[path], in_module, modules)
        ):  # gathered whole: by its style, or where its split output is read
            total.fwd += output_bytes / 2
            total.collectives += 1
        if source is None or not _needs_grad(graph, source):
            continue
        if style in COLUMN_STYLES and source not in reduced_inputs:
            reduced_inputs.add(source)
            total.bwd += graph.nodes[source]["output_bytes"]
            total.collectives += 1
        if style is TpStyle.ROWWISE_REP and linear_rows:
            total.bwd += graph.nodes[source]["output_bytes"] / 2
            total.collectives += 1
    return tuple(sums[i].result() if i in sums else None for i in range(len(units)))


def split_values(
    graph: CostGraph, modules: Mapping[str, TpStyle], nodes: Mapping[str, list[str]]
) -> set[str]:
    """The values a TP group holds split by features: the outputs of the ``colwise``
    modules and of the ops between them and their ``rowwise`` partners. A stage boundary
    they cross makes a TP stage gather them (every member of a group sends and receives
    whole activations)."""
    in_module = {n: m for m, found in nodes.items() for n in found}
    columns = {n for m, style in modules.items() if style is TpStyle.COLWISE for n in nodes[m]}
    return columns | _between_pairs(graph, modules, nodes, in_module)


def _between_pairs(
    graph: CostGraph,
    modules: Mapping[str, TpStyle],
    nodes: Mapping[str, list[str]],
    in_module: Mapping[str, str],
) -> set[str]:
    """The nodes between a column-split module and its row-split partner: reached forward
    from a ``colwise`` output and backward from a ``rowwise`` input, neither walk passing
    a split module's node."""
    starts = [n for m, style in modules.items() if style is TpStyle.COLWISE for n in nodes[m]]
    ends = [n for m, style in modules.items() if style is TpStyle.ROWWISE for n in nodes[m]]
    ahead = _walk(graph, starts, in_module, forward=True)
    behind = _walk(graph, ends, in_module, forward=False)
    return ahead & behind


def _reaches_rows(
    graph: CostGraph, nodes: list[str], in_module: Mapping[str, str], modules: Mapping[str, TpStyle]
) -> bool:
    """Whether a column-split module's output reaches a ``rowwise`` partner (else it is
    gathered whole where it is read)."""
    ahead = _walk(graph, nodes, in_module, forward=True)
    return any(
        modules[in_module[user]] is TpStyle.ROWWISE
        for node in (*nodes, *ahead)
        for user in graph.successors(node)
        if user in in_module
    )


def _walk(
    graph: CostGraph, starts: list[str], stop: Mapping[str, str], *, forward: bool
) -> set[str]:
    step = graph.successors if forward else graph.predecessors
    seen: set[str] = set()
    work = [n for start in starts for n in step(start)]
    while work:
        node = work.pop()
        if node in seen or node in stop or graph.nodes[node]["op"] in (OUTPUT, PLACEHOLDER):
            continue
        seen.add(node)
        work.extend(step(node))
    return seen


def _split_param_bytes(
    module: nn.Module,
    path: str,
    style: TpStyle,
    unit: UnitSpec,
    param_names: Mapping[str, str],
) -> int:
    """Bytes of the module's split parameters the unit holds: the weight, and the bias of
    a column-split module (a row-split bias is added whole after the sum)."""
    total = 0
    for local, param in module.named_parameters(recurse=False):
        if local != "weight" and not (local == "bias" and style in COLUMN_STYLES):
            continue
        name = f"{path}.{local}"
        if param_names.get(name, name) in unit.params:
            total += tensor_nbytes(param)
    return total


def _input(graph: CostGraph, nodes: list[str]) -> str | None:
    """The module's activation input: the largest value its nodes read from outside."""
    inside = set(nodes)
    sources = [
        p
        for n in nodes
        for p in graph.predecessors(n)
        if p not in inside and graph.nodes[p]["op"] != "get_attr"
    ]
    return max(sources, key=lambda p: graph.nodes[p]["output_bytes"], default=None)


def _output_bytes(graph: CostGraph, nodes: list[str]) -> float:
    """Per-sample bytes of the module's outputs (its nodes read outside it)."""
    inside = set(nodes)
    return sum(
        graph.nodes[n]["output_bytes"]
        for n in nodes
        if any(user not in inside for user in graph.successors(n))
    )


def _needs_grad(graph: CostGraph, name: str) -> bool:
    """Whether a value gets a gradient: its recorded tensor says so; a graph input never
    does; a value without a record is taken to."""
    data = graph.nodes[name]
    if data["op"] == PLACEHOLDER:
        return False
    spec = data["tensor"]
    return True if spec is None else bool(spec.requires_grad)
