"""MeasuredSource: measured numbers beat the roofline, the most specific device key wins,
unmeasured kinds are scaled rooflines, calibrated factors apply, sizes are interpolated."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from hplan.planner.cost.problem_builder import Numerics, RooflineSource, build_problem
from hplan.planner.cost.profiled_times import (
    MeasuredSource,
    check_profile_targets,
    source_labels,
    time_at_size,
)
from hplan.planner.hardware.cluster import Device
from hplan.planner.profiling.profile_file import (
    DeviceFactor,
    DeviceProfile,
    MeasurementSource,
    Profile,
    Stat,
    UnitTiming,
)
from hplan.runtime.contract.errors import ConfigError
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
        ([(1, 2.0), (2, 3.0), (4, 5.0)], 8, 9.0),  # above: the top two sizes' line
        ([(1, 1.0), (8, 1.7), (64, 7.3)], 32, 4.1),  # inside: the line of its neighbours
        ([(1, 1.0), (8, 1.7), (64, 7.3)], 4, 1.3),  # ... the overhead of small sizes kept
        ([(1, 3.0), (2, 1.0)], 4, 6.0),  # falling: made flat, then proportional above
        ([(2, 0.5), (4, 3.0)], 1, 0.25),  # below, the line would cross 0: proportional
        ([(2, 2.0), (4, 3.0)], 1, 1.5),  # below: the line of the two smallest
        ([(1, 1.0), (2, 0.9), (4, 2.0)], 2, 1.0),  # a dip is noise: running maximum
    ],
)
def test_time_at_size_is_overhead_plus_per_sample_time_never_negative_or_downhill(
    samples, x, expected
):
    assert time_at_size(samples, x) == pytest.approx(expected)


def test_one_large_micro_batch_is_cheaper_than_several_small_ones_as_measured():
    # a CPU-like unit: about 0.8 ms per micro-batch plus 8 us per sample (measured on the
    # MLP example, one core), falling per-sample cost from 1 to 2048
    device = cpu_cluster(1).devices[0]
    measured = {1: 0.85e-3, 8: 0.98e-3, 64: 1.49e-3, 512: 5.5e-3, 2048: 17.5e-3}
    source = _source(*(_timing("cpu", "u0", s, t / 3, 2 * t / 3) for s, t in measured.items()))

    def step_s(size: int) -> float:
        return sum(_times(source, device, 0, size))

    assert step_s(48) < 6 * step_s(8)
    per_sample = [step_s(s) / s for s in (1, 2, 8, 48, 64, 256, 512, 2048, 4096)]
    assert per_sample == sorted(per_sample, reverse=True)  # falls with the size
    assert step_s(4096) == pytest.approx(17.5e-3 + 2048 * (17.5e-3 - 5.5e-3) / 1536)


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
    cluster = gpu_cluster("rtx3090", "rtx3090", "rtx3090")
    first, second, third = cluster.devices
    profile = Profile(
        unit_timings=(
            _timing("rtx3090", "u0", 1, 0.010),
            _timing("rtx3090#GPU-b", "u0", 1, 0.020),
            _timing(f"rtx3090@{second.name}", "u0", 1, 0.030),
            _timing(f"rtx3090@{second.node}", "u0", 1, 0.040),
        )
    )
    source = MeasuredSource(profile, COSTS, "float32")
    assert _times(source, first, 0, 1)[0] == 0.040  # kind@node beats kind
    assert _times(source, second, 0, 1)[0] == 0.030  # kind@device beats kind@node
    assert _times(source, third, 0, 1)[0] == 0.040
    bound = MeasuredSource(
        replace(profile, unit_timings=profile.unit_timings[:3]),
        COSTS,
        "float32",
        device_uuids={first.name: "GPU-b"},
    )
    assert _times(bound, first, 0, 1)[0] == 0.020  # kind#uuid of that card beats kind
    assert _times(bound, third, 0, 1)[0] == 0.010  # kind


def test_per_node_profiles_give_each_node_its_own_times_and_name_the_unprofiled():
    cluster = cpu_cluster(1, num_nodes=3)  # nodes n0, n1, n2 with one cpu each
    profile = Profile(
        unit_timings=(
            _timing("cpu@n0", "u0", 1, 0.001),
            _timing("cpu@n1", "u0", 1, 0.002),
            _timing("cpu@n1", "u0", 2, 0.003),
        )
    )
    source = MeasuredSource(profile, COSTS, "float32")
    n0, n1, n2 = cluster.devices
    assert _times(source, n0, 0, 1) == (0.001, 0.002)
    assert _times(source, n1, 0, 1) == (0.002, 0.004)
    assert _times(source, n1, 0, 2) == (0.003, 0.006)
    assert _times(source, n2, 0, 1)[0] == pytest.approx(0.0015)  # the median of the others
    (note,) = source.borrowed_notes(cluster.devices)
    assert note.startswith("n2/0 has no profile of its own (`hplan profile --node n2` on it)")
    assert "cpu@n0, cpu@n1" in note
    check_profile_targets(profile, cluster, "prof/")  # every node is in the cluster


def test_a_profile_of_a_node_the_cluster_lacks_is_refused_naming_it():
    profile = Profile(unit_timings=(_timing("cpu@n7", "u0", 1, 0.001),))
    with pytest.raises(ConfigError) as info:
        check_profile_targets(profile, cpu_cluster(1, num_nodes=2), "prof/")
    message = str(info.value)
    assert message.startswith("profile prof/ measures cpu@n7, but '<test cluster>' has no node")
    assert "(its nodes: n0, n1)" in message and "--node" in message and "\n" not in message


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
        profile_paths=(tmp_path / "empty.json",),
    )
    notes = plan_training(request).plan.report.notes
    assert any("no measurement for rtx3060, rtx3090, rtx4090" in n for n in notes), notes
