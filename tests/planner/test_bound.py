"""The throughput bound: no layout the planning model rates is faster (solve/bound.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hplan.planner.cost.evaluate import evaluate, standalone_samples_per_s
from hplan.planner.cost.layout import Layout, ReplicaLayout, StageLayout
from hplan.planner.cost.microbatch import units_time_s
from hplan.planner.solve.bound import throughput_bound_samples_per_s, unit_time_per_sample_s
from hplan.planner.solve.solver import SolveOptions, solve
from hplan.runtime.contract.errors import InfeasiblePlanError
from tests.fixtures.brute_force import brute_force
from tests.fixtures.problems import GB, Dev, make_problem

FAST = SolveOptions(time_limit_s=30, watchdog=False)


def _skewed(problem, skew: np.ndarray):
    """``problem`` with each (device, unit) time multiplied by ``skew[d, u]`` (devices no
    longer proportionally fast on every unit)."""
    factor = skew[:, :, None]
    return replace(
        problem, fwd_time_s=problem.fwd_time_s * factor, bwd_time_s=problem.bwd_time_s * factor
    )


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    speeds=st.lists(st.sampled_from([0.5, 1.0, 1.5, 3.0]), min_size=1, max_size=3),
    memories=st.lists(st.sampled_from([3.0, 6.0, 12.0]), min_size=3, max_size=3),
    num_units=st.integers(1, 4),
    batch=st.integers(1, 8),
    overhead_s=st.sampled_from([0.0, 0.3]),
    skew_seed=st.integers(0, 2**16),
    grad_gb=st.sampled_from([0.0, 0.5]),
)
def test_no_layout_beats_the_bound(
    speeds, memories, num_units, batch, overhead_s, skew_seed, grad_gb
):
    """Exhaustively (brute force) and as solved: random small clusters, unit times not
    proportional across devices, a fixed cost per micro-batch (larger ones are cheaper per
    sample) and memory that caps the micro-batch of the whole model."""
    rng = np.random.default_rng(skew_seed)
    devices = [Dev("a" if i < 2 else "b", s, memories[i] * GB) for i, s in enumerate(speeds)]
    problem = make_problem(
        devices,
        unit_work=rng.uniform(0.5, 2.0, num_units).round(2).tolist(),
        global_batch_size=batch,
        micro_batch_sizes=(1, 2, 4),
        static_bytes=rng.uniform(0.5, 2.0, num_units).round(2) * GB,
        act_bytes_per_sample=rng.uniform(0.1, 1.0, num_units).round(2) * GB,
        grad_bytes=grad_gb * GB,
        per_microbatch_overhead_s=overhead_s,
    )
    problem = _skewed(problem, rng.choice([0.25, 1.0, 4.0], size=(len(devices), num_units)))
    bound = throughput_bound_samples_per_s(problem)
    best = brute_force(problem)
    if best is None:
        with pytest.raises(InfeasiblePlanError):
            solve(problem, FAST)
        return
    best_samples_per_s = batch / best[0]
    assert best_samples_per_s <= bound
    solved = solve(problem, FAST).evaluation
    assert solved.samples_per_s <= bound


def test_the_sum_of_standalone_devices_is_exceeded_where_the_bound_is_not():
    """Two devices, each four times faster at one of two units: a two-stage pipeline gives
    each device the unit it is good at and beats the sum of standalone rates (the old
    'bound'), never the LP bound."""
    problem = make_problem(
        [Dev("a", 1.0, 24 * GB), Dev("a", 1.0, 24 * GB)],
        unit_work=[1.0, 1.0],
        global_batch_size=64,
        micro_batch_sizes=(1,),
        cut_bytes_per_sample=0.0,
    )
    problem = _skewed(problem, np.array([[0.25, 1.0], [1.0, 0.25]]))
    pipeline = Layout((ReplicaLayout((StageLayout(0, 0, 1), StageLayout(1, 1, 2)), 1, 64, 64),))
    rate = evaluate(problem, pipeline).samples_per_s
    standalone = sum(standalone_samples_per_s(problem, d) for d in range(2))
    bound = throughput_bound_samples_per_s(problem)
    assert rate > 1.5 * standalone
    assert rate <= bound
    # each device spends 0.25 * 3 s per sample on its good unit: 1 / 0.75 samples/s at most
    # (the LP); the second stage also waits 0.75 s for the first micro-batch's trip through
    # the first, which the step-time MILP counts: the bound is the pipeline's rate, to its gap
    assert bound < 1 / 0.75
    assert bound <= rate * 1.011


def _overhead_problem(num_units: int):  # type: ignore[no-untyped-def]
    """Four equal devices, ``num_units`` units of little work, and a 1 s fixed cost per
    micro-batch on each unit; batch 4."""
    return make_problem(
        [Dev("a", 1.0, 24 * GB)] * 4,
        unit_work=[0.01] * num_units,
        global_batch_size=4,
        micro_batch_sizes=(1, 2, 4),
        grad_bytes=0.0,
        per_microbatch_overhead_s=1.0,
    )


def test_with_a_fixed_cost_per_micro_batch_and_a_small_batch_the_bound_is_the_critical_path():
    """The demo's regime: a micro-batch costs 1 s of overhead on each of four units
    whatever its size, and the batch is 4 samples. Per-sample rates (the LP) credit each of
    the four devices with its rate at micro-batch 4 (1.28 samples/s). But every micro-batch
    pays the overhead of all four units one after another, so no layout beats four replicas
    of one sample each (0.33 samples/s), which the bound now says to its MILP gap."""
    problem = _overhead_problem(4)
    bound = throughput_bound_samples_per_s(problem)
    replicas = Layout(tuple(ReplicaLayout((StageLayout(d, 0, 4),), 1, 1, 1) for d in range(4)))
    rate = evaluate(problem, replicas).samples_per_s
    assert rate <= bound <= rate * 1.011
    times = unit_time_per_sample_s(problem)
    lp_only = 4 / (times[0].sum())  # the LP's optimum: four devices at their best rate
    assert bound < 0.3 * lp_only


def test_a_stage_may_use_a_micro_batch_the_whole_model_cannot():
    """Per-micro-batch overhead makes large micro-batches cheaper per sample; the whole
    model fits a device only at size 1, each half of it at size 4."""
    problem = make_problem(
        [Dev("a", 1.0, 2.5 * GB), Dev("a", 1.0, 2.5 * GB)],
        unit_work=[1.0, 1.0],
        global_batch_size=64,
        micro_batch_sizes=(1, 4),
        static_bytes=1.0 * GB,
        act_bytes_per_sample=0.1 * GB,
        cut_bytes_per_sample=0.0,
        per_microbatch_overhead_s=1.0,
    )
    pipeline = Layout((ReplicaLayout((StageLayout(0, 0, 1), StageLayout(1, 1, 2)), 4, 16, 64),))
    ev = evaluate(problem, pipeline)
    assert ev.memory_ok
    standalone = sum(standalone_samples_per_s(problem, d) for d in range(2))
    assert ev.samples_per_s > standalone
    assert ev.samples_per_s <= throughput_bound_samples_per_s(problem)


def test_proportional_devices_give_the_sum_of_their_rates():
    problem = make_problem(
        [Dev("a", 1.0, 24 * GB), Dev("a", 2.0, 24 * GB), Dev("b", 2.0, 24 * GB)],
        unit_work=[1.0, 2.0, 1.0],
        global_batch_size=16,
    )
    # 4 work units x 3 (fwd + bwd) per sample: speed / 12 samples/s per device
    assert throughput_bound_samples_per_s(problem) == pytest.approx(5.0 / 12, rel=1e-6)


def test_a_unit_that_fits_no_device_gives_zero_and_too_large_sizes_are_ignored():
    problem = make_problem(
        [Dev("a", 1.0, 1.5 * GB)],
        unit_work=[1.0, 1.0],
        global_batch_size=2,
        micro_batch_sizes=(1, 2, 4),
        static_bytes=[1.0 * GB, 2.0 * GB],
    )
    assert throughput_bound_samples_per_s(problem) == 0.0
    times = unit_time_per_sample_s(problem)
    assert np.isinf(times[0, 1]) and np.isfinite(times[0, 0])


# --------------------------------------------------------------------------- baselines
def test_the_uniform_pipeline_baseline_always_has_two_or_more_stages():
    """Four fast devices that each hold the whole model: the fastest equal layout is plain
    data parallel, which the uniform pipeline must not turn into."""
    from hplan.planner.emit.report import baseline_reports
    from hplan.planner.solve.baselines import uniform_pipeline

    problem = make_problem(
        [Dev("a", 1.0, 24 * GB)] * 4, unit_work=[1.0] * 4, global_batch_size=16, grad_bytes=0.0
    )
    layout = uniform_pipeline(problem)
    assert layout is not None
    assert all(r.num_stages >= 2 for r in layout.replicas)
    names = {b.name.split(",")[0]: b for b in baseline_reports(problem)}
    assert "x 1 stage" in names["data parallel"].note
    assert "x 1 stage," not in names["uniform pipeline"].note


def test_one_device_has_no_uniform_pipeline_baseline():
    from hplan.planner.emit.report import baseline_reports
    from hplan.planner.solve.baselines import uniform_pipeline

    problem = make_problem([Dev("a", 1.0, 24 * GB)], unit_work=[1.0] * 3, global_batch_size=4)
    assert uniform_pipeline(problem) is None
    assert [b.name.split(",")[0] for b in baseline_reports(problem)] == ["data parallel"]


def test_a_bound_lp_the_solver_cannot_scale_falls_back_to_the_time_budget_bound():
    """A unit 1e24 times slower than the others (a capture file with an absurd figure):
    HiGHS fails on the LP, and the bound is the looser all-devices-time bound, which still
    holds for the solved plan, instead of an internal error."""
    problem = make_problem(
        [Dev("a", 1.0, 24 * GB), Dev("b", 2.0, 24 * GB)],
        unit_work=[1.0, 1.0, 1.0],
        global_batch_size=8,
        micro_batch_sizes=(1, 2, 4),
    )
    problem = _skewed(problem, np.array([[1e24, 1.0, 1.0], [1e24, 1.0, 1.0]]))
    bound = throughput_bound_samples_per_s(problem)
    times = unit_time_per_sample_s(problem)
    assert bound == pytest.approx(2 / times.min(axis=0).sum(), rel=1e-6)
    assert solve(problem, FAST).evaluation.samples_per_s <= bound


def test_a_problem_too_large_for_the_milp_keeps_the_critical_path():
    """4 devices x 40 units is past the MILP's size limit: the bound is then the batch over
    one micro-batch's trip through every unit, not the per-sample LP alone."""
    problem = _overhead_problem(40)
    path_s = sum(float(sum(units_time_s(problem, 0, u, u + 1, 1.0))) for u in range(40))
    assert throughput_bound_samples_per_s(problem) == pytest.approx(4 / path_s, rel=1e-6)
