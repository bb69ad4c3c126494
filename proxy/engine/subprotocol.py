"""The bearer token a WebSocket client sends as a subprotocol, read as kube-apiserver reads it.

A browser cannot set ``Authorization`` on a WebSocket, so the apiserver also takes the token from
``Sec-WebSocket-Protocol: base64url.bearer.authorization.k8s.io.<base64url(token), no padding>``
next to the real subprotocol (``v5.channel.k8s.io`` …). Its authenticators run in order, the
first that authenticates wins: the ``Authorization`` bearer token, then this one
(k8s.io/apiserver ``request/websocket/protocol.go``, after ``request/bearertoken``; in
``pkg/kubeapiserver/authenticator/config.go``). Shared by the identity middleware, which verifies
that token, and the relays, which never add opgate's own ``Authorization`` to a request that
carries one (the apiserver would take opgate's first and run the call as opgate).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping

__all__ = ["PREFIX", "carries_token", "is_websocket", "subprotocol_token"]

PREFIX = "base64url.bearer.authorization.k8s.io."
_PREFIX_LOWER = PREFIX.lower()
_PREFIX_LOWER_BYTES = _PREFIX_LOWER.encode()

# wsstream.IsWebSocketRequest's test of the (first) Connection value, lower-cased; RE2's \s
_CONNECTION_UPGRADE = re.compile(r"(^|.*,[\t\n\f\r ]*)upgrade(\Z|[\t\n\f\r ]*,)")
_BASE64URL = re.compile(r"[A-Za-z0-9_-]*")
_SPACE = " \t\n\r\x0b\x0c"  # Go's strings.TrimSpace (of ASCII text: a token's is)


def is_websocket(headers: Mapping[str, str]) -> bool:
    """``Upgrade: websocket`` (any case) and ``upgrade`` among the ``Connection`` tokens: the
    apiserver's test, on the first value of each header."""
    upgrade = headers.get("Upgrade")
    if upgrade is None or upgrade.strip(" \t").lower() != "websocket":
        return False
    return _CONNECTION_UPGRADE.match((headers.get("Connection") or "").lower()) is not None


def subprotocol_token(headers: Mapping[str, str]) -> str | None:
    """The token of a WebSocket upgrade's bearer subprotocol, ``None`` if it has none (also when
    the request is not a WebSocket upgrade: the apiserver then ignores the header).

    Raises ``ValueError`` with the apiserver's message where it refuses the request: two token
    subprotocols, one that is not unpadded base64url or not UTF-8, or a token with no other
    subprotocol next to it. An empty token is no token (the call goes on as anonymous)."""
    if "Sec-WebSocket-Protocol" not in headers or not is_websocket(headers):
        return None
    getall = getattr(headers, "getall", None)  # (every header of the name: RFC 6455 11.3.4)
    values = (getall("Sec-WebSocket-Protocol") if getall is not None
              else (headers["Sec-WebSocket-Protocol"],))
    token, seen, others = "", False, 0
    for value in values:
        for protocol in value.split(","):
            protocol = protocol.strip(_SPACE)
            if not protocol.startswith(PREFIX):
                others += 1
                continue
            if seen:
                raise ValueError("multiple base64.bearer.authorization tokens specified")
            seen = True
            token = _decode(protocol[len(PREFIX):])
    if token and not others:
        raise ValueError("missing additional subprotocol")
    return token or None


def _decode(encoded: str) -> str:
    """Go's ``base64.RawURLEncoding.DecodeString`` (no padding, no other alphabet, trailing
    bits not checked), then UTF-8."""
    if _BASE64URL.fullmatch(encoded) is None or len(encoded) % 4 == 1:
        raise ValueError("invalid base64.bearer.authorization token encoding")
    try:
        raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
    except (binascii.Error, ValueError):
        raise ValueError("invalid base64.bearer.authorization token encoding") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("invalid base64.bearer.authorization token") from None


def carries_token(value: str | bytes) -> bool:
    """Whether a ``Sec-WebSocket-Protocol`` value holds a bearer-token subprotocol, on any
    request (any case, anywhere: the relays' test, erring on the side of not adding opgate's
    token: a request with a token of its own never runs as opgate)."""
    if isinstance(value, bytes):
        return _PREFIX_LOWER_BYTES in value.lower()
    return _PREFIX_LOWER in value.lower()
