"""The caller's bearer tokens, read as the apiserver reads them, and the token cache's key.

The identity middleware (:mod:`proxy.middlewares.identity`) verifies the token of
``Authorization`` or, when that one does not authenticate, of a WebSocket upgrade's
``base64url.bearer.authorization.k8s.io.`` subprotocol (the apiserver's order and rules:
:mod:`proxy.engine.subprotocol`); this module finds them. A token is never logged nor put in a
message; the cache is keyed by a BLAKE2b-256 digest of its bytes, never the token itself.
BLAKE2b rather than SHA-256: CPython's own BLAKE2b is compact code, while ``hashlib.sha256``
goes through OpenSSL's provider machinery on every call, whose cold code cost ~35 µs of a
call's latency on a core woken from idle (an operator's pace: a call every 20 ms or more),
BLAKE2b's ~15 µs (bench/README.md, "Latency at an operator's pace"). The fast path hashes the
header's bytes as the fast relay received them (no decoding of a ~1 KB value, no copies of it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping

from proxy.engine.subprotocol import subprotocol_token

__all__ = ["bearer", "bearer_bytes", "credentials", "token_key"]


def bearer(headers: Mapping[str, str]) -> str | None:
    """The bearer token as the apiserver reads it (its ``bearertoken`` authenticator): the
    value trimmed, then split on single spaces, the second part; ``Bearer  tok`` (two spaces)
    has an empty token there, so none (the apiserver runs such a call as anonymous), and
    ``Bearer a b`` is token ``a``."""
    value = headers.get("Authorization") or headers.get("authorization") or ""
    scheme, space, rest = value.strip().partition(" ")  # (partition: memchr, split: a loop)
    if not space or scheme.lower() != "bearer":
        return None
    return rest.partition(" ")[0] or None


# what str.strip() strips from text decoded as latin-1 (as the fast relay decodes header values)
_STRIP = b" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0"


def token_key(token: bytes) -> bytes:
    """The token cache's key: a 32-byte BLAKE2b digest of the token's bytes (module docstring)."""
    return hashlib.blake2b(token, digest_size=32).digest()


def bearer_bytes(headers: Mapping[str, str]) -> bytes | None:
    """The bytes of the token :func:`bearer` finds (the cache key is their :func:`token_key`).

    With the fast relay's headers (``raw``: the value as received) this is :func:`bearer` on
    bytes, so a ~1 KB token is neither decoded nor encoded per call; the same token, because
    ``_STRIP`` is what ``str.strip`` strips from latin-1 text and ``bytes.lower`` lowers the
    ASCII letters, the only ones that lower into ``bearer``. Any other mapping: ``bearer``,
    encoded as before."""
    raw = getattr(headers, "raw", None)
    if raw is None:
        token = bearer(headers)
        return None if token is None else token.encode()
    value: bytes = raw("Authorization") or b""
    scheme, space, rest = value.strip(_STRIP).partition(b" ")
    if not space or scheme.lower() != b"bearer":
        return None
    return rest.partition(b" ")[0] or None


def credentials(headers: Mapping[str, str], key: bytes | None,
                 problems: list[str]) -> Iterator[tuple[str, bytes]]:
    """The caller's tokens, with their cache keys, in the apiserver's order: ``Authorization``'s,
    then a WebSocket upgrade's subprotocol token (a subprotocol the apiserver refuses adds its
    message to ``problems``). The apiserver's caller is the first that authenticates; opgate's
    too, but with both, a second that authenticates must be the same user: the apiserver may
    refuse a token opgate accepts (of a ServiceAccount deleted since, say) and then run the call
    as the other one."""
    first = bearer(headers)
    if first is not None:  # (key: bearer_bytes's, which agrees with bearer)
        yield first, key if key is not None else token_key(first.encode())
    if "Upgrade" in headers:  # (subprotocol_token: None unless a WebSocket upgrade)
        try:
            token = subprotocol_token(headers)
        except ValueError as exc:
            problems.append(f"invalid bearer token: {exc}")
            return
        if token is not None and token != first:
            yield token, token_key(token.encode())
