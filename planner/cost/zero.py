"""ZeRO stages 1 and 2 on a layout: uneven optimizer-state (and gradient) shards and what
they cost.

Under ZeRO stage 1 (Rajbhandari et al., "ZeRO", SC 2020, P_os) device d of holder set H
keeps ``state_u * w_d / sum_{m in H} w_m`` bytes of each shared unit's optimizer state,
``w`` the layout's ``optimizer_shard_weights``, each device's weight the memory it has left
(:func:`shard_weights`): a 12 GB card beside a 24 GB card takes a smaller shard. After the
optimizer step every holder set all-gathers its parameters, half a ring all-reduce
(:func:`allgather_time_s`; Patarasuk and Yuan, JPDC 2009). Stage 2 (P_os+g, section 5.2)
also shards the summed gradients, so a device keeps one bucket of the shared gradients'
flat copy (:func:`gradient_saving_bytes`). It is costed exactly as stage 1 (section 7.2
gives both the volume of data parallelism), an upper bound, so the solver takes stage 2
only where stage 1 does not fit (``solve.strategy.sharded_candidates``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from hplan.planner.cost.layout import Layout
from hplan.planner.cost.problem import PlanningProblem
from hplan.runtime.contract.link_model import BUCKET_CAP_BYTES, ring_all_reduce_time_s


def unit_holders(layout: Layout) -> dict[int, tuple[int, ...]]:
    """Unit index -> the sorted devices holding it."""
    held: dict[int, set[int]] = defaultdict(set)
    for replica in layout.replicas:
        for stage in replica.stages:
            for u in range(stage.unit_start, stage.unit_stop):
                held[u].add(stage.device_idx)
    return {u: tuple(sorted(devices)) for u, devices in held.items()}


def state_saving_bytes(
    problem: PlanningProblem, layout: Layout, weights: Sequence[float]
) -> dict[int, float]:
    """Device index -> optimizer-state bytes it does not keep under ZeRO stage 1 with
    ``weights`` (one per device of the problem): for every unit it shares, the state less
    its shard."""
    assert problem.optimizer_state_bytes is not None
    saving: dict[int, float] = defaultdict(float)
    for u, devices in unit_holders(layout).items():
        if len(devices) < 2:
            continue
        state = float(problem.optimizer_state_bytes[u])
        total = sum(weights[d] for d in devices)
        for d in devices:
            share = weights[d] / total if total > 0 else 1.0 / len(devices)
            saving[d] += state * (1.0 - share)
    return saving


def gradient_saving_bytes(problem: PlanningProblem, layout: Layout) -> dict[int, float]:
    """Device index -> bytes it does not keep under ZeRO stage 2 besides stage 1's saving:
    the flat copy of the gradients of the units it shares (counted in every unit's static
    memory, ``problem_builder.static_memory_bytes``), less one bucket still in flight, at
    most ``max(BUCKET_CAP_BYTES, the largest shared unit's gradient bytes)`` (a parameter
    larger than the cap is a bucket alone, and lies inside one unit)."""
    shared: dict[int, float] = defaultdict(float)
    largest: dict[int, float] = defaultdict(float)
    for u, devices in unit_holders(layout).items():
        if len(devices) < 2:
            continue
        for d in devices:
            shared[d] += float(problem.grad_bytes[u])
            largest[d] = max(largest[d], float(problem.grad_bytes[u]))
    return {
        d: max(0.0, total - min(total, max(BUCKET_CAP_BYTES, largest[d])))
        for d, total in shared.items()
    }


def shard_weights(
    problem: PlanningProblem,
    layout: Layout,
    stage_memory_bytes: dict[int, float],
    zero_stage: int = 1,
) -> tuple[float, ...] | None:
    """Shard weights that let every device of ``layout`` fit, or None when none do.

    Args:
        stage_memory_bytes: device index -> its stage's memory with the whole optimizer
            state (``evaluate``'s ``StageCost.memory_bytes``).

    Each device's weight is its headroom: capacity less its memory without the state of
    the units it shares (0 for a device whose other memory already fills it); under
    ``zero_stage`` 2 its memory is first less :func:`gradient_saving_bytes`. A layout
    whose devices share no unit gets weight 1 everywhere when it fits as it is (there is
    nothing to shard). With one holder set, shards proportional to the headroom fit
    whenever any split does (each share is at most the device's headroom exactly when the
    whole state is at most the sum of them).
    """
    if problem.optimizer_state_bytes is None:
        return None
    if zero_stage == 2:
        freed = gradient_saving_bytes(problem, layout)
        stage_memory_bytes = {d: m - freed.get(d, 0.0) for d, m in stage_memory_bytes.items()}
    shared_state: dict[int, float] = defaultdict(float)
    for u, devices in unit_holders(layout).items():
        if len(devices) > 1:
            for d in devices:
                shared_state[d] += float(problem.optimizer_state_bytes[u])
    if not shared_state:  # nothing to shard: the layout fits as it is, or not at all
        fits = all(
            need <= float(problem.memory_capacity_bytes[d]) * (1 + 1e-9)
            for d, need in stage_memory_bytes.items()
        )
        return (1.0,) * problem.num_devices if fits else None
    weights = [0.0] * problem.num_devices
    for d, need in stage_memory_bytes.items():
        headroom = float(problem.memory_capacity_bytes[d]) - (need - shared_state[d])
        if headroom < 0:
            return None
        weights[d] = headroom
    top = max(weights)
    if top <= 0:
        return None
    weights = [w / top for w in weights]
    saving = state_saving_bytes(problem, layout, weights)
    for d, need in stage_memory_bytes.items():
        if need - saving[d] > float(problem.memory_capacity_bytes[d]) * (1 + 1e-9):
            return None
    return tuple(weights)


def allgather_time_s(problem: PlanningProblem, layout: Layout) -> float:
    """Seconds the slowest device spends all-gathering its holder sets' updated
    parameters after the optimizer step (module docstring); 0 without sharding."""
    if not layout.optimizer_shard_weights:
        return 0.0
    by_set: dict[tuple[int, ...], float] = defaultdict(float)
    for u, devices in unit_holders(layout).items():
        if len(devices) > 1:
            by_set[devices] += float(problem.grad_bytes[u])
    per_device: dict[int, float] = defaultdict(float)
    for devices, num_bytes in by_set.items():
        idx = np.array(devices)
        off = ~np.eye(len(devices), dtype=bool)
        bandwidth = float(problem.bandwidth_bytes_per_s[np.ix_(idx, idx)][off].min())
        latency = float(problem.latency_s[np.ix_(idx, idx)][off].max())
        t = ring_all_reduce_time_s(len(devices), num_bytes, bandwidth, latency) / 2
        for d in devices:
            per_device[d] += t
    return max(per_device.values(), default=0.0)


def sharded_problem(problem: PlanningProblem, zero_stage: int = 1) -> PlanningProblem | None:
    """``problem`` whose units carry none of their optimizer state: what a device keeps
    with an uneven shard of weight 0, the most any sharding could save, so the search finds
    every layout ZeRO might make fit (each is then sized with :func:`shard_weights` and
    kept only if every device fits). None when the problem has no optimizer state to shard
    or a single device. Under ``zero_stage`` 2 each unit's flat gradient copy is left out
    too (:func:`gradient_saving_bytes` before its one bucket)."""
    state = problem.optimizer_state_bytes
    if state is None or problem.num_devices < 2 or not np.any(state > 0):
        return None
    freed = state + (problem.grad_bytes if zero_stage == 2 else 0.0)
    return replace(problem, static_memory_bytes=problem.static_memory_bytes - freed)
