"""The strategy space as data, and the generate step: which layouts the solver considers.

A :class:`Family` fixes how the ranks may use each memory strategy (a ``Policy`` each for
recomputation, ZeRO shards and optimizer offload) and its tensor-parallel grouping: a TP
family's devices are TP groups of one degree (``cost.tensor_parallel``), generated under
``--tensor-parallel auto`` for the NVLink groups of each degree the model allows, and for
groups of GeForce cards over PCIe only where the request's family has no layout or leaves
idle a device the model does not fit (nothing else fits); under ``always`` for groups of any
node's cards, and only TP families are chosen from. TP families run without ZeRO, offload or
local sync (the runtime does not combine them with TP). The request's own family (``mixed``:
each ``auto`` is chosen per rank) is always generated; when memory shaped its best layouts,
so is each uniform family the request allows (:data:`UNIFORM_FAMILIES`), whose stage-order
heuristics can find layouts the mixed search misses. A family's layouts come from its
generators, in order (:data:`GENERATORS`), each gated on what the layouts before it show.
Every layout is tagged with its family and its pool (synchronous or local), so the later
steps compare like with like.

All of it runs in one child process under one deadline (``watchdog``), searches that two
families share run once, and each search gets a share of the time left: ``--time-limit``
bounds the whole solve however many families and generators run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from hplan.planner.cost.evaluate import Evaluation, evaluate
from hplan.planner.cost.even_microbatches import even_microbatches
from hplan.planner.cost.layout import Layout
from hplan.planner.cost.offload import can_offload, offload_flags, offload_problem
from hplan.planner.cost.problem import PlanningProblem, Policy
from hplan.planner.cost.tensor_parallel import allowed_degrees, grouped_problem, tp_groups
from hplan.planner.cost.zero import shard_weights, sharded_problem
from hplan.planner.solve.baselines import data_parallel_equal, uniform_pipeline
from hplan.planner.solve.search import (
    Candidate,
    SearchOutcome,
    SolveOptions,
    search,
    without_flat_copies,
)
from hplan.planner.solve.sync_choice import SyncRequest
from hplan.planner.solve.validate import layout_problems
from hplan.planner.solve.watchdog import KILL_GRACE_S, run_with_deadline
from hplan.runtime.contract.errors import ConfigError, InfeasiblePlanError

__all__ = [
    "GENERATORS",
    "UNIFORM_FAMILIES",
    "Family",
    "Found",
    "Generated",
    "GeneratorRun",
    "Pool",
    "Ranked",
    "families",
    "generate",
    "rank_layouts",
    "requested_only",
    "uniform_strategies",
]


class Pool(StrEnum):
    """Which layouts a candidate is compared with: synchronous ones (every holder set sums
    its gradients every step), or local ones (islands that sync by local SGD or async),
    which ``sync_choice`` weighs against the synchronous best."""

    SYNCHRONOUS = "synchronous"
    LOCAL = "local"


@dataclass(frozen=True)
class Family:
    """One point of the strategy space: how the ranks may use each memory strategy, and
    which TP groups are its devices."""

    name: str
    recompute: Policy
    zero: Policy
    offload: Policy
    tp_groups: tuple[tuple[int, ...], ...] = ()
    """The family's devices (device indices of the solve's problem, in device order): its
    TP groups of one degree and every other card alone at degree 1; empty: single cards."""
    tp_over_pcie: bool = False
    """Its groups are GeForce cards over PCIe (chosen only where nothing else fits)."""
    grouped: PlanningProblem | None = field(default=None, compare=False, repr=False)
    """The problem of its TP groups (``tensor_parallel.grouped_problem``), made once."""

    @property
    def tp_degree(self) -> int:
        """The degree of its TP groups (1: none); its other cards run at degree 1."""
        return max((len(g) for g in self.tp_groups), default=1)

    def problem(self, problem: PlanningProblem) -> PlanningProblem:
        """``problem`` under this family's recompute policy (its TP groups' problem for a
        TP family)."""
        if self.grouped is not None:
            problem = replace(self.grouped, schedule=problem.schedule)
        return (
            problem
            if problem.recompute is self.recompute
            else replace(problem, recompute=self.recompute)
        )

    def options(self, options: SolveOptions) -> SolveOptions:
        """``options`` under this family's ZeRO and offload policies (a TP family syncs
        every step)."""
        if self.tp_groups:
            return replace(
                options, zero=self.zero, offload=self.offload, sync=SyncRequest.ALL_REDUCE
            )
        return replace(options, zero=self.zero, offload=self.offload)

    def uses_group(self, layout: Layout) -> bool:
        """Whether ``layout`` (of :meth:`problem`) puts a stage on one of its TP groups."""
        grouped = self.grouped
        return grouped is not None and any(grouped.degree(d) > 1 for d in layout.device_indices)

    @property
    def uses_auto(self) -> bool:
        """Whether any of its policies lets the solver choose per rank."""
        return Policy.AUTO in (self.recompute, self.zero, self.offload)


MIXED = "mixed"
"""The request's own family."""

UNIFORM_FAMILIES: tuple[Family, ...] = (
    Family("plain", Policy.NEVER, Policy.NEVER, Policy.NEVER),
    Family("recompute", Policy.ALWAYS, Policy.NEVER, Policy.NEVER),
    Family("zero-1", Policy.NEVER, Policy.ALWAYS, Policy.NEVER),
    Family("offload", Policy.NEVER, Policy.NEVER, Policy.ALWAYS),
)
"""Every rank the same (``bench/plan_quality.py --compare memory`` compares them with the
mixed choice)."""


def families(problem: PlanningProblem, options: SolveOptions) -> tuple[Family, ...]:
    """The request's family first, then each uniform family it allows: one whose every
    policy equals the request's or meets an ``auto`` there, not the request's own, and not
    ``offload`` where no device can offload (a ``cpu`` device's memory is the host's); then
    the TP families (:func:`tp_families`)."""
    return (*_memory_families(problem, options), *tp_families(problem, options))


def tp_families(problem: PlanningProblem, options: SolveOptions) -> tuple[Family, ...]:
    """For each degree the model allows (``--tensor-parallel`` auto or always): the family
    of the NVLink groups (``tp4``), and the one of GeForce groups over PCIe (``tp4-pcie``,
    run only where nothing else fits); under ``always`` also the groups of any node's
    cards (``tp4-any``) where no NVLink family has them all. Each family's devices are its
    groups and every other card at degree 1 (:func:`with_single_cards`), so a pipeline may
    put a tp4 stage beside tp1 stages. Recompute as requested; no ZeRO, no offload."""
    tp = problem.tensor_parallel
    if tp is None or options.tensor_parallel is Policy.NEVER:
        return ()
    found: list[Family] = []
    for degree in allowed_degrees(tp):
        kinds = [
            (f"tp{degree}", tp_groups(problem, degree, nvlink_only=True), False),
            (f"tp{degree}-pcie", _pcie_groups(problem, degree), True),
        ]
        if options.tensor_parallel is Policy.ALWAYS:
            kinds.append((f"tp{degree}-any", tp_groups(problem, degree, nvlink_only=False), False))
        seen: set[tuple[tuple[int, ...], ...]] = set()
        for name, groups, pcie in kinds:
            if not groups or groups in seen:
                continue
            seen.add(groups)
            devices = with_single_cards(problem, groups)
            grouped = grouped_problem(problem, devices)
            found.append(
                Family(name, problem.recompute, Policy.NEVER, Policy.NEVER, devices, pcie, grouped)
            )
    return tuple(found)


def with_single_cards(
    problem: PlanningProblem, groups: tuple[tuple[int, ...], ...]
) -> tuple[tuple[int, ...], ...]:
    """``groups`` and every card of ``problem`` in none of them (alone, at degree 1), sorted
    by their first card: a mixed-degree family's devices (a node's tp4 group beside the
    other nodes' cards in one pipeline)."""
    grouped = {d for g in groups for d in g}
    singles = tuple((d,) for d in range(problem.num_devices) if d not in grouped)
    return tuple(sorted((*groups, *singles)))


def _pcie_groups(problem: PlanningProblem, degree: int) -> tuple[tuple[int, ...], ...]:
    """Groups of GeForce cards of one node that NVLink does not join (all of them)."""
    nvlinked = {d for g in tp_groups(problem, degree, nvlink_only=True) for d in g}
    groups = tp_groups(problem, degree, nvlink_only=False, consumer_only=True)
    return tuple(g for g in groups if not set(g) & nvlinked)


def _memory_families(problem: PlanningProblem, options: SolveOptions) -> tuple[Family, ...]:
    """The request's family, then the uniform ones it allows (:func:`families`)."""
    mixed = Family(MIXED, problem.recompute, options.zero, options.offload)
    found = [mixed]
    request = (mixed.recompute, mixed.zero, mixed.offload)
    for family in UNIFORM_FAMILIES:
        uniform = (family.recompute, family.zero, family.offload)
        allowed = all(r in (u, Policy.AUTO) for r, u in zip(request, uniform, strict=True))
        if uniform == request or not allowed:
            continue
        if family.offload is Policy.ALWAYS and not _any_can_offload(problem):
            continue
        found.append(family)
    return tuple(found)


def uniform_strategies(
    problem: PlanningProblem, options: SolveOptions
) -> list[tuple[str, PlanningProblem, SolveOptions]]:
    """The uniform families :func:`families` allows, as (name, problem, options) to solve."""
    return [
        (family.name, family.problem(problem), family.options(options))
        for family in _memory_families(problem, options)[1:]
    ]


# --------------------------------------------------------------------------- candidates
@dataclass(frozen=True)
class Found:
    """A layout one generator of one family found."""

    family: str
    pool: Pool
    generator: str
    """Which generator found it (:data:`GENERATORS`)."""
    segment: int
    """Layouts of one segment are ranked together (the search's and the baselines'), the
    segments of a pool then merged by step time (ZeRO's, offload's)."""
    candidate: Candidate
    """The layout, the scenario that found it and what the search proved about it."""

    @property
    def layout(self) -> Layout:
        return self.candidate.layout

    @property
    def source(self) -> str:
        return self.candidate.scenario


@dataclass(frozen=True)
class GeneratorRun:
    """What one generator of one family did (``--dump-passes`` shows these)."""

    family: str
    generator: str
    num_found: int
    time_s: float
    skipped: str = ""
    """Why it did not run (its gate stayed shut); empty when it ran."""


@dataclass(frozen=True)
class Generated:
    """The generate step's result: every candidate of every family, and how they came."""

    families: tuple[Family, ...]
    """The families generated, the request's first."""
    found: tuple[Found, ...]
    outcomes: dict[str, SearchOutcome]
    """Each family's own search (its status and gap come from it), by family name."""
    runs: tuple[GeneratorRun, ...]
    deadline_s: float
    """``time.monotonic()`` by which the whole solve must end (``--time-limit``)."""
    bound_samples_per_s: float | None = None
    notes: tuple[str, ...] = ()
    cut_short: bool = False
    """Whether a search stopped at its share of the time limit before it had looked at
    every pipeline shape (what it did not find may exist)."""

    def family(self, name: str) -> Family:
        return next(f for f in self.families if f.name == name)

    def verify(self) -> None:
        """Every candidate belongs to a generated family; the request's family comes first."""
        names = {f.name for f in self.families}
        if not self.families or self.families[0].name != MIXED:
            raise ValueError("the request's own family must come first")
        strays = {f.family for f in self.found} - names
        if strays:
            raise ValueError(f"candidates of families {sorted(strays)} that were not generated")


# --------------------------------------------------------------------------- ranking
@dataclass(frozen=True)
class Ranked:
    """A candidate re-costed by the exact evaluator, its shares cut into equal micro-batches
    (``even_microbatches``); ``problems`` is what the independent validator rejects."""

    found: Found
    layout: Layout
    evaluation: Evaluation
    problems: tuple[str, ...] = ()

    @property
    def source(self) -> str:
        return self.found.source

    @property
    def valid(self) -> bool:
        return not self.problems


def evaluated(
    problem: PlanningProblem, found: Sequence[Found], deadline_s: float | None = None
) -> list[Ranked]:
    """Each layout's shares cut into equal micro-batches (``even_microbatches``), re-costed
    by the exact evaluator; each segment's distinct layouts, then every segment merged
    fastest first (stable: a tie keeps the order found; a layout found twice in a segment
    keeps its first source). Past ``deadline_s`` (``time.monotonic()``) a segment that has
    one layout takes no more."""
    by_segment: dict[int, list[Ranked]] = {}
    seen: set[tuple[int, Layout]] = set()
    for item in sorted(found, key=lambda f: _TIE_ORDER.index(f.generator)):
        late = deadline_s is not None and time.monotonic() >= deadline_s
        if late and item.segment in by_segment:
            continue
        layout = even_microbatches(problem, item.layout)
        if (item.segment, layout) in seen:
            continue
        seen.add((item.segment, layout))
        by_segment.setdefault(item.segment, []).append(
            Ranked(item, layout, evaluate(problem, layout))
        )
    merged = [r for segment in sorted(by_segment) for r in _fastest_first(by_segment[segment])]
    return _fastest_first(merged)


def validated(problem: PlanningProblem, ranked: Sequence[Ranked]) -> list[Ranked]:
    """``ranked`` with the independent validator's verdict on each (``Ranked.problems``)."""
    return [replace(r, problems=tuple(layout_problems(problem, r.layout))) for r in ranked]


def rank_layouts(problem: PlanningProblem, found: Sequence[Found]) -> list[Ranked]:
    """:func:`evaluated`, then :func:`validated`: what the gates look at."""
    return validated(problem, evaluated(problem, found))


def _fastest_first(ranked: Sequence[Ranked]) -> list[Ranked]:
    return sorted(ranked, key=lambda r: r.evaluation.step_time_s)


def valid_only(ranked: Sequence[Ranked]) -> list[Ranked]:
    return [r for r in ranked if r.valid]


def family_pool(family: Family, found: Sequence[Found], pool: Pool) -> list[Found]:
    """What ``family`` compares in ``pool``: all its layouts there, except that a policy of
    ``always`` keeps only its own strategy's (``--zero always``: the sharded layouts;
    ``--offload always``: the offloading ones, and no local plans under either)."""
    mine = [f for f in found if f.family == family.name and f.pool is pool]
    only = "offload" if family.offload is Policy.ALWAYS else ""
    only = only or ("zero" if family.zero is Policy.ALWAYS else "")
    if not only:
        return mine
    return [f for f in mine if f.generator == only] if pool is Pool.SYNCHRONOUS else []


# --------------------------------------------------------------------------- gates
MEMORY_BINDS_SHARE = 0.8
"""A stage filling more than this share of its device's usable memory counts as bound by
memory (:func:`memory_binds`)."""


def memory_binds(problem: PlanningProblem, ranked: Sequence[Ranked]) -> bool:
    """Whether memory may bind the fastest valid layout found, so that ZeRO's shards may
    help: none was found, it leaves idle a device the whole model does not fit
    (:func:`_idle_for_memory`) or gives such a device part of the model
    (:func:`_split_for_memory`: with shards it might hold a whole replica), a stage
    recomputes (some or all of its units), or a stage fills more than
    :data:`MEMORY_BINDS_SHARE` of its device, unless it is a replica of one stage that runs
    its whole share as one micro-batch (memory did not cut its micro-batch, and shards
    would only add their all-gather)."""
    valid = valid_only(ranked)
    if not valid:
        return True
    layout, evaluation = valid[0].layout, valid[0].evaluation
    full = any(
        c.memory_bytes > MEMORY_BINDS_SHARE * float(problem.memory_capacity_bytes[c.device_idx])
        for replica, costs in zip(layout.replicas, evaluation.stages, strict=True)
        if len(replica.stages) > 1 or replica.num_microbatches > 1
        for c in costs
    )
    recomputes = any(s.recomputed_units for r in layout.replicas for s in r.stages)
    return (
        full
        or recomputes
        or _idle_for_memory(problem, layout)
        or _split_for_memory(problem, layout)
    )


def nothing_cheaper_fits(problem: PlanningProblem, ranked: Sequence[Ranked]) -> bool:
    """Whether offload may help (``--offload auto``): no valid layout was found, or the
    fastest leaves idle a device the whole model does not fit (:func:`_idle_for_memory`)."""
    valid = valid_only(ranked)
    return not valid or _idle_for_memory(problem, valid[0].layout)


def memory_shaped(problem: PlanningProblem, layout: Layout, evaluation: Evaluation) -> bool:
    """Whether memory may have shaped ``layout``: a stage recomputes (some or all of its
    units), it shards or offloads optimizer state, or a stage fills more than
    :data:`MEMORY_BINDS_SHARE` of its device (the searches of the mixed and the uniform
    families then take different paths; on a cluster with room to spare they are the same
    search)."""
    recomputes = any(s.recompute or s.recompute_units for r in layout.replicas for s in r.stages)
    strategy = recomputes or bool(layout.optimizer_shard_weights) or any(layout.optimizer_offload)
    full = any(
        c.memory_bytes > MEMORY_BINDS_SHARE * float(problem.memory_capacity_bytes[c.device_idx])
        for costs in evaluation.stages
        for c in costs
    )
    return strategy or full


def _whole_model_bytes(problem: PlanningProblem, device_idx: int) -> float:
    """Parameters, gradients and optimizer state of the whole model and one micro-batch of
    the smallest size's activations, per card of ``device_idx`` (a tied parameter counts in
    each unit that uses it, so this errs towards "does not fit")."""
    return float(problem.static_bytes_on(device_idx).sum()) + float(
        problem.activation_bytes_on(device_idx).sum()
    ) * min(problem.micro_batch_sizes)


def _split_for_memory(problem: PlanningProblem, layout: Layout) -> bool:
    """Whether ``layout`` gives a device that cannot hold the whole model
    (:func:`_whole_model_bytes`) a stage of part of it: memory may be why that device is a
    pipeline stage rather than a replica."""
    return any(
        len(replica.stages) > 1
        and _whole_model_bytes(problem, stage.device_idx)
        > float(problem.memory_capacity_bytes[stage.device_idx])
        for replica in layout.replicas
        for stage in replica.stages
    )


def _idle_for_memory(problem: PlanningProblem, layout: Layout) -> bool:
    """Whether ``layout`` leaves idle a device that cannot hold the whole model
    (:func:`_whole_model_bytes`): memory may be why it is idle. A device that could hold it
    is idle for speed (its links, its launch overhead), which no memory strategy changes."""
    used = set(layout.device_indices)
    return any(
        _whole_model_bytes(problem, d) > float(problem.memory_capacity_bytes[d])
        for d in range(problem.num_devices)
        if d not in used
    )


def _any_can_offload(problem: PlanningProblem) -> bool:
    return any(can_offload(problem, d) for d in range(problem.num_devices))


# --------------------------------------------------------------------------- generators
SIMULATED_CANDIDATES = 5
"""How many of a pool's best distinct layouts the simulator re-times (and the uniform gate
looks at)."""

FIRST_SEARCH_SHARE = 0.8
"""The request's own search gets this share of the time left when other searches may follow
it (ZeRO, offload, the uniform families); each later one gets :data:`LATER_SEARCH_SHARE` of
what is left then (what none of them uses goes to the steps after generation)."""
LATER_SEARCH_SHARE = 0.5


@dataclass
class _Run:
    """The generate step inside its child process: the searches so far and the reporting."""

    problem: PlanningProblem
    options: SolveOptions
    deadline_s: float
    report: Callable[[object], None]
    first_share: float
    """The share of the time left the first search gets (:data:`FIRST_SEARCH_SHARE`, or all
    of it when nothing may follow)."""
    searches: dict[tuple[object, ...], SearchOutcome | None] = field(default_factory=dict)
    found: list[Found] = field(default_factory=list)
    tp_families: tuple[Family, ...] = ()
    """The run's TP families (:func:`tp_families`)."""

    def share_deadline(self) -> float:
        """The deadline of the next search: its share of the time left."""
        share = LATER_SEARCH_SHARE if self.searches else self.first_share
        return time.monotonic() + share * max(self.deadline_s - time.monotonic(), 0.0)

    def variant_search(self, kind: str) -> VariantSearch:
        """A synchronous search of a problem variant (ZeRO's, offload's), each variant once
        whichever family asks; the first ask of a kind takes its share of the time left,
        split between that kind's variants (ZeRO's two stages)."""
        deadline_s: list[float] = []

        def run_search(variant: PlanningProblem, key: str, parts_left: int) -> list[Candidate]:
            memo = (kind, key, variant.recompute, SyncRequest.ALL_REDUCE)
            if memo in self.searches:
                outcome = self.searches[memo]
                return [] if outcome is None else outcome.candidates
            if not deadline_s:
                deadline_s.append(self.share_deadline())
            part_s = max(deadline_s[0] - time.monotonic(), 0.0) / max(parts_left, 1)
            items: list[object] = []
            options = replace(self.options, sync=SyncRequest.ALL_REDUCE)
            try:
                search(variant, options, time.monotonic() + part_s, items.append)
            except InfeasiblePlanError:
                self.searches[memo] = None
                return []
            candidates = [i for i in items if isinstance(i, Candidate)]
            self.searches[memo] = SearchOutcome(candidates=candidates)
            self.report_cut_short(items)
            return candidates

        return run_search

    def report_cut_short(self, items: Sequence[object]) -> None:
        """Report :class:`_CutShort` when a search's outcome says time cut it short."""
        outcome = next((i for i in reversed(items) if isinstance(i, SearchOutcome)), None)
        if outcome is not None and not outcome.complete:
            self.report(_CutShort())

    def keep(self, family: Family, generator: str, segment: int, candidate: Candidate) -> None:
        if family.grouped is not None and not family.uses_group(candidate.layout):
            return  # single cards alone: the families without TP have that layout
        pool = Pool.LOCAL if candidate.layout.sync is not None else Pool.SYNCHRONOUS
        item = Found(family.name, pool, generator, segment, candidate)
        self.found.append(item)
        self.report(item)

    def ranked(self, family: Family, pool: Pool) -> list[Ranked]:
        """The family's pool so far, ranked (:func:`rank_layouts`, :func:`family_pool`)."""
        found = family_pool(family, self.found, pool)
        return rank_layouts(family.problem(self.problem), found)


Generator = Callable[[_Run, Family], None]
VariantSearch = Callable[[PlanningProblem, str, int], list[Candidate]]
"""Searches a problem variant (named by a key, with the variants of its kind still to go)
and gives its synchronous candidates (:meth:`_Run.variant_search`)."""
"""Adds a family's layouts to the run (:meth:`_Run.keep`)."""


def _searched(
    run: _Run,
    problem: PlanningProblem,
    options: SolveOptions,
    on_candidate: Callable[[Candidate], None],
) -> SearchOutcome | None:
    """``search`` of ``problem`` under ``options``, each candidate passed to ``on_candidate``
    as it is found; once per problem and options (a second family asking for it gets the
    first's candidates and outcome). None when nothing fits."""
    key = ("search", problem.recompute, options.sync, problem.tp_members)
    if key in run.searches:
        outcome = run.searches[key]
        for candidate in outcome.candidates if outcome is not None else ():
            on_candidate(candidate)
        return outcome
    items: list[object] = []

    def found(item: object) -> None:
        items.append(item)
        if isinstance(item, Candidate):
            on_candidate(item)

    deadline_s = run.share_deadline()
    try:
        search(problem, options, deadline_s, found)
    except InfeasiblePlanError:
        outcome = None
    else:
        outcome = next(i for i in reversed(items) if isinstance(i, SearchOutcome))
        outcome.candidates = [i for i in items if isinstance(i, Candidate)]
        run.report_cut_short(items)
    run.searches[key] = outcome
    return outcome


def search_generator(run: _Run, family: Family) -> None:
    """The search over pipelines, splits and shares (``search``): single nodes, the whole
    cluster and, where the sync request allows, the local plans of islands."""
    problem = family.problem(run.problem)
    options = family.options(run.options) if family.tp_groups else run.options
    outcome = _searched(run, problem, options, lambda c: run.keep(family, "search", 0, c))
    run.report(_FamilyOutcome(family.name, outcome))


def baselines_generator(run: _Run, family: Family) -> None:
    """What other tools would run (``baselines``), under the family's recompute policy."""
    problem = family.problem(run.problem)
    for name, layout in (
        ("data parallel", data_parallel_equal(problem)),
        ("uniform pipeline", uniform_pipeline(problem)),
    ):
        if layout is None or any(r.num_stages > run.options.max_stages for r in layout.replicas):
            continue
        layout = with_recompute_policy(problem, layout)
        candidate = Candidate(layout, f"baseline: {name}", 0.0, 0.0, False, main=False)
        run.keep(family, "baselines", 0, candidate)


def zero_generator(run: _Run, family: Family) -> None:
    """Layouts that fit with ZeRO's uneven shards (:func:`sharded_candidates`)."""
    problem = family.problem(run.problem)
    for candidate in sharded_candidates(problem, run.options, run.variant_search("zero")):
        run.keep(family, "zero", 1, candidate)


def offload_generator(run: _Run, family: Family) -> None:
    """Layouts that fit with optimizer-state offload (:func:`offload_candidates`)."""
    problem = family.problem(run.problem)
    options = family.options(run.options)
    for candidate in offload_candidates(problem, options, run.variant_search("offload")):
        run.keep(family, "offload", 2, candidate)


def unshared_generator(run: _Run, family: Family) -> None:
    """Layouts that fit only without the flat gradient copies every unit's static memory
    counts (``search.without_flat_copies``; a unit no other device sums every step needs
    none, ``evaluate.unsummed_flat_copy_bytes``), kept where the exact evaluator says they
    fit."""
    problem = family.problem(run.problem)
    search_variant = run.variant_search("unshared")
    for candidate in search_variant(without_flat_copies(problem), "no flat copies", 1):
        if not layout_problems(problem, candidate.layout):
            run.keep(family, "unshared", 3, candidate)


def _unshared_gate(run: _Run, family: Family) -> str:
    """Why the generator of layouts without flat copies does not run (empty: it runs)."""
    if family.tp_groups:
        return "a TP family's cards keep their flat copies counted"
    if memory_binds(run.problem, run.ranked(family, Pool.SYNCHRONOUS)):
        return ""
    return "memory does not bind the best layout"


def _zero_gate(run: _Run, family: Family) -> str:
    """Why the ZeRO generator does not run (empty: it runs)."""
    return _policy_gate(
        family.zero,
        "--zero never",
        lambda: memory_binds(run.problem, run.ranked(family, Pool.SYNCHRONOUS)),
        "memory does not bind the best layout",
    )


def _offload_gate(run: _Run, family: Family) -> str:
    """Why the offload generator does not run (empty: it runs)."""
    return _policy_gate(
        family.offload,
        "--offload never",
        lambda: nothing_cheaper_fits(run.problem, run.ranked(family, Pool.SYNCHRONOUS)),
        "a layout without offload uses every device that could need it",
    )


def _policy_gate(policy: Policy, never: str, pays: Callable[[], bool], why_not: str) -> str:
    """A strategy's gate: shut under ``never``, open under ``always``, and under ``auto``
    open where ``pays()`` says it may (``why_not`` otherwise)."""
    if policy is Policy.NEVER:
        return never
    if policy is Policy.ALWAYS or pays():
        return ""
    return why_not


def _open(run: _Run, family: Family) -> str:
    return ""


GENERATORS: tuple[tuple[str, Generator, Callable[[_Run, Family], str]], ...] = (
    ("baselines", baselines_generator, _open),
    ("search", search_generator, _open),
    ("zero", zero_generator, _zero_gate),
    ("offload", offload_generator, _offload_gate),
    ("unshared", unshared_generator, _unshared_gate),
)
"""Each family's generators, in the order they run: (name, generator, gate: why it does
not run, empty when it does). The baselines come first: they take no search, so a search
stopped at the deadline still leaves them. Under a policy of ``always`` the family compares
only what that strategy's generator finds (:func:`family_pool`); the search still gives
its status and gap."""

_TIE_ORDER = ("search", "baselines", "zero", "offload", "unshared")
"""Between layouts of equal step time the search's comes first, then a baseline's."""


def _generate_family(run: _Run, family: Family) -> None:
    for name, generator, gate in GENERATORS:
        started_s = time.monotonic()
        if time.monotonic() >= run.deadline_s:
            run.report(GeneratorRun(family.name, name, 0, 0.0, "the time limit was reached"))
            continue
        why = gate(run, family)
        if why:
            run.report(GeneratorRun(family.name, name, 0, 0.0, why))
            continue
        before = len(run.found)
        generator(run, family)
        run.report(
            GeneratorRun(family.name, name, len(run.found) - before, time.monotonic() - started_s)
        )


def _uniform_gate(run: _Run, mixed: Family) -> bool:
    """Whether the uniform families run: memory may have shaped one of the mixed family's
    best layouts (the :data:`SIMULATED_CANDIDATES` best of each pool, any of which the
    simulator may choose; :func:`memory_shaped`)."""
    for pool in Pool:
        ranked = valid_only(run.ranked(mixed, pool))
        if any(
            memory_shaped(run.problem, r.layout, r.evaluation)
            for r in ranked[:SIMULATED_CANDIDATES]
        ):
            return True
    return False


def _generate_all(
    problem: PlanningProblem,
    options: SolveOptions,
    deadline_s: float,
    report: Callable[[object], None],
) -> None:
    """The generate step in the child process: the request's family, then the uniform ones
    when memory shaped its best layouts; every item goes to ``report`` as it is made."""
    ordered = _memory_families(problem, options)
    mixed, uniform = ordered[0], ordered[1:]
    tensor_parallel = tp_families(problem, options)
    may_follow = (
        bool(uniform) or bool(tensor_parallel) or Policy.NEVER not in (mixed.zero, mixed.offload)
    )
    share = FIRST_SEARCH_SHARE if may_follow else 1.0
    run = _Run(problem, options, deadline_s, report, share, tp_families=tensor_parallel)
    _generate_family(run, mixed)
    if uniform and _uniform_gate(run, mixed):
        for family in uniform:
            _generate_family(run, family)
    for family in sorted(tensor_parallel, key=lambda f: f.tp_over_pcie):  # NVLink first
        why = _tp_gate(run, mixed, family)
        if why:
            run.report(GeneratorRun(family.name, "search", 0, 0.0, why))
            continue
        _generate_family(run, family)


TP_PCIE_GATE = (
    "every layer fits one GeForce card and a layout without TP over PCIe was found (TP over "
    "PCIe on GeForce only where nothing else fits)"
)


def _tp_gate(run: _Run, mixed: Family, family: Family) -> str:
    """Why a TP family does not run (empty: it runs): GeForce groups over PCIe only where
    nothing else fits, unless ``--tensor-parallel always``: the request's family and every
    NVLink TP family searched before it (their groups beside single cards) have no valid
    layout, or they leave idle a device the model does not fit (:func:`nothing_cheaper_fits`)
    while some unit fits no card of the family's GeForce groups alone (a layer no card
    holds: :func:`_unit_fits_no_card`). Where every layer fits a card, TP over PCIe would
    only trade a pipeline or data-parallel layout for per-layer all-reduces without
    peer-to-peer, which no published training run has shown to pay."""
    if not family.tp_over_pcie or run.options.tensor_parallel is Policy.ALWAYS:
        return ""
    nvlink = [f for f in run.tp_families if not f.tp_over_pcie]  # none found: nothing fits
    searched = [(f.problem(run.problem), run.ranked(f, Pool.SYNCHRONOUS)) for f in (mixed, *nvlink)]
    if all(not valid_only(ranked) for _, ranked in searched):
        return ""
    cards = [d for g in family.tp_groups if len(g) > 1 for d in g]
    if _unit_fits_no_card(run.problem, cards) and all(
        nothing_cheaper_fits(problem, ranked) for problem, ranked in searched
    ):
        return ""
    return TP_PCIE_GATE


def _unit_fits_no_card(problem: PlanningProblem, cards: Sequence[int]) -> bool:
    """Whether some unit's static memory and its activations at the smallest micro-batch
    exceed the capacity of each of ``cards`` (device indices of ``problem``) alone."""
    if not cards:
        return False
    smallest = problem.micro_batch_sizes[0]
    need = problem.static_memory_bytes + problem.activation_bytes_per_sample * smallest
    capacity = max(float(problem.memory_capacity_bytes[d]) for d in cards)
    return bool((need > capacity).any())


@dataclass(frozen=True)
class _FamilyOutcome:
    family: str
    outcome: SearchOutcome | None


@dataclass(frozen=True)
class _CutShort:
    """A search stopped at its time share before it had looked at every pipeline shape."""


def generate(
    problem: PlanningProblem,
    options: SolveOptions,
    *,
    deadline_s: float,
    meanwhile: Callable[[], float] | None = None,
) -> Generated:
    """Every family's candidates, found by :func:`_generate_all` in one child process
    (``options.watchdog``) that ends by ``deadline_s`` (``time.monotonic()``).

    ``meanwhile`` runs in this process while the child searches and its value is kept as
    ``Generated.bound_samples_per_s`` (the report's bound: a second core makes it free).

    Raises:
        ConfigError: ``--offload always`` on a cluster where no device can offload.
        SolverUnavailableError: a requested MILP backend does not work here.
    """
    if options.offload is Policy.ALWAYS and not _any_can_offload(problem):
        raise ConfigError(
            "--offload always: no device of this cluster can offload its optimizer state (a "
            "cpu device's memory is the host's); use --offload auto or never"
        )
    bound: list[float] = []
    items, finished = run_with_deadline(
        lambda deadline, report: _generate_all(problem, options, deadline, report),
        # the child's own deadline is ``deadline_s``; the kill comes a grace after it
        max(deadline_s - time.monotonic(), 0.05) + KILL_GRACE_S,
        use_child=options.watchdog,
        meanwhile=None if meanwhile is None else (lambda: bound.append(meanwhile())),
    )
    outcomes = {i.family: i.outcome for i in items if isinstance(i, _FamilyOutcome)}
    found = tuple(i for i in items if isinstance(i, Found))
    for family in {f.family for f in found if f.generator == "search"} - set(outcomes):
        # stopped mid-search: what it had found, nothing proven
        candidates = [f.candidate for f in found if f.family == family and f.generator == "search"]
        outcomes[family] = SearchOutcome(candidates=candidates)
    notes = () if finished else (f"solver stopped at the {options.time_limit_s:g} s limit",)
    return Generated(
        families=_families_seen(families(problem, options), items),
        found=found,
        outcomes={name: o for name, o in outcomes.items() if o is not None},
        runs=tuple(i for i in items if isinstance(i, GeneratorRun)),
        deadline_s=deadline_s,
        bound_samples_per_s=bound[0] if bound else None,
        notes=notes,
        cut_short=not finished or any(isinstance(i, _CutShort) for i in items),
    )


def requested_only(
    problem: PlanningProblem, options: SolveOptions, *, deadline_s: float
) -> Generated:
    """What generation gives when a baseline was asked for (``--strategy ddp``): nothing,
    the request's family only (the choose step builds the baseline)."""
    return Generated(
        families=families(problem, options)[:1],
        found=(),
        outcomes={},
        runs=(),
        deadline_s=deadline_s,
        notes=("a baseline was requested: nothing searched",),
    )


def _families_seen(ordered: Sequence[Family], items: Sequence[object]) -> tuple[Family, ...]:
    """The request's family and every other that reported a candidate or a generator run
    (the uniform ones only run when their gate opens)."""
    seen = {i.family for i in items if isinstance(i, Found | GeneratorRun | _FamilyOutcome)}
    return tuple(f for i, f in enumerate(ordered) if i == 0 or f.name in seen)


# --------------------------------------------------------------------------- ZeRO, offload
def sharded_candidates(
    problem: PlanningProblem, options: SolveOptions, search_variant: VariantSearch
) -> list[Candidate]:
    """Layouts that fit with ZeRO's uneven shards (``cost.zero``): stage 1, searched on the
    problem with the least state any sharding leaves (``zero.sharded_problem``), each sized
    by ``zero.shard_weights`` and kept only where every device then fits; then stage 2,
    searched on the problem that also leaves out the flat gradient copies, kept only for
    layouts that stage 1 cannot fit (stage 2 is costed as stage 1, so where both fit the
    solver keeps stage 1)."""
    found: list[Candidate] = []
    for stage in (1, 2):
        sharded = sharded_problem(problem, stage)
        if sharded is None:
            return found
        for candidate in search_variant(sharded, f"stage {stage}", 3 - stage):
            layout = candidate.layout
            if layout.sync is not None and layout.sync.local:
                continue
            evaluation = evaluate(problem, layout)
            memory = {c.device_idx: c.memory_bytes for costs in evaluation.stages for c in costs}
            if stage == 2 and shard_weights(problem, layout, memory) is not None:
                continue  # stage 1 fits it: found above, or by a layout at least as fast
            weights = shard_weights(problem, layout, memory, stage)
            if weights is not None:
                sharded_layout = replace(layout, optimizer_shard_weights=weights, zero_stage=stage)
                found.append(
                    replace(
                        candidate,
                        layout=sharded_layout,
                        scenario=f"zero-{stage}: {candidate.scenario}",
                    )
                )
    return found


def offload_candidates(
    problem: PlanningProblem, options: SolveOptions, search_variant: VariantSearch
) -> list[Candidate]:
    """Layouts that fit with optimizer-state offload (``cost.offload``): searched on the
    problem where every device offloads (``offload.offload_problem``); under ``auto`` each
    keeps offload only on the devices that do not fit without it
    (``offload.offload_flags``), under ``always`` on every GPU (a ``cpu`` device's memory
    is the host's: offload frees none of it); kept only where every device and every
    node's host memory then fit."""
    offloaded = offload_problem(problem)
    if offloaded is None:
        return []
    items = search_variant(offloaded, "offload", 1)
    found = []
    for candidate in items:
        layout = candidate.layout
        if layout.sync is not None and layout.sync.local:
            continue
        memory = {
            c.device_idx: c.memory_bytes
            for costs in evaluate(problem, layout).stages
            for c in costs
        }
        if options.offload is Policy.ALWAYS:
            flags: tuple[bool, ...] | None = tuple(
                d in memory and can_offload(problem, d) for d in range(problem.num_devices)
            )
        else:
            flags = offload_flags(problem, layout, memory)
        if flags is not None and any(flags):
            found.append(
                replace(
                    candidate,
                    layout=replace(layout, optimizer_offload=flags),
                    scenario=f"offload: {candidate.scenario}",
                )
            )
    return found


def with_recompute_policy(problem: PlanningProblem, layout: Layout) -> Layout:
    """``layout`` with every stage recomputing under ``Policy.ALWAYS`` (a baseline built
    without the policy), else itself."""
    if problem.recompute is not Policy.ALWAYS:
        return layout
    replicas = tuple(
        replace(r, stages=tuple(replace(s, recompute=True, recompute_units=()) for s in r.stages))
        for r in layout.replicas
    )
    return replace(layout, replicas=replicas)
