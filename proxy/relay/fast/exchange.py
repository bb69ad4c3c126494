"""One relayed response: the upstream's head and body, written to the client as they arrive.

An :class:`Exchange` is what an :class:`~proxy.relay.fast.upstream.UpstreamConnection` calls
back. The upstream's ``Content-Length`` framing is kept; a chunked or close-delimited body is
sent chunked to an HTTP/1.1 client (each upstream read is one chunk, so a watch event leaves as
soon as it arrives) and close-delimited to an HTTP/1.0 one. For ordinary calls the head is held
back and leaves with the first body bytes (one segment); a long-running call's head leaves at
once, as clients wait for it before the first event.

After an upgrade's ``101`` (``on_switch``) the head leaves at once with the upstream's
``Connection``/``Upgrade`` headers, and every later byte is relayed raw until either side closes.

Timers: ``arm`` bounds the wait for the upstream's head (504), ``limit`` the whole call (504
before the head, the response cut short after it), ``idle`` the silence of a long-running
response (a watch then ends cleanly, as the apiserver's own timeout ends it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from proxy.relay.fast.server import ClientConnection
from proxy.relay.fast.wire import Headers, response_head, switch_head

__all__ = ["Exchange"]

_LAST_CHUNK = b"0\r\n\r\n"


class Exchange:
    """Receives one upstream response and writes it to ``client``."""

    __slots__ = (
        "_chunked",
        "_defer",
        "_extra",
        "_head_only",
        "_http11",
        "_idle",
        "_last",
        "_pending",
        "_timer",
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
        *,
        extra: Iterable[tuple[str, str]],
        defer_head: bool,
        head_only: bool,
        http11: bool,
        keep_alive: bool,
    ) -> None:
        loop = asyncio.get_running_loop()
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
        self._pending = b""
        self._timer: asyncio.TimerHandle | None = None
        self._idle = 0.0
        self._last = 0.0
        self.expired = False  # a timer ended it: the upstream connection is not reusable
        self.switched = False

    # --- timers ------------------------------------------------------------------------
    def arm(self, seconds: float) -> None:
        """Fail ``head`` with ``TimeoutError`` unless the upstream's head arrives in time."""
        if seconds:
            self._timer = asyncio.get_running_loop().call_later(seconds, self._timed_out)

    def _timed_out(self) -> None:
        if not self.head.done():
            self.expired = True
            self.head.set_exception(TimeoutError("no response head in time"))

    def limit(self, seconds: float) -> asyncio.TimerHandle | None:
        """End the call after ``seconds``: 504 before the head, cut short after it."""
        if not seconds:
            return None
        return asyncio.get_running_loop().call_later(seconds, self._overran, seconds)

    def _overran(self, seconds: float) -> None:
        if self.done.done():
            return
        self.expired = True
        self.on_lost(TimeoutError(f"request timed out after {seconds:g}s"))

    def idle(self, seconds: float) -> asyncio.TimerHandle | None:
        """End a long-running response cleanly after ``seconds`` without a byte."""
        if not seconds:
            return None
        loop = asyncio.get_running_loop()
        self._idle, self._last = seconds, loop.time()
        return loop.call_later(seconds, self._idle_check)

    def _idle_check(self) -> None:
        if self.done.done():
            return
        loop = asyncio.get_running_loop()
        left = self._last + self._idle - loop.time()
        if left > 0:
            loop.call_later(left, self._idle_check)
            return
        self.expired = True
        if not self.head.done():
            self.head.set_exception(TimeoutError(f"no response in {self._idle:g}s"))
            return
        timeout = TimeoutError(f"watch idle for {self._idle:g}s")
        if self._chunked or self.close_client:  # an end the client reads as complete
            self.error = timeout
            self.on_complete()
        else:  # a length-framed body cannot end early: cut it short
            self.on_lost(timeout)

    # --- called by the upstream connection -----------------------------------------
    def on_head(
        self, status: int, reason: bytes, headers: Headers, *, length: bytes | None, chunked: bool
    ) -> None:
        if self.head.done():  # timed out or cancelled meanwhile
            return
        if self._timer is not None:
            self._timer.cancel()
        self.status = status
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
        head = response_head(
            status=status, reason=reason, headers=headers, extra=self._extra, framing=framing
        )
        if self._defer:
            self._pending = head
        else:
            self.client.write(head)
        self.head.set_result(None)

    def on_switch(self, reason: bytes, headers: Headers) -> None:
        if self.head.done():
            return
        if self._timer is not None:
            self._timer.cancel()
        self.status = 101
        self.switched = True
        self.close_client = True
        self.client.write(switch_head(reason=reason, headers=headers, extra=self._extra))
        self.head.set_result(None)

    def on_body(self, chunk: bytes) -> None:
        if not self.head.done() or self.done.done():
            return
        if self._idle:
            self._last = asyncio.get_running_loop().time()
        self.sent += len(chunk)
        if self._chunked:
            chunk = b"%x\r\n%b\r\n" % (len(chunk), chunk)
        if self._pending:
            chunk, self._pending = self._pending + chunk, b""
        self.client.write(chunk)

    def on_complete(self) -> None:
        if not self.head.done() or self.done.done():
            return
        tail = _LAST_CHUNK if self._chunked else b""
        if self._pending:
            tail, self._pending = self._pending + tail, b""
        if tail:
            self.client.write(tail)
        self.done.set_result(True)

    def on_lost(self, exc: BaseException) -> None:
        if self._timer is not None:
            self._timer.cancel()
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
