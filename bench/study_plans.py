"""Plan against the study: hplan's solver on the machines of every heterogeneous Sailor plan.

For each measured plan under ``plans/mit`` (consumer GPUs, 1 GbE-class links between
machines): build the planning problem of OPT-350 on the same machines, the same global batch
and the micro-batch sizes the study profiled on every device kind
(``bench/sailor/solve.py``: ``study_problem``), solve it with ``hplan.planner.solve.solver.solve``,
and simulate hplan's layout. The solver's cost model times each link alone, so it is run on
two views (links as measured, and inter-node links divided among the GPUs that share a
machine's network card, ``shared_nic``) and the layout that simulates faster is kept; the
simulation queues the real card. Two views of the machines:

- ``gpu``: every GPU is an hplan device (tp 1), as hplan's runtime would run it;
- ``machine``: each machine is one tensor-parallel device with the study's tp, so hplan only
  chooses the layout over the study's own devices.

Each hplan layout is simulated twice: as hplan's runtime runs it (``isend``) and as the
study's runtime would (blocking point-to-point). Both send the float32 hidden state across a
cut and queue a machine's outgoing transfers on its one network card. Printed next to the
study's measured iteration time and the study's plan simulated the same way (apples to
apples). Target (issue 4): never slower, faster wherever a better layout exists.

    python bench/study_plans.py [--data ../shared/data/sailor] [--time-limit 30]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sailor.data import SailorData, load_sailor
from sailor.plan import import_study_plan, study_sim_spec
from sailor.solve import (
    Granularity,
    layout_sim_spec,
    profiled_micro_batch_sizes,
    study_problem,
)
from sailor.study import StudyPlan, read_study_plan, study_plan_paths

from hplan.planner.cost.layout import Layout
from hplan.planner.cost.problem import PlanningProblem
from hplan.planner.sim.engine import simulate
from hplan.planner.solve.search import SolveOptions
from hplan.planner.solve.solver import solve
from hplan.runtime.contract.errors import ConfigError, InfeasiblePlanError

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = Path(os.environ.get("HPLAN_SAILOR_DATA", ROOT.parent / "shared" / "data" / "sailor"))


def describe_layout(problem: PlanningProblem, layout: Layout) -> str:
    """``2 x [rtx3090 0-8 | titan-rtx 9-25] mbs 1 x 64``: replicas grouped when identical."""
    parts: dict[str, int] = {}
    for replica in layout.replicas:
        stages = " | ".join(
            f"{problem.device_kinds[s.device_idx]} {s.unit_start}-{s.unit_stop - 1}"
            for s in replica.stages
        )
        key = f"[{stages}] mbs {replica.micro_batch_size} x {replica.num_microbatches}"
        parts[key] = parts.get(key, 0) + 1
    return "; ".join(f"{n} x {k}" if n > 1 else k for k, n in parts.items())


@dataclass(frozen=True)
class Outcome:
    """hplan's plan for one target runtime."""

    step_s: float
    layout: str
    solve_s: float


def best_layout(
    problem: PlanningProblem,
    shared: PlanningProblem,
    time_limit_s: float,
    *,
    study_runtime: bool,
) -> tuple[float, Layout]:
    """Solve on both cost views (links timed alone, and divided among a card's GPUs) and
    keep the layout that simulates faster on the physical problem (the simulator as second
    opinion, as ``solve`` does among its own candidates). For the study's runtime the solver
    is also asked for its best layout without pipelines: its cost model overlaps transfers
    with compute (hplan's ``isend``), so it cannot see what the study's blocking transfers
    cost a pipeline, and only the simulation below does."""
    options = [SolveOptions(time_limit_s=time_limit_s)]
    if study_runtime:
        options.append(SolveOptions(time_limit_s=time_limit_s, max_stages=1))
    found = []
    for view in (problem, shared):
        for option in options:
            layout = solve(view, option).layout
            spec = layout_sim_spec(problem, layout, study_runtime=study_runtime)
            found.append((simulate(spec).step_time_s, layout))
    return min(found, key=lambda x: x[0])


def plan_for_hplan_runtime(
    data: SailorData, study: StudyPlan, granularity: Granularity, time_limit_s: float
) -> Outcome:
    """Every profiled micro-batch size at once, simulated as hplan's runtime runs it."""
    problem = study_problem(data, study, granularity)
    shared = study_problem(data, study, granularity, shared_nic=True)
    start = time.monotonic()
    step_s, layout = best_layout(problem, shared, time_limit_s, study_runtime=False)
    return Outcome(step_s, describe_layout(problem, layout), time.monotonic() - start)


def plan_for_study_runtime(
    data: SailorData, study: StudyPlan, granularity: Granularity, time_limit_s: float
) -> Outcome:
    """One solve per profiled micro-batch size, each simulated as the study's runtime runs
    it (blocking transfers, which the solver's cost model does not see); the fastest wins."""
    best: Outcome | None = None
    start = time.monotonic()
    for mbs in profiled_micro_batch_sizes(data, study, granularity):
        problem = study_problem(data, study, granularity, micro_batch_size=mbs)
        shared = study_problem(data, study, granularity, micro_batch_size=mbs, shared_nic=True)
        try:
            step_s, layout = best_layout(problem, shared, time_limit_s, study_runtime=True)
        except InfeasiblePlanError:
            continue  # this micro-batch size does not fit in memory
        if best is None or step_s < best.step_s:
            best = Outcome(step_s, describe_layout(problem, layout), 0.0)
    if best is None:
        raise InfeasiblePlanError(f"{study.name}: no micro-batch size fits ({granularity})")
    return Outcome(best.step_s, best.layout, time.monotonic() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--time-limit", type=float, default=30.0, help="solver limit, s")
    args = parser.parse_args()
    if not (args.data / "plans" / "mit").is_dir():
        print(f"no Sailor data folder at {args.data}; nothing to compare")
        return 0
    data = load_sailor(args.data)
    header = (
        f"{'study plan':<22} {'real s':>7} {'sim s':>7} {'runtime':<7} {'view':<7} "
        f"{'hplan s':>8} {'vs real':>8} {'vs sim':>7} {'solve s':>7}  layout"
    )
    print(header)
    print("-" * len(header))
    slower = False
    for path in study_plan_paths(data):
        if path.parent.name != "mit":
            continue
        try:
            study = read_study_plan(path)
            imported = import_study_plan(data, study)
        except ConfigError as exc:
            print(f"mit/{path.stem:<18} not compared: {exc}")
            continue
        study_sim_s = simulate(study_sim_spec(imported)).step_time_s
        for runtime, planner in (
            ("hplan", plan_for_hplan_runtime),
            ("study", plan_for_study_runtime),
        ):
            for granularity in Granularity:
                out = planner(data, study, granularity, args.time_limit)
                slower |= out.step_s > study_sim_s
                print(
                    f"{study.name:<22} {study.real_s:>7.2f} {study_sim_s:>7.2f} {runtime:<7} "
                    f"{granularity.value:<7} {out.step_s:>8.2f} {study.real_s / out.step_s:>7.2f}x "
                    f"{study_sim_s / out.step_s:>6.2f}x {out.solve_s:>7.1f}  {out.layout}"
                )
    print()
    print(
        "real s: the study's plan, measured; sim s: the study's plan simulated by hplan (the "
        "study's runtime); hplan s: hplan's plan for that runtime, simulated; vs real = real / "
        "hplan s; vs sim = sim s / hplan s"
    )
    print("never slower than the study's plan simulated the same way:", not slower)
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())
