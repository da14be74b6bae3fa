"""``rehearse --verify``: every synced gradient against one process, every update against
the model's optimizer replayed on the ranks' gradients, dropout off for the verified step.

The rehearsals run stock Hugging Face models with their default dropout (0.1) on a plan of
two replicas, one pipelined over two stages: boundaries, micro-batches and the all-reduce
between replicas of different splits all take part.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.plan import Plan
from hplan.runtime.executor.random_ops import DropoutOff, RandomDraws
from hplan.runtime.rehearsal.reference_check import (
    VerifyResult,
    WorstDifference,
    _batch_norms,
    compare_gradients,
    compare_updates,
    replay_update,
)
from hplan.runtime.rehearsal.rehearse import RehearsalResult, rehearse
from tests.fixtures.hf_models import HF_BERT, HF_GPT2, SCALE_GRADIENT_ENV, with_gradient_fault
from tests.fixtures.plans import ReplicaShape, make_plan, write_model

TIMEOUT_S = 120.0


def _two_replicas(path: Path) -> Plan:
    """Replica 0: two stages, micro-batches of 2, 4 samples; replica 1: one stage, 2."""
    return make_plan(path, [ReplicaShape((2, -1), 2, 4), ReplicaShape((-1,), 2, 2)])


def _rehearse(plan: Plan, steps: int = 1) -> tuple[RehearsalResult, str]:
    out = io.StringIO()
    result = rehearse(
        plan, steps=steps, verify=True, timeout_s=TIMEOUT_S, console=Console(file=out, width=400)
    )
    return result, out.getvalue()


# --------------------------------------------------------------------------- random ops
def test_dropout_off_runs_every_dropout_at_probability_zero_only_inside_the_block() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 4, 8)
    attention = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
    with torch.no_grad():
        plain = attention(x, x, x, need_weights=False)[0]
        with DropoutOff() as off:
            outs = [
                nn.Dropout(0.3)(x),
                F.dropout(x, 0.3),
                torch.ops.aten.dropout.default(x, 0.3, True),  # as a torch.export graph calls
                F.scaled_dot_product_attention(x, x, x, dropout_p=0.3),
                attention(x, x, x, need_weights=False)[0],
            ]
        dropped = F.dropout(x, 0.3)
    for out in outs[:3]:
        torch.testing.assert_close(out, x, rtol=0, atol=0)
    torch.testing.assert_close(outs[3], F.scaled_dot_product_attention(x, x, x))
    attention.eval()
    with torch.no_grad():
        torch.testing.assert_close(outs[4], attention(x, x, x, need_weights=False)[0])
    assert not torch.allclose(plain, outs[4])  # in training mode, outside the block it drops
    assert not torch.equal(dropped, x)
    assert off.calls == {
        "dropout": 2,
        "dropout.default": 1,
        "scaled_dot_product_attention": 1,
        "multi_head_attention_forward": 1,
    }


def test_random_draws_names_random_operators_but_not_attention_without_dropout() -> None:
    x = torch.randn(2, 3, 4)
    with RandomDraws() as draws:
        F.scaled_dot_product_attention(x, x, x)
        torch.randn(3)
        F.rrelu(x, training=True)
    assert draws.calls == {"aten.randn.default": 1, "aten.rrelu_with_noise.default": 1}


# --------------------------------------------------------------------------- comparisons
def test_a_doubled_gradient_fails_naming_it_and_round_off_of_a_zero_gradient_passes() -> None:
    torch.manual_seed(0)
    weight, key_bias = torch.randn(16, 16), torch.full((16,), 3e-12)
    reference = {"weight": weight, "key.bias": key_bias}
    right = {"weight": weight * (1 + 1e-7), "key.bias": -key_bias}  # round-off of exact 0
    result = compare_gradients(reference, [right, right])
    assert result.passed and result.relative_difference < 1e-5
    doubled = {"weight": 2 * weight, "key.bias": -key_bias}
    result = compare_gradients(reference, [right, doubled])
    assert not result.passed
    assert (result.name, result.rank) == ("weight", 1)
    assert result.relative_difference == pytest.approx(1.0)
    assert result.describe("gradients") == (
        "gradients: worst weight (rank 1) rel 1.0e+00 (tol 1e-04) FAIL"
    )


ADAM_WARMUP = """
    import torch
    from torch import nn


    def build_model():
        return nn.Linear(4, 4)


    def sample_batch(batch_size):
        return torch.randn(batch_size, 4), torch.randn(batch_size, 4)


    def loss_fn(out, target):
        return torch.nn.functional.mse_loss(out, target)


    def make_optimizer(params):
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)


    def make_scheduler(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.1 * (step + 1))
"""


def test_adam_updates_of_round_off_gradients_match_when_replayed_on_the_ranks_gradients(
    tmp_path: Path,
) -> None:
    model_file = load_model_file(write_model(tmp_path, ADAM_WARMUP))
    torch.manual_seed(0)
    model = model_file.build_model()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {"weight": torch.randn(4, 4), "bias": torch.randn(4)}
    grads["weight"][0] = 1e-6  # 0 in exact arithmetic; the ranks computed round-off +1e-6
    replayed = replay_update(model, model_file, grads)
    lr = 1e-2 * 0.1  # the scheduler's factor at step 0
    update = replayed["weight"][0] - initial["weight"][0]
    torch.testing.assert_close(update, torch.full((4,), -lr), rtol=2e-2, atol=0)  # lr * sign
    rank = {n: t.clone() for n, t in replayed.items()}
    assert compare_updates(initial, replayed, [rank]).passed
    # The same step from the reference's round-off (-1e-11) moves row 0 the other way:
    # a comparison of updated parameters with one process would call this run wrong.
    grads["weight"][0] = -1e-6
    torch.manual_seed(0)
    other = replay_update(model_file.build_model(), model_file, grads)
    assert compare_updates(initial, other, [rank]).relative_difference > 0.1
    # A rank that skipped the scheduler's factor took a 10x step: that fails.
    wrong = {n: initial[n] + 10 * (t - initial[n]) for n, t in replayed.items()}
    result = compare_updates(initial, replayed, [wrong])
    assert not result.passed and result.relative_difference == pytest.approx(9.0, rel=1e-4)


# --------------------------------------------------------------------------- rehearsals
@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Model files: GPT-2 (with a gradient fault the ranks turn on from the environment)
    and BERT."""
    pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp("hf")
    return {
        "gpt2": write_model(directory, with_gradient_fault(HF_GPT2), "gpt2.py"),
        "bert": write_model(directory, HF_BERT, "bert.py"),
    }


@pytest.mark.xdist_group("hf-models")  # one worker builds `hf_models` and captures GPT-2 once
@pytest.mark.parametrize("model", ["gpt2", "bert"])
def test_stock_hf_models_with_dropout_pass_verify_on_pipeline_and_data_parallel(
    model: str, hf_models: dict[str, Path]
) -> None:
    plan = _two_replicas(hf_models[model])
    result, text = _rehearse(plan)
    verified = result.verify
    assert verified is not None and result.verify_passed is True, text
    assert verified.dropout_off and verified.random_draws == {}
    assert verified.gradients.relative_difference < 1e-5
    assert verified.updates.relative_difference < 1e-5
    assert verified.loss == pytest.approx(verified.reference_loss, rel=1e-5)
    data = result.to_dict()["verify"]
    assert data["gradients"]["name"] == verified.gradients.name and data["passed"] is True
    assert "verify: dropout was off in step 0 in both runs" in text
    assert f"verify: gradients: worst {verified.gradients.name} (rank " in text
    assert text.count(" pass") == 2 and "FAIL" not in text


@pytest.mark.xdist_group("hf-models")
def test_a_gradient_doubled_on_the_ranks_fails_verify_naming_that_parameter(
    hf_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "transformer.h.0.mlp.c_fc.weight"  # on rank 1: the pipeline's second stage
    monkeypatch.setenv(SCALE_GRADIENT_ENV, f"{name}=2")
    plan = make_plan(hf_models["gpt2"], [ReplicaShape((2, -1), 2, 4)])
    result, text = _rehearse(plan)
    verified = result.verify
    assert verified is not None and result.verify_passed is False
    assert verified.gradients.name == name and not verified.gradients.passed
    assert verified.gradients.relative_difference == pytest.approx(1.0, rel=1e-4)
    assert verified.updates.passed  # the ranks stepped right on the gradients they had
    assert f"verify: gradients: worst {name} (rank 1) rel 1.0e+00 (tol 1e-04) FAIL" in text


DROPOUT_OF_ONES = """
    '''out = b(dropout(a(x))) on a constant batch, SGD with lr 0: every step's loss is the
    same unless dropout draws.'''
    import torch
    import torch.nn.functional as F
    from torch import nn


    class Dropping(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 16)
            self.b = nn.Linear(16, 1)

        def forward(self, x):
            return self.b(F.dropout(self.a(x), 0.5))


    def build_model():
        return Dropping()


    def sample_batch(batch_size):
        return torch.ones(batch_size, 16), torch.zeros(batch_size, 1)


    def loss_fn(out, target):
        return F.mse_loss(out, target)


    def make_optimizer(params):
        return torch.optim.SGD(params, lr=0.0)
"""


def test_the_steps_after_the_verified_one_use_the_models_dropout(tmp_path: Path) -> None:
    plan = make_plan(write_model(tmp_path, DROPOUT_OF_ONES), [ReplicaShape((1, 1), 2, 4)])
    result, _ = _rehearse(plan, steps=2)
    assert result.verify is not None and result.verify_passed is True
    assert result.verify.dropout_off == {"dropout": 1}
    first, *later = result.losses
    assert first == pytest.approx(result.verify.reference_loss, rel=1e-6)
    assert later and all(
        loss is not None and not math.isclose(loss, first, rel_tol=1e-6) for loss in later
    )


DATA_FROM_A_FILE = """
    '''dataset() reads data.txt beside this file. The ranks listed in the environment's
    EDITED_RANKS see other numbers: with EDITED_AT=loss they write them into the file at
    their first loss (every rank has read it by then: an edit during the rehearsal), with
    EDITED_AT=build they read them instead of the file (ranks that read different data).'''
    import os
    from pathlib import Path

    import torch
    import torch.nn.functional as F
    from torch import nn

    DATA = Path(__file__).with_name("data.txt")
    EDITED = " ".join(str((3 * i) % 11 - 5) for i in range(40))


    def _edited(at):
        ranks = os.environ.get("EDITED_RANKS", "").split(",")
        return os.environ.get("RANK") in ranks and os.environ.get("EDITED_AT") == at


    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 8)
            self.b = nn.Linear(8, 1)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))


    def build_model():
        return Two()


    def sample_batch(batch_size):
        return torch.randn(batch_size, 4), torch.randn(batch_size, 1)


    def dataset():
        text = EDITED if _edited("build") else DATA.read_text()
        values = [float(v) for v in text.split()]
        return [
            (torch.tensor(values[i : i + 4]), torch.tensor(values[i + 4 : i + 5]))
            for i in range(0, len(values), 5)
        ]


    def loss_fn(out, target):
        if _edited("loss"):
            DATA.write_text(EDITED)
        return F.mse_loss(out, target)
"""


def _data_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at: str) -> Plan:
    """Two one-stage replicas (4 samples each) of DATA_FROM_A_FILE; rank 0 edits the data at
    its first loss (``at="loss"``) or rank 1 reads other data (``at="build"``)."""
    (tmp_path / "data.txt").write_text(" ".join(str(i % 7 - 3) for i in range(40)))
    plan = make_plan(write_model(tmp_path, DATA_FROM_A_FILE), [ReplicaShape((-1,), 2, 4)] * 2)
    monkeypatch.setenv("EDITED_AT", at)
    monkeypatch.setenv("EDITED_RANKS", "0" if at == "loss" else "1")
    return plan


def test_verify_runs_the_reference_on_the_ranks_batch_when_the_data_changed_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `make test` failed so (gradients rel 3.5e-01, updates 0) while CHANGELOG.md, which the
    # GPT example's dataset() reads, was being edited: the reference read the new text.
    plan = _data_from_a_file(tmp_path, monkeypatch, "loss")
    result, text = _rehearse(plan)
    assert (tmp_path / "data.txt").read_text().startswith("-5 -2 1")  # rank 0 rewrote it
    verified = result.verify
    assert verified is not None and result.verify_passed is True, text
    assert verified.data_changed and verified.gradients.relative_difference < 1e-5
    assert verified.loss == pytest.approx(verified.reference_loss, rel=1e-6)
    assert "verify: the model file's step-0 batch changed after the ranks read it" in text


def test_verify_refuses_ranks_that_read_different_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _data_from_a_file(tmp_path, monkeypatch, "build")
    with pytest.raises(ConfigError, match="verify: rank 1 read other step-0 samples than rank 0"):
        _rehearse(plan)


def test_a_failed_verify_of_a_batch_norm_model_says_why_it_may_differ() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.GroupNorm(2, 4))
    assert _batch_norms(model) == ("1",)  # group norm is per sample: not listed
    worst = WorstDifference("1.bias", 0, 0.49, 1e-4, False)
    result = VerifyResult(
        gradients=worst, updates=worst, loss=None, reference_loss=1.0, dropout_off={},
        random_draws={}, passed=False, batch_norms=_batch_norms(model),
    )  # fmt: skip
    (note,) = result.notes()
    assert note.startswith("verify: the model has batch norm (1); it normalises each micro-batch")
