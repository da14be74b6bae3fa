"""Tensor-parallel stages on gloo: ``rehearse --verify`` of TP plans (a pipeline whose
stages have different TP degrees, data parallelism between TP groups, a tiny Hugging Face
Llama) against one process, a shard's doubled gradient named, checkpoints carried between
plans with and without TP, and what TP does not run with yet refused."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.metrics_file import read_rank_metrics
from hplan.runtime.contract.plan import (
    MemoryStrategy,
    Plan,
    Precision,
    TpRule,
    TpStyle,
    ZeroStage,
)
from hplan.runtime.executor.memory.tensor_parallel import (
    check_tensor_parallel,
    placements,
    style_of,
    tp_rank_groups,
)
from hplan.runtime.executor.worker import boundaries
from hplan.runtime.rehearsal.rehearse import RehearsalResult, rehearse
from tests.fixtures.plans import (
    GPT_MODEL,
    NUMBERED_DATASET,
    ReplicaShape,
    make_plan,
    read_checkpoint,
    run_ranks,
    write_model,
)
from tests.fixtures.tp_plans import (
    HF_LLAMA,
    with_shard_fault,
    with_tensor_parallel,
)

TIMEOUT_S = 120.0


def _rehearse(plan: Plan, steps: int = 1) -> tuple[RehearsalResult, str]:
    out = io.StringIO()
    result = rehearse(
        plan, steps=steps, verify=True, timeout_s=TIMEOUT_S, console=Console(file=out, width=400)
    )
    return result, out.getvalue()


# --------------------------------------------------------------------------- no processes
def test_patterns_match_one_path_component_per_star_and_styles_place_as_megatron() -> None:
    rules = (TpRule(pattern="blocks.*.attn.qkv", style=TpStyle.COLWISE),)
    assert style_of(rules, "blocks.3.attn.qkv") is TpStyle.COLWISE
    assert style_of(rules, "blocks.3.x.attn.qkv") is None
    assert style_of(rules, "blocks.3.attn") is None
    assert [str(p) for p in placements(TpStyle.COLWISE, "bias", False)] == ["S(0)"]
    assert [str(p) for p in placements(TpStyle.ROWWISE, "weight", False)] == ["S(1)"]
    assert [str(p) for p in placements(TpStyle.ROWWISE, "bias", False)] == ["R"]
    assert [str(p) for p in placements(TpStyle.ROWWISE_REP, "weight", True)] == ["S(1)"]
    assert [str(p) for p in placements(None, "weight", False)] == ["R"]


def _three_stages() -> Plan:
    """The GPT example in three stages of TP degrees 2, 1, 2 (its own TP_PLAN; the tied
    embedding and head both at 2), in one micro-batch of 21 samples (what the solver planned
    for the CPU rehearsal cluster): every activation between TP regions stays whole both
    ways (DTensor took a split by the batch after the split embedding, and reduce-scattered
    the head's input gradient into one, which 21 samples on 2 ranks cannot take)."""
    base = make_plan(GPT_MODEL, [ReplicaShape((2, 2, -1), 21, 21)])
    return with_tensor_parallel(base, {(0, 0): 2, (0, 2): 2})


def test_boundaries_between_tp_groups_pair_receiver_j_with_sender_j_mod_degree() -> None:
    plan = _three_stages()
    assert tp_rank_groups(plan) == ((0, 1), (3, 4))
    sides = [boundaries(plan, r) for r in plan.ranks]
    # (receive activations from, send gradients to) / (receive gradients from, send to)
    shown = [[None if b is None else (b.peer_rank, b.destinations) for b in pair] for pair in sides]
    assert shown == [
        [None, (2, (2,))],
        [None, (2, ())],
        [(0, (0, 1)), (3, (3, 4))],
        [(2, (2,)), None],
        [(2, ()), None],
    ]


def test_what_tp_does_not_run_with_yet_is_refused_naming_the_fix() -> None:
    plan = _three_stages()
    check_tensor_parallel(plan)
    zero = replace(plan, training=replace(plan.training, zero_stage=ZeroStage.OPTIMIZER_STATE))
    with pytest.raises(ConfigError, match=r"ZeRO .* --tensor-parallel never"):
        check_tensor_parallel(zero)
    offload = replace(plan, ranks=tuple(replace(r, optimizer_offload=True) for r in plan.ranks))
    with pytest.raises(ConfigError, match="optimizer offload"):
        check_tensor_parallel(offload)


def test_a_parameter_tied_across_stages_of_other_degrees_is_refused() -> None:
    base = make_plan(GPT_MODEL, [ReplicaShape((2, -1), 2, 4)])
    plan = with_tensor_parallel(base, {(0, 1): 2})  # embedding at 1, head at 2
    with pytest.raises(ConfigError, match=r"tok_emb\.weight .* tp_degree 1 and 2"):
        check_tensor_parallel(plan)


# --------------------------------------------------------------------------- rehearsals
TP_NUMBERED = NUMBERED_DATASET.replace("nn.Linear(2, 4)", "nn.Linear(2, 8)").replace(
    "nn.Linear(4, 1)", "nn.Linear(8, 1)"
)
NUMBERED_TP_PLAN = (
    TpRule(pattern="a", style=TpStyle.COLWISE),
    TpRule(pattern="b", style=TpStyle.ROWWISE),
)


def test_gpt_pipeline_of_tp_degrees_2_1_2_recomputing_passes_verify() -> None:
    plan = _three_stages()  # the first TP stage recomputes whole, the last its first unit
    ranks = [
        replace(r, memory_strategy=MemoryStrategy.RECOMPUTE)
        if r.stage == 0
        else replace(r, memory_strategy=MemoryStrategy.SELECTIVE, recompute_units=r.units[:1])
        if r.stage == 2
        else r
        for r in plan.ranks
    ]
    result, text = _rehearse(replace(plan, ranks=tuple(ranks)))
    verified = result.verify
    assert verified is not None and result.verify_passed is True, text
    assert verified.gradients.relative_difference < 1e-5
    assert verified.updates.relative_difference < 1e-5
    assert verified.loss == pytest.approx(verified.reference_loss, rel=1e-5)


def test_two_tp_replicas_of_unequal_shares_clipped_to_the_global_norm_pass_verify(
    tmp_path: Path,
) -> None:
    # clipping to a norm far below the gradient's: a norm that counted a shard twice, or a
    # replicated bias once per member, scales the gradients otherwise than one process
    path = write_model(tmp_path, TP_NUMBERED + "\n    MAX_GRAD_NORM = 1e-3\n")
    base = make_plan(path, [ReplicaShape((-1,), 2, 4), ReplicaShape((-1,), 1, 2)])
    plan = with_tensor_parallel(base, {(0, 0): 2, (1, 0): 2}, NUMBERED_TP_PLAN)
    result, text = _rehearse(plan, steps=2)  # after step 0 a TP group times its stage warm
    assert result.verify is not None and result.verify_passed is True, text
    assert result.verify.gradients.relative_difference < 1e-5


def test_fp16_loss_scaling_on_a_tp_group_skips_and_trains_as_without_tp(tmp_path: Path) -> None:
    path = write_model(tmp_path, TP_NUMBERED)
    plain = make_plan(path, [ReplicaShape((-1,), 2, 4)])
    losses = {}
    for name, plan in (("tp", with_tensor_parallel(plain, {(0, 0): 2}, NUMBERED_TP_PLAN)),
                       ("plain", plain)):  # fmt: skip
        fp16 = replace(plan, ranks=tuple(replace(r, precision=Precision.FP16) for r in plan.ranks))
        metrics = tmp_path / f"m-{name}"
        outcomes = run_ranks(fp16, tmp_path / name, "--steps", "3", "--metrics-dir", str(metrics))
        assert all(o.returncode == 0 for o in outcomes), outcomes[0].stderr[-2000:]
        assert "step 0 skipped" in outcomes[0].stderr  # the scale starts too high here
        losses[name] = _losses(metrics, fp16.world_size)
    assert losses["tp"].keys() == losses["plain"].keys() == {0, 1, 2}
    for step, loss in losses["plain"].items():
        assert losses["tp"][step] == pytest.approx(loss, rel=1e-3), step  # fp16 roundings


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return write_model(tmp_path_factory.mktemp("llama"), with_shard_fault(HF_LLAMA), "llama.py")


def _llama_plan(path: Path) -> Plan:
    base = make_plan(path, [ReplicaShape((-1,), 2, 4)])
    return with_tensor_parallel(base, {(0, 0): 2})


@pytest.mark.xdist_group("tp-llama")
def test_tiny_hf_llama_on_a_tp_group_under_bf16_autocast_passes_verify(llama: Path) -> None:
    plan = _llama_plan(llama)
    bf16 = replace(plan, ranks=tuple(replace(r, precision=Precision.BF16) for r in plan.ranks))
    result, text = _rehearse(bf16)
    assert result.verify is not None and result.verify_passed is True, text
    assert "(tol 5e-02) pass" in text  # against one bf16 process: a few bf16 roundings


@pytest.mark.xdist_group("tp-llama")
def test_one_shards_doubled_gradient_fails_verify_naming_the_parameter(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "model.layers.1.mlp.up_proj.weight"
    monkeypatch.setenv("HPLAN_TEST_SCALE_SHARD", f"{name}=2@1")  # rank 1's half only
    result, text = _rehearse(_llama_plan(llama))
    verified = result.verify
    assert verified is not None and result.verify_passed is False, text
    assert verified.gradients.name == name and not verified.gradients.passed
    assert 0.5 < verified.gradients.relative_difference < 0.9  # half of it doubled
    assert f"verify: gradients: worst {name} (rank " in text and "FAIL" in text


# --------------------------------------------------------------------------- checkpoints
def _losses(metrics_dir: Path, world_size: int) -> dict[int, float]:
    found = {}
    for rank in range(world_size):
        for record in read_rank_metrics(metrics_dir / f"rank-{rank}.jsonl"):
            if record.loss is not None:
                assert record.step not in found  # a TP group's loss counted once
                found[record.step] = record.loss
    return found


def test_a_checkpoint_written_under_tp_resumes_without_tp_and_back(tmp_path: Path) -> None:
    path = write_model(tmp_path, TP_NUMBERED)
    plain = make_plan(path, [ReplicaShape((-1,), 4, 8)])
    tp = with_tensor_parallel(plain, {(0, 0): 2}, NUMBERED_TP_PLAN)
    whole, pieces = tmp_path / "whole", tmp_path / "pieces"
    common = ("--checkpoint-dir",)
    outcomes = run_ranks(
        tp, tmp_path / "w", "--steps", "3", *common, str(whole), "--metrics-dir",
        str(tmp_path / "m-whole"), timeout_s=TIMEOUT_S,
    )  # fmt: skip
    assert all(o.returncode == 0 for o in outcomes), outcomes[0].stderr[-2000:]
    for i, (plan, steps) in enumerate([(tp, 1), (plain, 1), (tp, 1)]):  # steps 0, 1, 2
        outcomes = run_ranks(
            plan, tmp_path / f"p{i}", "--steps", str(steps), *common, str(pieces), "--resume",
            "--metrics-dir", str(tmp_path / f"m{i}"), timeout_s=TIMEOUT_S,
        )  # fmt: skip
        assert all(o.returncode == 0 for o in outcomes), outcomes[0].stderr[-2000:]
    expected = _losses(tmp_path / "m-whole", tp.world_size)
    resumed = {
        **_losses(tmp_path / "m0", tp.world_size),
        **_losses(tmp_path / "m1", plain.world_size),
        **_losses(tmp_path / "m2", tp.world_size),
    }
    assert sorted(resumed) == [0, 1, 2]
    for step, loss in resumed.items():
        assert loss == pytest.approx(expected[step], rel=1e-5), step
    saved = read_checkpoint(pieces / "step-3", tmp_path)
    reference = read_checkpoint(whole / "step-3", tmp_path)
    assert saved["model"].keys() == reference["model"].keys() == {
        "a.weight", "a.bias", "b.weight", "b.bias",
    }  # fmt: skip
    for name, value in reference["model"].items():
        assert saved["model"][name].shape == value.shape
        assert (saved["model"][name] - value).abs().max() < 1e-6, name
