"""What tracing says about itself: failures, the notes a plan carries, error messages.

Notes are one readable line each. Modules kept whole for the same failure (repeated
blocks failing at the same line) share one note.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hplan.runtime.contract.plan import TraceMethod


@dataclass(frozen=True)
class Failure:
    """Where and why symbolic tracing failed."""

    module_path: str
    location: str
    message: str

    def describe(self, where: str | None = None) -> str:
        """``in module 'blocks.0' at model.py:9 `if x.sum() > 0:` (control flow ...)``."""
        if where is None:
            where = f"in module {self.module_path!r}" if self.module_path else "in the forward"
        at = "" if self.location == UNKNOWN_LINE else f" at {self.location}"
        return f"{where}{at} ({_readable(self.message)})"


UNKNOWN_LINE = "an unknown line"
_FX_CONTROL_FLOW = "symbolically traced variables cannot be used as inputs to control flow"


def _readable(message: str) -> str:
    """fx's control-flow error in plain words; other messages as they are."""
    if _FX_CONTROL_FLOW in message:
        return "its control flow depends on tensor values"
    return message


def kept_whole_notes(kept: Sequence[tuple[str, Failure]]) -> list[str]:
    """One note per distinct failure, naming every module kept whole because of it.

    Repeated blocks usually fail at the same line: six notes that differ only in the block
    index become one (``in modules 'blocks.0' … 'blocks.5' (6)``).
    """
    groups: dict[tuple[str, str], list[str]] = {}
    for path, failure in kept:
        groups.setdefault((failure.location, failure.message), []).append(path)
    notes = []
    for (location, message), paths in groups.items():
        failure = Failure(paths[0], location, message)
        if len(paths) == 1:
            notes.append(f"symbolic trace failed {failure.describe()}; kept {paths[0]!r} whole")
            continue
        named = (
            ", ".join(repr(p) for p in paths)
            if len(paths) <= 3
            else (f"{paths[0]!r} … {paths[-1]!r} ({len(paths)})")
        )
        notes.append(
            f"symbolic trace failed {failure.describe(f'in modules {named}')}; kept each whole"
        )
    return notes


def given_message(method: TraceMethod, detail: str) -> str:
    return (
        f"re-tracing with {method.value} failed: {detail}; the model differs from the one "
        "planned: re-run `hplan solve`"
    )


def failure_message(model_name: str, failure: Failure, export_error: str) -> str:
    """The TraceError message when every tracing method failed."""
    if failure.module_path:
        module = f"module {failure.module_path!r}"
        remedy = (
            f"keep it whole with LEAF_MODULES = [{failure.module_path!r}] in model.py, or "
            "make the branch depend on a constant"
        )
    else:
        module = f"module '' (the top-level forward of {model_name})"
        remedy = (
            "move that code into a submodule and list it in LEAF_MODULES in model.py, or make "
            "the branch depend on a constant"
        )
    return (
        f"cannot trace {model_name}: {module} fails at {failure.location} "
        f"({failure.message}); torch.export: {export_error}; module boundaries: the chain "
        f"of child modules differs from forward; {remedy}"
    )
