"""Islands that train on their own: ``local_sgd`` and ``async`` groups (``outer_sync.py``).

Every job runs its ranks as ``python -m hplan.runtime run`` processes (``RankJob``) on two
nodes of one machine, an island each, and is compared with a single-process pure-torch
reference: DiLoCo with sample weights, written out below (and with a synchronous run).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from hplan.runtime.capture.model_file import ModelFile, load_model_file
from hplan.runtime.contract.errors import ConfigError, ModelFileError
from hplan.runtime.contract.holders import outer_fragments, parameter_holders, parameter_order
from hplan.runtime.contract.metrics_file import read_rank_metrics
from hplan.runtime.contract.plan import Plan, PseudoGradientDtype, SyncMode
from hplan.runtime.executor.grad_sync import build_grad_clip
from hplan.runtime.executor.worker import RunOptions
from hplan.runtime.rehearsal.reference_check import relative_difference
from tests.fixtures.plans import (
    TIED_LM,
    RankJob,
    RankOutcome,
    ReplicaShape,
    make_plan,
    run_ranks,
    with_islands,
    write_model,
)
from tests.fixtures.processes import join_gloo
from tests.fixtures.processes import run_ranks as run_processes
from tests.fixtures.sample_plans import mixed_plan

TIMEOUT_S = 120.0

MODEL = (
    """
    '''A small language model whose head is tied to its embedding; each block has a damping
    factor that gets no gradient.'''
    import os

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    VOCAB, WIDTH, SEQ = 16, 8, 4
    _CALLS = [0]

"""
    + TIED_LM
    + """


    def loss_fn(logits, targets):
        _CALLS[0] += 1
        stall = os.environ.get("HPLAN_TEST_STALL_RANK")
        if stall and dist.get_rank() == int(stall) and _CALLS[0] >= 2:
            import time

            time.sleep(300)  # this island stops answering
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


    def make_optimizer(params):
        return {inner}
"""
)
SGD_MOMENTUM = "torch.optim.SGD(params, lr=0.2, momentum=0.5)"
PLAIN_SGD = "torch.optim.SGD(params, lr=0.2)"


def _model(directory: Path, inner: str = SGD_MOMENTUM, **constants: float) -> Path:
    extra = "".join(f"\n    {name} = {value!r}\n" for name, value in constants.items())
    directory.mkdir(parents=True, exist_ok=True)
    return write_model(directory, MODEL.replace("{inner}", inner) + extra)


def _pipeline_and_single(path: Path, **sync: object) -> Plan:
    """Island box-a: a 2-stage pipeline of 6 samples (ranks 0, 1); box-b: one stage of 4
    samples, split otherwise (rank 2). With ``sync``: its mode and schedule."""
    plan = make_plan(path, [ReplicaShape((2, -1), 3, 6), ReplicaShape((-1,), 2, 4)])
    return with_islands(plan, [1, 1], **sync) if sync else plan  # type: ignore[arg-type]


def _two_single(path: Path, timeout_s: float = 60.0, **sync: object) -> Plan:
    """One stage per island: box-a 6 samples (rank 0), box-b 2 samples (rank 1)."""
    plan = make_plan(path, [ReplicaShape((-1,), 3, 6), ReplicaShape((-1,), 2, 2)],
                     timeout_s=timeout_s)  # fmt: skip
    return with_islands(plan, [1, 1], **sync)  # type: ignore[arg-type]


def _every_step(plan: Plan, ranks: tuple[int, ...]) -> Plan:
    """``plan`` with the cross-island holder set ``ranks`` all-reducing every step."""
    sync = plan.training.sync
    assert sync is not None and ranks in [g.ranks for g in sync.groups]
    groups = tuple(
        replace(g, mode=SyncMode.ALL_REDUCE, local_steps=1) if g.ranks == ranks else g
        for g in sync.groups
    )
    changed = replace(plan, training=replace(plan.training, sync=replace(sync, groups=groups)))
    changed.verify()
    return changed


def _ok(outcomes: list[RankOutcome]) -> None:
    for outcome in outcomes:
        assert outcome.returncode == 0, f"rank {outcome.rank}: {outcome.stderr[-2000:]}"


def _train(plan: Plan, workdir: Path, steps: int, *args: str) -> Path:
    """Run ``steps`` steps with a checkpoint folder; return it."""
    ckpt = workdir / "ckpt"
    _ok(
        run_ranks(plan, workdir / "run", "--steps", str(steps), "--checkpoint-dir", str(ckpt),
                  "--metrics-dir", str(workdir / "m"), *args, timeout_s=TIMEOUT_S)
    )  # fmt: skip
    return ckpt


def _read(step_dir: Path) -> dict:
    """A whole checkpoint in this one process (nested: model, outer, island ...)."""
    path = step_dir.parent.parent / f"{step_dir.parent.name}-{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, path)
    return torch.load(path, weights_only=False)


# --------------------------------------------------------------------------- the reference
def _diloco(plan: Plan, model_file: ModelFile, steps: int) -> dict[str, torch.Tensor]:
    """Global parameters after ``steps`` steps of DiLoCo with sample weights, in one process
    and by hand: each island (one replica) an inner optimizer over its own copy (clipped to
    its own gradient norm with ``MAX_GRAD_NORM``); at each
    sync point G ← outer(G, Σ n_i / N (G - L_i)), every island ← G; ``async``: the average
    of a point applied at the next one, each island keeping its change since on top
    (``outer_sync.py``, 4.); the run's last step closes."""
    from hplan.runtime.executor.data import BatchSource

    assert plan.training.sync is not None
    group = plan.training.sync.groups[0]
    every, mode, total = group.local_steps, group.mode, plan.global_batch_size
    shares = [(plan.sample_offset(r), plan.replica_ranks(r)[0].num_samples)
              for r in range(plan.num_replicas)]  # fmt: skip
    torch.manual_seed(plan.training.seed)
    base = model_file.build_model()
    names = [n for n, _ in base.named_parameters()]
    islands = [copy.deepcopy(base) for _ in shares]
    inner = [model_file.optimizer(list(m.parameters())) for m in islands]
    glob = [p.detach().clone().float() for p in base.parameters()]
    momentum = model_file.outer_momentum
    outer = torch.optim.SGD(glob, lr=model_file.outer_lr, momentum=momentum,
                            nesterov=momentum > 0)  # fmt: skip
    source = BatchSource(model_file, lambda raw: {"idx": raw}, plan.training.seed, total)

    def local(i: int) -> list[torch.Tensor]:
        return [p.detach().clone() for p in islands[i].parameters()]

    def average(deltas: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        return [sum(n / total * d[k] for (_, n), d in zip(shares, deltas, strict=True))
                for k in range(len(glob))]  # type: ignore[misc]  # fmt: skip

    def outer_step(avg: list[torch.Tensor]) -> None:
        for g, a in zip(glob, avg, strict=True):
            g.grad = a.clone()
        outer.step()
        outer.zero_grad(set_to_none=True)

    def put(i: int, values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, v in zip(islands[i].parameters(), values, strict=True):
                p.copy_(v)

    starts = [local(i) for i in range(len(shares))]
    pending: list[torch.Tensor] | None = None
    for step in range(steps):
        x, y = source.global_batch(step)
        for i, (offset, n) in enumerate(shares):
            logits = islands[i](x[offset : offset + n])
            model_file.loss_fn(logits, y[offset : offset + n]).backward()
            if model_file.max_grad_norm is not None:  # the island's own norm
                torch.nn.utils.clip_grad_norm_(islands[i].parameters(), model_file.max_grad_norm)
            inner[i].step()
            inner[i].zero_grad(set_to_none=True)
        point, last = (step + 1) % every == 0, step == steps - 1
        if mode is SyncMode.LOCAL_SGD and (point or last):
            outer_step(average([[g - v for g, v in zip(glob, local(i), strict=True)]
                                for i in range(len(shares))]))  # fmt: skip
            for i in range(len(shares)):
                put(i, glob)
            continue
        if point:
            deltas = [[s - v for s, v in zip(starts[i], local(i), strict=True)]
                      for i in range(len(shares))]  # fmt: skip
            if pending is not None:
                outer_step(pending)
                for i in range(len(shares)):
                    put(i, [g - d for g, d in zip(glob, deltas[i], strict=True)])
            pending = average(deltas)
            starts = [local(i) for i in range(len(shares))]
        if last:
            if pending is not None:
                outer_step(pending)
            if not point:
                outer_step(average([[s - v for s, v in zip(starts[i], local(i), strict=True)]
                                    for i in range(len(shares))]))  # fmt: skip
    return dict(zip(names, glob, strict=True))


def _assert_close(actual: dict, expected: dict, rtol: float, atol: float = 1e-7) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name].float(), value.float(), rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip


# --------------------------------------------------------------------------- equalities
PLAIN_STEPS = 4


@pytest.fixture(scope="module")
def plain_synchronous(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A model of plain SGD with plain averaging (outer lr 1, no momentum), and the
    checkpoint after ``PLAIN_STEPS`` steps of its synchronous plan (``_pipeline_and_single``),
    run once for the module."""
    directory = tmp_path_factory.mktemp("plain")
    path = _model(directory, PLAIN_SGD, OUTER_LR=1.0, OUTER_MOMENTUM=0.0)
    synchronous = _pipeline_and_single(path)
    ckpt = _train(synchronous, directory / "sync", PLAIN_STEPS)
    return path, _read(ckpt / f"step-{PLAIN_STEPS}")


@pytest.mark.xdist_group("local-sgd-plain")  # one worker builds `plain_synchronous`
@pytest.mark.parametrize("tied_every_step", [False, True])
def test_local_sgd_every_step_with_plain_averaging_equals_the_synchronous_plan(
    tmp_path: Path, plain_synchronous: tuple[Path, dict], tied_every_step: bool
) -> None:
    # tied_every_step: the tied embedding (ranks 0, 1, 2) all-reduces across islands every
    # step, each island's contribution scaled by its share of the global batch
    path, want = plain_synchronous
    local = _pipeline_and_single(path, mode=SyncMode.LOCAL_SGD, local_steps=1)
    if tied_every_step:
        local = _every_step(local, (0, 1, 2))
    got = _read(_train(local, tmp_path / "local", PLAIN_STEPS) / f"step-{PLAIN_STEPS}")
    _assert_close(got["model"], want["model"], rtol=1e-5)
    islands = got["island"]
    assert sorted(islands) == ["box-a", "box-b"]
    _assert_close(islands["box-a"]["model"], islands["box-b"]["model"], rtol=1e-5)


@pytest.mark.parametrize(
    ("mode", "clip"),
    [(SyncMode.LOCAL_SGD, False), (SyncMode.ASYNC, False), (SyncMode.LOCAL_SGD, True)],
)
def test_islands_split_differently_equal_one_process_of_diloco_with_sample_weights(
    tmp_path: Path, mode: SyncMode, clip: bool
) -> None:
    # H = 3 over 5 steps: one sync point (async: two, H = 2) and a closing sync; clipped:
    # each island to its own norm (the tied embedding counted once in the pipeline)
    path = _model(tmp_path, MAX_GRAD_NORM=0.5) if clip else _model(tmp_path)
    every = 3 if mode is SyncMode.LOCAL_SGD else 2
    plan = _pipeline_and_single(path, mode=mode, local_steps=every)
    steps = 5
    ckpt = _train(plan, tmp_path, steps)
    got = _read(ckpt / f"step-{steps}")
    want = _diloco(plan, load_model_file(path), steps)
    _assert_close(got["model"], want, rtol=1e-4, atol=1e-6)
    synced = [r.outer_sync_time_s > 0 for r in read_rank_metrics(tmp_path / "m" / "rank-2.jsonl")]
    points = [(s + 1) % every == 0 or s == steps - 1 for s in range(steps)]
    assert synced == points
    if clip:  # each island clipped, by a norm of its own
        norms = [read_rank_metrics(tmp_path / "m" / f"rank-{r}.jsonl")[0].grad_norm for r in (0, 2)]
        assert all(n is not None and n > 0.5 for n in norms) and norms[0] != norms[1]
    # model.<name> is after the closing sync; what a resume needs is the state before it
    before = got["island"]
    assert any(not torch.equal(before["box-a"]["model"][n], before["box-b"]["model"][n])
               for n in want)  # fmt: skip


def test_fragments_sync_at_their_staggered_steps(tmp_path: Path) -> None:
    path = _model(tmp_path)
    # H = 4, F = 2: fragment 0 syncs after steps 3, 7 ..., fragment 1 after steps 1, 5 ...
    plan = _two_single(path, mode=SyncMode.LOCAL_SGD, local_steps=4, num_fragments=2)
    ckpt = _train(plan, tmp_path, 4, "--checkpoint-every-steps", "2")
    group = plan.training.sync.groups[0]  # type: ignore[union-attr]
    held = parameter_holders(plan)
    names = [n for n in parameter_order(plan) if held[n] == group.ranks]
    after_1, after_3 = _read(ckpt / "step-2"), _read(ckpt / "step-4")
    sizes = {n: after_1["model"][n].numel() * 4 for n in names}
    first, second = outer_fragments(group, names, sizes)

    def agree(state: dict, fragment: tuple[str, ...]) -> list[bool]:
        islands = state["island"]
        return [torch.equal(islands["box-a"]["model"][n], islands["box-b"]["model"][n])
                for n in fragment]  # fmt: skip

    assert all(agree(after_1, second)) and not all(agree(after_1, first))
    assert all(agree(after_3, first)) and not all(agree(after_3, second))
    waited = [r.outer_sync_time_s > 0 for r in read_rank_metrics(tmp_path / "m" / "rank-0.jsonl")]
    assert waited == [False, True, False, True]


def test_a_bfloat16_wire_lands_within_its_round_off_of_float32(tmp_path: Path) -> None:
    path = _model(tmp_path)
    results = {}
    # the quantized formats are checked exactly against a reference (test_outer_exchange.py)
    for dtype in (PseudoGradientDtype.FLOAT32, PseudoGradientDtype.BFLOAT16):
        plan = _two_single(path, mode=SyncMode.LOCAL_SGD, local_steps=2, wire_dtype=dtype)
        results[dtype] = _read(_train(plan, tmp_path / dtype.value, 4) / "step-4")["model"]
    torch.manual_seed(0)
    initial = dict(load_model_file(path).build_model().named_parameters())
    wide, narrow = results[PseudoGradientDtype.FLOAT32], results[PseudoGradientDtype.BFLOAT16]
    moved = [n for n in wide if not torch.equal(wide[n], initial[n].detach())]
    assert moved
    for name in moved:
        start = initial[name].detach()
        assert relative_difference(narrow[name] - start, wide[name] - start) < 2e-2, name
    assert any(not torch.equal(narrow[n], wide[n]) for n in moved)  # it did travel in bf16


# --------------------------------------------------------------------------- emulated floor
LATE_S = 0.4
"""Rank 1 reaches the first sync point this long after rank 0."""
FLOOR_S = 0.3
"""The emulated outer all-reduce time (``LinkDelay.all_reduce_floor_s``)."""


def _floored_points(rank: int, port: int, out_dir: str, mode: str) -> None:
    from hplan.runtime.contract.plan import OuterSyncSpec
    from hplan.runtime.executor.outer.outer_sync import OuterFragment, OuterSync, _outer_optimizer

    try:
        join_gloo(rank, port)
        param = torch.nn.Parameter(torch.full((3,), float(rank + 1)))
        glob = [torch.zeros(3)]
        spec = OuterSyncSpec(ranks=(0, 1), mode=SyncMode(mode), local_steps=1)
        outer_file = SimpleNamespace(outer_lr=1.0, outer_momentum=0.0)
        frag = OuterFragment(
            spec, 0, dist.group.WORLD, ("w",), [param], 0.5, ("box-a", "box-b"),
            ("box-a", "box-b")[rank], FLOOR_S, glob, _outer_optimizer(glob, outer_file),  # type: ignore[arg-type]
            start=[g.clone() for g in glob] if mode == "async" else [],
        )  # fmt: skip
        sync = OuterSync([frag], keep_resume_state=False)
        times = []
        for step in range(3):
            dist.barrier()
            if rank == 1 and step == 0:
                time.sleep(LATE_S)
            arrived_s = time.monotonic()
            sync.after_step(step, last=step == 2)
            times.append({"arrived_s": arrived_s, "left_s": time.monotonic()})
        result = {"times": times, "param": param.tolist()}
        (Path(out_dir) / f"rank-{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()
    except Exception:
        (Path(out_dir) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


@pytest.mark.parametrize("mode", ["local_sgd", "async"])
def test_an_emulated_outer_all_reduce_lasts_its_floor_from_the_last_launch(
    tmp_path: Path, mode: str
) -> None:
    assert run_processes(_floored_points, 2, tmp_path, mode) == [0, 0]
    early, late = (json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2))
    assert early["param"] == late["param"]  # every island ends on the same parameters
    first_late = late["times"][0]["arrived_s"]
    if mode == "local_sgd":  # blocking: both leave the first point a floor after rank 1 came
        assert early["param"] == [1.5] * 3  # G = 0 - (0.5 (0 - 1) + 0.5 (0 - 2))
        for times in (early, late):
            assert times["times"][0]["left_s"] >= first_late + FLOOR_S
        return
    # async: the first point only launches; the second, reached by both at about the
    # time rank 1 launched, waits for it until a floor after that launch
    assert early["times"][0]["left_s"] < first_late
    for times in (early, late):
        assert times["times"][1]["left_s"] >= first_late + FLOOR_S


# --------------------------------------------------------------------------- failures
def test_an_island_that_stops_answering_ends_the_job_in_one_line_naming_it(
    tmp_path: Path,
) -> None:
    path = _model(tmp_path)
    # the outer sync meets the stalled island at the plan's process-group timeout; 10 s
    # also bounds every collective before it, so it must outlast how far apart a loaded
    # machine lets the two ranks build and take their first step
    plan = _two_single(path, timeout_s=10.0, mode=SyncMode.LOCAL_SGD, local_steps=1)
    env = {"HPLAN_TEST_STALL_RANK": "1"}  # box-b sleeps in its second step's loss
    started_s = time.monotonic()
    with RankJob(plan, tmp_path / "a", "--steps", "5", env=env) as job:
        job.procs[0].wait(timeout=TIMEOUT_S)
        ended_s = time.monotonic() - started_s
        outcome = job.wait(1.0)[0]
    assert outcome.returncode == 1, outcome.stderr
    assert ended_s < 60
    lines = [line for line in outcome.stderr.splitlines() if line.startswith("hplan run")]
    assert len(lines) == 1, outcome.stderr
    assert re.search(
        r"PeerFailureError: outer sync \(local_sgd\) of ranks \[0, 1\] across islands box-a, "
        r"box-b failed: .*; island box-b probably fell behind or failed; check its logs$",
        lines[0],
    ), lines[0]


# --------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def three_steps(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[SyncMode], tuple[Plan, Path]]:
    """``mode`` -> the plan ``_two_single(mode, H = 2)`` and its checkpoint folder after 3
    steps (each mode run once for the module; copy the folder before resuming in it)."""
    runs: dict[SyncMode, tuple[Plan, Path]] = {}

    def run(mode: SyncMode) -> tuple[Plan, Path]:
        if mode not in runs:
            directory = tmp_path_factory.mktemp(f"three-{mode.value}")
            plan = _two_single(_model(directory), mode=mode, local_steps=2)
            runs[mode] = (plan, _train(plan, directory, 3))
        return runs[mode]

    return run


@pytest.mark.parametrize("mode", [SyncMode.LOCAL_SGD, SyncMode.ASYNC])
def test_a_resume_continues_exactly_as_one_uninterrupted_run(
    tmp_path: Path, three_steps: Callable[[SyncMode], tuple[Plan, Path]], mode: SyncMode
) -> None:
    # H = 2 does not divide k = 3: the first part ends between two sync points
    plan, after_three = three_steps(mode)
    whole = _read(_train(plan, tmp_path / "whole", 5) / "step-5")
    pieces = tmp_path / "pieces"
    shutil.copytree(after_three, pieces / "ckpt")
    ckpt = _train(plan, pieces, 2, "--resume")
    resumed = _read(ckpt / "step-5")
    for key in ("model", "outer", "island"):
        flat_whole, flat_resumed = _flat(whole[key]), _flat(resumed[key])
        assert flat_whole.keys() == flat_resumed.keys()
        for name, value in flat_whole.items():
            assert torch.equal(flat_resumed[name], value), (key, name)


def _flat(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            out[f"{prefix}{key}"] = value
    return out


def test_a_plan_without_local_groups_resumes_from_the_global_parameters(
    tmp_path: Path, three_steps: Callable[[SyncMode], tuple[Plan, Path]]
) -> None:
    local, after_three = three_steps(SyncMode.LOCAL_SGD)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(after_three, ckpt)
    synchronous = replace(local, training=replace(local.training, sync=None))
    outcomes = run_ranks(synchronous, tmp_path / "b", "--steps", "1", "--checkpoint-dir",
                         str(ckpt), "--resume", timeout_s=TIMEOUT_S)  # fmt: skip
    _ok(outcomes)
    assert "outer-sync state (local_sgd/async" in outcomes[0].stderr
    assert "is dropped: this plan has no local_sgd or async group" in outcomes[0].stderr
    names = dcp.FileSystemReader(ckpt / "step-4").read_metadata().state_dict_metadata
    assert not any(k.startswith(("outer.", "island.")) for k in names)


def test_a_local_plan_resumes_a_checkpoint_of_another_local_plan(
    tmp_path: Path, three_steps: Callable[[SyncMode], tuple[Plan, Path]]
) -> None:
    # what an elastic run does at each restart: the outer state starts again from the
    # checkpoint's global parameters (local SGD keeps no start point to reset)
    local, after_three = three_steps(SyncMode.LOCAL_SGD)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(after_three, ckpt)
    other = _two_single(Path(local.model.path), mode=SyncMode.LOCAL_SGD, local_steps=3)
    assert other.digest() != local.digest()
    outcomes = run_ranks(other, tmp_path / "b", "--steps", "1", "--checkpoint-dir", str(ckpt),
                         "--resume", timeout_s=TIMEOUT_S)  # fmt: skip
    _ok(outcomes)
    assert "outer-sync state was written under another plan" in outcomes[0].stderr


# --------------------------------------------------------------------------- refusals
def test_verify_refuses_a_plan_whose_islands_train_on_their_own(tmp_path: Path) -> None:
    plan = _two_single(_model(tmp_path), mode=SyncMode.ASYNC, local_steps=2)
    with pytest.raises(ConfigError, match=r"--verify compares one synchronous step .* async H=2"):
        RunOptions(steps=1, verify_dir=tmp_path / "v").for_plan(plan)


def test_island_clipping_is_refused_beside_a_group_that_all_reduces_across_islands() -> None:
    plan = mixed_plan()
    sync = plan.training.sync
    assert sync is not None
    groups = (replace(sync.groups[0], mode=SyncMode.ALL_REDUCE, local_steps=1), *sync.groups[1:])
    mixed = replace(plan, training=replace(plan.training, sync=replace(sync, groups=groups)))
    with pytest.raises(ConfigError, match=r"ranks \[0, 1, 2, 4\] all-reduce across islands"):
        build_grad_clip(mixed, 0, [], 1.0, torch.device("cpu"))


@pytest.mark.parametrize(
    ("name", "value", "shown"),
    [("OUTER_LR", "0", "0"), ("OUTER_LR", "'1'", "'1'"), ("OUTER_LR", "float('inf')", "inf"),
     ("OUTER_MOMENTUM", "1.0", "1.0"), ("OUTER_MOMENTUM", "-0.1", "-0.1"),
     ("OUTER_MOMENTUM", "True", "True")],
)  # fmt: skip
def test_a_bad_outer_constant_is_refused_at_load_in_one_line(
    tmp_path: Path, name: str, value: str, shown: str
) -> None:
    path = write_model(tmp_path, MODEL.replace("{inner}", PLAIN_SGD) + f"\n    {name} = {value}\n")
    with pytest.raises(ModelFileError) as info:
        load_model_file(path)
    message = str(info.value)
    assert "\n" not in message and f"{name} in" in message and f"is {shown};" in message


def test_the_outer_constants_default_to_dilocos(tmp_path: Path) -> None:
    defaults = load_model_file(_model(tmp_path))
    assert (defaults.outer_lr, defaults.outer_momentum) == (0.7, 0.9)
    chosen = load_model_file(_model(tmp_path / "set", OUTER_LR=1, OUTER_MOMENTUM=0))
    assert (chosen.outer_lr, chosen.outer_momentum) == (1.0, 0.0)
