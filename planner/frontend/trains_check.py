"""Check at solve time what tracing does not: that the model trains at all, every parameter.

Every parameter must be read by the traced forward (a stage holds what its part of the
graph reads; ``capture_checks.check_all_parameters_used``).

Tracing runs ``build_model``, ``sample_batch`` and the forward, but never ``loss_fn``; a
loss that raises, is not a scalar, or needs no gradient, or a model without trainable
parameters, would otherwise pass ``hplan solve`` and fail only when the plan runs. One
forward and one ``loss_fn`` call on the captured batch of two samples settle it, on the
capture's fake tensors (no memory, no compute). When a model or loss needs tensor values
(``.item()``, data-dependent shapes), fake tensors cannot run it: the verdict is then
static (the model has trainable parameters) and says so in a note. A model captured on
real CPU tensors (the capture's fallback) is checked on a meta copy when it runs there,
else on the captured model itself (its buffers and the RNG state restored), whose verdict
is final. Nothing is built or traced again. The same run checks what the loss averages over
(``runtime/capture/loss_items.py``, on random outputs of the forward's shapes): a sum is
refused, a token mean is weighted by tokens, and the plan records which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.multiprocessing.reductions import StorageWeakRef

from hplan.planner.frontend.capture import CapturedModel, meta_copy, to_meta
from hplan.planner.frontend.capture_checks import check_all_parameters_used
from hplan.runtime.capture.graph_inputs import forward_kwargs
from hplan.runtime.capture.loss_items import (
    IGNORE_INDEX,
    LossFound,
    check_loss_convention,
    random_like,
)
from hplan.runtime.capture.model_file import ModelFile, check_loss_value, checked_loss
from hplan.runtime.capture.trace import bind_inputs
from hplan.runtime.capture.trace_fallbacks import preserved
from hplan.runtime.contract.errors import ModelFileError, one_line
from hplan.runtime.contract.plan import LossConvention

CHECK_BATCH_SIZE = 2
"""Samples in the batch the check runs (the capture's smaller batch)."""

CHECK_DEVICES = ("fake", "meta", "cpu", "static")
"""Where a check can run: fake tensors, a meta copy, CPU tensors, or nowhere (static)."""

_NEEDS_VALUES = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
    GuardOnDataDependentSymNode,
)
"""What fake tensors raise for code that needs tensor values (not the model's fault)."""


@dataclass(frozen=True)
class LossMemory:
    """Bytes per sample that ``loss_fn`` saves for its backward (each storage once), and
    the largest of them: the loss's own activations, beside the model outputs it reads
    (cross-entropy saves its log-softmax, one tensor the size of the logits)."""

    saved_bytes_per_sample: float
    largest_saved_bytes_per_sample: float


class _SavedByLoss(torch.autograd.graph.saved_tensors_hooks):
    """Records the storages autograd saves while the loss runs (each counted once)."""

    def __init__(self) -> None:
        self.sizes: dict[StorageWeakRef, int] = {}
        super().__init__(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self.sizes[StorageWeakRef(storage)] = storage.nbytes()
        return tensor

    def per_sample(self, batch_size: int, inputs: Any) -> LossMemory:
        """The saved bytes per sample, leaving out what the loss received (the model's
        outputs and the targets, counted elsewhere)."""
        given = {StorageWeakRef(t.untyped_storage()) for t in _tensor_leaves(inputs)}
        own = [n for key, n in self.sizes.items() if key not in given]
        return LossMemory(sum(own) / batch_size, max(own, default=0) / batch_size)


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


@dataclass(frozen=True)
class TrainsVerdict:
    """The model trains: its loss needs a gradient. Where the check ran."""

    device: str
    """One of :data:`CHECK_DEVICES`."""
    notes: tuple[str, ...] = ()
    """Why the check was static, when it was."""
    loss_memory: LossMemory | None = None
    """What ``loss_fn`` saved for its backward, per sample; None where it did not run
    (a static verdict, or one read from a capture file)."""
    loss_convention: LossConvention = LossConvention.SAMPLE_MEAN
    """What ``loss_fn`` averages over (a per-sample mean where the check could not tell)."""

    def verify(self) -> None:
        """The verdict names one of :data:`CHECK_DEVICES`."""
        if self.device not in CHECK_DEVICES:
            raise ValueError(f"the check ran on {self.device!r}, not on one of {CHECK_DEVICES}")


def check_trains(captured: CapturedModel) -> TrainsVerdict:
    """Check that the model has trainable parameters and that its loss can be trained on.

    Runs the model on the captured batch of :data:`CHECK_BATCH_SIZE` samples and calls
    ``loss_fn`` on the outputs and targets: on the capture's fake tensors (a static verdict
    when the code needs tensor values); for a capture on real tensors, first on a meta
    copy, and if anything fails there, on the captured CPU model.

    Raises:
        ModelFileError: forward never uses some parameters (naming them); the model has no
            trainable parameters; ``loss_fn`` raises or
            returns something other than a scalar tensor that needs a gradient; or the
            model's forward raises (on fake tensors, or on CPU).
    """
    model_file, model = captured.model_file, captured.model
    check_all_parameters_used(model_file, model, captured.traced)
    if not any(p.requires_grad for p in model.parameters()):
        raise ModelFileError(
            f"build_model() in {str(model_file.path)!r} returns a model without trainable "
            "parameters, so there is nothing to train; give it parameters that require grad"
        )
    if captured.fake_mode is not None:
        return _check_fake(captured)
    inputs, targets = _batch(captured)
    try:
        meta = meta_copy(model)
        ran = _forward_and_loss(captured, meta, to_meta(inputs), to_meta(targets), on_cpu=False)
        return _verdict("meta", captured, ran)
    except Exception:  # maybe only the meta device's fault: the CPU run decides
        pass
    with preserved(model), torch.enable_grad():
        ran = _forward_and_loss(captured, model, inputs, targets, on_cpu=True)
    return _verdict("cpu", captured, ran)


def _verdict(device: str, captured: CapturedModel, ran: _LossRun) -> TrainsVerdict:
    convention, notes = loss_convention(captured.model_file, _batch(captured), *ran[1:])
    return TrainsVerdict(device, notes, loss_memory=ran[0], loss_convention=convention)


def _check_fake(captured: CapturedModel) -> TrainsVerdict:
    mode, model_file = captured.fake_mode, captured.model_file
    assert mode is not None
    inputs, targets = captured.fake(_batch(captured))
    where = f"sample_batch({CHECK_BATCH_SIZE}) from {str(model_file.path)!r}"
    try:
        with mode, captured.fake_runs(), torch.enable_grad():
            outputs = captured.model(**forward_kwargs(bind_inputs(captured.model, inputs)))
    except _NEEDS_VALUES as exc:
        return _static("the model's forward", exc)
    except Exception as exc:
        raise ModelFileError(
            f"the model's forward raised {one_line(exc)} on {where}; fix model.py"
        ) from None
    saved = _SavedByLoss()
    try:
        with mode, torch.enable_grad(), saved:
            loss = model_file.loss_fn(outputs, targets)
    except _NEEDS_VALUES as exc:
        return _static("loss_fn", exc)
    except Exception as exc:
        raise ModelFileError(
            f"loss_fn in {str(model_file.path)!r} raised {one_line(exc)} on (model outputs, "
            "targets from sample_batch); fix loss_fn in model.py"
        ) from None
    check_loss_value(model_file, loss, require_grad=True)
    batch_size = _batch_size(captured)
    convention, notes = loss_convention(model_file, _batch(captured), outputs, loss)
    return TrainsVerdict(
        "fake",
        notes,
        loss_memory=saved.per_sample(batch_size, (outputs, targets)),
        loss_convention=convention,
    )


def _static(what: str, exc: BaseException) -> TrainsVerdict:
    note = (
        f"the check that the model trains did not run: {what} needs tensor values "
        f"({one_line(exc)}); checked only that the model has trainable parameters"
    )
    return TrainsVerdict("static", (note,))


def _batch_size(captured: CapturedModel) -> int:
    return CHECK_BATCH_SIZE if CHECK_BATCH_SIZE in captured.batches else captured.batch_sizes[0]


def _batch(captured: CapturedModel) -> tuple[Any, Any]:
    return captured.batches[_batch_size(captured)]


_LossRun = tuple[LossMemory, Any, torch.Tensor]
"""What one forward and ``loss_fn`` gave: the loss's saved bytes, the outputs, the loss."""


def _forward_and_loss(
    captured: CapturedModel, model: nn.Module, inputs: Any, targets: Any, *, on_cpu: bool
) -> _LossRun:
    model_file = captured.model_file
    bound = bind_inputs(model, inputs)
    try:
        outputs = model(**forward_kwargs(bound))
    except Exception as exc:
        if not on_cpu:
            raise
        raise ModelFileError(
            f"the model's forward raised {type(exc).__name__} on sample_batch"
            f"({CHECK_BATCH_SIZE}) from {str(model_file.path)!r}; fix model.py"
        ) from None
    saved = _SavedByLoss()
    with saved:
        loss = checked_loss(model_file, outputs, targets, require_grad=True)
    return saved.per_sample(_batch_size(captured), (outputs, targets)), outputs, loss


CHECK_OUTPUT_BYTES_MAX = 512_000_000
"""Largest model output (bytes, at the check's batch) the loss convention check draws at
random; above it the check is skipped with a note (a 150k-token vocabulary's logits at a
long sequence)."""


def loss_convention(
    model_file: ModelFile, batch: tuple[Any, Any], outputs: Any, loss: torch.Tensor
) -> tuple[LossConvention, tuple[str, ...]]:
    """What ``loss_fn`` averages over, and the notes that say so.

    Calls ``loss_fn`` on random outputs of ``outputs``' shapes and the real targets of
    ``batch`` (``loss_items.check_loss_convention``). A loss that ``loss_fn`` takes from
    the outputs (a Hugging Face model's own ``outputs.loss``) cannot be checked that way:
    it is refused when the inputs hold padded labels (``-100``), else noted.

    Raises:
        ModelFileError: ``loss_fn`` is a sum over samples; or it returns the model's own
            loss over labels padded with ``-100``.
    """
    inputs, targets = batch
    where = f"loss_fn in {str(model_file.path)!r}"
    leaves = _tensor_leaves(outputs)
    if any(loss is leaf for leaf in leaves):
        return _models_own_loss(where, inputs)
    num_bytes = sum(t.numel() * t.element_size() for t in leaves)
    if num_bytes > CHECK_OUTPUT_BYTES_MAX:
        return LossConvention.SAMPLE_MEAN, (
            f"loss: not checked to be a per-sample mean (the model's outputs are "
            f"{num_bytes / 1e9:.1f} GB at {CHECK_BATCH_SIZE} samples); micro-batches are "
            "weighted by samples",
        )
    try:
        check = check_loss_convention(model_file.loss_fn, random_like(outputs), targets)
    except Exception as exc:
        return LossConvention.SAMPLE_MEAN, (
            f"loss: not checked to be a per-sample mean ({where} raised {one_line(exc)} on "
            "random outputs and parts of the batch); micro-batches are weighted by samples",
        )
    if check.found is LossFound.SUM:
        raise ModelFileError(
            f"{where} returns a sum over the samples it is given (on {CHECK_BATCH_SIZE} "
            f"samples {check.whole:.4g}, the sum of its values on each sample): hplan weights "
            "each micro-batch's loss by its share of the global batch, right only for a mean, "
            "and a sum's gradient grows with the batch size; return a mean (reduction='mean', "
            "or divide by the number of samples)"
        )
    return check.convention, _convention_notes(check.found)


def _convention_notes(found: LossFound) -> tuple[str, ...]:
    """A note where the check found no weighting (the summary's ``loss`` row says which
    convention the plan uses)."""
    if found is LossFound.OTHER:
        return (
            "loss: not a per-sample mean, a token mean or a sum (its value on a batch is no "
            "weighting of its values on the parts); micro-batches are weighted by samples, "
            "right only for a per-sample mean",
        )
    return ()


def _models_own_loss(where: str, inputs: Any) -> tuple[LossConvention, tuple[str, ...]]:
    padded = any(
        bool((t == IGNORE_INDEX).any())
        for t in _tensor_leaves(inputs)
        if not t.is_floating_point() and t.dtype != torch.bool
    )
    if padded:
        raise ModelFileError(
            f"{where} returns the model's own loss, a mean over each micro-batch's tokens, "
            f"and the inputs hold labels padded with {IGNORE_INDEX}, so unequal shares would "
            "weight tokens wrongly; give the labels as targets (shifted as the model shifts "
            "them) and return F.cross_entropy(logits.flatten(0, -2), targets.flatten()) "
            "from loss_fn: hplan then weights micro-batches by tokens"
        )
    return LossConvention.SAMPLE_MEAN, (
        "loss: loss_fn returns the model's own loss, not checked; micro-batches are weighted "
        "by samples, right for a per-sample mean or labels without padding",
    )
