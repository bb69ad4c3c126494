"""The upstream as every part of the relay reaches it: TLS context, address, token.

Built once at start from an :class:`UpstreamConfig`: one ``SSLContext`` (CA, client certificate,
ALPN ``http/1.1``) shared by every connection opgate opens upstream with its own credentials, and
when those include a client certificate a second one without it, for the calls that carry the
caller's credentials (the apiserver authenticates a connection's certificate before any token: a
caller's token over opgate's connection would be ignored and the call run as opgate); the
:class:`Endpoint` (the parts of the URL needed on every call), and a :class:`TokenSource` that
follows a rotating projected token file without a syscall per request. No HTTP library here: the
fast relay needs none, the aiohttp session (:mod:`proxy.relay.session`) builds on this.
"""

from __future__ import annotations

import logging
import os
import ssl
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from proxy.relay.upstream import UpstreamConfig, UpstreamConfigError

__all__ = ["MAX_HEADER_LINE", "Endpoint", "TokenSource", "make_ssl_context"]

log = logging.getLogger("opgate.relay")

MAX_HEADER_LINE = 64 * 1024  # long label selectors, big OIDC tokens, many Warning headers


def make_ssl_context(
    config: UpstreamConfig, *, client_cert: bool = True
) -> ssl.SSLContext | None:
    """The client TLS context for an https upstream (``None`` for http); with ``client_cert``
    false, without the configured client certificate (see :attr:`Endpoint.caller_tls`)."""
    if not config.url.startswith("https:"):
        return None
    try:
        ctx = ssl.create_default_context(
            ssl.Purpose.SERVER_AUTH, cafile=config.ca_file, cadata=config.ca_data
        )
        if client_cert and config.client_cert_file and config.client_key_file:
            ctx.load_cert_chain(config.client_cert_file, config.client_key_file)
    except (OSError, ssl.SSLError, ValueError) as e:
        raise UpstreamConfigError(f"upstream TLS ({config.source or 'config'}): {e}") from e
    if config.insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where to connect: the parts of the upstream URL the relay needs on every call."""

    base: str  # scheme://host:port[/prefix], no trailing slash
    host: str
    port: int
    host_header: str
    prefix: str  # path prefix of the upstream URL ("" for most)
    tls: ssl.SSLContext | None  # None for http
    server_name: str | None
    # for calls that carry the caller's own credentials: ``tls`` without opgate's client
    # certificate (``tls`` itself when there is none), which the apiserver would read first
    caller_tls: ssl.SSLContext | None

    @classmethod
    def from_config(cls, config: UpstreamConfig, ctx: ssl.SSLContext | None) -> Endpoint:
        parts = urlsplit(config.url)
        assert parts.hostname is not None
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(
            base=config.url.rstrip("/"),
            host=parts.hostname,
            port=port,
            host_header=parts.netloc.rpartition("@")[2],
            prefix=parts.path.rstrip("/"),
            tls=ctx,
            server_name=config.server_name,
            caller_tls=(make_ssl_context(config, client_cert=False)
                        if ctx is not None and config.client_cert_file else ctx),
        )


class TokenSource:
    """The bearer token to add when the client sent none: fixed, or read from a file.

    The file is stat()ed at most once a second and re-read when its mtime, size or inode
    changes (kubelet rotates projected tokens by swapping a symlink). A file that cannot be read
    keeps the last good token and is logged once per failure streak.
    """

    __slots__ = ("_checked", "_failing", "_file", "_header", "_raw", "_stamp")

    def __init__(self, *, token: str | None = None, token_file: str | None = None) -> None:
        self._file = token_file
        self._header: str | None = None
        self._raw: bytes | None = None
        self._set(f"Bearer {token}" if token else None)
        self._stamp: tuple[int, int, int] | None = None
        self._checked = 0.0
        self._failing = False
        if token_file:
            self._refresh(time.monotonic())

    def authorization(self, now: float | None = None) -> str | None:
        """The ``Authorization`` value, or ``None`` when opgate has no credentials to add.
        ``now``: the caller's ``time.monotonic()`` of this instant, if it has one."""
        if self._file is not None:
            self._check(now)
        return self._header

    def authorization_raw(self, now: float | None = None) -> bytes | None:
        """:meth:`authorization` as bytes (latin-1), encoded once per token."""
        if self._file is not None:
            self._check(now)
        raw = self._raw
        if raw is None and self._header is not None:  # (a token latin-1 cannot encode raises)
            raw = self._raw = self._header.encode("latin-1")
        return raw

    def _check(self, now: float | None) -> None:
        """Re-read the token file at most once a second."""
        if now is None:
            now = time.monotonic()
        if now - self._checked >= 1.0:
            self._refresh(now)

    def _set(self, header: str | None) -> None:
        self._header = header
        self._raw = None  # encoded when first asked for

    def _refresh(self, now: float) -> None:
        self._checked = now
        assert self._file is not None
        try:
            st = os.stat(self._file)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp == self._stamp:
                return
            with open(self._file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            if not self._failing:
                log.warning("cannot read the upstream token file %s: %s", self._file, e.strerror)
            self._failing = True
            return
        if self._failing or self._stamp is not None:
            log.info("upstream token file %s (re)loaded", self._file)
        self._failing = False
        self._stamp = stamp
        self._set(f"Bearer {token}" if token else None)
