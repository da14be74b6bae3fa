"""cluster.yaml: which machines, which devices, how fast the links are.

``load_cluster(path)`` validates the file with pydantic (``cluster_schema.py``; format in
``examples/clusters/README.md``) and returns a frozen ``Cluster``; every mistake is a one-line
``ConfigError`` naming the file, the key path and what is allowed. Devices are ordered node
by node, entries in file order, and named ``<node>/<local_index>``.

Link defaults (alpha-beta): inside a GPU node PCIe 4.0 x16, 31.5 GB/s per direction (PCI-SIG
Base Specification 4.0) and 10 us (assumed, NCCL's small-message latency order); inside a
CPU node 5 GB/s and 20 us (assumed, gloo over TCP loopback); between nodes no default
bandwidth (give ``links``), and 50 us latency where a link gives none (assumed, a LAN's TCP).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import combinations
from pathlib import Path
from typing import Any, NoReturn

import yaml
from pydantic import ValidationError

from hplan.planner.hardware.catalog import (
    CATALOG,
    DeviceClass,
    DeviceType,
    compute_dtype,
    lookup_device_type,
    normalize_name,
    peak_flops_per_s,
)
from hplan.planner.hardware.cluster_schema import (
    ClusterFile,
    DeviceEntry,
    LinkEntry,
    LinksEntry,
    MatrixEntry,
    MatrixLevel,
    NodeEntry,
    NvlinkAll,
    UniqueKeyLoader,
    pydantic_message,
    yaml_problem,
)
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.plan import (
    ClusterSpec,
    CollectiveSpec,
    DeviceSpec,
    LinkSpec,
    NodeSpec,
    Precision,
)
from hplan.runtime.contract.quantities import (
    gb_per_s_to_bytes_per_s,
    gb_to_bytes,
    gbit_per_s_to_bytes_per_s,
    gib_to_bytes,
    tflops_to_flops,
    us_to_s,
)

_PCIE4_X16_GB_PER_S = 31.5
_INTRA_DEFAULTS_GB_PER_S_US = {
    DeviceClass.GPU: (_PCIE4_X16_GB_PER_S, 10.0),
    DeviceClass.CPU: (5.0, 20.0),
}
DEFAULT_LINK_LATENCY_US = 50.0


# ----------------------------------------------------------------------------- the loaded cluster
@dataclass(frozen=True, slots=True)
class Link:
    """Alpha-beta model of a link: ``time_s = latency_s + num_bytes / bandwidth_bytes_per_s``."""

    bandwidth_bytes_per_s: float
    latency_s: float


@dataclass(frozen=True, slots=True)
class Device:
    """One device of the cluster, with its figures after any overrides from the file."""

    name: str
    """``<node>/<local_index>``."""
    node: str
    local_index: int
    type: DeviceType

    @property
    def kind(self) -> str:
        """Catalog key (or the ``custom`` label of an explicit device)."""
        return self.type.key


@dataclass(frozen=True, slots=True)
class Node:
    """One machine."""

    name: str
    host: str
    devices: tuple[Device, ...]
    intra_link: Link
    """Link between two devices of this node."""
    interface: str | None = None
    """The network interface its ranks talk over (cluster.yaml ``interface``); None: the
    one that holds ``host`` (the runtime finds it)."""
    host_memory_bytes: float | None = None
    """Its host memory (cluster.yaml ``host_memory_gb``); None: not declared."""
    nvlink: Mapping[tuple[int, int], Link] = dataclasses.field(default_factory=dict)
    """The NVLink between two of its cards, keyed by the sorted pair of local indices
    (cluster.yaml ``nvlink``, or the catalog's default for SXM parts); empty: PCIe only."""


@dataclass(frozen=True)
class Cluster:
    """A validated cluster. Build it with ``load_cluster`` or ``parse_cluster``."""

    name: str
    source: str
    """The file it came from (for messages)."""
    nodes: tuple[Node, ...]
    node_links: Mapping[tuple[str, str], Link]
    """Link between every pair of distinct nodes, keyed by the sorted pair of node names."""
    device_links: Mapping[tuple[str, str], Link]
    """Per-device-pair links from a device matrix (sorted name pairs); empty otherwise."""
    node_collectives: Mapping[str, CollectiveSpec] = dataclasses.field(default_factory=dict)
    """Node name -> its measured all-reduce among its devices (from a bandwidth file)."""

    @cached_property
    def devices(self) -> tuple[Device, ...]:
        """Every device, node by node in file order (devices of a node are contiguous)."""
        return tuple(d for node in self.nodes for d in node.devices)

    @cached_property
    def device_names(self) -> tuple[str, ...]:
        """Device names (``<node>/<local_index>``) in device order."""
        return tuple(d.name for d in self.devices)

    @cached_property
    def _device_by_name(self) -> dict[str, Device]:
        return {d.name: d for d in self.devices}

    def node(self, name: str) -> Node:
        """The node called ``name`` (KeyError if absent)."""
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def device(self, name: str) -> Device:
        """The device called ``name`` (KeyError if absent)."""
        return self._device_by_name[name]

    def link(self, a: str, b: str) -> Link:
        """Link between two distinct devices (by name).

        Same node: their NVLink where the node has one, else the node's intra link (a
        device matrix overrides either); else the link between their nodes.

        Raises:
            ValueError: ``a == b``. KeyError: an unknown device name.
        """
        if a == b:
            raise ValueError(f"no link from device {a!r} to itself")
        pair = _pair(a, b)
        if pair in self.device_links:
            return self.device_links[pair]
        device_a, device_b = self.device(a), self.device(b)
        node_a, node_b = device_a.node, device_b.node
        if node_a == node_b:
            low, high = sorted((device_a.local_index, device_b.local_index))
            return self.node(node_a).nvlink.get((low, high), self.node(node_a).intra_link)
        return self.node_links[_pair(node_a, node_b)]

    def nvlink(self, a: str, b: str) -> bool:
        """Whether NVLink joins the two devices (named; on one node)."""
        device_a, device_b = self.device(a), self.device(b)
        if device_a.node != device_b.node:
            return False
        pair = tuple(sorted((device_a.local_index, device_b.local_index)))
        return pair in self.node(device_a.node).nvlink

    def bandwidth_bytes_per_s(self, a: str, b: str) -> float:
        """Bandwidth between two distinct devices, bytes/s."""
        return self.link(a, b).bandwidth_bytes_per_s

    def latency_s(self, a: str, b: str) -> float:
        """Latency between two distinct devices, seconds."""
        return self.link(a, b).latency_s

    def select(self, *, nodes: Sequence[str] | None = None, without: Sequence[str] = ()) -> Cluster:
        """The cluster restricted to ``nodes`` (None: all), less the nodes and devices
        named in ``without`` (``"box-b"`` or ``"box-b/1"``); devices keep their names and
        local indices, links between what is left stay as they were.

        Raises:
            ConfigError: a name that is not a node (or device) of this cluster, naming the
                known ones; nothing left.
        """
        known_nodes = [n.name for n in self.nodes]
        for name in nodes or ():
            if name not in known_nodes:
                raise ConfigError(
                    f"{name!r} is not a node of cluster {self.source!r} (its nodes: "
                    f"{', '.join(known_nodes)}); add it to the cluster file"
                )
        for name in without:
            if name not in known_nodes and name not in self.device_names:
                raise ConfigError(
                    f"--without {name!r}: not a node or device of {self.source!r} (nodes: "
                    f"{', '.join(known_nodes)}; devices are named <node>/<index>, e.g. "
                    f"{self.device_names[0]!r})"
                )
        kept_nodes = []
        for node in self.nodes:
            if (nodes is not None and node.name not in nodes) or node.name in without:
                continue
            devices = tuple(d for d in node.devices if d.name not in without)
            if devices:
                kept_nodes.append(dataclasses.replace(node, devices=devices))
        if not kept_nodes:
            raise ConfigError(
                f"no device of {self.source!r} is left after --without {' '.join(without)}"
            )
        names = {d.name for node in kept_nodes for d in node.devices}
        node_names = {node.name for node in kept_nodes}
        whole = {n.name for n in kept_nodes if len(n.devices) == len(self.node(n.name).devices)}
        return dataclasses.replace(
            self,
            nodes=tuple(kept_nodes),
            node_links={
                pair: link for pair, link in self.node_links.items() if set(pair) <= node_names
            },
            device_links={
                pair: link for pair, link in self.device_links.items() if set(pair) <= names
            },
            node_collectives={  # a node's measured all-reduce holds for all its devices only
                name: spec for name, spec in self.node_collectives.items() if name in whole
            },
        )

    def verify(self) -> None:
        """Check the cluster's invariants; raise ValueError naming the first broken one.

        At least one device; unique node and device names; every device on its node; a
        link of finite positive bandwidth and finite latency >= 0 between every pair of
        distinct devices; collectives only for nodes of the cluster.
        """
        names = [d.name for d in self.devices]
        if not names:
            raise ValueError(f"cluster {self.name!r} has no devices")
        if len(set(names)) != len(names) or len({n.name for n in self.nodes}) != len(self.nodes):
            raise ValueError(f"cluster {self.name!r} repeats a node or device name")
        for node in self.nodes:
            for device in node.devices:
                if device.node != node.name:
                    raise ValueError(f"device {device.name!r} is listed under node {node.name!r}")
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                link = self.link(a, b)
                speed, delay = link.bandwidth_bytes_per_s, link.latency_s
                if not (math.isfinite(speed) and speed > 0 and math.isfinite(delay) and delay >= 0):
                    raise ValueError(f"link {a}-{b} has bandwidth {speed} B/s, latency {delay} s")
        unknown = set(self.node_collectives) - {n.name for n in self.nodes}
        if unknown:
            raise ValueError(f"collectives of unknown nodes {sorted(unknown)}")


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


# ----------------------------------------------------------------------------- loading
def load_cluster(path: str | Path) -> Cluster:
    """Read and validate a cluster.yaml.

    Raises:
        ConfigError: the file is missing, not YAML, repeats a key, or fails validation
            (unknown key, non-positive quantity, unknown device type, bad host name,
            duplicate node name, a link naming an unknown node, a missing inter-node link,
            a matrix of the wrong size). One line: file, key path, what is allowed.
    """
    file = Path(path)
    if file.is_dir():
        raise ConfigError(
            f"cluster file {str(path)!r} is a directory; pass the path to a cluster.yaml "
            "(examples in examples/clusters/)"
        )
    if not file.is_file():
        raise ConfigError(
            f"cluster file {str(path)!r} does not exist; pass the path to a cluster.yaml "
            "(examples in examples/clusters/)"
        )
    try:
        data = yaml.load(file.read_text(encoding="utf-8"), Loader=UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{file}: not valid YAML ({yaml_problem(exc)}); fix the syntax") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{file}: not UTF-8 text; save it as UTF-8 YAML") from None
    if data is None:
        raise ConfigError(f"{file}: file is empty; describe `nodes:` (see examples/clusters/)")
    if isinstance(data, dict) and "ranks" in data and "schema_version" in data:
        raise ConfigError(
            f"{file} is a plan (plan.json), not a cluster file; pass the cluster.yaml it was "
            "solved for (examples in examples/clusters/)"
        )
    default_name = re.sub(r"[^A-Za-z0-9_.-]", "-", file.stem).lstrip("-_.") or "cluster"
    return parse_cluster(data, source=str(file), default_name=default_name[:63])


def parse_cluster(
    data: Any, *, source: str = "<cluster>", default_name: str = "cluster"
) -> Cluster:
    """Validate an already-parsed cluster description (the YAML's top-level mapping).

    Raises:
        ConfigError: as for ``load_cluster``; messages start with ``source``.
    """
    try:
        entry = ClusterFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {pydantic_message(exc)}") from None
    _check_unique_nodes(source, entry.nodes)
    nodes = tuple(_node(source, idx, node) for idx, node in enumerate(entry.nodes))
    node_links, device_links = _inter_node_links(source, entry.links, nodes)
    return Cluster(
        name=entry.name or default_name,
        source=source,
        nodes=nodes,
        node_links=node_links,
        device_links=device_links,
    )


def _fail(source: str, key_path: str, message: str) -> NoReturn:
    raise ConfigError(f"{source}: {key_path}: {message}")


def _check_unique_nodes(source: str, nodes: Sequence[NodeEntry]) -> None:
    first_idx: dict[str, int] = {}
    for idx, node in enumerate(nodes):
        if node.name in first_idx:
            _fail(
                source,
                f"nodes[{idx}].name",
                f"duplicate node name {node.name!r} (also nodes[{first_idx[node.name]}]); "
                "give every node a unique name",
            )
        first_idx[node.name] = idx


def _node(source: str, node_idx: int, entry: NodeEntry) -> Node:
    devices: list[Device] = []
    for entry_idx, device_entry in enumerate(entry.devices):
        key_path = f"nodes[{node_idx}].devices[{entry_idx}]"
        device_type = _device_type(source, key_path, device_entry)
        for _ in range(device_entry.count):
            index = len(devices)
            devices.append(Device(f"{entry.name}/{index}", entry.name, index, device_type))
    classes = {d.type.device_class for d in devices}
    default_bw = min(_INTRA_DEFAULTS_GB_PER_S_US[c][0] for c in classes)
    default_lat = max(_INTRA_DEFAULTS_GB_PER_S_US[c][1] for c in classes)
    link = entry.intra_node_link
    intra = (
        _link(link, default_lat)
        if link is not None
        else Link(gb_per_s_to_bytes_per_s(default_bw), us_to_s(default_lat))
    )
    host_memory = None if entry.host_memory_gb is None else gb_to_bytes(entry.host_memory_gb)
    nvlink = _nvlink(source, f"nodes[{node_idx}]", entry, devices, intra.latency_s)
    return Node(entry.name, entry.host, tuple(devices), intra, entry.interface, host_memory, nvlink)


def _nvlink(
    source: str, key_path: str, entry: NodeEntry, devices: Sequence[Device], latency_s: float
) -> dict[tuple[int, int], Link]:
    """The node's NVLink pairs (sorted local indices) and their link: cluster.yaml's
    ``nvlink`` groups, ``all`` or ``none``, by default ``all`` where every card is an SXM
    part (``DeviceType.nvlink_by_default``); bandwidth ``nvlink_gb_per_s`` or the slowest
    card's catalog figure, latency the node's intra link's."""
    declared = entry.nvlink
    if declared is None:
        declared = (
            NvlinkAll.ALL if all(d.type.nvlink_by_default for d in devices) else NvlinkAll.NONE
        )
    if declared is NvlinkAll.NONE and entry.nvlink_gb_per_s is not None:
        _fail(
            source,
            f"{key_path}.nvlink_gb_per_s",
            f"node {entry.name!r} has no NVLink-joined cards (nvlink "
            f"{'none' if entry.nvlink is not None else 'not given, and not all SXM parts'}), "
            "so the bandwidth would be ignored; add nvlink: all or groups such as "
            "[[0, 1]], or drop nvlink_gb_per_s",
        )
    if declared is NvlinkAll.NONE or len(devices) < 2:
        return {}
    groups = [list(range(len(devices)))] if declared is NvlinkAll.ALL else declared
    pairs: set[tuple[int, int]] = set()
    for group_idx, group in enumerate(groups):
        where = f"{key_path}.nvlink" + ("" if declared is NvlinkAll.ALL else f"[{group_idx}]")
        for index in group:
            if index >= len(devices):
                _fail(
                    source,
                    where,
                    f"device index {index} is not on node {entry.name!r} (it has "
                    f"{len(devices)} devices: 0..{len(devices) - 1}); name its local indices",
                )
        if len(set(group)) != len(group):
            _fail(source, where, f"device indices {group} repeat; list each card once")
        pairs.update(combinations(sorted(group), 2))
    if entry.nvlink_gb_per_s is not None:
        bandwidth = gb_per_s_to_bytes_per_s(entry.nvlink_gb_per_s)
    else:
        joined = sorted({i for pair in pairs for i in pair})
        missing = [devices[i] for i in joined if devices[i].type.nvlink_bytes_per_s is None]
        if missing:
            _fail(
                source,
                f"{key_path}.nvlink",
                f"{missing[0].name} ({missing[0].kind}) has no NVLink in the catalog; give "
                "nvlink_gb_per_s for the node or leave nvlink out",
            )
        bandwidth = min(float(devices[i].type.nvlink_bytes_per_s or 0.0) for i in joined)
    link = Link(bandwidth, latency_s)
    return {pair: link for pair in sorted(pairs)}


def _device_type(source: str, key_path: str, entry: DeviceEntry) -> DeviceType:
    memory = _memory_bytes(entry)
    if entry.custom is not None:
        if normalize_name(entry.custom) in {normalize_name(k) for k in CATALOG}:
            _fail(
                source,
                f"{key_path}.custom",
                f"{entry.custom!r} is a catalog device; write `type: {entry.custom}` "
                "(with overrides) or choose another custom name",
            )
        assert memory is not None
        return _custom_type(entry, memory)
    assert entry.type is not None
    try:
        base = lookup_device_type(entry.type)
    except ConfigError as exc:
        _fail(source, f"{key_path}.type", str(exc))
    return _with_overrides(base, entry, memory)


def _memory_bytes(entry: DeviceEntry) -> int | None:
    if entry.memory_gb is not None:
        return int(gb_to_bytes(entry.memory_gb))
    if entry.memory_gib is not None:
        return int(gib_to_bytes(entry.memory_gib))
    return None


def _custom_type(entry: DeviceEntry, memory_bytes: int) -> DeviceType:
    assert entry.custom is not None
    assert entry.peak_tflops is not None and entry.memory_bandwidth_gb_per_s is not None
    peak = tflops_to_flops(entry.peak_tflops)
    return DeviceType(
        key=entry.custom,
        display_name=entry.custom,
        device_class=entry.device_class or DeviceClass.GPU,
        memory_bytes=memory_bytes,
        fp32_flops_per_s=peak,
        tf32_flops_per_s=peak,
        fp16_flops_per_s=peak,
        bf16_flops_per_s=peak,
        memory_bandwidth_bytes_per_s=gb_per_s_to_bytes_per_s(entry.memory_bandwidth_gb_per_s),
        consumer_card=bool(entry.consumer_card),
        source="cluster.yaml (explicit device; peak_tflops used for every dtype)",
    )


def _with_overrides(base: DeviceType, entry: DeviceEntry, memory_bytes: int | None) -> DeviceType:
    changes: dict[str, Any] = {}
    notes = []
    if memory_bytes is not None:
        changes["memory_bytes"] = memory_bytes
        notes.append("memory")
    if entry.peak_tflops is not None:
        peak = tflops_to_flops(entry.peak_tflops)
        for dtype_field in ("fp32", "tf32", "fp16", "bf16"):
            changes[f"{dtype_field}_flops_per_s"] = peak
        notes.append("peak_tflops (every dtype)")
    if entry.memory_bandwidth_gb_per_s is not None:
        bandwidth = gb_per_s_to_bytes_per_s(entry.memory_bandwidth_gb_per_s)
        changes["memory_bandwidth_bytes_per_s"] = bandwidth
        notes.append("memory bandwidth")
    if not changes:
        return base
    changes["source"] = f"{base.source}; overridden in cluster.yaml: {', '.join(notes)}"
    return dataclasses.replace(base, **changes)


def _link(entry: LinkEntry, default_latency_us: float = DEFAULT_LINK_LATENCY_US) -> Link:
    if entry.bandwidth_gb_per_s is not None:
        bandwidth = gb_per_s_to_bytes_per_s(entry.bandwidth_gb_per_s)
    else:
        assert entry.bandwidth_gbit_per_s is not None
        bandwidth = gbit_per_s_to_bytes_per_s(entry.bandwidth_gbit_per_s)
    latency_us = default_latency_us if entry.latency_us is None else entry.latency_us
    return Link(bandwidth, us_to_s(latency_us))


def _inter_node_links(
    source: str, links: LinksEntry, nodes: tuple[Node, ...]
) -> tuple[dict[tuple[str, str], Link], dict[tuple[str, str], Link]]:
    if links.matrix is not None:
        return _matrix_links(source, links.matrix, nodes)
    names = [n.name for n in nodes]
    result: dict[tuple[str, str], Link] = {}
    for idx, pair in enumerate(links.pairs):
        key_path = f"links.pairs[{idx}].nodes"
        for side, name in enumerate(pair.nodes):
            if name not in names:
                _fail(
                    source,
                    f"{key_path}[{side}]",
                    f"unknown node {name!r}; nodes: {', '.join(names)}",
                )
        key = _pair(*pair.nodes)
        if key[0] == key[1]:
            _fail(source, key_path, f"a pair needs two different nodes, got {key[0]!r} twice")
        if key in result:
            _fail(source, key_path, f"the pair {key[0]!r}, {key[1]!r} is listed twice; keep one")
        result[key] = _link(pair)
    for a, b in combinations(names, 2):
        if _pair(a, b) in result:
            continue
        if links.inter_node is None:
            _fail(
                source,
                "links",
                f"no link between nodes {a!r} and {b!r}; add links.inter_node (the default "
                "between nodes, e.g. bandwidth_gbit_per_s: 10) or a links.pairs entry",
            )
        result[_pair(a, b)] = _link(links.inter_node)
    return result, {}


def _matrix_links(
    source: str, matrix: MatrixEntry, nodes: tuple[Node, ...]
) -> tuple[dict[tuple[str, str], Link], dict[tuple[str, str], Link]]:
    """Links from a bandwidth matrix (rows and columns in file order); the slower of the two
    directions is used, since ``Link`` is symmetric. The diagonal is ignored."""
    devices = [d for n in nodes for d in n.devices]
    names = [n.name for n in (nodes if matrix.of is MatrixLevel.NODES else devices)]
    key = "bandwidth_gb_per_s" if matrix.bandwidth_gb_per_s is not None else "bandwidth_gbit_per_s"
    rows = matrix.bandwidth_gb_per_s or matrix.bandwidth_gbit_per_s or []
    to_bytes = gb_per_s_to_bytes_per_s if key == "bandwidth_gb_per_s" else gbit_per_s_to_bytes_per_s
    key_path = f"links.matrix.{key}"
    n = len(names)
    if len(rows) != n or any(len(row) != n for row in rows):
        shape = f"{len(rows)} rows of lengths {sorted({len(r) for r in rows})}"
        _fail(
            source,
            key_path,
            f"want {n}x{n} (a row and a column per {matrix.of.value[:-1]}, in file order), "
            f"got {shape}",
        )
    latency_us = DEFAULT_LINK_LATENCY_US if matrix.latency_us is None else matrix.latency_us
    links: dict[tuple[str, str], Link] = {}
    for i, j in combinations(range(n), 2):
        value = min(rows[i][j], rows[j][i])
        if value <= 0:
            _fail(source, f"{key_path}[{i}][{j}]", "off-diagonal bandwidths must be > 0")
        links[_pair(names[i], names[j])] = Link(to_bytes(value), us_to_s(latency_us))
    if matrix.of is MatrixLevel.NODES:
        return links, {}
    return _slowest_node_links(nodes, links), links


def _slowest_node_links(
    nodes: tuple[Node, ...], device_links: Mapping[tuple[str, str], Link]
) -> dict[tuple[str, str], Link]:
    """Node-to-node link implied by a device matrix: the slowest device pair between them."""
    result: dict[tuple[str, str], Link] = {}
    for node_a, node_b in combinations(nodes, 2):
        pairs = [
            device_links[_pair(a.name, b.name)] for a in node_a.devices for b in node_b.devices
        ]
        result[_pair(node_a.name, node_b.name)] = Link(
            min(p.bandwidth_bytes_per_s for p in pairs), max(p.latency_s for p in pairs)
        )
    return result


# ----------------------------------------------------------------------------- plan export
def _peak_flops_per_s(device: Device, param_dtype: str, precision: Precision | None) -> float:
    chosen = precision or Precision.FP32
    return peak_flops_per_s(
        device.type,
        compute_dtype(chosen, param_dtype),
        allow_tf32=chosen is Precision.TF32,
    )


def to_cluster_spec(
    cluster: Cluster,
    param_dtype: str,
    *,
    precisions: Mapping[str, Precision] | None = None,
) -> ClusterSpec:
    """The plan's record of the cluster.

    ``peak_flops`` of each device is its catalog peak for the dtype its matmuls run in
    (``catalog.compute_dtype`` of its precision in ``precisions``, default fp32, and
    ``param_dtype``; TF32 for tf32); ``links`` has one entry per unordered pair of
    distinct devices, in device order.

    Raises:
        ConfigError: ``param_dtype`` has no catalog peak.
    """
    devices = cluster.devices
    device_specs = tuple(
        DeviceSpec(
            name=d.name,
            node=d.node,
            local_index=d.local_index,
            kind=d.kind,
            memory_bytes=d.type.memory_bytes,
            peak_flops=_peak_flops_per_s(d, param_dtype, (precisions or {}).get(d.name)),
            memory_bandwidth_bytes_per_s=d.type.memory_bandwidth_bytes_per_s,
            consumer_card=d.type.consumer_card,
        )
        for d in devices
    )
    node_specs = tuple(
        NodeSpec(
            name=n.name,
            host=n.host,
            devices=tuple(d.name for d in n.devices),
            collective=cluster.node_collectives.get(n.name),
            interface=n.interface,
            host_memory_bytes=None if n.host_memory_bytes is None else round(n.host_memory_bytes),
        )
        for n in cluster.nodes
    )
    link_specs = tuple(
        LinkSpec(
            a=a.name,
            b=b.name,
            bandwidth_bytes_per_s=cluster.bandwidth_bytes_per_s(a.name, b.name),
            latency_s=cluster.latency_s(a.name, b.name),
        )
        for a, b in combinations(devices, 2)
    )
    return ClusterSpec(name=cluster.name, nodes=node_specs, devices=device_specs, links=link_specs)
