"""plan.json as a contract: hand edits that cannot run are rejected when the plan loads."""

from __future__ import annotations

import json

import pytest

from hplan.planner.emit.artifacts import schema_text
from hplan.runtime.contract.errors import PlanFileError
from hplan.runtime.contract.plan import SCHEMA_VERSION, Plan
from tests.fixtures.sample_plans import cpu_plan


def _edited(**training: object) -> str:
    data = json.loads(cpu_plan().to_json())
    data["training"].update(training)
    return json.dumps(data)


@pytest.mark.parametrize("timeout_s", [-1, 0, 1e400])
def test_a_process_group_timeout_that_is_not_positive_is_rejected(timeout_s: float) -> None:
    with pytest.raises(PlanFileError, match=r"process_group_timeout_s .* > 0"):
        Plan.from_json(_edited(process_group_timeout_s=timeout_s))


def test_a_master_port_out_of_range_is_rejected() -> None:
    with pytest.raises(PlanFileError, match=r"master_port is 70000"):
        Plan.from_json(_edited(master_port=70000))


def test_the_published_schema_pins_the_schema_version() -> None:
    schema = json.loads(schema_text())
    plan = schema["$defs"]["Plan"] if "$defs" in schema and "Plan" in schema["$defs"] else schema
    assert plan["properties"]["schema_version"]["const"] == SCHEMA_VERSION


def test_another_schema_version_says_to_re_solve() -> None:
    data = json.loads(cpu_plan().to_json())
    data["schema_version"] = 999
    with pytest.raises(PlanFileError, match=r"schema_version is 999, this hplan reads 2"):
        Plan.from_json(json.dumps(data))


def test_a_schema_version_written_as_a_string_says_to_write_the_number() -> None:
    data = json.loads(cpu_plan().to_json())
    data["schema_version"] = str(SCHEMA_VERSION)
    with pytest.raises(PlanFileError, match=r"the string '2'; write the number 2 \(no quotes\)"):
        Plan.from_json(json.dumps(data))


def test_a_schema_version_of_2_0_or_a_plan_without_training_is_refused() -> None:
    data = json.loads(cpu_plan().to_json())
    data["schema_version"] = 2.0
    with pytest.raises(PlanFileError, match=r"schema_version is 2.0; write the integer 2"):
        Plan.from_json(json.dumps(data))
    data = json.loads(cpu_plan().to_json())
    del data["training"]
    with pytest.raises(PlanFileError, match=r"no 'training' section"):
        Plan.from_json(json.dumps(data))


@pytest.mark.parametrize("value", ["32", 32.0, True])
def test_integer_fields_take_json_integers_only(value: object) -> None:
    data = json.loads(cpu_plan().to_json())
    data["ranks"][0]["micro_batch_size"] = value
    with pytest.raises(PlanFileError, match=r"'ranks.0.micro_batch_size' is .* a JSON integer"):
        Plan.from_json(json.dumps(data))
    data = json.loads(cpu_plan().to_json())
    data["training"]["seed"] = value
    with pytest.raises(PlanFileError, match=r"'training.seed' is .* a JSON integer"):
        Plan.from_json(json.dumps(data))


def test_stages_of_a_replica_that_disagree_name_the_field_and_both_ranks() -> None:
    data = json.loads(cpu_plan().to_json())
    ranks = [r for r in data["ranks"] if r["replica"] == 0]
    assert len(ranks) > 1, "the sample plan needs a replica of two stages"
    ranks[1]["num_samples"] = 999
    with pytest.raises(PlanFileError, match=r"num_samples 999, rank \d+ \(stage 0\) \d+"):
        Plan.from_json(json.dumps(data))


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (
            ("report", "ranks", 0, "forward_time_s"),
            float("nan"),
            r"report.ranks\[0\].forward_time_s is nan",
        ),
        (("report", "ranks", 0, "optimizer_time_s"), -1.0, r"optimizer_time_s is -1.0"),
        (("report", "predicted_step_time_s"), -1.0, r"report.predicted_step_time_s is -1.0"),
        (
            ("cluster", "links", 0, "bandwidth_bytes_per_s"),
            0.0,
            r"bandwidth must be finite and > 0",
        ),
        (("cluster", "links", 0, "latency_s"), -1.0, r"latency finite and >= 0"),
        (("cluster", "devices", 0, "peak_flops"), float("inf"), r"both must be finite and > 0"),
    ],
)
def test_hand_edited_figures_that_are_not_finite_or_are_negative_are_rejected(
    path: tuple[object, ...], value: float, message: str
) -> None:
    data = json.loads(cpu_plan().to_json())
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(PlanFileError, match=message):
        Plan.from_json(json.dumps(data))


def test_a_nodes_measured_collective_round_trips_and_bad_figures_are_rejected() -> None:
    data = json.loads(cpu_plan().to_json())
    data["cluster"]["nodes"][0]["collective"] = {
        "latency_per_step_s": 1e-3,
        "bus_bandwidth_bytes_per_s": 7.5e8,
    }
    plan = Plan.from_json(json.dumps(data))
    assert plan.cluster.nodes[0].collective is not None
    assert Plan.from_json(plan.to_json()) == plan
    devices = [d.name for d in plan.cluster.devices if d.node == plan.cluster.nodes[0].name]
    assert len(devices) > 1 and plan.ring_channel(devices[:2])[1] >= 1e-3
    data["cluster"]["nodes"][0]["collective"]["latency_per_step_s"] = -1.0
    with pytest.raises(PlanFileError, match=r"collective has bus bandwidth .* latency finite"):
        Plan.from_json(json.dumps(data))
