"""Header hygiene between the client and the apiserver, in both directions.

A proxy must not forward hop-by-hop headers (RFC 9110 §7.6.1: ``Connection`` and every header it
names, ``Keep-Alive``, ``TE``, ``Trailer``, ``Transfer-Encoding``, ``Upgrade``, ``Proxy-*``); every
other header is end-to-end and passes untouched, repeated names included (``Warning``,
``Audit-Id``, ``X-Kubernetes-PF-*``, ``Content-Encoding`` ...). On the way up opgate also removes
its own ``Opgate-*`` headers, the client's ``Impersonate-*`` headers unless a policy allows
impersonation, the request-header authenticator's ``X-Remote-User``, ``-Group``, ``-Uid`` and
``-Extra-*`` (always: only a front proxy may send them, and opgate's certificate may be one),
and whatever the middlewares asked to drop.

These functions run on every call: the sets are built once, and each header costs one
``lower()`` and a few set lookups.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping

from multidict import CIMultiDict

from proxy.engine.context import RequestContext
from proxy.engine.subprotocol import carries_token
from proxy.relay.calls import IMPERSONATION_DROPPED

__all__ = [
    "HOP_BY_HOP",
    "REQUEST_HEADER_EXTRA",
    "REQUEST_HEADER_IDENTITY",
    "carries_credentials",
    "connection_tokens",
    "for_upstream",
    "is_upgrade_request",
    "request_headers",
    "response_headers",
]

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# The identity headers of the apiserver's request-header authenticator (its --requestheader-*
# defaults, kubeadm's): it takes them from a connection whose certificate its requestheader CA
# signed, which opgate's own may be; no caller of opgate is a front proxy, so they never pass.
REQUEST_HEADER_IDENTITY = frozenset({"x-remote-user", "x-remote-group", "x-remote-uid"})
REQUEST_HEADER_EXTRA = "x-remote-extra-"
# Never forwarded upstream: hop-by-hop, plus what the relay sets itself (Host from the upstream
# URL) and what it answers itself (Expect: opgate sends the 100 Continue).
_REQUEST_DROP = HOP_BY_HOP | {"host", "expect"} | REQUEST_HEADER_IDENTITY
_REQUEST_DROP_UPGRADE = _REQUEST_DROP - {"upgrade", "connection"}
_RESPONSE_DROP = HOP_BY_HOP
_RESPONSE_DROP_UPGRADE = HOP_BY_HOP - {"upgrade", "connection"}
_DROP_PREFIXES = ("proxy-", "opgate-", REQUEST_HEADER_EXTRA)
_IMPERSONATE = "impersonate-"
_NOTHING: frozenset[str] = frozenset()

log = logging.getLogger("opgate.relay")


def connection_tokens(headers: Mapping[str, str]) -> frozenset[str]:
    """The lower-case header names listed in ``Connection`` (all of its occurrences)."""
    if "Connection" not in headers:
        return _NOTHING
    getall = getattr(headers, "getall", None)
    values: Iterable[str] = getall("Connection") if getall else (headers["Connection"],)
    return frozenset(
        token.strip().lower() for value in values for token in value.split(",") if token.strip()
    )


def is_upgrade_request(headers: Mapping[str, str]) -> bool:
    """``Upgrade: <proto>`` together with ``Connection: upgrade`` (SPDY/3.1, websocket ...)."""
    return "Upgrade" in headers and "upgrade" in connection_tokens(headers)


def carries_credentials(headers: Mapping[str, str]) -> bool:
    """Whether the client sent credentials of its own: any ``Authorization`` (even one listed
    in ``Connection``) or a WebSocket bearer-token subprotocol (:func:`carries_token`). Such a
    call never goes with opgate's, its token nor its client certificate (the apiserver reads a
    certificate first: ``Endpoint.caller_tls``)."""
    if "Authorization" in headers:
        return True
    if "Sec-WebSocket-Protocol" not in headers:
        return False
    getall = getattr(headers, "getall", None)
    values: Iterable[str] = (getall("Sec-WebSocket-Protocol") if getall
                             else (headers["Sec-WebSocket-Protocol"],))
    return any(map(carries_token, values))


def request_headers(
    headers: Mapping[str, str],
    *,
    drop: Collection[str] = (),
    allow_impersonation: bool = False,
    upgrade: bool = False,
) -> tuple[CIMultiDict[str], bool]:
    """The headers to send upstream, and whether the client sent any ``Impersonate-*`` header.

    ``drop`` holds lower-case names a middleware removed. With ``upgrade`` the ``Upgrade`` header
    is kept and ``Connection`` becomes exactly ``Upgrade``.
    """
    named = connection_tokens(headers)
    always = _REQUEST_DROP_UPGRADE if upgrade else _REQUEST_DROP
    out: CIMultiDict[str] = CIMultiDict()
    impersonating = False
    for name, value in headers.items():
        low = name.lower()
        if low in always or low.startswith(_DROP_PREFIXES):
            continue
        if low.startswith(_IMPERSONATE):
            impersonating = True
            if not allow_impersonation:
                continue
        if (named and low in named and low != "upgrade") or (drop and low in drop):
            continue
        if upgrade and low == "connection":
            continue
        out.add(name, value)
    if upgrade:
        out["Connection"] = "Upgrade"
    return out, impersonating


def for_upstream(
    headers: Mapping[str, str],
    ctx: RequestContext,
    *,
    authorization: str | None,
    upgrade: bool = False,
) -> CIMultiDict[str]:
    """:func:`request_headers` as the call's context asks, plus opgate's ``Authorization``,
    when the client sent none an ``Audit-ID`` (the trace id), and the caller's address
    (``ctx.remote``; none on a Unix socket) appended to ``X-Forwarded-For``, in one header, as
    kubectl proxy and Go's ReverseProxy do: the apiserver's ``sourceIPs`` end with it.

    Impersonation passes when the policy set or a middleware allows it; either way the header
    names (never their values) are logged, as impersonation is rare and worth an audit line.
    """
    allowed = ctx.allow_impersonation or bool(getattr(ctx.policies, "allow_impersonation", False))
    out, impersonating = request_headers(
        headers, drop=ctx.drop_request_headers, allow_impersonation=allowed, upgrade=upgrade
    )
    if impersonating:
        names = sorted({n for n in headers if n.lower().startswith(_IMPERSONATE)})
        log.info(
            "%s client headers %s (trace %s)",
            "forwarding impersonation" if allowed else "stripped impersonation",
            ",".join(names),
            ctx.trace_id,
        )
        if not allowed:
            ctx.warn(IMPERSONATION_DROPPED)
    if authorization is not None:
        out["Authorization"] = authorization
    if "Audit-ID" not in headers:  # the apiserver's audit log names the call as opgate's does
        out["Audit-ID"] = ctx.trace_id
    if ctx.remote:
        out["X-Forwarded-For"] = ", ".join((*out.popall("X-Forwarded-For", ()), ctx.remote))
    return out


def response_headers(
    headers: Mapping[str, str],
    *,
    extra: Iterable[tuple[str, str]] = (),
    upgrade: bool = False,
) -> CIMultiDict[str]:
    """The upstream's end-to-end headers plus ``extra`` (the middlewares' response headers).

    ``Content-Length`` is kept, so a body the upstream framed by length reaches the client with
    the same length; without it the client's response is chunked.
    """
    named = connection_tokens(headers)
    always = _RESPONSE_DROP_UPGRADE if upgrade else _RESPONSE_DROP
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        low = name.lower()
        if low in always or low.startswith("proxy-"):
            continue
        if named and low in named and low != "upgrade":
            continue
        if upgrade and low == "connection":
            continue
        out.add(name, value)
    if upgrade:
        out["Connection"] = "Upgrade"
    for name, value in extra:
        out.add(name, value)
    return out
