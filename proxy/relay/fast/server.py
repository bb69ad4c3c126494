"""The client side of the fast relay: one ``asyncio.Protocol`` per connection, httptools parsing.

Each request head becomes a :class:`Request` handed to the handler coroutine (one task per
call). The request body is not read by the handler: ``on_body`` pushes each chunk into the
request, which buffers it (pausing the client above ``BODY_HIGH_WATER``) until the relay
attaches a sink, then forwards every further chunk synchronously. Writing to the client is
``transport.write``; the transport's buffer limits drive ``pause_writing``/``resume_writing``,
which pause and resume whatever feeds this connection (``flow``: the upstream transport).

A client that disconnects cancels its running handler at once (the relay then closes the
upstream connection). Requests that arrive while one is being answered wait their turn (no
concurrent pipelining). ``Upgrade`` requests are marked and left to the handler to refuse.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, cast

import httptools

from proxy.relay.fast.wire import Headers

__all__ = ["ClientConnection", "Flow", "Handler", "Request", "serve"]

BODY_HIGH_WATER = 256 * 1024  # request body buffered before the upstream is ready
WRITE_HIGH_WATER = 64 * 1024  # client write buffer above which upstream reading pauses
MAX_QUEUED = 4


class Flow(Protocol):
    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


class Request:
    """One request head and its streamed body."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_end",
        "_sink",
        "_waiter",
        "body_done",
        "bytes_in",
        "cancellable",
        "chunked",
        "conn",
        "content_length",
        "expect_continue",
        "has_body",
        "headers",
        "http11",
        "keep_alive",
        "method",
        "task",
        "upgrade",
        "url",
    )

    def __init__(self, conn: ClientConnection, method: bytes, url: bytes, headers: Headers) -> None:
        self.conn = conn
        self.method = method
        self.url = url
        self.headers = headers
        self.http11 = True
        self.keep_alive = True
        self.upgrade = False
        self.expect_continue = False
        self.chunked = False
        self.has_body = False
        self.content_length: bytes | None = None
        self.cancellable = True  # False during the exit hooks: a client leaving must not cut them
        self.body_done = False
        self.bytes_in = 0
        self.task: asyncio.Task[None] | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._sink: Callable[[bytes], None] | None = None
        self._end: Callable[[], None] | None = None
        self._waiter: asyncio.Future[None] | None = None

    # --- fed by the parser ---------------------------------------------------------
    def feed(self, chunk: bytes) -> None:
        self.bytes_in += len(chunk)
        if self._sink is not None:
            self._sink(chunk)
            return
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered > BODY_HIGH_WATER and self._waiter is None:
            self.conn.pause_reading()

    def finish(self) -> None:
        self.body_done = True
        if self._end is not None:
            self._end()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # --- used by the relay ---------------------------------------------------------
    def attach(self, sink: Callable[[bytes], None], end: Callable[[], None]) -> None:
        """Send the buffered and every further body chunk to ``sink``; ``end`` at its end."""
        self.conn.resume_reading()  # first: flushing below may pause it again (backpressure)
        chunks, self._chunks, self._buffered = self._chunks, [], 0
        for chunk in chunks:
            sink(chunk)
        self._sink, self._end = sink, end
        if self.body_done:
            end()

    async def read_all(self, limit: int) -> bytes | None:
        """The whole body (``None`` when longer than ``limit``)."""
        while not self.body_done:
            if self._buffered > limit:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            self.conn.resume_reading()
            await self._waiter
        self._waiter = None
        body = b"".join(self._chunks)
        self._chunks, self._buffered = [], 0
        return body if len(body) <= limit else None


Handler = Callable[[Request], Coroutine[Any, Any, None]]


class ClientConnection(asyncio.Protocol):
    """One client connection: parse requests, run the handler for each, in order."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.flow: Flow | None = None  # what feeds this connection's writes (upstream)
        self.closed = False
        self._current: Request | None = None  # the request being answered
        self._parsing: Request | None = None  # the request whose bytes are arriving
        self._queue: deque[Request] = deque()
        self._url = b""
        self._headers: Headers = []
        self._read_paused = False
        self._loop = asyncio.get_event_loop()

    # --- asyncio.Protocol ----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no asyncio.Transport
        self.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # the handler refuses upgrades and closes the connection
        except httptools.HttpParserError:
            self._bad_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        current = self._current
        if current is not None and current.task is not None and current.cancellable:
            current.task.cancel()
        self._queue.clear()

    def pause_writing(self) -> None:
        if self.flow is not None:
            self.flow.pause_reading()

    def resume_writing(self) -> None:
        if self.flow is not None:
            self.flow.resume_reading()

    # --- httptools callbacks -------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self._parser
        req = Request(self, parser.get_method(), self._url, self._headers)
        req.http11 = parser.get_http_version() == "1.1"
        req.keep_alive = parser.should_keep_alive()
        req.upgrade = parser.should_upgrade()
        for name, value in self._headers:
            low = name.lower()
            if low == b"content-length":
                req.content_length = value.strip()
                req.has_body = req.content_length != b"0"
            elif low == b"transfer-encoding":
                req.chunked = req.has_body = True
            elif low == b"expect":
                req.expect_continue = value.strip().lower() == b"100-continue"
        self._parsing = req
        if self._current is None:
            self._start(req)
        else:
            self._queue.append(req)
            if len(self._queue) >= MAX_QUEUED:
                self.pause_reading()

    def on_body(self, body: bytes) -> None:
        if self._parsing is not None:
            self._parsing.feed(body)

    def on_message_complete(self) -> None:
        req, self._parsing = self._parsing, None
        if req is not None:
            req.finish()

    # --- running handlers ----------------------------------------------------------
    def _start(self, req: Request) -> None:
        self._current = req
        req.task = self._loop.create_task(self._handler(req))
        req.task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        req, self._current = self._current, None
        self.flow = None
        failed = task.cancelled() or task.exception() is not None  # (retrieves it)
        if self.closed or req is None:
            return
        if failed or not (req.keep_alive and req.body_done):
            self.close()
            return
        if self._queue:
            self._start(self._queue.popleft())
        self.resume_reading()

    def _bad_request(self) -> None:
        if self.transport is not None and not self.closed:
            body = b'{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"BadRequest",' \
                   b'"message":"opgate: malformed HTTP request","code":400}\n'
            self.transport.write(
                b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            self.close()

    # --- used by the relay ---------------------------------------------------------
    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def close(self) -> None:
        """Close after what was written is flushed."""
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """End a response cut short: flush what was written, send nothing more, close."""
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def pause_reading(self) -> None:
        if not self._read_paused and self.transport is not None and not self.closed:
            self._read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._read_paused and self.transport is not None and not self.closed:
            self._read_paused = False
            self.transport.resume_reading()


async def serve(
    handler: Handler, *, host: str, port: int, reuse_port: bool = False
) -> asyncio.Server:
    """Listen on ``host:port`` (TCP), one :class:`ClientConnection` per accepted connection."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(
        lambda: ClientConnection(handler), host, port, reuse_port=reuse_port or None, backlog=1024
    )
