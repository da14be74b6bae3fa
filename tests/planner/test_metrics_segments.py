"""`hplan metrics` and `hplan calibrate` on an elastic run's metrics folder (segment-*/)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tests.fixtures.elastic_metrics import SegmentSpec, write_elastic_metrics
from tests.fixtures.sample_plans import cpu_plan, datacentre_plan
from tests.planner.test_cli import _assert_one_line_error, _run


def _three_segments(metrics_dir: Path) -> list[Path]:
    """3 ranks on a, b, c (steps 0..9); c lost: 2 ranks (8..19, the record's restart
    figures); c back: 3 ranks (20..24, no restart figures in the record: measured)."""
    three, two = cpu_plan(), datacentre_plan()  # predicted 156.25 samples/s; 2 ranks x 64
    return write_elastic_metrics(
        metrics_dir,
        [
            SegmentSpec(three, ("a", "b", "c"), "start", 0, 10, 0.040, 1000.0),
            SegmentSpec(
                two, ("a", "b"), "node c lost", 8, 12, 0.5, 1005.0,
                downtime_s=7.5, steps_redone=2, predicted_samples_per_s=250.0,
            ),
            SegmentSpec(three, ("a", "b", "c"), "node c joined", 20, 5, 0.050, 1020.0),
        ],
    )  # fmt: skip


def test_metrics_shows_each_segment_against_its_plan_and_the_restarts(tmp_path, capsys):
    folders = _three_segments(tmp_path / "m")
    code, out, err = _run(["metrics", str(tmp_path / "m"), "--json"], capsys)
    assert code == 0, err
    rows = json.loads(out)["segments"]
    assert [(s["segment"], s["cause"], s["members"], s["world_size"]) for s in rows] == [
        (0, "start", ["a", "b", "c"], 3),
        (1, "node c lost", ["a", "b"], 2),
        (2, "node c joined", ["a", "b", "c"], 3),
    ]
    assert [(s["first_step"], s["last_step"]) for s in rows] == [(0, 9), (8, 19), (20, 24)]
    measured = [s["samples_per_s"] for s in rows]
    assert measured == pytest.approx([8 / 0.040, 128 / 0.5, 8 / 0.050])  # warm-up left out
    predicted = [s["predicted_samples_per_s"] for s in rows]
    assert predicted == pytest.approx([156.25, 250.0, 156.25])  # the plan's, the record's
    assert rows[1]["measured_over_predicted"] == pytest.approx(256 / 250)
    # the restarts: the record's figures, else measured from the step end times and steps
    assert [(s["downtime_s"], s["steps_redone"]) for s in rows[:2]] == [(None, None), (7.5, 2)]
    # segment 1 ends at 1005 + 10 x 0.5 + 11 x 0.5; segment 2's first step at 1020 + 10 x 0.05
    assert rows[2]["downtime_s"] == pytest.approx(1020.5 - 1015.5)
    assert rows[2]["steps_redone"] == 0
    assert rows[0]["metrics"]["ranks"][2]["device"] == "localhost/2"
    assert [s["missing"] for s in rows] == [None, None, None]
    # the table: a row per segment, the restart between two rows, then the latest's ranks
    assert "an elastic run, 3 segment(s)" in err
    assert "Traceback" not in err
    lines = err.splitlines()
    row0 = next(line for line in lines if line.lstrip().startswith("000"))
    assert row0.split() == ["000", "start", "a+b+c", "3", "0..9", "200.0", "156.2", "1.28x"]
    row1 = next(line for line in lines if line.lstrip().startswith("001"))
    assert row1.split() == [
        "001",
        "node",
        "c",
        "lost",
        "a+b",
        "2",
        "8..19",
        "256.0",
        "250.0",
        "1.02x",
    ]
    assert "restart: 7.5 s down, 2 steps redone" in err
    assert "restart: 5.0 s down, 0 steps redone" in err
    assert lines.index(row0) < next(i for i, ln in enumerate(lines) if "7.5 s down" in ln)
    assert "segment 002 (the latest measured" in err and "localhost/2" in err
    # one segment's folder is a run of its own plan, as before
    code, out, err = _run(["metrics", str(folders[1]), "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["samples_per_s"] == pytest.approx(256.0)


def test_a_segment_without_rank_files_or_steps_is_shown_as_such(tmp_path, capsys):
    three = cpu_plan()
    folders = write_elastic_metrics(
        tmp_path / "m",
        [
            SegmentSpec(three, ("a", "b", "c"), "start", 0, 4, 0.040, 1000.0),
            SegmentSpec(three, ("a", "b", "c"), "resumed", 4, 0, 0.040, 1010.0, rank_files=False),
            SegmentSpec(three, ("a", "b", "c"), "resumed", 4, 0, 0.040, 1020.0),  # empty files
            SegmentSpec(three, ("a", "b", "c"), "resumed", 4, 2, 0.040, 1030.0),
        ],
    )
    (folders[3] / "rank-1.jsonl").write_text("not json\n")
    code, out, err = _run(["metrics", str(tmp_path / "m"), "--json"], capsys)
    assert code == 0, err
    assert "Traceback" not in err
    rows = json.loads(out)["segments"]
    assert [s["missing"] is None for s in rows] == [True, False, False, False]
    assert rows[1]["missing"] == "no rank files"
    assert rows[2]["missing"].startswith("no step measured")
    assert "rank-1.jsonl: not a metrics line" in rows[3]["missing"]
    assert [s["samples_per_s"] for s in rows[1:]] == [None, None, None]
    assert [s["first_step"] for s in rows] == [0, None, None, None]
    assert "no rank files" in err and "no step measured" in err
    assert "segment 003: " in err and "not a metrics line" in err  # its reason, below
    assert "segment 000 (the latest measured" in err


def test_metrics_of_an_elastic_run_refuses_plan_in_one_line(tmp_path, capsys):
    _three_segments(tmp_path / "m")
    (tmp_path / "plan.json").write_text(cpu_plan().to_json())
    code, _, err = _run(
        ["metrics", str(tmp_path / "m"), "--plan", str(tmp_path / "plan.json")], capsys
    )
    assert code == 2
    _assert_one_line_error(err, "elastic run's segments", "leave --plan out", "segment-002")


def test_calibrate_reads_the_segments_that_ran_the_plan(tmp_path, capsys):
    _three_segments(tmp_path / "m")
    (tmp_path / "plan.json").write_text(cpu_plan().to_json())
    code, out, err = _run(
        ["calibrate", str(tmp_path / "plan.json"), str(tmp_path / "m"), "--json"], capsys
    )
    assert code == 0, err  # segments 0 and 2 ran it; segment 1 (2 ranks) is left out
    assert [r["rank"] for r in json.loads(out)["ranks"]] == [0, 1, 2]
    other = tmp_path / "other.json"
    plan = cpu_plan()
    other.write_text(replace(plan, training=replace(plan.training, steps=7)).to_json())
    code, _, err = _run(["calibrate", str(other), str(tmp_path / "m")], capsys)
    assert code == 2
    _assert_one_line_error(err, "elastic run's metrics", "none of its 3 segments", "segment-002")
