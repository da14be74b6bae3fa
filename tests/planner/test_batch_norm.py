"""A model with BatchNorm in train mode: the planner never gives it a micro-batch of one
sample (one sample has no variance), the plan carries that floor, and a note says that
batch norm sees each micro-batch's statistics."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from hplan.planner.cli.main import main
from hplan.planner.cost.even_microbatches import floored
from hplan.planner.cost.layout import Layout, ReplicaLayout, StageLayout
from hplan.planner.emit.report import batch_statistics_notes
from hplan.planner.solve.solver import SolveOptions, solve
from hplan.planner.solve.validate import layout_problems
from hplan.runtime.contract.plan import microbatch_sizes
from tests.fixtures.problems import GB, Dev, make_problem

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "examples" / "clusters" / "cpu-rehearsal.yaml"
FAST = SolveOptions(time_limit_s=10, watchdog=False)

BN_MLP = """
import torch
from torch import nn


def build_model():
    return nn.Sequential(
        nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)
    )


def sample_batch(batch_size):
    return torch.randn(batch_size, 8), torch.randn(batch_size, 4)


def loss_fn(outputs, targets):
    return nn.functional.mse_loss(outputs, targets)
"""


def _smallest(layout: Layout) -> int:
    return min(min(microbatch_sizes(r.num_samples, r.micro_batch_size)) for r in layout.replicas)


# Without the floor the solver gives the slowest device one sample of these batches.
@pytest.mark.parametrize(
    ("speeds", "global_batch_size"),
    [((1.0, 0.3), 7), ((2.0, 1.0, 1.0), 7), ((1.0, 1.0, 1.0), 5), ((3.0, 1.0), 5)],
)
def test_the_solver_never_gives_a_batch_norm_model_a_micro_batch_of_one(
    speeds: tuple[float, ...], global_batch_size: int
) -> None:
    problem = make_problem(
        [Dev("a", s, 100 * GB) for s in speeds],
        unit_work=[1.0, 1.0],
        global_batch_size=global_batch_size,
        micro_batch_sizes=(2, 4),
        grad_bytes=1e6,
        per_microbatch_overhead_s=0.01,
    )
    result = solve(replace(problem, min_microbatch_samples=2), FAST)
    assert _smallest(result.layout) >= 2
    assert sum(r.num_samples for r in result.layout.replicas) == global_batch_size


def test_a_layout_below_the_floor_is_rejected_and_floored_lifts_it() -> None:
    problem = replace(
        make_problem(
            [Dev("a", 1.0, 100 * GB)] * 3,
            unit_work=[1.0],
            global_batch_size=7,
            micro_batch_sizes=(2, 4),
        ),
        min_microbatch_samples=2,
    )
    layout = Layout(
        (
            ReplicaLayout((StageLayout(0, 0, 1),), 2, 3, 5),  # 2 + 2 + 1
            ReplicaLayout((StageLayout(1, 0, 1),), 1, 1, 1),  # 1
            ReplicaLayout((StageLayout(2, 0, 1),), 1, 1, 1),  # 1
        )
    )
    assert any("below the model's floor of 2" in p for p in layout_problems(problem, layout))
    lifted = floored(problem, layout)
    assert _smallest(lifted) >= 2 and not layout_problems(problem, lifted)
    assert sum(r.num_samples for r in lifted.replicas) == 7


def test_the_note_says_batch_norm_sees_small_micro_batches() -> None:
    layout = Layout(
        (
            ReplicaLayout((StageLayout(0, 0, 1),), 4, 2, 7),
            ReplicaLayout((StageLayout(1, 0, 1),), 3, 1, 3),
        )
    )
    (note,) = batch_statistics_notes(("bn1", "layer1.0.bn1"), layout)
    assert "2 layers: bn1, layer1.0.bn1" in note and "3 to 4 of the 10 samples" in note
    assert "below 16 samples its statistics are noisy" in note
    whole = Layout((ReplicaLayout((StageLayout(0, 0, 1),), 10, 1, 10),))
    assert batch_statistics_notes(("bn1",), whole) == ()  # one process's statistics
    assert batch_statistics_notes((), layout) == ()


def _solve(model: Path, out: Path, capsys, *extra: str) -> tuple[int, str]:
    argv = ["solve", str(model), "-c", str(CLUSTER), "-o", str(out), "--time-limit", "20"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, *extra])
    _, err = capsys.readouterr()
    return int(exit_info.value.code or 0), err


def test_a_batch_norm_plan_carries_its_floor_and_a_batch_of_one_is_refused(
    tmp_path: Path, capsys
) -> None:
    model = tmp_path / "model.py"
    model.write_text(BN_MLP)
    code, err = _solve(model, tmp_path / "out", capsys, "-b", "7")
    assert code == 0, err
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["training"]["min_microbatch_samples"] == 2
    code, err = _solve(model, tmp_path / "one", capsys, "-b", "1")
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "global batch size 1" in lines[0] and "at least 2 samples" in lines[0]
    code, err = _solve(model, tmp_path / "ones", capsys, "-b", "4", "--micro-batch-sizes", "1")
    assert code == 2 and "--micro-batch-sizes" in err and "give 2 or more" in err, err
    # a capture file keeps the batch-norm layers: a solve from it knows them too
    with pytest.raises(SystemExit) as exit_info:
        main(["capture", str(model), "-o", str(tmp_path / "capture.json")])
    assert not exit_info.value.code, capsys.readouterr().err
    capture = json.loads((tmp_path / "capture.json").read_text())
    assert capture["batch_statistics"] == ["1"]
    code, err = _solve(model, tmp_path / "one-from-file", capsys, "-b", "1", "--capture",
                       str(tmp_path / "capture.json"))  # fmt: skip
    assert code == 2 and "at least 2 samples" in err, err
