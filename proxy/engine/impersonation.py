"""The user a call impersonates, as the apiserver switches to it (``Impersonate-*`` headers).

Where a policy lets those headers through (``allowImpersonation: true``), the apiserver first
checks that the caller may impersonate, then authorizes the call as the impersonated user: so
the audit log records that user as ``impersonatedUser`` and a SubjectAccessReview asks about it
(asking about the caller would refuse a call the apiserver allows). Neither middleware imports
the other: both read it from here.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any
from urllib.parse import unquote

from proxy.engine.context import RequestContext

__all__ = ["header_pairs", "impersonated_user", "impersonation_of"]

# system:serviceaccount:<namespace (a DNS label)>:<name (a DNS subdomain)>, as the apiserver
# splits an impersonated user name
_SERVICE_ACCOUNT = re.compile(
    r"system:serviceaccount:([a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?)"
    r":((?=.{1,253}$)[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*)")


def header_pairs(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    """Every header, repeated names included, as (lower-case name, value)."""
    pairs = getattr(headers, "pairs", None)
    if pairs is not None:  # the fast relay's WireHeaders: bytes as received
        return [(n.decode("latin-1").lower(), v.decode("latin-1")) for n, v in pairs()]
    items = headers.items()  # a CIMultiDict's items() has the repeated names too
    return [(n.lower(), v) for n, v in items]


def impersonated_user(headers: Mapping[str, str], username: str,
                      dropped: Collection[str] = ()) -> dict[str, Any]:
    """``impersonatedUser`` as the apiserver logs the user it switches to: ``Impersonate-Uid``,
    the ``Impersonate-Group`` values (a ServiceAccount's two groups when none is given), then
    ``system:authenticated`` (``system:unauthenticated`` for ``system:anonymous``) unless
    listed, and ``Impersonate-Extra-<key>`` values by key (lower-case, percent-decoded); never
    a header of ``dropped`` (lower-case names the relay does not forward)."""
    groups: list[str] = []
    extra: dict[str, list[str]] = {}
    uid: str | None = None  # the first Impersonate-Uid, as the apiserver's Header.Get reads it
    for name, value in header_pairs(headers):
        if dropped and name in dropped:
            continue
        if name == "impersonate-group":
            groups.append(value)
        elif name.startswith("impersonate-extra-"):
            extra.setdefault(unquote(name[len("impersonate-extra-"):]), []).append(value)
        elif name == "impersonate-uid" and uid is None:
            uid = value
    if not groups and (sa := _SERVICE_ACCOUNT.fullmatch(username)) is not None:
        groups = ["system:serviceaccounts", f"system:serviceaccounts:{sa.group(1)}"]
    if username != "system:anonymous":
        if "system:authenticated" not in groups and "system:unauthenticated" not in groups:
            groups.append("system:authenticated")
    elif "system:unauthenticated" not in groups:
        groups.append("system:unauthenticated")
    out: dict[str, Any] = {"username": username}  # authentication/v1 UserInfo's field order
    if uid:
        out["uid"] = uid
    out["groups"] = groups
    if extra:
        out["extra"] = dict(sorted(extra.items()))  # a Go map: keys sorted
    return out


def impersonation_of(ctx: RequestContext) -> dict[str, Any] | None:
    """The user the apiserver will run ``ctx`` as, when it impersonates one (an
    ``Impersonate-User`` header that the policy set lets through, and that the relay forwards:
    not named in ``Connection``, not dropped by a middleware); ``None`` otherwise."""
    username = ctx.headers.get("impersonate-user")
    if not username or not (ctx.allow_impersonation
                            or getattr(ctx.policies, "allow_impersonation", False)):
        return None
    dropped = _not_forwarded(ctx)
    if "impersonate-user" in dropped:
        return None
    return impersonated_user(ctx.headers, username, dropped)


def _not_forwarded(ctx: RequestContext) -> frozenset[str]:
    """The lower-case header names the relay drops of this call beyond the fixed sets: those
    its ``Connection`` headers list (hop-by-hop) and those a middleware removed."""
    named = ctx.headers.get("connection")
    if named is None and not ctx.drop_request_headers:
        return frozenset()
    tokens = {t.strip().lower() for n, v in header_pairs(ctx.headers) if n == "connection"
              for t in v.split(",")}
    return frozenset(tokens | ctx.drop_request_headers)
