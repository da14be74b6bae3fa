"""Rehearsal: run every rank of a plan as a local CPU process, emulating the plan's hardware.

Each rank runs ``python -m hplan.runtime.rehearsal PLAN --rank R ...`` (``__main__.py``: the
executor's own rank, gloo on 127.0.0.1, one thread), whatever the plan's device kinds,
started and supervised by ``launcher.py``. The emulation (``emulation.py``) stretches
compute (cpu plans: to each device's declared speed; GPU plans: to the planner's
prediction) and delays transfers and all-reduces, in emulated seconds, ``scale`` of them
per second of the plan's hardware (:func:`default_time_scale`). ``dilation``
(:func:`default_dilation`) is one global factor that makes the ranks' total CPU demand fit
this machine, so that the run measures the plan rather than contention. The emulation is
recorded in ``<metrics_dir>/emulation.json`` (``contract/metrics_file.py``); ``verify``
compares step 0 with one process (``reference_check.py``), and ``trace_path`` gets the last
step's timeline in seconds of the plan's hardware (``contract/timeline_file.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from hplan.runtime.capture.graph_inputs import forward_kwargs
from hplan.runtime.capture.model_file import ModelFile, checked_loss, load_model_file
from hplan.runtime.capture.trace import bind_inputs
from hplan.runtime.contract.cpus import MEMINFO, available_memory_bytes
from hplan.runtime.contract.errors import (
    ConfigError,
    MemoryBudgetError,
    PeerFailureError,
    RehearsalChildError,
)
from hplan.runtime.contract.metrics_file import (
    EmulationRecord,
    RankSummary,
    StepSummary,
    check_fresh_metrics_dir,
    summarize_metrics,
    typical_step_time_s,
)
from hplan.runtime.contract.plan import Plan
from hplan.runtime.contract.timeline_file import check_trace_path, write_measured_trace
from hplan.runtime.executor.outer.outer_sync import check_verify
from hplan.runtime.executor.worker import check_graph_early, warn_if_model_changed
from hplan.runtime.rehearsal.emulation import modelled_emulation, rank_speeds
from hplan.runtime.rehearsal.launcher import ChildCommand, prepare_dir, run_children
from hplan.runtime.rehearsal.reference_check import VerifyResult, verify_first_step

DILATION_MARGIN = 1.25
"""Head-room over the exact CPU demand (interpreter, communication threads, the parent)."""
MIN_DILATION = 4.0
"""The least default dilation. What a rehearsal does in real time besides the emulated
compute and links (Python, gloo's hand-overs, process wake-ups) counts 1/dilation in the
plan's seconds: from about this dilation on it hardly shows, and higher ones only take
longer."""


@dataclass(frozen=True)
class Checkpointing:
    """Checkpoints of a rehearsal's ranks (the options of ``python -m hplan.runtime run``)."""

    directory: Path
    resume: bool = False
    every_steps: int | None = None

    def args(self) -> tuple[str, ...]:
        """The ranks' command-line options."""
        args = ["--checkpoint-dir", str(self.directory)]
        if self.resume:
            args.append("--resume")
        if self.every_steps is not None:
            args += ["--checkpoint-every-steps", str(self.every_steps)]
        return tuple(args)


@dataclass(frozen=True)
class RehearsalResult:
    """What a rehearsal measured, and what the plan predicted, in emulated units."""

    losses: tuple[float | None, ...]
    """Global-batch mean loss of each step."""
    steps: tuple[StepSummary, ...]
    measured_samples_per_s: float
    predicted_samples_per_s: float | None
    """Plan prediction in emulated units; None when the report has no reference time."""
    plan_samples_per_s: float | None
    """The plan's own prediction on its hardware (``report.predicted_samples_per_s``);
    None when there is no emulated prediction."""
    dilation: float
    time_scale: float
    cpu_time_per_sample_s: float
    """Forward + backward of one sample through the whole model here, on one thread."""
    verify: VerifyResult | None
    """``--verify``: step 0's gradients and updates against one process, with the worst
    parameter of each; None without verify."""
    verify_passed: bool | None
    """``verify.passed``; None without verify."""
    ranks: tuple[RankSummary, ...]
    metrics_dir: Path | None
    """Where the metrics and logs are; None when they were in a temporary folder, deleted."""
    slowdown: dict[str, float] = dataclasses.field(default_factory=dict)
    """Emulated stragglers: device name -> compute slowdown factor (``--slowdown``)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-native view (for ``hplan rehearse --json``)."""
        data = dataclasses.asdict(self)
        data["metrics_dir"] = None if self.metrics_dir is None else str(self.metrics_dir)
        return data


# --------------------------------------------------------------------------- emulation
def default_dilation(plan: Plan, num_cores: int, margin: float = DILATION_MARGIN) -> float:
    """Smallest dilation at which all ranks' CPU demand fits ``num_cores``, and at least
    :data:`MIN_DILATION`: rank ``r`` computes a fraction ``speed_r / (speed_max * dilation)``
    of the time, so ``dilation >= margin * sum_r(speed_r / speed_max) / cores``."""
    return max(MIN_DILATION, margin * sum(rank_speeds(plan)) / max(num_cores, 1))


def default_time_scale(plan: Plan, dilation: float, cpu_time_per_sample_s: float) -> float:
    """Emulated seconds per second of plan hardware: ``dilation * cpu_time_per_sample_s /
    report.reference_time_per_sample_s``, which keeps links and compute in the plan's
    proportions (``dilation`` alone when the report has no reference time)."""
    reference_s = plan.report.reference_time_per_sample_s
    if reference_s <= 0:
        return dilation
    return dilation * cpu_time_per_sample_s / reference_s


def predicted_samples_per_s(plan: Plan, scale: float) -> float | None:
    """The plan's throughput in emulated units; None when the report lacks a reference."""
    if plan.report.reference_time_per_sample_s <= 0 or plan.report.predicted_step_time_s <= 0:
        return None
    return plan.global_batch_size / (plan.report.predicted_step_time_s * scale)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_cpu_time_per_sample(model_file: ModelFile, plan: Plan, *, repeats: int = 3) -> float:
    """Forward + backward CPU seconds per sample of the whole model on this CPU, one
    thread, seeded, at the micro-batch size where the report's reference time was taken:
    the minimum over ``repeats`` timed calls after one warm-up call. CPU time is the
    calling thread's (``time.thread_time``, like the ranks' stretch)."""
    batch_size = plan.report.reference_micro_batch_size
    with _one_thread(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(plan.training.seed)
        model = model_file.build()
        inputs, targets = model_file.sample_batch(batch_size)
        bound = forward_kwargs(bind_inputs(model, inputs))

        def call() -> float:
            start_s = time.thread_time()
            checked_loss(model_file, model(**bound), targets, require_grad=True).backward()
            model.zero_grad(set_to_none=True)
            return time.thread_time() - start_s

        call()
        return min(call() for _ in range(repeats)) / batch_size


# --------------------------------------------------------------------------- rehearse
DEFAULT_STEPS = 10
"""Steps a rehearsal runs when neither it nor the plan says (``rehearsal_steps``)."""


def rehearsal_steps(plan: Plan, steps: int | None) -> int:
    """``steps`` if given, else the plan's training steps (``hplan solve --steps``), else
    :data:`DEFAULT_STEPS` (a plan that gives epochs is rehearsed for that many steps too)."""
    if steps is not None:
        return steps
    return plan.training.steps if plan.training.steps is not None else DEFAULT_STEPS


def rehearse(
    plan: Plan,
    *,
    model_path: str | Path | None = None,
    steps: int,
    verify: bool = False,
    metrics_dir: Path | None = None,
    dilation: float | None = None,
    time_scale: float | None = None,
    timeout_s: float = 600.0,
    console: Console | None = None,
    trace_path: Path | None = None,
    slowdown: Mapping[str, float] | None = None,
    checkpointing: Checkpointing | None = None,
    enforce_memory: bool = False,
) -> RehearsalResult:
    """Run every rank of ``plan`` on this machine, emulating its hardware.

    Args:
        model_path: model.py (default: the plan's recorded path).
        steps: optimizer steps.
        verify: run step 0 with dropout off, also in one process on the whole global
            batch, and compare every synced gradient and parameter update
            (``reference_check.verify_first_step``); refused for a plan whose islands
            train on their own (``outer_sync.check_verify``).
        metrics_dir: where ranks write metrics and logs (default: a new temporary folder,
            deleted at the end unless the ranks failed: then the error names its logs).
        dilation: global time-dilation factor (default: :func:`default_dilation`).
        time_scale: emulated seconds per second of plan hardware (default:
            :func:`default_time_scale`); give two rehearsals the same value to compare
            plans under one emulation.
        timeout_s: the whole run is killed after this many seconds.
        console: where progress goes (default: rich on stderr).
        trace_path: write the last step's measured timeline here (Chrome trace JSON).
        slowdown: device name -> factor (> 0) its compute is slowed by (a straggler).
        checkpointing: the ranks save checkpoints there (and resume from the latest).
        enforce_memory: stop the rehearsal when a rank's measured training memory (its
            peak over its memory before its stage was built) exceeds its device's memory
            less the device kind's reserve (``contract/memory_use.py``).

    Raises:
        RehearsalChildError: a rank failed; its one-line error and exit code are kept (a
            rank that SIGKILL ended: with its predicted and last measured memory).
        MemoryBudgetError: ``enforce_memory`` and a rank exceeded its device's budget.
        PeerFailureError: the run exceeded ``timeout_s`` (every rank is killed).
        ModelFileError, ConfigError: bad inputs.
    """
    _check_options(steps, dilation, time_scale, timeout_s)
    if verify and checkpointing is not None and checkpointing.resume:
        raise ConfigError("--verify compares step 0 with one process; it cannot go with --resume")
    if verify:
        check_verify(plan)
    if trace_path is not None:
        check_trace_path(trace_path)
    if metrics_dir is not None and Path(metrics_dir).exists() and not Path(metrics_dir).is_dir():
        raise ConfigError(f"metrics folder {str(metrics_dir)!r} is a file; give a directory")
    if metrics_dir is not None:
        check_fresh_metrics_dir(Path(metrics_dir), [r.rank for r in plan.ranks])
    _check_host_memory(plan)
    slowdown = dict(slowdown or {})
    unused = check_slowdown(plan, slowdown)
    run = _Run(
        plan=plan,
        model=str(model_path or plan.model.path),
        steps=steps,
        verify=verify,
        dilation=dilation,
        time_scale=time_scale,
        timeout_s=timeout_s,
        console=console or Console(stderr=True, soft_wrap=True),
        trace_path=trace_path,
        slowdown=slowdown,
        checkpointing=checkpointing,
        enforce_memory=enforce_memory,
    )
    for name in unused:
        run.console.print(f"note: --slowdown {name}: this plan runs no rank on it (no effect)")
    if metrics_dir is not None:
        return run.into(Path(metrics_dir))
    temporary = Path(tempfile.mkdtemp(prefix="hplan-rehearse-"))
    keep = False
    try:
        return dataclasses.replace(run.into(temporary), metrics_dir=None)
    except (RehearsalChildError, PeerFailureError, MemoryBudgetError):
        keep = True  # the message names the rank logs in it
        raise
    finally:
        if not keep:
            shutil.rmtree(temporary, ignore_errors=True)


def _check_host_memory(plan: Plan, meminfo: Path = MEMINFO) -> None:
    """Refuse a rehearsal whose ranks cannot fit this machine's memory, before any starts.

    Every rank runs here, in host memory, on its stage's real tensors: the plan's predicted
    peak of every rank together is a lower bound of what the rehearsal needs (CPU kernels
    save more than the fused GPU ones the plan was costed for). Skipped where
    ``MemAvailable`` cannot be read (not Linux).

    Raises:
        ConfigError: the ranks' predicted memory exceeds ``MemAvailable``.
    """
    available_bytes = available_memory_bytes(meminfo)
    if available_bytes is None:
        return
    needed_bytes = sum(r.memory_bytes for r in plan.report.ranks)
    if needed_bytes > available_bytes:
        raise ConfigError(
            f"rehearsing this plan needs at least {needed_bytes / 1e9:.1f} GB of memory here "
            f"(the predicted peak of its {plan.world_size} ranks, which all run on this "
            f"machine), and {available_bytes / 1e9:.1f} GB is available; rehearse a smaller "
            "configuration of the model (fewer layers, a shorter sequence) or a smaller "
            "global batch"
        )


@dataclass(frozen=True)
class _Run:
    """One rehearsal's settings (see :func:`rehearse`)."""

    plan: Plan
    model: str
    steps: int
    verify: bool
    dilation: float | None
    time_scale: float | None
    timeout_s: float
    console: Console
    trace_path: Path | None = None
    slowdown: dict[str, float] = dataclasses.field(default_factory=dict)
    checkpointing: Checkpointing | None = None
    enforce_memory: bool = False

    def into(self, metrics_dir: Path) -> RehearsalResult:
        """Rehearse with metrics and logs in ``metrics_dir``; print and return the result."""
        plan, console = self.plan, self.console
        model_file = load_model_file(self.model)
        warn_if_model_changed(plan, model_file)  # once here; the ranks do not repeat it
        if model_file.sha256 != plan.model.sha256:
            check_graph_early(plan, model_file)  # before minutes of timing and rank start-up
        cores = len(os.sched_getaffinity(0))
        dilation = self.dilation or default_dilation(plan, cores)
        console.print(
            "timing the whole model on this CPU at micro-batch "
            f"{plan.report.reference_micro_batch_size} (the emulation's reference)"
        )
        per_sample_s = measure_cpu_time_per_sample(model_file, plan)
        steps_mb = max(r.num_microbatches for r in plan.ranks)
        if steps_mb > 10_000:
            console.print(
                f"note: a rank runs {steps_mb} micro-batches per step; each step will take long"
            )
        scale = self.time_scale or default_time_scale(plan, dilation, per_sample_s)
        console.print(
            f"rehearsing {_count(plan.world_size, 'rank')} on {_count(cores, 'core')}: "
            f"dilation {dilation:.2f}, 1 s of plan hardware = {scale:.3g} s here, compute "
            + (
                "replayed from the plan's model"
                if modelled_emulation(plan)
                else "stretched (from the second step: each rank's warm compute times)"
            )
            + "".join(
                f"; {name} {factor:g}x slower"
                for name, factor in self.slowdown.items()
                if name in {r.device for r in plan.ranks}
            )
        )
        verify_dir = metrics_dir / "verify" if self.verify else None
        plan_path = prepare_dir(metrics_dir, plan)
        EmulationRecord(dilation=dilation, time_scale=scale, slowdown=self.slowdown).save(
            metrics_dir
        )
        extra = () if self.checkpointing is None else self.checkpointing.args()
        command = ChildCommand(
            plan_path, self.model, self.steps, metrics_dir, dilation, scale, verify_dir, extra
        )
        run_children(plan, command, self.timeout_s, console, enforce_memory=self.enforce_memory)
        summary = summarize_metrics(metrics_dir)
        verified = verify_first_step(plan, model_file, verify_dir) if verify_dir else None
        predicted = predicted_samples_per_s(plan, scale)
        result = RehearsalResult(
            losses=tuple(s.loss for s in summary.steps),
            steps=summary.steps,
            measured_samples_per_s=summary.samples_per_s,
            predicted_samples_per_s=predicted,
            plan_samples_per_s=None if predicted is None else plan.report.predicted_samples_per_s,
            dilation=dilation,
            time_scale=scale,
            cpu_time_per_sample_s=per_sample_s,
            verify=verified,
            verify_passed=None if verified is None else verified.passed,
            ranks=summary.ranks,
            metrics_dir=metrics_dir,
            slowdown=dict(self.slowdown),
        )
        _print_result(result, console)
        if self.trace_path is not None:
            step = write_measured_trace(plan, metrics_dir, self.trace_path, time_scale=scale)
            console.print(f"wrote step {step}'s measured timeline to {self.trace_path}")
        return result


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def _check_options(
    steps: int, dilation: float | None, time_scale: float | None, timeout_s: float
) -> None:
    if steps < 1:
        raise ConfigError(f"steps is {steps}; rehearse at least one step")
    if dilation is not None and not (math.isfinite(dilation) and dilation >= 1):
        raise ConfigError(
            f"dilation is {dilation}; it must be a finite number >= 1 (1 = real time)"
        )
    if time_scale is not None and not (math.isfinite(time_scale) and time_scale > 0):
        raise ConfigError(
            f"time scale is {time_scale}; it must be a finite number > 0 (emulated s per plan s)"
        )
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ConfigError(f"timeout is {timeout_s} s; it must be a finite number of seconds > 0")


def parse_slowdown(values: Sequence[str]) -> dict[str, float]:
    """``["box-b/1=1.4", ...]`` -> ``{"box-b/1": 1.4}`` (the last ``=`` splits).

    Raises:
        ConfigError: an item without ``=``, a factor that is not a finite number > 0, or a
            device given twice.
    """
    slowdown: dict[str, float] = {}
    for item in values:
        name, sep, text = item.rpartition("=")
        if not sep or not name:
            raise ConfigError(f"--slowdown {item!r} is not DEVICE=FACTOR; write e.g. box-b/1=1.4")
        try:
            factor = float(text)
        except ValueError:
            factor = math.nan
        if not (math.isfinite(factor) and factor > 0):
            raise ConfigError(
                f"--slowdown {item!r}: factor {text!r} must be a finite number > 0 "
                "(1.4 = 40% slower)"
            )
        if name in slowdown:
            raise ConfigError(f"--slowdown names {name!r} twice; give each device once")
        slowdown[name] = factor
    return slowdown


def check_slowdown(plan: Plan, slowdown: Mapping[str, float]) -> tuple[str, ...]:
    """Check that every slowed device is one of the plan's cluster devices.

    Returns:
        The slowed devices that run no rank of this plan (a re-solved plan may have moved
        off a slow device; its slowdown then has no effect).

    Raises:
        ConfigError: naming the unknown device and the cluster's devices, or a factor that
            is not finite and > 0.
    """
    known = [d.name for d in plan.cluster.devices]
    used = {r.device for r in plan.ranks}
    for name, factor in slowdown.items():
        if name not in known:
            raise ConfigError(
                f"--slowdown {name}={factor:g}: the cluster has no device {name!r}; "
                f"use one of {', '.join(known)}"
            )
        if not (math.isfinite(factor) and factor > 0):
            raise ConfigError(f"--slowdown {name}={factor}: the factor must be finite and > 0")
    return tuple(name for name in slowdown if name not in used)


def _typical_step(result: RehearsalResult) -> str:
    """``median step 0.069 s``, or the mean over whole rounds when outer syncs ran (what
    ``measured_samples_per_s`` is over, ``metrics_file.typical_step_time_s``)."""
    timed = result.steps[1:] or result.steps  # as ``measured_samples_per_s``
    times = [s.step_time_s for s in timed]
    rounds = any(s.outer_sync_time_s > 0 for s in result.steps)
    what = "mean step, outer syncs included" if rounds else "median step"
    skipped = ", step 0 left out" if len(result.steps) > 1 else ""
    return f"{what} {typical_step_time_s(times, rounds=rounds):.3f} s{skipped}"


def _print_result(result: RehearsalResult, console: Console) -> None:
    console.print(
        f"measured: {result.measured_samples_per_s:.2f} samples/s ({_typical_step(result)})"
    )
    if result.predicted_samples_per_s is not None:
        ratio = result.measured_samples_per_s / result.predicted_samples_per_s
        hardware = (
            ""
            if result.plan_samples_per_s is None
            else f"{result.plan_samples_per_s:.1f} samples/s on the plan's hardware; "
        )
        console.print(
            f"predicted: {result.predicted_samples_per_s:.2f} samples/s in emulated units "
            f"({hardware}1 s there = {result.time_scale:.3g} s here); "
            f"measured / predicted = {ratio:.2f}"
        )
    if result.verify is None:
        return
    for note in result.verify.notes():
        console.print(note, highlight=False)
    line = result.verify.describe()
    line = line.replace(" pass", " [green]pass[/green]").replace(" FAIL", " [red]FAIL[/red]")
    console.print(line, highlight=False)
