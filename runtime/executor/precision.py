"""A rank's number format: autocast around its compute, TF32 switches, one shared loss scale.

The plan gives every rank a ``Precision`` (``contract/plan.py``). Parameters, gradients and
optimizer state keep the model's dtype; what changes is how the stage computes:

- ``bf16`` / ``fp16``: the stage's forward (and its loss) runs under
  ``torch.autocast(device_type, dtype)``; the backward replays the autocast ops' casts.
  Floating boundary tensors travel in the autocast dtype (``contract.plan.wire_spec``).
- ``tf32``: ``torch.backends.cuda.matmul.allow_tf32`` on this process (on a GPU); ``fp32``
  leaves PyTorch's defaults (matmuls in float32, cuDNN convolutions in TF32).

Loss scaling (Micikevicius et al., "Mixed Precision Training", ICLR 2018): when any rank of
the plan computes in fp16, every rank holds a ``ShardedGradScaler`` (torch's GradScaler
whose ``unscale_`` sums the non-finite flags over a process group). The last stages scale
their loss; gradients cross stages and replicas at that scale (one scale everywhere, since
every rank starts at the same scale and takes the same decisions); after the gradient sync
each rank unscales its gradients, the flags are summed over *every* rank, and so a
non-finite gradient anywhere skips the step on every rank and halves the scale everywhere.
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
