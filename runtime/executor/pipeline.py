"""One optimizer step of one rank: its pipeline schedule, loss, and backward passes.

:class:`StepRunner` walks the rank's action list (``contract/schedule.py``): a forward
receives the previous stage's boundary tensors, runs the stage and sends its outputs on,
checked against the plan before any cast (``contract.plan.wire_spec``); the last stage
computes the weighted loss instead. A backward receives the gradients of those outputs, runs
autograd and sends back the gradients of what it received. The gradient buckets are summed
as they become final in the last backward (``grad_sync.py``); then the optimizer steps.
Every block runs in the rank's compute clock (``seams.ComputeClock``).

A failed action prints the replica's schedule above its one-line error
(:func:`schedule_table`, in ``torch.distributed.pipelining``'s notation: ``1F3`` is stage
1's forward of micro-batch 3). It and :func:`pipelining_action` are the one adapter to that
module, through private names of torch that ``tests/runtime/test_schedule.py`` pins.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

from hplan.runtime.capture.loss_items import count_items
from hplan.runtime.capture.model_file import ModelFile, checked_loss
from hplan.runtime.capture.segments import running_stats_kept
from hplan.runtime.capture.stage import StageModule
from hplan.runtime.contract.errors import HplanError, PeerFailureError
from hplan.runtime.contract.plan import (
    LossConvention,
    MemoryStrategy,
    Plan,
    RankPlan,
    microbatch_sizes,
    wire_spec,
)
from hplan.runtime.contract.schedule import Action, ActionKind, build_schedule
from hplan.runtime.contract.timeline_file import ALL_REDUCE, COMPUTE, WAIT, TimelineRecorder
from hplan.runtime.executor.comm import StageComm, torch_dtype
from hplan.runtime.executor.data import BatchSource, MicroBatch, stage_inputs
from hplan.runtime.executor.grad_sync import (
    GradBucket,
    GradClip,
    GradSync,
    loss_denominator,
    loss_sample_ranges,
    loss_weight,
)
from hplan.runtime.executor.memory.tensor_parallel import plain, replicated_inputs
from hplan.runtime.executor.memory.zero import ShardSync
from hplan.runtime.executor.precision import autocast
from hplan.runtime.executor.seams import ComputeClock, Phase

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    # 0.45 s to import (DTensor, sympy): the scaler is built only for fp16 plans.
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


def _zero_loss(outputs: Any) -> Tensor:
    """A loss of 0 whose gradient reaches every output that needs one (as zeros)."""
    leaves = [t for t in tree_flatten(outputs)[0] if isinstance(t, Tensor) and t.requires_grad]
    if not leaves:
        return torch.zeros(())
    return torch.stack([t.float().sum() * 0.0 for t in leaves]).sum()


def stage_label(rank_plan: RankPlan) -> str:
    """E.g. ``"stage 2 of replica 0 (rank 2, units blocks.3..head)"``."""
    units = (
        rank_plan.units[0]
        if len(rank_plan.units) == 1
        else (f"{rank_plan.units[0]}..{rank_plan.units[-1]}")
    )
    return (
        f"stage {rank_plan.stage} of replica {rank_plan.replica} "
        f"(rank {rank_plan.rank}, units {units})"
    )


@dataclass(frozen=True)
class RankParts:
    """What one rank holds while training (built once, by ``worker.build_rank``)."""

    plan: Plan
    rank_plan: RankPlan
    device: torch.device
    model_file: ModelFile
    stage: StageModule
    params: tuple[tuple[str, torch.nn.Parameter], ...]
    """The stage's parameters by canonical name (``StageModule.canonical_parameters``)."""
    optimizer: torch.optim.Optimizer
    source: BatchSource
    comm: StageComm
    scaler: ShardedGradScaler | None = None
    """The job's shared loss scaler when some rank computes in fp16 (``precision.py``)."""
    mesh: DeviceMesh | None = None
    """The rank's TP group when its stage has ``tp_degree`` > 1 (``tensor_parallel.py``:
    its parameters are DTensors over it); None otherwise."""


@dataclass
class _InFlight:
    """What a micro-batch's forward left for its backward."""

    received: dict[str, Tensor]
    inputs: dict[str, Tensor]
    outputs: dict[str, Any] | None = None
    loss: Tensor | None = None
    rng_state: tuple[Tensor, Tensor | None] | None = None
    """CPU and (on a GPU) device RNG state before the forward, for recomputation."""


@dataclass(frozen=True)
class StepTimes:
    """Seconds spent in one step, by kind (see ``contract/metrics_file.py``)."""

    compute_s: float = 0.0
    """Forwards and backwards."""
    forward_s: float = 0.0
    """The forward part of ``compute_s``."""
    allreduce_s: float = 0.0
    """Blocked in gradient all-reduces: waiting after the schedule for the buckets, and the
    gradient-norm sum of clipping; under ZeRO stage 1 also the all-gather of the updated
    shards."""
    optimizer_s: float = 0.0
    allreduce_overlapped_s: float = 0.0
    """From the first bucket's launch, during the last backward pass, to the end of the
    schedule: how long the reductions ran beside compute (0: none was launched early)."""
    compute_cpu_s: float = 0.0
    """CPU seconds of the forwards and backwards (``ComputeSpan.cpu_s``; 0: not measured)."""
    optimizer_cpu_s: float = 0.0
    """CPU seconds of the optimizer step (0: not measured)."""


class StepRunner:
    """Runs one optimizer step of one rank: its schedule, gradient sync and optimizer.

    Per step: :meth:`run`, :meth:`unscale_gradients`, :meth:`clip_gradients`, then
    :meth:`optimizer_step`, then :meth:`finish_step` (which reads the compute clock's spans
    into :attr:`times` and :attr:`timeline`).

    Args:
        clip: the rank's global-norm clipping (``MAX_GRAD_NORM``); None: no clipping.
        shards: under ZeRO stage 1, the broadcasts of the rank's updated shards after each
            optimizer step (``zero.ShardSync``); None: the optimizer is not sharded.
    """

    def __init__(
        self,
        parts: RankParts,
        buckets: list[GradBucket],
        clock: ComputeClock,
        clip: GradClip | None = None,
        shards: ShardSync | None = None,
    ) -> None:
        self.parts = parts
        self.buckets = buckets
        self.sync = GradSync(buckets)
        self.clip = clip
        self.shards = shards
        self.clock = clock
        rank_plan = parts.rank_plan
        self.sizes = microbatch_sizes(rank_plan.num_samples, rank_plan.micro_batch_size)
        num_stages = len(parts.plan.replica_ranks(rank_plan.replica))
        self.stages = build_schedule(parts.plan.training.schedule, num_stages, len(self.sizes))
        self.actions = self.stages[rank_plan.stage]
        backwards = [i for i, a in enumerate(self.actions) if a.kind is ActionKind.BACKWARD]
        self._last_backward = backwards[-1] if backwards else None
        """Index of the rank's last backward action: gradients are final after it."""
        self.offset = parts.plan.sample_offset(rank_plan.replica)
        self.loss_samples = loss_denominator(parts.plan, rank_plan.rank)
        """What the weighted loss is a mean over: the global batch, or the rank's island's
        samples when islands train on their own (``grad_sync.loss_denominator``)."""
        self.token_mean = parts.plan.model.loss_convention is LossConvention.TOKEN_MEAN
        """Weight micro-batches by target tokens, not samples (``contract.LossConvention``)."""
        self._step_items = 0
        """Under a token mean, the tokens that this step's loss is a mean over."""
        self.label = stage_label(rank_plan)
        self.recompute = rank_plan.memory_strategy is MemoryStrategy.RECOMPUTE
        self.times = StepTimes()
        self.timeline = TimelineRecorder(rank_plan.rank)
        self._allreduce_s = 0.0
        self._overlapped_s = 0.0
        self._traced_float32 = _traced_float32_inputs(parts.plan, rank_plan)
        self._narrowed = _narrowed_outputs(parts.plan, rank_plan)
        self._flight: dict[int, _InFlight] = {}
        self._losses: list[Tensor] = []
        self._batches: list[MicroBatch] = []

    # ----------------------------------------------------------------- one step
    def run(self, step: int) -> float | None:
        """Run step ``step``'s schedule and gradient sync; return this replica's mean loss on
        a last stage, else None.

        Raises:
            HplanError: an action failed (the schedule table is printed on stderr first).
        """
        parts = self.parts
        comm = parts.comm
        self.timeline = TimelineRecorder(parts.rank_plan.rank)
        self._losses = []
        self._batches = parts.source.microbatches(step, self.offset, self.num_samples, self.sizes)
        if self.token_mean and parts.stage.is_last:
            ranges = loss_sample_ranges(parts.plan, parts.rank_plan.rank)
            self._step_items = parts.source.loss_items(step, ranges)
        for index, action in enumerate(self.actions):
            if comm.post_ahead:  # this action's receive, then the next one's
                for upcoming in self.actions[index : index + 2]:
                    self._post_recv(upcoming)
            if index == self._last_backward:
                self.sync.arm()
            try:
                self._run_action(action)
            except HplanError as exc:
                self._report_schedule(exc, step, index)
                raise
        with self.timeline.span(WAIT, "send completion"):
            comm.wait_sends()
        self._sync_gradients()
        if not self._losses or parts.rank_plan.tp_rank > 0:  # a TP group's loss: its lead's
            return None
        total = torch.stack([loss.float() for loss in self._losses]).sum()
        return float(total) * self.loss_samples / self.num_samples

    @property
    def num_samples(self) -> int:
        """Samples of the global batch this rank's replica computes a step (its share)."""
        return sum(self.sizes)

    def reshare(self, offset: int, sizes: tuple[int, ...]) -> None:
        """Take samples ``[offset, offset + sum(sizes))`` of the global batch from the next
        step on, cut into ``sizes`` (as many micro-batches as before:
        ``rebalance.ShareBalancer``)."""
        assert len(sizes) == len(self.sizes) and all(n > 0 for n in sizes)
        self.offset, self.sizes = offset, sizes

    def _sync_gradients(self) -> None:
        """Wait for the gradient buckets (``GradSync.finish``); time the wait and what ran
        before it, and put every bucket on the timeline."""
        start_s = time.monotonic()
        self.sync.finish(self.clock.timeline_s)
        self._allreduce_s = time.monotonic() - start_s
        launched = [self.clock.timeline_s(b.launched_s) for b in self.buckets]
        self._overlapped_s = max(0.0, start_s - min(launched, default=start_s))
        for bucket, launched_s in zip(self.buckets, launched, strict=True):
            label = "all-reduce ranks " + ",".join(str(r) for r in bucket.ranks)
            names = [n for n, _ in bucket.params]
            self.timeline.add(
                ALL_REDUCE, label, launched_s, bucket.done_s, first=names[0], params=len(names)
            )

    def unscale_gradients(self) -> None:
        """Under loss scaling, divide the synced gradients by the scale and vote on
        whether any rank's are non-finite (``precision.py``; a collective of every rank).
        Call after :meth:`run`, before reading or clipping gradients."""
        if self.parts.scaler is not None:
            self.parts.scaler.unscale_(self.parts.optimizer)

    def clip_gradients(self) -> float | None:
        """With ``MAX_GRAD_NORM``: clip the synced, unscaled gradients to that global norm
        and return the norm before clipping (``grad_sync.GradClip``; a collective of every
        rank, timed as all-reduce); without it, None. Call after :meth:`unscale_gradients`.
        """
        if self.clip is None:
            return None
        start_s = time.monotonic()
        with self.timeline.span(ALL_REDUCE, "all-reduce gradient norm, all ranks"):
            norm = self.clip.clip()
        self._allreduce_s += time.monotonic() - start_s
        return norm

    def optimizer_step(self) -> bool:
        """Apply the optimizer to the synced (unscaled) gradients, then drop them; under
        ZeRO stage 1 then send the updated shards to their other holders (a collective of
        each holder set, timed as all-reduce; none after a skipped step, which changed
        nothing on any rank).

        Returns:
            False when loss scaling skipped the step (a non-finite gradient on some rank;
            every rank skips it and halves the scale), else True.
        """
        scaler = self.parts.scaler
        with self.clock.optimizer():
            if scaler is None:
                self.parts.optimizer.step()
                stepped = True
            else:
                scale = scaler.get_scale()
                scaler.step(self.parts.optimizer)
                scaler.update()
                stepped = scaler.get_scale() >= scale
            self.parts.optimizer.zero_grad(set_to_none=True)
        if stepped and self.shards is not None:
            start_s = time.monotonic()
            with self.timeline.span(ALL_REDUCE, "all-gather optimizer shards"):
                self.shards.all_gather()
            self._allreduce_s += time.monotonic() - start_s
        return stepped

    def finish_step(self) -> StepTimes:
        """This step's compute spans from the clock: into :attr:`times` and the timeline."""
        compute_s = forward_s = optimizer_s = compute_cpu_s = optimizer_cpu_s = 0.0
        for span in self.clock.take_spans():
            self.timeline.add(COMPUTE, span.label, span.start_s, span.end_s)
            if span.phase is Phase.OPTIMIZER:
                optimizer_s += span.duration_s
                optimizer_cpu_s += span.cpu_s
                continue
            compute_s += span.duration_s
            compute_cpu_s += span.cpu_s
            if span.phase is Phase.FORWARD:
                forward_s += span.duration_s
        self.times = StepTimes(
            compute_s,
            forward_s,
            self._allreduce_s,
            optimizer_s,
            self._overlapped_s,
            compute_cpu_s,
            optimizer_cpu_s,
        )
        return self.times

    # ----------------------------------------------------------------- for a compute clock
    def replay_forward(
        self, stage: torch.nn.Module, mb: MicroBatch, inputs: Mapping[str, Tensor],
        received: Mapping[str, Tensor],
    ) -> tuple[dict[str, Any], Tensor | None]:  # fmt: skip
        """One forward of ``stage`` (the rank's stage or a copy) with autograd on, and the
        weighted loss on a last stage (None elsewhere); nothing is sent."""
        with torch.enable_grad(), self._autocast():
            outputs = self._to_wire(stage(inputs, self._from_wire(received)))
            loss = self._loss(outputs, mb) if self.parts.stage.is_last else None
        return outputs, loss

    def backward_pairs(
        self, outputs: dict[str, Any] | None, loss: Tensor | None, grads: Mapping[str, Tensor]
    ) -> tuple[list[Tensor], list[Tensor | None]]:
        """What to backpropagate: the loss on a last stage, else each output that needs a
        gradient with the gradient the next stage sent for it."""
        if self.parts.stage.is_last:
            assert loss is not None
            if self.parts.scaler is not None:
                loss = self.parts.scaler.scale(loss)
            return ([loss], [None]) if loss.requires_grad else ([], [])
        assert outputs is not None
        pairs = [
            (outputs[name], grad)
            for name, grad in grads.items()
            if isinstance(outputs[name], Tensor) and outputs[name].requires_grad
        ]
        return [t for t, _ in pairs], [g for _, g in pairs]

    # ----------------------------------------------------------------- actions
    def _post_recv(self, action: Action) -> None:
        """Post the receive ``action`` will wait for, if any (``comm.py``: gloo only)."""
        comm, mb = self.parts.comm, self._batches[action.microbatch]
        if action.kind is ActionKind.FORWARD and comm.prev is not None:
            comm.post_activations_recv(mb.index, mb.num_samples)
        elif action.kind is ActionKind.BACKWARD and comm.next is not None:
            comm.post_grads_recv(mb.index, mb.num_samples)

    def _run_action(self, action: Action) -> None:
        mb = self._batches[action.microbatch]
        if action.kind is ActionKind.FORWARD:
            self._forward(action, mb)
        else:
            self._backward(action, mb)

    def _report_schedule(self, exc: HplanError, step: int, index: int) -> None:
        """Show where in the replica's schedule an action failed: the rank-by-step table on
        stderr when this rank's own action failed, above its one-line error; only as a note
        on the error when a peer failed (the peer's log has the cause, and the error stays
        one line)."""
        rank_plan = self.parts.rank_plan
        ranks = [r.rank for r in self.parts.plan.replica_ranks(rank_plan.replica)]
        table = schedule_table(self.stages, ranks, failed=(rank_plan.stage, index))
        action = self.actions[index]
        header = (
            f"hplan: rank {rank_plan.rank}: step {step} failed at action "
            f"{action.pipelining_notation()} ({action}), step {index} of replica "
            f"{rank_plan.replica}'s schedule:"
        )
        if isinstance(exc, PeerFailureError):
            exc.add_note(f"{header}\n{table}")
            return
        print(f"{header}\n{table}", file=sys.stderr, end="", flush=True)

    def _forward(self, action: Action, mb: MicroBatch) -> None:
        parts = self.parts
        received = {}
        if parts.comm.prev:
            stage = parts.rank_plan.stage
            with self.timeline.span(WAIT, f"wait F.mb{mb.index} from s{stage - 1}"):
                received = parts.comm.recv_activations(mb.index, mb.num_samples)
        inputs = {
            name: tensor.to(parts.device)
            for name, tensor in stage_inputs(
                mb.inputs, parts.stage.input_names, stage_label=self.label
            ).items()
        }
        flight = _InFlight(received, inputs)
        if self.recompute:
            flight.rng_state = _rng_state(parts.device)
        with (
            self.clock.forward(str(action), mb, inputs, received),
            torch.set_grad_enabled(not self.recompute),
            self._autocast(),
        ):
            outputs = self._to_wire(parts.stage(inputs, self._from_wire(received)))
            if parts.stage.is_last:
                flight.loss = self._loss(outputs, mb)
                self._losses.append(flight.loss.detach())
        if not self.recompute and not parts.stage.is_last:
            flight.outputs = outputs
        self._flight[mb.index] = flight
        if parts.comm.next is not None:
            parts.comm.send_activations(mb.index, mb.num_samples, outputs)

    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        return autocast(self.parts.device, self.parts.rank_plan.precision)

    def _to_wire(self, outputs: dict[str, Any]) -> dict[str, Any]:
        """Cast the float32 outputs that the plan sends narrower to the dtype they travel in
        (``contract.plan.wire_spec``: under autocast; nothing otherwise). Any other dtype
        is left as it is, so that the send's check against the plan
        (``comm.check_boundary_tensors``) sees the real tensor. The cast is part of the
        autograd graph, so the gradient that comes back in that dtype flows through it.
        A TP stage's DTensor outputs are made whole plain tensors first."""
        if self.parts.mesh is not None:
            outputs = plain(outputs)
        if not self._narrowed:
            return outputs
        cast = dict(outputs)
        for name, dtype in self._narrowed.items():
            value = cast.get(name)
            if isinstance(value, Tensor) and value.dtype == torch.float32:
                cast[name] = value.to(dtype)
        return cast

    def _from_wire(self, received: Mapping[str, Tensor]) -> Mapping[str, Any]:
        """Received tensors as this stage computes on them: half-precision float32
        tensors back in float32 on a rank without autocast (else as they came); on a TP
        stage as ``Replicate`` DTensors (``tensor_parallel.replicated_inputs``)."""
        values = self._widened(received)
        mesh = self.parts.mesh
        return values if mesh is None else replicated_inputs(values, mesh)

    def _widened(self, received: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        if (
            self.parts.rank_plan.precision.autocast_dtype is not None
            or self.parts.comm.prev is None
        ):
            return received
        narrowed = {
            spec.name for spec in self.parts.comm.prev.specs if spec.dtype != "float32"
        } & self._traced_float32
        return {name: t.float() if name in narrowed else t for name, t in received.items()}

    def _loss(self, outputs: dict[str, Any], mb: MicroBatch) -> Tensor:
        targets = _to_device(mb.targets, self.parts.device)
        if not self.token_mean:
            loss = checked_loss(self.parts.model_file, outputs["output"], targets)
            return loss.reshape(()) * loss_weight(mb.num_samples, self.loss_samples)
        items = count_items(mb.targets)
        if items == 0:  # all padding: a mean over no tokens is nan; it adds nothing
            return _zero_loss(outputs["output"])
        loss = checked_loss(self.parts.model_file, outputs["output"], targets)
        return loss.reshape(()) * loss_weight(items, self._step_items)

    def _backward(self, action: Action, mb: MicroBatch) -> None:
        parts = self.parts
        flight = self._flight.pop(mb.index)
        grads = {}
        if parts.comm.next:
            stage = parts.rank_plan.stage
            with self.timeline.span(WAIT, f"wait B.mb{mb.index} from s{stage + 1}"):
                grads = parts.comm.recv_grads(mb.index, mb.num_samples)
        with self.clock.backward(str(action), mb, grads):
            if self.recompute:
                self._recompute(flight, mb)
            tensors, grad_tensors = self.backward_pairs(flight.outputs, flight.loss, grads)
            if tensors:
                torch.autograd.backward(tensors, grad_tensors)
        if parts.comm.prev is not None:
            parts.comm.send_grads(mb.index, mb.num_samples, flight.received)

    def _recompute(self, flight: _InFlight, mb: MicroBatch) -> None:
        assert flight.rng_state is not None
        device = self.parts.device
        with (
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
            running_stats_kept(self.parts.stage),
        ):
            _set_rng_state(device, flight.rng_state)
            with self._autocast():
                received = self._from_wire(flight.received)
                flight.outputs = self._to_wire(self.parts.stage(flight.inputs, received))
                if self.parts.stage.is_last:
                    flight.loss = self._loss(flight.outputs, mb)


def _traced_float32_inputs(plan: Plan, rank_plan: RankPlan) -> frozenset[str]:
    """Names of the float32 tensors (as traced) this rank receives from its previous stage."""
    if rank_plan.stage == 0:
        return frozenset()
    before = plan.units[[u.name for u in plan.units].index(rank_plan.units[0]) - 1].name
    return frozenset(t.name for t in plan.cut_after(before).tensors if t.dtype == "float32")


def _narrowed_outputs(plan: Plan, rank_plan: RankPlan) -> dict[str, torch.dtype]:
    """The float32 tensors (as traced) this rank sends its next stage in a narrower dtype,
    by name: the autocast dtype of a bf16/fp16 rank (``contract.plan.wire_spec``)."""
    replica = plan.replica_ranks(rank_plan.replica)
    if rank_plan.stage == len(replica) - 1:
        return {}
    cut = plan.cut_after(rank_plan.units[-1])
    wire = [wire_spec(t, rank_plan.precision) for t in cut.tensors]
    return {w.name: torch_dtype(w.dtype) for t, w in zip(cut.tensors, wire, strict=True) if w != t}


def _to_device(value: Any, device: torch.device) -> Any:
    return tree_map(lambda x: x.to(device) if isinstance(x, Tensor) else x, value)


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state: tuple[Tensor, Tensor | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


# --------------------------------------------------------------------------- pipelining notation
# torch.distributed.pipelining is imported where a schedule is printed, not at start-up: it
# imports torch._dynamo, about 0.4 s of every rank's start on a CPU.
def pipelining_action(action: Action) -> Any:
    """``action`` as ``torch.distributed.pipelining``'s ``_Action`` (same text: ``1F3``)."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    kinds = {
        ActionKind.FORWARD: _ComputationType.FORWARD,
        ActionKind.BACKWARD: _ComputationType.FULL_BACKWARD,
    }
    return _Action(action.stage, kinds[action.kind], action.microbatch)


def schedule_table(
    stages: Sequence[Sequence[Action]],
    ranks: Sequence[int],
    *,
    failed: tuple[int, int] | None = None,
) -> str:
    """A replica's schedule as a rank-by-step grid, one column per stage.

    Args:
        stages: each stage's actions, in stage order.
        ranks: the plan rank that runs each stage (the grid's columns ``Rank 0..`` are the
            stages; a first line names their plan ranks).
        failed: ``(stage, action index)`` of the action that failed: the row of that index
            is marked ``<-- ERROR HERE`` (rows are positions in each stage's own list, not
            moments in time: the other columns show each stage's action at that position).

    Returns:
        Lines of text ending with a newline.
    """
    from torch.distributed.pipelining.schedules import _format_pipeline_order

    order: dict[int, list[Any]] = {
        stage: [pipelining_action(a) for a in actions] for stage, actions in enumerate(stages)
    }
    columns = ", ".join(f"Rank {stage} = plan rank {rank}" for stage, rank in enumerate(ranks))
    grid = _format_pipeline_order(order, error_step_number=None if failed is None else failed[1])
    return f"columns: {columns}\n{grid}"
