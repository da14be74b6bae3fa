"""The CPUs this process may use: its affinity mask capped by its cgroup's CPU quota; and
the host memory available to it (:func:`available_memory_bytes`).

torch starts as many intra-op threads as the CPUs it sees, not as many as the process may
use, and threads beyond a CPU quota slow training down. The runtime gives each rank
``usable CPUs // ranks on its node`` threads (``executor/machine.py``); ``hplan profile``
times a CPU with the same number, so that profiles measure what the ranks will run. Needs
no torch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_MAX_ANCESTORS = 32


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


def quota_binds(quota_cores: float | None, num_threads: int) -> bool:
    """Whether a CPU quota of ``quota_cores`` limits ``num_threads`` busy threads: then a
    block's sustained time is its CPU time over the quota, whatever its wall time showed
    (``planner/profiling/windows.sustained``, ``StepMetrics.sustained_s``)."""
    return quota_cores is not None and 0 < quota_cores < num_threads


def usable_cpus(root: Path = Path("/")) -> UsableCpus:
    """This process's usable CPUs: its affinity mask, capped by its cgroup's CPU quota
    rounded up.

    The quota is the smallest of the process's own group (``/proc/self/cgroup``) and its
    parents (v1: ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, v2: ``cpu.max``), found under
    the cgroup mount of ``/proc/self/mountinfo``. Inside ``ip netns exec`` ``/sys`` is
    remounted without the cgroup mounts, so the mount is looked up in the mount table of the
    nearest ancestor process that has one, through its ``/proc/<pid>/root``. Missing or
    unreadable files mean no quota.

    Args:
        root: where ``/proc`` lives (tests give a fake tree).
    """
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


MEMINFO = Path("/proc/meminfo")


def available_memory_bytes(meminfo: Path = MEMINFO) -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; None where it cannot be read (not
    Linux)."""
    try:
        fields = dict(
            line.split(":", 1) for line in meminfo.read_text(encoding="ascii").splitlines()
        )
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
