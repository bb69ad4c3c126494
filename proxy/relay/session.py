"""The aiohttp session to the upstream (the aiohttp relay, the informers, the authenticator).

One pooled ``ClientSession`` per user, configured to change nothing in transit (no
decompression, no cookie jar, no headers of its own), on the :class:`Endpoint` and TLS context
of :mod:`proxy.relay.endpoint` (re-exported here); and :func:`probe`, the readiness check.
"""

from __future__ import annotations

import aiohttp
from yarl import URL

from proxy.relay.endpoint import MAX_HEADER_LINE, Endpoint, TokenSource, make_ssl_context
from proxy.relay.errors import describe
from proxy.relay.fast.upstream import MAX_HEAD as MAX_RESPONSE_HEAD

__all__ = [
    "MAX_HEADER_LINE",
    "Endpoint",
    "TokenSource",
    "make_session",
    "make_ssl_context",
    "probe",
]

# A response head as the fast core takes it, up to 1 MiB: aiohttp bounds each field and their
# count, not their sum, so a field may be that long and a head that many fields of 64 bytes.
# (Its defaults, 8190 bytes and 128 fields, made a call the apiserver had answered a 503: a
# Warning header per warning, a proxied backend's head, which Go's client takes to 10 MB.)
MAX_RESPONSE_FIELDS = MAX_RESPONSE_HEAD // 64

# Headers aiohttp would otherwise add on its own; the client's own values (if any) still pass.
SKIP_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")


def make_session(
    endpoint: Endpoint, *, connect_timeout: float, read_bufsize: int = 2**17
) -> aiohttp.ClientSession:
    """One pooled session for every relayed call; per-call timeouts are passed per request."""
    connector = aiohttp.TCPConnector(
        limit=0,
        limit_per_host=0,
        ttl_dns_cache=300,
        keepalive_timeout=30.0,
        ssl=endpoint.tls if endpoint.tls is not None else True,
    )
    return aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=SKIP_AUTO_HEADERS,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout or None),
        read_bufsize=read_bufsize,
        max_line_size=MAX_HEADER_LINE,
        max_field_size=MAX_RESPONSE_HEAD,
        max_headers=MAX_RESPONSE_FIELDS,
        trust_env=False,
        requote_redirect_url=False,
    )


async def probe(
    session: aiohttp.ClientSession, endpoint: Endpoint, authorization: str | None
) -> tuple[bool, str]:
    """``GET /readyz``, then ``/version`` (some RBAC setups hide readyz): any 200 is ready."""
    headers = {"Authorization": authorization} if authorization else {}
    timeout = aiohttp.ClientTimeout(total=3.0)
    last = ""
    for path in ("/readyz", "/version"):
        try:
            async with session.get(
                URL(endpoint.base + path, encoded=True),
                headers=headers,
                timeout=timeout,
                allow_redirects=False,
                server_hostname=endpoint.server_name,
            ) as r:
                await r.read()
                if r.status == 200:
                    return True, f"upstream {path} answered 200"
                last = f"upstream {path} answered {r.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            return False, f"upstream unreachable: {describe(e)}"
    return False, last
