"""Renderers behind ``hplan show``: a plan as text, JSON or graphviz DOT.

Every renderer is a pure, deterministic ``Plan -> str``: the same plan gives the same bytes
on every machine (fixed width, no colour codes, no dependence on the terminal or on
environment variables). :func:`print_text` is the one impure variant; it prints the text
view in colour to a terminal. The DOT view lives in ``render_dot.py``, the formatting
helpers (decimal byte sizes, durations, unit lists, phrase wrapping) in ``textfmt.py``.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Sequence

from rich import box
from rich.console import Console, JustifyMethod, RenderableType
from rich.table import Table
from rich.text import Text

from hplan.planner.emit.render_dot import render_dot
from hplan.planner.solve.previous import PREVIOUS_BACKEND
from hplan.planner.textfmt import (
    batch_share,
    count,
    format_seconds,
    percent,
    stage_units,
    wrap_phrases,
)
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.holders import holder_sets, sync_summary
from hplan.runtime.contract.plan import (
    BaselineReport,
    LossConvention,
    MemoryStrategy,
    Plan,
    Precision,
    RankPlan,
    RankReport,
    Report,
)
from hplan.runtime.contract.quantities import format_bytes

TEXT_WIDTH = 100
"""Columns of the deterministic text view (``summary.txt``, ``hplan show``)."""


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


PIPE_WIDTH = 1000
"""Columns of :func:`table_console` when its output is not a terminal: wider than any table
hplan prints, so none folds its rows or cuts a cell to ``…``."""


def table_console(*, stderr: bool) -> Console:
    """A rich console for wide tables (``hplan calibrate``): on a
    terminal as :func:`wide_console`; in a pipe, a file or a CI log (where rich would assume
    80 columns) ``PIPE_WIDTH`` columns, lines unwrapped, so every table prints whole."""
    if Console(stderr=stderr).is_terminal:
        return wide_console(stderr=stderr)
    return Console(stderr=stderr, highlight=False, width=PIPE_WIDTH, soft_wrap=True)


_PRECISION_WORDS = {
    Precision.FP32: "fp32 (PyTorch defaults: float32 matmuls; convolutions in TF32 where the "
    "GPU has it)",
    Precision.TF32: "tf32 (float32 matmuls and convolutions in TF32)",
    Precision.BF16: "bf16 autocast (fp32 weights and optimizer state)",
    Precision.FP16: "fp16 autocast with a loss scale shared by every rank",
}


_LOSS_WORDS = {
    LossConvention.SAMPLE_MEAN: "a mean over samples: micro-batches weighted by their samples",
    LossConvention.TOKEN_MEAN: (
        "a mean over target tokens (not -100): micro-batches weighted by their tokens "
        "(transformers' num_items_in_batch)"
    ),
}
"""The header's ``loss`` row: what ``loss_fn`` averages over (``LossConvention``)."""


def _precision(plan: Plan) -> str:
    """``bf16 autocast (...)`` when every rank shares it, else per device kind."""
    kinds: dict[Precision, list[str]] = {}
    for rank in plan.ranks:
        kinds.setdefault(rank.precision, [])
        if rank.device_kind not in kinds[rank.precision]:
            kinds[rank.precision].append(rank.device_kind)
    if len(kinds) == 1:
        return _PRECISION_WORDS[next(iter(kinds))]
    return " · ".join(f"{p.value} on {', '.join(k)}" for p, k in kinds.items())


def _header(plan: Plan, width: int) -> list[Text]:
    report = plan.report
    nodes = {r.node for r in plan.ranks}
    title = Text.assemble(
        ("hplan plan", "bold"), f" for {plan.model.path} on cluster {plan.cluster.name}"
    )
    gap = (
        "gap unknown" if report.optimality_gap is None else f"gap {percent(report.optimality_gap)}"
    )
    rows = [
        (
            "layout",
            f"global batch {plan.global_batch_size} · {count(plan.world_size, 'rank')} on "
            f"{count(len(nodes), 'node')} · {count(plan.num_replicas, 'replica')} · "
            f"{plan.training.schedule} · sync {sync_summary(plan)} · "
            f"backend {plan.training.backend}",
        ),
        ("precision", _precision(plan)),
        ("training", training_length_text(plan)),
        ("loss", _LOSS_WORDS[plan.model.loss_convention]),
        ("predicted", _predicted(report)),
        (
            "bound",
            f"{report.physical_bound_samples_per_s:.1f} samples/s (no bubble or sync; at this batch) · "
            f"efficiency {percent(report.efficiency)}",
        ),
        ("solver", f"{_solver_text(report, gap)} · costs from {report.cost_source}"),
    ]
    lines = [title]
    for label, value in rows:
        lines += _labelled(label, value, width)
    for idx, choice in enumerate(report.sync_choices):
        lead = "" if len(report.sync_choices) == 1 else f"ranks {_ranks(choice.ranks)} · "
        lines += _labelled("sync" if idx == 0 else "", lead + choice.reason, width)
    for idx, idle in enumerate(report.idle_devices):
        lines += _labelled(
            "idle" if idx == 0 else "", f"{idle.device} ({idle.kind}): {idle.reason}", width
        )
    for idx, baseline in enumerate(report.baselines):
        value, lead, style = _baseline_line(plan, baseline)
        row = _labelled("baselines" if idx == 0 else "", value, width, _BASELINE_BREAKS)
        row[0].stylize(style, _LABEL_WIDTH, _LABEL_WIDTH + len(lead))
        lines += row
    return lines


def _solver_text(report: Report, gap: str) -> str:
    """``optimal (gap 0.0%) · highs``; for a layout kept from ``--previous``, that it was
    kept (no solver chose it; the notes give both predictions)."""
    if report.solver_backend == PREVIOUS_BACKEND:
        return "kept the --previous plan's layout (predicted no slower than the search's)"
    return f"{report.solver_status} ({gap}) · {report.solver_backend}"


def _ranks(ranks: Sequence[int]) -> str:
    return ",".join(str(r) for r in ranks)


def training_length_text(plan: Plan) -> str:
    """How long a run of ``plan`` trains, in words (launch scripts, ``hplan show``)."""
    training = plan.training
    if training.steps is not None:
        return (
            f"{count(training.steps, 'optimizer step')} (`hplan solve --steps`; --steps N "
            "overrides)"
        )
    if training.epochs is not None:
        return (
            f"{count(training.epochs, 'epoch')} of the model file's dataset() "
            "(`hplan solve --epochs`; --steps N overrides)"
        )
    return "not in the plan: pass --steps N (or re-run `hplan solve` with --steps N)"


def _predicted(report: Report) -> str:
    """The cost model's step time and throughput, and the simulator's step time if any."""
    text = (
        f"{format_seconds(report.predicted_step_time_s)} per step · "
        f"{report.predicted_samples_per_s:.1f} samples/s"
    )
    if report.simulated_step_time_s is None:
        return text
    return f"{text} · simulated {format_seconds(report.simulated_step_time_s)} per step"


_BASELINE_BREAKS = re.compile(r"(?= \([\d.]+ samples/s\))|(?= — )")
"""A baseline line breaks only before its throughput and before its note: its name and its
note may hold commas (``uniform pipeline, equal layers ...``)."""


def _labelled(
    label: str, value: str, width: int, breaks: re.Pattern[str] | None = None
) -> list[Text]:
    """A header row: the label in bold, the value wrapped between phrases and indented."""
    wrapped = (
        wrap_phrases(value, width - _LABEL_WIDTH)
        if breaks is None
        else wrap_phrases(value, width - _LABEL_WIDTH, breaks=breaks)
    )
    first = Text.assemble((label.ljust(_LABEL_WIDTH), "bold"), wrapped[0])
    return [first, *(Text(" " * _LABEL_WIDTH + line) for line in wrapped[1:])]


def _baseline_line(plan: Plan, baseline: BaselineReport) -> tuple[str, str, str]:
    """(the line, its lead to style, the style) for one baseline."""
    name = baseline.name
    if baseline.samples_per_s is None or baseline.samples_per_s <= 0:
        lead = f"{name}: does not fit"
        if baseline.note.startswith("does not fit"):  # the note says it already
            return f"{name}: {baseline.note}", lead, "yellow"
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
    zero = _zero_markers(plan)
    rows = [
        _rank_cells(
            rank, reports.get(rank.rank), rank.rank == bottleneck, plan.units, zero.get(rank.rank)
        )
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
    rank: RankPlan,
    report: RankReport | None,
    marked: bool,
    plan_units: Sequence[object],
    zero: str | None = None,
) -> list[Text]:
    recompute = _strategy_marker(rank)
    recompute += " O" if rank.optimizer_offload else ""
    recompute += f" {zero}" if zero else ""
    cells = [
        f"{rank.rank}{' *' if marked else ''}",
        rank.node,
        rank.device_kind,
        str(rank.replica),
        f"{rank.stage} tp{rank.tp_degree}" if rank.tp_degree > 1 else str(rank.stage),
        stage_units(rank.units, total=len(plan_units)),
        batch_share(rank),
        "-" if report is None else format_seconds(report.busy_time_s),
        ("-" if report is None else _memory_cell(report)) + recompute,
    ]
    return [Text(cell) for cell in cells]


def _strategy_marker(rank: RankPlan) -> str:
    """`` R`` (whole stage recomputed), `` R3/8`` (3 of its 8 units), or nothing."""
    if rank.memory_strategy == MemoryStrategy.RECOMPUTE:
        return " R"
    if rank.memory_strategy == MemoryStrategy.SELECTIVE:
        return f" R{len(rank.recompute_units)}/{len(rank.units)}"
    return ""


def _zero_markers(plan: Plan) -> dict[int, str]:
    """Rank -> ``Z1``/``Z2`` (its ZeRO stage) for every rank that shares a trainable
    parameter with another rank under ZeRO, ``Z2 s0.25`` when its shard weight is not that
    of the set's largest member (its share of the set's largest weight); others absent."""
    stage = int(plan.training.zero_stage)
    if stage == 0:
        return {}
    out: dict[int, str] = {}
    for ranks in holder_sets(plan):
        top = max(plan.ranks[r].optimizer_shard_weight for r in ranks)
        for r in ranks:
            weight = plan.ranks[r].optimizer_shard_weight
            share = "" if top <= 0 or weight == top else f" s{weight / top:.2f}"
            out.setdefault(r, f"Z{stage}{share}")
    return out


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
        "memory: predicted peak / usable capacity (memory less the framework reserve, 90% of "
        "the rest)",
    ]
    if any(r.memory_strategy == MemoryStrategy.RECOMPUTE for r in plan.ranks):
        parts.append("R: recomputes activations")
    if any(r.memory_strategy == MemoryStrategy.SELECTIVE for r in plan.ranks):
        parts.append("Rk/n: recomputes k of its n units (selective)")
    if any(r.optimizer_offload for r in plan.ranks):
        parts.append("O: optimizer state and step offloaded to host memory")
    if plan.tensor_parallel:
        parts.append(
            "tpN: the stage runs on a tensor-parallel group of N ranks, each holding 1/N of "
            "the modules of the model's TP plan (memory and busy time per rank)"
        )
    if _zero_markers(plan):
        what = "optimizer state" if int(plan.training.zero_stage) == 1 else "optimizer state "
        what += "" if int(plan.training.zero_stage) == 1 else "and summed gradients"
        parts.append(
            f"Z{int(plan.training.zero_stage)}: ZeRO stage {int(plan.training.zero_stage)}, "
            f"{what} sharded among the ranks holding the same parameters; s0.25: a shard "
            "weight a quarter of the set's largest"
        )
    return "\n".join(parts)


# --------------------------------------------------------------------------- JSON view
def render_json(plan: Plan) -> str:
    """The plan as ``plan.json`` text (``Plan.to_json``: deterministic, newline at end)."""
    return plan.to_json()


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
