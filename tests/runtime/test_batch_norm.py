"""BatchNorm under unequal shares: no micro-batch of one sample, one set of running
statistics across replicas and stages, ``--verify`` on the plan's micro-batches."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.contract.errors import PlanFileError
from hplan.runtime.contract.plan import MemoryStrategy, Plan, RankPlan, SyncMode
from hplan.runtime.executor.checkpoint import latest_checkpoint
from hplan.runtime.executor.running_stats import stat_sets
from hplan.runtime.rehearsal.reference_check import verify_first_step
from tests.fixtures.plans import (
    ReplicaShape,
    load_dumps,
    make_plan,
    read_checkpoint,
    run_ranks,
    with_islands,
    write_model,
)

BN_MLP = """
import torch
from torch import nn


def build_model():  # no bias before batch norm: its exact gradient is 0
    return nn.Sequential(
        nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(),
        nn.Linear(16, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(),
        nn.Linear(16, 4),
    )


def sample_batch(batch_size):
    return torch.randn(batch_size, 8), torch.randn(batch_size, 4)


def loss_fn(outputs, targets):
    return nn.functional.mse_loss(outputs, targets)
"""

STEPS = 3


def _bn_plan(model: Path) -> Plan:
    """Replica 0: a 2-stage pipeline of 7 samples in micro-batches (4, 3); replica 1: one
    stage of 4 samples in (2, 2). The stages count 2 micro-batches a step, the single
    stage too, but the shares (7 and 4) are odd and unequal."""
    plan = make_plan(
        model,
        [ReplicaShape((2, -1), 4, 7), ReplicaShape((-1,), 2, 4)],
    )
    return replace(plan, training=replace(plan.training, min_microbatch_samples=2))


def test_a_plan_with_a_micro_batch_below_its_floor_is_refused_at_load(tmp_path: Path) -> None:
    model = write_model(tmp_path, BN_MLP)
    plan = make_plan(model, [ReplicaShape((-1,), 2, 5), ReplicaShape((-1,), 2, 2)])  # 2+2+1
    with pytest.raises(PlanFileError, match="micro-batch of 1 sample"):
        replace(plan, training=replace(plan.training, min_microbatch_samples=2)).verify()


def test_replicas_of_a_batch_norm_model_keep_one_set_of_running_statistics(
    tmp_path: Path,
) -> None:
    model = write_model(tmp_path, BN_MLP)
    plan = _bn_plan(model)
    ckpt, verify_dir = tmp_path / "ckpt", tmp_path / "verify"
    outcomes = run_ranks(
        plan, tmp_path / "run", "--steps", str(STEPS), "--checkpoint-dir", str(ckpt),
        "--verify-dir", str(verify_dir),
    )  # fmt: skip
    for outcome in outcomes:
        assert outcome.returncode == 0, f"rank {outcome.rank}: {outcome.stderr[-2000:]}"
    # one process on the plan's micro-batches: batch norm normalises each by its own
    result = verify_first_step(plan, load_model_file(model), verify_dir)
    assert result.passed, result.describe()
    assert result.gradients.relative_difference < 1e-5
    # after the first step every holder of a running statistic holds the same values
    dumps = [d["buffers"] for d in load_dumps(verify_dir, "params", plan.world_size)]
    names = {n for d in dumps for n in d}
    assert {n.rpartition(".")[2] for n in names} == {
        "running_mean",
        "running_var",
        "num_batches_tracked",
    }
    for name in names:
        copies = [d[name] for d in dumps if name in d]
        assert len(copies) == 2  # one per replica
        assert torch.equal(copies[0], copies[1]), name
        if name.endswith("num_batches_tracked"):
            assert int(copies[0]) == 1  # one optimizer step, as one process counts it
    # the checkpoint after STEPS steps: one set, every layer at STEPS steps
    saved = read_checkpoint(latest_checkpoint(ckpt), tmp_path)
    counters = {n: int(t) for n, t in saved["buffers"].items() if "num_batches" in n}
    assert counters == {"1.num_batches_tracked": STEPS, "4.num_batches_tracked": STEPS}


def test_a_hand_made_plan_with_a_one_sample_micro_batch_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    model = write_model(tmp_path, BN_MLP)
    plan = make_plan(model, [ReplicaShape((-1,), 2, 3)])  # 2 + 1, no floor in the plan
    (outcome,) = run_ranks(plan, tmp_path / "run", "--steps", "1")
    assert outcome.returncode != 0
    assert "micro-batch of 1 sample through batch norm (1)" in outcome.stderr
    assert "Traceback" not in outcome.stderr and "internal error" not in outcome.stderr


def test_running_statistics_sync_with_their_holders_and_across_islands_at_the_outer_sync(
    tmp_path: Path,
) -> None:
    model = write_model(tmp_path, BN_MLP)
    plan = make_plan(model, [ReplicaShape((2, -1), 2, 4), ReplicaShape((-1,), 2, 4)])
    assert stat_sets(plan)["1.running_mean"] == (((0, 2), 1),)
    assert stat_sets(plan)["4.running_var"] == (((1, 2), 1),)
    islands = with_islands(
        make_plan(model, [ReplicaShape((-1,), 2, 4)] * 3), [2, 1], SyncMode.LOCAL_SGD, local_steps=5
    )
    assert stat_sets(islands)["1.running_mean"] == (((0, 1), 1), ((0, 1, 2), 5))


def test_islands_under_local_sgd_average_their_statistics_at_the_outer_sync(
    tmp_path: Path,
) -> None:
    model = write_model(tmp_path, BN_MLP)
    plan = with_islands(
        make_plan(model, [ReplicaShape((-1,), 2, 4), ReplicaShape((-1,), 3, 6)]),
        [1, 1],
        SyncMode.LOCAL_SGD,
        local_steps=2,
    )
    ckpt = tmp_path / "ckpt"
    outcomes = run_ranks(plan, tmp_path / "run", "--steps", "2", "--checkpoint-dir", str(ckpt))
    for outcome in outcomes:
        assert outcome.returncode == 0, f"rank {outcome.rank}: {outcome.stderr[-2000:]}"
    saved = read_checkpoint(latest_checkpoint(ckpt), tmp_path)
    counters = {n: int(t) for n, t in saved["buffers"].items() if "num_batches" in n}
    assert counters == {"1.num_batches_tracked": 2, "4.num_batches_tracked": 2}


def _recomputing(plan: Plan, strategy: MemoryStrategy) -> Plan:
    """``plan`` with every rank recomputing: all of its units, or all but its last."""

    def one(rank: RankPlan) -> RankPlan:
        if strategy is MemoryStrategy.RECOMPUTE:
            return replace(rank, memory_strategy=strategy)
        return replace(rank, memory_strategy=strategy, recompute_units=rank.units[:-1])

    return replace(plan, ranks=tuple(one(r) for r in plan.ranks))


@pytest.mark.parametrize("strategy", [MemoryStrategy.RECOMPUTE, MemoryStrategy.SELECTIVE])
def test_a_recomputed_forward_does_not_count_its_batch_twice_in_the_running_statistics(
    tmp_path: Path, strategy: MemoryStrategy
) -> None:
    model = write_model(tmp_path, BN_MLP)
    plan = make_plan(model, [ReplicaShape((2, -1), 2, 4)])
    saved = {}
    for name, run_plan in (("kept", plan), ("recomputed", _recomputing(plan, strategy))):
        ckpt = tmp_path / f"ckpt-{name}"
        outcomes = run_ranks(
            run_plan, tmp_path / name, "--steps", "2", "--checkpoint-dir", str(ckpt)
        )
        failed = [f"rank {o.rank}: {o.stderr[-1500:]}" for o in outcomes if o.returncode]
        assert not failed, failed
        saved[name] = read_checkpoint(latest_checkpoint(ckpt), tmp_path / name)["buffers"]
    assert saved["kept"].keys() == saved["recomputed"].keys()
    for name, value in saved["kept"].items():
        assert torch.allclose(value, saved["recomputed"][name], atol=1e-6), name
