"""How the holder sets that span islands sync: the rules, their constants, and the reasons.

Each spanning holder set (``GroupSync`` in ``IslandSync.groups``) gets its own mode, H,
wire format, fragments F and overlap tau, from its own link: T is one outer sync of its
pseudo-gradients in a wire format (``sync_cost.outer_transfer_time_s``), the inner step the
layout's step without outer syncs, of which a set gets a budget: an equal share with the
other sets on its busiest device (sets that share a device share its link).
``hplan solve --sync``:

- ``all_reduce``: one island; every holder set sums its gradients every step.
- ``local_sgd`` (blocking, tau = 0, one fragment): for each wire format in the order
  float32, bfloat16, int8, int4 (or the one ``--wire`` names), the smallest H <=
  ``--max-local-steps`` with T <= :data:`LOCAL_SGD_SYNC_SHARE` of H budgets; the first
  format that has one wins (compressed only where the less compressed cannot meet the
  rule). When none does: H = ``--max-local-steps`` in the format with the smallest T.
- ``async``: ``local_sgd``'s H and wire, applied one round late. Not the smallest H that
  would hide the sync: that can be H = 1, where DiLoCo's outer step applied one round late
  diverges (``bench/slow_links.py``).
- ``streaming`` (``local_sgd`` overlapped, Streaming DiLoCo): in the same format order,
  the smallest H, then the smallest tau >= 1, whose sync hides: the link carries T / H
  within :data:`LINK_BUSY_SHARE` of the budget, and each fragment (T / F, no smaller than
  the set's largest unit: fragments cut between parameters) travels within tau budgets,
  F the fewest that do, F <= min(H, units held); tau <= min(H - 1,
  ``--max-overlap-steps``). Small H first (DiLoCo's quality falls as H grows), then the
  least staleness. When nothing hides: the least exposed at H = ``--max-local-steps``.
- ``auto`` (the default): the synchronous plan, unless its synchronisation costs more than
  :data:`AUTO_SYNC_SHARE` of its step or it leaves devices idle, and the best local plan
  is predicted faster by more than :data:`AUTO_MIN_GAIN`. A set of a local plan takes
  the ``streaming`` rule's choice (tau = 0 allowed where T / H alone is within
  :data:`HIDDEN_SYNC_SHARE`) when it exposes less than ``local_sgd``'s, else
  ``local_sgd``'s. Never ``async``: its staleness changes what the model learns beyond
  what a step time can weigh.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from hplan.planner.cost.evaluate import (
    Evaluation,
    evaluate,
    grad_sync_groups,
    island_index,
    largest_unit_share,
    outer_costs_s,
    outer_link,
    outer_ring_times_s,
    outer_sync_groups,
    set_unit_bytes,
    slowest_link,
)
from hplan.planner.cost.islands import island_names
from hplan.planner.cost.layout import GroupSync, IslandSync, Layout
from hplan.planner.cost.problem import PlanningProblem
from hplan.planner.cost.sync_cost import (
    exposed_outer_s,
    outer_codec_time_s,
    outer_transfer_time_s,
    split_by_island,
)
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
    "DEFAULT_MAX_OVERLAP_STEPS",
    "HIDDEN_SYNC_SHARE",
    "LINK_BUSY_SHARE",
    "LOCAL_SGD_SYNC_SHARE",
    "GroupChoice",
    "SetCosts",
    "SyncRequest",
    "SyncRules",
    "WireRequest",
    "blocking_choice",
    "choose_group",
    "choose_local_steps",
    "group_choices",
    "group_label",
    "smallest_local_steps",
    "streaming_choice",
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
DEFAULT_MAX_OVERLAP_STEPS = 5
"""``--max-overlap-steps``: the most inner steps (tau) an outer sync may travel behind before
it is applied. Streaming DiLoCo (Douillard et al., 2025, section 2.3 and its overlap
ablation) overlaps tau = 1..5 inner steps at little loss; more staleness is untested."""
HIDDEN_SYNC_SHARE = 0.01
"""A set's outer sync counts as hidden when it exposes at most this share of its budget
(1%: a plan within 95% of its bound keeps the rest for compute balance)."""
LINK_BUSY_SHARE = 0.5
"""A hidden outer sync keeps the set's slow link busy at most this share of the inner
steps: headroom for a link that does not sustain its nominal speed."""


class SyncRequest(StrEnum):
    """``hplan solve --sync``: what the planner may choose (module docstring)."""

    AUTO = "auto"
    ALL_REDUCE = "all_reduce"
    LOCAL_SGD = "local_sgd"
    STREAMING = "streaming"
    ASYNC = "async"

    @property
    def mode(self) -> SyncMode:
        """The mode of the local plans searched: ``async`` for ``async``, else ``local_sgd``."""
        return SyncMode.ASYNC if self is SyncRequest.ASYNC else SyncMode.LOCAL_SGD

    @property
    def local(self) -> bool:
        """Whether the request asks for local plans only (not ``auto``, not ``all_reduce``)."""
        return self not in (SyncRequest.AUTO, SyncRequest.ALL_REDUCE)


class WireRequest(StrEnum):
    """``hplan solve --wire``: the pseudo-gradients' wire format, or ``auto`` (chosen per
    holder set, module docstring)."""

    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def formats(self) -> tuple[PseudoGradientDtype, ...]:
        """The formats tried, least compressed first."""
        if self is WireRequest.AUTO:
            return tuple(PseudoGradientDtype)
        return (PseudoGradientDtype(self.value),)


@dataclass(frozen=True, slots=True)
class SyncRules:
    """The sync options of ``hplan solve`` that the choice of each holder set follows."""

    request: SyncRequest = SyncRequest.AUTO
    max_local_steps: int = DEFAULT_MAX_LOCAL_STEPS
    wire: WireRequest = WireRequest.AUTO
    max_overlap_steps: int = DEFAULT_MAX_OVERLAP_STEPS


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


@dataclass(frozen=True, slots=True)
class SetCosts:
    """What the choice of one spanning holder set weighs."""

    transfer_s: dict[PseudoGradientDtype, float]
    """T of one outer sync in each wire format tried."""
    budget_s: float
    """The set's share of the inner step (module docstring)."""
    max_fragments: int
    """Units the set holds."""
    largest_share: float
    """Its largest unit's share of its bytes (a fragment is no smaller)."""
    codec_s: dict[PseudoGradientDtype, float] = field(default_factory=dict)
    """Of T, the host's encode and decode (exposed however the sync overlaps); 0 if absent."""

    def exposed_s(self, group: GroupSync) -> float:
        """Seconds ``group`` leaves exposed per step of the budget (``exposed_outer_s``)."""
        wire = group.wire_dtype
        return exposed_outer_s(
            group.mode,
            group.local_steps,
            group.num_fragments,
            group.overlap_steps,
            self.transfer_s[wire],
            self.budget_s,
            self.largest_share,
            self.codec_s.get(wire, 0.0),
        )


def blocking_choice(mode: SyncMode, costs: SetCosts, max_local_steps: int) -> GroupSync:
    """``local_sgd``'s (and ``async``'s) rule (module docstring)."""
    for wire, transfer_s in costs.transfer_s.items():
        steps = smallest_local_steps(mode, transfer_s, costs.budget_s, max_local_steps)
        if steps is not None:
            return GroupSync(mode=mode, local_steps=steps, wire_dtype=wire)
    wire = min(costs.transfer_s, key=lambda w: costs.transfer_s[w])
    return GroupSync(mode=mode, local_steps=max_local_steps, wire_dtype=wire)


def _overlapped(costs: SetCosts, wire: PseudoGradientDtype, steps: int, tau: int) -> GroupSync:
    """H = ``steps`` overlapping ``tau`` steps in ``wire``, F the fewest fragments whose wire
    time fits behind tau budgets (at most min(H, units held))."""
    wire_s = costs.transfer_s[wire] - costs.codec_s.get(wire, 0.0)
    wanted = math.ceil(wire_s / (tau * costs.budget_s) - _EPS) if tau else 1
    return GroupSync(
        mode=SyncMode.LOCAL_SGD,
        local_steps=steps,
        wire_dtype=wire,
        num_fragments=max(1, min(wanted, steps, costs.max_fragments)),
        overlap_steps=tau,
    )


def streaming_choice(
    costs: SetCosts, max_local_steps: int, max_overlap_steps: int, *, blocking_ok: bool
) -> GroupSync | None:
    """The ``streaming`` rule's choice (with tau = 0 when ``blocking_ok``); None when no
    choice hides the sync (module docstring)."""
    budget = costs.budget_s
    if budget <= 0:
        return None
    for wire, transfer_s in costs.transfer_s.items():
        first = max(1, math.ceil(transfer_s / (LINK_BUSY_SHARE * budget) - _EPS))
        for steps in range(max(first, 1 if blocking_ok else 2), max_local_steps + 1):
            lowest = 0 if blocking_ok else 1
            for tau in range(lowest, min(steps - 1, max_overlap_steps) + 1):
                group = _overlapped(costs, wire, steps, tau)
                if costs.exposed_s(group) <= HIDDEN_SYNC_SHARE * budget * (1 + _EPS):
                    return group
    return None


def least_exposed(costs: SetCosts, max_local_steps: int, max_overlap_steps: int) -> GroupSync:
    """When nothing hides: at H = ``max_local_steps`` with the most overlap allowed, the
    format that exposes least (the less compressed on a tie)."""
    steps = max_local_steps
    tau = min(steps - 1, max_overlap_steps)
    candidates = [_overlapped(costs, wire, steps, tau) for wire in costs.transfer_s]
    return min(candidates, key=costs.exposed_s)


def choose_group(costs: SetCosts, rules: SyncRules) -> GroupSync:
    """One spanning holder set's sync under ``rules`` (module docstring)."""
    h, tau_max = rules.max_local_steps, rules.max_overlap_steps
    if rules.request in (SyncRequest.LOCAL_SGD, SyncRequest.ASYNC):
        return blocking_choice(rules.request.mode, costs, h)
    hidden = streaming_choice(
        costs, h, tau_max, blocking_ok=rules.request is SyncRequest.AUTO
    ) or least_exposed(costs, h, tau_max)
    if rules.request is SyncRequest.STREAMING:
        return hidden
    today = blocking_choice(SyncMode.LOCAL_SGD, costs, h)
    if costs.exposed_s(hidden) < costs.exposed_s(today) - _EPS:
        return hidden
    return today


def choose_local_steps(problem: PlanningProblem, layout: Layout, rules: SyncRules) -> Layout:
    """``layout`` (islands and a local mode in ``layout.sync``) with each spanning holder
    set's H, wire format, fragments and overlap chosen by the rules of the module
    docstring. The defaults of ``IslandSync`` take the choice of the set with the most
    bytes; ``IslandSync.groups`` lists the sets that differ."""
    sync = layout.sync
    assert sync is not None and sync.local, "choose_local_steps needs a local layout"
    base = IslandSync(islands=sync.islands, mode=rules.request.mode)
    trial = replace(layout, sync=base)
    inner_s = evaluate(problem, trial).inner_step_time_s
    spanning = outer_sync_groups(problem, trial)
    if not spanning:
        return trial
    links = {g: outer_link(problem, base, g) for g in spanning}
    weights = link_weights(tuple(spanning))
    units = set_unit_bytes(problem, trial)
    chosen = {}
    for group, num_bytes in spanning.items():
        held = units.get(group, ())
        costs = SetCosts(
            transfer_s={
                w: outer_transfer_time_s(w, num_bytes, links[group]) for w in rules.wire.formats
            },
            budget_s=inner_s * weights[group],
            max_fragments=max(1, len(held)),
            largest_share=largest_unit_share(held),
            codec_s={
                w: outer_codec_time_s(w, num_bytes, len(links[group].island_links))
                for w in rules.wire.formats
            },
        )
        chosen[group] = choose_group(costs, rules)
    main = max(spanning, key=lambda g: (spanning[g], g))
    default = chosen[main]
    island_sync = IslandSync(
        islands=sync.islands,
        mode=default.mode,
        local_steps=default.local_steps,
        wire_dtype=default.wire_dtype,
        num_fragments=default.num_fragments,
        overlap_steps=default.overlap_steps,
    ).with_groups({g: c for g, c in chosen.items() if c != default})
    return replace(layout, sync=island_sync)


def link_weights(groups: Sequence[tuple[int, ...]]) -> dict[tuple[int, ...], float]:
    """Each set's share of its busiest member's link: 1 / the number of sets on it (1 for a
    set alone on its devices). Equal shares, not shares by bytes: a set on a slower link
    then takes a larger H or a smaller format rather than every set of a device one H."""
    per_device: dict[int, int] = {}
    for group in groups:
        for d in group:
            per_device[d] = per_device.get(d, 0) + 1
    return {group: min(1 / per_device[d] for d in group) for group in groups}


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
def group_label(group: GroupSync) -> str:
    """``local_sgd H=12`` and, where not the defaults, ``F=4``, ``overlap=2``, the wire."""
    words = [f"{group.mode.value} H={group.local_steps}"]
    if group.num_fragments > 1:
        words.append(f"F={group.num_fragments}")
    if group.overlap_steps:
        words.append(f"overlap={group.overlap_steps}")
    label = " ".join(words)
    if group.wire_dtype is not PseudoGradientDtype.FLOAT32:
        label += f", {group.wire_dtype.value}"
    return label


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
    """One outer sync of its pseudo-gradients (T, in its wire format)."""
    exposed_time_per_step_s: float
    """What its outer sync leaves exposed per inner step (``sync_cost.exposed_outer_s``)."""
    reason: str
    sync: GroupSync | None = None
    """Its H, wire format, fragments and overlap."""


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
    costs = outer_costs_s(problem, layout, inner_s)
    units = set_unit_bytes(problem, layout)
    synchronous = evaluate(problem, replace(layout, sync=None)).step_time_s - inner_s
    every_step = {g: _every_step_ring_s(problem, g, b) for g, b in spanning.items()}
    total_ring = sum(every_step.values())
    out = []
    for group in sorted(spanning):
        added = max(0.0, synchronous) * every_step[group] / total_ring if total_ring > 0 else 0.0
        islands = " | ".join(dict.fromkeys(names[island_of[d]] for d in group))
        how = sync.of(group)
        head = (
            f"{_head(how)}: an all-reduce of {format_bytes(spanning[group])} over "
            f"{format_link_speed(slowest_link(problem, group)[0])} would add "
            f"{format_seconds(added)} to each {format_seconds(inner_s)} step"
        )
        codec_s = outer_codec_time_s(
            how.wire_dtype, spanning[group], len(outer_link(problem, sync, group).island_links)
        )
        largest_s = (rings[group] - codec_s) * max(
            1 / how.num_fragments, largest_unit_share(units.get(group, ()))
        )
        tail = _tail(how, rings[group], costs[group][0], inner_s, max_local_steps)
        if how.overlap_steps and how.mode is SyncMode.LOCAL_SGD:
            tail = _streaming_tail(how, rings[group], largest_s, codec_s, costs[group][0], inner_s)
        out.append(
            GroupChoice(
                devices=group,
                mode=how.mode,
                local_steps=how.local_steps,
                all_reduce_time_s=added,
                outer_sync_time_s=rings[group],
                exposed_time_per_step_s=costs[group][0],
                reason=f"islands {islands}: {head}; {tail}",
                sync=how,
            )
        )
    return tuple(out)


def _every_step_ring_s(problem: PlanningProblem, group: tuple[int, ...], num_bytes: float) -> float:
    bandwidth, latency = slowest_link(problem, group)
    return bucket_rings_s(len(group), num_bytes, bandwidth, latency)[0]


def _head(how: GroupSync) -> str:
    head = f"{how.mode.value}, H = {how.local_steps}"
    if how.overlap_steps:
        head += (
            f", {count(how.num_fragments, 'fragment')} each overlapping "
            f"{count(how.overlap_steps, 'step')}"
        )
    return head


def _streaming_tail(
    how: GroupSync,
    transfer_s: float,
    largest_s: float,
    codec_s: float,
    exposed_s: float,
    inner_s: float,
) -> str:
    wire = "" if how.wire_dtype is PseudoGradientDtype.FLOAT32 else f" in {how.wire_dtype.value}"
    codec = f" ({format_seconds(codec_s)} of it encoding on the host)" if codec_s > 0 else ""
    tail = (
        f"one outer sync{wire} takes {format_seconds(transfer_s)}{codec}, its largest "
        f"fragment {format_seconds(largest_s)} behind {count(how.overlap_steps, 'step')} "
        f"({format_seconds(how.overlap_steps * inner_s)})"
    )
    if exposed_s <= 0:
        return tail + ": hidden"
    exposed = f": {format_seconds(exposed_s)} of each step is exposed"
    if exposed_s <= HIDDEN_SYNC_SHARE * inner_s * (1 + _EPS):
        return tail + exposed + f" (under {percent(HIDDEN_SYNC_SHARE)}: counted as hidden)"
    return tail + exposed


def _tail(
    how: GroupSync, transfer_s: float, exposed_s: float, inner_s: float, max_local_steps: int
) -> str:
    h = how.local_steps
    wire = "" if how.wire_dtype is PseudoGradientDtype.FLOAT32 else f" in {how.wire_dtype.value}"
    span_s = h * inner_s
    if how.mode is SyncMode.ASYNC:
        tail = (
            f"one outer sync{wire} takes {format_seconds(transfer_s)} and travels behind "
            f"{count(h, 'step')} ({format_seconds(span_s)})"
        )
        met = transfer_s <= LOCAL_SGD_SYNC_SHARE * span_s * (1 + _EPS)
    else:
        share = transfer_s / span_s if span_s > 0 else 0.0
        tail = (
            f"one outer sync{wire} takes {format_seconds(transfer_s)}, {percent(share)} of "
            f"{count(h, 'step')}"
        )
        met = share <= LOCAL_SGD_SYNC_SHARE * (1 + _EPS)
    if met:
        return tail
    cost = (
        f"{format_seconds(exposed_s)} of each step is exposed"
        if exposed_s > 0
        else "the sync still hides behind the round"
    )
    return tail + f"; H is capped at --max-local-steps {max_local_steps}: {cost}"
