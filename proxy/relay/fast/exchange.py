"""One relayed response: the upstream's head and body, written to the client as they arrive.

An :class:`Exchange` is what an :class:`~proxy.relay.fast.upstream.UpstreamConnection` calls
back. The upstream's ``Content-Length`` framing is kept; a chunked or close-delimited body is
sent chunked to an HTTP/1.1 client (each upstream read is one chunk, so a watch event leaves as
soon as it arrives) and close-delimited to an HTTP/1.0 one. An upstream's chunked body goes to
an HTTP/1.1 client as it came, framing and all (:meth:`Exchange.pass_chunked`, then ``on_raw``
per read), unless a subclass sees the body (:class:`~proxy.relay.fast.tapped.TappedExchange`).
A long-running call's exchange is a :class:`~proxy.relay.fast.watch.WatchExchange`: a watch it
ends (shutdown, idle timeout), it ends between two events.
For ordinary calls the head is held back and leaves with the first body bytes (one segment); a
long-running call's head leaves at once, as clients wait for it before the first event.

After an upgrade's ``101`` (``on_switch``) the head leaves at once with the upstream's
``Connection``/``Upgrade`` headers, and every later byte is relayed raw until either side closes.

Timers: :meth:`Exchange.limits` bounds the wait for the upstream's head, the whole call and the
silence of a long-running response. The exchange keeps only its next deadline, on the timer of
the upstream connection it is lent to (:class:`~proxy.relay.lazytimer.LazyTimer`), which calls
:meth:`Exchange.on_deadline` when it passes: calls in a row on a kept-alive connection move one
deadline instead of arming and cancelling a loop timer each, and a body chunk only notes the
time (the silence's deadline is moved when the timer fires).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from proxy.relay.fast.chunked import ChunkedFraming
from proxy.relay.fast.server import ClientConnection
from proxy.relay.fast.splice import tcp_socket_fd
from proxy.relay.fast.upstream import UpstreamConnection
from proxy.relay.fast.wire import Headers, response_head, switch_head

__all__ = ["Exchange"]

_LAST_CHUNK = b"0\r\n\r\n"
_COPY_BELOW = 16 * 1024  # smaller chunks leave in one buffer with their framing (one send)


class Exchange:
    """Receives one upstream response and writes it to ``client``."""

    PASSES_CHUNKED = True  # whether a chunked body may go through as it came (pass_chunked)
    SPLICES = True  # whether a long length-framed body may go socket to socket (splice_to)

    __slots__ = (
        "_chunked",
        "_conn",
        "_defer",
        "_extra",
        "_framing",
        "_head_by",
        "_head_only",
        "_http11",
        "_idle",
        "_last",
        "_loop",
        "_open_ended",
        "_pending",
        "_total",
        "_total_by",
        "client",
        "close_client",
        "done",
        "error",
        "expired",
        "head",
        "sent",
        "status",
        "switched",
    )

    def __init__(
        self,
        client: ClientConnection,
        extra: Iterable[tuple[str, str]],
        defer_head: bool,
        head_only: bool,
        http11: bool,
        keep_alive: bool,
    ) -> None:
        loop = self._loop = client.loop
        self.client = client
        self.head: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[bool] = loop.create_future()
        self.close_client = not keep_alive
        self.status = 0
        self.sent = 0
        self.error: BaseException | None = None
        self._extra = extra
        self._defer = defer_head
        self._head_only = head_only
        self._http11 = http11
        self._chunked = False
        self._open_ended = False  # the client finds the body's end in chunks or the close
        self._framing: ChunkedFraming | None = None
        self._pending = b""
        self._conn: UpstreamConnection | None = None  # whose timer holds the deadline
        self._head_by = self._total_by = self._total = self._idle = self._last = 0.0
        self.expired = False  # a timer ended it: the upstream connection is not reusable
        self.switched = False

    # --- timers (one deadline at a time, on the connection's timer) ----------------------
    def limits(
        self, conn: UpstreamConnection, *, head: float, total: float = 0.0, idle: float = 0.0
    ) -> None:
        """Seconds (0: none) for the upstream's head (then 504), for the whole call (504 before
        the head, cut short after it) and for a long-running response's silence (it then ends
        cleanly, as the apiserver's own timeout ends a watch). ``conn``: the connection this
        exchange was sent on (its ``timer`` keeps the deadline)."""
        self._conn = conn
        now = self._last = self._loop.time()
        self._head_by = now + head if head else 0.0
        self._total, self._total_by = total, (now + total if total else 0.0)
        self._idle = idle
        self._schedule()

    def cancel_timer(self) -> None:
        """Forget the deadline (cheap: no loop timer is cancelled). Only while the connection
        is still lent to this exchange: once given back it may already carry the next call,
        whose deadline is not this one's to forget (the connection forgot this one then)."""
        conn = self._conn
        if conn is not None and conn.exchange is self:
            conn.timer.clear()

    def _schedule(self) -> None:
        if not self.head.done():  # the head's deadline, or the whole call's if sooner
            due = self._head_by
            if self._total_by and (not due or self._total_by < due):
                due = self._total_by
        else:  # the whole call's deadline, or the body's silence if sooner
            due = self._total_by
            if self._idle and (not due or self._last + self._idle < due):
                due = self._last + self._idle
        conn = self._conn
        if conn is not None:
            if due:
                conn.timer.set(due)
            else:
                conn.timer.clear()

    def on_deadline(self) -> None:
        """The deadline set last has passed: end the call, or set the next deadline (the
        silence's moves with each chunk; the head's ends with it)."""
        if self.done.done():
            return
        now = self._loop.time()
        if not self.head.done():
            if self._total_by and now >= self._total_by:
                why = f"request timed out after {self._total:g}s"
            elif self._head_by and now >= self._head_by:
                why = "no response head in time"
            else:
                self._schedule()
                return
            self.expired = True
            self.head.set_exception(TimeoutError(why))
        elif self._total_by and now >= self._total_by:
            self.expired = True
            self.on_lost(TimeoutError(f"request timed out after {self._total:g}s"))
        elif self._idle and now >= self._last + self._idle:
            self.expired = True
            timeout = TimeoutError(f"watch idle for {self._idle:g}s")
            if self._open_ended:  # an end the client reads as complete
                self.error = timeout
                self._end_idle()
            else:  # a length-framed body cannot end early: cut it short
                self.on_lost(timeout)
        else:
            self._schedule()

    def _end_idle(self) -> None:
        """The silence has passed: end the body now (a watch waits for an event's end)."""
        self.on_complete()

    # --- called by the upstream connection -----------------------------------------
    def on_head(
        self, status: int, reason: bytes, headers: Headers, *, length: bytes | None, chunked: bool
    ) -> None:
        if self.head.done():  # timed out or cancelled meanwhile
            return
        if self._idle or not self._total_by:  # the head's deadline is over
            self.cancel_timer()
        self.status = status
        conn = self._conn
        if conn is not None and conn.body_pending:  # answered before the request body came
            self.close_client = True  # whole: the connection ends after it (ClientConnection
            # .linger), as the apiserver said (its Connection: close is hop-by-hop, not relayed)
        elif self.client.draining:  # (the connection ends after this call: say so)
            self.close_client = True
        if length is not None:
            framing = b"Content-Length: " + length + b"\r\n"
        elif self._head_only or status in (204, 304):
            framing = b""
        elif self._http11:
            framing = b"Transfer-Encoding: chunked\r\n"
            self._chunked = True
        else:
            framing = b""
            self.close_client = True
        if self.close_client:
            framing += b"Connection: close\r\n"
        # (not a Content-Length body, even on a connection that closes after it: its client
        # reads an end before the length as a body cut short)
        self._open_ended = self._chunked or (self.close_client and length is None)
        head = response_head(
            status=status, reason=reason, headers=headers, extra=self._extra, framing=framing
        )
        if self._defer:
            self._pending = head
        else:
            self.client.write(head)
        self.head.set_result(None)
        if self._idle:
            self._schedule()  # from now on: the silence of the body

    def on_switch(self, reason: bytes, headers: Headers) -> None:
        if self.head.done():
            return
        self.cancel_timer()
        self.status = 101
        self.switched = True
        self.close_client = True
        self.client.write(switch_head(reason=reason, headers=headers, extra=self._extra))
        self.head.set_result(None)

    def on_body(self, chunk: bytes | memoryview) -> None:
        if not self.head.done() or self.done.done():
            return
        if self._idle:
            self._last = self._loop.time()
        size = len(chunk)
        self.sent += size
        if size > _COPY_BELOW and not self._pending:  # big: frame it without copying it
            if self._chunked:
                self.client.writelines((b"%x\r\n" % size, chunk, b"\r\n"))
            else:
                self.client.write(chunk)
            return
        if self._chunked:
            chunk = b"%x\r\n%b\r\n" % (size, chunk)  # type: ignore[str-format]  # %b: any buffer
        if self._pending:
            chunk, self._pending = self._pending + chunk, b""
        self.client.write(chunk)

    def on_view(self, view: memoryview) -> bool:
        self.on_body(view)  # written as is, or framed into new bytes
        return self.client.holds_writes()  # then the transport may still refer to it

    def splice_to(self) -> int | None:
        """The client's socket when the rest of a long length-framed body may be spliced to it:
        plain TCP, and nothing of this call waiting in its write buffer (the held-back head is
        written first: the spliced bytes must follow it). ``None``: through ``on_view``."""
        if not self.SPLICES or self._chunked or self.done.done() or not self.head.done():
            return None
        client = self.client
        if client.closed:
            return None
        fd = tcp_socket_fd(client.transport)
        if fd is None:
            return None
        if self._pending:
            client.write(self._pending)
            self._pending = b""
        return None if client.holds_writes() else fd

    def on_spliced(self, size: int) -> None:
        self.sent += size
        if self._idle:
            self._last = self._loop.time()

    def abort_client(self) -> None:
        self.client.abort()

    def pass_chunked(self) -> ChunkedFraming | None:
        """The upstream's chunked body goes to the client chunked anyway: as it came."""
        if not self._chunked or not self.PASSES_CHUNKED or self.done.done():
            return None
        framing = self._framing = ChunkedFraming()
        return framing

    def on_raw(self, data: bytes, size: int) -> None:
        if self.done.done():
            return
        if self._idle:
            self._last = self._loop.time()
        self.sent += size
        if self._pending:
            pending, self._pending = self._pending, b""
            if len(data) > _COPY_BELOW:
                self.client.writelines((pending, data))
            else:
                self.client.write(pending + data)
            return
        self.client.write(data)

    def on_complete(self) -> None:
        if not self.head.done() or self.done.done():
            return
        framing = self._framing
        tail: bytes | None
        if framing is None:
            tail = _LAST_CHUNK if self._chunked else b""
        else:  # passed through: ended by the upstream, or by a deadline between two chunks
            tail = b"" if framing.ended else framing.closing()
            if tail is None:  # a deadline inside a chunk: no clean end, cut it short
                self.on_lost(self.error or ConnectionResetError("ended inside a chunk"))
                return
        if self._pending:
            tail, self._pending = self._pending + tail, b""
        if tail:
            self.client.write(tail)
        self.done.set_result(True)

    def end(self) -> bool:
        """At shutdown: end a long-running response now if its client can read it as complete
        (chunked and between two chunks, or close-delimited; never one of a Content-Length),
        as the watch idle timeout does;
        whether it has ended (``False``: no head yet, a tunnel, or inside a chunk; a watch
        inside an event too)."""
        if self.done.done():
            return True
        if not self.head.done() or self.switched or not self._open_ended:
            return False
        if not self._between():
            return False
        self.cancel_timer()
        self.expired = True  # the upstream is still sending: its connection is not reusable
        self.on_complete()
        return True

    def _between(self) -> bool:
        """Whether the body passed on so far may end here: between two chunks when passed
        through as it came (a watch: between two events too)."""
        framing = self._framing
        return framing is None or framing.ended or framing.closing() is not None

    def on_lost(self, exc: BaseException) -> None:
        self.cancel_timer()
        if not self.head.done():
            self.head.set_exception(exc)
        elif self.switched:  # either side closing ends a tunnel
            if not self.done.done():
                self.done.set_result(True)
        elif not self.done.done():
            self.error = exc
            if self._pending:  # the head was held back: send it, then cut the body short
                self.client.write(self._pending)
                self._pending = b""
            self.done.set_result(False)
