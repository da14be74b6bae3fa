"""Single-process reference training and the comparison behind ``rehearse --verify``.

The reference trains the *full* model in one process on the *whole* global batch of each
step: same seed, same data (``BatchSource``), same optimizer as the ranks. One distributed
step must give the same updated parameters, by name, whatever the plan's pipelines, batch
shares and micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from hplan.runtime.capture.model_file import ModelFile, checked_loss
from hplan.runtime.capture.trace import bind_inputs
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.plan import Plan, Precision
from hplan.runtime.executor.data import BatchSource
from hplan.runtime.executor.precision import autocast

REFERENCE_TOLERANCE = 1e-4
"""Largest relative difference of updated parameters for ``verify`` to pass."""


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
    micro-batches.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(plan.training.seed)
        model = model_file.build_model()
        source = BatchSource(
            model_file,
            lambda raw: bind_inputs(model, raw),
            plan.training.seed,
            plan.global_batch_size,
            plan.model.inputs,
        )
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = model_file.optimizer(params)
        losses = []
        grad_norms: list[float] = []
        first_grads: dict[str, torch.Tensor] = {}
        for step in range(num_steps):
            inputs, targets = source.global_batch(step)
            with autocast(torch.device("cpu"), reference_precision(plan)):
                outputs = model(**bind_inputs(model, inputs))
                loss = checked_loss(model_file, outputs, targets, require_grad=True)
            loss.backward()
            if model_file.max_grad_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(params, model_file.max_grad_norm)
                grad_norms.append(float(norm))
            losses.append(float(loss.detach()))
            if step == 0:
                first_grads = {
                    n: p.grad.detach().clone()
                    for n, p in model.named_parameters()
                    if p.grad is not None
                }
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


def relative_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` (L2 over all elements; 0/0 counts as 0)."""
    diff = torch.linalg.vector_norm((actual.double() - expected.double()).reshape(-1))
    scale = torch.linalg.vector_norm(expected.double().reshape(-1))
    if float(scale) == 0.0:
        return float(diff)
    return float(diff / scale)


def compare_with_reference(
    reference: dict[str, torch.Tensor], dumps: Sequence[dict[str, torch.Tensor]]
) -> float:
    """Largest relative difference over every parameter copy of every rank, by name.

    Raises:
        PlanMismatchError-like ConfigError: a rank holds a name the reference lacks, or a
            reference parameter is held by no rank.
    """
    worst = 0.0
    seen: set[str] = set()
    for tensors in dumps:
        for name, tensor in tensors.items():
            if name not in reference:
                raise ConfigError(f"verify: rank parameter {name!r} is not in the model")
            worst = max(worst, relative_difference(tensor, reference[name]))
            seen.add(name)
    missing = sorted(set(reference) - seen)
    if missing:
        raise ConfigError(f"verify: no rank holds parameter {missing[0]!r}")
    return worst


def compare_first_step(plan: Plan, model_file: ModelFile, verify_dir: Path) -> float:
    """Largest relative difference between the ranks' dumped parameters after step one
    (``params-rank-<r>.pt`` in ``verify_dir``) and the single-process reference.

    Raises:
        ConfigError: a dump names a parameter the model lacks, or misses one.
    """
    reference = reference_steps(plan, model_file).params
    dumps = [
        torch.load(verify_dir / f"params-rank-{r}.pt", weights_only=True)["tensors"]
        for r in range(plan.world_size)
    ]
    return compare_with_reference(reference, dumps)
