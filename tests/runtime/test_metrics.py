"""Metrics lines and their summary."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.metrics_file import (
    MemoryMeasure,
    MetricsWriter,
    StepMetrics,
    read_rank_metrics,
    summarize_metrics,
    summarize_records,
)

_BASE = StepMetrics(
    rank=0,
    replica=0,
    stage=0,
    step=0,
    step_time_s=1.0,
    compute_time_s=0.5,
    p2p_time_s=0.1,
    wait_time_s=0.2,
    allreduce_time_s=0.1,
    optimizer_time_s=0.05,
    other_time_s=0.05,
    loss=None,
    samples=6,
    peak_memory_bytes=100,
)


def _write(directory: Path, records: list[StepMetrics]) -> None:
    writer = MetricsWriter(directory, records[0].rank)
    for record in records:
        writer.write(record)
    writer.close()


def test_metrics_round_trip_through_json_lines(tmp_path: Path) -> None:
    records = [replace(_BASE, step=i, loss=None) for i in range(3)]
    _write(tmp_path, records)
    assert read_rank_metrics(tmp_path / "rank-0.jsonl") == records


def test_a_nonfinite_loss_is_written_as_a_string_in_strict_json_and_read_back(
    tmp_path: Path,
) -> None:
    losses = [float("nan"), float("inf"), float("-inf"), 0.5]
    _write(tmp_path, [replace(_BASE, step=i, loss=loss) for i, loss in enumerate(losses)])
    text = (tmp_path / "rank-0.jsonl").read_text()
    assert '"loss": "nan"' in text and '"loss": "-inf"' in text and "NaN" not in text
    read = [r.loss for r in read_rank_metrics(tmp_path / "rank-0.jsonl")]
    assert read[0] != read[0] and read[1:] == losses[1:]


def test_a_gradient_norm_round_trips_even_when_not_finite_and_old_lines_have_none(
    tmp_path: Path,
) -> None:
    norms = [float("inf"), 2.5, None]
    _write(tmp_path, [replace(_BASE, step=i, grad_norm=n) for i, n in enumerate(norms)])
    text = (tmp_path / "rank-0.jsonl").read_text()
    assert '"grad_norm": "inf"' in text and "Infinity" not in text
    assert [r.grad_norm for r in read_rank_metrics(tmp_path / "rank-0.jsonl")] == norms
    assert summarize_metrics(tmp_path).steps[1].grad_norm == 2.5
    # a line written before hplan recorded the norm
    old = text.splitlines()[1].replace(', "grad_norm": 2.5', "")
    assert "grad_norm" not in old
    (tmp_path / "rank-0.jsonl").write_text(old + "\n")
    assert read_rank_metrics(tmp_path / "rank-0.jsonl")[0].grad_norm is None


def test_summary_weights_replica_losses_by_samples_and_uses_the_slowest_rank(
    tmp_path: Path,
) -> None:
    # replica 0: two stages, 6 samples, loss on its last stage (rank 1); replica 1: 2 samples
    _write(tmp_path, [replace(_BASE, step=s, step_time_s=2.0) for s in range(3)])
    _write(
        tmp_path,
        [replace(_BASE, rank=1, stage=1, step=s, loss=1.0, step_time_s=1.0) for s in range(3)],
    )
    _write(
        tmp_path,
        [
            replace(_BASE, rank=2, replica=1, step=s, loss=3.0, samples=2, step_time_s=4.0 - s)
            for s in range(3)
        ],
    )
    summary = summarize_metrics(tmp_path)
    assert [s.loss for s in summary.steps] == [pytest.approx(1.5)] * 3  # (6*1 + 2*3) / 8
    assert [s.step_time_s for s in summary.steps] == [4.0, 3.0, 2.0]
    assert summary.steps[0].samples == 8
    # median over steps after the first: (3.0, 2.0) -> 2.5 s for 8 samples
    assert summary.samples_per_s == pytest.approx(8 / 2.5)
    assert [r.rank for r in summary.ranks] == [0, 1, 2]
    assert summary.ranks[2].step_time_s == pytest.approx(2.5)


def test_a_partial_last_line_is_ignored_and_garbage_is_an_error(tmp_path: Path) -> None:
    _write(tmp_path, [_BASE])
    path = tmp_path / "rank-0.jsonl"
    path.write_text(path.read_text() + '{"rank": 0, "rep')
    assert len(read_rank_metrics(path)) == 1
    path.write_text("not json\n")
    with pytest.raises(ConfigError, match="not a metrics line"):
        read_rank_metrics(path)


def test_an_empty_metrics_dir_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no rank-"):
        summarize_metrics(tmp_path)


def test_outer_sync_time_round_trips_and_old_lines_read_as_zero(tmp_path: Path) -> None:
    _write(tmp_path, [replace(_BASE, step=i, outer_sync_time_s=0.25 * i) for i in range(3)])
    assert [r.outer_sync_time_s for r in read_rank_metrics(tmp_path / "rank-0.jsonl")] == [
        0.0, 0.25, 0.5,
    ]  # fmt: skip
    assert summarize_metrics(tmp_path).ranks[0].outer_sync_time_s == pytest.approx(0.375)
    old = (tmp_path / "rank-0.jsonl").read_text().splitlines()[2]
    old = old.replace(', "outer_sync_time_s": 0.5', "")
    assert "outer_sync" not in old
    (tmp_path / "rank-0.jsonl").write_text(old + "\n")
    assert read_rank_metrics(tmp_path / "rank-0.jsonl")[0].outer_sync_time_s == 0.0


def test_rounds_with_outer_syncs_are_timed_by_their_mean_step() -> None:
    # local SGD, H = 4: three fast steps and one that waits for the outer sync, twice over
    times = [1.0, 0.1, 0.1, 0.1, 0.5, 0.1, 0.1, 0.1, 0.5]
    records = [
        replace(_BASE, step=i, step_time_s=t, loss=1.0, outer_sync_time_s=0.4 if t == 0.5 else 0.0)
        for i, t in enumerate(times)
    ]
    summary = summarize_records(records)
    timed = times[1:]
    assert summary.samples_per_s == pytest.approx(6 / (sum(timed) / len(timed)))
    assert [s.outer_sync_time_s for s in summary.steps] == [0.4 if t == 0.5 else 0.0 for t in times]
    synchronous = summarize_records([replace(r, outer_sync_time_s=0.0) for r in records])
    assert synchronous.samples_per_s == pytest.approx(6 / 0.1)  # the median: no rounds


def test_training_memory_is_the_peak_over_the_baseline_and_old_lines_have_none(
    tmp_path: Path,
) -> None:
    records = [
        replace(
            _BASE,
            step=i,
            peak_memory_bytes=peak,
            baseline_memory_bytes=300,
            memory_measure=MemoryMeasure.RSS_HIGH_WATER,
        )
        for i, peak in enumerate((350, 420, 410))
    ]
    _write(tmp_path, records)
    path = tmp_path / "rank-0.jsonl"
    assert read_rank_metrics(path) == records
    assert '"memory_measure": "rss_high_water"' in path.read_text()
    assert [r.training_memory_bytes for r in records] == [50, 120, 110]
    summary = summarize_metrics(tmp_path).ranks[0]
    assert (summary.baseline_memory_bytes, summary.training_memory_bytes) == (300, 120)
    old = path.read_text().splitlines()[0]
    old = old.replace(', "baseline_memory_bytes": 300, "memory_measure": "rss_high_water"', "")
    assert "baseline" not in old and "measure" not in old
    path.write_text(old + "\n")
    [record] = read_rank_metrics(path)
    assert record.baseline_memory_bytes is None and record.training_memory_bytes is None
    assert summarize_metrics(tmp_path).ranks[0].training_memory_bytes is None
    path.write_text(old.replace("}", ', "memory_measure": "vibes"}') + "\n")
    with pytest.raises(ConfigError, match="memory_measure 'vibes' is none of cuda_allocated"):
        read_rank_metrics(path)
