"""Warm compute times of a rank's own stage, for the stretched emulation of cpu plans.

A rehearsal of a cpu plan slows each rank to its device's speed by sleeping after every
forward, backward and optimizer step (``dilation - 1`` times its CPU time, and longer for
slower devices). The block that follows a sleep runs with cold caches, evicted by the
other ranks sharing the cores: on a 2-core VM the same forward took 1.1-1.4x its back-to-
back CPU time, differently per phase, rank and run (``bench/cold_compute.py``), so
stretching each block's own CPU time made the emulated devices slower than the cpus the
plan describes, by a noisy amount.

So after its first (warm-up) step each rank times its own stage back to back: a copy of
the stage runs the forward and backward of the first micro-batch of each size it saw in
that step (with the inputs, received activations and gradients of that step), and the
optimizer steps a copy of its parameters; the ranks take turns, so each measures alone.
From the second step on, a block lasts ``stretch`` times that warm CPU time, or longer
when its real compute takes longer. The copy keeps the run's parameters, gradients and
random-number streams untouched (``--verify`` still compares the updated parameters).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from hplan.runtime.data import MicroBatch

REPEATS = 9
"""Timed repetitions per micro-batch size (after one untimed); the least is taken."""


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


def measure_warm_times(
    stage: torch.nn.Module,
    samples: Mapping[int, Sample],
    forward: ForwardFn,
    pairs: PairsFn,
    make_optimizer: Callable[[Sequence[Tensor]], Any],
    *,
    recompute: bool,
    device: torch.device,
) -> WarmTimes:
    """Time ``stage``'s forward and backward per micro-batch size and one optimizer step.

    Args:
        stage: the rank's stage (copied; the original is not touched).
        samples: micro-batch size -> a micro-batch of that size from the warm-up step.
        forward: runs a stage copy on a sample (see :data:`ForwardFn`).
        pairs: what to backpropagate (see :data:`PairsFn`).
        make_optimizer: the model file's optimizer for a list of parameters.
        recompute: the rank recomputes its forward in the backward (counted in backward).
        device: the stage's device (its random-number state is restored afterwards).

    Returns:
        The least CPU seconds (``time.thread_time``) of :data:`REPEATS` runs after one
        untimed run: other processes on the machine (the other ranks, a test runner) only
        ever add to a run's CPU time, through shared caches and cores, and a rank replays
        this one figure for the whole run, so the least disturbed run is the estimate.
    """
    work = copy.deepcopy(stage)
    forward_s: dict[int, float] = {}
    backward_s: dict[int, float] = {}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for size, sample in sorted(samples.items()):
            runs = [_forward_backward(work, sample, forward, pairs) for _ in range(REPEATS + 1)]
            forward_s[size] = min(f for f, _ in runs[1:])
            backward_s[size] = min(b for _, b in runs[1:])
            if recompute:
                backward_s[size] += forward_s[size]
    params = [p for p in work.parameters() if p.requires_grad and p.grad is not None]
    return WarmTimes(forward_s, backward_s, _optimizer_s(params, make_optimizer))


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


def _optimizer_s(
    params: Sequence[Tensor], make_optimizer: Callable[[Sequence[Tensor]], Any]
) -> float:
    if not params:
        return 0.0
    optimizer = make_optimizer(params)
    times = []
    for _ in range(REPEATS + 1):
        start_s = time.thread_time()
        optimizer.step()
        times.append(time.thread_time() - start_s)
    return min(times[1:])
