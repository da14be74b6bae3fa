"""The compiler as a pass pipeline: model file + cluster file -> verified Plan.

:data:`PASSES`, in order, each a named pure function of the results before it whose result
is checked by its own ``verify()`` (``passes.run_passes`` runs them and names a failing
pass; ``hplan solve --dump-passes DIR`` writes every result as JSON): ``cluster``
(``hardware/``), ``capture``, ``trains_check``, ``cost_graph`` (``frontend/``; or a capture
file), ``runtime_bytes`` (``sim/spec``), ``time_source`` and ``problem`` (``cost/``), the
solver's named steps ``generate``, ``evaluate``, ``validate``, ``simulate`` and ``choose``
(``solve/``), then ``report`` and ``plan`` (``emit/``). ``--time-limit`` counts from the cost
passes on: the capture apart, it bounds the solve.

The CLI calls :func:`plan_training` and ``hplan.planner.emit.artifacts.emit``; nothing else
plans.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path

from hplan.planner.cost.problem import PlanningProblem, Policy
from hplan.planner.cost.problem_builder import (
    RooflineSource,
    UnitTimeSource,
    build_problem,
    optimizer_state_factor,
)
from hplan.planner.cost.profiled_times import (
    MeasuredSource,
    check_profile_targets,
    load_measured_source,
    profile_label,
    source_labels,
)
from hplan.planner.emit.plan_build import (
    build_plan,
    memory_model_spec,
    model_spec,
    with_grad_sync,
    with_memory,
)
from hplan.planner.emit.report import (
    REQUESTED,
    batch_statistics_notes,
    build_report,
    tp_notes,
    with_cost_sources,
)
from hplan.planner.frontend.capture import CapturedModel, capture_model
from hplan.planner.frontend.capture_file import (
    CaptureFile,
    StoredCapture,
    capture_record,
    load_capture,
)
from hplan.planner.frontend.cost_graph import ModelGraph, model_graph
from hplan.planner.frontend.trains_check import TrainsVerdict, check_trains
from hplan.planner.hardware.catalog import DeviceClass, PrecisionRequest, resolve_precision
from hplan.planner.hardware.cluster import Cluster, Device, load_cluster, to_cluster_spec
from hplan.planner.hardware.measured_links import load_measured_links
from hplan.planner.passes import Pass, PassObserver, PassResults, run_passes
from hplan.planner.profiling.comm_calibration import with_calibrated_collectives
from hplan.planner.profiling.profile_file import load_profiles
from hplan.planner.sim.spec import RuntimeBytes, simulated_step_time_s
from hplan.planner.solve.baselines import (
    Strategy,
    data_parallel_equal,
    pipeline_possible,
    uniform_pipeline,
)
from hplan.planner.solve.milp import MilpBackend
from hplan.planner.solve.previous import keep_previous
from hplan.planner.solve.search import SolveOptions
from hplan.planner.solve.solver import (
    Candidates,
    SolveResult,
    choose,
    evaluate_candidates,
    generate_step,
    simulate_candidates,
    validate_candidates,
)
from hplan.planner.solve.strategy import Generated, requested_only
from hplan.planner.solve.sync_choice import (
    DEFAULT_MAX_LOCAL_STEPS,
    DEFAULT_MAX_OVERLAP_STEPS,
    SyncRequest,
    WireRequest,
)
from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.contract.errors import ConfigError, InfeasiblePlanError, ModelFileError
from hplan.runtime.contract.plan import (
    MAX_LOCAL_STEPS,
    Backend,
    Plan,
    Precision,
    Report,
    Schedule,
    SolverStatus,
    TrainingSpec,
    ZeroStage,
)

MAX_GLOBAL_BATCH_SIZE = 2**30
"""The largest ``-b`` accepted (samples per optimizer step). The search's arrays grow with
the batch, so a larger one would run out of memory inside the solver instead of failing
here with a clear message."""


@dataclass(frozen=True)
class SolveRequest:
    """What ``hplan solve`` was asked for."""

    model_path: Path
    cluster_path: Path
    global_batch_size: int = 32
    micro_batch_sizes: tuple[int, ...] | None = None
    time_limit_s: float = 60.0
    solver: MilpBackend | None = None
    """The MILP backend (``--solver``); None: the first that works."""
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
    profile_paths: tuple[Path, ...] = ()
    """Measured profiles (``hplan profile``: files or directories of them, merged); their
    unit timings take precedence over the roofline. Empty: the roofline only."""
    previous_plan_path: Path | None = None
    """The plan a calibrated run measured (``--previous``): its layout is kept unless the
    search's is predicted faster under this solve's model (``solve.previous``)."""
    bandwidth_path: Path | None = None
    """A measured link matrix (``hplan bandwidth``); its device pairs override the cluster
    file's links. None: the cluster file's links only."""
    nodes: tuple[str, ...] | None = None
    """Plan for these nodes of the cluster file only (``hplan replan``); None: all."""
    without: tuple[str, ...] = ()
    """Nodes and devices (``box-b``, ``box-b/1``) of the cluster file to leave out (lost)."""
    precision: PrecisionRequest = PrecisionRequest.AUTO
    """``auto`` or one ``Precision`` for every device (``catalog.resolve_precision``)."""
    capture_path: Path | None = None
    """A capture file of the model (``hplan capture``): its cost graph and trains verdict
    stand for the capture, cost_graph and trains_check passes. None: capture the model."""
    steps: int | None = None
    """Optimizer steps a run of the plan trains (recorded in the plan's training section;
    ``--steps`` at run time overrides it). None: see ``epochs``."""
    epochs: int | None = None
    """Passes over the model file's ``dataset()`` a run trains, instead of ``steps``."""
    sync: SyncRequest = SyncRequest.AUTO
    """Which sync modes across islands the planner may choose (``solve.sync_choice``)."""
    max_local_steps: int = DEFAULT_MAX_LOCAL_STEPS
    """H at most under local sync (``--max-local-steps``)."""
    wire: WireRequest = WireRequest.AUTO
    """The pseudo-gradients' wire format, or ``auto`` per holder set (``--wire``)."""
    max_overlap_steps: int | None = None
    """tau at most: inner steps an outer sync may travel behind (``--max-overlap-steps``);
    None: not given, ``DEFAULT_MAX_OVERLAP_STEPS`` (:attr:`overlap_bound`)."""
    recompute: Policy = Policy.AUTO
    """Which stages may recompute their activations."""
    zero: Policy = Policy.AUTO
    """ZeRO (stage 1, or 2 where 1 does not fit; ``SolveOptions.zero``)."""
    offload: Policy = Policy.AUTO
    """Optimizer-state offload to host memory (``SolveOptions.offload``)."""
    tensor_parallel: Policy = Policy.AUTO
    """Tensor-parallel groups (``SolveOptions.tensor_parallel``, ``solve.strategy``)."""

    def __post_init__(self) -> None:
        """Enum fields given as strings (a script's ``sync="local_sgd"``) become members.

        Raises:
            ConfigError: a value is not one of its enum's, naming the option and the choices.
        """
        for name, kind in _ENUM_FIELDS:
            value = getattr(self, name)
            if value is None or isinstance(value, kind):
                continue
            try:
                object.__setattr__(self, name, kind(value))
            except ValueError:
                choices = ", ".join(m.value for m in kind)
                option = "--" + name.replace("_", "-")
                raise ConfigError(f"{option} {value!r} is not one of {choices}") from None

    @property
    def overlap_bound(self) -> int:
        """tau at most (``--max-overlap-steps``, else its default)."""
        if self.max_overlap_steps is None:
            return DEFAULT_MAX_OVERLAP_STEPS
        return self.max_overlap_steps

    def verify(self) -> None:
        """Check every option that can be checked without the model: ranges, micro-batch
        sizes against the global batch, and that the input files exist. Runs before the
        model file is imported (``hplan solve`` calls it first).

        Raises:
            ConfigError: naming the option, its value and the allowed range.
            ModelFileError: the model file is missing or a directory.
            PlanFileError: the ``--previous`` plan is not a valid, complete plan.
        """
        if not 1 <= self.global_batch_size <= MAX_GLOBAL_BATCH_SIZE:
            raise ConfigError(
                f"global batch size {self.global_batch_size} is outside "
                f"1..{MAX_GLOBAL_BATCH_SIZE:,} (-b); give a batch of samples per optimizer step"
            )
        _check_micro_batch_sizes(self.micro_batch_sizes, self.global_batch_size)
        if not (math.isfinite(self.time_limit_s) and self.time_limit_s > 0):
            raise ConfigError(
                f"--time-limit {self.time_limit_s:g} s must be a finite number of seconds > 0"
            )
        if self.max_stages < 1:
            raise ConfigError(f"--max-stages {self.max_stages} must be >= 1")
        _check_training_length(self.steps, self.epochs)
        if not 1 <= self.master_port <= 65534:
            raise ConfigError(f"--master-port {self.master_port} must be in 1..65534")
        _check_local_steps(self.max_local_steps)
        _check_sync_options(self.sync, self.wire, self.max_overlap_steps, self.max_local_steps)
        if self.tensor_parallel is Policy.ALWAYS and (
            Policy.ALWAYS in (self.zero, self.offload)
            or self.sync.local
            or self.strategy is not Strategy.HPLAN
        ):
            raise ConfigError(
                "--tensor-parallel always cannot be combined with --zero always, --offload "
                "always, --sync local_sgd/async (the runtime does not run them with TP "
                "groups) or a baseline --strategy; choose one of them"
            )
        if self.offload is Policy.ALWAYS and self.zero is Policy.ALWAYS:
            raise ConfigError(
                "--offload always and --zero always cannot be combined (offload does not run "
                "with ZeRO shards); choose one of them"
            )
        if self.strategy is not Strategy.HPLAN and self.sync not in (
            SyncRequest.AUTO,
            SyncRequest.ALL_REDUCE,
        ):
            raise ConfigError(
                f"--strategy {self.strategy.value} is a baseline that all-reduces every step; "
                f"--sync {self.sync} needs --strategy hplan"
            )
        if self.previous_plan_path is not None and self.strategy is not Strategy.HPLAN:
            raise ConfigError(
                f"--previous keeps a plan against the search's layout; --strategy "
                f"{self.strategy.value} does not search (use --strategy hplan)"
            )
        _check_model_path(self.model_path)
        for path, what in (
            (self.cluster_path, "cluster file"),
            *((path, "profile (--profile)") for path in self.profile_paths),
            (self.bandwidth_path, "bandwidth file (--bandwidth)"),
            (self.capture_path, "capture file (--capture)"),
            (self.previous_plan_path, "previous plan (--previous)"),
        ):
            if path is not None and not path.exists():
                raise ConfigError(f"{what} {str(path)!r} does not exist; pass an existing path")
        if self.previous_plan_path is not None:
            Plan.load(self.previous_plan_path)  # a bad plan is refused before the solve


_ENUM_FIELDS: tuple[tuple[str, type[StrEnum]], ...] = (
    ("schedule", Schedule),
    ("strategy", Strategy),
    ("solver", MilpBackend),
    ("precision", PrecisionRequest),
    ("sync", SyncRequest),
    ("wire", WireRequest),
    ("recompute", Policy),
    ("zero", Policy),
    ("offload", Policy),
    ("tensor_parallel", Policy),
)
"""The fields of :class:`SolveRequest` that hold an enum member, and its class."""


def _check_local_steps(max_local_steps: int) -> None:
    """``max_local_steps`` in 1..``MAX_LOCAL_STEPS`` (a ConfigError otherwise)."""
    if not 1 <= max_local_steps <= MAX_LOCAL_STEPS:
        raise ConfigError(
            f"--max-local-steps {max_local_steps} must be in 1..{MAX_LOCAL_STEPS} (inner "
            "steps per outer sync)"
        )


def _check_sync_options(
    sync: SyncRequest, wire: WireRequest, max_overlap_steps: int | None, max_local_steps: int
) -> None:
    """Refuse ``--wire`` and ``--max-overlap-steps`` where ``--sync`` cannot use them, and a
    bound outside 0..``max_local_steps - 1`` (``None``: not given).

    Raises:
        ConfigError: naming the options and the fix.
    """
    if wire is not WireRequest.AUTO and sync is SyncRequest.ALL_REDUCE:
        raise ConfigError(
            f"--wire {wire.value} is the format of pseudo-gradients across islands, and "
            "--sync all_reduce sends none; drop --wire or choose --sync auto, local_sgd, "
            "streaming or async"
        )
    if max_overlap_steps is None:
        return
    if not 0 <= max_overlap_steps < max(max_local_steps, 1):
        raise ConfigError(
            f"--max-overlap-steps {max_overlap_steps} must be in 0..{max_local_steps - 1} "
            "(inner steps an outer sync may travel behind, below --max-local-steps)"
        )
    if sync not in (SyncRequest.AUTO, SyncRequest.STREAMING):
        raise ConfigError(
            f"--max-overlap-steps bounds the overlap of --sync streaming and auto; --sync "
            f"{sync.value} does not overlap its outer sync (async: one round late); drop it "
            "or choose --sync streaming"
        )
    if sync is SyncRequest.STREAMING and max_overlap_steps == 0:
        raise ConfigError(
            "--sync streaming overlaps its outer sync with at least one inner step; "
            "--max-overlap-steps 0 would leave it blocking: give 1 or more, or use --sync "
            "local_sgd"
        )


def _check_training_length(steps: int | None, epochs: int | None) -> None:
    """At most one of ``steps`` and ``epochs``, each >= 1 (a ConfigError otherwise)."""
    if steps is not None and epochs is not None:
        raise ConfigError(
            f"--steps {steps} and --epochs {epochs} both give the training length; keep one"
        )
    for value, option in ((steps, "--steps"), (epochs, "--epochs")):
        if value is not None and value < 1:
            raise ConfigError(f"{option} {value} must be >= 1")


def _check_micro_batch_sizes(sizes: tuple[int, ...] | None, global_batch_size: int) -> None:
    """Every candidate micro-batch size in 1..global batch size (a ConfigError otherwise)."""
    if sizes is None:
        return
    if not sizes:
        raise ConfigError("--micro-batch-sizes is empty; give at least one size, e.g. 1")
    too_large = [size for size in sizes if not 1 <= size <= global_batch_size]
    if too_large:
        raise ConfigError(
            f"--micro-batch-sizes {','.join(map(str, sizes))} has "
            f"{','.join(map(str, too_large))} outside 1..{global_batch_size} (the global "
            f"batch size, -b); give sizes up to {global_batch_size} or raise -b"
        )


def _check_model_path(path: Path) -> None:
    if path.is_dir():
        raise ModelFileError(
            f"model file {str(path)!r} is a directory; pass the path to the model.py inside it"
        )
    if not path.is_file():
        raise ModelFileError(f"model file {str(path)!r} does not exist; pass a path to model.py")


@dataclass(frozen=True)
class DevicePrecisions:
    """The precision each device computes in (``catalog.resolve_precision``)."""

    by_device: Mapping[str, Precision]

    @property
    def widest(self) -> Precision:
        """The precision whose activations and cut tensors are largest (fp32 or tf32 when
        any device has no autocast): what per-unit figures are counted in."""
        plain = [p for p in self.by_device.values() if p.autocast_dtype is None]
        return plain[0] if plain or not self.by_device else next(iter(self.by_device.values()))

    def verify(self) -> None:
        """Every value is a ``Precision``."""
        for name, precision in self.by_device.items():
            if not isinstance(precision, Precision):
                raise ValueError(f"device {name!r} has precision {precision!r}")


@dataclass(frozen=True)
class ClusterInput:
    """The cluster a plan is made for, and the report's note on where its links came from."""

    cluster: Cluster
    link_notes: tuple[str, ...]
    precisions: DevicePrecisions
    """What each device computes in, for ``--precision`` (resolved with the cluster, so a
    precision no device can run fails before the model is captured)."""

    def verify(self) -> None:
        """The cluster's invariants (``Cluster.verify``) and the precisions'."""
        self.cluster.verify()
        self.precisions.verify()


@dataclass(frozen=True)
class PlanningOutcome:
    """The plan and the intermediate values that produced it."""

    plan: Plan
    graph: ModelGraph
    problem: PlanningProblem
    result: SolveResult
    solve_time_s: float
    """Wall time of the solver's passes (:data:`SOLVE_PASSES`), seconds."""
    pass_times_s: tuple[tuple[str, float], ...] = ()
    """Wall time of every pass, in order: (pass name, seconds)."""
    capture: CapturedModel | StoredCapture | None = None
    """The capture pass's result (the model captured here, or read from a capture file)."""
    trains: TrainsVerdict | None = None
    """The trains check's verdict."""

    def phase_times_s(self) -> tuple[tuple[str, float], ...]:
        """Wall time of every phase (:data:`PHASES`) that ran, in order, seconds."""
        per_phase: dict[str, float] = {}
        for name, time_s in self.pass_times_s:
            phase = phase_of(name)
            per_phase[phase] = per_phase.get(phase, 0.0) + time_s
        return tuple(per_phase.items())


def plan_training(
    request: SolveRequest,
    progress: PassObserver | None = None,
    *,
    dump_dir: Path | None = None,
) -> PlanningOutcome:
    """Plan ``request.model_path`` on ``request.cluster_path`` (the passes of :data:`PASSES`).

    ``request.verify()`` runs first: a bad option is refused before the model is imported.

    Args:
        progress: told when each pass starts (with its line) and ends (with its time).
        dump_dir: write every pass's result there as JSON (``passes.debug_json``).

    Raises:
        ModelFileError, TraceError, ConfigError: bad model file, model, cluster file or
            bandwidth file (one naming devices the cluster lacks).
        InfeasiblePlanError: nothing fits; names the binding constraint.
        SolverUnavailableError: a requested solver does not work here.
        PassError: a pass failed in a way that is a bug (names the pass).
    """
    request.verify()
    results = run_passes(PASSES, request, progress=progress, dump_dir=dump_dir)
    return PlanningOutcome(
        plan=results["plan"],
        graph=results["cost_graph"],
        problem=results["problem"],
        result=results["choose"],
        solve_time_s=sum(results[f"{name}.time_s"] for name in SOLVE_PASSES),
        pass_times_s=tuple((step.name, results[f"{step.name}.time_s"]) for step in PASSES),
        capture=results["capture"],
        trains=results["trains_check"],
    )


# --------------------------------------------------------------------------- the passes
def _request(r: PassResults) -> SolveRequest:
    request: SolveRequest = r["request"]
    return request


def cluster_pass(r: PassResults) -> ClusterInput:
    """The cluster, with measured links over the file's when ``bandwidth_path`` is given,
    the profiles' calibrated node collectives (``hplan calibrate``) over those, restricted
    to ``nodes`` less ``without`` (a re-plan for the devices left)."""
    request = _request(r)
    cluster = load_cluster(request.cluster_path)
    notes: tuple[str, ...] = ()
    if request.bandwidth_path is not None:
        measured = load_measured_links(cluster, request.bandwidth_path)
        cluster, notes = measured.cluster, (measured.note,)
    if request.profile_paths:
        cluster, calibrated = with_calibrated_collectives(
            cluster,
            load_profiles(request.profile_paths).node_collectives,
            profile_label(request.profile_paths),
        )
        notes = (*notes, *calibrated)
    if request.nodes is not None or request.without:
        cluster = cluster.select(nodes=request.nodes, without=request.without)
    _check_device_mix(cluster)
    _check_islands(cluster, request.sync)
    return ClusterInput(cluster, notes, _device_precisions(request, cluster))


def _device_precisions(request: SolveRequest, cluster: Cluster) -> DevicePrecisions:
    return DevicePrecisions(
        {
            d.name: resolve_precision(request.precision, d.type, device_name=d.name)
            for d in cluster.devices
        }
    )


Capture = CapturedModel | StoredCapture
"""The capture pass's result: the model captured here, or read from a capture file."""


def capture_pass(r: PassResults) -> Capture:
    """The model file loaded, its model built and traced (once for the whole solve); or,
    with ``capture_path``, the capture file checked against the model file and settings
    (the model file neither imported nor built)."""
    request = _request(r)
    if request.capture_path is not None:
        return load_capture(
            request.capture_path,
            model_path=request.model_path,
            seed=request.seed,
            leaf_modules=request.leaf_modules,
        )
    model_file = load_model_file(request.model_path)
    if request.epochs is not None and model_file.dataset is None:
        raise ConfigError(
            f"--epochs {request.epochs}: {str(request.model_path)!r} has no dataset() to count "
            "epochs of; give --steps N instead, or add dataset() to the model file"
        )
    return capture_model(
        model_file, leaf_modules=request.leaf_modules, seed=request.seed, progress=r.tell
    )


def cost_graph_pass(r: PassResults) -> ModelGraph:
    """The cost graph of the captured model; the capture file's, when it came from one."""
    captured: Capture = r["capture"]
    if isinstance(captured, StoredCapture):
        return captured.graph
    return model_graph(captured, r["trains_check"].loss_memory)


def trains_check_pass(r: PassResults) -> TrainsVerdict:
    """The check that the captured model trains; the capture file's verdict, when it came
    from one."""
    captured: Capture = r["capture"]
    if isinstance(captured, StoredCapture):
        return captured.trains
    return check_trains(captured)


def _capturing(r: PassResults) -> str:
    path = _request(r).capture_path
    return "loading and tracing the model" if path is None else f"reading the capture {path}"


def _measuring(r: PassResults) -> str:
    small, large = r["capture"].batch_sizes
    return f"measuring the graph at batch sizes {small} and {large}"


def _stored(r: PassResults) -> bool:
    return isinstance(r["capture"], StoredCapture)


def time_source_pass(r: PassResults) -> UnitTimeSource:
    """The roofline, or the measured profiles (checked to be of this model, and to name only
    nodes and devices of the cluster file)."""
    request = _request(r)
    if not request.profile_paths:
        return RooflineSource()
    source = load_measured_source(
        request.profile_paths, r["cost_graph"], model_path=request.model_path
    )
    selected = request.nodes is not None or bool(request.without)
    cluster = load_cluster(request.cluster_path) if selected else r["cluster"].cluster
    check_profile_targets(source.profile, cluster, source.label)
    return source


def problem_pass(r: PassResults) -> PlanningProblem:
    """The solver's arrays, from the cost graph, the cluster and the unit times."""
    request, graph = _request(r), r["cost_graph"]
    captured: Capture = r["capture"]
    if isinstance(captured, StoredCapture):
        optimizer_factor = captured.optimizer_state_bytes_per_param_byte
    else:
        optimizer_factor = optimizer_state_factor(
            captured.model_file, param_dtype=graph.param_dtype
        )
    return build_problem(
        graph,
        r["cluster"].cluster,
        global_batch_size=request.global_batch_size,
        micro_batch_sizes=request.micro_batch_sizes,
        optimizer_state_bytes_per_param_byte=optimizer_factor,
        time_source=r["time_source"],
        precisions=r["cluster"].precisions.by_device,
        recompute=request.recompute,
        schedule=request.schedule,
    )


def _solve_options(request: SolveRequest) -> SolveOptions:
    return SolveOptions(
        time_limit_s=request.time_limit_s,
        backend=request.solver,
        max_stages=request.max_stages,
        sync=request.sync,
        max_local_steps=request.max_local_steps,
        wire=request.wire,
        max_overlap_steps=request.overlap_bound,
        zero=request.zero,
        offload=request.offload,
        tensor_parallel=request.tensor_parallel,
    )


def generate_pass(r: PassResults) -> Generated:
    """Every strategy family's candidate layouts (``solve.strategy``), with the throughput
    bound computed meanwhile. ``--time-limit`` counts from the cost phase on (capture
    apart), so it bounds everything after the capture; a requested baseline generates
    nothing (the choose pass builds it)."""
    request, problem = _request(r), r["problem"]
    _check_tp_offered(request, problem, r["cost_graph"])
    started_s = time.monotonic() - r["time_source.time_s"] - r["problem.time_s"]
    deadline_s = started_s + request.time_limit_s
    if request.strategy is not Strategy.HPLAN:
        return requested_only(problem, _solve_options(request), deadline_s=deadline_s)
    return generate_step(problem, _solve_options(request), deadline_s=deadline_s, with_bound=True)


def _check_tp_offered(request: SolveRequest, problem: PlanningProblem, graph: ModelGraph) -> None:
    """``--tensor-parallel always`` for a model that offers no TP: a ConfigError saying why
    (``ModelGraph.tp_refusal``)."""
    if request.tensor_parallel is not Policy.ALWAYS or problem.tensor_parallel is not None:
        return
    why = graph.tp_refusal or "its TP plan splits no module of the traced graph"
    raise ConfigError(
        f"--tensor-parallel always: tensor parallelism is not offered for this model ({why}); "
        "use --tensor-parallel auto or never"
    )


def evaluate_pass(r: PassResults) -> Candidates:
    """Every candidate re-costed by the exact evaluator, ranked per family and pool."""
    return evaluate_candidates(r["problem"], r["generate"])


def validate_pass(r: PassResults) -> Candidates:
    """Every candidate checked by the independent validator (rejected ones kept, named)."""
    return validate_candidates(r["problem"], r["evaluate"])


def simulate_pass(r: PassResults) -> Candidates:
    """Each pool's best valid layouts simulated with the bytes their plans will send."""
    generated: Generated = r["generate"]
    return simulate_candidates(
        r["problem"], r["validate"], r["runtime_bytes"], deadline_s=generated.deadline_s
    )


def choose_pass(r: PassResults) -> SolveResult:
    """The layout: the search's choice (or ``--previous``'s, when predicted no slower), or
    the requested baseline's."""
    request, problem, runtime = _request(r), r["problem"], r["runtime_bytes"]
    if request.strategy is not Strategy.HPLAN:
        return _baseline(problem, request, runtime)
    result = choose(problem, _solve_options(request), r["simulate"], runtime)
    if request.previous_plan_path is None:
        return result
    path = request.previous_plan_path
    return keep_previous(problem, result, Plan.load(path), path, request.schedule, runtime)


def report_pass(r: PassResults) -> Report:
    """The plan's report, with each rank's cost source when a profile was given."""
    request, result = _request(r), r["choose"]
    problem = result.solved_problem(r["problem"])
    graph: ModelGraph = r["cost_graph"]
    source: UnitTimeSource = r["time_source"]
    notes = (
        *graph.notes,
        *r["trains_check"].notes,
        *r["cluster"].link_notes,
        *batch_statistics_notes(graph.batch_statistics, result.layout),
        *tp_notes(
            r["problem"],
            result,
            forced=request.tensor_parallel is Policy.ALWAYS,
            refusal=graph.tp_refusal,
        ),
    )
    report = build_report(
        problem,
        result,
        cost_source=source.name,
        notes=notes,
        max_local_steps=request.max_local_steps,
        baseline_problem=r["problem"],
    )
    if not request.profile_paths:
        return report
    cluster = r["cluster"].cluster
    devices = [cluster.device(name) for name in problem.device_names]
    labels = source_labels(source, devices, graph.unit_costs, problem.micro_batch_sizes)
    report = with_cost_sources(report, problem, result.layout, labels, source_name=source.name)
    profile_notes = (
        source.borrowed_notes(cluster.devices) if isinstance(source, MeasuredSource) else []
    )
    unmeasured = _unmeasured_kinds(cluster.devices, labels)
    if unmeasured:
        profile_notes.append(
            f"profile {profile_label(request.profile_paths)} has no measurement for "
            f"{', '.join(unmeasured)} and none to scale from: the roofline stands for them"
        )
    return replace(report, notes=(*report.notes, *profile_notes))


def plan_pass(r: PassResults) -> Plan:
    """The plan of the chosen layout, its gradient buckets and its simulated step time."""
    request, result = _request(r), r["choose"]
    problem = result.solved_problem(r["problem"])
    graph: ModelGraph = r["cost_graph"]
    captured: Capture = r["capture"]
    cluster = r["cluster"].cluster
    precisions = r["cluster"].precisions.by_device
    plan = build_plan(
        graph=graph,
        model=model_spec(
            graph,
            path=recorded_model_path(request.model_path, request.out_dir),
            sha256=captured.model_sha256,
            loss_convention=r["trains_check"].loss_convention,
        ),
        cluster=to_cluster_spec(cluster, graph.param_dtype, precisions=precisions),
        device_names=problem.device_names,
        layout=result.layout,
        global_batch_size=request.global_batch_size,
        report=r["report"],
        training=_training_spec(request, cluster, result, problem.min_microbatch_samples),
        precisions=precisions,
        tp_members=problem.tp_members,
    )
    plan = with_memory(plan, memory_model_spec(graph, r["problem"]))
    return with_grad_sync(plan, r["runtime_bytes"].wire_bytes, result.simulated_step_time_s)


def _solving(r: PassResults) -> str:
    problem, request = r["problem"], _request(r)
    return (
        f"solving ({problem.num_units} units, {problem.num_devices} devices, "
        f"limit {request.time_limit_s:g} s)"
    )


PASSES: Sequence[Pass] = (
    Pass("cluster", cluster_pass),
    Pass("capture", capture_pass, _capturing),
    Pass(
        "trains_check",
        trains_check_pass,
        lambda r: (
            "the capture file's trains check" if _stored(r) else "checking that the model trains"
        ),
    ),
    Pass(
        "cost_graph",
        cost_graph_pass,
        lambda r: "the capture file's cost graph" if _stored(r) else _measuring(r),
    ),
    Pass(
        "runtime_bytes",
        lambda r: RuntimeBytes.of(r["cost_graph"], r["cluster"].precisions.widest),
    ),
    Pass("time_source", time_source_pass),
    Pass("problem", problem_pass),
    Pass("generate", generate_pass, _solving),
    Pass("evaluate", evaluate_pass, lambda r: "evaluating the candidates"),
    Pass("validate", validate_pass, lambda r: "validating the candidates"),
    Pass("simulate", simulate_pass, lambda r: "simulating the best candidates"),
    Pass("choose", choose_pass, lambda r: "choosing the layout"),
    Pass("report", report_pass),
    Pass("plan", plan_pass),
)
"""The passes of a solve, in order (see the module docstring)."""

SOLVE_PASSES = ("generate", "evaluate", "validate", "simulate", "choose")
"""The solver's named steps (``solve.solver``), each a pass of its own."""

PHASES: Sequence[tuple[str, tuple[str, ...]]] = (
    ("cluster", ("cluster",)),
    ("capture", ("capture", "trains_check", "cost_graph", "runtime_bytes")),
    ("cost", ("time_source", "problem")),
    ("solve", SOLVE_PASSES),
    ("report", ("report", "plan")),
)
"""What ``hplan solve`` shows progress and times for: each phase and its passes, in order
(``solve`` searches, re-costs, validates and simulates; writing the files comes after)."""


def phase_of(pass_name: str) -> str:
    """The phase of :data:`PHASES` that pass ``pass_name`` belongs to (ValueError if none)."""
    for phase, names in PHASES:
        if pass_name in names:
            return phase
    raise ValueError(f"pass {pass_name!r} is in no phase")


# --------------------------------------------------------------------------- capture
def capture_to_file(
    model_path: Path,
    out_path: Path,
    *,
    leaf_modules: tuple[str, ...] = (),
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> CaptureFile:
    """Capture ``model_path`` once and write its capture file to ``out_path``
    (``hplan capture``): what ``hplan solve --capture`` reads instead of capturing again.

    Runs what a solve's capture, cost_graph and trains_check passes run, with the same
    ``leaf_modules`` and ``seed`` (a solve from the file must ask for the same), and the
    optimizer state factor the problem pass would compute; ``progress`` is told what the
    capture does as it goes.

    Raises:
        ModelFileError, TraceError: bad model file or model (as ``hplan solve``).
        ConfigError: ``out_path`` cannot be written (names it).
    """
    _check_model_path(model_path)
    model_file = load_model_file(model_path)
    captured = capture_model(model_file, leaf_modules=leaf_modules, seed=seed, progress=progress)
    trains = check_trains(captured)
    graph = model_graph(captured, trains.loss_memory)
    graph.verify()
    record = _record_of(captured, graph, trains, model_path=model_path, leaf_modules=leaf_modules)
    _write_capture(record, out_path)
    return record


def save_outcome_capture(outcome: PlanningOutcome, request: SolveRequest, out_path: Path) -> None:
    """Write the capture a solve made (or read) as a capture file at ``out_path``, without
    capturing the model again (``hplan solve --elastic``: re-solves start from it).

    Raises:
        ConfigError: ``out_path`` cannot be written (names it).
    """
    captured, trains = outcome.capture, outcome.trains
    assert captured is not None and trains is not None, "an outcome of plan_training"
    if isinstance(captured, StoredCapture):
        text = captured.source.read_text(encoding="utf-8")
        _write_text(out_path, text, what="capture file")
        return
    record = _record_of(
        captured, outcome.graph, trains, model_path=request.model_path,
        leaf_modules=request.leaf_modules,
    )  # fmt: skip
    _write_capture(record, out_path)


def _record_of(
    captured: CapturedModel,
    graph: ModelGraph,
    trains: TrainsVerdict,
    *,
    model_path: Path,
    leaf_modules: tuple[str, ...],
) -> CaptureFile:
    return capture_record(
        graph,
        trains,
        optimizer_state_bytes_per_param_byte=optimizer_state_factor(
            captured.model_file, param_dtype=graph.param_dtype
        ),
        model_path=model_path,
        model_sha256=captured.model_file.sha256,
        seed=captured.seed,
        leaf_modules=leaf_modules,
        batch_sizes=captured.batch_sizes,
    )


def _write_capture(record: CaptureFile, out_path: Path) -> None:
    _write_text(out_path, record.to_json(), what="capture file")


def _write_text(out_path: Path, text: str, *, what: str) -> None:
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"cannot write the {what} {str(out_path)!r} ({exc.strerror}); "
            "choose a writable path (-o)"
        ) from None


# --------------------------------------------------------------------------- helpers
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


def _baseline(
    problem: PlanningProblem, request: SolveRequest, runtime: RuntimeBytes
) -> SolveResult:
    from hplan.planner.cost.evaluate import evaluate
    from hplan.planner.cost.even_microbatches import floored

    pipeline = request.strategy is Strategy.UNIFORM_PIPELINE
    if pipeline and not pipeline_possible(problem):
        raise ConfigError(
            f"the uniform baseline is a pipeline of two or more stages; this cluster and model "
            f"have {problem.num_devices} device(s) and {problem.num_units} unit(s): use "
            "--strategy ddp or hplan"
        )
    layout = (uniform_pipeline if pipeline else data_parallel_equal)(problem)
    if layout is None:
        raise InfeasiblePlanError(
            f"the {request.strategy.value} baseline does not fit this cluster's memory; "
            "use the hplan strategy"
        )
    layout = floored(problem, layout)  # no micro-batch below batch norm's floor
    return SolveResult(
        layout=layout,
        evaluation=evaluate(problem, layout),
        status=SolverStatus.HEURISTIC,
        gap=None,
        backend="none",
        source=f"{REQUESTED}{request.strategy.value} baseline",
        notes=(f"{request.strategy.value} baseline requested; the layout was not optimised",),
        simulated_step_time_s=simulated_step_time_s(problem, layout, request.schedule, runtime),
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


def _check_islands(cluster: Cluster, sync: SyncRequest) -> None:
    if sync.local and len(cluster.nodes) < 2:
        raise ConfigError(
            f"--sync {sync.value} syncs islands of nodes; cluster {cluster.source!r} has one "
            "node: use --sync auto or all_reduce"
        )


def _check_device_mix(cluster: Cluster) -> None:
    kinds = {d.type.device_class is DeviceClass.CPU for d in cluster.devices}
    if len(kinds) > 1:
        raise ConfigError(
            f"cluster {cluster.source!r} mixes cpu and GPU devices; one plan runs on one backend "
            "(gloo for cpu, NCCL for GPUs): remove the cpu devices or make every device cpu"
        )


def _training_spec(
    request: SolveRequest, cluster: Cluster, result: SolveResult, min_microbatch_samples: int
) -> TrainingSpec:
    used = sorted(result.layout.device_indices)
    first = cluster.devices[used[0]]
    backend = Backend.GLOO if first.type.device_class is DeviceClass.CPU else Backend.NCCL
    return TrainingSpec(
        schedule=request.schedule,
        backend=backend,
        seed=request.seed,
        master_host=cluster.node(first.node).host,
        master_port=request.master_port,
        steps=request.steps,
        epochs=request.epochs,
        zero_stage=(
            ZeroStage(result.layout.zero_stage)
            if result.layout.optimizer_shard_weights
            else ZeroStage.NONE
        ),
        min_microbatch_samples=min_microbatch_samples,
    )
