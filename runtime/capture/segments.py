"""Selective recomputation inside a stage: run some partition units under
``torch.utils.checkpoint`` (mechanism only: the plan names the units).

A stage's graph holds the nodes of its units in graph order. :func:`split_segments` cuts
that order into segments: each maximal run of one recomputed unit's nodes is a segment that
runs under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` (autograd keeps only
its inputs; the backward runs its forward again, with the RNG state of the first run, so
dropout masks repeat); every other run is kept as usual. ``get_attr`` nodes and the copies
of other stages' replicable nodes belong to no unit of the stage and join the segment they
sit in. :func:`run_segments` interprets the graph segment by segment; attributes are read
from the stage's module at every call (parameters replaced after the build, by
materialisation or ZeRO, are the ones used). A forward run again in the backward leaves
batch norm's running statistics as the first run left them (:func:`running_stats_kept`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Interpreter, Node
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class Segment:
    """A run of graph nodes, recomputed in the backward or kept."""

    nodes: tuple[Node, ...]
    recomputed: bool
    inputs: tuple[Node, ...]
    """Values from before the segment that its nodes read (the checkpoint's arguments)."""
    outputs: tuple[Node, ...]
    """Values of the segment read after it (the checkpoint's results)."""


def split_segments(
    graph: torch.fx.Graph, node_unit: Mapping[str, str], recompute_units: Collection[str]
) -> tuple[Segment, ...]:
    """The segments of ``graph`` (see the module docstring).

    Args:
        node_unit: node name -> the stage unit it belongs to (nodes not listed are free).
        recompute_units: the stage's units to recompute.
    """
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    runs: list[tuple[str | None, list[Node]]] = []
    for node in body:
        unit = node_unit.get(node.name) if node.op != "get_attr" else None
        key = unit if unit in recompute_units else None
        if runs and (key == runs[-1][0] or unit is None):
            runs[-1][1].append(node)
        else:
            runs.append((key, [node]))
    position = {n: i for i, n in enumerate(graph.nodes)}
    segments = []
    for key, nodes in runs:
        inside = set(nodes)
        inputs = dict.fromkeys(i for n in nodes for i in n.all_input_nodes if i not in inside)
        last = position[nodes[-1]]
        outputs = [n for n in nodes if any(position[user] > last for user in n.users)]
        segments.append(Segment(tuple(nodes), key is not None, tuple(inputs), tuple(outputs)))
    return tuple(segments)


def run_segments(
    module: torch.fx.GraphModule, segments: Sequence[Segment], args: Sequence[Any]
) -> Any:
    """What ``module(*args)`` returns, the recomputed segments checkpointed."""
    interpreter = Interpreter(module, garbage_collect_values=False)
    graph_nodes = list(module.graph.nodes)
    env: dict[Node, Any] = dict(
        zip((n for n in graph_nodes if n.op == "placeholder"), args, strict=True)
    )
    for segment in segments:
        if not segment.recomputed:
            _run_nodes(interpreter, segment.nodes, env)
            continue
        values = checkpoint(
            _segment_function(interpreter, segment),
            *(env[n] for n in segment.inputs),
            use_reentrant=False,
        )
        env.update(zip(segment.outputs, values, strict=True))
    output = next(n for n in reversed(graph_nodes) if n.op == "output")
    return torch.fx.map_arg(output.args[0], env.__getitem__)


def _run_nodes(interpreter: Interpreter, nodes: Sequence[Node], env: dict[Node, Any]) -> None:
    interpreter.env = env
    for node in nodes:
        env[node] = interpreter.run_node(node)
    interpreter.env = {}  # the checkpoint keeps the interpreter: keep no tensors with it


def _segment_function(interpreter: Interpreter, segment: Segment) -> Any:
    """A function of the segment's inputs returning its outputs (what checkpoint re-runs)."""

    def run(*values: Any) -> tuple[Any, ...]:
        env = dict(zip(segment.inputs, values, strict=True))
        recomputing = torch._C._current_graph_task_id() != -1  # run by the backward
        with running_stats_kept(interpreter.module) if recomputing else contextlib.nullcontext():
            _run_nodes(interpreter, segment.nodes, env)
        return tuple(env[n] for n in segment.outputs)

    return run


RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")
"""The names batch norm gives the buffers that every training forward updates."""


@contextlib.contextmanager
def running_stats_kept(module: torch.nn.Module) -> Iterator[None]:
    """Restores ``module``'s batch-norm running statistics (its buffers named as in
    :data:`RUNNING_STATS`) when the block ends: a forward run again to recompute
    activations must not count its batch a second time (``torch.utils.checkpoint`` does not
    guard against it; fairscale's checkpoint wrapper patches batch norm for the same reason)."""
    kept = [
        (buffer, buffer.detach().clone())
        for name, buffer in module.named_buffers()
        if name.rsplit(".", 1)[-1].endswith(RUNNING_STATS)
    ]
    try:
        yield
    finally:
        for buffer, value in kept:
            # through .data: batch norm's backward node saved the buffer, and a training-mode
            # backward does not read its values; its version must not move
            buffer.data.copy_(value)
