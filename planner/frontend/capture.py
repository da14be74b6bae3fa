"""The capture pass: the model built once, its example batches, its graph traced once.

Every later pass of a solve reads this :class:`CapturedModel`: the cost graph measures its
graph (on a meta copy when the model allows it, :func:`meta_copy`), the check that the model
trains runs its module. ``build_model`` and the trace each run exactly once per solve.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hplan.runtime.capture.model_file import ModelFile
from hplan.runtime.capture.trace import TracedModel, bind_inputs, trace_model
from hplan.runtime.contract.errors import HplanError, ModelFileError, one_line

DEFAULT_BATCH_SIZES = (2, 3)
"""The two batch sizes every node is measured at (per-sample figures are their slope)."""


@dataclass(frozen=True)
class CapturedModel:
    """A model file's model, built and traced once, with its example batches."""

    model_file: ModelFile
    model: nn.Module
    """Built once, after ``torch.manual_seed(seed)``; CPU tensors."""
    traced: TracedModel
    """Traced once, on the smaller batch."""
    batches: Mapping[int, tuple[Any, Any]]
    """Batch size -> ``sample_batch(batch_size)`` as the model file returned it
    ``(inputs, targets)``; exactly two sizes."""
    inputs: Mapping[int, Mapping[str, torch.Tensor]]
    """Batch size -> the inputs bound to ``forward``'s parameter names."""
    seed: int

    @property
    def batch_sizes(self) -> tuple[int, int]:
        """The two batch sizes, smaller first."""
        small, large = sorted(self.inputs)
        return small, large

    def verify(self) -> None:
        """Check the capture's invariants; raise ValueError naming the first broken one.

        Two distinct batch sizes, with bound inputs and raw batches for both; the graph's
        placeholders are the fed inputs, in order, at both sizes.
        """
        sizes = sorted(self.inputs)
        if len(sizes) != 2 or sizes[0] == sizes[1] or sorted(self.batches) != sizes:
            raise ValueError(
                f"a capture needs two batch sizes, got {sizes} / {sorted(self.batches)}"
            )
        gm = self.traced.graph_module
        placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(self.traced.input_names):
            raise ValueError(
                f"graph placeholders {placeholders} do not match the fed inputs "
                f"{list(self.traced.input_names)}"
            )
        for size, feed in self.inputs.items():
            if list(feed) != list(self.traced.input_names):
                raise ValueError(
                    f"inputs at batch size {size} are {list(feed)}, want the traced ones"
                )


def capture_model(
    model_file: ModelFile,
    *,
    leaf_modules: tuple[str, ...] = (),
    seed: int = 0,
    batch_sizes: tuple[int, int] = DEFAULT_BATCH_SIZES,
) -> CapturedModel:
    """Build the model and its two example batches (seeded), and trace it on the smaller.

    Args:
        leaf_modules: module paths or class names to keep whole, besides the model file's
            ``LEAF_MODULES``.
        batch_sizes: two distinct batch sizes >= 1.

    Raises:
        ModelFileError: ``build_model``/``sample_batch`` raise or give unusable inputs.
        TraceError: the model cannot be traced.
        ValueError: ``batch_sizes`` are not two distinct positive integers.
    """
    small, large = _check_batch_sizes(batch_sizes)
    with torch.random.fork_rng(devices=[]):
        model = _build(model_file, seed)
        batches = {b: _sample_batch(model_file, b) for b in (small, large)}
    inputs = {b: bind_inputs(model, batch[0]) for b, batch in batches.items()}
    leaves = (*leaf_modules, *model_file.leaf_modules)
    traced = trace_model(model, inputs[small], leaf_modules=leaves)
    return CapturedModel(model_file, model, traced, batches, inputs, seed)


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device.

    No tensor data is copied: each parameter and buffer is replaced by a meta tensor of its
    shape and dtype (``requires_grad`` kept; a tensor tied under two names stays one), the
    rest of the module deep-copied.
    """
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        meta = tensor.detach().to("meta")
        if isinstance(tensor, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = meta
    with warnings.catch_warnings():  # torch's own pytree specs warn when deep-copied
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(module, memo)


def to_meta(value: Any) -> Any:
    """Every tensor in a nested structure moved to the meta device."""
    return torch.utils._pytree.tree_map(
        lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, value
    )


def _check_batch_sizes(batch_sizes: tuple[int, int]) -> tuple[int, int]:
    small, large = sorted(batch_sizes)
    if small < 1 or small == large:
        raise ValueError(f"batch_sizes {batch_sizes} must be two distinct integers >= 1")
    return small, large


def _build(model_file: ModelFile, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    try:
        model = model_file.build_model()
    except HplanError:
        raise
    except Exception as exc:
        raise ModelFileError(
            f"build_model() in {str(model_file.path)!r} raised {one_line(exc)}; fix model.py"
        ) from None
    if not isinstance(model, nn.Module):
        raise ModelFileError(
            f"build_model() returned a {type(model).__name__}; return a torch.nn.Module"
        )
    return model


def _sample_batch(model_file: ModelFile, batch_size: int) -> tuple[Any, Any]:
    try:
        batch = model_file.sample_batch(batch_size)
    except Exception as exc:
        raise ModelFileError(
            f"sample_batch({batch_size}) in {str(model_file.path)!r} raised "
            f"{one_line(exc)}; fix model.py"
        ) from None
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ModelFileError(
            f"sample_batch({batch_size}) must return (inputs, targets), got "
            f"{type(batch).__name__}; fix model.py"
        )
    return batch[0], batch[1]
