"""MILP backends behind PuLP: HiGHS (in-process, via highspy) first, CBC as fallback.

A backend counts as available only after it has solved a trivial model correctly
(case S1: an availability flag can lie; a binary can be present but not executable).
The one model hplan solves here is a covering problem over pipeline shapes (see
``solve_cover``); the solver module calls it many times with different capacities.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from enum import StrEnum
from functools import cache

import numpy as np
import pulp

from hplan.runtime.contract.errors import SolverUnavailableError

HIGHS_THREADS = 1
"""HiGHS worker threads; see :func:`_make_solver`."""
INSTALL_HINT = "install a MILP solver: `pip install highspy` (HiGHS) or PuLP's bundled CBC"


class MilpBackend(StrEnum):
    """Solvers hplan can drive; ``heuristic`` is the non-ILP greedy fallback."""

    HIGHS = "highs"
    CBC = "cbc"
    HEURISTIC = "heuristic"


class CoverStatus(StrEnum):
    FEASIBLE = "feasible"
    INFEASIBLE = "infeasible"
    """Proven: no selection reaches the demand."""
    UNKNOWN = "unknown"
    """The solver stopped (time limit) without a solution or a proof."""


@dataclass(frozen=True, slots=True)
class CoverResult:
    status: CoverStatus
    counts: tuple[int, ...] | None
    proven_optimal: bool


def _make_solver(backend: MilpBackend, time_limit_s: float) -> pulp.LpSolver:
    limit = max(0.05, float(time_limit_s))
    if backend is MilpBackend.HIGHS:
        # One thread: HiGHS's default (half the cores) starts a worker pool that a forked
        # watchdog child inherits without its threads, and the child's first solve then
        # may die or spin (with one thread there is no pool).
        # Our MILPs are small; HiGHS's branch and bound gains little from more threads.
        return pulp.HiGHS(msg=False, timeLimit=limit, threads=HIGHS_THREADS)
    if backend is MilpBackend.CBC:
        coin = pulp.COIN_CMD(msg=False, timeLimit=limit)
        if coin.available():
            return coin
        with warnings.catch_warnings():  # PuLP 3.3 deprecates its bundled CBC; still works
            warnings.simplefilter("ignore", DeprecationWarning)
            return pulp.PULP_CBC_CMD(msg=False, timeLimit=limit)
    raise ValueError(f"{backend} is not a MILP backend")


def _variable(model: pulp.LpProblem, name: str, upper: int) -> pulp.LpVariable:
    """A non-negative integer variable (PuLP >= 3.3 attaches it to the model)."""
    if hasattr(model, "add_variable"):
        return model.add_variable(name, lowBound=0, upBound=upper, cat="Integer")
    return pulp.LpVariable(name, lowBound=0, upBound=upper, cat="Integer")


def probe(backend: MilpBackend) -> bool:
    """True when ``backend`` solves ``min x, x >= 1.5, x integer`` to x = 2."""
    if backend is MilpBackend.HEURISTIC:
        return True
    try:
        problem = pulp.LpProblem("hplan_probe", pulp.LpMinimize)
        x = _variable(problem, "x", 10)
        problem += x
        problem += x >= 1.5, "at_least"
        problem.solve(_make_solver(backend, 5.0))
        return pulp.LpStatus[problem.status] == "Optimal" and round(x.value() or 0) == 2
    except Exception:
        return False


@cache
def _probe_cached(backend: MilpBackend) -> bool:
    return probe(backend)


def select_backend(requested: MilpBackend | None = None) -> MilpBackend:
    """The backend to use: the one requested (checked), else HiGHS, else CBC, else heuristic.

    Raises:
        SolverUnavailableError: a requested backend does not work here (with install hint).
    """
    if requested is not None:
        if not _probe_cached(requested):
            raise SolverUnavailableError(
                f"solver {requested.value!r} does not work here; {INSTALL_HINT}"
            )
        return requested
    for backend in (MilpBackend.HIGHS, MilpBackend.CBC):
        if _probe_cached(backend):
            return backend
    return MilpBackend.HEURISTIC


def solve_cover(
    *,
    capacity: np.ndarray,
    usage: np.ndarray,
    available: np.ndarray,
    demand: int,
    max_copies: int | None,
    minimize_copies: bool,
    backend: MilpBackend,
    time_limit_s: float,
) -> CoverResult:
    """Choose integer copies n_t of shapes so that they cover the demand.

    Model::

        find n >= 0 integer with
            sum_t capacity[t] * n[t] >= demand          (global_batch_covered)
            sum_t usage[c, t] * n[t] <= available[c]    (class_c_devices, every class c)
            sum_t n[t] <= max_copies                    (max_replicas, when given)
        minimise sum_t n[t] when minimize_copies, else any feasible n.

    Args:
        capacity: samples one copy of shape t can process in the target time, shape (T,).
        usage: devices of class c one copy of shape t uses, shape (C, T).
        available: devices in each class, shape (C,).
    """
    if backend is MilpBackend.HEURISTIC:
        return _greedy_cover(capacity, usage, available, demand, max_copies)
    model = pulp.LpProblem("hplan_cover", pulp.LpMinimize)
    upper = _upper_bounds(usage, available)
    n = [_variable(model, f"n_{t}", int(upper[t])) for t in range(len(capacity))]
    model += pulp.lpSum(n) if minimize_copies else pulp.lpSum([])
    model += (
        pulp.lpSum(float(capacity[t]) * n[t] for t in range(len(n))) >= demand,
        "global_batch_covered",
    )
    for c in range(usage.shape[0]):
        used = [(int(usage[c, t]), n[t]) for t in range(len(n)) if usage[c, t]]
        if used:
            model += pulp.lpSum(w * v for w, v in used) <= int(available[c]), f"class_{c}_devices"
    if max_copies is not None:
        model += pulp.lpSum(n) <= max_copies, "max_replicas"
    model.solve(_make_solver(backend, time_limit_s))
    return _read_cover(model, n, capacity, demand)


def copy_upper_bounds(usage: np.ndarray, available: np.ndarray) -> np.ndarray:
    """Most copies of each shape the classes allow, shape (T,) (huge where unused)."""
    return _upper_bounds(usage, available)


def _upper_bounds(usage: np.ndarray, available: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        ratio = np.where(
            usage > 0, available[:, None] // np.maximum(usage, 1), np.iinfo(np.int64).max
        )
    return ratio.min(axis=0)


def _read_cover(
    model: pulp.LpProblem, n: list[pulp.LpVariable], capacity: np.ndarray, demand: int
) -> CoverResult:
    status = model.status
    if status == pulp.LpStatusInfeasible:
        return CoverResult(CoverStatus.INFEASIBLE, None, True)
    values = [v.value() for v in n]
    if any(v is None for v in values):
        return CoverResult(CoverStatus.UNKNOWN, None, False)
    counts = tuple(round(float(v)) for v in values if v is not None)
    if float(np.dot(capacity, counts)) < demand:
        return CoverResult(CoverStatus.UNKNOWN, None, False)
    proven = model.sol_status == pulp.LpSolutionOptimal
    return CoverResult(CoverStatus.FEASIBLE, counts, proven)


def _greedy_cover(
    capacity: np.ndarray,
    usage: np.ndarray,
    available: np.ndarray,
    demand: int,
    max_copies: int | None,
) -> CoverResult:
    """Non-ILP fallback: add copies of the shape with most samples per device first."""
    left = available.astype(np.int64).copy()
    counts = np.zeros(len(capacity), dtype=np.int64)
    per_device = capacity / np.maximum(usage.sum(axis=0), 1)
    covered = 0.0
    for t in np.argsort(-per_device, kind="stable"):
        while covered < demand and capacity[t] > 0 and np.all(usage[:, t] <= left):
            if max_copies is not None and counts.sum() >= max_copies:
                break
            left -= usage[:, t]
            counts[t] += 1
            covered += capacity[t]
    if covered < demand:
        return CoverResult(CoverStatus.UNKNOWN, None, False)
    return CoverResult(CoverStatus.FEASIBLE, tuple(int(c) for c in counts), False)
