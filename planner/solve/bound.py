"""The throughput bound of the planning model: no layout it rates can be faster.

The solver's reported gap is measured against it. Two relaxations bound the step, and the
tighter one is returned (:func:`throughput_bound_samples_per_s`):

- an LP over the samples/s each device gives each unit, every device at its best
  per-sample rate at any size the unit alone fits (the sum of standalone devices is *not*
  a bound: a stage can run a size the whole model cannot fit, and a device can take only
  the units it is fastest at);
- a MILP over stages for one step of the global batch, in which every micro-batch pays at
  least a fixed overhead (:func:`_step_time_milp_s`).

Where a solver stops early or fails, a looser proven bound stands in (HiGHS's dual bound,
the critical path, :func:`_time_budget_bound`), so the result stays a bound.
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

_MILP_TIME_LIMIT_S = 1.0
"""Time limit of the step-time MILP; past it, HiGHS's proven lower bound is used."""

_MILP_MAX_STAGE_VARIABLES = 3000
"""Above this many (device, first unit, last unit) stage variables the MILP is not built
(PuLP would take longer to build it than HiGHS to solve it); the critical path alone then
bounds the step."""

_CAP_SLACK = 1e-6
"""Relative headroom on each stage's sample cap (the caps are cuts; looser is still valid),
and taken off the MILP's proven step time (HiGHS works to tolerances of about 1e-7)."""

_MILP_GAP = 0.01
"""Relative gap at which the step-time MILP stops; its proven lower bound is used."""


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
    static = _static_less_optimizer_state(problem)
    acts = problem.activation_bytes_at(problem.tp_degree)
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


def _static_less_optimizer_state(problem: PlanningProblem) -> FloatArray:
    """Each unit's static bytes less its optimizer state (ZeRO or offload may take it off
    the device), shape (U,); per card of the problem's largest TP degree (a relaxation
    where degrees differ: the bound stays below every layout's step)."""
    degree = problem.tp_degree
    state = problem.optimizer_state_at(degree)
    return problem.static_bytes_at(degree) - (state if state is not None else 0.0)


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
    """Samples/s that no layout of ``problem`` exceeds under the cost model.

    Every layout's step time is at least each of its stages' busy time, and a stage on
    device d holding unit u spends at least ``t[d, u]`` (:func:`unit_time_per_sample_s`)
    seconds per sample on it; gradient all-reduce and optimizer time only add. So the
    samples/s ``x[d, u]`` each device gives each unit satisfy::

        maximise N  subject to  sum_u t[d, u] x[d, u] <= 1   for every device d (its time)
                                sum_d x[d, u]         >= N   for every unit u (each sample
                                                              passes through every unit)
                                x >= 0, x[d, u] = 0 where unit u fits d at no size

    and N* bounds every layout's samples/s. Devices with identical rows of ``t`` are merged
    (their time budgets add). When every device's unit times are proportional, N* is the sum
    of each device's standalone rate at its per-unit best sizes. The result is the smaller of
    N* and the global batch over :func:`_step_time_lower_bound_s`.

    Returns:
        Samples/s; 0.0 when some unit fits no device, and ``inf`` when every unit costs no
        time on some device it fits (then nothing bounds the model's throughput).
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
    step_s = _step_time_lower_bound_s(problem, times)
    if step_s > 0:
        optimum = min(optimum, problem.global_batch_size / step_s)
    return optimum * (1 + _BOUND_SLACK)


def micro_batch_lines(
    problem: PlanningProblem, device_idx: int, first: int, stop: int, static_bytes: FloatArray
) -> list[tuple[float, float]]:
    """Lines ``(a_s, c_s_per_sample)`` with ``a > 0`` lying below the forward + backward
    seconds of one micro-batch of the stage of units ``first .. stop - 1`` on
    ``device_idx`` at every size it may take (1 up to the largest at which the stage fits:
    its static bytes and one micro-batch of its largest unit's activations, the least that
    selective recomputation of every unit holds; at most the global batch), for a device
    whose times are regular (below; :func:`_regular_times`, which the caller checks once
    per device). ``static_bytes``:
    :func:`_static_less_optimizer_state`, shape (U,). Empty where the stage fits at no size.

    A stage's time at size x is read off the candidates' *summed* times
    (``cost.microbatch.units_time_s``). Where every unit's forward and backward times on the
    device do not decrease with size and their line below the smallest candidate does not
    cross zero ("regular"), that reading is at least the sum of the units' own lines
    through their candidates (:func:`_piecewise_line`), so lines below that sum lie below
    the stage's time. A dip (measurement noise, which the reading smooths with a running
    maximum) breaks this, and then the device gets no lines (the LP's per-sample
    constraint alone holds). A line lies below a piecewise-linear time where it lies below
    it at the candidates, at 1 and at the largest size. The slopes tried: 0 and each
    segment's; of slopes within 1e-6 of each other only the highest line is kept.
    """
    sizes, times = _stage_times_s(problem, device_idx, first, stop, static_bytes)
    if len(sizes) == 0:
        return []
    slopes = {0.0} | {float(c) for c in np.diff(times) / np.diff(sizes) if c > 0}
    lines: list[tuple[float, float]] = []
    for slope in sorted(slopes):
        intercept = float((times - slope * sizes).min())
        if intercept <= 0:
            continue
        if lines and slope - lines[-1][1] <= 1e-6 * slope:
            if intercept > lines[-1][0]:
                lines[-1] = (intercept, slope)
            continue
        lines.append((intercept, slope))
    return lines


def _stage_times_s(
    problem: PlanningProblem, device_idx: int, first: int, stop: int, static_bytes: FloatArray
) -> tuple[FloatArray, FloatArray]:
    """The sizes a stage of units ``first .. stop - 1`` may run on ``device_idx`` at which
    its time bends (1, the candidates that fit, the largest that fits:
    :func:`_stage_largest_size`), and the sum of its units' forward and backward seconds
    there on their lines through the candidates (:func:`_piecewise_line`); both empty where
    the stage fits at no size."""
    largest = _stage_largest_size(problem, device_idx, first, stop, static_bytes)
    if largest < 1:
        return np.zeros(0), np.zeros(0)
    at = {1.0, float(largest)} | {float(k) for k in problem.micro_batch_sizes if k <= largest}
    sizes = np.array(sorted(at))
    times = np.zeros_like(sizes)
    for unit in range(first, stop):
        for pass_times in (problem.fwd_time_s, problem.bwd_time_s):
            times += _piecewise_line(problem.micro_batch_sizes, pass_times[device_idx, unit], sizes)
    return sizes, times


def _piecewise_line(candidates: tuple[int, ...], times_s: FloatArray, at: FloatArray) -> FloatArray:
    """Seconds at each size of ``at`` on the lines through consecutive candidates, the end
    ones continued (``cost.microbatch.time_at_sizes`` without its running maximum and its
    proportional fallbacks, which on regular times only add to it); proportional with one
    candidate."""
    xs = np.asarray(candidates, dtype=float)
    if len(xs) == 1:
        return np.asarray(times_s[0] * at / xs[0], dtype=float)
    idx = np.clip(np.searchsorted(xs, at, side="left"), 1, len(xs) - 1)
    slope = (times_s[idx] - times_s[idx - 1]) / (xs[idx] - xs[idx - 1])
    return np.asarray(times_s[idx - 1] + slope * (at - xs[idx - 1]), dtype=float)


def _regular_times(problem: PlanningProblem, device_idx: int) -> bool:
    """Every unit's forward and backward times on the device are non-decreasing over the
    candidate sizes, and their line through the two smallest candidates is non-negative at
    size 0 (see :func:`micro_batch_lines`)."""
    sizes = np.asarray(problem.micro_batch_sizes, dtype=float)
    for times in (problem.fwd_time_s[device_idx], problem.bwd_time_s[device_idx]):
        if len(sizes) < 2:
            continue
        if np.any(np.diff(times, axis=1) < 0):
            return False
        slope = (times[:, 1] - times[:, 0]) / (sizes[1] - sizes[0])
        if np.any(times[:, 0] - slope * sizes[0] < 0):
            return False
    return True


def _step_time_lower_bound_s(problem: PlanningProblem, times: FloatArray) -> float:
    """A least step time (s) of any layout processing the global batch:
    :func:`_step_time_milp_s`, or the critical path alone where the MILP is too large to
    build or ends without a proven bound; 0.0 where no device has a fixed micro-batch cost
    (then the LP says it all).

    Args:
        problem: the planning problem (D devices, U units).
        times: :func:`unit_time_per_sample_s`, shape (D, U); ``inf`` where u fits d at no size.
    """
    regular = [_regular_times(problem, d) for d in range(problem.num_devices)]
    static = _static_less_optimizer_state(problem)
    unit_lines = {
        (d, u): micro_batch_lines(problem, d, u, u + 1, static) if regular[d] else []
        for d in range(problem.num_devices)
        for u in range(problem.num_units)
        if math.isfinite(times[d, u])
    }
    if not any(unit_lines.values()):
        return 0.0
    unit_path_s = _unit_path_s(problem, unit_lines)
    unit_slope_s = _unit_slope_s(problem, unit_lines, static)
    path_s = float(unit_path_s.sum())
    num_stages = problem.num_devices * problem.num_units * (problem.num_units + 1) // 2
    if num_stages > _MILP_MAX_STAGE_VARIABLES:
        return path_s  # too large to build quickly: the critical path alone
    stages = _stage_lines(problem, times, unit_lines, regular, static)
    try:
        step_s = _step_time_milp_s(problem, times, stages, unit_path_s, unit_slope_s, regular)
        return max(step_s, path_s)
    except (RuntimeError, IndexError, pulp.PulpSolverError):  # no proven bound
        return path_s


Stage = tuple[int, int, int]
"""A regular device and the units it may hold as one stage: (device, first, stop)."""


def _stage_lines(
    problem: PlanningProblem,
    times: FloatArray,
    unit_lines: dict[tuple[int, int], list[tuple[float, float]]],
    regular: list[bool],
    static_bytes: FloatArray,
) -> dict[Stage, tuple[list[tuple[float, float]], float]]:
    """Every stage a regular device may hold (each unit fits it alone, and the stage fits
    as a whole: :func:`_stage_largest_size`): its :func:`micro_batch_lines` (none where its times
    have no fixed part) and its least seconds per sample (the sum of its units' ``times``)."""
    stages = {}
    for d in range(problem.num_devices):
        if not regular[d]:
            continue
        for first in range(problem.num_units):
            for stop in range(first + 1, problem.num_units + 1):
                fits = _stage_largest_size(problem, d, first, stop, static_bytes) >= 1
                if (d, stop - 1) not in unit_lines or not fits:
                    break  # a longer stage fits no better
                lines = micro_batch_lines(problem, d, first, stop, static_bytes)
                stages[d, first, stop] = (lines, float(times[d, first:stop].sum()))
    return stages


def _stage_largest_size(
    problem: PlanningProblem, device_idx: int, first: int, stop: int, static_bytes: FloatArray
) -> int:
    """The largest micro-batch at which the stage may run: its static bytes and one
    micro-batch of its largest unit's activations fit (a stage that recomputes every unit
    holds no less), at most the global batch; 0 where none fits."""
    return _largest_fitting_size(
        float(problem.memory_capacity_bytes[device_idx]),
        float(static_bytes[first:stop].sum()),
        float(problem.activation_bytes_at(problem.tp_degree)[first:stop].max()),
        problem.global_batch_size,
    )


def _stage_time_s(lines: list[tuple[float, float]], per_sample_s: float, samples: float) -> float:
    """The least seconds a stage spends on ``samples`` samples: its highest line there."""
    return max([a + c * samples for a, c in lines] + [per_sample_s * samples])


def _data_parallel_step_s(
    problem: PlanningProblem,
    stages: dict[Stage, tuple[list[tuple[float, float]], float]],
    unit_path_s: FloatArray,
) -> float:
    """The MILP's step time (s) of one of its own layouts: every device that may hold the
    whole model as one stage a share of the batch (found by bisection on the step time),
    never less than the critical path; ``inf`` where no device may hold the whole model.
    An upper bound on the MILP's optimum, which caps each stage's samples (a cut that
    keeps the optimum)."""
    batch = problem.global_batch_size
    whole = [stages[key] for key in stages if key[1] == 0 and key[2] == problem.num_units]
    if not whole:
        return math.inf

    def most_samples(step_s: float) -> float:
        total = 0.0
        for lines, per_sample_s in whole:
            if _stage_time_s(lines, per_sample_s, 0.0) > step_s:
                continue
            low, high = 0.0, float(batch)
            for _ in range(60):
                mid = (low + high) / 2
                low, high = (
                    (mid, high) if _stage_time_s(lines, per_sample_s, mid) <= step_s else (low, mid)
                )
            total += low
        return total

    high_s = min(_stage_time_s(lines, t, batch) for lines, t in whole)
    low_s = 0.0
    for _ in range(60):
        mid_s = (low_s + high_s) / 2
        low_s, high_s = (low_s, mid_s) if most_samples(mid_s) >= batch else (mid_s, high_s)
    return max(high_s * (1 + 1e-9), float(unit_path_s.sum()))


def _step_time_milp_s(
    problem: PlanningProblem,
    times: FloatArray,
    stages: dict[Stage, tuple[list[tuple[float, float]], float]],
    unit_path_s: FloatArray,
    unit_slope_s: FloatArray,
    regular: list[bool],
) -> float:
    """The least step time (s) of any layout of the global batch, as a mixed-integer program
    over stages: its optimum, or HiGHS's proven lower bound where it stops at its limit.

    The LP credits every device with its best per-sample rate, as if it had as many samples
    as it could use. A step has ``B`` (the global batch) samples, and a micro-batch costs at
    least a fixed overhead whatever its size (kernel launches: with a small model and batch
    most of the step). A stage ``s`` is a device ``d`` and a run of units ``i .. j - 1``;
    ``x_s`` (binary) says d holds it (at most one stage per device), ``n_s`` how many samples
    pass it per step (every sample that passes a stage passes all its units)::

        minimise T  subject to  sum over stages s holding u of n_s = B    for every unit u
                                z_s >= t_s n_s,   z_s >= a_k (x_s + w_s) + c_k n_s   for each k
                                T >= sum_s (z_s + P(< i) x_s)                for every device d
                                T >= z_s + P(others) x_s + q(others) (n_s - x_s - B w_s)
                                T >= P(all)

    where ``a_k + c_k x`` are lines below the time of one micro-batch of x samples of the
    stage over every size it may take (:func:`micro_batch_lines`), ``t_s`` the sum of its
    units' ``t[d, u]``, ``P`` the least seconds one sample spends on units, forward and
    backward, on whichever device (:func:`_unit_path_s`) and ``q`` the least rise per further
    sample (:func:`_unit_slope_s`). Why each holds:

    - m micro-batches of sizes x_j spend ``sum_j time(x_j) >= m a_k + c_k n`` seconds, and at
      least ``t_s n``;
    - a stage that is not the whole model runs two micro-batches or more (``w_s = 1``: two
      fixed costs), or one (``w_s = 0``), which passes every other unit, forward then
      backward, while the stage waits;
    - a stage waits, before its first forward and after its last backward, for a
      micro-batch's passes through the units before it (stages after it are not counted:
      1F1B fills that time with the stage's other forwards and backwards);
    - every micro-batch runs every unit, one after another (the critical path).

    Identical devices are ordered by busy time (:func:`_twins`, symmetry breaking), and each
    stage's samples are capped by what it can run within the step of one of the program's
    own layouts (:func:`_data_parallel_step_s`): cuts that keep the optimum and let HiGHS
    prove it fast. Devices whose times dip with size get no lines and enter with
    ``t[d, u]`` per sample alone. Without a fixed overhead (``a_k = 0``) this is the LP again.

    Raises:
        RuntimeError: it ended without an optimum or a proven lower bound.
    """
    batch = float(problem.global_batch_size)
    step_cap_s = _data_parallel_step_s(problem, stages, unit_path_s)
    model = pulp.LpProblem("hplan_step_time_bound", pulp.LpMinimize)
    step = _variable(model, "step_s")
    model += step
    unit_samples: dict[int, list[pulp.LpVariable]] = {u: [] for u in range(problem.num_units)}
    device_busy: dict[int, list[pulp.LpAffineExpression]] = {}
    holds: dict[int, list[pulp.LpVariable]] = {}
    for (d, first, stop), (lines, per_sample_s) in stages.items():
        wait_s = float(unit_path_s[:first].sum())
        name = f"{d}_{first}_{stop}"
        whole = first == 0 and stop == problem.num_units
        # a stage of a pipeline runs two micro-batches or more, each paying the fixed cost,
        # or one micro-batch, which passes every other unit while the stage waits
        others_slope_s = float(unit_slope_s.sum() - unit_slope_s[first:stop].sum())
        others_path_s = float(unit_path_s.sum() - unit_path_s[first:stop].sum())
        most_one = _most_samples(
            lines, per_sample_s, step_cap_s - others_path_s + others_slope_s, batch,
            extra_per_sample_s=others_slope_s,
        )  # fmt: skip
        most_split = -1.0 if whole else _most_samples(
            lines, per_sample_s, step_cap_s - wait_s, batch, fixed_count=2
        )  # fmt: skip
        if whole:
            most_one = _most_samples(lines, per_sample_s, step_cap_s, batch)
        if most_one < 0 and most_split < 0:
            continue  # holding it takes longer than a known layout's whole step
        held = _variable(model, f"x_{name}", binary=True)
        n = _variable(model, f"n_{name}")
        z = _variable(model, f"z_{name}")
        model += z >= per_sample_s * n, f"rate_{name}"
        if most_split < 0:  # one micro-batch only
            split: pulp.LpAffineExpression | float = 0.0
        elif most_one < 0:  # two or more only
            split = held
        else:
            split = _variable(model, f"w_{name}", binary=True)
            model += split <= held, f"split_{name}"
        loose = 1 + _CAP_SLACK  # caps meet the batch exactly at ties; HiGHS's presolve
        model += (  # then may cut the tie off (0.1994 + 1.8006 = 2 - 2e-16 < 2)
            n <= loose * max(most_one, 0.0) * (held - split) + loose * most_split * split,
            f"held_{name}",
        )
        for k, (intercept, slope) in enumerate(lines):
            model += z >= intercept * (held + split) + slope * n, f"line_{name}_{k}"
        if not whole:
            model += (
                step >= z + others_path_s * held + others_slope_s * (n - held - batch * split),
                f"one_micro_batch_{name}",
            )
        holds.setdefault(d, []).append(held)
        device_busy.setdefault(d, []).append(z + wait_s * held)
        for u in range(first, stop):
            unit_samples[u].append(n)
    for d in range(problem.num_devices):  # irregular devices: the per-sample time alone
        if regular[d]:
            continue
        for u in range(problem.num_units):
            if math.isfinite(times[d, u]):
                n = _variable(model, f"n_{d}_{u}")
                unit_samples[u].append(n)
                device_busy.setdefault(d, []).append(float(times[d, u]) * n)
    for d, held in holds.items():
        model += pulp.lpSum(held) <= 1, f"one_stage_{d}"
    for u, samples in unit_samples.items():
        model += pulp.lpSum(samples) == batch, f"unit_{u}"
    model += step >= float(unit_path_s.sum()), "critical_path"
    device_time = {d: pulp.lpSum(busy) for d, busy in device_busy.items()}
    for d, busy_s in device_time.items():
        model += step >= busy_s, f"device_{d}"
    for d, twin in _twins(problem, times, regular):  # identical devices: order their times
        if d in device_time and twin in device_time:
            model += device_time[d] >= device_time[twin], f"twin_{d}_{twin}"
    solver = _lp_solver(time_limit_s=_MILP_TIME_LIMIT_S, gap_rel=_MILP_GAP)
    with warnings.catch_warnings(), stdout_to_devnull():
        warnings.simplefilter("ignore", DeprecationWarning)
        status = model.solve(solver)
    proven = _highs_dual_bound(model)  # within the gap of the optimum, never above it
    if proven is None and pulp.LpStatus[status] == "Optimal" and step.value() is not None:
        proven = float(step.value()) * (1 - _MILP_GAP)  # CBC: its optimum within the gap
    if proven is None:
        raise RuntimeError(f"the step-time bound MILP ended {pulp.LpStatus[status]}")
    return proven * (1 - _CAP_SLACK)  # the solver's feasibility tolerances


def _most_samples(
    lines: list[tuple[float, float]],
    per_sample_s: float,
    within_s: float,
    batch: float,
    *,
    fixed_count: int = 1,
    extra_per_sample_s: float = 0.0,
) -> float:
    """The most samples a stage can run within ``within_s`` seconds, at most ``batch``
    (negative where even none fit), when it pays its fixed cost ``fixed_count`` times and
    spends ``extra_per_sample_s`` more on each sample (other units' time it waits for)."""
    if math.isinf(within_s):
        return batch
    most = batch
    for intercept, slope in lines:
        if fixed_count * intercept > within_s:
            return -1.0
        if slope + extra_per_sample_s > 0:
            most = min(most, (within_s - fixed_count * intercept) / (slope + extra_per_sample_s))
    if per_sample_s + extra_per_sample_s > 0:
        most = min(most, within_s / (per_sample_s + extra_per_sample_s))
    return most


def _twins(
    problem: PlanningProblem, times: FloatArray, regular: list[bool]
) -> list[tuple[int, int]]:
    """Pairs ``(d, d')``, ``d < d'``, of consecutive identical devices (same times, memory
    and regularity): swapping two of them changes no layout's time, so the MILP may order
    their busy times (symmetry breaking, which keeps its optimum)."""
    pairs = []
    for d in range(problem.num_devices):
        for twin in range(d + 1, problem.num_devices):
            same = (
                regular[d] == regular[twin]
                and problem.memory_capacity_bytes[d] == problem.memory_capacity_bytes[twin]
                and np.array_equal(times[d], times[twin])
                and np.array_equal(problem.fwd_time_s[d], problem.fwd_time_s[twin])
                and np.array_equal(problem.bwd_time_s[d], problem.bwd_time_s[twin])
            )
            if same:
                pairs.append((d, twin))
                break
    return pairs


def _unit_path_s(
    problem: PlanningProblem, lines: dict[tuple[int, int], list[tuple[float, float]]]
) -> FloatArray:
    """Seconds a micro-batch spends at least on each unit, forward and backward, whichever
    device runs it: ``min_d max (a + c)`` over the lines of ``u`` on the devices it fits
    (a line's value at one sample; the times do not decrease with size), 0 for a unit that
    fits a device without lines; shape (U,). A micro-batch runs its units one after
    another, so every step lasts at least their sum.
    """
    path_s = np.zeros(problem.num_units)
    for u in range(problem.num_units):
        on_devices = [unit_lines for (_, uu), unit_lines in lines.items() if uu == u]
        if on_devices and all(on_devices):
            path_s[u] = min(max(a + c for a, c in unit_lines) for unit_lines in on_devices)
    return path_s


def _unit_slope_s(
    problem: PlanningProblem,
    lines: dict[tuple[int, int], list[tuple[float, float]]],
    static_bytes: FloatArray,
) -> FloatArray:
    """Seconds per sample each unit's forward and backward time rises at least, between one
    sample and any larger size, whichever device runs it: the least slope of its
    piecewise-linear time (:func:`_piecewise_line`) on the devices it fits; 0 for a unit
    that fits a device without lines; shape (U,). With :func:`_unit_path_s`, a micro-batch
    of x samples spends at least ``path + slope * (x - 1)`` seconds on the unit.
    """
    slope_s = np.zeros(problem.num_units)
    for u in range(problem.num_units):
        on_devices = [d for (d, uu) in lines if uu == u]
        if not on_devices or not all(lines[d, u] for d in on_devices):
            continue
        least = math.inf
        for d in on_devices:
            sizes, times = _stage_times_s(problem, d, u, u + 1, static_bytes)
            if len(sizes) < 2:
                least = 0.0
                break
            least = min(least, float((np.diff(times) / np.diff(sizes)).min()))
        slope_s[u] = max(0.0, least)
    return slope_s


def _highs_dual_bound(model: pulp.LpProblem) -> float | None:
    """HiGHS's proven lower bound on a stopped MILP's objective, if it has one."""
    highs = getattr(model, "solverModel", None)
    try:
        bound = float(highs.getInfo().mip_dual_bound)  # type: ignore[union-attr]
    except AttributeError:
        return None
    return bound if math.isfinite(bound) and bound > 0 else None


def _time_budget_bound(rows: FloatArray, budgets: FloatArray) -> float:
    """Samples/s no layout exceeds: all devices' seconds per second over the least device
    time one sample needs (each unit on its fastest device); looser than the LP's, used
    where the LP solver fails (coefficients so far apart that HiGHS cannot scale them, as a
    capture file with an absurd figure makes)."""
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


def _variable(model: pulp.LpProblem, name: str, *, binary: bool = False) -> pulp.LpVariable:
    """A non-negative continuous (or binary) variable (PuLP >= 3.3 attaches it to the model)."""
    cat = "Binary" if binary else "Continuous"
    if hasattr(model, "add_variable"):
        return model.add_variable(name, lowBound=0, cat=cat)
    return pulp.LpVariable(name, lowBound=0, cat=cat)


def _lp_solver(time_limit_s: float | None = None, gap_rel: float | None = None) -> pulp.LpSolver:
    """HiGHS in-process (one thread, as ``milp``), else PuLP's CBC."""
    highs = pulp.HiGHS(msg=False, threads=1, timeLimit=time_limit_s, gapRel=gap_rel)
    if highs.available():
        return highs
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=gap_rel)
