"""Trace through torch.nn's built-in stacks of layers, one call per layer.

A symbolic trace keeps every torch.nn module whole, so ``nn.TransformerEncoder`` (and
``nn.TransformerDecoder``, ``nn.Transformer``) would be one graph node and one partition
unit however many layers it holds. Their ``forward`` cannot be traced as written (it
branches on tensor attributes to pick an inference fast path), so :func:`stack_forward`
gives a traceable forward that does what the training path does: each layer in turn, then
the final norm. Each layer stays whole (one node), a partition unit of its own.

The masks go to the layers as given: each layer canonicalises them itself, and
``is_causal`` only hints that a mask is causal (the attention gives the same result
without the hint).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def stack_forward(module: nn.Module) -> Callable[..., Any] | None:
    """A traceable forward of a built-in stack of layers (bound to ``module``), or None
    when ``module`` is no such stack (an exact torch.nn class, not a subclass)."""
    forwards: dict[type[nn.Module], Callable[..., Any]] = {
        nn.TransformerEncoder: _encoder_forward,
        nn.TransformerDecoder: _decoder_forward,
        nn.Transformer: _transformer_forward,
    }
    forward = forwards.get(type(module))
    if forward is None:
        return None
    return lambda *args, **kwargs: forward(module, *args, **kwargs)


def _encoder_forward(
    encoder: nn.TransformerEncoder,
    src: torch.Tensor,
    mask: torch.Tensor | None = None,
    src_key_padding_mask: torch.Tensor | None = None,
    is_causal: bool | None = None,
) -> torch.Tensor:
    output = src
    for layer in encoder.layers:
        output = layer(
            output,
            src_mask=mask,
            is_causal=bool(is_causal),
            src_key_padding_mask=src_key_padding_mask,
        )
    return output if encoder.norm is None else encoder.norm(output)


def _decoder_forward(
    decoder: nn.TransformerDecoder,
    tgt: torch.Tensor,
    memory: torch.Tensor,
    tgt_mask: torch.Tensor | None = None,
    memory_mask: torch.Tensor | None = None,
    tgt_key_padding_mask: torch.Tensor | None = None,
    memory_key_padding_mask: torch.Tensor | None = None,
    tgt_is_causal: bool | None = None,
    memory_is_causal: bool = False,
) -> torch.Tensor:
    output = tgt
    for layer in decoder.layers:
        output = layer(
            output,
            memory,
            tgt_mask=tgt_mask,
            memory_mask=memory_mask,
            tgt_key_padding_mask=tgt_key_padding_mask,
            memory_key_padding_mask=memory_key_padding_mask,
            tgt_is_causal=bool(tgt_is_causal),
            memory_is_causal=memory_is_causal,
        )
    return output if decoder.norm is None else decoder.norm(output)


def _transformer_forward(
    transformer: nn.Transformer,
    src: torch.Tensor,
    tgt: torch.Tensor,
    src_mask: torch.Tensor | None = None,
    tgt_mask: torch.Tensor | None = None,
    memory_mask: torch.Tensor | None = None,
    src_key_padding_mask: torch.Tensor | None = None,
    tgt_key_padding_mask: torch.Tensor | None = None,
    memory_key_padding_mask: torch.Tensor | None = None,
    src_is_causal: bool | None = None,
    tgt_is_causal: bool | None = None,
    memory_is_causal: bool = False,
) -> torch.Tensor:
    memory = transformer.encoder(
        src, mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=src_is_causal
    )
    return transformer.decoder(  # type: ignore[no-any-return]
        tgt,
        memory,
        tgt_mask=tgt_mask,
        memory_mask=memory_mask,
        tgt_key_padding_mask=tgt_key_padding_mask,
        memory_key_padding_mask=memory_key_padding_mask,
        tgt_is_causal=tgt_is_causal,
        memory_is_causal=memory_is_causal,
    )
