"""Tensor-parallel stages: a stage's TP-plan parameters as DTensors over its TP group.

A rank whose stage has ``tp_degree`` > 1 holds the ``tp_rank``-th piece of every parameter
that ``ModelSpec.tp_plan`` splits (``torch.distributed.tensor``: a ``DeviceMesh`` over the
TP group, ``distribute_tensor`` with ``Shard``/``Replicate`` placements) and every other
parameter whole (``Replicate``). The stage is an fx graph (symbolic trace keeps
``nn.Linear`` modules, ``torch.export`` inlines them into aten ops on parameters), so no
module is swapped: the graph runs as it is under
``torch.distributed.tensor.experimental.implicit_replication`` and DTensor's own sharding
propagation inserts the collectives (shapes stay global, so views with baked head counts
stay right). Received tensors enter as ``Replicate`` DTensors (their gradients come back
whole), outputs leave as plain tensors. Every member of a TP group feeds the same
micro-batches and computes the same loss; its gradients are its shards' (``local_grad``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map
from typing_extensions import TypeIs

from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.plan import (
    Plan,
    TpRule,
    TpStyle,
    ZeroStage,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Placement

    from hplan.runtime.capture.stage import StageModule

# torch.distributed.tensor is imported where a TP stage is built (it pulls in sympy): a
# rank without tensor parallelism does not pay for it. Until then no tensor is a DTensor
# (:func:`is_dtensor`).

NEVER = "re-run `hplan solve` with --tensor-parallel never"

_COLWISE = frozenset({TpStyle.COLWISE, TpStyle.COLWISE_REP})


def tp_rank_groups(plan: Plan) -> tuple[tuple[int, ...], ...]:
    """The ranks of every TP group of two or more ranks, by first rank: the process groups
    every rank creates, in this order (``new_group`` is collective over the world)."""
    groups = {
        tuple(r.rank for r in plan.tp_group(rank.rank)) for rank in plan.ranks if rank.tp_degree > 1
    }
    return tuple(sorted(groups))


def check_tensor_parallel(plan: Plan) -> None:
    """Refuse what tensor-parallel stages do not run with yet, in one line naming the fix.

    Raises:
        ConfigError: a TP plan with ZeRO, optimizer offload or islands that train on their
            own, or a parameter tied between stages of two degrees.
    """
    if not plan.tensor_parallel:
        return
    sync = plan.training.sync
    refusals = (
        (plan.training.zero_stage is not ZeroStage.NONE, "ZeRO (training.zero_stage)"),
        (any(r.optimizer_offload for r in plan.ranks), "optimizer offload"),
        (sync is not None and sync.local, "islands that train on their own (local_sgd/async)"),
    )
    for refused, what in refusals:
        if refused:
            raise ConfigError(
                f"the plan has tensor-parallel stages and {what}, which do not run together "
                f"yet; {NEVER}"
            )
    _check_tied_degrees(plan)


def _check_tied_degrees(plan: Plan) -> None:
    """Raises ConfigError: a parameter (tied between units) is held by stages of two TP
    degrees (its shards, or its copies at a position the other stage lacks, would not be
    summed with the other stage's gradient)."""
    units = {u.name: u for u in plan.units}
    degrees: dict[str, set[int]] = {}
    for rank in plan.ranks:
        for unit in rank.units:
            for name in units[unit].params:
                degrees.setdefault(name, set()).add(rank.tp_degree)
    for name, found in degrees.items():
        if len(found) > 1:
            low, high = sorted(found)[:2]
            raise ConfigError(
                f"parameter {name} is tied between stages of tp_degree {low} and {high}; "
                f"put its units on stages of one degree, or {NEVER}"
            )


def style_of(rules: Sequence[TpRule], module_path: str) -> TpStyle | None:
    """The style of the first rule that names ``module_path`` (``TpRule.matches``), else
    None."""
    return next((rule.style for rule in rules if rule.matches(module_path)), None)


def placements(style: TpStyle | None, param_name: str, embedding: bool) -> tuple[Placement, ...]:
    """The placement of one parameter of a module split by ``style`` (None: whole).

    ``nn.Linear`` weights are ``(out_features, in_features)``: colwise splits dim 0 (and
    the bias with it), rowwise dim 1 (the bias stays whole). ``nn.Embedding`` weights are
    ``(num_embeddings, dim)``: split by features (dim 1) in either style. Split by the
    vocabulary (Hugging Face's ``embedding_rowwise``), DTensor's masked partial sum lost
    its mask between micro-batches here (torch 2.13: ``_MaskPartial._reduce_value``), so
    the embedding is split by features, which divides its bytes alike.
    """
    from torch.distributed.tensor import Replicate, Shard

    if style is None:
        return (Replicate(),)
    colwise = style in _COLWISE
    if embedding:  # by features either way: see below
        return (Shard(1),)
    if param_name == "bias":
        return (Shard(0),) if colwise else (Replicate(),)
    return (Shard(0),) if colwise else (Shard(1),)


def shard_stage(
    stage: StageModule, rules: Sequence[TpRule], mesh: DeviceMesh, embeddings: frozenset[str]
) -> None:
    """Make every parameter of ``stage`` a DTensor over ``mesh``, in place: those of the
    modules ``rules`` match (by canonical module path) split by their style, the others
    ``Replicate``. Tied parameters stay tied; gradient hooks move to the new parameters;
    each parameter gets a hook that lays its accumulated gradient out like itself (DTensor
    may leave it ``Replicate`` or ``Partial``).

    Args:
        embeddings: canonical module paths of the model's ``nn.Embedding`` modules.
    """
    gm = stage.graph_module
    _drop_metadata_asserts(gm)
    names = dict(stage._param_names)
    made: dict[int, nn.Parameter] = {}
    for module_path, module in list(gm.named_modules()):
        for local, param in list(module.named_parameters(recurse=False)):
            if id(param) not in made:
                full = f"{module_path}.{local}" if module_path else local
                owner, _, leaf = names.get(full, full).rpartition(".")
                where = placements(style_of(rules, owner), leaf, owner in embeddings)
                made[id(param)] = _distributed(param, mesh, where)
            setattr(module, local, made[id(param)])


def _distributed(param: nn.Parameter, mesh: DeviceMesh, where: Sequence[Placement]) -> nn.Parameter:
    from torch.distributed.tensor import distribute_tensor

    tensor = distribute_tensor(param.detach(), mesh, list(where))
    new = nn.Parameter(tensor, requires_grad=param.requires_grad)
    for hook in (param._backward_hooks or {}).values():
        new.register_hook(hook)
    if new.requires_grad:
        new.register_post_accumulate_grad_hook(_lay_out_grad)
    return new


def _lay_out_grad(param: Tensor) -> None:
    """Lay ``param.grad`` out as ``param`` (a local slice from ``Replicate``, a
    reduce-scatter from ``Partial``)."""
    grad = param.grad
    if is_dtensor(grad) and is_dtensor(param) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def _drop_metadata_asserts(gm: torch.fx.GraphModule) -> None:
    """Remove ``aten._assert_tensor_metadata`` nodes (``torch.export`` leaves them after
    ``.to()`` calls; DTensor has no sharding rule for them and they return nothing)."""
    target = torch.ops.aten._assert_tensor_metadata.default
    dropped = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is target and not node.users:
            gm.graph.erase_node(node)
            dropped = True
    if dropped:
        gm.recompile()


def embedding_paths(model: nn.Module) -> frozenset[str]:
    """Module paths of ``model``'s ``nn.Embedding`` modules."""
    return frozenset(n for n, m in model.named_modules() if isinstance(m, nn.Embedding))


@contextlib.contextmanager
def tp_compute(device: torch.device) -> Iterator[None]:
    """Run a TP stage's forwards and backwards: plain tensors meet DTensors as
    ``Replicate``; on a CPU, attention by its math kernel (DTensor has no sharding rule for
    the CPU flash kernel)."""
    from torch.distributed.tensor.experimental import implicit_replication

    with contextlib.ExitStack() as stack:
        stack.enter_context(implicit_replication())
        if device.type == "cpu":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        yield


def replicated_inputs(received: Mapping[str, Tensor], mesh: DeviceMesh) -> dict[str, Any]:
    """Received tensors as ``Replicate`` DTensors (differentiable: the gradient that comes
    back to each is whole and plain)."""
    from torch.distributed.tensor import DTensor, Replicate

    return {
        name: DTensor.from_local(t, mesh, [Replicate()], run_check=False)
        if t.is_floating_point()
        else t
        for name, t in received.items()
    }


def plain(value: Any) -> Any:
    """``value`` with every DTensor made a whole plain tensor (differentiable)."""
    return tree_map(lambda x: x.full_tensor() if is_dtensor(x) else x, value)


def is_dtensor(value: object) -> TypeIs[DTensor]:
    """Whether ``value`` is a DTensor (False while ``torch.distributed.tensor`` is not
    imported: then none is)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def local(tensor: Tensor) -> Tensor:
    """The local shard of a DTensor (a view), else ``tensor``."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def local_grad(param: nn.Parameter, grad: Tensor) -> Tensor:
    """The local shard of ``grad`` laid out as ``param`` (a DTensor's), else ``grad``."""
    if is_dtensor(grad) and is_dtensor(param) and grad.placements != param.placements:
        grad = grad.redistribute(param.device_mesh, param.placements)
    return local(grad)


def set_local_grad(param: nn.Parameter, grad: Tensor) -> None:
    """Set ``param.grad`` from its local shard ``grad``."""
    if is_dtensor(param):
        from torch.distributed.tensor import DTensor

        param.grad = DTensor.from_local(
            grad, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
        return
    param.grad = grad


def whole(tensor: Tensor) -> Tensor:
    """A DTensor gathered whole (collective over its mesh), else ``tensor``."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def is_sharded(param: Tensor) -> bool:
    """Whether ``param`` is split across its TP group."""
    return is_dtensor(param) and any(p.is_shard() for p in param.placements)
