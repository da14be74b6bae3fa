"""The planner's choice of sync mode across islands (``solve/sync_choice.py``), the local
plans it compares (``solve/local_plan.py``, ``cost/islands.py``) and how a plan and its
summary say so: on hand-built problems, and end to end on the home-lab example."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from hplan.planner.cli.main import main
from hplan.planner.cost.evaluate import evaluate, outer_ring_times_s
from hplan.planner.cost.islands import candidate_partitions, island_names
from hplan.planner.cost.layout import IslandSync
from hplan.planner.cost.sync_cost import outer_round_s
from hplan.planner.sim.engine import EventKind, simulate
from hplan.planner.sim.spec import simulated_step_time_s, spec_from_plan
from hplan.planner.solve.local_plan import split_batch
from hplan.planner.solve.search import SolveOptions
from hplan.planner.solve.solver import SolveResult, solve
from hplan.planner.solve.sync_choice import (
    LOCAL_SGD_SYNC_SHARE,
    SyncRequest,
    group_choices,
    smallest_local_steps,
)
from hplan.planner.solve.validate import layout_problems
from hplan.runtime.contract.holders import outer_groups, sync_summary
from hplan.runtime.contract.plan import Plan, PseudoGradientDtype, SyncMode
from tests.fixtures.problems import GB, Dev, make_problem

ROOT = Path(__file__).resolve().parents[2]
GPT = ROOT / "examples" / "gpt" / "model.py"
MLP = ROOT / "examples" / "mlp" / "model.py"
CLUSTERS = ROOT / "examples" / "clusters"
GPT2_124M = {"LAYERS": "12", "WIDTH": "768", "HEADS": "12", "SEQ": "1024", "VOCAB": "50257"}


def _two_boxes(*, inter_bandwidth: float, grad_gb_per_unit: float = 0.1):
    """Box a: two devices of speed 2; box b: two of speed 1; four units of equal work."""
    devices = [Dev("a", 2.0, 8 * GB)] * 2 + [Dev("b", 1.0, 8 * GB)] * 2
    return make_problem(
        devices,
        unit_work=[0.01] * 4,
        global_batch_size=64,
        micro_batch_sizes=(1, 2, 4, 8, 16),
        static_bytes=0.2 * GB,
        act_bytes_per_sample=0.01 * GB,
        grad_bytes=grad_gb_per_unit * GB,
        inter_bandwidth=inter_bandwidth,
    )


def _solve(problem, sync: SyncRequest, **options) -> SolveResult:  # type: ignore[no-untyped-def]
    return solve(problem, SolveOptions(sync=sync, watchdog=False, time_limit_s=30, **options))


SLOW = 1.25e8  # 1 Gb/s
FAST = 1.25e11  # 1 Tb/s


# --------------------------------------------------------------------------- the rules
def test_smallest_local_steps_meets_each_modes_rule() -> None:
    # the round costs at most 5% of H steps; async takes the same H and hides the round
    assert smallest_local_steps(SyncMode.LOCAL_SGD, 1.0, 0.5, 100) == 40
    assert LOCAL_SGD_SYNC_SHARE * 39 * 0.5 < 1.0 <= LOCAL_SGD_SYNC_SHARE * 40 * 0.5
    assert smallest_local_steps(SyncMode.ASYNC, 1.0, 0.5, 100) == 40
    assert smallest_local_steps(SyncMode.LOCAL_SGD, 1.0, 0.5, 39) is None
    assert smallest_local_steps(SyncMode.LOCAL_SGD, 0.0, 0.5, 10) == 1


def test_the_batch_splits_by_weight_and_every_island_gets_a_sample() -> None:
    assert split_batch(10, [3.0, 1.0, 1.0]) == [6, 2, 2]
    assert split_batch(3, [100.0, 1.0, 1.0]) == [1, 1, 1]
    assert split_batch(7, [1.0, 0.0, 1.0]) == [4, 0, 3]
    with pytest.raises(ValueError, match="2 samples for 3 islands"):
        split_batch(2, [1.0, 1.0, 1.0])


def test_partitions_cut_at_every_inter_node_bandwidth_and_never_split_a_node() -> None:
    devices = [Dev(n, 1.0, 8 * GB) for n in ("a1", "a1", "a2", "b1", "b2")]
    problem = make_problem(devices, unit_work=[0.01], global_batch_size=8)
    bandwidth = problem.bandwidth_bytes_per_s.copy()
    same_site = {("a1", "a2"), ("b1", "b2")}
    for i, x in enumerate(problem.device_nodes):
        for j, y in enumerate(problem.device_nodes):
            if x != y:
                bandwidth[i, j] = 1.25e10 if (x, y) in same_site or (y, x) in same_site else 1.25e8
    problem = replace(problem, bandwidth_bytes_per_s=bandwidth)
    assert candidate_partitions(problem) == (
        (("a1",), ("a2",), ("b1",), ("b2",)),
        (("a1", "a2"), ("b1", "b2")),
    )
    assert island_names((("a1", "a2"), ("b1", "b2"))) == ("a", "b")
    assert island_names((("x", "y"), ("z",))) == ("x+y", "z")
    one_node = make_problem([Dev("a", 1.0, 8 * GB)] * 2, unit_work=[0.01], global_batch_size=4)
    assert candidate_partitions(one_node) == ()


# --------------------------------------------------------------------------- the choice
def test_a_slow_link_gets_local_sgd_with_the_smallest_h_that_meets_the_share() -> None:
    problem = _two_boxes(inter_bandwidth=SLOW)
    result = _solve(problem, SyncRequest.LOCAL_SGD)
    sync = result.layout.sync
    assert sync is not None and sync.mode is SyncMode.LOCAL_SGD
    assert sync.wire_dtype is PseudoGradientDtype.FLOAT32 and sync.num_fragments == 1
    assert sorted(result.layout.device_indices) == [0, 1, 2, 3]
    assert not layout_problems(problem, result.layout)
    ev = evaluate(problem, result.layout)
    round_s = outer_round_s(outer_ring_times_s(problem, result.layout))
    inner_s = ev.inner_step_time_s
    assert round_s <= LOCAL_SGD_SYNC_SHARE * sync.local_steps * inner_s
    assert round_s > LOCAL_SGD_SYNC_SHARE * (sync.local_steps - 1) * inner_s
    assert ev.outer_sync_time_s == pytest.approx(round_s / sync.local_steps)
    synchronous = _solve(problem, SyncRequest.ALL_REDUCE)
    assert ev.step_time_s < synchronous.evaluation.step_time_s


def test_islands_of_different_speeds_get_batch_shares_by_speed() -> None:
    result = _solve(_two_boxes(inter_bandwidth=SLOW), SyncRequest.LOCAL_SGD)
    per_device = {d: 0.0 for d in range(4)}
    for replica in result.layout.replicas:
        for stage in replica.stages:
            per_device[stage.device_idx] = replica.num_samples / replica.num_stages
    box_a, box_b = per_device[0] + per_device[1], per_device[2] + per_device[3]
    assert box_a == pytest.approx(2 * box_b, rel=0.25)


def test_a_fast_link_keeps_the_all_reduce_every_step() -> None:
    problem = _two_boxes(inter_bandwidth=FAST, grad_gb_per_unit=0.001)
    result = _solve(problem, SyncRequest.AUTO)
    assert result.layout.sync is None
    assert len(result.layout.device_indices) == 4


def test_sync_all_reduce_never_makes_a_local_plan() -> None:
    problem = _two_boxes(inter_bandwidth=SLOW)
    result = _solve(problem, SyncRequest.ALL_REDUCE)
    assert result.layout.sync is None
    assert not any("sync auto" in n for n in result.notes)


def test_async_takes_local_sgds_h_and_hides_the_outer_sync_behind_it() -> None:
    problem = _two_boxes(inter_bandwidth=SLOW)
    result = _solve(problem, SyncRequest.ASYNC)
    sync = result.layout.sync
    assert sync is not None and sync.mode is SyncMode.ASYNC
    ev = evaluate(problem, result.layout)
    round_s = outer_round_s(outer_ring_times_s(problem, result.layout))
    assert round_s > ev.inner_step_time_s  # the smallest hiding H would be > 1
    assert sync.local_steps == math.ceil(
        round_s / (LOCAL_SGD_SYNC_SHARE * ev.inner_step_time_s) - 1e-9
    )
    assert ev.outer_sync_time_s == 0.0


def test_max_local_steps_bounds_h_and_the_reason_says_what_it_costs() -> None:
    problem = _two_boxes(inter_bandwidth=SLOW, grad_gb_per_unit=1.0)
    result = _solve(problem, SyncRequest.LOCAL_SGD, max_local_steps=4)
    sync = result.layout.sync
    assert sync is not None and sync.local_steps == 4
    assert sync.wire_dtype is PseudoGradientDtype.BFLOAT16
    choices = group_choices(problem, result.layout, max_local_steps=4)
    assert choices and all(c.local_steps == 4 for c in choices)
    reason = choices[0].reason
    assert reason.startswith("islands a | b: local_sgd, H = 4: an all-reduce of")
    assert "in bfloat16" in reason and "H is capped at --max-local-steps 4" in reason
    assert "of each step is exposed" in reason
    assert evaluate(problem, result.layout).outer_sync_time_s > 0
    wider = _solve(problem, SyncRequest.LOCAL_SGD, max_local_steps=1000)
    assert wider.layout.sync is not None and wider.layout.sync.local_steps > 4


def test_the_simulator_times_a_local_layout_as_the_cost_model_does() -> None:
    problem = _two_boxes(inter_bandwidth=SLOW)
    result = _solve(problem, SyncRequest.LOCAL_SGD)
    ev = evaluate(problem, result.layout)
    simulated = simulated_step_time_s(problem, result.layout)
    assert simulated == pytest.approx(ev.step_time_s, rel=0.05)
    synchronous = replace(result.layout, sync=None)
    assert simulated_step_time_s(problem, synchronous) > simulated  # type: ignore[operator]
    as_async = replace(result.layout, sync=replace(result.layout.sync, mode=SyncMode.ASYNC))  # type: ignore[arg-type]
    assert simulated_step_time_s(problem, as_async) <= simulated  # type: ignore[operator]


def test_a_local_layout_whose_replica_spans_islands_is_invalid() -> None:
    problem = _two_boxes(inter_bandwidth=SLOW)
    result = _solve(problem, SyncRequest.LOCAL_SGD)
    spanning = replace(
        result.layout.replicas[0],
        stages=(
            replace(result.layout.replicas[0].stages[0], unit_stop=2),
            replace(result.layout.replicas[0].stages[0], device_idx=3, unit_start=2),
        ),
    )
    others = [r for r in result.layout.replicas[1:] if 3 not in {s.device_idx for s in r.stages}]
    moved = replace(result.layout, replicas=(spanning, *others))
    assert any("spans islands" in p for p in layout_problems(problem, moved))
    assert IslandSync(islands=(("a",), ("b",)), mode=SyncMode.LOCAL_SGD).local


# --------------------------------------------------------------------------- end to end
def _run(argv: list[str], capsys) -> tuple[int, str, str]:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


def test_the_home_lab_trains_both_boxes_under_auto(tmp_path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    for name, value in GPT2_124M.items():
        monkeypatch.setenv(f"HPLAN_GPT_{name}", value)
    cluster = str(CLUSTERS / "home-lab.yaml")
    argv = ["solve", str(GPT), "-c", cluster, "-o", str(tmp_path), "-b", "512", "--json"]
    code, out, err = _run(argv, capsys)
    assert code == 0, err
    summary = json.loads(out)
    plan = Plan.load(tmp_path / "plan.json")
    assert Plan.from_json(plan.to_json()) == plan
    plan.verify()
    assert summary["devices_used"] == summary["num_devices"] == 4
    assert (
        summary["sync"].startswith("local_sgd H=")
        and "across islands box-a | box-b" in (summary["sync"])
    )
    sync = plan.training.sync
    assert sync is not None and [i.name for i in sync.islands] == ["box-a", "box-b"]
    assert [g.ranks for g in sync.groups] == sorted(outer_groups(plan))
    choices = plan.report.sync_choices
    assert [c.ranks for c in choices] == [g.ranks for g in sync.groups]
    # the 1 GbE outer sync travels in fragments behind the inner steps: hidden
    assert all(g.overlap_steps >= 1 and g.num_fragments > 1 for g in sync.groups)
    assert all(c.all_reduce_time_s > 0 and c.exposed_time_per_step_s == 0 for c in choices)
    assert "overlap=" in summary["sync"] and "hidden" in choices[0].reason
    shares = {r.device_kind: r.num_samples for r in plan.ranks if r.node == "box-b"}
    assert shares["rtx3090"] > shares["rtx3060"]
    text = (tmp_path / "summary.txt").read_text(encoding="utf-8")
    assert "sync       islands box-a | box-b: local_sgd, H = " in text
    assert "an all-reduce of" in text and "one outer sync takes" in text
    assert 'label="island box-a"' in (tmp_path / "plan.dot").read_text(encoding="utf-8")
    code, shown, _ = _run(["show", str(tmp_path / "plan.json")], capsys)
    assert code == 0 and shown == text
    predicted = plan.report.predicted_step_time_s
    assert plan.report.simulated_step_time_s == pytest.approx(predicted, rel=0.05)
    from_plan = simulate(spec_from_plan(plan))  # the plan's own outer syncs, hidden too
    assert from_plan.step_time_s == pytest.approx(predicted, rel=0.05)
    assert not any(e.kind is EventKind.OUTER_SYNC for e in from_plan.events)
    assert plan.report.efficiency == pytest.approx(
        plan.report.predicted_samples_per_s / plan.report.physical_bound_samples_per_s
    )
    assert sync_summary(plan) == summary["sync"]
    listed = summary["sync_choices"]
    assert [tuple(c["ranks"]) for c in listed] == [c.ranks for c in choices]
    assert all(
        c["mode"] == "local_sgd" and c["local_steps"] == sync.groups[0].local_steps for c in listed
    )
    by_ranks = {g.ranks: g for g in sync.groups}
    for c in listed:  # each set's fragments, overlap and wire, as its plan group has them
        group = by_ranks[tuple(c["ranks"])]
        assert (c["num_fragments"], c["overlap_steps"], c["wire_dtype"]) == (
            group.num_fragments,
            group.overlap_steps,
            group.wire_dtype.value,
        )
    assert any("sync auto chose local sync" in n for n in plan.report.notes)
    assert [c["reason"] for c in listed] == [c.reason for c in choices]


@pytest.mark.parametrize(
    ("options", "needles"),
    [
        (["--sync", "sometimes"], ["'sometimes' is not one of", "hplan solve --help"]),
        (["--max-local-steps", "0"], ["--max-local-steps 0 must be in 1..1000000"]),
        (["--wire", "int3"], ["'int3' is not one of", "hplan solve --help"]),
        (["--max-overlap-steps", "100"], ["--max-overlap-steps 100 must be in 0..99"]),
        (
            ["--wire", "int8", "--sync", "all_reduce"],
            ["--wire int8 is the format of pseudo-gradients", "--sync all_reduce sends none"],
        ),
        (
            ["--sync", "local_sgd", "--max-overlap-steps", "2"],
            ["--max-overlap-steps bounds the overlap of --sync streaming and auto"],
        ),
        (
            ["--sync", "streaming", "--max-overlap-steps", "0"],
            ["--sync streaming overlaps its outer sync", "--sync local_sgd"],
        ),
        # the default bound (5) is no error where H may be at most 4
        (["--sync", "async", "--max-local-steps", "4"], ["--sync async syncs islands of nodes"]),
        (["--sync", "streaming"], ["--sync streaming syncs islands of nodes", "has one node"]),
        (["-b", "1000000000000"], ["global batch size 1000000000000 is outside 1..1,073,741,824"]),
        (["--sync", "local_sgd"], ["--sync local_sgd syncs islands of nodes", "has one node"]),
        (
            ["--strategy", "ddp", "--sync", "async"],
            ["--strategy ddp is a baseline that all-reduces every step", "--strategy hplan"],
        ),
    ],
)
def test_the_sync_options_are_checked_in_one_line(options, needles, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    cluster = tmp_path / "one-node.yaml"
    cluster.write_text(
        "name: one\nnodes:\n  - name: box\n    host: 127.0.0.1\n"
        "    devices: [{type: cpu, count: 2}]\n",
        encoding="utf-8",
    )
    argv = ["solve", str(MLP), "-c", str(cluster), "-o", str(tmp_path / "out")]
    code, _, err = _run([*argv, *options], capsys)
    assert code == 2
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
