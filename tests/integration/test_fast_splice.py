"""The fast relay's SplicePump (proxy/relay/fast/splice.py): a long length-framed body from a
plain-HTTP upstream moved to a plain-TCP client with splice(2).

That the bytes arrive intact, with a fast and a slow client, and that the connection goes back to
the pool is in tests/integration/test_fast_body_reader.py. Here: every other way the pump can
end (the upstream closing or stalling mid-body, the client leaving), that it leaves no
descriptor behind in any of them, that the held-back head goes first, that the client
connection serves its next call after it, that the call's byte count is right, and the calls it
must leave alone (a tap sees the body; a TLS or Unix-socket client). Each on both event loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from proxy.engine.context import RequestContext
from proxy.relay.calls import RelaySettings
from proxy.relay.fast import splice, upstream
from tests.integration.fakes import (
    Proxy,
    RawUpstream,
    Tapping,
    make_cert,
    read_head,
    run_on,
    running_proxy,
)

pytestmark = pytest.mark.skipif(not splice.AVAILABLE, reason="splice(2) is Linux-only")

LOOPS = ["asyncio", "uvloop"]
SIZE = 4 * upstream.LONG_BODY + 4321
BODY = os.urandom(SIZE)
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"


def open_pipes() -> int:
    """Pipes this process holds open (the pump's are its only ones)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
        except OSError:
            pass
    return count


class Pumps:
    """Counts the SplicePumps the relay starts (the real class does the work)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started = 0
        real = upstream.SplicePump

        def start(*args: Any) -> upstream.SplicePump:
            self.started += 1
            return real(*args)

        monkeypatch.setattr(upstream, "SplicePump", start)


class Exits:
    """A middleware that records what the exit hooks see of each call."""

    name = "exits"
    fail_open = False
    needs_body = False

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, str]] = []

    async def entry(self, ctx: RequestContext) -> None:
        return None

    async def exit(self, ctx: RequestContext) -> None:
        self.seen.append((ctx.status_code, ctx.bytes_out, ctx.error))


@contextlib.asynccontextmanager
async def fast_proxy(serve: Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                     Awaitable[None]],
                     **options: Any) -> AsyncIterator[tuple[RawUpstream, Proxy]]:
    """A :class:`RawUpstream` answering with ``serve``, and the fast relay in front of it."""
    up = await RawUpstream(serve).start()
    try:
        async with running_proxy(up.url, relay_kind="fast", **options) as proxy:
            yield up, proxy
    finally:
        await up.close()


async def serve_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers each GET with BODY: the head alone first (the relay holds it back), then the
    body in pieces; ``/small`` with a short body."""
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return
        if b"/small" in head.split(b"\r\n", 1)[0]:
            writer.write(HEAD % 2 + b"ok")
            continue
        writer.write(HEAD % SIZE)
        await writer.drain()
        await asyncio.sleep(0.05)
        for at in range(0, SIZE, 300_000):
            writer.write(BODY[at:at + 300_000])
            await writer.drain()


async def get(host: str, port: int, path: str = "/api/v1/configmaps", *,
              ssl_context: ssl.SSLContext | None = None) -> tuple[str, dict[str, str], bytes]:
    """One GET on a fresh connection: the status line, the head's fields and the body as far
    as it came before the connection closed or the body ended."""
    reader, writer = await asyncio.open_connection(host, port, ssl=ssl_context)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    line, headers = await read_head(reader)
    want, got = int(headers.get("content-length", "-1")), bytearray()
    while len(got) != want:
        chunk = await asyncio.wait_for(reader.read(1 << 20), 10)
        if not chunk:
            break
        got += chunk
    writer.close()
    return line, headers, bytes(got)


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


@pytest.mark.parametrize("loop", LOOPS)
def test_the_head_goes_first_the_count_is_right_and_the_next_call_is_served(
    loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pumps = Pumps(monkeypatch)
    exits = Exits()

    async def main() -> None:
        pipes = open_pipes()
        async with fast_proxy(serve_body, middlewares=(exits,)) as (_, proxy):
            host, port = address(proxy.url)
            reader, writer = await asyncio.open_connection(host, port)
            # pipelined: the second call waits for the first's spliced body to end
            writer.write(b"GET /api/v1/configmaps HTTP/1.1\r\nHost: x\r\n\r\n"
                         b"GET /api/v1/small HTTP/1.1\r\nHost: x\r\n\r\n")
            line, headers = await read_head(reader)
            assert line == "HTTP/1.1 200 OK" and headers["content-length"] == str(SIZE)
            assert headers["content-type"] == "application/json"
            body = await asyncio.wait_for(reader.readexactly(SIZE), 10)
            assert hashlib.sha256(body).digest() == hashlib.sha256(BODY).digest()
            line, headers = await read_head(reader)
            assert line == "HTTP/1.1 200 OK"
            assert await reader.readexactly(2) == b"ok"
            writer.close()
            assert proxy.relay.pool.opened == 1, "the upstream connection was not reused"
            assert open_pipes() == pipes, "the pump's pipe was left open"

    run_on(loop, main)
    assert pumps.started == 1
    assert exits.seen == [(200, SIZE, ""), (200, 2, "")]


@pytest.mark.parametrize("loop", LOOPS)
def test_an_http10_client_gets_the_whole_body_then_the_end_of_the_connection(
    loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pumps = Pumps(monkeypatch)

    async def main() -> None:
        async with fast_proxy(serve_body) as (_, proxy):
            reader, writer = await asyncio.open_connection(*address(proxy.url))
            writer.write(b"GET /api/v1/configmaps HTTP/1.0\r\n\r\n")
            line, headers = await read_head(reader)
            assert line.endswith("200 OK") and headers["content-length"] == str(SIZE)
            assert headers["connection"] == "close"
            rest = await asyncio.wait_for(reader.read(), 10)  # up to the connection's end
            assert hashlib.sha256(rest).digest() == hashlib.sha256(BODY).digest()
            writer.close()

    run_on(loop, main)
    assert pumps.started == 1


@pytest.mark.parametrize("loop", LOOPS)
def test_the_upstream_closing_mid_body_cuts_the_client_short(
    loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pumps = Pumps(monkeypatch)
    exits = Exits()

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(HEAD % SIZE + BODY[: 2 * upstream.LONG_BODY])
        await writer.drain()
        await asyncio.sleep(0.1)  # the pump is running by now
        writer.transport.abort()

    async def main() -> None:
        pipes = open_pipes()
        async with fast_proxy(cut, middlewares=(exits,)) as (_, proxy):
            for _ in range(3):
                _, headers, body = await get(*address(proxy.url))
                assert headers["content-length"] == str(SIZE)
                assert len(body) < SIZE, "a body cut short upstream arrived whole"
                assert body == BODY[: len(body)]
            assert open_pipes() == pipes
            assert not proxy.relay.pool._idle, "a connection cut mid-body went to the pool"

    run_on(loop, main)
    assert pumps.started == 3
    assert [(code, bool(error)) for code, _, error in exits.seen] == [(200, True)] * 3
    assert all("upstream stream" in error for _, _, error in exits.seen if error)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_stalled_body_ends_at_the_request_timeout_and_closes_the_upstream(
    loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pumps = Pumps(monkeypatch)

    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(HEAD % SIZE + BODY[: 2 * upstream.LONG_BODY])
        await writer.drain()
        await reader.read()  # until opgate closes the connection

    async def main() -> None:
        pipes = open_pipes()
        loop_ = asyncio.get_running_loop()
        async with fast_proxy(stall, settings=RelaySettings(request_timeout=1.0)) as (up, proxy):
            started = loop_.time()
            _, _, body = await get(*address(proxy.url))
            assert len(body) == 2 * upstream.LONG_BODY
            assert loop_.time() - started < 5
            await asyncio.wait_for(up.closed.get(), 5)  # opgate closed the upstream
            assert open_pipes() == pipes

    run_on(loop, main)
    assert pumps.started == 1


@pytest.mark.parametrize("loop", LOOPS)
def test_a_client_leaving_mid_body_leaves_nothing_open(
    loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pumps = Pumps(monkeypatch)

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(HEAD % (1 << 40))
        while True:
            writer.write(BODY)
            await writer.drain()

    async def main() -> None:
        up = await RawUpstream(endless).start()
        fds, pipes = len(os.listdir("/proc/self/fd")), open_pipes()
        try:
            async with running_proxy(up.url, relay_kind="fast") as proxy:
                for n in range(5):
                    reader, writer = await asyncio.open_connection(*address(proxy.url))
                    writer.write(b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\n\r\n")
                    await read_head(reader)
                    await reader.readexactly(3 * upstream.LONG_BODY)
                    if n % 2:  # a reset, and a clean close
                        writer.transport.abort()
                    else:
                        writer.close()
                    await asyncio.wait_for(up.closed.get(), 5)
                await asyncio.sleep(0.1)
                assert open_pipes() == pipes
                assert len(os.listdir("/proc/self/fd")) <= fds + 2  # the proxy's listener
        finally:
            await up.close()

    run_on(loop, main)
    assert pumps.started == 5


@pytest.mark.parametrize("loop", LOOPS)
def test_bytes_after_the_spliced_body_close_the_upstream_not_answer_the_next_call(
    loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upstream that sends more than its Content-Length (here: a whole second response
    nobody asked for, in the same write as the body's end): the pump moves exactly the body,
    so the rest waits in the socket; the connection must not go back to the pool with it, or
    the next call is answered with those bytes (as the BodyReader path sees ``extra``)."""
    pumps = Pumps(monkeypatch)
    stray = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstray"

    async def more(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            if b"/small" in head.split(b"\r\n", 1)[0]:
                writer.write(HEAD % 2 + b"ok")
                continue
            writer.write(HEAD % SIZE)
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(BODY + stray)
            await writer.drain()

    async def main() -> None:
        pipes = open_pipes()
        async with fast_proxy(more) as (_, proxy):
            reader, writer = await asyncio.open_connection(*address(proxy.url))
            writer.write(b"GET /api/v1/configmaps HTTP/1.1\r\nHost: x\r\n\r\n"
                         b"GET /api/v1/small HTTP/1.1\r\nHost: x\r\n\r\n")
            await read_head(reader)
            body = await asyncio.wait_for(reader.readexactly(SIZE), 10)
            assert hashlib.sha256(body).digest() == hashlib.sha256(BODY).digest()
            _, headers = await read_head(reader)
            assert await reader.readexactly(int(headers["content-length"])) == b"ok"
            writer.close()
            assert proxy.relay.pool.opened == 2, "the connection with stray bytes was reused"
            assert open_pipes() == pipes

    run_on(loop, main)
    assert pumps.started == 1


@pytest.mark.parametrize("loop", LOOPS)
def test_a_tapped_call_sees_every_byte_and_is_not_spliced(
    loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pumps = Pumps(monkeypatch)
    tap, exits = Tapping(), Exits()

    async def main() -> None:
        async with fast_proxy(serve_body, middlewares=(tap, exits)) as (_, proxy):
            _, _, body = await get(*address(proxy.url))
            assert body == BODY

    run_on(loop, main)
    assert pumps.started == 0
    assert bytes(tap.body) == BODY
    assert exits.seen == [(200, SIZE, "")]


@pytest.mark.parametrize("loop", LOOPS)
def test_tls_and_unix_socket_clients_are_not_spliced(
    loop: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    pumps = Pumps(monkeypatch)
    cert, key = make_cert(str(tmp_path))
    trust = ssl.create_default_context(cafile=cert)

    async def main() -> None:
        async with fast_proxy(serve_body, tls_cert=cert, tls_key=key) as (_, proxy):
            host, port = proxy.url.removeprefix("https://").split(":")
            _, _, body = await get(host, int(port), ssl_context=trust)
            assert body == BODY
        path = str(tmp_path / "opgate.sock")
        async with fast_proxy(serve_body, listen=f"unix:{path}"):
            reader, writer = await asyncio.open_unix_connection(path)
            writer.write(b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\n\r\n")
            await read_head(reader)
            assert await asyncio.wait_for(reader.readexactly(SIZE), 10) == BODY
            writer.close()

    run_on(loop, main)
    assert pumps.started == 0
