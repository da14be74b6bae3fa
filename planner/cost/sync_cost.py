"""What islands and their sync mode do to a step: which holder sets sum every step, and
the outer sync's cost per step.

Under ``local_sgd`` and ``async`` (``contract.plan.SyncMode``) a holder set that spans
islands sums its gradients every step only inside each island (:func:`split_by_island`);
every ``H`` inner steps its pseudo-gradients cross the islands in one ring all-reduce over
the set's slowest link. Every spanning set syncs at the same steps, so one outer *round*
runs each device's rings one after another (:func:`outer_round_s`), and each inner step
pays its amortised share (:func:`amortised_outer_s`). This is DiLoCo's outer step
(Douillard et al., 2023: every parameter's pseudo-gradient once a round) under hplan's
ring model (``link_model.ring_all_reduce_time_s``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hplan.runtime.contract.holders import RankSet
from hplan.runtime.contract.plan import DTYPE_BYTES, PseudoGradientDtype, SyncMode

__all__ = [
    "GRADIENT_WIRE_BYTES",
    "amortised_outer_s",
    "outer_round_s",
    "pseudo_gradient_bytes",
    "split_by_island",
]

GRADIENT_WIRE_BYTES = DTYPE_BYTES["float32"]
"""Bytes per element of the gradient bytes the cost model counts (the runtime's wire dtype,
float32; ``sim.spec.WIRE_BYTES_MIN``)."""


def pseudo_gradient_bytes(gradient_bytes: float, wire_dtype: PseudoGradientDtype) -> float:
    """Bytes of the pseudo-gradients of parameters whose gradients are ``gradient_bytes``
    (counted in float32), sent in ``wire_dtype``: the same in float32, half in bfloat16."""
    return gradient_bytes * DTYPE_BYTES[wire_dtype.value] / GRADIENT_WIRE_BYTES


def split_by_island(
    groups: Mapping[RankSet, float], island_of: Mapping[int, int] | Sequence[int]
) -> tuple[dict[RankSet, float], dict[RankSet, float]]:
    """(holder sets that sum every step -> bytes, spanning holder sets -> bytes) under local
    sync.

    Every set inside one island stays as it is; a set spanning islands goes to the second
    mapping and, in the first, is replaced by its members in each island (a member alone
    sums nothing and is dropped). Sets that coincide after the split are merged, their
    bytes added, as one all-reduce per holder set.

    Args:
        groups: sorted members (devices or ranks) -> bytes they sum.
        island_of: member -> its island's index.
    """
    inner: dict[RankSet, float] = {}
    outer: dict[RankSet, float] = {}
    for members, num_bytes in groups.items():
        by_island: dict[int, list[int]] = {}
        for m in members:
            by_island.setdefault(island_of[m], []).append(m)
        if len(by_island) > 1:
            outer[members] = outer.get(members, 0.0) + num_bytes
        for part in by_island.values():
            if len(part) > 1:
                key = tuple(sorted(part))
                inner[key] = inner.get(key, 0.0) + num_bytes
    return inner, outer


def outer_round_s(ring_s: Mapping[RankSet, float]) -> float:
    """Seconds of one outer sync round: every spanning set's ring (``ring_s``: members ->
    seconds), one after another on each member, the slowest member's total (as the inner
    all-reduce, ``evaluate.allreduce_time_s``); 0 without sets."""
    total: dict[int, float] = {}
    for members, seconds in ring_s.items():
        for m in members:
            total[m] = total.get(m, 0.0) + seconds
    return max(total.values(), default=0.0)


def amortised_outer_s(
    mode: SyncMode, local_steps: int, round_s: float, inner_step_s: float
) -> float:
    """Seconds one outer round of ``round_s`` adds to each of ``local_steps`` inner steps of
    ``inner_step_s``: ``round / H`` for ``local_sgd`` (the islands wait for the round, then go
    on), ``max(0, round - H * step) / H`` for ``async`` (only what does not fit behind H inner
    steps is exposed), 0 for ``all_reduce`` (no round)."""
    if mode is SyncMode.ALL_REDUCE or round_s <= 0:
        return 0.0
    if mode is SyncMode.ASYNC:
        return max(0.0, round_s - local_steps * inner_step_s) / local_steps
    return round_s / local_steps
