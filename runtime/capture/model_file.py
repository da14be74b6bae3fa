"""Load a user's ``model.py`` and check it follows the model-file convention.

The convention is README.md's "What you give it": ``build_model()``,
``sample_batch(batch_size)`` and ``loss_fn(outputs, targets)`` are required;
``make_optimizer``, ``dataset``, ``LEAF_MODULES``, ``make_scheduler``,
``STOP_ON_NONFINITE_LOSS``, ``MAX_GRAD_NORM``, ``OUTER_LR``, ``OUTER_MOMENTUM`` and
``TP_PLAN`` are optional. :class:`ModelFile`'s fields say what each means to the runtime.

Loading a model file executes its code, with the same rights as the user running hplan.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hplan.runtime.contract.errors import ModelFileError, Terminated, error_reason, one_line

REQUIRED = ("build_model", "sample_batch", "loss_fn")
DEFAULT_OUTER_LR = 0.7
"""``OUTER_LR`` when the model file sets none (DiLoCo's; Douillard et al., 2023)."""
DEFAULT_OUTER_MOMENTUM = 0.9
"""``OUTER_MOMENTUM`` when the model file sets none (DiLoCo's)."""


@dataclass(frozen=True)
class ModelFile:
    """The callables a model file provides."""

    path: Path
    sha256: str
    build_model: Callable[[], Any]
    """Called after ``torch.manual_seed``, so every rank builds the same initial weights; a
    rank calls it twice (on fake tensors, then building its own stage for real,
    ``materialise.py``), so it must build the same model every call."""
    sample_batch: Callable[[int], tuple[Any, Any]]
    """``(inputs, targets)`` of ``batch_size`` samples; ``inputs`` is a tensor (the first
    ``forward`` argument), a tuple (positional arguments) or a dict (keyword arguments);
    every tensor's dim 0 is the sample dimension."""
    loss_fn: Callable[[Any, Any], Any]
    """A scalar tensor: the *mean* over the samples it is given (hplan weights micro-batches
    by their sample counts)."""
    make_optimizer: Callable[[Any], Any] | None
    """It must update each parameter from its own gradient only (no global-norm clipping:
    ``MAX_GRAD_NORM``), so that per-stage optimizers equal one over the whole model; None:
    AdamW, lr 1e-3."""
    dataset: Callable[[], Sequence[Any]] | None
    """Real training data, one sample per item; None: train on ``sample_batch``."""
    leaf_modules: tuple[str, ...]
    """``LEAF_MODULES``: module paths (``"blocks.1"``) or class names kept whole when tracing."""
    make_scheduler: Callable[[Any], Any] | None = None
    """An LR scheduler, stepped after every optimizer step; a function of the step count (a
    resumed run steps it to the checkpoint's step)."""
    stop_on_nonfinite_loss: bool = False
    """``STOP_ON_NONFINITE_LOSS``: a non-finite loss stops the job (exit 1); False: it is
    reported and training goes on."""
    max_grad_norm: float | None = None
    """``MAX_GRAD_NORM``: clip to this global L2 norm every step, as
    ``clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)`` would in one process: the norm of
    the whole model's gradient after the data-parallel sum (and fp16 unscaling), each
    parameter counted once; every rank scales by ``min(1, MAX_GRAD_NORM / (norm + 1e-6))``,
    and a non-finite norm clips nothing. None: no clipping."""
    outer_lr: float = DEFAULT_OUTER_LR
    """``OUTER_LR``: the learning rate of the outer optimizer of ``local_sgd`` and ``async``
    plans, ``torch.optim.SGD(lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=OUTER_MOMENTUM >
    0)`` over the global parameters, stepped on the islands' sample-weighted pseudo-gradients
    (``executor/outer/outer_sync.py``); 1 with momentum 0 is plain averaging."""
    outer_momentum: float = DEFAULT_OUTER_MOMENTUM
    """``OUTER_MOMENTUM``: the outer optimizer's Nesterov momentum (0: plain SGD)."""
    tp_plan: tuple[tuple[str, str], ...] | None = None
    """``TP_PLAN``: the model's tensor-parallel plan, ``(module pattern, style)`` in the
    order written (Hugging Face's ``base_model_tp_plan`` form: ``*`` stands for one path
    component, styles ``colwise``, ``rowwise``, ``colwise_rep``, ``rowwise_rep``); the
    planner checks the patterns and styles against the model. None: the file sets none."""

    def build(self) -> Any:
        """The model file's ``build_model()`` (the caller seeds it).

        Raises:
            ModelFileError: ``build_model`` raises (the message names the file and the
                error, and says to fix model.py).
        """
        try:
            return self.build_model()
        except Exception as exc:
            raise ModelFileError(
                f"build_model() in {str(self.path)!r} raised {type(exc).__name__}: "
                f"{error_reason(exc)}; fix model.py"
            ) from None

    def optimizer(self, params: Sequence[Any]) -> Any:
        """The model file's ``make_optimizer(params)``, else AdamW with lr 1e-3."""
        if self.make_optimizer is not None:
            return self.make_optimizer(params)
        return torch.optim.AdamW(params, lr=1e-3)


def load_model_file(path: str | Path) -> ModelFile:
    """Import ``path`` as a module and return its convention functions.

    Raises:
        ModelFileError: the file is missing, raises while importing (the message gives the
            exception and the line in the file), lacks a required function, or sets
            ``LEAF_MODULES``, ``STOP_ON_NONFINITE_LOSS``, ``MAX_GRAD_NORM``, ``OUTER_LR``,
            ``OUTER_MOMENTUM`` or ``TP_PLAN`` to a value of the wrong kind.
    """
    file = Path(path)
    if file.is_dir():
        raise ModelFileError(
            f"model file {str(path)!r} is a directory; pass the path to the model.py inside it"
        )
    if not file.is_file():
        raise ModelFileError(f"model file {str(path)!r} does not exist; pass a path to model.py")
    text = file.read_bytes()
    digest = hashlib.sha256(text).hexdigest()
    module_name = f"hplan_user_model_{digest[:16]}"
    module = sys.modules[module_name] if module_name in sys.modules else _import(file, module_name)
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        raise ModelFileError(
            f"model file {str(path)!r} lacks {', '.join(missing)}; define "
            + ", ".join(f"{m}()" for m in missing)
            + " (see README: What you give it)"
        )
    leaves = getattr(module, "LEAF_MODULES", ())
    if isinstance(leaves, str) or not all(isinstance(x, str) for x in leaves):
        raise ModelFileError(
            f"LEAF_MODULES in {str(path)!r} must be a list of module paths or class names"
        )
    return ModelFile(
        path=file,
        sha256=digest,
        build_model=module.build_model,
        sample_batch=module.sample_batch,
        loss_fn=module.loss_fn,
        make_optimizer=_optional(module, "make_optimizer"),
        dataset=_optional(module, "dataset"),
        leaf_modules=tuple(leaves),
        make_scheduler=_optional(module, "make_scheduler"),
        stop_on_nonfinite_loss=_flag(path, module, "STOP_ON_NONFINITE_LOSS"),
        max_grad_norm=_max_grad_norm(path, module),
        outer_lr=_outer_lr(path, module),
        outer_momentum=_outer_momentum(path, module),
        tp_plan=_tp_plan(path, module),
    )


def checked_loss(
    model_file: ModelFile, outputs: Any, targets: Any, *, require_grad: bool = False
) -> Tensor:
    """``model_file.loss_fn(outputs, targets)``, checked: a scalar tensor.

    Args:
        require_grad: also require that the loss needs a gradient (true when the whole
            model ran with autograd on; a pipeline stage without trainable parameters
            legitimately returns a loss without one).

    Raises:
        ModelFileError: ``loss_fn`` raised, or returned something other than a
            one-element tensor (or, with ``require_grad``, one that needs no gradient).
    """
    where = f"loss_fn in {str(model_file.path)!r}"
    try:
        loss = model_file.loss_fn(outputs, targets)
    except Exception as exc:
        raise ModelFileError(
            f"{where} raised {one_line(exc)} on (model outputs, targets from "
            "sample_batch/dataset); fix loss_fn in model.py"
        ) from None
    return check_loss_value(model_file, loss, require_grad=require_grad)


def check_loss_value(model_file: ModelFile, loss: Any, *, require_grad: bool = False) -> Tensor:
    """Check what ``loss_fn`` returned: a one-element tensor (needing a gradient, with
    ``require_grad``); see :func:`checked_loss`.

    Raises:
        ModelFileError: naming what it got and the fix.
    """
    where = f"loss_fn in {str(model_file.path)!r}"
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        got = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, Tensor)
            else (f"a {type(loss).__name__}")
        )
        raise ModelFileError(
            f"{where} returned {got}; fix loss_fn to return a scalar tensor, the mean loss "
            "over the samples it is given (for example `.mean()`)"
        )
    if require_grad and not loss.requires_grad:
        raise ModelFileError(
            f"{where} returned a loss that needs no gradient, so nothing would train; fix "
            "loss_fn to compute it from the model outputs (no .detach(), .item() or "
            "torch.no_grad())"
        )
    return loss


def plan_model_path(
    recorded: str, plan_path: str | Path, override: str | Path | None = None
) -> Path:
    """The model file to run a plan with: ``override`` if given, else the plan's own.

    ``hplan solve`` records the model path relative to the folder it writes plan.json to,
    so a relative ``recorded`` path is taken relative to ``plan_path``'s folder (wherever
    the command runs from); an absolute one is used as it is.

    Raises:
        ModelFileError: the resulting file does not exist (naming ``--model``).
    """
    if override is not None:
        return Path(override)
    path = Path(recorded)
    if not path.is_absolute():
        path = Path(plan_path).parent / path
    if not path.is_file():
        raise ModelFileError(
            f"model file {recorded!r} recorded in {str(plan_path)!r} is not at {str(path)!r}; "
            "copy model.py there or pass --model PATH"
        )
    return path


def _flag(path: str | Path, module: Any, name: str) -> bool:
    value = getattr(module, name, False)
    if not isinstance(value, bool):
        raise ModelFileError(f"{name} in {str(path)!r} is {value!r}; set it to True or False")
    return value


def _max_grad_norm(path: str | Path, module: Any) -> float | None:
    value = getattr(module, "MAX_GRAD_NORM", None)
    if value is None:
        return None
    number = _number(value)
    if not (math.isfinite(number) and number > 0):
        raise ModelFileError(
            f"MAX_GRAD_NORM in {str(path)!r} is {value!r}; set it to a finite number > 0 "
            "(the global L2 gradient norm to clip to, e.g. 1.0) or remove it"
        )
    return number


def _number(value: Any) -> float:
    """``value`` as a float; NaN when it is not an int or float (bool is not a number)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except OverflowError:  # an int beyond float's range
        return math.inf


def _outer_lr(path: str | Path, module: Any) -> float:
    value = getattr(module, "OUTER_LR", DEFAULT_OUTER_LR)
    number = _number(value)
    if not (math.isfinite(number) and number > 0):
        raise ModelFileError(
            f"OUTER_LR in {str(path)!r} is {value!r}; set it to a finite number > 0 (the "
            f"outer learning rate of local_sgd/async plans, default {DEFAULT_OUTER_LR}) or "
            "remove it"
        )
    return number


def _outer_momentum(path: str | Path, module: Any) -> float:
    value = getattr(module, "OUTER_MOMENTUM", DEFAULT_OUTER_MOMENTUM)
    number = _number(value)
    if not 0 <= number < 1:  # NaN fails too
        raise ModelFileError(
            f"OUTER_MOMENTUM in {str(path)!r} is {value!r}; set it to a number in [0, 1) (the "
            f"outer Nesterov momentum of local_sgd/async plans, default "
            f"{DEFAULT_OUTER_MOMENTUM}) or remove it"
        )
    return number


def _tp_plan(path: str | Path, module: Any) -> tuple[tuple[str, str], ...] | None:
    value = getattr(module, "TP_PLAN", None)
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ModelFileError(
            f"TP_PLAN in {str(path)!r} is {type(value).__name__} {value!r:.80}; set it to a dict "
            'of module pattern -> style, e.g. {"blocks.*.mlp.0": "colwise", '
            '"blocks.*.mlp.2": "rowwise"}, or remove it'
        )
    return tuple(value.items())


def _optional(module: Any, name: str) -> Callable[..., Any] | None:
    value = getattr(module, name, None)
    return value if callable(value) else None


def _import(file: Path, module_name: str) -> Any:
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"cannot import {str(file)!r} as Python; is it a .py file?")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    # As `python model.py` does: modules beside the file import (it stays on the path, since
    # the model's functions may import lazily when they run).
    folder = str(file.resolve().parent)
    if folder not in sys.path:
        sys.path.append(folder)
    try:
        spec.loader.exec_module(module)
    except SystemExit as exc:
        del sys.modules[module_name]
        if isinstance(exc, Terminated):
            raise
        raise ModelFileError(
            f"model file {str(file)!r} called sys.exit({exc.code!r}){_line_in(file, exc)} while "
            "importing; hplan imports model.py as a module, so put script code under "
            "`if __name__ == '__main__':`"
        ) from None
    except Exception as exc:
        del sys.modules[module_name]
        line = _line_in(file, exc)
        raise ModelFileError(
            f"model file {str(file)!r} raised {type(exc).__name__}: {exc}{line} while "
            "importing; fix the file so `python model.py` imports cleanly"
        ) from None
    return module


def _line_in(file: Path, exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == file]
    return f" (line {frames[-1].lineno})" if frames else ""
