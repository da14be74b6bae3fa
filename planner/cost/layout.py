"""The solver's output: which devices form which pipelines, and who holds which units.

Pure data with indices into a ``PlanningProblem``; ``hplan.planner.emit.plan_build`` turns it into a
``Plan``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StageLayout:
    """One pipeline stage: a device and the contiguous units ``[unit_start, unit_stop)``."""

    device_idx: int
    unit_start: int
    unit_stop: int


@dataclass(frozen=True, slots=True)
class ReplicaLayout:
    """One data-parallel replica: a pipeline of stages and its share of the global batch."""

    stages: tuple[StageLayout, ...]
    micro_batch_size: int
    num_microbatches: int
    num_samples: int

    @property
    def num_stages(self) -> int:
        return len(self.stages)


@dataclass(frozen=True, slots=True)
class Layout:
    """A whole layout: every replica. Devices not named in any stage stay idle."""

    replicas: tuple[ReplicaLayout, ...]

    @property
    def device_indices(self) -> tuple[int, ...]:
        return tuple(s.device_idx for r in self.replicas for s in r.stages)
