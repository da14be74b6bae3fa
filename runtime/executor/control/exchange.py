"""The one collective the ranks run between steps: a MAX all-reduce of one small tensor.

:class:`StepControl` posts what this rank asks of the job after a step (:class:`Post`: its
:class:`StepFlags`, the newest checkpoint it has written, its replica's loss, rank 0's
proposed interval, its replica's measured speed) and reads, without waiting for it then,
what every rank posted, combined (:class:`Agreement`). Every value is encoded so that the
maximum over the ranks is what the job needs: the flags any rank set, the smallest written
step (negated), the one rank that posts a replica's loss or speed (``-inf`` elsewhere).
When to post and when to read is ``agreement.StepAgreement``'s business; the all-reduce
itself is a parameter, so that the protocol can be driven without processes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntFlag
from typing import Protocol

import torch
import torch.distributed as dist

from hplan.runtime.contract.errors import PeerFailureError, error_reason

__all__ = [
    "CONTROL_PERIOD_S",
    "Agreement",
    "Post",
    "StepControl",
    "StepFlags",
    "control_interval_steps",
    "encode_post",
]

CONTROL_PERIOD_S = 0.5
"""About how often, in seconds of training, the ranks exchange their step flags
(:func:`control_interval_steps`): a SIGTERM or a non-finite loss is acted on about that
much later at most, one step after the exchange that carries it."""


def control_interval_steps(step_time_s: float) -> int:
    """Steps between two exchanges of :class:`StepControl`: as many whole steps of
    ``step_time_s`` (rank 0's measured step) as fit in ``CONTROL_PERIOD_S``, at least one
    (one for a time that is not positive and finite)."""
    if not (math.isfinite(step_time_s) and step_time_s > 0):
        return 1
    return max(1, int(CONTROL_PERIOD_S / step_time_s))


class StepFlags(IntFlag):
    """What a rank asks the job to do after a step (the job does what any rank asks)."""

    NONE = 0
    PREEMPTED = 1
    """Received SIGTERM: checkpoint and exit 143."""
    NONFINITE_LOSS = 2
    """A loss was not finite and the model file asked to stop on it."""
    CHECKPOINT_DUE = 4
    """Time for a periodic checkpoint (rank 0's clock decides)."""
    REPLAN = 8
    """An elastic run re-planned for its ranks' measured speeds (rank 0 decides): checkpoint
    and exit so that torchrun's agents restart under the new plan."""


@dataclass(frozen=True, slots=True)
class Post:
    """What one rank posts in an exchange."""

    flags: StepFlags = StepFlags.NONE
    written_step: int = -1
    """The newest checkpoint step this rank has written completely (-1: none)."""
    step: int = -1
    """The step these values were posted after (kept by this rank, not sent)."""
    loss: tuple[int, float] | None = None
    """(replica, its mean loss of ``step``), on a replica's last stage only."""
    interval_steps: int = 0
    """Rank 0's proposed steps between exchanges (0: no proposal; other ranks)."""
    speed: tuple[int, float, float] | None = None
    """(replica, seconds a sample, fixed seconds) as ``rebalance.ShareBalancer.posted``
    measures them; None: nothing to post."""
    speed_epoch: int = -1
    """The share changes this rank had made when it measured ``speed``."""


@dataclass(frozen=True)
class Agreement:
    """What the ranks agreed on after a step."""

    flags: StepFlags
    """What any rank asked for."""
    written_step: int
    """The newest checkpoint step that every rank has written completely (the smallest
    of the ranks' own; -1: none), so that an asynchronous save can be published as soon
    as it is complete everywhere."""
    step: int | None = None
    """The step these values were posted after (None: nothing was posted)."""
    losses: tuple[float | None, ...] = ()
    """Each replica's mean loss of that step, from its last stage (None: not posted); a
    loss that was not finite reads ``inf``."""
    interval_steps: int = 0
    """Steps between exchanges from here on, as rank 0 proposed (0: no proposal)."""
    speeds: tuple[tuple[float, float] | None, ...] = ()
    """Each replica's measured (seconds a sample, fixed seconds) at its current share
    (``rebalance.ShareBalancer.posted``; None: not posted)."""
    speed_epoch: int = -1
    """The share changes the ranks had made when they posted ``speeds``."""


NOTHING = Agreement(StepFlags.NONE, -1)
"""What a read returns when nothing was posted since the last read."""
_NO_VALUE = -math.inf


class Pending(Protocol):
    """An all-reduce in flight (``torch.distributed.Work``)."""

    def wait(self) -> object: ...


AllReduce = Callable[[torch.Tensor], Pending]
"""Starts a MAX all-reduce of a tensor in place over the job's ranks."""


def _max_all_reduce(tensor: torch.Tensor) -> Pending:
    work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True)
    assert work is not None
    return work


def encode_post(post: Post, num_replicas: int) -> list[float]:
    """``post`` as the values of the all-reduced tensor (float64 holds the integers
    exactly): flags, the negated written step, the interval, a loss slot per replica, the
    speed epoch, then a seconds-a-sample and a fixed-seconds slot per replica."""
    values = [float(int(post.flags)), float(-post.written_step), float(post.interval_steps)]
    losses = [_NO_VALUE] * num_replicas
    if post.loss is not None:
        replica, value = post.loss
        losses[replica] = value if math.isfinite(value) else math.inf
    speeds = [_NO_VALUE] * (2 * num_replicas)
    if post.speed is not None:
        replica, per_sample_s, fixed_s = post.speed
        speeds[replica], speeds[num_replicas + replica] = per_sample_s, fixed_s
    return [*values, *losses, float(post.speed_epoch), *speeds]


def _decode(values: list[float], num_replicas: int, step: int) -> Agreement:
    flags, negated, interval, *rest = values
    n = num_replicas
    losses, epoch = rest[:n], rest[n]
    per_sample, fixed = rest[n + 1 : 2 * n + 1], rest[2 * n + 1 :]
    return Agreement(
        StepFlags(int(flags)),
        -int(negated),
        step,
        tuple(None if v == _NO_VALUE else v for v in losses),
        int(interval),
        tuple(
            None if a == _NO_VALUE or b == _NO_VALUE else (a, b)
            for a, b in zip(per_sample, fixed, strict=True)
        ),
        int(epoch),
    )


class StepControl:
    """The job's agreement on each :class:`Post`, read one call late (module docstring).

    Args:
        device: where the all-reduced tensor lives (the rank's device).
        num_replicas: the plan's replicas (a loss and a speed slot each).
        all_reduce: starts the MAX all-reduce (default: ``torch.distributed``'s, async).
    """

    def __init__(
        self, device: torch.device, num_replicas: int = 1, all_reduce: AllReduce | None = None
    ) -> None:
        self._device = device
        self._num_replicas = num_replicas
        self._all_reduce = all_reduce or _max_all_reduce
        self._pending: tuple[Pending, torch.Tensor, int] | None = None

    def exchange(self, post: Post) -> Agreement:
        """Post ``post`` for the next call; return what the ranks posted at the previous
        call, combined (:data:`NOTHING` at the first call).

        Every rank must call it at the same steps, in the same order (:meth:`finish`
        reads the values posted last without posting).

        Raises:
            PeerFailureError: a peer failed.
        """
        agreed = self.finish()
        values = encode_post(post, self._num_replicas)
        tensor = torch.tensor(values, dtype=torch.float64, device=self._device)
        try:
            work = self._all_reduce(tensor)
        except RuntimeError as exc:
            raise _lost(exc) from None
        self._pending = (work, tensor, post.step)
        return agreed

    def finish(self) -> Agreement:
        """Wait for the last posted values and return them (:data:`NOTHING` when none
        are in flight).

        Raises:
            PeerFailureError: a peer failed.
        """
        if self._pending is None:
            return NOTHING
        work, tensor, step = self._pending
        self._pending = None
        try:
            work.wait()
        except RuntimeError as exc:
            raise _lost(exc) from None
        return _decode(tensor.tolist(), self._num_replicas, step)


def _lost(exc: BaseException) -> PeerFailureError:
    return PeerFailureError(
        f"a peer failed between two steps: {error_reason(exc)}; check the other ranks' logs "
        "(one probably failed first)"
    )
