"""A heterogeneous cluster on one machine: network namespaces on a bridge, each with its own
shaped link (``tc ... tbf``) and its own CPU quota (cgroup v1 ``cpu.cfs_quota_us``).

Node ``i`` of a :class:`NamespaceCluster` is the namespace ``<tag>-<i>`` at
``10.<subnet>.0.<i+1>``; its veth pair joins the bridge ``<tag>-br``; both ends of the pair
are capped at the node's rate, so the node's traffic each way is shaped. Processes started
with :meth:`NamespaceCluster.start` run inside the node's namespace and CPU group (they and
their children), in a session of their own. Leaving the ``with`` block kills the processes
it started (by process group) and removes the namespaces, the bridge and the groups.

Needs root, ``ip`` and ``tc`` (iproute2) and cgroup v1's ``cpu`` controller;
:func:`available` says whether this machine has them.
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
CFS_PERIOD_US = 100_000


@dataclass(frozen=True)
class NodeShape:
    """One node: its name, its CPU quota in cores and its link's rate in Mbit/s."""

    name: str
    cpu_cores: float
    rate_mbit_per_s: float


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
        # join the CPU group first: inside `ip netns exec` /sys is the namespace's own
        shell = f'echo $$ > {tasks} && exec ip netns exec {self.namespace(index)} "$@"'
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
            group = self._group(i)
            if group.exists():
                for pid in (group / "tasks").read_text().split():  # only ours can be there
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
                for _ in range(50):  # a killed task leaves the group once it is reaped
                    try:
                        group.rmdir()
                        break
                    except OSError:
                        time.sleep(0.1)
        subprocess.run(["ip", "link", "del", f"{self.tag}-br"], capture_output=True)
