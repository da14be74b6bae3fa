"""The start of an elastic segment: who is there, which plan, which rank.

torchrun's elastic agent (c10d rendezvous; the launch scripts of ``hplan solve --elastic``)
starts every node's processes after each rendezvous round, numbered in its own order. With
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` each round has a fresh store, hosted by torchrun's
rank 0, so that no key of an earlier round leaks into this one. Every process posts its node
there and reads everyone's: the membership. torchrun's rank 0 finds the plan for exactly those
nodes (one a re-plan chose during the run, the family's, one solved earlier in the run, or a
new one solved now by the planner's own command in a child process: the runtime never imports
the planner) and posts its path; every process takes its rank from that plan, by node and
local rank, not from torchrun's order. A process the plan leaves without a rank waits for the
end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hplan.runtime.contract.elastic import (
    PlanFamily,
    RunEvent,
    RunEventKind,
    SharedRunDir,
    members_key,
    replan_command,
)
from hplan.runtime.contract.errors import ConfigError, HplanError, PeerFailureError, error_reason
from hplan.runtime.contract.plan import Plan

__all__ = ["ElasticEnd", "SegmentStart", "TorchrunEnv", "start_segment"]

STORE_TIMEOUT_S = 900.0
"""How long a process waits in the round's store (a re-solve runs while the others wait)."""
SOLVE_TIMEOUT_S = 600.0
"""The longest a re-solve for a new membership may take."""
END_POLL_S = 0.5
EXIT_WAIT_S = 60.0
"""How long the store's host waits for the other processes to leave before it does."""
_PREFIX = "hplan/elastic/"


class ElasticEnd(HplanError):
    """The run ends here for a reason a restart cannot fix (refused on every node).

    The processes exit 0 so that torchrun's agent does not restart them; the launch script's
    torchrun wrapper then exits with ``code`` and ``line`` from the run's ``ended`` event.
    """

    def __init__(self, line: str, code: int) -> None:
        super().__init__(line)
        self.code = code


@dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun's elastic agent told this process (its environment)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    restart_count: int

    @classmethod
    def read(cls) -> TorchrunEnv:
        """This process's torchrun environment.

        Raises:
            ConfigError: not started by torchrun (``--elastic`` runs under the launch
                scripts of ``hplan solve --elastic``).
        """
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        missing = [name for name in names if not os.environ.get(name, "").strip()]
        if missing:
            raise ConfigError(
                f"--elastic runs under torchrun's elastic agent, but {missing[0]} is not set; "
                "start the node with its launch script from `hplan solve ... --elastic`"
            )
        return cls(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            local_rank=int(os.environ["LOCAL_RANK"]),
            master_addr=os.environ["MASTER_ADDR"],
            master_port=int(os.environ["MASTER_PORT"]),
            restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        )


@dataclass(frozen=True)
class SegmentStart:
    """What a process of an elastic run knows once the round's plan is chosen."""

    env: TorchrunEnv
    store: dist.Store
    family: PlanFamily
    family_dir: Path
    shared: SharedRunDir
    node: str
    members: tuple[str, ...]
    """The nodes of this round, sorted."""
    plan_path: Path
    plan: Plan
    rank: int | None
    """This process's plan rank (None: the plan gives it nothing to do)."""
    segment: int
    source: str
    """Where the plan came from, for a person: ``family``, ``re-plan``, ``solved now``..."""
    started_unix_s: float

    @property
    def leader(self) -> bool:
        """torchrun's rank 0: hosts the round's store, chooses the plan."""
        return self.env.rank == 0

    def finish(self) -> None:
        """Leave the round (:func:`_leave_together`)."""
        _leave_together(self.store, self.env)

    def announce_end(self) -> None:
        """Tell the processes without a rank that training is over (plan rank 0)."""
        self.store.set(_PREFIX + "end", "1")

    def wait_for_end(self) -> None:
        """A process without a rank: wait until training is over.

        Raises:
            PeerFailureError: the round's store went away (its host failed: torchrun's agent
                restarts the round).
        """
        while True:
            try:
                if self.store.check([_PREFIX + "end"]):
                    return
            except (RuntimeError, ValueError) as exc:
                raise PeerFailureError(
                    f"node {self.node}: the round's store at {self.env.master_addr}:"
                    f"{self.env.master_port} went away ({error_reason(exc)}); torchrun "
                    "restarts the round"
                ) from None
            time.sleep(END_POLL_S)


def start_segment(plan_path: Path, node: str, checkpoint_dir: Path) -> SegmentStart:
    """Join the round's store, learn the membership and choose this process's plan and rank.

    Args:
        plan_path: the family's ``plan.json`` (its folder holds ``family.json``).
        node: this node's name (``HPLAN_NODE``).
        checkpoint_dir: the run's shared folder.

    Raises:
        ConfigError: not under torchrun, no family, or this node is not in it.
        ElasticEnd: the members cannot train (no plan fits them): the run ends on every node.
    """
    started_unix_s = time.time()
    family_dir = plan_path.parent
    family = PlanFamily.load(family_dir)
    if node not in family.nodes:
        raise ConfigError(
            f"node {node!r} is not in the plan family (nodes: {', '.join(family.nodes)}); "
            "start each node with its own launch script"
        )
    env = TorchrunEnv.read()
    store = dist.TCPStore(
        env.master_addr, env.master_port, is_master=env.rank == 0,
        timeout=timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False,
    )  # fmt: skip
    shared = SharedRunDir(checkpoint_dir)
    members = _exchange_members(store, env, node)
    if env.rank == 0:
        choice = _choose(family, family_dir, shared, members)
        store.set(_PREFIX + "plan", json.dumps(choice))
    else:
        choice = json.loads(store.get(_PREFIX + "plan").decode())
    if "refused" in choice:
        _leave_together(store, env)  # the store's host must not end before all have read
        raise ElasticEnd(choice["refused"], int(choice["code"]))
    chosen = Path(choice["path"])
    plan = Plan.load(chosen)
    rank = next(
        (r.rank for r in plan.ranks if r.node == node and r.local_rank == env.local_rank), None
    )
    return SegmentStart(
        env, store, family, family_dir, shared, node, members, chosen, plan, rank,
        int(choice["segment"]), choice["source"], started_unix_s,
    )  # fmt: skip


def _leave_together(store: dist.Store, env: TorchrunEnv) -> None:
    """Count this process out of the round; the store's host (torchrun's rank 0) waits until
    every other process has (at most :data:`EXIT_WAIT_S`), since the store ends with it."""
    try:
        store.add(_PREFIX + "exited", 1)
        if env.rank != 0:
            return
        deadline_s = time.monotonic() + EXIT_WAIT_S
        while time.monotonic() < deadline_s:
            if int(store.add(_PREFIX + "exited", 0)) >= env.world_size:
                return
            time.sleep(END_POLL_S)
    except (RuntimeError, ValueError):
        return  # the store is gone: nothing left to wait for


def _exchange_members(store: dist.Store, env: TorchrunEnv, node: str) -> tuple[str, ...]:
    """Post this process's node; read every process's (each waits for all)."""
    store.set(f"{_PREFIX}node/{env.rank}", node)
    keys = [f"{_PREFIX}node/{r}" for r in range(env.world_size)]
    store.wait(keys)
    return tuple(sorted({store.get(key).decode() for key in keys}))


def _choose(
    family: PlanFamily, family_dir: Path, shared: SharedRunDir, members: tuple[str, ...]
) -> dict[str, Any]:
    """torchrun's rank 0: the plan for ``members`` (or why none), and the segment number."""
    state = shared.read_state()
    segment = 0 if state is None else state.segment + 1
    key = members_key(members)
    replanned = shared.current_plans().get(key)
    if replanned is not None and Path(replanned).is_file():
        return {"path": replanned, "segment": segment, "source": "re-planned during the run"}
    ahead = family.plan_path(family_dir, members)
    if ahead is not None and ahead.is_file():
        return {"path": str(ahead), "segment": segment, "source": "solved ahead"}
    reason, code = family.infeasible.get(key), 3
    if reason is None:
        solved, reason, code = _solve(family, family_dir, shared, members)
        if solved is not None:
            return {"path": str(solved), "segment": segment, "source": "solved now"}
    line = f"nodes {', '.join(members)} cannot train this model: {reason}"
    event = RunEvent(kind=RunEventKind.ENDED, unix_s=time.time(), detail=line, exit_code=code)
    shared.append_event(event)
    return {"refused": line, "code": code}


def _solve(
    family: PlanFamily, family_dir: Path, shared: SharedRunDir, members: tuple[str, ...]
) -> tuple[Path | None, str, int]:
    """Solve the family's model for ``members`` with the planner's command (a child
    process); the plan's path, or None, the planner's one-line reason and its exit code
    (3: the members cannot hold the model)."""
    out_dir = shared.plans_dir / members_key(members)
    plan_file = out_dir / "plan.json"
    if plan_file.is_file():
        return plan_file, "", 0
    command = replan_command(family_dir, family, list(members), out_dir)
    print(
        f"hplan: elastic: no plan for nodes {', '.join(members)} in the family; solving one "
        f"({' '.join(command[2:4])} ...)",
        file=sys.stderr,
        flush=True,
    )
    started_s = time.monotonic()
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=SOLVE_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return None, f"the re-solve took longer than {SOLVE_TIMEOUT_S:g} s", 1
    if done.returncode != 0 or not plan_file.is_file():
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"the re-solve exited {done.returncode}"
        return None, reason, done.returncode or 1
    print(
        f"hplan: elastic: solved a plan for nodes {', '.join(members)} in "
        f"{time.monotonic() - started_s:.1f} s ({plan_file})",
        file=sys.stderr,
        flush=True,
    )
    return plan_file, "", 0
