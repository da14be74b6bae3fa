"""Independent check of a solver layout (the solver's own word is not trusted).

Recomputes everything from the problem arrays with plain loops; shares no code with the
solver or the evaluator on purpose.
"""

from __future__ import annotations

from hplan.planner.cost.evaluate import unsummed_flat_copy_bytes
from hplan.planner.cost.layout import IslandSync, Layout, StageLayout, is_even_cut
from hplan.planner.cost.problem import PlanningProblem, Policy
from hplan.planner.cost.zero import gradient_saving_bytes
from hplan.runtime.contract.memory import in_flight_microbatches
from hplan.runtime.contract.quantities import format_bytes_pair


def layout_problems(problem: PlanningProblem, layout: Layout) -> list[str]:
    """Every violated rule, as readable strings (empty list: valid).

    Rules: each replica places every unit exactly once, contiguously and in order, with no
    empty stage; no device is used twice; a micro-batch size is a candidate, the
    replica's share cut into equal micro-batches no larger than the largest candidate, or the
    replica's share run as one micro-batch, and never larger than the share; the
    micro-batches hold the replica's samples, none fewer than ``min_microbatch_samples``;
    shares sum to the global batch; every stage's memory (static + activations of its
    in-flight micro-batches under the problem's schedule,
    ``contract.memory.in_flight_microbatches``, or under recomputation its inputs in flight
    and one micro-batch's activations, or under selective recomputation the recomputed
    units' inputs in flight instead of their activations and one micro-batch of the largest
    one's + boundary buffers) fits its device; a selective stage names some, not all, of its
    units; with islands, they hold every node of the problem once, and under local sync
    every replica lies inside one island; every holder of a unit has one TP degree.
    """
    errors: list[str] = []
    seen: set[int] = set()
    total = 0
    if not layout.replicas:
        return ["layout has no replicas"]
    saving = _zero_saving(problem, layout)
    offload = _offload_saving(problem, layout)
    for d, num_bytes in [*offload.items(), *unsummed_flat_copy_bytes(problem, layout).items()]:
        saving[d] = saving.get(d, 0.0) + num_bytes
    errors += _offload_problems(problem, layout)
    for r, replica in enumerate(layout.replicas):
        total += replica.num_samples
        errors += _replica_problems(problem, r, replica, seen, saving)
    if total != problem.global_batch_size:
        errors.append(f"batch shares sum to {total}, not {problem.global_batch_size}")
    stages = [s for r in layout.replicas for s in r.stages]
    if problem.recompute is Policy.NEVER and any(s.recompute or s.recompute_units for s in stages):
        errors.append("a stage recomputes under --recompute never")
    if problem.recompute is Policy.ALWAYS and not all(s.recompute for s in stages):
        errors.append("a stage keeps (some of) its activations under --recompute always")
    for s in stages:
        if s.recompute_units and (
            s.recompute
            or len(s.recompute_units) >= s.unit_stop - s.unit_start
            or list(s.recompute_units) != sorted(set(s.recompute_units))
            or not s.unit_start <= s.recompute_units[0] <= s.recompute_units[-1] < s.unit_stop
        ):
            errors.append(
                f"stage on {problem.device_names[s.device_idx]} recomputes units "
                f"{list(s.recompute_units)}: not some (not all) of [{s.unit_start}, {s.unit_stop})"
            )
    if layout.sync is not None:
        errors += _island_problems(problem, layout, layout.sync)
    return errors + _tp_degree_problems(problem, layout)


def _tp_degree_problems(problem: PlanningProblem, layout: Layout) -> list[str]:
    """The contract's rule (``contract.plan._verify_tp``): every holder of a unit has one
    TP degree, since the holders of one TP position sum their shards together; and so has
    every holder of a parameter tied between units (the runtime refuses it otherwise,
    ``executor/memory/tensor_parallel.py``)."""
    if not problem.tp_degrees:
        return []
    degrees: dict[int, dict[int, str]] = {}
    for replica in layout.replicas:
        for stage in replica.stages:
            for u in range(stage.unit_start, stage.unit_stop):
                held = degrees.setdefault(u, {})
                held.setdefault(
                    problem.degree(stage.device_idx), problem.device_names[stage.device_idx]
                )
    errors = []
    for u, held in sorted(degrees.items()):
        if len(held) > 1:
            where = ", ".join(f"tp{g} on {name}" for g, name in sorted(held.items()))
            errors.append(
                f"unit {problem.unit_names[u]} is held at more than one TP degree ({where}): "
                "every holder of a unit needs one degree"
            )
    for tied in problem.tied_params:  # the runtime's rule for tied parameters too
        held = {g: n for u in tied.units for g, n in degrees.get(u, {}).items()}
        if len(held) > 1:
            names = ", ".join(problem.unit_names[u] for u in tied.units)
            where = ", ".join(f"tp{g} on {name}" for g, name in sorted(held.items()))
            errors.append(
                f"units {names} share parameters held at more than one TP degree ({where}): "
                "every holder of a tied parameter needs one degree"
            )
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


def _offload_saving(problem: PlanningProblem, layout: Layout) -> dict[int, float]:
    """Device -> bytes its optimizer offload moves to the host (its units' state and step
    temporaries)."""
    flags = layout.optimizer_offload
    if not flags or problem.offload_saving_bytes is None:
        return {}
    saving: dict[int, float] = {}
    for replica in layout.replicas:
        for stage in replica.stages:
            if flags[stage.device_idx]:
                units = range(stage.unit_start, stage.unit_stop)
                saving[stage.device_idx] = sum(
                    float(problem.offload_saving_bytes[u]) for u in units
                )
    return saving


def _offload_problems(problem: PlanningProblem, layout: Layout) -> list[str]:
    """Offload's own rules: one flag per device, not with ZeRO shards, figures present, and
    every node's host memory holds the offload of its devices."""
    flags = layout.optimizer_offload
    if not flags:
        return []
    if len(flags) != problem.num_devices:
        return [f"{len(flags)} offload flags for {problem.num_devices} devices"]
    if layout.optimizer_shard_weights and any(flags):
        return ["optimizer offload combined with ZeRO shards (not supported)"]
    if problem.offload_host_bytes is None or problem.host_capacity_bytes is None:
        return ["optimizer offload on a problem without offload figures"]
    need: dict[str, float] = {}
    capacity: dict[str, float] = {}
    for replica in layout.replicas:
        for stage in replica.stages:
            d = stage.device_idx
            node = problem.device_nodes[d]
            capacity[node] = float(problem.host_capacity_bytes[d])
            if flags[d]:
                units = range(stage.unit_start, stage.unit_stop)
                host = sum(float(problem.offload_host_bytes[u]) for u in units)
                need[node] = need.get(node, 0.0) + host
    errors = []
    for node, num_bytes in need.items():
        if num_bytes > capacity[node] * (1 + 1e-9):
            need_text, cap_text = format_bytes_pair(num_bytes, capacity[node])
            errors.append(
                f"offload on node {node} needs {need_text} of host memory, has {cap_text}"
            )
    return errors


def _zero_saving(problem: PlanningProblem, layout: Layout) -> dict[int, float]:
    """Device -> optimizer-state bytes it leaves to the other holders of its units under
    ZeRO stage 1 (a unit's state split in proportion to the holders' weights), and under
    stage 2 the flat gradient copies (``cost.zero.gradient_saving_bytes``)."""
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
            state = problem.optimizer_state_on(d)
            assert state is not None
            saving[d] = saving.get(d, 0.0) + float(state[u]) * (1 - kept)
    if layout.zero_stage == 2:
        for d, num_bytes in gradient_saving_bytes(problem, layout).items():
            saving[d] = saving.get(d, 0.0) + num_bytes
    return saving


def _allowed_size(problem: PlanningProblem, num_samples: int, micro_batch_size: int) -> bool:
    """A candidate, the share as one micro-batch, or the share cut into equal micro-batches
    (``layout.is_even_cut``) no larger than the largest candidate."""
    b = micro_batch_size
    if b in problem.micro_batch_sizes or b == num_samples:
        return True
    return b <= problem.micro_batch_sizes[-1] and is_even_cut(num_samples, b)


def _replica_problems(  # type: ignore[no-untyped-def]
    problem: PlanningProblem, r: int, replica, seen: set[int], saving: dict[int, float]
) -> list[str]:
    errors = []
    expected_start = 0
    b = replica.micro_batch_size
    if b > replica.num_samples:
        errors.append(f"replica {r}: micro-batch size {b} is larger than its share")
    elif not _allowed_size(problem, replica.num_samples, b):
        errors.append(
            f"replica {r}: micro-batch size {b} is neither a candidate, nor its share cut "
            "evenly within the largest candidate, nor its share"
        )
    if not (replica.num_microbatches - 1) * b < replica.num_samples <= replica.num_microbatches * b:
        errors.append(
            f"replica {r}: {replica.num_samples} samples do not fill "
            f"{replica.num_microbatches} x {b}"
        )
    smallest = replica.num_samples - (replica.num_microbatches - 1) * b
    if 0 < smallest < problem.min_microbatch_samples:
        errors.append(
            f"replica {r}: a micro-batch of {smallest} sample(s), below the model's floor of "
            f"{problem.min_microbatch_samples} (batch norm)"
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
        in_flight = in_flight_microbatches(
            problem.schedule, s, num_stages, replica.num_microbatches
        )
        need = _memory(problem, stage, b, in_flight) - saving.get(stage.device_idx, 0.0)
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


def _memory(problem: PlanningProblem, stage: StageLayout, b: int, in_flight: int) -> float:
    start, stop = stage.unit_start, stage.unit_stop
    # the received tensors without a batch dimension, held whole per micro-batch in flight
    received = problem.cut_bytes(start - 1, 0) if start > 0 else 0.0
    need = received * in_flight
    largest = 0.0
    static = problem.static_bytes_on(stage.device_idx)  # per card of a TP group
    activations = problem.activation_bytes_on(stage.device_idx)
    for u in range(start, stop):
        need += float(static[u])
        act = float(activations[u]) * b
        if stage.recompute:
            need += act
        elif u in stage.recompute_units:
            # a checkpointed unit keeps its input; its backward holds its activations alone
            if u:
                kept = problem.cut_bytes(u - 1, b) - (received if u == start else 0.0)
                need += kept * in_flight
            largest = max(largest, act)
        else:
            need += act * in_flight
    need += largest
    if stage.recompute and start > 0:
        need += (problem.cut_bytes(start - 1, b) - received) * in_flight
    if start > 0:
        need += 2.0 * problem.cut_bytes(start - 1, b)
    if stop < problem.num_units:
        need += 2.0 * problem.cut_bytes(stop - 1, b)
    return need
