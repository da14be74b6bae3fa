"""``hplan show``: a plan as text, JSON, graphviz or a timeline picture."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.memory import load_checked
from hplan.runtime.contract.plan import Plan


@click.command()
@click.argument("plan_path", type=click.Path(path_type=Path))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json", "dot", "svg", "png"], case_sensitive=False),
    default="text",
    show_default=True,
    help="text: a summary table; json: plan.json; dot: graphviz; svg / png: the simulated "
    "per-rank timeline (redirect stdout to a file).",
)
def show(plan_path: Path, fmt: str) -> None:
    """Show a plan: devices, stages, units, batch shares, predicted time and memory."""
    if fmt in ("svg", "png"):
        _show_image(load_checked(plan_path), fmt)
        return
    from hplan.planner.emit.render import (
        print_text,
        render_dot,
        render_json,
        render_text,
        wide_console,
    )

    plan = load_checked(plan_path)
    if fmt == "text" and sys.stdout.isatty():
        print_text(plan, wide_console(stderr=False))
    elif fmt == "text":
        click.echo(render_text(plan), nl=False)  # the bytes of summary.txt
    elif fmt == "json":
        click.echo(render_json(plan), nl=False)
    else:
        click.echo(render_dot(plan), nl=False)


def _show_image(plan: Plan, fmt: str) -> None:
    """Write the simulated timeline image to stdout (PNG only when stdout is not a terminal)."""
    from hplan.planner.cli.simulate import plan_timeline_image

    if fmt == "png" and sys.stdout.isatty():
        raise ConfigError("--format png writes binary data; redirect stdout to a file (> t.png)")
    image = plan_timeline_image(plan, fmt)
    if fmt == "svg":
        click.echo(image.decode("utf-8"), nl=False)
        return
    sys.stdout.flush()
    sys.stdout.buffer.write(image)
    sys.stdout.buffer.flush()
