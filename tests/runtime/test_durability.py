"""Durable training on gloo: checkpoints resumed under other plans, kills during a save,
preemption, ranks that run another job, frozen ranks and diverging losses.

Every job runs its ranks as ``python -m hplan.runtime run`` processes (``RankJob``) under a
timeout.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from hplan.runtime.contract.metrics_file import read_rank_metrics
from hplan.runtime.contract.plan import CutSpec, Plan
from hplan.runtime.contract.progress_lines import parse_line
from hplan.runtime.executor.checkpoint import latest_checkpoint
from hplan.runtime.rehearsal.reference_check import relative_difference
from tests.fixtures.plans import (
    NUMBERED_DATASET,
    RankJob,
    RankOutcome,
    ReplicaShape,
    make_plan,
    read_checkpoint,
    run_ranks,
    write_model,
)

TIMEOUT_S = 90.0
FAULTS = Path(__file__).resolve().parents[1] / "fixtures" / "faults"

SCHEDULED = (
    NUMBERED_DATASET
    + """

    def make_scheduler(optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
"""
)
"""The numbered-samples model with an LR scheduler (halves the rate every step)."""


def _ok(outcomes: list[RankOutcome]) -> None:
    for outcome in outcomes:
        assert outcome.returncode == 0, f"rank {outcome.rank}: {outcome.stderr[-2000:]}"


def _errors(stderr: str) -> list[str]:
    """The lines of a rank's stderr but its notes: the rendezvous's "waiting for peers",
    rank 0's threads, progress and summary."""
    return [
        line
        for line in stderr.splitlines()
        if "waiting for" not in line and "torch thread" not in line and parse_line(line) is None
    ]


def _global_losses(metrics_dir: Path, world_size: int) -> dict[int, float]:
    """{step: the loss over the global batch} (replica losses weighted by their samples)."""
    total: dict[int, float] = {}
    samples: dict[int, int] = {}
    for rank in range(world_size):
        for record in read_rank_metrics(metrics_dir / f"rank-{rank}.jsonl"):
            if record.loss is not None:
                total[record.step] = total.get(record.step, 0.0) + record.loss * record.samples
                samples[record.step] = samples.get(record.step, 0) + record.samples
    return {step: total[step] / samples[step] for step in total}


def _wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _wait_for_steps(metrics: Path, steps: int) -> None:
    """Until rank 0 has written the metrics of ``steps`` steps."""
    rank0 = metrics / "rank-0.jsonl"
    _wait_until(lambda: rank0.exists() and rank0.read_text().count("\n") >= steps)


def _newest_step(directory: Path) -> int:
    latest = latest_checkpoint(directory)
    return -1 if latest is None else int(latest.name.removeprefix("step-"))


def _assert_same_state(actual: dict, expected: dict) -> None:
    """Parameters and optimizer state equal within the ``--verify`` tolerance."""
    assert actual["model"].keys() == expected["model"].keys()
    for name, value in expected["model"].items():
        assert relative_difference(actual["model"][name], value) < 1e-4, name
    for name, state in expected["optimizer"].items():
        for key, value in state.items():
            got = actual["optimizer"][name][key]
            assert relative_difference(got.double(), value.double()) < 1e-4, (name, key)


# --------------------------------------------------------------------------- resume anywhere
def test_steps_resumed_under_other_plans_equal_one_uninterrupted_run(tmp_path: Path) -> None:
    path = write_model(tmp_path, SCHEDULED)
    pipeline = make_plan(path, [ReplicaShape((1, 1), micro_batch_size=5, num_samples=10)])
    data_parallel = make_plan(path, [ReplicaShape((-1,), 4, 4), ReplicaShape((-1,), 3, 6)])
    four_ranks = make_plan(path, [ReplicaShape((1, 1), 3, 6), ReplicaShape((1, 1), 2, 4)])
    whole, pieces = tmp_path / "whole", tmp_path / "pieces"
    _ok(
        run_ranks(pipeline, tmp_path / "a", "--steps", "4", "--checkpoint-dir", str(whole),
                  "--metrics-dir", str(tmp_path / "m-whole"), timeout_s=TIMEOUT_S)
    )  # fmt: skip
    runs = [(pipeline, 2), (data_parallel, 1), (four_ranks, 1)]  # steps 0-1, 2, 3
    for i, (plan, steps) in enumerate(runs):
        _ok(
            run_ranks(plan, tmp_path / f"p{i}", "--steps", str(steps), "--checkpoint-dir",
                      str(pieces), "--resume", "--metrics-dir", str(tmp_path / f"m{i}"),
                      timeout_s=TIMEOUT_S)
        )  # fmt: skip
    assert (pieces / "latest").read_text().strip() == "step-4"
    names = FileSystemReader(pieces / "step-4").read_metadata().state_dict_metadata
    assert {n for n in names if n.startswith("model.")} == {
        "model.a.weight", "model.a.bias", "model.b.weight", "model.b.bias",
    }  # fmt: skip
    assert {n for n in names if n.startswith("rng.")} == {f"rng.{r}.cpu" for r in range(4)}
    _assert_same_state(
        read_checkpoint(pieces / "step-4", tmp_path), read_checkpoint(whole / "step-4", tmp_path)
    )
    whole_losses = _global_losses(tmp_path / "m-whole", 2)
    resumed = {
        **_global_losses(tmp_path / "m1", data_parallel.world_size),
        **_global_losses(tmp_path / "m2", four_ranks.world_size),
    }
    assert sorted(resumed) == [2, 3]  # each run went on at the step where the last stopped
    for step, loss in resumed.items():
        assert loss == pytest.approx(whole_losses[step], rel=1e-5)


@pytest.mark.serial  # a runtime race: both ranks must reach the check before rank 0 (the store) ends
def test_a_resume_without_the_flag_or_from_another_batch_is_refused(tmp_path: Path) -> None:
    path = write_model(tmp_path, NUMBERED_DATASET)
    plan = make_plan(path, [ReplicaShape((1, 1), micro_batch_size=5, num_samples=10)])
    ckpt = tmp_path / "ckpt"
    _ok(run_ranks(plan, tmp_path / "a", "--steps", "1", "--checkpoint-dir", str(ckpt)))
    again = run_ranks(plan, tmp_path / "b", "--steps", "1", "--checkpoint-dir", str(ckpt))
    for outcome in again:
        assert outcome.returncode == 2
        assert "holds a checkpoint (step-1); pass --resume" in _errors(outcome.stderr)[-1]
    other_batch = make_plan(path, [ReplicaShape((1, 1), micro_batch_size=4, num_samples=8)])
    refused = run_ranks(
        other_batch, tmp_path / "c", "--steps", "1", "--checkpoint-dir", str(ckpt), "--resume"
    )
    for outcome in refused:
        assert outcome.returncode == 2
        assert "written with global batch 10" in _errors(outcome.stderr)[-1]


# --------------------------------------------------------------------------- kills during a save
WIDE = """
    import torch
    from torch import nn


    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 512)
            self.b = nn.Linear(512, 512)
            self.c = nn.Linear(512, 1)

        def forward(self, x):
            return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


    def build_model():
        return Wide()


    def sample_batch(batch_size):
        x = torch.randn(batch_size, 8)
        return x, x[:, :1]


    def loss_fn(pred, target):
        return torch.nn.functional.mse_loss(pred, target)
"""
"""A model whose checkpoint (3 MB with its optimizer state) takes a while to write."""


@pytest.fixture(scope="module")
def wide_plan(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    path = write_model(tmp_path_factory.mktemp("wide"), WIDE)
    return make_plan(path, [ReplicaShape((2, 1), micro_batch_size=4, num_samples=8)])


def _assert_latest_loads(directory: Path, scratch: Path, expected_step: int | None) -> int:
    latest = latest_checkpoint(directory)
    assert latest is not None, sorted(p.name for p in directory.iterdir())
    state = read_checkpoint(latest, scratch)
    assert state["progress"]["step"] == int(latest.name.removeprefix("step-"))
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    if expected_step is not None:
        assert latest.name == f"step-{expected_step}"
    return int(state["progress"]["step"])


@pytest.mark.parametrize(
    ("point", "rank", "latest_step"),
    [("write", 1, 1), ("metadata", 0, 1), ("publish", 0, 2), ("cleanup", 0, 3)],
)
def test_a_rank_killed_inside_a_save_leaves_a_complete_latest_checkpoint(
    wide_plan: Plan, tmp_path: Path, point: str, rank: int, latest_step: int
) -> None:
    nth = 1 if point == "cleanup" else 2
    env = {"PYTHONPATH": f"{FAULTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "HPLAN_TEST_DIE_AT": f"{point}:{rank}:{nth}"}  # fmt: skip
    ckpt = tmp_path / "ckpt"
    started_s = time.monotonic()
    outcomes = run_ranks(
        wide_plan, tmp_path / "a", "--steps", "50", "--checkpoint-dir", str(ckpt),
        "--checkpoint-every-steps", "1", env=env, timeout_s=TIMEOUT_S,
    )  # fmt: skip
    assert time.monotonic() - started_s < 60
    assert outcomes[rank].returncode == 9
    survivor = outcomes[1 - rank]
    assert survivor.returncode == 1, survivor.stderr
    assert len(_errors(survivor.stderr)) == 1, survivor.stderr
    assert "PeerFailureError" in survivor.stderr and "Traceback" not in survivor.stderr
    # rank 0 also hosts the store: the survivor notices either the store or the missing
    # heartbeat first (the latter under load); both name the rank and its node
    named = (
        ("rank 1 on node n0 failed",)
        if rank == 1
        else ("(rank 0's node n0) stopped answering", "rank 0 on node n0 failed")
    )
    assert any(text in survivor.stderr for text in named), survivor.stderr
    _assert_latest_loads(ckpt, tmp_path, latest_step)


def test_random_kills_always_leave_a_loadable_latest_and_resume_continues(
    wide_plan: Plan, tmp_path: Path
) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    ckpt = tmp_path / "ckpt"
    steps_done = 0
    for trial in range(3):
        metrics = tmp_path / f"m{trial}"
        args = ("--steps", "100000", "--checkpoint-dir", str(ckpt), "--resume",
                "--checkpoint-every-steps", "1", "--metrics-dir", str(metrics))  # fmt: skip
        with RankJob(wide_plan, tmp_path / f"run{trial}", *args) as job:
            _wait_until(lambda done=steps_done: _newest_step(ckpt) > done)
            time.sleep(rng.uniform(0.0, 1.0))
            victim = rng.randrange(wide_plan.world_size)
            job.procs[victim].send_signal(signal.SIGKILL)
            outcomes = job.wait(30.0)
        assert all(o.returncode not in (0, None) for o in outcomes), f"seed {seed}"
        first = read_rank_metrics(metrics / "rank-0.jsonl")[0].step
        assert first == steps_done, f"seed {seed}: resumed at {first}, saved {steps_done}"
        steps_done = _assert_latest_loads(ckpt, tmp_path, None)
        assert steps_done > first, f"seed {seed}"


# --------------------------------------------------------------------------- preemption
def test_sigterm_to_one_rank_checkpoints_the_job_and_exits_143(tmp_path: Path) -> None:
    path = write_model(tmp_path, NUMBERED_DATASET)
    plan = make_plan(path, [ReplicaShape((1, 1), micro_batch_size=5, num_samples=10)])
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m"
    args = ("--steps", "100000", "--checkpoint-dir", str(ckpt), "--metrics-dir", str(metrics))
    with RankJob(plan, tmp_path / "a", *args) as job:
        _wait_for_steps(metrics, 3)
        job.procs[1].send_signal(signal.SIGTERM)
        sent_s = time.monotonic()
        outcomes = job.wait(TIMEOUT_S)
    assert time.monotonic() - sent_s < plan.training.process_group_timeout_s  # no rank hung
    steps = [len(read_rank_metrics(metrics / f"rank-{r}.jsonl")) for r in range(2)]
    assert steps[0] == steps[1] >= 3
    for outcome in outcomes:
        assert outcome.returncode == 143, outcome.stderr
        last = _errors(outcome.stderr)[-1]
        assert f"PreemptedError: preempted (SIGTERM) after {steps[0]} steps" in last
    assert _assert_latest_loads(ckpt, tmp_path, steps[0]) == steps[0]
    _ok(
        run_ranks(plan, tmp_path / "b", "--steps", "1", "--checkpoint-dir", str(ckpt),
                  "--resume", "--metrics-dir", str(tmp_path / "m2"))
    )  # fmt: skip
    assert read_rank_metrics(tmp_path / "m2" / "rank-1.jsonl")[0].step == steps[0]


# --------------------------------------------------------------------------- another job
def _edited_cut(plan: Plan, **changes: object) -> Plan:
    cut = plan.cuts[0]
    tensors = (replace(cut.tensors[0], **changes), *cut.tensors[1:])
    return replace(plan, cuts=(CutSpec(after_unit=cut.after_unit, tensors=tensors), *plan.cuts[1:]))


@pytest.fixture(scope="module")
def numbered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Plan]:
    path = write_model(tmp_path_factory.mktemp("numbered"), NUMBERED_DATASET)
    return path, make_plan(path, [ReplicaShape((1, 1), micro_batch_size=5, num_samples=10)])


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("a larger boundary tensor", "another plan.json (its cuts differ)"),
        ("another dtype", "another plan.json (its cuts differ)"),
        ("a frozen front", "another plan.json (its cuts differ)"),
        ("another micro-batch count", "another plan.json (its ranks differ)"),
        ("another model", "cannot run: PlanMismatchError: the model traced from"),
        ("another loss function", "another model file"),
    ],
)
def test_a_rank_that_runs_another_job_ends_every_rank_in_one_line_within_seconds(
    numbered: tuple[Path, Plan], tmp_path: Path, case: str, says: str
) -> None:
    path, plan = numbered
    stale: dict[int, Plan] = {}
    models: dict[int, Path] = {}
    if case == "a larger boundary tensor":
        stale[1] = _edited_cut(plan, shape=(1, 5))
    elif case == "another dtype":
        stale[1] = _edited_cut(plan, dtype="float64")
    elif case == "a frozen front":
        stale[1] = _edited_cut(plan, requires_grad=False)
    elif case == "another micro-batch count":
        stale[1] = make_plan(path, [ReplicaShape((1, 1), micro_batch_size=2, num_samples=10)])
    else:
        source = path.read_text()
        edited = (
            source.replace("nn.Linear(4, 1)", "nn.Linear(4, 1, bias=False)")
            if case == "another model"
            else source.replace("mse_loss(pred, target)", "l1_loss(pred, target)")
        )
        assert edited != source
        models[1] = write_model(tmp_path, edited, name="edited.py")
    started_s = time.monotonic()
    with RankJob(plan, tmp_path / "a", "--steps", "3", plans=stale, model_paths=models) as job:
        outcomes = job.wait(TIMEOUT_S)
    # the check ended them, not a collective's timeout (what a rank waiting for a peer that
    # runs another job would meet)
    assert time.monotonic() - started_s < plan.training.process_group_timeout_s
    for outcome in outcomes:
        assert outcome.returncode not in (0, None), outcome.stderr
        lines = _errors(outcome.stderr)
        assert len(lines) == 1, lines
        if models and outcome.rank == 1 and case == "another model":  # its own error
            assert lines[0].startswith("hplan run (rank 1): PlanMismatchError"), lines[0]
        else:
            assert "rank 1 (node n0)" in lines[0] and says in lines[0], lines[0]


# --------------------------------------------------------------------------- frozen and dead ranks
PACED = (
    NUMBERED_DATASET
    + """

    import time


    def loss_fn(pred, target):  # the ranks mostly wait, as a real job's do
        time.sleep(0.02)
        return torch.nn.functional.mse_loss(pred, target)
"""
)
"""The numbered-samples model with a loss that sleeps 20 ms: a job that trains until the
test stops one of its ranks leaves the cores to the ranks' heartbeat threads (ranks that
spin through steps of microseconds starve them on a loaded machine, and a live rank then
looks silent to the others)."""


def test_a_frozen_rank_ends_every_other_rank_within_the_heartbeat_timeout(
    tmp_path: Path,
) -> None:
    path = write_model(tmp_path, PACED)
    plan = make_plan(path, [ReplicaShape((-1,), 4, 4), ReplicaShape((-1,), 3, 3),
                            ReplicaShape((-1,), 3, 3)])  # fmt: skip
    metrics = tmp_path / "m"
    args = ("--steps", "100000", "--metrics-dir", str(metrics), "--heartbeat-timeout-s", "3")
    with RankJob(plan, tmp_path / "a", *args) as job:
        _wait_for_steps(metrics, 1)
        job.procs[1].send_signal(signal.SIGSTOP)
        stopped_s = time.monotonic()
        ended_s = []
        for proc in (job.procs[0], job.procs[2]):
            proc.wait(timeout=TIMEOUT_S)
            ended_s.append(time.monotonic() - stopped_s)
        job.procs[1].send_signal(signal.SIGKILL)
        outcomes = job.wait(10)
    # the watchdog (timeout 3 s) ended them, not the collective they wait in for rank 1
    # (it would time out at the plan's process-group timeout)
    assert max(ended_s) < plan.training.process_group_timeout_s
    for outcome in (outcomes[0], outcomes[2]):
        assert outcome.returncode == 1
        lines = _errors(outcome.stderr)
        assert len(lines) == 1, lines  # the watchdog's line, or a collective's that it explains
        assert re.search(r"rank 1 on node n0 (failed or )?stopped answering", lines[0]), lines


@pytest.mark.serial  # a runtime race: rank 0 hosts the store, and may end before rank 2 names rank 1
def test_a_killed_rank_ends_every_other_rank_within_seconds_naming_it(tmp_path: Path) -> None:
    path = write_model(tmp_path, PACED)
    plan = make_plan(path, [ReplicaShape((1, 1), 5, 5), ReplicaShape((-1,), 5, 5)])
    metrics = tmp_path / "m"
    with RankJob(plan, tmp_path / "a", "--steps", "100000", "--metrics-dir", str(metrics)) as job:
        _wait_for_steps(metrics, 1)
        job.procs[1].send_signal(signal.SIGKILL)
        killed_s = time.monotonic()
        outcomes = job.wait(TIMEOUT_S)
    # its closed sockets ended them, not a collective's timeout
    assert time.monotonic() - killed_s < plan.training.process_group_timeout_s
    for outcome in (outcomes[0], outcomes[2]):
        assert outcome.returncode == 1
        lines = _errors(outcome.stderr)
        assert len(lines) == 1 and "rank 1 on node n0 failed or stopped answering" in lines[0], (
            lines
        )


# --------------------------------------------------------------------------- diverging loss
DIVERGING = (
    NUMBERED_DATASET
    + """

    STOP_ON_NONFINITE_LOSS = os.environ.get("HPLAN_TEST_STOP") == "1"
    _CALLS = [0]


    def loss_fn(pred, target):  # not finite from the 5th micro-batch on
        _CALLS[0] += 1
        loss = torch.nn.functional.mse_loss(pred, target)
        return loss * float("nan") if _CALLS[0] >= 5 else loss
"""
)


@pytest.mark.parametrize("stop", [True, False])
def test_a_nonfinite_loss_is_reported_and_stops_the_job_when_the_model_file_says_so(
    tmp_path: Path, stop: bool
) -> None:
    path = write_model(tmp_path, DIVERGING)
    plan = make_plan(path, [ReplicaShape((1, 1), micro_batch_size=5, num_samples=10)])
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m"
    outcomes = run_ranks(
        plan, tmp_path / "a", "--steps", "6", "--metrics-dir", str(metrics),
        "--checkpoint-dir", str(ckpt), "--checkpoint-every-steps", "1",
        env={"HPLAN_TEST_STOP": "1" if stop else "0"}, timeout_s=TIMEOUT_S,
    )  # fmt: skip
    losses = [r.loss for r in read_rank_metrics(metrics / "rank-1.jsonl")]
    first_bad = next(i for i, loss in enumerate(losses) if loss is not None and loss != loss)
    assert all(loss is not None and loss == loss for loss in losses[:first_bad])
    report = f"hplan: rank 1: step {first_bad}: the loss of replica 0 is nan"
    assert report in outcomes[1].stderr
    if not stop:
        _ok(outcomes)
        assert len(losses) == 6
        return
    for outcome in outcomes:
        assert outcome.returncode == 1
        last = _errors(outcome.stderr)[-1]
        assert "DivergedError" in last and "the diverged state was not saved" in last, last
    assert len(losses) <= first_bad + 2  # the job agrees one step late at most
    assert _assert_latest_loads(ckpt, tmp_path, first_bad) == first_bad
