"""The training loop of one rank: join, build, resume, train, and how the run ends.

:func:`run_rank` joins the job (its threads, the heartbeat watchdog), builds the rank
(``worker.build_rank``), checks that every rank built the same job
(``control/same_job.py``), resumes from the latest checkpoint when asked and runs
:class:`StepLoop`. Each step is a short sequence: the schedule and gradient sync
(``pipeline.py``, ``grad_sync.py``), the optimizer (under ZeRO its shards, ``zero.py``; then
BatchNorm's running statistics averaged, ``running_stats.py``, and any cross-island sync,
``outer_sync.py``), the metrics (``contract/metrics_file.py``, rank
0's progress), the job's agreement after the step (``control/agreement.py``: stop, checkpoint,
shares) and a checkpoint when agreed (``checkpoint.py``). The loop ends in one place, with a
:class:`RunEnd`; :func:`run_rank` turns a stop into its error and exit code there.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from hplan.runtime.contract.errors import (
    ConfigError,
    DivergedError,
    HplanError,
    PeerFailureError,
    PreemptedError,
    ReplannedError,
)
from hplan.runtime.contract.metrics_file import MetricsWriter, StepMetrics
from hplan.runtime.contract.plan import Plan
from hplan.runtime.contract.progress_lines import RunProgress, job_loss
from hplan.runtime.contract.timeline_file import ALL_REDUCE, TimelineEvent, TimelineWriter
from hplan.runtime.executor.checkpoint import Checkpointer, TrainState, latest_checkpoint
from hplan.runtime.executor.control.agreement import Decision, Reading, StepAgreement, StopReason
from hplan.runtime.executor.control.exchange import StepControl, StepFlags
from hplan.runtime.executor.control.liveness import Heartbeat, Preemption
from hplan.runtime.executor.control.rebalance import ShareBalancer
from hplan.runtime.executor.control.same_job import JobIdentity, check_same_job
from hplan.runtime.executor.data import batch_digest, batch_tensors
from hplan.runtime.executor.grad_sync import build_buckets, build_grad_clip, step_groups
from hplan.runtime.executor.machine import CpuShare, CpuShareWatch, set_rank_threads
from hplan.runtime.executor.memory.tensor_parallel import tp_compute, whole
from hplan.runtime.executor.memory.zero import (
    ShardSync,
    build_shard_sync,
    gradient_holders,
    reduce_to_owners,
)
from hplan.runtime.executor.outer.outer_sync import OuterSync, build_outer_sync
from hplan.runtime.executor.pipeline import RankParts, StepRunner
from hplan.runtime.executor.random_ops import DropoutOff
from hplan.runtime.executor.rendezvous import barrier, join_elastic, rank_device, under_torchrun
from hplan.runtime.executor.running_stats import RunningStats, build_running_stats
from hplan.runtime.executor.seams import (
    MemoryMeter,
    Seams,
    default_clock,
    preload_build_modules,
)
from hplan.runtime.executor.worker import (
    RunOptions,
    build_rank,
    init_distributed,
    run_backend,
    training_steps,
)

if TYPE_CHECKING:
    from hplan.runtime.executor.elastic.segment import ElasticSegment

DEFAULT_CHECKPOINT_EVERY_S = 600.0
"""With a checkpoint folder and neither interval given: a checkpoint every 10 minutes."""


def run_rank(
    plan: Plan,
    rank: int,
    model_path: str | Path | None,
    options: RunOptions,
    seams: Seams | None = None,
    elastic: ElasticSegment | None = None,
) -> None:
    """Join the job, build this rank and train ``options.steps`` optimizer steps (None: the
    plan's training length, ``worker.training_steps``).

    Every rank of the plan must call this with the same plan and options (except the rank);
    ``check_same_job`` refuses otherwise, on every rank.

    Args:
        options: checked against ``plan`` once, at the launch (``RunOptions.for_plan``),
            and this machine against the rank (``worker.check_environment``).
        seams: what times and delays the work (default: the real hardware, timed).
        elastic: a segment of an elastic run (``executor/elastic``): the ranks meet in its
            round's store, ``options.steps`` counts the whole run's steps (the checkpoint's
            are done), and its rank 0 records the run's progress after every step.

    Raises:
        HplanError subclasses: see ``worker.build_rank`` and ``worker.init_distributed``; a
            peer that dies or stops answering raises ``PeerFailureError`` (a frozen one ends
            the rank from the heartbeat watchdog); ``PreemptedError`` (exit 143) after a
            SIGTERM, once the checkpoint is saved; ``DivergedError`` on a non-finite loss the
            model file stops on.
    """
    seams = seams or Seams()
    threads = set_rank_threads(plan, rank)
    if rank == 0:
        print(
            f"hplan: rank 0: {threads.describe()}",
            file=sys.stderr,
            flush=True,
        )
    if elastic is None:
        host, port = init_distributed(plan, rank, options)
    else:
        host, port = join_elastic(plan, rank, elastic.start.store, run_backend(plan, options))
    heartbeat = None
    if plan.world_size > 1:
        heartbeat = Heartbeat(
            plan, rank, host=host, port=port, timeout_s=options.heartbeat_timeout_s
        ).start()
    try:
        _train(plan, rank, model_path, options, seams, elastic)
    except PeerFailureError:
        cause = heartbeat.blame() if heartbeat is not None else None
        if heartbeat is not None and rank == 0 and not under_torchrun():
            heartbeat.stop()  # this process hosts the job's store: the others may
            heartbeat.linger()  # still be reading it to name the rank that failed
        if cause is None:
            raise
        raise PeerFailureError(cause) from None  # the rank that stopped, not its symptom
    finally:  # whatever the ending, the others must not take this rank's exit for a freeze
        if heartbeat is not None:
            heartbeat.stop()
    dist.destroy_process_group()


def _train(
    plan: Plan,
    rank: int,
    model_path: str | Path | None,
    options: RunOptions,
    seams: Seams,
    elastic: ElasticSegment | None,
) -> None:
    parts, options, memory = _build_same_job(plan, rank, model_path, options, seams)
    groups = step_groups(plan)
    buckets = build_buckets(plan, rank, parts.params, delay=seams.links, groups=groups)
    buckets = reduce_to_owners(buckets, parts.optimizer)  # ZeRO stage 2
    shards = build_shard_sync(parts.optimizer, groups)
    outer = build_outer_sync(
        plan,
        rank,
        parts.params,
        parts.model_file,
        delay=seams.links,
        keep_resume_state=options.checkpoint_dir is not None,
    )
    checkpointer = _checkpointer(parts, options, outer, shards)
    first_step = _resume(checkpointer, options)
    if elastic is not None:  # --steps counts the run's steps, those done included
        assert options.steps is not None
        if first_step >= options.steps:
            return _already_done(rank, first_step, elastic)
        elastic.begin(first_step, options.steps)
        options = replace(options, steps=options.steps - first_step)
    stats = build_running_stats(plan, rank, parts.stage.canonical_buffers(), groups)
    scheduler = _scheduler(parts, first_step)
    clip = build_grad_clip(plan, rank, parts.params, parts.model_file.max_grad_norm, parts.device)
    held = gradient_holders(parts.optimizer)
    if clip is not None and held is not None:  # ZeRO stage 2: each element on one rank
        clip = replace(clip, counted=held, params=held)
    runner = StepRunner(parts, buckets, seams.clock or default_clock(parts.device), clip, shards)
    step = RankStep(runner, memory, scheduler, outer, options.verify_dir, first_step, stats)
    barrier(rank, "start of training")
    loop = StepLoop(step, options, CheckpointPolicy.of(checkpointer, options), elastic)
    with Preemption() as preemption, _compute_context(parts):
        end = loop.run(preemption)
    # How the run ended, in one place. A stop the job agreed on ends the rank with its
    # error and exit code. An elastic run's re-plan for measured speeds (REPLAN) exits
    # with ReplannedError once the checkpoint is saved: torchrun's agents restart the round
    # and the next segment takes the plan rank 0 chose.
    if end.stop is StopReason.REPLAN and elastic is not None:
        raise ReplannedError(elastic.replanned_line())  # torchrun's agents restart the round
    end.raise_if_stopped()
    barrier(rank, "end of training")
    if elastic is not None:
        elastic.end(end.steps_done)


def _compute_context(parts: RankParts) -> contextlib.AbstractContextManager[None]:
    """Where a TP stage's steps run (``tensor_parallel.tp_compute``); nothing otherwise."""
    if parts.mesh is None:
        return contextlib.nullcontext()
    return tp_compute(parts.device)


def _already_done(rank: int, steps_done: int, elastic: ElasticSegment) -> None:
    """An elastic run restarted after its last step: nothing to train, the run is over."""
    if rank == 0:
        print(
            f"hplan: elastic: the run's {steps_done} steps are done (newest checkpoint); "
            "nothing to train",
            file=sys.stderr,
            flush=True,
        )
    barrier(rank, "end of training")
    elastic.end(steps_done)


def _build_same_job(
    plan: Plan, rank: int, model_path: str | Path | None, options: RunOptions, seams: Seams
) -> tuple[RankParts, RunOptions, MemoryMeter]:
    """Build this rank, then check with every rank that all built the same job; return the
    rank, ``options`` with the steps to train resolved (``worker.training_steps``) and the
    memory meter started just before the build (``seams.MemoryMeter``).

    Raises:
        HplanError: this rank's own build error (after telling the others).
        ConfigError: another rank could not build, or runs another plan, model or settings.
    """
    path = Path(model_path or plan.model.path)
    try:
        model_sha256: str | None = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        model_sha256 = None
    parts: RankParts | None = None
    memory: MemoryMeter | None = None
    failure: HplanError | None = None
    try:
        preload_build_modules()  # the library, not the stage: in the baseline
        memory = MemoryMeter(rank_device(plan, plan.ranks[rank], options.device))
        parts = build_rank(plan, rank, model_path, options, links=seams.links)
        options = replace(
            options, steps=training_steps(plan, options, parts.source.steps_per_epoch)
        )
    except HplanError as exc:
        failure = exc
    identity = JobIdentity(
        plan.digest(),
        plan.section_digests(),
        model_sha256,
        options.settings(),
        None if failure is None else f"{type(failure).__name__}: {failure}",
    )
    try:
        check_same_job(plan, rank, identity)
    except ConfigError:
        if failure is not None:
            raise failure from None  # this rank's own error, with its exit code
        raise
    assert parts is not None and memory is not None
    return parts, options, memory


def _checkpointer(
    parts: RankParts, options: RunOptions, outer: OuterSync | None, shards: ShardSync | None
) -> Checkpointer | None:
    if options.checkpoint_dir is None:
        return None
    state = TrainState(
        parts.plan,
        parts.rank_plan.rank,
        parts.stage,
        parts.params,
        parts.optimizer,
        parts.device,
        parts.scaler,
        outer,
        shards,
    )
    return Checkpointer(
        options.checkpoint_dir,
        state,
        asynchronous=options.async_checkpoints,
        timeout_s=parts.plan.training.process_group_timeout_s,
    )


def _resume(checkpointer: Checkpointer | None, options: RunOptions) -> int:
    """Steps already done: the latest checkpoint's with ``--resume``, else 0.

    Raises:
        ConfigError: the folder holds a checkpoint and ``--resume`` was not given (starting
            over would overwrite it).
    """
    if checkpointer is None:
        return 0
    found = latest_checkpoint(checkpointer.directory)
    if found is None:
        if options.resume and checkpointer.state.rank == 0:
            print(
                f"hplan: --resume: no checkpoint in {checkpointer.directory} yet; starting "
                "at step 0",
                file=sys.stderr,
                flush=True,
            )
        return 0
    if not options.resume:
        raise ConfigError(
            f"{str(checkpointer.directory)!r} holds a checkpoint ({found.name}); pass --resume "
            "to continue from it, or give a fresh --checkpoint-dir"
        )
    return checkpointer.load(found)


def _scheduler(parts: RankParts, first_step: int) -> object | None:
    """The model file's LR scheduler of this rank's optimizer, stepped to ``first_step``."""
    make = parts.model_file.make_scheduler
    if make is None:
        return None
    scheduler = make(parts.optimizer)
    for _ in range(first_step):
        scheduler.step()
    return scheduler


@dataclass(frozen=True)
class RunEnd:
    """How a rank's run ended (:meth:`StepLoop.run`)."""

    steps_done: int
    stop: StopReason | None = None
    """Why the job stopped early (None: every step was trained)."""
    checkpoint: Path | None = None
    """The checkpoint saved at the end (None: none)."""

    def raise_if_stopped(self) -> None:
        """Raise the error of a stop (nothing for a run that trained every step).

        Raises:
            DivergedError: a loss was not finite and the model file stops on it.
            PreemptedError: SIGTERM, after the checkpoint is saved.
        """
        if self.stop is StopReason.DIVERGED:
            raise DivergedError(
                f"stopped after step {self.steps_done - 1}: a loss was not finite "
                "(STOP_ON_NONFINITE_LOSS in the model file); the diverged state was not "
                "saved"
            )
        if self.stop is StopReason.PREEMPTED:
            where = (
                f"checkpoint {self.checkpoint} saved; resume with --resume"
                if self.checkpoint is not None
                else "no --checkpoint-dir, so nothing was saved"
            )
            raise PreemptedError(f"preempted (SIGTERM) after {self.steps_done} steps: {where}")


@dataclass
class CheckpointPolicy:
    """When this rank saves checkpoints, and what the saves cost training.

    Every ``every_steps`` steps (every rank counts), when ``every_s`` seconds have passed
    since the last (rank 0's clock; the job agrees on it), and at the end; asynchronous
    unless ``--sync-checkpoints``. Without a checkpointer every call does nothing.
    """

    checkpointer: Checkpointer | None
    every_steps: int | None = None
    every_s: float | None = None
    saved_s: float = field(default_factory=time.monotonic)
    """When the last periodic save ended (or the run started)."""
    pauses_s: list[float] = field(default_factory=list)
    """How long training waited for each periodic save."""

    @classmethod
    def of(cls, checkpointer: Checkpointer | None, options: RunOptions) -> CheckpointPolicy:
        """The run's intervals (both unset: every ``DEFAULT_CHECKPOINT_EVERY_S``)."""
        every_steps, every_s = options.checkpoint_every_steps, options.checkpoint_every_s
        if every_steps is None and every_s is None:
            every_s = DEFAULT_CHECKPOINT_EVERY_S
        return cls(checkpointer, every_steps, every_s)

    def due_by_clock(self) -> bool:
        """``every_s`` has passed since the last save (what rank 0 asks the job for)."""
        if self.checkpointer is None or self.every_s is None:
            return False
        return time.monotonic() - self.saved_s >= self.every_s

    def written_step(self) -> int:
        """The newest step this rank has written completely (-1: none)."""
        return self.checkpointer.written_step() if self.checkpointer is not None else -1

    def publish(self, written_everywhere: int | None) -> None:
        """Publish the save every rank has written (None: nothing agreed to publish)."""
        if self.checkpointer is not None and written_everywhere is not None:
            self.checkpointer.publish_written(written_everywhere)

    def save(self, steps_done: int) -> None:
        """A periodic save, timed as a pause of training."""
        if self.checkpointer is None:
            return
        start_s = time.monotonic()
        self.checkpointer.save(steps_done)
        self.saved_s = time.monotonic()
        self.pauses_s.append(self.saved_s - start_s)

    def wait(self) -> None:
        """Finish a save in flight."""
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def save_last(self, steps_done: int, rank: int) -> Path | None:
        """The run's last save, waited for; rank 0 says what the saves cost training.
        Returns its folder (None: no checkpoints)."""
        if self.checkpointer is None:
            return None
        start_s = time.monotonic()
        self.checkpointer.save(steps_done)
        self.checkpointer.wait()
        if rank == 0:
            self._report_pauses(time.monotonic() - start_s)
        return self.checkpointer.directory / f"step-{steps_done}"

    def _report_pauses(self, last_s: float) -> None:
        assert self.checkpointer is not None
        mode = "asynchronous" if self.checkpointer.asynchronous else "synchronous"
        periodic = (
            f"{len(self.pauses_s)} periodic ({mode}) paused training "
            f"{statistics.median(self.pauses_s):.3f} s each (median), "
            if self.pauses_s
            else ""
        )
        print(
            f"hplan: checkpoints in {self.checkpointer.directory}: {periodic}the last took "
            f"{last_s:.3f} s",
            file=sys.stderr,
            flush=True,
        )


class RunReporter:
    """What a rank writes as it trains: its metrics and timeline files (``--metrics-dir``)
    and, on rank 0, the progress lines and summary (``contract/progress_lines.py``), whose
    loss is the job's, weighted by the shares each step ran with."""

    def __init__(
        self,
        plan: Plan,
        rank: int,
        options: RunOptions,
        first_step: int,
        balancer: ShareBalancer | None,
    ) -> None:
        assert options.steps is not None  # resolved by _build_same_job
        folder = options.metrics_dir
        self.plan = plan
        self.balancer = balancer
        self.metrics = MetricsWriter(folder, rank) if folder is not None else None
        self.timeline = TimelineWriter(folder, rank) if folder is not None else None
        self.progress = None
        if rank == 0:
            self.progress = RunProgress(
                plan,
                first_step=first_step,
                num_steps=options.steps,
                compare=options.device is None,  # not on the plan's devices: no prediction
            )

    def step(self, record: StepMetrics, events: list[TimelineEvent]) -> None:
        """A step's metrics, timeline and time."""
        if self.metrics is not None:
            self.metrics.write(record)
        if self.timeline is not None:
            self.timeline.write(record.step, events)
        if self.progress is not None:
            self.progress.step_done(record.step, record.step_time_s)

    def loss(self, reading: Reading) -> None:
        """The job's loss of a step, once the agreement brings it (rank 0's progress)."""
        if self.progress is None:
            return
        shares = self.balancer.shares_at(reading.step) if self.balancer is not None else None
        self.progress.loss_known(reading.step, job_loss(self.plan, reading.losses, shares))

    def summary(self) -> None:
        """Rank 0's summary of a run that trained every step."""
        if self.progress is not None:
            self.progress.summary()

    def close(self) -> None:
        """Stop the live line and close the files, however the run ended."""
        if self.progress is not None:
            self.progress.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.timeline is not None:
            self.timeline.close()


class RankStep:
    """One optimizer step of this rank, and its metrics (:func:`_train_step`)."""

    def __init__(
        self,
        runner: StepRunner,
        memory: MemoryMeter,
        scheduler: object | None,
        outer: OuterSync | None,
        verify_dir: Path | None,
        first_step: int,
        stats: RunningStats | None = None,
    ) -> None:
        self.runner, self.memory = runner, memory
        self.scheduler, self.outer = scheduler, outer
        self.stats = stats
        """BatchNorm's running statistics, averaged across replicas after every step."""
        self.verify_dir = verify_dir
        """``--verify``: the run's first step is dumped there (``_dump_verify``)."""
        self.first_step = first_step
        self.cpu_share = CpuShareWatch(runner.parts.plan, runner.parts.rank_plan.rank)

    def run(self, step: int, *, last: bool) -> StepMetrics:
        """Schedule, gradient sync and optimizer of ``step``, then the LR scheduler's step."""
        verify = self.verify_dir if step == self.first_step else None
        record = _train_step(
            self.runner,
            self.memory,
            step,
            verify,
            self.outer,
            last=last,
            cpu_share=self.cpu_share.current(),
            stats=self.stats,
        )
        if self.scheduler is not None:
            self.scheduler.step()  # type: ignore[attr-defined]
        return record

    def after_step(self, step: int, *, last: bool) -> None:
        """The compute clock's work between steps (``ComputeClock.after_step``; a rehearsal
        times a copy of the stage after its first step: not training's memory)."""
        with self.memory.excluded() if step == self.first_step else contextlib.nullcontext():
            self.runner.clock.after_step(step, self.runner, more_steps=not last)


class StepLoop:
    """The steps of one rank, what the job agrees after each, and how the run ends.

    Args:
        step: the work of one step (schedule, gradient sync, optimizer).
        options: the run's options, ``steps`` resolved.
        checkpoints: when to save.
    """

    def __init__(
        self,
        step: RankStep,
        options: RunOptions,
        checkpoints: CheckpointPolicy,
        elastic: ElasticSegment | None = None,
    ) -> None:
        parts = step.runner.parts
        self.elastic = elastic
        assert options.steps is not None  # resolved by _build_same_job
        self.step = step
        self.rank = parts.rank_plan.rank
        self.num_steps = options.steps
        self.stop_on_nonfinite_loss = parts.model_file.stop_on_nonfinite_loss
        self.checkpoints = checkpoints
        self.balancer = (
            ShareBalancer(parts.plan, self.rank)
            if options.rebalance and parts.plan.fixed_shares_reason() is None
            else None
        )
        """The replicas' shares as their measured speeds ask (``rebalance.py``); None: the
        plan's throughout."""
        self.agreement = StepAgreement(
            StepControl(parts.device, parts.plan.num_replicas),
            rank=self.rank,
            checkpointing=checkpoints.checkpointer is not None,
            checkpoint_every_steps=checkpoints.every_steps,
            balancer=self.balancer,
        )
        self.reporter = RunReporter(parts.plan, self.rank, options, step.first_step, self.balancer)

    def run(self, preemption: Preemption) -> RunEnd:
        """Train the run's steps; how the run ended (the loop's one way out)."""
        first_step = self.step.first_step
        last_step = first_step + self.num_steps - 1
        try:
            for step in range(first_step, last_step + 1):
                last = step == last_step
                record = self.step.run(step, last=last)  # schedule, gradient sync, optimizer
                self.reporter.step(record, self.step.runner.timeline.events)  # metrics
                if self.elastic is not None:
                    self.elastic.after_step(step + 1)  # the run's state; joiners let in
                self.step.after_step(step, last=last)  # the compute clock's turn
                decision = self._agree(record, preemption, last=last)  # stop? save? shares?
                if decision.stop is not None:
                    return self._end(decision)  # the job agreed to stop: see _train
                if decision.checkpoint:
                    self.checkpoints.save(decision.steps_done)
            return self._end(self._follow(self.agreement.finish(last_step + 1)))
        finally:
            self.reporter.close()

    def _agree(self, record: StepMetrics, preemption: Preemption, *, last: bool) -> Decision:
        """Post what this rank asks after the step of ``record``; follow what the job
        decided (``control/agreement.py``)."""
        decision = self.agreement.after_step(
            record.step + 1,
            record,
            self._asks(record, preemption),
            written_step=self.checkpoints.written_step(),
            last=last,
        )
        return self._follow(decision)

    def _asks(self, record: StepMetrics, preemption: Preemption) -> StepFlags:
        """What this rank asks of the job after the step of ``record``."""
        flags = StepFlags.NONE
        if preemption.received:
            flags |= StepFlags.PREEMPTED
        if record.loss is not None and not math.isfinite(record.loss):
            print(
                f"hplan: rank {self.rank}: step {record.step}: the loss of replica "
                f"{record.replica} is {record.loss}",
                file=sys.stderr,
                flush=True,
            )
            if self.stop_on_nonfinite_loss:
                flags |= StepFlags.NONFINITE_LOSS
        if self.rank == 0 and self.checkpoints.due_by_clock():
            flags |= StepFlags.CHECKPOINT_DUE
        if self.elastic is not None and self.elastic.wants_replan:
            flags |= StepFlags.REPLAN
        return flags

    def _follow(self, decision: Decision) -> Decision:
        """Take what the agreements read say: the job's losses (rank 0's progress), new
        shares, the checkpoint every rank has written."""
        for reading in decision.readings:
            self.reporter.loss(reading)
            if reading.reshare is not None:
                self._reshare(reading)
        self.checkpoints.publish(decision.written_step)
        return decision

    def _reshare(self, reading: Reading) -> None:
        """Cut the batch at the new shares from the next step on; rank 0 says so."""
        change = reading.reshare
        assert change is not None and self.balancer is not None
        self.step.runner.reshare(self.balancer.offset(), self.balancer.sizes())
        if self.rank == 0:
            print(
                f"hplan: from step {change.first_step}: batch shares "
                f"{_shares_text(reading.shares_before)} -> {_shares_text(change.shares)} (the "
                f"replicas' measured speeds; predicted step {change.predicted_gain * 100:.1f}% "
                "shorter)",
                file=sys.stderr,
                flush=True,
            )

    def _end(self, decision: Decision) -> RunEnd:
        """The run ends after ``decision.steps_done`` steps: the last checkpoint (none of a
        diverged state), rank 0's summary when every step was trained."""
        if decision.stop is StopReason.DIVERGED:
            self.checkpoints.wait()
            return RunEnd(decision.steps_done, decision.stop)
        saved = self.checkpoints.save_last(decision.steps_done, self.rank)
        if decision.stop is None:
            self.reporter.summary()
        return RunEnd(decision.steps_done, decision.stop, saved)


def _shares_text(shares: tuple[int, ...]) -> str:
    return " | ".join(str(n) for n in shares)


def _train_step(
    runner: StepRunner,
    memory: MemoryMeter,
    step: int,
    verify: Path | None,
    outer: OuterSync | None = None,
    *,
    last: bool = False,
    cpu_share: CpuShare,
    stats: RunningStats | None = None,
) -> StepMetrics:
    """One step: the schedule (forward and backward of the micro-batches) and gradient
    sync, the synced gradients unscaled (fp16 loss scaling) and clipped (``MAX_GRAD_NORM``;
    ``grad_sync.GradClip``), the optimizer (under ZeRO its shards, ``zero.py``), then with
    ``outer`` the cross-island syncs due (``last``: the run's last step, which closes them);
    with ``stats`` BatchNorm's running statistics averaged (``running_stats.py``).
    With ``verify`` (a folder), dropout is off for it (``random_ops.py``) and its synced
    gradients and updated parameters are dumped there. ``cpu_share``: the rank's CPU quota
    and threads, recorded with its CPU times."""
    parts = runner.parts
    start_s, start_cpu_s = time.monotonic(), time.process_time()
    parts.comm.reset_times()
    with DropoutOff() if verify is not None else contextlib.nullcontext():
        loss = runner.run(step)  # schedule, then the gradient sync
    runner.unscale_gradients()
    grad_norm = runner.clip_gradients()  # before the dump: the gradients the optimizer uses
    if verify is not None:
        sharded = runner.shards.gathered_grads() if runner.shards is not None else {}
        _dump_verify(parts, verify, "grads", loss, step, sharded)
    stepped = runner.optimizer_step()  # optimizer
    if stats is not None:
        stats.after_step(step, runner.num_samples)
    outer_s = 0.0
    if outer is not None:  # islands that train on their own
        outer_s = outer.after_step(step, last=last)
        for label, span_start_s, span_end_s in outer.spans:
            runner.timeline.add(ALL_REDUCE, label, span_start_s, span_end_s)
    if parts.rank_plan.rank == 0:
        _report_step(parts, step, stepped, grad_norm)
    if verify is not None:
        _dump_verify(parts, verify, "params", loss, step)
    times = runner.finish_step()
    cpu_s = time.process_time() - start_cpu_s
    step_s = time.monotonic() - start_s
    comm = parts.comm.reset_times()
    accounted = (
        times.compute_s + comm.p2p_s + comm.wait_s + times.allreduce_s + times.optimizer_s + outer_s
    )
    rp = parts.rank_plan
    return StepMetrics(
        rank=rp.rank,
        replica=rp.replica,
        stage=rp.stage,
        step=step,
        step_time_s=step_s,
        compute_time_s=times.compute_s,
        p2p_time_s=comm.p2p_s,
        wait_time_s=comm.wait_s,
        allreduce_time_s=times.allreduce_s,
        optimizer_time_s=times.optimizer_s,
        other_time_s=max(0.0, step_s - accounted),
        loss=loss,
        samples=runner.num_samples,
        peak_memory_bytes=memory.peak_bytes(),
        forward_time_s=times.forward_s,
        grad_norm=grad_norm,
        end_unix_time_s=time.time(),
        allreduce_overlapped_time_s=times.allreduce_overlapped_s,
        outer_sync_time_s=outer_s,
        baseline_memory_bytes=memory.baseline_bytes,
        memory_measure=memory.measure,
        compute_cpu_time_s=times.compute_cpu_s,
        optimizer_cpu_time_s=times.optimizer_cpu_s,
        cpu_time_s=cpu_s,
        cpu_quota_cores=cpu_share.quota_cores,
        num_threads=cpu_share.num_threads,
    )


def _report_step(parts: RankParts, step: int, stepped: bool, grad_norm: float | None) -> None:
    """Rank 0's line on stderr for a step that loss scaling skipped, or whose global
    gradient norm (``MAX_GRAD_NORM``) was not finite and so clipped nothing."""
    if not stepped:
        assert parts.scaler is not None
        print(
            f"hplan: step {step} skipped: a gradient was not finite (fp16 loss scaling; every "
            f"rank skipped it); loss scale now {parts.scaler.get_scale():g}",
            file=sys.stderr,
            flush=True,
        )
    elif grad_norm is not None and not math.isfinite(grad_norm):
        print(
            f"hplan: step {step}: the global gradient norm is {grad_norm}, so MAX_GRAD_NORM "
            "clipped nothing",
            file=sys.stderr,
            flush=True,
        )


def _dump_verify(
    parts: RankParts,
    directory: Path,
    kind: str,
    loss: float | None,
    step: int,
    sharded: Mapping[str, Tensor] | None = None,
) -> None:
    """Write ``<dir>/<kind>-rank-<r>.pt``: ``{"tensors": {name: tensor}, "loss", "samples"}``
    with this rank's gradients after the gradient sync (``grads``) or its parameters after
    the optimizer step (``params``, with its buffers as ``"buffers"``), by canonical name.

    With the gradients, the global batch of ``step`` as this rank's data source gives it:
    its fingerprint (``"batch_digest"``, ``data.batch_digest``) on every rank, its tensors
    (``"batch"``, ``data.batch_tensors``) on rank 0. The one-process reference runs on them
    when the model file's data changed after the ranks read it (a ``dataset()`` that reads
    files someone edited during the rehearsal), and refuses ranks that read different data
    (``reference_check.verify_first_step``)."""
    directory.mkdir(parents=True, exist_ok=True)
    payload: dict[str, object] = {"loss": loss, "samples": parts.rank_plan.num_samples}
    if kind == "grads":
        payload["tensors"] = {
            n: whole(p.grad).detach().cpu().clone() for n, p in parts.params if p.grad is not None
        } | {n: g.detach().cpu() for n, g in (sharded or {}).items()}
        batch = parts.source.global_batch(step)
        payload["batch_digest"] = batch_digest(batch)
        if parts.rank_plan.rank == 0:
            payload["batch"] = batch_tensors(batch)
    else:
        payload["tensors"] = {n: whole(p.detach()).cpu().clone() for n, p in parts.params}
        payload["buffers"] = {
            n: b.detach().cpu().clone() for n, b in parts.stage.canonical_buffers()
        }
    torch.save(payload, directory / f"{kind}-rank-{parts.rank_plan.rank}.pt")
