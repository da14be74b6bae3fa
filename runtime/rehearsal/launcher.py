"""The rank processes of a rehearsal: start them, follow their progress, reap them.

Each rank runs ``python -m hplan.runtime run PLAN --rank R --emulate ...`` with one thread
(``ChildCommand``), its output in ``<metrics_dir>/rank-<r>.log``. :func:`run_children`
prints each step once every rank has reported it, and on the first failure or at the
timeout kills every rank and raises one error: the failing rank's own last ``hplan run``
line (preferring a root cause over the peer failures it causes), or the timeout.

:func:`start_ranks`, :func:`supervise` and :func:`kill_all` are shared with the local link
measurement (``bandwidth_local.py``), which differs only in its commands, its progress
output and its messages.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from hplan.runtime.contract.errors import (
    ConfigError,
    HplanError,
    PeerFailureError,
    RehearsalChildError,
)
from hplan.runtime.contract.metrics_file import StepMetrics, metrics_path, step_summary
from hplan.runtime.contract.plan import Plan

_POLL_S = 0.05
_SETTLE_S = 2.0
"""How long to wait for a root cause once only consequences of a failure are seen."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class ChildCommand:
    """The ``python -m hplan.runtime run`` command line shared by every rank."""

    plan_path: Path
    model: str
    steps: int
    metrics_dir: Path
    dilation: float
    scale: float
    verify_dir: Path | None

    def for_rank(self, rank: int, master_port: int) -> list[str]:
        """The command of one rank."""
        command = [
            sys.executable, "-m", "hplan.runtime", "run", str(self.plan_path),
            "--rank", str(rank), "--model", self.model, "--steps", str(self.steps),
            "--metrics-dir", str(self.metrics_dir), "--emulate",
            "--dilation", repr(self.dilation), "--time-scale", repr(self.scale),
            "--master-port", str(master_port),
        ]  # fmt: skip
        if self.verify_dir is not None:
            command += ["--verify-dir", str(self.verify_dir)]
        return command


def prepare_dir(metrics_dir: Path, plan: Plan) -> Path:
    """Clear what an earlier run left in ``metrics_dir``; write the plan; return its path.

    Raises:
        ConfigError: ``metrics_dir`` is a file or cannot be created.
    """
    if metrics_dir.exists() and not metrics_dir.is_dir():
        raise ConfigError(f"metrics folder {str(metrics_dir)!r} is a file; give a directory")
    try:
        metrics_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create metrics folder {str(metrics_dir)!r} ({exc.strerror}); "
            "choose a writable directory"
        ) from None
    for pattern in ("rank-*.jsonl", "rank-*.log", "timeline-rank-*.jsonl", "verify/*.pt"):
        for stale in metrics_dir.glob(pattern):
            stale.unlink()
    plan_path = metrics_dir / "plan.json"
    plan_path.write_text(plan.to_json(), encoding="utf-8")
    return plan_path


def run_children(
    world_size: int, command: ChildCommand, timeout_s: float, console: Console
) -> None:
    """Start every rank (a free port, one thread each), supervise, and reap them all."""
    master_port = free_port() - 1  # the ranks join on master_port + 1
    logs = [command.metrics_dir / f"rank-{r}.log" for r in range(world_size)]
    commands = [command.for_rank(rank, master_port) for rank in range(world_size)]
    children: list[subprocess.Popen[bytes]] = []
    try:
        children = start_ranks(commands, logs)
        progress = _Progress(command.metrics_dir, world_size, console)
        supervise(
            children,
            logs,
            timeout_s,
            on_poll=progress.poll,
            is_error_line=lambda line: line.startswith("hplan run"),
            failure=lambda rank, code, line: RehearsalChildError(
                f"rank {rank} failed (exit {code}): {line} (full log: {logs[rank]})", code
            ),
            timeout=lambda running: PeerFailureError(
                f"rehearsal timed out after {timeout_s:.0f} s with ranks {running} still "
                f"running (killed); see their logs in {logs[0].parent} and raise --timeout "
                "if the model is just slow"
            ),
        )
    finally:
        kill_all(children)


_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def child_env() -> dict[str, str]:
    """This environment without torchrun's rank variables or HPLAN_NODE, one thread each."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _TORCHRUN_ENV and k != "HPLAN_NODE" and not k.startswith("TORCHELASTIC_")
    }
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def start_ranks(
    commands: Sequence[Sequence[str]], logs: Sequence[Path]
) -> list[subprocess.Popen[bytes]]:
    """Start one process per command (``child_env``), its output into the matching log."""
    children = []
    for command, log_path in zip(commands, logs, strict=True):
        with log_path.open("wb") as log:
            children.append(
                subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=child_env())
            )
    return children


def new_complete_lines(path: Path, offset: int) -> bytes:
    """The whole lines a growing file gained after byte ``offset`` (b"" if it is absent);
    a partial last line is left for the next read."""
    if not path.exists():
        return b""
    with path.open("rb") as file:
        file.seek(offset)
        chunk = file.read()
    return chunk[: chunk.rfind(b"\n") + 1]


def last_error_line(log: Path, is_error_line: Callable[[str], bool]) -> str:
    """The last line of ``log`` that ``is_error_line`` accepts, else its last line."""
    lines = [ln for ln in log.read_text(encoding="utf-8", errors="replace").splitlines() if ln]
    tagged = [ln for ln in lines if is_error_line(ln)]
    return (tagged or lines or ["(no output)"])[-1]


class _Progress:
    """Prints each step once every rank has reported it (reads only new complete lines)."""

    def __init__(self, metrics_dir: Path, world_size: int, console: Console) -> None:
        self.paths = [metrics_path(metrics_dir, r) for r in range(world_size)]
        self.offsets = [0] * world_size
        self.records: list[list[StepMetrics]] = [[] for _ in range(world_size)]
        self.console = console
        self.printed = 0

    def poll(self) -> None:
        """Print the steps that every rank has reported since the last poll."""
        for rank, path in enumerate(self.paths):
            self._read_new(rank, path)
        ready = min(len(records) for records in self.records)
        for i in range(self.printed, ready):
            summary = step_summary([records[i] for records in self.records])
            loss = "n/a" if summary.loss is None else f"{summary.loss:.4f}"
            self.console.print(
                f"step {summary.step}: loss {loss}, {summary.samples_per_s:.2f} samples/s "
                f"(step {summary.step_time_s:.3f} s)"
            )
        self.printed = max(self.printed, ready)

    def _read_new(self, rank: int, path: Path) -> None:
        complete = new_complete_lines(path, self.offsets[rank])
        self.offsets[rank] += len(complete)
        for line in complete.decode("utf-8").splitlines():
            self.records[rank].append(StepMetrics(**json.loads(line)))


def _settle(
    children: Sequence[subprocess.Popen[bytes]],
    failed: list[tuple[int, int]],
    lines: Callable[[int], str],
) -> list[tuple[int, int]]:
    """If only peer-failure errors are in, give the real culprit a moment to exit too."""
    deadline_s = time.monotonic() + _SETTLE_S
    while time.monotonic() < deadline_s:
        if any("PeerFailureError" not in lines(r) for r, _ in failed):
            break
        time.sleep(_POLL_S)
        codes = [child.poll() for child in children]
        failed = [(r, c) for r, c in enumerate(codes) if c is not None and c != 0]
    return failed


def kill_all(children: Sequence[subprocess.Popen[bytes]]) -> None:
    """Kill the children still running and reap them all."""
    for child in children:
        if child.poll() is None:
            child.kill()
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=10)


def supervise(
    children: Sequence[subprocess.Popen[bytes]],
    logs: Sequence[Path],
    timeout_s: float,
    *,
    on_poll: Callable[[], None],
    is_error_line: Callable[[str], bool],
    failure: Callable[[int, int, str], HplanError],
    timeout: Callable[[list[int]], HplanError],
) -> None:
    """Wait for every child; on the first failure or at the timeout, kill them all and raise.

    Raises:
        ``failure(rank, exit code, its last error line)``: for the failed rank to report,
            preferring one whose error is not a peer failure (a consequence of another's).
        ``timeout(ranks still running)``: at the timeout.
    """
    deadline_s = time.monotonic() + timeout_s

    def line(rank: int) -> str:
        return last_error_line(logs[rank], is_error_line)

    while True:
        codes = [child.poll() for child in children]
        failed = [(rank, code) for rank, code in enumerate(codes) if code is not None and code != 0]
        if failed:
            failed = _settle(children, failed, line)
            kill_all(children)
            on_poll()
            rank, code = next(
                ((r, c) for r, c in failed if "PeerFailureError" not in line(r)), failed[0]
            )
            raise failure(rank, code, line(rank))
        on_poll()
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline_s:
            running = [rank for rank, code in enumerate(codes) if code is None]
            kill_all(children)
            raise timeout(running)
        time.sleep(_POLL_S)
