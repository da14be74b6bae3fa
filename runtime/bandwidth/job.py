"""``python -m hplan.runtime.bandwidth``: measure the link matrix of a job's ranks.

Run it under torchrun on every node (one process per GPU; for a CPU cluster one process
per CPU "device")::

    HPLAN_NODE=box-a torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 \\
        --master-addr box-a --master-port 29400 -m hplan.runtime.bandwidth -o bw.json

or let ``hplan bandwidth --cluster cluster.yaml --write-scripts DIR`` write those commands;
without torchrun give ``--rank --world-size --master-addr --master-port``, or ``--local N``
for N processes on this machine. Rank 0 writes one ``contract.link_matrix.BandwidthFile``.
A rank is named ``<node>/<local_rank>`` when its node is known (``--node``, else
``HPLAN_NODE``, else with ``--cluster`` the node at torchrun's ``GROUP_RANK``), else by host
and local rank.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # after TORCH_CPP_LOG_LEVEL: torch reads it when it loads
import torch.distributed as dist
import yaml

from hplan.runtime.bandwidth.timing import (
    Sweep,
    fit_text,
    measure_all_reduce,
    measure_pairs,
    message_sizes,
    rate_text,
    slowest_per_repeat,
    stderr_say,
)
from hplan.runtime.contract.errors import ConfigError, HplanError, PeerFailureError, error_reason
from hplan.runtime.contract.link_matrix import (
    MIN_R_SQUARED,
    BandwidthFile,
    FitMethod,
    NodeAllReduce,
    PairLink,
    RankName,
    fit_alpha_beta,
)
from hplan.runtime.contract.quantities import BYTES_PER_KIB, BYTES_PER_MIB
from hplan.runtime.executor.cli import NODE_ENV, OneLineErrors
from hplan.runtime.executor.machine import bind_interface_towards
from hplan.runtime.executor.rendezvous import join_process_group

_PROG = "hplan bandwidth"
say = stderr_say(_PROG)


@dataclass(frozen=True)
class Job:
    """Where this process stands in the measuring job."""

    rank: int
    world_size: int
    name: RankName
    backend: str
    timeout_s: float


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() else None


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m hplan.runtime.bandwidth``."""
    p = OneLineErrors(prog="python -m hplan.runtime.bandwidth", description=__doc__.split("\n")[0])
    p.add_argument("-o", "--out", type=Path, default=Path("bandwidth.json"), help="JSON file")
    p.add_argument("--local", type=int, metavar="N", help="start N ranks here (gloo, 127.0.0.1)")
    p.add_argument("--node", default=os.environ.get(NODE_ENV) or None, help=f"default ${NODE_ENV}")
    p.add_argument("--cluster", type=Path, help="cluster.yaml: node = nodes[GROUP_RANK]")
    p.add_argument("--rank", type=int, default=_env_int("RANK"), help="default $RANK")
    p.add_argument("--world-size", type=int, default=_env_int("WORLD_SIZE"))
    p.add_argument("--local-rank", type=int, default=_env_int("LOCAL_RANK"))
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR"))
    p.add_argument("--master-port", type=int, default=_env_int("MASTER_PORT"))
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    p.add_argument("--min-size-bytes", type=int, default=4 * BYTES_PER_KIB)
    p.add_argument("--max-size-bytes", type=int, default=64 * BYTES_PER_MIB)
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per size")
    p.add_argument("--warmup", type=int, default=2, help="untimed repeats per size")
    p.add_argument(
        "--size-budget-s",
        type=float,
        default=2.0,
        help="stop a pair's sweep after a size whose repeats took longer than this",
    )
    p.add_argument("--timeout-s", type=float, default=600.0, help="process-group timeout")
    return p


def sweep_from(args: argparse.Namespace) -> Sweep:
    """The sweep the options ask for.

    Raises:
        ConfigError: sizes, repeats or budget out of range.
    """
    if not 1 <= args.min_size_bytes < args.max_size_bytes:
        raise ConfigError(
            f"--min-size-bytes {args.min_size_bytes} and --max-size-bytes "
            f"{args.max_size_bytes}: need 1 <= min < max"
        )
    if args.repeats < 1 or args.warmup < 0:
        raise ConfigError(f"--repeats {args.repeats} must be >= 1 and --warmup {args.warmup} >= 0")
    for flag, value in (("--size-budget-s", args.size_budget_s), ("--timeout-s", args.timeout_s)):
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{flag} {value} must be a finite number > 0")
    return Sweep(
        sizes_bytes=message_sizes(args.min_size_bytes, args.max_size_bytes),
        repeats=args.repeats,
        warmup=args.warmup,
        size_budget_s=args.size_budget_s,
    )


# ----------------------------------------------------------------------------- naming
def cluster_nodes(path: Path) -> list[tuple[str, int]]:
    """(name, number of devices) of every node of a cluster.yaml, in file order.

    Only ``nodes[].name`` and ``nodes[].devices[].count`` are read; ``hplan solve`` checks
    the rest of the file.

    Raises:
        ConfigError: unreadable file, or no ``nodes`` list of named nodes.
    """
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        nodes = [
            (str(n["name"]), sum(int(d.get("count", 1)) for d in n["devices"]))
            for n in data["nodes"]
        ]
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read cluster file {str(path)!r}: {error_reason(exc)}") from None
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ConfigError(
            f"cluster file {str(path)!r} has no `nodes:` list of nodes with `name` and "
            "`devices`; check it with `hplan solve`"
        ) from None
    return nodes


def rank_node(args: argparse.Namespace, local_rank: int) -> str | None:
    """This rank's node name: ``--node``/``HPLAN_NODE``, else ``--cluster`` at GROUP_RANK.

    Raises:
        ConfigError: the node is not in the cluster file, or the node has fewer devices
            than ``local_rank + 1``.
    """
    if args.cluster is None:
        return args.node
    nodes = cluster_nodes(args.cluster)
    node = args.node
    if node is None:
        group_rank = _env_int("GROUP_RANK")
        if group_rank is None or group_rank >= len(nodes):
            raise ConfigError(
                f"cannot tell this rank's node: set {NODE_ENV}=NAME or pass --node NAME "
                f"(torchrun's GROUP_RANK {group_rank} is not a node index of {args.cluster})"
            )
        node = nodes[group_rank][0]
    counts = dict(nodes)
    if node not in counts:
        raise ConfigError(f"node {node!r} is not in {str(args.cluster)!r}; nodes: {sorted(counts)}")
    if local_rank >= counts[node]:
        raise ConfigError(
            f"local rank {local_rank} but node {node!r} has {counts[node]} devices in "
            f"{str(args.cluster)!r}; start torchrun with --nproc-per-node {counts[node]}"
        )
    return node


def job_from(args: argparse.Namespace) -> Job:
    """This process's rank, world size, name and backend from options and torchrun's env.

    Raises:
        ConfigError: rank or world size unknown or inconsistent; see :func:`rank_node`.
    """
    if args.rank is None or args.world_size is None:
        raise ConfigError(
            "run under torchrun (which sets RANK and WORLD_SIZE), or pass --rank and "
            "--world-size with --master-addr/--master-port, or --local N"
        )
    if not 0 <= args.rank < args.world_size or args.world_size < 2:
        raise ConfigError(
            f"rank {args.rank} of world size {args.world_size}: need 0 <= rank < world "
            "size and at least 2 ranks (a link has two ends)"
        )
    local_rank = args.local_rank if args.local_rank is not None else 0
    node = rank_node(args, local_rank)
    name = RankName(
        rank=args.rank,
        host=socket.gethostname(),
        local_rank=local_rank,
        node=node,
        device=f"{node}/{local_rank}" if node else None,
    )
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    return Job(args.rank, args.world_size, name, backend, args.timeout_s)


def check_names(names: Sequence[RankName]) -> None:
    """Two ranks must not claim the same device.

    Raises:
        ConfigError: a device name appears twice (the same HPLAN_NODE on two nodes?).
    """
    seen: dict[str, int] = {}
    for name in names:
        if name.device is None:
            continue
        if name.device in seen:
            raise ConfigError(
                f"ranks {seen[name.device]} and {name.rank} both say they are device "
                f"{name.device!r}; give every node its own {NODE_ENV} (or --node)"
            )
        seen[name.device] = name.rank


# ----------------------------------------------------------------------------- measuring
def _device(job: Job) -> torch.device:
    if job.backend != "nccl":
        return torch.device("cpu")
    torch.cuda.set_device(job.name.local_rank)
    return torch.device("cuda", job.name.local_rank)


def _join(job: Job, args: argparse.Namespace) -> None:
    """Join the job through ``env://`` (torchrun's store, or rank 0's at master addr:port).

    Raises:
        ConfigError: no master address or port. PeerFailureError: the ranks did not meet.
    """
    if args.master_addr is None or args.master_port is None:
        raise ConfigError("pass --master-addr and --master-port (torchrun sets them)")
    binding = bind_interface_towards(args.master_addr, job.backend)
    via = f" via {binding.interface}" if binding.interface else ""
    say(f"rank {job.rank} ({job.name.label}) joining {job.world_size} ranks at "
        f"{args.master_addr}:{args.master_port} ({job.backend}{via})")  # fmt: skip
    join_process_group(
        backend=job.backend, rank=job.rank, world_size=job.world_size, host=args.master_addr,
        port=args.master_port, timeout_s=job.timeout_s, job="measurement",
    )  # fmt: skip


def _node_groups(names: Sequence[RankName]) -> list[tuple[str, tuple[int, ...]]]:
    """(node, ranks) per node (the host where the node is unknown), in first-rank order."""
    groups: dict[str, list[int]] = {}
    for name in sorted(names, key=lambda n: n.rank):
        groups.setdefault(name.node or name.host, []).append(name.rank)
    return [(node, tuple(ranks)) for node, ranks in groups.items()]


def _all_reduce_results(
    nodes: Sequence[tuple[str, tuple[int, ...]]],
    gathered: Sequence[dict[int, dict[int, list[float]]]],
) -> tuple[NodeAllReduce, ...]:
    out = []
    for idx, (node, ranks) in enumerate(nodes):
        if len(ranks) < 2:
            continue
        sizes = slowest_per_repeat([gathered[r][idx] for r in ranks])
        fit = fit_alpha_beta(sizes)
        n = len(ranks)
        bus = fit.bandwidth_bytes_per_s * 2 * (n - 1) / n
        out.append(
            NodeAllReduce(
                node=node, ranks=ranks, fit=fit, bus_bandwidth_bytes_per_s=bus, sizes=tuple(sizes)
            )
        )
    return tuple(out)


def measure(job: Job, sweep: Sweep) -> BandwidthFile:
    """Measure every pair and every node's all-reduce; every rank returns the whole file.

    The process group must be initialised.

    Raises:
        ConfigError: two ranks claim the same device. RuntimeError: a peer failed.
    """
    device = _device(job)
    names: list[RankName | None] = [None] * job.world_size
    dist.all_gather_object(names, job.name)
    known = [n for n in names if n is not None]
    check_names(known)
    nodes = _node_groups(known)
    groups = [(ranks, dist.new_group(list(ranks))) for _, ranks in nodes]  # every rank, in order
    pairs = measure_pairs(job.rank, job.world_size, sweep, device, say)
    all_reduce = measure_all_reduce(job.rank, groups, sweep, device)
    gathered_pairs: list[list[PairLink] | None] = [None] * job.world_size
    dist.all_gather_object(gathered_pairs, pairs)
    gathered_ar: list[dict[int, dict[int, list[float]]] | None] = [None] * job.world_size
    dist.all_gather_object(gathered_ar, all_reduce)
    every_pair = sorted(
        (p for sent in gathered_pairs if sent for p in sent), key=lambda p: (p.src_rank, p.dst_rank)
    )
    reduced = _all_reduce_results(nodes, [g or {} for g in gathered_ar])
    return BandwidthFile(
        backend=job.backend,
        world_size=job.world_size,
        repeats=sweep.repeats,
        warmup=sweep.warmup,
        ranks=tuple(sorted(known, key=lambda n: n.rank)),
        pairs=tuple(every_pair),
        all_reduce=reduced,
        notes=_fit_notes(known, every_pair, reduced),
    )


def _fit_notes(
    names: Sequence[RankName], pairs: Sequence[PairLink], reduced: Sequence[NodeAllReduce]
) -> tuple[str, ...]:
    """One note per fit that is not a least-squares line (noise swamped the sweep)."""
    label = {n.rank: n.label for n in names}
    noisy = [
        f"{label[p.src_rank]} -> {label[p.dst_rank]}"
        for p in pairs
        if p.fit.method is not FitMethod.LEAST_SQUARES
    ] + [f"all-reduce on {r.node}" for r in reduced if r.fit.method is not FitMethod.LEAST_SQUARES]
    if not noisy:
        return ()
    return (
        f"timings too noisy for a latency + bandwidth line (R^2 < {MIN_R_SQUARED}) for "
        f"{', '.join(noisy)}: their bandwidth is the largest message over its time, a lower "
        "bound; raise --max-size-bytes or --repeats to resolve them",
    )


def link_summary_lines(result: BandwidthFile) -> list[str]:
    """Human summary: one line per pair and per node all-reduce."""
    lines = []
    for pair in result.pairs:
        src = result.rank_name(pair.src_rank).label
        dst = result.rank_name(pair.dst_rank).label
        lines.append(f"{src} -> {dst}: {fit_text(pair.fit)}")
    for node in result.all_reduce:
        lines.append(
            f"all-reduce on {node.node} ({len(node.ranks)} ranks): {fit_text(node.fit)}; "
            f"bus bandwidth {rate_text(node.bus_bandwidth_bytes_per_s)}"
        )
    return lines


def measure_rank(args: argparse.Namespace) -> None:
    """Join, measure, and (rank 0) write ``args.out`` and print the summary."""
    sweep = sweep_from(args)
    job = job_from(args)
    _join(job, args)
    try:
        result = measure(job, sweep)
    except RuntimeError as exc:
        raise PeerFailureError(
            f"rank {job.rank} lost a peer while measuring: {error_reason(exc)}; check the "
            "other ranks' output (one probably failed first) and the network between them"
        ) from None
    if job.rank == 0:
        result.save(args.out)
        for line in (*link_summary_lines(result), *result.notes):
            say(line)
        say(f"wrote {args.out}")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (hplan errors: one line on stderr)."""
    args = parser().parse_args(argv)
    try:
        if args.local is not None:
            from hplan.runtime.bandwidth.local import measure_local

            names = local_names(args.cluster, args.local) if args.cluster else None
            measure_local(args.local, out=args.out, sweep_args=sweep_argv(args), names=names)
        else:
            from hplan.runtime.rehearsal.launcher import follow_supervisor

            follow_supervisor()  # a rank of `--local`: ends with the process that started it
            torch.set_num_threads(1)
            measure_rank(args)
    except HplanError as exc:
        print(f"{_PROG}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    return 0


def local_names(cluster: Path, num_ranks: int) -> list[tuple[str, int]]:
    """(node, local index) of every device of ``cluster``, one local rank each.

    Raises:
        ConfigError: the cluster has another number of devices than ``num_ranks``.
    """
    names = [(node, idx) for node, count in cluster_nodes(cluster) for idx in range(count)]
    if len(names) != num_ranks:
        raise ConfigError(
            f"{str(cluster)!r} has {len(names)} devices but --local is {num_ranks}; pass "
            f"--local {len(names)} (one local rank per device)"
        )
    return names


def sweep_argv(args: argparse.Namespace) -> list[str]:
    """The sweep and timeout options as command-line arguments (for child processes)."""
    sweep_from(args)  # fail here, once, rather than in every child
    return [
        "--min-size-bytes", str(args.min_size_bytes), "--max-size-bytes", str(args.max_size_bytes),
        "--repeats", str(args.repeats), "--warmup", str(args.warmup),
        "--size-budget-s", repr(args.size_budget_s), "--timeout-s", repr(args.timeout_s),
    ]  # fmt: skip
