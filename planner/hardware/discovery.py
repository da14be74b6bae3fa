"""Device discovery: which GPUs (and which CPU) this machine has, and what they are.

NVIDIA GPUs are read from NVML (``nvidia-ml-py``, module ``pynvml``; install
``hplan[nvml]``: name, UUID, memory, clocks, power limit, PCIe and NVLink links, peer
access) and from ``torch.cuda`` (the device index torch uses, compute capability, SM count,
peer access), joined on the PCI bus id: their device orders differ unless
``CUDA_DEVICE_ORDER=PCI_BUS_ID``. ``pynvml`` is imported inside :func:`discover_devices`
only, so importing hplan never initialises NVML. Without the library or a driver (case S4)
the machine reports no NVIDIA GPUs and hplan profiles the CPU instead; with torch's CUDA
but no ``nvidia-ml-py``, GPUs are found from torch alone (without clocks and power). Each
GPU's name is mapped to a catalog kind (``catalog.lookup_device_type``); a GPU the catalog
does not know keeps a kind made from its name (``NVIDIA H200`` -> ``h200``) and says so.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import platform
import re
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hplan.planner.hardware.catalog import lookup_device_type, normalize_name
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.quantities import format_bytes

Detail = str | int | float | bool


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuInfo:
    """One NVIDIA GPU of this machine. ``None``: not reported by the sources at hand."""

    name: str
    kind: str
    """Device-catalog kind (``rtx3090``), or a kind made from the name when not in it."""
    in_catalog: bool
    uuid: str | None = None
    """NVML UUID, ``GPU-xxxxxxxx-...``."""
    pci_bus_id: str | None = None
    """``dddd:bb:dd.f`` in lower-case hex (see :func:`normalize_pci_bus_id`)."""
    torch_index: int | None = None
    """``cuda:<index>`` in this process; None when torch cannot use the GPU."""
    memory_total_bytes: int = 0
    memory_free_bytes: int | None = None
    sm_clock_max_mhz: int | None = None
    memory_clock_max_mhz: int | None = None
    power_limit_w: float | None = None
    pcie_generation: int | None = None
    pcie_width: int | None = None
    nvlink_active_links: int | None = None
    peer_access: tuple[str, ...] = ()
    """PCI bus ids of the local GPUs this one can read from directly (peer to peer)."""
    compute_capability: str | None = None
    num_sms: int | None = None

    def details(self) -> dict[str, Detail]:
        """The discovered facts as a flat JSON-native dict (for ``DeviceProfile.details``)."""
        facts: dict[str, Detail | None] = {
            "in_catalog": self.in_catalog,
            "torch_index": self.torch_index,
            "memory_free_bytes": self.memory_free_bytes,
            "sm_clock_max_mhz": self.sm_clock_max_mhz,
            "memory_clock_max_mhz": self.memory_clock_max_mhz,
            "power_limit_w": self.power_limit_w,
            "pcie_generation": self.pcie_generation,
            "pcie_width": self.pcie_width,
            "nvlink_active_links": self.nvlink_active_links,
            "peer_access": ",".join(self.peer_access),
            "compute_capability": self.compute_capability,
            "num_sms": self.num_sms,
        }
        return {k: v for k, v in facts.items() if v is not None}


@dataclass(frozen=True, slots=True, kw_only=True)
class CpuInfo:
    """This machine's CPU (profiled when there is no usable GPU)."""

    name: str
    memory_total_bytes: int
    memory_available_bytes: int | None
    num_cores: int

    def details(self) -> dict[str, Detail]:
        """The discovered facts as a flat JSON-native dict."""
        facts: dict[str, Detail | None] = {
            "num_cores": self.num_cores,
            "memory_available_bytes": self.memory_available_bytes,
        }
        return {k: v for k, v in facts.items() if v is not None}


@dataclass(frozen=True, slots=True, kw_only=True)
class Discovery:
    """What :func:`discover_devices` found."""

    host: str
    gpus: tuple[GpuInfo, ...]
    """Ordered by PCI bus id (as ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` numbers them)."""
    cpu: CpuInfo
    notes: tuple[str, ...] = field(default=())
    """Why a source was unavailable (no nvidia-ml-py, no driver, torch without CUDA)."""

    @property
    def usable_gpus(self) -> tuple[GpuInfo, ...]:
        """GPUs torch can run on in this process."""
        return tuple(g for g in self.gpus if g.torch_index is not None)


def discover_devices() -> Discovery:
    """Find this machine's NVIDIA GPUs (NVML + torch.cuda, joined on PCI bus id) and CPU.

    Never raises for a missing library or driver: the reason becomes a note and the GPUs
    are those the remaining source reports (none without a driver).
    """
    notes: list[str] = []
    nvml_gpus, nvml_note = _nvml_gpus()
    torch_gpus, torch_note = _torch_gpus()
    notes += [n for n in (nvml_note, torch_note) if n]
    gpus = join_gpus(nvml_gpus, torch_gpus)
    if gpus and not any(g.torch_index is not None for g in gpus):
        notes.append("torch cannot use the GPUs here (no CUDA build or driver); profiling the CPU")
    return Discovery(host=host_name(), gpus=gpus, cpu=cpu_info(), notes=tuple(notes))


def host_name() -> str:
    """This machine's short host name (``localhost`` if it has none)."""
    return socket.gethostname().split(".")[0] or "localhost"


# ------------------------------------------------------------------------------------ CPU
def cpu_info() -> CpuInfo:
    """CPU model name (``/proc/cpuinfo``, else ``platform``), memory (``os.sysconf``), cores."""
    return CpuInfo(
        name=_cpu_name(),
        memory_total_bytes=_sysconf_bytes("SC_PHYS_PAGES") or 0,
        memory_available_bytes=_sysconf_bytes("SC_AVPHYS_PAGES"),
        num_cores=os.cpu_count() or 1,
    )


def _cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as file:
        for line in file:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def _sysconf_bytes(name: str) -> int | None:
    try:
        return int(os.sysconf(name)) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


# ----------------------------------------------------------------------------- joining
def normalize_pci_bus_id(bus_id: str) -> str | None:
    """``00000000:01:00.0`` (NVML), ``0000:01:00.0`` or ``01:00.0`` -> ``0000:01:00.0``.

    Returns None for text that is not a PCI address.
    """
    match = re.fullmatch(
        r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])",
        bus_id.strip(),
    )
    if match is None:
        return None
    domain, bus, device, function = match.groups()
    return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{function}"


def catalog_kind(name: str) -> tuple[str, bool]:
    """(catalog kind, True) for a known device name, else (a kind made from the name, False).

    Example: ``NVIDIA GeForce RTX 3090`` -> ``("rtx3090", True)``; ``NVIDIA H200`` ->
    ``("h200", False)``.
    """
    try:
        return lookup_device_type(name).key, True
    except ConfigError:
        return normalize_name(name) or "gpu", False


def join_gpus(nvml: Sequence[GpuInfo], torch_gpus: Sequence[GpuInfo]) -> tuple[GpuInfo, ...]:
    """One entry per physical GPU: NVML's facts plus torch's index and properties.

    GPUs are matched on PCI bus id; one seen by a single source keeps that source's facts.
    Peer access is the union of what both sources report. Ordered by PCI bus id.
    """
    by_bus = {g.pci_bus_id: g for g in nvml if g.pci_bus_id}
    joined = [g for g in nvml if not g.pci_bus_id]
    for tg in torch_gpus:
        ng = by_bus.pop(tg.pci_bus_id, None) if tg.pci_bus_id else None
        if ng is None:
            joined.append(tg)
            continue
        joined.append(
            replace(
                ng,
                torch_index=tg.torch_index,
                compute_capability=tg.compute_capability,
                num_sms=tg.num_sms,
                uuid=ng.uuid or tg.uuid,
                peer_access=tuple(sorted({*ng.peer_access, *tg.peer_access})),
            )
        )
    joined.extend(by_bus.values())
    return tuple(sorted(joined, key=lambda g: (g.pci_bus_id or "~", g.torch_index or 0)))


# -------------------------------------------------------------------------------- NVML
def _nvml_gpus() -> tuple[list[GpuInfo], str | None]:
    """GPUs as NVML reports them, or ([], why not)."""
    try:
        nvml: Any = importlib.import_module("pynvml")
    except ImportError:
        return [], "nvidia-ml-py is not installed (pip install 'hplan[nvml]' for clocks and power)"
    try:
        nvml.nvmlInit()
    except Exception as exc:
        return [], f"no NVIDIA driver: NVML did not initialise ({_text(exc)})"
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        gpus = [_nvml_gpu(nvml, h) for h in handles]
        return _with_nvml_peers(nvml, handles, gpus), None
    except Exception as exc:
        return [], f"NVML failed while listing GPUs ({_text(exc)})"
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _nvml_gpu(nvml: Any, handle: Any) -> GpuInfo:
    name = _text(nvml.nvmlDeviceGetName(handle))
    kind, known = catalog_kind(name)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    power_mw = _optional(nvml.nvmlDeviceGetPowerManagementLimit, handle)
    return GpuInfo(
        name=name,
        kind=kind,
        in_catalog=known,
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        pci_bus_id=normalize_pci_bus_id(_text(nvml.nvmlDeviceGetPciInfo(handle).busId)),
        memory_total_bytes=int(memory.total),
        memory_free_bytes=int(memory.free),
        sm_clock_max_mhz=_optional(nvml.nvmlDeviceGetMaxClockInfo, handle, nvml.NVML_CLOCK_SM),
        memory_clock_max_mhz=_optional(nvml.nvmlDeviceGetMaxClockInfo, handle, nvml.NVML_CLOCK_MEM),
        power_limit_w=None if power_mw is None else power_mw / 1000.0,
        pcie_generation=_optional(nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
        pcie_width=_optional(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
        nvlink_active_links=_nvlink_links(nvml, handle),
    )


def _nvlink_links(nvml: Any, handle: Any) -> int | None:
    """Active NVLink links; None when the GPU has no NVLink (the query is not supported)."""
    active = 0
    supported = False
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        state = _optional(nvml.nvmlDeviceGetNvLinkState, handle, link)
        if state is None:
            continue
        supported = True
        active += int(state == getattr(nvml, "NVML_FEATURE_ENABLED", 1))
    return active if supported else None


def _with_nvml_peers(nvml: Any, handles: Sequence[Any], gpus: list[GpuInfo]) -> list[GpuInfo]:
    read = getattr(nvml, "NVML_P2P_CAPS_INDEX_READ", 0)
    ok = getattr(nvml, "NVML_P2P_STATUS_OK", 0)
    result = []
    for i, gpu in enumerate(gpus):
        peers = [
            other.pci_bus_id
            for j, other in enumerate(gpus)
            if j != i
            and other.pci_bus_id
            and _optional(nvml.nvmlDeviceGetP2PStatus, handles[i], handles[j], read) == ok
        ]
        result.append(replace(gpu, peer_access=tuple(sorted(p for p in peers if p))))
    return result


def _optional(call: Any, *args: Any) -> Any:
    """``call(*args)``, or None when NVML says the query is unsupported or fails."""
    try:
        return call(*args)
    except Exception:
        return None


def _text(value: Any) -> str:
    """NVML strings are ``bytes`` in older nvidia-ml-py releases."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


# ------------------------------------------------------------------------------- torch
def _torch_gpus() -> tuple[list[GpuInfo], str | None]:
    """GPUs torch can use in this process, or ([], why not)."""
    import torch  # deferred: importing hplan must not import torch

    if not torch.cuda.is_available():
        return [], None
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    gpus = [_torch_gpu(i, p) for i, p in enumerate(props)]
    return [_with_torch_peers(i, g, gpus) for i, g in enumerate(gpus)], None


def _torch_gpu(index: int, props: Any) -> GpuInfo:
    kind, known = catalog_kind(props.name)
    uuid = getattr(props, "uuid", None)
    uuid_text = None if uuid is None else str(uuid)
    if uuid_text and not uuid_text.startswith("GPU-"):
        uuid_text = f"GPU-{uuid_text}"
    return GpuInfo(
        name=props.name,
        kind=kind,
        in_catalog=known,
        uuid=uuid_text,
        pci_bus_id=_torch_bus_id(props),
        torch_index=index,
        memory_total_bytes=int(props.total_memory),
        compute_capability=f"{props.major}.{props.minor}",
        num_sms=int(props.multi_processor_count),
    )


def _torch_bus_id(props: Any) -> str | None:
    parts = [getattr(props, f"pci_{n}_id", None) for n in ("domain", "bus", "device")]
    numbers = [int(p) for p in parts if p is not None]
    if len(numbers) != len(parts):
        return None
    domain, bus, device = numbers
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def _with_torch_peers(index: int, gpu: GpuInfo, gpus: Sequence[GpuInfo]) -> GpuInfo:
    import torch

    peers = [
        other.pci_bus_id
        for j, other in enumerate(gpus)
        if j != index and other.pci_bus_id and torch.cuda.can_device_access_peer(index, j)
    ]
    return replace(gpu, peer_access=tuple(sorted(p for p in peers if p)))


def describe_gpu(gpu: GpuInfo) -> str:
    """One line: ``cuda:0 NVIDIA GeForce RTX 3090 (rtx3090), 25.8 GB, 0000:01:00.0`` (decimal
    GB, as every figure hplan prints)."""
    where = f"cuda:{gpu.torch_index}" if gpu.torch_index is not None else "not usable by torch"
    known = "" if gpu.in_catalog else ", not in the device catalog"
    return (
        f"{where} {gpu.name} ({gpu.kind}{known}), {format_bytes(gpu.memory_total_bytes)}, "
        f"PCI {gpu.pci_bus_id or '?'}"
    )


def iter_details(discovery: Discovery) -> Iterator[str]:
    """Human-readable lines describing a discovery (GPUs, CPU, notes)."""
    for gpu in discovery.gpus:
        yield describe_gpu(gpu)
    cpu = discovery.cpu
    yield f"cpu {cpu.name}, {cpu.num_cores} cores, {format_bytes(cpu.memory_total_bytes)}"
    yield from discovery.notes
