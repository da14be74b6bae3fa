"""Solver benchmark: wall time and proven gap by model depth and device count.

Targets: 24 units x 8 devices in <= 5 s; 96 units x 32 devices of 4 types in <= 60 s; a
350M-parameter model (24 layers of width 1024, as ViT-L) on 64 GPUs of 8 kinds within its
``--time-limit`` of 60 s, capture apart (``--time-limit`` bounds the whole solve). Runs the
real CLI (`hplan solve --json`) on GPT models of the right depth (units = layers + token
embedding + position embedding + final norm + head); "solve s" is the time after the capture.

    python bench/solver.py
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import GPT, console, gpt_env, solve, table, write_cluster

EIGHT = """\
name: bench-8
nodes:
  - {name: n1, host: 10.0.0.1, devices: [{type: rtx4090, count: 4}]}
  - {name: n2, host: 10.0.0.2, devices: [{type: rtx3090, count: 2}, {type: rtx3060, count: 2}]}
links:
  inter_node: {bandwidth_gbit_per_s: 10, latency_us: 50}
"""

THIRTY_TWO = """\
name: bench-32
nodes:
  - {name: n1, host: 10.0.0.1, devices: [{type: a100-80gb, count: 8}]}
  - {name: n2, host: 10.0.0.2, devices: [{type: rtx4090, count: 8}]}
  - {name: n3, host: 10.0.0.3, devices: [{type: rtx3090, count: 8}]}
  - {name: n4, host: 10.0.0.4, devices: [{type: rtx3060, count: 8}]}
links:
  inter_node: {bandwidth_gbit_per_s: 25, latency_us: 20}
"""

SIXTY_FOUR = """\
name: bench-64
nodes:
  - {name: a1, host: 10.0.1.1, devices: [{type: a100-80gb, count: 8}]}
  - {name: a2, host: 10.0.1.2, devices: [{type: a100-40gb, count: 8}]}
  - {name: g1, host: 10.0.2.1, devices: [{type: rtx4090, count: 8}]}
  - {name: g2, host: 10.0.2.2, devices: [{type: rtx4090, count: 8}]}
  - {name: g3, host: 10.0.3.1, devices: [{type: rtx3090, count: 8}]}
  - {name: g4, host: 10.0.3.2, devices: [{type: rtx3090, count: 8}]}
  - {name: g5, host: 10.0.4.1, devices: [{type: rtx3060, count: 8}]}
  - {name: g6, host: 10.0.4.2, devices: [{type: rtx3080, count: 8}]}
links:
  inter_node: {bandwidth_gbit_per_s: 25, latency_us: 20}
"""

GPT_SMALL = {"width": 256, "heads": 4, "seq": 256}
VIT_L = {"width": 1024, "heads": 16, "seq": 1024}

CASES = [
    ("24 units x 8 devices", 20, GPT_SMALL, EIGHT, 64, 5.0),
    ("96 units x 32 devices, 4 types", 92, GPT_SMALL, THIRTY_TWO, 256, 60.0),
    ("28 units (ViT-L size) x 64 devices, 8 types", 24, VIT_L, SIXTY_FOUR, 512, 60.0),
]


def main() -> None:
    out = table(
        "hplan solver benchmark",
        ["case", "solve s", "target s", "status", "gap", "replicas", "verdict"],
    )
    for name, layers, shape, cluster_text, batch, target_s in CASES:
        cluster = write_cluster(cluster_text)
        with tempfile.TemporaryDirectory() as tmp:
            env = gpt_env(layers=layers, **shape)
            result = solve(
                GPT,
                cluster,
                Path(tmp),
                env=env,
                args=["-b", str(batch), "--time-limit", str(target_s)],
            )
        if "error" in result:
            out.add_row(name, "-", f"{target_s:g}", "error", "-", "-", result["error"])
            continue
        report = result["report"]
        gap = report["optimality_gap"]
        after_capture_s = result["total_time_s"] - result["phase_times_s"]["capture"]
        verdict = "ok" if after_capture_s <= target_s else "SLOW"
        out.add_row(
            name,
            f"{after_capture_s:.2f}",
            f"{target_s:g}",
            report["solver_status"],
            "-" if gap is None else f"{gap:.1%}",
            f"{result['num_replicas']} ({result['num_ranks']} devices)",
            verdict,
        )
    console.print(out)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    main()
