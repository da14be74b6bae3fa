"""Deterministic global batches, replica slices, micro-batches and input delivery."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.contract.errors import ConfigError, PlanMismatchError
from hplan.runtime.contract.plan import microbatch_sizes
from hplan.runtime.executor.data import (
    BatchSource,
    epoch_permutation,
    global_batch_indices,
    replica_indices,
    split_microbatches,
    stage_inputs,
    steps_per_epoch,
)
from tests.fixtures.plans import NUMBERED_DATASET, write_model


def test_every_sample_is_used_once_per_epoch_by_replicas_of_seven_and_three() -> None:
    num_samples, shares = 100, (7, 3)
    global_batch = sum(shares)
    per_epoch = steps_per_epoch(num_samples, global_batch)
    assert per_epoch == 10
    for epoch in range(2):
        used: list[int] = []
        for step in range(epoch * per_epoch, (epoch + 1) * per_epoch):
            offset = 0
            for share in shares:
                idx = replica_indices(3, step, num_samples, global_batch, offset, share)
                assert len(idx) == share
                used += idx.tolist()
                offset += share
        assert sorted(used) == list(range(num_samples))


def test_drop_last_skips_the_remainder_of_an_epoch_and_reshuffles_the_next() -> None:
    num_samples, global_batch = 103, 10
    per_epoch = steps_per_epoch(num_samples, global_batch)
    assert per_epoch == 10
    first = torch.cat([global_batch_indices(0, s, num_samples, global_batch) for s in range(10)])
    second = torch.cat(
        [global_batch_indices(0, s, num_samples, global_batch) for s in range(10, 20)]
    )
    assert len(set(first.tolist())) == 100  # no sample twice within the epoch
    dropped = set(range(num_samples)) - set(first.tolist())
    assert dropped == set(epoch_permutation(0, 0, num_samples)[100:].tolist())
    assert first.tolist() != second.tolist()


def test_global_batches_are_the_same_for_the_same_seed_and_differ_between_seeds() -> None:
    a = global_batch_indices(5, 3, 50, 8)
    assert torch.equal(a, global_batch_indices(5, 3, 50, 8))
    assert not torch.equal(a, global_batch_indices(6, 3, 50, 8))


def test_a_dataset_smaller_than_the_global_batch_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="6 samples, fewer than the global batch of 8"):
        steps_per_epoch(6, 8)


def test_split_microbatches_sizes_three_three_two_cover_the_batch_in_order() -> None:
    x = torch.arange(8 * 2).reshape(8, 2)
    mask = torch.arange(8) % 2 == 0
    table = torch.ones(4)  # not batched: goes whole to every micro-batch
    targets = {"y": torch.arange(8)}
    sizes = microbatch_sizes(8, 3)
    micro = split_microbatches(
        {"x": x, "mask": mask, "table": table}, targets, sizes, {"table": None}
    )
    assert [m.num_samples for m in micro] == [3, 3, 2]
    assert torch.equal(torch.cat([m.inputs["x"] for m in micro]), x)
    assert torch.equal(torch.cat([m.inputs["mask"] for m in micro]), mask)
    assert torch.equal(torch.cat([m.targets["y"] for m in micro]), targets["y"])
    assert all(m.inputs["table"] is table for m in micro)


def test_a_missing_graph_input_names_the_input_and_the_stage() -> None:
    available = {"x": torch.zeros(1), "mask": torch.zeros(1)}
    assert list(stage_inputs(available, ("mask",), stage_label="stage 1")) == ["mask"]
    with pytest.raises(
        PlanMismatchError, match=r"stage 2 of replica 0 .*'labels'.*\['mask', 'x'\]"
    ):
        stage_inputs(available, ("mask", "labels"), stage_label="stage 2 of replica 0")


def test_batch_source_slices_the_same_global_batch_for_every_replica(tmp_path: Path) -> None:
    model_file = load_model_file(write_model(tmp_path, NUMBERED_DATASET))

    def bind(inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x": inputs}

    source = BatchSource(model_file, bind, seed=1, global_batch_size=10)
    assert source.steps_per_epoch == 10
    whole, _ = source.global_batch(4)
    first = source.microbatches(4, 0, 7, (3, 3, 1))
    second = source.microbatches(4, 7, 3, (3,))
    got = torch.cat([m.inputs["x"] for m in first + second])
    assert torch.equal(got, whole)
    # sample i is x = (i, 1): the numbers are the dataset indices of global batch 4
    assert got[:, 0].long().tolist() == global_batch_indices(1, 4, 100, 10).tolist()


def test_sample_batch_source_is_deterministic_and_leaves_the_global_rng_alone(
    tmp_path: Path,
) -> None:
    model_file = load_model_file(
        write_model(tmp_path, NUMBERED_DATASET.replace("def dataset", "def _no"))
    )
    source = BatchSource(model_file, lambda x: {"x": x}, seed=0, global_batch_size=4)
    assert source.steps_per_epoch is None
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, _ = source.global_batch(2)
    assert torch.equal(torch.get_rng_state(), before)
    b, _ = source.global_batch(2)
    c, _ = source.global_batch(3)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_a_sampled_batch_seeds_the_cpu_generator_alone(tmp_path: Path, monkeypatch) -> None:
    # torch.manual_seed would queue a seed for every accelerator with a formatted stack,
    # every step; the batch is the one torch.manual_seed's CPU seed gives
    model_file = load_model_file(
        write_model(tmp_path, NUMBERED_DATASET.replace("def dataset", "def _no"))
    )
    source = BatchSource(model_file, lambda x: {"x": x}, seed=0, global_batch_size=4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)  # step 2 of seed 0
        expected, _ = model_file.sample_batch(4)

    def refused(seed: int) -> None:
        raise AssertionError("torch.manual_seed called per step")

    monkeypatch.setattr(torch, "manual_seed", refused)
    got, _ = source.global_batch(2)
    assert torch.equal(got, expected)


def test_an_epochs_order_is_drawn_once_and_a_batch_is_the_callers_own(monkeypatch) -> None:
    epoch_permutation.cache_clear()
    draws = []
    randperm = torch.randperm

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        draws.append(args[0])
        return randperm(*args, **kwargs)

    monkeypatch.setattr(torch, "randperm", counted)
    batches = [global_batch_indices(7, s, 1000, 10) for s in range(5)]
    assert draws == [1000]  # five steps of one epoch: one draw, as DistributedSampler
    expected = batches[0].clone()
    batches[0].zero_()  # the caller's copy; the kept order is untouched
    assert torch.equal(global_batch_indices(7, 0, 1000, 10), expected)
    assert draws == [1000]
