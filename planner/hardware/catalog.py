"""Device catalog: peak compute, memory and memory bandwidth of known GPUs (and a CPU).

Every figure is a vendor peak, not a measurement; the cost model applies its efficiency
factors on top (``hplan.planner.cost.problem_builder``). Conventions:

- FLOP/s are *dense* peaks at boost clock ("with sparsity" datasheet figures halved).
- ``fp16``/``bf16`` tensor peaks are with FP32 accumulation, as PyTorch's matmuls use it;
  GeForce cards (only) run it at half their FP16-accumulate rate (NVIDIA GA102 and Ada
  whitepapers, appendix tables). ``fp32`` is the CUDA-core rate (PyTorch's float32 matmuls
  use no TF32 by default since 1.12); without bf16 tensor cores (Volta, Turing) bf16 gets
  the fp32 rate, and without TF32 tf32 does.
- Memory sizes are the marketed capacity read as binary (a "24 GB" card has 24 GiB, as
  ``nvidia-smi`` shows 24576 MiB); memory bandwidth is the marketed peak, decimal bytes/s.
- A GeForce card without datasheet FLOP/s gets them from its CUDA cores, SM count and
  boost clock at its architecture whitepaper's per-SM rates, and its source says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.plan import CPU_KIND, Precision
from hplan.runtime.contract.quantities import (
    gb_per_s_to_bytes_per_s,
    gflops_to_flops,
    gib_to_bytes,
    tflops_to_flops,
)


class DeviceClass(StrEnum):
    """Broad kind of device; decides defaults such as the intra-node link."""

    GPU = "gpu"
    CPU = "cpu"


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceType:
    """One kind of device and its peak figures."""

    key: str
    """Catalog key, e.g. ``rtx4090``; what plans record as the device kind."""
    display_name: str
    device_class: DeviceClass
    memory_bytes: int
    fp32_flops_per_s: float
    """Dense FP32 peak on CUDA cores (non-tensor)."""
    tf32_flops_per_s: float
    """Dense TF32 tensor-core peak (the fp32 rate where the GPU has no TF32)."""
    fp16_flops_per_s: float
    """Dense FP16 tensor-core peak with FP32 accumulation."""
    bf16_flops_per_s: float
    """Dense BF16 tensor-core peak with FP32 accumulation (fp32 rate without bf16 cores)."""
    memory_bandwidth_bytes_per_s: float
    consumer_card: bool
    """GeForce-class card: PCIe peer-to-peer is unreliable, NCCL P2P must be disabled."""
    source: str
    """Where the figures come from."""
    aliases: tuple[str, ...] = ()
    """Other spellings (e.g. the name ``nvidia-smi`` prints)."""
    nvlink_bytes_per_s: float | None = None
    """NVLink bandwidth between two cards of this part, per direction; None: the part has
    no NVLink (cluster.yaml cannot declare it)."""
    nvlink_by_default: bool = False
    """Whether every pair of cards of one node is joined by NVLink unless cluster.yaml says
    otherwise (SXM boards behind NVSwitch or an all-to-all NVLink mesh)."""


_GA102_WP = "NVIDIA Ampere GA102 GPU Architecture whitepaper v2.0, appendix A"
_ADA_WP = "NVIDIA Ada GPU Architecture whitepaper v2.1, appendix A"
_TURING_WP = "NVIDIA Turing GPU Architecture whitepaper WP-09183-001, appendix A"
_GA10X_PER_SM = (
    "; tensor rates per SM as for GA10x GeForce in " + _GA102_WP + " (dense FP16 with FP32 "
    "accumulate 512 FLOP per SM per clock, TF32 half of that)"
)
_ADA_PER_SM = (
    "; tensor rates per SM as for Ada GeForce in " + _ADA_WP + " (dense FP16 with FP32 "
    "accumulate 512 FLOP per SM per clock, TF32 half of that)"
)
_PRO_NOTE = (
    "dense tensor peaks are half the datasheet's sparse 'Tensor Performance'; TF32 is half "
    "of FP16, as on the GA102 data-centre parts (NVIDIA A10 and A40 datasheets)"
)


def _gpu(
    key: str,
    name: str,
    *,
    memory_gib: float,
    fp32_tflops: float,
    tf32_tflops: float,
    fp16_tflops: float,
    bf16_tflops: float,
    bandwidth_gb_per_s: float,
    consumer: bool,
    source: str,
    aliases: tuple[str, ...] = (),
    nvlink_gb_per_s: float | None = None,
    nvlink_by_default: bool = False,
) -> DeviceType:
    return DeviceType(
        key=key,
        display_name=name,
        device_class=DeviceClass.GPU,
        memory_bytes=int(gib_to_bytes(memory_gib)),
        fp32_flops_per_s=tflops_to_flops(fp32_tflops),
        tf32_flops_per_s=tflops_to_flops(tf32_tflops),
        fp16_flops_per_s=tflops_to_flops(fp16_tflops),
        bf16_flops_per_s=tflops_to_flops(bf16_tflops),
        memory_bandwidth_bytes_per_s=gb_per_s_to_bytes_per_s(bandwidth_gb_per_s),
        consumer_card=consumer,
        source=source,
        aliases=aliases,
        nvlink_bytes_per_s=(
            None if nvlink_gb_per_s is None else gb_per_s_to_bytes_per_s(nvlink_gb_per_s)
        ),
        nvlink_by_default=nvlink_by_default,
    )


# fmt: off
_GPUS = (
    _gpu("rtx3060", "GeForce RTX 3060 12 GB", memory_gib=12, fp32_tflops=12.7,
         tf32_tflops=12.7, fp16_tflops=25.5, bf16_tflops=25.5, bandwidth_gb_per_s=360,
         consumer=True, aliases=("rtx3060-12gb", "3060 12gb"),
         source="NVIDIA GeForce RTX 3060 product specifications (3584 CUDA cores, 1.78 GHz "
                "boost, 192-bit 15 Gbps GDDR6); tensor rates per SM as for GA10x GeForce in "
                + _GA102_WP),
    _gpu("rtx3080", "GeForce RTX 3080 10 GB", memory_gib=10, fp32_tflops=29.8,
         tf32_tflops=29.8, fp16_tflops=59.5, bf16_tflops=59.5, bandwidth_gb_per_s=760,
         consumer=True, aliases=("rtx3080-10gb",),
         source=_GA102_WP + ", GeForce RTX 3080 column"),
    _gpu("rtx3090", "GeForce RTX 3090", memory_gib=24, fp32_tflops=35.6, tf32_tflops=35.6,
         fp16_tflops=71.0, bf16_tflops=71.0, bandwidth_gb_per_s=936, consumer=True,
         source=_GA102_WP + ", GeForce RTX 3090 column; NVLink bridge 112.5 GB/s both "
                "directions together (NVIDIA RTX 3090 product page)",
         nvlink_gb_per_s=56.25),
    _gpu("rtx4090", "GeForce RTX 4090", memory_gib=24, fp32_tflops=82.6, tf32_tflops=82.6,
         fp16_tflops=165.2, bf16_tflops=165.2, bandwidth_gb_per_s=1008, consumer=True,
         source=_ADA_WP + ", GeForce RTX 4090 column"),
    _gpu("rtx2080ti", "GeForce RTX 2080 Ti", memory_gib=11, fp32_tflops=13.4,
         tf32_tflops=13.4, fp16_tflops=53.8, bf16_tflops=13.4, bandwidth_gb_per_s=616,
         consumer=True, aliases=("rtx2080ti-11gb",),
         source=_TURING_WP + ", GeForce RTX 2080 Ti reference column (4352 CUDA cores, "
                "1545 MHz boost: 13.4 TFLOPS FP32; FP16 tensor 53.8 TFLOPS with FP32 "
                "accumulate, 107.6 with FP16 accumulate; 352-bit 14 Gbps GDDR6, 616 GB/s); "
                "Turing has no TF32 or BF16 tensor cores (fp32 rate)"),
    _gpu("rtx3080-12gb", "GeForce RTX 3080 12 GB", memory_gib=12, fp32_tflops=30.6,
         tf32_tflops=30.6, fp16_tflops=61.3, bf16_tflops=61.3, bandwidth_gb_per_s=912,
         consumer=True,
         source="NVIDIA GeForce RTX 3080 family specifications, 12 GB model (8960 CUDA "
                "cores in 70 SMs, 1.71 GHz boost, 384-bit 19 Gbps GDDR6X: 912 GB/s)"
                + _GA10X_PER_SM),
    _gpu("rtx3090ti", "GeForce RTX 3090 Ti", memory_gib=24, fp32_tflops=40.0,
         tf32_tflops=40.0, fp16_tflops=80.0, bf16_tflops=80.0, bandwidth_gb_per_s=1008,
         consumer=True,
         source=_ADA_WP + ", GeForce RTX 3090 Ti column (10752 CUDA cores, 1860 MHz boost: "
                "40 TFLOPS FP32, 80 FP16 tensor with FP32 accumulate, 40 TF32; 1008 GB/s)"),
    _gpu("rtx4060ti-16gb", "GeForce RTX 4060 Ti 16 GB", memory_gib=16, fp32_tflops=22.1,
         tf32_tflops=22.1, fp16_tflops=44.1, bf16_tflops=44.1, bandwidth_gb_per_s=288,
         consumer=True,
         source="NVIDIA GeForce RTX 4060 Ti family specifications, 16 GB model (4352 CUDA "
                "cores in 34 SMs, 2.535 GHz boost, 128-bit 18 Gbps GDDR6: 288 GB/s)"
                + _ADA_PER_SM),
    _gpu("rtx4070", "GeForce RTX 4070", memory_gib=12, fp32_tflops=29.1, tf32_tflops=29.1,
         fp16_tflops=58.3, bf16_tflops=58.3, bandwidth_gb_per_s=504, consumer=True,
         source="NVIDIA GeForce RTX 4070 specifications (5888 CUDA cores in 46 SMs, 2.475 GHz "
                "boost, 192-bit 21 Gbps GDDR6X: 504 GB/s)" + _ADA_PER_SM),
    _gpu("rtx4070ti", "GeForce RTX 4070 Ti", memory_gib=12, fp32_tflops=40.1,
         tf32_tflops=40.1, fp16_tflops=80.2, bf16_tflops=80.2, bandwidth_gb_per_s=504,
         consumer=True,
         source="NVIDIA GeForce RTX 4070 Ti specifications (7680 CUDA cores in 60 SMs, "
                "2.61 GHz boost, 192-bit 21 Gbps GDDR6X: 504 GB/s)" + _ADA_PER_SM),
    _gpu("rtx4080", "GeForce RTX 4080", memory_gib=16, fp32_tflops=48.7, tf32_tflops=48.7,
         fp16_tflops=97.5, bf16_tflops=97.5, bandwidth_gb_per_s=716.8, consumer=True,
         aliases=("rtx4080-16gb",),
         source=_ADA_WP + ", GeForce RTX 4080 (16 GB) column (9728 CUDA cores, 2505 MHz "
                "boost: 48.7 TFLOPS FP32, 97.5 FP16 tensor with FP32 accumulate, 48.7 TF32; "
                "256-bit 22.4 Gbps GDDR6X, 716.8 GB/s)"),
    _gpu("a4000", "RTX A4000", memory_gib=16, fp32_tflops=19.2, tf32_tflops=38.4,
         fp16_tflops=76.7, bf16_tflops=76.7, bandwidth_gb_per_s=448, consumer=False,
         source="NVIDIA RTX A4000 datasheet (19.2 TFLOPS FP32, 153.4 TFLOPS tensor with "
                "sparsity, 448 GB/s); " + _PRO_NOTE),
    _gpu("a5000", "RTX A5000", memory_gib=24, fp32_tflops=27.8, tf32_tflops=55.6,
         fp16_tflops=111.1, bf16_tflops=111.1, bandwidth_gb_per_s=768, consumer=False,
         source="NVIDIA RTX A5000 datasheet (27.8 TFLOPS FP32, 222.2 TFLOPS tensor with "
                "sparsity, 768 GB/s); " + _PRO_NOTE),
    _gpu("a6000", "RTX A6000", memory_gib=48, fp32_tflops=38.7, tf32_tflops=77.4,
         fp16_tflops=154.8, bf16_tflops=154.8, bandwidth_gb_per_s=768, consumer=False,
         source="NVIDIA RTX A6000 datasheet (38.7 TFLOPS FP32, 309.7 TFLOPS tensor with "
                "sparsity, 768 GB/s); " + _PRO_NOTE),
    _gpu("v100-16gb", "Tesla V100 16 GB (SXM2)", memory_gib=16, fp32_tflops=15.7,
         tf32_tflops=15.7, fp16_tflops=125.0, bf16_tflops=15.7, bandwidth_gb_per_s=900,
         consumer=False, aliases=("v100-sxm2-16gb", "v100-pcie-16gb"),
         source="NVIDIA Tesla V100 GPU Accelerator datasheet, SXM2 column (15.7 TFLOPS FP32, "
                "125 TFLOPS tensor, 900 GB/s); no TF32 or BF16 tensor cores (fp32 rate)"),
    _gpu("v100-32gb", "Tesla V100 32 GB (SXM2)", memory_gib=32, fp32_tflops=15.7,
         tf32_tflops=15.7, fp16_tflops=125.0, bf16_tflops=15.7, bandwidth_gb_per_s=900,
         consumer=False, aliases=("v100-sxm2-32gb", "v100-pcie-32gb"),
         source="NVIDIA Tesla V100 GPU Accelerator datasheet, SXM2 column (15.7 TFLOPS FP32, "
                "125 TFLOPS tensor, 900 GB/s); no TF32 or BF16 tensor cores (fp32 rate)"),
    _gpu("t4", "Tesla T4", memory_gib=16, fp32_tflops=8.1, tf32_tflops=8.1,
         fp16_tflops=65.0, bf16_tflops=8.1, bandwidth_gb_per_s=320, consumer=False,
         aliases=("tesla t4",),
         source="NVIDIA T4 datasheet (8.1 TFLOPS FP32, 65 TFLOPS FP16/FP32 mixed precision, "
                "320 GB/s); Turing has no TF32 or BF16 tensor cores (fp32 rate)"),
    _gpu("l4", "L4", memory_gib=24, fp32_tflops=30.3, tf32_tflops=60.0, fp16_tflops=121.0,
         bf16_tflops=121.0, bandwidth_gb_per_s=300, consumer=False,
         source="NVIDIA L4 datasheet (30.3 TFLOPS FP32; 120 TF32 and 242 FP16/BF16 TFLOPS "
                "with sparsity, halved here; 300 GB/s)"),
    _gpu("a10", "A10", memory_gib=24, fp32_tflops=31.2, tf32_tflops=62.5, fp16_tflops=125.0,
         bf16_tflops=125.0, bandwidth_gb_per_s=600, consumer=False,
         source="NVIDIA A10 datasheet (31.2 TFLOPS FP32, 62.5 TF32, 125 FP16/BF16 dense, "
                "600 GB/s)"),
    _gpu("a40", "A40", memory_gib=48, fp32_tflops=37.4, tf32_tflops=74.8,
         fp16_tflops=149.7, bf16_tflops=149.7, bandwidth_gb_per_s=696, consumer=False,
         source="NVIDIA A40 datasheet (37.4 TFLOPS FP32; 149.6 TF32 and 299.4 FP16/BF16 "
                "TFLOPS with sparsity, halved here; 48 GB GDDR6 with ECC, 696 GB/s); "
                "workstation-class GA102, FP32 accumulate at the full tensor rate"),
    _gpu("l40s", "L40S", memory_gib=48, fp32_tflops=91.6, tf32_tflops=183.0,
         fp16_tflops=362.05, bf16_tflops=362.05, bandwidth_gb_per_s=864, consumer=False,
         source="NVIDIA L40S datasheet (91.6 TFLOPS FP32; 366 TF32 and 733 FP16/BF16 TFLOPS "
                "with sparsity, halved here; 48 GB GDDR6 with ECC, 864 GB/s); data-centre "
                "Ada, FP32 accumulate at the full tensor rate"),
    _gpu("a100-40gb", "A100 40 GB", memory_gib=40, fp32_tflops=19.5, tf32_tflops=156.0,
         fp16_tflops=312.0, bf16_tflops=312.0, bandwidth_gb_per_s=1555, consumer=False,
         aliases=("a100-sxm4-40gb", "a100-pcie-40gb"),
         source="NVIDIA A100 Tensor Core GPU datasheet, 40 GB column (19.5 TFLOPS FP32, "
                "156 TF32, 312 FP16/BF16 dense, 1555 GB/s)"),
    _gpu("a100-80gb", "A100 80 GB (SXM)", memory_gib=80, fp32_tflops=19.5, tf32_tflops=156.0,
         fp16_tflops=312.0, bf16_tflops=312.0, bandwidth_gb_per_s=2039, consumer=False,
         aliases=("a100-sxm4-80gb", "a100 80gb pcie"),
         source="NVIDIA A100 Tensor Core GPU datasheet, 80 GB SXM column (19.5 TFLOPS FP32, "
                "156 TF32, 312 FP16/BF16 dense, 2039 GB/s; the PCIe card has 1935 GB/s)",
         nvlink_gb_per_s=300.0, nvlink_by_default=True),
    _gpu("h100-sxm", "H100 SXM5 80 GB", memory_gib=80, fp32_tflops=67.0, tf32_tflops=494.5,
         fp16_tflops=989.5, bf16_tflops=989.5, bandwidth_gb_per_s=3350, consumer=False,
         aliases=("h100-sxm5", "h100-sxm5-80gb", "h100 80gb hbm3"),
         source="NVIDIA H100 Tensor Core GPU datasheet, SXM column (67 TFLOPS FP32; 989 TF32 "
                "and 1979 FP16/BF16 TFLOPS with sparsity, halved here; 3.35 TB/s)",
         nvlink_gb_per_s=450.0, nvlink_by_default=True),
    _gpu("h100-pcie", "H100 PCIe 80 GB", memory_gib=80, fp32_tflops=51.0, tf32_tflops=378.0,
         fp16_tflops=756.5, bf16_tflops=756.5, bandwidth_gb_per_s=2000, consumer=False,
         aliases=("h100-pcie-80gb",),
         source="NVIDIA H100 Tensor Core GPU datasheet, PCIe column (51 TFLOPS FP32; 756 TF32 "
                "and 1513 FP16/BF16 TFLOPS with sparsity, halved here; 2 TB/s)"),
    _gpu("h200", "H200 SXM 141 GB", memory_gib=140, fp32_tflops=67.0, tf32_tflops=494.5,
         fp16_tflops=989.5, bf16_tflops=989.5, bandwidth_gb_per_s=4800, consumer=False,
         aliases=("h200-sxm", "h200-sxm-141gb"),
         source="NVIDIA H200 Tensor Core GPU datasheet, SXM column (67 TFLOPS FP32; 989 TF32 "
                "and 1979 FP16/BF16 TFLOPS with sparsity, halved here; 4.8 TB/s); memory "
                "143771 MiB as nvidia-smi reports it on one card (140 GiB)",
         nvlink_gb_per_s=450.0, nvlink_by_default=True),
)
# fmt: on

# The nominal rehearsal CPU: one process on one core. Assumed, not measured:
#   100 GFLOP/s: one x86 core with AVX2 FMA at about 3 GHz does
#       2 FMA units x 8 fp32 lanes x 2 FLOP x 3e9 Hz = 96 GFLOP/s (same for every dtype);
#   20 GB/s: about one DDR4-3200 channel (25.6 GB/s peak), rounded down;
#   4 GiB: a rehearsal budget small enough that several such devices fit one laptop.
CPU = DeviceType(
    key=CPU_KIND,
    display_name="CPU (nominal rehearsal device)",
    device_class=DeviceClass.CPU,
    memory_bytes=int(gib_to_bytes(4)),
    fp32_flops_per_s=gflops_to_flops(100),
    tf32_flops_per_s=gflops_to_flops(100),
    fp16_flops_per_s=gflops_to_flops(100),
    bf16_flops_per_s=gflops_to_flops(100),
    memory_bandwidth_bytes_per_s=gb_per_s_to_bytes_per_s(20),
    consumer_card=False,
    source="nominal, not measured: 100 GFLOP/s (one AVX2 core at ~3 GHz), 20 GB/s (one "
    "DDR4-3200 channel), 4 GiB rehearsal budget",
)

CATALOG: dict[str, DeviceType] = {d.key: d for d in (*_GPUS, CPU)}
"""Every known device type by catalog key, in a fixed order."""

# Spellings that match more than one entry, or a card the catalog has in one memory size
# only; they must be made specific. nvidia-smi prints "NVIDIA GeForce RTX 4060 Ti" for the
# 8 GB and the 16 GB card alike (an 8 GB card: describe it with ``custom``). The 3080 12 GB
# prints "NVIDIA GeForce RTX 3080" like the 10 GB card, which that name keeps finding.
_AMBIGUOUS = {
    "4060ti": ("rtx4060ti-16gb",),
    "a100": ("a100-40gb", "a100-80gb"),
    "v100": ("v100-16gb", "v100-32gb"),
    "h100": ("h100-sxm", "h100-pcie"),
    "h10080g": ("h100-sxm", "h100-pcie"),
}
_VENDOR_WORDS = ("nvidia", "geforce", "tesla", "quadro", "rtx")


def normalize_name(name: str) -> str:
    """Reduce a device name to a lookup key: lower case, letters and digits only, no vendor
    words, ``GB``/``GiB`` written ``g``.

    Example: ``"NVIDIA GeForce RTX 3090"`` -> ``"3090"``; ``"A100-SXM4-80GB"`` ->
    ``"a100sxm480g"``.
    """
    text = re.sub(r"[^a-z0-9]", "", name.lower())
    text = text.replace("gib", "g").replace("gb", "g")
    stripped = True
    while stripped:
        stripped = False
        for word in _VENDOR_WORDS:
            if text.startswith(word) and len(text) > len(word):
                text = text[len(word) :]
                stripped = True
    return text


def _build_index() -> dict[str, str]:
    index: dict[str, str] = {}
    for device in CATALOG.values():
        for spelling in (device.key, device.display_name, *device.aliases):
            norm = normalize_name(spelling)
            assert index.get(norm, device.key) == device.key, f"alias clash: {spelling}"
            index[norm] = device.key
    assert not set(index) & set(_AMBIGUOUS), "an ambiguous spelling is also an alias"
    return index


_INDEX = _build_index()


def device_type_names() -> tuple[str, ...]:
    """Catalog keys in catalog order."""
    return tuple(CATALOG)


def lookup_device_type(name: str) -> DeviceType:
    """Find a catalog entry by a forgiving spelling of its name.

    Args:
        name: e.g. ``rtx3090``, ``RTX 3090``, ``rtx-3090``, ``3090``,
            ``NVIDIA A100-SXM4-80GB``.

    Raises:
        ConfigError: the name matches no entry, or more than one (the message lists the
            candidates or every valid name).
    """
    norm = normalize_name(name)
    if norm in _INDEX:
        return CATALOG[_INDEX[norm]]
    if norm in _AMBIGUOUS:
        options = ", ".join(_AMBIGUOUS[norm])
        raise ConfigError(f"device type {name!r} is ambiguous; write one of: {options}")
    valid = ", ".join(CATALOG)
    raise ConfigError(
        f"unknown device type {name!r}; valid names: {valid} (or describe the device "
        "explicitly with `custom`, memory, peak_tflops and memory_bandwidth_gb_per_s)"
    )


_DTYPE_ALIASES = {
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
}


class PrecisionRequest(StrEnum):
    """What ``--precision`` accepts: ``auto`` (:func:`resolve_precision` picks per device) or
    a ``Precision`` for every device."""

    AUTO = "auto"
    FP32 = Precision.FP32.value
    TF32 = Precision.TF32.value
    BF16 = Precision.BF16.value
    FP16 = Precision.FP16.value


def has_bf16_tensor_cores(device: DeviceType) -> bool:
    """A GPU whose bf16 peak beats its fp32 one (Ampere and later; not Volta or Turing)."""
    return device.bf16_flops_per_s > device.fp32_flops_per_s


def runs_on_tensor_cores(device: DeviceType, dtype: str, *, allow_tf32: bool = False) -> bool:
    """Whether matmuls and convolutions in ``dtype`` run on ``device``'s tensor cores:
    float16 where its fp16 peak beats its fp32 one (Volta and later), bfloat16 and TF32
    (float32 with ``allow_tf32``) on GPUs with bf16 tensor cores (both came with Ampere; a
    GeForce Ampere or Ada card's TF32 peak equals its fp32 one, so peaks alone cannot tell).

    Raises:
        ConfigError: a dtype with no catalog peak.
    """
    short = _DTYPE_ALIASES.get(dtype.removeprefix("torch."))
    if device.device_class is not DeviceClass.GPU:
        return False
    if short == "float16":
        return device.fp16_flops_per_s > device.fp32_flops_per_s
    if short == "bfloat16" or (short == "float32" and allow_tf32):
        return has_bf16_tensor_cores(device)
    if short == "float32":
        return False
    peak_flops_per_s(device, dtype)  # raises the one-line error for a dtype with no peak
    return False


def resolve_precision(
    requested: PrecisionRequest | str, device: DeviceType, *, device_name: str
) -> Precision:
    """The precision a device computes in for ``--precision requested``.

    ``auto``: on a GPU, bf16 autocast where it has bf16 tensor cores, else fp16 autocast
    with loss scaling where it has fp16 tensor cores (Volta, Turing), else fp32; on a CPU,
    fp32 (PyTorch's defaults; CPU autocast is a choice to make by hand). A named precision
    applies as given, except bf16 on a GPU without bf16 tensor cores and tf32 on a device
    without TF32 (a CPU, Volta, Turing).

    Raises:
        ConfigError: an unknown name, bf16 asked of a GPU without bf16 tensor cores, or tf32
            of a device without TF32.
    """
    choices = [r.value for r in PrecisionRequest]
    if requested not in choices:
        raise ConfigError(f"precision {requested!r} is not one of {', '.join(choices)}")
    gpu = device.device_class is DeviceClass.GPU
    if requested != PrecisionRequest.AUTO:
        precision = Precision(requested)
        if precision is Precision.BF16 and gpu and not has_bf16_tensor_cores(device):
            raise ConfigError(
                f"{device_name} ({device.display_name}) has no bf16 tensor cores; use "
                "--precision fp16 (loss-scaled) or auto"
            )
        # TF32 came with bf16 tensor cores (Ampere); GeForce Ampere's TF32 rate equals its
        # FP32 one, so the rates alone do not tell.
        if precision is Precision.TF32 and not (gpu and has_bf16_tensor_cores(device)):
            raise ConfigError(
                f"{device_name} ({device.display_name}) has no TF32; use --precision fp32"
                + (", fp16 (loss-scaled) or auto" if gpu else " or auto")
            )
        return precision
    if not gpu:
        return Precision.FP32
    if has_bf16_tensor_cores(device):
        return Precision.BF16
    if device.fp16_flops_per_s > device.fp32_flops_per_s:
        return Precision.FP16
    return Precision.FP32


def compute_dtype(precision: Precision, param_dtype: str) -> str:
    """torch dtype name the matmuls of a rank run in: the autocast dtype, else the
    parameter dtype."""
    return precision.autocast_dtype or param_dtype


def peak_flops_per_s(device: DeviceType, dtype: str, *, allow_tf32: bool = False) -> float:
    """Dense peak FLOP/s of ``device`` for matmuls on parameters of ``dtype``.

    ``float32`` -> the non-tensor FP32 peak (or TF32 when ``allow_tf32``, matching
    ``torch.backends.cuda.matmul.allow_tf32``); ``bfloat16``/``float16`` -> the tensor-core
    peak with FP32 accumulation.

    Args:
        dtype: torch dtype name, with or without the ``torch.`` prefix.

    Raises:
        ConfigError: a dtype with no catalog peak (e.g. ``float64``).
    """
    short = _DTYPE_ALIASES.get(dtype.removeprefix("torch."))
    if short == "float32":
        return device.tf32_flops_per_s if allow_tf32 else device.fp32_flops_per_s
    if short == "float16":
        return device.fp16_flops_per_s
    if short == "bfloat16":
        return device.bf16_flops_per_s
    raise ConfigError(
        f"parameter dtype {dtype!r} has no peak in the device catalog; train in float32, "
        "bfloat16 or float16"
    )
