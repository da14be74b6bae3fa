"""Rank 0's progress and summary lines: what a real run prints, and when."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from hplan.runtime.contract.metrics_file import read_rank_metrics, summarize_metrics
from hplan.runtime.contract.progress_lines import RunProgress, format_line, job_loss, parse_line
from tests.fixtures.plans import NUMBERED_DATASET, ReplicaShape, make_plan, run_ranks, write_model
from tests.fixtures.sample_plans import mixed_plan

TIMEOUT_S = 120.0


def _lines(text: str, kind: str) -> list[dict[str, str]]:
    parsed = [parse_line(line) for line in text.splitlines()]
    return [fields for found in parsed if found is not None for k, fields in [found] if k == kind]


def test_rank_0_shows_the_jobs_loss_although_its_stage_computes_none(tmp_path: Path) -> None:
    # rank 0 is the first stage of a two-stage pipeline: the losses come from rank 1 (its
    # replica's last stage) and rank 2 (the other replica), through the step agreement
    path = write_model(tmp_path, NUMBERED_DATASET)
    plan = make_plan(path, [ReplicaShape((1, 1), 2, 3), ReplicaShape((-1,), 1, 2)])
    metrics = tmp_path / "m"
    outcomes = run_ranks(
        plan, tmp_path / "run", "--steps", "12", "--metrics-dir", str(metrics), timeout_s=TIMEOUT_S
    )
    assert [o.returncode for o in outcomes] == [0, 0, 0], [o.stderr[-2000:] for o in outcomes]
    first = read_rank_metrics(metrics / "rank-0.jsonl")
    assert first[0].loss is None  # computes no loss
    # CPU ranks record the CPU time of their blocks and their threads
    assert all(r.compute_cpu_time_s > 0 and r.cpu_time_s >= r.compute_cpu_time_s for r in first)
    assert all(r.optimizer_cpu_time_s > 0 and r.num_threads >= 1 for r in first)
    steps = summarize_metrics(metrics).steps
    progress = _lines(outcomes[0].stderr, "progress")
    assert len(progress) >= 2  # the first loss, then every 10% (here: every 2 steps)
    for line in progress:
        step = int(line["step"].split("/")[0]) - 1
        assert line["step"].endswith("/12")
        loss = steps[step].loss
        assert loss is not None and float(line["loss"]) == pytest.approx(loss, rel=1e-3)
    (summary,) = _lines(outcomes[0].stderr, "summary")
    last_loss = steps[-1].loss
    assert last_loss is not None
    assert (summary["steps"], summary["timed_steps"]) == ("12", "11")
    assert float(summary["final_loss"]) == pytest.approx(last_loss, rel=1e-3)
    times_s = [r.step_time_s for r in read_rank_metrics(metrics / "rank-0.jsonl")][1:]
    rate = plan.global_batch_size * len(times_s) / sum(times_s)
    assert float(summary["samples_per_s"]) == pytest.approx(rate, rel=1e-3)
    for outcome in outcomes[1:]:  # only rank 0 prints them
        assert not _lines(outcome.stderr, "progress") and not _lines(outcome.stderr, "summary")


class _Clock:
    def __init__(self, step_s: float) -> None:
        self.now_s, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        return self.now_s


def _run(steps: int, step_s: float) -> tuple[list[int], str]:
    """Feed a plain progress ``steps`` steps of ``step_s`` each, the losses one step late,
    as the training loop does; the steps of its progress lines and the summary."""
    clock, out = _Clock(step_s), io.StringIO()
    progress = RunProgress(
        mixed_plan(), first_step=0, num_steps=steps, stream=out, interactive=False, clock=clock
    )
    for step in range(steps):
        clock.now_s += step_s
        progress.step_done(step, step_s)
        progress.loss_known(step - 1, 2.0)
    progress.loss_known(steps - 1, 1.5)
    summary = progress.summary()
    shown = [int(f["step"].split("/")[0]) for f in _lines(out.getvalue(), "progress")]
    return shown, summary


def test_plain_lines_come_every_tenth_of_the_steps_or_every_ten_seconds() -> None:
    shown, summary = _run(100, 0.01)  # 1 s in all: by steps
    assert shown == [1, 11, 21, 31, 41, 51, 61, 71, 81, 91]
    fields = parse_line(summary)
    assert fields is not None and fields[0] == "summary"
    values = fields[1]
    assert values["final_loss"] == "1.5" and values["steps"] == "100"
    assert float(values["samples_per_s"]) == pytest.approx(40 / 0.01)
    assert float(values["predicted_samples_per_s"]) == pytest.approx(61.35, rel=1e-3)
    assert float(values["measured_over_predicted"]) == pytest.approx(4000 / 61.35, rel=1e-3)
    shown, _ = _run(100, 3.0)  # 300 s in all: by time, every 4 steps (12 s)
    assert shown[:4] == [1, 5, 9, 13]


def test_lines_read_back_and_the_job_loss_weights_replicas_by_samples() -> None:
    line = format_line("progress", [("step", "3/9"), ("loss", 0.25), ("eta_s", 12345.6)])
    assert line == "hplan: progress step=3/9 loss=0.25 eta_s=12346"
    assert parse_line(line) == ("progress", {"step": "3/9", "loss": "0.25", "eta_s": "12346"})
    assert parse_line("hplan: rank 0 waiting for 2 peers") is None
    plan = mixed_plan()  # replicas of 32 and 8 samples
    shares = [plan.replica_ranks(r)[0].num_samples for r in range(plan.num_replicas)]
    assert job_loss(plan, [1.0, 3.0]) == pytest.approx((shares[0] + 3 * shares[1]) / sum(shares))
    assert job_loss(plan, [1.0, None]) is None
