"""Tracing: methods, fallbacks, error messages, input binding, fingerprints."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch
from torch import nn

from hplan.runtime.capture.trace import bind_inputs, outputs_match, trace_model
from hplan.runtime.contract.errors import ModelFileError, TraceError
from hplan.runtime.contract.plan import TraceMethod
from tests.fixtures import models as fx


def _traced(case_name: str, batch_size: int = 2):
    case = fx.CASES[case_name]
    torch.manual_seed(0)
    model = case.build()
    inputs = case.sample(batch_size)
    return model, inputs, trace_model(model, inputs, leaf_modules=case.leaf_modules)


def _line_of(cls: type, text: str) -> int:
    lines, start = inspect.getsourcelines(cls)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _run(traced, inputs):
    return traced.graph_module(*[inputs[n] for n in traced.input_names])


# ----------------------------------------------------------------------- binding inputs
def test_bind_inputs_names_a_tensor_a_tuple_and_a_dict_by_forward_signature():
    model = fx.MaskAndLabels()
    x, mask = torch.randn(2, 6, 8), torch.ones(2, 6, dtype=torch.bool)
    assert list(bind_inputs(model, x)) == ["x"]
    assert list(bind_inputs(model, (x, mask))) == ["x", "mask"]
    bound = bind_inputs(model, {"mask": mask, "x": x, "labels": None})
    assert list(bound) == ["x", "mask"]  # signature order; None means not fed
    assert bound["mask"] is mask


@pytest.mark.parametrize(
    ("inputs", "needle"),
    [
        ({"x": torch.zeros(1), "lables": torch.zeros(1)}, "'lables'"),
        ((torch.zeros(1),) * 4, "4 positional inputs"),
        ({"x": torch.zeros(1), "mask": True}, "'mask' is a bool"),
        ([[1.0]], None),
    ],
)
def test_bind_inputs_rejects_bad_inputs_naming_them(inputs, needle):
    model = fx.MaskAndLabels()
    if needle is None:
        with pytest.raises(ModelFileError):
            bind_inputs(model, "not inputs")
        return
    with pytest.raises(ModelFileError, match=needle):
        bind_inputs(model, inputs)


# ----------------------------------------------------------------------- examples
@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_examples_trace_symbolically_and_retrace_to_the_same_fingerprint(name):
    model_file = fx.example_model_file(name)
    torch.manual_seed(0)
    model = model_file.build_model()
    inputs = bind_inputs(model, model_file.sample_batch(2)[0])
    traced = trace_model(model, inputs)
    assert traced.method is TraceMethod.SYMBOLIC
    assert traced.notes == ()
    assert torch.equal(_run(traced, inputs), model(**inputs))
    again = trace_model(model, inputs, method=traced.method, leaf_modules=traced.leaf_modules)
    assert again.fingerprint() == traced.fingerprint()
    exported = trace_model(model, inputs, method=TraceMethod.EXPORT)
    assert exported.method is TraceMethod.EXPORT
    assert exported.fingerprint() != traced.fingerprint()
    assert torch.equal(exported.graph_module(**inputs), model(**inputs))


def test_fingerprint_changes_with_a_models_sizes_even_when_its_graph_does_not(monkeypatch):
    model_file = fx.example_model_file("gpt")
    prints = {}
    for width in ("64", "128", "64"):
        monkeypatch.setenv("HPLAN_GPT_WIDTH", width)
        model = model_file.build_model()
        inputs = bind_inputs(model, model_file.sample_batch(2)[0])
        traced = trace_model(model, inputs)
        nodes = [(n.op, n.name) for n in traced.graph_module.graph.nodes]
        prints.setdefault(width, set()).add((traced.fingerprint(), tuple(nodes)))
    (narrow,), (wide,) = prints["64"], prints["128"]  # the same print at the same size
    assert narrow[1] == wide[1]  # the same nodes ...
    assert narrow[0] != wide[0]  # ... but not the same model


def test_fingerprint_changes_with_the_model_and_is_stable_across_processes():
    code = (
        "import torch\n"
        "from hplan.runtime.capture.trace import trace_model\n"
        "from tests.fixtures.models import CASES\n"
        "case = CASES['attention_norm_linear']\n"
        "print(trace_model(case.build(), case.sample(2)).fingerprint())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(fx.REPO_ROOT),
        check=True,
    )
    _, _, here = _traced("attention_norm_linear")
    assert result.stdout.strip() == here.fingerprint()
    _, _, other = _traced("weight_twice")
    assert other.fingerprint() != here.fingerprint()


def test_leaf_modules_by_class_name_keep_every_instance_whole():
    model = fx.example_model_file("gpt").build_model()
    inputs = {"idx": torch.randint(0, 256, (2, 64))}
    traced = trace_model(model, inputs, leaf_modules=["Block"])
    assert traced.leaf_modules == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    called = [n.target for n in traced.graph_module.graph.nodes if n.op == "call_module"]
    assert [t for t in called if str(t).startswith("blocks.")] == list(traced.leaf_modules)


def test_unknown_leaf_module_is_a_trace_error_naming_it():
    model, inputs, _ = _traced("weight_twice")
    with pytest.raises(TraceError, match=r"'decoder\.9'.*LEAF_MODULES"):
        trace_model(model, inputs, leaf_modules=["decoder.9"])


def test_tracing_leaves_buffers_and_rng_state_unchanged():
    torch.manual_seed(0)
    model = fx.ConvBatchNormReLU()  # train mode: a forward would update running stats
    before = {n: b.clone() for n, b in model.named_buffers()}
    x = torch.randn(2, 3, 6, 6)
    rng = torch.random.get_rng_state()
    for method in (None, TraceMethod.EXPORT):
        trace_model(model, {"x": x}, method=method)
    assert torch.equal(torch.random.get_rng_state(), rng)
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, before[name]), name


# ----------------------------------------------------------------------- T1 control flow
def test_branch_on_a_value_in_a_submodule_keeps_that_submodule_whole():
    model, _, traced = _traced("branch_in_submodule")
    assert traced.method is TraceMethod.SYMBOLIC
    assert traced.leaf_modules == ("blocks.0", "blocks.1", "blocks.2")
    line = _line_of(fx.ValueBranchBlock, "if h.sum() > 0")
    assert any("'blocks.0'" in n and f"models.py:{line}" in n for n in traced.notes)
    for batch_size in (2, 5):
        batch = fx.CASES["branch_in_submodule"].sample(batch_size)
        assert torch.equal(_run(traced, batch), model(**batch))


def test_branch_on_a_value_at_top_level_names_module_line_and_remedy():
    case = fx.CASES["branch_at_top"]
    with pytest.raises(TraceError) as info:
        trace_model(case.build(), case.sample(2))
    message = str(info.value)
    line = _line_of(fx.BranchAtTop, "if h.sum() > 0")
    assert "module ''" in message and "BranchAtTop" in message
    assert f"models.py:{line}" in message
    assert "LEAF_MODULES" in message and "constant" in message
    assert "\n" not in message


def test_flag_branch_traces_when_the_flag_is_a_constant():
    torch.manual_seed(0)
    model = fx.FlagBranch()
    x = torch.randn(3, 8)
    default = trace_model(model, {"x": x})
    assert default.input_names == ("x",)
    assert torch.equal(default.graph_module(x), model(x))
    doubled = trace_model(model, {"x": x, "double": True})
    assert doubled.input_names == ("x",)
    assert torch.equal(doubled.graph_module(x), model(x, double=True))
    assert not torch.equal(doubled.graph_module(x), default.graph_module(x))


def test_flag_branch_fed_as_a_tensor_names_the_branch_line():
    model = fx.FlagBranch()
    with pytest.raises(TraceError) as info:
        trace_model(model, {"x": torch.randn(3, 8), "double": torch.tensor(True)})
    assert f"models.py:{_line_of(fx.FlagBranch, 'if double:')}" in str(info.value)


def test_value_check_at_top_level_falls_back_to_module_boundaries():
    model, inputs, traced = _traced("nan_guard_at_top")
    assert traced.method is TraceMethod.MODULES
    assert traced.leaf_modules == ("inp", "out")
    assert any("torch.export failed" in n for n in traced.notes)
    assert torch.equal(_run(traced, inputs), model(**inputs))


def test_module_boundaries_are_rejected_when_the_chain_differs_from_forward():
    torch.manual_seed(0)
    model = fx.example_model_file("gpt").build_model()
    inputs = {"idx": torch.randint(0, 256, (2, 64))}
    with pytest.raises(TraceError, match="re-run `hplan solve`"):
        trace_model(model, inputs, method=TraceMethod.MODULES, leaf_modules=["tok_emb", "ln_f"])


class _SignBranch(torch.nn.Module):
    """A value-dependent branch a chain of the child modules matches on one batch only."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum().item() > 0:
            h = torch.relu(h)
        return self.b(h)


def test_a_chain_that_matches_forward_on_one_batch_only_is_refused():
    torch.manual_seed(0)
    model = _SignBranch()
    x = torch.randn(4, 8)
    with torch.no_grad():
        taken = float(model.a(x).sum()) > 0
    if taken:  # the chain (a, b) must match forward on the batch it is first checked on
        x = -x
    with pytest.raises(TraceError, match="matches forward on one batch but not on another"):
        trace_model(model, {"x": x})


# ----------------------------------------------------------------------- T2 ints from shapes
def test_python_ints_from_shapes_in_submodules_keep_them_whole():
    model, _, traced = _traced("shape_ints_in_submodules")
    assert traced.method is TraceMethod.SYMBOLIC
    assert set(traced.leaf_modules) == {"pos", "blocks.0", "blocks.1", "scale"}
    assert len(traced.notes) == 3  # blocks.0 and blocks.1 fail at the same line: one note
    assert any("in modules 'blocks.0', 'blocks.1' at" in note for note in traced.notes)
    for batch_size, seq in ((2, 4), (3, 4), (2, 7)):  # seq 7: the table is resized
        x = torch.randn(batch_size, seq, 8)
        assert torch.equal(traced.graph_module(x), model(x))


def test_python_ints_from_shapes_at_top_level_use_torch_export():
    model, _, traced = _traced("shape_ints_at_top")
    assert traced.method is TraceMethod.EXPORT
    assert any("used torch.export" in n for n in traced.notes)
    for batch_size in (2, 3, 5):  # the batch dimension stays dynamic
        batch = fx.CASES["shape_ints_at_top"].sample(batch_size)
        assert outputs_match(traced.graph_module(**batch), model(**batch))


def test_len_of_the_batch_at_top_level_is_an_error_not_a_fixed_batch_size():
    case = fx.CASES["len_at_top"]
    with pytest.raises(TraceError, match="fixed the batch size of input 'x'"):
        trace_model(case.build(), case.sample(2))


# ----------------------------------------------------------------------- T4 optional inputs
@pytest.mark.parametrize(
    ("case_name", "fed", "absent"),
    [
        ("optional_ids", "input_ids", "inputs_embeds"),
        ("optional_embeds", "inputs_embeds", "input_ids"),
    ],
)
def test_only_the_fed_optional_input_becomes_a_graph_input(case_name, fed, absent):
    model, inputs, traced = _traced(case_name)
    placeholders = [n.target for n in traced.graph_module.graph.nodes if n.op == "placeholder"]
    assert traced.input_names == (fed,) and placeholders == [fed]
    assert absent not in traced.graph_module.code
    assert torch.equal(_run(traced, inputs), model(**inputs))


@pytest.mark.parametrize("fed", [("input_ids", "inputs_embeds"), ()])
def test_unsupported_input_combination_names_the_inputs_tried(fed):
    model = fx.OptionalInputsLM()
    values = {"input_ids": torch.randint(0, 32, (2, 5)), "inputs_embeds": torch.randn(2, 5, 8)}
    with pytest.raises(TraceError) as info:
        trace_model(model, {name: values[name] for name in fed})
    message = str(info.value)
    assert f"with inputs ({', '.join(fed)}) fed" in message
    assert "give exactly one of input_ids and inputs_embeds" in message


# ----------------------------------------------------------------------- T5 built-ins
def test_builtin_modules_are_single_graph_nodes():
    _, _, attention = _traced("attention_norm_linear")
    _, _, conv = _traced("conv_bn_relu")
    calls = {
        str(n.target): n
        for t in (attention, conv)
        for n in t.graph_module.graph.nodes
        if n.op == "call_module"
    }
    assert {"attn", "norm", "proj"} <= set(calls)
    assert {f"features.{i}" for i in range(6)} <= set(calls)
    ops = [n.op for n in attention.graph_module.graph.nodes]
    assert ops.count("call_module") == 3  # nothing of the attention is traced through
    getitems = [u for u in calls["attn"].users if u.op == "call_function"]
    assert getitems and all("getitem" in str(u.target) for u in getitems)


def test_outputs_match_compares_structure_and_values():
    a = {"x": torch.ones(2), "n": 3}
    assert outputs_match(a, {"x": torch.ones(2), "n": 3})
    assert not outputs_match(a, {"x": torch.ones(2) * 2, "n": 3})
    assert not outputs_match(a, {"x": torch.ones(2), "n": 4})
    assert not outputs_match(a, (torch.ones(2), 3))
    assert not outputs_match(torch.ones(2, device="meta"), torch.ones(2, device="meta"))


def test_huggingface_gpt2_falls_back_to_torch_export():
    pytest.importorskip("transformers")
    model_file = fx.example_model_file("hf_gpt2")
    torch.manual_seed(0)
    model: nn.Module = model_file.build_model()
    inputs = bind_inputs(model, model_file.sample_batch(2)[0])
    traced = trace_model(model, inputs)
    assert traced.method is TraceMethod.EXPORT
    assert traced.notes[0].startswith("symbolic trace failed")
    assert not any(n.target == "_guards_fn" for n in traced.graph_module.graph.nodes)
    out = traced.graph_module(**inputs)
    assert torch.equal(out.logits, model(**inputs).logits)
