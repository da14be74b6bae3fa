"""Measured profiles: what ``hplan profile`` writes and the cost model reads.

A profile holds measurements of devices (achieved matmul FLOP/s per dtype, memory
bandwidth), of a model's partition units on those devices (forward/backward time per
micro-batch size, memory), and what ``hplan calibrate`` found: per-device correction
factors, and per-node collective costs (``NodeCollective``: the all-reduce a run measured,
as a ring's latency per step). Each measurement carries a device key saying what it
applies to (``device_keys.py``: a kind, a node's devices of a kind, one cluster device, one
card); the cost model prefers the most specific. Files are JSON, versioned, with units in
every key; ``Profile.load``/``to_json`` round-trip exactly; profiles of the same model merge.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import replace
from enum import StrEnum
from functools import cache
from pathlib import Path
from typing import Any, Literal

from pydantic import TypeAdapter

from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.plan import NonNegative, Positive
from hplan.runtime.contract.versioned_file import parse_versioned, record

PROFILE_SCHEMA_VERSION = 1


class MeasurementSource(StrEnum):
    """Where a number came from (reported in the plan)."""

    MEASURED = "measured"
    IMPORTED = "imported"
    CALIBRATED = "calibrated"


@record
class Stat:
    """A repeated measurement: median and spread of ``num_samples`` timed samples (each the
    mean of one timed window, ``windows.py``)."""

    median: float
    p10: float
    p90: float
    num_samples: int

    @staticmethod
    def of(samples: Sequence[float]) -> Stat:
        """Median and 10th/90th percentiles of ``samples`` (at least one)."""
        ordered = sorted(samples)
        if not ordered:
            raise ValueError("Stat.of needs at least one sample")
        q = statistics.quantiles(ordered, n=10, method="inclusive") if len(ordered) > 1 else None
        return Stat(
            median=statistics.median(ordered),
            p10=q[0] if q else ordered[0],
            p90=q[-1] if q else ordered[0],
            num_samples=len(ordered),
        )


@record
class DeviceProfile:
    """What was measured about one device (or one device kind)."""

    key: str
    """Device key (``device_keys.py``): ``kind``, ``kind@node``, ``kind@device-name`` or
    ``kind#uuid``."""
    kind: str
    """Catalog kind the device was identified as (``cpu`` for a CPU)."""
    name: str
    """Name as the driver or OS reports it."""
    host: str
    memory_bytes: int
    matmul_flops_per_s: dict[str, Stat]
    """Achieved dense matmul FLOP/s by dtype name (``float32``, ``bfloat16``, ...)."""
    memory_bandwidth_bytes_per_s: Stat | None
    source: MeasurementSource = MeasurementSource.MEASURED
    uuid: str | None = None
    pci_bus_id: str | None = None
    details: dict[str, str | int | float | bool] | None = None
    """Clocks, power limit, peer access, NVLink ... as discovered (informational)."""


@record
class UnitTiming:
    """One partition unit measured on one device at one micro-batch size."""

    device: str
    """Device key."""
    unit: str
    micro_batch_size: int
    forward_s: Stat
    backward_s: Stat
    optimizer_s: float | None = None
    """Optimizer step for this unit's parameters (None: not measured)."""
    activation_bytes: int
    """Bytes kept for backward by this micro-batch."""
    peak_bytes: int
    """Peak memory while running the unit (parameters, activations, transients)."""
    source: MeasurementSource = MeasurementSource.MEASURED


@record
class ModelRef:
    """Which model unit timings belong to."""

    path: str
    sha256: str
    graph_fingerprint: str
    units: tuple[str, ...]


@record
class DeviceFactor:
    """A calibrated slowdown of one cluster device relative to its kind (1.4 = 40% slower)."""

    device: str
    """Cluster device name (``box-b/1``)."""
    kind: str
    time_factor: float
    reason: str


@record
class NodeCollective:
    """A node's all-reduce cost as a run measured it (``hplan calibrate``), as a ring.

    ``hplan solve --profile`` puts it in the node's ``CollectiveSpec`` (replacing what
    ``--bandwidth`` measured): every ring over a device of the node then pays at least
    ``latency_per_step_s`` per ring step and runs no faster than
    ``bus_bandwidth_bytes_per_s`` (``Plan.ring_channel``, ``link_model``).
    """

    node: str
    """Cluster node name."""
    latency_per_step_s: NonNegative
    """Seconds per ring step: a ring of n ranks pays ``2 (n - 1)`` of them per call."""
    bus_bandwidth_bytes_per_s: Positive
    """Bus bandwidth (nccl-tests' convention); calibrate keeps the links' (it fits the
    latency only)."""
    reason: str


@record
class Profile:
    """A set of measurements; see the module docstring."""

    schema_version: Literal[1] = 1
    devices: tuple[DeviceProfile, ...] = ()
    model: ModelRef | None = None
    unit_timings: tuple[UnitTiming, ...] = ()
    device_factors: tuple[DeviceFactor, ...] = ()
    notes: tuple[str, ...] = ()
    node_collectives: tuple[NodeCollective, ...] = ()
    """Calibrated all-reduce costs per node (empty: the cluster's and links' own)."""

    def to_json(self) -> str:
        """Deterministic JSON text (2-space indent, declared field order, final newline)."""
        data = _adapter().dump_python(self, mode="json")
        return json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False) + "\n"

    @staticmethod
    def from_json(text: str, *, source: str = "<profile>") -> Profile:
        """Parse and validate profile JSON.

        Raises:
            ConfigError: not JSON, another schema version, unknown keys or wrong types;
                the message names the file and the field.
        """
        return parse_versioned(
            text,
            _adapter(),
            what="profile",
            source=source,
            version=PROFILE_SCHEMA_VERSION,
            fix="re-run `hplan profile`",
        )

    @staticmethod
    def load(path: str | Path) -> Profile:
        """Read a profile file, or merge every ``*.json`` profile of a directory.

        Raises:
            ConfigError: unreadable, invalid, or profiles of different models.
        """
        path = Path(path)
        files = sorted(path.glob("*.json")) if path.is_dir() else [path]
        if not files:
            raise ConfigError(
                f"no profile files (*.json) in {str(path)!r}; run `hplan profile -o {path}`"
            )
        merged = Profile()
        for file in files:
            try:
                text = file.read_text(encoding="utf-8")
            except OSError as exc:
                raise ConfigError(
                    f"cannot read profile {str(file)!r} ({exc.strerror}); pass a file or folder "
                    "written by `hplan profile --model MODEL -o DIR`"
                ) from None
            merged = merged.merge(Profile.from_json(text, source=str(file)))
        return merged

    def merge(self, other: Profile) -> Profile:
        """Both profiles' measurements; ``other`` wins where both measured the same thing.

        Raises:
            ConfigError: the two profiles time units of different models.
        """
        if (
            self.model
            and other.model
            and self.model.graph_fingerprint != other.model.graph_fingerprint
        ):
            raise ConfigError(
                f"profiles of different models cannot be merged ({self.model.path} and "
                f"{other.model.path}); profile each model into its own directory"
            )
        devices = {d.key: d for d in self.devices} | {d.key: d for d in other.devices}
        timings = {_timing_key(t): t for t in self.unit_timings} | {
            _timing_key(t): t for t in other.unit_timings
        }
        factors = {f.device: f for f in self.device_factors} | {
            f.device: f for f in other.device_factors
        }
        collectives = {c.node: c for c in self.node_collectives} | {
            c.node: c for c in other.node_collectives
        }
        return replace(
            self,
            devices=tuple(devices[k] for k in sorted(devices)),
            model=other.model or self.model,
            unit_timings=tuple(timings[k] for k in sorted(timings)),
            device_factors=tuple(factors[k] for k in sorted(factors)),
            notes=tuple(dict.fromkeys((*self.notes, *other.notes))),
            node_collectives=tuple(collectives[k] for k in sorted(collectives)),
        )


def load_profiles(paths: Sequence[str | Path]) -> Profile:
    """Every profile file and directory of ``paths`` merged, later ones winning where two
    measured the same thing (``Profile.load`` each, then ``Profile.merge``).

    Raises:
        ConfigError: as ``Profile.load``; profiles of different models.
    """
    merged = Profile()
    for path in paths:
        merged = merged.merge(Profile.load(path))
    return merged


def _timing_key(t: UnitTiming) -> tuple[str, str, int]:
    return (t.device, t.unit, t.micro_batch_size)


@cache
def _adapter() -> TypeAdapter[Profile]:
    return TypeAdapter(Profile)


def profile_json_schema() -> dict[str, Any]:
    """The JSON Schema of profile files."""
    return _adapter().json_schema()
