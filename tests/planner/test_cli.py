"""The `hplan` command line: end to end on the examples, and one-line errors on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from hplan.planner.cli.main import main
from hplan.runtime.contract.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "examples" / "mlp" / "model.py"
GPT = ROOT / "examples" / "gpt" / "model.py"
CLUSTERS = ROOT / "examples" / "clusters"

GOOD_CLUSTER = """\
name: tiny
nodes:
  - name: a
    host: 127.0.0.1
    devices:
      - type: rtx3090
        count: 2
"""


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


def _assert_one_line_error(err: str, *needles: str) -> None:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert "Traceback" not in err
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_solve_writes_plan_and_scripts_and_4090s_get_larger_shares(tmp_path, capsys, monkeypatch):
    # A 124M-class GPT: big enough that the roofline, not kernel launches, sets the speed.
    for name, value in {"LAYERS": "12", "WIDTH": "768", "HEADS": "12", "SEQ": "1024"}.items():
        monkeypatch.setenv(f"HPLAN_GPT_{name}", value)
    code, out, err = _run(
        [
            "solve",
            str(GPT),
            "--cluster",
            str(CLUSTERS / "mixed-3090-4090.yaml"),
            "-o",
            str(tmp_path),
            "-b",
            "512",
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    summary = json.loads(out)
    plan = Plan.from_json((tmp_path / "plan.json").read_text())
    assert summary["predicted_samples_per_s"] == pytest.approx(plan.report.predicted_samples_per_s)
    assert (tmp_path / "launch" / "node-box-a.sh").is_file()
    shares = {}
    for rank in plan.ranks:
        per_device = rank.num_samples / len(plan.replica_ranks(rank.replica))
        shares.setdefault(rank.device_kind, []).append(per_device)
    assert min(shares["rtx4090"]) > max(shares["rtx3090"])
    for report in plan.report.ranks:
        assert report.memory_bytes <= report.memory_capacity_bytes
    assert {r.device_kind for r in plan.ranks} >= {"rtx4090", "rtx3090"}


def test_show_renders_text_json_and_dot(tmp_path, capsys):
    code, _, err = _run(
        [
            "solve",
            str(MLP),
            "--cluster",
            str(CLUSTERS / "cpu-rehearsal.yaml"),
            "-o",
            str(tmp_path),
            "-b",
            "8",
        ],
        capsys,
    )
    assert code == 0, err
    plan_path = str(tmp_path / "plan.json")
    code, text, _ = _run(["show", plan_path], capsys)
    assert code == 0 and "samples/s" in text
    assert text == (tmp_path / "summary.txt").read_text(encoding="utf-8")  # not padded
    code, as_json, _ = _run(["show", plan_path, "--format", "json"], capsys)
    assert Plan.from_json(as_json) == Plan.from_json((tmp_path / "plan.json").read_text())
    code, dot, _ = _run(["show", plan_path, "--format", "dot"], capsys)
    assert dot.lstrip().startswith(("digraph", "strict digraph"))


BAD_CLUSTERS = {
    "unknown key": (GOOD_CLUSTER + "colour: blue\n", "colour"),
    "negative memory": (
        GOOD_CLUSTER.replace("count: 2", "count: 2\n        memory_gb: -4"),
        "memory_gb",
    ),
    "unknown device": (GOOD_CLUSTER.replace("rtx3090", "rtx9999"), "rtx9999"),
    "shell in host": (GOOD_CLUSTER.replace("127.0.0.1", "'a; rm -rf /'"), "host"),
    "link to unknown node": (
        GOOD_CLUSTER
        + "links:\n  pairs:\n    - nodes: [a, ghost]\n      bandwidth_gbit_per_s: 10\n",
        "ghost",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CLUSTERS))
def test_bad_cluster_file_is_one_line_exit_2(case, tmp_path, capsys):
    text, needle = BAD_CLUSTERS[case]
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(text)
    code, _, err = _run(
        ["solve", str(MLP), "--cluster", str(cluster), "-o", str(tmp_path / "out")], capsys
    )
    assert code == 2
    _assert_one_line_error(err, needle)


BAD_MODELS = {
    "missing function": (
        "import torch\ndef build_model():\n    return torch.nn.Linear(2, 2)\n",
        "sample_batch",
    ),
    "raises on import": ("import torch\nraise RuntimeError('no GPU found')\n", "no GPU found"),
    "untraceable": (
        textwrap.dedent(
            """
            import torch
            class M(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.l = torch.nn.Linear(4, 4)
                def forward(self, x):
                    if x.sum() > 0:
                        return self.l(x)
                    return -self.l(x)
            def build_model():
                return M()
            def sample_batch(n):
                return torch.randn(n, 4), torch.randn(n, 4)
            def loss_fn(out, y):
                return ((out - y) ** 2).mean()
            """
        ),
        "model.py",
    ),
}


LINEAR_MODEL = """\
import torch
def build_model():
    return torch.nn.Linear(4, 4)
def sample_batch(n):
    return torch.randn(n, 4), torch.randn(n, 4)
def loss_fn(out, y):
    return ((out - y) ** 2).mean()
"""
BAD_MODELS.update(
    {
        "loss raises": (
            LINEAR_MODEL.replace("return ((out - y) ** 2).mean()", "return {}['labels']"),
            "loss_fn",
        ),
        "loss not a scalar": (
            LINEAR_MODEL.replace("((out - y) ** 2).mean()", "(out - y) ** 2"),
            "shape (2, 4); fix loss_fn",
        ),
        "loss detached": (
            LINEAR_MODEL.replace("((out - y) ** 2).mean()", "((out - y) ** 2).mean().detach()"),
            "needs no gradient",
        ),
        "no parameters": (
            LINEAR_MODEL.replace("torch.nn.Linear(4, 4)", "torch.nn.ReLU()"),
            "without trainable parameters",
        ),
        "exits while importing": ("import sys\nsys.exit(0)\n", "sys.exit"),
        "exits 1 while importing": ("raise SystemExit(1)\n", "sys.exit"),
    }
)


@pytest.mark.parametrize("case", sorted(BAD_MODELS))
def test_bad_model_file_is_one_line_exit_2(case, tmp_path, capsys):
    text, needle = BAD_MODELS[case]
    model = tmp_path / "model.py"
    model.write_text(text)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(GOOD_CLUSTER)
    code, _, err = _run(
        ["solve", str(model), "--cluster", str(cluster), "-o", str(tmp_path / "out")], capsys
    )
    assert code == 2
    _assert_one_line_error(err, needle)


def test_missing_plan_and_usage_errors_exit_2(tmp_path, capsys):
    code, _, err = _run(["show", str(tmp_path / "nope.json")], capsys)
    assert code == 2
    _assert_one_line_error(err, "nope.json")
    code, _, _ = _run(["solve", str(MLP)], capsys)  # --cluster missing
    assert code == 2


def test_infeasible_cluster_exits_3_naming_the_device(tmp_path, capsys):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(GOOD_CLUSTER.replace("count: 2", "count: 1\n        memory_gb: 0.001"))
    code, _, err = _run(
        ["solve", str(MLP), "--cluster", str(cluster), "-o", str(tmp_path / "out")], capsys
    )
    assert code == 3
    _assert_one_line_error(err, "a/0")


def test_console_script_reports_version_and_help():
    exe = Path(sys.executable).with_name("hplan")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True)
    assert "solve" in out.stdout and "rehearse" in out.stdout


def test_rehearse_verifies_a_plan_of_replicas_with_different_shares_and_splits(tmp_path, capsys):
    cluster = CLUSTERS / "cpu-small-memory.yaml"
    code, _, err = _run(
        ["solve", str(GPT), "--cluster", str(cluster), "-o", str(tmp_path), "-b", "64"], capsys
    )
    assert code == 0, err
    plan = Plan.from_json((tmp_path / "plan.json").read_text())
    replicas = [plan.replica_ranks(r) for r in range(plan.num_replicas)]
    assert len({r[0].num_samples for r in replicas}) >= 2
    assert len({tuple(len(rank.units) for rank in r) for r in replicas}) >= 2
    assert max(len(r) for r in replicas) >= 2
    code, out, err = _run(
        ["rehearse", str(tmp_path / "plan.json"), "--steps", "3", "--verify", "--json"], capsys
    )
    assert code == 0, err
    result = json.loads(out)
    assert result["verify_passed"] is True
    assert result["verify"]["gradients"]["relative_difference"] <= 1e-4
    assert result["verify"]["updates"]["passed"] is True
    assert len(result["losses"]) == 3


def test_plan_records_the_model_path_relative_to_the_output_folder(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out" / "demo"
    argv = ["solve", str(MLP), "--cluster", str(CLUSTERS / "cpu-rehearsal.yaml"), "-b", "8"]
    texts = []
    for cwd in (ROOT, tmp_path):  # the same inputs from two directories: the same plan
        monkeypatch.chdir(cwd)
        code, _, err = _run([*argv, "-o", str(out)], capsys)
        assert code == 0, err
        texts.append((out / "plan.json").read_text())
    # The report is left out: its bound comes from a MILP under a wall-clock limit, which a
    # loaded machine can stop at a looser (still proven) bound.
    plans = [json.loads(text) for text in texts]
    for plan in plans:
        plan.pop("report")
    assert plans[0] == plans[1]
    recorded = Plan.from_json(texts[0]).model.path
    assert not Path(recorded).is_absolute()
    assert (out / recorded).resolve() == MLP.resolve()


def test_a_plan_whose_model_file_is_gone_names_the_model_option(tmp_path, capsys):
    model = tmp_path / "model.py"
    model.write_text(MLP.read_text())
    cluster = CLUSTERS / "cpu-rehearsal.yaml"
    code, _, err = _run(
        ["solve", str(model), "--cluster", str(cluster), "-o", str(tmp_path / "o"), "-b", "8"],
        capsys,
    )
    assert code == 0, err
    model.unlink()
    code, _, err = _run(["rehearse", str(tmp_path / "o" / "plan.json")], capsys)
    assert code == 2
    _assert_one_line_error(err, "'../model.py'", "--model")


@pytest.mark.parametrize("where", ["a file", "below a file", "in /proc"])
def test_an_output_folder_that_cannot_be_written_is_one_line_exit_2(where, tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    out = {"a file": blocker, "below a file": blocker / "out", "in /proc": Path("/proc/hplan")}
    if where == "in /proc" and not Path("/proc/self").exists():
        pytest.skip("needs /proc")
    cluster = CLUSTERS / "cpu-rehearsal.yaml"
    code, _, err = _run(["solve", str(MLP), "-c", str(cluster), "-o", str(out[where])], capsys)
    assert code == 2
    _assert_one_line_error(err, str(out[where]))


@pytest.fixture(scope="module")
def mlp_plan(tmp_path_factory) -> Path:
    """A solved cpu plan of the MLP example (plan.json path)."""
    out = tmp_path_factory.mktemp("mlp-plan")
    cluster = CLUSTERS / "cpu-rehearsal.yaml"
    with pytest.raises(SystemExit) as exit_info:
        main(["solve", str(MLP), "--cluster", str(cluster), "-o", str(out), "-b", "8"])
    assert exit_info.value.code == 0
    return out / "plan.json"


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--dilation", "nan"),
        ("--dilation", "inf"),
        ("--dilation", "0.5"),
        ("--time-scale", "nan"),
        ("--time-scale", "0"),
        ("--timeout", "0"),
        ("--timeout", "-5"),
        ("--timeout", "nan"),
    ],
)
def test_rehearse_rejects_meaningless_numbers_with_exit_2(option, value, mlp_plan, capsys):
    code, _, err = _run(["rehearse", str(mlp_plan), option, value], capsys)
    assert code == 2
    _assert_one_line_error(err, value)


@pytest.mark.parametrize("sizes", ["1,,2", "", ",", "1,x", "0,2"])
def test_bad_micro_batch_sizes_are_one_line_exit_2(sizes, tmp_path, capsys):
    cluster = CLUSTERS / "cpu-rehearsal.yaml"
    argv = ["solve", str(MLP), "-c", str(cluster), "-o", str(tmp_path), "--micro-batch-sizes"]
    code, _, err = _run([*argv, sizes], capsys)
    assert code == 2
    _assert_one_line_error(err, "--micro-batch-sizes")


def test_a_misspelt_cluster_key_is_reported_before_the_key_it_hides(tmp_path, capsys):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(GOOD_CLUSTER.replace("devices:", "devcies:"))
    code, _, err = _run(["solve", str(MLP), "-c", str(cluster), "-o", str(tmp_path)], capsys)
    assert code == 2
    _assert_one_line_error(err, "nodes[0].devcies: unknown key", "did you mean 'devices'?")


def test_a_directory_given_as_cluster_or_model_file_is_named_a_directory(tmp_path, capsys):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(GOOD_CLUSTER)
    code, _, err = _run(["solve", str(MLP), "-c", str(tmp_path), "-o", str(tmp_path)], capsys)
    assert code == 2
    _assert_one_line_error(err, "is a directory")
    code, _, err = _run(["solve", str(tmp_path), "-c", str(cluster), "-o", str(tmp_path)], capsys)
    assert code == 2
    _assert_one_line_error(err, "is a directory")


def test_rehearse_prints_both_predictions_warns_once_and_cleans_up(
    mlp_plan, tmp_path, capsys, monkeypatch
):
    edited = tmp_path / "model.py"
    edited.write_text(MLP.read_text() + "\n# an edit that keeps the graph\n")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    code, out, err = _run(
        ["rehearse", str(mlp_plan), "--steps", "1", "--model", str(edited), "--json"], capsys
    )
    assert code == 0, err
    lines = err.splitlines()
    assert len([line for line in lines if "warning" in line]) == 1
    assert "differs from the model file the plan was made for" in err
    plan = Plan.load(mlp_plan)
    rehearsing = next(line for line in lines if line.startswith("rehearsing "))
    assert rehearsing.startswith(f"rehearsing {plan.world_size} rank")
    predicted = next(line for line in lines if line.startswith("predicted: "))
    on_hardware = f"{plan.report.predicted_samples_per_s:.1f} samples/s on the plan's hardware"
    assert on_hardware in predicted and "1 s there = " in predicted
    assert json.loads(out)["metrics_dir"] is None
    assert list(scratch.iterdir()) == []  # the temporary metrics folder is gone


def test_a_model_whose_build_raises_at_rehearse_is_the_model_files_fault_not_hplans(
    mlp_plan, tmp_path, capsys
):
    edited = tmp_path / "model.py"
    edited.write_text(MLP.read_text() + "\n\ndef build_model():\n    raise RuntimeError('boom')\n")
    code, _, err = _run(["rehearse", str(mlp_plan), "--steps", "1", "--model", str(edited)], capsys)
    assert code == 2, err
    assert "Traceback" not in err and "internal error" not in err
    last = err.strip().splitlines()[-1]  # after the warning that the model file differs
    for needle in ("hplan: error:", "build_model()", "RuntimeError: boom", "fix model.py"):
        assert needle in last, (needle, last)


def test_a_model_whose_graph_changed_is_refused_before_the_rehearsal_times_anything(
    mlp_plan, tmp_path, capsys
):
    edited = tmp_path / "model.py"
    text = MLP.read_text()
    assert 'os.environ.get("HPLAN_MLP_WIDTH", "128")' in text
    edited.write_text(text.replace('os.environ.get("HPLAN_MLP_WIDTH", "128")', '"96"'))
    code, _, err = _run(["rehearse", str(mlp_plan), "--steps", "1", "--model", str(edited)], capsys)
    assert code == 2, err
    assert "graph fingerprint" in err.strip().splitlines()[-1]
    assert "timing the whole model" not in err


def test_a_termination_while_importing_the_model_is_not_blamed_on_the_model(tmp_path: Path) -> None:
    from hplan.runtime.capture.model_file import load_model_file
    from hplan.runtime.contract.errors import Terminated

    model = tmp_path / "model.py"
    model.write_text(
        "from hplan.runtime.contract.errors import Terminated\nraise Terminated(143)\n"
    )
    with pytest.raises(Terminated):
        load_model_file(model)


def test_a_terminated_command_says_so_in_one_line(capsys):
    from hplan.planner.cli.main import _invoke
    from hplan.runtime.contract.errors import Terminated

    def terminated() -> None:
        raise Terminated(143)

    assert _invoke(terminated) == 143
    assert capsys.readouterr().err.strip() == "hplan: terminated"


# --------------------------------------------------------------------------- options first
_EXPLODING_MODEL = """\
raise RuntimeError("model file imported")
"""


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--micro-batch-sizes", "8", "-b", "4"], ["--micro-batch-sizes 8", "1..4", "-b"]),
        (["--micro-batch-sizes", "1,2,16", "-b", "8"], ["16 outside 1..8"]),
        (["--time-limit", "0"], ["--time-limit 0"]),
        (["--time-limit", "inf"], ["--time-limit inf"]),
        (["--max-stages", "0"], ["--max-stages 0"]),
        (["--master-port", "70000"], ["--master-port 70000"]),
        (["--profile", "no-such-profile"], ["profile (--profile)", "no-such-profile"]),
        (["--bandwidth", "no-such.json"], ["bandwidth file (--bandwidth)"]),
        (["--offload", "always", "--zero", "always"], ["--offload always and --zero always"]),
    ],
)
def test_options_are_refused_before_the_model_file_is_imported(extra, needles, tmp_path, capsys):
    model = tmp_path / "model.py"
    model.write_text(_EXPLODING_MODEL)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(GOOD_CLUSTER)
    argv = ["solve", str(model), "-c", str(cluster), "-o", str(tmp_path / "out"), *extra]
    code, out, err = _run(argv, capsys)
    assert code == 2
    _assert_one_line_error(err, *needles)
    assert "imported" not in err
    assert out == ""


def test_a_bad_cluster_file_is_refused_before_the_model_file_is_imported(tmp_path, capsys):
    model = tmp_path / "model.py"
    model.write_text(_EXPLODING_MODEL)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(GOOD_CLUSTER.replace("rtx3090", "rtx9999"))
    code, _, err = _run(["solve", str(model), "-c", str(cluster), "-o", str(tmp_path)], capsys)
    assert code == 2
    _assert_one_line_error(err, "rtx9999")
    # and the same model file with good options fails on import: the test model does explode
    cluster.write_text(GOOD_CLUSTER)
    code, _, err = _run(["solve", str(model), "-c", str(cluster), "-o", str(tmp_path)], capsys)
    assert code == 2
    _assert_one_line_error(err, "model file imported")


def test_solve_prints_each_phase_with_its_time_and_the_json_has_them(tmp_path, capsys):
    cluster = CLUSTERS / "cpu-rehearsal.yaml"
    argv = ["solve", str(MLP), "-c", str(cluster), "-o", str(tmp_path), "-b", "8", "--json"]
    code, out, err = _run(argv, capsys)
    assert code == 0, err
    summary = json.loads(out)
    phases = summary["phase_times_s"]
    assert list(phases) == ["cluster", "capture", "cost", "solve", "report", "write"]
    assert all(t >= 0 for t in phases.values())
    assert summary["total_time_s"] >= sum(phases.values())
    assert summary["solve_time_s"] == pytest.approx(phases["solve"])
    last = err.splitlines()[-1]
    assert last.startswith("planned in ")
    assert all(f"{phase} " in last for phase in phases)


@pytest.mark.parametrize(
    ("device", "precision", "needles"),
    [
        ("t4", "bf16", ["(Tesla T4) has no bf16 tensor cores", "fp16"]),
        ("v100-16gb", "tf32", ["has no TF32", "--precision fp32"]),
        ("cpu", "tf32", ["has no TF32", "--precision fp32 or auto"]),
    ],
)
def test_a_precision_the_devices_lack_is_refused_before_the_model_file_is_imported(
    device, precision, needles, tmp_path, capsys
):
    model = tmp_path / "model.py"
    model.write_text(_EXPLODING_MODEL)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(
        f"name: one\nnodes:\n  - name: box\n    host: 10.0.0.1\n    devices: [{{type: {device}}}]\n"
    )
    argv = ["solve", str(model), "-c", str(cluster), "-o", str(tmp_path / "out")]
    code, _, err = _run([*argv, "--precision", precision], capsys)
    assert code == 2
    _assert_one_line_error(err, *needles)
    assert err.startswith("hplan: error:"), repr(err)  # no blank line left by a progress display


def test_a_model_file_imports_the_modules_beside_it(tmp_path, capsys):
    (tmp_path / "layers_beside.py").write_text(MLP.read_text(encoding="utf-8"), encoding="utf-8")
    model = tmp_path / "model.py"
    model.write_text("from layers_beside import build_model, loss_fn, sample_batch  # noqa\n")
    argv = [
        "solve",
        str(model),
        "-c",
        str(CLUSTERS / "cpu-rehearsal.yaml"),
        "-o",
        str(tmp_path / "o"),
    ]
    code, _, err = _run(argv, capsys)
    assert code == 0, err


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (
            ["solve", "m.py", "-c", "c.yaml", "--precision", "fp8"],
            ["'fp8' is not one of", "hplan solve --help"],
        ),
        (["solve", "--no-such-option"], ["No such option '--no-such-option'"]),
        (
            ["solve", "m.py", "-c", "c.yaml", "--offload", "sometimes"],
            ["'sometimes' is not one of", "hplan solve --help"],
        ),
        (
            ["replan", "p.json", "-c", "c.yaml", "--without", "x", "--offload", "x"],
            ["'x' is not one of", "hplan replan --help"],
        ),
        (["no-such-command"], ["No such command", "hplan --help"]),
    ],
)
def test_usage_errors_are_one_line(argv, needles, capsys):
    code, out, err = _run(argv, capsys)
    assert code == 2
    _assert_one_line_error(err, *needles)
    assert "Usage:" not in err and out == ""


# --------------------------------------------------------------------------- training length
def test_solve_records_the_steps_in_the_plan_and_its_launch_scripts(tmp_path, capsys):
    argv = ["solve", str(MLP), "-c", str(CLUSTERS / "cpu-rehearsal.yaml"), "-b", "8"]
    code, _, err = _run([*argv, "-o", str(tmp_path / "a"), "--steps", "250"], capsys)
    assert code == 0, err
    plan = Plan.load(tmp_path / "a" / "plan.json")
    assert (plan.training.steps, plan.training.epochs) == (250, None)
    script = next((tmp_path / "a" / "launch").glob("node-*.sh")).read_text()
    assert "# Training length: 250 optimizer steps, from `hplan solve --steps`" in script
    assert "training   250 optimizer steps" in (tmp_path / "a" / "summary.txt").read_text()
    code, _, err = _run([*argv, "-o", str(tmp_path / "b"), "--steps", "5", "--epochs", "2"], capsys)
    assert code == 2
    _assert_one_line_error(err, "--steps 5 and --epochs 2", "keep one")
    code, _, err = _run([*argv, "-o", str(tmp_path / "c"), "--epochs", "2"], capsys)
    assert code == 2  # examples/mlp has no dataset()
    _assert_one_line_error(err, "--epochs 2", "no dataset()", "--steps N")


def test_replan_keeps_the_training_length(tmp_path, capsys):
    cluster = CLUSTERS / "cpu-rehearsal.yaml"
    argv = ["solve", str(GPT), "-c", str(cluster), "-b", "8", "-o", str(tmp_path / "a")]
    code, _, err = _run([*argv, "--epochs", "3", "--time-limit", "10"], capsys)
    assert code == 0, err
    plan = Plan.load(tmp_path / "a" / "plan.json")
    lost = plan.ranks[-1].device
    code, _, err = _run(
        ["replan", str(tmp_path / "a" / "plan.json"), "-c", str(cluster), "--without", lost,
         "-o", str(tmp_path / "b"), "--time-limit", "10"],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    assert Plan.load(tmp_path / "b" / "plan.json").training.epochs == 3


# --------------------------------------------------------------------------- hplan metrics
def _metrics_run(folder: Path, plan: Plan, *, scale: float = 1.0) -> None:
    """Three steps of every rank of ``plan``: step 0 slow (warm-up), then 40 ms (x scale)
    steps of 10 compute, 20 wait, 4 point-to-point, 2 all-reduce, 1 optimizer, 3 other."""
    from hplan.runtime.contract.metrics_file import EmulationRecord, MetricsWriter, StepMetrics

    for rank in plan.ranks:
        writer = MetricsWriter(folder, rank.rank)
        for step in range(3):
            warm = 10.0 if step == 0 else 1.0
            parts = {"compute": 10, "p2p": 4, "wait": 20, "allreduce": 2, "optimizer": 1}
            last = rank.stage == len(plan.replica_ranks(rank.replica)) - 1
            writer.write(
                StepMetrics(
                    rank=rank.rank, replica=rank.replica, stage=rank.stage, step=step,
                    step_time_s=0.040 * scale * warm, other_time_s=0.003 * scale * warm,
                    **{f"{k}_time_s": v / 1e3 * scale * warm for k, v in parts.items()},
                    loss=2.0 - step if last else None, samples=rank.num_samples,
                    peak_memory_bytes=1,
                )
            )  # fmt: skip
        writer.close()
    if scale != 1.0:
        EmulationRecord(time_scale=scale).save(folder)


def test_metrics_prints_the_step_breakdown_and_the_measured_over_predicted_ratio(tmp_path, capsys):
    from tests.fixtures.sample_plans import cpu_plan

    plan = cpu_plan()  # 3 stages, global batch 8; predicted 51.2 ms, 156.25 samples/s
    _metrics_run(tmp_path / "run", plan)
    (tmp_path / "plan.json").write_text(plan.to_json())
    code, out, err = _run(
        ["metrics", str(tmp_path / "run"), "--plan", str(tmp_path / "plan.json"), "--json"],
        capsys,
    )
    assert code == 0, err
    summary = json.loads(out)
    assert summary["step_time_s"] == pytest.approx(0.040)  # the warm-up step is left out
    assert summary["samples_per_s"] == pytest.approx(8 / 0.040)
    assert summary["measured_over_predicted"] == pytest.approx(200 / 156.25)
    assert (summary["num_steps"], summary["timed_steps"], summary["final_loss"]) == (3, 2, 0.0)
    rank = summary["ranks"][1]
    assert rank["device"] == "localhost/1"
    assert rank["wait_time_s"] == pytest.approx(0.020) and rank["wait_share"] == pytest.approx(0.5)
    assert rank["other_time_s"] == pytest.approx(0.003)
    assert "measured/predicted 1.28x" in err and "200.0 samples/s" in err
    assert "20.0 50%" in err  # wait: ms and share of the step, in the table
    # a rehearsal's emulated seconds are divided by its time scale; the plan it wrote is found
    _metrics_run(tmp_path / "rehearsal", plan, scale=4.0)
    (tmp_path / "rehearsal" / "plan.json").write_text(plan.to_json())
    code, out, err = _run(["metrics", str(tmp_path / "rehearsal"), "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["step_time_s"] == pytest.approx(0.040)
    assert "time scale 4" in err


def test_metrics_of_another_plan_or_no_run_is_one_line(tmp_path, capsys):
    from tests.fixtures.sample_plans import cpu_plan, datacentre_plan

    code, _, err = _run(["metrics", str(tmp_path / "none")], capsys)
    assert code == 2
    _assert_one_line_error(err, "does not exist")
    _metrics_run(tmp_path / "run", cpu_plan())
    (tmp_path / "other.json").write_text(datacentre_plan().to_json())
    code, _, err = _run(
        ["metrics", str(tmp_path / "run"), "--plan", str(tmp_path / "other.json")], capsys
    )
    assert code == 2
    _assert_one_line_error(err, "ranks [0, 1, 2]", "the plan runs [0, 1]")


def test_metrics_of_a_run_whose_ranks_ran_other_shares_than_the_plan_is_one_line(tmp_path, capsys):
    from tests.fixtures.sample_plans import cpu_plan

    plan = cpu_plan()
    _metrics_run(tmp_path / "run", plan)
    (tmp_path / "plan.json").write_text(plan.to_json())
    rank0 = tmp_path / "run" / "rank-0.jsonl"
    lines = [json.loads(line) for line in rank0.read_text().splitlines()]
    rank0.write_text("".join(json.dumps({**line, "samples": 999}) + "\n" for line in lines))
    code, _, err = _run(
        ["metrics", str(tmp_path / "run"), "--plan", str(tmp_path / "plan.json")], capsys
    )
    assert code == 2
    _assert_one_line_error(err, "a run of another plan", "rank 0 ran replica 0 stage 0 with 999")


# --------------------------------------------------------------------------- incomplete plans
def _edited_plan(plan_path: Path, out: Path, edit) -> Path:
    data = json.loads(plan_path.read_text())
    edit(data)
    out.write_text(json.dumps(data))
    return out


@pytest.mark.parametrize(
    "command",
    [
        ["show", "{plan}"],
        ["simulate", "{plan}"],
        ["rehearse", "{plan}", "--steps", "1"],
        ["calibrate", "{plan}", "{runs}"],
        ["replan", "{plan}", "-c", str(CLUSTERS / "cpu-rehearsal.yaml"), "--without", "slow"],
        ["run", "{plan}", "--node", "fast"],
        [
            "solve",
            str(MLP),
            "-c",
            str(CLUSTERS / "cpu-rehearsal.yaml"),
            "-o",
            "{runs}",
            "--previous",
            "{plan}",
        ],
    ],
    ids=lambda argv: argv[0],
)
def test_every_command_refuses_a_plan_without_its_memory_section(
    command, mlp_plan, tmp_path, capsys
):
    plan = _edited_plan(mlp_plan, tmp_path / "plan.json", lambda d: d.pop("memory"))
    (tmp_path / "runs").mkdir()
    argv = [a.format(plan=plan, runs=tmp_path / "runs") for a in command]
    code, _, err = _run(argv, capsys)
    assert code == 2
    _assert_one_line_error(err, "no 'memory' section", "re-run `hplan solve`")


def test_a_non_boolean_optimizer_offload_is_refused(mlp_plan, tmp_path, capsys):
    def offload_yes(data):
        data["ranks"][0]["optimizer_offload"] = "yes"

    plan = _edited_plan(mlp_plan, tmp_path / "plan.json", offload_yes)
    code, _, err = _run(["show", str(plan)], capsys)
    assert code == 2
    _assert_one_line_error(err, "ranks.0.optimizer_offload' is 'yes'", "true or false")


@pytest.mark.parametrize("command", ["show", "simulate"])
def test_a_plan_whose_devices_lost_their_memory_is_refused(command, mlp_plan, tmp_path, capsys):
    def tiny_devices(data):
        for device in data["cluster"]["devices"]:
            device["memory_bytes"] = 1000

    plan = _edited_plan(mlp_plan, tmp_path / "plan.json", tiny_devices)
    code, _, err = _run([command, str(plan)], capsys)
    assert code == 2
    _assert_one_line_error(err, "does not fit in memory", "rank 0")


def test_a_plan_given_as_cluster_is_named_a_plan(mlp_plan, tmp_path, capsys):
    code, _, err = _run(["solve", str(MLP), "-c", str(mlp_plan), "-o", str(tmp_path)], capsys)
    assert code == 2
    _assert_one_line_error(err, "is a plan (plan.json), not a cluster file")


def test_a_plan_given_as_profile_is_named_a_plan(mlp_plan, tmp_path, capsys):
    argv = ["solve", str(MLP), "-c", str(CLUSTERS / "cpu-rehearsal.yaml"), "-o", str(tmp_path)]
    code, _, err = _run([*argv, "--profile", str(mlp_plan)], capsys)
    assert code == 2
    _assert_one_line_error(err, f"'{mlp_plan}' is a plan, not a profile")
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"schema_version": 1, "devices": []}))
    code, _, err = _run(["show", str(profile)], capsys)
    assert code == 2
    _assert_one_line_error(err, "is not a plan", "the plan.json `hplan solve` wrote")


def test_a_metrics_folder_of_an_earlier_run_is_refused_not_overwritten(mlp_plan, tmp_path, capsys):
    from hplan.runtime.executor.cli import main as runtime_main

    metrics = tmp_path / "m"
    metrics.mkdir()
    (metrics / "rank-1.jsonl").write_text("earlier\n")
    code, _, err = _run(
        ["rehearse", str(mlp_plan), "--steps", "1", "--metrics-dir", str(metrics)], capsys
    )
    assert code == 2
    _assert_one_line_error(
        err, "already holds an earlier run's metrics (rank-1.jsonl)", "new folder"
    )
    check = [
        "check",
        str(mlp_plan),
        "--node",
        "fast",
        "--steps",
        "1",
        "--metrics-dir",
        str(metrics),
    ]
    assert runtime_main(check) == 2
    _assert_one_line_error(capsys.readouterr().err, "already holds an earlier run's metrics")
    assert (metrics / "rank-1.jsonl").read_text() == "earlier\n"
    assert sorted(p.name for p in metrics.iterdir()) == ["rank-1.jsonl"]


def test_devices_lists_the_catalog_with_its_figures_and_sources(capsys):
    from hplan.planner.hardware.catalog import device_type_names

    code, out, _ = _run(["devices", "--json"], capsys)
    assert code == 0
    rows = json.loads(out)
    assert [r["type"] for r in rows] == list(device_type_names())
    a100 = next(r for r in rows if r["type"] == "a100-80gb")
    assert a100["bf16_flops_per_s"] == 312e12 and a100["source"]
    code, _, err = _run(["devices"], capsys)
    assert code == 0 and "rtx4090" in err and "memory GiB" in err
