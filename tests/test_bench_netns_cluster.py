"""bench/netns_cluster.py's core packing without a cluster (the benchmarks that build one
need root and namespaces; `make test` does not run them)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from netns_cluster import pack_cores  # noqa: E402


def test_the_benchmark_quotas_pack_the_fast_node_alone_and_the_slow_ones_together() -> None:
    assert pack_cores((0.9, 0.45, 0.45), [0, 1]) == [(0,), (1,), (1,)]
    assert pack_cores((0.45, 0.9, 0.45), [2, 5]) == [(5,), (2,), (5,)]


def test_quotas_that_do_not_fit_leave_every_node_unpinned() -> None:
    assert pack_cores((0.6, 0.6, 0.6), [0, 1]) == [None, None, None]
    assert pack_cores((1.5, 0.6), [0, 1]) == [None, None]


def test_a_quota_above_one_core_takes_whole_cores() -> None:
    assert pack_cores((1.5, 0.4, 0.5), [0, 1, 2]) == [(0, 1), (2,), (2,)]
