"""Unit conversions, in one place.

hplan computes in SI base units (bytes, seconds, FLOP, FLOP/s, bytes/s). User-facing
files use the units people quote (GB, GiB, Gbit/s, TFLOP/s, microseconds); they are
converted here and nowhere else.

Conventions (see the style guide): "GB" means 10^9 bytes and "GiB" 2^30 bytes; link
speeds in "Gbit/s" are decimal bits (10 GbE = 10 * 10^9 bit/s = 1.25 * 10^9 bytes/s).
"""

from __future__ import annotations

BYTES_PER_KB = 1e3
BYTES_PER_MB = 1e6
BYTES_PER_GB = 1e9
BYTES_PER_KIB = 2**10
BYTES_PER_MIB = 2**20
BYTES_PER_GIB = 2**30
BITS_PER_BYTE = 8
FLOPS_PER_TFLOP = 1e12
FLOPS_PER_GFLOP = 1e9
US_PER_S = 1e6
MS_PER_S = 1e3
S_PER_MIN = 60.0


def gb_to_bytes(gb: float) -> float:
    """Decimal gigabytes to bytes (1 GB = 10^9 bytes)."""
    return gb * BYTES_PER_GB


def gib_to_bytes(gib: float) -> float:
    """Binary gibibytes to bytes (1 GiB = 2^30 bytes)."""
    return gib * BYTES_PER_GIB


def gb_per_s_to_bytes_per_s(gb_per_s: float) -> float:
    """GB/s (10^9 bytes per second) to bytes/s."""
    return gb_per_s * BYTES_PER_GB


def gbit_per_s_to_bytes_per_s(gbit_per_s: float) -> float:
    """Gbit/s (10^9 bits per second, as in "10 GbE") to bytes/s."""
    return gbit_per_s * BYTES_PER_GB / BITS_PER_BYTE


def tflops_to_flops(tflops: float) -> float:
    """TFLOP/s to FLOP/s (1 TFLOP/s = 10^12 FLOP/s)."""
    return tflops * FLOPS_PER_TFLOP


def gflops_to_flops(gflops: float) -> float:
    """GFLOP/s to FLOP/s (1 GFLOP/s = 10^9 FLOP/s)."""
    return gflops * FLOPS_PER_GFLOP


def us_to_s(us: float) -> float:
    """Microseconds to seconds."""
    return us / US_PER_S


_DECIMAL_UNITS = ((BYTES_PER_GB, "GB"), (BYTES_PER_MB, "MB"), (BYTES_PER_KB, "kB"))


def format_bytes(num_bytes: float) -> str:
    """Human byte count in decimal units: ``1_500_000 -> "1.5 MB"``, ``512 -> "512 B"``."""
    for scale_bytes, unit in _DECIMAL_UNITS:
        if abs(num_bytes) >= scale_bytes:
            return f"{num_bytes / scale_bytes:.1f} {unit}"
    return f"{num_bytes:.0f} B"


def format_bytes_pair(first_bytes: float, second_bytes: float) -> tuple[str, str]:
    """Two byte counts for a "needs X, has Y" message, so that the figures always show.

    Both in the larger's decimal unit with one to four decimals, as few as tell them apart:
    ``(11.04e9, 11.0e9) -> ("11.04 GB", "11.00 GB")``. When the smaller would read below 0.1
    of that unit, each gets its own unit (:func:`format_bytes`): ``(3.2e6, 1.5e9) ->
    ("3.2 MB", "1.5 GB")``, never ``0.00 GB``.
    """
    larger = max(abs(first_bytes), abs(second_bytes))
    scale_bytes, unit = next(
        ((scale, name) for scale, name in _DECIMAL_UNITS if larger >= scale), (1.0, "B")
    )
    if unit == "B":
        return f"{first_bytes:.0f} B", f"{second_bytes:.0f} B"
    smaller = min(abs(first_bytes), abs(second_bytes))
    if 0 < smaller < 0.1 * scale_bytes:
        return format_bytes(first_bytes), format_bytes(second_bytes)
    for decimals in (1, 2, 3, 4):
        a, b = (
            f"{first_bytes / scale_bytes:.{decimals}f}",
            f"{second_bytes / scale_bytes:.{decimals}f}",
        )
        if a != b or first_bytes == second_bytes:
            break
    return f"{a} {unit}", f"{b} {unit}"


def format_link_speed(bandwidth_bytes_per_s: float) -> str:
    """A link's speed in decimal bits, three significant digits: ``1.25e8 -> "1 Gb/s"``,
    ``1.25e7 -> "100 Mb/s"``."""
    gbit = bandwidth_bytes_per_s * BITS_PER_BYTE / BYTES_PER_GB
    if gbit >= 1:
        return f"{gbit:.3g} Gb/s"
    return f"{gbit * 1e3:.3g} Mb/s"
