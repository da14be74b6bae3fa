"""Point-to-point transfers of boundary tensors between consecutive pipeline stages.

Every tensor that crosses a cut is described in the plan (``CutSpec.tensors``: name, shape
per sample, dtype, batch dimension, whether a gradient flows back). The sender checks each
real tensor against that description before sending (:func:`check_boundary_tensors`), so
a mismatch is a ``PlanMismatchError`` on the sender, never a hang or a garbled receive;
receivers allocate their buffers from the plan alone, per micro-batch. Tensors travel as
raw bytes (``uint8`` views of a contiguous copy), so every dtype arrives unchanged whatever
the backend supports. Sends are posted with ``isend`` and completed at the end of the step
(:meth:`StageComm.wait_sends`), receives waited for when their action runs, so the 1F1B
pattern cannot deadlock (``contract.schedule.dry_run``). Under a rehearsal's link delay
(``seams.LinkDelay``) the sender first sends a small header with the time the data may be
used, and the receiver holds the bytes until then; real runs send no header.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from hplan.runtime.contract.errors import PeerFailureError, PlanMismatchError, error_reason
from hplan.runtime.contract.plan import TensorSpec
from hplan.runtime.executor.seams import LinkDelay


def torch_dtype(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``.

    Raises:
        PlanMismatchError: torch has no dtype of that name.
    """
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise PlanMismatchError(f"plan names dtype {name!r}, which this torch does not have")
    return dtype


def check_boundary_tensors(
    specs: Sequence[TensorSpec],
    tensors: Mapping[str, Tensor],
    micro_batch_size: int,
    *,
    where: str,
) -> None:
    """Check real boundary tensors against the plan before they are sent.

    Args:
        specs: the cut's tensors, in cut order.
        tensors: name -> tensor produced by the stage.
        micro_batch_size: samples in this micro-batch.
        where: human-readable place, e.g. ``"cut after blocks.1 (rank 0 -> rank 1)"``.

    Raises:
        PlanMismatchError: a tensor is missing, has another shape or dtype than the plan
            says, or needs a gradient the plan does not send back. The message names the
            tensor, the expected and the actual value.
    """
    for spec in specs:
        if spec.name not in tensors:
            raise PlanMismatchError(
                f"{where}: tensor {spec.name!r} is not produced by the stage; "
                "re-run `hplan solve` with this model file"
            )
        _check_one(spec, tensors[spec.name], micro_batch_size, where)


def _check_one(spec: TensorSpec, tensor: Tensor, micro_batch_size: int, where: str) -> None:
    if not isinstance(tensor, Tensor):
        raise PlanMismatchError(
            f"{where}: {spec.name!r} is a {type(tensor).__name__}, the plan expects a tensor; "
            "re-run `hplan solve` with this model file"
        )
    expected_shape = spec.shape_for(micro_batch_size)
    if tuple(tensor.shape) != expected_shape:
        raise PlanMismatchError(
            f"{where}: tensor {spec.name!r} has shape {tuple(tensor.shape)}, the plan expects "
            f"{expected_shape} for a micro-batch of {micro_batch_size}; re-run `hplan solve` "
            "with the shapes this model really produces"
        )
    expected_dtype = torch_dtype(spec.dtype)
    if tensor.dtype != expected_dtype:
        raise PlanMismatchError(
            f"{where}: tensor {spec.name!r} has dtype {_dtype_name(tensor.dtype)}, the plan "
            f"expects {spec.dtype}; re-run `hplan solve` with this model file"
        )
    if tensor.requires_grad and not spec.requires_grad and torch.is_grad_enabled():
        raise PlanMismatchError(
            f"{where}: tensor {spec.name!r} needs a gradient but the plan sends none back for "
            "it; re-run `hplan solve` with this model file"
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def spec_nbytes(spec: TensorSpec, micro_batch_size: int) -> int:
    """Bytes of one boundary tensor for a micro-batch of ``micro_batch_size`` samples.

    Raises:
        PlanMismatchError: torch has no dtype of that name.
        PlanFileError: ``plan.DTYPE_BYTES`` does not know the dtype.
    """
    torch_dtype(spec.dtype)
    return spec.num_bytes(micro_batch_size)


def to_wire(tensor: Tensor) -> Tensor:
    """A contiguous ``uint8`` view of ``tensor``'s bytes (detached), ready to send."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8)


def wire_buffer(spec: TensorSpec, micro_batch_size: int, device: torch.device) -> Tensor:
    """An empty ``uint8`` receive buffer for one boundary tensor (from the plan alone)."""
    return torch.empty(spec_nbytes(spec, micro_batch_size), dtype=torch.uint8, device=device)


def from_wire(buffer: Tensor, spec: TensorSpec, micro_batch_size: int) -> Tensor:
    """Reinterpret received bytes as the spec's dtype and shape (no copy)."""
    return buffer.view(torch_dtype(spec.dtype)).reshape(spec.shape_for(micro_batch_size))


@dataclass(frozen=True)
class Boundary:
    """One side of a cut as seen from this rank."""

    peer_rank: int
    """The rank this side receives from (activations from the previous stage, gradients
    from the next)."""
    specs: tuple[TensorSpec, ...]
    label: str
    """E.g. ``"cut after blocks.1"``; used in error messages."""
    send_to: tuple[int, ...] | None = None
    """The ranks this side sends to; None: ``(peer_rank,)``. Between TP groups a rank may
    send to several ranks, or to none (``worker.boundaries``)."""

    @property
    def destinations(self) -> tuple[int, ...]:
        """The ranks this side sends to."""
        return (self.peer_rank,) if self.send_to is None else self.send_to


@dataclass
class CommTimes:
    """Seconds spent in point-to-point work during one step."""

    p2p_s: float = 0.0
    """Posting sends, completing them, and emulated link delays."""
    wait_s: float = 0.0
    """Blocked in receives, waiting for a peer (pipeline bubbles and transfers)."""


@dataclass
class StageComm:
    """Point-to-point transfers of one rank with its previous and next stage."""

    rank: int
    device: torch.device
    prev: Boundary | None
    next: Boundary | None
    delay: LinkDelay = field(default_factory=LinkDelay)
    """How long transfers must seem to take (``seams.LinkDelay``; default: as they are)."""
    post_ahead: bool = False
    """Receives may be posted before their action runs (gloo): the receive of the next
    action is posted when the current one starts (:meth:`post_activations_recv`,
    :meth:`post_grads_recv`). gloo hands a message over only once its receive is posted,
    which costs a round trip of the two processes' wake-ups; a receive posted ahead takes
    the bytes in while this rank computes. NCCL keeps program order (a receive posted early
    on a pair's stream would block the sends behind it)."""
    times: CommTimes = field(default_factory=CommTimes)
    _pending: list[tuple[dist.Work, int, str]] = field(default_factory=list)
    _posted: dict[tuple[str, int], _PostedRecv] = field(default_factory=dict)

    # ----------------------------------------------------------------- forward direction
    def send_activations(self, mb_idx: int, mb_size: int, outputs: Mapping[str, Tensor]) -> None:
        """Check and send this stage's boundary outputs of one micro-batch to the next stage.

        Raises:
            PlanMismatchError: a tensor differs from the plan (see check_boundary_tensors).
        """
        assert self.next is not None
        where = f"{self.next.label} (rank {self.rank} -> rank {self.next.peer_rank})"
        check_boundary_tensors(self.next.specs, outputs, mb_size, where=where)
        payload = [outputs[spec.name] for spec in self.next.specs]
        self._send(self.next, mb_idx, payload, "activations")

    def recv_activations(self, mb_idx: int, mb_size: int) -> dict[str, Tensor]:
        """Receive the previous stage's boundary tensors of one micro-batch.

        Float tensors whose spec says ``requires_grad`` come back as leaves that require
        grad, so their ``.grad`` can be sent back after the backward pass.

        Raises:
            PeerFailureError: the previous stage died or timed out.
        """
        assert self.prev is not None
        received = self._complete(self.post_activations_recv(mb_idx, mb_size))
        for spec in self.prev.specs:
            if spec.requires_grad:
                received[spec.name].requires_grad_(True)
        return received

    # ----------------------------------------------------------------- backward direction
    def send_grads(self, mb_idx: int, mb_size: int, received: Mapping[str, Tensor]) -> None:
        """Send the gradients of the received tensors that need one (zeros if unused)."""
        assert self.prev is not None
        payload = []
        for spec in _grad_specs(self.prev.specs):
            grad = received[spec.name].grad
            if grad is None:
                grad = torch.zeros_like(received[spec.name])
            payload.append(grad.to(torch_dtype(spec.dtype)))
        self._send(self.prev, mb_idx, payload, "gradients")

    def recv_grads(self, mb_idx: int, mb_size: int) -> dict[str, Tensor]:
        """Receive the next stage's gradients for the sent tensors that need one.

        Raises:
            PeerFailureError: the next stage died or timed out.
        """
        return self._complete(self.post_grads_recv(mb_idx, mb_size))

    def post_activations_recv(self, mb_idx: int, mb_size: int) -> _PostedRecv:
        """Post (once) the receive of one micro-batch's activations from the previous stage.

        Raises:
            PeerFailureError: the previous stage died.
        """
        assert self.prev is not None
        return self._post_recv(self.prev, mb_idx, mb_size, list(self.prev.specs), "activations")

    def post_grads_recv(self, mb_idx: int, mb_size: int) -> _PostedRecv:
        """Post (once) the receive of one micro-batch's gradients from the next stage.

        Raises:
            PeerFailureError: the next stage died.
        """
        assert self.next is not None
        specs = _grad_specs(self.next.specs)
        return self._post_recv(self.next, mb_idx, mb_size, specs, "gradients")

    def wait_sends(self) -> None:
        """Complete every send posted this step.

        Raises:
            PeerFailureError: a receiver died or timed out.
        """
        start_s = time.monotonic()
        pending, self._pending = self._pending, []
        for work, peer, what in pending:
            _wait(work, self.rank, peer, what)
        self.times.p2p_s += time.monotonic() - start_s

    def reset_times(self) -> CommTimes:
        """Return this step's times and start counting from zero."""
        times, self.times = self.times, CommTimes()
        return times

    # ----------------------------------------------------------------- plumbing
    def _send(self, side: Boundary, mb_idx: int, tensors: list[Tensor], what: str) -> None:
        if not tensors:
            return
        start_s = time.monotonic()
        wires = [to_wire(t) for t in tensors]
        label = f"{what} of micro-batch {mb_idx} ({side.label})"
        for peer in side.destinations:
            self._send_to(peer, mb_idx, wires, label)
        self.times.p2p_s += time.monotonic() - start_s

    def _send_to(self, peer: int, mb_idx: int, wires: list[Tensor], label: str) -> None:
        tags = _tags(mb_idx, len(wires))
        if self.delay.delays(peer):
            nbytes = sum(w.numel() for w in wires)
            ready_s = self.delay.ready_time_s(peer, time.monotonic(), nbytes)
            header = torch.tensor([ready_s], dtype=torch.float64, device=self.device)
            wires = [header, *wires]
        else:
            tags = tags[1:]
        for wire, tag in zip(wires, tags, strict=True):
            work = _post(dist.isend, wire, peer, tag, self.rank, label)
            self._pending.append((work, peer, label))

    def _post_recv(
        self,
        side: Boundary,
        mb_idx: int,
        mb_size: int,
        specs: list[TensorSpec],
        what: str,
    ) -> _PostedRecv:
        key = (what, mb_idx)
        posted = self._posted.get(key)
        if posted is not None:
            return posted
        start_s = time.monotonic()
        label = f"{what} of micro-batch {mb_idx} ({side.label})"
        buffers = [wire_buffer(spec, mb_size, self.device) for spec in specs]
        tags = _tags(mb_idx, len(buffers))
        emulated = bool(specs) and self.delay.delays(side.peer_rank)
        if emulated:
            buffers = [torch.zeros(1, dtype=torch.float64, device=self.device), *buffers]
        else:
            tags = tags[1:]
        works = [
            _post(dist.irecv, b, side.peer_rank, t, self.rank, label)
            for b, t in zip(buffers, tags, strict=True)
        ]
        posted = _PostedRecv(key, side.peer_rank, label, specs, mb_size, buffers, works, emulated)
        self._posted[key] = posted
        self.times.p2p_s += time.monotonic() - start_s
        return posted

    def _complete(self, posted: _PostedRecv) -> dict[str, Tensor]:
        """Wait for a posted receive, then for its emulated arrival time."""
        del self._posted[posted.key]
        if not posted.specs:
            return {}
        start_s = time.monotonic()
        for work in posted.works:
            _wait(work, self.rank, posted.peer_rank, posted.label)
        arrived_s = time.monotonic()
        self.times.wait_s += arrived_s - start_s
        buffers = posted.buffers
        if posted.emulated:
            header, buffers = buffers[0], buffers[1:]
            self.delay.hold_until(float(header.item()))
            self.times.p2p_s += time.monotonic() - arrived_s
        return {
            spec.name: from_wire(buf, spec, posted.mb_size).clone()
            for spec, buf in zip(posted.specs, buffers, strict=True)
        }


@dataclass
class _PostedRecv:
    """A receive whose ``irecv`` calls are posted (the emulation header first, if any)."""

    key: tuple[str, int]
    peer_rank: int
    label: str
    specs: list[TensorSpec]
    mb_size: int
    buffers: list[Tensor]
    works: list[dist.Work]
    emulated: bool


def _grad_specs(specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    return [spec for spec in specs if spec.requires_grad]


def _tags(mb_idx: int, num_tensors: int) -> list[int]:
    """Tags of one micro-batch's messages: the emulation header first, then each tensor."""
    base = mb_idx * (num_tensors + 1)
    return [base + i for i in range(num_tensors + 1)]


def _post(
    op: Callable[..., dist.Work | None], tensor: Tensor, peer: int, tag: int, rank: int, what: str
) -> dist.Work:
    try:
        work = op(tensor, peer, tag=tag)
    except RuntimeError as exc:
        raise _peer_failure(rank, peer, what, exc) from None
    assert work is not None
    return work


def _wait(work: dist.Work, rank: int, peer: int, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as exc:
        raise _peer_failure(rank, peer, what, exc) from None


def _peer_failure(rank: int, peer: int, what: str, exc: BaseException) -> PeerFailureError:
    return PeerFailureError(
        f"rank {rank} lost rank {peer} while exchanging {what}: {error_reason(exc)}; "
        f"check rank {peer}'s log (it probably failed first) and the network between them"
    )
