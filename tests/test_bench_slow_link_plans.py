"""bench/slow_link_plans.py's logic on a tiny model: its pools load as clusters, one case is
captured and solved through the CLI (in this process) (the GPT example at one layer, on the 1 GbE
desktops), rows are read from the plan and judged against their targets, and a model whose
module is missing is skipped with one line (the benchmark itself plans GPT-2 124M, an SD 1.5
UNet and a ViT-B/16; `make test` does not run it)."""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import slow_link_plans as bench  # noqa: E402

from hplan.planner.cli.main import main  # noqa: E402
from hplan.planner.hardware.cluster import parse_cluster  # noqa: E402

TINY = bench.Model("tiny-gpt", ROOT / "examples" / "gpt" / "model.py", 8)


def in_process(args: Sequence[str]) -> bench.Ran:
    """``hplan ARGS`` in this process (the benchmark's child processes cost seconds each)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        else:
            code = 0
    return bench.Ran(code, out.getvalue(), err.getvalue())


def test_the_pools_are_the_issues_clusters() -> None:
    kinds = {
        name: sorted(d.kind for d in parse_cluster(yaml.safe_load(text), source=name).devices)
        for name, text in bench.POOLS.items()
    }
    assert kinds["desktops"] == ["rtx3060", "rtx3090", "rtx3090", "rtx4090"]
    assert kinds["sites"] == ["rtx2080ti", "rtx3060", "rtx3090", "rtx3090", "rtx4090", "rtx4090"]


def test_a_tiny_case_is_captured_once_solved_and_judged(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HPLAN_GPT_LAYERS", "1")
    case = bench.Case("tiny", TINY, "desktops", target=0.01, all_devices=False)
    run = bench.Run(tmp_path, time_limit_s=1.0, runner=in_process)
    (row,) = run.case(case, ["all_reduce"])
    assert not row.error, row.error
    assert row.num_devices == 4 and 1 <= row.devices_used <= 4
    assert row.efficiency is not None and 0 < row.efficiency <= 1
    assert row.samples_per_s and row.step_s
    assert row.verdict == "PASS"
    assert run.captures["tiny-gpt"] is not None and run.captures["tiny-gpt"].exists()
    strict = bench.Case("tiny", TINY, "desktops", target=1.01)
    assert bench.Row(strict.name, "auto", 1.01, True, 4, 4, 0.99).verdict == "FAIL"
    assert bench.Row("x", "auto", 0.9, True, 3, 4, 0.99).verdict == "FAIL"  # a device idle
    assert bench.Row("x", "auto", 0.0, True, 3, 4, 0.5).verdict == "-"  # no target


PLAN = {
    "training": {
        "sync": {
            "groups": [
                {
                    "ranks": [0, 2],
                    "mode": "local_sgd",
                    "local_steps": 40,
                    "num_fragments": 4,
                    "wire_dtype": "int4",
                    "overlap_steps": 3,
                }
            ]
        }
    },
    "report": {
        "efficiency": 0.96,
        "predicted_samples_per_s": 100.0,
        "predicted_step_time_s": 1.0,
        "sync_choices": [{"ranks": [0, 2], "exposed_time_per_step_s": 0.002}],
        "idle_devices": [{"device": "b/1", "reason": "no layout\n  with it fits"}],
    },
}


def test_a_row_reads_each_groups_sync_and_the_idle_devices() -> None:
    case = bench.Case("x", TINY, "desktops", target=0.95)
    row = bench.row_from(case, "auto", {"devices_used": 3, "num_devices": 4}, PLAN)
    (group,) = row.groups
    assert group.text() == "local_sgd H=40 int4 F=4 overlap 3 exposed 2 ms/step"
    assert row.idle == ("b/1: no layout with it fits",)
    assert row.verdict == "FAIL"  # 3 of 4 devices


def test_a_missing_module_skips_the_case_and_bad_names_are_refused(tmp_path: Path, capsys) -> None:
    model = bench.Model("m", TINY.path, 8, needs="no_such_module_for_hplan")
    (row,) = bench.Run(tmp_path, 1.0).case(bench.Case("m", model, "sites", 0.9), ["auto"])
    assert row.skipped == "no_such_module_for_hplan is not installed"
    assert row.verdict == "-"
    with pytest.raises(SystemExit):
        bench.parse_args(["--cases", "gpt2-sites,huge"])
    assert "valid: gpt2-desktops" in capsys.readouterr().err
    assert bench.parse_args(["--sync", "auto,streaming"]).sync == ["auto", "streaming"]
