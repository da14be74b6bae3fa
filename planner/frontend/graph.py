"""The cost graph's structure: one networkx node per fx node, and the cuts read from it.

:func:`structure_graph` turns a traced model's fx graph into the ``networkx.DiGraph`` that
the frontend's later steps read: node attributes ``op``, ``target``, ``module_path``,
``replicable`` (cheap to recompute in every stage, never sent: ``capture.cuts``),
``params`` and ``buffers`` (the attribute names of the parameters and buffers the node
reads); one edge per input of a node, from the input to its user. Nodes keep the fx
graph's order, and each node's predecessors keep its inputs' order. The cost graph adds
the measured costs (``cost_graph.py``), the partition-unit policy reads it
(``partition_units.py``) and :func:`crossing_values` says what crosses each possible cut.
"""

from __future__ import annotations

from collections.abc import Mapping

import networkx as nx
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from hplan.runtime.capture.cuts import replicable_nodes
from hplan.runtime.capture.trace import TracedModel, target_name

OUTPUT = "output"
"""op of the graph's output node (it belongs to no unit; it reads what the model returns)."""
PLACEHOLDER = "placeholder"
"""op of a graph input (delivered by the data loader to every stage that reads it)."""
_NO_MODULE = "_empty_nn_module_stack_from_metadata_hook"

CostGraph = nx.DiGraph
"""A networkx graph of fx node names, with the attributes described in the module docstring."""


def structure_graph(traced: TracedModel) -> CostGraph:
    """The structure of ``traced``'s fx graph as a networkx graph (see the module docstring)."""
    gm = traced.graph_module
    replicable = replicable_nodes(gm)
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    buffers = {name for name, _ in gm.named_buffers(remove_duplicate=False)}
    graph: CostGraph = nx.DiGraph()
    for node in gm.graph.nodes:
        used = _tensors_used(gm, node)
        graph.add_node(
            node.name,
            op=node.op,
            target=target_name(node.target),
            module_path=module_path(node, traced.module_classes),
            replicable=node.name in replicable,
            params=tuple(sorted(used & params)),
            buffers=tuple(sorted(used & buffers)),
        )
        for source in node.all_input_nodes:
            graph.add_edge(source.name, node.name)
    return graph


def in_unit(graph: CostGraph, name: str) -> bool:
    """True for the nodes that belong to a partition unit (not placeholders, not the output)."""
    return graph.nodes[name]["op"] not in (PLACEHOLDER, OUTPUT)


def crossing_values(
    graph: CostGraph, node_unit: Mapping[str, int], cut_idx: int
) -> tuple[str, ...]:
    """Names of the values that cross a boundary placed after unit ``cut_idx``.

    A value crosses when it is produced in a unit ``<= cut_idx`` and read in a unit
    ``> cut_idx`` or by the graph output (which belongs to the last unit). Placeholders
    (delivered by the data loader to each stage) and replicable nodes are excluded.

    Args:
        node_unit: unit index of every node in a unit (see :func:`in_unit`).

    Returns:
        Node names in graph order.
    """
    last_unit = max(node_unit.values(), default=0)
    crossing = []
    for name, data in graph.nodes(data=True):
        if not in_unit(graph, name) or data["replicable"] or node_unit[name] > cut_idx:
            continue
        readers = (
            last_unit if graph.nodes[user]["op"] == OUTPUT else node_unit[user]
            for user in graph.successors(name)
        )
        if any(r > cut_idx for r in readers):
            crossing.append(name)
    return tuple(crossing)


def module_path(node: torch.fx.Node, module_classes: Mapping[str, str]) -> str:
    """The module a node belongs to: the call_module target, the owner of a get_attr, or
    the innermost module on the node's ``nn_module_stack``; ``""`` for top-level code."""
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr":
        owner = str(node.target).rpartition(".")[0]
        return owner if owner in module_classes else ""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        if path != _NO_MODULE and path in module_classes:
            return str(path)
    return ""


_TRAINING_ARG = 5
"""Position of ``training`` in ``F.batch_norm``, ``aten.batch_norm`` and
``aten._native_batch_norm_legit_functional``."""


def batch_statistics_layers(model: nn.Module, gm: torch.fx.GraphModule) -> tuple[str, ...]:
    """What normalises by the statistics of the batch it is given while training: the
    paths of ``model``'s BatchNorm modules in train mode (``_BatchNorm``: SyncBatchNorm
    too); without any, the names of ``gm``'s batch-norm calls in training (a functional
    ``batch_norm``). Such a layer cannot train on a micro-batch of one sample (no
    variance: torch raises for a 2-D input)."""
    modules = [
        name or type(model).__name__
        for name, module in model.named_modules()
        if isinstance(module, _BatchNorm) and module.training
    ]
    calls = [
        node.name
        for node in gm.graph.nodes
        if node.op == "call_function"
        and "batch_norm" in target_name(node.target)
        and _training_arg(node) is True
    ]
    return tuple(modules) or tuple(calls)


def _training_arg(node: torch.fx.Node) -> object:
    if "training" in node.kwargs:
        return node.kwargs["training"]
    return node.args[_TRAINING_ARG] if len(node.args) > _TRAINING_ARG else None


def _tensors_used(gm: torch.fx.GraphModule, node: torch.fx.Node) -> set[str]:
    """Attribute names of the parameters and buffers a node reads."""
    used: set[str] = set()
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        for named in (module.named_parameters, module.named_buffers):
            used.update(f"{node.target}.{n}" for n, _ in named(remove_duplicate=False))
    if node.op == "get_attr":
        used.add(str(node.target))
    used.update(str(i.target) for i in node.all_input_nodes if i.op == "get_attr")
    return used
