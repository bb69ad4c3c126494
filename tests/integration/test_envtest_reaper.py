"""The harness's reaper (``proxy.envtest.reaper``) on real processes.

Its end of the line closing is what the starter's death looks like to it (the kernel closes a
dead process's descriptors), so ``Reaper.close(timeout=0)`` stands for a killed starter here;
tests/e2e/test_harness_hygiene.py kills a real pytest. Ends are awaited through pidfds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.envtest.reaper import Reaper, _Targets, start_time
from tests.integration.procwatch import ended

GRACE = 0.5
ENDED_WITHIN = 15.0


def _ended(*pids: int, timeout: float = ENDED_WITHIN) -> bool:
    return not ended(*pids, timeout=timeout)


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Long sleeps, each in a session of its own; killed at the end if still running."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _sleeper(started: list[subprocess.Popen[bytes]], script: str = "exec sleep 600",
             ) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE,
                            start_new_session=True)
    started.append(proc)
    return proc


def test_a_dead_starters_groups_processes_and_dirs_are_cleaned_up(
    sleepers: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    line = Reaper(grace=GRACE)
    group = _sleeper(sleepers, "sleep 600 >/dev/null & echo $!; exec sleep 600 >/dev/null")
    alone = _sleeper(sleepers)
    deaf = _sleeper(sleepers, "trap '' TERM; exec sleep 600")  # SIGKILL after the grace
    workdir = tmp_path / "work"
    workdir.mkdir()
    line.watch_group(group.pid)
    line.watch_process(alone.pid)
    line.watch_group(deaf.pid)
    line.remove_at_death(workdir)
    assert group.stdout is not None
    member = int(group.stdout.readline())  # a second process in the leader's group
    reaper_pid = line.pid
    assert reaper_pid is not None

    line.close(timeout=0)  # as if this process had died

    assert _ended(group.pid, member, alone.pid, deaf.pid, reaper_pid)
    assert deaf.wait() == -signal.SIGKILL and alone.wait() == -signal.SIGTERM
    assert not workdir.exists()


def test_what_was_stopped_or_kept_is_left_alone(
    sleepers: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    line = Reaper(grace=GRACE)
    stopped = _sleeper(sleepers)
    line.watch_group(stopped.pid)
    line.forget_process(stopped.pid)
    line.remove_at_death(tmp_path)
    line.keep(tmp_path)

    line.close()

    assert stopped.poll() is None and tmp_path.exists()


def test_a_pid_now_naming_another_process_is_never_signalled(
    sleepers: list[subprocess.Popen[bytes]],
) -> None:
    other = _sleeper(sleepers)
    targets = _Targets(grace=GRACE)
    targets.apply(f"+p {other.pid} 1")  # registered once, started at another time
    targets.apply(f"+g {other.pid} 1")
    targets.clean_up()
    assert other.poll() is None

    targets.apply(f"+p {other.pid} {start_time(other.pid)}")
    targets.clean_up()
    assert other.wait(timeout=ENDED_WITHIN) == -signal.SIGTERM


def test_a_killed_reaper_is_replaced_and_told_everything_again(
    sleepers: list[subprocess.Popen[bytes]],
) -> None:
    line = Reaper(grace=GRACE)
    first, second = _sleeper(sleepers), _sleeper(sleepers)
    line.watch_group(first.pid)
    killed = line.pid
    assert killed is not None
    os.kill(killed, signal.SIGKILL)
    assert _ended(killed)

    line.watch_group(second.pid)  # finds the line broken: a new reaper, told of both
    assert line.pid not in (None, killed)
    line.close(timeout=0)

    assert _ended(first.pid, second.pid)


def test_a_proc_is_stopped_by_the_reaper_when_its_starter_is_killed(tmp_path: Path) -> None:
    """A starter that dies by SIGKILL (no atexit, no teardown) leaves no Proc running."""
    program = (
        "import sys, threading\n"
        "from proxy.envtest.procs import Proc\n"
        "from proxy.envtest.reaper import reaper\n"
        "import pathlib\n"
        "proc = Proc('sleep', ['sleep', '600'], log=pathlib.Path(sys.argv[1]))\n"
        "thread = threading.Thread(target=proc.start)\n"
        "thread.start()\n"
        "thread.join()\n"  # the thread that spawned it is gone: PDEATHSIG would have fired
        "print(proc.pid, reaper().pid, flush=True)\n"
        "threading.Event().wait(600)\n"
    )
    starter = subprocess.Popen([sys.executable, "-c", program, str(tmp_path / "log")],
                               stdout=subprocess.PIPE, text=True,
                               cwd=Path(__file__).resolve().parents[2])
    assert starter.stdout is not None
    try:
        child, reaper_pid = map(int, starter.stdout.readline().split())
        assert not _ended(child, timeout=0)
        starter.kill()
        starter.wait()
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
        starter.stdout.close()
    assert _ended(child, reaper_pid)


def test_a_forked_child_still_running_does_not_keep_the_reaper_waiting(tmp_path: Path) -> None:
    """A fork (``multiprocessing``'s default here) copies the line's write end: the reaper would
    see no EOF while the child lives, and the starter's processes would outlive it."""
    program = (
        "import os, sys, threading, pathlib\n"
        "from proxy.envtest.procs import Proc\n"
        "from proxy.envtest.reaper import reaper\n"
        "proc = Proc('sleep', ['sleep', '600'], log=pathlib.Path(sys.argv[1]))\n"
        "proc.start()\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    threading.Event().wait(600)\n"
        "    os._exit(0)\n"
        "print(proc.pid, reaper().pid, child, flush=True)\n"
        "threading.Event().wait(600)\n"
    )
    starter = subprocess.Popen([sys.executable, "-c", program, str(tmp_path / "log")],
                               stdout=subprocess.PIPE, text=True,
                               cwd=Path(__file__).resolve().parents[2])
    assert starter.stdout is not None
    forked = None
    try:
        sleeper, reaper_pid, forked = map(int, starter.stdout.readline().split())
        starter.kill()
        starter.wait()
        assert _ended(sleeper, reaper_pid)
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
        starter.stdout.close()
        if forked is not None:
            os.kill(forked, signal.SIGKILL)  # the fork this test's program made
