"""SubjectAccessReview for ``subjectAccessReview: true``: may the apiserver's user make the call?

Asked once per call whichever policies ask (the caller's ``done`` list), for the user the
apiserver authorizes (the impersonated one where the policy set lets ``Impersonate-*``
through), with the call's attributes as the apiserver's authorizers see them (a list's, a
watch's or a deletecollection's field and label selectors too: the Node authorizer lets a node
list only its own pods, by ``spec.nodeName``), and cached ``SAR_TTL`` seconds by everything the
review says, so an allow for one user, uid, version, object or selector is never another's.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from proxy.engine.context import Identity, RequestContext, user_extra
from proxy.engine.impersonation import impersonation_of
from proxy.engine.requestinfo import RequestInfo
from proxy.engine.selectors import raw_selectors
from proxy.middlewares.identity_verify import Authenticator

__all__ = ["SAR_TTL", "AccessReviews", "action"]

SAR_TTL = 10.0
SELECTOR_VERBS = frozenset({"list", "watch", "deletecollection"})


def _authorized_user(ctx: RequestContext, caller: Identity) -> Identity:
    """The user the apiserver authorizes the call as: the one it impersonates, where the policy
    set lets ``Impersonate-*`` through (the apiserver checks that the caller may impersonate,
    then authorizes the impersonated user), else the caller."""
    user = impersonation_of(ctx)
    if user is None:
        return caller
    extra = user_extra((key, values) for key, values in user.get("extra", {}).items())
    return Identity(user["username"], tuple(user["groups"]), user.get("uid", ""),
                    source="impersonated", extra=extra)


def _selectors(info: RequestInfo, query: str) -> tuple[str, str]:
    """The field and label selectors the apiserver's authorizers see (``""`` for none): those
    of a list, watch or deletecollection, except by the deprecated ``/watch/`` path, for which
    the apiserver gives none."""
    if not info.is_resource_request or info.verb not in SELECTOR_VERBS or not query:
        return "", ""
    segments = info.path.strip("/").split("/")
    version_at = 1 if info.api_prefix == "api" else 2
    if len(segments) > version_at + 1 and segments[version_at + 1] == "watch":
        return "", ""
    return raw_selectors(query)


def action(info: RequestInfo, verb: str) -> str:
    """The call in the apiserver's words (``create resource "configmaps" in API group ""…``)."""
    if not info.is_resource_request:
        return f'{verb} path "{info.path}"'
    resource = f"{info.resource}/{info.subresource}" if info.subresource else info.resource
    where = f' in the namespace "{info.namespace}"' if info.namespace else " at the cluster scope"
    return f'{verb} resource "{resource}" in API group "{info.api_group}"{where}'


class AccessReviews:
    """The SubjectAccessReviews of one middleware, and their cache (``cache_size`` entries)."""

    def __init__(self, authenticator: Authenticator, cache_size: int) -> None:
        self.auth = authenticator
        self.cache_size = cache_size
        self._sar: OrderedDict[tuple[Any, ...], tuple[bool, str, float]] = OrderedDict()

    async def denial(self, ctx: RequestContext, policy: Any, identity: Identity | None,
                     done: list[tuple[bool, str]]) -> tuple[int, str, str] | None:
        """``policy``'s 403 (code, reason, message) when the apiserver says no, else ``None``;
        ``done`` holds the call's one review once asked (every policy shares it)."""
        assert identity is not None
        subject = _authorized_user(ctx, identity)
        if not done:
            done.append(await self._access_review(ctx, subject))
        allowed, reason = done[0]
        if allowed:
            return None
        who = f'user "{subject.user}"'
        if subject is not identity:
            who += f' (impersonated by "{identity.user}")'
        return 403, "sar_denied", (
            f'{who} cannot {action(ctx.info, ctx.info.policy_verb)}: the '
            f'apiserver denies it ({reason or "no RBAC rule allows it"}; subjectAccessReview '
            f'of policy "{policy.name}" ({policy.source}))')

    async def _access_review(self, ctx: RequestContext, identity: Identity) -> tuple[bool, str]:
        """May ``identity`` (the user the apiserver authorizes) make the call? Cached."""
        info, verb = ctx.info, ctx.info.policy_verb
        fields, labels = _selectors(info, ctx.query)
        # everything the review below says (an allow for one is never another's)
        key = (identity.user, identity.uid, identity.groups, identity.extra, verb,
               info.api_group, info.api_version, info.resource, info.subresource,
               info.namespace, info.name, "" if info.is_resource_request else info.path,
               fields, labels)
        now = time.monotonic()
        hit = self._sar.get(key)
        if hit is not None and hit[2] > now:
            return hit[0], hit[1]
        attrs: dict[str, Any] = {"user": identity.user, "groups": list(identity.groups)}
        if identity.uid:
            attrs["uid"] = identity.uid
        if identity.extra:  # as the apiserver's authorizers see the user (webhooks read it)
            attrs["extra"] = {key: list(values) for key, values in identity.extra}
        if info.is_resource_request:
            attrs["resourceAttributes"] = {
                "namespace": info.namespace, "verb": verb, "group": info.api_group,
                "version": info.api_version, "resource": info.resource,
                "subresource": info.subresource, "name": info.name}
            for field, raw in (("fieldSelector", fields), ("labelSelector", labels)):
                if raw:  # (an empty one is refused: the apiserver's authorizers see none)
                    attrs["resourceAttributes"][field] = {"rawSelector": raw}
        else:
            attrs["nonResourceAttributes"] = {"path": info.path, "verb": verb}
        allowed, reason = await self.auth.access_review(attrs)
        self._sar[key] = (allowed, reason, now + SAR_TTL)
        self._sar.move_to_end(key)
        while len(self._sar) > self.cache_size:
            self._sar.popitem(last=False)
        return allowed, reason

