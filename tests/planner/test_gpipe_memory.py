"""One in-flight rule (``contract.memory.in_flight_microbatches``) for the search, the
evaluator, the validator and the plan's memory check: under GPipe every micro-batch is in
flight, so a plan that does not fit with all of them is never produced, and one that fits by
recomputing is found."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hplan.planner.cost.evaluate import evaluate, max_microbatches, stage_memory_bytes
from hplan.planner.cost.problem import Policy
from hplan.planner.solve.search import SolveOptions
from hplan.planner.solve.solver import solve
from hplan.planner.solve.validate import layout_problems
from hplan.runtime.contract.errors import InfeasiblePlanError
from hplan.runtime.contract.memory import in_flight_microbatches
from hplan.runtime.contract.plan import MemoryStrategy, Plan, Schedule
from tests.fixtures.brute_force import brute_force
from tests.fixtures.problems import GB, Dev, make_problem

FAST = SolveOptions(time_limit_s=30, watchdog=False)
ROOT = Path(__file__).resolve().parents[2]


def _one_device(schedule: Schedule, policy: Policy = Policy.AUTO):  # type: ignore[no-untyped-def]
    """One 2 GB device, 4 units of 0.1 GB static and 0.1 GB a sample of activations, a
    global batch of 8 in micro-batches of 2: keeping every activation needs 1.2 GB with one
    micro-batch in flight (1F1B's one stage) and 3.6 GB with all four (GPipe)."""
    problem = make_problem(
        [Dev("a", 1.0, 2.0 * GB)],
        unit_work=[1.0] * 4,
        global_batch_size=8,
        micro_batch_sizes=(2,),
        static_bytes=0.1 * GB,
        act_bytes_per_sample=0.1 * GB,
        cut_bytes_per_sample=1e6,
    )
    return replace(problem, schedule=schedule, recompute=policy)


def _all_in_flight_bytes(problem, layout) -> list[float]:  # type: ignore[no-untyped-def]
    """Each stage's memory with the micro-batches the schedule keeps in flight."""
    return [
        stage_memory_bytes(
            problem,
            stage.unit_start,
            stage.unit_stop,
            replica.micro_batch_size,
            in_flight_microbatches(
                problem.schedule, s, replica.num_stages, replica.num_microbatches
            ),
            stage.recompute,
            stage.recompute_units,
        )
        for replica in layout.replicas
        for s, stage in enumerate(replica.stages)
    ]


def test_the_rule_counts_every_microbatch_under_gpipe_and_at_most_the_stages_under_1f1b() -> None:
    assert in_flight_microbatches(Schedule.ONE_F_ONE_B, 0, 4, 8) == 4
    assert in_flight_microbatches(Schedule.ONE_F_ONE_B, 0, 4, 2) == 2
    assert in_flight_microbatches(Schedule.ONE_F_ONE_B, 1, 4) == 3  # any count: S - s
    assert in_flight_microbatches(Schedule.GPIPE, 3, 4, 8) == 8
    with pytest.raises(ValueError, match="GPipe"):
        in_flight_microbatches(Schedule.GPIPE, 0, 4)


def test_a_gpipe_solve_recomputes_to_fit_every_microbatch_in_flight() -> None:
    problem = _one_device(Schedule.GPIPE)
    result = solve(problem, FAST)
    (replica,) = result.layout.replicas
    assert replica.num_microbatches == 4
    assert replica.stages[0].recomputed_units  # keeping everything does not fit
    assert max(_all_in_flight_bytes(problem, result.layout)) <= 2.0 * GB
    assert evaluate(problem, result.layout).memory_ok
    assert not layout_problems(problem, result.layout)
    best = brute_force(problem)
    assert best is not None and result.evaluation.step_time_s == pytest.approx(best[0])


def test_the_same_problem_under_1f1b_keeps_its_activations() -> None:
    problem = _one_device(Schedule.ONE_F_ONE_B)
    (replica,) = solve(problem, FAST).layout.replicas
    assert not replica.stages[0].recomputed_units


def test_a_gpipe_layout_that_keeps_every_activation_is_refused_by_the_validator() -> None:
    problem = _one_device(Schedule.GPIPE)
    kept = solve(_one_device(Schedule.ONE_F_ONE_B), FAST).layout
    assert any("needs" in p for p in layout_problems(problem, kept))
    assert not evaluate(problem, kept).memory_ok
    assert max_microbatches(problem, kept.replicas[0].stages, 2) == 2  # 0.4 GB + 0.8 GB each


def test_gpipe_without_recomputation_is_infeasible_and_says_so() -> None:
    problem = _one_device(Schedule.GPIPE, Policy.NEVER)
    with pytest.raises(InfeasiblePlanError):
        solve(problem, replace(FAST, zero=Policy.NEVER, offload=Policy.NEVER))


@pytest.mark.slow
def test_hplan_solve_with_gpipe_on_a_small_device_finds_the_recomputing_plan(
    tmp_path: Path,
) -> None:
    """The issue's case: ``--schedule gpipe -b 256`` on a device with 900 kB usable exited 3
    ("the solver's layout does not fit under the plan's own schedule")."""
    cluster = tmp_path / "tiny.yaml"
    cluster.write_text(
        "name: tiny\nnodes:\n  - name: box\n    host: 127.0.0.1\n    devices:\n"
        "      - {type: cpu, count: 1, memory_gb: 0.361}\n",
        encoding="utf-8",
    )
    out = tmp_path / "out"
    env = {**os.environ, "HPLAN_MLP_LAYERS": "4", "HPLAN_MLP_WIDTH": "64"}
    done = subprocess.run(
        [
            str(Path(sys.executable).with_name("hplan")),
            "solve",
            str(ROOT / "examples" / "mlp" / "model.py"),
            "-c",
            str(cluster),
            "-b",
            "256",
            "--schedule",
            "gpipe",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    plan = Plan.load(out / "plan.json")
    (rank,) = plan.ranks
    assert rank.num_microbatches > 1
    assert rank.memory_strategy is not MemoryStrategy.KEEP  # it recomputes (some) units
