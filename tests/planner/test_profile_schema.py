"""Profile files: exact round trip, directory loading, merge precedence, readable errors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from pydantic import TypeAdapter

from hplan.planner.profiling.machine_profile import profile_file_name
from hplan.planner.profiling.profile_file import (
    DeviceFactor,
    DeviceProfile,
    MeasurementSource,
    ModelRef,
    Profile,
    Stat,
    UnitTiming,
    load_profiles,
    profile_json_schema,
)
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.versioned_file import parse_versioned

MODEL = ModelRef(path="model.py", sha256="a" * 64, graph_fingerprint="f" * 64, units=("u0", "u1"))


def _stat(median: float) -> Stat:
    return Stat(median=median, p10=median * 0.9, p90=median * 1.1, num_samples=5)


def _device(key: str = "rtx3090#GPU-1", flops: float = 3e13) -> DeviceProfile:
    return DeviceProfile(
        key=key,
        kind=key.split("#")[0].split("@")[0],
        name="NVIDIA GeForce RTX 3090",
        host="box",
        memory_bytes=24 * 2**30,
        matmul_flops_per_s={"float32": _stat(flops), "bfloat16": _stat(2 * flops)},
        memory_bandwidth_bytes_per_s=_stat(8e11),
        uuid="GPU-1",
        pci_bus_id="0000:01:00.0",
        details={"sm_clock_max_mhz": 2100, "power_limit_w": 350.0, "peer_access": ""},
    )


def _timing(device: str, unit: str, size: int, fwd_s: float, **kw) -> UnitTiming:
    return UnitTiming(
        device=device,
        unit=unit,
        micro_batch_size=size,
        forward_s=_stat(fwd_s),
        backward_s=_stat(2 * fwd_s),
        activation_bytes=1000 * size,
        peak_bytes=5000 * size,
        **kw,
    )


def _profile(**changes) -> Profile:
    base = Profile(
        devices=(_device(),),
        model=MODEL,
        unit_timings=(
            _timing("rtx3090#GPU-1", "u0", 1, 0.001, optimizer_s=0.0005),
            _timing("rtx3090#GPU-1", "u1", 1, 0.002),
        ),
        device_factors=(
            DeviceFactor(device="box/1", kind="rtx3090", time_factor=1.4, reason="straggler"),
        ),
        notes=("measured on box",),
    )
    return replace(base, **changes)


def test_profile_round_trips_exactly_and_every_quantity_key_names_its_unit():
    profile = _profile()
    text = profile.to_json()
    again = Profile.from_json(text)
    assert again == profile
    assert again.to_json() == text
    data = json.loads(text)
    assert data["schema_version"] == 1
    timing_keys = set(data["unit_timings"][0])
    assert {"forward_s", "backward_s", "optimizer_s", "activation_bytes", "peak_bytes"} <= (
        timing_keys
    )
    assert "matmul_flops_per_s" in data["devices"][0]
    assert "memory_bandwidth_bytes_per_s" in data["devices"][0]


def test_profile_json_schema_describes_every_top_level_field():
    schema = profile_json_schema()
    assert set(schema["properties"]) == {
        "schema_version",
        "devices",
        "model",
        "unit_timings",
        "device_factors",
        "notes",
        "node_collectives",
    }


def test_loading_a_directory_merges_every_profile_in_it(tmp_path):
    cpu = Profile(devices=(_device("cpu", 1e11),))
    (tmp_path / profile_file_name("box", "rtx3090#GPU-1")).write_text(_profile().to_json())
    (tmp_path / profile_file_name("box", "cpu")).write_text(cpu.to_json())
    merged = Profile.load(tmp_path)
    assert {d.key for d in merged.devices} == {"rtx3090#GPU-1", "cpu"}
    assert merged.model == MODEL
    assert len(merged.unit_timings) == 2


def test_merge_keeps_both_and_the_later_profile_wins_for_the_same_measurement():
    first = _profile()
    newer = Profile(
        devices=(_device(flops=5e13),),
        model=MODEL,
        unit_timings=(
            _timing("rtx3090#GPU-1", "u0", 1, 0.004, source=MeasurementSource.CALIBRATED),
            _timing("rtx3090#GPU-1", "u0", 2, 0.007),
        ),
    )
    merged = first.merge(newer)
    by_key = {(t.unit, t.micro_batch_size): t for t in merged.unit_timings}
    assert by_key[("u0", 1)].forward_s.median == 0.004
    assert by_key[("u0", 1)].source is MeasurementSource.CALIBRATED
    assert by_key[("u0", 2)].forward_s.median == 0.007
    assert by_key[("u1", 1)].forward_s.median == 0.002  # only in the first: kept
    assert merged.devices[0].matmul_flops_per_s["float32"].median == 5e13
    assert merged.device_factors == first.device_factors
    reverse = newer.merge(first)
    assert {(t.unit, t.micro_batch_size): t for t in reverse.unit_timings}[
        ("u0", 1)
    ].forward_s.median == 0.001


def test_profiles_of_different_models_do_not_merge():
    other = replace(MODEL, path="other.py", graph_fingerprint="0" * 64)
    with pytest.raises(ConfigError, match="different models"):
        _profile().merge(_profile(model=other))


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("{", "not valid JSON"),
        ('{"schema_version": 2}', "schema_version 2"),
        ('{"schema_version": 1, "devices": [{"key": "cpu"}]}', "devices.0"),
        ('{"schema_version": 1, "extra": 1}', "extra"),
    ],
)
def test_bad_profile_files_are_one_line_config_errors(text, needle):
    with pytest.raises(ConfigError, match=needle) as info:
        Profile.from_json(text, source="p.json")
    assert "p.json" in str(info.value)
    assert "\n" not in str(info.value)


def test_profile_file_names_are_safe_for_any_device_key():
    assert profile_file_name("box", "cpu") == "box-cpu.json"
    assert profile_file_name("box", "rtx3090#GPU-1/2") == "box-rtx3090_GPU-1_2.json"


def test_profiles_bound_to_a_node_are_named_after_it_not_the_host():
    assert profile_file_name("same-host", "cpu@left") == "left-cpu.json"
    assert profile_file_name("same-host", "rtx3090@box/1") == "box_1-rtx3090.json"


def test_several_profile_paths_merge_and_each_node_keeps_its_timings(tmp_path):
    nodes = {"left": 0.001, "right": 0.002}
    paths = []
    for node, fwd_s in nodes.items():
        profile = Profile(
            devices=(replace(_device(f"cpu@{node}"), uuid=None, pci_bus_id=None),),
            model=MODEL,
            unit_timings=(_timing(f"cpu@{node}", "u0", 1, fwd_s),),
        )
        (tmp_path / node).mkdir()
        path = tmp_path / node / profile_file_name("same-host", f"cpu@{node}")
        path.write_text(profile.to_json())
        paths.append(path if node == "left" else path.parent)  # a file and a directory
    merged = load_profiles(paths)
    assert {d.key for d in merged.devices} == {"cpu@left", "cpu@right"}
    assert {t.device: t.forward_s.median for t in merged.unit_timings} == {
        "cpu@left": 0.001,
        "cpu@right": 0.002,
    }


@pytest.mark.parametrize("text", ['{"x": 1}', "[1, 2]"])
def test_json_that_is_no_hplan_file_is_named_as_such(text: str) -> None:
    with pytest.raises(ConfigError, match=r"'bw.json' is not an hplan profile .*; run it"):
        parse_versioned(
            text, TypeAdapter(dict), what="profile", source="bw.json", version=1, fix="run it"
        )
