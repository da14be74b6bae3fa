"""Search for replicas, pipelines, unit splits and batch shares: the planning MILP.

An outer enumeration around an inner integer program. A *shape* is an ordered list of
device groups (``device_groups``) with a micro-batch size, split optimally by
``partition``. A gradient-sync *scenario* (``scenarios``) fixes each copy's all-reduce
time, so a copy of shape t runs ``(m - 1) P_t + F_t + O_t + A_t`` (period, fill,
optimizer, all-reduce) and by a target step time T processes ``PipeTimes.samples_by(T)``
samples. The least T is found by bisection (:func:`_bisect`), each step a small covering
MILP (``milp.solve_cover``: integer copy counts covering the global batch within the
classes' sizes), linear since no product of decisions appears; the exact evaluator prunes
each answer. Each distinct node is
searched alone first (the answer is never worse than the best single-node layout), and the
local plans of every island partition follow where ``--sync`` allows (``local_plan``).
The answer is proven optimal under the planning model when every bisection step was proven
and the shapes were enumerated exhaustively; otherwise the report gives the gap.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TypeVar

import numpy as np

from hplan.planner.cost.evaluate import evaluate
from hplan.planner.cost.islands import Partition, candidate_partitions
from hplan.planner.cost.layout import Layout, StageLayout, replica_layout
from hplan.planner.cost.microbatch import PipeTimes, pipe_times
from hplan.planner.cost.problem import PlanningProblem, Policy, restrict
from hplan.planner.cost.shares import share_options
from hplan.planner.solve.device_groups import (
    DeviceGroup,
    device_groups,
    node_groups,
    pair_devices,
)
from hplan.planner.solve.local_plan import local_plans
from hplan.planner.solve.milp import (
    CoverStatus,
    MilpBackend,
    copy_upper_bounds,
    select_backend,
    solve_cover,
)
from hplan.planner.solve.partition import PipelineShape, enumerate_shapes
from hplan.planner.solve.scenarios import Scenario, allreduce_estimate_s, make_scenarios
from hplan.planner.solve.sync_choice import (
    DEFAULT_MAX_LOCAL_STEPS,
    DEFAULT_MAX_OVERLAP_STEPS,
    SyncRequest,
    SyncRules,
    WireRequest,
    wants_local,
)
from hplan.planner.solve.watchdog import run_with_deadline
from hplan.runtime.contract.errors import InfeasiblePlanError
from hplan.runtime.contract.plan import CPU_KIND
from hplan.runtime.contract.quantities import format_bytes, format_bytes_pair

_E = TypeVar("_E", bound=StrEnum)

TEMPLATE_BUDGET_SHARE = 0.4
"""Share of the remaining time the heuristic shape enumeration may use."""
NODE_SEARCH_SHARE = 0.15
"""Share of the remaining time each single-node search may use."""
LOCAL_SEARCH_SHARE = 0.5
"""Share of the time limit kept for the local plans, when the search makes them."""


@dataclass(frozen=True)
class SolveOptions:
    """Knobs of the search. Strings are accepted for the enum fields (``"never"``) and
    converted on construction; an unknown one raises ValueError naming it."""

    time_limit_s: float = 60.0
    """Wall-clock limit of the whole solve; the best layout found by then is returned."""
    backend: MilpBackend | None = None
    """The MILP backend; None picks the first that works (HiGHS, CBC, the heuristic)."""
    max_stages: int = 8
    exhaustive_limit: int = 4000
    """Enumerate every class order and every split when the count of (order, split,
    micro-batch size) triples stays under this; otherwise use heuristics."""
    watchdog: bool = True
    """Run the search in a child process that is killed at the deadline (no leftovers)."""
    sync: SyncRequest = SyncRequest.ALL_REDUCE
    """Which sync modes across islands the planner may choose (``sync_choice``)."""
    max_local_steps: int = DEFAULT_MAX_LOCAL_STEPS
    """H at most, under local sync."""
    wire: WireRequest = WireRequest.AUTO
    """The pseudo-gradients' wire format (``hplan solve --wire``), or ``auto``."""
    max_overlap_steps: int = DEFAULT_MAX_OVERLAP_STEPS
    """tau at most: inner steps an outer sync may travel behind (``--max-overlap-steps``)."""
    zero: Policy = Policy.AUTO
    """ZeRO stage 1, or 2 where 1 does not fit (``hplan solve --zero``): ``auto`` (sharded
    layouts are searched too when memory binds the best unsharded one, and compete on
    speed), ``never``, ``always`` (only sharded layouts)."""
    offload: Policy = Policy.AUTO
    """Optimizer-state offload to host memory (``hplan solve --offload``, ``cost.offload``):
    ``auto`` (searched when nothing cheaper fits: no plan, or a device left idle; kept only
    on the devices that need it, and only if faster), ``never``, ``always`` (every device)."""
    tensor_parallel: Policy = Policy.AUTO
    """Tensor-parallel groups (``hplan solve --tensor-parallel``, ``solve.strategy``):
    ``auto`` inside NVLink nodes, and over PCIe on GeForce cards only where nothing else
    fits; ``never``; ``always`` (only layouts with TP groups, wherever the model allows)."""

    def __post_init__(self) -> None:
        for name, kind in (
            ("sync", SyncRequest),
            ("wire", WireRequest),
            ("zero", Policy),
            ("offload", Policy),
            ("tensor_parallel", Policy),
        ):
            object.__setattr__(self, name, _member(kind, getattr(self, name), name))
        if self.backend is not None:
            object.__setattr__(self, "backend", _member(MilpBackend, self.backend, "backend"))

    @property
    def sync_rules(self) -> SyncRules:
        """The options the choice of each spanning holder set follows (``sync_choice``)."""
        return SyncRules(
            request=self.sync,
            max_local_steps=self.max_local_steps,
            wire=self.wire,
            max_overlap_steps=self.max_overlap_steps,
        )


def _member(kind: type[_E], value: str, name: str) -> _E:
    """``value`` as a member of ``kind`` (ValueError naming ``name`` and the choices)."""
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(m.value for m in kind)
        raise ValueError(f"SolveOptions.{name} {value!r} is not one of {choices}") from None


@dataclass(frozen=True)
class Candidate:
    """A layout found by one search scenario, with what the search proved about it."""

    layout: Layout
    scenario: str
    model_time_s: float
    lower_bound_s: float
    proven: bool
    main: bool = True
    """False for candidates of a single-node sub-search (they prove nothing globally)."""


@dataclass
class SearchOutcome:
    """What the search reports back (also across the watchdog's process boundary)."""

    candidates: list[Candidate] = field(default_factory=list)
    exhaustive: bool = False
    complete: bool = False
    finished: bool = False
    backend: str = ""
    notes: list[str] = field(default_factory=list)


@dataclass
class _Bisection:
    """Arrays of one scenario's shapes and the covering check at a target time."""

    problem: PlanningProblem
    shapes: list[PipelineShape]
    pipes: list[PipeTimes]
    """Each shape's step time for any share, on its class's first devices."""
    usage: np.ndarray
    available: np.ndarray
    max_copies: int
    backend: MilpBackend

    def capacity(self, target_s: float) -> np.ndarray:
        b = self.problem.global_batch_size
        return np.array([p.samples_by(target_s, b) for p in self.pipes], dtype=float)

    def check(self, target_s: float, deadline: float, minimize: bool = False):  # type: ignore[no-untyped-def]
        cap = self.capacity(target_s)
        demand = self.problem.global_batch_size
        copies_bound = np.minimum(copy_upper_bounds(self.usage, self.available), self.max_copies)
        if float(np.dot(cap, copies_bound)) < demand:
            return CoverStatus.INFEASIBLE, None, True
        if not minimize:
            single = np.flatnonzero(cap >= demand)
            if single.size:
                counts = np.zeros(len(cap), dtype=int)
                counts[single[np.argmin(self.usage[:, single].sum(axis=0))]] = 1
                return CoverStatus.FEASIBLE, tuple(counts), True
        result = solve_cover(
            capacity=cap,
            usage=self.usage,
            available=self.available,
            demand=demand,
            max_copies=self.max_copies,
            minimize_copies=minimize,
            backend=self.backend,
            time_limit_s=max(0.05, deadline - time.monotonic()),
        )
        return result.status, result.counts, result.proven_optimal


MAX_CANDIDATE_TIMES = 2_000_000
"""Above this many possible copy times, bisect on the real line instead of the list."""


def _candidate_times(bis: _Bisection) -> np.ndarray | None:
    """Every possible copy time of whole micro-batches (and of the whole batch), sorted;
    None when there are too many to list."""
    b = bis.problem.global_batch_size
    counts = [-(-b // p.micro_batch_size) for p in bis.pipes]
    if sum(counts) > MAX_CANDIDATE_TIMES:
        return None
    values = []
    for p, count in zip(bis.pipes, counts, strict=True):
        samples = np.minimum(np.arange(1, count + 1) * p.micro_batch_size, b)
        times = p.times_s(b)[samples - 1]
        values.append(times[np.isfinite(times)])  # beyond what memory holds: never
    return np.unique(np.concatenate(values)) if values else np.empty(0)


def _times_between(bis: _Bisection, low_s: float, high_s: float) -> np.ndarray:
    """Every possible copy time in ``(low_s, high_s]``, sorted (shares of any size)."""
    b = bis.problem.global_batch_size
    values = [t[(t > low_s) & (t <= high_s)] for t in (p.times_s(b) for p in bis.pipes)]
    return np.unique(np.concatenate(values))


@dataclass(frozen=True)
class _Sorted:
    """What a bisection over a sorted list of times found."""

    index: int
    """Of the smallest time found feasible."""
    counts: tuple[int, ...]
    infeasible: int
    """Index of the largest time proven infeasible; -1 if none."""
    definitive: bool
    """Every check answered (none timed out or ended unknown)."""


def _bisect_sorted(
    bis: _Bisection, times: np.ndarray, deadline: float, counts: tuple[int, ...]
) -> _Sorted:
    """Bisection over ``times`` (sorted; the last one feasible with ``counts``)."""
    lo, hi = 0, len(times) - 1
    best_counts, definitive, infeasible = counts, True, -1
    while lo < hi and time.monotonic() < deadline:
        mid = (lo + hi) // 2
        if _still_covers(bis, float(times[mid]), best_counts):
            hi = mid
            continue
        status, found, _ = bis.check(float(times[mid]), deadline)
        if status is CoverStatus.FEASIBLE and found is not None:
            hi, best_counts = mid, found
            continue
        lo = mid + 1
        if status is CoverStatus.INFEASIBLE:
            infeasible = max(infeasible, mid)
        else:
            definitive = False
    return _Sorted(hi, best_counts, infeasible, definitive and lo >= hi)


def _still_covers(bis: _Bisection, target_s: float, counts: tuple[int, ...]) -> bool:
    """Whether ``counts`` (feasible at a later time, so within every device class) still
    covers the batch by ``target_s``: feasible without asking the MILP."""
    return float(np.dot(bis.capacity(target_s), counts)) >= bis.problem.global_batch_size


def _bisect(bis: _Bisection, deadline: float) -> tuple[float, tuple[int, ...], float, bool] | None:
    """Smallest feasible target time.

    Feasibility is monotone in the target time (capacities only grow), so bisection over
    the finite set of possible copy times finds the optimum when every check is
    definitive: first over the times of whole micro-batches, then over every time (shares
    with a smaller last micro-batch) between the last infeasible and the first feasible one.
    Returns (time, copy counts, lower bound, proven) or None when nothing is feasible.
    """
    coarse = _candidate_times(bis)
    if coarse is None:
        return _bisect_real(bis, deadline)
    if coarse.size == 0:
        return None
    status, counts, _ = bis.check(float(coarse[-1]), deadline)
    if status is not CoverStatus.FEASIBLE or counts is None:
        return None
    first = _bisect_sorted(bis, coarse, deadline, counts)
    below = float(coarse[first.index - 1]) if first.index > 0 else -np.inf
    fine = _times_between(bis, below, float(coarse[first.index]))
    second = _bisect_sorted(bis, fine, deadline, first.counts)
    found = float(fine[second.index])
    proven = first.definitive and second.definitive
    return found, second.counts, _lower_bound(bis, coarse, fine, first, second, proven), proven


def _lower_bound(
    bis: _Bisection,
    coarse: np.ndarray,
    fine: np.ndarray,
    first: _Sorted,
    second: _Sorted,
    proven: bool,
) -> float:
    """The smallest copy time not proven infeasible by :func:`_bisect`'s two bisections."""
    if proven:
        return float(fine[second.index])
    if second.infeasible >= 0:
        return float(fine[second.infeasible + 1])
    if first.infeasible == first.index - 1 >= 0:
        return float(fine[0])
    if first.infeasible >= 0:
        return float(coarse[first.infeasible])
    return min(p.time_s(1) for p in bis.pipes)


def _bisect_real(
    bis: _Bisection, deadline: float
) -> tuple[float, tuple[int, ...], float, bool] | None:
    """Bisection on the real line (huge batches): stops at a relative width of 1e-6."""
    b = bis.problem.global_batch_size
    hi = max(p.time_s(p.most_samples(b)) for p in bis.pipes)
    lo = min(p.time_s(1) for p in bis.pipes)
    status, counts, _ = bis.check(hi, deadline)
    if status is not CoverStatus.FEASIBLE or counts is None:
        return None
    best_counts, lower = counts, lo
    while hi - lo > 1e-6 * hi and time.monotonic() < deadline:
        mid = (lo + hi) / 2
        status, counts, _ = bis.check(mid, deadline)
        if status is CoverStatus.FEASIBLE and counts is not None:
            hi, best_counts = mid, counts
        else:
            lo = mid
            lower = mid if status is CoverStatus.INFEASIBLE else lower
    return hi, best_counts, lower, False


def _fewest_copies(
    bis: _Bisection, target_s: float, deadline: float, counts: tuple[int, ...]
) -> tuple[int, ...]:
    """Among the layouts that meet ``target_s``, one with the fewest replicas."""
    if time.monotonic() >= deadline:
        return counts
    status, fewest, _ = bis.check(target_s, deadline, minimize=True)
    return fewest if status is CoverStatus.FEASIBLE and fewest is not None else counts


# ---------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class _Copy:
    shape: PipelineShape
    devices: tuple[int, ...]
    pipe: PipeTimes
    """Its step time for any share (``cost.microbatch``), the scenario's estimates added."""

    @property
    def stages(self) -> tuple[StageLayout, ...]:
        return shape_stages(self.shape, self.devices)


def shape_stages(shape: PipelineShape, devices: Sequence[int]) -> tuple[StageLayout, ...]:
    """The stages of ``shape`` on ``devices`` (one per stage, in order)."""
    return tuple(
        StageLayout(
            devices[s],
            shape.bounds[s],
            shape.bounds[s + 1],
            shape.recompute[s],
            shape.recompute_units[s] if shape.recompute_units else (),
        )
        for s in range(shape.num_stages)
    )


_PipeCache = dict[tuple[PipelineShape, tuple[int, ...]], PipeTimes]
"""Pipe times of (shape, devices) without extra time, shared by a problem's scenarios."""


def shape_pipe(
    problem: PlanningProblem,
    shape: PipelineShape,
    devices: Sequence[int],
    extra_s: float,
    cache: _PipeCache | None = None,
) -> PipeTimes:
    """``cost.microbatch.pipe_times`` of ``shape`` on ``devices``, ``extra_s`` added."""
    key = (shape, tuple(devices))
    cached = None if cache is None else cache.get(key)
    if cached is None:
        stages = shape_stages(shape, devices)
        cached = pipe_times(problem, stages, shape.micro_batch_size, 0.0, shape.max_samples)
        if cache is not None:
            cache[key] = cached
    return replace(cached, extra_s=extra_s)


def _copies(
    problem: PlanningProblem,
    classes: Sequence[DeviceGroup],
    shapes: Sequence[PipelineShape],
    counts: Sequence[int],
    extra: np.ndarray,
    cache: _PipeCache,
) -> list[_Copy]:
    used = {c: 0 for c in range(len(classes))}
    out = []
    for t_idx, count in enumerate(counts):
        t = shapes[t_idx]
        for _ in range(count):
            devices = []
            local: dict[int, int] = {}
            for c in t.classes:
                devices.append(classes[c].devices[used[c] + local.get(c, 0)])
                local[c] = local.get(c, 0) + 1
            for c, n in local.items():
                used[c] += n
            pipe = shape_pipe(problem, t, devices, float(extra[t_idx]), cache)
            out.append(_Copy(t, tuple(devices), pipe))
    return out


def shared_layout(problem: PlanningProblem, copies: Sequence[_Copy]) -> tuple[float, Layout]:
    """(step time, layout) of ``copies`` sharing the global batch: of the shares
    ``shares.share_options`` offers, the one the exact evaluator rates fastest."""
    options = share_options([c.pipe for c in copies], problem.global_batch_size)
    layouts = [layout_from_copies(copies, samples) for samples in options]
    timed = [(evaluate(problem, layout).step_time_s, layout) for layout in layouts]
    return min(timed, key=lambda item: item[0])


def layout_from_copies(copies: Sequence[_Copy], samples: Sequence[int]) -> Layout:
    """Replicas for every copy that received samples (a micro-batch never larger than the
    share: ``layout.replica_layout``)."""
    return Layout(
        tuple(
            replica_layout(copy.stages, copy.shape.micro_batch_size, n)
            for copy, n in zip(copies, samples, strict=True)
            if n > 0
        )
    )


def _prune_copies(problem: PlanningProblem, copies: list[_Copy], deadline: float) -> Layout:
    """Drop replicas while the exact evaluator says the step gets faster.

    The scenario's all-reduce estimate cannot see that fewer replicas sync faster; this
    local search on the exact cost model can (steepest descent, one replica at a time).
    """
    current = list(copies)
    best, layout = shared_layout(problem, current)
    while len(current) > 1 and time.monotonic() < deadline:
        trials = []
        for i in range(len(current)):
            step_s, trial = shared_layout(problem, current[:i] + current[i + 1 :])
            trials.append((step_s, i, trial))
        step, i, trial = min(trials, key=lambda x: (x[0], x[1]))
        if step >= best * (1 - 1e-9):
            break
        best, layout = step, trial
        current.pop(i)
    return layout


def _solve_scenario(
    problem: PlanningProblem,
    classes: Sequence[DeviceGroup],
    shapes: Sequence[PipelineShape],
    scenario: Scenario,
    backend: MilpBackend,
    deadline: float,
    cache: _PipeCache,
) -> Candidate | None:
    chosen = [t for t in shapes if set(t.classes) <= scenario.classes]
    if not chosen:
        return None
    buckets = degree_buckets(problem, classes, chosen)
    found = [
        _solve_bucket(problem, classes, bucket, scenario, backend, deadline, cache)
        for bucket in buckets
    ]
    kept = [c for c in found if c is not None]
    if len(kept) < 2:
        return kept[0] if kept else None
    return min(kept, key=lambda c: evaluate(problem, c.layout).step_time_s)


MAX_DEGREE_BUCKETS = 6
"""The most degree buckets (:func:`degree_buckets`) a scenario searches, fastest first."""


def degree_buckets(
    problem: PlanningProblem, classes: Sequence[DeviceGroup], shapes: Sequence[PipelineShape]
) -> list[list[PipelineShape]]:
    """``shapes`` grouped so that copies of one group's shapes give every unit holders of
    one TP degree (the contract's rule): by the degree each unit's stage has; a shape that
    puts units sharing a tied parameter at two degrees is left out. One group
    where the problem's devices share one degree; else at most :data:`MAX_DEGREE_BUCKETS`
    of those with a TP stage, those whose best shape runs the most samples per second of
    period first."""
    if len(problem.distinct_degrees) == 1:
        return [list(shapes)]  # one degree: every layout keeps it
    buckets: dict[tuple[int, ...], list[PipelineShape]] = {}
    for t in shapes:
        signature = tuple(
            problem.degree(classes[c].rep)
            for s, c in enumerate(t.classes)
            for _ in range(t.bounds[s], t.bounds[s + 1])
        )
        if max(signature) == 1:  # single cards alone: the families without TP search them
            continue
        if any(len({signature[u] for u in tied.units}) > 1 for tied in problem.tied_params):
            continue  # a parameter tied between units held at two degrees (validate.py)
        buckets.setdefault(signature, []).append(t)

    def rate(bucket: list[PipelineShape]) -> float:
        return max(t.micro_batch_size / t.period_s if t.period_s > 0 else math.inf for t in bucket)

    return sorted(buckets.values(), key=rate, reverse=True)[:MAX_DEGREE_BUCKETS]


def _solve_bucket(
    problem: PlanningProblem,
    classes: Sequence[DeviceGroup],
    chosen: Sequence[PipelineShape],
    scenario: Scenario,
    backend: MilpBackend,
    deadline: float,
    cache: _PipeCache,
) -> Candidate | None:
    """:func:`_solve_scenario` over shapes that may share a layout."""
    extra = np.array(
        [t.optimizer_s + allreduce_estimate_s(problem, classes, scenario, t) for t in chosen]
    )
    usage = np.zeros((len(classes), len(chosen)), dtype=np.int64)
    for j, t in enumerate(chosen):
        for c in t.classes:
            usage[c, j] += 1
    bis = _Bisection(
        problem=problem,
        shapes=list(chosen),
        pipes=[
            shape_pipe(problem, t, pair_devices(classes, t.classes), float(e), cache)
            for t, e in zip(chosen, extra, strict=True)
        ],
        usage=usage,
        available=np.array([c.size for c in classes], dtype=np.int64),
        max_copies=scenario.max_copies,
        backend=backend,
    )
    found = _bisect(bis, deadline)
    if found is None:
        return None
    model_time, counts, lower, proven = found
    # The fewest replicas that meet the time, and the copies found: the exact evaluator
    # (``_prune_copies``) decides, as the scenario's all-reduce estimate cannot.
    fewest = _fewest_copies(bis, model_time, deadline, counts)
    layouts = [
        _prune_copies(problem, _copies(problem, classes, chosen, c, extra, cache), deadline)
        for c in dict.fromkeys((fewest, counts))
    ]
    layout = min(layouts, key=lambda x: evaluate(problem, x).step_time_s)
    return Candidate(layout, scenario.name, model_time, lower, proven)


def search_problem(
    problem: PlanningProblem,
    options: SolveOptions,
    backend: MilpBackend,
    deadline: float,
    report: Callable[[Candidate], None],
) -> tuple[bool, bool]:
    """Search one problem; report each candidate. Returns (exhaustive, complete)."""
    classes = device_groups(problem)
    budget = time.monotonic() + TEMPLATE_BUDGET_SHARE * max(deadline - time.monotonic(), 0.0)
    found = enumerate_shapes(
        problem,
        classes,
        max_stages=options.max_stages,
        exhaustive_limit=options.exhaustive_limit,
        budget_deadline=budget,
    )
    if not found.shapes:
        if not found.complete:
            return False, False
        raise InfeasiblePlanError(
            diagnose_infeasible(problem, zero=options.zero, max_stages=options.max_stages)
        )
    complete = found.complete
    cache: _PipeCache = {}
    for scenario in make_scenarios(problem, classes):
        if time.monotonic() >= deadline:
            complete = False
            break
        candidate = _solve_scenario(
            problem, classes, found.shapes, scenario, backend, deadline, cache
        )
        if candidate is not None:
            report(candidate)
    return found.exhaustive, complete


def search(
    problem: PlanningProblem,
    options: SolveOptions,
    deadline: float,
    report: Callable[[object], None],
) -> None:
    """Single-node searches, then the whole cluster, then (when ``options.sync`` allows
    them and they may be chosen) the local plans; ``report`` receives Candidates, then the
    final SearchOutcome."""
    backend = select_backend(options.backend)
    outcome = SearchOutcome(backend=backend.value)
    if backend is MilpBackend.HEURISTIC:
        outcome.notes.append(
            "greedy planner (as requested): no optimality claim"
            if options.backend is MilpBackend.HEURISTIC
            else "no MILP solver works here; used the greedy planner (install highspy)"
        )
    partitions = candidate_partitions(problem) if options.sync is not SyncRequest.ALL_REDUCE else ()
    main_deadline = deadline
    if partitions:
        main_deadline -= LOCAL_SEARCH_SHARE * max(deadline - time.monotonic(), 0.0)
    synchronous: list[Candidate] = []

    def keep(candidate: Candidate) -> None:
        synchronous.append(candidate)
        report(candidate)

    outcome.exhaustive, outcome.complete = _search_nodes_and_whole(
        problem, options, backend, main_deadline, keep
    )
    if partitions and wants_local(problem, [c.layout for c in synchronous], options.sync):
        _search_local(problem, partitions, options, backend, deadline, report)
    outcome.finished = time.monotonic() < deadline
    if not outcome.complete:
        outcome.notes.append(
            "the time limit cut the search short; the plan may improve with a longer --time-limit"
        )
    report(outcome)


def _search_nodes_and_whole(
    problem: PlanningProblem,
    options: SolveOptions,
    backend: MilpBackend,
    deadline: float,
    report: Callable[[Candidate], None],
) -> tuple[bool, bool]:
    """Each distinct node alone, then the whole problem; (exhaustive, complete) of the
    whole problem's search."""
    for node in _single_nodes(problem):
        sub, devices = subproblem(problem, {node})
        sub_deadline = time.monotonic() + NODE_SEARCH_SHARE * max(deadline - time.monotonic(), 0.0)
        # The model may not fit one node alone; the whole cluster may still hold it.
        with contextlib.suppress(InfeasiblePlanError):
            search_problem(sub, options, backend, sub_deadline, _mapped(report, devices, node))
    return search_problem(problem, options, backend, deadline, report)


def _search_local(
    problem: PlanningProblem,
    partitions: Sequence[Partition],
    options: SolveOptions,
    backend: MilpBackend,
    deadline: float,
    report: Callable[[object], None],
) -> None:
    """Report the local plans of every partition (``local_plan.local_plans``), each island
    searched as a whole problem is (:func:`_search_nodes_and_whole`)."""

    def search_island(sub: PlanningProblem, sub_deadline: float) -> list[Layout]:
        found: list[Layout] = []
        with contextlib.suppress(InfeasiblePlanError):
            _search_nodes_and_whole(
                sub, options, backend, sub_deadline, lambda c: found.append(c.layout)
            )
        return found

    plans = local_plans(
        problem,
        partitions,
        search_island,
        deadline,
        rules=options.sync_rules,
    )
    for label, layout in plans:
        step_s = evaluate(problem, layout).step_time_s
        report(Candidate(layout, label, step_s, 0.0, False, main=False))


def _single_nodes(problem: PlanningProblem) -> list[str]:
    """One node of each group of interchangeable nodes (none on a one-node cluster)."""
    if len(set(problem.device_nodes)) < 2:
        return []
    return [group[0] for group in node_groups(problem)]


def _mapped(
    report: Callable[[Candidate], None], devices: Sequence[int], node: str
) -> Callable[[Candidate], None]:
    def forward(candidate: Candidate) -> None:
        layout = Layout(
            tuple(
                replace(
                    r, stages=tuple(replace(s, device_idx=devices[s.device_idx]) for s in r.stages)
                )
                for r in candidate.layout.replicas
            )
        )
        report(
            replace(
                candidate, layout=layout, scenario=f"{node} alone: {candidate.scenario}", main=False
            )
        )

    return forward


def subproblem(
    problem: PlanningProblem, nodes: Collection[str], global_batch_size: int | None = None
) -> tuple[PlanningProblem, tuple[int, ...]]:
    """The problem restricted to the devices of ``nodes`` (``cost.problem.restrict``; for a
    global batch of ``global_batch_size``, default the same), and their indices in
    ``problem``."""
    devices = tuple(d for d, n in enumerate(problem.device_nodes) if n in nodes)
    return restrict(problem, devices, global_batch_size), devices


def run_search(
    problem: PlanningProblem,
    options: SolveOptions,
    meanwhile: Callable[[], None] | None = None,
) -> SearchOutcome:
    """``search`` under the wall-clock limit (a watchdog child process by default);
    ``meanwhile`` runs in this process while the child searches (``run_with_deadline``)."""
    items, finished = run_with_deadline(
        lambda deadline, report: search(problem, options, deadline, report),
        options.time_limit_s,
        use_child=options.watchdog,
        meanwhile=meanwhile,
    )
    candidates = [item for item in items if isinstance(item, Candidate)]
    outcomes = [item for item in items if isinstance(item, SearchOutcome)]
    outcome = outcomes[-1] if outcomes else SearchOutcome()
    outcome.candidates = candidates
    if not finished or not outcomes:
        outcome.finished = False
        outcome.notes.append(f"solver stopped at the {options.time_limit_s:g} s limit")
    return outcome


def diagnose_infeasible(
    problem: PlanningProblem,
    offload: str = "never",
    *,
    zero: str = "auto",
    max_stages: int | None = None,
    cut_short_s: float | None = None,
) -> str:
    """One line naming the binding memory constraint and what to change: the unit no device
    holds, or the whole model against the cluster's memory, with what sharding the
    optimizer state (``--zero``), recomputing (``--recompute``) and offloading the
    optimizer state to host memory (``--offload``, searched unless ``offload`` is
    ``never``) could still save, or that even they cannot. The last resort names the
    longest pipeline searched (``max_stages`` where it is below the device count) and
    advises only the policies the request left at ``never``; only there, where no proof
    of infeasibility stands, does a search cut short at ``cut_short_s`` seconds (its
    ``--time-limit``) add that a longer one may find a layout."""
    smallest_mbs = problem.micro_batch_sizes[0]
    biggest = int(np.argmax(problem.memory_capacity_bytes))
    capacity = float(problem.memory_capacity_bytes[biggest])
    need = problem.static_bytes_on(biggest) + problem.activation_bytes_on(biggest) * smallest_mbs
    worst = int(np.argmax(need))
    state_on = problem.optimizer_state_on(biggest)
    state = state_on if state_on is not None else np.zeros(problem.num_units)
    moved = (
        problem.offload_saving_bytes
        if problem.offload_saving_bytes is not None
        else np.zeros(problem.num_units)
    )
    if problem.device_kinds[biggest] == CPU_KIND:
        moved = np.zeros(problem.num_units)  # a cpu device's state is in host memory already
    rescued = offload != "never" and need[worst] - moved[worst] <= capacity
    if need[worst] > capacity and not rescued:  # else offload fits the unit: look further
        need_text, capacity_text = format_bytes_pair(float(need[worst]), capacity)
        hint = _unit_hint(float(state[worst]), float(moved[worst]), float(need[worst]), offload)
        return (
            f"unit `{problem.unit_names[worst]}` needs {need_text} on every device of "
            "its stage (parameters, gradients, optimizer state and activations of "
            f"{smallest_mbs} sample); the largest device ({problem.device_names[biggest]}) has "
            f"{capacity_text} usable{hint}; add a device with more memory than that"
        )
    total = float(problem.static_bytes_on(biggest).sum())
    usable = float(problem.memory_capacity_bytes.sum())
    if total > usable:
        return _whole_model_line(problem, total, usable, float(moved.sum()), offload)
    host = _host_binding(problem, float(need[worst]) - capacity, float(moved.sum()))
    if rescued and host is not None:
        return (
            f"unit `{problem.unit_names[worst]}` fits the largest device "
            f"({problem.device_names[biggest]}) only with its optimizer state offloaded to host "
            f"memory, but {host}"
        )
    line = _no_pipeline_line(problem, total, offload, zero, max_stages)
    if cut_short_s is not None:
        line += (
            f"; but the {cut_short_s:g} s --time-limit cut the search short before it had "
            "tried every pipeline, so a longer --time-limit may find a layout"
        )
    return line


def _no_pipeline_line(
    problem: PlanningProblem, total: float, offload: str, zero: str, max_stages: int | None
) -> str:
    """No pipeline holds the model: the longest one searched, and what else to allow."""
    longest = f"{problem.num_devices} devices"
    changes = ["add devices or memory", "reduce the micro-batch size"]
    if max_stages is not None and max_stages < problem.num_devices:
        longest = f"{max_stages} stages (--max-stages {max_stages})"
        changes.append("raise --max-stages")
    policies = (("recompute", str(problem.recompute)), ("zero", zero), ("offload", offload))
    never = [f"--{name} auto" for name, policy in policies if policy == "never"]
    if never:
        allow = never[0] if len(never) == 1 else f"{', '.join(never[:-1])} and {never[-1]}"
        changes.append(f"allow {allow}")
    advice = f"{', '.join(changes[:-1])} or {changes[-1]}"
    return (
        f"the model needs {format_bytes(total)} for parameters, gradients and optimizer state "
        f"plus activations, and no pipeline of at most {longest} holds it; {advice}"
    )


def _unit_hint(state_bytes: float, moved_bytes: float, need_bytes: float, offload: str) -> str:
    """What sharding (``--zero``) or offload (``--offload``) would leave of one unit."""
    if moved_bytes > 0 and offload != "never":
        return (
            f"; even with its optimizer state offloaded to host memory it needs "
            f"{format_bytes(need_bytes - moved_bytes)}"
        )
    if moved_bytes > 0:
        return (
            f"; with its optimizer state offloaded to host memory (--offload auto) it would "
            f"need {format_bytes(need_bytes - moved_bytes)}"
        )
    if state_bytes > 0:
        return (
            f"; with its optimizer state sharded away (--zero) it would still need "
            f"{format_bytes(need_bytes - state_bytes)}"
        )
    return ""


def _host_binding(problem: PlanningProblem, shed_bytes: float, moved_bytes: float) -> str | None:
    """The host memory constraint, when it is what binds: offloading enough optimizer state
    to shed ``shed_bytes`` of device memory needs more host memory than the nodes have
    usable. None when it does not bind (or the problem has no offload figures).

    The host bytes needed are at least ``shed_bytes`` x (host bytes / device bytes moved)
    over the whole model (``offload_host_bytes`` / ``offload_saving_bytes``): every unit
    moves about that ratio.
    """
    if problem.offload_host_bytes is None or problem.host_capacity_bytes is None:
        return None
    if moved_bytes <= 0:
        return None
    need = shed_bytes * float(problem.offload_host_bytes.sum()) / moved_bytes
    by_node = {
        node: float(problem.host_capacity_bytes[d]) for d, node in enumerate(problem.device_nodes)
    }
    have = sum(by_node.values())
    if need <= have:
        return None
    if len(by_node) == 1:
        where = f"node {next(iter(by_node))} has {format_bytes(have)} usable"
    else:
        nodes = ", ".join(f"{n} {format_bytes(b)}" for n, b in list(by_node.items())[:4])
        more = f" and {len(by_node) - 4} more" if len(by_node) > 4 else ""
        where = f"the nodes have {format_bytes(have)} usable together ({nodes}{more})"
    return (
        f"host memory binds: that offload needs at least {format_bytes(need)} of host memory "
        f"and {where} (host_memory_gb in cluster.yaml, or twice the node's device memory when "
        "not given, less a reserve per rank); raise host_memory_gb where a node has more, or "
        "add devices or memory"
    )


def _whole_model_line(
    problem: PlanningProblem, total: float, usable: float, moved: float, offload: str
) -> str:
    """The model's parameters, gradients and state against every device together."""
    head = (
        f"the model needs {format_bytes(total)} for parameters, gradients, optimizer state "
        f"and their workspace, more than the {format_bytes(usable)} all "
        f"{problem.num_devices} devices have usable together"
    )
    if moved > 0 and offload == "never":
        return (
            f"{head}; with the optimizer state offloaded to host memory it would need "
            f"{format_bytes(total - moved)}: allow --offload auto, or add devices or memory"
        )
    if moved > 0 and total - moved <= usable:
        offloaded = (
            f"{head}; with the optimizer state offloaded to host memory it needs "
            f"{format_bytes(total - moved)} on the devices"
        )
        host = _host_binding(problem, total - usable, moved)
        if host is not None:
            return f"{offloaded}, which fits, but {host}"
        return (
            f"{offloaded}, but no layout fits that with activations; add devices or memory, "
            "or reduce the micro-batch size"
        )
    still = f" (offloaded, it still needs {format_bytes(total - moved)})" if moved > 0 else ""
    return (
        f"{head}: no pipeline, recomputation, ZeRO shard or optimizer-state offload fits "
        f"it{still}; add devices or memory, or train with an optimizer with less state (SGD)"
    )
