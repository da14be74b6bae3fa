"""How a run notices that it must end: a SIGTERM to this rank, or a peer that stopped.

- :class:`Preemption`: SIGTERM (what Slurm, spot instances and torchrun's shutdown send) sets
  the preempted flag instead of killing the rank; the job then agrees to stop
  (``agreement.StepAgreement``), checkpoints and exits 143.
- :class:`Heartbeat`: a thread that beats a counter in the job's rendezvous store every
  ``interval_s`` and watches every other rank's; a rank whose counter has not moved for
  ``timeout_s`` (frozen: a hung driver, SIGSTOP, a swapped-out box), or a store that stops
  answering, ends this rank within that bound with one line naming the rank and its node.
  A dead rank's sockets close and its peers' collectives fail by themselves at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Any

import torch.distributed as dist

from hplan.runtime.contract.errors import ConfigError, error_reason
from hplan.runtime.contract.plan import Plan

__all__ = ["HEARTBEAT_INTERVAL_S", "Heartbeat", "Preemption"]

HEARTBEAT_INTERVAL_S = 1.0
"""How often a rank beats and looks at the others."""

LINGER_INTERVALS = 5
"""At most this many heartbeat intervals the store's host waits for its peers after a
failure (:meth:`Heartbeat.linger`)."""

_ENDED = -(1 << 40)
"""Added to a rank's counter when it stops beating on purpose (the counter turns negative)."""


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

    def linger(self, grace_s: float | None = None) -> None:
        """After :meth:`stop`, on the rank whose process hosts the job's store: wait until
        every peer has ended its heartbeat or fallen silent for two intervals, at most
        ``grace_s`` (default :data:`LINGER_INTERVALS` intervals), so that a peer still
        naming who failed (:meth:`blame`) reads the store instead of losing it."""
        deadline_s = time.monotonic() + (grace_s or LINGER_INTERVALS * self.interval_s)
        with self._lock:
            seen = dict(self._last)
        while time.monotonic() < deadline_s:
            try:
                counts = [self._store.add(str(p.rank), 0) for p in self._peers]
            except Exception:  # gone already: nothing to wait for
                return
            now_s = time.monotonic()
            waiting = False
            for peer, count in zip(self._peers, counts, strict=True):
                if count < 0:  # ended its heartbeat
                    continue
                last = seen.get(peer.rank)
                if last is None or last[0] != count:
                    seen[peer.rank] = (count, now_s)
                    waiting = True
                elif now_s - last[1] < 2 * self.interval_s:
                    waiting = True
            if not waiting:
                return
            time.sleep(self.interval_s / 10)

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
