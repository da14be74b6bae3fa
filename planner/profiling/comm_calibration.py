"""Communication calibration: the gradient all-reduce a run measured against the plan's.

The link matrix (``hplan bandwidth``) times messages between two processes; the all-reduce
a training run waits for also pays its collective library's per-call work on each rank.
On CPU ranks under a CPU quota that work is the cost: on the three-node benchmark
(``bench/real_cluster.py``, quotas 0.9 / 0.45 / 0.45 cores) the links predicted a ~3 ms ring
for 2-3 MB of gradients, the runtime waited 19-33 ms, and smaller buckets (more calls for
the same bytes) made steps slower (issue 14's note). The cost is per call, not per byte.

So the model fitted here is the ring's latency term: each holder set's ring
(``link_model.ring_all_reduce_time_s``) pays ``2 (n - 1)`` steps of ``latency_per_step_s``
per call (per bucket), the bandwidth term staying the links'. One run gives one exposed time
per holder set, and one number is what it determines; a fixed cost per call and an
effective bandwidth would need two bucket sizes or two byte counts per set.

**Waiting is not the collective.** A rank's exposed all-reduce (``allreduce_time_s``)
includes waiting for the last holder to launch, and that wait is the slower ranks' compute,
which the compute calibration already corrects. The runtime times each ring from its last
holder's launch (``executor/grad_sync.py``), so the holder that arrived last waited for no
one: per step, the smallest exposed time over the set's ranks is the collective itself.
The fit uses the median over steps of that minimum; the median of the others' excess over
it is reported as the wait.

**Per node.** The cost model's collective term is per node (``CollectiveSpec``, taken as
the worst over a ring's nodes, ``Plan.ring_channel``), and a set's fitted latency cannot be
split among its members from one run. A node gets the smallest latency fitted over the
sets that hold its devices (a node in a fast ring cannot be the one slowing a slow ring:
with one set, every node of it gets that set's figure), and never less than its links'
(a run cannot make the links faster than they measured).

Only holder sets whose ranks sum no other set are fitted: another set's rings would be
in the same exposed time. Sets of islands that sync locally (``local_sgd``, ``async``) are
left out.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hplan.planner.hardware.cluster import Cluster
from hplan.planner.profiling.profile_file import NodeCollective
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.link_model import (
    BUCKET_CAP_BYTES,
    last_bucket_bytes,
    overlap_window_s,
)
from hplan.runtime.contract.plan import CollectiveSpec, Plan

__all__ = [
    "SetFit",
    "collective_fits",
    "fit_latency_per_step_s",
    "node_collectives",
    "with_calibrated_collectives",
]


@dataclass(frozen=True, slots=True)
class SetFit:
    """One holder set's all-reduce: predicted, measured and the latency that explains it.

    Times are per step, in seconds of the plan's hardware.
    """

    ranks: tuple[int, ...]
    num_bytes: float
    """Gradient bytes the set sums per step."""
    predicted_s: float
    """Exposed all-reduce the plan's links predict (after the last backward pass)."""
    measured_s: float
    """Median over steps of the smallest exposed all-reduce of the set's ranks."""
    wait_s: float
    """Median over steps of the other ranks' mean excess over it: waiting for the last."""
    link_latency_per_step_s: float
    """The ring's latency per step the plan used (its slowest link, its nodes' collective)."""
    latency_per_step_s: float
    """The fitted latency per ring step (>= ``link_latency_per_step_s``)."""
    bandwidth_bytes_per_s: float
    """The ring's bandwidth (kept as it is)."""


def fit_latency_per_step_s(
    measured_s: float,
    num_ranks: int,
    num_bytes: float,
    bandwidth_bytes_per_s: float,
    window_s: float = 0.0,
    cap_bytes: float = BUCKET_CAP_BYTES,
) -> float:
    """The ring latency per step under which the exposed all-reduce takes ``measured_s``.

    The exposed time ``max(T(L) - W, R(L))`` (``link_model.exposed_all_reduce_s``) is the
    larger of two lines in the latency per step ``L``, with ``s = 2 (n - 1)`` ring steps and
    ``k`` buckets:

    - every bucket's ring less the overlap window:
      ``T(L) - W = s / n * bytes / bandwidth - W + k s L``;
    - the last bucket's ring: ``R(L) = s / n * last_bytes / bandwidth + s L``.

    Both rise with ``L``, so their maximum reaches ``measured_s`` first where the earlier of
    the two does: ``L = min((m - a) / b)`` over the lines ``a + b L``.

    Args:
        measured_s: the exposed all-reduce measured, seconds (> 0).
        num_ranks: ranks of the ring (>= 2).
        num_bytes: bytes summed per step (> 0).
        bandwidth_bytes_per_s: the ring's bandwidth (> 0).
        window_s: the overlap window (``link_model.overlap_window_s``), seconds.
        cap_bytes: the bucket cap.

    Returns:
        Seconds per ring step; may be negative when the bandwidth term alone exceeds
        ``measured_s`` (callers bound it below by the links' latency).

    Raises:
        ValueError: fewer than two ranks, no bytes, or a bandwidth <= 0.
    """
    if num_ranks < 2 or num_bytes <= 0 or bandwidth_bytes_per_s <= 0:
        raise ValueError(
            f"a ring fit needs >= 2 ranks, bytes > 0 and bandwidth > 0; got {num_ranks} ranks, "
            f"{num_bytes} bytes, {bandwidth_bytes_per_s} bytes/s"
        )
    steps = 2 * (num_ranks - 1)
    num_buckets = max(1, math.ceil(num_bytes / cap_bytes))
    wire_s = steps / num_ranks / bandwidth_bytes_per_s
    lines = (
        (wire_s * num_bytes - window_s, num_buckets * steps),
        (wire_s * last_bucket_bytes(num_bytes, cap_bytes), steps),
    )
    return min((measured_s - a) / b for a, b in lines)


def _exposed_s(
    num_ranks: int, num_bytes: float, bandwidth: float, latency: float, window_s: float
) -> float:
    """The exposed all-reduce of one set under latency per step ``latency`` (the lines of
    :func:`fit_latency_per_step_s` at ``latency``)."""
    steps = 2 * (num_ranks - 1)
    num_buckets = max(1, math.ceil(num_bytes / BUCKET_CAP_BYTES))
    wire_s = steps / num_ranks / bandwidth
    total_s = wire_s * num_bytes + num_buckets * steps * latency
    last_s = wire_s * last_bucket_bytes(num_bytes, BUCKET_CAP_BYTES) + steps * latency
    return max(total_s - window_s, last_s)


def waiting_s(exposed_s: Sequence[float]) -> float:
    """The holders' mean wait for the last to launch, in one step: the mean excess of the
    others' exposed all-reduce over the smallest (the last holder's), seconds."""
    least = min(exposed_s)
    return (sum(exposed_s) - len(exposed_s) * least) / (len(exposed_s) - 1)


def _window_s(plan: Plan, rank: int, num_bytes: float) -> float:
    """The overlap window of ``rank``: its last micro-batch's predicted backward."""
    report = next((r for r in plan.report.ranks if r.rank == rank), None)
    if report is None:
        return 0.0
    backward_s = report.backward_time_s / plan.ranks[rank].num_microbatches
    return overlap_window_s(backward_s, num_bytes, BUCKET_CAP_BYTES)


def fitted_sets(plan: Plan) -> dict[tuple[int, ...], float]:
    """Holder sets whose ranks sum no other set -> their bytes (see the module docstring)."""
    sets = {tuple(g.ranks): float(g.num_bytes) for g in plan.report.grad_sync or ()}
    sync = plan.training.sync
    if sync is not None and sync.local:
        return {}
    count: dict[int, int] = {}
    for ranks in sets:
        for r in ranks:
            count[r] = count.get(r, 0) + 1
    return {
        ranks: b
        for ranks, b in sets.items()
        if len(ranks) > 1 and b > 0 and all(count[r] == 1 for r in ranks)
    }


def collective_fits(plan: Plan, exposed_s: Mapping[int, Mapping[int, float]]) -> tuple[SetFit, ...]:
    """Fit each of ``plan``'s single holder sets (:func:`fitted_sets`) to the run.

    Args:
        plan: the plan the run ran.
        exposed_s: rank -> step -> its exposed all-reduce, seconds of the plan's hardware
            (warm-up steps already left out; several runs' steps under distinct keys).

    Returns:
        One fit per set that every one of its ranks measured in some common step.
    """
    fits = []
    for ranks, num_bytes in sorted(fitted_sets(plan).items()):
        steps = set.intersection(*(set(exposed_s.get(r, {})) for r in ranks))
        if not steps:
            continue
        per_step = [[exposed_s[r][s] for r in ranks] for s in sorted(steps)]
        last = [min(times) for times in per_step]
        waits = [waiting_s(times) for times in per_step]
        bandwidth, latency = plan.ring_channel([plan.ranks[r].device for r in ranks])
        window_s = min(_window_s(plan, r, num_bytes) for r in ranks)
        measured_s = statistics.median(last)
        fitted = fit_latency_per_step_s(measured_s, len(ranks), num_bytes, bandwidth, window_s)
        fits.append(
            SetFit(
                ranks=ranks,
                num_bytes=num_bytes,
                predicted_s=_exposed_s(len(ranks), num_bytes, bandwidth, latency, window_s),
                measured_s=measured_s,
                wait_s=statistics.median(waits),
                link_latency_per_step_s=latency,
                latency_per_step_s=max(latency, fitted),
                bandwidth_bytes_per_s=bandwidth,
            )
        )
    return tuple(fits)


def node_collectives(plan: Plan, fits: Sequence[SetFit]) -> dict[str, NodeCollective]:
    """Each node of a fitted set -> its calibrated collective (module docstring: the
    smallest latency of the sets holding its devices; bus bandwidth no lower than any of
    the node's links, so that no ring's bandwidth changes)."""
    node_of_rank = {r.rank: r.node for r in plan.ranks}
    best: dict[str, SetFit] = {}
    for fit in fits:
        for node in {node_of_rank[r] for r in fit.ranks}:
            if node not in best or fit.latency_per_step_s < best[node].latency_per_step_s:
                best[node] = fit
    nodes = {n.name: n for n in plan.cluster.nodes}
    out = {}
    for node, fit in sorted(best.items()):
        own = nodes[node].collective
        bus = _node_bus_bandwidth(plan, node)
        out[node] = NodeCollective(
            node=node,
            latency_per_step_s=max(fit.latency_per_step_s, 0.0),
            bus_bandwidth_bytes_per_s=bus if own is None else own.bus_bandwidth_bytes_per_s,
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
