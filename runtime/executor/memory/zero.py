"""ZeRO stages 1 and 2: each holder set's optimizer state (and under stage 2 its summed
gradients) split among its ranks, in uneven shards (Rajbhandari et al., "ZeRO", SC 2020).

A holder set's trainable parameters, in model order and laid end to end, form one flat
vector; rank r keeps the optimizer state of the elements ``bounds[r]`` of
``holders.optimizer_shards`` (sizes follow each rank's ``optimizer_shard_weight``). The
parameters become views of one flat buffer per param group and dtype (:class:`ShardLeaf`),
and the rank's slice of it is a leaf that the model file's own optimizer steps
(:func:`shard_optimizer`, :class:`ShardedOptimizer`); :class:`ShardSync` then sends each
member's updated slice to the others. Under stage 2 each gradient bucket is reduced to the
members' parts (:class:`ReducedBucket`) instead of all-reduced to every holder. The
optimizer must be elementwise, so that stepping the slices equals stepping the whole
parameters bit for bit; checkpoints keep the format of a plan without ZeRO, so either
resumes the other (:meth:`ShardSync.gathered_state`, :meth:`ShardSync.load_state`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hplan.runtime.contract.errors import ModelFileError, PeerFailureError, error_reason
from hplan.runtime.contract.holders import OptimizerShards, RankSet, optimizer_shards
from hplan.runtime.contract.plan import Plan, ZeroStage
from hplan.runtime.executor.grad_sync import GradBucket, grad_or_zeros, wire_dtype

NOT_ELEMENTWISE: Final = {
    "Adafactor": "its second moment of a matrix is factored over rows and columns",
    "LBFGS": "its line search and curvature pairs span every parameter",
    "Muon": "it orthogonalises each matrix's update as a whole",
}
"""``torch.optim`` classes whose update of an element reads other elements, and why:
ZeRO stage 1 refuses them."""


@dataclass(frozen=True)
class ShardLeaf:
    """One holder set's parameters of one optimizer param group and dtype, on one rank.

    Every member of the set has the same leaves, in the same order (their slices differ,
    and may be empty).
    """

    ranks: RankSet
    group_idx: int
    """The param group of the model file's optimizer its parameters belong to."""
    names: tuple[str, ...]
    """Canonical names, in model order."""
    params: tuple[nn.Parameter, ...]
    """The stage's parameters of ``names``, views of ``flat`` (shapes unchanged)."""
    offsets: tuple[int, ...]
    """Where each parameter starts in ``flat`` (elements)."""
    flat: Tensor
    """Every parameter's elements end to end, shape ``(num_elements,)``."""
    bounds: dict[int, tuple[int, int]]
    """Member rank -> its slice of ``flat``: consecutive, in rank order, covering it once."""
    param: nn.Parameter
    """This rank's slice of ``flat`` as a leaf the optimizer steps (shares its storage)."""

    @property
    def lowest(self) -> int:
        return self.ranks[0]

    def overlaps(self, start: int, stop: int) -> Iterator[tuple[int, int, int, int]]:
        """``(parameter index, first, last + 1, where in the slice)`` for every parameter
        with elements in ``flat[start:stop]``: its elements ``first:last + 1`` (flattened)
        are elements ``where:where + last + 1 - first`` of the slice."""
        for idx, (param, offset) in enumerate(zip(self.params, self.offsets, strict=True)):
            first, last = max(start, offset), min(stop, offset + param.numel())
            if first < last:
                yield idx, first - offset, last - offset, first - start

    def slice_of(self, tensors: Sequence[Tensor | None], rank: int) -> Tensor:
        """``rank``'s slice of ``tensors`` (one per parameter, its shape; None: zeros)
        laid end to end as ``flat`` is, shape ``(stop - start,)`` in ``flat``'s dtype."""
        start, stop = self.bounds[rank]
        out = self.flat.new_zeros(stop - start)
        for idx, first, last, where in self.overlaps(start, stop):
            tensor = tensors[idx]
            if tensor is not None:
                out[where : where + last - first] = tensor.reshape(-1)[first:last]
        return out


def shard_optimizer(
    plan: Plan,
    rank: int,
    optimizer: torch.optim.Optimizer,
    params: Sequence[tuple[str, nn.Parameter]],
    make_optimizer: Callable[[Sequence[nn.Parameter]], Any],
) -> torch.optim.Optimizer:
    """The model file's ``optimizer`` of this rank under ZeRO: a :class:`ShardedOptimizer`,
    or ``optimizer`` itself when the rank shares no trainable parameter with another rank.

    The shared parameters become views of their leaves' buffers (``param.data``, in place;
    their values and shapes unchanged), which they must stay: the stage is on its device
    already, and nothing may move it after this. A group's elements within the rank's slice
    of the set's vector are contiguous in the group's buffer (removing other groups'
    elements keeps the order), so every leaf is a view: the optimizer's in-place update is
    the parameters'. Param groups are kept (each group's sharded parameters replaced by its
    leaves), so that their hyperparameters and an LR scheduler's changes apply as without
    ZeRO. The optimizer must be elementwise: an element's update reads only its own
    parameter, gradient and state, and its group's hyperparameters (SGD with momentum,
    Adam, AdamW, Adagrad, RMSprop ... are).

    Args:
        optimizer: the model file's optimizer over every trainable parameter of ``params``,
            not yet stepped.
        params: the stage's parameters by canonical name.
        make_optimizer: the model file's ``optimizer(params)``: builds the leaves' state
            for an optimizer that creates it at construction (Adagrad), as it would.

    Raises:
        ModelFileError: the optimizer is not a ``torch.optim.Optimizer``, is one of
            :data:`NOT_ELEMENTWISE`, or leaves out a parameter it was given.
    """
    trainable = {n: p for n, p in params if p.requires_grad}
    numels = {n: p.numel() for n, p in trainable.items()}
    shards = [s for s in optimizer_shards(plan, numels).values() if rank in s.ranks]
    if not shards:
        return optimizer
    group_of = _group_of(optimizer, trainable)
    leaves = [leaf for spec in shards for leaf in _set_leaves(spec, rank, trainable, group_of)]
    outer = [list(g["params"]) for g in optimizer.param_groups]
    sharded = {id(p) for leaf in leaves for p in leaf.params}
    eager = [optimizer.state.pop(p) for leaf in leaves for p in leaf.params if p in optimizer.state]
    for idx, group in enumerate(optimizer.param_groups):
        kept = [p for p in group["params"] if id(p) not in sharded]
        group["params"] = kept + [leaf.param for leaf in leaves if leaf.group_idx == idx]
    if eager:  # the leaves' initial state, as this optimizer makes it for them
        probe = make_optimizer([leaf.param for leaf in leaves])
        for leaf in leaves:
            optimizer.state[leaf.param] = probe.state[leaf.param]
    if plan.training.zero_stage is not ZeroStage.GRADIENTS:
        return ShardedOptimizer(optimizer, outer, leaves, rank)
    held = [list(g["params"]) for g in optimizer.param_groups]  # what has a .grad (stage 2)
    return ShardedOptimizer(optimizer, held, leaves, rank, {s.ranks: s for s in shards})


def _group_of(
    optimizer: torch.optim.Optimizer, trainable: Mapping[str, nn.Parameter]
) -> dict[str, int]:
    """Canonical name -> the index of the optimizer's param group that holds it.

    Raises:
        ModelFileError: see :func:`shard_optimizer`.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ModelFileError(
            f"make_optimizer() returned a {type(optimizer).__name__}; ZeRO (zero_stage 1 or "
            "2) shards a torch.optim.Optimizer's state: return one, or use zero_stage 0"
        )
    for name, why in NOT_ELEMENTWISE.items():
        cls = getattr(torch.optim, name, None)
        if isinstance(cls, type) and isinstance(optimizer, cls):
            raise ModelFileError(
                f"ZeRO steps each rank's slice of the parameters alone, but {name} "
                f"is not elementwise ({why}); use an elementwise optimizer (SGD, Adam, "
                "AdamW ...) or zero_stage 0"
            )
    index = {id(p): idx for idx, g in enumerate(optimizer.param_groups) for p in g["params"]}
    missing = [n for n, p in trainable.items() if id(p) not in index]
    if missing:
        raise ModelFileError(
            f"make_optimizer() left parameter {missing[0]!r} out of its optimizer; under "
            "ZeRO (zero_stage 1 or 2) it must optimize every parameter it is given"
        )
    return {n: index[id(p)] for n, p in trainable.items()}


def _set_leaves(
    spec: OptimizerShards,
    rank: int,
    trainable: Mapping[str, nn.Parameter],
    group_of: Mapping[str, int],
) -> list[ShardLeaf]:
    """The leaves of one holder set: one per (param group, dtype) among its parameters, in
    order of first use; the parameters are moved into the leaves' buffers."""
    kinds: dict[tuple[int, torch.dtype], list[str]] = {}
    for name in spec.names:
        kinds.setdefault((group_of[name], trainable[name].dtype), []).append(name)
    sizes = [trainable[n].numel() for n in spec.names]
    starts = dict(zip(spec.names, itertools.accumulate(sizes, initial=0), strict=False))
    leaves = []
    for (group_idx, _), names in kinds.items():
        params = tuple(trainable[n] for n in names)
        offsets = tuple(itertools.accumulate((p.numel() for p in params[:-1]), initial=0))
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        for param, offset in zip(params, offsets, strict=True):
            param.data = flat[offset : offset + param.numel()].view_as(param)
        before = [(starts[n], p.numel()) for n, p in zip(names, params, strict=True)]
        bounds = {
            r: (_position(lo, before), _position(hi, before)) for r, (lo, hi) in spec.bounds.items()
        }
        start, stop = bounds[rank]
        leaf = nn.Parameter(flat[start:stop])
        leaves.append(
            ShardLeaf(spec.ranks, group_idx, tuple(names), params, offsets, flat, bounds, leaf)
        )
    return leaves


def _position(at: int, spans: Sequence[tuple[int, int]]) -> int:
    """Where element ``at`` of a holder set's vector falls in one leaf's buffer: how many
    of the leaf's elements lie before it (``spans``: each of the leaf's parameters' start
    in the set's vector and size). Consecutive slices of the vector so become consecutive
    slices of the buffer (a slice without elements of the leaf an empty one)."""
    return sum(min(max(at - start, 0), size) for start, size in spans)


def _hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


class ShardedOptimizer(torch.optim.Optimizer):
    """The model file's optimizer stepping this rank's shards.

    A step follows the gradient sync (under stage 1 every holder ends it with the whole
    summed gradient; under stage 2 only its shard), unscaling and clipping: it copies each
    leaf's slice of the gradients into the leaf's ``.grad`` and steps the model file's
    optimizer on the leaves and on the rank's unshared parameters; :class:`ShardSync` then
    sends the updated slices to the other holders.

    Its param groups are the model file's optimizer's, over the stage's parameters: what
    a loss scaler unscales, an LR scheduler changes and ``zero_grad`` clears. Its ``state``
    is the inner optimizer's (keyed by the unshared parameters and the leaves), so that
    ``optimizer.state`` sizes are what the rank really keeps. ``state_dict`` is not
    supported (checkpoints save by name: ``ShardSync``).
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        params_by_group: Sequence[Sequence[nn.Parameter]],
        leaves: Sequence[ShardLeaf],
        rank: int,
        gradient_shards: Mapping[RankSet, OptimizerShards] | None = None,
    ) -> None:
        """
        Args:
            params_by_group: per param group of ``inner``, the parameters this optimizer's
                group lists: the stage's (stage 1), or the rank's unshared ones and its
                leaves (stage 2).
            gradient_shards: under ZeRO stage 2, the shards of the rank's holder sets
                (``holders.optimizer_shards``): the gradients are sharded too, reduced
                straight into the leaves' ``.grad`` (:class:`ReducedBucket`); None: stage 1.
        """
        groups = [
            {**_hyperparameters(g), "params": list(p)}
            for g, p in zip(inner.param_groups, params_by_group, strict=True)
        ]
        super().__init__(groups, inner.defaults)
        self.inner = inner
        self.leaves = tuple(leaves)
        self.rank = rank
        self.state = inner.state
        self.gradient_shards = gradient_shards

    @property
    def grads_sharded(self) -> bool:
        """Whether the leaves' ``.grad`` is reduced into directly (ZeRO stage 2)."""
        return self.gradient_shards is not None

    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # no closure form
        """Copy each leaf's slice of the gradients into its ``.grad`` (zeros for a
        parameter without one), then step the inner optimizer with this optimizer's
        hyperparameters; the leaves' parameters change in place.

        Raises:
            ValueError: a ``closure`` is given (the step is taken once, on given gradients).
        """
        if closure is not None:
            raise ValueError("a sharded optimizer steps on the synced gradients, no closure")
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner.update(_hyperparameters(outer))
        for leaf in self.leaves:
            if not self.grads_sharded:
                leaf.param.grad = leaf.slice_of([p.grad for p in leaf.params], self.rank)
            elif leaf.param.grad is None:  # stage 2, an empty slice: stepped (and given its
                leaf.param.grad = torch.zeros_like(leaf.param)  # state) as on every member
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.inner.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError("a sharded optimizer's state is saved by name (ShardSync)")


def _elementwise(value: Any, leaf: ShardLeaf) -> bool:
    """Whether an optimizer state value holds one number per element of the leaf (AdamW's
    moments) rather than one for the whole leaf (its step count)."""
    return isinstance(value, Tensor) and value.shape == leaf.param.shape


@dataclass(frozen=True)
class ShardSync:
    """The collectives of this rank's shards: the updated slices to every holder after each
    step, the state to and from checkpoints.

    A broadcast from each member rather than one all-gather: torch's all-gather (gloo's
    above all) needs tensors of one size, so uneven shards would be padded to the largest;
    a broadcast moves exactly the member's slice, straight into the receivers' parameters,
    and a member without a slice sends nothing. They run on the gradient process groups
    (``grad_sync.step_groups``), launched set by set in ``holders.optimizer_shards`` order,
    each set's leaves and members in one order, the same on every rank, then waited for:
    the one global order of ``grad_sync.py``, so no deadlock. A rehearsal does not stretch
    them (``seams.LinkDelay`` emulates point-to-point transfers and the gradient
    all-reduces). Checkpoints keep the format of ``checkpoint.py`` (``optimizer.<name>.<key>``,
    each parameter's whole state): a save gathers each leaf's state on the set's lowest
    rank, a load keeps each member's slice.

    Every method is collective among the members of each of the rank's holder sets and
    must be called by every rank of the job.
    """

    optimizer: ShardedOptimizer
    groups: Mapping[RankSet, dist.ProcessGroup]
    """The gradient process group of each holder set (``grad_sync.step_groups``)."""

    @property
    def rank(self) -> int:
        return self.optimizer.rank

    @property
    def names(self) -> frozenset[str]:
        """The canonical names whose optimizer state is sharded."""
        return frozenset(n for leaf in self.optimizer.leaves for n in leaf.names)

    def all_gather(self) -> None:
        """Broadcast each member's slice of every leaf to the other members, straight into
        their parameters; return once every slice has arrived.

        Raises:
            PeerFailureError: a holder died or a broadcast timed out.
        """
        launched = []
        for leaf in self.optimizer.leaves:
            for member in leaf.ranks:
                start, stop = leaf.bounds[member]
                if stop > start:
                    launched.append((leaf, self._broadcast(leaf, leaf.flat[start:stop], member)))
        for leaf, work in launched:
            try:
                work.wait()
            except RuntimeError as exc:
                raise self._failure(leaf, "broadcast of the updated shards", exc) from None

    def gathered_grads(self) -> dict[str, Tensor]:
        """{canonical name: its whole summed gradient} of every sharded parameter, under
        ZeRO stage 2: each member broadcasts its leaves' ``.grad`` (zeros where it has none)
        to the set's other members (one-off memory of the set's gradients, for
        ``--verify``'s dump); empty under stage 1, whose parameters keep their gradients.

        Raises:
            PeerFailureError: a holder died or a broadcast timed out.
        """
        if not self.optimizer.grads_sharded:
            return {}
        out: dict[str, Tensor] = {}
        for leaf in self.optimizer.leaves:
            full = torch.zeros_like(leaf.flat)
            launched = []
            for member in leaf.ranks:
                start, stop = leaf.bounds[member]
                if stop <= start:
                    continue
                if member == self.rank and leaf.param.grad is not None:
                    full[start:stop] = leaf.param.grad
                launched.append(self._broadcast(leaf, full[start:stop], member))
            for work in launched:
                try:
                    work.wait()
                except RuntimeError as exc:
                    raise self._failure(leaf, "broadcast of the gradient shards", exc) from None
            for idx, name in enumerate(leaf.names):
                out[name] = _part(full, leaf, idx)
        return out

    def gathered_state(self) -> dict[str, dict[str, Any]]:
        """{canonical name: its whole optimizer state} of every sharded parameter whose
        set's lowest rank this is (empty on the others): the state tensors of each leaf
        gathered there (one-off memory of the set's state on that rank).

        Raises:
            PeerFailureError: a holder died or a gather timed out.
        """
        out: dict[str, dict[str, Any]] = {}
        for leaf in self.optimizer.leaves:
            state = self.optimizer.state.get(leaf.param)
            if not state:  # never stepped (on every member alike)
                continue
            entries: list[dict[str, Any]] = [{} for _ in leaf.names]
            for key in sorted(state):
                value = state[key]
                full = self._gather(leaf, value) if _elementwise(value, leaf) else None
                if self.rank != leaf.lowest:
                    continue
                for idx, entry in enumerate(entries):
                    entry[key] = _part(full, leaf, idx) if full is not None else _copy(value)
            if self.rank == leaf.lowest:
                out.update(zip(leaf.names, entries, strict=True))
        return out

    def state_request(self) -> dict[str, dict[str, Any]]:
        """{canonical name: tensors of its whole state} of every sharded parameter of this
        rank, for a checkpoint to load into (fresh full-size tensors, shaped and typed as
        the saved ones). The leaves' state must exist (``checkpoint._initialise_optimizer``).
        """
        out: dict[str, dict[str, Any]] = {}
        for leaf in self.optimizer.leaves:
            state = self.optimizer.state.get(leaf.param, {})
            for param, name in zip(leaf.params, leaf.names, strict=True):
                out[name] = {
                    key: torch.empty(param.shape, dtype=value.dtype, device=value.device)
                    if _elementwise(value, leaf)
                    else _copy(value)
                    for key, value in state.items()
                }
        return out

    def load_state(
        self, loaded: Mapping[str, Mapping[str, Any]], never_stepped: Sequence[str]
    ) -> None:
        """Keep this rank's slice of the whole states in ``loaded`` (what
        :meth:`state_request` asked for, filled by a checkpoint; names the checkpoint
        holds no state of are absent). A leaf none of whose parameters has saved state
        loses its state, when every one of them never stepped (``never_stepped``), as in
        the saved run; its elements of an absent name keep their current state."""
        for leaf in self.optimizer.leaves:
            state = self.optimizer.state.get(leaf.param)
            if state is None:
                continue
            present = [idx for idx, name in enumerate(leaf.names) if name in loaded]
            if not present:
                if set(leaf.names) <= set(never_stepped):
                    del self.optimizer.state[leaf.param]
                continue
            first = loaded[leaf.names[present[0]]]
            for key, value in list(state.items()):
                if not _elementwise(value, leaf):
                    state[key] = first[key]
                    continue
                start, stop = leaf.bounds[self.rank]
                for idx, lo, hi, where in leaf.overlaps(start, stop):
                    if idx in present:
                        source = loaded[leaf.names[idx]][key].reshape(-1)
                        value[where : where + hi - lo] = source[lo:hi]

    def _broadcast(self, leaf: ShardLeaf, tensor: Tensor, src: int) -> dist.Work:
        try:
            work = dist.broadcast(tensor, src=src, group=self.groups[leaf.ranks], async_op=True)
        except RuntimeError as exc:
            raise self._failure(leaf, "broadcast of the updated shards", exc) from None
        assert work is not None
        return work

    def _gather(self, leaf: ShardLeaf, value: Tensor) -> Tensor | None:
        """Every member's ``value`` (its slice of one state tensor) laid end to end, shape
        ``(num_elements,)``, on the set's lowest rank; None on the others. Padded to the
        largest slice (``dist.gather`` takes one size)."""
        sizes = [stop - start for start, stop in (leaf.bounds[r] for r in leaf.ranks)]
        largest = max(sizes)
        if largest == 0:
            return value.new_empty(0) if self.rank == leaf.lowest else None
        mine = value.new_zeros(largest)
        mine[: value.numel()] = value
        parts = [value.new_empty(largest) for _ in leaf.ranks] if self.rank == leaf.lowest else None
        try:
            dist.gather(mine, parts, dst=leaf.lowest, group=self.groups[leaf.ranks])
        except RuntimeError as exc:
            raise self._failure(
                leaf, "gather of the optimizer state for a checkpoint", exc
            ) from None
        if parts is None:
            return None
        return torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)])

    def _failure(self, leaf: ShardLeaf, what: str, exc: RuntimeError) -> PeerFailureError:
        return PeerFailureError(
            f"the {what} among ranks {list(leaf.ranks)} (ZeRO) failed: "
            f"{error_reason(exc)}; check the logs of those ranks (one probably failed first)"
        )


def _part(full: Tensor, leaf: ShardLeaf, idx: int) -> Tensor:
    """Parameter ``idx``'s part of a leaf's whole state vector ``full``, in its shape."""
    param, offset = leaf.params[idx], leaf.offsets[idx]
    return full[offset : offset + param.numel()].view_as(param).clone()


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, Tensor) else value


def build_shard_sync(
    optimizer: torch.optim.Optimizer, groups: Mapping[RankSet, dist.ProcessGroup | None]
) -> ShardSync | None:
    """This rank's :class:`ShardSync` when its optimizer is sharded, else None.

    Args:
        groups: the gradient process groups of the plan (``grad_sync.step_groups``): every
            holder set of the rank's leaves has one.
    """
    if not isinstance(optimizer, ShardedOptimizer):
        return None
    mine: dict[RankSet, dist.ProcessGroup] = {}
    for leaf in optimizer.leaves:
        group = groups[leaf.ranks]
        assert group is not None, "a holder set's members are in its group"
        mine[leaf.ranks] = group
    return ShardSync(optimizer, mine)


def gradient_holders(optimizer: torch.optim.Optimizer) -> list[nn.Parameter] | None:
    """Under ZeRO stage 2, the tensors whose ``.grad`` this rank holds after the gradient
    sync (its unshared trainable parameters and its leaves: each element's summed gradient
    on exactly one rank), what clipping measures and scales; None otherwise (the stage's
    parameters hold their gradients)."""
    if not isinstance(optimizer, ShardedOptimizer) or not optimizer.grads_sharded:
        return None
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


@dataclass(frozen=True)
class _Segment:
    """A contiguous range of a :class:`ReducedBucket`'s flat buffer that one member keeps."""

    start: int
    stop: int
    owner: int
    copies: tuple[tuple[ShardLeaf, int, int, int], ...]
    """On the owner: ``(leaf, where, start, stop)``: ``flat[start:stop]`` goes to
    ``leaf.param.grad[where:]``; empty on the other members."""


@dataclass
class ReducedBucket(GradBucket):
    """A gradient bucket under ZeRO stage 2: laid out in its holder set's order and summed
    by ``dist.reduce`` of each member's part to that member alone, which keeps it in its
    leaves' ``.grad``. Launched, waited for and timed as any bucket (``grad_sync.GradSync``).

    Each member's part is one contiguous range of the bucket (or a few, where a bucket is
    not one run of the set's vector). The flat copy replaces its parameters' ``.grad`` at
    launch; after the reductions no rank holds a summed gradient of a shared parameter, only
    its shard. A reduce per member rather than ``reduce_scatter``: gloo has none, and
    torch's takes one size per rank (uneven shards would be padded). The gradients still
    accumulate whole over the step's micro-batches: the replicas of a holder set run
    different numbers of micro-batches, so a reduction per micro-batch would not pair up
    across holders, and a hook that waited for a reduction inside the backward could
    deadlock with a pipeline peer still waiting for this rank's send.
    """

    segments: tuple[_Segment, ...] = ()
    _flat: Tensor | None = field(default=None, repr=False)
    _works: list[dist.Work] = field(default_factory=list, repr=False)

    def launch(self) -> None:
        """Flatten the gradients (zeros for a parameter without one; float32 for half
        types), drop the parameters' ``.grad`` and start each member's reduction.

        Raises:
            PeerFailureError: a reduction could not be started.
        """
        assert self._flat is None, "a bucket is launched once per step"
        grads = [grad_or_zeros(p) for _, p in self.params]
        wire = wire_dtype([g.dtype for g in grads])
        flat = torch.cat([g.reshape(-1).to(wire) for g in grads])
        del grads
        if self.scale != 1.0:
            flat.mul_(self.scale)
        for _, param in self.params:
            param.grad = None
        self.launched_s = time.monotonic()
        works = []
        for seg in self.segments:
            try:
                work = dist.reduce(
                    flat[seg.start : seg.stop],
                    dst=seg.owner,
                    op=dist.ReduceOp.SUM,
                    group=self.group,
                    async_op=True,
                )
            except RuntimeError as exc:
                raise self._failure(exc) from None
            assert work is not None
            works.append(work)
        self._flat, self._works = flat, works

    def finish(self) -> None:
        """Wait for the reductions and add this rank's parts to its leaves' ``.grad``
        (created as zeros at the step's first part); drop the flat buffer.

        Raises:
            PeerFailureError: a holder died or a reduction timed out.
        """
        flat, works = self._flat, self._works
        assert flat is not None, "finish() follows launch()"
        self._flat, self._works = None, []
        for work in works:
            try:
                work.wait()
            except RuntimeError as exc:
                raise self._failure(exc) from None
        for seg in self.segments:
            for leaf, where, start, stop in seg.copies:
                if leaf.param.grad is None:
                    leaf.param.grad = torch.zeros_like(leaf.param)
                target = leaf.param.grad[where : where + stop - start]
                target.copy_(flat[start:stop])
        self.done_s = time.monotonic()


def reduce_to_owners(
    buckets: Sequence[GradBucket], optimizer: torch.optim.Optimizer
) -> list[GradBucket]:
    """``buckets`` as :class:`ReducedBucket` under ZeRO stage 2 (``optimizer`` a
    :class:`ShardedOptimizer` sharding gradients); unchanged otherwise.

    Every member of a set computes the same segments, in the same order (from the plan's
    shards and the bucket's names alone), so their reductions pair up.
    """
    if not isinstance(optimizer, ShardedOptimizer) or optimizer.gradient_shards is None:
        return list(buckets)
    sets = optimizer.gradient_shards
    leaf_of = {n: (leaf, idx) for leaf in optimizer.leaves for idx, n in enumerate(leaf.names)}
    out: list[GradBucket] = []
    for bucket in buckets:
        spec = sets[bucket.ranks]
        numels = [p.numel() for p in _by_name(optimizer, spec.names)]
        offsets = dict(zip(spec.names, itertools.accumulate(numels, initial=0), strict=False))
        params = sorted(bucket.params, key=lambda item: offsets[item[0]])
        segments = _segments(params, offsets, spec, leaf_of, optimizer.rank)
        out.append(
            ReducedBucket(
                bucket.ranks,
                bucket.group,
                params,
                bucket.scale,
                bucket.min_time_s,
                segments=segments,
            )
        )
    return out


def _by_name(optimizer: ShardedOptimizer, names: Sequence[str]) -> list[nn.Parameter]:
    """The stage's parameters of ``names`` (each in one of the optimizer's leaves)."""
    found = {n: leaf.params[i] for leaf in optimizer.leaves for i, n in enumerate(leaf.names)}
    return [found[n] for n in names]


def _segments(
    params: Sequence[tuple[str, nn.Parameter]],
    offsets: Mapping[str, int],
    spec: OptimizerShards,
    leaf_of: Mapping[str, tuple[ShardLeaf, int]],
    rank: int,
) -> tuple[_Segment, ...]:
    """The members' parts of a bucket whose flat buffer lays ``params`` end to end (in the
    set's order): per parameter, its overlap with each member's slice of the set's vector
    (``spec.bounds``), merged where one member's parts touch in the buffer."""
    parts: list[tuple[int, int, int, tuple[tuple[ShardLeaf, int, int, int], ...]]] = []
    position = 0
    for name, param in params:
        offset, numel = offsets[name], param.numel()
        for member, (lo, hi) in spec.bounds.items():
            first, last = max(lo, offset) - offset, min(hi, offset + numel) - offset
            if first >= last:
                continue
            start, stop = position + first, position + last
            copies: tuple[tuple[ShardLeaf, int, int, int], ...] = ()
            if member == rank:
                leaf, idx = leaf_of[name]
                where = leaf.offsets[idx] + first - leaf.bounds[rank][0]
                copies = ((leaf, where, start, stop),)
            if parts and parts[-1][2] == member and parts[-1][1] == start:
                head = parts.pop()
                parts.append((head[0], stop, member, head[3] + copies))
            else:
                parts.append((start, stop, member, copies))
        position += numel
    return tuple(_Segment(start, stop, owner, copies) for start, stop, owner, copies in parts)
