"""The training loop of one rank: steps, metrics, checkpoints, and how a run ends.

:func:`run_rank` sets the rank's torch threads from its node's usable CPUs
(``machine.set_rank_threads``; rank 0 says how many and why), joins the job, runs the
heartbeat watchdog from then on, builds the rank (``worker.build_rank``), checks that
every rank built the same plan, model and options
(``control.check_same_job``), resumes from the latest checkpoint when asked, and runs its
steps: the micro-batches of this rank's replica go through the pipeline schedule (``pipeline.py``),
boundary tensors travel point-to-point (``comm.py``), gradients are summed among the ranks
holding each parameter (``grad_sync.py``), metrics are written per step
(``contract/metrics_file.py``). The number of steps is ``--steps``, else the plan's
(``worker.training_steps``). Rank 0 prints progress lines and a summary
(``contract/progress_lines.py``); the job's loss reaches it with the agreement below. About
every ``control.CONTROL_PERIOD_S`` (every few steps, as rank 0 proposes from its step time;
at a checkpoint's step and at the last) the ranks agree, one step late, on what to do
(``control.StepControl``):

- a checkpoint every ``checkpoint_every_steps`` steps (every rank counts) or every
  ``checkpoint_every_s`` seconds (rank 0's clock), asynchronous by default, and one at the
  end (``checkpoint.py``);
- SIGTERM (preemption): finish the step, save a checkpoint, exit 143;
- a loss that is not finite: reported on the rank that computed it; the job stops (exit 1,
  no checkpoint of the diverged state) when the model file sets ``STOP_ON_NONFINITE_LOSS``.

With the model file's ``MAX_GRAD_NORM``, the synced (and, under fp16 loss scaling,
unscaled) gradients are clipped to that global norm before the optimizer step
(``grad_sync.GradClip``); the norm before clipping goes into the step's metrics. A
non-finite norm clips nothing: under fp16 loss scaling a non-finite gradient skips the
step on every rank; otherwise rank 0 reports the norm and the step goes on.

ZeRO stage 1 (``training.zero_stage``, ``zero.py``): after the gradients are summed,
unscaled and clipped as always, each rank steps only its shards of the parameters it shares,
and the updated shards then travel to the other holders (part of the step's
``allreduce_time_s``); checkpoints gather and slice the shards' state, so that they keep
their format. Under stage 2 each shard of a shared gradient is reduced to its rank alone
(``zero.ReducedBucket``), so unscaling and clipping act on the shards (each element's
gradient on one rank: counted once in the global norm), and ``--verify`` gathers the
shards for its dump (``zero.ShardSync.gathered_grads``).

Islands that train on their own (``local_sgd``, ``async`` groups): after the optimizer
step, the fragments due sync across islands (``outer_sync.OuterSync.after_step``; the
run's last step closes every fragment); the time it takes is the step's
``outer_sync_time_s``. ``--verify`` refuses such plans (``outer_sync.check_verify``).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import statistics
import sys
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from hplan.runtime.contract.errors import (
    ConfigError,
    DivergedError,
    HplanError,
    PeerFailureError,
    PreemptedError,
)
from hplan.runtime.contract.metrics_file import MetricsWriter, StepMetrics
from hplan.runtime.contract.plan import Plan
from hplan.runtime.contract.progress_lines import RunProgress, job_loss
from hplan.runtime.contract.timeline_file import ALL_REDUCE, TimelineWriter
from hplan.runtime.executor.checkpoint import Checkpointer, TrainState, latest_checkpoint
from hplan.runtime.executor.control import (
    Agreement,
    Heartbeat,
    JobIdentity,
    Preemption,
    StepControl,
    StepFlags,
    check_same_job,
    control_interval_steps,
)
from hplan.runtime.executor.data import batch_digest, batch_tensors
from hplan.runtime.executor.grad_sync import build_buckets, build_grad_clip, step_groups
from hplan.runtime.executor.machine import (
    CpuShare,
    rank_cpu_share,
    set_rank_threads,
)
from hplan.runtime.executor.memory.zero import (
    ShardSync,
    build_shard_sync,
    gradient_holders,
    reduce_to_owners,
)
from hplan.runtime.executor.outer_sync import OuterSync, build_outer_sync, check_verify
from hplan.runtime.executor.pipeline import RankParts, StepRunner
from hplan.runtime.executor.random_ops import DropoutOff
from hplan.runtime.executor.rebalance import ReplicaSpeed, ShareBalancer
from hplan.runtime.executor.rendezvous import barrier, rank_device
from hplan.runtime.executor.seams import (
    MemoryMeter,
    Seams,
    default_clock,
    preload_build_modules,
)
from hplan.runtime.executor.worker import (
    RunOptions,
    build_rank,
    check_environment,
    check_training_length,
    init_distributed,
    training_steps,
)

DEFAULT_CHECKPOINT_EVERY_S = 600.0
"""With a checkpoint folder and neither interval given: a checkpoint every 10 minutes."""


def run_rank(
    plan: Plan,
    rank: int,
    model_path: str | Path | None,
    options: RunOptions,
    seams: Seams | None = None,
) -> None:
    """Join the job, build this rank and train ``options.steps`` optimizer steps (None: the
    plan's training length, ``worker.training_steps``).

    Every rank of the plan must call this with the same plan and options (except the rank);
    ``check_same_job`` refuses otherwise, on every rank.

    Args:
        seams: what times and delays the work (default: the real hardware, timed).

    Raises:
        HplanError subclasses: see ``worker.build_rank`` and ``worker.init_distributed``; a
            peer that dies or stops answering raises ``PeerFailureError`` (a frozen one ends
            the rank from the heartbeat watchdog); ``PreemptedError`` (exit 143) after a
            SIGTERM, once the checkpoint is saved; ``DivergedError`` on a non-finite loss the
            model file stops on.
    """
    check_options(plan, options)
    seams = seams or Seams()
    check_environment(plan, rank, options)
    threads = set_rank_threads(plan, rank)
    if rank == 0:
        print(
            f"hplan: rank 0: {threads.describe()}",
            file=sys.stderr,
            flush=True,
        )
    host, port = init_distributed(plan, rank, options)
    heartbeat = None
    if plan.world_size > 1:
        heartbeat = Heartbeat(
            plan, rank, host=host, port=port, timeout_s=options.heartbeat_timeout_s
        ).start()
    try:
        _train(plan, rank, model_path, options, seams)
    except PeerFailureError:
        cause = heartbeat.blame() if heartbeat is not None else None
        if cause is None:
            raise
        raise PeerFailureError(cause) from None  # the rank that stopped, not its symptom
    finally:  # whatever the ending, the others must not take this rank's exit for a freeze
        if heartbeat is not None:
            heartbeat.stop()
    dist.destroy_process_group()


def _train(
    plan: Plan, rank: int, model_path: str | Path | None, options: RunOptions, seams: Seams
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
    scheduler = _scheduler(parts, first_step)
    clip = build_grad_clip(plan, rank, parts.params, parts.model_file.max_grad_norm, parts.device)
    held = gradient_holders(parts.optimizer)
    if clip is not None and held is not None:  # ZeRO stage 2: each element on one rank
        clip = replace(clip, counted=held, params=held)
    runner = StepRunner(parts, buckets, seams.clock or default_clock(parts.device), clip, shards)
    loop = _Loop(parts, runner, options, checkpointer, scheduler, memory, outer)
    barrier(rank, "start of training")
    with Preemption() as preemption:
        loop.run(first_step, preemption)
    barrier(rank, "end of training")


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


def check_options(plan: Plan, options: RunOptions) -> None:
    """Check the run's options against each other and the plan (steps, checkpoints).

    Raises:
        ConfigError: naming the option and the fix.
    """
    if options.steps is not None and options.steps < 1:
        raise ConfigError(f"--steps is {options.steps}; run at least one step")
    check_training_length(plan, options)
    if options.checkpoint_every_steps is not None and options.checkpoint_every_steps < 1:
        raise ConfigError(f"--checkpoint-every-steps {options.checkpoint_every_steps} must be >= 1")
    every_s = options.checkpoint_every_s
    if every_s is not None and not (math.isfinite(every_s) and every_s > 0):
        raise ConfigError(f"the checkpoint interval {every_s} s must be a finite number > 0")
    if options.checkpoint_dir is None and (options.resume or options.checkpoint_every_steps):
        raise ConfigError("--resume and --checkpoint-every-* need --checkpoint-dir DIR")
    if options.verify_dir is not None:
        check_verify(plan)


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


class _Loop:
    """The steps of one rank, with their checkpoints and their endings (module docstring)."""

    def __init__(
        self,
        parts: RankParts,
        runner: StepRunner,
        options: RunOptions,
        checkpointer: Checkpointer | None,
        scheduler: object | None,
        memory: MemoryMeter,
        outer: OuterSync | None = None,
    ) -> None:
        self.parts, self.runner, self.options = parts, runner, options
        self.checkpointer, self.scheduler = checkpointer, scheduler
        self.memory = memory
        self.outer = outer
        self.control = StepControl(parts.device, parts.plan.num_replicas)
        self.control_every = 1
        """Steps between two exchanges of the step flags: 1 until the ranks read rank 0's
        proposal (``control.control_interval_steps``) in an agreement."""
        self.held = StepFlags.NONE
        """This rank's flags since the last exchange, posted at the next."""
        self.step_times_s: deque[float] = deque(maxlen=_PROPOSAL_STEPS)
        """This rank's last step times, the run's first (a warm-up) left out; rank 0's set
        the interval it proposes."""
        self.warmed_up = False
        self.progress: RunProgress | None = None
        """Rank 0's progress lines (``contract/progress_lines.py``), during :meth:`run`."""
        self.every_steps = options.checkpoint_every_steps
        self.every_s = options.checkpoint_every_s
        if self.every_steps is None and self.every_s is None:
            self.every_s = DEFAULT_CHECKPOINT_EVERY_S
        self.saved_s = time.monotonic()
        self.pauses_s: list[float] = []
        """How long training waited for each periodic checkpoint."""
        self.rank = parts.rank_plan.rank
        self.cpu_share = rank_cpu_share(parts.plan, self.rank)
        self.balancer = (
            ShareBalancer(parts.plan, self.rank)
            if options.rebalance and parts.plan.fixed_shares_reason() is None
            else None
        )
        """The replicas' shares as their measured speeds ask (``rebalance.py``); None: the
        plan's throughout."""

    def _report_pauses(self, last_s: float) -> None:
        """Rank 0 says what the checkpoints cost training (one line on stderr)."""
        if self.rank != 0 or self.checkpointer is None:
            return
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

    def run(self, first_step: int, preemption: Preemption) -> None:
        options = self.options
        writer = MetricsWriter(options.metrics_dir, self.rank) if options.metrics_dir else None
        timeline = TimelineWriter(options.metrics_dir, self.rank) if options.metrics_dir else None
        assert options.steps is not None  # resolved by _build_same_job
        last_step = first_step + options.steps - 1
        if self.rank == 0:
            self.progress = RunProgress(
                self.parts.plan,
                first_step=first_step,
                num_steps=options.steps,
                compare=options.device is None,  # not on the plan's devices: no prediction
            )
        try:
            for step in range(first_step, last_step + 1):
                record = _train_step(
                    self.runner,
                    self.memory,
                    step,
                    verify=options.verify_dir if step == first_step else None,
                    outer=self.outer,
                    last=step == last_step,
                    cpu_share=self.cpu_share,
                )
                if self.scheduler is not None:
                    self.scheduler.step()  # type: ignore[attr-defined]
                if self.balancer is not None and step != first_step:  # not the warm-up
                    self.balancer.observe(record)
                if writer is not None:
                    writer.write(record)
                if timeline is not None:
                    timeline.write(step, self.runner.timeline.events)
                # a rehearsal times a copy of the stage after its first step: not training
                with self.memory.excluded() if step == first_step else contextlib.nullcontext():
                    self.runner.clock.after_step(step, self.runner, more_steps=step < last_step)
                if self.progress is not None:
                    self.progress.step_done(step, record.step_time_s)
                self._after(step + 1, self._flags(record, preemption), record, step == last_step)
            self._finish(last_step + 1, self._collect().flags)
            if self.progress is not None:
                self.progress.summary()
        finally:
            if self.progress is not None:
                self.progress.close()
            if writer is not None:
                writer.close()
            if timeline is not None:
                timeline.close()

    def _flags(self, record: StepMetrics, preemption: Preemption) -> StepFlags:
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
            if self.parts.model_file.stop_on_nonfinite_loss:
                flags |= StepFlags.NONFINITE_LOSS
        due_s = self.every_s is not None and time.monotonic() - self.saved_s >= self.every_s
        if self.rank == 0 and self.checkpointer is not None and due_s:
            flags |= StepFlags.CHECKPOINT_DUE
        return flags

    def _post(self, record: StepMetrics) -> Agreement:
        """Post the flags held since the last exchange, this step's loss (on a last stage)
        and rank 0's proposed interval; return the previous exchange's agreement."""
        written = self.checkpointer.written_step() if self.checkpointer is not None else -1
        loss = None if record.loss is None else (record.replica, record.loss)
        held, self.held = self.held, StepFlags.NONE
        speed, epoch = None, -1
        if self.balancer is not None:
            epoch = self.balancer.epoch
            if (posted := self.balancer.posted()) is not None:
                replica, measured = posted
                speed = (replica, measured.compute_per_sample_s, measured.fixed_s)
        return self.control.exchange(
            held,
            written,
            step=record.step,
            loss=loss,
            interval_steps=self._proposal(),
            speed=speed,
            speed_epoch=epoch,
        )

    def _proposal(self) -> int:
        """Rank 0's steps between exchanges, from the median of its last steps (1 before
        it has timed one after the first); 0 on other ranks."""
        if self.rank != 0:
            return 0
        if not self.step_times_s:
            return 1
        return control_interval_steps(statistics.median(self.step_times_s))

    def _collect(self) -> Agreement:
        """The job's agreement on the values posted last (``StepControl.finish``)."""
        return self._heard(self.control.finish())

    def _heard(self, agreement: Agreement) -> Agreement:
        """Pass the losses of an agreement to rank 0's progress; return the agreement."""
        if self.progress is not None:
            shares = None
            if self.balancer is not None and agreement.step is not None:
                shares = self.balancer.shares_at(agreement.step)
            loss = job_loss(self.parts.plan, agreement.losses, shares)
            self.progress.loss_known(agreement.step, loss)
        return agreement

    def _reshare(self, agreement: Agreement, next_step: int) -> None:
        """Take the shares the agreement's speeds ask for from ``next_step`` on (every rank
        reads the same agreement at the same step, so all change together); rank 0 says so."""
        if self.balancer is None or not agreement.speeds:
            return
        speeds = [None if s is None else ReplicaSpeed(*s) for s in agreement.speeds]
        old = self.balancer.shares
        change = self.balancer.agreed(agreement.speed_epoch, speeds, next_step)
        if change is None:
            return
        self.runner.reshare(self.balancer.offset(), self.balancer.sizes())
        if self.rank == 0:
            print(
                f"hplan: from step {next_step}: batch shares {_shares_text(old)} -> "
                f"{_shares_text(change.shares)} (the replicas' measured speeds; predicted "
                f"step {change.predicted_gain * 100:.1f}% shorter)",
                file=sys.stderr,
                flush=True,
            )

    def _after(
        self, steps_done: int, flags: StepFlags, record: StepMetrics, last: bool = False
    ) -> None:
        """Hold this step's ``flags``; on an exchange step (every ``control_every`` steps,
        a checkpoint's step and the run's ``last``) post them (and this step's loss, on a
        last stage); on the step after an exchange, act on what the job agreed there.

        A checkpoint waits for this step's agreement first, so that the state it saves is
        never one that a rank has found diverged.

        Raises:
            PreemptedError, DivergedError: see :meth:`_finish`.
        """
        self.held |= flags
        if self.warmed_up:
            self.step_times_s.append(record.step_time_s)
        self.warmed_up = True
        due_steps = (
            self.checkpointer is not None
            and self.every_steps is not None
            and steps_done % self.every_steps == 0
        )
        posted = last or due_steps or steps_done % self.control_every == 0
        # off an exchange step: the last exchange's values, read once (nothing when read)
        agreement = self._heard(self._post(record) if posted else self.control.finish())
        if agreement.interval_steps > 0:  # every rank reads it at the same step
            self.control_every = agreement.interval_steps
        self._reshare(agreement, steps_done)
        agreed = agreement.flags
        if agreed & _STOP:
            self._finish(steps_done, agreed)
        if self.checkpointer is None:
            return
        self.checkpointer.publish_written(agreement.written_step)
        if not (due_steps or agreed & StepFlags.CHECKPOINT_DUE):
            return
        if not posted:  # every rank read the same agreement here: all post this step's flags
            self._post(record)
        now = self._collect().flags
        if now & _STOP:
            self._finish(steps_done, now)
        start_s = time.monotonic()
        self.checkpointer.save(steps_done)
        self.saved_s = time.monotonic()
        self.pauses_s.append(self.saved_s - start_s)

    def _finish(self, steps_done: int, agreed: StepFlags) -> None:
        """End the run after ``steps_done`` steps: the last checkpoint, then how it ended
        (``agreed``, with the flags still in flight, says how).

        Raises:
            DivergedError: a loss was not finite and the model file stops on it.
            PreemptedError: SIGTERM, after the checkpoint is saved.
        """
        agreed |= self._collect().flags
        if agreed & StepFlags.NONFINITE_LOSS:
            if self.checkpointer is not None:
                self.checkpointer.wait()
            raise DivergedError(
                f"stopped after step {steps_done - 1}: a loss was not finite "
                "(STOP_ON_NONFINITE_LOSS in the model file); the diverged state was not "
                "saved"
            )
        if self.checkpointer is not None:
            start_s = time.monotonic()
            self.checkpointer.save(steps_done)
            self.checkpointer.wait()
            self._report_pauses(time.monotonic() - start_s)
        if agreed & StepFlags.PREEMPTED:
            where = (
                f"checkpoint {self.checkpointer.directory / f'step-{steps_done}'} saved; "
                "resume with --resume"
                if self.checkpointer is not None
                else "no --checkpoint-dir, so nothing was saved"
            )
            raise PreemptedError(f"preempted (SIGTERM) after {steps_done} steps: {where}")


def _shares_text(shares: tuple[int, ...]) -> str:
    return " | ".join(str(n) for n in shares)


_STOP = StepFlags.PREEMPTED | StepFlags.NONFINITE_LOSS
_PROPOSAL_STEPS = 20
"""Rank 0's last steps whose median time sets the interval it proposes."""


def _train_step(
    runner: StepRunner,
    memory: MemoryMeter,
    step: int,
    verify: Path | None,
    outer: OuterSync | None = None,
    *,
    last: bool = False,
    cpu_share: CpuShare,
) -> StepMetrics:
    """One step; with ``verify`` (a folder), dropout is off for it (``random_ops.py``) and
    its synced gradients and updated parameters are dumped there. With ``outer``, the
    cross-island syncs due after it (``last``: the run's last step, which closes them).
    ``cpu_share``: the rank's CPU quota and threads, recorded with its CPU times."""
    parts = runner.parts
    start_s, start_cpu_s = time.monotonic(), time.process_time()
    parts.comm.reset_times()
    with DropoutOff() if verify is not None else contextlib.nullcontext():
        loss = runner.run(step)
    runner.unscale_gradients()
    grad_norm = runner.clip_gradients()  # before the dump: the gradients the optimizer uses
    if verify is not None:
        sharded = runner.shards.gathered_grads() if runner.shards is not None else {}
        _dump_verify(parts, verify, "grads", loss, step, sharded)
    stepped = runner.optimizer_step()
    outer_s = 0.0
    if outer is not None:
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
    the optimizer step (``params``), by canonical name.

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
            n: p.grad.detach().cpu().clone() for n, p in parts.params if p.grad is not None
        } | {n: g.detach().cpu() for n, g in (sharded or {}).items()}
        batch = parts.source.global_batch(step)
        payload["batch_digest"] = batch_digest(batch)
        if parts.rank_plan.rank == 0:
            payload["batch"] = batch_tensors(batch)
    else:
        payload["tensors"] = {n: p.detach().cpu().clone() for n, p in parts.params}
    torch.save(payload, directory / f"{kind}-rank-{parts.rank_plan.rank}.pt")
