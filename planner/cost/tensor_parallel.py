"""Tensor-parallel groups as devices of the layout search.

A TP group is ``d`` cards of one kind on one node that run one stage together, each on its
1/d of the modules the model's TP plan splits (``UnitCost.tp``). :func:`tp_groups` forms
the groups of one degree (joined by NVLink, or any cards of a node), and
:func:`grouped_problem` turns a problem into one whose devices are those groups, so the
search, the evaluator and the validator cost them as they cost single cards:

- compute per unit, on the group's slowest member: the split share / d plus the rest
  whole, plus the unit's TP
  all-reduces over the group's ring (its slowest link; ``link_model.tp_all_reduce_time_s``,
  the formula the simulator shares);
- memory per card, against the member with the least: the split parameters (with their
  gradients, optimizer state and workspace) and saved activations / d, the rest whole.

A grouped problem may mix degrees (a node's tp4 group beside single cards at degree 1);
every holder of a unit must then have one degree (what ``contract.plan`` requires):
``solve.validate`` refuses layouts that break it and the search builds none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from itertools import combinations

import numpy as np

from hplan.planner.cost.problem import (
    FloatArray,
    PlanningProblem,
    SplitBytes,
    TensorParallelInput,
    TiedParams,
    per_card_bytes,
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


def grouped_problem(problem: PlanningProblem, groups: Sequence[tuple[int, ...]]) -> PlanningProblem:
    """``problem`` whose devices are ``groups`` (indices into it, in device order; a group
    of one card is that card at degree 1), each named by its lead card (its first) and
    costed per card as the module docstring says. Groups may have different degrees (an
    NVLink node's tp4 group beside single cards): the memory arrays stay the whole units',
    and ``PlanningProblem.tp_degrees`` with ``tp_split`` give each device's per-card part.

    No offload (the runtime does not combine it with TP): the offload arrays are dropped.

    Raises:
        ValueError: no groups, no group above degree 1, or a problem without TP input.
    """
    tp = problem.tensor_parallel
    if tp is None or not groups or max(len(g) for g in groups) < 2:
        raise ValueError("grouped_problem needs TP input and a group of 2 or more cards")
    degrees = tuple(len(g) for g in groups)
    base = restrict(problem, [g[0] for g in groups])
    sizes = np.asarray(base.micro_batch_sizes, dtype=np.float64)
    fwd = base.fwd_time_s.copy()
    bwd = base.bwd_time_s.copy()
    opt = base.optimizer_time_s.copy()
    num_groups = len(groups)
    bandwidth = base.bandwidth_bytes_per_s.copy()
    latency = base.latency_s.copy()
    capacity = base.memory_capacity_bytes.copy()
    for i, group in enumerate(groups):
        degree = degrees[i]
        if degree > 1:  # its members step together: the slowest one's times, the least memory
            members = list(group)
            fwd[i] = problem.fwd_time_s[members].max(axis=0)
            bwd[i] = problem.bwd_time_s[members].max(axis=0)
            opt[i] = problem.optimizer_time_s[members].max(axis=0)
            capacity[i] = problem.memory_capacity_bytes[members].min()
            _group_times(problem, tp, group, sizes, fwd[i], bwd[i])
            ring_bw, ring_lat = _ring_link(problem, group)
            bandwidth[i, i], latency[i, i] = ring_bw, ring_lat
            opt[i] *= _param_share(problem, tp, degree)
        for j in range(i + 1, num_groups):
            link = _between(problem, group, groups[j])
            bandwidth[i, j] = bandwidth[j, i] = link[0]
            latency[i, j] = latency[j, i] = link[1]
    tie_share = _param_share(problem, tp, min(degrees))
    return replace(
        base,
        fwd_time_s=fwd,
        bwd_time_s=bwd,
        optimizer_time_s=opt,
        memory_capacity_bytes=capacity,
        tied_params=tuple(
            TiedParams(t.units, t.num_bytes * min(float(tie_share[u]) for u in t.units))
            for t in problem.tied_params
        ),
        bandwidth_bytes_per_s=bandwidth,
        latency_s=latency,
        offload_optimizer_time_s=None,
        offload_saving_bytes=None,
        offload_host_bytes=None,
        host_capacity_bytes=None,
        tensor_parallel=None,
        tp_degrees=degrees,
        tp_split=SplitBytes(
            static_bytes=tp.split_static_bytes,
            activation_bytes_per_sample=tp.split_activation_bytes_per_sample,
            optimizer_state_bytes=tp.split_optimizer_state_bytes,
            grad_bytes=tp.split_grad_bytes,
        ),
        tp_members=tuple(tuple(problem.device_names[d] for d in g) for g in groups),
        tp_split_params=tp.split_params,
    )


def _param_share(problem: PlanningProblem, tp: TensorParallelInput, degree: int) -> FloatArray:
    """Per unit, the share of its trainable parameters one card of a tp-``degree`` group
    holds, shape (U,) (1 where it has none)."""
    grad = per_card_bytes(problem.grad_bytes, tp.split_grad_bytes, degree)
    return np.divide(grad, problem.grad_bytes, out=np.ones_like(grad), where=problem.grad_bytes > 0)


def _group_times(
    problem: PlanningProblem,
    tp: TensorParallelInput,
    group: Sequence[int],
    sizes: FloatArray,
    fwd: FloatArray,
    bwd: FloatArray,
) -> None:
    """Scale one group's (U, K) forward and backward times in place: the split share / d
    plus the rest whole, plus the unit's TP all-reduces over the group's ring."""
    degree = len(group)
    scale = 1.0 - tp.split_time_share * (1.0 - 1.0 / degree)  # (U,)
    fwd *= scale[:, None]
    bwd *= scale[:, None]
    ring_bw, ring_lat = _ring_link(problem, group)
    for u in range(problem.num_units):
        fwd_per_sample = float(tp.fwd_allreduce_bytes_per_sample[u])
        bwd_per_sample = float(tp.bwd_allreduce_bytes_per_sample[u])
        num_fwd, num_bwd = pass_counts(float(tp.num_allreduces[u]), fwd_per_sample)
        for k, b in enumerate(sizes):
            fwd[u, k] += tp_all_reduce_time_s(
                degree, fwd_per_sample * b, ring_bw, ring_lat, num_fwd
            )
            bwd[u, k] += tp_all_reduce_time_s(
                degree, bwd_per_sample * b, ring_bw, ring_lat, num_bwd
            )
