"""What a recurrent layer (``nn.RNN``, ``nn.LSTM``, ``nn.GRU``) costs: FLOPs and saved bytes.

A recurrent layer runs as one fused kernel (cuDNN, oneDNN; on fake tensors oneDNN's meta
kernel, whose workspace is empty) that ``FlopCounterMode`` has no formula for: uncorrected,
it costs nothing. :class:`RecurrentCosts` charges each call by formula instead.

FLOPs: each step multiplies every sample by every weight matrix of every layer and
direction once (the cell equations in torch.nn's ``LSTM``/``GRU``/``RNN`` documentation),
``2 * num_weight_matrix_elements`` per step and sample; elementwise gate work is not counted.
Saved bytes, per step, sample, layer and direction: the layer's input and
:data:`SAVED_HIDDEN_VECTORS` hidden-size vectors, what autograd keeps on PyTorch's own cell
path (``_thnn_fused_lstm_cell`` in ``tools/autograd/derivatives.yaml``: the 4-gate
workspace, ``cx``, ``cy``, the previous hidden state). oneDNN's CPU LSTM keeps more.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hplan.planner.frontend.attention_costs import FormulaCosts

_VF = torch._C._VariableFunctions
_aten = torch.ops.aten

NUM_GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}
"""Gates per cell (rows of ``W_ih`` over the hidden size)."""
SAVED_HIDDEN_VECTORS = {"lstm": 7, "gru": 7, "rnn_tanh": 1, "rnn_relu": 1}
"""Hidden-size vectors saved per step, sample, layer and direction (besides the layer's
input); see the module docstring."""

_CELLS = {
    **{getattr(_VF, kind): kind for kind in NUM_GATES},
    **{getattr(_aten, kind).input: kind for kind in NUM_GATES},
    **{getattr(_aten, kind).data: kind for kind in NUM_GATES},
}
"""The calls costed here: the functions ``nn.RNNBase.forward`` calls (eager code, symbolic
traces) and the aten ops of ``torch.export`` graphs, padded (``.input``) or packed
(``.data``) sequences."""


def recurrent_flops(params: Sequence[torch.Tensor], num_tokens: int) -> int:
    """Forward FLOPs of a recurrent layer over ``num_tokens`` (steps x samples).

    Args:
        params: the layer's flat weights (``nn.RNNBase._flat_weights``); every 2-D one is
            a weight matrix used once per step and sample.
        num_tokens: steps times samples (a packed sequence's total length).
    """
    return 2 * num_tokens * sum(p.numel() for p in params if p.dim() == 2)


def recurrent_saved_bytes(kind: str, params: Sequence[torch.Tensor], num_tokens: int) -> int:
    """Bytes a recurrent layer keeps for the backward over ``num_tokens`` (see the module
    docstring), in the weights' dtype.

    Args:
        kind: ``lstm``, ``gru``, ``rnn_tanh`` or ``rnn_relu``.
        params: the flat weights in ``nn.RNNBase`` order: per layer and direction ``W_ih``
            (``(gates * hidden, input)``), ``W_hh``, the two biases if any, ``W_hr`` if
            the LSTM has projections.
    """
    if not params:
        return 0
    gates = NUM_GATES[kind]
    hidden = params[0].shape[0] // gates
    per_group = 2 + sum(1 for p in params[2:5] if p.dim() == 1)
    if kind == "lstm" and params[1].shape[1] != hidden:  # W_hh reads the projection
        per_group += 1
    elements = sum(w.shape[1] + SAVED_HIDDEN_VECTORS[kind] * hidden for w in params[::per_group])
    return num_tokens * elements * params[0].element_size()


class RecurrentCosts(FormulaCosts):
    """Cost every recurrent-layer call by formula (see the module docstring).

    Args:
        counter: the active FLOP counter; what it counts inside a call is replaced by
            :func:`recurrent_flops` through :attr:`flops_adjustment`.
        pack: the caller's saved-tensor hook; the kernel that really runs saves nothing
            through it, its output is kept as the layer's.
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        kind = _CELLS.get(func)
        if kind is None:
            return func(*args, **kwargs)
        data, params = args[0], _flat_weights(args)
        counted_before = self._counter.get_total_flops()
        with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):  # shadows the caller's
            output = func(*args, **kwargs)
        counted = self._counter.get_total_flops() - counted_before
        num_tokens = _num_tokens(args)
        self.flops_adjustment += recurrent_flops(params, num_tokens) - counted
        if torch.is_grad_enabled() and any(p.requires_grad for p in (data, *params)):
            self.extra_saved_bytes += recurrent_saved_bytes(kind, params, num_tokens)
        return output


def _is_packed(args: Sequence[Any]) -> bool:
    """A packed sequence's call: (data, batch_sizes, hx, weights, ...); a padded one's
    fourth argument is ``has_biases``."""
    return isinstance(args[3], (list, tuple))


def _flat_weights(args: Sequence[Any]) -> list[torch.Tensor]:
    """The weights argument: third of a padded call, fourth of a packed one."""
    return list(args[3] if _is_packed(args) else args[2])


def _num_tokens(args: Sequence[Any]) -> int:
    """Steps times samples: every row of a packed sequence, else all but the features."""
    data = args[0]
    if _is_packed(args):
        return int(data.shape[0])
    return int(data.numel() // data.shape[-1]) if data.dim() else 0


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
