"""One segment of an elastic run: what it writes to the run's shared folder and says.

Plan rank 0 of a segment records it (``segment.json`` in its metrics folder, a ``started``
event), rewrites ``run.json`` after every step (the next segment measures its downtime and the
steps it redoes from it), prints one line after its first step (which node was lost or joined,
which plan took over, the downtime, the steps redone) and lets waiting nodes in
(:func:`admission_due`). Any rank that sees a peer stop records the loss. Plan rank 0 also
watches the ranks' speeds and re-plans for a node that slows (``slowdown.py``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hplan.runtime.contract.elastic import (
    JoinRequest,
    RunEvent,
    RunEventKind,
    RunState,
    SegmentRecord,
    SharedRunDir,
    members_key,
    segment_dir,
    write_segment,
)
from hplan.runtime.contract.metrics_file import StepMetrics
from hplan.runtime.contract.plan import Plan
from hplan.runtime.executor.elastic.slowdown import (
    POLL_S,
    Replan,
    Replanner,
    SpeedWatch,
    decide_restart,
    plan_step_measured_s,
    restart_cost_s,
)
from hplan.runtime.executor.elastic.start import SegmentStart

__all__ = ["PROBATION_S", "ElasticSegment", "admission_due", "probation_s"]

PROBATION_S = 20.0
"""How long a node must wait, alive, before the run takes it in. A node that flaps (joins,
dies, joins...) costs the run two restarts per flap; making it prove at least as long a life
as a restart costs keeps a flapping node's cost bounded, and doubling it for each recent loss
of that node (:func:`probation_s`) drives the cost towards nothing."""
PROBATION_MAX_S = 600.0
RECENT_LOSS_S = 1800.0
"""Losses of a node within this long count against its next probation."""
STALE_REQUEST_S = 5.0
"""A join request not refreshed for this long belongs to a node that left."""
ADMISSION_POLL_S = 1.0
QUIET_S = 60.0
"""After a re-plan not taken (or failed), how long rank 0 waits before it looks again."""
REPLANNED = "re-planned for measured speeds"


def probation_s(
    node: str, events: list[RunEvent], now_unix_s: float, base_s: float = PROBATION_S
) -> float:
    """How long ``node`` must wait before it is taken in: ``base_s``, doubled for each time
    it was lost in the last :data:`RECENT_LOSS_S`, at most :data:`PROBATION_MAX_S` (or
    ``base_s`` where that is longer)."""
    losses = sum(
        1
        for e in events
        if e.kind is RunEventKind.LOST and e.node == node and now_unix_s - e.unix_s < RECENT_LOSS_S
    )
    return min(base_s * 2**losses, max(PROBATION_MAX_S, base_s))


def admission_due(
    requests: list[JoinRequest],
    *,
    members: tuple[str, ...],
    family_digest: str,
    events: list[RunEvent],
    now_unix_s: float,
    probation_base_s: float = PROBATION_S,
) -> list[JoinRequest]:
    """The waiting nodes to take in now: fresh requests of this family that have waited out
    their probation. A request from one of ``members`` is taken too: that node's script was
    started again, so its processes of this round are gone (a node the plan left idle is
    lost without anyone noticing)."""
    del members  # every fresh request is a node outside the round, whatever the round thinks
    due = []
    for request in requests:
        if request.family_digest != family_digest:
            continue
        if now_unix_s - request.beat_unix_s > STALE_REQUEST_S:
            continue
        waited_s = now_unix_s - request.since_unix_s
        if waited_s >= probation_s(request.node, events, now_unix_s, probation_base_s):
            due.append(request)
    return due


@dataclass
class _Previous:
    """The segment before this one, as ``run.json`` left it."""

    state: RunState | None
    cause: str


class ElasticSegment:
    """A segment's bookkeeping on one process (most of it on plan rank 0)."""

    def __init__(
        self, start: SegmentStart, metrics_root: Path | None, probation_s: float = PROBATION_S
    ) -> None:
        self.start = start
        self.probation_s = probation_s
        self.shared: SharedRunDir = start.shared
        self.metrics_root = metrics_root
        self.is_reporter = start.rank == 0
        self._previous: _Previous | None = None
        self._first_step = 0
        self._steps_seen = 0
        self._next_admission_s = 0.0
        self._admitted: set[str] = set()
        self._total_steps: int | None = None
        self._watch: SpeedWatch | None = None
        self._replanner: Replanner | None = None
        self._next_watch_s = 0.0
        self._quiet_until_s = 0.0
        self._detected_window: dict[int, Sequence[StepMetrics]] = {}
        """Each rank's records when the running re-plan began (its speeds are weighed)."""
        self.replan: Replan | None = None
        """The re-plan this segment restarts under (plan rank 0; None: none)."""

    @property
    def metrics_dir(self) -> Path | None:
        """This segment's metrics folder (None: no ``--metrics-dir``)."""
        if self.metrics_root is None:
            return None
        return segment_dir(self.metrics_root, self.start.segment)

    def begin(self, first_step: int, total_steps: int | None = None) -> None:
        """The segment resumed at ``first_step`` of the run's ``total_steps``: record it, and
        watch the ranks' speeds (plan rank 0; with ``total_steps``)."""
        self._first_step = first_step
        self._total_steps = total_steps
        if not self.is_reporter:
            return
        if self.metrics_dir is not None and total_steps is not None:
            start = self.start
            ranks = [r.rank for r in start.plan.ranks]
            self._watch = SpeedWatch(self.metrics_dir, ranks, first_step)
            self._replanner = Replanner(
                start.family, start.family_dir, self.shared, start.members, start.plan_path
            )
        state = self.shared.read_state()
        self._previous = _Previous(state, self._cause(state))
        if state is not None:
            for node in sorted(set(state.members) - set(self.start.members)):
                self.shared.append_event(  # when it was last seen training
                    RunEvent(
                        kind=RunEventKind.LOST,
                        unix_s=state.updated_unix_s,
                        node=node,
                        step=state.steps_done,
                        detail=f"node {node} lost",
                    )
                )
        plan = self.start.plan
        if self.metrics_root is not None:
            folder = write_segment(self.metrics_root, self._record(first_step))
            (folder / "plan.json").write_bytes(self.start.plan_path.read_bytes())
        self.shared.append_event(
            RunEvent(
                kind=RunEventKind.STARTED,
                unix_s=time.time(),
                step=first_step,
                detail=f"segment {self.start.segment}: nodes {members_key(self.start.members)}, "
                f"{plan.world_size} ranks, plan {self.start.plan_path} ({self.start.source}); "
                f"{self._previous.cause}",
            )
        )

    def after_step(self, steps_done: int) -> None:
        """Plan rank 0, after every step: ``run.json``; the takeover line after the first;
        waiting nodes taken in."""
        if not self.is_reporter:
            return
        now_s = time.time()
        self._steps_seen += 1
        self.shared.write_state(self._state(steps_done, now_s))
        if self._steps_seen == 1:
            self._say_takeover(now_s)
        if now_s >= self._next_admission_s:
            self._next_admission_s = now_s + ADMISSION_POLL_S
            self._admit_waiting(now_s, steps_done)
        if now_s >= self._next_watch_s:
            self._next_watch_s = now_s + POLL_S
            self._watch_speeds(now_s, steps_done)

    @property
    def wants_replan(self) -> bool:
        """Plan rank 0 asks the job to stop and restart under :attr:`replan`."""
        return self.replan is not None

    def replanned_line(self) -> str:
        """The one line every rank stops with when the job restarts under a re-plan."""
        plan = self.shared.current_plans().get(members_key(self.start.members))
        return f"{REPLANNED}: restarting under {plan or 'the plan rank 0 chose'}"

    def end(self, steps_done: int) -> None:
        """Plan rank 0, every step trained: the run is over."""
        if not self.is_reporter:
            return
        self.shared.append_event(
            RunEvent(
                kind=RunEventKind.ENDED,
                unix_s=time.time(),
                step=steps_done,
                detail=f"trained {steps_done} steps",
                exit_code=0,
            )
        )

    # ------------------------------------------------------------------------- internals
    def _cause(self, state: RunState | None) -> str:
        if state is None:
            return "start"
        before, now = set(state.members), set(self.start.members)
        parts = [f"node {n} lost" for n in sorted(before - now)]
        parts += [f"node {n} joined" for n in sorted(now - before)]
        if not parts:
            parts = [
                self._replanned_cause()
                if self.start.source.startswith("re-planned")
                else "restarted"
            ]
        return ", ".join(parts)

    def _replanned_cause(self) -> str:
        """``re-planned for measured speeds (c 0.52x)``, from the last ``slowed`` event."""
        slowed = [e for e in self.shared.events() if e.kind is RunEventKind.SLOWED]
        return slowed[-1].detail if slowed else REPLANNED

    def _watch_speeds(self, now_s: float, steps_done: int) -> None:
        """Plan rank 0, every :data:`POLL_S`: look for a slowed rank; re-plan in the
        background; weigh the finished re-plan (``slowdown.py``)."""
        watch, replanner = self._watch, self._replanner
        if watch is None or replanner is None or self.replan is not None:
            return
        result = replanner.take()
        if result is not None:
            self._weigh(result, now_s, steps_done)
            return
        if replanner.running or now_s < self._quiet_until_s:
            return
        slowdown = watch.poll(steps_done)
        if slowdown is None:
            return
        nodes = self._nodes()
        job = f"{slowdown.job_baseline_s * 1e3:.1f} -> {slowdown.job_recent_s * 1e3:.1f} ms"
        print(
            f"hplan: elastic: after step {steps_done - 1}: measured speed "
            f"{slowdown.describe(nodes)} of its baseline, the job's step {job}; re-planning "
            "with the measured speeds (training goes on)",
            file=sys.stderr,
            flush=True,
        )
        self._detected_window = dict(watch.recent)
        replanner.begin(slowdown, watch.recent)

    def _weigh(self, result: Replan | str, now_s: float, steps_done: int) -> None:
        """Restart under ``result`` when its gain over the steps left beats a restart's cost;
        say so in one line either way."""
        assert self._watch is not None and self._total_steps is not None
        self._quiet_until_s = now_s + QUIET_S
        if isinstance(result, str):
            self._say(f"the re-plan for measured speeds failed ({result}); keeping the plan")
            return
        now = self._watch.poll(steps_done)
        if now is None:
            self._say(f"{REPLANNED}: the slowdown is gone; keeping the plan")
            return
        # weighed with the speeds seen at the detection: since then the re-plan's own child
        # processes have competed with training on this node, and would overstate the gain
        window = self._detected_window or self._watch.recent
        decision = decide_restart(
            measured_step_s=min(now.job_recent_s, result.slowdown.job_recent_s),
            predicted_step_s=result.predicted_step_s,
            old_predicted_step_s=plan_step_measured_s(self.start.plan, window),
            steps_left=self._total_steps - steps_done,
            cost_s=restart_cost_s(self.metrics_root),
        )
        shares = _shares(result.plan)
        if not decision.restart:
            self._say(f"{REPLANNED} ({shares}): {decision.describe()}; keeping the plan")
            return
        self.replan = result
        detail = f"{REPLANNED} ({result.slowdown.describe(self._nodes())})"
        self.shared.set_current_plan(self.start.members, result.plan_path)
        for speed in result.slowdown.ranks:
            self.shared.append_event(
                RunEvent(
                    kind=RunEventKind.SLOWED,
                    unix_s=now_s,
                    node=self._nodes().get(speed.rank),
                    step=steps_done,
                    detail=detail,
                )
            )
        self._say(
            f"{detail}: {decision.describe()}; restarting under {result.plan_path} ({shares}) "
            "at the next checkpoint"
        )

    def _nodes(self) -> dict[int, str]:
        return {r.rank: r.node for r in self.start.plan.ranks}

    def _say(self, line: str) -> None:
        print(f"hplan: elastic: {line}", file=sys.stderr, flush=True)

    def _record(self, first_step: int, downtime_s: float | None = None) -> SegmentRecord:
        """The segment's ``segment.json`` (its downtime once its first step is done)."""
        state = self._previous.state if self._previous is not None else None
        return SegmentRecord(
            segment=self.start.segment,
            members=self.start.members,
            plan_path=str(self.start.plan_path),
            plan_digest=self.start.plan.digest(),
            world_size=self.start.plan.world_size,
            first_step=first_step,
            started_unix_s=self.start.started_unix_s,
            predicted_samples_per_s=self.start.plan.report.predicted_samples_per_s,
            cause=self._previous.cause if self._previous is not None else "start",
            downtime_s=downtime_s,
            steps_redone=None if state is None else max(0, state.steps_done - first_step),
        )

    def _state(self, steps_done: int, now_s: float) -> RunState:
        plan = self.start.plan
        return RunState(
            segment=self.start.segment,
            members=self.start.members,
            plan_path=str(self.start.plan_path),
            plan_digest=plan.digest(),
            family_digest=self.start.family.digest(),
            steps_done=steps_done,
            first_step=self._first_step,
            started_unix_s=self.start.started_unix_s,
            updated_unix_s=now_s,
            predicted_samples_per_s=plan.report.predicted_samples_per_s,
        )

    def _say_takeover(self, now_s: float) -> None:
        """One line after the first step of a segment that followed another."""
        previous = self._previous
        if previous is None or previous.state is None:
            return
        state = previous.state
        downtime_s = now_s - state.updated_unix_s
        redone = max(0, state.steps_done - self._first_step)
        if self.metrics_root is not None:
            write_segment(self.metrics_root, self._record(self._first_step, downtime_s))
        print(
            f"hplan: elastic: {previous.cause}; the plan for {members_key(self.start.members)} "
            f"({self.start.source}, {self.start.plan.world_size} ranks) took over at step "
            f"{self._first_step}; downtime {downtime_s:.1f} s (last step before to first step "
            f"after); {redone} step{'s' if redone != 1 else ''} redone",
            file=sys.stderr,
            flush=True,
        )

    def _admit_waiting(self, now_s: float, steps_done: int) -> None:
        """Take in the nodes whose probation is over: they start their agents at once, and
        torchrun's agents restart this round with them (this rank's SIGTERM: it saves a
        checkpoint first)."""
        due = admission_due(
            self.shared.join_requests(),
            members=self.start.members,
            family_digest=self.start.family.digest(),
            events=self.shared.events(),
            now_unix_s=now_s,
            probation_base_s=self.probation_s,
        )
        for request in due:
            if request.node in self._admitted:
                continue
            self._admitted.add(request.node)
            self.shared.admit(request.node)
            waited_s = now_s - request.since_unix_s
            line = (
                f"node {request.node} waited {waited_s:.0f} s; taken in after step "
                f"{steps_done - 1} (the run restarts with it)"
            )
            self.shared.append_event(
                RunEvent(
                    kind=RunEventKind.ADMITTED,
                    unix_s=now_s,
                    node=request.node,
                    step=steps_done,
                    detail=line,
                )
            )
            print(f"hplan: elastic: {line}", file=sys.stderr, flush=True)


def _shares(plan: Plan) -> str:
    """``samples a 5, b 5, c 2``: each node's samples a step under ``plan``."""
    per_node: dict[str, int] = {}
    for rank in plan.ranks:  # one rank of each replica's part: its first stage's lead
        if rank.stage or rank.tp_rank:
            continue
        per_node[rank.node] = per_node.get(rank.node, 0) + rank.num_samples
    return "samples " + ", ".join(f"{node} {n}" for node, n in per_node.items())
