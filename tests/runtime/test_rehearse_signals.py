"""A terminated `hplan rehearse` stops every rank process it started (no orphans)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.plans import NUMBERED_DATASET, ReplicaShape, make_plan, write_model

HPLAN = Path(sys.executable).with_name("hplan")
TIMEOUT_S = 60.0

# Ranks hang in build_model; the parent (which has no --rank) builds normally.
HANGING_RANKS = NUMBERED_DATASET.replace(
    "    def build_model():\n",
    "    def build_model():\n"
    "        import sys, time\n"
    "        if '--rank' in sys.argv:\n"
    "            time.sleep(3600)\n",
)


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _rehearse_with_hanging_ranks(tmp_path: Path) -> tuple[subprocess.Popen[bytes], list[int]]:
    """``hplan rehearse`` (in its own session) of a plan whose ranks hang; its rank pids."""
    path = write_model(tmp_path, HANGING_RANKS)
    plan = make_plan(path, [ReplicaShape((1, 1), micro_batch_size=2, num_samples=4)])
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.to_json())
    parent = subprocess.Popen(
        [str(HPLAN), "rehearse", str(plan_path), "--metrics-dir", str(tmp_path / "m")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    ranks: list[int] = []
    deadline_s = time.monotonic() + TIMEOUT_S
    while len(ranks) < plan.world_size:
        if time.monotonic() > deadline_s or parent.poll() is not None:
            parent.kill()
            raise AssertionError(f"the ranks never started: {parent.communicate()[1]!r}")
        time.sleep(0.2)
        ranks = _children(parent.pid)
    return parent, ranks


def _signal_and_wait(
    parent: subprocess.Popen[bytes], ranks: list[int], sig: signal.Signals
) -> tuple[bytes, list[int]]:
    """Send ``sig`` to the rehearsal only; its stderr and the ranks alive 10 s after it ended."""
    try:
        parent.send_signal(sig)
        _, err = parent.communicate(timeout=TIMEOUT_S)
        deadline_s = time.monotonic() + 10
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline_s:
            time.sleep(0.1)
        return err, [pid for pid in ranks if _alive(pid)]
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in ranks:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_sigterm_to_rehearse_kills_every_rank(tmp_path: Path) -> None:
    parent, ranks = _rehearse_with_hanging_ranks(tmp_path)
    err, survivors = _signal_and_wait(parent, ranks, signal.SIGTERM)
    assert survivors == [], "rank processes outlived a terminated rehearse"
    assert parent.returncode == 128 + signal.SIGTERM
    assert b"Traceback" not in err


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL])
def test_a_hangup_or_a_killed_rehearse_ends_every_rank(tmp_path: Path, sig: signal.Signals) -> None:
    # A closed terminal sends SIGHUP; SIGKILL leaves no clean-up at all: the ranks, each in
    # a session of its own, must end with the rehearsal anyway.
    parent, ranks = _rehearse_with_hanging_ranks(tmp_path)
    _, survivors = _signal_and_wait(parent, ranks, sig)
    assert survivors == [], f"rank processes outlived a rehearse ended by {sig.name}"
    if sig is signal.SIGHUP:
        assert parent.returncode == 128 + signal.SIGHUP
