"""A rank's number format: autocast around its compute, TF32 switches, one shared loss scale.

The plan gives every rank a ``Precision`` (``contract/plan.py`` says what each mode does).
Parameters, gradients and optimizer state keep the model's dtype: ``bf16`` and ``fp16`` run
the stage's forward (and its loss) under ``torch.autocast(device_type, dtype)``, whose casts
the backward replays; ``tf32`` sets ``torch.backends.cuda.matmul.allow_tf32`` on a GPU.

Loss scaling (Micikevicius et al., "Mixed Precision Training", ICLR 2018): when any rank of
the plan computes in fp16, every rank holds a ``ShardedGradScaler`` (torch's GradScaler
whose ``unscale_`` sums the non-finite flags over a process group). The last stages scale
their loss; gradients cross stages and replicas at that one scale (every rank starts at it
and takes the same decisions); after the gradient sync the flags are summed over *every*
rank, so a non-finite gradient anywhere skips the step and halves the scale everywhere.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hplan.runtime.contract.plan import Plan, Precision

if TYPE_CHECKING:
    # 0.45 s to import (DTensor, sympy): the scaler is built only for fp16 plans.
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


def autocast(device: torch.device, precision: Precision) -> contextlib.AbstractContextManager[None]:
    """The context a stage's forward runs in: ``torch.autocast`` for bf16/fp16, else none."""
    name = precision.autocast_dtype
    if name is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=getattr(torch, name))


def configure_matmul_precision(device: torch.device, precision: Precision) -> None:
    """Set this process's TF32 switch for float32 matmuls (GPU only; CPUs have no TF32)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = precision is Precision.TF32


def loss_scaler(plan: Plan, device: torch.device) -> ShardedGradScaler | None:
    """The job's shared loss scaler on this rank, or None when no rank computes in fp16.

    Its scale is initialised here (GradScaler does it on the first ``scale``, which only
    the last stages call), so that every rank can unscale and vote from the first step.
    """
    if not plan.loss_scaling:
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    scaler = ShardedGradScaler(device=device.type, process_group=dist.group.WORLD)
    scaler.scale(torch.zeros((), device=device))
    return scaler
