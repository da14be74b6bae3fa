"""`hplan capture` once, `hplan solve --capture` on many clusters: the same plan bytes, and a
capture that does not match the model file or the solve's settings refused in one line."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from hplan.planner import api
from hplan.planner.cli.main import main
from hplan.planner.frontend.capture_file import capture_record, load_capture
from hplan.planner.frontend.cost_graph import build_model_graph
from hplan.planner.frontend.trains_check import TrainsVerdict
from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.contract.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
GPT = ROOT / "examples" / "gpt" / "model.py"
MLP = ROOT / "examples" / "mlp" / "model.py"
CLUSTERS = ROOT / "examples" / "clusters"

# Raises when built while HPLAN_TEST_REFUSE_BUILD is set: a solve from a capture file must
# not build the model.
GUARDED_MODEL = """\
import os
import torch
def build_model():
    if os.environ.get("HPLAN_TEST_REFUSE_BUILD"):
        raise RuntimeError("build_model called during a solve from a capture file")
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
def sample_batch(n):
    return torch.randn(n, 8), torch.randn(n, 1)
def loss_fn(out, y):
    return ((out - y) ** 2).mean()
"""


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


def _one_line(err: str, *needles: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert "Traceback" not in err
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _capture(model: Path, out: Path, capsys, *extra: str) -> Path:
    code, _, err = _run(["capture", str(model), "-o", str(out), *extra], capsys)
    assert code == 0, err
    return out


def _solve(model: Path, cluster: str, out: Path, capsys, *extra: str) -> tuple[int, str]:
    argv = ["solve", str(model), "-c", str(CLUSTERS / cluster), "-o", str(out), *extra]
    code, _, err = _run(
        [*argv, "--time-limit", "60"], capsys
    )  # both solves to the end, however busy the machine
    return code, err


@pytest.fixture(scope="module")
def gpt_capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``hplan capture`` of the GPT example, once for every cluster it is solved on."""
    out = tmp_path_factory.mktemp("capture") / "gpt.capture.json"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
        main(["capture", str(GPT), "-o", str(out)])
    assert not exit_info.value.code, err.getvalue()
    return out


@pytest.mark.xdist_group("gpt-capture")  # one worker captures `gpt_capture`
@pytest.mark.parametrize("cluster", ["mixed-3090-4090.yaml", "two-site.yaml"])
def test_a_solve_from_the_capture_file_writes_the_same_plan_bytes(
    cluster, gpt_capture, tmp_path, capsys
):
    capture = gpt_capture
    assert json.loads(capture.read_text())["optimizer_state_bytes_per_param_byte"] == 2.0  # AdamW
    code, err = _solve(GPT, cluster, tmp_path / "direct", capsys)
    assert code == 0, err
    code, err = _solve(GPT, cluster, tmp_path / "from-file", capsys, "--capture", str(capture))
    assert code == 0, err
    direct = (tmp_path / "direct" / "plan.json").read_bytes()
    assert (tmp_path / "from-file" / "plan.json").read_bytes() == direct


def test_the_file_holds_the_cost_graph_as_measured(tmp_path):
    model_file = load_model_file(MLP)
    graph = build_model_graph(model_file)
    verdict = TrainsVerdict(device="fake", notes=("a note",))
    record = capture_record(
        graph,
        verdict,
        optimizer_state_bytes_per_param_byte=2.0,
        model_path=MLP,
        model_sha256=model_file.sha256,
        seed=0,
        leaf_modules=(),
    )
    path = tmp_path / "capture.json"
    path.write_text(record.to_json())
    stored = load_capture(path, model_path=MLP, seed=0, leaf_modules=())
    assert stored.trains == verdict and stored.model_sha256 == model_file.sha256
    assert stored.optimizer_state_bytes_per_param_byte == 2.0
    read = stored.graph
    for field in (
        "units", "unit_costs", "cuts", "inputs", "param_dtype", "notes", "trace_method",
        "leaf_modules", "graph_fingerprint", "trainable_param_sizes", "tied_trainable_bytes",
    ):  # fmt: skip
        assert getattr(read, field) == getattr(graph, field), field
    assert read.traced is None and graph.traced is not None
    assert list(read.graph.nodes(data=True)) == list(graph.graph.nodes(data=True))
    for name in graph.graph.nodes:
        assert list(read.graph.predecessors(name)) == list(graph.graph.predecessors(name))
        assert list(read.graph.successors(name)) == list(graph.graph.successors(name))
    assert list(read.graph.edges(data=True)) == list(graph.graph.edges(data=True))
    assert graph.trainable_param_sizes  # the MLP has trainable parameters to all-reduce


def test_a_solve_from_the_capture_file_does_not_build_or_trace_the_model(
    tmp_path, capsys, monkeypatch
):
    model = tmp_path / "model.py"
    model.write_text(GUARDED_MODEL)
    capture = _capture(model, tmp_path / "capture.json", capsys)
    monkeypatch.setenv("HPLAN_TEST_REFUSE_BUILD", "1")

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the model was captured again")

    for name in (
        "load_model_file", "capture_model", "model_graph", "check_trains", "optimizer_state_factor",
    ):  # fmt: skip
        monkeypatch.setattr(api, name, refuse)
    dump = tmp_path / "passes"
    code, err = _solve(
        model, "cpu-rehearsal.yaml", tmp_path / "out", capsys,
        "--capture", str(capture), "--dump-passes", str(dump),
    )  # fmt: skip
    assert code == 0, err
    assert (tmp_path / "out" / "plan.json").is_file()
    dumped = json.loads((dump / "02-capture.json").read_text())
    assert dumped["__type__"] == "StoredCapture" and dumped["source"] == str(capture)
    assert json.loads((dump / "04-cost_graph.json").read_text())["traced"] is None
    # and without the capture file the same solve builds the model, and fails here
    monkeypatch.undo()  # the real passes back, the guard still set
    monkeypatch.setenv("HPLAN_TEST_REFUSE_BUILD", "1")
    code, err = _solve(model, "cpu-rehearsal.yaml", tmp_path / "out2", capsys)
    assert code == 2
    _one_line(err, "build_model called during a solve from a capture file")


def test_a_capture_of_an_edited_model_file_is_refused_in_one_line(tmp_path, capsys):
    model = tmp_path / "model.py"
    shutil.copy(MLP, model)
    capture = _capture(model, tmp_path / "capture.json", capsys)
    model.write_text(model.read_text() + "\n# edited\n")
    code, err = _solve(
        model, "cpu-rehearsal.yaml", tmp_path / "out", capsys, "--capture", str(capture)
    )
    assert code == 2
    _one_line(err, str(capture), "sha256", "edited", "hplan capture")
    assert not (tmp_path / "out" / "plan.json").exists()


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (("--seed", "1"), ("--seed 0", "asks for 1", "--seed 1")),
        (
            ("--leaf-module", "blocks.0"),
            ("--leaf-module list none", "asks for blocks.0", "hplan capture"),
        ),
    ],
)
def test_a_capture_made_with_other_settings_is_refused_naming_them(
    extra, needles, tmp_path, capsys
):
    capture = _capture(MLP, tmp_path / "capture.json", capsys)
    code, err = _solve(
        MLP, "cpu-rehearsal.yaml", tmp_path / "out", capsys, "--capture", str(capture), *extra
    )
    assert code == 2
    _one_line(err, *needles)


def _edited(text: str, case: str) -> str:
    data = json.loads(text)
    if case == "truncated":
        return text[: len(text) // 2]
    if case == "unknown version":
        data["schema_version"] = 99
    elif case == "older version":
        data["schema_version"] = 2
    elif case == "version as a string":
        data["schema_version"] = str(data["schema_version"])
    elif case == "version as a float":
        data["schema_version"] = float(data["schema_version"])
    elif case == "version as a boolean":
        data["schema_version"] = True
    elif case == "not a capture":
        data = {"units": []}
    elif case == "unknown key":
        data["extra"] = 1
    elif case == "wrong type":
        data["unit_costs"][0]["param_bytes"] = "many"
    elif case == "edge to nowhere":
        data["edges"][0]["target"] = "no_such_node"
    elif case == "unit of no node":
        data["units"][0]["nodes"] = ["no_such_node"]
    return json.dumps(data)


CORRUPTIONS = {
    "truncated": "not valid JSON",
    "unknown version": "schema_version 99, from a newer hplan",
    "older version": "schema_version 2, this hplan reads 4",
    "version as a string": 'schema_version "4"; write the integer 4',
    "version as a float": "schema_version 4.0; write the integer 4",
    "version as a boolean": "schema_version true, not an integer",
    "not a capture": "not an hplan capture file",
    "unknown key": "'extra'",
    "wrong type": "param_bytes",
    "edge to nowhere": "no_such_node",
    "unit of no node": "inconsistent",
}


@pytest.fixture(scope="module")
def mlp_capture_text(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("capture") / "capture.json"
    api.capture_to_file(MLP, out)
    return out.read_text()


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_a_damaged_capture_file_is_refused_in_one_line(case, mlp_capture_text, tmp_path, capsys):
    capture = tmp_path / "capture.json"
    capture.write_text(_edited(mlp_capture_text, case))
    with pytest.raises(ConfigError, match="hplan capture") as raised:
        load_capture(capture, model_path=MLP, seed=0, leaf_modules=())
    assert "\n" not in str(raised.value) and CORRUPTIONS[case] in str(raised.value)
    code, err = _solve(
        MLP, "cpu-rehearsal.yaml", tmp_path / "out", capsys, "--capture", str(capture)
    )
    assert code == 2
    _one_line(err, str(capture), CORRUPTIONS[case])


def test_a_missing_capture_file_is_refused_before_the_model_is_imported(tmp_path, capsys):
    model = tmp_path / "model.py"
    model.write_text("raise RuntimeError('imported')\n")
    code, err = _solve(
        model, "cpu-rehearsal.yaml", tmp_path / "out", capsys, "--capture", "nope.json"
    )
    assert code == 2
    _one_line(err, "capture file (--capture) 'nope.json' does not exist")


def test_a_plan_given_as_the_capture_is_named_and_not_overwritten(tmp_path, capsys):
    out = tmp_path / "out"
    code, err = _solve(MLP, "cpu-rehearsal.yaml", out, capsys)
    assert code == 0, err
    before = (out / "plan.json").read_bytes()
    code, err = _solve(
        MLP, "cpu-rehearsal.yaml", tmp_path / "again", capsys, "--capture", str(out / "plan.json")
    )
    assert code == 2
    line = _one_line(err, "is a plan (plan.json), not a capture file", "-o capture.json")
    assert f"-o {out / 'plan.json'}" not in line
    assert (out / "plan.json").read_bytes() == before


def test_a_cluster_file_given_as_the_capture_is_not_proposed_as_the_output(tmp_path, capsys):
    cluster = CLUSTERS / "cpu-rehearsal.yaml"
    code, err = _solve(
        MLP, "cpu-rehearsal.yaml", tmp_path / "out", capsys, "--capture", str(cluster)
    )
    assert code == 2
    line = _one_line(err, str(cluster), "-o capture.json")
    assert f"-o {cluster}" not in line
