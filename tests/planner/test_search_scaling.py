"""The search scales with identical nodes, honours odd limits, and handles huge batches."""

from __future__ import annotations

import math

import pytest

from hplan.planner.solve.device_groups import device_groups, node_groups
from hplan.planner.solve.solver import SolveOptions, solve
from hplan.planner.solve.watchdog import checked_time_limit_s
from hplan.runtime.contract.errors import ConfigError
from tests.fixtures.problems import GB, Dev, make_problem

FAST = SolveOptions(time_limit_s=60, watchdog=False)


def _identical_nodes(num_nodes: int, **kwargs):
    devices = []
    for n in range(num_nodes):
        devices += [Dev(f"n{n}", 2.0, 24 * GB, kind="fast") for _ in range(2)]
        devices += [Dev(f"n{n}", 1.0, 12 * GB, kind="slow") for _ in range(2)]
    return make_problem(devices, unit_work=[1.0] * 6, micro_batch_sizes=(1, 2, 4, 8), **kwargs)


def test_identical_nodes_form_one_group_and_share_device_groups():
    problem = _identical_nodes(6, global_batch_size=32)
    assert node_groups(problem) == (tuple(f"n{i}" for i in range(6)),)
    classes = device_groups(problem)
    assert len(classes) == 2
    assert [c.size for c in classes] == [12, 12]
    first = classes[0].devices
    assert problem.device_nodes[first[0]] == problem.device_nodes[first[1]] == "n0"


def test_a_node_with_a_different_link_is_not_interchangeable():
    devices = [Dev(f"n{n}", 1.0, 24 * GB) for n in range(3) for _ in range(2)]
    problem = make_problem(devices, unit_work=[1.0] * 3, global_batch_size=8)
    problem.bandwidth_bytes_per_s[0:2, 4:6] = 1e8  # n0 <-> n2 slower than the rest
    problem.bandwidth_bytes_per_s[4:6, 0:2] = 1e8
    groups = node_groups(problem)
    assert ("n0",) in groups and ("n2",) in groups


@pytest.mark.parametrize("grad_gb", [0.0, 2.0])
def test_more_identical_nodes_never_plan_worse_than_one_node(grad_gb):
    one = solve(_identical_nodes(1, global_batch_size=64, grad_bytes=grad_gb * GB), FAST)
    many = solve(_identical_nodes(4, global_batch_size=64, grad_bytes=grad_gb * GB), FAST)
    assert many.evaluation.step_time_s <= one.evaluation.step_time_s * (1 + 1e-9)


def test_time_limits_reject_nan_and_zero_and_cap_infinity():
    for bad in (math.nan, 0.0, -1.0):
        with pytest.raises(ConfigError, match="time limit"):
            checked_time_limit_s(bad)
    assert checked_time_limit_s(math.inf) == 86_400.0
    assert checked_time_limit_s(1e12) == 86_400.0
    problem = _identical_nodes(1, global_batch_size=16)
    result = solve(problem, SolveOptions(time_limit_s=math.inf))
    assert result.layout.replicas


def test_a_huge_global_batch_is_solved_without_listing_every_step_time():
    problem = _identical_nodes(1, global_batch_size=10_000_000)
    result = solve(problem, FAST)
    assert sum(r.num_samples for r in result.layout.replicas) == 10_000_000


def test_the_watchdog_child_solves_after_the_parent_used_highs_in_process():
    # HiGHS keeps a thread pool; a forked child must reset it or its first solve hangs.
    solve(_identical_nodes(2, global_batch_size=64, grad_bytes=2 * GB), FAST)
    result = solve(_identical_nodes(1, global_batch_size=16), SolveOptions(time_limit_s=30))
    assert not any("limit" in note for note in result.notes)


def test_highs_runs_single_threaded_so_a_forked_watchdog_child_can_solve():
    # With HiGHS's default of half the cores, the parent's in-process solve leaves a worker
    # pool the forked child cannot use: the previous test failed on a 16-core machine
    # (the child died; "solver stopped at the limit"). On 2 cores the default is one thread.
    from hplan.planner.solve.milp import MilpBackend, _make_solver

    assert _make_solver(MilpBackend.HIGHS, 5.0).threads == 1
