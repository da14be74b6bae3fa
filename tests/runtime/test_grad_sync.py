"""Who sums which gradient, loss weights, and the ring all-reduce time model."""

from __future__ import annotations

import json
import time
import traceback
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hplan.runtime.contract.errors import PlanMismatchError
from hplan.runtime.contract.holders import holder_sets, parameter_holders
from hplan.runtime.contract.link_model import group_ring_time_s, ring_all_reduce_time_s, sync_order
from hplan.runtime.contract.plan import microbatch_sizes
from hplan.runtime.executor.grad_sync import GradBucket, check_stage_parameters, loss_weight
from tests.fixtures.processes import join_gloo, run_ranks
from tests.fixtures.sample_plans import mixed_plan


def test_a_tied_parameter_is_held_by_every_stage_that_uses_it_in_every_replica() -> None:
    plan = mixed_plan()  # replica 0: ranks 0-1, replica 1: ranks 2-4; tok_emb tied to head
    holders = parameter_holders(plan)
    # embedding on ranks 0 and 2, head on ranks 1 and 4
    assert holders["tok_emb.weight"] == (0, 1, 2, 4)
    assert holders["pos_emb.weight"] == (0, 2)
    assert holders["blocks.5.ln_1.weight"] == (0, 3)  # replica 0 stage 0, replica 1 stage 1
    assert holders["blocks.10.mlp.0.bias"] == (1, 4)  # both replicas' last stages


def test_holder_sets_are_unique_largest_first_and_skip_unshared_parameters() -> None:
    sets = holder_sets(mixed_plan())
    assert list(sets) == sorted(set(sets), key=lambda s: (-len(s), s))
    assert sets[0] == (0, 1, 2, 4)  # the set of every replica's first stage, before pairs
    two_replicas = [(0, 1), (2, 3), (0, 1, 2, 3)]  # stage pairs and a tie (solver numbering)
    assert sorted(two_replicas, key=sync_order) == [(0, 1, 2, 3), (0, 1), (2, 3)]
    assert (0, 1, 2, 4) in sets and (0, 2) in sets
    assert all(len(s) > 1 for s in sets)


def test_loss_weights_of_all_microbatches_of_all_replicas_sum_to_one() -> None:
    global_batch = 40
    shares = ((24, 4), (16, 3))  # (samples, micro-batch size) per replica
    weights = [
        Fraction(size, global_batch)
        for samples, mbs in shares
        for size in microbatch_sizes(samples, mbs)
    ]
    assert sum(weights) == 1
    assert loss_weight(2, 8) == pytest.approx(0.25)


def test_ring_all_reduce_time_follows_the_bandwidth_optimal_formula() -> None:
    assert ring_all_reduce_time_s(1, 10**9, 1e9, 1e-3) == 0.0
    # 2 (n-1)/n * bytes/bandwidth + 2 (n-1) * latency = 1.5 s + 6 ms
    assert ring_all_reduce_time_s(4, 10**9, 1e9, 1e-3) == pytest.approx(1.506)


def test_group_ring_time_uses_the_slowest_link_of_the_group() -> None:
    plan = mixed_plan()  # 25 GB/s inside a box, 1.25 GB/s between the boxes
    inside = group_ring_time_s(plan, (0, 1), 10**9)
    across = group_ring_time_s(plan, (0, 2), 10**9)
    assert across > 10 * inside
    assert across == pytest.approx(10**9 / 1.25e9, rel=1e-2)


def test_a_stage_holding_other_parameters_than_the_plan_is_a_mismatch() -> None:
    plan = mixed_plan()
    held = [n for n, ranks in parameter_holders(plan).items() if 4 in ranks]
    check_stage_parameters(plan, 4, held)
    with pytest.raises(PlanMismatchError, match=r"'blocks\.0\.ln_1\.weight' that the plan"):
        check_stage_parameters(plan, 4, [*held, "blocks.0.ln_1.weight"])
    with pytest.raises(PlanMismatchError, match=r"lists parameter 'tok_emb\.weight' for rank 4"):
        check_stage_parameters(plan, 4, [n for n in held if n != "tok_emb.weight"])


# --------------------------------------------------------------------------- 2 processes
LATE_S = 0.4
"""Rank 1 arrives at the emulated all-reduce this long after rank 0."""
RING_S = 0.3
"""The emulated all-reduce time."""


def _emulated_all_reduce(rank: int, port: int, out_dir: str) -> None:
    try:
        join_gloo(rank, port)
        weight = nn.Parameter(torch.zeros(3))
        weight.grad = torch.full((3,), float(rank + 1))
        bucket = GradBucket((0, 1), dist.group.WORLD, [("w", weight)], min_time_s=RING_S)
        dist.barrier()
        if rank == 1:
            time.sleep(LATE_S)
        arrived_s = time.monotonic()
        bucket.all_reduce()
        times = {"arrived_s": arrived_s, "left_s": time.monotonic(), "grad": weight.grad.tolist()}
        (Path(out_dir) / f"rank-{rank}.json").write_text(json.dumps(times))
        dist.destroy_process_group()
    except Exception:
        (Path(out_dir) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


def test_an_emulated_all_reduce_ends_on_every_holder_a_ring_time_after_the_last_arrival(
    tmp_path: Path,
) -> None:
    assert run_ranks(_emulated_all_reduce, 2, tmp_path) == [0, 0]
    early, late = (json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2))
    assert early["grad"] == late["grad"] == [3.0, 3.0, 3.0]
    assert late["arrived_s"] - early["arrived_s"] > LATE_S * 0.9
    for times in (early, late):  # monotonic clocks are one clock on one machine
        assert times["left_s"] >= late["arrived_s"] + RING_S
