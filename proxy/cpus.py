"""How many CPUs this process may use: what ``--workers auto`` starts one worker per.

``os.cpu_count()`` is the node's count. In a pod it is not what the sidecar may use: a CPU
limit (``resources.limits.cpu``) is a cgroup CPU bandwidth quota, and ``taskset`` or a CPU
manager's exclusive CPUs narrow the affinity mask. A sidecar limited to 1 CPU on a 64-core
node started 64 workers (~65 MB each): OOM-killed at the chart's memory limit, or throttled.

:func:`available_cpus` is the affinity mask's size, lowered to the cgroup's quota rounded up
(``ceil(quota / period)``, at least 1), as Go's runtime sets its default ``GOMAXPROCS`` since
Go 1.25. Like Go's it reads the limit of the cgroup the process is in (cgroup v2 ``cpu.max``,
or v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), found through ``/proc/self/cgroup`` and
``/proc/self/mountinfo``; a parent's tighter limit is not looked for (container runtimes show
the container its own cgroup only). Anything it cannot read means no limit.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def available_cpus(proc: Path = Path("/proc/self"), root: Path = Path("/")) -> int:
    """The CPUs this process may run on, lowered to its cgroup's CPU quota (see the module).
    ``proc`` and ``root`` are where ``/proc/self`` and the file system are (for tests)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    limit = cgroup_cpu_limit(proc, root)
    if limit is not None:
        cpus = min(cpus, max(1, math.ceil(limit)))
    return cpus


def cgroup_cpu_limit(proc: Path = Path("/proc/self"), root: Path = Path("/")) -> float | None:
    """The CPU bandwidth limit (in CPUs) of the cgroup this process is in; None without one."""
    try:
        groups = (proc / "cgroup").read_text()
        mounts = (proc / "mountinfo").read_text()
    except OSError:
        return None
    for directory, version in _cpu_directories(groups, mounts):
        try:
            if version == 2:
                quota, period = (root / directory.lstrip("/") / "cpu.max").read_text().split()
            else:
                base = root / directory.lstrip("/")
                quota = (base / "cpu.cfs_quota_us").read_text().strip()
                period = (base / "cpu.cfs_period_us").read_text().strip()
        except (OSError, ValueError):
            continue
        if quota in ("max", "-1"):
            return None
        try:
            return int(quota) / int(period) if int(period) > 0 and int(quota) > 0 else None
        except ValueError:
            return None
    return None


def _cpu_directories(groups: str, mounts: str) -> list[tuple[str, int]]:
    """The directories that hold this process's cgroup CPU limit, with their cgroup version:
    v1's ``cpu`` controller first (when it is mounted, v2 does not hold it)."""
    v1_path = v2_path = None
    for line in groups.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2_path = path
        elif "cpu" in controllers.split(","):
            v1_path = path
    found: list[tuple[str, int]] = []
    for line in mounts.splitlines():
        fields = line.split()
        if "-" not in fields or len(fields) < 5:
            continue
        tail = fields[fields.index("-") + 1:]
        if len(tail) < 3:
            continue
        fstype, options = tail[0], tail[2].split(",")
        if fstype == "cgroup" and "cpu" in options and v1_path is not None:
            directory = _inside(fields[3], fields[4], v1_path)
            if directory is not None:
                found.insert(0, (directory, 1))
        elif fstype == "cgroup2" and v2_path is not None:
            directory = _inside(fields[3], fields[4], v2_path)
            if directory is not None:
                found.append((directory, 2))
    return found


def _inside(mount_root: str, mount_point: str, path: str) -> str | None:
    """Where the cgroup ``path`` is below a mount of its hierarchy's ``mount_root`` at
    ``mount_point`` (None when that mount does not show it: another cgroup namespace's)."""
    mount_point = _unescape(mount_point)
    if mount_root == "/":
        return mount_point.rstrip("/") + path if path != "/" else mount_point
    if path == mount_root:
        return mount_point
    if path.startswith(mount_root.rstrip("/") + "/"):
        return mount_point.rstrip("/") + path[len(mount_root.rstrip("/")):]
    return None


def _unescape(field: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes are octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field
