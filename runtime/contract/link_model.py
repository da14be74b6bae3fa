"""The link model: how long a transfer and an all-reduce take, in one place.

The planner's cost model (``cost/evaluate.py``), its step simulator (``sim/engine.py``) and
the rehearsal's link emulation time transfers with :func:`transfer_time_s` (queued one after
another on a link direction by :class:`LinkQueue`) and all-reduces with
:func:`ring_all_reduce_time_s` over :func:`group_ring_time_s`'s slowest link; the link
matrix measurement fits the same latency + bytes / bandwidth line
(:func:`least_squares_alpha_beta`). The gradient all-reduce runs in buckets of at most
:data:`BUCKET_CAP_BYTES` beside the last backward pass (``executor/grad_sync.py``); what is
left of it is :func:`exposed_all_reduce_s`, whose docstring gives the formula. A tensor-
parallel group's per-layer collectives are rings too (:func:`tp_layer_all_reduce_time_s`).

Torch-free on purpose: the planner imports it without pulling in torch.distributed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from hplan.runtime.contract.plan import Plan
from hplan.runtime.contract.quantities import BYTES_PER_MIB

__all__ = [
    "BUCKET_CAP_BYTES",
    "TP_ALL_REDUCES_PER_LAYER_PASS",
    "LinkQueue",
    "QueuedTransfer",
    "bucketed_all_reduce_time_s",
    "exposed_all_reduce_s",
    "group_ring_time_s",
    "last_bucket_bytes",
    "least_squares_alpha_beta",
    "overlap_window_s",
    "ring_all_reduce_time_s",
    "sync_order",
    "tp_all_reduce_time_s",
    "tp_layer_all_reduce_time_s",
    "transfer_time_s",
    "wire_time_s",
]


def wire_time_s(num_bytes: float, bandwidth_bytes_per_s: float) -> float:
    """Seconds ``num_bytes`` occupy a link of ``bandwidth_bytes_per_s``: bytes / bandwidth."""
    return num_bytes / bandwidth_bytes_per_s


def transfer_time_s(num_bytes: float, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Alpha-beta time of one message: ``latency + bytes / bandwidth`` (Hockney, "The
    communication challenge for MPP: Intel Paragon and Meiko CS-2", Parallel Computing
    1994)."""
    return latency_s + wire_time_s(num_bytes, bandwidth_bytes_per_s)


@dataclass(frozen=True, slots=True)
class QueuedTransfer:
    """When a queued message took its link and when it arrived (seconds)."""

    start_s: float
    """It waited for the messages before it on the link until then."""
    wire_end_s: float
    """Its last byte left: ``start_s + bytes / bandwidth``; the link is free again."""
    arrival_s: float
    """Its last byte arrived: ``wire_end_s + latency``."""


@dataclass
class LinkQueue:
    """One direction of a link: messages occupy it one after another (alpha-beta each)."""

    busy_until_s: float = 0.0

    def send(
        self, now_s: float, num_bytes: float, bandwidth_bytes_per_s: float, latency_s: float
    ) -> QueuedTransfer:
        """Queue a message sent at ``now_s``; the link is busy until its last byte left."""
        start_s = max(now_s, self.busy_until_s)
        wire_end_s = start_s + wire_time_s(num_bytes, bandwidth_bytes_per_s)
        self.busy_until_s = wire_end_s
        return QueuedTransfer(start_s, wire_end_s, wire_end_s + latency_s)


def sync_order(ranks: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """Sort key of gradient holder sets: the order in which every rank creates their process
    groups, and in which the simulator sums them (the runtime launches its buckets in
    ``holders.grad_buckets``' order instead, as their gradients become final).

    Largest sets first, then by their ranks. A set shared by more ranks (tied embeddings
    across stages and replicas) waits for all of them anyway; run first, it lets the smaller
    per-stage sets that follow run side by side. Sorted by ranks alone, two 2-stage replicas
    would run {0,1}, then {0,1,2,3}, then {2,3} one after another (ranks 2 and 3 waiting for
    {0,1} to end before their shared set could start).
    """
    return (-len(ranks), tuple(ranks))


def ring_all_reduce_time_s(
    num_ranks: int, num_bytes: float, bandwidth_bytes_per_s: float, latency_s: float
) -> float:
    """Time of a ring all-reduce of ``num_bytes`` over ``num_ranks`` ranks, in seconds.

    ``2 (n - 1) / n * bytes / bandwidth + 2 (n - 1) * latency`` (reduce-scatter then
    all-gather). Source: Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for
    clusters of workstations", JPDC 2009. 0 for a group of one or for no bytes.
    """
    if num_ranks < 2 or num_bytes <= 0:
        return 0.0
    steps = 2 * (num_ranks - 1)
    return steps / num_ranks * num_bytes / bandwidth_bytes_per_s + steps * latency_s


TP_ALL_REDUCES_PER_LAYER_PASS = 2
"""All-reduces of the activation in one pass of a Megatron transformer layer under tensor
parallelism: the forward sums the outputs of the attention's and of the MLP's row-split
linear (operator ``g``), the backward sums the input gradients of their column-split
linear (operator ``f``). Shoeybi et al., "Megatron-LM", 2019, section 3 and figure 4."""


def tp_all_reduce_time_s(
    tp_degree: int,
    num_bytes: float,
    bandwidth_bytes_per_s: float,
    latency_s: float,
    num_all_reduces: int = 1,
) -> float:
    """Seconds of ``num_all_reduces`` ring all-reduces among a TP group, moving ``num_bytes``
    in total (one after another, as a layer's collectives run between its matmuls).

    Each is a ring (:func:`ring_all_reduce_time_s`): together
    ``2 (d - 1) / d * num_bytes / bandwidth + num_all_reduces * 2 (d - 1) * latency``.
    0 for a degree of 1 or no bytes.
    """
    if tp_degree < 2 or num_bytes <= 0:
        return 0.0
    ring_s = ring_all_reduce_time_s(tp_degree, num_bytes, bandwidth_bytes_per_s, 0.0)
    return ring_s + max(num_all_reduces, 1) * 2 * (tp_degree - 1) * latency_s


def tp_layer_all_reduce_time_s(
    tp_degree: int, activation_bytes: float, bandwidth_bytes_per_s: float, latency_s: float
) -> float:
    """Seconds of one pass (forward, or backward) of one transformer layer's TP
    collectives: :data:`TP_ALL_REDUCES_PER_LAYER_PASS` ring all-reduces of the layer's
    activation over the TP group's link.

    Args:
        tp_degree: ``d``, the TP group's size.
        activation_bytes: the layer's output for one micro-batch, ``micro_batch x seq x
            hidden x element bytes``.
        bandwidth_bytes_per_s, latency_s: the group's ring channel (its slowest link).
    """
    return tp_all_reduce_time_s(
        tp_degree,
        TP_ALL_REDUCES_PER_LAYER_PASS * activation_bytes,
        bandwidth_bytes_per_s,
        latency_s,
        TP_ALL_REDUCES_PER_LAYER_PASS,
    )


BUCKET_CAP_BYTES = 25 * BYTES_PER_MIB
"""Most wire bytes in one gradient bucket (one all-reduce): torch DDP's default
``bucket_cap_mb=25`` (Li et al., "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", VLDB 2020, section 3.2.3). A single parameter larger than this is a
bucket of its own."""


def _num_buckets(num_bytes: float, cap_bytes: float) -> int:
    return max(1, math.ceil(num_bytes / cap_bytes))


def last_bucket_bytes(num_bytes: float, cap_bytes: float) -> float:
    """Bytes of the last of the buckets of ``num_bytes`` split at ``cap_bytes``: full buckets
    first, the remainder last (the runtime fills buckets from the last layer back, so the
    one that holds the first layers, launched last, is the partial one)."""
    return num_bytes - (_num_buckets(num_bytes, cap_bytes) - 1) * cap_bytes


def bucketed_all_reduce_time_s(
    num_ranks: int,
    num_bytes: float,
    bandwidth_bytes_per_s: float,
    latency_s: float,
    cap_bytes: float,
) -> float:
    """Seconds of the rings of ``num_bytes`` in buckets of ``cap_bytes``, one after another.

    The ring time of each bucket (:func:`ring_all_reduce_time_s`) summed: the whole
    buffer's bandwidth term and each bucket's latency term,
    ``ring(bytes) + (num_buckets - 1) * 2 (n - 1) * latency``.
    """
    if num_ranks < 2 or num_bytes <= 0:
        return 0.0
    extra_buckets = _num_buckets(num_bytes, cap_bytes) - 1
    ring_s = ring_all_reduce_time_s(num_ranks, num_bytes, bandwidth_bytes_per_s, latency_s)
    return ring_s + extra_buckets * 2 * (num_ranks - 1) * latency_s


def bucket_rings_s(
    num_ranks: int,
    num_bytes: float,
    bandwidth_bytes_per_s: float,
    latency_s: float,
    cap_bytes: float = BUCKET_CAP_BYTES,
) -> tuple[float, float]:
    """(every bucket's ring one after another, the last bucket's ring) in seconds, for
    ``num_bytes`` of gradients in buckets of ``cap_bytes``
    (:func:`bucketed_all_reduce_time_s`, :func:`last_bucket_bytes`)."""
    total_s = bucketed_all_reduce_time_s(
        num_ranks, num_bytes, bandwidth_bytes_per_s, latency_s, cap_bytes
    )
    last_bytes = last_bucket_bytes(num_bytes, cap_bytes)
    return total_s, ring_all_reduce_time_s(num_ranks, last_bytes, bandwidth_bytes_per_s, latency_s)


def overlap_window_s(backward_s: float, num_bytes: float, cap_bytes: float) -> float:
    """Seconds of the last backward pass that a rank's all-reduce may overlap.

    The backward pass of the rank's last micro-batch (``backward_s``) finalises its
    ``num_bytes`` of gradients at an even rate (an assumption: bytes in proportion to
    backward time); the first bucket is out after ``backward_s * cap_bytes / num_bytes``, and
    the rest of the pass is the window: ``backward_s * max(0, 1 - cap_bytes / num_bytes)``
    (0 when everything fits one bucket, which is launched at the end of the pass).
    """
    if num_bytes <= cap_bytes:
        return 0.0
    return backward_s * (1.0 - cap_bytes / num_bytes)


def exposed_all_reduce_s(all_reduce_s: float, window_s: float, last_bucket_s: float) -> float:
    """Seconds of all-reduce left after the last backward pass ends.

    ``max(all_reduce_s - window_s, last_bucket_s)``: the reductions start a ``window_s``
    before the pass ends (:func:`overlap_window_s`) and take ``all_reduce_s``
    (:func:`bucketed_all_reduce_time_s`), but the last bucket holds gradients the pass
    finalises at its very end, so its ring (``last_bucket_s``) is never hidden. It is the
    two-bound model of wait-free backpropagation, where communication of the layers done
    so far runs under the backward of the rest (Zhang et al., "Poseidon: An Efficient
    Communication Architecture for Distributed Deep Learning on GPU Clusters", USENIX ATC
    2017, section 3.1; bucketed as in torch DDP, Li et al., VLDB 2020).
    """
    return max(all_reduce_s - window_s, last_bucket_s)


def group_ring_time_s(plan: Plan, ranks: Sequence[int], num_bytes: float) -> float:
    """Ring all-reduce time of ``num_bytes`` among ``ranks`` of ``plan``, on the plan's
    hardware: over their slowest link, no faster than their nodes' measured all-reduce
    (``Plan.ring_channel``); 0 for fewer than two ranks."""
    if len(ranks) < 2:
        return 0.0
    bandwidth, latency = plan.ring_channel([plan.ranks[r].device for r in ranks])
    return ring_all_reduce_time_s(len(ranks), num_bytes, bandwidth, latency)


def least_squares_alpha_beta(
    sizes_bytes: Sequence[float], times_s: Sequence[float], *, relative: bool = False
) -> tuple[float, float]:
    """The line ``time_s = latency_s + seconds_per_byte * num_bytes`` closest to the points.

    Args:
        sizes_bytes: message sizes, at least two distinct.
        times_s: their times (> 0 when ``relative``).
        relative: minimise relative errors (``sum(((y - line) / y)^2)``: every size counts
            alike over decades of sizes) instead of absolute ones (the large messages,
            whose times are mostly bytes, decide the slope).

    Returns:
        ``(latency_s, seconds_per_byte)`` of the least-squares line (either may be <= 0;
        the callers decide what a line that does not resolve means).

    Raises:
        ValueError: fewer than two distinct sizes, lengths that differ, or a time <= 0
            with ``relative``.
    """
    if len(sizes_bytes) != len(times_s) or len(set(sizes_bytes)) < 2:
        raise ValueError(
            f"a latency-bandwidth line needs two distinct sizes with one time each, got "
            f"{len(set(sizes_bytes))} sizes and {len(times_s)} times"
        )
    if relative and min(times_s) <= 0:
        raise ValueError(f"relative errors need times > 0, got {min(times_s)}")
    weights = [1.0 / (y * y) for y in times_s] if relative else None
    mean_x = statistics.fmean(sizes_bytes, weights)
    mean_y = statistics.fmean(times_s, weights)
    w = weights or [1.0] * len(times_s)
    sxx = sum(wi * (x - mean_x) ** 2 for wi, x in zip(w, sizes_bytes, strict=True))
    sxy = sum(
        wi * (x - mean_x) * (y - mean_y) for wi, x, y in zip(w, sizes_bytes, times_s, strict=True)
    )
    slope = sxy / sxx
    return mean_y - slope * mean_x, slope
