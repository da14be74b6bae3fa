"""The step flags are exchanged about every CONTROL_PERIOD_S, at the interval rank 0 proposes."""

from __future__ import annotations

import json
import math
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from hplan.runtime.contract.errors import DivergedError, PreemptedError
from hplan.runtime.executor.control import (
    CONTROL_PERIOD_S,
    StepControl,
    StepFlags,
    control_interval_steps,
)
from hplan.runtime.executor.training import _Loop
from tests.fixtures.processes import join_gloo, run_ranks

STEP_S = 0.1
PREEMPTED_AT = 17
"""Rank 1 is preempted (SIGTERM's flag) after this many steps."""


def test_the_interval_is_the_steps_that_fit_the_period() -> None:
    assert CONTROL_PERIOD_S == 0.5
    assert control_interval_steps(0.1) == 5
    assert control_interval_steps(0.3) == 1  # a step longer than half the period: every step
    assert control_interval_steps(1e-3) == 500
    assert control_interval_steps(0.0) == control_interval_steps(math.nan) == 1


def _loop(rank: int) -> _Loop:
    """A loop with what ``_after`` needs: no checkpoints, no progress lines."""
    loop = object.__new__(_Loop)
    loop.rank = rank
    loop.control = StepControl(torch.device("cpu"), num_replicas=1)
    loop.control_every, loop.held, loop.warmed_up = 1, StepFlags.NONE, False
    loop.step_times_s = deque(maxlen=20)
    loop.checkpointer, loop.every_steps, loop.progress = None, None, None
    loop.balancer = None
    return loop


def _in_rank(rank: int, port: int, out_dir: str, body: Callable[[_Loop], dict]) -> None:
    """Join the two-rank gloo job, run ``body`` on a fresh loop, write what it returns to
    ``rank-<rank>.json`` (an error's traceback to ``error-<rank>.txt``)."""
    try:
        join_gloo(rank, port)
        result = body(_loop(rank))
        (Path(out_dir) / f"rank-{rank}.json").write_text(json.dumps(result))
    except Exception:
        (Path(out_dir) / f"error-{rank}.txt").write_text(traceback.format_exc())


def _drive(
    loop: _Loop, num_steps: int, flags_at: Callable[[int], StepFlags], stop: type[Exception]
) -> int | None:
    """``loop._after`` for steps 1 .. ``num_steps - 1`` of STEP_S each, with the flags
    ``flags_at(steps_done)`` gives; the step at which it raised ``stop`` (None: never)."""
    for steps_done in range(1, num_steps):
        record = SimpleNamespace(step=steps_done - 1, step_time_s=STEP_S, loss=1.0, replica=0)
        try:
            loop._after(steps_done, flags_at(steps_done), record)  # type: ignore[arg-type]
        except stop:
            return steps_done
    return None


def _steps(rank: int, port: int, out_dir: str) -> None:
    def body(loop: _Loop) -> dict:
        exchanges: list[int] = []
        current = [0]
        exchange = loop.control.exchange

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            exchanges.append(current[0])
            return exchange(*args, **kwargs)

        def flags_at(steps_done: int) -> StepFlags:
            current[0] = steps_done
            preempted = rank == 1 and steps_done == PREEMPTED_AT
            return StepFlags.PREEMPTED if preempted else StepFlags.NONE

        loop.control.exchange = counted  # type: ignore[method-assign]
        stopped = _drive(loop, 40, flags_at, PreemptedError)
        return {"exchanges": exchanges, "stopped": stopped, "every": loop.control_every}

    _in_rank(rank, port, out_dir, body)


def test_ranks_exchange_every_fifth_step_of_a_tenth_of_a_second_and_stop_together(
    tmp_path: Path,
) -> None:
    assert run_ranks(_steps, 2, tmp_path) == [0, 0]
    results = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1]
    # every step until rank 0's proposal (5: 0.1 s steps in 0.5 s, from its second step on)
    # is read after step 3, then every fifth; rank 1's flag of step 17 rides the exchange
    # of step 20, and both ranks act on it when they read that agreement, one step later
    assert results[0] == {"exchanges": [1, 2, 3, 5, 10, 15, 20], "stopped": 21, "every": 5}


class _Saves:
    """A checkpointer that only records the steps it was asked to save."""

    def __init__(self) -> None:
        self.saved: list[int] = []

    def written_step(self) -> int:
        return -1

    def publish_written(self, written_everywhere: int) -> None:
        pass

    def save(self, steps_done: int) -> None:
        self.saved.append(steps_done)

    def wait(self) -> None:
        pass


def _checkpoint_after_divergence(rank: int, port: int, out_dir: str) -> None:
    def body(loop: _Loop) -> dict:
        saves = _Saves()
        loop.checkpointer = saves
        loop.saved_s, loop.pauses_s = 0.0, []

        def flags_at(steps_done: int) -> StepFlags:
            if rank == 0 and steps_done == 8:  # rank 0's clock: a checkpoint is due
                return StepFlags.CHECKPOINT_DUE
            if rank == 1 and steps_done == 11:  # rank 1's loss went non-finite
                return StepFlags.NONFINITE_LOSS
            return StepFlags.NONE

        diverged = _drive(loop, 20, flags_at, DivergedError)
        return {"saved": saves.saved, "diverged": diverged}

    _in_rank(rank, port, out_dir, body)


def test_a_checkpoint_agreed_between_exchanges_never_saves_a_diverged_state(
    tmp_path: Path,
) -> None:
    # rank 0's due checkpoint rides the exchange of step 10 and is read after step 11, off
    # an exchange step; rank 1's loss went non-finite in step 11: the ranks post that step's
    # flags before saving, find the divergence and stop without saving
    assert run_ranks(_checkpoint_after_divergence, 2, tmp_path) == [0, 0]
    results = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1] == {"saved": [], "diverged": 11}
