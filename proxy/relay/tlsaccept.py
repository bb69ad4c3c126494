"""The TLS API listener's accept: a plain HTTP request gets Go's answer, not a silent close.

A client pointed at the ``http://`` of opgate's TLS port (curl, a kubeconfig with the wrong
scheme) sent its request into the TLS layer, which failed the handshake and closed: "Empty reply
from server", nothing to say why. Go's net/http (the apiserver's, ``kubectl proxy``'s) answers a
first record that begins as an HTTP request does (``GET /``, ``HEAD``, ``POST``, ``PUT /``,
``OPTIO``: its ``tlsRecordHeaderLooksLikeHTTP``) with ``HTTP/1.0 400 Bad Request`` and ``Client
sent an HTTP request to an HTTPS server.``, and closes; opgate answers the same.

So the listener accepts plain TCP, and each connection starts with a :class:`Sniffer`, which
reads its first bytes. A TLS record begins with its content type (22 for the ClientHello), never
with ``G``, ``H``, ``P`` or ``O``: a connection whose first byte is none of those is handed, with
the bytes read, to the loop's own TLS layer, built as ``create_server(ssl=...)`` builds it
(uvloop's, or asyncio's), the handshake timed from the accept; the bytes are put in the layer's
buffer as the transport's next read would have put them. (Peeking at them with ``MSG_PEEK``
instead cannot be done on uvloop: its transport starts reading right after ``connection_made``,
paused or not.) From then on the sniffer is out of the way: nothing more per request. A client
that sends nothing is closed after ``HANDSHAKE_TIMEOUT``, as the TLS layer closed it. The answer
to a plain request is followed by its rest read and dropped until the client closes (or
``LINGER``): closed with bytes unread, the socket is reset, and the reset can overtake the
answer.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from asyncio import sslproto
from collections.abc import Callable
from typing import Any, cast

from proxy.engine.limitlog import log_limited

__all__ = ["ANSWER", "HANDSHAKE_TIMEOUT", "accepting"]

log = logging.getLogger("opgate.listen")

HANDSHAKE_TIMEOUT = 60.0  # seconds from the accept (asyncio's and uvloop's own default)
LINGER = 10.0  # seconds the rest of a refused request is read and dropped, at most
ANSWER = b"HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS server.\n"
_LOOKS_LIKE_HTTP = (b"GET /", b"HEAD ", b"POST ", b"PUT /", b"OPTIO")  # (Go's five bytes)
_PLAIN_FIRST = frozenset(start[0] for start in _LOOKS_LIKE_HTTP)


def accepting(factory: Callable[[], asyncio.BaseProtocol],
              tls: ssl.SSLContext) -> Callable[[], asyncio.BaseProtocol]:
    """The protocol factory of a TLS listener serving ``factory``'s protocols over ``tls``."""
    return lambda: Sniffer(factory(), tls)


def _layer(loop: asyncio.AbstractEventLoop) -> Any:
    """The TLS layer the loop's own ``create_server(ssl=...)`` gives each connection."""
    if type(loop).__module__.startswith("uvloop"):
        from uvloop.loop import SSLProtocol  # type: ignore[attr-defined]

        return SSLProtocol
    return sslproto.SSLProtocol


class Sniffer(asyncio.Protocol):
    """A new connection until its first byte says what it speaks (module docstring)."""

    def __init__(self, app: asyncio.BaseProtocol, tls: ssl.SSLContext) -> None:
        self._app = app
        self._tls = tls
        self._transport: asyncio.Transport | None = None
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._head = b""
        self._answered = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # (uvloop's are not its subclasses)
        self._transport = transport
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + HANDSHAKE_TIMEOUT
        self._timer = loop.call_at(self._deadline, transport.abort)

    def data_received(self, data: bytes) -> None:
        transport = self._transport
        if self._answered or transport is None:
            return  # (the rest of the refused request, dropped)
        if not self._head and data[0] not in _PLAIN_FIRST:
            self._start_tls(transport, data)
            return
        self._head += data
        head = self._head[:5]
        if len(head) < 5 and any(start.startswith(head) for start in _LOOKS_LIKE_HTTP):
            return
        if head in _LOOKS_LIKE_HTTP:
            self._answer(transport)
        else:
            transport.close()  # (neither TLS nor HTTP: the TLS layer refused it too)

    def _start_tls(self, transport: asyncio.Transport, data: bytes) -> None:
        """Hand the connection to the TLS layer as the loop's TLS server does, ``data`` (the
        bytes read) in its buffer."""
        loop = asyncio.get_running_loop()
        self._stop_timer()
        handshake: asyncio.Future[None] = loop.create_future()
        layer = _layer(loop)(loop, self._app, self._tls, handshake, server_side=True,
                             ssl_handshake_timeout=max(self._deadline - loop.time(), 0.001))

        def done(future: asyncio.Future[None]) -> None:
            if future.cancelled() or future.exception() is not None:
                transport.abort()  # (the layer has closed it already; as the loops do)

        handshake.add_done_callback(done)
        self._transport = None
        transport.set_protocol(layer)  # (uvloop reads into the layer's buffer from now on)
        layer.connection_made(transport)
        view = memoryview(data)
        while view and not transport.is_closing():
            buffer = layer.get_buffer(len(view))
            n = min(len(buffer), len(view))
            buffer[:n] = view[:n]
            layer.buffer_updated(n)
            view = view[n:]

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _answer(self, transport: asyncio.Transport) -> None:
        self._answered = True
        self._head = b""
        peer = transport.get_extra_info("peername")
        log_limited(log, "plain-http", "an HTTP request from %s came to the TLS API listener: "
                    "answered 400 (its client needs https://)",
                    peer[0] if isinstance(peer, tuple) else "a Unix socket client")
        transport.write(ANSWER)
        if transport.can_write_eof():
            transport.write_eof()
        self._stop_timer()
        self._timer = asyncio.get_running_loop().call_later(LINGER, transport.close)

    def eof_received(self) -> bool:
        return False  # (the transport closes)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        self._transport = None
