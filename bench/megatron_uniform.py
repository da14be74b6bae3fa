"""Megatron-style uniform (tp, pp, dp) plans, costed by hplan's own evaluator.

Megatron-LM's launcher gives every rank the same tensor-parallel degree ``tp`` and the
same pipeline depth ``pp``: ``tp x pp x dp`` cards, TP groups of ``tp`` consecutive cards
(one node, one kind here), ranks ordered tp fastest, then dp, then pp (its default order
``tp-dp-pp``), the layers split into equal counts per stage (the embedding with the first
stage, the head with the last) and the global batch into equal shares, one micro-batch
size everywhere. On a mixed pool that is not one plan but many: this module enumerates
every ``(tp, pp, dp)`` on every subset of TP groups that fits (with and without full
activation recomputation, Megatron's ``--recompute-granularity full``) and keeps the
fastest by ``cost.evaluate``, which is generous to the uniform plan: a user would pick one.
No optimizer-state offload or distributed optimizer (ZeRO) is tried.

Pure functions of a ``PlanningProblem``; ``bench/tensor_parallel.py`` prints them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import combinations

from hplan.planner.cost.evaluate import evaluate
from hplan.planner.cost.layout import Layout, StageLayout, replica_layout
from hplan.planner.cost.problem import PlanningProblem, restrict
from hplan.planner.cost.tensor_parallel import grouped_problem, tp_groups
from hplan.planner.solve.baselines import equal_shares, layer_bounds
from hplan.runtime.contract.plan import TP_DEGREES


@dataclass(frozen=True)
class UniformPlan:
    """One costed uniform plan."""

    tp: int
    pp: int
    dp: int
    cards: tuple[str, ...]
    """The cards it uses, TP groups in rank order (``tp`` consecutive names per group)."""
    kinds: tuple[str, ...]
    """The catalog kind of each of ``cards``."""
    micro_batch_size: int
    recompute: bool
    step_time_s: float
    samples_per_s: float

    def label(self) -> str:
        """``tp2 pp2 dp1 (4 cards: 4 a100-80gb, recompute, b=1)``."""
        kinds: dict[str, int] = {}
        for kind in self.kinds:
            kinds[kind] = kinds.get(kind, 0) + 1
        where = ", ".join(f"{n}x {k}" for k, n in kinds.items())
        extra = ", recompute" if self.recompute else ""
        return f"tp{self.tp} pp{self.pp} dp{self.dp} on {where}{extra}, b={self.micro_batch_size}"


def card_groups(problem: PlanningProblem, tp: int) -> tuple[tuple[int, ...], ...]:
    """Megatron's TP groups of ``tp`` cards: consecutive cards of one node and one kind
    (any link between them); every card alone for ``tp`` 1; none where the model offers
    no tensor parallelism or not this degree."""
    if tp == 1:
        return tuple((d,) for d in range(problem.num_devices))
    if problem.tensor_parallel is None:
        return ()
    if tp > problem.tensor_parallel.max_degree:
        return ()
    return tp_groups(problem, tp, nvlink_only=False)


def megatron_order(groups: Sequence[tuple[int, ...]], pp: int) -> list[tuple[int, ...]]:
    """``groups`` (``pp x dp`` of them, rank order) reordered into pipelines: Megatron puts
    stage ``s`` of replica ``r`` on group ``s * dp + r``; the result lists replica 0's
    stages, then replica 1's, ... (what :func:`uniform_layout` reads)."""
    dp = len(groups) // pp
    return [groups[s * dp + r] for r in range(dp) for s in range(pp)]


def uniform_layout(problem: PlanningProblem, pp: int, *, recompute: bool) -> Layout | None:
    """Replicas of ``pp`` consecutive devices of ``problem`` (all of them, in order), equal
    layer counts per stage (``baselines.layer_bounds``), equal batch shares, the largest
    micro-batch size that fits every device (``evaluate``'s memory check); None if none
    fits or the shape is impossible."""
    dp = problem.num_devices // pp
    if dp < 1 or dp * pp != problem.num_devices or pp > problem.num_units:
        return None
    if dp > problem.global_batch_size:
        return None
    bounds = layer_bounds(problem.unit_names, pp)
    shares = equal_shares(problem.global_batch_size, dp)
    for b in sorted(problem.micro_batch_sizes, reverse=True):
        if b > shares[-1]:
            continue
        replicas = tuple(
            replica_layout(
                tuple(
                    StageLayout(r * pp + s, bounds[s], bounds[s + 1], recompute=recompute)
                    for s in range(pp)
                ),
                b,
                share,
            )
            for r, share in enumerate(shares)
        )
        layout = Layout(replicas)
        if evaluate(problem, layout).memory_ok:
            return layout
    return None


def _problems(
    problem: PlanningProblem, tp: int, pp: int, num_groups: int
) -> Iterator[tuple[PlanningProblem, tuple[int, ...]]]:
    """Each subset of ``num_groups`` TP groups (cluster order), as a problem whose devices
    are those groups in Megatron's pipeline order, with the cards it uses (indices)."""
    groups = card_groups(problem, tp)
    for subset in combinations(groups, num_groups):
        ordered = megatron_order(subset, pp)
        cards = tuple(d for g in ordered for d in g)
        if tp == 1:
            yield restrict(problem, [g[0] for g in ordered]), cards
        else:
            yield grouped_problem(problem, ordered), cards


def uniform_plans(
    problem: PlanningProblem, degrees: Sequence[int] = TP_DEGREES
) -> list[UniformPlan]:
    """The fastest uniform plan of every ``(tp, pp, dp)`` that fits, fastest first."""
    best: dict[tuple[int, int, int], UniformPlan] = {}
    for tp in degrees:
        num_groups = len(card_groups(problem, tp))
        for n in range(1, num_groups + 1):
            for pp in (p for p in range(1, n + 1) if n % p == 0):
                for candidate in _costed(problem, tp, pp, n):
                    key = (tp, pp, n // pp)
                    if key not in best or candidate.samples_per_s > best[key].samples_per_s:
                        best[key] = candidate
    return sorted(best.values(), key=lambda p: -p.samples_per_s)


def _costed(problem: PlanningProblem, tp: int, pp: int, n: int) -> Iterator[UniformPlan]:
    for sub, cards in _problems(problem, tp, pp, n):
        for recompute in (False, True):
            layout = uniform_layout(sub, pp, recompute=recompute)
            if layout is None:
                continue
            result = evaluate(sub, layout)
            yield UniformPlan(
                tp=tp,
                pp=pp,
                dp=n // pp,
                cards=tuple(problem.device_names[d] for d in cards),
                kinds=tuple(problem.device_kinds[d] for d in cards),
                micro_batch_size=layout.replicas[0].micro_batch_size,
                recompute=recompute,
                step_time_s=result.step_time_s,
                samples_per_s=result.samples_per_s,
            )
