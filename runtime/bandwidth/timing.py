"""The timed loops of the link matrix: point-to-point ping-pong per ordered pair of ranks
(:func:`measure_pairs`) and an all-reduce per node (:func:`measure_all_reduce`). Every rank
of the job calls both functions in the same order, one pair or group at a time, the other
ranks waiting at a barrier so that nothing contends.

On GPUs (NCCL) tensors live on the rank's device and every timing waits for the device
(``torch.cuda.synchronize``); on CPU (gloo) the calls are synchronous.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from hplan.runtime.contract.link_matrix import (
    AlphaBetaFit,
    FitMethod,
    PairLink,
    SizeSamples,
    fit_alpha_beta,
    size_samples,
)
from hplan.runtime.contract.quantities import US_PER_S, format_link_speed

_MIN_ONE_WAY_S = 1e-9
"""Floor of a one-way time (a round trip can come out shorter than the reference one)."""
_GO_ON, _STOP = 1, 0
_FLOAT32_BYTES = 4


@dataclass(frozen=True)
class Sweep:
    """Which message sizes to time, and how often."""

    sizes_bytes: tuple[int, ...]
    """Increasing message sizes, bytes."""
    repeats: int
    """Timed repeats per size (the median is fitted)."""
    warmup: int
    """Untimed repeats before them."""
    size_budget_s: float
    """Stop a sweep after the first size whose timed repeats took longer than this."""


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 4) -> tuple[int, ...]:
    """``min_bytes``, ``min_bytes * factor``, ... up to ``max_bytes`` (always included).

    ``message_sizes(4096, 65536)`` -> ``(4096, 16384, 65536)``.

    Raises:
        ValueError: ``min_bytes < 1``, ``max_bytes <= min_bytes`` or ``factor < 2``.
    """
    if min_bytes < 1 or max_bytes <= min_bytes or factor < 2:
        raise ValueError(f"need 1 <= min ({min_bytes}) < max ({max_bytes}) and factor >= 2")
    sizes = [min_bytes]
    while sizes[-1] * factor < max_bytes:
        sizes.append(sizes[-1] * factor)
    sizes.append(max_bytes)
    return tuple(sizes)


def _waiter(device: torch.device) -> Callable[[], None]:
    """A function that waits until ``device`` finished its queued work."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def sync_group(device: torch.device, group: ProcessGroup | None = None) -> None:
    """Wait until every rank of ``group`` (default: all) got here: a 1-element all-reduce.

    (``dist.barrier`` would do on gloo; on NCCL it has to guess the device.)
    """
    token = torch.zeros(1, device=device)
    dist.all_reduce(token, group=group)
    _waiter(device)()


# ----------------------------------------------------------------------------- point to point
def measure_pairs(
    rank: int, world_size: int, sweep: Sweep, device: torch.device, say: Callable[[str], None]
) -> list[PairLink]:
    """Time every ordered pair of ranks, one pair at a time; return the pairs ``rank`` sent.

    The sender sends ``num_bytes`` and waits for a 1-byte reply; the receiver replies as
    soon as the message is in. First a 1-byte message and its reply are timed
    (``ack_round_trip_s``, the fastest of the repeats: scheduling delays only add time);
    each timed round trip less ``ack_round_trip_s / 2`` is the message's one-way time (the
    ping-pong method of the OSU and Intel MPI benchmarks; it needs no shared clock). After
    each size the sender tells the receiver whether to go on: the sweep stops once one
    size's timed repeats took longer than ``size_budget_s``, so that a slow link is not held
    for minutes by the largest messages.

    Every rank of the job calls this with the same arguments (but its own ``rank``).

    Raises:
        RuntimeError: a peer failed (from torch.distributed).
    """
    buffer = torch.zeros(max(sweep.sizes_bytes), dtype=torch.uint8, device=device)
    sent: list[PairLink] = []
    pairs = [(s, d) for s in range(world_size) for d in range(world_size) if s != d]
    for idx, (src, dst) in enumerate(pairs):
        if rank == src:
            link = _send_side(src, dst, sweep, buffer)
            sent.append(link)
            say(f"pair {idx + 1}/{len(pairs)}: rank {src} -> rank {dst}: {fit_text(link.fit)}")
        elif rank == dst:
            _receive_side(src, sweep, buffer)
        sync_group(device)
    return sent


def _round_trip_s(message: torch.Tensor, reply: torch.Tensor, peer: int) -> float:
    wait = _waiter(message.device)
    wait()
    started = time.perf_counter()
    dist.send(message, peer)
    dist.recv(reply, peer)
    wait()
    return time.perf_counter() - started


def _answer(message: torch.Tensor, reply: torch.Tensor, peer: int) -> None:
    dist.recv(message, peer)
    dist.send(reply, peer)


def _send_side(rank: int, peer: int, sweep: Sweep, buffer: torch.Tensor) -> PairLink:
    """The sender's half of one pair's sweep: its timings, fit and reference round trip."""
    reply = torch.zeros(1, dtype=torch.uint8, device=buffer.device)
    runs = sweep.warmup + sweep.repeats
    reference = [_round_trip_s(buffer[:1], reply, peer) for _ in range(runs)]
    ack_s = min(reference[sweep.warmup :])
    timed: list[SizeSamples] = []
    for idx, num_bytes in enumerate(sweep.sizes_bytes):
        trips = [_round_trip_s(buffer[:num_bytes], reply, peer) for _ in range(runs)]
        one_way = [max(t - ack_s / 2, _MIN_ONE_WAY_S) for t in trips[sweep.warmup :]]
        timed.append(size_samples(num_bytes, one_way))
        if idx + 1 == len(sweep.sizes_bytes):
            break
        go_on = sum(trips[sweep.warmup :]) <= sweep.size_budget_s or len(timed) < 2
        flag = torch.full((1,), _GO_ON if go_on else _STOP, dtype=torch.uint8, device=buffer.device)
        dist.send(flag, peer)
        if not go_on:
            break
    return PairLink(
        src_rank=rank,
        dst_rank=peer,
        fit=fit_alpha_beta(timed),
        sizes=tuple(timed),
        ack_round_trip_s=ack_s,
    )


def _receive_side(peer: int, sweep: Sweep, buffer: torch.Tensor) -> None:
    reply = torch.zeros(1, dtype=torch.uint8, device=buffer.device)
    runs = sweep.warmup + sweep.repeats
    for _ in range(runs):
        _answer(buffer[:1], reply, peer)
    flag = torch.zeros(1, dtype=torch.uint8, device=buffer.device)
    for idx, num_bytes in enumerate(sweep.sizes_bytes):
        for _ in range(runs):
            _answer(buffer[:num_bytes], reply, peer)
        if idx + 1 == len(sweep.sizes_bytes):
            break
        dist.recv(flag, peer)
        _waiter(buffer.device)()
        if int(flag.item()) == _STOP:
            break


# ----------------------------------------------------------------------------- all-reduce
def measure_all_reduce(
    rank: int,
    groups: Sequence[tuple[tuple[int, ...], ProcessGroup | None]],
    sweep: Sweep,
    device: torch.device,
) -> dict[int, dict[int, list[float]]]:
    """Time an all-reduce within each group that has two ranks or more, one group at a time.

    float32 tensors; each repeat starts together (after a 1-element all-reduce) and is
    timed on every rank (the caller keeps the slowest rank's time per repeat,
    :func:`slowest_per_repeat`).

    Args:
        groups: (ranks, process group) per node, the same list on every rank (every rank
            created every group, as ``dist.new_group`` requires).

    Returns:
        group index -> message bytes -> this rank's timed repeats (seconds), for the
        groups ``rank`` belongs to.

    Raises:
        RuntimeError: a peer failed (from torch.distributed).
    """
    result: dict[int, dict[int, list[float]]] = {}
    for idx, (ranks, group) in enumerate(groups):
        if rank in ranks and len(ranks) > 1:
            result[idx] = _all_reduce_sweep(group, sweep, device)
        sync_group(device)
    return result


def _all_reduce_sweep(
    group: ProcessGroup | None, sweep: Sweep, device: torch.device
) -> dict[int, list[float]]:
    wait = _waiter(device)
    elements = max(1, max(sweep.sizes_bytes) // _FLOAT32_BYTES)
    buffer = torch.zeros(elements, dtype=torch.float32, device=device)
    times: dict[int, list[float]] = {}
    for num_bytes in sweep.sizes_bytes:
        tensor = buffer[: max(1, num_bytes // _FLOAT32_BYTES)]
        runs: list[float] = []
        for _ in range(sweep.warmup + sweep.repeats):
            sync_group(device, group)
            started = time.perf_counter()
            dist.all_reduce(tensor, group=group)
            wait()
            runs.append(time.perf_counter() - started)
        times[tensor.numel() * _FLOAT32_BYTES] = runs[sweep.warmup :]
        spent = torch.tensor([sum(runs[sweep.warmup :])], device=device)
        dist.all_reduce(spent, op=dist.ReduceOp.MAX, group=group)  # every rank stops together
        if float(spent.item()) > sweep.size_budget_s and len(times) >= 2:
            break
    return times


def slowest_per_repeat(per_rank: Sequence[dict[int, list[float]]]) -> list[SizeSamples]:
    """Per size and repeat, the slowest rank's time (an all-reduce ends when its last rank
    is done); sizes every rank timed, in increasing order."""
    common = sorted(set.intersection(*(set(times) for times in per_rank)))
    return [
        size_samples(n, [max(run) for run in zip(*(t[n] for t in per_rank), strict=True)])
        for n in common
    ]


# ----------------------------------------------------------------------------- text
def rate_text(bytes_per_s: float) -> str:
    """``1.25e9`` -> ``"1.25 GB/s"``; decimal units (GB = 10^9 bytes)."""
    for scale, unit in ((1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s")):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.3g} {unit}"
    return f"{bytes_per_s:.3g} B/s"


def fit_text(fit: AlphaBetaFit) -> str:
    """One line for a fit: bandwidth (and Mbit/s), latency in microseconds, R^2."""
    bandwidth = fit.bandwidth_bytes_per_s
    how = (
        "" if fit.method is FitMethod.LEAST_SQUARES else " (too noisy for a line: largest message)"
    )
    return (
        f"{rate_text(bandwidth)} ({format_link_speed(bandwidth)}), "
        f"latency {fit.latency_s * US_PER_S:.1f} us, "
        f"R^2 {fit.r_squared:.3f}{how}"
    )


def stderr_say(prefix: str) -> Callable[[str], None]:
    """A progress printer: ``prefix: message`` on stderr, flushed."""
    return lambda message: print(f"{prefix}: {message}", file=sys.stderr, flush=True)
