"""Mixed precision in the runtime: bf16 autocast on gloo ranks against one process, and
fp16 loss scaling whose skip of a step is taken by every rank."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.contract.plan import Plan, Precision, ZeroStage, wire_spec
from hplan.runtime.executor.worker import boundaries
from tests.fixtures.plans import (
    ReplicaShape,
    compare_first_step,
    load_dumps,
    make_plan,
    run_ranks,
    with_zero,
    write_model,
)

REPO = Path(__file__).resolve().parents[2]
GPT = REPO / "examples" / "gpt" / "model.py"

# bf16 has an 8-bit significand (relative rounding 2**-8 = 3.9e-3 per operation): a
# pipelined step rounds its cut tensors to bf16 and sums micro-batches in another order
# than one process on the whole batch, so gradients agree to a few bf16 roundings.
BF16_GRAD_TOLERANCE = 5e-2


def with_precision(plan: Plan, precision: Precision) -> Plan:
    return replace(plan, ranks=tuple(replace(r, precision=precision) for r in plan.ranks))


@pytest.mark.slow
def test_bf16_autocast_ranks_match_one_bf16_process(tmp_path):
    plan = with_precision(
        make_plan(GPT, [ReplicaShape((3, -1), 2, 4), ReplicaShape((-1,), 4, 4)]), Precision.BF16
    )
    prev, _ = boundaries(plan, plan.ranks[1])
    assert prev is not None and {t.dtype for t in prev.specs} == {"bfloat16"}
    verify = tmp_path / "verify"
    outcomes = run_ranks(plan, tmp_path, "--steps", "1", "--verify-dir", str(verify))
    assert all(o.returncode == 0 for o in outcomes), [o.stderr[-800:] for o in outcomes]
    step = compare_first_step(plan, GPT, verify)
    assert not step.missing
    assert step.grad_rel < BF16_GRAD_TOLERANCE, step
    assert step.loss == pytest.approx(step.reference_loss, rel=1e-2)
    # The same plan in fp32 is far closer to an fp32 process: autocast did run.
    fp32 = make_plan(GPT, [ReplicaShape((3, -1), 2, 4), ReplicaShape((-1,), 4, 4)])
    fp32_dir = tmp_path / "fp32"
    outcomes = run_ranks(fp32, fp32_dir, "--steps", "1", "--verify-dir", str(fp32_dir / "v"))
    assert all(o.returncode == 0 for o in outcomes), [o.stderr[-800:] for o in outcomes]
    exact = compare_first_step(fp32, GPT, fp32_dir / "v")
    assert exact.grad_rel < 1e-4 < step.grad_rel


def test_fp32_ranks_send_cut_tensors_as_traced():
    plan = make_plan(GPT, [ReplicaShape((3, -1), 2, 4)])
    prev, _ = boundaries(plan, plan.ranks[1])
    cut = plan.cut_after(plan.ranks[0].units[-1])
    assert prev is not None and prev.specs == cut.tensors
    half = [wire_spec(t, Precision.FP16) for t in cut.tensors]
    assert [t.dtype for t in half] == [
        "float16" if t.dtype == "float32" else t.dtype for t in cut.tensors
    ]


OVERFLOW_MODEL = """
    # An MLP whose output bias gets a non-finite gradient on one rank in step 0 only.
    import os

    import torch
    import torch.distributed as dist
    from torch import nn

    OVERFLOW_RANK = int(os.environ.get("HPLAN_TEST_OVERFLOW_RANK", "-1"))
    calls = [0]


    class Overflow(torch.autograd.Function):
        @staticmethod
        def forward(ctx, bias):
            return bias.clone()

        @staticmethod
        def backward(ctx, grad):
            calls[0] += 1
            if calls[0] == 1 and dist.is_initialized() and dist.get_rank() == OVERFLOW_RANK:
                return grad * float("inf")
            return grad


    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 1, bias=False)
            self.bias = nn.Parameter(torch.zeros(1))

        def forward(self, x):
            return self.fc(x) + Overflow.apply(self.bias)


    def build_model():
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), Head())


    def sample_batch(batch_size):
        x = torch.randn(batch_size, 8)
        return x, x.sum(dim=1, keepdim=True)


    def loss_fn(pred, target):
        return torch.nn.functional.mse_loss(pred, target)
"""


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero0", "zero1", "zero2", "offload"])
def test_an_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path, strategy):
    path = write_model(tmp_path, OVERFLOW_MODEL)
    # Replica 0: ranks 0 (first layers) and 1 (head); replica 1: rank 2 (everything).
    shape = [ReplicaShape((2, -1), 2, 4), ReplicaShape((-1,), 2, 4)]
    plan = with_precision(make_plan(path, shape), Precision.FP16)
    if (
        strategy == "zero1"
    ):  # the scaler unscales and steps a sharded optimizer; the skip sends nothing
        plan = with_zero(plan, (1.0, 2.0, 1.0))
    if strategy == "zero2":  # the inf reaches only the bias's owner, whose vote skips all
        plan = with_zero(plan, (1.0, 2.0, 1.0), ZeroStage.GRADIENTS)
    if strategy == "offload":  # rank 0 unscales on its device, steps (or not) on the host
        plan = replace(
            plan, ranks=(replace(plan.ranks[0], optimizer_offload=True), *plan.ranks[1:])
        )
    assert plan.loss_scaling
    verify = tmp_path / "verify"
    outcomes = run_ranks(
        plan,
        tmp_path / "run",
        "--steps",
        "2",
        "--verify-dir",
        str(verify),
        env={"HPLAN_TEST_OVERFLOW_RANK": "1"},
    )
    assert all(o.returncode == 0 for o in outcomes), [o.stderr[-800:] for o in outcomes]
    assert "step 0 skipped" in outcomes[0].stderr
    assert "loss scale now 32768" in outcomes[0].stderr  # 65536, halved once
    torch.manual_seed(plan.training.seed)
    initial = dict(load_model_file(path).build_model().named_parameters())
    for rank, dump in enumerate(load_dumps(verify, "params", plan.world_size)):
        for name, value in dump["tensors"].items():
            # Rank 0's gradients were finite: it skipped only because rank 1 voted so.
            assert torch.equal(value, initial[name].detach()), (rank, name)


@pytest.mark.slow
def test_the_loss_scale_is_checkpointed_and_resumed(tmp_path):
    path = write_model(tmp_path, OVERFLOW_MODEL)
    plan = with_precision(make_plan(path, [ReplicaShape((-1,), 2, 4)]), Precision.FP16)
    checkpoints = tmp_path / "checkpoints"
    env = {"HPLAN_TEST_OVERFLOW_RANK": "0"}
    args = ("--checkpoint-dir", str(checkpoints), "--checkpoint-every-steps", "1")
    first = run_ranks(plan, tmp_path / "a", "--steps", "2", *args, env=env)
    assert first[0].returncode == 0, first[0].stderr[-800:]
    # The scale starts at 65536 and halves at each skip; with every step so far skipped the
    # checkpoint also holds no optimizer state, which the resume must take.
    scales = re.findall(r"loss scale now (\d+)", first[0].stderr)
    assert scales and int(scales[-1]) < 65536
    again = run_ranks(plan, tmp_path / "b", "--steps", "3", "--resume", *args)
    assert again[0].returncode == 0, again[0].stderr[-800:]
    assert "resumed at step 2" in again[0].stderr
    assert f"(loss scale {scales[-1]})" in again[0].stderr
