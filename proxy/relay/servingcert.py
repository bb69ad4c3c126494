"""The API listener's TLS certificate: loaded, checked, and replaced while opgate serves.

A renewal (cert-manager's, a Secret updated by hand) changes the files under a running listener.
Each poll that sees them changed builds a whole new context from them; only one whose key is
the certificate's becomes the context of the handshakes that follow (the listening context's SNI
callback, which OpenSSL calls for every ClientHello, with or without a server name, hands each
new connection the newest good one). Loading into the live context instead, as opgate did,
left it unusable by a pair caught half-written (OpenSSL drops the key a new certificate does
not match, then refuses the old key: every handshake failed until the next good pair), and
kept the old certificate served beside a new one of another key type (ECDSA and RSA have a slot
each). Open connections keep the context they were made with.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl

__all__ = ["CertReloader", "TLSFilesError", "server_tls_context"]

log = logging.getLogger("opgate.listen")

TLS_RELOAD_INTERVAL = 5.0

_Stamp = tuple[tuple[int, int, int, int], ...] | None


class TLSFilesError(ValueError):
    """``--tls-cert`` / ``--tls-key`` cannot be used; ``str()`` names the flag and the reason."""


class _Encrypted(Exception):
    """Raised by the passphrase callback: the key asks for a passphrase opgate does not have."""


def _no_passphrase() -> bytes:
    """Refuse at once: without a callback OpenSSL asks for the passphrase on the terminal, and
    waits there (the whole event loop with it, during a reload)."""
    raise _Encrypted


def server_tls_context(cert: str, key: str) -> ssl.SSLContext:
    """The API listener's TLS context; :class:`TLSFilesError` when the pair cannot be loaded."""
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as e:
            raise TLSFilesError(f"{flag} {path}: cannot read it: {e.strerror}") from e
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key, password=_no_passphrase)
    except _Encrypted:
        raise TLSFilesError(
            f"--tls-key {key}: the key is encrypted with a passphrase; opgate needs it "
            "unencrypted (as the apiserver, and a kubernetes.io/tls Secret, have it)") from None
    except (ssl.SSLError, OSError, ValueError) as e:
        raise TLSFilesError(
            f"--tls-cert {cert} / --tls-key {key}: not a PEM certificate and its private key "
            f"({getattr(e, 'reason', None) or e})") from e
    ctx.set_alpn_protocols(["http/1.1"])  # both relay cores speak HTTP/1.1 only
    return ctx


def _read_stamp(cert: str, key: str) -> _Stamp:
    """What tells the files changed: a new inode (kubelet's ``..data`` swap, a rename), a
    write (mtime, size), a chmod (ctime); ``None`` while one cannot be seen."""
    try:
        return tuple(
            (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)
            for st in (os.stat(cert), os.stat(key))
        )
    except OSError:
        return None


class CertReloader:
    """Polls the cert/key files and makes a good new pair the context of new handshakes."""

    def __init__(self, ctx: ssl.SSLContext, cert: str, key: str) -> None:
        self._cert, self._key = cert, key
        self._serving = ctx
        self._stamp = _read_stamp(cert, key)
        ctx.sni_callback = self._choose
        self._task = asyncio.get_running_loop().create_task(self._run())

    def _choose(self, conn: ssl.SSLObject, _name: str | None, _ctx: ssl.SSLContext) -> None:
        conn.context = self._serving

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TLS_RELOAD_INTERVAL)
            stamp = _read_stamp(self._cert, self._key)
            if stamp == self._stamp:
                continue
            # a pair that fails is tried again once the files change (the key written after
            # the cert), not every poll: one warning for each state, not one every 5 s
            self._stamp = stamp
            try:
                fresh = server_tls_context(self._cert, self._key)
            except TLSFilesError as e:
                log.warning("TLS certificate reload failed, keeping the old one: %s", e)
                continue
            self._serving = fresh
            log.info("TLS certificate reloaded from %s", self._cert)

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
