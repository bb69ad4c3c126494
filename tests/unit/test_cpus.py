"""``--workers auto``: one worker per CPU the process may use, not per CPU of the node."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.cpus import available_cpus, cgroup_cpu_limit

V2_MOUNTS = "41 31 0:38 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTS = ("31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755\n"
             "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
             "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")


def _proc(tmp_path: Path, groups: str, mounts: str) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(groups)
    (proc / "mountinfo").write_text(mounts)
    return proc


def _write(root: Path, path: str, text: str) -> None:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


@pytest.mark.parametrize(("cpu_max", "limit"), [
    ("150000 100000\n", 1.5), ("50000 100000\n", 0.5), ("max 100000\n", None)])
def test_cgroup_v2_cpu_max_of_the_process_cgroup(tmp_path: Path, cpu_max: str,
                                                 limit: float | None) -> None:
    proc = _proc(tmp_path, "0::/kubepods/burstable/pod1/c1\n", V2_MOUNTS)
    _write(tmp_path, "/sys/fs/cgroup/kubepods/burstable/pod1/c1/cpu.max", cpu_max)
    _write(tmp_path, "/sys/fs/cgroup/cpu.max", "max 100000\n")  # the root's: not ours
    assert cgroup_cpu_limit(proc, tmp_path) == limit
    cpus = len(os.sched_getaffinity(0))
    assert available_cpus(proc, tmp_path) == (cpus if limit is None else min(cpus, 1 if limit
                                                                           < 1 else 2))


def test_cgroup_v1_quota_and_period(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "4:memory:/kubepods/x\n3:cpu,cpuacct:/kubepods/x\n0::/\n", V1_MOUNTS)
    _write(tmp_path, "/sys/fs/cgroup/cpu,cpuacct/kubepods/x/cpu.cfs_quota_us", "100000\n")
    _write(tmp_path, "/sys/fs/cgroup/cpu,cpuacct/kubepods/x/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(proc, tmp_path) == 1.0
    assert available_cpus(proc, tmp_path) == 1
    _write(tmp_path, "/sys/fs/cgroup/cpu,cpuacct/kubepods/x/cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_limit(proc, tmp_path) is None


def test_a_container_sees_its_own_cgroup_at_the_mount(tmp_path: Path) -> None:
    """With its own cgroup namespace a container's /proc/self/cgroup says ``/``; with the
    host's, the mount's root is the container's cgroup: either way its limit is at the mount."""
    mounts = "41 31 0:38 /kubepods/pod1/c1 /sys/fs/cgroup ro - cgroup2 cgroup2 rw\n"
    proc = _proc(tmp_path, "0::/kubepods/pod1/c1\n", mounts)
    _write(tmp_path, "/sys/fs/cgroup/cpu.max", "200000 100000\n")
    assert cgroup_cpu_limit(proc, tmp_path) == 2.0
    other = _proc(tmp_path / "o", "0::/elsewhere\n", mounts)  # not below that mount's root
    assert cgroup_cpu_limit(other, tmp_path) is None


def test_nothing_to_read_is_no_limit(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path / "absent", tmp_path) is None
    proc = _proc(tmp_path, "0::/a\n", V2_MOUNTS)  # cpu.max missing (controller not enabled)
    assert cgroup_cpu_limit(proc, tmp_path) is None
    assert available_cpus(proc, tmp_path) == len(os.sched_getaffinity(0))


def _auto_workers(preexec: object) -> int:
    """``--workers auto`` as opgate's CLI parses it, in a process set up by ``preexec``."""
    out = subprocess.run(
        [sys.executable, "-c",
         "from proxy.cli_values import worker_count; print(worker_count('auto'))"],
        capture_output=True, text=True, check=True, preexec_fn=preexec,  # type: ignore[arg-type]
        cwd=Path(__file__).resolve().parents[2])
    return int(out.stdout)


def test_auto_follows_the_affinity_mask() -> None:
    """``taskset -c 0 opgate serve --workers auto`` (or a CPU manager's exclusive CPU): one
    worker, not one per CPU of the machine."""
    cpu = min(os.sched_getaffinity(0))
    assert _auto_workers(lambda: os.sched_setaffinity(0, {cpu})) == 1


CPU_V1 = Path("/sys/fs/cgroup/cpu")


@pytest.mark.skipif(not os.access(CPU_V1, os.W_OK) or len(os.sched_getaffinity(0)) < 2,
                    reason="needs a writable cgroup v1 cpu hierarchy (root) and 2 CPUs")
def test_auto_follows_a_real_cgroup_cpu_quota() -> None:
    """A pod's ``limits.cpu: 1`` is a CFS quota of one period per period: one worker."""
    group = CPU_V1 / f"opgate-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_quota_us").write_text(
            (group / "cpu.cfs_period_us").read_text())  # 1 CPU

        def enter() -> None:
            (group / "cgroup.procs").write_text("0")

        assert _auto_workers(enter) == 1
    finally:
        group.rmdir()
