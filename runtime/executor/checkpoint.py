"""Checkpoints keyed by parameter name, so one written under a plan loads under another.

Every parameter and buffer is saved once: by the lowest rank that holds it (the holder maps
of ``grad_sync``), together with its optimizer state. Layout::

    <dir>/step-<n>/rank-<r>.pt   {"params", "buffers", "optimizer": {name: ...}, "steps"}
    <dir>/latest                 "step-<n>", written by rank 0 after every rank saved

Loading reads every ``rank-*.pt`` of the latest step and takes the names this rank holds,
whatever plan wrote them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from hplan.runtime.capture.stage import StageModule
from hplan.runtime.contract.errors import PlanMismatchError
from hplan.runtime.contract.holders import buffer_holders, parameter_holders
from hplan.runtime.contract.plan import Plan

_LATEST = "latest"


@dataclass(frozen=True)
class TrainState:
    """What a checkpoint saves and restores of one rank."""

    plan: Plan
    rank: int
    stage: StageModule
    params: Sequence[tuple[str, nn.Parameter]]
    """The stage's parameters by canonical name."""
    optimizer: torch.optim.Optimizer


def save_checkpoint(
    state: TrainState, directory: Path, steps_done: int, barrier: Callable[[], None]
) -> None:
    """Save every parameter and buffer once, by canonical name, plus its optimizer state.

    The lowest rank holding a name writes it, to ``<dir>/step-<n>/rank-<r>.pt``; rank 0
    then writes ``<dir>/latest``. A checkpoint written under one plan loads under any other
    plan of the same model (names, not ranks, are the keys). Collective: every rank calls it.
    """
    rank = state.rank
    step_dir = directory / f"step-{steps_done}"
    if rank == 0:
        step_dir.mkdir(parents=True, exist_ok=True)
        for stale in step_dir.glob("rank-*.pt"):  # left by a run of another plan
            stale.unlink()
    barrier()
    owners = parameter_holders(state.plan)
    buffer_owners = buffer_holders(state.plan)
    params = {n: p.detach().cpu() for n, p in state.params if owners[n][0] == rank}
    optim = {n: s for n, s in _optimizer_state_by_name(state).items() if n in params}
    buffers = {
        n: b.detach().cpu()
        for n, b in state.stage.canonical_buffers()
        if buffer_owners.get(n, (rank,))[0] == rank
    }
    payload = {"params": params, "buffers": buffers, "optimizer": optim, "steps": steps_done}
    torch.save(payload, step_dir / f"rank-{rank}.pt")
    barrier()
    if rank == 0:
        (directory / _LATEST).write_text(step_dir.name + "\n", encoding="utf-8")


def _param_names_in_optimizer_order(state: TrainState) -> list[str]:
    """Canonical names in the order of ``optimizer.state_dict()``'s parameter indices."""
    names = {id(p): n for n, p in state.params}
    return [names[id(p)] for group in state.optimizer.param_groups for p in group["params"]]


def _optimizer_state_by_name(state: TrainState) -> dict[str, dict[str, Any]]:
    order = _param_names_in_optimizer_order(state)
    saved = state.optimizer.state_dict()["state"]
    return {
        order[idx]: {k: v.cpu() if isinstance(v, Tensor) else v for k, v in value.items()}
        for idx, value in saved.items()
    }


def load_checkpoint(state: TrainState, directory: Path) -> int:
    """Load the latest checkpoint in ``directory`` if there is one; return its step count.

    Optimizer state goes through ``Optimizer.load_state_dict``, which places each value on
    the device torch's optimizer expects.

    Raises:
        PlanMismatchError: the checkpoint lacks a parameter this rank holds, or its shape
            differs.
    """
    latest = directory / _LATEST
    if not latest.is_file():
        return 0
    step_dir = directory / latest.read_text(encoding="utf-8").strip()
    merged: dict[str, dict[str, Any]] = {"params": {}, "buffers": {}, "optimizer": {}}
    steps = 0
    for path in sorted(step_dir.glob("rank-*.pt")):
        payload = torch.load(path, map_location="cpu", weights_only=True)
        for key in merged:
            merged[key].update(payload[key])
        steps = int(payload["steps"])
    with torch.no_grad():
        for name, param in state.params:
            param.copy_(_saved_tensor(merged["params"], name, tuple(param.shape), step_dir))
        for name, buffer in state.stage.canonical_buffers():
            if name in merged["buffers"]:
                buffer.copy_(merged["buffers"][name])
    order = _param_names_in_optimizer_order(state)
    optimizer_state = state.optimizer.state_dict()
    optimizer_state["state"] = {
        idx: merged["optimizer"][name]
        for idx, name in enumerate(order)
        if name in merged["optimizer"]
    }
    state.optimizer.load_state_dict(optimizer_state)
    return steps


def _saved_tensor(
    saved: dict[str, Tensor], name: str, shape: tuple[int, ...], where: Path
) -> Tensor:
    if name not in saved:
        raise PlanMismatchError(
            f"checkpoint {str(where)!r} has no parameter {name!r}; was it written for another "
            "model? Use a fresh --checkpoint-dir"
        )
    if tuple(saved[name].shape) != shape:
        raise PlanMismatchError(
            f"checkpoint parameter {name!r} has shape {tuple(saved[name].shape)}, the model has "
            f"{shape}; use a fresh --checkpoint-dir"
        )
    return saved[name]
