"""A node's way into an elastic run, before its torchrun agent starts (``check --elastic``).

A node whose launch script starts while the run trains without it (it started late, or came
back after it was lost) does not join torchrun's rendezvous at once: that would restart every
node mid-step, and a node that flaps would restart them again and again. It first proves it is
compatible (the same model file, hplan version and plan family, else it is refused and the run
goes on without it), then posts a join request in the run's shared folder, refreshed every
second, and waits. The run takes it in once it has waited out its probation
(``segment.probation_s``): the run's rank 0 writes ``admit/<node>``, this node starts its agent,
and torchrun's agents restart the round with it (the running ranks save a checkpoint first).
"""

from __future__ import annotations

import hashlib
import socket
import sys
import time
from pathlib import Path

from hplan.runtime.contract.elastic import (
    JoinRequest,
    PlanFamily,
    RunEvent,
    RunEventKind,
    RunState,
    SharedRunDir,
    hplan_version,
)
from hplan.runtime.contract.errors import ConfigError, HplanError

__all__ = [
    "FINISHED_EXIT_CODE",
    "RUNNING_FRESH_S",
    "RunFinished",
    "check_joiner",
    "running_state",
    "wait_to_join",
]

FINISHED_EXIT_CODE = 10
"""``check --elastic``'s code for a run that has trained every step: the launch script then
exits 0 without starting torchrun."""
RUNNING_FRESH_S = 120.0
"""A run whose ``run.json`` was rewritten within this long is training (it is rewritten
after every step): a node arriving then waits to be taken in."""
BEAT_S = 1.0


def check_joiner(family: PlanFamily, family_dir: Path, node: str, model_path: Path) -> None:
    """Refuse a node that cannot train with the family: another model file or hplan version.

    Raises:
        ConfigError: naming what differs and the fix (the run, if any, goes on).
    """
    if node not in family.nodes:
        raise ConfigError(
            f"node {node!r} is not in the plan family of {str(family_dir)!r} (nodes: "
            f"{', '.join(family.nodes)}); start each node with its own launch script"
        )
    if family.hplan_version != hplan_version():
        raise ConfigError(
            f"node {node!r} runs hplan {hplan_version()}, the plan family was made by hplan "
            f"{family.hplan_version}; install the same version on every node"
        )
    try:
        digest = hashlib.sha256(model_path.read_bytes()).hexdigest()
    except OSError as exc:
        raise ConfigError(f"cannot read the model file {str(model_path)!r} ({exc})") from None
    if digest != family.model_digest:
        raise ConfigError(
            f"node {node!r}'s model file {str(model_path)!r} (sha256 {digest[:12]}) is not the "
            f"one the plan family was solved for ({family.model_digest[:12]}); copy the same "
            "model.py to every node"
        )


def running_state(
    shared: SharedRunDir, now_unix_s: float, family: PlanFamily | None = None
) -> RunState | None:
    """The state of the run training in ``shared`` now (None: none is, it ended, or, given
    its ``family``, nothing answers at its rendezvous: its host is gone)."""
    state = shared.read_state()
    if state is None or now_unix_s - state.updated_unix_s > RUNNING_FRESH_S:
        return None
    if ended_run(shared) is not None:
        return None
    if family is not None and not _answers(family.rendezvous_host, family.rendezvous_port):
        return None
    return state


def ended_run(shared: SharedRunDir) -> RunEvent | None:
    """The run's ``ended`` event when the run in ``shared`` has ended since it last trained
    (None: it has not, or never trained)."""
    state = shared.read_state()
    ended = [e for e in shared.events() if e.kind is RunEventKind.ENDED]
    if not ended or (state is not None and ended[-1].unix_s < state.updated_unix_s):
        return None
    return ended[-1]


class RunFinished(HplanError):
    """The run in the checkpoint folder has trained every step: nothing to join (the launch
    script exits 0 without starting torchrun)."""

    exit_code = FINISHED_EXIT_CODE


def check_not_finished(shared: SharedRunDir) -> None:
    """Raises:
    RunFinished: the run in ``shared`` trained every step (one line)."""
    ended = ended_run(shared)
    if ended is not None and ended.exit_code == 0:
        raise RunFinished(
            f"the run in {str(shared.checkpoint_dir)!r} has ended ({ended.detail}); nothing to "
            "join: give another --checkpoint-dir to start a new run"
        )


def _answers(host: str, port: int) -> bool:
    """Whether something accepts a TCP connection at ``host:port`` within a second."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def refuse(shared: SharedRunDir, node: str, line: str) -> None:
    """Record that ``node`` was turned away (the run goes on)."""
    shared.append_event(
        RunEvent(kind=RunEventKind.REFUSED, unix_s=time.time(), node=node, detail=line)
    )


def wait_to_join(family: PlanFamily, shared: SharedRunDir, node: str) -> None:
    """Wait until the run training in ``shared`` takes ``node`` in, or ends, or goes silent.

    Raises:
        ConfigError: the run trains another plan family (recorded; the run goes on).
    """
    check_not_finished(shared)
    state = running_state(shared, time.time(), family)
    if state is None:
        return
    if state.family_digest != family.digest():
        line = (
            f"node {node!r} was solved in another plan family ({family.digest()}) than the run "
            f"training in {str(shared.checkpoint_dir)!r} ({state.family_digest}); the run goes "
            "on without it: use that run's launch scripts, or another --checkpoint-dir"
        )
        refuse(shared, node, line)
        raise ConfigError(line)
    since_s = time.time()
    shared.clear_join(node)
    print(
        f"hplan: elastic: node {node} waits to join the run training on "
        f"{', '.join(state.members)} (step {state.steps_done}); it is taken in once it has "
        "waited out its probation, at the end of a step",
        file=sys.stderr,
        flush=True,
    )
    shared.append_event(RunEvent(kind=RunEventKind.JOIN_WAITING, unix_s=since_s, node=node))
    try:
        while True:
            now_s = time.time()
            shared.write_join_request(JoinRequest(node, family.digest(), since_s, now_s))
            if shared.admit_file(node).exists():
                print(
                    f"hplan: elastic: node {node} taken in after {now_s - since_s:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
                return
            if running_state(shared, now_s, family) is None:
                check_not_finished(shared)
                return  # the run went silent: start the agent, meet whoever is there
            time.sleep(BEAT_S)
    finally:
        shared.clear_join(node)
