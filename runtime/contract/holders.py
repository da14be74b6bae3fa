"""Which ranks hold which parameters: the one place that answers it.

A parameter is held by every rank whose stage holds a unit that uses it
(``UnitSpec.params``). Its gradient is summed every step among exactly those ranks, in
capped buckets per distinct holder set (:func:`grad_buckets`), except where the holder set
spans islands and syncs by ``local_sgd`` or ``async``: then among its holders inside each
island (:func:`step_holders`). The runtime's buckets, the checkpoints (each name saved once,
from its lowest holder), the plan report's bucket bytes and the planner's cost model
(:func:`holders` and :func:`shared_bytes` over its own items, before a plan exists) all
take their answer from here. Torch-free, like the rest of the contract.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from hplan.runtime.contract.link_model import sync_order
from hplan.runtime.contract.plan import (
    GradSyncReport,
    OuterSyncSpec,
    Plan,
    PseudoGradientDtype,
    SyncMode,
)

__all__ = [
    "RUNNING_STAT_BUFFERS",
    "BucketSpec",
    "OptimizerShards",
    "RankSet",
    "applied_after",
    "first_sync_step",
    "grad_buckets",
    "grad_sync_reports",
    "holder_sets",
    "holders",
    "island_of_rank",
    "island_ranks",
    "island_samples",
    "optimizer_shards",
    "outer_exchange_groups",
    "outer_fragments",
    "outer_groups",
    "outer_island_holders",
    "parameter_holders",
    "parameter_order",
    "running_stat_holders",
    "shared_bytes",
    "step_holder_sets",
    "step_holders",
    "sync_summary",
    "syncs_after",
    "tp_positions",
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


def parameter_holders(plan: Plan, tp_rank: int = 0) -> dict[str, RankSet]:
    """Canonical parameter name -> sorted ranks whose units use it, by name, among the
    ranks of TP position ``tp_rank``: under tensor parallelism the ``tp_rank``-th shards of
    a parameter (or, for one the TP plan leaves whole, the copies at that position) are
    summed together, never two positions' shards (``RankPlan.tp_rank``). Without tensor
    parallelism every rank has ``tp_rank`` 0."""
    units = {u.name: u for u in plan.units}
    pairs = (
        (r.rank, (p for u in r.units for p in units[u].params))
        for r in plan.ranks
        if r.tp_rank == tp_rank
    )
    return dict(sorted(holders(pairs).items()))


def tp_positions(plan: Plan) -> range:
    """The ``tp_rank`` values of the plan: ``range(max tp_degree)``."""
    return range(max(r.tp_degree for r in plan.ranks))


RUNNING_STAT_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
"""Last name components of the buffers a normalisation layer updates in training from the
batch it sees (BatchNorm's, and InstanceNorm's with ``track_running_stats``)."""


def running_stat_holders(plan: Plan) -> dict[str, RankSet]:
    """Canonical name of every running-statistics buffer (:data:`RUNNING_STAT_BUFFERS`)
    -> the sorted ranks whose units read it, by name."""
    units = {u.name: u for u in plan.units}
    pairs = (
        (r.rank, (b for u in r.units for b in units[u].buffers if _is_running_stat(b)))
        for r in plan.ranks
    )
    return dict(sorted(holders(pairs).items()))


def _is_running_stat(name: str) -> bool:
    return name.rpartition(".")[2] in RUNNING_STAT_BUFFERS


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

    Per rank set that sums a gradient every step (:func:`step_holders`: a holder set, or
    its part inside one island for a ``local_sgd``/``async`` group) of two or more ranks:
    its parameters in the reverse of the model's order (:func:`parameter_order`; the order
    in which a backward pass finalises a stage's gradients), cut greedily into buckets of
    at most ``cap_bytes`` (a parameter larger than the cap is a bucket of its own). Every
    bucket of every set is then placed in one global order, by the position of its first
    parameter in the reversed model order, then by its ranks. Derived from the plan and
    canonical names alone, so that every holder computes the same buckets in the same order
    (why that cannot deadlock: ``executor/grad_sync.py``).

    Args:
        wire_bytes: canonical name -> bytes the runtime all-reduces for that trainable
            parameter; parameters absent from it (not trainable, or held elsewhere) are
            skipped.
    """
    every_step = step_holders(plan)
    backward = [n for n in reversed(parameter_order(plan)) if n in wire_bytes]
    position = {name: idx for idx, name in enumerate(backward)}
    by_set: dict[RankSet, list[str]] = {}
    for name in backward:
        for ranks in every_step[name]:
            if len(ranks) > 1:
                by_set.setdefault(ranks, []).append(name)
    buckets = [
        b for ranks, names in by_set.items() for b in _split(ranks, names, wire_bytes, cap_bytes)
    ]
    return tuple(sorted(buckets, key=lambda b: (position[b.names[0]], b.ranks)))


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


@dataclass(frozen=True, slots=True)
class OptimizerShards:
    """How one holder set splits the optimizer state of its parameters (ZeRO stage 1).

    The set's trainable parameters, in ``names`` order, are laid end to end as one flat
    vector of ``num_elements``; rank ``r`` keeps the state of elements
    ``bounds[r][0]:bounds[r][1]``, consecutive slices in rank order that cover the vector
    once (a rank of weight 0 gets an empty slice).
    """

    ranks: RankSet
    names: tuple[str, ...]
    """Canonical names in the model's order (:func:`parameter_order`)."""
    num_elements: int
    bounds: dict[int, tuple[int, int]]


def optimizer_shards(plan: Plan, numels: Mapping[str, int]) -> dict[RankSet, OptimizerShards]:
    """The optimizer-state shards of every holder set of two or more ranks under ZeRO
    stage 1, by set (the same on every rank: derived from the plan and the sizes alone).

    Shard sizes follow the members' ``RankPlan.optimizer_shard_weight``: rank i of the set
    ends its slice at ``round(N * (w_0 + ... + w_i) / (w_0 + ... + w_k))`` elements, so the
    slices add up to the whole vector whatever the weights (``Plan.verify`` requires a
    positive sum).

    Args:
        numels: canonical name -> elements of each trainable parameter; parameters absent
            from it (frozen) are not sharded.
    """
    order = [n for n in parameter_order(plan) if n in numels]
    held = parameter_holders(plan)
    names_of: dict[RankSet, list[str]] = {}
    for name in order:
        ranks = held.get(name, ())
        if len(ranks) > 1:
            names_of.setdefault(ranks, []).append(name)
    out: dict[RankSet, OptimizerShards] = {}
    for ranks in sorted(names_of, key=sync_order):
        names = tuple(names_of[ranks])
        total = sum(int(numels[n]) for n in names)
        weights = [plan.ranks[r].optimizer_shard_weight for r in ranks]
        whole = sum(weights)
        bounds: dict[int, tuple[int, int]] = {}
        start, running = 0, 0.0
        for r, w in zip(ranks, weights, strict=True):
            running += w
            stop = total if r == ranks[-1] else min(total, round(total * running / whole))
            bounds[r] = (start, max(start, stop))
            start = bounds[r][1]
        out[ranks] = OptimizerShards(ranks, names, total, bounds)
    return out


def holder_sets(plan: Plan) -> tuple[RankSet, ...]:
    """Distinct holder sets of more than one rank, in ``link_model.sync_order``. Without
    ``local_sgd``/``async`` groups, the gradient process groups (:func:`step_holder_sets`)."""
    sets = {
        ranks
        for tp_rank in tp_positions(plan)
        for ranks in parameter_holders(plan, tp_rank).values()
        if len(ranks) > 1
    }
    return tuple(sorted(sets, key=sync_order))


def step_holder_sets(plan: Plan) -> tuple[RankSet, ...]:
    """Distinct rank sets of more than one rank that sum some gradient every step
    (:func:`step_holders`), in ``link_model.sync_order``: the gradient process groups every
    rank creates, in this order. :func:`holder_sets` without ``local_sgd``/``async`` groups."""
    sets = {ranks for found in step_holders(plan).values() for ranks in found if len(ranks) > 1}
    return tuple(sorted(sets, key=sync_order))


def grad_sync_reports(plan: Plan, wire_bytes: Mapping[str, int]) -> tuple[GradSyncReport, ...]:
    """One report per bucket (holder set of two or more ranks), sorted by ranks.

    Args:
        wire_bytes: canonical name -> bytes the runtime all-reduces for that trainable
            parameter; parameters absent from it (not trainable) are skipped.
    """
    groups: dict[RankSet, float] = {}
    for tp_rank in tp_positions(plan):  # each TP position's holder sets
        held = parameter_holders(plan, tp_rank)
        groups |= shared_bytes(
            held, {name: float(wire_bytes[name]) for name in held if name in wire_bytes}
        )
    return tuple(
        GradSyncReport(ranks=ranks, num_bytes=int(num_bytes))
        for ranks, num_bytes in sorted(groups.items())
    )


# --------------------------------------------------------------------------- islands
def island_of_rank(plan: Plan) -> dict[int, str]:
    """Rank -> the name of its node's island (``training.sync``); one island ``""`` holding
    every rank when the plan has no islands."""
    sync = plan.training.sync
    if sync is None:
        return {r.rank: "" for r in plan.ranks}
    island = {node: i.name for i in sync.islands for node in i.nodes}
    return {r.rank: island[r.node] for r in plan.ranks}


def island_ranks(plan: Plan) -> dict[str, RankSet]:
    """Island name -> its sorted ranks, islands in the plan's order (islands without ranks
    left out; one island ``""`` holding every rank when the plan has no islands)."""
    where = island_of_rank(plan)
    sync = plan.training.sync
    names = [""] if sync is None else [i.name for i in sync.islands]
    found = {name: tuple(r for r in sorted(where) if where[r] == name) for name in names}
    return {name: ranks for name, ranks in found.items() if ranks}


def island_samples(plan: Plan) -> dict[str, int]:
    """Island name -> samples its replicas process per inner step (the sum of their batch
    shares); the weights of its loss and of its pseudo-gradients."""
    where = island_of_rank(plan)
    samples: dict[str, int] = {}
    for replica in range(plan.num_replicas):
        first = plan.replica_ranks(replica)[0]
        samples[where[first.rank]] = samples.get(where[first.rank], 0) + first.num_samples
    return samples


def outer_groups(plan: Plan) -> dict[RankSet, OuterSyncSpec]:
    """Every holder set spanning two or more islands -> how it syncs: its entry in
    ``training.sync.groups``, else ``all_reduce`` every step. Empty without islands."""
    sync = plan.training.sync
    if sync is None:
        return {}
    where = island_of_rank(plan)
    listed = {g.ranks: g for g in sync.groups}
    return {
        ranks: listed.get(ranks, OuterSyncSpec(ranks=ranks, mode=SyncMode.ALL_REDUCE))
        for ranks in holder_sets(plan)
        if len({where[r] for r in ranks}) > 1
    }


def outer_island_holders(plan: Plan, group: OuterSyncSpec) -> dict[str, RankSet]:
    """Island name -> the holders of ``group`` inside it, islands in the order of their
    lowest holders; the first of each is the island's *lead*, which sends its island's
    quantized pseudo-gradient (``PseudoGradientDtype``)."""
    where = island_of_rank(plan)
    found: dict[str, list[int]] = {}
    for rank in sorted(group.ranks):
        found.setdefault(where[rank], []).append(rank)
    return {island: tuple(ranks) for island, ranks in found.items()}


def outer_exchange_groups(plan: Plan, group: OuterSyncSpec) -> tuple[RankSet, ...]:
    """The rank sets of a quantized ``group``'s exchange, in the order every rank creates
    their process groups: the islands' leads (who all-gather the payloads), then each
    island's holders where it has several (its lead sends them the decoded sum)."""
    by_island = outer_island_holders(plan, group)
    leads = tuple(ranks[0] for ranks in by_island.values())
    return (leads, *(ranks for ranks in by_island.values() if len(ranks) > 1))


def step_holders(plan: Plan) -> dict[str, tuple[RankSet, ...]]:
    """Canonical parameter name -> the rank sets that each sum its gradient every step: per
    TP position (the holders of that position's shard) one, all its holders, except where
    its holder set syncs by ``local_sgd`` or ``async``: then
    one per island, the holders inside that island (a set of one rank sums nothing)."""
    where = island_of_rank(plan)
    local = {ranks for ranks, g in outer_groups(plan).items() if g.mode is not SyncMode.ALL_REDUCE}
    found: dict[str, set[RankSet]] = {}
    for tp_rank in tp_positions(plan):  # one set per TP position (``parameter_holders``)
        for name, ranks in parameter_holders(plan, tp_rank).items():
            if ranks not in local:
                found.setdefault(name, set()).add(ranks)
                continue
            by_island: dict[str, list[int]] = {}
            for r in ranks:
                by_island.setdefault(where[r], []).append(r)
            found.setdefault(name, set()).update(tuple(v) for v in by_island.values())
    return {name: tuple(sorted(sets)) for name, sets in found.items()}


def outer_fragments(
    group: OuterSyncSpec, names: Sequence[str], wire_bytes: Mapping[str, int]
) -> tuple[tuple[str, ...], ...]:
    """The group's parameters (``names``, in model order) cut into ``num_fragments``
    contiguous fragments of about equal wire bytes (a fragment closes after the parameter
    that brings the running total nearest to its share's end; every fragment keeps at least
    one parameter); fewer when there are fewer parameters."""
    total = sum(wire_bytes[n] for n in names)
    count = min(group.num_fragments, len(names))
    fragments: list[tuple[str, ...]] = []
    current: list[str] = []
    size = 0
    for idx, name in enumerate(names):
        current.append(name)
        size += wire_bytes[name]
        left_names = len(names) - idx - 1
        left_fragments = count - len(fragments) - 1
        target = total * (len(fragments) + 1) / count
        if left_fragments > 0 and (
            size >= target - wire_bytes[name] / 2 or left_names == left_fragments
        ):
            fragments.append(tuple(current))
            current = []
    if current:
        fragments.append(tuple(current))
    return tuple(fragments)


def syncs_after(group: OuterSyncSpec, fragment_idx: int, step: int) -> bool:
    """Whether fragment ``fragment_idx`` of ``group`` syncs after step ``step`` (0-based):
    ``(step + 1 + fragment_idx * H // F) % H == 0`` with H = ``local_steps``, F =
    ``num_fragments`` (:class:`OuterSyncSpec`)."""
    offset = fragment_idx * group.local_steps // group.num_fragments
    return (step + 1 + offset) % group.local_steps == 0


def applied_after(group: OuterSyncSpec, fragment_idx: int, step: int) -> bool:
    """Whether the average of fragment ``fragment_idx`` launched ``group.delay_steps`` steps
    before is applied after step ``step``: it synced after step ``step - delay_steps >= 0``
    (:attr:`OuterSyncSpec.delay_steps`; with delay 0, exactly :func:`syncs_after`)."""
    launched = step - group.delay_steps
    return launched >= 0 and syncs_after(group, fragment_idx, launched)


def first_sync_step(group: OuterSyncSpec, fragment_idx: int) -> int:
    """The first step after which fragment ``fragment_idx`` of ``group`` syncs."""
    offset = fragment_idx * group.local_steps // group.num_fragments
    return (-(1 + offset)) % group.local_steps


def sync_summary(plan: Plan) -> str:
    """A few words on how the plan syncs: ``all_reduce`` (one island, or every group
    synchronous), else each mode with its H and, where not the defaults, its fragments,
    overlap and wire format, and the islands (``local_sgd H=50 across islands a | b``,
    ``local_sgd H=48 F=13 overlap=4 bfloat16, local_sgd H=6 ...``)."""
    sync = plan.training.sync
    ways = sorted(
        {
            (g.mode.value, g.local_steps, g.num_fragments, g.overlap_steps, g.wire_dtype.value)
            for g in outer_groups(plan).values()
            if g.mode is not SyncMode.ALL_REDUCE
        }
    )
    if sync is None or not ways:
        return SyncMode.ALL_REDUCE.value
    how = ", ".join(_way(*way) for way in ways)
    return f"{how} across islands {' | '.join(i.name for i in sync.islands)}"


def _way(mode: str, local_steps: int, fragments: int, overlap: int, wire: str) -> str:
    words = [f"{mode} H={local_steps}"]
    words += [f"F={fragments}"] if fragments > 1 else []
    words += [f"overlap={overlap}"] if overlap else []
    words += [wire] if wire != PseudoGradientDtype.FLOAT32.value else []
    return " ".join(words)
