"""Selective recomputation inside a stage (``capture/segments.py``): the recomputed units run
under ``torch.utils.checkpoint``, their forward runs again in the backward with the same
dropout masks, and the stage computes exactly what it computes keeping everything."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from hplan.planner.frontend.capture import CaptureTensors
from hplan.planner.frontend.cost_graph import build_model_graph
from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.capture.segments import split_segments
from hplan.runtime.capture.stage import StageModule, build_stage
from tests.fixtures.models import probe_loss
from tests.fixtures.plans import write_model

DROPOUT_MLP = """
    import torch
    from torch import nn

    WIDTH, IN, CLASSES = 16, 5, 3


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)
            self.drop = nn.Dropout(0.3)

        def forward(self, h):
            return h + self.drop(torch.tanh(self.lin(h)))


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(IN, WIDTH)
            self.blocks = nn.ModuleList(Block() for _ in range(4))
            self.head = nn.Linear(WIDTH, CLASSES)

        def forward(self, x):
            h = self.inp(x)
            for block in self.blocks:
                h = block(h)
            return self.head(h)


    def build_model():
        return Net()


    def sample_batch(batch_size):
        return {"x": torch.randn(batch_size, IN)}, torch.randint(0, CLASSES, (batch_size,))


    def loss_fn(logits, targets):
        return nn.functional.cross_entropy(logits, targets)
"""


def _run(stage: StageModule, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward in training mode from RNG seed 7: (output, gradients)."""
    params = stage.canonical_parameters()
    for _, p in params:
        p.grad = None
    torch.manual_seed(7)
    out = stage({"x": x}, {})["output"]
    torch.manual_seed(123)  # the backward must not depend on the RNG state it starts from
    probe_loss(out).backward()
    return out.detach(), {n: p.grad.clone() for n, p in params if p.grad is not None}


def test_recomputed_units_rerun_their_forward_with_the_same_dropout_masks(tmp_path: Path) -> None:
    model_file = load_model_file(write_model(tmp_path, DROPOUT_MLP))
    graph = build_model_graph(model_file, tensors=CaptureTensors.CPU)
    names = [u.name for u in graph.units]
    assert names == ["inp", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    recomputed = ("blocks.1", "blocks.3")
    keep = build_stage(graph.traced, graph.units, names, recv=(), send=())
    selective = build_stage(
        graph.traced, graph.units, names, recv=(), send=(), recompute_units=recomputed
    )
    segments = split_segments(selective.graph_module.graph, selective._node_units, recomputed)
    assert [s.recomputed for s in segments] == [False, True, False, True, False]
    calls: dict[str, int] = {}
    for i in range(4):
        module = selective.graph_module.get_submodule(f"blocks.{i}.drop")
        module.register_forward_pre_hook(  # a recompute stops once it has what it saved
            lambda *_, i=i: calls.__setitem__(f"blocks.{i}", calls.get(f"blocks.{i}", 0) + 1)
        )
    x = torch.randn(32, 5)
    keep.train()
    selective.train()
    out_keep, grads_keep = _run(keep, x)
    calls.clear()  # the stages share the modules
    out_selective, grads_selective = _run(selective, x)
    # each recomputed unit's dropout ran twice (forward, then again in the backward)
    assert calls == {"blocks.0": 1, "blocks.1": 2, "blocks.2": 1, "blocks.3": 2}
    assert torch.equal(out_keep, out_selective)
    assert set(grads_keep) == set(grads_selective) and len(grads_keep) == 12
    for name, grad in grads_keep.items():
        torch.testing.assert_close(grads_selective[name], grad, rtol=0, atol=0, msg=name)
    # and dropout really dropped: another seed gives other outputs
    torch.manual_seed(8)
    assert not torch.equal(selective({"x": x}, {})["output"], out_keep)
    # a deep copy (the rehearsal's warm timer runs one) splits its own graph
    twin = copy.deepcopy(selective)
    torch.testing.assert_close(_run(twin, x)[1], grads_keep, rtol=0, atol=0)
