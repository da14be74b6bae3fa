"""Loss weighting, gradient all-reduce and clipping for heterogeneous data parallelism.

Replicas process different numbers of samples and may split layers differently, so the last
stage weights each micro-batch's loss by its share of the batch (:func:`loss_weight`), and
each parameter's gradient is summed among exactly the ranks that hold it
(``contract/holders.py``; a parameter tied between two stages of one replica, GPT's
embedding and head, is summed across those stages too), on one process group per holder set
(:func:`step_groups`). Half-precision gradients are summed in float32 and cast back. The
sums overlap the last backward pass, as in torch DDP (Li et al., "PyTorch Distributed",
VLDB 2020): buckets launched from post-accumulate-grad hooks in one global order
(:class:`GradSync` says why it cannot deadlock). Islands that train on their own
(``training.sync.local``, ``outer_sync.py``) weight and sum per island
(:func:`loss_denominator`, :func:`contribution_scale`). Clipping: :class:`GradClip`.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from hplan.runtime.contract.errors import (
    ConfigError,
    PeerFailureError,
    PlanMismatchError,
    error_reason,
)
from hplan.runtime.contract.holders import (
    RankSet,
    grad_buckets,
    island_of_rank,
    island_ranks,
    island_samples,
    outer_groups,
    parameter_holders,
    step_holder_sets,
)
from hplan.runtime.contract.link_model import BUCKET_CAP_BYTES
from hplan.runtime.contract.plan import Plan, SyncMode
from hplan.runtime.executor.memory.tensor_parallel import (
    is_dtensor,
    is_sharded,
    local,
    local_grad,
    set_local_grad,
)
from hplan.runtime.executor.seams import LinkDelay


def loss_weight(mb_samples: int, batch_samples: int) -> float:
    """Factor for one micro-batch's mean loss so that all of them sum to the batch's mean.

    ``loss_fn`` returns the mean over the ``mb_samples`` samples (or, for a token-mean loss,
    target tokens) it is given; the mean over a batch of ``batch_samples`` (the global
    batch, or an island's samples under local sync: :func:`loss_denominator`) is
    ``sum_mb mean_mb * mb_samples / batch_samples``.
    """
    assert 0 < mb_samples <= batch_samples
    return mb_samples / batch_samples


def loss_denominator(plan: Plan, rank: int) -> int:
    """The samples a step's loss is the mean over on ``rank``: its island's
    (``holders.island_samples``) when islands train on their own (``training.sync.local``),
    else the global batch's.

    With islands an island's step is a step on its own samples: its gradients are the mean
    over them, and a local group's gradients are summed among its holders inside each
    island only (``holders.step_holders``); those island parts' buckets take their places
    in the one global launch order (their ranks are disjoint). Without a local group
    nothing changes: weights over the global batch, scale 1, bit for bit the synchronous
    runtime."""
    sync = plan.training.sync
    if sync is None or not sync.local:
        return plan.global_batch_size
    return island_samples(plan)[island_of_rank(plan)[rank]]


def loss_sample_ranges(plan: Plan, rank: int) -> tuple[tuple[int, int], ...]:
    """The samples ``[start, stop)`` of the global batch that a step's loss on ``rank`` is a
    mean over (:func:`loss_denominator`'s samples): the whole batch, or its island
    replicas' shares when islands train on their own. A token-mean loss counts its items
    there (``capture/loss_items.count_items``)."""
    sync = plan.training.sync
    if sync is None or not sync.local:
        return ((0, plan.global_batch_size),)
    where = island_of_rank(plan)
    ranges = []
    for replica in range(plan.num_replicas):
        first = plan.replica_ranks(replica)[0]
        if where[first.rank] == where[rank]:
            offset = plan.sample_offset(replica)
            ranges.append((offset, offset + first.num_samples))
    return tuple(ranges)


def contribution_scale(plan: Plan, rank: int, ranks: RankSet) -> float:
    """What ``rank`` multiplies its gradients by before summing them over ``ranks`` every
    step: ``island_samples / global_batch_size`` of its island when islands train on their
    own and ``ranks`` spans islands (an ``all_reduce`` group: the sum of the islands' means
    weighted by their samples is then the global batch's mean), else 1."""
    sync = plan.training.sync
    where = island_of_rank(plan)
    if sync is None or not sync.local or len({where[r] for r in ranks}) == 1:
        return 1.0
    return island_samples(plan)[where[rank]] / plan.global_batch_size


def check_stage_parameters(plan: Plan, rank: int, names: Sequence[str]) -> None:
    """Check that the stage holds exactly the parameters the plan says this rank holds.

    Raises:
        PlanMismatchError: naming a parameter that the stage and the plan disagree on.
    """
    tp_rank = plan.ranks[rank].tp_rank
    planned = {name for name, ranks in parameter_holders(plan, tp_rank).items() if rank in ranks}
    for name in sorted(set(names) - planned):
        raise PlanMismatchError(
            f"rank {rank} holds parameter {name!r} that the plan does not list for its units; "
            "re-run `hplan solve` with this model file"
        )
    for name in sorted(planned - set(names)):
        raise PlanMismatchError(
            f"the plan lists parameter {name!r} for rank {rank}, but its stage does not use "
            "it; re-run `hplan solve` with this model file"
        )


@dataclass
class _Launched:
    """An all-reduce in flight: its flat buffer, the gradients it was built from, its work."""

    flat: Tensor
    grads: list[Tensor]
    work: dist.Work


@dataclass
class GradBucket:
    """Some trainable parameters of one holder set, summed in one all-reduce
    (``holders.BucketSpec``)."""

    ranks: RankSet
    group: dist.ProcessGroup
    params: list[tuple[str, nn.Parameter]]
    scale: float = 1.0
    """This rank's contribution factor (:func:`contribution_scale`; 1: none applied)."""
    min_time_s: float = 0.0
    """Least all-reduce time, counted from when every holder has launched the bucket and
    finished its own previous one (the run's ``LinkDelay.all_reduce_floor_s``; 0: the real
    all-reduce alone; see :meth:`GradSync.finish`)."""
    launched_s: float = 0.0
    """When this step's all-reduce was launched (``time.monotonic``)."""
    done_s: float = 0.0
    """When its sums were in ``.grad`` (``time.monotonic``)."""
    _launched: _Launched | None = field(default=None, repr=False)

    def launch(self) -> None:
        """Flatten the gradients (zeros for a parameter without one; float32 for half
        types) and start summing them over the holder set, without waiting.

        Raises:
            PeerFailureError: the all-reduce could not be started.
        """
        assert self._launched is None, "a bucket is launched once per step"
        grads = [local_grad(p, grad_or_zeros(p)) for _, p in self.params]
        wire = wire_dtype([g.dtype for g in grads])
        flat = torch.cat([g.reshape(-1).to(wire) for g in grads])
        if self.scale != 1.0:
            flat.mul_(self.scale)
        self.launched_s = time.monotonic()
        work = self.collective(flat, dist.ReduceOp.SUM, async_op=True)
        assert work is not None
        self._launched = _Launched(flat, grads, work)

    def finish(self) -> None:
        """Wait for the launched all-reduce and put the sums into ``.grad``: views of the
        summed buffer where a gradient's dtype is the wire's (no copy; the buffer lives
        until ``zero_grad`` drops them), a converted copy otherwise: a view saves a copy's
        CPU time, as DDP's ``gradient_as_bucket_view`` does.

        Raises:
            PeerFailureError: a holder died or the all-reduce timed out.
        """
        launched, self._launched = self._launched, None
        assert launched is not None, "finish() follows launch()"
        try:
            launched.work.wait()
        except RuntimeError as exc:
            raise self._failure(exc) from None
        offset = 0
        for (_, param), grad in zip(self.params, launched.grads, strict=True):
            numel = grad.numel()
            chunk = launched.flat[offset : offset + numel].view_as(grad)
            set_local_grad(param, chunk if chunk.dtype == grad.dtype else chunk.to(grad.dtype))
            offset += numel
        self.done_s = time.monotonic()

    def collective(
        self, tensor: Tensor, op: dist.ReduceOp.RedOpType, *, async_op: bool = False
    ) -> dist.Work | None:
        """``dist.all_reduce`` of ``tensor`` on the holder set's group.

        Raises:
            PeerFailureError: a holder died or the all-reduce timed out.
        """
        try:
            return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)
        except RuntimeError as exc:
            raise self._failure(exc) from None

    def _failure(self, exc: RuntimeError) -> PeerFailureError:
        return PeerFailureError(
            f"gradient all-reduce among ranks {list(self.ranks)} failed: {error_reason(exc)}; "
            "check the logs of those ranks (one probably failed first)"
        )


def _unchanged(monotonic_s: float) -> float:
    return monotonic_s


class GradSync:
    """This rank's buckets, each launched as soon as the step's last backward pass has
    finalised its gradients.

    A holder set's gradients are split into buckets of at most
    ``link_model.BUCKET_CAP_BYTES`` wire bytes, in the reverse of the model's parameter order
    (``holders.grad_buckets``). A gradient is final after the rank's last backward pass of
    the step; during that pass a ``register_post_accumulate_grad_hook`` per parameter marks
    it done, and a bucket whose parameters are all done is flattened and its all-reduce
    launched (``async_op=True``). The hooks never block: a pipeline peer may still be
    waiting for this rank's next send.

    Why it cannot deadlock: all buckets of all holder sets lie in one global order, derived
    from the plan and canonical names alone, and every rank launches its own buckets as a
    subsequence of it (a bucket whose gradients are done waits until the rank's earlier
    buckets are out). Two ranks that issued collectives on several groups in opposite
    orders could each wait for the other (NCCL requires one order across communicators, and
    gloo's blocking calls hang the same way); under one global order the earliest pending
    collective always has every holder ready to run it. The order follows the order in
    which a stage finalises its gradients, so little overlap is lost.

    Per step: :meth:`arm` just before the rank's last backward pass, :meth:`finish` after
    its schedule. The hooks stay on the parameters until :meth:`close`.
    """

    def __init__(self, buckets: Sequence[GradBucket]) -> None:
        self.buckets = list(buckets)
        self._missing: list[set[int]] = [set() for _ in self.buckets]
        self._next = 0
        """Index of the next bucket to launch: buckets go out in order."""
        self._armed = False
        self._hooks = [
            param.register_post_accumulate_grad_hook(self._hook(idx, param))
            for idx, bucket in enumerate(self.buckets)
            for _, param in bucket.params
        ]

    def _hook(self, idx: int, param: nn.Parameter) -> Callable[[Tensor], None]:
        """The hook of ``param`` in bucket ``idx``. It holds this object weakly: a cycle
        through the parameters would keep the process groups alive until the interpreter
        exits, where destroying a gloo group aborts the process."""
        key, sync = id(param), weakref.ref(self)

        def on_grad(_: Tensor) -> None:
            owner = sync()
            if owner is None or not owner._armed:
                return
            owner._missing[idx].discard(key)
            owner._launch_ready()

        return on_grad

    def arm(self) -> None:
        """From now until :meth:`finish`, launch each bucket once all its parameters have
        accumulated a gradient, and every bucket before it has been launched. Call right
        before the rank's last backward pass of the step."""
        self._missing = [{id(p) for _, p in b.params} for b in self.buckets]
        self._armed = True

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and not self._missing[self._next]:
            self.buckets[self._next].launch()
            self._next += 1

    def finish(self, timeline_s: Callable[[float], float] = _unchanged) -> None:
        """Launch the buckets that are not out yet (a parameter that got no gradient in the
        last backward pass held its bucket, and the rank's later ones, back: its gradient
        or zeros go out now), wait for every bucket in launch order and put the sums into
        ``.grad``.

        Emulated (``min_time_s`` > 0), each bucket starts when every holder has launched it
        and ended its own previous bucket (a one-number MAX all-reduce of that time over
        the holders; the machine's clock is shared) and lasts ``min_time_s``: one ring after
        another on each rank, ending at the same time on every holder, as a real ring does;
        this returns no sooner than the last bucket's end. Launch times are placed on the
        compute clock's timeline first (``timeline_s``, ``ComputeClock.timeline_s``: a
        rehearsal stretches its blocks). Counted from each holder's own arrival instead, a
        holder that came early would leave as soon as the real reduction was done and start
        its next all-reduce while the late ones still slept.

        Raises:
            PeerFailureError: a holder died or an all-reduce timed out.
        """
        self._armed = False
        for bucket in self.buckets[self._next :]:
            bucket.launch()
        self._next = 0
        for bucket in self.buckets:
            bucket.finish()
        end_s = self._emulated_end_s(timeline_s)
        remaining_s = end_s - time.monotonic()
        if remaining_s > 0:
            time.sleep(remaining_s)

    def _emulated_end_s(self, timeline_s: Callable[[float], float]) -> float:
        """When the last bucket ends under its floor (see :meth:`finish`); blocking
        collectives, safe after the schedule: every rank runs them in the buckets' order."""
        end_s = -math.inf
        for bucket in self.buckets:
            if bucket.min_time_s <= 0:
                continue
            device = bucket.params[0][1].device
            launched_s = timeline_s(bucket.launched_s)
            ready = torch.tensor([max(launched_s, end_s)], dtype=torch.float64, device=device)
            bucket.collective(ready, dist.ReduceOp.MAX)
            end_s = float(ready.item()) + bucket.min_time_s
            bucket.done_s = max(bucket.done_s, end_s)
        return end_s

    def close(self) -> None:
        """Remove the hooks from the parameters."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def grad_or_zeros(param: nn.Parameter) -> Tensor:
    if param.grad is None:
        return torch.zeros_like(param)
    return param.grad


def wire_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    wire = torch.float32
    for dtype in dtypes:
        wire = torch.promote_types(wire, dtype)
    return wire


@dataclass
class GradClip:
    """Global-norm gradient clipping of one rank.

    After the sum every rank holds the full gradient of each of its parameters (of its shard
    of it, under tensor parallelism), so the whole model's L2 norm is the square root of the
    sum over parameters, each counted once on its lowest holder (where checkpoints save it
    from), of its squared norm: one SUM all-reduce of one number. A TP-split parameter is
    counted by the lowest holder of each shard; one a TP group holds whole, by its lead's.
    Each rank then scales its gradients as ``torch.nn.utils.clip_grad_norm_``
    does. Under local sync the norm is the island's (each parameter counted once per island,
    summed on the island's group), since an island's step is its own.

    Every rank of the job must call :meth:`clip` once per step, after the gradient sync.
    """

    max_norm: float
    """The model file's ``MAX_GRAD_NORM`` (global L2 norm, in gradient units)."""
    counted: list[nn.Parameter]
    """This rank's trainable parameters whose lowest holder it is: its share of the norm."""
    params: list[nn.Parameter]
    """Every trainable parameter of this rank: what it scales."""
    device: torch.device
    """Where the one-number all-reduce runs (the rank's device: NCCL needs a GPU tensor)."""
    group: dist.ProcessGroup | None = None
    """Whose norm: None, every rank's (the world); under local sync the island's group."""
    over: str = "every rank"
    """Whose norm, in words, for an error (``"island box-a's ranks [0, 1]"``)."""

    def clip(self) -> float:
        """Scale this rank's gradients by ``min(1, max_norm / (norm + 1e-6))``, where
        ``norm`` is the whole model's gradient L2 norm; return ``norm`` (before clipping).

        A non-finite ``norm`` (an overflow somewhere) scales nothing: under fp16 loss
        scaling every rank skips the step anyway; otherwise the caller reports it.

        Raises:
            PeerFailureError: a rank died or the all-reduce timed out.
        """
        grads = [local(p.grad) for p in self.counted if p.grad is not None]
        norm_here = get_total_norm(grads) if grads else torch.zeros(())
        squared = norm_here.to(self.device, torch.float64).square().reshape(1)
        try:
            dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=self.group)
        except RuntimeError as exc:
            raise PeerFailureError(
                f"the gradient-norm all-reduce (MAX_GRAD_NORM) over {self.over} failed: "
                f"{error_reason(exc)}; check the other ranks' logs (one probably failed first)"
            ) from None
        total = squared.sqrt().reshape(())
        norm = float(total)
        if math.isfinite(norm):  # the same float32 factor on every rank, as in one process
            _clip_with_norm(self.params, self.max_norm, total.float())
        return norm


def _clip_with_norm(params: Sequence[nn.Parameter], max_norm: float, total: Tensor) -> None:
    """``torch.nn.utils.clip_grads_with_norm_`` on the local gradients (a TP stage's shards,
    the same storage as its DTensor gradients): each times ``min(1, max_norm / (total +
    1e-6))``."""
    if not any(is_dtensor(p.grad) for p in params):
        clip_grads_with_norm_(params, max_norm, total)
        return
    grads = [local(p.grad) for p in params if p.grad is not None]
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(factor.to(grad.device))


def build_grad_clip(
    plan: Plan,
    rank: int,
    named_params: Sequence[tuple[str, nn.Parameter]],
    max_norm: float | None,
    device: torch.device,
) -> GradClip | None:
    """This rank's :class:`GradClip` for ``max_norm`` (None: no clipping, None returned).

    Under local sync, creates one group per island of two or more ranks (on every rank, in
    the islands' order: ``new_group`` is collective) and clips to the island's norm.

    Args:
        named_params: this rank's stage parameters by canonical name (as in
            :func:`build_buckets`, which checks them against the plan).

    Raises:
        ConfigError: islands train on their own and some cross-island holder set
            all-reduces every step (its copies, the same gradient scaled by each island's
            own factor, would drift apart).
    """
    if max_norm is None:
        return None
    sync = plan.training.sync
    trainable = [(n, p) for n, p in named_params if p.requires_grad]
    if sync is None or not sync.local:
        rank_plan = plan.ranks[rank]
        holders = parameter_holders(plan, rank_plan.tp_rank)
        counted = [
            p
            for n, p in trainable
            if holders[n][0] == rank and (rank_plan.tp_rank == 0 or is_sharded(p))
        ]
        return GradClip(max_norm, counted, [p for _, p in trainable], device)
    _check_island_clipping(plan)
    holders, where = parameter_holders(plan, plan.ranks[rank].tp_rank), island_of_rank(plan)
    island = where[rank]
    counted = [p for n, p in trainable if min(r for r in holders[n] if where[r] == island) == rank]
    timeout_s = plan.training.process_group_timeout_s
    groups = {name: new_group(ranks, timeout_s) for name, ranks in island_ranks(plan).items()}
    ranks = island_ranks(plan)[island]
    over = f"island {island}'s ranks {list(ranks)}"
    return GradClip(max_norm, counted, [p for _, p in trainable], device, groups[island], over)


def _check_island_clipping(plan: Plan) -> None:
    """Raises ConfigError: some cross-island holder set all-reduces every step while
    islands clip to their own norms (its copies would drift apart)."""
    every_step = [ranks for ranks, g in outer_groups(plan).items() if g.mode is SyncMode.ALL_REDUCE]
    if every_step:
        raise ConfigError(
            f"MAX_GRAD_NORM with islands that train on their own clips each island to its "
            f"own norm, but ranks {list(every_step[0])} all-reduce across islands every step "
            "and their copies would drift apart; remove MAX_GRAD_NORM or sync that group by "
            "local_sgd/async too (re-run `hplan solve`)"
        )


def build_buckets(
    plan: Plan,
    rank: int,
    named_params: Sequence[tuple[str, nn.Parameter]],
    *,
    delay: LinkDelay | None = None,
    cap_bytes: float = BUCKET_CAP_BYTES,
    groups: Mapping[RankSet, dist.ProcessGroup | None] | None = None,
) -> list[GradBucket]:
    """This rank's buckets, in launch order (``holders.grad_buckets``), on the gradient
    process groups (``groups``; None: :func:`step_groups` creates them here).

    Must be called by every rank of the world, in the same program order, because
    ``new_group`` is collective. Parameters that do not require grad are skipped.

    Args:
        named_params: this rank's stage parameters by canonical name.
        delay: the run's link delay (``seams.LinkDelay``): each bucket lasts at least its
            ``all_reduce_floor_s``; None: the real all-reduce alone.
        cap_bytes: most wire bytes per bucket (a larger parameter is a bucket alone).
        groups: :func:`step_groups` of the plan, created by the caller (who shares them:
            ZeRO stage 1's broadcasts run on them too, ``zero.py``).

    Raises:
        PlanMismatchError: the stage's parameters differ from the plan's (see
            :func:`check_stage_parameters`).
    """
    check_stage_parameters(plan, rank, [name for name, _ in named_params])
    if groups is None:
        groups = step_groups(plan)
    trainable = {n: p for n, p in named_params if p.requires_grad}
    wire_bytes = {n: p.numel() * wire_dtype([p.dtype]).itemsize for n, p in trainable.items()}
    buckets = []
    for spec in grad_buckets(plan, wire_bytes, cap_bytes):
        if rank not in spec.ranks:  # another island's part of a local group
            continue
        group = groups[spec.ranks]
        assert group is not None
        floor_s = 0.0 if delay is None else delay.all_reduce_floor_s(spec.ranks, spec.num_bytes)
        params = [(n, trainable[n]) for n in spec.names]
        scale = contribution_scale(plan, rank, spec.ranks)
        buckets.append(GradBucket(spec.ranks, group, params, scale, floor_s))
    return buckets


def step_groups(plan: Plan) -> dict[RankSet, dist.ProcessGroup | None]:
    """Create every gradient process group, one per rank set that sums gradients every
    step (``holders.step_holder_sets``), on every rank in that order (``new_group`` is
    collective over the world: every rank must call this at the same point), with the plan's
    process-group timeout (not torch's 30-minute default). ZeRO's broadcasts of the updated
    shards run on them too (``memory/zero.py``).

    Raises:
        PeerFailureError: creating a group failed.
    """
    timeout_s = plan.training.process_group_timeout_s
    return {ranks: new_group(ranks, timeout_s) for ranks in step_holder_sets(plan)}


def new_group(ranks: RankSet, timeout_s: float, what: str = "gradient") -> dist.ProcessGroup | None:
    """``dist.new_group`` of ``ranks`` with the plan's timeout (collective over the world).

    Raises:
        PeerFailureError: naming the ``what`` group and its ranks, when creating it fails.
    """
    try:
        return dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise PeerFailureError(
            f"creating the {what} group of ranks {list(ranks)} failed: {error_reason(exc)}; "
            "check the logs of those ranks (one probably failed first)"
        ) from None
