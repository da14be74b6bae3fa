"""How the holder sets that span islands sync: the rules, their constants, and the reasons.

``hplan solve --sync``:

- ``all_reduce``: one island; every holder set sums its gradients every step.
- ``local_sgd``: the best local plan (``local_plan``) over the candidate partitions, with H
  the smallest number of inner steps, at most ``--max-local-steps``, whose outer sync
  round costs at most :data:`LOCAL_SGD_SYNC_SHARE` of H inner steps.
- ``async``: as ``local_sgd``, with the same H and wire dtype, the round hidden behind the
  next H inner steps. Not the smallest H that would hide it: that can be H = 1, where
  DiLoCo's outer optimizer applied one round late diverges (``bench/slow_links.py``).
- ``auto`` (the default): the synchronous plan, unless its synchronisation costs more than
  :data:`AUTO_SYNC_SHARE` of its step or it leaves devices idle, and the best local SGD
  plan is predicted faster by more than :data:`AUTO_MIN_GAIN`. Never ``async``: its
  staleness changes what the model learns beyond what a step time can weigh.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from hplan.planner.cost.evaluate import (
    Evaluation,
    evaluate,
    grad_sync_groups,
    island_index,
    outer_ring_times_s,
    slowest_link,
)
from hplan.planner.cost.islands import island_names
from hplan.planner.cost.layout import Layout
from hplan.planner.cost.problem import PlanningProblem
from hplan.planner.cost.sync_cost import amortised_outer_s, outer_round_s, split_by_island
from hplan.planner.solve.idle import smallest_stage_bytes
from hplan.planner.solve.validate import layout_problems
from hplan.planner.textfmt import count, format_seconds, percent
from hplan.runtime.contract.link_model import bucket_rings_s
from hplan.runtime.contract.plan import PseudoGradientDtype, SyncMode
from hplan.runtime.contract.quantities import format_bytes, format_link_speed

__all__ = [
    "AUTO_MIN_GAIN",
    "AUTO_SYNC_SHARE",
    "DEFAULT_MAX_LOCAL_STEPS",
    "LOCAL_SGD_SYNC_SHARE",
    "GroupChoice",
    "SyncRequest",
    "choose_local_steps",
    "group_choices",
    "smallest_local_steps",
    "sync_cost_share",
    "usable_idle_devices",
    "wants_local",
]

LOCAL_SGD_SYNC_SHARE = 0.05
"""Under local SGD, one outer sync round may cost at most this share of the H inner steps
it follows (5%: the islands compute at least 95% of the time)."""
AUTO_SYNC_SHARE = 0.10
"""``auto`` looks for a local plan only when the synchronous plan's exposed all-reduce is
more than this share of its step (or it leaves devices idle)."""
AUTO_MIN_GAIN = 0.05
"""... and takes it only when it is predicted more than 5% faster per step: local SGD
changes the optimisation (each island drifts for H steps), which a few percent of step time
do not pay for, and a smaller gain is within what the roofline cost model tells apart."""
DEFAULT_MAX_LOCAL_STEPS = 100
"""``--max-local-steps``: DiLoCo's H ranges 50-500 (Douillard et al., 2023, section 4);
100 keeps the islands' models close enough that the outer step stays a small correction."""


class SyncRequest(StrEnum):
    """``hplan solve --sync``: what the planner may choose (module docstring)."""

    AUTO = "auto"
    ALL_REDUCE = "all_reduce"
    LOCAL_SGD = "local_sgd"
    ASYNC = "async"

    @property
    def mode(self) -> SyncMode:
        """The mode of the local plans searched: ``async`` for ``async``, else ``local_sgd``."""
        return SyncMode.ASYNC if self is SyncRequest.ASYNC else SyncMode.LOCAL_SGD


_EPS = 1e-9


def smallest_local_steps(
    mode: SyncMode, round_s: float, inner_step_s: float, max_local_steps: int
) -> int | None:
    """The smallest H <= ``max_local_steps`` meeting ``mode``'s rule, None when none does.

    Both modes: ``round_s <= LOCAL_SGD_SYNC_SHARE * H * inner_step_s`` (``async`` then hides
    the round behind the next H steps; module docstring). 1 when there is nothing to sync.
    """
    if round_s <= 0:
        return 1
    if inner_step_s <= 0:
        return None
    del mode  # one rule for both modes (module docstring)
    steps = max(1, math.ceil(round_s / (LOCAL_SGD_SYNC_SHARE * inner_step_s) - _EPS))
    return steps if steps <= max_local_steps else None


def choose_local_steps(problem: PlanningProblem, layout: Layout, max_local_steps: int) -> Layout:
    """``layout`` (islands and a local mode in ``layout.sync``) with H and the wire dtype
    chosen by the rules of the module docstring.

    When even H = ``max_local_steps`` misses the rule, the pseudo-gradients travel in
    bfloat16 (half the bytes), and failing that H = ``max_local_steps`` and the reason
    states the time left exposed per step. One fragment: a round costs the same bytes
    however it is cut (Streaming DiLoCo's fragments spread the traffic; they do not
    shrink it).
    """
    sync = layout.sync
    assert sync is not None and sync.local, "choose_local_steps needs a local layout"
    base = replace(sync, local_steps=1, num_fragments=1)
    inner_s = evaluate(problem, replace(layout, sync=base)).inner_step_time_s
    for wire in PseudoGradientDtype:
        trial = replace(base, wire_dtype=wire)
        round_s = outer_round_s(outer_ring_times_s(problem, replace(layout, sync=trial)))
        steps = smallest_local_steps(sync.mode, round_s, inner_s, max_local_steps)
        if steps is not None:
            return replace(layout, sync=replace(trial, local_steps=steps))
    last = replace(base, wire_dtype=PseudoGradientDtype.BFLOAT16, local_steps=max_local_steps)
    return replace(layout, sync=last)


def sync_cost_share(evaluation: Evaluation) -> float:
    """The share of a layout's step spent in its exposed all-reduce."""
    step = evaluation.step_time_s
    return evaluation.allreduce_time_s / step if step > 0 else 0.0


def wants_local(
    problem: PlanningProblem, synchronous: Sequence[Layout], request: SyncRequest
) -> bool:
    """Whether local plans may be chosen, before searching them: always when asked for;
    under ``auto`` only when the best of the ``synchronous`` layouts found spends more than
    :data:`AUTO_SYNC_SHARE` of its step in its all-reduce or leaves a device idle that
    could hold a stage (or none of them is valid)."""
    if request is SyncRequest.ALL_REDUCE:
        return False
    if request is not SyncRequest.AUTO:
        return True
    valid = [layout for layout in synchronous if not layout_problems(problem, layout)]
    if not valid:
        return True
    scored = [(evaluate(problem, layout), layout) for layout in valid]
    best_ev, best = min(scored, key=lambda item: item[0].step_time_s)
    return sync_cost_share(best_ev) > AUTO_SYNC_SHARE or bool(usable_idle_devices(problem, best))


def usable_idle_devices(problem: PlanningProblem, layout: Layout) -> tuple[int, ...]:
    """Devices the layout leaves idle that could hold a stage (``idle.smallest_stage_bytes``
    fits their memory)."""
    used = set(layout.device_indices)
    smallest = smallest_stage_bytes(problem)
    return tuple(
        d
        for d in range(problem.num_devices)
        if d not in used and smallest <= problem.memory_capacity_bytes[d]
    )


# --------------------------------------------------------------------------- reasons
@dataclass(frozen=True)
class GroupChoice:
    """Why one spanning holder set syncs as it does (the report's ``SyncChoiceReport``)."""

    devices: tuple[int, ...]
    """Sorted device indices of the holder set."""
    mode: SyncMode
    local_steps: int
    all_reduce_time_s: float
    """What summing its gradients every step would add to each step."""
    outer_sync_time_s: float
    """One outer sync of its pseudo-gradients (its ring, in the wire dtype)."""
    exposed_time_per_step_s: float
    """Its outer sync amortised per inner step (``sync_cost.amortised_outer_s``)."""
    reason: str


def group_choices(
    problem: PlanningProblem, layout: Layout, max_local_steps: int
) -> tuple[GroupChoice, ...]:
    """One choice per holder set spanning the islands of a local ``layout``, sorted by
    devices; empty for a layout without local sync."""
    sync = layout.sync
    if sync is None or not sync.local:
        return ()
    ev = evaluate(problem, layout)
    inner_s = ev.inner_step_time_s
    island_of = island_index(problem, sync)
    names = island_names(sync.islands)
    _, spanning = split_by_island(grad_sync_groups(problem, layout), island_of)
    rings = outer_ring_times_s(problem, layout)
    round_s = outer_round_s(rings)
    synchronous = evaluate(problem, replace(layout, sync=None)).step_time_s - inner_s
    every_step = {g: _every_step_ring_s(problem, g, b) for g, b in spanning.items()}
    total_ring = sum(every_step.values())
    out = []
    for group in sorted(spanning):
        added = max(0.0, synchronous) * every_step[group] / total_ring if total_ring > 0 else 0.0
        islands = " | ".join(dict.fromkeys(names[island_of[d]] for d in group))
        words = _reason(
            problem, layout, group, spanning[group], added, inner_s, round_s, max_local_steps
        )
        out.append(
            GroupChoice(
                devices=group,
                mode=sync.mode,
                local_steps=sync.local_steps,
                all_reduce_time_s=added,
                outer_sync_time_s=rings[group],
                exposed_time_per_step_s=amortised_outer_s(
                    sync.mode, sync.local_steps, rings[group], inner_s
                ),
                reason=f"islands {islands}: {words}",
            )
        )
    return tuple(out)


def _every_step_ring_s(problem: PlanningProblem, group: tuple[int, ...], num_bytes: float) -> float:
    bandwidth, latency = slowest_link(problem, group)
    return bucket_rings_s(len(group), num_bytes, bandwidth, latency)[0]


def _reason(
    problem: PlanningProblem,
    layout: Layout,
    group: tuple[int, ...],
    gradient_bytes: float,
    added_s: float,
    inner_s: float,
    round_s: float,
    max_local_steps: int,
) -> str:
    sync = layout.sync
    assert sync is not None
    h = sync.local_steps
    link = format_link_speed(slowest_link(problem, group)[0])
    head = (
        f"{sync.mode.value}, H = {h}: an all-reduce of {format_bytes(gradient_bytes)} over "
        f"{link} would add {format_seconds(added_s)} to each {format_seconds(inner_s)} step"
    )
    wire = "" if sync.wire_dtype is PseudoGradientDtype.FLOAT32 else " in bfloat16"
    span_s = h * inner_s
    if sync.mode is SyncMode.ASYNC:
        tail = (
            f"one outer sync{wire} takes {format_seconds(round_s)} and travels behind "
            f"{count(h, 'step')} ({format_seconds(span_s)})"
        )
        met = round_s <= LOCAL_SGD_SYNC_SHARE * span_s * (1 + _EPS)
    else:
        share = round_s / span_s if span_s > 0 else 0.0
        tail = (
            f"one outer sync{wire} takes {format_seconds(round_s)}, {percent(share)} of "
            f"{count(h, 'step')}"
        )
        met = share <= LOCAL_SGD_SYNC_SHARE * (1 + _EPS)
    if wire:
        tail += f" (in float32 it would need H > {max_local_steps})"
    if not met:
        exposed_s = amortised_outer_s(sync.mode, h, round_s, inner_s)
        cost = (
            f"{format_seconds(exposed_s)} of each step is exposed"
            if exposed_s > 0
            else "the sync still hides behind the round"
        )
        tail += f"; H is capped at --max-local-steps {max_local_steps} (5% wants more): {cost}"
    return f"{head}; {tail}"
