"""Loss weighting and gradient all-reduce for heterogeneous data parallelism.

Replicas process different numbers of samples and may split layers differently, so:

- the last stage weights each micro-batch's loss by ``mb_samples / global_batch_size``
  (:func:`loss_weight`); the sum over all micro-batches of all replicas is then the mean
  over the global batch, whatever each replica's share;
- each parameter's gradient is summed (all-reduce SUM) among exactly the ranks that hold
  it: the ranks whose units list it in ``UnitSpec.params``. A parameter tied between two
  stages of one replica (GPT's embedding and head) is summed across those stages too.

One process group per distinct holder set, created on every rank in the same sorted order
(``torch.distributed.new_group`` is collective over the whole world), with the plan's
process-group timeout (not torch's 30-minute default). Gradients of one group
are bucketed into one flat buffer; half-precision gradients are summed in float32 and cast
back, so bf16 models work on gloo without loss of precision in the sum.

Gradient clipping (the model file's ``MAX_GRAD_NORM``, :class:`GradClip`): after the sum,
every rank holds the full gradient of each of its parameters, so the whole model's L2
norm is the square root of the sum over parameters, each counted once, on its lowest
holder (the rank checkpoints save it from, ``contract/holders.py``), of its squared norm:
one SUM all-reduce of one number over every rank. Each rank then scales all of its
gradients as ``torch.nn.utils.clip_grad_norm_`` does (``clip_grads_with_norm_``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from hplan.runtime.contract.errors import PeerFailureError, PlanMismatchError, error_reason
from hplan.runtime.contract.holders import RankSet, holder_sets, parameter_holders
from hplan.runtime.contract.plan import Plan
from hplan.runtime.executor.seams import LinkDelay


def loss_weight(mb_samples: int, global_batch_size: int) -> float:
    """Factor for one micro-batch's mean loss so that all of them sum to the global mean.

    ``loss_fn`` returns the mean over the ``mb_samples`` samples it is given; the global
    batch mean is ``sum_mb mean_mb * mb_samples / global_batch_size``.
    """
    assert 0 < mb_samples <= global_batch_size
    return mb_samples / global_batch_size


def check_stage_parameters(plan: Plan, rank: int, names: Sequence[str]) -> None:
    """Check that the stage holds exactly the parameters the plan says this rank holds.

    Raises:
        PlanMismatchError: naming a parameter that the stage and the plan disagree on.
    """
    planned = {name for name, ranks in parameter_holders(plan).items() if rank in ranks}
    for name in sorted(set(names) - planned):
        raise PlanMismatchError(
            f"rank {rank} holds parameter {name!r} that the plan does not list for its units; "
            "re-run `hplan solve` with this model file"
        )
    for name in sorted(planned - set(names)):
        raise PlanMismatchError(
            f"the plan lists parameter {name!r} for rank {rank}, but its stage does not use "
            "it; re-run `hplan solve` with this model file"
        )


@dataclass
class GradBucket:
    """The trainable parameters of this rank that one holder set shares."""

    ranks: RankSet
    group: dist.ProcessGroup
    params: list[tuple[str, nn.Parameter]]
    min_time_s: float
    """Least all-reduce time, counted from the last holder's arrival (the run's
    ``LinkDelay.all_reduce_floor_s``; 0: the real all-reduce alone)."""

    def all_reduce(self) -> None:
        """Sum the bucket's gradients over its holder set (float32 for half types).

        Emulated (``min_time_s`` > 0): the holders first agree on the latest arrival (a
        one-number MAX all-reduce; the machine's clock is shared) and each returns no
        sooner than that plus ``min_time_s``, as a ring finishes on every holder at once.
        Counted from each holder's own arrival instead, a holder that came early left as
        soon as the real reduction was done and started its next all-reduce while the
        late ones still slept (in a rehearsal of two two-stage replicas the tied
        embeddings' ring ended 4.2 ms apart on its holders).

        Raises:
            PeerFailureError: a holder died or the all-reduce timed out.
        """
        grads = [_grad_or_zeros(p) for _, p in self.params]
        wire_dtype = _wire_dtype([g.dtype for g in grads])
        flat = torch.cat([g.reshape(-1).to(wire_dtype) for g in grads])
        start_s = time.monotonic()
        if self.min_time_s > 0:
            arrival = torch.tensor([start_s], dtype=torch.float64, device=flat.device)
            self._collective(arrival, dist.ReduceOp.MAX)
            start_s = float(arrival.item())
        self._collective(flat, dist.ReduceOp.SUM)
        offset = 0
        for (_, param), grad in zip(self.params, grads, strict=True):
            numel = grad.numel()
            param.grad = flat[offset : offset + numel].view_as(grad).to(grad.dtype).clone()
            offset += numel
        remaining_s = start_s + self.min_time_s - time.monotonic()
        if remaining_s > 0:
            time.sleep(remaining_s)

    def _collective(self, tensor: Tensor, op: dist.ReduceOp.RedOpType) -> None:
        try:
            dist.all_reduce(tensor, op=op, group=self.group)
        except RuntimeError as exc:
            raise PeerFailureError(
                f"gradient all-reduce among ranks {list(self.ranks)} failed: "
                f"{error_reason(exc)}; "
                "check the logs of those ranks (one probably failed first)"
            ) from None


def _grad_or_zeros(param: nn.Parameter) -> Tensor:
    if param.grad is None:
        return torch.zeros_like(param)
    return param.grad


def _wire_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    wire = torch.float32
    for dtype in dtypes:
        wire = torch.promote_types(wire, dtype)
    return wire


@dataclass
class GradClip:
    """Global-norm gradient clipping of one rank (module docstring).

    Every rank of the job must call :meth:`clip` once per step, after the gradient sync.
    """

    max_norm: float
    """The model file's ``MAX_GRAD_NORM`` (global L2 norm, in gradient units)."""
    counted: list[nn.Parameter]
    """This rank's trainable parameters whose lowest holder it is: its share of the norm."""
    params: list[nn.Parameter]
    """Every trainable parameter of this rank: what it scales."""
    device: torch.device
    """Where the one-number all-reduce runs (the rank's device: NCCL needs a GPU tensor)."""

    def clip(self) -> float:
        """Scale this rank's gradients by ``min(1, max_norm / (norm + 1e-6))``, where
        ``norm`` is the whole model's gradient L2 norm; return ``norm`` (before clipping).

        A non-finite ``norm`` (an overflow somewhere) scales nothing: under fp16 loss
        scaling every rank skips the step anyway; otherwise the caller reports it.

        Raises:
            PeerFailureError: a rank died or the all-reduce timed out.
        """
        grads = [p.grad for p in self.counted if p.grad is not None]
        local = get_total_norm(grads) if grads else torch.zeros(())
        squared = local.to(self.device, torch.float64).square().reshape(1)
        try:
            dist.all_reduce(squared, op=dist.ReduceOp.SUM)
        except RuntimeError as exc:
            raise PeerFailureError(
                f"the gradient-norm all-reduce (MAX_GRAD_NORM) over every rank failed: "
                f"{error_reason(exc)}; check the other ranks' logs (one probably failed first)"
            ) from None
        total = squared.sqrt().reshape(())
        norm = float(total)
        if math.isfinite(norm):  # the same float32 factor on every rank, as in one process
            clip_grads_with_norm_(self.params, self.max_norm, total.float())
        return norm


def build_grad_clip(
    plan: Plan,
    rank: int,
    named_params: Sequence[tuple[str, nn.Parameter]],
    max_norm: float | None,
    device: torch.device,
) -> GradClip | None:
    """This rank's :class:`GradClip` for ``max_norm`` (None: no clipping, None returned).

    Args:
        named_params: this rank's stage parameters by canonical name (as in
            :func:`build_buckets`, which checks them against the plan).
    """
    if max_norm is None:
        return None
    holders = parameter_holders(plan)
    trainable = [(n, p) for n, p in named_params if p.requires_grad]
    counted = [p for n, p in trainable if holders[n][0] == rank]
    return GradClip(max_norm, counted, [p for _, p in trainable], device)


def build_buckets(
    plan: Plan,
    rank: int,
    named_params: Sequence[tuple[str, nn.Parameter]],
    *,
    delay: LinkDelay | None = None,
) -> list[GradBucket]:
    """Create every holder-set process group (on all ranks) and this rank's buckets.

    Must be called by every rank of the world, in the same program order, because
    ``new_group`` is collective. Parameters that do not require grad are skipped.

    Args:
        named_params: this rank's stage parameters by canonical name.
        delay: the run's link delay (``seams.LinkDelay``): each bucket lasts at least its
            ``all_reduce_floor_s``; None: the real all-reduce alone.

    Raises:
        PlanMismatchError: the stage's parameters differ from the plan's (see
            :func:`check_stage_parameters`).
    """
    check_stage_parameters(plan, rank, [name for name, _ in named_params])
    holders = parameter_holders(plan)
    buckets = []
    for ranks in holder_sets(plan):
        group = _new_group(ranks, plan.training.process_group_timeout_s)
        if rank not in ranks:
            continue
        params = [(n, p) for n, p in named_params if holders[n] == ranks and p.requires_grad]
        if not params:
            continue
        nbytes = sum(p.numel() * _wire_dtype([p.dtype]).itemsize for _, p in params)
        min_time_s = 0.0 if delay is None else delay.all_reduce_floor_s(ranks, nbytes)
        assert group is not None
        buckets.append(GradBucket(ranks, group, params, min_time_s))
    return buckets


def _new_group(ranks: RankSet, timeout_s: float) -> dist.ProcessGroup | None:
    try:
        return dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise PeerFailureError(
            f"creating the gradient group of ranks {list(ranks)} failed: {error_reason(exc)}; "
            "check the logs of those ranks (one probably failed first)"
        ) from None
