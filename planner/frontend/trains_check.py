"""Check at solve time what tracing does not: that the model trains at all.

Tracing runs ``build_model``, ``sample_batch`` and the forward, but never ``loss_fn``; a
loss that raises, is not a scalar, or needs no gradient, or a model without trainable
parameters, would otherwise pass ``hplan solve`` and fail only when the plan runs. One
forward and one ``loss_fn`` call on a batch of two samples settle it: on the meta device
when the model and loss run there (no memory, no compute), else on CPU tensors, whose
verdict is final.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from hplan.runtime.capture.model_file import ModelFile, checked_loss
from hplan.runtime.capture.trace import bind_inputs
from hplan.runtime.contract.errors import ModelFileError

CHECK_BATCH_SIZE = 2
"""Samples in the batch the check runs (``sample_batch(2)``, as tracing uses)."""


def check_trains(model_file: ModelFile, seed: int = 0) -> None:
    """Check that the model has trainable parameters and that its loss can be trained on.

    Builds the model (after ``torch.manual_seed(seed)``, RNG state restored afterwards),
    runs it on ``sample_batch(2)`` and calls ``loss_fn`` on the outputs and targets: first
    with the model and batch on the meta device; if anything fails there, again on CPU.

    Raises:
        ModelFileError: ``build_model`` returns no trainable parameters; ``loss_fn`` raises
            or returns something other than a scalar tensor that needs a gradient; or the
            model's forward raises on CPU.
    """
    with torch.random.fork_rng(devices=[]):
        try:
            _check_on(model_file, seed, torch.device("meta"))
            return
        except Exception:  # maybe only the meta device's fault: the CPU run decides
            pass
        _check_on(model_file, seed, torch.device("cpu"))


def _check_on(model_file: ModelFile, seed: int, device: torch.device) -> None:
    torch.manual_seed(seed)
    with device:
        model = model_file.build_model()
    _check_parameters(model_file, model)
    inputs, targets = model_file.sample_batch(CHECK_BATCH_SIZE)
    bound = {name: _to(value, device) for name, value in bind_inputs(model, inputs).items()}
    try:
        outputs = model(**bound)
    except Exception as exc:
        if device.type == "meta":
            raise
        raise ModelFileError(
            f"the model's forward raised {type(exc).__name__} on sample_batch"
            f"({CHECK_BATCH_SIZE}) from {str(model_file.path)!r}; fix model.py"
        ) from None
    checked_loss(model_file, outputs, _to(targets, device), require_grad=True)


def _check_parameters(model_file: ModelFile, model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise ModelFileError(
            f"build_model() in {str(model_file.path)!r} returned a {type(model).__name__}; "
            "return a torch.nn.Module"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise ModelFileError(
            f"build_model() in {str(model_file.path)!r} returns a model without trainable "
            "parameters, so there is nothing to train; give it parameters that require grad"
        )


def _to(value: Any, device: torch.device) -> Any:
    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, value)
