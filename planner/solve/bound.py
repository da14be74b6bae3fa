"""The throughput bound of the planning model: no layout it rates can be faster.

Every layout's step time T is at least the busy time of each of its stages (the pipeline
time ``(m - 1) * period + fill`` of a replica is at least ``m`` times any stage's compute
time, and gradient all-reduce and optimizer time only add to it). A stage on device d
holding unit u at micro-batch size b spends ``(fwd + bwd)[d, u, b] / b`` seconds per sample
on it, and ``b`` is a size at which the unit alone fits the device (a stage holds at least
the unit's static bytes and one micro-batch of its activations). So with

    t[d, u] = min over sizes b that fit of (fwd + bwd)[d, u, b] / b   (s/sample)

(b: the candidate sizes, and the other sizes up to the global batch that a share or a
remainder micro-batch may take, timed as ``cost.microbatch`` interpolates them; see
``unit_time_per_sample_s``)

the samples/s ``x[d, u]`` each device gives each unit in any layout satisfy the linear
program below, and its optimum N* bounds every layout's samples/s::

    maximise N  subject to  sum_u t[d, u] x[d, u] <= 1   for every device d (its time)
                            sum_d x[d, u]         >= N   for every unit u (each sample
                                                          passes through every unit)
                            x >= 0, x[d, u] = 0 where unit u fits d at no size

Devices with identical rows of ``t`` are merged (their time budgets add). The sum of
standalone devices (each training the whole model alone) is *not* a bound: a pipeline
stage can run a micro-batch size the whole model cannot fit, and devices relatively faster
at some units than others can each take the units they are best at. When the unit times of
every device are proportional, N* equals the sum of each device's standalone rate at its
per-unit best sizes.

Where the LP solver fails (coefficients so far apart that HiGHS cannot scale them, as a
capture file with an absurd figure makes), the bound falls back to the looser
``sum_d budget_d / sum_u min_d t[d, u]``: every sample needs at least the fastest device's
time on every unit, and the devices together have ``sum_d budget_d`` seconds per second.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pulp

from hplan.planner.cost.microbatch import units_time_s
from hplan.planner.cost.problem import FloatArray, PlanningProblem
from hplan.planner.solve.watchdog import stdout_to_devnull

__all__ = ["throughput_bound_samples_per_s", "unit_time_per_sample_s"]

_BOUND_SLACK = 1e-9
"""Relative headroom added to the LP's optimum, for the LP solver's tolerances."""


def unit_time_per_sample_s(problem: PlanningProblem) -> FloatArray:
    """Fastest forward + backward seconds per sample of each unit on each device, shape
    (D, U); ``inf`` where the unit alone fits the device at no micro-batch size up to the
    global batch.

    A plan's micro-batches are candidate sizes, or smaller ones (a share or a remainder)
    whose time ``cost.microbatch`` interpolates linearly between candidates. Per sample,
    a line ``a + c * b`` over ``b`` is monotone, so the fastest size up to the largest
    that fits, ``B``, is a candidate up to ``B``, 1 or ``B`` itself; all are tried. "Fits":
    the unit's static bytes less its optimizer state (which ZeRO or offload may take off
    the device) and one micro-batch of its activations.
    """
    sizes = np.array(problem.micro_batch_sizes, dtype=float)
    per_sample = (problem.fwd_time_s + problem.bwd_time_s) / sizes[None, None, :]
    state = problem.optimizer_state_bytes
    static = problem.static_memory_bytes - (state if state is not None else 0.0)
    acts = problem.activation_bytes_per_sample
    need = static[:, None] + acts[:, None] * sizes[None, :]
    fits = need[None, :, :] <= problem.memory_capacity_bytes[:, None, None]
    fits &= (sizes <= problem.global_batch_size)[None, None, :]
    best = np.where(fits, per_sample, np.inf).min(axis=2)
    for d in range(problem.num_devices):
        for u in range(problem.num_units):
            largest = _largest_fitting_size(
                float(problem.memory_capacity_bytes[d]), float(static[u]), float(acts[u]),
                problem.global_batch_size,
            )  # fmt: skip
            if largest >= 1:
                ends = np.array([1.0, float(largest)])
                fwd, bwd = units_time_s(problem, d, u, u + 1, ends)
                best[d, u] = min(best[d, u], float(((fwd + bwd) / ends).min()))
    return best


def _largest_fitting_size(
    capacity_bytes: float, static_bytes: float, act_bytes_per_sample: float, limit: int
) -> int:
    """The largest micro-batch size up to ``limit`` whose bytes fit (0: none)."""
    room = capacity_bytes - static_bytes
    if room < 0:
        return 0
    if act_bytes_per_sample <= 0:
        return limit
    return int(min(limit, math.floor(room / act_bytes_per_sample)))


def throughput_bound_samples_per_s(problem: PlanningProblem) -> float:
    """Samples/s that no layout of ``problem`` exceeds under the cost model (module docstring).

    Returns 0.0 when some unit fits no device, and ``inf`` when every unit costs no time
    on some device it fits (then nothing bounds the model's throughput).

    """
    times = unit_time_per_sample_s(problem)
    if np.any(np.all(np.isinf(times), axis=0)):
        return 0.0
    if np.all(np.any(times == 0.0, axis=0)):
        return math.inf
    rows, budgets = _merged_rows(times)
    try:
        optimum = _solve_lp(rows, budgets)
    except (RuntimeError, IndexError, pulp.PulpSolverError):  # PuLP's HiGHS reader raises
        optimum = _time_budget_bound(rows, budgets)  # IndexError on a failed solve
    return optimum * (1 + _BOUND_SLACK)


def _time_budget_bound(rows: FloatArray, budgets: FloatArray) -> float:
    """Samples/s no layout exceeds: all devices' seconds per second over the least device
    time one sample needs (each unit on its fastest device); looser than the LP's."""
    return float(budgets.sum() / rows.min(axis=0).sum())


def _merged_rows(times: FloatArray) -> tuple[FloatArray, FloatArray]:
    """Distinct rows of ``times`` and how many devices share each (their time budget, s/s)."""
    rows, counts = np.unique(times, axis=0, return_counts=True)
    return rows, counts.astype(float)


def _solve_lp(rows: FloatArray, budgets: FloatArray) -> float:
    num_classes, num_units = rows.shape
    model = pulp.LpProblem("hplan_throughput_bound", pulp.LpMaximize)
    samples = _variable(model, "samples_per_s")
    share = {
        (c, u): _variable(model, f"x_{c}_{u}")
        for c in range(num_classes)
        for u in range(num_units)
        if math.isfinite(rows[c, u])
    }
    model += samples
    for c in range(num_classes):
        used = [(float(rows[c, u]), x) for (cc, u), x in share.items() if cc == c]
        if used:
            model += pulp.lpSum(t * x for t, x in used) <= float(budgets[c]), f"time_{c}"
    for u in range(num_units):
        model += pulp.lpSum(x for (_, uu), x in share.items() if uu == u) >= samples, f"unit_{u}"
    with warnings.catch_warnings(), stdout_to_devnull():  # HiGHS prints a banner on fd 1
        warnings.simplefilter("ignore", DeprecationWarning)  # PuLP 3.3 deprecates its CBC
        status = model.solve(_lp_solver())
    if pulp.LpStatus[status] != "Optimal" or samples.value() is None:
        raise RuntimeError(f"the throughput-bound LP ended {pulp.LpStatus[status]}")
    return float(samples.value())


def _variable(model: pulp.LpProblem, name: str) -> pulp.LpVariable:
    """A non-negative continuous variable (PuLP >= 3.3 attaches it to the model)."""
    if hasattr(model, "add_variable"):
        return model.add_variable(name, lowBound=0)
    return pulp.LpVariable(name, lowBound=0)


def _lp_solver() -> pulp.LpSolver:
    """HiGHS in-process (one thread, as ``milp``), else PuLP's CBC."""
    highs = pulp.HiGHS(msg=False, threads=1)
    if highs.available():
        return highs
    return pulp.PULP_CBC_CMD(msg=False)
