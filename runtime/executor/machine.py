"""What this machine gives a rank: its usable CPUs (hence its torch threads) and the network
interface its process group talks over.

**Threads.** torch starts as many intra-op threads as the CPUs it sees, not as many as the
process may use (``contract/cpus.py``). :func:`set_rank_threads` gives each rank
``max(1, usable CPUs // ranks on this node)`` threads, unless the user set
``OMP_NUM_THREADS``. torchrun sets ``OMP_NUM_THREADS=1`` itself when it starts more than
one process per node, so the launch scripts mark their own value with
``HPLAN_AUTO_THREADS=1`` (:data:`AUTO_THREADS_ENV`).

**Interfaces.** gloo and NCCL pick the address of the machine's hostname by default, which
is a loopback address on many Linux installs and inside network namespaces, so the peers
would be told to connect to 127.0.0.1. :func:`bind_interface` sets the backend's
``GLOO_SOCKET_IFNAME`` or ``NCCL_SOCKET_IFNAME`` unless the user set it.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import torch

from hplan.runtime.contract.cpus import UsableCpus, usable_cpus
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.plan import NodeSpec, Plan

AUTO_THREADS_ENV = "HPLAN_AUTO_THREADS"
"""Set to ``1`` by the launch scripts when they, not the user, set ``OMP_NUM_THREADS``
(which also silences torchrun's banner): a rank cannot tell torchrun's own ``1`` from the
user's, so with this mark it treats the value as unset."""
OMP_THREADS_ENV = "OMP_NUM_THREADS"


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
    on_node = ranks_on_node(plan, rank)
    cpus = usable_cpus(root)
    threads = choose_threads(env, cpus, on_node)
    if threads is None:
        return ThreadChoice(torch.get_num_threads(), f"{OMP_THREADS_ENV}={env[OMP_THREADS_ENV]}")
    torch.set_num_threads(threads)
    env[OMP_THREADS_ENV] = str(threads)
    env.pop(AUTO_THREADS_ENV, None)
    ranks = "rank" if on_node == 1 else "ranks"
    return ThreadChoice(threads, f"{cpus.describe()} / {on_node} {ranks} on node {node}")


@dataclass(frozen=True, slots=True)
class CpuShare:
    """The CPU a rank may use, as its metrics record it (``StepMetrics.cpu_quota_cores``)."""

    quota_cores: float | None
    """Its share of the cgroup's CPU quota: the quota over the plan's ranks on its node
    (None: no quota)."""
    num_threads: int
    """Its torch intra-op threads."""


def ranks_on_node(plan: Plan, rank: int) -> int:
    """How many of the plan's ranks share ``rank``'s node (itself included)."""
    node = plan.ranks[rank].node
    return sum(1 for r in plan.ranks if r.node == node)


def rank_cpu_share(plan: Plan, rank: int, root: Path = Path("/")) -> CpuShare:
    """This rank's :class:`CpuShare` now."""
    quota = usable_cpus(root).quota_cores
    share = None if quota is None else quota / ranks_on_node(plan, rank)
    return CpuShare(share, torch.get_num_threads())


CPU_SHARE_REFRESH_S = 5.0
"""How often a rank reads its CPU quota again: an operator or another tenant may change it
mid-run, and the metrics must say what was in force (calibration reads a quota-bound rank's
compute as its CPU time over the quota: a stale quota would hide the slowdown)."""


class CpuShareWatch:
    """A rank's :class:`CpuShare`, read again every :data:`CPU_SHARE_REFRESH_S`."""

    def __init__(self, plan: Plan, rank: int, root: Path = Path("/")) -> None:
        self.plan, self.rank, self.root = plan, rank, root
        self._share = rank_cpu_share(plan, rank, root)
        self._read_s = time.monotonic()

    def current(self, now_s: float | None = None) -> CpuShare:
        """The share, read again when :data:`CPU_SHARE_REFRESH_S` has passed since the last."""
        now_s = time.monotonic() if now_s is None else now_s
        if now_s - self._read_s >= CPU_SHARE_REFRESH_S:
            self._share, self._read_s = rank_cpu_share(self.plan, self.rank, self.root), now_s
        return self._share


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
    """Point ``backend`` at this node's interface, unless the user named one: the plan's
    (cluster.yaml ``interface``), else the interface that holds the node's address; return
    what it binds.

    Raises:
        ConfigError: the plan names an interface this machine does not have.
    """
    env = os.environ if env is None else env
    variable = INTERFACE_ENV.get(backend, INTERFACE_ENV["gloo"])
    yours = _users_choice(variable, env)
    if yours is not None:
        return yours
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
    return _bind_holder(variable, address, f"holds {node.host}", env)


def bind_interface_towards(
    host: str, backend: str, env: MutableMapping[str, str] | None = None
) -> Binding:
    """Point ``backend`` at the interface this machine reaches ``host`` through (the master,
    for a job that knows no node address of its own, such as ``hplan bandwidth``), unless
    the user set the backend's variable; what it binds.

    The interface is the one holding the source address the kernel picks for ``host``
    (a UDP socket's ``connect`` sends nothing, it only routes).
    """
    env = os.environ if env is None else env
    variable = INTERFACE_ENV.get(backend, INTERFACE_ENV["gloo"])
    yours = _users_choice(variable, env)
    if yours is not None:
        return yours
    address = resolve(host)
    if address is None:
        return Binding(variable, None, f"{host!r} does not resolve")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            source = probe.getsockname()[0]
    except OSError:
        return Binding(variable, None, f"no route to {address}")
    return _bind_holder(variable, source, f"reaches {host}", env)


def _users_choice(variable: str, env: Mapping[str, str]) -> Binding | None:
    """The interface the user named in ``variable``, else None."""
    given = env.get(variable, "").strip()
    if not given:
        return None
    return Binding(variable, given, "yours", _ipv4_address(given.split(",")[0]))


def _bind_holder(
    variable: str, address: str, source: str, env: MutableMapping[str, str]
) -> Binding:
    """Set ``variable`` to the interface holding ``address`` (``source`` says why)."""
    for _, name in _interfaces():
        if _ipv4_address(name) == address:
            env[variable] = name
            return Binding(variable, name, source, address)
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
