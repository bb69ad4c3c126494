"""An :class:`Exchange` that also shows the response to the call's tap (``ctx.tap``, set by a
middleware such as traffic capture): the head as received, then each body chunk as it is
forwarded. Used only for calls with a tap, so every other call pays nothing per chunk. After an
upgrade's ``101`` the tunnelled bytes are not shown. The body goes through the parser, chunk by
chunk: a watch's events are followed there (:class:`~proxy.relay.fast.watch.WatchExchange`)."""

from __future__ import annotations

from typing import Any

from proxy.engine.context import BodyTap
from proxy.relay.fast.server import ClientConnection
from proxy.relay.fast.watch import WatchExchange
from proxy.relay.fast.wire import Headers

__all__ = ["TappedExchange"]


class TappedExchange(WatchExchange):  # (a watch ends between two events, as untapped)
    __slots__ = ("tap",)

    PASSES_CHUNKED = False  # the tap is shown the body's data, so the parser takes the framing
    SPLICES = False  # ... and it is shown every byte of a long body, which splicing never sees

    def __init__(self, tap: BodyTap, client: ClientConnection, *args: Any,
                 **options: Any) -> None:
        super().__init__(client, *args, **options)
        self.tap = tap

    def on_head(
        self, status: int, reason: bytes, headers: Headers, *, length: bytes | None, chunked: bool
    ) -> None:
        if not self.head.done():
            self.tap.response_head(status, reason, headers)
        super().on_head(status, reason, headers, length=length, chunked=chunked)

    def on_switch(self, reason: bytes, headers: Headers) -> None:
        if not self.head.done():
            self.tap.response_head(101, reason, headers)
        super().on_switch(reason, headers)

    def on_body(self, chunk: bytes | memoryview) -> None:
        if self.head.done() and not self.done.done() and not self.switched:
            self.tap.response_body(bytes(chunk))
        super().on_body(chunk)

    def on_view(self, view: memoryview) -> bool:
        self.on_body(view.tobytes())  # the tap may keep what it is shown
        return False
