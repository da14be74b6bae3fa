"""The local plan of a partition: every island solved on its own, the global batch split so
that the islands finish their inner steps together, one layout whose islands sync locally.

For a partition into islands (``islands.candidate_partitions``), in rounds:

1. The global batch is split between the islands by their devices' standalone speeds
   (``evaluate.standalone_samples_per_s``), each at least one sample.
2. Each island is solved alone for its share (``search_island``); one whose model does not
   fit is left idle.
3. The islands' layouts are combined into one (``IslandSync``), the whole batch shared
   again over every replica (:func:`reshared`), H and the wire dtype chosen
   (``sync_choice.choose_local_steps``).
4. The next round solves the islands for the shares the combined layout ended with, or,
   when solved already, for shares from lines fitted to each island's last two solves
   (:func:`_fitted_shares`); at most :data:`LOCAL_SHARE_ROUNDS` rounds.

The caller re-costs every combined layout (``evaluate``, with the amortised outer sync).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from hplan.planner.cost.evaluate import (
    evaluate,
    island_index,
    max_microbatches,
    standalone_samples_per_s,
)
from hplan.planner.cost.islands import Partition, island_names
from hplan.planner.cost.layout import IslandSync, Layout, ReplicaLayout, replica_layout
from hplan.planner.cost.microbatch import PipeTimes, pipe_times
from hplan.planner.cost.problem import PlanningProblem, restrict
from hplan.planner.cost.shares import share_options
from hplan.planner.solve.sync_choice import SyncRules, choose_local_steps
from hplan.planner.solve.validate import layout_problems

__all__ = [
    "LOCAL_SHARE_ROUNDS",
    "IslandSearch",
    "local_layouts",
    "local_plans",
    "split_batch",
]

LOCAL_SHARE_ROUNDS = 4
"""Solves of each island per partition, at most (the first split and three refinements)."""

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
    """``total`` samples split in proportion to ``weights`` (largest remainder), every
    positive weight at least one sample (taken from the largest shares), zero weights none.

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
    exact = {i: total * weights[i] / weight for i in active}
    for i in active:
        out[i] = math.floor(exact[i])
    order = sorted(active, key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    for i in active:
        if out[i] == 0:
            out[max(active, key=lambda j: (out[j], -j))] -= 1
            out[i] = 1
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
    docstring, step 4); negative ones are 0."""
    lines = [_fitted_line(solves) for solves in points]
    common_s = (total + sum(a / c for a, c in lines)) / sum(1 / c for _, c in lines)
    return [max(0.0, (common_s - a) / c) for a, c in lines]


def local_plans(
    problem: PlanningProblem,
    partitions: Sequence[Partition],
    search_island: IslandSearch,
    deadline: float,
    *,
    rules: SyncRules,
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
            rules=rules,
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
    rules: SyncRules,
) -> list[Layout]:
    """The combined layouts of every round of the module docstring, H chosen; empty when
    fewer than two islands can take part."""
    total = problem.global_batch_size
    weights = [_island_speed(problem, island) for island in partition]
    solved: dict[tuple[int, int], _Solved | None] = {}
    points: list[list[tuple[int, float]]] = [[] for _ in partition]
    tried: set[tuple[int, ...]] = set()
    out: list[Layout] = []
    shares = _shares(total, weights)
    for round_idx in range(LOCAL_SHARE_ROUNDS):
        if shares is None or tuple(shares) in tried or time.monotonic() >= deadline:
            break
        tried.add(tuple(shares))
        left = (LOCAL_SHARE_ROUNDS - round_idx) * sum(1 for s in shares if s > 0)
        results = _solve_round(problem, partition, shares, search_island, deadline, left, solved)
        if any(shares[i] > 0 and results[i] is None for i in range(len(partition))):
            for i, result in enumerate(results):  # does not fit: the island stays idle
                weights[i] = 0.0 if shares[i] > 0 and result is None else weights[i]
            shares = _shares(total, weights)
            continue
        done = [r for r in results if r is not None]
        if len(done) < 2:
            break
        for i, result in enumerate(results):
            if result is not None:
                points[i].append((result.batch, result.step_s))
        combined = _combined(problem, partition, done, rules)
        if combined is None:
            break
        out.append(combined)
        shares = _island_totals(problem, combined)
        if tuple(shares) in tried:
            shares = _refined(total, weights, points)
    return out


def _island_totals(problem: PlanningProblem, layout: Layout) -> list[int]:
    """Samples each island of a local layout processes per step."""
    assert layout.sync is not None
    island = island_index(problem, layout.sync)
    totals = [0] * len(layout.sync.islands)
    for replica in layout.replicas:
        totals[island[replica.stages[0].device_idx]] += replica.num_samples
    return totals


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
    """The next round's shares (module docstring, step 4); islands left idle keep none."""
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
    rules: SyncRules,
) -> Layout | None:
    """The islands' replicas as one layout, the batch shared again over all of them
    (:func:`reshared`), H chosen; None when it is not a valid local layout."""
    sync = IslandSync(islands=partition, mode=rules.request.mode)
    layout = Layout(tuple(r for result in done for r in result.layout.replicas), sync=sync)
    if layout_problems(problem, layout):
        return None
    extra_s = [e for result in done for e in _extra_s(problem, result.layout)]
    shared = reshared(problem, layout, extra_s)
    if shared is not None and _better(problem, shared, layout):
        layout = shared
    return choose_local_steps(problem, layout, rules)


def _better(problem: PlanningProblem, candidate: Layout, current: Layout) -> bool:
    """A valid local layout on two islands or more that is faster than ``current``."""
    if _islands_used(problem, candidate) < 2 or layout_problems(problem, candidate):
        return False
    return evaluate(problem, candidate).step_time_s < evaluate(problem, current).step_time_s


def _extra_s(problem: PlanningProblem, island: Layout) -> list[float]:
    """Per replica of one island's layout: the island's exposed all-reduce and optimizer
    step (``evaluate``), which the replica's share does not change."""
    ev = evaluate(problem, island)
    return [ev.allreduce_time_s + ev.optimizer_time_s] * len(island.replicas)


def reshared(problem: PlanningProblem, layout: Layout, extra_s: Sequence[float]) -> Layout | None:
    """``layout`` with the global batch shared again over its replicas, each at the
    micro-batch size that lets it do the most by a common step time.

    Replica r at micro-batch size b (any candidate at which each of its stages fits its
    device) takes ``extra_s[r]`` plus its pipeline time for its share, a last micro-batch
    smaller than b charged by its size (``cost.microbatch.PipeTimes``). The smallest time T
    by which the replicas, each at its best size for T, process the batch is found by
    bisection (capacities only grow with T); then ``shares.share_options`` water-fills the
    batch over them at those sizes (by sample, or in whole micro-batches where the
    evaluator rates that faster). None when no size fits some replica.
    """
    options = [_options(problem, r, e) for r, e in zip(layout.replicas, extra_s, strict=True)]
    if not all(options):
        return None
    total = problem.global_batch_size

    def best_at(time_s: float) -> list[PipeTimes]:
        """Per replica, the option doing the most by ``time_s``, then done soonest."""
        return [max(opts, key=lambda o: _rank_at(o, time_s, total)) for opts in options]

    lo, hi = 0.0, max(min(o.time_s(total) for o in opts) for opts in options)
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(o.samples_by(mid, total) for o in best_at(mid)) < total:
            lo = mid
        else:
            hi = mid
    chosen = best_at(hi)
    shared = [
        replace(
            layout,
            replicas=tuple(
                replica_layout(r.stages, o.micro_batch_size, n)
                for r, o, n in zip(layout.replicas, chosen, shares, strict=True)
                if n > 0
            ),
        )
        for shares in share_options(chosen, total)
    ]
    return min(shared, key=lambda option: evaluate(problem, option).step_time_s)


def _options(problem: PlanningProblem, replica: ReplicaLayout, extra_s: float) -> list[PipeTimes]:
    """``replica``'s step time at every micro-batch size at which its stages fit."""
    out = []
    for b in problem.micro_batch_sizes:
        trial = replace(replica, micro_batch_size=b, num_microbatches=1, num_samples=b)
        if evaluate(problem, Layout((trial,))).memory_ok:
            most = max_microbatches(problem, replica.stages, b)
            limit = None if most is None else most * b
            out.append(pipe_times(problem, replica.stages, b, extra_s, limit))
    return out


def _rank_at(option: PipeTimes, time_s: float, total: int) -> tuple[int, float]:
    done = option.samples_by(time_s, total)
    return done, -option.time_s(done) if done else 0.0


def _islands_used(problem: PlanningProblem, layout: Layout) -> int:
    assert layout.sync is not None
    island = island_index(problem, layout.sync)
    return len({island[d] for d in layout.device_indices})
