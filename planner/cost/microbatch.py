"""Micro-batches of any size: stage times between the candidate sizes, and the 1F1B time of a
pipeline whose last micro-batch is smaller than the others.

A replica of n samples at micro-batch size b runs ``contract.plan.microbatch_sizes(n, b)``:
m - 1 full micro-batches of b samples, then a last one of r = n - (m - 1) b samples
(1 <= r <= b). The problem holds unit times at the candidate sizes only; a stage's time at
any other size is a fixed overhead plus a per-sample time read off them
(:func:`time_at_sizes`, the rule a profile's unmeasured sizes follow too). A pipeline runs
micro-batch j one period P after j - 1 (``(m - 1) P + F`` for m full ones, F the fill;
Narayanan et al., SC 2021, section 2.2); a smaller last micro-batch changes only the end,
``(m - 1) P + tail(r)`` (:func:`tail_s`; one micro-batch alone takes F(r)).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import ArrayLike

from hplan.planner.cost.layout import StageLayout
from hplan.planner.cost.problem import FloatArray, PlanningProblem
from hplan.runtime.contract.link_model import transfer_time_s
from hplan.runtime.contract.memory import in_flight_microbatches
from hplan.runtime.contract.plan import Schedule

_TOLERANCE = 1e-12
"""Relative slack when asking whether a time fits a budget (rounding of sums)."""


def time_at_sizes(sizes: Sequence[float], times_s: Sequence[float], at: ArrayLike) -> FloatArray:
    """Seconds of one micro-batch of each size in ``at`` from ``(sizes[i], times_s[i])``.

    A micro-batch costs a fixed overhead plus a per-sample time, ``a + b * size``, with
    ``a`` and ``b`` read off the known sizes nearest the asked one (so one micro-batch of
    48 costs less than six of 8 by the overhead the known times show, and a per-sample
    time that falls with size, as on a CPU up to its cache, is followed):

    - between two known sizes: the line through them;
    - above the largest: the line through the two largest, continued; when they took the
      same time (nothing says what a sample costs) proportional to the largest;
    - below the smallest: the line through the two smallest, continued, or proportional
      to the smallest where that line would cross zero;
    - one known size: proportional, ``y0 * size / x0``.

    The times are first made non-decreasing in size (a running maximum): a larger
    micro-batch never takes less time, so a dip is measurement noise.

    Args:
        sizes: known sizes (samples), any order, distinct.
        times_s: seconds at each of them, same length.
        at: the sizes to price, any shape.

    Returns:
        Seconds, the shape of ``at``.
    """
    order = np.argsort(np.asarray(sizes, dtype=float), kind="stable")
    xs = np.asarray(sizes, dtype=float)[order]
    ys = np.maximum.accumulate(np.asarray(times_s, dtype=float)[order])
    size = np.asarray(at, dtype=float)
    if len(xs) == 1:
        return np.asarray(ys[0] * size / xs[0], dtype=float)
    idx = np.clip(np.searchsorted(xs, size, side="left"), 1, len(xs) - 1)
    x0, y0, x1, y1 = xs[idx - 1], ys[idx - 1], xs[idx], ys[idx]
    slope = (y1 - y0) / (x1 - x0)
    line = y0 + slope * (size - x0)
    flat_above = (size > x1) & (slope <= 0)
    crosses_below = (size < x0) & (y0 - slope * x0 < 0)
    out = np.where(flat_above, y1 * size / x1, np.where(crosses_below, y0 * size / x0, line))
    return np.asarray(out, dtype=float)


def time_at_size(samples: Sequence[tuple[int, float]], size: float) -> float:
    """:func:`time_at_sizes` at one size, from ``(size, seconds)`` pairs."""
    return float(time_at_sizes([x for x, _ in samples], [y for _, y in samples], size))


def units_time_s(
    problem: PlanningProblem, device_idx: int, start: int, stop: int, sizes: ArrayLike
) -> tuple[FloatArray, FloatArray]:
    """Forward and backward seconds of units ``[start, stop)`` on ``device_idx`` for one
    micro-batch of each of ``sizes`` samples.

    At a candidate size, the problem's own sum (``fwd_time_s[d, start:stop, k]``); at any
    other, :func:`time_at_sizes` over the candidates' sums. Shapes: those of ``sizes``.
    """
    candidates = problem.micro_batch_sizes
    fwd_k = problem.fwd_time_s[device_idx, start:stop, :].sum(axis=0)
    bwd_k = problem.bwd_time_s[device_idx, start:stop, :].sum(axis=0)
    at = np.asarray(sizes, dtype=float)
    k = np.clip(np.searchsorted(np.asarray(candidates, dtype=float), at), 0, len(candidates) - 1)
    exact = np.asarray(candidates, dtype=float)[k] == at
    fwd = np.where(exact, fwd_k[k], time_at_sizes(candidates, fwd_k, at))
    bwd = np.where(exact, bwd_k[k], time_at_sizes(candidates, bwd_k, at))
    return np.asarray(fwd, dtype=float), np.asarray(bwd, dtype=float)


@dataclass(frozen=True, slots=True)
class StagePasses:
    """Seconds one micro-batch spends on each stage of a pipeline, arrays of shape (S,) for
    one size or (S, N) for N sizes."""

    forward_s: FloatArray
    """Forward compute."""
    backward_s: FloatArray
    """Backward compute, with the forward again of the units a stage recomputes (all of
    them, or the selective ones)."""
    send_s: FloatArray
    """Activations to the next stage (0 on the last)."""
    return_s: FloatArray
    """Gradients back from the next stage (0 on the last)."""

    @property
    def compute_s(self) -> FloatArray:
        return self.forward_s + self.backward_s

    @property
    def link_s(self) -> FloatArray:
        return self.send_s + self.return_s


def stage_passes(
    problem: PlanningProblem, stages: Sequence[StageLayout], sizes: ArrayLike
) -> StagePasses:
    """:class:`StagePasses` of ``stages`` (one pipeline) for micro-batches of ``sizes``
    samples: (S,) for one size, (S, N) for N sizes. Links are alpha-beta transfers of the
    cut's bytes at the size (``PlanningProblem.cut_bytes``, ``link_model.transfer_time_s``)."""
    at = np.asarray(sizes, dtype=float)
    forward, backward, send, back = [], [], [], []
    for s, stage in enumerate(stages):
        f, w = units_time_s(problem, stage.device_idx, stage.unit_start, stage.unit_stop, at)
        forward.append(f)
        backward.append(w + _recomputed_forward_s(problem, stage, at, f))
        if s + 1 == len(stages):
            send.append(np.zeros_like(at))
            back.append(np.zeros_like(at))
            continue
        a, b, cut = stage.device_idx, stages[s + 1].device_idx, stage.unit_stop - 1
        # cut_bytes(cut, 0): the unbatched tensors' bytes, sent once per micro-batch
        forward_bytes = problem.cut_bytes_per_sample[cut] * at + problem.cut_bytes(cut, 0)
        grad_bytes = problem.cut_grad_bytes_per_sample[cut] * at + problem.cut_grad_bytes(cut, 0)
        send.append(_link_s(problem, a, b, forward_bytes))
        back.append(_link_s(problem, b, a, grad_bytes))
    return StagePasses(*(np.array(x, dtype=float) for x in (forward, backward, send, back)))


def _recomputed_forward_s(
    problem: PlanningProblem, stage: StageLayout, sizes: FloatArray, stage_forward_s: FloatArray
) -> FloatArray:
    """The forward a stage's backward runs again per micro-batch: all of it under
    ``recompute``, its ``recompute_units``' under selective recomputation, else none."""
    if stage.recompute:
        return stage_forward_s
    again = np.zeros_like(sizes)
    for unit in stage.recompute_units:
        again = again + units_time_s(problem, stage.device_idx, unit, unit + 1, sizes)[0]
    return again


def recomputed_forward_s(
    problem: PlanningProblem, stage: StageLayout, sizes: ArrayLike
) -> FloatArray:
    """Seconds of forward a stage's backward runs again for one micro-batch of each of
    ``sizes`` samples (shape of ``sizes``; 0 where it keeps its activations)."""
    at = np.asarray(sizes, dtype=float)
    forward_s = units_time_s(problem, stage.device_idx, stage.unit_start, stage.unit_stop, at)[0]
    return _recomputed_forward_s(problem, stage, at, forward_s)


def _link_s(problem: PlanningProblem, a: int, b: int, num_bytes: FloatArray) -> FloatArray:
    if a == b:
        return np.zeros_like(num_bytes)
    bandwidth = float(problem.bandwidth_bytes_per_s[a, b])
    time_s = transfer_time_s(num_bytes, bandwidth, float(problem.latency_s[a, b]))  # type: ignore[arg-type]
    return np.where(num_bytes > 0, time_s, 0.0)


def pipeline_period_s(compute_times_s: Sequence[float], link_times_s: Sequence[float]) -> float:
    """Steady-state seconds per micro-batch of a 1F1B pipeline.

    ``compute_times_s[s]``: forward + backward of stage s per micro-batch;
    ``link_times_s[s]``: activations from s to s + 1 plus gradients back (0 for the last).
    The period is the largest of the slowest stage, the slowest link, and for every stage
    s its round trip divided by the micro-batches 1F1B lets it hold,
    ``sum_{t >= s} (c_t + l_t) / (S - s)``: a micro-batch's forward on stage s cannot be
    followed by its backward there before it has gone through the later stages and links
    and back, and at most ``S - s`` are on that trip at once (Little's law; the bound that
    makes slow links between stages cost more than their own transfer time). The cost model
    prices every schedule by 1F1B's steady state (GPipe's bubble is the same; the simulator
    runs each schedule as it is).
    """
    num_stages = len(compute_times_s)
    period = max(max(compute_times_s), max(link_times_s))
    round_trip = 0.0
    for s in reversed(range(num_stages)):
        round_trip += compute_times_s[s] + link_times_s[s]
        in_flight = in_flight_microbatches(Schedule.ONE_F_ONE_B, s, num_stages)
        period = max(period, round_trip / in_flight)
    return period


def period_s(full: StagePasses) -> float:
    """:func:`pipeline_period_s` of full micro-batches (``full`` of shape (S,))."""
    return pipeline_period_s(list(full.compute_s), list(full.link_s))


def fill_s(passes: StagePasses) -> FloatArray:
    """One micro-batch through every stage and link and back: F, shape (N,) (or scalar)."""
    return np.asarray(passes.compute_s.sum(axis=0) + passes.link_s.sum(axis=0), dtype=float)


def tail_s(full: StagePasses, last: StagePasses) -> FloatArray:
    """How long after ``(m - 1) P`` a pipeline of m >= 2 micro-batches ends when the last has
    the sizes of ``last`` ((S, N): one column per size) and the others those of ``full``
    ((S,)). Shape (N,).

    Per stage s = 0..S-1 at size x: forward f_s(x), backward w_s(x), activations sent
    a_s(x), gradients returned g_s(x); c = f + w; P and F of full micro-batches::

        tail(r) = max( sum_{s<S-1} (f_s(b) + a_s(b)) + c_{S-1}(r)
                         + sum_{s<S-1} (w_s(r) + g_s(r)),
                       F - P + max_t [ sum_{u<=t} w_u(r) + sum_{u<t} g_u(r)
                                       - sum_{u<t} (w_u(b) + g_u(b)) ] )

    The last micro-batch ends at the later of two paths: its own trip (the first, full,
    micro-batch fills the stages up to the last, which runs m - 1 periods and then the last
    micro-batch's forward and backward, whose gradient drains back at size r), or behind
    micro-batch m - 2, which ends its backward on stage t at ``(m - 2) P + F`` less its
    drain below t. With r = b the first path is F and the second at most F (P >= w_0); on
    one stage, tail(r) = c(r) exactly. Every micro-batch's compute still fits, so
    ``solve.bound`` stays a bound.
    """
    f, w, a, g = (x[:, None] for x in (full.forward_s, full.backward_s, full.send_s, full.return_s))
    lw, lg = last.backward_s, last.return_s
    own_trip = (
        (f[:-1] + a[:-1]).sum(axis=0)
        + last.forward_s[-1]
        + lw[-1]
        + (lw[:-1] + lg[:-1]).sum(axis=0)
    )
    before = np.cumsum(lw, axis=0) + np.cumsum(lg, axis=0) - lg - np.cumsum(w + g, axis=0) + w + g
    behind = float(fill_s(full)) - period_s(full) + before.max(axis=0)
    return np.asarray(np.maximum(own_trip, behind), dtype=float)


def pipeline_time_s(full: StagePasses, last: StagePasses, num_microbatches: int) -> float:
    """Seconds from the first forward to the last backward of one step of a pipeline of
    ``num_microbatches`` micro-batches, all of the sizes of ``full`` ((S,)) but the last,
    of those of ``last`` ((S,)); see the module docstring."""
    if num_microbatches == 1:
        return float(fill_s(last))
    period = period_s(full)
    if np.array_equal(full.compute_s, last.compute_s) and np.array_equal(full.link_s, last.link_s):
        return (num_microbatches - 1) * period + float(fill_s(full))
    tail = tail_s(full, _column(last))
    return (num_microbatches - 1) * period + float(tail[0])


def _column(passes: StagePasses) -> StagePasses:
    return StagePasses(
        *(x[:, None] for x in (passes.forward_s, passes.backward_s, passes.send_s, passes.return_s))
    )


@dataclass(frozen=True)
class PipeTimes:
    """Step time of one pipeline at micro-batch size b for any number of samples n:
    ``extra_s + (m - 1) * period_s + (alone_s if m == 1 else tail_s)[r - 1]`` with
    ``m = ceil(n / b)`` and ``r = n - (m - 1) b`` (module docstring)."""

    micro_batch_size: int
    extra_s: float
    """What the samples do not change (optimizer step, exposed all-reduce)."""
    period_s: float
    alone_s: FloatArray
    """Shape (b,): [r - 1] one micro-batch of r samples through and back, F(r)
    (non-decreasing: a running maximum, as a larger share never ends sooner)."""
    tail_s: FloatArray
    """Shape (b,): [r - 1] ``tail(r)`` after m - 1 >= 1 full micro-batches (non-decreasing,
    ``tail(b) = F``)."""
    max_samples: int | None = None
    """The most samples its stages hold in memory (GPipe keeps every micro-batch in flight,
    ``evaluate.max_microbatches``); more take infinitely long. None: no such limit."""

    def most_samples(self, limit: int) -> int:
        """``limit``, or fewer where memory holds fewer (:attr:`max_samples`)."""
        return limit if self.max_samples is None else min(limit, self.max_samples)

    def time_s(self, num_samples: int) -> float:
        """Seconds of a step of ``num_samples`` (0 for none; inf beyond :attr:`max_samples`)."""
        if num_samples <= 0:
            return 0.0
        if self.max_samples is not None and num_samples > self.max_samples:
            return float("inf")
        b = self.micro_batch_size
        full, r = divmod(num_samples - 1, b)
        if full == 0:
            return self.extra_s + float(self.alone_s[r])
        return self.extra_s + full * self.period_s + float(self.tail_s[r])

    def charged_whole(self) -> PipeTimes:
        """These times with a smaller last micro-batch charged as a full one (shares in
        whole micro-batches, whose last backward hides the most all-reduce)."""
        full = np.full_like(self.tail_s, self.tail_s[-1])
        return replace(self, alone_s=full, tail_s=full)

    def times_s(self, limit: int) -> FloatArray:
        """:meth:`time_s` of 1, 2, ..., ``limit`` samples, shape (limit,)."""
        n = np.arange(limit)
        full, r = np.divmod(n, self.micro_batch_size)
        last = np.where(full == 0, self.alone_s[r], self.tail_s[r])
        times = np.asarray(self.extra_s + full * self.period_s + last, dtype=float)
        if self.max_samples is not None:
            times[self.max_samples :] = np.inf
        return times

    def samples_by(self, time_s: float, limit: int) -> int:
        """The most samples (at most ``limit`` and :attr:`max_samples`) whose step ends by
        ``time_s``."""
        limit = self.most_samples(limit)
        budget = (time_s - self.extra_s) * (1 + _TOLERANCE) + _TOLERANCE * 1e-3
        b = self.micro_batch_size
        best = int(np.searchsorted(self.alone_s, budget, side="right"))
        lowest = float(self.tail_s[0])
        if budget < self.period_s + lowest or best < b:
            return min(best, limit)
        if self.period_s <= 0:
            return limit
        full = min(int((budget - lowest) / self.period_s), -(-limit // b))
        while full >= 1 and full * self.period_s + lowest > budget:
            full -= 1
        if full < 1:
            return min(best, limit)
        r = int(np.searchsorted(full * self.period_s + self.tail_s, budget, side="right"))
        return min(max(best, full * b + r), limit)


def pipe_times(
    problem: PlanningProblem,
    stages: Sequence[StageLayout],
    micro_batch_size: int,
    extra_s: float,
    max_samples: int | None = None,
) -> PipeTimes:
    """:class:`PipeTimes` of the pipeline ``stages`` at ``micro_batch_size`` (a size at which
    its stages fit; the last micro-batch is never larger), with ``extra_s`` added, holding
    at most ``max_samples`` in memory (None: any number)."""
    b = micro_batch_size
    full = stage_passes(problem, stages, float(b))
    sizes = np.arange(1, b + 1, dtype=float)
    last = stage_passes(problem, stages, sizes)
    tail = tail_s(full, last)
    tail[-1] = float(fill_s(full))
    alone = np.maximum.accumulate(fill_s(last))
    return PipeTimes(b, extra_s, period_s(full), alone, np.maximum.accumulate(tail), max_samples)
