"""Renderers behind ``hplan show``: a plan as text, JSON or graphviz DOT.

Every renderer is a pure, deterministic ``Plan -> str``: the same plan gives the same bytes
on every machine (fixed width, no colour codes, no dependence on the terminal or on
environment variables). :func:`print_text` is the one impure variant; it prints the text
view in colour to a terminal.

Byte sizes in human text are decimal (``1 MB`` = 10^6 bytes, ``1 GB`` = 10^9 bytes), as the
style guide asks.
"""

from __future__ import annotations

import io
import itertools
import re
import textwrap
from collections.abc import Callable, Sequence

import pydot
from rich import box
from rich.console import Console, JustifyMethod, RenderableType
from rich.table import Table
from rich.text import Text

from hplan.planner.quantities import BYTES_PER_GB, BYTES_PER_KB, BYTES_PER_MB, MS_PER_S
from hplan.runtime.errors import ConfigError
from hplan.runtime.plan import (
    BaselineReport,
    CutSpec,
    MemoryStrategy,
    Plan,
    RankPlan,
    RankReport,
    microbatch_sizes,
)

TEXT_WIDTH = 100
"""Columns of the deterministic text view (``summary.txt``, ``hplan show``)."""

_DECIMAL_UNITS = ((BYTES_PER_GB, "GB"), (BYTES_PER_MB, "MB"), (BYTES_PER_KB, "kB"))
_NUMBERED = re.compile(r"^(?P<prefix>.*)\.(?P<idx>\d+)$")


# --------------------------------------------------------------------------- formatting
def format_bytes(num_bytes: float) -> str:
    """Human byte count in decimal units: ``1_500_000 -> "1.5 MB"``, ``512 -> "512 B"``."""
    for scale_bytes, unit in _DECIMAL_UNITS:
        if abs(num_bytes) >= scale_bytes:
            return f"{num_bytes / scale_bytes:.1f} {unit}"
    return f"{num_bytes:.0f} B"


def format_seconds(time_s: float) -> str:
    """Human duration: ``0.5203 -> "0.520 s"``, ``0.0123 -> "12.3 ms"``."""
    if abs(time_s) >= 1.0:
        return f"{time_s:.2f} s"
    if abs(time_s) >= 0.1:
        return f"{time_s:.3f} s"
    return f"{time_s * MS_PER_S:.1f} ms"


def compact_units(units: Sequence[str]) -> str:
    """Units with runs of numbered siblings collapsed.

    Example: ``("tok_emb", "blocks.0", "blocks.1", "blocks.2", "lm_head")`` ->
    ``"tok_emb, blocks.0-blocks.2, lm_head"``. See :func:`compact_unit_groups`.
    """
    return ", ".join(compact_unit_groups(units))


def stage_units(units: Sequence[str], *, total: int) -> str:
    """A stage's contiguous units in a few characters.

    ``all 8 units`` when the stage holds the whole model; one name, or a numbered run
    (``blocks.0-blocks.3``); otherwise ``first…last (n)``.
    """
    if len(units) == total and total > 1:
        return f"all {total} units"
    groups = compact_unit_groups(units)
    if len(groups) <= 2:
        return ", ".join(groups)
    return f"{units[0]}…{units[-1]} ({len(units)})"


def compact_unit_groups(units: Sequence[str]) -> list[str]:
    """Units as groups: a run of consecutive numbered siblings becomes ``first-last``.

    Only consecutive indices under the same prefix form a run (``blocks.0``, ``blocks.1``);
    a run of one stays a single name.
    """
    groups: list[list[str]] = []
    for name in units:
        if groups and _continues_run(groups[-1][-1], name):
            groups[-1].append(name)
        else:
            groups.append([name])
    return [g[0] if len(g) == 1 else f"{g[0]}-{g[-1]}" for g in groups]


def _continues_run(previous: str, name: str) -> bool:
    prev_match, match = _NUMBERED.match(previous), _NUMBERED.match(name)
    if prev_match is None or match is None:
        return False
    same_prefix = prev_match["prefix"] == match["prefix"]
    return same_prefix and int(match["idx"]) == int(prev_match["idx"]) + 1


def batch_share(rank: RankPlan) -> str:
    """A replica's batch share as samples and micro-batches.

    ``24 (4×6)``: 24 samples in 6 micro-batches of 4. ``16 (3×5+1)``: 16 samples in 5
    micro-batches of 3 and one of 1 (see :func:`hplan.runtime.plan.microbatch_sizes`).
    """
    sizes = microbatch_sizes(rank.num_samples, rank.micro_batch_size)
    full = sum(1 for s in sizes if s == rank.micro_batch_size)
    rest = "" if len(sizes) == full else f"+{sizes[-1]}"
    return f"{rank.num_samples} ({rank.micro_batch_size}×{full}{rest})"


def boundary_bytes(cut: CutSpec, micro_batch_size: int) -> int:
    """Bytes sent forward across ``cut`` for one micro-batch of ``micro_batch_size`` samples.

    Sums every tensor of the cut (activations, masks, position ids), each at its concrete
    shape ``TensorSpec.shape_for(micro_batch_size)``.

    Raises:
        PlanFileError: a tensor has a dtype that ``plan.DTYPE_BYTES`` does not know.
    """
    return sum(tensor.num_bytes(micro_batch_size) for tensor in cut.tensors)


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def _percent(fraction: float) -> str:
    return f"{100.0 * fraction:.1f}%"


# --------------------------------------------------------------------------- wrapping
_PHRASE_BREAKS = re.compile(r"(?<=; )|(?<=: )|(?<=, )|(?<= · )|(?= — )")
"""Where a long line may break: after ``; ``, ``: ``, ``, `` and `` · ``, before `` — ``."""


def wrap_phrases(text: str, width: int) -> list[str]:
    """Lines of at most ``width`` columns, broken between phrases rather than inside one.

    Phrases end at ``; ``, ``: ``, ``, `` or `` · ``, or before `` — ``; lines are filled
    greedily. A phrase longer than ``width`` is broken at spaces instead (a word longer
    than ``width`` stays whole). ``"a · b"`` with width 3 -> ``["a ·", "b"]``.
    """
    lines: list[str] = []
    current = ""
    for phrase in _PHRASE_BREAKS.split(text):
        candidate = current + phrase
        if not current or len(candidate.rstrip()) <= width or len(phrase.strip()) > width:
            current = candidate
            continue
        wrapped = _wrap_words(current, width)
        lines.extend(wrapped[:-1])
        last = wrapped[-1] + current[len(current.rstrip()) :]
        if len((last + phrase).rstrip()) <= width:
            current = last + phrase
        else:
            lines.append(wrapped[-1])
            current = phrase.lstrip()
    lines.extend(_wrap_words(current, width))
    return lines


def _wrap_words(text: str, width: int) -> list[str]:
    text = text.rstrip()
    if len(text) <= width:
        return [text]
    return textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)


# --------------------------------------------------------------------------- text view
_LABEL_WIDTH = 11
"""Columns of the header's label (``baselines`` and two spaces)."""


def plan_renderables(plan: Plan, *, width: int = TEXT_WIDTH) -> list[RenderableType]:
    """The text view as rich renderables (header, rank table, legend, notes), with styles.

    Every part but the table is a list of lines already wrapped to ``width`` at phrase
    boundaries (print them with ``soft_wrap=True``). :func:`render_text` prints them
    without colour; :func:`print_text` with colour.
    """
    parts: list[RenderableType] = [*_header(plan, width), Text(""), _rank_table(plan)]
    parts += [Text(line) for line in _table_legend(plan).splitlines()]
    if plan.report.notes:
        parts += [Text(""), Text("notes", style="bold")]
        for note in plan.report.notes:
            lines = wrap_phrases(note, width - 2)
            parts += [Text(f"- {lines[0]}"), *(Text(f"  {line}") for line in lines[1:])]
    return parts


def render_text(plan: Plan, *, width: int = TEXT_WIDTH) -> str:
    """What ``hplan show`` prints: the plan as plain text, ``width`` columns, no colour.

    Lines break between phrases; the rank table is as wide as ``width`` or, when its
    columns cannot fit without breaking a value, as wide as they need. Deterministic: the
    console is configured explicitly (no terminal, colour or Jupyter detection, no
    ``COLUMNS``), so the same plan gives the same bytes everywhere.
    """
    buffer = io.StringIO()
    console = Console(
        file=buffer,
        width=width,
        color_system=None,
        force_terminal=False,
        force_jupyter=False,
        force_interactive=False,
        legacy_windows=False,
        highlight=False,
        markup=False,
        emoji=False,
        soft_wrap=False,
    )
    _print_parts(console, plan_renderables(plan, width=width))
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()) + "\n"


def print_text(plan: Plan, console: Console | None = None) -> None:
    """Print the text view with colour to ``console`` (default: a rich console on stderr)."""
    target = console if console is not None else wide_console(stderr=True)
    _print_parts(target, plan_renderables(plan))


def _print_parts(console: Console, parts: Sequence[RenderableType]) -> None:
    for part in parts:
        if isinstance(part, Table):  # wider than the console rather than break a value
            width = console.width
            console.width = max(width, part.min_width or 0)
            try:
                console.print(part)
            finally:
                console.width = width
        else:
            console.print(part, soft_wrap=True)


def wide_console(*, stderr: bool) -> Console:
    """A rich console at least ``TEXT_WIDTH`` columns wide, so the rank table never folds."""
    detected = Console(stderr=stderr).width
    return Console(stderr=stderr, highlight=False, width=max(detected, TEXT_WIDTH))


def _header(plan: Plan, width: int) -> list[Text]:
    report = plan.report
    nodes = {r.node for r in plan.ranks}
    title = Text.assemble(
        ("hplan plan", "bold"), f" for {plan.model.path} on cluster {plan.cluster.name}"
    )
    gap = (
        "gap unknown" if report.optimality_gap is None else f"gap {_percent(report.optimality_gap)}"
    )
    rows = [
        (
            "layout",
            f"global batch {plan.global_batch_size} · {_count(plan.world_size, 'rank')} on "
            f"{_count(len(nodes), 'node')} · {_count(plan.num_replicas, 'replica')} · "
            f"{plan.training.schedule} · sync {plan.training.sync_mode} · "
            f"backend {plan.training.backend}",
        ),
        (
            "predicted",
            f"{format_seconds(report.predicted_step_time_s)} per step · "
            f"{report.predicted_samples_per_s:.1f} samples/s",
        ),
        (
            "bound",
            f"{report.physical_bound_samples_per_s:.1f} samples/s (sum of standalone devices) · "
            f"efficiency {_percent(report.efficiency)}",
        ),
        (
            "solver",
            f"{report.solver_status} ({gap}) · {report.solver_backend} · "
            f"costs from {report.cost_source}",
        ),
    ]
    lines = [title]
    for label, value in rows:
        lines += _labelled(label, value, width)
    for idx, baseline in enumerate(report.baselines):
        value, lead, style = _baseline_line(plan, baseline)
        row = _labelled("baselines" if idx == 0 else "", value, width)
        row[0].stylize(style, _LABEL_WIDTH, _LABEL_WIDTH + len(lead))
        lines += row
    return lines


def _labelled(label: str, value: str, width: int) -> list[Text]:
    """A header row: the label in bold, the value wrapped between phrases and indented."""
    wrapped = wrap_phrases(value, width - _LABEL_WIDTH)
    first = Text.assemble((label.ljust(_LABEL_WIDTH), "bold"), wrapped[0])
    return [first, *(Text(" " * _LABEL_WIDTH + line) for line in wrapped[1:])]


def _baseline_line(plan: Plan, baseline: BaselineReport) -> tuple[str, str, str]:
    """(the line, its lead to style, the style) for one baseline."""
    name = baseline.name
    if baseline.samples_per_s is None or baseline.samples_per_s <= 0:
        lead = f"{name}: does not fit"
        return f"{lead} — {baseline.note}", lead, "yellow"
    ratio = plan.report.predicted_samples_per_s / baseline.samples_per_s
    lead = f"{ratio:.2f}×"
    line = f"{lead} vs {name} ({baseline.samples_per_s:.1f} samples/s) — {baseline.note}"
    return line, lead, "bold green" if ratio >= 1.0 else "bold red"


def _rank_table(plan: Plan) -> Table:
    """The rank table. Only ``units`` wraps, and only between unit groups (``a, b``): its
    minimum width is its longest group, so no name or ``all 8 units`` is ever broken."""
    reports = {r.rank: r for r in plan.report.ranks}
    bottleneck = plan.report.bottleneck_rank
    rows = [
        _rank_cells(rank, reports.get(rank.rank), rank.rank == bottleneck, plan.units)
        for rank in plan.ranks
    ]
    headers = [Text(header) for header, _ in _COLUMNS]
    units_idx = [h.plain for h in headers].index("units")
    groups = [g for row in rows for g in row[units_idx].plain.replace(", ", ",\n").splitlines()]
    longest_group = max((len(g) for g in groups), default=1)
    widths = [
        longest_group if idx == units_idx else max(len(r[idx].plain) for r in [headers, *rows])
        for idx in range(len(_COLUMNS))
    ]
    table = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        show_edge=False,
        collapse_padding=True,
        min_width=sum(widths) + 2 * (len(widths) - 1),  # every value whole, padding 1 | 1
    )
    for idx, (header, justify) in enumerate(_COLUMNS):
        wraps = idx == units_idx
        table.add_column(
            header,
            justify=justify,
            no_wrap=not wraps,
            overflow="fold" if wraps else "ellipsis",
            min_width=longest_group if wraps else None,
        )
    for rank, cells in zip(plan.ranks, rows, strict=True):
        table.add_row(*cells, style="bold red" if rank.rank == bottleneck else None)
    return table


_COLUMNS: tuple[tuple[str, JustifyMethod], ...] = (
    ("rank", "right"),
    ("node", "left"),
    ("device", "left"),
    ("replica", "right"),
    ("stage", "right"),
    ("units", "left"),
    ("samples", "right"),
    ("busy", "right"),
    ("memory", "right"),
)


def _rank_cells(
    rank: RankPlan, report: RankReport | None, marked: bool, plan_units: Sequence[object]
) -> list[Text]:
    recompute = " R" if rank.memory_strategy == MemoryStrategy.RECOMPUTE else ""
    cells = [
        f"{rank.rank}{' *' if marked else ''}",
        rank.node,
        rank.device_kind,
        str(rank.replica),
        str(rank.stage),
        stage_units(rank.units, total=len(plan_units)),
        batch_share(rank),
        "-" if report is None else format_seconds(report.busy_time_s),
        ("-" if report is None else _memory_cell(report)) + recompute,
    ]
    return [Text(cell) for cell in cells]


def _memory_cell(report: RankReport) -> str:
    """``14.2/23.7 GB 60%``; both units spelled out when they differ (``12.1 MB/14.7 GB``)."""
    used, capacity = format_bytes(report.memory_bytes), format_bytes(report.memory_capacity_bytes)
    used_value, used_unit = used.split(" ")
    if capacity.endswith(f" {used_unit}"):
        used = used_value
    if report.memory_capacity_bytes <= 0:
        return f"{used}/{capacity}"
    share = 100.0 * report.memory_bytes / report.memory_capacity_bytes
    return f"{used}/{capacity} {share:.0f}%"


def _table_legend(plan: Plan) -> str:
    bottleneck = plan.report.bottleneck_rank
    rank = next((r for r in plan.ranks if r.rank == bottleneck), None)
    parts = [
        f"bottleneck rank {bottleneck} is not in the plan"
        if rank is None
        else f"* bottleneck: rank {rank.rank} ({rank.device_kind} on {rank.node}, "
        f"replica {rank.replica} stage {rank.stage})",
        "samples: per optimizer step (micro-batch size × number of micro-batches)",
        "memory: predicted peak / capacity",
    ]
    if any(r.memory_strategy == MemoryStrategy.RECOMPUTE for r in plan.ranks):
        parts.append("R: recomputes activations")
    return "\n".join(parts)


# --------------------------------------------------------------------------- JSON view
def render_json(plan: Plan) -> str:
    """The plan as ``plan.json`` text (``Plan.to_json``: deterministic, newline at end)."""
    return plan.to_json()


# --------------------------------------------------------------------------- DOT view
def render_dot(plan: Plan) -> str:
    """The plan as graphviz DOT text, built with pydot.

    One cluster per node, one graph node per rank (device kind, replica and stage, units,
    batch share), solid pipeline edges labelled with the bytes one micro-batch sends across
    that boundary, dashed undirected edges between ranks of consecutive replicas that hold
    the same units (their gradients are synchronised), and a graph label with the summary.
    """
    graph = pydot.Dot("plan", graph_type="digraph")
    graph.set_graph_defaults(rankdir="LR", labelloc="t", fontname="Helvetica")
    graph.set_node_defaults(shape="box", fontname="Helvetica")
    graph.set_edge_defaults(fontname="Helvetica", fontsize="10")
    graph.set("label", _dot_text(_dot_title(plan)))
    for node_idx, node in enumerate(plan.cluster.nodes):
        label = _dot_text(f"{node.name} ({node.host})")
        cluster = pydot.Subgraph(f"cluster_node{node_idx}", label=label)
        for rank in plan.ranks:
            if rank.node == node.name:
                cluster.add_node(_dot_rank(rank, rank.rank == plan.report.bottleneck_rank))
        graph.add_subgraph(cluster)
    for edge in _pipeline_edges(plan) + _data_parallel_edges(plan):
        graph.add_edge(edge)
    return graph.to_string()


def _dot_text(text: str) -> str:
    """A plan string made safe for a DOT label: backslashes doubled (pydot escapes quotes)."""
    return text.replace("\\", "\\\\")


def _dot_title(plan: Plan) -> str:
    report = plan.report
    return "\n".join(
        (
            f"{plan.model.path} on {plan.cluster.name}: global batch {plan.global_batch_size}",
            f"{format_seconds(report.predicted_step_time_s)} per step, "
            f"{report.predicted_samples_per_s:.1f} samples/s, "
            f"efficiency {_percent(report.efficiency)}",
            _dot_data_parallel_note(plan),
        )
    )


def _dot_data_parallel_note(plan: Plan) -> str:
    if plan.num_replicas == 1:
        return "1 replica (no data parallelism)"
    return (
        f"{plan.num_replicas} replicas, data parallel by {plan.training.sync_mode} "
        "(dashed: ranks that synchronise the units named)"
    )


def _dot_rank(rank: RankPlan, bottleneck: bool) -> pydot.Node:
    lines = (
        f"rank {rank.rank}: {rank.device_kind}" + (" (bottleneck)" if bottleneck else ""),
        f"replica {rank.replica}, stage {rank.stage}",
        compact_units(rank.units),
        f"{batch_share(rank)} samples",
    )
    node = pydot.Node(f"rank{rank.rank}", label=_dot_text("\n".join(lines)))
    if bottleneck:
        node.set("penwidth", "2")
        node.set("color", "red")
    return node


def _pipeline_edges(plan: Plan) -> list[pydot.Edge]:
    edges = []
    for replica in range(plan.num_replicas):
        stages = plan.replica_ranks(replica)
        for sender, receiver in itertools.pairwise(stages):
            cut = plan.cut_after(sender.units[-1])
            size = format_bytes(boundary_bytes(cut, sender.micro_batch_size))
            label = f"{size} / micro-batch"
            edges.append(pydot.Edge(f"rank{sender.rank}", f"rank{receiver.rank}", label=label))
    return edges


def _data_parallel_edges(plan: Plan) -> list[pydot.Edge]:
    edges = []
    for replica in range(plan.num_replicas - 1):
        for left in plan.replica_ranks(replica):
            for right in plan.replica_ranks(replica + 1):
                shared = [u for u in left.units if u in set(right.units)]
                if not shared:
                    continue
                edges.append(
                    pydot.Edge(
                        f"rank{left.rank}",
                        f"rank{right.rank}",
                        label=_dot_text(compact_units(shared)),
                        style="dashed",
                        dir="none",
                        constraint="false",
                        color="gray40",
                    )
                )
    return edges


# --------------------------------------------------------------------------- dispatch
RENDERERS: dict[str, Callable[[Plan], str]] = {
    "text": render_text,
    "json": render_json,
    "dot": render_dot,
}
"""``hplan show --format`` choices and their renderers."""


def render(plan: Plan, fmt: str) -> str:
    """Render ``plan`` in format ``fmt`` (one of :data:`RENDERERS`).

    Raises:
        ConfigError: ``fmt`` is not a known format.
    """
    renderer = RENDERERS.get(fmt)
    if renderer is None:
        raise ConfigError(f"unknown format {fmt!r}; use one of {', '.join(RENDERERS)}")
    return renderer(plan)
