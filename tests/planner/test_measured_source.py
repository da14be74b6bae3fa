"""MeasuredSource: measured numbers beat the roofline, the most specific device key wins,
unmeasured kinds are scaled rooflines, calibrated factors apply, sizes are interpolated."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from hplan.planner.cost.problem_builder import Numerics, RooflineSource, build_problem
from hplan.planner.cost.profiled_times import MeasuredSource, fit_line_at, source_labels
from hplan.planner.hardware.cluster import Device
from hplan.planner.profiling.profile_file import (
    DeviceFactor,
    DeviceProfile,
    MeasurementSource,
    Profile,
    Stat,
    UnitTiming,
)
from tests.fixtures.clusters import cluster_from_dict, cpu_cluster, gpu_cluster, unit_cost

COSTS = (unit_cost("u0"), unit_cost("u1", fwd_flops_per_sample=4e9))
ROOFLINE = RooflineSource()
FP32_NUMERICS = Numerics("float32")


def _stat(value: float) -> Stat:
    return Stat(median=value, p10=value, p90=value, num_samples=3)


def _timing(device: str, unit: str, size: int, fwd_s: float, bwd_s: float | None = None, **kw):
    return UnitTiming(
        device=device,
        unit=unit,
        micro_batch_size=size,
        forward_s=_stat(fwd_s),
        backward_s=_stat(2 * fwd_s if bwd_s is None else bwd_s),
        activation_bytes=0,
        peak_bytes=0,
        **kw,
    )


def _source(*timings: UnitTiming, **profile_fields) -> MeasuredSource:
    profile = Profile(unit_timings=timings, **profile_fields)
    return MeasuredSource(profile, COSTS, "float32", label="prof/")


def _times(source: MeasuredSource, device: Device, unit: int, size: int) -> tuple[float, float]:
    times = source.unit_times(device, COSTS[unit], size, FP32_NUMERICS)
    return times.fwd_time_s, times.bwd_time_s


def test_measured_times_are_used_as_measured_instead_of_the_roofline():
    device = gpu_cluster("rtx3090").devices[0]
    source = _source(_timing("rtx3090", "u0", 2, 0.010, 0.025))
    assert _times(source, device, 0, 2) == (0.010, 0.025)
    assert source.source_label(device, COSTS[0], 2) == "measured"
    assert source.name == "profile prof/"


def test_a_calibrated_timing_says_so():
    device = gpu_cluster("rtx3090").devices[0]
    calibrated = _timing("rtx3090", "u0", 1, 0.01, source=MeasurementSource.CALIBRATED)
    assert _source(calibrated).source_label(device, COSTS[0], 1) == "calibrated"


def test_unmeasured_sizes_follow_a_line_through_the_measured_ones():
    device = gpu_cluster("rtx3090").devices[0]
    source = _source(
        _timing("rtx3090", "u0", 1, 0.002), _timing("rtx3090", "u0", 4, 0.005)
    )  # forward = 0.001 + 0.001 * size
    assert _times(source, device, 0, 2) == pytest.approx((0.003, 0.006))
    assert source.source_label(device, COSTS[0], 2) == "measured (interpolated)"
    assert _times(source, device, 0, 8) == pytest.approx((0.009, 0.018))
    assert source.source_label(device, COSTS[0], 8) == "measured (extrapolated)"


@pytest.mark.parametrize(
    ("samples", "x", "expected"),
    [
        ([(2, 4.0)], 3, 6.0),  # one point: proportional
        ([(1, 2.0), (2, 3.0), (4, 5.0)], 8, 9.0),  # exact line
        ([(1, 3.0), (2, 1.0)], 4, 2.0),  # falling: the mean
        ([(1, 0.5), (2, 3.0)], 4, 5.2),  # negative intercept: through the origin (6.5 / 5 * 4)
    ],
)
def test_line_fit_never_goes_negative_or_downhill(samples, x, expected):
    assert fit_line_at(samples, x) == pytest.approx(expected)


def test_an_unmeasured_kind_gets_the_roofline_scaled_by_the_measured_ratio():
    cluster = gpu_cluster("rtx3090", "rtx4090")
    measured, unmeasured = cluster.devices
    # measure u0 and u1 at exactly 3x their rtx3090 roofline (forward + backward)
    timings = []
    for cost in COSTS:
        for size in (1, 2):
            est = ROOFLINE.unit_times(measured, cost, size, FP32_NUMERICS)
            timings.append(
                _timing("rtx3090", cost.name, size, 3 * est.fwd_time_s, 3 * est.bwd_time_s)
            )
    source = _source(*timings)
    est = ROOFLINE.unit_times(unmeasured, COSTS[1], 4, FP32_NUMERICS)
    assert _times(source, unmeasured, 1, 4) == pytest.approx(
        (3 * est.fwd_time_s, 3 * est.bwd_time_s)
    )
    assert (
        source.source_label(unmeasured, COSTS[1], 4) == "roofline x 3 (scaled by measured devices)"
    )


def test_a_cpu_measurement_does_not_scale_gpu_estimates():
    cpu = cpu_cluster(1).devices[0]
    gpu = gpu_cluster("rtx4090").devices[0]
    est_cpu = ROOFLINE.unit_times(cpu, COSTS[0], 1, FP32_NUMERICS)
    source = _source(_timing("cpu", "u0", 1, 5 * est_cpu.fwd_time_s, 5 * est_cpu.bwd_time_s))
    est_gpu = ROOFLINE.unit_times(gpu, COSTS[0], 1, FP32_NUMERICS)
    assert _times(source, gpu, 0, 1) == (est_gpu.fwd_time_s, est_gpu.bwd_time_s)
    assert source.source_label(gpu, COSTS[0], 1) == "roofline"


def test_measured_device_peaks_replace_catalog_peaks_when_no_unit_was_timed():
    gpu = gpu_cluster("rtx4090").devices[0]
    peaks = DeviceProfile(
        key="rtx4090#GPU-1", kind="rtx4090", name="NVIDIA GeForce RTX 4090", host="h",
        memory_bytes=1, matmul_flops_per_s={"float32": _stat(1e12)},
        memory_bandwidth_bytes_per_s=_stat(1e11),
    )  # fmt: skip
    source = _source(devices=(peaks,))
    fwd, _ = _times(source, gpu, 1, 1)
    cost = COSTS[1]
    flops_s = cost.fwd_flops_per_sample / 1e12
    bytes_s = (cost.param_bytes + cost.io_bytes_per_sample) / 1e11
    assert fwd == pytest.approx(max(flops_s, bytes_s) + cost.num_ops * ROOFLINE.op_overhead_s)
    assert source.source_label(gpu, cost, 1) == "roofline (measured device peaks)"


def test_the_most_specific_device_key_wins():
    cluster = gpu_cluster("rtx3090", "rtx3090")
    first, second = cluster.devices
    profile = Profile(
        unit_timings=(
            _timing("rtx3090", "u0", 1, 0.010),
            _timing("rtx3090#GPU-b", "u0", 1, 0.020),
            _timing(f"rtx3090@{second.name}", "u0", 1, 0.030),
        )
    )
    source = MeasuredSource(profile, COSTS, "float32")
    assert _times(source, first, 0, 1)[0] == 0.010  # kind
    assert _times(source, second, 0, 1)[0] == 0.030  # kind@device beats kind
    bound = MeasuredSource(profile, COSTS, "float32", device_uuids={first.name: "GPU-b"})
    assert _times(bound, first, 0, 1)[0] == 0.020  # kind#uuid of that card beats kind


def test_cards_measured_by_uuid_stand_for_their_kind_when_pooled():
    device = gpu_cluster("rtx3090").devices[0]
    source = _source(
        _timing("rtx3090#GPU-a", "u0", 1, 0.010),
        _timing("rtx3090#GPU-b", "u0", 1, 0.020),
        _timing("rtx3090#GPU-c", "u0", 1, 0.060),
    )
    assert _times(source, device, 0, 1)[0] == 0.020  # the median card
    assert source.source_label(device, COSTS[0], 1) == "measured"


def test_a_device_factor_multiplies_that_device_only():
    cluster = gpu_cluster("rtx3090", "rtx3090")
    first, second = cluster.devices
    factor = DeviceFactor(device=second.name, kind="rtx3090", time_factor=1.4, reason="slow")
    source = _source(
        _timing("rtx3090", "u0", 1, 0.010, 0.020, optimizer_s=0.002), device_factors=(factor,)
    )
    assert _times(source, first, 0, 1) == (0.010, 0.020)
    assert _times(source, second, 0, 1) == pytest.approx((0.014, 0.028))
    assert source.source_label(second, COSTS[0], 1) == "measured x 1.40 (calibrated factor)"
    assert source.optimizer_time_s(first, COSTS[0], 2.0) == 0.002
    assert source.optimizer_time_s(second, COSTS[0], 2.0) == pytest.approx(0.0028)
    stale = replace(factor, kind="rtx4090")  # the device changed kind since calibration
    assert (
        _times(_source(_timing("rtx3090", "u0", 1, 0.01), device_factors=(stale,)), second, 0, 1)[0]
        == 0.01
    )


def test_cluster_overrides_scale_their_kinds_measurement():
    cluster = cpu_cluster(2, peak_tflops=[0.2, 0.1])
    fast, plain = cluster.devices
    source = _source(_timing("cpu", "u1", 1, 0.010))
    assert _times(source, plain, 1, 1)[0] == 0.010
    fast_fwd = _times(source, fast, 1, 1)[0]
    assert 0.004 < fast_fwd < 0.010  # declared twice as fast: scaled by the roofline ratio
    assert "cluster.yaml overrides cpu" in source.source_label(fast, COSTS[1], 1)


def test_unmeasured_optimizer_steps_use_the_measured_optimizer_ratio():
    cluster = gpu_cluster("rtx3090", "rtx4090")
    measured, other = cluster.devices
    est = ROOFLINE.optimizer_time_s(measured, COSTS[0], 2.0)
    source = _source(_timing("rtx3090", "u0", 1, 0.01, optimizer_s=4 * est))
    assert source.optimizer_time_s(measured, COSTS[0], 2.0) == pytest.approx(4 * est)
    assert source.optimizer_time_s(other, COSTS[1], 2.0) == pytest.approx(
        4 * ROOFLINE.optimizer_time_s(other, COSTS[1], 2.0)
    )


def test_problem_built_from_a_profile_has_measured_entries_and_labels():
    from tests.fixtures.clusters import stand_in_graph

    graph = stand_in_graph(list(COSTS))
    cluster = cluster_from_dict(
        {
            "name": "two",
            "nodes": [
                {"name": "a", "host": "a", "devices": [{"type": "rtx3090"}, {"type": "rtx4090"}]}
            ],
        }
    )
    source = _source(_timing("rtx3090", "u0", 1, 0.5), _timing("rtx3090", "u1", 1, 0.25))
    problem = build_problem(graph, cluster, global_batch_size=2, time_source=source)
    assert problem.fwd_time_s[0, 0, 0] == 0.5 and problem.fwd_time_s[0, 1, 0] == 0.25
    assert math.isclose(problem.fwd_time_s[0, 0, 1], 1.0)  # size 2 from the size-1 point
    labels = source_labels(source, cluster.devices, graph.unit_costs, problem.micro_batch_sizes)
    assert labels[0][0] == ("measured", "measured (extrapolated)")
    assert labels[1][0][0].startswith("roofline x ")
    assert source_labels(ROOFLINE, cluster.devices, graph.unit_costs, (1,))[1][1] == ("roofline",)


def test_a_profile_that_measured_none_of_the_clusters_kinds_says_so(tmp_path):
    from pathlib import Path

    from hplan.planner.api import SolveRequest, plan_training

    root = Path(__file__).resolve().parents[2]
    (tmp_path / "empty.json").write_text(Profile().to_json(), encoding="utf-8")
    request = SolveRequest(
        model_path=root / "examples" / "mlp" / "model.py",
        cluster_path=root / "examples" / "clusters" / "mixed-3090-4090.yaml",
        global_batch_size=16,
        profile_path=tmp_path / "empty.json",
    )
    notes = plan_training(request).plan.report.notes
    assert any("no measurement for rtx3060, rtx3090, rtx4090" in n for n in notes), notes
