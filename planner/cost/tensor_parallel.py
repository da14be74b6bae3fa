"""Tensor-parallel groups as devices of the layout search.

A TP group is ``d`` cards of one kind on one node that run one stage together, each on its
1/d of the modules the model's TP plan splits (``UnitCost.tp``). :func:`tp_groups` forms
the groups of one degree (joined by NVLink, or any cards of a node), and
:func:`grouped_problem` turns a problem into one whose devices are those groups, so the
search, the evaluator and the validator cost them as they cost single cards:

- compute per unit: the split share / d plus the rest whole, plus the unit's TP
  all-reduces over the group's ring (its slowest link; ``link_model.tp_all_reduce_time_s``,
  the formula the simulator shares);
- memory per card: the split parameters (with their gradients, optimizer state and
  workspace) and saved activations / d, the rest whole.

Every device of a grouped problem has the same degree, so every holder of a unit has one
degree (what ``contract.plan`` requires).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from itertools import combinations

import numpy as np

from hplan.planner.cost.problem import (
    FloatArray,
    PlanningProblem,
    TensorParallelInput,
    TiedParams,
    restrict,
)
from hplan.runtime.contract.link_model import tp_all_reduce_time_s
from hplan.runtime.contract.plan import TP_DEGREES

__all__ = ["allowed_degrees", "grouped_problem", "pass_counts", "tp_groups"]


def allowed_degrees(tp: TensorParallelInput) -> tuple[int, ...]:
    """The degrees above 1 of ``TP_DEGREES`` the model allows."""
    return tuple(d for d in TP_DEGREES if 1 < d <= tp.max_degree)


def tp_groups(
    problem: PlanningProblem,
    degree: int,
    *,
    nvlink_only: bool,
    consumer_only: bool = False,
) -> tuple[tuple[int, ...], ...]:
    """Disjoint groups of ``degree`` devices of one node and one kind, each in device order
    (consecutive devices taken greedily), sorted by their first device (so the groups'
    problem keeps the cluster's device order, and an emitted group's ranks are consecutive).

    Args:
        nvlink_only: every pair of a group joined by NVLink.
        consumer_only: GeForce cards only (``DeviceSpec.consumer_card``).
    """
    tp = problem.tensor_parallel
    if tp is None:
        return ()
    by_place: dict[tuple[str, str], list[int]] = {}
    for d in range(problem.num_devices):
        if consumer_only and not tp.consumer_card[d]:
            continue
        by_place.setdefault((problem.device_nodes[d], problem.device_kinds[d]), []).append(d)
    groups: list[tuple[int, ...]] = []
    for members in by_place.values():
        start = 0
        while start + degree <= len(members):
            group = tuple(members[start : start + degree])
            if nvlink_only and not all(tp.nvlink[a, b] for a, b in combinations(group, 2)):
                start += 1
                continue
            groups.append(group)
            start += degree
    return tuple(sorted(groups))


def pass_counts(num_collectives: float, fwd_bytes: float) -> tuple[int, int]:
    """A unit's collectives per micro-batch split between its forward and its backward:
    the larger half in the forward where it all-reduces anything (Megatron's pairs: half
    each; an embedding's one all-reduce: forward), the rest in the backward."""
    total = round(num_collectives)
    fwd = total - total // 2 if fwd_bytes > 0 else 0
    return fwd, total - fwd


def _ring_link(problem: PlanningProblem, group: Sequence[int]) -> tuple[float, float]:
    """The slowest bandwidth and the largest latency between two members of ``group``."""
    pairs = list(combinations(group, 2))
    return (
        min(float(problem.bandwidth_bytes_per_s[a, b]) for a, b in pairs),
        max(float(problem.latency_s[a, b]) for a, b in pairs),
    )


def _between(problem: PlanningProblem, a: Sequence[int], b: Sequence[int]) -> tuple[float, float]:
    """The slowest link between a member of ``a`` and one of ``b``."""
    return (
        min(float(problem.bandwidth_bytes_per_s[i, j]) for i in a for j in b),
        max(float(problem.latency_s[i, j]) for i in a for j in b),
    )


def _shrunk(whole: FloatArray, split: FloatArray, degree: int) -> FloatArray:
    """``whole`` with its ``split`` part divided by ``degree``: per card of a group."""
    return np.maximum(whole - split * (1.0 - 1.0 / degree), 0.0)


def grouped_problem(problem: PlanningProblem, groups: Sequence[tuple[int, ...]]) -> PlanningProblem:
    """``problem`` whose devices are ``groups`` (indices into it, of one degree), each
    named by its lead card (its first) and costed per card as the module docstring says.

    No offload (the runtime does not combine it with TP): the offload arrays are dropped.

    Raises:
        ValueError: no groups, groups of different sizes, or a problem without TP input.
    """
    tp = problem.tensor_parallel
    if tp is None or not groups or len({len(g) for g in groups}) != 1:
        raise ValueError("grouped_problem needs TP input and groups of one degree")
    degree = len(groups[0])
    base = restrict(problem, [g[0] for g in groups])
    sizes = np.asarray(base.micro_batch_sizes, dtype=np.float64)
    scale = 1.0 - tp.split_time_share * (1.0 - 1.0 / degree)  # (U,)
    fwd = base.fwd_time_s * scale[None, :, None]
    bwd = base.bwd_time_s * scale[None, :, None]
    num_groups = len(groups)
    bandwidth = np.zeros((num_groups, num_groups))
    latency = np.zeros_like(bandwidth)
    for i, group in enumerate(groups):
        ring_bw, ring_lat = _ring_link(problem, group)
        bandwidth[i, i], latency[i, i] = ring_bw, ring_lat
        for u in range(problem.num_units):
            fwd_per_sample = float(tp.fwd_allreduce_bytes_per_sample[u])
            bwd_per_sample = float(tp.bwd_allreduce_bytes_per_sample[u])
            num_fwd, num_bwd = pass_counts(float(tp.num_allreduces[u]), fwd_per_sample)
            for k, b in enumerate(sizes):
                fwd[i, u, k] += tp_all_reduce_time_s(
                    degree, fwd_per_sample * b, ring_bw, ring_lat, num_fwd
                )
                bwd[i, u, k] += tp_all_reduce_time_s(
                    degree, bwd_per_sample * b, ring_bw, ring_lat, num_bwd
                )
        for j in range(i + 1, num_groups):
            link = _between(problem, group, groups[j])
            bandwidth[i, j] = bandwidth[j, i] = link[0]
            latency[i, j] = latency[j, i] = link[1]
    grad = _shrunk(problem.grad_bytes, tp.split_grad_bytes, degree)
    param_share = np.divide(
        grad, problem.grad_bytes, out=np.ones_like(grad), where=problem.grad_bytes > 0
    )
    state = problem.optimizer_state_bytes
    return replace(
        base,
        fwd_time_s=fwd,
        bwd_time_s=bwd,
        optimizer_time_s=base.optimizer_time_s * param_share[None, :],
        static_memory_bytes=_shrunk(problem.static_memory_bytes, tp.split_static_bytes, degree),
        activation_bytes_per_sample=_shrunk(
            problem.activation_bytes_per_sample, tp.split_activation_bytes_per_sample, degree
        ),
        optimizer_state_bytes=(
            None if state is None else _shrunk(state, tp.split_optimizer_state_bytes, degree)
        ),
        grad_bytes=grad,
        tied_params=tuple(
            TiedParams(t.units, t.num_bytes * min(float(param_share[u]) for u in t.units))
            for t in problem.tied_params
        ),
        bandwidth_bytes_per_s=bandwidth,
        latency_s=latency,
        offload_optimizer_time_s=None,
        offload_saving_bytes=None,
        offload_host_bytes=None,
        host_capacity_bytes=None,
        tensor_parallel=None,
        tp_degree=degree,
        tp_members=tuple(tuple(problem.device_names[d] for d in g) for g in groups),
        tp_split_params=tp.split_params,
    )
