"""The solver's public entry: search, re-cost, validate, and say how good the answer is."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from hplan.planner.cost.evaluate import Evaluation, evaluate, island_index
from hplan.planner.cost.even_microbatches import even_microbatches
from hplan.planner.cost.layout import Layout
from hplan.planner.cost.offload import can_offload, offload_flags, offload_problem
from hplan.planner.cost.problem import PlanningProblem, RecomputePolicy
from hplan.planner.cost.zero import shard_weights, sharded_problem
from hplan.planner.sim.spec import RuntimeBytes, simulated_step_time_s
from hplan.planner.solve.baselines import data_parallel_equal, uniform_pipeline
from hplan.planner.solve.bound import throughput_bound_samples_per_s
from hplan.planner.solve.search import SearchOutcome, SolveOptions, diagnose_infeasible, run_search
from hplan.planner.solve.sync_choice import (
    AUTO_MIN_GAIN,
    AUTO_SYNC_SHARE,
    SyncRequest,
    sync_cost_share,
    usable_idle_devices,
)
from hplan.planner.solve.validate import layout_problems
from hplan.planner.textfmt import format_seconds, percent
from hplan.runtime.contract.errors import ConfigError, InfeasiblePlanError
from hplan.runtime.contract.plan import PseudoGradientDtype, Schedule, SolverStatus

__all__ = ["SolveOptions", "SolveResult", "second_opinion", "solve", "uniform_strategies"]

SIMULATED_CANDIDATES = 5
"""How many of the cost model's best distinct layouts the simulator re-times."""


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
    """Which search scenario (or baseline) produced the layout."""
    notes: tuple[str, ...]
    simulated_step_time_s: float | None = None
    """Step time of the chosen layout in the event-driven simulator (None: not simulated)."""
    bound_samples_per_s: float | None = None
    """The problem's throughput bound (``bound.throughput_bound_samples_per_s``), computed
    while the search ran when :func:`solve` was asked ``with_bound``; None: not computed."""

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


def solve(
    problem: PlanningProblem,
    options: SolveOptions | None = None,
    *,
    schedule: Schedule = Schedule.ONE_F_ONE_B,
    runtime: RuntimeBytes | None = None,
    with_bound: bool = False,
) -> SolveResult:
    """Find the fastest layout for ``problem`` within ``options.time_limit_s``.

    Every candidate (one per sync scenario, plus the data-parallel and uniform-pipeline
    baselines) is re-costed by the exact evaluator and checked by the independent
    validator. The cost model's objective is a linear approximation of a pipeline, so
    the ``SIMULATED_CANDIDATES`` best distinct layouts are then re-timed by the
    event-driven simulator under ``schedule`` (``sim/engine.py``) and the fastest by
    simulation wins (ties go to the cost model's order). Given ``runtime`` (the bytes the
    plan's runtime will send and sum), each is simulated exactly as its plan will be, and
    the winner's simulated time is the plan's (``SolveResult.simulated_step_time_s``).

    Local plans (islands that sync by local SGD or async, when ``options.sync`` allows
    them) are ranked and simulated apart from the synchronous ones; which of the two bests
    is returned follows ``options.sync`` (``sync_choice``).

    Where memory may shape the answer (a stage recomputes, optimizer state is sharded or
    offloaded, or a stage nearly fills its device) and the request has an ``auto`` among
    ``--recompute``, ``--zero`` and ``--offload``, each uniform strategy it allows
    (:func:`uniform_strategies`: everyone plain, recomputing, on ZeRO-1 or offloading) is
    solved too, each within ``options.time_limit_s``, and its result is taken when faster as
    the plans report them (:func:`_faster_of`): the mixed choice is then never slower than
    a uniform one's by construction. The heuristic searches (stage orders) of the two can
    differ, so a uniform search may find a layout the mixed one misses.

    ``with_bound``: also compute the problem's throughput bound (the report's "bound"
    line), in this process while the first search runs in its watchdog child (a second
    core makes it free), into ``SolveResult.bound_samples_per_s``.

    Raises:
        InfeasiblePlanError: nothing fits; the message names the binding constraint.
        ConfigError: ``--offload always`` on a cluster without a GPU.
        SolverUnavailableError: a requested MILP backend does not work here.
    """
    options = options or SolveOptions()
    problem.verify()
    bound: list[float] = []
    meanwhile = (
        (lambda: bound.append(throughput_bound_samples_per_s(problem))) if with_bound else None
    )
    result = _solve_once(problem, options, schedule, runtime, meanwhile)
    if _memory_shaped(problem, result):
        for name, uniform_problem, uniform_options in uniform_strategies(problem, options):
            try:
                other = _solve_once(uniform_problem, uniform_options, schedule, runtime)
            except InfeasiblePlanError:
                continue
            result = _faster_of(problem, result, other, name, schedule, runtime)
    return replace(result, bound_samples_per_s=bound[0]) if bound else result


def _solve_once(
    problem: PlanningProblem,
    options: SolveOptions,
    schedule: Schedule,
    runtime: RuntimeBytes | None,
    meanwhile: Callable[[], None] | None = None,
) -> SolveResult:
    """:func:`solve` under one setting of ``--recompute``, ``--zero`` and ``--offload``
    (the problem's recompute policy, the options' others), without the uniform ones."""
    if options.offload == "always" and not any(
        can_offload(problem, d) for d in range(problem.num_devices)
    ):
        raise ConfigError(
            "--offload always: no device of this cluster can offload its optimizer state (a "
            "cpu device's memory is the host's); use --offload auto or never"
        )
    try:
        outcome = run_search(problem, options, meanwhile)
    except InfeasiblePlanError:
        if options.offload == "never":
            raise
        outcome = SearchOutcome()  # offload may still fit it (below)
    pool: list[tuple[str, Layout]] = [
        (c.scenario, c.layout) for c in outcome.candidates if c.layout.sync is None
    ]
    for name, baseline in (
        ("data parallel", data_parallel_equal(problem)),
        ("uniform pipeline", uniform_pipeline(problem)),
    ):
        if baseline is not None and _within_max_stages(baseline, options.max_stages):
            pool.append((f"baseline: {name}", with_recompute_policy(problem, baseline)))
    local_pool = [(c.scenario, c.layout) for c in outcome.candidates if c.layout.sync is not None]
    ranked = _ranked(problem, pool)
    if options.zero == "always" or (options.zero == "auto" and _memory_binds(problem, ranked)):
        sharded = _ranked(problem, sharded_candidates(problem, options))
        ranked = (
            sharded
            if options.zero == "always"
            else sorted([*ranked, *sharded], key=lambda item: item[2].step_time_s)
        )
        if options.zero == "always":
            local_pool = []
    if options.offload == "always" or (
        options.offload == "auto" and _nothing_cheaper_fits(problem, ranked)
    ):
        offloaded = _ranked(problem, offload_candidates(problem, options))
        ranked = (
            offloaded
            if options.offload == "always"
            else sorted([*ranked, *offloaded], key=lambda item: item[2].step_time_s)
        )
        local_pool = [] if options.offload == "always" else local_pool
    synchronous = _pick(problem, ranked, schedule, runtime)
    local_ranked = _closest_to_synchronous(problem, _ranked(problem, local_pool))
    local = _pick(problem, local_ranked, schedule, runtime, margin=LOCAL_TIE_SHARE)
    if synchronous is None and local is None:
        raise InfeasiblePlanError(diagnose_infeasible(problem, offload=options.offload))
    chosen, why = choose_sync(problem, options.sync, synchronous, local)
    notes = list(outcome.notes)
    if chosen is synchronous:
        status, gap = _status(outcome)
        if synchronous.preferred_note:
            notes.append(synchronous.preferred_note)
            status, gap = _status_of_runner_up(
                status, gap, synchronous.model_best_s, synchronous.evaluation.step_time_s
            )
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


UNIFORM_STRATEGIES: tuple[tuple[str, RecomputePolicy, str, str], ...] = (
    ("plain", RecomputePolicy.NEVER, "never", "never"),
    ("recompute", RecomputePolicy.ALWAYS, "never", "never"),
    ("zero-1", RecomputePolicy.NEVER, "always", "never"),
    ("offload", RecomputePolicy.NEVER, "never", "always"),
)
"""The uniform memory strategies (name, ``--recompute``, ``--zero``, ``--offload``): every
rank the same, as ``bench/plan_quality.py --compare memory`` compares them with the mixed choice."""


def uniform_strategies(
    problem: PlanningProblem, options: SolveOptions
) -> list[tuple[str, PlanningProblem, SolveOptions]]:
    """The uniform strategies a mixed request also allows, as problems and options to solve.

    A strategy is allowed when each of its three settings equals the request's or the
    request's is ``auto``; the request's own setting is left out, and so is ``offload``
    where no device can offload (a ``cpu`` device's memory is the host's). Empty when the
    request has no ``auto`` (it is uniform itself).
    """
    request = (problem.recompute.value, options.zero, options.offload)
    found = []
    for name, recompute, zero, offload in UNIFORM_STRATEGIES:
        uniform = (recompute.value, zero, offload)
        allowed = all(r in (u, "auto") for r, u in zip(request, uniform, strict=True))
        if uniform == request or not allowed:
            continue
        if offload == "always" and not any(
            can_offload(problem, d) for d in range(problem.num_devices)
        ):
            continue
        found.append(
            (
                name,
                replace(problem, recompute=recompute),
                replace(options, zero=zero, offload=offload),
            )
        )
    return found


def _memory_shaped(problem: PlanningProblem, result: SolveResult) -> bool:
    """Whether memory may have shaped ``result``: a stage recomputes (some or all of its
    units), it shards or offloads optimizer state, or a stage fills more than
    :data:`MEMORY_BINDS_SHARE` of its device (the searches under ``auto`` and under a
    uniform strategy then take different paths; on a cluster with room to spare they are
    the same search)."""
    layout = result.layout
    recomputes = any(s.recompute or s.recompute_units for r in layout.replicas for s in r.stages)
    strategy = recomputes or bool(layout.optimizer_shard_weights) or any(layout.optimizer_offload)
    full = any(
        c.memory_bytes > MEMORY_BINDS_SHARE * float(problem.memory_capacity_bytes[c.device_idx])
        for costs in result.evaluation.stages
        for c in costs
    )
    return strategy or full


def _reported_s(result: SolveResult, simulated: bool) -> float:
    """The step time the plan reports: simulated when ``simulated``, else the cost model's."""
    if simulated and result.simulated_step_time_s is not None:
        return result.simulated_step_time_s
    return result.evaluation.step_time_s


def _faster_of(
    problem: PlanningProblem,
    mixed: SolveResult,
    other: SolveResult,
    name: str,
    schedule: Schedule,
    runtime: RuntimeBytes | None,
) -> SolveResult:
    """``mixed``, or the uniform strategy ``name``'s result ``other`` (re-costed and
    re-simulated on ``problem``) when that is faster.

    Both are compared as the plans report them (as ``--previous`` is): simulated where
    both were simulated, else the cost model's step; a tie keeps ``mixed``. A layout
    ``problem``'s validator refuses is never taken.
    """
    if layout_problems(problem, other.layout):
        return mixed
    evaluation = evaluate(problem, other.layout)
    simulated = mixed.simulated_step_time_s is not None and other.simulated_step_time_s is not None
    simulated_s = (
        simulated_step_time_s(problem, other.layout, schedule, runtime) if simulated else None
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
    note = (
        f"the uniform {name} strategy's layout ({other.source}) takes "
        f"{format_seconds(other_s)} per step ({how}), less than the {format_seconds(mixed_s)} "
        f"of the mixed search's best ({mixed.source}): chose it"
    )
    return replace(
        candidate,
        status=status,
        gap=gap,
        source=f"uniform {name}: {other.source}",
        notes=(*other.notes, note),
    )


MEMORY_BINDS_SHARE = 0.8
"""A stage filling more than this share of its device's usable memory counts as bound by
memory (``_memory_binds``)."""


def _memory_binds(problem: PlanningProblem, ranked: list[tuple[str, Layout, Evaluation]]) -> bool:
    """Whether memory may bind the fastest layout found, so that ZeRO's shards may help: none
    was found, it leaves idle a device the whole model does not fit (:func:`_idle_for_memory`)
    or gives such a device part of the model (:func:`_split_for_memory`: with shards it might
    hold a whole replica), a stage recomputes (some or all of its units), or a stage fills
    more than :data:`MEMORY_BINDS_SHARE` of its device, unless it is a replica of one stage
    that runs its whole share as one micro-batch (memory did not cut its micro-batch, and
    shards would only add their all-gather: GPT-2 124M on mixed-3090-4090 searched shards
    for 2.4 s for nothing)."""
    if not ranked:
        return True
    _, layout, evaluation = ranked[0]
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


def _whole_model_bytes(problem: PlanningProblem) -> float:
    """Parameters, gradients and optimizer state of the whole model and one micro-batch of
    the smallest size's activations (a tied parameter counts in each unit that uses it, so
    this errs towards "does not fit")."""
    return float(problem.static_memory_bytes.sum()) + float(
        problem.activation_bytes_per_sample.sum()
    ) * min(problem.micro_batch_sizes)


def _split_for_memory(problem: PlanningProblem, layout: Layout) -> bool:
    """Whether ``layout`` gives a device that cannot hold the whole model
    (:func:`_whole_model_bytes`) a stage of part of it: memory may be why that device is a
    pipeline stage rather than a replica (seen: four 12 GB cards as one GPT-2 medium
    pipeline, 0.628 s a step simulated, where ZeRO-1 replicas take 0.599 s)."""
    whole_bytes = _whole_model_bytes(problem)
    return any(
        len(replica.stages) > 1
        and whole_bytes > float(problem.memory_capacity_bytes[stage.device_idx])
        for replica in layout.replicas
        for stage in replica.stages
    )


def _idle_for_memory(problem: PlanningProblem, layout: Layout) -> bool:
    """Whether ``layout`` leaves idle a device that cannot hold the whole model (its
    parameters, gradients and optimizer state and one micro-batch of the smallest size's
    activations; a tied parameter counts in each unit that uses it, so this errs towards
    "cannot"): memory may be why it is idle. A device that could hold it is idle for speed
    (its links, its launch overhead), which no memory strategy changes."""
    whole_bytes = _whole_model_bytes(problem)
    used = set(layout.device_indices)
    return any(
        whole_bytes > float(problem.memory_capacity_bytes[d])
        for d in range(problem.num_devices)
        if d not in used
    )


def sharded_candidates(problem: PlanningProblem, options: SolveOptions) -> list[tuple[str, Layout]]:
    """Layouts that fit with ZeRO's uneven shards (``cost.zero``): stage 1, searched on the
    problem with the least state any sharding leaves (``zero.sharded_problem``), each sized
    by ``zero.shard_weights`` and kept only where every device then fits; then stage 2,
    searched on the problem that also leaves out the flat gradient copies, kept only for
    layouts that stage 1 cannot fit (stage 2 is costed as stage 1, so where both fit the
    solver keeps stage 1)."""
    found: list[tuple[str, Layout]] = []
    for stage in (1, 2):
        sharded = sharded_problem(problem, stage)
        if sharded is None:
            return found
        try:
            search = run_search(sharded, replace(options, sync=SyncRequest.ALL_REDUCE))
        except InfeasiblePlanError:  # the unsharded search found nothing either
            continue
        for candidate in search.candidates:
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
                found.append((f"zero-{stage}: {candidate.scenario}", sharded_layout))
    return found


def _nothing_cheaper_fits(
    problem: PlanningProblem, ranked: list[tuple[str, Layout, Evaluation]]
) -> bool:
    """Whether offload may help (``--offload auto``): no layout was found, or the fastest
    leaves idle a device the whole model does not fit (:func:`_idle_for_memory`)."""
    return not ranked or _idle_for_memory(problem, ranked[0][1])


def offload_candidates(problem: PlanningProblem, options: SolveOptions) -> list[tuple[str, Layout]]:
    """Layouts that fit with optimizer-state offload (``cost.offload``): searched on the
    problem where every device offloads (``offload.offload_problem``); under ``auto`` each
    keeps offload only on the devices that do not fit without it
    (``offload.offload_flags``), under ``always`` on every GPU (a ``cpu`` device's memory
    is the host's: offload frees none of it); kept only where every device and every
    node's host memory then fit."""
    offloaded = offload_problem(problem)
    if offloaded is None:
        return []
    found = []
    request = replace(options, sync=SyncRequest.ALL_REDUCE)
    try:
        candidates = run_search(offloaded, request).candidates
    except InfeasiblePlanError:
        return []
    for candidate in candidates:
        layout = candidate.layout
        if layout.sync is not None and layout.sync.local:
            continue
        memory = {
            c.device_idx: c.memory_bytes
            for costs in evaluate(problem, layout).stages
            for c in costs
        }
        if options.offload == "always":
            flags: tuple[bool, ...] | None = tuple(
                d in memory and can_offload(problem, d) for d in range(problem.num_devices)
            )
        else:
            flags = offload_flags(problem, layout, memory)
        if flags is not None and any(flags):
            found.append(
                (f"offload: {candidate.scenario}", replace(layout, optimizer_offload=flags))
            )
    return found


def with_recompute_policy(problem: PlanningProblem, layout: Layout) -> Layout:
    """``layout`` with every stage recomputing under ``RecomputePolicy.ALWAYS`` (a baseline
    built without the policy), else itself."""
    if problem.recompute is not RecomputePolicy.ALWAYS:
        return layout
    replicas = tuple(
        replace(r, stages=tuple(replace(s, recompute=True, recompute_units=()) for s in r.stages))
        for r in layout.replicas
    )
    return replace(layout, replicas=replicas)


LOCAL_PLAN_NOTE = (
    "each island was solved on its own for its share of the batch, the shares re-solved "
    "until the islands finish their steps together: no optimality claim across islands"
)


@dataclass(frozen=True)
class Pick:
    """The best of a ranked pool after the simulator's second opinion."""

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


def _closest_to_synchronous(
    problem: PlanningProblem, ranked: list[tuple[str, Layout, Evaluation]]
) -> list[tuple[str, Layout, Evaluation]]:
    """``ranked`` (fastest first) with the preferred of the tied local plans first
    (:data:`LOCAL_TIE_SHARE`)."""
    if not ranked:
        return ranked
    limit = ranked[0][2].step_time_s * (1 + LOCAL_TIE_SHARE)
    tied = [item for item in ranked if item[2].step_time_s <= limit]

    def closeness(item: tuple[str, Layout, Evaluation]) -> tuple[int, float]:
        layout = item[1]
        assert layout.sync is not None
        islands = island_index(problem, layout.sync)
        return len({islands[d] for d in layout.device_indices}), item[2].step_time_s

    preferred = min(tied, key=closeness)
    return [preferred, *(item for item in ranked if item is not preferred)]


def _pick(
    problem: PlanningProblem,
    ranked: list[tuple[str, Layout, Evaluation]],
    schedule: Schedule,
    runtime: RuntimeBytes | None,
    margin: float = 1e-9,
) -> Pick | None:
    if not ranked:
        return None
    top = ranked[:SIMULATED_CANDIDATES]
    layouts = [layout for _, layout, _ in top]
    chosen, simulated = second_opinion(problem, layouts, schedule, runtime, margin=margin)
    source, layout, ev = top[chosen]
    note = _preferred_note(top, simulated, chosen) if chosen > 0 else None
    return Pick(source, layout, ev, simulated[chosen], note, top[0][2].step_time_s)


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
            if local is None and request in (SyncRequest.LOCAL_SGD, SyncRequest.ASYNC)
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
    wire = "" if sync.wire_dtype is PseudoGradientDtype.FLOAT32 else f", {sync.wire_dtype}"
    return f"{sync.mode.value} H={sync.local_steps}{wire}"


def _within_max_stages(layout: Layout, max_stages: int) -> bool:
    """True when no replica of ``layout`` has more than ``max_stages`` stages."""
    return all(replica.num_stages <= max_stages for replica in layout.replicas)


def _ranked(
    problem: PlanningProblem, pool: list[tuple[str, Layout]]
) -> list[tuple[str, Layout, Evaluation]]:
    """Valid distinct layouts of the pool, each with its shares cut into equal micro-batches
    (``even_microbatches``), fastest first under the cost model (stable)."""
    seen: set[Layout] = set()
    ranked = []
    for source, pooled in pool:
        layout = even_microbatches(problem, pooled)
        if layout in seen or layout_problems(problem, layout):
            continue
        seen.add(layout)
        ranked.append((source, layout, evaluate(problem, layout)))
    return sorted(ranked, key=lambda item: item[2].step_time_s)


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
    outer sync amortised (``sim.engine``, rule 6). A layout too large to simulate (None, see
    ``sim.spec.MAX_SIMULATED_MICROBATCHES``) is never preferred, and when the cost model's
    best is too large the cost model's order stands.
    """
    simulated = tuple(
        simulated_step_time_s(problem, layout, schedule, runtime) for layout in layouts
    )
    chosen, best_s = 0, simulated[0]
    if best_s is None:
        return chosen, simulated
    for idx, time_s in enumerate(simulated):
        if time_s is not None and time_s < best_s * (1 - margin):
            chosen, best_s = idx, time_s
    return chosen, simulated


def _preferred_note(
    top: list[tuple[str, Layout, Evaluation]], simulated: tuple[float | None, ...], chosen: int
) -> str:
    """Why the simulator's choice replaced the cost model's best (both were simulated)."""
    best_source, _, best_ev = top[0]
    source, _, ev = top[chosen]
    return (
        f"the simulator preferred the layout from {source} "
        f"(simulated {(simulated[chosen] or 0.0) * 1e3:.4g} ms, cost model {ev.step_time_s * 1e3:.4g} ms) "
        f"to the cost model's best from {best_source} "
        f"(simulated {(simulated[0] or 0.0) * 1e3:.4g} ms, cost model {best_ev.step_time_s * 1e3:.4g} ms)"
    )


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
