"""Batch shares that follow the replicas' measured speeds (``executor/control/rebalance.py``): the
shares they balance to, when a change is taken, and that a run whose shares moved trains as
one process does."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.contract.metrics_file import StepMetrics
from hplan.runtime.contract.plan import Plan
from hplan.runtime.executor.control.rebalance import (
    MAX_GROWTH,
    MIN_GAIN,
    MIN_WINDOW_STEPS,
    WINDOW_STEPS,
    ReplicaSpeed,
    ShareBalancer,
    balanced_shares,
    even_cut,
    predicted_step_s,
    sample_caps,
)
from hplan.runtime.rehearsal.reference_check import reference_steps, relative_difference
from tests.fixtures.plans import ReplicaShape, make_plan, read_checkpoint, run_ranks, write_model

FAULTS = Path(__file__).resolve().parents[1] / "fixtures" / "faults"
"""The rank processes' test hooks (``sitecustomize.py``): here, the fixed compute clock."""

SLOW_LOADER = """
import time

import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def sample_batch(batch_size):
    time.sleep(0.03)  # steps of 30 ms or more: the ranks exchange every dozen steps or so
    x = torch.randn(batch_size, 8)
    return x, x.sum(dim=1, keepdim=True)


def loss_fn(pred, target):
    return torch.nn.functional.mse_loss(pred, target)


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.01)
"""


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("rebalance"), SLOW_LOADER)


def _plan(model_path: Path, *shares: tuple[int, int]) -> Plan:
    """Replicas of one stage each: (micro-batch size, samples) per replica."""
    return make_plan(
        model_path, [ReplicaShape((-1,), micro_batch_size=m, num_samples=n) for m, n in shares]
    )


def _record(rank: int, samples: int, compute_s: float, optimizer_s: float, step: int = 1):
    return StepMetrics(
        rank=rank, replica=rank, stage=0, step=step, step_time_s=compute_s + optimizer_s,
        compute_time_s=compute_s, p2p_time_s=0.0, wait_time_s=0.0, allreduce_time_s=0.0,
        optimizer_time_s=optimizer_s, other_time_s=0.0, loss=1.0, samples=samples,
        peak_memory_bytes=1,
    )  # fmt: skip


def test_an_even_cut_keeps_the_micro_batch_count_and_differs_by_one_sample_at_most() -> None:
    assert even_cut(51, 2) == (26, 25)
    assert even_cut(4, 3) == (2, 1, 1)  # microbatch_sizes(4, 2) would give two
    assert even_cut(7, 1) == (7,)


def test_balanced_shares_end_every_replica_together_within_floors_and_caps() -> None:
    # the benchmark's GPT: a fast node computing 2 ms a sample, two slow ones 4 ms, the
    # optimizer 4 ms on the fast one and 8 ms on the slow ones
    speeds = [ReplicaSpeed(0.002, 0.004), ReplicaSpeed(0.0042, 0.008), ReplicaSpeed(0.004, 0.008)]
    shares = balanced_shares(96, speeds, floors=(1, 1, 1), caps=(96, 96, 96))
    assert sum(shares) == 96
    best_s = min(
        predicted_step_s((a, b, 96 - a - b), speeds) for a in range(1, 95) for b in range(1, 96 - a)
    )
    assert predicted_step_s(shares, speeds) == pytest.approx(best_s)  # no split ends sooner
    assert shares == (50, 22, 24)  # 104 / 100.4 / 104 ms
    # the fast node capped at 40: the slow ones take the rest
    assert balanced_shares(96, speeds, floors=(1, 1, 1), caps=(40, 96, 96)) == (40, 27, 29)
    # a floor holds: one sample a micro-batch
    slow = [ReplicaSpeed(0.001, 0.0), ReplicaSpeed(1.0, 0.0)]
    assert balanced_shares(10, slow, floors=(1, 3), caps=(10, 10)) == (7, 3)
    with pytest.raises(ValueError, match="do not fit"):
        balanced_shares(10, slow, floors=(1, 3), caps=(5, 4))


def test_caps_grow_micro_batches_by_max_growth_where_memory_allows(model_path: Path) -> None:
    plan = _plan(model_path, (8, 16), (4, 8))
    assert sample_caps(plan) == (10 * 2, 5 * 2)  # floor(8 x 1.25) x 2, floor(4 x 1.25) x 2
    assert MAX_GROWTH == 1.25
    assert sample_caps(replace(plan, memory=None)) == (16, 8)  # no sizes: no growth
    tiny = replace(
        plan,
        cluster=replace(
            plan.cluster,
            devices=tuple(replace(d, memory_bytes=1) for d in plan.cluster.devices),
        ),
    )
    assert sample_caps(tiny) == (16, 8)  # nothing fits: the plan's own size stays


def test_the_balancer_posts_after_a_window_changes_once_and_ignores_stale_values(
    model_path: Path,
) -> None:
    plan = _plan(model_path, (12, 12), (12, 12))
    balancers = [ShareBalancer(plan, rank) for rank in range(2)]
    for step in range(1, MIN_WINDOW_STEPS):
        balancers[0].observe(_record(0, 12, 0.24, 0.01, step))
        assert balancers[0].posted() is None  # too few steps yet
    balancers[0].observe(_record(0, 12, 0.24, 0.01, MIN_WINDOW_STEPS))
    replica, speed = balancers[0].posted()  # type: ignore[misc]
    assert replica == 0 and speed == ReplicaSpeed(pytest.approx(0.02), pytest.approx(0.01))
    # replica 1 computes twice as fast: every rank takes the same change from step 9 on
    speeds = [ReplicaSpeed(0.02, 0.01), ReplicaSpeed(0.01, 0.01)]
    changes = [b.agreed(0, speeds, next_step=9) for b in balancers]
    assert changes[0] == changes[1] is not None
    assert changes[0].shares == (9, 15)  # replica 1 capped at floor(12 x 1.25)
    assert changes[0].predicted_gain == pytest.approx((0.25 / 0.19) - 1)
    assert [b.sizes() for b in balancers] == [(9,), (15,)]
    assert [b.offset() for b in balancers] == [0, 9]
    # the window keeps the steps of the old shares (a sample's time) and takes the new
    # ones, up to WINDOW_STEPS: 0.27 s for 9 samples is 0.03 s a sample
    for step in range(9, 9 + WINDOW_STEPS):
        balancers[0].observe(_record(0, 9, 0.27, 0.01, step))
    assert balancers[0].posted()[1].compute_per_sample_s == pytest.approx(0.03)  # type: ignore[index]
    # the values posted before the change come back one exchange later: stale
    assert balancers[0].agreed(0, speeds, next_step=12) is None
    # a missing replica, or a gain under MIN_GAIN, changes nothing
    assert balancers[0].agreed(1, [speeds[0], None], next_step=12) is None
    # at 9 | 15, replica 1 measured 0.0121 s a sample: 10 | 14 would end at 0.21 s, later
    # than 0.1915 s now
    near = [ReplicaSpeed(0.02, 0.01), ReplicaSpeed(0.0121, 0.01)]
    assert balancers[0].agreed(1, near, next_step=12) is None
    # a gain under MIN_GAIN: at 0.0137 s a sample replica 1 ends 9 | 15 at 0.2155 s, and
    # 10 | 14 would end at 0.21 s, 2.6% sooner
    assert MIN_GAIN == 0.03
    slightly = [ReplicaSpeed(0.02, 0.01), ReplicaSpeed(0.0137, 0.01)]
    assert balanced_shares(24, slightly, (1, 1), (15, 15)) == (10, 14)
    assert balancers[0].agreed(1, slightly, next_step=12) is None
    assert balancers[0].shares_at(8) == (12, 12) and balancers[0].shares_at(9) == (9, 15)


def test_under_a_binding_quota_all_cpu_outside_compute_is_fixed_time(model_path: Path) -> None:
    balancer = ShareBalancer(_plan(model_path, (12, 12), (12, 12)), 0)
    record = replace(
        _record(0, 12, 0.05, 0.004),
        compute_cpu_time_s=0.0216,
        optimizer_cpu_time_s=0.0018,
        cpu_time_s=0.0252,  # 3.6 ms outside compute: the optimizer and 1.8 ms of comm
        cpu_quota_cores=0.45,
        num_threads=1,
    )
    for _ in range(MIN_WINDOW_STEPS):
        balancer.observe(record)
    _, speed = balancer.posted()  # type: ignore[misc]
    assert speed.compute_per_sample_s == pytest.approx(0.0216 / 0.45 / 12)
    assert speed.fixed_s == pytest.approx(0.0036 / 0.45)  # not the optimizer's 0.0018 / 0.45


def test_a_run_whose_shares_moved_trains_as_one_process_does(
    model_path: Path, tmp_path: Path
) -> None:
    # two ranks on the fixed compute clock (``HPLAN_TEST_COMPUTE_S``: 5 ms a sample, 1 ms an
    # optimizer step, whatever the machine's load); replica 0 computes three micro-batches
    # of 4 a step, replica 1 one: replica 0 takes three times as long, so samples move to
    # replica 1 (up to its cap of 5) while training goes on
    plan = _plan(model_path, (4, 12), (4, 4))
    steps, metrics, ckpt = 40, tmp_path / "m", tmp_path / "ckpt"
    env = {"PYTHONPATH": f"{FAULTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "HPLAN_TEST_COMPUTE_S": "0.005:0.001"}  # fmt: skip
    outcomes = run_ranks(
        plan, tmp_path / "run", "--steps", str(steps), "--metrics-dir", str(metrics),
        "--checkpoint-dir", str(ckpt), env=env, timeout_s=120.0,
    )  # fmt: skip
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.stderr[-2000:]
    records = [
        [json.loads(line) for line in (metrics / f"rank-{r}.jsonl").open()] for r in range(2)
    ]
    samples = [[record["samples"] for record in rank] for rank in records]
    assert records[0][0]["compute_time_s"] == pytest.approx(2 * 12 * 0.005)  # forward, backward
    assert samples[0][0] == 12 and samples[1][0] == 4
    assert samples[0][-1] == 11 and samples[1][-1] == 5  # replica 1's cap: floor(4 x 1.25)
    assert all(a + b == 16 for a, b in zip(*samples, strict=True))  # every step, together
    assert "batch shares 12 | 4 -> 11 | 5" in outcomes[0].stderr
    saved = read_checkpoint(ckpt / f"step-{steps}", tmp_path)
    reference = reference_steps(plan, load_model_file(model_path), num_steps=steps)
    for name, value in reference.params.items():
        assert relative_difference(saved["model"][name], value) < 1e-5, name


def test_moved_shares_keep_the_plans_floor_of_samples_a_micro_batch(model_path: Path) -> None:
    plan = _plan(model_path, (3, 6), (40, 80))  # two micro-batches each
    floored = replace(plan, training=replace(plan.training, min_microbatch_samples=2))
    # replica 0 is 100x slower: without a floor it keeps one sample a micro-batch
    speeds = [ReplicaSpeed(1.0, 0.0), ReplicaSpeed(0.01, 0.0)]
    unfloored = ShareBalancer(plan, 0)
    assert unfloored.agreed(0, speeds, next_step=1) is not None and unfloored.sizes() == (1, 1)
    balancer = ShareBalancer(floored, 0)
    change = balancer.agreed(0, speeds, next_step=1)
    assert change is not None and change.shares == (4, 82) and balancer.sizes() == (2, 2)
