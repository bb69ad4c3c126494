"""A tiny asyncio Kubernetes API client: JSON requests with retries, and watch streams.

The only module of the sample operator that imports aiohttp. Every call can carry the
``Opgate-Instance`` header naming the Widget it is made for, so opgate can rate-limit and account
per custom-resource instance. Failed calls are sent again as client-go's ``rest.Request`` does
it (``retry.resend_delay``): any verb after the server's ``Retry-After`` on a 429 or 5xx; a GET
(only) after its connection was reset or closed under it, 1 s later; once with a fresh token
after a 401 when the token comes from a file. Nothing else: a write whose connection went, or
that timed out, may have been applied, and a create with ``generateName`` sent twice makes two
objects; a 5xx without ``Retry-After``, a 409 and the rest go to the caller, whose own backoff
(the work queue's, the informer's) or fresh read decides. (aiohttp itself sends a PUT or a
DELETE, idempotent in HTTP, once more when its connection is cut, where Go's transport would
not: the operator's PUT carries a ``resourceVersion`` and its DELETE a UID precondition, so a
second copy can only be refused.)
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import aiohttp

from .config import ClusterConfig
from .retry import CONNECTION_RETRY_DELAY, parse_retry_after, resend_delay

log = logging.getLogger("reconciler.kube")

INSTANCE_HEADER = "Opgate-Instance"
USER_AGENT = "opgate-sample-operator/0.1"
MERGE_PATCH = "application/merge-patch+json"
MAX_LINE = 16 * 1024 * 1024
RESET_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE})


class ApiError(Exception):
    """A non-2xx answer (``code`` > 0) or no answer at all (``code`` == 0)."""

    def __init__(
        self, *, code: int, reason: str, message: str, retry_after: float | None = None
    ) -> None:
        super().__init__(f"{code} {reason}: {message}" if code else f"connection error: {message}")
        self.code = code
        self.reason = reason
        self.message = message
        self.retry_after = retry_after

    @classmethod
    def from_status(cls, code: int, body: bytes, headers: Mapping[str, str]) -> ApiError:
        reason, message = "", body[:200].decode(errors="replace").strip()
        try:
            status = json.loads(body)
        except ValueError:
            status = None
        if isinstance(status, dict):
            reason = str(status.get("reason") or "")
            message = str(status.get("message") or message)[:500]
        return cls(code=code, reason=reason, message=message,
                   retry_after=parse_retry_after(headers.get("Retry-After")))

    @classmethod
    def from_watch_event(cls, status: Mapping[str, Any]) -> ApiError:
        return cls(code=int(status.get("code") or 500), reason=str(status.get("reason") or ""),
                   message=str(status.get("message") or "watch error")[:500])


def is_reset(exc: BaseException) -> bool:
    """The connection was reset or closed after the request went out: client-go's
    ``IsConnectionReset`` / ``IsProbableEOF``. Not a refused connection, not a timeout."""
    if isinstance(exc, TimeoutError | aiohttp.ClientConnectorError):
        return False
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return True
    return isinstance(exc, aiohttp.ClientOSError) and exc.errno in RESET_ERRNOS


class KubeClient:
    """JSON over HTTP to one apiserver (here: to the opgate sidecar in front of it)."""

    def __init__(
        self, config: ClusterConfig, *, max_attempts: int = 8, request_timeout: float = 30.0
    ) -> None:
        self._config = config
        self._max_attempts = max_attempts
        self._timeout = aiohttp.ClientTimeout(total=request_timeout, sock_connect=10)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> KubeClient:
        ssl_arg = self._config.ssl_context if self._config.ssl_context is not None else True
        connector = aiohttp.TCPConnector(ssl=ssl_arg, limit=64)
        self._session = aiohttp.ClientSession(connector=connector, headers={
            "User-Agent": USER_AGENT, "Accept": "application/json"})
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self, instance: str | None, content_type: str | None) -> dict[str, str]:
        headers: dict[str, str] = {}
        token = self._config.tokens.get()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if instance:
            headers[INSTANCE_HEADER] = instance
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    def _url(self, path: str) -> str:
        return self._config.server + path

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        instance: str | None = None,
    ) -> dict[str, Any]:
        """Send one call, retrying what is retryable; return the decoded JSON body."""
        assert self._session is not None, "use `async with KubeClient(...)`"
        data = None if body is None else json.dumps(body).encode()
        refreshed = False
        attempt = 0
        while True:
            headers = self._headers(instance, content_type if data is not None else None)
            reset = False
            try:
                async with self._session.request(
                    method, self._url(path), params=query, data=data, headers=headers,
                    timeout=self._timeout,
                ) as resp:
                    raw = await resp.read()
                    if resp.status < 300:
                        return json.loads(raw) if raw else {}
                    error = ApiError.from_status(resp.status, raw, resp.headers)
            except (TimeoutError, aiohttp.ClientError) as exc:
                reset = is_reset(exc)
                error = ApiError(code=0, reason="ConnectionError",
                                 message=type(exc).__name__ + (f": {exc}" if str(exc) else ""))
            if error.code == 401 and self._config.tokens.from_file and not refreshed:
                self._config.tokens.reload()
                refreshed = True
                continue
            delay = resend_delay(method, error.code, retry_after=error.retry_after, reset=reset,
                                 reset_delay=CONNECTION_RETRY_DELAY)
            attempt += 1
            if delay is None or attempt >= self._max_attempts:
                raise error
            log.debug("retrying %s %s in %.2fs after %s", method, path, delay, error)
            await asyncio.sleep(delay)

    async def watch(
        self,
        path: str,
        *,
        query: Mapping[str, str],
        read_timeout: float,
        instance: str | None = None,
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Open one watch stream and yield its events; raise :class:`ApiError` if it fails.

        ``read_timeout`` is an inactivity timeout: the stream may last as long as the server
        keeps it, but a silent connection is given up. The caller decides about retries.
        """
        assert self._session is not None, "use `async with KubeClient(...)`"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=read_timeout)
        try:
            async with self._session.get(
                self._url(path), params=dict(query), headers=self._headers(instance, None),
                timeout=timeout,
            ) as resp:
                if resp.status != 200:
                    raise ApiError.from_status(resp.status, await resp.read(), resp.headers)
                buffer = b""
                async for chunk in resp.content.iter_any():
                    buffer += chunk
                    while b"\n" in buffer:
                        line, buffer = buffer.split(b"\n", 1)
                        if line.strip():
                            yield json.loads(line)
                    if len(buffer) > MAX_LINE:
                        raise ApiError(code=0, reason="ProtocolError",
                                       message="watch line too long")
                if buffer.strip():
                    yield json.loads(buffer)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise ApiError(code=0, reason="ConnectionError",
                           message=type(exc).__name__ + (f": {exc}" if str(exc) else "")) from None
