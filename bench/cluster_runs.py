"""hplan's real flow and torch DDP on a :class:`NamespaceCluster`, as a user runs them: what
the real-cluster benchmarks (``real_cluster.py``, ``slow_links.py``) share.

- :func:`profile_nodes`: ``hplan profile --model M --node NAME`` inside each node, one after another;
- :func:`measure_links`: ``hplan bandwidth``'s scripts in every node at once (the matrix);
- :func:`run_launch_scripts`: the generated ``launch/node-NAME.sh`` in each namespace
  (torchrun, gloo, hplan's runtime) with ``--steps`` and ``--metrics-dir``; every rank's
  metrics back;
- :func:`run_ddp`: ``ddp_reference.py`` under torchrun in each namespace; rank 0's step ends
  and the global batch's mean loss per step.

Node ``i`` is named ``cluster.nodes[i].name`` (the :class:`NodeShape`'s name) in
cluster.yaml, in the plan and in the log files. Throughput is :func:`throughput` of rank 0's
step ends. A command that fails ends the benchmark (``SystemExit``) with the tail of its logs.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from common import HPLAN
from netns_cluster import NamespaceCluster

from hplan.runtime.contract.metrics_file import StepMetrics, read_rank_metrics, summarize_records

BIN = Path(sys.executable).parent
DDP = Path(__file__).resolve().parent / "ddp_reference.py"
RUN_TIMEOUT_S = 900.0
"""Longest a profile, a bandwidth measurement or a training run may take."""


@dataclass(frozen=True)
class Model:
    """A model file with its size (environment) and the global batch it trains with."""

    name: str
    path: Path
    env: dict[str, str]
    global_batch: int


def clean_env(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without torchrun's and the thread count's variables,
    plus ``extra``, unbuffered output and this Python's bin folder (torchrun) first on PATH."""
    env = dict(os.environ)
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "OMP_NUM_THREADS"):
        env.pop(name, None)
    env.update(extra, PYTHONUNBUFFERED="1")
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def hplan_proc(*args: str, env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    """Run the ``hplan`` CLI here (outside the namespaces); its exit status and output."""
    return subprocess.run([*HPLAN, *args], capture_output=True, text=True, env=dict(env))


def last_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The last line of a failed command's stderr (its one-line error), else its exit code."""
    return (proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"])[0]


def hplan_cli(*args: str, env: Mapping[str, str]) -> str:
    """Run the ``hplan`` CLI; its stdout. Raises ``SystemExit`` with its error line."""
    proc = hplan_proc(*args, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"hplan {args[0]} failed: {last_line(proc)}")
    return proc.stdout


def cluster_yaml(
    cluster: NamespaceCluster,
    name: str,
    inter_node_mbit_per_s: float,
    pairs_mbit_per_s: Mapping[tuple[str, str], float] | None = None,
) -> str:
    """cluster.yaml of the namespace cluster: one ``cpu`` device per node, every link between
    nodes ``inter_node_mbit_per_s`` except the node pairs in ``pairs_mbit_per_s`` (the rates
    the namespaces are shaped to; a measured link matrix overrides them)."""
    lines = [f"name: {name}", "nodes:"]
    for i, node in enumerate(cluster.nodes):
        lines.append(
            f"  - {{name: {node.name}, host: {cluster.host(i)}, devices: [{{type: cpu}}]}}"
        )
    gbit = inter_node_mbit_per_s / 1000
    lines += ["links:", f"  inter_node: {{bandwidth_gbit_per_s: {gbit:g}, latency_us: 100}}"]
    if pairs_mbit_per_s:
        lines.append("  pairs:")
        for (a, b), rate in pairs_mbit_per_s.items():
            lines.append(
                f"    - {{nodes: [{a}, {b}], bandwidth_gbit_per_s: {rate / 1000:g}, "
                "latency_us: 100}"
            )
    return "\n".join([*lines, ""])


def wait_all(
    cluster: NamespaceCluster,
    procs: Sequence[subprocess.Popen[bytes]],
    logs: Sequence[Path],
    what: str,
    timeout_s: float = RUN_TIMEOUT_S,
) -> None:
    """Wait for every process; on a timeout kill them all. Raises ``SystemExit`` with the
    logs' tails when one failed."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                cluster.kill(other)
            break
    if any(proc.returncode != 0 for proc in procs):
        tails = "\n".join(f"--- {log.name}\n" + log.read_text()[-1500:] for log in logs)
        raise SystemExit(f"{what} failed:\n{tails}")


Job = tuple[Sequence[str], Mapping[str, str]]
"""A command line and its environment."""


def run_at_once(
    cluster: NamespaceCluster, jobs: Mapping[int, Job], work: Path, tag: str, what: str
) -> None:
    """Start ``jobs[i]`` in node ``i``, all at once (logs ``<tag>-<node>.log``), and wait for
    all of them."""
    procs, logs = [], []
    for i, (argv, env) in jobs.items():
        log = work / f"{tag}-{cluster.nodes[i].name}.log"
        procs.append(cluster.start(i, argv, log=log, env=dict(env), cwd=work))
        logs.append(log)
    wait_all(cluster, procs, logs, what)


def profile_nodes(cluster: NamespaceCluster, model: Model, work: Path) -> Path:
    """Profile every node inside its own quota, one after another; return the folder.

    One after another, as on a real cluster whose machines share nothing: the nodes of this
    one machine share its cores' caches and memory bandwidth, and profiled all at once each
    node's curve over micro-batch sizes took whatever the others ran at the time (MLP at
    0.6 cores: 512 samples 1-6% cheaper per sample than 1024, where one process alone spent
    31.4 and 30.2 us of CPU per sample). The runs' share of that contention, alike at every
    size, is what ``hplan calibrate`` corrects (``--calibrate``)."""
    out = work / "profiles"
    env = clean_env(model.env)
    for i, node in enumerate(cluster.nodes):
        log = work / f"profile-{node.name}.log"
        argv = [*HPLAN, "profile", "--model", str(model.path), "--node", node.name, "-o", str(out)]
        proc = cluster.start(i, argv, log=log, env=env, cwd=work)
        wait_all(cluster, [proc], [log], f"hplan profile on {node.name}")
    return out


def measure_links(cluster: NamespaceCluster, cluster_file: Path, work: Path, port: int) -> Path:
    """``hplan bandwidth``'s scripts, one per namespace at once; the link matrix's path."""
    scripts = work / "bandwidth"
    hplan_cli("bandwidth", "--cluster", str(cluster_file), "--write-scripts", str(scripts),
              "--master-port", str(port), env=clean_env({}))  # fmt: skip
    jobs = {
        i: (["bash", str(scripts / f"bandwidth-{n.name}.sh")], clean_env({}))
        for i, n in enumerate(cluster.nodes)
    }
    run_at_once(cluster, jobs, work, "bandwidth", "hplan bandwidth")
    return scripts / "bandwidth.json"


def throughput(ends: Sequence[float], global_batch: int, warmup: int) -> float:
    """Samples/s over the step ends after the first ``warmup`` steps: the global batch times
    the steps from the end of step ``warmup`` to the last one's end, over that time."""
    timed = ends[warmup:]
    if len(timed) < 2:
        raise SystemExit(f"only {len(ends)} steps recorded; raise --steps above --warmup + 1")
    return global_batch * (len(timed) - 1) / (timed[-1] - timed[0])


def run_launch_scripts(
    cluster: NamespaceCluster, plan_dir: Path, model: Model, steps: int, work: Path, tag: str
) -> dict[int, list[StepMetrics]]:
    """Run the plan's generated launch scripts, each in its node's namespace (nodes the plan
    leaves idle have none), for ``steps`` optimizer steps; every rank's metrics (rank -> its
    steps in order)."""
    metrics = work / f"metrics-{tag}"
    shutil.rmtree(metrics, ignore_errors=True)
    flags = ["--steps", str(steps), "--metrics-dir", str(metrics)]
    scripts = {i: plan_dir / "launch" / f"node-{n.name}.sh" for i, n in enumerate(cluster.nodes)}
    jobs = {
        i: (["bash", str(script), *flags], clean_env(model.env))
        for i, script in scripts.items()
        if script.exists()
    }
    run_at_once(cluster, jobs, work, f"hplan-{tag}", "hplan run")
    return {int(p.stem.split("-")[1]): read_rank_metrics(p) for p in metrics.glob("rank-*.jsonl")}


def rank0_ends(records: Mapping[int, Sequence[StepMetrics]]) -> list[float]:
    """Rank 0's step ends (Unix seconds), in step order."""
    return [r.end_unix_time_s for r in records[0]]


def job_losses(records: Mapping[int, Sequence[StepMetrics]]) -> list[float | None]:
    """The job loss of every step: the global batch's mean loss, the last stages' replica
    losses weighted by their samples (``metrics_file.step_summary``, as ``hplan metrics``)."""
    steps = summarize_records([r for rs in records.values() for r in rs]).steps
    return [s.loss for s in steps]


@dataclass(frozen=True)
class DdpRun:
    """What one DDP run measured."""

    end_unix_time_s: list[float]
    """Rank 0's step ends."""
    losses: list[float]
    """The global batch's mean loss per step (the ranks' losses weighted by their samples)."""


def run_ddp(
    cluster: NamespaceCluster,
    sizes: Sequence[int],
    model: Model,
    steps: int,
    work: Path,
    tag: str,
    *,
    port: int,
    seed: int = 0,
) -> DdpRun:
    """torch DDP with ``sizes[i]`` samples per step on node ``i`` (one rank per node)."""
    out = work / f"ddp-{tag}.json"
    jobs = {}
    for i in range(len(cluster.nodes)):
        # DDP at its best: one thread per rank, gloo on the namespace's own interface
        env = clean_env({**model.env, "OMP_NUM_THREADS": "1", "HPLAN_DDP_PARTS": "1",
                         "GLOO_SOCKET_IFNAME": f"{cluster.tag}-n{i}"})  # fmt: skip
        argv = [str(BIN / "torchrun"), "--nnodes", str(len(cluster.nodes)), "--node-rank",
                str(i), "--nproc-per-node", "1", "--master-addr", cluster.host(0),
                "--master-port", str(port), str(DDP), str(model.path), "--batch-sizes",
                ",".join(map(str, sizes)), "--steps", str(steps), "--seed", str(seed),
                "--out", str(out)]  # fmt: skip
        jobs[i] = (argv, env)
    run_at_once(cluster, jobs, work, f"ddp-{tag}", "DDP")
    ranks = [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(len(sizes))]
    losses = [
        sum(size * rank["losses"][step] for size, rank in zip(sizes, ranks, strict=True))
        / sum(sizes)
        for step in range(steps)
    ]
    return DdpRun(ranks[0]["end_unix_time_s"], losses)


BREAKDOWN = ("forward", "backward", "wait", "p2p", "allreduce", "optimizer", "other")


def breakdown(
    records: Mapping[int, Sequence[StepMetrics]], warmup: int
) -> dict[int, dict[str, float]]:
    """Median milliseconds per part of the step, per rank, after the first ``warmup`` steps
    (the backward is the compute time less the forward)."""
    out = {}
    for rank, steps in sorted(records.items()):
        timed = steps[warmup:]
        parts = {"step": statistics.median(s.step_time_s for s in timed) * 1e3}
        for part in BREAKDOWN:
            if part == "backward":
                values = [s.compute_time_s - s.forward_time_s for s in timed]
            else:
                values = [getattr(s, f"{part}_time_s") for s in timed]
            parts[part] = statistics.median(values) * 1e3
        out[rank] = parts
    return out


def proportional_split(total: int, weights: Sequence[float]) -> tuple[int, ...]:
    """``total`` samples in proportion to ``weights``, rounded by largest remainder (the
    earlier part first on ties), summing to ``total``."""
    raw = [total * w / sum(weights) for w in weights]
    split = [int(r) for r in raw]
    by_remainder = sorted(range(len(raw)), key=lambda i: split[i] - raw[i])
    for i in by_remainder[: total - sum(split)]:
        split[i] += 1
    return tuple(split)


def equal_split(total: int, parts: int) -> tuple[int, ...]:
    """``total`` samples in ``parts`` shares differing by at most one."""
    return proportional_split(total, [1.0] * parts)


def median_range(values: Sequence[float], unit: str = "", digits: int = 2) -> str:
    """Median and range of ``values``: ``1.23x (1.10-1.30)``; the median alone when the
    range is one value at ``digits``."""
    mid, low, high = (f"{v:.{digits}f}" for v in (statistics.median(values), *_ends(values)))
    return f"{mid}{unit}" if low == high else f"{mid}{unit} ({low}-{high})"


def _ends(values: Sequence[float]) -> tuple[float, float]:
    return min(values), max(values)


def ratio_text(num: Sequence[float], den: Sequence[float]) -> str:
    """Median and range of the round-by-round ratios ``num[i] / den[i]``: ``1.23x (1.10-1.30)``."""
    return median_range([a / b for a, b in zip(num, den, strict=True)], "x")
