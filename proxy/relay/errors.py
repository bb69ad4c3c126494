"""What the relay answers when it cannot relay, and how it counts and logs upstream failures.

Both relay cores use it; it loads no HTTP library (aiohttp's exception types are only checked
for once aiohttp is loaded, as they can only occur then).

An unreachable, refusing or TLS-failing upstream is a ``503 ServiceUnavailable``; a connect,
header or request timeout is a ``504 Timeout`` (both Kubernetes ``Status`` bodies, so client-go
shows them). When nothing of the call left opgate (the connection to the apiserver was refused,
failed its TLS handshake or timed out) either carries ``Retry-After: 1``: a retry is safe for
any verb, and client-go makes it itself (it retries a 5xx only with a ``Retry-After``). A call
the apiserver may have seen has none: a create retried could be made twice. Failures are
counted in ``opgate_upstream_errors_total{kind}`` with a bounded ``kind`` and logged at most
once per kind every few seconds, so an apiserver outage does not flood the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import resource
import ssl
import sys
from collections.abc import AsyncIterator

from proxy.engine import telemetry
from proxy.engine.context import RequestContext
from proxy.engine.limitlog import log_limited
from proxy.engine.status import StatusError, bad_request, gateway_timeout, service_unavailable

__all__ = [
    "Answer",
    "ConnectTimeout",
    "ShuttingDown",
    "bad_host",
    "body_within",
    "describe",
    "head_too_large",
    "malformed_request",
    "refused_coding",
    "stream_broke",
    "too_large",
    "unsupported_coding",
    "upstream_failed",
    "version_not_supported",
]

log = logging.getLogger("opgate.relay")



class Answer(Exception):
    """Stop relaying and answer ``status`` (optionally closing the connection afterwards)."""

    def __init__(self, status: StatusError, *, close: bool = False) -> None:
        super().__init__(status.message)
        self.status = status
        self.close = close


class ShuttingDown(Exception):
    """opgate is stopping: a long-running response ends here (cleanly, between two chunks; a
    watch between two events)."""


class ConnectTimeout(TimeoutError):
    """The upstream did not accept the connection in time (a 504 that names the connect)."""


@contextlib.asynccontextmanager
async def body_within(seconds: float) -> AsyncIterator[None]:
    """Bound the read of a request body a middleware wants (``seconds``: the request timeout,
    0 = none): a client that stalls mid-body gets a ``504 Timeout`` Status, as the apiserver's
    own request timeout answers, and its connection is closed."""
    try:
        async with asyncio.timeout(seconds or None):
            yield
    except TimeoutError:
        raise Answer(gateway_timeout(
            f"opgate: the request body did not arrive within {seconds:g}s"), close=True) from None


def too_large(limit: int) -> StatusError:
    return StatusError(413, f"Request entity too large: limit is {limit}", "RequestEntityTooLarge")


def malformed_request() -> StatusError:
    """A request that is not HTTP/1.1 as the listener parses it (both listeners)."""
    return bad_request("opgate: malformed HTTP request")


def bad_host(hosts: int) -> StatusError:
    """A request with two ``Host`` headers, or an HTTP/1.1 one with none (``hosts``: how many
    it has), or one whose ``Host`` holds a byte no host or port has (``hosts`` 1): the
    apiserver (Go's net/http) answers each 400, and so do both listeners."""
    if hosts == 1:
        return bad_request("opgate: malformed Host header")
    return bad_request("opgate: missing required Host header" if not hosts
                       else "opgate: too many Host headers")


# the bytes Go's net/http takes in a Host value (httpguts.ValidHostHeader: RFC 3986's host and
# port, leniently): letters, digits and !$%&'()*+,-.:;=[]_~
_HOST_BYTES = bytes(range(ord("0"), ord("9") + 1)) + bytes(range(ord("a"), ord("z") + 1)) \
    + bytes(range(ord("A"), ord("Z") + 1)) + b"!$%&'()*+,-.:;=[]_~"


def malformed_host(value: bytes) -> bool:
    """Whether a ``Host`` value holds, inside its surrounding blanks, a byte the apiserver
    refuses with 400 (a space, ``/``, ``@``, a control byte, anything not ASCII, …)."""
    return bool(value.strip().translate(None, _HOST_BYTES))


def head_too_large(max_line: int, max_headers: int, max_head: int) -> StatusError:
    """A request head past the listener's limits (both listeners)."""
    return StatusError(
        431, f"opgate: request line or header longer than {max_line} bytes, more than "
        f"{max_headers} headers, or a request head over {max_head} bytes",
        "RequestHeaderFieldsTooLarge")


def refused_coding(message: str) -> bool:
    """Whether a request parser (llhttp, aiohttp's) refused a request for its
    ``Transfer-Encoding`` alone (``chunked, gzip``, ``gzip``): a coding the apiserver does not
    implement, which Go's net/http answers 501 (any value but ``chunked``). With a
    ``Content-Length`` too it is ambiguous framing: 400."""
    return "Transfer-Encoding" in message and "Content-Length" not in message


def unsupported_coding(
    message: str = "opgate: no transfer coding but chunked is supported",
) -> StatusError:
    """A request body with a transfer coding besides chunked (``gzip, chunked``): relayed as
    chunked, its coding would be lost on the way. The apiserver answers 501 too."""
    return StatusError(501, message, "NotImplemented")


def version_not_supported() -> StatusError:
    """A request line of another HTTP version than 1.x (the apiserver answers 505 too)."""
    return StatusError(505, "opgate: only HTTP/1.1 and HTTP/1.0 requests are served here",
                       "HTTPVersionNotSupported")


def describe(exc: BaseException) -> str:
    """A short, token-free description of a connection failure."""
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None:
        if isinstance(exc, aiohttp.ClientConnectorCertificateError):
            return f"TLS certificate verification failed: {exc.certificate_error}"
        if isinstance(exc, aiohttp.ClientConnectorError):
            return f"cannot connect: {exc.os_error.strerror or exc.os_error}"
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            return "connect timed out"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS certificate verification failed: {exc.verify_message or exc}"
    if isinstance(exc, ConnectTimeout):
        return "connect timed out"
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror and not isinstance(exc, ssl.SSLError):
        return f"cannot connect: {exc.strerror}" if isinstance(exc, ConnectionRefusedError) \
            else f"{type(exc).__name__}: {exc.strerror}"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _kind(exc: BaseException) -> str:
    aiohttp = sys.modules.get("aiohttp")
    if isinstance(exc, ssl.SSLError) or (aiohttp and isinstance(exc, aiohttp.ClientSSLError)):
        return "tls"
    if isinstance(exc, ConnectTimeout) or (
        aiohttp and isinstance(exc, aiohttp.ConnectionTimeoutError)
    ):
        return "connect_timeout"
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ConnectionRefusedError) or (
        aiohttp and isinstance(exc, aiohttp.ClientConnectorError)
    ):
        return "connect"
    if isinstance(exc, ConnectionError) or (
        aiohttp and isinstance(exc, aiohttp.ServerDisconnectedError)
    ):
        return "disconnect"
    return "other"


RETRY_UNSENT = 1.0  # Retry-After (s) of a call that never reached the apiserver


def upstream_failed(exc: BaseException, ctx: RequestContext, where: str, *,
                    sent: bool = True) -> Answer:
    """Count and log a failure before the upstream's headers; the Status to answer with.
    ``sent=False``: nothing of the call reached the upstream (it failed connecting), so the
    Status tells the client to retry it."""
    retry_after = None if sent else RETRY_UNSENT
    kind = _kind(exc)
    telemetry.UPSTREAM_ERRORS.labels(kind).inc()
    text = describe(exc)
    ctx.error = f"upstream {kind}: {text}"
    log_limited(log, kind, "upstream %s failed before its response (%s %s): %s", where,
                ctx.method, ctx.path, text)
    if kind in ("timeout", "connect_timeout"):
        what = "connect" if kind == "connect_timeout" else "respond"
        return Answer(gateway_timeout(f"opgate: the apiserver did not {what} in time ({text})",
                                      retry_after=retry_after))
    if _out_of_descriptors(exc):  # opgate's own limit, not the apiserver's state
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return Answer(service_unavailable(
            f"opgate is out of file descriptors (open files limit {soft}): cannot connect to "
            "the apiserver", retry_after=retry_after))
    return Answer(service_unavailable(f"opgate: the apiserver is unavailable ({text})",
                                      retry_after=retry_after))


def _out_of_descriptors(exc: BaseException) -> bool:
    """Whether the upstream connection failed for want of a descriptor in opgate (EMFILE,
    ENFILE: every one of its open files limit in use), aiohttp's wrapping included."""
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None and isinstance(exc, aiohttp.ClientConnectorError):
        exc = exc.os_error
    return isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE)


def stream_broke(exc: BaseException, ctx: RequestContext, *, idle: bool) -> None:
    """Count and log an upstream body that ended in an error after the headers went out."""
    kind = "idle" if idle else "stream"
    telemetry.UPSTREAM_ERRORS.labels(kind).inc()
    text = describe(exc)
    ctx.error = f"upstream {kind}: {text}"
    if idle:
        log.debug("watch idle timeout, ending it (%s)", ctx.trace_id)
    else:
        log_limited(log, kind, "upstream response broke mid-stream (%s %s): %s", ctx.method,
                    ctx.path, text)
