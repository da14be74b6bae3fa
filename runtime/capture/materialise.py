"""Build only some of a model's tensors, with the values a full build gives them.

A rank keeps one stage of the model; building every parameter on the CPU first would cost
the whole model's memory on every rank. Two passes over ``build_model`` avoid that:
:func:`record_build` runs it on fake tensors and writes down every operator call that
creates or changes a tensor (a :class:`Step`); :func:`replay_build` runs it again after the
same seed, only the steps the kept tensors depend on (:func:`real_steps`) on real CPU
tensors. A random step also runs on a real scratch tensor, so the CPU generator advances
exactly as in a full build: the kept tensors get the full build's values bit for bit, and
the peak is the kept tensors plus the largest single random draw.

``stage_tensors.materialise`` does both for a stage's tensors. What cannot be reproduced
raises :class:`CannotMaterialise`, and the caller builds the whole model.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode

from hplan.runtime.capture.trace import user_location
from hplan.runtime.contract.errors import one_line

__all__ = [
    "BuildRecord",
    "CannotMaterialise",
    "Step",
    "real_steps",
    "record_build",
    "replay_build",
]

_VALUE_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
"""Operators whose result depends on tensor values (``.item()``, ``nonzero``)."""


class CannotMaterialise(Exception):
    """The two-pass build cannot reproduce a full build of this model; the message says
    why (not an ``HplanError``: the caller falls back to a full build)."""


@dataclass(frozen=True, slots=True)
class Step:
    """One operator call of the fake build that creates or changes a tensor (views such
    as ``detach`` and queries such as ``sym_size`` are not steps: a fake tensor dispatches
    some of them where a real one does not)."""

    op: str
    """The operator overload, e.g. ``aten.normal_.default``."""
    reads: tuple[int, ...]
    """Storage ordinals of its tensor arguments."""
    writes: tuple[int, ...]
    """Storage ordinals it created (new outputs) or changed (mutated arguments)."""
    random: bool
    """Draws from a generator (torch's ``nondeterministic_seeded`` tag)."""
    outputs: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    """(shape, dtype) of each tensor it returned."""


@dataclass(frozen=True)
class BuildRecord:
    """A model built on fake tensors, and the steps that built it."""

    model: nn.Module
    fake_mode: FakeTensorMode
    """The mode of the model's fake tensors (torch.export must trace inside it)."""
    steps: tuple[Step, ...]
    ordinals: dict[int, int] = field(repr=False)
    """Storage address -> ordinal, numbered in order of first sight."""
    storages: list[Any] = field(repr=False)
    """Every storage seen, kept alive so that no address is reused."""

    def ordinal(self, tensor: torch.Tensor) -> int:
        """The ordinal of the storage of ``tensor``, a tensor of :attr:`model`.

        Raises:
            CannotMaterialise: no operator of the build touched that storage.
        """
        key = _storage_key(tensor)
        if key not in self.ordinals:
            raise CannotMaterialise("a tensor of the model was made outside build_model()")
        return self.ordinals[key]


# ----------------------------------------------------------------------- pass 1
def record_build(build: Callable[[], Any], seed: int) -> BuildRecord:
    """Run ``build`` after ``torch.manual_seed(seed)`` on fake tensors and record it.

    Fake tensors as in the planner's capture (``FakeTensorMode``: shapes, dtypes and
    strides, no storage; their device reads ``cpu``, so code that asks takes the path of a
    real build). A dispatch mode writes down, in order, every operator call that creates or
    changes a tensor: which storages it reads and which it writes. The fake model is what a
    rank traces. The generators of torch, ``random`` and NumPy are left as they were, so
    that the replay draws from them what a full build would.

    Raises:
        CannotMaterialise: ``build`` reads tensor values (``.item()``, ``trunc_normal_``'s
            rejection loop), raises on fake tensors (or raises at all: a full build then
            reports the model file's fault), or returns something other than a module.
    """
    mode = FakeTensorMode(shape_env=ShapeEnv(tracked_fakes=[]), allow_non_fake_inputs=True)
    recorder = _Recorder(mode)
    with _host_generators_kept(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            with recorder:
                model = build()
        except CannotMaterialise as exc:
            raise CannotMaterialise(f"build_model() {exc} at {user_location(exc)}") from None
        except Exception as exc:
            raise CannotMaterialise(
                f"build_model() raised {one_line(exc)} on fake tensors at {user_location(exc)}"
            ) from None
    if not isinstance(model, nn.Module):
        raise CannotMaterialise(f"build_model() returned a {type(model).__name__}")
    return BuildRecord(model, mode, tuple(recorder.steps), recorder.ordinals, recorder.storages)


class _Recorder(TorchDispatchMode):
    """Runs every operator on fake tensors and appends a :class:`Step` for each step."""

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.steps: list[Step] = []
        self.ordinals: dict[int, int] = {}
        self.storages: list[Any] = []

    def _ordinal(self, tensor: torch.Tensor) -> tuple[int, bool]:
        """(ordinal of its storage, whether first seen now)."""
        key = _storage_key(tensor)
        if key in self.ordinals:
            return self.ordinals[key], False
        self.ordinals[key] = len(self.ordinals)
        self.storages.append(tensor.untyped_storage())
        return self.ordinals[key], True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        if any(tag in func.tags for tag in _VALUE_TAGS) and any(_no_value(t) for t in inputs):
            raise CannotMaterialise(f"reads tensor values ({func})")
        reads = tuple(self._ordinal(t)[0] for t in inputs)
        with self.fake_mode:
            out = func(*args, **kwargs)
        outputs = _tensors(out)
        created = [ordinal for ordinal, new in map(self._ordinal, outputs) if new]
        if not _is_step(func):
            return out
        mutated = [self._ordinal(t)[0] for t in _mutated(func, args, kwargs)]
        step = Step(
            op=str(func),
            reads=reads,
            writes=tuple(dict.fromkeys([*mutated, *created])),
            random=_is_random(func),
            outputs=_metadata(outputs),
        )
        self.steps.append(step)
        return out


def _no_value(tensor: torch.Tensor) -> bool:
    """A fake tensor that does not carry its value (fake mode keeps small constants)."""
    return is_fake(tensor) and getattr(tensor, "constant", None) is None


# ----------------------------------------------------------------------- which steps are real
def real_steps(record: BuildRecord, keep: Iterable[int]) -> frozenset[int]:
    """Indices of the steps that must run on real tensors for the storages ``keep``
    (ordinals) to end with their full-build values.

    A storage needs every step that writes it, and such a step needs every storage it
    reads or writes. The values a random step reads (``bernoulli_``'s probabilities)
    decide how far it advances the generator, so they are needed whatever it writes.
    """
    writers: dict[int, list[int]] = {}
    for idx, step in enumerate(record.steps):
        for ordinal in step.writes:
            writers.setdefault(ordinal, []).append(idx)
    random_reads = [
        o for step in record.steps if step.random for o in step.reads if o not in step.writes
    ]
    needed: set[int] = set()
    chosen: set[int] = set()
    work = [*keep, *random_reads]
    while work:
        ordinal = work.pop()
        if ordinal in needed:
            continue
        needed.add(ordinal)
        for idx in writers.get(ordinal, ()):
            if idx not in chosen:
                chosen.add(idx)
                work.extend(record.steps[idx].reads + record.steps[idx].writes)
    return frozenset(chosen)


# ----------------------------------------------------------------------- pass 2
def replay_build(
    build: Callable[[], Any], seed: int, record: BuildRecord, real: frozenset[int]
) -> nn.Module:
    """Run ``build`` after ``torch.manual_seed(seed)``, the steps ``real`` on real CPU
    tensors and the others on fake ones; a random one (torch's ``nondeterministic_seeded``
    tag: ``normal_``, ``uniform_``, ``bernoulli_``, ``randn``, ``randperm`` ...) also on a
    real scratch tensor of the same shape, strides and dtype, whose values are dropped.

    Non-steps (views, queries) run on real tensors when all their tensor arguments are
    real. Afterwards the generators stand where a full build leaves them.

    Raises:
        CannotMaterialise: the build makes other steps than ``record`` (other operators,
            order or output shapes), a real step meets a fake tensor, or it raises.
    """
    replay = _Replay(record.steps, real)
    torch.manual_seed(seed)
    try:
        with replay:
            model = build()
    except CannotMaterialise:
        raise
    except Exception as exc:
        raise CannotMaterialise(
            f"build_model() raised {one_line(exc)} the second time, at {user_location(exc)}"
        ) from None
    if replay.next_idx != len(record.steps):
        raise CannotMaterialise(
            f"build_model() made {replay.next_idx} steps the second time, {len(record.steps)} "
            "the first"
        )
    assert isinstance(model, nn.Module)  # as in the record
    return model


class _Replay(TorchDispatchMode):
    def __init__(self, steps: Sequence[Step], real: frozenset[int]) -> None:
        super().__init__()
        self.steps = steps
        self.real = real
        self.next_idx = 0
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.scratch = _Scratch()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        all_real = not any(is_fake(t) for t in inputs)
        if not _is_step(func):
            return func(*args, **kwargs) if inputs and all_real else self._fake(func, args, kwargs)
        idx = self.next_idx
        step = self._expect(func, idx)
        self.next_idx += 1
        if idx in self.real:
            if not all_real:
                raise CannotMaterialise(f"step {idx} ({step.op}) reads a tensor not built")
            out = func(*args, **kwargs)
        else:
            out = self._fake(func, args, kwargs)
            if step.random:
                self.scratch.draw(func, args, kwargs)
        if _metadata(_tensors(out)) != step.outputs:
            raise CannotMaterialise(f"step {idx} ({step.op}) gave other shapes the second time")
        return out

    def _fake(self, func: Any, args: Any, kwargs: Any) -> Any:
        with self.fake_mode:
            return func(*args, **kwargs)

    def _expect(self, func: Any, idx: int) -> Step:
        recorded = self.steps[idx].op if idx < len(self.steps) else "nothing"
        if recorded != str(func):
            raise CannotMaterialise(
                f"build_model() called {func} the second time where it called {recorded} the "
                f"first (step {idx})"
            )
        return self.steps[idx]


class _Scratch:
    """Real memory for random draws whose values are dropped, reused from draw to draw (a
    flat buffer per dtype and argument position, grown to the largest draw). A fresh
    temporary per draw fragments the heap the kept tensors live in: in the GPT of
    ``bench/stage_memory.py`` the peak RSS grew by two thirds of the model."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, int], torch.Tensor] = {}

    def like(self, tensor: torch.Tensor, position: int) -> torch.Tensor:
        """A real tensor of ``tensor``'s shape, strides and dtype (uninitialised)."""
        sizes, strides = tuple(tensor.shape), tuple(tensor.stride())
        numel = (
            0 if 0 in sizes else 1 + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True))
        )
        key = (tensor.dtype, position)
        if key not in self._buffers or self._buffers[key].numel() < numel:
            self._buffers.pop(key, None)
            self._buffers[key] = torch.empty(numel, dtype=tensor.dtype, device="cpu")
        return self._buffers[key].as_strided(sizes, strides)

    def draw(self, func: Any, args: Any, kwargs: Any) -> None:
        """Run random operator ``func`` with real tensors in place of its fake ones, so that
        the generator advances as in a full build; drop the result.

        The tensors it writes are replaced by scratch tensors of their shape, strides and
        dtype (a random fill does not read what it overwrites; how many numbers it draws
        depends on size and contiguity only); the ones it reads are real already
        (:func:`real_steps` needs them).

        Raises:
            CannotMaterialise: it reads a fake tensor.
        """
        mutated = [id(t) for t in _mutated(func, args, kwargs)]

        def real(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            if id(value) in mutated:
                return self.like(value, mutated.index(id(value)))
            if is_fake(value):
                raise CannotMaterialise(f"random operator {func} reads a tensor not built")
            return value

        real_args, real_kwargs = pytree.tree_map(real, (args, kwargs))
        func(*real_args, **real_kwargs)


# ----------------------------------------------------------------------- helpers
def _tensors(value: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]


def _mutated(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors ``func`` writes to, by its schema (in-place and ``out=`` arguments)."""
    found: list[torch.Tensor] = []
    for idx, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        found.extend(_tensors(args[idx] if idx < len(args) else kwargs.get(argument.name)))
    return found


def _is_step(func: Any) -> bool:
    """Whether ``func`` changes an argument or returns a tensor that is not a view of one
    (by its schema, so the same in both passes)."""
    schema = func._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return True
    return any("Tensor" in str(r.type) and r.alias_info is None for r in schema.returns)


def _is_random(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def _metadata(tensors: Sequence[torch.Tensor]) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


def _storage_key(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError) as exc:  # sparse and other layouts
        raise CannotMaterialise(f"a {tensor.layout} tensor has no storage to follow") from exc


@contextlib.contextmanager
def _host_generators_kept() -> Iterator[None]:
    """Restore the global generators of Python's ``random`` and NumPy on exit."""
    python_state = random.getstate()
    numpy = _numpy()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        random.setstate(python_state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy
