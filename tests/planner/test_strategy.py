"""The strategy space as data and the solver's named steps: which families and generators
run, under one deadline; a layout the validator rejects is never reported optimal."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from hplan.planner.cost.layout import Layout
from hplan.planner.cost.problem import Policy
from hplan.planner.solve import strategy
from hplan.planner.solve.search import Candidate, SearchOutcome, SolveOptions
from hplan.planner.solve.solver import AFTER_GENERATION_SHARE, solve
from hplan.planner.solve.strategy import MIXED, Pool, families, generate
from hplan.planner.solve.validate import layout_problems
from hplan.runtime.contract.errors import ConfigError, InfeasiblePlanError
from hplan.runtime.contract.plan import SolverStatus
from tests.fixtures.problems import GB, Dev, make_problem, recompute_bound_problem

FAST = SolveOptions(time_limit_s=30, watchdog=False)


def _three_devices():  # type: ignore[no-untyped-def]
    return make_problem(
        [Dev("a", 1.0, 24 * GB), Dev("a", 1.5, 24 * GB), Dev("a", 2.0, 24 * GB)],
        unit_work=[1.0] * 4,
        global_batch_size=12,
    )


def _memory_bound():  # type: ignore[no-untyped-def]
    """A problem held only by a pipeline that recomputes, with optimizer state to shard (the
    mixed search's best is memory-shaped, so every gate opens)."""
    problem = recompute_bound_problem(grad_bytes=0.05 * GB)
    return replace(problem, optimizer_state_bytes=problem.static_memory_bytes / 2)


def test_families_are_the_request_and_the_uniform_settings_it_allows() -> None:
    problem = _three_devices()
    names = [f.name for f in families(problem, FAST)]
    assert names == [MIXED, "plain", "recompute", "zero-1", "offload"]
    cpus = make_problem([Dev("a", 1.0, 24 * GB, kind="cpu")], unit_work=[1.0], global_batch_size=2)
    assert "offload" not in [f.name for f in families(cpus, FAST)]  # a cpu's memory is the host's
    never = replace(FAST, zero=Policy.NEVER, offload=Policy.NEVER)
    assert [f.name for f in families(replace(problem, recompute=Policy.NEVER), never)] == [MIXED]


def test_options_take_strings_as_enum_members_and_refuse_unknown_ones() -> None:
    options = SolveOptions(zero="never", offload="always", sync="local_sgd", backend="highs")  # type: ignore[arg-type]
    assert options.zero is Policy.NEVER and options.offload is Policy.ALWAYS
    with pytest.raises(ValueError, match=r"SolveOptions\.zero 'sometimes'"):
        SolveOptions(zero="sometimes")  # type: ignore[arg-type]


def test_every_search_ends_within_the_time_limit_less_the_steps_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One deadline for every family and generator: each search gets a share of the time
    left, and generation ends the share of the limit that the later steps keep before it."""
    deadlines: list[float] = []
    real = strategy.search

    def recording(problem, options, deadline, report):  # type: ignore[no-untyped-def]
        deadlines.append(deadline)
        return real(problem, options, deadline, report)

    monkeypatch.setattr(strategy, "search", recording)
    limit_s = 20.0
    started_s = time.monotonic()
    result = solve(_memory_bound(), replace(FAST, time_limit_s=limit_s))
    assert result.layout.replicas
    assert len(deadlines) >= 3  # the request's search, ZeRO's, and a uniform family's
    assert max(deadlines) <= started_s + (1 - AFTER_GENERATION_SHARE) * limit_s


def test_a_search_two_families_share_runs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    keys: list[tuple[object, ...]] = []
    real = strategy.search

    def recording(problem, options, deadline, report):  # type: ignore[no-untyped-def]
        keys.append((problem.recompute, problem.static_memory_bytes.sum(), options.sync))
        return real(problem, options, deadline, report)

    monkeypatch.setattr(strategy, "search", recording)
    problem = replace(_memory_bound(), recompute=Policy.NEVER)
    solve(problem, FAST)
    assert len(keys) == len(set(keys))  # plain, zero-1 and offload share the plain search


def _bad(layout: Layout) -> Layout:
    """``layout`` with half its samples: faster under the cost model, and invalid (its
    shares no longer sum to the global batch)."""
    replicas = tuple(
        replace(r, num_samples=max(1, r.num_samples // 2), num_microbatches=1)
        for r in layout.replicas
    )
    return replace(
        layout, replicas=tuple(replace(r, micro_batch_size=r.num_samples) for r in replicas)
    )


def _inject(monkeypatch: pytest.MonkeyPatch, *, keep_real: bool) -> None:
    """The search reports, first, a "proven optimal" layout that the validator rejects."""
    real = strategy.search

    def with_a_bad_layout(problem, options, deadline, report):  # type: ignore[no-untyped-def]
        items: list[object] = []
        real(problem, options, deadline, items.append)
        found = [i for i in items if isinstance(i, Candidate) and i.main]
        bad = Candidate(_bad(found[0].layout), "a buggy scenario", 1e-6, 1e-6, True)
        report(bad)
        for item in items:
            if keep_real or isinstance(item, SearchOutcome):
                report(item)

    monkeypatch.setattr(strategy, "search", with_a_bad_layout)


def test_a_rejected_layout_is_never_reported_optimal_and_the_plan_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    problem = _three_devices()
    honest = solve(problem, FAST)
    assert honest.status is SolverStatus.OPTIMAL
    _inject(monkeypatch, keep_real=True)
    result = solve(problem, FAST)
    assert not layout_problems(problem, result.layout)
    assert result.status is not SolverStatus.OPTIMAL
    assert result.evaluation.step_time_s == pytest.approx(honest.evaluation.step_time_s)
    (note,) = [n for n in result.notes if "validator rejected" in n]
    assert "a buggy scenario" in note and "batch shares sum to" in note


def test_only_rejected_layouts_are_a_bug_of_hplan_not_a_limit_of_the_cluster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _inject(monkeypatch, keep_real=False)
    monkeypatch.setattr(strategy, "data_parallel_equal", lambda problem: None)
    monkeypatch.setattr(strategy, "uniform_pipeline", lambda problem: None)
    with pytest.raises(
        RuntimeError, match="bug in hplan's search, not a limit of the cluster"
    ) as err:
        solve(_three_devices(), FAST)
    assert "add devices" not in str(err.value)


def test_generation_tags_every_layout_with_its_family_pool_and_generator() -> None:
    problem = _memory_bound()
    generated = generate(problem, FAST, deadline_s=time.monotonic() + 30)
    generated.verify()
    assert {f.generator for f in generated.found} >= {"search", "baselines", "zero"}
    assert all(f.pool is Pool.SYNCHRONOUS for f in generated.found)
    assert generated.families[0].name == MIXED
    ran = {(r.family, r.generator) for r in generated.runs if not r.skipped}
    assert (MIXED, "search") in ran


def test_offload_always_on_cpus_is_refused_before_anything_runs() -> None:
    cpus = make_problem(
        [Dev("a", 1.0, 24 * GB, kind="cpu")], unit_work=[1.0] * 2, global_batch_size=4
    )
    with pytest.raises(ConfigError, match="--offload always"):
        generate(cpus, replace(FAST, offload=Policy.ALWAYS), deadline_s=time.monotonic() + 5)


@pytest.mark.parametrize("cut_short", [True, False])
def test_nothing_found_because_time_ran_out_says_so_not_only_the_cluster(
    monkeypatch: pytest.MonkeyPatch, cut_short: bool
) -> None:
    def searched_nothing(problem, options, deadline, report):  # type: ignore[no-untyped-def]
        if not cut_short:
            raise InfeasiblePlanError("nothing fits")
        report(SearchOutcome(complete=False))

    monkeypatch.setattr(strategy, "search", searched_nothing)
    monkeypatch.setattr(strategy, "data_parallel_equal", lambda problem: None)
    monkeypatch.setattr(strategy, "uniform_pipeline", lambda problem: None)
    with pytest.raises(InfeasiblePlanError) as err:
        solve(_three_devices(), FAST)
    assert ("30 s --time-limit cut the search short" in str(err.value)) is cut_short
