"""`hplan solve --elastic`: the plan family solved ahead, its elastic launch scripts, and
`hplan replan --members` (what an elastic run asks for a membership the family lacks)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import hplan.planner.api as api
from hplan.planner.cli.main import main
from hplan.planner.emit.artifacts import ElasticLaunch, render_launch_scripts
from hplan.runtime.contract.elastic import PlanFamily, replan_command
from hplan.runtime.contract.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "examples" / "mlp" / "model.py"

# a and b are too small to hold the MLP alone or together; c holds it: the plan for every
# node runs on c only, a+b is infeasible, a+c and b+c run on c.
SMALL_AND_LARGE = """\
name: small-and-large
nodes:
  - {name: a, host: 127.0.0.1, devices: [{type: cpu, memory_gib: 0.002}]}
  - {name: b, host: 127.0.0.2, devices: [{type: cpu, memory_gib: 0.002}]}
  - {name: c, host: 127.0.0.3, devices: [{type: cpu}]}
links:
  inter_node: {bandwidth_gbit_per_s: 10}
"""


def _hplan(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """``hplan solve --elastic`` of the MLP on :data:`SMALL_AND_LARGE`: its folder, and how
    many times the model was captured."""
    root = tmp_path_factory.mktemp("elastic")
    cluster = root / "cluster-in.yaml"
    cluster.write_text(SMALL_AND_LARGE)
    out = root / "out"
    captures = []
    real = api.capture_model

    def counting(*args: Any, **kwargs: Any) -> Any:
        captures.append(1)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch, pytest.raises(SystemExit) as exit_info:
        patch.setattr(api, "capture_model", counting)
        main(["solve", str(MLP), "-c", str(cluster), "-o", str(out), "--steps", "10",
              "--time-limit", "10", "--elastic", "--json"])  # fmt: skip
    assert exit_info.value.code in (0, None)
    return out, len(captures)


def test_elastic_solve_writes_a_family_of_plans_for_exactly_their_members(
    family_dir: tuple[Path, int],
) -> None:
    out, num_captures = family_dir
    assert num_captures == 1  # the family plans reuse the solve's capture (capture.json)
    family = PlanFamily.load(out)
    assert family.nodes == ("a", "b", "c")
    assert family.processes_per_node == {"a": 1, "b": 1, "c": 1}
    assert set(family.plans) == {"a+b+c", "a+c", "b+c"}
    assert family.plans["a+b+c"] == "plan.json"
    for key, relative in family.plans.items():
        plan = Plan.load(out / relative)
        assert "+".join(n.name for n in plan.cluster.nodes) == key
        assert {r.node for r in plan.ranks} <= set(key.split("+"))
    full = Plan.load(out / "plan.json")
    assert family.model_digest == full.model.sha256
    assert (family.rendezvous_host, family.rendezvous_port) == ("127.0.0.1", 29500)
    assert family.min_nodes == 2  # the smallest membership that holds the model
    assert family.run_id.startswith("hplan-")
    assert (out / family.cluster_file).read_text() == SMALL_AND_LARGE
    assert family.capture_file == "capture.json"
    assert json.loads((out / "capture.json").read_text())["model_sha256"] == full.model.sha256


def test_a_membership_that_cannot_hold_the_model_is_recorded_with_its_reason(
    family_dir: tuple[Path, int],
) -> None:
    out, _ = family_dir
    family = PlanFamily.load(out)
    assert list(family.infeasible) == ["a+b"]
    reason = family.infeasible["a+b"]
    assert "\n" not in reason and "needs" in reason and "blocks.0" in reason
    assert not (out / "family" / "a+b").exists()


def test_elastic_scripts_for_every_node_carry_torchruns_elastic_flags(
    family_dir: tuple[Path, int],
) -> None:
    out, _ = family_dir
    family = PlanFamily.load(out)
    for node, host in (("a", "127.0.0.1"), ("b", "127.0.0.2"), ("c", "127.0.0.3")):
        script = out / "launch" / f"node-{node}.sh"  # a and b too: the full plan leaves them idle
        subprocess.run(["bash", "-n", str(script)], check=True)
        text = script.read_text()
        for flag in (
            "--nnodes 2:3",
            "--nproc-per-node 1",
            "--rdzv-backend c10d",
            "--rdzv-endpoint 127.0.0.1:29500",
            f"--rdzv-id {family.run_id}",
            # the first node hosts the store, said outright: torchrun's guess from this
            # machine's hostname misses a node whose name resolves to another address
            '--rdzv-conf "last_call_timeout=3,join_timeout=${HPLAN_JOIN_TIMEOUT_S:-600},'
            f'is_host={1 if node == "a" else 0}"',
            '--max-restarts "${HPLAN_MAX_RESTARTS:-100}"',
            "--monitor-interval 0.5",
            f"--local-addr {host}",
            "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
            '-m hplan.runtime run "$PLAN" --elastic',
            '-m hplan.runtime check "$PLAN" --elastic "$@"',
            "single point of failure",
            "reads and writes",
        ):
            assert flag in text, (node, flag)
        assert "  --node-rank" not in text and "--master-addr" not in text
    assert "leaves this node idle" in (out / "launch" / "node-a.sh").read_text()


def test_replan_members_plans_for_exactly_those_nodes_from_the_capture(
    family_dir: tuple[Path, int],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out, _ = family_dir
    family = PlanFamily.load(out)
    command = replan_command(out, family, ["c", "b"], tmp_path / "bc")
    assert command[1:3] == ["-m", "hplan.planner"]
    code, stdout, err = _hplan([*command[3:], "--time-limit", "10"], capsys)
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["plan"] == str(tmp_path / "bc" / "plan.json")
    assert summary["predicted_samples_per_s"] > 0
    assert summary["members"] == ["b", "c"]
    plan = Plan.load(tmp_path / "bc" / "plan.json")
    assert [n.name for n in plan.cluster.nodes] == ["b", "c"]


def test_replan_members_that_cannot_hold_the_model_exits_3_naming_what_is_missing(
    family_dir: tuple[Path, int],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out, _ = family_dir
    argv = ["replan", str(out / "plan.json"), "-c", str(out / "cluster.yaml"), "--members",
            "a,b", "--capture", str(out / "capture.json"), "-o", str(tmp_path / "ab")]  # fmt: skip
    code, _, err = _hplan(argv, capsys)
    assert code == 3
    assert err.count("\n") == 1 and "blocks.0" in err and "needs" in err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--members", "a,x"], "--members 'x' is not a node of"),
        (["--members", "a", "--without", "b"], "leave out --without and --with"),
        (["--members", " , "], "names no node"),
    ],
)
def test_replan_members_errors_are_one_line(
    family_dir: tuple[Path, int],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    says: str,
) -> None:
    out, _ = family_dir
    argv = ["replan", str(out / "plan.json"), "-c", str(out / "cluster.yaml"), *args,
            "-o", str(tmp_path / "x")]  # fmt: skip
    code, _, err = _hplan(argv, capsys)
    assert code == 2
    assert err.count("\n") == 1 and says in err, err
    if "'x'" in says:
        assert "(its nodes: a, b, c)" in err


def test_min_nodes_needs_elastic_and_a_cluster_sized_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = tmp_path / "c.yaml"
    cluster.write_text(SMALL_AND_LARGE)
    base = ["solve", str(MLP), "-c", str(cluster), "-o", str(tmp_path / "o"), "--min-nodes"]
    code, _, err = _hplan([*base, "2"], capsys)
    assert code == 2 and "needs --elastic" in err
    code, _, err = _hplan([*base, "4", "--elastic"], capsys)
    assert code == 2 and "--min-nodes 4 must be in 1..3" in err


def test_python_m_hplan_planner_is_the_hplan_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hplan.planner", "replan", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "--members" in done.stdout and "--capture" in done.stdout


def test_an_ipv6_rendezvous_host_is_bracketed(family_dir: tuple[Path, int]) -> None:
    out, _ = family_dir
    family = dataclasses.replace(PlanFamily.load(out), rendezvous_host="fd00::1")
    scripts = render_launch_scripts(Plan.load(out / "plan.json"), ElasticLaunch(family))
    assert "--rdzv-endpoint '[fd00::1]:29500'" in scripts["launch/node-c.sh"]


def test_a_re_solve_during_the_run_takes_the_solves_own_options_and_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(SMALL_AND_LARGE)
    out = tmp_path / "out"
    code, _, err = _hplan(
        ["solve", str(MLP), "-c", str(cluster), "-o", str(out), "--steps", "10",
         "--time-limit", "7", "--zero", "never", "--sync", "all_reduce", "--elastic"],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    family = PlanFamily.load(out)
    command = replan_command(out, family, ["a", "c"], tmp_path / "re")
    assert command[command.index("--time-limit") + 1] == "7"
    assert command[command.index("--zero") + 1] == "never"
    assert command[command.index("--sync") + 1] == "all_reduce"
    calibrated = replan_command(out, family, ["a", "c"], tmp_path / "re", profile=cluster)
    assert calibrated.count("--profile") == 1 and str(cluster) in calibrated
