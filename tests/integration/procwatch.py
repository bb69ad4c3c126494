"""Watching processes a test did not start itself (a killed child's own children) end: through
pidfds, so that a test awaits the end instead of polling for it, and a zombie left to an init
that never reaps counts as ended (it holds no port, file or memory)."""

from __future__ import annotations

import os
import select
import time
from pathlib import Path


class Ends:
    """The ends of ``pids``, watched from now on (a pidfd each, opened here: a PID reused
    later is not mistaken for the process)."""

    def __init__(self, pids: set[int] | tuple[int, ...]) -> None:
        self._fds: dict[int, int] = {}
        for pid in pids:
            try:
                self._fds[os.pidfd_open(pid)] = pid
            except ProcessLookupError:
                pass  # gone, and reaped already

    def wait(self, timeout: float) -> set[int]:
        """Wait up to ``timeout`` for all of them to end; returns those still running (empty:
        all ended). With ``timeout=0``, looks once. Closes the pidfds."""
        try:
            pending = set(self._fds)
            deadline = time.monotonic() + timeout
            while pending:
                left = max(0.0, deadline - time.monotonic())
                ready = select.select(list(pending), [], [], left)[0]
                pending -= set(ready)
                if not ready and left == 0:
                    break
            return {self._fds[fd] for fd in pending}
        finally:
            for fd in self._fds:
                os.close(fd)
            self._fds = {}


def ended(*pids: int, timeout: float) -> set[int]:
    """``Ends(pids).wait(timeout)``: those of ``pids`` still running after ``timeout``."""
    return Ends(pids).wait(timeout)


def descendants(root: int) -> set[int]:
    """The PIDs whose chain of parents leads to ``root``: all it started that still runs."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def command(pid: int) -> str:
    """``pid``'s command line (shortened), to say what is still running."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "?"


def read_until(fd: int, marker: str | None, timeout: float) -> str:
    """What a child printed on ``fd``: until a whole line holding ``marker`` came (pytest's
    progress dots may stand before it), its output ended, or ``timeout`` passed."""
    out = b""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0 and select.select([fd], [], [], left)[0]:
        chunk = os.read(fd, 65536)
        out += chunk
        if not chunk or (marker is not None and out.endswith(b"\n")
                         and marker.encode() in out):
            break
    return out.decode(errors="replace")
