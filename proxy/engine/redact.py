"""What never leaves opgate in a record of a call (the audit log, traffic capture): tokens.

Shared by every component that writes calls down, so they redact the same things the same way:

* a query parameter whose name contains ``token``, ``password`` or ``secret``
  (``?access_token=…``): its value becomes ``REDACTED`` (:func:`redact_query`);
* request and response headers that carry credentials (``Authorization``,
  ``Proxy-Authorization``, ``Cookie``, ``Set-Cookie``, any name containing ``token``, ``password``
  or ``secret``) and the bearer token client-go puts into a WebSocket subprotocol
  (``Sec-WebSocket-Protocol: base64url.bearer.authorization.k8s.io.<token>``)
  (:func:`redact_header`);
* in JSON objects: a TokenReview's ``spec.token`` and a TokenRequest's ``status.token``
  (:func:`redact_object`).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote_plus

__all__ = ["REDACTED", "SECRET_NAME", "carries_token", "redact_header", "redact_object",
           "redact_query"]

REDACTED = "REDACTED"
SECRET_NAME = re.compile(r"token|password|secret", re.IGNORECASE)
_CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie", "set-cookie"})
_WS_BEARER = re.compile(r"(base64url\.bearer\.authorization\.k8s\.io\.)[^,\s]*", re.IGNORECASE)


def redact_query(query: str) -> str:
    """``query`` with the value of every secret-looking parameter replaced by ``REDACTED``; a
    name is judged decoded, as the apiserver reads it (``%74oken`` is ``token``)."""
    if not query or ("%" not in query and not SECRET_NAME.search(query)):
        return query
    parts = []
    for part in query.split("&"):
        name, eq, _ = part.partition("=")
        plain = unquote_plus(name) if "%" in name or "+" in name else name
        parts.append(f"{name}={REDACTED}" if eq and SECRET_NAME.search(plain) else part)
    return "&".join(parts)


def redact_header(name: str, value: str) -> str:
    """The value to record for header ``name`` (``value`` itself when it carries no secret).
    ``Authorization: Bearer x`` becomes ``Bearer REDACTED`` (the scheme stays readable)."""
    low = name.lower()
    if low in _CREDENTIAL_HEADERS or SECRET_NAME.search(low):
        scheme, space, _ = value.strip().partition(" ")
        return f"{scheme} {REDACTED}" if space and low.endswith("authorization") else REDACTED
    if low == "sec-websocket-protocol" and "bearer" in value.lower():
        return _WS_BEARER.sub(r"\g<1>" + REDACTED, value)
    return value


def carries_token(api_group: str, resource: str, subresource: str) -> bool:
    """Whether objects of this resource hold a token in a known field (TokenReview's
    ``spec.token``, TokenRequest's ``status.token``): see :func:`redact_object`."""
    return ((resource == "tokenreviews" and api_group == "authentication.k8s.io")
            or (resource == "serviceaccounts" and subresource == "token"))


def redact_object(obj: Any, api_group: str, resource: str, subresource: str = "") -> Any:
    """``obj`` (decoded JSON) with the token fields of :func:`carries_token` resources
    replaced by ``REDACTED`` (a new top-level dict when something changed)."""
    if not isinstance(obj, dict) or not carries_token(api_group, resource, subresource):
        return obj
    for field in ("spec", "status"):
        part = obj.get(field)
        if isinstance(part, dict) and "token" in part:
            obj = {**obj, field: {**part, "token": REDACTED}}
    return obj
