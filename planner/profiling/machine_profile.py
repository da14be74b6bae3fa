"""``hplan profile``: measure this machine's devices and, optionally, a model's units.

:func:`profile_machine` discovers the devices (``hardware/discovery.py``), runs the microbenchmarks
(``microbench.py``) on each measured device and, given a model file, profiles every
partition unit on one device (``unit_profile.py``). It returns one :class:`Profile` per
measured device; :func:`write_profiles` stores each as ``<host>-<device key>.json``.

Device keys (see ``profile_file.py``): a GPU measured by UUID is ``<kind>#<uuid>``
(``rtx3090#GPU-5d1c...``); the CPU is ``cpu`` (the catalog's one-core rehearsal device:
it is measured with one thread).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hplan.planner.frontend.capture import CaptureTensors
from hplan.planner.frontend.cost_graph import build_model_graph
from hplan.planner.hardware.discovery import CpuInfo, Discovery, GpuInfo, discover_devices
from hplan.planner.profiling.microbench import benchmark_device
from hplan.planner.profiling.profile_file import DeviceProfile, ModelRef, Profile
from hplan.planner.profiling.unit_profile import OnStep, UnitProfileOptions, profile_units
from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.contract.errors import ConfigError

DEFAULT_MICRO_BATCH_SIZES = (1, 2, 4, 8)
OnPhase = Callable[[str], None]
"""Progress callback: a short description of the phase starting."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileRequest:
    """What ``hplan profile`` was asked for."""

    model_path: Path | None = None
    """Profile this model's units too (None: devices only)."""
    micro_batch_sizes: tuple[int, ...] = DEFAULT_MICRO_BATCH_SIZES
    device: str | None = None
    """``cpu``, ``cuda`` or ``cuda:N``; None: every usable GPU (units on the first), else
    the CPU."""
    leaf_modules: tuple[str, ...] = ()
    seed: int = 0
    benchmark: bool = True
    """Run the device microbenchmarks (False: discovery and units only)."""
    unit_options: UnitProfileOptions | None = None
    """Repeats and warm-up of the unit timings (default ``UnitProfileOptions()``)."""


@dataclass(frozen=True, slots=True)
class MachineProfile:
    """What :func:`profile_machine` measured."""

    discovery: Discovery
    profiles: tuple[Profile, ...]
    """One per measured device, each with that device's ``DeviceProfile``."""
    elapsed_s: float

    def merged(self) -> Profile:
        """All measurements in one profile."""
        result = Profile()
        for profile in self.profiles:
            result = result.merge(profile)
        return result


def profile_machine(
    request: ProfileRequest,
    *,
    on_phase: OnPhase | None = None,
    on_step: OnStep | None = None,
    discovery: Discovery | None = None,
) -> MachineProfile:
    """Discover, benchmark and (with a model) profile this machine's devices.

    Args:
        on_phase: called with a description as each phase starts.
        on_step: called once per (unit, micro-batch size) profiled.
        discovery: use this instead of discovering (tests).

    Raises:
        ConfigError: an unknown or unusable ``device``, or bad micro-batch sizes.
        ModelFileError, TraceError: the model file cannot be loaded or traced.
    """
    say = on_phase or (lambda _msg: None)
    started_s = time.monotonic()
    _check_sizes(request.micro_batch_sizes)
    say("discovering devices")
    found = discovery if discovery is not None else discover_devices()
    targets = _targets(found, request.device)
    devices = []
    for device, gpu in targets:
        say(f"benchmarking {_label(device, gpu, found.cpu)}")
        devices.append(_device_profile(found, device, gpu, benchmark=request.benchmark))
    profiles = [Profile(devices=(d,), notes=found.notes) for d in devices]
    if request.model_path is not None:
        say(f"profiling the units of {request.model_path} on {devices[0].key}")
        profiles[0] = _with_units(profiles[0], request, targets[0][0], on_step)
    return MachineProfile(found, tuple(profiles), time.monotonic() - started_s)


def profile_file_name(host: str, device_key: str) -> str:
    """``<host>-<device key>.json`` with characters unsafe in file names replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9._@-]", "_", f"{host}-{device_key}") + ".json"


def write_profiles(result: MachineProfile, out_dir: Path) -> list[Path]:
    """Write each profile of ``result`` to ``out_dir/<host>-<device key>.json``.

    Raises:
        ConfigError: ``out_dir`` is a file or cannot be created or written.
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"output {str(out_dir)!r} is a file; give a directory with -o")
    written = []
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for profile in result.profiles:
            device = profile.devices[0]
            path = out_dir / profile_file_name(device.host, device.key)
            path.write_text(profile.to_json(), encoding="utf-8")
            written.append(path)
    except OSError as exc:
        raise ConfigError(f"cannot write profiles to {str(out_dir)!r} ({exc.strerror})") from None
    return written


# ------------------------------------------------------------------------------ devices
def _check_sizes(sizes: Sequence[int]) -> None:
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"micro-batch sizes {tuple(sizes)} must be integers >= 1, e.g. 1,2,4")


def _targets(found: Discovery, wanted: str | None) -> list[tuple[torch.device, GpuInfo | None]]:
    """(torch device, its GPU facts or None for the CPU), the unit-profiled device first."""
    usable = {g.torch_index: g for g in found.usable_gpus if g.torch_index is not None}
    if wanted is None:
        if usable:
            return [(torch.device("cuda", i), g) for i, g in sorted(usable.items())]
        return [(torch.device("cpu"), None)]
    try:
        device = torch.device(wanted)
    except RuntimeError:
        raise ConfigError(f"--device {wanted!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return [(device, None)]
    index = 0 if device.index is None else device.index
    if device.type != "cuda" or index not in usable:
        have = ", ".join(f"cuda:{i}" for i in sorted(usable)) or "no usable CUDA device"
        raise ConfigError(f"--device {wanted!r} is not available here ({have}); use --device cpu")
    return [(torch.device("cuda", index), usable[index])]


def _label(device: torch.device, gpu: GpuInfo | None, cpu: CpuInfo) -> str:
    return f"{device} ({gpu.name if gpu else cpu.name})"


def device_key(gpu: GpuInfo | None) -> str:
    """Profile key of a measured device: ``<kind>#<uuid>`` for a GPU, ``cpu`` for the CPU."""
    if gpu is None:
        return "cpu"
    return f"{gpu.kind}#{gpu.uuid}" if gpu.uuid else gpu.kind


def _device_profile(
    found: Discovery, device: torch.device, gpu: GpuInfo | None, *, benchmark: bool
) -> DeviceProfile:
    bench = benchmark_device(device) if benchmark else None
    flops = bench.matmul_flops_per_s if bench else {}
    bandwidth = bench.memory_bandwidth_bytes_per_s if bench else None
    if gpu is None:
        cpu = found.cpu
        details = {**cpu.details(), **({"num_threads": bench.num_threads} if bench else {})}
        return DeviceProfile(
            key="cpu",
            kind="cpu",
            name=cpu.name,
            host=found.host,
            memory_bytes=cpu.memory_total_bytes,
            matmul_flops_per_s=flops,
            memory_bandwidth_bytes_per_s=bandwidth,
            details=details,
        )
    return DeviceProfile(
        key=device_key(gpu),
        kind=gpu.kind,
        name=gpu.name,
        host=found.host,
        memory_bytes=gpu.memory_total_bytes,
        matmul_flops_per_s=flops,
        memory_bandwidth_bytes_per_s=bandwidth,
        uuid=gpu.uuid,
        pci_bus_id=gpu.pci_bus_id,
        details=gpu.details(),
    )


# -------------------------------------------------------------------------------- units
def _with_units(
    profile: Profile, request: ProfileRequest, device: torch.device, on_step: OnStep | None
) -> Profile:
    assert request.model_path is not None
    model_file = load_model_file(request.model_path)
    graph = build_model_graph(
        model_file,
        leaf_modules=request.leaf_modules,
        seed=request.seed,
        tensors=CaptureTensors.CPU,  # the units run for real
    )
    options = replace(
        request.unit_options or UnitProfileOptions(),
        micro_batch_sizes=tuple(sorted(set(request.micro_batch_sizes))),
        seed=request.seed,
    )
    key = profile.devices[0].key
    measured = profile_units(model_file, graph, device, key, options, on_step)
    model = ModelRef(
        path=request.model_path.as_posix(),
        sha256=model_file.sha256,
        graph_fingerprint=graph.graph_fingerprint,
        units=tuple(u.name for u in graph.units),
    )
    notes = (*profile.notes, *graph.notes, *_sharing_notes(measured.shared_with))
    return Profile(
        devices=profile.devices,
        model=model,
        unit_timings=measured.timings,
        notes=tuple(dict.fromkeys(notes)),
    )


def _sharing_notes(shared_with: dict[str, str]) -> list[str]:
    """``"blocks.1 .. blocks.23 (23 units) reuse the timings of blocks.0 ..."``."""
    sharers: dict[str, list[str]] = {}
    for unit, owner in shared_with.items():
        sharers.setdefault(owner, []).append(unit)
    notes = []
    for owner, units in sharers.items():
        span = units[0] if len(units) == 1 else f"{units[0]} .. {units[-1]} ({len(units)} units)"
        notes.append(f"{span} reuse the timings of {owner} (identical units are timed once)")
    return notes
