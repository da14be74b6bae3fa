"""The event-driven simulator: event-order rules, hand-computed timelines, and how it relates
to the cost model (``evaluate.py``)."""

from __future__ import annotations

import math
from collections import defaultdict
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hplan.planner.cost.evaluate import evaluate, replica_pipeline_time_s
from hplan.planner.cost.layout import Layout, ReplicaLayout, StageLayout
from hplan.planner.sim.engine import (
    EventKind,
    SimChannel,
    SimEvent,
    SimLink,
    SimReplica,
    SimSpec,
    SimStage,
    SimSyncGroup,
    SimulationResult,
    simulate,
)
from hplan.planner.sim.spec import spec_from_layout
from hplan.runtime.contract.link_model import BUCKET_CAP_BYTES, exposed_all_reduce_s
from hplan.runtime.contract.plan import Schedule
from hplan.runtime.contract.schedule import build_schedule
from tests.fixtures.problems import Dev, make_problem

FREE = SimChannel(math.inf, 0.0)


def _stage(rank: int, f: float, b: float, m: int, optimizer_s: float = 0.0) -> SimStage:
    return SimStage(rank, "gpu", (f,) * m, (b,) * m, optimizer_s)


def _link(m: int, num_bytes: float = 1.0, channel: SimChannel = FREE) -> SimLink:
    return SimLink(channel, channel, (num_bytes,) * m, (num_bytes,) * m)


def _events(result: SimulationResult, kind: EventKind, rank: int | None = None) -> list[SimEvent]:
    return [e for e in result.events if e.kind is kind and (rank is None or e.rank == rank)]


def _span(result: SimulationResult, rank: int, label: str) -> tuple[float, float]:
    (event,) = [e for e in result.events if e.rank == rank and e.label == label]
    return event.start_s, event.end_s


# --------------------------------------------------------------------------- invariants
def _check_invariants(spec: SimSpec, result: SimulationResult) -> None:
    compute = defaultdict(list)
    for e in result.events:
        if e.kind in (EventKind.FORWARD, EventKind.BACKWARD, EventKind.OPTIMIZER):
            compute[e.rank].append(e)
    for replica in spec.replicas:
        schedule = build_schedule(spec.schedule, len(replica.stages), len(replica.microbatch_sizes))
        for s, stage in enumerate(replica.stages):
            events = sorted(compute[stage.rank], key=lambda e: e.start_s)
            # one computation at a time, and exactly the schedule's actions in its order
            for a, b in pairwise(events):
                assert a.end_s <= b.start_s + 1e-12, (a, b)
            labels = [e.label for e in events if e.kind is not EventKind.OPTIMIZER]
            assert labels == [str(action) for action in schedule[s]]
            done = {e.label: e for e in events}
            for mb in range(len(replica.microbatch_sizes)):
                assert done[f"s{s}.F.mb{mb}"].end_s <= done[f"s{s}.B.mb{mb}"].start_s
    _check_transfers(spec, result)
    _check_totals(result)


def _check_transfers(spec: SimSpec, result: SimulationResult) -> None:
    compute = {
        (e.rank, e.label): e
        for e in result.events
        if e.kind in (EventKind.FORWARD, EventKind.BACKWARD)
    }
    rank_stage = {
        st.rank: (r, s) for r, rep in enumerate(spec.replicas) for s, st in enumerate(rep.stages)
    }
    wires: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for t in _events(result, EventKind.TRANSFER):
        what, mb = t.label.split(" ")[0].split(".")
        src, dst = t.stage, rank_stage[t.peer][1]
        sent = compute[(t.rank, f"s{src}.{what}.{mb}")]
        received = compute[(t.peer, f"s{dst}.{what}.{mb}")]
        assert sent.end_s <= t.start_s + 1e-12  # a message leaves after its action ends
        assert t.end_s <= received.start_s + 1e-12  # ... and arrives before its receiver starts
        link = spec.replicas[t.replica].links[min(src, dst)]
        channel = link.forward if what == "F" else link.backward
        wires[channel.key or f"{t.rank}->{t.peer}"].append((t.start_s, t.end_s - channel.latency_s))
    for spans in wires.values():  # one transfer at a time on each channel
        spans.sort()
        for (_, end_a), (start_b, _) in pairwise(spans):
            assert end_a <= start_b + 1e-9


def _check_totals(result: SimulationResult) -> None:
    assert result.step_time_s == pytest.approx(max(e.end_s for e in result.events))
    for r in result.ranks:
        total = r.compute_s + r.communication_s + r.idle_s
        assert total == pytest.approx(result.step_time_s, rel=1e-9, abs=1e-12)
        assert min(r.compute_s, r.communication_s, r.idle_s) >= -1e-12
    path = result.critical_path
    assert path[0].start_s == 0.0
    assert path[-1].end_s == pytest.approx(result.step_time_s)
    for a, b in pairwise(path):  # each event ends no later than the one it lets go on
        assert a.start_s <= b.start_s + 1e-9 or b.kind is EventKind.WAIT
        queued = (
            a.kind is b.kind is EventKind.TRANSFER
        )  # b left when a's bytes had, before a's latency
        assert a.end_s <= b.end_s + 1e-9 or queued
    for group in {e.label: [] for e in _events(result, EventKind.ALLREDUCE)}:
        spans = {(e.start_s, e.end_s) for e in result.events if e.label == group}
        assert len(spans) == 1  # every member runs the collective at the same time


@st.composite
def _specs(draw: st.DrawFn) -> SimSpec:
    times = st.floats(0.0, 3.0)
    channels = st.builds(
        SimChannel,
        st.sampled_from([math.inf, 0.5, 2.0, 10.0]),
        st.sampled_from([0.0, 0.1, 0.7]),
        st.sampled_from(["", "", "shared"]),
    )
    replicas, rank = [], 0
    for _ in range(draw(st.integers(1, 3))):
        m = draw(st.integers(1, 6))
        num_stages = draw(st.integers(1, 4))
        stages = []
        for _ in range(num_stages):
            fs = tuple(draw(times) for _ in range(m))
            bs = tuple(draw(times) for _ in range(m))
            stages.append(SimStage(rank, "gpu", fs, bs, draw(times)))
            rank += 1
        links = [
            SimLink(
                draw(channels),
                draw(channels),
                tuple(draw(st.sampled_from([0.0, 1.0, 3.0])) for _ in range(m)),
                tuple(draw(st.sampled_from([0.0, 1.0, 3.0])) for _ in range(m)),
            )
            for _ in range(num_stages - 1)
        ]
        replicas.append(SimReplica(tuple(stages), tuple(links), (2,) * m))
    groups = {}
    for _ in range(draw(st.integers(0, 3))):
        members = tuple(sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1, max_size=rank))))
        groups[members] = SimSyncGroup(members, draw(times), 2.0, draw(times))
    schedule = draw(st.sampled_from(list(Schedule)))
    cap = draw(st.sampled_from([None, 0.5, 2.0, BUCKET_CAP_BYTES]))
    return SimSpec(tuple(replicas), tuple(groups.values()), schedule, bucket_cap_bytes=cap)


@settings(max_examples=150, deadline=None)
@given(_specs())
def test_every_event_order_rule_holds_on_random_plans(spec: SimSpec) -> None:
    _check_invariants(spec, simulate(spec))


# --------------------------------------------------------------------------- hand-computed
def test_two_stage_pipeline_gives_the_hand_computed_timeline() -> None:
    # f = 1, b = 2 on both stages; 1 byte over 4 B/s (0.25 s) + 0.5 s latency each way;
    # a tied weight (8 bytes) all-reduced over the same link; optimizer 0.5 s and 0.25 s,
    # the previous step's, before each rank's schedule.
    link = SimChannel(4.0, 0.5)
    spec = SimSpec(
        replicas=(
            SimReplica(
                (_stage(0, 1.0, 2.0, 2, 0.5), _stage(1, 1.0, 2.0, 2, 0.25)),
                (_link(2, 1.0, link),),
                (4, 4),
            ),
        ),
        sync_groups=(SimSyncGroup((0, 1), 8.0, 4.0, 0.5),),
    )
    result = simulate(spec)
    expected = {
        (0, "optimizer"): (0.0, 0.5),
        (1, "optimizer"): (0.0, 0.25),
        (0, "s0.F.mb0"): (0.5, 1.5),
        (0, "s0.F.mb1"): (1.5, 2.5),
        (1, "s1.F.mb0"): (2.25, 3.25),  # waits for the first transfer: 1.5 + 0.25 + 0.5
        (1, "s1.B.mb0"): (3.25, 5.25),
        (1, "s1.F.mb1"): (5.25, 6.25),
        (1, "s1.B.mb1"): (6.25, 8.25),
        (0, "s0.B.mb0"): (6.0, 8.0),
        (0, "s0.B.mb1"): (9.0, 11.0),
        (0, "all-reduce ranks 0,1"): (11.0, 14.0),  # 2 (n-1)/n * 8 / 4 + 2 (n-1) * 0.5 = 3
        (1, "all-reduce ranks 0,1"): (11.0, 14.0),
    }
    for (rank, label), span in expected.items():
        assert _span(result, rank, label) == pytest.approx(span), label
    assert result.step_time_s == pytest.approx(14.0)
    assert result.samples_per_s == pytest.approx(8 / 14.0)
    ranks = {r.rank: r for r in result.ranks}
    assert ranks[0].compute_s == pytest.approx(6.5)  # 2 x (1 + 2) + 0.5
    assert ranks[1].compute_s == pytest.approx(6.25)
    assert ranks[0].communication_s == pytest.approx(3.0 + 0.75 + 0.75)  # all-reduce, 2 grads
    assert result.bottleneck_rank == 1  # 6 s of its compute lie on the critical path, 3.5 s of 0's
    _check_invariants(spec, result)


def test_transfers_on_a_shared_channel_queue_behind_each_other() -> None:
    # Two one-micro-batch pipelines whose forward links share one 1 B/s channel ("uplink"):
    # both first stages finish at 1 s; the second transfer waits for the first.
    uplink = SimChannel(1.0, 0.0, key="uplink")
    free = SimChannel(math.inf, 0.0)
    link = SimLink(uplink, free, (1.0,), (1.0,))
    replicas = tuple(
        SimReplica((_stage(2 * r, 1.0, 1.0, 1), _stage(2 * r + 1, 1.0, 1.0, 1)), (link,), (1,))
        for r in range(2)
    )
    result = simulate(SimSpec(replicas))
    transfers = sorted(
        (e.start_s, e.end_s) for e in _events(result, EventKind.TRANSFER) if e.label.startswith("F")
    )
    assert transfers == [(1.0, 2.0), (2.0, 3.0)]
    assert _span(result, 3, "s1.F.mb0") == (3.0, 4.0)
    assert result.step_time_s == pytest.approx(6.0)  # 3 + F 1 + B 1 + B on stage 0 1


def test_a_boundary_of_zero_bytes_sends_nothing_and_waits_for_nothing() -> None:
    no_grads = SimLink(FREE, FREE, (1.0, 1.0), (0.0, 0.0))
    spec = SimSpec(
        (SimReplica((_stage(0, 1.0, 1.0, 2), _stage(1, 1.0, 5.0, 2)), (no_grads,), (1, 1)),)
    )
    result = simulate(spec)
    assert [e.label for e in _events(result, EventKind.TRANSFER)] == [
        "F.mb0 s0->s1",
        "F.mb1 s0->s1",
    ]
    # stage 0's backwards run as soon as its forwards are done, not after stage 1's
    assert _span(result, 0, "s0.B.mb0") == (2.0, 3.0)


def test_a_send_completes_only_once_the_receiver_posts_its_receive() -> None:
    # After their optimizer steps (1 s), stage 0's slow backward posts the receive of B.mb1
    # at 14 s; stage 1 sent it at 6 s and is done only then, as the runtime's wait_sends.
    spec = SimSpec(
        (
            SimReplica(
                (_stage(0, 1.0, 10.0, 2, 1.0), _stage(1, 1.0, 1.0, 2, 1.0)), (_link(2),), (1, 1)
            ),
        )
    )
    result = simulate(spec)
    assert _span(result, 1, "send completion") == (6.0, 14.0)
    assert {r.rank: r.end_s for r in result.ranks}[1] == 14.0
    assert result.step_time_s == pytest.approx(24.0)


def test_replicas_wait_for_the_slowest_member_of_each_all_reduce() -> None:
    # Two replicas (3 s and 1 s of compute), one 10-byte group over 5 B/s, latency 0.1 s.
    spec = SimSpec(
        (
            SimReplica((_stage(0, 1.0, 2.0, 1, 0.5),), (), (3,)),
            SimReplica((_stage(1, 0.5, 0.5, 1, 0.5),), (), (1,)),
        ),
        (SimSyncGroup((0, 1), 10.0, 5.0, 0.1),),
    )
    result = simulate(spec)
    ring_s = 2.2  # 2 (n-1)/n * 10 B / 5 B/s + 2 (n-1) * 0.1 s, n = 2
    assert _span(result, 1, "wait for all-reduce ranks 0,1") == (1.5, 3.5)  # after 0.5 s optimizers
    assert _span(result, 1, "all-reduce ranks 0,1") == pytest.approx((3.5, 3.5 + ring_s))
    assert result.step_time_s == pytest.approx(0.5 + 3.0 + ring_s)
    ranks = {r.rank: r for r in result.ranks}
    assert ranks[1].idle_s == pytest.approx(2.0)
    assert result.bottleneck_rank == 0
    assert result.bubble_fraction == pytest.approx(2.0 / (2 * result.step_time_s))


def test_the_set_every_replica_shares_is_all_reduced_first_then_the_stage_pairs_overlap() -> None:
    # Two 2-stage replicas numbered as the solver does: stage 0 on ranks 0 and 1, stage 1 on
    # ranks 2 and 3; {0,1,2,3} holds a tied weight. Sorted by ranks alone, {2,3} waited for
    # {0,1} to end before {0,1,2,3} could start.
    spec = SimSpec(
        (
            SimReplica((_stage(0, 1.0, 1.0, 1), _stage(2, 1.0, 1.0, 1)), (_link(1),), (1,)),
            SimReplica((_stage(1, 1.0, 1.0, 1), _stage(3, 1.0, 1.0, 1)), (_link(1),), (1,)),
        ),
        (
            SimSyncGroup((0, 1), 10.0, 5.0, 0.0),
            SimSyncGroup((2, 3), 10.0, 5.0, 0.0),
            SimSyncGroup((0, 1, 2, 3), 10.0, 5.0, 0.0),
        ),
    )
    result = simulate(spec)
    tied = _span(result, 0, "all-reduce ranks 0,1,2,3")
    first, second = (
        _span(result, 0, "all-reduce ranks 0,1"),
        _span(result, 2, "all-reduce ranks 2,3"),
    )
    assert first[0] == second[0] == tied[1]  # both pairs start when the shared set ends
    assert result.step_time_s == pytest.approx(first[1])


# --------------------------------------------------------------------------- overlap
def _two_replicas_sharing(num_bytes: float, bandwidth: float, cap: float | None) -> SimSpec:
    # Two one-stage replicas (f = 1 s, b = 2 s, one micro-batch each) summing num_bytes
    # over a link of `bandwidth` B/s and 0.1 s latency, in buckets of `cap` bytes.
    return SimSpec(
        (
            SimReplica((_stage(0, 1.0, 2.0, 1, 0.5),), (), (1,)),
            SimReplica((_stage(1, 1.0, 2.0, 1, 0.5),), (), (1,)),
        ),
        (SimSyncGroup((0, 1), num_bytes, bandwidth, 0.1),),
        bucket_cap_bytes=cap,
    )


def test_buckets_go_out_during_the_last_backward_and_only_the_rest_is_exposed() -> None:
    # 100 bytes in buckets of 25: rings of 4 x (25 B / 25 B/s + 2 x 0.1 s) = 4.8 s, the last
    # one 1.2 s. After the 0.5 s optimizer step, the first bucket is out a quarter into the
    # 2 s backward, at 2 s.
    result = simulate(_two_replicas_sharing(100.0, 25.0, 25.0))
    assert exposed_all_reduce_s(4.8, 1.5, 1.2) == pytest.approx(3.3)
    for rank in (0, 1):
        assert _span(result, rank, "optimizer") == pytest.approx((0.0, 0.5))
        assert _span(result, rank, "s0.B.mb0") == (1.5, 3.5)
        assert _span(result, rank, "all-reduce ranks 0,1") == pytest.approx((2.0, 6.8))
    times = {r.rank: r for r in result.ranks}
    assert times[0].communication_s == pytest.approx(3.3)  # only what the backward left
    assert times[0].compute_s == pytest.approx(3.5)
    assert times[0].idle_s == pytest.approx(0.0, abs=1e-12)
    # one blocking ring after the schedule: 100 B / 25 B/s + 0.2 s
    after = simulate(_two_replicas_sharing(100.0, 25.0, None))
    assert _span(after, 0, "all-reduce ranks 0,1") == pytest.approx((3.5, 7.7))
    _check_invariants(_two_replicas_sharing(100.0, 25.0, 25.0), result)


def test_when_the_rings_are_faster_than_the_backward_only_the_last_bucket_is_exposed() -> None:
    # rings of 4 x (0.25 + 0.2) = 1.8 s from 2 s would end at 3.8 s, but the last bucket's
    # gradients are final at 3.5 s: 3.5 + 0.45 s.
    result = simulate(_two_replicas_sharing(100.0, 100.0, 25.0))
    assert _span(result, 0, "all-reduce ranks 0,1") == pytest.approx((2.0, 3.95))
    assert result.step_time_s == pytest.approx(3.95)
    path = [e.label for e in result.critical_path]
    assert path[0] == "optimizer"
    assert path[-2:] == ["s0.B.mb0", "all-reduce ranks 0,1"]


def test_a_group_that_fits_one_bucket_starts_when_the_last_backward_ends() -> None:
    result = simulate(_two_replicas_sharing(20.0, 25.0, 25.0))
    assert _span(result, 0, "all-reduce ranks 0,1") == pytest.approx((3.5, 4.5))  # 0.8 + 0.2


# --------------------------------------------------------------------------- vs evaluate.py
def _dp_layout(devices: int, shares: list[int], mbs: int, num_units: int) -> Layout:
    return Layout(
        tuple(
            ReplicaLayout((StageLayout(d, 0, num_units),), mbs, -(-n // mbs), n)
            for d, n in zip(range(devices), shares, strict=True)
        )
    )


@pytest.mark.parametrize("grad_scale", [1.0, 20.0, 200.0])  # one bucket, several, many
@pytest.mark.parametrize("shares", [[8, 8, 8], [12, 8, 4], [20, 2, 2]])
def test_single_stage_data_parallel_equals_the_cost_model_exactly(
    shares: list[int], grad_scale: float
) -> None:
    problem = make_problem(
        [Dev("a", 2.0, 80e9), Dev("a", 1.0, 80e9), Dev("b", 1.5, 80e9)],
        unit_work=[0.01, 0.02, 0.01],
        global_batch_size=sum(shares),
        grad_bytes=[4e6 * grad_scale, 8e6 * grad_scale, 4e6 * grad_scale],
        optimizer_s=0.003,
    )
    layout = _dp_layout(3, shares, 2, problem.num_units)
    simulated = simulate(spec_from_layout(problem, layout)).step_time_s
    assert simulated == pytest.approx(evaluate(problem, layout).step_time_s, rel=1e-12)


@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(2, 1), (2, 5), (4, 8), (3, 2)])
def test_uniform_pipelines_with_free_links_equal_the_cost_model(
    schedule: Schedule, num_stages: int, num_microbatches: int
) -> None:
    # (m + S - 1) (f + b) is both the cost model's formula and the exact 1F1B/GPipe makespan
    # when stages are equal and transfers cost nothing.
    problem = make_problem(
        [Dev("a", 1.0, 80e9)] * num_stages,
        unit_work=[0.01] * num_stages,
        global_batch_size=num_microbatches,
        micro_batch_sizes=(1,),
        cut_bytes_per_sample=1e-9,
        intra_bandwidth=1e30,
        latency_s=0.0,
    )
    stages = tuple(StageLayout(s, s, s + 1) for s in range(num_stages))
    layout = Layout((ReplicaLayout(stages, 1, num_microbatches, num_microbatches),))
    simulated = simulate(spec_from_layout(problem, layout, schedule)).step_time_s
    assert simulated == pytest.approx(evaluate(problem, layout).step_time_s, rel=1e-9)
    assert simulated == pytest.approx((num_microbatches + num_stages - 1) * 0.03, rel=1e-9)


@settings(max_examples=120, deadline=None)
@given(
    work=st.lists(st.floats(0.001, 0.05), min_size=1, max_size=4),
    speeds=st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=4, max_size=4),
    samples=st.integers(1, 12),
    latency_s=st.sampled_from([0.0, 1e-3, 1e-2]),
    schedule=st.sampled_from(list(Schedule)),
)
def test_simulation_never_beats_the_physical_lower_bounds(
    work: list[float], speeds: list[float], samples: int, latency_s: float, schedule: Schedule
) -> None:
    # Whatever the schedule: a stage computes its micro-batches one after another, and the
    # first micro-batch must go through every stage and every link and back.
    num_stages = len(work)
    problem = make_problem(
        [Dev("a" if i < 2 else "b", speeds[i], 80e9) for i in range(4)],
        unit_work=work,
        global_batch_size=samples,
        micro_batch_sizes=(1,),
        cut_bytes_per_sample=2e6,
        latency_s=latency_s,
    )
    stages = tuple(StageLayout(s, s, s + 1) for s in range(num_stages))
    layout = Layout((ReplicaLayout(stages, 1, samples, samples),))
    simulated = simulate(spec_from_layout(problem, layout, schedule)).step_time_s
    costs = evaluate(problem, layout).stages[0]
    busiest_stage = samples * max(c.compute_time_s for c in costs)
    first_round_trip = sum(c.compute_time_s + c.link_time_s for c in costs)
    assert simulated >= max(busiest_stage, first_round_trip) * (1 - 1e-9)
    if num_stages == 1:
        assert simulated == pytest.approx(replica_pipeline_time_s(costs, samples), rel=1e-12)


def test_the_cost_model_charges_the_round_trip_when_latency_bounds_a_pipeline() -> None:
    # Two equal stages of c = 30 ms per micro-batch joined by a link whose round trip is
    # also 30 ms: max(c, link) would be 30 ms, but 1F1B keeps only two micro-batches in
    # flight on stage 0, so each pair waits for a round trip: (30 + 30 + 30) / 2 = 45 ms
    # per micro-batch. Cost model and simulator both see it.
    problem = make_problem(
        [Dev("a", 1.0, 80e9), Dev("b", 1.0, 80e9)],
        unit_work=[0.01, 0.01],
        global_batch_size=16,
        micro_batch_sizes=(1,),
        cut_bytes_per_sample=1.0,
        inter_bandwidth=1e30,
        latency_s=0.015,
    )
    stages = (StageLayout(0, 0, 1), StageLayout(1, 1, 2))
    layout = Layout((ReplicaLayout(stages, 1, 16, 16),))
    predicted = evaluate(problem, layout).step_time_s
    simulated = simulate(spec_from_layout(problem, layout)).step_time_s
    assert predicted == pytest.approx(15 * 0.045 + 0.09)
    assert simulated == pytest.approx(predicted, rel=0.05)
