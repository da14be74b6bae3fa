"""One fragment of a local group on one rank (``outer_sync.py`` keeps them in order): its
state (G, A, the pending exchange) and the rule that launches its pseudo-gradients and
applies their average ``OuterSyncSpec.delay_steps`` steps later (:func:`step_fragment`), and
closes it at the run's end (:func:`close_fragment`). The collectives themselves: one SUM
all-reduce for a float wire format (here), ``outer_exchange.QuantizedExchange`` for
``int8``/``int4``. A failed or timed-out one raises ``PeerFailureError`` naming the islands.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hplan.runtime.contract.errors import PeerFailureError, error_reason
from hplan.runtime.contract.holders import applied_after, syncs_after
from hplan.runtime.contract.plan import OuterSyncSpec
from hplan.runtime.executor.outer.outer_exchange import (
    PendingExchange,
    QuantizedExchange,
    hold_floor,
)

__all__ = [
    "OuterFragment",
    "arrive",
    "close_fragment",
    "host_copy",
    "named_views",
    "step_fragment",
]


@dataclass
class OuterFragment:
    """One fragment of one local group, as one of its holders keeps it."""

    spec: OuterSyncSpec
    index: int
    group: dist.ProcessGroup
    names: tuple[str, ...]
    params: list[nn.Parameter]
    weight: float
    """Float wire: ``n_i / N`` on the lowest holder inside its island, else 0 (a zero
    contribution). Quantized wire: see :attr:`quantized`."""
    islands: tuple[str, ...]
    """The group's islands, in the order of their ranks; ``own_island`` is this rank's."""
    own_island: str
    floor_s: float
    """Least seconds of its float all-reduce (``seams.LinkDelay``; 0: the real one alone)."""
    global_: list[Tensor]
    """G: the global values, host float32."""
    optimizer: torch.optim.SGD
    start: list[Tensor] = field(default_factory=list)
    """A (a delay of 1 step or more, ``OuterSyncSpec.delay_steps``): the local values when
    the pending average was launched (``async``: since the last launch), host float32."""
    pending: PendingExchange | None = None
    quantized: QuantizedExchange | None = None
    """The exchange of an ``int8`` or ``int4`` wire (None: a float wire)."""

    @property
    def delay_steps(self) -> int:
        return self.spec.delay_steps

    @property
    def num_elements(self) -> int:
        return sum(g.numel() for g in self.global_)

    def due(self, step: int) -> bool:
        """Whether a sync is launched after ``step``."""
        return syncs_after(self.spec, self.index, step)

    def applies(self, step: int) -> bool:
        """Whether the pending average is applied after ``step``."""
        return self.pending is not None and applied_after(self.spec, self.index, step)

    def pending_at(self, steps_done: int) -> bool:
        """Whether an average is pending after ``steps_done`` steps: one was launched in the
        last ``delay_steps`` steps (a checkpoint is taken before the closing sync)."""
        first = max(0, steps_done - self.delay_steps)
        return any(self.due(s) for s in range(first, steps_done))


def host_copy(param: nn.Parameter) -> Tensor:
    return param.detach().to("cpu", torch.float32, copy=True)


def named_views(frag: OuterFragment, flat: Tensor) -> dict[str, Tensor]:
    """A flat float32 buffer of the fragment as host tensors by name (views)."""
    out, offset = {}, 0
    for name, g in zip(frag.names, frag.global_, strict=True):
        out[name] = flat[offset : offset + g.numel()].view_as(g)
        offset += g.numel()
    return out


def _launch(frag: OuterFragment, deltas: Sequence[Tensor]) -> PendingExchange:
    """Start the exchange of this island's pseudo-gradients (host float32, by parameter):
    a float wire's weighted SUM all-reduce over the holder set, or a quantized one
    (``outer_exchange.QuantizedExchange``)."""
    device = frag.params[0].device
    flat = torch.cat([d.reshape(-1) for d in deltas])
    try:
        if frag.quantized is not None:
            return frag.quantized.launch(flat, device)
        wire = getattr(torch, frag.spec.wire_dtype.value)
        flat = (flat * frag.weight if frag.weight else torch.zeros_like(flat)).to(device, wire)
        launched_s = time.monotonic()
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=frag.group, async_op=True)
    except RuntimeError as exc:
        raise _failure(frag, exc) from None
    assert work is not None
    return PendingExchange(launched_s, work, [flat])


def arrive(frag: OuterFragment, pending: PendingExchange) -> None:
    """Wait for ``pending`` (and its emulated floors); its ``average`` is then set."""
    if pending.average is not None:
        return
    device = frag.params[0].device
    try:
        if frag.quantized is not None:
            pending.average = frag.quantized.arrive(pending, frag.num_elements, device)
            return
        assert pending.work is not None
        pending.work.wait()
        pending.work = None
        hold_floor(frag.group, pending.launched_s, frag.floor_s, device)
    except RuntimeError as exc:
        raise _failure(frag, exc) from None
    pending.average = pending.buffers[0].to("cpu", torch.float32)
    pending.buffers = []


def _apply(frag: OuterFragment, pending: PendingExchange) -> None:
    """G ← outer(G, average of ``pending``)."""
    arrive(frag, pending)
    assert pending.average is not None
    for g, average in zip(frag.global_, named_views(frag, pending.average).values(), strict=True):
        g.grad = average
    frag.optimizer.step()
    frag.optimizer.zero_grad(set_to_none=True)


def _set_local(frag: OuterFragment, values: Sequence[Tensor]) -> None:
    with torch.no_grad():
        for param, value in zip(frag.params, values, strict=True):
            param.copy_(value.to(param.device, param.dtype))


def step_fragment(frag: OuterFragment, *, applies: bool, due: bool) -> None:
    """One step of ``frag`` that applies a pending average, launches a sync, or both
    (``OuterSyncSpec.overlap_steps``, ``delay_steps`` τ).

    Launch (after step s): island i's pseudo-gradient ``Δ_i = G - L_i`` (L: the island's
    parameters) starts on its way; the holder set gets ``Σ_i (n_i / N) Δ_i`` (n_i:
    ``island_samples``, N: the global batch). A float wire sums in one SUM all-reduce: the
    lowest holder inside each island contributes ``(n_i / N) Δ_i``, the island's other
    holders zeros (a tied weight held twice in an island counts once), in the group's
    ``wire_dtype``, back to float32 after; a quantized wire sums the decoded payloads
    (``outer_exchange.py``). With τ >= 1, A ← L.

    Apply (after step s + τ): wait; ``G.grad = average``, an outer step; L ← G - (A - L)
    (the island keeps the change it made since the launch on top of the new globals). When
    a launch falls on the same step (τ = H, ``async``), its pseudo-gradient is that change,
    ``A - L`` (= G - L after the apply, exactly). With τ = 0 the apply follows the launch at
    once and L ← G (DiLoCo). The inner optimizer's state stays each island's own.
    """
    deltas: list[Tensor] | None = None
    if applies:
        assert frag.pending is not None
        pending, frag.pending = frag.pending, None
        change = [a - host_copy(p) for a, p in zip(frag.start, frag.params, strict=True)]
        _apply(frag, pending)
        _set_local(frag, [g - c for g, c in zip(frag.global_, change, strict=True)])
        deltas = change if due else None
    if not due:
        return
    if deltas is None:
        deltas = [g - host_copy(p) for g, p in zip(frag.global_, frag.params, strict=True)]
    launched = _launch(frag, deltas)
    if frag.delay_steps == 0:
        _apply(frag, launched)
        _set_local(frag, frag.global_)
        return
    frag.pending = launched
    frag.start = [host_copy(p) for p in frag.params]


def close_fragment(frag: OuterFragment, progress: bool) -> None:
    """The end of a run: apply what is pending, sync what is left (``progress``: the
    fragment changed since its last launch) blocking, and L ← G, so that the run ends with
    every island holding the same parameters."""
    deltas: list[Tensor] | None = None
    if progress:
        base = frag.start if frag.pending is not None else frag.global_
        deltas = [b - host_copy(p) for b, p in zip(base, frag.params, strict=True)]
    if frag.pending is not None:
        pending, frag.pending = frag.pending, None
        _apply(frag, pending)
    if deltas is not None:
        _apply(frag, _launch(frag, deltas))
    _set_local(frag, frag.global_)
    frag.start = [g.clone() for g in frag.global_] if frag.delay_steps else []


def _failure(frag: OuterFragment, exc: RuntimeError) -> PeerFailureError:
    others = [i for i in frag.islands if i != frag.own_island]
    who = f"island {others[0]}" if len(others) == 1 else f"islands {', '.join(others)}"
    whose = "its" if len(others) == 1 else "their"
    return PeerFailureError(
        f"outer sync ({frag.spec.mode.value}) of ranks {list(frag.spec.ranks)} across islands "
        f"{', '.join(frag.islands)} failed: {error_reason(exc)}; {who} probably fell behind "
        f"or failed; check {whose} logs"
    )
