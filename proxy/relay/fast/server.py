"""The client side of the fast relay: one ``asyncio.Protocol`` per connection, httptools parsing.

Each request head becomes a :class:`Request` handed to the handler coroutine. The calls of one
connection run one after another in one task (``Request.task``), which waits for the next
request between them: a task per call measured ~7k instructions more per call (the task, its
registration in asyncio's weak set of tasks, a done callback). The request body is not read
by the handler: ``on_body`` pushes each chunk into the request, which buffers it (pausing the
client above ``BODY_HIGH_WATER``) until the relay attaches a sink, then forwards every further
chunk synchronously. Writing to the client is ``transport.write``; the transport's buffer limits
drive ``pause_writing``/``resume_writing``, which pause and resume whatever feeds this
connection (``flow``: the upstream transport).

A client that disconnects cancels its running handler at once (the relay then closes the
upstream connection). Requests that arrive while one is being answered wait their turn (no
concurrent pipelining). After an ``Upgrade`` request the parser is done with the connection:
every further byte is raw, buffered until the relay attaches a sink to the tunnel
(:meth:`ClientConnection.attach_raw`).

Limits, as the aiohttp listener has them: a request line or header of at most ``MAX_LINE``
bytes, at most ``MAX_HEADERS`` headers and at most ``MAX_HEAD`` bytes in all (else ``431``: a
head is measured when it came in more than one read; one in a single read is no longer than
the read, asyncio's are 256 KiB at most, so it costs nothing more; one whose reads pass twice
``MAX_HEAD`` before it ends is cut there, as llhttp holds a header line whole until it ends);
malformed HTTP, or a request with two ``Host`` headers (an HTTP/1.1 one with none, or one whose
value holds a byte no host has, as Go's net/http refuses it), gets
``400``, a request line of another version than HTTP/1.x ``505``, a transfer coding besides
chunked ``501``; each closes the connection (after the answers to the calls before it, when
pipelined). A connection idle for ``KEEPALIVE`` seconds between requests is closed. Trailer
fields of a chunked request are dropped. httptools parses no body of an upgrade request: its
``Content-Length`` bytes are taken from the raw bytes after the head (a chunked one gets
``501``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, cast

import httptools

from proxy.engine.status import StatusError
from proxy.relay.errors import (
    bad_host,
    head_too_large,
    malformed_host,
    malformed_request,
    refused_coding,
    unsupported_coding,
    version_not_supported,
)
from proxy.relay.fast.request import BODY_HIGH_WATER, Flow, FlowForwarding, Request
from proxy.relay.fast.wire import Headers
from proxy.relay.hostguard import HostGuard
from proxy.relay.tlsaccept import accepting

__all__ = ["ClientConnection", "FastServer", "Handler"]

WRITE_HIGH_WATER = 512 * 1024  # client write buffer above which upstream reading pauses
MAX_QUEUED = 4
MAX_LINE = 64 * 1024  # long label selectors, big OIDC tokens (as the aiohttp listener)
MAX_HEADERS = 512
MAX_HEAD = 1024 * 1024  # the request line and headers together (the apiserver's, Go's default)
_HEAD_CUT = 2 * MAX_HEAD  # bytes of the reads of a head still arriving (see data_received)
KEEPALIVE = 75.0  # seconds an idle keep-alive connection stays open (both listeners)
# seconds a connection answered before its request body came whole (and so closed) goes on
# reading the rest, and dropping it, before it is closed (both listeners; see linger)
LINGER = 10.0  # (aiohttp's own lingering_time)
# at shutdown: how long a long-running call inside a chunk (or before its head) may take to
# reach a point where it can end cleanly before it is cut
LONG_RUNNING_END = 1.0


class _Refused(Exception):
    """Raised in a parser callback: the connection gets ``answer`` and closes."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer


def _refusal(status: StatusError, phrase: str) -> bytes:
    body = status.body()
    return (
        f"HTTP/1.1 {status.code} {phrase}\r\nContent-Type: application/json\r\n"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


_BAD_REQUEST = _refusal(malformed_request(), "Bad Request")

_TOO_LARGE = _refusal(head_too_large(MAX_LINE, MAX_HEADERS, MAX_HEAD),
                      "Request Header Fields Too Large")
_NO_HOST = _refusal(bad_host(0), "Bad Request")
_MANY_HOSTS = _refusal(bad_host(2), "Bad Request")
_ODD_HOST = _refusal(bad_host(1), "Bad Request")
_BAD_VERSION = _refusal(version_not_supported(), "HTTP Version Not Supported")
_BAD_CODING = _refusal(unsupported_coding(), "Not Implemented")
_CHUNKED_UPGRADE = _refusal(
    unsupported_coding("opgate: an Upgrade request with a chunked body is not supported"),
    "Not Implemented")


class _Trailers(list[tuple[bytes, bytes]]):
    """Where the trailer fields of a chunked request body go: nowhere. llhttp reports them as
    headers after the body; added to the request's headers they would go upstream with a head
    built after the body (one read whole for a middleware), past the middlewares that judged
    the head. Neither relay forwards request trailers (the apiserver ignores them)."""

    def append(self, field: tuple[bytes, bytes]) -> None:
        pass


_TRAILERS = _Trailers()

Handler = Callable[[Request], Coroutine[Any, Any, None]]


class ClientConnection(FlowForwarding, asyncio.Protocol):
    """One client connection: parse requests, run the handler for each, in order."""

    def __init__(self, handler: Handler, server: FastServer | None = None) -> None:
        self._handler = handler
        self._server = server
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.flow: Flow | None = None  # what feeds this connection's writes (upstream)
        self.closed = False
        self._current: Request | None = None  # the request being answered
        self._parsing: Request | None = None  # the request whose bytes are arriving
        self._queue: deque[Request] = deque()
        self._url = b""
        self._headers: Headers = []
        self._in_head = False  # a request head has begun and not yet ended
        self._spread = 0  # bytes of the reads a head spread over (0: it came in one read)
        self._read_paused = False
        self._raw: list[bytes] | None = None  # after an upgrade: bytes not yet tunnelled
        self._raw_sink: Callable[[bytes], None] | None = None
        self._raw_closed: Callable[[], None] | None = None
        self._raw_body: Request | None = None  # an upgrade request whose body leads the raw bytes
        self._raw_left = 0  # ... and how many bytes of it are still due
        self._worker: asyncio.Task[None] | None = None  # runs this connection's calls in turn
        self._next: asyncio.Future[Request | None] | None = None  # the idle worker waits on it
        self._idle: asyncio.TimerHandle | None = None  # one per connection, re-armed lazily
        self._last = 0.0  # when the last request was answered (or the connection opened)
        self._refusal: bytes | None = None  # the answer to a malformed pipelined request
        self._lingering = False  # answered, closing: what still comes is dropped (linger)
        self.remote = ""  # the peer's IP address ("" on a Unix socket)
        self.loop = asyncio.get_event_loop()

    @property
    def busy(self) -> bool:
        return self._current is not None

    @property
    def current(self) -> Request | None:
        return self._current

    @property
    def draining(self) -> bool:
        """The listener is closing: an answer written now says ``Connection: close`` (the
        connection ends after it), as the apiserver's do while it shuts down."""
        return self._server is not None and self._server.closing

    # --- asyncio.Protocol ----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no asyncio.Transport
        self.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            self.remote = str(peer[0])
        if self._server is not None:
            self._server.connections.add(self)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # the rest of a body nobody reads
            return
        if self._raw is not None:
            self._raw_received(data)
            return
        if len(data) > MAX_HEAD:  # a head in it could be over (asyncio never reads that much)
            self._spread = self._spread or 1
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as e:
            self._raw = []
            offset = e.args[0] if e.args else len(data)
            upgrading = self._queue[-1] if self._queue else self._current
            if upgrading is not None and upgrading.content_length is not None:
                # httptools parses no body of an upgrade request (curl --http2 sends Upgrade:
                # h2c with a POST's): its Content-Length bytes lead what follows the head
                left = int(upgrading.content_length)
                if left:
                    upgrading.body_done = False
                    self._raw_body, self._raw_left = upgrading, left
            if offset < len(data):
                self._raw_received(data[offset:])
        except httptools.HttpParserError as e:
            cause = e.__context__
            if isinstance(cause, _Refused):
                self._refuse(cause.answer)
            else:  # a coding list that does not end in chunked: 501, as Go's net/http
                self._refuse(_BAD_CODING if refused_coding(str(e)) else _BAD_REQUEST)
        else:
            if self._in_head:  # a head goes on into the next read
                self._spread += len(data)
                if self._spread > _HEAD_CUT:  # (its line may not have ended: no field to count)
                    self._refuse(_TOO_LARGE)

    def eof_received(self) -> bool | None:
        return None  # close: a half-closed client gets no further answers

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_idle()
        if self._server is not None:
            self._server.connections.discard(self)
        if self._raw_closed is not None:  # a tunnel's client side ended: a normal end
            self._raw_closed()
        current = self._current
        if current is not None and current.task is not None and current.cancellable:
            current.task.cancel()
        self._queue.clear()
        waiting, self._next = self._next, None
        if waiting is not None and not waiting.done():  # an idle worker: it ends
            waiting.set_result(None)

    # --- httptools callbacks -------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._in_head = True

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_LINE:
            raise _Refused(_TOO_LARGE)

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) > MAX_LINE or len(self._headers) >= MAX_HEADERS:
            raise _Refused(_TOO_LARGE)
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        parser = self._parser
        if self._spread:  # a head that came in several reads (or a huge one) is measured
            self._spread = 0
            # in all, as the aiohttp listener counts it: "METHOD TARGET HTTP/1.x" CR LF, each
            # "Name: value" CR LF, CR LF (whitespace around a value beyond one space is not seen)
            size = (len(parser.get_method()) + len(self._url) + 14
                    + sum(len(n) + len(v) + 4 for n, v in self._headers))
            if size > MAX_HEAD:
                raise _Refused(_TOO_LARGE)
        req = Request(self, parser.get_method(), self._url, self._headers)
        version = parser.get_http_version()
        if version != "1.1":
            if version != "1.0":  # (llhttp takes HTTP/0.9 and HTTP/2.0 request lines too)
                raise _Refused(_BAD_VERSION)
            req.http11 = False
        req.keep_alive = parser.should_keep_alive()
        req.upgrade = parser.should_upgrade()
        hosts = 0
        host = b""
        for name, value in self._headers:
            low = name.lower()
            if low == b"content-length":
                req.content_length = value.strip()
                req.has_body = req.content_length != b"0"
            elif low == b"transfer-encoding":  # (llhttp takes only codings that end in chunked)
                if value.strip().lower() != b"chunked":
                    raise _Refused(_BAD_CODING)
                if req.upgrade:  # (its body would have to be found in the raw bytes)
                    raise _Refused(_CHUNKED_UPGRADE)
                req.chunked = req.has_body = True
                self._headers = _TRAILERS  # (this loop goes on over the request's own list)
            elif low == b"expect":  # (never a 1xx to an HTTP/1.0 client: RFC 9110 15.2)
                req.expect_continue = req.http11 and value.strip().lower() == b"100-continue"
            elif low == b"connection":
                req.connection = True
            elif low == b"host":
                hosts += 1
                host = value
                if malformed_host(value):
                    raise _Refused(_ODD_HOST)
        if hosts != 1 and (hosts or (req.http11 and req.method != b"CONNECT")):
            raise _Refused(_MANY_HOSTS if hosts else _NO_HOST)  # (Go's net/http: a 400 each)
        guard = self._server.host_guard if self._server is not None else None
        if guard is not None and hosts and not guard.accepts(host):  # (DNS rebinding)
            req.refused = guard.refusal(host)  # answered by the relay: recorded as a denial
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
        waiting, self._next = self._next, None
        if waiting is not None:  # the worker is idle: hand it the request
            req.task = self._worker
            waiting.set_result(req)
        else:
            req.task = self._worker = self.loop.create_task(self._work(req))

    async def _work(self, req: Request | None) -> None:
        """Run the handler for ``req``, then for each later request of the connection, until
        a call fails or the connection ends (a cancelled call ends it, cancelled)."""
        while req is not None:
            try:
                await self._handler(req)
                failed = False
            except asyncio.CancelledError:
                self._finished(failed=True)
                raise
            except Exception:  # the handler's own failure: this connection ends
                failed = True
            req = self._finished(failed=failed)
            if req is None and self._next is not None:  # idle until the next request
                req = await self._next

    def _finished(self, *, failed: bool) -> Request | None:
        """The current call ended: close the connection, or go on with a queued request (the
        one returned), or wait for the next (``_next`` set, ``None`` returned)."""
        req, self._current = self._current, None
        self.flow = None
        if self.closed or req is None:
            return None
        if failed or self._raw is not None or not (req.keep_alive and req.body_done):
            if failed or self._raw is not None or req.body_done:
                self.close()
            else:
                self.linger()
            return None
        if self._server is not None and self._server.closing:
            self.close()
            return None
        if self._queue:
            req = self._current = self._queue.popleft()
            req.task = self._worker
        elif self._refusal is not None:  # a malformed request came after the calls answered
            self.write(self._refusal)
            self.close()
            return None
        else:
            req = None
            self._next = self.loop.create_future()
            self._last = self.loop.time()  # the idle timer reads it: no timer per request
        self.resume_reading()
        return req

    def _refuse(self, answer: bytes) -> None:
        """Answer a request that cannot be parsed, and close. A client that pipelined it
        behind calls still being answered reads the answers in order: those calls first."""
        if self.transport is None or self.closed or self._refusal is not None:
            return
        parsing = self._parsing
        if self._current is None or parsing is self._current:
            self.transport.write(answer)
            self.close()
            return
        if parsing is not None:  # a queued request whose body broke: it is not answered
            self._queue.remove(parsing)
            self._parsing = None
        self._refusal = answer  # sent by _finished once the queue before it is answered
        self.pause_reading()

    def _arm_idle(self) -> None:
        self._last = self.loop.time()
        self._idle = self.loop.call_later(KEEPALIVE, self._idle_check)

    def _cancel_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _idle_check(self) -> None:
        """Close after ``KEEPALIVE`` seconds without a request being answered or in flight
        (a head still arriving counts as idle); otherwise look again when that could be."""
        now = self.loop.time()
        if self._current is None and self._parsing is None and now - self._last >= KEEPALIVE:
            self._idle = None
            self.close()
            return
        due = self._last + KEEPALIVE if self._current is None else now + KEEPALIVE
        self._idle = self.loop.call_at(max(due, now + 0.001), self._idle_check)

    # --- the tunnel after an upgrade -----------------------------------------------
    def _raw_received(self, data: bytes) -> None:
        if self._raw_body is not None:  # the upgrade request's body first
            data = self._upgrade_body(self._raw_body, data)
            if not data:
                return
        if self._current is not None:
            self._current.bytes_in += len(data)
        if self._raw_sink is not None:
            self._raw_sink(data)
            return
        assert self._raw is not None
        self._raw.append(data)
        if sum(map(len, self._raw)) > BODY_HIGH_WATER:
            self.pause_reading()

    def _upgrade_body(self, req: Request, data: bytes) -> bytes:
        """Feed ``req`` the part of ``data`` that is its body; returns the rest."""
        left = self._raw_left
        body, rest = (data, b"") if len(data) <= left else (data[:left], data[left:])
        self._raw_left = left - len(body)
        if body:
            req.feed(body)
        if not self._raw_left:
            self._raw_body = None
            req.finish()
        return rest

    def attach_raw(self, sink: Callable[[bytes], None], closed: Callable[[], None]) -> None:
        """Send every byte after the upgrade request (buffered and further) to ``sink``;
        ``closed`` when the client closes (instead of cancelling the call)."""
        if self._current is not None:
            self._current.cancellable = False
        pending, self._raw = self._raw or [], []
        self._raw_sink, self._raw_closed = sink, closed
        for chunk in pending:
            sink(chunk)
        self.resume_reading()

    # --- used by the relay ---------------------------------------------------------
    def write(self, data: bytes | memoryview) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def writelines(self, parts: tuple[bytes | memoryview, ...]) -> None:
        if self.transport is not None and not self.closed:
            self.transport.writelines(parts)

    def holds_writes(self) -> bool:
        """Whether the transport still buffers written data: a ``memoryview`` written may be
        among it (the transport keeps a reference instead of a copy)."""
        transport = self.transport
        return transport is not None and transport.get_write_buffer_size() > 0

    def close(self) -> None:
        """Close after what was written is flushed."""
        self._cancel_idle()
        # once: asyncio's TLS transport forgets its protocol on a second close() and then
        # fails get_write_buffer_size() (holds_writes), which shutdown asks again and again
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def linger(self) -> None:
        """Close a connection answered before its request body came whole, as Go's net/http
        (the apiserver's) does: the answer (it said ``Connection: close``) is flushed and the
        write side shut where the transport can, then the rest of the body is read and dropped
        until the client closes, or for ``LINGER`` seconds. Closed at once with bytes of the
        body unread, the socket is reset by the kernel, and the reset can overtake the answer:
        a client still sending (a 413 from the apiserver for a body past its limit, opgate's
        own denial) saw 'connection reset by peer' instead."""
        transport = self.transport
        if transport is None or self.closed or transport.is_closing():
            return
        self._cancel_idle()
        self._lingering = True
        self.resume_reading()
        if transport.can_write_eof():
            transport.write_eof()  # (after what is buffered: the answer is sent first)
        self._idle = self.loop.call_later(LINGER, self.close)  # (the idle timer's slot)

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


class FastServer:
    """The listening socket and its connections; stops the way the aiohttp listener does.

    ``end``: at shutdown, asked to end a connection's long-running call cleanly (a watch
    between two events gets its last chunk); whether it did (else it is asked again, and the
    call cut after ``LONG_RUNNING_END``)."""

    def __init__(
        self, handler: Handler, end: Callable[[ClientConnection], bool] | None = None,
        cut: Callable[[], None] | None = None,
    ) -> None:
        self._handler = handler
        self._end = end
        self._cut = cut  # told before the calls still running at the grace's end are cut
        self.host_guard: HostGuard | None = None  # the Host names answered (TCP listeners)
        self.connections: set[ClientConnection] = set()
        self.closing = False
        self._hurried = False
        self._server: asyncio.AbstractServer | None = None

    def _protocol(self) -> ClientConnection:
        return ClientConnection(self._handler, self)

    def _factory(self, tls: ssl.SSLContext | None) -> Callable[[], asyncio.BaseProtocol]:
        """Plain connections, or TLS ones answering a plain HTTP request as Go does
        (:mod:`proxy.relay.tlsaccept`)."""
        return self._protocol if tls is None else accepting(self._protocol, tls)

    async def listen_tcp(
        self, host: str, port: int, *, tls: ssl.SSLContext | None, reuse_port: bool
    ) -> list[tuple[str, int]]:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            self._factory(tls), host, port, reuse_port=reuse_port or None, backlog=1024
        )
        self._server = server
        return [s.getsockname()[:2] for s in server.sockets]

    async def listen_unix(self, path: str, *, tls: ssl.SSLContext | None) -> None:
        loop = asyncio.get_running_loop()  # (it replaces a stale socket file of an earlier run)
        self._server = await loop.create_unix_server(self._factory(tls), path, backlog=1024)

    def hurry(self) -> None:
        """Cut the grace of a :meth:`close` under way short: what is still running is cut now."""
        self._hurried = True

    async def close(self, grace: float) -> None:
        """Stop accepting, close idle connections, end long-running calls (cleanly where
        ``end`` can, else cut, within ``LONG_RUNNING_END`` seconds), give the others ``grace``
        seconds to finish (their answers written out to the client, too), then cut what is
        left."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        cut_by = loop.time() + min(grace, LONG_RUNNING_END)
        end = self._end
        while True:
            for conn in list(self.connections):
                current = conn.current
                if current is None:
                    conn.close()
                elif current.long_running and not (end is not None and end(conn)) \
                        and (loop.time() >= cut_by or self._hurried):
                    conn.abort()
            # a connection closed with its answer still in the transport's buffer is busy
            # too: the process must not exit before that reaches the client (slow readers)
            busy = [c for c in self.connections if c.busy or c.holds_writes()]
            if not busy or loop.time() >= deadline or self._hurried:
                break
            await asyncio.sleep(0.05)
        if self._cut is not None and any(c.current is not None for c in self.connections):
            self._cut()
        for conn in list(self.connections):
            conn.abort()
            current = conn.current
            if current is not None and current.task is not None and current.cancellable:
                current.task.cancel()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
