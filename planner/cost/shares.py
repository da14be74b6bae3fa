"""Batch shares: how many samples each pipeline of a layout takes so that the slowest one
ends first (the search's copies, and the replicas of every island of a local plan)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

__all__ = ["share_samples"]


def share_samples(
    micro_batch_sizes: Sequence[int],
    base_s: Sequence[float],
    period_s: Sequence[float],
    total: int,
) -> list[int]:
    """Samples per pipeline minimising the slowest one's time (water-filling by micro-batch).

    Pipeline i takes ``base_s[i] + (m - 1) * period_s[i]`` for m micro-batches of
    ``micro_batch_sizes[i]`` samples (its last one may be smaller). Bulk first: bisection
    finds the latest time by which the pipelines' completed micro-batches still fit in
    ``total``; a heap then hands out the rest one micro-batch at a time to the pipeline
    that would finish it first.
    """
    pipes = list(zip(micro_batch_sizes, base_s, period_s, strict=True))
    samples = _bulk_shares(pipes, total)
    heap = [(_pipe_time(p, samples[i] + p[0]), i) for i, p in enumerate(pipes)]
    heapq.heapify(heap)
    left = total - sum(samples)
    while left > 0 and heap:
        _, i = heapq.heappop(heap)
        add = min(pipes[i][0], left)
        samples[i] += add
        left -= add
        heapq.heappush(heap, (_pipe_time(pipes[i], samples[i] + pipes[i][0]), i))
    return samples


_Pipe = tuple[int, float, float]
"""(micro-batch size, base time, period) of one pipeline."""


def _pipe_time(pipe: _Pipe, samples: int) -> float:
    mbs, base_s, period_s = pipe
    m = math.ceil(samples / mbs)
    return base_s + (m - 1) * period_s if m > 0 else 0.0


def _bulk_shares(pipes: Sequence[_Pipe], total: int) -> list[int]:
    def done_by(time_s: float) -> list[int]:
        out = []
        for mbs, base_s, period_s in pipes:
            if time_s < base_s:
                out.append(0)
                continue
            steps = math.floor((time_s - base_s) / period_s) + 1 if period_s > 0 else math.inf
            out.append(int(min(steps, total)) * mbs)
        return out

    if not pipes:
        return []
    lo, hi = 0.0, max(_pipe_time(p, total) for p in pipes)
    for _ in range(64):
        mid = (lo + hi) / 2
        if sum(done_by(mid)) <= total:
            lo = mid
        else:
            hi = mid
    return done_by(lo) if sum(done_by(lo)) <= total else [0] * len(pipes)
