"""The pass runner: a solve is a list of named pure functions, each checked after it runs.

A :class:`Pass` reads the results of the passes before it by name (a read-only mapping,
the request under ``"request"``) and returns its own; :func:`run_passes` runs them in order,
calls the result's ``verify()`` when it has one, and stores it under the pass's name. A
user error (``HplanError``) keeps its class, message and exit code, with a note naming the
pass (shown with ``HPLAN_DEBUG=1``); anything else is a bug, a :class:`PassError` naming
the pass that failed and the one before it. With ``dump_dir`` every result is written as
``<dump_dir>/<NN>-<pass>.json`` (:func:`debug_json`), a failure as ``.error.txt``.

After xDSL's pass manager and torch.fx's ``passes/infra/pass_manager.py``: small named
passes, valid IR in, valid IR out, and a runner that names the failing pass.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from hplan.runtime.contract.errors import ConfigError, HplanError, one_line

__all__ = ["Pass", "PassError", "PassObserver", "PassResults", "debug_json", "run_passes"]

_MAX_DEPTH = 12
_MAX_LIST = 10_000
"""Longer arrays and sequences are dumped as their length and first items."""


class PassError(RuntimeError):
    """A pass raised something other than a user error, or made an invalid result (a bug)."""

    def __init__(self, message: str, pass_name: str) -> None:
        super().__init__(message)
        self.pass_name = pass_name


class PassResults(Mapping[str, Any]):
    """The results of the passes run so far, by pass name (read-only)."""

    def __init__(self, values: dict[str, Any], tell: Callable[[str], None] | None = None) -> None:
        self._values = values
        self._tell = tell

    def tell(self, says: str) -> None:
        """Replace the running pass's progress line by ``says`` (a pass that runs in steps,
        such as the capture); nothing without an observer."""
        if self._tell is not None:
            self._tell(says)

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


@dataclass(frozen=True)
class Pass:
    """One named step of a solve."""

    name: str
    run: Callable[[PassResults], Any]
    """Reads earlier results by name; returns this pass's result (pure: no global state)."""
    says: Callable[[PassResults], str] | None = None
    """The progress line shown while it runs (None: none)."""


class PassObserver(Protocol):
    """Told when each pass starts and ends (progress display, timings)."""

    def started(self, name: str, says: str | None) -> None:
        """Pass ``name`` starts; ``says``: its progress line (None: it has none)."""
        ...

    def finished(self, name: str, time_s: float) -> None:
        """Pass ``name`` returned a valid result after ``time_s`` seconds of wall time."""
        ...


def run_passes(
    passes: Sequence[Pass],
    request: Any,
    *,
    progress: PassObserver | None = None,
    dump_dir: Path | None = None,
) -> PassResults:
    """Run ``passes`` in order on ``request``; return every result by pass name.

    Also records each pass's wall time (``time.monotonic``, seconds) under
    ``"<name>.time_s"`` and tells ``progress`` when each pass starts and ends.

    Raises:
        HplanError: a pass's user error, unchanged (with a note naming the pass).
        PassError: a pass failed otherwise, or its result's ``verify()`` failed.
        ConfigError: ``dump_dir`` cannot be created.
    """
    values: dict[str, Any] = {"request": request}
    running = ["request"]

    def tell(says: str) -> None:
        if progress is not None:
            progress.started(running[0], says)

    results = PassResults(values, tell)
    if dump_dir is not None:
        _prepare(dump_dir)
        _dump(dump_dir, 0, "request", request)
    previous = "request"
    for index, step in enumerate(passes, start=1):
        running[0] = step.name
        if progress is not None:
            progress.started(step.name, None if step.says is None else step.says(results))
        started_s = time.monotonic()
        try:
            value = step.run(results)
            _verify(value, step.name, previous)
        except HplanError as exc:
            _dump_failure(dump_dir, index, step.name, exc)
            exc.add_note(f"in pass {step.name!r} (after {previous!r})")
            raise
        except PassError as exc:
            _dump_failure(dump_dir, index, step.name, exc)
            raise
        except Exception as exc:
            _dump_failure(dump_dir, index, step.name, exc)
            raise PassError(
                f"pass {step.name!r} (after {previous!r}) raised {one_line(exc)}", step.name
            ) from exc
        values[step.name] = value
        values[f"{step.name}.time_s"] = time.monotonic() - started_s
        if progress is not None:
            progress.finished(step.name, values[f"{step.name}.time_s"])
        if dump_dir is not None:
            _dump(dump_dir, index, step.name, value)
        previous = step.name
    return results


def _verify(value: Any, name: str, previous: str) -> None:
    verify = getattr(value, "verify", None)
    if not callable(verify):
        return
    try:
        verify()
    except (ValueError, AssertionError, HplanError) as exc:
        raise PassError(
            f"pass {name!r} (after {previous!r}) made an invalid {type(value).__name__}: "
            f"{one_line(exc)}",
            name,
        ) from exc


# --------------------------------------------------------------------------- dumping
def _prepare(dump_dir: Path) -> None:
    try:
        dump_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create the pass dump folder {str(dump_dir)!r} ({exc.strerror}); "
            "choose a writable directory"
        ) from None
    for stale in [*dump_dir.glob("[0-9][0-9]-*.json"), *dump_dir.glob("[0-9][0-9]-*.error.txt")]:
        stale.unlink()


def _dump(dump_dir: Path, index: int, name: str, value: Any) -> None:
    text = json.dumps(debug_json(value), indent=1, allow_nan=False, ensure_ascii=False)
    (dump_dir / f"{index:02d}-{name}.json").write_text(text + "\n", encoding="utf-8")


def _dump_failure(dump_dir: Path | None, index: int, name: str, exc: BaseException) -> None:
    if dump_dir is None:
        return
    text = "".join(traceback.format_exception(exc))
    (dump_dir / f"{index:02d}-{name}.error.txt").write_text(text, encoding="utf-8")


def debug_json(value: Any, depth: int = 0) -> Any:
    """A JSON-native view of any pass result, for reading while debugging (lossy).

    Dataclasses become their fields (with ``"__type__"``), networkx graphs their node-link
    data, numpy arrays and sequences lists (long ones cut to their first items and length),
    tensors and modules summaries, enums their values, non-finite floats strings.
    """
    if depth > _MAX_DEPTH:
        return f"<{type(value).__name__}>"
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    special = _special(value, depth)
    if special is not None:
        return special
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {
            f.name: debug_json(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)
        }
        return {"__type__": type(value).__name__, **fields}
    if isinstance(value, Mapping):
        return {str(k): debug_json(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = list(value)
        shown = [debug_json(v, depth + 1) for v in items[:_MAX_LIST]]
        return shown if len(items) <= _MAX_LIST else {"length": len(items), "first": shown}
    if callable(value):
        return f"<{getattr(value, '__qualname__', type(value).__name__)}>"
    return repr(value)


def _special(value: Any, depth: int) -> Any:
    """Views of third-party types (numpy, networkx, torch), imported only when present."""
    module = type(value).__module__.split(".")[0]
    if module == "numpy":
        return debug_json(value.tolist(), depth + 1)
    if module == "networkx":
        import networkx as nx

        return debug_json(nx.node_link_data(value, edges="edges"), depth + 1)
    if module == "torch":
        import torch

        if isinstance(value, torch.Tensor):
            return {
                "tensor": list(value.shape),
                "dtype": str(value.dtype),
                "device": str(value.device),
            }
        if isinstance(value, torch.fx.GraphModule):
            return {"graph_module": value.code.strip().splitlines()}
        if isinstance(value, torch.nn.Module):
            count = sum(p.numel() for p in value.parameters())
            return {"module": type(value).__qualname__, "num_parameters": count}
    return None
