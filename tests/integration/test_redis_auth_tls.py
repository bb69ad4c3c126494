"""A Redis with a password from a mounted Secret, and a Redis that speaks only TLS.

Both are real ``redis-server`` processes; opgate's store is built exactly as ``opgate serve``
builds it (``build_store`` with ``--redis-password-file`` / a ``rediss://`` URL naming the CA).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.envtest import pki
from proxy.envtest.procs import Proc, free_port
from proxy.stores import BucketRequest, build_store
from tests.integration.redis_server import REDIS_BINARY, ping

PASSWORD = "s3cret-from-a-secret"


def _start(tmp_path: Path, *args: str) -> Proc:
    proc = Proc("redis", [REDIS_BINARY, "--bind", "127.0.0.1", "--save", "", "--appendonly",
                          "no", "--dir", str(tmp_path), *args], log=tmp_path / "redis.log")
    proc.start()
    return proc


@pytest.fixture
def password_redis(tmp_path: Path) -> Iterator[int]:
    port = free_port()
    proc = _start(tmp_path, "--port", str(port), "--requirepass", PASSWORD)
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and b"NOAUTH" not in _raw(port, b"PING\r\n"):
            time.sleep(0.05)
        yield port
    finally:
        proc.stop()


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    files = pki.write_pki(tmp_path / "pki")
    cert, key = pki.issue_serving_cert(tmp_path / "pki", name="redis")
    port = free_port()
    proc = _start(tmp_path, "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert),
                  "--tls-key-file", str(key), "--tls-ca-cert-file", str(files.ca_cert),
                  "--tls-auth-clients", "no")
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not _listening(port):
            time.sleep(0.05)
        yield port, files.ca_cert
    finally:
        proc.stop()
    assert not ping(port)


@pytest.fixture
def unix_password_redis(tmp_path: Path) -> Iterator[Path]:
    sock = tmp_path / "redis.sock"
    proc = _start(tmp_path, "--port", "0", "--unixsocket", str(sock), "--requirepass", PASSWORD)
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not sock.exists():
            time.sleep(0.05)
        yield sock
    finally:
        proc.stop()


def _raw(port: int, data: bytes) -> bytes:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(data)
            return s.recv(128)
    except OSError:
        return b""


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


async def _decide(store: object, key: str, n: int) -> list[bool]:
    request = BucketRequest(key=key, rate=1.0, burst=3, fail_open=False)
    out = []
    for _ in range(n):
        verdict = await store.acquire([request])  # type: ignore[attr-defined]
        out.append(verdict.allowed and verdict.backend == "redis")
    return out


def test_password_from_a_file(password_redis: int, tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text(PASSWORD + "\n")  # as a Secret mounted from a file often ends

    async def main() -> list[bool]:
        store = build_store(redis_url=f"redis://127.0.0.1:{password_redis}/0",
                            password_file=str(secret), timeout=1.0)
        try:
            return await _decide(store, "auth-test", 4)
        finally:
            await store.close()

    # burst 3: three admitted by Redis, the fourth denied — decided by the real server
    assert asyncio.run(main()) == [True, True, True, False]


@pytest.mark.parametrize("where", ["tcp", "unix"])
def test_an_acl_user_in_the_url_with_its_password_from_a_file(
        password_redis: int, unix_password_redis: Path, tmp_path: Path, where: str) -> None:
    """The chart's form with a Redis ACL user: ``redis://USER@HOST:PORT/DB`` and the password
    in --redis-password-file. redis-py refused the URL's username next to the file's
    credential provider on every connection: the store never reached Redis (the start-up
    PING, with a plain password, did)."""
    import redis

    sock = unix_password_redis
    for admin in (redis.Redis(port=password_redis, password=PASSWORD),
                  redis.Redis(unix_socket_path=str(sock), password=PASSWORD)):
        admin.acl_setuser("opgate", enabled=True, passwords=["+acl-pw"], keys=["opgate:*"],
                          commands=["+@all"])
        admin.close()
    secret = tmp_path / "acl-password"
    secret.write_text("acl-pw\n")
    url = (f"redis://opgate@127.0.0.1:{password_redis}/0" if where == "tcp"
           else f"unix://opgate@{sock}?db=0")

    async def main() -> tuple[list[bool], Any]:
        store: Any = build_store(redis_url=url, password_file=str(secret), timeout=1.0)
        try:
            return await _decide(store, "acl", 4), store.health()
        finally:
            await store.close()

    decided, health = asyncio.run(main())
    assert decided == [True, True, True, False], health


def test_wrong_password_is_an_outage_not_a_crash(password_redis: int) -> None:
    async def main() -> str:
        store = build_store(redis_url=f"redis://:wrong@127.0.0.1:{password_redis}/0",
                            timeout=0.5)
        try:
            verdict = await store.acquire([BucketRequest(key="k", rate=1.0, burst=1,
                                                         fail_open=False)])
            return "unavailable" if verdict.unavailable else verdict.backend
        finally:
            await store.close()

    assert asyncio.run(main()) == "unavailable"  # failure: closed -> 503, never an exception


def test_tls_with_the_ca_named_in_the_url(tls_redis: tuple[int, Path]) -> None:
    port, ca = tls_redis

    async def main() -> list[bool]:
        store = build_store(redis_url=f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}",
                            timeout=1.0)
        try:
            return await _decide(store, "tls-test", 4)
        finally:
            await store.close()

    assert asyncio.run(main()) == [True, True, True, False]


def test_a_rotated_password_file_is_read_again(password_redis: int, tmp_path: Path) -> None:
    """The Secret behind --redis-password-file is rotated: Redis asks for the new password,
    drops its clients, and the kubelet swaps the file. opgate's reconnects must use the file
    as it is now, not the password read at start (stuck in its failure modes until a
    restart)."""
    import redis

    secret = tmp_path / "password"
    secret.write_text(PASSWORD + "\n")
    rotated = "rotated-" + PASSWORD

    async def main() -> None:
        store: Any = build_store(redis_url=f"redis://127.0.0.1:{password_redis}/0",
                                 password_file=str(secret), timeout=1.0, breaker_reset=0.2)
        request = BucketRequest(key="rotate", rate=1000.0, burst=1000, fail_open=False)
        try:
            assert (await store.acquire([request])).backend == "redis"
            admin = redis.Redis(port=password_redis, password=PASSWORD)
            admin.config_set("requirepass", rotated)
            secret.write_text(rotated + "\n")
            admin.client_kill_filter(_type="normal")  # every client but this one
            admin.close()
            deadline = time.monotonic() + 15
            while True:
                verdict = await store.acquire([request])
                if verdict.allowed and verdict.backend == "redis":
                    break
                assert time.monotonic() < deadline, store.health()
                await asyncio.sleep(0.05)
            assert store.health()["breaker"] == "closed"
        finally:
            await store.close()

    asyncio.run(main())


def test_a_redis_back_with_another_password_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Redis goes away (the circuit opens: connection refused), then comes back asking for a
    password opgate does not have. /readyz and the log must say that, not the refused
    connection of minutes ago: the fix is a Secret, not the network."""
    import logging

    caplog.set_level(logging.WARNING, logger="opgate.ratelimit.store")
    port = free_port()
    redis = _start(tmp_path, "--port", str(port))
    deadline = time.monotonic() + 15
    while not ping(port):
        assert time.monotonic() < deadline, "redis-server did not answer"
        time.sleep(0.05)

    async def main() -> dict[str, Any]:
        nonlocal redis
        store: Any = build_store(redis_url=f"redis://127.0.0.1:{port}/0", timeout=0.5,
                                 breaker_reset=0.1)
        request = BucketRequest(key="moved", rate=1000.0, burst=1000, fail_open=False)
        try:
            assert (await store.acquire([request])).backend == "redis"
            redis.stop(grace=0)
            while store.health()["breaker"] == "closed":
                await store.acquire([request])
            assert "connecting to" in str(store.health()["last_error"]), store.health()
            redis = _start(tmp_path, "--port", str(port), "--requirepass", PASSWORD)
            deadline = time.monotonic() + 10
            while "connecting to" in str(store.health()["last_error"]):
                assert time.monotonic() < deadline, store.health()
                await asyncio.sleep(0.05)
            return store.health()
        finally:
            await store.close()

    try:
        health = asyncio.run(main())
    finally:
        redis.stop(grace=0)
    assert health["breaker"] != "closed"
    assert "authentication failed" in str(health["last_error"]), health
    assert "authentication failed" in caplog.text, caplog.text


@pytest.mark.parametrize(("query", "problem"), [
    ("?password=wrong", "authentication failed"),
    ("", "authentication failed"),
    ("?db=99&password=" + PASSWORD, "answered with an error: DB index is out of range"),
])
def test_a_unix_socket_redis_that_refuses_says_why(
        unix_password_redis: Path, query: str, problem: str) -> None:
    """redis-py wraps what a Redis on a unix:// socket answers while connecting (AUTH, SELECT)
    in a ConnectionError: the start-up line and /readyz said "unreachable", sending the user
    to the socket path when the Secret or the ?db= was wrong."""
    from proxy.stores.redis import probe

    url = f"unix://{unix_password_redis}{query}"

    async def main() -> tuple[str | None, str]:
        store: Any = build_store(redis_url=url, timeout=1.0)
        try:
            for _ in range(3):  # failure: closed, until the circuit opens
                await store.acquire([BucketRequest(key="k", rate=1.0, burst=1, fail_open=False)])
            return await probe(url), str(store.health()["last_error"])
        finally:
            await store.close()

    said, last_error = asyncio.run(main())
    assert said is not None and said.startswith(problem), said
    assert last_error.startswith(problem), last_error
