"""Time to a target loss from a run's per-step losses and step ends: the pure part of
``slow_links.py``'s measurement (no cluster, no torch), so that it can be tested alone.

A run's loss at step ``k`` is the mean of its job losses over the ``window`` steps ending at
``k`` (:func:`trailing_means`): one step's loss is one global batch's, too noisy to compare
alone. The target of a run is the synchronous reference's mean over the same window ending
at step ``n - 1`` (``n`` steps = N samples): a run that trains exactly as the reference
reaches it at step ``n - 1`` whatever the window. A local run reaches it at the first step
whose mean is at or below it (:func:`steps_to_target`); its time to target is the wall time
of that many steps (:func:`time_to_step_s`). A synchronous run (DDP, an all-reduce plan)
trains as the reference does, so its time to target is N over its steady samples/s, measured
over a window of steps (:func:`extrapolated_time_s`).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence


def window_steps(loss_steps: int, horizon: int, num_steps: int) -> int:
    """The steps a run's loss averages: ``loss_steps`` rounded up to whole rounds of its
    ``horizon`` H (1 for a synchronous run), so that every mean covers whole rounds and does
    not depend on where in a round the step falls; at most the ``num_steps`` of N samples
    (then not whole rounds). ``window_steps(16, 6, 640) == 18``."""
    return min(math.ceil(loss_steps / horizon) * horizon, num_steps)


def trailing_means(losses: Sequence[float | None], window: int) -> list[float | None]:
    """Per step ``k``: the mean of ``losses[k - window + 1 .. k]``; None before ``window``
    steps or where one of them is unknown (None)."""
    out: list[float | None] = []
    for k in range(len(losses)):
        part = losses[k - window + 1 : k + 1] if k + 1 >= window else []
        known = [v for v in part if v is not None]
        out.append(statistics.fmean(known) if part and len(known) == window else None)
    return out


def steps_to_target(means: Sequence[float | None], target: float) -> int | None:
    """The first step whose mean is at or below ``target``; None when none is."""
    return next((k for k, v in enumerate(means) if v is not None and v <= target), None)


def time_to_step_s(ends: Sequence[float], step: int) -> float:
    """Wall seconds to train steps ``0 .. step``: the mean spacing of the step ends up to
    ``step`` (at least one spacing) times ``step + 1``. Step 0's own time (start-up, the
    first forward's allocations) is left out, as a window of steady steps leaves it out.

    Raises:
        ValueError: fewer than two step ends, or ``step`` beyond them.
    """
    if len(ends) < 2 or not 0 <= step < len(ends):
        raise ValueError(f"step {step} of {len(ends)} step ends: need two ends and the step")
    last = max(step, 1)
    return (ends[last] - ends[0]) / last * (step + 1)


def extrapolated_time_s(samples: int, samples_per_s: float) -> float:
    """A synchronous run's time to train ``samples``: at its steady rate."""
    return samples / samples_per_s


def relative_spread(values: Sequence[float]) -> float | None:
    """How far two runs of different seeds land apart: the median over pairs of
    ``|a - b| / ((a + b) / 2)``; None with fewer than two values."""
    pairs = [abs(a - b) / ((a + b) / 2) for a, b in itertools.combinations(values, 2)]
    return statistics.median(pairs) if pairs else None


def median_known(values: Sequence[float | None]) -> float | None:
    """The median of the values that are known; None when none is."""
    known = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(known) if known else None
