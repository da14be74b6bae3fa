"""The measurement rule of ``hplan profile``: every number is a sustained speed.

A timed **window** runs its calls back to back until at least ``window_s`` of wall time has
passed; a call's sample is its mean over the window. Short calls timed alone show bursts: a
CPU quota (the Linux CFS bandwidth controller hands out ``cpu.cfs_quota_us`` per
``cpu.cfs_period_us``, 100 ms by default) lets a process run at a full core's speed until the
period's quota is spent, and a GPU boosts its clock for short bursts likewise. On a CPU the
quota shows as a few long pauses per window, each landing in whichever call runs then, so
the window's wall time is shared out among its calls by their CPU time (:func:`apportion`);
where the quota is known and binds, a call's sustained time is its CPU time over the quota
(:func:`sustained`), what the controller allows by definition, and a rank under the same
quota is timed the same way (``executor/seams.HostClock``), so a profile and a run agree.
A GPU's calls are timed by CUDA events. Torch-free (the CLI reads it before importing torch).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from hplan.runtime.contract.cpus import quota_binds

DEFAULT_WINDOW_S = 0.3
"""Wall seconds a window lasts at least: three CFS periods, so one window's share of a
quota is off by at most a third of a period's quota (less after the median of several)."""
DEFAULT_NUM_WINDOWS = 3
"""Windows per microbenchmark; the samples of its ``Stat``."""
DEFAULT_TIME_BUDGET_S = 0.1
"""Forward + backward seconds of the whole model at which the unit profile's first sweep
stops doubling the micro-batch size: past it a micro-batch's fixed overhead (about a
millisecond on a CPU) is lost in its per-sample time and the cost model extends the line."""
DEFAULT_MAX_MICRO_BATCH_SIZE = 65536
"""Largest micro-batch size the first sweep tries."""

Laps = Callable[[], Sequence[float]]
"""Runs a window's calls once each; the seconds each took."""


def run_window(
    laps: Laps, num_calls: int, window_s: float, clock: Callable[[], float] = time.perf_counter
) -> list[float]:
    """Run ``laps`` again and again until at least ``window_s`` seconds of ``clock`` have
    passed (once at least); the mean seconds of each of its ``num_calls`` calls."""
    started_s = clock()
    totals_s = [0.0] * num_calls
    num_runs = 0
    while num_runs == 0 or clock() - started_s < window_s:
        for idx, lap_s in enumerate(laps()):
            totals_s[idx] += lap_s
        num_runs += 1
    return [total_s / num_runs for total_s in totals_s]


def sustained(
    wall_s: Sequence[float], cpu_s: Sequence[float], quota_cores: float | None, num_threads: int
) -> list[float]:
    """Each call's sustained seconds: its CPU seconds over ``quota_cores`` where a CPU quota
    binds (``quota_cores < num_threads``, the torch threads that ran it), else the
    window's wall time shared out by CPU time (:func:`apportion`).

    Example: on a 0.45-core quota, one thread, a call of 0.0315 s CPU takes 0.07 s.
    """
    if quota_cores is not None and quota_binds(quota_cores, num_threads) and sum(cpu_s) > 0:
        return [c / quota_cores for c in cpu_s]
    return apportion(wall_s, cpu_s)


def apportion(wall_s: Sequence[float], cpu_s: Sequence[float]) -> list[float]:
    """The calls' total wall seconds shared out by their CPU seconds: call ``i`` gets
    ``sum(wall_s) * cpu_s[i] / sum(cpu_s)`` (``wall_s`` as is when no CPU time was used).

    Example: two calls of 0.1 s CPU each, one of which caught a 0.4 s pause
    (``wall_s = [0.1, 0.5]``), each get 0.3 s.
    """
    total_cpu_s = sum(cpu_s)
    if total_cpu_s <= 0:
        return list(wall_s)
    total_wall_s = sum(wall_s)
    return [total_wall_s * c / total_cpu_s for c in cpu_s]
