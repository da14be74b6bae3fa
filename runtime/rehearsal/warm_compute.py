"""Warm compute times of a rank's own stage, for the stretched emulation of cpu plans.

A rehearsal of a cpu plan slows each rank to its device's speed by sleeping after every
forward, backward and optimizer step. The block that follows a sleep runs with cold caches,
evicted by the other ranks sharing the cores (``bench/cold_compute.py``), so stretching
each block's own CPU time would make the emulated devices slower than the cpus the plan
describes, by a noisy amount. So after its first (warm-up) step each rank times its own
stage back to back (:class:`WarmTimer`): a copy of the stage runs the forward and backward
of the first micro-batch of each size it saw in that step, with that step's inputs,
activations and gradients, and the optimizer steps a copy of its parameters; the ranks
take turns, so each measures alone, and a rank's time is the median of its rounds' least
times (:data:`ROUNDS`), which follows the machine's wandering speed rather than one moment
of it. The copy leaves the run's parameters, gradients and random-number streams untouched.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from hplan.runtime.executor.data import MicroBatch

ROUNDS = 5
"""Turns each rank takes at timing its stage; its time is the median of the rounds' least."""
REPEATS = 5
"""Timed repetitions per micro-batch size in one round (after one untimed); the least is
the round's figure."""


@dataclass(frozen=True)
class WarmTimes:
    """CPU seconds of this rank's stage, run back to back on a warm core."""

    forward_s: Mapping[int, float]
    """Micro-batch size (samples) -> one forward (with the loss on a last stage)."""
    backward_s: Mapping[int, float]
    """Micro-batch size -> one backward (with the recomputed forward when the rank
    recomputes)."""
    optimizer_s: float
    """One optimizer step over the stage's trainable parameters."""

    def describe(self) -> str:
        """One line for the rank's log, in CPU milliseconds."""
        sizes = ", ".join(
            f"micro-batch {size}: forward {self.forward_s[size] * 1e3:.3f}, backward "
            f"{self.backward_s[size] * 1e3:.3f}"
            for size in sorted(self.forward_s)
        )
        return f"warm compute (CPU ms) {sizes}; optimizer {self.optimizer_s * 1e3:.3f}"


@dataclass
class Sample:
    """What one micro-batch of the warm-up step gave this rank's stage."""

    inputs: dict[str, Tensor]
    """Graph inputs the stage reads."""
    received: dict[str, Tensor]
    """Boundary activations from the previous stage (detached copies)."""
    microbatch: MicroBatch
    """The micro-batch (its targets and size give a last stage's loss)."""
    grads: dict[str, Tensor] = field(default_factory=dict)
    """Gradients of the stage's outputs from the next stage (empty on a last stage)."""


ForwardFn = Callable[[torch.nn.Module, Sample, dict[str, Tensor]], tuple[dict[str, Any], Any]]
"""``(stage, sample, received) -> (outputs, loss or None)``: one forward with autograd."""
PairsFn = Callable[[dict[str, Any], Any, dict[str, Tensor]], tuple[list[Tensor], list[Any]]]
"""``(outputs, loss, grads) -> (tensors, grad_tensors)`` for ``torch.autograd.backward``."""


class WarmTimer:
    """Times a copy of a rank's stage in rounds; :meth:`result` combines the rounds.

    Args:
        stage: the rank's stage (copied; the original is not touched).
        samples: micro-batch size -> a micro-batch of that size from the warm-up step.
        forward: runs a stage copy on a sample (see :data:`ForwardFn`).
        pairs: what to backpropagate (see :data:`PairsFn`).
        make_optimizer: the model file's optimizer for a list of parameters.
        recompute: the rank recomputes its forward in the backward (counted in backward).
        device: the stage's device (its random-number state is restored after each round).
    """

    def __init__(
        self,
        stage: torch.nn.Module,
        samples: Mapping[int, Sample],
        forward: ForwardFn,
        pairs: PairsFn,
        make_optimizer: Callable[[Sequence[Tensor]], Any],
        *,
        recompute: bool,
        device: torch.device,
    ) -> None:
        self._work = copy.deepcopy(stage)
        self._samples = dict(sorted(samples.items()))
        self._forward, self._pairs = forward, pairs
        self._make_optimizer = make_optimizer
        self._optimizer: Any = None
        self._recompute = recompute
        self._device = device
        self._rounds: list[WarmTimes] = []

    def time_round(self) -> WarmTimes:
        """One round: the least CPU seconds (``time.thread_time``) of :data:`REPEATS` runs
        of each size's forward and backward and of the optimizer step, after one untimed
        run of each. Other processes on the machine (the other ranks, a test runner) only
        ever add to a run's CPU time, through shared caches and cores, so the least
        disturbed run is the round's figure."""
        forward_s: dict[int, float] = {}
        backward_s: dict[int, float] = {}
        devices = [self._device] if self._device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            for size, sample in self._samples.items():
                runs = [
                    _forward_backward(self._work, sample, self._forward, self._pairs)
                    for _ in range(REPEATS + 1)
                ]
                forward_s[size] = min(f for f, _ in runs[1:])
                backward_s[size] = min(b for _, b in runs[1:])
                if self._recompute:
                    backward_s[size] += forward_s[size]
        times = WarmTimes(forward_s, backward_s, self._optimizer_s())
        self._rounds.append(times)
        return times

    def result(self) -> WarmTimes:
        """Each figure's median over the rounds timed so far.

        Raises:
            ValueError: no round was timed.
        """
        rounds = self._rounds
        if not rounds:
            raise ValueError("no warm-compute round was timed; call time_round() first")
        sizes = list(self._samples)
        return WarmTimes(
            {s: statistics.median(r.forward_s[s] for r in rounds) for s in sizes},
            {s: statistics.median(r.backward_s[s] for r in rounds) for s in sizes},
            statistics.median(r.optimizer_s for r in rounds),
        )

    def _optimizer_s(self) -> float:
        if self._optimizer is None:
            params = [p for p in self._work.parameters() if p.requires_grad and p.grad is not None]
            if not params:
                return 0.0
            self._optimizer = self._make_optimizer(params)
        times = []
        for _ in range(REPEATS + 1):
            start_s = time.thread_time()
            self._optimizer.step()
            times.append(time.thread_time() - start_s)
        return min(times[1:])


def _forward_backward(
    stage: torch.nn.Module, sample: Sample, forward: ForwardFn, pairs: PairsFn
) -> tuple[float, float]:
    stage.zero_grad(set_to_none=False)
    received = {
        name: t.detach().clone().requires_grad_(t.requires_grad)
        for name, t in sample.received.items()
    }
    start_s = time.thread_time()
    outputs, loss = forward(stage, sample, received)
    middle_s = time.thread_time()
    tensors, grads = pairs(outputs, loss, sample.grads)
    if tensors:
        torch.autograd.backward(tensors, grads)
    return middle_s - start_s, time.thread_time() - middle_s
