"""Issue 38: each spanning holder set's outer sync, costed from its own link
(``cost/sync_cost.py``), chosen per set (``solve/sync_choice.py``), simulated as the cost
model counts it (``sim/engine.py``) and written per set into the plan
(``emit/plan_build.py``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from hplan.planner.cost.evaluate import (
    evaluate,
    largest_unit_share,
    outer_ring_times_s,
    set_unit_bytes,
)
from hplan.planner.cost.layout import GroupSync, IslandSync, Layout, ReplicaLayout, StageLayout
from hplan.planner.cost.problem import TiedParams
from hplan.planner.cost.sync_cost import (
    CODEC_DECODE_S_PER_ELEMENT,
    CODEC_ENCODE_S_PER_ELEMENT,
    OuterLink,
    device_outer_s,
    exposed_outer_s,
    fragment_shares,
    outer_transfer_time_s,
)
from hplan.planner.emit.plan_build import with_islands
from hplan.planner.sim.engine import EventKind, simulate
from hplan.planner.sim.spec import spec_from_layout
from hplan.planner.solve.previous import layout_of_plan
from hplan.planner.solve.sync_choice import (
    HIDDEN_SYNC_SHARE,
    LINK_BUSY_SHARE,
    SetCosts,
    SyncRequest,
    SyncRules,
    WireRequest,
    choose_group,
    choose_local_steps,
)
from hplan.runtime.contract.holders import outer_groups, sync_summary
from hplan.runtime.contract.link_model import ring_all_reduce_time_s
from hplan.runtime.contract.plan import Plan, PseudoGradientDtype, SyncMode, wire_payload_bytes
from tests.fixtures.plans import ReplicaShape, make_plan
from tests.fixtures.plans import with_islands as on_islands
from tests.fixtures.problems import GB, Dev, make_problem

F32, BF16, INT8, INT4 = (
    PseudoGradientDtype.FLOAT32,
    PseudoGradientDtype.BFLOAT16,
    PseudoGradientDtype.INT8,
    PseudoGradientDtype.INT4,
)
MLP = Path(__file__).resolve().parents[2] / "examples" / "mlp" / "model.py"


# --------------------------------------------------------------------------- the formulas
def test_exposed_time_per_step_blocking_overlapped_and_async() -> None:
    local = SyncMode.LOCAL_SGD
    assert exposed_outer_s(local, 10, 1, 0, 5.0, 1.0) == pytest.approx(0.5)  # T / H
    # 4 fragments of 2.5 s, each behind 2 steps of 1 s: 0.5 s of each left, 4 x 0.5 / 10
    assert exposed_outer_s(local, 10, 4, 2, 10.0, 1.0) == pytest.approx(0.2)
    assert exposed_outer_s(local, 10, 5, 2, 10.0, 1.0) == 0.0  # 2 s fragments: hidden
    assert exposed_outer_s(SyncMode.ASYNC, 4, 1, 0, 5.0, 1.0) == pytest.approx(0.25)
    assert exposed_outer_s(SyncMode.ALL_REDUCE, 1, 1, 0, 5.0, 1.0) == 0.0
    # the codec runs on the training thread: exposed however the wire time hides
    assert exposed_outer_s(local, 10, 5, 2, 10.0, 1.0, codec_s=2.0) == pytest.approx(0.2)
    assert exposed_outer_s(SyncMode.ASYNC, 4, 1, 0, 5.0, 2.0, codec_s=1.0) == pytest.approx(0.25)


def test_a_fragment_is_no_smaller_than_the_sets_largest_piece() -> None:
    assert fragment_shares(4, 0.1) == (0.25,) * 4
    assert fragment_shares(4, 0.4) == pytest.approx((0.4, 0.2, 0.2, 0.2))
    local = SyncMode.LOCAL_SGD
    # 10 s in 4 fragments behind 3 steps of 1 s: 2.5 s each hide; a 4 s one leaves 1 s
    assert exposed_outer_s(local, 10, 4, 3, 10.0, 1.0) == 0.0
    assert exposed_outer_s(local, 10, 4, 3, 10.0, 1.0, 0.4) == pytest.approx(0.1)


def test_sets_sharing_a_device_share_its_link() -> None:
    # both hidden on their own (exposed 0), but 0.8 + 0.6 s of traffic per 1 s step
    per_device = device_outer_s({(0, 1): (0.0, 0.8), (1, 2): (0.0, 0.6)}, 1.0)
    assert per_device == pytest.approx({0: 0.0, 1: 0.4, 2: 0.0})
    blocking = device_outer_s({(0, 1): (0.3, 0.3), (1, 2): (0.2, 0.2)}, 1.0)
    assert blocking == pytest.approx({0: 0.3, 1: 0.5, 2: 0.2})


def test_a_quantized_sync_is_an_all_gather_among_leads_a_broadcast_and_the_codec() -> None:
    link = OuterLink(
        num_members=5,
        ring_bandwidth_bytes_per_s=1e7,
        ring_latency_s=0.01,
        lead_bandwidth_bytes_per_s=1e7,
        lead_latency_s=0.01,
        island_links=((2, 1e10, 1e-5), (2, 2e10, 1e-5), (1, float("inf"), 0.0)),
    )
    gradient_bytes = 4e8  # 1e8 float32 elements
    n = 10**8
    payload = wire_payload_bytes(INT8, n)
    expected = (
        2 * (payload / 1e7 + 0.01)  # (I - 1) payloads over the leads' link
        + (gradient_bytes / 1e10 + 1e-5)  # the float32 sum to the slowest island's members
        + n * (CODEC_ENCODE_S_PER_ELEMENT + 3 * CODEC_DECODE_S_PER_ELEMENT)
    )
    assert outer_transfer_time_s(INT8, gradient_bytes, link) == pytest.approx(expected)
    ring = ring_all_reduce_time_s(5, gradient_bytes / 2, 1e7, 0.01)
    assert outer_transfer_time_s(BF16, gradient_bytes, link) == pytest.approx(ring)
    assert outer_transfer_time_s(INT4, gradient_bytes, link) < expected


# --------------------------------------------------------------------------- the rules
def _costs(transfer_s: dict[PseudoGradientDtype, float], **kw: float) -> SetCosts:
    return SetCosts(
        transfer_s=transfer_s,
        budget_s=kw.get("budget_s", 1.0),
        max_fragments=int(kw.get("max_fragments", 16)),
        largest_share=kw.get("largest_share", 0.05),
    )


def test_streaming_takes_the_smallest_h_then_the_least_overlap_that_hides() -> None:
    costs = _costs({F32: 6.0, BF16: 3.0})
    rules = SyncRules(request=SyncRequest.STREAMING)
    chosen = choose_group(costs, rules)
    # the link at most half busy: H >= 6 / 0.5; one step hides fragments of <= 1 s: F = 6
    assert chosen == GroupSync(
        mode=SyncMode.LOCAL_SGD, local_steps=12, wire_dtype=F32, num_fragments=6, overlap_steps=1
    )
    assert 6.0 / chosen.local_steps <= LINK_BUSY_SHARE
    # a fragment is no smaller than the largest unit: float32's 40% of 6 s fits behind 3
    # steps at the least, bfloat16's 1.2 s behind 2
    lumpy = choose_group(_costs({F32: 6.0, BF16: 3.0}, largest_share=0.4), rules)
    assert (lumpy.wire_dtype, lumpy.overlap_steps) == (F32, 3)
    bounded = choose_group(
        _costs({F32: 6.0, BF16: 3.0}, largest_share=0.4),
        replace(rules, max_overlap_steps=2),
    )
    # tau <= 2: float32's 2.4 s fragment leaves 0.4 s, within 1% of a step from H = 40 on
    assert (bounded.wire_dtype, bounded.overlap_steps, bounded.local_steps) == (F32, 2, 40)
    tight = choose_group(
        _costs({F32: 6.0, BF16: 3.0}, largest_share=0.4),
        SyncRules(request=SyncRequest.STREAMING, max_local_steps=20, max_overlap_steps=2),
    )
    assert (tight.wire_dtype, tight.overlap_steps, tight.local_steps) == (BF16, 2, 6)


def test_wire_forces_a_format_and_local_sgd_stays_blocking() -> None:
    costs = _costs({INT8: 2.0})
    forced = choose_group(costs, SyncRules(request=SyncRequest.STREAMING, wire=WireRequest.INT8))
    assert forced.wire_dtype is INT8 and forced.overlap_steps >= 1
    assert WireRequest.INT8.formats == (INT8,) and WireRequest.AUTO.formats[0] is F32
    blocking = choose_group(_costs({F32: 2.0}), SyncRules(request=SyncRequest.LOCAL_SGD))
    assert blocking == GroupSync(mode=SyncMode.LOCAL_SGD, local_steps=40)  # 2 s <= 5% of 40


def test_auto_overlaps_only_where_it_exposes_less_than_the_blocking_choice() -> None:
    auto = SyncRules(request=SyncRequest.AUTO)
    # a tiny sync: blocking at H = 1 already costs 0.1%; overlap would gain nothing
    assert choose_group(_costs({F32: 0.001}), auto) == GroupSync(SyncMode.LOCAL_SGD)
    # a big one: blocking exposes 5% of each step, overlapped none
    big = choose_group(_costs({F32: 2.0}), auto)
    assert big.overlap_steps >= 1 and big.mode is SyncMode.LOCAL_SGD
    assert (
        exposed_outer_s(big.mode, big.local_steps, big.num_fragments, big.overlap_steps, 2.0, 1.0)
        <= HIDDEN_SYNC_SHARE
    )


# --------------------------------------------------------------------------- per set
def _pipeline_and_replica(fast: float, slow: float):  # type: ignore[no-untyped-def]
    """Node a: a two-stage pipeline (devices 0, 1); node b: one replica (device 2). Units
    0-1 are held by {0, 2} over ``fast``, units 2-3 by {1, 2} over ``slow``."""
    devices = [Dev("a", 1.0, 8 * GB)] * 2 + [Dev("b", 2.0, 8 * GB)]
    problem = make_problem(
        devices,
        unit_work=[0.01] * 4,
        global_batch_size=32,
        static_bytes=0.2 * GB,
        act_bytes_per_sample=0.01 * GB,
        grad_bytes=0.1 * GB,
        inter_bandwidth=fast,
    )
    bandwidth = problem.bandwidth_bytes_per_s.copy()
    bandwidth[1, 2] = bandwidth[2, 1] = slow
    problem = replace(problem, bandwidth_bytes_per_s=bandwidth)
    layout = Layout(
        replicas=(
            ReplicaLayout((StageLayout(0, 0, 2), StageLayout(1, 2, 4)), 4, 4, 16),
            ReplicaLayout((StageLayout(2, 0, 4),), 4, 4, 16),
        ),
        sync=IslandSync(islands=(("a",), ("b",)), mode=SyncMode.LOCAL_SGD),
    )
    return problem, layout


def test_a_tied_parameter_is_one_piece_of_its_set_counted_once() -> None:
    """GPT-2's embedding, tied to its head: the runtime syncs it once, as one piece, so the
    set's largest piece is its share of the bytes counted once (it was counted twice in the
    total, and a fragment was costed smaller than the runtime's)."""
    devices = [Dev("a", 1.0, 8 * GB), Dev("b", 1.0, 8 * GB)]
    problem = make_problem(devices, unit_work=[0.01] * 3, global_batch_size=8, grad_bytes=1.0)
    problem = replace(problem, tied_params=(TiedParams((0, 2), 2.0),))
    grads = problem.grad_bytes_at(1).copy()
    grads[[0, 2]] += 2.0  # each unit of a tie includes its bytes (TiedParams.num_bytes)
    problem = replace(problem, grad_bytes=grads)
    layout = Layout(
        replicas=tuple(ReplicaLayout((StageLayout(d, 0, 3),), 4, 1, 4) for d in (0, 1)),
        sync=IslandSync(islands=(("a",), ("b",)), mode=SyncMode.LOCAL_SGD),
    )
    (units,) = set_unit_bytes(problem, layout).values()
    assert units == (3.0, 1.0, 1.0)
    assert largest_unit_share(units) == pytest.approx(3 / 5)


def test_two_sets_on_a_1_gbit_and_a_100_mbit_link_get_their_own_sync() -> None:
    problem, layout = _pipeline_and_replica(1.25e8, 1.25e7)
    chosen = choose_local_steps(problem, layout, SyncRules(request=SyncRequest.LOCAL_SGD))
    sync = chosen.sync
    assert sync is not None
    fast, slow = sync.of((0, 2)), sync.of((1, 2))
    assert (fast.local_steps, fast.wire_dtype) != (slow.local_steps, slow.wire_dtype)
    assert slow.local_steps > fast.local_steps or slow.wire_dtype is not F32
    rings = outer_ring_times_s(problem, chosen)
    assert rings[(1, 2)] > rings[(0, 2)]
    streaming = choose_local_steps(problem, layout, SyncRules(request=SyncRequest.STREAMING))
    assert streaming.sync is not None
    assert all(g.overlap_steps >= 1 for g in (streaming.sync.of((0, 2)), streaming.sync.of((1, 2))))
    assert streaming.sync.of((0, 2)) != streaming.sync.of((1, 2))
    assert (
        evaluate(problem, streaming).outer_sync_time_s < evaluate(problem, chosen).outer_sync_time_s
    )


def test_the_simulator_hides_an_overlapped_sync_and_exposes_a_blocking_one() -> None:
    problem, layout = _pipeline_and_replica(1.25e8, 1.25e8)
    inner_s = evaluate(problem, replace(layout, sync=None)).step_time_s
    blocking = replace(
        layout, sync=IslandSync(islands=(("a",), ("b",)), mode=SyncMode.LOCAL_SGD, local_steps=4)
    )
    overlapped = replace(
        layout,
        sync=replace(blocking.sync, local_steps=8, num_fragments=4, overlap_steps=2),  # type: ignore[type-var]
    )
    for local, waits in ((blocking, True), (overlapped, False)):
        ev = evaluate(problem, local)
        result = simulate(spec_from_layout(problem, local))
        assert result.step_time_s == pytest.approx(ev.step_time_s, rel=0.02)
        kinds = {e.kind for e in result.events}
        assert (EventKind.OUTER_SYNC in kinds) is waits
        assert (EventKind.OUTER_SYNC_HIDDEN in kinds) is not waits
    # blocking: every step pays the rings / H; overlapped: none of it
    rings = outer_ring_times_s(problem, blocking)
    assert evaluate(problem, blocking).outer_sync_time_s == pytest.approx(
        rings[(0, 2)] / 4 + rings[(1, 2)] / 4
    )
    assert evaluate(problem, overlapped).outer_sync_time_s == 0.0
    assert evaluate(problem, overlapped).step_time_s == pytest.approx(
        evaluate(
            problem, replace(layout, sync=replace(layout.sync, local_steps=8))
        ).inner_step_time_s  # type: ignore[type-var]
    )
    assert inner_s > 0


def test_the_plan_holds_each_sets_overlap_and_wire_and_loads() -> None:
    plan = make_plan(MLP, [ReplicaShape((1, -1), 2, 4), ReplicaShape((-1,), 2, 4)])
    placed = on_islands(plan, [1, 1], SyncMode.LOCAL_SGD)
    bare = replace(placed, training=replace(placed.training, sync=None))
    spanning = sorted(outer_groups(placed))
    assert len(spanning) >= 2
    first, second = spanning[0], spanning[1]
    sync = IslandSync(
        islands=(("box-a",), ("box-b",)), mode=SyncMode.LOCAL_SGD, local_steps=6
    ).with_groups(
        {
            first: GroupSync(SyncMode.LOCAL_SGD, 8, INT4, num_fragments=2, overlap_steps=3),
            second: GroupSync(SyncMode.LOCAL_SGD, 4, BF16),
        }
    )
    built = with_islands(bare, sync)
    built.verify()
    assert Plan.from_json(built.to_json()) == built
    groups = {g.ranks: g for g in built.training.sync.groups}  # type: ignore[union-attr]
    assert (groups[first].wire_dtype, groups[first].overlap_steps) == (INT4, 3)
    assert (groups[first].num_fragments, groups[first].local_steps) == (2, 8)
    assert (groups[second].wire_dtype, groups[second].local_steps) == (BF16, 4)
    assert "local_sgd H=8 F=2 overlap=3 int4" in sync_summary(built)
    # --previous reads each set's sync back (``solve.previous``)
    stub = SimpleNamespace(
        device_names=tuple(d.name for d in built.cluster.devices),
        device_nodes=tuple(d.node for d in built.cluster.devices),
        unit_names=tuple(u.name for u in built.units),
        global_batch_size=built.global_batch_size,
    )
    again = layout_of_plan(built, stub, Path("plan.json")).sync  # type: ignore[arg-type]
    assert again is not None
    assert all(again.of(ranks) == sync.of(ranks) for ranks in spanning)
