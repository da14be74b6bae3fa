"""Per-rank timelines: what each rank did when, as Chrome trace JSON.

One format for predicted and measured timelines, so that they can be put side by side:
``hplan simulate --trace`` writes the simulator's events, ``hplan rehearse --trace`` the
events the ranks recorded. A :class:`TimelineEvent` is one span on one *track*
(:data:`TRACKS`) of one rank; compute names follow the schedule's text form (``s1.F.mb3``).
The writer follows the Trace Event Format read by chrome://tracing and Perfetto: complete
events (``"ph": "X"``, ``ts`` and ``dur`` in microseconds), one ``pid`` per rank and one
``tid`` per track, named by metadata events (``"ph": "M"``). Ranks record with
:class:`TimelineRecorder` (``time.monotonic``: one clock for every process of a machine)
and append one JSON line per step with :class:`TimelineWriter`; :func:`read_step_events`
reads one step of every rank back. This module needs no torch.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.plan import Plan
from hplan.runtime.contract.quantities import US_PER_S

COMPUTE = "compute"
SEND_NEXT = "send to next stage"
SEND_PREVIOUS = "send to previous stage"
ALL_REDUCE = "all-reduce"
WAIT = "wait"
TRACKS: tuple[str, ...] = (COMPUTE, SEND_NEXT, SEND_PREVIOUS, ALL_REDUCE, WAIT)
"""Tracks in display order; an event on another track gets the next free thread id."""


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    """One span of one rank's timeline."""

    rank: int
    track: str
    """One of :data:`TRACKS` (others are allowed and shown after them)."""
    name: str
    """E.g. ``s1.F.mb3``, ``wait F.mb3 from s0``, ``all-reduce ranks 0,2``, ``optimizer``."""
    start_s: float
    end_s: float
    args: Mapping[str, Any] = field(default_factory=dict)
    """JSON-native extras shown in the trace viewer (micro-batch, peer, bytes ...)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-native view (the format of the timeline files)."""
        return {
            "rank": self.rank,
            "track": self.track,
            "name": self.name,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "args": dict(self.args),
        }

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> TimelineEvent:
        """Inverse of :meth:`to_dict`."""
        return TimelineEvent(
            rank=int(data["rank"]),
            track=str(data["track"]),
            name=str(data["name"]),
            start_s=float(data["start_s"]),
            end_s=float(data["end_s"]),
            args=dict(data.get("args", {})),
        )


def process_name(rank: int, replica: int, stage: int, device: str) -> str:
    """The label of one rank's row: ``rank 2 · replica 0 stage 1 · rtx3090``."""
    return f"rank {rank} · replica {replica} stage {stage} · {device}"


# --------------------------------------------------------------------------- Chrome trace
def chrome_trace(
    events: Iterable[TimelineEvent],
    *,
    process_names: Mapping[int, str] | None = None,
    other_data: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Events as a Chrome trace object (``{"traceEvents": [...], ...}``).

    Args:
        events: spans in seconds; ``ts``/``dur`` are written in microseconds.
        process_names: row label per rank (default ``rank <r>``).
        other_data: shown by the viewers as the trace's metadata (e.g. the time unit).

    Deterministic: events are sorted by (rank, track, start, name).
    """
    ordered = sorted(events, key=_sort_key)
    names = dict(process_names or {})
    tids = _thread_ids(ordered)
    ranks = sorted({e.rank for e in ordered} | set(names))
    meta: list[dict[str, Any]] = []
    for rank in ranks:
        label = names.get(rank, f"rank {rank}")
        meta.append(_meta("process_name", rank, 0, {"name": label}))
        meta.append(_meta("process_sort_index", rank, 0, {"sort_index": rank}))
        for track, tid in tids.items():
            meta.append(_meta("thread_name", rank, tid, {"name": track}))
            meta.append(_meta("thread_sort_index", rank, tid, {"sort_index": tid}))
    spans = [_span(e, tids[e.track]) for e in ordered]
    trace: dict[str, Any] = {"traceEvents": meta + spans, "displayTimeUnit": "ms"}
    if other_data:
        trace["otherData"] = dict(other_data)
    return trace


def check_trace_path(path: str | Path) -> None:
    """Fail before any work when a trace could not be written to ``path``.

    Raises:
        ConfigError: ``path`` is a directory, or its folder does not exist.
    """
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"trace path {str(target)!r} is a directory; give a file name")
    if target.parent.exists() and not target.parent.is_dir():
        raise ConfigError(
            f"cannot write trace {str(target)!r}: {str(target.parent)!r} is a file; choose "
            "another path"
        )
    if not target.parent.is_dir():
        raise ConfigError(
            f"cannot write trace {str(target)!r}: folder {str(target.parent)!r} does not "
            "exist; create it or choose another path"
        )


def write_chrome_trace(
    path: str | Path,
    events: Iterable[TimelineEvent],
    *,
    process_names: Mapping[int, str] | None = None,
    other_data: Mapping[str, Any] | None = None,
) -> None:
    """Write :func:`chrome_trace` as JSON to ``path``.

    Raises:
        ConfigError: the file cannot be written (names the path and the reason).
    """
    trace = chrome_trace(events, process_names=process_names, other_data=other_data)
    text = json.dumps(trace, indent=1, allow_nan=False) + "\n"
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"cannot write trace {str(path)!r} ({exc.strerror}); choose a writable path"
        ) from None


def _sort_key(event: TimelineEvent) -> tuple[int, int, float, str]:
    order = TRACKS.index(event.track) if event.track in TRACKS else len(TRACKS)
    return (event.rank, order, event.start_s, event.name)


def _thread_ids(events: Sequence[TimelineEvent]) -> dict[str, int]:
    used = {e.track for e in events}
    tracks = [t for t in TRACKS if t in used] + sorted(used - set(TRACKS))
    return {track: idx for idx, track in enumerate(tracks)}


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _span(event: TimelineEvent, tid: int) -> dict[str, Any]:
    start_us = event.start_s * US_PER_S
    dur_us = max(0.0, event.end_s - event.start_s) * US_PER_S
    return {
        "name": event.name,
        "cat": event.track,
        "ph": "X",
        "ts": round(start_us, 3),
        "dur": round(dur_us, 3),
        "pid": event.rank,
        "tid": tid,
        "args": dict(event.args),
    }


# --------------------------------------------------------------------------- recording
class TimelineRecorder:
    """Collects one rank's events (``time.monotonic`` seconds) during one step."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.events: list[TimelineEvent] = []

    def add(self, track: str, name: str, start_s: float, end_s: float, **args: Any) -> None:
        """Record a span that has ended."""
        self.events.append(TimelineEvent(self.rank, track, name, start_s, end_s, args))

    @contextlib.contextmanager
    def span(self, track: str, name: str, **args: Any) -> Iterator[None]:
        """Record the time the ``with`` block takes (also when it raises)."""
        start_s = time.monotonic()
        try:
            yield
        finally:
            self.add(track, name, start_s, time.monotonic(), **args)


def timeline_path(metrics_dir: Path, rank: int) -> Path:
    """``<metrics_dir>/timeline-rank-<rank>.jsonl``."""
    return metrics_dir / f"timeline-rank-{rank}.jsonl"


class TimelineWriter:
    """Appends one JSON line per step (``{"step": k, "events": [...]}``) for one rank."""

    def __init__(self, metrics_dir: Path, rank: int) -> None:
        metrics_dir.mkdir(parents=True, exist_ok=True)
        self._file = timeline_path(metrics_dir, rank).open("w", encoding="utf-8")

    def write(self, step: int, events: Sequence[TimelineEvent]) -> None:
        """Append and flush one step's events."""
        record = {"step": step, "events": [e.to_dict() for e in events]}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def read_timelines(metrics_dir: Path) -> dict[int, dict[int, list[TimelineEvent]]]:
    """Every complete line of every ``timeline-rank-*.jsonl``: rank -> step -> events.

    Raises:
        ConfigError: a complete line is not a timeline record.
    """
    found: dict[int, dict[int, list[TimelineEvent]]] = {}
    for path in sorted(metrics_dir.glob("timeline-rank-*.jsonl")):
        rank = int(path.stem.removeprefix("timeline-rank-"))
        found[rank] = _read_one(path)
    return found


def _read_one(path: Path) -> dict[int, list[TimelineEvent]]:
    steps: dict[int, list[TimelineEvent]] = {}
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if not line.endswith("\n"):
            break  # a partial last line: the rank is still writing or died
        try:
            record = json.loads(line)
            steps[int(record["step"])] = [TimelineEvent.from_dict(e) for e in record["events"]]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"{path}: not a timeline line ({exc}); was it written by hplan?"
            ) from None
    return steps


def read_step_events(
    metrics_dir: Path, step: int | None = None, *, time_scale: float = 1.0
) -> tuple[int, list[TimelineEvent]]:
    """One step of every rank, time zero at its first event, in units of ``1 / time_scale``.

    Args:
        step: the step to read; None: the last step that every rank recorded.
        time_scale: recorded seconds per output second (rehearsal: emulated seconds per
            second of plan hardware, so that the result reads in plan seconds).

    Returns:
        (the step, its events).

    Raises:
        ConfigError: no timeline files, or no step that every rank recorded.
    """
    timelines = read_timelines(metrics_dir)
    common = set.intersection(*(set(v) for v in timelines.values())) if timelines else set()
    if not common or (step is not None and step not in common):
        raise ConfigError(
            f"no timeline of step {'any' if step is None else step} for every rank in "
            f"{str(metrics_dir)!r}; rehearse with a metrics directory and at least one step"
        )
    chosen = max(common) if step is None else step
    events = [e for rank in sorted(timelines) for e in timelines[rank][chosen]]
    return chosen, shifted(events, time_scale=time_scale)


def shifted(events: Sequence[TimelineEvent], *, time_scale: float = 1.0) -> list[TimelineEvent]:
    """Events moved so the first starts at 0, and divided by ``time_scale``."""
    if not events:
        return []
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise ConfigError(f"time scale is {time_scale}; it must be a finite number > 0")
    zero_s = min(e.start_s for e in events)
    return [
        replace(e, start_s=(e.start_s - zero_s) / time_scale, end_s=(e.end_s - zero_s) / time_scale)
        for e in events
    ]


def plan_process_names(plan: Plan) -> dict[int, str]:
    """Row label of every rank of ``plan`` (see :func:`process_name`)."""
    return {r.rank: process_name(r.rank, r.replica, r.stage, r.device_kind) for r in plan.ranks}


def write_measured_trace(
    plan: Plan, metrics_dir: Path, path: str | Path, *, time_scale: float
) -> int:
    """Write the last step every rank recorded in ``metrics_dir`` as a Chrome trace.

    Times are divided by ``time_scale`` (a rehearsal's emulated seconds per second of the
    plan's hardware), so the trace reads in the same unit as ``hplan simulate --trace``.

    Returns:
        The step written.

    Raises:
        ConfigError: no complete step, or the file cannot be written.
    """
    step, events = read_step_events(metrics_dir, time_scale=time_scale)
    write_chrome_trace(
        path,
        events,
        process_names=plan_process_names(plan),
        other_data={
            "source": "hplan rehearse (measured)",
            "step": step,
            "time_unit": "s of the plan's hardware (emulated s / time_scale)",
            "time_scale": time_scale,
        },
    )
    return step
