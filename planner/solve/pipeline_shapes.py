"""Which pipeline shapes the solver considers.

Small instances: every ordering of every multiset of classes, and every split of the units
over it (exhaustive: the MILP's answer then matches a brute-force search). Larger ones:
each multiset of classes in a few promising orders, split by dynamic programming, for
pipelines up to three stages longer than the shortest that fits; enumeration stops at a
time budget (a share of the solve's wall-clock limit) and the answer is marked as coming
from a partial search.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from hplan.planner.cost.problem import PlanningProblem
from hplan.planner.solve.device_classes import (
    DeviceClass,
    distinct_orders,
    multisets,
    num_distinct_orders,
)
from hplan.planner.solve.partition import (
    Partitioner,
    PipelineShape,
    microbatch_levels,
    pareto,
)

EXTRA_STAGES = 3
"""Heuristic search: longest pipeline = shortest that fits + this."""


@dataclass(frozen=True)
class ShapeSet:
    """The costed shapes and how they were found."""

    shapes: list[PipelineShape]
    exhaustive: bool
    """Every order and every split was enumerated (no heuristic, no time cut)."""
    complete: bool
    """The heuristic enumeration finished before its time budget."""


def enumerate_shapes(
    problem: PlanningProblem,
    classes: Sequence[DeviceClass],
    *,
    max_stages: int,
    exhaustive_limit: int,
    budget_deadline: float,
) -> ShapeSet:
    """Costed shapes worth considering (see the module docstring)."""
    partitioner = Partitioner(problem, classes)
    sizes = [c.size for c in classes]
    longest = min(max_stages, problem.num_units, problem.num_devices)
    if _exhaustive_count(problem, sizes, longest, exhaustive_limit) <= exhaustive_limit:
        found = [
            t
            for s in range(1, longest + 1)
            for ms in multisets(sizes, s)
            for order in distinct_orders(ms)
            for k in range(len(problem.micro_batch_sizes))
            for t in _all_levels(problem, partitioner, order, k)
        ]
        return ShapeSet(found, exhaustive=True, complete=True)
    return _heuristic(problem, partitioner, sizes, longest, budget_deadline)


def _all_levels(
    problem: PlanningProblem, partitioner: Partitioner, order: tuple[int, ...], k: int
) -> list[PipelineShape]:
    """Every split of ``order`` at candidate ``k``, at each micro-batches-in-flight level
    (``partition.microbatch_levels``: one under 1F1B), the levels' fronts merged."""
    levels = microbatch_levels(problem, k)
    if len(levels) == 1:
        return partitioner.all_splits(order, k, levels[0])
    return pareto([t for level in levels for t in partitioner.all_splits(order, k, level)])


def _exhaustive_count(
    problem: PlanningProblem, sizes: Sequence[int], longest: int, limit: int
) -> int:
    """(order, split, micro-batch size) triples, counted until ``limit`` is passed."""
    total = 0
    k = sum(len(microbatch_levels(problem, k)) for k in range(len(problem.micro_batch_sizes)))
    for s in range(1, longest + 1):
        splits = math.comb(problem.num_units - 1, s - 1)
        for ms in multisets(sizes, s):
            total += num_distinct_orders(ms) * splits * k
            if total > limit:
                return total
    return total


def _heuristic(
    problem: PlanningProblem,
    partitioner: Partitioner,
    sizes: Sequence[int],
    longest: int,
    budget_deadline: float,
) -> ShapeSet:
    found: list[PipelineShape] = []
    smallest_fit: int | None = None
    for s in range(1, longest + 1):
        if smallest_fit is not None and s > smallest_fit + EXTRA_STAGES:
            break
        for ms in multisets(sizes, s):
            if time.monotonic() > budget_deadline:
                return ShapeSet(found, exhaustive=False, complete=False)
            for k in range(len(problem.micro_batch_sizes)):
                orders = heuristic_orders(problem, partitioner.classes, ms)
                costed = [
                    t
                    for seq in orders
                    for level in microbatch_levels(problem, k)
                    if (t := partitioner.best_split(seq, k, level))
                ]
                if costed:
                    smallest_fit = s if smallest_fit is None else smallest_fit
                    found.extend(pareto(costed))
    return ShapeSet(found, exhaustive=False, complete=True)


def heuristic_orders(
    problem: PlanningProblem, classes: Sequence[DeviceClass], ms: tuple[int, ...]
) -> list[tuple[int, ...]]:
    """Stage orders worth trying: most memory first (stage 0 holds the most activations),
    grouped by node (fewest slow hops; nodes by memory, then fastest node first and slowest
    node first), and fastest first; all orders of short pipelines. Ties go by node name
    and class index, so that the order of the cluster file decides as little as possible."""

    def memory(c: int) -> float:
        return float(problem.memory_capacity_bytes[classes[c].rep])

    def speed(c: int) -> float:
        return -float(problem.fwd_time_s[classes[c].rep].sum())

    def node(c: int) -> str:
        return problem.device_nodes[classes[c].rep]

    node_memory: dict[str, float] = {}
    node_time: dict[str, float] = {}
    for c in ms:
        node_memory[node(c)] = node_memory.get(node(c), 0.0) + memory(c)
        node_time[node(c)] = node_time.get(node(c), 0.0) - speed(c)
    orders = {
        tuple(sorted(ms, key=lambda c: (-memory(c), c))),
        tuple(sorted(ms, key=lambda c: (-node_memory[node(c)], node(c), -memory(c), c))),
        tuple(sorted(ms, key=lambda c: (node_time[node(c)], node(c), -speed(c), c))),
        tuple(sorted(ms, key=lambda c: (-node_time[node(c)], node(c), speed(c), c))),
        tuple(sorted(ms, key=lambda c: (-speed(c), -memory(c), c))),
    }
    if len(ms) <= 3:
        orders.update(distinct_orders(ms))
    return sorted(orders)
