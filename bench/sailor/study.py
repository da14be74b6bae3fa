"""The measured plans of the Sailor study (``plans/<cluster>/plan_config_*.json``), as read.

A file lists one or more pipelines; each gives its stages' layers and, per stage, its
data-parallel replicas, each a machine running the stage as a tensor-parallel group of
``tp`` GPUs: ``[[[gpu, gpus_per_node, zone]], tp]``. ``real`` is the measured iteration time,
``red_grads`` the measured time of the gradient all-reduce call (waiting included) and
``max_mem`` the peak memory of the busiest GPU (see the data folder's README).
``plan.import_study_plan`` turns a :class:`StudyPlan` into an hplan ``Plan``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hplan.runtime.contract.errors import ConfigError

from .data import SailorData


@dataclass(frozen=True, slots=True)
class Machine:
    """One machine of a study plan: a GPU type running one stage with ``tp`` GPUs."""

    gpu: str
    tp: int
    zone: str = ""
    """Cloud zone of the machine ("": the plan's zone)."""


@dataclass(frozen=True, slots=True)
class StudyStage:
    """One stage of one replica: its layers and its machine."""

    layers: tuple[int, ...]
    machine: Machine


@dataclass(frozen=True)
class StudyPlan:
    """One measured plan of the study, as read from its file."""

    name: str
    """``<cluster>/<file stem>``, e.g. ``mit/plan_config_N2_D1``."""
    zone: str
    replicas: tuple[tuple[StudyStage, ...], ...]
    """Every data-parallel replica's pipeline: the file's pipelines in order, each one's
    ``dp`` replicas (replica r of a pipeline runs on the r-th machine of every stage)."""
    mbs: int
    gbs: int
    real_s: float
    red_grads_s: float
    max_mem_bytes: int

    @property
    def cluster(self) -> str:
        return self.name.split("/")[0]

    @property
    def dp(self) -> int:
        return len(self.replicas)

    @property
    def samples_per_replica(self) -> int:
        """The global batch split evenly over the replicas (the study's data loader)."""
        return self.gbs // self.dp

    def zone_of(self, machine: Machine) -> str:
        return machine.zone or self.zone


def read_study_plan(path: str | Path) -> StudyPlan:
    """Parse one ``plan_config_*.json``.

    Raises:
        ConfigError: unreadable; a pipeline whose stages have different ``dp`` (hplan
            replicas are whole pipelines); a tensor-parallel group over several machines;
            a global batch that the replicas cannot share evenly.
    """
    path = Path(path)
    name = f"{path.parent.name}/{path.stem}"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"cannot read study plan {str(path)!r} ({exc.strerror}); check the path"
        ) from None
    try:
        raw = json.loads(text)
        replicas = [r for p in raw["pipeline_list"] for r in _pipeline_replicas(name, p)]
        plan = StudyPlan(
            name=name,
            zone=str(raw["zone"]),
            replicas=tuple(replicas),
            mbs=int(raw["mbs"]),
            gbs=int(raw["gbs"]),
            real_s=float(raw["real"]),
            red_grads_s=float(raw["red_grads"]),
            max_mem_bytes=int(raw["max_mem"]),
        )
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        reason = f"no key {exc}" if isinstance(exc, KeyError) else str(exc).splitlines()[0]
        raise ConfigError(
            f"study plan {str(path)!r} is not a Sailor plan_config file ({reason}); check the file"
        ) from None
    if not plan.replicas or plan.gbs % plan.dp:
        raise ConfigError(f"{name}: gbs {plan.gbs} cannot be shared by {plan.dp} replicas")
    return plan


def _pipeline_replicas(name: str, pipeline: dict[str, Any]) -> list[tuple[StudyStage, ...]]:
    layers = [tuple(int(x) for x in s) for s in pipeline["layers_per_stage"]]
    stages = pipeline["tmp_per_stage"]
    degrees = [len(stage) for stage in stages]
    if len(set(degrees)) != 1:
        raise ConfigError(
            f"study plan {name} gives its stages different data-parallel degrees {degrees}; "
            "hplan replicas are whole pipelines"
        )
    return [
        tuple(StudyStage(layers[s], _machine(name, stages[s][r])) for s in range(len(stages)))
        for r in range(degrees[0])
    ]


def _machine(name: str, entry: list[Any]) -> Machine:
    hosts, tp = entry
    if len(hosts) != 1:
        raise ConfigError(
            f"study plan {name} runs a tensor-parallel group over {len(hosts)} machines; "
            "the importer takes one machine per group"
        )
    gpu, _, zone = hosts[0]
    return Machine(str(gpu), int(tp), str(zone))


def study_plan_paths(data: SailorData) -> list[Path]:
    """Every measured plan under ``plans/``, sorted by cluster and name."""
    return sorted((data.root / "plans").glob("*/plan_config_*.json"))
