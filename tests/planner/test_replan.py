"""`hplan replan`: the plan solved again for the devices left, and a job resumed under it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hplan.planner.cli.main import main
from hplan.runtime.contract.metrics_file import read_rank_metrics
from hplan.runtime.contract.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "examples" / "mlp" / "model.py"
MIXED = ROOT / "examples" / "clusters" / "mixed-3090-4090.yaml"
HOME_LAB = ROOT / "examples" / "clusters" / "home-lab.yaml"

THREE_CPU_NODES = """\
name: three-cpu-nodes
nodes:
  - {name: left, host: 127.0.0.1, devices: [{type: cpu}]}
  - {name: middle, host: 127.0.0.1, devices: [{type: cpu}]}
  - {name: right, host: 127.0.0.1, devices: [{type: cpu}]}
links:
  inter_node: {bandwidth_gbit_per_s: 10}
"""


def _hplan(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


@pytest.fixture(scope="module")
def mixed_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mixed") / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["solve", str(MLP), "-c", str(MIXED), "-o", str(out), "-b", "32",
              "--strategy", "ddp", "--seed", "7"])  # fmt: skip
    assert exit_info.value.code == 0
    return out / "plan.json"


def test_replan_keeps_model_batch_and_seed_and_uses_only_the_devices_left(
    mixed_plan: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = Plan.load(mixed_plan)
    out = tmp_path / "new"
    argv = ["replan", str(mixed_plan), "-c", str(MIXED), "--without", "box-a",
            "--without", "box-b/2", "-o", str(out), "--json"]  # fmt: skip
    code, stdout, err = _hplan(argv, capsys)
    assert code == 0, err
    assert json.loads(stdout)["plan"] == str(out / "plan.json")
    new = Plan.load(out / "plan.json")
    assert [d.name for d in new.cluster.devices] == ["box-b/0", "box-b/1"]
    assert {r.device for r in new.ranks} <= {"box-b/0", "box-b/1"}
    assert new.global_batch_size == old.global_batch_size == 32
    assert new.training.seed == old.training.seed == 7
    assert new.model.graph_fingerprint == old.model.graph_fingerprint
    assert new.training.master_host == "10.0.0.2"  # rank 0's node moved to box-b
    assert (out / "launch" / "node-box-b.sh").is_file()
    assert not (out / "launch" / "node-box-a.sh").exists()
    # a second re-plan starts from the new plan's devices: box-b/2 stays out; --with brings
    # a device of the cluster file back
    again = tmp_path / "again"
    code, _, err = _hplan(
        ["replan", str(out / "plan.json"), "-c", str(MIXED), "--with", "box-a/0", "-o", str(again)],
        capsys,
    )
    assert code == 0, err
    devices = [d.name for d in Plan.load(again / "plan.json").cluster.devices]
    assert devices == ["box-a/0", "box-b/0", "box-b/1"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--without", "box-z"], "--without 'box-z': the plan has no such node or device"),
        (["--with", "box-z"], "--with 'box-z': "),
        ([], "give at least one --without NODE|DEVICE or --with NODE|DEVICE"),
        (["--without", "box-a", "--without", "box-b"], "no device of"),
        (["--without", "box-a", "--wire", "int9"], "'int9' is not one of"),
        (["--without", "box-a", "--max-overlap-steps", "-1"], "--max-overlap-steps -1 must be"),
    ],
)
def test_bad_replan_names_are_one_line_errors(
    mixed_plan: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    says: str,
) -> None:
    code, _, err = _hplan(
        ["replan", str(mixed_plan), "-c", str(MIXED), "-o", str(tmp_path / "o"), *args], capsys
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and says in lines[0], err
    assert "Traceback" not in err


def test_a_job_resumes_under_the_replan_for_the_nodes_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(THREE_CPU_NODES, encoding="utf-8")
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    code, _, err = _hplan(
        ["solve", str(MLP), "-c", str(cluster), "-o", str(out), "-b", "12", "--strategy", "ddp"],
        capsys,
    )
    assert code == 0, err
    assert Plan.load(out / "plan.json").world_size == 3
    code, _, err = _hplan(
        ["rehearse", str(out / "plan.json"), "--steps", "2", "--checkpoint-dir", str(ckpt),
         "--metrics-dir", str(tmp_path / "m1")],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    assert (ckpt / "latest").read_text().strip() == "step-2"
    code, _, err = _hplan(
        ["replan", str(out / "plan.json"), "-c", str(cluster), "--without", "middle"], capsys
    )
    assert code == 0, err
    replanned = tmp_path / "out-replan" / "plan.json"
    assert Plan.load(replanned).world_size == 2
    code, _, err = _hplan(
        ["rehearse", str(replanned), "--steps", "1", "--checkpoint-dir", str(ckpt), "--resume",
         "--metrics-dir", str(tmp_path / "m2")],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    assert read_rank_metrics(tmp_path / "m2" / "rank-0.jsonl")[0].step == 2
    assert (ckpt / "latest").read_text().strip() == "step-3"


def test_replan_keeps_the_plans_local_sync_mode_unless_told_otherwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An async plan over home-lab's 1 GbE re-planned without a card stays async (with no
    --sync on the command line, whose default would be auto); without a whole box, one
    node is left and the re-plan syncs every step."""
    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    argv = ["solve", str(MLP), "-c", str(HOME_LAB), "-o", str(old_dir), "-b", "256",
            "--sync", "async"]  # fmt: skip
    code, _, err = _hplan(argv, capsys)
    assert code == 0, err
    argv = ["replan", str(old_dir / "plan.json"), "-c", str(HOME_LAB), "--without", "box-b/1",
            "-o", str(new_dir)]  # fmt: skip
    code, _, err = _hplan(argv, capsys)
    assert code == 0, err
    sync = Plan.load(new_dir / "plan.json").training.sync
    assert sync is not None and sync.groups
    assert {g.mode.value for g in sync.groups} == {"async"}
    argv = ["replan", str(old_dir / "plan.json"), "-c", str(HOME_LAB), "--without", "box-b",
            "-o", str(tmp_path / "one-box")]  # fmt: skip
    code, _, err = _hplan(argv, capsys)  # one node left: nothing to sync across, so auto
    assert code == 0, err
