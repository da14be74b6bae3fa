"""The model's tensor-parallel plan: read at capture and matched to the model's modules.

Which modules a TP group splits comes from the model itself (``TpRule``): ``TP_PLAN`` in
model.py, else a Hugging Face model's own plan (``config.base_model_tp_plan``, whose
patterns are relative to the base model, and the model class's ``_tp_plan``, e.g. its LM
head). Every pattern must match modules, each an ``nn.Linear`` or ``nn.Embedding``, under a
style of ``TpStyle`` (transformers' other names for the same splits are read as those).
Otherwise tensor parallelism is not offered, and :attr:`TpModules.refusal` says why in one
line. :func:`max_degree` finds the largest degree that divides every dimension the plan
splits, attention heads included.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from torch import nn

from hplan.planner.frontend.graph import CostGraph
from hplan.runtime.capture.model_file import ModelFile
from hplan.runtime.contract.plan import TP_DEGREES, TpRule, TpStyle

HF_STYLE_ALIASES: Final[Mapping[str, TpStyle]] = {
    "colwise_gather_output": TpStyle.COLWISE_REP,
    "rowwise_split_input": TpStyle.ROWWISE_REP,
    "embedding_rowwise": TpStyle.ROWWISE_REP,
}
"""transformers' (5.x) names of splits ``TpStyle`` has under another name
(``transformers/distributed/tensor_parallel.py``: ``colwise_gather_output`` is its
``colwise_rep``, ``rowwise_split_input`` its ``rowwise_rep``, ``embedding_rowwise`` an
embedding split by vocabulary with its partial lookups summed)."""

NO_PLAN: Final = (
    "the model has no TP_PLAN in its model file and no Hugging Face base_model_tp_plan; "
    "add a TP_PLAN (README: What you give it) to offer tensor parallelism"
)
"""The refusal of a model without a tensor-parallel plan."""

SPLIT_MODULES: Final = (nn.Linear, nn.Embedding)
"""The module types a style splits (torch's ``ColwiseParallel``/``RowwiseParallel``)."""

_VIEWS: Final = frozenset({"view", "reshape", "unflatten", "_unsafe_view"})
"""Names of the ops that may split a feature dimension into heads (the last component of
a method's or function's name, the one before the overload of an aten op's)."""


@dataclass(frozen=True)
class TpModules:
    """A model's tensor-parallel plan and the modules it splits."""

    rules: tuple[TpRule, ...] = ()
    """The plan as declared (``ModelSpec.tp_plan``); empty when refused."""
    modules: Mapping[str, TpStyle] = field(default_factory=dict)
    """Module path (``named_modules()``) -> its style, for every module a rule matches."""
    from_hugging_face: bool = False
    """The plan is the Hugging Face model's own (its config names the attention heads)."""
    refusal: str | None = NO_PLAN
    """Why tensor parallelism is not offered, one line; None when it is."""


def read_tp_plan(model_file: ModelFile, model: nn.Module) -> TpModules:
    """The model's tensor-parallel plan matched to its modules (see the module docstring).

    Returns:
        The rules and modules, or a refusal naming the style, pattern or module that
        cannot be split (``refusal``; the rules and modules are then empty).
    """
    if model_file.tp_plan is not None:
        return _resolve(model_file.tp_plan, model, hugging_face=False)
    hf_plan = hf_tp_plan(model)
    if not hf_plan:
        return TpModules()
    return _resolve(tuple(hf_plan.items()), model, hugging_face=True)


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """A Hugging Face model's tensor-parallel plan, patterns as ``named_modules()`` names
    them: its config's ``base_model_tp_plan`` prefixed with ``base_model_prefix`` when the
    model wraps its base model (a ``*ForCausalLM``), and its class's ``_tp_plan``. Where
    transformers has merged the plan on the instance (``_tp_plan`` after ``__init__``, with
    its submodels' plans; 5.x adds the input embedding's vocabulary split), that plan
    first. Empty: none."""
    config = getattr(model, "config", None)
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    own = dict(getattr(type(model), "_tp_plan", None) or {})
    prefix = ""
    if getattr(model, "base_model", model) is not model:
        prefix = f"{getattr(model, 'base_model_prefix', '')}.".lstrip(".")
    derived = {f"{prefix}{pattern}": style for pattern, style in base.items()} | own
    merged = getattr(model, "_tp_plan", None)
    merged = dict(merged) if isinstance(merged, dict) else {}
    return merged | {k: v for k, v in derived.items() if k not in merged}


def _resolve(
    entries: tuple[tuple[str, str], ...], model: nn.Module, *, hugging_face: bool
) -> TpModules:
    """Match each entry's pattern to the model's modules; a refusal at the first entry
    hplan cannot split."""
    where, fix = (
        ("the Hugging Face model's TP plan", "set a TP_PLAN in model.py to split other modules")
        if hugging_face
        else ("TP_PLAN", "fix TP_PLAN in model.py")
    )
    if not entries:
        return TpModules(refusal=f"{where} is empty; {fix} to offer tensor parallelism")
    named = dict(model.named_modules())
    rules: list[TpRule] = []
    modules: dict[str, TpStyle] = {}
    for pattern, style_name in entries:
        style = _style(style_name)
        if style is None:
            valid = ", ".join(TpStyle)
            return TpModules(
                refusal=f"{where} splits {pattern!r} as {style_name!r}, a style hplan does not "
                f"run (it runs {valid}); tensor parallelism is not offered"
            )
        regex = pattern_regex(pattern)
        matched = [name for name in named if name and regex.fullmatch(name)]
        if not matched:
            return TpModules(
                refusal=f"{where} names {pattern!r}, which matches no module of the model; {fix}"
            )
        for name in matched:
            refusal = _unsplittable(where, name, named[name], style, modules)
            if refusal is not None:
                return TpModules(refusal=refusal)
            modules[name] = style
        rules.append(TpRule(pattern=pattern, style=style))
    return TpModules(
        rules=tuple(rules), modules=modules, from_hugging_face=hugging_face, refusal=None
    )


def _style(name: str) -> TpStyle | None:
    if name in HF_STYLE_ALIASES:
        return HF_STYLE_ALIASES[name]
    try:
        return TpStyle(name)
    except ValueError:
        return None


def _unsplittable(
    where: str, name: str, module: nn.Module, style: TpStyle, found: Mapping[str, TpStyle]
) -> str | None:
    if not isinstance(module, SPLIT_MODULES):
        return (
            f"{where} splits {name!r} ({style}), a {type(module).__name__}; tensor "
            "parallelism splits nn.Linear and nn.Embedding modules only"
        )
    if name in found:
        return f"{where} names module {name!r} twice ({found[name]}, {style}); name it once"
    return None


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """A plan pattern as a regex over module paths: ``*`` is one path component."""
    parts = ("[^.]+" if part == "*" else re.escape(part) for part in pattern.split("."))
    return re.compile(r"\.".join(parts))


# ----------------------------------------------------------------------- the degree
def split_dimensions(
    model: nn.Module, plan: TpModules, graph: CostGraph, module_nodes: Mapping[str, list[str]]
) -> dict[str, int]:
    """Every dimension the plan splits, named for a message -> its size: the out features
    of a column-split ``nn.Linear`` (the columns of an ``nn.Embedding``), the in features
    of a row-split one (the rows, i.e. the vocabulary, of an embedding), and the attention
    heads: the Hugging Face config's ``num_attention_heads`` and ``num_key_value_heads``
    for its own plan, and for any plan the heads a view or reshape makes of a column-split
    output (``(..., heads * head_dim) -> (..., heads, head_dim)``). A model that splits
    heads another way is checked on its features only."""
    dims: dict[str, int] = {}
    for name, style in plan.modules.items():
        module = model.get_submodule(name)
        what, size = _split_dimension(module, style)
        dims[f"{name} {what}"] = size
    if plan.from_hugging_face:
        dims.update(_config_heads(model))
    for name, style in plan.modules.items():
        if style is TpStyle.COLWISE:
            for view, heads in _view_heads(graph, module_nodes.get(name, [])):
                dims[f"the heads of {view} (from {name})"] = heads
    return dims


def _split_dimension(module: nn.Module, style: TpStyle) -> tuple[str, int]:
    columns = style in (TpStyle.COLWISE, TpStyle.COLWISE_REP)
    if isinstance(module, nn.Embedding):
        return ("columns", module.embedding_dim) if columns else ("rows", module.num_embeddings)
    assert isinstance(module, nn.Linear)
    return ("out features", module.out_features) if columns else ("in features", module.in_features)


def _config_heads(model: nn.Module) -> Iterator[tuple[str, int]]:
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attribute in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(text, attribute, None)
        if isinstance(value, int) and value > 0:
            yield attribute, value


def _view_heads(graph: CostGraph, nodes: list[str]) -> Iterator[tuple[str, int]]:
    """(view node, heads) for each view that splits a module output's last dimension in
    two, read from the per-sample tensor shapes of the cost graph."""
    for name in nodes:
        spec = graph.nodes[name]["tensor"]
        if spec is None:
            continue
        for user in graph.successors(name):
            data = graph.nodes[user]
            out = data["tensor"]
            if out is None or not _is_view(data["target"]):
                continue
            kept = len(spec.shape) - 1
            if (
                len(out.shape) == kept + 2
                and out.shape[:kept] == spec.shape[:kept]
                and out.shape[kept] * out.shape[kept + 1] == spec.shape[kept]
            ):
                yield user, out.shape[kept]


def _is_view(target: str) -> bool:
    """``view``, ``torch.reshape``, ``aten.view.default``, ``aten::reshape``: a view op."""
    parts = target.replace("::", ".").split(".")
    return any(part in _VIEWS for part in parts[-2:])


def max_degree(dims: Mapping[str, int]) -> tuple[int, str | None]:
    """The largest of ``TP_DEGREES`` dividing every dimension, and when that is 1 the
    refusal naming a dimension 2 does not divide."""
    degree = max(d for d in TP_DEGREES if all(size % d == 0 for size in dims.values()))
    if degree > 1:
        return degree, None
    odd = next(f"{what} {size}" for what, size in dims.items() if size % 2)
    degrees = ", ".join(str(d) for d in TP_DEGREES if d > 1)
    return 1, (
        f"no tensor-parallel degree ({degrees}) divides every dimension the TP plan splits "
        f"({odd}); tensor parallelism is not offered"
    )
