"""A GPT-style language model with a declared tensor-parallel plan, sized by the environment.

Written for ``bench/tensor_parallel.py``. Its default size is the issue's wide-head model: a
vocabulary of 200,000 over a hidden size of 8,192, so the token embedding and the untied
LM head hold 1.6B parameters each (no 12 GB card holds one with its gradient and AdamW
state), plus two transformer blocks. ``hplan solve`` builds it under a ``FakeTensorMode``, so
planning it needs no memory for the weights.

Sizes (environment, read at call time): HPLAN_WIDE_VOCAB (200000), HPLAN_WIDE_WIDTH (8192),
HPLAN_WIDE_LAYERS (2), HPLAN_WIDE_HEADS (64), HPLAN_WIDE_SEQ (1024); HPLAN_WIDE_DTYPE
(``bfloat16``) is the parameters' dtype, so weights, gradients and AdamW state are bf16
(``float32``: Megatron's fp32 master copy, 16 bytes per parameter, which 96 GB of cards
cannot hold for these 4.9B parameters with any split).

``TP_PLAN`` names the modules a tensor-parallel stage splits, in Hugging Face's
``base_model_tp_plan`` words: Megatron-LM's pairs (Shoeybi et al., 2019), the attention's
projections and the MLP split by columns then rows, the embedding by vocabulary rows, the
head by vocabulary columns with its output gathered.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

TP_PLAN = {
    "tok_emb": "rowwise",
    "blocks.*.attn.q_proj": "colwise",
    "blocks.*.attn.k_proj": "colwise",
    "blocks.*.attn.v_proj": "colwise",
    "blocks.*.attn.o_proj": "rowwise",
    "blocks.*.mlp.up": "colwise",
    "blocks.*.mlp.down": "rowwise",
    "lm_head": "colwise_rep",
}
"""Module path pattern -> split style (``runtime.contract.plan.TpStyle``)."""


def _size(name: str, default: int) -> int:
    """A model dimension from the environment, read at call time (not import time)."""
    return int(os.environ.get(f"HPLAN_WIDE_{name}", str(default)))


def vocab_size() -> int:
    return _size("VOCAB", 200_000)


def seq_len() -> int:
    return _size("SEQ", 1024)


class Attention(nn.Module):
    """Causal self-attention with separate q, k, v projections (each split by heads)."""

    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(width, width, bias=False)
        self.k_proj = nn.Linear(width, width, bias=False)
        self.v_proj = nn.Linear(width, width, bias=False)
        self.o_proj = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        head = width // self.num_heads
        q, k, v = (
            proj(x).view(batch, seq, self.num_heads, head).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, width))


class Mlp(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width, bias=False)
        self.down = nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = Attention(width, num_heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = Mlp(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class WideLM(nn.Module):
    def __init__(
        self, *, vocab: int, width: int, num_layers: int, num_heads: int, seq: int
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, width)
        self.pos_emb = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, num_heads) for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model() -> nn.Module:
    model = WideLM(
        vocab=vocab_size(),
        width=_size("WIDTH", 8192),
        num_layers=_size("LAYERS", 2),
        num_heads=_size("HEADS", 64),
        seq=seq_len(),
    )
    return model.to(getattr(torch, os.environ.get("HPLAN_WIDE_DTYPE", "bfloat16")))


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab_size(), (batch_size, seq_len() + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
