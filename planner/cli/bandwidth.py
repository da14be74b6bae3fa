"""``hplan bandwidth``: measure the link matrix here, or write the scripts that measure it on
every node of a cluster. A thin click layer over ``hplan.runtime.bandwidth.local`` and
``hplan.planner.emit.bandwidth_scripts``; torch is imported only when measuring.
"""

from __future__ import annotations

from pathlib import Path

import click

from hplan.planner.cli.console import stderr
from hplan.runtime.contract.errors import ConfigError


def _sweep_argv(
    min_size_bytes: int, max_size_bytes: int, repeats: int, warmup: int, size_budget_s: float
) -> list[str]:
    """The sweep options for the measuring processes, checked once here.

    Raises:
        ConfigError: a value out of range (see ``hplan.runtime.bandwidth.job.sweep_from``).
    """
    from hplan.runtime.bandwidth.job import parser, sweep_argv

    argv = [
        "--min-size-bytes", str(min_size_bytes), "--max-size-bytes", str(max_size_bytes),
        "--repeats", str(repeats), "--warmup", str(warmup), "--size-budget-s", repr(size_budget_s),
    ]  # fmt: skip
    return sweep_argv(parser().parse_args(argv))


def _local_names(cluster_path: Path | None, num_local: int) -> list[tuple[str, int]] | None:
    """(node, local index) of every local rank, from the cluster's devices; None: no cluster.

    Raises:
        ConfigError: ``--local`` differs from the cluster's device count.
    """
    if cluster_path is None:
        return None
    from hplan.planner.hardware.cluster import load_cluster

    cluster = load_cluster(cluster_path)
    names = [(d.node, d.local_index) for d in cluster.devices]
    if num_local != len(names):
        raise ConfigError(
            f"--local {num_local} but {str(cluster_path)!r} has {len(names)} devices; pass "
            f"--local {len(names)} (one local rank per device)"
        )
    return names


MAX_LOCAL_RANKS = 32
"""``--local`` above this is refused: N (N - 1) pairs are timed one after another."""


@click.command()
@click.option(
    "--local",
    "num_local",
    type=int,
    help="Measure N ranks on this machine (gloo on 127.0.0.1); with --cluster, one per device.",
)
@click.option(
    "--cluster",
    "-c",
    "cluster_path",
    type=click.Path(path_type=Path),
    help="cluster.yaml: names local ranks after its devices, or the nodes to write scripts for.",
)
@click.option(
    "--write-scripts",
    "scripts_dir",
    type=click.Path(path_type=Path),
    help="Write bandwidth-<node>.sh for every node of --cluster into this folder (no measuring).",
)
@click.option(
    "--out",
    "-o",
    type=click.Path(path_type=Path),
    default=Path("bandwidth.json"),
    show_default=True,
    help="Where the local measurement writes the link matrix.",
)
@click.option(
    "--master-port",
    type=int,
    default=29400,
    show_default=True,
    help="Scripts: torchrun rendezvous port on the cluster's first node.",
)
@click.option("--min-size-bytes", type=int, default=4096, show_default=True)
@click.option("--max-size-bytes", type=int, default=64 * 2**20, show_default=True)
@click.option("--repeats", type=int, default=5, show_default=True, help="Timed repeats per size.")
@click.option("--warmup", type=int, default=2, show_default=True, help="Untimed repeats per size.")
@click.option(
    "--size-budget-s",
    type=float,
    default=2.0,
    show_default=True,
    help="Stop a pair's sweep after a size whose timed repeats took longer than this.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=900.0,
    show_default=True,
    help="Stop a local measurement after this many seconds.",
)
def bandwidth(
    num_local: int | None,
    cluster_path: Path | None,
    scripts_dir: Path | None,
    out: Path,
    master_port: int,
    min_size_bytes: int,
    max_size_bytes: int,
    repeats: int,
    warmup: int,
    size_budget_s: float,
    timeout_s: float,
) -> None:
    """Measure latency and bandwidth between every pair of ranks (the link matrix).

    \b
    Here, as a rehearsal:   hplan bandwidth --local 4 -o bw.json
                            hplan bandwidth --cluster cluster.yaml --local 4 -o bw.json
    On a cluster:           hplan bandwidth --cluster cluster.yaml --write-scripts bw/
                            then run bw/bandwidth-<node>.sh on every node at the same time
    Then:                   hplan solve model.py --cluster cluster.yaml --bandwidth bw.json
    """
    if scripts_dir is not None:
        if cluster_path is None:
            raise ConfigError("--write-scripts needs --cluster cluster.yaml (the nodes to measure)")
        from hplan.planner.emit.bandwidth_scripts import write_bandwidth_scripts
        from hplan.planner.hardware.cluster import load_cluster

        written = write_bandwidth_scripts(
            load_cluster(cluster_path), scripts_dir, master_port=master_port
        )
        stderr.print(
            f"wrote {len(written)} scripts to {scripts_dir}/; run every one at the same time, "
            "one on each node"
        )
        return
    if num_local is None:
        raise ConfigError(
            "pass --local N to measure N ranks here (with --cluster, one per device), or "
            "--cluster cluster.yaml --write-scripts DIR to measure on the cluster's nodes"
        )
    if not 1 <= timeout_s < float("inf"):
        raise ConfigError(f"--timeout {timeout_s} must be a finite number >= 1")
    if num_local > MAX_LOCAL_RANKS:
        raise ConfigError(
            f"--local {num_local}: at most {MAX_LOCAL_RANKS} ranks on one machine (every one of "
            f"the {num_local * (num_local - 1)} ordered pairs is timed alone); measure a "
            "large cluster on its nodes with --cluster cluster.yaml --write-scripts DIR"
        )
    names = _local_names(cluster_path, num_local)
    argv = _sweep_argv(min_size_bytes, max_size_bytes, repeats, warmup, size_budget_s)
    from hplan.runtime.bandwidth.local import measure_local
    from hplan.runtime.contract.link_matrix import BandwidthFile

    BandwidthFile.check_writable(Path(out))

    measure_local(num_local, out=out, sweep_args=argv, names=names, timeout_s=timeout_s)
