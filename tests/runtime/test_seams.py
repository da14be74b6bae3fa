"""The executor's seams (compute clock, link delay), the env:// rendezvous's rank check, and
what a rank shows when one of its actions fails."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import pytest
import torch

from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.metrics_file import MemoryMeasure
from hplan.runtime.executor.rendezvous import check_torchrun_rank, rendezvous_address
from hplan.runtime.executor.seams import (
    CudaEventClock,
    HostClock,
    LinkDelay,
    MemoryMeter,
    Phase,
    _status_bytes,
    _trim_heap,
    default_clock,
)
from tests.fixtures.plans import NUMBERED_DATASET, ReplicaShape, make_plan, run_ranks, write_model
from tests.fixtures.sample_plans import mixed_plan


def test_the_host_clock_times_each_block_once_by_phase() -> None:
    clock = HostClock()
    with clock.optimizer():
        time.sleep(0.01)
    spans = clock.take_spans()
    assert [(s.phase, s.label) for s in spans] == [(Phase.OPTIMIZER, "optimizer")]
    assert spans[0].duration_s >= 0.009
    assert clock.take_spans() == []  # handed out once


def test_the_default_seams_add_nothing() -> None:
    delay = LinkDelay()
    assert not delay.delays(3)
    assert delay.all_reduce_floor_s((0, 1), 10**9) == 0.0
    assert isinstance(default_clock(torch.device("cpu")), HostClock)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_cuda_clock_times_the_kernels_not_their_launch() -> None:
    device = torch.device("cuda", 0)
    clock = default_clock(device)
    assert isinstance(clock, CudaEventClock)
    a = torch.randn(4096, 4096, device=device)
    host_start_s = time.monotonic()
    with clock.optimizer():
        for _ in range(20):
            a = a @ a / a.norm()
    host_launch_s = time.monotonic() - host_start_s
    (span,) = clock.take_spans()
    assert span.duration_s > host_launch_s  # the host returned before the kernels ended
    assert span.start_s >= host_start_s - 0.1


def test_under_torchrun_the_ranks_it_gave_must_be_the_plans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan = mixed_plan()  # box-a: ranks 0, 1; box-b: ranks 2, 3, 4
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("WORLD_SIZE", "5")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    check_torchrun_rank(plan, 2)
    assert rendezvous_address(plan, host=None, port=1234) == ("10.0.0.1", 29500)  # torchrun's
    monkeypatch.setenv("RANK", "0")  # box-b started as node rank 0
    with pytest.raises(ConfigError, match=r"torchrun gave this process RANK=0, but .* RANK=2"):
        check_torchrun_rank(plan, 2)


def test_without_torchrun_the_address_is_the_option_then_the_environment_then_the_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan = mixed_plan()
    for name in ("TORCHELASTIC_USE_AGENT_STORE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert rendezvous_address(plan, host=None, port=None) == (
        plan.training.master_host,
        plan.training.master_port,
    )
    monkeypatch.setenv("MASTER_PORT", "4000")
    assert rendezvous_address(plan, host="127.0.0.1", port=None) == ("127.0.0.1", 4000)
    assert rendezvous_address(plan, host="127.0.0.1", port=5000) == ("127.0.0.1", 5000)


VECTOR_LOSS = NUMBERED_DATASET.replace(
    "return torch.nn.functional.mse_loss(pred, target)",
    "return torch.nn.functional.mse_loss(pred, target, reduction='none')",
)


def test_a_failing_action_shows_the_schedule_above_its_one_line_error(tmp_path: Path) -> None:
    path = write_model(tmp_path, VECTOR_LOSS)
    plan = make_plan(path, [ReplicaShape((1, 1), micro_batch_size=2, num_samples=4)])
    outcomes = run_ranks(plan, tmp_path / "run", "--steps", "1", timeout_s=60)
    last = outcomes[1]  # the last stage computes the loss
    assert last.returncode == 2, last.stderr
    lines = last.stderr.strip().splitlines()
    assert lines[-1].startswith("hplan run (rank 1): ModelFileError: loss_fn")
    header = next(i for i, line in enumerate(lines) if "failed at action" in line)
    assert "failed at action 1F0 (s1.F.mb0), step 0 of replica 0's schedule" in lines[header]
    assert lines[header + 1] == "columns: Rank 0 = plan rank 0, Rank 1 = plan rank 1"
    assert lines[header + 3].endswith("<-- ERROR HERE") and "1F0" in lines[header + 3]
    assert "Traceback" not in last.stderr


def test_the_memory_meter_counts_what_is_allocated_after_it_starts_and_keeps_the_peak() -> None:
    size_bytes = 64 * 2**20
    meter = MemoryMeter(torch.device("cpu"))
    block = torch.ones(size_bytes // 4)  # touched: resident
    peak_bytes = meter.peak_bytes()
    del block
    # a peak, not the current size (Linux's resident-set counters are approximate per CPU)
    assert meter.peak_bytes() >= peak_bytes - 2**20
    grown_bytes = peak_bytes - meter.baseline_bytes
    if meter.measure is MemoryMeasure.RSS_LIFETIME_PEAK:
        assert grown_bytes >= 0  # the lifetime peak may already have been higher
        return
    assert meter.measure is MemoryMeasure.RSS_HIGH_WATER
    if grown_bytes < size_bytes:  # seen once under a loaded CI run: measure once more, and
        meter = MemoryMeter(torch.device("cpu"))  # say what the kernel reported if it recurs
        block = torch.ones(size_bytes // 4)
        peak_bytes = meter.peak_bytes()
        now_bytes = _status_bytes("VmRSS")
        del block
        grown_bytes = peak_bytes - meter.baseline_bytes
        assert size_bytes <= grown_bytes, (
            f"baseline {meter.baseline_bytes} B, VmHWM {peak_bytes} B, VmRSS {now_bytes} B "
            f"with the {size_bytes} B block held"
        )
    assert size_bytes <= grown_bytes < size_bytes + 32 * 2**20
    # the baseline is the resident set, far below the interpreter + torch lifetime peak
    again = MemoryMeter(torch.device("cpu"))
    assert again.peak_bytes() - again.baseline_bytes < 8 * 2**20


def test_the_memory_meter_leaves_out_an_excluded_window_but_not_what_it_left_behind() -> None:
    size_bytes = 96 * 2**20  # above glibc's largest mmap threshold: freed at once
    gc.collect()  # the window trims the heap: trim what earlier tests freed first, so
    _trim_heap()  # that the window's own effect is what the resident set shows
    meter = MemoryMeter(torch.device("cpu"))
    if meter.measure is not MemoryMeasure.RSS_HIGH_WATER:
        pytest.skip("needs a resettable resident-set high-water mark (Linux)")
    before_bytes = meter.peak_bytes()
    with meter.excluded():
        timing_copy = torch.ones(size_bytes // 4)  # a rehearsal's copy of the stage, say
        del timing_copy
        kept = torch.ones(size_bytes // 8)  # still held after the window: counted
    assert meter.peak_bytes() < before_bytes + size_bytes // 2 + 16 * 2**20
    assert meter.peak_bytes() >= before_bytes + size_bytes // 2 - 2**20
    del kept


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_meter_counts_the_allocators_bytes_from_its_start() -> None:
    device = torch.device("cuda", 0)
    before = torch.ones(2**20, device=device)  # 4 MiB held before the build: the baseline
    meter = MemoryMeter(device)
    assert meter.measure is MemoryMeasure.CUDA_ALLOCATED
    assert meter.baseline_bytes >= before.numel() * 4
    block = torch.ones(2**24, device=device)  # 64 MiB, freed again: the peak keeps it
    del block
    grown_bytes = meter.peak_bytes() - meter.baseline_bytes
    assert 2**26 <= grown_bytes < 2**26 + 2**21
