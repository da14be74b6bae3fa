"""Write a plan's artifacts: plan.json, its schema, plan.dot, a summary, launch scripts.

The launch scripts are rendered from the jinja2 templates shipped in ``hplan.templates``
(package data). Templates receive plan-derived values only, undefined names fail
(``StrictUndefined``), and every value that reaches a shell line passes through the ``q``
filter (``shlex.quote``); comment lines use ``c`` (quoted, with control characters escaped
so that a newline in a name cannot end the comment). Host and node names are validated when
cluster.yaml is loaded, but the scripts do not rely on it.

Layout of ``out_dir`` after :func:`emit`::

    plan.json  plan.schema.json  plan.dot  summary.txt
    launch/node-<node>.sh ...  launch/slurm.sbatch  launch/rehearse.sh

With an :class:`ElasticLaunch` (``hplan solve --elastic``) every node of the cluster gets an
elastic script (torchrun's elastic agent, c10d rendezvous at the plan family's host), also the
nodes the plan for every node leaves idle.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import jinja2

from hplan.planner.emit.render import render_dot, render_json, render_text
from hplan.planner.textfmt import compact_unit_groups
from hplan.runtime.contract.elastic import PlanFamily
from hplan.runtime.contract.errors import ConfigError, PlanFileError
from hplan.runtime.contract.plan import CPU_KIND, Backend, Plan

LAUNCH_DIR = "launch"
PLAN_FILE = "plan.json"
_PLAN_FROM_LAUNCH_DIR = f"../{PLAN_FILE}"
_UNSAFE_FILE_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_EXECUTE_BITS = 0o111
_NODE_SCRIPT_MARK = b"\n# hplan launch script for node "
"""Second line of every node script (``templates/node.sh.j2``): marks the files emit owns."""


@dataclass(frozen=True, slots=True)
class RankLine:
    """One rank as a launch script's header comment lists it."""

    rank: int
    local_rank: int
    device: str
    kind: str
    replica: int
    stage: int
    units: tuple[str, ...]
    """Compact unit groups (``blocks.0-blocks.3``)."""


@dataclass(frozen=True, slots=True)
class NodeLaunch:
    """What one node's launch script needs, derived from the plan."""

    name: str
    host: str
    node_rank: int
    """Position among the nodes that run ranks (torchrun ``--node-rank``)."""
    script: str
    """File name of the node's script inside ``launch/``."""
    ranks: tuple[RankLine, ...]
    consumer_kinds: tuple[str, ...]
    """Sorted kinds of the GeForce-class cards its ranks use (empty: none)."""

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True, slots=True)
class ElasticLaunch:
    """What an elastic node script runs torchrun's elastic agent with (``--elastic``)."""

    family: PlanFamily
    join_timeout_s: int = 600
    """c10d ``join_timeout``: how long a (re)start waits for ``min_nodes`` nodes
    (``HPLAN_JOIN_TIMEOUT_S`` overrides it when the script runs)."""
    max_restarts: int = 100
    """torchrun ``--max-restarts`` (``HPLAN_MAX_RESTARTS`` overrides it): each node lost,
    re-plan for a slowed node or failed start costs one; nodes joining cost none. 100 carries
    a long run on a pool that changes daily, and still ends a run that fails every start."""
    last_call_timeout_s: int = 3
    """c10d ``last_call_timeout``: once ``min_nodes`` are there, how long a round waits for
    more before it closes."""
    monitor_interval_s: float = 0.5
    """torchrun ``--monitor-interval``: how often the agent looks at its workers."""


@dataclass(frozen=True, slots=True)
class ElasticNode:
    """One node's elastic torchrun arguments (the template's ``elastic``)."""

    nodes: tuple[str, ...]
    min_nodes: int
    nproc: int
    rendezvous_node: str
    rendezvous_endpoint: str
    """``host:port`` of the c10d store."""
    run_id: str
    join_timeout_s: int
    max_restarts: int
    last_call_timeout_s: int
    monitor_interval_s: float


SLURM_PREEMPTION_WARNING_S = 120
"""The Slurm batch file asks for SIGTERM this long before the time limit: time to finish a
step and write a checkpoint (``--signal=TERM@120``)."""


# --------------------------------------------------------------------------- templates
def shell_quote(value: object) -> str:
    """``shlex.quote`` of ``str(value)``: the ``q`` filter for values on shell lines."""
    return shlex.quote(str(value))


def comment_text(value: object) -> str:
    """The ``c`` filter: a value quoted for a comment line, control characters escaped.

    ``"box-a" -> "box-a"``; ``"a b\\nrm -rf /" -> "'a b\\\\nrm -rf /'"`` (one line).
    """
    quoted = shell_quote(value)
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in quoted)


@cache
def template_environment() -> jinja2.Environment:
    """The jinja2 environment over the ``hplan.templates`` package data."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("hplan.templates", "."),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["q"] = shell_quote
    env.filters["c"] = comment_text
    return env


def _render(template: str, **context: object) -> str:
    return template_environment().get_template(template).render(**context)


# --------------------------------------------------------------------------- plan -> context
def node_script_name(node: str) -> str:
    """File name of a node's launch script: ``node-<node>.sh``, unsafe characters as ``_``."""
    return f"node-{_UNSAFE_FILE_CHARS.sub('_', node)}.sh"


def launch_nodes(plan: Plan) -> tuple[NodeLaunch, ...]:
    """The nodes that run ranks, in cluster order, with their torchrun node ranks.

    Raises:
        PlanFileError: two node names map to the same script file name.
    """
    used = [n for n in plan.cluster.nodes if any(r.node == n.name for r in plan.ranks)]
    launches = tuple(_node_launch(plan, node_rank, n.name) for node_rank, n in enumerate(used))
    _check_script_names(launches)
    return launches


def _node_launch(plan: Plan, node_rank: int, name: str) -> NodeLaunch:
    ranks = sorted((r for r in plan.ranks if r.node == name), key=lambda r: r.local_rank)
    devices = [plan.device(r.device) for r in ranks]
    lines = tuple(
        RankLine(
            rank=r.rank,
            local_rank=r.local_rank,
            device=r.device,
            kind=r.device_kind,
            replica=r.replica,
            stage=r.stage,
            units=tuple(compact_unit_groups(r.units)),
        )
        for r in ranks
    )
    return NodeLaunch(
        name=name,
        host=plan.node(name).host,
        node_rank=node_rank,
        script=node_script_name(name),
        ranks=lines,
        consumer_kinds=tuple(sorted({d.kind for d in devices if d.consumer_card})),
    )


def elastic_nodes(plan: Plan) -> tuple[NodeLaunch, ...]:
    """Every node of the plan's cluster, in cluster order, with its ranks under the plan
    (none for a node it leaves idle); ``node_rank`` is the position in the cluster.

    Raises:
        PlanFileError: two node names map to the same script file name.
    """
    launches = tuple(
        _node_launch(plan, index, n.name) for index, n in enumerate(plan.cluster.nodes)
    )
    _check_script_names(launches)
    return launches


def _check_script_names(launches: tuple[NodeLaunch, ...]) -> None:
    scripts = [n.script for n in launches]
    if len(set(scripts)) != len(scripts):
        names = ", ".join(repr(n.name) for n in launches)
        raise PlanFileError(
            f"node names {names} give clashing launch-script names; give the nodes in "
            "cluster.yaml names made of letters, digits, '.', '_' and '-'"
        )


def _elastic_node(launch: ElasticLaunch, node: str) -> ElasticNode:
    family = launch.family
    return ElasticNode(
        nodes=family.nodes,
        min_nodes=family.min_nodes,
        nproc=family.processes_per_node[node],
        rendezvous_node=family.nodes[0],
        rendezvous_endpoint=f"{_bracketed(family.rendezvous_host)}:{family.rendezvous_port}",
        run_id=family.run_id,
        join_timeout_s=launch.join_timeout_s,
        max_restarts=launch.max_restarts,
        last_call_timeout_s=launch.last_call_timeout_s,
        monitor_interval_s=launch.monitor_interval_s,
    )


def _bracketed(host: str) -> str:
    """An IPv6 address in brackets (``[fd00::1]``), as torchrun's ``host:port`` needs."""
    return f"[{host}]" if ":" in host else host


def _gpus_per_node(plan: Plan, nodes: tuple[NodeLaunch, ...]) -> int:
    """Most ranks on one node for GPU plans; 0 when every rank runs on a CPU."""
    if all(r.device_kind == CPU_KIND for r in plan.ranks):
        return 0
    return max(n.num_ranks for n in nodes)


# --------------------------------------------------------------------------- scripts
def render_node_script(plan: Plan, node: NodeLaunch, elastic: ElasticLaunch | None = None) -> str:
    """``launch/node-<node>.sh``: one ``torchrun`` for the node's ranks (see the template);
    with ``elastic``, torchrun's elastic agent for the node's devices (``--nnodes MIN:MAX``,
    c10d rendezvous) running the plan for whoever is there.

    On nodes whose ranks use GeForce cards under NCCL it exports
    ``NCCL_P2P_DISABLE="${NCCL_P2P_DISABLE:-1}"`` (PCIe peer-to-peer between GeForce cards is
    unreliable; the user can override it). Data-centre-only nodes get no such line.
    """
    return _render(
        "node.sh.j2",
        elastic=None if elastic is None else _elastic_node(elastic, node.name),
        node=node.name,
        host=node.host,
        node_rank=node.node_rank,
        num_nodes=len(launch_nodes(plan)),
        world_size=plan.world_size,
        ranks=node.ranks,
        consumer_kinds=node.consumer_kinds if plan.training.backend == Backend.NCCL else (),
        backend=str(plan.training.backend),
        master_host=plan.training.master_host,
        master_port=plan.training.master_port,
        plan_path=_PLAN_FROM_LAUNCH_DIR,
        model_path=plan.model.path,
        steps=plan.training.steps,
        epochs=plan.training.epochs,
        interface=plan.node(node.name).interface,
    )


def render_slurm_script(plan: Plan) -> str:
    """``launch/slurm.sbatch``: one Slurm task per plan node, each running its node script."""
    nodes = launch_nodes(plan)
    return _render(
        "slurm.sbatch.j2",
        nodes=nodes,
        num_nodes=len(nodes),
        gpus_per_node=_gpus_per_node(plan, nodes),
        master_host=plan.training.master_host,
        preemption_warning_s=SLURM_PREEMPTION_WARNING_S,
    )


def render_rehearse_script(plan: Plan) -> str:
    """``launch/rehearse.sh``: ``hplan rehearse <plan.json> "$@"`` on this machine."""
    return _render("rehearse.sh.j2", world_size=plan.world_size, plan_path=_PLAN_FROM_LAUNCH_DIR)


def render_launch_scripts(plan: Plan, elastic: ElasticLaunch | None = None) -> dict[str, str]:
    """Every launch script by path relative to the output directory, in a stable order
    (with ``elastic``, a node script for every node of the cluster)."""
    nodes = launch_nodes(plan) if elastic is None else elastic_nodes(plan)
    scripts = {
        f"{LAUNCH_DIR}/{node.script}": render_node_script(plan, node, elastic) for node in nodes
    }
    scripts[f"{LAUNCH_DIR}/slurm.sbatch"] = render_slurm_script(plan)
    scripts[f"{LAUNCH_DIR}/rehearse.sh"] = render_rehearse_script(plan)
    return scripts


# --------------------------------------------------------------------------- artifacts
def schema_text() -> str:
    """The published JSON Schema of plan.json (``schema/plan.schema.json``), as text."""
    return json.dumps(Plan.json_schema(), indent=2, sort_keys=True) + "\n"


def render_artifacts(plan: Plan, elastic: ElasticLaunch | None = None) -> dict[str, str]:
    """Every file :func:`emit` writes, by relative path, in the order it writes them."""
    artifacts = {
        PLAN_FILE: render_json(plan),
        "plan.schema.json": schema_text(),
        "plan.dot": render_dot(plan),
        "summary.txt": render_text(plan),
    }
    artifacts.update(render_launch_scripts(plan, elastic))
    return artifacts


def check_out_dir(out_dir: Path) -> None:
    """Check, before planning, that ``out_dir`` is or can become a writable folder.

    Raises:
        ConfigError: ``out_dir`` or a folder above it is a file, or the nearest existing
            folder cannot be written.
    """
    existing = out_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == out_dir else f"is inside {str(existing)!r}, a file"
        raise ConfigError(
            f"output folder {str(out_dir)!r} {what}; pass -o a folder (new or existing)"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"output folder {str(out_dir)!r} cannot be written ({str(existing)!r} is not "
            "writable); pass -o a folder you can write to"
        )


def emit(plan: Plan, out_dir: Path, elastic: ElasticLaunch | None = None) -> list[Path]:
    """Write the plan's artifacts under ``out_dir`` and return their paths in a stable order.

    Files: ``plan.json``, ``plan.schema.json``, ``plan.dot``, ``summary.txt`` and the launch
    scripts under ``launch/`` (executable; with ``elastic``, elastic node scripts for every
    node of the cluster). Existing files of the same names are replaced,
    and node scripts that an earlier plan wrote for nodes this plan does not use are
    removed; other files are left alone. Everything is rendered before anything is written.

    Raises:
        PlanFileError: the plan cannot be rendered (clashing node script names, a boundary
            tensor of unknown dtype).
        ConfigError: ``out_dir`` cannot be written (the message names the file and why).
    """
    return _write_all(render_artifacts(plan, elastic), out_dir)


def emit_plan_only(plan: Plan, out_dir: Path) -> list[Path]:
    """Write ``plan.json`` and ``summary.txt`` under ``out_dir`` (a plan of an elastic
    family, run by the elastic scripts of the full plan's folder); their paths.

    Raises:
        ConfigError: ``out_dir`` cannot be written (the message names the file and why).
    """
    return _write_all({PLAN_FILE: render_json(plan), "summary.txt": render_text(plan)}, out_dir)


def _write_all(artifacts: dict[str, str], out_dir: Path) -> list[Path]:
    written = []
    try:
        _remove_stale_node_scripts(out_dir, set(artifacts))
        for relpath, text in artifacts.items():
            path = out_dir / relpath
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(text.encode("utf-8"))
            if relpath.startswith(f"{LAUNCH_DIR}/"):
                path.chmod(path.stat().st_mode | _EXECUTE_BITS)
            written.append(path)
    except OSError as exc:
        where = exc.filename or out_dir
        raise ConfigError(
            f"cannot write the plan to {str(out_dir)!r}: {str(where)!r}: "
            f"{exc.strerror or type(exc).__name__}; pass -o a folder you can write to"
        ) from None
    return written


def _remove_stale_node_scripts(out_dir: Path, keep: set[str]) -> None:
    """Delete ``launch/node-*.sh`` files that hplan wrote and this plan does not (re)write."""
    launch = out_dir / LAUNCH_DIR
    if not launch.is_dir():
        return
    for path in sorted(launch.glob("node-*.sh")):
        if f"{LAUNCH_DIR}/{path.name}" in keep or not path.is_file():
            continue
        with path.open("rb") as file:
            head = file.read(len(_NODE_SCRIPT_MARK) + 64)
        if _NODE_SCRIPT_MARK in head:
            path.unlink()
