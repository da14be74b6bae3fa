"""``hplan capture``: capture a model once into a capture file that many solves read.

A thin click layer over :func:`hplan.planner.api.capture_to_file`; torch is imported only
when the command runs. ``hplan solve MODEL --capture FILE`` then plans from the file
without building or tracing the model again, for any cluster.
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from hplan.planner.cli.console import stderr
from hplan.planner.cli.solve import leaf_module_option, seed_option
from hplan.planner.textfmt import format_seconds


@click.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option(
    "--out",
    "-o",
    "out_path",
    type=click.Path(path_type=Path),
    default=Path("capture.json"),
    show_default=True,
    help="The capture file to write.",
)
@leaf_module_option
@seed_option
def capture(model: Path, out_path: Path, leaf_modules: tuple[str, ...], seed: int) -> None:
    """Capture MODEL (a model.py) once: its cost graph and trains check, for
    `hplan solve MODEL --capture FILE` on any cluster.

    Loading model.py executes it, with your rights.
    """
    started_s = time.monotonic()
    from hplan.planner.api import capture_to_file

    with stderr.status("capturing the model (build, trace, measure, trains check)") as status:
        record = capture_to_file(
            model,
            out_path,
            leaf_modules=leaf_modules,
            seed=seed,
            progress=lambda says: status.update(f"capturing the model: {says}"),
        )
    stderr.print(
        f"captured {model} in {format_seconds(time.monotonic() - started_s)}: "
        f"{len(record.units)} units, {len(record.nodes)} graph nodes; wrote {out_path}"
    )
