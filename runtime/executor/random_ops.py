"""Random operations of a model's step: dropout turned off, other random draws found.

``rehearse --verify`` compares one distributed step with one process on the whole global
batch. Dropout draws its masks per micro-batch on each rank, in another order and shape
than one process drawing them for the whole batch, so no seed makes the two agree: for the
verified step only, both runs set every dropout probability to 0 (:class:`DropoutOff`, a
``torch.overrides.TorchFunctionMode`` that sees the dropout calls of eager code, including
``nn.MultiheadAttention`` and ``F.scaled_dot_product_attention``'s ``dropout_p``, and of
traced graphs). A forward that draws other random numbers (``torch.randn``, ``F.rrelu``,
...) is found by :class:`RandomDraws`; ``verify`` names them, since it cannot make them
agree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten

_DROPOUT_ARGUMENTS: dict[Callable[..., Any], tuple[int, str]] = {
    F.dropout: (1, "p"),
    F.dropout1d: (1, "p"),
    F.dropout2d: (1, "p"),
    F.dropout3d: (1, "p"),
    F.alpha_dropout: (1, "p"),
    F.feature_alpha_dropout: (1, "p"),
    torch.dropout: (1, "p"),
    torch.alpha_dropout: (1, "p"),
    torch.feature_dropout: (1, "p"),
    torch.feature_alpha_dropout: (1, "p"),
    _aten.dropout.default: (1, "p"),
    _aten.native_dropout.default: (1, "p"),
    _aten.alpha_dropout.default: (1, "p"),
    _aten.feature_dropout.default: (1, "p"),
    _aten.feature_alpha_dropout.default: (1, "p"),
    F.scaled_dot_product_attention: (4, "dropout_p"),
    _aten.scaled_dot_product_attention.default: (4, "dropout_p"),
    F.multi_head_attention_forward: (10, "dropout_p"),
}
"""Function -> (position, keyword) of its dropout probability."""


def _name(func: Any) -> str:
    return str(getattr(func, "__name__", func))


class DropoutOff(TorchFunctionMode):
    """Run every dropout with probability 0 inside ``with DropoutOff():``.

    After the block, :attr:`calls` counts the dropout calls whose probability was above 0,
    by function name (e.g. ``{"dropout.default": 5, "scaled_dot_product_attention.default":
    2}``); empty when the model has no active dropout.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        where = _DROPOUT_ARGUMENTS.get(func)
        if where is None:
            return func(*args, **kwargs)
        position, keyword = where
        if keyword in kwargs:
            probability, kwargs[keyword] = kwargs[keyword], 0.0
        elif len(args) > position:
            probability = args[position]
            args = (*args[:position], 0.0, *args[position + 1 :])
        else:  # the default: F.dropout's 0.5; attention's 0
            probability, kwargs[keyword] = (0.0 if keyword == "dropout_p" else 0.5), 0.0
        if probability:
            self.calls[_name(func)] += 1
        return func(*args, **kwargs)


class RandomDraws(TorchDispatchMode):
    """Record the random operators run inside ``with RandomDraws():``.

    :attr:`calls` counts every ATen operator tagged ``torch.Tag.nondeterministic_seeded``
    (``randn``, ``bernoulli_``, ``rrelu_with_noise``, ...) that draws, by name
    (``aten.randn.default``); an attention kernel at ``dropout_p`` 0 draws nothing.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags and _draws(func, args, kwargs):
            self.calls[str(func)] += 1
        return func(*args, **kwargs)


def _draws(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether a seeded operator draws here: attention kernels are seeded for their
    ``dropout_p``, and draw nothing at 0."""
    names = [argument.name for argument in func._schema.arguments]
    if "dropout_p" not in names:
        return True
    position = names.index("dropout_p")
    probability = kwargs.get("dropout_p", args[position] if len(args) > position else 0.0)
    return bool(probability)
