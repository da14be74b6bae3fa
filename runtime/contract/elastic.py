"""Elastic runs: the plan family a solve ships, and the run's shared folder.

``hplan solve --elastic`` writes, beside ``plan.json``, a plan for each likely membership of
the cluster (every node; every node but one) and ``family.json`` (:class:`PlanFamily`), the
index the ranks read at each (re)start under torchrun's elastic agent to run the plan made
for the nodes that are there. A membership the family lacks is solved then, from the capture
file, by one process running the planner's own command (:func:`replan_command`): the runtime
never imports the planner.

Everything a run keeps across restarts lives in one folder every node reads and writes, the
checkpoint folder (:class:`SharedRunDir`): checkpoints, the run's state (``run.json``: who
trains, under which plan, how far), its events (lost, joined, slowed, refused), plans solved
during the run, and the join requests of nodes that wait to be taken in. This module needs
no torch.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from importlib import metadata
from pathlib import Path

from pydantic import TypeAdapter

from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.versioned_file import parse_versioned, record

__all__ = [
    "FAMILY_FILE",
    "FAMILY_VERSION",
    "JoinRequest",
    "PlanFamily",
    "RunEvent",
    "RunEventKind",
    "RunState",
    "SegmentRecord",
    "SharedRunDir",
    "calibrate_command",
    "hplan_version",
    "members_key",
    "read_segments",
    "replan_command",
    "segment_dir",
    "write_segment",
]

FAMILY_FILE = "family.json"
"""The family's index, beside ``plan.json``."""
FAMILY_VERSION = 1
MEMBERS_SEPARATOR = "+"
ELASTIC_DIR = "elastic"
"""The run's elastic state, inside the checkpoint folder."""


def hplan_version() -> str:
    """The installed hplan's version (``0+unknown`` when run from a source tree only)."""
    try:
        return metadata.version("hplan")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def members_key(nodes: Iterable[str]) -> str:
    """A membership's name: its node names sorted and joined by ``+`` (``a+b+c``)."""
    return MEMBERS_SEPARATOR.join(sorted(set(nodes)))


@record
class PlanFamily:
    """``family.json``: the plans solved ahead for the memberships a run may see.

    Paths are relative to the folder of ``family.json`` (the plan's output folder).
    """

    schema_version: int
    hplan_version: str
    """The version that wrote the family: a node running another version is refused."""
    nodes: tuple[str, ...]
    """Every node of the cluster file, in its order."""
    processes_per_node: dict[str, int]
    """Processes each node's launch script starts (one per device of the node)."""
    min_nodes: int
    """The fewest nodes the run goes on with (torchrun's ``--nnodes MIN:MAX``)."""
    rendezvous_host: str
    """Where torchrun's c10d rendezvous store runs (the first node's host): the run's one
    single point of failure."""
    rendezvous_port: int
    run_id: str
    """torchrun's ``--rdzv-id``: the family's digest, so that two runs never meet."""
    cluster_file: str
    """A copy of the cluster file the family was solved with."""
    capture_file: str | None
    """The model's capture file (re-solves start from it, in seconds); None: from the model."""
    model_digest: str
    """The model file's digest (``Plan.model.digest``): a joining node with another model
    file is refused."""
    plans: dict[str, str]
    """{members key: plan path}: the plan for exactly those nodes."""
    infeasible: dict[str, str] = field(default_factory=dict)
    """{members key: why}: memberships solved ahead and found unable to train."""
    replan_options: tuple[str, ...] = ()
    """The solve's own options for a re-solve during the run (``--time-limit 60 --zero
    auto ...``), so that a membership solved then is planned as the family was."""
    replan_files: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """{option: paths relative to the family's folder}: the solve's input files a re-solve
    needs too (``--profile``, ``--bandwidth``), copied beside ``family.json``."""

    @classmethod
    def load(cls, path: Path) -> PlanFamily:
        """Read ``family.json`` (a file, or the folder that holds it).

        Raises:
            ConfigError: the file is missing or not a family this version reads.
        """
        path = path / FAMILY_FILE if path.is_dir() else path
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(
                f"cannot read the plan family {str(path)!r} ({exc.strerror}); solve with "
                "`hplan solve ... --elastic` to write it"
            ) from None
        return parse_versioned(
            text,
            TypeAdapter(cls),
            what="plan family",
            source=str(path),
            version=FAMILY_VERSION,
            fix="solve again with `hplan solve ... --elastic`",
        )

    def save(self, path: Path) -> None:
        """Write the family as ``path`` (a file)."""
        _write_json_atomic(path, _plain(self))

    def digest(self) -> str:
        """What two nodes must agree on to train together (version, model, nodes, plans)."""
        import hashlib

        text = json.dumps(
            [self.hplan_version, self.model_digest, self.nodes, sorted(self.plans.items())]
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def plan_path(self, folder: Path, members: Iterable[str]) -> Path | None:
        """The plan solved ahead for exactly ``members`` (None: not in the family)."""
        relative = self.plans.get(members_key(members))
        return None if relative is None else folder / relative


def replan_command(
    folder: Path,
    family: PlanFamily,
    members: Sequence[str],
    out_dir: Path,
    *,
    profile: Path | None = None,
) -> list[str]:
    """The planner's command that solves the family's model for exactly ``members``.

    ``python -m hplan.planner replan <folder>/plan.json --cluster <copy> --members a,b
    [--capture <file>] [--profile P] -o OUT --json``: the same model, global batch, schedule,
    seed and training length as the family's full plan, on the members' devices only.
    The runtime runs it as a child process (it never imports the planner).

    Args:
        folder: the folder of ``family.json``.
        profile: a calibrated profile (``hplan calibrate``) to solve with measured speeds.
    """
    command = [
        sys.executable, "-m", "hplan.planner", "replan", str(folder / "plan.json"),
        "--cluster", str(folder / family.cluster_file),
        "--members", ",".join(members),
        "-o", str(out_dir), "--json", *family.replan_options,
    ]  # fmt: skip
    if family.capture_file is not None:
        command += ["--capture", str(folder / family.capture_file)]
    files = dict(family.replan_files)
    if profile is not None:  # the calibrated profile replaces the solve's
        files["--profile"] = ()
        command += ["--profile", str(profile)]
    for option, paths in files.items():
        for path in paths:
            command += [option, str(folder / path)]
    return command


def calibrate_command(
    plan_path: Path, runs_dir: Path, out_dir: Path, *, profile: Path | None = None
) -> list[str]:
    """The planner's command that writes ``out_dir/calibrated.json``: ``plan_path``'s
    profile corrected by the runs in ``runs_dir`` (their ``rank-<r>.jsonl``), each device's
    measured speed included (``python -m hplan.planner calibrate PLAN RUNS -o OUT
    [--profile P]``).

    Args:
        profile: the profile ``plan_path`` was solved with (an earlier calibration): the
            factors of devices these runs did not measure are kept.
    """
    command = [
        sys.executable, "-m", "hplan.planner", "calibrate", str(plan_path), str(runs_dir),
        "-o", str(out_dir),
    ]  # fmt: skip
    return command if profile is None else [*command, "--profile", str(profile)]


class RunEventKind(StrEnum):
    """What happened to a run (``events.jsonl``)."""

    STARTED = "started"
    """A segment started: its plan, its nodes."""
    LOST = "lost"
    """A node stopped answering (seen by a survivor)."""
    JOIN_WAITING = "join_waiting"
    """A node asked to be taken in."""
    ADMITTED = "admitted"
    """The run let a waiting node in (it restarts with it at once)."""
    SLOWED = "slowed"
    """A rank's measured speed stayed off its plan: the run re-planned."""
    REFUSED = "refused"
    """A node was turned away (another model file, version or family)."""
    ENDED = "ended"
    """The run ended: done, or a stop that restarting cannot fix (the line says why)."""


@dataclass(frozen=True, slots=True)
class RunEvent:
    """One line of ``events.jsonl``."""

    kind: RunEventKind
    unix_s: float
    node: str | None = None
    step: int | None = None
    """Steps done when it happened (where known)."""
    detail: str = ""
    """One line for a person."""
    exit_code: int | None = None
    """For ``ended``: the code every launch script exits with (0: trained every step)."""


@dataclass(frozen=True, slots=True)
class RunState:
    """``run.json``: the segment training now, rewritten by its rank 0 after every step."""

    segment: int
    """0, 1, ...: one per (re)start that trained."""
    members: tuple[str, ...]
    plan_path: str
    plan_digest: str
    family_digest: str
    steps_done: int
    """Optimizer steps done in the whole run (the step counter, not this segment's)."""
    first_step: int
    """The step this segment resumed at."""
    started_unix_s: float
    updated_unix_s: float
    predicted_samples_per_s: float | None = None


@dataclass(frozen=True, slots=True)
class JoinRequest:
    """``joins/<node>.json``: a node waiting to be taken in, refreshed while it waits."""

    node: str
    family_digest: str
    since_unix_s: float
    """When it started waiting (its probation counts from here)."""
    beat_unix_s: float
    """Its last refresh: a request not refreshed for a few seconds is stale (the node left)."""


@dataclass(frozen=True, slots=True)
class SegmentRecord:
    """``<metrics-dir>/segment-<NNN>/segment.json``: one (re)start of an elastic run that
    trained, written by its rank 0 before its first step (its ranks' ``rank-<r>.jsonl`` and
    a copy of its ``plan.json`` lie beside it)."""

    segment: int
    members: tuple[str, ...]
    """The nodes that trained in it, sorted."""
    plan_path: str
    """The plan it ran (as the ranks found it: the family's, or one solved during the run)."""
    plan_digest: str
    world_size: int
    first_step: int
    """The step it resumed at (0: the run's start)."""
    started_unix_s: float
    """When its ranks started (before the build and the checkpoint load)."""
    predicted_samples_per_s: float | None
    cause: str
    """Why it started, one line: ``start``, ``node c lost``, ``node c joined``, ``re-planned
    for measured speeds (b 0.52x)``, ``resumed``."""
    downtime_s: float | None = None
    """From the previous segment's last step (or the loss, where seen) to this segment's
    first step; None for the first."""
    steps_redone: int | None = None
    """Steps the previous segment had done past the checkpoint this one resumed from."""


SEGMENT_FILE = "segment.json"


def segment_dir(metrics_dir: Path, segment: int) -> Path:
    """``<metrics-dir>/segment-<NNN>``: one segment's metrics."""
    return metrics_dir / f"segment-{segment:03d}"


def write_segment(metrics_dir: Path, record: SegmentRecord) -> Path:
    """Write ``record`` as its segment folder's ``segment.json``; return the folder."""
    folder = segment_dir(metrics_dir, record.segment)
    _write_json_atomic(folder / SEGMENT_FILE, asdict(record))
    return folder


def read_segments(metrics_dir: Path) -> list[tuple[Path, SegmentRecord]]:
    """Every segment of an elastic run's metrics folder, in order (none: not elastic)."""
    found = []
    for path in sorted(metrics_dir.glob(f"segment-*/{SEGMENT_FILE}")):
        data = _read_json(path)
        if not isinstance(data, dict):
            continue
        data["members"] = tuple(data.get("members", ()))
        try:
            found.append((path.parent, SegmentRecord(**data)))
        except TypeError:
            continue
    return found


class SharedRunDir:
    """The run's folder every node reads and writes: ``<checkpoint-dir>/elastic/``.

    Writes are atomic (write, then rename) so a reader on another node never sees half a file.
    """

    def __init__(self, checkpoint_dir: Path) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.root = checkpoint_dir / ELASTIC_DIR

    @property
    def run_file(self) -> Path:
        return self.root / "run.json"

    @property
    def events_file(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def plans_dir(self) -> Path:
        """Plans solved during the run (``<members key>[-<n>]/plan.json``)."""
        return self.root / "plans"

    @property
    def current_file(self) -> Path:
        """{members key: plan path}: a plan solved during the run that replaces the family's
        for those members (a re-plan with measured speeds)."""
        return self.root / "current.json"

    def join_file(self, node: str) -> Path:
        return self.root / "joins" / f"{node}.json"

    def admit_file(self, node: str) -> Path:
        return self.root / "admit" / node

    def read_state(self) -> RunState | None:
        """The segment's state (None: no segment has trained yet, or unreadable)."""
        data = _read_json(self.run_file)
        if not isinstance(data, dict):
            return None
        data["members"] = tuple(data.get("members", ()))
        try:
            return RunState(**data)
        except TypeError:
            return None

    def write_state(self, state: RunState) -> None:
        _write_json_atomic(self.run_file, asdict(state))

    def append_event(self, event: RunEvent) -> None:
        """Append one event as a JSON line (one ``write`` of one line: whole on every
        common file system, NFS included, for lines this short)."""
        self.root.mkdir(parents=True, exist_ok=True)
        line = json.dumps({k: v for k, v in asdict(event).items() if v not in (None, "")})
        with self.events_file.open("a", encoding="utf-8") as out:
            out.write(line + "\n")

    def events(self) -> list[RunEvent]:
        """Every event so far, oldest first (unreadable lines skipped)."""
        try:
            lines = self.events_file.read_text(encoding="utf-8").splitlines()
        except OSError:
            return []
        events = []
        for line in lines:
            try:
                data = json.loads(line)
                data["kind"] = RunEventKind(data["kind"])
                events.append(RunEvent(**data))
            except (ValueError, KeyError, TypeError):
                continue
        return events

    def current_plans(self) -> dict[str, str]:
        data = _read_json(self.current_file)
        return data if isinstance(data, dict) else {}

    def set_current_plan(self, members: Iterable[str], plan_path: Path) -> None:
        current = self.current_plans()
        current[members_key(members)] = str(plan_path)
        _write_json_atomic(self.current_file, current)

    def join_requests(self) -> list[JoinRequest]:
        """The nodes waiting to join (stale ones too: the caller judges their age)."""
        requests = []
        for path in sorted((self.root / "joins").glob("*.json")):
            data = _read_json(path)
            try:
                requests.append(JoinRequest(**data))  # type: ignore[arg-type]
            except TypeError:
                continue
        return requests

    def write_join_request(self, request: JoinRequest) -> None:
        _write_json_atomic(self.join_file(request.node), asdict(request))

    def clear_join(self, node: str) -> None:
        for path in (self.join_file(node), self.admit_file(node)):
            path.unlink(missing_ok=True)

    def admit(self, node: str) -> None:
        path = self.admit_file(node)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{time.time()}\n", encoding="utf-8")


def _plain(value: object) -> object:
    """A record as JSON-ready data (tuples as lists)."""
    return json.loads(json.dumps(asdict(value)))  # type: ignore[call-overload]


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write_json_atomic(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
