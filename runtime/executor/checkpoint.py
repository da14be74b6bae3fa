"""Checkpoints with ``torch.distributed.checkpoint``: keyed by name, resumable under any plan.

``<dir>/step-<n>/`` is one checkpoint (DCP's files, ``.metadata`` written last by an atomic
rename, and ``plan.json``, the plan it was written under); ``<dir>/latest`` names the newest
one every rank has confirmed. A checkpoint is complete or invisible: a step folder without
``.metadata`` is never resumed from. Keys name tensors (``model.<name>``, ``buffers.<name>``,
``optimizer.<name>.<key>``, ``progress``; :meth:`Checkpointer.save` lists them), never a rank
or a position except ``rng.<rank>``, and ranks that hold the same tensor write it once
(DCP's deduplication). The data position is the step (``data.py``), so a resume neither
repeats nor skips a sample. A rank loads exactly the names it holds, so a checkpoint resumes
under any plan of the same model and batch (another layer split, other shares, devices or
number of ranks); under the same plan the run continues exactly as if it had not stopped.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

# torch.distributed.checkpoint is imported in the functions that save and load: importing it
# takes about 0.5 s, paid by every rank at start whether it checkpoints or not.
from torch import nn

from hplan.runtime.capture.stage import StageModule
from hplan.runtime.contract.errors import (
    ConfigError,
    PeerFailureError,
    PlanMismatchError,
    error_reason,
)
from hplan.runtime.contract.plan import Plan
from hplan.runtime.executor.memory.offload import OffloadedOptimizer
from hplan.runtime.executor.memory.zero import ShardSync
from hplan.runtime.executor.outer.outer_sync import OuterSync

if TYPE_CHECKING:
    # slow to import (DTensor, sympy): the scaler is built only for fp16 plans.
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

LATEST = "latest"
"""The file naming the newest complete checkpoint."""
KEEP_CHECKPOINTS = 2
"""Complete checkpoints kept (the newest ones); older and unfinished ones are removed."""
_METADATA = ".metadata"


@dataclass(frozen=True)
class TrainState:
    """What a checkpoint saves and restores of one rank."""

    plan: Plan
    rank: int
    stage: StageModule
    params: Sequence[tuple[str, nn.Parameter]]
    """The stage's parameters by canonical name."""
    optimizer: torch.optim.Optimizer
    device: torch.device
    scaler: ShardedGradScaler | None = None
    """The job's shared fp16 loss scaler (``precision.py``), when it has one."""
    outer: OuterSync | None = None
    """This rank's local groups' outer syncs (``outer_sync.py``), when it holds some."""
    shards: ShardSync | None = None
    """Under ZeRO stage 1, the collectives of this rank's optimizer shards (``zero.py``),
    when it holds some."""


@dataclass(frozen=True)
class Progress:
    """Where training stands; the same on every rank."""

    step: int
    """Optimizer steps done (the next step is ``step``)."""
    global_batch_size: int
    seed: int
    plan_digest: str
    loss_scale: float = 0.0
    """The fp16 loss scale (the same on every rank); 0.0: the job scaled no loss. A
    checkpoint written before this field was added loads as 0.0."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "plan_digest": self.plan_digest,
            "loss_scale": self.loss_scale,
        }


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest complete checkpoint in ``directory``; None when there is none.

    Complete means its ``.metadata`` is there: DCP writes it last, by an atomic rename,
    once every rank's data is on disk. That is newer than ``latest`` when a job ended
    between an asynchronous save's last write and its publication.
    """
    steps = []
    for path in directory.glob("step-*"):
        suffix = path.name.removeprefix("step-")
        if suffix.isdigit() and (path / _METADATA).is_file():
            steps.append((int(suffix), path))
    return max(steps)[1] if steps else None


class Checkpointer:
    """Saves and loads one rank's :class:`TrainState` (every call is collective).

    Args:
        asynchronous: stage the state in CPU memory and write it from a background thread
            while training goes on (``dcp.async_save``); the next save, and the end of the
            run, wait for it. Otherwise each save blocks until written.
        timeout_s: the process-group timeout of the checkpoint's own gloo group.
    """

    def __init__(
        self, directory: Path, state: TrainState, *, asynchronous: bool, timeout_s: float
    ) -> None:
        self.directory = directory
        self.state = state
        self.asynchronous = asynchronous
        self._group = _new_gloo_group(timeout_s)
        self._pending: tuple[Future[Any], Path, int] | None = None
        self._saved_step: int | None = None
        """The step of the newest save started (or loaded)."""
        self._published_step = -1
        """The step ``latest`` points at (-1: none of this run)."""

    # ----------------------------------------------------------------- saving
    def save(self, steps_done: int) -> None:
        """Start a checkpoint of the state after ``steps_done`` optimizer steps.

        Keys: ``model.<name>`` and ``buffers.<name>`` by canonical name;
        ``optimizer.<name>.<key>``, each parameter's whole optimizer state (under ZeRO
        gathered to each holder set's lowest rank, which writes it, ``memory/zero.py``);
        ``progress`` (:class:`Progress`); ``rng.<rank>``. A local group's parameters
        (``outer_sync.py``) differ by island, so they are saved apart: ``model.<name>`` is
        G, the global value (after a run's closing sync, what every island ends with), in
        the parameter's dtype; ``outer.global.<name>``, ``outer.momentum.<name>`` and
        ``outer.pending.<name>`` are G in float32, the outer momentum and a pending
        average (``async``, overlapped ``local_sgd``), as a resume needs them (at a run's
        end: before its closing sync); ``island.<island>.model.<name>``,
        ``island.<island>.start.<name>``, ``island.<island>.residual.<name>`` and
        ``island.<island>.optimizer.<name>.<key>`` are each island's own parameters, its A
        (the values at the pending launch), its residual (``int8``/``int4`` wires) and its
        inner optimizer state.

        Raises:
            PeerFailureError: a peer failed while saving.
            ConfigError: the folder cannot be written.
        """
        import torch.distributed.checkpoint as dcp

        if steps_done == self._saved_step:
            return  # this state is saved already (a periodic save on the last step)
        self.wait()
        self._saved_step = steps_done
        step_dir = self.directory / f"step-{steps_done}"
        if self.state.rank == 0:
            _prepare(step_dir, self.state.plan)
        _barrier(self._group, self.state.rank, "checkpoint")
        state = self._state_dict(steps_done)
        try:
            if self.asynchronous:
                future = dcp.async_save(state, checkpoint_id=step_dir, process_group=self._group)
                assert isinstance(future, Future)
                self._pending = (future, step_dir, steps_done)
                return
            dcp.save(state, checkpoint_id=step_dir, process_group=self._group)
        except Exception as exc:
            raise _save_failed(step_dir, exc) from None
        self._publish(step_dir, steps_done)

    def written_step(self) -> int:
        """The newest step this rank has written completely (a save in flight counts once
        its writes are done; -1: none)."""
        if self._pending is not None and self._pending[0].done():
            return self._pending[2]
        return self._published_step

    def publish_written(self, written_everywhere: int) -> None:
        """Publish the save in flight once every rank has written it (``StepControl``'s
        agreement says so): ``latest`` then moves at once, not at the next save.

        Raises:
            PeerFailureError: see :meth:`wait`.
        """
        if self._pending is not None and written_everywhere >= self._pending[2]:
            self.wait()

    def wait(self) -> None:
        """Finish an asynchronous save in flight and publish it (nothing when none is)."""
        if self._pending is None:
            return
        future, step_dir, steps_done = self._pending
        self._pending = None
        try:
            future.result()
        except Exception as exc:
            raise _save_failed(step_dir, exc) from None
        self._publish(step_dir, steps_done)

    def _publish(self, step_dir: Path, steps_done: int) -> None:
        """Point ``latest`` at ``step_dir`` (rank 0, after every rank's part is written)."""
        _barrier(self._group, self.state.rank, "checkpoint")
        self._published_step = steps_done
        if self.state.rank != 0:
            return
        pointer = self.directory / LATEST
        staged = self.directory / f"{LATEST}.tmp-{os.getpid()}"
        staged.write_text(step_dir.name + "\n", encoding="utf-8")
        os.replace(staged, pointer)
        _remove_old(self.directory, keep=step_dir)

    def _state_dict(self, steps_done: int) -> dict[str, Any]:
        state, plan = self.state, self.state.plan
        scale = 0.0 if state.scaler is None else float(state.scaler.get_scale())
        progress = Progress(
            steps_done, plan.global_batch_size, plan.training.seed, plan.digest(), scale
        )
        entries: dict[str, Any] = {
            "model": {name: p.detach() for name, p in state.params},
            "buffers": {name: b.detach() for name, b in state.stage.canonical_buffers()},
            "optimizer": _optimizer_state(state),
            "progress": progress.as_dict(),
            "rng": {str(state.rank): _rng_state(state.device)},
        }
        if state.shards is not None:  # the whole state of a set, from its lowest rank
            entries["optimizer"].update(state.shards.gathered_state())
        if state.outer is not None:
            state.outer.prepare_checkpoint()
            entries["model"].update(state.outer.global_params())
            island: dict[str, Any] = dict(state.outer.island_state())
            island["optimizer"] = _take(entries["optimizer"], state.outer.names)
            entries["outer"] = state.outer.shared_state()
            entries["island"] = {state.outer.island: island}
        return entries

    # ----------------------------------------------------------------- loading
    def load(self, step_dir: Path) -> int:
        """Load the checkpoint in ``step_dir`` into this rank; return its steps done
        (that state is then the saved one: it is not written again).

        The RNG states are restored only under the same plan (another plan's ranks draw
        from their seeded streams again; rank 0 says so). Under another plan with local
        groups every rank takes ``model.<name>`` (G) and the outer state starts again from
        it; under a plan without them the outer state is dropped. Either way the islands'
        inner optimizer state of those parameters starts afresh.

        Raises:
            PlanMismatchError: the checkpoint lacks a name this rank holds, or a shape
                differs (another model).
            ConfigError: it was written with another global batch size or seed.
        """
        import torch.distributed.checkpoint as dcp

        start_s = time.monotonic()
        state, plan = self.state, self.state.plan
        progress = self._load_progress(step_dir)
        _check_same_data(step_dir, progress, plan)
        steps_done = int(progress["step"])
        same_plan = progress["plan_digest"] == plan.digest()
        saved = _saved_keys(step_dir)
        had_outer = saved is not None and any(k.startswith("outer.global.") for k in saved)
        request = _load_request(state, same_plan, exact=same_plan and had_outer, step=steps_done)
        never_stepped = _without_saved_optimizer_state(request["optimizer"], saved, "optimizer")
        for island, entries in request.get("island", {}).items():
            never_stepped += _without_saved_optimizer_state(
                entries["optimizer"], saved, f"island.{island}.optimizer"
            )
        try:
            with torch.no_grad():
                dcp.load(request, checkpoint_id=step_dir, process_group=self._group)
        except Exception as exc:
            raise PlanMismatchError(
                f"checkpoint {str(step_dir)!r} does not fit this model ({error_reason(exc)}); "
                "was it written for another model? Use a fresh --checkpoint-dir"
            ) from None
        _set_loaded(state, request, steps_done, never_stepped)
        scale = float(progress.get("loss_scale", 0.0))
        if state.scaler is not None and scale > 0:
            state.scaler.update(new_scale=scale)
        self._saved_step = self._published_step = steps_done
        if state.rank == 0:
            if had_outer:
                _say_outer(plan, same_plan)
            _say_resumed(step_dir, steps_done, time.monotonic() - start_s, same_plan, state, scale)
        return steps_done

    def _load_progress(self, step_dir: Path) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        progress: dict[str, Any] = {"progress": Progress(0, 0, 0, "").as_dict()}
        try:
            dcp.load(
                progress,
                checkpoint_id=step_dir,
                process_group=self._group,
                planner=dcp.DefaultLoadPlanner(allow_partial_load=True),  # fields added later
            )
        except Exception as exc:
            raise ConfigError(
                f"{str(step_dir)!r} is not an hplan checkpoint ({error_reason(exc)}); use a "
                "fresh --checkpoint-dir"
            ) from None
        loaded: dict[str, Any] = progress["progress"]
        if loaded["global_batch_size"] == 0:  # nothing loaded: the keys are not there
            raise ConfigError(
                f"{str(step_dir)!r} is not an hplan checkpoint (it has no training progress); "
                "use a fresh --checkpoint-dir"
            )
        return loaded


def _check_same_data(step_dir: Path, progress: dict[str, Any], plan: Plan) -> None:
    """Raises ConfigError: the checkpoint was written with another global batch or seed."""
    if (
        progress["global_batch_size"] == plan.global_batch_size
        and progress["seed"] == plan.training.seed
    ):
        return
    raise ConfigError(
        f"checkpoint {str(step_dir)!r} was written with global batch "
        f"{progress['global_batch_size']} and seed {progress['seed']}; this plan has "
        f"{plan.global_batch_size} and {plan.training.seed}, so the data position "
        "cannot carry over: solve with the same -b and --seed, or use a fresh "
        "--checkpoint-dir"
    )


def _load_request(state: TrainState, same_plan: bool, *, exact: bool, step: int) -> dict[str, Any]:
    """The tensors to load a checkpoint into (DCP loads in place), by key (module
    docstring): with ``exact`` (the same plan, a checkpoint with outer state) a local
    group's parameters come from this island's entries, and the outer state too."""
    _initialise_optimizer(state.optimizer)
    request: dict[str, Any] = {
        "model": {name: p.detach() for name, p in state.params},
        "buffers": {name: b.detach() for name, b in state.stage.canonical_buffers()},
        "optimizer": _optimizer_state(state),
    }
    if state.shards is not None:
        request["optimizer"].update(state.shards.state_request())
    if same_plan:
        request["rng"] = {str(state.rank): _rng_state(state.device)}
    if exact and state.outer is not None:
        shared, own = state.outer.load_request(step)
        _take(request["model"], state.outer.names)
        island: dict[str, Any] = dict(own)
        island["optimizer"] = _take(request["optimizer"], state.outer.names)
        request["outer"] = shared
        request["island"] = {state.outer.island: island}
    return request


def _set_loaded(
    state: TrainState, request: dict[str, Any], steps_done: int, never_stepped: list[str]
) -> None:
    """Put what DCP loaded into ``request`` in place: optimizer states, the outer state,
    the random-number state."""
    if state.shards is not None:
        sharded = _take(request["optimizer"], state.shards.names)
        state.shards.load_state(sharded, never_stepped)
    _set_optimizer_state(state, request["optimizer"])
    for entries in request.get("island", {}).values():
        _set_optimizer_state(state, entries["optimizer"])
    if state.outer is not None and "outer" in request:
        state.outer.loaded(request["outer"], steps_done)
    elif state.outer is not None:
        state.outer.restart()
    by_name = dict(state.params)
    for name in never_stepped:  # as in the saved run: no state until the first step
        state.optimizer.state.pop(by_name[name], None)
    if isinstance(state.optimizer, OffloadedOptimizer):  # its host copies are stale now
        state.optimizer.parameters_changed()
    if "rng" in request:
        _set_rng_state(state.device, request["rng"][str(state.rank)])


def _say_resumed(
    step_dir: Path,
    steps_done: int,
    took_s: float,
    same_plan: bool,
    state: TrainState,
    scale: float,
) -> None:
    """Rank 0's line on a resume."""
    other = (
        ""
        if same_plan
        else " (written under another plan: parameters and optimizer state carried "
        "over by name; each rank's random-number stream starts again from the seed)"
    )
    scaled = f" (loss scale {scale:g})" if state.scaler is not None and scale > 0 else ""
    print(
        f"hplan: resumed at step {steps_done} from {step_dir} in {took_s:.2f} s{scaled}{other}",
        file=sys.stderr,
        flush=True,
    )


# --------------------------------------------------------------------------- optimizer
def _param_order(state: TrainState) -> dict[int, str]:
    return {id(p): name for name, p in state.params}


def _optimizer_state(state: TrainState) -> dict[str, dict[str, Any]]:
    """{canonical name: the optimizer's state of that parameter} (references, no copies)."""
    names = _param_order(state)
    return {
        names[id(param)]: dict(values)
        for param, values in state.optimizer.state.items()
        if id(param) in names
    }


def _saved_keys(step_dir: Path) -> set[str] | None:
    """The flattened keys of a checkpoint (None: its metadata is unreadable; the load
    itself reports that)."""
    import torch.distributed.checkpoint as dcp

    try:
        return set(dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata)
    except Exception:
        return None


def _take(entries: dict[str, Any], names: frozenset[str]) -> dict[str, Any]:
    """Remove the entries of ``names`` from ``entries``; return them."""
    return {name: entries.pop(name) for name in sorted(names) if name in entries}


def _without_saved_optimizer_state(
    requested: dict[str, dict[str, Any]], saved: set[str] | None, prefix: str
) -> list[str]:
    """Drop from ``requested`` the parameters whose optimizer state the checkpoint lacks
    entirely under ``prefix`` (saved before their first optimizer step, e.g. every step so
    far skipped by fp16 loss scaling, or an island's under another plan); return their
    names. A parameter with part of its state is kept, so that loading it fails as another
    model's would."""
    if saved is None:
        return []
    missing = [
        name for name in requested if not any(key.startswith(f"{prefix}.{name}.") for key in saved)
    ]
    for name in missing:
        del requested[name]
    return missing


def _say_outer(plan: Plan, same_plan: bool) -> None:
    """Rank 0's line on a checkpoint's outer-sync state that this plan does not carry on."""
    sync = plan.training.sync
    if sync is None or not sync.local:
        print(
            "hplan: the checkpoint's outer-sync state (local_sgd/async: the outer optimizer, "
            "each island's progress since its last outer sync) is dropped: this plan has no "
            "local_sgd or async group; training goes on from the global parameters",
            file=sys.stderr,
            flush=True,
        )
    elif not same_plan:
        print(
            "hplan: the checkpoint's outer-sync state was written under another plan: the "
            "outer optimizer and the islands start again from its global parameters",
            file=sys.stderr,
            flush=True,
        )


def _set_optimizer_state(state: TrainState, loaded: dict[str, dict[str, Any]]) -> None:
    by_name = dict(state.params)
    for name, values in loaded.items():
        state.optimizer.state[by_name[name]].update(values)


def _initialise_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its optimizer state (optimizers create it at their first step),
    so that a checkpoint can be loaded into it: one step with zero gradients and learning
    rate 0, which changes no parameter (the way ``torch.distributed.checkpoint.state_dict``
    initialises an optimizer before loading)."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for param in params:
        param.grad = torch.zeros_like(param)
    rates = [group.get("lr") for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        if rate is not None:
            group["lr"] = rate
    optimizer.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------- helpers
def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(device: torch.device, state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _new_gloo_group(timeout_s: float) -> dist.ProcessGroup:
    """The checkpoint's own group (gloo: a CPU backend, which ``async_save`` needs; its own
    so that a background save never shares a group with the training's collectives)."""
    try:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise PeerFailureError(
            f"creating the checkpoint group failed: {error_reason(exc)}; check the other ranks' logs"
        ) from None
    assert group is not None
    return group


def _barrier(group: dist.ProcessGroup, rank: int, what: str) -> None:
    try:
        dist.barrier(group=group)
    except RuntimeError as exc:
        raise PeerFailureError(
            f"rank {rank}: a peer failed during the {what}: {error_reason(exc)}; check the "
            "other ranks' logs (one probably failed first)"
        ) from None


def _prepare(step_dir: Path, plan: Plan) -> None:
    """An empty ``step_dir`` holding the plan the checkpoint is written under."""
    try:
        if step_dir.exists():  # left by a save that did not finish, or another run
            _remove(step_dir)
        step_dir.mkdir(parents=True)
        (step_dir / "plan.json").write_text(plan.to_json(), encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"cannot write checkpoint {str(step_dir)!r} ({exc.strerror}); choose a writable "
            "--checkpoint-dir"
        ) from None


def _save_failed(step_dir: Path, exc: BaseException) -> PeerFailureError:
    return PeerFailureError(
        f"saving checkpoint {str(step_dir)!r} failed: {error_reason(exc)}; the previous "
        "checkpoint stays the latest"
    )


def _remove_old(directory: Path, *, keep: Path) -> None:
    """Remove every ``step-*`` folder but the newest complete ones (``KEEP_CHECKPOINTS``)
    and ``keep``; unfinished ones older than ``keep`` go too."""
    steps = []
    for path in directory.glob("step-*"):
        suffix = path.name.removeprefix("step-")
        if path.is_dir() and suffix.isdigit():
            steps.append((int(suffix), path))
    complete = [p for _, p in sorted(steps) if (p / _METADATA).is_file()]
    kept = set(complete[-KEEP_CHECKPOINTS:]) | {keep}
    newest = int(keep.name.removeprefix("step-"))
    for step, path in steps:
        if path not in kept and step <= newest:
            _remove(path)


def _remove(step_dir: Path) -> None:
    """Remove a checkpoint, its ``.metadata`` first: one half removed is never complete."""
    (step_dir / _METADATA).unlink(missing_ok=True)
    shutil.rmtree(step_dir, ignore_errors=True)
