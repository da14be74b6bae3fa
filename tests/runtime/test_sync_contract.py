"""The plan's islands and cross-island sync groups (``SyncSpec``): what a valid plan says,
and which ranks sum which gradients every step (``contract/holders.py``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hplan.runtime.contract.errors import PlanFileError
from hplan.runtime.contract.holders import (
    island_of_rank,
    island_samples,
    outer_exchange_groups,
    outer_fragments,
    outer_groups,
    outer_island_holders,
    parameter_holders,
    step_holders,
    sync_summary,
)
from hplan.runtime.contract.plan import IslandSpec, OuterSyncSpec, Plan, SyncMode, SyncSpec
from tests.fixtures.sample_plans import mixed_plan


def _with_sync(plan: Plan, sync: SyncSpec | None) -> Plan:
    return replace(plan, training=replace(plan.training, sync=sync))


def test_a_local_sgd_plan_round_trips_and_names_its_mode() -> None:
    plan = mixed_plan()
    assert Plan.from_json(plan.to_json()) == plan
    assert sync_summary(plan) == "local_sgd H=8 across islands box-a | box-b"
    assert island_of_rank(plan) == {0: "box-a", 1: "box-a", 2: "box-b", 3: "box-b", 4: "box-b"}
    assert island_samples(plan) == {"box-a": 24, "box-b": 16}


def test_local_groups_sum_gradients_inside_each_island_only() -> None:
    plan = mixed_plan()
    every_step = step_holders(plan)
    held = parameter_holders(plan)
    island = island_of_rank(plan)
    for name, sets in every_step.items():
        assert sorted(r for s in sets for r in s) == list(held[name])
        assert all(len({island[r] for r in s}) == 1 for s in sets)
    synchronous = _with_sync(plan, replace(plan.training.sync, groups=()))  # type: ignore[arg-type]
    assert sync_summary(synchronous) == "all_reduce"
    assert step_holders(synchronous) == {n: (r,) for n, r in held.items()}
    assert all(g.mode is SyncMode.ALL_REDUCE for g in outer_groups(synchronous).values())


def test_without_islands_nothing_spans_and_every_holder_set_sums_every_step() -> None:
    plan = _with_sync(mixed_plan(), None)
    assert outer_groups(plan) == {}
    assert set(island_of_rank(plan).values()) == {""}
    assert step_holders(plan) == {n: (r,) for n, r in parameter_holders(plan).items()}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: replace(s, islands=s.islands[:1]), "every node of the cluster once"),
        (
            lambda s: replace(s, islands=(s.islands[0], replace(s.islands[1], name="box-a"))),
            "island names repeat",
        ),
        (lambda s: replace(s, groups=s.groups + s.groups[:1]), "sorted|listed twice"),
        (
            lambda s: replace(s, groups=(OuterSyncSpec(ranks=(0, 1), mode=SyncMode.LOCAL_SGD),)),
            "not a holder set spanning",
        ),
        (
            lambda s: replace(s, groups=(replace(s.groups[0], num_fragments=9),)),
            "9 fragments for 8 local steps",
        ),
        (
            lambda s: replace(s, groups=(replace(s.groups[0], mode=SyncMode.ALL_REDUCE),)),
            "local_steps must be 1",
        ),
        (
            lambda s: replace(s, islands=(IslandSpec(name="all", nodes=("box-a", "box-b")),)),
            "not a holder set spanning",
        ),
    ],
)
def test_inconsistent_sync_specs_are_refused_in_one_line(change, message: str) -> None:  # type: ignore[no-untyped-def]
    plan = mixed_plan()
    assert plan.training.sync is not None
    bad = _with_sync(plan, change(plan.training.sync))
    with pytest.raises(PlanFileError, match=message):
        bad.verify()


def test_a_replica_across_islands_is_refused_when_islands_train_locally() -> None:
    plan = mixed_plan()
    assert plan.training.sync is not None
    # split box-b's three-stage replica: rank 4 alone on an island of its own node
    moved = replace(
        plan,
        cluster=replace(
            plan.cluster,
            nodes=(
                *plan.cluster.nodes,
                replace(plan.cluster.nodes[1], name="box-c", devices=()),
            ),
        ),
        ranks=tuple(replace(r, node="box-c") if r.rank == 4 else r for r in plan.ranks),
    )
    islands = (*plan.training.sync.islands, IslandSpec(name="box-c", nodes=("box-c",)))
    groups = tuple(
        OuterSyncSpec(ranks=ranks, mode=SyncMode.LOCAL_SGD, local_steps=4)
        for ranks in sorted(outer_groups(_with_sync(moved, SyncSpec(islands=islands))))
    )
    with pytest.raises(PlanFileError, match="replica 1 spans islands"):
        _with_sync(moved, SyncSpec(islands=islands, groups=groups)).verify()


def test_fragments_are_contiguous_and_of_about_equal_bytes() -> None:
    names = [f"p{i}" for i in range(10)]
    sizes = dict(zip(names, [4, 4, 4, 4, 4, 4, 4, 4, 4, 4], strict=True))
    group = OuterSyncSpec(ranks=(0, 1), mode=SyncMode.ASYNC, local_steps=8, num_fragments=3)
    fragments = outer_fragments(group, names, sizes)
    assert [n for f in fragments for n in f] == names
    assert [len(f) for f in fragments] == [3, 4, 3]
    assert len(outer_fragments(replace(group, num_fragments=12), names[:2], sizes)) == 2
    big = dict(sizes, p0=100)
    assert outer_fragments(replace(group, num_fragments=2), names, big)[0] == ("p0",)


def test_a_quantized_exchange_runs_among_the_island_leads_then_inside_each_island() -> None:
    plan = mixed_plan()  # box-a: ranks 0, 1; box-b: ranks 2, 3, 4
    groups = outer_groups(plan)
    tied, pair = groups[(0, 1, 2, 4)], groups[(1, 3)]
    assert outer_island_holders(plan, tied) == {"box-a": (0, 1), "box-b": (2, 4)}
    assert outer_exchange_groups(plan, tied) == ((0, 2), (0, 1), (2, 4))
    assert outer_exchange_groups(plan, pair) == ((1, 3),)  # one holder per island: no more
