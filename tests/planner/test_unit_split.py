"""Units small enough to place: torch.nn's stacks of layers and oversized blocks split."""

from __future__ import annotations

import torch
from torch import nn

from hplan.planner.frontend.partition_units import _default_limit, assign_units
from hplan.runtime.capture.cuts import node_units
from hplan.runtime.capture.trace import TracedModel, trace_model

WIDTH, VOCAB, SEQ = 16, 40, 6


def _units(model: nn.Module, inputs: dict[str, torch.Tensor], **kwargs):
    traced = trace_model(model, inputs)
    every = {n.name for n in traced.graph_module.graph.nodes if n.op != "output"}
    units, notes = assign_units(traced, every, **kwargs)
    node_units(traced.graph_module, units)  # each node in exactly one unit
    return traced, [u.name for u in units], notes


def _same_output(traced: TracedModel, model: nn.Module, *inputs: torch.Tensor) -> None:
    torch.testing.assert_close(traced.graph_module(*inputs), model(*inputs))


class EncoderLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(
            layer, 4, norm=nn.LayerNorm(WIDTH), enable_nested_tensor=False
        )
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.encoder(self.emb(tokens), mask=mask, is_causal=True))


def test_a_transformer_encoder_is_one_unit_per_layer():
    torch.manual_seed(0)
    model = EncoderLM()
    tokens = torch.randint(0, VOCAB, (3, SEQ))
    traced, names, _ = _units(model, {"tokens": tokens})
    layers = [f"encoder.layers.{i}" for i in range(4)]
    assert names == ["emb", *layers, "encoder.norm", "head"]
    _same_output(traced, model, tokens)


class Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Transformer(
            WIDTH, 2, num_encoder_layers=2, num_decoder_layers=3, dim_feedforward=32,
            dropout=0.0, batch_first=True,
        )  # fmt: skip
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.head(self.transformer(src, tgt))


def test_a_transformer_splits_into_its_encoder_and_decoder_layers():
    torch.manual_seed(0)
    model = Seq2Seq()
    src, tgt = torch.randn(3, SEQ, WIDTH), torch.randn(3, SEQ - 2, WIDTH)
    traced, names, _ = _units(model, {"src": src, "tgt": tgt})
    encoder = [f"transformer.encoder.layers.{i}" for i in range(2)]
    decoder = [f"transformer.decoder.layers.{i}" for i in range(3)]
    assert [n for n in names if "layers" in n] == [*encoder, *decoder]
    _same_output(traced, model, src, tgt)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))  # x crosses a cut between fc1 and fc2


class OneHugeBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.big = Block(width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.big(self.stem(x)))


def test_a_block_too_large_to_place_is_split_into_its_children():
    # 2 x 12000^2 fp32 weights: 1.15 GB, 99% of the model (built on meta: no memory)
    with torch.device("meta"):
        model = OneHugeBlock(12_000)
    _, names, notes = _units(model, {"x": torch.empty(2, 8, device="meta")})
    assert names == ["stem", "big.fc1", "big.fc2", "head"]
    (note,) = notes
    assert "split unit big (1.2 GB of parameters, 100% of the model)" in note


def test_a_large_block_in_a_small_model_stays_whole():
    _, names, notes = _units(OneHugeBlock(64), {"x": torch.randn(2, 8)})
    assert names == ["stem", "big", "head"]
    assert notes == ()


class Stacked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ModuleList([Block(WIDTH), Block(WIDTH)])
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.inner:
            x = block(x)
        return self.proj(x)


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, WIDTH)
        self.up = nn.ModuleList([Stacked(), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for module in self.up:
            x = module(x)
        return x


def test_a_split_block_splits_the_lists_it_holds_into_their_entries():
    model = Wrapper()
    stacked_bytes = sum(p.numel() * 4 for p in model.up[0].parameters())
    x = torch.randn(2, 8)
    traced, names, notes = _units(model, {"x": x}, max_unit_param_bytes=stacked_bytes - 1)
    assert names == ["stem", "up.0.inner.0", "up.0.inner.1", "up.0.proj", "up.1", "up.2"]
    assert len(notes) == 1 and "split unit up.0 " in notes[0]
    _same_output(traced, model, x)


def test_a_block_of_a_third_of_an_sd15_unet_is_split_and_gpt2s_embedding_stays_whole():
    """SD 1.5's UNet holds 3.44 GB of fp32 parameters, its ``up_blocks.1`` 1.03 GB (30%):
    whole, no cut of the model between a 12 GB and an 11 GB card fits both (issue 38).
    GPT-2 124M (498 MB) keeps its 154 MB embedding whole (it has no children anyway) and
    every block: models under 2 GiB of parameters are not split."""
    unet = {"": 3_438_000_000, "up_blocks.1": 1_030_000_000, "up_blocks.2": 290_000_000}
    assert _default_limit(unet) < unet["up_blocks.1"]
    assert _default_limit(unet) > unet["up_blocks.2"]
    gpt2 = {"": 497_800_000, "transformer.wte": 154_400_000}
    assert _default_limit(gpt2) > gpt2["transformer.wte"]
