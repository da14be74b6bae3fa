"""``hplan profile``: measure this machine's devices and, optionally, a model's units.

:func:`profile_machine` discovers the devices (``hardware/discovery.py``), runs the microbenchmarks
(``microbench.py``) on each measured device and, given a model file, profiles every
partition unit on one device (``unit_profile.py``). It returns one :class:`Profile` per
measured device; :func:`write_profiles` stores each as a JSON file.

Device keys (``device_keys.py``): by default a GPU measured by UUID is ``<kind>#<uuid>``
(``rtx3090#GPU-5d1c...``) and the CPU is ``cpu`` (the catalog's one-core rehearsal device:
it is measured with one thread); files are ``<host>-<device key>.json``. With ``node`` (this
machine is that node of the cluster) the CPU is ``cpu@<node>`` and GPU ``i`` is
``<kind>@<node>/<i>``, files ``<node>-<kind>.json`` and ``<node>_<i>-<kind>.json``: the
profiles of several machines go in one directory and each node keeps its own times.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hplan.planner.frontend.capture import CaptureTensors
from hplan.planner.frontend.cost_graph import build_model_graph
from hplan.planner.hardware.cluster import Cluster, load_cluster
from hplan.planner.hardware.discovery import CpuInfo, Discovery, GpuInfo, discover_devices
from hplan.planner.profiling.device_keys import (
    check_node_name,
    key_kind,
    key_target,
    node_cpu_key,
    node_gpu_key,
)
from hplan.planner.profiling.microbench import benchmark_device
from hplan.planner.profiling.profile_file import DeviceProfile, ModelRef, Profile
from hplan.planner.profiling.unit_profile import OnStep, UnitProfileOptions, profile_units
from hplan.planner.profiling.windows import DEFAULT_MAX_MICRO_BATCH_SIZE, DEFAULT_WINDOW_S
from hplan.runtime.capture.model_file import ModelFile, load_model_file
from hplan.runtime.contract.errors import ConfigError

OnPhase = Callable[[str], None]
"""Progress callback: a short description of the phase starting."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileRequest:
    """What ``hplan profile`` was asked for."""

    model_path: Path | None = None
    """Profile this model's units too (None: devices only)."""
    micro_batch_sizes: tuple[int, ...] | None = None
    """Sizes to time the units at; None: powers of two chosen as they are timed
    (``unit_profile.py``)."""
    max_micro_batch_size: int = DEFAULT_MAX_MICRO_BATCH_SIZE
    """Largest size to choose when ``micro_batch_sizes`` is None."""
    window_s: float = DEFAULT_WINDOW_S
    """Wall seconds every timed window (benchmarks and units) lasts at least."""
    node: str | None = None
    """The cluster node this machine is: keys and file names name it (module docstring).
    None: keys by kind and UUID."""
    cluster_path: Path | None = None
    """The cluster file ``node`` is checked against (and takes its device kinds from)."""
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
    phase_times_s: tuple[tuple[str, float], ...] = ()
    """(phase, wall seconds): ``benchmarks`` and ``units``, those that ran."""
    micro_batch_sizes: tuple[int, ...] = ()
    """The sizes the units were timed at (none without a model)."""

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
    _check_request(request)
    cluster = load_cluster(request.cluster_path) if request.cluster_path is not None else None
    model_file = load_model_file(request.model_path) if request.model_path is not None else None
    say("discovering devices")
    found = discovery if discovery is not None else discover_devices()
    targets = _targets(found, request.device)
    keys = [_key(found, gpu, request.node, cluster) for _, gpu in targets]
    devices = []
    bench_started_s = time.monotonic()
    for (device, gpu), key in zip(targets, keys, strict=True):
        say(f"benchmarking {_label(device, gpu, found.cpu)}")
        devices.append(_device_profile(found, device, gpu, key, request))
    phases = [("benchmarks", time.monotonic() - bench_started_s)] if request.benchmark else []
    profiles = [Profile(devices=(d,), notes=found.notes) for d in devices]
    sizes: tuple[int, ...] = ()
    if model_file is not None:
        say(f"profiling the units of {request.model_path} on {devices[0].key}")
        units_started_s = time.monotonic()
        profiles[0], sizes = _with_units(profiles[0], model_file, request, targets[0][0], on_step)
        phases.append(("units", time.monotonic() - units_started_s))
    elapsed_s = time.monotonic() - started_s
    return MachineProfile(found, tuple(profiles), elapsed_s, tuple(phases), sizes)


def profile_file_name(host: str, device_key: str) -> str:
    """``<host>-<device key>.json``; for a key bound to a node or device
    (``cpu@left``, ``rtx3090@box/1``) ``<node or device>-<kind>.json`` (``left-cpu.json``,
    ``box_1-rtx3090.json``). Characters unsafe in file names become ``_``."""
    target = key_target(device_key)
    stem = f"{host}-{device_key}" if target is None else f"{target}-{key_kind(device_key)}"
    return re.sub(r"[^A-Za-z0-9._@-]", "_", stem) + ".json"


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
def _check_request(request: ProfileRequest) -> None:
    sizes = request.micro_batch_sizes
    if sizes is not None and (not sizes or min(sizes) < 1):
        raise ConfigError(f"micro-batch sizes {tuple(sizes)} must be integers >= 1, e.g. 1,2,4")
    if request.max_micro_batch_size < 1:
        raise ConfigError(
            f"--max-micro-batch-size {request.max_micro_batch_size} must be an integer >= 1"
        )
    if not request.window_s >= 0:
        raise ConfigError(f"--window {request.window_s:g} must be seconds >= 0, e.g. 0.3")
    if request.node is not None:
        check_node_name(request.node)
    elif request.cluster_path is not None:
        raise ConfigError("--cluster goes with --node (the node of the cluster this machine is)")


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


def _key(found: Discovery, gpu: GpuInfo | None, node: str | None, cluster: Cluster | None) -> str:
    """The device's key: :func:`device_key`, or bound to ``node`` (module docstring)."""
    if node is None:
        return device_key(gpu)
    if gpu is None:
        return node_cpu_key(node, cluster)
    order = [g.torch_index for g in found.usable_gpus]  # PCI bus order, as the runtime's
    return node_gpu_key(node, order.index(gpu.torch_index), gpu.kind, cluster)


def _device_profile(
    found: Discovery, device: torch.device, gpu: GpuInfo | None, key: str, request: ProfileRequest
) -> DeviceProfile:
    bench = benchmark_device(device, window_s=request.window_s) if request.benchmark else None
    flops = bench.matmul_flops_per_s if bench else {}
    bandwidth = bench.memory_bandwidth_bytes_per_s if bench else None
    if gpu is None:
        cpu = found.cpu
        details = {**cpu.details(), **({"num_threads": bench.num_threads} if bench else {})}
        return DeviceProfile(
            key=key,
            kind=key_kind(key),
            name=cpu.name,
            host=found.host,
            memory_bytes=cpu.memory_total_bytes,
            matmul_flops_per_s=flops,
            memory_bandwidth_bytes_per_s=bandwidth,
            details=details,
        )
    return DeviceProfile(
        key=key,
        kind=key_kind(key),
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
    profile: Profile,
    model_file: ModelFile,
    request: ProfileRequest,
    device: torch.device,
    on_step: OnStep | None,
) -> tuple[Profile, tuple[int, ...]]:
    """``profile`` with the model's unit timings on ``device``; the sizes timed."""
    assert request.model_path is not None
    graph = build_model_graph(
        model_file,
        leaf_modules=request.leaf_modules,
        seed=request.seed,
        tensors=CaptureTensors.CPU,  # the units run for real
    )
    options = replace(
        request.unit_options or UnitProfileOptions(),
        micro_batch_sizes=request.micro_batch_sizes,
        max_micro_batch_size=request.max_micro_batch_size,
        window_s=request.window_s,
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
    notes = (
        *profile.notes,
        *graph.notes,
        *_sharing_notes(measured.shared_with),
        *(f"{key}: {note}" for note in measured.notes),
    )
    with_units = Profile(
        devices=profile.devices,
        model=model,
        unit_timings=measured.timings,
        notes=tuple(dict.fromkeys(notes)),
    )
    return with_units, measured.micro_batch_sizes


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
