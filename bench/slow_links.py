"""hplan's cross-island sync modes against synchronous all-reduce and DDP on slow links.

Issue 12, measured from outside on real shaped links.

Two islands on this machine (``netns_cluster.py``), one network namespace per node, one
``cpu`` device per node, each node's CPU capped by a cgroup-v1 quota. ``--layout 1+1`` (the
default): one node per island (``a0``, ``b0``), both veths shaped by ``tc tbf`` at the case's
rate, so each direction between the islands crosses two tbfs of that rate in series (one
link of that rate). ``--layout 2+1``: island a has two nodes shaped at 10 Gbit/s and island
b one node at the case's rate, so only the traffic between the islands is slow (and a0 and
a1 share b0's rate, as nodes behind one slow uplink do). Per rate, hplan's real flow as a
user runs it (``cluster_runs.py``): ``hplan profile --node`` in each namespace (once, the
quotas do not change with the rate), ``hplan bandwidth``'s scripts, ``hplan solve --profile
--bandwidth --sync MODE`` for ``all_reduce`` and every mode of ``--modes`` (``auto``: the
planner's choice), then the generated launch scripts in each namespace for ``--steps``
optimizer steps, and torch DDP (``ddp_reference.py``) with the all_reduce plan's batch split
and an equal one, for the same steps: the same samples, seed and data order (hplan's). The
runs of a rate are interleaved (round 2 starts one further on) because the machine is noisy.

Printed per rate: samples/s of each run (global batch over the spacing of rank 0's step ends
after ``--warmup`` steps, ``end_unix_time_s``; with ``--steps`` and ``--warmup`` multiples of
H the window is whole rounds of H steps); the ratios to hplan's all_reduce plan and to DDP with
the plan's split (median and range over rounds); the mode and H each plan says
(``holders.sync_summary``); the loss after N = steps x global batch samples and its ratio to
all_reduce's. The loss is the job loss of the metrics (each step's global batch mean loss,
the replicas' losses weighted by their samples, as ``hplan metrics`` computes it) averaged
over ``--loss-steps`` steps: the last ones for synchronous runs; for a ``local_sgd`` plan of
one fragment per group, the last round-starting steps (step s with s % H == 0, whose forward
runs on the parameters the outer step just synced), so that it is the synced parameters'
loss; otherwise (async, several fragments) the last steps on each island's own parameters.
Every ratio compares the same steps, so the same batches.

``--max-stages 1`` (the default) keeps the plans data parallel, the layout the sync modes are
for; the planner may still leave an island idle when syncing with it costs more than it
brings (at 100 Mbit/s its synchronous plan trains on one node: "x DDP" is then the figure
against synchronous all-reduce across both islands).

    python bench/slow_links.py [--rates 1000,100,20] [--modes auto,local_sgd,async]
        [--steps 48] [--warmup 8] [--rounds 2] [--json PATH] [--keep DIR]

Needs root, iproute2 and cgroup v1's cpu controller; prints one line and exits 0 where they
are missing. A ``hplan solve`` without ``--sync`` (before the planner's sync modes) is said in
one line and the run goes on with all_reduce (solved without ``--sync``) and DDP.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

from cluster_runs import (
    Model,
    breakdown,
    clean_env,
    cluster_yaml,
    equal_split,
    hplan_proc,
    job_losses,
    last_line,
    measure_links,
    median_range,
    profile_nodes,
    rank0_ends,
    run_ddp,
    run_launch_scripts,
    throughput,
)
from common import GPT, console, gpt_env, table
from netns_cluster import NamespaceCluster, NodeShape, available

from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.contract.holders import outer_groups, sync_summary
from hplan.runtime.contract.plan import Plan, SyncMode

MODEL = Model("GPT example", GPT, gpt_env(layers=4, width=256, heads=4, seq=64), 32)
"""3.24 M parameters, 12.97 MB of float32 gradients a step: 1.04 s each way at 100 Mbit/s
against about 0.2 s of compute for 16 samples on 0.9 core."""
PORT = 29661
"""hplan's rendezvous port; DDP's is one above, hplan bandwidth's two above."""
FAST_MBIT_PER_S = 10_000.0
"""The links inside an island (``--layout 2+1``)."""
MODES = ("all_reduce", "auto", "local_sgd", "async")
LAYOUTS = {"1+1": (1, 1), "2+1": (2, 1)}


def island_nodes(layout: str) -> tuple[tuple[str, ...], ...]:
    """Node names per island: ``2+1`` -> ``(("a0", "a1"), ("b0",))``."""
    return tuple(
        tuple(f"{chr(ord('a') + i)}{j}" for j in range(count))
        for i, count in enumerate(LAYOUTS[layout])
    )


def node_shapes(
    islands: Sequence[Sequence[str]], rate_mbit_per_s: float, cpu_cores: float
) -> list[NodeShape]:
    """Every node's quota and link: nodes of the island with several nodes at
    ``FAST_MBIT_PER_S``, the others at the case's rate (tbf shapes a node's traffic to every
    peer alike, so at most one island may have several nodes)."""
    return [
        NodeShape(name, cpu_cores, FAST_MBIT_PER_S if len(nodes) > 1 else rate_mbit_per_s)
        for nodes in islands
        for name in nodes
    ]


def intra_island_pairs(islands: Sequence[Sequence[str]]) -> dict[tuple[str, str], float]:
    """cluster.yaml's pair links inside islands (every other pair is the slow rate)."""
    return {
        (a, b): FAST_MBIT_PER_S
        for nodes in islands
        for i, a in enumerate(nodes)
        for b in nodes[i + 1 :]
    }


def gradient_bytes(model: Model) -> tuple[int, int]:
    """The model's trainable parameters and their gradients' bytes (a tied one once): what
    a synchronous all-reduce sums every step."""
    with mock.patch.dict(os.environ, model.env):
        params = [
            p for p in load_model_file(model.path).build_model().parameters() if p.requires_grad
        ]
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def solve_has_sync(env: dict[str, str]) -> bool:
    """Whether this ``hplan solve`` takes ``--sync`` (the planner's sync modes)."""
    return (
        re.search(r"^\s*--sync\b(?!-)", hplan_proc("solve", "--help", env=env).stdout, re.M)
        is not None
    )


def plan_split(plan: Plan, names: Sequence[str]) -> tuple[int, ...] | None:
    """Samples per node when every node runs one data-parallel replica (DDP's layout), in
    ``names`` order; None for any other layout (a pipeline, several ranks on a node)."""
    by_node = {r.node: r for r in plan.ranks if r.stage == 0}
    if len(plan.ranks) != len(names) or set(by_node) != set(names):
        return None
    return tuple(by_node[name].num_samples for name in names)


def synced_steps(plan: Plan, num_steps: int) -> list[int] | None:
    """Steps whose forward runs on parameters that every island holds alike: every step of a
    synchronous plan; with ``local_sgd`` of one H and one fragment per group, the steps
    ``s % H == 0`` (the outer step ends step ``s - 1``); None otherwise (async, fragments)."""
    local = [g for g in outer_groups(plan).values() if g.mode is not SyncMode.ALL_REDUCE]
    if not local:
        return list(range(num_steps))
    horizons = {g.local_steps for g in local}
    one_shot = all(g.mode is SyncMode.LOCAL_SGD and g.num_fragments == 1 for g in local)
    if not one_shot or len(horizons) != 1:
        return None
    (h,) = horizons
    return list(range(0, num_steps, h))


def loss_window(plan: Plan | None, num_steps: int, count: int) -> tuple[list[int], str]:
    """The steps a run's final loss averages (module docstring), and how to say so."""
    synced = list(range(num_steps)) if plan is None else synced_steps(plan, num_steps)
    if synced is None:
        return list(range(num_steps))[-count:], f"last {count} steps, islands' own parameters"
    if len(synced) < num_steps:
        return synced[-count:], f"{min(count, len(synced))} round starts, synced parameters"
    return synced[-count:], f"last {count} steps"


def mean_loss(losses: Sequence[float | None], steps: Sequence[int]) -> float:
    """Mean of ``losses`` over ``steps`` (NaN where one is unknown)."""
    values = [losses[s] for s in steps]
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if len(known) == len(values) else float("nan")


@dataclass
class Run:
    """One hplan plan or one DDP split, measured once per round."""

    label: str
    plan_dir: Path | None = None
    """hplan: the plan's folder (its launch scripts); None: DDP."""
    plan: Plan | None = None
    sizes: tuple[int, ...] = ()
    """DDP: samples per node."""
    sync: str = SyncMode.ALL_REDUCE.value
    window: list[int] = field(default_factory=list)
    window_text: str = ""
    samples_per_s: list[float] = field(default_factory=list)
    losses: list[list[float | None]] = field(default_factory=list)
    """Per round, the job loss of every step."""
    breakdown: dict[int, dict[str, float]] = field(default_factory=dict)
    """hplan: median ms per part of the step, per rank, last round."""
    notes: list[str] = field(default_factory=list)


@dataclass
class RateResult:
    rate_mbit_per_s: float
    runs: list[Run]


def solve_modes(
    modes: Sequence[str], solve: list[str], with_sync: bool, work: Path, args: argparse.Namespace
) -> list[Run]:
    """Solve once per mode (``all_reduce`` first); a mode whose plan is the same as an
    earlier one's joins that run's label. A mode ``hplan solve`` refuses is one line."""
    runs: list[Run] = []
    plans: list[Plan] = []
    env = clean_env(MODEL.env)
    for mode in modes:
        plan_dir = work / f"plan-{mode}"
        flags = ["--sync", mode] if with_sync else []
        if with_sync and mode != "all_reduce" and args.max_local_steps is not None:
            flags += ["--max-local-steps", str(args.max_local_steps)]
        proc = hplan_proc(*solve, "-o", str(plan_dir), *flags, env=env)
        if proc.returncode != 0:
            console.print(
                f"slow_links: hplan solve --sync {mode} failed, skipped: {last_line(proc)}"
            )
            continue
        plan = Plan.load(plan_dir / "plan.json")
        same = [i for i, p in enumerate(plans) if _what_runs(p) == _what_runs(plan)]
        if same:
            runs[same[0]].label += f" = {mode}"
            continue
        plans.append(plan)
        window, text = loss_window(plan, args.steps, args.loss_steps)
        notes = [c.reason for c in plan.report.sync_choices] + [_ranks_text(plan)]
        notes += [f"{d.device} idle: {d.reason}" for d in plan.report.idle_devices]
        runs.append(
            Run(
                f"hplan {mode}",
                plan_dir,
                plan,
                sync=sync_summary(plan),
                window=window,
                window_text=text,
                notes=notes,
            )
        )
    return runs


def _what_runs(plan: Plan) -> tuple[object, ...]:
    """The plan less its report: two plans equal here train the same way."""
    return (plan.units, plan.cuts, plan.ranks, plan.training, plan.global_batch_size)


def _ranks_text(plan: Plan) -> str:
    return ", ".join(
        f"r{r.rank} {r.node} stage {r.stage} {r.micro_batch_size}x{r.num_microbatches}"
        for r in plan.ranks
    )


def _horizon_note(runs: Sequence[Run], args: argparse.Namespace) -> None:
    """Say when --steps or --warmup is not whole rounds of a plan's H."""
    for run in runs:
        horizons = {g.local_steps for g in outer_groups(run.plan).values()} if run.plan else set()
        for h in sorted(horizons - {1}):
            if args.steps % h or args.warmup % h:
                console.print(
                    f"  note: {run.label}: H={h} does not divide --steps {args.steps} "
                    f"and --warmup {args.warmup}; samples/s is not over whole rounds"
                )


def measure_rate(
    rate: float, args: argparse.Namespace, root: Path, profiles: Path | None
) -> tuple[RateResult, Path]:
    """Everything of one rate: links, plans, rounds. Returns the result and the profiles'
    folder (profiled in the first rate's cluster, reused after)."""
    work = root / f"rate-{rate:g}"
    work.mkdir(parents=True, exist_ok=True)
    islands = island_nodes(args.layout)
    names = [n for nodes in islands for n in nodes]
    cpu = args.cpu_cores or min(0.9, 1.8 / len(names))
    with NamespaceCluster(node_shapes(islands, rate, cpu), tag="hpsl", subnet=215) as cluster:
        cluster_file = work / "cluster.yaml"
        text = cluster_yaml(cluster, "slow-links", rate, intra_island_pairs(islands))
        cluster_file.write_text(text)
        console.print(
            f"[bold]{rate:g} Mbit/s[/] between islands {' | '.join(map(' '.join, islands))}"
        )
        if profiles is None:
            console.print(f"  profiling each node ({cpu:g} core)")
            profiles = profile_nodes(cluster, MODEL, root)
        console.print("  measuring the links (hplan bandwidth)")
        links = measure_links(cluster, cluster_file, work, PORT + 2)
        solve = ["solve", str(MODEL.path), "-c", str(cluster_file), "-b", str(MODEL.global_batch)]
        solve += ["--profile", str(profiles), "--bandwidth", str(links), "--master-port", str(PORT)]
        solve += ["--max-stages", str(args.max_stages), "--seed", str(args.seed)]
        runs = solve_modes(args.modes, solve, args.with_sync, work, args)
        if not runs:
            raise SystemExit("slow_links: no mode could be solved")
        _horizon_note(runs, args)
        baseline = runs[0].plan
        assert baseline is not None
        result = RateResult(rate, runs)
        window, text = loss_window(None, args.steps, args.loss_steps)
        splits = [plan_split(baseline, names), equal_split(MODEL.global_batch, len(names))]
        for sizes in dict.fromkeys(s for s in splits if s is not None):
            runs.append(
                Run(
                    f"DDP {':'.join(map(str, sizes))}", sizes=sizes, window=window, window_text=text
                )
            )
        for r in range(args.rounds):
            for run in runs[r % len(runs) :] + runs[: r % len(runs)]:
                console.print(f"  round {r + 1}: {run.label}")
                _measure(cluster, run, args, work, f"{r}")
    return result, profiles


def _measure(
    cluster: NamespaceCluster, run: Run, args: argparse.Namespace, work: Path, tag: str
) -> None:
    """One round of one run: its samples/s and its job loss per step."""
    if run.plan_dir is not None:
        records = run_launch_scripts(
            cluster, run.plan_dir, MODEL, args.steps, work, f"{run.plan_dir.name}-r{tag}"
        )
        ends, losses = rank0_ends(records), job_losses(records)
        run.breakdown = breakdown(records, args.warmup)
    else:
        name = f"{'-'.join(map(str, run.sizes))}-r{tag}"
        ddp = run_ddp(
            cluster, run.sizes, MODEL, args.steps, work, name, port=PORT + 1, seed=args.seed
        )
        ends, losses = ddp.end_unix_time_s, list(ddp.losses)
    # the end of step warmup - 1 opens the window: whole rounds when H divides both
    run.samples_per_s.append(throughput(ends, MODEL.global_batch, args.warmup - 1))
    run.losses.append(losses)


def _ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    return [a / b for a, b in zip(num, den, strict=True)]


def rows(result: RateResult) -> list[dict[str, object]]:
    """The table's and the JSON's figures of one rate, one dict per run."""
    base = result.runs[0]
    ddp = next((r for r in result.runs if r.plan_dir is None), None)
    out = []
    for run in result.runs:
        loss = [mean_loss(lo, run.window) for lo in run.losses]
        base_loss = [mean_loss(lo, run.window) for lo in base.losses]
        out.append(
            {
                "run": run.label,
                "sync": run.sync,
                "samples_per_s": run.samples_per_s,
                "vs_all_reduce": _ratios(run.samples_per_s, base.samples_per_s),
                "vs_ddp": _ratios(run.samples_per_s, ddp.samples_per_s) if ddp else [],
                "loss": loss,
                "loss_vs_all_reduce": _ratios(loss, base_loss),
                "loss_steps": run.window,
                "loss_window": run.window_text,
                "breakdown_ms": run.breakdown,
                "notes": run.notes,
            }
        )
    return out


COLUMNS = (
    "Mbit/s",
    "run",
    "sync",
    "samples/s",
    "x all_reduce",
    "x DDP",
    "loss",
    "loss / all_reduce",
    "loss over",
)


def _table_row(rate: float, row: dict) -> list[str]:
    vs_ddp = median_range(row["vs_ddp"], "x") if row["vs_ddp"] else "-"
    return [
        f"{rate:g}",
        row["run"],
        row["sync"],
        median_range(row["samples_per_s"], "", 1),
        median_range(row["vs_all_reduce"], "x"),
        vs_ddp,
        median_range(row["loss"], "", 4),
        median_range(row["loss_vs_all_reduce"], "", 4),
        row["loss_window"],
    ]


def report(results: Sequence[RateResult], args: argparse.Namespace) -> None:
    """The table, the plans' lines and the JSON line."""
    samples = args.steps * MODEL.global_batch
    title = (
        f"Slow links: {MODEL.name}, N = {args.steps} steps x {MODEL.global_batch} = "
        f"{samples} samples, seed {args.seed}, {args.rounds} rounds (median, range)"
    )
    out = table(title, list(COLUMNS))
    for result in results:
        for row in rows(result):
            out.add_row(*_table_row(result.rate_mbit_per_s, row))
    console.print(out)
    num_params, num_bytes = gradient_bytes(MODEL)
    console.print(
        f"{MODEL.name} ({', '.join(f'{k}={v}' for k, v in MODEL.env.items())}): "
        f"{num_params / 1e6:.2f} M parameters, {num_bytes / 1e6:.2f} MB of gradients "
        "a synchronous step all-reduces"
    )
    for result in results:
        console.print(f"[bold]{result.rate_mbit_per_s:g} Mbit/s[/]")
        for run in result.runs:
            for note in run.notes:
                console.print(f"  {run.label}: {note}")
    if args.json is None:
        return
    record = {
        "benchmark": "slow_links",
        "model": MODEL.name,
        "model_env": MODEL.env,
        "num_params": num_params,
        "gradient_bytes": num_bytes,
        "global_batch": MODEL.global_batch,
        "steps": args.steps,
        "samples": samples,
        "seed": args.seed,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "layout": args.layout,
        "max_stages": args.max_stages,
        "sync_option": args.with_sync,
        "rates": [{"rate_mbit_per_s": r.rate_mbit_per_s, "runs": rows(r)} for r in results],
    }
    args.json.write_text(json.dumps(record) + "\n")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1000,100,20", help="Mbit/s between the islands")
    parser.add_argument(
        "--modes",
        default="auto,local_sgd,async",
        help=f"hplan solve --sync values, of {', '.join(MODES)} "
        "(all_reduce, the reference, always runs)",
    )
    parser.add_argument("--max-local-steps", type=int, help="hplan solve --max-local-steps")
    parser.add_argument(
        "--max-stages",
        type=int,
        default=1,
        help="hplan solve --max-stages (1: data parallel across the islands, "
        "what the sync modes are for)",
    )
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="1+1", help="nodes per island")
    parser.add_argument(
        "--cpu-cores", type=float, help="quota per node (default 1.8 / nodes, at most 0.9)"
    )
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--warmup", type=int, default=8, help="steps left out of samples/s")
    parser.add_argument("--loss-steps", type=int, default=4, help="steps the final loss averages")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results as one JSON line here")
    parser.add_argument("--keep", type=Path, help="keep the work folder here")
    args = parser.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)}; valid: {', '.join(MODES)}")
    args.modes = ["all_reduce", *dict.fromkeys(m for m in modes if m != "all_reduce")]
    if not 1 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 1 and below --steps")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    missing = available()
    if missing:
        print(f"slow_links: skipped: {missing}")
        return
    args.with_sync = solve_has_sync(clean_env({}))
    if not args.with_sync:
        dropped = [m for m in args.modes if m != "all_reduce"]
        print(
            "slow_links: this `hplan solve` has no --sync (the planner's sync modes are not "
            "in it): solving without it, measuring all_reduce and DDP only"
            + (f" ({', '.join(dropped)} left out)" if dropped else "")
        )
        args.modes = ["all_reduce"]
    root = args.keep or Path(tempfile.mkdtemp(prefix="hplan-slow-"))
    results, profiles = [], None
    try:
        for rate in args.rates:
            result, profiles = measure_rate(rate, args, root, profiles)
            results.append(result)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    report(results, args)


if __name__ == "__main__":
    main()
