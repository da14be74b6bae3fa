"""Run the search under a wall-clock limit, in a child process killed at the deadline.

The search reports each candidate as it is found; whatever has arrived when the deadline
passes is kept (case S2: a solver that ignores its own time limit, or hangs, cannot hold
the planner). The child runs in its own session, so killing its process group also kills a
CBC subprocess (no solver process left behind). Native solver banners on fd 1 are sent to
/dev/null so that ``--json`` output on stdout stays clean.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import queue as queue_module
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from hplan.runtime.contract.errors import ConfigError, HplanError

MAX_TIME_LIMIT_S = 86_400.0
"""An infinite or larger limit is treated as one day."""
KILL_GRACE_S = 1.0
"""Head-room between the search's own deadline and the kill."""
_POLL_S = 0.5


def checked_time_limit_s(time_limit_s: float) -> float:
    """The solve's limit in seconds: > 0, not NaN; infinity and huge values mean one day.

    Raises:
        ConfigError: zero, negative or NaN.
    """
    if math.isnan(time_limit_s) or time_limit_s <= 0:
        raise ConfigError(
            f"time limit {time_limit_s} s must be a number > 0 (e.g. --time-limit 60)"
        )
    return min(time_limit_s, MAX_TIME_LIMIT_S)


def run_with_deadline(
    work: Callable[[float, Callable[[object], None]], None],
    time_limit_s: float,
    *,
    use_child: bool,
    meanwhile: Callable[[], None] | None = None,
) -> tuple[list[object], bool]:
    """Call ``work(deadline, report)``; return (reported items, finished in time).

    ``work`` must stop by ``deadline`` (a ``time.monotonic()`` value) on its own; with
    ``use_child`` it runs in a child process that is killed ``KILL_GRACE_S`` after the
    limit if it does not. HplanErrors raised by ``work`` propagate.

    ``meanwhile`` (no arguments; it keeps its own result) runs in this process while the
    child works, so a second core does it at no wall-clock cost; without a child, after
    ``work``. Items the child reported while it ran are still collected when it ends
    after the limit.
    """
    start = time.monotonic()
    limit_s = checked_time_limit_s(time_limit_s)
    deadline = start + max(limit_s - KILL_GRACE_S, limit_s / 2)
    if not use_child or "fork" not in mp.get_all_start_methods():
        items: list[object] = []
        with stdout_to_devnull():
            work(deadline, items.append)
        if meanwhile is not None:
            meanwhile()
        return items, True
    return _in_child(work, deadline, start + limit_s, meanwhile)


def _in_child(
    work: Callable[[float, Callable[[object], None]], None],
    deadline: float,
    kill_at: float,
    meanwhile: Callable[[], None] | None,
) -> tuple[list[object], bool]:
    ctx = mp.get_context("fork")
    results: Any = ctx.Queue()
    child = ctx.Process(target=_child_main, args=(work, deadline, results), daemon=True)
    child.start()
    items: list[object] = []
    finished = False
    try:
        if meanwhile is not None:
            meanwhile()
            # past the limit (meanwhile ran long): still take what the child has sent
            kill_at = max(kill_at, time.monotonic() + _POLL_S)
        while time.monotonic() < kill_at:
            try:
                item = results.get(timeout=min(_POLL_S, max(kill_at - time.monotonic(), 0.01)))
            except queue_module.Empty:
                if not child.is_alive() and results.empty():
                    break
                continue
            if isinstance(item, BaseException):
                raise item
            if item == _DONE:
                finished = True
                break
            items.append(item)
    finally:
        _kill(child)
    return items, finished


_DONE = "__hplan_search_done__"


def _child_main(
    work: Callable[[float, Callable[[object], None]], None], deadline: float, results: Any
) -> None:
    os.setsid()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    _reset_solver_threads()
    try:
        work(deadline, results.put)
        results.put(_DONE)
    except HplanError as exc:
        results.put(exc)
    except Exception as exc:  # an unexpected solver crash must reach the parent, not hang it
        results.put(RuntimeError(f"solver crashed: {type(exc).__name__}: {exc}"))
    results.close()
    results.join_thread()


def _reset_solver_threads() -> None:
    """A forked child inherits HiGHS's thread-pool state but not its threads; where the parent
    solved in-process before forking, the child's first solve would spin forever waiting for
    them without a reset."""
    highspy = sys.modules.get("highspy")
    if highspy is not None and hasattr(highspy.Highs, "resetGlobalScheduler"):
        highspy.Highs.resetGlobalScheduler(True)


def _kill(child: Any) -> None:
    if child.is_alive() and child.pid is not None:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            child.kill()
    child.join(timeout=5)


@contextlib.contextmanager
def stdout_to_devnull() -> Iterator[None]:
    """Silence native solver banners on fd 1 (HiGHS prints one per process)."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)
