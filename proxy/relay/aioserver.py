"""aiohttp's low-level ``web.Server`` as the aiohttp relay's listener runs it: a request head it
refuses gets the answer the fast relay's listener gives, a Kubernetes Status.

aiohttp's own answer to a request it cannot parse is a text/plain 400, which client-go cannot
show: here it is a Status, 431 for a head past the limits, else 400 (an HTTP/1.1 request
without a ``Host`` header, or one with two, named as the apiserver names them; a malformed
``Host`` value is refused by the relay's handler). aiohttp's
parser bounds each line (``max_line_size``, ``max_field_size``) and the number of headers
(``max_headers``), not their sum: 512 headers of 64 KiB, 32 MiB held for one head. So the
bytes of each head are counted as they arrive, up to its blank line, and a head over
``MAX_HEAD`` is refused as one past a line's limit is (Go's net/http, the apiserver's, counts
the same bytes). Loaded only by the aiohttp relay.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

from proxy.relay import errors
from proxy.relay.endpoint import MAX_HEADER_LINE
from proxy.relay.fast.server import MAX_HEAD, MAX_HEADERS
from proxy.relay.response import StatusLine11
from proxy.relay.tlsaccept import Sniffer

__all__ = ["HeadTooLarge", "StatusServer"]

_END = b"\r\n\r\n"


class HeadTooLarge(BadHttpMessage):
    """A request head over ``MAX_HEAD`` bytes, each of its lines within its own limit."""


class _HeadBound:
    """aiohttp's request parser with the size of each request head bounded: the bytes from a
    head's first to its blank line are counted before the parser gets them (those of a
    request's body are not). A head that starts in the read that ended the request before it
    is counted from the next read on (less than one read uncounted: a pipelining client's)."""

    def __init__(self, parser: Any, limit: int) -> None:
        self._parser = parser
        self._limit = limit
        self._seen = 0  # bytes of the head arriving so far
        self._last = b""  # their last three (a CR LF CR LF split between two reads)
        self._body: Any = None  # the body of the last request parsed (until it ends)

    def feed_data(self, data: bytes) -> Any:
        body = self._body
        if body is None or body.is_eof():  # a head (or none yet)
            end = data.find(_END)
            if self._last:
                split = (self._last + data[:3]).find(_END)
                if split >= 0:
                    end = split - len(self._last)
            seen = self._seen + (len(data) if end < 0 else end + 4)
            if seen > self._limit:
                self._seen = seen  # (and every further read of it is refused too)
                raise HeadTooLarge(f"request head over {self._limit} bytes")
            if end < 0:
                self._seen = seen
                self._last = data[-3:] if len(data) >= 3 else (self._last + data)[-3:]
            else:
                self._seen, self._last = 0, b""
        messages, upgraded, tail = self._parser.feed_data(data)
        if messages:
            self._body = messages[-1][1]
        return messages, upgraded, tail

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parser, name)


class _Refusal(StatusLine11, web.Response):
    """The answer to a head aiohttp could not parse, in an ``HTTP/1.1`` status line, which
    says ``Connection: close`` as the fast listener's does (aiohttp adds it only to a request
    it read as HTTP/1.1; this one it could not read) and no ``Server: Python/… aiohttp/…``."""

    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        self.headers.popall("Server", None)
        self.headers["Connection"] = "close"


class _Handler(RequestHandler):
    def __init__(self, manager: web.Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        # (a stand-in for aiohttp's parser: it only forwards, with the head counted)
        self._parser = _HeadBound(self._parser, MAX_HEAD)  # type: ignore[assignment]

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status != 400:  # (the relay's handler answers its own errors)
            return super().handle_error(request, status, exc, message)
        text = message or ""
        if isinstance(exc, LineTooLong | HeadTooLarge) or "Too many headers" in text:
            answer = errors.head_too_large(MAX_HEADER_LINE, MAX_HEADERS, MAX_HEAD)
        elif errors.refused_coding(text):  # (as the fast listener: Go's 501)
            answer = errors.unsupported_coding()
        elif "'host' header" in text.lower():  # "Missing 'Host' header ...", "Duplicate ..."
            answer = errors.bad_host(0 if text.startswith("Missing") else 2)
        else:
            answer = errors.malformed_request()
        resp = _Refusal(status=answer.code, body=answer.body(), content_type="application/json")
        resp.force_close()
        return resp


class StatusServer(web.Server):
    """``web.Server`` whose connections refuse a request head with a Status (see above); with
    ``tls`` set, served over TLS by the site's plain listener, a plain HTTP request answered
    as Go answers it (:mod:`proxy.relay.tlsaccept`)."""

    tls: ssl.SSLContext | None = None

    def __call__(self) -> asyncio.BaseProtocol:  # type: ignore[override]
        handler = _Handler(self, loop=self._loop, **self._kwargs)
        return handler if self.tls is None else Sniffer(handler, self.tls)
