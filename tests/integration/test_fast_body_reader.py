"""Long length-framed bodies through the fast relay: BodyReader and SplicePump.

A body of at least ``LONG_BODY`` bytes is read into a buffer of the upstream connection's own and
written to the client as views of it (``BodyReader``, proxy/relay/fast/upstream.py), or, when
both sockets are plain TCP, moved socket to socket with splice(2) (``SplicePump``,
proxy/relay/fast/splice.py). These tests run on both event loops the relay runs on (uvloop picks
its read callbacks when reading starts, asyncio switches at once), over TLS (BodyReader) and
plain HTTP (SplicePump, and BodyReader with splicing off), with a client that reads at once and
one that reads slowly through a small window (the relay's write buffer then holds views; the
pump's pipe fills): every byte must arrive intact and in order, the connection must go back to
the pool, and a call after the long body must be parsed as usual. That a view still held sends
the next read to a fresh buffer is checked deterministically in tests/unit/test_fast_upstream.py;
the pump's other endings in tests/integration/test_fast_splice.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
from typing import Any

import pytest
from aiohttp import web

from proxy.relay.fast import upstream
from proxy.relay.fast.relay import FastRelay
from tests.integration.fakes import (
    AiohttpUpstream,
    read_head,
    run_on,
    running_proxy,
    tls_upstream,
)

pytest.importorskip("uvloop")

BODY = os.urandom(3 * upstream.LONG_BODY + 12345)  # several reads, a partial last one
LOOPS = ["asyncio", "uvloop"]


async def handler(request: web.BaseRequest) -> web.StreamResponse:
    if request.path.endswith("/small"):
        return web.Response(body=b'{"kind":"Status"}', content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    resp.content_length = len(BODY)
    await resp.prepare(request)
    for at in range(0, len(BODY), 100_000):  # the upstream writes in pieces of its own
        await resp.write(BODY[at:at + 100_000])
    return resp


class Counting:
    """Counts the BodyReaders and SplicePumps the relay starts (the real classes do the work)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started = 0
        self.pumps = 0
        reader, pump = upstream.BodyReader, upstream.SplicePump

        def start(*args: Any) -> upstream.BodyReader:
            self.started += 1
            return reader(*args)

        def start_pump(*args: Any) -> upstream.SplicePump:
            self.pumps += 1
            return pump(*args)

        monkeypatch.setattr(upstream, "BodyReader", start)
        monkeypatch.setattr(upstream, "SplicePump", start_pump)


async def fetch(url: str, path: str, *, slow: bool) -> tuple[dict[str, str], bytes]:
    """One GET on a fresh connection: the head's fields and the body."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if slow:  # a small window: the relay's own write buffer fills, not just the kernel's
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=2**16)
    writer.write(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    _, headers = await read_head(reader)
    want, got = int(headers["content-length"]), bytearray()
    size = 4096 if slow else 65536
    while len(got) < want:
        chunk = await asyncio.wait_for(reader.read(min(want - len(got), size)), 10)
        assert chunk, f"connection closed after {len(got)} of {want} bytes"
        got += chunk
        if slow:
            await asyncio.sleep(0)  # one small read per loop turn
    writer.close()
    return headers, bytes(got)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize(("tls", "splice"), [(False, True), (False, False), (True, True)],
                         ids=["plain", "plain-nosplice", "tls"])
@pytest.mark.parametrize("slow", [False, True], ids=["fast-client", "slow-client"])
def test_long_body_arrives_intact_and_the_connection_is_reused(
    loop: str, tls: bool, splice: bool, slow: bool, tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    readers = Counting(monkeypatch)
    if not splice:
        monkeypatch.setattr(upstream, "SPLICE_AVAILABLE", False)

    async def main() -> None:
        context, options = tls_upstream(tls, str(tmp_path))
        up = await AiohttpUpstream(handler).start(ssl_context=context)
        try:
            async with running_proxy(up.url, relay_kind="fast", **options) as proxy:
                assert isinstance(proxy.relay, FastRelay)
                for _ in range(2):
                    headers, body = await fetch(proxy.url, "/api/v1/pods", slow=slow)
                    assert headers["content-length"] == str(len(BODY))
                    assert hashlib.sha256(body).digest() == hashlib.sha256(BODY).digest()
                    _, small = await fetch(proxy.url, "/api/v1/small", slow=False)
                    assert small == b'{"kind":"Status"}'
                assert proxy.relay.pool.opened == 1, "the connection was not given back"
        finally:
            await up.close()

    run_on(loop, main)
    spliced = splice and not tls
    assert (readers.pumps, readers.started) == ((2, 0) if spliced else (0, 2))


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("splice", [True, False], ids=["splice", "nosplice"])
def test_client_leaving_mid_body_closes_the_upstream_connection(
    loop: str, splice: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    readers = Counting(monkeypatch)
    if not splice:
        monkeypatch.setattr(upstream, "SPLICE_AVAILABLE", False)
    gone = asyncio.Event  # made per loop below

    async def main() -> None:
        closed = gone()

        async def endless(request: web.BaseRequest) -> web.StreamResponse:
            resp = web.StreamResponse()
            resp.content_length = 1 << 40
            await resp.prepare(request)
            try:
                while True:
                    await resp.write(BODY[:100_000])
            except (ConnectionError, asyncio.CancelledError):
                closed.set()
                raise
            return resp

        up = await AiohttpUpstream(endless).start()
        try:
            async with running_proxy(up.url, relay_kind="fast") as proxy:
                host, port = proxy.url.removeprefix("http://").split(":")
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\n\r\n")
                await read_head(reader)
                await reader.readexactly(4 * upstream.READ_SIZE)
                writer.close()
                await asyncio.wait_for(closed.wait(), 5)
        finally:
            await up.close()

    run_on(loop, main)
    assert (readers.pumps, readers.started) == ((1, 0) if splice else (0, 1))
