"""BatchNorm's running statistics kept one set across replicas.

Each replica's BatchNorm layers update their running mean and variance from the micro-batches
they see, so without a sync the replicas drift apart, a checkpoint (each buffer saved from
its lowest holder) mixes them layer by layer, and eval-mode outputs differ by replica. After
every optimizer step the holders of each running-statistics buffer
(``holders.running_stat_holders``: one rank per replica) average it, weighted by the samples
each replica computed in the step, in one all-reduce per holder set over float64 (DDP
instead broadcasts rank 0's buffers, which drops the other replicas' samples; SyncBatchNorm,
statistics of the whole batch in every forward, costs a collective per layer and
micro-batch). Under local sync (islands that train on their own) the holders inside an
island average every step, the whole set at each outer sync (every H steps).
``num_batches_tracked`` counts optimizer steps, as one process on the global batch counts
them: a pipeline stage's layer would count its micro-batches instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from hplan.runtime.capture.stage import StageModule
from hplan.runtime.contract.errors import PlanMismatchError
from hplan.runtime.contract.holders import RankSet, island_of_rank, running_stat_holders
from hplan.runtime.contract.link_model import sync_order
from hplan.runtime.contract.plan import Plan, RankPlan, microbatch_sizes
from hplan.runtime.executor.grad_sync import new_group

__all__ = ["RunningStats", "build_running_stats", "check_batch_statistics_floor", "stat_sets"]

_COUNTER = "num_batches_tracked"


@dataclass(frozen=True)
class _StatSet:
    """The running statistics this rank averages with one rank set."""

    ranks: RankSet
    group: dist.ProcessGroup | None
    tensors: tuple[Tensor, ...]
    every_steps: int
    """1, or H for a set spanning islands that sync locally."""


class RunningStats:
    """This rank's running-statistics buffers and the sets it averages them with.

    Call :meth:`after_step` after every optimizer step, on every holder at the same steps.
    """

    def __init__(self, sets: Sequence[_StatSet], counters: Sequence[Tensor]) -> None:
        self.sets = tuple(sets)
        self.counters = tuple(counters)
        self._start = tuple(c.clone() for c in counters)
        """The counters when the run (or its resume) began."""
        self._steps = 0

    def after_step(self, step: int, num_samples: int) -> None:
        """Average the sets due after step ``step`` (0-based), each holder weighted by its
        replica's ``num_samples`` this step; set every ``num_batches_tracked`` to its start
        plus the optimizer steps taken since."""
        self._steps += 1
        for stat_set in self.sets:
            if (step + 1) % stat_set.every_steps == 0:
                _average(stat_set, num_samples)
        for counter, start in zip(self.counters, self._start, strict=True):
            counter.copy_(start + self._steps)


def _average(stat_set: _StatSet, num_samples: int) -> None:
    """The samples-weighted mean of the set's tensors over its ranks, in place."""
    flat = torch.cat([t.detach().double().reshape(-1) for t in stat_set.tensors])
    weight = torch.tensor([float(num_samples)], dtype=torch.float64, device=flat.device)
    payload = torch.cat([flat * num_samples, weight])
    dist.all_reduce(payload, group=stat_set.group)
    mean = payload[:-1] / payload[-1]
    offset = 0
    with torch.no_grad():
        for tensor in stat_set.tensors:
            size = tensor.numel()
            tensor.copy_(mean[offset : offset + size].reshape(tensor.shape))
            offset += size


def stat_sets(plan: Plan) -> dict[str, tuple[tuple[RankSet, int], ...]]:
    """Canonical name of every running-statistics buffer held by two or more ranks -> the
    rank sets that average it and how often (every step, or every H steps).

    Without local sync: its holders, every step. Under local sync: its holders inside each
    island every step, and all its holders every H steps when they span islands.
    """
    sync = plan.training.sync
    local_steps = [g.local_steps for g in sync.groups if sync.local] if sync else []
    where = island_of_rank(plan)
    out: dict[str, tuple[tuple[RankSet, int], ...]] = {}
    for name, ranks in running_stat_holders(plan).items():
        if len(ranks) < 2:
            continue
        islands = {where[r] for r in ranks}
        if not local_steps or len(islands) == 1:
            out[name] = ((ranks, 1),)
            continue
        inside = [tuple(r for r in ranks if where[r] == island) for island in sorted(islands)]
        every = tuple((part, 1) for part in inside if len(part) > 1)
        out[name] = (*every, (ranks, max(local_steps)))
    return out


def build_running_stats(
    plan: Plan,
    rank: int,
    named_buffers: Sequence[tuple[str, Tensor]],
    groups: Mapping[RankSet, dist.ProcessGroup | None],
) -> RunningStats | None:
    """This rank's :class:`RunningStats`, creating the process group of every set that
    ``groups`` (the gradient groups, ``grad_sync.step_groups``) lacks, on every rank in
    ``link_model.sync_order`` (``new_group`` is collective: every rank calls this at the
    same point).

    Args:
        named_buffers: this rank's stage buffers by canonical name.

    Returns:
        None when this rank holds no running statistics.

    Raises:
        PeerFailureError: creating a group failed.
    """
    by_name = stat_sets(plan)
    wanted = {ranks for found in by_name.values() for ranks, _ in found}
    timeout_s = plan.training.process_group_timeout_s
    made = dict(groups)
    for ranks in sorted(wanted - set(groups), key=sync_order):
        made[ranks] = new_group(ranks, timeout_s, "running-statistics")
    held = dict(named_buffers)
    names = [n for n in running_stat_holders(plan) if n in held]
    if not names:
        return None
    tensors: dict[tuple[RankSet, int], list[Tensor]] = {}
    for name in names:
        if name.rpartition(".")[2] == _COUNTER:
            continue
        for key in by_name.get(name, ()):
            if rank in key[0]:
                tensors.setdefault(key, []).append(held[name])
    sets = [
        _StatSet(ranks, made[ranks], tuple(found), every)
        for (ranks, every), found in sorted(tensors.items(), key=lambda i: sync_order(i[0][0]))
    ]
    counters = [held[n] for n in names if n.rpartition(".")[2] == _COUNTER]
    return RunningStats(sets, counters)


def check_batch_statistics_floor(rank_plan: RankPlan, stage: StageModule) -> None:
    """Refuse a plan that gives a stage with BatchNorm in train mode a micro-batch of one
    sample (a plan made by hand, or by an hplan before ``min_microbatch_samples``): torch
    would fail inside the forward of a 2-D input, and a 4-D one would train on a sample's
    own statistics.

    Raises:
        PlanMismatchError: naming the rank, a batch-norm module and the fix.
    """
    sizes = microbatch_sizes(rank_plan.num_samples, rank_plan.micro_batch_size)
    if min(sizes) > 1:
        return
    modules = stage.graph_module.named_modules()
    found = [n for n, m in modules if isinstance(m, _BatchNorm) and m.training]
    if found:
        raise PlanMismatchError(
            f"rank {rank_plan.rank} runs a micro-batch of 1 sample through batch norm "
            f"({found[0]}), which needs 2 or more in training; re-run `hplan solve` (it keeps "
            "every micro-batch of a batch-norm model at 2 samples or more)"
        )
