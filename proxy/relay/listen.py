"""The API listener: TCP (v4/v6), a Unix socket, or TLS with a certificate reloaded in place.

For the fast relay it is the relay's own :class:`~proxy.relay.fast.server.FastServer` (asyncio
protocols, httptools). For the aiohttp relay it is aiohttp's low-level ``web.Server`` (no
router, no access log: the audit and metrics middlewares see every call) with
``handler_cancellation=True``. Either way a client that disconnects cancels its handler at once
and the relay closes the upstream stream. With TLS, the certificate
and key files are polled every few seconds (``proxy.relay.servingcert``: cert-manager renewals,
Secret updates); new handshakes get a new good pair, open connections keep theirs, and a bad
pair keeps the old one and is logged. A TLS listener accepts plain TCP and hands each connection
to TLS after its first bytes (``proxy.relay.tlsaccept``): a plain HTTP request gets Go's 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from proxy.engine.limitlog import log_limited
from proxy.relay.endpoint import MAX_HEADER_LINE
from proxy.relay.fast import FastRelay
from proxy.relay.fast import server as fast_server
from proxy.relay.fast.server import MAX_HEADERS
from proxy.relay.hostguard import HostGuard
from proxy.relay.servingcert import CertReloader, TLSFilesError, server_tls_context

if TYPE_CHECKING:
    from aiohttp import web

    from proxy.relay.handler import Relay

__all__ = ["Listener", "TLSFilesError", "listen_failure", "parse_listen",
           "quiet_accept_failures", "raise_open_files_limit", "serve_api", "server_tls_context"]

log = logging.getLogger("opgate.listen")

_ACCEPT_FAILED = "socket.accept() out of system resource"  # (asyncio's message)
AIOHTTP_LEFTOVER = 1.0  # seconds aiohttp's shutdown gives what is still running after the cut


def raise_open_files_limit() -> None:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit, as Go's runtime does at start (so
    the apiserver and ``kubectl proxy`` have it): each call in flight holds two descriptors
    (client, upstream), a watch holds them for good, and the soft limit a container may be
    given (1024, systemd's default, with a hard one of 524288) ended the calls past ~500 at
    once with ``503 Too many open files``. A limit that cannot be raised stays as it is."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def quiet_accept_failures(loop: asyncio.AbstractEventLoop) -> None:
    """Log a listener's refused ``accept()`` (out of descriptors or memory) as one warning per
    ``LOG_EVERY`` seconds. asyncio's own loop reports each to the exception handler, with its
    traceback, for every connection waiting in the backlog and again every second (its accept
    loop goes on after the failure): over a thousand ERROR lines a second while the limit is
    reached. The connections wait in the backlog meanwhile (uvloop, the default, closes them
    unanswered and reports nothing: the upstream's failures say it)."""
    previous = loop.get_exception_handler()
    if not isinstance(previous, _AcceptFailures):
        loop.set_exception_handler(_AcceptFailures(previous))


class _AcceptFailures:
    """The loop's exception handler: accept failures logged by kind, the rest passed on."""

    def __init__(self, previous: Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object]
                 | None) -> None:
        self._previous = previous

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if context.get("message") == _ACCEPT_FAILED and isinstance(exc, OSError):
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            log_limited(log, "accept", "cannot accept connections (%s; open files limit %d): "
                        "they wait", exc.strerror, soft)
        elif self._previous is not None:
            self._previous(loop, context)
        else:
            loop.default_exception_handler(context)


def parse_listen(listen: str) -> tuple[str, int] | str:
    """``HOST:PORT`` / ``[V6]:PORT`` → (host, port); ``unix:/path`` → the path."""
    if listen.startswith("unix:"):
        path = listen[5:]
        if not path:
            raise ValueError(f"listen address {listen!r}: unix: needs a path")
        return path
    host, sep, port = listen.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(
            f"listen address {listen!r}: expected HOST:PORT, [IPV6]:PORT or unix:/path"
        )
    return host, int(port)


def listen_failure(flag: str, address: str, exc: BaseException) -> str:
    """One line naming the flag, the address and why it cannot be listened on."""
    if isinstance(exc, socket.gaierror):
        why = f"cannot resolve the host ({exc.strerror or exc})"
    elif isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        why = "the address is already in use (another opgate, or another program, listens there)"
    elif isinstance(exc, OSError) and exc.errno == errno.EADDRNOTAVAIL:
        why = "not an address of this machine"
    elif isinstance(exc, OSError) and exc.errno == errno.EACCES:
        why = "permission denied (ports below 1024 need privileges; a socket path, write access)"
    elif isinstance(exc, OSError):
        why = exc.strerror or str(exc)
    else:
        why = str(exc)
    return f"cannot listen on {flag} {address}: {why}"


class Listener:
    """A running API listener; ``address`` is the real one (port 0 resolved)."""

    def __init__(
        self,
        stop: Callable[[], Awaitable[None]],
        address: str,
        *,
        unix_path: str | None,
        reloader: CertReloader | None,
        hurry: Callable[[], None],
    ) -> None:
        self.address = address
        self._stop = stop
        self.hurry = hurry  # during close(): cut what still runs now, not after the grace
        self._unix_path = unix_path
        self._reloader = reloader

    @property
    def tls(self) -> bool:
        return self._reloader is not None

    async def serving_cert(self) -> tuple[bool, str]:
        """``/readyz``'s ``serving-cert`` check of a TLS listener: passes, and says what is
        served and why changed files are not (:meth:`CertReloader.describe`)."""
        if self._reloader is None:
            return True, "no TLS"
        return self._reloader.describe()

    async def close(self) -> None:
        if self._reloader is not None:
            await self._reloader.stop()
        await self._stop()
        if self._unix_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._unix_path)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve_api(
    relay: Relay | FastRelay,
    *,
    listen: str = "127.0.0.1:8001",
    tls_cert: str | None = None,
    tls_key: str | None = None,
    reuse_port: bool = False,
    shutdown_timeout: float = 10.0,
    host_guard: HostGuard | None = None,
) -> Listener:
    """Start serving ``relay.handle``; the relay must be started (``await relay.start()``).

    On close, the server stops accepting, and calls in flight get ``shutdown_timeout`` seconds
    to finish (long-running calls such as watches are ended at once by both relays, a watch
    cleanly, with its last chunk, between two events: clients resume them from their last
    resourceVersion). ``Listener.hurry`` during the close cuts what still runs. ``host_guard``:
    the ``Host`` names a TCP listener answers (``--accept-hosts``; a Unix socket's are not
    checked: no browser reaches one)."""
    where = parse_listen(listen)
    guard = None if isinstance(where, str) else host_guard
    raise_open_files_limit()
    quiet_accept_failures(asyncio.get_running_loop())
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("TLS needs both a certificate and a key file")
    ctx = server_tls_context(tls_cert, tls_key) if tls_cert and tls_key else None
    if isinstance(relay, FastRelay):
        fast = relay.server()
        fast.host_guard = guard
        if isinstance(where, str):
            await fast.listen_unix(where, tls=ctx)
            address = f"unix:{where}"
        else:
            bound = await fast.listen_tcp(where[0], where[1], tls=ctx, reuse_port=reuse_port)
            address = _address(*bound[0])

        async def stop_fast() -> None:
            await fast.close(shutdown_timeout)

        stop: Callable[[], Awaitable[None]] = stop_fast
        hurry = fast.hurry
    else:
        relay.host_guard = guard
        stop, hurry, address = await _serve_aiohttp(relay, where, ctx, reuse_port,
                                                    shutdown_timeout)
    reloader = CertReloader(ctx, tls_cert, tls_key) if ctx and tls_cert and tls_key else None
    log.info("API listener on %s%s", address, " (TLS)" if ctx else "")
    return Listener(
        stop, address, unix_path=where if isinstance(where, str) else None, reloader=reloader,
        hurry=hurry,
    )


async def _serve_aiohttp(
    relay: Relay,
    where: tuple[str, int] | str,
    ctx: ssl.SSLContext | None,
    reuse_port: bool,
    shutdown_timeout: float,
) -> tuple[Callable[[], Awaitable[None]], Callable[[], None], str]:
    from aiohttp import web  # here: only the aiohttp relay loads aiohttp's server

    from proxy.relay.aioserver import StatusServer

    server = StatusServer(
        relay.handle,
        handler_cancellation=True,
        access_log=None,
        max_line_size=MAX_HEADER_LINE,
        max_field_size=MAX_HEADER_LINE,
        max_headers=MAX_HEADERS,
        # as the fast listener: aiohttp's own default (3630 s) kept an idle connection, or one
        # whose request head never ends, open for an hour
        keepalive_timeout=fast_server.KEEPALIVE,
        # a body left unread by an answer is read and dropped before the close, as long as
        # the fast listener does it
        lingering_time=fast_server.LINGER,
        # a request body is relayed as sent: aiohttp inflated one with a Content-Encoding (the
        # apiserver got the JSON under "Content-Encoding: gzip", cut at the compressed length)
        auto_decompress=False,
    )
    server.tls = ctx  # (the site listens in plain TCP: see StatusServer)
    # the grace is given in stop() below; aiohttp's own is only for what is left after it
    runner = web.ServerRunner(server, shutdown_timeout=min(shutdown_timeout, AIOHTTP_LEFTOVER))
    await runner.setup()
    site: web.BaseSite
    try:
        if isinstance(where, str):
            site = web.UnixSite(runner, where)
        else:
            site = web.TCPSite(
                runner, where[0], where[1], reuse_port=reuse_port or None,
                backlog=1024,
            )
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    if isinstance(where, str):
        address = f"unix:{where}"
    else:
        address = _address(*runner.addresses[0][:2])

    async def stop() -> None:
        # aiohttp's own shutdown (runner.cleanup) stops reading every connection at once, so a
        # call whose request body is still arriving can only time out, and it gives every
        # handler the grace, then cancels and waits the grace again (a watch would hold the
        # shutdown twice that long). So, as the fast relay does: stop accepting, end the
        # long-running calls, close each connection once it is idle, and give the calls in
        # flight the grace; aiohttp's cleanup then ends what is left.
        for running in list(runner.sites):
            await running.stop()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + shutdown_timeout
        while not hurried.is_set():
            relay.end_long_running()  # (again: one may have started on a kept-alive connection)
            busy = False
            for conn in server.connections:
                # (_request_in_progress: aiohttp's, no public one) a connection whose answer
                # is still in its write buffer is busy too, as on the fast relay: the process
                # must not exit, nor the cut below drop it, before that reaches the client
                transport = conn.transport
                if getattr(conn, "_request_in_progress", True) or (
                        transport is not None and transport.get_write_buffer_size()):
                    busy = True
                else:
                    _close_when_idle(conn)
            if not busy or loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        relay.cut()  # what is cut now was cut by opgate, not left by its client
        for conn in list(server.connections):  # cut now, as the fast relay does: aiohttp's
            transport = conn.transport  # cleanup would wait for each handler once more, then
            if transport is not None:  # cancel it and wait again (twice its leftover)
                transport.abort()  # (connection_lost cancels the handler)
        await runner.cleanup()

    hurried = asyncio.Event()
    return stop, hurried.set, address


def _close_when_idle(conn: Any) -> None:
    """Close an aiohttp connection no call runs on: at once if it waits for a request (an idle
    keep-alive one), else once what it does ends (an answer written out, the rest of a body
    read and dropped). aiohttp's ``close()`` alone cancels an idle connection's wait and ends
    its task without closing the transport: the connection stayed open, unread, until the
    drain ended, and a call its client sent on it meanwhile was never answered."""
    waiter = getattr(conn, "_waiter", None)  # (aiohttp's, no public one)
    if waiter is not None and not waiter.done():
        conn.force_close()
    else:
        conn.close()
