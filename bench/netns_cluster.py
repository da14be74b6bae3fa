"""A heterogeneous cluster on one machine: network namespaces on a bridge, each with its own
shaped link (``tc ... tbf``) and its own CPU quota (cgroup v1 ``cpu.cfs_quota_us``), and,
where the quotas pack onto the machine's cores (:func:`pack_cores`), cores of its own
(cgroup v1 ``cpuset``).

Node ``i`` of a :class:`NamespaceCluster` is the namespace ``<tag>-<i>`` at
``10.<subnet>.0.<i+1>``; its veth pair joins the bridge ``<tag>-br``; both ends of the pair
are capped at the node's rate, so the node's traffic each way is shaped. Processes started
with :meth:`NamespaceCluster.start` run inside the node's namespace and CPU group (they and
their children), in a session of their own. Leaving the ``with`` block kills the processes
it started (by process group) and removes the namespaces, the bridge and the groups.

Why cores of its own: a quota caps a node's CPU time per period, not which of the machine's
cores it runs on or when; a node that waited for its peers has quota left and runs on any
free core, so nodes of one machine compete for its cores as machines of a cluster never do.
On the 2-core development machine (quotas 0.9 / 0.45 / 0.45, the GPT example, 51 of 96
samples on the fast node) the fast node's compute ran at 0.84-0.88 of a core (its CPU time
over its wall time, the three rounds of one run) where its quota gives 0.9; pinned as
:func:`pack_cores` packs it (alone on one core, 50 samples), at 0.95 (``bench/real_cluster.py``,
stop 31). Pinning raised DDP split's samples/s but not hplan's ratios to DDP: over three
runs each, the issue-14 targets were met as often pinned as unpinned.

Needs root, ``ip`` and ``tc`` (iproute2) and cgroup v1's ``cpu`` controller (``cpuset`` to
pin); :func:`available` says whether this machine has them.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
CGROUP_CPUSET = Path("/sys/fs/cgroup/cpuset")
CFS_PERIOD_US = 100_000


@dataclass(frozen=True)
class NodeShape:
    """One node: its name, its CPU quota in cores, its link's rate in Mbit/s and the
    machine's cores it runs on (None: any)."""

    name: str
    cpu_cores: float
    rate_mbit_per_s: float
    cores: tuple[int, ...] | None = None


def pack_cores(quotas_cores: Sequence[float], cores: Sequence[int]) -> list[tuple[int, ...] | None]:
    """Cores for nodes of ``quotas_cores`` (in cores) so that no two nodes share a core beyond
    its capacity: first fit, largest quota first, a node of quota above one core on whole
    free cores. Every node None (unpinned) when they do not all fit: 0.9 / 0.45 / 0.45 on
    two cores packs as ``(0,)``, ``(1,)``, ``(1,)``; 0.6 / 0.6 / 0.6 does not pack.
    """
    free = {core: 1.0 for core in cores}
    out: list[tuple[int, ...] | None] = [None] * len(quotas_cores)
    for index in sorted(range(len(quotas_cores)), key=lambda i: -quotas_cores[i]):
        quota = quotas_cores[index]
        if quota > 1.0:
            whole = [c for c, left in free.items() if left == 1.0][: math.ceil(quota)]
            if len(whole) < math.ceil(quota):
                return [None] * len(quotas_cores)
            for core in whole:
                free[core] = 0.0
            out[index] = tuple(whole)
            continue
        fits = [c for c, left in free.items() if left >= quota - 1e-9]
        if not fits:
            return [None] * len(quotas_cores)
        free[fits[0]] -= quota
        out[index] = (fits[0],)
    return out


TIMER_HZ = 100
"""Assumed kernel timer rate: tbf refills its bucket at most about this often."""


def burst_kbit(rate_mbit_per_s: float) -> int:
    """tbf's bucket for ``rate_mbit_per_s``: what the link sends in one timer tick (at least
    64 kbit, more than a frame). A smaller bucket caps the rate below the one asked for,
    since tokens cannot arrive faster than the timer fires (``tc-tbf(8)``: "burst ... must
    be at least rate / HZ"): with 8 KB at 10 Gbit/s, gloo's all-reduce of 2 MB took 0.3-2.7 s
    instead of milliseconds. 100 ms of queue (``latency``) stays before tbf drops."""
    return max(64, math.ceil(rate_mbit_per_s * 1000 / TIMER_HZ))


def available() -> str | None:
    """None when namespaces, tbf and cpu groups can be used here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc, cgroups)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs {tool!r} (iproute2)"
    if not (CGROUP_CPU / "cpu.cfs_quota_us").exists():
        return f"needs cgroup v1's cpu controller at {CGROUP_CPU}"
    return None


def _run(*args: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {proc.stderr.strip()}")


class NamespaceCluster:
    """See the module docstring."""

    def __init__(self, nodes: Sequence[NodeShape], *, tag: str = "hpb", subnet: int = 213):
        self.nodes = tuple(nodes)
        self.tag = tag
        self.subnet = subnet
        self._procs: list[subprocess.Popen[bytes]] = []

    def host(self, index: int) -> str:
        """The address of node ``index``."""
        return f"10.{self.subnet}.0.{index + 1}"

    def namespace(self, index: int) -> str:
        return f"{self.tag}-{index}"

    def _group(self, index: int) -> Path:
        return CGROUP_CPU / f"{self.tag}-{index}"

    def _cpuset(self, index: int) -> Path | None:
        """Node ``index``'s cpuset group; None where it runs on any core."""
        if self.nodes[index].cores is None:
            return None
        return CGROUP_CPUSET / f"{self.tag}-{index}"

    def __enter__(self) -> NamespaceCluster:
        try:
            self._create()
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._remove()

    def _create(self) -> None:
        bridge = f"{self.tag}-br"
        _run("ip", "link", "add", bridge, "type", "bridge")
        _run("ip", "link", "set", bridge, "up")
        for i, node in enumerate(self.nodes):
            ns, outside, inside = self.namespace(i), f"{self.tag}-h{i}", f"{self.tag}-n{i}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            _run("ip", "link", "set", inside, "netns", ns)
            _run("ip", "link", "set", outside, "master", bridge)
            _run("ip", "link", "set", outside, "up")
            _run(
                "ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.host(i)}/24", "dev", inside
            )
            _run("ip", "netns", "exec", ns, "ip", "link", "set", inside, "up")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            rate = f"{node.rate_mbit_per_s:g}mbit"
            burst = f"{burst_kbit(node.rate_mbit_per_s)}kbit"
            for where in (["ip", "netns", "exec", ns], []):
                dev = inside if where else outside
                _run(*where, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                     "burst", burst, "latency", "100ms")  # fmt: skip
            group = self._group(i)
            group.mkdir(exist_ok=True)
            (group / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(int(node.cpu_cores * CFS_PERIOD_US)))
            pinned = self._cpuset(i)
            if pinned is not None:
                assert node.cores is not None
                pinned.mkdir(exist_ok=True)
                mems = (CGROUP_CPUSET / "cpuset.mems").read_text().strip()
                (pinned / "cpuset.mems").write_text(mems)
                (pinned / "cpuset.cpus").write_text(",".join(map(str, node.cores)))

    def start(
        self,
        index: int,
        argv: Sequence[str],
        *,
        log: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in node ``index``'s namespace and CPU group; output to ``log``."""
        tasks = self._group(index) / "tasks"
        pinned = self._cpuset(index)
        join = f"echo $$ > {tasks}" + (f" && echo $$ > {pinned / 'tasks'}" if pinned else "")
        # join the CPU groups first: inside `ip netns exec` /sys is the namespace's own
        shell = f'{join} && exec ip netns exec {self.namespace(index)} "$@"'
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                ["sh", "-c", shell, "sh", *argv],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        self._procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL a process this cluster started, with its children (its process group)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def set_cpu_quota(self, index: int, cpu_cores: float) -> None:
        """Change node ``index``'s CPU quota to ``cpu_cores`` while its processes run (a node
        slowed by heat or another tenant); they keep it until the cluster is removed."""
        quota_us = int(cpu_cores * CFS_PERIOD_US)
        (self._group(index) / "cpu.cfs_quota_us").write_text(str(quota_us))

    def kill_node(self, index: int) -> None:
        """SIGKILL every process in node ``index``'s CPU group (the node is gone): the
        processes this cluster started there and all their descendants, whatever session
        they moved to (torchrun starts each rank in a session of its own)."""
        tasks = self._group(index) / "tasks"
        for _ in range(3):  # a process forking while it is killed leaves a child behind
            for pid in tasks.read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)

    def _remove(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                self.kill(proc)
        for i in range(len(self.nodes)):
            subprocess.run(["ip", "netns", "del", self.namespace(i)], capture_output=True)
            subprocess.run(["ip", "link", "del", f"{self.tag}-h{i}"], capture_output=True)
            for group in (self._group(i), self._cpuset(i)):
                if group is not None and group.exists():
                    _remove_group(group)
        subprocess.run(["ip", "link", "del", f"{self.tag}-br"], capture_output=True)


def _remove_group(group: Path) -> None:
    """Kill the tasks left in one of the cluster's groups (only ours can be there) and
    remove it."""
    for pid in (group / "tasks").read_text().split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    for _ in range(50):  # a killed task leaves the group once it is reaped
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)
