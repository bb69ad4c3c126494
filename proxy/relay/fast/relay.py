"""The fast relay: the same engine contract as :class:`proxy.relay.handler.Relay`, less machinery.

Per call: ``parse_request_info`` → :class:`RequestContext` → ``chain.entry`` → relay over a
pooled upstream connection → ``chain.exit``, with one task per connection and no coroutine per body
chunk: bodies flow by protocol callbacks (client → upstream through ``Request.attach``,
upstream → client through :class:`~proxy.relay.fast.exchange.Exchange`), with backpressure by
``pause_reading`` on the feeding transport whenever the other one's write buffer is full.

Upgrades (exec, attach, port-forward) get an upstream connection of their own; after the
upstream's ``101`` both connections are spliced into a raw byte tunnel (any other answer is
relayed as a normal response and the client connection closed after it). A stale pooled
connection that fails before any response byte is retried once on a fresh one when the request
is idempotent and its body can be sent again (the upstream may have acted on a POST or PATCH it
dropped unanswered: as Go's and aiohttp's clients, never send one twice). Timeouts as
:class:`~proxy.relay.handler.RelaySettings` describes them: connect, response head, the whole
call (not for long-running calls), a watch's silence.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from types import CoroutineType
from urllib.parse import unquote

import httptools

from proxy.engine.chain import Chain, settle
from proxy.engine.context import RequestContext
from proxy.engine.requestinfo import parse_request_info
from proxy.engine.status import StatusError, bad_request, internal_error
from proxy.engine.telemetry import INFLIGHT, WATCHES_OPEN, publish_levels
from proxy.relay import errors
from proxy.relay.aftercare import Aftercare
from proxy.relay.calls import (
    IMPERSONATION_DROPPED,
    PolicyStoreLike,
    RelaySettings,
    body_predicate,
    malformed_escape,
    origin_form,
    trace_ids,
)
from proxy.relay.endpoint import Endpoint, TokenSource, make_ssl_context
from proxy.relay.fast.client import UpstreamClient
from proxy.relay.fast.exchange import Exchange
from proxy.relay.fast.request import Request
from proxy.relay.fast.server import ClientConnection, FastServer
from proxy.relay.fast.tapped import TappedExchange
from proxy.relay.fast.upstream import UpstreamConnection, UpstreamPool
from proxy.relay.fast.watch import WatchExchange
from proxy.relay.fast.wire import (
    NOTHING,
    WireHeaders,
    carries_credentials,
    connection_tokens,
    header_line,
    request_head,
    status_line,
)
from proxy.relay.upstream import UpstreamConfig

__all__ = ["FastRelay"]

log = logging.getLogger("opgate.relay")

PROBE_TIMEOUT = 3.0
PROBE_LIMIT = 1 << 20  # a readyz or version answer is a few hundred bytes
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE", b"PUT", b"DELETE"})  # RFC 9110
_LAST_CHUNK = b"0\r\n\r\n"
_next_trace_id = trace_ids("-f")


class FastRelay:
    """Relays non-upgrade API calls to one upstream through one middleware chain."""

    def __init__(
        self,
        *,
        upstream: UpstreamConfig,
        chain: Chain,
        policies: PolicyStoreLike,
        settings: RelaySettings | None = None,
    ) -> None:
        settings = settings or RelaySettings()
        endpoint = Endpoint.from_config(upstream, make_ssl_context(upstream))
        self.upstream = upstream
        self.endpoint = endpoint
        self.settings = settings
        self.pool = UpstreamPool(
            host=endpoint.host, port=endpoint.port, tls=endpoint.tls,
            server_hostname=endpoint.server_name, connect_timeout=settings.connect_timeout,
        )
        # the calls with the caller's own credentials, when opgate's include a client
        # certificate: connections without it (the apiserver would run them as opgate)
        self.caller_pool = self.pool if endpoint.caller_tls is endpoint.tls else UpstreamPool(
            host=endpoint.host, port=endpoint.port, tls=endpoint.caller_tls,
            server_hostname=endpoint.server_name, connect_timeout=settings.connect_timeout,
        )
        self._base = endpoint.base
        self._host = endpoint.host_header.encode("latin-1")
        self._prefix = endpoint.prefix.encode("latin-1")
        self._chain = chain
        self._policies = policies
        self._token = TokenSource(token=upstream.token, token_file=upstream.token_file)
        self._wants_body = body_predicate(chain) if chain.needs_body else None
        self._after = Aftercare(chain)
        self._probe = UpstreamClient(endpoint, self._token, pool=self.pool,
                                     connect_timeout=settings.connect_timeout,
                                     user_agent="opgate-readyz")

    async def start(self) -> None:
        """Connections open on demand; with ``--workers`` the gauges' levels are published
        from now on (the same interface as ``Relay``)."""
        publish_levels()

    def server(self) -> FastServer:
        """A server for this relay's calls (:func:`proxy.relay.listen.serve_api` listens)."""
        return FastServer(self.handle, end=_end_cleanly, cut=self._after.mark_cut)

    async def close(self) -> None:
        await self._after.drain()
        self.pool.close()
        self.caller_pool.close()

    async def upstream_ready(self) -> tuple[bool, str]:
        """Whether the apiserver answers ``GET /readyz``, else ``/version`` (some RBAC set-ups
        hide readyz): any 200 is ready. Over the relay's own pool, 3 s at most each."""
        last = ""
        for path in ("/readyz", "/version"):
            try:
                answer = await self._probe.call("GET", path, within=PROBE_TIMEOUT,
                                                limit=PROBE_LIMIT)
            except (OSError, TimeoutError, httptools.HttpParserError) as e:
                return False, f"upstream unreachable: {errors.describe(e)}"
            if answer.status == 200:
                return True, f"upstream {path} answered 200"
            last = f"upstream {path} answered {answer.status}"
        return False, last

    # --- one call ----------------------------------------------------------------------
    async def handle(self, req: Request) -> None:
        url = req.url
        bad: str | None = None  # a request target the apiserver would refuse: 400 from here
        if url[:1] != b"/":
            target = origin_form(url.decode("latin-1"))
            if target is None:
                bad = "the request target is not a path"
            else:
                url = req.url = target.encode("latin-1")
        cut = url.find(b"?")
        raw_path = url if cut < 0 else url[:cut]
        query = "" if cut < 0 else url[cut + 1 :].decode("latin-1")
        sent = path = raw_path.decode("latin-1")
        if "%" in path:
            if malformed_escape(path):
                bad = "malformed percent-encoding in the path"
            path = unquote(path)
        method = req.method.decode("ascii")
        # (info, method, path, query, headers, policies, trace_id, remote), positional: Python
        # 3.11 calls a class given keywords through a dict (~3.7k instructions more per call)
        ctx = RequestContext(
            parse_request_info(method, path, query), method, path, query,
            WireHeaders(req.headers), self._policies.current,  # type: ignore[arg-type]
            _next_trace_id(), req.conn.remote,
        )
        if path is not sent:  # it held escapes: the records keep it as sent
            ctx.raw_path = sent
        # counted in the gauges as Aftercare.track does it, without a coroutine of its own
        watch = ctx.info.verb == "watch"
        INFLIGHT.now += 1
        if watch:
            WATCHES_OPEN.now += 1
        try:
            # serving the call, in this coroutine (a coroutine of its own cost ~1.5k
            # instructions per call): the body if a hook asked, the chain's entry, the relay
            try:
                if req.refused is not None:  # the Host guard's (DNS rebinding): a denial
                    ctx.decision = "denied"
                    raise errors.Answer(req.refused, close=True)
                if bad is not None:
                    raise errors.Answer(bad_request(f"opgate: {bad}"))
                if req.has_body and self._wants_body is not None and self._wants_body(ctx):
                    denied = await self._entry_with_body(req, ctx)
                else:
                    denied = self._chain.entry(ctx)
                    if type(denied) is CoroutineType:  # a hook has to wait
                        denied = await denied
                if denied is not None:
                    self._answer(req, ctx, denied, close=req.upgrade)
                else:
                    req.long_running = ctx.info.is_long_running
                    if ctx.tap is not None:
                        req.tap = ctx.tap.request_body
                    if req.upgrade:
                        await self._tunnel(req, ctx)
                    else:
                        await self._relay(req, ctx)
            except errors.Answer as answer:
                self._answer(req, ctx, answer.status, close=answer.close or req.upgrade)
            except Exception as e:
                log.exception("fast relay failed (%s %s, trace %s)", ctx.method, ctx.path,
                              ctx.trace_id)
                ctx.error = f"internal error: {type(e).__name__}"
                if ctx.status_code:  # the head went out: cut the response short
                    req.conn.abort()
                else:
                    self._answer(req, ctx, internal_error(
                        "opgate: internal error; see the opgate log"), close=True)
            finally:
                ctx.bytes_in = len(ctx.body) if ctx.body is not None else req.bytes_in
        except BaseException:  # cancelled: the client has gone
            self._after.gone(ctx)
            raise
        finally:
            INFLIGHT.now -= 1
            if watch:
                WATCHES_OPEN.now -= 1
        if not ctx.finished:  # (_relay sets it when the response ended with its head)
            ctx.finished = time.monotonic()
        if self._after.has_hooks:
            req.cancellable = False
            waiting = self._chain.exit(ctx)
            if waiting is not None:  # a hook has to wait (chain.exit answers at once if not)
                await waiting

    async def _entry_with_body(self, req: Request, ctx: RequestContext) -> StatusError | None:
        """The chain's entry for a call whose body a middleware wants: the hooks ahead of the
        body's readers first (a caller refused there never makes opgate read its body), then
        the body, bounded, then the rest."""
        denied = await settle(self._chain.entry_before_body(ctx))
        if denied is not None:
            return denied
        if req.expect_continue:
            req.conn.write(_CONTINUE)
        limit = self.settings.max_body_bytes
        async with errors.body_within(self.settings.request_timeout):
            body = await req.read_all(limit)
        if body is None:
            raise errors.Answer(errors.too_large(limit), close=True)
        ctx.body = body
        return await settle(self._chain.entry_after_body(ctx))

    def _answer(
        self, req: Request, ctx: RequestContext, status: StatusError, *, close: bool = False
    ) -> None:
        body = status.body()
        if ctx.decision == "allowed":  # the relay's own answer (400, 413, 5xx), no denial
            ctx.decision = "error"
        ctx.answer = status
        ctx.status_code = status.code
        length = len(body)
        if req.method == b"HEAD":  # its length, not the body: the client reads none (the
            body = b""  # next answer would be read as it)
        ctx.bytes_out = len(body)
        lines = [status_line(status.code)]
        lines += map(header_line, (*status.response_headers(), *ctx.response_headers))
        # as on the apiserver's answers (not through header_line: its memory is for repeats)
        lines.append(b"Audit-Id: %s\r\n" % ctx.audit_id.encode("latin-1"))
        # a body not (yet) read whole ends the connection (see FastServer): say so, e.g. to a
        # client refused before it sent its Expect: 100-continue body
        if close or not req.keep_alive or not req.body_done or req.conn.draining:
            lines.append(b"Connection: close\r\n")
            req.keep_alive = False
        lines.append(b"Content-Length: %d\r\n\r\n" % length)
        req.conn.write(b"".join(lines) + body)

    def _head(
        self, req: Request, ctx: RequestContext, *, upgrade: bool = False,
        now: float | None = None,
    ) -> bytes:
        if ctx.body is not None:
            framing = b"Content-Length: %d\r\n" % len(ctx.body)
        elif req.chunked:
            framing = b"Transfer-Encoding: chunked\r\n"
        elif req.content_length is not None:
            framing = b"Content-Length: " + req.content_length + b"\r\n"
        else:
            framing = b""
        auth = self._token.authorization_raw(now)
        allowed = ctx.allow_impersonation or bool(
            getattr(ctx.policies, "allow_impersonation", False)
        )
        named = connection_tokens(req.headers) if req.connection else NOTHING
        head, impersonating = request_head(
            method=req.method, target=self._prefix + req.url, host=self._host,
            headers=req.headers, named=named,
            drop=ctx.drop_request_headers, allow_impersonation=allowed,
            authorization=auth, framing=framing, audit_id=ctx.trace_id.encode("latin-1"),
            upgrade=upgrade, forwarded_for=ctx.remote.encode("latin-1"),
        )
        if impersonating:
            log.info("%s client impersonation headers (trace %s)",
                     "forwarding" if allowed else "stripped", ctx.trace_id)
            if not allowed:
                ctx.warn(IMPERSONATION_DROPPED)
        return head + (ctx.body or b"")

    def _pool_for(self, req: Request) -> UpstreamPool:
        """The caller's pool for a call with credentials of its own, else opgate's (the same
        pool unless opgate has a client certificate)."""
        pool = self.pool
        if self.caller_pool is not pool and carries_credentials(req.headers):
            return self.caller_pool
        return pool

    async def _relay(self, req: Request, ctx: RequestContext) -> None:
        client = req.conn
        now = time.monotonic()  # for the token file's check, the pool, and the upstream's timing
        data = self._head(req, ctx, now=now)
        streaming = req.has_body and ctx.body is None
        long_running = ctx.info.is_long_running
        head_only = req.method == b"HEAD"
        settings = self.settings
        pool = self.pool if self.caller_pool is self.pool else self._pool_for(req)
        for attempt in (0, 1):
            conn = pool.take(now if attempt == 0 else None)  # pool.acquire's hot half
            reused = conn is not None
            if conn is None:
                try:
                    conn = await pool.connect()
                except (OSError, TimeoutError) as e:
                    raise errors.upstream_failed(e, ctx, self._base, sent=False) from e
            # (client, extra, defer_head, head_only, http11, keep_alive), positional as above
            exchange = (
                (WatchExchange if long_running else Exchange) if ctx.tap is None
                else partial(TappedExchange, ctx.tap)
            )(client, ctx.response_headers, not long_running, head_only, req.http11,
              req.keep_alive)
            # a pooled connection came at once: the upstream's timing starts at the same instant
            started = now if reused and attempt == 0 else time.monotonic()
            client.flow = conn
            conn.flow = client
            conn.send(exchange, data, head_only=head_only, streaming=streaming)
            if streaming:
                if req.expect_continue:
                    client.write(_CONTINUE)
                if req.chunked:
                    req.attach(partial(_write_chunk, conn), partial(_end_body, conn, _LAST_CHUNK))
                else:
                    req.attach(conn.write, partial(_end_body, conn, b""))
            if long_running:
                exchange.limits(conn, head=_head_limit(ctx, settings),
                                idle=settings.watch_idle_timeout)
                if ctx.info.verb == "watch" and isinstance(exchange, WatchExchange):
                    exchange.watch()  # (before any byte of its answer can come)
            else:
                exchange.limits(conn, head=settings.header_timeout, total=settings.request_timeout)
            try:
                try:
                    await exchange.head
                except (OSError, TimeoutError, httptools.HttpParserError) as e:
                    conn.close()
                    if attempt == 0 and reused and not streaming and not conn.received \
                            and not isinstance(e, TimeoutError) and req.method in _IDEMPOTENT:
                        continue  # a stale keep-alive connection: once more on a fresh one
                    raise errors.upstream_failed(e, ctx, self._base) from e
                ctx.status_code = exchange.status
                now = time.monotonic()
                ctx.upstream_seconds = now - started
                self._after.observe_upstream(ctx.info.verb, ctx.upstream_seconds)
                if exchange.done.done():  # the whole response came with its head: it ended now
                    ctx.finished = now
                complete = await exchange.done
            except BaseException:
                conn.close()
                raise
            finally:
                ctx.bytes_out = exchange.sent
                exchange.cancel_timer()
            if exchange.expired:
                conn.close()
            if exchange.close_client:
                req.keep_alive = False
            if exchange.error is not None:
                errors.stream_broke(exchange.error, ctx, idle=complete)
            if not complete:
                client.abort()
            return

    async def _tunnel(self, req: Request, ctx: RequestContext) -> None:
        """An upgrade: its own upstream connection, and after a ``101`` a raw byte tunnel."""
        client = req.conn
        if req.has_body and ctx.body is None:  # unusual for an upgrade, but relay it (bounded)
            async with errors.body_within(self.settings.request_timeout):
                body = await req.read_all(self.settings.max_body_bytes)
            if body is None:
                raise errors.Answer(errors.too_large(self.settings.max_body_bytes), close=True)
            ctx.body = body
        data = self._head(req, ctx, upgrade=True)
        try:
            conn = await self._pool_for(req).connect(tunnel=True)
        except (OSError, TimeoutError) as e:
            raise errors.upstream_failed(e, ctx, self._base, sent=False) from e
        exchange = (Exchange if ctx.tap is None else partial(TappedExchange, ctx.tap))(
            client, extra=ctx.response_headers, defer_head=False, head_only=False,
            http11=req.http11, keep_alive=False)
        started = time.monotonic()
        client.flow = conn
        conn.flow = client
        try:
            conn.send(exchange, data, upgrade=True)
            exchange.limits(conn, head=self.settings.header_timeout)
            try:
                await exchange.head
            except (OSError, TimeoutError, httptools.HttpParserError) as e:
                raise errors.upstream_failed(e, ctx, self._base) from e
            ctx.status_code = exchange.status
            ctx.upstream_seconds = time.monotonic() - started
            self._after.observe_upstream(ctx.info.verb, ctx.upstream_seconds)
            if exchange.switched:
                gone = ConnectionResetError("the client closed the tunnel")
                client.attach_raw(conn.write, partial(exchange.on_lost, gone))
            complete = await exchange.done
        finally:
            ctx.bytes_out = exchange.sent
            exchange.cancel_timer()
            conn.close()
        req.keep_alive = False
        if not complete and exchange.error is not None:
            errors.stream_broke(exchange.error, ctx, idle=False)
            client.abort()


def _head_limit(ctx: RequestContext, settings: RelaySettings) -> float:
    """Seconds (0: none) a long-running call waits for its head: the header timeout for a
    watch (the apiserver answers one at once); for a log or a proxied call only the watch
    idle timeout, as their head comes with the kubelet's (the backend's) first byte: the next
    line of a quiet container for ``logs -f``, which the apiserver waits for as long as it
    takes."""
    if ctx.info.verb == "watch":
        return settings.header_timeout
    return settings.watch_idle_timeout


def _end_cleanly(client: ClientConnection) -> bool:
    """At shutdown: end the long-running response ``client`` receives, if it can end cleanly
    now (:meth:`Exchange.end`); found through the upstream connection that feeds it."""
    upstream = client.flow
    if not isinstance(upstream, UpstreamConnection):
        return False
    exchange = upstream.exchange
    return isinstance(exchange, Exchange) and exchange.client is client and exchange.end()


def _write_chunk(conn: UpstreamConnection, chunk: bytes) -> None:
    conn.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))


def _end_body(conn: UpstreamConnection, tail: bytes) -> None:
    if tail:
        conn.write(tail)
    conn.body_pending = False
