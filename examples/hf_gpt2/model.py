"""A Hugging Face ``transformers`` GPT-2 (randomly initialised, nothing downloaded).

Model-file convention (see README): build_model, sample_batch, loss_fn. Needs the ``hf``
extra (``pip install hplan[hf]``). ``torch.fx.symbolic_trace`` cannot trace modern Hugging
Face models, so hplan falls back to ``torch.export`` and says so in the plan's notes.

Dropout is off so that a pipelined run reproduces a single-process step exactly; turn it
back on (``resid_pdrop`` and friends) for real training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB_SIZE = 256
SEQ_LEN = 32


def build_model() -> nn.Module:
    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=2,
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def sample_batch(batch_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    tokens = torch.randint(0, VOCAB_SIZE, (batch_size, SEQ_LEN + 1))
    return {"input_ids": tokens[:, :-1]}, tokens[:, 1:]


def loss_fn(outputs, targets: torch.Tensor) -> torch.Tensor:
    logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
    return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))
