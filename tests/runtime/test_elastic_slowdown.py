"""A node that slows (``executor/elastic/slowdown.py``): detection from the segment's rank
files, the restart's decision, and the re-plan's commands, on synthetic metrics."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hplan.runtime.contract.elastic import PlanFamily
from hplan.runtime.contract.metrics_file import StepMetrics, metrics_line, metrics_path
from hplan.runtime.executor.elastic.slowdown import (
    CONFIRM_POLLS,
    DEFAULT_RESTART_COST_S,
    SPEED_WINDOW_STEPS,
    WARMUP_STEPS,
    SpeedWatch,
    decide_restart,
    detect_slowdown,
    read_tail,
    restart_cost_s,
    solved_with,
)

STEP_S = 0.1


def _record(rank: int, step: int, *, compute_s: float = 0.08, samples: int = 4,
            step_s: float = STEP_S, end_s: float | None = None) -> StepMetrics:  # fmt: skip
    return StepMetrics(
        rank=rank, replica=rank, stage=0, step=step, step_time_s=step_s,
        compute_time_s=compute_s, p2p_time_s=0.0, wait_time_s=0.0, allreduce_time_s=0.0,
        optimizer_time_s=0.01, other_time_s=0.0, loss=1.0, samples=samples,
        peak_memory_bytes=1, end_unix_time_s=step * step_s if end_s is None else end_s,
    )  # fmt: skip


def _window(first: int, *, slow: dict[int, float] | None = None, job_step_s: float = STEP_S,
            ranks: int = 3, start_s: float = 1000.0) -> dict[int, list[StepMetrics]]:  # fmt: skip
    """Each rank's records of SPEED_WINDOW_STEPS steps from ``first``; ``slow``: {rank: factor on its
    compute}; rank 0's step ends ``job_step_s`` apart."""
    return {
        rank: [
            _record(
                rank,
                step,
                compute_s=0.08 * (slow or {}).get(rank, 1.0),
                end_s=start_s + (step - first) * job_step_s,
            )
            for step in range(first, first + SPEED_WINDOW_STEPS)
        ]
        for rank in range(ranks)
    }


def test_a_rank_whose_compute_stays_off_while_the_job_slows_is_slowed() -> None:
    found = detect_slowdown(_window(10), _window(50, slow={2: 2.0}, job_step_s=0.16))
    assert found is not None
    assert [s.rank for s in found.ranks] == [2]
    assert found.ranks[0].factor == pytest.approx(0.5)
    assert found.job_recent_s == pytest.approx(0.16) and found.job_baseline_s == pytest.approx(0.1)
    assert found.describe({2: "c"}) == "c 0.50x"


def test_a_slowdown_the_shares_absorbed_or_every_rank_shares_is_no_ranks() -> None:
    # the job's step rose 5%: the share balancing absorbed the slow rank
    assert detect_slowdown(_window(10), _window(50, slow={2: 2.0}, job_step_s=0.105)) is None
    # every rank 1.8x slower (the machine, not a node): nothing a re-plan could fix
    every = {0: 1.8, 1: 1.8, 2: 1.8}
    assert detect_slowdown(_window(10), _window(50, slow=every, job_step_s=0.18)) is None
    # a rank 20% slower: under the threshold
    assert detect_slowdown(_window(10), _window(50, slow={2: 1.2}, job_step_s=0.12)) is None


def test_a_slowed_rank_the_shares_left_little_work_is_off_the_critical_path() -> None:
    baseline, recent = _window(10), _window(50, slow={2: 2.0}, job_step_s=0.16)
    for rank in (baseline, recent):  # rank 2 computes 1 sample a step, the others 4
        rank[2] = [replace(r, samples=1, compute_time_s=r.compute_time_s / 4) for r in rank[2]]
    assert detect_slowdown(baseline, recent) is None


def test_a_restart_pays_when_the_gain_over_the_steps_left_beats_its_cost() -> None:
    go = decide_restart(measured_step_s=0.2, predicted_step_s=0.12, steps_left=1000, cost_s=20)
    assert go.restart and go.gain_s == pytest.approx(80.0)
    near_end = decide_restart(measured_step_s=0.2, predicted_step_s=0.12, steps_left=200, cost_s=20)
    assert not near_end.restart and near_end.gain_s == pytest.approx(16.0)
    assert "gain 16.0 s against a restart's 20.0 s" in near_end.describe()


def test_the_new_plans_step_is_scaled_by_the_old_plans_in_the_same_units() -> None:
    # the planner predicts 30 ms for the new plan and 60 ms for the old one under the same
    # (measured) speeds: on this machine the new plan runs at half the measured 0.2 s step
    decision = decide_restart(
        measured_step_s=0.2,
        predicted_step_s=0.03,
        old_predicted_step_s=0.06,
        steps_left=100,
        cost_s=5.0,
    )
    assert decision.predicted_step_s == pytest.approx(0.1)
    assert decision.gain_s == pytest.approx(10.0) and decision.restart


def test_a_restarts_cost_is_the_runs_last_measured_downtime(tmp_path: Path) -> None:
    from hplan.runtime.contract.elastic import SegmentRecord, write_segment

    assert restart_cost_s(tmp_path) == DEFAULT_RESTART_COST_S
    for segment, downtime in ((0, None), (1, 12.5), (2, None)):
        record = SegmentRecord(
            segment=segment, members=("a", "b"), plan_path="p", plan_digest="d",
            world_size=2, first_step=0, started_unix_s=0.0, predicted_samples_per_s=None,
            cause="start", downtime_s=downtime,
        )  # fmt: skip
        write_segment(tmp_path, record)
    assert restart_cost_s(tmp_path) == 12.5


def test_a_tail_read_skips_the_cut_first_line_and_the_unfinished_last(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.jsonl"
    lines = [metrics_line(_record(0, step)) for step in range(30)]
    path.write_text("".join(lines) + lines[0][:40], encoding="utf-8")
    tail = read_tail(path, max_bytes=sum(map(len, lines[-5:])) + 40 + 10)  # 10: a cut line
    assert [r.step for r in tail] == [25, 26, 27, 28, 29]
    assert read_tail(tmp_path / "rank-9.jsonl") == []


def _write(folder: Path, records: dict[int, list[StepMetrics]]) -> None:
    for rank, window in records.items():
        with metrics_path(folder, rank).open("a", encoding="utf-8") as out:
            out.writelines(metrics_line(r) for r in window)


def test_the_watch_re_plans_only_for_a_rank_that_stays_off_for_windows_in_a_row(
    tmp_path: Path,
) -> None:
    watch = SpeedWatch(tmp_path, [0, 1, 2], first_step=100)
    step = 100
    for _ in range(2 + (WARMUP_STEPS // SPEED_WINDOW_STEPS)):  # warm-up, then the baseline
        _write(tmp_path, _window(step, start_s=1000 + step * STEP_S))
        step += SPEED_WINDOW_STEPS
    assert watch.poll(step) is None  # healthy
    for confirmed in range(1, CONFIRM_POLLS + 1):
        _write(tmp_path, _window(step, slow={1: 2.5}, job_step_s=0.2, start_s=1000 + step * STEP_S))
        step += SPEED_WINDOW_STEPS
        found = watch.poll(step)
        assert (found is not None) == (confirmed == CONFIRM_POLLS)
    assert found is not None and [s.rank for s in found.ranks] == [1]
    assert set(watch.recent) == {0, 1, 2}  # the window a re-plan calibrates with
    _write(tmp_path, _window(step, start_s=1000 + step * STEP_S))  # the rank recovered
    assert watch.poll(step + SPEED_WINDOW_STEPS) is None


def test_the_watch_waits_for_warm_up_and_a_baseline_every_rank_wrote(tmp_path: Path) -> None:
    watch = SpeedWatch(tmp_path, [0, 1], first_step=0)
    _write(tmp_path, _window(0, ranks=1, slow={0: 3.0}))
    assert watch.poll(SPEED_WINDOW_STEPS) is None  # during warm-up
    assert watch.poll(WARMUP_STEPS + 2 * SPEED_WINDOW_STEPS) is None  # rank 1 wrote nothing


def test_the_replan_commands_are_the_planners_own(tmp_path: Path) -> None:
    from hplan.runtime.contract.elastic import calibration_command

    command = calibration_command(tmp_path / "plan.json", tmp_path / "runs", tmp_path / "out")
    assert command[1:4] == ["-m", "hplan.planner", "calibrate"]
    assert command[-2:] == ["-o", str(tmp_path / "out")]
    # the family's plan: calibrated from the solve's own profile, where it had one
    family = _family(tmp_path)
    assert solved_with(tmp_path / "plan.json", family, tmp_path) == ()
    family = replace(family, replan_files={"--profile": ("profile.json",)})
    assert solved_with(tmp_path / "plan.json", family, tmp_path) == (tmp_path / "profile.json",)
    # a plan re-planned during the run: from the calibration it was solved with
    replanned = tmp_path / "a+b-r1" / "plan" / "plan.json"
    (tmp_path / "a+b-r1" / "calibrated").mkdir(parents=True)
    (tmp_path / "a+b-r1" / "calibrated" / "calibrated.json").write_text("{}", encoding="utf-8")
    profiles = solved_with(replanned, family, tmp_path)
    assert profiles == (tmp_path / "a+b-r1" / "calibrated" / "calibrated.json",)
    command = calibration_command(replanned, tmp_path, tmp_path / "out", profiles=profiles)
    assert command[-2:] == ["--profile", str(profiles[0])]


# --------------------------------------------------------------------------- the segment


@pytest.fixture(scope="module")
def island_plans(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two plans of three one-rank islands (nodes box-a, box-b, box-c): 4|4|4 and 5|5|2."""
    from hplan.runtime.contract.plan import SyncMode
    from tests.fixtures.plans import (
        TINY_MODEL,
        ReplicaShape,
        make_plan,
        with_islands,
        write_model,
    )

    folder = tmp_path_factory.mktemp("plans")
    model = write_model(folder, TINY_MODEL)
    paths = []
    for name, shares in (("even", (4, 4, 4)), ("moved", (5, 5, 2))):
        shapes = tuple(ReplicaShape((-1,), n, n) for n in shares)
        plan = with_islands(make_plan(model, shapes), [1, 1, 1], SyncMode.LOCAL_SGD)
        path = folder / name / "plan.json"
        path.parent.mkdir()
        path.write_text(plan.to_json(), encoding="utf-8")
        paths.append(path)
    return paths[0], paths[1]


class _SolvedAtOnce:
    """A ``Replanner`` whose re-plan is ``plan_path``, done as soon as it is begun."""

    def __init__(self, plan_path: Path) -> None:
        self.plan_path = plan_path
        self.running = False
        self.begun = 0
        self._result: object = None

    def begin(self, slowdown: object, recent: object) -> None:
        from hplan.runtime.contract.plan import Plan
        from hplan.runtime.executor.elastic.slowdown import Replan

        self.begun += 1
        self._result = Replan(self.plan_path, Plan.load(self.plan_path), slowdown)  # type: ignore[arg-type]

    def take(self) -> object:
        result, self._result = self._result, None
        return result


def _family(folder: Path) -> PlanFamily:
    members = ("box-a", "box-b", "box-c")
    return PlanFamily(
        schema_version=1, hplan_version="0", nodes=members,
        processes_per_node=dict.fromkeys(members, 1), min_nodes=1,
        rendezvous_host="127.0.0.1", rendezvous_port=1, run_id="t", cluster_file="c.yaml",
        capture_file=None, model_digest="m", plans={"+".join(members): "plan.json"},
    )  # fmt: skip


def _segment(tmp_path: Path, plan_path: Path, total_steps: int) -> object:
    from hplan.runtime.contract.elastic import SharedRunDir
    from hplan.runtime.contract.plan import Plan
    from hplan.runtime.executor.elastic.segment import ElasticSegment
    from hplan.runtime.executor.elastic.start import SegmentStart

    members = ("box-a", "box-b", "box-c")
    family = _family(plan_path.parent)
    start = SegmentStart(
        None, None, family, plan_path.parent, SharedRunDir(tmp_path / "ck"),  # type: ignore[arg-type]
        "box-a", members, plan_path, Plan.load(plan_path), 0, 0, "solved ahead", 0.0,
    )  # fmt: skip
    segment = ElasticSegment(start, tmp_path / "metrics")
    segment.begin(0, total_steps)
    return segment


def _train_slowing(
    segment: object, folder: Path, num_windows: int, *, busier_from: int | None = None
) -> None:
    """Rank files as three islands write them: healthy through the baseline, then node
    box-c (rank 2) 2.5x slower and the job's step 2x longer (5x from window ``busier_from``
    on); ``after_step`` at each window."""
    step = 0
    for index in range(num_windows):
        slow = index >= 2 + WARMUP_STEPS // SPEED_WINDOW_STEPS
        start_s = 1000 + step * STEP_S
        job_step_s = 0.5 if busier_from is not None and index >= busier_from else 0.2
        window = (
            _window(step, slow={2: 2.5}, job_step_s=job_step_s, start_s=start_s)
            if slow
            else _window(step, start_s=start_s)
        )
        _write(folder, window)
        step += SPEED_WINDOW_STEPS
        segment.after_step(step)  # type: ignore[attr-defined]


def _replanning_segment(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    plan_path: Path,
    replanner: object,
    total_steps: int = 10_000,
) -> object:
    """A segment of ``plan_path`` whose watch polls at once and re-plans with ``replanner``."""
    from hplan.runtime.executor.elastic import segment as segment_module

    monkeypatch.setattr(segment_module, "POLL_S", 0.0)
    segment = _segment(tmp_path, plan_path, total_steps=total_steps)
    segment._replanner = replanner  # type: ignore[attr-defined]
    return segment


def test_a_slowed_node_makes_rank_0_replan_and_ask_the_job_to_restart(
    tmp_path: Path,
    island_plans: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hplan.runtime.contract.elastic import RunEventKind

    even, moved = island_plans
    fake = _SolvedAtOnce(moved)
    segment = _replanning_segment(tmp_path, monkeypatch, even, fake)
    _train_slowing(segment, segment.metrics_dir, 8)  # type: ignore[attr-defined]
    err = capsys.readouterr().err
    assert fake.begun == 1
    assert "measured speed box-c 0.40x of its baseline" in err
    assert "restarting under" in err and "samples box-a 5, box-b 5, box-c 2" in err
    assert segment.wants_replan  # type: ignore[attr-defined]
    shared = segment.shared  # type: ignore[attr-defined]
    assert shared.current_plans() == {"box-a+box-b+box-c": str(moved)}
    (slowed,) = [e for e in shared.events() if e.kind is RunEventKind.SLOWED]
    assert (
        slowed.node == "box-c" and slowed.detail == "re-planned for measured speeds (box-c 0.40x)"
    )
    assert segment.replanned_line() == f"re-planned for measured speeds: restarting under {moved}"  # type: ignore[attr-defined]


def test_a_replan_that_does_not_pay_before_the_end_keeps_the_plan(
    tmp_path: Path,
    island_plans: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:

    even, moved = island_plans
    segment = _replanning_segment(  # 10 steps left at the decision
        tmp_path, monkeypatch, even, _SolvedAtOnce(moved), total_steps=170
    )
    _train_slowing(segment, segment.metrics_dir, 8)  # type: ignore[attr-defined]
    err = capsys.readouterr().err
    assert "keeping the plan" in err and "restarting under" not in err
    assert not segment.wants_replan  # type: ignore[attr-defined]
    assert segment.shared.current_plans() == {}  # type: ignore[attr-defined]


class _SolvedLater(_SolvedAtOnce):
    """A ``Replanner`` whose re-plan finishes one poll after it was begun."""

    _polls_left = 0

    def begin(self, slowdown: object, recent: object) -> None:
        super().begin(slowdown, recent)
        self.running, self._polls_left = True, 1

    def take(self) -> object:
        if self._polls_left:
            self._polls_left -= 1
            return None
        self.running = False
        return super().take()


def test_the_gain_is_weighed_with_the_step_seen_at_the_detection(
    tmp_path: Path,
    island_plans: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # while the re-plan's child processes run on rank 0's node the job's step grows again
    # (0.2 -> 0.5 s here); that is the re-plan's own cost, not the slowed node's

    even, moved = island_plans
    segment = _replanning_segment(tmp_path, monkeypatch, even, _SolvedLater(moved))
    _train_slowing(segment, segment.metrics_dir, 9, busier_from=4)  # type: ignore[attr-defined]
    err = capsys.readouterr().err
    assert "restarting under" in err
    assert "step 200.0 ms measured" in err, err
