"""Capture benchmark: wall time and peak memory of `hplan solve` on real-size HF models.

Targets (issue 10): a 7B Llama-2-style model (seq 4096) captured and solved in under 60 s
and under 4 GB peak RSS on a 2-core machine; GPT-2 124M (seq 1024) in under 10 s. Each case
writes a model file from a transformers config (random init, nothing downloaded) into a
temporary folder and runs the real CLI (`hplan solve --json`) in a child process; the
child's wall time and peak RSS (``os.wait4``'s ``ru_maxrss``) are printed beside the solve
pass's own time and the plan's trace notes. A child whose RSS passes ``--max-rss-gb`` is
killed (so a capture that would materialise a 7B model cannot take the machine down).

    python bench/capture.py [--cases gpt2-124m,llama-7b] [--max-rss-gb 12] [--timeout-s 900]
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
from dataclasses import dataclass
from pathlib import Path

from common import CLUSTERS, HPLAN, console, table

BYTES_PER_GB = 10**9
_KIB = 1024
"""``ru_maxrss`` and /proc's VmRSS are in KiB on Linux."""

A100_X8 = """\
name: a100-x8
nodes:
  - {name: n1, host: 10.0.0.1, devices: [{type: a100-80gb, count: 8}]}
"""

GPT2 = """\
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB_SIZE = 50257
SEQ_LEN = {seq}


def build_model():
    config = GPT2Config(
        n_embd={hidden}, n_layer={layers}, n_head={heads}, n_positions=SEQ_LEN,
        vocab_size=VOCAB_SIZE, use_cache=False,
    )
    return GPT2LMHeadModel(config)


def sample_batch(batch_size):
    tokens = torch.randint(0, VOCAB_SIZE, (batch_size, SEQ_LEN + 1))
    return {{"input_ids": tokens[:, :-1]}}, tokens[:, 1:]


def loss_fn(outputs, targets):
    return F.cross_entropy(outputs.logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))
"""

LLAMA = """\
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB_SIZE = 32000
SEQ_LEN = {seq}


def build_model():
    config = LlamaConfig(
        hidden_size={hidden}, num_hidden_layers={layers}, num_attention_heads={heads},
        num_key_value_heads={kv_heads}, intermediate_size={mlp}, vocab_size=VOCAB_SIZE,
        max_position_embeddings=SEQ_LEN, use_cache=False,
    )
    return LlamaForCausalLM(config)


def sample_batch(batch_size):
    tokens = torch.randint(0, VOCAB_SIZE, (batch_size, SEQ_LEN + 1))
    return {{"input_ids": tokens[:, :-1]}}, tokens[:, 1:]


def loss_fn(outputs, targets):
    return F.cross_entropy(outputs.logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))
"""


@dataclass(frozen=True)
class Case:
    name: str
    model_text: str
    cluster: str
    """A file under examples/clusters, or ``a100-x8`` (written to the temp folder)."""
    global_batch_size: int
    target_s: float | None
    target_rss_gb: float | None


CASES = (
    Case(
        "gpt2-124m",
        GPT2.format(seq=1024, hidden=768, layers=12, heads=12),
        "mixed-3090-4090.yaml",
        32,
        10.0,
        None,
    ),
    Case(
        "gpt2-medium",
        GPT2.format(seq=1024, hidden=1024, layers=24, heads=16),
        "mixed-3090-4090.yaml",
        32,
        None,
        None,
    ),
    Case(
        "llama-1.1b",
        LLAMA.format(seq=2048, hidden=2048, layers=22, heads=32, kv_heads=4, mlp=5632),
        "mixed-3090-4090.yaml",
        32,
        None,
        None,
    ),
    Case(
        "llama-7b",
        LLAMA.format(seq=4096, hidden=4096, layers=32, heads=32, kv_heads=32, mlp=11008),
        "a100-x8",
        64,
        60.0,
        4.0,
    ),
)


@dataclass(frozen=True)
class Outcome:
    wall_s: float
    peak_rss_bytes: int
    error: str | None
    summary: dict


def run_case(case: Case, folder: Path, *, max_rss_bytes: int, timeout_s: float) -> Outcome:
    """Write the case's model (and cluster) file to ``folder`` and time `hplan solve` on it."""
    model = folder / f"{case.name}.py"
    model.write_text(case.model_text)
    cluster = CLUSTERS / case.cluster
    if case.cluster == "a100-x8":
        cluster = folder / "a100-x8.yaml"
        cluster.write_text(A100_X8)
    out_dir = folder / f"{case.name}-out"
    cmd = [
        *HPLAN,
        "solve",
        str(model),
        "--cluster",
        str(cluster),
        "-o",
        str(out_dir),
        "-b",
        str(case.global_batch_size),
        "--time-limit",
        "20",
        "--json",
    ]
    log = folder / f"{case.name}.stderr"
    started_s = time.monotonic()
    with open(log, "w") as stderr, open(folder / f"{case.name}.stdout", "w+") as stdout:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr)
        killed = _watch(proc.pid, started_s, max_rss_bytes=max_rss_bytes, timeout_s=timeout_s)
        _, status, usage = os.wait4(proc.pid, 0)
        wall_s = time.monotonic() - started_s
        stdout.seek(0)
        text = stdout.read()
    peak = int(usage.ru_maxrss) * _KIB
    code = os.waitstatus_to_exitcode(status)
    if killed or code != 0:
        lines = log.read_text().strip().splitlines()
        error = killed or (lines[-1] if lines else f"exit {code}")
        return Outcome(wall_s, peak, error, {})
    summary = json.loads(text)
    plan = json.loads((out_dir / "plan.json").read_text())
    summary["notes"] = plan["report"].get("notes", [])
    return Outcome(wall_s, peak, None, summary)


def _watch(pid: int, started_s: float, *, max_rss_bytes: int, timeout_s: float) -> str | None:
    """Poll the child until it exits; kill it past the RSS or time limit (say which)."""
    while True:
        exited = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if exited is not None:
            return None
        rss = _rss_bytes(pid)
        if rss > max_rss_bytes:
            os.kill(pid, 9)
            return f"killed: RSS {rss / BYTES_PER_GB:.1f} GB passed {max_rss_bytes / BYTES_PER_GB:g} GB"
        if time.monotonic() - started_s > timeout_s:
            os.kill(pid, 9)
            return f"killed: still running after {timeout_s:g} s"
        time.sleep(0.2)


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * _KIB
    except OSError:
        pass
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--max-rss-gb", type=float, default=12.0)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    args = parser.parse_args()
    try:
        import transformers  # noqa: F401
    except ImportError:
        console.print("skipped: transformers is not installed (pip install hplan[hf])")
        return
    chosen = set(args.cases.split(",")) if args.cases else {c.name for c in CASES}
    out = table(
        "hplan capture + solve on real-size models (child process)",
        ["case", "wall s", "target s", "peak RSS GB", "target GB", "solve pass s", "verdict"],
    )
    notes: list[str] = []
    for case in CASES:
        if case.name not in chosen:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            got = run_case(
                case,
                Path(tmp),
                max_rss_bytes=int(args.max_rss_gb * BYTES_PER_GB),
                timeout_s=args.timeout_s,
            )
        ok = got.error is None
        ok = ok and (case.target_s is None or got.wall_s <= case.target_s)
        rss_gb = got.peak_rss_bytes / BYTES_PER_GB
        ok = ok and (case.target_rss_gb is None or rss_gb <= case.target_rss_gb)
        solve_s = got.summary.get("solve_time_s")
        out.add_row(
            case.name,
            f"{got.wall_s:.1f}",
            "-" if case.target_s is None else f"{case.target_s:g}",
            f"{rss_gb:.2f}",
            "-" if case.target_rss_gb is None else f"{case.target_rss_gb:g}",
            "-" if solve_s is None else f"{solve_s:.1f}",
            "ok" if ok else (got.error or "missed target"),
        )
        notes.extend(f"{case.name}: {n}" for n in got.summary.get("notes", ()) if "trace" in n)
    console.print(out)
    for note in notes:
        console.print(note)
    self_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _KIB / BYTES_PER_GB
    console.print(f"(this process: {self_rss:.2f} GB peak RSS; {sys.executable})")


if __name__ == "__main__":
    main()
