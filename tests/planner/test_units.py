"""Partition units: which nodes group together, and the invariants every grouping keeps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hplan.planner.frontend.partition_units import assign_units
from hplan.runtime.capture.cuts import node_units
from hplan.runtime.capture.trace import TracedModel, bind_inputs, repeated_containers, trace_model
from tests.fixtures import models as fx


def _tensor_nodes(traced: TracedModel, inputs: dict[str, torch.Tensor]) -> set[str]:
    found: set[str] = set()

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node):
            result = super().run_node(n)
            if isinstance(result, torch.Tensor):
                found.add(n.name)
            return result

    Recorder(traced.graph_module).run(*[inputs[n] for n in traced.input_names])
    return found


def _units(model: nn.Module, inputs: dict[str, torch.Tensor], tensor_nodes=None):
    traced = trace_model(model, inputs)
    nodes = _tensor_nodes(traced, inputs) if tensor_nodes is None else tensor_nodes
    units, notes = assign_units(traced, nodes)
    return traced, units, notes


def _case_units(name: str):
    case = fx.CASES[name]
    torch.manual_seed(0)
    return _units(case.build(), case.sample(2))


def _example_units(name: str):
    model_file = fx.example_model_file(name)
    torch.manual_seed(0)
    model = model_file.build_model()
    return _units(model, bind_inputs(model, model_file.sample_batch(2)[0]))


def test_repeated_blocks_embeddings_and_head_are_units():
    _, units, notes = _example_units("gpt")
    names = [u.name for u in units]
    assert names == ["tok_emb", "pos_emb", *(f"blocks.{i}" for i in range(4)), "ln_f", "lm_head"]
    assert notes == ()


def test_huggingface_gpt2_units_are_its_layers():
    pytest.importorskip("transformers")
    _, units, _ = _example_units("hf_gpt2")
    names = [u.name for u in units]
    assert names == [
        "transformer.wte",
        "transformer.wpe",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.ln_f",
        "lm_head",
    ]


def test_only_the_outermost_stack_of_repeated_blocks_counts():
    traced, _, _ = _example_units("gpt")
    # blocks.k.mlp is a Sequential with two Linear children, but it lies inside a block
    assert repeated_containers(traced.module_classes) == {"blocks"}


@pytest.mark.parametrize("name", ["gpt", "mlp", *(n for n, c in fx.CASES.items() if c.traceable)])
def test_every_node_is_in_one_unit_and_data_flows_forward(name):
    traced, units, _ = _example_units(name) if name in ("gpt", "mlp") else _case_units(name)
    gm = traced.graph_module
    node_unit = node_units(gm, units)  # raises unless each node is in exactly one unit
    assert len({u.name for u in units}) == len(units)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        for source in node.all_input_nodes:
            if source.op != "placeholder":
                assert node_unit[source.name] <= node_unit[node.name], (source, node)
    assert all(u.params for u in units) or len(units) == 1


def test_parameter_free_modules_merge_into_the_preceding_unit():
    _, units, _ = _case_units("conv_bn_relu")
    names = [u.name for u in units]
    assert names == ["features.0", "features.1", "features.3", "features.4", "head"]
    relu_unit = next(u for u in units if u.name == "features.1")
    assert any("features_2" in n for n in relu_unit.nodes)


def test_a_leading_parameter_free_module_merges_into_the_next_unit():
    model = nn.Sequential(nn.ReLU(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    _, units, _ = _units(model, {"input": torch.randn(2, 4)})
    assert [u.name for u in units] == ["1", "3"]
    assert [len(u.nodes) for u in units] == [3, 1]  # relu joins 1, tanh joins 1 too


def test_a_non_tensor_crossing_a_boundary_merges_the_units_it_spans():
    _, units, notes = _case_units("attention_tuple_across_modules")
    assert [u.name for u in units] == ["attn", "head"]
    assert len(notes) == 1 and "'attn'" in notes[0] and "unpack" in notes[0]


def test_units_merge_around_any_value_the_caller_marks_as_not_a_tensor():
    model_file = fx.example_model_file("mlp")
    torch.manual_seed(0)
    model = model_file.build_model()
    inputs = bind_inputs(model, model_file.sample_batch(2)[0])
    traced = trace_model(model, inputs)
    every = _tensor_nodes(traced, inputs)
    _, plain, _ = _units(model, inputs, every)
    node_unit = node_units(traced.graph_module, plain)
    out_of_block_1 = max(
        (n for n in plain[2].nodes), key=lambda n: list(node_unit).index(n)
    )  # the value blocks.1 hands to blocks.2
    units, notes = assign_units(traced, every - {out_of_block_1})
    assert [u.name for u in units] == [u.name for u in plain if u.name != "blocks.2"]
    assert notes and "blocks.1, blocks.2" in notes[0]


def test_attention_and_the_getitem_of_its_output_share_a_unit():
    traced, units, _ = _case_units("attention_norm_linear")
    node_unit = node_units(traced.graph_module, units)
    attn = next(n for n in traced.graph_module.graph.nodes if n.target == "attn")
    for user in attn.users:
        assert node_unit[user.name] == node_unit[attn.name]


def test_unit_parameters_and_buffers_use_canonical_names():
    _, gpt_units, _ = _example_units("gpt")
    assert gpt_units[-1].params == ("tok_emb.weight",)  # lm_head.weight is tied to it
    assert gpt_units[0].params == ("tok_emb.weight",)
    _, shared_units, _ = _case_units("shared_buffer")
    assert [u.buffers for u in shared_units] == [("table",)] * 4
    _, conv_units, _ = _case_units("conv_bn_relu")
    bn = next(u for u in conv_units if u.name == "features.1")
    assert "features.1.running_mean" in bn.buffers
    assert bn.params == ("features.1.bias", "features.1.weight")


def test_top_level_code_joins_its_latest_input_and_input_free_nodes_their_first_user():
    traced, units, _ = _example_units("gpt")
    node_unit = node_units(traced.graph_module, units)
    names = [u.name for u in units]
    by_name = {n.name: n for n in traced.graph_module.graph.nodes}
    add = next(n for n in by_name.values() if n.op == "call_function" and n.name == "add")
    assert names[node_unit[add.name]] == "pos_emb"  # tok_emb(idx) + pos_emb(pos)
    arange = next(n for n in by_name.values() if "arange" in str(n.target))
    assert names[node_unit[arange.name]] == "pos_emb"  # its first user
