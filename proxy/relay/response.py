"""Writing to the client: relayed bodies, responses that add nothing, opgate's Status, aborts.

:func:`pump` copies the upstream body as it arrives (``readany``: whatever bytes are there, no
re-chunking, no copy for a single buffered chunk); ``write()`` sends at once and applies
backpressure above 64 KiB, so watch events reach the client as the apiserver sends them.

aiohttp's ``StreamResponse`` would add ``Server: Python/… aiohttp/…`` and, for a body without a
type, ``Content-Type: application/octet-stream``; a transparent proxy adds neither, so
:class:`RelayResponse` removes them again when the upstream did not send them. ``Date`` is only
added when missing (the apiserver always sends one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from proxy.engine.context import RequestContext
from proxy.engine.status import StatusError, bad_request
from proxy.relay import errors
from proxy.relay.events import EventEnds
from proxy.relay.fast import server as fast_server
from proxy.relay.tap import tee_read

__all__ = [
    "BufferedRelayResponse",
    "Http11Refusal",
    "RelayResponse",
    "StatusLine11",
    "abort",
    "pump",
    "pump_watch",
    "read_body",
    "send_continue",
    "send_status",
]


class RelayResponse(web.StreamResponse):
    """A ``StreamResponse`` that sends exactly the headers it was given (plus ``Date``)."""

    async def _prepare_headers(self) -> None:
        headers = self.headers
        had_server = "Server" in headers
        had_type = "Content-Type" in headers
        await super()._prepare_headers()
        if not had_server:
            headers.popall("Server", None)
        if not had_type:
            headers.popall("Content-Type", None)


class BufferedRelayResponse(RelayResponse):
    """Holds the headers back until the first body bytes, so both leave in one segment.

    For ordinary calls only: a watch's headers must go out at once (clients wait for them).
    """

    _send_headers_immediately = False


class StatusLine11:
    """A mixin for opgate's refusal of a request line that is not HTTP/1.0 or 1.1
    (``HTTP/2.0``), or of a head aiohttp could not parse: the status line says ``HTTP/1.1``, as
    Go's net/http (the apiserver's) and the fast relay write it. aiohttp echoes the request's
    version (an ``HTTP/2.0 505`` on an HTTP/1 connection), or ``HTTP/1.0`` for a head it
    could not read."""

    async def _write_headers(self: Any) -> None:
        writer = self._payload_writer
        assert writer is not None
        await writer.write_headers(f"HTTP/1.1 {self.status} {self.reason}", self.headers)
        if self._send_headers_immediately:
            writer.send_headers()


class Http11Refusal(StatusLine11, BufferedRelayResponse):
    """:func:`send_status`'s answer to a request line of another HTTP version."""


async def send_status(
    request: web.BaseRequest,
    status: StatusError,
    *,
    extra: Iterable[tuple[str, str]] = (),
    close: bool = False,
) -> tuple[RelayResponse, int]:
    """Answer with a Kubernetes ``Status``; returns the response and the body size (sent)."""
    body = status.body()
    headers: CIMultiDict[str] = CIMultiDict(status.response_headers())
    headers.extend(extra)
    kind = BufferedRelayResponse if request.version.major == 1 else Http11Refusal
    resp = kind(status=status.code, headers=headers)
    resp.content_length = len(body)
    if close:
        resp.force_close()
    await resp.prepare(request)
    if request.method == "HEAD":  # its length, not the body: the client reads none
        body = b""  # (a StreamResponse would send it, and the next answer be read as it)
    await resp.write_eof(body)
    return resp, len(body)


def abort(request: web.BaseRequest, resp: web.StreamResponse) -> None:
    """End a response whose headers are already sent, so the client sees it incomplete.

    No terminating chunk and no further bytes: the connection is closed after what was written
    is flushed, so a chunked or length-framed body visibly ends early.
    """
    resp.force_close()
    transport = request.transport
    if transport is not None:
        transport.close()


async def pump(
    request: web.BaseRequest,
    ctx: RequestContext,
    upstream: aiohttp.ClientResponse,
    resp: web.StreamResponse,
) -> bool:
    """Copy the upstream body to the client as it arrives; True if it ended cleanly.

    The last chunk goes out with the end of the response (one segment for small bodies). A
    watch idle timeout, or opgate's shutdown, ends the response cleanly, as the apiserver's own
    timeout would; any other upstream failure aborts it, so the client sees it incomplete.
    """
    content = upstream.content
    read = content.readany if ctx.tap is None else tee_read(content.readany, ctx.tap)
    write = resp.write
    sent = 0
    try:
        while True:
            try:
                chunk = await read()
            except errors.ShuttingDown:  # opgate stops: end the body here, cleanly, and the
                resp.force_close()  # connection after it (no further call on it)
                return True
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                idle = isinstance(e, aiohttp.SocketTimeoutError) and (
                    ctx.info.is_long_running and upstream.content_length is None
                )
                errors.stream_broke(e, ctx, idle=idle)
                if idle:
                    return True
                abort(request, resp)
                return False
            if not chunk:
                return True
            sent += len(chunk)
            try:
                if content.at_eof():
                    await resp.write_eof(chunk)
                    return True
                await write(chunk)
            except ConnectionError:
                ctx.error = "client went away"
                return False
    finally:
        ctx.bytes_out = sent


async def pump_watch(
    request: web.BaseRequest,
    ctx: RequestContext,
    upstream: aiohttp.ClientResponse,
    resp: web.StreamResponse,
    *,
    events: EventEnds,
    idle: float,
) -> bool:
    """:func:`pump` for a watch: it ends (at shutdown, at the idle timeout) between two of its
    events, never inside one (the apiserver splits an event over two chunks when its writer's
    2,048-byte buffer fills). ``events`` follows what was written (:mod:`proxy.relay.events`);
    asked to end inside an event, the watch ends with the piece that completes it, or is cut
    when none does by ``events.ending``. ``idle``: the watch idle timeout (0: none), kept here
    rather than by aiohttp's ``sock_read``, after which nothing more could be read."""
    content = upstream.content
    # inside an event, one HTTP chunk a read: readany would join the chunk that ends the
    # event to the next ones aiohttp holds behind it (events back to back), and a watch asked
    # to end inside it could then only be cut
    read_any, read_chunk = content.readany, _chunk_reader(content)
    if ctx.tap is not None:
        read_any, read_chunk = tee_read(read_any, ctx.tap), tee_read(read_chunk, ctx.tap)
    write = resp.write
    loop = asyncio.get_running_loop()
    framed = upstream.content_length is not None  # (an error Status: it cannot end early)
    idled: TimeoutError | None = None  # the idle timeout passed inside an event
    sent = 0
    try:
        while True:
            wait = idle or None
            if events.ending:
                wait = max(events.ending - loop.time(), 0.0)
            read = read_any if events.between else read_chunk
            try:
                async with asyncio.timeout(wait):
                    chunk = await read()
            except errors.ShuttingDown:  # opgate stops between two events: end the body here,
                resp.force_close()  # cleanly, and the connection after it
                return True
            except TimeoutError as e:
                if events.ending and loop.time() < events.ending:
                    continue  # (the idle timeout, while shutdown waits for an event's end)
                if events.ending or framed:  # an event's end, or a framed body's, never came
                    errors.stream_broke(e, ctx, idle=False)
                    abort(request, resp)
                    return False
                if events.between:  # the idle timeout ends the watch, as the apiserver's would
                    errors.stream_broke(e, ctx, idle=True)
                    return True
                idled = e  # inside an event: wait a little for its end
                events.ending = loop.time() + fast_server.LONG_RUNNING_END
                continue
            except (aiohttp.ClientError, OSError) as e:
                errors.stream_broke(e, ctx, idle=False)
                abort(request, resp)
                return False
            if not chunk:
                return True
            sent += len(chunk)
            events.data(chunk, 0, len(chunk))
            try:
                if content.at_eof():
                    await resp.write_eof(chunk)
                    return True
                await write(chunk)
            except ConnectionError:
                ctx.error = "client went away"
                return False
            if events.ending and events.between:  # the event asked to end in has ended
                if idled is not None:
                    errors.stream_broke(idled, ctx, idle=True)
                else:  # at shutdown: the connection ends after it
                    resp.force_close()
                return True
    finally:
        ctx.bytes_out = sent


def _chunk_reader(content: aiohttp.StreamReader) -> Callable[[], Awaitable[bytes]]:
    """``content.readany`` that returns at most one HTTP chunk's data (``b""`` at the end)."""
    async def read() -> bytes:
        while True:
            data, chunk_end = await content.readchunk()
            if data or not chunk_end:  # ((b"", True): a chunk's end already read up to)
                return data

    return read


async def send_continue(request: web.BaseRequest) -> None:
    """Answer ``Expect: 100-continue`` before reading a body (opgate does not forward Expect)."""
    expect = request.headers.get("Expect")
    if expect is not None and expect.lower() == "100-continue" and request.version >= (1, 1):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")


async def read_body(request: web.BaseRequest, *, limit: int) -> bytes:
    """The whole request body for the middlewares, at most ``limit`` bytes (else a 413)."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise errors.Answer(errors.too_large(limit), close=True)
    await send_continue(request)
    buf = bytearray()
    content = request.content
    try:
        while chunk := await content.readany():
            buf += chunk
            if len(buf) > limit:
                raise errors.Answer(errors.too_large(limit), close=True)
    except web.RequestPayloadError as e:
        raise errors.Answer(bad_request(f"cannot read the request body: {e}"), close=True) from e
    return bytes(buf)
