"""``hplan replan``: solve a plan again for the devices that are left (or that joined).

A lost node or card: ``hplan replan out/plan.json --cluster cluster.yaml --without box-b``
plans the same model, global batch size, schedule, seed and training length (a checkpoint
carries over only under the first four) on the plan's devices less ``box-b``, and writes the new plan and launch
scripts; the job then continues from its latest checkpoint with ``--resume``
(``executor/checkpoint.py`` loads it under any plan). ``--with`` adds back a node or device
of the cluster file that the plan does not use (a node that joined, a card repaired).
``--members a,b`` plans for exactly the cluster file's devices of those nodes (what an elastic
run's ranks ask for a membership its family lacks: ``contract.elastic.replan_command``), and
``--capture FILE`` plans from the model's capture file instead of tracing the model again.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from hplan.planner.cli.console import parse_sizes, stderr
from hplan.planner.cli.progress import PhaseProgress
from hplan.planner.cli.solve import (
    bandwidth_option,
    max_local_steps_option,
    max_overlap_steps_option,
    micro_batch_sizes_option,
    offload_option,
    precision_option,
    print_plan,
    profile_option,
    recompute_option,
    sync_option,
    tensor_parallel_option,
    time_limit_option,
    wire_option,
    write_files,
    zero_option,
)
from hplan.planner.cost.problem import Policy
from hplan.planner.hardware.catalog import PrecisionRequest
from hplan.planner.solve.sync_choice import SyncRequest, WireRequest
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.plan import OuterSyncSpec, Plan, SyncMode

if TYPE_CHECKING:
    from hplan.planner.hardware.cluster import Cluster


@click.command()
@click.argument("plan_path", metavar="PLAN", type=click.Path(path_type=Path))
@click.option(
    "--cluster",
    "-c",
    "cluster_path",
    required=True,
    type=click.Path(path_type=Path),
    help="The cluster.yaml the plan was solved with (plus any node that joins).",
)
@click.option(
    "--without",
    multiple=True,
    metavar="NODE|DEVICE",
    help="A node (box-b) or device (box-b/1) that is lost (repeatable).",
)
@click.option(
    "--with",
    "joining",
    multiple=True,
    metavar="NODE|DEVICE",
    help="A node or device of the cluster file to add to the plan's (repeatable).",
)
@click.option(
    "--members",
    metavar="NODE,NODE...",
    help="Plan for exactly these nodes of the cluster file, all their devices (instead of "
    "--without/--with).",
)
@click.option(
    "--capture",
    "capture_path",
    type=click.Path(path_type=Path),
    help="Capture file of the plan's model (`hplan capture`, or capture.json of `hplan solve "
    "--elastic`): plan from it instead of tracing the model again.",
)
@click.option(
    "--out",
    "-o",
    "out_dir",
    type=click.Path(path_type=Path),
    help="Directory for the new plan (default: <plan's folder>-replan next to it).",
)
@time_limit_option
@micro_batch_sizes_option
@precision_option
@sync_option
@max_local_steps_option
@wire_option
@max_overlap_steps_option
@recompute_option
@zero_option
@offload_option
@tensor_parallel_option
@profile_option
@bandwidth_option
@click.option(
    "--model",
    "model_override",
    type=click.Path(path_type=Path),
    help="model.py to use instead of the plan's.",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def replan(
    plan_path: Path,
    cluster_path: Path,
    without: tuple[str, ...],
    joining: tuple[str, ...],
    members: str | None,
    capture_path: Path | None,
    out_dir: Path | None,
    time_limit_s: float,
    micro_batch_sizes: str | None,
    precision: PrecisionRequest | None,
    sync: SyncRequest,
    max_local_steps: int,
    wire: WireRequest,
    max_overlap_steps: int | None,
    recompute: Policy,
    zero: Policy,
    offload: Policy,
    tensor_parallel: Policy,
    profile_paths: tuple[Path, ...],
    bandwidth_path: Path | None,
    model_override: Path | None,
    as_json: bool,
) -> None:
    """Solve PLAN again without the lost nodes or devices (or with joining ones, or for
    exactly --members); the job then resumes from its latest checkpoint with --resume."""
    started_s = time.monotonic()
    from hplan.planner.api import SolveRequest, phase_of, plan_training
    from hplan.planner.emit.artifacts import check_out_dir
    from hplan.planner.hardware.cluster import load_cluster
    from hplan.runtime.capture.model_file import plan_model_path

    if members is not None and (without or joining):
        raise ConfigError("--members names every node to plan for; leave out --without and --with")
    if members is None and not without and not joining:
        raise ConfigError(
            "give at least one --without NODE|DEVICE or --with NODE|DEVICE (or --members "
            "NODE,NODE: exactly those nodes)"
        )
    plan = Plan.load(plan_path)
    cluster = load_cluster(cluster_path)
    nodes = None if members is None else _members(members, cluster, cluster_path)
    left_out = (
        ()
        if nodes is not None
        else _left_out(plan, cluster.device_names, cluster_path, without, joining)
    )
    nodes_left = len(nodes) if nodes is not None else _nodes_left(cluster, left_out)
    out_dir = out_dir or plan_path.parent.absolute().with_name(
        f"{plan_path.parent.absolute().name}-replan"
    )
    request = SolveRequest(
        model_path=plan_model_path(plan.model.path, plan_path, model_override),
        cluster_path=cluster_path,
        global_batch_size=plan.global_batch_size,
        micro_batch_sizes=parse_sizes(micro_batch_sizes),
        time_limit_s=time_limit_s,
        schedule=plan.training.schedule,
        seed=plan.training.seed,
        master_port=plan.training.master_port,
        steps=plan.training.steps,
        epochs=plan.training.epochs,
        leaf_modules=_leaf_modules(plan, capture_path),
        out_dir=out_dir,
        profile_paths=profile_paths,
        bandwidth_path=bandwidth_path,
        nodes=nodes,
        without=left_out,
        capture_path=capture_path,
        precision=precision or _plan_precision(plan),
        sync=sync if _given("sync") else _plan_sync(plan, nodes_left),
        max_local_steps=(
            max_local_steps
            if _given("max_local_steps")
            else _plan_local_steps(plan, max_local_steps)
        ),
        wire=wire,
        max_overlap_steps=max_overlap_steps,
        recompute=recompute,
        zero=zero,
        offload=offload,
        tensor_parallel=tensor_parallel,
    )
    request.verify()  # every option checked before the model file is imported
    check_out_dir(out_dir)
    with PhaseProgress(stderr, phase_of) as progress:
        outcome = plan_training(request, progress=progress)
        written = write_files(outcome, out_dir, progress)
    extra = None if nodes is None else {"members": list(nodes)}
    print_plan(outcome, out_dir, written, progress, started_s, as_json=as_json, extra=extra)
    changed = (
        f"members: {', '.join(nodes)}"
        if nodes is not None
        else f"lost: {', '.join(without) or 'none'}; joined: {', '.join(joining) or 'none'}"
    )
    stderr.print(
        f"re-planned for {len(outcome.plan.cluster.devices)} devices ({changed}); continue "
        "training with the new launch scripts and --checkpoint-dir DIR --resume (DIR: the "
        "job's checkpoint folder)"
    )


def _members(members: str, cluster: Cluster, cluster_path: Path) -> tuple[str, ...]:
    """``--members a,b`` as node names in cluster order.

    Raises:
        ConfigError: no name, or a name that is not a node of the cluster file (naming its
            nodes).
    """
    names = [name.strip() for name in members.split(",") if name.strip()]
    known = [n.name for n in cluster.nodes]
    if not names:
        raise ConfigError(
            f"--members {members!r} names no node; give nodes of {str(cluster_path)!r} "
            f"separated by commas (its nodes: {', '.join(known)})"
        )
    for name in names:
        if name not in known:
            raise ConfigError(
                f"--members {name!r} is not a node of {str(cluster_path)!r} (its nodes: "
                f"{', '.join(known)})"
            )
    return tuple(n for n in known if n in names)


def _leaf_modules(plan: Plan, capture_path: Path | None) -> tuple[str, ...]:
    """The ``--leaf-module`` list to solve with: the capture file's own settings where one is
    given (the plan records the modules the trace kept whole, found ones included), else
    the plan's. An unreadable file keeps the plan's (the capture pass names the problem)."""
    if capture_path is None:
        return plan.model.leaf_modules
    try:
        data = json.loads(capture_path.read_text(encoding="utf-8"))
        return tuple(str(name) for name in data["settings"]["leaf_modules"])
    except (OSError, ValueError, KeyError, TypeError):
        return plan.model.leaf_modules


def _plan_precision(plan: Plan) -> PrecisionRequest:
    """The precision the plan's ranks share (kept by a re-plan), else ``auto``."""
    used = {r.precision.value for r in plan.ranks}
    return PrecisionRequest(used.pop()) if len(used) == 1 else PrecisionRequest.AUTO


def _given(parameter: str) -> bool:
    """Whether the command line set ``parameter`` (not its default)."""
    source = click.get_current_context().get_parameter_source(parameter)
    return source is not None and source is not click.core.ParameterSource.DEFAULT


def _plan_sync(plan: Plan, nodes_left: int) -> SyncRequest:
    """The cross-island mode the plan runs (kept by a re-plan where it syncs locally and
    more than one node is left to sync across), else ``auto``."""
    local = {
        SyncRequest.STREAMING.value if g.overlap_steps else g.mode.value
        for g in _local_groups(plan)
    }
    return SyncRequest(local.pop()) if len(local) == 1 and nodes_left > 1 else SyncRequest.AUTO


def _nodes_left(cluster: Cluster, left_out: tuple[str, ...]) -> int:
    """How many nodes hold a device the re-plan may use."""
    return len({d.node for d in cluster.devices if d.name not in left_out})


def _plan_local_steps(plan: Plan, default: int) -> int:
    """The bound on H for a re-plan: the default, raised to the plan's largest H."""
    return max([default, *(g.local_steps for g in _local_groups(plan))])


def _local_groups(plan: Plan) -> list[OuterSyncSpec]:
    sync = plan.training.sync
    if sync is None:
        return []
    return [g for g in sync.groups if g.mode is not SyncMode.ALL_REDUCE]


def _left_out(
    plan: Plan,
    file_devices: tuple[str, ...],
    cluster_path: Path,
    without: tuple[str, ...],
    joining: tuple[str, ...],
) -> tuple[str, ...]:
    """The cluster file's devices the new plan must not use: those the plan did not have
    (unless ``joining``) and those ``without`` names.

    Raises:
        ConfigError: a name in ``without`` that the plan does not use, one in ``joining``
            that the cluster file lacks, or a device of the plan the cluster file lacks.
    """
    plan_devices = [d.name for d in plan.cluster.devices]
    plan_nodes = [n.name for n in plan.cluster.nodes]
    missing = [d for d in plan_devices if d not in file_devices]
    if missing:
        raise ConfigError(
            f"{str(cluster_path)!r} lacks device {missing[0]!r} of the plan; pass the cluster "
            "file the plan was solved with"
        )
    for name in without:
        if name not in plan_devices and name not in plan_nodes:
            raise ConfigError(
                f"--without {name!r}: the plan has no such node or device (nodes: "
                f"{', '.join(plan_nodes)}; devices are named <node>/<index>, e.g. "
                f"{plan_devices[0]!r})"
            )

    def of(name: str) -> list[str]:
        return [d for d in file_devices if d == name or d.rsplit("/", 1)[0] == name]

    added = set()
    for name in joining:
        if not of(name):
            raise ConfigError(
                f"--with {name!r}: {str(cluster_path)!r} has no such node or device; add the "
                "node to the cluster file first"
            )
        added.update(of(name))
    gone = {d for name in without for d in of(name)}
    keep = (set(plan_devices) | added) - gone
    return tuple(d for d in file_devices if d not in keep)
