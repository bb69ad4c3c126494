"""One request as the fast relay's client connection hands it to the handler: the parsed head
(byte pairs) and a body that streams (:meth:`Request.attach`) or is read whole for middlewares
(:meth:`Request.read_all`), with the connection paused while too much of it waits."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from proxy.relay.fast.wire import Headers

if TYPE_CHECKING:
    from proxy.engine.status import StatusError
    from proxy.relay.fast.server import ClientConnection

__all__ = ["BODY_HIGH_WATER", "Flow", "FlowForwarding", "Request"]

BODY_HIGH_WATER = 256 * 1024  # request body buffered before the upstream is ready


class Flow(Protocol):
    """What feeds a connection's writes, paused while that connection's write buffer is full."""

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


class FlowForwarding:
    """For a protocol: while its transport's write buffer is full, pause what feeds it."""

    flow: Flow | None = None  # the other side of the relay, set per exchange

    def pause_writing(self) -> None:
        if self.flow is not None:
            self.flow.pause_reading()

    def resume_writing(self) -> None:
        if self.flow is not None:
            self.flow.resume_reading()


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
        "connection",
        "content_length",
        "expect_continue",
        "has_body",
        "headers",
        "http11",
        "keep_alive",
        "long_running",
        "method",
        "refused",
        "tap",
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
        self.long_running = False  # set by the relay: shutdown does not wait for these
        self.expect_continue = False
        self.refused: StatusError | None = None  # the Host guard's 403: answered, recorded
        self.chunked = False
        self.connection = False  # a Connection header came: its tokens name hop-by-hop headers
        self.has_body = False
        self.content_length: bytes | None = None
        self.cancellable = True  # False during the exit hooks: a client leaving must not cut them
        self.body_done = False
        self.bytes_in = 0
        self.task: asyncio.Task[None] | None = None
        self.tap: Callable[[bytes], None] | None = None  # sees each streamed chunk (ctx.tap)
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
        """Send the buffered and every further body chunk to ``sink``; ``end`` at its end
        (and each chunk to ``tap`` first, when set)."""
        if self.tap is not None:
            sink = _tee(self.tap, sink)
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


def _tee(tap: Callable[[bytes], None], sink: Callable[[bytes], None]) -> Callable[[bytes], None]:
    def both(chunk: bytes) -> None:
        tap(chunk)
        sink(chunk)

    return both
