"""What the capture refuses at solve time (one line, exit 2), and what it accepts.

Parameters created in forward, lazy modules, inputs whose dim 0 is not the batch and
trainable parameters forward never uses are refused before a plan is written; a real-tensor
fallback that would not fit this machine's memory is refused before it builds anything;
a forward that unrolls a Python loop over the sequence is refused while it is traced; a dict
of per-sample tensors (diffusers' ``added_cond_kwargs``) is planned and run with the gradients
of one process; the capture says what it is doing as it goes.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

import pytest

from hplan.planner.cli.main import main
from hplan.planner.frontend import capture as capture_module
from hplan.planner.frontend.capture import CaptureTensors, capture_model
from hplan.runtime.capture import trace as trace_module
from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.contract.errors import ModelFileError, TraceTooLongError

ROOT = Path(__file__).resolve().parents[2]
CPU_CLUSTER = ROOT / "examples" / "clusters" / "cpu-rehearsal.yaml"

BASE = textwrap.dedent(
    """\
    import torch
    from torch import nn

    W = 8


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(W, W) for _ in range(3))
            self.head = nn.Linear(W, 1)

        def forward(self, x):
            for block in self.blocks:
                x = torch.relu(block(x))
            return self.head(x).squeeze(-1)


    def build_model():
        return Net()


    def sample_batch(batch_size):
        return torch.randn(batch_size, W), torch.randn(batch_size)


    def loss_fn(outputs, targets):
        return ((outputs - targets) ** 2).mean()
    """
)

FORWARD_LOOP = "        for block in self.blocks:\n"
HEAD = "self.head = nn.Linear(W, 1)"
HEAD_CALL = "        return self.head(x).squeeze(-1)"
SAMPLE = "return torch.randn(batch_size, W), torch.randn(batch_size)"

MISTAKES = {
    "parameter_in_forward": (
        (FORWARD_LOOP, "        self.scale = nn.Parameter(torch.ones(W))\n" + FORWARD_LOOP),
        "creates parameters (Net.scale)",
    ),
    "module_in_forward": (
        (HEAD_CALL, "        return nn.Linear(W, 1)(x).squeeze(-1)"),
        "creates parameters (Linear.weight",
    ),
    "lazy_module": ((HEAD, "self.head = nn.LazyLinear(1)"), "'head' (LazyLinear)"),
    "batch_in_dim_1": (
        (SAMPLE, "return torch.randn(W, batch_size), torch.randn(batch_size)"),
        "its dim 0 is not the batch size 2",
    ),
    "unused_parameter": (
        (HEAD, HEAD + "\n        self.pooler = nn.Linear(W, W)"),
        "never uses the parameters pooler.weight, pooler.bias",
    ),
}


def _write(directory: Path, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model.py"
    path.write_text(text)
    return path


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_what_the_runtime_cannot_train_is_refused_at_solve_time(mistake, tmp_path, capsys):
    (old, new), needle = MISTAKES[mistake]
    assert old in BASE
    model = _write(tmp_path / mistake, BASE.replace(old, new))
    argv = ["solve", str(model), "--cluster", str(CPU_CLUSTER), "-b", "8", "-o", str(tmp_path)]
    code, _, err = _run(argv, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0]
    assert not (tmp_path / "plan.json").exists()


def test_the_capture_says_what_it_does(tmp_path):
    said: list[str] = []
    capture_model(load_model_file(_write(tmp_path, BASE)), progress=said.append)
    assert said[:2] == ["building the model on fake tensors", "tracing with torch.fx"]


VALUE_LEAF = (
    BASE.replace(HEAD, HEAD + "\n        self.gate = Gate()")
    .replace(FORWARD_LOOP, "        x = self.gate(x)\n" + FORWARD_LOOP)
    .replace(
        "class Net(",
        "LEAF_MODULES = ['gate']\n\n\nclass Gate(nn.Module):\n    def forward(self, x):\n"
        "        return x * (2.0 if x.mean().item() > 0 else 1.0)\n\n\nclass Net(",
    )
)
"""A model kept whole around a branch on a value: traced by fx, run on real tensors only."""


def test_the_real_tensor_fallback_is_refused_when_it_cannot_fit(tmp_path, monkeypatch):
    path = _write(tmp_path, VALUE_LEAF)
    said: list[str] = []
    captured = capture_model(load_model_file(path), progress=said.append)
    assert captured.tensors is CaptureTensors.CPU  # it needs values: real tensors
    assert any(
        s.startswith("building the model on real CPU tensors (fake tensors failed") for s in said
    )
    model_file = load_model_file(path)
    builds: list[bool] = []

    def build_model():
        builds.append(True)
        return model_file.build_model()

    monkeypatch.setattr(capture_module, "available_memory_bytes", lambda: 10**8)
    with pytest.raises(ModelFileError, match=r"needs at least .* GB here .* available"):
        capture_model(dataclasses.replace(model_file, build_model=build_model))
    assert len(builds) == 1  # on fake tensors only


NESTED = textwrap.dedent(
    """\
    import torch
    from torch import nn

    W = 8


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(W, W)
            self.cond = nn.Linear(W + 6, W)

        def forward(self, x, emb):
            return x + torch.tanh(self.lin(x)) * self.cond(emb).unsqueeze(1)


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Linear(W, W)
            self.blocks = nn.ModuleList(Block() for _ in range(4))
            self.head = nn.Linear(W, 1)

        def forward(self, x, added_cond_kwargs=None):
            if "text_embeds" not in added_cond_kwargs:
                raise ValueError("added_cond_kwargs needs text_embeds")
            cond = added_cond_kwargs
            emb = torch.cat([cond["text_embeds"], cond.get("time_ids")], -1)
            h = self.stem(x)
            for block in self.blocks:
                h = block(h, emb)
            return self.head(h).mean(dim=(1, 2))


    def build_model():
        return Net()


    def sample_batch(batch_size):
        cond = {"text_embeds": torch.randn(batch_size, W), "time_ids": torch.randn(batch_size, 6)}
        return {"x": torch.randn(batch_size, 5, W), "added_cond_kwargs": cond}, torch.randn(
            batch_size
        )


    def loss_fn(outputs, targets):
        return ((outputs - targets) ** 2).mean()
    """
)


def test_a_dict_of_per_sample_tensors_is_planned_and_run(tmp_path, capsys):
    model = _write(tmp_path / "nested", NESTED)
    out = tmp_path / "out"
    argv = ["solve", str(model), "--cluster", str(CPU_CLUSTER), "-b", "16", "-o", str(out)]
    code, _, err = _run([*argv, "--strategy", "uniform"], capsys)
    assert code == 0, err
    plan = json.loads((out / "plan.json").read_text())
    names = [spec["tensor"]["name"] for spec in plan["model"]["inputs"]]
    assert names == ["x", "added_cond_kwargs.text_embeds", "added_cond_kwargs.time_ids"]
    assert max(rank["stage"] for rank in plan["ranks"]) >= 1  # a pipeline: inputs per stage
    code, stdout, err = _run(
        ["rehearse", str(out / "plan.json"), "--steps", "2", "--verify", "--json"], capsys
    )
    assert code == 0, err
    assert json.loads(stdout)["verify_passed"] is True


LOOP = textwrap.dedent(
    """\
    import torch
    from torch import nn

    W, SEQ = 8, 64


    class Cell(nn.Module):
        def __init__(self):
            super().__init__()
            self.ih = nn.Linear(W, W)
            self.hh = nn.Linear(W, W)

        def forward(self, x, h):
            return torch.tanh(self.ih(x) + self.hh(h))


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = Cell()
            self.head = nn.Linear(W, 1)

        def forward(self, x):
            h = torch.zeros_like(x[:, 0])
            for t in range(x.shape[1]):  # fx cannot loop over a traced size: torch.export
                h = self.cell(x[:, t], h)
            return self.head(h).squeeze(-1)


    def build_model():
        return Net()


    def sample_batch(batch_size):
        return torch.randn(batch_size, SEQ, W), torch.randn(batch_size)


    def loss_fn(outputs, targets):
        return ((outputs - targets) ** 2).mean()
    """
)


def test_a_python_loop_over_the_sequence_is_refused_while_tracing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(trace_module, "MAX_CALLS_PER_LINE", 32)  # 64 steps: twice the limit
    model_file = load_model_file(_write(tmp_path / "loop", LOOP))
    builds: list[bool] = []

    def build_model():
        builds.append(True)
        return model_file.build_model()

    with pytest.raises(TraceTooLongError, match=r"model.py:\d+ `h = self.cell\(x\[:, t\], h\)`"):
        capture_model(dataclasses.replace(model_file, build_model=build_model))
    assert len(builds) == 1  # refused on fake tensors: no real build would be faster
    argv = ["solve", str(model_file.path), "--cluster", str(CPU_CLUSTER), "-b", "8"]
    code, _, err = _run([*argv, "-o", str(tmp_path / "out")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "unrolls a Python loop" in err


def test_a_loop_torch_fx_unrolls_is_refused_too(tmp_path, monkeypatch):
    monkeypatch.setattr(trace_module, "MAX_CALLS_PER_LINE", 32)
    constant_loop = LOOP.replace("range(x.shape[1])", "range(SEQ)")  # fx traces it
    with pytest.raises(TraceTooLongError, match=r"torch.fx unrolls a Python loop: .*model.py"):
        capture_model(load_model_file(_write(tmp_path / "loop", constant_loop)))


def test_a_loop_within_the_limit_is_traced(tmp_path, monkeypatch):
    monkeypatch.setattr(trace_module, "MAX_CALLS_PER_LINE", 512)
    captured = capture_model(load_model_file(_write(tmp_path / "loop", LOOP)))
    assert captured.traced.method.value == "torch_export"
