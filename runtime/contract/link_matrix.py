"""The link matrix file: what ``python -m hplan.runtime.bandwidth`` writes and ``hplan solve
--bandwidth`` reads.

One versioned JSON object, units in every key. It names every rank by host and local rank,
and by the cluster's device name (``<node>/<local_index>``) when the measuring processes
knew their node. For every ordered pair of ranks it holds the raw timings of a
point-to-point sweep over message sizes and the alpha-beta fit of their medians
(``time_s = latency_s + num_bytes / bandwidth_bytes_per_s``, Hockney's model;
:func:`fit_alpha_beta`); for every node with more than one rank, the same for an all-reduce
among the node's ranks.

This module does not import torch: the planner reads these files anywhere.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Sequence
from enum import StrEnum
from functools import cache
from pathlib import Path
from typing import Final, Literal

from pydantic import TypeAdapter

from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.link_model import least_squares_alpha_beta
from hplan.runtime.contract.versioned_file import parse_versioned, record

BANDWIDTH_SCHEMA_VERSION: Final = 1


class FitMethod(StrEnum):
    """How an :class:`AlphaBetaFit` was obtained."""

    LEAST_SQUARES = "least_squares"
    """The least-squares line through the medians (see :func:`fit_alpha_beta`)."""
    LARGEST_MESSAGE = "largest_message"
    """The sweep did not resolve a line (slope <= 0, or R^2 below ``MIN_R_SQUARED``: noise
    swamps the bytes): bandwidth = largest message / its median time, a lower bound of the
    link's bandwidth; latency = the smallest message's median time."""


MIN_R_SQUARED = 0.5
"""Below this, a least-squares line explains too little of the medians to be used."""


@record
class AlphaBetaFit:
    """``time_s = latency_s + num_bytes / bandwidth_bytes_per_s`` fitted to a sweep."""

    latency_s: float
    """Time of the smallest message beyond its bytes at the fitted bandwidth, >= 0."""
    bandwidth_bytes_per_s: float
    r_squared: float
    """Coefficient of determination of the least-squares line on the medians (<= 1; it
    can be negative when noise dominates), whichever ``method`` was used."""
    method: FitMethod = FitMethod.LEAST_SQUARES


@record
class SizeSamples:
    """Timings of one message size."""

    num_bytes: int
    samples_s: tuple[float, ...]
    """One-way time of each timed repeat (warm-up excluded), seconds."""
    median_s: float


@record
class RankName:
    """Who a rank was: where it ran and, when known, which cluster device it was."""

    rank: int
    host: str
    local_rank: int
    node: str | None = None
    """Cluster node name (from ``--node``, ``HPLAN_NODE`` or ``--cluster``); None: unknown."""
    device: str | None = None
    """``<node>/<local_rank>`` when ``node`` is known."""

    @property
    def label(self) -> str:
        """The device name if known, else ``<host>:<local_rank>``."""
        return self.device or f"{self.host}:{self.local_rank}"


@record
class PairLink:
    """Point-to-point from ``src_rank`` to ``dst_rank`` (the direction the data went)."""

    src_rank: int
    dst_rank: int
    fit: AlphaBetaFit
    sizes: tuple[SizeSamples, ...]
    ack_round_trip_s: float
    """Fastest round trip of a 1-byte message and its 1-byte reply; half of it was taken
    off every timed round trip to leave the one-way time (see ``bandwidth/timing.py``)."""


@record
class NodeAllReduce:
    """An all-reduce of float32 tensors among the ranks of one node."""

    node: str
    """Node name, or the host when the node is unknown."""
    ranks: tuple[int, ...]
    fit: AlphaBetaFit
    """Algorithm bandwidth: message bytes / time."""
    bus_bandwidth_bytes_per_s: float
    """``fit.bandwidth_bytes_per_s * 2 (n - 1) / n``, the per-link figure of a ring
    (the convention of nccl-tests' PERFORMANCE.md)."""
    sizes: tuple[SizeSamples, ...]
    """Per repeat, the slowest rank's time."""


@record
class BandwidthFile:
    """A measured link matrix; see the module docstring."""

    schema_version: Literal[1] = BANDWIDTH_SCHEMA_VERSION
    backend: str
    """torch.distributed backend it was measured with (``gloo``, ``nccl``)."""
    world_size: int
    repeats: int
    """Timed repeats per message size (after ``warmup`` untimed ones)."""
    warmup: int
    ranks: tuple[RankName, ...]
    pairs: tuple[PairLink, ...]
    all_reduce: tuple[NodeAllReduce, ...] = ()
    notes: tuple[str, ...] = ()

    def rank_name(self, rank: int) -> RankName:
        """The name of ``rank`` (KeyError if absent)."""
        for name in self.ranks:
            if name.rank == rank:
                return name
        raise KeyError(rank)

    def to_json(self) -> str:
        """Deterministic JSON text (2-space indent, declared field order, final newline)."""
        data = _adapter().dump_python(self, mode="json")
        return json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False) + "\n"

    def save(self, path: Path) -> None:
        """Write the file atomically (a temporary file in the same folder, then a rename).

        Raises:
            ConfigError: the file cannot be written.
        """
        partial = path.with_name(f".{path.name}.{os.getpid()}.part")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(self.to_json(), encoding="utf-8")
            partial.replace(path)
        except OSError as exc:
            raise ConfigError(
                f"cannot write the link matrix to {str(path)!r} ({exc.strerror}); pass --out "
                "a path you can write to"
            ) from None

    @staticmethod
    def check_writable(path: Path) -> None:
        """Fail before a measurement whose result could not be saved to ``path``.

        Raises:
            ConfigError: ``path`` is a directory, or a folder on its way is a file.
        """
        if path.is_dir():
            raise ConfigError(
                f"-o {str(path)!r} is a directory; give the link matrix's file name, e.g. "
                f"{str(path / 'bw.json')!r}"
            )
        for folder in path.parents:
            if folder.exists():
                if not folder.is_dir():
                    raise ConfigError(
                        f"cannot write the link matrix to {str(path)!r}: {str(folder)!r} is a "
                        "file; choose another path"
                    )
                return

    @staticmethod
    def from_json(text: str, *, source: str = "<bandwidth>") -> BandwidthFile:
        """Parse and validate a link-matrix file.

        Raises:
            ConfigError: not JSON, another schema version, unknown keys, wrong types, or
                pairs that name ranks the file does not list. Names the file and field.
        """
        result = parse_versioned(
            text,
            _adapter(),
            what="bandwidth file",
            source=source,
            version=BANDWIDTH_SCHEMA_VERSION,
            fix="re-measure with `python -m hplan.runtime.bandwidth` or `hplan bandwidth`",
        )
        _check_consistent(result, source)
        return result

    @staticmethod
    def load(path: str | Path) -> BandwidthFile:
        """Read and validate a link-matrix file.

        Raises:
            ConfigError: unreadable, or see :meth:`from_json`.
        """
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or type(exc).__name__
            raise ConfigError(
                f"cannot read bandwidth file {str(path)!r} ({reason}); pass the JSON file "
                "that `python -m hplan.runtime.bandwidth` or `hplan bandwidth` wrote"
            ) from None
        return BandwidthFile.from_json(text, source=str(path))


def _check_consistent(result: BandwidthFile, source: str) -> None:
    ranks = {name.rank for name in result.ranks}
    devices = [name.device for name in result.ranks if name.device is not None]
    twice = sorted({d for d in devices if devices.count(d) > 1})
    if len(ranks) != len(result.ranks) or twice:
        what = f"device {twice[0]!r}" if twice else "a rank number"
        raise ConfigError(
            f"bandwidth file {source!r} lists {what} twice in `ranks`; re-measure with a "
            "distinct HPLAN_NODE per node"
        )
    for pair in result.pairs:
        for rank in (pair.src_rank, pair.dst_rank):
            if rank not in ranks:
                raise ConfigError(
                    f"bandwidth file {source!r}: pair {pair.src_rank}->{pair.dst_rank} names "
                    f"rank {rank}, which `ranks` does not list; re-measure the link matrix"
                )
        _check_fit(pair.fit, f"bandwidth file {source!r}: pair {pair.src_rank}->{pair.dst_rank}")
    nodes = [entry.node for entry in result.all_reduce]
    for entry in result.all_reduce:
        where = f"bandwidth file {source!r}: all_reduce of node {entry.node!r}"
        if nodes.count(entry.node) > 1:
            raise ConfigError(f"{where} appears twice; re-measure the link matrix")
        unknown = sorted(set(entry.ranks) - ranks)
        if unknown:
            raise ConfigError(
                f"{where} names rank {unknown[0]}, which `ranks` does not list; re-measure "
                "the link matrix"
            )
        _check_fit(entry.fit, where)
        if not (
            math.isfinite(entry.bus_bandwidth_bytes_per_s) and entry.bus_bandwidth_bytes_per_s > 0
        ):
            raise ConfigError(
                f"{where} has bus bandwidth {entry.bus_bandwidth_bytes_per_s}; it must be a "
                "finite number > 0 (re-measure the link matrix)"
            )


def _check_fit(fit: AlphaBetaFit, where: str) -> None:
    if not (math.isfinite(fit.bandwidth_bytes_per_s) and fit.bandwidth_bytes_per_s > 0):
        raise ConfigError(
            f"{where} has bandwidth {fit.bandwidth_bytes_per_s}; it must be a finite number > 0 "
            "(re-measure the link matrix)"
        )
    if not (math.isfinite(fit.latency_s) and fit.latency_s >= 0):
        raise ConfigError(
            f"{where} has latency {fit.latency_s}; it must be a finite number >= 0 (re-measure "
            "the link matrix)"
        )


@cache
def _adapter() -> TypeAdapter[BandwidthFile]:
    return TypeAdapter(BandwidthFile)


# ----------------------------------------------------------------------------- fitting
def size_samples(num_bytes: int, samples_s: Sequence[float]) -> SizeSamples:
    """The timings of one message size with their median."""
    if not samples_s:
        raise ValueError(f"no timings for {num_bytes} bytes")
    return SizeSamples(
        num_bytes=num_bytes, samples_s=tuple(samples_s), median_s=statistics.median(samples_s)
    )


def fit_alpha_beta(sizes: Sequence[SizeSamples]) -> AlphaBetaFit:
    """Fit ``time_s = latency_s + num_bytes / bandwidth_bytes_per_s`` to the medians.

    The bandwidth is one over the slope of the least-squares line through the medians
    (the large messages, whose times are mostly bytes, decide it). The latency is the
    smallest message's time less its bytes at that bandwidth, clipped at 0: the line's
    own intercept, extrapolated over decades of sizes, would be the noise of the largest
    messages. The smallest message's time is the least median of all sizes: no larger
    message can take less, so a smallest-message median above it is scheduling noise. When
    the line has a slope <= 0 or an R^2 below ``MIN_R_SQUARED`` (times dominated by noise,
    as for a fast link timed with small messages), the largest message's bytes over its
    median time give the bandwidth, a lower bound, and the smallest message's time the
    latency (``FitMethod.LARGEST_MESSAGE``).

    Args:
        sizes: at least two distinct message sizes, each with a median time > 0.

    Returns:
        The fit; ``r_squared`` of the least-squares line on the medians.

    Raises:
        ValueError: fewer than two distinct sizes, or a median that is not > 0.
    """
    xs = [float(s.num_bytes) for s in sizes]
    ys = [s.median_s for s in sizes]
    if len(set(xs)) < 2:
        raise ValueError(f"an alpha-beta fit needs two distinct message sizes, got {sorted(xs)}")
    if min(ys) <= 0:
        raise ValueError(f"every median time must be > 0, got {min(ys)}")
    intercept, slope = least_squares_alpha_beta(xs, ys)
    r_squared = _r_squared(xs, ys, slope, intercept)
    smallest = min(sizes, key=lambda s: s.num_bytes)
    smallest_s = min(ys)
    if slope <= 0 or r_squared < MIN_R_SQUARED:
        largest = max(sizes, key=lambda s: s.num_bytes)
        return AlphaBetaFit(
            latency_s=smallest_s,
            bandwidth_bytes_per_s=largest.num_bytes / largest.median_s,
            r_squared=r_squared,
            method=FitMethod.LARGEST_MESSAGE,
        )
    return AlphaBetaFit(
        latency_s=max(smallest_s - smallest.num_bytes * slope, 0.0),
        bandwidth_bytes_per_s=1.0 / slope,
        r_squared=r_squared,
    )


def _r_squared(xs: Sequence[float], ys: Sequence[float], slope: float, intercept: float) -> float:
    mean_y = statistics.fmean(ys)
    total = sum((y - mean_y) ** 2 for y in ys)
    residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return 1.0 - residual / total if total > 0 else 1.0
