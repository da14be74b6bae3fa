"""Read the published Sailor measurements (profiles, network curves, model sizes).

The data is the artifact of the Sailor planner (ETH Zurich EASL, SOSP 2025; MIT licence),
read at run time from a folder such as ``../shared/data/sailor`` (see its README.md) and never
copied into this repository. This module turns its per-layer profiles into a ``Profile``
(units ``layer0`` .. ``layer25``, source ``imported``) and its fitted network curves into
alpha-beta links; ``plan.py`` imports its measured plans.

A tensor-parallel group of ``tp`` GPUs of one machine is imported as *one logical device*
(kind ``rtx3090-tp2``; ``tp`` 1 keeps the plain kind) with the profile's ``tp`` times and its
GPUs' memory summed: hplan plans have one device per stage. The study trains in float32
(:data:`TRAINING_DTYPE`): boundary activations and all-reduced gradients are 4 bytes an element.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hplan.planner.hardware.catalog import CATALOG
from hplan.planner.profiling.profile_file import (
    DeviceProfile,
    MeasurementSource,
    ModelRef,
    Profile,
    Stat,
    UnitTiming,
)
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.link_model import least_squares_alpha_beta

MODEL = "OPT-350"
TRAINING_DTYPE = "float32"
"""The study trains in float32 (see the module docstring): parameters, boundary activations
and their gradients."""
ADAM_MIXED_BYTES_PER_PARAM = 16
"""fp16 weight (2) + fp16 gradient (2) + fp32 master weight, Adam m and v (3 x 4): mixed
precision with Adam (Rajbhandari et al., "ZeRO", SC 2020, section 3.1); float32 Adam holds
the same 16 (weight, gradient, m, v: 4 x 4)."""
GB = 1e9
MB = 1e6

STUDY_TO_KIND: dict[str, str] = {
    "RTX-3090": "rtx3090",
    "V100-16": "v100-16gb",
    "A100-40": "a100-40gb",
    "A100-80": "a100-80gb",
    "RTX-2080": "rtx2080ti",  # cluster_gpus.json gives it 11 GiB: the 2080 Ti (the 2080 has 8)
    "Titan-RTX": "titan-rtx",
    "GH-96": "gh200-96gb",
}
"""Sailor GPU names -> hplan device kinds (catalog keys where the catalog has them)."""


@dataclass(frozen=True, slots=True)
class ExtraKind:
    """Figures of a GPU the device catalog lacks (fp16 tensor peak, memory bandwidth)."""

    peak_flops: float
    memory_bandwidth_bytes_per_s: float
    consumer_card: bool
    source: str


EXTRA_KINDS: dict[str, ExtraKind] = {
    "titan-rtx": ExtraKind(
        130.5e12, 672e9, True, "NVIDIA TITAN RTX specifications (130 tensor TFLOPS, 672 GB/s)"
    ),
    "gh200-96gb": ExtraKind(
        989.5e12, 4.0e12, False, "NVIDIA GH200 datasheet, 96 GB HBM3 (H100: 989 dense fp16 "
        "TFLOPS, 4 TB/s)",
    ),
}  # fmt: skip


# --------------------------------------------------------------------------- data folder
@dataclass(frozen=True)
class SailorData:
    """The parsed data folder (plain JSON values, keys as in the files)."""

    root: Path
    profiles: dict[str, dict[str, dict[str, dict[str, list[float]]]]]
    """GPU -> mbs -> tp -> layer -> [fwd_s, bwd_s, update_s]."""
    llm_info: dict[str, dict[str, dict[str, int]]]
    """tp -> layer -> sizes (``params_floats``, ``act_output_floats``, ``act_mem_bytes`` ...)."""
    cluster_gpus: dict[str, Any]
    training: dict[str, Any]
    inter_node: dict[str, Any]
    intra_node: dict[str, Any]

    @property
    def num_layers(self) -> int:
        return int(self.training["num_all_layers"])

    @property
    def hidden(self) -> int:
        return int(self.training["hidden_size"])

    @property
    def seq_len(self) -> int:
        return int(self.training["sequence_length"])

    def gpus_per_node(self, gpu: str) -> int:
        return int(self.cluster_gpus[gpu]["gpus_per_node"])

    def memory_per_gpu_bytes(self, gpu: str) -> int:
        return int(self.cluster_gpus[gpu]["mem_per_gpu"])

    def layer_times(self, gpu: str, mbs: int, tp: int) -> dict[str, list[float]] | None:
        """``{layer: [fwd_s, bwd_s, update_s]}``; None where the study did not measure it."""
        return self.profiles.get(gpu, {}).get(str(mbs), {}).get(str(tp))

    def fitted_layer_times(self, gpu: str, mbs: int, tp: int) -> dict[str, list[float]] | None:
        """Like :meth:`layer_times`; an unmeasured ``mbs`` comes from a least-squares line
        ``time = a + b * mbs`` (a, b >= 0) through the sizes measured at the same ``tp``
        (one measured size: time proportional to ``mbs``); ``update_s`` is independent of
        ``mbs``. None: nothing measured at this ``tp``."""
        exact = self.layer_times(gpu, mbs, tp)
        if exact is not None:
            return exact
        measured = {
            int(m): per_tp[str(tp)]
            for m, per_tp in self.profiles.get(gpu, {}).items()
            if str(tp) in per_tp
        }
        if not measured:
            return None
        sizes = np.array(sorted(measured), dtype=float)
        out = {}
        for layer in measured[int(sizes[0])]:
            rows = np.array([measured[int(m)][layer] for m in sizes])
            fwd, bwd = (_line_at(sizes, rows[:, i], mbs) for i in (0, 1))
            out[layer] = [fwd, bwd, float(rows[:, 2].mean())]
        return out

    def params_floats(self, layer: int, tp: int) -> int:
        """Parameters of ``layer`` on one GPU of a tensor-parallel group of ``tp``."""
        return int(self.llm_info[str(tp)][str(layer)]["params_floats"])


def _line_at(sizes: np.ndarray, times: np.ndarray, size: float) -> float:
    """Least-squares ``a + b * size`` (a, b >= 0) through ``(sizes, times)`` at ``size``."""
    if len(sizes) == 1:
        return float(times[0] * size / sizes[0])
    slope, intercept = np.polyfit(sizes, times, 1)
    if intercept < 0 or slope < 0:
        slope = max(float(np.sum(sizes * times) / np.sum(sizes * sizes)), 0.0)
        intercept = 0.0
    return float(intercept + slope * size)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"cannot read study file {str(path)!r} ({exc}); check the folder"
        ) from None


def load_sailor(root: str | Path) -> SailorData:
    """Read the Sailor data folder (profiles, model sizes, GPUs, network curves).

    Raises:
        ConfigError: the folder or one of its files is missing or not JSON.
    """
    root = Path(root)
    if not (root / "llm_info_OPT-350.json").is_file():
        raise ConfigError(
            f"{str(root)!r} is not the Sailor data folder (no llm_info_{MODEL}.json); pass the "
            "folder that holds profiles/, network/ and plans/"
        )
    profiles = {
        path.stem.removeprefix(f"{MODEL}_"): _read_json(path)
        for path in sorted((root / "profiles").glob(f"{MODEL}_*.json"))
    }
    return SailorData(
        root=root,
        profiles=profiles,
        llm_info=_read_json(root / f"llm_info_{MODEL}.json")[MODEL],
        cluster_gpus=_read_json(root / "cluster_gpus.json"),
        training=_read_json(root / f"training_config_{MODEL}.json"),
        inter_node=_read_json(root / "network" / "inter_node.json"),
        intra_node=_read_json(root / "network" / "intra_node.json"),
    )


# --------------------------------------------------------------------------- kinds
def device_kind(gpu: str, tp: int = 1) -> str:
    """hplan kind of a tensor-parallel group of ``tp`` GPUs named ``gpu`` in the study.

    Raises:
        ConfigError: a GPU name the importer does not know.
    """
    if gpu not in STUDY_TO_KIND:
        raise ConfigError(
            f"study GPU {gpu!r} is unknown; known: {', '.join(sorted(STUDY_TO_KIND))}"
        )
    kind = STUDY_TO_KIND[gpu]
    return kind if tp == 1 else f"{kind}-tp{tp}"


def kind_figures(kind: str) -> tuple[float, float, bool]:
    """(fp16 peak FLOP/s, memory bandwidth in bytes/s, consumer card) of one GPU of ``kind``."""
    if kind in CATALOG:
        known = CATALOG[kind]
        return known.fp16_flops_per_s, known.memory_bandwidth_bytes_per_s, known.consumer_card
    extra = EXTRA_KINDS[kind]
    return extra.peak_flops, extra.memory_bandwidth_bytes_per_s, extra.consumer_card


def unit_name(layer: int) -> str:
    return f"layer{layer}"


# --------------------------------------------------------------------------- profile
def import_profile(data: SailorData) -> Profile:
    """Every measured (GPU, mbs, tp) of the study as hplan unit timings.

    Device key = :func:`device_kind` (``rtx3090``, ``rtx3090-tp2`` ...); ``forward_s`` and
    ``backward_s`` are one-sample ``Stat`` s of the study's numbers, ``optimizer_s`` is its
    ``update_s``; ``activation_bytes`` is ``act_mem_bytes(tp) x mbs`` (the study's count, see
    the module docstring); ``peak_bytes`` adds the mixed-precision Adam state of the layer.
    """
    devices: list[DeviceProfile] = []
    timings: list[UnitTiming] = []
    for gpu, by_mbs in sorted(data.profiles.items()):
        tps = sorted({int(tp) for per_tp in by_mbs.values() for tp in per_tp})
        devices.extend(_device_profile(data, gpu, tp) for tp in tps)
        for mbs, per_tp in by_mbs.items():
            for tp, layers in per_tp.items():
                timings.extend(_timings(data, gpu, int(mbs), int(tp), layers))
    units = tuple(unit_name(i) for i in range(data.num_layers))
    model = ModelRef(
        path=f"sailor:{MODEL}", sha256="", graph_fingerprint=f"sailor-{MODEL}", units=units
    )
    return Profile(
        devices=tuple(sorted(devices, key=lambda d: d.key)),
        model=model,
        unit_timings=tuple(sorted(timings, key=lambda t: (t.device, t.unit, t.micro_batch_size))),
        notes=(f"imported from the Sailor artifact ({data.root})",),
    )


def _device_profile(data: SailorData, gpu: str, tp: int) -> DeviceProfile:
    kind = device_kind(gpu, tp)
    flops, bandwidth, _ = kind_figures(STUDY_TO_KIND[gpu])
    return DeviceProfile(
        key=kind,
        kind=kind,
        name=f"{gpu} x{tp} (tensor parallel)" if tp > 1 else gpu,
        host="sailor-study",
        memory_bytes=tp * data.memory_per_gpu_bytes(gpu),
        matmul_flops_per_s={"float16": Stat.of([tp * flops])},
        memory_bandwidth_bytes_per_s=Stat.of([tp * bandwidth]),
        source=MeasurementSource.IMPORTED,
    )


def _timings(
    data: SailorData, gpu: str, mbs: int, tp: int, layers: dict[str, list[float]]
) -> list[UnitTiming]:
    out = []
    for layer, (fwd_s, bwd_s, update_s) in layers.items():
        info = data.llm_info[str(tp)][layer] if str(tp) in data.llm_info else None
        act_bytes = int(info["act_mem_bytes"]) * mbs if info else 0
        state_bytes = int(info["params_floats"]) * ADAM_MIXED_BYTES_PER_PARAM if info else 0
        out.append(
            UnitTiming(
                device=device_kind(gpu, tp),
                unit=unit_name(int(layer)),
                micro_batch_size=mbs,
                forward_s=Stat.of([fwd_s]),
                backward_s=Stat.of([bwd_s]),
                optimizer_s=update_s,
                activation_bytes=act_bytes,
                peak_bytes=act_bytes + state_bytes,
                source=MeasurementSource.IMPORTED,
            )
        )
    return out


# --------------------------------------------------------------------------- network
@dataclass(frozen=True, slots=True)
class BandwidthCurve:
    """The study's fit: bandwidth in GB/s = ``c2 m^2 + c1 m + c0``, ``m = log2(bytes / 1e6)``,
    capped at ``max_bytes_per_s`` (the study's measured maximum)."""

    c2: float
    c1: float
    c0: float
    max_bytes_per_s: float

    @staticmethod
    def of(entry: list[Any]) -> BandwidthCurve:
        (c2, c1, c0), cap = entry
        return BandwidthCurve(float(c2), float(c1), float(c0), float(cap))

    def bandwidth_bytes_per_s(self, num_bytes: float) -> float:
        m = math.log2(num_bytes / MB)
        fitted = (self.c2 * m * m + self.c1 * m + self.c0) * GB
        return max(min(fitted, self.max_bytes_per_s), 1.0)

    def time_s(self, num_bytes: float) -> float:
        """Transfer time of one message: ``bytes / bandwidth(bytes)``."""
        return num_bytes / self.bandwidth_bytes_per_s(num_bytes)


Endpoint = tuple[str, str, int]
"""(zone, study GPU name, tp degree) of one end of an inter-node transfer."""


def inter_node_curve(data: SailorData, src: Endpoint, dst: Endpoint) -> BandwidthCurve:
    """Curve from a ``tp``-group of ``src`` GPUs to one of ``dst`` GPUs in another machine.

    More GPUs sending at once over the same two machines' cards move at least as many bytes
    per second as fewer do (one card per machine: the same card, more streams; a card per
    GPU, as on GH200 nodes: more cards). So of the study's entries between these two GPU
    types and zones, in either direction (full-duplex cards), whose tp degrees are at most
    ``src``'s and ``dst``'s, the one with the highest measured maximum is used (ties: the
    same direction, then the closest tp degrees). The rule matters where the file fills a
    pair it did not measure with another pair's fit: Titan-RTX <-> RTX-2080 at tp 8 (and 1)
    carries the 0.11 GB/s fit also given for RTX-2080 -> RTX-3090, while tp 2 and 4 measure
    2.8 GB/s, as between two Titan-RTX or two RTX-2080 machines. Without such an entry, the
    entry of the closest tp degrees (the same direction first).

    Raises:
        ConfigError: the study has no curve between these GPU types and zones.
    """
    want = (src[2], dst[2])
    entries = [
        (entry, 0, (tp_a, tp_b)) for tp_a, tp_b, entry in _inter_node_entries(data, src, dst)
    ]
    entries += [
        (entry, 1, (tp_a, tp_b)) for tp_b, tp_a, entry in _inter_node_entries(data, dst, src)
    ]
    if not entries:
        raise ConfigError(
            f"the study has no inter-node curve between {src[1]} ({src[0]}) and {dst[1]} "
            f"({dst[0]}); choose GPUs the study measured"
        )
    smaller = [e for e in entries if e[2][0] <= want[0] and e[2][1] <= want[1]]
    if smaller:
        entry = max(smaller, key=lambda e: (BandwidthCurve.of(e[0]).max_bytes_per_s, -e[1], e[2]))
    else:
        entry = min(entries, key=lambda e: (abs(e[2][0] - want[0]) + abs(e[2][1] - want[1]), e[1:]))
    return BandwidthCurve.of(entry[0])


def _inter_node_entries(
    data: SailorData, a: Endpoint, b: Endpoint
) -> list[tuple[int, int, list[Any]]]:
    """``(tp at a, tp at b, entry)`` of every curve the study gives from ``a``'s GPUs to
    ``b``'s."""
    by_tp = data.inter_node.get(a[0], {}).get(a[1], {})
    return [
        (int(tp_a), int(tp_b), entry)
        for tp_a, by_zone in by_tp.items()
        for tp_b, entry in by_zone.get(b[0], {}).get(b[1], {}).items()
    ]


def intra_node_curve(data: SailorData, gpu: str, num_gpus: int) -> BandwidthCurve:
    """Curve between ``num_gpus`` GPUs of one ``gpu`` machine (PCIe/NVLink).

    Raises:
        ConfigError: the study has no curve for that GPU and count.
    """
    try:
        return BandwidthCurve.of(data.intra_node[gpu][str(num_gpus)])
    except KeyError:
        raise ConfigError(
            f"the study has no intra-node curve for {num_gpus} x {gpu}; choose a measured count"
        ) from None


def curves_alpha_beta(
    curves: list[BandwidthCurve], min_bytes: float, max_bytes: float, num_points: int = 25
) -> tuple[float, float]:
    """Alpha-beta fit ``time = latency + bytes / bandwidth`` of the slowest of ``curves``.

    Least squares in relative error over ``num_points`` log-spaced message sizes in
    ``[min_bytes, max_bytes]`` (the sizes a plan sends); the time at each size is the
    largest of the curves' (a symmetric hplan link carries the slower direction).
    Returns ``(bandwidth_bytes_per_s, latency_s)``, latency >= 0.

    Raises:
        ValueError: an empty size range or no curve.
    """
    if not curves or not 0 < min_bytes <= max_bytes:
        raise ValueError(f"fit needs curves and 0 < {min_bytes} <= {max_bytes}")
    sizes = np.geomspace(min_bytes, max_bytes, num_points if max_bytes > min_bytes else 1)
    times = np.array([max(c.time_s(x) for c in curves) for x in sizes])
    if len(sizes) == 1:
        return float(sizes[0] / times[0]), 0.0
    latency_s, inv_bw = least_squares_alpha_beta(list(sizes), list(times), relative=True)
    if latency_s < 0 or inv_bw <= 0:
        weights = 1.0 / times
        inv_bw = float(np.sum(sizes * times * weights**2) / np.sum((sizes * weights) ** 2))
        latency_s = 0.0
    return float(1.0 / inv_bw), float(latency_s)
