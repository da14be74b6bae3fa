"""Batch shares: how many samples each pipeline of a layout takes so that the slowest one
ends first (the search's copies, and the replicas of every island of a local plan)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from hplan.planner.cost.microbatch import PipeTimes

__all__ = ["share_options", "share_samples"]

_BISECTION_STEPS = 64
_RELATIVE_WIDTH = 1e-13
"""Bisection stops when its bracket is this narrow (relative): the heap does the rest."""


def share_samples(pipes: Sequence[PipeTimes], total: int) -> list[int]:
    """Samples per pipeline minimising the slowest one's time (water-filling by sample).

    Pipeline i takes ``pipes[i].time_s(n)`` for n samples: its full micro-batches at its
    period and a last, smaller one charged by its size (``cost.microbatch``), so a share
    need not be a whole number of micro-batches. Bulk first: bisection finds the latest time
    by which the pipelines' samples still fit in ``total``; a heap then hands out the rest
    one sample at a time to the pipeline that would finish it first (ties: the first).
    """
    if not pipes:
        return []
    lo, hi = 0.0, min(p.time_s(total) for p in pipes)
    if not np.isfinite(hi):  # memory holds fewer than ``total`` on every pipeline
        hi = max(p.time_s(p.most_samples(total)) for p in pipes)
    for _ in range(_BISECTION_STEPS):
        if hi - lo <= _RELATIVE_WIDTH * hi:
            break
        mid = (lo + hi) / 2
        if sum(p.samples_by(mid, total) for p in pipes) < total:
            lo = mid
        else:
            hi = mid
    samples = [p.samples_by(lo, total) for p in pipes]
    if sum(samples) > total:
        samples = [0] * len(pipes)
    heap = [(p.time_s(samples[i] + 1), i) for i, p in enumerate(pipes)]
    heapq.heapify(heap)
    left = total - sum(samples)
    while left > 0:
        _, i = heapq.heappop(heap)
        samples[i] += 1
        left -= 1
        heapq.heappush(heap, (pipes[i].time_s(samples[i] + 1), i))
    return samples


def share_options(pipes: Sequence[PipeTimes], total: int) -> list[list[int]]:
    """The shares worth costing: :func:`share_samples` (pipelines ending together), and the
    same water-filling in whole micro-batches (``PipeTimes.charged_whole``), whose last
    micro-batch is a full one: its backward hides more of the gradient all-reduce
    (``evaluate.allreduce_time_s``), which a share ending in a small micro-batch leaves
    exposed. The caller keeps the one the evaluator rates faster (distinct, in this order).
    """
    by_sample = share_samples(pipes, total)
    whole = share_samples([p.charged_whole() for p in pipes], total)
    return [by_sample] if whole == by_sample else [by_sample, whole]
