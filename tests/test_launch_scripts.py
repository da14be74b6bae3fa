"""The launch scripts that `hplan solve` writes really train under the real torchrun.

A two-node all-cpu plan (both "nodes" on 127.0.0.1) is solved through the CLI, and every
node's ``launch/node-<node>.sh`` runs at the same time, from another directory, with the
real ``torchrun`` of this environment. Every script must exit 0 and every rank must write
its metrics. (test_emit.py checks the scripts' text and quoting with stand-ins for
torchrun; this test checks that torchrun and the runtime accept what the scripts pass.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hplan.planner.cli.main import main
from hplan.runtime.contract.plan import Plan
from hplan.runtime.rehearsal.launcher import free_port
from tests.fixtures.clusters import two_cpu_nodes_yaml

ROOT = Path(__file__).resolve().parents[1]
MLP = ROOT / "examples" / "mlp" / "model.py"
BIN_DIR = Path(sys.executable).parent
TIMEOUT_S = 180.0

TWO_NODES = two_cpu_nodes_yaml(bandwidth_gbit_per_s=10, name="two-cpu-nodes")

needs_torchrun = pytest.mark.skipif(
    not (BIN_DIR / "torchrun").exists() or shutil.which("bash") is None,
    reason="needs bash and torchrun next to this Python",
)


def _solve(tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path = MLP) -> Path:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(TWO_NODES, encoding="utf-8")
    out = tmp_path / "out"
    argv = [
        "solve", str(model), "--cluster", str(cluster), "-o", str(out), "-b", "8",
        "--strategy", "ddp", "--master-port", str(free_port()),  # torchrun's store; the only port
    ]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0, capsys.readouterr().err
    return out


def _run_all(
    scripts: list[Path],
    cwd: Path,
    *args: str,
    while_running: Callable[[list[subprocess.Popen[bytes]]], None] | None = None,
) -> list[tuple[int | None, str]]:
    """Start every script at once; kill what is left at the timeout; (exit code, output).

    ``while_running`` is called with the processes once all are started."""
    env = {**os.environ, "PATH": f"{BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("LOCAL_RANK", None)
    logs = [cwd / f"{script.stem}.log" for script in scripts]
    procs = []
    for script, log in zip(scripts, logs, strict=True):
        with log.open("wb") as sink:
            procs.append(
                subprocess.Popen(
                    ["bash", str(script), *args],
                    cwd=cwd,
                    env=env,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    deadline_s = time.monotonic() + TIMEOUT_S
    if while_running is not None:
        while_running(procs)
    while time.monotonic() < deadline_s and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return [
        (None if p.returncode == -9 else p.returncode, log.read_text())
        for p, log in zip(procs, logs, strict=True)
    ]


@needs_torchrun
def test_every_node_script_trains_under_torchrun(tmp_path: Path, capsys) -> None:
    out = _solve(tmp_path, capsys)
    plan = Plan.load(out / "plan.json")
    assert sorted({r.node for r in plan.ranks}) == ["left", "right"]
    scripts = sorted((out / "launch").glob("node-*.sh"))
    assert [s.name for s in scripts] == ["node-left.sh", "node-right.sh"]
    elsewhere = tmp_path / "elsewhere"  # the plan's model path must not depend on the cwd
    elsewhere.mkdir()
    metrics = tmp_path / "metrics"
    results = _run_all(scripts, elsewhere, "--steps", "1", "--metrics-dir", str(metrics))
    for script, (code, output) in zip(scripts, results, strict=True):
        assert code == 0, f"{script.name} exited {code}:\n{output[-3000:]}"
    for rank in plan.ranks:
        lines = (metrics / f"rank-{rank.rank}.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [0]


@needs_torchrun
def test_sigterm_to_one_node_script_checkpoints_every_rank_and_the_job_resumes(
    tmp_path: Path, capsys
) -> None:
    out = _solve(tmp_path, capsys)
    scripts = sorted((out / "launch").glob("node-*.sh"))
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics"
    args = ("--steps", "100000", "--checkpoint-dir", str(ckpt), "--metrics-dir", str(metrics))
    first = metrics / "rank-0.jsonl"

    def preempt_right(procs: list[subprocess.Popen[bytes]]) -> None:
        deadline_s = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline_s and (
            not first.exists() or first.read_text().count("\n") < 3
        ):
            time.sleep(0.1)
        procs[1].send_signal(signal.SIGTERM)  # the script exec'd torchrun: what Slurm signals

    results = _run_all(scripts, tmp_path, *args, while_running=preempt_right)
    steps = [len((metrics / f"rank-{r}.jsonl").read_text().splitlines()) for r in (0, 1)]
    assert steps[0] == steps[1] >= 3
    for script, (code, output) in zip(scripts, results, strict=True):
        assert code is not None and code != 0, f"{script.name}:\n{output[-3000:]}"
        assert f"PreemptedError: preempted (SIGTERM) after {steps[0]} steps" in output, output
    assert (ckpt / "latest").read_text().strip() == f"step-{steps[0]}"
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    again = _run_all(scripts, resumed, "--steps", "1", "--checkpoint-dir", str(ckpt),
                     "--resume", "--metrics-dir", str(resumed))  # fmt: skip
    for script, (code, output) in zip(scripts, again, strict=True):
        assert code == 0, f"{script.name} exited {code}:\n{output[-3000:]}"
    assert json.loads((resumed / "rank-1.jsonl").read_text())["step"] == steps[0]


@needs_torchrun
def test_a_mistake_in_the_options_stops_a_node_script_in_one_line_before_torchrun(
    tmp_path: Path, capsys
) -> None:
    out = _solve(tmp_path, capsys)  # no --steps: the plan has no training length
    script = out / "launch" / "node-left.sh"
    for args, needle in (
        ((), "the plan gives no training length"),
        (("--steps", "0"), "--steps is 0"),
        (("--steps", "2", "--model", str(tmp_path / "nope.py")), "nope.py"),
    ):
        env = {**os.environ, "PATH": f"{BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"}
        env.pop("LOCAL_RANK", None)
        proc = subprocess.run(
            ["bash", str(script), *args], cwd=tmp_path, env=env, capture_output=True,
            text=True, timeout=60, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        code, output = proc.returncode, proc.stdout + proc.stderr
        lines = output.strip().splitlines()
        assert code == 2, output
        assert len(lines) == 1 and needle in lines[0], output
        assert "torchrun" not in output.lower().replace("torchrun`", "")  # never started


@needs_torchrun
def test_a_rank_the_kernel_kills_is_one_line_with_its_memory_not_torchruns_table(
    tmp_path: Path, capsys
) -> None:
    model = tmp_path / "model.py"  # rank 1 (node right) dies by SIGKILL in its second step
    model.write_text(
        MLP.read_text(encoding="utf-8").replace(
            "def loss_fn(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:\n",
            "CALLS = []\n\n\n"
            "def loss_fn(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:\n"
            "    import signal\n\n"
            "    CALLS.append(1)\n"
            "    if os.environ.get('RANK') == '1' and len(CALLS) == 2:\n"
            "        os.kill(os.getpid(), signal.SIGKILL)\n",
        ),
        encoding="utf-8",
    )
    out = _solve(tmp_path, capsys, model)
    plan = Plan.load(out / "plan.json")
    assert plan.ranks[1].node == "right"
    scripts = sorted((out / "launch").glob("node-*.sh"))
    metrics = tmp_path / "metrics"
    results = _run_all(scripts, tmp_path, "--steps", "3", "--metrics-dir", str(metrics))
    (left_code, left), (right_code, right) = results
    assert right_code == 1, right[-3000:]
    killed = [line for line in right.splitlines() if line.startswith("hplan run (rank 1")]
    assert len(killed) == 1, right[-3000:]
    assert killed[0].startswith("hplan run (rank 1, node right): killed by SIGKILL ("), killed
    assert "on node right, device right/0 (cpu" in killed[0]
    assert "of training memory (plan report), last measured " in killed[0]
    assert "at step 0 (peak " in killed[0] and str(metrics / "rank-1.jsonl") in killed[0]
    assert "Traceback" not in right and "ChildFailedError" not in right, right[-3000:]
    assert left_code is not None and left_code != 0  # its peer died: a peer failure
    assert "hplan run (rank 0, node left): exited with code 1 (its error is above)" in left
