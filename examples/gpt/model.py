"""A GPT-2-style decoder, sized to rehearse in about a minute on two CPU cores.

Model-file convention (see README): build_model, sample_batch, loss_fn, optional
make_optimizer, dataset and TP_PLAN. Sizes can be changed with environment variables so the same
file serves the demo, the tests and the benchmarks:

    HPLAN_GPT_LAYERS (4), HPLAN_GPT_WIDTH (64), HPLAN_GPT_HEADS (4), HPLAN_GPT_SEQ (64),
    HPLAN_GPT_VOCAB (256)

and the outer optimizer of local SGD across islands: HPLAN_GPT_OUTER_LR (0.7) and
HPLAN_GPT_OUTER_MOMENTUM (0.9), DiLoCo's; 1 and 0 are plain averaging.

GPT-2 124M is LAYERS=12 WIDTH=768 HEADS=12 SEQ=1024 VOCAB=50257. The vocabulary is bytes
(256 tokens) by default; dataset() trains on the text files shipped with hplan (the
Markdown files at the top of the repository and the example model files, in windows that
start every half window), so no download is needed (with a larger vocabulary its token ids
stay below 256).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

VOCAB_SIZE = 256
"""The default vocabulary: bytes."""
OUTER_LR = float(os.environ.get("HPLAN_GPT_OUTER_LR", "0.7"))
OUTER_MOMENTUM = float(os.environ.get("HPLAN_GPT_OUTER_MOMENTUM", "0.9"))


TP_PLAN = {
    "tok_emb": "rowwise_rep",
    "blocks.*.mlp.0": "colwise",
    "blocks.*.mlp.2": "rowwise",
    "lm_head": "colwise_rep",
}
"""The tensor-parallel plan (README: What you give it): the embedding split by vocabulary
(its partial lookups summed), each MLP as Megatron's column/row pair (one all-reduce
forward, one backward per block) and the LM head by vocabulary, gathered; the head's
weight is the embedding's (tied), split by rows both ways. Attention stays whole on every
member: its fused ``qkv`` output is ``split(width)`` into q, k and v, so a column split of
its weight would give a member a slice of [q; k; v] instead of whole heads (and the view
into heads would need every slice)."""


def _size(name: str, default: int) -> int:
    """A model dimension from the environment, read at call time (not import time)."""
    return int(os.environ.get(f"HPLAN_GPT_{name}", str(default)))


def vocab_size() -> int:
    return _size("VOCAB", VOCAB_SIZE)


def seq_len() -> int:
    return _size("SEQ", 64)


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        head = width // self.num_heads
        q = q.view(batch, seq, self.num_heads, head).transpose(1, 2)
        k = k.view(batch, seq, self.num_heads, head).transpose(1, 2)
        v = v.view(batch, seq, self.num_heads, head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, num_heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _init_weights(module: nn.Module) -> None:
    """GPT-2 initialisation: weights N(0, 0.02), biases zero."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class GPT(nn.Module):
    def __init__(
        self, num_layers: int, width: int, num_heads: int, seq_len: int, vocab: int = VOCAB_SIZE
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, width)
        self.pos_emb = nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(Block(width, num_heads) for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied, as in GPT-2
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model() -> nn.Module:
    return GPT(_size("LAYERS", 4), _size("WIDTH", 64), _size("HEADS", 4), seq_len(), vocab_size())


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab_size(), (batch_size, seq_len() + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)


class _ByteWindows(torch.utils.data.Dataset):
    """Windows of seq_len + 1 bytes starting every half window (so the shipped text gives
    enough samples for a global batch of 2048); item = (input ids, next-byte targets)."""

    def __init__(self, data: bytes, length: int) -> None:
        self.tokens = torch.tensor(list(data), dtype=torch.long)
        self.length = length
        self.stride = max(1, length // 2)

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1 - self.length) // self.stride + 1)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = idx * self.stride
        window = self.tokens[start : start + self.length + 1]
        return window[:-1], window[1:]


def dataset() -> torch.utils.data.Dataset:
    root = Path(__file__).resolve().parents[2]
    files = sorted(root.glob("*.md")) + sorted((root / "examples").rglob("*.py"))
    data = b"\n".join(f.read_bytes() for f in files)
    return _ByteWindows(data, seq_len())
