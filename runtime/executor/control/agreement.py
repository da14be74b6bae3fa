"""What the job decides after each step, agreed one step late without a wait.

The ranks agree with one collective (``exchange.StepControl``: a MAX all-reduce of one
small tensor) posted after a step and read after the next, so that no rank waits for it.
:class:`StepAgreement` is the protocol around it: when to post and when to read, and what
the job decided at a step (:class:`Decision`). It holds no model, optimizer or process
group, so it runs on a fake all-reduce in tests.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from enum import StrEnum

from hplan.runtime.contract.metrics_file import StepMetrics
from hplan.runtime.executor.control.exchange import (
    Agreement,
    Post,
    StepControl,
    StepFlags,
    control_interval_steps,
)
from hplan.runtime.executor.control.rebalance import ReplicaSpeed, ShareBalancer, ShareChange

__all__ = ["PROPOSAL_STEPS", "Decision", "Reading", "StepAgreement", "StopReason"]

PROPOSAL_STEPS = 20
"""Rank 0's last steps whose median time sets the interval it proposes."""


class StopReason(StrEnum):
    """Why the job agreed to stop before its last step."""

    PREEMPTED = "preempted"
    """A rank received SIGTERM: save a checkpoint, exit 143."""
    DIVERGED = "diverged"
    """A loss was not finite and the model file stops on it: exit 1, nothing saved."""
    REPLAN = "replan"
    """An elastic run re-planned for measured speeds: save a checkpoint, exit 75
    (``ReplannedError``) so that torchrun's agents restart under the new plan."""


@dataclass(frozen=True, slots=True)
class Reading:
    """One agreement as this rank read it."""

    step: int
    """The step its values were posted after."""
    losses: tuple[float | None, ...]
    """Each replica's mean loss of ``step`` (``exchange.Agreement.losses``)."""
    reshare: ShareChange | None = None
    """The shares every rank takes from the next step on (``rebalance.ShareBalancer``)."""
    shares_before: tuple[int, ...] = ()
    """The shares ``reshare`` replaces."""


@dataclass(frozen=True, slots=True)
class Decision:
    """What the job decided after a step, the same on every rank."""

    steps_done: int
    stop: StopReason | None = None
    """Stop here, and why (None: go on)."""
    checkpoint: bool = False
    """Save a checkpoint of ``steps_done`` steps now (every rank)."""
    written_step: int | None = None
    """The newest checkpoint every rank has written completely, to publish (-1: none yet;
    None: nothing read to publish)."""
    interval_steps: int = 1
    """Steps between exchanges from here on."""
    readings: tuple[Reading, ...] = ()
    """The agreements read at this step, in order: the losses for rank 0's progress."""


_STOP = StepFlags.PREEMPTED | StepFlags.NONFINITE_LOSS | StepFlags.REPLAN


class StepAgreement:
    """One rank's side of the agreement after every step; every rank makes the same calls.

    Call :meth:`after_step` after every step with the flags this rank raised, and
    :meth:`finish` after the run's last step; act on the :class:`Decision` each returns.

    What is posted (``exchange.Post``): the flags held since the last post, the newest
    checkpoint this rank has written, its replica's loss of the step (a last stage), rank
    0's proposed interval (the median of its last ``PROPOSAL_STEPS`` step times, the run's
    first step left out: ``exchange.control_interval_steps``) and its replica's measured
    speed (``ShareBalancer.posted``).

    States and transitions, at each :meth:`after_step` (``n`` = steps done):

    - idle -> posted (an exchange step: ``n`` a multiple of the interval, a checkpoint's
      step by count, or the last step): read what is in flight, then post.
    - posted -> idle (any other step): read what is in flight; a post is read exactly one
      step after it was made, whatever the interval.
    - reading: the interval rank 0 proposed is taken from ``n`` on (1 until then), and the
      shares the agreed speeds ask for (:attr:`Reading.reshare`); every rank reads the same
      values at the same step, so they change together.
    - stop (a read flag PREEMPTED, NONFINITE_LOSS or REPLAN): what is still in flight is
      read and its flags joined; the decision says why (:class:`StopReason`, DIVERGED
      first, then PREEMPTED).
    - checkpoint (``n`` a multiple of ``checkpoint_every_steps``, or CHECKPOINT_DUE read):
      every rank posts this step's flags if it has not, and waits for them (post + collect),
      so that a checkpoint never saves a state a rank found diverged; a stop read there
      wins over the checkpoint.
    - last step: :meth:`finish` reads the last post; its flags decide how the run ends.

    Args:
        control: the all-reduce of the posts.
        rank: this rank (rank 0 proposes the interval).
        checkpointing: the run saves checkpoints (every rank alike).
        checkpoint_every_steps: save one every this many steps (None: by time only).
        balancer: the replicas' shares as measured (None: the plan's throughout).
    """

    def __init__(
        self,
        control: StepControl,
        *,
        rank: int,
        checkpointing: bool = False,
        checkpoint_every_steps: int | None = None,
        balancer: ShareBalancer | None = None,
    ) -> None:
        self._control = control
        self._rank = rank
        self._checkpointing = checkpointing
        self._every_steps = checkpoint_every_steps if checkpointing else None
        self._balancer = balancer
        self._interval = 1
        self._held = StepFlags.NONE
        """This rank's flags since its last post."""
        self._step_times_s: deque[float] = deque(maxlen=PROPOSAL_STEPS)
        self._warmed_up = False

    @property
    def interval_steps(self) -> int:
        """Steps between exchanges now."""
        return self._interval

    def after_step(
        self,
        steps_done: int,
        record: StepMetrics,
        flags: StepFlags = StepFlags.NONE,
        *,
        written_step: int = -1,
        last: bool = False,
    ) -> Decision:
        """Hold ``flags`` (what this rank asks after the step of ``record``), post or read
        as the protocol says (class docstring) and return what the job decided.

        Args:
            steps_done: steps done after this one (``record.step + 1``).
            written_step: the newest checkpoint this rank has written completely.
            last: the run's last step (its values are always posted).

        Raises:
            PeerFailureError: a peer failed.
        """
        self._held |= flags
        self._observe(record)
        due_steps = self._every_steps is not None and steps_done % self._every_steps == 0
        posting = last or due_steps or steps_done % self._interval == 0
        read = self._post(record, written_step) if posting else self._control.finish()
        if read.interval_steps > 0:
            self._interval = read.interval_steps
        readings = _readings(read, self._reshare(read, steps_done))
        if read.flags & _STOP:
            return self._stop(steps_done, read.flags, readings)
        if not self._checkpointing:
            return self._decision(steps_done, readings)
        if not (due_steps or read.flags & StepFlags.CHECKPOINT_DUE):
            return self._decision(steps_done, readings, written_step=read.written_step)
        if not posting:
            self._post(record, written_step)
        now = self._control.finish()
        readings += _readings(now)
        if now.flags & _STOP:
            return self._stop(steps_done, now.flags, readings, written_step=read.written_step)
        return self._decision(steps_done, readings, written_step=read.written_step, save=True)

    def finish(self, steps_done: int) -> Decision:
        """After the run's last step: read the last post; how the job ends.

        Raises:
            PeerFailureError: a peer failed.
        """
        last = self._control.finish()
        return self._decision(steps_done, _readings(last), stop=_stop_reason(last.flags))

    def _observe(self, record: StepMetrics) -> None:
        """Keep the step's time and speed, the run's first step (a warm-up) left out."""
        if self._warmed_up:
            self._step_times_s.append(record.step_time_s)
            if self._balancer is not None:
                self._balancer.observe(record)
        self._warmed_up = True

    def _post(self, record: StepMetrics, written_step: int) -> Agreement:
        """Post the held flags and this step's values; return the previous post's agreement."""
        held, self._held = self._held, StepFlags.NONE
        speed, epoch = None, -1
        if self._balancer is not None:
            epoch = self._balancer.epoch
            if (posted := self._balancer.posted()) is not None:
                replica, measured = posted
                speed = (replica, measured.compute_per_sample_s, measured.fixed_s)
        post = Post(
            flags=held,
            written_step=written_step,
            step=record.step,
            loss=None if record.loss is None else (record.replica, record.loss),
            interval_steps=self._proposal(),
            speed=speed,
            speed_epoch=epoch,
        )
        return self._control.exchange(post)

    def _proposal(self) -> int:
        """Rank 0's steps between exchanges (1 before it has timed a step after the
        first); 0 on other ranks."""
        if self._rank != 0:
            return 0
        if not self._step_times_s:
            return 1
        return control_interval_steps(statistics.median(self._step_times_s))

    def _reshare(self, read: Agreement, next_step: int) -> Reading | None:
        """The shares ``read``'s speeds ask for from ``next_step`` on, as a reading."""
        if self._balancer is None or not read.speeds or read.step is None:
            return None
        before = self._balancer.shares
        speeds = [None if s is None else ReplicaSpeed(*s) for s in read.speeds]
        change = self._balancer.agreed(read.speed_epoch, speeds, next_step)
        if change is None:
            return None
        return Reading(read.step, read.losses, change, before)

    def _stop(
        self,
        steps_done: int,
        flags: StepFlags,
        readings: tuple[Reading, ...],
        *,
        written_step: int | None = None,
    ) -> Decision:
        """Stop after ``steps_done`` steps: read what is still in flight, join its flags."""
        rest = self._control.finish()
        reason = _stop_reason(flags | rest.flags)
        readings += _readings(rest)
        return self._decision(steps_done, readings, stop=reason, written_step=written_step)

    def _decision(
        self,
        steps_done: int,
        readings: tuple[Reading, ...],
        *,
        stop: StopReason | None = None,
        written_step: int | None = None,
        save: bool = False,
    ) -> Decision:
        return Decision(
            steps_done,
            stop=stop,
            checkpoint=save,
            written_step=written_step,
            interval_steps=self._interval,
            readings=readings,
        )


def _readings(read: Agreement, reshared: Reading | None = None) -> tuple[Reading, ...]:
    """``read`` as a reading (none when nothing was posted), with its share change."""
    if reshared is not None:
        return (reshared,)
    if read.step is None:
        return ()
    return (Reading(read.step, read.losses),)


def _stop_reason(flags: StepFlags) -> StopReason | None:
    if flags & StepFlags.NONFINITE_LOSS:
        return StopReason.DIVERGED
    if flags & StepFlags.PREEMPTED:
        return StopReason.PREEMPTED
    if flags & StepFlags.REPLAN:
        return StopReason.REPLAN
    return None
