"""Candidate islands: ways to cut a cluster's nodes into groups joined by fast links.

The links between two nodes are the slowest of their device pairs (the problem's link
matrix: measured with ``--bandwidth`` where given, else cluster.yaml's). For every distinct
inter-node bandwidth L, the nodes joined by links faster than L form connected components;
each set of components with two or more members is a candidate *partition*: every link
between its islands is at most L fast, every island is held together by faster ones. L
runs from the fastest inter-node link (every node its own island) to the slowest (the
coarsest cut that still has two islands). Nodes are never split.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import networkx as nx
import numpy as np

from hplan.planner.cost.problem import PlanningProblem

__all__ = [
    "Partition",
    "candidate_partitions",
    "components",
    "island_names",
    "node_link_bytes_per_s",
]

_N = TypeVar("_N", bound=Hashable)

Partition = tuple[tuple[str, ...], ...]
"""Islands, each its node names in problem order; islands ordered by their first node."""


def _nodes(problem: PlanningProblem) -> list[str]:
    return list(dict.fromkeys(problem.device_nodes))


def node_link_bytes_per_s(problem: PlanningProblem, a: str, b: str) -> float:
    """Slowest bandwidth between a device of node ``a`` and one of node ``b`` (bytes/s)."""
    left = [d for d, n in enumerate(problem.device_nodes) if n == a]
    right = [d for d, n in enumerate(problem.device_nodes) if n == b]
    return float(problem.bandwidth_bytes_per_s[np.ix_(left, right)].min())


def candidate_partitions(problem: PlanningProblem) -> tuple[Partition, ...]:
    """Every partition of the nodes into two or more islands (module docstring), finest
    first; empty on a cluster of one node."""
    nodes = _nodes(problem)
    if len(nodes) < 2:
        return ()
    link = {(a, b): node_link_bytes_per_s(problem, a, b) for a in nodes for b in nodes if a != b}
    levels = sorted(set(link.values()), reverse=True)
    found: list[Partition] = []
    for level in levels:
        partition = tuple(components(nodes, _faster_than(link, level)))
        if len(partition) > 1 and partition not in found:
            found.append(partition)
    return tuple(found)


def _faster_than(link: dict[tuple[str, str], float], level: float) -> Callable[[str, str], bool]:
    return lambda a, b: link[(a, b)] > level


def components(nodes: Sequence[_N], joined: Callable[[_N, _N], bool]) -> list[tuple[_N, ...]]:
    """The connected components of ``nodes`` under ``joined`` (networkx), each in the order
    of ``nodes``, ordered by their first member."""
    graph: nx.Graph[_N] = nx.Graph()
    graph.add_nodes_from(nodes)
    graph.add_edges_from(
        (a, b) for i, a in enumerate(nodes) for b in nodes[i + 1 :] if joined(a, b)
    )
    position = {node: i for i, node in enumerate(nodes)}
    groups = [sorted(c, key=position.__getitem__) for c in nx.connected_components(graph)]
    return [tuple(g) for g in sorted(groups, key=lambda g: position[g[0]])]


def island_names(partition: Partition) -> tuple[str, ...]:
    """A short unique name per island: its node's name, or for several nodes their common
    prefix without trailing separators (``site-a-1``, ``site-a-2`` -> ``site-a``), else the
    names joined by ``+``."""
    names = [_name(island) for island in partition]
    if len(set(names)) == len(names):
        return tuple(names)
    return tuple("+".join(island) for island in partition)


def _name(island: tuple[str, ...]) -> str:
    if len(island) == 1:
        return island[0]
    first, *rest = island
    size = next(
        (i for i in range(len(first)) if any(i >= len(n) or n[i] != first[i] for n in rest)),
        len(first),
    )
    prefix = first[:size].rstrip("-_.")
    return prefix or "+".join(island)
