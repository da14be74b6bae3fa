"""What ``slow_links.py`` measured, as figures, a table and a JSON record: per run and seed,
its time to the reference's loss at N samples, DDP's time over it and the loss penalty at
N (``time_to_target.py``), then medians and ranges over seeds.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster_runs import median_range
from common import console, table
from time_to_target import (
    extrapolated_time_s,
    median_known,
    relative_spread,
    steps_to_target,
    time_to_step_s,
    trailing_means,
    window_steps,
)

from hplan.runtime.contract.holders import outer_groups
from hplan.runtime.contract.plan import Plan, SyncMode

TARGET_X_DDP = 4.0
"""Issue 38's bar: time to target at least 4x DDP's at 100 Mbit/s ..."""
TARGET_RATE_MBIT_PER_S = 100.0
"""... with the loss penalty at equal samples within the spread of two synchronous runs."""


@dataclass
class Trial:
    """One seed's run: per step its job loss and rank 0's end (Unix s), and its samples/s
    (global batch over the spacing of the step ends after the warm-up)."""

    losses: list[float | None]
    ends: list[float]
    samples_per_s: float


@dataclass
class Run:
    """One row: an hplan plan or a DDP split, run once per seed."""

    label: str
    plan_dir: Path | None = None
    """hplan: the plan's folder (its launch scripts); None: DDP."""
    plan: Plan | None = None
    sizes: tuple[int, ...] = ()
    """DDP: samples per node."""
    sync: str = SyncMode.ALL_REDUCE.value
    notes: list[str] = field(default_factory=list)
    trials: dict[int, Trial] = field(default_factory=dict)
    """Seed -> what it measured."""
    breakdown: dict[int, dict[str, float]] = field(default_factory=dict)
    """hplan: median ms per part of the step, per rank, last seed."""

    @property
    def horizon(self) -> int:
        """The largest H of the plan's outer syncs; 1 for DDP and a plan that syncs every
        step."""
        if self.plan is None:
            return 1
        groups = outer_groups(self.plan).values()
        return max((g.local_steps for g in groups if g.mode is not SyncMode.ALL_REDUCE), default=1)

    @property
    def local(self) -> bool:
        """Whether it has outer syncs: trained to N x (1 + slack) samples, not extrapolated."""
        if self.plan is None:
            return False
        return any(g.mode is not SyncMode.ALL_REDUCE for g in outer_groups(self.plan).values())


@dataclass
class RateResult:
    rate_mbit_per_s: float
    runs: list[Run]


@dataclass
class Reference:
    """The synchronous reference (hplan's all-reduce plan on fast links) and DDP's
    samples/s there (equal split, first seed)."""

    run: Run
    ddp_samples_per_s: float | None = None


def trial_figures(
    run: Run,
    trial: Trial,
    reference: Sequence[float | None],
    *,
    num_steps: int,
    global_batch: int,
    loss_steps: int,
) -> dict[str, Any]:
    """One seed's figures of one run against the reference's losses of that seed: its
    loss window (steps), the target, the step at which it reached it and the time it took
    (None: not within the run), its loss at N and its penalty (loss / target - 1; None for a
    synchronous run, whose losses are the reference's)."""
    window = window_steps(loss_steps, run.horizon, num_steps)
    means = trailing_means(reference, window)
    target = means[num_steps - 1] if num_steps <= len(means) else None
    out: dict[str, Any] = {
        "window_steps": window,
        "target": target,
        "samples_per_s": trial.samples_per_s,
    }
    if not run.local:
        time_s = extrapolated_time_s(num_steps * global_batch, trial.samples_per_s)
        return {**out, "step": num_steps - 1, "time_s": time_s, "loss": None, "penalty": None}
    own = trailing_means(trial.losses, window)
    step = steps_to_target(own, target) if target is not None else None
    time_s = time_to_step_s(trial.ends, step) if step is not None else None
    loss = own[num_steps - 1] if num_steps <= len(own) else None
    penalty = loss / target - 1 if loss is not None and target is not None else None
    return {**out, "step": step, "time_s": time_s, "loss": loss, "penalty": penalty}


def run_figures(
    result: RateResult, reference: Reference, num_steps: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Per run of one rate: its figures per seed (:func:`trial_figures`) plus ``x_ddp``,
    the faster DDP split's time to target of that seed over the run's (0 where the run did
    not reach the target: as if it never would)."""
    per_run = []
    for run in result.runs:
        seeds = {}
        for seed, trial in sorted(run.trials.items()):
            ref = reference.run.trials[seed].losses
            seeds[seed] = trial_figures(
                run,
                trial,
                ref,
                num_steps=num_steps,
                global_batch=args.global_batch,
                loss_steps=args.loss_steps,
            )
        per_run.append(seeds)
    ddp = [figs for run, figs in zip(result.runs, per_run, strict=True) if run.plan_dir is None]
    for seeds in per_run:
        for seed, figs in seeds.items():
            best = min((d[seed]["time_s"] for d in ddp if seed in d), default=None)
            figs["x_ddp"] = _x_ddp(best, figs["time_s"])
    return [
        {
            "run": run.label,
            "sync": run.sync,
            "local": run.local,
            "seeds": seeds,
            "notes": run.notes,
            "breakdown_ms": run.breakdown,
        }
        for run, seeds in zip(result.runs, per_run, strict=True)
    ]


def _x_ddp(ddp_time_s: float | None, time_s: float | None) -> float | None:
    """DDP's time over the run's; 0 where the run did not reach the target, None without
    DDP."""
    if ddp_time_s is None:
        return None
    return ddp_time_s / time_s if time_s else 0.0


def _spread(values: Sequence[float | None], unit: str = "", digits: int = 2) -> str:
    known = [v for v in values if v is not None]
    return median_range(known, unit, digits) if known else "-"


def _seed_values(row: dict[str, Any], key: str, scale: float = 1.0) -> list[float | None]:
    return [None if f[key] is None else f[key] * scale for f in row["seeds"].values()]


COLUMNS = (
    "Mbit/s",
    "run",
    "sync",
    "samples/s",
    "time to target s",
    "x DDP",
    "reached",
    "loss at N",
    "reference",
    "penalty %",
    "loss over",
)


def table_row(rate: float, row: dict[str, Any]) -> list[str]:
    """One table row: medians (ranges) over seeds."""
    seeds = list(row["seeds"].values())
    reached = sum(f["time_s"] is not None for f in seeds)
    windows = sorted({f["window_steps"] for f in seeds})
    how = "steps" if row["local"] else "steps, extrapolated"
    return [
        f"{rate:g}",
        row["run"],
        row["sync"],
        _spread(_seed_values(row, "samples_per_s"), "", 1),
        _spread(_seed_values(row, "time_s"), "", 1),
        _spread(_seed_values(row, "x_ddp"), "x"),
        f"{reached}/{len(seeds)}",
        _spread(_seed_values(row, "loss"), "", 4) if row["local"] else "= reference",
        _spread(_seed_values(row, "target"), "", 4),
        _spread(_seed_values(row, "penalty", 100.0), "", 2) if row["local"] else "-",
        f"{'/'.join(map(str, windows))} {how}" if seeds else "-",
    ]


def reference_losses(reference: Reference, num_steps: int, loss_steps: int) -> list[float]:
    """The reference's loss at N per seed, over ``loss_steps`` steps."""
    out = []
    for trial in reference.run.trials.values():
        value = trailing_means(trial.losses, loss_steps)[num_steps - 1]
        if value is not None:
            out.append(value)
    return out


def ddp_share_lines(result: RateResult, reference: Reference) -> list[str]:
    """DDP's communication share of its step per split (median over seeds): its step on
    the shaped links less its step on fast links (the equal split), over the former; and
    what that bounds a local row to, whose every sync were hidden."""
    fast = reference.ddp_samples_per_s
    lines = []
    for run in (r for r in result.runs if r.plan_dir is None):
        if not fast or not run.trials:
            continue
        shaped = median_known([t.samples_per_s for t in run.trials.values()]) or fast
        share = 1 - shaped / fast
        bound = "communication-bound" if share >= 0.5 else "NOT communication-bound"
        lines.append(
            f"{run.label}: {share:.0%} of its step is communication at "
            f"{result.rate_mbit_per_s:g} Mbit/s (against fast links): {bound}; a row whose "
            f"every sync is hidden is at most {fast / shaped:.1f}x DDP"
        )
    return lines


def verdict_lines(rows: Sequence[dict[str, Any]], spread: float | None) -> list[str]:
    """Issue 38's bar per local run: median x DDP at least 4, median penalty within the
    spread of two reference runs."""
    lines = []
    for row in (r for r in rows if r["local"]):
        x_ddp = median_known(_seed_values(row, "x_ddp"))
        penalty = median_known(_seed_values(row, "penalty"))
        if x_ddp is None or penalty is None:
            continue
        fast = x_ddp >= TARGET_X_DDP
        close = spread is not None and penalty <= spread
        verdict = "meets" if fast and close else "misses"
        spread_text = f"{spread:.2%}" if spread is not None else "unknown (one seed)"
        lines.append(
            f"{row['run']}: {x_ddp:.2f}x DDP, penalty {penalty:+.2%} against a spread of "
            f"{spread_text}: {verdict} the bar ({TARGET_X_DDP:g}x, penalty within the spread)"
        )
    return lines


def report(
    results: Sequence[RateResult],
    reference: Reference,
    args: argparse.Namespace,
    model: dict[str, Any],
) -> None:
    """The table, the reference's and DDP's lines, the plans' notes and the JSON record."""
    num_steps = args.num_steps
    samples = num_steps * args.global_batch
    ref_losses = reference_losses(reference, num_steps, args.loss_steps)
    spread = relative_spread(ref_losses)
    title = (
        f"Slow links {args.layout}: {model['name']}, N = {num_steps} steps x "
        f"{args.global_batch} = {samples} samples, seeds {', '.join(map(str, args.seed_list))} "
        "(median, range)"
    )
    out = table(title, list(COLUMNS))
    all_rows = []
    for result in results:
        rows = run_figures(result, reference, num_steps, args)
        all_rows.append(rows)
        for row in rows:
            out.add_row(*table_row(result.rate_mbit_per_s, row))
    console.print(out)
    console.print(
        f"reference (hplan all_reduce on {args.fast_mbit_per_s:g} Mbit/s links): loss at N "
        f"{_spread(ref_losses, '', 4)} over the last {args.loss_steps} steps; two runs of "
        "different seeds differ by "
        + (f"{spread:.2%} (median of pairs)" if spread is not None else "- (one seed)")
    )
    console.print(
        f"synchronous rows (DDP, plans without outer syncs): samples/s measured over "
        f"{args.window_steps} steps after {args.warmup}, extrapolated to N; local rows: trained "
        f"for {args.local_steps} steps (N x {1 + args.slack:g}), timed to the first step at "
        "the target (the reference's loss at N over the same window)"
    )
    for result, rows in zip(results, all_rows, strict=True):
        console.print(f"[bold]{result.rate_mbit_per_s:g} Mbit/s[/]")
        for line in ddp_share_lines(result, reference):
            console.print(f"  {line}")
        if result.rate_mbit_per_s == TARGET_RATE_MBIT_PER_S:
            for line in verdict_lines(rows, spread):
                console.print(f"  {line}")
        for run in result.runs:
            for note in run.notes:
                console.print(f"  {run.label}: {note}")
    console.print(
        f"{model['name']} ({', '.join(f'{k}={v}' for k, v in model['env'].items())}): "
        f"{model['num_params'] / 1e6:.2f} M parameters, {model['gradient_bytes'] / 1e6:.2f} MB "
        "of gradients a synchronous step all-reduces"
    )
    if args.json is None:
        return
    record = {
        "benchmark": "slow_links",
        "model": model,
        "layout": args.layout,
        "global_batch": args.global_batch,
        "steps": num_steps,
        "samples": samples,
        "local_steps": args.local_steps,
        "seeds": args.seed_list,
        "loss_steps": args.loss_steps,
        "window_steps": args.window_steps,
        "warmup": args.warmup,
        "skipped": args.skipped,
        "reference": {
            "losses_at_n": ref_losses,
            "spread": spread,
            "ddp_fast_samples_per_s": reference.ddp_samples_per_s,
        },
        "rates": [
            {"rate_mbit_per_s": r.rate_mbit_per_s, "runs": rows}
            for r, rows in zip(results, all_rows, strict=True)
        ],
    }
    args.json.write_text(json.dumps(record) + "\n")
