"""HTTP/1.1 robustness at the edges, on both relay cores, over raw sockets: what a request may
put into a response head, odd framings from clients and upstreams, and malformed requests.

Each test asserts the bytes the client (or the upstream) received, so that both relays give the
same answer and neither lets one side's framing differ from the other's.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from proxy.relay.fast import server as fast_server
from tests.integration.fakes import (
    AiohttpUpstream,
    Policies,
    RawUpstream,
    ok_handler,
    read_head,
    running_proxy,
    wait_closed,
)
from tests.unit.test_identity import FakeAuth, policy, policy_set, sa_token

pytestmark = pytest.mark.usefixtures("each_relay")  # every test on both relay cores


async def raw_call(url: str, request: bytes, *, within: float = 5.0) -> bytes:
    """Send ``request`` as is and read until the proxy closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        return await asyncio.wait_for(reader.read(-1), within)
    finally:
        writer.close()


async def refused(head: bytes) -> tuple[bytes, list[Any]]:
    """``head`` sent through a proxy in front of a fresh upstream: what came back until the
    proxy closed, and what the upstream saw."""
    up = await AiohttpUpstream(ok_handler).start()
    try:
        async with running_proxy(up.url) as proxy:
            return await raw_call(proxy.url, head), up.seen
    finally:
        await up.close()


def split(raw: bytes) -> tuple[bytes, list[tuple[bytes, bytes]], bytes]:
    """The status line, the header lines (name, value) and the body of one response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    pairs = []
    for line in lines:
        name, sep, value = line.partition(b":")
        assert sep, f"not a header line: {line!r}"
        pairs.append((name.strip().lower(), value.strip()))
    return status, pairs, body


@pytest.mark.asyncio
@pytest.mark.parametrize(("namespace", "shown"), [
    ("a%0D%0AX-Injected:%20yes", "a%0D%0AX-Injected: yes"),  # a CR LF from the path
    ("caf%C3%A9%E2%82%AC", "caf%C3%A9%E2%82%AC"),  # beyond latin-1
])
async def test_a_dryrun_warning_holds_no_request_text_that_breaks_the_head(
    tmp_path: Path, namespace: str, shown: str
) -> None:
    """A dryrun identity policy's Warning names the namespace of the path, percent-decoded:
    its CR LF must not end the header (a header of the request's choosing after it), nor may
    a character beyond latin-1 fail the call; the call is relayed, with one Warning."""
    from proxy.middlewares.identity import IdentityCheck

    up = await AiohttpUpstream(ok_handler).start()
    middleware = IdentityCheck(authenticator=FakeAuth())
    policies = Policies(policy_set(tmp_path, policy(mode="dryrun")))
    request = (f"POST /api/v1/namespaces/{namespace}/secrets HTTP/1.1\r\nHost: x\r\n"
               f"Authorization: Bearer {sa_token()}\r\nContent-Type: application/json\r\n"
               "Content-Length: 2\r\nConnection: close\r\n\r\n{}").encode()
    try:
        async with running_proxy(up.url, middlewares=(middleware,),
                                 policies=policies) as proxy:
            raw = await raw_call(proxy.url, request)
    finally:
        await up.close()
    status, headers, body = split(raw)
    assert status.startswith(b"HTTP/1.1 200 "), raw
    assert body == b'{"kind":"Fine"}'
    assert b"x-injected" not in dict(headers)
    warnings = [v for n, v in headers if n == b"warning"]
    assert len(warnings) == 1
    assert warnings[0].isascii()
    assert b'rule \\"no-secrets\\"' in warnings[0]
    assert f'the namespace \\"{shown}\\"'.encode() in warnings[0]
    assert len(up.seen) == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("coding", [b"chunked, identity", b"xchunked"])
async def test_an_upstream_body_not_chunked_last_is_read_until_the_upstream_closes(
    coding: bytes,
) -> None:
    """``Transfer-Encoding`` whose last coding is not ``chunked`` frames a response by the
    connection's end (RFC 9112 6.3, and llhttp): the relay must follow that framing, not read
    the body's bytes as chunk sizes."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                     b"Transfer-Encoding: %b\r\n\r\nhello, " % coding)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"world")

    up = await RawUpstream(serve).start()
    try:
        async with running_proxy(up.url) as proxy:
            raw = await raw_call(proxy.url, b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\n"
                                            b"Connection: close\r\n\r\n")
    finally:
        await up.close()
    status, headers, body = split(raw)
    assert status.startswith(b"HTTP/1.1 200 "), raw
    assert (b"transfer-encoding", b"chunked") in headers  # re-framed for the client
    data, rest = b"", body
    while True:  # the client's chunked body, strictly
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        data, rest = data + rest[:size], rest[size:]
        assert rest[:2] == b"\r\n"
        rest = rest[2:]
        if not size:
            break
    assert data == b"hello, world" and rest == b""


_SMUGGLED = b"GET /api/v1/secrets HTTP/1.1\r\nHost: x\r\n\r\n"


def fields(count: int) -> bytes:
    """``count`` header lines of 60,000 bytes: each well within the line limit (64 KiB)."""
    return b"".join(b"X-Big-%d: %b\r\n" % (i, b"b" * 60_000) for i in range(count))


@pytest.mark.asyncio
@pytest.mark.parametrize(("head", "code"), [
    (b"GET /api/v1/pods?labelSelector=" + b"a" * (70 * 1024) + b" HTTP/1.1\r\nHost: x\r\n\r\n",
     431),
    (b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * (70 * 1024) + b"\r\n\r\n",
     431),
    (b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\n" + b"X-N: 1\r\n" * 600 + b"\r\n", 431),
    # each line within its limit, and far fewer than 512 of them: over 1 MiB in all
    (b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\n" + fields(18) + b"\r\n", 431),
    # no Host in an HTTP/1.1 request, or two (in an HTTP/1.0 one too), as Go's net/http
    (b"GET /api/v1/pods HTTP/1.1\r\nAccept: */*\r\n\r\n", 400),
    (b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\nhost: y\r\n\r\n", 400),
    (b"GET /api/v1/pods HTTP/1.0\r\nHost: x\r\nHost: x\r\n\r\n", 400),
    (b"GET /api/v1/pods HTTP/1.1\r\nHost x\r\n\r\n", 400),
    # the framings a smuggler tries: refused whole, nothing of them relayed
    (b"POST /api/v1/namespaces/a/configmaps HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + _SMUGGLED, 400),
    (b"POST /api/v1/namespaces/a/configmaps HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
     b"Content-Length: %d\r\n\r\n%b" % (len(_SMUGGLED), _SMUGGLED), 400),
    (b"POST /api/v1/namespaces/a/configmaps HTTP/1.1\r\nHost: x\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n0\n\n" + _SMUGGLED, 400),
    (b"GET /api/v1/pods HTTP/1.1\nHost: x\n\n", 400),
])
async def test_malformed_or_oversized_heads_get_a_status_and_nothing_is_relayed(
    head: bytes, code: int
) -> None:
    """Both listeners answer a request they cannot parse with a Kubernetes Status (431 past
    the head's limits, else 400), close, say so (an HTTP/1.1 answer without ``Connection:
    close`` is one the client may send its next request after), and relay none of it."""
    raw, seen = await refused(head)
    status, headers, body = split(raw)
    assert status.split(b" ")[:2] == [b"HTTP/1.1", b"%d" % code], raw[:200]  # (as Go's net/http)
    assert (b"content-type", b"application/json") in headers
    assert (b"connection", b"close") in headers, raw[:300]
    assert b"server" not in dict(headers)  # (aiohttp's "Python/3.11 aiohttp/3.x": not ours)
    got = json.loads(body)
    assert got["kind"] == "Status" and got["code"] == code
    assert got["reason"] == ("BadRequest" if code == 400 else "RequestHeaderFieldsTooLarge")
    assert got["message"].startswith("opgate: ")
    assert seen == []


@pytest.mark.asyncio
@pytest.mark.parametrize(("head", "message"), [
    (b"GET /api/v1/pods HTTP/1.1\r\nAccept: */*\r\n\r\n", "missing required Host header"),
    (b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\nHOST: x\r\n\r\n", "too many Host headers"),
    (b"GET /api/v1/pods HTTP/1.1\r\nHost: api server\r\n\r\n", "malformed Host header"),
    (b"GET /api/v1/pods HTTP/1.1\r\nHost: evil.example/x\r\n\r\n", "malformed Host header"),
    (b"GET /api/v1/pods HTTP/1.1\r\nHost: me@10.0.0.1\r\n\r\n", "malformed Host header"),
    (b"GET /api/v1/pods HTTP/1.1\r\nHost: caf\xc3\xa9.local\r\n\r\n", "malformed Host header"),
    (b"GET /api/v1/pods HTTP/1.0\r\nHost: a\"b\r\n\r\n", "malformed Host header"),
    (b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\n" + fields(18) + b"\r\n",
     "request line or header longer than 65536 bytes, more than 512 headers, or a request head "
     "over 1048576 bytes"),
], ids=["no-host", "two-hosts", "host-space", "host-slash", "host-userinfo", "host-not-ascii",
        "http10-host-quote", "over-1MiB"])
async def test_the_host_and_head_size_refusals_say_what_is_wrong(head: bytes, message: str) -> None:
    """The apiserver (Go's net/http) names these refusals; both listeners name them too."""
    raw, _ = await refused(head)
    assert json.loads(split(raw)[2])["message"] == f"opgate: {message}"


@pytest.mark.asyncio
@pytest.mark.parametrize("head", [
    b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + fields(17)
    + b"\r\n",  # just under 1 MiB in all
    b"GET /api/v1/pods HTTP/1.0\r\n\r\n",  # (Go takes an HTTP/1.0 request without Host)
    # every byte Go's net/http takes in a Host value, and an IPv6 literal with a port
    b"GET /api/v1/pods HTTP/1.1\r\nHost: aZ09!$%&'()*+,-.:;=[]_~\r\nConnection: close\r\n\r\n",
    b"GET /api/v1/pods HTTP/1.1\r\nHost: [::1]:6443\r\nConnection: close\r\n\r\n",
], ids=["just-under-1MiB", "http10-without-host", "host-every-byte-go-takes", "host-ipv6"])
async def test_heads_within_the_limits_are_relayed_whole(head: bytes) -> None:
    got: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen = b""
        while b"\r\n\r\n" not in seen:  # (read_head's StreamReader stops at 64 KiB)
            seen += await reader.read(1 << 16)
        got.append(seen)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
        await writer.drain()
        writer.close()

    up = await RawUpstream(serve).start()
    try:
        async with running_proxy(up.url) as proxy:
            raw = await raw_call(proxy.url, head, within=10)
    finally:
        await up.close()
    assert raw.startswith(b"HTTP/1.") and raw.split(b" ")[1] == b"200", raw[:300]
    (upstream,) = got
    assert upstream.count(b": " + b"b" * 60_000 + b"\r\n") == head.count(b"b" * 60_000)


def head_of(total: int) -> bytes:
    """A request head of exactly ``total`` bytes in all, request line and blank line too."""
    start = b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + fields(17)
    head = start + b"X-Pad: " + b"p" * (total - len(start) - len(b"X-Pad: \r\n\r\n")) + b"\r\n\r\n"
    assert len(head) == total
    return head


@pytest.mark.asyncio
@pytest.mark.parametrize(("over", "code"), [(0, b"200"), (1, b"431"), (12, b"431")])
@pytest.mark.parametrize("pieces", [1, 2, 7])
async def test_the_head_limit_counts_every_byte_of_the_head_on_both_relays(
        over: int, code: bytes, pieces: int) -> None:
    """1 MiB in all is the limit, however many reads the head comes in, on both listeners: the
    fast relay counted the fields and the target alone (not the method, the version, the line
    ends of the request line and of the head), so a head up to ~20 bytes over passed there
    while the aiohttp listener refused it."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen = b""
        while b"\r\n\r\n" not in seen:
            seen += await reader.read(1 << 16)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
        await writer.drain()
        writer.close()

    head = head_of(fast_server.MAX_HEAD + over)
    up = await RawUpstream(serve).start()
    try:
        async with running_proxy(up.url) as proxy:
            host, port = proxy.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            step = -(-len(head) // pieces)
            for at in range(0, len(head), step):
                writer.write(head[at:at + step])
                await writer.drain()
                await asyncio.sleep(0.01)  # each piece a read of its own
            raw = await asyncio.wait_for(reader.read(-1), 10)
            writer.close()
    finally:
        await up.close()
    assert raw.split(b" ")[1] == code, raw[:300]


@pytest.mark.asyncio
async def test_credentials_named_in_connection_are_never_replaced_by_opgates() -> None:
    """A client may list ``Authorization`` in ``Connection`` (so it is hop-by-hop and dropped):
    the call then goes upstream without credentials, never with opgate's ``--token-file``
    token instead (the middlewares judged the client's token, not opgate's)."""
    up = await AiohttpUpstream(ok_handler).start()
    try:
        async with running_proxy(up.url, token="opgate-own-token") as proxy:
            raw = await raw_call(proxy.url, b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\n"
                                            b"Connection: Authorization, close\r\n"
                                            b"Authorization: Bearer client-token\r\n\r\n")
            # and without credentials of its own, the call gets opgate's
            plain = await raw_call(proxy.url, b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\n"
                                              b"Connection: close\r\n\r\n")
    finally:
        await up.close()
    assert raw.startswith(b"HTTP/1.1 200 ") and plain.startswith(b"HTTP/1.1 200 ")
    assert [s.headers.getall("Authorization", []) for s in up.seen] == [
        [], ["Bearer opgate-own-token"]]


@pytest.mark.asyncio
async def test_an_http10_keep_alive_client_gets_a_body_it_can_see_the_end_of() -> None:
    """An HTTP/1.0 client cannot read chunks: an upstream body without a length reaches it
    framed by the connection's end, so the connection must then close even when the client
    asked for keep-alive, or it waits for the end until the idle timeout."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)  # (a kube-apiserver sends every LIST chunked)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
        await reader.read()

    up = await RawUpstream(serve).start()
    try:
        async with running_proxy(up.url) as proxy:
            raw = await raw_call(proxy.url, b"GET /api/v1/pods HTTP/1.0\r\nHost: x\r\n"
                                            b"Connection: keep-alive\r\n\r\n", within=3.0)
    finally:
        await up.close()
    status, headers, body = split(raw)
    assert status.split(b" ")[1] == b"200"
    assert b"transfer-encoding" not in dict(headers) and b"content-length" not in dict(headers)
    assert body == b"{}"


@pytest.mark.asyncio
@pytest.mark.parametrize("sent", [
    b"",  # a connection that never sends a request
    b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\nX-Slow: a",  # a head that never ends
    b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\n\r\n",  # idle after an answer
], ids=["nothing", "unfinished-head", "idle"])
async def test_idle_connections_and_unfinished_heads_are_closed(
    monkeypatch: pytest.MonkeyPatch, sent: bytes
) -> None:
    monkeypatch.setattr(fast_server, "KEEPALIVE", 0.5)
    up = await AiohttpUpstream(ok_handler).start()
    loop = asyncio.get_running_loop()
    try:
        async with running_proxy(up.url) as proxy:
            host, port = proxy.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            started = loop.time()
            writer.write(sent)
            got = await asyncio.wait_for(reader.read(-1), 10)  # until the listener closes
            writer.close()
    finally:
        await up.close()
    assert loop.time() - started < 3
    assert got.startswith(b"HTTP/1.1 200 ") if sent.endswith(b"\r\n\r\n") else got == b""


class _ReadsBodies:
    """A middleware that reads every body (as quota and the instance lookup read creates)."""

    name, needs_body, fail_open = "reads-bodies", True, False

    def entry(self, ctx: Any) -> None:
        return None


@pytest.mark.asyncio
@pytest.mark.parametrize(("method", "body", "answer", "sent"), [
    (b"POST", b"", "503", 1),
    (b"POST", b'{"kind":"ConfigMap"}', "503", 1),  # read whole for a middleware
    (b"PATCH", b'{"data":{}}', "503", 1),
    (b"GET", b"", "200", 2),  # (a stale keep-alive connection: once more on a fresh one)
])
async def test_a_call_the_upstream_dropped_unanswered_is_sent_again_only_if_idempotent(
    method: bytes, body: bytes, answer: str, sent: int
) -> None:
    """When the upstream closes a reused connection after reading a call but without an
    answer, it may have acted on it: a POST or PATCH sent again could create a second object
    (generateName). Only an idempotent call is retried (as Go's and aiohttp's clients do);
    the others get a 503 and the client decides."""
    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            line, headers = await read_head(reader)
            data = await reader.readexactly(int(headers.get("content-length", "0")))
            if "/drop" in line:
                seen.append(data)
                if len(seen) == 1:
                    return  # read, perhaps acted on, and dropped without an answer
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()

    up = await RawUpstream(serve).start()
    call = (b"%b /api/v1/namespaces/a/configmaps/drop HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
            % (method, len(body), body))
    get = b"GET /api/v1/namespaces/a/configmaps HTTP/1.1\r\nHost: x\r\n\r\n"
    try:
        async with running_proxy(up.url, middlewares=(_ReadsBodies(),)) as proxy:
            host, port = proxy.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            answers = []
            for request in (get, call, get):  # the call on the GET's kept-alive connection
                writer.write(request)
                status, headers = await asyncio.wait_for(read_head(reader), 10)
                await reader.readexactly(int(headers["content-length"]))
                answers.append(status.split(" ")[1])
            writer.close()
    finally:
        await up.close()
    assert answers == ["200", answer, "200"]
    assert seen == [body] * sent


@pytest.mark.asyncio
@pytest.mark.parametrize(("version", "interim"), [(b"1.1", True), (b"1.0", False)])
async def test_expect_100_continue_is_answered_only_to_http11_clients(
    version: bytes, interim: bool
) -> None:
    """An HTTP/1.0 client knows no 1xx answers (it would take a 100 for the response): its
    ``Expect: 100-continue`` is ignored, as RFC 9110 wants; an HTTP/1.1 client gets the 100
    before it sends the body."""
    up = await AiohttpUpstream(ok_handler).start()
    try:
        async with running_proxy(up.url) as proxy:
            host, port = proxy.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /api/v1/namespaces/a/configmaps HTTP/%b\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nExpect: 100-continue\r\n"
                         b"Content-Length: 2\r\nConnection: close\r\n\r\n" % version)
            if interim:
                assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == (
                    b"HTTP/1.1 100 Continue\r\n\r\n")
            else:  # the 1.0 client waits a while, then sends the body anyway
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.5)
            writer.write(b"{}")
            raw = await asyncio.wait_for(reader.read(-1), 5)
            writer.close()
    finally:
        await up.close()
    status, _, body = split(raw)
    assert status.split(b" ")[1] == b"200" and body == b'{"kind":"Fine"}'
    assert [s.body for s in up.seen] == [b"{}"]


@pytest.mark.asyncio
@pytest.mark.parametrize("bad", [
    b"GET /api/v1/pods HTTP/1.1\r\nHost x\r\n\r\n",
    b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * (70 * 1024) + b"\r\n\r\n",
    b"POST /api/v1/namespaces/a/configmaps HTTP/1.1\r\nHost: x\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\nzz\r\n",  # its body breaks
], ids=["malformed-head", "oversized-head", "malformed-body"])
async def test_a_malformed_pipelined_request_is_answered_after_the_calls_before_it(
    bad: bytes,
) -> None:
    """A client that pipelines a malformed request behind a call still in flight reads the
    answers in order: the call's own, then the refusal (a refusal first would be read as the
    answer to a call the upstream carried out)."""
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, headers = await read_head(reader)
        await reader.readexactly(int(headers.get("content-length", "0")))
        await asyncio.sleep(0.3)
        writer.write(b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 2\r\n\r\n{}")
        await writer.drain()
        await reader.read()

    up = await RawUpstream(slow).start()
    try:
        async with running_proxy(up.url) as proxy:
            host, port = proxy.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /api/v1/namespaces/a/configmaps HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
            await asyncio.sleep(0.1)  # the call is on its way upstream
            writer.write(bad)
            raw = await asyncio.wait_for(reader.read(-1), 5)
            writer.close()
    finally:
        await up.close()
    assert raw.startswith(b"HTTP/1.1 201 Created\r\n"), raw[:300]
    rest = raw.partition(b"\r\n\r\n{}")[2]
    assert rest.split(b" ")[1] in (b"400", b"431"), raw[:300]
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["kind"] == "Status"
    assert up.connections == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("line", [b"GET /api/v1/pods HTTP/2.0", b"GET /api/v1/pods"])
async def test_a_request_line_of_another_http_version_gets_505(line: bytes) -> None:
    """llhttp (both listeners' parser) takes HTTP/2.0 and HTTP/0.9 request lines; the apiserver
    answers those 505, and so does opgate, relaying nothing (aiohttp answered "HTTP/2.0 200"),
    in an HTTP/1.1 status line (aiohttp's core echoed "HTTP/2.0 505")."""
    up = await AiohttpUpstream(ok_handler).start()
    try:
        async with running_proxy(up.url) as proxy:
            raw = await raw_call(proxy.url, line + b"\r\nHost: x\r\n\r\n")
    finally:
        await up.close()
    status, _, body = split(raw)
    assert status == b"HTTP/1.1 505 HTTP Version Not Supported", raw[:200]
    got = json.loads(body)
    assert got["kind"] == "Status" and got["code"] == 505
    assert up.seen == []


class _SeesHeaders(_ReadsBodies):
    def __init__(self) -> None:
        self.seen: list[str | None] = []

    def entry(self, ctx: Any) -> None:
        self.seen.append(ctx.headers.get("X-Trailer"))


@pytest.mark.asyncio
@pytest.mark.parametrize("reads_body", [True, False])
async def test_request_trailers_never_become_headers(reads_body: bool) -> None:
    """A chunked request body's trailer fields are not headers: neither the middlewares nor
    the upstream see them as such (the upstream head is built after them when the body is read
    whole, or came in the same read as the head)."""
    up = await AiohttpUpstream(ok_handler).start()
    middleware = _SeesHeaders()
    try:
        async with running_proxy(up.url, middlewares=(middleware,) if reads_body else ()) as proxy:
            raw = await raw_call(proxy.url, b"POST /api/v1/namespaces/a/configmaps HTTP/1.1\r\n"
                                            b"Host: x\r\nContent-Type: application/json\r\n"
                                            b"Transfer-Encoding: chunked\r\n"
                                            b"Connection: close\r\n\r\n"
                                            b"2\r\n{}\r\n0\r\nX-Trailer: t\r\n\r\n")
    finally:
        await up.close()
    assert raw.startswith(b"HTTP/1.1 200 "), raw[:200]
    assert [(s.body, "X-Trailer" in s.headers) for s in up.seen] == [(b"{}", False)]
    assert middleware.seen == ([None] if reads_body else [])


@pytest.mark.asyncio
@pytest.mark.parametrize("coding", [
    b"gzip, chunked", b"identity, chunked", b"gzip", b"identity",
    # not chunked last: llhttp refuses the framing itself (a smuggler's, followed by a request)
    b"chunked, identity", b"chunked, gzip",
])
async def test_a_request_body_with_another_transfer_coding_gets_501(coding: bytes) -> None:
    """llhttp takes any codings that end in chunked; relayed as plain chunked, the body's other
    coding would be lost (the upstream would read gzip bytes as JSON). The apiserver (Go's
    net/http) answers 501 to any value but chunked, and so does opgate on both cores, relaying
    nothing (a coding list not ended by chunked was a 400, and a lone gzip on the aiohttp
    core)."""
    up = await AiohttpUpstream(ok_handler).start()
    try:
        async with running_proxy(up.url) as proxy:
            raw = await raw_call(proxy.url, b"POST /api/v1/namespaces/a/configmaps HTTP/1.1\r\n"
                                            b"Host: x\r\nContent-Type: application/json\r\n"
                                            b"Transfer-Encoding: %b\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
                                            % coding)
    finally:
        await up.close()
    status, _, body = split(raw)
    assert status.split(b" ")[1] == b"501", raw[:200]
    got = json.loads(body)
    assert got["kind"] == "Status" and got["code"] == 501
    assert up.seen == []


class _DeniesHead:
    name, needs_body, fail_open = "denies-head", False, False

    def entry(self, ctx: Any) -> Any:
        from proxy.engine.context import Deny
        from proxy.engine.status import forbidden

        return Deny(forbidden("no HEAD here")) if ctx.method == "HEAD" else None


@pytest.mark.asyncio
async def test_opgates_own_answer_to_a_head_request_has_no_body() -> None:
    """A HEAD answer has no body, whatever its Content-Length says: a Status body sent after
    opgate's own answer (a denial, a 503) would be read as the next response on the
    connection."""
    up = await AiohttpUpstream(ok_handler).start()
    try:
        async with running_proxy(up.url, middlewares=(_DeniesHead(),)) as proxy:
            host, port = proxy.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"HEAD /api/v1/pods HTTP/1.1\r\nHost: x\r\n\r\n"
                         b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            first, headers = await asyncio.wait_for(read_head(reader), 5)
            rest = await asyncio.wait_for(reader.read(-1), 5)
            writer.close()
    finally:
        await up.close()
    assert first.startswith("HTTP/1.1 403 ") and int(headers["content-length"]) > 0
    assert rest.startswith(b"HTTP/1.1 200 "), rest[:200]  # the GET's answer, right after
    assert rest.endswith(b'\r\n\r\n{"kind":"Fine"}')


@pytest.mark.asyncio
async def test_hop_by_hop_opgate_and_impersonation_headers_never_reach_the_upstream() -> None:
    """What the upstream gets of a request full of headers that must not pass (in any case):
    hop-by-hop ones and those ``Connection`` names, ``Proxy-*``, opgate's own, the identities
    of the apiserver's request-header authenticator (``X-Remote-*``: only a front proxy sends
    them) and ``Impersonate-*`` (no policy allows it), with the client told about the last."""
    up = await AiohttpUpstream(ok_handler).start()
    try:
        async with running_proxy(up.url) as proxy:
            raw = await raw_call(proxy.url, b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\n"
                                            b"Connection: X-Hop, close\r\nX-Hop: 1\r\n"
                                            b"Keep-Alive: timeout=5\r\nPROXY-AUTHORIZATION: b\r\n"
                                            b"Proxy-Connection: keep-alive\r\nTE: trailers\r\n"
                                            b"Trailer: X-T\r\nUpgrade: h2c\r\n"
                                            b"iMpErSoNaTe-UsEr: admin\r\nIMPERSONATE-GROUP: g\r\n"
                                            b"impersonate-extra-scopes: s\r\nImpersonate-Uid: u\r\n"
                                            b"Opgate-Instance: a/w/b\r\nOPGATE-OTHER: 1\r\n"
                                            b"X-Remote-User: admin\r\nx-remote-group: g\r\n"
                                            b"X-REMOTE-UID: 1\r\nX-Remote-Extra-Scopes: s\r\n"
                                            b"X-Kept: yes\r\n\r\n")
    finally:
        await up.close()
    assert raw.startswith(b"HTTP/1.1 200 ")
    _, headers, _ = split(raw)
    assert any(n == b"warning" and b"Impersonate-* headers dropped" in v for n, v in headers)
    (seen,) = up.seen
    host = up.url.removeprefix("http://")
    got = sorted((k.lower(), v) for k, v in seen.headers.items())
    # and opgate's own Audit-ID (the client sent none): the apiserver logs the call by it
    assert [k for k, v in got if k == "audit-id" and v] == ["audit-id"], got
    # and the caller's address in X-Forwarded-For (test_the_callers_address_is_appended_...)
    assert [(k, v) for k, v in got if k != "audit-id"] == [
        ("host", host), ("x-forwarded-for", "127.0.0.1"), ("x-kept", "yes")]


@pytest.mark.asyncio
@pytest.mark.parametrize("switch", [False, True], ids=["answered", "switched"])
async def test_the_body_of_an_upgrade_request_is_relayed_as_its_body(switch: bool) -> None:
    """``curl --http2`` asks a plain-HTTP server to upgrade to h2c on any request, a POST with
    its body too. That body is the request's (framed by its Content-Length), not the start of
    the tunnel: the upstream gets it as the body, whether it then switches or just answers."""
    got: dict[str, bytes] = {}

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, headers = await read_head(reader)
        got["body"] = await reader.readexactly(int(headers.get("content-length", "0")))
        if not switch:
            writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
            return
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
                     b"Upgrade: h2c\r\n\r\n")
        got["tunnel"] = await reader.readexactly(4)
        writer.write(got["tunnel"])
        await writer.drain()
        await reader.read()

    up = await RawUpstream(serve).start()
    body = b'{"kind":"ConfigMap","metadata":{"name":"c"}}'
    try:
        async with running_proxy(up.url) as proxy:
            host, port = proxy.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /api/v1/namespaces/a/configmaps HTTP/1.1\r\nHost: x\r\n"
                         b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                         b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                         % (len(body), body[:10]))
            await asyncio.sleep(0.05)
            writer.write(body[10:])  # the rest of the body in a read of its own
            status, _ = await asyncio.wait_for(read_head(reader), 5)
            if switch:  # (clients send tunnel bytes once they see the 101)
                writer.write(b"PING")
            echo = await asyncio.wait_for(reader.readexactly(4 if switch else 2), 5)
            writer.close()
    finally:
        await up.close()
    assert got["body"] == body
    if switch:
        assert status.startswith("HTTP/1.1 101 ") and got["tunnel"] == echo == b"PING"
    else:
        assert status.startswith("HTTP/1.1 201 ") and echo == b"{}"


@pytest.mark.asyncio
async def test_a_response_nobody_asked_for_never_lends_a_connection_twice() -> None:
    """An upstream that sends a second response right behind the first (in the same read):
    the connection must not go back to the pool a second time, or two calls would be sent on
    it at once and read each other's answers."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            line, _ = await read_head(reader)
            path = line.split(" ")[1].encode()
            answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(path), path)
            if path.endswith(b"/first"):
                answer += b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nextra"
            writer.write(answer)
            await writer.drain()

    up = await RawUpstream(serve).start()

    async def call(url: str, path: str) -> bytes:
        raw = await raw_call(url, b"GET %b HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                                  % path.encode(), within=10)
        return split(raw)[2]

    try:
        async with running_proxy(up.url) as proxy:
            assert await call(proxy.url, "/api/v1/first") == b"/api/v1/first"
            paths = [f"/api/v1/namespaces/n{i}/pods" for i in range(4)]
            got = await asyncio.gather(*(call(proxy.url, p) for p in paths))
    finally:
        await up.close()
    assert got == [p.encode() for p in paths]


class _NamesCalls:
    """Records each call's trace id; denies ``/denied`` paths (an answer of opgate's own)."""

    name, needs_body, fail_open = "names-calls", False, False

    def __init__(self) -> None:
        self.trace_ids: list[str] = []

    def entry(self, ctx: Any) -> Any:
        from proxy.engine.context import Deny
        from proxy.engine.status import forbidden

        self.trace_ids.append(ctx.trace_id)
        return Deny(forbidden("not here")) if ctx.path.endswith("/denied") else None


@pytest.mark.asyncio
async def test_the_audit_id_names_the_call_upstream_and_on_opgates_own_answers() -> None:
    """As the apiserver takes it: the client's ``Audit-ID`` goes upstream as it is (once); a
    call without one gets opgate's trace id, so the apiserver's audit log names it as opgate's
    does; opgate's own answers carry ``Audit-Id`` as the apiserver's do."""
    names = _NamesCalls()
    up = await AiohttpUpstream(ok_handler).start()
    try:
        async with running_proxy(up.url, middlewares=(names,)) as proxy:
            def get(path: bytes, audit_id: bytes = b"") -> Any:
                own = b"Audit-ID: %b\r\n" % audit_id if audit_id else b""
                return raw_call(proxy.url, b"GET %b HTTP/1.1\r\nHost: x\r\n%b"
                                           b"Connection: close\r\n\r\n" % (path, own))

            plain = await get(b"/api/v1/pods")
            own = await get(b"/api/v1/pods", b"mine-1")
            denied = await get(b"/api/v1/denied")
            denied_own = await get(b"/api/v1/denied", b"mine-2")
    finally:
        await up.close()
    assert plain.startswith(b"HTTP/1.1 200 ") and own.startswith(b"HTTP/1.1 200 ")
    first, second = up.seen
    assert first.headers.getall("Audit-ID") == [names.trace_ids[0]]
    assert second.headers.getall("Audit-ID") == ["mine-1"]
    for raw, want in ((denied, names.trace_ids[2]), (denied_own, "mine-2")):
        assert raw.startswith(b"HTTP/1.1 403 "), raw[:200]
        _, headers, _ = split(raw)
        assert [v for n, v in headers if n == b"audit-id"] == [want.encode()]


WS_TOKEN = "base64url.bearer.authorization.k8s.io." + "c2VjcmV0LXRva2Vu"  # "secret-token"


@pytest.mark.asyncio
@pytest.mark.parametrize("identity", [False, True])
async def test_a_websocket_subprotocol_token_is_never_joined_by_opgates(
        tmp_path: Path, identity: bool) -> None:
    """A WebSocket client (a browser) may send its bearer token as a subprotocol: the call
    then goes upstream with that header as sent and without opgate's ``--token-file`` token,
    which the apiserver would read first (and run the call as opgate). With the identity
    middleware the subprotocol's token is the caller's."""
    from proxy.middlewares.identity import IdentityCheck

    heads: list[bytes] = []

    async def upgrade(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while head := await reader.readuntil(b"\r\n\r\n"):
            heads.append(head)
            if b"Upgrade: websocket" in head:
                writer.write(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
                             b"Upgrade: websocket\r\nSec-WebSocket-Protocol: v4.channel.k8s.io"
                             b"\r\n\r\n")
                await writer.drain()
                await reader.read()  # until the client's end
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")

    up = await RawUpstream(upgrade).start()
    token = sa_token()
    encoded = base64.urlsafe_b64encode(token.encode()).rstrip(b"=")
    protocols = b"v4.channel.k8s.io, base64url.bearer.authorization.k8s.io." + encoded
    middlewares = (IdentityCheck(authenticator=FakeAuth()),) if identity else ()
    policies = Policies(policy_set(tmp_path, policy())) if identity else None
    upgrade_request = (b"GET /api/v1/namespaces/team-a/configmaps?watch=true "  # (a browser's)
                       b"HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                       b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZQ==\r\n"
                       b"Sec-WebSocket-Protocol: " + protocols + b"\r\n"
                       b"Sec-WebSocket-Protocol: base64.channel.k8s.io\r\n\r\n")
    try:
        async with running_proxy(up.url, token="opgate-own-token", middlewares=middlewares,
                                 policies=policies) as proxy:
            host, port = proxy.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(upgrade_request)
            status, _ = await read_head(reader)
            writer.close()
            if not identity:  # (the identity policy's rules do not allow these two)
                # a plain call with such a header (the apiserver ignores it there) is the
                # client's, not opgate's, too; one with other subprotocols only is opgate's
                plain = await raw_call(proxy.url, b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\n"
                                                  b"Sec-WebSocket-Protocol: " + WS_TOKEN.encode()
                                                  + b", x\r\nConnection: close\r\n\r\n")
                other = await raw_call(proxy.url, b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\n"
                                                  b"Sec-WebSocket-Protocol: v4.channel.k8s.io"
                                                  b"\r\nConnection: close\r\n\r\n")
                assert plain.startswith(b"HTTP/1.1 200 ") and other.startswith(b"HTTP/1.1 200 ")
    finally:
        await up.close()
    assert status.startswith("HTTP/1.1 101"), status
    lines = [line.lower() for line in heads[0].split(b"\r\n")]
    assert not [line for line in lines if line.startswith(b"authorization:")]
    assert [line for line in heads[0].split(b"\r\n")
            if line.lower().startswith(b"sec-websocket-protocol:")] == [
        b"Sec-WebSocket-Protocol: " + protocols,
        b"Sec-WebSocket-Protocol: base64.channel.k8s.io"]
    if not identity:
        assert b"authorization:" not in heads[1].lower()
        assert b"\r\nAuthorization: Bearer opgate-own-token\r\n" in heads[2]


@pytest.mark.asyncio
@pytest.mark.parametrize("read_by", ["relayed", "middleware"])
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_compressed_request_body_reaches_the_upstream_as_sent(
    framing: str, read_by: str
) -> None:
    """``Content-Encoding`` is end-to-end: the body goes up byte for byte, still compressed,
    with the client's own ``Content-Encoding``, and the apiserver decides (it answers 400:
    it reads no compressed request). aiohttp's server inflated it: the upstream got the JSON
    under ``Content-Encoding: gzip``, cut at the compressed length (or, shorter than it, never
    finished: a 504 after the header timeout)."""
    body = gzip.compress(json.dumps({"kind": "ConfigMap", "data": {"k": "v" * 4000}}).encode())
    seen: list[tuple[dict[str, str], bytes]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, headers = await read_head(reader)
        if "content-length" in headers:
            data = await reader.readexactly(int(headers["content-length"]))
        else:  # chunked
            data = b""
            while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
                data += (await reader.readexactly(size + 2))[:-2]
            await reader.readuntil(b"\r\n")
        seen.append((headers, data))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
        await writer.drain()

    up = await RawUpstream(serve).start()
    if framing == "chunked":
        framed = b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
    else:
        framed = b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    middlewares = (_ReadsBodies(),) if read_by == "middleware" else ()
    try:
        async with running_proxy(up.url, middlewares=middlewares) as proxy:
            got = await raw_call(proxy.url, b"POST /api/v1/namespaces/a/configmaps HTTP/1.1\r\n"
                                 b"Host: x\r\nContent-Type: application/json\r\n"
                                 b"Content-Encoding: gzip\r\nConnection: close\r\n" + framed)
    finally:
        await up.close()
    assert got.startswith(b"HTTP/1.1 200 "), got[:200]
    [(headers, data)] = seen
    assert headers["content-encoding"] == "gzip"
    assert data == body


class _DeniesPosts:
    name, needs_body, fail_open = "denies-posts", False, False

    def entry(self, ctx: Any) -> Any:
        from proxy.engine.context import Deny
        from proxy.engine.status import forbidden

        return Deny(forbidden("no POST here")) if ctx.method == "POST" else None


@pytest.mark.asyncio
@pytest.mark.parametrize("by", ["apiserver", "opgate"])
async def test_an_answer_before_the_whole_body_reaches_a_client_still_sending_it(by: str) -> None:
    """The apiserver answers a body it will not read at once (413 past its 3 MiB, 401 for a
    bad token), as opgate answers a denial: the client, still sending the body, must get that
    answer. The connection was closed with the rest of the body unread: the kernel resets it,
    and the reset could overtake the answer (kubectl creating a 15 MB ConfigMap on the
    plain-HTTP listener got 'write: connection reset by peer' one time in six, never the
    apiserver's 'Request entity too large'). Now the answer says ``Connection: close`` and the
    rest of the body is read and dropped until the client closes (as Go's net/http lingers),
    for a bounded time."""
    refusal = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                          "message": "Request entity too large: limit is 3145728",
                          "reason": "RequestEntityTooLarge", "code": 413}).encode()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)  # and none of the body: as Go's net/http, answer, then linger
        writer.write(b"HTTP/1.1 413 Request Entity Too Large\r\nContent-Type: application/json"
                     b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%b"
                     % (len(refusal), refusal))
        await writer.drain()
        while await reader.read(1 << 20):
            pass

    up = await RawUpstream(serve).start()
    body = b"x" * (32 * 1024 * 1024)
    middlewares = (_DeniesPosts(),) if by == "opgate" else ()
    try:
        async with running_proxy(up.url, middlewares=middlewares) as proxy:
            host, port = proxy.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            # a client that sends the whole body before it reads (the answer waits meanwhile)
            writer.write(b"POST /api/v1/namespaces/a/configmaps HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                         % len(body))
            writer.write(body)
            await asyncio.wait_for(writer.drain(), 10)
            status, headers = await asyncio.wait_for(read_head(reader), 10)
            answer = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])),
                                            10)
            writer.close()
    finally:
        await up.close()
    code = "413" if by == "apiserver" else "403"
    assert status.startswith(f"HTTP/1.1 {code} "), status
    assert json.loads(answer)["code"] == int(code)


@pytest.mark.asyncio
@pytest.mark.parametrize("fields", [
    b"".join(b'Warning: 299 - "webhook says %d"\r\n' % i for i in range(300)),  # > 128 fields
    b"X-Big: " + b"b" * (200 * 1024) + b"\r\n",  # a field past 64 KiB
    b"".join(b"X-Big-%d: %b\r\n" % (i, b"b" * 60_000) for i in range(16)),  # ~960 KB in all
])
async def test_a_response_head_up_to_1_mib_is_relayed_whole(fields: bytes) -> None:
    """Go's client takes a response head up to 10 MB, so the apiserver's proxy passes a
    backend's on, and its own Warning headers are one field per warning: the fast core relays
    a head up to 1 MiB; the aiohttp core answered a call done upstream 503 past 128 fields or
    past 64 KiB in one ('Too many headers received'), a create made and reported failed."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n" + fields
                     + b"Content-Length: 2\r\n\r\n{}")
        await writer.drain()
        await wait_closed(reader)

    up = await RawUpstream(serve).start()
    try:
        async with running_proxy(up.url) as proxy:
            raw = await raw_call(proxy.url, b"POST /api/v1/namespaces/a/configmaps HTTP/1.1\r\n"
                                            b"Host: x\r\nContent-Length: 2\r\n"
                                            b"Connection: close\r\n\r\n{}")
    finally:
        await up.close()
    status, _, body = split(raw)
    assert status.startswith(b"HTTP/1.1 201 "), raw[:500]
    assert fields in raw and body == b"{}"


@pytest.mark.asyncio
@pytest.mark.parametrize(("sent", "seen"), [
    (b"", ["127.0.0.1"]),
    (b"X-Forwarded-For: 10.0.0.1\r\nx-forwarded-for: 10.0.0.2, 10.0.0.3\r\n",
     ["10.0.0.1, 10.0.0.2, 10.0.0.3, 127.0.0.1"]),
    (b"Connection: X-Forwarded-For, close\r\nX-Forwarded-For: 10.0.0.1\r\n", ["127.0.0.1"]),
])
async def test_the_callers_address_is_appended_to_x_forwarded_for(
        sent: bytes, seen: list[str], tmp_path: Path) -> None:
    """As kubectl proxy and Go's ReverseProxy forward a call: the caller's address is appended
    to ``X-Forwarded-For`` (the client's values first, joined in one header; none that its
    ``Connection`` names), so the apiserver's audit ``sourceIPs`` ends with the real caller and
    then opgate, whatever the client wrote; on a Unix socket, which has no address, the
    client's header goes as it came."""
    up = await AiohttpUpstream(ok_handler).start()
    request = (b"GET /api/v1/pods HTTP/1.1\r\nHost: localhost\r\n" + sent
               + (b"" if b"Connection:" in sent else b"Connection: close\r\n") + b"\r\n")
    socket = str(tmp_path / "api.sock")
    try:
        async with running_proxy(up.url) as proxy:
            raw = await raw_call(proxy.url, request)
        async with running_proxy(up.url, listen=f"unix:{socket}"):
            reader, writer = await asyncio.open_unix_connection(socket)
            writer.write(request)
            on_socket = await asyncio.wait_for(reader.read(-1), 5)
            writer.close()
    finally:
        await up.close()
    assert raw.startswith(b"HTTP/1.1 200 ") and on_socket.startswith(b"HTTP/1.1 200 ")
    tcp, unix = up.seen
    assert tcp.headers.getall("X-Forwarded-For", []) == seen
    named = b"Connection: X-Forwarded-For" in sent
    assert unix.headers.getall("X-Forwarded-For", []) == (
        [] if named else [v.strip() for line in sent.decode().split("\r\n") if line
                          for v in [line.partition(":")[2]]])
