"""Measured links over the cluster file's: what ``hplan solve --bandwidth bw.json`` does.

The link matrix file (``hplan.runtime.contract.link_matrix``, written by ``python -m
hplan.runtime.bandwidth`` or ``hplan bandwidth``) holds a fitted latency and bandwidth for
every ordered pair of measured ranks, named by cluster device (``<node>/<local_index>``).
:func:`apply_measured_links` turns each measured device pair into a device-pair link of the
cluster, in place of what cluster.yaml said: the slower of the two directions (a ``Link``
is symmetric; the pipeline sends activations one way and gradients the other), and the
larger latency. Pairs the file does not cover keep the cluster file's links. Each node's
measured all-reduce becomes that node's ``CollectiveSpec``: an all-reduce among its devices
is then no faster than the one measured (``Plan.ring_channel``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from hplan.planner.hardware.cluster import Cluster, Link
from hplan.planner.textfmt import count
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.link_matrix import BandwidthFile, NodeAllReduce, PairLink
from hplan.runtime.contract.plan import CollectiveSpec

_SHOWN_NAMES = 5


@dataclass(frozen=True)
class MeasuredLinks:
    """A cluster whose measured device pairs use the measured links."""

    cluster: Cluster
    num_pairs: int
    """Unordered device pairs that now use a measurement."""
    note: str
    """One line for the plan's report: how many pairs came from which file."""


def load_measured_links(cluster: Cluster, path: Path) -> MeasuredLinks:
    """Read a link matrix file and apply it to ``cluster``.

    Raises:
        ConfigError: unreadable or invalid file; see :func:`apply_measured_links`.
    """
    return apply_measured_links(cluster, BandwidthFile.load(path), source=str(path))


def apply_measured_links(
    cluster: Cluster, measured: BandwidthFile, *, source: str
) -> MeasuredLinks:
    """``cluster`` with every measured device pair's link replaced by the measurement.

    Args:
        measured: the link matrix; its ranks must carry cluster device names.
        source: the file's name, for messages and the note.

    Raises:
        ConfigError: a measured pair's ranks carry no device name (measured without a node
            name), or the file names devices that ``cluster`` does not have (names them).
    """
    devices = {name.rank: name.device for name in measured.ranks}
    unnamed = sorted({r for p in measured.pairs for r in _ends(p) if devices.get(r) is None})
    if unnamed:
        raise ConfigError(
            f"bandwidth file {source!r}: ranks {_listed(str(r) for r in unnamed)} carry no "
            "device name (measured without a node name); re-measure with HPLAN_NODE=<node> "
            "set on every node (the scripts of `hplan bandwidth --write-scripts` do) or with "
            "--cluster"
        )
    known = set(cluster.device_names)
    unknown = sorted({d for d in devices.values() if d is not None and d not in known})
    if unknown:
        raise ConfigError(
            f"bandwidth file {source!r} names devices that cluster {cluster.source!r} does not "
            f"have: {_listed(repr(d) for d in unknown)}; measure with the cluster's node names "
            f"(HPLAN_NODE=<node>) or pass the cluster file it was measured for"
        )
    strangers = sorted({e.node for e in measured.all_reduce} - {n.name for n in cluster.nodes})
    if strangers:
        raise ConfigError(
            f"bandwidth file {source!r} measured an all-reduce on node(s) "
            f"{_listed(repr(n) for n in strangers)}, which cluster {cluster.source!r} does not "
            "have; measure with the cluster's node names (HPLAN_NODE=<node>) or pass the "
            "cluster file it was measured for"
        )
    links = _measured_device_links(measured.pairs, devices)
    total = len(known) * (len(known) - 1) // 2
    note = (
        f"links: {len(links)} of {count(total, 'device pair')} measured ({source}; the slower "
        "direction of each pair)"
        + (f", the rest from {cluster.source}" if len(links) < total else "")
    )
    merged = {**cluster.device_links, **links}
    collectives = node_collectives(measured.all_reduce, {n.name for n in cluster.nodes})
    if collectives:
        note += "; all-reduce measured on " + ", ".join(
            f"{name} ({c.latency_per_step_s * 1e3:.3g} ms per ring step, bus "
            f"{c.bus_bandwidth_bytes_per_s / 1e9:.3g} GB/s)"
            for name, c in sorted(collectives.items())
        )
    updated = dataclasses.replace(
        cluster,
        device_links=merged,
        node_collectives={**cluster.node_collectives, **collectives},
    )
    return MeasuredLinks(updated, len(links), note)


def node_collectives(
    measured: Iterable[NodeAllReduce], nodes: set[str]
) -> dict[str, CollectiveSpec]:
    """Each measured all-reduce of two ranks or more on a cluster node, as a ring: the fit's
    latency over its ``2 (K - 1)`` steps, and its bus bandwidth."""
    out = {}
    for entry in measured:
        if entry.node in nodes and len(entry.ranks) > 1:
            steps = 2 * (len(entry.ranks) - 1)
            out[entry.node] = CollectiveSpec(
                latency_per_step_s=entry.fit.latency_s / steps,
                bus_bandwidth_bytes_per_s=entry.bus_bandwidth_bytes_per_s,
            )
    return out


def _ends(pair: PairLink) -> tuple[int, int]:
    return (pair.src_rank, pair.dst_rank)


def _listed(items: Iterable[str]) -> str:
    shown = list(items)
    more = len(shown) - _SHOWN_NAMES
    return ", ".join(shown[:_SHOWN_NAMES]) + (f" and {more} more" if more > 0 else "")


def _measured_device_links(
    pairs: Iterable[PairLink], devices: dict[int, str | None]
) -> dict[tuple[str, str], Link]:
    """Sorted device-name pair -> the slower direction's bandwidth and larger latency."""
    links: dict[tuple[str, str], Link] = {}
    for pair in pairs:
        a, b = devices[pair.src_rank], devices[pair.dst_rank]
        assert a is not None and b is not None and a != b
        key = (a, b) if a <= b else (b, a)
        fit = pair.fit
        if key in links:
            old = links[key]
            links[key] = Link(
                min(old.bandwidth_bytes_per_s, fit.bandwidth_bytes_per_s),
                max(old.latency_s, fit.latency_s),
            )
        else:
            links[key] = Link(fit.bandwidth_bytes_per_s, fit.latency_s)
    return links
