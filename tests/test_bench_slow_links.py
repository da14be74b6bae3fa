"""bench/slow_links.py without a cluster: its options, its skip line and its loss windows
(the benchmark itself needs root and namespaces; `make test` does not run it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import slow_links  # noqa: E402

from hplan.runtime.contract.plan import Plan  # noqa: E402

LOCAL_SGD_PLAN = ROOT / "tests" / "golden" / "mixed-3090-4090" / "plan.json"
"""A plan whose cross-island groups are ``local_sgd`` H=8, one fragment each."""


def test_all_reduce_is_always_solved_first_and_once() -> None:
    args = slow_links.parse_args(["--modes", "auto,all_reduce,auto", "--rates", "100,20"])
    assert args.modes == ["all_reduce", "auto"]
    assert args.rates == [100.0, 20.0]


def test_an_unknown_mode_is_refused_with_the_valid_ones(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        slow_links.parse_args(["--modes", "diloco"])
    assert exit_.value.code == 2
    assert "valid: all_reduce, auto, local_sgd, async" in capsys.readouterr().err


def test_a_machine_without_namespaces_is_one_line_and_exit_0(monkeypatch, capsys) -> None:
    monkeypatch.setattr(slow_links, "available", lambda: "needs root")
    slow_links.main(["--rates", "100"])
    assert capsys.readouterr().out == "slow_links: skipped: needs root\n"


def test_local_sgd_losses_are_taken_where_the_outer_step_synced() -> None:
    plan = Plan.load(LOCAL_SGD_PLAN)
    assert slow_links.synced_steps(plan, 20) == [0, 8, 16]
    assert slow_links.loss_window(plan, 48, 3) == (
        [24, 32, 40],
        "3 round starts, synced parameters",
    )
    assert slow_links.loss_window(None, 48, 3) == ([45, 46, 47], "last 3 steps")


def test_islands_shape_only_the_links_between_them() -> None:
    islands = slow_links.island_nodes("2+1")
    assert islands == (("a0", "a1"), ("b0",))
    rates = [n.rate_mbit_per_s for n in slow_links.node_shapes(islands, 20.0, 0.6)]
    assert rates == [slow_links.FAST_MBIT_PER_S, slow_links.FAST_MBIT_PER_S, 20.0]
    assert slow_links.intra_island_pairs(islands) == {("a0", "a1"): slow_links.FAST_MBIT_PER_S}
