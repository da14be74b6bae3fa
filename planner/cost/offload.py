"""Optimizer-state offload to host memory on a layout: what it frees and what it costs.

A device that offloads (``Layout.optimizer_offload``, the plan's
``RankPlan.optimizer_offload``; ZeRO-Offload, Ren et al., USENIX ATC 2021, without its
fused CPU Adam) keeps its parameters, gradients and activations and leaves its optimizer
state and the step's temporaries to the host, which also holds a copy of its trainable
parameters and their gradients (``contract.memory``: ``offload_device_saving_bytes``,
``offload_host_bytes``; the node's host memory bounds the sum over its offloading devices).
Its optimizer step becomes copies over PCIe and a step on the host CPU
(:func:`offload_step_time_s`). ``auto`` (``hplan solve --offload``) searches layouts with
every device offloading when nothing cheaper fits, then keeps offload only on the devices
that do not fit without it (:func:`offload_flags`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import numpy as np

from hplan.planner.cost.layout import Layout
from hplan.planner.cost.problem import PlanningProblem
from hplan.runtime.contract.plan import CPU_KIND

PCIE_BANDWIDTH_BYTES_PER_S: float = 25e9
"""Effective host <-> GPU copy bandwidth of pinned memory over PCIe 4.0 x16, one direction:
the link carries 16 GT/s x 16 lanes x 128/130 = 31.5 GB/s (PCI-SIG, PCI Express Base
Specification 4.0), and CUDA's ``bandwidthTest`` of pinned memory typically reaches about
80% of it."""

HOST_MEMORY_BANDWIDTH_BYTES_PER_S: float = 25.6e9
"""What the host's optimizer step streams its bytes at: half of dual-channel DDR4-3200's
51.2 GB/s peak (2 channels x 8 bytes x 3200 MT/s, JEDEC JESD79-4), the share a memory-bound
``torch.optim`` step on CPU is assumed to reach (assumed, like the roofline's memory
efficiency; a workstation's 4-8 channels stream more)."""

OPTIMIZER_WEIGHT_GRAD_PASSES: float = 3.0
"""Optimizer traffic per trainable parameter byte, besides the state: read the weight,
write the weight, read the gradient (a memory-bound elementwise step)."""
OPTIMIZER_STATE_PASSES: float = 2.0
"""Traffic per optimizer-state byte: read once, written once."""


def offload_step_time_s(
    trainable_bytes: float,
    state_factor: float,
    transfer_bytes_per_s: float = PCIE_BANDWIDTH_BYTES_PER_S,
    host_bytes_per_s: float = HOST_MEMORY_BANDWIDTH_BYTES_PER_S,
) -> float:
    """Seconds of one offloaded optimizer step of ``trainable_bytes``, after the backward and
    the gradient sync, in place of the device's own optimizer step::

        2 x trainable bytes / transfer_bytes_per_s       gradients to the host, parameters back
        + trainable bytes x passes / host_bytes_per_s    the optimizer step on the host CPU

    ``passes`` as the device's memory-bound optimizer step counts them (weight read and
    written, gradient read: 3; each state byte read and written: 2 x ``state_factor``;
    ``problem_builder.RooflineSource.optimizer_time_s``).

    Args:
        trainable_bytes: the parameters it steps (and so the gradients it copies), bytes.
        state_factor: optimizer state bytes per parameter byte (2.0 for AdamW).
        transfer_bytes_per_s: device <-> host copy bandwidth (PCIe; a ``cpu`` device's
            own memory bandwidth).
        host_bytes_per_s: the host's memory bandwidth as the optimizer step reaches it.
    """
    passes = OPTIMIZER_WEIGHT_GRAD_PASSES + OPTIMIZER_STATE_PASSES * state_factor
    return (
        2.0 * trainable_bytes / transfer_bytes_per_s + trainable_bytes * passes / host_bytes_per_s
    )


def offload_problem(problem: PlanningProblem) -> PlanningProblem | None:
    """``problem`` where every device offloads: each unit's static memory less what offload
    frees, each device's optimizer time the offloaded step's. None when the problem carries
    no offload figures or nothing to offload."""
    saving = problem.offload_saving_bytes
    times = problem.offload_optimizer_time_s
    if saving is None or times is None or not np.any(saving > 0):
        return None
    return replace(
        problem, static_memory_bytes=problem.static_memory_bytes - saving, optimizer_time_s=times
    )


def can_offload(problem: PlanningProblem, device_idx: int) -> bool:
    """Whether offloading frees memory on ``device_idx`` (a GPU; not a ``cpu`` device)."""
    return problem.device_kinds[device_idx] != CPU_KIND


def device_offloads(layout: Layout, device_idx: int) -> bool:
    """Whether ``device_idx`` offloads its optimizer in ``layout``."""
    return bool(layout.optimizer_offload) and layout.optimizer_offload[device_idx]


def stage_optimizer_time_s(
    problem: PlanningProblem, layout: Layout, device_idx: int, start: int, stop: int
) -> float:
    """The optimizer step of units ``[start, stop)`` on ``device_idx``: offloaded or its own."""
    times = problem.optimizer_time_s
    if device_offloads(layout, device_idx):
        assert problem.offload_optimizer_time_s is not None
        times = problem.offload_optimizer_time_s
    return float(times[device_idx, start:stop].sum())


def _held(layout: Layout) -> dict[int, tuple[int, int]]:
    return {s.device_idx: (s.unit_start, s.unit_stop) for r in layout.replicas for s in r.stages}


def device_saving_bytes(problem: PlanningProblem, layout: Layout) -> dict[int, float]:
    """Device index -> device bytes its offload frees (offloading devices only)."""
    if not layout.optimizer_offload or problem.offload_saving_bytes is None:
        return {}
    saving = problem.offload_saving_bytes
    return {
        d: float(saving[start:stop].sum())
        for d, (start, stop) in _held(layout).items()
        if layout.optimizer_offload[d]
    }


def host_bytes_by_node(problem: PlanningProblem, layout: Layout) -> dict[str, float]:
    """Node -> host bytes its offloading devices hold (``contract.memory.offload_host_bytes``)."""
    need: dict[str, float] = defaultdict(float)
    if not layout.optimizer_offload or problem.offload_host_bytes is None:
        return need
    for d, (start, stop) in _held(layout).items():
        if layout.optimizer_offload[d]:
            need[problem.device_nodes[d]] += float(problem.offload_host_bytes[start:stop].sum())
    return need


def host_fits(problem: PlanningProblem, layout: Layout) -> bool:
    """Whether every node's host memory holds its devices' offload."""
    capacity = problem.host_capacity_bytes
    if capacity is None:
        return not any(layout.optimizer_offload)
    of_node = {problem.device_nodes[d]: float(capacity[d]) for d in range(problem.num_devices)}
    return all(
        need <= of_node[node] * (1 + 1e-9)
        for node, need in host_bytes_by_node(problem, layout).items()
    )


def offload_flags(
    problem: PlanningProblem, layout: Layout, stage_memory_bytes: dict[int, float]
) -> tuple[bool, ...] | None:
    """Per device of the problem: whether it offloads, only where it does not fit without
    it; None when a device does not fit even with offload, or a node's host memory does
    not hold the offload.

    Args:
        stage_memory_bytes: device index -> its stage's memory without offload
            (``evaluate``'s ``StageCost.memory_bytes``).
    """
    saving = problem.offload_saving_bytes
    if saving is None:
        return None
    held = _held(layout)
    flags = [False] * problem.num_devices
    for d, need in stage_memory_bytes.items():
        capacity = float(problem.memory_capacity_bytes[d]) * (1 + 1e-9)
        if need <= capacity:
            continue
        start, stop = held[d]
        if not can_offload(problem, d) or need - float(saving[start:stop].sum()) > capacity:
            return None
        flags[d] = True
    result = tuple(flags)
    return result if host_fits(problem, replace(layout, optimizer_offload=result)) else None
