"""A verified token's claims → the caller it names (:class:`proxy.engine.context.Identity`).

What ``spec.identity.issuers`` means once a token's signature is verified
(:mod:`proxy.middlewares.identity_verify`): a service-account token becomes
``system:serviceaccount:<ns>:<name>`` with the apiserver's groups and ``user.extra``; an OIDC
token's user is ``claims.username`` (default ``sub``, prefixed ``<issuer>#`` unless it is
``email``, as the apiserver does; ``usernamePrefix: "-"`` for none). A token whose claims do not
name a caller as the apiserver's authenticators would names nobody.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.engine.context import Extra, Identity
from proxy.middlewares.identity_spec import KUBERNETES, SA_PREFIX, Issuer

__all__ = ["identity_from_claims"]

# the keys of user.extra the apiserver's authenticators fill (k8s.io/apiserver
# pkg/authentication/user and serviceaccount/util.go)
CREDENTIAL_ID = "authentication.kubernetes.io/credential-id"
POD_NAME = "authentication.kubernetes.io/pod-name"
POD_UID = "authentication.kubernetes.io/pod-uid"
NODE_NAME = "authentication.kubernetes.io/node-name"
NODE_UID = "authentication.kubernetes.io/node-uid"
AUTHENTICATED = "system:authenticated"


def _service_account(claims: Mapping[str, Any]) -> Identity | None:
    sub = claims.get("sub")
    if not isinstance(sub, str) or not sub.startswith(SA_PREFIX):
        return None
    namespace, _, name = sub[len(SA_PREFIX):].partition(":")
    if not namespace or not name or ":" in name:
        return None
    uid = ""
    k8s = claims.get("kubernetes.io")
    pairs: list[tuple[str, str]] = []
    if isinstance(k8s, dict):
        sa = k8s.get("serviceaccount")
        if k8s.get("namespace") != namespace or not isinstance(sa, dict) or sa.get("name") != name:
            return None
        uid = str(sa.get("uid") or "")
        pairs = _bound_to(k8s)
    groups = ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", AUTHENTICATED)
    return Identity(user=sub, groups=groups, uid=uid, source="serviceaccount",
                    extra=_extra(claims, pairs))


def _ref(k8s: Mapping[str, Any], kind: str) -> tuple[str, str] | None:
    """The name and uid of the object a token is bound to (``kubernetes.io.pod`` …)."""
    ref = k8s.get(kind)
    if not isinstance(ref, dict):
        return None
    name, uid = ref.get("name"), ref.get("uid")
    return (name if isinstance(name, str) else "", uid if isinstance(uid, str) else "")


def _bound_to(k8s: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``user.extra`` of a service-account token's binding, as the apiserver's validator
    (pkg/serviceaccount/claims.go) and ``ServiceAccountInfo.UserInfo`` fill it: the pod's name
    and uid when both are set, the node's name (and uid, when set) of a pod- or node-bound
    token; nothing for a secret-bound one."""
    pairs: list[tuple[str, str]] = []
    pod = _ref(k8s, "pod")
    if pod is not None and pod[0] and pod[1]:
        pairs += [(POD_NAME, pod[0]), (POD_UID, pod[1])]
    node = _ref(k8s, "node")
    if node is not None and node[0]:
        pairs.append((NODE_NAME, node[0]))
        if node[1]:
            pairs.append((NODE_UID, node[1]))
    return pairs


def _extra(claims: Mapping[str, Any], pairs: list[tuple[str, str]]) -> Extra:
    """``user.extra`` by key: ``pairs`` and the credential id ``JTI=<jti>`` of a token with a
    ``jti`` (the apiserver's service-account and OIDC authenticators both add it)."""
    jti = claims.get("jti")
    if isinstance(jti, str) and jti:
        pairs = [*pairs, (CREDENTIAL_ID, f"JTI={jti}")]
    return tuple(sorted((key, (value,)) for key, value in pairs))


def identity_from_claims(issuer: Issuer, issuer_url: str,
                         claims: Mapping[str, Any]) -> Identity | None:
    """The caller a verified token names, or ``None`` when the claims do not name one."""
    if issuer.kind == KUBERNETES:
        return _service_account(claims)
    value = claims.get(issuer.username_claim)
    if not isinstance(value, str) or not value:
        return None
    # as the apiserver: an email_verified claim, when present, must be the JSON true
    if issuer.username_claim == "email" and claims.get("email_verified", True) is not True:
        return None
    prefix = issuer.username_prefix
    if prefix is None:
        prefix = "" if issuer.username_claim == "email" else f"{issuer_url}#"
    elif prefix == "-":
        prefix = ""
    groups: list[str] = []
    if issuer.groups_claim:
        raw = claims.get(issuer.groups_claim)
        if isinstance(raw, str):
            items = [raw]
        elif raw is None or (isinstance(raw, list) and all(isinstance(g, str) for g in raw)):
            items = raw or []
        else:  # as the apiserver, which refuses the token: not a string nor a list of them
            return None
        groups = [issuer.groups_prefix + g for g in items if g]
    groups.append(AUTHENTICATED)
    return Identity(user=prefix + value, groups=tuple(groups), uid="", source="oidc",
                    extra=_extra(claims, []))
