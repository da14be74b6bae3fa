"""``rehearse --verify`` without false alarms (``rehearsal/round_off.py``): a gradient that
is 0 in exact arithmetic, or summed in bf16 from terms that cancel, is measured against
the round-off of one process summing it in another order; a doubled gradient still fails."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from rich.console import Console

from hplan.runtime.contract.plan import Plan
from hplan.runtime.rehearsal.reference_check import compare_gradients
from hplan.runtime.rehearsal.rehearse import RehearsalResult, rehearse
from hplan.runtime.rehearsal.round_off import plan_split, round_off_norms
from tests.fixtures.plans import ReplicaShape, make_plan, write_model


def _grads() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "weight": torch.randn(16, 16),
        "norm.weight": torch.randn(16),
        "key.bias": torch.zeros(16),
    }


def test_zero_gradient_round_off_passes_against_the_measured_round_off() -> None:
    reference = _grads()
    reference["key.bias"] = torch.full((16,), 2e-9)  # exact 0; round-off of a big sum
    rank = dict(reference, **{"key.bias": torch.full((16,), -3e-9)})
    assert not compare_gradients(reference, [rank]).passed  # the dtype floor alone: too low
    split = dict(reference, **{"key.bias": torch.full((16,), -1e-9)})
    result = compare_gradients(reference, [rank], round_off=round_off_norms(reference, split))
    assert result.passed, result.describe("gradients")


def test_bf16_cancellation_passes_and_a_doubled_gradient_still_fails() -> None:
    reference = _grads()
    norm = reference["norm.weight"]
    n1, n2 = (n * norm.norm() / n.norm() for n in torch.randn(2, 16))  # unit: ||norm||
    rank = dict(reference, **{"norm.weight": norm + 0.14 * n1})  # bf16 round-off of a sum
    split = dict(reference, **{"norm.weight": norm + 0.10 * n2})  # that cancels
    bf16 = {"compute_dtype": torch.bfloat16}
    assert not compare_gradients(reference, [rank], **bf16).passed  # rel 1.4e-1 > 5e-2
    floors = round_off_norms(reference, split)
    assert compare_gradients(reference, [rank], round_off=floors, **bf16).passed
    doubled = dict(rank, **{"norm.weight": 2 * norm})
    result = compare_gradients(reference, [doubled], round_off=floors, **bf16)
    assert not result.passed and result.name == "norm.weight"
    doubled = dict(reference, **{"weight": 2 * reference["weight"]})
    result = compare_gradients(reference, [doubled], round_off=floors, **bf16)
    assert not result.passed and result.name == "weight"


def test_the_split_is_the_plans_micro_batches_or_two_halves(tmp_path: Path) -> None:
    path = write_model(tmp_path, LINEAR)
    plan = make_plan(path, [ReplicaShape((-1,), 2, 5), ReplicaShape((-1,), 3, 3)])
    assert plan_split(plan) == [2, 2, 1, 3]
    assert plan_split(make_plan(path, [ReplicaShape((-1,), 4, 4)])) == [2, 2]


LINEAR = """
    import torch
    from torch import nn


    def build_model():
        return nn.Linear(4, 2)


    def sample_batch(batch_size):
        return torch.randn(batch_size, 4), torch.randn(batch_size, 2)


    def loss_fn(out, target):
        return torch.nn.functional.mse_loss(out, target)
"""

TINY_VIT = """
    '''A tiny transformers ViT: its key-projection biases have exact gradient 0.'''
    import torch
    import torch.nn.functional as F
    from transformers import ViTConfig, ViTForImageClassification


    def build_model():
        config = ViTConfig(
            image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=4,
            num_attention_heads=4, intermediate_size=64, num_labels=10,
        )
        return ViTForImageClassification(config)


    def sample_batch(batch_size):
        return {"pixel_values": torch.randn(batch_size, 3, 32, 32)}, torch.randint(0, 10, (batch_size,))


    def loss_fn(outputs, targets):
        return F.cross_entropy(outputs.logits, targets)
"""


def _rehearse(plan: Plan) -> tuple[RehearsalResult, str]:
    out = io.StringIO()
    result = rehearse(
        plan, steps=1, verify=True, timeout_s=120.0, console=Console(file=out, width=400)
    )
    return result, out.getvalue()


def test_a_vits_zero_key_bias_gradient_passes_verify(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    plan = make_plan(
        write_model(tmp_path, TINY_VIT), [ReplicaShape((-1,), 1, 8), ReplicaShape((-1,), 1, 8)]
    )
    result, text = _rehearse(plan)
    assert result.verify_passed is True, text
    assert "k_proj.bias" in text or "key.bias" in text  # the worst: round-off of 0
