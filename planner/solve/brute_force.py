"""Brute-force reference planner for tiny instances (tests compare the MILP with it).

Enumerates every layout: every set of disjoint, ordered device sequences (the replicas),
every contiguous unit split of each, whether each stage keeps its activations, recomputes
some of its units (every prefix of ``cost.recompute.recompute_order`` the solver may take)
or recomputes them all (as the problem's ``Policy`` allows), every micro-batch
size candidate (cut to the share where it is larger: ``layout.replica_layout``) and the even
cut of the share into as many micro-batches (``layout.even_size``, what
``cost.even_microbatches`` makes of it), and every split of the global batch into positive
shares; costs each with
the exact evaluator. Exponential: use only with a handful of devices, units and samples.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from hplan.planner.cost.evaluate import evaluate
from hplan.planner.cost.even_microbatches import even_sizes
from hplan.planner.cost.layout import Layout, ReplicaLayout, StageLayout, replica_layout
from hplan.planner.cost.problem import PlanningProblem, Policy
from hplan.planner.cost.recompute import recompute_order, selected_units
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
) -> list[tuple[int, tuple[StageLayout, ...]]]:
    u = problem.num_units
    out: list[tuple[int, tuple[StageLayout, ...]]] = []
    for cuts in itertools.combinations(range(1, u), len(devices) - 1):
        bounds = (0, *cuts, u)
        for k in range(len(problem.micro_batch_sizes)):
            options = [
                _stage_options(problem, d, bounds[s], bounds[s + 1], k)
                for s, d in enumerate(devices)
            ]
            out.extend((k, stages) for stages in itertools.product(*options))
    return out


def _stage_options(
    problem: PlanningProblem, device: int, start: int, stop: int, k: int
) -> list[StageLayout]:
    """Keep, every selective prefix of ``recompute_order`` short of all the stage's units,
    and whole-stage recomputation, as the problem's ``Policy`` allows."""
    keep = StageLayout(device, start, stop)
    full = StageLayout(device, start, stop, recompute=True)
    if problem.recompute is Policy.NEVER:
        return [keep]
    if problem.recompute is Policy.ALWAYS:
        return [full]
    order = recompute_order(problem, device, k)
    subsets = {
        chosen
        for count in range(1, len(order) + 1)
        if 0 < len(chosen := selected_units(order, start, stop, count)) < stop - start
    }
    selective = [StageLayout(device, start, stop, recompute_units=c) for c in sorted(subsets)]
    return [keep, *selective, full]


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
    sizes = problem.micro_batch_sizes
    for shares in _compositions(problem.global_batch_size, len(pipelines)):
        for options in itertools.product(*stage_options):
            cuts = [
                _cuts(problem, replica_layout(st, sizes[k], n))
                for (k, st), n in zip(options, shares, strict=True)
            ]
            for replicas in itertools.product(*cuts):
                layout = Layout(replicas)
                if layout_problems(problem, layout):
                    continue
                step = evaluate(problem, layout).step_time_s
                if best is None or step < best[0] - 1e-15:
                    best = (step, layout)
    return best


def _cuts(problem: PlanningProblem, replica: ReplicaLayout) -> tuple[ReplicaLayout, ...]:
    """The replica as cut, then its share cut evenly into every count
    ``cost.even_microbatches`` prices (once each)."""
    n = replica.num_samples
    sizes = [b for b in even_sizes(problem.micro_batch_sizes, n) if b != replica.micro_batch_size]
    return (replica, *(replica_layout(replica.stages, b, n) for b in sizes))
