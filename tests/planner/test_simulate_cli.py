"""`hplan simulate`, `hplan show --format svg|png`, the plan-to-simulator view and the
solver's second opinion."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hplan.planner.cli.main import main
from hplan.planner.cost.evaluate import evaluate
from hplan.planner.cost.layout import Layout, ReplicaLayout, StageLayout
from hplan.planner.sim.engine import EventKind, outer_time_per_step_s, simulate
from hplan.planner.sim.spec import spec_from_layout, spec_from_plan
from hplan.planner.solve.search import SolveOptions
from hplan.planner.solve.solver import second_opinion, solve
from hplan.runtime.contract.holders import grad_sync_reports, island_of_rank, outer_groups
from hplan.runtime.contract.plan import GradSyncReport, Plan, Schedule, SyncMode
from tests.fixtures.plans import GPT_MODEL, ReplicaShape, make_plan
from tests.fixtures.problems import Dev, make_problem
from tests.fixtures.sample_plans import cpu_plan, mixed_plan

CLI = [sys.executable, "-c", "from hplan.planner.cli.main import main; main()"]


def _predicted(plan: Plan) -> Plan:
    """``plan`` whose report predicts forward = 1/3 and backward = 2/3 of each stage time."""
    ranks = tuple(
        replace(
            r,
            forward_time_s=r.stage_time_per_microbatch_s / 3,
            backward_time_s=2 * r.stage_time_per_microbatch_s / 3,
            optimizer_time_s=1e-3,
        )
        for r in plan.report.ranks
    )
    groups = (GradSyncReport(ranks=tuple(r.rank for r in plan.ranks), num_bytes=10**8),)
    return replace(plan, report=replace(plan.report, ranks=ranks, grad_sync=groups))


def _write(plan: Plan, tmp_path: Path) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json(), encoding="utf-8")
    return path


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


# --------------------------------------------------------------------------- plan -> spec
def test_the_plan_view_sends_the_cut_tensors_bytes_of_each_micro_batch() -> None:
    plan = _predicted(cpu_plan())  # one 3-stage pipeline, micro-batches 3, 3, 2
    spec = spec_from_plan(plan)
    (replica,) = spec.replicas
    first = plan.replica_ranks(0)[0]
    cut = plan.cut_after(first.units[-1])
    assert replica.microbatch_sizes == (3, 3, 2)
    assert replica.links[0].forward_bytes == tuple(
        float(sum(t.num_bytes(n) for t in cut.tensors)) for n in (3, 3, 2)
    )
    grads = [t for t in cut.tensors if t.requires_grad]
    assert 0 < len(grads) < len(cut.tensors)  # a mask and position ids get no gradient back
    assert replica.links[0].backward_bytes[2] == float(sum(t.num_bytes(2) for t in grads))
    # full-micro-batch compute for every micro-batch, as the cost model charges it
    assert len(set(replica.stages[0].forward_s)) == 1
    scaled = spec_from_plan(plan, scale_partial_microbatches=True).replicas[0].stages[0]
    assert scaled.forward_s[2] == pytest.approx(replica.stages[0].forward_s[0] * 2 / 3)


def test_a_plan_without_predictions_is_refused_with_the_fix() -> None:
    from hplan.runtime.contract.errors import ConfigError

    with pytest.raises(ConfigError, match="re-run `hplan solve`"):
        spec_from_plan(mixed_plan())


def test_gradient_groups_follow_the_runtimes_holder_sets_tied_weights_included() -> None:
    # GPT ties tok_emb and lm_head: a 2-stage pipeline sums that gradient across its stages.
    plan = make_plan(
        GPT_MODEL,
        [ReplicaShape((3, -1), micro_batch_size=2, num_samples=4), ReplicaShape((-1,), 2, 2)],
    )
    wire = {name: 100 for unit in plan.units for name in unit.params}
    groups = {g.ranks: g.num_bytes for g in grad_sync_reports(plan, wire)}
    assert (0, 1, 2) in groups  # the tied weight: both stages of replica 0 and replica 1
    assert set(groups) == {(0, 2), (1, 2), (0, 1, 2)}
    assert sum(groups.values()) == 100 * len({p for u in plan.units for p in u.params})


# --------------------------------------------------------------------------- CLI
def test_simulate_prints_a_summary_and_writes_a_chrome_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = _predicted(mixed_plan())
    trace = tmp_path / "trace.json"
    code, out, err = _run(
        ["simulate", str(_write(plan, tmp_path)), "--json", "--trace", str(trace)], capsys
    )
    assert code == 0, err
    summary = json.loads(out)
    expected = simulate(spec_from_plan(plan))
    assert summary["step_time_s"] == pytest.approx(expected.step_time_s)
    assert [r["rank"] for r in summary["ranks"]] == [r.rank for r in plan.ranks]
    assert summary["bottleneck_rank"] == expected.bottleneck_rank
    assert "bubble" in err and "critical path" in err
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {r.rank for r in plan.ranks}
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert (0, "compute") in threads and (0, "send to next stage") in threads
    names = {e["name"] for e in spans if e["cat"] == "compute"}
    assert "s1.F.mb3" in names and "s0.B.mb0" in names and "optimizer" in names
    assert all(re.fullmatch(r"s\d\.[FB]\.mb\d+|optimizer", n) for n in names)


def test_simulate_rejects_a_plan_without_predictions_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(["simulate", str(_write(mixed_plan(), tmp_path))], capsys)
    assert code == 2
    assert err.count("\n") == 1 and "re-run `hplan solve`" in err


def test_simulate_needs_a_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["simulate"], capsys)
    assert code == 2
    assert "PLAN_PATH" in err


def test_show_draws_the_same_svg_twice_and_a_png(tmp_path: Path) -> None:
    path = _write(_predicted(replace(cpu_plan(), training=replace(cpu_plan().training))), tmp_path)
    svgs = [
        subprocess.run(
            [*CLI, "show", str(path), "--format", "svg"], capture_output=True, check=True
        ).stdout
        for _ in range(2)
    ]
    assert svgs[0] == svgs[1]
    assert svgs[0].startswith(b"<?xml") and b"<svg" in svgs[0]
    png = subprocess.run(
        [*CLI, "show", str(path), "--format", "png"], capture_output=True, check=True
    )
    assert png.stdout.startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.parametrize("fmt", ["svg", "png"])
def test_show_without_matplotlib_says_what_to_install_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fmt: str
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    path = _write(_predicted(cpu_plan()), tmp_path)
    code, out, err = _run(["show", str(path), "--format", fmt], capsys)
    assert code == 4  # environment
    assert out == ""
    assert err.count("\n") == 1 and "pip install 'hplan[plot]'" in err, err


# --------------------------------------------------------------------------- solver
def test_the_solver_reports_the_simulated_time_of_its_layout() -> None:
    problem = make_problem(
        [Dev("a", 2.0, 80e9), Dev("a", 1.0, 80e9), Dev("b", 1.0, 2e9)],
        unit_work=[0.01, 0.02, 0.02, 0.01],
        global_batch_size=24,
        grad_bytes=1e7,
    )
    result = solve(problem, SolveOptions(time_limit_s=20, watchdog=False))
    assert result.simulated_step_time_s == pytest.approx(
        simulate(spec_from_layout(problem, result.layout)).step_time_s
    )


def test_the_second_opinion_prefers_what_the_simulator_finds_faster() -> None:
    # A latency-bound 2-stage pipeline: the cost model charges 1F1B's round trip per two
    # micro-batches (45 ms each) and ranks it behind data parallel with a 90 ms all-reduce;
    # run under GPipe, which keeps every micro-batch in flight, the simulator finds the
    # pipeline faster (30 ms per micro-batch).
    problem = make_problem(
        [Dev("a", 1.0, 80e9), Dev("b", 1.0, 80e9)],
        unit_work=[0.01, 0.01],
        global_batch_size=16,
        micro_batch_sizes=(1,),
        cut_bytes_per_sample=1.0,
        inter_bandwidth=1e8,
        latency_s=0.015,
        grad_bytes=3e6,  # a 90 ms all-reduce in one bucket: 2 x 3e6 B / 1e8 B/s + 2 x 15 ms
    )
    pipeline = Layout((ReplicaLayout((StageLayout(0, 0, 1), StageLayout(1, 1, 2)), 1, 16, 16),))
    data_parallel = Layout(tuple(ReplicaLayout((StageLayout(d, 0, 2),), 1, 8, 8) for d in range(2)))
    assert evaluate(problem, data_parallel).step_time_s < evaluate(problem, pipeline).step_time_s
    chosen, simulated = second_opinion(problem, [data_parallel, pipeline], Schedule.GPIPE)
    assert chosen == 1
    assert simulated == pytest.approx((0.57, 0.54))
    assert second_opinion(problem, [data_parallel, pipeline], Schedule.ONE_F_ONE_B)[0] == 0


def test_local_sgd_plans_sum_inside_islands_and_amortise_their_outer_sync() -> None:
    base = _predicted(mixed_plan())
    recorded = tuple(GradSyncReport(ranks=r, num_bytes=10**8) for r in sorted(outer_groups(base)))
    plan = replace(base, report=replace(base.report, grad_sync=recorded))
    spec = spec_from_plan(plan)
    island = island_of_rank(plan)
    assert spec.sync_groups and spec.notes == ()
    assert all(len({island[r] for r in g.ranks}) == 1 for g in spec.sync_groups)
    assert [o.ranks for o in spec.outer_syncs] == [g.ranks for g in recorded]
    assert {(o.mode, o.local_steps) for o in spec.outer_syncs} == {(SyncMode.LOCAL_SGD, 8)}
    inner_s = simulate(replace(spec, outer_syncs=())).step_time_s
    local = simulate(spec)
    assert local.step_time_s == pytest.approx(
        inner_s + outer_time_per_step_s(spec.outer_syncs, inner_s)
    )
    assert any(e.kind is EventKind.OUTER_SYNC for e in local.events)
    synchronous = replace(plan, training=replace(plan.training, sync=None))
    assert simulate(spec_from_plan(synchronous)).step_time_s > local.step_time_s


def test_the_timeline_draws_an_all_reduce_beside_the_backward_it_overlaps_not_over_it() -> None:
    from hplan.planner.emit.timeline_plot import _LANES, _category
    from hplan.runtime.contract.timeline_file import ALL_REDUCE, COMPUTE, TimelineEvent

    backward = TimelineEvent(0, COMPUTE, "s0.B.mb0", 0.0, 0.098)
    bucket = TimelineEvent(0, ALL_REDUCE, "all-reduce ranks 0,1", 0.003, 0.095)
    (b_lane, b_colour), (a_lane, a_colour) = _category(backward), _category(bucket)
    assert (b_colour, a_colour) == ("B", ALL_REDUCE) and b_lane != a_lane
    spans = sorted((bottom, bottom + height) for bottom, height in _LANES.values())
    assert all(top <= bottom for (_, top), (bottom, _) in itertools.pairwise(spans))
    assert spans[0][0] >= 0 and spans[-1][1] <= 1
