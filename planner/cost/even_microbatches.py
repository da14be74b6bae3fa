"""Cut each replica's share into micro-batches of equal size; the cost model picks how many.

The search prices candidate micro-batch sizes, so a share that is not a multiple of the size
ends in a smaller micro-batch (1,365 samples at 512: 512 + 512 + 341). That ragged cut is
never kept: each replica's share is cut instead into ``k`` micro-batches of ``ceil(n / k)``
samples, for ``k = 1`` and every count a candidate size gives (:func:`microbatch_counts`);
the cost model (``evaluate``) picks the count, then the shares move until the replicas end
together again (:func:`rebalanced`); even cuts are the ones Megatron-LM and torch's
pipelining schedules require. Ties go to fewer micro-batches: counts priced within the
measurement spread of the replica's devices (:func:`tie_share`) cannot be ranked.

No micro-batch holds fewer than the problem's ``min_microbatch_samples`` (2 for BatchNorm in
train mode): shares below it take samples from the largest (:func:`floored_shares`), and
cuts whose last micro-batch would be smaller are not priced.
"""

from __future__ import annotations

from dataclasses import replace

from hplan.planner.cost.evaluate import Evaluation, evaluate
from hplan.planner.cost.layout import Layout, ReplicaLayout, even_size, replica_layout
from hplan.planner.cost.problem import PlanningProblem

__all__ = [
    "even_microbatches",
    "even_sizes",
    "floored",
    "floored_shares",
    "microbatch_counts",
    "rebalanced",
    "smallest_microbatch",
    "tie_share",
]

REBALANCE_ROUNDS = 4
"""Most rounds of :func:`rebalanced`. A replica's time is close to linear in its share (a
fixed cost plus a per-sample time, ``cost.microbatch``), so each round lands near the
balance and the next only corrects the rounding and the curve."""


def microbatch_counts(candidate_sizes: tuple[int, ...], num_samples: int) -> list[int]:
    """The micro-batch counts to price for a share of ``num_samples``: one, and the count of
    every candidate size up to the share (``ceil(n / c)``), ascending, without repeats."""
    counts = {1} | {-(-num_samples // c) for c in candidate_sizes if c <= num_samples}
    return sorted(counts)


def even_sizes(
    candidate_sizes: tuple[int, ...], num_samples: int, min_samples: int = 1
) -> list[int]:
    """The micro-batch sizes that cut ``num_samples`` evenly into each of
    :func:`microbatch_counts`, ascending, without repeats (one count may give the size of
    another: 10 in 6 is 5 x 2, as in 5), leaving out those whose last micro-batch holds
    fewer than ``min_samples`` (7 in 3 is 3 + 3 + 1)."""
    counts = microbatch_counts(candidate_sizes, num_samples)
    sizes = {even_size(num_samples, k) for k in counts}
    return sorted(b for b in sizes if smallest_microbatch(num_samples, b) >= min_samples)


def smallest_microbatch(num_samples: int, micro_batch_size: int) -> int:
    """Samples of the last (smallest) micro-batch of ``num_samples`` cut at
    ``micro_batch_size`` (``contract.plan.microbatch_sizes``)."""
    b = min(micro_batch_size, num_samples)
    return num_samples - (-(-num_samples // b) - 1) * b


def floored_shares(problem: PlanningProblem, layout: Layout) -> Layout:
    """``layout`` with no replica's share below ``problem.min_microbatch_samples``: a
    share below it takes samples from the largest share, one at a time, while that stays
    at the floor; where the batch cannot give every replica the floor, the replicas of
    the smallest shares are left out (their samples go to the largest). Micro-batch sizes
    are kept (clamped to the share); :func:`even_microbatches` cuts them afresh."""
    floor = problem.min_microbatch_samples
    shares = [r.num_samples for r in layout.replicas]
    if floor <= 1 or min(shares) >= floor:
        return layout
    kept = sorted(range(len(shares)), key=lambda i: -shares[i])
    kept = kept[: max(1, problem.global_batch_size // floor)]
    left_out = sum(shares[i] for i in range(len(shares)) if i not in kept)
    shares[kept[0]] += left_out
    for i in kept:
        while shares[i] < floor:
            donor = max(kept, key=lambda j: shares[j])
            shares[donor] -= 1
            shares[i] += 1
    replicas = tuple(
        replica_layout(r.stages, r.micro_batch_size, shares[i])
        for i, r in enumerate(layout.replicas)
        if i in kept
    )
    return replace(layout, replicas=replicas)


def floored(problem: PlanningProblem, layout: Layout) -> Layout:
    """``layout`` with no micro-batch below ``problem.min_microbatch_samples``: its shares
    floored (:func:`floored_shares`), and a replica whose last micro-batch is smaller cut
    into the most micro-batches, no more than it had, whose last one is not (one at
    worst). Nothing is re-costed (for layouts taken as they are: the baselines)."""
    layout = floored_shares(problem, layout)
    floor = problem.min_microbatch_samples
    replicas = []
    for replica in layout.replicas:
        n = replica.num_samples
        counts = range(min(replica.num_microbatches, n), 0, -1)
        k = next(k for k in counts if smallest_microbatch(n, even_size(n, k)) >= floor or k == 1)
        ok = smallest_microbatch(n, replica.micro_batch_size) >= floor
        replicas.append(replica if ok else replica_layout(replica.stages, even_size(n, k), n))
    return replace(layout, replicas=tuple(replicas))


def even_microbatches(problem: PlanningProblem, layout: Layout) -> Layout:
    """``layout`` with every replica's share cut evenly, its count the cost model's choice
    (module docstring); replicas are settled one after another, in order. A count whose
    micro-batches no longer fit memory (``Evaluation.memory_ok``) is skipped; when none
    fits the replica keeps its micro-batches (cut again where one is below the floor:
    :func:`floored`).

    Returns:
        A layout with the same stages, its shares rebalanced for the new cuts
        (:func:`rebalanced`; the same layout when nothing changes).
    """
    layout = floored_shares(problem, layout)
    floor = problem.min_microbatch_samples
    for r, replica in enumerate(layout.replicas):
        options: list[tuple[int, Layout, Evaluation]] = []
        for b in even_sizes(problem.micro_batch_sizes, replica.num_samples, floor):
            cut = replica_layout(replica.stages, b, replica.num_samples)
            option = replace(
                layout, replicas=(*layout.replicas[:r], cut, *layout.replicas[r + 1 :])
            )
            evaluation = evaluate(problem, option)
            if evaluation.memory_ok:
                options.append((cut.num_microbatches, option, evaluation))
        if options:
            layout = _fewest_within_tie(options, r, tie_share(problem, replica))
    return rebalanced(problem, floored(problem, layout))


def rebalanced(problem: PlanningProblem, layout: Layout) -> Layout:
    """``layout`` with its replicas' shares moved so that they end together again, each
    replica keeping its count of micro-batches (cut evenly, :func:`even_size`).

    The search balanced the shares for the micro-batches it priced (a candidate size and a
    smaller last one); cut evenly, a replica's time changes, and the replicas no longer end
    together. Each round gives replica ``r`` the share ``(T - o_r) * n_r / t_r`` (its
    samples at the rate its predicted time ``t_r`` shows, after its optimizer step ``o_r``,
    all ending at the same ``T``; rounded by the largest remainder), up to
    ``REBALANCE_ROUNDS`` rounds, each kept only when the cost model predicts a strictly
    shorter step and its micro-batches fit memory and stay allowed (an even cut no larger
    than the largest candidate, or one micro-batch). Layouts whose islands sync locally keep
    their shares (each island's are its own).

    Returns:
        A layout with the same stages and micro-batch counts (the same layout when no
        round helps).
    """
    if len(layout.replicas) < 2 or (layout.sync is not None and layout.sync.local):
        return layout
    best, best_eval = layout, evaluate(problem, layout)
    for _ in range(REBALANCE_ROUNDS):
        shares = _balanced_shares(
            best,
            best_eval.replica_times_s,
            best_eval.replica_starts_s,
            problem.min_microbatch_samples,
        )
        replicas = [_even_cut(problem, r, n) for r, n in zip(best.replicas, shares, strict=True)]
        if any(r is None for r in replicas):
            break
        option = replace(best, replicas=tuple(r for r in replicas if r is not None))
        evaluation = evaluate(problem, option)
        if not evaluation.memory_ok or evaluation.step_time_s >= best_eval.step_time_s:
            break
        best, best_eval = option, evaluation
    return best


def _balanced_shares(
    layout: Layout,
    replica_times_s: tuple[float, ...],
    starts_s: tuple[float, ...],
    floor: int = 1,
) -> list[int]:
    """Shares summing to the layout's such that every replica, after what precedes its
    pipeline (``starts_s``: its optimizer step, ``evaluate.Evaluation.replica_starts_s``),
    ends at the same time, each computing at its samples per second at its current share
    (largest remainder; at least ``floor`` samples each)."""
    total = sum(r.num_samples for r in layout.replicas)
    rates = [
        r.num_samples / max(t, 1e-12) for r, t in zip(layout.replicas, replica_times_s, strict=True)
    ]
    starts = starts_s or (0.0,) * len(rates)
    end_s = (total + sum(rate * s for rate, s in zip(rates, starts, strict=True))) / sum(rates)
    room = [max(0.0, (end_s - s) * rate) for rate, s in zip(rates, starts, strict=True)]
    exact = [total * x / sum(room) for x in room]
    shares = [max(floor, int(x)) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: int(exact[i]) - exact[i])
    for i in by_remainder[: max(0, total - sum(shares))]:
        shares[i] += 1
    while sum(shares) > total:  # only when a share was raised to the floor
        shares[shares.index(max(shares))] -= 1
    return shares


def _even_cut(
    problem: PlanningProblem, replica: ReplicaLayout, num_samples: int
) -> ReplicaLayout | None:
    """``replica`` with ``num_samples``, cut evenly into as many micro-batches as it has
    (fewer when the share is smaller); None when that cut is larger than the largest
    candidate (``solve.validate``'s rule: only one micro-batch may be), or its last
    micro-batch holds fewer than ``min_microbatch_samples``."""
    count = min(replica.num_microbatches, num_samples)
    size = even_size(num_samples, count)
    if count > 1 and size > problem.micro_batch_sizes[-1]:
        return None
    if smallest_microbatch(num_samples, size) < problem.min_microbatch_samples:
        return None
    return replica_layout(replica.stages, size, num_samples)


def tie_share(problem: PlanningProblem, replica: ReplicaLayout) -> float:
    """How close two predictions for ``replica`` must be to count as a tie: the largest
    ``PlanningProblem.time_spread`` of its devices (0 without measurements)."""
    if problem.time_spread is None:
        return 0.0
    return max(float(problem.time_spread[s.device_idx]) for s in replica.stages)


def _fewest_within_tie(
    options: list[tuple[int, Layout, Evaluation]], r: int, share: float
) -> Layout:
    """The layout with the fewest micro-batches among those whose step time is within
    ``share`` of the best, and of those, whose replica ``r``'s own pipeline time is within
    ``share`` of the best of them (at 0: the fastest step, then replica, then count)."""
    best_step_s = min(ev.step_time_s for _, _, ev in options)
    near = [o for o in options if o[2].step_time_s <= best_step_s * (1 + share)]
    best_own_s = min(ev.replica_times_s[r] for _, _, ev in near)
    tied = [o for o in near if o[2].replica_times_s[r] <= best_own_s * (1 + share)]
    return min(tied, key=lambda o: (o[0], o[2].step_time_s))[1]
