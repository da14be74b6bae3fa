"""The local plan of a partition: every island solved on its own, the global batch split so
that the islands finish their inner steps together, one layout whose islands sync locally.

For a partition into islands (``islands.candidate_partitions``):

1. The global batch B is split between the islands in proportion to their devices'
   standalone speeds (``evaluate.standalone_samples_per_s``), each island at least one
   sample.
2. Each island is solved alone for its share (the search, given as ``search_island``, on
   the problem restricted to its nodes and batch: ``cost.problem.restrict``). An island
   whose model does not fit is left idle.
3. The islands' inner step times t_i(B_i) are made equal: from the last two solves of an
   island, ``t_i(B) ~ a_i + c_i B`` (one solve: ``a_i = 0``, its throughput), and the
   shares ``B_i = (T - a_i) / c_i`` with ``sum B_i = B`` (an island whose share would be
   below one sample is left idle); then solved again. This repeats up to
   :data:`LOCAL_SHARE_ROUNDS` times, or until the islands' times are within
   :data:`SHARE_TOLERANCE` of each other.
4. Every round's islands are combined into one layout (their replicas, in island order,
   and ``IslandSync``); the whole batch is then shared again over every replica of every
   island at the shapes found (``shares.share_samples``: water-filling by micro-batch, so
   that the slowest replica of any island ends first), and
   ``sync_choice.choose_local_steps`` picks H and the wire dtype.

Every combined layout is returned; the caller re-costs them (``evaluate``, which includes
the amortised outer sync) and keeps the best.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from hplan.planner.cost.evaluate import (
    evaluate,
    island_index,
    pipeline_period_s,
    standalone_samples_per_s,
)
from hplan.planner.cost.islands import Partition, island_names
from hplan.planner.cost.layout import IslandSync, Layout
from hplan.planner.cost.problem import PlanningProblem, restrict
from hplan.planner.cost.shares import share_samples
from hplan.planner.solve.sync_choice import choose_local_steps
from hplan.planner.solve.validate import layout_problems
from hplan.runtime.contract.plan import SyncMode

__all__ = [
    "LOCAL_SHARE_ROUNDS",
    "SHARE_TOLERANCE",
    "IslandSearch",
    "local_layouts",
    "local_plans",
    "split_batch",
]

LOCAL_SHARE_ROUNDS = 4
"""Solves of each island per partition, at most (the first split and three refinements)."""
SHARE_TOLERANCE = 0.02
"""Islands whose inner steps are within 2% of each other finish together."""

IslandSearch = Callable[[PlanningProblem, float], Sequence[Layout]]
"""(an island's problem, deadline on ``time.monotonic``) -> the layouts its search found
(device indices of that problem)."""


@dataclass(frozen=True)
class _Solved:
    """One island solved for one share."""

    batch: int
    layout: Layout
    """Device indices of the whole problem."""
    step_s: float
    """The island's inner step alone."""


def split_batch(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` samples split in proportion to ``weights`` (largest remainder), each
    positive weight at least one sample, each zero weight none.

    Raises:
        ValueError: fewer samples than positive weights.
    """
    active = [i for i, w in enumerate(weights) if w > 0]
    if total < len(active):
        raise ValueError(f"{total} samples for {len(active)} islands")
    out = [0] * len(weights)
    if not active:
        return out
    weight = sum(weights[i] for i in active)
    rest = total - len(active)
    exact = {i: rest * weights[i] / weight for i in active}
    for i in active:
        out[i] = 1 + math.floor(exact[i])
    left = total - sum(out)
    order = sorted(active, key=lambda i: (-(exact[i] - math.floor(exact[i])), i))
    for i in order[:left]:
        out[i] += 1
    return out


def _fitted_line(solves: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(a, c) of ``t ~ a + c B`` through an island's last two solves of different batches,
    ``solves`` of (batch, step time); (0, t / B) from one, or when the time did not grow."""
    batch, step_s = solves[-1]
    earlier = [p for p in solves[:-1] if p[0] != batch]
    if earlier:
        slope = (step_s - earlier[-1][1]) / (batch - earlier[-1][0])
        if math.isfinite(slope) and slope > 0:
            return step_s - slope * batch, slope
    return 0.0, step_s / batch


def _fitted_shares(total: int, points: Sequence[Sequence[tuple[int, float]]]) -> list[float]:
    """Shares that give every island the same step time under its fitted line (module
    docstring, step 3); negative ones are 0."""
    lines = [_fitted_line(solves) for solves in points]
    common_s = (total + sum(a / c for a, c in lines)) / sum(1 / c for _, c in lines)
    return [max(0.0, (common_s - a) / c) for a, c in lines]


def local_plans(
    problem: PlanningProblem,
    partitions: Sequence[Partition],
    search_island: IslandSearch,
    deadline: float,
    *,
    mode: SyncMode,
    max_local_steps: int,
) -> list[tuple[str, Layout]]:
    """(``islands a | b``, layout) for every local layout of every partition
    (:func:`local_layouts`), the time left shared evenly between the partitions."""
    out = []
    for idx, partition in enumerate(partitions):
        share_s = max(deadline - time.monotonic(), 0.0) / (len(partitions) - idx)
        layouts = local_layouts(
            problem,
            partition,
            search_island,
            time.monotonic() + share_s,
            mode=mode,
            max_local_steps=max_local_steps,
        )
        label = f"islands {' | '.join(island_names(partition))}"
        out += [(label, layout) for layout in layouts]
    return out


def local_layouts(
    problem: PlanningProblem,
    partition: Partition,
    search_island: IslandSearch,
    deadline: float,
    *,
    mode: SyncMode,
    max_local_steps: int,
) -> list[Layout]:
    """The combined layouts of every round of the module docstring, H chosen; empty when
    fewer than two islands can take part."""
    total = problem.global_batch_size
    weights = [_island_speed(problem, island) for island in partition]
    solved: dict[tuple[int, int], _Solved | None] = {}
    points: list[list[tuple[int, float]]] = [[] for _ in partition]
    out: list[Layout] = []
    shares = _shares(total, weights)
    for round_idx in range(LOCAL_SHARE_ROUNDS):
        if shares is None or time.monotonic() >= deadline:
            break
        left = (LOCAL_SHARE_ROUNDS - round_idx) * sum(1 for s in shares if s > 0)
        results = _solve_round(problem, partition, shares, search_island, deadline, left, solved)
        for i, result in enumerate(results):
            if shares[i] > 0 and result is None:  # does not fit: the island stays idle
                weights[i] = 0.0
        if any(shares[i] > 0 and results[i] is None for i in range(len(partition))):
            shares = _shares(total, weights)
            continue
        done = [r for r in results if r is not None]
        if len(done) < 2:
            break
        for i, result in enumerate(results):
            if result is not None:
                points[i].append((result.batch, result.step_s))
        combined = _combined(problem, partition, done, mode, max_local_steps)
        if combined is not None:
            out.append(combined)
        times = [r.step_s for r in done]
        if max(times) <= (1 + SHARE_TOLERANCE) * min(times):
            break
        shares = _refined(total, weights, points)
    return out


def _island_speed(problem: PlanningProblem, island: Sequence[str]) -> float:
    return sum(
        standalone_samples_per_s(problem, d)
        for d, node in enumerate(problem.device_nodes)
        if node in island
    )


def _shares(total: int, weights: Sequence[float]) -> list[int] | None:
    """``split_batch``, or None when fewer than two islands take part."""
    if sum(1 for w in weights if w > 0) < 2 or total < 2:
        return None
    positive = sorted((w for w in weights if w > 0), reverse=True)
    floor = positive[min(total, len(positive)) - 1]
    return split_batch(total, [w if w >= floor else 0.0 for w in weights])


def _refined(
    total: int, weights: Sequence[float], points: Sequence[Sequence[tuple[int, float]]]
) -> list[int] | None:
    """The next round's shares (module docstring, step 3); islands left idle keep none."""
    active = [i for i, w in enumerate(weights) if w > 0 and points[i]]
    targets = _fitted_shares(total, [points[i] for i in active])
    refined = [0.0] * len(weights)
    for i, target in zip(active, targets, strict=True):
        refined[i] = target if target >= 1 else 0.0
    return _shares(total, refined)


def _solve_round(
    problem: PlanningProblem,
    partition: Partition,
    shares: Sequence[int],
    search_island: IslandSearch,
    deadline: float,
    solves_left: int,
    solved: dict[tuple[int, int], _Solved | None],
) -> list[_Solved | None]:
    out: list[_Solved | None] = []
    for i, (island, share) in enumerate(zip(partition, shares, strict=True)):
        if share <= 0:
            out.append(None)
            continue
        if (i, share) not in solved:
            budget = max(deadline - time.monotonic(), 0.0) / max(solves_left, 1)
            solves_left -= 1
            solved[(i, share)] = _solve_island(
                problem, island, share, search_island, time.monotonic() + budget
            )
        out.append(solved[(i, share)])
    return out


def _solve_island(
    problem: PlanningProblem,
    island: Sequence[str],
    share: int,
    search_island: IslandSearch,
    deadline: float,
) -> _Solved | None:
    devices = tuple(d for d, node in enumerate(problem.device_nodes) if node in island)
    sub = restrict(problem, devices, share)
    best: tuple[float, Layout] | None = None
    for layout in search_island(sub, deadline):
        if layout_problems(sub, layout):
            continue
        step_s = evaluate(sub, layout).step_time_s
        if best is None or step_s < best[0]:
            best = (step_s, layout)
    if best is None:
        return None
    return _Solved(share, _to_problem(best[1], devices), best[0])


def _to_problem(layout: Layout, devices: Sequence[int]) -> Layout:
    """A sub-problem's layout in the whole problem's device indices."""
    replicas = tuple(
        replace(r, stages=tuple(replace(s, device_idx=devices[s.device_idx]) for s in r.stages))
        for r in layout.replicas
    )
    return Layout(replicas)


def _combined(
    problem: PlanningProblem,
    partition: Partition,
    done: Sequence[_Solved],
    mode: SyncMode,
    max_local_steps: int,
) -> Layout | None:
    sync = IslandSync(islands=partition, mode=mode)
    layout = Layout(tuple(r for result in done for r in result.layout.replicas), sync=sync)
    if layout_problems(problem, layout):
        return None
    pipes = [p for result in done for p in _pipes(problem, result.layout)]
    shares = share_samples(
        [r.micro_batch_size for r in layout.replicas],
        [base_s for base_s, _ in pipes],
        [period_s for _, period_s in pipes],
        problem.global_batch_size,
    )
    shared = Layout(
        tuple(
            replace(r, num_microbatches=math.ceil(n / r.micro_batch_size), num_samples=n)
            for r, n in zip(layout.replicas, shares, strict=True)
            if n > 0
        ),
        sync=sync,
    )
    valid = _islands_used(problem, shared) >= 2 and not layout_problems(problem, shared)
    if valid and evaluate(problem, shared).step_time_s < evaluate(problem, layout).step_time_s:
        layout = shared
    return choose_local_steps(problem, layout, max_local_steps)


def _pipes(problem: PlanningProblem, island: Layout) -> list[tuple[float, float]]:
    """(base, period) of each replica of one island's layout: its pipeline takes
    ``base + (m - 1) * period`` for m micro-batches, base being its fill plus the island's
    exposed all-reduce and optimizer step (``evaluate``; they do not change with shares)."""
    ev = evaluate(problem, island)
    extra_s = ev.allreduce_time_s + ev.optimizer_time_s
    out = []
    for costs in ev.stages:
        computes = [c.compute_time_s for c in costs]
        links = [c.link_time_s for c in costs]
        out.append((sum(computes) + sum(links) + extra_s, pipeline_period_s(computes, links)))
    return out


def _islands_used(problem: PlanningProblem, layout: Layout) -> int:
    assert layout.sync is not None
    island = island_index(problem, layout.sync)
    return len({island[d] for d in layout.device_indices})
