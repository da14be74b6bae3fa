"""Group the nodes of a traced model into partition units (policy).

A partition unit is the smallest piece a stage boundary may fall between: by default the
repeated blocks (``blocks.0``, ``transformer.h.3``) and the modules around them
(:func:`assign_units` states the rules). The policy reads the cost graph's structure
(``graph.py``); the mechanism that cuts stages (``hplan.runtime.capture.stage``) receives
these units as data.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from hplan.planner.frontend.graph import (
    OUTPUT,
    CostGraph,
    crossing_values,
    in_unit,
    structure_graph,
)
from hplan.runtime.capture.trace import TracedModel, repeated_containers
from hplan.runtime.contract.plan import UnitSpec

_ROOT_UNIT = "model"


def assign_units(
    traced: TracedModel, tensor_nodes: Collection[str], graph: CostGraph | None = None
) -> tuple[tuple[UnitSpec, ...], tuple[str, ...]]:
    """Group graph nodes into partition units by the default policy:

    - the repeated blocks (children of a ModuleList/Sequential/ModuleDict that has >= 2
      children of one class: ``blocks.0``, ``transformer.h.3``) are units;
    - other modules become units at the shallowest path that is not an ancestor of a repeated
      container (``tok_emb``, ``transformer.wte``, ``lm_head``);
    - nodes of no module (top-level code) join the unit of their latest input; nodes that
      read nothing computed (parameters, replicable nodes) join the unit of their first user;
    - a node's unit index is at least that of every input (data only flows forward);
    - parameter-free units merge into the preceding unit (leading ones into the first unit
      with parameters);
    - when a value that is not a tensor and not replicable would cross a boundary, the units
      between its producer and its last reader merge.

    Args:
        traced: the traced model (its module classes and canonical names).
        tensor_nodes: names of the nodes whose output is a tensor that may cross a stage
            boundary (batch-linear); any other non-replicable value never crosses one.
        graph: the cost graph of ``traced`` (``graph.structure_graph``), read for the
            nodes, their modules, inputs, users and the parameters they read; built when
            not given.

    Returns:
        (units in order, notes about merged units). ``UnitSpec.params``/``.buffers`` are
        canonical names; every graph node except placeholders and the output is in
        exactly one unit.
    """
    graph = structure_graph(traced) if graph is None else graph
    paths = {n: d["module_path"] for n, d in graph.nodes(data=True) if in_unit(graph, n)}
    keys = _unit_keys(traced, paths)
    partial, names = _first_pass(graph, keys, paths)
    labels = _assign_deferred(graph, partial, len(names))
    if not names:
        names = [_ROOT_UNIT]
    labels, names = _merge_parameter_free(graph, labels, names)
    labels, names, notes = _merge_non_tensor_cuts(graph, labels, names, tensor_nodes)
    return _unit_specs(traced, graph, labels, names), tuple(notes)


def _unit_keys(traced: TracedModel, paths: Mapping[str, str]) -> dict[str, str | None]:
    """Unit key of each module path that owns nodes; None for top-level code."""
    repeated = repeated_containers(traced.module_classes)

    def holds_repeated(path: str) -> bool:
        return any(r == path or r.startswith(f"{path}.") for r in repeated)

    keys: dict[str, str | None] = {}
    for path in set(paths.values()):
        keys[path] = None
        parts = path.split(".") if path else []
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            if not holds_repeated(prefix):
                keys[path] = prefix
                break
    return keys


def _first_pass(
    graph: CostGraph, keys: Mapping[str, str | None], paths: Mapping[str, str]
) -> tuple[dict[str, int | None], list[str]]:
    """Label module nodes by their key (units in order of first appearance), top-level
    code by its latest input; defer get_attr, replicable and input-free top-level nodes."""
    names: list[str] = []
    labels: dict[str, int | None] = {}
    for node, data in graph.nodes(data=True):
        if not in_unit(graph, node):
            continue
        if data["op"] == "get_attr" or data["replicable"]:
            labels[node] = None
            continue
        inputs = [labels.get(i) for i in graph.predecessors(node)]
        latest = max((u for u in inputs if u is not None), default=None)
        key = keys[paths[node]]
        if key is not None and key not in names:
            names.append(key)
        own = names.index(key) if key is not None else None
        candidates = [u for u in (own, latest) if u is not None]
        labels[node] = max(candidates) if candidates else None
    return labels, names


def _assign_deferred(
    graph: CostGraph, labels: dict[str, int | None], num_units: int
) -> dict[str, int]:
    """Deferred nodes join their earliest user's unit (the output is in the last unit)."""
    last = max(num_units - 1, 0)
    final: dict[str, int] = {}
    for node in reversed(list(graph.nodes)):
        if not in_unit(graph, node):
            continue
        label = labels[node]
        if label is None:
            users = [last if _is_output(graph, u) else final[u] for u in graph.successors(node)]
            label = min(users, default=0)
        final[node] = label
    return final


def _is_output(graph: CostGraph, name: str) -> bool:
    return bool(graph.nodes[name]["op"] == OUTPUT)


def _merge_parameter_free(
    graph: CostGraph, labels: dict[str, int], names: list[str]
) -> tuple[dict[str, int], list[str]]:
    """Merge each parameter-free unit into the preceding one (leading ones into the first
    unit with parameters; a model without parameters becomes one unit)."""
    has_params = [False] * len(names)
    for node, unit in labels.items():
        if graph.nodes[node]["params"]:
            has_params[unit] = True
    kept = [i for i, flag in enumerate(has_params) if flag] or [0]
    target = [max((k for k in kept if k <= i), default=kept[0]) for i in range(len(names))]
    new_index = {k: idx for idx, k in enumerate(kept)}
    new_labels = {n: new_index[target[u]] for n, u in labels.items()}
    return new_labels, [names[k] for k in kept]


def _merge_non_tensor_cuts(
    graph: CostGraph,
    labels: dict[str, int],
    names: list[str],
    tensor_nodes: Collection[str],
) -> tuple[dict[str, int], list[str], list[str]]:
    """Merge units so that only tensors (in ``tensor_nodes``) cross any boundary."""
    notes: list[str] = []
    cut_idx = 0
    while cut_idx < len(names) - 1:
        bad = [v for v in crossing_values(graph, labels, cut_idx) if v not in tensor_nodes]
        if not bad:
            cut_idx += 1
            continue
        value = bad[0]
        last = len(names) - 1
        readers = [last if _is_output(graph, u) else labels[u] for u in graph.successors(value)]
        lo, hi = labels[value], max(readers)
        merged = ", ".join(names[lo : hi + 1])
        notes.append(f"merged units {merged}: {value!r} is not a tensor and crosses them")
        labels, names = _merge(labels, names, lo, hi, names[lo])
        cut_idx = lo
    return labels, names, notes


def _merge(
    labels: dict[str, int], names: list[str], lo: int, hi: int, name: str
) -> tuple[dict[str, int], list[str]]:
    """Units lo..hi become one unit called ``name``; later units shift down."""
    span = hi - lo
    new_labels = {
        n: (lo if lo <= u <= hi else u - span if u > hi else u) for n, u in labels.items()
    }
    return new_labels, [*names[:lo], name, *names[hi + 1 :]]


def _unit_specs(
    traced: TracedModel, graph: CostGraph, labels: Mapping[str, int], names: list[str]
) -> tuple[UnitSpec, ...]:
    canonical = traced.param_names
    nodes: list[list[str]] = [[] for _ in names]
    params: list[set[str]] = [set() for _ in names]
    buffers: list[set[str]] = [set() for _ in names]
    for node, data in graph.nodes(data=True):
        if node not in labels:
            continue
        unit = labels[node]
        nodes[unit].append(node)
        params[unit].update(canonical.get(t, t) for t in data["params"])
        buffers[unit].update(canonical.get(t, t) for t in data["buffers"] if t in canonical)
    return tuple(
        UnitSpec(
            name=name,
            nodes=tuple(nodes[i]),
            params=tuple(sorted(params[i])),
            buffers=tuple(sorted(buffers[i])),
        )
        for i, name in enumerate(names)
    )
