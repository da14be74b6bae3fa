"""The solver's tensor-parallel degree per stage: cluster.yaml's NVLink, the TP groups'
costs, when ``--tensor-parallel auto`` chooses them, and the plans they emit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hplan.planner.api import SolveRequest
from hplan.planner.cli.main import main
from hplan.planner.cost.problem import PlanningProblem, Policy
from hplan.planner.cost.problem_builder import build_problem
from hplan.planner.cost.tensor_parallel import grouped_problem, pass_counts, tp_groups
from hplan.planner.emit.render import render_text
from hplan.planner.emit.render_dot import render_dot
from hplan.planner.emit.report import tp_notes
from hplan.planner.frontend.cost_graph import ModelGraph
from hplan.planner.hardware.cluster import Cluster, to_cluster_spec
from hplan.planner.sim.spec import RuntimeBytes, spec_from_layout
from hplan.planner.solve.baselines import data_parallel_equal
from hplan.planner.solve.solver import SolveOptions, SolveResult, solve
from hplan.planner.solve.strategy import TP_PCIE_GATE, generate
from hplan.runtime.contract.errors import ConfigError, InfeasiblePlanError
from hplan.runtime.contract.link_model import ring_all_reduce_time_s
from hplan.runtime.contract.plan import Plan, TpRule, TpStyle
from hplan.runtime.contract.quantities import gb_per_s_to_bytes_per_s
from tests.fixtures.clusters import (
    cluster_from_dict,
    language_model_graph,
    solved_tp_plan,
    tp_language_model_graph,
)

FAST = {"time_limit_s": 10.0, "watchdog": False}


def _one_node(kind: str, count: int, **node: object) -> Cluster:
    return cluster_from_dict(
        {
            "name": f"{count}x{kind}",
            "nodes": [
                {"name": "box", "host": "box", "devices": [{"type": kind, "count": count}], **node}
            ],
        }
    )


def _wide_head_graph() -> ModelGraph:
    """Embedding and head of 800,000 x 2,048 (1.6B parameters each): neither fits a 12 GB
    card alone, not even with its optimizer state offloaded."""
    return tp_language_model_graph(vocab_size=800_000, width=2048, seq_len=128, num_blocks=4)


def _solve(problem: PlanningProblem, policy: str) -> SolveResult:
    return solve(problem, SolveOptions(tensor_parallel=policy, **FAST))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- cluster.yaml
def test_sxm_parts_are_joined_by_nvlink_and_the_plan_links_show_it() -> None:
    cluster = _one_node("a100-80gb", 4)
    assert cluster.nvlink("box/0", "box/3")
    assert cluster.bandwidth_bytes_per_s("box/0", "box/3") == gb_per_s_to_bytes_per_s(300)
    spec = to_cluster_spec(cluster, "float32")
    assert {link.bandwidth_bytes_per_s for link in spec.links} == {gb_per_s_to_bytes_per_s(300)}
    assert not _one_node("a100-80gb", 2, nvlink="none").nvlink("box/0", "box/1")


def test_bridged_pairs_join_only_their_pairs() -> None:
    cluster = _one_node("rtx3090", 4, nvlink=[[0, 1], [2, 3]])
    assert cluster.nvlink("box/0", "box/1") and cluster.nvlink("box/2", "box/3")
    assert not cluster.nvlink("box/1", "box/2")
    assert cluster.bandwidth_bytes_per_s("box/1", "box/2") == gb_per_s_to_bytes_per_s(31.5)
    assert cluster.bandwidth_bytes_per_s("box/0", "box/1") == gb_per_s_to_bytes_per_s(56.25)
    assert not _one_node("rtx4090", 2).nvlink("box/0", "box/1")


@pytest.mark.parametrize(
    ("node", "message"),
    [
        ({"nvlink": [[0, 4]]}, r"nodes\[0\]\.nvlink\[0\]: device index 4 is not on node 'box'"),
        ({"nvlink": [[1, 1]]}, r"device indices \[1, 1\] repeat"),
        ({"nvlink": [[0]]}, r"nodes\[0\]\.nvlink: \[\[0\]\] is not an nvlink value: write `all`"),
        (
            {"nvlink": [0, 1]},
            r"nodes\[0\]\.nvlink: \[0, 1\] is not an nvlink value.*\[\[0, 1\], \[2, 3\]\]$",
        ),
        ({"nvlink": "some"}, r"nodes\[0\]\.nvlink: 'some' is not an nvlink value"),
        ({"nvlink_gb_per_s": 50}, r"nodes\[0\]\.nvlink_gb_per_s: .*no NVLink-joined cards"),
        ({"nvlink": "none", "nvlink_gb_per_s": 50}, r"would be ignored; add nvlink: all"),
    ],
)
def test_bad_nvlink_is_one_config_error(node: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _one_node("rtx3090", 4, **node)


def test_nvlink_on_a_part_without_it_needs_a_bandwidth() -> None:
    with pytest.raises(ConfigError, match=r"box/0 \(rtx4090\) has no NVLink.*nvlink_gb_per_s"):
        _one_node("rtx4090", 2, nvlink="all")
    cluster = _one_node("rtx4090", 2, nvlink="all", nvlink_gb_per_s=50)
    assert cluster.bandwidth_bytes_per_s("box/0", "box/1") == gb_per_s_to_bytes_per_s(50)


# --------------------------------------------------------------------------- costs
def test_a_tp_group_costs_split_part_over_degree_plus_rest_and_its_all_reduces() -> None:
    graph = tp_language_model_graph(num_blocks=2)
    problem = build_problem(graph, _one_node("a100-80gb", 4), global_batch_size=8)
    tp = problem.tensor_parallel
    assert tp is not None
    groups = tp_groups(problem, 2, nvlink_only=True)
    assert groups == ((0, 1), (2, 3))
    grouped = grouped_problem(problem, groups)
    assert grouped.tp_degree == 2 and grouped.tp_members == (("box/0", "box/1"), ("box/2", "box/3"))
    u, k = 1, 2  # a block, micro-batch size 4
    b = problem.micro_batch_sizes[k]
    static = problem.static_memory_bytes[u] - tp.split_static_bytes[u] / 2
    assert grouped.static_bytes_on(0)[u] == pytest.approx(static)
    act = problem.activation_bytes_per_sample[u] - tp.split_activation_bytes_per_sample[u] / 2
    assert grouped.activation_bytes_on(0)[u] == pytest.approx(act)
    assert tp.split_activation_bytes_per_sample[u] == pytest.approx(12 * 128 * 64 * 4)
    nvlink, latency = gb_per_s_to_bytes_per_s(300), problem.latency_s[0, 1]
    # two all-reduces of t h forward (Megatron's pair): one ring of their bytes, and the
    # latency steps, 2 (d - 1) each, of both
    fwd_bytes = 2 * 128 * 64 * 4 * b
    collectives = ring_all_reduce_time_s(2, fwd_bytes, nvlink, 0.0) + 2 * 2 * latency
    share = tp.split_time_share[u]
    assert share == pytest.approx(1.0)
    expected = problem.fwd_time_s[0, u, k] * (1 - share / 2) + collectives
    assert grouped.fwd_time_s[0, u, k] == pytest.approx(expected)
    assert grouped.grad_bytes_on(0)[u] == pytest.approx(problem.grad_bytes[u] / 2)
    assert grouped.offload_saving_bytes is None  # no offload with TP
    assert pass_counts(4, 1.0) == (2, 2) and pass_counts(1, 1.0) == (1, 0)  # a block, embed
    assert pass_counts(1, 0.0) == (0, 1)


# --------------------------------------------------------------------------- the choice
def test_a_head_no_card_holds_is_planned_with_tp_over_pcie_on_eight_geforce_cards() -> None:
    problem = build_problem(_wide_head_graph(), _one_node("rtx3060", 8), global_batch_size=8)
    assert problem.static_memory_bytes[0] > problem.memory_capacity_bytes[0]
    with pytest.raises(InfeasiblePlanError):
        _solve(problem, "never")
    result = _solve(problem, "auto")
    assert result.tp_problem is not None and result.tp_over_pcie
    notes = tp_notes(problem, result)
    assert sum("over PCIe on GeForce" in n and "nothing else fits" in n for n in notes) == 1


def test_nvlink_a100_node_gets_tp_under_auto_where_it_pays() -> None:
    graph = tp_language_model_graph(vocab_size=32000, width=8192, seq_len=512, num_blocks=8)
    problem = build_problem(graph, _one_node("a100-80gb", 4), global_batch_size=8)
    without = _solve(problem, "never")
    result = _solve(problem, "auto")
    assert result.tp_problem is not None and not result.tp_over_pcie
    assert result.evaluation.step_time_s < without.evaluation.step_time_s
    assert "TP family" in result.notes[-1]


def test_two_4090s_over_pcie_where_data_parallel_fits_get_no_tp() -> None:
    graph = tp_language_model_graph(vocab_size=32000, width=768, seq_len=512, num_blocks=6)
    problem = build_problem(graph, _one_node("rtx4090", 2), global_batch_size=16)
    options = SolveOptions(**FAST)  # type: ignore[arg-type]
    result = solve(problem, options)
    assert result.tp_problem is None
    generated = generate(problem, options, deadline_s=float("inf"))
    skipped = {run.family: run.skipped for run in generated.runs if run.family == "tp2-pcie"}
    assert skipped == {"tp2-pcie": TP_PCIE_GATE}
    forced = _solve(problem, "always")
    assert forced.tp_problem is not None and forced.tp_problem.tp_degree == 2
    notes = " ".join(tp_notes(problem, forced, forced=True))
    assert "as --tensor-parallel always asks" in notes and "nothing else fits" not in notes


def test_always_without_a_tp_plan_is_one_config_error() -> None:
    problem = build_problem(language_model_graph(), _one_node("rtx4090", 2), global_batch_size=8)
    with pytest.raises(ConfigError, match="--tensor-parallel always: the model offers no"):
        _solve(problem, "always")


# --------------------------------------------------------------------------- the plan
def test_a_tp_plan_verifies_round_trips_and_shows_its_groups() -> None:
    graph = _wide_head_graph()
    cluster = _one_node("rtx3060", 8)
    problem = build_problem(graph, cluster, global_batch_size=8)
    result = _solve(problem, "auto")
    solved = result.solved_problem(problem)
    plan = solved_tp_plan(graph, cluster, problem, result, 8)
    degree = solved.tp_degree
    assert plan.tensor_parallel and plan.model.tp_plan == graph.tp_plan
    assert [r.tp_rank for r in plan.ranks[:degree]] == list(range(degree))
    assert len(plan.ranks) == degree * len(set(result.layout.device_indices))
    # every rank holds 1/d of the head: the plan's own memory check sees it fit
    head = plan.memory.units[-1] if plan.memory else None
    assert head is not None and head.tp_split_activation_bytes_per_sample > 0
    capacity = float(problem.memory_capacity_bytes[0])
    assert all(0 < r.memory_bytes <= capacity for r in plan.report.ranks)
    assert len(plan.report.ranks) == len(plan.ranks)
    assert f"0 tp{degree}" in render_text(plan)
    assert f"TP group of {degree}" in render_dot(plan)


def test_tp_policy_reaches_every_option_set() -> None:
    assert SolveOptions(tensor_parallel="never").tensor_parallel is Policy.NEVER  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tensor_parallel"):
        SolveOptions(tensor_parallel="sometimes")  # type: ignore[arg-type]
    assert np.all(
        ~build_problem(
            tp_language_model_graph(), _one_node("rtx4090", 2), global_batch_size=4
        ).tensor_parallel.nvlink
    )  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "other",
    [{"zero": "always"}, {"offload": "always"}, {"sync": "local_sgd"}, {"strategy": "ddp"}],
)
def test_always_with_what_tp_does_not_combine_with_is_refused(other: dict[str, str]) -> None:
    request = SolveRequest(
        model_path=Path("model.py"),
        cluster_path=Path("cluster.yaml"),
        tensor_parallel="always",  # type: ignore[arg-type]
        **other,  # type: ignore[arg-type]
    )
    with pytest.raises(ConfigError, match="--tensor-parallel always cannot be combined"):
        request.verify()


# --------------------------------------------------------------------------- hplan solve
MLP = Path(__file__).resolve().parents[2] / "examples" / "mlp" / "model.py"
GPT = MLP.parents[1] / "gpt" / "model.py"

BRIDGED_3090S = """\
name: bridged
nodes:
  - name: a
    host: 127.0.0.1
    devices: [{type: rtx3090, count: 2}]
    nvlink: [[0, 1]]
"""


def test_hplan_solve_always_writes_a_tp_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The GPT example's own TP_PLAN, read by the capture, planned end to end; the MLP
    example, which has none, is one line."""
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(BRIDGED_3090S, encoding="utf-8")
    out = tmp_path / "out"
    argv = ["solve", "-c", str(cluster), "-o", str(out), "-b", "8"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, str(GPT), "--tensor-parallel", "always", "--time-limit", "10"])
    _, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    plan = Plan.load(out / "plan.json")
    summary = (out / "summary.txt").read_text(encoding="utf-8")
    assert [(r.tp_degree, r.tp_rank) for r in plan.ranks] == [(2, 0), (2, 1)]
    assert plan.model.tp_plan and plan.model.tp_plan[0].pattern == "tok_emb"
    assert "0 tp2" in summary and "TP group of 2" in (out / "plan.dot").read_text()
    assert "tensor parallel: stages on TP groups of 2 cards (a/0+a/1)" in summary
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, str(MLP), "--tensor-parallel", "always", "--time-limit", "10"])
    _, err = capsys.readouterr()
    assert exit_info.value.code == 2
    assert "--tensor-parallel always: tensor parallelism is not offered" in err
    assert len(err.strip().splitlines()) == 1


def test_replicas_of_tp_groups_sum_their_share_of_each_split_gradient() -> None:
    graph = tp_language_model_graph(num_blocks=2)
    problem = build_problem(graph, _one_node("a100-80gb", 4), global_batch_size=8)
    grouped = grouped_problem(problem, tp_groups(problem, 2, nvlink_only=True))
    layout = data_parallel_equal(grouped)
    assert layout is not None and len(layout.replicas) == 2
    runtime = RuntimeBytes.of(graph)
    spec = spec_from_layout(grouped, layout, runtime=runtime)
    summed = sum(g.num_bytes for g in spec.sync_groups)
    assert summed == pytest.approx(sum(runtime.wire_bytes.values()) / 2, rel=1e-6)


def test_always_without_a_group_to_form_is_one_config_error() -> None:
    cluster = cluster_from_dict(
        {"name": "one-each", "nodes": [{"name": "box", "host": "box", "devices": [
            {"type": "rtx4090"}, {"type": "rtx3090"}]}]}
    )  # fmt: skip
    problem = build_problem(tp_language_model_graph(), cluster, global_batch_size=8)
    with pytest.raises(ConfigError, match="always: no node has 2 or more cards of one kind"):
        _solve(problem, "always")


def test_tp_rules_name_the_parameters_they_split() -> None:
    col = TpRule(pattern="layers.*.q_proj", style=TpStyle.COLWISE)
    row = TpRule(pattern="layers.*.o_proj", style=TpStyle.ROWWISE)
    assert col.splits("layers.3.q_proj.weight") and col.splits("layers.3.q_proj.bias")
    assert row.splits("layers.0.o_proj.weight") and not row.splits("layers.0.o_proj.bias")
    assert not col.splits("layers.3.k_proj.weight") and not col.splits("layers.q_proj.weight")
    assert not col.splits("model.layers.3.q_proj.weight")


def test_a_group_of_unlike_cards_runs_at_its_slowest_and_holds_what_its_smallest_holds() -> None:
    """Cards of one kind may be declared unlike (the CPU rehearsal cluster's node ``slow``
    has a cpu of 1 GiB beside one of the catalog's): the group steps at its slowest member's
    pace and must fit its smallest memory."""
    cluster = cluster_from_dict(
        {
            "name": "unlike",
            "nodes": [
                {
                    "name": "a",
                    "host": "127.0.0.1",
                    "devices": [
                        {"type": "cpu", "peak_tflops": 0.2},
                        {"type": "cpu", "memory_gib": 1},
                    ],
                }
            ],
        }
    )
    problem = build_problem(tp_language_model_graph(num_blocks=2), cluster, global_batch_size=4)
    grouped = grouped_problem(problem, ((0, 1),))
    assert grouped.memory_capacity_bytes[0] == problem.memory_capacity_bytes[1]
    assert problem.fwd_time_s[1, 1, 0] > problem.fwd_time_s[0, 1, 0]
    assert grouped.fwd_time_s[0, 1, 0] > problem.fwd_time_s[0, 1, 0] * 0.5  # not the fast one's


def test_three_nvlink_cards_and_a_tied_head_get_a_tp2_pair_not_a_mixed_pipeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The GPT example ties its head to its embedding: the tp2 family's search builds no
    pipeline that puts them at two degrees (the validator and the runtime refuse it), so its
    tp2 pair alone wins over data parallelism on all three cards, and the third card's idle
    line says why."""
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(
        "name: a100x3\nnodes:\n  - name: dgx\n    host: 127.0.0.1\n"
        "    devices: [{type: a100-80gb, count: 3}]\n",
        encoding="utf-8",
    )
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["solve", str(GPT), "-c", str(cluster), "-o", str(out), "--time-limit", "10"])
    _, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    plan = Plan.load(out / "plan.json")
    assert [r.tp_degree for r in plan.ranks] == [2, 2]
    summary = " ".join((out / "summary.txt").read_text(encoding="utf-8").split())
    assert "it would hold them at tp1 beside the plan's tp2 stages" in summary


def test_a_broken_tp_plan_is_named_in_the_summary_under_auto(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A TP_PLAN with a style that does not exist plans without TP under the default
    ``auto`` and says why in the summary; a model without any plan gets no such line."""
    model = tmp_path / "model.py"
    text = MLP.read_text(encoding="utf-8")
    model.write_text(text + '\nTP_PLAN = {"blocks.*.fc": "columnwise"}\n', encoding="utf-8")
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(BRIDGED_3090S, encoding="utf-8")
    summaries = []
    for path, out in ((model, tmp_path / "broken"), (MLP, tmp_path / "none")):
        with pytest.raises(SystemExit) as exit_info:
            main(["solve", str(path), "-c", str(cluster), "-o", str(out), "--time-limit", "10"])
        _, err = capsys.readouterr()
        assert exit_info.value.code == 0, err
        summaries.append(" ".join((out / "summary.txt").read_text(encoding="utf-8").split()))
    assert "tensor parallel: not offered:" in summaries[0] and "columnwise" in summaries[0]
    assert "tensor parallel" not in summaries[1]
