"""Cut a traced model into pipeline stages (mechanism only: the plan decides the cuts).

A stage is the sub-graph of the traced model that holds the nodes of its partition units,
plus copies of the cheap nodes they need that depend on no parameter (``get_attr`` nodes,
sizes, ``arange``, masks: see :func:`replicable_nodes`), so that such values never cross a
stage boundary. Every other value produced before the stage and read in it (or by the
graph output, after it) is received; the plan lists those names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from hplan.runtime.capture.cuts import MISMATCH, node_units, replicable_nodes
from hplan.runtime.capture.segments import Segment, run_segments, split_segments
from hplan.runtime.capture.trace import TracedModel
from hplan.runtime.contract.errors import PlanMismatchError
from hplan.runtime.contract.plan import UnitSpec


class StageModule(nn.Module):
    """One pipeline stage: a sub-graph of the traced model with named inputs and outputs."""

    def __init__(
        self,
        graph_module: torch.fx.GraphModule,
        *,
        input_names: tuple[str, ...],
        recv_names: tuple[str, ...],
        send_names: tuple[str, ...],
        is_last: bool,
        out_spec: pytree.TreeSpec | None,
        param_names: Mapping[str, str],
        unit_names: tuple[str, ...],
        node_units: Mapping[str, str] | None = None,
        recompute_units: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self.graph_module = graph_module
        self.input_names = input_names
        """Graph inputs (forward parameter names) this stage reads."""
        self.recv_names = recv_names
        """Boundary tensors received from the previous stage, in the given order."""
        self.send_names = send_names
        """Boundary tensors sent to the next stage, in the given order; () if last."""
        self.is_last = is_last
        self.unit_names = unit_names
        self._out_spec = out_spec
        self._param_names = dict(param_names)
        self.recompute_units = recompute_units
        """Units run under ``torch.utils.checkpoint`` (selective recomputation)."""
        self._node_units = dict(node_units or {})
        self._segments: tuple[torch.fx.Node, tuple[Segment, ...]] | None = None
        """The graph's first node when they were split, and the segments (first use)."""

    def forward(
        self, inputs: Mapping[str, torch.Tensor], received: Mapping[str, torch.Tensor]
    ) -> dict[str, Any]:
        """Run the stage on one micro-batch.

        Args:
            inputs: graph inputs by forward parameter name (extra entries are ignored).
            received: boundary tensors by node name, as sent by the previous stage.

        Returns:
            Not last: ``{name: tensor for name in send_names}`` (pass-through values
            included). Last: ``{"output": exactly what the model's forward returns}``.

        Raises:
            PlanMismatchError: a graph input or received tensor this stage needs is missing.
        """
        args = [self._take(inputs, n, "graph input") for n in self.input_names]
        args += [self._take(received, n, "received tensor") for n in self.recv_names]
        result = self._run(args)
        if not self.is_last:
            return dict(zip(self.send_names, result, strict=True))
        if self._out_spec is not None:
            result = pytree.tree_unflatten(list(result), self._out_spec)
        return {"output": result}

    def _run(self, args: list[torch.Tensor]) -> Any:
        if not self.recompute_units:
            return self.graph_module(*args)
        graph = self.graph_module.graph
        first = next(iter(graph.nodes))
        if self._segments is None or self._segments[0] is not first:
            # first use, or a deep copy (whose graph copied its nodes apart from ours)
            segments = split_segments(graph, self._node_units, set(self.recompute_units))
            self._segments = (first, segments)
        return run_segments(self.graph_module, self._segments[1], args)

    def _take(self, values: Mapping[str, torch.Tensor], name: str, kind: str) -> torch.Tensor:
        if name not in values:
            raise PlanMismatchError(
                f"stage with units {', '.join(self.unit_names)} needs {kind} {name!r} but "
                f"was not given it; deliver {name!r} to this stage"
            )
        return values[name]

    def canonical_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name in the full model's ``named_parameters()``, parameter), unique, by name.

        A tied parameter has one canonical name: the first under which the full model
        lists it.
        """
        named = self.graph_module.named_parameters(remove_duplicate=False)
        return self._canonical(named)

    def canonical_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """(name in the full model's ``named_buffers()``, buffer), unique, by name.

        Constants that tracing created (not buffers of the model) are left out.
        """
        named = self.graph_module.named_buffers(remove_duplicate=False)
        return self._canonical((n, b) for n, b in named if n in self._param_names)

    def _canonical(self, named: Any) -> list[Any]:
        unique: dict[str, Any] = {}
        for name, tensor in named:
            unique.setdefault(self._param_names.get(name, name), tensor)
        return sorted(unique.items(), key=lambda item: item[0])


def build_stage(
    traced: TracedModel,
    units: Sequence[UnitSpec],
    stage_units: Sequence[str],
    *,
    recv: Sequence[str],
    send: Sequence[str],
    recompute_units: Sequence[str] = (),
) -> StageModule:
    """Build the stage that holds the nodes of ``stage_units``.

    The stage also holds copies of the replicable and ``get_attr`` nodes its nodes need
    (a shared buffer gets its own copy in every stage that reads it; nothing is sent).

    Args:
        units: every partition unit of the model, in order.
        stage_units: names of this stage's units.
        recv: node names received from the previous stage (its placeholder order).
        send: node names sent to the next stage (its output order); ``()`` if last.
        recompute_units: stage units to run under ``torch.utils.checkpoint``
            (``MemoryStrategy.SELECTIVE``; ``segments.py``).

    Raises:
        PlanMismatchError: a unit lists a node the graph lacks, a graph node belongs to no
            unit, a stage unit is unknown, or the stage needs a value it does not receive.
    """
    gm = traced.graph_module
    node_unit = node_units(gm, units)
    index = {u.name: i for i, u in enumerate(units)}
    unknown = [u for u in stage_units if u not in index]
    if unknown:
        raise PlanMismatchError(f"stage unit {unknown[0]!r} is not a unit; {MISMATCH}")
    owned_idx = {index[u] for u in stage_units}
    is_last = len(units) - 1 in owned_idx
    nodes = {n.name: n for n in gm.graph.nodes}
    _check_names(recv, nodes, node_unit, owned_idx, "receives")
    _check_names(send, nodes, node_unit, set(), "sends")
    output = next(n for n in gm.graph.nodes if n.op == "output")
    roots = [nodes[s] for s in send] + ([output] if is_last else [])
    keep = _closure(gm, node_unit, owned_idx, set(recv), roots)
    graph, input_names = _stage_graph(traced, keep, recv, send, output if is_last else None)
    # GraphModule registers the tensor constants tracing made as buffers: they move too
    stage_gm = torch.fx.GraphModule(gm, graph, "Stage")
    codegen = getattr(gm.graph, "_codegen", None)
    pytree_info = getattr(codegen, "pytree_info", None)
    return StageModule(
        stage_gm,
        input_names=input_names,
        recv_names=tuple(recv),
        send_names=tuple(send),
        is_last=is_last,
        out_spec=pytree_info.out_spec if is_last and pytree_info is not None else None,
        param_names=traced.param_names,
        unit_names=tuple(stage_units),
        node_units={name: units[idx].name for name, idx in node_unit.items() if idx in owned_idx},
        recompute_units=tuple(recompute_units),
    )


def _check_names(
    names: Sequence[str],
    nodes: Mapping[str, torch.fx.Node],
    node_unit: Mapping[str, int],
    owned_idx: set[int],
    verb: str,
) -> None:
    for name in names:
        if name not in nodes or nodes[name].op == "output":
            raise PlanMismatchError(f"the stage {verb} {name!r}, not a graph node; {MISMATCH}")
        if node_unit.get(name) in owned_idx:
            raise PlanMismatchError(f"the stage {verb} {name!r}, which it computes; {MISMATCH}")


def _closure(
    gm: torch.fx.GraphModule,
    node_unit: Mapping[str, int],
    owned_idx: set[int],
    recv: set[str],
    roots: Sequence[torch.fx.Node],
) -> set[torch.fx.Node]:
    """The nodes the stage computes or reads: owned, replicated, placeholders, received."""
    replicable = replicable_nodes(gm)
    keep = {n for n in gm.graph.nodes if node_unit.get(n.name, -1) in owned_idx}
    work = [*keep, *roots]
    while work:
        node = work.pop()
        if node.op != "output":
            keep.add(node)
        if node.name in recv:
            continue
        for inp in node.all_input_nodes:
            if inp in keep:
                continue
            if inp.name in recv or inp.op == "placeholder" or inp.name in replicable:
                keep.add(inp)
                work.append(inp)
                continue
            raise PlanMismatchError(
                f"the stage needs {inp.name!r} (from unit index {node_unit[inp.name]}) but "
                f"does not receive it; {MISMATCH}"
            )
    return keep


def _stage_graph(
    traced: TracedModel,
    keep: set[torch.fx.Node],
    recv: Sequence[str],
    send: Sequence[str],
    output: torch.fx.Node | None,
) -> tuple[torch.fx.Graph, tuple[str, ...]]:
    """A new graph: fed inputs, then received values, then the kept nodes in graph order."""
    gm = traced.graph_module
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    input_names = []
    for node, name in zip(placeholders, traced.input_names, strict=True):
        if node in keep:
            env[node] = graph.placeholder(node.name)
            input_names.append(name)
    nodes = {n.name: n for n in gm.graph.nodes}
    for name in recv:
        env[nodes[name]] = graph.placeholder(name)
    for node in gm.graph.nodes:
        if node in keep and node not in env and node.op != "placeholder":
            env[node] = graph.node_copy(node, env.__getitem__)
    if output is None:
        graph.output(tuple(env[nodes[name]] for name in send))
    else:
        graph.output(torch.fx.map_arg(output.args[0], env.__getitem__))
    return graph, tuple(input_names)
