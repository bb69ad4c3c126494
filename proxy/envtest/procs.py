"""Child processes for the test tier that never outlive it, and loopback ports to give them.

Every server a test starts (etcd, kube-apiserver, opgate, redis-server) runs in its own process
group and is stopped by that group's id: SIGTERM, a grace period, then SIGKILL, so a failing
test, a Ctrl-C or an exiting interpreter (``atexit``) leaves nothing behind and no name-based
kill is ever needed. If the starting process dies without any of that running (SIGKILL, an
unhandled signal), its reaper (``proxy.envtest.reaper``) stops the groups instead. Output goes
to a log file whose tail is shown when a start fails.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import threading
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from proxy.envtest.reaper import reaper

_sigterm_seen = False


def interrupt_on_sigterm() -> None:
    """Make SIGTERM end this process as Ctrl-C does (``KeyboardInterrupt``), so that a test
    runner ended by a CI timeout or ``timeout`` still runs its fixtures' teardown and
    ``atexit``; a second SIGTERM ends it at once (the reaper then cleans up). Only replaces
    the default action, only from the main thread (where signal handlers run), and never
    again once a SIGTERM came; calling it again puts it back after code that reset SIGTERM
    to its default (asyncio's ``remove_signal_handler`` does)."""
    if (not _sigterm_seen and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: object) -> None:
    global _sigterm_seen
    _sigterm_seen = True
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_open(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def http_ok(url: str) -> bool:
    """Whether a plain-HTTP GET of ``url`` answers 200 (a readiness probe)."""
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url, timeout=3) as resp:
            return bool(resp.status == 200)
    except (OSError, ValueError):
        return False


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Proc:
    """One child process in its own session, output appended to ``log``."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log = log
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self._popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen else None

    def start(self) -> None:
        watcher = reaper()  # first: its atexit then runs after this Proc's stop
        with open(self.log, "ab") as out:
            self._popen = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=self.env, cwd=self.cwd, start_new_session=True,
            )
        watcher.watch_group(self._popen.pid)
        atexit.register(self.stop)

    def send_signal(self, sig: signal.Signals) -> None:
        """Signal the process itself (e.g. SIGSTOP / SIGCONT to freeze it), if it runs."""
        if self._popen is not None and self._popen.poll() is None:
            self._popen.send_signal(sig)

    def alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def stop(self, *, grace: float = 10.0) -> int | None:
        """Stop the whole process group (SIGTERM, then SIGKILL after ``grace`` seconds; at
        once with ``grace=0``); returns the exit code (idempotent)."""
        popen = self._popen
        if popen is None:
            return None
        if popen.poll() is None:
            self._signal(popen.pid, signal.SIGTERM if grace > 0 else signal.SIGKILL)
            try:
                popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self._signal(popen.pid, signal.SIGKILL)
                popen.wait(timeout=30)
        self._signal(popen.pid, signal.SIGKILL)  # leftover children of the group, if any
        reaper().forget_process(popen.pid)
        atexit.unregister(self.stop)
        return popen.returncode

    @staticmethod
    def _signal(pgid: int, sig: signal.Signals) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
