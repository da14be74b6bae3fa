"""Device microbenchmarks: achieved matmul FLOP/s per dtype and memory bandwidth.

Each benchmark warms up, then times repeated runs and reports the median and the 10th/90th
percentiles (:class:`hplan.planner.profiling.profile_file.Stat`). On a GPU the clock is a pair of CUDA
events around each run; on a CPU ``torch.utils.benchmark.Timer.blocked_autorange`` (each
sample is the mean of a block of runs long enough for the timer's resolution).

- Matmul: ``C = A @ B`` with square ``n x n`` operands; ``2 n^3`` FLOPs per product (one
  multiply and one add per inner-product term).
- Memory bandwidth: ``dst.copy_(src)`` of one large buffer; ``2 x`` its bytes moved per
  copy (one read, one write), as STREAM's "Copy" counts (McCalpin, "Memory Bandwidth and
  Machine Balance in Current High Performance Computers", IEEE TCCA newsletter, 1995).

Sizes are chosen so the CPU run takes a few seconds at most: one CPU thread (the catalog's
``cpu`` device is one core of a rehearsal), 512 x 512 fp32 operands, a 64 MiB copy.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.utils import benchmark

from hplan.planner.profiling.profile_file import Stat

_MIB = 2**20


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchSizes:
    """Problem sizes and time budget of the microbenchmarks on one device class."""

    matmul_n: dict[str, int]
    """Square matmul size by dtype name."""
    copy_bytes: int
    min_time_s: float
    """Timed seconds per benchmark (after warm-up)."""


CPU_SIZES = BenchSizes(
    matmul_n={"float32": 512, "bfloat16": 512, "float16": 256},
    copy_bytes=64 * _MIB,
    min_time_s=0.3,
)
GPU_SIZES = BenchSizes(
    matmul_n={"float32": 4096, "bfloat16": 8192, "float16": 8192},
    copy_bytes=1024 * _MIB,
    min_time_s=0.5,
)


@dataclass(frozen=True, slots=True)
class DeviceBenchmark:
    """Results of :func:`benchmark_device`."""

    matmul_flops_per_s: dict[str, Stat]
    memory_bandwidth_bytes_per_s: Stat
    num_threads: int
    """CPU threads torch used (1 on a GPU's host side is irrelevant but recorded)."""


def matmul_dtypes(device: torch.device) -> tuple[str, ...]:
    """Dtype names to benchmark on ``device``: float32, plus bfloat16/float16 where supported.

    CPU: all three (torch implements them; bf16 uses AMX or AVX-512 BF16 where present).
    CUDA: float16 always; bfloat16 when ``torch.cuda.is_bf16_supported()`` natively.
    """
    if device.type != "cuda":
        return ("float32", "bfloat16", "float16")
    names = ["float32", "float16"]
    if torch.cuda.is_bf16_supported(including_emulation=False):
        names.insert(1, "bfloat16")
    return tuple(names)


def benchmark_device(
    device: torch.device, *, sizes: BenchSizes | None = None, dtypes: Sequence[str] | None = None
) -> DeviceBenchmark:
    """Matmul FLOP/s for each dtype and copy bandwidth of ``device``.

    Args:
        device: ``cpu`` (timed on one thread) or ``cuda:N``.
        sizes: default ``GPU_SIZES`` on CUDA, else ``CPU_SIZES``.
        dtypes: default :func:`matmul_dtypes`.

    Returns:
        FLOP/s by dtype name (``2 n^3`` per product) and bytes/s (``2 x`` buffer bytes per
        copy), each a ``Stat`` over the timed samples.
    """
    sizes = sizes or (GPU_SIZES if device.type == "cuda" else CPU_SIZES)
    names = tuple(dtypes) if dtypes is not None else matmul_dtypes(device)
    with one_cpu_thread(device):
        flops = {
            name: matmul_flops_per_s(
                device, getattr(torch, name), sizes.matmul_n.get(name, 512), sizes.min_time_s
            )
            for name in names
        }
        bandwidth = copy_bandwidth_bytes_per_s(device, sizes.copy_bytes, sizes.min_time_s)
        threads = torch.get_num_threads()
    return DeviceBenchmark(flops, bandwidth, threads)


def matmul_flops_per_s(device: torch.device, dtype: torch.dtype, n: int, min_time_s: float) -> Stat:
    """Achieved FLOP/s of an ``n x n @ n x n`` matmul in ``dtype`` (``2 n^3`` FLOPs each)."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=generator).to(device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = time_call(lambda: torch.mm(a, b, out=out), device, min_time_s=min_time_s)
    return Stat.of([2.0 * n**3 / s for s in seconds])


def copy_bandwidth_bytes_per_s(device: torch.device, num_bytes: int, min_time_s: float) -> Stat:
    """Achieved bytes/s of ``dst.copy_(src)`` of a ``num_bytes`` float32 buffer (read+write)."""
    numel = max(num_bytes // 4, 1)
    src = torch.ones(numel, device=device)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), device, min_time_s=min_time_s)
    return Stat.of([2.0 * numel * 4 / s for s in seconds])


def time_call(
    fn: Callable[[], object],
    device: torch.device,
    *,
    min_time_s: float,
    num_warmup: int = 3,
    max_samples: int = 200,
) -> list[float]:
    """Seconds per call of ``fn`` on ``device``, one entry per timed sample (>= 3 samples).

    CPU: ``torch.utils.benchmark.Timer.blocked_autorange(min_run_time=min_time_s)`` with the
    current thread count; each sample is a block's mean. CUDA: CUDA events around each call,
    after ``num_warmup`` calls, until ``min_time_s`` of samples or ``max_samples``.
    """
    if device.type != "cuda":
        timer = benchmark.Timer(
            stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
        )
        for _ in range(num_warmup):
            fn()
        measurement = timer.blocked_autorange(min_run_time=min_time_s)
        times = list(measurement.times)
        while len(times) < 3:
            times += timer.timeit(measurement.number_per_run).times
        return times
    watch = Stopwatch(device)
    for _ in range(num_warmup):
        fn()
    samples: list[float] = []
    while len(samples) < 3 or (sum(samples) < min_time_s and len(samples) < max_samples):
        samples.append(watch.laps([fn])[0])
    return samples


class Stopwatch:
    """Times consecutive calls on a device: CUDA events on a GPU, ``perf_counter`` on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def laps(self, calls: Sequence[Callable[[], object]]) -> list[float]:
        """Run ``calls`` one after the other; return the seconds each took."""
        if self.device.type == "cuda":
            return self._cuda_laps(calls)
        marks = [time.perf_counter()]
        for call in calls:
            call()
            marks.append(time.perf_counter())
        return [b - a for a, b in itertools.pairwise(marks)]

    def _cuda_laps(self, calls: Sequence[Callable[[], object]]) -> list[float]:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(calls) + 1)]
        with torch.cuda.device(self.device):
            events[0].record()
            for call, event in zip(calls, events[1:], strict=True):
                call()
                event.record()
            events[-1].synchronize()
        return [a.elapsed_time(b) / 1000.0 for a, b in itertools.pairwise(events)]


@contextlib.contextmanager
def one_cpu_thread(device: torch.device) -> Iterator[None]:
    """Torch uses one intra-op thread inside the block when ``device`` is a CPU.

    The catalog's ``cpu`` device is one core (one rehearsal rank runs one thread), so
    measurements of it use one thread too. No effect for a CUDA device.
    """
    before = torch.get_num_threads()
    if device.type != "cuda":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
