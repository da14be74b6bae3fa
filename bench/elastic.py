"""Elastic training, measured on the namespace cluster (issue 35): a node lost and back, a
node slowed, each against a fresh hplan plan for the new cluster, run separately.

The cluster (``netns_cluster.py``): three network namespaces at 0.9 / 0.45 / 0.45 cores
(``fast``, ``slow-a``, ``slow-b``; pinned to cores of their own where the quotas pack),
10 Gbit/s links. Each node is profiled inside its quota (``hplan profile``), the GPT example
is solved with ``hplan solve ... --elastic --steps N`` and every node runs its generated
``launch/node-<name>.sh --checkpoint-dir D --checkpoint-every-steps 5 --metrics-dir M`` in its
namespace (D and M on this machine's file system, which the namespaces share: the shared
folder the elastic run needs). Parts, each skippable:

- **lost** (``--skip-lost``): at step ``--kill-step`` (40; ``--random-kill``: a random step
  from 20 to 60) every process of ``slow-b`` is killed (SIGKILL of its CPU group); its script
  starts again ``--rejoin-after-s`` (45) later; the run goes to its last step. Printed: the
  downtime from the kill to the first step under the survivors' plan (measured here: the kill's
  time against rank 0's end of that step in its metrics; and as the runtime says it), the
  steps redone, the join (its wait, probation, downtime), samples/s of every segment, every
  script's exit code, and the runtime's own lines.
- **fresh plans** (with lost): a plain ``hplan solve`` (no ``--elastic``) of the survivors,
  run with its static scripts on the same namespaces for ``--fresh-steps``: the samples/s the
  survivors' segment is compared with. Throughput is always the global batch over the spacing
  of rank 0's step ends after ``--warmup`` steps of a segment or run (``cluster_runs``).
- **loss** (``--skip-reference``): an uninterrupted run of the same scripts and samples; the
  lost-and-back run's loss curve against it: per-step and per-10-step mean losses, the largest
  absolute difference, against the noise floor (the steps the survivors redid against the
  same steps before the kill: same samples, same parameters, another reduction order; and with
  ``--reference-runs 2`` two uninterrupted runs against each other).
- **slowed** (``--skip-slowed``): the quota of ``--slow-node`` (``fast``) halved at step
  ``--slow-step`` (40) of a new run; printed: the time from the change to the first step
  under a re-plan (if the runtime re-plans), samples/s before and after (and from 2 minutes
  after the change on), against a fresh plan for the new speeds (the node profiled again at
  its new quota, ``hplan solve`` again, its static scripts run on the same namespaces).
- **torchft** (``--skip-torchft``): whether torchft can give a reference row here (installed
  in the Python given by ``--torchft-python``, never in hplan's environment).

Needs root, iproute2 and cgroup v1's cpu controller; prints one line and exits 0 where they
are missing. Every process it started is killed by id, the namespaces and groups removed,
whatever happens.

    python bench/elastic.py [--steps 400] [--skip-lost] [--skip-reference] [--skip-slowed]
        [--skip-torchft] [--json] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from itertools import combinations, pairwise
from pathlib import Path

from cluster_runs import (
    Model,
    clean_env,
    cluster_yaml,
    hplan_cli,
    hplan_proc,
    last_line,
    profile_nodes,
    rank0_ends,
    throughput,
    wait_all,
)
from common import GPT, HPLAN, console, gpt_env, table
from netns_cluster import CGROUP_CPUSET, NamespaceCluster, NodeShape, available, pack_cores

from hplan.runtime.contract.elastic import RunEventKind, SharedRunDir, read_segments
from hplan.runtime.contract.metrics_file import StepMetrics, read_rank_metrics, summarize_records

NODE_NAMES = ("fast", "slow-a", "slow-b")
QUOTAS = (0.9, 0.45, 0.45)
RATE_MBIT_PER_S = 10_000
PORT = 29681
"""The elastic run's rendezvous; the static runs' is one above."""
MODEL = Model("GPT example", GPT, gpt_env(layers=4, width=128, heads=4, seq=64), 96)
CHECKPOINT_EVERY = 5
WARMUP = 3
RUN_TIMEOUT_S = 1500.0
"""The longest one elastic run may take (then every script is killed and the bench says so)."""
VICTIM = "slow-b"


class BenchFailure(Exception):
    """A run went wrong: the line says what, and where its logs are."""


# --------------------------------------------------------------------------- one elastic run
@dataclass
class Script:
    """One start of a node's launch script."""

    node: str
    label: str
    proc: subprocess.Popen[bytes]
    log: Path
    started_unix_s: float
    killed: bool = False


class ElasticRun:
    """One elastic run: the generated scripts started in their namespaces with one shared
    checkpoint and metrics folder."""

    def __init__(self, cluster: NamespaceCluster, out: Path, work: Path, args: list[str]) -> None:
        self.cluster, self.out, self.work = cluster, out, work
        self.checkpoint_dir, self.metrics_dir = work / "checkpoints", work / "metrics"
        for path in (self.checkpoint_dir, self.metrics_dir):
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
        self.args = [
            "--checkpoint-dir", str(self.checkpoint_dir),
            "--checkpoint-every-steps", str(CHECKPOINT_EVERY),
            "--metrics-dir", str(self.metrics_dir), *args,
        ]  # fmt: skip
        self.scripts: list[Script] = []
        self.shared = SharedRunDir(self.checkpoint_dir)

    def start(self, node: str, label: str = "start") -> Script:
        index = NODE_NAMES.index(node)
        log = self.work / f"{node}-{label}.log"
        argv = ["bash", str(self.out / "launch" / f"node-{node}.sh"), *self.args]
        proc = self.cluster.start(index, argv, log=log, env=clean_env(MODEL.env), cwd=self.work)
        script = Script(node, label, proc, log, time.time())
        self.scripts.append(script)
        return script

    def steps_done(self) -> int:
        state = self.shared.read_state()
        return 0 if state is None else state.steps_done

    def live(self) -> list[Script]:
        return [s for s in self.scripts if s.proc.poll() is None]

    def kill_node(self, node: str) -> float:
        """SIGKILL every process of ``node``; the time of the kill (Unix s)."""
        killed_unix_s = time.time()
        self.cluster.kill_node(NODE_NAMES.index(node))
        for script in self.scripts:
            if script.node == node and script.proc.poll() is None:
                script.killed = True
                script.proc.wait()
            elif script.node == node:
                script.killed = True
        return killed_unix_s

    def wait_until(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Poll ``condition``; fail when the run stops first or it takes over ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            if not self.live():
                raise BenchFailure(f"every script exited before {what}; {self.tails()}")
            if time.monotonic() > deadline:
                raise BenchFailure(f"timed out after {timeout_s:.0f} s waiting for {what}")
            time.sleep(0.1)

    def wait_end(self, timeout_s: float = RUN_TIMEOUT_S) -> None:
        """Wait for every script; on a timeout kill them (the bench then says so)."""
        deadline = time.monotonic() + timeout_s
        for script in self.scripts:
            try:
                script.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for other in self.live():
                    self.cluster.kill(other.proc)
                raise BenchFailure(
                    f"the run did not end within {timeout_s:.0f} s (step {self.steps_done()}); "
                    f"{self.tails()}"
                ) from None

    def exit_codes(self) -> list[tuple[str, str, int | None]]:
        """(node, which start, exit code; None: still running) of every script started."""
        return [
            (s.node, s.label + (" (killed)" if s.killed else ""), s.proc.poll())
            for s in self.scripts
        ]

    def elastic_lines(self) -> list[str]:
        """The runtime's ``hplan: elastic:`` and error lines, every log, in order of starts."""
        found = []
        for script in self.scripts:
            for line in script.log.read_text(errors="replace").splitlines():
                if re.search(r"hplan: (elastic|error)|hplan run ", line):
                    found.append(f"{script.node}/{script.label}: {line.strip()}")
        return found

    def tails(self) -> str:
        return "logs: " + ", ".join(str(s.log) for s in self.scripts)


@dataclass
class Segment:
    """One segment as the run's files and ``hplan metrics --json`` show it."""

    segment: int
    cause: str
    members: list[str]
    world_size: int
    first_step: int
    last_step: int | None
    steps: int
    samples_per_s_metrics: float | None
    """``hplan metrics``' own (a typical step time)."""
    samples_per_s: float | None
    """The global batch over rank 0's step-end spacing after the warmup (None: too few)."""
    predicted_samples_per_s: float | None
    downtime_s: float | None
    steps_redone: int | None
    first_step_end_unix_s: float | None
    compute_ms_per_sample: list[float] = field(default_factory=list)
    """Each rank's median compute milliseconds per sample after the warmup: the machine's
    load shows here (the same plan computing slower per sample)."""


def rank_records(folder: Path) -> dict[int, list[StepMetrics]]:
    return {
        int(p.stem.removeprefix("rank-")): read_rank_metrics(p)
        for p in sorted(folder.glob("rank-*.jsonl"))
    }


def segments_of(metrics_dir: Path) -> list[Segment]:
    """Every segment of an elastic run's metrics folder."""
    proc = hplan_proc("metrics", str(metrics_dir), "--json", env=clean_env({}))
    shown = {}
    if proc.returncode == 0:
        shown = {s["segment"]: s for s in json.loads(proc.stdout)["segments"]}
    out = []
    for folder, record in read_segments(metrics_dir):
        records = rank_records(folder)
        ends = rank0_ends(records) if 0 in records else []
        rate = None
        if len(ends) > WARMUP + 1:
            rate = throughput(ends, MODEL.global_batch, WARMUP)
        row = shown.get(record.segment, {})
        out.append(
            Segment(
                segment=record.segment,
                cause=record.cause,
                members=list(record.members),
                world_size=record.world_size,
                first_step=record.first_step,
                last_step=row.get("last_step"),
                steps=len(ends),
                samples_per_s_metrics=row.get("samples_per_s"),
                samples_per_s=rate,
                predicted_samples_per_s=record.predicted_samples_per_s,
                downtime_s=record.downtime_s,
                steps_redone=record.steps_redone,
                first_step_end_unix_s=ends[0] if ends else None,
                compute_ms_per_sample=[
                    1e3 * statistics.median(s.compute_time_s / max(s.samples, 1) for s in timed)
                    for _, steps in sorted(records.items())
                    if (timed := steps[WARMUP:])
                ],
            )
        )
    return out


def step_losses(folder: Path) -> dict[int, float]:
    """{step: the global batch's mean loss} of one segment's or run's rank files."""
    records = [r for rs in rank_records(folder).values() for r in rs]
    return {s.step: s.loss for s in summarize_records(records).steps if s.loss is not None}


def run_losses(metrics_dir: Path) -> tuple[dict[int, float], dict[int, float]]:
    """The run's loss per step (a redone step: its last segment's), and the losses the steps
    that were redone had before (the noise floor: same samples and parameters)."""
    final: dict[int, float] = {}
    before: dict[int, float] = {}
    for folder, _record in read_segments(metrics_dir):
        for step, loss in step_losses(folder).items():
            if step in final:
                before[step] = final[step]
            final[step] = loss
    return final, before


# --------------------------------------------------------------------------- results
@dataclass
class Lost:
    kill_step: int
    """The step the kill was aimed at."""
    steps_done_at_kill: int
    killed_unix_s: float
    rejoin_started_unix_s: float | None
    segments: list[Segment]
    downtime_outside_s: float | None
    """The kill to rank 0's end of the first step under the survivors' plan."""
    steps_redone_outside: int | None
    join_waited_s: float | None
    """The rejoined node's script start to its admission."""
    probation_s: float | None
    join_outside_s: float | None
    """The admission to rank 0's end of the first step with the node back."""
    exit_codes: list[tuple[str, str, int | None]]
    lines: list[str]
    ended: str
    wall_s: float


@dataclass
class Fresh:
    """A static plan solved for one cluster and run on the namespaces."""

    what: str
    plan: str
    samples_per_s: float
    predicted_samples_per_s: float | None


@dataclass
class LossRow:
    """Two runs' loss curves over the steps both have (one loss per step: the global
    batch's mean; a redone step's from its last segment)."""

    compared: str
    steps: int
    max_abs_step: float
    mean_abs_step: float
    max_abs_window: float
    """Per-10-step means."""
    last_window_a: float
    last_window_b: float
    """Mean loss of the last 10 steps of each."""


@dataclass
class Slowed:
    node: str
    quota_before: float
    quota_after: float
    changed_at_step: int
    changed_unix_s: float
    segments: list[Segment]
    replan_first_step_s: float | None
    """The change to rank 0's end of the first step under a re-plan (None: no re-plan)."""
    before_samples_per_s: float | None
    after_samples_per_s: float | None
    """From the change to the end."""
    after_2min_samples_per_s: float | None
    """From 2 minutes after the change to the end."""
    exit_codes: list[tuple[str, str, int | None]]
    lines: list[str]
    events: list[str]


@dataclass
class Report:
    step_s: float | None = None
    plan: str = ""
    family: list[str] = field(default_factory=list)
    lost: Lost | None = None
    fresh: list[Fresh] = field(default_factory=list)
    loss: list[LossRow] = field(default_factory=list)
    redone_noise: float | None = None
    """The largest |loss difference| of a redone step against its first computation."""
    reference_samples_per_s: list[float | None] = field(default_factory=list)
    slowed: Slowed | None = None
    torchft: Torchft | None = None
    torchft_note: str = ""
    failures: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- the parts
def node_shapes(quotas: Sequence[float]) -> list[NodeShape]:
    cores: list[tuple[int, ...] | None] = [None] * len(quotas)
    if CGROUP_CPUSET.exists():
        cores = pack_cores(quotas, sorted(os.sched_getaffinity(0)))
    return [
        NodeShape(name, quota, RATE_MBIT_PER_S, where)
        for name, quota, where in zip(NODE_NAMES, quotas, cores, strict=True)
    ]


def subset_yaml(cluster: NamespaceCluster, nodes: Sequence[str]) -> str:
    """cluster.yaml of some of the namespace cluster's nodes (their own hosts)."""
    full = cluster_yaml(cluster, "elastic", RATE_MBIT_PER_S).splitlines()
    keep = [
        line
        for line in full
        if "{name: " not in line or any(f"{{name: {n}," in line for n in nodes)
    ]
    return "\n".join([*keep, ""])


def solve(
    cluster_file: Path, profiles: Path, out: Path, steps: int, *, elastic: bool, port: int
) -> dict:
    args = ["solve", str(MODEL.path), "-c", str(cluster_file), "--profile", str(profiles),
            "-b", str(MODEL.global_batch), "--sync", "all_reduce", "--steps", str(steps),
            "--master-port", str(port), "--time-limit", "30", "-o", str(out), "--json"]  # fmt: skip
    if elastic:
        args.append("--elastic")
    return json.loads(hplan_cli(*args, env=clean_env(MODEL.env)))


def plan_line(plan_dir: Path) -> str:
    """One line: the plan's ranks (node, stage, replica, samples)."""
    plan = json.loads((plan_dir / "plan.json").read_text())
    ranks = ", ".join(
        f"{r['node']} s{r['stage']}r{r['replica']} {r['micro_batch_size']}x{r['num_microbatches']}"
        for r in plan["ranks"]
    )
    predicted = plan["report"].get("predicted_samples_per_s")
    return f"{ranks}; predicted {predicted:.0f} samples/s" if predicted else ranks


def fresh_run(
    cluster: NamespaceCluster, nodes: Sequence[str], profiles: Path, work: Path, what: str,
    steps: int,
) -> Fresh:  # fmt: skip
    """A plain static solve for ``nodes``, its scripts run on the namespaces for ``steps``,
    with a checkpoint every :data:`CHECKPOINT_EVERY` steps as the elastic runs (on these
    quotas the asynchronous saves cost ~20% of the samples/s: without them the fresh plan
    would win by that much)."""
    work.mkdir(parents=True, exist_ok=True)
    cluster_file = work / "cluster.yaml"
    cluster_file.write_text(subset_yaml(cluster, nodes), encoding="utf-8")
    own = work / "profiles"  # the solve refuses profiles of nodes outside its cluster
    shutil.rmtree(own, ignore_errors=True)
    own.mkdir()
    for node in nodes:
        for path in profiles.glob(f"{node}-*.json"):
            shutil.copy2(path, own / path.name)
    out = work / "plan"
    solve(cluster_file, own, out, steps, elastic=False, port=PORT + 1)
    records = run_static(cluster, out, steps, work)
    plan = json.loads((out / "plan.json").read_text())
    return Fresh(
        what, plan_line(out), throughput(rank0_ends(records), MODEL.global_batch, WARMUP),
        plan["report"].get("predicted_samples_per_s"),
    )  # fmt: skip


def run_static(
    cluster: NamespaceCluster, plan_dir: Path, steps: int, work: Path
) -> dict[int, list[StepMetrics]]:
    """The plan's static scripts in their namespaces (nodes it leaves idle have none), a
    checkpoint every :data:`CHECKPOINT_EVERY` steps; every rank's metrics."""
    metrics, checkpoints = work / "metrics-fresh", work / "checkpoints-fresh"
    for path in (metrics, checkpoints):
        shutil.rmtree(path, ignore_errors=True)
    flags = ["--steps", str(steps), "--metrics-dir", str(metrics), "--checkpoint-dir",
             str(checkpoints), "--checkpoint-every-steps", str(CHECKPOINT_EVERY)]  # fmt: skip
    procs, logs = [], []
    for i, node in enumerate(NODE_NAMES):
        script = plan_dir / "launch" / f"node-{node}.sh"
        if not script.exists():
            continue
        log = work / f"fresh-{node}.log"
        argv = ["bash", str(script), *flags]
        procs.append(cluster.start(i, argv, log=log, env=clean_env(MODEL.env), cwd=work))
        logs.append(log)
    wait_all(cluster, procs, logs, "the fresh plan's run")
    return rank_records(metrics)


def lose_and_rejoin(
    cluster: NamespaceCluster, out: Path, work: Path, *, kill_step: int, rejoin_after_s: float
) -> tuple[Lost, ElasticRun]:
    run = ElasticRun(cluster, out, work, [])
    started_s = time.monotonic()
    for node in NODE_NAMES:
        run.start(node)
    run.wait_until(lambda: run.steps_done() >= kill_step, 600, f"step {kill_step}")
    killed_unix_s = run.kill_node(VICTIM)
    done_at_kill = run.steps_done()
    console.print(f"  killed {VICTIM} after step {done_at_kill} (run.json)", highlight=False)
    rejoin_unix_s: float | None = None
    try:
        run.wait_until(
            lambda: time.time() >= killed_unix_s + rejoin_after_s, rejoin_after_s + 5, "the rejoin"
        )
        rejoin_unix_s = run.start(VICTIM, "rejoin").started_unix_s
        console.print(f"  {VICTIM}'s script started again at step {run.steps_done()}")
        run.wait_end()
    finally:
        for script in run.live():
            cluster.kill(script.proc)
    segments = segments_of(run.metrics_dir)
    events = run.shared.events()
    lost_segment = next((s for s in segments if s.first_step > 0), None)
    outside = steps_redone = None
    if lost_segment is not None and lost_segment.first_step_end_unix_s is not None:
        outside = lost_segment.first_step_end_unix_s - killed_unix_s
        steps_redone = done_at_kill - lost_segment.first_step
    admitted = next((e for e in events if e.kind is RunEventKind.ADMITTED), None)
    joined = next((s for s in segments if "join" in s.cause), None)
    waited = probation = join_outside = None
    if admitted is not None and rejoin_unix_s is not None:
        waited = admitted.unix_s - rejoin_unix_s
        match = re.search(r"waited (\d+) s", admitted.detail)
        probation = float(match.group(1)) if match else None
        if joined is not None and joined.first_step_end_unix_s is not None:
            join_outside = joined.first_step_end_unix_s - admitted.unix_s
    ended = next((e.detail for e in reversed(events) if e.kind is RunEventKind.ENDED), "")
    lost = Lost(
        kill_step=kill_step, steps_done_at_kill=done_at_kill, killed_unix_s=killed_unix_s,
        rejoin_started_unix_s=rejoin_unix_s, segments=segments, downtime_outside_s=outside,
        steps_redone_outside=steps_redone, join_waited_s=waited, probation_s=probation,
        join_outside_s=join_outside, exit_codes=run.exit_codes(), lines=run.elastic_lines(),
        ended=ended, wall_s=time.monotonic() - started_s,
    )  # fmt: skip
    return lost, run


def uninterrupted(cluster: NamespaceCluster, out: Path, work: Path) -> ElasticRun:
    run = ElasticRun(cluster, out, work, [])
    try:
        for node in NODE_NAMES:
            run.start(node)
        run.wait_end()
    finally:
        for script in run.live():
            cluster.kill(script.proc)
    bad = [(n, code) for n, _, code in run.exit_codes() if code != 0]
    if bad:
        raise BenchFailure(f"the uninterrupted run's scripts exited {bad}; {run.tails()}")
    return run


def window_means(losses: Mapping[int, float], width: int = 10) -> dict[int, float]:
    windows: dict[int, list[float]] = {}
    for step, loss in losses.items():
        windows.setdefault(step // width, []).append(loss)
    return {w: statistics.fmean(v) for w, v in windows.items()}


def max_abs(a: Mapping[int, float], b: Mapping[int, float]) -> float:
    common = set(a) & set(b)
    return max((abs(a[k] - b[k]) for k in common), default=float("nan"))


def last_window(losses: Mapping[int, float]) -> float:
    windows = window_means(losses)
    return windows[max(windows)] if windows else float("nan")


def compare_losses(runs: Mapping[str, Path], pairs: Sequence[tuple[str, str]]) -> list[LossRow]:
    """One row per pair of ``runs`` (name -> metrics folder)."""
    losses = {name: run_losses(folder)[0] for name, folder in runs.items()}
    rows = []
    for a, b in pairs:
        x, y = losses[a], losses[b]
        common = sorted(set(x) & set(y))
        rows.append(
            LossRow(
                compared=f"{a} / {b}",
                steps=len(common),
                max_abs_step=max_abs(x, y),
                mean_abs_step=statistics.fmean(abs(x[s] - y[s]) for s in common),
                max_abs_window=max_abs(window_means(x), window_means(y)),
                last_window_a=last_window(x),
                last_window_b=last_window(y),
            )
        )
    return rows


def redone_noise(metrics_dir: Path) -> float | None:
    """The largest difference of a redone step's loss from its loss before the restart
    (the same samples and parameters, another reduction order); None: none redone."""
    final, before = run_losses(metrics_dir)
    return max_abs(before, final) if before else None


def run_rate(metrics_dir: Path) -> float | None:
    """Samples/s of a one-segment run (rank 0's step spacing after the warmup)."""
    segments = read_segments(metrics_dir)
    if not segments:
        return None
    ends = rank0_ends(rank_records(segments[0][0]))
    return throughput(ends, MODEL.global_batch, WARMUP) if len(ends) > WARMUP + 1 else None


def rate_between(
    metrics_dir: Path, start_unix_s: float, end_unix_s: float | None = None
) -> float | None:
    """Samples/s from rank 0's step ends in [start, end] over every segment (the global
    batch over their spacing; None: fewer than 2 steps there)."""
    ends = sorted(
        t
        for folder, _ in read_segments(metrics_dir)
        for t in rank0_ends(rank_records(folder))
        if t >= start_unix_s and (end_unix_s is None or t <= end_unix_s)
    )
    if len(ends) < 2:
        return None
    return MODEL.global_batch * (len(ends) - 1) / (ends[-1] - ends[0])


def slow_a_node(
    cluster: NamespaceCluster, out: Path, work: Path, *, node: str, at_step: int, steps: int
) -> Slowed:
    index = NODE_NAMES.index(node)
    quota = QUOTAS[index]
    run = ElasticRun(cluster, out, work, ["--steps", str(steps)])
    try:
        for name in NODE_NAMES:
            run.start(name)
        run.wait_until(lambda: run.steps_done() >= at_step, 600, f"step {at_step}")
        changed_unix_s = time.time()
        cluster.set_cpu_quota(index, quota / 2)
        changed_step = run.steps_done()
        console.print(
            f"  {node}'s quota {quota:g} -> {quota / 2:g} cores after step {changed_step}"
        )
        run.wait_end()
    finally:
        for script in run.live():
            cluster.kill(script.proc)
    segments = segments_of(run.metrics_dir)
    replanned = next((s for s in segments if s.first_step > 0 and "lost" not in s.cause), None)
    first_s = None
    if replanned is not None and replanned.first_step_end_unix_s is not None:
        first_s = replanned.first_step_end_unix_s - changed_unix_s
    first_segment = segments[0] if segments else None
    before = None
    if first_segment is not None:
        before = rate_between(run.metrics_dir, 0.0, changed_unix_s)
    events = [
        f"{e.kind.value} {e.node or ''} step {e.step} {e.detail}".strip()
        for e in run.shared.events()
        if e.kind not in (RunEventKind.STARTED,)
    ]
    return Slowed(
        node=node, quota_before=quota, quota_after=quota / 2, changed_at_step=changed_step,
        changed_unix_s=changed_unix_s, segments=segments, replan_first_step_s=first_s,
        before_samples_per_s=before,
        after_samples_per_s=rate_between(run.metrics_dir, changed_unix_s),
        after_2min_samples_per_s=rate_between(run.metrics_dir, changed_unix_s + 120.0),
        exit_codes=run.exit_codes(), lines=run.elastic_lines(), events=events,
    )  # fmt: skip


def reprofile(cluster: NamespaceCluster, profiles: Path, node: str, work: Path) -> Path:
    """``profiles`` with ``node`` profiled again at its quota now."""
    fresh = profile_nodes_subset(cluster, [node], work / "reprofile")
    merged = work / "profiles-slowed"
    shutil.rmtree(merged, ignore_errors=True)
    shutil.copytree(profiles, merged)
    for path in fresh.iterdir():
        shutil.copy2(path, merged / path.name)
    return merged


def profile_nodes_subset(cluster: NamespaceCluster, nodes: Sequence[str], work: Path) -> Path:
    """``hplan profile`` inside each of ``nodes``, one after another; the folder."""
    work.mkdir(parents=True, exist_ok=True)
    out = work / "profiles"
    for node in nodes:
        log = work / f"profile-{node}.log"
        argv = [*HPLAN, "profile", "--model", str(MODEL.path), "--node", node, "-o", str(out)]
        proc = cluster.start(NODE_NAMES.index(node), argv, log=log, env=clean_env(MODEL.env))
        if proc.wait() != 0:
            raise BenchFailure(f"hplan profile on {node} failed; see {log}")
    return out


TORCHFT_PORT = 29740
"""torchft's lighthouse; each replica's store and manager use the two ports above it."""
TORCHFT_WORKER = Path(__file__).resolve().parent / "torchft_worker.py"


@dataclass
class Torchft:
    """torchft's data-parallel recovery on the same namespaces (a reference row)."""

    batch_per_replica: int
    killed_after_step: int
    downtime_s: float | None
    """The kill to the end of the survivors' first step after it that counted (replica 0)."""
    steps_lost: int | None
    """Steps the survivors' counter went back (torchft: none expected)."""
    join_s: float | None
    """The replica's script start to its first step with the others."""
    join_pause_s: float | None
    """The survivors' longest gap between two step ends from its start to its first step."""
    before_samples_per_s: float | None
    survivors_samples_per_s: float | None
    after_samples_per_s: float | None
    exit_codes: list[tuple[str, str, int | None]]
    note: str = ""


def torchft_python_ok(python: str | None) -> str | None:
    """None when ``python`` imports torchft, else why no torchft row (one line)."""
    if not python:
        return "torchft: not run (give --torchft-python, a Python with torchft, apart from hplan's)"
    proc = subprocess.run([python, "-c", "import torchft"], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"torchft: does not import in {python}: {last_line(proc)}"
    lighthouse = Path(python).parent / "torchft_lighthouse"
    if not lighthouse.exists():
        return f"torchft: no torchft_lighthouse beside {python}"
    return None


def torchft_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rate_of(records: Sequence[dict], batch: int) -> float | None:
    """Samples/s of a replica's records: every participant's batch over the step spacing."""
    if len(records) < 2:
        return None
    samples = sum(r["participants"] * batch for r in records[1:])
    return samples / (records[-1]["end_unix_s"] - records[0]["end_unix_s"])


def run_torchft(
    cluster: NamespaceCluster, python: str, work: Path, *, kill_step: int, rejoin_after_s: float,
    steps: int,
) -> Torchft:  # fmt: skip
    """torchft's DDP over gloo, one replica per node, ``MODEL.global_batch / 3`` samples each;
    ``VICTIM`` killed at ``kill_step`` and started again ``rejoin_after_s`` later."""
    work.mkdir(parents=True, exist_ok=True)
    batch = MODEL.global_batch // len(NODE_NAMES)
    env = clean_env({**MODEL.env, "OMP_NUM_THREADS": "1"})
    scripts: list[Script] = []
    lighthouse = [str(Path(python).parent / "torchft_lighthouse"), "--min_replicas", "2",
                  "--bind", f"{cluster.host(0)}:{TORCHFT_PORT}", "--join_timeout_ms", "1000",
                  "--heartbeat_timeout_ms", "5000"]  # fmt: skip
    lighthouse_proc = cluster.start(0, lighthouse, log=work / "lighthouse.log", env=env)

    def start(index: int, label: str) -> Script:
        node = NODE_NAMES[index]
        argv = [python, str(TORCHFT_WORKER), str(MODEL.path), "--replica", str(index),
                "--host", cluster.host(index),
                "--lighthouse", f"http://{cluster.host(0)}:{TORCHFT_PORT}",
                "--store-port", str(TORCHFT_PORT + 1), "--manager-port", str(TORCHFT_PORT + 2),
                "--steps", str(steps), "--batch", str(batch),
                "--out", str(work / f"torchft-{node}.jsonl")]  # fmt: skip
        log = work / f"torchft-{node}-{label}.log"
        own = {**env, "GLOO_SOCKET_IFNAME": f"{cluster.tag}-n{index}"}  # else gloo picks lo
        proc = cluster.start(index, argv, log=log, env=own, cwd=work)
        script = Script(node, label, proc, log, time.time())
        scripts.append(script)
        return script

    first = work / f"torchft-{NODE_NAMES[0]}.jsonl"
    victim = NODE_NAMES.index(VICTIM)
    try:
        for index in range(len(NODE_NAMES)):
            start(index, "start")
        deadline = time.monotonic() + 600
        while not any(r["step"] >= kill_step for r in torchft_records(first)):
            if time.monotonic() > deadline or all(s.proc.poll() is not None for s in scripts):
                raise BenchFailure(f"torchft never reached step {kill_step}; logs in {work}")
            time.sleep(0.1)
        killed_unix_s = time.time()
        cluster.kill_node(victim)
        for script in scripts:
            if script.node == VICTIM:
                script.killed = True
                script.proc.wait()
        done_at_kill = max(r["step"] for r in torchft_records(first))
        time.sleep(max(0.0, killed_unix_s + rejoin_after_s - time.time()))
        rejoin = start(victim, "rejoin")
        for script in scripts:
            if not script.killed:
                script.proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        for script in scripts:
            if script.proc.poll() is None:
                cluster.kill(script.proc)
        cluster.kill(lighthouse_proc)
    records = torchft_records(first)
    before = [r for r in records if r["end_unix_s"] <= killed_unix_s]
    after_kill = [r for r in records if r["end_unix_s"] > killed_unix_s]
    committed = [r for r in after_kill if r["step"] > done_at_kill]  # a step that counted
    downtime = committed[0]["end_unix_s"] - killed_unix_s if committed else None
    lost = None
    if before and after_kill:
        lost = max(0, before[-1]["step"] - min(r["step"] for r in after_kill))
    survivors = [r for r in after_kill if r["end_unix_s"] <= rejoin.started_unix_s]
    joined = [
        r for r in torchft_records(work / f"torchft-{VICTIM}.jsonl")
        if r["end_unix_s"] > rejoin.started_unix_s and r["participants"] == len(NODE_NAMES)
    ]  # fmt: skip
    join_s = joined[0]["end_unix_s"] - rejoin.started_unix_s if joined else None
    after = [r for r in records if joined and r["end_unix_s"] >= joined[0]["end_unix_s"]]
    joined_unix_s = joined[0]["end_unix_s"] if joined else float("inf")
    gaps = [
        b["end_unix_s"] - a["end_unix_s"]
        for a, b in pairwise(records)
        if b["end_unix_s"] > rejoin.started_unix_s and a["end_unix_s"] < joined_unix_s
    ]
    return Torchft(
        batch_per_replica=batch, killed_after_step=done_at_kill, downtime_s=downtime,
        steps_lost=lost, join_s=join_s, join_pause_s=max(gaps) if gaps else None,
        before_samples_per_s=rate_of(before[WARMUP:], batch),
        survivors_samples_per_s=rate_of(survivors[WARMUP:], batch),
        after_samples_per_s=rate_of(after[WARMUP:], batch),
        exit_codes=[(s.node, s.label + (" (killed)" if s.killed else ""), s.proc.poll())
                    for s in scripts],
    )  # fmt: skip


# --------------------------------------------------------------------------- printing
def fmt(value: float | None, digits: int = 1, unit: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def print_report(report: Report, args: argparse.Namespace) -> None:
    console.print(
        f"GPT example ({', '.join(f'{k}={v}' for k, v in MODEL.env.items())}), global batch "
        f"{MODEL.global_batch}; rank 0's median step on every node: {fmt(report.step_s, 2, ' s')}",
        highlight=False,
    )
    console.print(f"plan for every node: {report.plan}", highlight=False, soft_wrap=True)
    for line in report.family:
        console.print(f"  {line}", highlight=False, soft_wrap=True)
    fresh = {f.what: f for f in report.fresh}
    if report.lost is not None:
        lost = report.lost
        head = table(
            f"a node lost and back: {VICTIM} killed at step {lost.steps_done_at_kill} "
            f"(aimed at {lost.kill_step}), its script started again {args.rejoin_after_s:g} s "
            f"later; checkpoint every {CHECKPOINT_EVERY} steps",
            ["What", "measured here", "the runtime says"],
        )
        lost_seg = next((s for s in lost.segments if s.first_step > 0), None)
        join_seg = next((s for s in lost.segments if "join" in s.cause), None)
        head.add_row(
            "downtime: kill -> first step under the survivors' plan",
            fmt(lost.downtime_outside_s, 1, " s"),
            fmt(lost_seg.downtime_s if lost_seg else None, 1, " s"),
        )
        head.add_row(
            "steps redone",
            str(lost.steps_redone_outside) if lost.steps_redone_outside is not None else "-",
            str(lost_seg.steps_redone) if lost_seg and lost_seg.steps_redone is not None else "-",
        )
        head.add_row("join: script start -> admitted", fmt(lost.join_waited_s, 1, " s"),
                     fmt(lost.probation_s, 0, " s waited"))  # fmt: skip
        head.add_row(
            "join: admitted -> first step on all three",
            fmt(lost.join_outside_s, 1, " s"),
            fmt(join_seg.downtime_s if join_seg else None, 1, " s downtime"),
        )
        head.add_row(
            "join: steps redone",
            "-",
            str(join_seg.steps_redone) if join_seg and join_seg.steps_redone is not None else "-",
        )
        head.add_row("run's end", f"{lost.wall_s:.0f} s wall", lost.ended or "-")
        console.print(head)
        print_segments(lost.segments, fresh)
        codes = ", ".join(f"{n} {label}: {code}" for n, label, code in lost.exit_codes)
        console.print(f"exit codes: {codes}", highlight=False, soft_wrap=True)
        for line in lost.lines:
            console.print(f"  {line}", highlight=False, soft_wrap=True)
    if report.loss:
        out = table(
            "loss curves of the same samples (loss per step: the global batch's mean; a "
            "redone step's from its last segment)",
            ["Runs", "steps", "max |diff| per step", "mean |diff| per step",
             "max |diff| per-10-step mean", "last 10 steps' loss"],
        )  # fmt: skip
        for row in report.loss:
            out.add_row(row.compared, str(row.steps), f"{row.max_abs_step:.2e}",
                        f"{row.mean_abs_step:.2e}", f"{row.max_abs_window:.2e}",
                        f"{row.last_window_a:.4f} / {row.last_window_b:.4f}")  # fmt: skip
        console.print(out)
        if report.redone_noise is not None:
            console.print(
                f"steps redone after the kill against their first computation (same samples "
                f"and parameters, another layout): max |diff| {report.redone_noise:.2e}"
            )
        rates = ", ".join(fmt(r) for r in report.reference_samples_per_s)
        console.print(f"uninterrupted runs' samples/s (all three nodes): {rates}")
    if report.slowed is not None:
        slowed = report.slowed
        fresh_slow = fresh.get("slowed")
        out = table(
            f"a node slowed: {slowed.node}'s quota {slowed.quota_before:g} -> "
            f"{slowed.quota_after:g} cores after step {slowed.changed_at_step}",
            ["What", "value"],
        )
        out.add_row("change -> first step under a re-plan", fmt(slowed.replan_first_step_s, 1, " s")
                    if slowed.replan_first_step_s is not None else "no re-plan")  # fmt: skip
        out.add_row("samples/s before the change", fmt(slowed.before_samples_per_s))
        out.add_row("samples/s after the change (to the end)", fmt(slowed.after_samples_per_s))
        out.add_row("samples/s from 2 min after the change", fmt(slowed.after_2min_samples_per_s))
        if fresh_slow is not None:
            out.add_row("fresh plan for the new speeds (measured)", fmt(fresh_slow.samples_per_s))
            if slowed.after_2min_samples_per_s is not None:
                ratio = slowed.after_2min_samples_per_s / fresh_slow.samples_per_s
                out.add_row("from 2 min after / fresh", f"{ratio:.2f}")
        console.print(out)
        print_segments(slowed.segments, fresh)
        codes = ", ".join(f"{n} {label}: {code}" for n, label, code in slowed.exit_codes)
        console.print(f"exit codes: {codes}", highlight=False, soft_wrap=True)
        for line in [*slowed.lines, *slowed.events]:
            console.print(f"  {line}", highlight=False, soft_wrap=True)
    for f in report.fresh:
        console.print(f"fresh plan ({f.what}): {f.plan}", highlight=False, soft_wrap=True)
    if report.torchft is not None:
        ft = report.torchft
        out = table(
            f"reference: torchft {ft.batch_per_replica} samples per replica (data parallel, "
            f"gloo), {VICTIM} killed after step {ft.killed_after_step}, started again "
            f"{args.rejoin_after_s:g} s later",
            ["What", "value"],
        )
        out.add_row("kill -> survivors' next step end", fmt(ft.downtime_s, 1, " s"))
        out.add_row("steps lost", str(ft.steps_lost) if ft.steps_lost is not None else "-")
        out.add_row("rejoin: start -> first step with all three", fmt(ft.join_s, 1, " s"))
        out.add_row("rejoin: survivors' longest pause", fmt(ft.join_pause_s, 1, " s"))
        out.add_row("samples/s before / survivors / after", " / ".join(
            fmt(v) for v in (ft.before_samples_per_s, ft.survivors_samples_per_s,
                             ft.after_samples_per_s)))  # fmt: skip
        console.print(out)
        codes = ", ".join(f"{n} {label}: {code}" for n, label, code in ft.exit_codes)
        console.print(f"torchft exit codes: {codes}", highlight=False, soft_wrap=True)
    if report.torchft_note:
        console.print(report.torchft_note, highlight=False, soft_wrap=True)
    for line in report.failures:
        console.print(f"[red]failed[/red]: {line}", highlight=False, soft_wrap=True)


def print_segments(segments: Sequence[Segment], fresh: Mapping[str, Fresh]) -> None:
    out = table(
        "segments (samples/s: the global batch over rank 0's step spacing after "
        f"{WARMUP} steps)",
        ["segment", "Cause", "Nodes", "steps", "samples/s", "hplan metrics", "predicted",
         "fresh plan", "/ fresh", "compute ms/sample per rank"],
    )  # fmt: skip
    for s in segments:
        key = "+".join(sorted(s.members))
        match = next((f for f in fresh.values() if f.what == key), None)
        ratio = (
            f"{s.samples_per_s / match.samples_per_s:.2f}"
            if match is not None and s.samples_per_s is not None
            else "-"
        )
        out.add_row(
            str(s.segment), s.cause, key, f"{s.first_step}-{s.last_step}",
            fmt(s.samples_per_s), fmt(s.samples_per_s_metrics), fmt(s.predicted_samples_per_s),
            fmt(match.samples_per_s) if match else "-", ratio,
            " ".join(f"{ms:.1f}" for ms in s.compute_ms_per_sample),
        )  # fmt: skip
    console.print(out)


# --------------------------------------------------------------------------- main
def step_time_s(metrics_dir: Path) -> float | None:
    """Rank 0's median step time in the run's first segment (after the warmup)."""
    segments = read_segments(metrics_dir)
    records = rank_records(segments[0][0]).get(0, []) if segments else []
    timed = [s.step_time_s for s in records[WARMUP:]]
    return statistics.median(timed) if timed else None


def run_all(args: argparse.Namespace, work: Path, report: Report) -> None:
    shapes = node_shapes(QUOTAS)
    with NamespaceCluster(shapes, tag="hpe", subnet=217) as cluster:
        cluster_file = work / "cluster.yaml"
        cluster_file.write_text(cluster_yaml(cluster, "elastic", RATE_MBIT_PER_S), "utf-8")
        if args.profiles is not None:
            profiles = args.profiles
        else:
            console.print(f"profiling the nodes ({', '.join(NODE_NAMES)}) ...")
            profiles = profile_nodes(cluster, MODEL, work)
        out = work / "out"
        summary = solve(cluster_file, profiles, out, args.steps, elastic=True, port=PORT)
        report.plan = plan_line(out)
        family = json.loads((out / "family.json").read_text())
        report.family = [f"{key}: {plan_line((out / path).parent)}"
                         for key, path in family["plans"].items()]  # fmt: skip
        report.family += [f"{key}: infeasible: {why}" for key, why in family["infeasible"].items()]
        console.print(f"solved: {summary.get('predicted_samples_per_s', '')} {report.plan}")
        runs: dict[str, Path] = {}
        if not args.skip_lost:
            console.print(f"lost and back: {args.steps} steps ...")
            kill_step = args.kill_step
            if args.random_kill:
                kill_step = random.Random(args.seed).randrange(20, 61)
            try:
                report.lost, run = lose_and_rejoin(
                    cluster, out, work / "lost", kill_step=kill_step,
                    rejoin_after_s=args.rejoin_after_s,
                )  # fmt: skip
            except BenchFailure as exc:
                report.failures.append(f"lost and back: {exc}")
                run = None
            if run is not None:
                report.step_s = step_time_s(run.metrics_dir)
            survivors = [n for n in NODE_NAMES if n != VICTIM]
            console.print("fresh plans: the survivors, every node ...")
            report.fresh.append(fresh_run(cluster, survivors, profiles, work / "fresh-survivors",
                                          "+".join(sorted(survivors)), args.fresh_steps))  # fmt: skip
            report.fresh.append(fresh_run(cluster, NODE_NAMES, profiles, work / "fresh-all",
                                          "+".join(sorted(NODE_NAMES)), args.fresh_steps))  # fmt: skip
            if run is not None and not args.skip_reference:
                references = []
                for i in range(args.reference_runs):
                    console.print(f"uninterrupted run {i + 1} of {args.reference_runs} ...")
                    references.append(uninterrupted(cluster, out, work / f"reference-{i}"))
                report.reference_samples_per_s = [run_rate(r.metrics_dir) for r in references]
                report.redone_noise = redone_noise(run.metrics_dir)
                runs["lost-and-back"] = run.metrics_dir
                for i, reference in enumerate(references):
                    runs[f"uninterrupted-{i}"] = reference.metrics_dir
        if not args.skip_torchft and not report.torchft_note:
            console.print("torchft reference ...")
            try:
                report.torchft = run_torchft(
                    cluster, args.torchft_python, work / "torchft", kill_step=args.kill_step,
                    rejoin_after_s=args.rejoin_after_s, steps=args.torchft_steps,
                )  # fmt: skip
            except (BenchFailure, subprocess.TimeoutExpired) as exc:
                report.failures.append(f"torchft: {exc}")
        if not args.skip_slowed:
            console.print(f"slowed: {args.slow_node} halved at step {args.slow_step} ...")
            try:
                report.slowed = slow_a_node(
                    cluster, out, work / "slowed", node=args.slow_node,
                    at_step=args.slow_step, steps=args.slow_steps,
                )  # fmt: skip
            except BenchFailure as exc:
                report.failures.append(f"slowed: {exc}")
            index = NODE_NAMES.index(args.slow_node)
            cluster.set_cpu_quota(index, QUOTAS[index] / 2)
            slowed_profiles = reprofile(cluster, profiles, args.slow_node, work)
            fresh = fresh_run(cluster, NODE_NAMES, slowed_profiles, work / "fresh-slowed",
                              "slowed", args.fresh_steps)  # fmt: skip
            report.fresh.append(fresh)
            if report.slowed is not None:
                runs["slowed"] = work / "slowed" / "metrics"
        references = [name for name in runs if name.startswith("uninterrupted")]
        pairs = [(a, b) for a in runs if not a.startswith("uninterrupted") for b in references]
        pairs += list(combinations(references, 2))
        report.loss = compare_losses(runs, pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="steps of the lost-and-back run")
    parser.add_argument("--kill-step", type=int, default=40)
    parser.add_argument("--random-kill", action="store_true", help="kill at a step from 20-60")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--rejoin-after-s", type=float, default=45.0)
    parser.add_argument("--fresh-steps", type=int, default=40,
                        help="steps of each fresh static plan's run")  # fmt: skip
    parser.add_argument("--reference-runs", type=int, default=1, choices=(1, 2))
    parser.add_argument("--slow-node", default="fast", choices=NODE_NAMES)
    parser.add_argument("--slow-step", type=int, default=40)
    parser.add_argument("--slow-steps", type=int, default=400, help="steps of the slowed run")
    parser.add_argument("--torchft-python", help="a Python with torchft (not hplan's venv)")
    parser.add_argument("--torchft-steps", type=int, default=250)
    parser.add_argument("--skip-lost", action="store_true")
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument("--skip-slowed", action="store_true")
    parser.add_argument("--skip-torchft", action="store_true")
    parser.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    parser.add_argument("--keep", type=Path, help="keep the work files here")
    parser.add_argument("--profiles", type=Path,
                        help="the nodes' profiles from an earlier run (skips profiling)")  # fmt: skip
    args = parser.parse_args()
    # a SIGTERM (or SIGINT, ignored in a background job) ends the bench through its clean-up
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    why_not = available()
    if why_not is not None:
        console.print(f"bench/elastic.py skipped: {why_not}")
        return
    work = args.keep or Path(tempfile.mkdtemp(prefix="hplan-elastic-"))
    work.mkdir(parents=True, exist_ok=True)
    console.print(f"work files in {work}")
    report = Report()
    try:
        if not args.skip_torchft:
            report.torchft_note = torchft_python_ok(args.torchft_python) or ""
        run_all(args, work, report)
    except BenchFailure as exc:
        report.failures.append(str(exc))
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print_report(report, args)
    if args.json:
        print(json.dumps(asdict(report), indent=1))


if __name__ == "__main__":
    main()
