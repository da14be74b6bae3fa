"""The capture on fake tensors: nothing real runs, costs as real kernels have them.

Small Hugging Face configs (Llama with grouped KV heads, GPT-2), both with the default
``sdpa`` attention: built, traced, measured and checked on fake tensors, with the graph a
rank traces on real tensors; FLOPs equal to ``FlopCounterMode`` on a real run; attention
saved as the fused kernels save it (against a hand count); the fallbacks say why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import is_fake
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from hplan.planner.frontend.attention_costs import attention_flops, logsumexp_bytes
from hplan.planner.frontend.capture import CaptureTensors, capture_model
from hplan.planner.frontend.cost_graph import model_graph
from hplan.planner.frontend.trains_check import check_trains
from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.capture.trace import bind_inputs, trace_model
from hplan.runtime.contract.errors import ModelFileError
from tests.fixtures import models as fx

FAMILIES = ["llama", "gpt2"]
FLOAT_BYTES = 4


class _RealFloatCalls(TorchFunctionMode):
    """Records every torch call that receives a real (not fake, not meta) float tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        leaves = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        if any(_is_real_float(t) for t in leaves):
            self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _is_real_float(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and not value.is_meta
        and not is_fake(value)
    )


def _hf_file(tmp_path: Path, family: str, **kwargs: Any) -> Path:
    pytest.importorskip("transformers")
    return fx.write_hf_model_file(tmp_path, family, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_models_are_captured_measured_and_checked_without_a_real_tensor(family, tmp_path):
    model_file = load_model_file(_hf_file(tmp_path, family))
    with _RealFloatCalls() as watch:
        captured = capture_model(model_file)
        graph = model_graph(captured)
    assert watch.calls == []
    verdict = check_trains(captured)  # loss_fn on real random outputs: the loss convention
    assert captured.tensors is CaptureTensors.FAKE and captured.notes == ()
    tensors = [*captured.model.parameters(), *captured.model.buffers()]
    assert tensors and all(is_fake(t) for t in tensors)  # no parameter has storage
    assert verdict.device == "fake" and verdict.notes == ()
    assert all(c.fwd_flops_per_sample > 0 for c in graph.unit_costs if "layers" in c.name)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fake_graph_is_the_graph_a_rank_traces_on_real_tensors(family, tmp_path):
    model_file = load_model_file(_hf_file(tmp_path, family))
    captured = capture_model(model_file)
    torch.manual_seed(0)
    model = model_file.build_model()
    inputs = bind_inputs(model, model_file.sample_batch(2)[0])
    real = trace_model(model, inputs, method=captured.traced.method)
    assert real.fingerprint() == captured.traced.fingerprint()


@pytest.mark.parametrize("family", FAMILIES)
def test_stock_configs_with_their_key_value_cache_on_are_traced_without_it(family, tmp_path):
    """``use_cache`` left at the config's default (True): forward would return a cache
    object torch.export cannot trace; a training step reads none, so it is traced False,
    on fake tensors and on the real ones a rank traces alike."""
    model_file = load_model_file(_hf_file(tmp_path, family, use_cache=None))
    captured = capture_model(model_file)
    assert captured.tensors is CaptureTensors.FAKE and captured.notes == ()
    torch.manual_seed(0)
    model = model_file.build_model()
    assert model.config.use_cache
    inputs = bind_inputs(model, model_file.sample_batch(2)[0])
    real = trace_model(model, inputs, method=captured.traced.method)
    assert real.fingerprint() == captured.traced.fingerprint()
    interpreter = torch.fx.Interpreter(real.graph_module)
    outputs = interpreter.run(*inputs.values(), enable_io_processing=False)
    shapes = [tuple(t.shape) for t in torch.utils._pytree.tree_leaves(outputs)]
    assert shapes == [(2, fx.HF_SEQ, fx.HF_VOCAB)]  # the logits, no key/value cache


@pytest.mark.parametrize("family", FAMILIES)
def test_flops_per_sample_equal_the_flop_counter_on_a_real_run(family, tmp_path):
    """Eager attention runs matmuls the counter sees; sdpa's FLOPs come from the formula and
    must equal them (the CPU's sdpa kernel counts 0 in FlopCounterMode)."""
    eager = load_model_file(_hf_file(tmp_path, family, attention="eager"))
    counted = []
    for batch_size in (2, 3):
        torch.manual_seed(0)
        model = eager.build_model()
        inputs = bind_inputs(model, eager.sample_batch(batch_size)[0])
        with FlopCounterMode(display=False) as counter:
            model(**inputs)
        counted.append(counter.get_total_flops())
    real_per_sample = counted[1] - counted[0]
    for attention in ("eager", "sdpa"):
        path = _hf_file(tmp_path, family, attention=attention)
        graph = model_graph(capture_model(load_model_file(path)))
        total = sum(c.fwd_flops_per_sample for c in graph.unit_costs)
        assert total == pytest.approx(real_per_sample, rel=1e-9), attention


def test_attention_saves_what_the_fused_kernels_save(tmp_path):
    """Per sample: q, k, v (views of one qkv storage), the output and one float32
    log-sum-exp per head and query row; not the (seq x seq) attention matrix."""
    path = fx.write_model_file(tmp_path, "fused_attention")
    graph = model_graph(capture_model(load_model_file(path)))
    seq, width, heads = fx.ATTENTION_SEQ, fx.ATTENTION_WIDTH, fx.ATTENTION_HEADS
    qkv_bytes = 3 * seq * width * FLOAT_BYTES
    output_bytes = seq * width * FLOAT_BYTES
    lse_bytes = heads * seq * FLOAT_BYTES
    node = graph.graph.nodes["scaled_dot_product_attention"]
    assert node["saved_bytes"] == qkv_bytes + output_bytes + lse_bytes
    assert node["saved_bytes"] < heads * seq * seq * FLOAT_BYTES  # the math path's matrix
    head_dim = width // heads
    assert node["flops"] == 4 * heads * seq * seq * head_dim  # per sample: the two matmuls


def test_attention_formulas_fold_leading_dims_and_grouped_kv_heads():
    query = torch.empty(2, 8, 16, 4, device="meta")
    grouped = torch.empty(2, 2, 16, 4, device="meta")
    assert attention_flops(query, grouped, grouped) == 4 * 2 * 8 * 16 * 16 * 4
    assert logsumexp_bytes(query) == 2 * 8 * 16 * 4


def test_a_loss_that_needs_values_gets_a_static_verdict_with_a_note(tmp_path):
    captured = capture_model(load_model_file(_hf_file(tmp_path, "gpt2", loss="item")))
    verdict = check_trains(captured)
    assert verdict.device == "static"
    assert len(verdict.notes) == 1 and "loss_fn needs tensor values" in verdict.notes[0]


def test_a_broken_loss_still_fails_on_fake_tensors(tmp_path):
    path = _hf_file(tmp_path, "llama")
    path.write_text(path.read_text().replace("return loss\n", "return loss.reshape(1).repeat(2)\n"))
    captured = capture_model(load_model_file(path))
    with pytest.raises(ModelFileError, match="returned a tensor of shape"):
        check_trains(captured)


def test_a_model_fake_tensors_cannot_build_is_captured_on_cpu_with_a_note(tmp_path):
    captured = capture_model(load_model_file(fx.write_model_file(tmp_path, "value_in_init")))
    assert captured.tensors is CaptureTensors.CPU
    assert len(captured.notes) == 1 and "captured on real CPU tensors" in captured.notes[0]
    assert captured.notes[0] in model_graph(captured).notes
    assert check_trains(captured).device in ("meta", "cpu")
