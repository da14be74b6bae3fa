"""Elastic runs end to end: the launch scripts of ``hplan solve --elastic`` under torchrun's
elastic agent, three one-CPU "nodes" on this machine (each node's script in a process group
of its own, told apart by ``HPLAN_NODE``).

A node's every process killed: the survivors go on under their plan from the newest
checkpoint; its script started again: it waits, is taken in, and the run ends on all three,
every script exiting 0. Survivors that cannot hold the model end the run on every node with
one line and exit 3.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hplan.runtime.contract.elastic import RunEventKind, SharedRunDir, read_segments
from hplan.runtime.rehearsal.launcher import free_port

pytestmark = pytest.mark.serial  # torchrun agents on loopback: the nodes' timing matters

BIN = Path(sys.executable).parent
STEP_S = 0.03
"""Each step lasts at least this long (the model file's data sleeps): the run cannot end
before the test has acted, however fast the machine."""
MODEL = f"""
import time
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 1))

def sample_batch(batch_size):
    time.sleep({STEP_S})
    x = torch.randn(batch_size, 8)
    return x, x.sum(dim=1, keepdim=True)

def loss_fn(pred, target):
    return torch.nn.functional.mse_loss(pred, target)
"""
TIMEOUT_S = 240.0


def _cluster(small_c: bool) -> str:
    c_memory = ", memory_gib: 0.0001" if small_c else ""
    return "\n".join(
        [
            "name: elastic-test",
            "nodes:",
            "  - {name: a, host: 127.0.0.1, devices: [{type: cpu}]}",
            "  - {name: b, host: 127.0.0.1, devices: [{type: cpu}]}",
            f"  - {{name: c, host: 127.0.0.1, devices: [{{type: cpu{c_memory}}}]}}",
            "links:",
            "  inter_node: {bandwidth_gbit_per_s: 10, latency_us: 100}",
            "",
        ]
    )


def _env(tag: str) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.update({"HPLAN_TEST_TAG": tag, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    env.update({"HPLAN_JOIN_TIMEOUT_S": "60"})
    env.pop("LOCAL_RANK", None)
    return env


def _solve(tmp_path: Path, *args: str, small_c: bool = False) -> Path:
    model = tmp_path / "model.py"
    model.write_text(MODEL)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(_cluster(small_c))
    out = tmp_path / "plan"
    done = subprocess.run(
        [str(BIN / "hplan"), "solve", str(model), "-c", str(cluster), "-b", "8", "-o", str(out),
         "--elastic", "--master-port", str(free_port()), "--time-limit", "20", *args],
        capture_output=True, text=True, env=_env("solve"), timeout=TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return out


class Nodes:
    """The nodes' launch scripts, started and killed by this test only (by their tag)."""

    def __init__(self, plan_dir: Path, tmp_path: Path, *args: str) -> None:
        self.plan_dir, self.tmp_path, self.args = plan_dir, tmp_path, args
        self.tag = f"elastic-{os.getpid()}-{time.monotonic_ns()}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, list[Path]] = {}

    def start(self, node: str) -> None:
        log = self.tmp_path / f"{node}-{len(self.logs.get(node, []))}.log"
        self.logs.setdefault(node, []).append(log)
        with log.open("wb") as out:
            self.procs[node] = subprocess.Popen(
                ["bash", str(self.plan_dir / "launch" / f"node-{node}.sh"), *self.args],
                stdout=out, stderr=subprocess.STDOUT, env=_env(self.tag),
                start_new_session=True,
            )  # fmt: skip

    def log(self, node: str) -> str:
        return "".join(p.read_text(errors="replace") for p in self.logs.get(node, []))

    def kill(self, node: str) -> None:
        """SIGKILL every process of ``node`` this test started (its agent and workers)."""
        for pid in self._pids(node):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.procs[node].wait(timeout=30)

    def _pids(self, node: str) -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"HPLAN_TEST_TAG={self.tag}".encode() in environ and (
                f"HPLAN_NODE={node}".encode() in environ
            ):
                found.append(int(entry.name))
        return found

    def wait_all(self) -> dict[str, int]:
        return {node: proc.wait(timeout=TIMEOUT_S) for node, proc in self.procs.items()}

    def stop_all(self) -> None:
        for node in list(self.procs):
            if self.procs[node].poll() is None:
                self.kill(node)


def _wait_until(condition: Callable[[], bool], what: str, nodes: Nodes) -> None:
    deadline_s = time.monotonic() + TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline_s:
            logs = "\n".join(f"--- {n}\n{nodes.log(n)[-3000:]}" for n in ("a", "b", "c"))
            pytest.fail(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.2)


def _steps_done(shared: SharedRunDir) -> int:
    state = shared.read_state()
    return -1 if state is None else state.steps_done


def test_a_lost_node_is_replaced_by_the_survivors_plan_and_taken_back_in(tmp_path: Path) -> None:
    plan_dir = _solve(tmp_path, "--steps", "240", "--strategy", "ddp")  # every node trains
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics"
    nodes = Nodes(
        plan_dir, tmp_path, "--checkpoint-dir", str(ckpt), "--checkpoint-every-steps", "5",
        "--metrics-dir", str(metrics), "--join-probation-s", "1",
    )  # fmt: skip
    shared = SharedRunDir(ckpt)
    try:
        nodes.start("a")  # the rendezvous host first
        time.sleep(1.0)
        nodes.start("b")
        nodes.start("c")
        _wait_until(lambda: _steps_done(shared) >= 20, "step 20 on three nodes", nodes)
        assert shared.read_state().members == ("a", "b", "c")  # type: ignore[union-attr]
        lost_at_step = _steps_done(shared)
        nodes.kill("c")
        _wait_until(lambda: "node c lost;" in nodes.log("a"), "the survivors' takeover", nodes)
        nodes.start("c")  # back: it waits in its check, then is taken in
        _wait_until(lambda: "node c joined;" in nodes.log("a"), "node c taken back in", nodes)
        codes = nodes.wait_all()
    finally:
        nodes.stop_all()
    assert codes == {"a": 0, "b": 0, "c": 0}, {n: nodes.log(n)[-2000:] for n in codes}
    takeover = next(line for line in nodes.log("a").splitlines() if "node c lost;" in line)
    assert "the plan for a+b (solved ahead, 2 ranks) took over" in takeover
    redone = int(takeover.rsplit(";", 1)[1].split()[0])
    assert 0 <= redone <= 5  # at most one checkpoint interval
    segments = [record for _, record in read_segments(metrics)]
    assert [s.members for s in segments] == [("a", "b", "c"), ("a", "b"), ("a", "b", "c")]
    assert [s.cause for s in segments] == ["start", "node c lost", "node c joined"]
    assert segments[1].first_step <= lost_at_step + 5
    kinds = [(e.kind, e.node) for e in shared.events()]
    assert (RunEventKind.LOST, "c") in kinds and (RunEventKind.ADMITTED, "c") in kinds
    assert kinds[-1] == (RunEventKind.ENDED, None)
    assert shared.read_state().steps_done == 240  # type: ignore[union-attr]
    waited = nodes.log("c")
    assert "waits to join the run training on a, b" in waited


def test_survivors_that_cannot_hold_the_model_end_the_run_with_one_line(tmp_path: Path) -> None:
    plan_dir = _solve(tmp_path, "--steps", "40", "--min-nodes", "1", small_c=True)
    family = json.loads((plan_dir / "family.json").read_text())
    assert "c" in family["infeasible"] or "c" not in family["plans"]
    nodes = Nodes(plan_dir, tmp_path, "--checkpoint-dir", str(tmp_path / "ckpt"))
    try:
        nodes.start("c")  # alone: no plan of c by itself holds the model
        code = nodes.procs["c"].wait(timeout=TIMEOUT_S)
    finally:
        nodes.stop_all()
    log = nodes.log("c")
    assert code == 3, log[-3000:]
    assert "hplan: elastic: the run ended: nodes c cannot train this model" in log
    assert "Traceback" not in log
