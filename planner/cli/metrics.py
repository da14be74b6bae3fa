"""``hplan metrics``: a run's per-rank step breakdown and its throughput against the plan's.

A thin click layer over ``hplan.planner.emit.run_metrics`` (and ``run_segments`` for an
elastic run's metrics folder): the tables go to stderr, ``--json`` to stdout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.measure import Measurement

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from hplan.planner.emit.run_metrics import RunMetrics
    from hplan.planner.emit.run_segments import SegmentMetrics


@click.command()
@click.argument("runs_dir", type=click.Path(path_type=Path))
@click.option(
    "--plan",
    "plan_path",
    type=click.Path(path_type=Path),
    help="The plan that ran (default: the plan.json a rehearsal wrote into RUNS_DIR; "
    "without one, no prediction is shown).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def metrics(runs_dir: Path, plan_path: Path | None, as_json: bool) -> None:
    """Summarise a run's metrics (RUNS_DIR: the --metrics-dir of `hplan run` or `hplan
    rehearse`, or a folder of such folders) against the plan's prediction.

    Per rank: the median step and its parts (compute, wait, point-to-point, all-reduce,
    optimizer, other) in ms and as shares of the step, over the steps after each run's
    first; then measured vs predicted samples/s and step time. An elastic run's folder
    (segment-*/): one row per segment (its cause, nodes, ranks, steps, samples/s against its
    plan's) with the restarts between them, then the latest measured segment's ranks.
    """
    from hplan.planner.emit.render import wide_console
    from hplan.planner.emit.run_metrics import metrics_json, run_metrics
    from hplan.planner.emit.run_segments import segment_metrics, segments_json

    console = wide_console(stderr=True)
    segments = segment_metrics(runs_dir, plan_path)
    if segments:
        _print_segments(console, runs_dir, segments)
        if as_json:
            click.echo(json.dumps(segments_json(runs_dir, segments), indent=2))
        return
    result = run_metrics(runs_dir, plan_path)
    _print_run(console, result)
    if as_json:
        click.echo(json.dumps(metrics_json(result), indent=2))


def _print_run(console: Console, result: RunMetrics) -> None:
    """One run's lines and per-rank table."""
    from hplan.planner.emit.run_metrics import breakdown_table, summary_lines

    lines = summary_lines(result)
    console.print(lines[0], soft_wrap=True, markup=False)
    _print_table(console, breakdown_table(result))
    for line in lines[1:]:
        console.print(line, soft_wrap=True, markup=False)


def _print_segments(console: Console, runs_dir: Path, segments: tuple[SegmentMetrics, ...]) -> None:
    """The segments table, then the latest measured segment's ranks."""
    from hplan.planner.emit.run_segments import latest_measured, segments_lines, segments_table

    lines = segments_lines(runs_dir, segments)
    console.print(lines[0], soft_wrap=True, markup=False)
    _print_table(console, segments_table(segments))
    for line in lines[1:]:
        console.print(line, soft_wrap=True, markup=False)
    latest = latest_measured(segments)
    if latest is None or latest.metrics is None:
        return
    console.print(
        f"\nsegment {latest.record.segment:03d} (the latest measured; another segment's ranks: "
        f"hplan metrics {runs_dir / 'segment-NNN'})",
        soft_wrap=True,
        markup=False,
    )
    _print_run(console, latest.metrics)


def _print_table(console: Console, table: Table) -> None:
    """``table`` as wide as its values: no figure folds."""
    width = console.width
    console.width = max(
        width, Measurement.get(console, console.options.update_width(1000), table).maximum
    )
    console.print(table)
    console.width = width
