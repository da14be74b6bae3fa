"""Simulator speed: wall time of `simulate` on large plans (target: 64 ranks x 32 micro-batches
well under a second, so the solver can re-time its best candidates).

Each shape is R replicas of S-stage pipelines on heterogeneous stage times, every boundary on
its own link, gradients all-reduced per stage across replicas (S groups of R ranks).

    python bench/simulator_speed.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from common import console, table

from hplan.planner.sim.engine import (
    SimChannel,
    SimLink,
    SimReplica,
    SimSpec,
    SimStage,
    SimSyncGroup,
    simulate,
)
from hplan.runtime.contract.plan import Schedule

SHAPES = ((1, 64, 32), (8, 8, 32), (16, 4, 32), (64, 1, 32), (8, 8, 128))
"""(replicas, stages, micro-batches)."""


def make_spec(num_replicas: int, num_stages: int, num_mb: int, schedule: Schedule) -> SimSpec:
    """A deterministic random spec of the given shape."""
    rng = random.Random(0)
    link = SimChannel(12.5e9, 10e-6)
    replicas = []
    for r in range(num_replicas):
        stages = tuple(
            SimStage(
                rank=r * num_stages + s,
                device="gpu",
                forward_s=(rng.uniform(1e-3, 3e-3),) * num_mb,
                backward_s=(rng.uniform(2e-3, 6e-3),) * num_mb,
                optimizer_s=1e-3,
            )
            for s in range(num_stages)
        )
        links = tuple(SimLink(link, link, (8e6,) * num_mb, (8e6,) * num_mb) for _ in stages[1:])
        replicas.append(SimReplica(stages, links, (4,) * num_mb))
    groups = tuple(
        SimSyncGroup(tuple(r * num_stages + s for r in range(num_replicas)), 5e8, 12.5e9, 10e-6)
        for s in range(num_stages)
        if num_replicas > 1
    )
    return SimSpec(tuple(replicas), groups, schedule)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    out = table(
        f"simulate(): median wall time of {args.repeats} runs",
        ["replicas x stages", "ranks", "micro-batches", "schedule", "events", "wall ms"],
    )
    for num_replicas, num_stages, num_mb in SHAPES:
        for schedule in Schedule:
            spec = make_spec(num_replicas, num_stages, num_mb, schedule)
            times, num_events = [], 0
            for _ in range(args.repeats):
                start = time.perf_counter()
                num_events = len(simulate(spec).events)
                times.append(time.perf_counter() - start)
            out.add_row(
                f"{num_replicas} x {num_stages}",
                str(num_replicas * num_stages),
                str(num_mb),
                schedule.value,
                str(num_events),
                f"{statistics.median(times) * 1e3:.1f}",
            )
    console.print(out)


if __name__ == "__main__":
    main()
