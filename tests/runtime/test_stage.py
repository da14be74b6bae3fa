"""Stage splitting: chained stages equal eager, tied and shared tensors, plan mismatches."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import pytest
import torch

from hplan.planner.frontend.capture import CaptureTensors
from hplan.planner.frontend.cost_graph import ModelGraph, build_model_graph
from hplan.planner.frontend.graph import crossing_values
from hplan.planner.frontend.partition_units import assign_units
from hplan.runtime.capture.cuts import node_units, replicable_nodes
from hplan.runtime.capture.model_file import ModelFile, load_model_file
from hplan.runtime.capture.stage import build_stage
from hplan.runtime.capture.trace import bind_inputs, outputs_match, trace_model
from hplan.runtime.contract.errors import PlanMismatchError
from hplan.runtime.contract.plan import TraceMethod, UnitSpec
from tests.fixtures import models as fx

SPLIT_CASES = sorted(
    name for name, case in fx.CASES.items() if case.traceable and name != "untied_lm_q3"
)
EXAMPLES = ["gpt", "mlp", "hf_gpt2"]


@cache
def _model_file(name: str, directory: Path) -> ModelFile:
    if name in EXAMPLES:
        if name == "hf_gpt2":
            pytest.importorskip("transformers")
        return fx.example_model_file(name)
    return load_model_file(fx.write_model_file(directory, name))


@cache
def _graph(model_file: ModelFile) -> ModelGraph:
    return build_model_graph(model_file, tensors=CaptureTensors.CPU)  # stages run for real


def _setup(name: str, tmp_path: Path, batch_size: int = 3):
    model_file = _model_file(name, tmp_path)
    graph = _graph(model_file)
    torch.manual_seed(0)
    model = model_file.build_model()  # same weights as the graph's (seed 0)
    torch.manual_seed(1)
    inputs = bind_inputs(model, model_file.sample_batch(batch_size)[0])
    return graph, model, inputs


def _cut_choices(name: str, num_units: int) -> list[tuple[int, ...]]:
    cuts = list(range(num_units - 1))
    rng = random.Random(name)
    choices = [(), tuple(cuts)]
    for _ in range(3):
        if cuts:
            choices.append(tuple(sorted(rng.sample(cuts, rng.randint(1, min(3, len(cuts)))))))
    return choices


@pytest.mark.parametrize("name", EXAMPLES + SPLIT_CASES)
def test_chained_stages_equal_eager_forward_and_every_gradient(name, tmp_path):
    graph, model, inputs = _setup(name, tmp_path)
    eager_out, eager_grads = fx.eager_grads(model, inputs)
    assert eager_grads, "the probe loss must reach the parameters"
    units = {u.name: u for u in graph.units}
    for cuts in _cut_choices(name, len(graph.units)):
        run = fx.run_split(graph.traced, graph.units, cuts, inputs)
        for stage in run.stages:  # what a stage holds is what its units list
            listed = {p for u in stage.unit_names for p in units[u].params}
            assert {n for n, _ in stage.canonical_parameters()} == listed
            listed = {b for u in stage.unit_names for b in units[u].buffers}
            assert {n for n, _ in stage.canonical_buffers()} == listed
        assert outputs_match(run.output, eager_out, rtol=0, atol=0), cuts
        assert set(run.grads) == set(eager_grads), cuts
        for param_name, grad in eager_grads.items():
            torch.testing.assert_close(
                run.grads[param_name], grad, rtol=1e-5, atol=1e-6, msg=f"{param_name} {cuts}"
            )


def test_tied_head_weight_has_its_canonical_name(tmp_path):
    graph, _, _ = _setup("gpt", tmp_path)
    assert graph.units[-1].name == "lm_head"
    stages = fx.build_stages(graph.traced, graph.units, [len(graph.units) - 2])
    names = [n for n, _ in stages[-1].canonical_parameters()]
    assert names == ["tok_emb.weight"]
    first = dict(stages[0].canonical_parameters())
    assert first["tok_emb.weight"] is dict(stages[-1].canonical_parameters())["tok_emb.weight"]


def test_shared_buffer_is_copied_into_each_stage_and_never_sent(tmp_path):
    graph, _, inputs = _setup("shared_buffer", tmp_path)
    assert [u.name for u in graph.units] == [f"blocks.{i}" for i in range(4)]
    run = fx.run_split(graph.traced, graph.units, [0, 2], inputs)  # three stages
    assert len(run.stages) == 3
    for stage in run.stages:
        assert [n for n, _ in stage.canonical_buffers()] == ["table"]
    for sent in run.sent:
        assert len(sent) == 1
        assert next(iter(sent.values())).shape == (3, fx.SEQ, fx.WIDTH)
    get_attr = [n.name for n in graph.traced.graph_module.graph.nodes if n.op == "get_attr"]
    assert all(t.name not in get_attr for cut in graph.cuts for t in cut)


def test_stage_ending_with_transpose_or_strided_slice_sends_it_unchanged(tmp_path):
    graph, model, inputs = _setup("non_contiguous", tmp_path)
    cuts = list(range(len(graph.units) - 1))
    run = fx.run_split(graph.traced, graph.units, cuts, inputs)
    sent = [t for s in run.sent for t in s.values()]
    assert any(not t.is_contiguous() for t in sent)
    assert any(t.stride(1) == 2 * t.shape[2] for t in sent)  # the strided slice
    for idx, stage in enumerate(run.stages[1:]):
        received = {n: t.contiguous() for n, t in run.sent[idx].items()}
        assert list(received) == list(stage.recv_names)
    assert torch.equal(run.output, model(**inputs))


def test_boundaries_carry_tensors_of_each_dtype_with_grad_only_for_floats(tmp_path):
    graph, _, inputs = _setup("mixed_dtype_boundary", tmp_path)
    assert [u.name for u in graph.units] == ["make", "use", "head"]
    specs = {t.dtype: t for t in graph.cuts[0]}
    assert set(specs) == {"float32", "int64", "bool"}
    assert [specs[d].requires_grad for d in ("float32", "int64", "bool")] == [True, False, False]
    run = fx.run_split(graph.traced, graph.units, [0], inputs)
    dtypes = {str(t.dtype) for t in run.sent[0].values()}
    assert dtypes == {"torch.float32", "torch.int64", "torch.bool"}


def test_graph_inputs_go_to_every_stage_that_reads_them(tmp_path):
    graph, _, inputs = _setup("mask_and_labels", tmp_path)
    stages = fx.build_stages(graph.traced, graph.units, [0, 1, 2])
    assert [s.input_names for s in stages] == [("x", "mask"), ("mask",), ("mask",), ("labels",)]
    del inputs["labels"]
    received = {}
    for stage in stages[:-1]:
        received = stage(inputs, received)
    with pytest.raises(PlanMismatchError, match=r"units head needs graph input 'labels'"):
        stages[-1](inputs, received)


class _NoisyInput(torch.nn.Module):
    """Random ops on the input alone: cheap, but recomputing them would change values."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noisy = torch.nn.functional.dropout(x, 0.5, training=True) + torch.rand_like(x)
        return (noisy + x.size(0)) @ self.w


@pytest.mark.parametrize("method", [TraceMethod.SYMBOLIC, TraceMethod.EXPORT])
def test_replicable_nodes_are_parameter_free_deterministic_and_not_modules(method):
    traced = trace_model(_NoisyInput(), {"x": torch.randn(2, 4)}, method=method)
    gm = traced.graph_module
    by_name = {n.name: n for n in gm.graph.nodes}
    replicable = replicable_nodes(gm)
    kinds = {str(by_name[n].target) for n in replicable}
    assert any("size" in k for k in kinds), kinds  # x.size(0) depends on the input only
    randoms = [n for n in by_name if "dropout" in n or "rand" in n]
    assert randoms and not set(randoms) & replicable
    assert not any(by_name[n].op in ("placeholder", "call_module") for n in replicable)
    users_of_params = [
        n for n in by_name.values() if any(i.op == "get_attr" for i in n.all_input_nodes)
    ]
    assert users_of_params and not {n.name for n in users_of_params} & replicable


def test_crossing_values_exclude_placeholders_and_replicable_nodes(tmp_path):
    graph, _, _ = _setup("gpt", tmp_path)
    gm = graph.traced.graph_module
    node_unit = node_units(gm, graph.units)
    replicable = replicable_nodes(gm)
    for cut_idx in range(len(graph.units) - 1):
        crossing = crossing_values(graph.graph, node_unit, cut_idx)
        assert len(crossing) == 1
        assert not set(crossing) & replicable
        assert [t.name for t in graph.cuts[cut_idx]] == list(crossing)


def test_plan_mismatches_are_typed_errors(tmp_path):
    graph, _, _ = _setup("mlp", tmp_path)
    traced, units = graph.traced, graph.units
    names = [u.name for u in units]
    ghost = UnitSpec(name="ghost", nodes=("no_such_node",), params=(), buffers=())
    with pytest.raises(PlanMismatchError, match=r"'no_such_node'.*re-run `hplan solve`"):
        build_stage(traced, [*units, ghost], names, recv=(), send=())
    with pytest.raises(PlanMismatchError, match="belongs to no unit"):
        build_stage(traced, units[:-1], names[:-1], recv=(), send=())
    with pytest.raises(PlanMismatchError, match="does not receive"):
        build_stage(traced, units, names[2:], recv=(), send=())
    with pytest.raises(PlanMismatchError, match="'decoder'"):
        build_stage(traced, units, ["decoder"], recv=(), send=())


@pytest.mark.parametrize("method", [TraceMethod.SYMBOLIC, TraceMethod.EXPORT])
@pytest.mark.parametrize("name", ["gpt", "hf_gpt2", "tensor_constants", "shape_ints_at_top"])
def test_stages_run_after_moving_to_another_device(name, method, tmp_path):
    """Nothing of the trace device is baked in: constants move with the stage, factory
    ops follow the inputs (the meta device stands in for a GPU)."""
    model_file = _model_file(name, tmp_path)
    torch.manual_seed(0)
    model = model_file.build_model()
    inputs = bind_inputs(model, model_file.sample_batch(2)[0])
    if method is TraceMethod.SYMBOLIC and name in ("hf_gpt2", "shape_ints_at_top"):
        pytest.skip("not symbolically traceable")
    traced = trace_model(model, inputs, method=method)
    reference = model(**inputs)  # before the move: stages share the model's modules
    expected = reference.logits if hasattr(reference, "logits") else reference
    units, _ = assign_units(traced, _tensor_nodes(traced, inputs))
    stages = fx.build_stages(traced, units, list(range(len(units) - 1)))
    received: dict[str, torch.Tensor] = {}
    on_meta = {n: t.to("meta") for n, t in inputs.items()}
    for stage in stages:
        stage.to("meta")
        received = stage(on_meta, received)
    output = received["output"]
    logits = output.logits if hasattr(output, "logits") else output
    assert logits.device.type == "meta"
    assert logits.shape == expected.shape


def _tensor_nodes(traced, inputs) -> set[str]:
    found: set[str] = set()

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node):
            result = super().run_node(n)
            if isinstance(result, torch.Tensor):
                found.add(n.name)
            return result

    Recorder(traced.graph_module).run(
        *[inputs[n] for n in traced.input_names], enable_io_processing=False
    )
    return found
