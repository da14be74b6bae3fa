"""Search for replicas, pipelines, unit splits and batch shares: the planning MILP.

Formulation (an outer enumeration plus an inner integer program, as the design card
allows):

1. Devices are grouped into interchangeable classes; *templates* are pipeline shapes (an
   ordered list of classes) with a micro-batch size, each split optimally by
   ``hplan.planner.partition`` (period P_t, fill F_t, optimizer time O_t).
2. A copy of template t running m micro-batches takes ``(m - 1) P_t + F_t + O_t + A_t``,
   where A_t is the gradient all-reduce time estimated for a *sync scenario* (one replica;
   or data parallel over the devices joined by links of at least some bandwidth). For a
   target step time T a copy can therefore process
   ``cap_t(T) = mbs_t * (floor((T - F_t - O_t - A_t) / P_t) + 1)`` samples.
3. T is found by bisection over the finite set of possible copy times: T is feasible iff
   integer copy counts n_t exist with ``sum_t cap_t(T) n_t >= global batch`` and no class
   over-used — a small covering MILP (``hplan.planner.milp.solve_cover``). Products of
   decisions (batch share x stage time) never appear, so the MILP is linear.
4. Each scenario's layout, the baselines and the single-replica layout are re-costed with
   the exact evaluator (``hplan.planner.evaluate``) and the fastest one is returned after
   an independent validation.

The answer is proven optimal under the planning model when every bisection step was
proven by the MILP and the template space was enumerated exhaustively; otherwise the
report gives the gap to the best lower bound found.
"""

from __future__ import annotations

import contextlib
import heapq
import math
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from hplan.planner.evaluate import evaluate, ring_allreduce_time_s
from hplan.planner.layout import Layout, ReplicaLayout, StageLayout
from hplan.planner.milp import CoverStatus, MilpBackend, select_backend, solve_cover
from hplan.planner.partition import (
    DeviceClass,
    Partitioner,
    Template,
    device_classes,
    distinct_orders,
    multisets,
    pareto,
)
from hplan.planner.problem import PlanningProblem
from hplan.runtime.errors import HplanError, InfeasiblePlanError


@dataclass(frozen=True)
class SolveOptions:
    """Knobs of the search."""

    time_limit_s: float = 60.0
    """Wall-clock limit of the whole solve; the best layout found by then is returned."""
    backend: str | None = None
    """``highs``, ``cbc`` or ``heuristic``; None picks the first that works."""
    max_stages: int = 8
    exhaustive_limit: int = 4000
    """Enumerate every class order and every split when the count of (order, split) pairs
    stays under this; otherwise order classes by heuristics and split by DP."""
    watchdog: bool = True
    """Run the search in a child process that is killed at the deadline (no leftovers)."""


@dataclass(frozen=True)
class Candidate:
    """A layout found by one search scenario, with what the search proved about it."""

    layout: Layout
    scenario: str
    model_time_s: float
    lower_bound_s: float
    proven: bool


@dataclass
class SearchOutcome:
    """What the search reports back (also across the watchdog's process boundary)."""

    candidates: list[Candidate] = field(default_factory=list)
    exhaustive: bool = False
    finished: bool = False
    backend: str = ""
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- templates
def enumerate_templates(
    problem: PlanningProblem, classes: Sequence[DeviceClass], options: SolveOptions
) -> tuple[list[Template], bool]:
    """All costed templates worth considering, and whether the enumeration is exhaustive."""
    partitioner = Partitioner(problem, classes)
    sizes = [c.size for c in classes]
    max_stages = min(options.max_stages, problem.num_units, problem.num_devices)
    sequences = [
        order
        for s in range(1, max_stages + 1)
        for ms in multisets(sizes, s)
        for order in distinct_orders(ms)
    ]
    splits = sum(math.comb(problem.num_units - 1, len(seq) - 1) for seq in sequences)
    exhaustive = splits * len(problem.micro_batch_sizes) <= options.exhaustive_limit
    if exhaustive:
        found = [
            t
            for seq in sequences
            for k in range(len(problem.micro_batch_sizes))
            for t in partitioner.all_splits(seq, k)
        ]
        return found, True
    return _heuristic_templates(problem, partitioner, sizes, max_stages), False


def _heuristic_templates(
    problem: PlanningProblem, partitioner: Partitioner, sizes: Sequence[int], max_stages: int
) -> list[Template]:
    found: list[Template] = []
    smallest_fit: int | None = None
    for s in range(1, max_stages + 1):
        if smallest_fit is not None and s > smallest_fit + 3:
            break
        for ms in multisets(sizes, s):
            for k in range(len(problem.micro_batch_sizes)):
                costed = [
                    t
                    for seq in _heuristic_orders(problem, partitioner, ms)
                    if (t := partitioner.best_split(seq, k))
                ]
                if costed:
                    smallest_fit = s if smallest_fit is None else smallest_fit
                    found.extend(pareto(costed))
    return found


def _heuristic_orders(
    problem: PlanningProblem, partitioner: Partitioner, ms: tuple[int, ...]
) -> list[tuple[int, ...]]:
    """Stage orders worth trying: most memory first (stage 0 holds the most activations),
    node-grouped (fewest slow hops), and fastest first."""
    classes = partitioner.classes

    def memory(c: int) -> float:
        return float(problem.memory_capacity_bytes[classes[c].rep])

    def speed(c: int) -> float:
        return -float(problem.fwd_time_s[classes[c].rep].sum())

    def node(c: int) -> str:
        return problem.device_nodes[classes[c].rep]

    node_memory: dict[str, float] = {}
    for c in ms:
        node_memory[node(c)] = node_memory.get(node(c), 0.0) + memory(c)
    orders = {
        tuple(sorted(ms, key=lambda c: (-memory(c), c))),
        tuple(sorted(ms, key=lambda c: (-node_memory[node(c)], node(c), -memory(c), c))),
        tuple(sorted(ms, key=lambda c: (-speed(c), -memory(c), c))),
    }
    if len(ms) <= 3:
        orders.update(distinct_orders(ms))
    return sorted(orders)


# ---------------------------------------------------------------------------- scenarios
class SyncEstimate(StrEnum):
    """How a scenario estimates a copy's gradient all-reduce time."""

    WHOLE_MODEL = "whole_model"
    """Some device syncs every unit (e.g. a one-stage replica is in the group)."""
    PER_STAGE = "per_stage"
    """Each stage syncs only its own units, over the scenario's slowest link."""
    STAGE_LOCAL = "stage_local"
    """Replicas are aligned: each stage syncs its units inside its own device class."""


@dataclass(frozen=True)
class Scenario:
    """A gradient-sync assumption under which copy times are linear."""

    name: str
    classes: frozenset[int]
    single_replica: bool
    bandwidth_bytes_per_s: float
    latency_s: float
    group_size: int
    sync: SyncEstimate


def _class_link(
    problem: PlanningProblem, classes: Sequence[DeviceClass], a: int, b: int
) -> tuple[float, float]:
    if a == b:
        devs = classes[a].devices
        if len(devs) < 2:
            return math.inf, 0.0
        return float(problem.bandwidth_bytes_per_s[devs[0], devs[1]]), float(
            problem.latency_s[devs[0], devs[1]]
        )
    da, db = classes[a].rep, classes[b].rep
    return float(problem.bandwidth_bytes_per_s[da, db]), float(problem.latency_s[da, db])


def make_scenarios(problem: PlanningProblem, classes: Sequence[DeviceClass]) -> list[Scenario]:
    """One replica; and for each bandwidth level, data parallel inside each set of classes
    joined by links at least that fast (conservative and per-stage-local estimates)."""
    everyone = frozenset(range(len(classes)))
    scenarios = [Scenario("one replica", everyone, True, math.inf, 0.0, 1, SyncEstimate.PER_STAGE)]
    links = {(a, b): _class_link(problem, classes, a, b) for a in everyone for b in everyone}
    levels = sorted({bw for bw, _ in links.values() if math.isfinite(bw)}, reverse=True)
    seen: set[frozenset[int]] = set()
    for level in levels:
        for component in _components(everyone, _at_least(links, level)):
            size = sum(classes[c].size for c in component)
            if size < 2 or component in seen:
                continue
            seen.add(component)
            bw = min(
                links[(a, b)][0]
                for a in component
                for b in component
                if math.isfinite(links[(a, b)][0])
            )
            lat = max(links[(a, b)][1] for a in component for b in component)
            label = "+".join(sorted({problem.device_nodes[classes[c].rep] for c in component}))
            multi_node = len({problem.device_nodes[classes[c].rep] for c in component}) > 1
            for sync in SyncEstimate:
                if sync is SyncEstimate.STAGE_LOCAL and not multi_node:
                    continue
                name = f"data parallel on {label} ({sync.value.replace('_', ' ')} sync)"
                scenarios.append(Scenario(name, component, False, bw, lat, size, sync))
    return scenarios


def _at_least(
    links: dict[tuple[int, int], tuple[float, float]], level: float
) -> Callable[[int, int], bool]:
    return lambda a, b: links[(a, b)][0] >= level


def _components(nodes: frozenset[int], joined: Callable[[int, int], bool]) -> list[frozenset[int]]:
    left = set(nodes)
    out = []
    while left:
        frontier = [left.pop()]
        comp = set(frontier)
        while frontier:
            a = frontier.pop()
            for b in list(left):
                if joined(a, b):
                    left.discard(b)
                    comp.add(b)
                    frontier.append(b)
        out.append(frozenset(comp))
    return out


def _allreduce_estimate_s(
    problem: PlanningProblem, classes: Sequence[DeviceClass], scenario: Scenario, t: Template
) -> float:
    if scenario.single_replica:
        return 0.0
    if scenario.sync is SyncEstimate.WHOLE_MODEL:
        return ring_allreduce_time_s(
            sum(t.stage_grad_bytes),
            max(scenario.group_size, 2),
            scenario.bandwidth_bytes_per_s,
            scenario.latency_s,
        )
    times = []
    for s, c in enumerate(t.classes):
        bw, lat, n = scenario.bandwidth_bytes_per_s, scenario.latency_s, scenario.group_size
        if scenario.sync is SyncEstimate.STAGE_LOCAL:
            local_bw, local_lat = _class_link(problem, classes, c, c)
            if math.isfinite(local_bw):
                bw, lat, n = local_bw, local_lat, classes[c].size
        times.append(ring_allreduce_time_s(t.stage_grad_bytes[s], max(n, 2), bw, lat))
    return max(times, default=0.0)


# ---------------------------------------------------------------------------- bisection
@dataclass
class _Bisection:
    """Arrays of one scenario's templates and the covering check at a target time."""

    problem: PlanningProblem
    templates: list[Template]
    base_s: np.ndarray
    period_s: np.ndarray
    mbs: np.ndarray
    usage: np.ndarray
    available: np.ndarray
    max_copies: int | None
    backend: MilpBackend

    def capacity(self, target_s: float) -> np.ndarray:
        slack = target_s - self.base_s
        with np.errstate(divide="ignore", invalid="ignore"):
            steps = np.where(
                self.period_s > 0,
                np.floor(slack / np.maximum(self.period_s, 1e-300) + 1e-9),
                np.inf,
            )
        cap = np.where(slack >= -1e-12, self.mbs * (steps + 1), 0.0)
        return np.minimum(cap, float(self.problem.global_batch_size))

    def check(self, target_s: float, deadline: float, minimize: bool = False):  # type: ignore[no-untyped-def]
        cap = self.capacity(target_s)
        demand = self.problem.global_batch_size
        upper = np.minimum(self.available[:, None] // np.maximum(self.usage, 1), 10**9).min(axis=0)
        copies_bound = np.minimum(upper, self.max_copies or 10**9)
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


def _bisect(bis: _Bisection, deadline: float) -> tuple[float, tuple[int, ...], float, bool] | None:
    """Smallest feasible target time over the finite set of possible copy times.

    Feasibility is monotone in the target time (capacities only grow), so bisection finds
    the optimum when every check is definitive. Returns (time, copy counts, lower bound,
    proven) or None when nothing is feasible.
    """
    b = bis.problem.global_batch_size
    values = [
        bis.base_s[i] + np.arange(math.ceil(b / bis.mbs[i])) * bis.period_s[i]
        for i in range(len(bis.templates))
    ]
    if not values:
        return None
    candidates = np.unique(np.concatenate(values))
    lo, hi = 0, len(candidates) - 1
    status, counts, _ = bis.check(float(candidates[hi]), deadline)
    if status is not CoverStatus.FEASIBLE or counts is None:
        return None
    best_counts, definitive, proven_infeasible = counts, True, -1
    while lo < hi and time.monotonic() < deadline:
        mid = (lo + hi) // 2
        status, counts, _ = bis.check(float(candidates[mid]), deadline)
        if status is CoverStatus.FEASIBLE and counts is not None:
            hi, best_counts = mid, counts
            continue
        lo = mid + 1
        if status is CoverStatus.INFEASIBLE:
            proven_infeasible = max(proven_infeasible, mid)
        else:
            definitive = False
    proven = definitive and lo >= hi
    if time.monotonic() < deadline:
        status, counts, _ = bis.check(float(candidates[hi]), deadline, minimize=True)
        if status is CoverStatus.FEASIBLE and counts is not None:
            best_counts = counts
    lower = float(candidates[hi]) if proven else float(candidates[proven_infeasible + 1])
    return float(candidates[hi]), best_counts, lower, proven


# ---------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class _Copy:
    template: Template
    devices: tuple[int, ...]
    base_s: float


def _copies(
    classes: Sequence[DeviceClass],
    templates: Sequence[Template],
    counts: Sequence[int],
    base: np.ndarray,
) -> list[_Copy]:
    used = {c: 0 for c in range(len(classes))}
    out = []
    for t_idx, count in enumerate(counts):
        t = templates[t_idx]
        for _ in range(count):
            devices = []
            local: dict[int, int] = {}
            for c in t.classes:
                devices.append(classes[c].devices[used[c] + local.get(c, 0)])
                local[c] = local.get(c, 0) + 1
            for c, n in local.items():
                used[c] += n
            out.append(_Copy(t, tuple(devices), float(base[t_idx])))
    return out


def _copy_time(copy: _Copy, samples: int) -> float:
    m = math.ceil(samples / copy.template.micro_batch_size)
    return copy.base_s + (m - 1) * copy.template.period_s if m > 0 else 0.0


def share_batch(copies: Sequence[_Copy], global_batch_size: int) -> list[int]:
    """Samples per copy minimising the slowest copy's time (water-filling by micro-batch)."""
    samples = [0] * len(copies)
    heap = [(_copy_time(c, c.template.micro_batch_size), i) for i, c in enumerate(copies)]
    heapq.heapify(heap)
    left = global_batch_size
    while left > 0 and heap:
        _, i = heapq.heappop(heap)
        add = min(copies[i].template.micro_batch_size, left)
        samples[i] += add
        left -= add
        nxt = samples[i] + copies[i].template.micro_batch_size
        heapq.heappush(heap, (_copy_time(copies[i], nxt), i))
    return samples


def layout_from_copies(copies: Sequence[_Copy], samples: Sequence[int]) -> Layout:
    """Replicas for every copy that received samples."""
    replicas = []
    for copy, n in zip(copies, samples, strict=True):
        if n <= 0:
            continue
        t = copy.template
        stages = tuple(
            StageLayout(copy.devices[s], t.bounds[s], t.bounds[s + 1]) for s in range(t.num_stages)
        )
        replicas.append(
            ReplicaLayout(stages, t.micro_batch_size, math.ceil(n / t.micro_batch_size), n)
        )
    return Layout(tuple(replicas))


def _prune_copies(problem: PlanningProblem, copies: list[_Copy], deadline: float) -> Layout:
    """Drop replicas while the exact evaluator says the step gets faster.

    The scenario's all-reduce estimate cannot see that fewer replicas sync faster; this
    local search on the exact cost model can (steepest descent, one replica at a time).
    """
    b = problem.global_batch_size
    current = list(copies)
    layout = layout_from_copies(current, share_batch(current, b))
    best = evaluate(problem, layout).step_time_s
    while len(current) > 1 and time.monotonic() < deadline:
        trials = []
        for i in range(len(current)):
            rest = current[:i] + current[i + 1 :]
            trial = layout_from_copies(rest, share_batch(rest, b))
            trials.append((evaluate(problem, trial).step_time_s, i, trial))
        step, i, trial = min(trials, key=lambda x: (x[0], x[1]))
        if step >= best * (1 - 1e-9):
            break
        best, layout = step, trial
        current.pop(i)
    return layout


# ---------------------------------------------------------------------------- search
def search(
    problem: PlanningProblem,
    options: SolveOptions,
    deadline: float,
    report: Callable[[object], None],
) -> None:
    """Run every scenario; ``report`` receives Candidates, then the final SearchOutcome."""
    backend = select_backend(options.backend)
    classes = device_classes(problem)
    templates, exhaustive = enumerate_templates(problem, classes, options)
    if not templates:
        raise InfeasiblePlanError(diagnose_infeasible(problem))
    outcome = SearchOutcome(exhaustive=exhaustive, backend=backend.value)
    if backend is MilpBackend.HEURISTIC:
        outcome.notes.append("no MILP solver works here; used the greedy planner (install highspy)")
    for scenario in make_scenarios(problem, classes):
        if time.monotonic() >= deadline:
            outcome.notes.append("time limit reached before every scenario was searched")
            break
        candidate = _solve_scenario(problem, classes, templates, scenario, backend, deadline)
        if candidate is not None:
            report(candidate)
            outcome.candidates.append(candidate)
    outcome.finished = time.monotonic() < deadline
    report(outcome)


def _solve_scenario(
    problem: PlanningProblem,
    classes: Sequence[DeviceClass],
    templates: Sequence[Template],
    scenario: Scenario,
    backend: MilpBackend,
    deadline: float,
) -> Candidate | None:
    chosen = [t for t in templates if set(t.classes) <= scenario.classes]
    if not chosen:
        return None
    base = np.array(
        [
            t.fill_s + t.optimizer_s + _allreduce_estimate_s(problem, classes, scenario, t)
            for t in chosen
        ]
    )
    usage = np.zeros((len(classes), len(chosen)), dtype=np.int64)
    for j, t in enumerate(chosen):
        for c in t.classes:
            usage[c, j] += 1
    available = np.array([c.size for c in classes], dtype=np.int64)
    bis = _Bisection(
        problem=problem,
        templates=list(chosen),
        base_s=base,
        period_s=np.array([t.period_s for t in chosen]),
        mbs=np.array([t.micro_batch_size for t in chosen], dtype=float),
        usage=usage,
        available=available,
        max_copies=1 if scenario.single_replica else None,
        backend=backend,
    )
    found = _bisect(bis, deadline)
    if found is None:
        return None
    model_time, counts, lower, proven = found
    copies = _copies(classes, chosen, counts, base)
    layout = _prune_copies(problem, copies, deadline)
    return Candidate(layout, scenario.name, model_time, lower, proven)


def diagnose_infeasible(problem: PlanningProblem) -> str:
    """One line naming the binding memory constraint and what to change."""
    gb = 1e9
    smallest_mbs = problem.micro_batch_sizes[0]
    biggest = int(np.argmax(problem.memory_capacity_bytes))
    capacity = float(problem.memory_capacity_bytes[biggest])
    need = problem.static_memory_bytes + problem.activation_bytes_per_sample * smallest_mbs
    worst = int(np.argmax(need))
    if need[worst] > capacity:
        return (
            f"unit `{problem.unit_names[worst]}` needs {need[worst] / gb:.1f} GB on every "
            "device of its stage (parameters, gradients, optimizer state and activations of "
            f"{smallest_mbs} sample); the largest device ({problem.device_names[biggest]}) "
            f"has {capacity / gb:.1f} GB usable; add a device with at least "
            f"{math.ceil(need[worst] / gb)} GB"
        )
    total = float(problem.static_memory_bytes.sum())
    pooled = float(np.sort(problem.memory_capacity_bytes)[::-1][: problem.num_units].sum())
    return (
        f"the model needs {total / gb:.1f} GB for parameters, gradients and optimizer state plus "
        f"activations, and no pipeline of at most {problem.num_devices} devices holds it "
        f"(their usable memory adds up to {pooled / gb:.1f} GB); add devices or memory, or reduce "
        "the micro-batch size"
    )


# ---------------------------------------------------------------------------- watchdog
def run_search(problem: PlanningProblem, options: SolveOptions) -> SearchOutcome:
    """Run ``search`` under the wall-clock limit; a child process is killed at the deadline."""
    deadline = time.monotonic() + options.time_limit_s
    if not options.watchdog or "fork" not in mp.get_all_start_methods():
        return _collect_in_process(problem, options, deadline)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_main, args=(problem, options, deadline, queue), daemon=True)
    child.start()
    outcome = SearchOutcome()
    grace_s = 2.0
    while True:
        remaining = deadline + grace_s - time.monotonic()
        item = _get(queue, remaining)
        if item is None:
            break
        if isinstance(item, BaseException):
            _kill(child)
            raise item
        if isinstance(item, Candidate):
            outcome.candidates.append(item)
        elif isinstance(item, SearchOutcome):
            item.candidates = outcome.candidates
            outcome = item
            break
    _kill(child)
    if not outcome.finished:
        outcome.notes.append(f"solver stopped at the {options.time_limit_s:g} s limit")
    return outcome


def _get(queue: mp.Queue, timeout_s: float) -> object | None:  # type: ignore[type-arg]
    if timeout_s <= 0:
        return None
    try:
        return queue.get(timeout=timeout_s)
    except Exception:
        return None


@contextlib.contextmanager
def _stdout_to_devnull() -> Iterator[None]:
    """Silence native solver banners on fd 1 (HiGHS prints one per process), which would
    otherwise corrupt ``--json`` output on stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _child_main(
    problem: PlanningProblem, options: SolveOptions, deadline: float, queue: mp.Queue
) -> None:  # type: ignore[type-arg]
    os.setsid()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        search(problem, options, deadline, queue.put)
    except HplanError as exc:
        queue.put(exc)
    except Exception as exc:  # an unexpected solver crash must reach the parent, not hang it
        queue.put(RuntimeError(f"solver crashed: {type(exc).__name__}: {exc}"))
    queue.close()
    queue.join_thread()


def _kill(child: Any) -> None:
    if child.is_alive() and child.pid is not None:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            child.kill()
    child.join(timeout=5)


def _collect_in_process(
    problem: PlanningProblem, options: SolveOptions, deadline: float
) -> SearchOutcome:
    outcome = SearchOutcome()

    def report(item: object) -> None:
        nonlocal outcome
        if isinstance(item, Candidate):
            outcome.candidates.append(item)
        elif isinstance(item, SearchOutcome):
            item.candidates = outcome.candidates
            outcome = item

    with _stdout_to_devnull():
        search(problem, options, deadline, report)
    return outcome
