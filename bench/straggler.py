"""The straggler, end to end in rehearsal (issue 3, part 6): find it, re-plan, measure.

On a one-node cluster of three ``cpu`` devices, one of which (``box/2``) runs 40% slower
than its siblings (``hplan rehearse --slowdown box/2=1.4``):

1. ``hplan profile --model`` times the GPT example's units on this machine;
2. ``hplan solve --profile`` plans as if the three devices were equal (plan A);
3. ``hplan rehearse A --slowdown box/2=1.4`` measures the step time with the straggler;
4. ``hplan calibrate A RUNS --profile`` prints the error table, flags ``box/2`` and writes
   a corrected profile with its factor;
5. ``hplan solve --profile CORRECTED`` re-plans (plan B), and
   ``hplan rehearse B --slowdown box/2=1.4`` measures again, under the same emulation
   (``--dilation D --time-scale D``).

Prints step time and samples/s before and after, and each device's batch share; plan A
rehearsed without the straggler is the reference for what equal devices would give. The
global batch (120, micro-batches of up to 8) leaves the solver room to shift whole
micro-batches between devices (with 48, 16/16/16 stays the best split at micro-batch 8).

    python bench/straggler.py [--steps 12] [--batch 120] [--factor 1.4] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from common import GPT, HPLAN, console, table

from hplan.runtime.contract.plan import Plan

CLUSTER = """\
name: three-cpu
nodes:
  - name: box
    host: 127.0.0.1
    devices:
      - type: cpu
        count: 3
"""
SLOW = "box/2"


def _run(cmd: list[str], what: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise SystemExit(f"{what} failed: {tail[0]}")
    if what.startswith("calibrate"):
        console.print(proc.stderr)
    return proc.stdout


def _solve(work: Path, name: str, profile: Path, batch: int) -> Plan:
    out = work / name
    cmd = [*HPLAN, "solve", str(GPT), "--cluster", str(work / "cluster.yaml"), "-o", str(out)]
    cmd += ["--profile", str(profile), "--global-batch-size", str(batch)]
    _run([*cmd, "--micro-batch-sizes", "1,2,4,8"], f"solve {name}")
    return Plan.load(out / "plan.json")


def _rehearse(work: Path, name: str, runs: str, args: argparse.Namespace, slow: bool) -> float:
    """Median step time (emulated seconds) over the steps after the first."""
    cmd = [*HPLAN, "rehearse", str(work / name / "plan.json"), "--json"]
    cmd += ["--steps", str(args.steps), "--metrics-dir", str(work / runs)]
    cmd += ["--dilation", repr(args.dilation), "--time-scale", repr(args.dilation)]
    cmd += ["--slowdown", f"{SLOW}={args.factor}"] if slow else []
    result = json.loads(_run(cmd, f"rehearse {name}"))
    return statistics.median(s["step_time_s"] for s in result["steps"][1:])


def _shares(plan: Plan) -> str:
    """Samples x units per device, as a share of the plan's total work."""
    work = {r.device: r.num_samples * len(r.units) for r in plan.ranks}
    total = sum(work.values())
    names = [d.name for d in plan.cluster.devices]
    return " ".join(f"{n}:{work.get(n, 0) / total:.0%}" for n in names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=120)
    parser.add_argument("--factor", type=float, default=1.4, help="slowdown of box/2")
    parser.add_argument("--dilation", type=float, default=4.0, help="rehearsal dilation")
    parser.add_argument("--keep", type=Path, help="keep profiles, plans and metrics here")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="hplan-straggler-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "cluster.yaml").write_text(CLUSTER, encoding="utf-8")
    console.print(f"load average before: {os.getloadavg()[0]:.2f}; files in {work}")
    _run(
        [*HPLAN, "profile", "--model", str(GPT), "-o", str(work / "prof"), "--device", "cpu"],
        "profile",
    )
    plan_a = _solve(work, "plan-a", work / "prof", args.batch)
    equal_s = _rehearse(work, "plan-a", "runs-a-equal", args, slow=False)
    before_s = _rehearse(work, "plan-a", "runs-a", args, slow=True)
    cmd = [*HPLAN, "calibrate", str(work / "plan-a" / "plan.json"), str(work / "runs-a")]
    _run([*cmd, "--profile", str(work / "prof"), "-o", str(work / "calibrated")], "calibrate")
    plan_b = _solve(work, "plan-b", work / "calibrated", args.batch)
    after_s = _rehearse(work, "plan-b", "runs-b", args, slow=True)
    out = table(
        f"{SLOW} {args.factor:g}x slower; emulated seconds (dilation = time scale = "
        f"{args.dilation:g}); global batch {args.batch}",
        ["run", "work share (samples x units)", "step s", "samples/s"],
    )
    rows = (
        ("plan A, equal devices (reference)", plan_a, equal_s),
        (f"plan A, {SLOW} slowed (before)", plan_a, before_s),
        (f"plan B after calibrate, {SLOW} slowed (after)", plan_b, after_s),
    )
    for label, plan, step_s in rows:
        out.add_row(label, _shares(plan), f"{step_s:.4f}", f"{args.batch / step_s:.1f}")
    console.print(out)
    console.print(
        f"step time before {before_s:.4f} s, after {after_s:.4f} s: "
        f"{before_s / after_s:.2f}x faster; load average after: {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
