"""GPT-2 124M (Hugging Face ``transformers``, ``GPT2Config()``'s defaults: 12 layers, width
768, 12 heads, 50,257 tokens, 1,024-token context; random weights, nothing downloaded).

Written for ``bench/slow_link_plans.py``. Dropout is off (as in ``examples/hf_gpt2``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

SEQ_LEN = 1024


def build_model() -> nn.Module:
    config = GPT2Config(
        use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, n_positions=SEQ_LEN
    )
    return GPT2LMHeadModel(config)


def sample_batch(batch_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    tokens = torch.randint(0, GPT2Config().vocab_size, (batch_size, SEQ_LEN + 1))
    return {"input_ids": tokens[:, :-1]}, tokens[:, 1:]


def loss_fn(outputs, targets: torch.Tensor) -> torch.Tensor:
    logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
