"""Durable training, measured (issue 13): a node lost at a random step, the re-plan, the
resume; and what a checkpoint costs training, asynchronous against synchronous.

Part 1, a lost node (twice: on a cluster of network namespaces with shaped links and CPU
quotas, running the generated launch scripts under torchrun; and in rehearsal). The GPT
example is solved for three one-device nodes and trained with a checkpoint every
``--every`` steps; at a random step the last node is killed (SIGKILL of its whole process
group: the node is gone). Measured: the time from the kill until every other rank has
exited; until ``hplan replan --without NODE`` has written the new plan; until the first
step under the new plan is done (the new job's start, rendezvous, build and checkpoint
load; the load alone, as rank 0 reports it, is given too); the steps lost (done before
the kill minus the checkpoint resumed from: at most one interval); and whether the loss
is continuous: the resumed run recomputes the steps that were lost, and its losses are
compared with the ones the lost run had for the same steps (same parameters, same
samples; only the reduction order differs).

Part 2, the pause: the GPT example (about 30 M parameters: a 350 MB checkpoint with AdamW's
moments) on two ranks, a checkpoint every 3 steps, ``--sync-checkpoints`` against the
default asynchronous save; rank 0's median pause per periodic checkpoint, next to the
median step time. Both runs in one invocation, one after the other.

    python bench/durability.py [--every 4] [--seed N] [--skip-namespaces] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common import GPT, HPLAN, console, gpt_env, table
from netns_cluster import NamespaceCluster, NodeShape, available

from hplan.runtime.contract.metrics_file import StepMetrics, read_rank_metrics
from hplan.runtime.contract.plan import Plan

BIN = Path(sys.executable).parent
SMALL_GPT = gpt_env(layers=4, width=128, heads=4, seq=64)
PAUSE_GPT = gpt_env(layers=8, width=576, heads=8, seq=128)
NODES = (
    NodeShape("left", cpu_cores=0.7, rate_mbit_per_s=400),
    NodeShape("middle", cpu_cores=0.7, rate_mbit_per_s=400),
    NodeShape("right", cpu_cores=0.5, rate_mbit_per_s=200),
)
PORT = 29631


def _cluster_yaml(hosts: list[str]) -> str:
    lines = ["name: durability", "nodes:"]
    for node, host in zip(NODES, hosts, strict=True):
        lines.append(f"  - {{name: {node.name}, host: {host}, devices: [{{type: cpu}}]}}")
    lines += ["links:", "  inter_node: {bandwidth_gbit_per_s: 0.2, latency_us: 200}", ""]
    return "\n".join(lines)


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, **extra, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("LOCAL_RANK", None)
    return env


def _hplan(*args: str, env: dict[str, str]) -> str:
    proc = subprocess.run([*HPLAN, *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"hplan {args[0]} failed: {proc.stderr.strip().splitlines()[-1]}")
    return proc.stderr


def _records(metrics: Path) -> dict[int, list[StepMetrics]]:
    found: dict[int, list[StepMetrics]] = {}
    for path in sorted(metrics.glob("rank-*.jsonl")):
        found[int(path.stem.removeprefix("rank-"))] = read_rank_metrics(path)
    return found


def _global_losses(metrics: Path) -> dict[int, float]:
    total: dict[int, float] = {}
    samples: dict[int, int] = {}
    steps_per_rank = [{r.step for r in records} for records in _records(metrics).values()]
    complete = set.intersection(*steps_per_rank) if steps_per_rank else set()
    for records in _records(metrics).values():
        for r in records:
            if r.loss is not None and r.step in complete:
                total[r.step] = total.get(r.step, 0.0) + r.loss * r.samples
                samples[r.step] = samples.get(r.step, 0) + r.samples
    return {step: total[step] / samples[step] for step in total}


def _steps_done(metrics: Path) -> int:
    """Steps every rank of a run finished (its metrics hold them)."""
    counts = [len(records) for records in _records(metrics).values()]
    return min(counts) if counts else 0


def _wait(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)


# --------------------------------------------------------------------------- a lost node
@dataclass
class LostNode:
    """What one kill / replan / resume measured."""

    where: str
    killed_at_step: int
    all_exited_s: float
    replan_written_s: float
    resumed_s: float
    load_s: float | None
    steps_lost: int
    resumed_from: int
    loss_rel_diff: float
    """Largest relative difference of a recomputed step's loss from the lost run's."""
    exit_lines: list[str]


class _Launcher:
    """Starts one run of a plan's ranks and kills a node of it (namespaces or rehearsal)."""

    def start(self, plan_dir: Path, args: list[str], logs: Path) -> None:
        raise NotImplementedError

    def kill_node(self, node: str) -> None:
        raise NotImplementedError

    def running(self) -> bool:
        raise NotImplementedError

    def logs(self) -> str:
        raise NotImplementedError


class _NamespaceLauncher(_Launcher):
    def __init__(self, cluster: NamespaceCluster, env: dict[str, str]) -> None:
        self.cluster, self.env = cluster, env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.log_paths: list[Path] = []

    def start(self, plan_dir: Path, args: list[str], logs: Path) -> None:
        plan = Plan.load(plan_dir / "plan.json")
        self.procs = {}
        self.log_paths = []
        for node in {r.node for r in plan.ranks}:
            index = [n.name for n in NODES].index(node)
            log = logs / f"{node}.log"
            self.log_paths.append(log)
            script = plan_dir / "launch" / f"node-{node}.sh"
            argv = ["bash", str(script), *args]
            self.procs[node] = self.cluster.start(index, argv, log=log, env=self.env, cwd=logs)

    def kill_node(self, node: str) -> None:
        self.cluster.kill_node([n.name for n in NODES].index(node))
        self.procs.pop(node).wait()

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs.values())

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.log_paths)


class _RehearsalLauncher(_Launcher):
    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: Path | None = None
        self.plan: Plan | None = None

    def start(self, plan_dir: Path, args: list[str], logs: Path) -> None:
        self.plan = Plan.load(plan_dir / "plan.json")
        self.log = logs / "rehearse.log"
        with self.log.open("wb") as sink:
            self.proc = subprocess.Popen(
                [*HPLAN, "rehearse", str(plan_dir / "plan.json"), *args],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )

    def kill_node(self, node: str) -> None:
        assert self.plan is not None and self.proc is not None
        ranks = {str(r.rank) for r in self.plan.ranks if r.node == node}
        for pid in _descendants(self.proc.pid):
            argv = _cmdline(pid)
            if "hplan.runtime.rehearsal" in argv and _rank_of(argv) in ranks:
                os.kill(pid, 9)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def logs(self) -> str:
        return self.log.read_text(errors="replace") if self.log else ""


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            children = (
                (task / "children").read_text().split() if (task / "children").exists() else []
            )
            for child in children:
                found.append(int(child))
                todo.append(int(child))
    return found


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _rank_of(argv: list[str]) -> str | None:
    return argv[argv.index("--rank") + 1] if "--rank" in argv else None


def lose_a_node(
    launcher: _Launcher,
    where: str,
    out: Path,
    cluster_file: Path,
    work: Path,
    *,
    every: int,
    rng: random.Random,
    env: dict[str, str],
) -> LostNode:
    plan = Plan.load(out / "plan.json")
    nodes_used = [r.node for r in plan.ranks]
    victim = next(n for n in reversed(nodes_used) if n != plan.ranks[0].node)
    ckpt, first_metrics, second_metrics = work / "ckpt", work / "m1", work / "m2"
    for path in (ckpt, first_metrics, second_metrics, work / "logs1", work / "logs2"):
        path.mkdir(parents=True, exist_ok=True)
    kill_step = rng.randrange(2 * every, 4 * every)
    common = ["--checkpoint-dir", str(ckpt), "--checkpoint-every-steps", str(every)]
    launcher.start(out, ["--steps", "100000", *common, "--metrics-dir", str(first_metrics)],
                   work / "logs1")  # fmt: skip

    def reached() -> bool:
        if not launcher.running():
            raise SystemExit(f"the run ended before step {kill_step}:\n{launcher.logs()[-3000:]}")
        return _steps_done(first_metrics) >= kill_step

    _wait(reached, 600, f"step {kill_step}")
    launcher.kill_node(victim)
    killed_s = time.monotonic()
    _wait(lambda: not launcher.running(), 120, "the other ranks to exit")
    exited_s = time.monotonic()
    exit_lines = [
        line
        for line in launcher.logs().splitlines()
        if line.startswith(("hplan run", "hplan: error"))
    ]
    done = _steps_done(first_metrics)
    _hplan("replan", str(out / "plan.json"), "-c", str(cluster_file), "--without", victim,
           "-o", str(work / "replan"), "--time-limit", "20", env=env)  # fmt: skip
    replanned_s = time.monotonic()
    launcher.start(work / "replan", ["--steps", str(2 * every), *common, "--resume",
                   "--metrics-dir", str(second_metrics)], work / "logs2")  # fmt: skip
    _wait(lambda: _steps_done(second_metrics) >= 1, 600, "the first resumed step")
    resumed_s = time.monotonic()
    _wait(lambda: not launcher.running(), 600, "the resumed run to end")
    resumed_from = min(r.step for records in _records(second_metrics).values() for r in records)
    rank_logs = "".join(p.read_text(errors="replace") for p in second_metrics.glob("*.log"))
    loads = re.findall(r"resumed at step \d+ from \S+ in ([0-9.]+) s", launcher.logs() + rank_logs)
    before, after = _global_losses(first_metrics), _global_losses(second_metrics)
    common_steps = sorted(set(before) & set(after))
    rel = max(
        (abs(after[s] - before[s]) / max(abs(before[s]), 1e-12) for s in common_steps),
        default=float("nan"),
    )
    return LostNode(
        where=where,
        killed_at_step=done,
        all_exited_s=exited_s - killed_s,
        replan_written_s=replanned_s - killed_s,
        resumed_s=resumed_s - killed_s,
        load_s=float(loads[0]) if loads else None,
        steps_lost=done - resumed_from,
        resumed_from=resumed_from,
        loss_rel_diff=rel,
        exit_lines=exit_lines,
    )


# --------------------------------------------------------------------------- the pause
def checkpoint_pauses(work: Path, env: dict[str, str]) -> list[tuple[str, float, float, float]]:
    """[(mode, median pause per periodic checkpoint s, median step s, checkpoint MB)]."""
    work.mkdir(parents=True, exist_ok=True)
    cluster = work / "two-cpu.yaml"
    cluster.write_text(
        "name: two-cpu\nnodes:\n  - {name: box, host: 127.0.0.1, devices: [{type: cpu, count: 2}]}\n",
        encoding="utf-8",
    )
    out = work / "out"
    pause_env = {**env, **PAUSE_GPT}
    _hplan("solve", str(GPT), "-c", str(cluster), "-o", str(out), "-b", "4", "--strategy",
           "ddp", "--master-port", str(PORT + 7), env=pause_env)  # fmt: skip
    rows = []
    for mode, flag in (("synchronous", ["--sync-checkpoints"]), ("asynchronous", [])):
        ckpt, metrics = work / f"ckpt-{mode}", work / f"m-{mode}"
        proc = subprocess.run(
            ["bash", str(out / "launch" / "node-box.sh"), "--steps", "13", "--checkpoint-dir",
             str(ckpt), "--checkpoint-every-steps", "3", "--metrics-dir", str(metrics), *flag],
            capture_output=True, text=True, env=pause_env,
        )  # fmt: skip
        if proc.returncode != 0:
            raise SystemExit(f"the {mode} run failed:\n{proc.stderr[-2000:]}")
        found = re.search(r"periodic \(\w+\) paused training ([0-9.]+) s each", proc.stderr)
        assert found, proc.stderr[-2000:]
        steps = [r.step_time_s for r in read_rank_metrics(metrics / "rank-0.jsonl")[1:]]
        size_mb = sum(f.stat().st_size for f in (ckpt / "step-13").iterdir()) / 1e6
        rows.append((mode, float(found.group(1)), statistics.median(steps), size_mb))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=4, help="checkpoint every N steps")
    parser.add_argument("--seed", type=int, help="seed of the kill step (default: random)")
    parser.add_argument("--skip-namespaces", action="store_true")
    parser.add_argument("--keep", type=Path, help="keep the work files here")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    rng = random.Random(seed)
    work = args.keep or Path(tempfile.mkdtemp(prefix="hplan-durability-"))
    work.mkdir(parents=True, exist_ok=True)
    env = _env(SMALL_GPT)
    results: list[LostNode] = []
    console.print(f"seed {seed}; work files in {work}")
    try:
        why_not = None if not args.skip_namespaces else "--skip-namespaces"
        why_not = why_not or available()
        if why_not is None:
            with NamespaceCluster(NODES, tag="hpd") as cluster:
                hosts = [cluster.host(i) for i in range(len(NODES))]
                cluster_file = work / "ns-cluster.yaml"
                cluster_file.write_text(_cluster_yaml(hosts), encoding="utf-8")
                out = work / "ns-out"
                _hplan("solve", str(GPT), "-c", str(cluster_file), "-o", str(out), "-b", "24",
                       "--time-limit", "20", "--master-port", str(PORT), env=env)  # fmt: skip
                launcher = _NamespaceLauncher(cluster, env)
                results.append(lose_a_node(launcher, "namespaces, torchrun", out, cluster_file,
                                           work / "ns", every=args.every, rng=rng, env=env))  # fmt: skip
        else:
            console.print(f"namespaces skipped: {why_not}")
        cluster_file = work / "local-cluster.yaml"
        cluster_file.write_text(_cluster_yaml(["127.0.0.1"] * len(NODES)), encoding="utf-8")
        out = work / "local-out"
        _hplan("solve", str(GPT), "-c", str(cluster_file), "-o", str(out), "-b", "24",
               "--time-limit", "20", "--master-port", str(PORT + 3), env=env)  # fmt: skip
        results.append(lose_a_node(_RehearsalLauncher(env), "rehearsal", out, cluster_file,
                                   work / "rehearsal", every=args.every, rng=rng, env=env))  # fmt: skip
        pauses = checkpoint_pauses(work / "pause", _env({}))
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    out_table = table(
        f"a node lost (checkpoint every {args.every} steps; times from the kill)",
        ["where", "killed after step", "all exited s", "re-plan written s", "resumed s",
         "load s", "resumed from", "steps lost", "loss rel diff"],
    )  # fmt: skip
    for r in results:
        out_table.add_row(
            r.where, str(r.killed_at_step), f"{r.all_exited_s:.1f}", f"{r.replan_written_s:.1f}",
            f"{r.resumed_s:.1f}", "-" if r.load_s is None else f"{r.load_s:.2f}",
            str(r.resumed_from), str(r.steps_lost), f"{r.loss_rel_diff:.1e}",
        )  # fmt: skip
    console.print(out_table)
    for r in results:
        for line in sorted(set(r.exit_lines)):
            console.print(f"  {r.where}: {line}", highlight=False, soft_wrap=True)
    pause_table = table(
        "checkpoint pause, GPT example on 2 ranks (rank 0, median of the periodic saves)",
        ["save", "pause s", "step s", "pause / step", "checkpoint MB"],
    )
    for mode, pause_s, step_s, size_mb in pauses:
        pause_table.add_row(mode, f"{pause_s:.3f}", f"{step_s:.3f}", f"{pause_s / step_s:.2f}",
                            f"{size_mb:.0f}")  # fmt: skip
    console.print(pause_table)
    sync, asyn = pauses[0][1], pauses[1][1]
    console.print(f"asynchronous / synchronous pause: {asyn / sync:.2f}")


if __name__ == "__main__":
    main()
