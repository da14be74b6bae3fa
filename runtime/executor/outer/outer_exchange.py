"""How one holder of a local group's fragment moves a pseudo-gradient across islands and
gets the weighted average back (``outer_sync.py`` decides when).

Float wire formats (``float32``, ``bfloat16``) sum in one all-reduce over the holder set
(``outer_sync.py``). The quantized ones (``int8``, ``int4``: ``PseudoGradientDtype``) go
through :class:`QuantizedExchange`: every holder of an island quantizes the same value (its
weighted pseudo-gradient plus its residual, ``pseudo_gradient_codec.py``), so that all keep
the same residual; the island's lowest holder (its *lead*) all-gathers the payloads with the
other islands' leads, decodes them and sums them in float32 in island order; at the apply
point it broadcasts the sum to its island's other holders. A :class:`PendingExchange` is one
exchange's state between its launch and its arrival. In a rehearsal each collective lasts at
least its floor (:func:`hold_floor`), counted from when its last member started it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from hplan.runtime.contract.plan import PseudoGradientDtype
from hplan.runtime.executor.outer.pseudo_gradient_codec import decode, encode

__all__ = [
    "PendingExchange",
    "QuantizedExchange",
    "broadcast_floor_bytes",
    "gather_floor_bytes",
    "hold_floor",
]


@dataclass
class PendingExchange:
    """An outer exchange launched and not yet applied."""

    launched_s: float
    work: dist.Work | None
    """The collective in flight; None once waited for, or where none was launched (a
    quantized group's holder other than its island's lead)."""
    buffers: list[Tensor]
    """Float wire: ``[the wire buffer]``; quantized, on a lead: the gathered payloads."""
    average: Tensor | None = None
    """``(n,)`` host float32: the weighted average, once arrived (or loaded)."""


def hold_floor(
    group: dist.ProcessGroup, started_s: float, floor_s: float, device: torch.device
) -> None:
    """Sleep until ``floor_s`` after the latest ``started_s`` of ``group``'s members (one MAX
    all-reduce of it; every member calls this); nothing when ``floor_s`` is 0."""
    if floor_s <= 0:
        return
    ready = torch.tensor([started_s], dtype=torch.float64, device=device)
    dist.all_reduce(ready, op=dist.ReduceOp.MAX, group=group)
    time.sleep(max(0.0, float(ready.item()) + floor_s - time.monotonic()))


def gather_floor_bytes(num_members: int, payload_bytes: int) -> int:
    """The all-reduce bytes whose ring floor (``LinkDelay.all_reduce_floor_s``) is the
    bandwidth time of a ring all-gather of ``num_members`` payloads of ``payload_bytes``:
    each member receives ``(k - 1) P`` bytes, what a ring all-reduce of ``k P / 2`` bytes
    moves (``2 (k - 1) / k`` times its bytes; Patarasuk and Yuan, JPDC 2009). Its latency
    term counts ``2 (k - 1)`` steps where an all-gather takes ``k - 1``."""
    return -(-num_members * payload_bytes // 2)


def broadcast_floor_bytes(num_members: int, num_bytes: int) -> int:
    """The all-reduce bytes whose ring floor is the time of a pipelined broadcast of
    ``num_bytes`` to ``num_members`` ranks (every link carries the bytes once:
    ``2 (m - 1) / m * x = num_bytes``)."""
    if num_members < 2:
        return 0
    return -(-num_members * num_bytes // (2 * (num_members - 1)))


@dataclass
class QuantizedExchange:
    """One holder's part of a quantized fragment's exchange (module docstring).

    Every holder of an island calls :meth:`launch` and :meth:`arrive` at the same steps,
    in the same order as the other collectives of the job (``outer_sync.OuterSync``).
    """

    wire: PseudoGradientDtype
    weight: float
    """``n_i / N`` of this rank's island (every holder of the island alike)."""
    lead_rank: int
    """The global rank of this island's lead (its lowest holder)."""
    leads: dist.ProcessGroup | None
    """The islands' leads' group, on a lead; None on the island's other holders."""
    num_leads: int
    island_group: dist.ProcessGroup | None
    """This island's holders (None: the island has one holder)."""
    gather_floor_s: float
    broadcast_floor_s: float
    residual: Tensor
    """``(n,)`` host float32: what the rounding lost so far, added to the next value."""

    def launch(self, deltas: Tensor, device: torch.device) -> PendingExchange:
        """Quantize ``weight * deltas + residual`` (``deltas``: ``(n,)`` host float32, this
        island's pseudo-gradient), keep what the rounding lost as the residual and, on a
        lead, start the all-gather of the payloads (not waited for)."""
        value = deltas * self.weight + self.residual
        encoded = encode(value, self.wire)
        self.residual.copy_(value - encoded.decoded)
        launched_s = time.monotonic()
        if self.leads is None:
            return PendingExchange(launched_s, None, [])
        payload = encoded.payload.to(device)
        gathered = [torch.empty_like(payload) for _ in range(self.num_leads)]
        work = dist.all_gather(gathered, payload, group=self.leads, async_op=True)
        assert work is not None
        return PendingExchange(launched_s, work, gathered)

    def arrive(self, pending: PendingExchange, num_elements: int, device: torch.device) -> Tensor:
        """Wait for ``pending``: a lead decodes the payloads and sums them in float32 in
        island order; the sum then goes to the island's other holders. Returns the
        ``(num_elements,)`` host float32 average.

        Raises:
            RuntimeError: a collective failed or timed out (the caller names the islands).
        """
        total = torch.empty(0)
        if self.leads is not None:
            assert pending.work is not None
            pending.work.wait()
            pending.work = None
            hold_floor(self.leads, pending.launched_s, self.gather_floor_s, device)
            decoded = [decode(p.cpu(), self.wire, num_elements) for p in pending.buffers]
            total = decoded[0].clone()
            for values in decoded[1:]:
                total += values
        if self.island_group is not None:
            started_s = time.monotonic()
            buffer = (
                total.to(device)
                if self.leads is not None
                else torch.empty(num_elements, dtype=torch.float32, device=device)
            )
            dist.broadcast(buffer, src=self.lead_rank, group=self.island_group)
            hold_floor(self.island_group, started_s, self.broadcast_floor_s, device)
            total = buffer.to("cpu", torch.float32)
        pending.buffers = []
        return total
