"""ZeRO stage 1: uneven optimizer-state shards, stepped per rank and exchanged, against the
unsharded runtime (bit for bit) and one process; checkpoints across plans; the refusals.
ZeRO stage 2 (the summed gradients sharded too) on the same plan and weights, in the same
module-scoped runs.

The plan: a tied-embedding language model (``TIED_LM``) in two replicas split differently
(replica 0: ranks 0 and 1, replica 1: ranks 2 and 3), so that its holder sets differ by
parameter: the tied embedding (0, 1, 2, 3) with shard weights 3:1:0:1 (rank 2 keeps none),
``blocks.0`` (0, 3) at 3:1 and the rest (1, 3) at 1:1. Its optimizer has two param groups
(weight decay on matrices only), so a holder set's shard is several leaves.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch
from rich.console import Console

from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.contract.holders import optimizer_shards, parameter_holders
from hplan.runtime.contract.plan import Plan, ZeroStage
from hplan.runtime.executor.memory.zero import ShardedOptimizer
from hplan.runtime.executor.worker import RunOptions, build_rank
from hplan.runtime.rehearsal.reference_check import reference_steps, relative_difference
from hplan.runtime.rehearsal.rehearse import rehearse
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
WEIGHTS = (3.0, 1.0, 0.0, 1.0)

pytestmark = pytest.mark.xdist_group("zero-runs")  # one worker builds the `runs` fixture


def _ok(outcomes: list[RankOutcome]) -> None:
    for outcome in outcomes:
        assert outcome.returncode == 0, f"rank {outcome.rank}: {outcome.stderr[-2000:]}"


def _plans(directory: Path) -> tuple[Path, Plan, Plan]:
    """The model file, the plain plan and the same plan under ZeRO stage 1 (``WEIGHTS``)."""
    path = write_model(directory, TIED_LM_OPTIMIZERS)
    plain = make_plan(path, [ReplicaShape((2, -1), 2, 4), ReplicaShape((1, -1), 2, 6)])
    return path, plain, with_zero(plain, WEIGHTS)


def test_the_plan_has_uneven_shards_a_weight_zero_rank_and_holder_sets_that_differ(
    tmp_path: Path,
) -> None:
    _, _, zero = _plans(tmp_path)
    held = parameter_holders(zero)
    assert held["tok_emb.weight"] == (0, 1, 2, 3)
    assert held["blocks.0.fc.weight"] == (0, 3) and held["ln_f.weight"] == (1, 3)
    sizes = {"tok_emb.weight": 32 * 8, "blocks.0.damping": 8, "blocks.0.fc.bias": 8,
             "blocks.0.fc.weight": 64}  # fmt: skip
    shards = optimizer_shards(zero, sizes)
    assert shards[(0, 1, 2, 3)].bounds == {0: (0, 154), 1: (154, 205), 2: (205, 205),
                                           3: (205, 256)}  # fmt: skip
    assert shards[(0, 3)].bounds == {0: (0, 60), 3: (60, 80)}  # 3:1, inside fc.weight


# --------------------------------------------------------------------------- one process
def _build_ranks(plan: Plan, path: Path) -> list:
    return [build_rank(plan, r.rank, path, RunOptions(steps=1, device="cpu")) for r in plan.ranks]


def _exchange(ranks: list) -> None:
    """What ``ShardSync.all_gather`` does, in one process: each member's updated slice of
    every leaf into the other members' buffers."""
    leaves = {}
    for parts in ranks:
        for leaf in parts.optimizer.leaves:
            leaves.setdefault((leaf.ranks, leaf.names), {})[parts.rank_plan.rank] = leaf
    for members in leaves.values():
        for owner, leaf in members.items():
            start, stop = leaf.bounds[owner]
            for other in members.values():
                other.flat[start:stop] = leaf.flat[start:stop]


def _halving(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


@pytest.mark.parametrize("kind", ["adamw", "sgd", "adagrad"])
def test_every_ranks_shards_stepped_and_exchanged_equal_one_optimizer_bit_for_bit(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(OPTIMIZER_ENV, kind)
    path, _, zero = _plans(tmp_path)
    model_file = load_model_file(path)
    ranks = _build_ranks(zero, path)
    torch.manual_seed(zero.training.seed)
    model = model_file.build_model()
    named = dict(model.named_parameters())
    optimizer = model_file.optimizer([p for p in named.values() if p.requires_grad])
    schedulers = [_halving(o) for o in [optimizer, *(parts.optimizer for parts in ranks)]]
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = {n: torch.randn(p.shape, generator=generator) for n, p in named.items()}
        for name, param in named.items():
            param.grad = grads[name].clone()
        optimizer.step()
        for parts in ranks:
            for name, param in parts.params:
                param.grad = grads[name].clone()
            parts.optimizer.step()
            parts.optimizer.zero_grad(set_to_none=True)
        _exchange(ranks)
        for scheduler in schedulers:  # the rate each step is its param groups'
            scheduler.step()
    for parts in ranks:
        assert isinstance(parts.optimizer, ShardedOptimizer)
        for name, param in parts.params:
            assert torch.equal(param, named[name]), (parts.rank_plan.rank, name)


def test_each_rank_keeps_optimizer_state_of_its_shards_only(tmp_path: Path) -> None:
    path, _, zero = _plans(tmp_path)
    ranks = _build_ranks(zero, path)
    held = parameter_holders(zero)
    numels = {n: p.numel() for parts in ranks for n, p in parts.params}
    shards = optimizer_shards(zero, numels)
    kept_sharded = 0
    for parts in ranks:
        for _, param in parts.params:
            param.grad = torch.zeros_like(param)
        parts.optimizer.step()  # AdamW creates its state
        rank = parts.rank_plan.rank
        whole = sum(numels[n] for n, _ in parts.params if len(held[n]) == 1)
        shard = sum(s.bounds[rank][1] - s.bounds[rank][0] for s in shards.values()
                    if rank in s.ranks)  # fmt: skip
        states = list(parts.optimizer.state.values())
        assert all(s["exp_avg"].numel() == s["exp_avg_sq"].numel() for s in states)
        assert sum(s["exp_avg"].numel() for s in states) == whole + shard, rank
        assert whole + shard < sum(numels[n] for n, _ in parts.params), rank
        kept_sharded += shard
    assert kept_sharded == sum(s.num_elements for s in shards.values())  # each element once
    assert sum(s["exp_avg"].numel() for s in ranks[2].optimizer.state.values()) == 0  # weight 0


def test_an_optimizer_that_is_not_elementwise_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(OPTIMIZER_ENV, "lbfgs")
    path = write_model(tmp_path, TIED_LM_OPTIMIZERS)
    plain = make_plan(path, [ReplicaShape((-1,), 2, 4), ReplicaShape((-1,), 2, 4)])
    build_rank(plain, 0, path, RunOptions(steps=1, device="cpu"))  # fine without ZeRO
    zero = with_zero(plain, (1.0, 1.0))
    outcomes = run_ranks(zero, tmp_path / "run", "--steps", "1", timeout_s=TIMEOUT_S)
    for outcome in outcomes:
        assert outcome.returncode == 2, outcome.stderr
        last = outcome.stderr.strip().splitlines()[-1]
        assert "LBFGS is not elementwise" in last and "zero_stage 0" in last, outcome.stderr
        assert "Traceback" not in outcome.stderr


# --------------------------------------------------------------------------- gloo ranks
STEPS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The plain and the ZeRO plan, each trained ``STEPS`` steps on 4 gloo ranks with a
    checkpoint after every step and ``--verify-dir``."""
    directory = tmp_path_factory.mktemp("zero")
    path, plain, zero = _plans(directory)
    zero2 = with_zero(plain, WEIGHTS, ZeroStage.GRADIENTS)
    for name, plan in (("plain", plain), ("zero", zero), ("zero2", zero2)):
        _ok(
            run_ranks(plan, directory / name, "--steps", str(STEPS), "--checkpoint-dir",
                      str(directory / name / "ckpt"), "--checkpoint-every-steps", "1",
                      "--verify-dir", str(directory / name / "verify"), timeout_s=TIMEOUT_S)
        )  # fmt: skip
    return {"dir": directory, "path": path, "plain": plain, "zero": zero, "zero2": zero2}


def test_zero_steps_equal_the_unsharded_run_bit_for_bit_and_one_process(
    runs: dict, tmp_path: Path
) -> None:
    directory, path, zero = runs["dir"], runs["path"], runs["zero"]
    first = compare_first_step(zero, path, directory / "zero" / "verify")  # every copy
    assert first.missing == ()
    assert first.grad_rel < 1e-5 and first.param_rel < 1e-4
    assert first.loss == pytest.approx(first.reference_loss, rel=1e-5)
    sharded = read_checkpoint(directory / "zero" / "ckpt" / f"step-{STEPS}", tmp_path)
    plain = read_checkpoint(directory / "plain" / "ckpt" / f"step-{STEPS}", tmp_path)
    _assert_equal_state(sharded, plain)
    reference = reference_steps(zero, load_model_file(path), num_steps=STEPS)
    assert sharded["model"].keys() == reference.params.keys()
    for name, value in reference.params.items():
        assert relative_difference(sharded["model"][name], value) < 1e-5, name


def test_zero_stage_2_equals_one_process_every_gradient_and_parameter_and_the_plain_run(
    runs: dict, tmp_path: Path
) -> None:
    """Stage 2 at 3:1:0:1 (a weight-0 rank, holder sets that differ, a tied weight, clipping
    to MAX_GRAD_NORM): the first step's gradients (each rank's shards, gathered for the
    dump) and parameters against one process, and three steps against the plain run."""
    directory, path, zero2 = runs["dir"], runs["path"], runs["zero2"]
    first = compare_first_step(zero2, path, directory / "zero2" / "verify")
    assert first.missing == ()
    assert first.grad_rel < 1e-5 and first.param_rel < 1e-4
    assert first.loss == pytest.approx(first.reference_loss, rel=1e-5)
    sharded = read_checkpoint(directory / "zero2" / "ckpt" / f"step-{STEPS}", tmp_path)
    plain = read_checkpoint(directory / "plain" / "ckpt" / f"step-{STEPS}", tmp_path)
    assert sharded["model"].keys() == plain["model"].keys()
    for name, value in plain["model"].items():  # reduce and all-reduce may sum in two orders
        assert relative_difference(sharded["model"][name], value) < 1e-6, name
    assert sharded["optimizer"].keys() == plain["optimizer"].keys()
    for name, state in plain["optimizer"].items():
        for key, value in state.items():
            got = torch.as_tensor(sharded["optimizer"][name][key]).double()
            assert relative_difference(got, torch.as_tensor(value).double()) < 1e-5, (name, key)


def _assert_equal_state(actual: dict, expected: dict) -> None:
    """Every parameter and every optimizer state value (each parameter's whole state, by
    name) equal bit for bit."""
    assert actual["model"].keys() == expected["model"].keys()
    for name, value in expected["model"].items():
        assert torch.equal(actual["model"][name], value), name
    assert actual["optimizer"].keys() == expected["optimizer"].keys()
    for name, state in expected["optimizer"].items():
        assert state.keys() == actual["optimizer"][name].keys(), name
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(actual["optimizer"][name][key]), value), (name, key)


def _from_step(source: Path, step: int, target: Path) -> Path:
    """A copy of checkpoint folder ``source`` whose newest checkpoint is ``step``."""
    shutil.copytree(source, target)
    for found in target.glob("step-*"):
        if int(found.name.removeprefix("step-")) > step:
            shutil.rmtree(found)
    (target / "latest").write_text(f"step-{step}\n", encoding="utf-8")
    return target


def test_checkpoints_resume_from_zero_without_it_and_into_it_equal_the_uninterrupted_run(
    runs: dict, tmp_path: Path
) -> None:
    directory, plain, zero = runs["dir"], runs["plain"], runs["zero"]
    cases = [  # (written under, resumed under); other weights load as plain -> zero does
        ("zero", plain),
        ("plain", zero),
    ]
    uninterrupted = read_checkpoint(directory / "plain" / "ckpt" / f"step-{STEPS}", tmp_path)
    for idx, (written, resumed) in enumerate(cases):
        ckpt = _from_step(directory / written / "ckpt", STEPS - 1, tmp_path / f"ckpt-{idx}")
        _ok(
            run_ranks(resumed, tmp_path / f"run-{idx}", "--steps", "1", "--checkpoint-dir",
                      str(ckpt), "--resume", timeout_s=TIMEOUT_S)
        )  # fmt: skip
        again = read_checkpoint(ckpt / f"step-{STEPS}", tmp_path)
        _assert_equal_state(again, uninterrupted)


def test_rehearse_verify_passes_under_zero(runs: dict) -> None:
    result = rehearse(
        runs["zero"],
        steps=1,
        verify=True,
        timeout_s=TIMEOUT_S,
        console=Console(file=io.StringIO(), width=400),
    )
    assert result.verify is not None and result.verify.passed, result.verify
