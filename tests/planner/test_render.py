"""The ``hplan show`` renderers: text, JSON and DOT views of hand-built sample plans.

Golden files live in ``tests/golden/<plan>/``; ``HPLAN_UPDATE_GOLDEN=1 pytest
tests/planner`` rewrites them (review ``git diff tests/golden`` before committing).
"""

from __future__ import annotations

import io
import re
import warnings
from dataclasses import replace

import pydot
import pytest
from rich.console import Console

from hplan.planner.emit.render import (
    RENDERERS,
    print_text,
    render,
    render_dot,
    render_json,
    render_text,
)
from hplan.planner.textfmt import (
    batch_share,
    boundary_bytes,
    compact_units,
    format_seconds,
    wrap_phrases,
)
from hplan.runtime.contract.errors import ConfigError, PlanFileError
from hplan.runtime.contract.plan import MemoryStrategy, Plan, TensorSpec, ZeroStage
from hplan.runtime.contract.quantities import format_bytes
from tests.fixtures.sample_plans import (
    SAMPLE_PLANS,
    check_golden,
    cpu_plan,
    datacentre_plan,
    mixed_plan,
    with_suffixed_names,
)

PLAN_NAMES = sorted(SAMPLE_PLANS)
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


# --------------------------------------------------------------------------- golden files
@pytest.mark.parametrize("name", PLAN_NAMES)
def test_text_view_matches_golden_file(name: str) -> None:
    check_golden(f"{name}/summary.txt", render_text(SAMPLE_PLANS[name]()))


@pytest.mark.parametrize("name", PLAN_NAMES)
def test_dot_view_matches_golden_file(name: str) -> None:
    check_golden(f"{name}/plan.dot", render_dot(SAMPLE_PLANS[name]()))


@pytest.mark.parametrize("name", PLAN_NAMES)
def test_json_view_matches_golden_file(name: str) -> None:
    check_golden(f"{name}/plan.json", render_json(SAMPLE_PLANS[name]()))


# --------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("name", PLAN_NAMES)
@pytest.mark.parametrize("fmt", sorted(RENDERERS))
def test_renderers_give_the_same_bytes_twice_and_after_a_json_round_trip(
    name: str, fmt: str
) -> None:
    plan = SAMPLE_PLANS[name]()
    first = render(plan, fmt)
    assert render(SAMPLE_PLANS[name](), fmt) == first
    assert render(Plan.from_json(plan.to_json()), fmt) == first


@pytest.mark.parametrize("name", PLAN_NAMES)
def test_plan_json_round_trips_exactly(name: str) -> None:
    plan = SAMPLE_PLANS[name]()
    text = plan.to_json()
    again = Plan.from_json(text)
    assert again == plan
    assert again.to_json() == text


def test_text_view_ignores_terminal_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = mixed_plan()
    plain = render_text(plan)
    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("TERM", "xterm-256color")
    assert render_text(plan) == plain
    assert "\x1b" not in plain
    assert max(len(line) for line in plain.splitlines()) <= 100


# --------------------------------------------------------------------------- text content
def test_text_header_states_prediction_bound_solver_and_baselines() -> None:
    text = render_text(mixed_plan())
    assert "examples/gpt/model.py" in text
    assert "global batch 40" in text
    assert "0.652 s per step · 61.3 samples/s" in text
    assert "96.4 samples/s" in text and "efficiency 63.6%" in text
    assert "optimal (gap 0.0%)" in text
    assert "costs from roofline (device catalog)" in text
    assert "2.47× vs data-parallel-equal" in text  # 61.35 / 24.8
    assert "data-parallel-no-recompute: does not fit" in text


def test_text_says_gap_unknown_when_solver_gives_none() -> None:
    assert "heuristic (gap unknown)" in render_text(cpu_plan())


def test_text_table_marks_only_the_bottleneck_rank() -> None:
    lines = render_text(mixed_plan()).splitlines()
    marked = [line for line in lines if re.match(r"^\s*\d+ \*", line)]
    assert len(marked) == 1
    assert marked[0].split()[:4] == ["4", "*", "box-b", "rtx3060"]
    assert "10.6/11.9 GB 89% R" in marked[0]
    assert any(line.startswith("* bottleneck: rank 4 (rtx3060 on box-b") for line in lines)


def test_text_table_marks_a_selective_rank_with_its_recomputed_share_of_units() -> None:
    plan = mixed_plan()
    ranks = list(plan.ranks)
    ranks[3] = replace(
        ranks[3], memory_strategy=MemoryStrategy.SELECTIVE, recompute_units=("blocks.6", "blocks.8")
    )
    lines = render_text(replace(plan, ranks=tuple(ranks))).splitlines()
    row = next(line for line in lines if line.lstrip().startswith("3 "))
    assert row.rstrip().endswith(" R2/5")
    assert "Rk/n: recomputes k of its n units (selective)" in lines


def test_text_table_marks_zero_ranks_with_their_stage_and_a_smaller_shard() -> None:
    plan = datacentre_plan()
    weights = (0.5, 1.0)
    plan = replace(
        plan,
        ranks=tuple(
            replace(r, optimizer_shard_weight=w) for r, w in zip(plan.ranks, weights, strict=True)
        ),
        training=replace(plan.training, zero_stage=ZeroStage.GRADIENTS),
    )
    lines = render_text(plan).splitlines()
    rows = [line.rstrip() for line in lines if line.lstrip()[:1] in ("0", "1")]
    assert rows[0].endswith(" Z2 s0.50") and rows[1].endswith(" Z2"), rows
    assert any(line.startswith("Z2: ZeRO stage 2") for line in lines)
    plain = render_text(datacentre_plan())
    assert " Z" not in plain


def test_text_table_rows_show_units_compactly_and_batch_shares() -> None:
    text = render_text(cpu_plan())
    row = next(line for line in text.splitlines() if line.lstrip().startswith("1 "))
    assert "blocks.1-blocks.2" in row
    assert "8 (3×2+2)" in row
    assert "10.8 MB/14.7 GB" in row


def test_text_prints_plan_strings_literally_not_as_rich_markup() -> None:
    plan = with_suffixed_names(cpu_plan(), "[bold]x[/bold]")
    text = render_text(plan)
    assert "localhost[bold]x[/bold]" in text


def test_text_lists_notes_with_hanging_indent() -> None:
    text = render_text(mixed_plan())
    notes = text.split("\nnotes\n", 1)[1].splitlines()
    assert notes[0].startswith("- replicas sync by local SGD")
    assert notes[1].startswith("  ") and not notes[1].startswith("  -")


def test_colour_variant_prints_the_same_text_with_styles() -> None:
    plan = mixed_plan()
    buffer = io.StringIO()
    console = Console(
        file=buffer, width=100, force_terminal=True, color_system="truecolor", force_jupyter=False
    )
    print_text(plan, console)
    coloured = buffer.getvalue()
    assert "\x1b[" in coloured
    stripped = [_ANSI_ESCAPE.sub("", line).rstrip() for line in coloured.splitlines()]
    assert stripped == render_text(plan).splitlines()


def test_unknown_format_is_a_config_error_naming_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"'yaml'.*text, json, dot"):
        render(mixed_plan(), "yaml")


def test_json_view_is_plan_json() -> None:
    plan = datacentre_plan()
    assert render_json(plan) == plan.to_json()


# --------------------------------------------------------------------------- helpers
@pytest.mark.parametrize(
    ("units", "expected"),
    [
        (("tok_emb", "blocks.0", "blocks.1", "blocks.2", "lm_head"), "tok_emb, blocks.0-blocks.2, lm_head"),
        (("blocks.3",), "blocks.3"),
        (("blocks.1", "blocks.3", "blocks.4"), "blocks.1, blocks.3-blocks.4"),
        (("enc.9", "enc.10", "dec.11", "dec.12"), "enc.9-enc.10, dec.11-dec.12"),
        (("layer1", "layer2"), "layer1, layer2"),
        ((), ""),
    ],
)  # fmt: skip
def test_compact_units_collapses_only_consecutive_numbered_siblings(
    units: tuple[str, ...], expected: str
) -> None:
    assert compact_units(units) == expected


def test_batch_share_shows_micro_batches_and_the_remainder() -> None:
    ranks = mixed_plan().ranks
    assert batch_share(ranks[0]) == "24 (4×6)"
    assert batch_share(ranks[2]) == "16 (3×5+1)"
    two = replace(ranks[2], num_samples=1389, micro_batch_size=695, num_microbatches=2)
    assert batch_share(two) == "1389 (695+694)"


@pytest.mark.parametrize(
    ("num_bytes", "expected"),
    [(512, "512 B"), (1_500, "1.5 kB"), (1_500_000, "1.5 MB"), (12_582_912, "12.6 MB"),
     (25_769_803_776, "25.8 GB"), (2.5e12, "2500.0 GB")],
)  # fmt: skip
def test_format_bytes_uses_decimal_units(num_bytes: float, expected: str) -> None:
    assert format_bytes(num_bytes) == expected


def test_format_seconds_switches_to_milliseconds_below_100_ms() -> None:
    assert format_seconds(0.652) == "0.652 s"
    assert format_seconds(0.0512) == "51.2 ms"
    assert format_seconds(12.345) == "12.35 s"


def test_boundary_bytes_counts_every_tensor_of_the_cut_at_micro_batch_size() -> None:
    cut = cpu_plan().cuts[0]
    # per sample: hidden 64*64 float32 = 16384, mask 64*64 bool = 4096, ids 64 int64 = 512
    assert boundary_bytes(cut, 3) == 3 * (16_384 + 4_096 + 512)


def test_boundary_bytes_rejects_an_unknown_dtype_by_name() -> None:
    cut = cpu_plan().cuts[0]
    odd = TensorSpec(name="odd", shape=(1,), dtype="float4", batch_dim=0, requires_grad=False)
    with pytest.raises(PlanFileError, match=r"'odd'.*'float4'"):
        boundary_bytes(replace(cut, tensors=(odd,)), 1)


# --------------------------------------------------------------------------- DOT content
def _parse_dot(text: str) -> pydot.Dot:
    with warnings.catch_warnings():  # pydot's parser uses deprecated pyparsing names
        warnings.simplefilter("ignore", DeprecationWarning)
        graphs = pydot.graph_from_dot_data(text)
    assert graphs, "DOT output does not parse"
    return graphs[0]


def test_dot_has_a_cluster_per_node_and_a_graph_node_per_rank() -> None:
    plan = mixed_plan()
    synchronous = replace(plan, training=replace(plan.training, sync=None))
    clusters = _parse_dot(render_dot(synchronous)).get_subgraphs()
    assert [c.get("label") for c in clusters] == ['"box-a (10.0.0.1)"', '"box-b (10.0.0.2)"']
    assert [len(c.get_nodes()) for c in clusters] == [2, 3]


def test_dot_puts_each_node_cluster_inside_its_island() -> None:
    islands = _parse_dot(render_dot(mixed_plan())).get_subgraphs()
    assert [c.get("label") for c in islands] == ['"island box-a"', '"island box-b"']
    assert all(c.get("style") == "dashed" for c in islands)
    nodes = [[n.get("label") for n in c.get_subgraphs()] for c in islands]
    assert nodes == [['"box-a (10.0.0.1)"'], ['"box-b (10.0.0.2)"']]
    assert [len(c.get_subgraphs()[0].get_nodes()) for c in islands] == [2, 3]


def test_dot_pipeline_edges_carry_bytes_per_micro_batch() -> None:
    graph = _parse_dot(render_dot(mixed_plan()))
    solid = {
        (e.get_source(), e.get_destination()): e.get("label")
        for e in graph.get_edges()
        if e.get("style") != "dashed"
    }
    # 1024 x 768 float32 per sample: 4 samples = 12.6 MB, 3 samples = 9.4 MB
    assert solid == {
        ("rank0", "rank1"): '"12.6 MB / micro-batch"',
        ("rank2", "rank3"): '"9.4 MB / micro-batch"',
        ("rank3", "rank4"): '"9.4 MB / micro-batch"',
    }


def test_dot_dashed_edges_join_ranks_of_replicas_that_share_units() -> None:
    graph = _parse_dot(render_dot(mixed_plan()))
    dashed = {
        (e.get_source(), e.get_destination()): e.get("label")
        for e in graph.get_edges()
        if e.get("style") == "dashed"
    }
    assert dashed == {
        ("rank0", "rank2"): '"tok_emb, blocks.0-blocks.4"',
        ("rank0", "rank3"): '"blocks.5-blocks.6"',
        ("rank1", "rank3"): '"blocks.7-blocks.9"',
        ("rank1", "rank4"): '"blocks.10-blocks.11, lm_head"',
    }


def test_dot_single_replica_plan_has_no_data_parallel_edges() -> None:
    graph = _parse_dot(render_dot(cpu_plan()))
    styles = [e.get("style") for e in graph.get_edges()]
    assert styles == [None, None]


def test_dot_escapes_quotes_and_backslashes_in_plan_strings() -> None:
    payload = '"; $(rm -rf /) \\'
    graph = _parse_dot(render_dot(with_suffixed_names(cpu_plan(), payload)))
    label = graph.get_subgraphs()[0].get("label")
    assert label == '"localhost\\"; $(rm -rf /) \\\\ (127.0.0.1\\"; $(rm -rf /) \\\\)"'


def test_views_tolerate_a_placeholder_report_without_rank_predictions() -> None:
    plan = cpu_plan()
    empty = replace(
        plan.report,
        ranks=(),
        predicted_step_time_s=0.0,
        predicted_samples_per_s=0.0,
        physical_bound_samples_per_s=0.0,
        efficiency=0.0,
        bottleneck_rank=7,
    )
    plan = replace(plan, report=empty)
    text = render_text(plan)
    row = next(line for line in text.splitlines() if line.lstrip().startswith("0 "))
    assert row.split()[-2:] == ["-", "-"]
    assert "bottleneck rank 7 is not in the plan" in text
    assert "rank0 -> rank1" in render_dot(plan)


# --------------------------------------------------------------------------- wrapping
def test_long_lines_break_between_phrases_not_inside_them() -> None:
    text = "2.36× vs ddp (115442.4 samples/s) — 5 replicas x 1 stages, 5 devices"
    assert wrap_phrases(text, 40) == [
        "2.36× vs ddp (115442.4 samples/s)",
        "— 5 replicas x 1 stages, 5 devices",
    ]
    assert wrap_phrases("a · b · c", 5) == ["a ·", "b · c"]
    assert wrap_phrases("one phrase that is too long for the line", 12) == [
        "one phrase",
        "that is too",
        "long for the",
        "line",
    ]
    assert wrap_phrases("short", 40) == ["short"]


def test_header_keeps_every_baseline_phrase_on_one_line() -> None:
    plan = mixed_plan()
    first = plan.report.baselines[0]
    note = "5 replicas x 1 stages, 5 devices"
    baselines = (
        replace(first, name="data parallel, equal batches (DDP) on every device", note=note),
        replace(
            first,
            name="uniform pipeline, equal layers and batches (Megatron/DeepSpeed)",
            samples_per_s=12632.3,
            note="2 replicas x 2 stages, 4 devices",
        ),
    )
    plan = replace(plan, report=replace(plan.report, baselines=baselines))
    lines = render_text(plan).splitlines()
    assert f"           — {note}" in lines
    assert "           uniform pipeline, equal layers and batches (Megatron/DeepSpeed)" not in lines
    assert any(
        line.endswith("vs uniform pipeline, equal layers and batches (Megatron/DeepSpeed)")
        for line in lines
    )
    assert "           (12632.3 samples/s) — 2 replicas x 2 stages, 4 devices" in lines
    assert max(len(line) for line in lines[:10]) <= 100


def test_a_huge_batch_widens_the_table_instead_of_breaking_values() -> None:
    plan = mixed_plan()
    ranks = tuple(
        replace(r, num_samples=2369152, micro_batch_size=8192, num_microbatches=290)
        for r in plan.ranks
    )
    plan = replace(plan, ranks=ranks)
    text = render_text(plan)
    for rank in plan.ranks:
        row = next(
            line
            for line in text.splitlines()
            if re.match(rf"^\s*{rank.rank}( \*)?\s+{rank.node}\s", line)
        )
        assert "2369152 (8192×289+1664)" in row
        assert re.search(r"\d+%( R)?$", row), row  # the memory cell is whole
    for group in ("tok_emb,", "blocks.0-blocks.6", "blocks.10-blocks.11,", "lm_head"):
        assert group in text.split()  # unit groups are never broken inside


def test_idle_devices_get_one_row_each_with_their_reason():
    from hplan.runtime.contract.plan import IdleDeviceReport

    plan = mixed_plan()
    idle = (
        IdleDeviceReport(device="box-c/0", kind="rtx3060", reason="the model's smallest stage "
                         "needs 14.2 GB, the card has 11.0 GB usable"),
        IdleDeviceReport(device="box-c/1", kind="rtx3060", reason="as one more replica, ..."),
    )  # fmt: skip
    with_idle = replace(plan, report=replace(plan.report, idle_devices=idle))
    text = render_text(with_idle)
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("idle "))
    assert lines[first] == (
        "idle       box-c/0 (rtx3060): the model's smallest stage needs 14.2 GB, the card has "
        "11.0 GB usable"
    )
    assert lines[first + 1] == "           box-c/1 (rtx3060): as one more replica, ..."
    assert Plan.from_json(with_idle.to_json()) == with_idle
