"""Interchangeable devices and interchangeable nodes, for the solver's symmetry reduction.

Two nodes are *interchangeable* when they hold the same devices (kind, memory, unit times),
the same links inside, the same links to every other node, and the same link between each
other — typically several identical workstations on one switch. A *device group* (a
*class* of the search's pipeline shapes) is the set of devices of one kind (same memory,
unit times and optimizer times) over one group of interchangeable nodes, listed node by
node: a shape that takes "the next free device" of its groups therefore packs each pipeline
into as few nodes as possible. Without the grouping, 16 identical nodes of three GPU kinds
would give 48 groups, and the shape count would explode; with it they give 3.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import combinations
from math import factorial, prod

import numpy as np

from hplan.planner.cost.problem import PlanningProblem


@dataclass(frozen=True, slots=True)
class DeviceGroup:
    """Interchangeable devices (indices into the problem), node by node: one kind over one
    group of interchangeable nodes (module docstring)."""

    devices: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def rep(self) -> int:
        return self.devices[0]


def _device_key(problem: PlanningProblem, d: int) -> tuple[object, ...]:
    return (
        problem.device_kinds[d],
        problem.degree(d),  # a TP group is never interchangeable with a single card
        float(problem.memory_capacity_bytes[d]),
        problem.fwd_time_s[d].tobytes(),
        problem.bwd_time_s[d].tobytes(),
        problem.optimizer_time_s[d].tobytes(),  # a step balances it too (cost.evaluate)
    )


def _node_devices(problem: PlanningProblem) -> dict[str, list[int]]:
    members: dict[str, list[int]] = {}
    for d, node in enumerate(problem.device_nodes):
        members.setdefault(node, []).append(d)
    return members


def _link(problem: PlanningProblem, a: Sequence[int], b: Sequence[int]) -> tuple[float, float]:
    """Slowest link between two device sets: (min bandwidth, max latency)."""
    pairs = [(x, y) for x in a for y in b if x != y]
    if not pairs:
        return (np.inf, 0.0)
    bw = min(float(problem.bandwidth_bytes_per_s[x, y]) for x, y in pairs)
    lat = max(float(problem.latency_s[x, y]) for x, y in pairs)
    return (bw, lat)


def node_groups(problem: PlanningProblem) -> tuple[tuple[str, ...], ...]:
    """Groups of interchangeable nodes, in node order (see the module docstring)."""
    members = _node_devices(problem)
    nodes = list(members)
    signature = {
        n: (
            tuple(sorted(Counter(_device_key(problem, d) for d in members[n]).items())),
            _link(problem, members[n], members[n]),
        )
        for n in nodes
    }
    by_signature: dict[object, list[str]] = {}
    for n in nodes:
        by_signature.setdefault(signature[n], []).append(n)
    groups: list[tuple[str, ...]] = []
    for candidate in by_signature.values():
        if _symmetric(problem, members, candidate, nodes):
            groups.append(tuple(candidate))
        else:
            groups.extend((n,) for n in candidate)
    return tuple(sorted(groups, key=lambda g: nodes.index(g[0])))


def _symmetric(
    problem: PlanningProblem, members: dict[str, list[int]], group: list[str], nodes: list[str]
) -> bool:
    if len(group) == 1:
        return True
    between = {_link(problem, members[x], members[y]) for x, y in combinations(group, 2)}
    if len(between) != 1:
        return False
    others = [z for z in nodes if z not in group]
    return all(len({_link(problem, members[x], members[z]) for x in group}) == 1 for z in others)


def device_groups(problem: PlanningProblem) -> tuple[DeviceGroup, ...]:
    """Device groups over groups of interchangeable nodes, ordered by first device."""
    members = _node_devices(problem)
    classes: dict[tuple[object, ...], list[int]] = {}
    for group_idx, group in enumerate(node_groups(problem)):
        for node in group:
            for d in members[node]:
                classes.setdefault((group_idx, *_device_key(problem, d)), []).append(d)
    ordered = sorted(classes.values(), key=lambda devs: devs[0])
    return tuple(DeviceGroup(tuple(devs)) for devs in ordered)


def group_link(
    problem: PlanningProblem, groups: Sequence[DeviceGroup], a: int, b: int
) -> tuple[float, float]:
    """Slowest link between two device groups (within one group: between its devices)."""
    return _link(problem, groups[a].devices, groups[b].devices)


def pair_devices(groups: Sequence[DeviceGroup], sequence: Sequence[int]) -> list[int]:
    """Concrete devices for a sequence of group indices (a shape's classes): the next unused
    device of each group."""
    used = dict.fromkeys(set(sequence), 0)
    devices = []
    for c in sequence:
        devices.append(groups[c].devices[used[c]])
        used[c] += 1
    return devices


def multisets(sizes: Sequence[int], length: int) -> Iterator[tuple[int, ...]]:
    """Non-decreasing class tuples of ``length``, class c at most ``sizes[c]`` times, in
    lexicographic order (generated without enumerating the rejected ones)."""

    def extend(prefix: list[int], start: int, left: int) -> Iterator[tuple[int, ...]]:
        if left == 0:
            yield tuple(prefix)
            return
        for c in range(start, len(sizes)):
            if prefix.count(c) < sizes[c]:
                yield from extend([*prefix, c], c, left - 1)

    yield from extend([], 0, length)


def num_distinct_orders(multiset: Sequence[int]) -> int:
    """Number of distinct orderings of a multiset: n! / prod(count!)."""
    counts = Counter(multiset).values()
    return factorial(len(multiset)) // prod(factorial(c) for c in counts)


def distinct_orders(multiset: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every distinct ordering of a multiset (no duplicates), in lexicographic order."""
    items = sorted(multiset)

    def extend(prefix: list[int], left: Counter[int]) -> Iterator[tuple[int, ...]]:
        if not left:
            yield tuple(prefix)
            return
        for c in sorted(left):
            rest = left.copy()
            rest[c] -= 1
            if rest[c] == 0:
                del rest[c]
            yield from extend([*prefix, c], rest)

    yield from extend([], Counter(items))
