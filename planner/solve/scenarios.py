"""Gradient-sync scenarios: assumptions under which a pipeline copy's time is linear.

A copy's step time includes the gradient all-reduce, which depends on which other copies
exist — a product of decisions. The search fixes it per scenario instead and solves each:

- *one replica*: no data parallelism, no all-reduce;
- *data parallel with at most R copies over a set of classes* joined by links at least as
  fast as some level: every copy's all-reduce is costed as a ring of R over the slowest
  link of the set, either over the whole model (some device syncs every unit, e.g. a
  one-stage replica), per stage (each stage syncs only its units), or, across nodes,
  stage-locally (replicas aligned stage by stage sync inside each stage's own class).

R runs over powers of two up to the set's size, so small data-parallel groups are not
charged for a ring of every device. The exact evaluator re-costs every scenario's answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from hplan.planner.cost.evaluate import measured_ring
from hplan.planner.cost.islands import components
from hplan.planner.cost.problem import PlanningProblem
from hplan.planner.solve.device_groups import DeviceGroup, group_link
from hplan.planner.solve.partition import PipelineShape
from hplan.runtime.contract.link_model import (
    BUCKET_CAP_BYTES,
    bucket_rings_s,
    exposed_all_reduce_s,
    overlap_window_s,
)


class SyncEstimate(StrEnum):
    """How a scenario estimates a copy's gradient all-reduce time."""

    WHOLE_MODEL = "whole model"
    PER_STAGE = "per stage"
    STAGE_LOCAL = "stage-local"


@dataclass(frozen=True)
class Scenario:
    """A gradient-sync assumption under which copy times are linear."""

    name: str
    classes: frozenset[int]
    max_copies: int
    bandwidth_bytes_per_s: float
    latency_s: float
    sync: SyncEstimate

    @property
    def single_replica(self) -> bool:
        return self.max_copies == 1


def _copy_counts(size: int) -> list[int]:
    counts, r = [], 2
    while r < size:
        counts.append(r)
        r *= 2
    return [*counts, size] if size >= 2 else []


def _devices(classes: Sequence[DeviceGroup], members: Iterable[int]) -> list[int]:
    return [d for c in members for d in classes[c].devices]


def _label(
    problem: PlanningProblem, classes: Sequence[DeviceGroup], component: frozenset[int]
) -> str:
    nodes = sorted({problem.device_nodes[d] for c in component for d in classes[c].devices})
    return "+".join(nodes) if len(nodes) <= 3 else f"{len(nodes)} nodes"


def make_scenarios(problem: PlanningProblem, classes: Sequence[DeviceGroup]) -> list[Scenario]:
    """Every scenario worth solving for this problem (see the module docstring)."""
    everyone = frozenset(range(len(classes)))
    scenarios = [Scenario("one replica", everyone, 1, math.inf, 0.0, SyncEstimate.PER_STAGE)]
    links = {(a, b): group_link(problem, classes, a, b) for a in everyone for b in everyone}
    levels = sorted({bw for bw, _ in links.values() if math.isfinite(bw)}, reverse=True)
    seen: set[frozenset[int]] = set()
    for level in levels:
        for component in map(frozenset, components(sorted(everyone), _at_least(links, level))):
            if component in seen:
                continue
            seen.add(component)
            scenarios += _data_parallel(problem, classes, component, links)
    return scenarios


def _data_parallel(
    problem: PlanningProblem,
    classes: Sequence[DeviceGroup],
    component: frozenset[int],
    links: dict[tuple[int, int], tuple[float, float]],
) -> list[Scenario]:
    size = sum(classes[c].size for c in component)
    finite = [
        links[(a, b)] for a in component for b in component if math.isfinite(links[(a, b)][0])
    ]
    if size < 2 or not finite:
        return []
    ring_bw, ring_lat = measured_ring(problem, _devices(classes, component))
    bw = min(ring_bw, *(x[0] for x in finite))
    lat = max(ring_lat, *(x[1] for x in finite))
    label = _label(problem, classes, component)
    multi_node = len({problem.device_nodes[d] for c in component for d in classes[c].devices}) > 1
    out = []
    for copies in _copy_counts(size):
        for sync in SyncEstimate:
            if sync is SyncEstimate.STAGE_LOCAL and not multi_node:
                continue
            name = f"data parallel on {label}, up to {copies} replicas, {sync.value} sync"
            out.append(Scenario(name, component, copies, bw, lat, sync))
    return out


def _at_least(
    links: dict[tuple[int, int], tuple[float, float]], level: float
) -> Callable[[int, int], bool]:
    return lambda a, b: links[(a, b)][0] >= level


def allreduce_estimate_s(
    problem: PlanningProblem, classes: Sequence[DeviceGroup], scenario: Scenario, t: PipelineShape
) -> float:
    """The all-reduce time one copy of ``t`` is charged under ``scenario``: what its stages'
    rings leave after their last backward pass (``link_model.exposed_all_reduce_s``, as
    ``evaluate.allreduce_time_s``). Over the whole model, the pass is the whole model's
    backward on ``t``'s devices (exact for a one-stage copy)."""
    if scenario.single_replica:
        return 0.0
    n = scenario.max_copies
    if scenario.sync is SyncEstimate.WHOLE_MODEL:
        total = sum(t.stage_grad_bytes)
        backward_s = sum(t.stage_backward_s)
        return _exposed_s(n, total, backward_s, scenario.bandwidth_bytes_per_s, scenario.latency_s)
    floor = (  # the scenario's own figures already hold it; a stage-local link does not
        measured_ring(problem, _devices(classes, scenario.classes))
        if scenario.sync is SyncEstimate.STAGE_LOCAL
        else None
    )
    times = []
    for s, c in enumerate(t.classes):
        bw, lat = scenario.bandwidth_bytes_per_s, scenario.latency_s
        if floor is not None:
            local_bw, local_lat = group_link(problem, classes, c, c)
            if math.isfinite(local_bw):
                bw, lat = min(local_bw, floor[0]), max(local_lat, floor[1])
        times.append(_exposed_s(n, t.stage_grad_bytes[s], t.stage_backward_s[s], bw, lat))
    return max(times, default=0.0)


def _exposed_s(
    num_ranks: int, num_bytes: float, backward_s: float, bandwidth: float, latency_s: float
) -> float:
    """A ring of ``num_ranks`` over ``num_bytes`` in buckets, overlapped with a backward
    pass of ``backward_s``: the part left after the pass (``link_model``)."""
    total_s, last_s = bucket_rings_s(num_ranks, num_bytes, bandwidth, latency_s)
    window_s = overlap_window_s(backward_s, num_bytes, BUCKET_CAP_BYTES)
    return exposed_all_reduce_s(total_s, window_s, last_s)
