"""The solve as a pass pipeline: each pass checked, named when it fails, dumpable; the model
captured once; the chosen layout simulated once, with the bytes its plan sends."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import hplan.planner.api as api
from hplan.planner.api import PASSES, SolveRequest, plan_training
from hplan.planner.frontend.cost_graph import build_model_graph
from hplan.planner.passes import Pass, PassError, debug_json, run_passes
from hplan.planner.sim.engine import simulate
from hplan.planner.sim.spec import spec_from_plan
from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.contract.errors import ConfigError, ModelFileError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
GPT = EXAMPLES / "gpt" / "model.py"
CLUSTERS = EXAMPLES / "clusters"


class _Checked:
    """A pass result whose verify() fails."""

    def verify(self) -> None:
        raise ValueError("units out of order")


def test_a_result_whose_verify_fails_names_the_pass_and_the_one_before() -> None:
    passes = [Pass("first", lambda r: 1), Pass("second", lambda r: _Checked())]
    with pytest.raises(
        PassError, match=r"pass 'second' \(after 'first'\) made an invalid _Checked"
    ):
        run_passes(passes, request=None)


def test_a_bug_in_a_pass_names_the_pass_and_a_user_error_stays_as_it_is() -> None:
    def crash(r: object) -> object:
        return {}["missing"]

    with pytest.raises(PassError, match=r"pass 'crash' \(after 'request'\) raised KeyError"):
        run_passes([Pass("crash", crash)], request=None)

    def bad_input(r: object) -> object:
        raise ConfigError("cluster 'x.yaml' has no nodes; add one")

    with pytest.raises(ConfigError) as info:
        run_passes([Pass("ok", lambda r: 1), Pass("cluster", bad_input)], request=None)
    assert str(info.value) == "cluster 'x.yaml' has no nodes; add one"  # the CLI's one line
    assert info.value.__notes__ == ["in pass 'cluster' (after 'ok')"]


def test_the_passes_read_earlier_results_by_name_and_are_timed() -> None:
    results = run_passes(
        [Pass("a", lambda r: r["request"] + 1), Pass("b", lambda r: r["a"] * 10)], request=1
    )
    assert (results["a"], results["b"]) == (2, 20)
    assert results["b.time_s"] >= 0


def test_every_pass_result_can_be_written_for_debugging(tmp_path: Path) -> None:
    request = SolveRequest(model_path=GPT, cluster_path=CLUSTERS / "mixed-3090-4090.yaml")
    plan = plan_training(request, dump_dir=tmp_path).plan
    names = sorted(p.name for p in tmp_path.iterdir())
    expected = ["00-request.json"] + [f"{i:02d}-{p.name}.json" for i, p in enumerate(PASSES, 1)]
    assert names == expected
    graph = json.loads((tmp_path / "04-cost_graph.json").read_text())
    assert graph["__type__"] == "ModelGraph" and graph["graph"]["nodes"]
    assert json.loads((tmp_path / f"{len(PASSES):02d}-plan.json").read_text())["ranks"]
    assert len(plan.ranks) >= 1


def test_a_failing_pass_leaves_its_error_beside_the_results_before_it(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        GPT.read_text() + "\n\ndef loss_fn(logits, targets):\n    return logits.detach().mean()\n"
    )
    request = SolveRequest(model_path=bad, cluster_path=CLUSTERS / "mixed-3090-4090.yaml")
    with pytest.raises(ModelFileError, match="needs no gradient"):
        plan_training(request, dump_dir=tmp_path / "dump")
    names = sorted(p.name for p in (tmp_path / "dump").iterdir())
    assert names[-1] == "03-trains_check.error.txt" and "02-capture.json" in names


def test_debug_json_views_arrays_graphs_tensors_and_non_finite_numbers() -> None:
    import networkx as nx
    import numpy as np
    import torch

    graph: nx.DiGraph = nx.DiGraph()
    graph.add_edge("a", "b", bytes=4.0)
    view = debug_json(
        {"array": np.array([1.0, 2.0]), "graph": graph, "t": torch.zeros(2, 3), "x": float("inf")}
    )
    json.dumps(view, allow_nan=False)  # JSON-native
    assert view["array"] == [1.0, 2.0] and view["x"] == "inf"
    assert view["t"] == {"tensor": [2, 3], "dtype": "torch.float32", "device": "cpu"}
    assert view["graph"]["edges"] == [{"bytes": 4.0, "source": "a", "target": "b"}]


def test_a_solve_builds_and_traces_the_model_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"build": 0, "trace": 0}
    load, trace = api.load_model_file, api.capture_model.__globals__["trace_model"]

    def counting_load(path: Path):  # type: ignore[no-untyped-def]
        model_file = load(path)
        build = model_file.build_model

        def counted():  # type: ignore[no-untyped-def]
            calls["build"] += 1
            return build()

        return dataclasses.replace(model_file, build_model=counted)

    def counting_trace(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["trace"] += 1
        return trace(*args, **kwargs)

    monkeypatch.setattr(api, "load_model_file", counting_load)
    monkeypatch.setitem(api.capture_model.__globals__, "trace_model", counting_trace)
    request = SolveRequest(model_path=GPT, cluster_path=CLUSTERS / "cpu-small-memory.yaml")
    plan_training(request)
    assert calls == {"build": 1, "trace": 1}


@pytest.mark.parametrize(
    ("model", "cluster", "batch"),
    [
        ("gpt", "mixed-3090-4090", 32),
        ("gpt", "cpu-small-memory", 32),
        ("mlp", "two-site", 64),
    ],
)
def test_the_plans_simulated_step_is_what_hplan_simulate_gives(
    model: str, cluster: str, batch: int
) -> None:
    request = SolveRequest(
        model_path=EXAMPLES / model / "model.py",
        cluster_path=CLUSTERS / f"{cluster}.yaml",
        global_batch_size=batch,
    )
    plan = plan_training(request).plan
    assert plan.report.simulated_step_time_s is not None
    assert plan.report.simulated_step_time_s == simulate(spec_from_plan(plan)).step_time_s


def test_the_cost_graph_verifies_its_units_against_its_nodes() -> None:
    graph = build_model_graph(load_model_file(GPT))
    graph.verify()
    node = graph.units[1].nodes[0]
    graph.graph.nodes[node]["unit"] = graph.units[0].name
    with pytest.raises(ValueError, match=rf"graph node {node!r} has unit"):
        graph.verify()
