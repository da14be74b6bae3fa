"""``hplan simulate``: the event-driven timeline of one training step of a plan.

A thin click layer over ``sim.spec.spec_from_plan`` and ``sim.engine.simulate``: a table on
stderr, ``--json`` on stdout, ``--trace`` as Chrome trace JSON (chrome://tracing, Perfetto).
Also :func:`plan_timeline_image`, which ``hplan show --format svg|png`` calls.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from hplan.runtime.contract.memory import load_checked
from hplan.runtime.contract.plan import Plan


@click.command("simulate")
@click.argument("plan_path", type=click.Path(path_type=Path))
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(path_type=Path),
    help="Write the timeline as Chrome trace JSON (open in chrome://tracing or Perfetto).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def simulate_command(plan_path: Path, trace_path: Path | None, as_json: bool) -> None:
    """Simulate one training step of a plan: step time, per-rank busy/idle, bubble, bottleneck.

    Each rank runs its pipeline schedule; transfers queue on their links; gradients are
    all-reduced after the last backward, then the optimizer steps (see `hplan.planner.sim.engine`).
    """
    from hplan.planner.cli.console import stderr
    from hplan.planner.sim.engine import simulate
    from hplan.planner.sim.spec import spec_from_plan
    from hplan.planner.sim.views import (
        print_simulation,
        process_names,
        simulation_summary,
        timeline_events,
    )
    from hplan.runtime.contract.timeline_file import check_trace_path, write_chrome_trace

    if trace_path is not None:
        check_trace_path(trace_path)

    plan = load_checked(plan_path)
    result = simulate(spec_from_plan(plan))
    predicted_s = plan.report.predicted_step_time_s or None
    print_simulation(result, stderr, predicted_step_time_s=predicted_s)
    if trace_path is not None:
        write_chrome_trace(
            trace_path,
            timeline_events(result),
            process_names=process_names(result),
            other_data={"source": "hplan simulate", "plan": str(plan_path), "time_unit": "s"},
        )
        stderr.print(f"wrote {trace_path} (open it in chrome://tracing or ui.perfetto.dev)")
    if as_json:
        summary = simulation_summary(result, predicted_step_time_s=predicted_s)
        click.echo(json.dumps(summary, indent=2))


def plan_timeline_image(plan: Plan, fmt: str) -> bytes:
    """The simulated per-rank timeline of ``plan`` as an ``svg`` or ``png`` image.

    Raises:
        ConfigError: the plan's report has no per-rank predictions, or an unknown format.
    """
    from hplan.planner.emit.timeline_plot import plot_timeline
    from hplan.planner.sim.engine import simulate
    from hplan.planner.sim.spec import spec_from_plan
    from hplan.planner.sim.views import process_names, timeline_events
    from hplan.planner.textfmt import format_seconds, percent

    result = simulate(spec_from_plan(plan))
    title = (
        f"{plan.cluster.name}: simulated step {format_seconds(result.step_time_s)}, "
        f"{result.samples_per_s:.1f} samples/s, bubble {percent(result.bubble_fraction)}, "
        f"{plan.training.schedule.value}"
    )
    return plot_timeline(
        timeline_events(result), process_names=process_names(result), title=title, fmt=fmt
    )
