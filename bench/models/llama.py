"""A Hugging Face Llama built from its config (random weights, nothing downloaded).

Written for ``bench/tensor_parallel.py``. ``HPLAN_LLAMA_PRESET`` picks the shape:
``tinyllama-1.1b`` (hidden 2048, 22 layers, 32 heads, 4 KV heads, intermediate 5632, seq
2048), ``llama-13b`` (5120, 40, 40, 40, 13824, seq 4096) or ``llama-70b`` (8192, 80, 64, 8,
28672, seq 4096); vocabulary 32,000 in each. ``HPLAN_LLAMA_DTYPE`` (``float32``, the
default, or ``bfloat16``) is the parameters' dtype: under bf16 autocast a float32 model keeps
fp32 weights, gradients and AdamW state (Megatron's mixed precision); ``bfloat16`` keeps
all of them in bf16. The tensor-parallel plan is the model's own (``base_model_tp_plan``).
``hplan solve`` builds it under a ``FakeTensorMode``, so planning a 70B model needs no
memory for its weights.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB_SIZE = 32_000

PRESETS = {
    "tinyllama-1.1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "intermediate_size": 5632,
        "seq": 2048,
    },
    "llama-13b": {
        "hidden_size": 5120,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 40,
        "intermediate_size": 13824,
        "seq": 4096,
    },
    "llama-70b": {
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
        "seq": 4096,
    },
}
"""Shapes by name: Llama-2 13B and 70B, TinyLlama 1.1B (their published configs)."""


def _preset() -> dict[str, int]:
    name = os.environ.get("HPLAN_LLAMA_PRESET", "tinyllama-1.1b")
    if name not in PRESETS:
        raise ValueError(f"HPLAN_LLAMA_PRESET {name!r} is not one of {', '.join(PRESETS)}")
    return PRESETS[name]


def seq_len() -> int:
    return _preset()["seq"]


def build_model() -> nn.Module:
    shape = {k: v for k, v in _preset().items() if k != "seq"}
    config = LlamaConfig(
        **shape,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=seq_len(),
        use_cache=False,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    dtype = getattr(torch, os.environ.get("HPLAN_LLAMA_DTYPE", "float32"))
    return model.to(dtype)


def sample_batch(batch_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    tokens = torch.randint(0, VOCAB_SIZE, (batch_size, seq_len() + 1))
    return {"input_ids": tokens[:, :-1]}, tokens[:, 1:]


def loss_fn(outputs, targets: torch.Tensor) -> torch.Tensor:
    logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
    return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE).float(), targets.reshape(-1))
