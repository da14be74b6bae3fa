"""The link matrix rehearsed on one machine: N processes, gloo on 127.0.0.1.

:func:`measure_local` starts ``python -m hplan.runtime.bandwidth --rank r --world-size N``
for every rank (``rehearsal/launcher.py``: one thread each, rank 0 hosting the store on a
free port), copies their progress lines to stderr as they come, and on the first failure or
at the timeout stops every rank and raises one error: the failed rank's own last line. It
returns the file that rank 0 wrote.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from hplan.runtime.contract.errors import ConfigError, PeerFailureError, RehearsalChildError
from hplan.runtime.contract.link_matrix import BandwidthFile
from hplan.runtime.rehearsal.launcher import free_port, new_complete_lines, supervise


def rank_args(
    rank: int,
    world_size: int,
    *,
    master: tuple[str, int],
    out: Path,
    sweep_args: Sequence[str],
    name: tuple[str, int] | None = None,
) -> list[str]:
    """The arguments (after the Python interpreter) of one rank; ``name`` is its (node,
    local index), if known."""
    local_rank = name[1] if name else rank
    command = [
        "-m", "hplan.runtime.bandwidth", "--rank", str(rank),
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
        sweep_args: sweep options passed to every rank (see ``job.sweep_argv``).

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
        args = [
            rank_args(
                rank, num_ranks, master=master, out=out, sweep_args=sweep_args,
                name=names[rank] if names else None,
            )
            for rank in range(num_ranks)
        ]  # fmt: skip
        supervise(
            "hplan-bandwidth",
            args,
            logs,
            timeout_s,
            master_port=master[1],
            on_poll=_Echo(logs).poll,
            is_error_line=lambda line: line.startswith("hplan bandwidth: ") and "Error" in line,
            failure=lambda rank, code, line: RehearsalChildError(
                f"rank {rank} failed (exit {code}): {line}", max(code, 1)
            ),
            timeout=lambda _running: PeerFailureError(
                f"the local link measurement timed out after {timeout_s:g} s; pass smaller "
                "--max-size-bytes or fewer ranks"
            ),
        )
    return BandwidthFile.load(out)


class _Echo:
    """Copies the complete new lines of every rank's log to stderr."""

    def __init__(self, logs: list[Path]) -> None:
        self.logs = logs
        self.offsets = [0] * len(logs)

    def poll(self) -> None:
        for idx, log in enumerate(self.logs):
            complete = new_complete_lines(log, self.offsets[idx])
            self.offsets[idx] += len(complete)
            if complete:
                sys.stderr.write(complete.decode("utf-8", errors="replace"))
                sys.stderr.flush()
