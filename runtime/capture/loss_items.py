"""What ``loss_fn`` averages over, checked on a few real numbers, and the items it counts.

The runtime sums the micro-batches' losses, each weighted so that they add up to the
global batch's loss: by samples when ``loss_fn`` is a per-sample mean, by target tokens
when it is a mean over the targets that are not ``-100`` (padded labels; transformers'
``num_items_in_batch`` convention). A summed loss grows with the batch, so the weights would
be wrong whatever they are. The check calls ``loss_fn`` on a tiny batch and on its parts and
asks which weighting of the parts gives the whole (it pads half of the first sample's
integer targets with ``-100`` first, where ``loss_fn`` accepts that, so that the two means
differ); the model is not run (its outputs are random tensors of their shapes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves, tree_map

from hplan.runtime.contract.plan import LossConvention

IGNORE_INDEX = -100
"""The target value a token-mean loss leaves out (``cross_entropy``'s default
``ignore_index``, transformers' label padding)."""

_MATCH_RTOL = 1e-4
"""How close a weighting of the parts' losses must come to the whole batch's loss (float32
losses of a few elements: the same sums in another order)."""


class LossFound(StrEnum):
    """What the check found ``loss_fn`` to be."""

    SAMPLE_MEAN = "sample_mean"
    TOKEN_MEAN = "token_mean"
    SUM = "sum"
    OTHER = "other"


@dataclass(frozen=True)
class LossCheck:
    """The check's finding, and the loss values behind it (for messages)."""

    found: LossFound
    whole: float
    """``loss_fn`` on the whole check batch."""
    parts_sum: float
    """The sum of ``loss_fn`` on its parts."""

    @property
    def convention(self) -> LossConvention:
        """How the runtime weights micro-batches: by tokens for a token mean, else by
        samples (a sum is refused before this matters; an unknown loss gets a note)."""
        if self.found is LossFound.TOKEN_MEAN:
            return LossConvention.TOKEN_MEAN
        return LossConvention.SAMPLE_MEAN


def count_items(targets: Any) -> int:
    """The elements of ``targets``' integer tensors that are not :data:`IGNORE_INDEX`: what a
    token-mean loss averages over (``labels.ne(-100).sum()``, as transformers counts
    ``num_items_in_batch``)."""
    return sum(
        int((t != IGNORE_INDEX).sum())
        for t in tree_leaves(targets)
        if isinstance(t, Tensor) and not t.is_floating_point() and t.dtype != torch.bool
    )


def slice_samples(value: Any, start: int, stop: int) -> Any:
    """Samples ``[start, stop)`` (dim 0) of every tensor in a nested structure."""
    return tree_map(lambda x: x[start:stop] if isinstance(x, Tensor) else x, value)


def random_like(value: Any, seed: int = 0) -> Any:
    """Real tensors of ``value``'s tensors' shapes and dtypes (fake or meta ones too): floats
    drawn from N(0, 1), other dtypes zero; other leaves kept."""
    generator = torch.Generator().manual_seed(seed)

    def real(x: Any) -> Any:
        if not isinstance(x, Tensor):
            return x
        if x.is_floating_point():
            return torch.randn(tuple(x.shape), dtype=x.dtype, generator=generator)
        return torch.zeros(tuple(x.shape), dtype=x.dtype)

    return tree_map(real, value)


def check_loss_convention(
    loss_fn: Callable[[Any, Any], Tensor], outputs: Any, targets: Any
) -> LossCheck:
    """Which weighting of ``loss_fn``'s values on parts of a batch gives its value on the
    whole batch.

    Args:
        loss_fn: the model file's ``loss_fn``.
        outputs: real model outputs (or random ones of their shapes), samples in dim 0.
        targets: real targets of the same samples, samples in dim 0; at least 2 samples.

    Returns:
        SAMPLE_MEAN when the whole is the parts weighted by samples, else TOKEN_MEAN when by
        their non-``-100`` integer target elements, else SUM when it is their sum, else
        OTHER.

    Raises:
        Exception: whatever ``loss_fn`` raises on the unpadded batch.
    """
    padded = _padded(targets)
    if padded is not None:
        try:
            return _classify(loss_fn, outputs, padded)
        except Exception:  # a loss that reads targets as indices: check it unpadded
            pass
    return _classify(loss_fn, outputs, targets)


def _classify(loss_fn: Callable[[Any, Any], Tensor], outputs: Any, targets: Any) -> LossCheck:
    num_samples = _num_samples(targets) or _num_samples(outputs)
    if num_samples < 2:
        raise ValueError(f"the check needs two samples, the batch has {num_samples}")
    bounds = [(0, 1), (1, num_samples)]
    with torch.no_grad():
        whole = float(loss_fn(outputs, targets))
        parts = [
            float(loss_fn(slice_samples(outputs, a, b), slice_samples(targets, a, b)))
            for a, b in bounds
        ]
    if not all(math.isfinite(v) for v in (whole, *parts)):
        raise ValueError("loss_fn gave a non-finite loss on the check batch")
    items = [count_items(slice_samples(targets, a, b)) for a, b in bounds]
    found = LossFound.OTHER
    if _close(whole, _weighted(parts, [b - a for a, b in bounds])):
        found = LossFound.SAMPLE_MEAN
    elif sum(items) > 0 and _close(whole, _weighted(parts, items)):
        found = LossFound.TOKEN_MEAN
    elif _close(whole, sum(parts)):
        found = LossFound.SUM
    return LossCheck(found, whole, sum(parts))


def _weighted(values: list[float], weights: list[int]) -> float:
    return sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights)


def _close(value: float, expected: float) -> bool:
    return abs(value - expected) <= _MATCH_RTOL * max(abs(value), abs(expected), 1e-12)


def _num_samples(targets: Any) -> int:
    sizes = {t.shape[0] for t in tree_leaves(targets) if isinstance(t, Tensor) and t.dim() > 0}
    return min(sizes) if sizes else 0


def _padded(targets: Any) -> Any | None:
    """``targets`` with the first half of sample 0's elements that are not
    :data:`IGNORE_INDEX` in each integer tensor set to it (sample 0 keeps the rest, so its
    items are not 0; tensors of one element a sample kept whole); None when nothing could be
    padded."""
    changed = False

    def pad(x: Any) -> Any:
        nonlocal changed
        if not isinstance(x, Tensor) or x.is_floating_point() or x.dtype == torch.bool:
            return x
        if x.dim() < 2 or x[0].numel() < 2 or x.dtype == torch.uint8:
            return x
        flat = x[0].reshape(-1).clone()
        kept = (flat != IGNORE_INDEX).nonzero().reshape(-1)
        if kept.numel() < 2:
            return x
        flat[kept[: kept.numel() // 2]] = IGNORE_INDEX
        padded = x.clone()
        padded[0] = flat.reshape(x[0].shape)
        changed = True
        return padded

    result = tree_map(pad, targets)
    return result if changed else None
