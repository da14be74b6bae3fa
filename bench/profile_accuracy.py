"""Accuracy on this machine (issue 3, part 7): predicted vs measured step time of cpu plans.

For the GPT example on all-``cpu`` rehearsal clusters (every device is one of this
machine's cores at the catalog cpu speed, so rehearsal runs real compute):

1. ``hplan profile --model`` times every unit here; ``hplan bandwidth --local`` measures the
   links between local ranks (gloo on 127.0.0.1) of each cluster;
2. ``hplan solve --profile --bandwidth`` plans three shapes: data parallel (three cpus),
   pipeline (three cpus with 6 MB each: the model does not fit on one) and mixed (two cpus
   plus two with 6 MB, at most two stages: replicas that differ in batch share and split);
3. ``hplan rehearse`` runs each plan with ``--dilation D --time-scale D``: compute is
   stretched to D x its real CPU time, links to D x their measured time, so one second of
   the plan's hardware (this machine) is D emulated seconds and the prediction in emulated
   units is ``predicted_step_time_s * D``. (The rehearsal's default time scale divides by
   its own CPU timing of the model and would hide a wrong profile.) D defaults to 16, more
   than the rehearsal's own default (at least 4, and 1.25 x ranks / cores): what the
   rehearsal does in real time besides the stretched compute and links (Python, gloo's
   hand-overs, the processes' wake-ups on 2 shared cores; ~12 ms per step of the 3-stage
   plan here, fitted to the gaps below) counts only 1/D in the plan's seconds. Rehearsing
   one 3-stage plan (before gloo receives were posted ahead), the step exceeded its slowest
   stage's compute by 9.5, 8.1 and 7.2 ms at D = 4, 8 and 16 (6.2 ms simulated).
4. ``hplan calibrate`` (the library call, pooling the three runs) corrects the profile;
   each plan is re-solved with it and rehearsed again.

Prints, per plan, the cost model's prediction (``report.predicted_step_time_s``), the
event-driven simulation of the plan (``report.simulated_step_time_s``), the measured step
time and both errors, before and after. Targets: within 15% before calibration, within
10% after. Numbers depend on the machine's load: run it alone. Compute after each of the
emulation's sleeps runs colder than the profile's back-to-back timing
(``bench/cold_compute.py``: 1.24-1.28x CPU time after a sleep of 3x, i.e. at D = 4), so from
the second step each rank stretches its own stage's warm CPU time, timed back to back after
the first step (``runtime/rehearsal/warm_compute.py``; before, stretching each block's own CPU time
put the error before calibration at +38..+44%).

Last, the machine's own drift between the two rehearsals of each plan whose layout the
calibration kept: after / before of each rank's warm CPU time of the same stage (-9.3% to
+9.3% within two minutes in seven runs on this project's 2-core VM).

    python bench/profile_accuracy.py [--steps 16] [--batch 24] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

from common import GPT, HPLAN, console, table

from hplan.planner.profiling.calibrate import calibrate, load_runs, write_profile
from hplan.planner.profiling.profile_file import Profile
from hplan.runtime.contract.plan import Plan
from hplan.runtime.rehearsal.rehearse import DILATION_MARGIN

CLUSTERS = {
    "data parallel": ("three-cpu", [("", 3)], []),
    "pipeline": ("three-small-cpu", [("memory_gb: 0.006", 3)], []),
    "mixed": ("two-plus-two-small-cpu", [("", 2), ("memory_gb: 0.006", 2)], ["--max-stages", "2"]),
}


def _cluster_yaml(name: str, groups: list[tuple[str, int]]) -> str:
    lines = [f"name: {name}", "nodes:", "  - name: box", "    host: 127.0.0.1", "    devices:"]
    for extra, count in groups:
        lines += ["      - type: cpu", f"        count: {count}"]
        lines += [f"        {extra}"] if extra else []
    return "\n".join(lines) + "\n"


def _run(cmd: list[str], what: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise SystemExit(f"{what} failed: {tail[0]}")
    return proc.stdout


def _dilation(num_ranks: int, least: float) -> float:
    """At least ``least`` and the rehearsal's default (``rehearse.default_dilation``)."""
    cores = len(os.sched_getaffinity(0))
    return max(least, DILATION_MARGIN * num_ranks / cores)


def _solve(
    cluster: Path, out: Path, profile: Path, bandwidth: Path, batch: int, extra: list[str]
) -> Plan:
    cmd = [*HPLAN, "solve", str(GPT), "--cluster", str(cluster), "-o", str(out), *extra]
    cmd += ["--profile", str(profile), "--bandwidth", str(bandwidth)]
    cmd += ["--global-batch-size", str(batch), "--micro-batch-sizes", "1,2,4,8"]
    _run(cmd, f"solve {cluster.name}")
    return Plan.load(out / "plan.json")


def _rehearse(plan_dir: Path, runs: Path, steps: int, dilation: float) -> float:
    """Median step time (emulated seconds) over the steps after the first."""
    cmd = [*HPLAN, "rehearse", str(plan_dir / "plan.json"), "--steps", str(steps), "--json"]
    cmd += ["--dilation", repr(dilation), "--time-scale", repr(dilation)]
    cmd += ["--metrics-dir", str(runs)]
    result = json.loads(_run(cmd, f"rehearse {plan_dir.name}"))
    return statistics.median(s["step_time_s"] for s in result["steps"][1:])


def _shape(plan: Plan) -> str:
    replicas = sorted({r.replica for r in plan.ranks})
    stages = [sum(1 for r in plan.ranks if r.replica == k) for k in replicas]
    return " + ".join(f"{n}-stage" for n in stages)


def _measure(
    work: Path, label: str, profile: Path, args: argparse.Namespace
) -> dict[str, tuple[Plan, float, float, Path]]:
    """Solve and rehearse every shape: shape -> (plan, dilation, measured step s, runs)."""
    out = {}
    batch, steps = args.batch, args.steps
    for shape, (name, _groups, extra) in CLUSTERS.items():
        cluster = work / f"{name}.yaml"
        bandwidth = work / f"bw-{name}.json"
        plan = _solve(cluster, work / label / name, profile, bandwidth, batch, extra)
        dilation = _dilation(plan.world_size, args.dilation)
        runs = work / label / f"runs-{name}"
        measured_s = _rehearse(work / label / name, runs, steps, dilation)
        out[shape] = (plan, dilation, measured_s, runs)
    return out


def _print(
    title: str, results: dict[str, tuple[Plan, float, float, Path]]
) -> tuple[list[float], list[float]]:
    """Print the table; return the errors against the cost model and the simulator."""
    columns = ["plan", "layout", "ranks", "D", "predicted s", "simulated s", "measured s"]
    out = table(title, [*columns, "error (predicted)", "error (simulated)"])
    errors: tuple[list[float], list[float]] = ([], [])
    for shape, (plan, dilation, measured_s, _) in results.items():
        predicted_s = plan.report.predicted_step_time_s * dilation
        simulated_s = (plan.report.simulated_step_time_s or math.nan) * dilation
        errors[0].append(measured_s / predicted_s - 1.0)
        errors[1].append(measured_s / simulated_s - 1.0)
        out.add_row(
            shape,
            _shape(plan),
            str(plan.world_size),
            f"{dilation:.2f}",
            f"{predicted_s:.4f}",
            f"{simulated_s:.4f}",
            f"{measured_s:.4f}",
            f"{errors[0][-1] * 100:+.1f}%",
            f"{errors[1][-1] * 100:+.1f}%",
        )
    console.print(out)
    return errors


def _warm_ms(runs: Path) -> dict[int, float]:
    """Rank -> its stage's warm forward + backward CPU ms (summed over micro-batch sizes),
    from the ``warm compute (CPU ms) ...`` line of each rank's log."""
    out = {}
    for log in runs.glob("rank-*.log"):
        line = next((x for x in log.read_text().splitlines() if "warm compute (CPU ms)" in x), "")
        figures = re.findall(r"(?:forward|backward) ([0-9.]+)", line)
        if figures:
            out[int(log.stem.split("-")[1])] = sum(float(f) for f in figures)
    return out


def _print_drift(
    before: dict[str, tuple[Plan, float, float, Path]],
    after: dict[str, tuple[Plan, float, float, Path]],
) -> None:
    """The machine's drift between the two rehearsals of a plan the calibration left as it
    was (same units, micro-batch sizes and shares per rank): after / before of each rank's
    own warm CPU time of the same stage. No prediction can follow it; it says how much of an
    error after calibration the machine made by itself."""
    parts = []
    for shape, (plan, _, _, runs) in before.items():
        plan_after, _, _, runs_after = after[shape]
        same = [(r.units, r.micro_batch_size, r.num_samples) for r in plan.ranks] == [
            (r.units, r.micro_batch_size, r.num_samples) for r in plan_after.ranks
        ]
        was, now = _warm_ms(runs), _warm_ms(runs_after)
        if not same or set(was) != set(now) or not was:
            parts.append(f"{shape}: layout changed")
            continue
        drift = statistics.median(now[r] / was[r] for r in was)
        parts.append(f"{shape}: {(drift - 1) * 100:+.1f}%")
    console.print(
        "machine drift (each rank's warm stage time, after / before): " + ", ".join(parts)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--dilation", type=float, default=16.0, help="at least this dilation")
    parser.add_argument("--keep", type=Path, help="keep profiles, plans and metrics here")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="hplan-accuracy-"))
    work.mkdir(parents=True, exist_ok=True)
    console.print(f"load average before: {os.getloadavg()[0]:.2f}; files in {work}")
    _run(
        [*HPLAN, "profile", "--model", str(GPT), "-o", str(work / "prof"), "--device", "cpu"],
        "profile",
    )
    for name, groups, _extra in CLUSTERS.values():
        cluster = work / f"{name}.yaml"
        cluster.write_text(_cluster_yaml(name, groups), encoding="utf-8")
        num = sum(count for _, count in groups)
        cmd = [*HPLAN, "bandwidth", "--cluster", str(cluster), "--local", str(num)]
        _run([*cmd, "-o", str(work / f"bw-{name}.json")], f"bandwidth {name}")
    before = _measure(work, "before", work / "prof", args)
    before_errors = _print("before calibration (profile from `hplan profile --model`)", before)
    observations = [(plan, load_runs(runs)) for plan, _, _, runs in before.values()]
    calibration = calibrate(observations, Profile.load(work / "prof"))
    write_profile(calibration.profile, work / "calibrated")
    corrections = ", ".join(
        f"{k} x {v:.3f} (forward x {phases.get(k, (v, v))[0]:.3f}, backward x "
        f"{phases.get(k, (v, v))[1]:.3f}, optimizer x "
        f"{calibration.optimizer_corrections.get(k, 1.0):.3f})"
        for k, v in calibration.kind_corrections.items()
        if (phases := calibration.phase_corrections) is not None
    )
    stragglers = ", ".join(f"{f.device} x {f.time_factor:.2f}" for f in calibration.factors)
    console.print(f"calibration: {corrections}; stragglers: {stragglers or 'none'}")
    after = _measure(work, "after", work / "calibrated", args)
    after_errors = _print("after one calibrate (pooled over the three runs)", after)
    _print_drift(before, after)
    for k, source in enumerate(("cost model (report.predicted)", "simulator (report.simulated)")):
        worst_before = max(abs(e) for e in before_errors[k])
        worst_after = max(abs(e) for e in after_errors[k])
        console.print(
            f"{source}: largest |error| {worst_before * 100:.1f}% before (target 15%), "
            f"{worst_after * 100:.1f}% after (target 10%)"
        )
    console.print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
