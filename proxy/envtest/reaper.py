"""The reaper: stops what the harness started, and removes its temp dirs, when the process that
started them dies, however it dies (SIGKILL, a CI timeout, an uncaught signal, an interpreter
crash), as testcontainers' Ryuk does for containers.

The first process the harness starts also starts one reaper (``python -I -S`` running this
file, in a session of its own so that a terminal's Ctrl-C or ``timeout``'s signal to the test
runner's process group does not reach it). The reaper's stdin is the read end of a pipe whose
only write end the starting process holds, not inheritable by anything it spawns: it is told,
a line each, which process groups, processes and directories to clean up and which no longer
(stopped normally); when it reads EOF, the writer is gone, and it sends SIGTERM to what is
left, SIGKILL after ``GRACE`` seconds, removes the directories and exits. A normal exit of
the starting process closes the pipe with nothing left, so the reaper just exits.

Why not ``prctl(PR_SET_PDEATHSIG)``: it fires when the *thread* that spawned the child exits,
and the harness starts processes from worker threads (``asyncio.to_thread``), so children
would die with their thread. Why not only atexit or a SIGTERM handler: neither runs on SIGKILL.

A PID is signalled only while it still names the process registered (its start time in
/proc must match), so a PID reused by an unrelated process after a crash is never touched. A
registration is lost only if the starter dies in the microseconds between a spawn and its
registration line. Stdlib only: it runs with ``-S`` and never imports the ``proxy`` package.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

GRACE = 5.0
_POLL = 0.05


def start_time(pid: int) -> str:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22), which
    tells it from a later process that reuses its PID; ``-`` where /proc cannot say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "-"


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it holds no ports, files or memory)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


# ---- the reaper process --------------------------------------------------------------------


class _Targets:
    """What the reaper cleans up at EOF: process groups and processes (PID -> start time)
    and directories."""

    def __init__(self, grace: float = GRACE) -> None:
        self.grace = grace
        self.groups: dict[int, str] = {}
        self.pids: dict[int, str] = {}
        self.dirs: set[str] = set()

    def apply(self, line: str) -> None:
        """One instruction: ``+g PID START`` / ``+p PID START`` / ``-p PID`` / ``+d PATH`` /
        ``-d PATH``; an unknown line is ignored."""
        op, _, arg = line.partition(" ")
        if op in ("+g", "+p"):
            pid, _, started = arg.partition(" ")
            (self.groups if op == "+g" else self.pids)[int(pid)] = started
        elif op == "-p":
            self.groups.pop(int(arg), None)
            self.pids.pop(int(arg), None)
        elif op == "+d":
            self.dirs.add(arg)
        elif op == "-d":
            self.dirs.discard(arg)

    def _same(self, pid: int, started: str) -> bool:
        return started == "-" or start_time(pid) in (started, "-")

    def _signal_all(self, sig: signal.Signals) -> list[int]:
        """Signal what is still what was registered; returns the PIDs signalled."""
        signalled = []
        for pgid, started in self.groups.items():
            # a group outlives its leader only while the PID cannot be reused: signal it unless
            # the PID now names a different process
            if start_time(pgid) == "-" or self._same(pgid, started):
                signalled += [pgid] if _quietly(os.killpg, pgid, sig) else []
        for pid, started in self.pids.items():
            if start_time(pid) != "-" and self._same(pid, started):
                signalled += [pid] if _quietly(os.kill, pid, sig) else []
        return signalled

    @staticmethod
    def _wait(pids: list[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(_POLL)

    def clean_up(self) -> None:
        """SIGTERM, up to ``GRACE`` seconds, SIGKILL (what ignored SIGTERM, and the groups'
        other members), then the directories."""
        if signalled := self._signal_all(signal.SIGTERM):
            self._wait(signalled, self.grace)
            self._wait(self._signal_all(signal.SIGKILL), self.grace)
        for path in self.dirs:
            shutil.rmtree(path, ignore_errors=True)


def _quietly(kill: Callable[[int, int], None], pid: int, sig: signal.Signals) -> bool:
    """``kill(pid, sig)``; whether anything was there to signal."""
    try:
        kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def main() -> None:
    """Read instructions from stdin until EOF, then clean up (argv[1]: the grace period)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a stray Ctrl-C must not skip the clean-up
    targets = _Targets(float(sys.argv[1]) if len(sys.argv) > 1 else GRACE)
    for raw in sys.stdin.buffer:
        targets.apply(os.fsdecode(raw.rstrip(b"\n")))
    targets.clean_up()


# ---- the client, in the process that starts things -----------------------------------------


class Reaper:
    """This process's line to its reaper; started on first use, re-started (told everything
    again) if it was killed, dropped in a forked child (whose parent keeps the line)."""

    def __init__(self, grace: float = GRACE) -> None:
        self.grace = grace
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._popen: subprocess.Popen[bytes] | None = None
        self._held: dict[str, str] = {}  # key -> the line that registered it
        self._closed = False  # at exit: what stops now needs no reaper

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen else None

    def watch_group(self, pgid: int) -> None:
        """Stop process group ``pgid`` (its leader's PID) if this process dies first."""
        self._hold(f"p{pgid}", f"+g {pgid} {start_time(pgid)}")

    def watch_process(self, pid: int) -> None:
        """Stop process ``pid`` (not its group) if this process dies first."""
        self._hold(f"p{pid}", f"+p {pid} {start_time(pid)}")

    def forget_process(self, pid: int) -> None:
        """``pid`` was stopped (and waited for) here: its PID may be reused from now on."""
        self._release(f"p{pid}", f"-p {pid}")

    def remove_at_death(self, path: str | os.PathLike[str]) -> None:
        """Remove directory ``path`` if this process dies first."""
        self._hold(f"d{os.fspath(path)}", f"+d {os.fspath(path)}")

    def keep(self, path: str | os.PathLike[str]) -> None:
        """``path`` was removed here, or is to be kept: never remove it."""
        self._release(f"d{os.fspath(path)}", f"-d {os.fspath(path)}")

    def _hold(self, key: str, line: str) -> None:
        if "\n" in line:
            raise ValueError(f"a newline in {line!r}")
        with self._lock:
            self._held[key] = line
            self._send(line)

    def _release(self, key: str, line: str) -> None:
        with self._lock:
            if self._held.pop(key, None) is not None:
                self._send(line)

    def _send(self, line: str) -> None:
        """Write ``line`` (atomic: shorter than PIPE_BUF); if the reaper is gone, start a new
        one and tell it everything held."""
        if self._closed:
            return
        data = os.fsencode(line + "\n")
        if self._fd is not None:
            try:
                os.write(self._fd, data)
                return
            except OSError:  # EPIPE: someone killed the reaper
                self._close()
        self._spawn()
        assert self._fd is not None
        os.write(self._fd, b"".join(os.fsencode(held + "\n") for held in self._held.values()))

    def _spawn(self) -> None:
        read_end, write_end = os.pipe()  # neither is inherited by other children (PEP 446)
        try:
            self._popen = subprocess.Popen(
                [sys.executable, "-I", "-S", __file__, str(self.grace)], stdin=read_end,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            )
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        self._fd = write_end

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self, timeout: float | None = None) -> None:
        """At a normal exit: close the line and wait for the reaper (it cleans up what was
        left registered, usually nothing), so that it is not left a zombie."""
        timeout = 2 * self.grace + 5 if timeout is None else timeout
        with self._lock:
            self._closed = True
            self._close()
            popen, self._popen = self._popen, None
        if popen is not None:
            try:
                popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass

    def _after_fork_in_child(self) -> None:
        """A forked child must not keep its parent's line open (the reaper would wait for it
        too), nor clean up what its parent started when it exits."""
        if self._fd is not None:
            os.close(self._fd)
        self._lock = threading.Lock()
        self._fd, self._popen = None, None
        self._held = {}


_reaper: Reaper | None = None
_reaper_lock = threading.Lock()


def reaper() -> Reaper:
    """This process's reaper client (one per process)."""
    global _reaper
    with _reaper_lock:
        if _reaper is None:
            _reaper = Reaper()
            atexit.register(_reaper.close)
            os.register_at_fork(after_in_child=_reaper._after_fork_in_child)
        return _reaper


if __name__ == "__main__":
    main()
