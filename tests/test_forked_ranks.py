"""The test fixtures' forked ranks (``tests/fixtures/forked_ranks.py``) behave as fresh
``python -m hplan.runtime`` processes: the same output, exit code, environment and
directory; a request the zygote cannot honour starts a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.forked_ranks import FRESH_ENV, ForkedProcess, start_rank


def _both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], env: dict[str, str]
) -> list[tuple[int, str, str]]:
    """Run ``python -m hplan.runtime ARGS`` fresh, then forked: (code, stdout, stderr)."""
    results = []
    for fresh in (True, False):
        out, err = tmp_path / f"{fresh}.out", tmp_path / f"{fresh}.err"
        monkeypatch.setenv(FRESH_ENV, "1" if fresh else "0")
        command = [sys.executable, "-m", "hplan.runtime", *args]
        proc = start_rank(command, env=env, stdout=out, stderr=err)
        assert isinstance(proc, ForkedProcess) != fresh
        code = proc.wait(timeout=120)
        results.append((code, out.read_text(), err.read_text()))
    return results


def test_a_forked_rank_prints_and_exits_as_a_fresh_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "60"}  # help wraps at 60
    monkeypatch.chdir(tmp_path)
    Path("plan.json").write_text("{not json", encoding="utf-8")  # found in this directory
    fresh, forked = _both(tmp_path, monkeypatch, ["run", "plan.json", "--rank", "0"], env)
    assert fresh[0] == 2 and "plan.json" in fresh[2] and "No such file" not in fresh[2]
    assert forked == fresh
    fresh, forked = _both(tmp_path, monkeypatch, ["run", "--help"], env)
    assert fresh[0] == 0 and fresh[1].splitlines()[1].strip() == "[--node NODE]"
    assert forked == fresh


def test_a_forked_rank_reports_a_signal_as_popen_does_and_odd_requests_start_fresh(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sleeper = [sys.executable, "-m", "timeit", "-n1", "-r1", "import time; time.sleep(600)"]
    proc = start_rank(sleeper, env=env, stdout=None, stderr=tmp_path / "err")
    assert isinstance(proc, ForkedProcess)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.1)
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    proc.kill()  # ended: nothing is sent
    other_threads = start_rank(
        sleeper, env={**env, "OMP_NUM_THREADS": "2"}, stdout=None, stderr=tmp_path / "err2"
    )
    assert isinstance(other_threads, subprocess.Popen)
    other_threads.kill()
    assert other_threads.wait(timeout=60) == -signal.SIGKILL
