"""Brute-force reference planner for tiny instances (tests compare the MILP with it).

Enumerates every layout: every set of disjoint, ordered device sequences (the replicas),
every contiguous unit split of each, whether each stage recomputes (as the problem's
``RecomputePolicy`` allows), every micro-batch size candidate (cut to the share where it is
larger: ``layout.replica_layout``), and every split of the global batch into positive
shares; costs each with the exact evaluator. Exponential:
use only with a handful of devices, units and samples.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from hplan.planner.cost.evaluate import evaluate
from hplan.planner.cost.layout import Layout, StageLayout, replica_layout
from hplan.planner.cost.problem import PlanningProblem, RecomputePolicy
from hplan.planner.solve.validate import layout_problems


def _ordered_partitions(items: tuple[int, ...]) -> Iterator[list[tuple[int, ...]]]:
    """Every set of disjoint non-empty ordered sequences covering ``items``."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for size in range(len(rest) + 1):
        for others in itertools.combinations(rest, size):
            remaining = tuple(x for x in rest if x not in others)
            for order in itertools.permutations((first, *others)):
                for tail in _ordered_partitions(remaining):
                    yield [order, *tail]


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def _replica_options(
    problem: PlanningProblem, devices: tuple[int, ...]
) -> list[tuple[StageLayout, ...]]:
    u = problem.num_units
    choices = {
        RecomputePolicy.AUTO: (False, True),
        RecomputePolicy.NEVER: (False,),
        RecomputePolicy.ALWAYS: (True,),
    }[problem.recompute]
    out = []
    for cuts in itertools.combinations(range(1, u), len(devices) - 1):
        bounds = (0, *cuts, u)
        for flags in itertools.product(choices, repeat=len(devices)):
            out.append(
                tuple(
                    StageLayout(d, bounds[s], bounds[s + 1], flags[s])
                    for s, d in enumerate(devices)
                )
            )
    return out


def brute_force(problem: PlanningProblem) -> tuple[float, Layout] | None:
    """(best step time, layout) over every valid layout, or None if none fits."""
    best: tuple[float, Layout] | None = None
    devices = tuple(range(problem.num_devices))
    for size in range(1, len(devices) + 1):
        for subset in itertools.combinations(devices, size):
            for pipelines in _ordered_partitions(subset):
                if len(pipelines) > problem.global_batch_size:
                    continue
                best = _best_for(problem, pipelines, best)
    return best


def _best_for(
    problem: PlanningProblem, pipelines: list[tuple[int, ...]], best: tuple[float, Layout] | None
) -> tuple[float, Layout] | None:
    if any(len(p) > problem.num_units for p in pipelines):
        return best
    stage_options = [_replica_options(problem, p) for p in pipelines]
    mbs_options = [problem.micro_batch_sizes] * len(pipelines)
    for shares in _compositions(problem.global_batch_size, len(pipelines)):
        for stages in itertools.product(*stage_options):
            for sizes in itertools.product(*mbs_options):
                replicas = tuple(
                    replica_layout(st, b, n) for st, b, n in zip(stages, sizes, shares, strict=True)
                )
                layout = Layout(replicas)
                if layout_problems(problem, layout):
                    continue
                step = evaluate(problem, layout).step_time_s
                if best is None or step < best[0] - 1e-15:
                    best = (step, layout)
    return best
