"""Cross-island syncs of ``local_sgd`` and ``async`` groups (DiLoCo; Douillard et al., 2023),
on one rank.

A holder set that spans islands and syncs by ``local_sgd`` or ``async`` (a *local group*,
``SyncMode``) leaves each island to train on its own samples between outer syncs
(``grad_sync.py`` weights and sums per island). Each rank keeps a host float32 copy G of the
global values of its local groups' parameters and an outer Nesterov SGD over G (``OUTER_LR``,
``OUTER_MOMENTUM``: ``capture/model_file.py``). At a fragment's sync point the islands'
pseudo-gradients are averaged, weighted by their samples, in one SUM all-reduce, and the
outer step updates G, which every island continues from; ``async`` applies each average one
round late, while the next round computes (:func:`_point` states both rules). The outer
collectives run after the optimizer step, on groups of their own, in one order every rank
shares (:class:`OuterSync`); a failed or timed-out one raises ``PeerFailureError`` naming the
islands, never a hang.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hplan.runtime.capture.model_file import ModelFile
from hplan.runtime.contract.errors import ConfigError, PeerFailureError, error_reason
from hplan.runtime.contract.holders import (
    first_sync_step,
    island_of_rank,
    island_samples,
    outer_fragments,
    outer_groups,
    parameter_holders,
    parameter_order,
    sync_summary,
    syncs_after,
)
from hplan.runtime.contract.link_model import sync_order
from hplan.runtime.contract.plan import DTYPE_BYTES, OuterSyncSpec, Plan, SyncMode
from hplan.runtime.executor.grad_sync import new_group
from hplan.runtime.executor.seams import LinkDelay

State = dict[str, dict[str, Tensor]]
"""Checkpoint entries by kind, then canonical name (``{"global": {name: G}}``)."""


@dataclass
class _Pending:
    """An outer all-reduce launched and not yet applied."""

    flat: Tensor
    """The wire buffer; the weighted average once :attr:`work` is done."""
    launched_s: float
    work: dist.Work | None
    """None once waited for (or loaded from a checkpoint)."""


@dataclass
class OuterFragment:
    """One fragment of one local group, as one of its holders keeps it."""

    spec: OuterSyncSpec
    index: int
    group: dist.ProcessGroup
    names: tuple[str, ...]
    params: list[nn.Parameter]
    weight: float
    """``n_i / N`` on the lowest holder inside its island, else 0 (a zero contribution)."""
    islands: tuple[str, ...]
    """The group's islands, in the order of their ranks; ``own_island`` is this rank's."""
    own_island: str
    floor_s: float
    """Least seconds of its all-reduce (``seams.LinkDelay``; 0: the real one alone)."""
    global_: list[Tensor]
    """G: the global values, host float32."""
    optimizer: torch.optim.SGD
    start: list[Tensor] = field(default_factory=list)
    """S (``async``): the local values right after the last merge, host float32."""
    pending: _Pending | None = None

    @property
    def is_async(self) -> bool:
        return self.spec.mode is SyncMode.ASYNC

    def due(self, step: int) -> bool:
        return syncs_after(self.spec, self.index, step)

    def pending_at(self, steps_done: int) -> bool:
        """Whether an ``async`` average is pending after ``steps_done`` steps (some point
        came before them; a checkpoint is taken before the closing sync)."""
        return self.is_async and steps_done > first_sync_step(self.spec, self.index)


class OuterSync:
    """This rank's fragments of its local groups. Per step, after the optimizer step:
    :meth:`after_step`.

    A group's parameters (model order, ``holders.parameter_order``) are cut into fragments
    (``holders.outer_fragments``), each synced after the steps ``holders.syncs_after``
    gives. Every rank visits its groups in ``link_model.sync_order`` and each group's
    fragments in order, once every gradient bucket of the step has been waited for; an
    ``async`` all-reduce in flight is waited for at its next point, in that same order. So
    the collectives of all ranks stay a subsequence of one global order, as
    ``grad_sync.GradSync`` argues for the buckets. In a rehearsal a link delay's floor
    (``seams.LinkDelay.all_reduce_floor_s``) applies to every outer all-reduce, counted from
    when the last holder launched it. Checkpoints hold G, S, the outer momentum and a
    pending average, with each island's own parameters and inner optimizer state
    (:meth:`shared_state`, :meth:`island_state`), so that a resume under the same plan
    continues exactly.

    Args:
        keep_resume_state: at the last step, keep the state a resume needs before the
            closing sync (a run that checkpoints).
    """

    def __init__(self, fragments: Sequence[OuterFragment], *, keep_resume_state: bool) -> None:
        self.fragments = list(fragments)
        self.keep_resume_state = keep_resume_state
        self.island = self.fragments[0].own_island
        self.names = frozenset(n for f in self.fragments for n in f.names)
        self.spans: list[tuple[str, float, float]] = []
        """This step's outer syncs: (label, start_s, end_s)."""
        self._resume: tuple[State, State] | None = None

    def after_step(self, step: int, *, last: bool) -> float:
        """Sync the fragments due after ``step`` (and, when ``last``, close every fragment,
        :func:`_close`, after keeping the state a resume needs); return the seconds it took
        (0 when nothing was due).

        Raises:
            PeerFailureError: an outer all-reduce failed or timed out.
        """
        self.spans = []
        for frag in self.fragments:
            if frag.due(step):
                with self._span(frag, "outer sync"):
                    _point(frag)
        if last:
            if self.keep_resume_state:
                begin_s = time.monotonic()
                self._arrive_all()
                self._resume = (self.shared_state(), self.island_state())
                self.spans.append(("outer sync state kept", begin_s, time.monotonic()))
            for frag in self.fragments:
                with self._span(frag, "closing sync"):
                    _close(frag, progress=not frag.due(step))
        return sum(end_s - begin_s for _, begin_s, end_s in self.spans)

    @contextlib.contextmanager
    def _span(self, frag: OuterFragment, what: str) -> Iterator[None]:
        begin_s = time.monotonic()
        yield
        label = f"{what} ranks {','.join(str(r) for r in frag.spec.ranks)} f{frag.index}"
        self.spans.append((label, begin_s, time.monotonic()))

    def _arrive_all(self) -> None:
        for frag in self.fragments:
            if frag.pending is not None:
                _arrive(frag, frag.pending)

    # ----------------------------------------------------------------- checkpoints
    def prepare_checkpoint(self) -> None:
        """Wait for every pending average (it is saved; it is still applied at its point)."""
        self._arrive_all()

    def global_params(self) -> dict[str, Tensor]:
        """G in each parameter's dtype: what ``model.<name>`` saves (every island alike)."""
        return {
            n: g.to(p.dtype)
            for f in self.fragments
            for n, p, g in zip(f.names, f.params, f.global_, strict=True)
        }

    def shared_state(self) -> State:
        """What every holder keeps alike: ``global`` (G), ``momentum`` (the outer
        optimizer's), ``pending`` (an ``async`` average waited for), by name (copies)."""
        if self._resume is not None:
            return self._resume[0]
        state: State = {"global": {}, "momentum": {}, "pending": {}}
        for frag in self.fragments:
            for name, g in zip(frag.names, frag.global_, strict=True):
                state["global"][name] = g.clone()
                buffer = frag.optimizer.state.get(g, {}).get("momentum_buffer")
                if buffer is not None:
                    state["momentum"][name] = buffer.clone()
            if frag.pending is not None:
                assert frag.pending.work is None, "prepare_checkpoint() first"
                pending = _named(frag, frag.pending.flat)
                state["pending"].update((n, t.clone()) for n, t in pending.items())
        return state

    def island_state(self) -> State:
        """What this island's holders keep alike: ``model`` (L) and ``start`` (S), copies."""
        if self._resume is not None:
            return self._resume[1]
        state: State = {"model": {}, "start": {}}
        for frag in self.fragments:
            for name, param in zip(frag.names, frag.params, strict=True):
                state["model"][name] = param.detach().clone()
            if frag.is_async:
                state["start"].update(zip(frag.names, (s.clone() for s in frag.start), strict=True))
        return state

    def load_request(self, steps_done: int) -> tuple[State, State]:
        """Tensors to load a checkpoint of ``steps_done`` steps into, as
        (:meth:`shared_state`, :meth:`island_state`) keys; then :meth:`loaded`."""
        shared: State = {"global": {}, "momentum": {}, "pending": {}}
        island: State = {"model": {}, "start": {}}
        for frag in self.fragments:
            for name, g, param in zip(frag.names, frag.global_, frag.params, strict=True):
                shared["global"][name] = g
                island["model"][name] = param.detach()
                buffer = frag.optimizer.state.get(g, {}).get("momentum_buffer")
                if buffer is not None:
                    shared["momentum"][name] = buffer
            if frag.is_async:
                island["start"].update(zip(frag.names, frag.start, strict=True))
            if frag.pending_at(steps_done):
                zeros = (torch.zeros_like(g) for g in frag.global_)
                shared["pending"].update(zip(frag.names, zeros, strict=True))
        return shared, island

    def loaded(self, shared: State, steps_done: int) -> None:
        """After :meth:`load_request`'s tensors were loaded: the pending averages."""
        for frag in self.fragments:
            if frag.pending_at(steps_done):
                flat = torch.cat([shared["pending"][n].reshape(-1) for n in frag.names])
                frag.pending = _Pending(flat, time.monotonic(), None)

    def restart(self) -> None:
        """Start the outer state again from the parameters (G = S = L, no momentum, nothing
        pending): a checkpoint of another plan, or of none with local groups."""
        for frag in self.fragments:
            with torch.no_grad():
                for g, param in zip(frag.global_, frag.params, strict=True):
                    g.copy_(_host(param))
                    buffer = frag.optimizer.state.get(g, {}).get("momentum_buffer")
                    if buffer is not None:
                        buffer.zero_()
                if frag.is_async:  # local SGD keeps no start point
                    for s, g in zip(frag.start, frag.global_, strict=True):
                        s.copy_(g)
            frag.pending = None


# --------------------------------------------------------------------------- one fragment
def _host(param: nn.Parameter) -> Tensor:
    return param.detach().to("cpu", torch.float32, copy=True)


def _named(frag: OuterFragment, flat: Tensor) -> dict[str, Tensor]:
    """A flat float32 buffer of the fragment as host tensors by name (views)."""
    out, offset = {}, 0
    for name, g in zip(frag.names, frag.global_, strict=True):
        out[name] = flat[offset : offset + g.numel()].view_as(g)
        offset += g.numel()
    return out


def _launch(frag: OuterFragment, deltas: Sequence[Tensor]) -> _Pending:
    """Start the weighted SUM of this island's pseudo-gradients over the holder set."""
    wire = getattr(torch, frag.spec.wire_dtype.value)
    device = frag.params[0].device
    flat = torch.cat([d.reshape(-1) for d in deltas])
    flat = (flat * frag.weight if frag.weight else torch.zeros_like(flat)).to(device, wire)
    launched_s = time.monotonic()
    try:
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=frag.group, async_op=True)
    except RuntimeError as exc:
        raise _failure(frag, exc) from None
    assert work is not None
    return _Pending(flat, launched_s, work)


def _arrive(frag: OuterFragment, pending: _Pending) -> None:
    """Wait for ``pending`` (and its emulated floor); its buffer is then the float32 host
    average."""
    if pending.work is None:
        return
    try:
        pending.work.wait()
        if frag.floor_s > 0:
            device = pending.flat.device
            ready = torch.tensor([pending.launched_s], dtype=torch.float64, device=device)
            dist.all_reduce(ready, op=dist.ReduceOp.MAX, group=frag.group)
            time.sleep(max(0.0, float(ready.item()) + frag.floor_s - time.monotonic()))
    except RuntimeError as exc:
        raise _failure(frag, exc) from None
    pending.flat = pending.flat.to("cpu", torch.float32)
    pending.work = None


def _apply(frag: OuterFragment, pending: _Pending) -> None:
    """G ← outer(G, average of ``pending``)."""
    _arrive(frag, pending)
    for g, average in zip(frag.global_, _named(frag, pending.flat).values(), strict=True):
        g.grad = average
    frag.optimizer.step()
    frag.optimizer.zero_grad(set_to_none=True)


def _set_local(frag: OuterFragment, values: Sequence[Tensor]) -> None:
    with torch.no_grad():
        for param, value in zip(frag.params, values, strict=True):
            param.copy_(value.to(param.device, param.dtype))


def _point(frag: OuterFragment) -> None:
    """One sync point of ``frag``.

    ``local_sgd``: island i's pseudo-gradient is ``Δ_i = G - L_i`` (L: the island's
    parameters); their average weighted by samples, ``Σ_i (n_i / N) Δ_i`` (n_i:
    ``island_samples``, N: the global batch), is one SUM all-reduce over the holder set: the
    lowest holder inside each island contributes ``(n_i / N) Δ_i``, the island's other
    holders zeros (a tied weight held twice in an island counts once), in the group's
    ``wire_dtype`` (the sum comes back to float32). Then ``G.grad = average``, an outer
    step, and L ← G. The inner optimizer's state stays each island's own.

    ``async``, at point k: if the average launched at point k - 1 is pending, G ← outer(G,
    avg_{k-1}); ``Δ_k = S - L`` (S: the local values right after the previous merge;
    initially S = G = L) is launched without waiting; L ← G - Δ_k (the island keeps its own
    in-flight change on top of the new globals); S ← L. This is ``local_sgd`` with each
    average applied one round late (staleness one round).
    """
    if not frag.is_async:
        deltas = [g - _host(p) for g, p in zip(frag.global_, frag.params, strict=True)]
        _apply(frag, _launch(frag, deltas))
        _set_local(frag, frag.global_)
        return
    previous, frag.pending = frag.pending, None
    if previous is not None:
        _apply(frag, previous)
    deltas = [s - _host(p) for s, p in zip(frag.start, frag.params, strict=True)]
    frag.pending = _launch(frag, deltas)
    if previous is not None:
        _set_local(frag, [g - d for g, d in zip(frag.global_, deltas, strict=True)])
    frag.start = [_host(p) for p in frag.params]


def _close(frag: OuterFragment, progress: bool) -> None:
    """The end of a run: apply what is pending, sync what is left (``progress``: the
    fragment changed since its last sync point) blocking, and L ← G, so that the run ends
    with every island holding the same parameters."""
    if frag.pending is not None:
        pending, frag.pending = frag.pending, None
        _apply(frag, pending)
    if progress:
        base = frag.start if frag.is_async else frag.global_
        deltas = [b - _host(p) for b, p in zip(base, frag.params, strict=True)]
        _apply(frag, _launch(frag, deltas))
    _set_local(frag, frag.global_)
    frag.start = [g.clone() for g in frag.global_] if frag.is_async else []


def _failure(frag: OuterFragment, exc: RuntimeError) -> PeerFailureError:
    others = [i for i in frag.islands if i != frag.own_island]
    who = f"island {others[0]}" if len(others) == 1 else f"islands {', '.join(others)}"
    whose = "its" if len(others) == 1 else "their"
    return PeerFailureError(
        f"outer sync ({frag.spec.mode.value}) of ranks {list(frag.spec.ranks)} across islands "
        f"{', '.join(frag.islands)} failed: {error_reason(exc)}; {who} probably fell behind "
        f"or failed; check {whose} logs"
    )


# --------------------------------------------------------------------------- building
def build_outer_sync(
    plan: Plan,
    rank: int,
    named_params: Sequence[tuple[str, nn.Parameter]],
    model_file: ModelFile,
    *,
    delay: LinkDelay,
    keep_resume_state: bool,
) -> OuterSync | None:
    """Create the process group of every local group (on every rank, in
    ``link_model.sync_order``: ``new_group`` is collective) and this rank's fragments.

    Must be called by every rank of the world, in the same program order, after
    ``grad_sync.build_buckets`` (which checks the stage's parameters against the plan).

    Args:
        named_params: this rank's stage parameters by canonical name.
        delay: the run's link delay (its all-reduce floors apply to outer syncs).
        keep_resume_state: see :class:`OuterSync`.

    Returns:
        None when the plan has no local group or this rank holds none of its trainable
        parameters.

    Raises:
        PeerFailureError: creating a group failed.
    """
    local = sorted(
        (g for g in outer_groups(plan).values() if g.mode is not SyncMode.ALL_REDUCE),
        key=lambda g: sync_order(g.ranks),
    )
    timeout_s = plan.training.process_group_timeout_s
    groups = {g.ranks: new_group(g.ranks, timeout_s, "outer-sync") for g in local}
    trainable = {n: p for n, p in named_params if p.requires_grad}
    fragments = [
        frag
        for spec in local
        if rank in spec.ranks
        for frag in _fragments(plan, rank, spec, groups[spec.ranks], trainable, model_file, delay)
    ]
    return OuterSync(fragments, keep_resume_state=keep_resume_state) if fragments else None


def _fragments(
    plan: Plan,
    rank: int,
    spec: OuterSyncSpec,
    group: dist.ProcessGroup | None,
    trainable: Mapping[str, nn.Parameter],
    model_file: ModelFile,
    delay: LinkDelay,
) -> list[OuterFragment]:
    """``rank``'s fragments of the local group ``spec`` (holders compute the same cut)."""
    assert group is not None
    held = parameter_holders(plan, plan.ranks[rank].tp_rank)
    names = [n for n in parameter_order(plan) if held[n] == spec.ranks and n in trainable]
    wire_bytes = {n: trainable[n].numel() * DTYPE_BYTES[spec.wire_dtype.value] for n in names}
    where = island_of_rank(plan)
    own = where[rank]
    lowest = min(r for r in spec.ranks if where[r] == own)
    weight = island_samples(plan)[own] / plan.global_batch_size if lowest == rank else 0.0
    islands = tuple(dict.fromkeys(where[r] for r in spec.ranks))
    fragments = []
    for idx, frag_names in enumerate(outer_fragments(spec, names, wire_bytes)):
        params = [trainable[n] for n in frag_names]
        global_ = [_host(p) for p in params]
        floor_s = delay.all_reduce_floor_s(spec.ranks, sum(wire_bytes[n] for n in frag_names))
        fragments.append(
            OuterFragment(
                spec, idx, group, frag_names, params, weight, islands, own, floor_s, global_,
                _outer_optimizer(global_, model_file),
                start=[g.clone() for g in global_] if spec.mode is SyncMode.ASYNC else [],
            )
        )  # fmt: skip
    return fragments


def _outer_optimizer(global_: list[Tensor], model_file: ModelFile) -> torch.optim.SGD:
    """Nesterov SGD over G (``OUTER_LR``, ``OUTER_MOMENTUM``). With momentum, each buffer
    starts as zeros: torch's first step sets it to the gradient, and ``0 * momentum +
    gradient`` is that gradient bit for bit, so the state exists from the start (for
    checkpoints)."""
    momentum = model_file.outer_momentum
    optimizer = torch.optim.SGD(
        global_, lr=model_file.outer_lr, momentum=momentum, nesterov=momentum > 0
    )
    if momentum > 0:
        for g in global_:
            optimizer.state[g]["momentum_buffer"] = torch.zeros_like(g)
    return optimizer


def check_verify(plan: Plan) -> None:
    """Refuse ``--verify`` for a plan with a local group: it compares one synchronous step
    of the whole global batch with one process, and an island's step is another computation.

    Raises:
        ConfigError: naming the plan's sync and the fix.
    """
    sync = plan.training.sync
    if sync is not None and sync.local:
        raise ConfigError(
            f"--verify compares one synchronous step of the global batch with one process, "
            f"but this plan syncs by {sync_summary(plan)} (each island steps on its own "
            "samples); verify a plan that all-reduces every step"
        )
