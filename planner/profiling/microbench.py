"""Device microbenchmarks: achieved matmul FLOP/s per dtype and memory bandwidth.

Each benchmark warms up, then times a few windows (``windows.py``: sustained speeds, not
bursts) and reports the median and the 10th/90th percentiles of their means
(``profile_file.Stat``); CUDA events on a GPU, ``time.perf_counter`` on a CPU.

- Matmul: ``C = A @ B`` with square ``n x n`` operands; ``2 n^3`` FLOPs per product (one
  multiply and one add per inner-product term).
- Memory bandwidth: ``dst.copy_(src)`` of one large buffer; ``2 x`` its bytes moved per
  copy (one read, one write), as STREAM's "Copy" counts (McCalpin, "Memory Bandwidth and
  Machine Balance in Current High Performance Computers", IEEE TCCA newsletter, 1995).

The CPU sizes (one thread, as the catalog's one-core ``cpu`` device; 512 x 512 fp32
operands, a 64 MiB copy) keep its run to a few seconds.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from hplan.planner.profiling.profile_file import Stat
from hplan.planner.profiling.windows import (
    DEFAULT_NUM_WINDOWS,
    DEFAULT_WINDOW_S,
    run_window,
    sustained,
)
from hplan.runtime.contract.cpus import usable_cpus

_MIB = 2**20


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchSizes:
    """Problem sizes and time budget of the microbenchmarks on one device class."""

    matmul_n: dict[str, int]
    """Square matmul size by dtype name."""
    copy_bytes: int
    window_s: float = DEFAULT_WINDOW_S
    """Wall seconds each timed window lasts at least (after warm-up)."""
    num_windows: int = DEFAULT_NUM_WINDOWS
    """Windows per benchmark; the samples of its ``Stat``."""


CPU_SIZES = BenchSizes(
    matmul_n={"float32": 512, "bfloat16": 512, "float16": 256},
    copy_bytes=64 * _MIB,
)
GPU_SIZES = BenchSizes(
    matmul_n={"float32": 4096, "bfloat16": 8192, "float16": 8192},
    copy_bytes=1024 * _MIB,
    window_s=0.5,
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
    device: torch.device,
    *,
    sizes: BenchSizes | None = None,
    dtypes: Sequence[str] | None = None,
    window_s: float | None = None,
) -> DeviceBenchmark:
    """Matmul FLOP/s for each dtype and copy bandwidth of ``device``.

    Args:
        device: ``cpu`` (timed on one thread) or ``cuda:N``.
        sizes: default ``GPU_SIZES`` on CUDA, else ``CPU_SIZES``.
        dtypes: default :func:`matmul_dtypes`.
        window_s: replaces the window of ``sizes`` (None: keep it).

    Returns:
        FLOP/s by dtype name (``2 n^3`` per product) and bytes/s (``2 x`` buffer bytes per
        copy), each a ``Stat`` over the timed samples.
    """
    sizes = sizes or (GPU_SIZES if device.type == "cuda" else CPU_SIZES)
    if window_s is not None:
        sizes = replace(sizes, window_s=window_s)
    names = tuple(dtypes) if dtypes is not None else matmul_dtypes(device)
    with one_cpu_thread(device):
        flops = {
            name: matmul_flops_per_s(
                device, getattr(torch, name), sizes.matmul_n.get(name, 512), sizes
            )
            for name in names
        }
        bandwidth = copy_bandwidth_bytes_per_s(device, sizes.copy_bytes, sizes)
        threads = torch.get_num_threads()
    return DeviceBenchmark(flops, bandwidth, threads)


def matmul_flops_per_s(device: torch.device, dtype: torch.dtype, n: int, sizes: BenchSizes) -> Stat:
    """Achieved FLOP/s of an ``n x n @ n x n`` matmul in ``dtype`` (``2 n^3`` FLOPs each),
    one sample per window of ``sizes``."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=generator).to(device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = time_call(
        lambda: torch.mm(a, b, out=out),
        device,
        window_s=sizes.window_s,
        num_windows=sizes.num_windows,
    )
    return Stat.of([2.0 * n**3 / s for s in seconds])


def copy_bandwidth_bytes_per_s(device: torch.device, num_bytes: int, sizes: BenchSizes) -> Stat:
    """Achieved bytes/s of ``dst.copy_(src)`` of a ``num_bytes`` float32 buffer (read+write),
    one sample per window of ``sizes``."""
    numel = max(num_bytes // 4, 1)
    src = torch.ones(numel, device=device)
    dst = torch.empty_like(src)
    seconds = time_call(
        lambda: dst.copy_(src), device, window_s=sizes.window_s, num_windows=sizes.num_windows
    )
    return Stat.of([2.0 * numel * 4 / s for s in seconds])


def time_call(
    fn: Callable[[], object],
    device: torch.device,
    *,
    window_s: float = DEFAULT_WINDOW_S,
    num_windows: int = DEFAULT_NUM_WINDOWS,
    num_warmup: int = 3,
) -> list[float]:
    """Seconds per call of ``fn`` on ``device``: one mean per window (``Stopwatch.window``),
    ``num_windows`` windows of at least ``window_s`` wall seconds, after ``num_warmup`` calls."""
    for _ in range(num_warmup):
        fn()
    watch = Stopwatch(device, quota_cores=usable_cpus().quota_cores)
    return [watch.window([fn], window_s)[0] for _ in range(num_windows)]


class Stopwatch:
    """Times consecutive calls on a device: CUDA events on a GPU, ``perf_counter`` on a CPU."""

    def __init__(
        self,
        device: torch.device,
        clock: Callable[[], float] = time.perf_counter,
        cpu_clock: Callable[[], float] = time.process_time,
        quota_cores: float | None = None,
    ) -> None:
        """
        Args:
            clock: wall seconds (``time.perf_counter``); the CPU laps and every window's
                length are read from it.
            cpu_clock: this process's CPU seconds (``time.process_time``: every torch
                thread's), by which a CPU window's wall time is shared out among its calls.
            quota_cores: the process's cgroup CPU quota in cores (``contract.cpus``); None:
                none. Where it is below the torch threads a window runs, a CPU call's sample
                is its CPU seconds over the quota (``windows.sustained``).
        """
        self.device = device
        self.clock = clock
        self.cpu_clock = cpu_clock
        self.quota_cores = quota_cores

    def window(self, calls: Sequence[Callable[[], object]], window_s: float) -> list[float]:
        """Run ``calls`` one after the other, again and again, until at least ``window_s``
        wall seconds have passed (once at least); the mean seconds of each call
        (``windows.run_window``). On a CPU the calls' wall time is shared out by their
        CPU time (``windows.apportion``), or under a binding CPU quota each call takes its
        CPU time over the quota (``windows.sustained``)."""
        if self.device.type == "cuda":
            return run_window(lambda: self.laps(calls), len(calls), window_s, self.clock)
        num_calls = len(calls)
        means = run_window(lambda: self._cpu_laps(calls), 2 * num_calls, window_s, self.clock)
        return sustained(
            means[:num_calls], means[num_calls:], self.quota_cores, torch.get_num_threads()
        )

    def _cpu_laps(self, calls: Sequence[Callable[[], object]]) -> list[float]:
        """Run ``calls`` once each: the wall seconds of each, then the CPU seconds of each.

        Each CPU reading comes before its wall reading: reading a thread's CPU time is a
        system call that brings its run time up to date, which is where the kernel finds a
        quota spent and pauses the thread, so the pause must fall inside a wall lap."""
        walls = [self.clock()]
        cpus = [self.cpu_clock()]
        for call in calls:
            call()
            cpus.append(self.cpu_clock())
            walls.append(self.clock())
        return [b - a for a, b in itertools.pairwise(walls)] + [
            b - a for a, b in itertools.pairwise(cpus)
        ]

    def laps(self, calls: Sequence[Callable[[], object]]) -> list[float]:
        """Run ``calls`` one after the other; return the seconds each took."""
        if self.device.type == "cuda":
            return self._cuda_laps(calls)
        marks = [self.clock()]
        for call in calls:
            call()
            marks.append(self.clock())
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
