"""Cut analysis of a traced graph: which values may be recomputed in every stage, and which
unit each node belongs to.

Mechanism only, shared by the runtime (its stage builder copies the replicable nodes into
every stage that reads them and checks the plan's units against the graph) and the planner
(its cost graph marks the replicable nodes; what crosses each cut it reads from that graph,
``planner/frontend/graph.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hplan.runtime.capture.trace import target_name
from hplan.runtime.contract.errors import PlanMismatchError
from hplan.runtime.contract.plan import UnitSpec

_RANDOM_WORDS = (
    "rand", "dropout", "bernoulli", "normal", "multinomial", "uniform", "exponential",
    "poisson", "geometric", "cauchy", "random",
)  # fmt: skip
MISMATCH = "the model's graph differs from the plan; re-run `hplan solve`"
"""The fix appended to every message about a graph that differs from the plan."""


def replicable_nodes(gm: torch.fx.GraphModule) -> frozenset[str]:
    """Nodes cheap to recompute in every stage that needs them instead of sending them.

    These are ``get_attr`` nodes, and ``call_function``/``call_method`` nodes whose inputs
    are only placeholders, ``get_attr`` nodes of non-parameters, constants or other
    replicable nodes, and that are neither random nor in-place (e.g. ``size``,
    ``arange(idx.size(1))``, a causal mask). Their outputs never cross a cut.
    """
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    found: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            found.add(node.name)
            continue
        if node.op not in ("call_function", "call_method") or not _pure(node):
            continue
        if all(_free_input(i, found, params) for i in node.all_input_nodes):
            found.add(node.name)
    return frozenset(found)


def _free_input(node: torch.fx.Node, found: set[str], params: set[str]) -> bool:
    if node.op == "placeholder":
        return True
    if node.op == "get_attr":
        return node.target not in params
    return node.name in found


def _pure(node: torch.fx.Node) -> bool:
    """Neither random nor in-place (recomputing it twice gives the same value, no effect).

    torch.fx's own purity test first, then name and schema checks for what it misses
    (``call_method`` nodes, Python-level random functions).
    """
    if node.op == "call_function" and node.is_impure(impure_random=True):
        return False
    name = target_name(node.target).lower()
    if any(word in name for word in _RANDOM_WORDS):
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        schema = node.target._schema
        if schema.is_mutable or torch.Tag.nondeterministic_seeded in node.target.tags:
            return False
    base = name.rsplit(".", 1)[-1]
    return not (base.endswith("_") and not base.endswith("__"))


def node_units(gm: torch.fx.GraphModule, units: Sequence[UnitSpec]) -> dict[str, int]:
    """Unit index of every graph node (placeholders and output excluded).

    Raises:
        PlanMismatchError: a unit lists a node the graph lacks or lists a node twice, or a
            graph node belongs to no unit.
    """
    names = {n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")}
    node_unit: dict[str, int] = {}
    for idx, unit in enumerate(units):
        for name in unit.nodes:
            if name not in names:
                raise PlanMismatchError(f"unit {unit.name!r} lists node {name!r}; {MISMATCH}")
            if name in node_unit:
                raise PlanMismatchError(f"node {name!r} is in two units; {MISMATCH}")
            node_unit[name] = idx
    orphans = sorted(names - set(node_unit))
    if orphans:
        raise PlanMismatchError(f"graph node {orphans[0]!r} belongs to no unit; {MISMATCH}")
    return node_unit
