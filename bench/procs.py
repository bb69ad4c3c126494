"""Every process the bench starts, in one registry that stops them all by PID at the end.

Built on the e2e harness's :class:`proxy.envtest.procs.Proc` (own session, SIGTERM then SIGKILL
of its process group, ``atexit`` as a last resort). The registry stops its processes in reverse
order of start, on normal exit, on an error and on Ctrl-C / SIGTERM (``__main__`` turns SIGTERM
into ``KeyboardInterrupt``), so nginx, redis-server, opgate, kubectl proxy and the watch upstream
never outlive a run. No process is ever looked up or signalled by name.
"""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from proxy.envtest.procs import Proc, free_port, tail

__all__ = ["Procs", "free_port", "wait_http", "wait_port"]


def wait_port(port: int, *, proc: Proc, timeout: float = 30.0) -> None:
    """Until something accepts on 127.0.0.1:``port`` (raises if ``proc`` exits or time runs out)."""
    _wait(lambda: _connects(port), proc=proc, timeout=timeout, what=f"port {port}")


def wait_http(url: str, *, proc: Proc, timeout: float = 30.0,
              headers: Mapping[str, str] | None = None) -> None:
    """Until a GET of ``url`` (with ``headers``) answers 200 (plain HTTP, loopback)."""
    _wait(lambda: _http_ok(url, headers or {}), proc=proc, timeout=timeout, what=url)


def _connects(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _http_ok(url: str, headers: Mapping[str, str]) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=dict(headers)),
                                    timeout=2) as resp:
            return bool(resp.status == 200)
    except (OSError, ValueError):
        return False


def _wait(probe: Callable[[], bool], *, proc: Proc, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if probe():
            return
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited before {what} answered; its log:\n"
                               f"{tail(proc.log)}")
        time.sleep(0.05)
    raise RuntimeError(f"{proc.name}: {what} not ready after {timeout:.0f}s; its log:\n"
                       f"{tail(proc.log)}")


class Procs:
    """Starts named processes with logs in ``logdir``; ``stop_all`` stops them newest first."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self._procs: list[Proc] = []

    def start(
        self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> Proc:
        proc = Proc(name, argv, log=self.logdir / f"{name}.log", env=env, cwd=cwd)
        proc.start()
        self._procs.append(proc)
        return proc

    def stop(self, proc: Proc, *, grace: float = 5.0) -> None:
        proc.stop(grace=grace)
        if proc in self._procs:
            self._procs.remove(proc)

    def stop_all(self) -> None:
        while self._procs:
            self._procs.pop().stop(grace=5.0)

    def stop_pids(self, pids: set[int]) -> None:
        """Stop the processes this registry started with these PIDs."""
        for proc in [p for p in self._procs if p.pid in pids]:
            self.stop(proc)
