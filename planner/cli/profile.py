"""``hplan profile``: measure this machine's devices (and a model's units) into a profile.

A thin click layer over :func:`hplan.planner.profiling.machine_profile.profile_machine`; torch is imported
only when the command runs. Human output (progress, summary tables) goes to stderr;
``--json`` prints the (merged) profile on stdout.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.table import Table

from hplan.planner.cli.console import parse_sizes, stderr
from hplan.planner.profiling.windows import (
    DEFAULT_MAX_MICRO_BATCH_SIZE,
    DEFAULT_TIME_BUDGET_S,
    DEFAULT_WINDOW_S,
)
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.quantities import MS_PER_S

if TYPE_CHECKING:
    from hplan.planner.profiling.machine_profile import MachineProfile
    from hplan.planner.profiling.profile_file import Profile, Stat, UnitTiming

_GIGA = 1e9
_TERA = 1e12
_MEGA = 1e6
_MAX_SIZE_COLUMNS = 6


@click.command()
@click.option(
    "--model",
    "model_path",
    type=click.Path(path_type=Path),
    help="Also time each partition unit of this model.py (forward, backward, optimizer, memory).",
)
@click.option(
    "--out",
    "-o",
    "out_dir",
    type=click.Path(path_type=Path),
    help="Directory to write the profiles into, one JSON file per device (default: print only).",
)
@click.option(
    "--node",
    help="The cluster node this machine is: its measurements are keyed to that node "
    "(cpu@NODE, KIND@NODE/INDEX) and the files named after it, so the profiles of every node "
    "go in one directory for `hplan solve --profile DIR`.",
)
@click.option(
    "--cluster",
    "cluster_path",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="cluster.yaml to check --node against (and to take the node's device kinds from).",
)
@click.option(
    "--micro-batch-sizes",
    help="Micro-batch sizes to time the units at, e.g. 1,2,4,8 (default: powers of two from 1 "
    f"until forward + backward of the whole model takes {DEFAULT_TIME_BUDGET_S:g} s, memory "
    "runs out, or --max-micro-batch-size).",
)
@click.option(
    "--max-micro-batch-size",
    type=int,
    default=DEFAULT_MAX_MICRO_BATCH_SIZE,
    show_default=True,
    help="Largest micro-batch size to time when --micro-batch-sizes is not given.",
)
@click.option(
    "--window",
    "window_s",
    type=float,
    default=DEFAULT_WINDOW_S,
    show_default=True,
    help="Seconds every timing runs back to back (a few windows each, median): long enough "
    "for a CPU quota's or a GPU's sustained speed; a shorter one measures bursts.",
)
@click.option(
    "--device",
    help="cpu, cuda or cuda:N (default: every usable GPU, units on the first; else the CPU).",
)
@click.option(
    "--leaf-module",
    "leaf_modules",
    multiple=True,
    help="Module path or class name to keep whole when tracing (as given to `hplan solve`).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for weights and inputs.")
@click.option(
    "--no-benchmark", is_flag=True, help="Skip the matmul and memory-bandwidth microbenchmarks."
)
@click.option("--json", "as_json", is_flag=True, help="Print the profile as JSON on stdout.")
def profile(
    model_path: Path | None,
    out_dir: Path | None,
    node: str | None,
    cluster_path: Path | None,
    micro_batch_sizes: str | None,
    max_micro_batch_size: int,
    window_s: float,
    device: str | None,
    leaf_modules: tuple[str, ...],
    seed: int,
    no_benchmark: bool,
    as_json: bool,
) -> None:
    """Measure this machine's devices (FLOP/s, memory bandwidth) and, with --model, the time
    and memory of each partition unit; `hplan solve --profile DIR` plans with them.

    On a cluster, run it on every node with --node NAME (and --cluster to check the name)
    into one directory: each node keeps its own times.

    Loading model.py executes it, with your rights.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from hplan.planner.profiling.machine_profile import (
        ProfileRequest,
        profile_machine,
        write_profiles,
    )

    if out_dir is not None and out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {str(out_dir)!r} is a file; give a directory")
    request = ProfileRequest(
        model_path=model_path,
        micro_batch_sizes=parse_sizes(micro_batch_sizes),
        max_micro_batch_size=max_micro_batch_size,
        window_s=window_s,
        node=node,
        cluster_path=cluster_path,
        device=device,
        leaf_modules=leaf_modules,
        seed=seed,
        benchmark=not no_benchmark,
    )
    columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    shown = stderr.is_terminal  # a bar on a pipe or file leaves only a blank line
    with Progress(*columns, console=stderr, transient=True, disable=not shown) as bar:
        task = bar.add_task("profiling", total=None)

        def on_phase(message: str) -> None:
            bar.update(task, description=message)

        def on_step(unit: str, timed: bool, total: int | None) -> None:
            verb = "timing" if timed else "sharing"
            bar.update(task, total=total, advance=1, description=f"{verb} {unit}")

        result = profile_machine(request, on_phase=on_phase, on_step=on_step)
    merged = result.merged()
    for table in profile_tables(merged):
        stderr.print(table)
    for note in merged.notes:
        stderr.print(f"note: {note}", markup=False)
    stderr.print(profiled_line(result), markup=False)
    if out_dir is not None:
        for path in write_profiles(result, out_dir):
            stderr.print(f"wrote {path}", markup=False)
    if as_json:
        click.echo(merged.to_json(), nl=False)


def profiled_line(result: MachineProfile) -> str:
    """``profiled in 14.2 s (benchmarks 3.9 s, units 10.1 s at 14 micro-batch sizes 1..8192)``."""
    parts = []
    for phase, time_s in result.phase_times_s:
        sizes = result.micro_batch_sizes
        detail = ""
        if phase == "units" and sizes:
            span = f"{sizes[0]}..{sizes[-1]}" if len(sizes) > 1 else str(sizes[0])
            detail = f" at {len(sizes)} micro-batch sizes {span}"
        parts.append(f"{phase} {time_s:.1f} s{detail}")
    breakdown = f" ({', '.join(parts)})" if parts else ""
    return f"profiled in {result.elapsed_s:.1f} s{breakdown}"


def profile_tables(profile: Profile) -> list[Table]:
    """Readable summary: one table of devices, one of units (when timed)."""
    tables = [_device_table(profile)]
    if profile.unit_timings:
        tables.append(_unit_table(profile))
    return tables


def _device_table(profile: Profile) -> Table:
    dtypes = list(dict.fromkeys(d for p in profile.devices for d in p.matmul_flops_per_s))
    table = Table(title="devices (median ± half the p10-p90 range)", title_justify="left")
    for column in ("key", "name", "memory GB", *(f"{d} TFLOP/s" for d in dtypes), "copy GB/s"):
        table.add_column(column)
    for device in profile.devices:
        flops = device.matmul_flops_per_s
        bandwidth = device.memory_bandwidth_bytes_per_s
        table.add_row(
            device.key,
            device.name,
            f"{device.memory_bytes / _GIGA:.1f}",
            *(_spread(flops[d], _TERA, 3) if d in flops else "-" for d in dtypes),
            _spread(bandwidth, _GIGA, 1) if bandwidth else "-",
        )
    return table


def shown_sizes(sizes: list[int], limit: int = _MAX_SIZE_COLUMNS) -> list[int]:
    """At most ``limit`` of ``sizes`` (ascending), evenly spread, the first and last kept."""
    if len(sizes) <= limit:
        return sizes
    return [sizes[round(i * (len(sizes) - 1) / (limit - 1))] for i in range(limit)]


def _unit_table(profile: Profile) -> Table:
    timed = sorted({t.micro_batch_size for t in profile.unit_timings})
    sizes = shown_sizes(timed)
    title = "units: forward + backward ms per micro-batch"
    if len(sizes) < len(timed):
        title += f" ({len(sizes)} of {len(timed)} sizes; --json or the files have all)"
    table = Table(title=title, title_justify="left")
    table.add_column("device")
    table.add_column("unit")
    for size in sizes:
        table.add_column(f"mbs {size}", justify="right")
    table.add_column("optimizer ms", justify="right")
    table.add_column(f"activations / peak MB (mbs {sizes[-1]})", justify="right")
    rows: dict[tuple[str, str], dict[int, UnitTiming]] = {}
    for t in profile.unit_timings:
        rows.setdefault((t.device, t.unit), {})[t.micro_batch_size] = t
    order = {u: i for i, u in enumerate(profile.model.units)} if profile.model else {}
    for (device, unit), by_size in sorted(rows.items(), key=lambda r: order.get(r[0][1], -1)):
        cells = []
        for size in sizes:
            timing = by_size.get(size)
            cells.append(
                "-" if timing is None else _ms(timing.forward_s.median + timing.backward_s.median)
            )
        last = by_size[max(by_size)]
        optimizer = last.optimizer_s
        memory = f"{last.activation_bytes / _MEGA:.2f} / {last.peak_bytes / _MEGA:.2f}"
        table.add_row(device, unit, *cells, "-" if optimizer is None else _ms(optimizer), memory)
    return table


def _ms(time_s: float) -> str:
    return f"{time_s * MS_PER_S:.3f}"


def _spread(stat: Stat, scale: float, digits: int) -> str:
    """``"0.138 ±12%"``: the median and half the p10-p90 range relative to it."""
    half_range = (stat.p90 - stat.p10) / 2
    relative = f" ±{100 * half_range / stat.median:.0f}%" if stat.median > 0 else ""
    return f"{stat.median / scale:.{digits}f}{relative}"
