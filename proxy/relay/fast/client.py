"""opgate's own calls to the apiserver (informers, quota counts, TokenReview, JWKS), fast core.

The relay's :class:`~proxy.relay.fast.upstream.UpstreamPool` and exchanges, used as a small
client: :meth:`UpstreamClient.call` answers a whole (bounded) body, :meth:`UpstreamClient.stream`
hands a long response (a watch) over chunk by chunk as it arrives, pausing the connection while
the reader lags. Each client has a pool of its own, so these calls never queue behind relayed
ones, and the token is the relay's (``--token-file``, kubeconfig or in-cluster). No HTTP library
is loaded for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from proxy.engine.jsonbody import loads
from proxy.relay.endpoint import Endpoint, TokenSource
from proxy.relay.fast.upstream import UpstreamConnection, UpstreamPool
from proxy.relay.fast.wire import Headers

__all__ = ["Answer", "ClientError", "UpstreamClient", "json_lines"]

MAX_BODY = 64 * 1024 * 1024  # a LIST page of 500 metadata-only objects is far below this
MAX_EVENT = 16 * 1024 * 1024  # one watch event
_HIGH, _LOW = 32, 8  # chunks queued before the connection pauses, and before it resumes


class ClientError(ConnectionError):
    """The call failed before a whole answer arrived (connect, TLS, reset, too large)."""


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes

    def json(self) -> Any:
        """The body as JSON, as deep as the apiserver writes it (:mod:`proxy.engine.jsonbody`)."""
        return loads(self.body)

    def message(self) -> str:
        """The ``message`` of a Kubernetes Status body, if there is one (never a token)."""
        try:
            doc = loads(self.body[:65536])
        except ValueError:
            return ""
        return str(doc.get("message", ""))[:200] if isinstance(doc, dict) else ""


class _Exchange:
    """Receives one response: the head, then body chunks into a bounded queue."""

    def __init__(self, conn: UpstreamConnection, limit: int) -> None:
        loop = asyncio.get_running_loop()
        self.head: asyncio.Future[int] = loop.create_future()
        self._conn = conn
        self._limit = limit
        self._size = 0
        self._chunks: deque[bytes] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self.ended = False
        self.error: BaseException | None = None

    def on_head(
        self, status: int, reason: bytes, headers: Headers, *, length: bytes | None, chunked: bool
    ) -> None:
        if not self.head.done():
            self.head.set_result(status)

    def on_switch(self, reason: bytes, headers: Headers) -> None:
        self.on_lost(ClientError("the apiserver switched protocols"))

    def on_body(self, chunk: bytes) -> None:
        self._size += len(chunk)
        if self._size > self._limit:
            self.on_lost(ClientError(f"answer larger than {self._limit} bytes"))
            self._conn.close()
            return
        self._chunks.append(chunk)
        if len(self._chunks) >= _HIGH and not self._paused:
            self._paused = True
            self._conn.pause_reading()
        self._wake()

    def on_view(self, view: memoryview) -> bool:
        self.on_body(view.tobytes())  # kept until read
        return False

    def pass_chunked(self) -> None:
        return None  # its reader wants the data alone

    def splice_to(self) -> None:
        return None  # ... and keeps it

    def on_spliced(self, size: int) -> None:
        raise AssertionError("never called: splice_to answers None")

    def abort_client(self) -> None:
        raise AssertionError("never called: splice_to answers None")

    def on_raw(self, data: bytes, size: int) -> None:
        raise AssertionError("never called: pass_chunked answers None")

    def on_complete(self) -> None:
        self.ended = True
        self._wake()

    def on_lost(self, exc: BaseException) -> None:
        if not self.head.done():
            self.head.set_exception(exc)
        elif not self.ended and self.error is None:
            self.error = exc
        self._wake()

    def on_deadline(self) -> None:
        """Never called: these calls set no deadline on the connection (``asyncio.timeout``)."""

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def chunks(self, idle: float | None) -> AsyncIterator[bytes]:
        """Body chunks as they arrive; ``TimeoutError`` after ``idle`` seconds without one."""
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                if self._paused and len(self._chunks) <= _LOW:
                    self._paused = False
                    self._conn.resume_reading()
                yield chunk
            elif self.error is not None:
                raise ClientError(str(self.error)) from self.error
            elif self.ended:
                return
            else:
                self._waiter = asyncio.get_running_loop().create_future()
                async with asyncio.timeout(idle):
                    await self._waiter


class UpstreamClient:
    """GETs, POSTs and watches against the upstream with opgate's own credentials."""

    def __init__(self, endpoint: Endpoint, token: TokenSource, *, connect_timeout: float,
                 user_agent: str = "opgate", pool: UpstreamPool | None = None) -> None:
        """``pool``: connections to share (the relay's, for its readiness probe); by default
        a pool of its own."""
        self._endpoint = endpoint
        self._token = token
        self._host = endpoint.host_header.encode("latin-1")
        self._prefix = endpoint.prefix.encode("latin-1")
        self._agent = user_agent.encode("latin-1")
        self.pool = pool or UpstreamPool(
            host=endpoint.host, port=endpoint.port, tls=endpoint.tls,
            server_hostname=endpoint.server_name, connect_timeout=connect_timeout, max_idle=4)

    def close(self) -> None:
        self.pool.close()

    def _head(self, method: str, path: str, accept: str, body: bytes | None) -> bytes:
        lines = [method.encode(), b" ", self._prefix, path.encode("latin-1"), b" HTTP/1.1\r\n",
                 b"Host: ", self._host, b"\r\nAccept: ", accept.encode("latin-1"),
                 b"\r\nUser-Agent: ", self._agent, b"\r\n"]
        auth = self._token.authorization()
        if auth:
            lines += (b"Authorization: ", auth.encode("latin-1"), b"\r\n")
        if body is not None:
            lines.append(b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body))
        lines.append(b"\r\n")
        return b"".join(lines) + (body or b"")

    @contextlib.asynccontextmanager
    async def stream(
        self, path: str, *, accept: str = "application/json", head_timeout: float = 60.0,
        idle: float | None = None, limit: int = 1 << 62,
    ) -> AsyncIterator[tuple[int, AsyncIterator[bytes]]]:
        """``GET path``: its status and its body chunks (``idle``: most seconds between two).

        A stream left before its end closes its connection; a finished one is reused."""
        data = self._head("GET", path, accept, None)
        async with self._exchange(data, head_timeout, limit) as (status, exchange):
            yield status, exchange.chunks(idle)

    async def call(
        self, method: str, path: str, *, accept: str = "application/json",
        body: Any = None, within: float = 60.0, limit: int = MAX_BODY,
    ) -> Answer:
        """One whole call: ``body`` (if any) is sent as JSON; the answer is read in full."""
        raw = json.dumps(body).encode() if body is not None else None
        data = self._head(method, path, accept, raw)
        async with asyncio.timeout(within), self._exchange(data, None, limit) as (status, ex):
            return Answer(status, b"".join([c async for c in ex.chunks(None)]))

    @contextlib.asynccontextmanager
    async def _exchange(
        self, data: bytes, head_timeout: float | None, limit: int
    ) -> AsyncIterator[tuple[int, _Exchange]]:
        for attempt in (0, 1):
            conn, reused = await self.pool.acquire()
            exchange = _Exchange(conn, limit)
            conn.send(exchange, data)
            try:
                async with asyncio.timeout(head_timeout):
                    status = await exchange.head
            except OSError as e:
                conn.close()
                if attempt == 0 and reused and not conn.received:
                    continue  # a stale keep-alive connection: once more on a fresh one
                raise ClientError(str(e) or type(e).__name__) from e
            except BaseException:
                conn.close()
                raise
            try:
                yield status, exchange
            finally:
                if not exchange.ended:
                    conn.close()
            return


async def json_lines(chunks: AsyncIterator[bytes], *, limit: int = MAX_EVENT) -> AsyncIterator[Any]:
    """The JSON documents of a watch stream, one per line, as their lines complete.

    ``ClientError`` for a line longer than ``limit``; ``ValueError`` for one that is not JSON."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        if b"\n" not in chunk:
            if len(buf) > limit:
                raise ClientError(f"a watch event larger than {limit} bytes")
            continue
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.strip():
                yield loads(line)
