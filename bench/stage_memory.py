"""Peak host memory of building one rank's stage: the whole model first, or the stage only.

Every rank used to build the whole model on the CPU and then keep its stage; now it builds
the model on fake tensors and materialises only its stage's parameters and buffers
(``runtime/capture/materialise.py``). This bench plans the GPT example (8 layers, width
768: 57 M parameters, 227 MB in float32) as one pipeline of four stages, two blocks
each, and builds each
rank's stage both ways, each in a fresh child process, as ``build_rank`` does
(``worker.rank_stage``); the child reports its peak RSS (``ru_maxrss``: imports included)
and what the build added to its RSS (high-water mark during the build minus the RSS
before it). Both ways run in the same run, side by side.

    PYTHONPATH=. python bench/stage_memory.py [--layers 8] [--width 768]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # hplan and the test fixtures of this checkout

from common import GPT, console, gpt_env, table  # noqa: E402

_KIB_BYTES = 1024
"""``ru_maxrss`` is in KiB on Linux."""
BYTES_PER_MB = 10**6
NUM_STAGES = 4
MODES = ("floor", "whole", "stage")
"""floor: imports and plan only; whole: the whole model built, then the stage kept (the
old way); stage: only the stage materialised."""


def _child(plan_path: str, rank: int, mode: str) -> None:
    """Build ``rank``'s stage the ``mode`` way; print peak RSS, what the build added to the
    RSS, build time and stage size (JSON)."""
    from hplan.runtime.capture.model_file import load_model_file
    from hplan.runtime.contract.plan import Plan
    from hplan.runtime.executor.worker import rank_stage

    plan = Plan.from_json(Path(plan_path).read_text(encoding="utf-8"))
    rank_plan = plan.ranks[rank]
    model_file = load_model_file(plan.model.path)
    before_bytes = _reset_high_water()
    started_s = time.perf_counter()
    stage_bytes = 0
    if mode != "floor":
        stage, _ = rank_stage(plan, rank_plan, model_file, whole=mode == "whole")
        tensors = stage.canonical_parameters() + stage.canonical_buffers()
        stage_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
    built_s = time.perf_counter() - started_s
    high_bytes = _status_bytes("VmHWM")
    peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _KIB_BYTES
    added = None if before_bytes is None else high_bytes - before_bytes
    result = {"peak_bytes": peak_bytes, "added_bytes": added, "build_s": built_s}
    print(json.dumps({**result, "stage_bytes": stage_bytes}))


def _reset_high_water() -> int | None:
    """Reset this process's RSS high-water mark (VmHWM) to its RSS now (Linux >= 4.0:
    ``clear_refs`` 5) and return that RSS; None where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return _status_bytes("VmRSS")


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * _KIB_BYTES
    raise SystemExit(f"/proc/self/status has no {field}")


def _run_child(plan_path: Path, rank: int, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--child", str(plan_path), str(rank), mode]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"rank {rank} ({mode}) failed: {proc.stderr.strip()[-2000:]}")
    if proc.stderr.strip():
        console.print(f"rank {rank} ({mode}) stderr: {proc.stderr.strip()}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _plan(tmp: Path, layers: int) -> Path:
    """One pipeline of four stages, two blocks each (the embeddings go with the first, the
    final norm and the tied head with the last): a quarter of the model per stage."""
    from tests.fixtures.plans import ReplicaShape, make_plan

    per_stage = layers // NUM_STAGES
    counts = (2 + per_stage, per_stage, per_stage, per_stage + 2)
    plan = make_plan(GPT, [ReplicaShape(counts, micro_batch_size=2, num_samples=8)])
    path = tmp / "plan.json"
    path.write_text(plan.to_json(), encoding="utf-8")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], int(args.child[1]), args.child[2])
        return
    if args.layers % NUM_STAGES:
        raise SystemExit(f"--layers {args.layers}: give a multiple of {NUM_STAGES}")
    os.environ.update(gpt_env(layers=args.layers, width=args.width, heads=12, seq=64))
    out = table(
        f"peak RSS of building one rank's stage (GPT {args.layers}x{args.width}, "
        f"{NUM_STAGES} stages; fresh process per rank and way)",
        [
            "rank",
            "units",
            "stage MB",
            "peak MB whole / stage",
            "peak ratio",
            "added MB whole / stage",
            "added ratio",
            "build s whole / stage",
        ],
    )
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = _plan(Path(tmp), args.layers)
        from hplan.runtime.contract.plan import Plan

        plan = Plan.from_json(plan_path.read_text(encoding="utf-8"))
        floor = _run_child(plan_path, 0, "floor")["peak_bytes"]
        for rank_plan in plan.ranks:
            whole = _run_child(plan_path, rank_plan.rank, "whole")
            stage = _run_child(plan_path, rank_plan.rank, "stage")
            out.add_row(
                str(rank_plan.rank),
                f"{rank_plan.units[0]}..{rank_plan.units[-1]}",
                _mb(stage["stage_bytes"]),
                f"{_mb(whole['peak_bytes'])} / {_mb(stage['peak_bytes'])}",
                _ratio(whole["peak_bytes"], stage["peak_bytes"]),
                f"{_mb(whole['added_bytes'])} / {_mb(stage['added_bytes'])}",
                _ratio(whole["added_bytes"], stage["added_bytes"]),
                f"{whole['build_s']:.1f} / {stage['build_s']:.1f}",
            )
    console.print(out)
    console.print(
        f"peak: the child's ru_maxrss (a child that only imports and loads the plan: "
        f"{_mb(floor)} MB); added: its RSS high-water mark during the build minus its RSS "
        "before (VmHWM reset through /proc/self/clear_refs)"
    )


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / BYTES_PER_MB:.0f}"


def _ratio(a: int | None, b: int | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


if __name__ == "__main__":
    main()
