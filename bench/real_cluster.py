"""hplan against torch DDP on a real heterogeneous cluster (issue 14), measured from outside.

The cluster is built on this machine (``netns_cluster.py``): one network namespace per node on
a bridge, each node's link shaped by ``tc tbf`` and its CPU capped by a cgroup-v1 quota; one
``cpu`` device per node. hplan's real flow, as a user runs it:

1. ``hplan profile --model M --node NAME`` inside each node (inside its quota);
2. ``hplan bandwidth``'s scripts in every node at once (the link matrix), then
   ``hplan solve M -c cluster.yaml --profile PROFILES --bandwidth MATRIX``;
3. the generated ``launch/node-NAME.sh`` in each namespace (torchrun, gloo, hplan's runtime);

against torch DDP (``ddp_reference.py``, the same model file, its optimizer, the same global
batch) with equal batches and with batches split by measured speed: every node trains the
model alone on an equal share, all at once, and the batch is split by the samples/s each
reached. The
runs are interleaved (round 1: hplan, DDP equal, DDP split; round 2 starts one further on; ...)
because the machine is noisy. Throughput is the global batch over the spacing of rank 0's
step ends after ``--warmup`` steps (every per-step overhead included). Printed per case:
samples/s of each run, the ratios hplan/DDP (median and range over rounds), the plan's
predicted samples/s against hplan's measured, and the median per-rank breakdown of hplan's
step from its own metrics (compute, wait, point-to-point, all-reduce, optimizer, other).

    python bench/real_cluster.py [--models mlp,gpt] [--rounds 3] [--steps 30]
        [--cases hetero,homogeneous] [--calibrate] [--keep DIR]

``--calibrate``: before the rounds, hplan's plan runs once, ``hplan calibrate`` reads that run
and the case is solved again; the rounds run the calibrated plan (the issue's "after at most
one calibration"), and the first run's measured and predicted samples/s are printed too.
Needs root, iproute2 and cgroup v1's cpu controller; prints one line and exits 0 where they
are missing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common import GPT, HPLAN, ROOT, console, gpt_env, table
from netns_cluster import NamespaceCluster, NodeShape, available

from hplan.runtime.contract.metrics_file import StepMetrics, read_rank_metrics
from hplan.runtime.contract.plan import Plan

BIN = Path(sys.executable).parent
MLP = ROOT / "examples" / "mlp" / "model.py"
DDP = Path(__file__).resolve().parent / "ddp_reference.py"
PORT = 29651
RATE_MBIT_PER_S = 10_000


@dataclass(frozen=True)
class Model:
    name: str
    path: Path
    env: dict[str, str]
    global_batch: int


MODELS = {
    "mlp": Model("MLP example", MLP, {"HPLAN_MLP_LAYERS": "8", "HPLAN_MLP_WIDTH": "256"}, 4096),
    "gpt": Model("GPT example", GPT, gpt_env(layers=4, width=128, heads=4, seq=64), 96),
}
CASES = {
    "hetero": (0.9, 0.45, 0.45),
    "homogeneous": (0.6, 0.6, 0.6),
}
NODE_NAMES = ("fast", "slow-a", "slow-b")


@dataclass
class Case:
    """One model on one set of quotas: what was measured in every round."""

    model: Model
    quotas: tuple[float, ...]
    split: tuple[int, ...] = ()
    samples_per_s: dict[str, list[float]] = field(default_factory=dict)
    predicted_samples_per_s: float = 0.0
    breakdown: dict[int, dict[str, float]] = field(default_factory=dict)
    plan_text: str = ""
    first: tuple[float, float] | None = None
    """With ``--calibrate``: the first run's measured and predicted samples/s."""
    first_plan_text: str = ""


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "OMP_NUM_THREADS"):
        env.pop(name, None)
    env.update(extra, PYTHONUNBUFFERED="1")
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def _hplan(*args: str, env: dict[str, str]) -> str:
    proc = subprocess.run([*HPLAN, *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise SystemExit(f"hplan {args[0]} failed: {tail[0]}")
    return proc.stdout


def _cluster_yaml(cluster: NamespaceCluster) -> str:
    lines = ["name: real-cluster", "nodes:"]
    for i, name in enumerate(NODE_NAMES[: len(cluster.nodes)]):
        lines.append(f"  - {{name: {name}, host: {cluster.host(i)}, devices: [{{type: cpu}}]}}")
    gbit = RATE_MBIT_PER_S / 1000
    lines += ["links:", f"  inter_node: {{bandwidth_gbit_per_s: {gbit:g}, latency_us: 100}}", ""]
    return "\n".join(lines)


def _wait_all(cluster: NamespaceCluster, procs: Sequence[subprocess.Popen[bytes]],
              timeout_s: float, logs: Sequence[Path], what: str) -> None:  # fmt: skip
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


def profile_nodes(cluster: NamespaceCluster, model: Model, work: Path) -> Path:
    """Profile every node inside its own quota, one after another; return the folder."""
    out = work / "profiles"
    env = _env(model.env)
    for i, name in enumerate(NODE_NAMES[: len(cluster.nodes)]):
        log = work / f"profile-{name}.log"
        argv = [*HPLAN, "profile", "--model", str(model.path), "--node", name, "-o", str(out)]
        proc = cluster.start(i, argv, log=log, env=env, cwd=work)
        _wait_all(cluster, [proc], 600, [log], f"hplan profile on {name}")
    return out


def measure_links(cluster: NamespaceCluster, cluster_file: Path, work: Path) -> Path:
    """``hplan bandwidth``'s scripts, one per namespace at once; the link matrix's path."""
    scripts = work / "bandwidth"
    _hplan("bandwidth", "--cluster", str(cluster_file), "--write-scripts", str(scripts),
           "--master-port", str(PORT + 2), env=_env({}))  # fmt: skip
    procs, logs = [], []
    for i, name in enumerate(NODE_NAMES[: len(cluster.nodes)]):
        log = work / f"bandwidth-{name}.log"
        procs.append(cluster.start(i, ["bash", str(scripts / f"bandwidth-{name}.sh")], log=log,
                                   env=_env({}), cwd=work))  # fmt: skip
        logs.append(log)
    _wait_all(cluster, procs, 900, logs, "hplan bandwidth")
    return scripts / "bandwidth.json"


def speed_split(cluster: NamespaceCluster, model: Model, steps: int, work: Path) -> tuple[int, ...]:
    """The global batch split in proportion to each node's samples/s, measured with every
    node training the model alone on an equal share at the same time (so that what the
    nodes take from each other's caches and memory bandwidth counts): the best split a user
    could give DDP by hand."""
    equal = _equal_split(model.global_batch, len(cluster.nodes))
    procs, logs = [], []
    for i, size in enumerate(equal):
        env = _env({**model.env, "OMP_NUM_THREADS": "1"})
        log = work / f"solo-{i}.log"
        argv = [sys.executable, str(DDP), str(model.path), "--solo", "--batch-sizes", str(size),
                "--steps", str(steps), "--out", str(work / f"solo-{i}.json")]  # fmt: skip
        procs.append(cluster.start(i, argv, log=log, env=env, cwd=work))
        logs.append(log)
    _wait_all(cluster, procs, 900, logs, "solo speed runs")
    speeds = []
    for i, size in enumerate(equal):
        ends = json.loads((work / f"solo-{i}.json").read_text())["end_unix_time_s"]
        speeds.append(_throughput(ends, size, WARMUP))
    return proportional_split(model.global_batch, speeds)


def _throughput(ends: Sequence[float], global_batch: int, warmup: int) -> float:
    timed = ends[warmup:]
    if len(timed) < 2:
        raise SystemExit(f"only {len(ends)} steps recorded; raise --steps above --warmup + 1")
    return global_batch * (len(timed) - 1) / (timed[-1] - timed[0])


def run_hplan(cluster: NamespaceCluster, plan_dir: Path, model: Model, steps: int,
              work: Path, tag: str) -> tuple[float, dict[int, list[StepMetrics]]]:  # fmt: skip
    """Run the generated launch scripts, one per namespace; samples/s and the metrics."""
    metrics = work / f"metrics-{tag}"
    shutil.rmtree(metrics, ignore_errors=True)
    env = _env({**model.env, "MASTER_PORT": str(PORT)})
    procs, logs = [], []
    for i, name in enumerate(NODE_NAMES[: len(cluster.nodes)]):
        log = work / f"hplan-{tag}-{name}.log"
        script = plan_dir / "launch" / f"node-{name}.sh"
        argv = ["bash", str(script), "--steps", str(steps), "--metrics-dir", str(metrics)]
        procs.append(cluster.start(i, argv, log=log, env=env, cwd=work))
        logs.append(log)
    _wait_all(cluster, procs, 900, logs, "hplan run")
    records = {
        int(p.stem.split("-")[1]): read_rank_metrics(p) for p in metrics.glob("rank-*.jsonl")
    }
    ends = [r.end_unix_time_s for r in records[0]]
    return _throughput(ends, model.global_batch, WARMUP), records


def run_ddp(cluster: NamespaceCluster, sizes: Sequence[int], model: Model, steps: int,
            work: Path, tag: str) -> float:  # fmt: skip
    """torch DDP with ``sizes[i]`` samples per step on node ``i``; samples/s."""
    out = work / f"ddp-{tag}.json"
    procs, logs = [], []
    for i in range(len(cluster.nodes)):
        # DDP at its best: one thread per rank, gloo on the namespace's own interface
        env = _env({**model.env, "OMP_NUM_THREADS": "1",
                    "GLOO_SOCKET_IFNAME": f"{cluster.tag}-n{i}"})  # fmt: skip
        log = work / f"ddp-{tag}-{i}.log"
        argv = [str(BIN / "torchrun"), "--nnodes", str(len(cluster.nodes)), "--node-rank",
                str(i), "--nproc-per-node", "1", "--master-addr", cluster.host(0),
                "--master-port", str(PORT + 1), str(DDP), str(model.path), "--batch-sizes",
                ",".join(map(str, sizes)), "--steps", str(steps), "--out", str(out)]  # fmt: skip
        procs.append(cluster.start(i, argv, log=log, env=env, cwd=work))
        logs.append(log)
    _wait_all(cluster, procs, 900, logs, "DDP")
    ends = json.loads(out.read_text())["end_unix_time_s"]
    return _throughput(ends, model.global_batch, WARMUP)


BREAKDOWN = ("forward", "backward", "wait", "p2p", "allreduce", "optimizer", "other")


def breakdown(records: dict[int, list[StepMetrics]]) -> dict[int, dict[str, float]]:
    """Median milliseconds per part of the step, per rank, after the warm-up steps (the
    backward is the compute time less the forward)."""
    out = {}
    for rank, steps in sorted(records.items()):
        timed = steps[WARMUP:]
        parts = {"step": statistics.median(s.step_time_s for s in timed) * 1e3}
        for part in BREAKDOWN:
            if part == "backward":
                values = [s.compute_time_s - s.forward_time_s for s in timed]
            else:
                values = [getattr(s, f"{part}_time_s") for s in timed]
            parts[part] = statistics.median(values) * 1e3
        out[rank] = parts
    return out


def run_case(case: Case, args: argparse.Namespace, work: Path) -> None:
    model, quotas = case.model, case.quotas
    nodes = [NodeShape(n, q, RATE_MBIT_PER_S) for n, q in zip(NODE_NAMES, quotas, strict=False)]
    with NamespaceCluster(nodes, tag="hprc", subnet=214) as cluster:
        cluster_file = work / "cluster.yaml"
        cluster_file.write_text(_cluster_yaml(cluster))
        console.print(f"[bold]{model.name}[/] quotas {quotas}: profiling each node")
        profiles = profile_nodes(cluster, model, work)
        console.print("  measuring the links (hplan bandwidth)")
        links = measure_links(cluster, cluster_file, work)
        case.split = speed_split(cluster, model, args.steps, work)
        plan_dir = work / "plan"
        env = _env(model.env)
        solve = ["solve", str(model.path), "-c", str(cluster_file), "--profile", str(profiles),
                 "-b", str(model.global_batch), "-o", str(plan_dir), "--master-port", str(PORT),
                 "--bandwidth", str(links)]  # fmt: skip
        _hplan(*solve, env=env)
        if args.calibrate:  # one real run, calibrate, solve again: the rounds run that plan
            console.print("  first run, to calibrate")
            case.first_plan_text = _plan_text(Plan.load(plan_dir / "plan.json"))
            first, _ = run_hplan(cluster, plan_dir, model, args.steps, work, "first")
            case.first = (first, Plan.load(plan_dir / "plan.json").report.predicted_samples_per_s)
            calibrated = work / "calibrated"
            _hplan("calibrate", str(plan_dir / "plan.json"), str(work / "metrics-first"),
                   "--profile", str(profiles), "-o", str(calibrated), env=env)  # fmt: skip
            _hplan(*solve[:5], str(calibrated), *solve[6:], env=env)
        equal = _equal_split(model.global_batch, len(nodes))
        runs = ["hplan", "ddp equal", "ddp split"]
        for r in range(args.rounds):
            order = runs[r % 3 :] + runs[: r % 3]
            for run in order:
                console.print(f"  round {r + 1}: {run}")
                if run == "hplan":
                    value, records = run_hplan(cluster, plan_dir, model, args.steps, work,
                                               f"r{r}")  # fmt: skip
                    case.breakdown = breakdown(records)
                elif run == "ddp equal":
                    value = run_ddp(cluster, equal, model, args.steps, work, f"e{r}")
                else:
                    value = run_ddp(cluster, case.split, model, args.steps, work, f"s{r}")
                case.samples_per_s.setdefault(run, []).append(value)
        plan = Plan.load(plan_dir / "plan.json")
        case.predicted_samples_per_s = plan.report.predicted_samples_per_s
        case.plan_text = _plan_text(plan)


def _plan_text(plan: Plan) -> str:
    return ", ".join(
        f"r{rp.rank} {rp.node} stage {rp.stage} {rp.micro_batch_size}x{rp.num_microbatches}"
        for rp in plan.ranks
    )


def proportional_split(total: int, weights: Sequence[float]) -> tuple[int, ...]:
    """``total`` samples in proportion to ``weights``, rounded by largest remainder (the
    earlier part first on ties), summing to ``total``."""
    raw = [total * w / sum(weights) for w in weights]
    split = [int(r) for r in raw]
    by_remainder = sorted(range(len(raw)), key=lambda i: split[i] - raw[i])
    for i in by_remainder[: total - sum(split)]:
        split[i] += 1
    return tuple(split)


def _equal_split(total: int, parts: int) -> tuple[int, ...]:
    return proportional_split(total, [1.0] * parts)


def _ratio(num: Sequence[float], den: Sequence[float]) -> str:
    ratios = sorted(a / b for a, b in zip(num, den, strict=True))
    return f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def report(cases: Sequence[Case]) -> None:
    out = table("hplan vs torch DDP, real namespace cluster (median of rounds, range)",
                ["case", "hplan samples/s", "DDP equal", "DDP split", "split",
                 "hplan/DDP equal", "hplan/DDP split", "measured/predicted"])  # fmt: skip
    for c in cases:
        s = c.samples_per_s
        hplan = statistics.median(s["hplan"])
        out.add_row(
            f"{c.model.name} {'/'.join(f'{q:g}' for q in c.quotas)}",
            f"{hplan:.0f}",
            f"{statistics.median(s['ddp equal']):.0f}",
            f"{statistics.median(s['ddp split']):.0f}",
            ":".join(map(str, c.split)),
            _ratio(s["hplan"], s["ddp equal"]),
            _ratio(s["hplan"], s["ddp split"]),
            f"{hplan / c.predicted_samples_per_s:.2f}" if c.predicted_samples_per_s else "-",
        )
    console.print(out)
    for c in cases:
        if c.first is not None:
            console.print(
                f"[bold]{c.model.name} {c.quotas}[/] before calibration: {c.first[0]:.0f} "
                f"samples/s measured, {c.first[1]:.0f} predicted "
                f"({c.first[0] / c.first[1]:.2f}); plan {c.first_plan_text}"
            )
        console.print(f"[bold]{c.model.name} {c.quotas}[/] plan: {c.plan_text}")
        parts = table("hplan step breakdown, ms (median per rank, last round)",
                      ["rank", "step", *BREAKDOWN])  # fmt: skip
        for rank, row in c.breakdown.items():
            parts.add_row(str(rank), *(f"{row[k]:.1f}" for k in ("step", *BREAKDOWN)))
        console.print(parts)


WARMUP = 3


def main() -> None:
    global WARMUP
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,gpt")
    parser.add_argument("--cases", default="hetero,homogeneous")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--keep", type=Path, help="keep the work folder here")
    args = parser.parse_args()
    WARMUP = args.warmup
    missing = available()
    if missing:
        print(f"real_cluster: skipped: {missing}")
        return
    cases = [
        Case(MODELS[m], CASES[c]) for m in args.models.split(",") for c in args.cases.split(",")
    ]
    root = args.keep or Path(tempfile.mkdtemp(prefix="hplan-real-"))
    try:
        for i, case in enumerate(cases):
            work = root / f"case-{i}"
            work.mkdir(parents=True, exist_ok=True)
            run_case(case, args, work)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    report(cases)


if __name__ == "__main__":
    main()
