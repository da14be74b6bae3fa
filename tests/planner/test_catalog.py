"""Device catalog: figures, forgiving lookup, dtype peaks."""

from __future__ import annotations

import pytest

from hplan.planner.hardware.catalog import (
    CATALOG,
    DeviceClass,
    device_type_names,
    lookup_device_type,
    peak_flops_per_s,
)
from hplan.runtime.contract.errors import ConfigError

REQUIRED_KEYS = {
    "rtx3060", "rtx3080", "rtx3090", "rtx4090", "a4000", "a5000", "a6000", "v100-16gb",
    "v100-32gb", "t4", "l4", "a10", "a100-40gb", "a100-80gb", "h100-sxm", "cpu",
}  # fmt: skip


def test_catalog_has_every_required_device_type():
    assert set(device_type_names()) >= REQUIRED_KEYS


@pytest.mark.parametrize("key", sorted(CATALOG))
def test_every_entry_has_positive_figures_and_a_source(key):
    device = CATALOG[key]
    assert device.memory_bytes > 0
    assert device.memory_bandwidth_bytes_per_s > 0
    assert device.fp32_flops_per_s > 0
    # Tensor cores never make a dtype slower than plain FP32.
    for tensor_peak in (device.tf32_flops_per_s, device.fp16_flops_per_s, device.bf16_flops_per_s):
        assert tensor_peak >= device.fp32_flops_per_s
    assert len(device.source) > 20


def test_only_geforce_cards_are_consumer_cards():
    consumer = {key for key, device in CATALOG.items() if device.consumer_card}
    assert consumer == {
        "rtx2080ti", "rtx3060", "rtx3080", "rtx3080-12gb", "rtx3090", "rtx3090ti",
        "rtx4060ti-16gb", "rtx4070", "rtx4070ti", "rtx4080", "rtx4090",
    }  # fmt: skip


def test_cpu_is_the_only_cpu_class_device():
    cpus = [k for k, d in CATALOG.items() if d.device_class is DeviceClass.CPU]
    assert cpus == ["cpu"]


def test_datasheet_figures_of_some_well_known_cards():
    gib = 2**30
    assert CATALOG["rtx3090"].memory_bytes == 24 * gib
    assert CATALOG["rtx3060"].memory_bytes == 12 * gib
    assert CATALOG["a100-80gb"].memory_bytes == 80 * gib
    assert CATALOG["rtx4090"].bf16_flops_per_s == pytest.approx(165.2e12)
    assert CATALOG["a100-40gb"].bf16_flops_per_s == pytest.approx(312e12)
    assert CATALOG["rtx3090"].memory_bandwidth_bytes_per_s == pytest.approx(936e9)
    assert CATALOG["h100-sxm"].memory_bandwidth_bytes_per_s == pytest.approx(3.35e12)


@pytest.mark.parametrize(
    ("spelling", "key"),
    [
        ("rtx3090", "rtx3090"),
        ("RTX 3090", "rtx3090"),
        ("rtx-3090", "rtx3090"),
        ("3090", "rtx3090"),
        ("NVIDIA GeForce RTX 3090", "rtx3090"),
        ("RTX_4090", "rtx4090"),
        ("3060", "rtx3060"),
        ("RTX 3060 12GB", "rtx3060"),
        ("NVIDIA RTX A6000", "a6000"),
        ("A5000", "a5000"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("A100 40GB", "a100-40gb"),
        ("Tesla V100-SXM2-16GB", "v100-16gb"),
        ("v100 32gb", "v100-32gb"),
        ("Tesla T4", "t4"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("H100 SXM", "h100-sxm"),
        ("CPU", "cpu"),
        ("NVIDIA GeForce RTX 2080 Ti", "rtx2080ti"),
        ("RTX 3080 12GB", "rtx3080-12gb"),
        ("NVIDIA GeForce RTX 3080", "rtx3080"),
        ("NVIDIA GeForce RTX 3090 Ti", "rtx3090ti"),
        ("RTX 4060 Ti 16GB", "rtx4060ti-16gb"),
        ("NVIDIA GeForce RTX 4070", "rtx4070"),
        ("NVIDIA GeForce RTX 4070 Ti", "rtx4070ti"),
        ("NVIDIA GeForce RTX 4080", "rtx4080"),
        ("NVIDIA A40", "a40"),
        ("NVIDIA L40S", "l40s"),
    ],
)
def test_lookup_forgives_spelling(spelling, key):
    assert lookup_device_type(spelling).key == key


def test_unknown_device_raises_config_error_listing_valid_names():
    with pytest.raises(ConfigError) as info:
        lookup_device_type("rtx9090")
    message = str(info.value)
    assert "rtx9090" in message
    assert all(key in message for key in CATALOG)
    assert info.value.exit_code == 2


@pytest.mark.parametrize("spelling", ["A100", "v100", "H100", "NVIDIA GeForce RTX 4060 Ti"])
def test_ambiguous_name_lists_the_candidates(spelling):
    with pytest.raises(ConfigError, match="ambiguous") as info:
        lookup_device_type(spelling)
    assert "-" in str(info.value).split(":")[-1]  # e.g. a100-40gb, a100-80gb


def test_peak_for_dtype_picks_fp32_or_tensor_core_rate():
    device = CATALOG["rtx4090"]
    assert peak_flops_per_s(device, "float32") == device.fp32_flops_per_s
    assert peak_flops_per_s(device, "bfloat16") == device.bf16_flops_per_s
    assert peak_flops_per_s(device, "float16") == device.fp16_flops_per_s
    assert peak_flops_per_s(device, "torch.bfloat16") == device.bf16_flops_per_s
    assert peak_flops_per_s(device, "float32", allow_tf32=True) == device.tf32_flops_per_s
    assert peak_flops_per_s(device, "bfloat16") > 1.5 * peak_flops_per_s(device, "float32")


def test_datasheet_figures_of_the_added_cards():
    """Each against its whitepaper or datasheet (see its ``source``), dense, in TFLOPS."""
    gib = 2**30
    figures = {  # key: (memory GiB, fp32, fp16 with fp32 accumulate, GB/s)
        "rtx2080ti": (11, 13.4, 53.8, 616),
        "rtx3080-12gb": (12, 30.6, 61.3, 912),
        "rtx3090ti": (24, 40.0, 80.0, 1008),
        "rtx4060ti-16gb": (16, 22.1, 44.1, 288),
        "rtx4070": (12, 29.1, 58.3, 504),
        "rtx4070ti": (12, 40.1, 80.2, 504),
        "rtx4080": (16, 48.7, 97.5, 716.8),
        "a40": (48, 37.4, 149.7, 696),
        "l40s": (48, 91.6, 362.05, 864),
    }
    for key, (memory_gib, fp32, fp16, bandwidth) in figures.items():
        device = CATALOG[key]
        assert device.memory_bytes == memory_gib * gib, key
        assert device.fp32_flops_per_s == pytest.approx(fp32 * 1e12), key
        assert device.fp16_flops_per_s == pytest.approx(fp16 * 1e12), key
        assert device.memory_bandwidth_bytes_per_s == pytest.approx(bandwidth * 1e9), key


def test_geforce_fp32_accumulate_is_half_the_rate_where_pro_cards_keep_the_full_rate():
    """GeForce Ampere/Ada: TF32 = FP32 CUDA-core rate = half of FP16 with FP32 accumulate;
    the workstation and data-centre parts run TF32 at half FP16, twice their FP32."""
    for key in ("rtx3080-12gb", "rtx3090ti", "rtx4060ti-16gb", "rtx4070", "rtx4070ti", "rtx4080"):
        device = CATALOG[key]
        assert device.tf32_flops_per_s == pytest.approx(device.fp16_flops_per_s / 2, rel=0.01)
        assert device.bf16_flops_per_s == device.fp16_flops_per_s
    for key in ("a40", "l40s"):
        device = CATALOG[key]
        assert device.tf32_flops_per_s == pytest.approx(2 * device.fp32_flops_per_s, rel=0.01)


def test_gpus_without_bf16_tensor_cores_get_their_fp32_rate():
    for key in ("v100-16gb", "t4", "rtx2080ti"):
        device = CATALOG[key]
        assert peak_flops_per_s(device, "bfloat16") == device.fp32_flops_per_s
        assert peak_flops_per_s(device, "float16") >= 4 * device.fp32_flops_per_s


def test_dtype_without_a_catalog_peak_raises_config_error():
    with pytest.raises(ConfigError, match="float64"):
        peak_flops_per_s(CATALOG["a100-80gb"], "float64")
