"""The model's tensor-parallel plan at capture: read from TP_PLAN or a Hugging Face model,
what it splits in each unit (bytes, FLOPs, collectives, worked out by hand), its largest
degree, why it is refused, and its round trip through the capture file and the plan."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest
import torch

from hplan.planner.emit.plan_build import model_spec
from hplan.planner.frontend.capture_file import capture_record, load_capture
from hplan.planner.frontend.cost_graph import ModelGraph, build_model_graph
from hplan.planner.frontend.tp_costs import UnitTensorParallel
from hplan.planner.frontend.tp_plan import NO_PLAN, hf_tp_plan, read_tp_plan
from hplan.planner.frontend.trains_check import TrainsVerdict
from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.contract.errors import ModelFileError
from hplan.runtime.contract.plan import TpRule, TpStyle
from tests.fixtures.plans import GPT_MODEL, write_model

FLOAT_BYTES = 4

# A block with separate q, k, v projections viewed into heads and an MLP; TP_PLAN and the
# head count come from the environment-free placeholders below.
TINY = """
    import torch
    import torch.nn.functional as F
    from torch import nn

    WIDTH, SEQ, HEADS = 16, 4, {heads}
    TP_PLAN = {plan}
    LEAF_MODULES = {leaves}


    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(WIDTH, WIDTH)
            self.k = nn.Linear(WIDTH, WIDTH)
            self.v = nn.Linear(WIDTH, WIDTH)
            self.o = nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            b, s, w = x.shape
            q = self.q(x).view(b, s, HEADS, w // HEADS).transpose(1, 2)
            k = self.k(x).view(b, s, HEADS, w // HEADS).transpose(1, 2)
            v = self.v(x).view(b, s, HEADS, w // HEADS).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v)
            return x + self.o(y.transpose(1, 2).reshape(b, s, w))


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attention()
            self.norm = nn.LayerNorm(WIDTH)
            self.fc1 = nn.Linear(WIDTH, {hidden})
            self.fc2 = nn.Linear({hidden}, WIDTH)

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(self.norm(self.attn(x)))))


    def build_model():
        return Net()


    def sample_batch(n):
        return torch.randn(n, SEQ, WIDTH), torch.randn(n, SEQ, WIDTH)


    def loss_fn(out, y):
        return ((out - y) ** 2).mean()
"""

MEGATRON = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise"}

LLAMA = """
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    VOCAB, SEQ = 256, 16


    def build_model():
        config = LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, use_cache=False,
        )
        {edit}
        return LlamaForCausalLM(config)


    def sample_batch(n):
        tokens = torch.randint(0, VOCAB, (n, SEQ + 1))
        return {{"input_ids": tokens[:, :-1]}}, tokens[:, 1:]


    def loss_fn(outputs, targets):
        return F.cross_entropy(outputs.logits.reshape(-1, VOCAB), targets.reshape(-1))
"""


def _tiny(
    tmp_path: Path,
    plan: dict[str, str] | None = None,
    *,
    heads: int = 2,
    hidden: int = 32,
    leaves: tuple[str, ...] = (),
) -> Path:
    source = TINY.format(plan=plan, heads=heads, hidden=hidden, leaves=list(leaves))
    return write_model(tmp_path, source)


def _graph(path: Path) -> ModelGraph:
    graph = build_model_graph(load_model_file(path))
    graph.verify()
    return graph


def _refused(graph: ModelGraph) -> str:
    """The refusal, after checking a refused graph splits nothing."""
    assert graph.tp_plan == () and graph.tp_max_degree == 1
    assert all(cost.tp is None for cost in graph.unit_costs)
    assert graph.tp_refusal is not None and "\n" not in graph.tp_refusal
    return graph.tp_refusal


# ----------------------------------------------------------------------- the GPT example
@pytest.mark.parametrize(("width", "seq"), [(64, 64), (32, 16)])
def test_gpt_example_splits_its_mlps_embedding_and_head_as_worked_out_by_hand(
    width, seq, monkeypatch
):
    monkeypatch.setenv("HPLAN_GPT_WIDTH", str(width))
    monkeypatch.setenv("HPLAN_GPT_SEQ", str(seq))
    monkeypatch.setenv("HPLAN_GPT_LAYERS", "2")
    vocab = 256
    graph = _graph(GPT_MODEL)
    costs = {c.name: c for c in graph.unit_costs}
    assert graph.tp_refusal is None and graph.tp_max_degree == 8  # 256 and 4 * width
    assert graph.tp_plan == (
        TpRule(pattern="tok_emb", style=TpStyle.ROWWISE_REP),
        TpRule(pattern="blocks.*.mlp.0", style=TpStyle.COLWISE),
        TpRule(pattern="blocks.*.mlp.2", style=TpStyle.ROWWISE),
        TpRule(pattern="lm_head", style=TpStyle.COLWISE_REP),
    )
    hidden = seq * width * FLOAT_BYTES  # one sample's residual stream
    assert costs["tok_emb"].tp == UnitTensorParallel(
        split_param_bytes=vocab * width * FLOAT_BYTES,
        split_flops_per_sample=0.0,
        split_activation_bytes_per_sample=0.0,  # it saves the token ids, whole
        fwd_allreduce_bytes_per_sample=hidden / 2,  # split by features, gathered
        bwd_allreduce_bytes_per_sample=0.0,  # token ids need no gradient
        num_allreduces=1,
    )
    for block in ("blocks.0", "blocks.1"):
        assert costs[block].tp == UnitTensorParallel(
            # mlp.0's weight and bias, mlp.2's weight (its bias stays whole)
            split_param_bytes=(4 * width * width + 4 * width + width * 4 * width) * FLOAT_BYTES,
            split_flops_per_sample=2 * (2 * seq * width * 4 * width),
            # GELU's input and mlp.2's input, each (seq, 4 width); mlp.0 saves its whole input
            split_activation_bytes_per_sample=2 * seq * 4 * width * FLOAT_BYTES,
            fwd_allreduce_bytes_per_sample=hidden,  # mlp.2's output
            bwd_allreduce_bytes_per_sample=hidden,  # mlp.0's input gradient
            num_allreduces=2,
        )
    assert costs["lm_head"].tp == UnitTensorParallel(
        split_param_bytes=vocab * width * FLOAT_BYTES,  # the embedding's weight, tied
        split_flops_per_sample=2 * seq * width * vocab,
        split_activation_bytes_per_sample=0.0,
        fwd_allreduce_bytes_per_sample=seq * vocab * FLOAT_BYTES / 2,  # logits gathered
        bwd_allreduce_bytes_per_sample=hidden,
        num_allreduces=2,
    )
    for whole in ("pos_emb", "ln_f"):
        assert costs[whole].tp is None
    assert graph.tp_split_cuts == ()  # each MLP pair inside one block unit


def test_an_odd_vocabulary_refuses_tp_naming_the_dimension(monkeypatch):
    monkeypatch.setenv("HPLAN_GPT_VOCAB", "257")
    monkeypatch.setenv("HPLAN_GPT_LAYERS", "1")
    monkeypatch.setenv("HPLAN_GPT_SEQ", "8")
    refusal = _refused(_graph(GPT_MODEL))
    assert "tok_emb rows 257" in refusal and "no tensor-parallel degree" in refusal


# ----------------------------------------------------------------------- Hugging Face
@pytest.fixture(scope="module")
def llama_graph(tmp_path_factory: pytest.TempPathFactory) -> ModelGraph:
    pytest.importorskip("transformers")
    path = write_model(tmp_path_factory.mktemp("llama"), LLAMA.format(edit="pass"))
    return _graph(path)


def test_a_hugging_face_llama_brings_its_own_plan_prefixed_with_its_base_model(llama_graph):
    rules = {rule.pattern: rule.style for rule in llama_graph.tp_plan}
    assert rules["model.layers.*.self_attn.q_proj"] is TpStyle.COLWISE
    assert rules["model.layers.*.self_attn.o_proj"] is TpStyle.ROWWISE
    assert rules["model.layers.*.mlp.down_proj"] is TpStyle.ROWWISE
    assert rules["lm_head"] is TpStyle.COLWISE_REP  # the class's colwise_gather_output
    assert rules["model.embed_tokens"] is TpStyle.ROWWISE_REP  # transformers' vocab split
    # 8 divides every feature count, but the config has 2 key/value heads
    assert llama_graph.tp_refusal is None and llama_graph.tp_max_degree == 2


def test_a_llama_layer_has_megatrons_two_allreduces_each_way(llama_graph):
    hidden, inter, kv, seq, vocab = 64, 128, 32, 16, 256
    costs = {c.name: c for c in llama_graph.unit_costs}
    for layer in ("model.layers.0", "model.layers.1"):
        cost = costs[layer]
        tp = cost.tp
        assert tp is not None
        assert (
            tp.split_param_bytes == (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter) * 4
        )
        assert tp.split_flops_per_sample == cost.fwd_flops_per_sample  # norms count no FLOPs
        assert 0 < tp.split_activation_bytes_per_sample < cost.activation_bytes_per_sample
        assert tp.fwd_allreduce_bytes_per_sample == 2 * seq * hidden * 4  # o_proj, down_proj
        assert tp.bwd_allreduce_bytes_per_sample == 2 * seq * hidden * 4  # q/k/v, gate/up inputs
        assert tp.num_allreduces == 4
    embed, head = costs["model.embed_tokens"].tp, costs["lm_head"].tp
    assert embed is not None and head is not None
    assert embed.split_param_bytes == head.split_param_bytes == vocab * hidden * 4
    assert (embed.fwd_allreduce_bytes_per_sample, embed.num_allreduces) == (seq * hidden * 2, 1)
    assert head.fwd_allreduce_bytes_per_sample == seq * vocab * 4 / 2
    assert costs["model.norm"].tp is None


def test_a_hugging_face_style_hplan_cannot_run_refuses_tp(tmp_path):
    pytest.importorskip("transformers")
    edit = 'config.base_model_tp_plan = {"layers.*.mlp.gate_proj": "local_colwise"}'
    path = write_model(tmp_path, LLAMA.format(edit=edit))
    model_file = load_model_file(path)
    with torch.device("meta"):
        plan = read_tp_plan(model_file, model_file.build_model())
    assert plan.rules == () and plan.refusal is not None
    assert "'local_colwise'" in plan.refusal and "model.layers.*.mlp.gate_proj" in plan.refusal


class _Config:
    base_model_tp_plan: ClassVar = {"layers.*.fc": "colwise", "layers.*.out": "rowwise"}


class _Base(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))


class _ForCausalLM(torch.nn.Module):
    """What transformers' models look like to :func:`hf_tp_plan` where the library has not
    merged the plans on the instance (its class's ``_tp_plan`` is all the instance has)."""

    _tp_plan: ClassVar = {"lm_head": "colwise_gather_output"}
    base_model_prefix = "model"

    def __init__(self) -> None:
        super().__init__()
        self.config = _Config()
        self.model = _Base()
        self.lm_head = torch.nn.Linear(4, 8)

    @property
    def base_model(self) -> torch.nn.Module:
        return self.model


def test_a_base_model_plan_is_prefixed_with_the_base_model_path():
    assert hf_tp_plan(_ForCausalLM()) == {
        "lm_head": "colwise_gather_output",
        "model.layers.*.fc": "colwise",
        "model.layers.*.out": "rowwise",
    }
    assert hf_tp_plan(_Base()) == {}


def test_a_colwise_module_without_a_rowwise_partner_is_gathered(tmp_path):
    seq, width, hidden = 4, 16, 32
    costs = {c.name: c for c in _graph(_tiny(tmp_path, {"fc1": "colwise"})).unit_costs}
    assert costs["fc1"].tp == UnitTensorParallel(
        split_param_bytes=(hidden * width + hidden) * FLOAT_BYTES,
        split_flops_per_sample=2 * seq * width * hidden,
        split_activation_bytes_per_sample=0.0,  # GELU reads the gathered output
        fwd_allreduce_bytes_per_sample=seq * hidden * FLOAT_BYTES / 2,
        bwd_allreduce_bytes_per_sample=seq * width * FLOAT_BYTES,
        num_allreduces=2,
    )


def test_a_cut_between_a_column_split_and_its_row_split_partner_is_named(tmp_path):
    graph = _graph(_tiny(tmp_path, {"fc1": "colwise", "fc2": "rowwise"}))
    names = [unit.name for unit in graph.units]
    assert names == ["attn", "norm", "fc1", "fc2"]  # GELU in fc1's unit
    assert graph.tp_split_cuts == (names.index("fc1"),)
    assert [t.name for t in graph.cuts[names.index("fc1")]] == ["gelu"]


# ----------------------------------------------------------------------- the degree
@pytest.mark.parametrize("heads", [2, 4])
def test_the_largest_degree_divides_the_heads_read_off_the_view(heads, tmp_path):
    graph = _graph(_tiny(tmp_path, MEGATRON, heads=heads))
    assert graph.tp_refusal is None
    assert graph.tp_max_degree == heads  # 16 features allow 8


def test_the_largest_degree_divides_every_split_feature_count(tmp_path):
    plan = {"fc1": "colwise", "fc2": "rowwise"}
    assert _graph(_tiny(tmp_path, plan, hidden=12)).tp_max_degree == 4
    refusal = _refused(_graph(_tiny(tmp_path, plan, hidden=5)))
    assert "fc1 out features 5" in refusal


# ----------------------------------------------------------------------- refusals
def test_a_model_without_a_plan_is_not_offered_tp(tmp_path):
    assert _refused(_graph(_tiny(tmp_path))) == NO_PLAN
    assert "TP_PLAN" in NO_PLAN and "base_model_tp_plan" in NO_PLAN


@pytest.mark.parametrize(
    ("plan", "needles"),
    [
        ({"attn.q": "colwise", "fc1": "sequence_parallel"}, ("'sequence_parallel'", "'fc1'")),
        ({"attn.q": "colwise", "blocks.*.fc1": "colwise"}, ("'blocks.*.fc1'", "matches no module")),
        ({"norm": "colwise"}, ("'norm'", "LayerNorm", "nn.Linear")),
        ({}, ("TP_PLAN is empty",)),
    ],
    ids=["unknown style", "pattern matching nothing", "not a linear", "empty"],
)
def test_a_plan_hplan_cannot_split_is_refused_in_one_line(plan, needles, tmp_path):
    refusal = _refused(_graph(_tiny(tmp_path, plan)))
    for needle in needles:
        assert needle in refusal, (needle, refusal)


def test_a_split_module_the_trace_kept_whole_is_refused(tmp_path):
    refusal = _refused(_graph(_tiny(tmp_path, MEGATRON, leaves=("attn",))))
    assert "'attn.q'" in refusal and "no node of its own" in refusal


def test_a_tp_plan_of_the_wrong_kind_is_a_model_file_error(tmp_path):
    path = write_model(tmp_path, TINY.format(plan='["fc1"]', heads=2, hidden=32, leaves=[]))
    with pytest.raises(ModelFileError, match=r"TP_PLAN .* set it to a dict"):
        load_model_file(path)


# ----------------------------------------------------------------------- round trips
def test_the_capture_file_and_the_plan_carry_the_tp_plan(tmp_path):
    (tmp_path / "split").mkdir()
    (tmp_path / "refused").mkdir()
    split = _tiny(tmp_path / "split", {**MEGATRON, "fc1": "colwise", "fc2": "rowwise"})
    for path in (split, _tiny(tmp_path / "refused")):
        model_file = load_model_file(path)
        graph = _graph(path)
        record = capture_record(
            graph,
            TrainsVerdict(device="fake", notes=()),
            optimizer_state_bytes_per_param_byte=2.0,
            model_path=path,
            model_sha256=model_file.sha256,
            seed=0,
            leaf_modules=(),
        )
        stored = path.with_name("capture.json")
        stored.write_text(record.to_json())
        read = load_capture(stored, model_path=path, seed=0, leaf_modules=()).graph
        for field in ("unit_costs", "tp_plan", "tp_max_degree", "tp_refusal", "tp_split_cuts"):
            assert getattr(read, field) == getattr(graph, field), field
        assert model_spec(read, path="model.py", sha256="0").tp_plan == graph.tp_plan
        split_units = [cost.tp for cost in graph.unit_costs if cost.tp is not None]
        assert bool(split_units) == (path == split)
