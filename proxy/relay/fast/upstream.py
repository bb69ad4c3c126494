"""The upstream side of the fast relay: a keep-alive pool of ``asyncio.Protocol`` connections.

An :class:`UpstreamConnection` parses responses with httptools and calls the :class:`Exchange`
it is lent to (head, each body chunk as it arrives, end, or loss): no stream reader, no
coroutine per chunk. A connection goes back to the pool after a complete response the upstream
did not ask to close; anything else closes it. ``pause_writing``/``resume_writing`` pause and
resume whatever feeds its request body (``flow``: the client transport).

The pool is LIFO (the warmest connection first), unbounded in size like the aiohttp relay's
(``limit=0``), keeps at most ``max_idle`` idle connections, and drops idle ones older than
``keepalive`` seconds when it meets them.

An upgrade request (exec, attach, port-forward) goes over a connection of its own
(:meth:`UpstreamPool.connect`): on ``101`` the exchange is told (``on_switch``) and every further
byte the upstream sends is handed to ``on_body`` untouched; such a connection is never pooled,
and its TLS layer is asyncio's, which keeps the bytes before the upstream's FIN
(``proxy.relay.tlsconnect``).

A length-framed body of at least ``LONG_BODY`` bytes (a big LIST) is read past the parser into a
buffer of the connection's own (:class:`BodyReader`, an ``asyncio.BufferedProtocol`` the
transport is switched to until the body ends): each read goes to the exchange as a
``memoryview`` of that buffer (``on_view``) instead of a new ``bytes``, and over TLS the
decrypted records land in it directly instead of being joined into one. The exchange answers
whether it still holds the view (the client's write buffer kept it); the next read then goes to
a fresh buffer. Meanwhile the socket wakes the loop only once ``LOWAT`` bytes are queued
(``SO_RCVLOWAT``) for as long as more than that is still due: an upstream that sends a TLS
record at a time is read in fewer, fuller reads, and written to the client in fewer, larger
writes. Near the body's end the mark goes back to 1, so the last bytes are never held back.

A chunked body (every LIST and watch of a kube-apiserver) that the exchange relays chunked to an
HTTP/1.1 client is passed through as it came, framing and all (``pass_chunked``, then
``on_raw`` per read): the parser is stopped right after the head, and
:class:`~proxy.relay.fast.chunked.ChunkedFraming` reads only the framing to find the body's end,
so a read is one client write instead of a callback, a framing and a write per chunk. Its end is
not known ahead, so no low-water mark is set: every read leaves at once, as a watch needs.

Each connection has one :class:`~proxy.relay.lazytimer.LazyTimer` (``timer``) for the deadlines
of the exchange it is lent to: the exchange sets its next deadline there, and when it passes the
connection calls ``on_deadline`` of the exchange lent at that moment (never of one that was
lent before). Whenever the connection is given back or closed, the deadline is forgotten (and on
close the loop timer cancelled). Calls one after another on a kept-alive connection so move one
deadline rather than arming and cancelling a loop timer each.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import ssl
import time
from typing import Protocol, cast

import httptools

from proxy.relay import tlsconnect
from proxy.relay.errors import ConnectTimeout
from proxy.relay.fast.chunked import ChunkedFraming, FramingError
from proxy.relay.fast.request import Flow, FlowForwarding
from proxy.relay.fast.splice import AVAILABLE as SPLICE_AVAILABLE
from proxy.relay.fast.splice import SplicePump
from proxy.relay.fast.wire import Headers
from proxy.relay.lazytimer import LazyTimer

__all__ = ["Exchange", "UpstreamConnection", "UpstreamPool"]

WRITE_HIGH_WATER = 64 * 1024
LONG_BODY = 1024 * 1024  # a length-framed body this long is read by a BodyReader
READ_SIZE = 256 * 1024  # the BodyReader's buffer: one read (over TLS: up to 16 records)
LOWAT = 128 * 1024  # meanwhile, wake up for no less (SO_RCVLOWAT) ...
LOWAT_MARGIN = 2 * READ_SIZE  # ... while more than this is due besides (a TLS layer's backlog)
MAX_HEAD = 1024 * 1024  # a response head (interim ones included) longer than this fails the call
OUT_OF_FILES = (errno.EMFILE, errno.ENFILE)
ROOM_FIRST, ROOM_MAX = 0.005, 1.0  # seconds between dials out of descriptors (Go's EMFILE backoff)
ROOM_BOUND = 5.0  # seconds a dial waits for a descriptor without a connect timeout


class Exchange(Protocol):
    """Receives one upstream response."""

    def on_head(
        self, status: int, reason: bytes, headers: Headers, *, length: bytes | None, chunked: bool
    ) -> None: ...
    def on_switch(self, reason: bytes, headers: Headers) -> None: ...
    def on_body(self, chunk: bytes) -> None: ...
    def on_view(self, view: memoryview) -> bool:
        """A body chunk as a view of the connection's read buffer, valid only during the call;
        ``True`` when the view is still referenced afterwards (the next read then goes to a
        fresh buffer). An exchange that keeps chunks copies it, or answers ``True``."""
        ...
    def pass_chunked(self) -> ChunkedFraming | None:
        """Asked once the head of a chunked body is in: the framing to follow when the body
        is to go to ``on_raw`` as it came, framing and all; ``None``: through ``on_body``."""
        ...
    def on_raw(self, data: bytes, size: int) -> None:
        """A read of a chunked body passed through, framing included (``size``: the data
        bytes in it)."""
        ...
    def splice_to(self) -> int | None:
        """Asked once the head of a long length-framed body from a plain-HTTP upstream is in:
        the client's socket when the rest may go there socket to socket
        (:class:`~proxy.relay.fast.splice.SplicePump`, which then calls ``on_spliced``), else
        ``None`` (``on_view`` per read)."""
        ...
    def on_spliced(self, size: int) -> None: ...
    def abort_client(self) -> None: ...
    def on_complete(self) -> None: ...
    def on_lost(self, exc: BaseException) -> None: ...
    def on_deadline(self) -> None:
        """The deadline it set on the connection's ``timer`` has passed."""


class UpstreamConnection(FlowForwarding, asyncio.Protocol):
    """One connection to the upstream, lent to one exchange at a time."""

    def __init__(self, pool: UpstreamPool, loop: asyncio.AbstractEventLoop) -> None:
        self._pool = pool
        self.timer = LazyTimer(loop, self._deadline)  # the deadline of the exchange lent
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.flow: Flow | None = None
        self.closed = False
        self.idle_since = 0.0
        self.head_only = False  # the request was HEAD: no body follows the head
        self.received = False  # any byte of the current response
        self._reason = b""
        self._headers: Headers = []
        self._until_close = False  # a body framed by the end of the connection
        self._keep = True
        self.body_pending = False  # a streamed request body is still being sent
        self.upgrade = False  # the request asks for an upgrade
        self.switched = False  # the upstream answered 101: raw bytes from here on
        self._left = 0  # body bytes still due of a length-framed response
        self._status = 0
        self._framing: ChunkedFraming | None = None  # a chunked body passed through as it came
        self._in_body = False  # the final head of the current response is in
        self._before = b""  # meanwhile: the response's reads so far (its head may span reads)
        self._heads = 0  # heads of the current response so far (interim ones too)
        self.paused = False  # reading paused: the client's write buffer was full (backpressure)
        self.pump: SplicePump | None = None  # moving a long body socket to socket, meanwhile
        self._splices = SPLICE_AVAILABLE and pool.tls is None  # (plain TCP: nothing to decrypt)

    def send(
        self,
        exchange: Exchange,
        data: bytes,
        *,
        head_only: bool = False,
        streaming: bool = False,
        upgrade: bool = False,
    ) -> None:
        self.exchange, self.head_only, self.received = exchange, head_only, False
        self.body_pending, self._until_close, self.upgrade = streaming, False, upgrade
        self._in_body, self._before, self._heads = False, b"", 0
        assert self.transport is not None
        self.transport.write(data)

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def close(self) -> None:
        if not self.closed and self.transport is not None:
            self.transport.close()
        self.closed = True
        self.exchange = None
        self.timer.close()
        if self.pump is not None:
            self.pump.stop()

    def _deadline(self) -> None:
        exchange = self.exchange  # the one lent now: a finished one is no longer here
        if exchange is not None:
            exchange.on_deadline()

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    # --- asyncio.Protocol ----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no asyncio.Transport
        self.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:  # nothing asked: a stray byte makes the connection unusable
            self.close()
            return
        if self.switched:
            exchange.on_body(data)
            return
        if self._left:
            self._body_past_parser(exchange, data)
            return
        if self._framing is not None:
            self._chunks_past_parser(exchange, data)
            return
        self.received = True
        try:
            self._parser.feed_data(data)
            if self._left >= LONG_BODY and not self.closed and self.transport is not None:
                self._long_body(exchange, self.transport)
            if not self._in_body:  # the head goes on in the next read (rare: kept whole)
                self._before += data
                if len(self._before) > MAX_HEAD:
                    raise httptools.HttpParserError(
                        f"response head longer than {MAX_HEAD} bytes")
        except httptools.HttpParserUpgrade as e:
            offset = e.args[0] if e.args else len(data)
            if self.switched and offset < len(data) and self.exchange is not None:
                self.exchange.on_body(data[offset:])
        except httptools.HttpParserError as e:
            if isinstance(e.__context__, _PassChunks):
                self._chunks_after_head(exchange, data)
                return
            exchange = self.exchange
            self.close()
            if exchange is not None:
                exchange.on_lost(e)

    def _long_body(self, exchange: Exchange, transport: asyncio.Transport) -> None:
        """The rest of a long length-framed body: socket to socket when both are plain TCP and
        the exchange agrees, else through a :class:`BodyReader`."""
        if self._splices:
            client_fd = exchange.splice_to()
            if client_fd is not None:
                try:
                    SplicePump(self, exchange, transport, client_fd)
                    return
                except OSError:  # no descriptors left for the pipe: read it the usual way
                    pass
        BodyReader(self, transport)

    def _chunks_after_head(self, exchange: Exchange, data: bytes) -> None:
        """The parser stopped right after the head of a chunked body passed through. The body
        starts where llhttp stopped: after the response's ``_heads``-th head (interim ones
        first), each of which starts at its first byte that is not CR or LF (llhttp skips
        those between messages) and ends with ``\\r\\n\\r\\n`` (llhttp takes no other line
        end). The response's earlier reads are in ``_before`` when its head spanned reads."""
        self._parser = httptools.HttpResponseParser(self)  # this one is in its error state
        before, self._before = self._before, b""
        buf = before + data if before else data
        at = 0
        for _ in range(self._heads):
            while at < len(buf) and buf[at] in b"\r\n":
                at += 1
            end = buf.find(b"\r\n\r\n", at)
            if end < 0:  # cannot happen with a head llhttp accepted; never guess
                self._framing = None
                self.close()
                exchange.on_lost(httptools.HttpParserError("no end of the response head found"))
                return
            at = end + 4
        at -= len(before)
        if at < len(data):
            self._chunks_past_parser(exchange, data[at:] if at else data)

    def _chunks_past_parser(self, exchange: Exchange, data: bytes) -> None:
        """A read of a chunked body passed through: to the client as it came, up to the
        body's end (which :class:`ChunkedFraming` finds)."""
        framing = self._framing
        assert framing is not None
        before = framing.body
        try:
            end = framing.feed(data)
        except FramingError as e:
            self._framing = None
            self.close()
            exchange.on_lost(e)
            return
        if end < 0:
            stop = framing.stop  # (a watch ending after the event in this read: it ends
            exchange.on_raw(data if stop < 0 else data[:stop], framing.body - before)  # there)
            return
        self._framing = None
        extra = end < len(data)
        exchange.on_raw(data[:end] if extra else data, framing.body - before)
        self._end_body(extra)

    def _body_past_parser(self, exchange: Exchange, data: bytes) -> None:
        """The rest of a length-framed body, straight to the exchange: no parser, no copy."""
        left = self._left
        if len(data) < left:
            self._left = left - len(data)
            exchange.on_body(data)
            return
        self._left = 0
        exchange.on_body(data[:left] if len(data) > left else data)
        self._end_body(len(data) > left)  # more: bytes nobody asked for

    def body_ended(self, exchange: Exchange, last: memoryview, *, extra: bool) -> None:
        """A :class:`BodyReader` read the body's ``last`` bytes and gave the transport back
        (``extra``: the upstream sent more, which nobody asked for)."""
        self._left = 0
        exchange.on_view(last)
        self._end_body(extra)

    def body_spliced(self, *, extra: bool = False) -> None:
        """A :class:`SplicePump` moved the body's last byte (the transport reads on in the pool,
        or closes; ``extra``: the upstream sent more, which nobody asked for)."""
        self._left = 0
        self._end_body(extra)

    def _end_body(self, extra: bool) -> None:
        self._parser = httptools.HttpResponseParser(self)  # the old one stopped mid-body
        self.on_message_complete()
        if extra and not self.closed:
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.timer.close()
        if self.pump is not None:
            self.pump.stop()
        self._pool.discard(self)
        exchange, self.exchange = self.exchange, None
        if exchange is None:
            return
        if (self._until_close or self.switched) and exc is None:
            exchange.on_complete()
        else:
            exchange.on_lost(exc or ConnectionResetError("the upstream closed the connection"))

    # --- httptools callbacks -------------------------------------------------------
    def on_message_begin(self) -> None:
        self._headers = []
        self._reason = b""

    def on_status(self, reason: bytes) -> None:
        self._reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._heads += 1
        status = self._status = self._parser.get_status_code()
        if status == 101 and self.upgrade:
            self.switched = True
            if self.exchange is not None:
                self.exchange.on_switch(self._reason, self._headers)
            return
        if 100 <= status < 200:
            return  # interim (100 Continue): the real response follows
        self._in_body = True
        self._keep = self._parser.should_keep_alive() and not self.upgrade
        length: bytes | None = None
        chunked = False
        for name, value in self._headers:
            size = len(name)  # only names of the two lengths are lower()ed
            if size == 14 and name.lower() == b"content-length":
                length = value.strip()
            elif size == 17 and name.lower() == b"transfer-encoding":
                # chunked only as the last coding, as llhttp frames it ("chunked, identity" is
                # read until the upstream closes): the framing followed must be the parser's
                chunked = value == b"chunked" or (  # (what an apiserver sends, at once)
                    value.rpartition(b",")[2].strip().lower() == b"chunked")
        no_body = self.head_only or status in (204, 304)
        self._until_close = not (chunked or length is not None or no_body)
        if length is not None and not no_body and not chunked and length.isdigit():
            self._left = int(length)  # counted down by on_body; what the parser leaves, we take
        exchange = self.exchange
        if exchange is not None:
            exchange.on_head(status, self._reason, self._headers, length=length,
                             chunked=chunked and not no_body)
            if chunked and not no_body:
                self._framing = exchange.pass_chunked()
                if self._framing is not None:
                    raise _PassChunks  # stops the parser here (see data_received)
        if self.head_only:  # httptools cannot skip a HEAD's announced body: finish, do not reuse
            self.exchange = None
            self.close()
            if exchange is not None:
                exchange.on_complete()

    def on_body(self, body: bytes) -> None:
        if self._left:
            self._left -= len(body)
        if self.exchange is not None:
            self.exchange.on_body(body)

    def on_message_complete(self) -> None:
        if 100 <= self._status < 200:
            return  # interim, or a 101 whose tunnel goes on
        exchange, self.exchange = self.exchange, None
        self.flow = None
        self.timer.clear()  # its deadline: the next exchange sets its own
        if exchange is not None and self._keep and not (
                self._until_close or self.closed or self.body_pending):
            self._pool.release(self)
        else:  # (no exchange: a response nobody asked for, in the read of the one before it;
            self.close()  # pooled again, the connection would be lent to two calls at once)
        if exchange is not None:
            exchange.on_complete()


class _PassChunks(Exception):
    """Raised in the parser's head callback to stop it where a passed-through body starts."""


class BodyReader(asyncio.BufferedProtocol):
    """The transport's protocol while a long length-framed body flows (see the module's
    docstring): reads land in a buffer of its own and go to the connection's exchange as views. At
    the body's end it gives the transport back to its :class:`UpstreamConnection`; everything
    else (loss, EOF, write flow control) is the connection's business all along."""

    __slots__ = ("_conn", "_lowat", "_transport", "_view")

    def __init__(self, conn: UpstreamConnection, transport: asyncio.Transport) -> None:
        self._conn, self._transport = conn, transport
        self._view = memoryview(bytearray(READ_SIZE))
        self._lowat = conn._left > LOWAT + LOWAT_MARGIN and self._wake_at(LOWAT)
        self._switch(self)

    def _wake_at(self, size: int) -> bool:
        """Have the kernel report the socket readable only once ``size`` bytes are queued
        (``SO_RCVLOWAT``; 1 is the default): fewer, fuller reads while a fast upstream sends a
        long body, and as fewer, larger writes to the client. It must never exceed what the
        upstream is still to send, or the last bytes would wait for ever: hence the margin
        for what a TLS layer read but has not yet handed over. ``False`` when not set."""
        sock = self._transport.get_extra_info("socket")
        if sock is None:
            return False
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, size)
        except (OSError, AttributeError):
            return False
        return True

    def _switch(self, protocol: asyncio.BaseProtocol) -> None:
        transport = self._transport
        transport.set_protocol(protocol)
        if transport.is_reading():  # uvloop picks its read callbacks when reading starts
            transport.pause_reading()
            transport.resume_reading()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._view

    def buffer_updated(self, nbytes: int) -> None:
        conn = self._conn
        exchange = conn.exchange
        if exchange is None or conn.closed:  # the call was cut short meanwhile
            conn.close()
            return
        left = conn._left
        if self._lowat and left - nbytes <= LOWAT + LOWAT_MARGIN:  # (and before the pool)
            self._lowat = not self._wake_at(1)
        if nbytes < left:
            conn._left = left - nbytes
            if exchange.on_view(self._view[:nbytes]):
                self._view = memoryview(bytearray(READ_SIZE))  # the old one is still in use
            return
        self._switch(conn)  # the body ends here: the connection reads what follows
        conn.body_ended(exchange, self._view[:left], extra=nbytes > left)

    def eof_received(self) -> bool | None:
        return self._conn.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._conn.connection_lost(exc)

    def pause_writing(self) -> None:
        self._conn.pause_writing()

    def resume_writing(self) -> None:
        self._conn.resume_writing()


class UpstreamPool:
    """Keep-alive connections to one ``host:port`` (TLS when ``tls`` is set)."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        tls: ssl.SSLContext | None,
        server_hostname: str | None,
        connect_timeout: float,
        keepalive: float = 30.0,
        max_idle: int = 64,
    ) -> None:
        self._host, self._port, self.tls = host, port, tls
        self._server_hostname = server_hostname
        self._connect_timeout = connect_timeout or None
        self._keepalive = keepalive
        self._max_idle = max_idle
        self._idle: list[UpstreamConnection] = []
        self._all: set[UpstreamConnection] = set()
        self._room = asyncio.Event()  # a connection closed or given back (out of descriptors)
        self.opened = 0  # connections ever opened (for tests and benchmarks)

    async def acquire(self, now: float | None = None) -> tuple[UpstreamConnection, bool]:
        """A connection and whether it was reused from the pool (``now``: the caller's
        ``time.monotonic()`` of this instant, if it has one)."""
        conn = self.take(now)
        if conn is not None:
            return conn, True
        return await self.connect(), False

    def take(self, now: float | None = None) -> UpstreamConnection | None:
        """An idle connection still within its keep-alive, or ``None`` (:meth:`acquire`
        without its coroutine, for the relay's hot path; ``connect`` when it is ``None``)."""
        if now is None:
            now = time.monotonic()
        idle = self._idle
        while idle:
            conn = idle.pop()
            if conn.closed:
                continue
            if now - conn.idle_since > self._keepalive:
                conn.close()
                continue
            return conn
        return None

    async def connect(self, *, tunnel: bool = False) -> UpstreamConnection:
        """A new connection (for the pool, or with ``tunnel`` for an upgrade's tunnel: over
        TLS, asyncio's TLS layer then, which ``proxy.relay.tlsconnect`` explains).

        Out of descriptors (EMFILE: the client connections took them all), it waits for one
        rather than failing the call at once (a 503), as Go's servers back off on EMFILE: an
        idle pooled connection is closed to make room, and the dial is tried again when a
        connection of the pool closes or is given back, or after a backoff (a client leaving
        frees one too), for at most the connect timeout."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + (self._connect_timeout or ROOM_BOUND)
        wait = ROOM_FIRST
        while True:
            try:
                return await self._dial(loop, tunnel)
            except OSError as e:
                if e.errno not in OUT_OF_FILES or loop.time() >= give_up:
                    raise
            idle = self._idle
            if idle:  # (its descriptor is freed once it is closed: connection_lost)
                idle.pop(0).close()  # the coldest
            self._room.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(wait, max(give_up - loop.time(), 0.0))):
                    await self._room.wait()
            wait = min(wait * 2, ROOM_MAX)

    async def _dial(self, loop: asyncio.AbstractEventLoop, tunnel: bool) -> UpstreamConnection:
        tls = self.tls
        try:
            async with asyncio.timeout(self._connect_timeout):
                if tunnel:
                    conn = UpstreamConnection(self, loop)
                    await tlsconnect.open_connection(conn, self._host, self._port, tls=tls,
                                                     server_hostname=self._server_hostname)
                else:
                    _, conn = await loop.create_connection(
                        lambda: UpstreamConnection(self, loop), self._host, self._port,
                        ssl=tls,
                        server_hostname=(self._server_hostname or self._host) if tls else None,
                    )
        except TimeoutError as e:
            raise ConnectTimeout(f"connect to {self._host}:{self._port} timed out") from e
        self.opened += 1
        self._all.add(conn)
        return conn

    def release(self, conn: UpstreamConnection) -> None:
        if len(self._idle) >= self._max_idle:
            conn.close()
            return
        if conn.paused:
            # its response ended while the client's write buffer was full: the client's
            # resume_writing no longer reaches it (the call is over), so resume here, or the
            # next call on this connection would never read its answer (a 504 after the
            # header timeout)
            conn.resume_reading()
        conn.idle_since = time.monotonic()
        self._idle.append(conn)
        self._room.set()

    def discard(self, conn: UpstreamConnection) -> None:
        self._all.discard(conn)
        self._room.set()

    def close(self) -> None:
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
        self._all.clear()
