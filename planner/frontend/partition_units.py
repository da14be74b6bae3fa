"""Group the nodes of a traced model into partition units (policy).

A partition unit is the smallest piece a stage boundary may fall between. Default policy:

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

The mechanism that cuts stages (``hplan.runtime.capture.stage``) receives these units as data.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from hplan.runtime.capture.cuts import crossing_values, replicable_nodes
from hplan.runtime.capture.trace import TracedModel, repeated_containers
from hplan.runtime.contract.plan import UnitSpec

_NO_MODULE = "_empty_nn_module_stack_from_metadata_hook"
_ROOT_UNIT = "model"


def assign_units(
    traced: TracedModel, tensor_nodes: Collection[str]
) -> tuple[tuple[UnitSpec, ...], tuple[str, ...]]:
    """Group graph nodes into partition units (see the module docstring).

    Args:
        traced: the traced model.
        tensor_nodes: names of the nodes whose output is a tensor that may cross a stage
            boundary (batch-linear); any other non-replicable value never crosses one.

    Returns:
        (units in order, notes about merged units). ``UnitSpec.params``/``.buffers`` are
        canonical names; every graph node except placeholders and the output is in
        exactly one unit.
    """
    gm = traced.graph_module
    replicable = replicable_nodes(gm)
    paths = {
        n.name: module_path(n, traced.module_classes)
        for n in gm.graph.nodes
        if n.op not in ("placeholder", "output")
    }
    keys = _unit_keys(traced, paths)
    partial, names = _first_pass(gm, keys, replicable, paths)
    labels = _assign_deferred(gm, partial, len(names))
    if not names:
        names = [_ROOT_UNIT]
    labels, names = _merge_parameter_free(gm, labels, names)
    labels, names, notes = _merge_non_tensor_cuts(gm, labels, names, tensor_nodes, replicable)
    return _unit_specs(traced, labels, names), tuple(notes)


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
    gm: torch.fx.GraphModule,
    keys: Mapping[str, str | None],
    replicable: frozenset[str],
    paths: Mapping[str, str],
) -> tuple[dict[str, int | None], list[str]]:
    """Label module nodes by their key (units in order of first appearance), top-level
    code by its latest input; defer get_attr, replicable and input-free top-level nodes."""
    names: list[str] = []
    labels: dict[str, int | None] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr" or node.name in replicable:
            labels[node.name] = None
            continue
        inputs = [labels.get(i.name) for i in node.all_input_nodes]
        latest = max((u for u in inputs if u is not None), default=None)
        key = keys[paths[node.name]]
        if key is not None and key not in names:
            names.append(key)
        own = names.index(key) if key is not None else None
        candidates = [u for u in (own, latest) if u is not None]
        labels[node.name] = max(candidates) if candidates else None
    return labels, names


def _assign_deferred(
    gm: torch.fx.GraphModule, labels: dict[str, int | None], num_units: int
) -> dict[str, int]:
    """Deferred nodes join their earliest user's unit (the output is in the last unit)."""
    last = max(num_units - 1, 0)
    final: dict[str, int] = {}
    for node in reversed(gm.graph.nodes):
        if node.op in ("placeholder", "output"):
            continue
        label = labels[node.name]
        if label is None:
            users = [last if u.op == "output" else final[u.name] for u in node.users]
            label = min(users, default=0)
        final[node.name] = label
    return final


def _merge_parameter_free(
    gm: torch.fx.GraphModule, labels: dict[str, int], names: list[str]
) -> tuple[dict[str, int], list[str]]:
    """Merge each parameter-free unit into the preceding one (leading ones into the first
    unit with parameters; a model without parameters becomes one unit)."""
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    has_params = [False] * len(names)
    for node in gm.graph.nodes:
        if node.name in labels and _tensors_used(gm, node) & params:
            has_params[labels[node.name]] = True
    kept = [i for i, flag in enumerate(has_params) if flag] or [0]
    target = [max((k for k in kept if k <= i), default=kept[0]) for i in range(len(names))]
    new_index = {k: idx for idx, k in enumerate(kept)}
    new_labels = {n: new_index[target[u]] for n, u in labels.items()}
    return new_labels, [names[k] for k in kept]


def _merge_non_tensor_cuts(
    gm: torch.fx.GraphModule,
    labels: dict[str, int],
    names: list[str],
    tensor_nodes: Collection[str],
    replicable: frozenset[str],
) -> tuple[dict[str, int], list[str], list[str]]:
    """Merge units so that only tensors (in ``tensor_nodes``) cross any boundary."""
    notes: list[str] = []
    nodes = {n.name: n for n in gm.graph.nodes}
    cut_idx = 0
    while cut_idx < len(names) - 1:
        bad = [
            v
            for v in crossing_values(gm, labels, cut_idx, replicable=replicable)
            if v not in tensor_nodes
        ]
        if not bad:
            cut_idx += 1
            continue
        value = nodes[bad[0]]
        last = len(names) - 1
        readers = [last if u.op == "output" else labels[u.name] for u in value.users]
        lo, hi = labels[value.name], max(readers)
        merged = ", ".join(names[lo : hi + 1])
        notes.append(f"merged units {merged}: {value.name!r} is not a tensor and crosses them")
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
    traced: TracedModel, labels: Mapping[str, int], names: list[str]
) -> tuple[UnitSpec, ...]:
    gm = traced.graph_module
    params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    canonical = traced.param_names
    buffers = {n for n, _ in gm.named_buffers(remove_duplicate=False) if n in canonical}
    nodes: list[list[str]] = [[] for _ in names]
    used: list[set[str]] = [set() for _ in names]
    for node in gm.graph.nodes:
        if node.name in labels:
            nodes[labels[node.name]].append(node.name)
            used[labels[node.name]].update(_tensors_used(gm, node))
    return tuple(
        UnitSpec(
            name=name,
            nodes=tuple(nodes[i]),
            params=tuple(sorted({canonical.get(t, t) for t in used[i] & params})),
            buffers=tuple(sorted({canonical.get(t, t) for t in used[i] & buffers})),
        )
        for i, name in enumerate(names)
    )


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
