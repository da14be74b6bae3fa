"""A replica's last, smaller micro-batch is charged by its size (``cost.microbatch``):
the 1F1B formula on one and three stages, the shares, the micro-batch never above the
share, and the simulator agreeing with the cost model."""

from __future__ import annotations

import pytest

from hplan.planner.cost.evaluate import evaluate
from hplan.planner.cost.layout import Layout, ReplicaLayout, StageLayout, replica_layout
from hplan.planner.cost.microbatch import pipe_times, time_at_size, units_time_s
from hplan.planner.cost.shares import share_samples
from hplan.planner.sim.engine import simulate
from hplan.planner.sim.spec import spec_from_layout
from hplan.planner.solve.solver import SolveOptions, solve
from hplan.planner.solve.validate import layout_problems
from tests.fixtures.problems import Dev, make_problem

FAST = SolveOptions(time_limit_s=30, watchdog=False)


def _one_stage_problem(batch: int = 11):
    # forward of the two units at b samples: 0.03 b + 2 x 0.001 s; backward twice that,
    # so a micro-batch of b costs c(b) = 0.09 b + 0.006 s at every size (a straight line).
    return make_problem(
        [Dev("a", 1.0, 80e9)],
        unit_work=[0.01, 0.02],
        global_batch_size=batch,
        micro_batch_sizes=(1, 2, 4, 8),
        per_microbatch_overhead_s=0.001,
    )


def test_a_remainder_is_charged_by_its_size_on_one_stage() -> None:
    problem = _one_stage_problem()
    stage = (StageLayout(0, 0, 2),)
    split = evaluate(problem, Layout((ReplicaLayout(stage, 4, 3, 11),)))  # 4 + 4 + 3
    whole = evaluate(problem, Layout((ReplicaLayout(stage, 4, 3, 12),)))  # 4 + 4 + 4
    c = lambda b: 0.09 * b + 0.006  # noqa: E731
    assert split.step_time_s == pytest.approx(2 * c(4) + c(3), rel=1e-12)  # between candidates
    assert whole.step_time_s == pytest.approx(3 * c(4), rel=1e-12)
    assert split.step_time_s < whole.step_time_s
    assert split.stages[0][0].busy_time_s == pytest.approx(2 * c(4) + c(3), rel=1e-12)
    assert split.stages[0][0].memory_bytes == whole.stages[0][0].memory_bytes  # the full peak


def test_a_remainder_is_charged_as_the_formula_says_on_three_stages() -> None:
    # Three equal stages, free links; per stage at x samples f = 0.01 x, w = 0.02 x.
    # Full micro-batch b = 4: c = 0.12 = period P, fill F = 0.36. Last r = 2:
    # own trip  f0(4) + f1(4) + c2(2) + w1(2) + w0(2) = 0.04 + 0.04 + 0.06 + 0.04 + 0.04 = 0.22
    # behind    F - P + max(w0(2), w0(2) + w1(2) - w0(4), ...) = 0.36 - 0.12 + 0.04 = 0.28
    # T = (m - 1) P + max(0.22, 0.28) = 2 x 0.12 + 0.28 = 0.52 (all full: 0.60).
    problem = make_problem(
        [Dev("a", 1.0, 80e9)] * 3,
        unit_work=[0.01] * 3,
        global_batch_size=10,
        micro_batch_sizes=(1, 2, 4),
        cut_bytes_per_sample=1e-9,
        intra_bandwidth=1e30,
        latency_s=0.0,
    )
    stages = tuple(StageLayout(s, s, s + 1) for s in range(3))
    layout = Layout((ReplicaLayout(stages, 4, 3, 10),))
    full = Layout((ReplicaLayout(stages, 4, 3, 12),))
    assert evaluate(problem, layout).step_time_s == pytest.approx(0.52, rel=1e-12)
    assert evaluate(problem, full).step_time_s == pytest.approx(0.60, rel=1e-12)
    assert simulate(spec_from_layout(problem, layout)).step_time_s == pytest.approx(0.52)
    pipe = pipe_times(problem, stages, 4, 0.0)
    assert [pipe.time_s(n) for n in (2, 4, 10, 12)] == pytest.approx([0.18, 0.36, 0.52, 0.60])


def test_a_time_between_the_candidates_is_the_profile_rule_on_the_problems_sums() -> None:
    problem = _one_stage_problem()
    fwd, bwd = units_time_s(problem, 0, 0, 2, [3, 4, 6])
    sums = problem.fwd_time_s[0].sum(axis=0)
    at_six = time_at_size(list(zip(problem.micro_batch_sizes, sums, strict=True)), 6)
    assert fwd.tolist() == pytest.approx([0.092, 0.122, at_six])
    assert bwd.tolist() == pytest.approx([0.184, 0.244, 2 * at_six])


def test_shares_are_no_longer_whole_micro_batches() -> None:
    # Two equal devices, batch 10, micro-batches of 4: by micro-batch the water-filling
    # gave 6 + 4 (the partial one charged as a full one); by sample it gives 5 + 5.
    problem = _one_stage_problem(batch=10)
    pipes = [pipe_times(problem, (StageLayout(0, 0, 2),), 4, 0.0)] * 2
    assert share_samples(pipes, 10) == [5, 5]
    two = make_problem(
        [Dev("a", 1.0, 80e9), Dev("a", 1.0, 80e9)],
        unit_work=[0.01, 0.02],
        global_batch_size=10,
        micro_batch_sizes=(1, 2, 4, 8),
        per_microbatch_overhead_s=0.001,
    )
    layout = solve(two, FAST).layout
    assert sorted(r.num_samples for r in layout.replicas) == [5, 5]
    # The micro-batch never exceeds the share: 8 fits, so each runs one micro-batch of 5.
    assert all(r.micro_batch_size <= r.num_samples for r in layout.replicas)


def test_a_micro_batch_is_cut_to_its_share_and_larger_ones_are_refused() -> None:
    problem = _one_stage_problem(batch=3)
    stage = (StageLayout(0, 0, 2),)
    cut = replica_layout(stage, 8, 3)
    assert (cut.micro_batch_size, cut.num_microbatches) == (3, 1)
    assert layout_problems(problem, Layout((cut,))) == []
    larger = Layout((ReplicaLayout(stage, 4, 1, 3),))
    assert layout_problems(problem, larger) == [
        "replica 0: micro-batch size 4 is larger than its share"
    ]
    # What the runtime runs (one micro-batch of 3) is what both are charged.
    assert evaluate(problem, larger).step_time_s == evaluate(problem, Layout((cut,))).step_time_s


def test_simulator_and_cost_model_agree_with_remainders_and_an_all_reduce() -> None:
    # Data parallel over three devices with shares 11, 7, 6 at micro-batch 4 (last
    # micro-batches of 3, 3 and 2, whose backward passes the buckets overlap) and gradients
    # to all-reduce: the cost model and the simulator give the same step.
    problem = make_problem(
        [Dev("a", 2.0, 80e9), Dev("a", 1.0, 80e9), Dev("b", 1.5, 80e9)],
        unit_work=[0.01, 0.02, 0.01],
        global_batch_size=24,
        micro_batch_sizes=(1, 2, 4),
        grad_bytes=[4e6, 8e6, 4e6],
        optimizer_s=0.003,
        per_microbatch_overhead_s=0.001,
    )
    layout = Layout(
        tuple(replica_layout((StageLayout(d, 0, 3),), 4, n) for d, n in enumerate((11, 7, 6)))
    )
    predicted = evaluate(problem, layout)
    simulated = simulate(spec_from_layout(problem, layout)).step_time_s
    assert simulated == pytest.approx(predicted.step_time_s, rel=1e-12)
    assert predicted.allreduce_time_s > 0
