"""Check at solve time what tracing does not: that the model trains at all.

Tracing runs ``build_model``, ``sample_batch`` and the forward, but never ``loss_fn``; a
loss that raises, is not a scalar, or needs no gradient, or a model without trainable
parameters, would otherwise pass ``hplan solve`` and fail only when the plan runs. One
forward and one ``loss_fn`` call on the captured batch of two samples settle it: on a meta
copy of the captured model when the model and loss run there (no memory, no compute), else
on the captured model itself (its buffers and the RNG state restored), whose verdict is
final. Nothing is built or traced again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hplan.planner.frontend.capture import CapturedModel, meta_copy, to_meta
from hplan.runtime.capture.model_file import checked_loss
from hplan.runtime.capture.trace import bind_inputs
from hplan.runtime.capture.trace_fallbacks import preserved
from hplan.runtime.contract.errors import ModelFileError

CHECK_BATCH_SIZE = 2
"""Samples in the batch the check runs (the capture's smaller batch)."""


@dataclass(frozen=True)
class TrainsVerdict:
    """The model trains: its loss needs a gradient. Where the check ran."""

    device: str
    """``meta`` or ``cpu``."""

    def verify(self) -> None:
        """The verdict names one of the two devices the check runs on."""
        if self.device not in ("meta", "cpu"):
            raise ValueError(f"the check ran on {self.device!r}, not on meta or cpu")


def check_trains(captured: CapturedModel) -> TrainsVerdict:
    """Check that the model has trainable parameters and that its loss can be trained on.

    Runs the model on the captured batch of :data:`CHECK_BATCH_SIZE` samples and calls
    ``loss_fn`` on the outputs and targets: first on a meta copy; if anything fails there,
    on the captured CPU model.

    Raises:
        ModelFileError: the model has no trainable parameters; ``loss_fn`` raises or
            returns something other than a scalar tensor that needs a gradient; or the
            model's forward raises on CPU.
    """
    model_file, model = captured.model_file, captured.model
    if not any(p.requires_grad for p in model.parameters()):
        raise ModelFileError(
            f"build_model() in {str(model_file.path)!r} returns a model without trainable "
            "parameters, so there is nothing to train; give it parameters that require grad"
        )
    inputs, targets = _batch(captured)
    try:
        meta = meta_copy(model)
        _forward_and_loss(captured, meta, to_meta(inputs), to_meta(targets), on_cpu=False)
        return TrainsVerdict("meta")
    except Exception:  # maybe only the meta device's fault: the CPU run decides
        pass
    with preserved(model), torch.enable_grad():
        _forward_and_loss(captured, model, inputs, targets, on_cpu=True)
    return TrainsVerdict("cpu")


def _batch(captured: CapturedModel) -> tuple[Any, Any]:
    if CHECK_BATCH_SIZE in captured.batches:
        return captured.batches[CHECK_BATCH_SIZE]
    return captured.batches[captured.batch_sizes[0]]


def _forward_and_loss(
    captured: CapturedModel, model: nn.Module, inputs: Any, targets: Any, *, on_cpu: bool
) -> None:
    model_file = captured.model_file
    bound = bind_inputs(model, inputs)
    try:
        outputs = model(**bound)
    except Exception as exc:
        if not on_cpu:
            raise
        raise ModelFileError(
            f"the model's forward raised {type(exc).__name__} on sample_batch"
            f"({CHECK_BATCH_SIZE}) from {str(model_file.path)!r}; fix model.py"
        ) from None
    checked_loss(model_file, outputs, targets, require_grad=True)
