"""Mixture-of-experts models captured on fake tensors, costed by their active experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hplan.planner.frontend.capture import CapturedModel, CaptureTensors, capture_model
from hplan.planner.frontend.cost_graph import ModelGraph, model_graph
from hplan.planner.frontend.moe import FakeGroupedMm, grouped_mm_flops
from hplan.planner.frontend.trains_check import check_trains
from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.contract.errors import TraceError
from tests.fixtures.moe_models import (
    HAND_MOE,
    HAND_MOE_FFN,
    HAND_MOE_HIDDEN,
    HAND_MOE_SEQ,
    HF_MIXTRAL,
    HF_QWEN3_MOE,
    moe_source,
)
from tests.fixtures.plans import write_model

FLOAT32_BYTES = 4


def _capture(directory: Path, source: str, name: str) -> CapturedModel:
    return capture_model(load_model_file(write_model(directory, source, name)))


def _unit(graph: ModelGraph, name: str) -> tuple[float, int]:
    """(forward FLOPs per sample, parameter bytes) of unit ``name``."""
    cost = next(c for c in graph.unit_costs if c.name == name)
    return cost.fwd_flops_per_sample, cost.param_bytes


# ----------------------------------------------------------------------- grouped matmul
def test_a_float32_grouped_matmul_runs_on_fake_tensors_and_counts_its_routed_rows() -> None:
    mode = FakeTensorMode()
    with mode:
        rows = torch.empty(12, 16)
        experts = torch.empty(4, 16, 8)
        offsets = torch.tensor([3, 6, 9, 12], dtype=torch.int32)
        with pytest.raises(RuntimeError, match="BF16"):
            torch._grouped_mm(rows, experts, offs=offsets)
        with FakeGroupedMm():
            out = torch._grouped_mm(rows, experts, offs=offsets)
    assert out.shape == (12, 8) and out.dtype == torch.float32
    assert grouped_mm_flops((12, 16), (4, 16, 8), out_shape=(12, 8)) == 2 * 12 * 16 * 8


# ----------------------------------------------------------------------- stock Hugging Face
@pytest.mark.parametrize("source", [HF_QWEN3_MOE, HF_MIXTRAL], ids=["qwen3-moe", "mixtral"])
def test_stock_hf_moe_is_captured_and_checked_on_fake_tensors(source: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    captured = _capture(tmp_path, source, "moe.py")
    assert captured.tensors is CaptureTensors.FAKE, captured.notes
    assert check_trains(captured).device == "fake"


def test_stock_qwen3_moe_flops_follow_the_active_experts_and_memory_all_of_them(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    hidden, ffn, seq, layer = 16, 8, 8, "model.layers.0"
    graphs = {
        (e, k): model_graph(
            _capture(tmp_path, moe_source(HF_QWEN3_MOE, num_experts=e, top_k=k), f"q{e}{k}.py")
        )
        for e, k in [(4, 2), (4, 1), (8, 2)]
    }
    (flops_42, bytes_42), (flops_41, bytes_41), (flops_82, bytes_82) = (
        _unit(graphs[key], layer) for key in [(4, 2), (4, 1), (8, 2)]
    )
    expert_flops = 2 * hidden * 2 * ffn + 2 * ffn * hidden  # gate_up and down, per token
    assert flops_42 - flops_41 == pytest.approx(seq * expert_flops)
    assert flops_82 - flops_42 == pytest.approx(seq * 2 * hidden * 4)  # the router only
    assert bytes_41 == bytes_42
    expert_bytes = 3 * hidden * ffn * FLOAT32_BYTES
    assert bytes_82 - bytes_42 == 4 * (expert_bytes + hidden * FLOAT32_BYTES)


def test_hf_eager_experts_are_refused_in_one_line_before_a_real_build(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    source = moe_source(HF_QWEN3_MOE).replace(
        "output_router_logits=False,", "output_router_logits=False, experts_implementation='eager',"
    )
    with pytest.raises(TraceError) as refused:
        _capture(tmp_path, source, "eager.py")
    message = str(refused.value)
    assert "'model.layers.0.mlp.experts', 2 in all" in message and "\n" not in message
    assert "experts_implementation='grouped_mm'" in message and "LEAF_MODULES" not in message


# ----------------------------------------------------------------------- hand-written
@pytest.mark.parametrize(
    ("guard", "aux"),
    [(True, False), (False, False), (True, True)],
    ids=["kept-whole-by-trace", "traced-through", "with-aux-loss"],
)
def test_a_hand_written_dispatch_is_captured_on_fake_tensors_as_a_balanced_routing(
    guard: bool, aux: bool, tmp_path: Path
) -> None:
    captured = _capture(tmp_path, moe_source(HAND_MOE, guard=guard, aux=aux), "hand.py")
    assert captured.tensors is CaptureTensors.FAKE, captured.notes
    paths = ("blocks.0.moe", "blocks.1.moe")
    assert tuple(d.path for d in captured.expert_dispatches) == paths
    assert {(d.top_k, d.num_outputs) for d in captured.expert_dispatches} == {(2, 1 + aux)}
    assert set(paths) <= set(captured.traced.leaf_modules)
    assert "costed as a balanced routing (top-2 of 4 experts per token" in captured.notes[0]
    assert check_trains(captured).device == "fake"
    hidden, ffn = HAND_MOE_HIDDEN, HAND_MOE_FFN
    per_token = 2 * hidden * hidden + 2 * hidden * 4 + 2 * (2 * hidden * ffn + 2 * ffn * hidden)
    per_token += 2 * hidden * 4 * aux  # the router again, for the load-balancing loss
    assert _unit(model_graph(captured), "blocks.0")[0] == HAND_MOE_SEQ * per_token


def test_hand_written_flops_follow_top_k_and_memory_holds_every_expert(tmp_path: Path) -> None:
    hidden, ffn, seq = HAND_MOE_HIDDEN, HAND_MOE_FFN, HAND_MOE_SEQ
    units = {}
    for e, k in [(4, 2), (4, 1), (8, 2)]:
        captured = _capture(tmp_path, moe_source(HAND_MOE, num_experts=e, top_k=k), f"h{e}{k}.py")
        assert captured.tensors is CaptureTensors.FAKE, captured.notes
        units[e, k] = _unit(model_graph(captured), "blocks.0")
    expert_flops = 2 * hidden * ffn + 2 * ffn * hidden
    assert units[4, 2][0] - units[4, 1][0] == seq * expert_flops
    assert units[8, 2][0] - units[4, 2][0] == seq * 2 * hidden * 4  # the router only
    assert units[4, 1][1] == units[4, 2][1]
    expert_bytes = (2 * hidden * ffn + ffn + hidden) * FLOAT32_BYTES
    assert units[8, 2][1] - units[4, 2][1] == 4 * (expert_bytes + hidden * FLOAT32_BYTES)
