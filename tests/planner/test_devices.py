"""Device discovery: NVML absent (case S4), a fake NVML with two GPUs joined to torch by PCI
bus id, unknown GPU names; and `hplan profile` of this CPU."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from hplan.planner.hardware import discovery as devices
from hplan.planner.hardware.discovery import (
    GpuInfo,
    catalog_kind,
    discover_devices,
    join_gpus,
    normalize_pci_bus_id,
)
from hplan.planner.profiling.machine_profile import ProfileRequest, device_key, profile_machine
from hplan.runtime.contract.errors import ConfigError


class FakeNvmlError(Exception):
    pass


def _fake_nvml(gpus: list[dict], *, init_error: bool = False) -> types.ModuleType:
    """A stand-in ``pynvml`` module: handles are indices into ``gpus``."""
    nvml = types.ModuleType("pynvml")
    nvml.NVML_CLOCK_SM = 1
    nvml.NVML_CLOCK_MEM = 2
    nvml.NVML_NVLINK_MAX_LINKS = 4
    nvml.NVML_FEATURE_ENABLED = 1
    nvml.NVML_P2P_CAPS_INDEX_READ = 0
    nvml.NVML_P2P_STATUS_OK = 0
    state = {"init": 0, "shutdown": 0}
    nvml.state = state

    def init() -> None:
        if init_error:
            raise FakeNvmlError("Driver Not Loaded")
        state["init"] += 1

    def nvlink(h: int, link: int) -> int:
        links = gpus[h].get("nvlink")
        if links is None:
            raise FakeNvmlError("Not Supported")
        return int(link < links)

    def clock(h: int, which: int) -> int:
        return gpus[h]["sm_mhz"] if which == 1 else gpus[h]["mem_mhz"]

    def p2p(a: int, b: int, _index: int) -> int:
        return 0 if gpus[a].get("p2p", True) and gpus[b].get("p2p", True) else 4

    nvml.nvmlInit = init
    nvml.nvmlShutdown = lambda: state.__setitem__("shutdown", state["shutdown"] + 1)
    nvml.nvmlDeviceGetCount = lambda: len(gpus)
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i
    nvml.nvmlDeviceGetName = lambda h: gpus[h]["name"].encode()  # bytes, as old releases
    nvml.nvmlDeviceGetUUID = lambda h: gpus[h]["uuid"]
    nvml.nvmlDeviceGetPciInfo = lambda h: SimpleNamespace(busId=gpus[h]["bus"])
    nvml.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(total=gpus[h]["mem"], free=1000)
    nvml.nvmlDeviceGetMaxClockInfo = clock
    nvml.nvmlDeviceGetPowerManagementLimit = lambda h: 350_000
    nvml.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: 4
    nvml.nvmlDeviceGetCurrPcieLinkWidth = lambda h: 16
    nvml.nvmlDeviceGetNvLinkState = nvlink
    nvml.nvmlDeviceGetP2PStatus = p2p
    return nvml


TWO_GPUS = [
    {"name": "NVIDIA GeForce RTX 3090", "uuid": "GPU-aaa", "bus": "00000000:01:00.0",
     "mem": 24 * 2**30, "sm_mhz": 2100, "mem_mhz": 9751, "p2p": False},
    {"name": "NVIDIA GeForce RTX 4090", "uuid": "GPU-bbb", "bus": "00000000:41:00.0",
     "mem": 24 * 2**30, "sm_mhz": 2520, "mem_mhz": 10501, "nvlink": 2},
]  # fmt: skip


def _torch_gpu(index: int, name: str, bus: int) -> GpuInfo:
    props = SimpleNamespace(
        name=name, total_memory=24 * 2**30, major=8, minor=6, multi_processor_count=82,
        pci_domain_id=0, pci_bus_id=bus, pci_device_id=0, uuid=None,
    )  # fmt: skip
    return devices._torch_gpu(index, props)


def test_without_nvml_there_are_no_gpus_and_the_cpu_is_profiled(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    monkeypatch.setattr(devices, "_torch_gpus", lambda: ([], None))
    found = discover_devices()
    assert found.gpus == ()
    assert any("nvidia-ml-py is not installed" in n for n in found.notes)
    assert found.cpu.memory_total_bytes > 0 and found.cpu.name
    result = profile_machine(ProfileRequest(benchmark=False), discovery=found)
    (profile,) = result.profiles
    assert [d.key for d in profile.devices] == ["cpu"]
    assert profile.devices[0].kind == "cpu"


def test_nvml_without_a_driver_is_a_note_not_an_error(monkeypatch):
    nvml = _fake_nvml(TWO_GPUS, init_error=True)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(devices, "_torch_gpus", lambda: ([], None))
    found = discover_devices()
    assert found.gpus == ()
    assert any("no NVIDIA driver" in n and "Driver Not Loaded" in n for n in found.notes)


def test_two_nvml_gpus_join_torch_devices_by_pci_bus_id(monkeypatch):
    nvml = _fake_nvml(TWO_GPUS)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    # torch numbers them the other way round (CUDA_DEVICE_ORDER=FASTEST_FIRST)
    torch_side = [_torch_gpu(0, "NVIDIA GeForce RTX 4090", 0x41), _torch_gpu(1, "x", 0x01)]
    monkeypatch.setattr(devices, "_torch_gpus", lambda: (torch_side, None))
    found = discover_devices()
    assert nvml.state == {"init": 1, "shutdown": 1}
    first, second = found.gpus
    assert (first.kind, first.torch_index, first.uuid) == ("rtx3090", 1, "GPU-aaa")
    assert (second.kind, second.torch_index, second.uuid) == ("rtx4090", 0, "GPU-bbb")
    assert first.pci_bus_id == "0000:01:00.0" and second.pci_bus_id == "0000:41:00.0"
    assert (first.sm_clock_max_mhz, first.memory_clock_max_mhz) == (2100, 9751)
    assert first.power_limit_w == 350.0 and first.pcie_generation == 4
    assert first.nvlink_active_links is None and second.nvlink_active_links == 2
    assert first.peer_access == () and second.peer_access == ()  # 3090 refuses P2P
    assert first.compute_capability == "8.6" and first.num_sms == 82
    assert device_key(first) == "rtx3090#GPU-aaa"
    details = second.details()
    assert details["nvlink_active_links"] == 2 and details["torch_index"] == 0
    assert all(isinstance(v, str | int | float | bool) for v in details.values())


def test_gpu_seen_by_one_source_only_is_kept():
    nvml_only = GpuInfo(name="a", kind="a", in_catalog=False, pci_bus_id="0000:02:00.0")
    torch_only = GpuInfo(name="b", kind="b", in_catalog=False, pci_bus_id="0000:03:00.0",
                         torch_index=0)  # fmt: skip
    joined = join_gpus([nvml_only], [torch_only])
    assert [g.name for g in joined] == ["a", "b"]
    assert joined[1].torch_index == 0 and joined[0].torch_index is None


def test_peer_access_is_recorded_between_gpus_that_allow_it(monkeypatch):
    gpus = [dict(TWO_GPUS[1], bus=f"00000000:{b:02x}:00.0", uuid=f"GPU-{b}") for b in (1, 2)]
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(gpus))
    monkeypatch.setattr(devices, "_torch_gpus", lambda: ([], None))
    first, second = discover_devices().gpus
    assert first.peer_access == ("0000:02:00.0",)
    assert second.peer_access == ("0000:01:00.0",)
    assert any("torch cannot use the GPUs" in n for n in discover_devices().notes)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA GeForce RTX 3090", ("rtx3090", True)),
        ("NVIDIA A100-SXM4-80GB", ("a100-80gb", True)),
        ("NVIDIA H200", ("h200", True)),
        ("NVIDIA B200", ("b200", False)),
    ],
)
def test_gpu_names_map_to_catalog_kinds_or_keep_their_own(name, expected):
    assert catalog_kind(name) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("00000000:01:00.0", "0000:01:00.0"),
        ("0000:4F:00.0", "0000:4f:00.0"),
        ("01:00.0", "0000:01:00.0"),
        ("not a bus", None),
    ],
)
def test_pci_bus_ids_from_nvml_and_torch_normalise_alike(text, expected):
    assert normalize_pci_bus_id(text) == expected


def test_asking_for_a_missing_cuda_device_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(devices, "_torch_gpus", lambda: ([], None))
    with pytest.raises(ConfigError, match=r"cuda:1.*not available here"):
        profile_machine(ProfileRequest(device="cuda:1", benchmark=False))


def test_cpu_microbenchmarks_measure_positive_flops_and_bandwidth(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    from hplan.planner.profiling.microbench import BenchSizes, benchmark_device

    tiny = BenchSizes(matmul_n={"float32": 64, "bfloat16": 64}, copy_bytes=2**20, window_s=0.01)
    before = torch.get_num_threads()
    result = benchmark_device(torch.device("cpu"), sizes=tiny, dtypes=("float32", "bfloat16"))
    assert torch.get_num_threads() == before
    assert result.num_threads == 1
    for stat in (*result.matmul_flops_per_s.values(), result.memory_bandwidth_bytes_per_s):
        assert stat.num_samples >= 3 and 0 < stat.p10 <= stat.median <= stat.p90
