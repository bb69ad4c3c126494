"""Upgrades (exec, attach, port-forward): after the upstream's 101, a raw byte tunnel both ways.

kubectl speaks SPDY/3.1 (``Upgrade: SPDY/3.1``) or WebSocket; opgate parses neither. It opens its
own connection to the apiserver (same TLS context, ALPN ``http/1.1``), writes the request head
itself, reads the response head, and on ``101`` answers the client with the upstream's headers
and then copies bytes untouched until either side closes. Any other answer is relayed as a normal
response and the client connection is closed after it.

Taking over aiohttp's server connection, the way ``WebSocketResponse`` does: it installs a reader
with ``request.protocol.set_parser(reader)``, after which the protocol feeds every byte the client
sends to ``reader.feed_data(data)`` and calls ``reader.feed_eof()`` when the connection is lost,
instead of parsing HTTP. aiohttp's HTTP parser only switches itself into "upgraded" mode for
``websocket``; for ``SPDY/3.1`` it would try to parse the client's frames as the next request.
Installing the reader *before* the 101 is sent makes both cases equal: clients send no frame
before they see the 101, and for websocket the parser's buffered tail (if any) is handed to the
reader by ``set_parser`` itself. Writes to the client go through the prepared 101 response, which
has neither length nor chunking, so they are raw bytes with aiohttp's own flow control.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from typing import TYPE_CHECKING, cast

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from proxy.engine.context import RequestContext
from proxy.engine.status import service_unavailable
from proxy.relay import errors, tlsconnect
from proxy.relay.endpoint import Endpoint
from proxy.relay.headers import response_headers
from proxy.relay.response import RelayResponse, abort, read_body

if TYPE_CHECKING:
    from proxy.relay.handler import Relay

__all__ = ["relay_upgrade"]

READ_SIZE = 2**16
HIGH_WATER = 2**18  # pause reading the client while this much waits for the upstream
_NO_BODY = frozenset({101, 204, 304})


class _ClientToUpstream:
    """Installed as the aiohttp protocol's payload parser: client bytes go straight upstream."""

    def __init__(self, writer: asyncio.StreamWriter, client: asyncio.Transport) -> None:
        self._writer = writer
        self._client = client
        self._paused = False
        self._drainer: asyncio.Task[None] | None = None
        self.received = 0

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        transport = self._writer.transport
        if transport.is_closing():
            return False, b""
        self.received += len(data)
        transport.write(data)
        if not self._paused and transport.get_write_buffer_size() > HIGH_WATER:
            self._paused = True
            self._client.pause_reading()
            self._drainer = asyncio.get_running_loop().create_task(self._drain())
        return False, b""

    def feed_eof(self) -> None:
        """The client connection is gone: end the upstream side too."""
        self._writer.close()

    async def _drain(self) -> None:
        try:
            await self._writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self._paused = False
            if not self._client.is_closing():
                self._client.resume_reading()


async def relay_upgrade(
    relay: Relay, request: web.BaseRequest, ctx: RequestContext
) -> web.StreamResponse:
    """Relay one upgrade request; returns once the tunnel (or the refusal) is over."""
    endpoint = relay.endpoint
    settings = relay.settings
    body = b""
    if ctx.body is not None:
        body = ctx.body
    elif request.body_exists:  # unusual for an upgrade, but relay it (bounded)
        async with errors.body_within(settings.request_timeout):
            body = await read_body(request, limit=settings.max_body_bytes)
    headers = relay.upstream_headers(request, ctx, upgrade=True)
    headers["Host"] = endpoint.host_header
    if body or "Content-Length" in headers:
        headers["Content-Length"] = str(len(body))
    head = _request_head(ctx.method, endpoint.prefix + request.raw_path, headers) + body
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        async with asyncio.timeout(settings.connect_timeout or None):
            reader, writer = await _open_upstream(endpoint, relay.tls_for(request.headers))
    except TimeoutError as e:
        timeout = aiohttp.ConnectionTimeoutError("connect timed out")
        raise errors.upstream_failed(timeout, ctx, endpoint.base, sent=False) from e
    except (OSError, ssl.SSLError) as e:
        raise errors.upstream_failed(e, ctx, endpoint.base, sent=False) from e
    try:
        writer.write(head)
        try:
            async with asyncio.timeout(settings.header_timeout or None):
                raw_head = await reader.readuntil(b"\r\n\r\n")
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            raise errors.upstream_failed(ConnectionResetError(str(e)), ctx, endpoint.base) from e
        except TimeoutError as e:
            raise errors.upstream_failed(e, ctx, endpoint.base) from e
        ctx.upstream_seconds = loop.time() - started
        relay.observe_upstream(ctx.info.verb, ctx.upstream_seconds)
        code, reason, up_headers = _parse_head(raw_head)
        if ctx.tap is not None:
            ctx.tap.response_head(code, reason, up_headers.items())
        if code == 101:
            return await _tunnel(request, ctx, reader, writer, code, reason, up_headers)
        return await _relay_refusal(request, ctx, reader, code, reason, up_headers)
    finally:
        writer.close()


class _StreamProtocol(asyncio.StreamReaderProtocol):
    """A StreamReaderProtocol that keeps the transport it is given (the TLS one, over TLS)."""

    transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        super().connection_made(transport)


async def _open_upstream(
    endpoint: Endpoint, tls: ssl.SSLContext | None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """``asyncio.open_connection`` to the upstream, over TLS (``tls``: ``Relay.tls_for``) with
    asyncio's own TLS layer whichever loop runs (``proxy.relay.tlsconnect`` says why)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=READ_SIZE * 2, loop=loop)
    protocol = _StreamProtocol(reader, loop=loop)
    await tlsconnect.open_connection(protocol, endpoint.host, endpoint.port, tls=tls,
                                     server_hostname=endpoint.server_name)
    assert protocol.transport is not None
    return reader, asyncio.StreamWriter(protocol.transport, protocol, reader, loop)


async def _tunnel(
    request: web.BaseRequest,
    ctx: RequestContext,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    code: int,
    reason: str,
    up_headers: CIMultiDict[str],
) -> web.StreamResponse:
    client = request.transport
    if client is None:
        raise ConnectionResetError("client connection lost")
    resp = RelayResponse(
        status=code,
        reason=reason,
        headers=response_headers(up_headers, extra=ctx.response_headers, upgrade=True),
    )
    resp.force_close()  # the connection is the tunnel's now; never reused for HTTP
    sink = _ClientToUpstream(writer, client)
    # installed before the 101 goes out, so no client frame can slip past it
    request.protocol.set_parser(sink)  # type: ignore[arg-type]
    await resp.prepare(request)
    ctx.status_code = code
    sent = 0
    try:
        while True:
            try:
                data = await reader.read(READ_SIZE)
            except (OSError, ssl.SSLError):
                break
            if not data:
                break
            sent += len(data)
            await resp.write(data)
    except ConnectionError:
        ctx.error = "client went away"
    finally:
        ctx.bytes_out = sent
        ctx.bytes_in = sink.received
    with contextlib.suppress(ConnectionError):
        await resp.write_eof()
    return resp


async def _relay_refusal(
    request: web.BaseRequest,
    ctx: RequestContext,
    reader: asyncio.StreamReader,
    code: int,
    reason: str,
    up_headers: CIMultiDict[str],
) -> web.StreamResponse:
    """The upstream did not switch protocols: relay its answer (framing decoded, re-framed)."""
    length = up_headers.get("Content-Length")
    chunked = "chunked" in up_headers.get("Transfer-Encoding", "").lower()
    resp = RelayResponse(
        status=code,
        reason=reason,
        headers=response_headers(up_headers, extra=ctx.response_headers),
    )
    resp.force_close()
    await resp.prepare(request)
    ctx.status_code = code
    sent = 0
    try:
        if code in _NO_BODY or ctx.method == "HEAD":
            pass
        elif chunked:
            while size := int((await reader.readline()).split(b";", 1)[0].strip() or b"0", 16):
                data = await reader.readexactly(size)
                await resp.write(data)
                sent += size
                await reader.readline()
        elif length is not None:
            remaining = int(length)
            while remaining > 0:
                data = await reader.read(min(READ_SIZE, remaining))
                if not data:
                    raise asyncio.IncompleteReadError(b"", remaining)
                remaining -= len(data)
                sent += len(data)
                await resp.write(data)
        else:
            while data := await reader.read(READ_SIZE):
                sent += len(data)
                await resp.write(data)
    except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
        ctx.bytes_out = sent
        errors.stream_broke(e, ctx, idle=False)
        abort(request, resp)
        return resp
    ctx.bytes_out = sent
    await resp.write_eof()
    return resp


def _request_head(method: str, target: str, headers: CIMultiDict[str]) -> bytes:
    lines = [f"{method} {target} HTTP/1.1"]
    lines.extend(f"{name}: {value}" for name, value in headers.items())
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")


def _parse_head(raw: bytes) -> tuple[int, str, CIMultiDict[str]]:
    text = raw.decode("utf-8", "surrogateescape")
    lines = text.split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise errors.Answer(service_unavailable("opgate: the apiserver sent an invalid response"))
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines[1:]:
        if not line:
            continue
        name, _, value = line.partition(":")
        headers.add(name.strip(), value.strip())
    return int(parts[1]), parts[2] if len(parts) > 2 else "", headers
