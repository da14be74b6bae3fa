"""What islands and their sync modes do to a step: which holder sets sum every step, and
what each outer sync costs per inner step.

Under ``local_sgd`` and ``async`` (``contract.plan.SyncMode``) a holder set that spans
islands sums its gradients every step only inside each island (:func:`split_by_island`);
every H inner steps its pseudo-gradients cross the islands (DiLoCo's outer step, Douillard
et al., 2023), in F fragments synced in turn (Streaming DiLoCo, Douillard et al., 2025).
One outer sync of a set takes T (:func:`outer_transfer_time_s`): a ring all-reduce of its
wire bytes for the float formats; for ``int8``/``int4`` an all-gather of the payloads among
the island leads, the sum broadcast inside each island, and the host's encode/decode. Per
inner step a set exposes :func:`exposed_outer_s` (blocking: T / H; overlapped by tau steps:
what of each fragment does not fit behind them); a device's sets share its link, so what
their T / H add up to beyond the inner step is exposed too (:func:`device_outer_s`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from hplan.runtime.contract.holders import RankSet
from hplan.runtime.contract.link_model import ring_all_reduce_time_s
from hplan.runtime.contract.plan import (
    DTYPE_BYTES,
    PseudoGradientDtype,
    SyncMode,
    wire_payload_bytes,
)

__all__ = [
    "CODEC_DECODE_S_PER_ELEMENT",
    "CODEC_ENCODE_S_PER_ELEMENT",
    "GRADIENT_WIRE_BYTES",
    "OuterLink",
    "amortised_outer_s",
    "device_outer_s",
    "exposed_outer_s",
    "fragment_shares",
    "outer_codec_time_s",
    "outer_round_s",
    "outer_transfer_time_s",
    "pseudo_gradient_bytes",
    "split_by_island",
]

CODEC_ENCODE_S_PER_ELEMENT: Final = 25e-9
"""Host seconds per element for one island's side of a quantized outer sync
(``PseudoGradientDtype`` int8/int4): add the residual, block-quantize, pack, and the error
feedback's decode; the runtime's own codec on one CPU thread (``bench/codec_speed.py``,
int4, the slower). It runs on the training thread: exposed even when the sync overlaps."""
CODEC_DECODE_S_PER_ELEMENT: Final = 6e-9
"""Host seconds per element to unpack, scale and add one island's payload (as above)."""

GRADIENT_WIRE_BYTES = DTYPE_BYTES["float32"]
"""Bytes per element of the gradient bytes the cost model counts (the runtime's wire dtype,
float32; ``sim.spec.WIRE_BYTES_MIN``)."""


def pseudo_gradient_bytes(gradient_bytes: float, wire_dtype: PseudoGradientDtype) -> float:
    """Bytes one island's pseudo-gradients take on the wire in ``wire_dtype`` for parameters
    whose gradients are ``gradient_bytes`` (counted in float32): the same in float32, half
    in bfloat16, ``contract.plan.wire_payload_bytes`` for the quantized formats."""
    if not wire_dtype.quantized:
        return gradient_bytes * DTYPE_BYTES[wire_dtype.value] / GRADIENT_WIRE_BYTES
    return float(wire_payload_bytes(wire_dtype, round(gradient_bytes / GRADIENT_WIRE_BYTES)))


@dataclass(frozen=True, slots=True)
class OuterLink:
    """The links one spanning holder set's outer sync crosses (bytes/s, seconds)."""

    num_members: int
    ring_bandwidth_bytes_per_s: float
    """Slowest link of a ring over every member (the float formats' all-reduce)."""
    ring_latency_s: float
    lead_bandwidth_bytes_per_s: float
    """Slowest link between the islands' leads (their lowest members): the all-gather."""
    lead_latency_s: float
    island_links: tuple[tuple[int, float, float], ...]
    """Per island: (members, slowest bandwidth, highest latency among them)."""


def outer_transfer_time_s(
    wire: PseudoGradientDtype, gradient_bytes: float, link: OuterLink
) -> float:
    """Seconds T of one outer sync of pseudo-gradients whose gradients are
    ``gradient_bytes`` (float32), in ``wire``, over ``link``.

    - float32/bfloat16: a ring all-reduce of the wire bytes over the slowest link
      (``link_model.ring_all_reduce_time_s``; Patarasuk and Yuan, JPDC 2009).
    - int8/int4 (``PseudoGradientDtype``'s algorithm): the I island leads all-gather the
      payloads over their slowest link, ``(I - 1) (payload / bandwidth + latency)`` (a
      ring all-gather, as above); each island's lead sends the float32 sum to its other
      members, ``bytes / bandwidth + latency`` (the slowest island); each lead encodes its
      own pseudo-gradient and decodes I payloads (:data:`CODEC_ENCODE_S_PER_ELEMENT`,
      :data:`CODEC_DECODE_S_PER_ELEMENT`).
    """
    if gradient_bytes <= 0 or link.num_members < 2:
        return 0.0
    payload = pseudo_gradient_bytes(gradient_bytes, wire)
    if not wire.quantized:
        return ring_all_reduce_time_s(
            link.num_members, payload, link.ring_bandwidth_bytes_per_s, link.ring_latency_s
        )
    num_islands = len(link.island_links)
    gather_s = (num_islands - 1) * (payload / link.lead_bandwidth_bytes_per_s + link.lead_latency_s)
    broadcast_s = max(
        (gradient_bytes / bw + lat for members, bw, lat in link.island_links if members > 1),
        default=0.0,
    )
    return gather_s + broadcast_s + outer_codec_time_s(wire, gradient_bytes, num_islands)


def outer_codec_time_s(wire: PseudoGradientDtype, gradient_bytes: float, num_islands: int) -> float:
    """Host seconds of the encode and the ``num_islands`` decodes of one quantized outer sync
    of pseudo-gradients whose gradients are ``gradient_bytes`` (float32); 0 for the float
    formats (:data:`CODEC_ENCODE_S_PER_ELEMENT`, :data:`CODEC_DECODE_S_PER_ELEMENT`)."""
    if not wire.quantized:
        return 0.0
    elements = gradient_bytes / GRADIENT_WIRE_BYTES
    return elements * (CODEC_ENCODE_S_PER_ELEMENT + num_islands * CODEC_DECODE_S_PER_ELEMENT)


def split_by_island(
    groups: Mapping[RankSet, float], island_of: Mapping[int, int] | Sequence[int]
) -> tuple[dict[RankSet, float], dict[RankSet, float]]:
    """(holder sets that sum every step -> bytes, spanning holder sets -> bytes) under local
    sync.

    Every set inside one island stays as it is; a set spanning islands goes to the second
    mapping and, in the first, is replaced by its members in each island (a member alone
    sums nothing and is dropped). Sets that coincide after the split are merged, their
    bytes added, as one all-reduce per holder set.

    Args:
        groups: sorted members (devices or ranks) -> bytes they sum.
        island_of: member -> its island's index.
    """
    inner: dict[RankSet, float] = {}
    outer: dict[RankSet, float] = {}
    for members, num_bytes in groups.items():
        by_island: dict[int, list[int]] = {}
        for m in members:
            by_island.setdefault(island_of[m], []).append(m)
        if len(by_island) > 1:
            outer[members] = outer.get(members, 0.0) + num_bytes
        for part in by_island.values():
            if len(part) > 1:
                key = tuple(sorted(part))
                inner[key] = inner.get(key, 0.0) + num_bytes
    return inner, outer


def outer_round_s(ring_s: Mapping[RankSet, float]) -> float:
    """Seconds of one outer sync round: every spanning set's ring (``ring_s``: members ->
    seconds), one after another on each member, the slowest member's total (as the inner
    all-reduce, ``evaluate.allreduce_time_s``); 0 without sets."""
    total: dict[int, float] = {}
    for members, seconds in ring_s.items():
        for m in members:
            total[m] = total.get(m, 0.0) + seconds
    return max(total.values(), default=0.0)


def amortised_outer_s(
    mode: SyncMode, local_steps: int, round_s: float, inner_step_s: float
) -> float:
    """Seconds one outer round of ``round_s`` adds to each of ``local_steps`` inner steps of
    ``inner_step_s``: ``round / H`` for ``local_sgd`` (the islands wait for the round, then go
    on), ``max(0, round - H * step) / H`` for ``async`` (only what does not fit behind H inner
    steps is exposed), 0 for ``all_reduce`` (no round)."""
    return exposed_outer_s(mode, local_steps, 1, 0, round_s, inner_step_s)


def exposed_outer_s(
    mode: SyncMode,
    local_steps: int,
    num_fragments: int,
    overlap_steps: int,
    transfer_s: float,
    inner_step_s: float,
    largest_share: float = 0.0,
    codec_s: float = 0.0,
) -> float:
    """Seconds per inner step that one holder set's outer sync of ``transfer_s`` (T) leaves
    exposed, synced every H = ``local_steps`` inner steps of ``inner_step_s``:

    - ``all_reduce``: 0 (no outer sync);
    - ``local_sgd``, tau = ``overlap_steps`` = 0: T / H (the islands wait for it);
    - ``local_sgd``, tau >= 1: ``sum over fragments f of max(0, T s_f - tau step) / H``,
      the shares s_f of :func:`fragment_shares` (equal: ``F max(0, T / F - tau step) /
      H``): each fragment travels behind tau inner steps before it is applied (Streaming
      DiLoCo, Douillard et al., 2025), what does not fit is waited for;
    - ``async`` (applied H steps late): ``max(0, T - H step) / H``.

    ``largest_share``: the set's largest indivisible piece (a parameter, or a unit where the
    parameters are not known) as a share of its bytes; 0: fragments cut evenly.
    ``codec_s``: the part of T spent encoding and decoding on the training thread
    (:func:`outer_codec_time_s`): exposed, ``codec / H``, under every mode that overlaps.
    """
    if mode is SyncMode.ALL_REDUCE or transfer_s <= 0:
        return 0.0
    if overlap_steps == 0 and mode is SyncMode.LOCAL_SGD:
        return transfer_s / local_steps
    wire_s = transfer_s - codec_s
    if mode is SyncMode.ASYNC:
        return (max(0.0, wire_s - local_steps * inner_step_s) + codec_s) / local_steps
    hidden_s = overlap_steps * inner_step_s
    shares = fragment_shares(num_fragments, largest_share)
    left_s = sum(max(0.0, wire_s * share - hidden_s) for share in shares)
    return (left_s + codec_s) / local_steps


def fragment_shares(num_fragments: int, largest_share: float) -> tuple[float, ...]:
    """The share of a set's bytes each of its ``num_fragments`` fragments carries: equal,
    unless an indivisible piece of ``largest_share`` is larger than an equal share: its
    fragment carries it, the others the rest evenly (``holders.outer_fragments`` cuts
    between parameters)."""
    count = max(1, num_fragments)
    if count == 1 or largest_share <= 1 / count:
        return (1 / count,) * count
    largest = min(1.0, largest_share)
    return (largest, *((1 - largest) / (count - 1),) * (count - 1))


def device_outer_s(
    costs: Mapping[RankSet, tuple[float, float]], inner_step_s: float
) -> dict[int, float]:
    """Seconds per inner step the outer syncs expose on each member of a set in ``costs``
    (members -> (exposed per step, :func:`exposed_outer_s`; link time per step, T / H)):
    the sum of its sets' exposed times, or, when its sets' T / H add up to more than the
    inner step (they share its link), that excess, whichever is larger."""
    exposed: dict[int, float] = {}
    busy: dict[int, float] = {}
    for members, (exposed_s, busy_s) in costs.items():
        for m in members:
            exposed[m] = exposed.get(m, 0.0) + exposed_s
            busy[m] = busy.get(m, 0.0) + busy_s
    return {m: max(exposed[m], busy[m] - inner_step_s) for m in exposed}
