"""The link matrix: the alpha-beta fit, the file format, a local measurement, and a real
bottleneck (two network namespaces joined by a veth pair capped with ``tc ... tbf``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hplan.runtime.bandwidth.job import main as bandwidth_main
from hplan.runtime.bandwidth.local import measure_local
from hplan.runtime.bandwidth.timing import message_sizes
from hplan.runtime.contract.errors import ConfigError, RehearsalChildError
from hplan.runtime.contract.link_matrix import (
    BandwidthFile,
    FitMethod,
    PairLink,
    RankName,
    fit_alpha_beta,
    size_samples,
)

SMALL_SWEEP = ["--min-size-bytes", "4096", "--max-size-bytes", "262144", "--repeats", "2",
               "--warmup", "1", "--timeout-s", "60"]  # fmt: skip
LOCAL_TIMEOUT_S = 120.0


# ----------------------------------------------------------------------------- the fit
def _exact(latency_s: float, bandwidth_bytes_per_s: float, sizes: list[int]):
    return [size_samples(n, [latency_s + n / bandwidth_bytes_per_s]) for n in sizes]


def test_fit_recovers_latency_and_bandwidth_of_an_exact_line():
    fit = fit_alpha_beta(_exact(50e-6, 1.25e9, [4096, 65536, 1 << 20, 1 << 24]))
    assert fit.latency_s == pytest.approx(50e-6, rel=1e-6)
    assert fit.bandwidth_bytes_per_s == pytest.approx(1.25e9, rel=1e-6)
    assert fit.r_squared == pytest.approx(1.0)
    assert fit.method is FitMethod.LEAST_SQUARES


def test_fit_takes_bandwidth_from_large_and_latency_from_small_messages():
    # 3 ms of scheduling noise on the smallest message must not tilt the bandwidth, and 10%
    # noise on the largest must not swamp the 20 us latency.
    sizes = _exact(20e-6, 1e9, [4096, 16384, 1 << 24, 1 << 26])
    sizes[0] = size_samples(4096, [sizes[0].median_s + 3e-3])
    fit = fit_alpha_beta(sizes)
    assert fit.bandwidth_bytes_per_s == pytest.approx(1e9, rel=0.05)
    # ... nor the latency: 16 KiB took 36 us, so 4 KiB took no more (was 3 ms before).
    assert 20e-6 <= fit.latency_s <= 36.4e-6
    sizes = _exact(20e-6, 1e9, [4096, 16384, 65536, 1 << 26])
    sizes[-1] = size_samples(1 << 26, [sizes[-1].median_s * 1.1])
    fit = fit_alpha_beta(sizes)
    assert 15e-6 < fit.latency_s < 25e-6
    assert fit.bandwidth_bytes_per_s == pytest.approx(1e9 / 1.1, rel=0.01)


def test_fit_falls_back_to_bytes_over_time_when_time_does_not_grow_with_size():
    fit = fit_alpha_beta([size_samples(n, [1e-3]) for n in (4096, 8192, 16384)])
    assert fit.method is FitMethod.LARGEST_MESSAGE
    assert fit.bandwidth_bytes_per_s == pytest.approx(16384 / 1e-3)
    assert fit.latency_s == pytest.approx(1e-3)


def test_fit_does_not_believe_a_line_through_noise():
    # Times that jump by milliseconds of scheduling noise, unrelated to the bytes: a line
    # with a tiny positive slope would claim an absurd bandwidth.
    times = {4096: 4e-3, 16384: 1e-4, 65536: 4e-3, 262144: 4.1e-3}
    fit = fit_alpha_beta([size_samples(n, [t]) for n, t in times.items()])
    assert fit.method is FitMethod.LARGEST_MESSAGE
    assert fit.r_squared < 0.5
    assert fit.bandwidth_bytes_per_s == pytest.approx(262144 / 4.1e-3)
    assert fit.latency_s == pytest.approx(1e-4)  # the least median: 16 KiB in 0.1 ms


def test_fit_needs_two_message_sizes():
    with pytest.raises(ValueError, match="two distinct message sizes"):
        fit_alpha_beta([size_samples(4096, [1e-3, 2e-3])])


def test_message_sizes_grow_by_four_and_end_at_the_maximum():
    assert message_sizes(4096, 65536) == (4096, 16384, 65536)
    assert message_sizes(4096, 100_000) == (4096, 16384, 65536, 100_000)


# ----------------------------------------------------------------------------- the file
def _hand_written() -> BandwidthFile:
    """A two-rank file written by hand: a/0 -> b/0 at 1 GB/s, b/0 -> a/0 at 0.5 GB/s."""
    sizes = _exact(10e-6, 1e9, [4096, 1 << 20])
    ranks = (
        RankName(rank=0, host="h", local_rank=0, node="a", device="a/0"),
        RankName(rank=1, host="h", local_rank=0, node="b", device="b/0"),
    )
    pairs = tuple(
        PairLink(src_rank=s, dst_rank=d, fit=fit_alpha_beta(sizes), sizes=tuple(sizes),
                 ack_round_trip_s=20e-6)
        for s, d in ((0, 1), (1, 0))
    )  # fmt: skip
    return BandwidthFile(
        backend="gloo", world_size=2, repeats=1, warmup=0, ranks=ranks, pairs=pairs
    )


def test_bandwidth_file_rejects_another_version_and_unknown_keys():
    with pytest.raises(ConfigError, match="schema_version 2"):
        BandwidthFile.from_json('{"schema_version": 2}', source="bw.json")
    text = '{"schema_version": 1, "backend": "gloo", "world_size": 2, "repeats": 1, ' \
        '"warmup": 0, "ranks": [], "pairs": [], "colour": "red"}'  # fmt: skip
    with pytest.raises(ConfigError, match="colour"):
        BandwidthFile.from_json(text, source="bw.json")


def test_local_measurement_fits_every_ordered_pair_and_names_cluster_devices(tmp_path):
    out = tmp_path / "bw.json"
    names = [("a", 0), ("a", 1), ("b", 0)]
    result = measure_local(3, out=out, sweep_args=SMALL_SWEEP, names=names,
                           timeout_s=LOCAL_TIMEOUT_S)  # fmt: skip
    assert [r.device for r in result.ranks] == ["a/0", "a/1", "b/0"]
    assert [(p.src_rank, p.dst_rank) for p in result.pairs] == [
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 2),
        (2, 0),
        (2, 1),
    ]
    for pair in result.pairs:
        assert pair.fit.bandwidth_bytes_per_s > 0 and pair.fit.latency_s >= 0
        assert [s.num_bytes for s in pair.sizes] == [4096, 16384, 65536, 262144]
        assert all(len(s.samples_s) == 2 for s in pair.sizes)
    assert [(a.node, a.ranks) for a in result.all_reduce] == [("a", (0, 1))]
    # The file on disk is what was returned, and round-trips exactly.
    assert BandwidthFile.load(out) == result
    assert BandwidthFile.from_json(result.to_json()) == result


def test_bandwidth_file_round_trips_exactly():
    written = _hand_written()
    assert BandwidthFile.from_json(written.to_json()) == written
    assert '"bandwidth_bytes_per_s"' in written.to_json()


def test_bandwidth_file_rejects_two_ranks_on_one_device():
    result = _hand_written()
    clash = replace(result, ranks=(result.ranks[0], replace(result.ranks[1], device="a/0")))
    with pytest.raises(ConfigError, match="device 'a/0' twice"):
        BandwidthFile.from_json(clash.to_json(), source="bw.json")


def test_a_failing_rank_ends_the_local_measurement_with_its_reason(tmp_path):
    with pytest.raises(RehearsalChildError, match="both say they are device 'a/0'"):
        measure_local(2, out=tmp_path / "bw.json", sweep_args=SMALL_SWEEP,
                      names=[("a", 0), ("a", 0)], timeout_s=LOCAL_TIMEOUT_S)  # fmt: skip
    assert not (tmp_path / "bw.json").exists()


def test_outside_torchrun_without_a_rank_is_a_one_line_usage_error(monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert bandwidth_main(["--out", "unused.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run under torchrun" in err[0]


# ----------------------------------------------------------------------------- a real bottleneck
CAP_BITS_PER_S = 100e6
"""The tbf rate below: 100 Mbit/s."""
_CAP_BYTES_PER_S = CAP_BITS_PER_S / 8
_NETNS_TIMEOUT_S = 120


class _Unavailable(Exception):
    """The machine does not allow what the shaped-link test needs."""


def _ip(*args: str) -> None:
    """Run an ``ip``/``tc`` command; raise ``_Unavailable`` with its message if it fails."""
    done = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise _Unavailable(f"`{' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")


def _make_shaped_pair(tag: str) -> tuple[str, str, str, str]:
    """Namespaces ``<tag>a``/``<tag>b`` joined by veth ``<tag>va``/``<tag>vb`` (10.231.0.1/2);
    a's side sends through tbf at 100 Mbit/s, b's side is not shaped."""
    ns_a, ns_b, veth_a, veth_b = f"{tag}a", f"{tag}b", f"{tag}va", f"{tag}vb"
    _ip("ip", "netns", "add", ns_a)
    _ip("ip", "netns", "add", ns_b)
    _ip("ip", "link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
    for ns, veth, address in ((ns_a, veth_a, "10.231.0.1/24"), (ns_b, veth_b, "10.231.0.2/24")):
        _ip("ip", "link", "set", veth, "netns", ns)
        _ip("ip", "-n", ns, "addr", "add", address, "dev", veth)
        _ip("ip", "-n", ns, "link", "set", veth, "up")
        _ip("ip", "-n", ns, "link", "set", "lo", "up")
    # burst 32 kbit = 4 KB (more than one MTU, so tbf never drops a whole frame); the
    # 400 ms queue absorbs TCP's bursts, so the rate and not drops limit the throughput.
    _ip("ip", "netns", "exec", ns_a, "tc", "qdisc", "add", "dev", veth_a, "root", "tbf",
        "rate", "100mbit", "burst", "32kbit", "latency", "400ms")  # fmt: skip
    return ns_a, ns_b, veth_a, veth_b


def _remove_shaped_pair(tag: str) -> None:
    """Delete both namespaces (and with them the veth pair) and a veth left outside them."""
    commands = [["ip", "netns", "del", f"{tag}{side}"] for side in "ab"]
    commands.append(["ip", "link", "del", f"{tag}va"])
    for command in commands:
        subprocess.run(command, capture_output=True, timeout=30, check=False)


def _rank_in(ns: str, veth: str, rank: int, node: str, out: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k not in ("HPLAN_NODE", "RANK", "WORLD_SIZE")}
    env.update(GLOO_SOCKET_IFNAME=veth, OMP_NUM_THREADS="1")
    command = [
        "ip", "netns", "exec", ns, sys.executable, "-m", "hplan.runtime.bandwidth",
        "--rank", str(rank), "--world-size", "2", "--local-rank", "0", "--node", node,
        "--master-addr", "10.231.0.1", "--master-port", "29517", "--backend", "gloo",
        "--min-size-bytes", "16384", "--max-size-bytes", str(2 << 20), "--repeats", "3",
        "--warmup", "1", "--timeout-s", "60", "--out", str(out),
    ]  # fmt: skip
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_a_tbf_capped_veth_link_is_measured_within_20_percent_of_its_cap(tmp_path):
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs `ip` and `tc` (Debian package iproute2)")
    tag = f"hb{os.getpid() % 100000}"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        try:
            ns_a, ns_b, veth_a, veth_b = _make_shaped_pair(tag)
        except (_Unavailable, subprocess.TimeoutExpired) as exc:
            pytest.skip(f"network namespaces or tc tbf not allowed here: {exc}")
        out = tmp_path / "bw.json"
        procs = [_rank_in(ns_a, veth_a, 0, "a", out), _rank_in(ns_b, veth_b, 1, "b", out)]
        logs = [p.communicate(timeout=_NETNS_TIMEOUT_S)[0].decode() for p in procs]
        assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
        result = BandwidthFile.load(out)
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout=10)
        _remove_shaped_pair(tag)
    shaped = next(p for p in result.pairs if (p.src_rank, p.dst_rank) == (0, 1))
    free = next(p for p in result.pairs if (p.src_rank, p.dst_rank) == (1, 0))
    assert shaped.fit.bandwidth_bytes_per_s == pytest.approx(_CAP_BYTES_PER_S, rel=0.2)
    assert free.fit.bandwidth_bytes_per_s > 2 * _CAP_BYTES_PER_S  # only a -> b is capped
    assert [r.device for r in result.ranks] == ["a/0", "b/0"]
