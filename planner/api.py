"""The compiler pipeline as one function: model file + cluster file -> verified Plan.

Each step is a pure function of the previous step's value (see the design card):
load -> trace and cost graph -> cluster -> planning problem -> solve -> report -> plan.
The CLI calls ``plan_training`` and ``hplan.planner.emit.artifacts.emit``; nothing else plans.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path

from hplan.planner.cost.evaluate import evaluate
from hplan.planner.cost.problem import PlanningProblem
from hplan.planner.cost.problem_builder import (
    RooflineSource,
    UnitTimeSource,
    build_problem,
    optimizer_state_factor,
)
from hplan.planner.cost.profiled_times import load_measured_source, source_labels
from hplan.planner.emit.plan_build import build_plan, model_spec
from hplan.planner.emit.report import build_report, with_cost_sources
from hplan.planner.frontend.cost_graph import ModelGraph, build_model_graph
from hplan.planner.frontend.trains_check import check_trains
from hplan.planner.hardware.catalog import DeviceClass
from hplan.planner.hardware.cluster import Cluster, Device, load_cluster, to_cluster_spec
from hplan.planner.hardware.measured_links import load_measured_links
from hplan.planner.sim.spec import param_wire_bytes, with_simulation
from hplan.planner.solve.baselines import data_parallel_equal, uniform_pipeline
from hplan.planner.solve.search import SolveOptions
from hplan.planner.solve.solver import SolveResult, solve
from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.contract.errors import ConfigError, InfeasiblePlanError
from hplan.runtime.contract.plan import Backend, Plan, Schedule, SolverStatus, TrainingSpec


class Strategy(StrEnum):
    """Who decides the layout."""

    HPLAN = "hplan"
    DATA_PARALLEL = "ddp"
    """Equal-batch data parallel on every device (what DDP does)."""
    UNIFORM_PIPELINE = "uniform"
    """Equal-layer pipelines with equal batches (Megatron/DeepSpeed ``uniform``)."""


@dataclass(frozen=True)
class SolveRequest:
    """What ``hplan solve`` was asked for."""

    model_path: Path
    cluster_path: Path
    global_batch_size: int = 32
    micro_batch_sizes: tuple[int, ...] | None = None
    time_limit_s: float = 60.0
    solver: str | None = None
    max_stages: int = 8
    schedule: Schedule = Schedule.ONE_F_ONE_B
    seed: int = 0
    master_port: int = 29500
    leaf_modules: tuple[str, ...] = ()
    strategy: Strategy = Strategy.HPLAN
    """``hplan`` solves; the others emit a baseline layout (for side-by-side runs)."""
    out_dir: Path | None = None
    """Where plan.json will be written: the plan records the model path relative to it
    (the runtime resolves it against plan.json's folder). None: record it as given."""
    profile_path: Path | None = None
    """A measured profile (``hplan profile``: a file or a directory of them); its unit
    timings take precedence over the roofline. None: the roofline only."""
    bandwidth_path: Path | None = None
    """A measured link matrix (``hplan bandwidth``); its device pairs override the cluster
    file's links. None: the cluster file's links only."""


@dataclass(frozen=True)
class PlanningOutcome:
    """The plan and the intermediate values that produced it."""

    plan: Plan
    graph: ModelGraph
    problem: PlanningProblem
    result: SolveResult
    solve_time_s: float


def plan_training(
    request: SolveRequest, progress: Callable[[str], None] | None = None
) -> PlanningOutcome:
    """Plan ``request.model_path`` on ``request.cluster_path``.

    Raises:
        ModelFileError, TraceError, ConfigError: bad model file, model, cluster file or
            bandwidth file (one naming devices the cluster lacks).
        InfeasiblePlanError: nothing fits; names the binding constraint.
        SolverUnavailableError: a requested solver does not work here.
    """
    say = progress or (lambda _msg: None)
    _check_request(request)
    cluster, link_notes = _cluster(request)
    say("loading and tracing the model")
    model_file = load_model_file(request.model_path)
    graph = build_model_graph(model_file, leaf_modules=request.leaf_modules, seed=request.seed)
    say("checking that the model trains")
    check_trains(model_file, seed=request.seed)
    source = _time_source(request, graph)
    problem = build_problem(
        graph,
        cluster,
        global_batch_size=request.global_batch_size,
        micro_batch_sizes=request.micro_batch_sizes,
        optimizer_state_bytes_per_param_byte=optimizer_state_factor(
            model_file, param_dtype=graph.param_dtype
        ),
        time_source=source,
    )
    say(
        f"solving ({problem.num_units} units, {problem.num_devices} devices, limit {request.time_limit_s:g} s)"
    )
    started = time.monotonic()
    result = _decide(problem, request)
    solve_time_s = time.monotonic() - started
    report = build_report(
        problem, result, cost_source=source.name, notes=(*graph.notes, *link_notes)
    )
    if request.profile_path is not None:
        labels = source_labels(source, cluster.devices, graph.unit_costs, problem.micro_batch_sizes)
        report = with_cost_sources(report, problem, result.layout, labels, source_name=source.name)
        unmeasured = _unmeasured_kinds(cluster.devices, labels)
        if unmeasured:
            note = (
                f"profile {request.profile_path} has no measurement for "
                f"{', '.join(unmeasured)} and none to scale from: the roofline stands for them"
            )
            report = replace(report, notes=(*report.notes, note))
    plan = build_plan(
        graph=graph,
        model=model_spec(
            graph,
            path=recorded_model_path(request.model_path, request.out_dir),
            sha256=model_file.sha256,
        ),
        cluster=to_cluster_spec(cluster, graph.param_dtype),
        device_names=problem.device_names,
        layout=result.layout,
        global_batch_size=request.global_batch_size,
        report=report,
        training=_training_spec(request, cluster, result),
    )
    plan = with_simulation(plan, param_wire_bytes(graph))
    return PlanningOutcome(plan, graph, problem, result, solve_time_s)


def recorded_model_path(model_path: Path, out_dir: Path | None) -> str:
    """The model path a plan records: relative to ``out_dir`` (POSIX separators).

    ``examples/gpt/model.py`` planned into ``out/demo`` -> ``../../examples/gpt/model.py``,
    whatever the current directory, so the same inputs give the same plan bytes and the
    runtime finds the file from plan.json's folder. Symbolic links in the folders are
    resolved; the file name is kept. ``out_dir`` None: the path as given.
    """
    if out_dir is None:
        return model_path.as_posix()
    model_abs = model_path.absolute().parent.resolve() / model_path.name
    return Path(os.path.relpath(model_abs, out_dir.absolute().resolve())).as_posix()


def _decide(problem: PlanningProblem, request: SolveRequest) -> SolveResult:
    if request.strategy is Strategy.HPLAN:
        options = SolveOptions(
            time_limit_s=request.time_limit_s, backend=request.solver, max_stages=request.max_stages
        )
        return solve(problem, options, schedule=request.schedule)
    make = data_parallel_equal if request.strategy is Strategy.DATA_PARALLEL else uniform_pipeline
    layout = make(problem)
    if layout is None:
        raise InfeasiblePlanError(
            f"the {request.strategy.value} baseline does not fit this cluster's memory; "
            "use the hplan strategy"
        )
    return SolveResult(
        layout=layout,
        evaluation=evaluate(problem, layout),
        status=SolverStatus.HEURISTIC,
        gap=None,
        backend="none",
        source=f"baseline: {request.strategy.value}",
        notes=(f"{request.strategy.value} baseline requested; the layout was not optimised",),
    )


def _unmeasured_kinds(
    devices: Sequence[Device], labels: tuple[tuple[tuple[str, ...], ...], ...]
) -> tuple[str, ...]:
    """Device kinds whose every number came from the plain roofline (``labels``: D x U x K)."""
    kinds = {
        device.kind
        for device, per_unit in zip(devices, labels, strict=True)
        if all(label == "roofline" for sizes in per_unit for label in sizes)
    }
    return tuple(sorted(kinds))


def _time_source(request: SolveRequest, graph: ModelGraph) -> UnitTimeSource:
    """The roofline, or the measured profile (checked to be of this model)."""
    if request.profile_path is None:
        return RooflineSource()
    return load_measured_source(request.profile_path, graph, model_path=request.model_path)


def _check_request(request: SolveRequest) -> None:
    if request.global_batch_size < 1:
        raise ConfigError(f"global batch size {request.global_batch_size} must be >= 1")
    if request.time_limit_s <= 0:
        raise ConfigError(f"time limit {request.time_limit_s} s must be > 0")
    if request.max_stages < 1:
        raise ConfigError(f"max stages {request.max_stages} must be >= 1")
    if not 1 <= request.master_port <= 65534:
        raise ConfigError(f"master port {request.master_port} must be in 1..65534")


def _cluster(request: SolveRequest) -> tuple[Cluster, tuple[str, ...]]:
    """The cluster, with measured links over the file's when ``bandwidth_path`` is given,
    and the report's note on where the links came from."""
    cluster = load_cluster(request.cluster_path)
    _check_device_mix(cluster)
    if request.bandwidth_path is None:
        return cluster, ()
    measured = load_measured_links(cluster, request.bandwidth_path)
    return measured.cluster, (measured.note,)


def _check_device_mix(cluster: Cluster) -> None:
    kinds = {d.type.device_class is DeviceClass.CPU for d in cluster.devices}
    if len(kinds) > 1:
        raise ConfigError(
            f"cluster {cluster.source!r} mixes cpu and GPU devices; one plan runs on one backend "
            "(gloo for cpu, NCCL for GPUs): remove the cpu devices or make every device cpu"
        )


def _training_spec(request: SolveRequest, cluster: Cluster, result: SolveResult) -> TrainingSpec:
    used = sorted(result.layout.device_indices)
    first = cluster.devices[used[0]]
    backend = Backend.GLOO if first.type.device_class is DeviceClass.CPU else Backend.NCCL
    return TrainingSpec(
        schedule=request.schedule,
        backend=backend,
        seed=request.seed,
        master_host=cluster.node(first.node).host,
        master_port=request.master_port,
    )
