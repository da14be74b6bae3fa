"""Closed-form times of collectives, shared by the runtime's emulation and the planner.

Torch-free on purpose: the planner's cost model and step simulator import it without
pulling in torch.distributed.
"""

from __future__ import annotations

__all__ = ["ring_all_reduce_time_s"]


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
