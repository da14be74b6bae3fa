"""The measurement rule of ``hplan profile``: every number is a sustained speed.

A timed **window** runs its calls back to back until at least ``window_s`` of wall time has
passed; a call's sample is its mean over the window. Short calls timed alone show bursts: a
CPU quota (the Linux CFS bandwidth controller hands out ``cpu.cfs_quota_us`` per
``cpu.cfs_period_us``, 100 ms by default) lets a process run at a full core's speed until the
period's quota is spent, so a 1.4 ms block timed call by call measured as fast on a
0.45-core cgroup as on a 0.9-core one; a GPU boosts its clock for short bursts likewise. A
pause of the whole process lands in whichever call runs at the time, so over a window each
call's mean carries its share of the pauses.

Torch-free (the CLI reads the defaults before importing torch).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

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
