"""What fused scaled-dot-product attention costs on a GPU: FLOPs and the bytes it saves.

On CUDA, ``torch.nn.functional.scaled_dot_product_attention`` runs a fused kernel
(FlashAttention, memory-efficient or cuDNN attention) that saves for the backward its inputs
``q``, ``k``, ``v`` (and ``attn_mask``), its output and one float32 log-sum-exp per query
row and head, and recomputes the (seq_q x seq_k) attention matrix instead of keeping it.
The math path that the meta device (and the CPU, with dropout) takes keeps that matrix, so
:class:`FusedAttentionCosts` records the fused kernels' saved tensors and FLOPs instead,
whatever kernel really ran (the CPU's flash kernel has no formula in ``FlopCounterMode``).

Sources: Dao et al., FlashAttention (2022), section 3.1; PyTorch's
``aten._scaled_dot_product_flash_attention`` returns ``logsumexp`` of shape
``(batch, heads, seq_q)``, float32; FLOPs: ``torch.utils.flop_counter.sdpa_flop_count``
(the two matmuls, ``4 * batch * heads * seq_q * seq_k * head_dim``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

ATTENTION_FUNCTIONS = (
    F.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
)
"""The calls costed as fused attention: the functional (eager code, symbolic traces) and
the aten op (``torch.export`` graphs)."""

LOGSUMEXP_BYTES = 4
"""Bytes of one saved log-sum-exp (float32, whatever the input dtype)."""


def attention_flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> int:
    """Forward FLOPs of attention of ``query`` ``(..., heads, seq_q, head_dim)`` over ``key``
    and ``value`` ``(..., kv_heads, seq_k, head_dim)`` (kv_heads divides heads: GQA).

    Leading dimensions fold into heads; formula: ``sdpa_flop_count`` (see the module
    docstring).
    """
    q_rows, k_rows = math.prod(query.shape[:-2]), math.prod(key.shape[:-2])
    return int(
        sdpa_flop_count(
            (1, q_rows, query.shape[-2], query.shape[-1]),
            (1, k_rows, key.shape[-2], key.shape[-1]),
            (1, k_rows, value.shape[-2], value.shape[-1]),
        )
    )


def logsumexp_bytes(query: torch.Tensor) -> int:
    """Bytes of the log-sum-exp a fused kernel saves for ``query`` ``(..., seq_q, head_dim)``:
    one float32 per query row and head."""
    return math.prod(query.shape[:-1]) * LOGSUMEXP_BYTES


class FormulaCosts(TorchFunctionMode):
    """A mode that costs some calls by formula: what the FLOP counter counts inside them is
    replaced (:attr:`flops_adjustment`), and what they save is passed to ``pack`` or added
    as :attr:`extra_saved_bytes`.

    Args:
        counter: the active FLOP counter.
        pack: the caller's saved-tensor hook.
    """

    def __init__(self, counter: FlopCounterMode, pack: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self._counter = counter
        self._pack = pack
        self.flops_adjustment = 0
        """FLOPs to add to the counter's total: formula minus what it counted in the calls."""
        self.extra_saved_bytes = 0
        """Saved bytes that are no tensor of the graph."""


class FusedAttentionCosts(FormulaCosts):
    """Cost every attention call as the fused CUDA kernels do (see the module docstring).

    Args:
        counter: the active FLOP counter; what it counts inside an attention call is
            replaced by :func:`attention_flops` through :attr:`flops_adjustment`.
        pack: called with each tensor the fused kernel saves (the caller's saved-tensor
            hook); the kernel that really runs saves nothing through it.
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in ATTENTION_FUNCTIONS:
            return func(*args, **kwargs)
        query, key, value = args[:3]
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        counted_before = self._counter.get_total_flops()
        with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):  # shadows the caller's
            output = func(*args, **kwargs)
        counted = self._counter.get_total_flops() - counted_before
        self.flops_adjustment += attention_flops(query, key, value) - counted
        if isinstance(output, torch.Tensor) and output.requires_grad:
            for tensor in (query, key, value, mask, output):
                if isinstance(tensor, torch.Tensor):
                    self._pack(tensor)
            self.extra_saved_bytes += logsumexp_bytes(query)
        return output


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
