"""Stage splits on real traced models: costs from time and memory, checked against brute force."""

from __future__ import annotations

import itertools

import pytest

from hplan.planner.cost.evaluate import evaluate
from hplan.planner.cost.layout import Layout, ReplicaLayout, StageLayout
from hplan.planner.cost.problem_builder import build_problem
from hplan.planner.frontend.cost_graph import build_model_graph
from hplan.planner.solve.device_groups import device_groups
from hplan.planner.solve.partition import Partitioner
from hplan.runtime.capture.model_file import load_model_file
from tests.fixtures.clusters import gpu_cluster
from tests.fixtures.models import write_model_file


def _pipeline(bounds: tuple[int, ...], micro_batch_size: int, batch: int) -> Layout:
    stages = tuple(StageLayout(s, bounds[s], bounds[s + 1]) for s in range(len(bounds) - 1))
    return Layout((ReplicaLayout(stages, micro_batch_size, batch // micro_batch_size, batch),))


@pytest.fixture(scope="module")
def q3_problem(tmp_path_factory):
    """Vocabulary 32000, width 64, sequence 128, four blocks, untied, four equal devices."""
    path = write_model_file(tmp_path_factory.mktemp("q3"), "untied_lm_q3")
    graph = build_model_graph(load_model_file(path))
    cluster = gpu_cluster("rtx3090", "rtx3090", "rtx3090", "rtx3090")
    return build_problem(graph, cluster, global_batch_size=32, micro_batch_sizes=(4,))


def test_head_stage_holds_no_more_blocks_than_the_embedding_stage(q3_problem):
    problem = q3_problem
    classes = device_groups(problem)
    assert len(classes) == 1  # four equal devices
    shape = Partitioner(problem, classes).best_split((0, 0, 0, 0), 0)
    assert shape is not None
    names = problem.unit_names
    stages = [names[shape.bounds[s] : shape.bounds[s + 1]] for s in range(4)]
    blocks = [sum(1 for n in stage if n.startswith("blocks.")) for stage in stages]
    head_stage = next(i for i, st in enumerate(stages) if "head" in st)
    emb_stage = next(i for i, st in enumerate(stages) if "emb" in st)
    assert blocks[head_stage] <= blocks[emb_stage]
    # Parameter counts are equal for emb and head; time is not (the logits matmul).
    emb, head = names.index("emb"), names.index("head")
    assert problem.static_memory_bytes[emb] == problem.static_memory_bytes[head]
    assert problem.fwd_time_s[0, head, 0] > 5 * problem.fwd_time_s[0, emb, 0]


def test_four_stage_split_matches_a_brute_force_search(q3_problem):
    """Small instances use every split's (period, fill) Pareto front: exactly optimal. Large
    ones use the min-period dynamic program: within 0.1% here."""
    problem = q3_problem
    u = problem.num_units
    brute = min(
        evaluate(problem, _pipeline((0, *cuts, u), 4, 32)).step_time_s
        for cuts in itertools.combinations(range(1, u), 3)
    )
    partitioner = Partitioner(problem, device_groups(problem))
    front = partitioner.all_splits((0, 0, 0, 0), 0)
    exact = min(evaluate(problem, _pipeline(t.bounds, 4, 32)).step_time_s for t in front)
    assert exact == pytest.approx(brute, rel=1e-12)
    shape = partitioner.best_split((0, 0, 0, 0), 0)
    assert shape is not None
    dynamic = evaluate(problem, _pipeline(shape.bounds, 4, 32)).step_time_s
    assert brute <= dynamic <= brute * 1.001
