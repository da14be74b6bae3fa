"""The round-off floor of ``rehearse --verify``: how far two correct one-process runs of
the same step differ.

The ranks sum a gradient in another order than one process on the whole batch (per
micro-batch, then across replicas), so their gradients differ from it by round-off, and
relative to a gradient that is 0 in exact arithmetic (a key-projection bias before a
softmax) or summed from many terms that cancel in bf16 (a norm weight), that round-off is no
small fraction. Rather than guess its size from the dtype alone, the reference runs the step
a second time on the plan's micro-batches, each loss weighted as the ranks weight it, and
takes the difference of the two runs per parameter as the floor a rank's difference is
measured against (:func:`split_gradients`), when the two runs' losses agree (a wrong
weighting would otherwise pass as round-off). A gradient scaled by 2 still fails: its
difference is the gradient itself, far above any round-off.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hplan.runtime.capture.graph_inputs import forward_kwargs
from hplan.runtime.capture.loss_items import count_items
from hplan.runtime.capture.model_file import ModelFile, checked_loss
from hplan.runtime.capture.trace import bind_inputs
from hplan.runtime.contract.plan import LossConvention, Plan, Precision, microbatch_sizes
from hplan.runtime.executor.data import MicroBatch, split_microbatches
from hplan.runtime.executor.precision import autocast


def plan_split(plan: Plan) -> list[int]:
    """The global batch's micro-batch sizes as the plan's replicas cut it, in sample order;
    two halves when that is one micro-batch (empty for a batch of one sample)."""
    sizes = [size for replica in range(plan.num_replicas) for size in _replica_sizes(plan, replica)]
    if len(sizes) > 1:
        return sizes
    whole = plan.global_batch_size
    return [whole // 2, whole - whole // 2] if whole > 1 else []


def _replica_sizes(plan: Plan, replica: int) -> list[int]:
    first = plan.replica_ranks(replica)[0]
    return list(microbatch_sizes(first.num_samples, first.micro_batch_size))


@dataclass(frozen=True)
class SplitRun:
    """The step in one process on the plan's micro-batches."""

    grads: dict[str, torch.Tensor]
    loss: float
    """The weighted sum of the micro-batches' losses: the whole batch's loss, up to
    round-off, when the plan's weighting (its ``loss_convention``) is right."""


def split_gradients(
    plan: Plan,
    model_file: ModelFile,
    model: torch.nn.Module,
    batch: tuple[Any, Any],
    precision: Precision,
) -> SplitRun | None:
    """The step's gradients in one process, accumulated over the plan's micro-batches
    (:func:`plan_split`), each loss weighted by its samples (its tokens under a token
    mean), clipped as the reference clips; the model's gradients are cleared before and
    after. None when the batch cannot be split (one sample). The caller compares its loss
    with the whole batch's: a wrong weighting shows there, and its gradients are then no
    measure of round-off.

    Args:
        model: the full model at its initial parameters (dropout off around this call).
        batch: the step's global ``(inputs, targets)``.
    """
    sizes = plan_split(plan)
    if not sizes:
        return None
    inputs, targets = batch
    batch_dims = {spec.tensor.name: spec.tensor.batch_dim for spec in plan.model.inputs}
    parts = split_microbatches(bind_inputs(model, inputs), targets, sizes, batch_dims)
    token_mean = plan.model.loss_convention is LossConvention.TOKEN_MEAN
    total = count_items(targets) if token_mean else plan.global_batch_size
    model.zero_grad(set_to_none=True)
    loss = 0.0
    for part in parts:
        weight = count_items(part.targets) if token_mean else part.num_samples
        if weight:
            loss += _backward(model, model_file, part, weight / total, precision)
    if model_file.max_grad_norm is not None:
        params = [p for p in model.parameters() if p.requires_grad]
        torch.nn.utils.clip_grad_norm_(params, model_file.max_grad_norm)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return SplitRun(grads, loss)


def _backward(
    model: torch.nn.Module,
    model_file: ModelFile,
    part: MicroBatch,
    weight: float,
    precision: Precision,
) -> float:
    with autocast(torch.device("cpu"), precision):
        outputs = model(**forward_kwargs(part.inputs))
        loss = checked_loss(model_file, outputs, part.targets, require_grad=True)
    weighted = loss.reshape(()) * weight
    weighted.backward()
    return float(weighted.detach())


def round_off_norms(
    whole: Mapping[str, torch.Tensor], split: Mapping[str, torch.Tensor]
) -> dict[str, float]:
    """Per parameter, ``||g_whole - g_split||`` (L2, float64): the round-off of summing its
    gradient in another order (a parameter without a gradient in one run counts as 0)."""
    names = set(whole) | set(split)
    return {name: _distance(whole.get(name), split.get(name)) for name in sorted(names)}


def _distance(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        present = a if a is not None else b
        assert present is not None
        return float(torch.linalg.vector_norm(present.double().reshape(-1)))
    diff = torch.linalg.vector_norm((a.double() - b.double()).reshape(-1))
    return float(diff) if math.isfinite(float(diff)) else 0.0
