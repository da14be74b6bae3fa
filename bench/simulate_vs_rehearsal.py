"""Runtime vs simulator: rehearse the GPT example on several plan shapes and compare the
measured step time with the simulated one (issue 4, part 6; target: within 15%).

Every plan is rehearsed with `hplan rehearse --json --trace` (all ranks on this machine,
emulated hardware); the measured step time is the median over the steps after the first,
in emulated seconds. The simulated step time is `hplan simulate`'s, times the rehearsal's
time scale (emulated seconds per second of the plan's hardware).

- GPU plans (NCCL, replayed compute): each forward, backward and optimizer step lasts the
  plan's prediction, so the comparison checks the simulator's model of the runtime's
  schedule, point-to-point transfers, send completion, all-reduce and their overheads.
  Shapes: data parallel and a 2-stage pipeline as `hplan solve` makes them, and a mixed
  layout (a one-stage replica beside a 2-stage pipeline) fixed by hand, because on GPUs the
  small example model is launch-bound and the solver never pipelines it next to a replica.
- cpu plans (gloo, stretched real compute): compute is this CPU's, stretched per device, so
  the plan's roofline prediction for a "cpu" device is only as good as the catalog entry.
  For these the table also gives the simulation fed with the per-rank forward, backward and
  optimizer times measured in the same rehearsal ("sim, measured compute"), which again
  isolates schedule, transfers and synchronisation.

Emulation slack: a rehearsal replays plan-hardware time on this CPU, whose own per-op
Python, gloo and optimizer overheads are fixed in real seconds; at the rehearsal's default
dilation (just enough for the ranks' CPU demand to fit the cores) they can exceed the
modelled durations and the measurement then shows this host, not the plan. The bench
rehearses at ``--slack`` (default 3) times the default dilation, so the modelled durations
dominate; ``--slack 1`` gives the rehearsal's defaults.

    python bench/simulate_vs_rehearsal.py [--steps 8] [--only gpu|cpu] [--slack 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from common import CLUSTERS, GPT, HPLAN, console, solve, table, write_cluster

from hplan.planner import api
from hplan.planner.cost.evaluate import evaluate
from hplan.planner.cost.layout import Layout, ReplicaLayout, StageLayout
from hplan.planner.cost.problem import PlanningProblem
from hplan.planner.sim.engine import SimSpec, simulate
from hplan.planner.sim.spec import spec_from_plan
from hplan.planner.solve.solver import SolveResult
from hplan.runtime.contract.plan import Plan, SolverStatus
from hplan.runtime.rehearsal.rehearse import default_dilation

DP_GPUS = """\
name: dp-4090-3090
nodes:
  - name: box
    host: 127.0.0.1
    devices:
      - type: rtx4090
      - type: rtx3090
"""
PIPELINE_GPUS = """\
# Two 3090s that cannot hold the model alone (6 MB usable each), on two nodes, 10 Gb/s.
name: pipeline-small-3090s
nodes:
  - {name: a, host: 127.0.0.1, devices: [{type: rtx3090, memory_gb: 1.0804}]}
  - {name: b, host: 127.0.0.1, devices: [{type: rtx3090, memory_gb: 1.0804}]}
links:
  inter_node: {bandwidth_gbit_per_s: 10, latency_us: 50}
"""
MIXED_GPUS = """\
name: mixed-4090-3090s
nodes:
  - {name: a, host: 127.0.0.1, devices: [{type: rtx4090}]}
  - {name: b, host: 127.0.0.1, devices: [{type: rtx3090, count: 2}]}
links:
  inter_node: {bandwidth_gbit_per_s: 1, latency_us: 100}
"""
TIGHT_CPUS = """\
# Two catalog cpus with 6 MB each: too little for the whole model, so hplan pipelines them.
name: two-small-cpus
nodes:
  - {name: box, host: 127.0.0.1, devices: [{type: cpu, count: 2, memory_gb: 0.006}]}
"""
TWO_CPUS = """\
name: two-cpus
nodes:
  - name: box
    host: 127.0.0.1
    devices:
      - {type: cpu, peak_tflops: 0.2, memory_bandwidth_gb_per_s: 40}
      - {type: cpu}
"""


@dataclass(frozen=True)
class Case:
    """One plan shape to rehearse."""

    name: str
    kind: str
    """``gpu`` or ``cpu``."""
    make: Callable[[Path], Path]
    """Writes the plan into a folder and returns the path of plan.json."""


# --------------------------------------------------------------------------- plans
def _solved(cluster_text: str | None, cluster: Path | None, batch: int, *extra: str):  # type: ignore[no-untyped-def]
    def make(out: Path) -> Path:
        path = cluster or write_cluster(cluster_text or "")
        result = solve(GPT, path, out, env={}, args=["-b", str(batch), *extra])
        if "error" in result:
            raise SystemExit(f"solve failed: {result['error']}")
        return out / "plan.json"

    return make


def _mixed_layout(problem: PlanningProblem) -> Layout:
    """Replica 0: the 4090 alone (16 samples); replica 1: the 3090s as a 2-stage pipeline."""
    half = problem.num_units // 2
    return Layout(
        (
            ReplicaLayout((StageLayout(0, 0, problem.num_units),), 4, 4, 16),
            ReplicaLayout(
                (StageLayout(1, 0, half), StageLayout(2, half, problem.num_units)), 2, 8, 16
            ),
        )
    )


def _hand_layout(out: Path) -> Path:
    """Plan the hand-made mixed layout with hplan's own cost model, report and emitter."""
    from hplan.planner.emit.artifacts import emit

    def decide(problem: PlanningProblem, _request: api.SolveRequest) -> SolveResult:
        layout = _mixed_layout(problem)
        return SolveResult(
            layout, evaluate(problem, layout), SolverStatus.HEURISTIC, None, "none",
            "bench: hand-made mixed layout", ("layout fixed by bench/simulate_vs_rehearsal.py",),
        )  # fmt: skip

    original = api._decide
    api._decide = decide  # type: ignore[assignment]
    try:
        request = api.SolveRequest(
            model_path=GPT, cluster_path=write_cluster(MIXED_GPUS), global_batch_size=32,
            micro_batch_sizes=(1, 2, 4), out_dir=out,
        )  # fmt: skip
        outcome = api.plan_training(request)
    finally:
        api._decide = original
    emit(outcome.plan, out)
    return out / "plan.json"


CASES = (
    Case("data parallel (solved)", "gpu", _solved(DP_GPUS, None, 32)),
    Case("2-stage pipeline (solved)", "gpu", _solved(PIPELINE_GPUS, None, 32)),
    Case("mixed: 1 + 2-stage (hand layout)", "gpu", _hand_layout),
    Case("data parallel (solved)", "cpu", _solved(TWO_CPUS, None, 16)),
    Case("2-stage pipeline (solved)", "cpu", _solved(TIGHT_CPUS, None, 16)),
    Case("mixed (cpu-small-memory, solved)", "cpu", _solved(None, CLUSTERS / "cpu-small-memory.yaml", 64)),
)  # fmt: skip


# --------------------------------------------------------------------------- measuring
def _rehearse(plan_path: Path, steps: int, trace: Path, slack: float = 1.0) -> dict:
    cmd = [*HPLAN, "rehearse", str(plan_path), "--steps", str(steps), "--json"]
    cmd += ["--trace", str(trace)]
    if slack != 1.0:
        dilation = slack * default_dilation(Plan.load(plan_path), os.cpu_count() or 1)
        cmd += ["--dilation", f"{dilation:.6g}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"rehearsal of {plan_path} failed: {proc.stderr.strip()[-400:]}")
    return json.loads(proc.stdout)


def measured_compute(trace_path: Path) -> dict[int, dict[str, float]]:
    """Per rank, the mean forward and backward and the optimizer time (plan seconds)."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    spans: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for e in events:
        if e["ph"] != "X" or e["cat"] != "compute":
            continue
        what = "optimizer" if e["name"] == "optimizer" else e["name"].split(".")[1]
        spans[e["pid"]][what].append(e["dur"] / 1e6)
    return {
        rank: {what: statistics.fmean(values) for what, values in kinds.items()}
        for rank, kinds in spans.items()
    }


def with_compute(spec: SimSpec, compute: dict[int, dict[str, float]]) -> SimSpec:
    """``spec`` with every stage's compute replaced by measured means."""
    replicas = []
    for replica in spec.replicas:
        stages = []
        for stage in replica.stages:
            times = compute[stage.rank]
            num_mb = len(stage.forward_s)
            stages.append(
                replace(
                    stage,
                    forward_s=(times["F"],) * num_mb,
                    backward_s=(times["B"],) * num_mb,
                    optimizer_s=times.get("optimizer", 0.0),
                )
            )
        replicas.append(replace(replica, stages=tuple(stages)))
    return replace(spec, replicas=tuple(replicas))


def _shape(plan: Plan) -> str:
    stages = [len(plan.replica_ranks(r)) for r in range(plan.num_replicas)]
    return " + ".join(f"{n}-stage" if n > 1 else "1" for n in stages)


def run_case(case: Case, steps: int, tmp: Path, slack: float) -> list[str]:
    """One table row: shape, measured, simulated and the errors."""
    out = tmp / f"{case.kind}-{case.name.split(' ')[0]}-{abs(hash(case.name)) % 1000}"
    plan_path = case.make(out)
    plan = Plan.load(plan_path)
    trace = out / "measured-trace.json"
    result = _rehearse(plan_path, steps, trace, slack)
    scale = result["time_scale"]
    timed = [s["step_time_s"] for s in result["steps"][1:]] or [result["steps"][0]["step_time_s"]]
    measured_s = statistics.median(timed)
    spec = spec_from_plan(plan, scale_partial_microbatches=case.kind == "cpu")
    simulated_s = simulate(spec).step_time_s * scale
    model_s = plan.report.predicted_step_time_s * scale
    row = [
        case.kind,
        case.name,
        _shape(plan),
        f"{measured_s * 1e3:.1f}",
        f"{simulated_s * 1e3:.1f}",
        f"{(simulated_s / measured_s - 1) * 100:+.1f}%",
        f"{(model_s / measured_s - 1) * 100:+.1f}%",
    ]
    if case.kind == "cpu":
        fed = simulate(with_compute(spec, measured_compute(trace))).step_time_s * scale
        row.append(f"{(fed / measured_s - 1) * 100:+.1f}%")
    else:
        row.append("-")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--only", choices=["gpu", "cpu"])
    parser.add_argument(
        "--slack", type=float, default=3.0, help="rehearse at this many times the default dilation"
    )
    args = parser.parse_args()
    out = table(
        f"GPT example: measured (rehearsal) vs simulated step time, {args.steps} steps, "
        f"median after the first, slack {args.slack:g}; emulated ms",
        [
            "plans",
            "shape",
            "replicas",
            "measured ms",
            "simulated ms",
            "sim error",
            "cost-model error",
            "sim error, measured compute",
        ],
    )
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            if args.only and case.kind != args.only:
                continue
            out.add_row(*run_case(case, args.steps, Path(tmp), args.slack))
            console.print(f"done: {case.kind} {case.name}")
    console.print(out)


if __name__ == "__main__":
    main()
