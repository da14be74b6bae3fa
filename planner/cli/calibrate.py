"""``hplan calibrate``: measured runs -> per-rank error table and a corrected profile.

A thin click layer over ``hplan.planner.profiling.calibrate``: the tables (times, then
memory) go to stderr, ``--json`` to stdout, the corrected profile to
``-o DIR/calibrated.json``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.table import Table

from hplan.planner.textfmt import format_seconds
from hplan.runtime.contract.quantities import format_bytes

if TYPE_CHECKING:  # importing the CLI must not import torch (tests/test_architecture.py)
    from hplan.planner.profiling.calibrate import Calibration, RankError
    from hplan.planner.profiling.comm_calibration import GroupFit
    from hplan.runtime.contract.memory_use import RankMemoryUse


@click.command("calibrate")
@click.argument("plan_path", type=click.Path(path_type=Path))
@click.argument("runs_dir", type=click.Path(path_type=Path))
@click.option(
    "--profile",
    "profile_paths",
    type=click.Path(path_type=Path),
    multiple=True,
    help="The profile the plan was solved with (file or directory; repeatable, as given to "
    "`hplan solve`); its unit times are corrected.",
)
@click.option(
    "-o",
    "--out",
    "out_dir",
    type=click.Path(path_type=Path),
    help="Directory to write the corrected profile into (calibrated.json; default: print only).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the error table as JSON on stdout.")
def calibrate_command(
    plan_path: Path,
    runs_dir: Path,
    profile_paths: tuple[Path, ...],
    out_dir: Path | None,
    as_json: bool,
) -> None:
    """Compare the runs in RUNS_DIR (rank-*.jsonl, or subfolders of them) with PLAN's prediction.

    An elastic run's metrics folder (segment-*/): the segments that ran PLAN.

    Prints the per-rank error table, flags devices more than 15% slower or faster than the
    other devices of their kind, fits each holder set's gradient all-reduce (its last
    holder's exposed time) as a ring latency per step on its nodes, and writes a corrected
    profile for `hplan solve --profile` (compute and all-reduce).
    Then, per rank, the predicted peak memory (and its parts, where the plan records them)
    against the training memory measured: the peak less what the process held before its
    stage was built (on CPU its resident set, on a GPU the CUDA allocator's).
    """
    from hplan.planner.emit.render import table_console
    from hplan.planner.profiling.calibrate import (
        calibrate,
        check_profile_out,
        load_runs_of_plan,
        single_step_runs,
        write_profile,
    )
    from hplan.planner.profiling.profile_file import load_profiles
    from hplan.runtime.contract.plan import Plan

    if out_dir is not None:
        check_profile_out(out_dir)
    plan = Plan.load(plan_path)
    base = load_profiles(profile_paths) if profile_paths else None
    runs = load_runs_of_plan(plan, runs_dir)
    result = calibrate([(plan, runs)], base)
    stderr = table_console(stderr=True)
    print_calibration(result, stderr)
    for path in single_step_runs(runs):
        stderr.print(
            f"note: {path} has one step only; its first step (warm-up: cold caches, and in a "
            "rehearsal of a cpu plan no warm timing yet) is all it measured; run more steps"
        )
    if base is None and result.optimizer_corrections:
        stderr.print(
            "note: the optimizer corrections apply to a profile's unit timings; without "
            "--profile the corrected profile carries the compute corrections only"
        )
    if out_dir is not None:
        path = write_profile(result.profile, out_dir)
        stderr.print(f"wrote {path}; re-solve with `hplan solve ... --profile {out_dir}`")
    if as_json:
        click.echo(json.dumps(calibration_summary(result), indent=2))


def _error_text(measured: float, predicted: float) -> str:
    error = measured / predicted - 1.0 if predicted > 0 else math.nan
    return "-" if math.isnan(error) else f"{error * 100:+.1f}%"


def error_row(e: RankError) -> list[str]:
    """One table row: rank, device, then predicted / measured / error of each quantity."""
    return [
        str(e.rank),
        e.device,
        format_seconds(e.predicted_compute_s),
        format_seconds(e.measured_compute_s),
        _error_text(e.measured_compute_s, e.predicted_compute_s),
        format_seconds(e.predicted_rest_s),
        format_seconds(e.measured_rest_s),
        format_seconds(e.predicted_step_s),
        format_seconds(e.measured_step_s),
        _error_text(e.measured_step_s, e.predicted_step_s),
    ]


def print_calibration(result: Calibration, console: Console) -> None:
    """The per-rank error table, the kind corrections, the stragglers, the speed classes read
    as one speed and the speed factors."""
    from hplan.planner.profiling.calibrate import POOL_THRESHOLD

    table = Table(
        title="predicted vs measured, per step, in seconds of the plan's hardware",
        caption="comm+wait: step - compute - optimizer (transfers, bubbles, all-reduce)",
    )
    for header in (
        "rank",
        "device",
        "compute",
        "measured",
        "error",
        "comm+wait",
        "measured",
        "step",
        "measured",
        "error",
    ):
        table.add_column(header, justify="left" if header == "device" else "right")
    for e in result.errors:
        table.add_row(*error_row(e))
    console.print(table)
    for kind, value in result.kind_corrections.items():
        optimizer = result.optimizer_corrections.get(kind)
        phases = result.phase_corrections.get(kind)
        times = (
            f"unit times x {value:.3f}"
            if phases is None
            else f"forward x {phases[0]:.3f}, backward x {phases[1]:.3f} (together x {value:.3f})"
        )
        also = "" if optimizer is None else f", optimizer steps x {optimizer:.3f}"
        console.print(f"{kind}: {times}{also} (median measured / predicted)")
    if not result.factors:
        console.print("no device differs from its kind by more than 15%")
    for factor in result.factors:
        console.print(
            f"[bold]straggler[/bold] {factor.device}: x {factor.time_factor:.2f} — {factor.reason}"
        )
    for speed_class in result.pooled:
        console.print(
            f"one speed {', '.join(speed_class.devices)}: measured "
            f"{speed_class.spread * 100:.1f}% apart a sample (within "
            f"{POOL_THRESHOLD * 100:.0f}%), each read at their median "
            f"{format_seconds(speed_class.pooled_per_sample_s)} a sample"
        )
    for factor in result.speed_factors:
        console.print(f"speed {factor.device}: x {factor.time_factor:.3f} — {factor.reason}")
    if result.collectives:
        print_collectives(result.collectives, console)
    if result.memory:
        print_memory(result.memory, console)


def collective_row(fit: GroupFit) -> list[str]:
    """One row of the all-reduce table (times per step)."""
    return [
        ",".join(map(str, fit.ranks)) + (f" ({fit.num_sets} sets)" if fit.num_sets > 1 else ""),
        format_bytes(fit.num_bytes),
        format_seconds(fit.predicted_s),
        format_seconds(fit.measured_s),
        _error_text(fit.measured_s, fit.predicted_s),
        format_seconds(fit.wait_s),
        format_seconds(fit.link_latency_per_step_s),
        format_seconds(fit.latency_per_step_s),
    ]


def print_collectives(fits: tuple[GroupFit, ...], console: Console) -> None:
    """The per-sync-group all-reduce table: predicted, measured and the fitted latency."""
    table = Table(
        title="gradient all-reduce per sync group, per step (exposed after the backward)",
        caption="measured: the rank that launched last (no waiting); wait: the others' "
        "excess, waiting for it (the compute correction covers it)",
    )
    for header in (
        "ranks", "bytes", "predicted", "measured", "error", "wait",
        "latency/ring step", "calibrated",
    ):  # fmt: skip
        table.add_column(header, justify="right")
    for fit in fits:
        table.add_row(*collective_row(fit))
    console.print(table)


_PARTS = ("parameter", "gradient", "optimizer_state", "activation", "workspace")
"""``MemoryBreakdown.<part>_bytes``, in the order shown."""
_PART_HEADERS = ("params", "grads", "optimizer", "activations", "workspace")


def _bytes_text(num_bytes: float | None) -> str:
    return "-" if num_bytes is None else format_bytes(num_bytes)


def memory_row(m: RankMemoryUse, *, parts: bool) -> list[str]:
    """One row of the memory table (with the breakdown's columns when ``parts``)."""
    breakdown = [
        "-" if m.breakdown is None else format_bytes(getattr(m.breakdown, f"{p}_bytes"))
        for p in _PARTS
    ]
    return [
        str(m.rank),
        m.device,
        format_bytes(m.predicted_bytes) if m.predicted_bytes > 0 else "-",
        *(breakdown if parts else []),
        _bytes_text(m.measured_bytes),
        "-" if m.ratio is None else f"{m.ratio:.2f}x",
        _bytes_text(m.baseline_bytes),
        format_bytes(m.budget_bytes),
    ]


def print_memory(memory: tuple[RankMemoryUse, ...], console: Console) -> None:
    """The per-rank table of predicted and measured training memory."""
    parts = any(m.breakdown is not None for m in memory)
    table = Table(
        title="predicted vs measured training memory, per rank (peak of every step and run)",
        caption="measured: peak less the process's memory before its stage was built "
        "(baseline); budget: device memory less its kind's reserve",
    )
    headers = ["rank", "device", "predicted", *(_PART_HEADERS if parts else ()), "measured"]
    for header in (*headers, "measured/predicted", "baseline", "budget"):
        table.add_column(header, justify="left" if header == "device" else "right")
    for m in memory:
        table.add_row(*memory_row(m, parts=parts))
    console.print(table)
    if any(m.measured_bytes is None for m in memory):
        console.print(
            "note: some metrics carry no baseline (written before hplan measured one); "
            "re-run to measure their training memory"
        )


def calibration_summary(result: Calibration) -> dict[str, object]:
    """JSON-native summary: rows, kind corrections, device ratios and stragglers."""
    return {
        "ranks": [
            {
                "rank": e.rank,
                "device": e.device,
                "kind": e.kind,
                "predicted_compute_s": e.predicted_compute_s,
                "measured_compute_s": e.measured_compute_s,
                "predicted_rest_s": e.predicted_rest_s,
                "measured_rest_s": e.measured_rest_s,
                "predicted_step_s": e.predicted_step_s,
                "measured_step_s": e.measured_step_s,
            }
            for e in result.errors
        ],
        "kind_corrections": result.kind_corrections,
        "optimizer_corrections": result.optimizer_corrections,
        "phase_corrections": {
            kind: {"forward": f, "backward": b} for kind, (f, b) in result.phase_corrections.items()
        },
        "device_ratios": result.device_ratios,
        "stragglers": [
            {"device": f.device, "time_factor": f.time_factor, "reason": f.reason}
            for f in result.factors
        ],
        "speed_factors": [
            {"device": f.device, "time_factor": f.time_factor, "reason": f.reason}
            for f in result.speed_factors
        ],
        "pooled": [
            {
                "devices": list(c.devices),
                "measured_per_sample_s": list(c.measured_per_sample_s),
                "pooled_per_sample_s": c.pooled_per_sample_s,
            }
            for c in result.pooled
        ],
        "memory": [memory_json(m) for m in result.memory],
        "all_reduce": [
            {
                "ranks": list(f.ranks),
                "num_sets": f.num_sets,
                "num_bytes": f.num_bytes,
                "predicted_s": f.predicted_s,
                "measured_s": f.measured_s,
                "wait_s": f.wait_s,
                "link_latency_per_step_s": f.link_latency_per_step_s,
                "latency_per_step_s": f.latency_per_step_s,
            }
            for f in result.collectives
        ],
        "node_collectives": [
            {"node": c.node, "latency_per_step_s": c.latency_per_step_s, "reason": c.reason}
            for c in result.profile.node_collectives
        ],
    }


def memory_json(m: RankMemoryUse) -> dict[str, object]:
    """JSON-native view of one rank's memory, bytes."""
    return {
        "rank": m.rank,
        "node": m.node,
        "device": m.device,
        "kind": m.kind,
        "predicted_bytes": m.predicted_bytes,
        "predicted_breakdown": None
        if m.breakdown is None
        else {f"{p}_bytes": getattr(m.breakdown, f"{p}_bytes") for p in _PARTS},
        "measured_bytes": m.measured_bytes,
        "measured_over_predicted": m.ratio,
        "baseline_bytes": m.baseline_bytes,
        "peak_bytes": m.peak_bytes,
        "measure": None if m.measure is None else m.measure.value,
        "budget_bytes": m.budget_bytes,
    }
