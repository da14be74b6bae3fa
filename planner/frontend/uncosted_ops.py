"""Name the ops that compute but that the cost model has no FLOP figure for.

FLOPs come from ``torch.utils.flop_counter``'s formulas (matmuls, convolutions, attention)
and this package's own (``attention_costs.py``, ``recurrent_costs.py``); every other op is
charged by the bytes it moves, right for elementwise work and normalisation, wrong for an
op that multiplies matrices without a formula (an FFT, a linear solve; ``moe.py`` gives
grouped matmuls theirs). :class:`UncostedOps` records such ops as they run, so the
plan's notes name them instead of costing them as nearly free.
"""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from hplan.planner.frontend.moe import moe_flop_formulas

_MATRIX_WORDS = ("mm", "bmm", "addmm", "addbmm", "baddbmm", "mv", "addmv", "matmul", "einsum")
_SOLVER_WORDS = ("tensordot", "bilinear", "cdist", "cholesky", "linalg", "svd", "qr", "lu", "eig")
_LAYER_WORDS = (
    "fft",
    "convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "rnn",
    "lstm",
    "gru",
    "attention",
)
_COMPUTE_WORDS = frozenset((*_MATRIX_WORDS, *_SOLVER_WORDS, *_LAYER_WORDS))
"""Words (between underscores) of an aten op's name that mark compute-bound work."""

_COSTED_ELSEWHERE = frozenset(
    (
        "mkldnn_rnn_layer",
        "_cudnn_rnn",
        "miopen_rnn",
        "_thnn_fused_lstm_cell",
        "_thnn_fused_gru_cell",
        "lstm_cell",
        "gru_cell",
        "rnn_tanh_cell",
        "rnn_relu_cell",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_fused_attention_overrideable",
    )
)
"""Kernels that run inside a call costed by formula (``recurrent_costs.py``,
``attention_costs.py``)."""


def _formulas() -> frozenset[str]:
    """The ops with a FLOP formula now (transformers registers its ops when imported)."""
    return frozenset(str(op) for op in (*flop_registry, *moe_flop_formulas()))


def lacks_flop_figure(op_name: str, formulas: frozenset[str] | None = None) -> bool:
    """Whether an op (its overload packet's name: ``aten._fft_c2c``) computes but has
    no FLOP formula here (see the module docstring); ``formulas``: :func:`_formulas`."""
    name = op_name.removeprefix("aten.")
    if op_name in (formulas or _formulas()) or name in _COSTED_ELSEWHERE:
        return False
    return any(word in _COMPUTE_WORDS for word in name.split("_"))


class UncostedOps(TorchDispatchMode):
    """Records (:attr:`names`) every op that runs and :func:`lacks_flop_figure`."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self._formulas = _formulas()
        self._seen: set[Any] = set()
        """The ops already judged (each op's name is worked out once, not per call)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func not in self._seen:
            self._seen.add(func)
            name = str(getattr(func, "overloadpacket", func))
            if lacks_flop_figure(name, self._formulas) and name not in self.names:
                self.names.append(name)
        return func(*args, **(kwargs or {}))
