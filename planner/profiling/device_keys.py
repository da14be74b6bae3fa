"""Profile device keys: what a measurement applies to, and the cluster devices it names.

A measurement (a ``DeviceProfile``, a ``UnitTiming``) carries a key, most general first:

- ``<kind>`` (``cpu``, ``rtx3090``): every device of that catalog kind;
- ``<kind>#<uuid>`` (``rtx3090#GPU-5d1c...``): one physical card, by NVML UUID;
- ``<kind>@<node>`` (``cpu@left``): every device of that kind on one cluster node
  (``hplan profile --node left`` on a CPU machine: each of its CPU devices is a core like
  the one measured);
- ``<kind>@<node>/<index>`` (``rtx3090@box-b/1``): one device of one cluster, by its name
  (``hplan profile --node box-b`` on a GPU machine; ``hplan calibrate``).

The cost model takes the most specific key that has measurements (:func:`lookup_keys`).
Node names have no ``@`` or ``/`` (``cluster_schema``), so the forms cannot be confused.
"""

from __future__ import annotations

from collections.abc import Iterable

from hplan.planner.hardware.catalog import CATALOG, DeviceClass
from hplan.planner.hardware.cluster import Cluster, Device
from hplan.planner.hardware.cluster_schema import check_name
from hplan.runtime.contract.errors import ConfigError


def key_kind(key: str) -> str:
    """The kind a key measures (``cpu@left`` -> ``cpu``)."""
    return key.split("@")[0].split("#")[0]


def key_target(key: str) -> str | None:
    """The node or device name a key is bound to (``cpu@left`` -> ``left``); None for
    ``<kind>`` and ``<kind>#<uuid>``."""
    return key.split("@", 1)[1] if "@" in key else None


def lookup_keys(device: Device, uuid: str | None = None) -> list[str]:
    """Keys whose measurements stand for ``device``, most specific first: the device, its
    node, its card's UUID (when known), its kind."""
    kind = device.kind
    keys = [f"{kind}@{device.name}", f"{kind}@{device.node}"]
    if uuid is not None:
        keys.append(f"{kind}#{uuid}")
    return [*keys, kind]


def check_node_name(node: str) -> None:
    """``--node`` must be a valid cluster node name (a ConfigError otherwise)."""
    try:
        check_name(node)
    except ValueError as exc:
        raise ConfigError(f"--node {node!r}: {exc}") from None


def node_cpu_key(node: str, cluster: Cluster | None) -> str:
    """The key of this machine's CPU when it is cluster node ``node``: ``<kind>@<node>``,
    the kind of the node's CPU devices in ``cluster`` (``cpu`` without one).

    Raises:
        ConfigError: ``node`` is not a node of ``cluster``, or has no CPU device there.
    """
    if cluster is None:
        return f"cpu@{node}"
    members = _node_devices(node, cluster)
    kinds = sorted({d.kind for d in members if d.type.device_class is DeviceClass.CPU})
    if not kinds:
        have = ", ".join(d.kind for d in members)
        raise ConfigError(
            f"node {node!r} of {cluster.source!r} has no CPU device (its devices: {have}); "
            "profile its GPUs (leave out --device cpu) or pick the right --node"
        )
    return f"{kinds[0]}@{node}"


def node_gpu_key(node: str, local_index: int, kind: str, cluster: Cluster | None) -> str:
    """The key of this machine's GPU ``local_index`` (in PCI bus order, as the runtime
    numbers them) when it is cluster node ``node``: ``<kind>@<node>/<local_index>``, with
    the kind ``cluster`` declares for that device.

    Raises:
        ConfigError: ``node`` is not in ``cluster``, has fewer devices, or declares another
            catalog kind for that device.
    """
    if cluster is None:
        return f"{kind}@{node}/{local_index}"
    members = _node_devices(node, cluster)
    if local_index >= len(members):
        raise ConfigError(
            f"this machine's GPU {local_index} has no device in node {node!r} of "
            f"{cluster.source!r} ({len(members)} devices); declare it or pick the right --node"
        )
    declared = members[local_index]
    if declared.kind != kind and declared.kind in CATALOG and kind in CATALOG:
        raise ConfigError(
            f"{cluster.source!r} declares {declared.name} a {declared.kind}, but this "
            f"machine's GPU {local_index} is a {kind}; fix the cluster file or pick the right "
            "--node"
        )
    return f"{declared.kind}@{declared.name}"


def unknown_targets(keys: Iterable[str], cluster: Cluster) -> list[str]:
    """Keys bound to a node or device name ``cluster`` lacks, sorted."""
    names = {n.name for n in cluster.nodes} | set(cluster.device_names)
    return sorted({k for k in keys if (t := key_target(k)) is not None and t not in names})


def _node_devices(node: str, cluster: Cluster) -> tuple[Device, ...]:
    try:
        return cluster.node(node).devices
    except KeyError:
        nodes = ", ".join(n.name for n in cluster.nodes)
        raise ConfigError(
            f"--node {node!r} is not a node of {cluster.source!r} (its nodes: {nodes})"
        ) from None
