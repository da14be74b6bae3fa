"""Optimizer-state offload: the model file's optimizer stepped on host copies, against one
optimizer (bit for bit), the plain runtime on gloo ranks (bit for bit, with gradient sync
and clipping), one process, and checkpoints across plain and offloading plans; the
refusals.

The plan: ``TIED_LM`` in two replicas split differently (replica 0: ranks 0 and 1,
replica 1: rank 2), the tied embedding summed over all three; rank 1 offloads (it shares
the tied embedding with ranks 0 and 2, so its host step reads an all-reduced, clipped
gradient). Its optimizer has two param groups (weight decay on matrices only).
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.contract.errors import PlanFileError
from hplan.runtime.contract.plan import Plan
from hplan.runtime.executor.memory.offload import OffloadedOptimizer
from hplan.runtime.executor.worker import RunOptions, build_rank
from hplan.runtime.rehearsal.reference_check import reference_steps, relative_difference
from tests.fixtures.plans import (
    OPTIMIZER_ENV,
    TIED_LM_OPTIMIZERS,
    RankOutcome,
    ReplicaShape,
    compare_first_step,
    make_plan,
    read_checkpoint,
    run_ranks,
    with_zero,
    write_model,
)

TIMEOUT_S = 90.0
OFFLOADING = (1,)


def with_offload(plan: Plan, ranks: tuple[int, ...]) -> Plan:
    """``plan`` with ``optimizer_offload`` on ``ranks``."""
    offloading = replace(
        plan,
        ranks=tuple(replace(r, optimizer_offload=r.rank in ranks) for r in plan.ranks),
    )
    offloading.verify()
    return offloading


def _ok(outcomes: list[RankOutcome]) -> None:
    for outcome in outcomes:
        assert outcome.returncode == 0, f"rank {outcome.rank}: {outcome.stderr[-2000:]}"


def _plans(directory: Path) -> tuple[Path, Plan, Plan]:
    """The model file, the plain plan and the same plan with rank 1 offloading."""
    path = write_model(directory, TIED_LM_OPTIMIZERS)
    plain = make_plan(path, [ReplicaShape((2, -1), 2, 4), ReplicaShape((-1,), 2, 6)])
    return path, plain, with_offload(plain, OFFLOADING)


# --------------------------------------------------------------------------- one process
@pytest.mark.parametrize("kind", ["adamw", "sgd", "adagrad"])
def test_an_offloaded_optimizer_steps_as_the_model_files_own_bit_for_bit(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(OPTIMIZER_ENV, kind)
    path, plain, offloading = _plans(tmp_path)
    mine = build_rank(offloading, 1, path, RunOptions(steps=1, device="cpu"))
    theirs = build_rank(plain, 1, path, RunOptions(steps=1, device="cpu"))
    assert isinstance(mine.optimizer, OffloadedOptimizer)
    assert not isinstance(theirs.optimizer, OffloadedOptimizer)
    host_ids = {id(h) for _, h, _ in mine.optimizer.hosts}
    device_ids = {id(p) for _, p in mine.params}
    schedulers = [
        torch.optim.lr_scheduler.StepLR(parts.optimizer, step_size=1, gamma=0.5)
        for parts in (mine, theirs)
    ]
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        grads = {n: torch.randn(p.shape, generator=generator) for n, p in theirs.params}
        for parts in (mine, theirs):
            for name, param in parts.params:
                param.grad = None if (step == 1 and name == "ln_f.bias") else grads[name].clone()
            parts.optimizer.step()
            parts.optimizer.zero_grad(set_to_none=True)
        for scheduler in schedulers:
            scheduler.step()
    for (name, param), (_, other) in zip(mine.params, theirs.params, strict=True):
        assert torch.equal(param, other), name
    stepped = {id(k) for k in mine.optimizer.state}  # keyed by the device's parameters
    assert stepped <= device_ids and stepped
    assert {id(k) for k in mine.optimizer.inner.state} <= host_ids  # kept on the host copies
    for (_, param), (_, other) in zip(mine.params, theirs.params, strict=True):
        for key, value in theirs.optimizer.state[other].items():
            assert torch.equal(torch.as_tensor(mine.optimizer.state[param][key]), value), key


def test_a_plan_refuses_offload_with_zero_in_one_line(tmp_path: Path) -> None:
    _, plain, _ = _plans(tmp_path)
    zero = with_zero(plain, (1.0, 1.0, 1.0))
    with pytest.raises(PlanFileError, match="optimizer_offload with zero_stage 1"):
        with_offload(zero, OFFLOADING)


# --------------------------------------------------------------------------- gloo ranks
STEPS = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The offloading plan trained ``STEPS`` steps on 3 gloo ranks with a checkpoint after
    every step and ``--verify-dir``."""
    directory = tmp_path_factory.mktemp("offload")
    path, plain, offloading = _plans(directory)
    _ok(
        run_ranks(offloading, directory / "run", "--steps", str(STEPS), "--checkpoint-dir",
                  str(directory / "ckpt"), "--checkpoint-every-steps", "1",
                  "--verify-dir", str(directory / "verify"), timeout_s=TIMEOUT_S)
    )  # fmt: skip
    return {"dir": directory, "path": path, "plain": plain, "offload": offloading}


def _assert_equal_state(actual: dict, expected: dict) -> None:
    """Every parameter and every optimizer state value, by name, equal bit for bit."""
    assert actual["model"].keys() == expected["model"].keys()
    for name, value in expected["model"].items():
        assert torch.equal(actual["model"][name], value), name
    assert actual["optimizer"].keys() == expected["optimizer"].keys()
    for name, state in expected["optimizer"].items():
        assert state.keys() == actual["optimizer"][name].keys(), name
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(actual["optimizer"][name][key]), value), (name, key)


@pytest.mark.xdist_group("offload-runs")  # one worker builds `runs`
def test_offload_trains_as_one_process(runs: dict, tmp_path: Path) -> None:
    directory, path, offloading = runs["dir"], runs["path"], runs["offload"]
    first = compare_first_step(offloading, path, directory / "verify")  # every copy
    assert first.missing == ()
    assert first.grad_rel < 1e-5 and first.param_rel < 1e-4
    assert first.loss == pytest.approx(first.reference_loss, rel=1e-5)
    offloaded = read_checkpoint(directory / "ckpt" / f"step-{STEPS}", tmp_path)
    reference = reference_steps(offloading, load_model_file(path), num_steps=STEPS)
    assert offloaded["model"].keys() == reference.params.keys()
    for name, value in reference.params.items():
        assert relative_difference(offloaded["model"][name], value) < 1e-5, name


def _from_step(source: Path, step: int, target: Path) -> Path:
    """A copy of checkpoint folder ``source`` whose newest checkpoint is ``step``."""
    shutil.copytree(source, target)
    for found in target.glob("step-*"):
        if int(found.name.removeprefix("step-")) > step:
            shutil.rmtree(found)
    (target / "latest").write_text(f"step-{step}\n", encoding="utf-8")
    return target


@pytest.mark.xdist_group("offload-runs")  # one worker builds `runs`
def test_resumed_offload_to_plain_and_back_continue_the_run(runs: dict, tmp_path: Path) -> None:
    """Step 2 by the plain plan from the offloading run's step 1 (offload -> plain) equals
    the offloading run's own step 2 bit for bit: offload steps exactly as the plain runtime
    (with the gradient all-reduce and the clipping), and a plain plan reads its
    checkpoints. Step 3 by the offloading plan from that plain checkpoint (plain ->
    offload) equals one process's three steps (the parameters it loads reach its host
    copies)."""
    directory, path, plain, offloading = runs["dir"], runs["path"], runs["plain"], runs["offload"]
    ckpt = _from_step(directory / "ckpt", STEPS - 1, tmp_path / "ckpt")
    _ok(
        run_ranks(plain, tmp_path / "run-plain", "--steps", "1", "--checkpoint-dir", str(ckpt),
                  "--resume", timeout_s=TIMEOUT_S)
    )  # fmt: skip
    scratch = tmp_path / "read"
    scratch.mkdir()
    again = read_checkpoint(ckpt / f"step-{STEPS}", scratch)
    _assert_equal_state(again, read_checkpoint(directory / "ckpt" / f"step-{STEPS}", tmp_path))
    _ok(
        run_ranks(offloading, tmp_path / "run-offload", "--steps", "1", "--checkpoint-dir",
                  str(ckpt), "--resume", timeout_s=TIMEOUT_S)
    )  # fmt: skip
    last = read_checkpoint(ckpt / f"step-{STEPS + 1}", scratch)
    reference = reference_steps(offloading, load_model_file(path), num_steps=STEPS + 1)
    for name, value in reference.params.items():
        assert relative_difference(last["model"][name], value) < 1e-5, name
