"""The request flow: classify, run the entry hooks, relay (streaming), run the exit hooks.

``Relay.handle`` is the aiohttp handler of the API listener (DESIGN.md steps 1-7). The hot path
does no parsing beyond ``parse_request_info``, no regex, no JSON and no logging; bodies are never
read whole unless a middleware declared ``needs_body`` (then bounded by ``max_body_bytes``) and,
when it also has a ``wants_body(ctx) -> bool`` method, wants this call's body.

Cancellation: the listener runs with ``handler_cancellation=True``, so a client that goes away
cancels this handler wherever it is. The ``finally`` blocks close the upstream response (never
return a half-read connection to the pool), ``CancelledError`` propagates, and the exit hooks
still run, in a task of their own, bounded, so metrics count the call.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from proxy.engine.chain import Chain, settle
from proxy.engine.context import RequestContext
from proxy.engine.requestinfo import parse_request_info
from proxy.engine.status import StatusError, bad_request, internal_error
from proxy.engine.telemetry import publish_levels
from proxy.relay import errors, tunnel
from proxy.relay.aftercare import CLIENT_GONE, Aftercare
from proxy.relay.calls import (
    PolicyStoreLike,
    RelaySettings,
    body_predicate,
    malformed_escape,
    origin_form,
    trace_ids,
)
from proxy.relay.events import EventEnds, event_ends
from proxy.relay.fast import server as fast_server
from proxy.relay.headers import (
    carries_credentials,
    for_upstream,
    is_upgrade_request,
    response_headers,
)
from proxy.relay.hostguard import HostGuard
from proxy.relay.response import (
    BufferedRelayResponse,
    RelayResponse,
    pump,
    pump_watch,
    read_body,
    send_continue,
    send_status,
)
from proxy.relay.session import Endpoint, TokenSource, make_session, make_ssl_context, probe
from proxy.relay.tap import tee_stream
from proxy.relay.upstream import UpstreamConfig

__all__ = ["PolicyStoreLike", "Relay", "RelaySettings"]  # the last two from calls.py

log = logging.getLogger("opgate.relay")

_next_trace_id = trace_ids("-")


class Relay:
    """Relays API calls to one upstream through one middleware chain."""

    def __init__(
        self,
        *,
        upstream: UpstreamConfig,
        chain: Chain,
        policies: PolicyStoreLike,
        settings: RelaySettings | None = None,
    ) -> None:
        settings = settings or RelaySettings()
        self.upstream = upstream
        self.settings = settings
        self._chain = chain
        self._policies = policies
        self._endpoint = Endpoint.from_config(upstream, make_ssl_context(upstream))
        self._token = TokenSource(token=upstream.token, token_file=upstream.token_file)
        self._session: aiohttp.ClientSession | None = None
        self._wants_body = body_predicate(chain) if chain.needs_body else None
        self._timeout = aiohttp.ClientTimeout(
            total=settings.request_timeout or None, sock_connect=settings.connect_timeout or None
        )
        self._long_timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=settings.connect_timeout or None,
            sock_read=settings.watch_idle_timeout or None,
        )
        # a watch's silence is timed by pump_watch (past sock_read, nothing could be read:
        # not the rest of an event either)
        self._watch_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=settings.connect_timeout or None)
        self._header_timeout = settings.header_timeout or None
        self._after = Aftercare(chain)
        self.host_guard: HostGuard | None = None  # the Host names answered (TCP listeners)
        # the client transports of watches etc. in flight, each with its upstream response
        # once there is one, and where a watch's events end (ended at shutdown)
        self._long_running: dict[
            asyncio.BaseTransport, tuple[aiohttp.ClientResponse, EventEnds | None] | None] = {}
        self._draining = False  # the listener is closing: no call after this one on its conn

    async def start(self) -> None:
        publish_levels()  # with --workers: the in-flight and watch gauges' levels
        if self._session is None:
            self._session = make_session(
                self._endpoint, connect_timeout=self.settings.connect_timeout
            )

    def cut(self) -> None:
        """The listener's shutdown is about to cut the calls still running (the grace ran out,
        or a second signal): record them as cut by opgate, not as left by their clients."""
        self._after.mark_cut()

    def end_long_running(self) -> None:
        """At shutdown: end the long-running calls in flight (watches, logs) at once, as the
        fast relay does: a relayed body ends cleanly after the chunk being written (the last
        chunk, as the watch idle timeout ends it; a watch inside an event with the piece that
        ends it, or it is cut after LONG_RUNNING_END), the others (no upstream head yet, exec
        and port-forward tunnels) are cut. Their clients resume them (a watch from its last
        resourceVersion) while ordinary calls get the listener's grace to finish. Called again
        and again while the listener drains."""
        self._draining = True
        now = asyncio.get_running_loop().time()
        for transport, running in list(self._long_running.items()):
            if running is None:
                transport.close()
                continue
            upstream, events = running
            if upstream.content_length is not None:  # (a length-framed answer, an error,
                continue  # ends by itself)
            if events is None or events.between:  # a stream, between two events if a watch
                upstream.content.set_exception(errors.ShuttingDown())
            elif not events.ending:  # pump_watch ends it with the piece that ends the event
                events.ending = now + fast_server.LONG_RUNNING_END
            elif now >= events.ending:  # which never came
                upstream.content.set_exception(
                    ConnectionResetError("ended inside an event at shutdown"))

    async def close(self) -> None:
        await self._after.drain()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # --- the handler -------------------------------------------------------------------

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.version.major != 1:  # aiohttp takes HTTP/0.9 and HTTP/2.0 request lines
            return (await send_status(request, errors.version_not_supported(), close=True))[0]
        if request.body_exists and request.headers.get(
                "Transfer-Encoding", "chunked").strip().lower() != "chunked":
            return (await send_status(request, errors.unsupported_coding(), close=True))[0]
        host = request.headers.get("Host")
        refused: StatusError | None = None  # the Host guard's 403, recorded as a denial
        if host:
            raw_host = host.encode("utf-8", "surrogateescape")
            if errors.malformed_host(raw_host):
                return (await send_status(request, errors.bad_host(1), close=True))[0]
            guard = self.host_guard
            if guard is not None and not guard.accepts(raw_host):  # (DNS rebinding)
                refused = guard.refusal(raw_host)
        raw = request.raw_path
        bad: str | None = None  # a request target the apiserver would refuse: 400 from here
        if not raw.startswith("/"):
            target = origin_form(raw)
            if target is None:
                bad = "the request target is not a path"
            else:  # relayed (and classified) as the origin-form the apiserver routes by
                request = request.clone(rel_url=URL(target, encoded=True))
                raw = request.raw_path
        cut = raw.find("?")
        query = raw[cut + 1 :] if cut >= 0 else ""
        sent = raw if cut < 0 else raw[:cut]  # the path as sent (escapes kept)
        escaped = "%" in sent
        method = request.method
        if bad is not None:
            path = raw
        else:
            path = request.path
            if escaped and malformed_escape(sent):
                bad = "malformed percent-encoding in the path"
        ctx = RequestContext(
            info=parse_request_info(method, path, query),
            method=method,
            path=path,
            query=query,
            headers=request.headers,
            policies=self._policies.current,  # type: ignore[arg-type]
            trace_id=_next_trace_id(),
            remote=request.remote or "",
        )
        if escaped:  # the records keep the path as sent
            ctx.raw_path = sent
        transport = request.transport
        if refused is not None:  # answered and recorded, nothing decided nor relayed
            ctx.decision = "denied"
            resp = await self._after.track(
                ctx, self._answer(request, ctx, refused, close=True))
        elif bad is None and ctx.info.is_long_running and transport is not None:
            self._long_running[transport] = None
            try:
                resp = await self._after.track(ctx, self._serve(request, ctx))
            finally:
                self._long_running.pop(transport, None)
        elif bad is None:
            resp = await self._after.track(ctx, self._serve(request, ctx))
        else:
            resp = await self._after.track(
                ctx, self._answer(request, ctx, bad_request(f"opgate: {bad}")))
        if self._draining:
            # as the fast relay: the connection closes after a call that ends while the
            # listener drains. Kept alive, it took the call the client sent next (an informer
            # watching again the moment its watch ended), which the drain then ended within a
            # second and without an event: client-go takes that for a failure and lists again
            resp.force_close()
        if self._after.has_hooks:
            # shielded: a client that leaves now must not cut the hooks short
            await asyncio.shield(settle(self._chain.exit(ctx)))
        return resp

    async def _serve(self, request: web.BaseRequest, ctx: RequestContext) -> web.StreamResponse:
        """Run the call; contain everything but cancellation (the client gone) here."""
        try:
            try:
                return await self._dispatch(request, ctx)
            except Exception as e:
                if isinstance(e, ConnectionError) or ctx.status_code:
                    raise
                log.exception("relay failed (%s %s, trace %s)", ctx.method, ctx.path, ctx.trace_id)
                ctx.error = f"internal error: {type(e).__name__}"
                status = internal_error("opgate: internal error; see the opgate log")
                return await self._answer(request, ctx, status)
        except ConnectionError:  # the client has gone (or the shutdown closed it)
            ctx.error = ctx.error or self._after.gone_reason
        except Exception as e:  # broke after the headers went out: cut the response short
            log.exception("relay failed (%s %s, trace %s)", ctx.method, ctx.path, ctx.trace_id)
            ctx.error = f"internal error: {type(e).__name__}"
        ctx.status_code = ctx.status_code or CLIENT_GONE
        transport = request.transport
        if transport is not None:
            transport.close()
        gone = web.StreamResponse()
        gone.force_close()
        return gone  # aiohttp's prepare() of it fails quietly on the closed transport

    async def _dispatch(
        self, request: web.BaseRequest, ctx: RequestContext
    ) -> web.StreamResponse:
        # an upgrade request that is not tunnelled leaves aiohttp's parser mid-upgrade: close
        upgrade = "Upgrade" in request.headers and is_upgrade_request(request.headers)
        try:
            if request.body_exists and self._wants_body is not None and self._wants_body(ctx):
                # the hooks ahead of the body's readers first: a caller refused there (401)
                # never makes opgate read its body
                denied = await settle(self._chain.entry_before_body(ctx))
                if denied is None:
                    async with errors.body_within(self.settings.request_timeout):
                        ctx.body = await read_body(request, limit=self.settings.max_body_bytes)
                    denied = await settle(self._chain.entry_after_body(ctx))
            else:
                denied = await settle(self._chain.entry(ctx))
            if denied is not None:
                return await self._answer(request, ctx, denied, close=upgrade)
            if upgrade:
                return await tunnel.relay_upgrade(self, request, ctx)
            return await self._relay(request, ctx)
        except errors.Answer as answer:
            close = answer.close or upgrade
            return await self._answer(request, ctx, answer.status, close=close)

    async def _answer(
        self,
        request: web.BaseRequest,
        ctx: RequestContext,
        status: StatusError,
        *,
        close: bool = False,
    ) -> web.StreamResponse:
        if ctx.decision == "allowed":  # the relay's own answer (400, 413, 5xx), no denial
            ctx.decision = "error"
        ctx.answer = status
        ctx.status_code = status.code
        # answered before the body was read whole (a refusal, a timeout): the connection
        # ends after the answer, as on the fast relay (ClientConnection.linger): the write side
        # is shut after it, and aiohttp reads the rest of the body and drops it, for at most
        # LINGER seconds, before it closes (closed with it unread, the socket would be reset,
        # and the reset could overtake the answer). What follows the answer is never read as a
        # request (an Expect: 100-continue client refused sends no body, or sends it anyway)
        unread = request.body_exists and not request.content.is_eof()
        resp, size = await send_status(
            request, status, extra=(*ctx.response_headers, ("Audit-Id", ctx.audit_id)),
            close=close or unread or self._draining)
        transport = request.transport
        if unread and transport is not None and transport.can_write_eof():
            transport.write_eof()
        ctx.bytes_out = size
        return resp

    def upstream_headers(
        self, request: web.BaseRequest, ctx: RequestContext, *, upgrade: bool
    ) -> CIMultiDict[str]:
        """Request headers for the upstream, with opgate's token when the client sent none (no
        ``Authorization``, no WebSocket bearer-token subprotocol: :func:`carries_credentials`)."""
        auth = None if carries_credentials(request.headers) else self._token.authorization()
        return for_upstream(request.headers, ctx, authorization=auth, upgrade=upgrade)

    def tls_for(self, headers: CIMultiDict[str]) -> ssl.SSLContext | None:
        """The TLS context of a call's upstream connection: without opgate's client
        certificate when the caller sent credentials of its own (``Endpoint.caller_tls``)."""
        endpoint = self._endpoint
        return endpoint.caller_tls if carries_credentials(headers) else endpoint.tls

    async def _relay(self, request: web.BaseRequest, ctx: RequestContext) -> web.StreamResponse:
        session = self._session
        if session is None:
            raise RuntimeError("Relay.start() was not awaited")
        headers = self.upstream_headers(request, ctx, upgrade=False)
        data: object = None
        if ctx.body is not None:
            data = ctx.body
            headers.popall("Content-Length", None)
        elif request.body_exists:
            await send_continue(request)
            data = request.content if ctx.tap is None else tee_stream(request.content, ctx.tap)
        long_running = ctx.info.is_long_running
        watch = long_running and ctx.info.verb == "watch"
        idle = self.settings.watch_idle_timeout
        if watch:  # the apiserver answers a watch at once (bounded by its idle timeout too,
            head_limit = self._header_timeout or idle  # as sock_read bounds the others)
        elif long_running:  # a log's or proxied call's head comes with the kubelet's (the
            head_limit = idle  # backend's) first byte: a quiet container's next line
        else:
            head_limit = self._header_timeout
        started = time.monotonic()
        try:
            async with asyncio.timeout(head_limit or None):
                upstream = await session.request(
                    ctx.method,
                    URL(self._endpoint.base + request.raw_path, encoded=True),
                    headers=headers,
                    data=data,
                    allow_redirects=False,
                    timeout=(self._watch_timeout if watch else self._long_timeout)
                    if long_running else self._timeout,
                    server_hostname=self._endpoint.server_name,
                    ssl=self.tls_for(request.headers) or True,
                )
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            # (a connector's error, TLS included, or its timeout: the call was never sent)
            unsent = isinstance(e, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))
            raise errors.upstream_failed(e, ctx, self._endpoint.base, sent=not unsent) from e
        ctx.upstream_seconds = time.monotonic() - started
        self.observe_upstream(ctx.info.verb, ctx.upstream_seconds)
        events: EventEnds | None = None
        if watch:  # where its events end (anywhere: not followed, or a length-framed answer)
            events = (event_ends(upstream.headers.get("Content-Type", ""))
                      if upstream.content_length is None else None) or EventEnds()
        if long_running and request.transport in self._long_running:  # to end at shutdown
            self._long_running[request.transport] = (upstream, events)
        if ctx.tap is not None:
            ctx.tap.response_head(upstream.status, upstream.reason or "", upstream.raw_headers)
        try:  # from here on the upstream response must be closed or released
            response_class = RelayResponse if long_running else BufferedRelayResponse
            resp = response_class(
                status=upstream.status,
                reason=upstream.reason,
                headers=response_headers(upstream.headers, extra=ctx.response_headers),
            )
            http10_stream = upstream.content_length is None \
                and request.version < aiohttp.HttpVersion11
            if http10_stream or self._draining:
                # an HTTP/1.0 client's body ends with the connection: aiohttp would keep a
                # "Connection: keep-alive" one open, and the client wait for an end; while the
                # listener drains the connection ends after the call: Connection: close says so
                resp.force_close()
            await resp.prepare(request)
            ctx.status_code = upstream.status
            if events is None:
                complete = await pump(request, ctx, upstream, resp)
            else:
                complete = await pump_watch(request, ctx, upstream, resp, events=events,
                                            idle=idle)
        except BaseException:
            upstream.close()
            raise
        finally:
            ctx.bytes_in = len(ctx.body) if ctx.body is not None else request.content.total_bytes
        if complete:
            upstream.release()
            await resp.write_eof()
        else:
            upstream.close()
        return resp

    def observe_upstream(self, verb: str, seconds: float) -> None:
        """Record the time until the upstream's response headers (the tunnel uses it too)."""
        self._after.observe_upstream(verb, seconds)

    # --- used by the tunnel and the admin listener -------------------------------------

    @property
    def endpoint(self) -> Endpoint:
        return self._endpoint

    async def upstream_ready(self) -> tuple[bool, str]:
        """Whether the apiserver answers: ``GET /readyz``, then ``/version``; short timeout."""
        if self._session is None:
            return False, "relay not started"
        return await probe(self._session, self._endpoint, self._token.authorization())
