"""The solver's public entry: search, re-cost, validate, and say how good the answer is."""

from __future__ import annotations

from dataclasses import dataclass

from hplan.planner.baselines import data_parallel_equal, uniform_pipeline
from hplan.planner.evaluate import Evaluation, evaluate
from hplan.planner.layout import Layout
from hplan.planner.problem import PlanningProblem
from hplan.planner.search import SearchOutcome, SolveOptions, diagnose_infeasible, run_search
from hplan.planner.validate import layout_problems
from hplan.runtime.errors import InfeasiblePlanError
from hplan.runtime.plan import SolverStatus

__all__ = ["SolveOptions", "SolveResult", "solve"]


@dataclass(frozen=True)
class SolveResult:
    """The chosen layout and what the solver can say about it."""

    layout: Layout
    evaluation: Evaluation
    status: SolverStatus
    gap: float | None
    """Relative gap of the planning model's step time to its best lower bound."""
    backend: str
    source: str
    """Which search scenario (or baseline) produced the layout."""
    notes: tuple[str, ...]


def solve(problem: PlanningProblem, options: SolveOptions | None = None) -> SolveResult:
    """Find the fastest layout for ``problem`` within ``options.time_limit_s``.

    Every candidate (one per sync scenario, plus the data-parallel and uniform-pipeline
    baselines) is re-costed by the exact evaluator and checked by the independent
    validator; the fastest valid one wins, so the result is never slower than the
    baselines under the cost model.

    Raises:
        InfeasiblePlanError: nothing fits; the message names the binding constraint.
        SolverUnavailableError: a requested MILP backend does not work here.
    """
    options = options or SolveOptions()
    problem.verify()
    outcome = run_search(problem, options)
    pool: list[tuple[str, Layout]] = [(c.scenario, c.layout) for c in outcome.candidates]
    for name, baseline in (
        ("data parallel", data_parallel_equal(problem)),
        ("uniform pipeline", uniform_pipeline(problem)),
    ):
        if baseline is not None:
            pool.append((f"baseline: {name}", baseline))
    best: tuple[float, str, Layout, Evaluation] | None = None
    for source, layout in pool:
        if layout_problems(problem, layout):
            continue
        ev = evaluate(problem, layout)
        if best is None or ev.step_time_s < best[0]:
            best = (ev.step_time_s, source, layout, ev)
    if best is None:
        raise InfeasiblePlanError(diagnose_infeasible(problem))
    _, source, layout, ev = best
    status, gap = _status(outcome)
    notes = list(outcome.notes)
    if not outcome.exhaustive:
        notes.append(
            "too many candidate pipelines to enumerate: stage orders chosen by heuristics, "
            "unit splits by dynamic programming; the gap is measured within that search"
        )
    return SolveResult(layout, ev, status, gap, outcome.backend or "none", source, tuple(notes))


def _status(outcome: SearchOutcome) -> tuple[SolverStatus, float | None]:
    """Optimal when the whole-cluster search was exhaustive, finished, and every bisection
    was proven; otherwise the gap of the best model time to the best lower bound."""
    main = [c for c in outcome.candidates if c.main]
    if outcome.backend == "heuristic" or not main:
        return SolverStatus.HEURISTIC, None
    best_model = min(c.model_time_s for c in outcome.candidates)
    lower = min(c.lower_bound_s for c in main)
    gap = max(0.0, (best_model - lower) / best_model) if best_model > 0 else 0.0
    proven = outcome.finished and outcome.complete and all(c.proven for c in main)
    if proven and outcome.exhaustive:
        return SolverStatus.OPTIMAL, 0.0
    return SolverStatus.FEASIBLE, gap if outcome.finished and outcome.complete else None
