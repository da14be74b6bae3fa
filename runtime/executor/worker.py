"""One rank of a plan: its run options, and the build of its stage, optimizer and links.

:class:`RunOptions` is what ``hplan run`` was asked beyond the plan, checked once per launch.
:func:`build_rank` loads the model file and builds this rank's ``StageModule``
(:func:`rank_stage`): the model built on fake tensors with the plan's seed, re-traced the
way the plan says, the graph fingerprint checked, and only the stage's own parameters and
buffers built for real (``capture/materialise.py``, ``capture/stage_tensors.py``);
``training.run_rank`` then trains it. A stage without a trainable parameter still gets an
optimizer, over an empty placeholder (:func:`build_optimizer`), so that every rank steps,
unscales and checkpoints alike. The executor reads only the plan's "what" (ranks, units,
cuts, training), never its report.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh

from hplan.runtime.capture.materialise import BuildRecord, CannotMaterialise, record_build
from hplan.runtime.capture.model_file import ModelFile, load_model_file
from hplan.runtime.capture.stage import StageModule, build_stage
from hplan.runtime.capture.stage_tensors import materialise
from hplan.runtime.capture.trace import TracedModel, bind_inputs, trace_model
from hplan.runtime.contract.errors import (
    ConfigError,
    ModelFileError,
    PlanMismatchError,
    TraceError,
    error_reason,
)
from hplan.runtime.contract.plan import Plan, RankPlan, TraceMethod, ZeroStage, wire_spec
from hplan.runtime.executor.comm import Boundary, StageComm
from hplan.runtime.executor.data import BatchSource, Binder
from hplan.runtime.executor.grad_sync import new_group
from hplan.runtime.executor.memory.offload import offload_optimizer
from hplan.runtime.executor.memory.tensor_parallel import (
    check_tensor_parallel,
    embedding_paths,
    shard_stage,
    tp_rank_groups,
)
from hplan.runtime.executor.memory.zero import shard_optimizer
from hplan.runtime.executor.outer.outer_sync import check_verify
from hplan.runtime.executor.pipeline import RankParts, stage_label
from hplan.runtime.executor.precision import configure_matmul_precision, loss_scaler
from hplan.runtime.executor.rendezvous import (
    check_machine,
    join_job,
    rank_device,
    rendezvous_address,
)
from hplan.runtime.executor.running_stats import check_batch_statistics_floor
from hplan.runtime.executor.seams import (
    LinkDelay,
)

NO_LENGTH = (
    "the plan gives no training length; pass --steps N to the launch script (or `hplan "
    "run`), or re-run `hplan solve ... --steps N` (or --epochs E) to record it in the plan"
)


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """What ``hplan run`` was asked to do beyond the plan, valid by construction.

    Each value is checked when the options are made (``ConfigError`` naming the option and
    the fix); :meth:`for_plan` checks them against the plan, once per launch
    (``cli.run_options``).
    """

    steps: int | None = None
    """Optimizer steps to train (``--steps``); None: the plan's training length
    (:func:`training_steps`)."""
    metrics_dir: Path | None = None
    checkpoint_dir: Path | None = None
    verify_dir: Path | None = None
    """Rehearsal ``--verify``: run the first step with dropout off (``random_ops.py``) and
    dump its synced gradients, updated parameters and loss here."""
    device: str | None = None
    """Override the plan's device (rehearsal runs every rank on ``cpu``)."""
    backend: str | None = None
    master_host: str | None = None
    master_port: int | None = None
    warn_model_change: bool = True
    """Local rank 0 warns when model.py is not the file the plan was made for (a rehearsal
    warns once itself)."""
    resume: bool = False
    """Continue from the latest checkpoint in ``checkpoint_dir`` (from step 0 if none)."""
    checkpoint_every_steps: int | None = None
    """Save a checkpoint every this many steps (None: by time only)."""
    checkpoint_every_s: float | None = None
    """Save a checkpoint when this long has passed since the last (None: by steps only;
    both None: every ``training.DEFAULT_CHECKPOINT_EVERY_S``)."""
    async_checkpoints: bool = True
    """Write checkpoints from a background thread while training goes on."""
    heartbeat_timeout_s: float = 30.0
    """A peer whose heartbeat stops for this long ends the job (``liveness.Heartbeat``)."""
    rebalance: bool = True
    """Move samples between replicas as their measured speeds ask (``rebalance.py``; plans
    of one-stage replicas that sync every step)."""

    def __post_init__(self) -> None:
        """Check each value (and that checkpoint options have a folder).

        Raises:
            ConfigError: naming the option and the fix.
        """
        port, timeout_s = self.master_port, self.heartbeat_timeout_s
        if port is not None and not 1 <= port <= 65534:
            raise ConfigError(f"--master-port {port} must be in 1..65534")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ConfigError(f"--heartbeat-timeout-s {timeout_s} must be a finite number > 0")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"--steps is {self.steps}; run at least one step")
        every_steps, every_s = self.checkpoint_every_steps, self.checkpoint_every_s
        if every_steps is not None and every_steps < 1:
            raise ConfigError(f"--checkpoint-every-steps {every_steps} must be >= 1")
        if every_s is not None and not (math.isfinite(every_s) and every_s > 0):
            raise ConfigError(f"the checkpoint interval {every_s} s must be a finite number > 0")
        if self.checkpoint_dir is None and (self.resume or every_steps):
            raise ConfigError("--resume and --checkpoint-every-* need --checkpoint-dir DIR")

    def for_plan(self, plan: Plan) -> RunOptions:
        """These options, checked against ``plan`` (before joining or loading user code).

        Raises:
            ConfigError: neither ``--steps`` nor the plan's steps or epochs give the
                training length, or ``--verify`` of a plan whose islands train on their
                own (``outer_sync.check_verify``).
        """
        training = plan.training
        if self.steps is None and training.steps is None and training.epochs is None:
            raise ConfigError(NO_LENGTH)
        if self.verify_dir is not None:
            check_verify(plan)
        check_tensor_parallel(plan)
        return self

    def settings(self) -> dict[str, object]:
        """The options every rank of a job must share (``same_job.check_same_job``)."""
        return {
            "steps": self.steps,
            "resume": self.resume,
            "checkpointing": self.checkpoint_dir is not None,
            "checkpoint_every_steps": self.checkpoint_every_steps,
            "checkpoint_every_s": self.checkpoint_every_s,
            "async_checkpoints": self.async_checkpoints,
            "verify": self.verify_dir is not None,
            "rebalance": self.rebalance,
        }


# --------------------------------------------------------------------------- training length
def training_steps(plan: Plan, options: RunOptions, steps_per_epoch: int | None) -> int:
    """Steps this run trains: ``--steps``, else the plan's steps, else its epochs times
    ``steps_per_epoch`` (the model file's ``dataset()``, None without one).

    Raises:
        ConfigError: no length anywhere, or epochs without a dataset.
    """
    training = plan.training
    if options.steps is not None:
        return options.steps
    if training.steps is not None:
        return training.steps
    if training.epochs is None:
        raise ConfigError(NO_LENGTH)
    if steps_per_epoch is None:
        raise ConfigError(
            f"the plan trains {training.epochs} epochs (`hplan solve --epochs`), but the model "
            "file has no dataset() to count them in; pass --steps N, or add dataset()"
        )
    return training.epochs * steps_per_epoch


# --------------------------------------------------------------------------- process group
def run_backend(plan: Plan, options: RunOptions) -> str:
    """The process-group backend of this run: ``options.backend``, else the plan's."""
    return options.backend or plan.training.backend.value


def init_distributed(plan: Plan, rank: int, options: RunOptions) -> tuple[str, int]:
    """Join the job (``rendezvous.join_job``) at :func:`rendezvous.rendezvous_address`;
    return that address.

    Raises:
        ConfigError: torchrun numbered this process otherwise than the plan.
        PeerFailureError: the other ranks did not join within the plan's timeout.
    """
    host, port = rendezvous_address(plan, host=options.master_host, port=options.master_port)
    join_job(plan, rank, host=host, port=port, backend=run_backend(plan, options))
    return host, port


def check_environment(plan: Plan, rank: int, options: RunOptions) -> None:
    """Check, before joining, that this machine can run ``rank`` (``rendezvous.check_machine``).

    Raises:
        EnvironmentProblemError: the plan needs NCCL or a GPU that this machine lacks.
    """
    check_machine(plan, rank, backend=run_backend(plan, options), device=options.device)


# --------------------------------------------------------------------------- building
def boundaries(plan: Plan, rank_plan: RankPlan) -> tuple[Boundary | None, Boundary | None]:
    """This rank's cut with the previous stage and with the next one (None: no such stage),
    each tensor as it travels from its sender (``contract.plan.wire_spec``).

    Between TP groups of degrees d_s and d_{s+1} (every member holds the whole
    activation), receiver j takes its input from sender ``j % d_s`` and sends its input's
    gradient to every sender i with ``i % d_{s+1} == j``; sender i takes its output's
    gradient from receiver ``i % d_{s+1}`` and sends its output to every receiver j with
    ``j % d_s == i``. Without tensor parallelism: one peer each way."""
    replica = plan.replica_ranks(rank_plan.replica)
    unit_names = [u.name for u in plan.units]
    me = rank_plan.tp_rank
    prev = next_ = None
    if rank_plan.stage > 0:
        before = unit_names[unit_names.index(rank_plan.units[0]) - 1]
        cut = plan.cut_after(before)
        senders = plan.tp_group(replica[rank_plan.stage - 1].rank)
        specs = tuple(wire_spec(t, senders[0].precision) for t in cut.tensors)
        grads_to = tuple(r.rank for r in senders if r.tp_rank % rank_plan.tp_degree == me)
        source = senders[me % len(senders)].rank
        prev = Boundary(source, specs, f"cut after {before}", grads_to)
    if rank_plan.stage < len(replica) - 1:
        cut = plan.cut_after(rank_plan.units[-1])
        receivers = plan.tp_group(replica[rank_plan.stage + 1].rank)
        specs = tuple(wire_spec(t, rank_plan.precision) for t in cut.tensors)
        sends_to = tuple(r.rank for r in receivers if r.tp_rank % rank_plan.tp_degree == me)
        source = receivers[me % len(receivers)].rank
        next_ = Boundary(source, specs, f"cut after {rank_plan.units[-1]}", sends_to)
    return prev, next_


def _example_inputs(model_file: ModelFile, model: nn.Module, seed: int) -> dict[str, Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inputs, _ = model_file.sample_batch(2)
    return bind_inputs(model, inputs)


def rank_stage(
    plan: Plan,
    rank_plan: RankPlan,
    model_file: ModelFile,
    *,
    whole: bool = False,
    mesh: DeviceMesh | None = None,
) -> tuple[StageModule, Binder]:
    """Build this rank's stage with the plan's seed, materialising only its own tensors.

    The model is built on fake tensors and traced as the planner did; only the stage's
    parameters and buffers are then built for real, with a full build's values
    (``capture/materialise.py``). Where that cannot reproduce a full build, the whole model
    is built on the CPU as before, and one line on stderr says so. A stage that is the
    whole model is built whole.

    Args:
        whole: build the whole model on the CPU first in any case (what every rank did
            before; ``bench/stage_memory.py`` compares the two).
        mesh: the rank's TP group (``tp_degree`` > 1): the stage's parameters become
            DTensors over it (``tensor_parallel.shard_stage``).

    Raises:
        ModelFileError: ``build_model`` raises.
        PlanMismatchError: an input the plan feeds is missing, or the graph differs.
    """
    prev, next_ = boundaries(plan, rank_plan)
    recv = [t.name for t in prev.specs] if prev else []
    send = [t.name for t in next_.specs] if next_ else []
    reason: str | None = None
    if not whole and len(rank_plan.units) < len(plan.units):
        try:
            stage, model = _own_stage(plan, rank_plan, model_file, recv, send)
            return _sharded(stage, plan, model, mesh), _binder(model)
        except CannotMaterialise as exc:
            reason = str(exc)
    model = _build_whole(plan, model_file)
    example = _example_inputs(model_file, model, plan.training.seed)
    traced = _checked_trace(plan, model_file, model, example)
    stage = _split_stage(traced, plan, rank_plan, recv, send)
    if reason is not None:
        print(
            f"hplan: note: {stage_label(rank_plan)} built the whole model, not its stage "
            f"alone ({reason})",
            file=sys.stderr,
            flush=True,
        )
    return _sharded(stage, plan, model, mesh), _binder(model)


def _sharded(
    stage: StageModule, plan: Plan, model: nn.Module, mesh: DeviceMesh | None
) -> StageModule:
    """``stage`` with its parameters DTensors over ``mesh`` (None: as it is), on the
    mesh's device first: ``Module.to`` would replace DTensor parameters by new ones,
    dropping their gradient hooks."""
    if mesh is not None:
        stage.to(_mesh_device(mesh))
        shard_stage(stage, plan.model.tp_plan, mesh, embedding_paths(model))
    return stage


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device of this rank in ``mesh`` (``cuda``: the current one)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _split_stage(
    traced: TracedModel, plan: Plan, rank_plan: RankPlan, recv: list[str], send: list[str]
) -> StageModule:
    """The rank's stage cut from the traced model (its units, boundaries, recomputed units)."""
    return build_stage(
        traced,
        plan.units,
        rank_plan.units,
        recv=recv,
        send=send,
        recompute_units=rank_plan.recompute_units,
    )


def _own_stage(
    plan: Plan, rank_plan: RankPlan, model_file: ModelFile, recv: list[str], send: list[str]
) -> tuple[StageModule, nn.Module]:
    """The stage from a fake build, its tensors materialised (raises CannotMaterialise)."""
    try:
        record, traced = _fake_checked_trace(plan, model_file)
    except (TraceError, PlanMismatchError) as exc:
        raise CannotMaterialise(f"on fake tensors: {error_reason(exc)}") from None
    stage = _split_stage(traced, plan, rank_plan, recv, send)
    materialise(stage.graph_module, record, model_file.build_model, plan.training.seed)
    return stage, record.model


def _fake_checked_trace(plan: Plan, model_file: ModelFile) -> tuple[BuildRecord, TracedModel]:
    """The model built on fake tensors with the plan's seed and traced as the planner did,
    its fingerprint checked (raises CannotMaterialise, TraceError, PlanMismatchError)."""
    seed = plan.training.seed
    record = record_build(model_file.build_model, seed)
    example = _example_inputs(model_file, record.model, seed)
    fake = {k: record.fake_mode.from_tensor(v, static_shapes=True) for k, v in example.items()}
    return record, _checked_trace(plan, model_file, record.model, fake, record.fake_mode)


def _build_whole(plan: Plan, model_file: ModelFile) -> nn.Module:
    """Build the model with the plan's seed.

    Raises:
        ModelFileError: ``build_model`` raises.
    """
    torch.manual_seed(plan.training.seed)
    return model_file.build()


def _checked_trace(
    plan: Plan,
    model_file: ModelFile,
    model: nn.Module,
    example: Mapping[str, Tensor],
    fake_mode: FakeTensorMode | None = None,
) -> TracedModel:
    """Re-trace ``model`` exactly as the planner did (torch.export inside ``fake_mode``,
    when given) and check the graph fingerprint.

    Raises:
        PlanMismatchError: an input the plan feeds is missing, or the graph differs.
        TraceError: the plan's method fails on this model.
    """
    check_fed_inputs(plan, example)
    method = plan.model.trace_method
    exporting = method is TraceMethod.EXPORT
    context: contextlib.AbstractContextManager[Any] = (
        fake_mode if exporting and fake_mode is not None else contextlib.nullcontext()
    )
    with context:
        traced = trace_model(model, example, leaf_modules=plan.model.leaf_modules, method=method)
    fingerprint = traced.fingerprint()
    if fingerprint != plan.model.graph_fingerprint:
        raise PlanMismatchError(
            f"the model traced from {model_file.path} has graph fingerprint "
            f"{fingerprint[:12]}, the plan was made for "
            f"{plan.model.graph_fingerprint[:12]} (its graph or its parameter shapes differ); "
            "re-run `hplan solve` with this model file, or give the run the environment "
            "variables the model file read when it was planned"
        )
    return traced


def build_rank(
    plan: Plan,
    rank: int,
    model_path: str | Path | None,
    options: RunOptions,
    *,
    links: LinkDelay | None = None,
) -> RankParts:
    """Build this rank's stage, optimizer, data source and communication (no collectives).

    Args:
        links: the link delay of its point-to-point transfers (default: none).

    Raises:
        ModelFileError: the model file cannot be loaded.
        PlanMismatchError: the re-traced graph differs from the plan's fingerprint, the
            stage's parameters differ from the plan's, or a stage with batch norm gets a
            micro-batch of one sample.
        EnvironmentProblemError: the plan asks for a GPU this machine lacks.
    """
    rank_plan = plan.ranks[rank]
    device = rank_device(plan, rank_plan, options.device)
    check_tensor_parallel(plan)
    mesh = tp_mesh(plan, rank, device)  # collective: before anything of this rank can fail
    model_file = load_model_file(model_path or plan.model.path)
    if options.warn_model_change and rank_plan.local_rank == 0:
        warn_if_model_changed(plan, model_file)
    stage, binder = rank_stage(plan, rank_plan, model_file, mesh=mesh)
    check_batch_statistics_floor(rank_plan, stage)
    prev, next_ = boundaries(plan, rank_plan)
    if mesh is None:  # a TP stage is on its device already (``_sharded``)
        stage.to(device)
    params = tuple(stage.canonical_parameters())
    optimizer = build_optimizer(plan, rank, model_file, params, device)
    source = BatchSource(
        model_file, binder, plan.training.seed, plan.global_batch_size, plan.model.inputs
    )
    comm = StageComm(
        rank,
        device,
        prev,
        next_,
        delay=links or LinkDelay(),
        post_ahead=run_backend(plan, options) == "gloo",
    )
    configure_matmul_precision(device, rank_plan.precision)
    return RankParts(
        plan,
        rank_plan,
        device,
        model_file,
        stage,
        params,
        optimizer,
        source,
        comm,
        scaler=loss_scaler(plan, device),
        mesh=mesh,
    )


def tp_mesh(plan: Plan, rank: int, device: torch.device) -> DeviceMesh | None:
    """This rank's TP group as a ``DeviceMesh`` (None: its stage has ``tp_degree`` 1).
    Creates the process group of every TP group of the plan, on every rank in the same
    order (``new_group`` is collective over the world); nothing without TP stages.

    Raises:
        PeerFailureError: creating a group failed.
    """
    if not plan.tensor_parallel:
        return None
    timeout_s = plan.training.process_group_timeout_s
    mine = None
    for ranks in tp_rank_groups(plan):
        group = new_group(ranks, timeout_s, "tensor-parallel")
        if rank in ranks:
            mine = group
    if mine is None:
        return None
    return DeviceMesh.from_group(mine, device.type)


def build_optimizer(
    plan: Plan,
    rank: int,
    model_file: ModelFile,
    params: Sequence[tuple[str, nn.Parameter]],
    device: torch.device,
) -> torch.optim.Optimizer:
    """The model file's optimizer over the stage's trainable parameters; under
    ``training.zero_stage`` 1 or 2 it steps only this rank's shards of the parameters it shares
    with other ranks (``zero.shard_optimizer``, which makes those parameters views of its
    flat buffers).

    A stage without a trainable parameter (every parameter frozen, or none at all) gets the
    model file's optimizer over one empty placeholder parameter instead (``torch.optim``
    refuses an empty list): it steps nothing, holds no state of a model parameter
    (checkpoints save optimizer state by canonical name only), and keeps the
    hyperparameters an LR scheduler reads, so that the training step, the scheduler, the
    loss scaler and the checkpoints treat the rank like any other.

    Args:
        params: the stage's parameters by canonical name.
        device: where the placeholder lives (the rank's device).

    Raises:
        ModelFileError: under ZeRO (stage 1 or 2), an optimizer that cannot be sharded
            (``zero.shard_optimizer``); under ``optimizer_offload``, one that is not a
            ``torch.optim.Optimizer`` (``offload.offload_optimizer`` moves it to the host).
    """
    trainable = [p for _, p in params if p.requires_grad]
    if not trainable:
        placeholder = nn.Parameter(torch.empty(0, device=device))
        empty: torch.optim.Optimizer = model_file.optimizer([placeholder])
        return empty
    optimizer: torch.optim.Optimizer = model_file.optimizer(trainable)
    if plan.ranks[rank].optimizer_offload:  # never with ZeRO (``Plan.verify``)
        return offload_optimizer(_checked_torch_optimizer(optimizer), model_file.optimizer, device)
    if plan.training.zero_stage is ZeroStage.NONE:
        return optimizer
    return shard_optimizer(plan, rank, optimizer, params, model_file.optimizer)


def _checked_torch_optimizer(optimizer: object) -> torch.optim.Optimizer:
    """``optimizer`` when it is a ``torch.optim.Optimizer`` (what offload can move).

    Raises:
        ModelFileError: it is not.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ModelFileError(
            f"make_optimizer() returned a {type(optimizer).__name__}; optimizer_offload moves "
            "a torch.optim.Optimizer's state to host memory: return one, or plan without "
            "offload (hplan solve --offload never)"
        )
    return optimizer


def check_graph_early(plan: Plan, model_file: ModelFile) -> None:
    """Trace the model as the ranks will and check its fingerprint against the plan's, so
    that a model file whose graph changed is refused before any work (rehearse's whole-model
    timing, the ranks' start). On fake tensors; a mismatch there is confirmed on real CPU
    tensors (as a rank would fall back to). Where the model cannot be traced here, the
    ranks report it.

    Raises:
        PlanMismatchError: the graph differs from the plan's (the ranks' message).
        ModelFileError: ``build_model`` raises.
    """
    try:
        _fake_checked_trace(plan, model_file)
        return
    except (CannotMaterialise, TraceError, PlanMismatchError):
        pass  # confirmed (or not) on real tensors below
    model = _build_whole(plan, model_file)
    example = _example_inputs(model_file, model, plan.training.seed)
    try:
        _checked_trace(plan, model_file, model, example)
    except TraceError:
        return


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
