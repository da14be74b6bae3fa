"""The solver as named steps: generate, evaluate, validate, simulate the best, choose.

:func:`solve` runs them in order (``hplan solve`` runs each as a pass of its own, so
``--dump-passes`` shows every one and the phase line times it):

1. ``strategy.generate``: every family's candidates, in one child process under one deadline;
2. :func:`evaluate_candidates`: each re-costed by the exact evaluator, ranked in its pools;
3. :func:`validate_candidates`: each checked by the independent validator (``validate``);
   a rejected layout is never chosen, and the plan's notes say why;
4. :func:`simulate_candidates`: the best valid layouts re-timed by the event-driven
   simulator (the cost model is a linear approximation of a pipeline);
5. :func:`choose`: each family's fastest by simulation, synchronous or local as ``--sync``
   says (``sync_choice``), then the request's family against each uniform one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from hplan.planner.cost.evaluate import Evaluation, evaluate, island_index
from hplan.planner.cost.layout import Layout
from hplan.planner.cost.problem import PlanningProblem, Policy
from hplan.planner.sim.spec import RuntimeBytes, simulated_step_time_s
from hplan.planner.solve.bound import throughput_bound_samples_per_s
from hplan.planner.solve.search import SearchOutcome, SolveOptions, diagnose_infeasible
from hplan.planner.solve.strategy import (
    MIXED,
    SIMULATED_CANDIDATES,
    Family,
    Generated,
    Pool,
    Ranked,
    evaluated,
    family_pool,
    generate,
    uniform_strategies,
    validated,
)
from hplan.planner.solve.sync_choice import (
    AUTO_MIN_GAIN,
    AUTO_SYNC_SHARE,
    SyncRequest,
    group_label,
    sync_cost_share,
    usable_idle_devices,
)
from hplan.planner.solve.validate import layout_problems
from hplan.planner.solve.watchdog import checked_time_limit_s
from hplan.planner.textfmt import count, format_seconds, percent
from hplan.runtime.contract.errors import ConfigError, InfeasiblePlanError
from hplan.runtime.contract.plan import Schedule, SolverStatus

__all__ = [
    "Candidates",
    "SolveOptions",
    "SolveResult",
    "choose",
    "evaluate_candidates",
    "second_opinion",
    "simulate_candidates",
    "solve",
    "uniform_strategies",
    "validate_candidates",
]


@dataclass(frozen=True)
class SolveResult:
    """The chosen layout and what the solver can say about it."""

    layout: Layout
    evaluation: Evaluation
    status: SolverStatus
    gap: float | None
    """Relative gap of the planning model's step time to its best lower bound."""
    backend: str
    source: str
    """Which family, generator and search scenario (or baseline) produced the layout."""
    notes: tuple[str, ...]
    simulated_step_time_s: float | None = None
    """Step time of the chosen layout in the event-driven simulator (None: not simulated)."""
    bound_samples_per_s: float | None = None
    """The problem's throughput bound (``bound.throughput_bound_samples_per_s``), computed
    while the search ran when :func:`solve` was asked ``with_bound``; None: not computed."""
    tp_problem: PlanningProblem | None = None
    """The problem of the TP groups the layout's device indices name (its devices are TP
    groups: ``PlanningProblem.tp_members``); None: the solve's own problem's devices."""
    tp_over_pcie: bool = False
    """Its TP groups are GeForce cards over PCIe (chosen because nothing else fits)."""

    def solved_problem(self, problem: PlanningProblem) -> PlanningProblem:
        """The problem ``layout`` indexes: :attr:`tp_problem`, else ``problem``."""
        return problem if self.tp_problem is None else self.tp_problem

    def verify(self) -> None:
        """Check the result's consistency; raise ValueError naming the first problem.

        The layout is consistent (``Layout.verify``), the evaluation has one cost per stage,
        and the status agrees with the gap (optimal: 0; otherwise None or >= 0).
        """
        self.layout.verify()
        shapes = [len(r.stages) for r in self.layout.replicas]
        if [len(s) for s in self.evaluation.stages] != shapes:
            raise ValueError(f"the evaluation's stages do not match the layout's {shapes}")
        if self.status is SolverStatus.OPTIMAL and self.gap != 0.0:
            raise ValueError(f"an optimal layout with gap {self.gap}")
        if self.gap is not None and not self.gap >= 0:
            raise ValueError(f"gap {self.gap} must be >= 0")


# --------------------------------------------------------------------------- the steps
@dataclass(frozen=True)
class PoolCandidates:
    """One family's candidates in one pool after a step."""

    family: str
    pool: Pool
    ranked: tuple[Ranked, ...]
    """Distinct layouts, fastest first under the cost model (after ``validate``, rejected
    ones included with their reasons)."""
    simulated: tuple[tuple[Ranked, float | None], ...] = ()
    """After ``simulate``: the valid layouts re-timed, in the order the choice reads them
    (the cost model's, the local pool's preferred first), with their simulated step (None:
    too large to simulate)."""

    @property
    def valid(self) -> tuple[Ranked, ...]:
        return tuple(r for r in self.ranked if r.valid)

    @property
    def rejected(self) -> tuple[Ranked, ...]:
        return tuple(r for r in self.ranked if not r.valid)


@dataclass(frozen=True)
class Candidates:
    """What the evaluate, validate and simulate steps make of the generated candidates."""

    generated: Generated
    pools: tuple[PoolCandidates, ...]

    def of(self, family: str, pool: Pool) -> PoolCandidates:
        found = [p for p in self.pools if p.family == family and p.pool is pool]
        return found[0] if found else PoolCandidates(family, pool, ())

    def verify(self) -> None:
        """Every pool is fastest first; every simulated layout is one of its valid ones."""
        for pool in self.pools:
            times = [r.evaluation.step_time_s for r in pool.ranked]
            if times != sorted(times):
                raise ValueError(f"{pool.family} {pool.pool} candidates are not fastest first")
            if any(not r.valid for r, _ in pool.simulated):
                raise ValueError(f"{pool.family} {pool.pool}: a rejected layout was simulated")


def evaluate_candidates(problem: PlanningProblem, generated: Generated) -> Candidates:
    """Every generated layout, its shares cut into equal micro-batches (``even_microbatches``),
    re-costed by the exact evaluator under its family's policies, ranked fastest first in
    each family's pools (``strategy.family_pool``, ``strategy.evaluated``: duplicates
    within a segment dropped; past the solve's deadline a segment keeps its first)."""
    pools = []
    for family in generated.families:
        family_problem = family.problem(problem)
        for pool in Pool:
            found = family_pool(family, generated.found, pool)
            ranked = evaluated(family_problem, found, generated.deadline_s)
            pools.append(PoolCandidates(family.name, pool, tuple(ranked)))
    return Candidates(generated, tuple(pools))


def validate_candidates(problem: PlanningProblem, candidates: Candidates) -> Candidates:
    """Every candidate checked by the independent validator under its family's policies;
    a rejected one keeps its place with the validator's reasons (``Ranked.problems``)."""
    pools = []
    for pool in candidates.pools:
        family_problem = candidates.generated.family(pool.family).problem(problem)
        pools.append(replace(pool, ranked=tuple(validated(family_problem, pool.ranked))))
    return replace(candidates, pools=tuple(pools))


def simulate_candidates(
    problem: PlanningProblem,
    candidates: Candidates,
    runtime: RuntimeBytes | None = None,
    *,
    deadline_s: float | None = None,
) -> Candidates:
    """Each pool's ``SIMULATED_CANDIDATES`` best valid layouts re-timed by the simulator
    under the problem's schedule, exactly as their plans will be given ``runtime`` (the
    bytes the runtime sends and sums). The local pool's preferred layout comes first
    (:func:`_closest_to_synchronous`). Past ``deadline_s`` (``time.monotonic()``) only each
    pool's first layout is simulated: the cost model's order stands."""
    pools = []
    for pool in candidates.pools:
        family_problem = candidates.generated.family(pool.family).problem(problem)
        valid = list(pool.valid)
        if pool.pool is Pool.LOCAL:
            valid = _closest_to_synchronous(family_problem, valid)
        simulated = []
        for index, ranked in enumerate(valid[:SIMULATED_CANDIDATES]):
            late = deadline_s is not None and time.monotonic() >= deadline_s
            if index > 0 and late:
                break
            time_s = simulated_step_time_s(
                family_problem, ranked.layout, family_problem.schedule, runtime
            )
            simulated.append((ranked, time_s))
        pools.append(replace(pool, simulated=tuple(simulated)))
    return replace(candidates, pools=tuple(pools))


def choose(
    problem: PlanningProblem,
    options: SolveOptions,
    candidates: Candidates,
    runtime: RuntimeBytes | None = None,
) -> SolveResult:
    """The layout to plan: the request's family's choice (:func:`_family_choice`), replaced
    by a uniform family's where that one is faster as the plans report them
    (:func:`_faster_of`: the mixed choice is then never slower than a uniform one).

    Raises:
        InfeasiblePlanError: nothing fits; the message names the binding constraint.
        RuntimeError: the search found layouts but the validator rejected every one (a bug
            in hplan's search, never blamed on the cluster).
    """
    generated = candidates.generated
    ordered = generated.families
    if options.tensor_parallel is Policy.ALWAYS:
        ordered = tuple(f for f in ordered if f.tp_groups)
        if not ordered or all(
            _family_choice(problem, options, candidates, f) is None for f in ordered
        ):
            raise _no_tp_plan(problem, generated)
    result = None
    for family in ordered:
        other = _family_choice(problem, options, candidates, family)
        if other is None:
            continue
        other = _with_tp(other, family)
        result = other if result is None else _faster_of(problem, result, other, family, runtime)
    if result is None:
        raise _nothing_valid(problem, options, candidates)
    notes = (*generated.notes, *result.notes)
    return replace(result, notes=notes, bound_samples_per_s=generated.bound_samples_per_s)


def _with_tp(result: SolveResult, family: Family) -> SolveResult:
    """``result`` of ``family`` carrying its TP groups' problem when it has one."""
    if not family.tp_groups:
        return result
    return replace(
        result,
        tp_problem=family.grouped,
        tp_over_pcie=family.tp_over_pcie,
        source=f"{family.name}: {result.source}",
    )


def _no_tp_plan(problem: PlanningProblem, generated: Generated) -> ConfigError:
    """``--tensor-parallel always`` without a TP layout: why, in one line."""
    tp = problem.tensor_parallel
    if tp is None:
        why = "the model offers no tensor parallelism (no TP plan, or no unit splits)"
    elif not any(f.tp_groups for f in generated.families):
        why = (
            f"no node has 2 or more cards of one kind for a degree the model allows "
            f"(up to {tp.max_degree})"
        )
    else:
        why = "no layout of TP groups fits this cluster"
    return ConfigError(f"--tensor-parallel always: {why}; use --tensor-parallel auto or never")


def solve(
    problem: PlanningProblem,
    options: SolveOptions | None = None,
    *,
    runtime: RuntimeBytes | None = None,
    with_bound: bool = False,
    schedule: Schedule | None = None,
) -> SolveResult:
    """Find the fastest layout for ``problem`` within ``options.time_limit_s``: the steps of
    the module docstring, one after another.

    Args:
        runtime: the bytes the plan's runtime will send and sum, for the simulator (None:
            the cost model's).
        with_bound: also compute the problem's throughput bound (the report's "bound"
            line), in this process while the search runs in its child.
        schedule: the pipeline schedule, when it is not the problem's own.

    Raises:
        InfeasiblePlanError: nothing fits; the message names the binding constraint.
        ConfigError: ``--offload always`` on a cluster without a GPU.
        SolverUnavailableError: a requested MILP backend does not work here.
    """
    options = options or SolveOptions()
    if schedule is not None and schedule is not problem.schedule:
        problem = replace(problem, schedule=schedule)
    problem.verify()
    deadline_s = time.monotonic() + checked_time_limit_s(options.time_limit_s)
    generated = generate_step(problem, options, deadline_s=deadline_s, with_bound=with_bound)
    candidates = validate_candidates(problem, evaluate_candidates(problem, generated))
    simulated = simulate_candidates(problem, candidates, runtime, deadline_s=deadline_s)
    return choose(problem, options, simulated, runtime)


AFTER_GENERATION_SHARE = 0.2
"""Of the time limit, what the steps after generation keep for themselves (evaluate,
validate, simulate, choose, then the report and the plan's files)."""


def generate_step(
    problem: PlanningProblem,
    options: SolveOptions,
    *,
    deadline_s: float,
    with_bound: bool = False,
) -> Generated:
    """``strategy.generate`` ending :data:`AFTER_GENERATION_SHARE` of the time limit before
    ``deadline_s``, with the bound computed meanwhile when asked."""
    limit_s = checked_time_limit_s(options.time_limit_s)
    search_deadline_s = deadline_s - AFTER_GENERATION_SHARE * limit_s
    bound: Callable[[], float] | None = (
        (lambda: throughput_bound_samples_per_s(problem)) if with_bound else None
    )
    generated = generate(problem, options, deadline_s=search_deadline_s, meanwhile=bound)
    return replace(generated, deadline_s=deadline_s)


# --------------------------------------------------------------------------- one family
LOCAL_PLAN_NOTE = (
    "each island was solved on its own for its share of the batch, the shares re-solved "
    "until the islands finish their steps together: no optimality claim across islands"
)


@dataclass(frozen=True)
class Pick:
    """The best of a pool after the simulator's second opinion."""

    source: str
    layout: Layout
    evaluation: Evaluation
    simulated_s: float | None
    preferred_note: str | None
    """Why the simulator's choice replaced the cost model's best (None: it did not)."""
    model_best_s: float
    """The cost model's best step time in the pool."""


LOCAL_TIE_SHARE = 0.02
"""Local plans within 2% of the fastest one's step count as tied; of those the fastest with
the fewest islands in use is preferred (closer to synchronous training), and the simulator
must find another more than 2% faster to replace it."""


def _family_choice(
    problem: PlanningProblem, options: SolveOptions, candidates: Candidates, family: Family
) -> SolveResult | None:
    """``family``'s layout: its synchronous or its local pick, as ``options.sync`` says,
    with the status and gap its search proved; None when it has no valid layout."""
    synchronous = _pick(candidates.of(family.name, Pool.SYNCHRONOUS))
    local = _pick(candidates.of(family.name, Pool.LOCAL), margin=LOCAL_TIE_SHARE)
    if synchronous is None and local is None:
        return None
    outcome = candidates.generated.outcomes.get(family.name) or SearchOutcome()
    family_problem = family.problem(problem)
    chosen, why = choose_sync(family_problem, options.sync, synchronous, local)
    notes = list(outcome.notes)
    if chosen is synchronous:
        status, gap = _status(outcome)
        if synchronous.preferred_note:
            notes.append(synchronous.preferred_note)
            status, gap = _status_of_runner_up(
                status, gap, synchronous.model_best_s, synchronous.evaluation.step_time_s
            )
        rejected = _rejected_search_layouts(candidates.of(family.name, Pool.SYNCHRONOUS))
        if rejected:
            notes.append(rejected)
            status, gap = _not_proven(status, gap, outcome, synchronous.evaluation.step_time_s)
    else:
        status, gap = SolverStatus.FEASIBLE, None
        notes.append(LOCAL_PLAN_NOTE)
    notes += why
    if not outcome.exhaustive:
        notes.append(
            "too many candidate pipelines to enumerate: stage orders chosen by heuristics, "
            "unit splits by dynamic programming; the gap is measured within that search"
        )
    return SolveResult(
        chosen.layout,
        chosen.evaluation,
        status,
        gap,
        outcome.backend or "none",
        chosen.source,
        tuple(notes),
        simulated_step_time_s=chosen.simulated_s,
    )


def _pick(pool: PoolCandidates, margin: float = 1e-9) -> Pick | None:
    """The pool's simulated layout the simulator finds fastest (:func:`second_opinion`'s
    rule: it must beat an earlier one by more than ``margin``)."""
    if not pool.simulated:
        return None
    times = tuple(time_s for _, time_s in pool.simulated)
    chosen = _fastest_simulated(times, margin)
    ranked = pool.simulated[chosen][0]
    note = _preferred_note(pool.simulated, chosen) if chosen > 0 else None
    return Pick(
        ranked.source,
        ranked.layout,
        ranked.evaluation,
        times[chosen],
        note,
        pool.simulated[0][0].evaluation.step_time_s,
    )


def _rejected_search_layouts(pool: PoolCandidates) -> str:
    """The note on the search's layouts the validator rejected (empty: none was). A
    baseline that does not fit is no news; a searched layout that does not is hplan's
    mistake, and the plan is then not proven optimal."""
    rejected = [r for r in pool.rejected if r.found.generator != "baselines"]
    if not rejected:
        return ""
    first = rejected[0]
    more = f" and {len(rejected) - 1} more" if len(rejected) > 1 else ""
    return (
        f"the validator rejected the search's layout from {first.source} "
        f"({'; '.join(first.problems[:2])}){more}: the plan is the best layout that passed, "
        "so it is not claimed optimal"
    )


def _not_proven(
    status: SolverStatus, gap: float | None, outcome: SearchOutcome, chosen_s: float
) -> tuple[SolverStatus, float | None]:
    """Status and gap when the search's own layouts were rejected: feasible, its gap to the
    search's lower bound (None when the search did not finish)."""
    if status is SolverStatus.HEURISTIC:
        return status, gap
    main = [c for c in outcome.candidates if c.main]
    if gap is None or not main or chosen_s <= 0:
        return SolverStatus.FEASIBLE, None
    lower = min(c.lower_bound_s for c in main)
    return SolverStatus.FEASIBLE, max(0.0, (chosen_s - lower) / chosen_s)


def _nothing_valid(
    problem: PlanningProblem, options: SolveOptions, candidates: Candidates
) -> Exception:
    """The error when the request's family has no valid layout: infeasible, naming the
    binding constraint, unless the search found layouts that the validator rejected (then
    it is a bug in hplan's search, said as such, not a limit of the cluster)."""
    mixed = [candidates.of(MIXED, pool) for pool in Pool]
    rejected = [r for pool in mixed for r in pool.rejected if r.found.generator != "baselines"]
    if not rejected:
        return InfeasiblePlanError(
            diagnose_infeasible(
                problem,
                options.offload,
                zero=options.zero,
                max_stages=options.max_stages,
                cut_short_s=options.time_limit_s if candidates.generated.cut_short else None,
            )
        )
    first = rejected[0]
    return RuntimeError(
        f"the search found {len(rejected)} layout(s) for this cluster but the independent "
        f"validator rejected every one (first, from {first.source}: "
        f"{'; '.join(first.problems[:2])}); this is a bug in hplan's search, not a limit of "
        "the cluster: please report it with the files of --dump-passes DIR (--strategy ddp "
        "or uniform plans a baseline meanwhile)"
    )


def _closest_to_synchronous(problem: PlanningProblem, ranked: list[Ranked]) -> list[Ranked]:
    """``ranked`` (fastest first) with the preferred of the tied local plans first
    (:data:`LOCAL_TIE_SHARE`)."""
    if not ranked:
        return ranked
    limit = ranked[0].evaluation.step_time_s * (1 + LOCAL_TIE_SHARE)
    tied = [item for item in ranked if item.evaluation.step_time_s <= limit]

    def closeness(item: Ranked) -> tuple[int, float]:
        layout = item.layout
        assert layout.sync is not None
        islands = island_index(problem, layout.sync)
        return len({islands[d] for d in layout.device_indices}), item.evaluation.step_time_s

    preferred = min(tied, key=closeness)
    return [preferred, *(item for item in ranked if item is not preferred)]


def choose_sync(
    problem: PlanningProblem, request: SyncRequest, synchronous: Pick | None, local: Pick | None
) -> tuple[Pick, tuple[str, ...]]:
    """The synchronous or the local pick, as ``request`` says (``sync_choice``), and the
    notes that say why. At least one pick is given."""
    if local is None or synchronous is None:
        chosen = local or synchronous
        assert chosen is not None
        missing = (
            (f"--sync {request.value}: no local plan fits this cluster; the plan syncs every step",)
            if local is None and request.local
            else ()
        )
        return chosen, missing
    if request is not SyncRequest.AUTO:
        return local, ()
    sync_ev, local_ev = synchronous.evaluation, local.evaluation
    idle = usable_idle_devices(problem, synchronous.layout)
    share = sync_cost_share(sync_ev)
    costly = share > AUTO_SYNC_SHARE or bool(idle)
    faster = local_ev.step_time_s < (1 - AUTO_MIN_GAIN) * sync_ev.step_time_s
    used = len(set(synchronous.layout.device_indices))
    sync_words = (
        f"the best synchronous plan takes {format_seconds(sync_ev.step_time_s)} per step on "
        f"{used} of {problem.num_devices} devices (all-reduce {percent(share)} of it)"
    )
    local_words = (
        f"the best local plan ({local.source}, {sync_label(local.layout)}) "
        f"{format_seconds(local_ev.step_time_s)}"
    )
    if costly and faster:
        return local, (f"sync auto chose local sync: {sync_words}; {local_words}",)
    why = (
        f"local sync is not {percent(AUTO_MIN_GAIN)} faster"
        if costly
        else "the all-reduce is cheap and every device is used"
    )
    return synchronous, (f"sync auto kept all_reduce ({why}): {sync_words}; {local_words}",)


def sync_label(layout: Layout) -> str:
    """``local_sgd H=12`` (``bfloat16`` added when so) for a local layout."""
    sync = layout.sync
    if sync is None:
        return "all_reduce"
    label = group_label(sync.default)
    return label + (f" ({count(len(sync.groups), 'holder set')} apart)" if sync.groups else "")


# --------------------------------------------------------------------------- families
def _reported_s(result: SolveResult, simulated: bool) -> float:
    """The step time the plan reports: simulated when ``simulated``, else the cost model's."""
    if simulated and result.simulated_step_time_s is not None:
        return result.simulated_step_time_s
    return result.evaluation.step_time_s


def _faster_of(
    problem: PlanningProblem,
    mixed: SolveResult,
    other: SolveResult,
    family: Family,
    runtime: RuntimeBytes | None,
) -> SolveResult:
    """``mixed``, or the other family's result ``other`` (re-costed and re-simulated on
    ``problem``, or on its TP groups' problem) when that is faster.

    Both are compared as the plans report them (as ``--previous`` is): simulated where
    both were simulated, else the cost model's step; a tie keeps ``mixed``. A layout
    ``problem``'s validator refuses is never taken.
    """
    name = family.name
    problem = other.solved_problem(problem)
    if layout_problems(problem, other.layout):
        return mixed
    evaluation = evaluate(problem, other.layout)
    simulated = mixed.simulated_step_time_s is not None and other.simulated_step_time_s is not None
    simulated_s = (
        simulated_step_time_s(problem, other.layout, problem.schedule, runtime)
        if simulated
        else None
    )
    candidate = replace(other, evaluation=evaluation, simulated_step_time_s=simulated_s)
    mixed_s = _reported_s(mixed, simulated)
    other_s = _reported_s(candidate, simulated)
    if not other_s < mixed_s:
        return mixed
    status, gap = _status_of_runner_up(
        mixed.status, mixed.gap, mixed.evaluation.step_time_s, evaluation.step_time_s
    )
    how = "simulated" if simulated else "cost model"
    what = f"the {name} TP family" if family.tp_groups else f"the uniform {name} strategy"
    note = (
        f"{what}'s layout ({other.source}) takes "
        f"{format_seconds(other_s)} per step ({how}), less than the {format_seconds(mixed_s)} "
        f"of the best so far ({mixed.source}): chose it"
    )
    return replace(
        candidate,
        status=status,
        gap=gap,
        source=other.source if family.tp_groups else f"uniform {name}: {other.source}",
        notes=(*other.notes, note),
    )


# --------------------------------------------------------------------------- the simulator
def second_opinion(
    problem: PlanningProblem,
    layouts: list[Layout],
    schedule: Schedule = Schedule.ONE_F_ONE_B,
    runtime: RuntimeBytes | None = None,
    *,
    margin: float = 1e-9,
) -> tuple[int, tuple[float | None, ...]]:
    """Index of the layout the simulator finds fastest, and every layout's simulated time.

    ``layouts`` come in the cost model's order; a layout must beat an earlier one by more
    than a relative ``margin`` to be preferred. Local layouts are simulated with their
    outer sync amortised (``sim.engine.simulate``, rule 6). A layout too large to simulate
    (None, see ``sim.spec.MAX_SIMULATED_MICROBATCHES``) is never preferred, and when the
    cost model's best is too large the cost model's order stands.
    """
    simulated = tuple(
        simulated_step_time_s(problem, layout, schedule, runtime) for layout in layouts
    )
    return _fastest_simulated(simulated, margin), simulated


def _fastest_simulated(simulated: Sequence[float | None], margin: float) -> int:
    """:func:`second_opinion`'s choice among simulated times (the first is the model's best)."""
    chosen, best_s = 0, simulated[0]
    if best_s is None:
        return chosen
    for idx, time_s in enumerate(simulated):
        if time_s is not None and time_s < best_s * (1 - margin):
            chosen, best_s = idx, time_s
    return chosen


def _preferred_note(simulated: Sequence[tuple[Ranked, float | None]], chosen: int) -> str:
    """Why the simulator's choice replaced the cost model's best (both were simulated)."""
    best, best_s = simulated[0]
    picked, picked_s = simulated[chosen]
    return (
        f"the simulator preferred the layout from {picked.source} "
        f"(simulated {(picked_s or 0.0) * 1e3:.4g} ms, cost model "
        f"{picked.evaluation.step_time_s * 1e3:.4g} ms) to the cost model's best from "
        f"{best.source} (simulated {(best_s or 0.0) * 1e3:.4g} ms, cost model "
        f"{best.evaluation.step_time_s * 1e3:.4g} ms)"
    )


# --------------------------------------------------------------------------- status
def _status_of_runner_up(
    status: SolverStatus, gap: float | None, best_s: float, chosen_s: float
) -> tuple[SolverStatus, float | None]:
    """Status and gap, under the cost model, of a layout other than the model's best.

    The model's lower bound is ``best_s * (1 - gap)``, so the chosen layout's gap is
    ``1 - (1 - gap) * best_s / chosen_s``.
    """
    if status is SolverStatus.HEURISTIC or gap is None or chosen_s <= 0:
        return status, gap
    new_gap = max(0.0, 1 - (1 - gap) * best_s / chosen_s)
    return (SolverStatus.FEASIBLE if new_gap > 0 else status), new_gap


def _status(outcome: SearchOutcome) -> tuple[SolverStatus, float | None]:
    """Optimal when the whole-cluster search was exhaustive, finished, and every bisection
    was proven; otherwise the gap of the best model time to the best lower bound."""
    main = [c for c in outcome.candidates if c.main]
    if outcome.backend == "heuristic" or not main:
        return SolverStatus.HEURISTIC, None
    best_model = min(c.model_time_s for c in outcome.candidates if c.layout.sync is None)
    lower = min(c.lower_bound_s for c in main)
    gap = max(0.0, (best_model - lower) / best_model) if best_model > 0 else 0.0
    proven = outcome.finished and outcome.complete and all(c.proven for c in main)
    if proven and outcome.exhaustive:
        return SolverStatus.OPTIMAL, 0.0
    return SolverStatus.FEASIBLE, gap if outcome.finished and outcome.complete else None
