"""One relayed response: the upstream's head and body, written to the client as they arrive.

An :class:`Exchange` is what an :class:`~proxy.relay.fast.upstream.UpstreamConnection` calls
back. The upstream's ``Content-Length`` framing is kept; a chunked or close-delimited body is
sent chunked to an HTTP/1.1 client (each upstream read is one chunk, so a watch event leaves as
soon as it arrives) and close-delimited to an HTTP/1.0 one. For ordinary calls the head is held
back and leaves with the first body bytes (one segment); a long-running call's head leaves at
once, as clients wait for it before the first event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from proxy.relay.fast.server import ClientConnection
from proxy.relay.fast.wire import Headers, response_head

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
        "_pending",
        "_timer",
        "client",
        "close_client",
        "done",
        "error",
        "head",
        "sent",
        "status",
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

    def arm(self, seconds: float) -> None:
        """Fail ``head`` with ``TimeoutError`` unless the upstream's head arrives in time."""
        if seconds:
            self._timer = asyncio.get_running_loop().call_later(seconds, self._timed_out)

    def _timed_out(self) -> None:
        if not self.head.done():
            self.head.set_exception(TimeoutError("no response head in time"))

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

    def on_body(self, chunk: bytes) -> None:
        if not self.head.done() or self.done.done():
            return
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
        elif not self.done.done():
            self.error = exc
            if self._pending:  # the head was held back: send it, then cut the body short
                self.client.write(self._pending)
                self._pending = b""
            self.done.set_result(False)
