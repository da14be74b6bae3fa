"""Pipeline schedules: shapes, validation and the dry-run deadlock simulator."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hplan.runtime.contract.plan import Schedule
from hplan.runtime.contract.schedule import (
    Action,
    ActionKind,
    build_schedule,
    dry_run,
    gpipe,
    one_f_one_b,
    validate_schedule,
)

F, B = ActionKind.FORWARD, ActionKind.BACKWARD


def _text(actions: tuple[Action, ...]) -> str:
    return " ".join(str(a) for a in actions)


def test_one_f_one_b_three_stages_four_microbatches_has_the_textbook_order() -> None:
    stages = one_f_one_b(3, 4)
    assert _text(stages[0]) == (
        "s0.F.mb0 s0.F.mb1 s0.F.mb2 s0.B.mb0 s0.F.mb3 s0.B.mb1 s0.B.mb2 s0.B.mb3"
    )
    assert _text(stages[1]) == (
        "s1.F.mb0 s1.F.mb1 s1.B.mb0 s1.F.mb2 s1.B.mb1 s1.F.mb3 s1.B.mb2 s1.B.mb3"
    )
    assert _text(stages[2]) == (
        "s2.F.mb0 s2.B.mb0 s2.F.mb1 s2.B.mb1 s2.F.mb2 s2.B.mb2 s2.F.mb3 s2.B.mb3"
    )


def test_gpipe_runs_all_forwards_then_all_backwards() -> None:
    assert _text(gpipe(2, 2)[1]) == "s1.F.mb0 s1.F.mb1 s1.B.mb0 s1.B.mb1"


def test_action_text_form_round_trips_and_rejects_garbage() -> None:
    action = Action(1, B, 3)
    assert str(action) == "s1.B.mb3"
    assert Action.parse("s1.B.mb3") == action
    with pytest.raises(ValueError, match="s<stage>"):
        Action.parse("stage1-backward-3")


def test_sizes_below_one_are_rejected() -> None:
    with pytest.raises(ValueError, match="num_stages"):
        one_f_one_b(0, 3)
    with pytest.raises(ValueError, match="num_microbatches"):
        gpipe(2, 0)


def test_validator_rejects_backward_before_forward() -> None:
    stages = [(Action(0, B, 0), Action(0, F, 0))]
    with pytest.raises(ValueError, match=r"s0\.B\.mb0 comes before its forward"):
        validate_schedule(stages, 1)


def test_validator_rejects_a_missing_or_repeated_microbatch() -> None:
    stages = [(Action(0, F, 0), Action(0, F, 0), Action(0, B, 0), Action(0, B, 1))]
    with pytest.raises(ValueError, match="forwards"):
        validate_schedule(stages, 2)


def test_validator_rejects_an_action_of_another_stage() -> None:
    stages = [(Action(1, F, 0), Action(1, B, 0))]
    with pytest.raises(ValueError, match="another stage"):
        validate_schedule(stages, 1)


def test_simulator_finds_a_cross_stage_deadlock() -> None:
    # Each stage is valid on its own, but stage 0 waits for mb0's gradient while stage 1
    # waits for mb1's activations, which stage 0 only sends after that gradient.
    stages = [
        tuple(Action.parse(t) for t in ["s0.F.mb0", "s0.B.mb0", "s0.F.mb1", "s0.B.mb1"]),
        tuple(Action.parse(t) for t in ["s1.F.mb0", "s1.F.mb1", "s1.B.mb0", "s1.B.mb1"]),
    ]
    validate_schedule(stages, 2)
    with pytest.raises(ValueError, match="deadlock"):
        dry_run(stages)


@settings(max_examples=150, deadline=None)
@given(
    num_stages=st.integers(1, 8),
    num_microbatches=st.integers(1, 16),
    schedule=st.sampled_from(list(Schedule)),
)
def test_every_schedule_is_valid_pairs_every_send_and_never_deadlocks(
    num_stages: int, num_microbatches: int, schedule: Schedule
) -> None:
    stages = build_schedule(schedule, num_stages, num_microbatches)
    validate_schedule(stages, num_microbatches)
    result = dry_run(stages)
    # every message is sent once and received once: forwards across each of the S-1 cuts
    # and gradients back across each of them, for every micro-batch
    transfers = [t for t, _ in result.transfers]
    assert len(transfers) == len(set(transfers)) == 2 * (num_stages - 1) * num_microbatches
    for transfer, receiver in result.transfers:
        assert receiver.stage == transfer.dst_stage
        assert receiver.microbatch == transfer.microbatch
        assert receiver.kind is transfer.kind
    ran = [a for round_ in result.rounds for a in round_]
    assert sorted(map(str, ran)) == sorted(str(a) for s in stages for a in s)


@settings(max_examples=100, deadline=None)
@given(num_stages=st.integers(1, 8), num_microbatches=st.integers(1, 16))
def test_one_f_one_b_bounds_microbatches_in_flight_by_distance_to_the_last_stage(
    num_stages: int, num_microbatches: int
) -> None:
    stages = one_f_one_b(num_stages, num_microbatches)
    result = dry_run(stages)
    for stage_idx, actions in enumerate(stages):
        warmup = min(num_stages - stage_idx - 1, num_microbatches)
        assert all(a.kind is F for a in actions[:warmup])
        assert result.max_in_flight[stage_idx] <= min(num_stages - stage_idx, num_microbatches)
    gpipe_result = dry_run(gpipe(num_stages, num_microbatches))
    assert gpipe_result.max_in_flight == (num_microbatches,) * num_stages


# --------------------------------------------------------------------------- notation
@pytest.mark.parametrize("schedule", list(Schedule))
def test_every_action_prints_in_torch_pipelinings_notation_and_parses_back(
    schedule: Schedule,
) -> None:
    from torch.distributed.pipelining.schedules import _Action

    from hplan.runtime.executor.pipeline import pipelining_action

    for actions in build_schedule(schedule, 3, 5):
        for action in actions:
            text = action.pipelining_notation()
            assert text == str(pipelining_action(action)) == repr(pipelining_action(action))
            assert _Action.from_str(text) == pipelining_action(action)
    assert Action(1, ActionKind.FORWARD, 3).pipelining_notation() == "1F3"
    assert Action(0, ActionKind.BACKWARD, 12).pipelining_notation() == "0B12"


def test_a_failed_action_is_marked_in_a_rank_by_step_table() -> None:
    from hplan.runtime.executor.pipeline import schedule_table

    stages = build_schedule(Schedule.ONE_F_ONE_B, 2, 2)
    table = schedule_table(stages, [3, 5], failed=(1, 1))
    lines = table.splitlines()
    assert lines[0] == "columns: Rank 0 = plan rank 3, Rank 1 = plan rank 5"
    assert lines[1].split() == ["Rank", "0", "Rank", "1"]
    rows = {line.split(":")[0]: line.split(":", 1)[1].split() for line in lines[2:]}
    assert rows["Step 0"] == ["0F0", "1F0"]
    assert rows["Step 1"] == ["0F1", "1B0", "<--", "ERROR", "HERE"]
    assert sum("ERROR" in line for line in lines) == 1
