"""The capture pass: the model built once, its example batches, its graph traced once.

Every later pass of a solve reads this :class:`CapturedModel`; ``build_model`` and the trace
each run exactly once per solve. By default nothing runs on real tensors: ``build_model``
runs under a ``FakeTensorMode`` (shapes, dtypes and strides, no storage, no compute), the
example inputs are fake copies of ``sample_batch``'s, and the trace and every later forward
run on them, so a 7B model costs no more memory than its Python objects. Fake CPU tensors,
not meta ones, because ops choose their kernel by device: on meta
``scaled_dot_product_attention`` takes the unfused math path, whose graph and strides differ
from what a rank traces on real tensors, and Hugging Face models raise on meta in their
data-dependent checks. Expert layers that do not run on fakes as they are run as
``moe.py`` says, in every fake run (:meth:`CapturedModel.fake_runs`). When the model cannot be
built or traced on fake tensors, it is built and traced on real CPU tensors instead, if it
fits this machine's memory, and :attr:`CapturedModel.notes` says why. What the runtime
could not train is refused first (``capture_checks.py``).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols

from hplan.planner.frontend.capture_checks import (
    ParametersCreated,
    check_fallback_memory,
    check_inputs,
    check_materialised,
    check_no_parameters_created,
    state_bytes,
)
from hplan.planner.frontend.moe import (
    NEEDS_VALUES,
    ExpertDispatch,
    dispatch_notes,
    eager_experts_message,
    eager_hf_experts,
    expected_routing,
    find_expert_dispatches,
    with_output_arity,
)
from hplan.runtime.capture.model_file import ModelFile
from hplan.runtime.capture.trace import TracedModel, bind_inputs, trace_model
from hplan.runtime.contract.cpus import available_memory_bytes
from hplan.runtime.contract.errors import (
    HplanError,
    ModelFileError,
    TraceError,
    TraceTooLongError,
    one_line,
)
from hplan.runtime.contract.plan import TraceMethod

DEFAULT_BATCH_SIZES = (2, 3)
"""The two batch sizes every node is measured at (per-sample figures are their slope)."""


class CaptureTensors(StrEnum):
    """What the captured model's tensors are."""

    FAKE = "fake"
    """Fake CPU tensors of one ``FakeTensorMode``: no storage; nothing really runs."""
    CPU = "cpu"
    """Real CPU tensors (the fallback when the model does not build or trace on fake ones)."""


@dataclass(frozen=True)
class CapturedModel:
    """A model file's model, built and traced once, with its example batches."""

    model_file: ModelFile
    model: nn.Module
    """Built once, after ``torch.manual_seed(seed)``; fake or CPU tensors (``tensors``)."""
    traced: TracedModel
    """Traced once, on the smaller batch."""
    batches: Mapping[int, tuple[Any, Any]]
    """Batch size -> ``sample_batch(batch_size)`` as the model file returned it
    ``(inputs, targets)``, real tensors; exactly two sizes."""
    inputs: Mapping[int, Mapping[str, torch.Tensor]]
    """Batch size -> the inputs bound to ``forward``'s parameter names (fake copies when
    ``tensors`` is FAKE)."""
    seed: int
    fake_mode: FakeTensorMode | None = None
    """The mode the model's fake tensors belong to (run every forward inside it); None for
    real CPU tensors."""
    notes: tuple[str, ...] = ()
    """Why the model was captured on real CPU tensors, when it was; which expert layers
    are costed as a balanced routing."""
    expert_dispatches: tuple[ExpertDispatch, ...] = ()
    """The expert layers that pick tokens by value, kept whole and run as a balanced
    routing on fake tensors (``moe.py``)."""

    def fake_runs(self) -> contextlib.AbstractContextManager[object]:
        """The context every run of the fake model goes in (inside :attr:`fake_mode`):
        expert layers as ``moe.py`` runs them on fakes."""
        return expected_routing(self.model, self.expert_dispatches)

    @property
    def model_sha256(self) -> str:
        """sha256 hex of the model file's bytes."""
        return self.model_file.sha256

    @property
    def tensors(self) -> CaptureTensors:
        """FAKE when the model and inputs are fake tensors, else CPU."""
        return CaptureTensors.CPU if self.fake_mode is None else CaptureTensors.FAKE

    def fake(self, value: Any) -> Any:
        """Every real tensor in a nested structure as a fake tensor of :attr:`fake_mode`
        (static shapes); fake tensors and other leaves as they are."""
        mode = self.fake_mode
        assert mode is not None, "fake() needs a fake capture"
        return torch.utils._pytree.tree_map(lambda x: _fake_of(mode, x), value)

    @property
    def batch_sizes(self) -> tuple[int, int]:
        """The two batch sizes, smaller first."""
        small, large = sorted(self.inputs)
        return small, large

    def verify(self) -> None:
        """Check the capture's invariants; raise ValueError naming the first broken one.

        Two distinct batch sizes, with bound inputs and raw batches for both; the graph's
        placeholders are the fed inputs, in order, at both sizes.
        """
        sizes = sorted(self.inputs)
        if len(sizes) != 2 or sizes[0] == sizes[1] or sorted(self.batches) != sizes:
            raise ValueError(
                f"a capture needs two batch sizes, got {sizes} / {sorted(self.batches)}"
            )
        gm = self.traced.graph_module
        placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(self.traced.input_names):
            raise ValueError(
                f"graph placeholders {placeholders} do not match the fed inputs "
                f"{list(self.traced.input_names)}"
            )
        for size, feed in self.inputs.items():
            if list(feed) != list(self.traced.input_names):
                raise ValueError(
                    f"inputs at batch size {size} are {list(feed)}, want the traced ones"
                )


def capture_model(
    model_file: ModelFile,
    *,
    leaf_modules: tuple[str, ...] = (),
    seed: int = 0,
    batch_sizes: tuple[int, int] = DEFAULT_BATCH_SIZES,
    tensors: CaptureTensors = CaptureTensors.FAKE,
    progress: Callable[[str], None] | None = None,
) -> CapturedModel:
    """Build the model and its two example batches (seeded), and trace it on the smaller.

    The inputs are checked (``capture_checks.check_inputs``) before any real build, and a
    real-tensor fallback against this machine's available memory first.

    Args:
        leaf_modules: module paths or class names to keep whole, besides the model file's
            ``LEAF_MODULES``.
        batch_sizes: two distinct batch sizes >= 1.
        tensors: FAKE (the default) builds and traces on fake tensors, and on real CPU
            tensors when that fails (a note says why); CPU builds on real CPU tensors
            (what measuring on a device needs).
        progress: told what the capture is doing, as each step starts (a short phrase).

    Raises:
        ModelFileError: ``build_model``/``sample_batch`` raise or give unusable inputs, the
            model has lazy modules not materialised, its forward creates parameters, or the
            real-tensor fallback would not fit this machine's memory (``capture_checks``).
        TraceError: the model cannot be traced.
        ValueError: ``batch_sizes`` are not two distinct positive integers.
    """
    small, large = _check_batch_sizes(batch_sizes)
    say = progress or _silent
    leaves = (*leaf_modules, *model_file.leaf_modules)
    notes: tuple[str, ...] = ()
    building = "building the model on real CPU tensors"
    if tensors is CaptureTensors.FAKE:
        try:
            with _fake_tensor_log_quiet():
                return _capture_fake(model_file, leaves, seed, (small, large), say)
        except _FakeCaptureFailed as failed:
            reason, model_bytes = _reason(failed.cause), failed.state_bytes
        notes = (
            "captured on real CPU tensors: the model does not build or trace on fake "
            f"tensors ({reason})",
        )
        if model_bytes is None:
            model_bytes = _meta_state_bytes(model_file, seed)
        check_fallback_memory(model_file, model_bytes, reason, available_memory_bytes())
        building = f"{building} (fake tensors failed: {reason})"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        check_inputs(model_file, {b: _sample_batch(model_file, b) for b in (small, large)})
    say(building)
    with torch.random.fork_rng(devices=[]):
        model = _build(model_file, seed)
        batches = {b: _sample_batch(model_file, b) for b in (small, large)}
    check_materialised(model_file, model)
    inputs = {b: bind_inputs(model, batch[0]) for b, batch in batches.items()}
    say("tracing on real CPU tensors")
    with ParametersCreated() as created:
        traced = trace_model(model, inputs[small], leaf_modules=leaves, progress=say)
    check_no_parameters_created(model_file, created)
    return CapturedModel(model_file, model, traced, batches, inputs, seed, notes=notes)


class _FakeCaptureFailed(Exception):
    """The capture on fake tensors failed where real tensors may succeed."""

    def __init__(self, cause: BaseException, state_bytes: int | None) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.state_bytes = state_bytes
        """The fake build's parameter and buffer bytes; None when the build failed."""


def _silent(_: str) -> None:
    return None


def _capture_fake(
    model_file: ModelFile,
    leaves: tuple[str, ...],
    seed: int,
    sizes: tuple[int, int],
    say: Callable[[str], None],
) -> CapturedModel:
    """The capture on fake tensors (see the module docstring). A failure to build or trace
    raises :class:`_FakeCaptureFailed` (real tensors may do); a refusal of the inputs or of
    the model raises its ModelFileError (real tensors would not help).

    A run of the traced graph is part of the trace (modules kept whole run their own code,
    which may need tensor values; a graph from ``torch.export`` ran on these fakes as it
    was made, and is not run again). The mode has a shape environment that records its
    fakes, so that ``torch.export`` reuses it (and the model's fake parameters).
    """
    mode = FakeTensorMode(shape_env=ShapeEnv(tracked_fakes=[]), allow_non_fake_inputs=True)
    say("building the model on fake tensors")
    with torch.random.fork_rng(devices=[]):
        try:
            model = _build_fake(model_file, seed, mode)
        except Exception as exc:
            raise _FakeCaptureFailed(exc, None) from exc
        batches = {b: _sample_batch(model_file, b) for b in sizes}
    check_inputs(model_file, batches)
    check_materialised(model_file, model)
    inputs = {
        b: {k: _fake_of(mode, v) for k, v in bind_inputs(model, batch[0]).items()}
        for b, batch in batches.items()
    }
    eager = eager_hf_experts(model)
    if eager:
        raise _Untraceable(eager_experts_message(type(model).__name__, eager))
    dispatches = find_expert_dispatches(model)
    try:
        with ParametersCreated() as created:
            traced, routed = _trace_keeping_dispatches(
                model, inputs[sizes[0]], leaves, dispatches, mode, say
            )
    except TraceTooLongError:  # no faster on real tensors
        raise
    except Exception as exc:
        raise _FakeCaptureFailed(exc, state_bytes(model)) from exc
    check_no_parameters_created(model_file, created)
    return CapturedModel(
        model_file,
        model,
        traced,
        batches,
        inputs,
        seed,
        fake_mode=mode,
        notes=dispatch_notes(routed),
        expert_dispatches=tuple(routed.values()),
    )


def _trace_keeping_dispatches(
    model: nn.Module,
    feed: Mapping[str, torch.Tensor],
    leaves: tuple[str, ...],
    dispatches: tuple[ExpertDispatch, ...],
    mode: FakeTensorMode,
    say: Callable[[str], None],
) -> tuple[TracedModel, dict[str, ExpertDispatch]]:
    """:func:`_trace_fake`; when its run needs tensor values and the model has expert layers
    (``moe.find_expert_dispatches``) that the trace went through, they are kept whole and
    the model traced again."""
    try:
        return _trace_fake(model, feed, leaves, dispatches, mode, say)
    except (*NEEDS_VALUES, ValueShapesError):
        kept = (*leaves, *(d.path for d in dispatches))
        if not dispatches or set(kept) == set(leaves):
            raise
        return _trace_fake(model, feed, kept, dispatches, mode, say)


def _trace_fake(
    model: nn.Module,
    feed: Mapping[str, torch.Tensor],
    leaves: tuple[str, ...],
    dispatches: tuple[ExpertDispatch, ...],
    mode: FakeTensorMode,
    say: Callable[[str], None],
) -> tuple[TracedModel, dict[str, ExpertDispatch]]:
    """The trace on fakes and one run of its graph (expert layers probed: ``moe.py``);
    the expert layers that run as a balanced routing, by path."""
    with mode:
        traced = trace_model(model, feed, leaf_modules=leaves, progress=say)
        if traced.method is TraceMethod.EXPORT:  # export ran every op on these fakes
            return traced, {}
        dispatches = with_output_arity(dispatches, traced.graph_module)
        with (
            expected_routing(model, dispatches, probe=True) as routing,
            torch.no_grad(),
            warnings.catch_warnings(),  # modules kept whole run code that may need values
        ):
            warnings.simplefilter("ignore")
            args = [feed[n] for n in traced.input_names]
            _ShapeChecked(traced.graph_module).run(*args, enable_io_processing=False)
    return traced, routing.routed


class _Untraceable(TraceError):
    """A model no tracing method can trace, known from its modules: refused before a
    real-tensor build."""


class ValueShapesError(RuntimeError):
    """A traced graph makes a tensor whose shape depends on tensor values."""


class _ShapeChecked(torch.fx.Interpreter):
    """Runs a graph on fakes; raises :class:`ValueShapesError` at the first node whose
    output's shape depends on tensor values (``torch.where(mask)``: fake tensors give it an
    unbacked size, which no later cost can be read from)."""

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        for value in torch.utils._pytree.tree_leaves(result):
            if isinstance(value, torch.Tensor) and free_unbacked_symbols(value.shape):
                raise ValueShapesError(
                    f"node {n.name!r} makes a tensor whose shape depends on tensor values"
                )
        return result


def _meta_state_bytes(model_file: ModelFile, seed: int) -> int | None:
    """The parameter and buffer bytes of the model built on the meta device (no storage);
    None when it does not build there."""
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            return state_bytes(_build(model_file, seed))
    except Exception:
        return None


@contextlib.contextmanager
def _fake_tensor_log_quiet() -> Iterator[None]:
    """torch logs a traceback at ERROR level when an op fails on fake tensors, before it
    raises; the capture turns what it raises into one line (or falls back to real
    tensors), so that log is noise on the user's terminal."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _build_fake(model_file: ModelFile, seed: int, mode: FakeTensorMode) -> nn.Module:
    """``build_model`` under ``mode``; where it converts its own parameters (``model.to(
    memory_format=torch.channels_last)``, ``.to(torch.bfloat16)``), which torch cannot do
    to fake parameters (``nn.Module._apply`` swaps them, and a fake tensor is weakly
    referenced: "Couldn't swap"), built on the meta device instead and given fake CPU
    storage of the same shapes, dtypes and strides (``to_empty``), parameters shared
    between modules kept shared. Raises what the build raises otherwise."""
    try:
        with mode:
            return _build(model_file, seed)
    except ModelFileError as exc:
        if "Couldn't swap" not in str(exc):
            raise
    with torch.device("meta"):
        model = _build(model_file, seed)
    owners = {id(p): name for name, p in model.named_parameters(remove_duplicate=True)}
    shared = [
        (name, owners[id(p)])
        for name, p in model.named_parameters(remove_duplicate=False)
        if owners[id(p)] != name
    ]
    with mode:
        model = model.to_empty(device="cpu")
    for name, owner in shared:  # to_empty gives each module its own new parameter
        module_path, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(module_path), attribute, model.get_parameter(owner))
    return model


def _fake_of(mode: FakeTensorMode, value: Any) -> Any:
    if not isinstance(value, torch.Tensor) or is_fake(value):
        return value
    return mode.from_tensor(value, static_shapes=True)


def _reason(exc: BaseException) -> str:
    return one_line(exc).removeprefix("RuntimeError: ")


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device.

    No tensor data is copied: each parameter and buffer is replaced by a meta tensor of its
    shape and dtype (``requires_grad`` kept; a tensor tied under two names stays one), the
    rest of the module deep-copied.
    """
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        meta = tensor.detach().to("meta")
        if isinstance(tensor, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = meta
    with warnings.catch_warnings():  # torch's own pytree specs warn when deep-copied
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(module, memo)


def to_meta(value: Any) -> Any:
    """Every tensor in a nested structure moved to the meta device."""
    return torch.utils._pytree.tree_map(
        lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, value
    )


def _check_batch_sizes(batch_sizes: tuple[int, int]) -> tuple[int, int]:
    small, large = sorted(batch_sizes)
    if small < 1 or small == large:
        raise ValueError(f"batch_sizes {batch_sizes} must be two distinct integers >= 1")
    return small, large


def _build(model_file: ModelFile, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    try:
        model = model_file.build_model()
    except HplanError:
        raise
    except Exception as exc:
        raise ModelFileError(
            f"build_model() in {str(model_file.path)!r} raised {one_line(exc)}; fix model.py"
        ) from None
    if not isinstance(model, nn.Module):
        raise ModelFileError(
            f"build_model() returned a {type(model).__name__}; return a torch.nn.Module"
        )
    return model


def _sample_batch(model_file: ModelFile, batch_size: int) -> tuple[Any, Any]:
    try:
        batch = model_file.sample_batch(batch_size)
    except Exception as exc:
        raise ModelFileError(
            f"sample_batch({batch_size}) in {str(model_file.path)!r} raised "
            f"{one_line(exc)}; fix model.py"
        ) from None
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ModelFileError(
            f"sample_batch({batch_size}) must return (inputs, targets), got "
            f"{type(batch).__name__}; fix model.py"
        )
    return batch[0], batch[1]
