"""The solver's memory strategies: recomputation per stage and ZeRO stage 1's (and 2's)
uneven shards, chosen where memory binds (issue 11)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from hplan.planner.cost.evaluate import evaluate
from hplan.planner.cost.problem import Policy
from hplan.planner.cost.zero import state_saving_bytes
from hplan.planner.sim.spec import simulated_step_time_s
from hplan.planner.solve import solver as solver_module
from hplan.planner.solve.search import SolveOptions
from hplan.planner.solve.solver import solve, uniform_strategies
from hplan.planner.solve.validate import layout_problems
from hplan.runtime.contract.errors import InfeasiblePlanError
from tests.fixtures.brute_force import brute_force
from tests.fixtures.problems import GB, Dev, make_problem, recompute_bound_problem

FAST = SolveOptions(time_limit_s=30, watchdog=False)


def _recompute_problem(policy: Policy = Policy.AUTO):  # type: ignore[no-untyped-def]
    """``recompute_bound_problem`` under ``policy``."""
    return replace(recompute_bound_problem(), recompute=policy)


def test_a_stage_recomputes_where_only_recomputing_fits_a_faster_micro_batch() -> None:
    problem = _recompute_problem()
    result = solve(problem, FAST)
    (replica,) = result.layout.replicas
    assert [s.recompute for s in replica.stages] == [True, False]
    assert replica.micro_batch_size == 2
    assert not layout_problems(problem, result.layout)
    never = solve(_recompute_problem(Policy.NEVER), FAST)
    assert never.layout.replicas[0].micro_batch_size == 1
    assert not never.layout.replicas[0].stages[0].recompute
    assert result.evaluation.step_time_s < never.evaluation.step_time_s
    best = brute_force(problem)
    assert best is not None and result.evaluation.step_time_s == pytest.approx(best[0])


def test_recomputing_costs_the_extra_forward_and_keeps_one_microbatch() -> None:
    problem = _recompute_problem()
    layout = solve(problem, FAST).layout
    kept = replace(
        layout,
        replicas=tuple(
            replace(r, stages=tuple(replace(s, recompute=False) for s in r.stages))
            for r in layout.replicas
        ),
    )
    with_recompute, without = evaluate(problem, layout), evaluate(problem, kept)
    k = problem.micro_batch_sizes.index(layout.replicas[0].micro_batch_size)
    first = layout.replicas[0].stages[0]
    forward = float(
        problem.fwd_time_s[first.device_idx, first.unit_start : first.unit_stop, k].sum()
    )
    assert with_recompute.stages[0][0].compute_time_s == pytest.approx(
        without.stages[0][0].compute_time_s + forward
    )
    assert with_recompute.memory_ok and not without.memory_ok
    assert layout_problems(problem, kept)  # the validator sees keeping does not fit


def test_policies_are_obeyed() -> None:
    always = solve(_recompute_problem(Policy.ALWAYS), FAST)
    assert all(s.recompute for r in always.layout.replicas for s in r.stages)
    tight = replace(_recompute_problem(Policy.NEVER), global_batch_size=4)
    tight = replace(tight, memory_capacity_bytes=np.array([1.2 * GB, 1.2 * GB]))
    with pytest.raises(InfeasiblePlanError):
        solve(tight, FAST)


def _three_cards(  # type: ignore[no-untyped-def]
    small_gb: float,
    num_units: int,
    static_gb: float,
    state_gb: float,
    act_gb: float,
    grad_gb: float,
):
    """Two 24 GB cards (speed 2) and a ``small_gb`` card (speed 1) on one node, a model of
    ``num_units`` units, each with ``static_gb`` of static bytes of which ``state_gb`` is
    optimizer state; no recomputation."""
    problem = make_problem(
        [Dev("a", 2.0, 24 * GB), Dev("a", 2.0, 24 * GB), Dev("a", 1.0, small_gb * GB)],
        unit_work=[1.0] * num_units,
        global_batch_size=40,
        micro_batch_sizes=(1, 2, 4, 8),
        static_bytes=static_gb * GB,
        act_bytes_per_sample=act_gb * GB,
        grad_bytes=grad_gb * GB,
        intra_bandwidth=50e9,
    )
    state = np.full(num_units, state_gb * GB)
    return replace(problem, optimizer_state_bytes=state, recompute=Policy.NEVER)


def _zero_problem():  # type: ignore[no-untyped-def]
    """Two 24 GB cards and one 10.5 GB card, one node, a model of one unit (no pipeline):
    8 GB of parameters and gradients plus 8 GB of optimizer state. The small card cannot
    hold a replica with its whole state, the 24 GB ones can; with the state sharded by
    free memory all three can (evenly, a third of the state overflows the small card)."""
    return _three_cards(10.5, 1, static_gb=16.0, state_gb=8.0, act_gb=0.05, grad_gb=4.0)


def test_zero_shards_unevenly_so_the_small_card_joins() -> None:
    problem = _zero_problem()
    plain = solve(problem, replace(FAST, zero="never"))
    sharded = solve(problem, FAST)
    weights = sharded.layout.optimizer_shard_weights
    assert weights, "auto shards when the unsharded plan leaves the small card idle"
    assert len(sharded.layout.device_indices) == 3 > len(plain.layout.device_indices)
    assert weights[2] < weights[0] and weights[2] < weights[1]
    assert sharded.evaluation.memory_ok and not layout_problems(problem, sharded.layout)
    saving = state_saving_bytes(problem, sharded.layout, weights)
    kept = {d: 8 * GB - saving[d] for d in range(3)}
    assert sum(kept.values()) == pytest.approx(8 * GB)  # the shards add up to the state
    assert sharded.evaluation.samples_per_s > plain.evaluation.samples_per_s
    assert sharded.evaluation.optimizer_time_s > plain.evaluation.optimizer_time_s  # all-gather
    even = replace(sharded.layout, optimizer_shard_weights=(1.0, 1.0, 1.0))
    assert not evaluate(problem, even).memory_ok


def test_zero_auto_shards_where_a_small_card_serves_only_as_a_pipeline_stage() -> None:
    """The small card cannot hold the whole model (four units of 2 GB static), so unsharded
    it is one stage of a two-stage pipeline; with the optimizer state sharded it holds a
    replica of its own, which is faster. Memory binds there although no device is idle or
    full (seen in bench/plan_quality.py --compare memory: GPT-2 medium on four 3060s and a 4090)."""
    problem = _three_cards(8.0, 4, static_gb=2.0, state_gb=1.0, act_gb=0.01, grad_gb=0.5)
    never = solve(problem, replace(FAST, zero="never"))
    assert [len(r.stages) for r in never.layout.replicas] == [1, 2]
    auto = solve(problem, FAST)
    assert auto.layout.optimizer_shard_weights
    assert [len(r.stages) for r in auto.layout.replicas] == [1, 1, 1]
    assert auto.evaluation.step_time_s < never.evaluation.step_time_s


def test_zero_never_and_always() -> None:
    problem = _zero_problem()
    never = solve(problem, replace(FAST, zero="never"))
    assert not never.layout.optimizer_shard_weights
    always = solve(problem, replace(FAST, zero="always"))
    assert always.layout.optimizer_shard_weights


def _zero2_problem(small_gb: float):  # type: ignore[no-untyped-def]
    """Two 24 GB cards and a small one, one node, a model of four units (each 1 GB of
    parameters, 1 GB of gradients, 1 GB of their all-reduce copy and 1 GB of optimizer
    state): stage 1 leaves the small card at least 12 GB (its state sharded away), stage 2
    9 GB (the copies too, less one 1 GB bucket), plus activations."""
    return _three_cards(small_gb, 4, static_gb=4.0, state_gb=1.0, act_gb=0.01, grad_gb=1.0)


def test_zero_stage_2_where_stage_1_does_not_fit_and_stage_1_where_it_does() -> None:
    options = replace(FAST, max_stages=1)
    tight = solve(_zero2_problem(10.5), options)  # stage 1 needs >= 12 GB there
    assert tight.layout.optimizer_shard_weights and tight.layout.zero_stage == 2
    assert len(tight.layout.device_indices) == 3
    assert tight.evaluation.memory_ok and not layout_problems(_zero2_problem(10.5), tight.layout)
    stage1 = replace(tight.layout, zero_stage=1)
    assert not evaluate(_zero2_problem(10.5), stage1).memory_ok
    assert layout_problems(_zero2_problem(10.5), stage1)  # the validator counts it too
    roomy = solve(_zero2_problem(14.0), options)  # stage 1 fits: same cost, stage 1 kept
    assert roomy.layout.optimizer_shard_weights and roomy.layout.zero_stage == 1
    assert len(roomy.layout.device_indices) == 3


def test_a_model_larger_than_every_device_together_is_named_as_such() -> None:
    problem = make_problem(
        [Dev("a", 1.0, 1.5 * GB), Dev("a", 1.0, 1.5 * GB)],
        unit_work=[1.0] * 4,
        global_batch_size=2,
        static_bytes=1 * GB,
        act_bytes_per_sample=0.01 * GB,
    )  # every unit fits a device, the four do not fit both
    with pytest.raises(
        InfeasiblePlanError,
        match="no pipeline, recomputation, ZeRO shard or optimizer-state offload",
    ):
        solve(problem, FAST)


def test_a_unit_no_device_holds_says_what_sharding_would_leave() -> None:
    problem = replace(_zero_problem(), memory_capacity_bytes=np.array([9.0, 9.0, 9.0]) * GB)
    problem = replace(problem, optimizer_state_bytes=np.full(1, 8 * GB))
    with pytest.raises(InfeasiblePlanError) as caught:
        solve(replace(problem, memory_capacity_bytes=np.array([7.0, 7.0, 7.0]) * GB), FAST)
    assert "with its optimizer state sharded away (--zero) it would still need" in str(caught.value)


def _selective_problem(policy: Policy = Policy.AUTO):  # type: ignore[no-untyped-def]
    """Two 3.3 GB devices, 4 units of 1 GB static: only the split [0, 1] | [2, 3] fits. Units
    1 and 3 hold 0.3 GB/sample of activations, units 0 and 2 0.1 GB, all the same forward
    time, and a micro-batch costs a fixed 10 s. At micro-batch 2, stage 0 (two in flight)
    keeping everything needs 3.6 GB; recomputing unit 1 alone, 3.0 GB; the whole stage,
    2.8 GB."""
    problem = make_problem(
        [Dev("a", 1.0, 3.3 * GB), Dev("a", 1.0, 3.3 * GB)],
        unit_work=[1.0] * 4,
        global_batch_size=4,
        micro_batch_sizes=(1, 2),
        static_bytes=1.0 * GB,
        act_bytes_per_sample=[0.1 * GB, 0.3 * GB, 0.1 * GB, 0.3 * GB],
        per_microbatch_overhead_s=10.0,
    )
    return replace(problem, recompute=policy)


def test_a_stage_recomputes_its_cheapest_unit_per_byte_where_that_fits_and_is_cheaper() -> None:
    problem = _selective_problem()
    result = solve(problem, FAST)
    (replica,) = result.layout.replicas
    first, second = replica.stages
    assert replica.micro_batch_size == 2
    assert (first.unit_start, first.unit_stop, first.recompute_units) == (0, 2, (1,))
    assert not first.recompute and second.recomputed_units == ()
    assert not layout_problems(problem, result.layout)
    best = brute_force(problem)
    assert best is not None and result.evaluation.step_time_s == pytest.approx(best[0])
    # the same layout with stage 0 recomputing every unit: fits too, but is slower
    full = replace(
        result.layout,
        replicas=(
            replace(replica, stages=(replace(first, recompute=True, recompute_units=()), second)),
        ),
    )
    assert not layout_problems(problem, full)
    assert evaluate(problem, full).step_time_s > result.evaluation.step_time_s
    # keeping unit 1's activations too does not fit; the evaluator and the validator agree
    kept = replace(
        full, replicas=(replace(replica, stages=(replace(first, recompute_units=()), second)),)
    )
    assert layout_problems(problem, kept) and not evaluate(problem, kept).memory_ok
    k = problem.micro_batch_sizes.index(2)
    assert result.evaluation.stages[0][0].compute_time_s == pytest.approx(
        evaluate(problem, kept).stages[0][0].compute_time_s + problem.fwd_time_s[0, 1, k]
    )
    assert result.evaluation.stages[0][0].memory_bytes == pytest.approx(
        2 * GB + 0.1 * GB * 2 * 2 + 1e6 * 2 * 2 + 0.3 * GB * 2 + 2 * 1e6 * 2
    )
    # --recompute always recomputes whole stages, never: micro-batch 1 only
    always = solve(_selective_problem(Policy.ALWAYS), FAST).layout
    assert all(s.recompute and not s.recompute_units for r in always.replicas for s in r.stages)
    never = solve(_selective_problem(Policy.NEVER), FAST)
    assert never.layout.replicas[0].micro_batch_size == 1
    assert never.evaluation.step_time_s > result.evaluation.step_time_s


def test_uniform_strategies_are_those_the_request_allows() -> None:
    problem = _recompute_problem()
    names = [name for name, _, _ in uniform_strategies(problem, FAST)]
    assert names == ["plain", "recompute", "zero-1", "offload"]
    _, plain_problem, plain_options = uniform_strategies(problem, FAST)[0]
    assert plain_problem.recompute is Policy.NEVER
    assert (plain_options.zero, plain_options.offload) == ("never", "never")
    no_zero = replace(FAST, zero="never", offload="never")
    assert [n for n, _, _ in uniform_strategies(problem, no_zero)] == ["plain", "recompute"]
    never = replace(problem, recompute=Policy.NEVER)
    assert [n for n, _, _ in uniform_strategies(never, no_zero)] == []  # plain itself


def test_the_mixed_choice_is_never_slower_than_a_uniform_strategy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The mixed search's own answer is made worse than plain's (its stages recompute at
    micro-batch 1); the solver must then return a uniform strategy's layout, as fast as the
    best of them as the plans report it."""
    problem = _recompute_problem()
    real = solver_module._family_choice

    def worse_mixed(p, options, candidates, family):  # type: ignore[no-untyped-def]
        result = real(p, options, candidates, family)
        if family.name != "mixed" or p.recompute is not Policy.AUTO:
            return result
        plain_family = candidates.generated.family("plain")
        plain = real(p, options, candidates, plain_family)
        layout = replace(
            plain.layout,
            replicas=tuple(
                replace(r, stages=tuple(replace(s, recompute=True) for s in r.stages))
                for r in plain.layout.replicas
            ),
        )
        simulated_s = simulated_step_time_s(p, layout, p.schedule, None)
        return replace(
            result,
            layout=layout,
            evaluation=evaluate(p, layout),
            simulated_step_time_s=simulated_s,
            source="worse",
        )

    monkeypatch.setattr(solver_module, "_family_choice", worse_mixed)
    chosen = solve(problem, FAST)
    uniform = [solve(p, o) for _, p, o in uniform_strategies(problem, FAST)[:2]]
    best_s = min(r.evaluation.step_time_s for r in uniform)
    assert chosen.source.startswith("uniform ")
    assert chosen.evaluation.step_time_s == pytest.approx(best_s)
    assert any("uniform" in note and "chose it" in note for note in chosen.notes)
    assert not layout_problems(problem, chosen.layout)
