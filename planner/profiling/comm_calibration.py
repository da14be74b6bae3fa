"""Communication calibration: the gradient all-reduce a run measured against the plan's.

The link matrix (``hplan bandwidth``) times messages between two processes; the all-reduce
a training run waits for also pays its collective library's per-call work on each rank,
which on CPU ranks under a quota can dominate. That cost is per call, not per byte, so the
model fitted here is the ring's latency term: each ring pays ``2 (n - 1)`` steps of
``latency_per_step_s`` per bucket (``link_model.ring_all_reduce_time_s``), the bandwidth
staying the links' (:func:`fit_latency_per_step_s`). A rank's exposed all-reduce includes
waiting for the last holder, the slower ranks' compute, which the compute calibration
corrects; the runtime times each ring from its last holder's launch, so per step the
smallest exposed time in a sync group is the collective itself (:func:`collective_fits`).
A node gets the smallest latency fitted over the groups holding its devices, never less
than its links' (:func:`calibrated_node_collectives`). Plans whose islands sync locally are left out.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hplan.planner.hardware.cluster import Cluster
from hplan.planner.profiling.profile_file import NodeCollective
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.link_model import (
    BUCKET_CAP_BYTES,
    bucket_rings_s,
    exposed_all_reduce_s,
    overlap_window_s,
)
from hplan.runtime.contract.plan import CollectiveSpec, Plan

__all__ = [
    "GroupFit",
    "Ring",
    "calibrated_node_collectives",
    "collective_fits",
    "fit_latency_per_step_s",
    "plan_rings",
    "predicted_exposed_s",
    "sync_groups",
    "waiting_s",
    "with_calibrated_collectives",
]


@dataclass(frozen=True, slots=True)
class Ring:
    """One holder set's gradient all-reduce: its ranks, bytes per step and channel."""

    ranks: tuple[int, ...]
    num_bytes: float
    bandwidth_bytes_per_s: float
    latency_s: float
    """The plan's latency per ring step (slowest link, nodes' collectives)."""


@dataclass(frozen=True, slots=True)
class GroupFit:
    """One sync group's all-reduce: predicted, measured and the latency that explains it.

    Times are per step, in seconds of the plan's hardware.
    """

    ranks: tuple[int, ...]
    """Every rank of the group's holder sets, sorted."""
    num_sets: int
    num_bytes: float
    """Gradient bytes the group's sets sum per step, together."""
    predicted_s: float
    """The smallest exposed all-reduce of the group's ranks the plan predicts."""
    measured_s: float
    """Median over steps of the smallest exposed all-reduce measured (no waiting)."""
    wait_s: float
    """Median over steps of the other ranks' mean excess over it: waiting for the last."""
    link_latency_per_step_s: float
    """The largest latency per ring step the plan used in the group."""
    latency_per_step_s: float
    """The fitted node latency per ring step (each ring runs at the larger of it and its
    own; 0: the links explain what was measured)."""


def fit_latency_per_step_s(
    measured_s: float, rings: Sequence[Ring], window_s: float = 0.0
) -> float:
    """The node latency per ring step under which a rank's exposed all-reduce takes
    ``measured_s``.

    A node's collective latency ``L`` makes each ring run at ``max(L, ring.latency_s)`` per
    step (``Plan.ring_channel``); the rank's exposed time at ``L``
    (:func:`predicted_exposed_s`: its rings one after another, every bucket's
    ``2 (n - 1)`` latency steps, less the overlap window, never below the last bucket's ring)
    rises with ``L`` and is continuous, so it is solved for ``L`` by bisection on
    ``[0, measured_s]`` (at ``L = measured_s`` one ring step alone takes it).

    Args:
        measured_s: the exposed all-reduce measured, seconds.
        rings: the rank's rings (each of >= 2 ranks, bytes > 0, bandwidth > 0).
        window_s: the rank's overlap window (``link_model.overlap_window_s``), seconds.

    Returns:
        Seconds per ring step, to within 1e-12 s; 0 when the rings as they are already take
        ``measured_s`` or more.

    Raises:
        ValueError: no rings, or a ring of fewer than two ranks, no bytes or no bandwidth.
    """
    bad = [r for r in rings if len(r.ranks) < 2 or r.num_bytes <= 0 or r.bandwidth_bytes_per_s <= 0]
    if not rings or bad:
        raise ValueError(
            f"a ring fit needs rings of >= 2 ranks, bytes > 0 and bandwidth > 0; got "
            f"{bad[0] if bad else 'no rings'}"
        )

    def exposed_s(latency_s: float) -> float:
        floored = [dataclasses.replace(r, latency_s=max(r.latency_s, latency_s)) for r in rings]
        return predicted_exposed_s(floored, window_s)

    low, high = 0.0, max(measured_s, 0.0)
    if exposed_s(low) >= measured_s:
        return 0.0
    while high - low > 1e-12:
        middle = (low + high) / 2
        low, high = (middle, high) if exposed_s(middle) < measured_s else (low, middle)
    return (low + high) / 2


def predicted_exposed_s(rings: Sequence[Ring], window_s: float) -> float:
    """The exposed all-reduce of a rank running ``rings`` at their own latencies, as the
    cost model charges it (``link_model.exposed_all_reduce_s`` of the summed buckets)."""
    times = [
        bucket_rings_s(len(r.ranks), r.num_bytes, r.bandwidth_bytes_per_s, r.latency_s)
        for r in rings
    ]
    total_s = sum(t for t, _ in times)
    return exposed_all_reduce_s(total_s, window_s, max(last for _, last in times))


def waiting_s(exposed_s: Sequence[float]) -> float:
    """The holders' mean wait for the last to launch, in one step: the mean excess of the
    others' exposed all-reduce over the smallest (the last holder's), seconds (>= 2 ranks)."""
    least = min(exposed_s)
    return (sum(exposed_s) - len(exposed_s) * least) / (len(exposed_s) - 1)


def _window_s(plan: Plan, rank: int, num_bytes: float) -> float:
    """The overlap window of ``rank`` summing ``num_bytes``: its last micro-batch's
    predicted backward (``link_model.overlap_window_s``)."""
    report = next((r for r in plan.report.ranks if r.rank == rank), None)
    if report is None:
        return 0.0
    backward_s = report.backward_time_s / plan.ranks[rank].num_microbatches
    return overlap_window_s(backward_s, num_bytes, BUCKET_CAP_BYTES)


def plan_rings(plan: Plan) -> tuple[Ring, ...]:
    """The holder sets ``plan`` sums every step, as rings (none under local sync)."""
    sync = plan.training.sync
    if sync is not None and sync.local:
        return ()
    rings = []
    for group in plan.report.grad_sync or ():
        if len(group.ranks) > 1 and group.num_bytes > 0:
            ranks = tuple(group.ranks)
            bandwidth, latency = plan.ring_channel([plan.ranks[r].device for r in ranks])
            rings.append(Ring(ranks, float(group.num_bytes), bandwidth, latency))
    return tuple(rings)


def sync_groups(rings: Sequence[Ring]) -> tuple[tuple[Ring, ...], ...]:
    """``rings`` joined where they share a rank (connected components), in first-ring
    order."""
    groups: list[tuple[set[int], list[Ring]]] = []
    for ring in rings:
        touching = [g for g in groups if g[0] & set(ring.ranks)]
        merged_ranks, merged_rings = set(ring.ranks), [ring]
        for g in touching:
            merged_ranks |= g[0]
            merged_rings = [*g[1], *merged_rings]
            groups.remove(g)
        groups.append((merged_ranks, merged_rings))
    return tuple(tuple(g[1]) for g in groups)


def collective_fits(
    plan: Plan, exposed_s: Mapping[int, Mapping[int, float]]
) -> tuple[GroupFit, ...]:
    """Fit each sync group of ``plan`` (:func:`sync_groups`: holder sets that share a rank,
    joined) to a run: per step, the latency is fitted to the rank with the smallest exposed
    time, under that rank's own rings and overlap window, and the fit is the median over
    steps; the median of the others' excess over that smallest time is the wait.

    Args:
        plan: the plan the run ran.
        exposed_s: rank -> step -> its exposed all-reduce, seconds of the plan's hardware
            (warm-up steps already left out; several runs' steps under distinct keys).

    Returns:
        One fit per group that every one of its ranks measured in some common step.
    """
    fits = []
    for group in sync_groups(plan_rings(plan)):
        ranks = tuple(sorted({r for ring in group for r in ring.ranks}))
        mine = {r: [g for g in group if r in g.ranks] for r in ranks}
        window = {r: _window_s(plan, r, sum(g.num_bytes for g in mine[r])) for r in ranks}
        steps = sorted(set.intersection(*(set(exposed_s.get(r, {})) for r in ranks)))
        if not steps:
            continue
        per_step = [{r: exposed_s[r][s] for r in ranks} for s in steps]
        last = [min(times, key=times.__getitem__) for times in per_step]
        fitted = [
            fit_latency_per_step_s(times[r], mine[r], window[r])
            for times, r in zip(per_step, last, strict=True)
        ]
        fits.append(
            GroupFit(
                ranks=ranks,
                num_sets=len(group),
                num_bytes=sum(g.num_bytes for g in group),
                predicted_s=min(predicted_exposed_s(mine[r], window[r]) for r in ranks),
                measured_s=statistics.median(t[r] for t, r in zip(per_step, last, strict=True)),
                wait_s=statistics.median(waiting_s(list(t.values())) for t in per_step),
                link_latency_per_step_s=max(g.latency_s for g in group),
                latency_per_step_s=statistics.median(fitted),
            )
        )
    return tuple(fits)


def calibrated_node_collectives(plan: Plan, fits: Sequence[GroupFit]) -> dict[str, NodeCollective]:
    """Each node of a fitted group -> its calibrated collective: the smallest latency of the
    groups holding its devices (a group's latency cannot be split among its members from one
    run, and a node in a fast ring cannot be the one slowing a slow ring), never less than
    its links'; bus bandwidth its measured collective's, else its fastest link's, so that no
    ring's bandwidth changes. Nodes whose latency would not rise above their own collective's
    (or 0) are left out."""
    node_of_rank = {r.rank: r.node for r in plan.ranks}
    best: dict[str, GroupFit] = {}
    for fit in fits:
        for node in {node_of_rank[r] for r in fit.ranks}:
            if node not in best or fit.latency_per_step_s < best[node].latency_per_step_s:
                best[node] = fit
    nodes = {n.name: n for n in plan.cluster.nodes}
    out = {}
    for node, fit in sorted(best.items()):
        own = nodes[node].collective
        if fit.latency_per_step_s <= (0.0 if own is None else own.latency_per_step_s):
            continue
        out[node] = NodeCollective(
            node=node,
            latency_per_step_s=fit.latency_per_step_s,
            bus_bandwidth_bytes_per_s=_node_bus_bandwidth(plan, node)
            if own is None
            else own.bus_bandwidth_bytes_per_s,
            reason=f"all-reduce of ranks {list(fit.ranks)} ({fit.num_bytes / 1e6:.3g} MB) "
            f"measured {fit.measured_s * 1e3:.3g} ms after its last holder launched, "
            f"predicted {fit.predicted_s * 1e3:.3g} ms",
        )
    return out


def _node_bus_bandwidth(plan: Plan, node: str) -> float:
    """The fastest link of ``node``'s devices: a bus bandwidth that slows no ring."""
    mine = {d.name for d in plan.cluster.devices if d.node == node}
    speeds = [
        link.bandwidth_bytes_per_s
        for link in plan.cluster.links
        if link.a in mine or link.b in mine
    ]
    return max(speeds, default=1e12)


def with_calibrated_collectives(
    cluster: Cluster, collectives: Sequence[NodeCollective], label: str
) -> tuple[Cluster, tuple[str, ...]]:
    """``cluster`` with each calibrated node collective in place of the node's own, and a
    note for the plan's report (none without collectives).

    Raises:
        ConfigError: a collective of a node ``cluster`` lacks (naming it, its nodes and the
            fix).
    """
    if not collectives:
        return cluster, ()
    names = [n.name for n in cluster.nodes]
    unknown = [c.node for c in collectives if c.node not in names]
    if unknown:
        raise ConfigError(
            f"profile {label} calibrated the all-reduce of node {unknown[0]!r}, which "
            f"{cluster.source!r} does not have (its nodes: {', '.join(names)}); calibrate a run "
            "on this cluster, or leave that profile out"
        )
    specs = {
        c.node: CollectiveSpec(
            latency_per_step_s=c.latency_per_step_s,
            bus_bandwidth_bytes_per_s=c.bus_bandwidth_bytes_per_s,
        )
        for c in collectives
    }
    note = "all-reduce calibrated on " + ", ".join(
        f"{c.node} ({c.latency_per_step_s * 1e3:.3g} ms per ring step)" for c in collectives
    )
    updated = dataclasses.replace(cluster, node_collectives={**cluster.node_collectives, **specs})
    return updated, (f"{note} ({label})",)
