"""The :class:`Exchange` of a long-running call: a watch it ends (at shutdown, at the idle
timeout) ends between two of its events, never inside one.

The apiserver splits an event over two chunks when its chunked writer's 2,048-byte buffer fills
(the rest follows a moment later), so an end between two chunks may still be inside an event.
For a watch (:meth:`WatchExchange.watch`) whose ``Content-Type`` says where its events end
(:mod:`proxy.relay.events`: JSON lines, protobuf frames) the body passed on is followed, through
the chunked framing when it passes as it came, else chunk by chunk. Asked to end inside an event
(``end`` at shutdown, or the idle timeout), it ends with the piece that completes the event
(passed as it came: right after the chunk that does, the next events of the same read left
unsent); one that does not come within ``LONG_RUNNING_END`` (1 s) is cut, as inside a chunk:
the client sees a broken stream rather than a short event read as whole.

Only long-running calls use this class (and tapped ones: :class:`TappedExchange` builds on it),
so every other call pays nothing for it.
"""

from __future__ import annotations

from typing import Any

from proxy.relay.events import EventEnds, event_ends
from proxy.relay.fast import server
from proxy.relay.fast.chunked import ChunkedFraming
from proxy.relay.fast.exchange import Exchange
from proxy.relay.fast.server import ClientConnection
from proxy.relay.fast.wire import Headers

__all__ = ["WatchExchange"]


class WatchExchange(Exchange):
    __slots__ = ("_events",)

    def __init__(self, client: ClientConnection, *args: Any, **options: Any) -> None:
        super().__init__(client, *args, **options)
        self._events: EventEnds | None = None  # a watch's: where its events end

    def watch(self) -> None:
        """The call is a watch: follow where its events end once its head says how."""
        self._events = EventEnds()  # (until then: anywhere)

    def on_head(
        self, status: int, reason: bytes, headers: Headers, *, length: bytes | None, chunked: bool
    ) -> None:
        super().on_head(status, reason, headers, length=length, chunked=chunked)
        if self._events is not None:  # (a length-framed body never ends early: not followed)
            self._events = event_ends(_content_type(headers)) if self._open_ended else None

    def pass_chunked(self) -> ChunkedFraming | None:
        framing = super().pass_chunked()
        if framing is not None:
            framing.events = self._events
        return framing

    def on_body(self, chunk: bytes | memoryview) -> None:
        events = self._events
        if events is None:
            super().on_body(chunk)
            return
        if self.head.done() and not self.done.done():
            events.data(chunk, 0, len(chunk))
        super().on_body(chunk)
        if events.ending:  # asked to end inside an event: this piece may end it
            self.end()

    def on_raw(self, data: bytes, size: int) -> None:
        super().on_raw(data, size)  # (the framing showed its data to the events already)
        events = self._events
        if events is not None and events.ending:
            self.end()

    def on_deadline(self) -> None:
        events = self._events
        if events is None or not events.ending or self.done.done():
            super().on_deadline()
            return
        now = self._loop.time()  # asked to end inside an event, and it has not ended yet
        if now >= events.ending:
            self.expired = True
            self.on_lost(self.error or TimeoutError("ended inside an event"))
        elif self._conn is not None:
            self._conn.timer.set(events.ending)

    def _end_idle(self) -> None:
        events = self._events
        if events is None or self._between():
            super()._end_idle()
            return
        # inside an event (or a chunk): the piece that ends it ends the watch; else it is cut
        # at ``ending``
        events.ending = self._loop.time() + server.LONG_RUNNING_END
        if self._conn is not None:
            self._conn.timer.set(events.ending)

    def _between(self) -> bool:
        events = self._events
        return super()._between() and (events is None or events.between)

    def end(self) -> bool:
        if super().end():
            return True
        events = self._events
        if events is not None and not events.ending and self.head.done():
            # inside an event (or a chunk): the piece that ends it ends the watch (the
            # listener cuts it at its LONG_RUNNING_END)
            events.ending = self._loop.time() + server.LONG_RUNNING_END
        return False


def _content_type(headers: Headers) -> bytes:
    for name, value in headers:
        if len(name) == 12 and name.lower() == b"content-type":
            return value
    return b""
