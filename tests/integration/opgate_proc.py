"""Run ``python -m proxy serve`` as a real subprocess for tests, and stop it by its PID.

Each is registered with the test process's reaper (``proxy.envtest.reaper``): if pytest dies
without stopping it (SIGKILL, or a test that never called ``stop``), the reaper does."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from proxy.envtest.procs import free_port
from proxy.envtest.reaper import reaper


class OpgateProcess:
    """An ``opgate serve`` child process with its API and admin URLs and its captured output."""

    def __init__(self, *args: str, log_dir: Path, env: dict[str, str] | None = None,
                 session: bool = False, wrapper: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.admin_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_url = f"http://127.0.0.1:{self.admin_port}"
        self.stdout_path = log_dir / f"opgate-{self.port}.out"
        self.stderr_path = log_dir / f"opgate-{self.port}.err"
        # wrapper: a command that execs the rest (e.g. into a namespace of its own)
        cmd = [*wrapper, sys.executable, "-m", "proxy", "serve", "--listen",
               f"127.0.0.1:{self.port}",
               "--admin-listen", f"127.0.0.1:{self.admin_port}", *args]
        self._out = self.stdout_path.open("wb")
        self._err = self.stderr_path.open("wb")
        # session: a process group of its own, for a test to signal it as a terminal does
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=self._err,
                                     env={**os.environ, **(env or {})}, start_new_session=session)
        # its own group: the whole group; else only it (its group is pytest's own)
        if session:
            reaper().watch_group(self.proc.pid)
        else:
            reaper().watch_process(self.proc.pid)

    def wait_ready(self, timeout: float = 30.0, path: str = "/healthz") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"opgate exited with {self.proc.returncode}:\n{self.stderr()}")
            try:
                with urllib.request.urlopen(self.admin_url + path, timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"opgate not ready after {timeout}s:\n{self.stderr()}")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        reaper().forget_process(self.proc.pid)
        self._out.close()
        self._err.close()
        return self.proc.returncode


def open_once_read(fifo: Path, proc: subprocess.Popen[bytes] | subprocess.Popen[str],
                   describe: Callable[[], str] = lambda: "") -> int:
    """A write end of ``fifo``, once ``proc`` opens it to read (its start is held there until
    the test writes); ``describe`` says what went wrong when it exits or never reads it."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:  # ENXIO: nobody reads it yet
            if exc.errno != errno.ENXIO:
                raise
        assert proc.poll() is None, describe()
        assert time.monotonic() < deadline, describe()
        time.sleep(0.01)
