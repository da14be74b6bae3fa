"""Batch shares that follow the replicas' measured speeds during a run.

A plan shares the global batch by the speeds its profile predicted; a real node runs at its
own speed, which drifts. Every sample has its place in the global batch whatever the shares
(``data.py``), so moving samples between replicas between two steps leaves the summed
gradient, and the training, as it was (up to the order of a float sum).
:class:`ShareBalancer` does it for plans whose replicas are one stage each and sync every
step (``Plan.fixed_shares_reason``): each rank posts its replica's median speed
(:func:`step_speed`) in the job's agreement after a step (``agreement.StepAgreement``);
every rank reads the same values at the same step and takes the same new shares
(:func:`balanced_shares`, within :func:`sample_caps`) from its next step when they shorten
the predicted step by more than ``MIN_GAIN``. Each replica keeps its plan's number of
micro-batches, cut evenly (:func:`even_cut`), none below the plan's
``min_microbatch_samples``.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from hplan.runtime.contract.memory import device_capacity_bytes, rank_memory
from hplan.runtime.contract.metrics_file import StepMetrics
from hplan.runtime.contract.plan import Plan, microbatch_sizes

__all__ = [
    "MAX_GROWTH",
    "MIN_GAIN",
    "MIN_WINDOW_STEPS",
    "WINDOW_STEPS",
    "ReplicaSpeed",
    "ShareBalancer",
    "ShareChange",
    "balanced_shares",
    "even_cut",
    "predicted_step_s",
    "step_speed",
]

WINDOW_STEPS = 20
"""The most recent steps whose median speed a rank posts: enough that a node's step-to-step
noise does not move samples back and forth (chosen on replays, ``bench/share_replay.py``)."""
MIN_WINDOW_STEPS = 6
"""Steps a rank measures before it posts its speed at all."""
MIN_GAIN = 0.03
"""New shares are taken only when they shorten the predicted step (compute and fixed time of
the slowest replica) by more than this: the medians' noise must not move samples back and
forth between identical nodes, while a real imbalance predicts more."""
MAX_GROWTH = 1.25
"""A replica's micro-batches grow to at most this times the plan's (and within its rank's
memory, :func:`sample_caps`): the plan's memory was checked at its own sizes."""


@dataclass(frozen=True, slots=True)
class ReplicaSpeed:
    """What one replica measured at its current share."""

    compute_per_sample_s: float
    """Sustained forward + backward seconds a sample."""
    fixed_s: float
    """Sustained seconds a step that do not grow with the share (:meth:`ShareBalancer.observe`)."""


@dataclass(frozen=True, slots=True)
class ShareChange:
    """New shares, from a step on."""

    first_step: int
    shares: tuple[int, ...]
    """Samples of the global batch per replica, in replica order."""
    predicted_gain: float
    """Predicted step at the old shares over the new, minus 1 (0.03: 3% shorter)."""


def even_cut(num_samples: int, num_microbatches: int) -> tuple[int, ...]:
    """``num_samples`` cut into ``num_microbatches`` micro-batches that differ by at most one
    sample, larger first (the plan's even cut, ``microbatch_sizes(n, ceil(n / k))``, where
    that has ``k`` micro-batches). Example: 51 in 2 -> (26, 25)."""
    assert 1 <= num_microbatches <= num_samples
    base, extra = divmod(num_samples, num_microbatches)
    return (base + 1,) * extra + (base,) * (num_microbatches - extra)


def predicted_step_s(shares: Sequence[int], speeds: Sequence[ReplicaSpeed]) -> float:
    """The slowest replica's compute and fixed time at ``shares`` (seconds)."""
    return max(n * s.compute_per_sample_s + s.fixed_s for n, s in zip(shares, speeds, strict=True))


def balanced_shares(
    global_batch: int,
    speeds: Sequence[ReplicaSpeed],
    floors: Sequence[int],
    caps: Sequence[int],
) -> tuple[int, ...]:
    """Shares of ``global_batch`` that end the replicas' compute and fixed time together.

    Every replica starts at its floor; each further sample goes to the replica that would
    end first with it (``(n + 1) * c + fixed``), among those below their cap: the shares
    whose slowest replica ends first, in whole samples.

    Args:
        global_batch: samples a step.
        speeds: per replica, its measured seconds a sample and fixed seconds.
        floors: per replica, its fewest samples (``min_microbatch_samples`` a
            micro-batch).
        caps: per replica, its most samples (``sample_caps``).

    Returns:
        Samples per replica, summing to ``global_batch``.

    Raises:
        ValueError: the floors exceed the batch or the caps cannot hold it.
    """
    if not sum(floors) <= global_batch <= sum(caps):
        raise ValueError(f"{global_batch} samples do not fit floors {floors} and caps {caps}")
    shares = list(floors)
    heap = [
        ((n + 1) * s.compute_per_sample_s + s.fixed_s, r)
        for r, (n, s) in enumerate(zip(shares, speeds, strict=True))
        if n < caps[r]
    ]
    heapq.heapify(heap)
    for _ in range(global_batch - sum(floors)):
        _, r = heapq.heappop(heap)
        shares[r] += 1
        if shares[r] < caps[r]:
            s = speeds[r]
            heapq.heappush(heap, ((shares[r] + 1) * s.compute_per_sample_s + s.fixed_s, r))
    return tuple(shares)


def step_speed(record: StepMetrics) -> ReplicaSpeed:
    """A step's sustained compute a sample and, under a binding CPU quota, all its CPU time
    outside compute over the quota (the optimizer's alone would leave much of a step's
    fixed time out), else its optimizer step's wall time.

    Raises:
        ValueError: the record has no samples.
    """
    if record.samples <= 0:
        raise ValueError(f"rank {record.rank} step {record.step} computed no samples")
    compute_s = record.sustained_s(record.compute_time_s, record.compute_cpu_time_s)
    fixed_s = record.sustained_s(
        record.optimizer_time_s, record.cpu_time_s - record.compute_cpu_time_s
    )
    return ReplicaSpeed(compute_s / record.samples, fixed_s)


def sample_caps(plan: Plan, growth: float = MAX_GROWTH) -> tuple[int, ...]:
    """Per replica, the most samples its share may reach: its plan's micro-batch count at
    the largest micro-batch of at most ``growth`` times the plan's whose predicted peak
    memory (``contract.memory.rank_memory``) fits the rank's device; the plan's size when
    the plan carries no memory sizes."""
    devices = {d.name: d for d in plan.cluster.devices}
    caps = []
    for replica in range(plan.num_replicas):
        (rank,) = plan.replica_ranks(replica)
        size = rank.micro_batch_size
        if plan.memory is not None:
            capacity = device_capacity_bytes(devices[rank.device])
            low, high = size, max(size, math.floor(size * growth))
            while low < high:  # the largest size that fits, memory growing with it
                middle = (low + high + 1) // 2
                grown = replace(rank, micro_batch_size=middle)
                if rank_memory(plan, grown, plan.memory).total_bytes <= capacity:
                    low = middle
                else:
                    high = middle - 1
            size = low
        caps.append(size * rank.num_microbatches)
    return tuple(caps)


def _usable(speed: ReplicaSpeed) -> bool:
    return speed.compute_per_sample_s > 0 and math.isfinite(speed.fixed_s)


class ShareBalancer:
    """One rank's view of the replicas' shares; every rank of the job holds one and they
    change together (values posted before the last change are stale).

    Call :meth:`observe` after every step, :meth:`posted` for what to post in the exchange,
    and :meth:`agreed` with every agreement read; :meth:`sizes` and :meth:`offset` give the
    current cut.
    """

    def __init__(self, plan: Plan, rank: int) -> None:
        reason = plan.fixed_shares_reason()
        assert reason is None, reason
        self.plan = plan
        self.replica = next(r.replica for r in plan.ranks if r.rank == rank)
        firsts = [plan.replica_ranks(r)[0] for r in range(plan.num_replicas)]
        self.plan_shares = tuple(r.num_samples for r in firsts)
        self.counts = tuple(r.num_microbatches for r in firsts)
        floor = plan.training.min_microbatch_samples
        self.floors = tuple(count * floor for count in self.counts)
        """Per replica, its fewest samples: ``min_microbatch_samples`` a micro-batch."""
        self.plan_sizes = tuple(microbatch_sizes(r.num_samples, r.micro_batch_size) for r in firsts)
        self.caps = sample_caps(plan)
        self.shares = self.plan_shares
        self.epoch = 0
        """Changes so far: values posted under another epoch are stale."""
        self.changes: list[ShareChange] = []
        self._window: deque[ReplicaSpeed] = deque(maxlen=WINDOW_STEPS)

    def observe(self, record: StepMetrics) -> None:
        """Keep a step's measured speed (:func:`step_speed`)."""
        if record.samples > 0:
            self._window.append(step_speed(record))

    def posted(self) -> tuple[int, ReplicaSpeed] | None:
        """(replica, its median speed over the window) once it holds ``MIN_WINDOW_STEPS``,
        else None."""
        if len(self._window) < MIN_WINDOW_STEPS:
            return None
        return self.replica, ReplicaSpeed(
            statistics.median(s.compute_per_sample_s for s in self._window),
            statistics.median(s.fixed_s for s in self._window),
        )

    def agreed(
        self, epoch: int, speeds: Sequence[ReplicaSpeed | None], next_step: int
    ) -> ShareChange | None:
        """Act on an agreement's speeds (posted under ``epoch``): the change taken from
        ``next_step`` on, or None (stale or missing values, or too small a gain)."""
        known = [s for s in speeds if s is not None and _usable(s)]
        if epoch != self.epoch or len(known) != len(speeds):
            return None
        shares = balanced_shares(self.plan.global_batch_size, known, self.floors, self.caps)
        before_s = predicted_step_s(self.shares, known)
        after_s = predicted_step_s(shares, known)
        gain = before_s / after_s - 1.0
        if shares == self.shares or gain <= MIN_GAIN:
            return None
        change = ShareChange(next_step, shares, gain)
        self.shares = shares
        self.epoch += 1
        self.changes.append(change)
        return change

    def sizes(self, replica: int | None = None) -> tuple[int, ...]:
        """The micro-batch sizes of ``replica`` (this rank's by default) at the current shares."""
        replica = self.replica if replica is None else replica
        if self.shares[replica] == self.plan_shares[replica]:
            return self.plan_sizes[replica]
        return even_cut(self.shares[replica], self.counts[replica])

    def offset(self, replica: int | None = None) -> int:
        """Index of ``replica``'s first sample in the global batch at the current shares."""
        replica = self.replica if replica is None else replica
        return sum(self.shares[:replica])

    def shares_at(self, step: int) -> tuple[int, ...]:
        """The shares step ``step`` ran with."""
        shares = self.plan_shares
        for change in self.changes:
            if change.first_step <= step:
                shares = change.shares
        return shares
