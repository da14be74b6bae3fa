"""The step agreement's protocol (``control/agreement.py``), one test per transition of its
class docstring, driven in one process by a fake MAX all-reduce whose other ranks post what
each test scripts."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from hplan.runtime.contract.metrics_file import StepMetrics
from hplan.runtime.executor.control.agreement import Decision, StepAgreement, StopReason
from hplan.runtime.executor.control.exchange import Post, StepControl, StepFlags, encode_post
from hplan.runtime.executor.control.rebalance import MIN_WINDOW_STEPS, ShareBalancer
from tests.fixtures.plans import ReplicaShape, make_plan, write_model

NONE, PREEMPTED = StepFlags.NONE, StepFlags.PREEMPTED
NONFINITE, DUE = StepFlags.NONFINITE_LOSS, StepFlags.CHECKPOINT_DUE
MODEL = """
import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def sample_batch(batch_size):
    x = torch.randn(batch_size, 4)
    return x, x.sum(dim=1, keepdim=True)


def loss_fn(pred, target):
    return torch.nn.functional.mse_loss(pred, target)
"""


@dataclass
class FakeJob:
    """A MAX all-reduce over this rank and the other ranks of a job, which post
    ``peers(index)`` at the exchange of that index (0 first; None: nothing), read back by
    ``wait``. Records at which step (``now``, set by :func:`drive`) each exchange was posted
    and each was read."""

    num_replicas: int = 1
    peers: Callable[[int], Post | None] = lambda index: None
    now: int = 0
    posted_at: list[int] = field(default_factory=list)
    read_at: list[int] = field(default_factory=list)
    mine: list[list[float]] = field(default_factory=list)
    """What this rank posted at each exchange (``exchange.encode_post``'s values)."""

    def all_reduce(self, tensor: torch.Tensor) -> _Done:
        index = len(self.posted_at)
        self.posted_at.append(self.now)
        self.mine.append(tensor.tolist())
        peer = self.peers(index)
        if peer is not None:
            theirs = torch.tensor(encode_post(peer, self.num_replicas), dtype=torch.float64)
            tensor.copy_(torch.maximum(tensor, theirs))
        return _Done(self)

    def agreement(self, rank: int = 1, **kwargs: object) -> StepAgreement:
        control = StepControl(torch.device("cpu"), self.num_replicas, all_reduce=self.all_reduce)
        return StepAgreement(control, rank=rank, **kwargs)  # type: ignore[arg-type]


@dataclass
class _Done:
    job: FakeJob

    def wait(self) -> None:
        self.job.read_at.append(self.job.now)


def _record(step: int, *, loss: float | None = 1.0, replica: int = 0, samples: int = 12,
            compute_s: float = 0.09, optimizer_s: float = 0.01) -> StepMetrics:  # fmt: skip
    return StepMetrics(
        rank=replica, replica=replica, stage=0, step=step, step_time_s=compute_s + optimizer_s,
        compute_time_s=compute_s, p2p_time_s=0.0, wait_time_s=0.0, allreduce_time_s=0.0,
        optimizer_time_s=optimizer_s, other_time_s=0.0, loss=loss, samples=samples,
        peak_memory_bytes=1,
    )  # fmt: skip


def drive(
    job: FakeJob,
    agreement: StepAgreement,
    num_steps: int,
    flags: dict[int, StepFlags] | None = None,
    *,
    last: bool = False,
    written: int = -1,
    **record: float,
) -> list[Decision]:
    """``after_step`` for steps 1 .. ``num_steps`` (``flags[n]`` after step n; the last one
    the run's last when ``last``), until the job agrees to stop."""
    decisions = []
    for n in range(1, num_steps + 1):
        job.now = n
        decision = agreement.after_step(
            n,
            _record(n - 1, **record),  # type: ignore[arg-type]
            (flags or {}).get(n, NONE),
            written_step=written,
            last=last and n == num_steps,
        )
        decisions.append(decision)
        if decision.stop is not None:
            break
    return decisions


def _at(decisions: list[Decision], steps_done: int) -> Decision:
    (decision,) = [d for d in decisions if d.steps_done == steps_done]
    return decision


# --------------------------------------------------------------------------- idle <-> posted
def test_an_exchange_step_posts_and_every_post_is_read_exactly_one_step_later() -> None:
    # rank 0 proposes 5 steps between exchanges (0.1 s steps, from its second step on)
    job = FakeJob(peers=lambda index: Post(interval_steps=5) if index >= 1 else None)
    decisions = drive(job, job.agreement(rank=1), 12)
    assert job.posted_at == [1, 2, 3, 5, 10]  # idle -> posted: interval 1, then 5
    assert job.read_at == [2, 3, 4, 6, 11]  # posted -> idle: the next step, exchange or not
    assert [d.readings[0].step for d in decisions if d.readings] == [0, 1, 2, 4, 9]
    assert all(not d.readings for d in decisions if d.steps_done not in job.read_at)


def test_rank_0_proposes_its_median_step_and_every_rank_takes_it_when_read() -> None:
    job = FakeJob()
    decisions = drive(job, job.agreement(rank=0), 6)
    proposals = [int(values[2]) for values in job.mine]
    assert proposals == [1, 5, 5, 5]  # nothing timed after the warm-up step yet, then 0.1 s
    assert [d.interval_steps for d in decisions] == [1, 1, 5, 5, 5, 5]  # read after step 3
    other = FakeJob()
    drive(other, other.agreement(rank=1), 3)
    assert [int(values[2]) for values in other.mine] == [0, 0, 0]  # only rank 0 proposes


# --------------------------------------------------------------------------- reading
def test_each_replicas_loss_reaches_every_rank_one_step_later_a_nonfinite_one_as_inf() -> None:
    job = FakeJob(num_replicas=3, peers=lambda index: Post(step=index, loss=(1, math.nan)))
    decisions = drive(job, job.agreement(), 2, loss=2.5)
    assert _at(decisions, 2).readings[0].losses == (2.5, math.inf, None)  # replica 2 posted none
    assert _at(decisions, 2).readings[0].step == 0


def test_the_shares_the_agreed_speeds_ask_for_are_taken_from_the_step_they_are_read(
    tmp_path: Path,
) -> None:
    model = write_model(tmp_path, MODEL)
    shapes = [ReplicaShape((-1,), micro_batch_size=12, num_samples=12)] * 2
    balancer = ShareBalancer(make_plan(model, shapes), 1)
    # replica 0 computes a sample in 0.01 s, twice as fast as this rank's replica 1
    job = FakeJob(num_replicas=2, peers=lambda index: Post(speed=(0, 0.01, 0.01), speed_epoch=0))
    agreement = job.agreement(rank=1, balancer=balancer)
    decisions = drive(job, agreement, MIN_WINDOW_STEPS + 3, compute_s=0.24, replica=1)
    changed = [(d.steps_done, r) for d in decisions for r in d.readings if r.reshare is not None]
    assert len(changed) == 1
    steps_done, reading = changed[0]
    # its own speed first rides the post after MIN_WINDOW_STEPS timed steps (the first is a
    # warm-up), read one step later
    assert steps_done == MIN_WINDOW_STEPS + 2
    assert reading.reshare is not None and reading.reshare.first_step == steps_done
    assert reading.shares_before == (12, 12) and reading.reshare.shares == (15, 9)
    assert balancer.shares == (15, 9) and balancer.epoch == 1
    assert job.mine[-1][-4:-2] == [-math.inf, pytest.approx(0.02)]  # its replica's slot


# --------------------------------------------------------------------------- stop
def test_a_peers_sigterm_stops_the_job_one_step_after_the_exchange_that_carries_it() -> None:
    job = FakeJob(peers=lambda index: Post(flags=PREEMPTED) if index == 1 else None)
    decisions = drive(job, job.agreement(), 10)
    assert decisions[-1].steps_done == 3 and decisions[-1].stop is StopReason.PREEMPTED
    assert all(d.stop is None for d in decisions[:-1])
    assert len(job.read_at) == len(job.posted_at)  # nothing left in flight


def test_a_stop_reads_the_post_in_flight_and_a_divergence_wins_over_a_preemption() -> None:
    job = FakeJob(peers=lambda index: Post(flags=PREEMPTED) if index == 1 else None)
    # this rank's own loss went non-finite in step 3: posted at 3, in flight when the
    # peer's SIGTERM of step 2 is read there
    decisions = drive(job, job.agreement(), 10, {3: NONFINITE})
    assert decisions[-1].steps_done == 3 and decisions[-1].stop is StopReason.DIVERGED
    assert job.read_at == [2, 3, 3]
    assert [r.step for r in decisions[-1].readings] == [1, 2]


def test_rank_0s_replan_stops_the_job_on_every_rank_and_a_preemption_wins_over_it() -> None:
    job = FakeJob(peers=lambda index: Post(flags=StepFlags.REPLAN) if index == 1 else None)
    decisions = drive(job, job.agreement(), 10)
    assert decisions[-1].steps_done == 3 and decisions[-1].stop is StopReason.REPLAN
    assert all(d.stop is None for d in decisions[:-1])
    job = FakeJob(peers=lambda index: Post(flags=StepFlags.REPLAN) if index == 1 else None)
    decisions = drive(job, job.agreement(), 10, {3: PREEMPTED})
    assert decisions[-1].steps_done == 3 and decisions[-1].stop is StopReason.PREEMPTED


# --------------------------------------------------------------------------- checkpoint
def test_a_checkpoint_step_by_count_posts_and_waits_for_its_own_flags() -> None:
    job = FakeJob(peers=lambda index: Post(interval_steps=5) if index >= 1 else None)
    decisions = drive(job, job.agreement(checkpointing=True, checkpoint_every_steps=4), 9)
    assert [d.steps_done for d in decisions if d.checkpoint] == [4, 8]
    assert job.posted_at == [1, 2, 3, 4, 5, 8]  # 4 and 8 although the interval is 5
    assert job.read_at == [2, 3, 4, 4, 6, 8]  # the last post, then its own: none in flight


def test_a_due_checkpoint_read_off_an_exchange_step_posts_this_steps_flags_first() -> None:
    due = {1: Post(interval_steps=5), 3: Post(flags=DUE)}  # rank 0's clock, after step 5
    job = FakeJob(peers=due.get)
    decisions = drive(job, job.agreement(checkpointing=True), 8)
    assert [d.steps_done for d in decisions if d.checkpoint] == [6]
    assert job.posted_at == [1, 2, 3, 5, 6]  # step 6 posts though the interval is 5
    assert job.read_at == [2, 3, 4, 6, 6]


def test_a_stop_found_while_confirming_a_checkpoint_wins_and_nothing_is_saved() -> None:
    due = {1: Post(interval_steps=5), 3: Post(flags=DUE)}
    job = FakeJob(peers=due.get)
    decisions = drive(job, job.agreement(checkpointing=True), 8, {6: NONFINITE})
    assert decisions[-1].steps_done == 6 and decisions[-1].stop is StopReason.DIVERGED
    assert not any(d.checkpoint for d in decisions)
    assert decisions[-1].written_step == -1  # the save every rank wrote is still published


def test_the_checkpoint_every_rank_has_written_is_the_smallest_any_posted() -> None:
    job = FakeJob(peers=lambda index: Post(written_step=4))
    decisions = drive(job, job.agreement(checkpointing=True), 3, written=8)
    assert [d.written_step for d in decisions] == [-1, 4, 4]
    plain = FakeJob(peers=lambda index: Post(flags=DUE, written_step=4))
    decisions = drive(plain, plain.agreement(checkpointing=False), 3, written=8)
    assert [(d.written_step, d.checkpoint) for d in decisions] == [(None, False)] * 3


# --------------------------------------------------------------------------- last step
def test_the_last_step_posts_and_finish_reads_how_the_job_ends() -> None:
    job = FakeJob(peers=lambda index: Post(interval_steps=5) if index >= 1 else None)
    agreement = job.agreement()
    drive(job, agreement, 7, {7: PREEMPTED}, last=True)
    assert job.posted_at[-1] == 7  # the last step posts off the interval
    job.now = 8
    ended = agreement.finish(7)
    assert ended.stop is StopReason.PREEMPTED and [r.step for r in ended.readings] == [6]
    clean = FakeJob()
    agreement = clean.agreement()
    drive(clean, agreement, 3, last=True)
    assert agreement.finish(3).stop is None
    assert agreement.finish(3).readings == ()  # read once
