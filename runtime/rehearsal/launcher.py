"""Local rank processes: started and supervised by ``torch.distributed.elastic``.

A rehearsal runs every rank of a plan on this machine (one thread each); the local link
measurement runs N ranks of ``python -m hplan.runtime.bandwidth``. Both start them with
``torch.distributed.elastic.multiprocessing.start_processes`` (what torchrun itself uses):
each process gets the ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` /
``MASTER_PORT`` that ``env://`` reads (rank 0 hosts the store on 127.0.0.1), its stderr in
``<log>`` and its stdout in ``<log stem>.stdout.log``. :func:`supervise` polls them; on the
first failure or at the timeout every rank is stopped, and one error is raised: the failed
rank's own last error line, preferring a root cause over the peer failures it causes, or
the timeout. A rank that SIGKILL ended (the out-of-memory killer, a memory watchdog) is
reported with its predicted and last measured memory (``contract/memory_use.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from torch.distributed.elastic.multiprocessing import start_processes
from torch.distributed.elastic.multiprocessing.api import (
    LogsDest,
    LogsSpecs,
    SignalException,
    SubprocessContext,
)

from hplan.runtime.contract.errors import (
    ConfigError,
    HplanError,
    MemoryBudgetError,
    PeerFailureError,
    RehearsalChildError,
)
from hplan.runtime.contract.memory_use import (
    budget_problem,
    killed_description,
    last_record,
    oom_cause,
    oom_kill_counts,
)
from hplan.runtime.contract.metrics_file import (
    StepMetrics,
    metrics_path,
    parse_metrics_line,
    step_summary,
)
from hplan.runtime.contract.plan import Plan

_POLL_S = 0.05
PREEMPTION_GRACE_S = 30
"""A terminated supervisor gives its ranks this long (after SIGTERM: finish the step, save a
checkpoint, exit) before SIGKILL; torchrun gives its workers the same 30 s."""
_ELASTIC_LOGGER = "torch.distributed.elastic.multiprocessing.api"
"""torch's process context logs every signal it sends at WARNING; a rehearsal reports
failures in one line of its own."""
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
"""Signals torch's process context takes over when it starts; hplan keeps its own
handlers (a terminated ``hplan rehearse`` stops its ranks in its ``finally`` blocks)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stdout_log(log: Path) -> Path:
    """Where a rank's stdout goes: ``rank-1.log`` -> ``rank-1.stdout.log``."""
    return log.with_suffix(".stdout.log")


@dataclass(frozen=True)
class ChildCommand:
    """The ``python -m hplan.runtime.rehearsal`` command line shared by every rank."""

    plan_path: Path
    model: str
    steps: int
    metrics_dir: Path
    dilation: float
    scale: float
    verify_dir: Path | None
    extra: tuple[str, ...] = ()
    """More options of every rank (checkpointing: ``rehearse.Checkpointing.args``)."""

    def for_rank(self, rank: int, master_port: int) -> list[str]:
        """The arguments (after the Python interpreter) of one rank."""
        command = [
            "-m", "hplan.runtime.rehearsal", str(self.plan_path),
            "--rank", str(rank), "--model", self.model, "--steps", str(self.steps),
            "--metrics-dir", str(self.metrics_dir),
            "--dilation", repr(self.dilation), "--time-scale", repr(self.scale),
            "--master-port", str(master_port),
        ]  # fmt: skip
        if self.verify_dir is not None:
            command += ["--verify-dir", str(self.verify_dir)]
        return [*command, *self.extra]


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
    plan: Plan,
    command: ChildCommand,
    timeout_s: float,
    console: Console,
    *,
    enforce_memory: bool = False,
) -> None:
    """Start every rank of a rehearsal of ``plan`` (a free port, one thread each) and
    supervise them.

    A rank killed by SIGKILL is reported with its figures and whether the kernel's
    out-of-memory killer counted it (``memory_use.killed_description``). With
    ``enforce_memory``, each step a rank reports is checked against its device's budget
    (``memory_use.budget_problem``), and the first over it stops the rehearsal; the ranks
    then give freed memory back to the system at once (:func:`released_heap_env`), so that
    what is checked is what the plan holds.

    Raises:
        RehearsalChildError: a rank failed. MemoryBudgetError: a rank exceeded its budget.
        PeerFailureError: the timeout.
    """
    world_size = plan.world_size
    master_port = free_port()
    logs = [command.metrics_dir / f"rank-{r}.log" for r in range(world_size)]
    check = _budget_check(plan) if enforce_memory else None
    progress = _Progress(command.metrics_dir, world_size, console, check)
    oom_before = oom_kill_counts()

    def killed(rank: int) -> str:
        path = metrics_path(command.metrics_dir, rank)
        last = last_record(progress.records[rank]) if rank < world_size else None
        cause = oom_cause(oom_before, oom_kill_counts())
        return killed_description(plan, rank, cause, last, path)

    supervise(
        "hplan-rehearsal",
        [command.for_rank(rank, master_port) for rank in range(world_size)],
        logs,
        timeout_s,
        master_port=master_port,
        extra_env=released_heap_env() if enforce_memory else None,
        on_poll=progress.poll,
        is_error_line=lambda line: line.startswith("hplan run"),
        failure=lambda rank, code, line: RehearsalChildError(
            f"rank {rank} failed (exit {code}): {line} (full log: {logs[rank]})", code
        ),
        describe_kill=killed,
        timeout=lambda running: PeerFailureError(
            f"rehearsal timed out after {timeout_s:.0f} s with ranks {running} still "
            f"running (killed); see their logs in {logs[0].parent} and raise --timeout "
            "if the model is just slow"
        ),
    )


SUPERVISOR_ENV = "HPLAN_SUPERVISOR_PID"
"""Set in every local rank to the process id of the process that started it."""
_PR_SET_PDEATHSIG = 1
"""``prctl`` option (Linux ``<sys/prctl.h>``): a signal for the process when its parent ends."""


def follow_supervisor() -> None:
    """In a local rank: end with the process that started it.

    torch's process context starts every rank in its own session, so neither a closed
    terminal (SIGHUP to the session) nor the supervisor's own death (SIGKILL) would reach
    the rank; on Linux the kernel sends it SIGKILL when its parent ends
    (``prctl(PR_SET_PDEATHSIG)``). A rank whose supervisor already ended exits at once.
    Nothing happens outside a local rank (no ``HPLAN_SUPERVISOR_PID``) or off Linux.
    """
    supervisor = os.environ.get(SUPERVISOR_ENV, "").strip()
    if not supervisor.isdigit() or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != int(supervisor):
        os._exit(1)


MMAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"
RELEASED_HEAP_MMAP_THRESHOLD_BYTES = 65536
"""glibc's mmap threshold under ``--enforce-memory``: allocations from 64 KiB up (every
tensor but the smallest) are mapped on their own and unmapped when freed."""


def released_heap_env() -> dict[str, str]:
    """What makes a rank's resident set follow its live memory (``--enforce-memory``):
    glibc's mmap threshold pinned at :data:`RELEASED_HEAP_MMAP_THRESHOLD_BYTES`, unless the
    user set ``MALLOC_MMAP_THRESHOLD_``.

    By default glibc raises its mmap threshold to the size of the largest block freed (up
    to 32 MiB), so tensors come from the heap, and the heap's freed memory stays resident:
    a plan that fits would fail the budget check on memory no tensor holds
    (``bench/memory_rehearsal.py`` compares both). The cost is a page fault per page of
    each new tensor, a slower compute, which is why plain rehearsals keep glibc's default.
    """
    if MMAP_THRESHOLD_ENV in os.environ:
        return {}
    return {MMAP_THRESHOLD_ENV: str(RELEASED_HEAP_MMAP_THRESHOLD_BYTES)}


def rank_env(rank: int, world_size: int, master_port: int) -> dict[str, str]:
    """What one local rank adds to this process's environment: ``env://``'s variables on
    127.0.0.1 (no torchrun agent store), one thread, unbuffered output, and this process
    as its supervisor (:func:`follow_supervisor`)."""
    return {
        SUPERVISOR_ENV: str(os.getpid()),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }


class _RankLogs(LogsSpecs):
    """Each rank's stderr in its log file, its stdout beside it (``stdout_log``)."""

    def __init__(self, logs: Sequence[Path]) -> None:
        super().__init__(log_dir=str(logs[0].parent))
        self._logs = list(logs)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        ranks = range(len(self._logs))
        return LogsDest(
            stdouts={r: str(stdout_log(self._logs[r])) for r in ranks},
            stderrs={r: str(self._logs[r]) for r in ranks},
            tee_stdouts={},
            tee_stderrs={},
            error_files={r: str(self._logs[r].with_suffix(".error.json")) for r in ranks},
        )

    @property
    def root_log_dir(self) -> str:
        return str(self._logs[0].parent)


def start_ranks(
    name: str,
    args: Sequence[Sequence[str]],
    logs: Sequence[Path],
    *,
    master_port: int,
    extra_env: Mapping[str, str] | None = None,
) -> SubprocessContext:
    """Start ``python ARGS`` once per rank (``rank_env`` and ``extra_env``), keeping
    hplan's signal handlers."""
    saved = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    caught: signal.Signals | None = None
    try:
        context = start_processes(
            name=name,
            entrypoint=sys.executable,
            args={rank: tuple(a) for rank, a in enumerate(args)},
            envs={
                rank: {**rank_env(rank, len(args), master_port), **(extra_env or {})}
                for rank in range(len(args))
            },
            logs_specs=_RankLogs(logs),
        )
        assert isinstance(context, SubprocessContext)  # a binary entry point
        return context
    except SignalException as exc:  # a signal while torch's handlers were in place
        caught = exc.sigval
        raise
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        if caught is not None:  # hplan's own handler decides (exit 128 + N), as at any time
            signal.raise_signal(caught)


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
    if not log.exists():
        return "(no output)"
    lines = [ln for ln in log.read_text(encoding="utf-8", errors="replace").splitlines() if ln]
    tagged = [ln for ln in lines if is_error_line(ln)]
    return (tagged or lines or ["(no output)"])[-1]


def _budget_check(plan: Plan) -> Callable[[StepMetrics], None]:
    """``--enforce-memory``: raise on a step whose training memory exceeds its rank's
    device budget (``memory_use.budget_problem``)."""

    def check(record: StepMetrics) -> None:
        problem = budget_problem(plan, record)
        if problem is not None:
            raise MemoryBudgetError(problem)

    return check


class _Progress:
    """Prints each step once every rank has reported it (reads only new complete lines);
    passes each new record to ``check`` first."""

    def __init__(
        self,
        metrics_dir: Path,
        world_size: int,
        console: Console,
        check: Callable[[StepMetrics], None] | None = None,
    ) -> None:
        self.paths = [metrics_path(metrics_dir, r) for r in range(world_size)]
        self.offsets = [0] * world_size
        self.records: list[list[StepMetrics]] = [[] for _ in range(world_size)]
        self.console = console
        self.printed = 0
        self.check = check

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
            record = parse_metrics_line(line)
            self.records[rank].append(record)
            if self.check is not None:
                self.check(record)


@contextlib.contextmanager
def _quiet_elastic_logs() -> Iterator[None]:
    logger = logging.getLogger(_ELASTIC_LOGGER)
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


def supervise(
    name: str,
    args: Sequence[Sequence[str]],
    logs: Sequence[Path],
    timeout_s: float,
    *,
    master_port: int,
    on_poll: Callable[[], None],
    is_error_line: Callable[[str], bool],
    failure: Callable[[int, int, str], HplanError],
    timeout: Callable[[list[int]], HplanError],
    describe_kill: Callable[[int], str] | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> None:
    """Run one process per rank until all end; on the first failure or at the timeout,
    stop them all and raise.

    On the first failure torch's process context stops the others; at the timeout this
    does, with SIGKILL (a terminated supervisor first sends SIGTERM and gives the ranks
    ``PREEMPTION_GRACE_S`` to checkpoint).

    Args:
        args: per rank, the arguments after the Python interpreter.
        on_poll: called between polls (a rehearsal prints each step once every rank has
            reported it).
        logs: per rank, the file its stderr goes to.
        extra_env: variables every rank gets besides ``rank_env``'s.
        describe_kill: what to say of a rank that SIGKILL ended (default: ``killed by
            SIGKILL`` and its last line).

    Raises:
        ``failure(rank, exit code, its last error line)``: for the rank to report: a failed
            rank whose error is not a peer failure (a consequence of another's), else any
            rank whose log holds such an error, else the first failed rank.
        ``timeout(ranks still running)``: at the timeout.
    """
    deadline_s = time.monotonic() + timeout_s
    with _quiet_elastic_logs():
        context = start_ranks(name, args, logs, master_port=master_port, extra_env=extra_env)
        try:
            first_failed: list[int] = []  # those that ended badly by themselves, first seen
            while True:
                if not first_failed:
                    first_failed = _failed_ranks(context)
                result = context.wait(timeout=0)  # on a failure, stops the others
                on_poll()
                if result is not None and result.is_failed():
                    failed = first_failed or sorted(result.failures)
                    codes = {r: h.proc.poll() for r, h in context.subprocess_handlers.items()}
                    raise _reported(failed, codes, logs, is_error_line, failure, describe_kill)
                if result is not None:
                    return
                if time.monotonic() > deadline_s:
                    running = [
                        r for r, h in context.subprocess_handlers.items() if h.proc.poll() is None
                    ]
                    raise timeout(running)
                time.sleep(_POLL_S)
        except SystemExit:  # hplan's SIGTERM / SIGHUP handler: let the ranks checkpoint
            context.close(death_sig=signal.SIGTERM, timeout=PREEMPTION_GRACE_S)
            raise
        finally:
            context.close(death_sig=signal.SIGKILL)


def _failed_ranks(context: SubprocessContext) -> list[int]:
    """The ranks whose process has ended with an error or a signal, by itself."""
    codes = {r: h.proc.poll() for r, h in context.subprocess_handlers.items()}
    return sorted(r for r, code in codes.items() if code not in (None, 0))


def _reported(
    failed: Sequence[int],
    codes: dict[int, int | None],
    logs: Sequence[Path],
    is_error_line: Callable[[str], bool],
    failure: Callable[[int, int, str], HplanError],
    describe_kill: Callable[[int], str] | None = None,
) -> HplanError:
    """The error for the rank whose failure explains the others (see :func:`supervise`).

    Among the failed ranks: one whose last line is not a peer failure (a consequence of
    another's), and that ended by itself before one that was stopped (by a signal); else a
    stopped rank whose log ends in an hplan error that is not a peer failure; else the
    first failed rank. A rank stopped by a signal reports exit code 1.

    Args:
        failed: the ranks that had failed when the failure was seen (torch's process
            context adds the ranks it stopped).
        codes: every rank's exit code once all were stopped.
    """
    lines = {rank: last_error_line(log, is_error_line) for rank, log in enumerate(logs)}

    def blame(rank: int) -> tuple[bool, bool, int]:
        code = codes.get(rank)
        return ("PeerFailureError" in lines[rank], code is None or code < 0, rank)

    ranked = sorted(failed, key=blame)
    others = [
        r
        for r in range(len(logs))
        if r not in failed and is_error_line(lines[r]) and "PeerFailureError" not in lines[r]
    ]
    rank = ranked[0] if ranked and not blame(ranked[0])[0] else (others or ranked)[0]
    code = codes.get(rank)
    line = lines[rank]
    if code == -signal.SIGKILL and describe_kill is not None and not is_error_line(line):
        line = describe_kill(rank)
    elif code is not None and code < 0 and not is_error_line(line):
        line = f"killed by {_signal_name(-code)} (its last line: {line})"
    return failure(rank, code if code is not None and code > 0 else 1, line)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
