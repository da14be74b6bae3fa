"""Ranks of real plans, run as gloo processes on CPU, against single-process autograd.

Every multi-process test runs under a timeout (``run_ranks`` kills what is left).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from rich.console import Console

from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.contract.errors import ConfigError, PlanMismatchError, error_reason, one_line
from hplan.runtime.contract.plan import MemoryStrategy, Schedule
from hplan.runtime.executor.cli import main, run_one_rank
from hplan.runtime.executor.rendezvous import resolve_rank
from hplan.runtime.executor.worker import RunOptions, build_rank
from hplan.runtime.rehearsal.launcher import free_port
from hplan.runtime.rehearsal.reference_check import reference_steps, relative_difference
from tests.fixtures.plans import (
    BF16_MLP,
    FROZEN_EMBEDDING,
    LATE_INPUTS,
    NUMBERED_DATASET,
    WEIGHT_USED_TWICE,
    ReplicaShape,
    compare_first_step,
    load_dumps,
    make_plan,
    rank_command,
    read_checkpoint,
    run_ranks,
    write_model,
)

TIMEOUT_S = 90.0


def _assert_all_ok(outcomes: list) -> None:
    for outcome in outcomes:
        assert outcome.returncode == 0, f"rank {outcome.rank}: {outcome.stderr[-2000:]}"


def _metrics(directory: Path, rank: int) -> list[dict]:
    lines = (directory / f"rank-{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


# --------------------------------------------------------------------------- late inputs
@pytest.fixture(scope="module")
def late_inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = write_model(tmp_path_factory.mktemp("late"), LATE_INPUTS)
    # units: inp, blocks.0..3, head -> stages [inp, blocks.0] [blocks.1, blocks.2] [blocks.3, head]
    plan = make_plan(path, [ReplicaShape((2, 2, 2), micro_batch_size=3, num_samples=8)])
    return path, plan


def test_late_inputs_mixed_dtype_cuts_and_uneven_microbatches_equal_one_process(
    late_inputs: tuple[Path, object], tmp_path: Path
) -> None:
    path, plan = late_inputs
    cut = plan.cut_after("blocks.0")
    dtypes = {t.dtype: t.requires_grad for t in cut.tensors}
    assert dtypes == {"float32": True, "bool": False, "int64": False}
    readers = {i.tensor.name: set(i.read_by_units) for i in plan.model.inputs}
    assert readers["mask"] == {"blocks.0", "blocks.1", "blocks.2", "blocks.3"}
    assert readers["labels"] == {"head"}
    assert plan.ranks[0].num_microbatches == 3  # micro-batches of 3, 3 and 2 samples
    # stage 0 keeps its activations, stage 1 recomputes blocks.2 alone (selective,
    # torch.utils.checkpoint), stage 2 recomputes the whole stage in the backward pass
    selective = replace(
        plan.ranks[1], memory_strategy=MemoryStrategy.SELECTIVE, recompute_units=("blocks.2",)
    )
    recompute = replace(plan.ranks[2], memory_strategy=MemoryStrategy.RECOMPUTE)
    plan = replace(plan, ranks=(plan.ranks[0], selective, recompute))
    plan.verify()

    outcomes = run_ranks(
        plan,
        tmp_path,
        "--steps", "1", "--verify-dir", str(tmp_path / "verify"),
        "--metrics-dir", str(tmp_path / "metrics"),
        timeout_s=TIMEOUT_S,
    )  # fmt: skip
    _assert_all_ok(outcomes)
    result = compare_first_step(plan, path, tmp_path / "verify")
    assert result.missing == ()
    assert result.loss == pytest.approx(result.reference_loss, rel=1e-5)
    assert result.grad_rel < 1e-5
    assert result.param_rel < 1e-4  # --verify tolerance: Adam amplifies near-zero grads
    assert result.noise_abs <= 1e-2 * 1.01  # AdamW lr
    losses = [m["loss"] for r in range(3) for m in _metrics(tmp_path / "metrics", r)]
    assert losses[:2] == [None, None] and losses[2] == pytest.approx(result.loss)


def test_a_missing_graph_input_names_the_input_and_the_stage_that_reads_it(
    late_inputs: tuple[Path, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, plan = late_inputs
    monkeypatch.setenv("HPLAN_TEST_DROP_LABELS", "1")
    with pytest.raises(PlanMismatchError, match=r"'labels' is read by stage 2 of replica 0"):
        build_rank(plan, 0, path, RunOptions(steps=1))


def test_a_different_graph_is_a_plan_mismatch_before_anything_runs(
    late_inputs: tuple[Path, object],
) -> None:
    path, plan = late_inputs
    changed = replace(plan, model=replace(plan.model, graph_fingerprint="0" * 64))
    with pytest.raises(PlanMismatchError, match="graph fingerprint"):
        build_rank(changed, 1, path, RunOptions(steps=1))


# --------------------------------------------------------------------------- weight twice
@pytest.mark.parametrize("schedule", [Schedule.ONE_F_ONE_B, Schedule.GPIPE])
def test_a_weight_used_in_two_stages_gets_plain_autograds_gradient(
    schedule: Schedule, tmp_path: Path
) -> None:
    path = write_model(tmp_path, WEIGHT_USED_TWICE)
    plan = make_plan(
        path, [ReplicaShape((1, 1), micro_batch_size=2, num_samples=6)], schedule=schedule
    )
    assert {t.name for t in plan.cut_after("a").tensors} == {"transpose", "getitem"}
    outcomes = run_ranks(
        plan, tmp_path, "--steps", "1", "--verify-dir", str(tmp_path / "v"), timeout_s=TIMEOUT_S
    )
    _assert_all_ok(outcomes)
    grads = load_dumps(tmp_path / "v", "grads", 2)
    reference = reference_steps(plan, load_model_file(path))
    for dump in grads:  # both stages hold w; each ends with the full gradient
        torch.testing.assert_close(
            dump["tensors"]["w"], reference.first_grads["w"], rtol=1e-5, atol=1e-7
        )
    result = compare_first_step(plan, path, tmp_path / "v")
    assert result.grad_rel < 1e-5 and result.param_rel < 1e-5 and result.noise_abs < 1e-6


# --------------------------------------------------------------------------- bf16 on gloo
def test_a_bf16_model_trains_through_a_pipeline_boundary_and_gradient_averaging(
    tmp_path: Path,
) -> None:
    path = write_model(tmp_path, BF16_MLP)
    plan = make_plan(
        path,
        [
            ReplicaShape((2, -1), micro_batch_size=2, num_samples=4),
            ReplicaShape((-1,), micro_batch_size=2, num_samples=2),
        ],
    )
    assert plan.model.param_dtype == "bfloat16"
    assert all(t.dtype == "bfloat16" for c in plan.cuts for t in c.tensors)
    outcomes = run_ranks(
        plan,
        tmp_path,
        "--steps", "3", "--verify-dir", str(tmp_path / "v"),
        "--metrics-dir", str(tmp_path / "m"),
        timeout_s=TIMEOUT_S,
    )  # fmt: skip
    _assert_all_ok(outcomes)
    params = load_dumps(tmp_path / "v", "params", 3)
    for name, value in params[2]["tensors"].items():  # replica 1 holds everything
        assert value.dtype == torch.bfloat16
        copies = [p["tensors"][name] for p in params[:2] if name in p["tensors"]]
        assert copies and all(torch.equal(c, value) for c in copies), name
    result = compare_first_step(plan, path, tmp_path / "v")
    assert result.grad_rel < 2e-2  # bf16: ~3 significant digits
    assert result.param_rel < 2e-2
    losses = [m["loss"] for m in _metrics(tmp_path / "m", 2)]
    assert all(torch.isfinite(torch.tensor(loss)) for loss in losses)


# --------------------------------------------------------------------------- frozen stage
def test_a_stage_of_frozen_parameters_only_trains_resumes_and_equals_one_process(
    tmp_path: Path,
) -> None:
    path = write_model(tmp_path, FROZEN_EMBEDDING)
    plan = make_plan(path, [ReplicaShape((1, -1), micro_batch_size=2, num_samples=4)])
    assert plan.ranks[0].units == ("tok_emb",)  # the frozen embedding alone
    ckpt, verify = tmp_path / "ckpt", tmp_path / "v"
    _assert_all_ok(
        run_ranks(plan, tmp_path / "a", "--steps", "3", "--verify-dir", str(verify),
                  "--checkpoint-dir", str(ckpt), timeout_s=TIMEOUT_S)
    )  # fmt: skip
    result = compare_first_step(plan, path, verify)
    assert result.missing == ()
    assert result.grad_rel < 1e-5 and result.param_rel < 1e-4
    _assert_all_ok(
        run_ranks(plan, tmp_path / "b", "--steps", "1", "--checkpoint-dir", str(ckpt),
                  "--resume", timeout_s=TIMEOUT_S)
    )  # fmt: skip
    saved = read_checkpoint(ckpt / "step-4", tmp_path)
    reference = reference_steps(plan, load_model_file(path), num_steps=4)
    for name, value in reference.params.items():  # MAX_GRAD_NORM clipped in both
        assert relative_difference(saved["model"][name], value) < 1e-5, name
    assert torch.equal(saved["model"]["tok_emb.weight"], reference.params["tok_emb.weight"])
    assert sorted(saved["optimizer"]) == ["blocks.0.fc.bias", "blocks.0.fc.weight",
                                          "blocks.1.fc.bias", "blocks.1.fc.weight",
                                          "head.bias", "head.weight"]  # fmt: skip


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=400)


# --------------------------------------------------------------------------- data parallel
def test_replicas_with_shares_seven_and_three_take_the_same_steps_across_an_epoch(
    tmp_path: Path,
) -> None:
    path = write_model(tmp_path, NUMBERED_DATASET)
    plan = make_plan(
        path,
        [
            ReplicaShape((-1,), micro_batch_size=4, num_samples=7),
            ReplicaShape((-1,), micro_batch_size=3, num_samples=3),
        ],
    )
    outcomes = run_ranks(
        plan, tmp_path, "--steps", "11", "--metrics-dir", str(tmp_path / "m"), timeout_s=TIMEOUT_S
    )
    _assert_all_ok(outcomes)
    steps = [[m["step"] for m in _metrics(tmp_path / "m", r)] for r in range(2)]
    assert steps == [list(range(11))] * 2  # 100 samples / 10 per step: epoch 2 starts at 10
    assert [m["samples"] for m in _metrics(tmp_path / "m", 0)] == [7] * 11


def test_a_killed_peer_ends_the_other_rank_with_a_one_line_error(tmp_path: Path) -> None:
    path = write_model(tmp_path, NUMBERED_DATASET)
    plan = make_plan(
        path,
        [ReplicaShape((-1,), 4, 7), ReplicaShape((-1,), 3, 3)],
        timeout_s=20.0,
    )
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.to_json())
    args = ("--steps", "100000", "--metrics-dir", str(tmp_path / "m"))
    port = ("--master-port", str(free_port()))
    procs = []
    for local_rank in range(2):  # the torchrun way: --node plus LOCAL_RANK
        command = rank_command(plan_path, 0, *args, *port)
        command[command.index("--rank") : command.index("--rank") + 2] = ["--node", "n0"]
        env = {**os.environ, "LOCAL_RANK": str(local_rank), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(command, stderr=subprocess.PIPE, env=env))
    try:
        deadline = time.monotonic() + 60
        metrics = tmp_path / "m" / "rank-1.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline, "rank 1 never finished a step"
            assert procs[1].poll() is None, procs[1].stderr.read().decode()
            time.sleep(0.1)
        procs[0].kill()
        _, stderr = procs[1].communicate(timeout=45)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    lines = stderr.decode().strip().splitlines()
    assert procs[1].returncode == 1
    assert len(lines) == 2, lines  # "waiting for 1 peer ..." while joining, then the error
    assert lines[0].startswith("hplan: rank 1 waiting for 1 peer at 127.0.0.1:")
    assert "PeerFailureError" in lines[1] and "rank 1" in lines[1]
    assert "Traceback" not in stderr.decode()


# --------------------------------------------------------------------------- ranks
def test_the_rank_comes_from_node_and_local_rank_never_from_launch_order(
    late_inputs: tuple[Path, object],
) -> None:
    _, plan = late_inputs
    assert resolve_rank(plan, rank=None, node="n0", local_rank="2") == 2
    assert resolve_rank(plan, rank=1, node=None, local_rank=None) == 1
    with pytest.raises(ConfigError, match="set LOCAL_RANK"):
        resolve_rank(plan, rank=None, node="n0", local_rank=None)
    with pytest.raises(ConfigError, match="'n9' runs no rank"):
        resolve_rank(plan, rank=None, node="n9", local_rank="0")
    with pytest.raises(ConfigError, match="LOCAL_RANK=5"):
        resolve_rank(plan, rank=None, node="n0", local_rank="5")
    with pytest.raises(ConfigError, match="--rank 3 is outside"):
        resolve_rank(plan, rank=3, node=None, local_rank=None)


def test_the_entry_point_turns_errors_into_one_line_and_an_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["run", str(tmp_path / "missing.json"), "--rank", "0"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "PlanFileError: cannot read plan" in err


def test_a_changed_model_file_warns_once_on_local_rank_zero_only(
    late_inputs: tuple[Path, object], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, plan = late_inputs
    edited = tmp_path / "edited.py"
    edited.write_text(path.read_text() + "\n# an edit that leaves the graph alone\n")
    build_rank(plan, 1, edited, RunOptions(steps=1))  # local rank 1: quiet
    assert "warning" not in capsys.readouterr().err
    build_rank(plan, 0, edited, RunOptions(steps=1))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hplan: warning: ")
    assert "differs from the model file the plan was made for" in err[0]
    build_rank(plan, 0, path, RunOptions(steps=1))  # the same file: no warning
    assert capsys.readouterr().err == ""


def test_an_unexpected_exception_in_a_rank_is_one_line_naming_where_it_happened(
    late_inputs: tuple[Path, object], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, plan = late_inputs
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.to_json(), encoding="utf-8")

    def broken(args: object, plan: object, rank: int) -> None:
        {}["missing"]

    args = argparse.Namespace(plan=plan_path, node=None, rank=1)
    assert run_one_rank(args, broken) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(
        "hplan run (rank 1): internal error: KeyError: 'missing' at test_worker.py:"
    )
    assert "Traceback" not in err


def test_library_messages_are_quoted_without_source_locations_advice_or_cut_words() -> None:
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:8065. This is typically caused by a remote worker crashing. Check the "
        "logs of the remote worker before reporting an error. GLHF!"
    )
    assert error_reason(gloo) == "Connection closed by peer [127.0.0.1]:8065."
    long = ValueError("word " * 100)
    reason = one_line(long)
    assert reason.endswith("word...") and len(reason) <= len("ValueError: ") + 203
