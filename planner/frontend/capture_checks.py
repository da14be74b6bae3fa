"""What the capture refuses, in one line at solve time, before anything big is built.

The runtime trains the parameters the traced graph reads, splits every input along dim 0,
and builds each stage from the model as ``build_model`` returns it; a model that breaks one
of these would plan and then run wrongly or fail on the cluster. Each check here names the
input, module or parameter and the fix. The real-tensor fallback of the capture is checked
against this machine's available memory first, with the parameter and buffer bytes the fake
build already knows, so that a model too big to build here is refused rather than swapped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from hplan.runtime.capture.model_file import ModelFile
from hplan.runtime.capture.trace import TracedModel
from hplan.runtime.contract.errors import ModelFileError
from hplan.runtime.contract.quantities import format_bytes_pair

FALLBACK_STATE_FACTOR = 2.0
"""A real-tensor capture holds the parameters and buffers, and about as much again in the
trace's activations and the checks' working copies (a lower bound: activations grow with
the sequence)."""
FALLBACK_MARGIN_BYTES = 10**9
"""Left free besides (the interpreter, torch's own allocations)."""
_TRACER_MODULES = ("torch.fx", "torch.export", "torch._export", "torch._functorch")


def check_inputs(model_file: ModelFile, batches: Mapping[int, tuple[Any, Any]]) -> None:
    """Check that every tensor ``sample_batch`` gives as an input has the batch in dim 0.

    Args:
        batches: batch size -> ``(inputs, targets)`` as ``sample_batch`` returned them.

    Raises:
        ModelFileError: a tensor input is 0-dimensional, or its dim 0 is not the batch size
            (naming the input, its shapes and the fix).
    """
    for batch_size, (inputs, _) in sorted(batches.items()):
        for path, value in pytree.tree_flatten_with_path(inputs)[0]:
            if not isinstance(value, torch.Tensor):
                continue
            if value.dim() >= 1 and value.shape[0] == batch_size:
                continue
            raise ModelFileError(
                f"sample_batch({batch_size}) in {str(model_file.path)!r} gives input "
                f"inputs{pytree.keystr(path)} of shape {tuple(value.shape)}: its dim 0 is not "
                f"the batch size {batch_size}, so it does not grow with the batch size where "
                "hplan splits inputs; make dim 0 of every input the sample dimension "
                "(batch-first; transpose inside forward) and give values shared by all samples "
                "as defaults of forward or buffers of the model"
            )


def check_materialised(model_file: ModelFile, model: nn.Module) -> None:
    """Refuse lazy modules (``nn.LazyLinear``) whose parameters are not made yet.

    Raises:
        ModelFileError: naming the first such module and the fix.
    """
    for path, module in model.named_modules():
        has_uninitialized = getattr(module, "has_uninitialized_params", None)
        if callable(has_uninitialized) and has_uninitialized():
            raise ModelFileError(
                f"module {path or 'the root'!r} ({type(module).__name__}) of build_model() in "
                f"{str(model_file.path)!r} has no parameters yet (a lazy module); every rank "
                "builds its stage without running forward, so materialise it in build_model: "
                "run one forward on a sample batch before returning the model"
            )


class ParametersCreated:
    """Records every parameter registered on any module while it is active (a context
    manager around a forward: ``self.w = nn.Parameter(...)`` or ``nn.Linear(...)`` inside
    forward registers one; building does not run inside it)."""

    def __init__(self) -> None:
        self.created: list[str] = []
        self._handle: Any = None

    def __enter__(self) -> ParametersCreated:
        self._handle = register_module_parameter_registration_hook(self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()

    def _record(self, module: nn.Module, name: str, param: Any) -> None:
        """(Tracing builds modules of its own, plain ``nn.Module`` shells and graph
        modules that ``torch.export`` fills with the model's parameters: not the model's.)"""
        cls = type(module)
        if cls is nn.Module or cls.__module__.startswith(_TRACER_MODULES):
            return
        created = f"{cls.__name__}.{name}"
        if created not in self.created:
            self.created.append(created)


def check_no_parameters_created(model_file: ModelFile, created: ParametersCreated) -> None:
    """Refuse a model whose forward creates parameters (``self.w = nn.Parameter(...)`` or
    a module built in forward): each step would draw them anew and nothing would train
    them.

    Raises:
        ModelFileError: naming the parameters (module class and attribute) and the fix.
    """
    if created.created:
        raise ModelFileError(
            f"forward of the model of {str(model_file.path)!r} creates parameters "
            f"({_listed(created.created)}): they would be drawn anew every step and never "
            "trained; create the parameters and modules in __init__ (build_model) and only "
            "use them in forward"
        )


def unused_parameters(model: nn.Module, traced: TracedModel) -> list[str]:
    """Parameters that the traced graph never reads (neither through ``get_attr``
    nor inside a module it calls whole), by canonical name."""
    gm = traced.graph_module
    read: set[str] = set()
    called: list[str] = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            read.add(traced.param_names.get(str(node.target), str(node.target)))
        elif node.op == "call_module":
            called.append(f"{node.target}.")
    unused = []
    for name, _ in model.named_parameters():
        if name in read:
            continue
        if any(name.startswith(prefix) for prefix in called):
            continue
        unused.append(name)
    return unused


def check_all_parameters_used(model_file: ModelFile, model: nn.Module, traced: TracedModel) -> None:
    """Refuse parameters that forward never uses. Refused rather than trained with a note:
    no stage holds them (a stage holds what its part of the graph reads), so a checkpoint
    would lack them, and they would get no gradient anyway; deleting them in
    ``build_model`` says so in model.py.

    Raises:
        ModelFileError: naming them and the fix.
    """
    unused = unused_parameters(model, traced)
    if unused:
        raise ModelFileError(
            f"forward of the model of {str(model_file.path)!r} never uses the parameters "
            f"{_listed(unused)}, so no stage would hold them (nor train or save them); in "
            "build_model, delete the modules forward does not call (e.g. `model.pooler = "
            "None`) or use them in forward"
        )


def state_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each tensor once."""
    seen: dict[int, int] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def check_fallback_memory(
    model_file: ModelFile, model_state_bytes: int | None, reason: str, available: int | None
) -> None:
    """Refuse a real-tensor capture that cannot fit this machine's available memory.

    Args:
        model_state_bytes: the parameter and buffer bytes of the fake (or meta) build; None
            when no build ran (nothing is checked).
        reason: why the fake capture failed (quoted in the message).
        available: the available memory in bytes (:func:`available_memory_bytes`); None
            where unknown (nothing is checked).

    Raises:
        ModelFileError: the estimate (``FALLBACK_STATE_FACTOR`` times the state, plus
            ``FALLBACK_MARGIN_BYTES``) exceeds ``available``.
    """
    if model_state_bytes is None or available is None:
        return
    needed = FALLBACK_STATE_FACTOR * model_state_bytes + FALLBACK_MARGIN_BYTES
    if needed <= available:
        return
    needed_text, available_text = format_bytes_pair(needed, available)
    raise ModelFileError(
        f"the model of {str(model_file.path)!r} does not trace on fake tensors ({reason}), and "
        f"building it on real CPU tensors needs at least {needed_text} here (its parameters "
        f"and buffers are {format_bytes_pair(model_state_bytes, available)[0]}) while "
        f"{available_text} is available; capture a smaller configuration of it (fewer layers "
        "or experts, e.g. through the environment variables model.py reads), or capture on "
        "a machine with more memory (`hplan capture`, then `hplan solve --capture`)"
    )


def _listed(names: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    more = len(names) - limit
    return f"{shown} and {more} more" if more > 0 else shown
