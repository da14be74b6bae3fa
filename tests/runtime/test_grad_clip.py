"""MAX_GRAD_NORM: the model file's value is checked at load; ranks clip the whole model's
gradient (each parameter counted once, tied ones included) as one process's
``clip_grad_norm_`` does; a norm that is never reached changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.contract.errors import ModelFileError
from hplan.runtime.contract.holders import parameter_holders
from hplan.runtime.contract.metrics_file import read_rank_metrics, summarize_metrics
from hplan.runtime.executor.grad_sync import build_grad_clip
from hplan.runtime.rehearsal.reference_check import reference_steps
from tests.fixtures.plans import (
    GPT_MODEL,
    WEIGHT_USED_TWICE,
    ReplicaShape,
    compare_first_step,
    load_dumps,
    make_plan,
    run_ranks,
    write_model,
)

TIMEOUT_S = 240.0

# The GPT example (tok_emb tied to lm_head) with MAX_GRAD_NORM; its first-step gradient
# norm on the plan below is 2.9, so 0.5 clips it to about a sixth.
GPT_CLIPPED = f"""
    import importlib.util

    _spec = importlib.util.spec_from_file_location("hplan_test_gpt_example", {str(GPT_MODEL)!r})
    _gpt = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_gpt)
    build_model, sample_batch, loss_fn = _gpt.build_model, _gpt.sample_batch, _gpt.loss_fn
    make_optimizer, dataset = _gpt.make_optimizer, _gpt.dataset

    MAX_GRAD_NORM = 0.5
"""


def _assert_all_ok(outcomes: list) -> None:
    assert all(o.returncode == 0 for o in outcomes), [
        (o.rank, o.returncode, o.stderr[-1500:]) for o in outcomes
    ]


# --------------------------------------------------------------------------- loading
@pytest.mark.parametrize(
    "value", ["0", "-1.0", "'1.0'", "True", "float('nan')", "float('inf')", "[1.0]", "10**400"]
)
def test_a_bad_max_grad_norm_is_refused_at_load_in_one_line(tmp_path: Path, value: str) -> None:
    path = write_model(tmp_path, WEIGHT_USED_TWICE + f"\n    MAX_GRAD_NORM = {value}\n")
    with pytest.raises(ModelFileError) as info:
        load_model_file(path)
    message = str(info.value)
    assert "\n" not in message
    assert f"MAX_GRAD_NORM in {str(path)!r} is {eval(value)!r}" in message
    assert "finite number > 0" in message


def test_max_grad_norm_is_optional_and_may_be_an_int(tmp_path: Path) -> None:
    assert load_model_file(write_model(tmp_path, WEIGHT_USED_TWICE)).max_grad_norm is None
    path = write_model(tmp_path, WEIGHT_USED_TWICE + "\n    MAX_GRAD_NORM = 2\n", "two.py")
    assert load_model_file(path).max_grad_norm == 2.0


# --------------------------------------------------------------------------- counting
def test_every_parameter_counts_toward_the_norm_on_exactly_one_rank() -> None:
    # three ranks: a two-stage replica and a one-stage one; tok_emb is held by all three
    plan = make_plan(GPT_MODEL, [ReplicaShape((3, -1), 2, 4), ReplicaShape((-1,), 4, 4)])
    held = parameter_holders(plan)
    assert held["tok_emb.weight"] == (0, 1, 2)
    counted: dict[str, list[int]] = {}
    for rank in range(plan.world_size):
        named = [(n, nn.Parameter(torch.zeros(1))) for n, ranks in held.items() if rank in ranks]
        clip = build_grad_clip(plan, rank, named, 1.0, torch.device("cpu"))
        assert clip is not None and len(clip.params) == len(named)
        ids = {id(p) for p in clip.counted}
        for name, param in named:
            if id(param) in ids:
                counted.setdefault(name, []).append(rank)
    assert counted == {name: [ranks[0]] for name, ranks in held.items()}
    assert build_grad_clip(plan, 0, [], None, torch.device("cpu")) is None


# --------------------------------------------------------------------------- ranks
@pytest.mark.slow
def test_pipeline_and_data_parallel_ranks_clip_like_one_process(tmp_path: Path) -> None:
    path = write_model(tmp_path, GPT_CLIPPED)
    plan = make_plan(path, [ReplicaShape((3, -1), 2, 4), ReplicaShape((-1,), 4, 4)])
    reference = reference_steps(plan, load_model_file(path))
    (norm_before,) = reference.grad_norms
    assert norm_before > 4 * 0.5  # the clip bites
    verify, metrics = tmp_path / "verify", tmp_path / "metrics"
    outcomes = run_ranks(
        plan,
        tmp_path / "run",
        "--steps", "1", "--verify-dir", str(verify), "--metrics-dir", str(metrics),
        timeout_s=TIMEOUT_S,
    )  # fmt: skip
    _assert_all_ok(outcomes)
    step = compare_first_step(plan, path, verify)
    assert not step.missing
    # Updated parameters: AdamW normalises each element's gradient, so a small gradient's
    # round-off moves its update (measured 1.4e-6 to 1.4e-4 relative, the latter once in a
    # full suite run); the gradients are what the clip changes, and they agree to 5e-7.
    assert step.grad_rel < 1e-5 and step.param_rel < 1e-3, step
    assert step.noise_abs <= 3e-3 * 1.01  # AdamW lr: round-off gradients step by up to lr
    # the dumped (clipped) gradients, each parameter once, have the norm clipped to
    grads = load_dumps(verify, "grads", plan.world_size)
    once = {n: g for dump in reversed(grads) for n, g in dump["tensors"].items()}
    clipped = torch.linalg.vector_norm(torch.stack([g.norm() for g in once.values()]))
    assert float(clipped) == pytest.approx(0.5, rel=1e-5)
    # every rank records the norm before clipping, the one clip_grad_norm_ returned
    for rank in range(plan.world_size):
        (record,) = read_rank_metrics(metrics / f"rank-{rank}.jsonl")
        assert record.grad_norm == pytest.approx(norm_before, rel=1e-5)
    assert summarize_metrics(metrics).steps[0].grad_norm == pytest.approx(norm_before, rel=1e-5)


@pytest.mark.slow
def test_a_norm_never_reached_changes_no_gradient(tmp_path: Path) -> None:
    # w is tied between the two stages of replica 0 and held by replica 1 too; SGD, so a
    # clipped gradient would show in the updated parameters as well
    path = write_model(tmp_path, WEIGHT_USED_TWICE + "\n    MAX_GRAD_NORM = 1e6\n")
    plan = make_plan(path, [ReplicaShape((1, 1), 2, 4), ReplicaShape((-1,), 2, 2)])
    unclipped = write_model(tmp_path, WEIGHT_USED_TWICE, "unclipped.py")
    outcomes = run_ranks(
        plan,
        tmp_path / "run",
        "--steps", "1", "--verify-dir", str(tmp_path / "v"), "--metrics-dir", str(tmp_path / "m"),
        timeout_s=TIMEOUT_S,
    )  # fmt: skip
    _assert_all_ok(outcomes)
    step = compare_first_step(plan, unclipped, tmp_path / "v")
    assert not step.missing
    assert step.grad_rel < 1e-6 and step.param_rel < 1e-6, step
    (norm_before,) = reference_steps(plan, load_model_file(path)).grad_norms
    assert 0 < norm_before < 1e6
    for rank in range(plan.world_size):
        (record,) = read_rank_metrics(tmp_path / "m" / f"rank-{rank}.jsonl")
        assert record.grad_norm == pytest.approx(norm_before, rel=1e-5)


@pytest.mark.slow
def test_under_fp16_loss_scaling_the_unscaled_norm_is_clipped_and_an_overflow_skips(
    tmp_path: Path,
) -> None:
    from dataclasses import replace

    from hplan.runtime.contract.plan import Precision
    from tests.runtime.test_precision import OVERFLOW_MODEL

    path = write_model(tmp_path, OVERFLOW_MODEL + "\n    MAX_GRAD_NORM = 0.1\n")
    plan = make_plan(path, [ReplicaShape((2, -1), 2, 4), ReplicaShape((-1,), 2, 4)])
    plan = replace(plan, ranks=tuple(replace(r, precision=Precision.FP16) for r in plan.ranks))
    assert plan.loss_scaling
    outcomes = run_ranks(
        plan,
        tmp_path / "run",
        "--steps", "2", "--metrics-dir", str(tmp_path / "m"),
        env={"HPLAN_TEST_OVERFLOW_RANK": "1"},
        timeout_s=TIMEOUT_S,
    )  # fmt: skip
    _assert_all_ok(outcomes)
    assert "step 0 skipped" in outcomes[0].stderr
    for rank in range(plan.world_size):
        first, second = read_rank_metrics(tmp_path / "m" / f"rank-{rank}.jsonl")
        assert first.grad_norm == float("inf")  # the overflow: nothing clipped, step skipped
        # the norm of the unscaled gradient (scaled, it would be 32768 times larger)
        assert second.grad_norm is not None and 0.1 < second.grad_norm < 1e3


@pytest.mark.slow
def test_a_nonfinite_norm_clips_nothing_is_reported_and_training_goes_on(tmp_path: Path) -> None:
    diverging = WEIGHT_USED_TWICE + (
        "\n    MAX_GRAD_NORM = 1.0\n\n\n"
        "    def loss_fn(out, target):\n"
        "        return torch.nn.functional.mse_loss(out, target) * float('inf')\n"
    )
    path = write_model(tmp_path, diverging)
    plan = make_plan(path, [ReplicaShape((1, 1), 2, 4)])
    outcomes = run_ranks(
        plan, tmp_path / "run", "--steps", "2", "--metrics-dir", str(tmp_path / "m"),
        timeout_s=TIMEOUT_S,
    )  # fmt: skip
    _assert_all_ok(outcomes)
    assert "step 0: the global gradient norm is nan, so MAX_GRAD_NORM clipped nothing" in (
        outcomes[0].stderr
    )
    for rank in range(plan.world_size):
        records = read_rank_metrics(tmp_path / "m" / f"rank-{rank}.jsonl")
        assert len(records) == 2 and all(r.grad_norm != r.grad_norm for r in records)  # nan
