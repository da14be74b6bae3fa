"""hplan's cross-island sync modes against synchronous training and torch DDP on slow links:
the time each takes to reach the loss that synchronous training reaches after N samples,
and its loss at N samples. Issues 12 and 38, measured from outside on real shaped links.

Islands on this machine (``netns_cluster.py``), one network namespace per node, one ``cpu``
device per node, each node's CPU capped by a cgroup-v1 quota. ``--layout 1+1+1`` (the
default) and ``1+1``: one node per island (``a0``, ``b0``, ``c0``), every veth shaped by
``tc tbf`` at the case's rate, so each direction between two islands crosses two tbfs of that
rate in series (one link of that rate). ``--layout 2+1``: island a has two nodes shaped at
10 Gbit/s and island b one node at the case's rate. hplan's real flow as a user runs it
(``cluster_runs.py``): ``hplan profile --node`` in each namespace, ``hplan bandwidth``'s
scripts per rate, ``hplan solve --sync S [--wire W]`` per mode, the generated launch scripts
in each namespace; torch DDP (``ddp_reference.py``) with the same seed and data order.

Per seed (``--seeds``; the seed goes into each plan's ``training.seed``):

- the reference: hplan's all-reduce plan trains N samples on fast links (10 Gbit/s: a
  synchronous run's losses do not depend on its links), once for every rate;
- DDP (the all-reduce plan's batch split and an equal one) and each plan that syncs every
  step: their steady samples/s over ``--window-steps`` steps on the shaped links; time to
  target = N / samples/s (measured over K steps, extrapolated: their losses are the
  reference's);
- each plan with an outer sync (local modes): N x (1 + ``--slack``) samples on the shaped
  links; time to target = the wall time until its loss first reaches the reference's at N
  (``time_to_target.py``: losses averaged over ``--loss-steps`` steps rounded up to whole
  rounds of the plan's H, the same steps for both).

Printed per rate, medians (and ranges) over seeds: samples/s, time to target, DDP's time over
it (the faster DDP split of the same seed), how many seeds reached the target, the loss at N
and its penalty against the reference's at equal samples (the same batches); the relative
spread of the reference's loss at N between two seeds; DDP's communication share of its step
(its step on the shaped links against on fast links: the comparison says little unless DDP
is communication-bound). The loss is the job loss of the metrics (each step's global batch
mean, the replicas weighted by their samples, as ``hplan metrics``), on each island's own
parameters for local modes.

    python bench/slow_links.py [--layout 1+1+1] [--rates 100,20] [--seeds 3]
        [--modes ddp,all_reduce,local_sgd/bfloat16,streaming,streaming/int8,streaming/int4,auto]
        [--samples 30720] [--slack 0.2] [--smoke] [--json PATH] [--keep DIR]

A mode is ``SYNC`` or ``SYNC/WIRE`` (``hplan solve --sync SYNC --wire WIRE``; ``SYNC``
alone leaves ``--wire`` to the planner), or ``ddp``.
A mode this ``hplan solve`` has no option value for is skipped with one line. Needs root,
iproute2 and cgroup v1's cpu controller; prints one line and exits 0 where they are missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from cluster_runs import (
    Model,
    breakdown,
    clean_env,
    cluster_yaml,
    equal_split,
    hplan_cli,
    hplan_proc,
    job_losses,
    last_line,
    measure_links,
    profile_nodes,
    rank0_ends,
    run_ddp,
    run_launch_scripts,
    throughput,
)
from common import GPT, console, gpt_env
from netns_cluster import NamespaceCluster, NodeShape, available
from slow_links_report import RateResult, Reference, Run, Trial, report

from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.contract.holders import outer_groups
from hplan.runtime.contract.plan import Plan, SyncMode

MODEL = Model("GPT example", GPT, gpt_env(layers=4, width=128, heads=4, seq=32), 24)
"""0.83 M parameters, 3.3 MB of float32 gradients a step: a ring all-reduce among three
nodes sends 4.4 MB from each, 0.35 s at 100 Mbit/s, against a DDP step of about 0.05 s on
fast links for 8 samples per 0.6-core node; N = 30,720 samples are 1,280 steps. With 16
samples per node DDP's step was only 69-80% communication at 100 Mbit/s (a row hiding every
sync at most 3.2-5.0x DDP), with 8 samples 89% (8.7x)."""
REFERENCE_SAMPLES_PER_S = 500.0
"""The reference's samples/s on fast links, three 0.6-core nodes (for the estimate printed
before anything runs; the reference's own rate replaces it once measured)."""
START_S = 20.0
"""A run's start-up and teardown (the launch script's check, torchrun, imports, rendezvous
inside 0.6-core quotas), for the estimate."""
SETUP_S = {"profile per node": 30.0, "links per rate": 110.0, "solve per mode": 5.0}
"""What the estimate adds for ``hplan profile``, ``hplan bandwidth`` and ``hplan solve``."""
STARTED_S = time.monotonic()
PORT = 29661
"""hplan's rendezvous port; DDP's is one above, hplan bandwidth's two above."""
FAST_MBIT_PER_S = 10_000.0
"""The links inside an island (``--layout 2+1``) and the reference's."""
SYNCS = ("all_reduce", "auto", "local_sgd", "streaming", "async")
WIRES = ("float32", "bfloat16", "int8", "int4")
DDP = "ddp"
DEFAULT_MODES = "ddp,all_reduce,local_sgd/bfloat16,streaming,streaming/int8,streaming/int4,auto"
"""``local_sgd/bfloat16`` is the blocking local SGD of before issue 38: its planner sent this
model's pseudo-gradients in bfloat16 at 100 and 20 Mbit/s (float32 needed H > 100), where
``--wire auto`` now picks int4."""
LAYOUTS = {"1+1+1": (1, 1, 1), "1+1": (1, 1), "2+1": (2, 1)}
SMOKE = {"samples": 960, "seeds": 1, "rates": "100", "window_steps": 6, "warmup": 2,
         "loss_steps": 4}  # fmt: skip
"""``--smoke``'s defaults (options given still win): 40 steps, one seed, 100 Mbit/s."""


@dataclass(frozen=True)
class Mode:
    """What one row runs: ``ddp``, or ``hplan solve --sync sync [--wire wire]``."""

    sync: str
    wire: str | None = None

    @property
    def label(self) -> str:
        return self.sync if self.wire is None else f"{self.sync}/{self.wire}"


def parse_mode(text: str) -> Mode:
    """``streaming/int8`` -> ``Mode("streaming", "int8")``.

    Raises:
        ValueError: an unknown sync mode or wire format, naming the valid ones.
    """
    sync, _, wire = text.partition("/")
    if sync != DDP and sync not in SYNCS:
        raise ValueError(f"unknown mode {sync!r}; valid: {DDP}, {', '.join(SYNCS)}")
    if wire and (sync == DDP or wire not in WIRES):
        raise ValueError(f"{text!r}: the wire is one of {', '.join(WIRES)}, after a sync mode")
    return Mode(sync, wire or None)


def solve_choices(env: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """The values ``hplan solve --help`` lists for ``--sync`` and ``--wire`` (an option it
    lacks is absent)."""
    text = hplan_proc("solve", "--help", env=env).stdout
    found = {}
    for option in ("--sync", "--wire"):
        match = re.search(rf"^\s*{option} \[([^\]]+)\]", text, re.M)
        if match:
            found[option] = tuple(match.group(1).split("|"))
    return found


def unsupported(mode: Mode, choices: Mapping[str, Sequence[str]]) -> str | None:
    """Why this ``hplan solve`` cannot solve ``mode`` (None: it can). ``all_reduce`` is
    solved without ``--sync`` where there is none."""
    if mode.sync == DDP or (mode.sync == "all_reduce" and "--sync" not in choices):
        return None
    if mode.sync not in choices.get("--sync", ()):
        return f"this `hplan solve` has no --sync {mode.sync}"
    if mode.wire is not None and mode.wire not in choices.get("--wire", ()):
        return f"this `hplan solve` has no --wire {mode.wire}"
    return None


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


def plan_split(plan: Plan, names: Sequence[str]) -> tuple[int, ...] | None:
    """Samples per node when every node runs one data-parallel replica (DDP's layout), in
    ``names`` order; None for any other layout (a pipeline, several ranks on a node)."""
    by_node = {r.node: r for r in plan.ranks if r.stage == 0}
    if len(plan.ranks) != len(names) or set(by_node) != set(names):
        return None
    return tuple(by_node[name].num_samples for name in names)


def sync_text(plan: Plan) -> str:
    """How the plan's cross-island groups sync, in a few words: ``local_sgd H=16 F=4
    overlap 2 int8`` (the parts that differ from one blocking float32 fragment)."""
    parts = set()
    for g in outer_groups(plan).values():
        if g.mode is SyncMode.ALL_REDUCE:
            continue
        words = [g.mode.value, f"H={g.local_steps}"]
        words += [f"F={g.num_fragments}"] if g.num_fragments > 1 else []
        words += [f"overlap {g.overlap_steps}"] if g.overlap_steps else []
        wire = g.wire_dtype.value
        words += [wire] if wire != "float32" else []
        parts.add(" ".join(words))
    return ", ".join(sorted(parts)) or SyncMode.ALL_REDUCE.value


@dataclass(frozen=True)
class Pace:
    """What an estimate assumes: the reference's step on fast links and a run's start-up
    and teardown (seconds)."""

    step_s: float
    start_s: float


def rate_estimate_s(
    args: argparse.Namespace,
    rate: float,
    rows: tuple[int, int],
    pace: Pace,
    *,
    gradient_bytes: int,
    num_nodes: int,
) -> float:
    """Seconds one rate's runs take, roughly: ``rows[0]`` local rows train
    N x (1 + slack) samples at the reference's pace, ``rows[1]`` synchronous rows (DDP
    included) a window whose every step also sends a ring all-reduce of ``gradient_bytes``
    at the rate (2 (k - 1) / k of them leave each of k nodes); ``start_s`` each."""
    num_local, num_synchronous = rows
    ring_bytes = 2 * (num_nodes - 1) / num_nodes * gradient_bytes
    comm_s = ring_bytes * 8 / (rate * 1e6)
    window = args.warmup + args.window_steps
    per_seed = num_local * (args.local_steps * pace.step_s + pace.start_s)
    per_seed += num_synchronous * (window * (pace.step_s + comm_s) + pace.start_s)
    return len(args.seed_list) * per_seed


def estimate_s(
    args: argparse.Namespace,
    rows: tuple[int, int],
    pace: Pace,
    *,
    gradient_bytes: int,
    num_nodes: int,
) -> float:
    """Seconds the whole measurement takes, roughly: the profiles, the reference per seed
    (and DDP's window on fast links once), and per rate the links, the solves
    (``SETUP_S``) and the runs (:func:`rate_estimate_s`)."""
    window = args.warmup + args.window_steps
    seconds = num_nodes * SETUP_S["profile per node"]
    setup_s = SETUP_S["links per rate"] + (rows[0] + 1) * SETUP_S["solve per mode"]
    seconds += len(args.rates) * setup_s
    seconds += len(args.seed_list) * (args.num_steps * pace.step_s + pace.start_s)
    seconds += window * pace.step_s + pace.start_s
    return seconds + sum(
        rate_estimate_s(args, rate, rows, pace, gradient_bytes=gradient_bytes, num_nodes=num_nodes)
        for rate in args.rates
    )


def say(text: str) -> None:
    """One progress line, after the minutes and seconds since the benchmark started."""
    minutes, seconds = divmod(int(time.monotonic() - STARTED_S), 60)
    console.print(f"{minutes:3d}:{seconds:02d} {text}")


def _row_counts(modes: Sequence[Mode]) -> tuple[int, int]:
    """Rows that train to N (every hplan mode but all_reduce) and rows that run a window
    (DDP's two splits, all_reduce), for the estimate."""
    synchronous = sum(2 if m.sync == DDP else 1 for m in modes if m.sync in (DDP, "all_reduce"))
    return len(modes) - sum(m.sync in (DDP, "all_reduce") for m in modes), synchronous


def seeded(plan_dir: Path, seed: int) -> Path:
    """A copy of the plan's folder whose plan trains under ``seed`` (``training.seed``: the
    model's initial values and the data order)."""
    out = plan_dir.with_name(f"{plan_dir.name}-seed{seed}")
    if out.exists():
        return out
    shutil.copytree(plan_dir, out)
    plan = Plan.load(plan_dir / "plan.json")
    training = dataclasses.replace(plan.training, seed=seed)
    (out / "plan.json").write_text(dataclasses.replace(plan, training=training).to_json())
    return out


def run_trial(
    cluster: NamespaceCluster,
    run: Run,
    seed: int,
    steps: int,
    work: Path,
    args: argparse.Namespace,
) -> Trial:
    """One run of ``steps`` steps under ``seed``: its losses, step ends and samples/s."""
    tag = f"{re.sub(r'[^A-Za-z0-9]+', '-', run.label)}-s{seed}"
    if run.plan_dir is not None:
        records = run_launch_scripts(
            cluster, seeded(run.plan_dir, seed), args.model, steps, work, tag
        )
        run.breakdown = breakdown(records, args.warmup)
        ends, losses = rank0_ends(records), job_losses(records)
        # the end of step warmup - 1 opens the window
        return Trial(losses, ends, throughput(ends, args.model.global_batch, args.warmup - 1))
    ddp = run_ddp(cluster, run.sizes, args.model, steps, work, tag, port=PORT + 1, seed=seed)
    ends = ddp.end_unix_time_s
    return Trial(list(ddp.losses), ends, throughput(ends, args.model.global_batch, args.warmup - 1))


def solve_flags(
    mode: Mode, choices: Mapping[str, Sequence[str]], args: argparse.Namespace
) -> list[str]:
    """``hplan solve``'s options for ``mode``."""
    flags = ["--sync", mode.sync] if "--sync" in choices else []
    flags += ["--wire", mode.wire] if mode.wire is not None else []
    if mode.sync != "all_reduce" and args.max_local_steps is not None:
        flags += ["--max-local-steps", str(args.max_local_steps)]
    return flags


def solve_modes(solve: Sequence[str], work: Path, args: argparse.Namespace) -> list[Run]:
    """Solve every hplan mode (``all_reduce`` first when asked); a mode whose plan is the
    same as an earlier one's joins that row's label. A mode ``hplan solve`` refuses is one
    line."""
    runs: list[Run] = []
    plans: list[Plan] = []
    env = clean_env(args.model.env)
    for mode in (m for m in args.modes if m.sync != DDP):
        plan_dir = work / f"plan-{mode.label.replace('/', '-')}"
        flags = solve_flags(mode, args.choices, args)
        proc = hplan_proc(*solve, "-o", str(plan_dir), *flags, env=env)
        if proc.returncode != 0:
            say(f"  hplan solve {' '.join(flags)} failed, skipped: {last_line(proc)}")
            continue
        plan = Plan.load(plan_dir / "plan.json")
        same = [i for i, p in enumerate(plans) if _what_runs(p) == _what_runs(plan)]
        if same:
            runs[same[0]].label += f" = {mode.label}"
            continue
        plans.append(plan)
        notes = [c.reason for c in plan.report.sync_choices] + [_ranks_text(plan)]
        notes += [f"{d.device} idle: {d.reason}" for d in plan.report.idle_devices]
        runs.append(Run(f"hplan {mode.label}", plan_dir, plan, sync=sync_text(plan), notes=notes))
    return runs


def _what_runs(plan: Plan) -> tuple[object, ...]:
    """The plan less its report: two plans equal here train the same way."""
    return (plan.units, plan.cuts, plan.ranks, plan.training, plan.global_batch_size)


def _ranks_text(plan: Plan) -> str:
    return ", ".join(
        f"r{r.rank} {r.node} stage {r.stage} {r.micro_batch_size}x{r.num_microbatches}"
        for r in plan.ranks
    )


def _solve_command(cluster_file: Path, profiles: Path, args: argparse.Namespace) -> list[str]:
    solve = [
        "solve",
        str(args.model.path),
        "-c",
        str(cluster_file),
        "-b",
        str(args.model.global_batch),
    ]
    solve += ["--profile", str(profiles), "--master-port", str(PORT)]
    return [*solve, "--max-stages", str(args.max_stages)]


def _cluster(rate: float, args: argparse.Namespace) -> NamespaceCluster:
    islands = island_nodes(args.layout)
    cpu = args.cpu_cores or min(0.9, 1.8 / sum(map(len, islands)))
    return NamespaceCluster(node_shapes(islands, rate, cpu), tag="hpsl", subnet=215)


def measure_reference(args: argparse.Namespace, root: Path) -> tuple[Reference, Path]:
    """Profile the nodes, then per seed: hplan's all-reduce plan for N samples and DDP's
    window, on fast links. Returns the reference and the profiles' folder."""
    work = root / "reference"
    work.mkdir(parents=True, exist_ok=True)
    with _cluster(FAST_MBIT_PER_S, args) as cluster:
        cluster_file = work / "cluster.yaml"
        cluster_file.write_text(cluster_yaml(cluster, "slow-links-fast", FAST_MBIT_PER_S))
        say(f"[bold]reference[/]: every link {FAST_MBIT_PER_S:g} Mbit/s")
        say("  profiling each node")
        profiles = profile_nodes(cluster, args.model, root)
        plan_dir = work / "plan-all_reduce"
        flags = solve_flags(Mode("all_reduce"), args.choices, args)
        command = [*_solve_command(cluster_file, profiles, args), "-o", str(plan_dir), *flags]
        hplan_cli(*command, env=clean_env(args.model.env))
        plan = Plan.load(plan_dir / "plan.json")
        reference = Reference(Run("reference", plan_dir, plan, sync=sync_text(plan)))
        ddp = Run("DDP", sizes=equal_split(args.model.global_batch, len(cluster.nodes)))
        for seed in args.seed_list:
            say(f"  seed {seed}: hplan all_reduce, {args.num_steps} steps")
            started = time.monotonic()
            trial = run_trial(cluster, reference.run, seed, args.num_steps, work, args)
            reference.run.trials[seed] = trial
            if len(reference.run.trials) > 1:
                continue
            args.pace = _pace(trial, time.monotonic() - started, args.global_batch)
            seconds = estimate_s(args, _row_counts(args.modes), args.pace, **_sizes(args))
            say(
                f"  the reference ran {trial.samples_per_s:.0f} samples/s after "
                f"{args.pace.start_s:.0f} s of start-up: about {seconds / 60:.0f} min in all"
            )
            say(f"  seed {seed}: {ddp.label}, {args.warmup + args.window_steps} steps")
            window = run_trial(cluster, ddp, seed, args.warmup + args.window_steps, work, args)
            reference.ddp_samples_per_s = window.samples_per_s
    return reference, profiles


def _pace(trial: Trial, wall_s: float, global_batch: int) -> Pace:
    """The pace a run of the reference showed: its steady step and the rest of its wall
    time (start-up, teardown)."""
    train_s = trial.ends[-1] - trial.ends[0]
    step_s = global_batch / trial.samples_per_s
    return Pace(step_s, max(0.0, wall_s - train_s - step_s))


def _sizes(args: argparse.Namespace) -> dict[str, int]:
    return {"gradient_bytes": args.gradient_bytes, "num_nodes": args.num_nodes}


def measure_rate(rate: float, args: argparse.Namespace, root: Path, profiles: Path) -> RateResult:
    """One rate: the links, the plans, then per seed every row (rotated per seed: the
    machine is noisy)."""
    work = root / f"rate-{rate:g}"
    work.mkdir(parents=True, exist_ok=True)
    islands = island_nodes(args.layout)
    names = [n for nodes in islands for n in nodes]
    with _cluster(rate, args) as cluster:
        cluster_file = work / "cluster.yaml"
        text = cluster_yaml(cluster, "slow-links", rate, intra_island_pairs(islands))
        cluster_file.write_text(text)
        say(f"[bold]{rate:g} Mbit/s[/] between islands {' | '.join(map(' '.join, islands))}")
        say("  measuring the links (hplan bandwidth)")
        links = measure_links(cluster, cluster_file, work, PORT + 2)
        solve = [*_solve_command(cluster_file, profiles, args), "--bandwidth", str(links)]
        runs = solve_modes(solve, work, args)
        rows = (sum(r.local for r in runs), len(runs) - sum(r.local for r in runs))
        if any(m.sync == DDP for m in args.modes):
            baseline = next((r.plan for r in runs if r.label.startswith("hplan all_reduce")), None)
            splits = [plan_split(baseline, names) if baseline else None]
            splits.append(equal_split(args.model.global_batch, len(names)))
            for sizes in dict.fromkeys(s for s in splits if s is not None):
                runs.append(Run(f"DDP {':'.join(map(str, sizes))}", sizes=sizes))
                rows = (rows[0], rows[1] + 1)
        seconds = rate_estimate_s(args, rate, rows, args.pace, **_sizes(args))
        say(f"  {rows[0]} local rows, {rows[1]} synchronous: about {seconds / 60:.0f} min")
        for i, seed in enumerate(args.seed_list):
            for run in runs[i % len(runs) :] + runs[: i % len(runs)]:
                steps = args.local_steps if run.local else args.warmup + args.window_steps
                say(f"  seed {seed}: {run.label} ({run.sync}), {steps} steps")
                run.trials[seed] = run_trial(cluster, run, seed, steps, work, args)
    return RateResult(rate, runs)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=list(LAYOUTS), default="1+1+1", help="nodes per island")
    parser.add_argument("--rates", default="100,20", help="Mbit/s between the islands")
    parser.add_argument(
        "--modes",
        default=DEFAULT_MODES,
        help=f"rows: {DDP} or SYNC[/WIRE], SYNC of {', '.join(SYNCS)}, WIRE of "
        f"{', '.join(WIRES)} (hplan solve --sync SYNC --wire WIRE)",
    )
    parser.add_argument("--samples", type=int, default=30_720, help="N, rounded up to whole steps")
    parser.add_argument(
        "--global-batch",
        type=int,
        default=MODEL.global_batch,
        help="samples per step (fewer: DDP more communication-bound, more steps to N)",
    )
    parser.add_argument(
        "--slack", type=float, default=0.2, help="local rows train N x (1 + slack) samples"
    )
    parser.add_argument("--seeds", type=int, default=3, help="how many seeds")
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument(
        "--loss-steps", type=int, default=16, help="steps a loss averages (whole rounds of H)"
    )
    parser.add_argument(
        "--window-steps", type=int, default=24, help="steps a synchronous row's samples/s spans"
    )
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of samples/s")
    parser.add_argument("--max-local-steps", type=int, help="hplan solve --max-local-steps")
    parser.add_argument(
        "--max-stages",
        type=int,
        default=1,
        help="hplan solve --max-stages (1: data parallel across the islands)",
    )
    parser.add_argument(
        "--cpu-cores", type=float, help="quota per node (default 1.8 / nodes, at most 0.9)"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a quick check that every row runs; defaults "
        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in SMOKE.items()),
    )
    parser.add_argument(
        "--outer",
        default="1,0",
        help="the model file's OUTER_LR,OUTER_MOMENTUM (default 1,0: plain averaging; "
        "0.7,0.9 is DiLoCo's, whose outer momentum costs loss at these H: "
        "bench/outer_step_quality.py)",
    )
    parser.add_argument("--json", type=Path, help="write the results as one JSON line here")
    parser.add_argument("--keep", type=Path, help="keep the work folder here")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    try:
        modes = [parse_mode(m) for m in args.modes.split(",") if m]
    except ValueError as exc:
        parser.error(f"--modes: {exc}")
    args.modes = list(dict.fromkeys(sorted(modes, key=lambda m: m.sync != "all_reduce")))
    outer_lr, _, outer_momentum = args.outer.partition(",")
    outer = {"HPLAN_GPT_OUTER_LR": outer_lr, "HPLAN_GPT_OUTER_MOMENTUM": outer_momentum or "0"}
    args.model = dataclasses.replace(
        MODEL, env={**MODEL.env, **outer}, global_batch=args.global_batch
    )
    args.num_steps = math.ceil(args.samples / args.global_batch)
    args.local_steps = math.ceil(args.num_steps * (1 + args.slack))
    args.seed_list = list(range(args.seed, args.seed + args.seeds))
    args.fast_mbit_per_s = FAST_MBIT_PER_S
    if args.warmup < 1 or args.window_steps < 2:
        parser.error("--warmup must be at least 1 and --window-steps at least 2")
    if not 1 <= args.loss_steps <= args.num_steps:
        parser.error(f"--loss-steps must be 1 to the {args.num_steps} steps of --samples")
    if args.global_batch < sum(LAYOUTS[args.layout]):
        parser.error(f"--global-batch must be at least one sample per node of {args.layout}")
    if args.seeds < 1 or args.slack < 0:
        parser.error("--seeds must be at least 1 and --slack at least 0")
    return args


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM ends the benchmark as an error does, so that the namespaces it made are
    removed (a background process ignores SIGINT)."""
    raise SystemExit(f"slow_links: stopped by signal {signum}")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    missing = available()
    if missing:
        print(f"slow_links: skipped: {missing}")
        return
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args.choices = solve_choices(clean_env({}))
    args.skipped = []
    for mode in list(args.modes):
        why = unsupported(mode, args.choices)
        if why is not None:
            args.skipped.append(f"{mode.label}: {why}")
            print(f"slow_links: {mode.label} skipped: {why}")
            args.modes.remove(mode)
    num_params, num_bytes = gradient_bytes(MODEL)
    args.gradient_bytes = num_bytes
    args.num_nodes = sum(LAYOUTS[args.layout])
    args.pace = Pace(args.global_batch / REFERENCE_SAMPLES_PER_S, START_S)
    seconds = estimate_s(args, _row_counts(args.modes), args.pace, **_sizes(args))
    console.print(
        f"slow_links: {args.layout} at {', '.join(f'{r:g}' for r in args.rates)} Mbit/s, "
        f"rows {', '.join(m.label for m in args.modes)}, {len(args.seed_list)} seeds, "
        f"N = {args.num_steps} steps x {args.global_batch}: about {seconds / 60:.0f} min "
        "in all (estimated)"
    )
    root = args.keep or Path(tempfile.mkdtemp(prefix="hplan-slow-"))
    try:
        reference, profiles = measure_reference(args, root)
        results = [measure_rate(rate, args, root, profiles) for rate in args.rates]
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    model = {
        "name": MODEL.name,
        "env": args.model.env,
        "num_params": num_params,
        "gradient_bytes": num_bytes,
    }
    report(results, reference, args, model)


if __name__ == "__main__":
    main()
