"""Draw per-rank timelines (simulated or measured) as SVG or PNG with matplotlib.

One row per rank: compute as bars, all-reduces, transfers and waits as thin strips in lanes
of their own (a bucket's all-reduce overlaps the backward it follows). matplotlib is an
optional extra (``hplan[plot]``), imported only when a picture is drawn; its object API with
the Agg canvas (no pyplot, no display, no global backend switch). SVG output is
deterministic: a fixed ``svg.hashsalt``, no date in the metadata, text drawn as paths.
"""

from __future__ import annotations

import io
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence

from hplan.runtime.contract.errors import ConfigError, EnvironmentProblemError
from hplan.runtime.contract.timeline_file import ALL_REDUCE, COMPUTE, WAIT, TimelineEvent

FORMATS = ("svg", "png")
MISSING_MATPLOTLIB = (
    "the svg/png timeline needs matplotlib, which is not installed; "
    "install it with `pip install 'hplan[plot]'` (or `pip install matplotlib`)"
)
_COLOURS = {
    "F": "#4C78A8",
    "B": "#54A24B",
    "optimizer": "#B279A2",
    ALL_REDUCE: "#F58518",
    "transfer": "#9D9D9D",
    WAIT: "#E45756",
}
_MB = re.compile(r"\.([FB])\.mb(\d+)$")
_LANES = {
    "transfer": (0.06, 0.10),
    ALL_REDUCE: (0.18, 0.10),
    "bar": (0.30, 0.50),
    WAIT: (0.84, 0.08),
}
"""Per lane: (bottom offset within the row, height); a row is 1 unit tall; lanes do not
overlap."""


def plot_timeline(
    events: Sequence[TimelineEvent],
    *,
    process_names: Mapping[int, str] | None = None,
    title: str = "",
    fmt: str = "svg",
) -> bytes:
    """The timeline of ``events`` as an SVG or PNG image.

    Args:
        events: spans in seconds (shown in ms below 1 s).
        process_names: row label per rank (default ``rank <r>``).
        fmt: ``svg`` or ``png``.

    Raises:
        ConfigError: an unknown format, or no events.
        EnvironmentProblemError: matplotlib is not installed.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"unknown image format {fmt!r}; use one of {', '.join(FORMATS)}")
    if not events:
        raise ConfigError("the timeline has no events to draw")
    try:
        import matplotlib
    except ImportError:
        raise EnvironmentProblemError(MISSING_MATPLOTLIB) from None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ranks = sorted({e.rank for e in events} | set(process_names or {}))
    end_s = max(e.end_s for e in events)
    scale, unit = (1e3, "ms") if end_s < 1.0 else (1.0, "s")
    with matplotlib.rc_context({"svg.hashsalt": "hplan", "svg.fonttype": "path"}):
        fig = Figure(figsize=(12, 1.2 + 0.55 * len(ranks)), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        row_of = {rank: idx for idx, rank in enumerate(reversed(ranks))}
        _draw(ax, events, row_of, scale)
        names = process_names or {}
        ax.set_yticks([row_of[r] + 0.55 for r in ranks])
        ax.set_yticklabels([names.get(r, f"rank {r}") for r in ranks], fontsize=8)
        ax.set_ylim(0, len(ranks))
        ax.set_xlim(0, end_s * scale * 1.01)
        ax.set_xlabel(f"time ({unit})")
        ax.grid(axis="x", alpha=0.3)
        if title:
            ax.set_title(title, fontsize=10)
        handles = [Patch(color=c, label=k) for k, c in _COLOURS.items()]
        ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.005, 0.5), fontsize="small")
        fig.tight_layout()
        buffer = io.BytesIO()
        metadata = {"Date": None} if fmt == "svg" else {"Software": None}
        fig.savefig(buffer, format=fmt, metadata=metadata)
    return buffer.getvalue()


def _category(event: TimelineEvent) -> tuple[str, str]:
    """(lane, colour key) of an event."""
    if event.track == COMPUTE:
        match = _MB.search(event.name)
        return "bar", match.group(1) if match else "optimizer"
    if event.track == ALL_REDUCE:
        return ALL_REDUCE, ALL_REDUCE
    if event.track == WAIT:
        return WAIT, WAIT
    return "transfer", "transfer"


def _draw(ax, events: Sequence[TimelineEvent], row_of: Mapping[int, int], scale: float) -> None:  # type: ignore[no-untyped-def]
    groups: dict[tuple[int, str, str], list[tuple[float, float]]] = defaultdict(list)
    for event in events:
        lane, colour = _category(event)
        span = (event.start_s * scale, max(0.0, event.end_s - event.start_s) * scale)
        groups[(event.rank, lane, colour)].append(span)
    for (rank, lane, colour), spans in sorted(groups.items()):
        offset, height = _LANES[lane]
        ax.broken_barh(
            spans,
            (row_of[rank] + offset, height),
            facecolors=_COLOURS[colour],
            edgecolor="white",
            linewidth=0.3,
        )
    width = max(e.end_s for e in events) * scale
    for event in events:
        match = _MB.search(event.name) if event.track == COMPUTE else None
        duration = (event.end_s - event.start_s) * scale
        if match is None or duration < 0.012 * width:
            continue
        ax.text(
            (event.start_s * scale) + duration / 2,
            row_of[event.rank] + 0.55,
            match.group(2),
            ha="center",
            va="center",
            fontsize=6,
            color="white",
        )
