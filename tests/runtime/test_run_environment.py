"""`hplan run` checks the machine before it waits, and waits quietly with one message."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from hplan.runtime.executor.cli import main
from hplan.runtime.rehearsal.launcher import free_port
from tests.fixtures.plans import (
    NUMBERED_DATASET,
    ReplicaShape,
    make_plan,
    rank_command,
    write_model,
)
from tests.fixtures.sample_plans import mixed_plan

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


@no_cuda
def test_a_gpu_plan_on_a_machine_without_cuda_exits_4_before_joining(
    tmp_path: Path, capsys
) -> None:
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(mixed_plan().to_json())  # NCCL, master 10.0.0.1: would wait 300 s
    assert main(["run", str(plan_path), "--rank", "0"]) == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "EnvironmentProblemError" in err[0] and "NCCL" in err[0] and "rehearse" in err[0]


def test_a_rank_whose_peers_never_come_says_so_once_and_fails_in_one_line(tmp_path: Path) -> None:
    path = write_model(tmp_path, NUMBERED_DATASET)
    plan = make_plan(path, [ReplicaShape((-1,), 2, 2), ReplicaShape((-1,), 2, 2)], timeout_s=3.0)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.to_json())
    command = rank_command(plan_path, 1, "--master-port", str(free_port()))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_CPP_LOG_LEVEL", None)
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1
    assert len(lines) == 2, lines  # no C++ stack traces of the connection retries
    assert lines[0].startswith("hplan: rank 1 waiting for 1 peer at 127.0.0.1:")
    assert lines[0].endswith("(timeout 3 s)")
    assert "PeerFailureError" in lines[1] and "could not join" in lines[1]


def test_usage_errors_and_a_missing_node_are_one_line_exit_2(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(mixed_plan().to_json())
    with pytest.raises(SystemExit) as info:
        main(["run", str(plan_path), "--bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unrecognized arguments: --bogus" in err[0]
    monkeypatch.delenv("HPLAN_NODE", raising=False)
    assert main(["run", str(plan_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "HPLAN_NODE" in err[0]
    monkeypatch.setenv("HPLAN_NODE", "nowhere")
    assert main(["run", str(plan_path)]) == 2
    assert "--node 'nowhere' runs no rank of this plan" in capsys.readouterr().err


def test_gloo_uses_the_interface_of_the_nodes_plan_address(monkeypatch) -> None:
    from hplan.runtime.executor.rendezvous import GLOO_INTERFACE_ENV, use_interface_of

    monkeypatch.delenv(GLOO_INTERFACE_ENV, raising=False)
    assert use_interface_of("192.0.2.250") is None  # TEST-NET: on no interface here
    assert GLOO_INTERFACE_ENV not in os.environ
    assert use_interface_of("127.0.0.1") == "lo"
    assert os.environ[GLOO_INTERFACE_ENV] == "lo"
    monkeypatch.setenv(GLOO_INTERFACE_ENV, "eth7")  # the user's choice stays
    assert use_interface_of("127.0.0.1") is None
    assert os.environ[GLOO_INTERFACE_ENV] == "eth7"
