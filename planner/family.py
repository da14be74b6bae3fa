"""The plan family of an elastic run (``hplan solve --elastic``): plans solved ahead.

After the solve for every node of the cluster, :func:`solve_family` solves the same model,
with the same options, for every membership a run is likely to see next (every node but
one), each from the capture the solve made (written once as ``capture.json``: no membership
traces the model again), and writes beside ``plan.json``::

    family.json  capture.json  cluster.yaml  family/<members key>/plan.json (+ summary.txt)

``family.json`` (``contract.elastic.PlanFamily``) is what the ranks read at each (re)start
under torchrun's elastic agent; a membership it lacks is solved during the run by
``hplan replan --members`` (``contract.elastic.replan_command``). A membership that cannot
hold the model is recorded in ``infeasible`` with the solver's one-line reason.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from hplan.planner.api import PlanningOutcome, SolveRequest, plan_training, save_outcome_capture
from hplan.planner.emit.artifacts import PLAN_FILE, emit_plan_only
from hplan.planner.hardware.cluster import Cluster, load_cluster
from hplan.planner.solve.sync_choice import SyncRequest
from hplan.runtime.contract.elastic import (
    FAMILY_FILE,
    FAMILY_VERSION,
    PlanFamily,
    hplan_version,
    members_key,
)
from hplan.runtime.contract.errors import ConfigError, InfeasiblePlanError
from hplan.runtime.contract.plan import Plan

__all__ = [
    "CAPTURE_FILE",
    "CLUSTER_FILE",
    "FAMILY_DIR",
    "FamilyOutcome",
    "MemberPlan",
    "check_min_nodes",
    "likely_memberships",
    "member_request",
    "solve_family",
]

CAPTURE_FILE = "capture.json"
CLUSTER_FILE = "cluster.yaml"
FAMILY_DIR = "family"


@dataclass(frozen=True, slots=True)
class MemberPlan:
    """One membership solved ahead: its plan, or why none fits."""

    members: tuple[str, ...]
    """Its nodes, in cluster order."""
    plan: Plan | None
    """None: the members cannot hold the model (see ``reason``)."""
    reason: str | None
    """The solver's one-line reason, for an infeasible membership."""
    solve_time_s: float

    @property
    def key(self) -> str:
        return members_key(self.members)


@dataclass(frozen=True, slots=True)
class FamilyOutcome:
    """The family written beside the full plan."""

    family: PlanFamily
    members: tuple[MemberPlan, ...]
    """The memberships solved ahead (the full plan apart), in the order solved."""
    files: tuple[Path, ...]
    """Every file written, in order (``family.json`` last)."""


def likely_memberships(nodes: Sequence[str]) -> list[tuple[str, ...]]:
    """The memberships solved ahead besides every node: every node but one, in cluster
    order (none for a one-node cluster)."""
    if len(nodes) < 2:
        return []
    return [tuple(n for n in nodes if n != lost) for lost in nodes]


def member_request(
    request: SolveRequest, members: Sequence[str], capture_path: Path, out_dir: Path
) -> SolveRequest:
    """The full solve's request for exactly ``members``' devices, from ``capture_path``.

    Every option is kept (global batch, schedule, seed, port, length, precision, policies,
    time limit, profiles, bandwidth file) but ``--previous`` (a layout of other devices) and
    a local-SGD ``--sync`` for one node (nothing to sync across: ``auto``).
    """
    sync = request.sync
    if len(members) < 2 and sync.local:
        sync = SyncRequest.AUTO
    return replace(
        request,
        nodes=tuple(members),
        without=(),
        capture_path=capture_path,
        out_dir=out_dir,
        previous_plan_path=None,
        sync=sync,
    )


def solve_family(
    request: SolveRequest,
    outcome: PlanningOutcome,
    out_dir: Path,
    *,
    min_nodes: int | None = None,
    tell: Callable[[str], None] | None = None,
    solved: Callable[[MemberPlan], None] | None = None,
) -> FamilyOutcome:
    """Solve every likely membership ahead and write the family beside ``out_dir/plan.json``.

    Args:
        request: the full solve's request; ``outcome``: its result (its capture is reused).
        min_nodes: the fewest nodes the run goes on with; None: the smallest membership that
            holds the model (of the full plan and those solved ahead).
        tell: told what is being solved (progress).
        solved: told of each membership once solved.

    Raises:
        ConfigError: ``min_nodes`` outside 1..number of nodes, or a file cannot be written.
        Other planning errors of a membership (not ``InfeasiblePlanError``) as ``hplan solve``.
    """
    cluster = load_cluster(request.cluster_path)
    nodes = tuple(n.name for n in cluster.nodes)
    _check_min_nodes(min_nodes, len(nodes))
    capture_path = out_dir / CAPTURE_FILE
    save_outcome_capture(outcome, request, capture_path)
    cluster_copy = out_dir / CLUSTER_FILE
    _copy(request.cluster_path, cluster_copy)
    files = [capture_path, cluster_copy]
    memberships = likely_memberships(nodes)
    results = []
    for index, members in enumerate(memberships, start=1):
        if tell is not None:
            tell(f"solving ahead for {', '.join(members)} ({index}/{len(memberships)})")
        member = _solve_member(request, members, capture_path, out_dir)
        if member.plan is not None:
            files += emit_plan_only(member.plan, out_dir / FAMILY_DIR / member.key)
        results.append(member)
        if solved is not None:
            solved(member)
    family = _family(cluster, outcome.plan, tuple(results), min_nodes)
    family = replace(
        family,
        replan_options=replan_options(request),
        replan_files=_copy_inputs(request, out_dir),
    )
    family_path = out_dir / FAMILY_FILE
    try:
        family.save(family_path)
    except OSError as exc:
        raise ConfigError(
            f"cannot write {str(family_path)!r} ({exc.strerror}); pass -o a folder you can write to"
        ) from None
    return FamilyOutcome(family=family, members=tuple(results), files=(*files, family_path))


def replan_options(request: SolveRequest) -> tuple[str, ...]:
    """The solve's options as ``hplan replan`` takes them: a membership solved during the
    run is planned as the family was (the files: :func:`_copy_inputs`)."""
    options = [
        "--time-limit", f"{request.time_limit_s:g}",
        "--precision", request.precision.value,
        "--sync", request.sync.value,
        "--max-local-steps", str(request.max_local_steps),
        "--wire", request.wire.value,
        "--recompute", request.recompute.value,
        "--zero", request.zero.value,
        "--offload", request.offload.value,
        "--tensor-parallel", request.tensor_parallel.value,
    ]  # fmt: skip
    if request.max_overlap_steps is not None:
        options += ["--max-overlap-steps", str(request.max_overlap_steps)]
    if request.micro_batch_sizes:
        options += ["--micro-batch-sizes", ",".join(map(str, request.micro_batch_sizes))]
    return tuple(options)


INPUTS_DIR = "inputs"


def _copy_inputs(request: SolveRequest, out_dir: Path) -> dict[str, tuple[str, ...]]:
    """Copy the solve's profiles and link matrix into ``<out>/inputs/`` (every node gets the
    plan folder, not the solving machine's files); their paths relative to ``out_dir``."""
    sources = {"--profile": request.profile_paths}
    if request.bandwidth_path is not None:
        sources["--bandwidth"] = (request.bandwidth_path,)
    copied: dict[str, tuple[str, ...]] = {}
    for option, paths in sources.items():
        names = []
        for index, path in enumerate(paths):
            target = out_dir / INPUTS_DIR / f"{option.strip('-')}-{index}-{path.name}"
            target.parent.mkdir(parents=True, exist_ok=True)
            if path.is_dir():
                shutil.copytree(path, target, dirs_exist_ok=True)
            else:
                shutil.copyfile(path, target)
            names.append(str(target.relative_to(out_dir)))
        if names:
            copied[option] = tuple(names)
    return copied


def _solve_member(
    request: SolveRequest, members: tuple[str, ...], capture_path: Path, out_dir: Path
) -> MemberPlan:
    started_s = time.monotonic()
    member = member_request(
        request, members, capture_path, out_dir / FAMILY_DIR / members_key(members)
    )
    try:
        plan = plan_training(member).plan
    except InfeasiblePlanError as exc:
        reason = " ".join(str(exc).split())
        return MemberPlan(members, None, reason, time.monotonic() - started_s)
    return MemberPlan(members, plan, None, time.monotonic() - started_s)


def _family(
    cluster: Cluster, full: Plan, members: tuple[MemberPlan, ...], min_nodes: int | None
) -> PlanFamily:
    nodes = tuple(n.name for n in cluster.nodes)
    plans = {members_key(nodes): PLAN_FILE}
    plans.update(
        {m.key: f"{FAMILY_DIR}/{m.key}/{PLAN_FILE}" for m in members if m.plan is not None}
    )
    infeasible = {m.key: m.reason for m in members if m.reason is not None}
    if min_nodes is None:
        min_nodes = min([len(nodes), *(len(m.members) for m in members if m.plan is not None)])
    digests = sorted((m.key, m.plan.digest()) for m in members if m.plan is not None)
    run_id = _run_id([hplan_version(), full.digest(), digests, sorted(infeasible), min_nodes])
    return PlanFamily(
        schema_version=FAMILY_VERSION,
        hplan_version=hplan_version(),
        nodes=nodes,
        processes_per_node={n.name: len(n.devices) for n in cluster.nodes},
        min_nodes=min_nodes,
        rendezvous_host=cluster.nodes[0].host,
        rendezvous_port=full.training.master_port,
        run_id=run_id,
        cluster_file=CLUSTER_FILE,
        capture_file=CAPTURE_FILE,
        model_digest=full.model.sha256,
        plans=plans,
        infeasible=infeasible,
    )


def _run_id(parts: list[object]) -> str:
    """torchrun's ``--rdzv-id``: a digest of what the family runs (stable for the same
    family; two families never share one)."""
    return "hplan-" + hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def check_min_nodes(min_nodes: int | None, cluster_path: Path) -> None:
    """Refuse a ``--min-nodes`` outside 1..the cluster file's nodes before anything is solved.

    Raises:
        ConfigError: naming the value and the range; or a bad cluster file.
    """
    _check_min_nodes(min_nodes, len(load_cluster(cluster_path).nodes))


def _check_min_nodes(min_nodes: int | None, num_nodes: int) -> None:
    if min_nodes is not None and not 1 <= min_nodes <= num_nodes:
        raise ConfigError(
            f"--min-nodes {min_nodes} must be in 1..{num_nodes} (the cluster's nodes)"
        )


def _copy(source: Path, target: Path) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.resolve() != target.resolve():
            shutil.copyfile(source, target)
    except OSError as exc:
        raise ConfigError(
            f"cannot copy the cluster file to {str(target)!r} ({exc.strerror}); pass -o a "
            "folder you can write to"
        ) from None
