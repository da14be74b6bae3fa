"""Typed errors for every user-facing failure in hplan.

The planner and the runtime both raise these; the CLI turns each into one line on stderr
and the exit code carried by the class. The module lives in the runtime package because
the runtime must run on a cluster node without the planner (the planner imports from here,
never the reverse).

Exit codes (see the design card): 0 ok, 2 usage or invalid input, 3 infeasible,
4 environment (missing solver, no driver), 75 an elastic run restarting under a re-plan,
143 preempted, 1 anything else.

Every message names the bad value and says what to do about it.
"""

from __future__ import annotations

import os
import re
import sys
import traceback


class HplanError(Exception):
    """Base of all hplan errors; ``exit_code`` is what the CLI exits with."""

    exit_code: int = 1


class ConfigError(HplanError):
    """A user input file (cluster.yaml, a profile, CLI options) is invalid."""

    exit_code = 2


class ModelFileError(HplanError):
    """``model.py`` cannot be loaded or does not follow the model-file convention."""

    exit_code = 2


class TraceError(HplanError):
    """The model cannot be turned into a graph by any tracing method."""

    exit_code = 2


class TraceTooLongError(TraceError):
    """Tracing unrolls more operations than a plan can be made of in bounded time (a Python
    loop over the sequence); no other tracing method or tensor kind would do better."""


class PlanFileError(HplanError):
    """``plan.json`` is malformed, from another schema version, or fails validation."""

    exit_code = 2


class PlanMismatchError(HplanError):
    """The running model or a received tensor differs from what the plan recorded."""

    exit_code = 2


class InfeasiblePlanError(HplanError):
    """No layout satisfies the constraints; the message names the binding one."""

    exit_code = 3


class SolverUnavailableError(HplanError):
    """No working MILP solver is installed."""

    exit_code = 4


class EnvironmentProblemError(HplanError):
    """The machine lacks something hplan needs (a driver, a free port, a backend)."""

    exit_code = 4


class PeerFailureError(HplanError):
    """A peer rank died or stopped answering within the process-group timeout."""

    exit_code = 1


class PreemptedError(HplanError):
    """The job was asked to stop (SIGTERM) and stopped after a step; exit code 143."""

    exit_code = 143


class ReplannedError(HplanError):
    """An elastic run re-planned for its ranks' measured speeds: every rank stops at a
    checkpoint and exits with this code, so that torchrun's agents restart the round under
    the new plan (a restart counted against ``--max-restarts``)."""

    exit_code = 75


class DivergedError(HplanError):
    """The loss stopped being finite and the model file asked to stop on it."""

    exit_code = 1


class MemoryBudgetError(HplanError):
    """A rank measured more training memory than its device offers the plan
    (``hplan rehearse --enforce-memory``): the plan does not fit as it was planned."""

    exit_code = 3


class RehearsalChildError(HplanError):
    """A rank of the rehearsal failed; carries that rank's one-line error and exit code.

    Unlike the other errors, ``exit_code`` is set per instance: the failed rank's own.
    """

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Terminated(SystemExit):
    """Raised by hplan's own SIGTERM handler (code 128 + signal), so that code catching a
    model file's ``sys.exit`` can tell a termination from the model's own exit."""


_MAX_REASON_CHARS = 200
"""Longest first line of a foreign exception's text that a message quotes."""
_SOURCE_LOCATION = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp|py):\d+\]\s*")
"""A C++ library's own source location in front of its message (gloo's ``[/../pair.cc:553]``)."""


_TORCH_ADVICE = re.compile(r"\s*This is typically caused by .*$")
"""torch's generic advice after a gloo or store error ("... Check the logs of the remote
worker before reporting an error. GLHF!"): hplan says which log to check itself."""


def _first_line(text: str) -> str:
    """The first line, without a source-location prefix or torch's generic advice, cut at
    a word to at most 200 characters (``...`` marks the cut)."""
    line = _SOURCE_LOCATION.sub("", text.strip().splitlines()[0]).strip() if text.strip() else ""
    line = _TORCH_ADVICE.sub("", line)
    if len(line) <= _MAX_REASON_CHARS:
        return line
    cut = line[:_MAX_REASON_CHARS].rsplit(" ", 1)[0].rstrip(" ,;:.")
    return f"{cut}..."


def error_reason(exc: BaseException) -> str:
    """First line of an exception's text, or its class name.

    For messages that quote what a library said: ``"Connection closed by peer"``. A C++
    source location in front is dropped, and a long line is cut at a word (``...``), never
    in the middle of one.
    """
    return _first_line(str(exc)) or type(exc).__name__


def one_line(exc: BaseException) -> str:
    """``"TypeName: first line of the message"`` (cut as in :func:`error_reason`); the
    class name alone when the message is empty. For messages that quote a user's exception."""
    line = _first_line(str(exc))
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def report_internal_error(exc: BaseException, prefix: str) -> int:
    """Print an unexpected exception (a bug) as one line on stderr, naming the file and
    line it came from (of its cause, when it has one: a wrapped failure); the traceback
    first when ``HPLAN_DEBUG`` is set. Returns the exit code, 1.

    ``prefix``: who is speaking, e.g. ``"hplan"`` or ``"hplan run (rank 2)"``.
    """
    if os.environ.get("HPLAN_DEBUG"):
        traceback.print_exception(exc)
    origin = exc.__cause__ if exc.__cause__ is not None else exc
    frame = traceback.extract_tb(origin.__traceback__)[-1] if origin.__traceback__ else None
    at = f" at {os.path.basename(frame.filename)}:{frame.lineno}" if frame else ""
    print(
        f"{prefix}: internal error: {one_line(exc)}{at} (a bug; rerun with HPLAN_DEBUG=1 "
        "for the traceback and report it)",
        file=sys.stderr,
        flush=True,
    )
    return 1
