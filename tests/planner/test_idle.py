"""Idle devices explained from the cost model (solve/idle.py) and shown in the report."""

from __future__ import annotations

from hplan.planner.cost.evaluate import evaluate
from hplan.planner.cost.layout import IslandSync, Layout, StageLayout, replica_layout
from hplan.planner.emit.report import idle_device_reports
from hplan.planner.solve.idle import idle_reasons, smallest_stage_bytes
from hplan.planner.solve.solver import SolveOptions, solve
from hplan.runtime.contract.plan import SyncMode
from tests.fixtures.problems import GB, Dev, make_problem

FAST = SolveOptions(time_limit_s=30, watchdog=False)


def test_a_device_too_small_for_any_stage_says_both_figures():
    problem = make_problem(
        [Dev("a", 1.0, 24 * GB), Dev("a", 1.0, 0.9 * GB)],
        unit_work=[1.0, 1.0],
        global_batch_size=4,
        static_bytes=1.0 * GB,
        act_bytes_per_sample=0.1 * GB,
        cut_bytes_per_sample=0.0,
    )
    result = solve(problem, FAST)
    assert set(result.layout.device_indices) == {0}
    (idle,) = idle_reasons(problem, result.layout, result.evaluation)
    assert idle.device_idx == 1
    assert smallest_stage_bytes(problem) == 1.1 * GB
    assert idle.reason == "the model's smallest stage needs 1.1 GB, the card has 0.9 GB usable"


def test_a_node_behind_a_slow_link_is_idle_because_syncing_costs_more_than_it_saves():
    """Two equal devices on two nodes joined by 1 Gb/s; 2 GB of gradients a step: adding the
    second as a replica would halve the compute but sync 2 GB over the slow link."""
    problem = make_problem(
        [Dev("box1", 1.0, 24 * GB), Dev("box2", 1.0, 24 * GB)],
        unit_work=[0.01, 0.01],
        global_batch_size=8,
        grad_bytes=1.0 * GB,
        cut_bytes_per_sample=1e9,
        inter_bandwidth=0.125e9,
    )
    result = solve(problem, FAST)
    assert len(result.layout.device_indices) == 1
    (report,) = idle_device_reports(problem, result)
    assert report.device == problem.device_names[1 - result.layout.device_indices[0]]
    assert "as one more replica" in report.reason
    assert "syncing gradients over the 1 Gb/s link costs" in report.reason
    assert "more than its compute saves" in report.reason


def test_every_device_used_means_no_idle_reports():
    problem = make_problem(
        [Dev("a", 1.0, 24 * GB), Dev("a", 1.0, 24 * GB)], unit_work=[1.0] * 4, global_batch_size=8
    )
    result = solve(problem, FAST)
    assert len(set(result.layout.device_indices)) == 2
    assert idle_device_reports(problem, result) == ()


def test_a_replica_without_pipeline_links_is_not_said_to_transfer_over_a_link():
    """A third, slower device as one more single-stage replica makes the slowest replica
    longer; the reason says so, not "transfers over the inf Gb/s link"."""
    problem = make_problem(
        [Dev("a", 1.0, 24 * GB), Dev("a", 1.0, 24 * GB), Dev("a", 0.5, 24 * GB)],
        unit_work=[1.0, 1.0],
        global_batch_size=6,
        per_microbatch_overhead_s=0.1,
    )
    result = solve(problem, FAST)
    (idle,) = idle_reasons(problem, result.layout, result.evaluation)
    assert idle.device_idx == 2
    assert idle.reason.startswith("as one more replica")
    assert "the slowest replica gets 0.600 s longer" in idle.reason
    assert "link" not in idle.reason


def test_a_box_left_out_of_a_local_plan_is_idle_for_the_outer_sync_it_would_join():
    """Three equal boxes over 100 Mbit/s, a local layout on boxes a and b: box c as one more
    replica saves compute but joins the outer sync (a round with a third island). The
    reason names that, not an all-reduce over an "inf" link (box c alone sums nothing every
    step; issue 38's ViT-B/16 on three sites)."""
    problem = make_problem(
        [Dev(node, 1.0, 8 * GB) for node in "abc"],
        unit_work=[0.01] * 2,
        global_batch_size=64,
        micro_batch_sizes=(1, 2, 4, 8, 16, 32, 64),
        grad_bytes=0.5 * GB,
        inter_bandwidth=1.25e7,
    )
    islands = (("a",), ("b",), ("c",))
    sync = IslandSync(islands=islands, mode=SyncMode.LOCAL_SGD, local_steps=2)
    replicas = tuple(replica_layout((StageLayout(d, 0, 2),), 64, n) for d, n in ((0, 32), (1, 32)))
    layout = Layout(replicas, sync=sync)
    (idle,) = idle_reasons(problem, layout, evaluate(problem, layout))
    assert idle.device_idx == 2
    assert "inf" not in idle.reason and "syncing gradients" not in idle.reason
    assert "its compute saves" in idle.reason and "the outer sync (per step)" in idle.reason
