"""The tensors a traced stage holds, and their full-build values put in their places.

A stage's graph module has the module paths of the model it was traced from. When that
model was built on fake tensors (``materialise.record_build``), :func:`materialise` finds
every fake tensor the stage holds (parameters, buffers and plain tensor attributes, at
any depth), replays the build with only those made real (``materialise.replay_build``) and
puts the replayed tensors at the same paths. A tensor tied under two paths is one tensor in
the replayed model, so it stays tied in the stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from hplan.runtime.capture.materialise import (
    BuildRecord,
    CannotMaterialise,
    real_steps,
    replay_build,
)

__all__ = ["materialise"]


_Kind = Literal["parameter", "buffer", "attribute"]


@dataclass(frozen=True, slots=True)
class _Slot:
    """Where a module holds a tensor."""

    module: nn.Module
    kind: _Kind
    """``attribute``: a plain tensor attribute."""
    name: str
    path: str
    """Module path and name, from the root module."""
    tensor: torch.Tensor


def materialise(
    module: nn.Module, record: BuildRecord, build: Callable[[], Any], seed: int
) -> None:
    """Replace every fake tensor of ``module`` by its full-build value.

    ``module`` is made from ``record.model`` with the same module paths (a stage's graph
    module): the tensors at those paths in a replayed build (:func:`replay_build`) that
    builds only them (and what they depend on) take their places; ties stay ties.

    Raises:
        CannotMaterialise: a fake tensor of ``module`` is at no path of the model, or the
            replay fails.
    """
    slots = [s for s in _slots(module) if is_fake(s.tensor)]
    keep = []
    for slot in slots:
        source = _at_path(record.model, slot.path)
        if source is None:
            raise CannotMaterialise(f"the traced stage holds {slot.path!r}, not the model")
        keep.append(record.ordinal(source))
    built = replay_build(build, seed, record, real_steps(record, keep))
    for slot in slots:
        value = _at_path(built, slot.path)
        if value is None or is_fake(value):
            raise CannotMaterialise(f"the second build did not make {slot.path!r}")
        if _signature(value) != _signature(slot.tensor):
            raise CannotMaterialise(f"the second build made {slot.path!r} otherwise")
        _assign(slot, value)


def _signature(tensor: torch.Tensor) -> tuple[bool, tuple[int, ...], torch.dtype]:
    return isinstance(tensor, nn.Parameter), tuple(tensor.shape), tensor.dtype


def _slots(module: nn.Module) -> Iterator[_Slot]:
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        tables: tuple[tuple[_Kind, Mapping[str, Any]], ...] = (
            ("parameter", sub._parameters),
            ("buffer", sub._buffers),
            ("attribute", vars(sub)),
        )
        for kind, table in tables:
            for name, value in table.items():
                if isinstance(value, torch.Tensor):
                    yield _Slot(sub, kind, name, f"{dot}{name}", value)


def _at_path(model: nn.Module, path: str) -> torch.Tensor | None:
    prefix, _, name = path.rpartition(".")
    try:
        sub = model.get_submodule(prefix)
    except AttributeError:
        return None
    for table in (sub._parameters, sub._buffers, vars(sub)):
        value = table.get(name)
        if isinstance(value, torch.Tensor):
            return value
    return None


def _assign(slot: _Slot, value: torch.Tensor) -> None:
    if slot.kind == "parameter":
        slot.module._parameters[slot.name] = value  # type: ignore[assignment]
    elif slot.kind == "buffer":
        slot.module._buffers[slot.name] = value
    else:
        setattr(slot.module, slot.name, value)
