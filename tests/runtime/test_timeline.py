"""Timelines: the Chrome trace writer, the per-rank timeline files, and the trace a rehearsal
measures."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.schedule import build_schedule
from hplan.runtime.contract.timeline_file import (
    COMPUTE,
    SEND_NEXT,
    WAIT,
    TimelineEvent,
    TimelineWriter,
    check_trace_path,
    chrome_trace,
    read_step_events,
    write_chrome_trace,
)
from hplan.runtime.rehearsal.rehearse import rehearse
from tests.fixtures.plans import GPT_MODEL, ReplicaShape, make_plan, placeholder_report


def test_chrome_trace_has_one_process_per_rank_and_one_thread_per_track() -> None:
    events = [
        TimelineEvent(1, COMPUTE, "s1.F.mb0", 0.002, 0.003, {"microbatch": 0}),
        TimelineEvent(0, SEND_NEXT, "F.mb0 s0->s1", 0.001, 0.002),
        TimelineEvent(0, COMPUTE, "s0.F.mb0", 0.0, 0.001),
    ]
    trace = chrome_trace(events, process_names={0: "rank 0 · first", 1: "rank 1"})
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["name"]) for e in spans] == [
        (0, "s0.F.mb0"),
        (0, "F.mb0 s0->s1"),
        (1, "s1.F.mb0"),
    ]
    assert spans[2]["ts"] == pytest.approx(2000.0) and spans[2]["dur"] == pytest.approx(1000.0)
    assert spans[0]["tid"] != spans[1]["tid"]  # compute and communication on separate tracks
    meta = {
        (e["name"], e["pid"], e["tid"]): e["args"] for e in trace["traceEvents"] if e["ph"] == "M"
    }
    assert meta[("process_name", 0, 0)] == {"name": "rank 0 · first"}
    assert meta[("thread_name", 1, spans[1]["tid"])] == {"name": SEND_NEXT}
    assert chrome_trace(list(reversed(events))) == chrome_trace(events)  # deterministic


def test_write_chrome_trace_names_an_unwritable_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot write trace"):
        write_chrome_trace(tmp_path / "missing" / "t.json", [])


def test_timeline_files_round_trip_and_start_at_zero(tmp_path: Path) -> None:
    for rank in (0, 1):
        writer = TimelineWriter(tmp_path, rank)
        for step in (0, 1):
            base = 100.0 + 10 * step + rank
            writer.write(step, [TimelineEvent(rank, COMPUTE, "s0.F.mb0", base, base + 2.0)])
        writer.close()
    step, events = read_step_events(tmp_path, time_scale=2.0)
    assert step == 1
    assert [(e.rank, e.start_s, e.end_s) for e in events] == [(0, 0.0, 1.0), (1, 0.5, 1.5)]
    with pytest.raises(ConfigError, match="no timeline of step 7"):
        read_step_events(tmp_path, 7)


def test_a_rehearsal_writes_every_action_of_every_rank_on_one_clock(tmp_path: Path) -> None:
    plan = make_plan(
        GPT_MODEL,
        [ReplicaShape((3, -1), micro_batch_size=2, num_samples=6)],
        report=placeholder_report(2),
    )
    trace_path = tmp_path / "trace.json"
    rehearse(
        plan,
        steps=1,
        metrics_dir=tmp_path / "metrics",
        timeout_s=120.0,
        console=Console(file=io.StringIO()),
        trace_path=trace_path,
    )
    spans = [e for e in json.loads(trace_path.read_text())["traceEvents"] if e["ph"] == "X"]
    compute = {(e["pid"], e["name"]): e for e in spans if e["cat"] == COMPUTE}
    for stage, actions in enumerate(build_schedule(plan.training.schedule, 2, 3)):
        for action in actions:
            assert (stage, str(action)) in compute
        assert (stage, "optimizer") in compute
    for mb in range(3):  # one clock: stage 1 computes a micro-batch after stage 0 sent it
        first, second = compute[(0, f"s0.F.mb{mb}")], compute[(1, f"s1.F.mb{mb}")]
        assert first["ts"] + first["dur"] <= second["ts"]
        back_1, back_0 = compute[(1, f"s1.B.mb{mb}")], compute[(0, f"s0.B.mb{mb}")]
        assert back_1["ts"] + back_1["dur"] <= back_0["ts"]
    waits = {e["name"] for e in spans if e["cat"] == WAIT}
    assert "wait F.mb0 from s0" in waits and "wait B.mb2 from s1" in waits
    assert any(e["name"] == "all-reduce ranks 0,1" for e in spans)  # GPT's tied embedding
    assert min(e["ts"] for e in spans) == 0.0


def test_a_trace_path_that_cannot_be_written_is_refused_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        check_trace_path(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        check_trace_path(tmp_path / "missing" / "trace.json")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match=r"'.*afile' is a file; choose another path"):
        check_trace_path(tmp_path / "afile" / "trace.json")
    check_trace_path(tmp_path / "trace.json")


def test_a_metrics_folder_that_is_a_file_is_a_config_error(tmp_path: Path) -> None:
    from hplan.runtime.rehearsal.launcher import prepare_dir
    from tests.fixtures.sample_plans import cpu_plan

    afile = tmp_path / "metrics"
    afile.write_text("x", encoding="utf-8")
    with pytest.raises(ConfigError, match="is a file"):
        prepare_dir(afile, cpu_plan())
    folder = tmp_path / "runs"
    folder.mkdir()
    (folder / "timeline-rank-7.jsonl").write_text("{}", encoding="utf-8")
    prepare_dir(folder, cpu_plan())
    assert not (folder / "timeline-rank-7.jsonl").exists()
