"""``hplan solve --bandwidth``: measured links override the cluster file's, and
``hplan bandwidth --write-scripts``: the per-node measuring scripts, run under torchrun."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hplan.planner.api import SolveRequest, plan_training
from hplan.planner.cli.main import main
from hplan.planner.emit.bandwidth_scripts import render_bandwidth_scripts, write_bandwidth_scripts
from hplan.planner.hardware.measured_links import apply_measured_links
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.link_matrix import (
    AlphaBetaFit,
    BandwidthFile,
    PairLink,
    RankName,
    size_samples,
)
from hplan.runtime.contract.plan import Plan
from tests.fixtures.clusters import cluster_from_dict

ROOT = Path(__file__).resolve().parents[2]
GPT = ROOT / "examples" / "gpt" / "model.py"
BIN_DIR = Path(sys.executable).parent
TORCHRUN_TIMEOUT_S = 120.0

TWO_4090_NODES = """\
name: pair
nodes:
  - name: a
    host: 10.0.0.1
    devices: [{type: rtx4090}]
  - name: b
    host: 10.0.0.2
    devices: [{type: rtx4090}]
links:
  inter_node: {bandwidth_gbit_per_s: 100}
"""


def _pair(src: int, dst: int, bandwidth_bytes_per_s: float, latency_s: float) -> PairLink:
    sizes = (size_samples(4096, [1e-3]), size_samples(1 << 20, [2e-3]))
    fit = AlphaBetaFit(
        latency_s=latency_s, bandwidth_bytes_per_s=bandwidth_bytes_per_s, r_squared=1.0
    )
    return PairLink(src_rank=src, dst_rank=dst, fit=fit, sizes=sizes, ack_round_trip_s=1e-4)


def _measured(devices: list[str | None], pairs: list[PairLink]) -> BandwidthFile:
    """A hand-written link matrix whose rank r is ``devices[r]``."""
    ranks = tuple(
        RankName(
            rank=r,
            host=f"host-{r}",
            local_rank=int(d.split("/")[1]) if d else 0,
            node=d.split("/")[0] if d else None,
            device=d,
        )
        for r, d in enumerate(devices)
    )
    return BandwidthFile(
        backend="nccl",
        world_size=len(ranks),
        repeats=1,
        warmup=0,
        ranks=ranks,
        pairs=tuple(pairs),
    )


def _three_devices():
    return cluster_from_dict(
        {
            "name": "three",
            "nodes": [
                {"name": "a", "host": "10.0.0.1", "devices": [{"type": "rtx3090", "count": 2}]},
                {"name": "b", "host": "10.0.0.2", "devices": [{"type": "rtx3090"}]},
            ],
            "links": {"inter_node": {"bandwidth_gbit_per_s": 10, "latency_us": 50}},
        },
        source="three.yaml",
    )


# ----------------------------------------------------------------------------- merging
def test_a_measured_pair_takes_its_slower_direction_and_other_pairs_keep_the_file_links():
    cluster = _three_devices()
    measured = _measured(["a/0", "b/0"], [_pair(0, 1, 50e6, 1e-3), _pair(1, 0, 20e6, 2e-3)])
    result = apply_measured_links(cluster, measured, source="bw.json")
    link = result.cluster.link("b/0", "a/0")
    assert (link.bandwidth_bytes_per_s, link.latency_s) == (20e6, 2e-3)
    untouched = result.cluster.link("a/1", "b/0")
    assert untouched == cluster.link("a/1", "b/0")
    assert untouched.bandwidth_bytes_per_s == pytest.approx(1.25e9)
    assert result.num_pairs == 1
    assert result.note.startswith("links: 1 of 3 device pairs measured (bw.json")
    assert result.note.endswith("the rest from three.yaml")


def test_a_file_naming_devices_the_cluster_lacks_is_a_one_line_error_naming_them():
    measured = _measured(["a/0", "c/0", "c/1"], [_pair(0, 1, 1e9, 1e-5)])
    with pytest.raises(ConfigError) as info:
        apply_measured_links(_three_devices(), measured, source="bw.json")
    message = str(info.value)
    assert "\n" not in message
    assert "'c/0', 'c/1'" in message and "three.yaml" in message and "HPLAN_NODE" in message


def test_a_file_of_unnamed_ranks_says_how_to_measure_with_names():
    measured = _measured([None, None], [_pair(0, 1, 1e9, 1e-5)])
    with pytest.raises(ConfigError, match="ranks 0, 1 carry no device name"):
        apply_measured_links(_three_devices(), measured, source="bw.json")


def test_solve_with_a_measured_slow_link_keeps_the_model_off_it(tmp_path, capsys):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(TWO_4090_NODES, encoding="utf-8")
    # The file says 100 Gbit/s; the measurement says 200 kB/s (slower direction).
    measured = _measured(["a/0", "b/0"], [_pair(0, 1, 1e6, 1e-3), _pair(1, 0, 2e5, 2e-3)])
    bw = tmp_path / "bw.json"
    bw.write_text(measured.to_json(), encoding="utf-8")
    # -b 128: with a small batch the tiny model is too quick on one card for a second to pay.
    request = SolveRequest(model_path=GPT, cluster_path=cluster, global_batch_size=128)
    unmeasured = plan_training(request).plan
    assert {r.device for r in unmeasured.ranks} == {"a/0", "b/0"}
    argv = ["solve", str(GPT), "-c", str(cluster), "-o", str(tmp_path / "out"),
            "-b", "128", "--bandwidth", str(bw)]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0, capsys.readouterr().err
    plan = Plan.load(tmp_path / "out" / "plan.json")
    assert plan.link("a/0", "b/0").bandwidth_bytes_per_s == 2e5
    assert plan.world_size == 1
    assert any(n.startswith("links: 1 of 1 device pair measured") for n in plan.report.notes)


def test_solve_with_a_bandwidth_file_of_another_cluster_exits_2_in_one_line(tmp_path, capsys):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(TWO_4090_NODES, encoding="utf-8")
    bw = tmp_path / "bw.json"
    bw.write_text(_measured(["x/0", "y/0"], [_pair(0, 1, 1e9, 1e-5)]).to_json(), encoding="utf-8")
    with pytest.raises(SystemExit) as exit_info:
        main(["solve", str(GPT), "-c", str(cluster), "-o", str(tmp_path), "--bandwidth", str(bw)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2
    assert len(err) == 1 and "'x/0', 'y/0'" in err[0]


def test_too_many_local_ranks_are_refused_at_once(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bandwidth", "--local", "99"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2
    assert len(err) == 1 and "--local 99: at most 32 ranks" in err[0]


@pytest.mark.parametrize("where", ["folder", "under-a-file"])
def test_an_output_path_that_cannot_be_written_is_refused_before_measuring(
    tmp_path, capsys, monkeypatch, where
):
    import hplan.runtime.bandwidth.local as local

    monkeypatch.setattr(local, "measure_local", lambda *a, **k: pytest.fail("measured"))
    (tmp_path / "afile").write_text("x")
    out = tmp_path if where == "folder" else tmp_path / "afile" / "bw.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["bandwidth", "--local", "2", "-o", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1
    assert ("is a directory" if where == "folder" else "is a file") in err[0]


# ----------------------------------------------------------------------------- scripts
def test_scripts_name_each_node_and_disable_p2p_only_on_geforce_nodes():
    cluster = cluster_from_dict(
        {
            "nodes": [
                {"name": "gamer", "host": "10.0.0.1", "devices": [{"type": "rtx4090", "count": 2}]},
                {"name": "dc", "host": "10.0.0.2", "devices": [{"type": "a100-80gb"}]},
            ],
            "links": {"inter_node": {"bandwidth_gbit_per_s": 10}},
        }
    )
    scripts = render_bandwidth_scripts(cluster, master_port=29400)
    assert sorted(scripts) == ["bandwidth-dc.sh", "bandwidth-gamer.sh"]
    gamer, dc = scripts["bandwidth-gamer.sh"], scripts["bandwidth-dc.sh"]
    assert "export HPLAN_NODE=gamer\n" in gamer and "export HPLAN_NODE=dc\n" in dc
    assert "--nproc-per-node 2 " in gamer and "--node-rank 0 " in gamer
    assert "--nproc-per-node 1 " in dc and "--node-rank 1 " in dc
    assert "--master-addr 10.0.0.1 " in dc and "--backend nccl " in dc
    assert "NCCL_P2P_DISABLE" in gamer and "NCCL_P2P_DISABLE" not in dc
    bash = shutil.which("bash")
    if bash is not None:
        for text in scripts.values():
            subprocess.run([bash, "-n"], input=text, text=True, check=True)


def test_scripts_refuse_a_cluster_that_mixes_cpu_and_gpu_devices():
    cluster = cluster_from_dict(
        {
            "nodes": [
                {"name": "g", "host": "10.0.0.1", "devices": [{"type": "rtx4090"}]},
                {"name": "c", "host": "10.0.0.2", "devices": [{"type": "cpu"}]},
            ],
            "links": {"inter_node": {"bandwidth_gbit_per_s": 10}},
        }
    )
    with pytest.raises(ConfigError, match="mixes cpu and GPU"):
        render_bandwidth_scripts(cluster, master_port=29400)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
@pytest.mark.skipif(
    not (BIN_DIR / "torchrun").exists() or shutil.which("bash") is None,
    reason="needs bash and torchrun next to this Python",
)
def test_the_written_scripts_measure_every_device_pair_under_torchrun(tmp_path):
    cluster = cluster_from_dict(
        {
            "name": "two-cpu-nodes",
            "nodes": [
                {"name": "left", "host": "127.0.0.1", "devices": [{"type": "cpu"}]},
                {"name": "right", "host": "127.0.0.1", "devices": [{"type": "cpu", "count": 2}]},
            ],
            "links": {"inter_node": {"bandwidth_gbit_per_s": 10}},
        }
    )
    scripts = write_bandwidth_scripts(cluster, tmp_path / "bw", master_port=_free_port())
    env = {**os.environ, "PATH": f"{BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.update(OMP_NUM_THREADS="1")
    for name in ("HPLAN_NODE", "LOCAL_RANK", "RANK", "WORLD_SIZE"):
        env.pop(name, None)
    sweep = ["--min-size-bytes", "4096", "--max-size-bytes", "65536", "--repeats", "2"]
    procs = [
        subprocess.Popen(
            ["bash", str(script), *sweep],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for script in scripts
    ]
    deadline_s = time.monotonic() + TORCHRUN_TIMEOUT_S
    try:
        outputs = [p.communicate(timeout=max(1.0, deadline_s - time.monotonic()))[0] for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    assert [p.returncode for p in procs] == [0, 0], b"\n".join(outputs).decode()
    result = BandwidthFile.load(tmp_path / "bw" / "bandwidth.json")
    assert [r.device for r in result.ranks] == ["left/0", "right/0", "right/1"]
    assert len(result.pairs) == 6
    assert [(a.node, a.ranks) for a in result.all_reduce] == [("right", (1, 2))]
    assert apply_measured_links(cluster, result, source="bw.json").num_pairs == 3


def test_a_measured_node_all_reduce_bounds_every_ring_on_that_node(tmp_path):
    # gloo among processes sharing cores measured milliseconds per all-reduce where a
    # point-to-point message took tens of microseconds: the plan, the cost model and the
    # rehearsal's emulation all charge a ring on the node no less than the measurement.
    from dataclasses import replace

    from hplan.planner.cost.evaluate import slowest_link
    from hplan.planner.hardware.measured_links import node_collectives
    from hplan.runtime.contract.link_matrix import NodeAllReduce
    from hplan.runtime.contract.link_model import group_ring_time_s

    ring = NodeAllReduce(
        node="box",
        ranks=(0, 1, 2),
        fit=AlphaBetaFit(latency_s=4e-3, bandwidth_bytes_per_s=1e9, r_squared=0.99),
        bus_bandwidth_bytes_per_s=0.75e9,
        sizes=(size_samples(4096, [4e-3]), size_samples(1 << 20, [5e-3])),
    )
    rings = node_collectives([ring, replace(ring, node="elsewhere")], {"box"})
    assert set(rings) == {"box"}
    assert rings["box"].latency_per_step_s == pytest.approx(4e-3 / 4)  # 2 (K - 1) steps
    assert rings["box"].bus_bandwidth_bytes_per_s == 0.75e9
    assert node_collectives([replace(ring, ranks=(0,))], {"box"}) == {}

    cluster = tmp_path / "three.yaml"
    cluster.write_text(
        "name: three\nnodes:\n  - name: box\n    host: 127.0.0.1\n    devices:\n"
        "      - type: cpu\n        count: 3\n"
    )
    pairs = [_pair(a, b, 2e9, 5e-5) for a in range(3) for b in range(3) if a != b]
    measured = replace(_measured(["box/0", "box/1", "box/2"], pairs), all_reduce=(ring,))
    (tmp_path / "bw.json").write_text(measured.to_json(), encoding="utf-8")
    request = SolveRequest(
        model_path=GPT, cluster_path=cluster, global_batch_size=24,
        bandwidth_path=tmp_path / "bw.json",
    )  # fmt: skip
    outcome = plan_training(request)
    plan = Plan.from_json(outcome.plan.to_json())  # the measurement survives the plan file
    assert plan.cluster.nodes[0].collective == rings["box"]
    assert any("all-reduce measured on box (1 ms per ring step" in n for n in plan.report.notes)
    groups = plan.report.grad_sync
    assert groups
    for group in groups:
        devices = [plan.ranks[r].device for r in group.ranks]
        bandwidth, latency = plan.ring_channel(devices)
        assert (bandwidth, latency) == (0.75e9, 1e-3)  # the measurement, not the 2 GB/s links
        problem_devices = tuple(outcome.problem.device_names.index(d) for d in devices)
        assert slowest_link(outcome.problem, problem_devices) == (bandwidth, latency)
        steps = 2 * (len(devices) - 1)
        assert group_ring_time_s(plan, group.ranks, group.num_bytes) >= steps * 1e-3


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"node": "ghost"}, "all-reduce on node(s) 'ghost', which cluster"),
        ({"ranks": [0, 7]}, "names rank 7, which `ranks` does not list"),
        ({"fit": {"latency_s": -1e-3}}, "has latency -0.001; it must be a finite number >= 0"),
        ({"fit": {"bandwidth_bytes_per_s": 0.0}}, "has bandwidth 0.0; it must be a finite"),
        ({"bus_bandwidth_bytes_per_s": -5.0}, "has bus bandwidth -5.0"),
    ],
)
def test_a_bad_measured_all_reduce_is_a_one_line_error_not_an_internal_one(tmp_path, edit, message):
    import json

    ring = {
        "node": "a",
        "ranks": [0, 1],
        "fit": {"latency_s": 1e-3, "bandwidth_bytes_per_s": 1e9, "r_squared": 1.0},
        "bus_bandwidth_bytes_per_s": 1e9,
        "sizes": [],
    }
    for key, value in edit.items():
        ring[key] = {**ring[key], **value} if isinstance(value, dict) else value
    data = json.loads(_measured(["a/0", "a/1"], [_pair(0, 1, 1e9, 1e-5)]).to_json())
    data["all_reduce"] = [ring]
    path = tmp_path / "bw.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        apply_measured_links(_three_devices(), BandwidthFile.load(path), source=str(path))
    assert "\n" not in str(info.value)
