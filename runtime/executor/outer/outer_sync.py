"""Cross-island syncs of ``local_sgd`` and ``async`` groups (DiLoCo; Douillard et al., 2023),
on one rank.

A holder set that spans islands and syncs by ``local_sgd`` or ``async`` (a *local group*,
``SyncMode``) leaves each island to train on its own samples between outer syncs
(``grad_sync.py`` weights and sums per island). Each rank keeps a host float32 copy G of the
global values of its local groups' parameters and an outer Nesterov SGD over G (``OUTER_LR``,
``OUTER_MOMENTUM``: ``capture/model_file.py``). At a fragment's sync point the islands'
pseudo-gradients start on their way, to be averaged, weighted by their samples (one SUM
all-reduce in a float wire format, an all-gather of quantized payloads with error feedback
in ``int8``/``int4``: ``outer_exchange.py``); ``OuterSyncSpec.delay_steps`` steps later the
outer step updates G with the average, and every island continues from G plus what it did
meanwhile. One rule covers blocking DiLoCo (delay 0), overlapped Streaming DiLoCo (1 .. H - 1)
and ``async`` (H): ``outer_fragment.py`` applies it to each fragment. The outer collectives
run after the optimizer step, on groups of their own, in one order every rank shares
(:class:`OuterSync`); a failed or timed-out one raises ``PeerFailureError`` naming the
islands, never a hang.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hplan.runtime.capture.model_file import ModelFile
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.holders import (
    RankSet,
    island_of_rank,
    island_samples,
    outer_exchange_groups,
    outer_fragments,
    outer_groups,
    outer_island_holders,
    parameter_holders,
    parameter_order,
    sync_summary,
)
from hplan.runtime.contract.link_model import sync_order
from hplan.runtime.contract.plan import (
    DTYPE_BYTES,
    OuterSyncSpec,
    Plan,
    PseudoGradientDtype,
    SyncMode,
    wire_payload_bytes,
)
from hplan.runtime.executor.grad_sync import new_group
from hplan.runtime.executor.outer.outer_exchange import (
    PendingExchange,
    QuantizedExchange,
    broadcast_floor_bytes,
    gather_floor_bytes,
)
from hplan.runtime.executor.outer.outer_fragment import (
    OuterFragment,
    arrive,
    close_fragment,
    host_copy,
    named_views,
    step_fragment,
)
from hplan.runtime.executor.seams import LinkDelay

State = dict[str, dict[str, Tensor]]
"""Checkpoint entries by kind, then canonical name (``{"global": {name: G}}``)."""


class OuterSync:
    """This rank's fragments of its local groups. Per step, after the optimizer step:
    :meth:`after_step`.

    A group's parameters (model order, ``holders.parameter_order``) are cut into fragments
    (``holders.outer_fragments``), each launched after the steps ``holders.syncs_after``
    gives and applied ``OuterSyncSpec.delay_steps`` later (``holders.applied_after``).
    Every rank visits its groups in ``link_model.sync_order`` and each group's fragments in
    order, once every gradient bucket of the step has been waited for; per fragment the
    apply (a wait, and a quantized group's broadcast inside the island) comes before the
    launch. Launches, waits and broadcasts are functions of the step alone, so the
    collectives of all ranks stay a subsequence of one global order, as
    ``grad_sync.GradSync`` argues for the buckets. In a rehearsal a link delay's floor
    (``seams.LinkDelay.all_reduce_floor_s``) applies to every outer collective, counted from
    when its last member launched it (``outer_exchange.hold_floor``). Checkpoints hold G,
    A, the outer momentum, a pending average and the residuals of a quantized wire, with
    each island's own parameters and inner optimizer state (:meth:`shared_state`,
    :meth:`island_state`), so that a resume under the same plan continues exactly.

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
        """Apply the averages due after ``step`` and launch the syncs due (and, when
        ``last``, close every fragment, ``outer_fragment.close_fragment``, after keeping the
        state a resume needs); return the seconds it took (0 when nothing was due).

        Raises:
            PeerFailureError: an outer collective failed or timed out.
        """
        self.spans = []
        for frag in self.fragments:
            applies, due = frag.applies(step), frag.due(step)
            if applies or due:
                with self._span(frag, "outer sync"):
                    step_fragment(frag, applies=applies, due=due)
        if last:
            if self.keep_resume_state:
                begin_s = time.monotonic()
                self._arrive_all()
                self._resume = (self.shared_state(), self.island_state())
                self.spans.append(("outer sync state kept", begin_s, time.monotonic()))
            for frag in self.fragments:
                with self._span(frag, "closing sync"):
                    close_fragment(frag, progress=not frag.due(step))
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
                arrive(frag, frag.pending)

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
        optimizer's), ``pending`` (an average waited for, not yet applied), by name
        (copies)."""
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
                assert frag.pending.average is not None, "prepare_checkpoint() first"
                pending = named_views(frag, frag.pending.average)
                state["pending"].update((n, t.clone()) for n, t in pending.items())
        return state

    def island_state(self) -> State:
        """What this island's holders keep alike: ``model`` (L), ``start`` (A) and
        ``residual`` (a quantized wire's), copies."""
        if self._resume is not None:
            return self._resume[1]
        state: State = {"model": {}, "start": {}, "residual": {}}
        for frag in self.fragments:
            for name, param in zip(frag.names, frag.params, strict=True):
                state["model"][name] = param.detach().clone()
            if frag.delay_steps:  # blocking local SGD keeps no A
                state["start"].update(zip(frag.names, (s.clone() for s in frag.start), strict=True))
            if frag.quantized is not None:
                residual = named_views(frag, frag.quantized.residual)
                state["residual"].update((n, t.clone()) for n, t in residual.items())
        return state

    def load_request(self, steps_done: int) -> tuple[State, State]:
        """Tensors to load a checkpoint of ``steps_done`` steps into, as
        (:meth:`shared_state`, :meth:`island_state`) keys; then :meth:`loaded`."""
        shared: State = {"global": {}, "momentum": {}, "pending": {}}
        island: State = {"model": {}, "start": {}, "residual": {}}
        for frag in self.fragments:
            for name, g, param in zip(frag.names, frag.global_, frag.params, strict=True):
                shared["global"][name] = g
                island["model"][name] = param.detach()
                buffer = frag.optimizer.state.get(g, {}).get("momentum_buffer")
                if buffer is not None:
                    shared["momentum"][name] = buffer
            if frag.delay_steps:
                island["start"].update(zip(frag.names, frag.start, strict=True))
            if frag.quantized is not None:
                island["residual"].update(named_views(frag, frag.quantized.residual))
            if frag.pending_at(steps_done):
                zeros = (torch.zeros_like(g) for g in frag.global_)
                shared["pending"].update(zip(frag.names, zeros, strict=True))
        return shared, island

    def loaded(self, shared: State, steps_done: int) -> None:
        """After :meth:`load_request`'s tensors were loaded: the pending averages."""
        for frag in self.fragments:
            if frag.pending_at(steps_done):
                flat = torch.cat([shared["pending"][n].reshape(-1) for n in frag.names])
                frag.pending = PendingExchange(time.monotonic(), None, [], average=flat)

    def restart(self) -> None:
        """Start the outer state again from the parameters (G = A = L, no momentum, no
        residual, nothing pending): a checkpoint of another plan, or of none with local
        groups."""
        for frag in self.fragments:
            with torch.no_grad():
                for g, param in zip(frag.global_, frag.params, strict=True):
                    g.copy_(host_copy(param))
                    buffer = frag.optimizer.state.get(g, {}).get("momentum_buffer")
                    if buffer is not None:
                        buffer.zero_()
                if frag.delay_steps:  # blocking local SGD keeps no A
                    for s, g in zip(frag.start, frag.global_, strict=True):
                        s.copy_(g)
                if frag.quantized is not None:
                    frag.quantized.residual.zero_()
            frag.pending = None


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
    """Create the process groups of every local group (on every rank, in
    ``link_model.sync_order``: ``new_group`` is collective): the holder set's, and for a
    quantized wire its islands' leads' and each island's holders'
    (``holders.outer_exchange_groups``);
    then this rank's fragments.

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
    groups: dict[RankSet, dist.ProcessGroup | None] = {}
    for spec in local:
        groups[spec.ranks] = new_group(spec.ranks, timeout_s, "outer-sync")
        if spec.wire_dtype.quantized:
            for ranks in outer_exchange_groups(plan, spec):
                if ranks not in groups:
                    groups[ranks] = new_group(ranks, timeout_s, "outer-sync")
    trainable = {n: p for n, p in named_params if p.requires_grad}
    fragments = [
        frag
        for spec in local
        if rank in spec.ranks
        for frag in _fragments(plan, rank, spec, groups, trainable, model_file, delay)
    ]
    return OuterSync(fragments, keep_resume_state=keep_resume_state) if fragments else None


def _fragments(
    plan: Plan,
    rank: int,
    spec: OuterSyncSpec,
    groups: Mapping[RankSet, dist.ProcessGroup | None],
    trainable: Mapping[str, nn.Parameter],
    model_file: ModelFile,
    delay: LinkDelay,
) -> list[OuterFragment]:
    """``rank``'s fragments of the local group ``spec`` (holders compute the same cut)."""
    group = groups[spec.ranks]
    assert group is not None
    held = parameter_holders(plan, plan.ranks[rank].tp_rank)
    names = [n for n in parameter_order(plan) if held[n] == spec.ranks and n in trainable]
    wire = spec.wire_dtype
    wire_bytes = {n: wire_payload_bytes(wire, trainable[n].numel()) for n in names}
    where = island_of_rank(plan)
    own = where[rank]
    island_weight = island_samples(plan)[own] / plan.global_batch_size
    by_island = outer_island_holders(plan, spec)
    lowest = by_island[own][0]
    weight = island_weight if lowest == rank else 0.0
    islands = tuple(by_island)
    fragments = []
    for idx, frag_names in enumerate(outer_fragments(spec, names, wire_bytes)):
        params = [trainable[n] for n in frag_names]
        global_ = [host_copy(p) for p in params]
        floor_s = delay.all_reduce_floor_s(spec.ranks, sum(wire_bytes[n] for n in frag_names))
        quantized = None
        if wire.quantized:
            num_elements = sum(g.numel() for g in global_)
            quantized = _quantized(spec, rank, by_island, own, groups, delay, island_weight,
                                   num_elements)  # fmt: skip
        fragments.append(
            OuterFragment(
                spec, idx, group, frag_names, params, weight, islands, own, floor_s, global_,
                _outer_optimizer(global_, model_file),
                start=[g.clone() for g in global_] if spec.delay_steps else [],
                quantized=quantized,
            )
        )  # fmt: skip
    return fragments


def _quantized(
    spec: OuterSyncSpec,
    rank: int,
    by_island: Mapping[str, RankSet],
    own: str,
    groups: Mapping[RankSet, dist.ProcessGroup | None],
    delay: LinkDelay,
    weight: float,
    num_elements: int,
) -> QuantizedExchange:
    """``rank``'s exchange of one quantized fragment of ``num_elements`` elements: its
    floors count the real bytes, the payloads all-gathered by the leads
    (``outer_exchange.gather_floor_bytes``) and the float32 sum broadcast in the island."""
    island = by_island[own]
    leads = tuple(ranks[0] for ranks in by_island.values())
    num_islands = len(leads)
    payload = wire_payload_bytes(spec.wire_dtype, num_elements)
    sum_bytes = num_elements * DTYPE_BYTES[PseudoGradientDtype.FLOAT32.value]
    is_lead = rank == island[0]
    return QuantizedExchange(
        wire=spec.wire_dtype,
        weight=weight,
        lead_rank=island[0],
        leads=groups[leads] if is_lead else None,
        num_leads=num_islands,
        island_group=groups[island] if len(island) > 1 else None,
        gather_floor_s=delay.all_reduce_floor_s(leads, gather_floor_bytes(num_islands, payload)),
        broadcast_floor_s=delay.all_reduce_floor_s(
            island, broadcast_floor_bytes(len(island), sum_bytes)
        ),
        residual=torch.zeros(num_elements, dtype=torch.float32),
    )


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
