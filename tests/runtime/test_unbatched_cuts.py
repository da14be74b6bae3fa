"""Values without a batch dimension crossing cuts (``TensorSpec.batch_dim`` None): solved,
sent whole with every micro-batch, their gradients sent back, and ``rehearse --verify``
equal to one process, on two replicas, one pipelined over three stages (with a ragged last
micro-batch), the other split where the solver splits."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from hplan.planner.api import SolveRequest, plan_training
from hplan.planner.solve.baselines import Strategy
from hplan.runtime.contract.plan import Plan, TensorSpec
from hplan.runtime.rehearsal.rehearse import rehearse
from tests.fixtures.hf_models import HF_T5
from tests.fixtures.plans import BIAS_AND_AUX, ReplicaShape, make_plan, write_model

TIMEOUT_S = 120.0


def _solve(tmp_path: Path, model: Path, strategy: Strategy) -> Plan:
    """``hplan solve`` of ``model`` for a global batch of 8 on three nominal cpu devices."""
    cluster = tmp_path / "cluster.yaml"
    devices = "".join("      - type: cpu\n" for _ in range(3))
    cluster.write_text(
        f"name: three-cpus\nnodes:\n  - name: n0\n    host: 127.0.0.1\n    devices:\n{devices}"
    )
    request = SolveRequest(
        model_path=model, cluster_path=cluster, global_batch_size=8, strategy=strategy
    )
    return plan_training(request).plan


def _unbatched(plan: Plan) -> dict[str, list[TensorSpec]]:
    """Cut (after unit) -> its tensors without a batch dimension."""
    return {cut.after_unit: [t for t in cut.tensors if t.batch_dim is None] for cut in plan.cuts}


def _verify(plan: Plan) -> None:
    out = io.StringIO()
    result = rehearse(
        plan, steps=1, verify=True, timeout_s=TIMEOUT_S, console=Console(file=out, width=400)
    )
    verified = result.verify
    assert verified is not None and result.verify_passed is True, out.getvalue()
    assert verified.gradients.relative_difference < 1e-5
    assert verified.loss == pytest.approx(verified.reference_loss, rel=1e-5)


def test_a_position_bias_and_an_aux_loss_scalar_cross_cuts_and_verify(tmp_path: Path) -> None:
    model = write_model(tmp_path, BIAS_AND_AUX)
    solved = _solve(tmp_path, model, Strategy.UNIFORM_PIPELINE)  # embed, blocks 0-1 | the rest
    assert [r.units[-1] for r in solved.ranks] == ["blocks.1", "head"]
    # One rehearsal checks both layouts: replica 0: embed + block 0 | blocks 1-2 | block 3 +
    # head, micro-batches 2, 2, 1; replica 1: the solved split (embed, blocks 0-1 | the rest)
    laid_out = make_plan(model, [ReplicaShape((2, 2, -1), 2, 5), ReplicaShape((3, -1), 2, 3)])
    assert [r.units for r in laid_out.replica_ranks(1)] == [r.units for r in solved.ranks]
    for plan, cuts in ((solved, {"blocks.1"}), (laid_out, {"blocks.0", "blocks.1", "blocks.2"})):
        unbatched = _unbatched(plan)
        assert set(unbatched) == cuts
        for tensors in unbatched.values():
            shapes = sorted((t.shape, t.requires_grad) for t in tensors)
            assert shapes == [((), True), ((1, 6, 6), True)]  # the aux scalar, the bias
    _verify(solved)  # the solver's own micro-batches
    _verify(laid_out)


def test_tiny_hf_t5_solves_and_verifies_with_its_position_biases_across_cuts(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    model = write_model(tmp_path, HF_T5)
    solved = _solve(tmp_path, model, Strategy.DATA_PARALLEL)
    assert [r.stage for r in solved.ranks] == [0, 0, 0]
    # replica 0: encoder embed + block 0 | encoder block 1 ... decoder block 0 | the rest
    plan = make_plan(model, [ReplicaShape((2, 4, -1), 2, 4), ReplicaShape((-1,), 2, 2)])
    unbatched = _unbatched(plan)
    assert set(unbatched) == {"encoder.block.0", "decoder.block.0"}
    for tensors in unbatched.values():
        assert tensors and all(t.requires_grad and len(t.shape) == 4 for t in tensors)
    _verify(plan)
