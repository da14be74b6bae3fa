"""Which units a stage recomputes under selective recomputation, and in what order.

A stage that does not fit with every activation kept recomputes some of its partition
units (``MemoryStrategy.SELECTIVE``): each recomputed unit keeps its input instead of its
activations and runs its forward again in the backward. The units are taken cheapest first:
by forward time per activation byte saved per sample, ``fwd_time_s / activation bytes``
(Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
MLSys 2023, recompute the attention core for the same reason: much memory, little
compute). A unit whose activations are no larger than its input saves nothing and is never
taken. The solver (``solve.partition``) and the brute-force reference take prefixes of the
same order, so they search the same choices.
"""

from __future__ import annotations

from collections.abc import Sequence

from hplan.planner.cost.evaluate import unit_input_bytes
from hplan.planner.cost.problem import PlanningProblem


def recompute_order(problem: PlanningProblem, device_idx: int, k: int) -> tuple[int, ...]:
    """Units (problem indices) worth recomputing on ``device_idx`` at micro-batch candidate
    ``k``, cheapest per byte saved first (ties: lower index first)."""
    ratios = []
    b = problem.micro_batch_sizes[k]
    activations = problem.activation_bytes_on(device_idx)
    for u in range(problem.num_units):
        act = float(activations[u])
        if act * b > unit_input_bytes(problem, u, b):
            ratios.append((float(problem.fwd_time_s[device_idx, u, k]) / act, u))
    return tuple(u for _, u in sorted(ratios))


def selected_units(order: Sequence[int], start: int, stop: int, count: int) -> tuple[int, ...]:
    """The units of ``[start, stop)`` among the first ``count`` of ``order``, ascending."""
    return tuple(sorted(u for u in order[:count] if start <= u < stop))
