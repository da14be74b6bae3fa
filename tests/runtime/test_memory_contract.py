"""The memory formula of ``contract.memory``, the ZeRO shards of ``holders`` and optimizer
offload's host memory: plan-only, no torch."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from hplan.runtime.contract.holders import optimizer_shards, parameter_holders, step_holders
from hplan.runtime.contract.memory import (
    CPU_RESERVE_BYTES,
    OPTIMIZER_STEP_WORKSPACE,
    check_fits,
    host_capacity_bytes,
    in_flight_microbatches,
    memory_problems,
    offload_device_saving_bytes,
    offload_host_bytes,
    parameter_numels,
    plan_memory,
    stage_activation_bytes,
)
from hplan.runtime.contract.plan import (
    MemoryModelSpec,
    MemoryStrategy,
    ParameterSpec,
    Plan,
    PlanFileError,
    Schedule,
    UnitMemorySpec,
    ZeroStage,
)
from tests.fixtures.sample_plans import cpu_plan, datacentre_plan, mixed_plan

NUMEL = 1000


def _with_memory(
    plan: Plan, *, per_sample: float = 1e4, frozen: int = 0, numel: int = NUMEL
) -> Plan:
    names = dict.fromkeys(p for u in plan.units for p in u.params)
    spec = MemoryModelSpec(
        optimizer_state_bytes_per_param_byte=2.0,
        parameters=tuple(ParameterSpec(name=n, num_elements=numel, element_bytes=4) for n in names),
        units=tuple(
            UnitMemorySpec(unit=u.name, activation_bytes_per_sample=per_sample, frozen_bytes=frozen)
            for u in plan.units
        ),
    )
    out = replace(plan, memory=spec)
    out.verify()
    return out


def test_shards_cover_each_holder_sets_parameters_once_in_proportion_to_the_weights() -> None:
    plan = _with_memory(datacentre_plan())
    weights = {r.rank: float(r.rank % 3) + (r.rank == 0) for r in plan.ranks}
    plan = replace(
        plan,
        ranks=tuple(replace(r, optimizer_shard_weight=weights[r.rank]) for r in plan.ranks),
        training=replace(plan.training, zero_stage=ZeroStage.OPTIMIZER_STATE),
    )
    plan.verify()
    shards = optimizer_shards(plan, parameter_numels(plan.memory))
    held = parameter_holders(plan)
    assert shards, "the mixed plan has replicas, so some holder set has two or more ranks"
    for ranks, shard in shards.items():
        assert all(held[n] == ranks for n in shard.names)
        assert shard.num_elements == NUMEL * len(shard.names)
        edges = [shard.bounds[r] for r in ranks]
        assert edges[0][0] == 0 and edges[-1][1] == shard.num_elements
        assert all(a[1] == b[0] for a, b in itertools.pairwise(edges))
        total = sum(weights[r] for r in ranks)
        for r in ranks:
            share = (shard.bounds[r][1] - shard.bounds[r][0]) / shard.num_elements
            assert share == pytest.approx(weights[r] / total, abs=2 / shard.num_elements)


def test_zero_cuts_the_optimizer_state_of_every_shared_parameter_and_nothing_else() -> None:
    plan = _with_memory(datacentre_plan())
    plain = plan_memory(plan)
    zero = plan_memory(
        replace(plan, training=replace(plan.training, zero_stage=ZeroStage.OPTIMIZER_STATE))
    )
    assert plain is not None and zero is not None
    held = parameter_holders(plan)
    units = {u.name: u for u in plan.units}
    for rank, before, after in zip(plan.ranks, plain, zero, strict=True):
        names = dict.fromkeys(p for u in rank.units for p in units[u].params)
        expected = sum(NUMEL * 4 * 2.0 / len(held[n]) for n in names)
        assert after.optimizer_state_bytes == pytest.approx(expected, rel=0.01)
        assert before.optimizer_state_bytes == pytest.approx(NUMEL * 4 * 2.0 * len(names))
        assert (after.parameter_bytes, after.gradient_bytes) == (
            before.parameter_bytes,
            before.gradient_bytes,
        )


def test_zero_stage_2_keeps_one_bucket_of_the_summed_copies_and_is_checked_at_load() -> None:
    big = 10_000_000  # 40 MB per parameter: above the 25 MB bucket cap, a bucket each
    plan = _with_memory(datacentre_plan(), numel=big)
    one = replace(plan, training=replace(plan.training, zero_stage=ZeroStage.OPTIMIZER_STATE))
    two = replace(plan, training=replace(plan.training, zero_stage=ZeroStage.GRADIENTS))
    two.verify()
    first, second = plan_memory(one), plan_memory(two)
    assert first is not None and second is not None
    held = parameter_holders(plan)
    units = {u.name: u for u in plan.units}
    saved = 0.0
    for rank, a, b in zip(plan.ranks, first, second, strict=True):
        names = dict.fromkeys(p for u in rank.units for p in units[u].params)
        shared = [n for n in names if len(held[n]) > 1]
        assert (b.optimizer_state_bytes, b.gradient_bytes) == (
            a.optimizer_state_bytes,
            a.gradient_bytes,
        )  # the state as stage 1; the gradients still accumulate whole
        bucket = big * 4.0 if shared else 0.0
        assert b.workspace_bytes == pytest.approx(
            a.workspace_bytes - big * 4 * len(shared) + bucket
        )
        saved += a.total_bytes - b.total_bytes
    assert saved > 0
    edited = replace(  # by hand: every rank of the stage-2 plan at a huge activation size
        _with_memory(datacentre_plan(), numel=big, per_sample=1e12),
        training=two.training,
    )
    with pytest.raises(PlanFileError) as caught:
        check_fits(edited, "plan.json")
    line = str(caught.value)
    assert "\n" not in line and "rank " in line and " GB" in line


def test_gpipe_holds_every_microbatch_and_recompute_one() -> None:
    assert in_flight_microbatches(Schedule.ONE_F_ONE_B, 0, 4, 8) == 4
    assert in_flight_microbatches(Schedule.ONE_F_ONE_B, 0, 4, 2) == 2
    assert in_flight_microbatches(Schedule.GPIPE, 3, 4, 8) == 8
    per_sample = 1e9  # far above the boundary tensors a recomputing stage keeps
    plan = _with_memory(mixed_plan(), per_sample=per_sample)
    keep = tuple(replace(r, memory_strategy=MemoryStrategy.KEEP) for r in plan.ranks)
    plan = replace(plan, ranks=keep)
    one_f_one_b = plan_memory(plan)
    gpipe = plan_memory(replace(plan, training=replace(plan.training, schedule=Schedule.GPIPE)))
    recompute = plan_memory(
        replace(
            plan,
            ranks=tuple(replace(r, memory_strategy=MemoryStrategy.RECOMPUTE) for r in plan.ranks),
        )
    )
    assert one_f_one_b is not None and gpipe is not None and recompute is not None
    for rank, a, b, c in zip(plan.ranks, one_f_one_b, gpipe, recompute, strict=True):
        per_microbatch = len(rank.units) * per_sample * rank.micro_batch_size
        assert b.activation_bytes == pytest.approx(per_microbatch * rank.num_microbatches)
        assert a.activation_bytes <= b.activation_bytes
        assert c.activation_bytes < a.activation_bytes or a.activation_bytes == per_microbatch


def test_a_plan_that_no_longer_fits_is_named_by_rank_bytes_and_capacity() -> None:
    plan = _with_memory(mixed_plan())
    assert memory_problems(plan) == []
    huge = _with_memory(mixed_plan(), per_sample=1e12)
    problems = memory_problems(huge)
    assert problems and problems[0].startswith("rank 0 on ")
    assert " GB " in problems[0] and "usable" in problems[0]
    assert "GiB" not in problems[0] and "MiB" not in problems[0]  # decimal units, as elsewhere


def test_zero_weights_of_zero_on_a_whole_holder_set_are_refused() -> None:
    plan = _with_memory(datacentre_plan())
    bad = replace(
        plan,
        ranks=tuple(replace(r, optimizer_shard_weight=0.0) for r in plan.ranks),
        training=replace(plan.training, zero_stage=ZeroStage.OPTIMIZER_STATE),
    )
    with pytest.raises(PlanFileError, match="optimizer_shard_weight 0"):
        bad.verify()


def test_selective_keeps_the_recomputed_units_inputs_and_one_microbatch_of_the_largest() -> None:
    acts, inputs = [5.0, 40.0, 7.0, 30.0], [0.0, 2.0, 3.0, 1.0]
    b, m = 3, 4
    assert stage_activation_bytes(acts, inputs, [False] * 4, b, m) == b * m * 82.0
    assert stage_activation_bytes(acts, inputs, [False] * 4, b, m, full_recompute=True) == (
        b * 82.0
    )
    chosen = [False, True, False, True]
    assert stage_activation_bytes(acts, inputs, chosen, b, m) == b * m * (5 + 2 + 7 + 1) + b * 40


def _selective_plan(recomputed: tuple[str, ...]) -> Plan:
    """The mixed plan with 3 GB/sample of activations in blocks.5 and blocks.6 (1e4
    elsewhere), each unit's input 1 MB/sample; rank 0 (tok_emb..blocks.6) recomputes both,
    rank 3 (blocks.5-9, micro-batch 3, two in flight) ``recomputed``."""
    plan = _with_memory(mixed_plan())
    assert plan.memory is not None
    big = {"blocks.5", "blocks.6"}
    units = tuple(
        replace(
            u, activation_bytes_per_sample=3e9 if u.unit in big else 1e4, input_bytes_per_sample=1e6
        )
        for u in plan.memory.units
    )
    ranks = list(plan.ranks)
    ranks[0] = replace(
        ranks[0], memory_strategy=MemoryStrategy.SELECTIVE, recompute_units=("blocks.5", "blocks.6")
    )
    ranks[3] = replace(
        ranks[3], memory_strategy=MemoryStrategy.SELECTIVE, recompute_units=recomputed
    )
    out = replace(plan, memory=replace(plan.memory, units=units), ranks=tuple(ranks))
    out.verify()
    return out


def test_a_selective_rank_fits_and_the_same_plan_edited_to_recompute_less_is_refused() -> None:
    plan = _selective_plan(("blocks.5", "blocks.6"))
    found = plan_memory(plan)
    assert found is not None
    # rank 3: kept blocks.7-9; the inputs of blocks.5 (the stage's, 1024 x 768 float32 per
    # sample) and blocks.6; one micro-batch of one big unit
    stage_input = 1024 * 768 * 4
    assert found[3].activation_bytes == pytest.approx(3 * 2 * (3e4 + stage_input + 1e6) + 3 * 3e9)
    assert check_fits(plan) is plan
    keeping = replace(
        plan,
        ranks=tuple(
            replace(r, memory_strategy=MemoryStrategy.KEEP, recompute_units=())
            if r.rank == 3
            else r
            for r in plan.ranks
        ),
    )
    assert memory_problems(keeping)[0].startswith("rank 3 on box-b/1")
    edited = _selective_plan(("blocks.6",))
    with pytest.raises(PlanFileError, match=r"rank 3 on box-b/1 needs .* \(selective 1/5\)"):
        check_fits(edited)


@pytest.mark.parametrize(
    ("strategy", "recomputed", "message"),
    [
        (MemoryStrategy.KEEP, ("blocks.6",), "lists recompute_units under memory_strategy keep"),
        (MemoryStrategy.SELECTIVE, (), "selective with 0 of its 5 units"),
        (
            MemoryStrategy.SELECTIVE,
            ("blocks.5", "blocks.6", "blocks.7", "blocks.8", "blocks.9"),
            "selective with 5 of its 5 units",
        ),
        (
            MemoryStrategy.SELECTIVE,
            ("blocks.7", "blocks.6"),
            "must be its own units, once each, in stage order",
        ),
        (MemoryStrategy.SELECTIVE, ("lm_head",), "must be its own units"),
    ],
)
def test_recompute_units_that_do_not_say_a_selective_choice_are_refused_in_one_line(
    strategy: MemoryStrategy, recomputed: tuple[str, ...], message: str
) -> None:
    plan = mixed_plan()
    ranks = tuple(
        replace(r, memory_strategy=strategy, recompute_units=recomputed) if r.rank == 3 else r
        for r in plan.ranks
    )
    with pytest.raises(PlanFileError, match=message):
        Plan.from_json(replace(plan, ranks=ranks).to_json())


def test_offload_moves_the_state_and_step_to_the_host_and_the_host_is_checked() -> None:
    plan = _with_memory(datacentre_plan())
    offloading = replace(plan, ranks=tuple(replace(r, optimizer_offload=True) for r in plan.ranks))
    offloading.verify()
    before, after = plan_memory(plan), plan_memory(offloading)
    assert before is not None and after is not None
    units = {u.name: u for u in plan.units}
    for rank, a, b in zip(plan.ranks, before, after, strict=True):
        trainable = NUMEL * 4 * len(dict.fromkeys(p for u in rank.units for p in units[u].params))
        moved = offload_device_saving_bytes(trainable, 2.0)
        assert moved == pytest.approx(trainable * (2.0 + OPTIMIZER_STEP_WORKSPACE))
        assert b.optimizer_state_bytes == 0.0 and a.host_bytes == 0.0
        assert b.total_bytes == pytest.approx(a.total_bytes - moved)
        assert b.host_bytes == pytest.approx(offload_host_bytes(trainable, 2.0))
    assert memory_problems(offloading) == []
    node = offloading.cluster.nodes[0]
    num_ranks = sum(1 for r in offloading.ranks if r.node == node.name)
    reserve = round(num_ranks * CPU_RESERVE_BYTES)  # nothing left for the offload
    tight = replace(
        offloading,
        cluster=replace(
            offloading.cluster,
            nodes=(replace(node, host_memory_bytes=reserve), *offloading.cluster.nodes[1:]),
        ),
    )
    problems = memory_problems(tight)
    assert len(problems) == 1 and f"node {node.name}'s host memory" in problems[0]
    with pytest.raises(PlanFileError, match=r"host memory.*host_memory_gb"):
        check_fits(tight)
    assert host_capacity_bytes(tight, node.name) < host_capacity_bytes(offloading, node.name)


def test_offload_on_a_cpu_rank_keeps_everything_in_its_memory() -> None:
    plan = _with_memory(cpu_plan())
    offloading = replace(plan, ranks=tuple(replace(r, optimizer_offload=True) for r in plan.ranks))
    before, after = plan_memory(plan), plan_memory(offloading)
    assert before is not None and after is not None
    for a, b in zip(before, after, strict=True):
        assert b.host_bytes == 0.0 and b.optimizer_state_bytes == a.optimizer_state_bytes
        assert b.total_bytes == pytest.approx(a.total_bytes + 2 * a.gradient_bytes)  # the copies


def test_offload_with_zero_or_local_sync_is_refused() -> None:
    plan = _with_memory(datacentre_plan())
    bad = replace(
        plan,
        ranks=tuple(replace(r, optimizer_offload=r.rank == 0) for r in plan.ranks),
        training=replace(plan.training, zero_stage=ZeroStage.OPTIMIZER_STATE),
    )
    with pytest.raises(PlanFileError, match="optimizer_offload with zero_stage 1"):
        bad.verify()


def test_the_flat_copy_is_counted_only_for_gradients_summed_every_step() -> None:
    """A bucket's flat copy holds what a rank all-reduces every step (``grad_buckets``):
    under local SGD not a parameter whose other holders are all in other islands (box-a |
    box-b here); the synchronous plan of the same ranks counts it (issue 38: an SD 1.5
    UNet's pipeline on a 3060 + 2080 Ti fits only without it)."""
    local = mixed_plan()
    synchronous = replace(local, training=replace(local.training, sync=None))
    assert local.memory is not None
    sizes = {p.name: p.num_elements * p.element_bytes for p in local.memory.parameters}
    units = {u.name: u for u in local.units}
    held, every = parameter_holders(local), step_holders(local)
    loc, syn = plan_memory(local), plan_memory(synchronous)
    assert loc is not None and syn is not None
    saved = []
    for rank, a, b in zip(local.ranks, syn, loc, strict=True):
        names = [n for n in dict.fromkeys(p for u in rank.units for p in units[u].params)]
        across_only = [
            n
            for n in names
            if n in sizes
            and len(held[n]) > 1
            and not any(rank.rank in s and len(s) > 1 for s in every[n])
        ]
        saved.append(sum(sizes[n] for n in across_only))
        assert a.workspace_bytes - b.workspace_bytes == pytest.approx(saved[-1])
    assert all(saved)  # every rank holds some parameter only its other island also holds
