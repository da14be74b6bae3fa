"""Recurrent layers costed by formula, and ops without a FLOP figure named in the notes."""

from __future__ import annotations

import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils.flop_counter import FlopCounterMode

from hplan.planner.frontend.cost_graph import ModelGraph, build_model_graph
from hplan.planner.frontend.recurrent_costs import RecurrentCosts
from hplan.runtime.capture.model_file import load_model_file

SEQ, FEATURES, HIDDEN, LAYERS = 12, 16, 24, 2


def _graph(tmp_path: Path, body: str) -> ModelGraph:
    path = tmp_path / "model.py"
    header = "import torch\nfrom torch import nn\n\n"
    path.write_text(header + textwrap.dedent(body))
    return build_model_graph(load_model_file(path))


def _recurrent_model(tmp_path: Path, cls: str, bidirectional: bool) -> ModelGraph:
    return _graph(
        tmp_path,
        f"""
        class Tagger(nn.Module):
            def __init__(self):
                super().__init__()
                self.rnn = nn.{cls}({FEATURES}, {HIDDEN}, num_layers={LAYERS},
                                    batch_first=True, bidirectional={bidirectional})
                self.head = nn.Linear({HIDDEN * (2 if bidirectional else 1)}, 3)

            def forward(self, x):
                return self.head(self.rnn(x)[0])

        def build_model():
            return Tagger()

        def sample_batch(batch_size):
            return torch.randn(batch_size, {SEQ}, {FEATURES}), torch.randn(batch_size, {SEQ}, 3)

        def loss_fn(pred, target):
            return nn.functional.mse_loss(pred, target)
        """,
    )


def _hand_flops(gates: int, bidirectional: bool) -> int:
    """Per sample: every step multiplies by W_ih (gates*hidden x input) and W_hh (gates*hidden
    x hidden) in each layer and direction, 2 FLOPs a multiply-add."""
    directions = 2 if bidirectional else 1
    total = 0
    for layer in range(LAYERS):
        inputs = FEATURES if layer == 0 else HIDDEN * directions
        total += directions * 2 * gates * HIDDEN * (inputs + HIDDEN)
    return SEQ * total


def _measured_saved_bytes_per_sample(cls: type[nn.RNNBase], bidirectional: bool) -> float:
    """What autograd really keeps for the layer on CPU tensors, per sample (two batch
    sizes, each storage once), on PyTorch's cell path (oneDNN's fused LSTM off)."""
    totals = []
    for batch_size in (2, 4):
        torch.manual_seed(0)
        rnn = cls(FEATURES, HIDDEN, num_layers=LAYERS, batch_first=True,
                  bidirectional=bidirectional)  # fmt: skip
        x = torch.randn(batch_size, SEQ, FEATURES, requires_grad=True)
        storages: dict[StorageWeakRef, int] = {}

        def pack(tensor: torch.Tensor, storages=storages) -> torch.Tensor:
            storage = tensor.untyped_storage()
            storages[StorageWeakRef(storage)] = storage.nbytes()
            return tensor

        with (
            warnings.catch_warnings(action="ignore"),  # oneDNN's TF32 notice
            torch.backends.mkldnn.flags(enabled=False),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            rnn(x)
        totals.append(sum(storages.values()))
    return (totals[1] - totals[0]) / 2


@pytest.mark.parametrize(
    ("cls", "gates", "bidirectional"),
    [("LSTM", 4, False), ("GRU", 3, True), ("RNN", 1, False)],
)
def test_a_recurrent_layer_costs_its_flops_and_the_activations_autograd_keeps(
    tmp_path, cls, gates, bidirectional
):
    graph = _recurrent_model(tmp_path, cls, bidirectional)
    rnn = next(c for c in graph.unit_costs if c.name == "rnn")
    hand = _hand_flops(gates, bidirectional)
    assert rnn.fwd_flops_per_sample == pytest.approx(hand, rel=0.25)
    measured = _measured_saved_bytes_per_sample(getattr(nn, cls), bidirectional)
    assert rnn.activation_bytes_per_sample == pytest.approx(measured, rel=0.25)
    assert not any("no FLOP figure" in note for note in graph.notes)


def test_an_op_that_computes_without_a_flop_figure_is_named_in_the_notes(tmp_path):
    graph = _graph(
        tmp_path,
        """
        class FourierMixer(nn.Module):
            def __init__(self):
                super().__init__()
                self.inp = nn.Linear(8, 8)
                self.out = nn.Linear(8, 1)

            def forward(self, x):
                mixed = torch.fft.fft2(self.inp(x).to(torch.complex64)).real
                return self.out(mixed)

        def build_model():
            return FourierMixer()

        def sample_batch(batch_size):
            return torch.randn(batch_size, 6, 8), torch.randn(batch_size, 6, 1)

        def loss_fn(pred, target):
            return nn.functional.mse_loss(pred, target)
        """,
    )
    (note,) = [n for n in graph.notes if "no FLOP figure" in n]
    assert "aten._fft_c2c" in note and "inp" in note


def test_a_packed_sequence_is_costed_by_its_real_steps_with_projections():
    lstm = nn.LSTM(FEATURES, HIDDEN, proj_size=8, batch_first=True)
    lengths = [SEQ, SEQ - 4, 3]
    packed = pack_padded_sequence(torch.randn(3, SEQ, FEATURES), lengths, batch_first=True)
    counter = FlopCounterMode(display=False)
    costs = RecurrentCosts(counter, lambda t: t)
    with counter, costs:
        lstm(packed)
    num_tokens = sum(lengths)
    weights = 4 * HIDDEN * FEATURES + 4 * HIDDEN * 8 + 8 * HIDDEN  # W_ih, W_hh, W_hr
    assert counter.get_total_flops() + costs.flops_adjustment == 2 * num_tokens * weights
    assert costs.extra_saved_bytes == num_tokens * (FEATURES + 7 * HIDDEN) * 4
