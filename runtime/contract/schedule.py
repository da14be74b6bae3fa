"""Pipeline schedules as plain integers: per stage, an ordered list of actions.

A schedule says, for every stage of one replica's pipeline, in which order it runs the
forward (``F``) and backward (``B``) pass of each micro-batch. It is built from
``(num_stages, num_microbatches)`` alone, needs no torch, and has a one-line text form per
action (``s1.F.mb3``: stage 1, forward, micro-batch 3). Communication is implied: the
forward of ``m`` on stage ``s > 0`` receives what stage ``s - 1`` sent after its forward of
``m``; the backward of ``m`` on stage ``s < last`` receives the gradient stage ``s + 1`` sent
after its backward of ``m``. Sends are asynchronous, receives block; :func:`dry_run` runs a
schedule under these rules and proves that every receive is matched and no stage waits
forever.

The shapes follow the 1F1B schedule of PipeDream-Flush (Narayanan et al., "Memory-Efficient
Pipeline-Parallel DNN Training", 2021) and GPipe (Huang et al., 2019).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from hplan.runtime.contract.plan import Schedule


class ActionKind(StrEnum):
    """What a stage does with one micro-batch."""

    FORWARD = "F"
    BACKWARD = "B"


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one stage: run ``kind`` on micro-batch ``microbatch``."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"s{self.stage}.{self.kind.value}.mb{self.microbatch}"

    def pipelining_notation(self) -> str:
        """The action in ``torch.distributed.pipelining``'s notation: ``1F3`` is stage 1's
        forward of micro-batch 3, ``1B3`` its full backward (``_Action``'s text form)."""
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @staticmethod
    def parse(text: str) -> Action:
        """Inverse of ``str``: ``"s1.F.mb3"`` -> ``Action(1, FORWARD, 3)``.

        Raises:
            ValueError: the text is not of the form ``s<int>.<F|B>.mb<int>``.
        """
        match = _ACTION_RE.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"action {text!r} is not of the form 's<stage>.<F|B>.mb<index>'")
        return Action(int(match["stage"]), ActionKind(match["kind"]), int(match["mb"]))


_ACTION_RE = re.compile(r"s(?P<stage>\d+)\.(?P<kind>[FB])\.mb(?P<mb>\d+)")

StageActions = tuple[Action, ...]
"""The ordered actions of one stage."""


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages is {num_stages}; a pipeline needs at least one stage")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches is {num_microbatches}; need at least one")


def one_f_one_b(num_stages: int, num_microbatches: int) -> tuple[StageActions, ...]:
    """The 1F1B schedule: warm-up forwards, then alternate, then cool-down backwards.

    Stage ``s`` runs ``min(num_stages - s - 1, num_microbatches)`` warm-up forwards, then
    one forward and one backward in turn until every forward is done, then the remaining
    backwards. At most ``num_stages - s`` micro-batches are in flight on stage ``s``.

    Raises:
        ValueError: ``num_stages`` or ``num_microbatches`` is below 1.
    """
    _check_sizes(num_stages, num_microbatches)
    return tuple(_one_f_one_b_stage(s, num_stages, num_microbatches) for s in range(num_stages))


def _one_f_one_b_stage(stage: int, num_stages: int, num_microbatches: int) -> StageActions:
    num_warmup = min(num_stages - stage - 1, num_microbatches)
    actions = [Action(stage, ActionKind.FORWARD, m) for m in range(num_warmup)]
    for offset in range(num_microbatches - num_warmup):
        actions.append(Action(stage, ActionKind.FORWARD, num_warmup + offset))
        actions.append(Action(stage, ActionKind.BACKWARD, offset))
    first_cooldown = num_microbatches - num_warmup
    actions += [
        Action(stage, ActionKind.BACKWARD, m) for m in range(first_cooldown, num_microbatches)
    ]
    return tuple(actions)


def gpipe(num_stages: int, num_microbatches: int) -> tuple[StageActions, ...]:
    """The GPipe schedule: every forward, then every backward, in micro-batch order.

    Raises:
        ValueError: ``num_stages`` or ``num_microbatches`` is below 1.
    """
    _check_sizes(num_stages, num_microbatches)
    return tuple(
        tuple(Action(s, ActionKind.FORWARD, m) for m in range(num_microbatches))
        + tuple(Action(s, ActionKind.BACKWARD, m) for m in range(num_microbatches))
        for s in range(num_stages)
    )


def build_schedule(
    schedule: Schedule, num_stages: int, num_microbatches: int
) -> tuple[StageActions, ...]:
    """The per-stage action lists of ``schedule``, validated.

    Raises:
        ValueError: sizes below 1.
    """
    builders = {Schedule.ONE_F_ONE_B: one_f_one_b, Schedule.GPIPE: gpipe}
    stages = builders[schedule](num_stages, num_microbatches)
    validate_schedule(stages, num_microbatches)
    return stages


def validate_schedule(stages: Sequence[Sequence[Action]], num_microbatches: int) -> None:
    """Check that every stage forwards and then backwards each micro-batch exactly once.

    Per stage: every action names that stage; forwards appear in micro-batch order
    ``0..n-1``, backwards too; each micro-batch's backward comes after its forward.

    Raises:
        ValueError: naming the stage and the first offending action.
    """
    for stage_idx, actions in enumerate(stages):
        _validate_stage(stage_idx, actions, num_microbatches)


def _validate_stage(stage_idx: int, actions: Sequence[Action], num_microbatches: int) -> None:
    forwards = [a.microbatch for a in actions if a.kind is ActionKind.FORWARD]
    backwards = [a.microbatch for a in actions if a.kind is ActionKind.BACKWARD]
    expected = list(range(num_microbatches))
    if forwards != expected:
        raise ValueError(f"stage {stage_idx}: forwards {forwards}, want {expected}")
    if backwards != expected:
        raise ValueError(f"stage {stage_idx}: backwards {backwards}, want {expected}")
    done_forward: set[int] = set()
    for action in actions:
        if action.stage != stage_idx:
            raise ValueError(f"stage {stage_idx} lists {action}, which belongs to another stage")
        if action.kind is ActionKind.FORWARD:
            done_forward.add(action.microbatch)
        elif action.microbatch not in done_forward:
            raise ValueError(f"stage {stage_idx}: {action} comes before its forward")


@dataclass(frozen=True, slots=True)
class Transfer:
    """One point-to-point message implied by a schedule."""

    src_stage: int
    dst_stage: int
    kind: ActionKind
    """FORWARD: activations of ``microbatch``; BACKWARD: their gradients."""
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind.value}.mb{self.microbatch}:s{self.src_stage}->s{self.dst_stage}"


@dataclass(frozen=True, slots=True)
class DryRun:
    """What the dry run saw."""

    rounds: tuple[tuple[Action, ...], ...]
    """Actions run in each round (every stage whose next action was ready runs it)."""
    transfers: tuple[tuple[Transfer, Action], ...]
    """Every send, paired with the action that received it, in send order."""
    max_in_flight: tuple[int, ...]
    """Per stage: most micro-batches forwarded but not yet backwarded at any time."""


def sends_of(action: Action, num_stages: int) -> Transfer | None:
    """The message ``action`` sends when it finishes, if any."""
    if action.kind is ActionKind.FORWARD and action.stage < num_stages - 1:
        return Transfer(action.stage, action.stage + 1, ActionKind.FORWARD, action.microbatch)
    if action.kind is ActionKind.BACKWARD and action.stage > 0:
        return Transfer(action.stage, action.stage - 1, ActionKind.BACKWARD, action.microbatch)
    return None


def receives_of(action: Action, num_stages: int) -> Transfer | None:
    """The message ``action`` must receive before it can run, if any."""
    if action.kind is ActionKind.FORWARD and action.stage > 0:
        return Transfer(action.stage - 1, action.stage, ActionKind.FORWARD, action.microbatch)
    if action.kind is ActionKind.BACKWARD and action.stage < num_stages - 1:
        return Transfer(action.stage + 1, action.stage, ActionKind.BACKWARD, action.microbatch)
    return None


def dry_run(stages: Sequence[Sequence[Action]]) -> DryRun:
    """Dry-run a schedule: pair every send with its receive and prove there is no deadlock.

    Rules (those of the runtime): an action runs once the message it receives has been
    sent; it posts its own send when done, without waiting for the receiver. In each round
    every stage whose next action is ready runs it. The last stage's backward needs only its
    own forward (validated separately).

    Raises:
        ValueError: a deadlock (names every stuck stage and the message it waits for), or a
            send that no action receives.
    """
    num_stages = len(stages)
    positions = [0] * num_stages
    posted: dict[Transfer, None] = {}
    pairs: list[tuple[Transfer, Action]] = []
    rounds: list[tuple[Action, ...]] = []
    in_flight = [0] * num_stages
    max_in_flight = [0] * num_stages
    while any(positions[s] < len(stages[s]) for s in range(num_stages)):
        ready = [
            stages[s][positions[s]]
            for s in range(num_stages)
            if positions[s] < len(stages[s])
            and _is_ready(stages[s][positions[s]], num_stages, posted)
        ]
        if not ready:
            raise ValueError(f"deadlock: {_stuck(stages, positions)}")
        for action in ready:
            _run_action(action, num_stages, posted, pairs)
            positions[action.stage] += 1
            in_flight[action.stage] += 1 if action.kind is ActionKind.FORWARD else -1
            max_in_flight[action.stage] = max(max_in_flight[action.stage], in_flight[action.stage])
        rounds.append(tuple(ready))
    if posted:
        raise ValueError(f"sends never received: {', '.join(str(t) for t in posted)}")
    return DryRun(tuple(rounds), tuple(pairs), tuple(max_in_flight))


def _is_ready(action: Action, num_stages: int, posted: dict[Transfer, None]) -> bool:
    needed = receives_of(action, num_stages)
    return needed is None or needed in posted


def _run_action(
    action: Action,
    num_stages: int,
    posted: dict[Transfer, None],
    pairs: list[tuple[Transfer, Action]],
) -> None:
    needed = receives_of(action, num_stages)
    if needed is not None:
        del posted[needed]
        pairs.append((needed, action))
    sent = sends_of(action, num_stages)
    if sent is not None:
        posted[sent] = None


def _stuck(stages: Sequence[Sequence[Action]], positions: list[int]) -> str:
    num_stages = len(stages)
    parts = []
    for s, actions in enumerate(stages):
        if positions[s] >= len(actions):
            continue
        action = actions[positions[s]]
        parts.append(f"{action} waits for {receives_of(action, num_stages)}")
    return "; ".join(parts)
