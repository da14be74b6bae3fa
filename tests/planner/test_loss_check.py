"""The trains check's loss convention (``frontend/trains_check.loss_convention``): a summed
loss refused at solve time in one line, a token mean over padded labels recorded in the
plan and its summary, a model's own loss over padded labels refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from hplan.planner.cli.main import main
from hplan.planner.frontend.capture import capture_model
from hplan.planner.frontend.trains_check import check_trains
from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.contract.errors import ModelFileError
from hplan.runtime.contract.plan import LossConvention, Plan
from tests.fixtures.plans import write_model

CLUSTER = Path(__file__).resolve().parents[2] / "examples" / "clusters" / "cpu-rehearsal.yaml"

TOKENS = """
    import torch
    import torch.nn.functional as F
    from torch import nn

    VOCAB, SEQ = 16, 6


    def build_model():
        return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))


    def sample_batch(batch_size):
        tokens = torch.randint(0, VOCAB, (batch_size, SEQ))
        labels = torch.randint(0, VOCAB, (batch_size, SEQ))
        labels[:, SEQ // 2 :] = -100
        return tokens, labels


    def loss_fn(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(){reduction})
"""


def _verdict(tmp_path: Path, source: str):
    return check_trains(capture_model(load_model_file(write_model(tmp_path, source))))


def test_a_summed_loss_is_refused_at_solve_time_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_model(tmp_path, TOKENS.replace("{reduction}", ', reduction="sum"'))
    with pytest.raises(SystemExit) as exit_info:
        main(["solve", str(path), "-c", str(CLUSTER), "-b", "8", "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "returns a sum over the samples it is given" in err and "return a mean" in err


def test_a_token_mean_is_recorded_in_the_plan_and_its_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_model(tmp_path, TOKENS.replace("{reduction}", ""))
    with pytest.raises(SystemExit) as exit_info:
        main(["solve", str(path), "-c", str(CLUSTER), "-b", "8", "-o", str(tmp_path / "out")])
    assert exit_info.value.code == 0
    plan = Plan.load(tmp_path / "out" / "plan.json")
    assert plan.model.loss_convention is LossConvention.TOKEN_MEAN
    summary = (tmp_path / "out" / "summary.txt").read_text(encoding="utf-8")
    assert "loss       a mean over target tokens (not -100)" in summary


def test_a_per_sample_mean_is_the_default_and_needs_no_note(tmp_path: Path) -> None:
    verdict = _verdict(tmp_path, TOKENS.replace("labels[:, SEQ // 2 :] = -100", "").replace(
        "labels.flatten(){reduction})", "labels.flatten(), reduction='none').mean()"
    ))  # fmt: skip
    assert verdict.loss_convention is LossConvention.SAMPLE_MEAN and verdict.notes == ()


MODELS_OWN_LOSS = """
    import torch
    import torch.nn.functional as F
    from torch import nn


    class WithLoss(nn.Module):
        '''Returns its own loss, a mean over labels other than -100 (as HF models do).'''

        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

        def forward(self, input_ids, labels):
            logits = self.head(self.emb(input_ids))
            return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


    def sample_batch(batch_size):
        labels = torch.randint(0, 16, (batch_size, 6))
        labels[:, 3:] = {pad}
        return {"input_ids": torch.randint(0, 16, (batch_size, 6)), "labels": labels}, None


    def build_model():
        return WithLoss()


    def loss_fn(outputs, targets):
        return outputs["loss"]
"""


def test_a_models_own_loss_over_padded_labels_is_refused_with_what_to_write(
    tmp_path: Path,
) -> None:
    with pytest.raises(ModelFileError, match="returns the model's own loss") as error:
        _verdict(tmp_path, MODELS_OWN_LOSS.replace("{pad}", "-100"))
    assert "give the labels as targets" in str(error.value) and error.value.exit_code == 2
    verdict = _verdict(tmp_path, MODELS_OWN_LOSS.replace("{pad}", "7"))
    assert verdict.loss_convention is LossConvention.SAMPLE_MEAN
    assert any("own loss, not checked" in note for note in verdict.notes)
