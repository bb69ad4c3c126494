"""The API listener's TLS certificate: loaded, checked, and replaced while opgate serves.

A renewal (cert-manager's, a Secret updated by hand) changes the files under a running listener.
Each poll that sees them changed builds a whole new context from them; only one whose key is
the certificate's becomes the context of the handshakes that follow (the listening context's SNI
callback, which OpenSSL calls for every ClientHello, with or without a server name, hands each
new connection the newest good one). Loading into the live context instead, as opgate did,
left it unusable by a pair caught half-written (OpenSSL drops the key a new certificate does
not match, then refuses the old key: every handshake failed until the next good pair), and
kept the old certificate served beside a new one of another key type (ECDSA and RSA have a slot
each). A new certificate already expired is refused too (the old one may still be good);
at start it is only said. Open connections keep the context they were made with. A refused
pair is seen besides its log line: in the metrics and on ``/readyz?verbose``
(:class:`CertReloader`), never by failing readiness.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import ssl

from proxy.engine import telemetry

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
        raise TLSFilesError(_at_fault(cert, key, e)) from e
    ctx.set_alpn_protocols(["http/1.1"])  # both relay cores speak HTTP/1.1 only
    return ctx


_PEM_MARKS = (("--tls-cert", "-----BEGIN CERTIFICATE-----", "a PEM certificate"),
              ("--tls-key", "PRIVATE KEY-----", "a PEM private key"))


def _at_fault(cert: str, key: str, exc: Exception) -> str:
    """Which file of a pair OpenSSL refused is wrong, as far as can be told (OpenSSL says only
    'PEM lib'): the flags given each other's file, an empty one, a key of another cert."""
    reason = getattr(exc, "reason", None)
    if reason == "KEY_VALUES_MISMATCH":
        return f"--tls-key {key} is not the private key of --tls-cert {cert}"
    for (flag, mark, what), path in zip(_PEM_MARKS, (cert, key), strict=True):
        try:
            with open(path, encoding="ascii", errors="replace") as f:
                found = mark in f.read()
        except OSError:
            found = True  # (read a moment ago; say no more than OpenSSL did)
        if not found:
            return f"{flag} {path}: not {what} (no {mark!r} in it)"
    return (f"--tls-cert {cert} / --tls-key {key}: not a PEM certificate and its private key "
            f"({reason or exc})")


def _tlv(der: bytes, at: int) -> tuple[int, int, int]:
    """The DER element at ``at``: its tag, where its content starts and where it ends."""
    tag, length, start = der[at], der[at + 1], at + 2
    if length & 0x80:
        n = length & 0x7F
        length, start = int.from_bytes(der[start:start + n], "big"), start + n
    return tag, start, start + length


def _not_after(der: bytes) -> dt.datetime:
    """A certificate's notAfter (RFC 5280's tbsCertificate, walked as far as its validity: the
    standard library parses no certificate, and cryptography costs every pod megabytes)."""
    _, tbs, _ = _tlv(der, 0)
    _, at, _ = _tlv(der, tbs)
    if der[at] == 0xA0:  # [0] version
        at = _tlv(der, at)[2]
    for _skipped in ("serialNumber", "signature", "issuer"):
        at = _tlv(der, at)[2]
    _, validity, _ = _tlv(der, at)
    tag, start, end = _tlv(der, _tlv(der, validity)[2])  # notBefore, then notAfter
    text = der[start:end].decode("ascii")
    return dt.datetime.strptime(text, "%y%m%d%H%M%SZ" if tag == 0x17 else "%Y%m%d%H%M%SZ"
                                ).replace(tzinfo=dt.UTC)


def not_after(cert: str) -> dt.datetime | None:
    """The notAfter of the file's certificate (its first); ``None`` when it cannot be read
    (what cannot be read is load_cert_chain's to say)."""
    try:
        with open(cert, encoding="ascii", errors="replace") as f:
            pem = f.read()
        begin = pem.index("-----BEGIN CERTIFICATE-----")
        end = pem.index("-----END CERTIFICATE-----", begin) + len("-----END CERTIFICATE-----")
        return _not_after(ssl.PEM_cert_to_DER_cert(pem[begin:end]))
    except (OSError, ValueError, IndexError):
        return None


def _stamp(when: dt.datetime) -> str:
    return f"{when:%Y-%m-%dT%H:%M:%SZ}"


def expired(cert: str, ends: dt.datetime | None = None) -> str | None:
    """Why the file's certificate (its first; ``ends``: its notAfter, when read already) can
    be served to no client, or ``None``: clients refuse one past its notAfter (not one not yet
    valid: a clock a little behind the issuer's would refuse a fresh renewal)."""
    ends = ends or not_after(cert)
    if ends is None or ends >= dt.datetime.now(dt.UTC):
        return None
    return f"--tls-cert {cert}: the certificate expired at {_stamp(ends)}"


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
    """Polls the cert/key files and makes a good new pair the context of new handshakes.

    What it serves, and a reload that failed, are seen without reading the log: the gauge
    ``opgate_tls_cert_expiry_timestamp_seconds`` (the notAfter of the certificate new
    handshakes get), the counter ``opgate_tls_cert_reloads_total{result}``, and
    :meth:`describe` (``/readyz``'s ``serving-cert`` line). A failed reload fails no readiness:
    the old pair still serves, and an unready pod is taken out of its Service for a problem its
    clients do not have yet (the expiry gauge is what to alert on)."""

    def __init__(self, ctx: ssl.SSLContext, cert: str, key: str) -> None:
        self._cert, self._key = cert, key
        self._serving = ctx
        self._stamp = _read_stamp(cert, key)
        self._not_after = not_after(cert)
        self.failure: str | None = None  # why the files as they are now are not served
        if (why := expired(cert, self._not_after)) is not None:  # (served: there is no other)
            log.warning("TLS certificate: %s; clients will refuse it", why)
        self._show()
        ctx.sni_callback = self._choose
        self._task = asyncio.get_running_loop().create_task(self._run())

    def _choose(self, conn: ssl.SSLObject, _name: str | None, _ctx: ssl.SSLContext) -> None:
        conn.context = self._serving

    def _show(self) -> None:
        if self._not_after is not None:
            telemetry.TLS_CERT_EXPIRY.labels(cert=self._cert).set(self._not_after.timestamp())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TLS_RELOAD_INTERVAL)
            stamp = _read_stamp(self._cert, self._key)
            if stamp == self._stamp:
                continue
            # a pair that fails is tried again once the files change (the key written after
            # the cert), not every poll: one warning for each state, not one every 5 s
            self._stamp = stamp
            self._reload()

    def _reload(self) -> None:
        try:
            fresh = server_tls_context(self._cert, self._key)
            ends = not_after(self._cert)
            if (why := expired(self._cert, ends)) is not None:
                raise TLSFilesError(why)
        except TLSFilesError as e:
            log.warning("TLS certificate reload failed, keeping the old one: %s", e)
            telemetry.TLS_CERT_RELOADS.labels(result="error").inc()
            self.failure = f"{e} (since {_stamp(dt.datetime.now(dt.UTC))})"
            return
        self._serving, self._not_after, self.failure = fresh, ends, None
        self._show()
        telemetry.TLS_CERT_RELOADS.labels(result="success").inc()
        log.info("TLS certificate reloaded from %s", self._cert)

    def describe(self) -> tuple[bool, str]:
        """``/readyz``'s ``serving-cert`` check: always passing (see the class docstring); its
        detail starts ``warning:`` while a changed pair is refused or the one served expired
        (the supervisor of ``--workers`` repeats such a detail of a worker)."""
        ends = "" if self._not_after is None else f", notAfter {_stamp(self._not_after)}"
        serving = f"{self._cert}{ends}"
        warnings = []
        if self.failure is not None:
            warnings.append(f"the changed files are not served: {self.failure}; the old "
                            f"certificate serves on ({serving})")
        if self._not_after is not None and self._not_after < dt.datetime.now(dt.UTC):
            warnings.append(f"the certificate served expired at {_stamp(self._not_after)}: "
                            "clients refuse it")
        if warnings:
            return True, "warning: " + "; ".join(warnings)
        return True, serving

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
