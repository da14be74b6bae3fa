"""Tensor parallelism: where hplan chooses it and what it buys (predicted, issue 36).

Every figure is predicted by hplan's cost model (no GPU runs here); "efficiency" is the plan's
predicted samples/s over the physical bound its own report gives (each device's standalone
samples/s summed, no bubble or sync). Each hplan plan is a real ``hplan solve --json`` in a
child process (from one ``hplan capture`` of the model where that works); the
Megatron-style rows are costed in this process by the same evaluator
(``bench/megatron_uniform.py``). Cases (``--cases``):

- ``wide``: a language model whose embedding and head (200,000 x 8,192, 1.6B parameters
  each; ``bench/models/wide_lm.py``) fit no 12 GB card, on one box of eight RTX 3060s over
  PCIe: ``--tensor-parallel never`` is infeasible (its one-line reason printed), ``auto``
  plans it with TP.
- ``lab``: Llama-2 13B and 70B shapes (``bench/models/llama.py``, bf16 weights) on a lab
  pool, one 4x A100 SXM node (NVLink) + 2x RTX 4090 + 2x RTX 3090, 25 Gb/s between the
  nodes: hplan with TP (``auto``) beside the best plan without it (``never``), the best
  plan with TP groups only (``always``) and the best Megatron-style uniform (tp, pp, dp)
  plan on all eight cards or a subset; the same on the A100 node alone.
- ``small``: GPT-2 124M (``examples/gpt/model.py``, with its TP_PLAN) and TinyLlama 1.1B
  (fp32 and bf16 weights) on two RTX 4090s over PCIe: ``auto`` must not choose TP where
  data parallelism (or anything else) fits; PASS/FAIL per model, beside what ``always``
  (TP forced) would give.

    python bench/tensor_parallel.py [--cases wide,lab,small] [--time-limit S] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common import GPT, HPLAN, ROOT, console, gpt_env, table, write_cluster
from megatron_uniform import UniformPlan, uniform_plans
from rich.table import Table

MODELS = ROOT / "bench" / "models"
WIDE_LM = MODELS / "wide_lm.py"
LLAMA = MODELS / "llama.py"

EIGHT_3060 = """\
name: eight-3060
nodes:
  - {name: box, host: 10.0.0.1, devices: [{type: rtx3060, count: 8}]}
"""
"""One box of eight GeForce RTX 3060 12 GB on PCIe (no peer-to-peer)."""

LAB_POOL = """\
name: lab-pool
nodes:
  - {name: a100, host: 10.0.0.1, devices: [{type: a100-80gb, count: 4}]}
  - {name: g4090, host: 10.0.0.2, devices: [{type: rtx4090, count: 2}]}
  - {name: g3090, host: 10.0.0.3, devices: [{type: rtx3090, count: 2}]}
links:
  inter_node: {bandwidth_gbit_per_s: 25, latency_us: 20}
"""
"""The A100 80 GB is the SXM part: the catalog joins a node's cards by NVLink."""

A100_NODE = """\
name: a100-node
nodes:
  - {name: a100, host: 10.0.0.1, devices: [{type: a100-80gb, count: 4}]}
"""
"""The lab pool's A100 node alone: where Megatron-LM's recipes use TP."""

TWO_4090 = """\
name: two-4090
nodes:
  - {name: box, host: 10.0.0.1, devices: [{type: rtx4090, count: 2}]}
"""


@dataclass(frozen=True)
class Model:
    name: str
    path: Path
    env: dict[str, str]
    global_batch_size: int


WIDE = Model("wide head (200k x 8192, 2 blocks)", WIDE_LM, {}, 16)
LLAMA_13B = Model(
    "Llama 13B (bf16)",
    LLAMA,
    {"HPLAN_LLAMA_PRESET": "llama-13b", "HPLAN_LLAMA_DTYPE": "bfloat16"},
    64,
)
LLAMA_70B = Model(
    "Llama 70B (bf16)",
    LLAMA,
    {"HPLAN_LLAMA_PRESET": "llama-70b", "HPLAN_LLAMA_DTYPE": "bfloat16"},
    64,
)
GPT2_124M = Model(
    "GPT-2 124M (examples/gpt)",
    GPT,
    {**gpt_env(layers=12, width=768, heads=12, seq=1024), "HPLAN_GPT_VOCAB": "50304"},
    64,
)
"""The vocabulary padded to 50,304 as nanoGPT pads it (50,257 divides by no TP degree, so
TP would not be offered at all and the small case's check would say nothing)."""
TINYLLAMA = Model("TinyLlama 1.1B", LLAMA, {"HPLAN_LLAMA_PRESET": "tinyllama-1.1b"}, 64)
TINYLLAMA_BF16 = Model(
    "TinyLlama 1.1B (bf16)",
    LLAMA,
    {"HPLAN_LLAMA_PRESET": "tinyllama-1.1b", "HPLAN_LLAMA_DTYPE": "bfloat16"},
    64,
)
SMALL_MODELS = (GPT2_124M, TINYLLAMA, TINYLLAMA_BF16)


@dataclass(frozen=True)
class Solved:
    """One ``hplan solve`` of a model on a cluster with one ``--tensor-parallel`` mode."""

    model: str
    mode: str
    error: str | None = None
    samples_per_s: float | None = None
    bound_samples_per_s: float | None = None
    efficiency: float | None = None
    pipelines: tuple[str, ...] = ()
    """Each replica's stages (``pipeline_lines``)."""
    stage_degrees: tuple[int, ...] = ()
    """The tp_degree of every stage of every replica."""
    devices_used: str = ""
    ddp_fits: bool | None = None
    tp_notes: tuple[str, ...] = field(default_factory=tuple)


# --------------------------------------------------------------------------- solving
def capture(model: Model, folder: Path) -> Path | None:
    """``hplan capture`` of the model into ``folder``; None where it fails (then every
    solve captures the model itself)."""
    out = folder / "capture.json"
    proc = subprocess.run(
        [*HPLAN, "capture", str(model.path), "-o", str(out)],
        env={**os.environ, **model.env},
        capture_output=True,
        text=True,
    )
    return out if proc.returncode == 0 else None


def solve(
    model: Model,
    cluster: Path,
    mode: str,
    *,
    time_limit_s: float,
    capture_path: Path | None,
) -> Solved:
    """``hplan solve --json --tensor-parallel mode``."""
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        cmd = [
            *HPLAN,
            "solve",
            str(model.path),
            "--cluster",
            str(cluster),
            "-o",
            str(out_dir),
            "-b",
            str(model.global_batch_size),
            "--time-limit",
            str(time_limit_s),
            "--json",
            "--tensor-parallel",
            mode,
            *(["--capture", str(capture_path)] if capture_path else []),
        ]
        proc = subprocess.run(cmd, env={**os.environ, **model.env}, capture_output=True, text=True)
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines()
            error = lines[-1].removeprefix("hplan: error: ") if lines else None
            return Solved(model.name, mode, error=error or f"exit {proc.returncode}")
        summary = json.loads(proc.stdout)
        plan = json.loads((out_dir / "plan.json").read_text())
    return solved_from(model.name, mode, summary, plan)


def solved_from(model: str, mode: str, summary: dict, plan: dict) -> Solved:
    """A :class:`Solved` from ``hplan solve --json``'s summary and the plan it wrote."""
    report = plan["report"]
    ddp = next((b for b in report["baselines"] if b["name"].startswith("data parallel")), None)
    return Solved(
        model,
        mode,
        samples_per_s=report["predicted_samples_per_s"],
        bound_samples_per_s=report["physical_bound_samples_per_s"],
        efficiency=report["efficiency"],
        pipelines=pipeline_lines(plan["ranks"]),
        stage_degrees=tuple(m[0].get("tp_degree", 1) for m in stages_of(plan["ranks"]).values()),
        devices_used=f"{summary['devices_used']}/{summary['num_devices']}",
        ddp_fits=None if ddp is None else ddp["samples_per_s"] is not None,
        tp_notes=tuple(n for n in report.get("notes", ()) if _about_tp(n)),
    )


def _about_tp(note: str) -> bool:
    text = note.lower()
    return "tensor" in text or "tp " in text or "tp_" in text or " tp" in text


def short_kind(kind: str) -> str:
    """``rtx3090`` -> ``3090``, ``a100-80gb`` -> ``a100``."""
    return kind.removeprefix("rtx").split("-")[0]


def stages_of(ranks: Sequence[dict]) -> dict[tuple[int, int], list[dict]]:
    """The ranks of each (replica, stage), in order (a TP group's ranks together)."""
    groups: dict[tuple[int, int], list[dict]] = {}
    for rank in ranks:
        groups.setdefault((rank["replica"], rank["stage"]), []).append(rank)
    return dict(sorted(groups.items()))


def pipeline_lines(ranks: Sequence[dict]) -> tuple[str, ...]:
    """Each replica's pipeline, its stages in order: ``3090 > 4xa100 tp4 > 4090`` (a TP
    group as its card count, kind and degree)."""
    pipes: dict[int, list[str]] = {}
    for (replica, _), members in stages_of(ranks).items():
        kind = short_kind(members[0]["device_kind"])
        tp = members[0].get("tp_degree", 1)
        pipes.setdefault(replica, []).append(kind if tp == 1 else f"{tp}x{kind} tp{tp}")
    return tuple(" > ".join(stages) for stages in pipes.values())


def layout_text(solved: Solved, *, short: bool = False) -> str:
    """``1 replica: 3090 > a100 > ...``, or the error (``short``: its first clause, up to
    the first ``;``)."""
    if solved.error:
        return solved.error.split("; ")[0] if short else solved.error
    n = len(solved.pipelines)
    return f"{n} replica{'s' if n > 1 else ''}: " + " | ".join(solved.pipelines)


def degrees_text(solved: Solved) -> str:
    """The TP degrees of a plan's stages, ``tp4 x1, tp1 x4`` (stages per degree)."""
    counts: dict[int, int] = {}
    for tp in solved.stage_degrees:
        counts[tp] = counts.get(tp, 0) + 1
    return ", ".join(f"tp{tp} x{n}" for tp, n in sorted(counts.items(), reverse=True)) or "-"


def no_tp_chosen(solved: Solved) -> bool:
    """The small case's check: a plan, and every rank at tp_degree 1."""
    return solved.error is None and all(d == 1 for d in solved.stage_degrees)


# --------------------------------------------------------------------------- megatron
@contextmanager
def model_env(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with the model's sizes for an in-process capture, then as it was."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def megatron_plans(model: Model, cluster: Path, capture_path: Path | None) -> list[UniformPlan]:
    """Every fitting uniform (tp, pp, dp) plan of ``bench/megatron_uniform.py``, fastest
    first, on the problem hplan's passes build for this model and cluster."""
    from hplan.planner.api import PASSES, SolveRequest
    from hplan.planner.passes import run_passes

    request = SolveRequest(
        model_path=model.path,
        cluster_path=cluster,
        global_batch_size=model.global_batch_size,
        capture_path=capture_path,
    )
    names = [p.name for p in PASSES]
    with model_env(model.env):
        results = run_passes(PASSES[: names.index("problem") + 1], request)
    return uniform_plans(results["problem"])


# --------------------------------------------------------------------------- cases
def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _ratio(ours: float | None, other: float | None) -> str:
    return "-" if not ours or not other else f"{ours / other:.2f}x"


def run_wide(args: argparse.Namespace) -> list[Solved]:
    cluster = write_cluster(EIGHT_3060)
    with tempfile.TemporaryDirectory() as tmp:
        stored = capture(WIDE, Path(tmp))
        results = [
            solve(WIDE, cluster, m, time_limit_s=args.time_limit, capture_path=stored)
            for m in ("never", "auto")
        ]
    out = table(
        f"(a) {WIDE.name} on 8x RTX 3060 12 GB (PCIe), batch {WIDE.global_batch_size} (predicted)",
        [
            "--tensor-parallel",
            "Plan",
            "samples/s",
            "bound",
            "efficiency",
            "Layout (pipelines, stages in order)",
        ],
    )
    for r in results:
        out.add_row(
            r.mode,
            "infeasible" if r.error else "planned",
            _rate(r.samples_per_s),
            _rate(r.bound_samples_per_s),
            "-" if r.efficiency is None else f"{r.efficiency:.2f}",
            layout_text(r),
        )
    console.print(out)
    _print_notes(results)
    return results


def run_lab(args: argparse.Namespace) -> list[dict]:
    clusters = {"pool": write_cluster(LAB_POOL), "A100 node alone": write_cluster(A100_NODE)}
    out = table(
        "(b) lab pool: 4x A100 SXM 80 GB (NVLink) + 2x RTX 4090 + 2x RTX 3090, 25 Gb/s; and its "
        "A100 node alone (predicted; efficiency = samples/s / hplan's physical bound)",
        ["Model", "Cards", "Plan", "samples/s", "hplan TP auto / this", "efficiency", "Layout"],
    )
    records = []
    for model in args.lab_models:
        with tempfile.TemporaryDirectory() as tmp:
            stored = capture(model, Path(tmp))
            for where, cluster in clusters.items():
                record = lab_rows(model, where, cluster, stored, args.time_limit, out)
                records.append(record)
    console.print(out)
    return records


def lab_rows(
    model: Model,
    where: str,
    cluster: Path,
    stored: Path | None,
    time_limit_s: float,
    out: Table,
) -> dict:
    """hplan's three modes and the best uniform plan of one model on one cluster: rows
    of ``out``, the other uniform shapes and the TP notes printed; the results returned."""
    runs = {
        m: solve(model, cluster, m, time_limit_s=time_limit_s, capture_path=stored)
        for m in ("auto", "never", "always")
    }
    uniform = megatron_plans(model, cluster, stored)
    best = uniform[0] if uniform else None
    ours = runs["auto"]
    bound = next((r.bound_samples_per_s for r in runs.values() if r.bound_samples_per_s), None)
    for mode, r in runs.items():
        out.add_row(
            model.name,
            where,
            f"hplan, TP {mode}",
            _rate(r.samples_per_s),
            _ratio(ours.samples_per_s, r.samples_per_s),
            "-" if r.efficiency is None else f"{r.efficiency:.2f}",
            layout_text(r, short=True),
        )
    out.add_row(
        model.name,
        where,
        "Megatron uniform (best)",
        _rate(best.samples_per_s if best else None),
        _ratio(ours.samples_per_s, best.samples_per_s if best else None),
        "-" if not (best and bound) else f"{best.samples_per_s / bound:.2f}",
        best.label() if best else "no uniform (tp, pp, dp) fits",
    )
    console.print(f"{model.name} on {where}: {len(uniform)} uniform (tp, pp, dp) shapes fit")
    for plan in uniform[1:6]:
        console.print(f"  also: {plan.label()}: {plan.samples_per_s:.3g} samples/s")
    _print_notes(list(runs.values()))
    for error in dict.fromkeys(r.error for r in runs.values() if r.error):
        console.print(f"  {model.name} on {where}: {error}")
    return {
        "model": model.name,
        "cluster": where,
        "hplan": {m: asdict(r) for m, r in runs.items()},
        "megatron": [asdict(p) for p in uniform],
    }


def run_small(args: argparse.Namespace) -> list[dict]:
    cluster = write_cluster(TWO_4090)
    out = table(
        "(c) 2x RTX 4090 over PCIe: auto must not choose TP where something else fits (predicted)",
        [
            "Model",
            "batch",
            "DDP fits",
            "auto samples/s",
            "efficiency",
            "TP degrees",
            "check",
            "Layout",
            "TP always samples/s",
            "auto / always",
        ],
    )
    records = []
    for model in SMALL_MODELS:
        with tempfile.TemporaryDirectory() as tmp:
            stored = capture(model, Path(tmp))
            chosen, forced = (
                solve(model, cluster, m, time_limit_s=args.time_limit, capture_path=stored)
                for m in ("auto", "always")
            )
        out.add_row(
            model.name,
            str(model.global_batch_size),
            "-" if chosen.ddp_fits is None else ("yes" if chosen.ddp_fits else "no"),
            _rate(chosen.samples_per_s),
            "-" if chosen.efficiency is None else f"{chosen.efficiency:.2f}",
            chosen.error or degrees_text(chosen),
            "PASS" if no_tp_chosen(chosen) else "FAIL",
            "" if chosen.error else layout_text(chosen),
            _rate(forced.samples_per_s) if not forced.error else "none (below)",
            _ratio(chosen.samples_per_s, forced.samples_per_s),
        )
        records.append({"auto": asdict(chosen), "always": asdict(forced)})
        _print_notes([chosen])
        if forced.error:
            console.print(f"  {model.name}, always: {forced.error}")
    console.print(out)
    return records


def _print_notes(results: Sequence[Solved]) -> None:
    for r in results:
        for note in r.tp_notes:
            console.print(f"  {r.model}, {r.mode}: {note}")


# --------------------------------------------------------------------------- main
CASES = ("wide", "lab", "small")
LAB_MODELS = {"13b": LLAMA_13B, "70b": LLAMA_70B}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="of " + ", ".join(CASES))
    parser.add_argument(
        "--lab-models", default="13b,70b", help="lab case models, of " + ", ".join(LAB_MODELS)
    )
    parser.add_argument("--time-limit", type=float, default=60.0, help="per solve, seconds")
    parser.add_argument("--json", type=Path, help="write the results as one JSON line here")
    args = parser.parse_args(argv)
    args.cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)}; valid: {', '.join(CASES)}")
    names = [m for m in args.lab_models.split(",") if m]
    bad = sorted(set(names) - set(LAB_MODELS))
    if bad:
        parser.error(f"--lab-models: unknown {', '.join(bad)}; valid: {', '.join(LAB_MODELS)}")
    args.lab_models = [LAB_MODELS[n] for n in names]
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    record: dict = {"benchmark": "tensor_parallel", "time_limit_s": args.time_limit}
    if "wide" in args.cases:
        record["wide"] = [asdict(r) for r in run_wide(args)]
    if "lab" in args.cases:
        record["lab"] = run_lab(args)
    if "small" in args.cases:
        record["small"] = run_small(args)
    if args.json is not None:
        args.json.write_text(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
