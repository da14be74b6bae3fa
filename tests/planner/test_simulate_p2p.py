"""The simulator's point-to-point modes: ``isend`` (hplan's runtime) and blocking
``send``/``recv`` (``SimSpec.blocking_p2p``, runtimes such as DeepSpeed's pipeline engine)."""

from __future__ import annotations

from itertools import pairwise

import pytest

from hplan.planner.sim.engine import SimChannel, SimLink, SimReplica, SimSpec, SimStage, simulate


def _two_stage(blocking: bool, num_mb: int = 2) -> SimSpec:
    """Two stages, forward and backward 1 s each, messages that take 1 s on the wire."""
    stages = tuple(SimStage(r, "gpu", (1.0,) * num_mb, (1.0,) * num_mb, 0.0) for r in (0, 1))
    channel = SimChannel(1.0, 0.0)
    link = SimLink(channel, channel, (1.0,) * num_mb, (1.0,) * num_mb)
    replica = SimReplica(stages, (link,), (1,) * num_mb)
    return SimSpec(replicas=(replica,), blocking_p2p=blocking)


def test_isend_overlaps_transfers_with_compute() -> None:
    # s0: F0 [0,1] F1 [1,2]; s1: F0 [2,3] B0 [3,4] F1 [4,5] B1 [5,6]; s0: B0 [5,6] B1 [7,8].
    assert simulate(_two_stage(blocking=False)).step_time_s == pytest.approx(8.0)


def test_blocking_p2p_charges_the_wire_time_to_both_ends() -> None:
    # s0: F0 [0,1] send [1,2] F1 [2,3] send [3,4]; s1: F0 [2,3] B0 [3,4] send [4,5],
    # receive F1 posted at 5 takes 1 s -> F1 [6,7] B1 [7,8] send [8,9]; s0: B0 [5,6], B1 [9,10].
    result = simulate(_two_stage(blocking=True))
    assert result.step_time_s == pytest.approx(10.0)
    s1 = [e for e in result.events if e.rank == 1 and e.label == "s1.F.mb1"]
    assert [(e.start_s, e.end_s) for e in s1] == [(6.0, 7.0)]


def test_blocking_p2p_ranks_never_compute_while_sending() -> None:
    result = simulate(_two_stage(blocking=True, num_mb=5))
    for rank in (0, 1):
        spans = sorted(
            (e.start_s, e.end_s)
            for e in result.events
            if e.rank == rank and (e.kind.value in ("forward", "backward") or "send" in e.label)
        )
        for (_, end), (start, _) in pairwise(spans):
            assert start >= end - 1e-12


def test_a_middle_stage_receives_and_sends_at_once_on_full_duplex_links() -> None:
    # Three stages, two micro-batches, 1 s per pass and per message, isend (hplan's runtime).
    # s0: F0 [0,1] F1 [1,2]; link 0 forward: A0 [1,2], A1 [2,3]. s1: F0 [2,3] F1 [3,4];
    # link 1 forward: A0 [3,4], A1 [4,5]. s2: F0 [4,5] B0 [5,6] F1 [6,7] B1 [7,8]; link 1 back:
    # G0 [6,7], G1 [8,9]. s1: B0 [7,8], then at [8,9] it sends G0 to s0 while it receives G1
    # from s2 (two cards' directions, neither waits), B1 [9,10], G1 to s0 [10,11]; s0: B0
    # [9,10], B1 [11,12]. Were a card one queue for both directions, G1 would arrive at 10
    # and the step end at 13.
    stages = tuple(SimStage(r, "gpu", (1.0, 1.0), (1.0, 1.0), 0.0) for r in range(3))
    channel = SimChannel(1.0, 0.0)
    link = SimLink(channel, channel, (1.0, 1.0), (1.0, 1.0))
    spec = SimSpec(replicas=(SimReplica(stages, (link, link), (1, 1)),))
    result = simulate(spec)
    assert result.step_time_s == pytest.approx(12.0)
    s1 = {e.label: (e.start_s, e.end_s) for e in result.events if e.rank == 1}
    assert s1["s1.B.mb1"] == (9.0, 10.0)
