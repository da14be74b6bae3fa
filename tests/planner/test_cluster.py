"""cluster.yaml loading, validation messages, link lookup and the plan's ClusterSpec."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from hplan.planner.hardware.catalog import CATALOG
from hplan.planner.hardware.cluster import load_cluster, to_cluster_spec
from hplan.runtime.contract.errors import ConfigError
from tests.fixtures.clusters import (
    EXAMPLE_CLUSTERS,
    EXAMPLES_DIR,
    cluster_from_dict,
    cpu_cluster,
    example_cluster,
    mixed_cluster,
)

GIB = 2**30


def _two_nodes(**links) -> dict:
    return {
        "nodes": [
            {"name": "a", "host": "10.0.0.1", "devices": [{"type": "rtx4090", "count": 2}]},
            {"name": "b", "host": "10.0.0.2", "devices": [{"type": "rtx3090"}]},
        ],
        "links": links or {"inter_node": {"bandwidth_gbit_per_s": 10}},
    }


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def _load_error(tmp_path: Path, data_or_text) -> str:
    text = data_or_text if isinstance(data_or_text, str) else yaml.safe_dump(data_or_text)
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    message = str(info.value)
    assert info.value.exit_code == 2
    assert "\n" not in message, "messages are one line"
    assert str(path) in message, "messages name the file"
    return message


# ----------------------------------------------------------------------------- examples
@pytest.mark.parametrize("name", EXAMPLE_CLUSTERS)
def test_example_clusters_load_and_export(name):
    cluster = example_cluster(name)
    spec = to_cluster_spec(cluster, "bfloat16")
    num_devices = len(cluster.devices)
    assert num_devices >= 4
    assert len(spec.links) == num_devices * (num_devices - 1) // 2


def test_mixed_example_has_the_documented_devices_in_file_order():
    cluster = example_cluster("mixed-3090-4090")
    assert cluster.device_names == ("box-a/0", "box-a/1", "box-b/0", "box-b/1", "box-b/2")
    assert [d.kind for d in cluster.devices] == [
        "rtx4090", "rtx4090", "rtx3090", "rtx3090", "rtx3060",
    ]  # fmt: skip
    assert cluster.link("box-a/0", "box-b/2").bandwidth_bytes_per_s == pytest.approx(1.25e9)
    assert all(d.type.consumer_card for d in cluster.devices)


def test_two_site_example_is_slow_across_sites_and_fast_inside():
    cluster = example_cluster("two-site")
    across = cluster.link("site-a-1/0", "site-b-2/1")
    inside = cluster.link("site-a-1/0", "site-a-2/1")
    assert across.bandwidth_bytes_per_s == pytest.approx(1e9 / 8)
    assert inside.bandwidth_bytes_per_s == pytest.approx(100e9 / 8)
    assert across.latency_s > inside.latency_s


def test_cpu_rehearsal_example_has_heterogeneous_cpu_devices():
    cluster = example_cluster("cpu-rehearsal")
    assert {d.kind for d in cluster.devices} == {"cpu"}
    assert {d.node for d in cluster.devices} == {"fast", "slow"}
    speeds = {d.type.fp32_flops_per_s for d in cluster.devices}
    assert len(speeds) == 2
    memories = {d.type.memory_bytes for d in cluster.devices}
    assert 1 * GIB in memories and len(memories) == 2


def test_readme_format_example_loads():
    text = (EXAMPLES_DIR / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```yaml\n(.*?)```", text, re.DOTALL)
    assert block is not None
    cluster = cluster_from_dict(yaml.safe_load(block.group(1)))
    kinds = [d.kind for d in cluster.devices]
    assert kinds == ["rtx4090", "rtx4090", "rtx3060", "my-card", "rtx3090"]
    assert cluster.link("box-a/0", "box-a/1").bandwidth_bytes_per_s == pytest.approx(25e9)
    assert [n.interface for n in cluster.nodes] == ["eth1", None]


def test_a_nodes_interface_is_recorded_in_the_plans_cluster_and_checked(tmp_path):
    data = _two_nodes()
    data["nodes"][1]["interface"] = "ib0"
    spec = to_cluster_spec(load_cluster(_write(tmp_path, yaml.safe_dump(data))), "float32")
    assert [n.interface for n in spec.nodes] == [None, "ib0"]
    data["nodes"][1]["interface"] = "eth0; rm -rf /"
    message = _load_error(tmp_path, data)
    assert "nodes[1].interface" in message and "not a network interface name" in message


# ----------------------------------------------------------------------------- device order and links
def test_devices_of_a_node_are_contiguous_and_named_node_slash_index():
    cluster = cpu_cluster(3, num_nodes=2)
    nodes = [d.node for d in cluster.devices]
    assert nodes == ["n0"] * 3 + ["n1"] * 3
    assert [d.local_index for d in cluster.devices] == [0, 1, 2, 0, 1, 2]
    assert cluster.device_names[4] == "n1/1"


def test_intra_node_defaults_depend_on_device_class():
    gpu = mixed_cluster()
    cpu = cpu_cluster(2)
    assert gpu.link("box-a/0", "box-a/1").bandwidth_bytes_per_s == pytest.approx(31.5e9)
    assert cpu.link("n0/0", "n0/1").bandwidth_bytes_per_s == pytest.approx(5e9)


def test_intra_node_link_can_be_set_per_node():
    data = _two_nodes()
    data["nodes"][0]["intra_node_link"] = {"bandwidth_gb_per_s": 300, "latency_us": 3}
    cluster = cluster_from_dict(data)
    link = cluster.link("a/0", "a/1")
    assert link.bandwidth_bytes_per_s == pytest.approx(300e9)
    assert link.latency_s == pytest.approx(3e-6)


def test_pair_override_beats_the_default_inter_node_link():
    data = _two_nodes(
        inter_node={"bandwidth_gbit_per_s": 100},
        pairs=[{"nodes": ["b", "a"], "bandwidth_gb_per_s": 0.5, "latency_us": 900}],
    )
    cluster = cluster_from_dict(data)
    assert cluster.bandwidth_bytes_per_s("a/1", "b/0") == pytest.approx(0.5e9)
    assert cluster.latency_s("b/0", "a/0") == pytest.approx(900e-6)


def test_node_matrix_uses_the_slower_direction():
    data = _two_nodes(matrix={"of": "nodes", "bandwidth_gb_per_s": [[0, 2.0], [1.5, 0]]})
    cluster = cluster_from_dict(data)
    assert cluster.bandwidth_bytes_per_s("a/0", "b/0") == pytest.approx(1.5e9)
    assert cluster.latency_s("a/0", "b/0") == pytest.approx(50e-6)


def test_device_matrix_sets_every_pair_including_inside_a_node():
    matrix = [[0, 7, 1], [7, 0, 2], [1, 2, 0]]
    data = _two_nodes(matrix={"of": "devices", "bandwidth_gb_per_s": matrix, "latency_us": 4})
    cluster = cluster_from_dict(data)
    assert cluster.bandwidth_bytes_per_s("a/0", "a/1") == pytest.approx(7e9)
    assert cluster.bandwidth_bytes_per_s("a/1", "b/0") == pytest.approx(2e9)
    assert cluster.node_links[("a", "b")].bandwidth_bytes_per_s == pytest.approx(1e9)


def test_link_of_a_device_with_itself_is_an_error():
    with pytest.raises(ValueError):
        mixed_cluster().link("box-a/0", "box-a/0")


def test_overrides_change_only_what_they_name():
    data = _two_nodes()
    data["nodes"][1]["devices"][0].update({"memory_gib": 20, "peak_tflops": 50})
    device = cluster_from_dict(data).device("b/0")
    assert device.kind == "rtx3090"
    assert device.type.memory_bytes == 20 * GIB
    assert device.type.bf16_flops_per_s == pytest.approx(50e12)
    assert device.type.fp32_flops_per_s == pytest.approx(50e12)
    assert (
        device.type.memory_bandwidth_bytes_per_s == CATALOG["rtx3090"].memory_bandwidth_bytes_per_s
    )


def test_memory_gb_is_decimal_and_memory_gib_binary():
    data = _two_nodes()
    data["nodes"][0]["devices"][0]["memory_gb"] = 10
    data["nodes"][1]["devices"][0]["memory_gib"] = 10
    cluster = cluster_from_dict(data)
    assert cluster.device("a/0").type.memory_bytes == 10 * 10**9
    assert cluster.device("b/0").type.memory_bytes == 10 * GIB


def test_custom_device_uses_its_figures_for_every_dtype():
    data = _two_nodes()
    data["nodes"][1]["devices"] = [
        {
            "custom": "lab-card",
            "memory_gib": 16,
            "peak_tflops": 40,
            "memory_bandwidth_gb_per_s": 500,
            "consumer_card": True,
        }
    ]
    cluster = cluster_from_dict(data)
    spec = to_cluster_spec(cluster, "float32")
    device = spec.devices[2]
    assert (device.kind, device.peak_flops, device.consumer_card) == ("lab-card", 40e12, True)
    assert device.memory_bandwidth_bytes_per_s == pytest.approx(500e9)


def test_bare_model_number_in_yaml_is_read_as_a_name(tmp_path):
    text = "nodes:\n  - name: a\n    host: a\n    devices:\n      - type: 3090\n"
    assert load_cluster(_write(tmp_path, text)).devices[0].kind == "rtx3090"


def test_name_defaults_to_the_file_stem(tmp_path):
    path = tmp_path / "lab-pool.yaml"
    path.write_text(
        yaml.safe_dump({"nodes": [{"name": "a", "host": "a", "devices": [{"type": "t4"}]}]})
    )
    assert load_cluster(path).name == "lab-pool"


@pytest.mark.parametrize("host", ["10.0.0.1", "::1", "fd00::12", "gpu-01.example.org", "localhost"])
def test_valid_hosts_are_accepted(host):
    data = _two_nodes()
    data["nodes"][0]["host"] = host
    assert cluster_from_dict(data).nodes[0].host == host


# ----------------------------------------------------------------------------- ClusterSpec
def test_cluster_spec_has_dtype_peaks_and_a_link_per_device_pair():
    cluster = mixed_cluster()
    spec = to_cluster_spec(cluster, "bfloat16")
    assert [d.name for d in spec.devices] == list(cluster.device_names)
    assert spec.devices[0].peak_flops == pytest.approx(165.2e12)
    assert to_cluster_spec(cluster, "float32").devices[0].peak_flops == pytest.approx(82.6e12)
    pairs = {(link.a, link.b) for link in spec.links}
    assert len(pairs) == 10 and ("box-a/0", "box-b/2") in pairs
    for link in spec.links:
        assert link.bandwidth_bytes_per_s == cluster.bandwidth_bytes_per_s(link.a, link.b)
    assert [n.devices for n in spec.nodes][1] == ("box-b/0", "box-b/1", "box-b/2")


# ----------------------------------------------------------------------------- bad files
def _bad(path_and_change):
    """Return a two-node cluster dict changed by ``path_and_change(data)``."""
    data = _two_nodes()
    path_and_change(data)
    return data


BAD_CASES = {
    "unknown top-level key": (
        lambda d: d.update(gpus=3),
        r"gpus: unknown key; allowed keys here: name, nodes, links",
    ),
    "unknown device key": (
        lambda d: d["nodes"][1]["devices"][0].update(memroy_gb=3),
        r"nodes\[1\]\.devices\[0\]\.memroy_gb: unknown key; did you mean 'memory_gb'\? "
        r"allowed keys here: type, custom",
    ),
    "unknown link key": (
        lambda d: d["links"]["inter_node"].update(speed=3),
        r"links\.inter_node\.speed: unknown key; allowed keys here: bandwidth_gb_per_s",
    ),
    "negative memory": (
        lambda d: d["nodes"][1]["devices"][0].update(memory_gb=-4),
        r"nodes\[1\]\.devices\[0\]\.memory_gb: .*greater than 0",
    ),
    "zero memory": (
        lambda d: d["nodes"][0]["devices"][0].update(memory_gib=0),
        r"nodes\[0\]\.devices\[0\]\.memory_gib: .*greater than 0",
    ),
    "unknown device": (
        lambda d: d["nodes"][1]["devices"][0].update(type="rtx9090"),
        r"nodes\[1\]\.devices\[0\]\.type: unknown device type 'rtx9090'; valid names: rtx3060",
    ),
    "shell metacharacters in host": (
        lambda d: d["nodes"][0].update(host="10.0.0.1; rm -rf ~"),
        r"nodes\[0\]\.host: .* is not a host name or IP address",
    ),
    "command substitution in host": (
        lambda d: d["nodes"][1].update(host="$(reboot)"),
        r"nodes\[1\]\.host: ",
    ),
    "bad IPv4 address": (lambda d: d["nodes"][1].update(host="10.0.0.300"), r"nodes\[1\]\.host: "),
    "IPv6 scope id": (lambda d: d["nodes"][1].update(host="fe80::1%eth0"), r"nodes\[1\]\.host: "),
    "host label starting with a dash": (
        lambda d: d["nodes"][1].update(host="-oProxyCommand=x"),
        r"nodes\[1\]\.host: ",
    ),
    "duplicate node names": (
        lambda d: d["nodes"][1].update(name="a"),
        r"nodes\[1\]\.name: duplicate node name 'a' \(also nodes\[0\]\)",
    ),
    "slash in node name": (lambda d: d["nodes"][1].update(name="b/c"), r"nodes\[1\]\.name: "),
    "unknown node in a link": (
        lambda d: d["links"].update(pairs=[{"nodes": ["a", "z"], "bandwidth_gbit_per_s": 1}]),
        r"links\.pairs\[0\]\.nodes\[1\]: unknown node 'z'; nodes: a, b",
    ),
    "no inter-node link": (lambda d: d.pop("links"), r"links: no link between nodes 'a' and 'b'"),
    "two bandwidth units": (
        lambda d: d["links"]["inter_node"].update(bandwidth_gb_per_s=1),
        r"links\.inter_node: give exactly one of bandwidth_gb_per_s, bandwidth_gbit_per_s",
    ),
    "matrix of the wrong size": (
        lambda d: d.update(links={"matrix": {"of": "nodes", "bandwidth_gb_per_s": [[0]]}}),
        r"links\.matrix\.bandwidth_gb_per_s: want 2x2",
    ),
    "matrix and pairs together": (
        lambda d: d["links"].update(matrix={"of": "nodes", "bandwidth_gb_per_s": [[0, 1], [1, 0]]}),
        r"links: give either matrix or inter_node/pairs",
    ),
    "custom device without figures": (
        lambda d: d["nodes"][1]["devices"].append({"custom": "x", "memory_gb": 8}),
        r"nodes\[1\]\.devices\[1\]: a `custom` device needs",
    ),
    "custom device named like a catalog device": (
        lambda d: d["nodes"][1]["devices"].append(
            {"custom": "rtx-3090", "memory_gb": 8, "peak_tflops": 1, "memory_bandwidth_gb_per_s": 1}
        ),
        r"nodes\[1\]\.devices\[1\]\.custom: 'rtx-3090' is a catalog device",
    ),
    "device without type or custom": (
        lambda d: d["nodes"][1]["devices"].append({"count": 2}),
        r"nodes\[1\]\.devices\[1\]: give exactly one of type, custom",
    ),
    "zero count": (
        lambda d: d["nodes"][0]["devices"][0].update(count=0),
        r"nodes\[0\]\.devices\[0\]\.count: .*\(got 0\); change it in the cluster file$",
    ),
    "node without devices": (lambda d: d["nodes"][0].update(devices=[]), r"nodes\[0\]\.devices: "),
    "missing host": (
        lambda d: d["nodes"][0].pop("host"),
        r"nodes\[0\]\.host: required key is missing; add it \(examples/clusters/README\.md",
    ),
    "text where a number belongs": (
        lambda d: d["links"]["inter_node"].update(bandwidth_gbit_per_s="fast"),
        r"links\.inter_node\.bandwidth_gbit_per_s: .*valid number \(got 'fast'\)",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_cluster_raises_one_line_config_error_with_the_key_path(tmp_path, case):
    change, pattern = BAD_CASES[case]
    message = _load_error(tmp_path, _bad(change))
    assert re.search(pattern, message), message


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("nodes: [{name: a", r"not valid YAML \(.*line 1, column 17\)"),
        ("nodes: []\nnodes: []\n", r"duplicate key 'nodes'"),
        ("", r"file is empty"),
        ("- a\n- b\n", r"\(top level\): the file must be a mapping"),
        ("\tnodes: 1", r"not valid YAML"),
    ],
)
def test_unreadable_cluster_file_raises_config_error(tmp_path, text, pattern):
    message = _load_error(tmp_path, text)
    assert re.search(pattern, message), message


def test_missing_cluster_file_raises_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_cluster(tmp_path / "nope.yaml")
    assert info.value.exit_code == 2


def test_select_drops_lost_nodes_and_devices_and_keeps_names_and_links():
    matrix = [[0, 7, 1], [7, 0, 2], [1, 2, 0]]
    data = _two_nodes(matrix={"of": "devices", "bandwidth_gb_per_s": matrix, "latency_us": 4})
    cluster = cluster_from_dict(data)
    left = cluster.select(without=["a/0"])
    assert left.device_names == ("a/1", "b/0")
    assert left.device("a/1").local_index == 1  # CUDA numbering stays the machine's
    assert left.bandwidth_bytes_per_s("a/1", "b/0") == pytest.approx(2e9)
    assert set(left.device_links) == {("a/1", "b/0")}
    left.verify()
    only_b = cluster.select(nodes=["b"])
    assert only_b.device_names == ("b/0",) and [n.name for n in only_b.nodes] == ["b"]
    assert cluster.select(without=["a"]).device_names == ("b/0",)
    with pytest.raises(ConfigError, match="--without 'c/0': not a node or device"):
        cluster.select(without=["c/0"])
    with pytest.raises(ConfigError, match="no device of"):
        cluster.select(without=["a", "b"])
