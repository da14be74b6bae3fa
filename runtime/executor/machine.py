"""What this machine gives a rank: its usable CPUs (hence its torch threads) and the network
interface its process group talks over.

**Threads.** torch starts as many intra-op threads as the CPUs it sees, not as many as the
process may use: in a container or a Slurm job with a CPU quota of 0.45 cores it ran 2
threads and trained at 0.35-0.44x the speed it had with one. :func:`set_rank_threads` gives
each rank ``max(1, usable CPUs // ranks on this node)`` threads, unless the user set
``OMP_NUM_THREADS``. The usable CPUs (:func:`usable_cpus`) are the CPUs of the process's
affinity mask, capped by its cgroup's CPU quota rounded up (v1: ``cpu.cfs_quota_us`` /
``cpu.cfs_period_us``, v2: ``cpu.max``; the smallest quota of the group and its parents).
The group is the process's own, from ``/proc/self/cgroup``, found under the cgroup mount of
``/proc/self/mountinfo``; inside ``ip netns exec`` ``/sys`` is remounted without the cgroup
mounts, so the mount is looked up in the mount table of the nearest ancestor process that
has one, through its ``/proc/<pid>/root``. Missing or unreadable files mean no quota.

torchrun sets ``OMP_NUM_THREADS=1`` itself when it starts more than one process per node
(``torch/distributed/run.py``), so a rank cannot tell that value from the user's. The
launch scripts export ``OMP_NUM_THREADS=1`` and ``HPLAN_AUTO_THREADS=1`` when the user set
no ``OMP_NUM_THREADS`` (which also silences torchrun's banner); a rank then treats the value
as unset.

**Interfaces.** gloo and NCCL pick the address of the machine's hostname by default, which
is a loopback address on many Linux installs and inside network namespaces: the peers are
told to connect to 127.0.0.1 and fail. :func:`bind_interface` sets ``GLOO_SOCKET_IFNAME``
or ``NCCL_SOCKET_IFNAME`` (the run's backend's), unless the user set it, to the node's
interface in the plan (cluster.yaml ``interface``) or else to the interface that holds the
node's address.
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
import struct
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import torch

from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.plan import NodeSpec, Plan

AUTO_THREADS_ENV = "HPLAN_AUTO_THREADS"
"""Set to ``1`` by the launch scripts when they, not the user, set ``OMP_NUM_THREADS``."""
OMP_THREADS_ENV = "OMP_NUM_THREADS"
_MAX_ANCESTORS = 32


# --------------------------------------------------------------------------- CPUs
@dataclass(frozen=True, slots=True)
class UsableCpus:
    """The CPUs this process may use."""

    affinity: int
    """CPUs in its affinity mask (``os.sched_getaffinity``)."""
    quota_cores: float | None = None
    """Its cgroup CPU quota in cores (quota / period); None: no quota, or none readable."""
    quota_file: str | None = None
    """The file the quota came from."""

    @property
    def cores(self) -> int:
        """``min(affinity, ceil(quota))``, at least 1."""
        if self.quota_cores is None:
            return max(1, self.affinity)
        return max(1, min(self.affinity, math.ceil(self.quota_cores)))

    def describe(self) -> str:
        """``4 usable CPUs (affinity 16, cgroup quota 3.5 cores)``."""
        quota = "" if self.quota_cores is None else f", cgroup quota {self.quota_cores:g} cores"
        return f"{self.cores} usable CPUs (affinity {self.affinity}{quota})"


def usable_cpus(root: Path = Path("/")) -> UsableCpus:
    """This process's usable CPUs (module docstring); ``root`` is where ``/proc`` lives
    (tests give a fake tree)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        affinity = os.cpu_count() or 1
    quota = cgroup_cpu_quota(root)
    if quota is None:
        return UsableCpus(affinity)
    return UsableCpus(affinity, quota[0], quota[1])


def cgroup_cpu_quota(root: Path = Path("/")) -> tuple[float, str] | None:
    """(quota in cores, the file it came from) of this process's cgroup, or None."""
    groups = _read(root / "proc/self/cgroup")
    if groups is None:
        return None
    for pid, fs_root in _mount_tables(root):
        mounts = _read(root / "proc" / pid / "mountinfo")
        if mounts is None:
            continue
        seen = False
        for directory, mount_point, version in _cpu_groups(groups, mounts):
            base = fs_root / mount_point.lstrip("/")
            if not _is_dir(base):
                continue
            seen = True
            found = _smallest_quota(base, directory, version)
            if found is not None:
                return found
        if seen:  # the first mount table that shows the hierarchy decides
            return None
    return None


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # another mount namespace's root without the rights to it
        return False


def _mount_tables(root: Path) -> Iterator[tuple[str, Path]]:
    """(pid, the root its mount table's paths are under): this process, then its
    ancestors (their files seen through ``/proc/<pid>/root``)."""
    yield "self", root
    pid = _parent_pid(root, "self")
    for _ in range(_MAX_ANCESTORS):
        if pid is None or pid < 1:
            return
        yield str(pid), root / "proc" / str(pid) / "root"
        pid = None if pid == 1 else _parent_pid(root, str(pid))


def _parent_pid(root: Path, pid: str) -> int | None:
    stat = _read(root / "proc" / pid / "stat")
    if stat is None or ")" not in stat:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


def _cpu_groups(groups: str, mounts: str) -> Iterator[tuple[str, str, int]]:
    """(the process's group path, the mount point that holds it, cgroup version) for the
    cpu controller: v1's ``cpu`` hierarchy first, then the v2 unified one."""
    paths = {}
    for line in groups.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "cpu" in parts[1].split(","):
            paths[1] = parts[2]
        elif parts[0] == "0" and parts[1] == "":
            paths[2] = parts[2]
    for version, mount_root, mount_point in _cgroup_mounts(mounts):
        path = paths.get(version)
        if path is None:
            continue
        relative = path[len(mount_root) :] if path.startswith(mount_root) else path
        yield relative.strip("/"), mount_point, version


def _cgroup_mounts(mounts: str) -> list[tuple[int, str, str]]:
    """(version, root of the mount in its hierarchy, mount point) of the cpu cgroup mounts
    in a ``mountinfo`` text, v1 before v2."""
    found = []
    for line in mounts.splitlines():
        fields = line.split()
        if "-" not in fields or len(fields) < 5:
            continue
        after = fields[fields.index("-") + 1 :]
        if len(after) < 3:
            continue
        fs_type, options = after[0], after[2].split(",")
        if fs_type == "cgroup" and "cpu" in options:
            found.append((1, _unescape(fields[3]), _unescape(fields[4])))
        elif fs_type == "cgroup2":
            found.append((2, _unescape(fields[3]), _unescape(fields[4])))
    return sorted(found)


def _unescape(field: str) -> str:
    """mountinfo's octal escapes (``\\040`` is a space)."""
    return field.encode().decode("unicode_escape") if "\\" in field else field


def _smallest_quota(base: Path, directory: str, version: int) -> tuple[float, str] | None:
    """The smallest quota of the group ``directory`` (relative to the mount ``base``) and
    of its parents, up to the mount."""
    parts = [p for p in directory.split("/") if p]
    best: tuple[float, str] | None = None
    for depth in range(len(parts), -1, -1):
        group = base.joinpath(*parts[:depth])
        quota = _quota_v1(group) if version == 1 else _quota_v2(group)
        if quota is not None and (best is None or quota[0] < best[0]):
            best = quota
    return best


def _quota_v1(group: Path) -> tuple[float, str] | None:
    quota, period = _read(group / "cpu.cfs_quota_us"), _read(group / "cpu.cfs_period_us")
    if quota is None or period is None:
        return None
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:
        return None
    if quota_us <= 0 or period_us <= 0:  # -1: no quota
        return None
    return quota_us / period_us, str(group / "cpu.cfs_quota_us")


def _quota_v2(group: Path) -> tuple[float, str] | None:
    text = _read(group / "cpu.max")
    fields = text.split() if text is not None else []
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota_us, period_us = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    if quota_us <= 0 or period_us <= 0:
        return None
    return quota_us / period_us, str(group / "cpu.max")


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:  # missing, not readable (another mount namespace, no rights), a directory
        return None


# --------------------------------------------------------------------------- threads
@dataclass(frozen=True, slots=True)
class ThreadChoice:
    """How many intra-op threads a rank runs, and why."""

    num_threads: int
    reason: str
    """Why, in a phrase (``4 usable CPUs (...) / 2 ranks on node box-a``)."""

    def describe(self) -> str:
        """``2 torch threads per rank (4 usable CPUs (affinity 4) / 2 ranks on node a)``."""
        threads = "thread" if self.num_threads == 1 else "threads"
        return f"{self.num_threads} torch {threads} per rank ({self.reason})"


def choose_threads(env: Mapping[str, str], cpus: UsableCpus, ranks_on_node: int) -> int | None:
    """``max(1, cpus.cores // ranks_on_node)``; None when the user set ``OMP_NUM_THREADS``
    (the launch scripts' own value, marked by ``HPLAN_AUTO_THREADS=1``, does not count)."""
    if env.get(OMP_THREADS_ENV, "").strip() and env.get(AUTO_THREADS_ENV) != "1":
        return None
    return max(1, cpus.cores // max(1, ranks_on_node))


def set_rank_threads(
    plan: Plan, rank: int, env: MutableMapping[str, str] | None = None, root: Path = Path("/")
) -> ThreadChoice:
    """Set this rank's torch threads (:func:`choose_threads`) and export the number as
    ``OMP_NUM_THREADS`` for the processes it starts; what was chosen and why."""
    env = os.environ if env is None else env
    node = plan.ranks[rank].node
    on_node = sum(1 for r in plan.ranks if r.node == node)
    cpus = usable_cpus(root)
    threads = choose_threads(env, cpus, on_node)
    if threads is None:
        return ThreadChoice(torch.get_num_threads(), f"{OMP_THREADS_ENV}={env[OMP_THREADS_ENV]}")
    torch.set_num_threads(threads)
    env[OMP_THREADS_ENV] = str(threads)
    env.pop(AUTO_THREADS_ENV, None)
    ranks = "rank" if on_node == 1 else "ranks"
    return ThreadChoice(threads, f"{cpus.describe()} / {on_node} {ranks} on node {node}")


# --------------------------------------------------------------------------- interfaces
INTERFACE_ENV = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}
"""The variable that names the network interface of each backend."""


@dataclass(frozen=True, slots=True)
class Binding:
    """The interface a rank's backend talks over, as far as hplan knows it."""

    variable: str
    """``GLOO_SOCKET_IFNAME`` or ``NCCL_SOCKET_IFNAME``."""
    interface: str | None
    """The interface; None: none chosen (the backend takes the hostname's address)."""
    source: str
    """Where it came from: ``yours``, ``cluster.yaml``, ``holds 10.0.0.2``, or why none."""
    address: str | None = None
    """The interface's IPv4 address, when it has one."""

    def describe(self) -> str:
        """``interface eth1 (10.0.0.2; GLOO_SOCKET_IFNAME from cluster.yaml)``."""
        if self.interface is None:
            return f"no interface chosen ({self.source}; the backend takes the hostname's)"
        address = f"{self.address}; " if self.address else ""
        return f"interface {self.interface} ({address}{self.variable} {self.source})"

    @property
    def loopback(self) -> bool:
        """Whether it talks over a loopback address."""
        return self.address is not None and is_loopback(self.address)


def bind_interface(
    node: NodeSpec, backend: str, env: MutableMapping[str, str] | None = None
) -> Binding:
    """Point ``backend`` at this node's interface (module docstring); what it binds.

    Raises:
        ConfigError: the plan names an interface this machine does not have.
    """
    env = os.environ if env is None else env
    variable = INTERFACE_ENV.get(backend, INTERFACE_ENV["gloo"])
    given = env.get(variable, "").strip()
    if given:
        return Binding(variable, given, "yours", _ipv4_address(given.split(",")[0]))
    if node.interface is not None:
        names = [name for _, name in _interfaces()]
        if names and node.interface not in names:
            raise ConfigError(
                f"cluster.yaml names interface {node.interface!r} for node {node.name!r}, but "
                f"this machine has {', '.join(names)}; fix `interface:` and re-run `hplan "
                f"solve`, or set {variable}"
            )
        env[variable] = node.interface
        return Binding(variable, node.interface, "from cluster.yaml", _ipv4_address(node.interface))
    address = resolve(node.host)
    if address is None:
        return Binding(variable, None, f"{node.host!r} does not resolve")
    for _, name in _interfaces():
        if _ipv4_address(name) == address:
            env[variable] = name
            return Binding(variable, name, f"holds {node.host}", address)
    return Binding(variable, None, f"no interface here holds {address}")


def resolve(host: str) -> str | None:
    """``host``'s IPv4 address (None when it does not resolve)."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def is_loopback(address: str) -> bool:
    """Whether ``address`` is a loopback address (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _interfaces() -> list[tuple[int, str]]:
    try:
        return socket.if_nameindex()
    except OSError:
        return []


_SIOCGIFADDR = 0x8915
"""Linux ioctl: the IPv4 address of an interface (``netdevice(7)``)."""


def _ipv4_address(interface: str) -> str | None:
    try:
        import fcntl
    except ImportError:  # not a Unix
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            request = struct.pack("256s", interface.encode()[:15])
            answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
        except OSError:  # no IPv4 address, no such interface
            return None
    return socket.inet_ntoa(answer[20:24])
