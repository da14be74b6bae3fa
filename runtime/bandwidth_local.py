"""The link matrix rehearsed on one machine: N processes, gloo on 127.0.0.1.

:func:`measure_local` starts ``python -m hplan.runtime.bandwidth --rank r --world-size N``
for every rank (one thread each, rank 0 hosting the store on a free port), copies their
progress lines to stderr as they come, and on the first failure or at the timeout stops
every rank and raises one error: the failed rank's own last line. It returns the file that
rank 0 wrote.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from hplan.runtime.bandwidth_file import BandwidthFile
from hplan.runtime.errors import ConfigError, PeerFailureError, RehearsalChildError
from hplan.runtime.local_ranks import free_port

_POLL_S = 0.05
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


def rank_command(
    rank: int,
    world_size: int,
    *,
    master: tuple[str, int],
    out: Path,
    sweep_args: Sequence[str],
    name: tuple[str, int] | None = None,
) -> list[str]:
    """The command line of one rank; ``name`` is its (node, local index), if known."""
    local_rank = name[1] if name else rank
    command = [
        sys.executable, "-m", "hplan.runtime.bandwidth", "--rank", str(rank),
        "--world-size", str(world_size), "--local-rank", str(local_rank),
        "--master-addr", master[0], "--master-port", str(master[1]), "--backend", "gloo",
        "--out", str(out), *sweep_args,
    ]  # fmt: skip
    if name is not None:
        command += ["--node", name[0]]
    return command


def measure_local(
    num_ranks: int,
    *,
    out: Path,
    sweep_args: Sequence[str] = (),
    names: Sequence[tuple[str, int]] | None = None,
    timeout_s: float = 900.0,
) -> BandwidthFile:
    """Measure the links between ``num_ranks`` local processes; rank 0 writes ``out``.

    Args:
        names: (node, local index) of each rank, to name ranks as cluster devices.
        sweep_args: sweep options passed to every rank (see ``bandwidth.sweep_argv``).

    Raises:
        ConfigError: fewer than two ranks, or ``names`` of another length.
        RehearsalChildError: a rank failed (its last line and exit code).
        PeerFailureError: the timeout passed.
    """
    if num_ranks < 2:
        raise ConfigError(f"--local {num_ranks}: a link has two ends; pass --local 2 or more")
    if names is not None and len(names) != num_ranks:
        raise ConfigError(f"{len(names)} device names for {num_ranks} ranks; give one per rank")
    master = ("127.0.0.1", free_port())
    with tempfile.TemporaryDirectory(prefix="hplan-bandwidth-") as tmp:
        logs = [Path(tmp) / f"rank-{r}.log" for r in range(num_ranks)]
        children: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(num_ranks):
                command = rank_command(
                    rank, num_ranks, master=master, out=out, sweep_args=sweep_args,
                    name=names[rank] if names else None,
                )  # fmt: skip
                with logs[rank].open("wb") as log:
                    children.append(
                        subprocess.Popen(
                            command, stdout=log, stderr=subprocess.STDOUT, env=child_env()
                        )
                    )
            _supervise(children, logs, timeout_s)
        finally:
            _stop(children)
    return BandwidthFile.load(out)


def _supervise(
    children: Sequence[subprocess.Popen[bytes]], logs: list[Path], timeout_s: float
) -> None:
    deadline_s = time.monotonic() + timeout_s
    echo = _Echo(logs)
    while True:
        echo.poll()
        codes = [child.poll() for child in children]
        failed = [(rank, code) for rank, code in enumerate(codes) if code is not None and code != 0]
        if failed:
            time.sleep(0.5)  # let a peer whose death caused this one's print its own reason
            echo.poll()
            raise _failure(failed, logs)
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline_s:
            raise PeerFailureError(
                f"the local link measurement timed out after {timeout_s:g} s; pass smaller "
                "--max-size-bytes or fewer ranks"
            )
        time.sleep(_POLL_S)


def _failure(failed: list[tuple[int, int]], logs: list[Path]) -> RehearsalChildError:
    lines = {rank: _last_line(logs[rank]) for rank, _ in failed}
    rank, code = next(((r, c) for r, c in failed if "PeerFailureError" not in lines[r]), failed[0])
    return RehearsalChildError(f"rank {rank} failed (exit {code}): {lines[rank]}", max(code, 1))


def _last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(encoding="utf-8", errors="replace").splitlines() if ln]
    tagged = [ln for ln in lines if ln.startswith("hplan bandwidth: ") and "Error" in ln]
    return (tagged or lines or ["(no output)"])[-1]


class _Echo:
    """Copies the complete new lines of every rank's log to stderr."""

    def __init__(self, logs: list[Path]) -> None:
        self.logs = logs
        self.offsets = [0] * len(logs)

    def poll(self) -> None:
        for idx, log in enumerate(self.logs):
            if not log.exists():
                continue
            with log.open("rb") as file:
                file.seek(self.offsets[idx])
                chunk = file.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self.offsets[idx] += len(complete)
            if complete:
                sys.stderr.write(complete.decode("utf-8", errors="replace"))
                sys.stderr.flush()


def _stop(children: Sequence[subprocess.Popen[bytes]]) -> None:
    for child in children:
        if child.poll() is None:
            child.kill()
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=10)
