"""Per-node launch scripts of the link measurement: ``hplan bandwidth --write-scripts DIR``.

One script per node of a cluster, ``bandwidth-<node>.sh``, rendered from
``templates/bandwidth.sh.j2`` with the same jinja2 environment as the training launch
scripts (``q``: shell-quoted values; ``c``: comment-safe values; undefined names fail). Each
runs ``torchrun ... -m hplan.runtime.bandwidth`` with one process per device of its node,
``HPLAN_NODE`` set so that the ranks carry the cluster's device names, the first node's host
as the rendezvous address, and gloo for an all-cpu cluster, NCCL otherwise. The measurement
needs no plan: it comes before ``hplan solve --bandwidth``.
"""

from __future__ import annotations

from pathlib import Path

from hplan.planner.emit.artifacts import template_environment
from hplan.planner.hardware.catalog import DeviceClass
from hplan.planner.hardware.cluster import Cluster, Node
from hplan.runtime.contract.errors import ConfigError

_EXECUTE_BITS = 0o111


def bandwidth_script_name(node: str) -> str:
    """``bandwidth-<node>.sh`` (node names are letters, digits, ``.``, ``_``, ``-``)."""
    return f"bandwidth-{node}.sh"


def _backend(cluster: Cluster) -> str:
    """``gloo`` for an all-cpu cluster, ``nccl`` for an all-GPU one.

    Raises:
        ConfigError: the cluster mixes cpu and GPU devices.
    """
    classes = {d.type.device_class for d in cluster.devices}
    if classes == {DeviceClass.CPU}:
        return "gloo"
    if DeviceClass.CPU in classes:
        raise ConfigError(
            f"cluster {cluster.source!r} mixes cpu and GPU devices; one measurement runs on one "
            "backend: measure the GPU nodes and the cpu nodes with two cluster files"
        )
    return "nccl"


def _render(cluster: Cluster, node_rank: int, node: Node, backend: str, master_port: int) -> str:
    consumer = sorted({d.kind for d in node.devices if d.type.consumer_card})
    return (
        template_environment()
        .get_template("bandwidth.sh.j2")
        .render(
            node=node.name,
            host=node.host,
            node_rank=node_rank,
            num_nodes=len(cluster.nodes),
            num_ranks=len(node.devices),
            first_node=cluster.nodes[0].name,
            master_host=cluster.nodes[0].host,
            master_port=master_port,
            backend=backend,
            consumer_kinds=consumer if backend == "nccl" else [],
            cluster_source=cluster.source,
        )
    )


def render_bandwidth_scripts(cluster: Cluster, *, master_port: int) -> dict[str, str]:
    """Script file name -> text, one per node in cluster order.

    Raises:
        ConfigError: a mixed cpu/GPU cluster, or a port outside 1..65535.
    """
    if not 1 <= master_port <= 65535:
        raise ConfigError(f"--master-port {master_port} must be in 1..65535")
    backend = _backend(cluster)
    return {
        bandwidth_script_name(node.name): _render(cluster, idx, node, backend, master_port)
        for idx, node in enumerate(cluster.nodes)
    }


def write_bandwidth_scripts(cluster: Cluster, out_dir: Path, *, master_port: int) -> list[Path]:
    """Write the scripts (executable) into ``out_dir``; return their paths.

    Raises:
        ConfigError: see :func:`render_bandwidth_scripts`; ``out_dir`` cannot be written.
    """
    scripts = render_bandwidth_scripts(cluster, master_port=master_port)
    written = []
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, text in scripts.items():
            path = out_dir / name
            path.write_text(text, encoding="utf-8")
            path.chmod(path.stat().st_mode | _EXECUTE_BITS)
            written.append(path)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the scripts to {str(out_dir)!r} ({exc.strerror}); pass "
            "--write-scripts a folder you can write to"
        ) from None
    return written
