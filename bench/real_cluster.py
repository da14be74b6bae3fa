"""hplan against torch DDP on a real heterogeneous cluster (issue 14), measured from outside.

The cluster is built on this machine (``netns_cluster.py``): one network namespace per node on
a bridge, each node's link shaped by ``tc tbf`` and its CPU capped by a cgroup-v1 quota; one
``cpu`` device per node. hplan's real flow, as a user runs it:

1. ``hplan profile --model M --node NAME`` inside each node (inside its quota);
2. ``hplan bandwidth``'s scripts in every node at once (the link matrix), then
   ``hplan solve M -c cluster.yaml --profile PROFILES --bandwidth MATRIX --sync all_reduce``
   (DDP's training: every gradient summed every step, never local SGD);
3. the generated ``launch/node-NAME.sh`` in each namespace (torchrun, gloo, hplan's runtime);

against torch DDP (``ddp_reference.py``, the same model file, its optimizer, the same global
batch) with equal batches and with batches split by measured speed: every node trains the
model alone on an equal share, all at once, and the batch is split by the samples/s each
reached. The
runs are interleaved (round 1: hplan, DDP equal, DDP split; round 2 starts one further on; ...)
because the machine is noisy. Throughput is the global batch over the spacing of rank 0's
step ends after ``--warmup`` steps (every per-step overhead included). Printed per case:
samples/s of each run, the ratios hplan/DDP (median and range over rounds), the plan's
predicted samples/s against hplan's measured, the median per-rank breakdown of hplan's
step from its own metrics (compute, wait, point-to-point, all-reduce, optimizer, other), and
each rank's CPU milliseconds per step in hplan's and in DDP split's last runs (under a CPU
quota a node's speed is its CPU time over its quota, so this is where their work differs).

    python bench/real_cluster.py [--models mlp,gpt] [--rounds 3] [--steps 30]
        [--cases hetero,homogeneous] [--calibrate] [--keep DIR]

``--calibrate``: before the rounds, hplan's plan runs once, ``hplan calibrate`` reads that run
(compute and all-reduce) and the case is solved again with ``--previous`` (the first plan
stays unless the calibrated model predicts another faster); the rounds run the calibrated
plan (the issue's "after at most one calibration"), and the first run's measured and
predicted samples/s are printed too.
``--pin`` (the default; ``--no-pin`` to turn it off): where the quotas pack onto this
machine's cores (``netns_cluster.pack_cores``: 0.9 / 0.45 / 0.45 on two cores does, 0.6 / 0.6
/ 0.6 does not), each node also runs on cores of its own (cgroup v1 cpuset), as the machines
of a cluster do; the report says which cases ran pinned.
Needs root, iproute2 and cgroup v1's cpu controller; prints one line and exits 0 where they
are missing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cluster_runs import (
    BREAKDOWN,
    DDP,
    Model,
    breakdown,
    clean_env,
    cluster_yaml,
    equal_split,
    hplan_cli,
    measure_links,
    profile_nodes,
    proportional_split,
    rank0_ends,
    ratio_text,
    run_ddp,
    run_launch_scripts,
    throughput,
    wait_all,
)
from common import GPT, ROOT, console, gpt_env, table
from netns_cluster import CGROUP_CPUSET, NamespaceCluster, NodeShape, available, pack_cores

from hplan.runtime.contract.metrics_file import StepMetrics
from hplan.runtime.contract.plan import Plan

MLP = ROOT / "examples" / "mlp" / "model.py"
PORT = 29651
"""hplan's rendezvous port; DDP's is one above, hplan bandwidth's two above."""
RATE_MBIT_PER_S = 10_000
WARMUP = 3
"""Default for --warmup: steps left out of the throughput."""

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
    cpu_ms: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Rank -> (hplan, DDP split) median CPU milliseconds per step, last round."""
    cores: tuple[tuple[int, ...] | None, ...] = ()
    """Each node's cores (None: unpinned)."""
    shares: list[str] = field(default_factory=list)
    """Each hplan round's batch shares per rank, first step -> last (the runtime moves
    them as the ranks' measured speeds ask, ``executor/control/rebalance.py``)."""


def node_shapes(quotas: Sequence[float], pin: bool) -> list[NodeShape]:
    """The case's nodes, pinned to cores of their own where ``pin`` and the quotas pack."""
    cores: list[tuple[int, ...] | None] = [None] * len(quotas)
    if pin and CGROUP_CPUSET.exists():
        cores = pack_cores(quotas, sorted(os.sched_getaffinity(0)))
    return [
        NodeShape(name, quota, RATE_MBIT_PER_S, where)
        for name, quota, where in zip(NODE_NAMES, quotas, cores, strict=False)
    ]


def speed_split(
    cluster: NamespaceCluster, model: Model, steps: int, warmup: int, work: Path
) -> tuple[int, ...]:
    """The global batch split in proportion to each node's samples/s, measured with every
    node training the model alone on an equal share at the same time (so that what the
    nodes take from each other's caches and memory bandwidth counts): the best split a user
    could give DDP by hand."""
    equal = equal_split(model.global_batch, len(cluster.nodes))
    procs, logs = [], []
    for i, size in enumerate(equal):
        env = clean_env({**model.env, "OMP_NUM_THREADS": "1"})
        log = work / f"solo-{i}.log"
        argv = [sys.executable, str(DDP), str(model.path), "--solo", "--batch-sizes", str(size),
                "--steps", str(steps), "--out", str(work / f"solo-{i}.json")]  # fmt: skip
        procs.append(cluster.start(i, argv, log=log, env=env, cwd=work))
        logs.append(log)
    wait_all(cluster, procs, logs, "solo speed runs")
    speeds = []
    for i, size in enumerate(equal):
        ends = json.loads((work / f"solo-{i}.json").read_text())["end_unix_time_s"]
        speeds.append(throughput(ends, size, warmup))
    return proportional_split(model.global_batch, speeds)


def run_hplan(
    cluster: NamespaceCluster, plan_dir: Path, model: Model, args: argparse.Namespace,
    work: Path, tag: str,
) -> tuple[float, dict[int, list[StepMetrics]]]:  # fmt: skip
    """Run the plan's launch scripts; samples/s and every rank's metrics."""
    records = run_launch_scripts(cluster, plan_dir, model, args.steps, work, tag)
    return throughput(rank0_ends(records), model.global_batch, args.warmup), records


def ddp_samples_per_s(
    cluster: NamespaceCluster, sizes: Sequence[int], model: Model, args: argparse.Namespace,
    work: Path, tag: str,
) -> float:  # fmt: skip
    """torch DDP with ``sizes[i]`` samples per step on node ``i``; samples/s. A run that
    fails is run once more, and says so: one of the torch DDP reference's ranks once
    aborted inside torch (``terminate called without an active exception``) and ended a
    half-hour benchmark."""
    try:
        run = run_ddp(cluster, sizes, model, args.steps, work, tag, port=PORT + 1)
    except SystemExit as failure:
        console.print(f"  DDP run {tag} failed, running it once more: {str(failure)[-300:]}")
        run = run_ddp(cluster, sizes, model, args.steps, work, f"{tag}-again", port=PORT + 1)
    return throughput(run.end_unix_time_s, model.global_batch, args.warmup)


def run_case(case: Case, args: argparse.Namespace, work: Path) -> None:
    model, quotas = case.model, case.quotas
    nodes = node_shapes(quotas, args.pin)
    case.cores = tuple(n.cores for n in nodes)
    with NamespaceCluster(nodes, tag="hprc", subnet=214) as cluster:
        cluster_file = work / "cluster.yaml"
        cluster_file.write_text(cluster_yaml(cluster, "real-cluster", RATE_MBIT_PER_S))
        console.print(f"[bold]{model.name}[/] quotas {quotas}: profiling each node")
        profiles = profile_nodes(cluster, model, work)
        console.print("  measuring the links (hplan bandwidth)")
        links = measure_links(cluster, cluster_file, work, PORT + 2)
        case.split = speed_split(cluster, model, args.steps, args.warmup, work)
        plan_dir = work / "plan"
        env = clean_env(model.env)
        solve = ["solve", str(model.path), "-c", str(cluster_file), "--profile", str(profiles),
                 "-b", str(model.global_batch), "-o", str(plan_dir), "--master-port", str(PORT),
                 "--bandwidth", str(links), "--sync", "all_reduce"]  # fmt: skip
        # --sync all_reduce: DDP's training, a sum of every gradient every step; under
        # --sync auto a calibrated plan took local SGD (H=3) here, which trains otherwise
        hplan_cli(*solve, env=env)
        if args.calibrate:  # one real run, calibrate, solve again: the rounds run that plan
            console.print("  first run, to calibrate")
            case.first_plan_text = _plan_text(Plan.load(plan_dir / "plan.json"))
            first, _ = run_hplan(cluster, plan_dir, model, args, work, "first")
            case.first = (first, Plan.load(plan_dir / "plan.json").report.predicted_samples_per_s)
            calibrated, first_plan = work / "calibrated", work / "plan-first.json"
            shutil.copyfile(plan_dir / "plan.json", first_plan)
            hplan_cli("calibrate", str(first_plan), str(work / "metrics-first"),
                      "--profile", str(profiles), "-o", str(calibrated), env=env)  # fmt: skip
            # the measured plan stays unless the calibrated model predicts another faster
            hplan_cli(*solve[:5], str(calibrated), *solve[6:], "--previous", str(first_plan),
                      env=env)  # fmt: skip
        equal = equal_split(model.global_batch, len(nodes))
        runs = ["hplan", "ddp equal", "ddp split"]
        for r in range(args.rounds):
            order = runs[r % 3 :] + runs[: r % 3]
            for run in order:
                console.print(f"  round {r + 1}: {run}")
                if run == "hplan":
                    value, records = run_hplan(cluster, plan_dir, model, args, work, f"r{r}")
                    case.breakdown = breakdown(records, args.warmup)
                    case.shares.append(_shares_text(records))
                elif run == "ddp equal":
                    value = ddp_samples_per_s(cluster, equal, model, args, work, f"e{r}")
                else:
                    value = ddp_samples_per_s(cluster, case.split, model, args, work, f"s{r}")
                case.samples_per_s.setdefault(run, []).append(value)
        if args.rounds:
            last = work / f"ddp-s{args.rounds - 1}.json"
            if (again := work / f"ddp-s{args.rounds - 1}-again.json").exists():
                last = again  # the first try failed (``ddp_samples_per_s``)
            case.cpu_ms = _cpu_ms(records, last, args.warmup)  # the last round's hplan run
        plan = Plan.load(plan_dir / "plan.json")
        case.predicted_samples_per_s = plan.report.predicted_samples_per_s
        case.plan_text = _plan_text(plan)


def _cpu_ms(
    records: dict[int, list[StepMetrics]], ddp_out: Path, warmup: int
) -> dict[int, tuple[float, float]]:
    """Per rank, the median CPU milliseconds of a step of hplan (``records``, the round's
    run) and of DDP (``ddp_out``'s per-rank files), after ``warmup`` steps."""
    out = {}
    for rank, steps in sorted(records.items()):
        ddp = json.loads(ddp_out.with_suffix(f".rank{rank}.json").read_text())["cpu_s"]
        hplan_ms = statistics.median(s.cpu_time_s for s in steps[warmup:]) * 1e3
        out[rank] = (hplan_ms, statistics.median(ddp[warmup:]) * 1e3)
    return out


def _plan_text(plan: Plan) -> str:
    return ", ".join(
        f"r{rp.rank} {rp.node} stage {rp.stage} {rp.micro_batch_size}x{rp.num_microbatches}"
        for rp in plan.ranks
    )


def _shares_text(records: dict[int, list[StepMetrics]]) -> str:
    """``50|23|23 -> 51|22|23``: every rank's samples at its first and last step."""
    ranks = sorted(records)
    first = "|".join(str(records[r][0].samples) for r in ranks)
    last = "|".join(str(records[r][-1].samples) for r in ranks)
    return first if first == last else f"{first} -> {last}"


def _cores_text(cores: Sequence[tuple[int, ...] | None]) -> str:
    """`` cores 0/1/1`` for pinned nodes, nothing for unpinned ones."""
    if not cores or any(c is None for c in cores):
        return ""
    return " cores " + "/".join(",".join(map(str, c)) for c in cores if c is not None)


def report(cases: Sequence[Case]) -> None:
    out = table("hplan vs torch DDP, real namespace cluster (median of rounds, range)",
                ["case", "hplan samples/s", "DDP equal", "DDP split", "split",
                 "hplan/DDP equal", "hplan/DDP split", "measured/predicted"])  # fmt: skip
    for c in cases:
        s = c.samples_per_s
        hplan = statistics.median(s["hplan"])
        out.add_row(
            f"{c.model.name} {'/'.join(f'{q:g}' for q in c.quotas)}{_cores_text(c.cores)}",
            f"{hplan:.0f}",
            f"{statistics.median(s['ddp equal']):.0f}",
            f"{statistics.median(s['ddp split']):.0f}",
            ":".join(map(str, c.split)),
            ratio_text(s["hplan"], s["ddp equal"]),
            ratio_text(s["hplan"], s["ddp split"]),
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
        if c.shares:
            console.print(f"  samples a rank in each round: {'; '.join(c.shares)}")
        parts = table("hplan step breakdown, ms (median per rank, last round)",
                      ["rank", "step", *BREAKDOWN])  # fmt: skip
        for rank, row in c.breakdown.items():
            parts.add_row(str(rank), *(f"{row[k]:.1f}" for k in ("step", *BREAKDOWN)))
        console.print(parts)
        if c.cpu_ms:
            cpu = table("CPU ms per step (median per rank, last round)",
                        ["rank", "hplan", "DDP split"])  # fmt: skip
            for rank, (hplan_ms, ddp_ms) in c.cpu_ms.items():
                cpu.add_row(str(rank), f"{hplan_ms:.1f}", f"{ddp_ms:.1f}")
            console.print(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(
        description="hplan against torch DDP on a heterogeneous cluster of network namespaces "
        "with CPU quotas and shaped links, built on this machine (needs root).",
        epilog="Each case: every node profiled in its quota, hplan's plan solved and run with "
        "its generated launch scripts, against DDP with equal batches and with batches split by "
        "measured speed, in interleaved rounds.",
    )
    parser.add_argument(
        "--models",
        default="mlp,gpt",
        help=f"comma-separated, of {', '.join(MODELS)} (default: %(default)s)",
    )
    parser.add_argument(
        "--cases",
        default="hetero,homogeneous",
        help="comma-separated: hetero (quotas 0.9/0.45/0.45 cores), homogeneous "
        "(0.6/0.6/0.6) (default: %(default)s)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds of hplan, DDP equal and DDP split (default: 3)",
    )
    parser.add_argument("--steps", type=int, default=30, help="steps of each run (default: 30)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=WARMUP,
        help=f"steps left out of each run's samples/s (default: {WARMUP})",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="run hplan's plan once, `hplan calibrate` it and solve again first",
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run each node on cores of its own where the quotas pack (default: on)",
    )
    parser.add_argument("--keep", type=Path, help="keep the work folder here")
    args = parser.parse_args()
    for option, given, valid in (("--models", args.models, MODELS), ("--cases", args.cases, CASES)):
        unknown = [name for name in given.split(",") if name not in valid]
        if unknown:
            parser.error(f"{option}: unknown {unknown[0]!r}; valid: {', '.join(valid)}")
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
