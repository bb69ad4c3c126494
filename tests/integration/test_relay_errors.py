"""Failures: unreachable or stalled upstreams, broken streams, middlewares that deny or crash.

opgate's own answers must be Kubernetes Status bodies, and no failure may wedge the listener:
every test ends by serving a normal request through the same proxy.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.engine.context import Delay, Deny, RequestContext
from proxy.engine.status import StatusError
from proxy.envtest.procs import free_port
from proxy.relay import RelaySettings
from tests.integration.fakes import (
    AiohttpUpstream,
    RawUpstream,
    ok_handler,
    read_head,
    running_proxy,
    wait_closed,
)

pytestmark = pytest.mark.usefixtures("each_relay")  # every test on both relay cores


def assert_status(body: bytes, code: int, reason: str) -> dict[str, Any]:
    status = json.loads(body)
    assert status["kind"] == "Status"
    assert status["apiVersion"] == "v1"
    assert status["status"] == "Failure"
    assert status["code"] == code
    assert status["reason"] == reason
    assert status["message"]
    return status


@pytest.mark.asyncio
async def test_503_when_nothing_listens_then_serves_once_the_upstream_is_up() -> None:
    port = free_port()
    async with running_proxy(f"http://127.0.0.1:{port}") as proxy, aiohttp.ClientSession() as c:
        async with c.get(proxy.url + "/api/v1/pods") as r:
            assert r.status == 503
            assert r.headers["Content-Type"] == "application/json"
            assert_status(await r.read(), 503, "ServiceUnavailable")
        up = await AiohttpUpstream(ok_handler).start(port=port)
        try:
            async with c.get(proxy.url + "/api/v1/pods") as r:
                assert r.status == 200
        finally:
            await up.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
async def test_a_call_that_never_reached_the_apiserver_says_retry_after(method: str) -> None:
    """Nothing of the call left opgate (the apiserver refused the connection: restarting, or a
    rollout behind its Service), so retrying it is safe whatever its verb: the 503 carries
    ``Retry-After: 1`` and ``retryAfterSeconds``, and client-go waits and retries it itself as
    it does a 429 (it retries a 5xx only when told when). Without them a controller's create
    failed at once during an apiserver restart."""
    port = free_port()
    async with running_proxy(f"http://127.0.0.1:{port}") as proxy, aiohttp.ClientSession() as c:
        async with c.request(method, proxy.url + "/api/v1/namespaces/a/configmaps",
                             data=b"{}" if method == "POST" else None) as r:
            assert r.status == 503
            assert r.headers.get("Retry-After") == "1"
            status = assert_status(await r.read(), 503, "ServiceUnavailable")
            assert status["details"]["retryAfterSeconds"] == 1


@pytest.mark.asyncio
async def test_a_create_the_apiserver_may_have_seen_gets_no_retry_after() -> None:
    """An upstream that took the call and then closed without an answer may have made the
    object: a retry could make it twice, so that 503 says nothing of retrying (client-go then
    returns the error, as it would talking to the apiserver directly)."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.close()

    up = await RawUpstream(serve).start()
    try:
        async with running_proxy(up.url) as proxy, aiohttp.ClientSession() as c, c.post(
                proxy.url + "/api/v1/namespaces/a/configmaps", data=b"{}") as r:
            assert r.status == 503
            assert "Retry-After" not in r.headers
            status = assert_status(await r.read(), 503, "ServiceUnavailable")
            assert "retryAfterSeconds" not in status.get("details", {})
    finally:
        await up.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("settings", [
    RelaySettings(header_timeout=0.5),
    RelaySettings(header_timeout=30, request_timeout=0.5),
], ids=["header-timeout", "request-timeout"])
async def test_504_when_the_upstream_never_answers_then_still_serves(
    settings: RelaySettings,
) -> None:
    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        if request.path == "/stall":
            await asyncio.sleep(3600)
        return await ok_handler(request)

    up = await AiohttpUpstream(handler).start()
    loop = asyncio.get_running_loop()
    try:
        async with running_proxy(up.url, settings=settings) as proxy, aiohttp.ClientSession() as c:
            started = loop.time()
            async with c.get(proxy.url + "/stall") as r:
                assert r.status == 504
                status = assert_status(await r.read(), 504, "Timeout")
                assert status["message"].startswith("opgate: the apiserver did not respond in time")
            assert 0.4 < loop.time() - started < 5
            async with c.get(proxy.url + "/api/v1/pods") as r:
                assert r.status == 200
    finally:
        await up.close()


@pytest.mark.asyncio
@pytest.mark.parametrize(("path", "code"), [
    ("/api/v1/namespaces/a/pods/p/log?follow=true", 200),  # a container quiet for a while
    ("/api/v1/namespaces/a/services/s:80/proxy/slow", 200),  # a backend slow to answer
    ("/api/v1/namespaces/a/configmaps?watch=true", 504),  # the apiserver answers a watch at once
])
async def test_a_log_or_proxy_head_may_come_after_the_header_timeout(path: str, code: int) -> None:
    """The apiserver sends the head of ``logs -f`` when the kubelet sends its first byte (the
    container's next line) and that of a proxied call when the backend answers, however long
    that takes: opgate waits as long (``kubectl logs -f`` of a container quiet for 30 s got
    opgate's 504 Timeout). The watch idle timeout, when set, still bounds the wait."""
    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        await asyncio.sleep(0.8)  # past the header timeout
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        await resp.write(b"line 1\n")
        return resp

    up = await AiohttpUpstream(handler).start()
    try:
        async with running_proxy(up.url, settings=RelaySettings(header_timeout=0.3)) as proxy, \
                aiohttp.ClientSession() as c, c.get(proxy.url + path) as r:
            assert r.status == code
            body = await r.read()
        if code == 200:
            assert body == b"line 1\n"
        async with running_proxy(up.url, settings=RelaySettings(
                header_timeout=0.3, watch_idle_timeout=0.3)) as proxy, \
                aiohttp.ClientSession() as c, c.get(proxy.url + path) as r:
            assert r.status == 504  # (no head within the idle timeout)
    finally:
        await up.close()


@pytest.mark.asyncio
async def test_504_on_connect_timeout() -> None:
    # A listener whose accept queue is full drops further SYNs: the connect hangs.
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(0)
    port = blocker.getsockname()[1]
    fillers = []
    for _ in range(8):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fillers.append(s)
    settings = RelaySettings(connect_timeout=0.3, header_timeout=5)
    try:
        async with running_proxy(f"http://127.0.0.1:{port}", settings=settings) as proxy:
            async with aiohttp.ClientSession() as c, c.get(proxy.url + "/version") as r:
                if r.status == 503:
                    pytest.skip("this kernel refuses instead of dropping SYNs to a full queue")
                assert r.status == 504
                assert r.headers.get("Retry-After") == "1"  # (nothing was sent: safe to retry)
                assert_status(await r.read(), 504, "Timeout")
    finally:
        for s in fillers:
            s.close()
        blocker.close()


def dying_upstream(framing: str) -> RawUpstream:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            line, _ = await read_head(reader)
            if "/ok" in line:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                continue
            if framing == "length":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n" + b"x" * 1000)
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                             b"3e8\r\n" + b"x" * 1000 + b"\r\n")
            await writer.drain()
            await asyncio.sleep(0.2)
            return  # dies mid-body

    return RawUpstream(serve)


@pytest.mark.asyncio
@pytest.mark.parametrize("framing", ["length", "chunked"])
async def test_upstream_dying_mid_stream_ends_the_client_response(framing: str) -> None:
    up = await dying_upstream(framing).start()
    loop = asyncio.get_running_loop()
    try:
        async with running_proxy(up.url) as proxy, aiohttp.ClientSession() as c:
            started = loop.time()
            async with c.get(proxy.url + "/api/v1/pods") as r:
                assert r.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await asyncio.wait_for(r.read(), 5)
            assert loop.time() - started < 3
            async with c.get(proxy.url + "/ok") as r:
                assert await r.read() == b"ok"
    finally:
        await up.close()


class Recorder:
    """A test middleware: denies, delays or crashes by path; records what exit hooks see."""

    name = "recorder"
    fail_open = False

    def __init__(self, *, needs_body: bool = False) -> None:
        self.needs_body = needs_body
        self.exits: list[dict[str, Any]] = []
        self.bodies: list[bytes | None] = []

    async def entry(self, ctx: RequestContext) -> Deny | Delay | None:
        self.bodies.append(ctx.body)
        ctx.response_headers.append(("X-Opgate-Test", "seen"))
        if ctx.path.endswith("/deny"):
            ctx.warn("policy test says no")
            return Deny(StatusError(403, "denied by test", "Forbidden", None, (("X-Why", "t"),)))
        if ctx.path.endswith("/delay"):
            return Delay(0.3)
        if ctx.path.endswith("/crash"):
            raise RuntimeError("boom")
        return None

    async def exit(self, ctx: RequestContext) -> None:
        self.exits.append(
            {"path": ctx.path, "code": ctx.status_code, "in": ctx.bytes_in, "out": ctx.bytes_out,
             "upstream": ctx.upstream_seconds, "finished": ctx.finished, "error": ctx.error,
             "started": ctx.started,
             "decision": ctx.decision, "answer": ctx.answer}
        )


@pytest.mark.asyncio
async def test_middleware_deny_delay_crash_and_exit_hooks() -> None:
    up = await AiohttpUpstream(ok_handler).start()
    rec = Recorder()
    loop = asyncio.get_running_loop()
    try:
        async with running_proxy(up.url, middlewares=(rec,)) as proxy, aiohttp.ClientSession() as c:
            async with c.get(proxy.url + "/api/v1/deny") as r:
                assert r.status == 403
                assert r.headers["X-Why"] == "t"
                assert r.headers["X-Opgate-Test"] == "seen"
                assert "policy test says no" in r.headers["Warning"]
                assert_status(await r.read(), 403, "Forbidden")
            started = loop.time()
            async with c.get(proxy.url + "/api/v1/delay") as r:
                assert r.status == 200
                assert r.headers["X-Opgate-Test"] == "seen"
            assert loop.time() - started >= 0.29
            async with c.get(proxy.url + "/api/v1/crash") as r:
                assert r.status == 500
                assert_status(await r.read(), 500, "InternalError")
            async with c.post(proxy.url + "/api/v1/namespaces/a/pods", data=b"x" * 1234) as r:
                assert r.status == 200
                body = await r.read()
    finally:
        await up.close()
    assert [s.raw_path for s in up.seen] == ["/api/v1/delay", "/api/v1/namespaces/a/pods"]
    by_path = {e["path"]: e for e in rec.exits}
    assert by_path["/api/v1/deny"]["code"] == 403
    assert by_path["/api/v1/deny"]["decision"] == "denied"
    assert by_path["/api/v1/deny"]["answer"].message == "denied by test"  # for the audit log
    assert by_path["/api/v1/crash"]["code"] == 500
    assert by_path["/api/v1/crash"]["answer"].reason == "InternalError"
    assert by_path["/api/v1/delay"]["answer"] is None  # relayed, not answered by opgate
    post = by_path["/api/v1/namespaces/a/pods"]
    assert post["code"] == 200
    assert post["in"] == 1234
    assert post["out"] == len(body)
    assert post["upstream"] > 0
    assert post["finished"] > 0
    # the upstream's part of the call fits in the call
    assert post["finished"] - post["started"] >= post["upstream"] - 1e-9
    assert post["error"] == ""
    assert rec.bodies == [None] * 4  # no middleware asked for bodies


@pytest.mark.asyncio
async def test_needs_body_reads_bounded_and_answers_413() -> None:
    up = await AiohttpUpstream(ok_handler).start()
    rec = Recorder(needs_body=True)
    settings = RelaySettings(max_body_bytes=1000)
    try:
        async with running_proxy(up.url, middlewares=(rec,), settings=settings) as proxy:
            async with aiohttp.ClientSession() as c:
                async with c.put(proxy.url + "/api/v1/namespaces/a/pods/p", data=b"y" * 999) as r:
                    assert r.status == 200
                async with c.put(proxy.url + "/api/v1/namespaces/a/pods/p", data=b"z" * 1001) as r:
                    assert r.status == 413
                    assert_status(await r.read(), 413, "RequestEntityTooLarge")

                async def unsized() -> Any:
                    for _ in range(3):
                        yield b"w" * 600

                async with c.put(proxy.url + "/api/v1/namespaces/a/pods/p", data=unsized()) as r:
                    assert r.status == 413
            async with aiohttp.ClientSession() as c, c.get(proxy.url + "/api/v1/pods") as r:
                assert r.status == 200
    finally:
        await up.close()
    assert rec.bodies[0] == b"y" * 999
    assert up.seen[0].body == b"y" * 999
    assert up.seen[0].headers["Content-Length"] == "999"
    assert len(up.seen) == 2


class Picky(Recorder):
    """Needs bodies, but only of the calls whose path ends in ``/want``."""

    def __init__(self) -> None:
        super().__init__(needs_body=True)
        self.asked: list[str] = []

    def wants_body(self, ctx: RequestContext) -> bool:
        self.asked.append(ctx.path)
        return ctx.path.endswith("/want")


@pytest.mark.asyncio
async def test_wants_body_narrows_needs_body_per_call() -> None:
    up = await AiohttpUpstream(ok_handler).start()
    picky = Picky()
    body = b'{"metadata":{"name":"p"}}' * 100
    try:
        async with running_proxy(up.url, middlewares=(picky,)) as proxy:
            async with aiohttp.ClientSession() as c:
                for path in ("/api/v1/namespaces/a/pods/want", "/api/v1/namespaces/a/pods/x"):
                    async with c.put(proxy.url + path, data=body) as r:
                        assert r.status == 200
                async with c.get(proxy.url + "/api/v1/pods") as r:  # no body: not asked
                    assert r.status == 200
    finally:
        await up.close()
    assert picky.asked == ["/api/v1/namespaces/a/pods/want", "/api/v1/namespaces/a/pods/x"]
    assert picky.bodies == [body, None, None]  # read once, streamed once
    assert [s.body for s in up.seen[:2]] == [body, body]  # the same bytes upstream either way
    assert up.seen[0].headers["Content-Length"] == str(len(body))


@pytest.mark.asyncio
async def test_client_gone_before_headers_still_runs_exit_hooks() -> None:
    async def slow(request: web.BaseRequest) -> web.StreamResponse:
        await asyncio.sleep(1)
        return await ok_handler(request)

    up = await AiohttpUpstream(slow).start()
    rec = Recorder()
    try:
        async with running_proxy(up.url, middlewares=(rec,)) as proxy:
            host, port = proxy.listener.address.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.sleep(0.2)
            writer.close()
            await asyncio.wait_for(wait_closed(reader), 5)
            for _ in range(100):
                if rec.exits:
                    break
                await asyncio.sleep(0.02)
    finally:
        await up.close()
    assert rec.exits and rec.exits[0]["code"] == 499


FIRST = b'{"type":"ADDED","object":{}}\n'


def stalling_stream(*, content_type: str = "application/json") -> RawUpstream:
    """Sends the headers and one chunk (one whole watch event, ``FIRST``), then nothing (but
    keeps the connection open)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode()
                     + b"%x\r\n%b\r\n" % (len(FIRST), FIRST))
        await writer.drain()
        await wait_closed(reader)

    return RawUpstream(serve)


@pytest.mark.asyncio
async def test_watch_idle_timeout_ends_the_watch_cleanly() -> None:
    up = await stalling_stream().start()
    loop = asyncio.get_running_loop()
    settings = RelaySettings(watch_idle_timeout=0.4, request_timeout=0.1)
    try:
        async with running_proxy(up.url, settings=settings) as proxy, aiohttp.ClientSession() as c:
            started = loop.time()
            async with c.get(proxy.url + "/api/v1/pods?watch=true") as r:
                assert await asyncio.wait_for(r.read(), 5) == FIRST  # complete, no error
            assert 0.35 < loop.time() - started < 3  # the watch outlived request_timeout
            ended = await asyncio.wait_for(up.closed.get(), 5)
            assert ended - started < 3
    finally:
        await up.close()


@pytest.mark.asyncio
async def test_request_timeout_cuts_a_stalled_non_watch_response() -> None:
    up = await stalling_stream().start()
    loop = asyncio.get_running_loop()
    settings = RelaySettings(request_timeout=0.4)
    try:
        async with running_proxy(up.url, settings=settings) as proxy, aiohttp.ClientSession() as c:
            started = loop.time()
            async with c.get(proxy.url + "/api/v1/pods") as r:
                assert r.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await asyncio.wait_for(r.read(), 5)
            assert 0.35 < loop.time() - started < 3
    finally:
        await up.close()


@pytest.mark.asyncio
async def test_a_refused_expect_continue_call_closes_the_connection() -> None:
    """A call refused before its ``Expect: 100-continue`` body was asked for: the client sends
    no body, so the connection cannot carry another request (the next one would be read as the
    body). The apiserver closes it; so must opgate, and say so."""
    up = await AiohttpUpstream(ok_handler).start()
    try:
        async with running_proxy(up.url, middlewares=(Recorder(),)) as proxy:
            host, port = proxy.listener.address.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /api/v1/namespaces/a/configmaps/deny HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 62\r\n"
                         b"Expect: 100-continue\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 403 ")
            assert b"\r\nconnection: close\r\n" in head.lower()
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            assert b'"Forbidden"' in await reader.readexactly(length)
            writer.write(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")  # too late: it is closed
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
    finally:
        await up.close()


@pytest.mark.asyncio
async def test_a_body_that_stalls_for_a_middleware_times_out() -> None:
    """A middleware wants the body and the client stops sending it halfway: the call ends with
    a 504 Timeout Status after the request timeout and the connection is closed, instead of
    holding the call (and its gauges) for as long as the client likes."""
    up = await AiohttpUpstream(ok_handler).start()
    rec = Recorder(needs_body=True)
    loop = asyncio.get_running_loop()
    try:
        async with running_proxy(up.url, middlewares=(rec,),
                                 settings=RelaySettings(request_timeout=0.5)) as proxy:
            host, port = proxy.listener.address.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /api/v1/namespaces/a/configmaps HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 20\r\n\r\n{\"ki")
            started = loop.time()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert 0.4 < loop.time() - started < 3
            assert head.startswith(b"HTTP/1.1 504 ")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            status = assert_status(await reader.readexactly(length), 504, "Timeout")
            assert "request body" in status["message"]
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed
            writer.close()
    finally:
        await up.close()
    assert rec.bodies == []  # the chain never ran on half a body
    # the relay's own answer: not "allowed" in the access log, the audit log and the metrics
    assert [(e["code"], e["decision"]) for e in rec.exits] == [(504, "error")]


class Gatekeeper:
    """Refuses every call without a token, as identity does, ahead of a body reader."""

    name = "gatekeeper"
    needs_body = False
    fail_open = False

    def entry(self, ctx: RequestContext) -> Deny | None:
        if ctx.headers.get("Authorization"):
            return None
        return Deny(StatusError(401, "no bearer token", "Unauthorized"))


@pytest.mark.asyncio
async def test_a_caller_refused_ahead_of_the_body_readers_sends_no_body() -> None:
    """A middleware ahead of one that reads bodies refuses the call: the answer comes at once,
    without opgate reading (or waiting for) the body; with a token the body is read."""
    up = await AiohttpUpstream(ok_handler).start()
    rec = Recorder(needs_body=True)
    try:
        async with running_proxy(up.url, middlewares=(Gatekeeper(), rec)) as proxy:
            host, port = proxy.listener.address.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /api/v1/namespaces/a/configmaps HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 3000000\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)  # no body sent
            assert head.startswith(b"HTTP/1.1 401 ")
            assert b"\r\nconnection: close\r\n" in head.lower()
            writer.close()
            async with aiohttp.ClientSession() as c:
                async with c.post(proxy.url + "/api/v1/namespaces/a/configmaps", data=b"{}",
                                  headers={"Authorization": "Bearer t"}) as r:
                    assert r.status == 200
    finally:
        await up.close()
    assert rec.bodies == [b"{}"]  # the refused call never reached the body reader
