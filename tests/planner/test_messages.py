"""Issue 37's messages: the uniform baseline balanced by layers as Megatron splits them, and
the infeasible line that names the longest pipeline searched and advises only what the
request did not allow."""

from __future__ import annotations

from dataclasses import replace

from hplan.planner.cost.problem import Policy
from hplan.planner.solve.baselines import layer_bounds, uniform_pipeline
from hplan.planner.solve.search import diagnose_infeasible
from tests.fixtures.problems import GB, Dev, make_problem

LM_UNITS = ("embed", "model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3",
            "norm", "lm_head")  # fmt: skip


def test_the_uniform_baseline_splits_layers_not_units() -> None:
    # 7 units in equal counts on 3 stages: (embed, 0, 1), (2, 3), (norm, lm_head), a last
    # stage without a layer; by layers: (embed, 0, 1), (2), (3, norm, lm_head)
    assert layer_bounds(LM_UNITS, 3) == [0, 3, 4, 7]
    assert layer_bounds(LM_UNITS, 2) == [0, 3, 7]
    assert layer_bounds(LM_UNITS, 1) == [0, 7]
    assert layer_bounds(("stem", "head"), 2) == [0, 1, 2]  # no layers: equal unit counts
    devices = [Dev("a", 1.0, 80 * GB)] * 3
    work = [0.01, 1.0, 1.0, 1.0, 1.0, 0.05, 0.2]
    problem = replace(
        make_problem(devices, unit_work=work, global_batch_size=8), unit_names=LM_UNITS
    )
    layout = uniform_pipeline(problem)
    assert layout is not None
    stages = [(s.unit_start, s.unit_stop) for r in layout.replicas for s in r.stages]
    assert stages in ([(0, 3), (3, 7)], [(0, 3), (3, 4), (4, 7)])


def _sixteen_small_devices():
    devices = [Dev("a", 1.0, 1 * GB)] * 16
    return make_problem(
        devices, unit_work=[1.0] * 16, global_batch_size=16, micro_batch_sizes=(1,),
        static_bytes=0.6 * GB, act_bytes_per_sample=0.01 * GB,
    )  # fmt: skip


def test_no_pipeline_names_max_stages_and_advises_only_what_is_not_allowed() -> None:
    problem = _sixteen_small_devices()  # 16 stages of one unit would fit, 8 of two do not
    line = diagnose_infeasible(problem, "auto", zero="auto", max_stages=8)
    assert "no pipeline of at most 8 stages (--max-stages 8) holds it" in line
    assert "raise --max-stages" in line and "allow" not in line
    line = diagnose_infeasible(
        replace(problem, recompute=Policy.NEVER), "auto", zero="never", max_stages=16
    )
    assert "no pipeline of at most 16 devices holds it" in line and "--max-stages" not in line
    assert line.endswith("or allow --recompute auto and --zero auto")


def test_a_search_cut_short_adds_its_time_limit_only_where_nothing_is_proven() -> None:
    """No pipeline found in time: a longer --time-limit may help, said so; the whole model
    against every device's memory: a proof, which no time limit changes (bench: Llama 70B on
    the lab pool was told both)."""
    search_short = diagnose_infeasible(_sixteen_small_devices(), max_stages=8, cut_short_s=60)
    assert search_short.endswith("a longer --time-limit may find a layout")
    too_big = make_problem(
        [Dev("a", 1.0, 1 * GB)] * 2, unit_work=[1.0] * 4, global_batch_size=4,
        micro_batch_sizes=(1,), static_bytes=0.9 * GB, act_bytes_per_sample=0.01 * GB,
    )  # fmt: skip
    proven = diagnose_infeasible(too_big, cut_short_s=60)
    assert "all 2 devices have usable together" in proven and "--time-limit" not in proven
