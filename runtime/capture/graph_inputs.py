"""Inputs as graph inputs: a dict of per-sample tensors becomes one graph input per tensor.

diffusers' UNets take ``added_cond_kwargs={"text_embeds": ..., "time_ids": ...}``: a dict
whose tensors each hold one row per sample. A plan names every graph input, splits each
along dim 0 and sends each to the stages that read it, so the dict's tensors are graph
inputs of their own, named ``parameter.key``; an eager call of ``forward`` gets the dict
back (:func:`forward_kwargs`), and a trace gives forward a dict of its placeholders.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hplan.runtime.contract.errors import ModelFileError


def flat_input(name: str, value: Any) -> dict[str, torch.Tensor]:
    """One input as ``{graph input name: tensor}``: a tensor as itself, a dict of tensors
    one entry per tensor (``name.key``, nested dicts ``name.key.key``), None as nothing.

    Raises:
        ModelFileError: a value that is neither, or a dict key that is no identifier.
    """
    if value is None:
        return {}
    if isinstance(value, torch.Tensor):
        return {name: value}
    if not isinstance(value, Mapping) or not value:
        raise ModelFileError(
            f"input {name!r} is a {type(value).__name__}, not a tensor or a dict of tensors; "
            "return tensors (or dicts of tensors) whose dim 0 is the batch, and give "
            "settings that are the same for every batch as defaults of forward instead"
        )
    flat: dict[str, torch.Tensor] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ModelFileError(
                f"input {name!r} is a dict with key {key!r}; hplan feeds dicts whose keys "
                "are Python identifiers (like 'text_embeds'): rename the key"
            )
        flat.update(flat_input(f"{name}.{key}", item))
    return flat


def forward_kwargs(bound: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments of an eager ``forward`` call from graph inputs (``trace.
    bind_inputs``): ``parameter.key`` entries nested back into dicts."""
    kwargs: dict[str, Any] = {}
    for name, value in bound.items():
        *parents, leaf = name.split(".")
        level = kwargs
        for parent in parents:
            level = level.setdefault(parent, {})
        level[leaf] = value
    return kwargs


def dict_inputs(fed: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """Forward parameters fed as dicts of tensors -> their graph input names."""
    found: dict[str, tuple[str, ...]] = {}
    for name in fed:
        if "." in name:
            parameter = name.split(".")[0]
            found[parameter] = (*found.get(parameter, ()), name)
    return found


def placeholder_target(name: str) -> str:
    """The Python argument name of graph input ``name`` (``parameter.key`` ->
    ``parameter_key``)."""
    return name.replace(".", "_")
