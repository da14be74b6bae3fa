"""Each rank builds only its own stage (``capture/materialise.py`` through
``worker.rank_stage``): its parameters and buffers equal those of a full single-process
build bit for bit, the generators end where a full build leaves them, and a model whose
build cannot be reproduced that way is built whole, with one line on stderr."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch import nn

from hplan.runtime.capture.materialise import (
    CannotMaterialise,
    real_steps,
    record_build,
    replay_build,
)
from hplan.runtime.capture.model_file import ModelFile, load_model_file
from hplan.runtime.contract.plan import Plan
from hplan.runtime.executor.worker import rank_stage
from tests.fixtures.hf_models import HF_GPT2
from tests.fixtures.plans import (
    DRAWS_AT_INIT,
    GPT_MODEL,
    TIED_LM,
    ReplicaShape,
    make_plan,
    write_model,
)

TIED = (
    """
    import torch
    import torch.nn.functional as F
    from torch import nn

    VOCAB, WIDTH, SEQ = 32, 8, 6
"""
    + TIED_LM
    + """

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
"""
)
SOURCES = {"tied": TIED, "hf_gpt2": HF_GPT2, "draws": DRAWS_AT_INIT}
SPLITS = {2: (2, -1), 3: (1, 2, -1), 4: (1, 1, 1, -1)}
"""Units per stage of a pipeline of 2, 3 and 4 stages."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def _model_path(name: str, directory: Path) -> Path:
    if name == "gpt":
        return GPT_MODEL
    if name == "hf_gpt2":
        pytest.importorskip("transformers")
    path = directory / f"{name}.py"
    if not path.exists():
        write_model(directory, SOURCES[name], path.name)
    return path


def _full_build(model_file: ModelFile, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Every parameter and buffer of one full build by name, and the CPU generator's state
    after it."""
    torch.manual_seed(seed)
    model = model_file.build_model()
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return tensors, torch.get_rng_state()


def _assert_stages_equal_full_build(plan: Plan, model_file: ModelFile) -> None:
    reference, rng_after = _full_build(model_file, plan.training.seed)
    held: set[str] = set()
    for rank_plan in plan.ranks:
        stage, _ = rank_stage(plan, rank_plan, model_file)
        assert torch.equal(torch.get_rng_state(), rng_after), rank_plan.rank
        for name, tensor in stage.canonical_parameters() + stage.canonical_buffers():
            want = reference[name]
            assert tensor.dtype == want.dtype and torch.equal(tensor, want), (rank_plan.rank, name)
            assert isinstance(tensor, nn.Parameter) == isinstance(want, nn.Parameter), name
            held.add(name)
    parameters = {n for n, t in reference.items() if isinstance(t, nn.Parameter)}
    assert parameters <= held


# --------------------------------------------------------------------------- equal values
@pytest.mark.parametrize("num_stages", sorted(SPLITS))
@pytest.mark.parametrize("name", ["gpt", "tied", "hf_gpt2", "draws"])
def test_each_stage_built_alone_equals_the_full_build_bit_for_bit(
    name: str, num_stages: int, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _model_path(name, model_dir)
    plan = make_plan(path, [ReplicaShape(SPLITS[num_stages], micro_batch_size=2, num_samples=4)])
    assert len(plan.ranks) == num_stages
    _assert_stages_equal_full_build(plan, load_model_file(path))
    assert capsys.readouterr().err == ""  # no rank fell back to a full build


def test_a_stage_that_is_the_whole_model_is_built_whole_without_a_note(
    capsys: pytest.CaptureFixture[str],
) -> None:
    plan = make_plan(GPT_MODEL, [ReplicaShape((-1,), micro_batch_size=2, num_samples=2)])
    _assert_stages_equal_full_build(plan, load_model_file(GPT_MODEL))
    assert capsys.readouterr().err == ""


def test_a_stage_alone_builds_its_own_tensors_and_nothing_else() -> None:
    model_file = load_model_file(GPT_MODEL)
    record = record_build(model_file.build_model, 0)
    block = record.model.get_submodule("blocks.1")
    own = {record.ordinal(t) for t in itertools.chain(block.parameters(), block.buffers())}
    real = real_steps(record, own)
    assert real and all(set(record.steps[idx].writes) <= own for idx in real)
    assert any(record.steps[idx].random for idx in set(range(len(record.steps))) - real)


# --------------------------------------------------------------------------- falling back
def test_a_build_that_reads_tensor_values_is_built_whole_with_one_line_per_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reads = "self.scale = float(self.w.detach().abs().max())"
    source = DRAWS_AT_INIT.replace("self.scale = random.random()", reads)
    assert reads in source
    path = write_model(tmp_path, source)
    plan = make_plan(path, [ReplicaShape(SPLITS[3], micro_batch_size=2, num_samples=4)])
    _assert_stages_equal_full_build(plan, load_model_file(path))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == len(plan.ranks)
    for line, rank_plan in zip(lines, plan.ranks, strict=True):
        assert line.startswith(f"hplan: note: stage {rank_plan.stage} of replica 0 ")
        assert "built the whole model, not its stage alone" in line
        assert f"reads tensor values (aten._local_scalar_dense.default) at {path}:" in line
        assert reads in line


def _linear(out_features: int, zero_bias: bool = False) -> nn.Module:
    layer = nn.Linear(4, out_features)
    if zero_bias:
        nn.init.zeros_(layer.bias)
    return layer


@pytest.mark.parametrize(
    ("first", "second", "message"),
    [
        (4, lambda: _linear(5), "step 0 .* gave other shapes the second time"),
        (
            4,
            lambda: _linear(4, zero_bias=True),
            "called aten.zero_.default the second time where it called nothing the first",
        ),
        (4, lambda: _linear(4) if torch.rand(()) < 2 else None, "called aten.rand.default"),
    ],
)
def test_a_second_build_that_differs_from_the_first_is_refused(first, second, message) -> None:
    record = record_build(lambda: _linear(first), 0)
    with pytest.raises(CannotMaterialise, match=message):
        replay_build(second, 0, record, frozenset(range(len(record.steps))))


def test_a_second_build_with_fewer_steps_is_refused() -> None:
    record = record_build(lambda: _linear(4, zero_bias=True), 0)
    with pytest.raises(CannotMaterialise, match="made 4 steps the second time, 5 the first"):
        replay_build(lambda: _linear(4), 0, record, frozenset())
