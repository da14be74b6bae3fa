"""Views of a simulated step: a JSON summary, a rich table, and timeline events.

Pure functions of a ``SimulationResult`` (and the ``SimSpec`` it came from): the CLI
(``hplan simulate``), ``hplan show --format svg|png`` and the benchmarks use them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from hplan.planner.sim.engine import COMPUTE_KINDS, EventKind, SimEvent, SimulationResult
from hplan.planner.textfmt import format_seconds, percent
from hplan.runtime.contract.timeline_file import (
    ALL_REDUCE,
    COMPUTE,
    SEND_NEXT,
    SEND_PREVIOUS,
    WAIT,
    TimelineEvent,
    process_name,
)


# --------------------------------------------------------------------------- JSON
def simulation_summary(
    result: SimulationResult, *, predicted_step_time_s: float | None = None
) -> dict[str, Any]:
    """JSON-native summary (``hplan simulate --json``); the event list is left out."""
    return {
        "step_time_s": result.step_time_s,
        "samples_per_s": result.samples_per_s,
        "predicted_step_time_s": predicted_step_time_s,
        "bubble_fraction": result.bubble_fraction,
        "bottleneck_rank": result.bottleneck_rank,
        "ranks": [
            {
                "rank": r.rank,
                "replica": r.replica,
                "stage": r.stage,
                "device": r.device,
                "compute_s": r.compute_s,
                "communication_s": r.communication_s,
                "idle_s": r.idle_s,
                "end_s": r.end_s,
            }
            for r in result.ranks
        ],
        "critical_path": [
            {
                "rank": e.rank,
                "kind": e.kind.value,
                "label": e.label,
                "start_s": e.start_s,
                "end_s": e.end_s,
            }
            for e in result.critical_path
        ],
        "notes": list(result.notes),
    }


# --------------------------------------------------------------------------- critical path
@dataclass(frozen=True, slots=True)
class PathSegment:
    """Consecutive critical-path events of one rank and one kind of work."""

    where: str
    """``rank 2`` for compute, ``rank 0 -> 1`` for transfers, ``ranks 0,2`` for all-reduce."""
    what: str
    """``compute``, ``transfer``, ``all-reduce``, ``wait``."""
    num_events: int
    duration_s: float
    first: str
    last: str


def path_segments(path: Sequence[SimEvent]) -> list[PathSegment]:
    """The critical path folded into runs of the same place and kind of work."""
    segments: list[PathSegment] = []
    for event in path:
        where, what = _place(event)
        duration_s = event.end_s - event.start_s
        if segments and (segments[-1].where, segments[-1].what) == (where, what):
            prev = segments[-1]
            segments[-1] = PathSegment(
                where,
                what,
                prev.num_events + 1,
                prev.duration_s + duration_s,
                prev.first,
                event.label,
            )
        else:
            segments.append(PathSegment(where, what, 1, duration_s, event.label, event.label))
    return segments


def _place(event: SimEvent) -> tuple[str, str]:
    if event.kind in COMPUTE_KINDS:
        return f"rank {event.rank}", "compute"
    if event.kind is EventKind.TRANSFER:
        return f"rank {event.rank} -> {event.peer}", "transfer"
    if event.kind is EventKind.ALLREDUCE:
        return event.label.removeprefix("all-reduce "), "all-reduce"
    if event.kind is EventKind.TP_COLLECTIVE:
        return f"rank {event.rank}", "tp all-reduce"
    if event.kind in (EventKind.OUTER_SYNC, EventKind.OUTER_SYNC_HIDDEN):
        return "islands", event.kind.value
    return f"rank {event.rank}", "wait"


def path_shares(result: SimulationResult) -> dict[str, float]:
    """Share of the step that the critical path spends in each kind of work."""
    shares: dict[str, float] = {}
    for segment in path_segments(result.critical_path):
        shares[segment.what] = shares.get(segment.what, 0.0) + segment.duration_s
    step_s = result.step_time_s
    return {k: v / step_s for k, v in shares.items()} if step_s > 0 else shares


# --------------------------------------------------------------------------- rich output
def print_simulation(
    result: SimulationResult,
    console: Console,
    *,
    predicted_step_time_s: float | None = None,
    max_segments: int = 12,
) -> None:
    """Header, per-rank table, critical path and notes, for a person."""
    line = (
        f"[bold]simulated[/bold]  {format_seconds(result.step_time_s)} per step · "
        f"{result.samples_per_s:.1f} samples/s · bubble {percent(result.bubble_fraction)} · "
        f"bottleneck rank {result.bottleneck_rank}"
    )
    console.print(line)
    if predicted_step_time_s:
        ratio = result.step_time_s / predicted_step_time_s
        console.print(
            f"[bold]cost model[/bold] {format_seconds(predicted_step_time_s)} per step "
            f"(simulated / cost model = {ratio:.3f})"
        )
    console.print(_rank_table(result))
    shares = ", ".join(f"{what} {percent(share)}" for what, share in path_shares(result).items())
    console.print(f"[bold]critical path[/bold] ({len(result.critical_path)} events: {shares})")
    segments = path_segments(result.critical_path)
    for segment in segments[:max_segments]:
        span = segment.first if segment.num_events == 1 else f"{segment.first} … {segment.last}"
        console.print(
            f"  {segment.where:<16} {segment.what:<10} {format_seconds(segment.duration_s):>9}  "
            f"{span}",
            highlight=False,
        )
    if len(segments) > max_segments:
        console.print(f"  … {len(segments) - max_segments} more segments (see --json)")
    for note in result.notes:
        console.print(f"[yellow]note:[/yellow] {note}")


def _rank_table(result: SimulationResult) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for header in ("rank", "replica", "stage", "device", "compute", "comm", "idle", "busy"):
        table.add_column(header, justify="left" if header == "device" else "right")
    step_s = result.step_time_s
    for r in result.ranks:
        busy = (r.compute_s + r.communication_s) / step_s if step_s > 0 else 0.0
        table.add_row(
            f"{r.rank}{' *' if r.rank == result.bottleneck_rank else ''}",
            str(r.replica),
            str(r.stage),
            r.device,
            format_seconds(r.compute_s),
            format_seconds(r.communication_s),
            format_seconds(r.idle_s),
            percent(busy),
            style="bold red" if r.rank == result.bottleneck_rank else None,
        )
    return table


# --------------------------------------------------------------------------- timeline
def timeline_events(result: SimulationResult) -> list[TimelineEvent]:
    """The simulated events in the runtime's timeline format (see ``runtime/contract/timeline_file.py``)."""
    return [_timeline_event(e) for e in result.events]


def _timeline_event(event: SimEvent) -> TimelineEvent:
    args: dict[str, Any] = {"replica": event.replica, "stage": event.stage}
    if event.microbatch is not None:
        args["microbatch"] = event.microbatch
    if event.peer is not None:
        args["peer"] = event.peer
    return TimelineEvent(event.rank, _track(event), event.label, event.start_s, event.end_s, args)


def _track(event: SimEvent) -> str:
    if event.kind in COMPUTE_KINDS:
        return COMPUTE
    if event.kind is EventKind.TRANSFER:
        return SEND_NEXT if event.label.startswith("F.") else SEND_PREVIOUS
    if event.kind in (
        EventKind.ALLREDUCE,
        EventKind.OUTER_SYNC,
        EventKind.OUTER_SYNC_HIDDEN,
        EventKind.TP_COLLECTIVE,
    ):
        return ALL_REDUCE
    return WAIT


def process_names(result: SimulationResult) -> dict[int, str]:
    """Row label of every rank (``rank 2 · replica 0 stage 1 · rtx3090``)."""
    return {r.rank: process_name(r.rank, r.replica, r.stage, r.device) for r in result.ranks}
