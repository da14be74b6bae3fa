"""One rank of a plan: build its stage, run its schedule, sync gradients, step.

:func:`build_rank` loads the model file, seeds, builds the model, re-traces it the way the
plan says, checks the graph fingerprint, builds only this rank's ``StageModule`` and drops
the rest. :func:`run_rank` then runs ``steps`` optimizer steps: the micro-batches of this
rank's replica go through the pipeline schedule (``schedule.py``), boundary tensors travel
point-to-point (``comm.py``), gradients are summed among the ranks holding each parameter
(``grad_sync.py``), and metrics are written per step (``metrics.py``).

Emulation (rehearsal) stretches each forward and backward to the device's speed: it lasts
``dilation * peak_max / peak_device`` times its CPU time (``pipeline.py``; from the second
step the stage's warm CPU time, ``warm_compute.py``), and the links
of the plan delay point-to-point transfers and all-reduces (``comm.py``, ``grad_sync.py``).
"""

from __future__ import annotations

import inspect
import json
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hplan.runtime.capture.model_file import ModelFile, load_model_file
from hplan.runtime.capture.stage import StageModule, build_stage
from hplan.runtime.capture.trace import TracedModel, bind_inputs, trace_model
from hplan.runtime.contract.errors import (
    ConfigError,
    ModelFileError,
    PeerFailureError,
    PlanMismatchError,
)
from hplan.runtime.contract.metrics_file import MetricsWriter, StepMetrics, peak_memory_bytes
from hplan.runtime.contract.plan import Backend, Plan, RankPlan, SyncMode
from hplan.runtime.contract.timeline_file import TimelineWriter
from hplan.runtime.executor.checkpoint import load_checkpoint, save_checkpoint
from hplan.runtime.executor.comm import Boundary, EmulatedLink, StageComm, error_reason
from hplan.runtime.executor.data import BatchSource, Binder
from hplan.runtime.executor.grad_sync import GradBucket, build_buckets
from hplan.runtime.executor.pipeline import StepRunner, stage_label
from hplan.runtime.executor.rendezvous import check_machine, join_job, rank_device
from hplan.runtime.rehearsal.warm_compute import ROUNDS, WarmTimes


@dataclass(frozen=True)
class Emulation:
    """How a rehearsal slows this machine down to look like the plan's hardware."""

    dilation: float
    """Global time-dilation factor (>= 1) so that all ranks' CPU demand fits the cores."""
    time_scale: float
    """Emulated seconds per second of plan hardware: links, all-reduce and, for GPU plans,
    compute (see ComputeEmulation)."""
    slowdown: Mapping[str, float] = field(default_factory=dict)
    """Straggler emulation: cluster device name -> factor its compute is slowed by
    (1.4 = 40% slower than the plan says), in both compute modes."""


EMULATION_FILE = "emulation.json"
"""Written by a rehearsal into its metrics folder: dilation, time scale and slowdowns."""


def recorded_emulation(emulation: Emulation, metrics_dir: Path | None) -> Emulation:
    """``emulation`` with the slowdowns a rehearsal recorded in
    ``<metrics_dir>/emulation.json`` (unchanged without one).

    Raises:
        ConfigError: the file is not a rehearsal's record.
    """
    path = None if metrics_dir is None else metrics_dir / EMULATION_FILE
    if path is None or not path.is_file():
        return emulation
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        slowdown = {str(name): float(f) for name, f in record.get("slowdown", {}).items()}
    except (ValueError, AttributeError, TypeError) as exc:
        raise ConfigError(f"{path}: not a rehearsal's emulation record ({exc})") from None
    return replace(emulation, slowdown=slowdown)


def recorded_slowdown(metrics_dir: Path | None) -> dict[str, float]:
    """The ``slowdown`` a rehearsal recorded in ``metrics_dir`` ({} if none); see
    :func:`recorded_emulation`."""
    return dict(recorded_emulation(Emulation(1.0, 1.0), metrics_dir).slowdown)


@dataclass(frozen=True)
class RunOptions:
    """What ``hplan run`` was asked to do beyond the plan."""

    steps: int
    metrics_dir: Path | None = None
    checkpoint_dir: Path | None = None
    emulation: Emulation | None = None
    verify_dir: Path | None = None
    """Rehearsal ``--verify``: dump parameters, gradients and loss after the first step."""
    device: str | None = None
    """Override the plan's device (rehearsal runs every rank on ``cpu``)."""
    backend: str | None = None
    master_host: str | None = None
    master_port: int | None = None


@dataclass
class RankState:
    """Everything one rank holds while training."""

    plan: Plan
    rank_plan: RankPlan
    device: torch.device
    model_file: ModelFile
    stage: StageModule
    params: list[tuple[str, nn.Parameter]]
    optimizer: torch.optim.Optimizer
    source: BatchSource
    comm: StageComm
    buckets: list[GradBucket] = field(default_factory=list)
    compute: ComputeEmulation = field(default_factory=lambda: ComputeEmulation())
    """How long compute lasts under emulation (no emulation by default)."""


# --------------------------------------------------------------------------- process group
def run_backend(plan: Plan, options: RunOptions) -> str:
    """The process-group backend of this run: ``options.backend``, else the plan's."""
    return options.backend or plan.training.backend.value


def init_distributed(plan: Plan, rank: int, options: RunOptions) -> None:
    """Join the job at ``<master_host>:<master_port + 1>`` (see :func:`join.join_job`).

    Raises:
        PeerFailureError: the other ranks did not join within the plan's timeout.
    """
    training = plan.training
    port = options.master_port if options.master_port is not None else training.master_port
    join_job(
        plan,
        rank,
        host=options.master_host or training.master_host,
        port=port + 1,
        backend=run_backend(plan, options),
    )


def check_environment(plan: Plan, rank: int, options: RunOptions) -> None:
    """Check, before joining, that this machine can run ``rank`` (see :func:`join.check_machine`).

    Raises:
        EnvironmentProblemError: the plan needs NCCL or a GPU that this machine lacks.
    """
    check_machine(plan, rank, backend=run_backend(plan, options), device=options.device)


# --------------------------------------------------------------------------- building
def _boundaries(plan: Plan, rank_plan: RankPlan) -> tuple[Boundary | None, Boundary | None]:
    replica = plan.replica_ranks(rank_plan.replica)
    unit_names = [u.name for u in plan.units]
    prev = next_ = None
    if rank_plan.stage > 0:
        before = unit_names[unit_names.index(rank_plan.units[0]) - 1]
        cut = plan.cut_after(before)
        prev = Boundary(replica[rank_plan.stage - 1].rank, cut.tensors, f"cut after {before}")
    if rank_plan.stage < len(replica) - 1:
        cut = plan.cut_after(rank_plan.units[-1])
        peer = replica[rank_plan.stage + 1].rank
        next_ = Boundary(peer, cut.tensors, f"cut after {rank_plan.units[-1]}")
    return prev, next_


def rank_speeds(plan: Plan) -> list[float]:
    """Speed of each rank's device on this model relative to the fastest (rank order).

    Plans whose compute is stretched (cpu devices, see ComputeEmulation): the ratio of the
    devices' declared peak FLOP/s, i.e. the hardware the cluster file describes. Not the
    report's ``relative_speed``: that is a standalone throughput, lower for a device whose
    memory only fits small micro-batches, and it includes calibrated factors (a straggler
    is emulated with ``slowdown``, not by replaying the planner's estimate of it).
    Modelled plans: the report's per-rank ``relative_speed`` when every rank has one;
    otherwise the peak FLOP/s ratio.
    """
    by_rank = {r.rank: r.relative_speed for r in plan.report.ranks}
    if (
        modelled_emulation(plan)
        and len(by_rank) == len(plan.ranks)
        and all(v > 0 for v in by_rank.values())
    ):
        return [by_rank[r.rank] / max(by_rank.values()) for r in plan.ranks]
    peaks = [plan.device(r.device).peak_flops for r in plan.ranks]
    return [peak / max(peaks) for peak in peaks]


def device_stretch(plan: Plan, rank: int) -> float:
    """How many times slower than the fastest device this rank's device runs (>= 1)."""
    return 1.0 / rank_speeds(plan)[rank]


@dataclass(frozen=True)
class ComputeEmulation:
    """How long a rank's compute blocks last under emulation.

    Two modes. *Stretch* (plans for cpu devices, gloo): in the first step each forward,
    backward and optimizer step lasts ``stretch`` x its measured CPU time; after it, the
    rank times its own stage back to back (``warm_compute.py``) and each block lasts
    ``stretch`` x that warm time of its phase and micro-batch size (a block after the
    emulation's sleeps runs colder than on a dedicated core). The emulated device is a
    CPU, so its real compute is the right model. *Modelled* (GPU plans, NCCL): each
    forward, backward and optimizer step lasts at least ``time_scale`` x the planner's prediction for this rank
    (``RankReport.forward_time_s`` ...). A CPU cannot show a GPU's behaviour (launch
    overhead amortised by larger micro-batches, tensor-core peaks), so the plan's hardware
    model is replayed and the runtime's schedule, transfers and synchronisation are
    measured on top of it.
    """

    stretch: float = 1.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    measure_warm: bool = False
    """Stretched mode: time the stage back to back after the first step."""
    warm: WarmTimes | None = None
    """Stretched mode, after the first step: the stage's warm CPU times."""


def modelled_emulation(plan: Plan) -> bool:
    """True for GPU plans whose report predicts every rank's compute (see ComputeEmulation)."""
    ranks = plan.report.ranks
    return (
        plan.training.backend is Backend.NCCL
        and len(ranks) == len(plan.ranks)
        and all(r.forward_time_s > 0 and r.backward_time_s > 0 for r in ranks)
    )


def compute_emulation(plan: Plan, rank: int, emulation: Emulation | None) -> ComputeEmulation:
    """This rank's compute emulation (none when not rehearsing)."""
    if emulation is None:
        return ComputeEmulation()
    slowdown = emulation.slowdown.get(plan.ranks[rank].device, 1.0)
    if not modelled_emulation(plan):
        stretch = emulation.dilation * device_stretch(plan, rank) * slowdown
        return ComputeEmulation(stretch=stretch, measure_warm=True)
    report = next(r for r in plan.report.ranks if r.rank == rank)
    scale = emulation.time_scale * slowdown
    return ComputeEmulation(
        forward_s=scale * report.forward_time_s,
        backward_s=scale * report.backward_time_s,
        optimizer_s=scale * report.optimizer_time_s,
    )


def _emulated_links(
    plan: Plan, rank_plan: RankPlan, emulation: Emulation | None
) -> dict[int, EmulatedLink]:
    if emulation is None:
        return {}
    links = {}
    for side in _boundaries(plan, rank_plan):
        if side is None:
            continue
        spec = plan.link(rank_plan.device, plan.ranks[side.peer_rank].device)
        links[side.peer_rank] = EmulatedLink(
            spec.latency_s, spec.bandwidth_bytes_per_s, emulation.time_scale
        )
    return links


def _example_inputs(model_file: ModelFile, model: nn.Module, seed: int) -> dict[str, Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inputs, _ = model_file.sample_batch(2)
    return bind_inputs(model, inputs)


def _retrace(plan: Plan, model_file: ModelFile) -> tuple[TracedModel, Binder]:
    """Build the model with the plan's seed and re-trace it exactly as the planner did.

    Raises:
        ModelFileError: ``build_model`` raises.
        PlanMismatchError: an input the plan feeds is missing, or the graph differs.
    """
    torch.manual_seed(plan.training.seed)
    try:
        model = model_file.build_model()
    except Exception as exc:
        raise ModelFileError(
            f"build_model() in {str(model_file.path)!r} raised {type(exc).__name__}: "
            f"{error_reason(exc)}; fix model.py"
        ) from None
    example = _example_inputs(model_file, model, plan.training.seed)
    check_fed_inputs(plan, example)
    traced = trace_model(
        model, example, leaf_modules=plan.model.leaf_modules, method=plan.model.trace_method
    )
    fingerprint = traced.fingerprint()
    if fingerprint != plan.model.graph_fingerprint:
        raise PlanMismatchError(
            f"the model traced from {model_file.path} has graph fingerprint "
            f"{fingerprint[:12]}, the plan was made for "
            f"{plan.model.graph_fingerprint[:12]} (its graph or its parameter shapes differ); "
            "re-run `hplan solve` with this model file"
        )
    return traced, _binder(model)


def build_rank(
    plan: Plan, rank: int, model_path: str | Path | None, options: RunOptions
) -> RankState:
    """Build this rank's stage, optimizer, data source and communication (no collectives).

    Raises:
        ModelFileError: the model file cannot be loaded.
        PlanMismatchError: the re-traced graph differs from the plan's fingerprint, or the
            stage's parameters differ from the plan's.
        ConfigError: the plan asks for a sync mode this runtime does not implement.
        EnvironmentProblemError: the plan asks for a GPU this machine lacks.
    """
    rank_plan = plan.ranks[rank]
    if plan.training.sync_mode is not SyncMode.ALL_REDUCE:
        raise ConfigError(
            f"plan asks for sync mode {plan.training.sync_mode.value!r}; this runtime runs "
            "only 'all_reduce'; re-run `hplan solve` with synchronous all-reduce"
        )
    model_file = load_model_file(model_path or plan.model.path)
    device = rank_device(plan, rank_plan, options.device)
    if options.emulation is None and rank_plan.local_rank == 0:
        warn_if_model_changed(plan, model_file)
    traced, binder = _retrace(plan, model_file)
    prev, next_ = _boundaries(plan, rank_plan)
    stage = build_stage(
        traced,
        plan.units,
        rank_plan.units,
        recv=[t.name for t in prev.specs] if prev else [],
        send=[t.name for t in next_.specs] if next_ else [],
    )
    del traced
    stage.to(device)
    params = stage.canonical_parameters()
    trainable = [p for _, p in params if p.requires_grad]
    optimizer = model_file.optimizer(trainable)
    source = BatchSource(
        model_file, binder, plan.training.seed, plan.global_batch_size, plan.model.inputs
    )
    comm = StageComm(
        rank,
        device,
        prev,
        next_,
        links=_emulated_links(plan, rank_plan, options.emulation),
        post_ahead=run_backend(plan, options) == "gloo",
    )
    compute = compute_emulation(plan, rank_plan.rank, options.emulation)
    return RankState(
        plan, rank_plan, device, model_file, stage, params, optimizer, source, comm, [], compute
    )


def warn_if_model_changed(plan: Plan, model_file: ModelFile) -> None:
    """One warning line on stderr when model.py is not the file the plan was made for.

    Not an error: an edit that leaves the graph alone (a new data path, a comment) is fine,
    and a change to the graph fails the fingerprint check that follows.
    """
    if model_file.sha256 == plan.model.sha256:
        return
    print(
        f"hplan: warning: {model_file.path} differs from the model file the plan was made for "
        f"(sha256 {model_file.sha256[:12]}, plan {plan.model.sha256[:12]}); the traced graph "
        "is checked against the plan next",
        file=sys.stderr,
        flush=True,
    )


def check_fed_inputs(plan: Plan, fed: Mapping[str, Any]) -> None:
    """Check that the model file feeds every graph input the plan was made with.

    Raises:
        PlanMismatchError: naming the missing input and the first stage that reads it.
    """
    for spec in plan.model.inputs:
        name = spec.tensor.name
        if name in fed:
            continue
        readers = [r for r in plan.ranks if set(r.units) & set(spec.read_by_units)]
        where = stage_label(readers[0]) if readers else "no stage"
        raise PlanMismatchError(
            f"graph input {name!r} is read by {where}, but sample_batch()/dataset() does not "
            f"return it (it returns {sorted(fed)}); return {name!r} with the inputs or "
            "re-run `hplan solve` with this model file"
        )


def _binder(model: nn.Module) -> Binder:
    """Bind inputs by ``forward``'s signature without keeping the model's weights alive."""
    shell = _SignatureShell(model)
    return lambda inputs: bind_inputs(shell, inputs)


class _SignatureShell(nn.Module):
    """An empty module whose ``forward`` has the user model's signature (for binding)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        signature = inspect.signature(model.forward)

        def forward(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("signature shell is never called")

        forward.__signature__ = signature  # type: ignore[attr-defined]
        self.forward = forward  # type: ignore[method-assign]


# --------------------------------------------------------------------------- the run
def run_rank(plan: Plan, rank: int, model_path: str | Path | None, options: RunOptions) -> None:
    """Join the job, build this rank and train ``options.steps`` optimizer steps.

    Every rank of the plan must call this with the same plan and options (except the rank).

    Raises:
        HplanError subclasses: see :func:`build_rank`, :func:`init_distributed`; a peer
            that dies or stops answering raises ``PeerFailureError``.
    """
    if options.steps < 1:
        raise ConfigError(f"--steps is {options.steps}; run at least one step")
    if options.emulation is not None:
        emulation = recorded_emulation(options.emulation, options.metrics_dir)
        options = replace(options, emulation=emulation)
    check_environment(plan, rank, options)
    init_distributed(plan, rank, options)
    state = build_rank(plan, rank, model_path, options)
    scale = options.emulation.time_scale if options.emulation else 0.0
    state.buckets = build_buckets(plan, rank, state.params, time_scale=scale)
    first_step = 0
    if options.checkpoint_dir is not None:
        first_step = load_checkpoint(state, options.checkpoint_dir)
    writer = MetricsWriter(options.metrics_dir, rank) if options.metrics_dir else None
    timeline = TimelineWriter(options.metrics_dir, rank) if options.metrics_dir else None
    runner = StepRunner(state)
    _barrier(rank, "start of training")
    last_step = first_step + options.steps - 1
    for step in range(first_step, last_step + 1):
        record = _train_step(
            state, runner, step, verify=options.verify_dir if step == first_step else None
        )
        if writer is not None:
            writer.write(record)
        if timeline is not None:
            timeline.write(step, runner.timeline.events)
        if state.compute.measure_warm and state.compute.warm is None and step < last_step:
            _time_warm_compute(state, runner)
    if writer is not None:
        writer.close()
    if timeline is not None:
        timeline.close()
    if options.checkpoint_dir is not None:
        save_checkpoint(
            state,
            options.checkpoint_dir,
            first_step + options.steps,
            barrier=lambda: _barrier(rank, "checkpoint"),
        )
    _barrier(rank, "end of training")
    dist.destroy_process_group()


def _time_warm_compute(state: RankState, runner: StepRunner) -> None:
    """The ranks take turns timing their stage back to back, ``warm_compute.ROUNDS`` turns
    each (``warm_compute.py``)."""
    rank = state.rank_plan.rank
    timer = runner.warm_timer()
    _barrier(rank, "warm compute timing")  # every rank idle before the first turn
    for _ in range(ROUNDS):
        for turn in range(state.plan.world_size):
            if turn == rank:
                timer.time_round()
            _barrier(rank, "warm compute timing")
    warm = timer.result()
    state.compute = replace(state.compute, warm=warm)
    print(f"rank {rank}: {warm.describe()}", file=sys.stderr, flush=True)


def _train_step(
    state: RankState, runner: StepRunner, step: int, verify: Path | None
) -> StepMetrics:
    start_s = time.monotonic()
    state.comm.reset_times()
    loss = runner.run(step)
    if verify is not None:
        _dump_verify(state, verify, "grads", loss)
    runner.optimizer_step()
    if verify is not None:
        _dump_verify(state, verify, "params", loss)
    step_s = time.monotonic() - start_s
    comm = state.comm.reset_times()
    times = runner.times
    accounted = times.compute_s + comm.p2p_s + comm.wait_s + times.allreduce_s + times.optimizer_s
    rp = state.rank_plan
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
        samples=rp.num_samples,
        peak_memory_bytes=peak_memory_bytes(state.device),
        forward_time_s=times.forward_s,
    )


def _barrier(rank: int, what: str) -> None:
    try:
        dist.barrier()
    except RuntimeError as exc:
        raise PeerFailureError(
            f"rank {rank}: a peer failed before the {what}: {error_reason(exc)}; check the other "
            "ranks' logs (one probably failed first)"
        ) from None


def _dump_verify(state: RankState, directory: Path, kind: str, loss: float | None) -> None:
    """Write ``<dir>/<kind>-rank-<r>.pt``: {name: tensor} of grads or updated params."""
    directory.mkdir(parents=True, exist_ok=True)
    if kind == "grads":
        tensors = {n: p.grad.detach().cpu().clone() for n, p in state.params if p.grad is not None}
    else:
        tensors = {n: p.detach().cpu().clone() for n, p in state.params}
    payload = {"tensors": tensors, "loss": loss, "samples": state.rank_plan.num_samples}
    torch.save(payload, directory / f"{kind}-rank-{state.rank_plan.rank}.pt")
