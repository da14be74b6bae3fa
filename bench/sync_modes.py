"""Sync modes across slow links: the synchronous plan beside the one `--sync auto` chooses.

For each cluster whose nodes are joined by slow links, one `hplan solve --sync all_reduce`
(an all-reduce every step: today's plan) and one `hplan solve --sync auto` (islands with
local SGD where the all-reduce costs too much), same model, batch and cost model. Prints
each plan's predicted samples/s, its efficiency (predicted / physical bound), the devices
it uses, and its sync. Target (issue 12): >= 0.90 of the bound with every device used.

    python bench/sync_modes.py
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import CLUSTERS, GPT, console, gpt_env, solve, table

GPT2_124M = {**gpt_env(layers=12, width=768, heads=12, seq=1024), "HPLAN_GPT_VOCAB": "50257"}
DEMO = gpt_env(layers=4, width=64, heads=4, seq=64)
ROWS = (
    ("home-lab", "GPT-2 124M", GPT2_124M, 512),
    ("two-site", "GPT-2 124M", GPT2_124M, 512),
    ("mixed-3090-4090", "GPT-2 124M", GPT2_124M, 512),
    ("mixed-3090-4090", "gpt 4x64 (make demo)", DEMO, 2048),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=60.0, help="per solve, seconds")
    args = parser.parse_args()
    columns = [
        "cluster",
        "model",
        "batch",
        "all_reduce eff.",
        "devices",
        "auto eff.",
        "devices ",
        "speed-up",
        "auto sync",
        "verdict",
    ]
    out = table("sync modes: all-reduce every step vs --sync auto (predicted)", columns)
    for cluster, model, env, batch in ROWS:
        results = {}
        for sync in ("all_reduce", "auto"):
            with tempfile.TemporaryDirectory() as tmp:
                results[sync] = solve(
                    GPT,
                    CLUSTERS / f"{cluster}.yaml",
                    Path(tmp),
                    env=env,
                    args=["-b", str(batch), "--sync", sync, "--time-limit", str(args.time_limit)],
                )
        out.add_row(cluster, model, str(batch), *_cells(results["all_reduce"], results["auto"]))
    console.print(out)


def _cells(synchronous: dict, chosen: dict) -> list[str]:
    if "error" in synchronous or "error" in chosen:
        return ["error", "-", "-", "-", "-", "-", synchronous.get("error") or chosen["error"]]
    efficiency = chosen["efficiency"]
    every_device = chosen["devices_used"] == chosen["num_devices"]
    verdict = "ok" if efficiency >= 0.9 and every_device else "BELOW TARGET"
    return [
        f"{synchronous['efficiency']:.3f}",
        f"{synchronous['devices_used']}/{synchronous['num_devices']}",
        f"{efficiency:.3f}",
        f"{chosen['devices_used']}/{chosen['num_devices']}",
        f"{chosen['predicted_samples_per_s'] / synchronous['predicted_samples_per_s']:.2f}x",
        chosen["sync"],
        verdict,
    ]


if __name__ == "__main__":
    main()
