"""opgate's duty as a container's PID 1 (:class:`proxy.workers.OrphanReaper`), on real child
processes of the test, on both event loops: an exited process that is not opgate's own is
reaped; one of the supervisor's workers keeps its exit status for asyncio's child watcher."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import uvloop

from proxy.settings import RuntimeSettings, Settings
from proxy.workers import (
    LIVENESS_GRACE,
    STABLE_AFTER,
    OrphanReaper,
    Supervisor,
    _Worker,
    liveness,
)

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def _orphan() -> int:
    """A process that exits at once and that nothing here waits for, as an orphan given to
    PID 1 (a ``kubectl exec`` session's leftover)."""
    return os.posix_spawn(sys.executable, [sys.executable, "-c", "pass"], os.environ)


def _zombie(pid: int) -> bool:
    """Whether ``pid`` has exited and waits to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def _gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


async def _until(condition: Callable[[], bool], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while True:
        if condition():
            return
        assert time.monotonic() < deadline, "gave up waiting"
        await asyncio.sleep(0.01)


def _run(loop_factory: LoopFactory, test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(test())


async def _reaps_an_orphan() -> None:
    reaper = OrphanReaper(asyncio.get_running_loop(), ours=set)
    reaper.start()
    try:
        orphan = _orphan()
        await _until(lambda: _gone(orphan))
    finally:
        reaper.close()


async def _reaps_one_from_before() -> None:
    orphan = _orphan()
    await _until(lambda: _zombie(orphan))
    reaper = OrphanReaper(asyncio.get_running_loop(), ours=set)
    reaper.start()
    try:
        await _until(lambda: _gone(orphan))
    finally:
        reaper.close()


LOOPS = pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop],
                                ids=["asyncio", "uvloop"])


@LOOPS
def test_an_exited_process_that_is_not_ours_is_reaped(loop_factory: LoopFactory) -> None:
    """Without it such a process stayed a zombie for the container's life, holding a PID of
    the pod's limit (an init reaps them; opgate is the image's entrypoint)."""
    _run(loop_factory, _reaps_an_orphan)


@LOOPS
def test_one_that_exited_before_the_start_is_reaped(loop_factory: LoopFactory) -> None:
    _run(loop_factory, _reaps_one_from_before)


async def test_a_workers_exit_status_stays_asyncios() -> None:
    """The supervisor logs a worker's status ("killed by SIGKILL") and backs off by it: reaped
    by the sweep, asyncio would make it 255. (The supervisor runs on asyncio's loop.)"""
    workers: set[int] = set()
    reaper = OrphanReaper(asyncio.get_running_loop(), ours=lambda: workers)
    reaper.start()
    try:
        worker = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import sys; sys.stdin.read(); sys.exit(3)",
            stdin=asyncio.subprocess.PIPE)
        workers.add(worker.pid)
        orphan = _orphan()
        await _until(lambda: _gone(orphan))
        assert worker.stdin is not None
        worker.stdin.close()
        assert await asyncio.wait_for(worker.wait(), 10) == 3
    finally:
        reaper.close()


def test_one_of_ours_that_exited_is_left_to_its_owner() -> None:
    mine = os.posix_spawn(sys.executable, [sys.executable, "-c", "raise SystemExit(4)"],
                          os.environ)

    async def sweep_once() -> None:
        await _until(lambda: _zombie(mine))
        reaper = OrphanReaper(asyncio.get_running_loop(), ours=lambda: {mine})
        reaper.start()  # a sweep, now
        reaper.close()

    _run(asyncio.new_event_loop, sweep_once)
    assert _zombie(mine)
    assert os.waitstatus_to_exitcode(os.waitpid(mine, 0)[1]) == 4


class _Spawned:
    """A worker process as the supervisor sees it, recording the signals it is sent."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.signals: list[int] = []

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)


async def test_a_sighup_while_a_worker_is_being_spawned_reaches_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A SIGHUP handled while the supervisor waits for a new worker process (forked, not yet
    its ``Process``) was lost for that worker: it skipped one with no process yet, or with the
    dead one a restart replaces, so that worker never reloaded (one "SIGHUP: reloading" line
    short). It is passed on once the worker serves, as to one still starting."""
    supervisor = Supervisor(Settings(runtime=RuntimeSettings(workers=2)), run_dir=str(tmp_path),
                            listen="127.0.0.1:1")
    spawned: list[_Spawned] = []

    async def spawn(*args: object, **kwargs: object) -> _Spawned:
        supervisor._hangup()  # the signal comes while this awaits
        spawned.append(_Spawned(1000 + len(spawned)))
        return spawned[-1]

    async def answers(worker: object) -> bool:
        return True

    monkeypatch.setattr(asyncio, "create_subprocess_exec", spawn)
    monkeypatch.setattr(supervisor, "_answers", answers)
    try:
        for worker in supervisor.workers:
            await supervisor._spawn(worker)
        await asyncio.wait_for(asyncio.gather(*supervisor._hangups), 5)
    finally:
        for fd in supervisor._pipe:
            os.close(fd)
    # the first: the SIGHUP while it was spawned; the second: both, the first one's at once
    assert [p.signals for p in spawned] == [[signal.SIGHUP, signal.SIGHUP], [signal.SIGHUP]]


def _worker(index: int, *, up: bool = False, pid: int | None = None,
            failing_since: float | None = None, quick_deaths: int = 0) -> _Worker:
    """A worker in a given state; ``pid``: its process runs (a stand-in with that pid)."""
    worker = _Worker(index, f"/nowhere/worker-{index}.sock", up=up,
                     failing_since=failing_since, quick_deaths=quick_deaths,
                     last_exit="exited with status 1")
    if pid is not None:
        worker.proc = _Spawned(pid)  # type: ignore[assignment]
    return worker


GRACE = LIVENESS_GRACE


@pytest.mark.parametrize(("workers", "live"), [
    # all serving since the start: never failed
    ([_worker(0, up=True, pid=10), _worker(1, up=True, pid=11)], True),
    # one died at once and restarts: the other serves
    ([_worker(0, failing_since=0.0, quick_deaths=9), _worker(1, up=True, pid=11)], True),
    # both died together a moment ago (an OOM kill): within the grace
    ([_worker(0, failing_since=100 - GRACE / 2), _worker(1, failing_since=100 - GRACE / 2)],
     True),
    # both crash-loop, past the grace
    ([_worker(0, failing_since=0.0, quick_deaths=6), _worker(1, failing_since=1.0)], False),
    # one restarted and serves again (even briefly, in a loop): the pod relays now
    ([_worker(0, up=True, pid=10, failing_since=0.0), _worker(1, failing_since=0.0)], True),
    # restarted, running, but its admin never answered: not serving
    ([_worker(0, pid=10, failing_since=0.0), _worker(1, failing_since=0.0)], False),
    # one of them failing only since just now: not every one past the grace
    ([_worker(0, failing_since=0.0), _worker(1, failing_since=100 - GRACE / 2)], True),
])
def test_liveness_fails_only_when_no_worker_served_for_the_grace(
        workers: list[_Worker], live: bool) -> None:
    ok, detail = liveness(workers, now=100.0)
    assert ok is live, detail
    assert (detail == "") is live


def test_liveness_says_why_for_each_worker() -> None:
    ok, detail = liveness([_worker(0, failing_since=10.0, quick_deaths=6),
                           _worker(1, pid=77, failing_since=20.0, quick_deaths=2)], now=100.0)
    assert not ok
    assert detail == (
        f"no worker has served for 80.0s (more than {GRACE:g}s): worker 0 exited with status 1 "
        f"(6 times in a row within {STABLE_AFTER:g}s of its start), restarting; worker 1 "
        "(pid 77) not serving since its start; it exited with status 1 before (2 times in a "
        f"row within {STABLE_AFTER:g}s of its start)")
