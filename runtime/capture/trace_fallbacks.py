"""The tracing fallbacks of ``trace.py``: torch.export and module boundaries.

Both return a torch.fx GraphModule whose placeholders are the fed inputs, in
forward-signature order, and run user code inside ``preserved`` (the model's buffers and the
RNG state are restored afterwards).

- ``export_graph``: ``torch.export`` (non-strict, dim 0 of every input dynamic); its graph
  carries ``nn_module_stack``. Raises when export fixes the batch size, or unrolls a Python
  loop (``loop_guard.py``).
- ``module_chain``: the model's child modules in registration order (containers
  expanded), run eagerly one after another; accepted only when it reproduces the eager
  forward on the example inputs (``outputs_match``).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from hplan.runtime.capture.graph_inputs import forward_kwargs
from hplan.runtime.capture.loop_guard import LoopGuard
from hplan.runtime.contract.errors import TraceError

_EXPORT_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch._export", "torch.export")


@contextlib.contextmanager
def preserved(model: nn.Module) -> Iterator[None]:
    """Run user code without leaving traces: buffers and RNG state are restored."""
    saved = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            buffers = dict(model.named_buffers())
            with torch.no_grad():
                for name, value in saved.items():
                    buffers[name].copy_(value)


# ----------------------------------------------------------------------- torch.export
def export_graph(
    model: nn.Module,
    fed: Mapping[str, Any],
    constants: Mapping[str, Any],
    budget: LoopGuard | None = None,
) -> torch.fx.GraphModule:
    """Trace ``model`` with ``torch.export`` (non-strict, dim 0 of every input dynamic).

    Args:
        model: the model; its buffers and the RNG state are restored afterwards.
        fed: {graph input name: tensor}, the graph inputs, in forward order
            (``parameter.key`` for a parameter fed as a dict of tensors).
        constants: {forward parameter name: value} of the parameters not fed; values that
            differ from the parameter's default are passed to export (and specialised).
        budget: stops export when it unrolls a loop (None: no guard).

    Returns:
        The exported graph: one placeholder per ``fed`` entry, the input-guard call
        removed, device constants replaced by the device of the first input.

    Raises:
        TraceError: export kept a constant as a graph input.
        TraceTooLongError: ``budget`` found a loop unrolled.
        Exception: whatever ``torch.export`` raises, or RuntimeError when it fixed the
            batch size (the caller turns these into a note or a TraceError).
    """
    signature = inspect.signature(model.forward).parameters
    extra = {
        name: value
        for name, value in constants.items()
        if value is not signature[name].default and value is not None
    }
    given = {**forward_kwargs(fed), **extra}
    ordered = {name: given[name] for name in signature if name in given}
    dynamic = {name: _batch_dynamic(value) for name, value in ordered.items()}
    with preserved(model), _quiet_export_logs(), budget or contextlib.nullcontext():
        program = torch.export.export(model, (), ordered, dynamic_shapes=dynamic, strict=False)
    names = _leaf_names(ordered)
    gm = program.module()
    assert isinstance(gm, torch.fx.GraphModule)
    _check_batch_dynamic(gm, names)
    _drop_export_extras(gm, names, set(fed))
    _devices_from_input(gm)
    return gm


def _batch_dynamic(value: Any) -> Any:
    """export's dynamic-shapes entry for one argument: dim 0 of every tensor in it."""
    if isinstance(value, Mapping):
        return {key: _batch_dynamic(item) for key, item in value.items()}
    if isinstance(value, torch.Tensor) and value.dim() >= 1:
        return {0: torch.export.Dim.AUTO}
    return None


def _leaf_names(arguments: Mapping[str, Any]) -> list[str]:
    """The name of each of export's placeholders: each argument's, ``parameter.key`` for the
    tensors of a dict (in its order, as export flattens it)."""
    names: list[str] = []
    for name, value in arguments.items():
        if isinstance(value, Mapping):
            names.extend(_leaf_names({f"{name}.{k}": v for k, v in value.items()}))
        else:
            names.append(name)
    return names


def _devices_from_input(gm: torch.fx.GraphModule) -> None:
    """Replace the device constants export bakes in (``arange(..., device=cpu)``) by the
    device of the first graph input, so a stage moved to another device still runs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    users = [n for n in gm.graph.nodes if n.op == "call_function" and _has_device(n)]
    if not placeholders or not users:
        return
    with gm.graph.inserting_after(placeholders[-1]):
        device = gm.graph.call_function(getattr, (placeholders[0], "device"))

    def swap(value: Any) -> Any:
        return device if isinstance(value, torch.device) else value

    for node in users:
        node.args = torch.fx.node.map_aggregate(node.args, swap)
        node.kwargs = torch.fx.node.map_aggregate(node.kwargs, swap)
    gm.recompile()


def _has_device(node: torch.fx.Node) -> bool:
    values = pytree.tree_leaves((node.args, node.kwargs))
    return any(isinstance(v, torch.device) for v in values)


@contextlib.contextmanager
def _quiet_export_logs() -> Iterator[None]:
    """torch.export logs and prints (to stderr) whole graphs when it gives up; hplan
    reports one line instead."""
    loggers = [logging.getLogger(n) for n in _EXPORT_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _check_batch_dynamic(gm: torch.fx.GraphModule, names: list[str]) -> None:
    """Raise when export fixed the batch size (e.g. ``len(x)``): the graph would be wrong
    for every other micro-batch size."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, names, strict=True):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        if is_concrete_int(value.shape[0]):
            raise RuntimeError(
                f"torch.export fixed the batch size of input {name!r} to {int(value.shape[0])} "
                "(a Python int from the batch dimension, e.g. len(x))"
            )


def _drop_export_extras(gm: torch.fx.GraphModule, names: list[str], fed: set[str]) -> None:
    """Drop the input-guard call and the placeholders of specialised constants.

    Args:
        names: the forward parameter of each placeholder, in graph order.
    """
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, names, strict=True):
        if name in fed:
            continue
        if node.users:
            raise TraceError(
                f"torch.export kept constant input {name!r} as a graph input; "
                "feed it as a tensor or leave it at its default"
            )
        gm.graph.erase_node(node)
    codegen = gm.graph._codegen
    if isinstance(codegen, torch.fx.graph._PyTreeCodeGen):  # called with the fed inputs only
        kept = [name.replace(".", "_") for name in names if name in fed]
        in_spec = pytree.tree_structure(((), dict.fromkeys(kept, 0)))
        codegen.pytree_info = codegen.pytree_info._replace(orig_args=kept, in_spec=in_spec)
    gm.recompile()


# ----------------------------------------------------------------------- module chain
def chain_paths(model: nn.Module) -> list[str]:
    """Child module paths in registration order, containers expanded."""
    paths: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
                visit(f"{path}.", child)
            else:
                paths.append(path)

    visit("", model)
    return paths


def module_chain(
    model: nn.Module, fed: Mapping[str, Any], paths: Sequence[str], reference: Any
) -> torch.fx.GraphModule | None:
    """The graph that runs the modules at ``paths`` one after another on the ``fed`` inputs.

    Args:
        model: the model that owns the modules.
        fed: {forward parameter name: tensor}, the graph inputs, in forward order.
        paths: module paths, in the order they run (see ``chain_paths``).
        reference: the eager forward's output on ``fed``; None to accept the chain unrun.

    Returns:
        The chain graph, or None when it is empty, fails, or differs from ``reference``.
    """
    if not paths:
        return None
    graph = torch.fx.Graph()
    value: Any = tuple(graph.placeholder(name) for name in fed)
    for path in paths:
        args = value if isinstance(value, tuple) else (value,)
        value = graph.call_module(path, args)
    graph.output(value)
    gm = torch.fx.GraphModule(model, graph, type(model).__name__)
    if reference is None:
        return gm
    try:
        with preserved(model), torch.no_grad():
            out = gm(*fed.values())
    except Exception:
        return None
    return gm if outputs_match(out, reference) else None


def outputs_match(a: Any, b: Any, *, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    """Same pytree structure, close tensors, equal other leaves; meta tensors never match."""
    flat_a, spec_a = pytree.tree_flatten(a)
    flat_b, spec_b = pytree.tree_flatten(b)
    if spec_a != spec_b:
        return False
    for x, y in zip(flat_a, flat_b, strict=True):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if not isinstance(x, torch.Tensor):
            if x != y:
                return False
            continue
        if x.is_meta or y.is_meta or x.shape != y.shape or x.dtype != y.dtype:
            return False
        if not torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
            return False
    return True
