"""The local plan of a partition (``solve/local_plan.py``): the batch shared again over the
islands' replicas keeps every island that was solved."""

from __future__ import annotations

from hplan.planner.cost.evaluate import evaluate
from hplan.planner.solve.search import SolveOptions
from hplan.planner.solve.solver import solve
from hplan.planner.solve.sync_choice import SyncRequest
from tests.fixtures.problems import GB, Dev, make_problem


def test_resharing_the_batch_keeps_every_island_though_a_smaller_round_would_look_faster() -> None:
    """Three boxes over 100 Mbit/s (speeds 4, 2, 1): each island alone finishes its share in
    about the same time. Before H is chosen every local layout pays its outer sync each
    step, where leaving a box out (a smaller round) looked faster: the reshared batch then
    dropped box c, and every later round kept it idle (issue 38: a ViT-B/16 on three sites
    used 4 of 6 devices)."""
    devices = (
        [Dev("a", 4.0, 8 * GB)] * 2 + [Dev("b", 2.0, 8 * GB)] * 2 + [Dev("c", 1.0, 8 * GB)] * 2
    )
    problem = make_problem(
        devices,
        unit_work=[0.01] * 4,
        global_batch_size=256,
        micro_batch_sizes=(1, 2, 4, 8, 16, 32, 64),
        static_bytes=0.2 * GB,
        act_bytes_per_sample=0.01 * GB,
        grad_bytes=0.1 * GB,
        inter_bandwidth=1.25e7,
        per_microbatch_overhead_s=0.002,
    )
    options = SolveOptions(sync=SyncRequest.LOCAL_SGD, watchdog=False, time_limit_s=30)
    result = solve(problem, options)
    assert result.layout.sync is not None
    assert sorted(result.layout.device_indices) == [0, 1, 2, 3, 4, 5]
    ev = evaluate(problem, result.layout)
    work_per_sample = 3 * 0.04  # four units of 0.01 forward, the backward twice that
    balanced_s = 256 / sum(d.speed / work_per_sample for d in devices)
    assert ev.inner_step_time_s < 1.1 * balanced_s


def test_an_island_that_fits_only_without_flat_gradient_copies_runs_a_pipeline() -> None:
    """Box c's two cards hold half the model each only without the flat copy of its
    gradients that every unit's static memory counts (1 GB a unit, 0.25 GB of it the copy):
    as one pipeline in its island, under local SGD, no rank sums those gradients every step
    with another, so no bucket copies them (issue 38: an SD 1.5 UNet on a 3060 + 2080 Ti)."""
    devices = [Dev(node, 1.0, 8 * GB) for node in "aabb"] + [Dev("c", 1.0, 1.9 * GB)] * 2
    problem = make_problem(
        devices,
        unit_work=[0.01] * 4,
        global_batch_size=64,
        micro_batch_sizes=(1, 2, 4, 8, 16),
        static_bytes=1.0 * GB,
        act_bytes_per_sample=0.001 * GB,
        grad_bytes=0.25 * GB,
        inter_bandwidth=1.25e7,
    )
    result = solve(problem, SolveOptions(sync=SyncRequest.LOCAL_SGD, watchdog=False))
    assert sorted(result.layout.device_indices) == [0, 1, 2, 3, 4, 5]
    (pipeline,) = [r for r in result.layout.replicas if r.stages[0].device_idx >= 4]
    assert [s.unit_stop - s.unit_start for s in pipeline.stages] == [2, 2]
    costs = evaluate(problem, result.layout).stages[result.layout.replicas.index(pipeline)]
    assert all(1.5 * GB < c.memory_bytes < 1.9 * GB for c in costs)
