"""Turn a model into a torch.fx graph: symbolic trace, torch.export, or module boundaries.

The planner traces once to build the cost graph; every rank re-traces the same way (the
plan records the method and the leaf modules) and checks the graph fingerprint. Methods,
tried in this order when none is given:

1. ``torch.fx.symbolic_trace`` (module-level graph; torch.nn built-ins stay leaves, but
   its stacks of layers are traced one call per layer: ``builtin_stacks.py``). When
   it fails inside a submodule, that submodule is kept whole (a leaf) and tracing retried,
   unless keeping it whole would swallow a stack of repeated blocks.
2. ``torch.export``, then 3. module boundaries (``trace_fallbacks.py``).

Tracing runs user code; it never changes the model's buffers or the RNG state. A model and
inputs without data (fake tensors, as the planner captures them, or meta tensors) are
traced without running the eager forward; method 3, which needs its values, is not tried.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from hplan.runtime.capture.builtin_stacks import stack_forward
from hplan.runtime.capture.graph_inputs import (
    dict_inputs,
    flat_input,
    forward_kwargs,
    placeholder_target,
)
from hplan.runtime.capture.loop_guard import LoopGuard
from hplan.runtime.capture.trace_fallbacks import (
    chain_paths,
    export_graph,
    module_chain,
    outputs_match,
    preserved,
)
from hplan.runtime.capture.trace_notes import (
    UNKNOWN_LINE,
    Failure,
    failure_message,
    given_message,
    kept_whole_notes,
)
from hplan.runtime.contract.errors import ModelFileError, TraceError, TraceTooLongError, one_line
from hplan.runtime.contract.plan import TraceMethod

__all__ = [
    "CONTAINER_CLASSES",
    "TracedModel",
    "bind_inputs",
    "outputs_match",
    "repeated_containers",
    "target_name",
    "trace_model",
    "user_location",
]

CONTAINER_CLASSES = frozenset(
    f"torch.nn.modules.container.{name}" for name in ("ModuleList", "Sequential", "ModuleDict")
)
_MAX_AUTO_LEAVES = 16
MAX_CALLS_PER_LINE = 1_024
"""The most torch calls one line of user code may make in one module instance while
torch.fx or ``torch.export`` traces (``loop_guard.LoopGuard``): outside loops a line makes a handful
per call of its module; a loop over the experts of a 256-expert MoE some hundreds; a loop
over a 1024-token sequence thousands."""
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_RUNTIME_DIR = Path(__file__).resolve().parents[1]
_LIBRARY_DIRS = (_TORCH_DIR, str(_RUNTIME_DIR), str(_RUNTIME_DIR.parent / "planner"))
"""Frames in these folders are not the user's (hplan's two packages are siblings, in a
checkout and in an installed wheel alike)."""


@dataclass(frozen=True)
class TracedModel:
    """A traced model: its fx graph and how it was obtained."""

    graph_module: torch.fx.GraphModule
    method: TraceMethod
    input_names: tuple[str, ...]
    """Fed graph inputs (placeholders, in graph order): forward parameter names, in
    forward-signature order."""
    leaf_modules: tuple[str, ...]
    """Module paths kept whole (given + found automatically)."""
    notes: tuple[str, ...]
    """Human-readable notes, e.g. "symbolic trace failed at ...; used torch.export"."""
    param_names: Mapping[str, str] = field(default_factory=dict)
    """Every name of a parameter or buffer of the model (tied aliases included) -> its
    canonical name: the first name under which ``named_parameters()`` /
    ``named_buffers()`` lists that tensor."""
    module_classes: Mapping[str, str] = field(default_factory=dict)
    """Module path (``""`` is the root) -> qualified class name, for every module."""

    def fingerprint(self) -> str:
        """sha256 hex of (op, name, target) of every node and of the name, shape and dtype
        of every parameter and buffer; stable across runs. The tensors count because a
        model's sizes need not change its graph: the GPT example at width 128 traces to the
        same nodes as at width 64, and a plan made for one ran the other unnoticed."""
        digest = hashlib.sha256()
        for node in self.graph_module.graph.nodes:
            digest.update(f"{node.op}\t{node.name}\t{target_name(node.target)}\n".encode())
        tensors = [*self.graph_module.named_parameters(), *self.graph_module.named_buffers()]
        for name, tensor in tensors:
            digest.update(f"{name}\t{tuple(tensor.shape)}\t{tensor.dtype}\n".encode())
        return digest.hexdigest()


def target_name(target: Any) -> str:
    """A run-independent text for an fx node target (no memory addresses)."""
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    return f"{module}.{name}" if name else type(target).__name__


def repeated_containers(module_classes: Mapping[str, str]) -> frozenset[str]:
    """Paths of the outermost ModuleList/Sequential/ModuleDict modules that have >= 2
    children of one class (the stacks of repeated blocks; ``""`` is the root)."""
    found = set()
    for path, cls in module_classes.items():
        if cls not in CONTAINER_CLASSES:
            continue
        prefix = f"{path}." if path else ""
        children = [
            c for p, c in module_classes.items() if p.startswith(prefix) and _is_child(p, prefix)
        ]
        if any(children.count(c) >= 2 for c in set(children)):
            found.add(path)
    return frozenset(p for p in found if not any(_is_inside(p, q) for q in found))


def _is_inside(path: str, ancestor: str) -> bool:
    return path != ancestor and (not ancestor or path.startswith(f"{ancestor}."))


def _is_child(path: str, prefix: str) -> bool:
    rest = path[len(prefix) :]
    return bool(rest) and "." not in rest


def bind_inputs(model: nn.Module, inputs: Any) -> dict[str, torch.Tensor]:
    """Name the inputs that ``sample_batch``/``dataset`` give by ``forward``'s parameters.

    A dict of tensors given for one parameter (diffusers' ``added_cond_kwargs={"text_embeds":
    ..., "time_ids": ...}``) becomes one graph input per tensor, named
    ``parameter.key`` (nested dicts: ``parameter.key.key``); :func:`forward_kwargs` rebuilds
    the dict for an eager call.

    Args:
        model: the model whose ``forward`` signature names the inputs.
        inputs: a Tensor (the first forward argument), a tuple/list (positional arguments)
            or a dict (keyword arguments). ``None`` entries mean "not fed".

    Returns:
        {graph input name: tensor}, in forward-signature order (a dict's keys in its order).

    Raises:
        ModelFileError: an unknown key, too many positional inputs, or a value that is
            neither a tensor nor a dict of tensors.
    """
    names = _parameter_names(model)
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if isinstance(inputs, (tuple, list)):
        if len(inputs) > len(names):
            raise ModelFileError(
                f"sample_batch gives {len(inputs)} positional inputs but forward takes "
                f"{len(names)} ({', '.join(names)}); return fewer or a dict by name"
            )
        inputs = dict(zip(names, inputs, strict=False))
    if not isinstance(inputs, Mapping):
        raise ModelFileError(
            f"sample_batch inputs are a {type(inputs).__name__}; return a tensor, a tuple "
            "or a dict of tensors"
        )
    for key in inputs:
        if key not in names:
            raise ModelFileError(
                f"input {key!r} is not a parameter of forward ({', '.join(names)}); "
                "rename the key in sample_batch"
            )
    bound: dict[str, torch.Tensor] = {}
    for name in names:
        bound.update(flat_input(name, inputs.get(name)))
    return bound


def _parameter_names(model: nn.Module) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = inspect.signature(model.forward).parameters.values()
    names = [p.name for p in params if p.kind in kinds]
    return names + [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


def trace_model(
    model: nn.Module,
    example_inputs: Mapping[str, Any],
    *,
    leaf_modules: Sequence[str] = (),
    method: TraceMethod | None = None,
    progress: Callable[[str], None] | None = None,
) -> TracedModel:
    """Trace ``model`` into a torch.fx graph (see the module docstring for the order).

    Args:
        model: the model; it is not modified (buffers and RNG state are restored).
        example_inputs: {forward parameter name: tensor} (see ``bind_inputs``). A
            non-tensor value is a constant baked into the graph; absent parameters are
            constants too (their default, else None).
        leaf_modules: module paths or class names to keep whole.
        method: None to choose; given (re-tracing from a plan): use exactly that method
            and those leaf modules.
        progress: told which method is being tried, as it starts.

    Raises:
        TraceTooLongError: torch.fx or ``torch.export`` unrolls a Python loop (a line made
            more than :data:`MAX_CALLS_PER_LINE` torch calls in one module).
        TraceError: no method works (naming the module path, the source file:line of the
            failing statement and the remedy), eager forward fails on the inputs (naming
            the inputs tried), or a leaf name matches no module.
    """
    fed, constants = _split_inputs(model, example_inputs)
    module_classes = _module_classes(model)
    leaves = _resolve_leaves(model, leaf_modules)
    context = _Context(model, fed, constants, module_classes)
    if method is not None:
        return context.finish(*_trace_given(context, method, leaves))
    say = progress or (lambda _: None)
    without_data = _without_data(context.fed)
    reference = None if without_data else _eager_reference(context)
    say("tracing with torch.fx")
    with LoopGuard("torch.fx", MAX_CALLS_PER_LINE, say):
        traced = _symbolic_auto(context, leaves)
    if isinstance(traced, tuple):
        gm, final_leaves, notes = traced
        return context.finish(gm, TraceMethod.SYMBOLIC, final_leaves, notes)
    failure = traced
    failed = f"symbolic trace failed {failure.describe()}"
    say("tracing with torch.export (torch.fx could not)")
    budget = LoopGuard("torch.export", MAX_CALLS_PER_LINE, say)
    try:
        gm = export_graph(context.model, context.fed, context.constants, budget)
    except TraceTooLongError:
        raise
    except Exception as exc:
        export_error = one_line(exc)
    else:
        ignored = " (it ignores LEAF_MODULES)" if leaves else ""
        notes = [f"{failed}; used torch.export instead{ignored}"]
        return context.finish(gm, TraceMethod.EXPORT, (), notes)
    if without_data:
        raise TraceError(
            f"{failed}; torch.export failed too ({export_error}); a chain of child modules "
            "cannot be checked on tensors without data: trace with real tensors"
        )
    say("tracing as a chain of child modules (torch.fx and torch.export could not)")
    paths = chain_paths(model)
    chain = module_chain(model, context.fed, paths, reference)
    if chain is not None and not _chain_holds_on_other_inputs(context, paths):
        raise TraceError(
            f"{failed}; torch.export failed too ({export_error}); a chain of its child "
            "modules matches forward on one batch but not on another, so forward takes "
            "data-dependent branches: make forward traceable (no Python control flow on "
            "tensor values, or torch.cond)"
        )
    if chain is not None:
        notes = [
            f"{failed}; torch.export failed too ({export_error}); ran child modules as a chain"
        ]
        return context.finish(chain, TraceMethod.MODULES, tuple(paths), notes)
    raise TraceError(failure_message(type(context.model).__name__, failure, export_error))


def _chain_holds_on_other_inputs(context: _Context, paths: Sequence[str]) -> bool:
    """Whether the module chain also equals forward on the fed batch with its floating
    inputs negated: a forward whose Python branches depend on values (``if x.sum() > 0``)
    usually takes another branch there, which one batch cannot show. Without floating
    inputs there is no such second batch to try (True)."""
    negated = {
        name: -value if isinstance(value, torch.Tensor) and value.is_floating_point() else value
        for name, value in context.fed.items()
    }
    if all(negated[name] is value for name, value in context.fed.items()):
        return True
    other = dataclasses.replace(context, fed=negated)
    return module_chain(context.model, negated, paths, _eager_reference(other)) is not None


# ----------------------------------------------------------------------- shared state
@dataclass(frozen=True)
class _Context:
    model: nn.Module
    fed: dict[str, Any]
    constants: dict[str, Any]
    module_classes: dict[str, str]

    def finish(
        self, gm: torch.fx.GraphModule, method: TraceMethod, leaves: Sequence[str], notes: Any
    ) -> TracedModel:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        assert len(placeholders) == len(self.fed), (placeholders, list(self.fed))
        return TracedModel(
            graph_module=gm,
            method=method,
            input_names=tuple(self.fed),
            leaf_modules=tuple(leaves),
            notes=tuple(notes),
            param_names=_param_names(self.model),
            module_classes=self.module_classes,
        )


_TRAINING_VALUES: dict[str, Any] = {"use_cache": False}
"""Forward parameters whose default is None, traced at these values when ``sample_batch``
leaves them unset: a training step reads no key/value cache (Hugging Face's ``use_cache=None``
means the config's, True for generation), and the cache object it would return cannot be
traced or cross a stage boundary."""


def _split_inputs(
    model: nn.Module, example_inputs: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fed tensors (graph inputs, ``parameter.key`` for a dict's tensors) and the
    constants of ``model.forward``'s parameters: a value ``example_inputs`` gives, else the
    default, else :data:`_TRAINING_VALUES`' or None."""
    signature = inspect.signature(model.forward).parameters
    given = forward_kwargs(example_inputs)
    unknown = sorted(set(given) - set(signature))
    if unknown:
        raise TraceError(
            f"inputs {unknown} are not parameters of {type(model).__name__}.forward "
            f"({', '.join(signature)}); rename them in sample_batch"
        )
    fed: dict[str, Any] = {}
    constants: dict[str, Any] = {}
    for name, param in signature.items():
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        tensors = {
            key: value
            for key, value in example_inputs.items()
            if key.split(".")[0] == name and isinstance(value, torch.Tensor)
        }
        value = given.get(name)
        if tensors:
            fed.update(tensors)
        elif value is not None:
            constants[name] = value
        else:
            default = None if param.default is inspect.Parameter.empty else param.default
            constants[name] = _TRAINING_VALUES.get(name) if default is None else default
    return fed, constants


def _module_classes(model: nn.Module) -> dict[str, str]:
    return {
        path: f"{type(m).__module__}.{type(m).__qualname__}" for path, m in model.named_modules()
    }


def _param_names(model: nn.Module) -> dict[str, str]:
    canonical: dict[str, str] = {}
    for named in (model.named_parameters, model.named_buffers):
        first: dict[int, str] = {}
        for name, tensor in named(remove_duplicate=False):
            canonical[name] = first.setdefault(id(tensor), name)
    return canonical


def _resolve_leaves(model: nn.Module, leaf_modules: Sequence[str]) -> tuple[str, ...]:
    modules = dict(model.named_modules())
    paths: list[str] = []
    for entry in leaf_modules:
        if entry in modules and entry:
            paths.append(entry)
            continue
        matches = [p for p, m in modules.items() if p and type(m).__name__ == entry]
        if not matches:
            raise TraceError(
                f"leaf module {entry!r} matches no module path or class name of "
                f"{type(model).__name__}; fix LEAF_MODULES in model.py or --leaf-module"
            )
        paths.extend(matches)
    return tuple(dict.fromkeys(paths))


def user_location(exc: BaseException) -> str:
    """file:line (and the statement) of the innermost frame outside torch and hplan."""
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if "<" not in f.filename and not str(Path(f.filename).resolve()).startswith(_LIBRARY_DIRS)
    ]
    if not frames:
        return UNKNOWN_LINE
    frame = frames[-1]
    code = f" `{frame.line.strip()}`" if frame.line else ""
    return f"{frame.filename}:{frame.lineno}{code}"


def _without_data(fed: Mapping[str, Any]) -> bool:
    """True when an input is a meta or fake tensor (shapes and dtypes only, no values)."""
    return any(isinstance(v, torch.Tensor) and (v.is_meta or is_fake(v)) for v in fed.values())


def _eager_reference(context: _Context) -> Any:
    try:
        with preserved(context.model), torch.no_grad():
            return context.model(**forward_kwargs(context.fed), **context.constants)
    except Exception as exc:
        const = [n for n, v in context.constants.items() if v is not None]
        location = user_location(exc)
        at = "" if location == UNKNOWN_LINE else f" at {location}"
        raise TraceError(
            f"{type(context.model).__name__}.forward raised {one_line(exc)}{at} with inputs "
            f"({', '.join(context.fed)}) fed and ({', '.join(const) or 'no others'}) set; "
            "fix model.py so that forward runs on what sample_batch returns (its shapes, "
            "and which inputs it feeds)"
        ) from None


# ----------------------------------------------------------------------- symbolic trace
class _Tracer(torch.fx.Tracer):
    """fx tracer that keeps given paths whole and records the module that failed."""

    def __init__(
        self, leaves: Sequence[str], dicts: Mapping[str, tuple[str, ...]] | None = None
    ) -> None:
        super().__init__()
        self.leaves = frozenset(leaves)
        self.dicts = dict(dicts or {})
        """Forward parameters fed as dicts of tensors -> their graph input names."""
        self.failed_module: str | None = None

    def create_args_for_root(
        self, root_fn: Any, is_module: bool, concrete_args: Any = None
    ) -> tuple[Any, list[Any]]:
        """fx's placeholders, with a parameter fed as a dict of tensors given as a dict of
        placeholders (one per tensor, where the parameter's was), so that forward may use
        it as a dict (``in``, ``.get``, ``**``)."""
        fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)
        for index, arg in enumerate(args):
            node = getattr(arg, "node", None)
            if node is None or node.op != "placeholder" or node.target not in self.dicts:
                continue
            with self.graph.inserting_before(node):
                proxies = {
                    name: self.create_proxy("placeholder", placeholder_target(name), (), {})
                    for name in self.dicts[node.target]
                }
            args[index] = forward_kwargs(proxies)[node.target]
            self.graph.erase_node(node)
        return fn, args

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaves:
            return True
        return stack_forward(m) is None and super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        if not self.is_leaf_module(m, self.path_of_module(m)):
            forward = stack_forward(m) or forward  # torch.nn's stacks: one call per layer
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_module is None:
                self.failed_module = self.path_of_module(m)
            raise


class _SymbolicFailure(Exception):
    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.describe())
        self.failure = failure


def _symbolic(context: _Context, leaves: Sequence[str]) -> torch.fx.GraphModule:
    tracer = _Tracer(leaves, dict_inputs(context.fed))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = tracer.trace(context.model, concrete_args=context.constants)
    except TraceTooLongError:
        raise
    except Exception as exc:
        failure = Failure(tracer.failed_module or "", user_location(exc), one_line(exc))
        raise _SymbolicFailure(failure) from exc
    gm = torch.fx.GraphModule(tracer.root, graph, type(context.model).__name__)
    _drop_unfed_placeholders(gm, {placeholder_target(name) for name in context.fed})
    return gm


def _drop_unfed_placeholders(gm: torch.fx.GraphModule, fed: set[str]) -> None:
    """Remove the placeholders fx makes for constant arguments, and their assertions."""
    doomed: dict[torch.fx.Node, None] = {}
    for node in gm.graph.nodes:
        unfed = node.op == "placeholder" and node.target not in fed
        if unfed or any(i in doomed for i in node.all_input_nodes):
            doomed[node] = None
    for node in reversed(doomed):
        gm.graph.erase_node(node)
    gm.recompile()


def _keepable(path: str, module_classes: Mapping[str, str]) -> bool:
    """A submodule may be kept whole unless it holds (or is) a stack of repeated blocks."""
    if not path:
        return False
    repeated = repeated_containers(module_classes)
    return not any(r == path or r.startswith(f"{path}.") for r in repeated)


def _symbolic_auto(
    context: _Context, leaves: Sequence[str]
) -> tuple[torch.fx.GraphModule, tuple[str, ...], list[str]] | Failure:
    """Symbolic trace, keeping failing submodules whole; the last failure if it gives up."""
    current = list(leaves)
    kept: list[tuple[str, Failure]] = []
    failure = Failure("", UNKNOWN_LINE, "too many modules to keep whole")
    for _ in range(_MAX_AUTO_LEAVES):
        try:
            gm = _symbolic(context, current)
        except _SymbolicFailure as exc:
            failure = exc.failure
            path = failure.module_path
            if path in current or not _keepable(path, context.module_classes):
                return failure
            current.append(path)
            kept.append((path, failure))
            continue
        return gm, tuple(current), kept_whole_notes(kept)
    return failure


# ----------------------------------------------------------------------- given method
def _trace_given(
    context: _Context, method: TraceMethod, leaves: tuple[str, ...]
) -> tuple[torch.fx.GraphModule, TraceMethod, tuple[str, ...], list[str]]:
    try:
        if method is TraceMethod.SYMBOLIC:
            return _symbolic(context, leaves), method, leaves, []
        if method is TraceMethod.EXPORT:
            return export_graph(context.model, context.fed, context.constants), method, (), []
    except _SymbolicFailure as exc:
        raise TraceError(given_message(method, exc.failure.describe())) from None
    except TraceError:
        raise
    except Exception as exc:
        raise TraceError(given_message(method, one_line(exc))) from None
    reference = None if _without_data(context.fed) else _eager_reference(context)
    chain = module_chain(context.model, context.fed, leaves, reference)
    if chain is None:
        raise TraceError(given_message(method, "the module chain differs from forward"))
    return chain, method, leaves, []
