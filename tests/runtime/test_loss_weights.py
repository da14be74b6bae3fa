"""The loss convention (``capture/loss_items.py``): which weighting of a loss's values on
parts of a batch gives its value on the whole, and a token-mean loss over padded labels
weighted by tokens across unequal shares, checked by ``rehearse --verify``."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

from hplan.runtime.capture.loss_items import (
    IGNORE_INDEX,
    LossFound,
    check_loss_convention,
    count_items,
)
from hplan.runtime.contract.plan import LossConvention, Plan
from hplan.runtime.rehearsal.rehearse import RehearsalResult, rehearse
from tests.fixtures.plans import ReplicaShape, make_plan, write_model

pytestmark = pytest.mark.xdist_group("padded-gpt2")  # one worker captures `padded_model`


def _logits_and_labels() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(4, 6, 10), torch.randint(0, 10, (4, 6))


def _found(loss_fn) -> LossFound:
    logits, labels = _logits_and_labels()
    return check_loss_convention(loss_fn, logits, labels).found


def test_a_per_sample_mean_a_token_mean_a_sum_and_other_losses_are_told_apart() -> None:
    def token_mean(out, y):
        return F.cross_entropy(out.flatten(0, 1), y.flatten())

    def per_sample_mean(out, y):
        per_token = F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none")
        return per_token.view(y.shape).mean(dim=1).mean()

    def summed(out, y):
        return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum")

    def largest(out, y):
        return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").max()

    assert _found(token_mean) is LossFound.TOKEN_MEAN  # the check pads labels with -100
    assert _found(per_sample_mean) is LossFound.SAMPLE_MEAN
    assert _found(summed) is LossFound.SUM
    assert _found(largest) is LossFound.OTHER
    assert _found(lambda out, y: F.mse_loss(out, torch.zeros_like(out))) is LossFound.SAMPLE_MEAN


def test_a_loss_that_reads_targets_as_indices_is_checked_on_its_own_targets() -> None:
    def gathered(out, y):  # -100 would index out of range: checked unpadded
        return out.gather(2, y.unsqueeze(2)).mean()

    assert _found(gathered) is LossFound.SAMPLE_MEAN


def test_items_are_the_integer_targets_that_are_not_the_ignore_index() -> None:
    labels = torch.tensor([[1, 2, IGNORE_INDEX], [IGNORE_INDEX, IGNORE_INDEX, 5]])
    assert count_items(labels) == 3
    assert count_items({"labels": labels, "weights": torch.ones(2, 3)}) == 3


PADDED_GPT2 = """
    '''A tiny GPT-2 whose labels are padded with -100 past each sample's length.'''
    import torch
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    VOCAB_SIZE, SEQ_LEN = 64, 8


    def build_model():
        config = GPT2Config(
            vocab_size=VOCAB_SIZE, n_positions=16, n_embd=16, n_layer=2, n_head=2,
            use_cache=False, bos_token_id=0, eos_token_id=0,
        )
        return GPT2LMHeadModel(config)


    def sample_batch(batch_size):
        tokens = torch.randint(0, VOCAB_SIZE, (batch_size, SEQ_LEN + 1))
        lengths = torch.randint(1, SEQ_LEN + 1, (batch_size,))
        labels = tokens[:, 1:].clone()
        labels[torch.arange(SEQ_LEN)[None, :] >= lengths[:, None]] = -100
        return {"input_ids": tokens[:, :-1]}, labels


    def loss_fn(outputs, targets):
        return F.cross_entropy(outputs.logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))
"""


def _rehearse(plan: Plan) -> tuple[RehearsalResult, str]:
    out = io.StringIO()
    result = rehearse(
        plan, steps=1, verify=True, timeout_s=120.0, console=Console(file=out, width=400)
    )
    return result, out.getvalue()


@pytest.fixture(scope="module")
def padded_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """PADDED_GPT2's file, one per module: both conventions' plans share its capture."""
    pytest.importorskip("transformers")
    return write_model(tmp_path_factory.mktemp("padded"), PADDED_GPT2)


def _padded_plan(path: Path, convention: LossConvention) -> Plan:
    plan = make_plan(path, [ReplicaShape((2, -1), 1, 3), ReplicaShape((-1,), 2, 3)])
    return replace(plan, model=replace(plan.model, loss_convention=convention))


def test_padded_labels_weighted_by_tokens_across_unequal_shares_pass_verify(
    padded_model: Path,
) -> None:
    result, text = _rehearse(_padded_plan(padded_model, LossConvention.TOKEN_MEAN))
    verified = result.verify
    assert verified is not None and result.verify_passed is True, text
    assert verified.gradients.relative_difference < 1e-5
    assert verified.loss == pytest.approx(verified.reference_loss, rel=1e-5)


def test_padded_labels_weighted_by_samples_fail_verify(padded_model: Path) -> None:
    """What hplan did before it checked the convention: tokens weighted wrongly."""
    result, text = _rehearse(_padded_plan(padded_model, LossConvention.SAMPLE_MEAN))
    assert result.verify_passed is False, text
