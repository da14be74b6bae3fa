"""What the ranks of a job agree on, and how a rank notices peers that stopped answering.

- :func:`check_same_job`: once every rank has built its stage, the ranks gather each
  other's :class:`JobIdentity` (the plan digest, ``Plan.digest``: what to run, the report
  excluded; the model file's sha256; the run settings; and whether the build failed); a
  rank that could not build, or whose plan, model or settings differ (a stale ``plan.json``
  on one node, another ``--steps``) is named, with its node, in one line on every rank,
  before any tensor moves. With the same plan on both ends, the sender's check of every
  boundary tensor against the plan (``comm.check_boundary_tensors``) is a check against
  what the receiver expects, so no payload needs a header.
- :class:`StepControl`: between optimizer steps the ranks agree on flags (stop: preempted,
  or a non-finite loss the model file wants to stop on; save a checkpoint now), on the
  newest checkpoint that every rank has written, and learn each replica's loss (what rank
  0's progress shows), with a MAX all-reduce of one small tensor. It is posted after a
  step and read after the next exchange, so no rank ever waits for it (every rank sees the
  same values at the same step, one exchange late). The ranks exchange about every
  ``CONTROL_PERIOD_S``, not every step: rank 0 proposes the number of steps between
  exchanges from its measured step time (:func:`control_interval_steps`) in the exchange
  itself, and every rank takes it when it reads that agreement, at the same step. One such
  all-reduce cost each of three CPU ranks 0.8-1.1 ms of CPU (2.2-2.6 ms wall) on this
  project's 2-core machine, nearly what the MLP example's 2.2 MB gradient all-reduce cost
  (1.5-2.0 ms), and torch DDP has no such collective.
- :class:`Preemption`: SIGTERM (what Slurm, spot instances and torchrun's shutdown send) sets
  the preempted flag instead of killing the rank; the job then checkpoints and exits 143.
- :class:`Heartbeat`: a thread that beats a counter in the job's rendezvous store every
  ``interval_s`` and watches every other rank's; a rank whose counter has not moved for
  ``timeout_s`` (frozen: a hung driver, SIGSTOP, a swapped-out box), or a store that stops
  answering, ends this rank within that bound with one line naming the rank and its node.
  A dead rank's sockets close and its peers' collectives fail by themselves at once.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from enum import IntFlag
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from hplan.runtime.contract.errors import ConfigError, PeerFailureError, error_reason
from hplan.runtime.contract.plan import Plan

__all__ = [
    "CONTROL_PERIOD_S",
    "HEARTBEAT_INTERVAL_S",
    "Agreement",
    "Heartbeat",
    "JobIdentity",
    "Preemption",
    "StepControl",
    "StepFlags",
    "check_same_job",
    "control_interval_steps",
]

HEARTBEAT_INTERVAL_S = 1.0
"""How often a rank beats and looks at the others."""
CONTROL_PERIOD_S = 0.5
"""About how often, in seconds of training, the ranks exchange their step flags
(:func:`control_interval_steps`): a SIGTERM or a non-finite loss is acted on about that
much later at most, one step after the exchange that carries it."""


def control_interval_steps(step_time_s: float) -> int:
    """Steps between two exchanges of :class:`StepControl`: as many whole steps of
    ``step_time_s`` (rank 0's measured step) as fit in ``CONTROL_PERIOD_S``, at least one
    (one for a time that is not positive and finite)."""
    if not (math.isfinite(step_time_s) and step_time_s > 0):
        return 1
    return max(1, int(CONTROL_PERIOD_S / step_time_s))


_ENDED = -(1 << 40)
"""Added to a rank's counter when it stops beating on purpose (the counter turns negative)."""


class StepFlags(IntFlag):
    """What a rank asks the job to do after a step (the job does what any rank asks)."""

    NONE = 0
    PREEMPTED = 1
    """Received SIGTERM: checkpoint and exit 143."""
    NONFINITE_LOSS = 2
    """A loss was not finite and the model file asked to stop on it."""
    CHECKPOINT_DUE = 4
    """Time for a periodic checkpoint (rank 0's clock decides)."""


# --------------------------------------------------------------------------- same job
@dataclass(frozen=True)
class JobIdentity:
    """What one rank runs, as compared by :func:`check_same_job`."""

    plan_digest: str
    """``Plan.digest()`` of its plan.json."""
    plan_sections: Mapping[str, str]
    """``Plan.section_digests()``: which parts differ, when the digests do."""
    model_sha256: str | None
    """sha256 of its model file (None: the file could not be read)."""
    settings: Mapping[str, Any]
    """The run options every rank must share (``RunOptions.settings``), picklable values."""
    failure: str | None = None
    """Why this rank cannot run (its build failed: another model, a missing file ...), in
    one line; None when it built."""


def check_same_job(plan: Plan, rank: int, mine: JobIdentity) -> None:
    """Check that every rank built its stage and runs this plan, the same model file and
    the same settings (a collective over the whole job, before any tensor moves).

    Raises:
        ConfigError: on every rank, naming the ranks and nodes that could not build their
            stage (with their reason), or whose plan, model file or settings differ from
            rank 0's.
        PeerFailureError: a peer failed during the exchange.
    """
    gathered: list[Any] = [None] * plan.world_size
    try:
        dist.all_gather_object(gathered, (rank, plan.ranks[rank].node, mine))
    except RuntimeError as exc:
        raise PeerFailureError(
            f"rank {rank}: a peer failed while the ranks compared their plans: "
            f"{error_reason(exc)}; check the other ranks' logs"
        ) from None
    failed = [(r, node, seen.failure) for r, node, seen in gathered if seen.failure]
    if failed:
        r, node, reason = failed[0]
        more = f" (and {len(failed) - 1} other ranks)" if len(failed) > 1 else ""
        raise ConfigError(f"rank {r} (node {node}) cannot run{more}: {reason}")
    _, node0, reference = gathered[0]
    differing: dict[str, list[str]] = {}
    for r, node, seen in gathered[1:]:
        for what in _differences(reference, seen):
            differing.setdefault(what, []).append(f"rank {r} (node {node})")
    if not differing:
        return
    what, who = next(iter(differing.items()))
    raise ConfigError(
        f"{', '.join(who)} run{'s' if len(who) == 1 else ''} another {what} than rank 0 (node "
        f"{node0}): give every node the same out/ folder from one `hplan solve`, the same "
        "model file and the same options"
    )


def _differences(reference: JobIdentity, seen: JobIdentity) -> list[str]:
    """What ``seen`` runs otherwise than ``reference``, as the user would name it."""
    found = []
    if seen.plan_digest != reference.plan_digest:
        sections = [
            key
            for key in sorted(set(seen.plan_sections) | set(reference.plan_sections))
            if seen.plan_sections.get(key) != reference.plan_sections.get(key)
        ]
        found.append(f"plan.json (its {', '.join(sections) or 'fields'} differ)")
    if seen.model_sha256 != reference.model_sha256:
        found.append("model file")
    keys = sorted(set(seen.settings) | set(reference.settings))
    options = [k for k in keys if seen.settings.get(k) != reference.settings.get(k)]
    if options:
        found.append(", ".join(f"--{k.replace('_', '-')}" for k in options))
    return found


# --------------------------------------------------------------------------- step flags
@dataclass(frozen=True)
class Agreement:
    """What the ranks agreed on after a step."""

    flags: StepFlags
    """What any rank asked for."""
    written_step: int
    """The newest checkpoint step that every rank has written completely (the smallest
    of the ranks' own; -1: none), so that an asynchronous save can be published as soon
    as it is complete everywhere."""
    step: int | None = None
    """The step these values were posted after (None: nothing was posted)."""
    losses: tuple[float | None, ...] = ()
    """Each replica's mean loss of that step, from its last stage (None: not posted); a
    loss that was not finite reads ``inf``."""
    interval_steps: int = 0
    """Steps between exchanges from here on, as rank 0 proposed (0: no proposal)."""
    speeds: tuple[tuple[float, float] | None, ...] = ()
    """Each replica's measured (seconds a sample, fixed seconds) at its current share
    (``rebalance.ShareBalancer.posted``; None: not posted)."""
    speed_epoch: int = -1
    """The share changes the ranks had made when they posted ``speeds``."""


_NOTHING = Agreement(StepFlags.NONE, -1)
_NO_LOSS = -math.inf


class StepControl:
    """The job's agreement on :class:`StepFlags`, written checkpoints and each replica's
    loss, one step late (see the module docstring).

    The losses ride in the same MAX all-reduce, so that rank 0 can show the job's loss
    without a collective of its own: a replica's last stage posts its loss in the
    replica's slot (a non-finite one as ``inf``), every other rank ``-inf``. So do the
    replicas' measured speeds for ``rebalance.ShareBalancer`` (a slot each for seconds a
    sample and fixed seconds, and the ranks' share epoch).
    """

    def __init__(self, device: torch.device, num_replicas: int = 1) -> None:
        self._device = device
        self._num_replicas = num_replicas
        self._pending: tuple[dist.Work, torch.Tensor, int] | None = None

    def exchange(
        self,
        flags: StepFlags,
        written_step: int = -1,
        *,
        step: int = -1,
        loss: tuple[int, float] | None = None,
        interval_steps: int = 0,
        speed: tuple[int, float, float] | None = None,
        speed_epoch: int = -1,
    ) -> Agreement:
        """Post this rank's ``flags``, newest completely written checkpoint step,
        ``loss`` (its replica, its replica's mean loss; last stages only) of ``step`` and
        proposed ``interval_steps`` (rank 0; 0 elsewhere) and ``speed`` (its replica, seconds
        a sample, fixed seconds; under share epoch ``speed_epoch``) for the next call;
        return what the ranks posted at the previous call, combined (nothing at the first
        call).

        Every rank must call it at the same steps, in the same order (:meth:`finish`
        reads the values posted last without posting).

        Raises:
            PeerFailureError: a peer failed.
        """
        agreed = self._collect()
        # one MAX all-reduce: the flags any rank set, (negated) the smallest written step,
        # rank 0's interval and each replica's loss (float64 holds the integers exactly)
        values = [float(int(flags)), float(-written_step), float(interval_steps)]
        values += [_NO_LOSS] * self._num_replicas
        if loss is not None:
            replica, value = loss
            values[3 + replica] = value if math.isfinite(value) else math.inf
        speeds = [_NO_LOSS] * (2 * self._num_replicas)
        if speed is not None:
            replica, per_sample_s, fixed_s = speed
            speeds[replica], speeds[self._num_replicas + replica] = per_sample_s, fixed_s
        values += [float(speed_epoch), *speeds]
        tensor = torch.tensor(values, dtype=torch.float64, device=self._device)
        try:
            work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True)
        except RuntimeError as exc:
            raise _lost(exc) from None
        assert work is not None
        self._pending = (work, tensor, step)
        return agreed

    def finish(self) -> Agreement:
        """Wait for the last posted values and return them (nothing when none are)."""
        return self._collect()

    def _collect(self) -> Agreement:
        if self._pending is None:
            return _NOTHING
        work, tensor, step = self._pending
        self._pending = None
        try:
            work.wait()
        except RuntimeError as exc:
            raise _lost(exc) from None
        flags, negated, interval, *rest = tensor.tolist()
        n = self._num_replicas
        losses, epoch, per_sample, fixed = (
            rest[:n],
            rest[n],
            rest[n + 1 : 2 * n + 1],
            rest[2 * n + 1 :],
        )
        return Agreement(
            StepFlags(int(flags)),
            -int(negated),
            step,
            tuple(None if v == _NO_LOSS else v for v in losses),
            int(interval),
            tuple(
                None if a == _NO_LOSS or b == _NO_LOSS else (a, b)
                for a, b in zip(per_sample, fixed, strict=True)
            ),
            int(epoch),
        )


def _lost(exc: BaseException) -> PeerFailureError:
    return PeerFailureError(
        f"a peer failed between two steps: {error_reason(exc)}; check the other ranks' logs "
        "(one probably failed first)"
    )


# --------------------------------------------------------------------------- preemption
class Preemption:
    """While active, SIGTERM marks this rank preempted instead of ending it."""

    def __init__(self) -> None:
        self.received = False
        self._previous: Any = None

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received:  # a second SIGTERM: stop now
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        self.received = True
        print(
            "hplan: SIGTERM: finishing this step, then a checkpoint and exit (a second "
            "SIGTERM ends the rank at once)",
            file=sys.stderr,
            flush=True,
        )


# --------------------------------------------------------------------------- heartbeat
@dataclass(frozen=True)
class _Peer:
    rank: int
    node: str


class Heartbeat:
    """Beats in the job's store and ends this rank when a peer stops beating (see the
    module docstring).

    Args:
        on_lost: called with the one-line reason before the rank ends (default: print it on
            stderr); then the process exits with code 1 at once (a collective may be blocked
            in the main thread, waiting for the lost peer).
    """

    def __init__(
        self,
        plan: Plan,
        rank: int,
        *,
        host: str,
        port: int,
        timeout_s: float,
        interval_s: float = HEARTBEAT_INTERVAL_S,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        if not timeout_s > interval_s:
            raise ConfigError(
                f"--heartbeat-timeout {timeout_s:g} s must be longer than the heartbeat "
                f"interval ({interval_s:g} s)"
            )
        self.rank = rank
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self._where = f"{host}:{port}"
        self._peers = [_Peer(r.rank, r.node) for r in plan.ranks if r.rank != rank]
        self._on_lost = on_lost or _print_line
        self._stop = threading.Event()
        self._ending = threading.Lock()
        """Held while the watchdog ends the process, or :meth:`stop` stops it."""
        self._lock = threading.Lock()
        self._last: dict[int, tuple[int, float]] = {}
        """{peer rank: (its counter, when this rank last saw it change)}."""
        self._store_node = plan.ranks[0].node
        self._store_lost: str | None = None
        """Why the store is gone, once it is."""
        self._store_lost_s: float | None = None
        """When it went (peers' silence is measured up to then: nothing is seen after)."""
        self._store = dist.PrefixStore(
            f"hplan/heartbeat/{plan.digest()[:16]}/",
            dist.TCPStore(
                host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                wait_for_workers=False,
            ),
        )  # fmt: skip
        self._thread = threading.Thread(target=self._run, name="hplan-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        """Beat once, then keep beating and watching in the background."""
        self._store.add(str(self.rank), 1)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating, and tell the peers this rank ended (they stop watching it: its
        exit is not a freeze; a failure it ended on reaches them through the job's
        sockets). Once this returns the watchdog never ends the process."""
        with self._ending:
            self._stop.set()
        self._thread.join(timeout=self.interval_s * 2)
        with contextlib.suppress(Exception):  # the store may be gone already
            self._store.add(str(self.rank), _ENDED)

    def blame(self) -> str | None:
        """Who ended the job, in one line, once a collective or a transfer failed: a peer
        that has not beaten for two intervals or more (the stalest; a dead rank's sockets
        close at once, so this waits up to three intervals for its silence to show), or the
        job's store when it went away; None when every peer still beats."""
        deadline_s = time.monotonic() + 3 * self.interval_s
        while True:
            found = self._stalest(min_silent_s=2 * self.interval_s)
            if found is not None:
                peer, silent_s = found
                return (
                    f"rank {peer.rank} on node {peer.node} failed or stopped answering (no "
                    f"heartbeat for {silent_s:.0f} s); rank {self.rank} ends too; check node "
                    f"{peer.node}'s log"
                )
            if self._store_lost is not None:
                return self._store_lost
            if time.monotonic() >= deadline_s:
                return None
            time.sleep(self.interval_s / 10)

    def _stalest(self, min_silent_s: float) -> tuple[_Peer, float] | None:
        """The peer silent longest, if it has been silent ``min_silent_s`` or more."""
        now_s = self._store_lost_s or time.monotonic()
        with self._lock:
            silent = [
                (now_s - since_s, peer)
                for peer in self._peers
                if (seen := self._last.get(peer.rank)) is not None and seen[0] >= 0
                for since_s in [seen[1]]
            ]
        if not silent:
            return None
        silent_s, peer = max(silent, key=lambda item: item[0])
        return (peer, silent_s) if silent_s >= min_silent_s else None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._store.add(str(self.rank), 1)
                # add(key, 0) reads a counter without waiting for a peer that never beat
                counts = [self._store.add(str(p.rank), 0) for p in self._peers]
            except Exception as exc:  # the store itself stopped answering
                self._store_lost_s = time.monotonic()
                self._store_lost = (
                    f"the job's store at {self._where} (rank 0's node {self._store_node}) "
                    f"stopped answering ({error_reason(exc)}); rank 0 or its launcher "
                    f"probably ended; rank {self.rank} ends too; check node {self._store_node}"
                )
                self._end(self.blame() or self._store_lost)
                return
            now_s = time.monotonic()
            with self._lock:
                for peer, count in zip(self._peers, counts, strict=True):
                    seen = self._last.get(peer.rank)
                    if seen is None or count != seen[0]:
                        self._last[peer.rank] = (count, now_s)
            found = self._stalest(min_silent_s=self.timeout_s)
            if found is not None:
                peer, silent_s = found
                self._end(
                    f"rank {peer.rank} on node {peer.node} stopped answering (no heartbeat "
                    f"for {silent_s:.0f} s; frozen or cut off); rank {self.rank} ends too; "
                    f"check node {peer.node}"
                )
                return

    def _end(self, reason: str) -> None:
        """Report ``reason`` and end the process, unless :meth:`stop` came first."""
        with self._ending:
            if self._stop.is_set():
                return
            self._on_lost(f"hplan run (rank {self.rank}): PeerFailureError: {reason}")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)


def _print_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
