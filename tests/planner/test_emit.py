"""emit(): plan.json, schema, DOT, summary and launch scripts, checked as text and run.

The scripts are checked with ``bash -n`` and also executed with stand-ins for ``torchrun``,
``hplan`` and ``srun`` on PATH that record their arguments, so quoting, path resolution and
the Slurm dispatch are tested for real. Golden files: ``tests/golden/<plan>/``;
``HPLAN_UPDATE_GOLDEN=1`` rewrites them and ``schema/plan.schema.json``.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hplan.planner.emit.artifacts import (
    check_out_dir,
    emit,
    launch_nodes,
    node_script_name,
    render_launch_scripts,
    schema_text,
)
from hplan.runtime.contract.errors import ConfigError, PlanFileError
from hplan.runtime.contract.plan import NodeSpec, Plan
from tests.fixtures.sample_plans import (
    SAMPLE_PLANS,
    check_golden,
    cpu_plan,
    datacentre_plan,
    mixed_plan,
    with_suffixed_names,
)

PLAN_NAMES = sorted(SAMPLE_PLANS)
REPO_ROOT = Path(__file__).resolve().parents[2]
BASH = shutil.which("bash")
needs_bash = pytest.mark.skipif(BASH is None, reason="bash is not installed")
P2P_EXPORT = 'export NCCL_P2P_DISABLE="${NCCL_P2P_DISABLE:-1}"'
SCRIPT_TIMEOUT_S = 30

# Stand-ins: record argv (NUL-separated), NCCL_P2P_DISABLE, HPLAN_NODE and OMP_NUM_THREADS
# with HPLAN_AUTO_THREADS into $HPLAN_TEST_RECORD, .p2p, .node and .omp.
_RECORDER = """#!/usr/bin/env bash
printf '%s\\0' "$(basename "$0")" "$@" > "$HPLAN_TEST_RECORD"
printf '%s' "${NCCL_P2P_DISABLE-unset}" > "$HPLAN_TEST_RECORD.p2p"
printf '%s' "${HPLAN_NODE-unset}" > "$HPLAN_TEST_RECORD.node"
printf '%s' "${OMP_NUM_THREADS-unset} ${HPLAN_AUTO_THREADS-unset}" > "$HPLAN_TEST_RECORD.omp"
"""
# srun stand-in: drop srun's own options, run the command as this node's only task.
_FAKE_SRUN = """#!/usr/bin/env bash
while [[ $# -gt 0 && $1 == --* ]]; do shift; done
exec "$@"
"""


# --------------------------------------------------------------------------- written files
def test_emit_writes_every_artifact_in_a_stable_order(tmp_path: Path) -> None:
    written = emit(mixed_plan(), tmp_path / "out")
    relative = [p.relative_to(tmp_path / "out").as_posix() for p in written]
    assert relative == [
        "plan.json",
        "plan.schema.json",
        "plan.dot",
        "summary.txt",
        "launch/node-box-a.sh",
        "launch/node-box-b.sh",
        "launch/slurm.sbatch",
        "launch/rehearse.sh",
    ]
    assert sorted(p for p in (tmp_path / "out").rglob("*") if p.is_file()) == sorted(written)


def test_emit_makes_only_launch_scripts_executable(tmp_path: Path) -> None:
    for path in emit(cpu_plan(), tmp_path):
        executable = bool(path.stat().st_mode & stat.S_IXUSR)
        assert executable == (path.parent.name == "launch"), path


def test_emitted_plan_json_loads_back_to_the_same_plan(tmp_path: Path) -> None:
    plan = mixed_plan()
    emit(plan, tmp_path)
    assert Plan.from_json((tmp_path / "plan.json").read_text(encoding="utf-8")) == plan


def test_emit_twice_gives_identical_bytes(tmp_path: Path) -> None:
    first = {p.name: p.read_bytes() for p in emit(datacentre_plan(), tmp_path / "a")}
    second = {p.name: p.read_bytes() for p in emit(datacentre_plan(), tmp_path / "b")}
    assert first == second


@pytest.mark.parametrize("name", PLAN_NAMES)
def test_emitted_files_match_golden_files(name: str, tmp_path: Path) -> None:
    for path in emit(SAMPLE_PLANS[name](), tmp_path):
        relpath = path.relative_to(tmp_path).as_posix()
        if relpath == "plan.schema.json":
            continue  # compared with schema/plan.schema.json below
        check_golden(f"{name}/{relpath}", path.read_bytes().decode("utf-8"))


# --------------------------------------------------------------------------- schema
def test_published_schema_matches_the_plan_types() -> None:
    """schema/plan.schema.json is generated: HPLAN_UPDATE_GOLDEN=1 pytest tests/planner."""
    published = REPO_ROOT / "schema" / "plan.schema.json"
    text = schema_text()
    if os.environ.get("HPLAN_UPDATE_GOLDEN") == "1":
        published.parent.mkdir(exist_ok=True)
        published.write_bytes(text.encode("utf-8"))
    assert published.read_bytes().decode("utf-8") == text, (
        "schema/plan.schema.json is stale; regenerate it with HPLAN_UPDATE_GOLDEN=1"
    )


def test_emitted_schema_is_the_published_schema(tmp_path: Path) -> None:
    emit(cpu_plan(), tmp_path)
    assert (tmp_path / "plan.schema.json").read_text(encoding="utf-8") == schema_text()
    assert '"RankPlan"' in schema_text()


# --------------------------------------------------------------------------- node scripts
def test_geforce_node_disables_nccl_p2p_with_reason_and_override() -> None:
    script = render_launch_scripts(mixed_plan())["launch/node-box-a.sh"]
    lines = script.splitlines()
    export_idx = lines.index(P2P_EXPORT)
    comment = " ".join(lines[export_idx - 3 : export_idx])
    assert comment.startswith("# GeForce cards on this node (rtx4090)")
    assert "peer-to-peer" in comment and "hang" in comment
    assert "Set NCCL_P2P_DISABLE=0 before running to override" in comment


def test_mixed_geforce_node_names_every_consumer_kind() -> None:
    script = render_launch_scripts(mixed_plan())["launch/node-box-b.sh"]
    assert P2P_EXPORT in script.splitlines()
    assert "# GeForce cards on this node (rtx3060, rtx3090)" in script


def test_datacentre_and_cpu_nodes_leave_nccl_p2p_alone() -> None:
    for plan in (datacentre_plan(), cpu_plan()):
        for relpath, script in render_launch_scripts(plan).items():
            assert "NCCL_P2P_DISABLE" not in script, relpath


def test_node_script_runs_torchrun_with_the_node_rank_and_sizes() -> None:
    script = render_launch_scripts(mixed_plan())["launch/node-box-b.sh"]
    assert "set -euo pipefail" in script
    assert "export CUDA_DEVICE_ORDER=PCI_BUS_ID" in script
    flat = " ".join(line.rstrip("\\").strip() for line in script.splitlines())
    assert "export HPLAN_NODE=box-b" in script.splitlines()
    assert (
        'exec "${TORCHRUN[@]}" --nnodes 2 --node-rank 1 --nproc-per-node 3 --master-addr '
        '10.0.0.1 --master-port 29500 -m hplan.runtime run "$PLAN" "$@"'
    ) in flat
    assert "TORCHRUN=(torchrun)" in script.splitlines()


def test_nodes_without_ranks_get_no_script_and_do_not_count() -> None:
    plan = cpu_plan()
    idle = NodeSpec(name="spare", host="127.0.0.2", devices=())
    plan = replace(plan, cluster=replace(plan.cluster, nodes=(idle, *plan.cluster.nodes)))
    assert [n.name for n in launch_nodes(plan)] == ["localhost"]
    scripts = render_launch_scripts(plan)
    assert "launch/node-spare.sh" not in scripts
    assert "--nnodes 1 \\" in scripts["launch/node-localhost.sh"]


def test_script_names_replace_unsafe_characters() -> None:
    assert node_script_name("box-a") == "node-box-a.sh"
    assert node_script_name("../../etc/x y") == "node-.._.._etc_x_y.sh"


def test_clashing_script_names_are_a_plan_error() -> None:
    plan = _rename_nodes(mixed_plan(), {"box-a": "box a", "box-b": "box_a"})
    with pytest.raises(PlanFileError, match="clashing launch-script names"):
        render_launch_scripts(plan)


def _rename_nodes(plan: Plan, renamed: dict[str, str]) -> Plan:
    cluster = replace(
        plan.cluster,
        nodes=tuple(replace(n, name=renamed[n.name]) for n in plan.cluster.nodes),
        devices=tuple(replace(d, node=renamed[d.node]) for d in plan.cluster.devices),
    )
    ranks = tuple(replace(r, node=renamed[r.node]) for r in plan.ranks)
    return replace(plan, cluster=cluster, ranks=ranks)


# --------------------------------------------------------------------------- slurm
def test_slurm_file_asks_one_task_per_node_and_the_most_gpus_on_a_node() -> None:
    script = render_launch_scripts(mixed_plan())["launch/slurm.sbatch"]
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=3\n" in script
    assert "The hosts in plan.json must match the allocation" in script


def test_one_node_plans_say_node_not_nodes() -> None:
    scripts = render_launch_scripts(cpu_plan())
    assert '"exactly" 1 node >&2' in scripts["launch/slurm.sbatch"]
    assert "1 nodes" not in scripts["launch/slurm.sbatch"]
    one_rank = replace(cpu_plan(), ranks=cpu_plan().ranks[:1])
    assert "runs its one rank" in render_launch_scripts(one_rank)["launch/rehearse.sh"]


def test_slurm_file_for_a_cpu_plan_asks_no_gpus() -> None:
    script = render_launch_scripts(cpu_plan())["launch/slurm.sbatch"]
    assert "--gpus-per-node" not in script


# --------------------------------------------------------------------------- shell checks
@needs_bash
@pytest.mark.parametrize("name", PLAN_NAMES)
def test_every_script_passes_bash_syntax_check(name: str, tmp_path: Path) -> None:
    for path in emit(SAMPLE_PLANS[name](), tmp_path):
        if path.parent.name == "launch":
            _bash_syntax_ok(path)


def _bash_syntax_ok(path: Path) -> None:
    assert BASH is not None
    result = subprocess.run(
        [BASH, "-n", str(path)], capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S
    )
    assert result.returncode == 0, f"{path.name}: {result.stderr}"


def _single_quoted_spans(line: str) -> list[tuple[int, int]]:
    """(start, stop) of the text inside each single-quoted span, by bash's quoting rules."""
    spans, state, idx, opened = [], "", 0, 0
    while idx < len(line):
        char = line[idx]
        if state == "'":
            if char == "'":
                spans.append((opened, idx))
                state = ""
        elif char == "\\":
            idx += 1
        elif state == '"':
            state = "" if char == '"' else state
        elif char in "'\"":
            state, opened = char, idx + 1
        idx += 1
    return spans


def _occurrences(line: str, needle: str) -> list[int]:
    found, start = [], line.find(needle)
    while start >= 0:
        found.append(start)
        start = line.find(needle, start + 1)
    return found


@needs_bash
@pytest.mark.parametrize("name", PLAN_NAMES)
def test_hostile_names_reach_scripts_only_inside_single_quotes(name: str, tmp_path: Path) -> None:
    payload = ";$(rm -rf /)"
    plan = with_suffixed_names(SAMPLE_PLANS[name](), payload)
    seen = 0
    for path in emit(plan, tmp_path):
        if path.parent.name != "launch":
            continue
        _bash_syntax_ok(path)
        for line in path.read_text(encoding="utf-8").splitlines():
            spans = _single_quoted_spans(line)
            for start in _occurrences(line, payload):
                seen += 1
                inside = any(a <= start and start + len(payload) <= b for a, b in spans)
                assert inside, f"{path.name}: unquoted {payload!r} in {line!r}"
    assert seen >= 5  # node, host, device, kind, model path on the node script alone


# --------------------------------------------------------------------------- scripts run
def _fake_tools(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, body in (("torchrun", _RECORDER), ("hplan", _RECORDER), ("srun", _FAKE_SRUN)):
        (bin_dir / tool).write_text(body, encoding="utf-8")
        (bin_dir / tool).chmod(0o755)
    # without the virtual environment pytest may run in (an activated one puts its python3,
    # which imports hplan, first on PATH): the scripts must find no Python of hplan's here
    venv_bin = str(Path(sys.prefix) / "bin") if sys.prefix != sys.base_prefix else None
    path = os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep)
    return {
        "PATH": os.pathsep.join([str(bin_dir), *(d for d in path if d != venv_bin)]),
        "HOME": str(tmp_path),
        "HPLAN_TEST_RECORD": str(tmp_path / "record"),
    }


def _run(script: Path, env: dict[str, str], cwd: Path, *args: str) -> list[str]:
    assert BASH is not None
    result = subprocess.run(
        [BASH, str(script), *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    record = Path(env["HPLAN_TEST_RECORD"]).read_bytes().decode("utf-8")
    return record.split("\0")[:-1]


def _recorded_node(env: dict[str, str]) -> str:
    return Path(env["HPLAN_TEST_RECORD"] + ".node").read_bytes().decode("utf-8")


def _copied_out_dir(plan: Plan, tmp_path: Path) -> Path:
    """Emit, then move the output elsewhere: scripts must find plan.json relative to themselves."""
    emit(plan, tmp_path / "first")
    moved = tmp_path / "elsewhere" / "out"
    shutil.copytree(tmp_path / "first", moved)
    shutil.rmtree(tmp_path / "first")
    return moved


@needs_bash
def test_node_script_passes_plan_path_and_arguments_to_torchrun(tmp_path: Path) -> None:
    out = _copied_out_dir(mixed_plan(), tmp_path)
    env = _fake_tools(tmp_path)
    argv = _run(out / "launch" / "node-box-a.sh", env, tmp_path, "--steps", "3")
    assert argv == [
        "torchrun", "--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "2",
        "--master-addr", "10.0.0.1", "--master-port", "29500", "-m", "hplan.runtime", "run",
        f"{out / 'launch'}/../plan.json", "--steps", "3",
    ]  # fmt: skip
    assert Path(argv[argv.index("run") + 1]).resolve() == (out / "plan.json").resolve()
    assert _recorded_node(env) == "box-a"


@needs_bash
@pytest.mark.parametrize("check_exit", [0, 1])
def test_node_script_runs_torchrun_in_hplans_wrapper_where_its_python_passes_the_check(
    tmp_path: Path, check_exit: int
) -> None:
    out = _copied_out_dir(mixed_plan(), tmp_path)
    env = _fake_tools(tmp_path)
    python = tmp_path / "bin" / "python"  # next to torchrun: the environment's Python
    python.write_text(
        "#!/usr/bin/env bash\n"
        f'if [ "$3" = check ]; then exit {check_exit}; fi\n' + _RECORDER.split("\n", 1)[1],
        encoding="utf-8",
    )
    python.chmod(0o755)
    argv = _run(out / "launch" / "node-box-a.sh", env, tmp_path, "--steps", "3")
    launcher = ["python", "-m", "hplan.runtime", "torchrun"] if check_exit == 0 else ["torchrun"]
    assert argv == [
        *launcher, "--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "2",
        "--master-addr", "10.0.0.1", "--master-port", "29500", "-m", "hplan.runtime", "run",
        f"{out / 'launch'}/../plan.json", "--steps", "3",
    ]  # fmt: skip


@needs_bash
def test_nccl_p2p_is_disabled_by_default_and_the_user_can_override_it(tmp_path: Path) -> None:
    out = _copied_out_dir(mixed_plan(), tmp_path)
    env = _fake_tools(tmp_path)
    record = Path(env["HPLAN_TEST_RECORD"] + ".p2p")
    _run(out / "launch" / "node-box-a.sh", env, tmp_path)
    assert record.read_text(encoding="utf-8") == "1"
    _run(out / "launch" / "node-box-a.sh", {**env, "NCCL_P2P_DISABLE": "0"}, tmp_path)
    assert record.read_text(encoding="utf-8") == "0"


@needs_bash
def test_node_script_marks_its_own_thread_setting_and_keeps_the_users(tmp_path: Path) -> None:
    # torchrun sets OMP_NUM_THREADS=1 itself for several ranks per node: the script sets it
    # first, marked as its own, so that the ranks choose their threads from the node's CPUs
    out = _copied_out_dir(mixed_plan(), tmp_path)
    env = _fake_tools(tmp_path)
    env.pop("OMP_NUM_THREADS", None)
    record = Path(env["HPLAN_TEST_RECORD"] + ".omp")
    _run(out / "launch" / "node-box-a.sh", env, tmp_path)
    assert record.read_text(encoding="utf-8") == "1 1"
    _run(out / "launch" / "node-box-a.sh", {**env, "OMP_NUM_THREADS": "6"}, tmp_path)
    assert record.read_text(encoding="utf-8") == "6 unset"


@needs_bash
def test_rehearse_script_runs_hplan_rehearse_on_the_plan(tmp_path: Path) -> None:
    out = _copied_out_dir(cpu_plan(), tmp_path)
    env = _fake_tools(tmp_path)
    argv = _run(out / "launch" / "rehearse.sh", env, tmp_path, "--steps", "20")
    assert argv == ["hplan", "rehearse", f"{out / 'launch'}/../plan.json", "--steps", "20"]


@needs_bash
@pytest.mark.parametrize(
    ("slurm_env", "node"),
    [
        ({"SLURM_NODEID": "0"}, "box-a"),
        ({"SLURM_NODEID": "1"}, "box-b"),
        ({"SLURM_NODEID": "0", "SLURMD_NODENAME": "box-b"}, "box-b"),
    ],
)
def test_slurm_task_runs_the_script_of_its_node(
    slurm_env: dict[str, str], node: str, tmp_path: Path
) -> None:
    out = _copied_out_dir(mixed_plan(), tmp_path)
    env = {**_fake_tools(tmp_path), **slurm_env}
    argv = _run(out / "launch" / "slurm.sbatch", env, tmp_path, "--steps", "5")
    assert _recorded_node(env) == node
    assert argv[-2:] == ["--steps", "5"]


@needs_bash
def test_slurm_task_outside_the_plan_fails_with_a_message(tmp_path: Path) -> None:
    out = _copied_out_dir(mixed_plan(), tmp_path)
    env = {**_fake_tools(tmp_path), "SLURM_NODEID": "7"}
    assert BASH is not None
    result = subprocess.run(
        [BASH, str(out / "launch" / "slurm.sbatch")],
        env=env,
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
    )
    assert result.returncode == 2
    assert "SLURM_NODEID=7 is not a node of this plan; allocate exactly 2 nodes" in result.stderr


@needs_bash
def test_hostile_names_arrive_intact_and_execute_nothing(tmp_path: Path) -> None:
    payload = "x'\"`touch pwned1`;touch pwned2\n$(touch pwned3) $HOME"
    plan = with_suffixed_names(mixed_plan(), payload)
    out = _copied_out_dir(plan, tmp_path)
    env = {**_fake_tools(tmp_path), "SLURM_NODEID": "1"}
    argv = _run(out / "launch" / "slurm.sbatch", env, tmp_path, "--steps", "1")
    assert _recorded_node(env) == "box-b" + payload
    assert argv[argv.index("--master-addr") + 1] == "10.0.0.1" + payload
    assert "--model" not in argv  # the runtime reads the model path from plan.json
    argv = _run(out / "launch" / "rehearse.sh", env, tmp_path)
    assert argv[0] == "hplan"
    leftovers = [p.name for p in tmp_path.rglob("pwned*")]
    assert leftovers == []


def test_re_emitting_removes_node_scripts_of_the_old_plan_only(tmp_path: Path) -> None:
    emit(mixed_plan(), tmp_path)  # node-box-a.sh, node-box-b.sh
    mine = tmp_path / "launch" / "node-mine.sh"
    mine.write_text("#!/usr/bin/env bash\necho my own script\n")
    written = emit(cpu_plan(), tmp_path)  # node-localhost.sh
    scripts = sorted(p.name for p in (tmp_path / "launch").glob("node-*.sh"))
    assert scripts == ["node-localhost.sh", "node-mine.sh"]
    assert all(p.exists() for p in written)


def test_an_output_folder_that_cannot_be_written_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("not a folder")
    for out in (blocker, blocker / "sub"):
        with pytest.raises(ConfigError, match="pass -o a folder"):
            check_out_dir(out)
        with pytest.raises(ConfigError, match="cannot write the plan to"):
            emit(cpu_plan(), out)
    check_out_dir(tmp_path / "new" / "folder")  # may be created


@needs_bash
def test_scripts_say_to_activate_the_environment_when_tools_are_missing(tmp_path: Path) -> None:
    out = _copied_out_dir(cpu_plan(), tmp_path)
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    for tool in ("dirname", "env"):  # what the scripts need besides hplan and torchrun
        found = shutil.which(tool)
        assert found is not None
        (empty / tool).symlink_to(found)
    env = {"PATH": str(empty), "HOME": str(tmp_path)}
    for script, tool in (("rehearse.sh", "hplan"), ("node-localhost.sh", "torchrun")):
        assert BASH is not None
        result = subprocess.run(
            [BASH, str(out / "launch" / script)],
            env=env,
            capture_output=True,
            text=True,
            timeout=SCRIPT_TIMEOUT_S,
        )
        assert result.returncode == 4, result.stderr
        assert f"'{tool}' is not on PATH" in result.stderr
        assert "source .venv/bin/activate" in result.stderr
