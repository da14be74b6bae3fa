"""The step flags are exchanged about every CONTROL_PERIOD_S, at the interval rank 0 proposes."""

from __future__ import annotations

import json
import math
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from hplan.runtime.executor.control.agreement import StepAgreement, StopReason
from hplan.runtime.executor.control.exchange import (
    CONTROL_PERIOD_S,
    StepControl,
    StepFlags,
    control_interval_steps,
)
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


def _in_rank(rank: int, port: int, out_dir: str, body: Callable[[], dict]) -> None:
    """Join the two-rank gloo job, run ``body``, write what it returns to
    ``rank-<rank>.json`` (an error's traceback to ``error-<rank>.txt``)."""
    try:
        join_gloo(rank, port)
        result = body()
        (Path(out_dir) / f"rank-{rank}.json").write_text(json.dumps(result))
    except Exception:
        (Path(out_dir) / f"error-{rank}.txt").write_text(traceback.format_exc())


def _drive(
    agreement: StepAgreement,
    num_steps: int,
    flags_at: Callable[[int], StepFlags],
    stop: StopReason,
    saved: list[int] | None = None,
) -> int | None:
    """``agreement.after_step`` for steps 1 .. ``num_steps - 1`` of STEP_S each, with the
    flags ``flags_at(steps_done)`` gives; the step at which the job agreed to ``stop``
    (None: never). The steps it agreed to checkpoint go to ``saved``."""
    for steps_done in range(1, num_steps):
        record = SimpleNamespace(step=steps_done - 1, step_time_s=STEP_S, loss=1.0, replica=0)
        decision = agreement.after_step(steps_done, record, flags_at(steps_done))  # type: ignore[arg-type]
        if decision.stop is stop:
            return steps_done
        assert decision.stop is None, decision
        if decision.checkpoint and saved is not None:
            saved.append(steps_done)
    return None


def _steps(rank: int, port: int, out_dir: str) -> None:
    def body() -> dict:
        exchanges: list[int] = []
        current = [0]
        control = StepControl(torch.device("cpu"), num_replicas=1)
        exchange = control.exchange

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            exchanges.append(current[0])
            return exchange(*args, **kwargs)

        def flags_at(steps_done: int) -> StepFlags:
            current[0] = steps_done
            preempted = rank == 1 and steps_done == PREEMPTED_AT
            return StepFlags.PREEMPTED if preempted else StepFlags.NONE

        control.exchange = counted  # type: ignore[method-assign]
        agreement = StepAgreement(control, rank=rank)
        stopped = _drive(agreement, 40, flags_at, StopReason.PREEMPTED)
        return {"exchanges": exchanges, "stopped": stopped, "every": agreement.interval_steps}

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


def _checkpoint_after_divergence(rank: int, port: int, out_dir: str) -> None:
    def body() -> dict:
        control = StepControl(torch.device("cpu"), num_replicas=1)
        agreement = StepAgreement(control, rank=rank, checkpointing=True)
        saved: list[int] = []

        def flags_at(steps_done: int) -> StepFlags:
            if rank == 0 and steps_done == 8:  # rank 0's clock: a checkpoint is due
                return StepFlags.CHECKPOINT_DUE
            if rank == 1 and steps_done == 11:  # rank 1's loss went non-finite
                return StepFlags.NONFINITE_LOSS
            return StepFlags.NONE

        diverged = _drive(agreement, 20, flags_at, StopReason.DIVERGED, saved)
        return {"saved": saved, "diverged": diverged}

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
