"""Equal micro-batches: the ragged cut replaced, the count by the cost model, ties to the fewest."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from hplan.planner.cost.evaluate import evaluate
from hplan.planner.cost.even_microbatches import even_microbatches, microbatch_counts, rebalanced
from hplan.planner.cost.layout import (
    IslandSync,
    Layout,
    ReplicaLayout,
    StageLayout,
    even_size,
    is_even_cut,
)
from hplan.planner.cost.profiled_times import time_spread
from hplan.planner.profiling.profile_file import Stat, UnitTiming
from hplan.planner.solve.solver import SolveOptions, solve
from hplan.planner.solve.validate import layout_problems
from hplan.runtime.contract.plan import SyncMode
from tests.fixtures.problems import GB, Dev, make_problem

FAST = SolveOptions(time_limit_s=30, watchdog=False)

# one unit whose time per sample is lowest at 8: 4 -> 4.4 s, 8 -> 8.0 s, 16 -> 19.2 s (forward)
SIZES = (4, 8, 16)
FORWARD_S = np.array([4.4, 8.0, 19.2])


def _problem(*, spread: float | None = None, memory_bytes: float = 100 * GB):
    problem = make_problem(
        [Dev("a", 1.0, memory_bytes)],
        unit_work=[1.0],
        global_batch_size=12,
        micro_batch_sizes=SIZES,
        static_bytes=0.0,
        act_bytes_per_sample=1 * GB,
    )
    fwd = FORWARD_S[None, None, :].copy()
    spreads = None if spread is None else np.array([spread])
    return replace(problem, fwd_time_s=fwd, bwd_time_s=2 * fwd, time_spread=spreads)


def _replica(problem, micro_batch_size: int) -> ReplicaLayout:
    n = problem.global_batch_size
    return ReplicaLayout((StageLayout(0, 0, 1),), micro_batch_size, -(-n // micro_batch_size), n)


def _cut(layout: Layout) -> tuple[int, int]:
    (replica,) = layout.replicas
    return replica.micro_batch_size, replica.num_microbatches


def test_even_size_and_even_cuts():
    assert even_size(1365, 3) == 455
    assert is_even_cut(1365, 455) and is_even_cut(1365, 683) and is_even_cut(1365, 1365)
    assert not is_even_cut(1365, 512)  # 512 + 512 + 341
    assert microbatch_counts((1, 2, 4, 8), 12) == [1, 2, 3, 6, 12]
    with pytest.raises(ValueError, match="num_microbatches 13"):
        even_size(12, 13)


def test_a_share_that_is_no_multiple_of_the_micro_batch_is_cut_evenly():
    # 8 + 4 and 6 + 6 cost the same (12.4 s forward); one of 12 costs 13.6 s: the even cut
    # of two wins, where the search alone ran 8 + 4
    problem = _problem()
    assert _cut(even_microbatches(problem, Layout((_replica(problem, 8),)))) == (6, 2)
    assert _cut(solve(problem, FAST).layout) == (6, 2)


def test_counts_within_the_measured_spread_go_to_the_fewest_micro_batches():
    # one micro-batch of 12 is predicted 9.7% slower than two of 6
    start = Layout((_replica(_problem(), 8),))
    assert _cut(even_microbatches(_problem(spread=0.05), start)) == (6, 2)
    assert _cut(even_microbatches(_problem(spread=0.15), start)) == (12, 1)
    assert _cut(solve(_problem(spread=0.15), FAST).layout) == (12, 1)


def test_a_count_whose_micro_batch_does_not_fit_memory_is_not_taken():
    # 12 samples of activations (12 GB) do not fit 10 GB; 6 do
    problem = _problem(spread=0.15, memory_bytes=10 * GB)
    start = Layout((_replica(problem, 8),))
    assert _cut(even_microbatches(problem, start)) == (6, 2)


def test_the_validator_takes_even_cuts_within_the_largest_candidate_only():
    problem = _problem()
    assert layout_problems(problem, Layout((_replica(problem, 6),))) == []  # 6 + 6
    assert layout_problems(problem, Layout((_replica(problem, 12),))) == []  # the share
    (uneven,) = layout_problems(problem, Layout((_replica(problem, 5),)))  # 5 + 5 + 2
    assert "micro-batch size 5 is neither a candidate" in uneven


def _timing(unit: str, size: int, median: float, p10: float, p90: float) -> UnitTiming:
    stat = Stat(median=median, p10=p10, p90=p90, num_samples=3)
    return UnitTiming(
        device="cpu@a",
        unit=unit,
        micro_batch_size=size,
        forward_s=stat,
        backward_s=stat,
        activation_bytes=0,
        peak_bytes=0,
    )


def test_time_spread_is_the_median_over_sizes_of_the_relative_p10_p90_width():
    timings = [
        # size 1: two units, forward + backward summed: p10 3.6, median 4, p90 4.4 -> 20%
        _timing("u0", 1, 1.0, 0.9, 1.1),
        _timing("u1", 1, 1.0, 0.9, 1.1),
        _timing("u0", 2, 1.0, 0.98, 1.02),  # 4%
        _timing("u1", 2, 1.0, 0.98, 1.02),
        _timing("u0", 4, 1.0, 0.99, 1.01),  # 2%
        _timing("u1", 4, 1.0, 0.99, 1.01),
    ]
    assert time_spread(timings) == pytest.approx(0.04)
    assert time_spread([]) == 0.0


def _two_replicas(shares: tuple[int, int], counts: tuple[int, int] = (1, 1)):
    """Two equal devices on two nodes; the MLP-like unit of ``_problem`` on each."""
    problem = make_problem(
        [Dev("a", 1.0, 100 * GB), Dev("b", 1.0, 100 * GB)],
        unit_work=[1.0],
        global_batch_size=sum(shares),
        micro_batch_sizes=SIZES,
        static_bytes=0.0,
        act_bytes_per_sample=0.1 * GB,
    )
    fwd = np.repeat(FORWARD_S[None, None, :], 2, axis=0)
    problem = replace(problem, fwd_time_s=fwd, bwd_time_s=2 * fwd)
    replicas = tuple(
        ReplicaLayout((StageLayout(d, 0, 1),), even_size(n, k), k, n)
        for d, (n, k) in enumerate(zip(shares, counts, strict=True))
    )
    return problem, Layout(replicas)


def test_shares_are_moved_until_the_replicas_end_together_keeping_their_counts():
    # 12 + 4 samples on two equal devices: one replica waits for the other; 8 + 8 ends
    # together, 1.4x faster by the cost model
    problem, start = _two_replicas((12, 4))
    balanced = rebalanced(problem, start)
    assert [(r.num_samples, r.num_microbatches) for r in balanced.replicas] == [(8, 1), (8, 1)]
    assert evaluate(problem, balanced).step_time_s < evaluate(problem, start).step_time_s / 1.4
    assert not layout_problems(problem, balanced)
    # two micro-batches stay two: 12 as 6 + 6 and 4 as 2 + 2 become 8 as 4 + 4 each
    problem, start = _two_replicas((12, 4), counts=(2, 2))
    assert [
        (r.num_samples, r.micro_batch_size, r.num_microbatches)
        for r in rebalanced(problem, start).replicas
    ] == [(8, 4, 2), (8, 4, 2)]
    # already balanced: the same layout
    problem, start = _two_replicas((8, 8))
    assert rebalanced(problem, start) is start


def test_shares_are_not_moved_past_the_largest_candidate_nor_between_local_islands():
    # 16 samples as 8 + 8 beside one micro-batch of 32: the 32 take longer, so samples move
    # to the two micro-batches, which then grow past 8
    problem, start = _two_replicas((16, 32), counts=(2, 1))
    moved = rebalanced(problem, start)
    assert moved.replicas[0].num_samples > 16 and moved.replicas[0].num_microbatches == 2
    assert not layout_problems(problem, moved)
    # with 8 the largest candidate, a cut of two above 8 is not allowed: nothing moves
    small = replace(
        problem,
        micro_batch_sizes=(4, 8),
        fwd_time_s=problem.fwd_time_s[:, :, :2],
        bwd_time_s=problem.bwd_time_s[:, :, :2],
    )
    assert rebalanced(small, start) is start
    local = replace(start, sync=IslandSync((("a",), ("b",)), SyncMode.LOCAL_SGD, local_steps=4))
    assert rebalanced(problem, local) is local
