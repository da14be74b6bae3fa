"""Which ranks hold which parameters: the one place that answers it.

A parameter is held by every rank whose stage holds a unit that uses it
(``UnitSpec.params``); its gradient is summed among exactly those ranks, in all-reduces
per distinct holder set (split into buckets of a capped size, :func:`grad_buckets`). The
runtime buckets gradients this way, checkpoints
save each name once from its lowest holder, the plan's report records the buckets'
bytes, and the planner's cost model groups a layout's units the same way before a plan
exists (:func:`holders` and :func:`shared_bytes` over its own items).

Torch-free, like the rest of the contract.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from hplan.runtime.contract.link_model import sync_order
from hplan.runtime.contract.plan import GradSyncReport, Plan

__all__ = [
    "BucketSpec",
    "RankSet",
    "buffer_holders",
    "grad_buckets",
    "grad_sync_reports",
    "holder_sets",
    "holders",
    "parameter_holders",
    "parameter_order",
    "shared_bytes",
]

RankSet = tuple[int, ...]
"""Sorted ranks (or device indices) that hold the same items."""

_K = TypeVar("_K", bound=Hashable)


def holders(held: Iterable[tuple[int, Iterable[_K]]]) -> dict[_K, RankSet]:
    """Item -> the sorted holders that hold it, from ``(holder, items it holds)`` pairs.

    Items appear in the order they are first met; a holder listed twice counts once.
    """
    found: dict[_K, set[int]] = {}
    for holder, items in held:
        for item in items:
            found.setdefault(item, set()).add(holder)
    return {item: tuple(sorted(owners)) for item, owners in found.items()}


def shared_bytes(
    item_holders: Mapping[_K, RankSet], num_bytes: Mapping[_K, float]
) -> dict[RankSet, float]:
    """Bytes per holder set of two or more holders: what each all-reduce bucket sums.

    Items are taken in the order of ``num_bytes``; items held once, absent from
    ``item_holders`` or of no bytes are skipped (they need no sync).
    """
    groups: dict[RankSet, float] = {}
    for item, size in num_bytes.items():
        owners = item_holders.get(item, ())
        if len(owners) > 1 and size > 0:
            groups[owners] = groups.get(owners, 0.0) + size
    return groups


def parameter_holders(plan: Plan) -> dict[str, RankSet]:
    """Canonical parameter name -> sorted ranks whose units use it, by name."""
    units = {u.name: u for u in plan.units}
    pairs = ((r.rank, (p for u in r.units for p in units[u].params)) for r in plan.ranks)
    return dict(sorted(holders(pairs).items()))


def parameter_order(plan: Plan) -> tuple[str, ...]:
    """Canonical parameter names in the model's order: the plan's units in order, each
    unit's ``params`` in order, a tied parameter where it is first used."""
    return tuple(dict.fromkeys(p for u in plan.units for p in u.params))


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """One gradient bucket: parameters of one holder set, summed in one all-reduce."""

    ranks: RankSet
    names: tuple[str, ...]
    """Canonical names, in the reverse of the model's order (as backward finalises them)."""
    num_bytes: int
    """Wire bytes of the bucket (the sum over ``names``)."""


def grad_buckets(
    plan: Plan, wire_bytes: Mapping[str, int], cap_bytes: float
) -> tuple[BucketSpec, ...]:
    """The gradient buckets of the parameters in ``wire_bytes``, in launch order.

    Per holder set of two or more ranks: its parameters in the reverse of the model's
    order (:func:`parameter_order`; the order in which a backward pass finalises a stage's
    gradients), cut greedily into buckets of at most ``cap_bytes`` (a parameter larger
    than the cap is a bucket of its own). Every bucket of every set is then placed in one
    global order, by the position of its first parameter in the reversed model order.

    Derived from the plan and canonical names alone, so every holder of a bucket computes
    the same bucket, and every rank's buckets are a subsequence of one global order: a rank
    that launches its collectives in this order cannot deadlock with another
    (``executor/grad_sync.py``).

    Args:
        wire_bytes: canonical name -> bytes the runtime all-reduces for that trainable
            parameter; parameters absent from it (not trainable, or held elsewhere) are
            skipped.
    """
    held = parameter_holders(plan)
    backward = [n for n in reversed(parameter_order(plan)) if n in wire_bytes]
    position = {name: idx for idx, name in enumerate(backward)}
    by_set: dict[RankSet, list[str]] = {}
    for name in backward:
        if len(held[name]) > 1:
            by_set.setdefault(held[name], []).append(name)
    buckets = [
        b for ranks, names in by_set.items() for b in _split(ranks, names, wire_bytes, cap_bytes)
    ]
    return tuple(sorted(buckets, key=lambda b: position[b.names[0]]))


def _split(
    ranks: RankSet, names: list[str], wire_bytes: Mapping[str, int], cap_bytes: float
) -> list[BucketSpec]:
    buckets: list[BucketSpec] = []
    current: list[str] = []
    size = 0
    for name in names:
        if current and size + wire_bytes[name] > cap_bytes:
            buckets.append(BucketSpec(ranks, tuple(current), size))
            current, size = [], 0
        current.append(name)
        size += wire_bytes[name]
    if current:
        buckets.append(BucketSpec(ranks, tuple(current), size))
    return buckets


def buffer_holders(plan: Plan) -> dict[str, RankSet]:
    """Canonical buffer name -> sorted ranks whose units read it, by name."""
    units = {u.name: u for u in plan.units}
    pairs = ((r.rank, (b for u in r.units for b in units[u].buffers)) for r in plan.ranks)
    return dict(sorted(holders(pairs).items()))


def holder_sets(plan: Plan) -> tuple[RankSet, ...]:
    """Distinct holder sets of more than one rank: the process groups every rank creates,
    in this order (``link_model.sync_order``; creating a group is collective)."""
    sets = {ranks for ranks in parameter_holders(plan).values() if len(ranks) > 1}
    return tuple(sorted(sets, key=sync_order))


def grad_sync_reports(plan: Plan, wire_bytes: Mapping[str, int]) -> tuple[GradSyncReport, ...]:
    """One report per bucket (holder set of two or more ranks), sorted by ranks.

    Args:
        wire_bytes: canonical name -> bytes the runtime all-reduces for that trainable
            parameter; parameters absent from it (not trainable) are skipped.
    """
    held = parameter_holders(plan)
    groups = shared_bytes(
        held, {name: float(wire_bytes[name]) for name in held if name in wire_bytes}
    )
    return tuple(
        GradSyncReport(ranks=ranks, num_bytes=int(num_bytes))
        for ranks, num_bytes in sorted(groups.items())
    )
