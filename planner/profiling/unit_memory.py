"""Memory of one forward + backward of a partition unit: activations kept, peak.

- *Activations kept for backward*: the distinct storages that autograd saves during the
  forward (``torch.autograd.graph.saved_tensors_hooks``), parameters and buffers excluded.
- *Peak*: the bytes that existed before (the unit's parameters, buffers and inputs) plus
  the largest growth of memory in use during the forward and backward. On CUDA the growth
  is ``torch.cuda.max_memory_allocated`` minus ``memory_allocated`` before the run (the
  rest of the model may sit on the same device; it does not count). On a CPU torch keeps
  no allocator statistics, so :class:`LiveBytes` (a ``TorchDispatchMode``) adds up the
  storages that ops create and drops each once it is freed. Gradients count, as the
  backward creates them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass(frozen=True, slots=True)
class UnitMemory:
    """Bytes of one micro-batch's forward + backward through a unit."""

    activation_bytes: int
    """Kept for backward by the forward (parameters and buffers excluded)."""
    peak_bytes: int
    """Largest memory in use during forward + backward, parameters and inputs included."""


class LiveBytes(TorchDispatchMode):
    """Tracks bytes of the storages that ops create while the mode is active.

    ``current_bytes`` drops a storage's bytes once no tensor refers to it (checked at
    each op); ``peak_bytes`` is the largest ``current_bytes`` seen.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[StorageWeakRef, int] = {}
        self.current_bytes = 0
        self.peak_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._drop_freed()
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self._add(value)
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return out

    def _add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = StorageWeakRef(storage)
        if key not in self._live:
            self._live[key] = storage.nbytes()
            self.current_bytes += storage.nbytes()

    def _drop_freed(self) -> None:
        for key in [k for k in self._live if k.expired()]:
            self.current_bytes -= self._live.pop(key)


def storage_keys(tensors: Iterable[torch.Tensor]) -> set[StorageWeakRef]:
    """Weak keys of the tensors' storages (to exclude parameters from saved bytes)."""
    return {StorageWeakRef(t.untyped_storage()) for t in tensors}


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors``."""
    seen: dict[StorageWeakRef, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen.setdefault(StorageWeakRef(storage), storage.nbytes())
    return sum(seen.values())


def measure_unit_memory(
    forward: Callable[[], Any],
    backward: Callable[[Any], None],
    *,
    device: torch.device,
    resident: Iterable[torch.Tensor],
) -> UnitMemory:
    """Run ``backward(forward())`` once and measure its memory (see the module docstring).

    Args:
        forward: runs the unit's forward and returns what ``backward`` needs.
        backward: runs the backward.
        device: where the unit runs.
        resident: tensors that exist before the run (parameters, buffers, inputs); their
            storages are not activations, and their bytes are the peak's base.
    """
    resident = list(resident)
    excluded = storage_keys(resident)
    saved: dict[StorageWeakRef, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = StorageWeakRef(tensor.untyped_storage())
        if key not in excluded:
            saved.setdefault(key, tensor.untyped_storage().nbytes())
        return tensor

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        with hooks:
            result = forward()
        backward(result)
        torch.cuda.synchronize(device)
        growth = int(torch.cuda.max_memory_allocated(device)) - before
    else:
        live = LiveBytes()
        with live:
            with hooks:
                result = forward()
            backward(result)
        growth = live.peak_bytes
    peak = storage_bytes(resident) + growth
    return UnitMemory(activation_bytes=sum(saved.values()), peak_bytes=peak)
