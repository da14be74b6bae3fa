"""Roofline cost model: the PlanningProblem it fills and the properties it must keep."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hplan.planner.cost.problem_builder import (
    Numerics,
    RooflineSource,
    UnitTimes,
    build_problem,
    default_micro_batch_sizes,
    optimizer_state_factor,
    roofline_time_s,
    static_memory_bytes,
)
from hplan.planner.frontend.cost_graph import build_model_graph
from hplan.planner.hardware.catalog import CATALOG, resolve_precision
from hplan.planner.hardware.cluster import Device
from hplan.runtime.capture.model_file import ModelFile, load_model_file
from hplan.runtime.contract.errors import ConfigError, ModelFileError
from hplan.runtime.contract.memory import (
    OPTIMIZER_STEP_WORKSPACE,
    USABLE_MEMORY_FRACTION,
    device_reserve_bytes,
    usable_memory_bytes,
)
from hplan.runtime.contract.plan import Precision
from tests.fixtures.clusters import (
    cluster_from_dict,
    cpu_cluster,
    gpu_cluster,
    language_model_graph,
    mixed_cluster,
    stand_in_graph,
    unit_cost,
)

GIB = 2**30


def _custom(name: str, tflops: float, bandwidth_gb_per_s: float, memory_gib: float = 24) -> dict:
    return {
        "custom": name,
        "memory_gib": memory_gib,
        "peak_tflops": tflops,
        "memory_bandwidth_gb_per_s": bandwidth_gb_per_s,
    }


# ----------------------------------------------------------------------------- the problem
def test_problem_has_documented_shapes_and_verifies():
    graph = language_model_graph()
    cluster = mixed_cluster()
    problem = build_problem(graph, cluster, global_batch_size=24)
    d, u, k = 5, 6, 6
    assert problem.micro_batch_sizes == (1, 2, 4, 8, 16, 24)
    assert problem.fwd_time_s.shape == (d, u, k) and problem.bwd_time_s.shape == (d, u, k)
    assert problem.optimizer_time_s.shape == (d, u)
    assert problem.cut_bytes_per_sample.shape == (u - 1,)
    assert problem.device_names == cluster.device_names
    assert problem.device_nodes == ("box-a", "box-a", "box-b", "box-b", "box-b")
    assert problem.device_kinds[-1] == "rtx3060"
    assert problem.unit_names[0] == "embed" and problem.unit_names[-1] == "lm_head"
    # Cuts carry the float32 hidden state (seq 128 x width 64) forward and its gradient back.
    assert np.all(problem.cut_bytes_per_sample == 128 * 64 * 4)
    assert np.all(problem.cut_grad_bytes_per_sample == 128 * 64 * 4)
    problem.verify()


def test_links_come_from_the_cluster():
    problem = build_problem(language_model_graph(), mixed_cluster(), global_batch_size=8)
    bandwidth = problem.bandwidth_bytes_per_s
    assert np.allclose(bandwidth, bandwidth.T)
    assert bandwidth[0, 1] == pytest.approx(31.5e9)  # PCIe 4.0 x16 inside box-a
    assert bandwidth[0, 4] == pytest.approx(1.25e9)  # 10 GbE between the boxes
    assert problem.latency_s[0, 4] == pytest.approx(50e-6)
    assert np.all(np.diag(bandwidth) > 0)


def test_backward_is_about_twice_forward():
    problem = build_problem(language_model_graph(), mixed_cluster(), global_batch_size=8)
    ratio = problem.bwd_time_s / problem.fwd_time_s
    assert np.allclose(ratio, 2.0)


def test_faster_catalog_device_is_never_slower():
    problem = build_problem(
        language_model_graph(), gpu_cluster("rtx4090", "rtx3090", "rtx3060"), global_batch_size=16
    )
    t4090, t3090, t3060 = problem.fwd_time_s
    assert np.all(t4090 <= t3090) and np.all(t3090 <= t3060)
    assert np.all(problem.optimizer_time_s[0] <= problem.optimizer_time_s[2])


_unit_costs = st.builds(
    unit_cost,
    st.just("u"),
    fwd_flops_per_sample=st.floats(0, 1e13),
    param_bytes=st.integers(0, 10**10),
    activation_bytes_per_sample=st.floats(0, 1e9),
    io_bytes_per_sample=st.floats(0, 1e10),
    num_ops=st.integers(0, 1000),
)


@settings(max_examples=40, deadline=None)
@given(
    cost=_unit_costs,
    slow=st.tuples(st.floats(0.01, 500), st.floats(1, 3000)),
    speedup=st.tuples(st.floats(1, 10), st.floats(1, 10)),
)
def test_a_device_faster_in_compute_and_bandwidth_is_never_slower(cost, slow, speedup):
    fast = (slow[0] * speedup[0], slow[1] * speedup[1])
    node = {"name": "n", "host": "n", "devices": [_custom("slow", *slow), _custom("fast", *fast)]}
    problem = build_problem(
        stand_in_graph([cost]), cluster_from_dict({"nodes": [node]}), global_batch_size=8
    )
    assert np.all(problem.fwd_time_s[1] <= problem.fwd_time_s[0])
    assert np.all(problem.bwd_time_s[1] <= problem.bwd_time_s[0])
    assert problem.optimizer_time_s[1, 0] <= problem.optimizer_time_s[0, 0]


@settings(max_examples=40, deadline=None)
@given(cost=_unit_costs, device=st.sampled_from(sorted(CATALOG)), dtype=st.sampled_from(
    ["float32", "bfloat16", "float16"]
))  # fmt: skip
def test_time_per_sample_does_not_grow_with_micro_batch_size(cost, device, dtype):
    graph = stand_in_graph([cost], param_dtype=dtype)
    problem = build_problem(graph, gpu_cluster(device), global_batch_size=64)
    sizes = np.array(problem.micro_batch_sizes, dtype=float)
    for times in (problem.fwd_time_s[0, 0], problem.bwd_time_s[0, 0]):
        per_sample = times / sizes
        assert np.all(np.diff(per_sample) <= 1e-12 * per_sample[:-1] + 1e-300)


def test_memory_grows_with_micro_batch_size():
    problem = build_problem(language_model_graph(), cpu_cluster(2), global_batch_size=16)
    sizes = np.array(problem.micro_batch_sizes)
    for u in range(problem.num_units):
        needed = problem.static_memory_bytes[u] + problem.activation_bytes_per_sample[u] * sizes
        assert np.all(np.diff(needed) > 0)


def test_logits_heavy_head_costs_more_than_a_block_and_the_embedding():
    """Case Q3: vocab 32000, width 64, seq 128, untied. Embedding and head have the same
    parameter count, yet the head costs far more time and memory: costs come from time and
    memory, not from parameter counts."""
    graph = language_model_graph(vocab_size=32000, width=64, seq_len=128, num_blocks=4)
    costs = {c.name: c for c in graph.unit_costs}
    assert costs["embed"].param_bytes == costs["lm_head"].param_bytes
    problem = build_problem(graph, gpu_cluster("rtx3090", "rtx3090"), global_batch_size=8)
    idx = {name: i for i, name in enumerate(problem.unit_names)}
    head, block, embed = idx["lm_head"], idx["blocks.0"], idx["embed"]
    acts = problem.activation_bytes_per_sample
    assert acts[head] > 10 * acts[block]
    assert acts[head] >= 128 * 32000 * 4  # the logits (seq x vocab, float32) are charged
    for times in (problem.fwd_time_s, problem.bwd_time_s):
        assert np.all(times[:, head, :] > times[:, embed, :])
        # Blocks have more ops (launch overhead); once the batch is big, the logits win.
        assert np.all(times[:, head, -1] > times[:, block, -1])


# ----------------------------------------------------------------------------- memory
def test_static_memory_counts_weights_gradients_state_frozen_params_and_buffers():
    cost = unit_cost("u", param_bytes=1000, trainable_param_bytes=600, buffer_bytes=50)
    # weights, gradients, state; the gradient bucket copy; the optimizer step's temporaries
    step = OPTIMIZER_STEP_WORKSPACE * 600
    assert static_memory_bytes(cost, 2.0) == pytest.approx(600 * 4 + 400 + 50 + 600 + step)
    assert static_memory_bytes(cost, 0.0) == 600 * 2 + 400 + 50 + 600  # SGD: no temporaries
    problem = build_problem(
        stand_in_graph([cost, cost]),
        cpu_cluster(1),
        global_batch_size=2,
        optimizer_state_bytes_per_param_byte=0.0,
    )
    assert list(problem.static_memory_bytes) == [2250, 2250]
    assert list(problem.grad_bytes) == [600, 600]


def test_autocast_copies_only_weights_wider_than_its_dtype():
    """float32 weights under bf16 autocast get a bf16 copy (half their bytes); bf16 weights
    are used as they are (what ``contract.memory`` counts): no copy."""
    cost = unit_cost("u", param_bytes=1000, trainable_param_bytes=1000, buffer_bytes=0)
    plain = static_memory_bytes(cost, 2.0)
    fp32 = static_memory_bytes(cost, 2.0, Numerics("float32", Precision.BF16))
    bf16 = static_memory_bytes(cost, 2.0, Numerics("bfloat16", Precision.BF16))
    assert fp32 == pytest.approx(plain + 500)
    assert bf16 == pytest.approx(plain)


def test_usable_memory_subtracts_the_reserve_then_keeps_a_fraction():
    gpu = CATALOG["rtx3090"]
    expected = (24 * GIB - device_reserve_bytes(gpu.key)) * USABLE_MEMORY_FRACTION
    assert usable_memory_bytes(gpu.memory_bytes, gpu.key) == pytest.approx(expected)
    assert usable_memory_bytes(gpu.memory_bytes, gpu.key) < 24 * GIB * USABLE_MEMORY_FRACTION
    cpu = CATALOG["cpu"]
    expected_cpu = (4 * GIB - device_reserve_bytes(cpu.key)) * USABLE_MEMORY_FRACTION
    assert usable_memory_bytes(cpu.memory_bytes, cpu.key) == pytest.approx(expected_cpu)


def test_usable_memory_of_a_tiny_device_is_zero_not_negative():
    node = {"name": "n", "host": "n", "devices": [_custom("tiny", 1, 10, memory_gib=0.5)]}
    problem = build_problem(
        stand_in_graph([unit_cost("u")]), cluster_from_dict({"nodes": [node]}), global_batch_size=1
    )
    assert problem.memory_capacity_bytes[0] == 0.0


def test_optimizer_time_is_memory_bound_and_grows_with_state():
    graph = stand_in_graph([unit_cost("u", param_bytes=10**9)])
    cluster = gpu_cluster("rtx3090")
    adam = build_problem(graph, cluster, global_batch_size=1).optimizer_time_s[0, 0]
    sgd = build_problem(
        graph, cluster, global_batch_size=1, optimizer_state_bytes_per_param_byte=0.0
    ).optimizer_time_s[0, 0]
    # AdamW moves 7 bytes per parameter byte, plain SGD 3, at 80% of 936 GB/s.
    assert adam == pytest.approx(7e9 / (0.8 * 936e9))
    assert sgd == pytest.approx(3e9 / (0.8 * 936e9))


# ----------------------------------------------------------------------------- formulas and inputs
def test_roofline_takes_the_slower_of_compute_and_memory_plus_op_overhead():
    compute_bound = roofline_time_s(
        flops=1e12, num_bytes=1e6, num_ops=0, peak_flops_per_s=1e12,
        memory_bandwidth_bytes_per_s=1e9, compute_efficiency=0.5, memory_efficiency=1.0,
    )  # fmt: skip
    memory_bound = roofline_time_s(
        flops=1e6, num_bytes=1e9, num_ops=10, peak_flops_per_s=1e12,
        memory_bandwidth_bytes_per_s=1e9, memory_efficiency=0.5, op_overhead_s=1e-3,
    )  # fmt: skip
    assert compute_bound == pytest.approx(2.0)
    assert memory_bound == pytest.approx(2.0 + 10e-3)


def test_bfloat16_uses_the_tensor_core_peak():
    big = unit_cost("u", fwd_flops_per_sample=1e13, param_bytes=0, io_bytes_per_sample=0, num_ops=0)
    cluster = gpu_cluster("a100-80gb")
    fp32 = build_problem(stand_in_graph([big]), cluster, global_batch_size=1).fwd_time_s
    bf16 = build_problem(
        stand_in_graph([big], param_dtype="bfloat16"), cluster, global_batch_size=1
    ).fwd_time_s
    assert fp32[0, 0, 0] / bf16[0, 0, 0] == pytest.approx(312 / 19.5, rel=1e-3)


def _conv_unit_s(device: str, precision: Precision, channels_first_bytes: float) -> float:
    """Forward seconds of a unit of convolutions only (1 TFLOP per sample, 8 samples)."""
    conv = replace(
        unit_cost("conv", fwd_flops_per_sample=1e12, param_bytes=0, io_bytes_per_sample=0,
                  num_ops=0),
        conv_flops_per_sample=1e12,
        channels_first_conv_io_bytes_per_sample=channels_first_bytes,
    )  # fmt: skip
    dev = Device(name="d", node="n", local_index=0, type=CATALOG[device])
    return RooflineSource().unit_times(dev, conv, 8, Numerics("float32", precision)).fwd_time_s


@pytest.mark.parametrize(
    ("device", "precision", "transposes_s"),
    [
        # TF32 tensor cores (8x the A100's fp32 peak) win despite the transposes: 2 passes
        # over 1 GB per sample x 8 samples at 0.8 x 2039 GB/s
        ("a100-80gb", Precision.TF32, 2 * 8e9 / (0.8 * 2039e9)),
        ("a100-80gb", Precision.FP32, 2 * 8e9 / (0.8 * 2039e9)),  # cuDNN's TF32 default
        ("a100-80gb", Precision.BF16, 2 * 4e9 / (0.8 * 2039e9)),  # half-precision bytes
        ("rtx3090", Precision.TF32, 0.0),  # TF32 peak = fp32 peak: CUDA cores, no transposes
        ("v100-16gb", Precision.FP32, 0.0),  # Volta has no TF32
        ("cpu", Precision.FP32, 0.0),
    ],
)
def test_channels_first_convolutions_pay_transposes_where_tensor_cores_are_faster(
    device, precision, transposes_s
):
    """cuDNN transposes channels-first tensors around tensor-core convolutions (two passes
    over the convolutions' activation input and output bytes, at memory speed), and picks
    CUDA cores where those are no slower."""
    channels_first_s = _conv_unit_s(device, precision, channels_first_bytes=1e9)
    channels_last_s = _conv_unit_s(device, precision, channels_first_bytes=0.0)
    assert channels_first_s - channels_last_s == pytest.approx(transposes_s)


@pytest.mark.parametrize("device", ["a100-80gb", "rtx3090", "rtx4090", "l4", "v100-16gb"])
@pytest.mark.parametrize("channels_first_bytes", [0.0, 1e9, 1e11])
def test_convolutions_in_tf32_are_never_predicted_slower_than_in_fp32(device, channels_first_bytes):
    tf32_s = _conv_unit_s(device, Precision.TF32, channels_first_bytes)
    fp32_s = _conv_unit_s(device, Precision.FP32, channels_first_bytes)
    assert tf32_s <= fp32_s * (1 + 1e-12)


@pytest.mark.parametrize(
    ("global_batch_size", "expected"),
    [(1, (1,)), (16, (1, 2, 4, 8, 16)), (24, (1, 2, 4, 8, 16, 24)), (3, (1, 2, 3))],
)
def test_default_micro_batch_sizes_are_powers_of_two_plus_the_global_batch(
    global_batch_size, expected
):
    assert default_micro_batch_sizes(global_batch_size) == expected


def test_given_micro_batch_sizes_are_sorted_and_deduplicated():
    problem = build_problem(
        language_model_graph(), cpu_cluster(2), global_batch_size=8, micro_batch_sizes=[3, 1, 3]
    )
    assert problem.micro_batch_sizes == (1, 3)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"global_batch_size": 0},
        {"global_batch_size": 4, "micro_batch_sizes": [8]},
        {"global_batch_size": 4, "micro_batch_sizes": [0, 1]},
        {"global_batch_size": 4, "micro_batch_sizes": []},
        {"global_batch_size": 4, "optimizer_state_bytes_per_param_byte": -1.0},
    ],
)
def test_bad_batch_settings_raise_config_error(kwargs):
    with pytest.raises(ConfigError) as info:
        build_problem(language_model_graph(), cpu_cluster(2), **kwargs)
    assert info.value.exit_code == 2


def test_param_dtype_without_a_peak_raises_config_error():
    graph = stand_in_graph([unit_cost("u")], param_dtype="float64")
    with pytest.raises(ConfigError, match="float64"):
        build_problem(graph, cpu_cluster(1), global_batch_size=1)


@dataclass
class _FixedSource:
    """A stand-in for a measured profile: fixed times, records what it was asked."""

    calls: list[tuple[str, str, int]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return "measured-test"

    def unit_times(self, device, cost, micro_batch_size, numerics):
        self.calls.append((device.name, cost.name, micro_batch_size))
        return UnitTimes(fwd_time_s=0.001 * micro_batch_size, bwd_time_s=0.002 * micro_batch_size)

    def optimizer_time_s(self, device, cost, optimizer_state_bytes_per_param_byte):
        return 0.5

    def time_spread(self, device):
        return 0.0


def test_a_measured_time_source_replaces_the_roofline():
    source = _FixedSource()
    graph = language_model_graph(num_blocks=2)
    problem = build_problem(graph, cpu_cluster(2), global_batch_size=4, time_source=source)
    assert np.allclose(problem.fwd_time_s[:, :, -1], 0.004)
    assert np.allclose(problem.bwd_time_s[:, :, 0], 0.002)
    assert np.all(problem.optimizer_time_s == 0.5)
    assert len(source.calls) == 2 * 4 * 3
    assert source.name != RooflineSource().name == "roofline"


# ----------------------------------------------------------------------------- optimizer state
def _model_file(make_optimizer) -> ModelFile:
    return ModelFile(
        path=Path("model.py"),
        sha256="0" * 64,
        build_model=lambda: torch.nn.Linear(2, 2),
        sample_batch=lambda n: (torch.zeros(n, 2), torch.zeros(n, 2)),
        loss_fn=lambda out, target: (out - target).pow(2).mean(),
        make_optimizer=make_optimizer,
        dataset=None,
        leaf_modules=(),
    )


@pytest.mark.parametrize(
    ("make_optimizer", "expected"),
    [
        (lambda params: torch.optim.AdamW(params, lr=1e-3), 2.0),
        (lambda params: torch.optim.Adam(params, lr=1e-3), 2.0),
        (lambda params: torch.optim.SGD(params, lr=0.1), 0.0),
        (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), 1.0),
        (None, 2.0),  # the convention's default optimizer is AdamW
    ],
)
def test_optimizer_state_factor_measures_state_bytes_per_parameter_byte(make_optimizer, expected):
    assert optimizer_state_factor(_model_file(make_optimizer)) == pytest.approx(expected)


def test_optimizer_state_factor_in_bfloat16():
    make = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    assert optimizer_state_factor(_model_file(make), param_dtype="bfloat16") == pytest.approx(2.0)


def test_broken_make_optimizer_raises_model_file_error():
    with pytest.raises(ModelFileError, match="make_optimizer"):
        optimizer_state_factor(_model_file(lambda params: "not an optimizer"))
    with pytest.raises(ModelFileError, match="make_optimizer"):
        optimizer_state_factor(_model_file(lambda params: torch.optim.LBFGS(params)))


# ----------------------------------------------------------------------------- traced models
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

_Q3_MODEL = """
import torch
from torch import nn

VOCAB, WIDTH, SEQ = 32000, 64, 128


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model():
    return LM()


def sample_batch(batch_size):
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
"""


def _traced_graph(path: Path):
    model_file = load_model_file(path)
    return model_file, build_model_graph(model_file)


def test_gpt_example_plans_on_the_mixed_cluster():
    model_file, graph = _traced_graph(EXAMPLES / "gpt" / "model.py")
    factor = optimizer_state_factor(model_file)
    problem = build_problem(
        graph, mixed_cluster(), global_batch_size=16, optimizer_state_bytes_per_param_byte=factor
    )
    assert factor == pytest.approx(2.0)
    assert problem.num_units == len(graph.units) and problem.num_devices == 5
    blocks = [i for i, name in enumerate(problem.unit_names) if name.startswith("blocks.")]
    assert len(blocks) >= 2
    # Identical blocks cost the same; the 4090 is faster than the 3060 on every unit.
    assert np.allclose(problem.fwd_time_s[:, blocks[0]], problem.fwd_time_s[:, blocks[-1]])
    assert np.all(problem.fwd_time_s[0] <= problem.fwd_time_s[4])
    assert np.all(problem.static_memory_bytes > 0)
    assert np.all(problem.cut_bytes_per_sample > 0)


def test_traced_logits_heavy_head_is_charged_its_logits(tmp_path):
    """Case Q3 on a real traced model: vocab 32000, width 64, seq 128, untied."""
    path = tmp_path / "model.py"
    path.write_text(_Q3_MODEL, encoding="utf-8")
    _, graph = _traced_graph(path)
    problem = build_problem(graph, gpu_cluster("rtx3090", "rtx3090"), global_batch_size=8)
    names = list(problem.unit_names)
    head, embed = names.index("head"), names.index("embed")
    block = names.index("blocks.0")
    acts = problem.activation_bytes_per_sample
    assert acts[head] >= 128 * 32000 * 4
    assert acts[head] > 10 * acts[block]
    assert problem.static_memory_bytes[head] == pytest.approx(problem.static_memory_bytes[embed])
    assert np.all(problem.fwd_time_s[:, head, :] > problem.fwd_time_s[:, embed, :])
    assert np.all(problem.fwd_time_s[:, head, -1] > problem.fwd_time_s[:, block, -1])


def test_tied_parameters_sync_in_one_group_as_the_runtime_buckets_them(tmp_path):
    # GPT-2 ties its token embedding to its LM head: with the two on different stages,
    # every holder of either unit sums that gradient in one all-reduce. The cost model's
    # groups must be the plan's (the runtime's) groups, for pipelines and mixed replicas.
    from hplan.planner.api import SolveRequest, Strategy, plan_training
    from hplan.planner.cost.evaluate import grad_sync_groups

    root = Path(__file__).resolve().parents[2]
    cluster = tmp_path / "four.yaml"
    cluster.write_text(
        "name: four\nnodes:\n  - name: box\n    host: 127.0.0.1\n    devices:\n"
        "      - type: cpu\n        count: 2\n      - type: cpu\n        count: 2\n"
        "        memory_gb: 0.366\n"
    )
    spans_stages = False
    for strategy in (Strategy.HPLAN, Strategy.UNIFORM_PIPELINE):
        request = SolveRequest(
            model_path=root / "examples" / "gpt" / "model.py",
            cluster_path=cluster,
            global_batch_size=24,
            strategy=strategy,
        )
        outcome = plan_training(request)
        problem, layout, plan = outcome.problem, outcome.result.layout, outcome.plan
        assert [t.units[0] for t in problem.tied_params] == [0]  # tok_emb, tied to lm_head
        rank_of = {problem.device_names.index(r.device): r.rank for r in plan.ranks}
        modelled = {
            tuple(sorted(rank_of[d] for d in devices)): num_bytes
            for devices, num_bytes in grad_sync_groups(problem, layout).items()
        }
        assert modelled == {g.ranks: float(g.num_bytes) for g in plan.report.grad_sync}
        stages = {r.rank: (r.replica, r.stage) for r in plan.ranks}
        spans_stages |= any(
            len({stages[r] for r in ranks}) > len({stages[r][0] for r in ranks})
            for ranks in modelled
        )
    assert spans_stages  # some group holds two stages of one replica: the tie


@pytest.mark.parametrize(
    ("units", "num_bytes", "message"),
    [
        ((1,), 1.0, "must be >= 2 ascending"),
        ((1, 0), 1.0, "must be >= 2 ascending"),
        ((0, 9), 1.0, "must be >= 2 ascending"),
        ((0, 1), float("nan"), "must be finite"),
        ((0, 1), 1e30, "exceed a unit's grad_bytes"),
    ],
)
def test_a_problem_refuses_tied_parameters_it_cannot_hold(units, num_bytes, message):
    from dataclasses import replace

    from hplan.planner.cost.problem import TiedParams
    from tests.fixtures.problems import Dev, make_problem

    problem = make_problem(
        [Dev("box", 1.0, 8e9)], unit_work=[1.0, 1.0, 1.0], global_batch_size=4, grad_bytes=10.0
    )
    with pytest.raises(ValueError, match=message):
        replace(problem, tied_params=(TiedParams(units, num_bytes),)).verify()


# --------------------------------------------------------------------------- precision
@pytest.mark.parametrize(
    ("kind", "auto"),
    [("rtx3090", Precision.BF16), ("a100-80gb", Precision.BF16), ("v100-32gb", Precision.FP16),
     ("t4", Precision.FP16), ("cpu", Precision.FP32)],
)  # fmt: skip
def test_auto_precision_follows_the_tensor_cores(kind, auto):
    assert resolve_precision("auto", CATALOG[kind], device_name="d") is auto
    if auto is Precision.BF16:  # Ampere and later have TF32
        assert resolve_precision("tf32", CATALOG[kind], device_name="d") is Precision.TF32
    else:
        with pytest.raises(ConfigError, match="has no TF32; use --precision fp32"):
            resolve_precision("tf32", CATALOG[kind], device_name="d")


def test_bf16_on_a_card_without_bf16_tensor_cores_says_what_to_use():
    with pytest.raises(ConfigError, match=r"d/0 \(.*T4.*\) has no bf16 tensor cores.*fp16"):
        resolve_precision("bf16", CATALOG["t4"], device_name="d/0")
    with pytest.raises(ConfigError, match="'int8' is not one of auto, fp32"):
        resolve_precision("int8", CATALOG["t4"], device_name="d/0")


def test_bf16_autocast_runs_matmuls_at_the_bf16_peak_and_halves_activation_bytes():
    cost = unit_cost("u", fwd_flops_per_sample=1e12, io_bytes_per_sample=1e3, num_ops=0)
    graph = stand_in_graph([cost, cost], cut_numel_per_sample=1000)
    cluster = gpu_cluster("a100-80gb")
    fp32 = build_problem(graph, cluster, global_batch_size=4)
    bf16 = build_problem(
        graph, cluster, global_batch_size=4, precisions={"node0/0": Precision.BF16}
    )
    tf32 = build_problem(
        graph, cluster, global_batch_size=4, precisions={"node0/0": Precision.TF32}
    )
    a100 = CATALOG["a100-80gb"]
    # Compute-bound: the time ratio is the peak ratio.
    ratio = fp32.fwd_time_s[0, 0, -1] / bf16.fwd_time_s[0, 0, -1]
    assert ratio == pytest.approx(a100.bf16_flops_per_s / a100.fp32_flops_per_s, rel=1e-3)
    ratio = fp32.fwd_time_s[0, 0, -1] / tf32.fwd_time_s[0, 0, -1]
    assert ratio == pytest.approx(a100.tf32_flops_per_s / a100.fp32_flops_per_s, rel=1e-3)
    assert bf16.activation_bytes_per_sample[0] == fp32.activation_bytes_per_sample[0] / 2
    assert bf16.cut_bytes_per_sample[0] == fp32.cut_bytes_per_sample[0] / 2 == 2000
    # AMP keeps fp32 weights, gradients and Adam moments (16 bytes per parameter) and
    # adds autocast's bf16 copy of the weights (2 more).
    assert fp32.static_memory_bytes[0] == pytest.approx(
        cost.param_bytes * (5 + OPTIMIZER_STEP_WORKSPACE)
    )
    # autocast keeps a half-precision copy of the weights for the forward
    assert bf16.static_memory_bytes[0] == pytest.approx(
        fp32.static_memory_bytes[0] + cost.param_bytes * 0.5
    )
    assert tf32.static_memory_bytes[0] == fp32.static_memory_bytes[0]


# --------------------------------------------------------------------------- all-reduce
@pytest.mark.parametrize(
    ("bandwidth", "exposed_s"),
    [
        # 100 MiB over 2 ranks: 0.1048576 s of rings at 1 GB/s; a 0.2 s backward hides all
        # but the last 25 MiB bucket (0.0262144 s) ...
        (1e9, 0.0262144),
        # ... at 0.25 GB/s the rings take 0.4194304 s, 0.15 s of them under the backward
        # (the part after the first bucket is out: 0.2 s * (1 - 25/100))
        (0.25e9, 0.4194304 - 0.15),
    ],
)
def test_the_all_reduce_overlaps_the_last_backward_but_for_the_last_bucket(bandwidth, exposed_s):
    from hplan.planner.cost.evaluate import evaluate
    from hplan.planner.cost.layout import Layout, ReplicaLayout, StageLayout
    from tests.fixtures.problems import Dev, make_problem

    problem = make_problem(
        [Dev("box", 1.0, 80e9), Dev("box", 1.0, 80e9)],
        unit_work=[0.1],  # forward 0.1 s, backward 0.2 s per sample
        global_batch_size=2,
        micro_batch_sizes=(1,),
        grad_bytes=[100 * 2**20],
        intra_bandwidth=bandwidth,
        latency_s=0.0,
    )
    layout = Layout(tuple(ReplicaLayout((StageLayout(d, 0, 1),), 1, 1, 1) for d in (0, 1)))
    result = evaluate(problem, layout)
    assert result.allreduce_time_s == pytest.approx(exposed_s)
    assert result.step_time_s == pytest.approx(0.3 + exposed_s)
