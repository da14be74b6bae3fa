"""Rehearsal benchmark: measured samples/s of hplan's plan against plain DDP, one emulation.

Plans the GPT example for a cluster twice — hplan's layout, and equal-batch data parallel on
every device (`--strategy ddp`, what DDP does) — then rehearses both on this machine with the
same dilation and time scale (emulated seconds per second of plan hardware), one after the
other in the same run, and prints measured (and predicted) samples/s side by side.
Target (issue 2): >= 1.2x on mixed-3090-4090.

    python bench/rehearsal.py [--cluster mixed-3090-4090] [--steps 20] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from common import CLUSTERS, GPT, HPLAN, console, solve, table

from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.contract.plan import Plan
from hplan.runtime.rehearsal.rehearse import (
    default_dilation,
    default_time_scale,
    measure_cpu_time_per_sample,
)


def _one_emulation(plans: list[Plan]) -> tuple[float, float]:
    """The dilation and time scale that suit every plan (the largest of their defaults)."""
    cores = len(os.sched_getaffinity(0))
    model_file = load_model_file(GPT)
    dilations, scales = [], []
    for plan in plans:
        dilation = default_dilation(plan, cores)
        cpu_s = measure_cpu_time_per_sample(model_file, plan)
        dilations.append(dilation)
        scales.append(default_time_scale(plan, dilation, cpu_s))
    return max(dilations), max(scales)


def _rehearse(plan_path: Path, steps: int, dilation: float, scale: float) -> dict:
    cmd = [*HPLAN, "rehearse", str(plan_path), "--steps", str(steps), "--json"]
    cmd += ["--dilation", f"{dilation:.6g}", "--time-scale", f"{scale:.6g}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"rehearsal of {plan_path} failed: {proc.stderr.strip().splitlines()[-1]}")
    return json.loads(proc.stdout)


def _plans(cluster: Path, batch: int, tmp: Path) -> dict[str, Path]:
    plans = {}
    for strategy in ("hplan", "ddp"):
        out = tmp / strategy
        result = solve(GPT, cluster, out, env={}, args=["-b", str(batch), "--strategy", strategy])
        if "error" in result:
            raise SystemExit(f"{strategy}: {result['error']}")
        plans[strategy] = out / "plan.json"
    return plans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="mixed-3090-4090")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        plans = _plans(CLUSTERS / f"{args.cluster}.yaml", args.batch, Path(tmp))
        dilation, scale = _one_emulation([Plan.from_json(p.read_text()) for p in plans.values()])
        results = {
            name: _rehearse(path, args.steps, dilation, scale) for name, path in plans.items()
        }
    out = table(
        f"rehearsal on {args.cluster}: GPT example, global batch {args.batch}, {args.steps} steps, "
        f"1 s of plan hardware = {scale:.3g} s here",
        ["plan", "ranks", "predicted samples/s", "measured samples/s", "measured / predicted"],
    )
    for name, res in results.items():
        predicted = res["predicted_samples_per_s"]
        measured = res["measured_samples_per_s"]
        out.add_row(
            name,
            str(len(res["ranks"])),
            "-" if predicted is None else f"{predicted:.1f}",
            f"{measured:.1f}",
            "-" if not predicted else f"{measured / predicted:.2f}",
        )
    console.print(out)
    ratio = results["hplan"]["measured_samples_per_s"] / results["ddp"]["measured_samples_per_s"]
    verdict = "ok" if ratio >= 1.2 else "BELOW 1.2x"
    console.print(f"hplan / DDP measured samples/s: {ratio:.2f}x (target >= 1.2x): {verdict}")


if __name__ == "__main__":
    main()
