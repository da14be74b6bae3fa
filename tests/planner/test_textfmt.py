"""Human text helpers (planner/textfmt.py) where their output is a promise: memory shown."""

from __future__ import annotations

from hplan.planner.cost.layout import Layout, ReplicaLayout, StageLayout
from hplan.planner.solve.validate import layout_problems
from hplan.runtime.contract.quantities import format_bytes_pair
from tests.fixtures.problems import Dev, make_problem


def test_byte_pairs_always_show_their_figures():
    assert format_bytes_pair(11.04e9, 11.0e9) == ("11.04 GB", "11.00 GB")
    assert format_bytes_pair(12.3e9, 10.6e9) == ("12.3 GB", "10.6 GB")
    assert format_bytes_pair(3.2e6, 1.5e9) == ("3.2 MB", "1.5 GB")
    assert format_bytes_pair(2.5e6, 2.0e6) == ("2.5 MB", "2.0 MB")
    assert format_bytes_pair(2500.0, 700.0) == ("2.5 kB", "0.7 kB")
    assert format_bytes_pair(512.0, 100.0) == ("512 B", "100 B")


def test_the_validator_prints_small_devices_in_a_unit_that_shows_them():
    problem = make_problem(
        [Dev("a", 1.0, 2e6)], unit_work=[1.0], global_batch_size=1, static_bytes=3e6,
        act_bytes_per_sample=1e5,
    )  # fmt: skip
    layout = Layout((ReplicaLayout((StageLayout(0, 0, 1),), 1, 1, 1),))
    (problem_text,) = layout_problems(problem, layout)
    assert problem_text.endswith("needs 3.1 MB, has 2.0 MB")
