"""``hplan devices``: the device catalog a cluster file's ``type:`` names, with its figures.

A thin click layer over ``hplan.planner.hardware.catalog``: a table on stderr (name, memory,
peak rates, memory bandwidth), ``--json`` on stdout (with aliases and each figure's source).
"""

from __future__ import annotations

import json

import click

from hplan.runtime.contract.quantities import BYTES_PER_GB, BYTES_PER_GIB, FLOPS_PER_TFLOP


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the catalog as JSON on stdout.")
def devices(as_json: bool) -> None:
    """List the device types a cluster file may name (`type: rtx3090`), with the peak
    figures the roofline cost model uses and where each comes from.

    Names are forgiving: `rtx3090`, `RTX 3090`, `3090` and the name nvidia-smi prints all
    find the same entry. TFLOP/s are dense peaks: fp32 on CUDA cores; tf32, fp16 and bf16
    on tensor cores (the fp32 rate where a card lacks them).
    """
    from hplan.planner.emit.render import wide_console
    from hplan.planner.hardware.catalog import device_type_names, lookup_device_type

    entries = [lookup_device_type(name) for name in device_type_names()]
    if as_json:
        rows = [
            {
                "type": d.key,
                "name": d.display_name,
                "memory_bytes": d.memory_bytes,
                "fp32_flops_per_s": d.fp32_flops_per_s,
                "tf32_flops_per_s": d.tf32_flops_per_s,
                "fp16_flops_per_s": d.fp16_flops_per_s,
                "bf16_flops_per_s": d.bf16_flops_per_s,
                "memory_bandwidth_bytes_per_s": d.memory_bandwidth_bytes_per_s,
                "consumer_card": d.consumer_card,
                "aliases": list(d.aliases),
                "source": d.source,
            }
            for d in entries
        ]
        click.echo(json.dumps(rows, indent=2))
        return
    from rich.table import Table

    table = Table(
        title="device types (cluster.yaml `type:`); TFLOP/s dense peak",
        caption="the source of every figure: hplan devices --json",
    )
    for column in ("type", "name", "memory GiB", "fp32", "tf32", "fp16", "bf16", "memory GB/s"):
        table.add_column(column, justify="left" if column in ("type", "name") else "right")
    for d in entries:
        table.add_row(
            d.key,
            d.display_name,
            f"{d.memory_bytes / BYTES_PER_GIB:.0f}",
            *(
                f"{rate / FLOPS_PER_TFLOP:.1f}"
                for rate in (
                    d.fp32_flops_per_s,
                    d.tf32_flops_per_s,
                    d.fp16_flops_per_s,
                    d.bf16_flops_per_s,
                )
            ),
            f"{d.memory_bandwidth_bytes_per_s / BYTES_PER_GB:.0f}",
        )
    wide_console(stderr=True).print(table)
