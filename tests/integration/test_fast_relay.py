"""The fast relay (proxy/relay/fast): bodies, framing, watches, disconnects, errors, headers, pool,
and what only its own server has to do (request limits, keep-alive expiry, graceful shutdown).

Each test runs a fake upstream from tests/integration/fakes.py and the fast relay on 127.0.0.1
in this process; the client is aiohttp, or raw sockets where exact bytes matter. The behaviour
both relay cores share is tested on both in tests/integration/test_relay_*.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.engine.context import RequestContext
from proxy.relay import RelaySettings
from proxy.relay.fast import FastRelay, server
from tests.integration.fakes import (
    AiohttpUpstream,
    RawUpstream,
    ok_handler,
    read_head,
    run_on,
    running_proxy,
    tls_upstream,
    wait_closed,
)


@contextlib.asynccontextmanager
async def fast_proxy(
    upstream_url: str,
    *,
    middlewares: tuple[object, ...] = (),
    settings: RelaySettings | None = None,
    **upstream: Any,
) -> AsyncIterator[tuple[FastRelay, str]]:
    async with running_proxy(
        upstream_url, middlewares=middlewares, settings=settings or RelaySettings(),
        relay_kind="fast", **upstream,
    ) as proxy:
        assert isinstance(proxy.relay, FastRelay)
        yield proxy.relay, proxy.url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def client() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        auto_decompress=False, skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent")
    )


async def raw_exchange(url: str, request: bytes) -> bytes:
    """Send ``request`` on a fresh connection; read until the relay closes it."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    data = await asyncio.wait_for(reader.read(-1), 5)
    writer.close()
    return data


async def echo(request: web.BaseRequest) -> web.StreamResponse:
    body = await request.read()
    return web.Response(body=body, content_type="application/octet-stream")


@pytest.mark.asyncio
@pytest.mark.parametrize("chunked", [False, True])
async def test_bodies_are_byte_exact_both_ways(chunked: bool) -> None:
    payload = os.urandom(900_017)  # the aiohttp upstream reads at most 1 MiB
    up = await AiohttpUpstream(echo).start()

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(payload), 100_000):
            yield payload[i : i + 100_000]

    try:
        async with fast_proxy(up.url) as (_, url), client() as c:
            data: Any = pieces() if chunked else payload
            async with c.post(url + "/api/v1/namespaces/a/configmaps", data=data) as r:
                assert r.status == 200
                assert await r.read() == payload
            async with c.get(url + "/api/v1/namespaces/a/configmaps/x") as r:
                assert r.status == 200
    finally:
        await up.close()
    seen = up.seen[0]
    assert seen.body == payload
    if chunked:
        assert seen.headers["Transfer-Encoding"] == "chunked"
        assert "Content-Length" not in seen.headers
    else:
        assert seen.headers["Content-Length"] == str(len(payload))


@pytest.mark.asyncio
@pytest.mark.parametrize("framing", ["length", "chunked"])
async def test_response_framing_is_preserved(framing: str) -> None:
    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        if framing == "length":
            resp.content_length = 10
        await resp.prepare(request)
        await resp.write(b"01234")
        await resp.write(b"56789")
        await resp.write_eof()
        return resp

    up = await AiohttpUpstream(handler).start()
    try:
        async with fast_proxy(up.url) as (_, url):
            raw = await raw_exchange(
                url, b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
    finally:
        await up.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    if framing == "length":
        assert b"content-length: 10" in lines and body == b"0123456789"
    else:
        assert b"transfer-encoding: chunked" in lines
        assert body.endswith(b"0\r\n\r\n") and b"01234" in body and b"56789" in body


@pytest.mark.asyncio
async def test_head_request_keeps_length_and_sends_no_body() -> None:
    up = await AiohttpUpstream(ok_handler).start()
    try:
        async with fast_proxy(up.url) as (_, url), client() as c:
            for _ in range(2):
                async with c.head(url + "/api/v1/namespaces/a/pods/b") as r:
                    assert r.status == 200
                    assert r.headers["Content-Length"] == "15"
                    assert await r.read() == b""
    finally:
        await up.close()


async def watch_upstream(events: int, gap: float, sent: list[float]) -> RawUpstream:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        for i in range(events):
            await asyncio.sleep(gap)
            event = b'{"type":"ADDED","object":{"n":%d}}\n' % i
            sent.append(asyncio.get_running_loop().time())
            writer.write(b"%x\r\n%b\r\n" % (len(event), event))
            await writer.drain()
        await wait_closed(reader)

    return await RawUpstream(serve).start()


@pytest.mark.asyncio
async def test_watch_events_arrive_one_by_one() -> None:
    sent: list[float] = []
    up = await watch_upstream(3, 0.3, sent)
    loop = asyncio.get_running_loop()
    try:
        async with fast_proxy(up.url) as (_, url), client() as c:
            async with c.get(url + "/api/v1/namespaces/a/pods?watch=true") as r:
                assert r.status == 200
                for i in range(3):
                    line = await asyncio.wait_for(r.content.readline(), 5)
                    assert line == b'{"type":"ADDED","object":{"n":%d}}\n' % i
                    assert loop.time() - sent[i] < 0.2  # not held back for the next one
    finally:
        await up.close()


def apiserver_like_body(objects: int) -> bytes:
    """Chunked as a kube-apiserver frames a LIST: a 2,048-byte chunk, then the rest of each
    object (a chunk extension and a trailer besides, which a pass-through keeps)."""
    out = [b"1;opgate=test\r\n[\r\n"]
    for i in range(objects):
        obj = b'{"kind":"ConfigMap","n":%d,"data":"%b"},' % (i, b"x" * (3000 + 37 * i))
        out += [b"800\r\n", obj[:2048], b"\r\n", b"%x\r\n" % (len(obj) - 2048), obj[2048:],
                b"\r\n"]
    out.append(b"1\r\n]\r\n0\r\nX-Trailer: 1\r\n\r\n")
    return b"".join(out)


async def read_response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """A chunked response's head and body, raw (framing included), from a raw connection."""
    head = await reader.readuntil(b"\r\n\r\n")
    body = b""
    while not body.endswith(b"\r\n0\r\nX-Trailer: 1\r\n\r\n"):
        more = await asyncio.wait_for(reader.read(65536), 5)
        assert more, body[-200:]
        body += more
    return head, body


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_chunked_body_reaches_the_client_as_the_upstream_framed_it(
    loop: str, tls: bool, tmp_path: Any
) -> None:
    """The chunks of a chunked LIST go through as they came (framing and all, in whatever reads
    the upstream's writes arrive as, decrypted by either loop's TLS), the body ends where its
    framing says, and both connections are kept for the next call."""
    body = apiserver_like_body(40)
    calls = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal calls
        while True:
            await read_head(reader)
            calls += 1
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n" + body[:5])
            for at in range(5, len(body), 7001):  # writes that cut framing anywhere
                await writer.drain()
                writer.write(body[at : at + 7001])
            await writer.drain()

    async def main() -> None:
        context, options = tls_upstream(tls, str(tmp_path))
        up = await RawUpstream(serve).start(ssl_context=context)
        try:
            async with fast_proxy(up.url, **options) as (relay, url):
                host, port = url.removeprefix("http://").split(":")
                reader, writer = await asyncio.open_connection(host, int(port))
                for _ in range(3):
                    writer.write(b"GET /api/v1/configmaps HTTP/1.1\r\nHost: x\r\n\r\n")
                    head, got = await read_response(reader)
                    assert head.startswith(b"HTTP/1.1 200 ")
                    assert b"transfer-encoding: chunked" in head.lower()
                    assert got == body
                writer.close()
                assert calls == 3 and up.connections == 1 and relay.pool.opened == 1
        finally:
            await up.close()

    run_on(loop, main)


@pytest.mark.asyncio
async def test_a_watch_ended_by_opgate_inside_a_chunk_is_cut_short() -> None:
    """A passed-through watch ended by the idle timeout between two chunks ends cleanly
    (test_relay_errors.py); inside a chunk whose rest does not come (within 1 s more) no
    clean end exists: the response is cut."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n10\r\nhalf a")
        await writer.drain()
        await wait_closed(reader)

    up = await RawUpstream(serve).start()
    try:
        settings = RelaySettings(watch_idle_timeout=0.3)
        async with fast_proxy(up.url, settings=settings) as (_, url), client() as c:
            async with c.get(url + "/api/v1/pods?watch=true") as r:
                assert r.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await asyncio.wait_for(r.read(), 5)
            await asyncio.wait_for(up.closed.get(), 5)
    finally:
        await up.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("rest_comes", [True, False], ids=["chunk-completes", "chunk-stalls"])
async def test_shutdown_inside_a_chunk_waits_for_its_end_then_cuts(
    rest_comes: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At shutdown a passed-through watch inside a chunk is not cut at once: when the rest of
    the chunk comes (the apiserver writes an event's chunks back to back) the watch ends
    cleanly after it, whole events only; a chunk that never completes is cut within
    server.LONG_RUNNING_END, not after the listener's whole grace."""
    if rest_comes:  # however slow this machine: the end comes from the chunk, not the bound
        monkeypatch.setattr(server, "LONG_RUNNING_END", 30.0)
    go_on = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n6\r\nfirst\n\r\n7\r\nsec")
        await writer.drain()
        await go_on.wait()
        if rest_comes:
            writer.write(b"ond\n\r\n")
            await writer.drain()
        await wait_closed(reader)

    up = await RawUpstream(serve).start()
    loop = asyncio.get_running_loop()
    try:
        async with running_proxy(up.url, relay_kind="fast", shutdown_timeout=10.0) as proxy, \
                client() as c:
            async with c.get(proxy.url + "/api/v1/pods?watch=true") as r:
                assert await r.content.readline() == b"first\n"
                started = loop.time()
                closing = asyncio.create_task(proxy.listener.close())
                await asyncio.sleep(0.3)  # inside the chunk: neither ended nor cut yet
                assert not closing.done()
                go_on.set()
                if rest_comes:
                    assert await asyncio.wait_for(r.content.read(), 5) == b"second\n"
                else:
                    with pytest.raises(aiohttp.ClientPayloadError):
                        await asyncio.wait_for(r.content.read(), 5)
                await asyncio.wait_for(closing, 5)
            assert loop.time() - started < server.LONG_RUNNING_END + 3  # not the 10 s grace
            await asyncio.wait_for(up.closed.get(), 5)  # the upstream stream is closed too
    finally:
        await up.close()


@pytest.mark.asyncio
async def test_client_disconnect_closes_upstream_within_a_second() -> None:
    sent: list[float] = []
    up = await watch_upstream(1000, 0.2, sent)
    loop = asyncio.get_running_loop()
    try:
        async with fast_proxy(up.url) as (_, url):
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /api/v1/pods?watch=1 HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.wait_for(reader.readuntil(b"ADDED"), 5)
            left = loop.time()
            writer.close()
            closed_at = await asyncio.wait_for(up.closed.get(), 2)
            assert closed_at - left < 1.0
    finally:
        await up.close()


@pytest.mark.asyncio
async def test_unreachable_upstream_is_503_status() -> None:
    async with fast_proxy(f"http://127.0.0.1:{free_port()}") as (_, url), client() as c:
        async with c.get(url + "/api/v1/pods") as r:
            assert r.status == 503
            body = await r.json()
    assert body["kind"] == "Status" and body["reason"] == "ServiceUnavailable"


@pytest.mark.asyncio
async def test_header_timeout_is_504_status() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        await wait_closed(reader)

    up = await RawUpstream(stall).start()
    try:
        settings = RelaySettings(header_timeout=0.3)
        async with fast_proxy(up.url, settings=settings) as (_, url), client() as c:
            async with c.get(url + "/api/v1/pods") as r:
                assert r.status == 504
                body = await r.json()
            closed = await asyncio.wait_for(up.closed.get(), 2)  # the stalled one is dropped
            assert closed > 0
    finally:
        await up.close()
    assert body["kind"] == "Status" and body["reason"] == "Timeout"


@pytest.mark.asyncio
async def test_hop_by_hop_and_private_headers_are_removed_both_ways() -> None:
    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        return web.Response(body=b"{}", headers={
            "Connection": "X-Up-Private", "X-Up-Private": "1", "Keep-Alive": "timeout=5",
            "Proxy-Thing": "1", "Warning": '299 - "kept"', "Audit-Id": "abc",
        })

    up = await AiohttpUpstream(handler).start()
    try:
        async with fast_proxy(up.url) as (_, url), client() as c:
            headers = {"Connection": "X-Private", "X-Private": "1", "Keep-Alive": "300",
                       "TE": "trailers", "Proxy-Authorization": "x", "Opgate-Instance": "a/b/c",
                       "Impersonate-User": "admin", "X-Kept": "yes"}
            async with c.get(url + "/api/v1/pods", headers=headers) as r:
                assert r.status == 200
                got = r.headers
    finally:
        await up.close()
    seen = up.seen[0].headers
    for name in ("X-Private", "Keep-Alive", "TE", "Proxy-Authorization", "Opgate-Instance",
                 "Impersonate-User"):
        assert name not in seen, name
    assert seen["X-Kept"] == "yes"
    for name in ("X-Up-Private", "Keep-Alive", "Proxy-Thing"):
        assert name not in got, name
    assert got["Warning"] == '299 - "kept"' and got["Audit-Id"] == "abc"


@pytest.mark.asyncio
async def test_token_added_only_when_the_client_sent_none() -> None:
    up = await AiohttpUpstream(ok_handler).start()
    try:
        async with fast_proxy(up.url, token="opgate-token") as (_, url), client() as c:
            async with c.get(url + "/api/v1/pods") as r:
                assert r.status == 200
            async with c.get(url + "/api/v1/pods", headers={"Authorization": "Bearer mine"}) as r:
                assert r.status == 200
    finally:
        await up.close()
    assert up.seen[0].headers.getall("Authorization") == ["Bearer opgate-token"]
    assert up.seen[1].headers.getall("Authorization") == ["Bearer mine"]


@pytest.mark.asyncio
async def test_keep_alive_reuses_upstream_connections() -> None:
    up = await AiohttpUpstream(ok_handler).start()
    conn = aiohttp.TCPConnector(limit=1)
    try:
        async with fast_proxy(up.url) as (relay, url), aiohttp.ClientSession(connector=conn) as c:
            for _ in range(50):
                async with c.get(url + "/api/v1/namespaces/a/pods/b") as r:
                    assert await r.read() == b'{"kind":"Fine"}'
            assert relay.pool.opened <= 2
    finally:
        await up.close()


def keep_alive_upstream() -> RawUpstream:
    """Answers every request on a connection with a small JSON; ``/stall`` never answers."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            status, _ = await read_head(reader)
            if status.split()[1].endswith("/stall"):
                await wait_closed(reader)
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 15\r\n\r\n" b'{"kind":"Fine"}')
            await writer.drain()

    return RawUpstream(serve)


async def get_on(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str) -> str:
    """``GET path`` on an open client connection; the status line (the body is read)."""
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    status, headers = await read_head(reader)
    await reader.readexactly(int(headers["content-length"]))
    return status


@pytest.mark.asyncio
async def test_keep_alive_calls_arm_no_loop_timer_each(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.get_running_loop()
    if not isinstance(loop, asyncio.BaseEventLoop):
        pytest.skip("counts call_at on asyncio's own loop (call_later goes through it)")
    armed: list[float] = []
    call_at = loop.call_at

    def counting(when: float, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
        armed.append(when)
        return call_at(when, *args, **kwargs)

    up = await keep_alive_upstream().start()
    try:
        async with fast_proxy(up.url) as (relay, url):
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            monkeypatch.setattr(loop, "call_at", counting)
            for _ in range(200):
                assert " 200 " in await get_on(reader, writer, "/api/v1/namespaces/a/pods/b")
            monkeypatch.undo()
            writer.close()
            assert relay.pool.opened == 1
    finally:
        await up.close()
    # the connect's timeout, the client connection's idle timer, one head deadline: not 200
    assert len(armed) <= 5, armed


@pytest.mark.asyncio
async def test_header_timeout_fires_on_a_connection_reused_for_many_calls() -> None:
    up = await keep_alive_upstream().start()
    loop = asyncio.get_running_loop()
    try:
        async with fast_proxy(up.url, settings=RelaySettings(header_timeout=0.3)) as (relay, url):
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            for _ in range(200):
                assert " 200 " in await get_on(reader, writer, "/api/v1/namespaces/a/pods/b")
            started = loop.time()
            status = await asyncio.wait_for(get_on(reader, writer, "/api/v1/stall"), 5)
            assert " 504 " in status
            assert 0.25 < loop.time() - started < 3
            assert relay.pool.opened == 1  # the stalled call went over the reused connection
            assert " 200 " in await get_on(reader, writer, "/api/v1/namespaces/a/pods/b")
            assert relay.pool.opened == 2  # the timed-out connection was not reused
            writer.close()
            assert await asyncio.wait_for(up.closed.get(), 5)  # and was closed
    finally:
        await up.close()


class _Deny:
    name, needs_body, fail_open = "deny", False, False

    async def entry(self, ctx: RequestContext) -> object:
        from proxy.engine.context import Deny
        from proxy.engine.status import forbidden

        ctx.response_headers.append(("X-Opgate", "seen"))
        return Deny(forbidden("no")) if ctx.info.verb == "delete" else None


@pytest.mark.asyncio
async def test_chain_deny_and_response_headers() -> None:
    up = await AiohttpUpstream(ok_handler).start()
    try:
        async with fast_proxy(up.url, middlewares=(_Deny(),)) as (_, url), client() as c:
            async with c.get(url + "/api/v1/namespaces/a/pods/b") as r:
                assert r.status == 200 and r.headers["X-Opgate"] == "seen"
            async with c.delete(url + "/api/v1/namespaces/a/pods/b") as r:
                assert r.status == 403 and r.headers["X-Opgate"] == "seen"
                assert (await r.json())["reason"] == "Forbidden"
    finally:
        await up.close()
    assert len(up.seen) == 1


@pytest.mark.asyncio
@pytest.mark.parametrize(("head", "code"), [
    (b"GET /api/v1/pods?labelSelector=" + b"a" * (70 * 1024) + b" HTTP/1.1\r\nHost: x\r\n\r\n",
     431),
    (b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * (70 * 1024) + b"\r\n\r\n",
     431),
    (b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\n" + b"X-N: 1\r\n" * 600 + b"\r\n", 431),
    (b"GET /api/v1/pods HTTP/1.1\r\nHost x\r\n\r\n", 400),
])
async def test_oversized_or_malformed_heads_get_a_status_and_are_not_relayed(
    head: bytes, code: int
) -> None:
    seen: list[str] = []

    async def measure(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, headers = await read_head(reader)
        seen.append(headers.get("x-big", ""))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    up = await RawUpstream(measure).start()
    try:
        async with fast_proxy(up.url) as (_, url):
            raw = await raw_exchange(url, head)
            # within the limits: a 60 KiB header (big OIDC tokens) is relayed whole
            big = "t" * (60 * 1024)
            async with client() as c, c.get(url + "/api/v1/pods", headers={"X-Big": big}) as r:
                assert r.status == 200
    finally:
        await up.close()
    assert raw.startswith(b"HTTP/1.1 %d " % code)
    body = raw.split(b"\r\n\r\n", 1)[1]
    assert b'"kind":"Status"' in body and b'"code":%d' % code in body
    assert seen == [big]  # only the request within the limits reached the upstream


@pytest.mark.asyncio
async def test_idle_keep_alive_connection_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "KEEPALIVE", 0.3)
    up = await AiohttpUpstream(ok_handler).start()
    try:
        async with fast_proxy(up.url) as (_, url):
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            for _ in range(2):  # requests keep the connection: each one re-arms the timer
                writer.write(b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\n\r\n")
                status, headers = await read_head(reader)
                await reader.readexactly(int(headers["content-length"]))
                assert " 200 " in status
                await asyncio.sleep(0.2)
            started = asyncio.get_running_loop().time()
            assert await asyncio.wait_for(reader.read(), 3) == b""  # closed by the relay
            assert asyncio.get_running_loop().time() - started < 1.5
            writer.close()
    finally:
        await up.close()


@pytest.mark.asyncio
async def test_slow_client_pauses_the_upstream() -> None:
    block = os.urandom(64 * 1024)
    written = [0]

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (800 * len(block)))
        for _ in range(800):  # 50 MiB
            writer.write(block)
            await writer.drain()
            written[0] += len(block)
        await wait_closed(reader)

    up = await RawUpstream(flood).start()
    try:
        async with fast_proxy(up.url) as (_, url):
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port), limit=2**16)
            writer.write(b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.sleep(1.0)  # read nothing: the relay must stop reading upstream
            assert written[0] < 16 * 1024 * 1024
            total = 0
            while total < 800 * len(block):
                chunk = await asyncio.wait_for(reader.read(2**20), 5)
                assert chunk
                total += len(chunk)
            writer.close()
    finally:
        await up.close()
    assert total >= 800 * len(block)


@pytest.mark.asyncio
async def test_an_upgrade_request_with_a_chunked_body_gets_501() -> None:
    """httptools parses no body of an upgrade request; a Content-Length one is taken from the
    bytes after the head (tests/integration/test_http_hygiene.py), a chunked one is refused
    rather than relayed empty with its chunks sent on as tunnel bytes. (The aiohttp relay
    reads it whole and relays it.)"""
    up = await AiohttpUpstream(ok_handler).start()
    try:
        async with fast_proxy(up.url) as (_, url):
            raw = await raw_exchange(url, b"POST /api/v1/namespaces/a/configmaps HTTP/1.1\r\n"
                                          b"Host: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n"
                                          b"Transfer-Encoding: chunked\r\n\r\n"
                                          b"2\r\n{}\r\n0\r\n\r\n")
    finally:
        await up.close()
    assert raw.startswith(b"HTTP/1.1 501 ")
    assert b'"reason":"NotImplemented"' in raw and b"chunked body" in raw
    assert up.seen == []
