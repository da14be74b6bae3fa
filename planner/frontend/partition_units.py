"""Group the nodes of a traced model into partition units (policy).

A partition unit is the smallest piece a stage boundary may fall between: by default the
repeated blocks (``blocks.0``, ``transformer.h.3``) and the modules around them, a module
too large to place split into its children (:func:`assign_units` states the rules). The
policy reads the cost graph's structure (``graph.py``); the mechanism that cuts stages
(``hplan.runtime.capture.stage``) receives these units as data.
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
from hplan.runtime.capture.trace import CONTAINER_CLASSES, TracedModel, repeated_containers
from hplan.runtime.contract.plan import UnitSpec
from hplan.runtime.contract.quantities import format_bytes

_ROOT_UNIT = "model"

MAX_UNIT_SHARE = 0.125
"""A module holding more than this share of the model's parameter bytes (and more than
:data:`MIN_SPLIT_PARAM_BYTES`) is split into its children: SDXL's ``up_blocks.0`` holds
nearly half its UNet, and whole, no 24 GB card could hold a stage containing it."""
MIN_SPLIT_PARAM_BYTES = 2**28
"""Parameter bytes below which no module is split however large its share: 256 MiB of fp32
parameters is 1 GiB of training state under Adam (16 bytes a parameter), a step of stage
memory fine enough to share a model between 11 and 12 GB cards; models under 2 GiB of
parameters (8 of these) keep their blocks whole. SD 1.5's UNet (3.4 GB) has its
``up_blocks.1`` (1.0 GB, 6.4 GB of state) split: whole, no cut of the model between an RTX
3060 and a 2080 Ti fits both, and the two halves of a pipeline on two 4090s differ by half."""


def assign_units(
    traced: TracedModel,
    tensor_nodes: Collection[str],
    graph: CostGraph | None = None,
    *,
    max_unit_param_bytes: float | None = None,
) -> tuple[tuple[UnitSpec, ...], tuple[str, ...]]:
    """Group graph nodes into partition units by the default policy:

    - the repeated blocks (children of a ModuleList/Sequential/ModuleDict that has >= 2
      children of one class: ``blocks.0``, ``transformer.h.3``) are units;
    - other modules become units at the shallowest path that is not an ancestor of a repeated
      container (``tok_emb``, ``transformer.wte``, ``lm_head``);
    - a module with more parameter bytes than ``max_unit_param_bytes`` and with children
      that hold parameters is split: its children are units by these rules, its own code
      is top-level code (``up_blocks.0`` of SDXL's UNet: its resnets, attentions and
      upsamplers; the skip connections that cross become cut tensors);
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
        max_unit_param_bytes: the largest module kept whole; by default
            :data:`MAX_UNIT_SHARE` of the model's parameter bytes, at least
            :data:`MIN_SPLIT_PARAM_BYTES`.

    Returns:
        (units in order, notes about merged units). ``UnitSpec.params``/``.buffers`` are
        canonical names; every graph node except placeholders and the output is in
        exactly one unit.
    """
    graph = structure_graph(traced) if graph is None else graph
    paths = {n: d["module_path"] for n, d in graph.nodes(data=True) if in_unit(graph, n)}
    split, split_notes = _oversized_modules(traced, paths, max_unit_param_bytes)
    keys = _unit_keys(traced, paths, split)
    partial, names = _first_pass(graph, keys, paths)
    labels = _assign_deferred(graph, partial, len(names))
    if not names:
        names = [_ROOT_UNIT]
    labels, names = _merge_parameter_free(graph, labels, names)
    labels, names, notes = _merge_non_tensor_cuts(graph, labels, names, tensor_nodes)
    return _unit_specs(traced, graph, labels, names), (*split_notes, *notes)


def _oversized_modules(
    traced: TracedModel, paths: Mapping[str, str], max_param_bytes: float | None
) -> tuple[set[str], list[str]]:
    """The modules to split for their size (``_split_modules``), and a note for each that
    would otherwise have been a unit."""
    sizes = _module_param_bytes(traced)
    limit = _default_limit(sizes) if max_param_bytes is None else max_param_bytes
    split = _split_modules(traced, sizes, limit)
    whole = set(_unit_keys(traced, paths).values())
    return split, [_split_note(path, sizes) for path in sorted(split & whole)]


def _module_param_bytes(traced: TracedModel) -> dict[str, int]:
    """Parameter bytes of every module path (``""``: the model), shared tensors once."""
    sizes = dict.fromkeys(traced.module_classes, 0)
    for name, param in traced.graph_module.named_parameters():
        parts = traced.param_names.get(name, name).split(".")[:-1]
        for prefix in (".".join(parts[:depth]) for depth in range(len(parts) + 1)):
            if prefix in sizes:
                sizes[prefix] += param.numel() * param.element_size()
    return sizes


def _default_limit(sizes: Mapping[str, int]) -> float:
    return max(MAX_UNIT_SHARE * sizes.get("", 0), MIN_SPLIT_PARAM_BYTES)


def _split_modules(traced: TracedModel, sizes: Mapping[str, int], limit: float) -> set[str]:
    """Module paths too large to be one unit whose children hold parameters, and the
    containers (ModuleList, Sequential, ModuleDict) among the children of those: a
    split block's ``resnets`` list splits into its resnets."""
    children: dict[str, list[str]] = {}
    for path in sizes:
        if path and sizes[path]:
            children.setdefault(path.rpartition(".")[0], []).append(path)
    work = [p for p, size in sizes.items() if p and size > limit and len(children.get(p, ())) >= 2]
    split: set[str] = set()
    while work:
        path = work.pop()
        split.add(path)
        work.extend(
            child
            for child in children.get(path, ())
            if traced.module_classes[child] in CONTAINER_CLASSES and child not in split
        )
    return split


def _split_note(path: str, sizes: Mapping[str, int]) -> str:
    share = sizes[path] / max(sizes.get("", 0), 1)
    return (
        f"split unit {path} ({format_bytes(sizes[path])} of parameters, {share:.0%} of the "
        "model) into its children, so that smaller devices can hold it"
    )


def _unit_keys(
    traced: TracedModel, paths: Mapping[str, str], split: Collection[str] = ()
) -> dict[str, str | None]:
    """Unit key of each module path that owns nodes; None for top-level code (and the
    own code of a split module)."""
    repeated = repeated_containers(traced.module_classes)

    def holds_repeated(path: str) -> bool:
        return path in split or any(r == path or r.startswith(f"{path}.") for r in repeated)

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
