"""One optimizer step of one rank: its pipeline schedule, loss, and backward passes.

:class:`StepRunner` walks the rank's action list (``schedule.py``): a forward receives the
previous stage's boundary tensors, runs the stage on the graph inputs it reads and sends
its outputs on (the last stage computes the weighted loss instead); a backward receives the
gradients of those outputs, runs autograd and sends the gradients of what it received
back. Then gradients are summed among their holders (``grad_sync.py``) and the optimizer
steps.

Memory strategy ``recompute``: the forward runs without autograd and keeps only its inputs;
the backward re-runs it (same RNG state) with autograd, then backpropagates.

Emulation (``RankState.compute``, see ``worker.ComputeEmulation``): every forward and
backward either lasts ``stretch`` times its CPU time (from the second step: times the
stage's warm CPU time of that phase and micro-batch size, ``warm_compute.py``), or at least
its modelled duration, by sleeping after it (``_ComputeTimer``); the optimizer step
likewise.

Timeline: each step records, on ``StepRunner.timeline``, when every forward, backward,
blocking receive, send completion, all-reduce and optimizer step started and ended
(``runtime/contract/timeline_file.py``; names like the schedule's ``s1.F.mb3``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from hplan.runtime.capture.model_file import checked_loss
from hplan.runtime.contract.plan import MemoryStrategy, RankPlan, microbatch_sizes
from hplan.runtime.contract.schedule import Action, ActionKind, build_schedule
from hplan.runtime.contract.timeline_file import ALL_REDUCE, COMPUTE, WAIT, TimelineRecorder
from hplan.runtime.executor.data import MicroBatch, stage_inputs
from hplan.runtime.executor.grad_sync import loss_weight
from hplan.runtime.rehearsal.warm_compute import Sample, WarmTimer

if TYPE_CHECKING:
    from hplan.runtime.executor.worker import RankState


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


@dataclass
class _InFlight:
    """What a micro-batch's forward left for its backward."""

    received: dict[str, Tensor]
    inputs: dict[str, Tensor]
    outputs: dict[str, Any] | None = None
    loss: Tensor | None = None
    rng_state: tuple[Tensor, Tensor | None] | None = None
    """CPU and (on a GPU) device RNG state before the forward, for recomputation."""


@dataclass
class StepTimes:
    """Seconds spent in one step, by kind (see ``metrics.py``)."""

    compute_s: float = 0.0
    forward_s: float = 0.0
    """The forward part of ``compute_s``."""
    allreduce_s: float = 0.0
    optimizer_s: float = 0.0


class StepRunner:
    """Runs one optimizer step of one rank: its schedule, gradient sync and optimizer."""

    def __init__(self, state: RankState) -> None:
        self.state = state
        rank_plan = state.rank_plan
        self.sizes = microbatch_sizes(rank_plan.num_samples, rank_plan.micro_batch_size)
        num_stages = len(state.plan.replica_ranks(rank_plan.replica))
        self.actions = build_schedule(state.plan.training.schedule, num_stages, len(self.sizes))[
            rank_plan.stage
        ]
        self.offset = state.plan.sample_offset(rank_plan.replica)
        self.label = stage_label(rank_plan)
        self.recompute = rank_plan.memory_strategy is MemoryStrategy.RECOMPUTE
        self.times = StepTimes()
        self.timeline = TimelineRecorder(rank_plan.rank)
        self._flight: dict[int, _InFlight] = {}
        self._losses: list[Tensor] = []
        self._batches: list[MicroBatch] = []
        self._samples: dict[int, Sample] = {}
        """Stretched emulation, until timed: one micro-batch of each size (warm_compute)."""

    def run(self, step: int) -> float | None:
        """Run step ``step``; return this replica's mean loss on a last stage, else None."""
        state = self.state
        self.times = StepTimes()
        self.timeline = TimelineRecorder(state.rank_plan.rank)
        self._losses = []
        self._batches = state.source.microbatches(
            step, self.offset, state.rank_plan.num_samples, self.sizes
        )
        for index, action in enumerate(self.actions):
            if state.comm.post_ahead:  # this action's receive, then the next one's
                for upcoming in self.actions[index : index + 2]:
                    self._post_recv(upcoming)
            self._run_action(action)
        with self.timeline.span(WAIT, "send completion"):
            state.comm.wait_sends()
        start_s = time.monotonic()
        for bucket in state.buckets:
            label = "all-reduce ranks " + ",".join(str(r) for r in bucket.ranks)
            with self.timeline.span(ALL_REDUCE, label):
                bucket.all_reduce()
        self.times.allreduce_s = time.monotonic() - start_s
        if not self._losses:
            return None
        total = torch.stack([loss.float() for loss in self._losses]).sum()
        return float(total) * state.plan.global_batch_size / state.rank_plan.num_samples

    def optimizer_step(self) -> None:
        """Apply the optimizer to the synced gradients, then drop them.

        Emulated like forward and backward: at least ``optimizer_s`` (modelled) and at
        least ``stretch`` x its CPU time (stretched: the optimizer is device compute too).
        """
        start_s = time.monotonic()
        start_cpu_s = time.thread_time()
        self.state.optimizer.step()
        self.state.optimizer.zero_grad(set_to_none=True)
        compute = self.state.compute
        if compute.warm is not None:
            floor_s, stretched_s = compute.stretch * compute.warm.optimizer_s, 0.0
        else:
            floor_s = compute.optimizer_s
            stretched_s = compute.stretch * (time.thread_time() - start_cpu_s)
        _sleep_until(start_s + max(floor_s, stretched_s))
        self.times.optimizer_s = time.monotonic() - start_s
        self.timeline.add(COMPUTE, "optimizer", start_s, start_s + self.times.optimizer_s)

    def _post_recv(self, action: Action) -> None:
        """Post the receive ``action`` will wait for, if any (``comm.py``: gloo only)."""
        comm, mb = self.state.comm, self._batches[action.microbatch]
        if action.kind is ActionKind.FORWARD and comm.prev is not None:
            comm.post_activations_recv(mb.index, mb.num_samples)
        elif action.kind is ActionKind.BACKWARD and comm.next is not None:
            comm.post_grads_recv(mb.index, mb.num_samples)

    def _run_action(self, action: Action) -> None:
        if action.kind is ActionKind.FORWARD:
            self._forward(self._batches[action.microbatch])
        else:
            self._backward(self._batches[action.microbatch])

    def _forward(self, mb: MicroBatch) -> None:
        state = self.state
        received = {}
        if state.comm.prev:
            stage = state.rank_plan.stage
            with self.timeline.span(WAIT, f"wait F.mb{mb.index} from s{stage - 1}"):
                received = state.comm.recv_activations(mb.index, mb.num_samples)
        inputs = {
            name: tensor.to(state.device)
            for name, tensor in stage_inputs(
                mb.inputs, state.stage.input_names, stage_label=self.label
            ).items()
        }
        flight = _InFlight(received, inputs)
        if self.recompute:
            flight.rng_state = _rng_state(state.device)
        self._record_sample(mb, inputs, received)
        forward = self._timed_compute(ActionKind.FORWARD, mb)
        with forward, torch.set_grad_enabled(not self.recompute):
            outputs = state.stage(inputs, received)
            if state.stage.is_last:
                flight.loss = self._loss(outputs, mb)
                self._losses.append(flight.loss.detach())
        if not self.recompute and not state.stage.is_last:
            flight.outputs = outputs
        self._flight[mb.index] = flight
        if state.comm.next is not None:
            state.comm.send_activations(mb.index, mb.num_samples, outputs)

    def _loss(self, outputs: dict[str, Any], mb: MicroBatch) -> Tensor:
        targets = _to_device(mb.targets, self.state.device)
        loss = checked_loss(self.state.model_file, outputs["output"], targets)
        return loss.reshape(()) * loss_weight(mb.num_samples, self.state.plan.global_batch_size)

    def _backward(self, mb: MicroBatch) -> None:
        state = self.state
        flight = self._flight.pop(mb.index)
        grads = {}
        if state.comm.next:
            stage = state.rank_plan.stage
            with self.timeline.span(WAIT, f"wait B.mb{mb.index} from s{stage + 1}"):
                grads = state.comm.recv_grads(mb.index, mb.num_samples)
        sample = self._samples.get(mb.num_samples)
        if sample is not None and sample.microbatch is mb:
            sample.grads = {name: g.detach().clone() for name, g in grads.items()}
        with self._timed_compute(ActionKind.BACKWARD, mb):
            if self.recompute:
                self._recompute(flight, mb)
            tensors, grad_tensors = self._backward_pairs(flight, grads)
            if tensors:
                torch.autograd.backward(tensors, grad_tensors)
        if state.comm.prev is not None:
            state.comm.send_grads(mb.index, mb.num_samples, flight.received)

    def _recompute(self, flight: _InFlight, mb: MicroBatch) -> None:
        assert flight.rng_state is not None
        device = self.state.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            _set_rng_state(device, flight.rng_state)
            flight.outputs = self.state.stage(flight.inputs, flight.received)
            if self.state.stage.is_last:
                flight.loss = self._loss(flight.outputs, mb)

    def _backward_pairs(
        self, flight: _InFlight, grads: dict[str, Tensor]
    ) -> tuple[list[Tensor], list[Tensor | None]]:
        if self.state.stage.is_last:
            assert flight.loss is not None
            return ([flight.loss], [None]) if flight.loss.requires_grad else ([], [])
        assert flight.outputs is not None
        pairs = [
            (flight.outputs[name], grad)
            for name, grad in grads.items()
            if isinstance(flight.outputs[name], Tensor) and flight.outputs[name].requires_grad
        ]
        return [t for t, _ in pairs], [g for _, g in pairs]

    def _timed_compute(self, kind: ActionKind, mb: MicroBatch) -> _ComputeTimer:
        compute = self.state.compute
        forward = kind is ActionKind.FORWARD
        label = str(Action(self.state.rank_plan.stage, kind, mb.index))
        if compute.warm is not None:
            table = compute.warm.forward_s if forward else compute.warm.backward_s
            if mb.num_samples in table:
                warm_s = compute.stretch * table[mb.num_samples]
                return _ComputeTimer(self, 0.0, warm_s, label, forward=forward)
        floor_s = compute.forward_s if forward else compute.backward_s
        return _ComputeTimer(self, compute.stretch, floor_s, label, forward=forward)

    def _record_sample(
        self, mb: MicroBatch, inputs: dict[str, Tensor], received: dict[str, Tensor]
    ) -> None:
        """Keep the first micro-batch of each size while the warm compute is to be timed."""
        compute = self.state.compute
        if not compute.measure_warm or compute.warm is not None or mb.num_samples in self._samples:
            return
        kept = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in received.items()}
        self._samples[mb.num_samples] = Sample(inputs, kept, mb)

    def warm_timer(self) -> WarmTimer:
        """A timer of this rank's stage, run back to back on the micro-batches kept from
        the first step (``warm_compute.WarmTimer``); the kept micro-batches are dropped."""
        state = self.state

        def forward(stage: Any, sample: Sample, received: dict[str, Tensor]) -> Any:
            with torch.enable_grad():
                outputs = stage(sample.inputs, received)
                loss = self._loss(outputs, sample.microbatch) if stage.is_last else None
            return outputs, loss

        def pairs(outputs: Any, loss: Any, grads: dict[str, Tensor]) -> Any:
            return self._backward_pairs(_InFlight({}, {}, outputs, loss), grads)

        samples, self._samples = self._samples, {}
        return WarmTimer(
            state.stage,
            samples,
            forward,
            pairs,
            state.model_file.optimizer,
            recompute=self.recompute,
            device=state.device,
        )


class _ComputeTimer:
    """Context manager: adds the block's time to compute time and applies the emulation.

    The block lasts at least ``floor_s`` (modelled emulation) and at least ``stretch`` x
    its *CPU time* (``time.thread_time``: torch runs on the calling thread with one
    intra-op thread), so that time lost to other processes on the machine is not
    stretched as well.
    """

    def __init__(
        self, runner: StepRunner, stretch: float, floor_s: float, label: str, *, forward: bool
    ) -> None:
        self.forward = forward
        self.runner = runner
        self.stretch = stretch
        self.floor_s = floor_s
        self.label = label
        self.start_s = 0.0
        self.start_cpu_s = 0.0

    def __enter__(self) -> None:
        self.start_s = time.monotonic()
        self.start_cpu_s = time.thread_time()

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            cpu_s = time.thread_time() - self.start_cpu_s
            _sleep_until(self.start_s + max(self.floor_s, self.stretch * cpu_s))
        end_s = time.monotonic()
        self.runner.times.compute_s += end_s - self.start_s
        if self.forward:
            self.runner.times.forward_s += end_s - self.start_s
        self.runner.timeline.add(COMPUTE, self.label, self.start_s, end_s)


def _sleep_until(deadline_s: float) -> None:
    remaining_s = deadline_s - time.monotonic()
    if remaining_s > 0:
        time.sleep(remaining_s)


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
