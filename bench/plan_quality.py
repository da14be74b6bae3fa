"""Plan quality: hplan's predicted throughput against what other tools would do.

For each example cluster and model size, prints hplan's predicted samples/s and its ratio
to (a) equal-batch data parallel (plain DDP; '-' where the model does not fit the smallest
device), (b) the best equal-layer, equal-batch pipeline (Megatron/DeepSpeed `uniform`), and
(c) the physical bound (sum of each device's standalone samples/s). All from one `hplan
solve` run per row, under the same cost model. Target: efficiency >= 0.90 wherever data
parallel fits.

    python bench/plan_quality.py
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import CLUSTERS, GPT, console, gpt_env, solve, table, write_cluster

MODELS = {
    "gpt 4x64 (demo)": gpt_env(layers=4, width=64, heads=4, seq=64),
    "gpt 12x768 (124M-class)": gpt_env(layers=12, width=768, heads=12, seq=1024),
    "gpt 24x1024 (350M-class)": gpt_env(layers=24, width=1024, heads=16, seq=1024),
}
ONE_BOX = """\
name: one-box
nodes:
  - name: box
    host: 10.0.0.1
    devices: [{type: rtx4090, count: 2}, {type: rtx3090, count: 2}]
"""
"""A mixed box whose GPUs share PCIe: data parallel fits and links are fast, so hplan's plan
should come close to the physical bound here."""

CLUSTER_MODELS = {
    "one-box": ["gpt 12x768 (124M-class)"],
    "mixed-3090-4090": ["gpt 12x768 (124M-class)", "gpt 24x1024 (350M-class)"],
    "two-site": ["gpt 12x768 (124M-class)", "gpt 24x1024 (350M-class)"],
    "cpu-rehearsal": ["gpt 4x64 (demo)"],
}


def _ratio(ours: float, other: float | None) -> str:
    return "-" if not other else f"{ours / other:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--batch", type=int, nargs="+", default=[64, 512], help="global batch sizes"
    )
    args = parser.parse_args()
    columns = [
        "cluster",
        "model",
        "batch",
        "hplan samples/s",
        "vs DDP",
        "vs uniform",
        "efficiency",
        "status",
        "verdict",
    ]
    out = table("hplan plan quality (predicted, same cost model)", columns)
    rows = [(c, m, b) for c, models in CLUSTER_MODELS.items() for m in models for b in args.batch]
    for cluster, model, batch in rows:
        with tempfile.TemporaryDirectory() as tmp:
            path = write_cluster(ONE_BOX) if cluster == "one-box" else CLUSTERS / f"{cluster}.yaml"
            result = solve(
                GPT,
                path,
                Path(tmp),
                env=MODELS[model],
                args=["-b", str(batch), "--time-limit", "60"],
            )
        if "error" in result:
            out.add_row(cluster, model, str(batch), "error", "-", "-", "-", "-", result["error"])
            continue
        out.add_row(cluster, model, str(batch), *_cells(result["report"]))
    console.print(out)


def _cells(report: dict) -> list[str]:
    ours = report["predicted_samples_per_s"]
    base = {b["name"].split(",")[0]: b["samples_per_s"] for b in report["baselines"]}
    ddp, uniform = base.get("data parallel"), base.get("uniform pipeline")
    efficiency = report["efficiency"]
    verdict = (
        "n/a (DDP does not fit)" if ddp is None else "ok" if efficiency >= 0.9 else "BELOW 0.90"
    )
    return [
        f"{ours:.1f}",
        _ratio(ours, ddp),
        _ratio(ours, uniform),
        f"{efficiency:.2f}",
        report["solver_status"],
        verdict,
    ]


if __name__ == "__main__":
    main()
