"""Stop a trace that unrolls a Python loop over the sequence, in bounded time.

torch.fx and ``torch.export`` run forward once and record every torch call: a loop over a 1024-token
sequence (a reference scan, an RNN cell stepped per token) becomes thousands of calls per
layer, and tracing, costing and solving them takes minutes to hours, with nothing shown. A
stack of layers runs each line of user code once per layer, each in a module of its own; a
loop runs one line once per step in the same module. So the guard counts torch calls per
(line of user code, module instance) and refuses at a limit, naming the line.
"""

from __future__ import annotations

import linecache
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.overrides import TorchFunctionMode

from hplan.runtime.contract.errors import TraceTooLongError


class LoopGuard(TorchFunctionMode):
    """Stops a trace that unrolls a Python loop over the sequence (a reference scan, an RNN
    cell stepped per token): tracing, costing and solving grow with every step, for minutes
    to hours. Counts the torch calls each line of user code makes in each module instance
    (a stack of layers runs each line once per layer, in a module of its own; a loop runs
    it once per step, in the same module) and raises :class:`TraceTooLongError` when one
    exceeds ``max_calls_per_line``, naming the line. Tells ``progress`` the number of calls
    every ``report_every``."""

    def __init__(
        self,
        what: str,
        max_calls_per_line: int,
        progress: Callable[[str], None] | None = None,
        report_every: int = 2_000,
    ) -> None:
        super().__init__()
        self.what, self.limit, self.progress = what, max_calls_per_line, progress
        self.report_every = report_every
        self.num_calls = 0
        self._counts: dict[tuple[Any, int, int], int] = {}
        self._modules: list[nn.Module] = []
        self._kinds: dict[Any, str] = {}
        self._hooks: list[Any] = []

    def __enter__(self) -> LoopGuard:
        self._hooks = [
            register_module_forward_pre_hook(lambda m, args: self._modules.append(m)),
            register_module_forward_hook(lambda m, args, out: self._pop(m), always_call=True),
        ]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for hook in self._hooks:
            hook.remove()

    def _pop(self, module: nn.Module) -> None:
        if self._modules and self._modules[-1] is module:
            self._modules.pop()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.num_calls += 1
        frame = self._user_frame()
        if frame is not None:
            module = id(self._modules[-1]) if self._modules else 0
            key = (frame.f_code, frame.f_lineno, module)
            self._counts[key] = count = self._counts.get(key, 0) + 1
            if count > self.limit:
                raise TraceTooLongError(self._message(frame))
        if self.progress is not None and self.num_calls % self.report_every == 0:
            self.progress(f"{self.what}: {self.num_calls} torch calls traced")
        return func(*args, **(kwargs or {}))

    def _user_frame(self) -> FrameType | None:
        """The innermost frame of user code (the model's), skipping torch's; None when the
        call comes from torch itself (hplan's own frames are reached first)."""
        frame: FrameType | None = sys._getframe(2)
        while frame is not None:
            kind = self._kinds.get(frame.f_code)
            if kind is None:
                kind = self._kinds[frame.f_code] = _code_kind(frame.f_code.co_filename)
            if kind == "hplan":
                return None
            if kind == "user":
                return frame
            frame = frame.f_back
        return None

    def _message(self, frame: FrameType) -> str:
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        return (
            f"{self.what} unrolls a Python loop: {frame.f_code.co_filename}:{frame.f_lineno} "
            f"`{line}` made more than {self.limit} torch calls in one module (a loop over the "
            "sequence?), and a plan of it would take too long to make; vectorise the "
            "loop (a parallel scan), move it into a module of its own that torch.fx traces "
            "around and keep that whole (--leaf-module), or plan a shorter sequence"
        )


def _code_kind(filename: str) -> str:
    """ "torch", "hplan" or "user": whose code ``filename`` holds."""
    if filename.startswith("<"):
        return "torch"
    path = str(Path(filename).resolve())
    if path.startswith(_TORCH_DIR):
        return "torch"
    return "hplan" if path.startswith(_HPLAN_DIRS) else "user"


_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_RUNTIME_DIR = Path(__file__).resolve().parents[1]
_HPLAN_DIRS = (str(_RUNTIME_DIR), str(_RUNTIME_DIR.parent / "planner"))
"""hplan's two packages (siblings in a checkout and in an installed wheel alike)."""
