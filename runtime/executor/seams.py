"""The executor's two seams: a compute clock and a link delay, with do-nothing defaults;
and its memory meter (:class:`MemoryMeter`).

A rehearsal (``hplan.runtime.rehearsal``) emulates other hardware by plugging its own
implementations into these two seams, and nowhere else:

- :class:`ComputeClock` wraps every forward, backward and optimizer step of a rank. The
  default times real work: host clocks on a CPU (:class:`HostClock`), CUDA events on a GPU
  (:class:`CudaEventClock`: a host clock would time only the kernel launches, as the
  kernels run asynchronously).
- :class:`LinkDelay` says how long a point-to-point transfer or a gradient all-reduce must
  seem to take; the base class adds nothing.

Both are on the executor's hot path; the defaults do no more than time the block.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import importlib
import resource
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from hplan.runtime.contract.metrics_file import MemoryMeasure
from hplan.runtime.contract.quantities import BYTES_PER_KIB, MS_PER_S

if TYPE_CHECKING:
    from hplan.runtime.executor.data import MicroBatch
    from hplan.runtime.executor.pipeline import StepRunner

__all__ = [
    "ComputeClock",
    "ComputeSpan",
    "CudaEventClock",
    "HostClock",
    "LinkDelay",
    "MemoryMeter",
    "Phase",
    "Seams",
    "default_clock",
    "preload_build_modules",
]


class Phase(StrEnum):
    """What a compute span did."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


@dataclass(frozen=True, slots=True)
class ComputeSpan:
    """One timed block of compute, on the host's ``time.monotonic`` clock (seconds)."""

    phase: Phase
    label: str
    """E.g. ``s1.F.mb3`` (the schedule's action) or ``optimizer``."""
    start_s: float
    end_s: float
    cpu_s: float = 0.0
    """CPU seconds the process used during the block, every thread's (0: not measured, as
    on a GPU, whose work the host only launches)."""

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


class ComputeClock(ABC):
    """Wraps a rank's compute blocks; times them (and, in a rehearsal, stretches them).

    The forward and backward hooks receive what the block works on, for an emulation that
    needs it (a rehearsal of a cpu plan re-times its stage on the first step's
    micro-batches); by default each names its phase and calls :meth:`_block`, the one
    method a clock must say: how one block is timed.
    """

    def forward(
        self,
        label: str,
        mb: MicroBatch,
        inputs: Mapping[str, Tensor],
        received: Mapping[str, Tensor],
    ) -> contextlib.AbstractContextManager[None]:
        """Wrap the forward of micro-batch ``mb`` (graph ``inputs``, ``received`` tensors)."""
        return self._block(Phase.FORWARD, label, mb.num_samples)

    def backward(
        self, label: str, mb: MicroBatch, grads: Mapping[str, Tensor]
    ) -> contextlib.AbstractContextManager[None]:
        """Wrap the backward of ``mb`` (``grads``: the next stage's gradients)."""
        return self._block(Phase.BACKWARD, label, mb.num_samples)

    def optimizer(self) -> contextlib.AbstractContextManager[None]:
        """Wrap the optimizer step."""
        return self._block(Phase.OPTIMIZER, "optimizer", 0)

    def after_step(self, step: int, runner: StepRunner, *, more_steps: bool) -> None:
        """Called by every rank after each optimizer step (collectives allowed)."""
        return None

    def timeline_s(self, monotonic_s: float) -> float:
        """Where a moment of this step (a ``time.monotonic`` reading) lies on this clock's
        timeline: the moment itself, unless the clock stretches its blocks (a rehearsal),
        where work done inside a block counts as done proportionally later."""
        return monotonic_s

    @abstractmethod
    def take_spans(self) -> list[ComputeSpan]:
        """The spans of the blocks since the last call, oldest first (waits for the device)."""

    @abstractmethod
    def _block(
        self, phase: Phase, label: str, num_samples: int
    ) -> contextlib.AbstractContextManager[None]:
        """Time one block of ``phase`` (``num_samples``: its micro-batch's; 0 for the
        optimizer)."""


class HostClock(ComputeClock):
    """Times each block with ``time.monotonic`` (CPU work runs synchronously), and the CPU
    time it used with ``time.process_time``: under a cgroup CPU quota a block's wall time
    depends on how long the rank idled before it (a rank that waits for its peers runs its
    next block at a full core's speed), its CPU time does not (``windows.sustained``)."""

    def __init__(self) -> None:
        self._spans: list[ComputeSpan] = []

    @contextlib.contextmanager
    def _block(self, phase: Phase, label: str, num_samples: int) -> Iterator[None]:
        start_s, start_cpu_s = time.monotonic(), time.process_time()
        try:
            yield
        finally:
            # the CPU clock first: reading it is where a due quota pause falls (microbench)
            cpu_s = time.process_time() - start_cpu_s
            self._spans.append(ComputeSpan(phase, label, start_s, time.monotonic(), cpu_s))

    def take_spans(self) -> list[ComputeSpan]:
        spans, self._spans = self._spans, []
        return spans


@dataclass
class _PendingSpan:
    phase: Phase
    label: str
    start: torch.cuda.Event
    end: torch.cuda.Event


class CudaEventClock(ComputeClock):
    """Times each block with a pair of CUDA events on the rank's device.

    Kernels run asynchronously, so a host clock around a block times only their launch.
    The events are read in :meth:`take_spans`, which waits for the device; each span is
    placed on the host clock relative to an anchor event recorded (and host-timed) at the
    first block after the previous call, so spans line up with the host-timed receives and
    all-reduces of the same step up to the launch queue's lag.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: list[_PendingSpan] = []
        self._anchor: tuple[torch.cuda.Event, float] | None = None

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextlib.contextmanager
    def _block(self, phase: Phase, label: str, num_samples: int) -> Iterator[None]:
        if self._anchor is None:
            self._anchor = (self._event(), time.monotonic())
        start = self._event()
        try:
            yield
        finally:
            self._pending.append(_PendingSpan(phase, label, start, self._event()))

    def take_spans(self) -> list[ComputeSpan]:
        if self._anchor is None:
            return []
        torch.cuda.synchronize(self.device)
        anchor, anchor_s = self._anchor
        spans = [
            ComputeSpan(
                p.phase,
                p.label,
                anchor_s + anchor.elapsed_time(p.start) / MS_PER_S,
                anchor_s + anchor.elapsed_time(p.end) / MS_PER_S,
            )
            for p in self._pending
        ]
        self._pending, self._anchor = [], None
        return spans


def default_clock(device: torch.device) -> ComputeClock:
    """CUDA events on a GPU, the host clock elsewhere."""
    if device.type == "cuda":
        return CudaEventClock(device)
    return HostClock()


class LinkDelay:
    """How long transfers and all-reduces must seem to take; this base adds nothing (the
    real links, as they are), a rehearsal's emulated links override it.

    Point-to-point: when :meth:`delays` is true for a peer, the sender asks
    :meth:`ready_time_s` when its bytes may be used and sends that time ahead of them; the
    receiver, once the bytes are in, calls :meth:`hold_until` with it. All-reduce: a bucket
    lasts at least :meth:`all_reduce_floor_s`, counted from when its last holder launched
    it and ended its previous bucket (``grad_sync.GradSync.finish``).
    """

    def delays(self, peer_rank: int) -> bool:
        """Whether transfers with ``peer_rank`` carry a ready time (both ends must agree)."""
        return False

    def ready_time_s(self, peer_rank: int, now_s: float, num_bytes: int) -> float:
        """Monotonic time at which ``num_bytes`` sent to ``peer_rank`` at ``now_s`` arrive."""
        return now_s

    def hold_until(self, ready_s: float) -> None:
        """Wait, on the receiving side, until ``ready_s``."""
        return None

    def all_reduce_floor_s(self, ranks: Sequence[int], num_bytes: int) -> float:
        """Least seconds an all-reduce of ``num_bytes`` among ``ranks`` takes (0: none)."""
        return 0.0


@dataclass(frozen=True)
class Seams:
    """What a run plugs into the executor; the defaults run and time the real hardware."""

    clock: ComputeClock | None = None
    """None: :func:`default_clock` for the rank's device."""
    links: LinkDelay = field(default_factory=LinkDelay)


_PROC_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_RESET_HIGH_WATER = "5"
"""Written to ``/proc/self/clear_refs``: reset the resident-set high-water mark (``VmHWM``)
to the current resident set (Linux >= 4.0, ``Documentation/filesystems/proc.rst``)."""


class MemoryMeter:
    """A rank's memory from the moment it is started: its baseline then, its peak since.

    Start it just before the rank's stage is built (after the interpreter, torch, hplan and
    the process groups are in place): the difference of the two,
    ``StepMetrics.training_memory_bytes``, is then the stage's parameters, gradients,
    optimizer state, activations and buffers, what the plan predicts. How, by device
    (``metrics_file.MemoryMeasure``):

    - GPU: the allocator's peak is reset (``torch.cuda.reset_peak_memory_stats``); baseline
      ``torch.cuda.memory_allocated``, peak ``torch.cuda.max_memory_allocated``;
    - CPU on Linux: the high-water mark is reset (``5`` into ``/proc/self/clear_refs``);
      baseline ``VmRSS``, peak ``VmHWM`` of ``/proc/self/status``;
    - CPU elsewhere (or where ``clear_refs`` cannot be written): ``ru_maxrss``, the lifetime
      peak, for both; the difference misses what the build reused of an earlier, higher
      peak.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._excluded_peak_bytes = 0
        """The peak before the last :meth:`excluded` window (0: none yet)."""
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.measure = MemoryMeasure.CUDA_ALLOCATED
            self.baseline_bytes = int(torch.cuda.memory_allocated(device))
        elif _reset_high_water():
            self.measure = MemoryMeasure.RSS_HIGH_WATER
            self.baseline_bytes = _status_bytes("VmRSS")
        else:
            self.measure = MemoryMeasure.RSS_LIFETIME_PEAK
            self.baseline_bytes = _lifetime_peak_bytes()

    def peak_bytes(self) -> int:
        """The peak since the meter started (or, ``RSS_LIFETIME_PEAK``, ever), outside the
        :meth:`excluded` windows."""
        return max(self._excluded_peak_bytes, self._measured_peak_bytes())

    def _measured_peak_bytes(self) -> int:
        if self.measure is MemoryMeasure.CUDA_ALLOCATED:
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.measure is MemoryMeasure.RSS_HIGH_WATER:
            return _status_bytes("VmHWM")
        return _lifetime_peak_bytes()

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """What runs inside is not the rank's training (a rehearsal timing a copy of its
        stage): its peak is left out of :meth:`peak_bytes`.

        The peak so far is kept; after the window, Python's cyclic garbage is collected
        (what the window left in reference cycles), the C heap's free memory is given
        back to the system (glibc's ``malloc_trim``, where there is one: freed blocks
        below its mmap threshold stay resident otherwise), and the peak is reset to what
        the process holds then, so what the window left behind still counts. Where the
        peak cannot be reset (``RSS_LIFETIME_PEAK``) the window counts.
        """
        before_bytes = self.peak_bytes()
        try:
            yield
        finally:
            gc.collect()
            _trim_heap()
            if self.measure is MemoryMeasure.CUDA_ALLOCATED:
                torch.cuda.reset_peak_memory_stats(self.device)
                self._excluded_peak_bytes = before_bytes
            elif self.measure is MemoryMeasure.RSS_HIGH_WATER and _reset_high_water():
                self._excluded_peak_bytes = before_bytes


BUILD_MODULES = (
    "torch.export",
    "torch._dynamo",
    "torch.distributed.tensor",
    "torch._subclasses.fake_tensor",
    "torch.fx.experimental.symbolic_shapes",
)
"""The parts of torch a rank's build imports on first use (its stage is traced with
``torch.export`` on fake tensors, ``worker.rank_stage``): their resident set belongs in
the process's baseline, not in its training memory."""


def preload_build_modules() -> None:
    """Import :data:`BUILD_MODULES`, so that a :class:`MemoryMeter` started after counts
    them in the process's baseline, with the interpreter and torch, not in the training
    memory that the plan predicts."""
    for name in BUILD_MODULES:
        importlib.import_module(name)


def _trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's ``malloc_trim(0)``); a
    no-op where the C library has no such function."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _reset_high_water() -> bool:
    """Reset this process's resident-set high-water mark; False where Linux's interface
    to do so is missing or refused."""
    try:
        _CLEAR_REFS.write_text(_RESET_HIGH_WATER, encoding="ascii")
        _status_bytes("VmHWM")
    except (OSError, ValueError):
        return False
    return True


def _status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in bytes.

    Raises:
        OSError: no such file. ValueError: no such field.
    """
    for line in _PROC_STATUS.read_text(encoding="ascii").splitlines():
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0]) * BYTES_PER_KIB
    raise ValueError(f"no {field} in {_PROC_STATUS}")


def _lifetime_peak_bytes() -> int:
    """``ru_maxrss`` of this process, in bytes (Linux reports kibibytes, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * BYTES_PER_KIB)
