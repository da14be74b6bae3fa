"""Independent check of a solver layout (the solver's own word is not trusted).

Recomputes everything from the problem arrays with plain loops; shares no code with the
solver or the evaluator on purpose.
"""

from __future__ import annotations

from hplan.planner.cost.layout import IslandSync, Layout
from hplan.planner.cost.problem import PlanningProblem, RecomputePolicy
from hplan.planner.textfmt import format_bytes_pair


def layout_problems(problem: PlanningProblem, layout: Layout) -> list[str]:
    """Every violated rule, as readable strings (empty list: valid).

    Rules: each replica places every unit exactly once, contiguously and in order, with no
    empty stage; no device is used twice; a micro-batch size is a candidate, or the
    replica's share run as one micro-batch, and never larger than the share; the
    micro-batches hold the replica's samples; shares sum to the global batch; every stage's
    memory (static + activations of its in-flight micro-batches under 1F1B, or under
    recomputation its inputs in flight and one micro-batch's activations + boundary
    buffers) fits its device; with islands, they hold every node of the problem once, and
    under local sync every replica lies inside one island.
    """
    errors: list[str] = []
    seen: set[int] = set()
    total = 0
    if not layout.replicas:
        return ["layout has no replicas"]
    saving = _zero_saving(problem, layout)
    for r, replica in enumerate(layout.replicas):
        total += replica.num_samples
        errors += _replica_problems(problem, r, replica, seen, saving)
    if total != problem.global_batch_size:
        errors.append(f"batch shares sum to {total}, not {problem.global_batch_size}")
    flags = {s.recompute for r in layout.replicas for s in r.stages}
    if problem.recompute is RecomputePolicy.NEVER and True in flags:
        errors.append("a stage recomputes under --recompute never")
    if problem.recompute is RecomputePolicy.ALWAYS and False in flags:
        errors.append("a stage keeps its activations under --recompute always")
    if layout.sync is not None:
        errors += _island_problems(problem, layout, layout.sync)
    return errors


def _island_problems(problem: PlanningProblem, layout: Layout, sync: IslandSync) -> list[str]:
    placed = sorted(n for island in sync.islands for n in island)
    if placed != sorted(set(problem.device_nodes)):
        return [f"islands {sync.islands} do not hold every node once"]
    if not sync.local:
        return []
    island_of = {n: i for i, island in enumerate(sync.islands) for n in island}
    errors = []
    for r, replica in enumerate(layout.replicas):
        where = {island_of[problem.device_nodes[s.device_idx]] for s in replica.stages}
        if len(where) > 1:
            errors.append(f"replica {r} spans islands under {sync.mode}")
    return errors


def _zero_saving(problem: PlanningProblem, layout: Layout) -> dict[int, float]:
    """Device -> optimizer-state bytes it leaves to the other holders of its units under
    ZeRO stage 1 (a unit's state split in proportion to the holders' weights)."""
    weights = layout.optimizer_shard_weights
    if not weights or problem.optimizer_state_bytes is None:
        return {}
    holders: dict[int, list[int]] = {}
    for replica in layout.replicas:
        for stage in replica.stages:
            for u in range(stage.unit_start, stage.unit_stop):
                holders.setdefault(u, []).append(stage.device_idx)
    saving: dict[int, float] = {}
    for u, devices in holders.items():
        if len(devices) < 2:
            continue
        total = sum(weights[d] for d in devices)
        for d in devices:
            kept = weights[d] / total if total > 0 else 0.0
            saving[d] = saving.get(d, 0.0) + float(problem.optimizer_state_bytes[u]) * (1 - kept)
    return saving


def _replica_problems(  # type: ignore[no-untyped-def]
    problem: PlanningProblem, r: int, replica, seen: set[int], saving: dict[int, float]
) -> list[str]:
    errors = []
    expected_start = 0
    b = replica.micro_batch_size
    if b > replica.num_samples:
        errors.append(f"replica {r}: micro-batch size {b} is larger than its share")
    elif b not in problem.micro_batch_sizes and b != replica.num_samples:
        errors.append(f"replica {r}: micro-batch size {b} is neither a candidate nor its share")
    if not (replica.num_microbatches - 1) * b < replica.num_samples <= replica.num_microbatches * b:
        errors.append(
            f"replica {r}: {replica.num_samples} samples do not fill "
            f"{replica.num_microbatches} x {b}"
        )
    num_stages = len(replica.stages)
    for s, stage in enumerate(replica.stages):
        if stage.device_idx in seen:
            errors.append(f"device {problem.device_names[stage.device_idx]} used twice")
        seen.add(stage.device_idx)
        if stage.unit_start != expected_start or stage.unit_stop <= stage.unit_start:
            errors.append(
                f"replica {r} stage {s}: units [{stage.unit_start}, {stage.unit_stop}) "
                "out of order or empty"
            )
        expected_start = stage.unit_stop
        need = _memory(
            problem, stage.unit_start, stage.unit_stop, b, num_stages - s, stage.recompute
        ) - saving.get(stage.device_idx, 0.0)
        cap = float(problem.memory_capacity_bytes[stage.device_idx])
        if need > cap:
            need_text, cap_text = format_bytes_pair(need, cap)
            errors.append(
                f"replica {r} stage {s} on {problem.device_names[stage.device_idx]} needs "
                f"{need_text}, has {cap_text}"
            )
    if expected_start != problem.num_units:
        errors.append(f"replica {r} does not hold every unit")
    return errors


def _memory(
    problem: PlanningProblem, start: int, stop: int, b: int, in_flight: int, recompute: bool
) -> float:
    need = 0.0
    kept = 1 if recompute else in_flight
    for u in range(start, stop):
        need += float(problem.static_memory_bytes[u])
        need += float(problem.activation_bytes_per_sample[u]) * b * kept
    if recompute and start > 0:
        need += float(problem.cut_bytes_per_sample[start - 1]) * b * in_flight
    if start > 0:
        need += 2.0 * float(problem.cut_bytes_per_sample[start - 1]) * b
    if stop < problem.num_units:
        need += 2.0 * float(problem.cut_bytes_per_sample[stop - 1]) * b
    return need
