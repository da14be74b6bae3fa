"""bench/tensor_parallel.py's pure parts: the Megatron-style uniform (tp, pp, dp) plans
on a small problem, the plan's layout lines and the small case's check (the benchmark
itself solves 13B and 70B models; `make test` does not run it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import megatron_uniform  # noqa: E402
import tensor_parallel  # noqa: E402

from hplan.planner.cost.evaluate import evaluate  # noqa: E402
from hplan.planner.cost.problem_builder import build_problem  # noqa: E402
from hplan.planner.solve.baselines import data_parallel_equal  # noqa: E402
from tests.fixtures.clusters import cluster_from_dict, tp_language_model_graph  # noqa: E402

POOL = {
    "name": "pool",
    "nodes": [
        {"name": "a", "host": "a", "devices": [{"type": "a100-80gb", "count": 4}]},
        {"name": "b", "host": "b", "devices": [{"type": "rtx4090", "count": 2}]},
    ],
    "links": {"inter_node": {"bandwidth_gbit_per_s": 25}},
}


def _problem(width: int, batch: int = 16):
    graph = tp_language_model_graph(vocab_size=32000, width=width, seq_len=128, num_blocks=4)
    return build_problem(graph, cluster_from_dict(POOL), global_batch_size=batch)


def test_megatron_puts_stage_s_of_replica_r_on_group_s_times_dp_plus_r() -> None:
    groups = [(0,), (1,), (2,), (3,)]
    assert megatron_uniform.megatron_order(groups, 2) == [(0,), (2,), (1,), (3,)]
    assert megatron_uniform.megatron_order(groups, 1) == groups


def test_uniform_plans_cover_every_shape_and_match_the_ddp_baseline() -> None:
    problem = _problem(width=256)
    plans = megatron_uniform.uniform_plans(problem)
    shapes = {(p.tp, p.pp, p.dp) for p in plans}
    assert {(1, 1, 6), (2, 1, 3), (4, 1, 1), (1, 2, 3)} <= shapes
    assert all(p.tp * p.pp * p.dp == len(p.cards) for p in plans)
    rates = [p.samples_per_s for p in plans]
    assert rates == sorted(rates, reverse=True)
    tp4 = next(p for p in plans if p.tp == 4)
    assert set(tp4.kinds) == {"a100-80gb"}  # TP groups stay on one node and one kind
    ddp = next(p for p in plans if (p.tp, p.pp, p.dp) == (1, 1, 6))
    layout = data_parallel_equal(problem)
    assert layout is not None
    assert ddp.samples_per_s == pytest.approx(evaluate(problem, layout).samples_per_s)
    assert ddp.label().startswith("tp1 pp1 dp6 on 4x a100-80gb, 2x rtx4090")


def test_a_model_no_4090_holds_is_planned_on_the_a100s_or_split() -> None:
    problem = _problem(width=5120, batch=8)  # its Adam state alone fills a 4090
    assert problem.static_memory_bytes.sum() > problem.memory_capacity_bytes[-1]
    plans = megatron_uniform.uniform_plans(problem)
    assert plans
    assert all(p.tp * p.pp > 1 or "rtx4090" not in p.kinds for p in plans)


RANKS = [
    {"replica": 0, "stage": 0, "device_kind": "rtx3090", "tp_degree": 1},
    {"replica": 0, "stage": 1, "device_kind": "a100-80gb", "tp_degree": 2},
    {"replica": 0, "stage": 1, "device_kind": "a100-80gb", "tp_degree": 2},
    {"replica": 1, "stage": 0, "device_kind": "rtx4090", "tp_degree": 1},
]


def test_layout_lines_count_a_tp_group_once() -> None:
    assert tensor_parallel.pipeline_lines(RANKS) == ("3090 > 2xa100 tp2", "4090")
    solved = tensor_parallel.Solved(
        "m", "auto", pipelines=("3090 > 2xa100 tp2", "4090"), stage_degrees=(1, 2, 1)
    )
    assert tensor_parallel.layout_text(solved) == "2 replicas: 3090 > 2xa100 tp2 | 4090"
    assert tensor_parallel.degrees_text(solved) == "tp2 x1, tp1 x2"
    assert not tensor_parallel.no_tp_chosen(solved)
    assert tensor_parallel.no_tp_chosen(tensor_parallel.Solved("m", "auto", stage_degrees=(1, 1)))
    failed = tensor_parallel.Solved("m", "auto", error="needs 9 GB: no fit; add memory")
    assert not tensor_parallel.no_tp_chosen(failed)
    assert tensor_parallel.layout_text(failed, short=True) == "needs 9 GB: no fit"


def test_unknown_cases_and_models_are_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        tensor_parallel.parse_args(["--cases", "wide,huge"])
    assert "valid: wide, lab, small" in capsys.readouterr().err
    args = tensor_parallel.parse_args(["--lab-models", "13b"])
    assert args.lab_models == [tensor_parallel.LLAMA_13B]
