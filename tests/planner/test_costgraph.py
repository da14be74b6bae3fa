"""The cost graph: per-sample FLOPs and bytes, cut tensors, inputs, fallbacks, errors."""

from __future__ import annotations

import textwrap
from functools import cache
from pathlib import Path

import pytest

from hplan.planner.frontend.cost_graph import ModelGraph, build_model_graph
from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.contract.errors import ModelFileError, TraceError
from hplan.runtime.contract.plan import TraceMethod
from tests.fixtures import models as fx


@cache
def _example(name: str) -> ModelGraph:
    return build_model_graph(fx.example_model_file(name))


def _case(name: str, tmp_path: Path) -> ModelGraph:
    return build_model_graph(load_model_file(fx.write_model_file(tmp_path, name)))


def _write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "model.py"
    header = "import torch\nfrom torch import nn\n\n"
    path.write_text(header + textwrap.dedent(body))
    return path


def test_gpt_example_cuts_carry_one_hidden_state_per_sample():
    graph = _example("gpt")
    assert graph.traced.method is TraceMethod.SYMBOLIC
    assert graph.notes == ()  # measured on the meta device
    assert len(graph.cuts) == len(graph.units) - 1
    for idx, cut in enumerate(graph.cuts[1:], start=1):
        (hidden,) = cut
        assert (hidden.shape, hidden.batch_dim, hidden.dtype) == ((1, 64, 64), 0, "float32")
        assert hidden.requires_grad
        assert graph.cut_bytes_per_sample(idx) == 64 * 64 * 4
    assert graph.param_dtype == "float32"
    (idx_input,) = graph.inputs
    assert idx_input.tensor.name == "idx" and idx_input.tensor.dtype == "int64"
    assert idx_input.tensor.shape == (1, 64) and not idx_input.tensor.requires_grad
    assert idx_input.read_by_units == ("tok_emb", "pos_emb")


def test_flops_per_sample_follow_the_linear_layer_formula():
    graph = _example("mlp")
    costs = {c.name: c for c in graph.unit_costs}
    width, features = 128, 32
    # a Linear layer does 2 * in * out FLOPs per row (multiply and add)
    assert costs["inp"].fwd_flops_per_sample == 2 * features * width
    for idx in range(8):
        assert costs[f"blocks.{idx}"].fwd_flops_per_sample == 2 * width * width
    assert costs["out"].fwd_flops_per_sample == 2 * width


def test_parameters_cancel_out_of_per_sample_activation_bytes():
    graph = _example("mlp")
    block = next(c for c in graph.unit_costs if c.name == "blocks.0")
    row_bytes = 128 * 4
    # saved: the LayerNorm input and its statistics, the Linear input, the ReLU output
    assert 3 * row_bytes <= block.activation_bytes_per_sample <= 3 * row_bytes + 64
    assert block.param_bytes == (128 * 128 + 128 + 2 * 128) * 4
    assert block.trainable_param_bytes == block.param_bytes
    assert block.io_bytes_per_sample > 2 * row_bytes
    assert block.num_ops == 4  # norm, fc, relu, add


def test_logits_are_charged_to_the_head_unit(tmp_path):
    graph = _case("untied_lm_q3", tmp_path)
    assert graph.notes == ()  # vocab 32000 x seq 128 is free on the meta device
    costs = {c.name: c for c in graph.unit_costs}
    logits_bytes = 128 * 32000 * 4
    assert costs["head"].activation_bytes_per_sample >= logits_bytes
    assert costs["head"].io_bytes_per_sample >= logits_bytes
    assert costs["emb"].activation_bytes_per_sample < logits_bytes / 100
    assert costs["emb"].param_bytes == costs["head"].param_bytes == 32000 * 64 * 4
    assert costs["head"].fwd_flops_per_sample == 2 * 128 * 64 * 32000


def test_cut_specs_have_per_sample_shapes_and_dtypes(tmp_path):
    graph = _case("mixed_dtype_boundary", tmp_path)
    by_dtype = {t.dtype: t for t in graph.cuts[0]}
    assert by_dtype["float32"].shape == (1, fx.SEQ, fx.WIDTH)
    assert by_dtype["int64"].shape == by_dtype["bool"].shape == (1, fx.SEQ)
    assert [by_dtype[d].requires_grad for d in ("float32", "int64", "bool")] == [
        True,
        False,
        False,
    ]
    assert graph.cut_grad_bytes_per_sample(0) == fx.SEQ * fx.WIDTH * 4
    (tmp_path / "sliced").mkdir()
    sliced = _case("non_contiguous", tmp_path / "sliced")
    slice_cut = sliced.cuts[[u.name for u in sliced.units].index("slice")]
    assert [t.shape_for(3) for t in slice_cut] == [(3, fx.WIDTH // 2, fx.WIDTH)]


def test_inputs_list_every_unit_that_reads_them(tmp_path):
    graph = _case("mask_and_labels", tmp_path)
    read_by = {i.tensor.name: i.read_by_units for i in graph.inputs}
    assert read_by == {
        "x": ("blocks.0",),
        "mask": ("blocks.0", "blocks.1", "blocks.2"),
        "labels": ("head",),
    }
    mask = next(i.tensor for i in graph.inputs if i.tensor.name == "mask")
    assert (mask.dtype, mask.shape, mask.batch_dim) == ("bool", (1, fx.SEQ), 0)


def test_a_model_the_meta_device_cannot_run_is_measured_on_cpu(tmp_path):
    graph = _case("branch_in_submodule", tmp_path)
    assert graph.traced.leaf_modules == ("blocks.0", "blocks.1", "blocks.2")
    assert any("CPU" in n for n in graph.notes)
    costs = {c.name: c for c in graph.unit_costs}
    assert costs["blocks.1"].fwd_flops_per_sample == 2 * fx.WIDTH * fx.WIDTH
    assert [u.name for u in graph.units] == ["inp", "blocks.0", "blocks.1", "blocks.2", "out"]


def test_networkx_graph_holds_every_node_with_its_costs():
    graph = _example("gpt")
    gm = graph.traced.graph_module
    assert set(graph.graph.nodes) == {n.name for n in gm.graph.nodes}
    for unit, cost in zip(graph.units, graph.unit_costs, strict=True):
        flops = sum(graph.graph.nodes[n]["flops"] for n in unit.nodes)
        assert flops == pytest.approx(cost.fwd_flops_per_sample)
        assert all(graph.graph.nodes[n]["unit"] == unit.name for n in unit.nodes)
    data = graph.graph.nodes["blocks_0_attn_qkv"]
    assert data["op"] == "call_module" and data["module_path"] == "blocks.0.attn.qkv"
    assert data["output_bytes"] == 64 * 3 * 64 * 4
    assert graph.graph.edges["blocks_0_attn_qkv", "split"]["bytes"] == 64 * 3 * 64 * 4
    assert graph.graph.nodes["idx"]["unit"] is None


def test_huggingface_gpt2_plans_through_torch_export():
    pytest.importorskip("transformers")
    graph = _example("hf_gpt2")
    assert graph.traced.method is TraceMethod.EXPORT
    assert any("used torch.export" in n for n in graph.notes)
    for note in graph.notes:  # readable one-liners, not raw internal errors
        assert "\n" not in note and "an unknown line" not in note
        assert "RuntimeError" not in note and "meta device differs" not in note
    for cut in graph.cuts:
        assert [(t.shape, t.dtype) for t in cut] == [((1, 32, 64), "float32")]
    assert graph.inputs[0].read_by_units[0] == "transformer.wte"


def test_frozen_parameters_are_not_trainable_bytes(tmp_path):
    path = _write(
        tmp_path,
        """\
        def build_model():
            model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
            model[0].requires_grad_(False)
            return model

        def sample_batch(batch_size):
            return torch.randn(batch_size, 4), torch.randn(batch_size, 4)

        def loss_fn(out, target):
            return ((out - target) ** 2).mean()
        """,
    )
    costs = build_model_graph(load_model_file(path)).unit_costs
    assert [(c.param_bytes, c.trainable_param_bytes) for c in costs] == [(80, 0), (80, 80)]


_CONV_MODEL = """\
    def build_model():
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 1), nn.Flatten(), nn.Linear(8 * 16 * 16, 4),
        )
        return model{layout}

    def sample_batch(batch_size):
        images = torch.randn(batch_size, 3, 16, 16){layout}
        return images, torch.randn(batch_size, 4)

    def loss_fn(out, target):
        return ((out - target) ** 2).mean()
    """


@pytest.mark.parametrize(
    ("layout", "expected_bytes"),
    [
        # first conv: input 3x16x16 + output 8x16x16; the 1x1 conv: 8x16x16 in and out
        ("", 4 * (3 * 256 + 8 * 256 + 8 * 256 + 8 * 256)),
        (".to(memory_format=torch.channels_last)", 0),
    ],
)
def test_channels_first_convolutions_record_their_activation_bytes(
    tmp_path, layout, expected_bytes
):
    path = _write(tmp_path, _CONV_MODEL.format(layout=layout))
    graph = build_model_graph(load_model_file(path))
    total = sum(c.channels_first_conv_io_bytes_per_sample for c in graph.unit_costs)
    assert total == pytest.approx(expected_bytes)
    # 2 x kernel elements x output positions: 2 x 8*3*3*3 x 256 + 2 x 8*8 x 256
    assert sum(c.conv_flops_per_sample for c in graph.unit_costs) == pytest.approx(143_360)
    assert not any("real CPU tensors" in note for note in graph.notes), graph.notes


def test_a_model_that_converts_its_own_parameters_is_captured_on_fake_tensors(tmp_path):
    """torch cannot convert fake parameters in place (``.to(memory_format=...)`` or a
    dtype); the capture builds such a model on meta and keeps its shared parameters shared."""
    path = _write(
        tmp_path,
        """\
        class Tied(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(50, 16)
                self.conv = nn.Conv2d(1, 1, 3, padding=1)
                self.head = nn.Linear(16, 50, bias=False)
                self.head.weight = self.emb.weight

            def forward(self, x):
                return self.head(self.conv(self.emb(x).unsqueeze(1)).squeeze(1))

        def build_model():
            return Tied().to(memory_format=torch.channels_last)

        def sample_batch(batch_size):
            x = torch.randint(0, 50, (batch_size, 8))
            return x, x

        def loss_fn(out, target):
            return nn.functional.cross_entropy(out.reshape(-1, 50), target.reshape(-1))
        """,
    )
    graph = build_model_graph(load_model_file(path))
    assert not any("real CPU tensors" in note for note in graph.notes), graph.notes
    assert list(graph.trainable_param_sizes) == ["emb.weight", "conv.weight", "conv.bias"]
    assert list(graph.tied_trainable_bytes.values()) == [50 * 16 * 4]


@pytest.mark.parametrize(
    ("body", "error", "needle"),
    [
        (
            "def build_model():\n    raise RuntimeError('no GPU here')\n",
            ModelFileError,
            "build_model",
        ),
        ("def build_model():\n    return 3\n", ModelFileError, "torch.nn.Module"),
        (
            "def build_model():\n    return nn.Linear(2, 2)\n"
            "def sample_batch(batch_size):\n    raise KeyError('shard')\n",
            ModelFileError,
            r"sample_batch\(2\)",
        ),
        (
            "def build_model():\n    return nn.Linear(2, 2)\n"
            "def sample_batch(batch_size):\n    return torch.randn(batch_size, 2)\n",
            ModelFileError,
            r"\(inputs, targets\)",
        ),
        (
            "def build_model():\n    return nn.Linear(2, 2)\n"
            "def sample_batch(batch_size):\n    return torch.randn(4, 2), None\n",
            ModelFileError,
            "grow with the batch size",
        ),
    ],
)
def test_model_file_mistakes_are_one_line_typed_errors(tmp_path, body, error, needle):
    defaults = {
        "sample_batch": "def sample_batch(batch_size):\n    return torch.randn(batch_size, 2), None\n",
        "loss_fn": "def loss_fn(out, target):\n    return out.mean()\n",
    }
    text = body + "".join(v for k, v in defaults.items() if f"def {k}" not in body)
    with pytest.raises(error, match=needle) as info:
        build_model_graph(load_model_file(_write(tmp_path, text)))
    assert "\n" not in str(info.value)


def test_untraceable_model_is_a_trace_error(tmp_path):
    with pytest.raises(TraceError, match="LEAF_MODULES"):
        _case("branch_at_top", tmp_path)


def test_batch_sizes_must_be_two_distinct_positive_integers():
    model_file = fx.example_model_file("mlp")
    for sizes in ((2, 2), (0, 3)):
        with pytest.raises(ValueError, match="batch_sizes"):
            build_model_graph(model_file, batch_sizes=sizes)


def test_a_shape_mismatch_is_one_line_with_no_torch_traceback_on_stderr(tmp_path, capfd):
    path = _write(
        tmp_path,
        """\
        def build_model():
            return nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(10, 10))

        def sample_batch(batch_size):
            return torch.randn(batch_size, 3, 32, 32), torch.randint(0, 10, (batch_size,))

        def loss_fn(out, target):
            return nn.functional.cross_entropy(out, target)
        """,
    )
    with pytest.raises(TraceError, match="cannot be multiplied") as info:
        build_model_graph(load_model_file(path))
    assert "\n" not in str(info.value) and "an unknown line" not in str(info.value)
    assert "Traceback" not in capfd.readouterr().err


def test_the_loss_stage_holds_the_losses_own_tensors_and_the_gradients_of_its_backward(
    tmp_path,
):
    """Cross-entropy over 1000 classes: its log-softmax (saved) and, at the start of the
    backward, the gradients of the logits and of the log-softmax: three more logits-sized
    tensors per sample (4000 bytes each in float32) on the unit that makes the logits."""
    from hplan.planner.frontend.capture import capture_model
    from hplan.planner.frontend.cost_graph import model_graph
    from hplan.planner.frontend.trains_check import check_trains

    path = _write(
        tmp_path,
        """
        import torch.nn.functional as F

        def build_model():
            return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1000))

        def sample_batch(n):
            return torch.randn(n, 8), torch.randint(0, 1000, (n,))

        def loss_fn(logits, targets):
            return F.cross_entropy(logits, targets)
        """,
    )
    captured = capture_model(load_model_file(path))
    verdict = check_trains(captured)
    assert verdict.loss_memory is not None
    assert verdict.loss_memory.saved_bytes_per_sample == pytest.approx(4000, rel=0.01)
    assert verdict.loss_memory.largest_saved_bytes_per_sample == pytest.approx(4000, rel=0.01)
    without = model_graph(captured).unit_costs[-1].activation_bytes_per_sample
    with_loss = model_graph(captured, verdict.loss_memory).unit_costs[-1]
    assert with_loss.activation_bytes_per_sample - without == pytest.approx(12_000, rel=0.01)
