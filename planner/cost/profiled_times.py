"""Unit times from a measured profile (``hplan profile``), with the roofline as fallback.

:class:`MeasuredSource` is a ``UnitTimeSource`` (see ``problem_builder.py``). It looks a
device's timings up most specific key first (``profiling/device_keys.py``: the device, its
node, its card, its kind, the kind's pooled measurements); a measured (unit, size) is used as
is, another size comes from the sizes around it (``cost.microbatch.time_at_size``), and a
device the cluster file re-rates gets its kind's measurement scaled by the roofline ratio.
A device with no timings gets the roofline times the median measured-to-roofline ratio of
its device class, else the roofline on its kind's measured peaks, else the plain roofline;
a ``DeviceFactor`` (``hplan calibrate``) multiplies the result.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hplan.planner.cost.microbatch import time_at_size
from hplan.planner.cost.problem_builder import (
    Numerics,
    RooflineSource,
    UnitTimes,
    UnitTimeSource,
)
from hplan.planner.hardware.catalog import CATALOG, DeviceClass, DeviceType
from hplan.planner.hardware.cluster import Cluster, Device
from hplan.planner.profiling.device_keys import (
    key_kind,
    key_target,
    lookup_keys,
    unknown_targets,
)
from hplan.planner.profiling.profile_file import (
    MeasurementSource,
    Profile,
    UnitTiming,
    load_profiles,
)
from hplan.runtime.contract.errors import ConfigError

if TYPE_CHECKING:
    from hplan.planner.frontend.cost_graph import ModelGraph, UnitCost

_POOLED = "*"
_SAME_FACTOR = 1e-9


@dataclass(frozen=True, slots=True)
class _Point:
    """Median forward and backward seconds at one micro-batch size."""

    fwd_s: float
    bwd_s: float
    source: MeasurementSource


@dataclass
class _Measured:
    """Timings of one device key: unit -> size -> point; unit -> optimizer seconds."""

    points: dict[str, dict[int, _Point]]
    optimizer_s: dict[str, float]
    spread: float = 0.0
    """:func:`time_spread` of these timings."""


@dataclass(frozen=True, slots=True)
class _Estimate:
    times: UnitTimes
    label: str
    scale: float
    """Factor applied to the kind-level measurement (overrides and calibrated factors)."""


class MeasuredSource:
    """Unit times from a profile; see the module docstring for the precedence."""

    def __init__(
        self,
        profile: Profile,
        costs: Sequence[UnitCost],
        param_dtype: str,
        *,
        label: str = "profile",
        roofline: RooflineSource | None = None,
        device_uuids: Mapping[str, str] | None = None,
    ) -> None:
        """
        Args:
            profile: the measurements (unit timings must be of this model).
            costs: the model's unit costs (for the roofline ratios).
            param_dtype: the model's parameter dtype (which measured peak to use).
            label: where the profile came from, for the report (``prof/``).
            device_uuids: cluster device name -> NVML UUID of the card it is.
        """
        self.profile = profile
        self.label = label
        self.param_dtype = param_dtype
        self.roofline = roofline or RooflineSource()
        self.device_uuids = dict(device_uuids or {})
        self._costs = {c.name: c for c in costs}
        self._measured = _index_timings(profile.unit_timings)
        self._devices = {d.key: d for d in profile.devices}
        self._factors = {f.device: f for f in profile.device_factors}
        self._ratios = self._class_ratios()
        self._cache: dict[tuple[str, str, int], _Estimate] = {}

    @property
    def name(self) -> str:
        return f"profile {self.label}"

    # -------------------------------------------------------------- UnitTimeSource
    def unit_times(
        self, device: Device, cost: UnitCost, micro_batch_size: int, numerics: Numerics
    ) -> UnitTimes:
        """Forward and backward seconds of one micro-batch (see the module docstring).

        Measured points are used as measured (``hplan profile`` times units in the model's
        own dtype, without autocast); ``numerics`` steers the roofline estimates."""
        return self._estimate(device, cost, micro_batch_size, numerics).times

    def optimizer_time_s(
        self, device: Device, cost: UnitCost, optimizer_state_bytes_per_param_byte: float
    ) -> float:
        """Measured optimizer step of the unit where timed, else the roofline estimate
        times the class's measured-to-roofline optimizer ratio; then overrides/factors."""
        key = self._timing_key(device)
        measured = self._measured[key].optimizer_s.get(cost.name) if key else None
        if measured is not None:
            return measured * self._override_scale(device, cost, 1) * self._factor(device)
        estimate = self.roofline.optimizer_time_s(
            device, cost, optimizer_state_bytes_per_param_byte
        )
        ratio = self._optimizer_ratio(
            device.type.device_class, optimizer_state_bytes_per_param_byte
        )
        return estimate * ratio * self._factor(device)

    def time_spread(self, device: Device) -> float:
        """The spread of the timings that stand for ``device`` (:func:`time_spread`); 0
        when none do (its times are estimates)."""
        key = self._timing_key(device)
        return self._measured[key].spread if key else 0.0

    def source_label(self, device: Device, cost: UnitCost, micro_batch_size: int) -> str:
        """Where ``unit_times`` got this number from, for the plan report."""
        return self._estimate(device, cost, micro_batch_size).label

    # -------------------------------------------------------------------- lookup
    def _timing_key(self, device: Device) -> str | None:
        uuid = self.device_uuids.get(device.name)
        candidates = [*lookup_keys(device, uuid), f"{device.kind}{_POOLED}"]
        return next((k for k in candidates if k in self._measured), None)

    def borrowed_notes(self, devices: Sequence[Device]) -> list[str]:
        """One note per device whose kind was profiled per node (``--node``) but not on its
        node: which measurements stand for it."""
        notes = []
        for device in devices:
            key = self._timing_key(device)
            if key is None or not key.endswith(_POOLED):
                continue
            bound = sorted(k for k in self._measured if _bound(k) and key_kind(k) == device.kind)
            if any("@" in k for k in bound):
                notes.append(
                    f"{device.name} has no profile of its own (`hplan profile --node "
                    f"{device.node}` on it): the median of {', '.join(bound)} stands for it"
                )
        return notes

    def _estimate(
        self, device: Device, cost: UnitCost, size: int, numerics: Numerics | None = None
    ) -> _Estimate:
        cache_key = (device.name, cost.name, size)
        if cache_key not in self._cache:
            base = self._base_estimate(device, cost, size, numerics or Numerics(self.param_dtype))
            factor = self._factor(device)
            label = base.label
            if abs(factor - 1.0) > _SAME_FACTOR:
                label = f"{label} x {factor:.2f} (calibrated factor)"
            times = UnitTimes(base.times.fwd_time_s * factor, base.times.bwd_time_s * factor)
            self._cache[cache_key] = _Estimate(times, label, base.scale * factor)
        return self._cache[cache_key]

    def _base_estimate(
        self, device: Device, cost: UnitCost, size: int, numerics: Numerics
    ) -> _Estimate:
        key = self._timing_key(device)
        points = self._measured[key].points.get(cost.name) if key else None
        if points:
            point, label = _at_size(points, size)
            scale = self._override_scale(device, cost, size)
            if abs(scale - 1.0) > _SAME_FACTOR:
                label = f"{label} x {scale:.2f} (cluster.yaml overrides {device.kind})"
            return _Estimate(UnitTimes(point.fwd_s * scale, point.bwd_s * scale), label, scale)
        roofline = self.roofline.unit_times(device, cost, size, numerics)
        ratio = self._ratios.get(device.type.device_class)
        if ratio is not None:
            times = UnitTimes(roofline.fwd_time_s * ratio, roofline.bwd_time_s * ratio)
            return _Estimate(times, f"roofline x {ratio:.2g} (scaled by measured devices)", ratio)
        peaks = self._measured_peaks_type(device, numerics.compute_dtype)
        if peaks is not None:
            measured_roofline = RooflineSource(
                compute_efficiency=1.0,
                memory_efficiency=1.0,
                op_overhead_s=self.roofline.op_overhead_s,
            )
            peak_device = dataclasses.replace(device, type=peaks)
            times = measured_roofline.unit_times(peak_device, cost, size, numerics)
            return _Estimate(times, "roofline (measured device peaks)", 1.0)
        return _Estimate(roofline, "roofline", 1.0)

    def _factor(self, device: Device) -> float:
        factor = self._factors.get(device.name)
        return factor.time_factor if factor is not None and factor.kind == device.kind else 1.0

    def _override_scale(self, device: Device, cost: UnitCost, size: int) -> float:
        """Declared figures over the catalog's, as roofline times (1.0 without overrides)."""
        catalog = CATALOG.get(device.kind)
        if catalog is None or catalog == device.type:
            return 1.0
        declared = self._roofline_total_s(device.type, cost, size)
        reference = self._roofline_total_s(catalog, cost, size)
        return declared / reference if reference > 0 else 1.0

    def _roofline_total_s(self, device_type: DeviceType, cost: UnitCost, size: int) -> float:
        stand_in = Device(name="profile", node="profile", local_index=0, type=device_type)
        times = self.roofline.unit_times(stand_in, cost, size, Numerics(self.param_dtype))
        return times.fwd_time_s + times.bwd_time_s

    def _measured_peaks_type(self, device: Device, dtype: str) -> DeviceType | None:
        """The device's type with its own measured ``dtype`` matmul FLOP/s and bandwidth
        (its most specific key's), else its kind's (the median), if measured."""
        own = [
            k for k in lookup_keys(device, self.device_uuids.get(device.name)) if k in self._devices
        ]
        profiles = (
            [self._devices[own[0]]]
            if own
            else [p for p in self._devices.values() if p.kind == device.kind]
        )
        flops = [p.matmul_flops_per_s.get(dtype) for p in profiles]
        bandwidths = [p.memory_bandwidth_bytes_per_s for p in profiles]
        flops_s = [f.median for f in flops if f is not None]
        bandwidth_s = [b.median for b in bandwidths if b is not None]
        if not flops_s or not bandwidth_s:
            return None
        peak = statistics.median(flops_s)
        return dataclasses.replace(
            device.type,
            fp32_flops_per_s=peak,
            tf32_flops_per_s=peak,
            fp16_flops_per_s=peak,
            bf16_flops_per_s=peak,
            memory_bandwidth_bytes_per_s=statistics.median(bandwidth_s),
        )

    # -------------------------------------------------------------------- ratios
    def _measured_kinds(self) -> Iterable[tuple[DeviceType, _Measured]]:
        for key, measured in self._measured.items():
            kind = key_kind(key)
            if kind in CATALOG and not key.endswith(_POOLED):
                yield CATALOG[kind], measured

    def _class_ratios(self) -> dict[DeviceClass, float]:
        """Median measured / roofline (forward + backward) per device class."""
        ratios: dict[DeviceClass, list[float]] = {}
        for device_type, measured in self._measured_kinds():
            for unit, points in measured.points.items():
                cost = self._costs.get(unit)
                if cost is None:
                    continue
                for size, point in points.items():
                    estimate = self._roofline_total_s(device_type, cost, size)
                    if estimate > 0:
                        ratio = (point.fwd_s + point.bwd_s) / estimate
                        ratios.setdefault(device_type.device_class, []).append(ratio)
        return {cls: statistics.median(values) for cls, values in ratios.items()}

    def _optimizer_ratio(self, device_class: DeviceClass, state_factor: float) -> float:
        ratios = []
        for device_type, measured in self._measured_kinds():
            if device_type.device_class is not device_class:
                continue
            stand_in = Device(name="profile", node="profile", local_index=0, type=device_type)
            for unit, seconds in measured.optimizer_s.items():
                cost = self._costs.get(unit)
                if cost is None:
                    continue
                estimate = self.roofline.optimizer_time_s(stand_in, cost, state_factor)
                if estimate > 0 and seconds > 0:
                    ratios.append(seconds / estimate)
        return statistics.median(ratios) if ratios else 1.0


def _index_timings(timings: Iterable[UnitTiming]) -> dict[str, _Measured]:
    """Timings by device key, plus a pooled ``kind*`` entry per kind with bound keys."""
    measured: dict[str, _Measured] = {}
    bound: dict[str, list[UnitTiming]] = {}
    by_key: dict[str, list[UnitTiming]] = {}
    for t in timings:
        by_key.setdefault(t.device, []).append(t)
        entry = measured.setdefault(t.device, _Measured({}, {}))
        entry.points.setdefault(t.unit, {})[t.micro_batch_size] = _Point(
            t.forward_s.median, t.backward_s.median, t.source
        )
        if t.optimizer_s is not None:
            entry.optimizer_s[t.unit] = t.optimizer_s
        if _bound(t.device):
            bound.setdefault(key_kind(t.device), []).append(t)
    for key, own in by_key.items():
        measured[key].spread = time_spread(own)
    for kind, group in bound.items():
        measured[f"{kind}{_POOLED}"] = _pooled(group)
        measured[f"{kind}{_POOLED}"].spread = statistics.median(
            measured[k].spread for k in {t.device for t in group}
        )
    return measured


def time_spread(timings: Sequence[UnitTiming]) -> float:
    """How far apart one device's timings lie: at each micro-batch size, the p10-p90 width of
    the forward + backward summed over the units timed at it, over its median; the median of
    those over the sizes (``PlanningProblem.time_spread``). 0 without timings.

    Over the MLP example's profiles under a 0.6-core CPU quota the width was 3-9% at most
    sizes, 17-33% at a few (a sweep that met a neighbour): the median over sizes keeps
    those few from deciding."""
    sums: dict[int, list[float]] = {}
    for t in timings:
        total = sums.setdefault(t.micro_batch_size, [0.0, 0.0, 0.0])
        for i, q in enumerate(("p10", "median", "p90")):
            total[i] += getattr(t.forward_s, q) + getattr(t.backward_s, q)
    widths = [(p90 - p10) / median for p10, median, p90 in sums.values() if median > 0]
    return max(0.0, statistics.median(widths)) if widths else 0.0


def _bound(key: str) -> bool:
    """A key bound to a card (``#``), a node or a device (``@``)."""
    return "#" in key or key_target(key) is not None


def _pooled(timings: Sequence[UnitTiming]) -> _Measured:
    groups: dict[tuple[str, int], list[UnitTiming]] = {}
    optimizer: dict[str, list[float]] = {}
    for t in timings:
        groups.setdefault((t.unit, t.micro_batch_size), []).append(t)
        if t.optimizer_s is not None:
            optimizer.setdefault(t.unit, []).append(t.optimizer_s)
    points: dict[str, dict[int, _Point]] = {}
    for (unit, size), group in groups.items():
        points.setdefault(unit, {})[size] = _Point(
            statistics.median(t.forward_s.median for t in group),
            statistics.median(t.backward_s.median for t in group),
            group[0].source,
        )
    return _Measured(points, {u: statistics.median(v) for u, v in optimizer.items()})


_SOURCE_LABELS = {
    MeasurementSource.MEASURED: "measured",
    MeasurementSource.CALIBRATED: "calibrated",
    MeasurementSource.IMPORTED: "imported",
}


def _at_size(points: Mapping[int, _Point], size: int) -> tuple[_Point, str]:
    """The point at ``size``: measured, or from the measured sizes around it."""
    if size in points:
        point = points[size]
        return point, _SOURCE_LABELS[point.source]
    sizes = sorted(points)
    source = _SOURCE_LABELS[points[sizes[0]].source]
    inside = sizes[0] < size < sizes[-1]
    label = f"{source} ({'interpolated' if inside else 'extrapolated'})"
    fwd = time_at_size([(s, points[s].fwd_s) for s in sizes], size)
    bwd = time_at_size([(s, points[s].bwd_s) for s in sizes], size)
    return _Point(fwd, bwd, points[sizes[0]].source), label


# ------------------------------------------------------------------------------ loading
def load_measured_source(
    profile_paths: Sequence[Path], graph: ModelGraph, *, model_path: Path
) -> MeasuredSource:
    """The ``MeasuredSource`` of profile files and directories (merged; later ones win where
    two measured the same thing) for ``graph``'s model.

    Raises:
        ConfigError: a profile cannot be read, holds unit timings without a model, or was
            measured on another model (graph fingerprints differ; names both).
    """
    profile = load_profiles(profile_paths)
    named = profile_label(profile_paths)
    quoted = ", ".join(repr(str(p)) for p in profile_paths)
    fingerprint = graph.graph_fingerprint
    if profile.unit_timings and profile.model is None:
        raise ConfigError(
            f"profile {quoted} has unit timings but no model; re-run "
            f"`hplan profile --model {model_path} -o {named}`"
        )
    if profile.model is not None and profile.model.graph_fingerprint != fingerprint:
        raise ConfigError(
            f"profile {quoted} was measured on model {profile.model.path} (graph "
            f"{profile.model.graph_fingerprint[:12]}), not on {model_path} (graph "
            f"{fingerprint[:12]}); re-run `hplan profile --model {model_path}` with the same "
            "--leaf-module options"
        )
    return MeasuredSource(profile, graph.unit_costs, graph.param_dtype, label=named)


def profile_label(profile_paths: Sequence[Path]) -> str:
    """``prof/`` or ``a.json, b.json``: the profiles as the report names them."""
    return ", ".join(p.as_posix() for p in profile_paths)


def check_profile_targets(profile: Profile, cluster: Cluster, label: str) -> None:
    """Every node or device a profile key is bound to (``cpu@left``) is in ``cluster``.

    Raises:
        ConfigError: naming the first unknown key, the cluster's nodes and the fix.
    """
    keys = [d.key for d in profile.devices] + [t.device for t in profile.unit_timings]
    unknown = unknown_targets(keys, cluster)
    if not unknown:
        return
    nodes = ", ".join(n.name for n in cluster.nodes)
    others = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
    raise ConfigError(
        f"profile {label} measures {unknown[0]}{others}, but {cluster.source!r} has no node or "
        f"device {key_target(unknown[0])!r} (its nodes: {nodes}); re-profile that machine "
        "with `hplan profile --node NODE --cluster CLUSTER` or leave its file out"
    )


def source_labels(
    source: UnitTimeSource,
    devices: Sequence[Device],
    costs: Sequence[UnitCost],
    sizes: Sequence[int],
) -> tuple[tuple[tuple[str, ...], ...], ...]:
    """Label of every (device, unit, micro-batch size) number, shape (D, U, K).

    A source without ``source_label`` (the roofline) gives its ``name`` everywhere.
    """
    label = getattr(source, "source_label", None)
    if label is None:
        return tuple(tuple((source.name,) * len(sizes) for _ in costs) for _ in devices)
    return tuple(tuple(tuple(label(d, c, s) for s in sizes) for c in costs) for d in devices)
