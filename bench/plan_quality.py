"""Plan quality: hplan's predicted throughput beside what other choices would give.

One `hplan solve` run per cell, all under the same cost model; ``--compare`` picks the table:

- ``baselines`` (default): per example cluster, model size and batch, hplan's predicted
  samples/s and its ratio to (a) equal-batch data parallel (plain DDP; '-' where the model
  does not fit the smallest device), (b) the best equal-layer, equal-batch pipeline
  (Megatron/DeepSpeed `uniform`) and (c) the physical bound (sum of each device's standalone
  samples/s). Target: efficiency >= 0.90 wherever data parallel fits.
- ``memory``: where memory binds, the solver's mixed memory strategy (``--recompute auto
  --zero auto --offload auto``) beside uniform ones (``plain``, everyone ``recompute``,
  ``zero-1``, ``offload``), by the step time the solver picks by (simulated where simulated)
  and by the cost model's alone. The mixed solve also solves each uniform strategy it allows
  and keeps the fastest, so its first ratio is at least 1.0 by construction. Models:
  examples/gpt/model.py at GPT-2 medium, TinyLlama (1.1B) and OpenLLaMA-3B sizes. Target:
  >= 1.2x where memory binds, never below 1.0x.
- ``sync``: across slow links, ``--sync all_reduce`` (an all-reduce every step) beside
  ``--sync auto`` (islands with local SGD where the all-reduce costs too much): efficiency
  (predicted / physical bound), devices used and the chosen sync. Target: >= 0.90 of the
  bound with every device used.

    python bench/plan_quality.py [--compare baselines|memory|sync] [--time-limit S]
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path

from common import CLUSTERS, GPT, console, gpt_env, solve, table, write_cluster

DEFAULT_TIME_LIMIT_S = {"baselines": 60.0, "memory": 20.0, "sync": 60.0}
"""Solver limit per solve, seconds, when ``--time-limit`` is not given."""


def _solve(
    cluster: Path, env: dict[str, str], batch: int, time_limit_s: float, flags: list[str]
) -> dict:
    """One `hplan solve --json` of examples/gpt/model.py (see ``common.solve``)."""
    with tempfile.TemporaryDirectory() as tmp:
        return solve(
            GPT,
            cluster,
            Path(tmp),
            env=env,
            args=["-b", str(batch), "--time-limit", str(time_limit_s), *flags],
        )


# --------------------------------------------------------------------------- baselines
BASELINE_MODELS = {
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
BASELINE_CLUSTER_MODELS = {
    "one-box": ["gpt 12x768 (124M-class)"],
    "mixed-3090-4090": ["gpt 12x768 (124M-class)", "gpt 24x1024 (350M-class)"],
    "two-site": ["gpt 12x768 (124M-class)", "gpt 24x1024 (350M-class)"],
    "cpu-rehearsal": ["gpt 4x64 (demo)"],
}


def compare_baselines(batches: list[int], time_limit_s: float) -> None:
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
    rows = [(c, m, b) for c, ms in BASELINE_CLUSTER_MODELS.items() for m in ms for b in batches]
    for cluster, model, batch in rows:
        path = write_cluster(ONE_BOX) if cluster == "one-box" else CLUSTERS / f"{cluster}.yaml"
        result = _solve(path, BASELINE_MODELS[model], batch, time_limit_s, [])
        if "error" in result:
            out.add_row(cluster, model, str(batch), "error", "-", "-", "-", "-", result["error"])
            continue
        out.add_row(cluster, model, str(batch), *_baseline_cells(result["report"]))
    console.print(out)


def _ratio(ours: float, other: float | None) -> str:
    return "-" if not other else f"{ours / other:.2f}x"


def _baseline_cells(report: dict) -> list[str]:
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


# --------------------------------------------------------------------------- memory
MEMORY_ONE_BOX = """\
name: one-box-3060x4-4090
nodes:
  - name: box
    host: 127.0.0.1
    devices:
      - {type: rtx4090, count: 1}
      - {type: rtx3060, count: 4}
"""
MEMORY_MODELS = (
    (
        "GPT-2 medium",
        {**gpt_env(layers=24, width=1024, heads=16, seq=1024), "HPLAN_GPT_VOCAB": "50257"},
        32,
    ),
    (
        "1.1B (TinyLlama size)",
        {**gpt_env(layers=22, width=2048, heads=32, seq=2048), "HPLAN_GPT_VOCAB": "32000"},
        32,
    ),
    (
        "3B (OpenLLaMA-3B size)",
        {**gpt_env(layers=26, width=3200, heads=32, seq=2048), "HPLAN_GPT_VOCAB": "32000"},
        32,
    ),
)
STRATEGIES = {
    "mixed": ["--recompute", "auto", "--zero", "auto", "--offload", "auto"],
    "plain": ["--recompute", "never", "--zero", "never", "--offload", "never"],
    "recompute": ["--recompute", "always", "--zero", "never", "--offload", "never"],
    "zero-1": ["--recompute", "never", "--zero", "always", "--offload", "never"],
    "offload": ["--recompute", "never", "--zero", "never", "--offload", "always"],
}


def compare_memory(time_limit_s: float) -> None:
    columns = [
        "cluster",
        "model",
        *(f"{name} samples/s" for name in STRATEGIES),
        "mixed / best uniform (solver's step time)",
        "cost model: mixed / best uniform",
        "mixed uses",
        "verdict",
    ]
    out = table("memory strategies (predicted; devices used / in the cluster)", columns)
    clusters = (
        ("4x 3060 + 4090", write_cluster(MEMORY_ONE_BOX)),
        ("home-lab", CLUSTERS / "home-lab.yaml"),
    )
    for cluster_name, cluster in clusters:
        for model_name, env, batch in MEMORY_MODELS:
            results = {
                name: _solve(cluster, env, batch, time_limit_s, flags)
                for name, flags in STRATEGIES.items()
            }
            out.add_row(cluster_name, model_name, *_memory_cells(results))
            console.print(f"{cluster_name} · {model_name}: done")
    console.print(out)


def _rate(result: dict) -> float | None:
    return None if "error" in result else float(result["predicted_samples_per_s"])


def _solver_rate(result: dict) -> float | None:
    """Samples/s by the step time the solver picks by: the simulator's where the plan was
    simulated (its last word between layouts), else the cost model's."""
    if "error" in result:
        return None
    report = result["report"]
    if not report.get("simulated_step_time_s"):
        return _rate(result)
    batch = report["predicted_samples_per_s"] * report["predicted_step_time_s"]
    return float(batch / report["simulated_step_time_s"])


def _mixed_ratio(results: dict[str, dict], rate: Callable[[dict], float | None]) -> str:
    mixed = rate(results["mixed"])
    uniform = [r for name, res in results.items() if name != "mixed" and (r := rate(res))]
    if mixed is None or not uniform:
        return "-"
    return f"{mixed / max(uniform):.2f}x"


def _memory_cells(results: dict[str, dict]) -> list[str]:
    cells = []
    for result in results.values():
        rate = _rate(result)
        cells.append(
            f"{rate:.2f} ({result['devices_used']}/{result['num_devices']})"
            if rate is not None
            else "does not fit"
        )
    mixed = _solver_rate(results["mixed"])
    uniform = [
        r
        for name, res in results.items()
        if name != "mixed" and (r := _solver_rate(res)) is not None
    ]
    if mixed is None:
        return [*cells, "-", "-", "-", results["mixed"]["error"][:80]]
    best = max(uniform, default=None)
    ratio = mixed / best if best else float("inf")
    plain = _rate(results["plain"])
    binds = plain is None or results["plain"]["devices_used"] < results["plain"]["num_devices"]
    verdict = "ok" if ratio >= 1.0 and (ratio >= 1.2 or not binds) else "BELOW TARGET"
    return [
        *cells,
        f"{ratio:.2f}x" if best else "only mixed fits",
        _mixed_ratio(results, _rate),
        _strategies(results["mixed"]),
        verdict,
    ]


def _strategies(result: dict) -> str:
    kinds = result["memory_strategies"]
    recompute = sum(1 for k in kinds if k == "recompute")
    selective = [
        f"R{k}/{n}"
        for kind, (k, n) in zip(kinds, result["recompute_units"], strict=True)
        if kind == "selective"
    ]
    stage = result["training"].get("zero_stage")
    zero = f", zero-{stage} shards" if stage else ""
    chosen = f", selective {' '.join(selective)}" if selective else ""
    offload = sum(1 for flag in result["offloads"] if flag)
    offloads = f", {offload}/{len(kinds)} offload" if offload else ""
    return f"{recompute}/{len(kinds)} recompute{chosen}{zero}{offloads}"


# --------------------------------------------------------------------------- sync
GPT2_124M = {**gpt_env(layers=12, width=768, heads=12, seq=1024), "HPLAN_GPT_VOCAB": "50257"}
SYNC_ROWS = (
    ("home-lab", "GPT-2 124M", GPT2_124M, 512),
    ("two-site", "GPT-2 124M", GPT2_124M, 512),
    ("mixed-3090-4090", "GPT-2 124M", GPT2_124M, 512),
    ("mixed-3090-4090", "gpt 4x64 (make demo)", gpt_env(layers=4, width=64, heads=4, seq=64), 2048),
)


def compare_sync(time_limit_s: float) -> None:
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
    for cluster, model, env, batch in SYNC_ROWS:
        path = CLUSTERS / f"{cluster}.yaml"
        results = {
            sync: _solve(path, env, batch, time_limit_s, ["--sync", sync])
            for sync in ("all_reduce", "auto")
        }
        out.add_row(
            cluster, model, str(batch), *_sync_cells(results["all_reduce"], results["auto"])
        )
    console.print(out)


def _sync_cells(synchronous: dict, chosen: dict) -> list[str]:
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


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--compare",
        choices=list(DEFAULT_TIME_LIMIT_S),
        default="baselines",
        help="baselines: vs DDP, uniform pipeline and the bound; memory: the mixed memory "
        "strategy vs uniform ones; sync: --sync all_reduce vs --sync auto",
    )
    parser.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=[64, 512],
        help="global batch sizes (baselines only)",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        help="per solve, seconds (default: 60 for baselines and sync, 20 for memory)",
    )
    args = parser.parse_args(argv)
    if args.time_limit is None:
        args.time_limit = DEFAULT_TIME_LIMIT_S[args.compare]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.compare == "baselines":
        compare_baselines(args.batch, args.time_limit)
    elif args.compare == "memory":
        compare_memory(args.time_limit)
    else:
        compare_sync(args.time_limit)


if __name__ == "__main__":
    main()
