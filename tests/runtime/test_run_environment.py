"""`hplan run` checks the machine before it waits, and waits quietly with one message; what a
rank takes from its machine (threads, network interface) and from the plan (its length)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hplan.runtime.contract.cpus import UsableCpus, cgroup_cpu_quota, usable_cpus
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.plan import NodeSpec
from hplan.runtime.executor.cli import main
from hplan.runtime.executor.machine import (
    CPU_SHARE_REFRESH_S,
    INTERFACE_ENV,
    Binding,
    CpuShareWatch,
    bind_interface,
    bind_interface_towards,
    choose_threads,
)
from hplan.runtime.executor.rendezvous import join_failure
from hplan.runtime.executor.worker import RunOptions, training_steps
from hplan.runtime.rehearsal.launcher import free_port
from hplan.runtime.rehearsal.rehearse import DEFAULT_STEPS, rehearsal_steps
from tests.fixtures.plans import (
    NUMBERED_DATASET,
    TINY_MODEL,
    ReplicaShape,
    make_plan,
    rank_command,
    write_model,
)
from tests.fixtures.sample_plans import mixed_plan

GLOO, NCCL = INTERFACE_ENV["gloo"], INTERFACE_ENV["nccl"]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


@no_cuda
def test_a_gpu_plan_on_a_machine_without_cuda_exits_4_before_joining(
    tmp_path: Path, capsys
) -> None:
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(mixed_plan().to_json())  # NCCL, master 10.0.0.1: would wait 300 s
    assert main(["run", str(plan_path), "--rank", "0"]) == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "EnvironmentProblemError" in err[0] and "NCCL" in err[0] and "rehearse" in err[0]


def test_a_rank_whose_peers_never_come_says_so_once_and_fails_in_one_line(tmp_path: Path) -> None:
    path = write_model(tmp_path, NUMBERED_DATASET)
    plan = make_plan(path, [ReplicaShape((-1,), 2, 2), ReplicaShape((-1,), 2, 2)], timeout_s=3.0)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.to_json())
    port = free_port()
    command = rank_command(plan_path, 1, "--steps", "1", "--master-port", str(port))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_CPP_LOG_LEVEL", None)
    env.pop("GLOO_SOCKET_IFNAME", None)
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1
    assert len(lines) == 2, lines  # no C++ stack traces of the connection retries
    assert lines[0].startswith("hplan: rank 1 waiting for 1 peer at 127.0.0.1:")
    assert lines[0].endswith(" via lo (timeout 3 s)")
    assert "PeerFailureError" in lines[1] and "could not join" in lines[1]
    # what it tried, what it bound, and the loopback hint
    assert (
        f"it tried 127.0.0.1:{port}, over interface lo (127.0.0.1; GLOO_SOCKET_IFNAME" in lines[1]
    )
    assert "check that every node started and that the port is reachable" in lines[1]
    assert "loopback address or interface reaches this machine only" in lines[1]


def test_usage_errors_and_a_missing_node_are_one_line_exit_2(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(mixed_plan().to_json())
    with pytest.raises(SystemExit) as info:
        main(["run", str(plan_path), "--bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unrecognized arguments: --bogus" in err[0]
    monkeypatch.delenv("HPLAN_NODE", raising=False)
    assert main(["run", str(plan_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "HPLAN_NODE" in err[0]
    monkeypatch.setenv("HPLAN_NODE", "nowhere")
    assert main(["run", str(plan_path)]) == 2
    assert "--node 'nowhere' runs no rank of this plan" in capsys.readouterr().err


def test_the_backend_talks_over_the_interface_of_the_nodes_address_or_the_plans() -> None:
    node = NodeSpec(name="a", host="127.0.0.1", devices=())
    env: dict[str, str] = {}
    assert bind_interface(replace(node, host="192.0.2.250"), "gloo", env).interface is None
    assert env == {}  # TEST-NET: on no interface here, nothing set
    binding = bind_interface(node, "gloo", env)
    assert (binding.interface, binding.address, env) == ("lo", "127.0.0.1", {GLOO: "lo"})
    assert binding.loopback
    env = {}
    assert bind_interface(node, "nccl", env).variable == NCCL and env == {NCCL: "lo"}
    env = {GLOO: "eth7"}  # the user's choice stays
    assert bind_interface(node, "gloo", env).source == "yours" and env == {GLOO: "eth7"}
    env = {}
    named = replace(node, host="192.0.2.250", interface="lo")  # cluster.yaml's wins
    assert bind_interface(named, "nccl", env).source == "from cluster.yaml"
    assert env == {NCCL: "lo"}
    with pytest.raises(ConfigError, match=r"names interface 'nosuch0' for node 'a'.*has lo"):
        bind_interface(replace(node, interface="nosuch0"), "gloo", {})


def test_a_job_without_a_node_address_talks_over_the_interface_that_reaches_the_master() -> None:
    env: dict[str, str] = {}
    binding = bind_interface_towards("127.0.0.1", "gloo", env)
    assert (binding.interface, binding.address, env) == ("lo", "127.0.0.1", {GLOO: "lo"})
    env = {GLOO: "eth7"}  # the user's choice stays
    assert bind_interface_towards("127.0.0.1", "gloo", env).source == "yours"
    assert env == {GLOO: "eth7"}
    env = {}
    assert bind_interface_towards("no-such-host.invalid", "nccl", env).interface is None
    assert env == {}


def test_a_failed_join_names_the_address_and_interface_and_says_loopback_only_then() -> None:
    remote = Binding(GLOO, "eth1", "from cluster.yaml", "10.0.0.2")
    line = join_failure(1, 4, "job", "192.0.2.7", 29500, remote, RuntimeError("refused"))
    assert "it tried 192.0.2.7:29500, over interface eth1 (10.0.0.2; GLOO_SOCKET_IFNAME " in line
    assert "loopback" not in line
    local = Binding(GLOO, "lo", "holds localhost", "127.0.0.1")
    line = join_failure(1, 4, "job", "localhost", 29500, local, RuntimeError("refused"))
    assert "tried localhost (127.0.0.1):29500" in line and "loopback" in line


# --------------------------------------------------------------------------- threads
def _fake_proc(root: Path, *, cgroup: str, mountinfo: str, pid: str = "self") -> None:
    folder = root / "proc" / pid
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cgroup").write_text(cgroup)
    (folder / "mountinfo").write_text(mountinfo)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


V1_MOUNT = "30 25 0:26 / /sys/fs/cgroup/cpu rw,relatime shared:9 - cgroup cgroup rw,cpu\n"
V1_GROUPS = "2:cpuacct:/\n1:cpu:/job/rank\n0::/\n"


def test_a_cgroup_v1_quota_caps_the_usable_cpus_its_parents_quota_too(tmp_path: Path) -> None:
    _fake_proc(tmp_path, cgroup=V1_GROUPS, mountinfo=V1_MOUNT)
    group = tmp_path / "sys/fs/cgroup/cpu/job/rank"
    _write(group / "cpu.cfs_quota_us", "-1\n")  # the rank's own group: no quota
    _write(group / "cpu.cfs_period_us", "100000\n")
    _write(group.parent / "cpu.cfs_quota_us", "45000\n")  # its parent's: 0.45 cores
    _write(group.parent / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(tmp_path) == (0.45, str(group.parent / "cpu.cfs_quota_us"))
    cpus = usable_cpus(tmp_path)
    assert cpus.quota_cores == 0.45 and cpus.cores == 1  # rounded up, at least one
    assert UsableCpus(8, 2.5).cores == 3 and UsableCpus(2, 6.0).cores == 2
    assert UsableCpus(4).describe() == "4 usable CPUs (affinity 4)"


def test_a_cgroup_v2_cpu_max_and_missing_files_read_as_no_quota(tmp_path: Path) -> None:
    _fake_proc(
        tmp_path,
        cgroup="0::/slurm/job7\n",
        mountinfo="40 1 0:30 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n",
    )
    _write(tmp_path / "sys/fs/cgroup/slurm/job7/cpu.max", "150000 100000\n")
    _write(tmp_path / "sys/fs/cgroup/slurm/cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(tmp_path) == (1.5, str(tmp_path / "sys/fs/cgroup/slurm/job7/cpu.max"))
    assert cgroup_cpu_quota(tmp_path / "nothing-here") is None
    _fake_proc(tmp_path / "no-mount", cgroup="0::/x\n", mountinfo="")
    assert cgroup_cpu_quota(tmp_path / "no-mount") is None


def test_a_quota_changed_mid_run_is_what_the_next_metrics_say(tmp_path: Path) -> None:
    # an elastic run re-plans for a node whose quota was halved: calibration reads a quota-
    # bound rank's compute as its CPU time over the quota, so a stale quota hides it
    _fake_proc(
        tmp_path,
        cgroup="0::/job\n",
        mountinfo="40 1 0:30 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n",
    )
    _write(tmp_path / "sys/fs/cgroup/job/cpu.max", "90000 100000\n")
    plan = make_plan(write_model(tmp_path, TINY_MODEL), [ReplicaShape((-1,), 4, 4)])
    watch = CpuShareWatch(plan, 0, tmp_path)
    assert watch.current().quota_cores == pytest.approx(0.9)
    _write(tmp_path / "sys/fs/cgroup/job/cpu.max", "45000 100000\n")
    started_s = time.monotonic()
    assert watch.current(started_s).quota_cores == pytest.approx(0.9)  # read a moment ago
    later = watch.current(started_s + CPU_SHARE_REFRESH_S)
    assert later.quota_cores == pytest.approx(0.45)


def test_under_ip_netns_exec_the_quota_is_read_through_an_ancestors_mounts(tmp_path: Path) -> None:
    # /sys remounted: this process's mount table has no cgroup mount; its grandparent's does
    _fake_proc(tmp_path, cgroup=V1_GROUPS, mountinfo="22 1 0:20 / /sys rw - sysfs sysfs rw\n")
    _write(tmp_path / "proc/self/stat", "900 (python) S 77 900 900 0")
    _write(tmp_path / "proc/77/stat", "77 (ip netns) S 12 77 77 0")
    _fake_proc(tmp_path, pid="12", cgroup=V1_GROUPS, mountinfo=V1_MOUNT)
    _write(tmp_path / "proc/12/stat", "12 (bash) S 1 12 12 0")
    group = tmp_path / "proc/12/root/sys/fs/cgroup/cpu/job/rank"
    _write(group / "cpu.cfs_quota_us", "45000\n")
    _write(group / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(tmp_path) == (0.45, str(group / "cpu.cfs_quota_us"))


def test_threads_are_the_usable_cpus_over_the_nodes_ranks_unless_the_user_set_them() -> None:
    cpus = UsableCpus(16, 7.5)  # 8 usable CPUs
    assert choose_threads({}, cpus, 3) == 2
    assert choose_threads({}, cpus, 9) == 1
    assert choose_threads({"OMP_NUM_THREADS": "4"}, cpus, 1) is None
    # what the launch scripts (and torchrun) set is not the user's
    assert choose_threads({"OMP_NUM_THREADS": "1", "HPLAN_AUTO_THREADS": "1"}, cpus, 1) == 8


NEEDS_NETNS = pytest.mark.skipif(
    os.geteuid() != 0
    or shutil.which("ip") is None
    or not Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").exists(),
    reason="needs root, `ip` and cgroup v1's cpu controller",
)


@NEEDS_NETNS
def test_a_rank_in_a_network_namespace_with_a_cpu_quota_runs_one_thread(tmp_path: Path) -> None:
    """The reported case: 2 threads in a 0.45-core quota. A one-rank plan runs under
    ``ip netns exec`` in a cgroup of 0.45 cores, as the launch script starts it."""
    path = write_model(tmp_path, NUMBERED_DATASET)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(make_plan(path, [ReplicaShape((-1,), 2, 2)], timeout_s=20.0).to_json())
    tag = f"hpt{os.getpid() % 100000}"
    group = Path("/sys/fs/cgroup/cpu") / tag
    subprocess.run(["ip", "netns", "add", tag], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", tag, "ip", "link", "set", "lo", "up"], check=True)
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("45000")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HPLAN_AUTO_THREADS": "1"}
        script = f'echo $$ > {group}/cgroup.procs && exec ip netns exec {tag} "$@"'
        command = ["sh", "-c", script, "sh", *rank_command(plan_path, 0, "--steps", "1")]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    finally:
        subprocess.run(["ip", "netns", "del", tag], check=False)
        if group.exists():
            group.rmdir()
    assert done.returncode == 0, done.stderr
    first = done.stderr.splitlines()[0]
    assert first.startswith("hplan: rank 0: 1 torch thread per rank (1 usable CPUs ("), first
    assert "cgroup quota 0.45 cores" in first and "/ 1 rank on node n0" in first


# --------------------------------------------------------------------------- training length
def test_a_run_without_steps_anywhere_fails_in_one_line_naming_both_ways(
    tmp_path: Path, capsys
) -> None:
    path = write_model(tmp_path, NUMBERED_DATASET)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(make_plan(path, [ReplicaShape((-1,), 2, 2)]).to_json())
    assert main(["run", str(plan_path), "--rank", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "ConfigError" in err[0] and "--steps N" in err[0] and "hplan solve" in err[0]


def test_the_plans_steps_or_epochs_set_the_length_and_run_time_steps_override() -> None:
    plan = mixed_plan()
    with_steps = replace(plan, training=replace(plan.training, epochs=None, steps=7))
    with_epochs = replace(plan, training=replace(plan.training, epochs=3))
    assert training_steps(with_steps, RunOptions(), None) == 7
    assert training_steps(with_steps, RunOptions(steps=2), None) == 2
    assert training_steps(with_epochs, RunOptions(), 25) == 75
    with pytest.raises(ConfigError, match="no dataset"):
        training_steps(with_epochs, RunOptions(), None)
    no_length = replace(plan, training=replace(plan.training, epochs=None))
    with pytest.raises(ConfigError, match="no training length"):
        training_steps(no_length, RunOptions(), 25)
    assert rehearsal_steps(with_steps, None) == 7 and rehearsal_steps(with_steps, 3) == 3
    assert rehearsal_steps(no_length, None) == DEFAULT_STEPS
