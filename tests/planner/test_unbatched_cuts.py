"""What cut tensors without a batch dimension cost (``TensorSpec.batch_dim`` None): their
bytes once per micro-batch, not per sample, on the link, in the boundary buffers, held for
each micro-batch in flight, and in the memory check a plan is loaded with."""

from __future__ import annotations

from pathlib import Path

import pytest

from hplan.planner.cost.evaluate import stage_memory_bytes
from hplan.planner.cost.problem_builder import build_problem
from hplan.runtime.contract.memory import plan_memory
from tests.fixtures.clusters import cpu_cluster
from tests.fixtures.plans import BIAS_AND_AUX, ReplicaShape, make_plan, model_graph, write_model

HIDDEN_BYTES_PER_SAMPLE = 6 * 8 * 4  # SEQ x WIDTH float32
BIAS_AND_AUX_BYTES = 6 * 6 * 4 + 4  # the SEQ x SEQ bias and the scalar, float32


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("bias"), BIAS_AND_AUX)


def test_the_cost_graph_keeps_unbatched_cut_tensors_and_the_problem_counts_them_once(
    model: Path,
) -> None:
    graph = model_graph(str(model))
    graph.verify()
    after_block_0 = [u.name for u in graph.units].index("blocks.0")
    assert graph.cut_bytes_per_sample(after_block_0) == HIDDEN_BYTES_PER_SAMPLE
    problem = build_problem(graph, cpu_cluster(2), global_batch_size=8)
    assert problem.cut_bytes_per_sample[after_block_0] == HIDDEN_BYTES_PER_SAMPLE
    assert problem.cut_fixed_bytes is not None and problem.cut_grad_fixed_bytes is not None
    assert problem.cut_fixed_bytes[after_block_0] == BIAS_AND_AUX_BYTES
    assert problem.cut_grad_fixed_bytes[after_block_0] == BIAS_AND_AUX_BYTES
    for b in (1, 4):
        expected = b * HIDDEN_BYTES_PER_SAMPLE + BIAS_AND_AUX_BYTES
        assert problem.cut_bytes(after_block_0, b) == expected
        assert problem.cut_grad_bytes(after_block_0, b) == expected
    # blocks 1-2 between two such cuts: a sample more adds its activations and the batched
    # part of one receive and one send buffer on each side, never the bias again
    start, stop = after_block_0 + 1, after_block_0 + 3
    one, two = (stage_memory_bytes(problem, start, stop, b, in_flight=1) for b in (1, 2))
    activations = float(problem.activation_bytes_per_sample[start:stop].sum())
    assert two - one == pytest.approx(activations + 2 * 2 * HIDDEN_BYTES_PER_SAMPLE)
    # a micro-batch more in flight holds its activations and the received bias and scalar
    held = [stage_memory_bytes(problem, start, stop, 2, in_flight=m) for m in (1, 2)]
    assert held[1] - held[0] == pytest.approx(2 * activations + BIAS_AND_AUX_BYTES)


def test_the_plans_memory_check_counts_unbatched_boundary_tensors_once_per_micro_batch(
    model: Path,
) -> None:
    workspace = []
    for micro_batch_size in (1, 2):
        plan = make_plan(model, [ReplicaShape((2, 2, -1), micro_batch_size, 4)])
        memory = plan_memory(plan)
        assert memory is not None
        workspace.append(memory[1].workspace_bytes)  # stage 1: blocks 1-2
    assert workspace[1] - workspace[0] == pytest.approx(2 * 2 * HIDDEN_BYTES_PER_SAMPLE)
    activations = []
    for num_samples in (1, 2):  # stage 1 holds 1, then 2 micro-batches of 1 in flight
        memory = plan_memory(make_plan(model, [ReplicaShape((2, 2, -1), 1, num_samples)]))
        assert memory is not None
        activations.append(memory[1].activation_bytes)
    graph = model_graph(str(model))
    per_sample = sum(graph.unit_costs[u].activation_bytes_per_sample for u in (2, 3))
    assert activations[1] - activations[0] == pytest.approx(per_sample + BIAS_AND_AUX_BYTES)
