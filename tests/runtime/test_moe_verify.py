"""``rehearse --verify`` of mixture-of-experts models planned on fake tensors.

Each plan has two replicas, one pipelined over two stages (a cut between expert layers) and
one data-parallel copy of the whole model: the gradients of every expert, the router
included, must equal one process's.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from hplan.runtime.rehearsal.rehearse import rehearse
from tests.fixtures.moe_models import HAND_MOE, HF_MIXTRAL, HF_QWEN3_MOE, moe_source
from tests.fixtures.plans import ReplicaShape, make_plan, model_graph, write_model

TIMEOUT_S = 120.0
SOURCES = {
    "qwen3-moe": moe_source(HF_QWEN3_MOE),
    "mixtral": moe_source(HF_MIXTRAL),
    "hand-written": moe_source(HAND_MOE),
}


@pytest.mark.parametrize("name", list(SOURCES))
def test_moe_plans_on_pipeline_and_data_parallel_pass_verify(name: str, tmp_path: Path) -> None:
    if not name.startswith("hand-written"):
        pytest.importorskip("transformers")
    path = write_model(tmp_path, SOURCES[name], f"{name}.py")
    graph = model_graph(str(path))
    assert not any("real CPU tensors" in note for note in graph.notes), graph.notes
    plan = make_plan(path, [ReplicaShape((2, -1), 2, 4), ReplicaShape((-1,), 2, 2)])
    out = io.StringIO()
    result = rehearse(
        plan, steps=1, verify=True, timeout_s=TIMEOUT_S, console=Console(file=out, width=400)
    )
    verified = result.verify
    assert verified is not None and result.verify_passed is True, out.getvalue()
    assert verified.gradients.relative_difference < 1e-5
