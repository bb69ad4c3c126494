"""A real Redis server for the integration tests: a container when Docker answers, else the local
``redis-server`` binary on a free loopback port. It can be stopped, restarted on the same port,
paused and resumed mid-test (outage tests). If neither way works, the test fails; it never skips.
The binary runs as a ``proxy.envtest.procs.Proc`` (its own process group, stopped at exit, and
by the reaper with its temp dir if the test process dies first: nothing outlives the run).

Use it as a context manager from a fixture::

    @pytest.fixture
    def redis_server():
        with RedisServer.launch() as server:
            yield server
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from proxy.envtest.procs import Proc, tail
from proxy.envtest.reaper import reaper

REDIS_BINARY = os.environ.get("OPGATE_TEST_REDIS_SERVER") or shutil.which("redis-server") or (
    "/usr/bin/redis-server"
)


def free_port(*, cluster: bool = False) -> int:
    """A free loopback port; with ``cluster``, one whose bus port (+10000) is free too."""
    if not cluster:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    for port in random.sample(range(20000, 45000), 200):
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
                return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a Redis Cluster node")


def ping(port: int, *, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def docker_answers() -> bool:
    try:
        import docker

        client = docker.from_env(timeout=2)
        return bool(client.ping())
    except Exception:
        return False


class RedisServer:
    """One Redis server on 127.0.0.1:``port``; ``kind`` is ``container`` or ``binary``."""

    extra_args: tuple[str, ...] = ()

    def __init__(self, *, kind: str, port: int | None = None) -> None:
        self.kind = kind
        self.port = port or free_port()
        self.proc: Proc | None = None
        self.container: Any = None
        self._dir = tempfile.mkdtemp(prefix="opgate-redis-")
        reaper().remove_at_death(self._dir)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @classmethod
    def launch(cls, *, extra_args: tuple[str, ...] = ()) -> RedisServer:
        if docker_answers() and not extra_args:
            server = cls(kind="container")
        elif os.path.exists(REDIS_BINARY):
            server = cls(kind="binary")
        else:
            pytest.fail("integration tests need a real Redis: no Docker engine answered and "
                        f"{REDIS_BINARY} does not exist (apt-get install redis-server)")
        server.extra_args = extra_args
        server.start()
        return server

    def start(self) -> None:
        if self.kind == "container":
            self._start_container()
        else:
            self.proc = Proc("redis-server", [
                REDIS_BINARY, "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", self._dir,
                "--loglevel", "warning", *self.extra_args,
            ], log=Path(self._dir) / "redis.log")
            self.proc.start()
        deadline = time.monotonic() + 15
        while not ping(self.port):
            if self.proc is not None and not self.proc.alive():
                log = Path(self._dir) / "redis.log"
                pytest.fail(f"redis-server exited with {self.proc.stop()} on port {self.port}:\n"
                            f"{tail(log)}")
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"redis on 127.0.0.1:{self.port} did not answer PING within 15 s")
            time.sleep(0.02)

    def _start_container(self) -> None:
        if self.container is not None:  # a restart: same container, same host port
            self.container.get_wrapped_container().start()
            return
        from testcontainers.redis import RedisContainer

        self.container = RedisContainer().with_bind_ports(6379, self.port)
        self.container.start()

    def stop(self) -> None:
        """Kill the server (SIGKILL: no goodbye to clients), keep the port for a restart."""
        if self.proc is not None:
            self.proc.stop(grace=0)
            self.proc = None
        elif self.container is not None:
            self.container.get_wrapped_container().kill()
        deadline = time.monotonic() + 5
        while ping(self.port, timeout=0.05) and time.monotonic() < deadline:
            time.sleep(0.02)

    def restart(self) -> None:
        self.stop()
        self.start()

    def pause(self) -> None:
        """Freeze the server: connections hang instead of failing (the timeout path)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)
        else:
            self.container.get_wrapped_container().pause()

    def resume(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)
        else:
            self.container.get_wrapped_container().unpause()

    def close(self) -> None:
        if self.proc is not None:
            self.resume()
        self.stop()
        if self.container is not None:
            self.container.stop()
            self.container = None
        shutil.rmtree(self._dir, ignore_errors=True)
        reaper().keep(self._dir)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
