"""Single-process reference training and the comparison behind ``rehearse --verify``.

The reference runs the *full* model in one process on the *whole* global batch of a step,
with the ranks' seed, data, optimizer and LR scheduler (:func:`reference_steps`).
:func:`verify_first_step` checks the ranks' first step, every copy of every parameter on
every rank, by relative L2 difference (``||x_rank - x_ref|| / ||x_ref||``):

1. **Gradients** after the gradient sync, against one-process autograd, within
   :func:`gradient_tolerance` of their dtype, measured against at least a round-off floor:
   :data:`ROUND_OFF_MARGIN` times how far the same step on the plan's micro-batches in one
   process lands from it (``round_off.py``), and :data:`GRADIENT_FLOOR_EPS`.
2. **Updates** ``p_rank - p_0``, against the model file's own optimizer replayed in one
   process on *the ranks' synced gradients*, within :data:`UPDATE_TOLERANCE`: an optimizer
   can turn a gradient difference far inside the tolerance into one the size of the whole
   step (Adam's first step is ``lr * g / (|g| + eps)``), and the replay works for any
   optimizer. Together: the right gradients, and the right update applied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hplan.runtime.capture.graph_inputs import forward_kwargs
from hplan.runtime.capture.loss_items import slice_samples
from hplan.runtime.capture.model_file import ModelFile, checked_loss
from hplan.runtime.capture.trace import bind_inputs
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.plan import Plan, Precision, microbatch_sizes
from hplan.runtime.executor.data import BatchSource, batch_digest, with_batch_tensors
from hplan.runtime.executor.precision import autocast
from hplan.runtime.executor.random_ops import DropoutOff, RandomDraws
from hplan.runtime.rehearsal.round_off import round_off_norms, split_gradients

GRADIENT_TOLERANCES = {torch.float64: 1e-4, torch.float32: 1e-4, torch.bfloat16: 5e-2}
"""Largest relative L2 difference of a parameter's gradient, by dtype: the ranks and one
process sum the same terms in another order (micro-batches, all-reduce), which correct runs
keep far below these, while a doubled gradient gives 1; bfloat16 has 8 mantissa bits."""
DEFAULT_GRADIENT_TOLERANCE = 5e-2
"""Other dtypes (float16, 10 mantissa bits): bfloat16's tolerance, the looser one."""
GRADIENT_FLOOR_EPS = 10.0
"""A gradient's norm is measured against at least this many ``torch.finfo(dtype).eps`` of
the model's typical gradient of a tensor its size (``sqrt(numel)`` times the RMS of every
reference gradient element), so that a gradient that is zero in exact arithmetic, and
round-off in both runs (a key bias before a softmax), does not count as a 100% difference,
while the smallest real gradients stay above the floor."""
ROUND_OFF_MARGIN = 3.0
"""A rank's gradient may differ from one process by this many times the round-off of the
same step run on the plan's micro-batches in one process (``round_off.round_off_norms``): the
ranks sum in yet another order (across replicas too); a gradient scaled by 2 differs by
itself, far more than 3x its round-off."""
UPDATE_TOLERANCE = 1e-4
"""Largest relative L2 difference of a parameter's update against the model's optimizer
replayed on the ranks' own gradients: the same arithmetic on the same numbers; the margin is
for optimizers whose kernels group parameters differently (``foreach``) on another device."""


def gradient_tolerance(dtype: torch.dtype) -> float:
    """The relative gradient tolerance of a parameter of ``dtype`` (see
    :data:`GRADIENT_TOLERANCES`)."""
    return GRADIENT_TOLERANCES.get(dtype, DEFAULT_GRADIENT_TOLERANCE)


@dataclass(frozen=True)
class ReferenceRun:
    """What single-process training on the whole global batch gives."""

    params: dict[str, torch.Tensor]
    """Parameters after the last step, by canonical name (a tied parameter once)."""
    first_grads: dict[str, torch.Tensor]
    """Gradients of the first step (before the optimizer, after any clipping), by
    canonical name."""
    losses: tuple[float, ...]
    """Global-batch mean loss of each step."""
    grad_norms: tuple[float, ...] = ()
    """Gradient L2 norm of each step before clipping (empty without ``MAX_GRAD_NORM``)."""


def reference_steps(plan: Plan, model_file: ModelFile, num_steps: int = 1) -> ReferenceRun:
    """Train ``num_steps`` steps in one process on the plan's global batches.

    Same seed, same data (``BatchSource``), same optimizer (``make_optimizer`` or AdamW) as
    the ranks, the same autocast (``reference_precision``), the same clipping
    (``torch.nn.utils.clip_grad_norm_`` to ``MAX_GRAD_NORM``, before ``first_grads`` is
    taken, as the ranks dump clipped gradients); the full model, no pipeline, no
    micro-batches, the model's own dropout.
    """
    with torch.random.fork_rng(devices=[]):
        model, source = _build(plan, model_file)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = model_file.optimizer(params)
        losses = []
        grad_norms: list[float] = []
        first_grads: dict[str, torch.Tensor] = {}
        for step in range(num_steps):
            batch = source.global_batch(step)
            loss, norm = _forward_backward(model, model_file, batch, reference_precision(plan))
            losses.append(loss)
            if norm is not None:
                grad_norms.append(norm)
            if step == 0:
                first_grads = _grads(model)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    params_now = {name: p.detach().clone() for name, p in model.named_parameters()}
    return ReferenceRun(params_now, first_grads, tuple(losses), tuple(grad_norms))


def reference_precision(plan: Plan) -> Precision:
    """The precision the reference computes in: the ranks' when they share one, else fp32.

    A loss scale changes no gradient that stays finite, so fp16 plans are checked with fp16
    autocast and no scaler."""
    used = {r.precision for r in plan.ranks}
    return used.pop() if len(used) == 1 else Precision.FP32


@dataclass(frozen=True)
class WorstDifference:
    """The parameter that came closest to (or furthest past) its tolerance."""

    name: str | None
    """Canonical parameter name; None when no parameter was compared."""
    rank: int | None
    """The rank whose copy it is (a parameter held by several ranks is compared on each)."""
    relative_difference: float
    """Its relative L2 difference (dimensionless; :func:`relative_difference`)."""
    tolerance: float
    """Its tolerance (by dtype for gradients); the worst is the largest difference /
    tolerance."""
    passed: bool
    """Every compared parameter is within its tolerance."""

    def describe(self, kind: str) -> str:
        """E.g. ``gradients: worst h.0.attn.c_attn.weight (rank 1) rel 3.1e-06 (tol 1e-04)
        pass``."""
        verdict = "pass" if self.passed else "FAIL"
        if self.name is None:
            return f"{kind}: none compared {verdict}"
        diff = "0" if self.relative_difference == 0 else f"{self.relative_difference:.1e}"
        return (
            f"{kind}: worst {self.name} (rank {self.rank}) rel {diff} "
            f"(tol {self.tolerance:.0e}) {verdict}"
        )


@dataclass(frozen=True)
class VerifyResult:
    """The verified first step of a rehearsal against one process."""

    gradients: WorstDifference
    """Synced gradients against one-process autograd."""
    updates: WorstDifference
    """Parameter updates against the model's optimizer replayed on the ranks' gradients."""
    loss: float | None
    """The ranks' global-batch mean loss of the step (None: no last stage dumped one)."""
    reference_loss: float
    dropout_off: dict[str, int]
    """Dropout calls that ran with probability 0 (on the ranks too) in the reference step,
    by function (empty: the model has no active dropout)."""
    random_draws: dict[str, int]
    """Other random operators the reference forward and backward ran, by ATen name."""
    passed: bool
    data_changed: bool = False
    """The model file gave this process other step-0 samples than the ranks trained on (its
    data changed after they read it); the reference ran on the ranks' batch."""
    batch_norms: tuple[str, ...] = ()
    """The model's batch-norm modules, when the plan splits the global batch (their
    statistics are then each micro-batch's, not the whole batch's, and the reference ran
    the plan's micro-batches one after another)."""

    def describe(self) -> str:
        """One line: both comparisons and the verdict."""
        return (
            f"verify: {self.gradients.describe('gradients')}; "
            f"{self.updates.describe('parameter updates')}"
        )

    def notes(self) -> list[str]:
        """What the check changed or could not control, for the user."""
        notes = []
        if self.data_changed:
            notes.append(
                "verify: the model file's step-0 batch changed after the ranks read it (a file "
                "its dataset() reads was edited during the rehearsal?); the reference ran on "
                "the samples the ranks trained on"
            )
        if self.dropout_off:
            calls = sum(self.dropout_off.values())
            notes.append(
                f"verify: dropout was off in step 0 in both runs ({calls} dropout calls with "
                "p > 0 run at p = 0); the steps after it use the model's dropout"
            )
        if self.batch_norms:
            shown = ", ".join(self.batch_norms[:3]) + (", ..." if len(self.batch_norms) > 3 else "")
            notes.append(
                f"verify: the model has batch norm ({shown}); it normalises each micro-batch "
                "by that micro-batch's statistics (as under DDP without SyncBatchNorm), so the "
                "one process ran the plan's micro-batches one after another, not the whole "
                "batch at once"
            )
        if self.random_draws:
            names = ", ".join(f"{name} x{n}" for name, n in sorted(self.random_draws.items()))
            notes.append(
                f"verify: the forward draws random numbers outside dropout ({names}); one "
                "process cannot draw the same ones, so gradients may differ for that reason"
            )
        return notes


@dataclass(frozen=True)
class _Reference:
    model: torch.nn.Module
    initial: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    loss: float
    dropout_off: dict[str, int]
    random_draws: dict[str, int]
    data_changed: bool = False
    round_off: dict[str, float] = field(default_factory=dict)
    """Per parameter, the round-off of the step on the plan's micro-batches (L2)."""


@dataclass(frozen=True)
class _RanksBatch:
    """Step 0's global batch as the ranks read it (``executor/training._dump_verify``)."""

    digest: str
    """``data.batch_digest`` of it, the same on every rank."""
    tensors: list[torch.Tensor]
    """Its tensors (``data.batch_tensors``), from rank 0's dump."""


def _ranks_batch(grad_dumps: Sequence[Mapping[str, Any]]) -> _RanksBatch | None:
    """The ranks' step-0 batch (None: dumps without one, from before they carried it).

    Raises:
        ConfigError: two ranks read different step-0 data.
    """
    digests = [d.get("batch_digest") for d in grad_dumps]
    if not digests or digests[0] is None or "batch" not in grad_dumps[0]:
        return None
    for rank, digest in enumerate(digests):
        if digest != digests[0]:
            raise ConfigError(
                f"verify: rank {rank} read other step-0 samples than rank 0, so the ranks "
                "trained on different data (the model file's sample_batch()/dataset() gave "
                "them different batches: was a file it reads edited while they started?); "
                "rehearse again with the data unchanged"
            )
    return _RanksBatch(digests[0], list(grad_dumps[0]["batch"]))


def _step_zero_batch(source: BatchSource, ranks_batch: _RanksBatch | None) -> tuple[Any, bool]:
    """Step 0's global batch for the reference, and whether it is the ranks' rather than
    what ``source`` reads now (the model file's data changed since the ranks read it).

    Raises:
        ConfigError: the ranks' batch does not fit the nesting of this one.
    """
    batch = source.global_batch(0)
    if ranks_batch is None or batch_digest(batch) == ranks_batch.digest:
        return batch, False
    try:
        theirs = with_batch_tensors(batch, ranks_batch.tensors)
    except ValueError as exc:
        theirs, reason = None, str(exc)
    else:
        reason = "its other leaves or its nesting differ"
    if theirs is None or batch_digest(theirs) != ranks_batch.digest:
        raise ConfigError(
            "verify: the model file's step-0 batch changed after the ranks read it, and the "
            f"ranks' batch does not fit the one read now ({reason}); rehearse again with the "
            "data unchanged"
        )
    return theirs, True


def verify_first_step(plan: Plan, model_file: ModelFile, verify_dir: Path) -> VerifyResult:
    """Compare the ranks' first step (``grads-rank-<r>.pt`` and ``params-rank-<r>.pt`` in
    ``verify_dir``) with one process: gradients and updates (module docstring).

    The verified step runs with dropout off in both runs (``executor/random_ops.py``);
    other random draws are recorded and named, since nothing here makes them agree. The
    reference reads step 0's batch again after the ranks finished, and a model file's
    ``dataset()`` may read files that changed meanwhile; so every rank dumps a fingerprint
    of its step-0 batch and rank 0 its tensors (``executor/data.batch_digest``): ranks that
    disagree are refused, and when only the reference's batch differs it runs on the
    ranks' batch, with a note.

    Raises:
        ConfigError: a dump names a parameter the model lacks, or no rank holds one; the
            ranks read different step-0 data, or rank 0's batch does not fit this one's.
    """
    grad_dumps = _load(verify_dir, "grads", plan.world_size)
    param_dumps = _load(verify_dir, "params", plan.world_size)
    ranks_batch = _ranks_batch(grad_dumps)
    with torch.random.fork_rng(devices=[]):
        reference = _reference_first_step(plan, model_file, ranks_batch)
        _check_names(reference.initial, [d["tensors"] for d in param_dumps])
        synced = _first_copies([d["tensors"] for d in grad_dumps])
        replayed = replay_update(reference.model, model_file, synced)
    half = reference_precision(plan).autocast_dtype
    gradients = compare_gradients(
        reference.grads,
        [d["tensors"] for d in grad_dumps],
        compute_dtype=None if half is None else getattr(torch, half),
        round_off=reference.round_off,
    )
    updates = compare_updates(reference.initial, replayed, [d["tensors"] for d in param_dumps])
    with_loss = [d for d in grad_dumps if d["loss"] is not None]
    loss = (
        sum(d["loss"] * d["samples"] for d in with_loss) / plan.global_batch_size
        if with_loss
        else None
    )
    return VerifyResult(
        gradients=gradients,
        updates=updates,
        loss=loss,
        reference_loss=reference.loss,
        dropout_off=reference.dropout_off,
        random_draws=reference.random_draws,
        passed=gradients.passed and updates.passed,
        data_changed=reference.data_changed,
        batch_norms=_batch_norms(reference.model) if _splits_batch(plan) else (),
    )


def _batch_norms(model: torch.nn.Module) -> tuple[str, ...]:
    """Paths of the model's batch-norm modules (they normalise by the batch in training)."""
    return tuple(
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
    )


def _splits_batch(plan: Plan) -> bool:
    """Whether some rank runs a micro-batch smaller than the global batch."""
    return any(r.micro_batch_size < plan.global_batch_size for r in plan.ranks)


def compare_gradients(
    reference: Mapping[str, torch.Tensor],
    dumps: Sequence[Mapping[str, torch.Tensor]],
    compute_dtype: torch.dtype | None = None,
    round_off: Mapping[str, float] | None = None,
) -> WorstDifference:
    """Every rank's synced gradient of every parameter against one-process autograd.

    Args:
        reference: one-process gradients by canonical name (a missing one counts as zero).
        dumps: each rank's gradients by canonical name.
        compute_dtype: the autocast dtype both runs computed in (its tolerance and round-off
            floor apply; fp32 gradients of bf16 matmuls carry bf16 error); None: each
            gradient's own dtype.
        round_off: per parameter, the L2 round-off of one process summing its gradient in
            another order (``round_off.round_off_norms``); a rank may differ by
            :data:`ROUND_OFF_MARGIN` times it. None: the dtype floor alone.
    """
    typical_rms = _rms(list(reference.values()))
    measured = round_off or {}
    pairs = []
    for rank, tensors in enumerate(dumps):
        for name, grad in tensors.items():
            expected = reference.get(name, torch.zeros_like(grad))
            dtype = compute_dtype or grad.dtype
            tolerance = gradient_tolerance(dtype)
            eps = torch.finfo(dtype).eps
            floor = max(
                GRADIENT_FLOOR_EPS * eps * typical_rms * math.sqrt(expected.numel()),
                ROUND_OFF_MARGIN * measured.get(name, 0.0) / tolerance,
            )
            diff = relative_difference(grad, expected, floor=floor)
            pairs.append((name, rank, diff, tolerance))
    return _worst(pairs)


def compare_updates(
    initial: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    dumps: Sequence[Mapping[str, torch.Tensor]],
) -> WorstDifference:
    """Every rank's update of every parameter (``after - initial``) against the expected
    parameters' update, relative to the expected update's L2 norm."""
    pairs = []
    for rank, tensors in enumerate(dumps):
        for name, after in tensors.items():
            start = initial[name].double()
            diff = relative_difference(after.double() - start, expected[name].double() - start)
            pairs.append((name, rank, diff, UPDATE_TOLERANCE))
    return _worst(pairs)


def relative_difference(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> float:
    """``||actual - expected|| / max(||expected||, floor)`` (L2 over all elements, in
    float64); the plain ``||actual - expected||`` where that scale is 0."""
    diff = torch.linalg.vector_norm((actual.double() - expected.double()).reshape(-1))
    scale = max(float(torch.linalg.vector_norm(expected.double().reshape(-1))), floor)
    if scale == 0.0:
        return float(diff)
    return float(diff) / scale


def _worst(pairs: Sequence[tuple[str, int, float, float]]) -> WorstDifference:
    """The pair with the largest difference / tolerance (the first of equals)."""
    if not pairs:
        return WorstDifference(None, None, 0.0, UPDATE_TOLERANCE, True)
    name, rank, diff, tolerance = max(pairs, key=lambda p: p[2] / p[3])
    return WorstDifference(name, rank, diff, tolerance, all(d <= t for _, _, d, t in pairs))


def _rms(tensors: Sequence[torch.Tensor]) -> float:
    numel = sum(t.numel() for t in tensors)
    if numel == 0:
        return 0.0
    total = sum(float(t.double().pow(2).sum()) for t in tensors)
    return math.sqrt(total / numel)


def _build(plan: Plan, model_file: ModelFile) -> tuple[torch.nn.Module, BatchSource]:
    torch.manual_seed(plan.training.seed)
    model = model_file.build()
    source = BatchSource(
        model_file,
        lambda raw: bind_inputs(model, raw),
        plan.training.seed,
        plan.global_batch_size,
        plan.model.inputs,
    )
    return model, source


def _forward_backward(
    model: torch.nn.Module,
    model_file: ModelFile,
    batch: tuple[Any, Any],
    precision: Precision = Precision.FP32,
    spans: Sequence[tuple[int, int]] | None = None,
) -> tuple[float, float | None]:
    """Forward (under ``precision``'s autocast) and backward of a whole global batch
    ``(inputs, targets)``, or of its samples ``[start, stop)`` of each of ``spans`` one
    after another, each micro-batch's mean loss weighted by its share of the batch (as the
    ranks weight theirs); then the model file's clipping (``MAX_GRAD_NORM``), as the ranks
    clip their synced gradients. Returns the mean loss and the norm before clipping (None
    without clipping)."""
    parts, weights = [batch], [1.0]
    if spans is not None:
        num_samples = sum(stop - start for start, stop in spans)
        parts = [_samples(batch, start, stop) for start, stop in spans]
        weights = [(stop - start) / num_samples for start, stop in spans]
    total = 0.0
    for (inputs, targets), weight in zip(parts, weights, strict=True):
        with autocast(torch.device("cpu"), precision):
            outputs = model(**forward_kwargs(bind_inputs(model, inputs)))
            loss = checked_loss(model_file, outputs, targets, require_grad=True)
        (loss * weight).backward()
        total += float(loss.detach()) * weight
    norm = None
    if model_file.max_grad_norm is not None:
        params = [p for p in model.parameters() if p.requires_grad]
        norm = float(torch.nn.utils.clip_grad_norm_(params, model_file.max_grad_norm))
    return total, norm


def _samples(batch: tuple[Any, Any], start: int, stop: int) -> tuple[Any, Any]:
    return slice_samples(batch[0], start, stop), slice_samples(batch[1], start, stop)


def _microbatch_spans(plan: Plan) -> list[tuple[int, int]]:
    """``[start, stop)`` in the global batch of every micro-batch of every replica, in
    replica and micro-batch order."""
    spans = []
    for replica in range(plan.num_replicas):
        first = plan.replica_ranks(replica)[0]
        start = plan.sample_offset(replica)
        for size in microbatch_sizes(first.num_samples, first.micro_batch_size):
            spans.append((start, start + size))
            start += size
    return spans


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference_first_step(
    plan: Plan, model_file: ModelFile, ranks_batch: _RanksBatch | None = None
) -> _Reference:
    """Step 0's gradients in one process, dropout off, on the ranks' step-0 batch when
    given (:func:`_step_zero_batch`); the model keeps its initial parameters (no optimizer
    step)."""
    model, source = _build(plan, model_file)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    batch, changed = _step_zero_batch(source, ranks_batch)
    precision = reference_precision(plan)
    has_batch_norm = bool(_batch_norms(model))
    spans = _microbatch_spans(plan) if has_batch_norm and _splits_batch(plan) else None
    with DropoutOff() as off, RandomDraws() as draws:
        loss, _ = _forward_backward(model, model_file, batch, precision, spans)
    grads = _grads(model)
    floors: dict[str, float] = {}
    if not has_batch_norm:  # batch norm's gradients depend on the split itself
        with DropoutOff():
            split = split_gradients(plan, model_file, model, batch, precision)
        if split is not None and _same_loss(split.loss, loss, precision):
            floors = round_off_norms(grads, split.grads)
    return _Reference(
        model, initial, grads, loss, dict(off.calls), dict(draws.calls), changed, floors
    )


def _same_loss(split: float, whole: float, precision: Precision) -> bool:
    """Whether the micro-batches' weighted losses add up to the whole batch's, within the
    gradient tolerance of the dtype the step computed in."""
    half = precision.autocast_dtype
    tolerance = gradient_tolerance(torch.float32 if half is None else getattr(torch, half))
    return abs(split - whole) <= tolerance * max(abs(whole), 1e-12)


def replay_update(
    model: torch.nn.Module, model_file: ModelFile, grads: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """One step of the model file's optimizer on ``grads``, built and scheduled as on the
    ranks (``make_scheduler`` runs before the step).

    Args:
        model: the full model at its initial parameters; stepped in place.
        grads: gradients by canonical name; a parameter without one gets ``grad = None``.

    Returns:
        Every parameter after the step, by canonical name.
    """
    named = dict(model.named_parameters())
    for name, param in named.items():
        param.grad = grads[name].clone() if name in grads else None
    optimizer = model_file.optimizer([p for p in named.values() if p.requires_grad])
    if model_file.make_scheduler is not None:
        model_file.make_scheduler(optimizer)
    optimizer.step()
    return {name: p.detach().clone() for name, p in named.items()}


def _first_copies(dumps: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each parameter's tensor from the first rank that holds it."""
    first: dict[str, torch.Tensor] = {}
    for tensors in dumps:
        for name, tensor in tensors.items():
            first.setdefault(name, tensor)
    return first


def _check_names(
    reference: Mapping[str, torch.Tensor], dumps: Sequence[Mapping[str, torch.Tensor]]
) -> None:
    """Raises ConfigError: a rank holds a name the model lacks, or no rank holds one."""
    seen: set[str] = set()
    for tensors in dumps:
        unknown = sorted(set(tensors) - set(reference))
        if unknown:
            raise ConfigError(f"verify: rank parameter {unknown[0]!r} is not in the model")
        seen |= set(tensors)
    missing = sorted(set(reference) - seen)
    if missing:
        raise ConfigError(f"verify: no rank holds parameter {missing[0]!r}")


def _load(verify_dir: Path, kind: str, world_size: int) -> list[dict[str, Any]]:
    return [
        torch.load(verify_dir / f"{kind}-rank-{r}.pt", weights_only=True) for r in range(world_size)
    ]
