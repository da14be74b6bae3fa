"""``hplan metrics``: a run's per-rank step breakdown and its throughput against the plan's.

A thin click layer over ``hplan.planner.emit.run_metrics``: the table goes to stderr,
``--json`` to stdout.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.measure import Measurement


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
    first; then measured vs predicted samples/s and step time.
    """
    from hplan.planner.emit.render import wide_console
    from hplan.planner.emit.run_metrics import (
        breakdown_table,
        metrics_json,
        run_metrics,
        summary_lines,
    )

    result = run_metrics(runs_dir, plan_path)
    console = wide_console(stderr=True)
    lines = summary_lines(result)
    console.print(lines[0], soft_wrap=True, markup=False)
    table = breakdown_table(result)
    width = console.width
    console.width = max(
        width, Measurement.get(console, console.options.update_width(1000), table).maximum
    )
    console.print(table)  # as wide as its values: no figure folds
    console.width = width
    for line in lines[1:]:
        console.print(line, soft_wrap=True, markup=False)
    if as_json:
        click.echo(json.dumps(metrics_json(result), indent=2))
