"""Event-driven simulation of one training step: the timeline a plan predicts.

The cost model prices a pipeline by a closed formula; the simulator replays the step
action by action the way the runtime runs it (``runtime/executor/``: ``pipeline.py``,
``comm.py``, ``grad_sync.py``), so the solver can re-time its best candidates and
``hplan simulate`` can show the timeline. Its input is a small neutral :class:`SimSpec`
(``sim.spec`` builds one from a plan or a solver layout; an importer of external
measurements can build one by hand); :func:`simulate` states the rules it applies. Pure
Python (no torch, no numpy), so that the solver can afford it.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, field

from hplan.planner.cost.sync_cost import device_outer_s, exposed_outer_s
from hplan.planner.sim.ir import (
    COMPUTE_KINDS,
    EventKind,
    RankTimes,
    SimChannel,
    SimEvent,
    SimLink,
    SimOuterSync,
    SimReplica,
    SimSpec,
    SimStage,
    SimSyncGroup,
    SimulationResult,
)
from hplan.runtime.contract.link_model import (
    LinkQueue,
    bucketed_all_reduce_time_s,
    last_bucket_bytes,
    overlap_window_s,
    ring_all_reduce_time_s,
    sync_order,
)
from hplan.runtime.contract.plan import Schedule
from hplan.runtime.contract.schedule import Action, ActionKind, build_schedule

__all__ = [
    "COMPUTE_KINDS",
    "EventKind",
    "RankTimes",
    "Schedule",
    "SimChannel",
    "SimEvent",
    "SimLink",
    "SimOuterSync",
    "SimReplica",
    "SimSpec",
    "SimStage",
    "SimSyncGroup",
    "SimulationResult",
    "critical_path",
    "outer_per_rank_s",
    "outer_time_per_step_s",
    "simulate",
]


# --------------------------------------------------------------------------- engine
_FREE, _DONE = 0, 1
_MsgKey = tuple[int, int, int, int]
"""(replica, 0 forward / 1 backward, sending stage, micro-batch)."""


@dataclass
class _Rank:
    rank: int
    replica: int
    stage: int
    spec: SimStage
    actions: tuple[Action, ...]
    pos: int = 0
    clock_s: float = 0.0
    last: int | None = None
    """Index of this rank's last compute, all-reduce or send-completion event."""
    compute_s: float = 0.0
    comm_s: float = 0.0
    sent: list[_MsgKey] = field(default_factory=list)
    final_backward_pos: int | None = None
    """Position of the rank's last backward action in ``actions``."""
    last_backward: int | None = None
    """Index of the last event of the rank's last backward pass, its TP collectives
    included (its gradients are final then)."""
    last_backward_compute: int | None = None
    """Index of the compute event of that pass."""


@dataclass
class _Message:
    event: int
    posted_s: float
    wire_s: float = 0.0
    """Time the message occupies its channel (bytes / bandwidth)."""


class _Engine:
    """One simulation run; see :func:`simulate` for the rules."""

    def __init__(self, spec: SimSpec) -> None:
        self.spec = spec
        self.events: list[SimEvent] = []
        self.ranks: dict[int, _Rank] = {}
        self.heap: list[tuple[float, int, int, int]] = []
        self.seq = 0
        self.messages: dict[_MsgKey, _Message] = {}
        self.blocked: dict[_MsgKey, int] = {}
        self.recv_posted: dict[_MsgKey, tuple[float, int | None]] = {}
        """When each receive was posted, and the receiver's event that ended then."""
        self.channels: dict[str, LinkQueue] = defaultdict(LinkQueue)
        self.channel_last: dict[str, int] = {}
        for r_idx, replica in enumerate(spec.replicas):
            num_mb = len(replica.microbatch_sizes)
            schedule = build_schedule(spec.schedule, len(replica.stages), num_mb)
            for s_idx, stage in enumerate(replica.stages):
                actions = schedule[s_idx]
                backwards = [i for i, a in enumerate(actions) if a.kind is ActionKind.BACKWARD]
                self.ranks[stage.rank] = _Rank(
                    stage.rank, r_idx, s_idx, stage, actions,
                    final_backward_pos=backwards[-1] if backwards else None,
                )  # fmt: skip

    def run(self) -> None:
        for rank in sorted(self.ranks):
            state = self.ranks[rank]
            self._optimizer(state)  # the previous step's: this step's schedule follows it
            self._push(state.clock_s, _FREE, rank)
        while self.heap:
            time_s, _, what, rank = heapq.heappop(self.heap)
            if what == _FREE:
                self._try_next(self.ranks[rank], time_s)
            else:
                self._finish(self.ranks[rank], time_s)
        stuck = [r.rank for r in self.ranks.values() if r.pos < len(r.actions)]
        assert not stuck, f"schedule deadlocked on ranks {stuck}"  # schedules are validated
        for state in self.ranks.values():
            self._complete_sends(state)
        self._all_reduce()
        self._outer_sync()

    # ----------------------------------------------------------------- helpers
    def _push(self, time_s: float, what: int, rank: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (time_s, self.seq, what, rank))

    def _add(self, event: SimEvent) -> int:
        self.events.append(event)
        return len(self.events) - 1

    def _link(self, rank: _Rank, boundary: int) -> SimLink:
        return self.spec.replicas[rank.replica].links[boundary]

    def _needs(self, rank: _Rank, action: Action) -> _MsgKey | None:
        """The message ``action`` waits for (None: none, or a message of 0 bytes)."""
        num_stages = len(self.spec.replicas[rank.replica].stages)
        mb = action.microbatch
        if action.kind is ActionKind.FORWARD and rank.stage > 0:
            sent = self._link(rank, rank.stage - 1).forward_bytes[mb] > 0
            return (rank.replica, 0, rank.stage - 1, mb) if sent else None
        if action.kind is ActionKind.BACKWARD and rank.stage < num_stages - 1:
            sent = self._link(rank, rank.stage).backward_bytes[mb] > 0
            return (rank.replica, 1, rank.stage + 1, mb) if sent else None
        return None

    # ----------------------------------------------------------------- pipeline phase
    def _try_next(self, rank: _Rank, time_s: float) -> None:
        """Start the rank's next action at ``time_s`` or block until its message arrives."""
        action = rank.actions[rank.pos]
        cause = rank.last
        key = self._needs(rank, action)
        if key is not None:
            self.recv_posted.setdefault(key, (time_s, rank.last))
            message = self.messages.get(key)
            if message is None:
                self.blocked[key] = rank.rank
                rank.clock_s = time_s
                return
            arrival_s = self.events[message.event].end_s
            if self.spec.blocking_p2p:
                arrival_s = max(arrival_s, time_s + message.wire_s)
            if arrival_s > time_s:
                self._wait(rank, key, message, time_s, arrival_s)
                time_s, cause = arrival_s, message.event
        forward = action.kind is ActionKind.FORWARD
        duration_s = (rank.spec.forward_s if forward else rank.spec.backward_s)[action.microbatch]
        kind = EventKind.FORWARD if forward else EventKind.BACKWARD
        rank.last = self._add(
            SimEvent(
                kind, rank.rank, rank.replica, rank.stage, time_s, time_s + duration_s,
                str(action), action.microbatch, None, cause,
            )
        )  # fmt: skip
        compute = rank.last
        rank.compute_s += duration_s
        end_s = self._tp_collectives(rank, action, time_s + duration_s)
        if rank.pos == rank.final_backward_pos:
            rank.last_backward, rank.last_backward_compute = rank.last, compute
        self._push(end_s, _DONE, rank.rank)

    def _tp_collectives(self, rank: _Rank, action: Action, start_s: float) -> float:
        """The TP group's collectives of the pass that ended at ``start_s`` (rule 7);
        returns when the pass ends."""
        forward = action.kind is ActionKind.FORWARD
        times = rank.spec.tp_forward_s if forward else rank.spec.tp_backward_s
        duration_s = times[action.microbatch] if times else 0.0
        if duration_s <= 0:
            return start_s
        rank.last = self._add(
            SimEvent(
                EventKind.TP_COLLECTIVE, rank.rank, rank.replica, rank.stage, start_s,
                start_s + duration_s, f"{action} tp{rank.spec.tp_degree}", action.microbatch,
                None, rank.last,
            )
        )  # fmt: skip
        rank.comm_s += duration_s
        return start_s + duration_s

    def _wait(
        self, rank: _Rank, key: _MsgKey, message: _Message, start_s: float, end_s: float
    ) -> None:
        _, direction, src_stage, mb = key
        what = "F" if direction == 0 else "B"
        self._add(
            SimEvent(
                EventKind.WAIT, rank.rank, rank.replica, rank.stage, start_s, end_s,
                f"wait {what}.mb{mb} from s{src_stage}", mb, None, message.event,
            )
        )  # fmt: skip
        rank.comm_s += end_s - max(start_s, message.posted_s)

    def _finish(self, rank: _Rank, time_s: float) -> None:
        """The rank's current action ends at ``time_s``: post its send, go on."""
        action = rank.actions[rank.pos]
        rank.pos += 1
        rank.clock_s = time_s
        free_s = self._send(rank, action, time_s)
        if free_s > time_s:
            self._blocked_send(rank, action, time_s, free_s)
            if rank.pos < len(rank.actions):
                self._push(free_s, _FREE, rank.rank)
            return
        if rank.pos < len(rank.actions):
            self._try_next(rank, time_s)

    def _blocked_send(self, rank: _Rank, action: Action, start_s: float, end_s: float) -> None:
        """``blocking_p2p``: the sender sits in ``send`` until its message left the wire."""
        rank.last = self._add(
            SimEvent(
                EventKind.WAIT, rank.rank, rank.replica, rank.stage, start_s, end_s,
                f"send {action}", action.microbatch, None, rank.last,
            )
        )  # fmt: skip
        rank.comm_s += end_s - start_s
        rank.clock_s = end_s

    def _send(self, rank: _Rank, action: Action, time_s: float) -> float:
        """Post the message ``action`` produces; return when the sender may go on."""
        replica = self.spec.replicas[rank.replica]
        mb = action.microbatch
        if action.kind is ActionKind.FORWARD and rank.stage < len(replica.stages) - 1:
            link = replica.links[rank.stage]
            channel, num_bytes, dst, direction = link.forward, link.forward_bytes[mb], 1, 0
        elif action.kind is ActionKind.BACKWARD and rank.stage > 0:
            link = replica.links[rank.stage - 1]
            channel, num_bytes, dst, direction = link.backward, link.backward_bytes[mb], -1, 1
        else:
            return time_s
        if num_bytes <= 0:
            return time_s
        key = (rank.replica, direction, rank.stage, mb)
        peer = replica.stages[rank.stage + dst].rank
        queue = channel.key or f"{rank.rank}->{peer}"
        sent = self.channels[queue].send(
            time_s, num_bytes, channel.bandwidth_bytes_per_s, channel.latency_s
        )
        start_s, wire_end_s = sent.start_s, sent.wire_end_s
        cause = rank.last if start_s <= time_s else self.channel_last[queue]
        what = "F" if direction == 0 else "B"
        label = f"{what}.mb{mb} s{rank.stage}->s{rank.stage + dst}"
        event = self._add(
            SimEvent(
                EventKind.TRANSFER, rank.rank, rank.replica, rank.stage, start_s,
                sent.arrival_s, label, mb, peer, cause,
            )
        )  # fmt: skip
        self.channel_last[queue] = event
        self.messages[key] = _Message(event, time_s, wire_end_s - start_s)
        rank.sent.append(key)
        waiting = self.blocked.pop(key, None)
        if waiting is not None:
            self._push(self.ranks[waiting].clock_s, _FREE, waiting)
        return wire_end_s if self.spec.blocking_p2p else time_s

    # ----------------------------------------------------------------- after the schedule
    def _complete_sends(self, rank: _Rank) -> None:
        """``wait_sends``: every message has arrived and its receive has been posted."""
        done_s, on_wire_s, cause = rank.clock_s, rank.clock_s, rank.last
        for key in rank.sent:
            message = self.messages[key]
            arrival_s = self.events[message.event].end_s
            on_wire_s = max(on_wire_s, arrival_s)
            if arrival_s > done_s:
                done_s, cause = arrival_s, message.event
            posted_s, posted_cause = self.recv_posted[key]
            if posted_s > done_s:
                done_s, cause = posted_s, posted_cause
        if done_s <= rank.clock_s:
            return
        rank.last = self._add(
            SimEvent(
                EventKind.WAIT, rank.rank, rank.replica, rank.stage, rank.clock_s, done_s,
                "send completion", None, None, cause,
            )
        )  # fmt: skip
        rank.comm_s += on_wire_s - rank.clock_s
        rank.clock_s = done_s

    def _all_reduce(self) -> None:
        """Groups in ``link_model.sync_order``, one after another on each member, each run
        by all its members at once (:func:`simulate`, rule 4)."""
        ready = {r: self._first_ready(state) for r, state in self.ranks.items()}
        cursor = {r: state.clock_s for r, state in self.ranks.items()}
        for group in sorted(self.spec.sync_groups, key=lambda g: sync_order(g.ranks)):
            members = [self.ranks[r] for r in group.ranks]
            latest = max(members, key=lambda m: (ready[m.rank][0], -m.rank))
            start_s, cause = ready[latest.rank]
            end_s, cause = self._group_end(group, members, start_s, cause)
            label = "all-reduce ranks " + ",".join(str(r) for r in group.ranks)
            for member in members:
                at_s = cursor[member.rank]
                if at_s < start_s:
                    self._add(
                        SimEvent(
                            EventKind.WAIT, member.rank, member.replica, member.stage,
                            at_s, start_s, f"wait for {label}", None, None, cause,
                        )
                    )  # fmt: skip
                event = self._add(
                    SimEvent(
                        EventKind.ALLREDUCE, member.rank, member.replica, member.stage,
                        start_s, end_s, label, None, None, cause,
                    )
                )  # fmt: skip
                if end_s > at_s:
                    member.comm_s += end_s - max(start_s, at_s)
                    member.last = event
                    cursor[member.rank] = end_s
                ready[member.rank] = (end_s, event)
        for rank, state in self.ranks.items():
            state.clock_s = cursor[rank]

    def _first_ready(self, rank: _Rank) -> tuple[float, int | None]:
        """When ``rank`` may start its first all-reduce, and the event that decides it: an
        overlap window before its last backward pass ends, or once its sends are done."""
        if self.spec.bucket_cap_bytes is None or rank.last_backward is None:
            return rank.clock_s, rank.last
        assert rank.last_backward_compute is not None
        backward = self.events[rank.last_backward_compute]
        num_bytes = sum(g.num_bytes for g in self.spec.sync_groups if rank.rank in g.ranks)
        window_s = overlap_window_s(
            backward.end_s - backward.start_s, num_bytes, self.spec.bucket_cap_bytes
        )
        return backward.end_s - window_s, rank.last_backward_compute

    def _group_end(
        self, group: SimSyncGroup, members: list[_Rank], start_s: float, cause: int | None
    ) -> tuple[float, int | None]:
        """When a group started at ``start_s`` ends, and the event that decides it."""
        n, num_bytes = len(members), group.num_bytes
        bandwidth, latency_s = group.bandwidth_bytes_per_s, group.latency_s
        cap = self.spec.bucket_cap_bytes
        if cap is None:
            return start_s + ring_all_reduce_time_s(n, num_bytes, bandwidth, latency_s), cause
        end_s = start_s + bucketed_all_reduce_time_s(n, num_bytes, bandwidth, latency_s, cap)
        last_s = ring_all_reduce_time_s(n, last_bucket_bytes(num_bytes, cap), bandwidth, latency_s)
        passes = [m.last_backward for m in members if m.last_backward is not None]
        if not passes:
            return end_s, cause
        final = max(passes, key=lambda e: (self.events[e].end_s, -e))
        if self.events[final].end_s + last_s > end_s:
            return self.events[final].end_s + last_s, final
        return end_s, cause

    def _optimizer(self, rank: _Rank) -> None:
        duration_s = rank.spec.optimizer_s
        if duration_s <= 0:
            return
        rank.last = self._add(
            SimEvent(
                EventKind.OPTIMIZER, rank.rank, rank.replica, rank.stage, rank.clock_s,
                rank.clock_s + duration_s, "optimizer", None, None, rank.last,
            )
        )  # fmt: skip
        rank.clock_s += duration_s
        rank.compute_s += duration_s

    def _outer_sync(self) -> None:
        """The outer syncs per inner step (:func:`simulate`, rule 6)."""
        outer = self.spec.outer_syncs
        if not outer:
            return
        inner_s = max(state.clock_s for state in self.ranks.values())
        exposed, busy = outer_per_rank_s(outer, inner_s)
        waiting = [r for r in sorted(exposed) if exposed[r] > 0]
        for rank in sorted(busy):
            hidden_s = min(inner_s, max(0.0, busy[rank] - exposed[rank]))
            if hidden_s > 0:
                state = self.ranks[rank]
                self._add(
                    SimEvent(
                        EventKind.OUTER_SYNC_HIDDEN, rank, state.replica, state.stage, 0.0,
                        hidden_s, "outer sync behind compute (per inner step)", None, None,
                        None,
                    )
                )  # fmt: skip
        if not waiting:
            return
        latest = max((self.ranks[r] for r in waiting), key=lambda m: (m.clock_s, -m.rank))
        start_s, cause = latest.clock_s, latest.last
        for rank in waiting:
            state = self.ranks[rank]
            if state.clock_s < start_s:
                self._add(
                    SimEvent(
                        EventKind.WAIT, rank, state.replica, state.stage, state.clock_s,
                        start_s, "wait for the outer sync", None, None, cause,
                    )
                )  # fmt: skip
            state.last = self._add(
                SimEvent(
                    EventKind.OUTER_SYNC, rank, state.replica, state.stage, start_s,
                    start_s + exposed[rank], "outer sync exposed (per inner step)", None,
                    None, cause,
                )
            )  # fmt: skip
            state.comm_s += exposed[rank]
            state.clock_s = start_s + exposed[rank]


def outer_per_rank_s(
    outer: tuple[SimOuterSync, ...], inner_step_s: float
) -> tuple[dict[int, float], dict[int, float]]:
    """(rank -> seconds the outer syncs expose per inner step of ``inner_step_s``, rank ->
    seconds of outer traffic on its link per inner step): each set's T
    (``SimOuterSync.transfer_s``, else a ring all-reduce of its bytes) exposed by
    ``sync_cost.exposed_outer_s``, the sets of a rank combined by
    ``sync_cost.device_outer_s`` (the cost model's rule)."""
    costs: dict[tuple[int, ...], tuple[float, float]] = {}
    for g in outer:
        transfer_s = (
            g.transfer_s
            if g.transfer_s is not None
            else ring_all_reduce_time_s(
                len(g.ranks), g.num_bytes, g.bandwidth_bytes_per_s, g.latency_s
            )
        )
        exposed_s = exposed_outer_s(
            g.mode,
            g.local_steps,
            g.num_fragments,
            g.overlap_steps,
            transfer_s,
            inner_step_s,
            g.largest_share,
            g.codec_s,
        )
        before = costs.get(g.ranks, (0.0, 0.0))
        costs[g.ranks] = (before[0] + exposed_s, before[1] + transfer_s / g.local_steps)
    busy: dict[int, float] = {}
    for ranks, (_, busy_s) in costs.items():
        for r in ranks:
            busy[r] = busy.get(r, 0.0) + busy_s
    return device_outer_s(costs, inner_step_s), busy


def outer_time_per_step_s(outer: tuple[SimOuterSync, ...], inner_step_s: float) -> float:
    """Seconds the outer syncs add to an inner step of ``inner_step_s``: the most any rank
    waits (:func:`outer_per_rank_s`)."""
    exposed, _ = outer_per_rank_s(outer, inner_step_s)
    return max(exposed.values(), default=0.0)


# --------------------------------------------------------------------------- entry point
def simulate(spec: SimSpec) -> SimulationResult:
    """Simulate one optimizer step of ``spec``, the way the runtime runs it.

    Rules:

    1. Each rank runs its stage's actions in schedule order (``runtime/contract/schedule.py``:
       1F1B or GPipe). A forward of micro-batch m on stage s > 0 starts once stage s-1's
       activations of m have arrived; a backward on a stage before the last once stage s+1's
       gradients of m have arrived (a message of 0 bytes is not sent and not waited for).
    2. A finished action posts its send and goes on (``isend``). Each direction of a link is
       a FIFO channel carrying one transfer at a time: a transfer occupies it for ``bytes /
       bandwidth`` and arrives ``latency`` after it leaves (alpha-beta model, Hockney, "The
       communication challenge for MPP", Parallel Computing 1994; the rehearsal's
       ``rehearsal.emulation.EmulatedLink`` applies the same rule). Channels that share a
       ``key`` share one queue. With ``SimSpec.blocking_p2p`` (blocking ``send``/``recv``, as
       in DeepSpeed's pipeline engine) neither end computes while a message moves.
    3. After its last action a rank waits until its sends are complete: arrived, and the
       receiver has posted the matching receive.
    4. Gradients are summed group by group (holder sets in ``link_model.sync_order``), one
       after another on each rank; a group starts when every member is ready and all members
       run it together, a ring all-reduce over its slowest link,
       ``2 (n - 1) / n * bytes / bandwidth + 2 (n - 1) * latency`` (Patarasuk and Yuan, JPDC
       2009). With ``SimSpec.bucket_cap_bytes`` (hplan's runtime, ``grad_sync.py``) it is a
       ring per bucket launched during the rank's last backward pass: a member is ready
       ``link_model.overlap_window_s`` before that pass ends, and the group ends at
       ``max(start + all of its rings, last pass end + last ring)``
       (``link_model.exposed_all_reduce_s`` on a timeline). Without it a member is ready once
       its sends are complete and the group is one blocking ring.
    5. The optimizer step of the step before runs first, then the schedule: the steady state
       of step after step, each rank's optimizer counted with its own schedule (the cost
       model's ``evaluate``; the runtime ends a step with it, the same cycle cut elsewhere).
    6. Under local sync (``SimSpec.outer_syncs``) each holder set's outer sync per inner
       step (``cost.sync_cost``): what overlaps compute (fragments behind tau steps, async)
       is an ``outer sync behind compute`` span beside the step, not waited for; what is
       exposed (a blocking sync, a fragment longer than tau steps, a link busier than the
       step) is an ``outer sync`` span that every rank exposing some starts when the last
       of them ends its step.
    7. A stage run by a TP group (``SimStage.tp_degree`` > 1) is simulated on its lead: the
       members run the same passes in lockstep. A pass's TP collectives
       (``SimStage.tp_forward_s``, ``tp_backward_s``: ring all-reduces over the group's link,
       ``link_model.tp_layer_all_reduce_time_s``) follow its compute as one ``tp all-reduce``
       span, before its send; they are communication, not compute.

    Every rank starts at 0; the step ends when the last rank ends. Per rank the step splits
    into compute (forwards, backwards, optimizer), communication (all-reduce after the rank's
    schedule, TP collectives, and time blocked on a message already on its way) and idle
    time (waiting for a peer to compute: the bubble, or a slower replica). The critical path is the chain of
    events, each the one whose end fixed the next one's start, that ends the step.

    Raises:
        ValueError: the spec is inconsistent (see :meth:`SimSpec.verify`).
    """
    spec.verify()
    engine = _Engine(spec)
    engine.run()
    events = tuple(engine.events)
    step_s = max(r.clock_s for r in engine.ranks.values())
    ranks = tuple(
        RankTimes(
            rank=r.rank,
            replica=r.replica,
            stage=r.stage,
            device=r.spec.device,
            compute_s=r.compute_s,
            communication_s=r.comm_s,
            idle_s=max(0.0, step_s - r.compute_s - r.comm_s),
            end_s=r.clock_s,
        )
        for r in sorted(engine.ranks.values(), key=lambda r: r.rank)
    )
    path = critical_path(events)
    samples = sum(sum(r.microbatch_sizes) for r in spec.replicas)
    idle = sum(r.idle_s for r in ranks)
    return SimulationResult(
        step_time_s=step_s,
        samples_per_s=samples / step_s if step_s > 0 else math.inf,
        ranks=ranks,
        bubble_fraction=idle / (len(ranks) * step_s) if step_s > 0 else 0.0,
        bottleneck_rank=_bottleneck(path, ranks),
        critical_path=path,
        events=events,
        notes=spec.notes,
    )


def critical_path(events: tuple[SimEvent, ...]) -> tuple[SimEvent, ...]:
    """The chain of causes that ends with the last event to end (earliest first)."""
    if not events:
        return ()
    waited = [i for i in range(len(events)) if events[i].kind is not EventKind.OUTER_SYNC_HIDDEN]
    if not waited:
        return ()
    last = max(waited, key=lambda i: (events[i].end_s, i))
    chain = []
    current: int | None = last
    while current is not None:
        chain.append(events[current])
        current = events[current].cause
    return tuple(reversed(chain))


def _bottleneck(path: tuple[SimEvent, ...], ranks: tuple[RankTimes, ...]) -> int:
    on_path: dict[int, float] = defaultdict(float)
    for event in path:
        if event.kind in COMPUTE_KINDS:
            on_path[event.rank] += event.end_s - event.start_s
    if on_path:
        return min(on_path, key=lambda r: (-on_path[r], r))
    return min(ranks, key=lambda r: (-(r.compute_s + r.communication_s), r.rank)).rank
