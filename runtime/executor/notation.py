"""The one adapter to ``torch.distributed.pipelining``: its action notation and its table.

hplan builds its schedules itself (``contract/schedule.py``: integers in, actions out),
but prints them as the pipelining module does, so that a reader who knows that module reads
ours: ``1F3`` is stage 1's forward of micro-batch 3 and ``1B3`` its full backward
(``_Action``), and a replica's schedule is a rank-by-step grid
(``_format_pipeline_order``). Both are private, alpha-marked names of torch; the test
``tests/runtime/test_schedule.py`` pins what this module relies on (the text of every
action parses back with ``_Action.from_str``, and the grid's layout).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.pipelining.schedules import (
    _Action,
    _ComputationType,
    _format_pipeline_order,
)

from hplan.runtime.contract.schedule import Action, ActionKind

__all__ = ["pipelining_action", "schedule_table"]

_KINDS = {
    ActionKind.FORWARD: _ComputationType.FORWARD,
    ActionKind.BACKWARD: _ComputationType.FULL_BACKWARD,
}


def pipelining_action(action: Action) -> _Action:
    """``action`` as ``torch.distributed.pipelining``'s ``_Action`` (same text: ``1F3``)."""
    return _Action(action.stage, _KINDS[action.kind], action.microbatch)


def schedule_table(
    stages: Sequence[Sequence[Action]],
    ranks: Sequence[int],
    *,
    failed: tuple[int, int] | None = None,
) -> str:
    """A replica's schedule as a rank-by-step grid, one column per stage.

    Args:
        stages: each stage's actions, in stage order.
        ranks: the plan rank that runs each stage (the grid's columns ``Rank 0..`` are the
            stages; a first line names their plan ranks).
        failed: ``(stage, action index)`` of the action that failed: the row of that index
            is marked ``<-- ERROR HERE`` (rows are positions in each stage's own list, not
            moments in time: the other columns show each stage's action at that position).

    Returns:
        Lines of text ending with a newline.
    """
    order: dict[int, list[_Action | None]] = {
        stage: [pipelining_action(a) for a in actions] for stage, actions in enumerate(stages)
    }
    columns = ", ".join(f"Rank {stage} = plan rank {rank}" for stage, rank in enumerate(ranks))
    grid = _format_pipeline_order(order, error_step_number=None if failed is None else failed[1])
    return f"columns: {columns}\n{grid}"
