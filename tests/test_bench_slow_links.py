"""bench/slow_links.py without a cluster: its options, its skip lines, and the time to target
and loss penalty it computes from a run's losses (the benchmark itself needs root and
namespaces; `make test` does not run it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import slow_links  # noqa: E402
import slow_links_report  # noqa: E402
import time_to_target  # noqa: E402

from hplan.runtime.contract.plan import Plan  # noqa: E402

LOCAL_SGD_PLAN = ROOT / "tests" / "golden" / "mixed-3090-4090" / "plan.json"
"""A plan whose cross-island groups are ``local_sgd`` H=8, one fragment each."""


def test_all_reduce_is_solved_first_and_every_mode_once() -> None:
    args = slow_links.parse_args(["--modes", "auto,ddp,all_reduce,streaming/int8,auto"])
    assert [m.label for m in args.modes] == ["all_reduce", "auto", "ddp", "streaming/int8"]
    assert args.rates == [100.0, 20.0]
    assert args.layout == "1+1+1"
    # N = 30,720 samples: 1,280 steps of 24; local rows 20% more; seeds 0, 1, 2
    assert (args.num_steps, args.local_steps, args.seed_list) == (1280, 1536, [0, 1, 2])


def test_smoke_is_one_seed_of_a_few_steps_at_100_mbit() -> None:
    args = slow_links.parse_args(["--smoke", "--modes", "ddp,local_sgd"])
    assert (args.num_steps, args.seed_list, args.rates) == (40, [0], [100.0])
    args = slow_links.parse_args(["--smoke", "--rates", "20", "--global-batch", "48"])
    assert (args.num_steps, args.rates, args.model.global_batch) == (20, [20.0], 48)


@pytest.mark.parametrize(
    ("modes", "expected"),
    [("diloco", "unknown mode 'diloco'; valid: ddp, all_reduce"), ("ddp/int8", "the wire is")],
)
def test_an_unknown_mode_is_refused_with_the_valid_ones(capsys, modes, expected) -> None:
    with pytest.raises(SystemExit) as exit_:
        slow_links.parse_args(["--modes", modes])
    assert exit_.value.code == 2
    assert expected in capsys.readouterr().err


def test_a_mode_this_solve_lacks_is_skipped_with_its_reason() -> None:
    choices = {"--sync": ("auto", "all_reduce", "local_sgd", "async")}
    assert slow_links.unsupported(slow_links.parse_mode("local_sgd"), choices) is None
    assert slow_links.unsupported(slow_links.parse_mode("ddp"), {}) is None
    assert slow_links.unsupported(slow_links.parse_mode("all_reduce"), {}) is None
    why = slow_links.unsupported(slow_links.parse_mode("streaming"), choices)
    assert why == "this `hplan solve` has no --sync streaming"
    why = slow_links.unsupported(slow_links.parse_mode("local_sgd/int4"), choices)
    assert why == "this `hplan solve` has no --wire int4"


def test_a_machine_without_namespaces_is_one_line_and_exit_0(monkeypatch, capsys) -> None:
    monkeypatch.setattr(slow_links, "available", lambda: "needs root")
    slow_links.main(["--rates", "100"])
    assert capsys.readouterr().out == "slow_links: skipped: needs root\n"


def test_islands_shape_only_the_links_between_them() -> None:
    assert slow_links.island_nodes("1+1+1") == (("a0",), ("b0",), ("c0",))
    islands = slow_links.island_nodes("2+1")
    assert islands == (("a0", "a1"), ("b0",))
    rates = [n.rate_mbit_per_s for n in slow_links.node_shapes(islands, 20.0, 0.6)]
    assert rates == [slow_links.FAST_MBIT_PER_S, slow_links.FAST_MBIT_PER_S, 20.0]
    assert slow_links.intra_island_pairs(islands) == {("a0", "a1"): slow_links.FAST_MBIT_PER_S}


def test_loss_windows_average_whole_rounds_and_skip_unknown_steps() -> None:
    assert time_to_target.window_steps(16, 1, 640) == 16
    assert time_to_target.window_steps(16, 6, 640) == 18
    assert time_to_target.window_steps(16, 62, 20) == 20  # a smoke run shorter than H
    means = time_to_target.trailing_means([4.0, 2.0, None, 6.0, 2.0], 2)
    assert means == [None, 3.0, None, None, 4.0]


def test_the_target_is_the_first_mean_at_or_below_it_timed_without_step_0() -> None:
    assert time_to_target.steps_to_target([None, 3.0, 2.5, 2.0, 2.4], 2.5) == 2
    assert time_to_target.steps_to_target([None, 3.0], 2.5) is None
    ends = [100.0, 101.0, 102.0, 104.0]  # step 0's start-up is not in the ends
    assert time_to_target.time_to_step_s(ends, 3) == pytest.approx(4 * 4 / 3)
    assert time_to_target.time_to_step_s(ends, 0) == pytest.approx(1.0)
    assert time_to_target.extrapolated_time_s(960, 48.0) == 20.0
    with pytest.raises(ValueError, match="step 4 of 4"):
        time_to_target.time_to_step_s(ends, 4)


def test_spread_and_medians_over_seeds() -> None:
    assert time_to_target.relative_spread([2.0]) is None
    # pairs: 0.2/2.1, 0.4/2.2, 0.2/2.3
    assert time_to_target.relative_spread([2.0, 2.2, 2.4]) == pytest.approx(0.2 / 2.1)
    assert time_to_target.median_known([None, 3.0, float("nan"), 1.0]) == 2.0
    assert time_to_target.median_known([None]) is None


def _args(loss_steps: int = 2) -> argparse.Namespace:
    return argparse.Namespace(global_batch=10, loss_steps=loss_steps)


def test_a_local_run_is_timed_to_the_reference_at_n_and_a_synchronous_one_extrapolated() -> None:
    plan = Plan.load(LOCAL_SGD_PLAN)  # local_sgd H=8: losses over 8 steps
    reference = [10.0 - 0.5 * s for s in range(16)]  # steps 8 .. 15 (N = 16): mean 4.25
    local = slow_links_report.Run("hplan local_sgd", Path("p"), plan)
    own = [10.5 - 0.5 * s for s in range(20)]  # mean over steps 9 .. 16: 4.25
    ends = [float(s) for s in range(20)]
    trial = slow_links_report.Trial(list(own), ends, 10.0)
    ddp = slow_links_report.Run("DDP 5:5")
    ddp.trials[0] = slow_links_report.Trial([], [], 2.0)  # 160 samples at 2/s: 80 s
    local.trials[0] = trial
    result = slow_links_report.RateResult(100.0, [local, ddp])
    ref = slow_links_report.Reference(slow_links_report.Run("reference"))
    ref.run.trials[0] = slow_links_report.Trial(reference, [], 1.0)
    rows = slow_links_report.run_figures(result, ref, 16, _args())
    figs = rows[0]["seeds"][0]
    assert (figs["window_steps"], figs["target"], figs["step"]) == (8, 4.25, 16)
    assert figs["time_s"] == pytest.approx(17.0)  # 16 spacings of 1 s for steps 0 .. 16
    assert (figs["loss"], figs["penalty"]) == (4.75, pytest.approx(4.75 / 4.25 - 1))
    assert figs["x_ddp"] == pytest.approx(80.0 / 17.0)
    assert rows[1]["seeds"][0] | {"target": None} == {
        "window_steps": 2, "target": None, "samples_per_s": 2.0, "step": 15,
        "time_s": 80.0, "loss": None, "penalty": None, "x_ddp": 1.0,
    }  # fmt: skip
    assert slow_links.sync_text(plan) == "local_sgd H=8"


def test_a_run_that_never_reaches_the_target_counts_as_zero_x_ddp() -> None:
    assert slow_links_report._x_ddp(80.0, None) == 0.0
    assert slow_links_report._x_ddp(None, 10.0) is None
    assert slow_links_report._x_ddp(80.0, 20.0) == 4.0


def test_the_estimate_counts_local_rows_to_n_and_synchronous_rows_at_the_link() -> None:
    args = slow_links.parse_args(
        [
            "--rates",
            "100",
            "--seeds",
            "1",
            "--samples",
            "480",
            "--loss-steps",
            "4",
            "--global-batch",
            "48",
        ]
    )
    pace = slow_links.Pace(step_s=1.0, start_s=0.0)
    seconds = slow_links.estimate_s(args, (1, 1), pace, gradient_bytes=4_687_500, num_nodes=3)
    # reference 10 steps + 28 DDP steps on fast links of 1 s; 12 local steps; 28 steps of 1 s
    # + a ring all-reduce sending 2 x 2/3 of the gradients, 6.25 MB at 100 Mbit/s: 0.5 s;
    # 3 profiles, the links, 2 solves
    assert seconds == pytest.approx(10 + 28 + 12 + 28 * 1.5 + 3 * 30 + 110 + 2 * 5)


def test_ddp_share_and_the_bar_are_said_in_one_line_each() -> None:
    ddp = slow_links_report.Run("DDP 16:16:16")
    ddp.trials = {
        0: slow_links_report.Trial([], [], 100.0),
        1: slow_links_report.Trial([], [], 80.0),
    }
    reference = slow_links_report.Reference(slow_links_report.Run("reference"), 360.0)
    result = slow_links_report.RateResult(100.0, [ddp])
    (line,) = slow_links_report.ddp_share_lines(result, reference)
    assert line == (
        "DDP 16:16:16: 75% of its step is communication at 100 Mbit/s (against fast links): "
        "communication-bound; a row whose every sync is hidden is at most 4.0x DDP"
    )
    row = {"run": "hplan streaming", "local": True, "seeds": {
        0: {"x_ddp": 4.5, "penalty": 0.004}, 1: {"x_ddp": 3.9, "penalty": 0.002},
        2: {"x_ddp": 4.2, "penalty": 0.009}}}  # fmt: skip
    (line,) = slow_links_report.verdict_lines([row], 0.005)
    assert line.startswith("hplan streaming: 4.20x DDP, penalty +0.40% against a spread of 0.50%")
    assert "meets the bar" in line
    (line,) = slow_links_report.verdict_lines([row], 0.003)
    assert "misses the bar" in line
