"""Helpers shared by the benchmarks: run the real `hplan` CLI in a subprocess and read its output.

Benchmarks use the command line on purpose: they measure what a user gets.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt" / "model.py"
CLUSTERS = ROOT / "examples" / "clusters"
HPLAN = [sys.executable, "-c", "from hplan.planner.cli.main import main; main()"]
console = Console(width=160)


def gpt_env(*, layers: int, width: int, heads: int, seq: int) -> dict[str, str]:
    """Environment that sizes examples/gpt/model.py."""
    return {
        "HPLAN_GPT_LAYERS": str(layers),
        "HPLAN_GPT_WIDTH": str(width),
        "HPLAN_GPT_HEADS": str(heads),
        "HPLAN_GPT_SEQ": str(seq),
    }


def solve(
    model: Path, cluster: Path, out_dir: Path, *, env: dict[str, str], args: list[str]
) -> dict:
    """Run `hplan solve --json`; return its summary plus the plan's report."""
    cmd = [
        *HPLAN,
        "solve",
        str(model),
        "--cluster",
        str(cluster),
        "-o",
        str(out_dir),
        "--json",
        *args,
    ]
    proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
    if proc.returncode != 0:
        return {
            "error": proc.stderr.strip().splitlines()[-1]
            if proc.stderr.strip()
            else f"exit {proc.returncode}"
        }
    summary = json.loads(proc.stdout)
    plan = json.loads((out_dir / "plan.json").read_text())
    summary["report"] = plan["report"]
    summary["num_replicas"] = len({r["replica"] for r in plan["ranks"]})
    summary["num_ranks"] = len(plan["ranks"])
    summary["training"] = plan["training"]
    summary["memory_strategies"] = [r["memory_strategy"] for r in plan["ranks"]]
    summary["recompute_units"] = [
        (len(r.get("recompute_units", ())), len(r["units"])) for r in plan["ranks"]
    ]
    summary["offloads"] = [r.get("optimizer_offload", False) for r in plan["ranks"]]
    return summary


def write_cluster(text: str) -> Path:
    """Write a cluster YAML to a temporary file (removed when the process exits)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
        handle.write(text)
    path = Path(handle.name)
    atexit.register(path.unlink, missing_ok=True)
    return path


def table(title: str, columns: list[str]) -> Table:
    out = Table(title=title, title_justify="left")
    for col in columns:
        out.add_column(col, justify="right" if col[0].isupper() is False else "left")
    return out
