"""What other tools would do on the same cluster, costed by the same model.

- ``data_parallel_equal``: every device a replica with the same batch share and the same
  micro-batch size (plain PyTorch DDP).
- ``uniform_pipeline``: pipelines of p consecutive devices (cluster order), equal batch
  shares and micro-batches, the layers (the repeated blocks, :func:`is_layer`) split into
  equal counts, the embedding with the first stage and the final norm and head with the
  last, as Megatron-LM splits ``num_layers`` (DeepSpeed ``partition_method="uniform"``
  splits layer counts too); units in equal counts where the model has fewer layers than
  stages. The best p >= 2 that fits is taken, which is generous to it. A pipeline has at
  least two stages: with one device or one unit there is none.
"""

from __future__ import annotations

from enum import StrEnum

from hplan.planner.cost.evaluate import evaluate, stage_memory_bytes
from hplan.planner.cost.layout import Layout, StageLayout, replica_layout
from hplan.planner.cost.problem import PlanningProblem
from hplan.runtime.contract.memory import in_flight_microbatches


class Strategy(StrEnum):
    """Who decides the layout."""

    HPLAN = "hplan"
    DATA_PARALLEL = "ddp"
    """Equal-batch data parallel on every device (what DDP does)."""
    UNIFORM_PIPELINE = "uniform"
    """Equal-layer pipelines of two or more stages with equal batches (Megatron/DeepSpeed
    ``uniform``)."""


def equal_shares(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` integers differing by at most one (larger first)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def equal_unit_bounds(num_units: int, num_stages: int) -> list[int]:
    """Stage boundaries for equal unit counts (the first stages take the remainder)."""
    sizes = equal_shares(num_units, num_stages)
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return bounds


def is_layer(unit_name: str) -> bool:
    """Whether a partition unit is one of the model's repeated blocks: its name ends in the
    block's index (``model.layers.3``, ``blocks.0``; ``partition_units.assign_units``)."""
    return unit_name.rsplit(".", 1)[-1].isdigit()


def layer_bounds(unit_names: tuple[str, ...], num_stages: int) -> list[int]:
    """Stage boundaries (unit indices, ``num_stages + 1`` of them) that give each stage an
    equal count of layers (:func:`is_layer`; the first stages take the remainder): units
    before the first layer join the first stage, the others the stage of the layer before
    them (a final norm and head: the last). Equal unit counts (:func:`equal_unit_bounds`)
    when there are fewer layers than stages."""
    layers = [u for u, name in enumerate(unit_names) if is_layer(name)]
    if len(layers) < num_stages:
        return equal_unit_bounds(len(unit_names), num_stages)
    bounds, taken = [0], 0
    for size in equal_shares(len(layers), num_stages)[:-1]:
        taken += size
        bounds.append(layers[taken])
    return [*bounds, len(unit_names)]


def _fits(
    problem: PlanningProblem, pipelines: list[list[int]], bounds: list[int], b: int, share: int
) -> bool:
    num_stages = len(bounds) - 1
    num_microbatches = -(-share // b)
    for devices in pipelines:
        for s, d in enumerate(devices):
            in_flight = in_flight_microbatches(problem.schedule, s, num_stages, num_microbatches)
            need = stage_memory_bytes(problem, bounds[s], bounds[s + 1], b, in_flight, device_idx=d)
            if need > problem.memory_capacity_bytes[d]:
                return False
    return True


def _uniform_layout(problem: PlanningProblem, num_stages: int) -> Layout | None:
    num_replicas = min(problem.num_devices // num_stages, problem.global_batch_size)
    if num_replicas < 1 or num_stages > problem.num_units:
        return None
    pipelines = [list(range(r * num_stages, (r + 1) * num_stages)) for r in range(num_replicas)]
    bounds = layer_bounds(problem.unit_names, num_stages)
    shares = equal_shares(problem.global_batch_size, num_replicas)
    fitting = [
        b
        for b in problem.micro_batch_sizes
        if b <= shares[0] and _fits(problem, pipelines, bounds, b, shares[0])
    ]
    if not fitting:
        return None
    b = max(fitting)
    replicas = tuple(
        replica_layout(
            tuple(StageLayout(d, bounds[s], bounds[s + 1]) for s, d in enumerate(devices)),
            b,
            share,
        )
        for devices, share in zip(pipelines, shares, strict=True)
    )
    return Layout(replicas)


def data_parallel_equal(problem: PlanningProblem) -> Layout | None:
    """Equal-batch data parallel over every device; None if the model does not fit one."""
    return _uniform_layout(problem, 1)


def pipeline_possible(problem: PlanningProblem) -> bool:
    """True when the problem has room for a pipeline of two or more stages."""
    return min(problem.num_units, problem.num_devices) >= 2


def uniform_pipeline(problem: PlanningProblem) -> Layout | None:
    """The fastest equal-layer (:func:`layer_bounds`), equal-batch pipeline layout of two or
    more stages that fits; None if none fits (or :func:`pipeline_possible` is False)."""
    best: tuple[float, Layout] | None = None
    for num_stages in range(2, min(problem.num_units, problem.num_devices) + 1):
        layout = _uniform_layout(problem, num_stages)
        if layout is None:
            continue
        step = evaluate(problem, layout).step_time_s
        if best is None or step < best[0]:
            best = (step, layout)
    return best[1] if best else None
