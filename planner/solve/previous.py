"""``hplan solve --previous PLAN``: never trade a measured plan for one predicted slower.

After ``hplan calibrate``, the next solve runs on the corrected profile. Its search can
still land on a layout that the corrected model itself predicts slower than the plan the
run measured (a heuristic scenario, a simulator's second opinion between near ties), and a
calibration from one noisy run can move a plan to a layout that runs slower. With
``--previous``, the previous plan's layout is re-predicted under the new model (the cost
model, then the simulator, as every candidate is) and kept unless the search's layout is
predicted strictly faster.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hplan.planner.cost.evaluate import evaluate
from hplan.planner.cost.even_microbatches import smallest_microbatch
from hplan.planner.cost.layout import GroupSync, IslandSync, Layout, ReplicaLayout, StageLayout
from hplan.planner.cost.problem import PlanningProblem
from hplan.planner.sim.spec import RuntimeBytes, simulated_step_time_s
from hplan.planner.solve.solver import SolveResult
from hplan.planner.textfmt import format_seconds
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.plan import (
    MemoryStrategy,
    Plan,
    Schedule,
    SolverStatus,
    SyncMode,
    ZeroStage,
)

__all__ = ["PREVIOUS_BACKEND", "keep_previous", "layout_of_plan"]

PREVIOUS_BACKEND = "previous plan"
"""``SolveResult.backend`` (and the report's ``solver_backend``) of a kept ``--previous``
layout: no solver chose it, so the summary says it was kept rather than a solver status."""


def _refuse(path: Path, what: str) -> ConfigError:
    return ConfigError(
        f"--previous {str(path)!r}: {what}; give the plan the calibrated run ran (same "
        "cluster, model and global batch), or leave --previous out"
    )


def _island_sync(plan: Plan, problem: PlanningProblem, path: Path) -> IslandSync | None:
    """The solver's form of ``plan``'s islands and their sync (``Layout.sync``); None when
    the plan has no islands.

    Raises:
        ConfigError: the islands hold another cluster's nodes.
    """
    sync = plan.training.sync
    if sync is None:
        return None
    islands = tuple(i.nodes for i in sync.islands)
    placed = sorted(n for nodes in islands for n in nodes)
    if placed != sorted(set(problem.device_nodes)):
        raise _refuse(path, f"its islands hold nodes {placed}, this cluster has others")
    local = [g for g in sync.groups if g.mode is not SyncMode.ALL_REDUCE]
    if not local:
        return IslandSync(islands=islands, mode=SyncMode.ALL_REDUCE)
    device_of = {name: d for d, name in enumerate(problem.device_names)}
    groups = {
        tuple(sorted({device_of.get(plan.ranks[r].device, -1) for r in g.ranks})): GroupSync(
            mode=g.mode,
            local_steps=g.local_steps,
            wire_dtype=g.wire_dtype,
            num_fragments=g.num_fragments,
            overlap_steps=g.overlap_steps,
        )
        for g in local
    }
    default = groups[min(groups)]
    return IslandSync(
        islands=islands,
        mode=default.mode,
        local_steps=default.local_steps,
        wire_dtype=default.wire_dtype,
        num_fragments=default.num_fragments,
        overlap_steps=default.overlap_steps,
    ).with_groups({d: g for d, g in groups.items() if g != default})


def layout_of_plan(plan: Plan, problem: PlanningProblem, path: Path) -> Layout:
    """The solver's layout of ``plan``, in ``problem``'s device and unit indices.

    Raises:
        ConfigError: the plan has a device, node, unit or global batch the problem lacks
            (naming it). Its micro-batch sizes need
            not be candidates of the problem (the cost model interpolates between them).
    """
    sync = _island_sync(plan, problem, path)
    if plan.global_batch_size != problem.global_batch_size:
        raise _refuse(
            path,
            f"its global batch is {plan.global_batch_size}, this solve's "
            f"{problem.global_batch_size}",
        )
    devices = {name: i for i, name in enumerate(problem.device_names)}
    units = {name: i for i, name in enumerate(problem.unit_names)}
    replicas = []
    for replica in sorted({r.replica for r in plan.ranks}):
        ranks = sorted((r for r in plan.ranks if r.replica == replica), key=lambda r: r.stage)
        for r in ranks:
            if r.device not in devices:
                raise _refuse(path, f"its device {r.device!r} is not in this cluster")
            unknown = [u for u in r.units if u not in units]
            if unknown:
                raise _refuse(path, f"its unit {unknown[0]!r} is not in this model")
        # its micro-batch size need not be a candidate (the solver's own plans may run a
        # share as one micro-batch of any size; the cost model interpolates)
        first = ranks[0]
        stages = tuple(
            StageLayout(
                device_idx=devices[r.device],
                unit_start=units[r.units[0]],
                unit_stop=units[r.units[-1]] + 1,
                recompute=r.memory_strategy is MemoryStrategy.RECOMPUTE,
                recompute_units=tuple(units[u] for u in r.recompute_units),
            )
            for r in ranks
        )
        replicas.append(
            ReplicaLayout(
                stages=stages,
                micro_batch_size=first.micro_batch_size,
                num_microbatches=first.num_microbatches,
                num_samples=first.num_samples,
            )
        )
    weights: tuple[float, ...] = ()
    if plan.training.zero_stage is not ZeroStage.NONE:
        by_device = {devices[r.device]: r.optimizer_shard_weight for r in plan.ranks}
        weights = tuple(by_device.get(d, 0.0) for d in range(len(problem.device_names)))
    layout = Layout(
        replicas=tuple(replicas),
        sync=sync,
        optimizer_shard_weights=weights,
        zero_stage=max(1, int(plan.training.zero_stage)),
    )
    try:
        layout.verify()
    except ValueError as exc:
        raise _refuse(path, f"its layout does not fit this model ({exc})") from None
    return layout


def keep_previous(
    problem: PlanningProblem,
    result: SolveResult,
    previous: Plan,
    path: Path,
    schedule: Schedule,
    runtime: RuntimeBytes,
) -> SolveResult:
    """``result``, or ``previous``'s layout when the model predicts it no slower.

    Both are compared as the plan reports them: simulated where the result was simulated,
    else the cost model's step. A previous layout that no longer fits memory, or has a
    micro-batch below ``problem.min_microbatch_samples``, is not kept.

    Raises:
        ConfigError: see :func:`layout_of_plan`.
    """
    if previous.tensor_parallel:
        return _with_note(
            result,
            f"--previous {path}: the search's layout replaces it (a plan with TP groups is "
            "not re-costed yet)",
        )
    layout = layout_of_plan(previous, problem, path)
    floor = problem.min_microbatch_samples
    if any(smallest_microbatch(r.num_samples, r.micro_batch_size) < floor for r in layout.replicas):
        return _with_note(
            result,
            f"--previous {path}: the search's layout replaces it (it has a micro-batch below "
            f"{floor} samples, which the model's batch norm needs)",
        )
    evaluation = evaluate(problem, layout)
    simulated_s = (
        None
        if result.simulated_step_time_s is None
        else simulated_step_time_s(problem, layout, schedule, runtime)
    )
    old_s = evaluation.step_time_s if simulated_s is None else simulated_s
    new_s = (
        result.evaluation.step_time_s
        if result.simulated_step_time_s is None
        else result.simulated_step_time_s
    )
    if not evaluation.memory_ok or new_s < old_s:
        why = "does not fit memory" if not evaluation.memory_ok else f"{format_seconds(old_s)}"
        note = (
            f"--previous {path}: the search's layout ({format_seconds(new_s)} per step) "
            f"replaces it (predicted {why})"
        )
        return _with_note(result, note)
    note = (
        f"--previous {path}: kept its layout, predicted {format_seconds(old_s)} per step "
        f"under this model against the search's {format_seconds(new_s)}"
    )
    return SolveResult(
        layout=layout,
        evaluation=evaluation,
        status=SolverStatus.HEURISTIC,
        gap=None,
        backend=PREVIOUS_BACKEND,
        source=PREVIOUS_BACKEND,
        notes=(*result.notes, note),
        simulated_step_time_s=simulated_s,
    )


def _with_note(result: SolveResult, note: str) -> SolveResult:
    return replace(result, notes=(*result.notes, note))
