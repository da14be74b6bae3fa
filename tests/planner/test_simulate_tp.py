"""Tensor parallelism in the simulator: a TP group's per-layer collectives, timed by hand."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from hplan.planner.sim.engine import (
    EventKind,
    SimChannel,
    SimLink,
    SimReplica,
    SimSpec,
    SimStage,
    simulate,
)
from hplan.planner.sim.spec import spec_from_plan
from hplan.runtime.contract.link_model import (
    TP_ALL_REDUCES_PER_LAYER_PASS,
    tp_all_reduce_time_s,
    tp_layer_all_reduce_time_s,
)
from hplan.runtime.contract.plan import GradSyncReport, Plan, Schedule, TpRule, TpStyle

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
NVLINK = 100e9
"""Bytes/s of the hand example's ring channel."""
LATENCY_S = 1e-5
ACTIVATION_BYTES = 8 * 2048 * 1024 * 4
"""One micro-batch's layer output: 8 x 2048 x 1024 float32."""


def test_layer_all_reduce_by_hand() -> None:
    # Two rings of the activation over 4 ranks: each moves 2 * 3/4 of it and pays 2 * 3
    # latencies (Megatron: two all-reduces per layer and pass).
    one_ring_s = 2 * 3 / 4 * ACTIVATION_BYTES / NVLINK + 2 * 3 * LATENCY_S
    got = tp_layer_all_reduce_time_s(4, ACTIVATION_BYTES, NVLINK, LATENCY_S)
    assert TP_ALL_REDUCES_PER_LAYER_PASS == 2
    assert got == pytest.approx(2 * one_ring_s, rel=1e-12)
    assert tp_layer_all_reduce_time_s(1, ACTIVATION_BYTES, NVLINK, LATENCY_S) == 0.0
    assert tp_all_reduce_time_s(2, 0.0, NVLINK, LATENCY_S, 3) == 0.0
    # A degree of 2: a ring moves half the bytes twice, 2 latencies.
    assert tp_all_reduce_time_s(2, 1e9, NVLINK, LATENCY_S) == pytest.approx(1e9 / NVLINK + 2e-5)


def _tp_stage(rank: int, num_layers: int, num_mb: int, degree: int = 4) -> SimStage:
    tp_s = num_layers * tp_layer_all_reduce_time_s(degree, ACTIVATION_BYTES, NVLINK, LATENCY_S)
    return SimStage(
        rank, "gh200", (0.010,) * num_mb, (0.020,) * num_mb, 0.005,
        tp_degree=degree, tp_forward_s=(tp_s,) * num_mb, tp_backward_s=(tp_s,) * num_mb,
    )  # fmt: skip


def test_single_stage_tp_collectives_by_hand() -> None:
    # One stage of 3 layers on a TP group of 4, 2 micro-batches: every pass is its compute
    # and then its 3 layers' collectives; the optimizer step (of the step before) first.
    layer_s = tp_layer_all_reduce_time_s(4, ACTIVATION_BYTES, NVLINK, LATENCY_S)
    stage = _tp_stage(0, 3, 2)
    spec = SimSpec(replicas=(SimReplica((stage,), (), (1, 1)),), schedule=Schedule.GPIPE)
    result = simulate(spec)
    tp_events = [e for e in result.events if e.kind is EventKind.TP_COLLECTIVE]
    assert len(tp_events) == 4
    assert all(e.end_s - e.start_s == pytest.approx(3 * layer_s) for e in tp_events)
    assert result.step_time_s == pytest.approx(0.005 + 2 * (0.010 + 0.020) + 4 * 3 * layer_s)
    (times,) = result.ranks
    assert times.compute_s == pytest.approx(0.065)
    assert times.communication_s == pytest.approx(4 * 3 * layer_s)
    without = simulate(replace(spec, replicas=(SimReplica((_tp_stage(0, 0, 2),), (), (1, 1)),)))
    assert without.step_time_s == pytest.approx(0.065)


def test_send_waits_for_the_tp_collectives() -> None:
    # Stage 0 (TP group of 4, 2 layers) sends its activation once its collectives end.
    layer_s = tp_layer_all_reduce_time_s(4, ACTIVATION_BYTES, NVLINK, LATENCY_S)
    free = SimChannel(math.inf, 0.0)
    stage1 = SimStage(1, "gh200", (0.010,), (0.020,), 0.0)
    spec = SimSpec(
        replicas=(
            SimReplica(
                (replace(_tp_stage(0, 2, 1), optimizer_s=0.0), stage1),
                (SimLink(free, free, (1.0,), (1.0,)),),
                (1,),
            ),
        )
    )
    result = simulate(spec)
    (forward1,) = [e for e in result.events if e.rank == 1 and e.kind is EventKind.FORWARD]
    assert forward1.start_s == pytest.approx(0.010 + 2 * layer_s)
    # ... and stage 0's backward pass, with its collectives, ends the step.
    assert result.step_time_s == pytest.approx(0.010 + 2 * layer_s + 0.030 + 0.020 + 2 * layer_s)


def test_tp_times_are_checked() -> None:
    replica = SimReplica((_tp_stage(0, 1, 2),), (), (1, 1))
    with pytest.raises(ValueError, match="tp_degree 3"):
        simulate(
            SimSpec(replicas=(replace(replica, stages=(replace(replica.stages[0], tp_degree=3),)),))
        )
    with pytest.raises(ValueError, match="one time per micro-batch"):
        bad = replace(replica.stages[0], tp_forward_s=(0.1,))
        simulate(SimSpec(replicas=(replace(replica, stages=(bad,)),)))
    with pytest.raises(ValueError, match="tp_degree 1"):
        bad = replace(replica.stages[0], tp_degree=1)
        simulate(SimSpec(replicas=(replace(replica, stages=(bad,)),)))


def _tp_plan() -> Plan:
    """The datacentre golden plan's two A100s as one stage on a TP group of 2 (one replica),
    with a gradient group recorded among both TP positions' ranks."""
    plan = Plan.load(GOLDEN / "datacentre-a100" / "plan.json")
    lead = replace(plan.ranks[0], tp_degree=2)
    member = replace(lead, rank=1, device=plan.ranks[1].device, tp_rank=1)
    timed = replace(
        plan.report.ranks[0], forward_time_s=0.01, backward_time_s=0.02, optimizer_time_s=0.005
    )
    reports = (timed, replace(timed, rank=1))
    grad_sync = (GradSyncReport(ranks=(0, 1), num_bytes=1_000_000),)
    return replace(
        plan,
        model=replace(
            plan.model, tp_plan=(TpRule(pattern="blocks.*.mlp.fc", style=TpStyle.COLWISE),)
        ),
        global_batch_size=lead.num_samples,
        ranks=(lead, member),
        report=replace(plan.report, ranks=reports, grad_sync=grad_sync),
    )


def test_a_tp_plan_is_simulated_on_its_stage_leads() -> None:
    plan = _tp_plan()
    plan.verify()
    spec = spec_from_plan(plan)
    ((stage,),) = [r.stages for r in spec.replicas]
    assert (stage.rank, stage.tp_degree) == (0, 2)
    # The group of both positions' ranks is not a gradient sync among replicas.
    assert spec.sync_groups == ()
    result = simulate(spec)
    report = plan.report.ranks[0]
    num_mb = plan.ranks[0].num_microbatches
    expected_s = (report.forward_time_s + report.backward_time_s) * num_mb
    assert result.step_time_s == pytest.approx(expected_s + report.optimizer_time_s)
