"""Mixture-of-experts layers on fake tensors: grouped matmuls and data-dependent dispatches.

Two kinds of expert code do not run as they are on the capture's fake tensors:

- Hugging Face's default experts (``grouped_mm``) call ``aten._grouped_mm``, whose meta
  kernel accepts only bfloat16 although the CPU and CUDA kernels run float32 too;
  :class:`FakeGroupedMm` runs it in bfloat16 on fakes and returns the caller's dtype. Its
  FLOPs (and those of the float32 fallback op ``torch.export`` records) come from
  :func:`grouped_mm_flops`: the routed rows only, so top-k of E experts.
- A hand-written dispatch (router, ``topk``, a loop over an ``nn.ModuleList`` of experts that
  picks each expert's tokens by value) needs tensor values. Such a module is kept whole and
  runs on fakes under :func:`expected_routing`: the router, then ``top_k`` rows per token
  through one expert (experts of one class cost alike), weighted and summed: the cost of a
  balanced routing, without a real-tensor build (a load-balancing loss besides, where the
  graph unpacks one). Memory still counts every expert: the module's parameters are all of
  its node's.
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    is_fake,
)
from torch.fx.experimental.symbolic_shapes import (
    GuardOnDataDependentSymNode,
    free_unbacked_symbols,
)
from torch.utils._python_dispatch import TorchDispatchMode

NEEDS_VALUES = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    GuardOnDataDependentSymNode,
)
"""What fake tensors raise for code that picks tensors by their values."""

TOP_K_ATTRIBUTES = ("top_k", "num_experts_per_tok", "topk", "k", "num_selected_experts")
"""Attributes of an experts module that may state how many experts each token goes to."""

_GROUPED_MM = torch.ops.aten._grouped_mm.default
_FAKE_GROUPED_MM_DTYPE = torch.bfloat16


# ----------------------------------------------------------------------- grouped matmul
def grouped_mm_flops(
    a_shape: Sequence[int], b_shape: Sequence[int], *args: Any, out_shape: Any = None, **_: Any
) -> int:
    """Forward FLOPs of a grouped matmul: 2 per multiply-add of the rows each group owns.

    ``a`` ``(rows, k)`` by ``b`` ``(groups, k, n)`` (rows split among the groups, Hugging
    Face's experts) gives ``2 * rows * k * n``; ``(groups, m, k)`` by ``(groups, k, n)``
    gives ``2 * groups * m * k * n``; ``(m, k)`` by ``(k, n)`` with ``k`` split among the
    groups (a weight gradient) gives ``2 * m * k * n``. Source: ``torch._grouped_mm``'s
    documented layouts; the count as ``torch.utils.flop_counter.mm_flop``'s.
    """
    inner = int(a_shape[-1])
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * int(a_shape[0]) * inner * int(b_shape[-1])
    return 2 * math.prod(int(d) for d in out_shape) * inner


def moe_flop_formulas() -> dict[Any, Any]:
    """FLOP formulas for ``FlopCounterMode(custom_mapping=...)``: ``aten._grouped_mm`` and,
    where transformers is loaded, its float32 fallback op (``(input, weight, offs)``, the
    same layouts)."""
    formulas: dict[Any, Any] = {torch.ops.aten._grouped_mm: grouped_mm_flops}
    with contextlib.suppress(AttributeError, RuntimeError):
        formulas[torch.ops.transformers.grouped_mm_fallback] = grouped_mm_flops
    return formulas


class FakeGroupedMm(TorchDispatchMode):
    """Runs ``aten._grouped_mm`` of fake float32/float16 tensors in bfloat16 (the only dtype
    its meta kernel takes) and returns the output in the input's dtype; on real tensors
    and other ops it changes nothing. Shapes and strides are those of the real kernel."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not _GROUPED_MM or not _fake_non_bf16(args):
            return func(*args, **kwargs)
        dtype = args[0].dtype
        cast = [_to_bf16(a) for a in args]
        out = func(*cast, **{k: _to_bf16(v) for k, v in kwargs.items()})
        return out.to(dtype)


def _fake_non_bf16(args: Sequence[Any]) -> bool:
    mats = [a for a in args[:2] if isinstance(a, torch.Tensor)]
    return all(is_fake(m) and m.is_floating_point() for m in mats) and any(
        m.dtype != _FAKE_GROUPED_MM_DTYPE for m in mats
    )


def _to_bf16(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(_FAKE_GROUPED_MM_DTYPE)
    return value


def eager_hf_experts(model: nn.Module) -> tuple[str, ...]:
    """Paths of the modules that run Hugging Face's ``eager`` experts implementation (a loop
    over the experts that picks tokens by value: ``torch.export``, which traces Hugging Face
    models, cannot trace it, on fake tensors or real ones)."""
    return tuple(
        path
        for path, module in model.named_modules()
        if getattr(getattr(module, "config", None), "_experts_implementation", None) == "eager"
        and any(p.dim() == 3 for p in module.parameters(recurse=False))
    )


def eager_experts_message(model_name: str, paths: Sequence[str]) -> str:
    """The one-line refusal of a model whose experts run Hugging Face's eager loop."""
    return (
        f"cannot trace {model_name}: its experts ({paths[0]!r}, {len(paths)} in all) run "
        "transformers' 'eager' experts implementation, a loop that picks each expert's "
        "tokens by value, which torch.export cannot trace; build the model with "
        "experts_implementation='grouped_mm' (transformers' default) or leave it unset"
    )


# ----------------------------------------------------------------------- expert dispatch
@dataclass(frozen=True)
class ExpertDispatch:
    """A module that routes each token to ``top_k`` of its ``num_experts`` experts."""

    path: str
    """Module path of the dispatching module (kept whole)."""
    router: str
    """Its child ``nn.Linear`` with one output per expert."""
    experts: str
    """Its child ``nn.ModuleList`` of ``num_experts`` modules of one class."""
    num_experts: int
    top_k: int | None = None
    """Experts per token; None until known (an attribute of the module, or the ``k`` of
    the first ``topk`` its forward calls)."""
    num_outputs: int = 1
    """1: forward returns the token states; n > 1: a tuple of them and n - 1 auxiliary
    losses (what the traced graph unpacks)."""


def find_expert_dispatches(model: nn.Module) -> tuple[ExpertDispatch, ...]:
    """The modules of ``model`` shaped like an expert dispatch: a child ``nn.ModuleList`` of
    >= 2 modules of one class with parameters (the experts), a child ``nn.Linear`` with one
    output per expert (the router), and no other child with parameters."""
    found = []
    for path, module in model.named_modules():
        dispatch = _as_dispatch(path, module)
        if dispatch is not None:
            found.append(dispatch)
    return tuple(found)


def _as_dispatch(path: str, module: nn.Module) -> ExpertDispatch | None:
    children = dict(module.named_children())
    lists = [n for n, c in children.items() if _is_expert_list(c)]
    if len(lists) != 1:
        return None
    num_experts = len(list(children[lists[0]].children()))
    routers = [
        n for n, c in children.items() if isinstance(c, nn.Linear) and c.out_features == num_experts
    ]
    others = [c for n, c in children.items() if n not in (*lists, *routers[:1])]
    if len(routers) != 1 or any(any(True for _ in c.parameters()) for c in others):
        return None
    return ExpertDispatch(
        path=path,
        router=routers[0],
        experts=lists[0],
        num_experts=num_experts,
        top_k=_top_k_attribute(module, num_experts),
    )


def _is_expert_list(module: nn.Module) -> bool:
    if not isinstance(module, nn.ModuleList) or len(module) < 2:
        return False
    classes = {type(m) for m in module}
    return len(classes) == 1 and any(True for _ in module[0].parameters())


def _top_k_attribute(module: nn.Module, num_experts: int) -> int | None:
    for name in TOP_K_ATTRIBUTES:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= num_experts:
            return value
    return None


class _Probe(TorchDispatchMode):
    """Records the ``k`` of every ``aten.topk`` call, and whether an op made a tensor whose
    shape depends on tensor values (fake tensors give it an unbacked size)."""

    def __init__(self) -> None:
        super().__init__()
        self.ks: list[int] = []
        self.value_shapes = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.topk.default:
            self.ks.append(int(args[1]))
        out = func(*args, **(kwargs or {}))
        if not self.value_shapes:
            self.value_shapes = any(
                free_unbacked_symbols(t.shape) for t in pytree.tree_leaves(out) if _is_tensor(t)
            )
        return out


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


class UnknownTopKError(RuntimeError):
    """An expert layer's experts per token could not be found (no attribute, no topk)."""


class ExpectedRouting:
    """The dispatch modules of one model run as a balanced routing would (see the module
    docstring), while :func:`expected_routing` is active. :attr:`routed` holds the ones
    that ran so, with their ``top_k``."""

    def __init__(self, model: nn.Module, dispatches: Sequence[ExpertDispatch], probe: bool):
        self.model = model
        self.probe = probe
        self.routed: dict[str, ExpertDispatch] = {}

    def forward(self, dispatch: ExpertDispatch, original: Any, *args: Any, **kwargs: Any) -> Any:
        """The patched forward. On a probe, the module's own forward first: kept when its
        shapes do not depend on values; else routed, with the ``k`` of its first ``topk``
        unless an attribute gave one (:class:`UnknownTopKError` when neither did)."""
        if not self.probe:
            return self._route(dispatch, *args, **kwargs)
        probe = _Probe()
        try:
            with probe:
                out = original(*args, **kwargs)
        except NEEDS_VALUES:
            probe.value_shapes = True
        if not probe.value_shapes:
            return out
        top_k = dispatch.top_k or next(iter(probe.ks), None)
        if top_k is None:
            raise UnknownTopKError(
                f"expert layer {dispatch.path!r} picks tokens by value and calls no topk"
            )
        self.routed[dispatch.path] = replace(dispatch, top_k=top_k)
        return self._route(self.routed[dispatch.path], *args, **kwargs)

    def _route(self, dispatch: ExpertDispatch, hidden: torch.Tensor, *_: Any, **__: Any) -> Any:
        module = self.model.get_submodule(dispatch.path)
        router = module.get_submodule(dispatch.router)
        expert = module.get_submodule(f"{dispatch.experts}.0")
        assert dispatch.top_k is not None
        out = routed_output(hidden, router, expert, dispatch.top_k)
        if dispatch.num_outputs == 1:
            return out
        aux = balance_loss(router(hidden.reshape(-1, hidden.shape[-1])), dispatch.top_k)
        return (out, *[aux] * (dispatch.num_outputs - 1))


def routed_output(
    hidden: torch.Tensor, router: nn.Module, expert: nn.Module, top_k: int
) -> torch.Tensor:
    """What a top-``top_k`` expert layer computes under a balanced routing, op for op in cost.

    Args:
        hidden: ``(..., hidden)`` token states.
        router: maps ``(tokens, hidden)`` to ``(tokens, num_experts)`` logits.
        expert: one expert, ``(rows, hidden) -> (rows, hidden_out)``.
        top_k: experts per token.

    Returns:
        ``(..., hidden_out)``: each token's ``top_k`` expert outputs (all through ``expert``:
        the experts of a layer have one shape), weighted by the router's softmax.
    """
    tokens = hidden.reshape(-1, hidden.shape[-1])
    weights, _ = F.softmax(router(tokens), dim=-1).topk(top_k, dim=-1)
    rows = expert(tokens.repeat_interleave(top_k, dim=0))
    mixed = (rows.view(tokens.shape[0], top_k, -1) * weights.unsqueeze(-1)).sum(dim=1)
    return mixed.view(*hidden.shape[:-1], mixed.shape[-1])


def balance_loss(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The load-balancing loss of a router's ``(tokens, num_experts)`` logits: ``num_experts
    * sum_i f_i * P_i``, ``f_i`` the share of routed slots expert ``i`` gets, ``P_i`` its
    mean probability (Fedus et al., Switch Transformers (2021), eq. 4). A 0-dim tensor."""
    probs = F.softmax(logits, dim=-1)
    chosen = probs.topk(top_k, dim=-1).indices
    slots = torch.zeros_like(probs).scatter(1, chosen, 1.0)
    return probs.shape[-1] * (slots.mean(dim=0) / top_k * probs.mean(dim=0)).sum()


def with_output_arity(
    dispatches: Sequence[ExpertDispatch], gm: torch.fx.GraphModule
) -> tuple[ExpertDispatch, ...]:
    """``dispatches`` with :attr:`ExpertDispatch.num_outputs` read from ``gm``: how many
    items the graph takes from the module's call (1 when it uses the result whole)."""
    arity: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        items = [u.args[1] for u in node.users if u.target is operator.getitem]
        whole = len(items) < len(node.users) or not all(isinstance(i, int) for i in items)
        arity[str(node.target)] = 1 if whole else max(items) + 1
    return tuple(replace(d, num_outputs=arity.get(d.path, 1)) for d in dispatches)


@contextlib.contextmanager
def expected_routing(
    model: nn.Module, dispatches: Sequence[ExpertDispatch], *, probe: bool = False
) -> Iterator[ExpectedRouting]:
    """Run the ``dispatches`` of ``model`` as :class:`ExpectedRouting` says, and
    ``aten._grouped_mm`` under :class:`FakeGroupedMm`, inside the block.

    Args:
        probe: False: every dispatch is routed (their ``top_k`` known); True: each runs its
            own forward first, and is routed only when that needs tensor values.
    """
    routing = ExpectedRouting(model, dispatches, probe)
    patched = []
    for dispatch in dispatches:
        module = model.get_submodule(dispatch.path)
        original = module.forward
        module.forward = functools.partial(routing.forward, dispatch, original)
        patched.append(module)
    try:
        with FakeGroupedMm():
            yield routing
    finally:
        for module in patched:
            del module.forward


def dispatch_notes(routed: Mapping[str, ExpertDispatch]) -> tuple[str, ...]:
    """One note naming the dispatch modules costed by a balanced routing."""
    if not routed:
        return ()
    first = next(iter(routed.values()))
    paths = list(routed)
    named = (
        ", ".join(repr(p) for p in paths) if len(paths) <= 3 else f"{paths[0]!r} … ({len(paths)})"
    )
    return (
        f"expert layers {named} pick tokens by value: kept whole and costed as a balanced "
        f"routing (top-{first.top_k} of {first.num_experts} experts per token; memory holds "
        "every expert)",
    )
