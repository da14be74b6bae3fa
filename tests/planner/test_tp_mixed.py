"""Mixed-degree TP families: an NVLink node's TP group beside single cards in one pipeline
(planner/cost/tensor_parallel.py, PlanningProblem.tp_degrees and its per-card accessors)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hplan.planner.cost.evaluate import (
    evaluate,
    grad_sync_groups,
    step_sync_groups,
    unsummed_flat_copy_bytes,
)
from hplan.planner.cost.layout import Layout, StageLayout, replica_layout
from hplan.planner.cost.problem import PlanningProblem, TiedParams
from hplan.planner.cost.problem_builder import build_problem
from hplan.planner.cost.tensor_parallel import grouped_problem, tp_groups
from hplan.planner.frontend.cost_graph import ModelGraph
from hplan.planner.hardware.cluster import Cluster
from hplan.planner.sim.spec import RuntimeBytes, spec_from_layout
from hplan.planner.solve import strategy
from hplan.planner.solve.device_groups import device_groups
from hplan.planner.solve.partition import enumerate_shapes
from hplan.planner.solve.search import degree_buckets
from hplan.planner.solve.solver import SolveOptions, solve
from hplan.planner.solve.strategy import with_single_cards
from hplan.planner.solve.validate import layout_problems
from hplan.runtime.contract.plan import Precision
from tests.fixtures.clusters import cluster_from_dict, solved_tp_plan, tp_language_model_graph

LAB_POOL = {
    "name": "lab-pool",
    "nodes": [
        {"name": "a100", "host": "10.0.0.1", "devices": [{"type": "a100-80gb", "count": 4}]},
        {"name": "g4090", "host": "10.0.0.2", "devices": [{"type": "rtx4090", "count": 2}]},
        {"name": "g3090", "host": "10.0.0.3", "devices": [{"type": "rtx3090", "count": 2}]},
    ],
    "links": {"inter_node": {"bandwidth_gbit_per_s": 25, "latency_us": 20}},
}
"""One 4x A100 SXM node (NVLink) beside a 4090 box and a 3090 box, 25 Gb/s between."""


def _lab_problem(graph: ModelGraph, batch: int) -> tuple[Cluster, PlanningProblem]:
    cluster = cluster_from_dict(LAB_POOL)
    bf16 = {d.name: Precision.BF16 for d in cluster.devices}
    return cluster, build_problem(graph, cluster, global_batch_size=batch, precisions=bf16)


def _mixed(problem: PlanningProblem, degree: int) -> PlanningProblem:
    """The lab pool's tp-``degree`` family's problem: the A100 groups and every other card."""
    groups = tp_groups(problem, degree, nvlink_only=True)
    return grouped_problem(problem, with_single_cards(problem, groups))


def test_a_model_too_big_for_the_a100_node_gets_a_tp4_stage_beside_tp1_stages() -> None:
    # 15 blocks of width 8192: 310 GB of parameters, gradients and Adam state, more than
    # the four A100s hold, so the 4090s and 3090s must hold some units
    graph = tp_language_model_graph(vocab_size=32000, width=8192, seq_len=512, num_blocks=15)
    cluster, problem = _lab_problem(graph, batch=2)
    assert problem.static_memory_bytes.sum() > problem.memory_capacity_bytes[:4].sum()
    result = solve(problem, SolveOptions(time_limit_s=10.0, tensor_parallel="auto", watchdog=False))
    solved = result.solved_problem(problem)
    assert result.source.startswith("tp4:")
    [replica] = result.layout.replicas
    degrees = [solved.degree(s.device_idx) for s in replica.stages]
    assert sorted(degrees) == [1] * (len(degrees) - 1) + [4]
    assert not layout_problems(solved, result.layout)
    plan = solved_tp_plan(graph, cluster, problem, result, 2)
    by_stage: dict[int, list[int]] = {}
    for rank in plan.ranks:
        by_stage.setdefault(rank.stage, []).append(rank.rank)
        assert rank.tp_degree == degrees[rank.stage]
    for stage, ranks in by_stage.items():
        assert ranks == list(range(ranks[0], ranks[0] + degrees[stage]))  # consecutive
        assert [plan.ranks[r].tp_rank for r in ranks] == list(range(degrees[stage]))
    assert {plan.ranks[r].device for r in by_stage[degrees.index(4)]} == {
        f"a100/{i}" for i in range(4)
    }


def test_memory_per_card_of_a_mixed_layout_by_hand() -> None:
    graph = tp_language_model_graph(num_blocks=2, width=256)
    _, problem = _lab_problem(graph, batch=4)
    tp = problem.tensor_parallel
    assert tp is not None
    mixed = _mixed(problem, 4)
    assert mixed.tp_degrees == (4, 1, 1, 1, 1)
    assert mixed.tp_members[0] == ("a100/0", "a100/1", "a100/2", "a100/3")
    # the A100 group holds the embedding and a block, a 4090 the rest, 2 samples each
    layout = Layout(
        (replica_layout((StageLayout(0, 0, 2), StageLayout(1, 2, 4)), 2, 4),),
    )
    ev = evaluate(mixed, layout)
    first, second = ev.stages[0]

    def by_hand(units: range, degree: int, in_flight: int, cut_before: int | None) -> float:
        shrink = 1.0 - 1.0 / degree
        static = sum(
            problem.static_memory_bytes[u] - tp.split_static_bytes[u] * shrink for u in units
        )
        acts = sum(
            problem.activation_bytes_per_sample[u]
            - tp.split_activation_bytes_per_sample[u] * shrink
            for u in units
        )
        cuts = [c for c in (cut_before, units[-1]) if c is not None and c < problem.num_units - 1]
        buffers = sum(2 * problem.cut_bytes(c, 2) for c in cuts)
        return float(static + acts * 2 * in_flight + buffers)

    # 1F1B with 2 micro-batches: the first stage holds both, the last one
    assert first.memory_bytes == pytest.approx(by_hand(range(0, 2), 4, 2, None))
    # the 4090 sums only the tied parameters' gradients every step: only they keep a flat
    # copy (a TP group's cards keep every unit's, counted conservatively)
    unsummed = unsummed_flat_copy_bytes(mixed, layout)
    summed = sum(b for group, b in step_sync_groups(mixed, layout).items() if 1 in group)
    assert 0 not in unsummed
    assert unsummed[1] == pytest.approx(float(mixed.grad_bytes[2:4].sum()) - summed)
    assert second.memory_bytes == pytest.approx(by_hand(range(2, 4), 1, 1, 1) - unsummed[1])
    assert (
        mixed.static_bytes_on(0)[1] < mixed.static_bytes_on(1)[1] == problem.static_memory_bytes[1]
    )


def test_holders_of_a_unit_at_two_degrees_are_refused() -> None:
    graph = tp_language_model_graph(num_blocks=2, width=256)
    _, problem = _lab_problem(graph, batch=4)
    mixed = _mixed(problem, 4)
    whole = problem.num_units
    layout = Layout(
        (
            replica_layout((StageLayout(0, 0, whole),), 2, 2),
            replica_layout((StageLayout(1, 0, whole),), 2, 2),
        )
    )
    problems = layout_problems(mixed, layout)
    assert any(
        "held at more than one TP degree (tp1 on g4090/0, tp4 on a100/0)" in p for p in problems
    )


def test_a_parameter_tied_across_two_degrees_is_refused() -> None:
    """An embedding tied to its head, the embedding on the tp4 A100 stage and the head on
    a 4090 at tp1: the runtime refuses such a plan, so the validator does."""
    graph = tp_language_model_graph(num_blocks=2, width=256)
    _, problem = _lab_problem(graph, batch=4)
    last = problem.num_units - 1
    mixed = dataclasses.replace(_mixed(problem, 4), tied_params=(TiedParams((0, last), 1.0),))
    layout = Layout(
        (replica_layout((StageLayout(0, 0, last), StageLayout(1, last, last + 1)), 2, 2),)
    )
    assert any(
        "share parameters held at more than one TP degree" in p
        for p in layout_problems(mixed, layout)
    )


def test_search_buckets_keep_each_units_degree() -> None:
    graph = tp_language_model_graph(num_blocks=4, width=256)
    _, problem = _lab_problem(graph, batch=8)
    mixed = _mixed(problem, 2)
    classes = device_groups(mixed)
    shapes = enumerate_shapes(
        mixed, classes, max_stages=3, exhaustive_limit=10**6, budget_deadline=float("inf")
    ).shapes
    assert len(degree_buckets(mixed, classes, shapes)) > 1
    for bucket in degree_buckets(mixed, classes, shapes):
        signatures = {
            tuple(
                mixed.degree(classes[c].rep)
                for s, c in enumerate(t.classes)
                for _ in range(t.bounds[s], t.bounds[s + 1])
            )
            for t in bucket
        }
        assert len(signatures) == 1 and max(next(iter(signatures))) > 1


def test_replicas_of_tp2_groups_sync_half_of_each_split_gradient() -> None:
    graph = tp_language_model_graph(num_blocks=2, width=256)
    _, problem = _lab_problem(graph, batch=4)
    tp = problem.tensor_parallel
    assert tp is not None
    mixed = _mixed(problem, 2)  # devices: a100 0+1, a100 2+3, 4090s, 3090s
    assert mixed.tp_degrees == (2, 2, 1, 1, 1, 1)
    layout = Layout(
        (
            replica_layout((StageLayout(0, 0, 2), StageLayout(2, 2, 4)), 2, 2),
            replica_layout((StageLayout(1, 0, 2), StageLayout(3, 2, 4)), 2, 2),
        )
    )
    assert not layout_problems(mixed, layout)
    groups = grad_sync_groups(mixed, layout)
    half = sum(problem.grad_bytes[u] - tp.split_grad_bytes[u] / 2 for u in (0, 1))
    assert groups[(0, 1)] == pytest.approx(half)
    assert groups[(2, 3)] == pytest.approx(float(problem.grad_bytes[2:4].sum()))
    # the simulator's buckets too: the tp2 ranks sum half of each split parameter
    runtime = RuntimeBytes.of(graph)
    spec = spec_from_layout(mixed, layout, runtime=runtime)
    wire = [runtime.wire_bytes[f"{graph.units[u].name}.proj.weight"] for u in range(4)]
    summed = sorted(g.num_bytes for g in spec.sync_groups)
    assert summed == pytest.approx(sorted([(wire[0] + wire[1]) / 2, wire[2] + wire[3]]), rel=1e-6)


def test_a_problem_without_tp_reads_its_own_arrays() -> None:
    graph = tp_language_model_graph(num_blocks=2, width=256)
    _, problem = _lab_problem(graph, batch=4)
    assert problem.tp_degrees == () and problem.distinct_degrees == (1,)
    assert problem.static_bytes_on(3) is problem.static_memory_bytes
    assert problem.activation_bytes_on(3) is problem.activation_bytes_per_sample
    assert problem.grad_bytes_on(3) is problem.grad_bytes
    assert problem.optimizer_state_on(3) is problem.optimizer_state_bytes
    mixed = _mixed(problem, 4)
    assert np.array_equal(mixed.static_bytes_on(1), problem.static_memory_bytes)


def test_geforce_tp_over_pcie_waits_for_the_nvlink_families(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The request's family leaves a card idle the model does not fit (stubbed), the NVLink
    family (its groups beside single cards) uses every card: TP over PCIe stays shut."""
    graph = tp_language_model_graph(num_blocks=2, width=256)
    _, problem = _lab_problem(graph, batch=4)

    def leaves_idle(p: PlanningProblem, ranked: object) -> bool:
        return not p.tp_degrees  # the single cards' problem only

    monkeypatch.setattr(strategy, "nothing_cheaper_fits", leaves_idle)
    options = SolveOptions(time_limit_s=2.0, watchdog=False)
    generated = strategy.generate(problem, options, deadline_s=float("inf"))
    [search] = [r for r in generated.runs if (r.family, r.generator) == ("tp2-pcie", "search")]
    assert search.skipped == strategy.TP_PCIE_GATE


def test_geforce_tp_over_pcie_needs_a_layer_no_card_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every layout found leaves a card idle the model does not fit (stubbed), yet every
    unit fits one GeForce card: TP over PCIe stays shut (the issue's rule: only where
    nothing else fits a layer)."""
    graph = tp_language_model_graph(num_blocks=2, width=256)
    _, problem = _lab_problem(graph, batch=4)
    monkeypatch.setattr(strategy, "nothing_cheaper_fits", lambda p, ranked: True)
    options = SolveOptions(time_limit_s=2.0, watchdog=False)
    generated = strategy.generate(problem, options, deadline_s=float("inf"))
    [search] = [r for r in generated.runs if (r.family, r.generator) == ("tp2-pcie", "search")]
    assert search.skipped == strategy.TP_PCIE_GATE
