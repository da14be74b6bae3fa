"""Rehearsal emulation: GPU plans replay the planner's compute model; cpu plans stretch real compute."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hplan.planner.api import SolveRequest, Strategy, plan_training
from hplan.runtime.executor.seams import Phase
from hplan.runtime.rehearsal.emulation import (
    EmulatedClock,
    Emulation,
    compute_emulation,
    modelled_emulation,
    rank_speeds,
)
from hplan.runtime.rehearsal.rehearse import rehearse

ROOT = Path(__file__).resolve().parents[2]
GPT = ROOT / "examples" / "gpt" / "model.py"
CLUSTERS = ROOT / "examples" / "clusters"


def _plan(cluster: str, batch: int):
    request = SolveRequest(
        model_path=GPT, cluster_path=CLUSTERS / f"{cluster}.yaml", global_batch_size=batch
    )
    return plan_training(request).plan


def test_gpu_plan_replays_the_predicted_forward_backward_and_optimizer_times():
    plan = _plan("mixed-3090-4090", 32)
    assert modelled_emulation(plan)
    for report in plan.report.ranks:
        emulated = compute_emulation(plan, report.rank, Emulation(dilation=2.0, time_scale=30.0))
        assert emulated.forward_s == pytest.approx(30.0 * report.forward_time_s)
        assert emulated.backward_s == pytest.approx(30.0 * report.backward_time_s)
        assert emulated.optimizer_s == pytest.approx(30.0 * report.optimizer_time_s)
        assert emulated.backward_s > emulated.forward_s > 0
    assert compute_emulation(plan, 0, None).forward_s == 0.0  # not rehearsing: no emulation


def test_a_smaller_last_micro_batch_replays_its_own_predicted_times():
    # Equal-batch data parallel: 44 samples over 5 GPUs at micro-batches of 4 gives
    # 9 = 4 + 4 + 1 (and 8 = 4 + 4): a last micro-batch of 1 is charged as 1, not 4.
    request = SolveRequest(
        model_path=GPT,
        cluster_path=CLUSTERS / "mixed-3090-4090.yaml",
        global_batch_size=44,
        micro_batch_sizes=(4,),
        strategy=Strategy.DATA_PARALLEL,
    )
    plan = plan_training(request).plan
    smaller = [r for r in plan.report.ranks if r.last_forward_time_s > 0]
    assert len(smaller) == 4
    for report in smaller:
        emulated = compute_emulation(plan, report.rank, Emulation(dilation=2.0, time_scale=30.0))
        clock = EmulatedClock(emulated, report.rank, plan.world_size)
        assert emulated.last_samples == 1
        assert clock._floor_and_stretch(Phase.FORWARD, 1)[0] == pytest.approx(
            30.0 * report.last_forward_time_s
        )
        assert clock._floor_and_stretch(Phase.BACKWARD, 1)[0] == pytest.approx(
            30.0 * report.last_backward_time_s
        )
        assert clock._floor_and_stretch(Phase.FORWARD, 4)[0] == pytest.approx(
            30.0 * report.forward_time_s
        )
        assert report.last_forward_time_s < report.forward_time_s


def test_cpu_plan_stretches_real_compute_by_the_planned_relative_speed():
    plan = _plan("cpu-rehearsal", 16)
    assert not modelled_emulation(plan)
    speeds = rank_speeds(plan)
    assert max(speeds) == 1.0
    for rank in plan.ranks:
        emulated = compute_emulation(plan, rank.rank, Emulation(dilation=2.0, time_scale=5.0))
        assert emulated.stretch == pytest.approx(2.0 / speeds[rank.rank])
        assert emulated.forward_s == 0.0


def test_rehearsed_gpu_plan_spends_at_least_the_modelled_compute_time(tmp_path):
    plan = _plan("mixed-3090-4090", 16)
    scale = 200.0  # emulated seconds per plan second: long enough to dominate the CPU work
    result = rehearse(plan, steps=2, metrics_dir=tmp_path, time_scale=scale, timeout_s=240)
    for summary in result.ranks:
        report = next(r for r in plan.report.ranks if r.rank == summary.rank)
        rank = plan.ranks[summary.rank]
        floor_s = scale * (report.forward_time_s + report.backward_time_s) * rank.num_microbatches
        assert summary.compute_time_s >= floor_s
        assert summary.optimizer_time_s >= scale * report.optimizer_time_s
    assert result.predicted_samples_per_s == pytest.approx(
        plan.global_batch_size / (plan.report.predicted_step_time_s * scale)
    )


def test_a_moment_inside_a_stretched_block_lies_proportionally_later_on_its_timeline():
    from hplan.runtime.executor.seams import Phase
    from hplan.runtime.rehearsal.emulation import ComputeEmulation, EmulatedClock

    clock = EmulatedClock(ComputeEmulation(backward_s=0.05), rank=0, world_size=1)
    before = time.monotonic()
    with clock._block(Phase.BACKWARD, "s0.B.mb0", 1):  # a little work, then 50 ms at least
        start = time.monotonic()
        sum(range(10_000))
        middle = time.monotonic()
        sum(range(10_000))
    (span,), (worked,) = clock._spans, clock._worked_s  # worked: when the real work ended
    assert span.duration_s >= 0.05
    assert span.start_s <= clock.timeline_s(start) <= clock.timeline_s(middle) <= span.end_s
    fraction = (middle - span.start_s) / (worked - span.start_s)
    assert clock.timeline_s(middle) == pytest.approx(span.start_s + fraction * span.duration_s)
    assert clock.timeline_s(middle) >= middle
    assert clock.timeline_s(worked) == pytest.approx(span.end_s)  # the work's end: the block's
    assert clock.timeline_s(before) == before  # outside every block: unchanged
    after = time.monotonic()
    assert clock.timeline_s(after) == after
    clock.take_spans()
    assert clock.timeline_s(middle) == middle  # the step's blocks are gone
