"""What the kernel knows about a server the bench started: CPU time, memory, core placement.

Each measured server is a process tree (nginx: master + worker; opgate: one Python process;
kubectl proxy: one Go process with many threads), so CPU time and RSS are summed over the
process and its descendants. CPU comes from ``/proc/PID/stat`` (utime + stime, in clock ticks),
current and peak RSS from ``/proc/PID/status`` (``VmRSS``, ``VmHWM``); the peak is reset by
writing ``5`` to ``/proc/PID/clear_refs`` so that a measure sees only its own high-water mark.
Pinning sets the affinity of every thread of the tree (``/proc/PID/task/*``), so it can be
changed between rounds without restarting anything; threads created later inherit it. With
pinning, how busy a core was (``/proc/stat``, :class:`CoreBusy`) tells which side of a transfer
was its bottleneck.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(children.get(current, []))
    return out


def cpu_split(pid: int) -> tuple[float, float]:
    """(utime, stime) of ``pid`` and its descendants, in seconds."""
    user = system = 0
    for p in descendants(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        user += int(fields[11])  # fields 14 and 15 of proc(5)
        system += int(fields[12])
    return user / TICK, system / TICK


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and its descendants, in seconds."""
    return sum(cpu_split(pid))


def _status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_mb(pid: int) -> float:
    """Current resident memory of the tree, MB."""
    return sum(_status_kb(p, "VmRSS") for p in descendants(pid)) / 1024


def hwm_mb(pid: int) -> float:
    """Peak resident memory (since start or the last ``reset_hwm``) of the tree, MB."""
    return sum(_status_kb(p, "VmHWM") for p in descendants(pid)) / 1024


def reset_hwm(pid: int) -> None:
    for p in descendants(pid):
        try:
            Path(f"/proc/{p}/clear_refs").write_text("5")
        except OSError:
            pass


def pin(pid: int, cpus: set[int] | None) -> None:
    """Set the affinity of every thread of the tree (``None``: every online CPU)."""
    target = cpus or set(range(os.cpu_count() or 1))
    for p in descendants(pid):
        try:
            tids = [int(t.name) for t in Path(f"/proc/{p}/task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, target)
            except OSError:
                pass


def core_ticks() -> dict[int, tuple[int, int]]:
    """Per core: (busy, all) clock ticks since boot. Busy is everything but idle and iowait;
    time stolen by the hypervisor counts as busy (the core was not there for us)."""
    out: dict[int, tuple[int, int]] = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
        out[int(name[3:])] = (sum(ticks) - ticks[3] - ticks[4], sum(ticks))
    return out


@dataclass(frozen=True, slots=True)
class CoreBusy:
    """A ``/proc/stat`` reading to compare a later one with."""

    start: dict[int, tuple[int, int]]

    @classmethod
    def begin(cls) -> CoreBusy:
        return cls(core_ticks())

    def percent(self, cores: set[int]) -> float | None:
        """How busy ``cores`` were since ``begin``, in percent of their time (``None`` when
        not a tick passed). Ticks are 1/``TICK`` s: a transfer of half a second is good to a
        few percent."""
        now = core_ticks()
        busy = total = 0
        for core in cores:
            if core in now and core in self.start:
                busy += now[core][0] - self.start[core][0]
                total += now[core][1] - self.start[core][1]
        return 100.0 * busy / total if total > 0 else None


@dataclass(frozen=True, slots=True)
class CpuUsage:
    """A CPU-time reading to subtract from a later one."""

    pid: int
    start: float
    start_user: float = 0.0

    @classmethod
    def begin(cls, pid: int) -> CpuUsage:
        user, system = cpu_split(pid)
        return cls(pid, user + system, user)

    def us_per(self, count: int) -> float:
        """CPU µs spent since ``begin`` per one of ``count`` events."""
        return (cpu_seconds(self.pid) - self.start) * 1e6 / max(1, count)

    def split_per(self, count: int) -> tuple[float, float]:
        """(user, system) CPU µs spent since ``begin`` per one of ``count`` events."""
        user, system = cpu_split(self.pid)
        n = max(1, count)
        return ((user - self.start_user) * 1e6 / n,
                (user + system - self.start - (user - self.start_user)) * 1e6 / n)


@dataclass(frozen=True, slots=True)
class Layout:
    """Which cores the load generator, the proxy under test and the upstream (+ Redis) get."""

    gen: set[int]
    proxy: set[int]
    upstream: set[int]

    @classmethod
    def for_machine(cls) -> Layout:
        """3+ cores: one each. 2 cores: the proxy gets a core of its own, the load generator
        shares the other with the upstream (both are C programs far cheaper per request)."""
        n = os.cpu_count() or 1
        if n >= 3:
            return cls({0}, {1}, set(range(2, n)))
        if n == 2:
            return cls({0}, {1}, {0})
        return cls({0}, {0}, {0})

    def describe(self) -> str:
        def fmt(s: set[int]) -> str:
            return ",".join(str(c) for c in sorted(s))
        return f"load generator cpu {fmt(self.gen)}, proxy cpu {fmt(self.proxy)}, " \
            f"upstream + redis cpu {fmt(self.upstream)}"


def machine() -> dict[str, str]:
    """nproc, CPU model, kernel and the versions the numbers depend on."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import aiohttp

    def version(cmd: list[str]) -> str:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
            return (out.stdout + out.stderr).strip().splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            return "?"

    return {
        "nproc": str(os.cpu_count()),
        "cpu": model,
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "aiohttp": aiohttp.__version__,
        "nginx": version(["nginx", "-v"]).rpartition(": ")[2],
        "wrk": "wrk " + version(["wrk", "-v"]).split()[1],
        "redis": "redis " + version(["redis-server", "--version"]).split()[2].removeprefix("v="),
    }
