"""Measured memory against the plan: the per-rank rows, the device budget, the OOM evidence."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hplan.runtime.contract.errors import RehearsalChildError
from hplan.runtime.contract.memory import GPU_RESERVE_BYTES
from hplan.runtime.contract.memory_use import (
    MemoryBreakdown,
    budget_problem,
    killed_description,
    memory_budget_bytes,
    memory_use,
    oom_cause,
    oom_kill_counts,
)
from hplan.runtime.contract.metrics_file import MemoryMeasure, StepMetrics
from hplan.runtime.rehearsal.launcher import (
    MMAP_THRESHOLD_ENV,
    free_port,
    released_heap_env,
    supervise,
)
from tests.fixtures.sample_plans import cpu_plan, mixed_plan

GB = 10**9


def _record(rank: int, step: int, peak_bytes: int, baseline_bytes: int | None) -> StepMetrics:
    return StepMetrics(
        rank=rank,
        replica=0,
        stage=0,
        step=step,
        step_time_s=1.0,
        compute_time_s=0.5,
        p2p_time_s=0.0,
        wait_time_s=0.0,
        allreduce_time_s=0.0,
        optimizer_time_s=0.1,
        other_time_s=0.4,
        loss=None,
        samples=8,
        peak_memory_bytes=peak_bytes,
        baseline_memory_bytes=baseline_bytes,
        memory_measure=None if baseline_bytes is None else MemoryMeasure.RSS_HIGH_WATER,
    )


def test_each_rank_is_its_predicted_peak_beside_its_largest_measured_training_memory() -> None:
    plan = mixed_plan()  # rank 0 predicted at 14.2 GB on a 24 GiB rtx4090
    ranks = list(plan.report.ranks)
    ranks[1] = replace(
        ranks[1],
        parameter_memory_bytes=4 * GB,
        gradient_memory_bytes=4 * GB,
        activation_memory_bytes=3 * GB,
    )
    plan = replace(plan, report=replace(plan.report, ranks=tuple(ranks)))
    records = [
        _record(0, 0, 10 * GB, 1 * GB),
        _record(0, 1, 15 * GB, 1 * GB),  # the peak of the run
        _record(0, 0, 13 * GB, 1 * GB),  # another run of the same plan
        _record(1, 0, 5 * GB, None),  # metrics from before hplan measured a baseline
        _record(9, 0, 5 * GB, 0),  # a rank the plan lacks
    ]
    rows = memory_use(plan, records)
    assert [r.rank for r in rows] == [0, 1, 2, 3, 4]
    first, second, third = rows[:3]
    assert (first.predicted_bytes, first.measured_bytes, first.peak_bytes) == (
        14.2e9,
        14 * GB,
        15 * GB,
    )
    assert first.ratio == pytest.approx(14 / 14.2)
    assert first.baseline_bytes == GB and first.measure is MemoryMeasure.RSS_HIGH_WATER
    assert first.budget_bytes == 24 * 2**30 - GPU_RESERVE_BYTES and first.breakdown is None
    assert second.measured_bytes is None and second.ratio is None and second.peak_bytes == 5 * GB
    assert second.breakdown == MemoryBreakdown(4 * GB, 4 * GB, 0, 3 * GB, 0)
    assert third.peak_bytes is None and third.measured_bytes is None  # nothing measured


def test_a_step_over_the_device_budget_is_one_line_naming_rank_device_bytes_and_budget() -> None:
    plan = mixed_plan()
    device = plan.device(plan.ranks[4].device)  # rtx3060, 12 GiB
    budget = memory_budget_bytes(device)
    assert budget == device.memory_bytes - GPU_RESERVE_BYTES
    assert budget_problem(plan, _record(4, 2, int(budget) + 10**6, 10**6)) is None  # exactly fits
    assert budget_problem(plan, _record(4, 2, 40 * GB, None)) is None  # no baseline: unmeasured
    line = budget_problem(plan, _record(4, 2, int(budget) + 2 * 10**6, 10**6))
    assert line is not None and "\n" not in line
    assert line.startswith(
        "rank 4 on box-b/2 (rtx3060) measured 11.812 GB of training memory by step 2 "
        "(resident-set high-water 11.8 GB less the 1.0 MB its process held before its stage "
        "was built), over its device's budget of 11.811 GB (its declared 12.9 GB less the "
        "rtx3060 reserve 1.1 GB); the plan predicted 10.6 GB: declare the memory box-b/2 "
    )


def test_a_cpu_rank_is_held_to_its_declared_memory_by_its_whole_process() -> None:
    """A ``cpu`` device is the rank's process: its resident-set peak is compared with the
    declared memory (what a cgroup limit enforces), not the training memory with the
    declared memory less the planner's 360 MB reserve (which refused ranks that fitted)."""
    plan = cpu_plan()
    rank = plan.ranks[-1]
    device = plan.device(rank.device)
    declared = int(device.memory_bytes)
    baseline = 330 * 10**6
    fits = _record(rank.rank, 3, declared - 10**6, baseline)
    assert fits.training_memory_bytes > memory_budget_bytes(device)  # the old check refused it
    assert budget_problem(plan, fits) is None
    line = budget_problem(plan, _record(rank.rank, 3, declared + 10**6, baseline))
    assert line is not None and "\n" not in line
    assert line.startswith(f"rank {rank.rank} on {rank.device} (cpu) measured a resident-set ")
    assert "for its whole process by step 3 (330.0 MB before its stage was built)" in line
    assert line.endswith("re-solve, or rehearse without --enforce-memory")


def _cgroup_root(tmp_path: Path, cgroup: str, files: dict[str, str]) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_oom_counters_are_the_cgroups_own_else_its_mount_roots_else_the_machines(
    tmp_path: Path,
) -> None:
    v2 = _cgroup_root(
        tmp_path / "v2",
        "0::/job/rank\n",
        {"sys/fs/cgroup/job/rank/memory.events": "low 0\noom 2\noom_kill 1\n"},
    )
    assert oom_kill_counts(v2) == {str(v2 / "sys/fs/cgroup/job/rank/memory.events"): 1}
    v1 = _cgroup_root(
        tmp_path / "v1",
        "5:cpu:/\n4:memory:/outside/the/container\n",
        {
            "sys/fs/cgroup/memory/memory.oom_control": "oom_kill_disable 0\noom_kill 3\n",
            "proc/vmstat": "oom_kill 70\n",
        },
    )
    assert oom_kill_counts(v1) == {str(v1 / "sys/fs/cgroup/memory/memory.oom_control"): 3}
    machine = _cgroup_root(tmp_path / "vm", "0::/\n", {"proc/vmstat": "pgfault 9\noom_kill 70\n"})
    assert oom_kill_counts(machine) == {str(machine / "proc/vmstat"): 70}
    assert oom_kill_counts(tmp_path / "nothing") == {}


def test_a_sigkill_is_out_of_memory_when_a_counter_rose_and_says_so_when_none_can_tell() -> None:
    before = {"/cg/memory.events": 1}
    assert oom_cause(before, {"/cg/memory.events": 2}) == (
        "out of memory: the kernel's OOM killer counted 1 kill meanwhile in /cg/memory.events"
    )
    assert oom_cause(before, before).startswith(
        "not by the kernel's OOM killer, which counted none meanwhile in /cg/memory.events"
    )
    assert oom_cause({}, {}) == (
        "most likely out of memory; no OOM kill counter is readable here to tell"
    )


def test_a_killed_rank_names_its_node_device_prediction_and_last_measurement() -> None:
    plan = mixed_plan()
    cause = oom_cause({"f": 0}, {"f": 1})
    last = _record(3, 7, 12 * GB, 2 * GB)
    line = killed_description(plan, 3, cause, last, Path("m/rank-3.jsonl"))
    assert line == (
        "killed by SIGKILL (out of memory: the kernel's OOM killer counted 1 kill meanwhile in "
        "f) on node box-b, device box-b/1 (rtx3090, 25.8 GB declared): predicted peak 10.3 GB "
        "of training memory (plan report), last measured 10.0 GB of training memory at step 7 "
        "(peak 12.0 GB over a 2.0 GB baseline; m/rank-3.jsonl); if it ran out of memory, give "
        "it more (cluster file, re-solve) or make the plan need less (smaller micro-batches, "
        "recompute, ZeRO)"
    )
    assert "no step measured before it died (m/rank-3.jsonl has none)" in killed_description(
        plan, 3, cause, None, Path("m/rank-3.jsonl")
    )
    assert "run with --metrics-dir DIR" in killed_description(plan, 3, cause, None, None)


# --------------------------------------------------------------- --enforce-memory's allocator
def test_enforced_ranks_get_the_released_heap_setting_unless_the_user_set_one(monkeypatch):
    monkeypatch.delenv(MMAP_THRESHOLD_ENV, raising=False)
    assert released_heap_env() == {MMAP_THRESHOLD_ENV: "65536"}
    monkeypatch.setenv(MMAP_THRESHOLD_ENV, "131072")
    assert released_heap_env() == {}  # the user's own value stays, inherited


@pytest.mark.parametrize(("extra_env", "exit_code"), [({"HPLAN_PROBE": "set"}, 0), (None, 5)])
def test_supervised_ranks_receive_the_extra_environment(tmp_path, extra_env, exit_code):
    """What ``run_children`` passes for ``--enforce-memory`` reaches every rank process."""
    probe = "import os, sys; sys.exit(0 if os.environ.get('HPLAN_PROBE') == 'set' else 5)"
    logs = [tmp_path / f"rank-{r}.log" for r in range(2)]

    def failure(rank: int, code: int, line: str) -> RehearsalChildError:
        return RehearsalChildError(f"rank {rank} exit {code}", code)

    def supervised() -> None:
        supervise(
            "probe", [["-c", probe]] * 2, logs, 60.0, master_port=free_port(),
            on_poll=lambda: None, is_error_line=lambda line: False, failure=failure,
            timeout=lambda running: RehearsalChildError(f"timeout {running}", 1),
            extra_env=extra_env,
        )  # fmt: skip

    if exit_code == 0:
        supervised()
    else:
        with pytest.raises(RehearsalChildError, match=f"exit {exit_code}"):
            supervised()
