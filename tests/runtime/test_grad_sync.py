"""Who sums which gradient, in which buckets and order, loss weights, the ring all-reduce
time model, and the buckets' all-reduce overlapped with the last backward pass."""

from __future__ import annotations

import time
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hplan.runtime.contract.errors import PlanMismatchError
from hplan.runtime.contract.holders import (
    grad_buckets,
    holder_sets,
    parameter_holders,
    parameter_order,
    step_holder_sets,
)
from hplan.runtime.contract.link_model import group_ring_time_s, ring_all_reduce_time_s, sync_order
from hplan.runtime.contract.plan import Plan, microbatch_sizes
from hplan.runtime.executor.grad_sync import (
    GradBucket,
    GradSync,
    check_stage_parameters,
    loss_weight,
)
from tests.fixtures.plans import TIED_LM, ReplicaShape, make_plan, write_model
from tests.fixtures.processes import join_gloo, rank_results, run_ranks, write_rank_result
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


# --------------------------------------------------------------------------- buckets
def _wire_bytes(plan, rank: int | None = None) -> dict[str, int]:
    """Made-up wire bytes (100 per parameter, 1000 for the embedding) of the parameters
    ``rank`` holds (every parameter for None)."""
    held = parameter_holders(plan)
    return {
        name: 1000 if name == "tok_emb.weight" else 100
        for name, ranks in held.items()
        if rank is None or rank in ranks
    }


def _synchronous(plan: Plan) -> Plan:
    """``plan`` with every holder set summing its gradients every step (no islands)."""
    return replace(plan, training=replace(plan.training, sync=None))


def test_buckets_are_capped_and_follow_the_reversed_model_order_in_one_global_order() -> None:
    plan = _synchronous(mixed_plan())
    everything = grad_buckets(plan, _wire_bytes(plan), cap_bytes=250)
    backward = [n for n in reversed(parameter_order(plan))]
    position = {name: i for i, name in enumerate(backward)}
    held = parameter_holders(plan)
    assert {n for b in everything for n in b.names} == {n for n, r in held.items() if len(r) > 1}
    for bucket in everything:
        assert bucket.num_bytes <= 250 or len(bucket.names) == 1  # the embedding is alone
        assert all(held[n] == bucket.ranks for n in bucket.names)
        assert [position[n] for n in bucket.names] == sorted(position[n] for n in bucket.names)
    firsts = [position[b.names[0]] for b in everything]
    assert firsts == sorted(firsts)  # one global order, by each bucket's first parameter
    assert everything[-1].names == ("tok_emb.weight",)  # first used by the first unit: last
    for rank in range(plan.world_size):  # what a rank computes from its own parameters
        own = grad_buckets(plan, _wire_bytes(plan, rank), cap_bytes=250)
        assert list(own) == [b for b in everything if rank in b.ranks]


def test_without_a_cap_a_holder_set_is_one_bucket() -> None:
    plan = _synchronous(mixed_plan())
    buckets = grad_buckets(plan, _wire_bytes(plan), cap_bytes=float("inf"))
    assert sorted(b.ranks for b in buckets) == sorted(holder_sets(plan))
    assert step_holder_sets(plan) == holder_sets(plan)


def test_local_groups_bucket_their_island_parts_in_the_one_global_order() -> None:
    plan = mixed_plan()  # local_sgd across box-a (ranks 0, 1) and box-b (ranks 2-4)
    everything = grad_buckets(plan, _wire_bytes(plan), cap_bytes=250)
    # only the tied embedding is held twice inside an island: (0, 1) and (2, 4)
    assert [(b.ranks, b.names) for b in everything] == [
        ((0, 1), ("tok_emb.weight",)),
        ((2, 4), ("tok_emb.weight",)),
    ]
    assert step_holder_sets(plan) == ((0, 1), (2, 4))
    for rank in range(plan.world_size):  # what a rank computes, less other islands' parts
        own = grad_buckets(plan, _wire_bytes(plan, rank), cap_bytes=250)
        assert [b for b in own if rank in b.ranks] == [b for b in everything if rank in b.ranks]


# --------------------------------------------------------------------------- 2 processes
LATE_S = 0.4
"""Rank 1 arrives at the emulated all-reduce this long after rank 0."""
RING_S = 0.3
"""The emulated all-reduce time."""


def _emulated_all_reduce(rank: int, port: int, out_dir: str) -> None:
    def body() -> object:
        join_gloo(rank, port)
        weight = nn.Parameter(torch.zeros(3))
        weight.grad = torch.full((3,), float(rank + 1))
        sync = GradSync([GradBucket((0, 1), dist.group.WORLD, [("w", weight)], min_time_s=RING_S)])
        dist.barrier()
        if rank == 1:
            time.sleep(LATE_S)
        arrived_s = time.monotonic()
        sync.finish()
        times = {"arrived_s": arrived_s, "left_s": time.monotonic(), "grad": weight.grad.tolist()}
        return times

    write_rank_result(out_dir, rank, body)


def test_an_emulated_all_reduce_ends_on_every_holder_a_ring_time_after_the_last_arrival(
    tmp_path: Path,
) -> None:
    assert run_ranks(_emulated_all_reduce, 2, tmp_path) == [0, 0]
    early, late = rank_results(tmp_path, 2)
    assert early["grad"] == late["grad"] == [3.0, 3.0, 3.0]
    # rank 1 came late (by less than LATE_S when load delays rank 0 after the barrier)
    assert late["arrived_s"] - early["arrived_s"] > LATE_S / 2
    for times in (early, late):  # monotonic clocks are one clock on one machine
        assert times["left_s"] >= late["arrived_s"] + RING_S


class _Layers(nn.Module):
    """Four linear layers and a parameter the forward pass reads without autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(6, 6) for _ in range(4)))
        self.offset = nn.Parameter(torch.ones(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x) + self.offset.detach()


def _overlapped_buckets(rank: int, port: int, out_dir: str) -> None:
    def body() -> object:
        join_gloo(rank, port)
        torch.manual_seed(0)
        model = _Layers()
        named = list(model.named_parameters())
        # one parameter per bucket, in the reverse of the model's order, as the runtime does
        buckets = [GradBucket((0, 1), dist.group.WORLD, [item]) for item in reversed(named)]
        sync = GradSync(buckets)
        final_s: dict[str, float] = {}
        for name, param in named:  # after the sync's hooks: when each gradient was final
            param.register_post_accumulate_grad_hook(
                lambda _, name=name: final_s.__setitem__(name, time.monotonic())
            )
        torch.manual_seed(1 + rank)  # unequal data on the two ranks
        for microbatch in range(3):
            if microbatch == 2:
                sync.arm()
            model(torch.randn(2 + rank, 6)).square().mean().backward()
        backward_end_s = time.monotonic()
        local = {n: p.grad.clone() for n, p in named if p.grad is not None}
        sync.finish()
        exact = True
        for name, grad in local.items():  # the sum after the backward, one parameter at a time
            dist.all_reduce(grad)
            exact = exact and torch.equal(grad, dict(named)[name].grad)
        result = {
            "exact": exact,
            "offset_grad": model.offset.grad.tolist(),
            "launched_s": [b.launched_s for b in buckets],
            "final_s": final_s,
            "backward_end_s": backward_end_s,
            "names": [b.params[0][0] for b in buckets],
        }
        return result

    write_rank_result(out_dir, rank, body)


def test_buckets_launch_during_the_last_backward_and_sum_exactly_as_after_it(
    tmp_path: Path,
) -> None:
    assert run_ranks(_overlapped_buckets, 2, tmp_path) == [0, 0]
    for result in rank_results(tmp_path, 2):
        assert result["exact"]
        assert result["offset_grad"] == [0.0] * 6  # no gradient: summed as zeros, at the end
        launched = dict(zip(result["names"], result["launched_s"], strict=True))
        final = result["final_s"]
        # the last layer's bucket went out before the first layer's gradient was final ...
        assert launched["layers.3.bias"] < final["layers.0.weight"]
        assert launched["layers.0.weight"] < result["backward_end_s"]
        # ... and the bucket of the parameter without a gradient only after the backward
        assert launched["offset"] > result["backward_end_s"]
        assert result["launched_s"] == sorted(result["launched_s"])  # in bucket order


# --------------------------------------------------------------------------- 3 processes
TINY_CAP_BYTES = 200
"""Small enough that the stages below split into several buckets per holder set."""
TIED_MODEL = (
    """
    '''A small language model: its head is tied to its embedding, and every block has a
    damping factor that the forward pass reads without autograd (it never gets a
    gradient).'''
    import torch
    import torch.nn.functional as F
    from torch import nn

    VOCAB, WIDTH, SEQ = 32, 8, 6

"""
    + TIED_LM
    + """


    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


    def make_optimizer(params):
        return torch.optim.SGD(params, lr=0.1)
"""
)


def _overlapped_step(rank: int, port: int, out_dir: str, plan_json: str) -> None:
    from hplan.runtime.contract.plan import Plan
    from hplan.runtime.contract.timeline_file import ALL_REDUCE
    from hplan.runtime.executor.grad_sync import build_buckets
    from hplan.runtime.executor.pipeline import StepRunner
    from hplan.runtime.executor.seams import HostClock
    from hplan.runtime.executor.worker import RunOptions, build_rank

    def body() -> object:
        plan = Plan.from_json(plan_json)
        join_gloo(rank, port, world_size=plan.world_size)
        parts = build_rank(plan, rank, None, RunOptions(steps=1, device="cpu"))
        buckets = build_buckets(plan, rank, parts.params, cap_bytes=TINY_CAP_BYTES)
        final_s: dict[str, float] = {}
        for name, param in parts.params:
            param.register_post_accumulate_grad_hook(
                lambda _, name=name: final_s.__setitem__(name, time.monotonic())
            )
        runner = StepRunner(parts, buckets, HostClock())
        runner.run(0)
        times = runner.finish_step()
        synced = {n: p.grad.clone() for n, p in parts.params}
        runner.sync.close()
        parts.optimizer.zero_grad(set_to_none=True)
        StepRunner(parts, [], HostClock()).run(0)  # the same step's local gradients alone
        groups = {b.ranks: b.group for b in buckets}
        held = parameter_holders(plan)
        params = dict(parts.params)
        for ranks in holder_sets(plan):  # the sum after the backward, one parameter at a time
            for name in sorted(n for n in params if held[n] == ranks):
                param = params[name]
                param.grad = torch.zeros_like(param) if param.grad is None else param.grad
                dist.all_reduce(param.grad, group=groups[ranks])
        spans = [e for e in runner.timeline.events if e.track == ALL_REDUCE]
        backward_end_s = max(e.end_s for e in runner.timeline.events if ".B." in e.name)
        result = {
            "differ": [n for n, p in parts.params if not torch.equal(p.grad, synced[n])],
            "damping": [synced[n].abs().sum().item() for n in synced if n.endswith("damping")],
            "num_buckets": len(buckets),
            "holder_sets": sorted({b.ranks for b in buckets}),
            "first_launch_s": min(e.start_s for e in spans),
            "last_final_s": max(final_s.values()),
            "launched_in_backward": sum(e.start_s < backward_end_s for e in spans),
            "overlapped_s": times.allreduce_overlapped_s,
        }
        return result

    write_rank_result(out_dir, rank, body)


def test_overlapped_buckets_of_replicas_split_differently_equal_the_sum_after_the_backward(
    tmp_path: Path,
) -> None:
    # replica 0: the whole model on rank 0 (6 samples); replica 1: two stages on ranks 1
    # and 2 (4 samples), so the tied embedding is summed over ranks 0, 1 and 2
    path = write_model(tmp_path, TIED_MODEL)
    plan = make_plan(path, [ReplicaShape((-1,), 2, 6), ReplicaShape((2, -1), 2, 4)])
    held = parameter_holders(plan)
    assert held["tok_emb.weight"] == (0, 1, 2)
    assert held["blocks.0.damping"] == (0, 1) and held["blocks.2.damping"] == (0, 2)
    assert run_ranks(_overlapped_step, 3, tmp_path, plan.to_json()) == [0, 0, 0]
    for result in rank_results(tmp_path, 3):
        assert result["differ"] == []  # bit for bit
        assert result["damping"] and not any(result["damping"])  # no gradient: zeros
        assert result["num_buckets"] > len(result["holder_sets"])  # several per holder set
        assert result["first_launch_s"] < result["last_final_s"]  # before the backward ended
        assert result["launched_in_backward"] >= 1
        assert result["overlapped_s"] > 0


def _views_of_the_sum(rank: int, port: int, out_dir: str) -> None:
    def body() -> object:
        join_gloo(rank, port)
        weight = nn.Parameter(torch.zeros(2, 3))
        bias = nn.Parameter(torch.zeros(3))
        half = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
        bucket = GradBucket((0, 1), dist.group.WORLD, [("w", weight), ("b", bias), ("h", half)])
        sync = GradSync([bucket])
        result: dict[str, object] = {}
        for step in range(2):  # the second step's sums are fresh, not added to the first's
            for p in (weight, bias, half):
                p.grad = torch.full_like(p, float((rank + 1) * (step + 1)))
            sync.finish()
            result[f"sums-{step}"] = [
                p.grad.float().flatten().tolist() for p in (weight, bias, half)
            ]
            result[f"dtypes-{step}"] = [str(p.grad.dtype) for p in (weight, bias, half)]
            storages = {p.grad.untyped_storage().data_ptr() for p in (weight, bias)}
            result[f"one_buffer-{step}"] = len(storages) == 1
            result[f"half_apart-{step}"] = half.grad.untyped_storage().data_ptr() not in storages
            for p in (weight, bias, half):
                p.grad = None  # what the runtime's zero_grad(set_to_none=True) does
        return result

    write_rank_result(out_dir, rank, body)


def test_summed_gradients_are_views_of_the_bucket_and_a_half_gradient_a_copy_in_its_dtype(
    tmp_path: Path,
) -> None:
    assert run_ranks(_views_of_the_sum, 2, tmp_path) == [0, 0]
    for result in rank_results(tmp_path, 2):
        for step in range(2):
            total = 3.0 * (step + 1)  # ranks give 1 and 2 (times the step's factor)
            assert result[f"sums-{step}"] == [[total] * 6, [total] * 3, [total] * 4]
            assert result[f"dtypes-{step}"] == ["torch.float32", "torch.float32", "torch.bfloat16"]
            assert result[f"one_buffer-{step}"] and result[f"half_apart-{step}"]
