"""The identity middleware (``spec.identity``): who is calling, and may they make this call?

First in the chain. It takes the caller's bearer token (:mod:`~proxy.middlewares.identity_tokens`:
``Authorization``'s, or a WebSocket upgrade's subprotocol token, as the apiserver reads them),
verifies it once (:mod:`~proxy.middlewares.identity_verify`), and caches the verdict (keyed by a
BLAKE2b-256 digest of the token, never the token itself, until the token expires or 5 minutes,
whichever is first), so a known token costs a hash, a dict lookup and the rule matching. The
cache is bounded (``CACHE_SIZE`` tokens) and evicts by *second chance* (CLOCK), an approximation
of least-recently-used that costs a hit one flag store instead of moving the entry to the end:
the oldest entry goes, unless a call used it since it was inserted or last passed over, in
which case it is moved to the end, unflagged, and the next oldest is considered. Refusals are
cached too (``NEGATIVE_TTL``, by digest): a bad token repeated costs one TokenReview.

A verification that waits too long for one of the ``REVIEWS_IN_FLIGHT`` TokenReviews gets
``429`` with ``Retry-After: 1`` (goes on under ``failure: open``). ``429`` because that is how
the apiserver sheds load itself (max-in-flight and API Priority and Fairness answer ``429``,
``Retry-After: 1``; so do opgate's rate limits), and client-go waits and retries it. Not the
``503`` without ``Retry-After`` opgate answers when the apiserver cannot be asked (client-go
does not retry it), nor the ``401`` the apiserver answers when its own token webhook is
overloaded (a failed webhook call is a failed authentication): a client would take its token
for bad.

Then each policy with an identity section must pass, in order: the token is accepted (401
otherwise), the caller is in ``allow`` and the first rule that matches allows the call (403
naming the rule, or saying no rule matches, and the policy file), and, with
``subjectAccessReview: true``, the apiserver agrees (:mod:`~proxy.middlewares.identity_sar`). A
``dryrun`` policy never denies: it warns (``Warning`` header), logs and counts. A verified caller
becomes ``ctx.identity`` (the rate limiter's ``{user}``). The network calls live in
:mod:`proxy.relay.authn`; this module never touches a socket.

The outcome of those checks depends only on the verified token and the call's
:attr:`~proxy.engine.requestinfo.RequestInfo.shape`, so a cached token remembers the shapes
every policy allowed without a word (no denial, no dryrun warning; never with
``subjectAccessReview``, which is asked per object): the next such call costs a hash of the
token and three lookups. That path (:meth:`IdentityCheck.entry`) hashes the header's bytes as the
fast relay received them (no decoding of a ~1 KB value, no copies of it), nothing else; a call
with a ``Sec-WebSocket-Protocol`` header does not take it (a second token may be there).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.engine import telemetry
from proxy.engine.chain import Maybe
from proxy.engine.context import Decision, Deny, Identity, RequestContext
from proxy.engine.limitlog import log_limited
from proxy.engine.status import (
    call_details,
    forbidden,
    service_unavailable,
    too_many_requests,
    unauthorized,
)
from proxy.middlewares.identity_sar import AccessReviews, action
from proxy.middlewares.identity_spec import KUBERNETES, SECTION, IdentitySpec, Issuer, parse_section
from proxy.middlewares.identity_tokens import bearer_bytes, credentials, token_key
from proxy.middlewares.identity_verify import Authenticator, Busy, Invalid, TokenVerifier, Verified

__all__ = ["CACHE_SIZE", "SECTION", "Authenticator", "IdentityCheck", "parse_section"]

log = logging.getLogger("opgate.identity")

# a path no rule matches: what RBAC's reading of resources (proxy.engine.match) leaves for it
_PATH_HINT = ("; a rule naming resources, apiGroups or namespaces is about resource requests "
              'only (and discovery: /api, /apis, /openapi, /version, when each is left out or "*"'
              "): allow another path with nonResourceURLs, or with a rule naming none of them")
CACHE_SIZE = 4096
ALLOWED_SHAPES = 256  # per cached token: the call shapes every policy allowed


@dataclass(frozen=True, slots=True)
class _Plan:
    section: tuple[tuple[Any, IdentitySpec], ...]
    oidc: Mapping[str, Issuer]
    kubernetes: Issuer | None
    memo: bool = True  # whether allowed shapes may be remembered (no subjectAccessReview)
    # a rule is about paths (nonResourceURLs), which a shape does not hold: a non-resource
    # call's verdict is then not remembered
    paths: bool = False


def _same_caller(one: Identity | None, other: Identity | None) -> bool:
    return (one is not None and other is not None and one.user == other.user
            and set(one.groups) == set(other.groups))


class IdentityCheck:
    """The middleware; ``authenticator`` does the network calls (see the module docstring)."""

    name = "identity"
    needs_body = False
    fail_open = False
    sections = (SECTION,)  # entry does nothing under a policy set without one

    def __init__(self, *, authenticator: Authenticator, cache_size: int = CACHE_SIZE) -> None:
        self.auth = authenticator
        self.cache_size = cache_size
        self._tokens: OrderedDict[bytes, Verified] = OrderedDict()
        self._inflight: dict[bytes, asyncio.Future[Verified]] = {}
        self._verifier = TokenVerifier(authenticator)
        self._reviews = AccessReviews(authenticator, cache_size)
        self._plan_for: object = None
        self._plan = _Plan((), {}, None)

    def _plan_of(self, policies: Any) -> _Plan:
        if policies is not self._plan_for:
            section = tuple(policies.section(SECTION))
            oidc: dict[str, Issuer] = {}
            kubernetes = None
            for _policy, spec in section:
                for issuer in spec.issuers:  # the first declaration of an issuer maps claims
                    if issuer.kind == KUBERNETES:
                        kubernetes = kubernetes or issuer
                    else:
                        oidc.setdefault(issuer.url, issuer)
            memo = not any(spec.subject_access_review for _policy, spec in section)
            paths = any(rule.non_resource_urls for _policy, spec in section
                        for rule in spec.rules)
            self._plan = _Plan(section, oidc, kubernetes, memo, paths)
            self._plan_for = policies
            self._tokens.clear()  # claim mappings may have changed
            self._inflight.clear()  # (verifications under way keep to the set they began in)
        return self._plan

    def entry(self, ctx: RequestContext) -> Maybe[Decision | None]:
        # the plan of the set in force, without a call while it stays in force
        plan = self._plan if ctx.policies is self._plan_for else self._plan_of(ctx.policies)
        if not plan.section:
            return None
        raw = bearer_bytes(ctx.headers)
        key = None
        if raw is not None:
            key = token_key(raw)  # the one hash of the call (_verify reuses it)
            hit = self._tokens.get(key)
            # a live token (negative entries allow nothing) that every policy already let make
            # a call of this shape: nothing else to work out
            if (hit is not None and ctx.info.shape in hit.allowed
                    and hit.expires > time.monotonic()
                    and "Sec-WebSocket-Protocol" not in ctx.headers):  # (see credentials)
                hit.used = True  # instead of move_to_end (see the module docstring)
                ctx.identity = hit.identity
                return None
        return self._decide(ctx, plan, key)  # verifies the token: awaited by the chain

    async def _decide(self, ctx: RequestContext, plan: _Plan,
                      key: bytes | None) -> Decision | None:
        """Every check, for a call that the remembered shapes of its token do not cover."""
        verified: Verified | None = None
        problems: list[str] = []
        for token, cache_key in credentials(ctx.headers, key, problems):
            try:
                found = await self._verify(token, cache_key, plan)
            except Invalid as exc:
                problems.append(f"invalid bearer token: {str(exc).replace(token, '<token>')}")
                continue
            except asyncio.CancelledError:
                raise
            except Busy:
                return self._unavailable(ctx, plan, "too many TokenReviews in flight", token,
                                         busy=True)
            except Exception as exc:  # the authenticator cannot tell now
                return self._unavailable(ctx, plan, f"{type(exc).__name__}: {exc}", token)
            if verified is None:
                verified = found
            elif not _same_caller(verified.identity, found.identity):  # see credentials
                verified = None
                problems[:] = ["the Authorization header and the WebSocket subprotocol carry "
                               "tokens of different users"]
                break
        problem = "; ".join(problems) or "no bearer token in the Authorization header"
        if verified is not None:
            ctx.identity = verified.identity
        sar: list[tuple[bool, str]] = []  # one SubjectAccessReview per call, if any policy asks
        silent = True  # no policy denied nor warned
        for policy, spec in plan.section:
            denial = self._check(ctx, spec, policy, verified, problem, not problems)
            if denial is None and spec.subject_access_review and verified is not None:
                try:
                    denial = await self._reviews.denial(ctx, policy, verified.identity, sar)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.warning("SubjectAccessReview failed (trace %s): %s", ctx.trace_id, exc)
                    if policy.dryrun or policy.failure == "open":
                        continue
                    return Deny(service_unavailable(
                        f'opgate: cannot ask the apiserver now (subjectAccessReview of policy '
                        f'"{policy.name}", {policy.source}); try again', retry_after=1),
                        "unavailable")
            if denial is None:
                continue
            silent = False
            code, reason, message = denial
            telemetry.IDENTITY_DENIALS.labels(reason).inc()
            if policy.dryrun:
                telemetry.DRYRUN_DENIALS.labels(self.name).inc()
                log.info("dryrun policy %s would deny (%s): %s", policy.name, reason, message)
                ctx.warn(f"would deny (dryrun): {message}")
                continue
            log.debug("identity denies (%s, trace %s): %s", reason, ctx.trace_id, message)
            if code == 401:
                # not authenticated: no caller to the exit hooks (the apiserver audits its own
                # 401 with no user), even where the token was verified (an audience, an issuer
                # this policy refuses)
                ctx.identity = None
                return Deny(unauthorized(f"opgate: Unauthorized: {message}"), "unauthorized")
            return Deny(forbidden(f"opgate: {message}", details=call_details(ctx.info)),
                        "denied")
        if (silent and plan.memo and verified is not None and plan is self._plan
                and (ctx.info.is_resource_request or not plan.paths)
                and len(verified.allowed) < ALLOWED_SHAPES):
            verified.allowed.add(ctx.info.shape)
        return None

    def _check(self, ctx: RequestContext, spec: IdentitySpec, policy: Any,
               verified: Verified | None, problem: str,
               missing: bool) -> tuple[int, str, str] | None:
        where = f'policy "{policy.name}" ({policy.source})'
        if verified is None:
            return 401, "missing_token" if missing else "invalid_token", f"{problem} ({where})"
        identity = verified.identity
        assert identity is not None
        if not spec.accepts(verified.issuer):
            return 401, "invalid_token", f"the token's issuer is not one of {where}'s issuers"
        issuer = spec.issuer(verified.issuer)
        if (issuer is not None and not issuer.audience_ok(
                verified.audiences, verified.issuer_url, vouched=verified.vouched)):
            return 401, "invalid_token", f"the token's audience is not accepted by {where}"
        if not spec.allow.allows(identity):
            return 403, "not_allowed", (f'user "{identity.user}" is not allowed by {where}: not '
                                        f"in spec.identity.allow ({spec.allow.where})")
        info, verb = ctx.info, ctx.info.policy_verb
        for rule in spec.rules:
            if rule.matches(info, verb, identity.user):
                if rule.allow:
                    return None
                return 403, "rule_denied", (f'user "{identity.user}" cannot {action(info, verb)}:'
                                            f' rule "{rule.name}" ({rule.source}) of {where} '
                                            "denies it")
        return 403, "no_rule", (f'user "{identity.user}" cannot {action(info, verb)}: no rule '
                                f"of {where} matches (spec.identity.rules at {spec.rules_where})"
                                + ("" if info.is_resource_request else _PATH_HINT))

    def _unavailable(self, ctx: RequestContext, plan: _Plan, why: str, token: str, *,
                     busy: bool = False) -> Deny | None:
        why = why.replace(token, "<token>")
        log_limited(log, "identity-busy" if busy else "identity-unavailable",
                    "cannot verify a token now (%s %s, trace %s): %s", ctx.method, ctx.path,
                    ctx.trace_id, why)
        for policy, _spec in plan.section:
            if policy.dryrun:
                ctx.warn(f"policy {policy.name} could not verify the caller (dryrun)")
            elif policy.failure != "open":
                what = ("too many tokens to verify at once" if busy
                        else "cannot verify the caller now")
                message = f'opgate: {what} (policy "{policy.name}", {policy.source}); try again'
                if busy:  # see the module docstring
                    return Deny(too_many_requests(message, retry_after=1), "throttled")
                return Deny(service_unavailable(message, retry_after=1), "unavailable")
        return None

    # --- verification (cached) --------------------------------------------------------------

    async def _verify(self, token: str, key: bytes, plan: _Plan) -> Verified:
        """The cached verdict on ``token`` (``key``: :func:`token_key` of its bytes), else a new
        one; raises :class:`Invalid` for a token the apiserver or a signature does not accept."""
        hit = self._tokens.get(key)
        if hit is not None:
            if hit.expires > time.monotonic():
                hit.used = True
                if hit.identity is None:
                    raise Invalid("the apiserver does not accept it")
                return hit
            del self._tokens[key]
        future = self._inflight.get(key)
        if future is None:  # one verification per token, however many calls wait for it
            future = asyncio.ensure_future(self._verifier.verify(
                token, oidc=plan.oidc, kubernetes=plan.kubernetes))
            self._inflight[key] = future
            future.add_done_callback(lambda done: self._settled(key, plan, done))
        result = await asyncio.shield(future)
        if result.identity is None:
            raise Invalid("the apiserver does not accept it")
        return result

    def _settled(self, key: bytes, plan: _Plan, done: asyncio.Future[Verified]) -> None:
        """A verification ended: its verdict is cached in the step that takes it out of
        ``_inflight`` (not when a waiting call resumes, a turn of the loop later, in which a new
        call of the same token would find neither and verify it again: a second TokenReview)."""
        if self._inflight.get(key) is not done:  # (a new set cleared it: see _plan_of)
            return
        del self._inflight[key]
        if (plan is self._plan and not done.cancelled()  # not a verdict of a replaced set
                and done.exception() is None):
            self._remember_token(key, done.result())

    def _remember_token(self, key: bytes, verified: Verified) -> None:
        """Cache a verdict; a full cache first evicts by second chance (module docstring), so
        the new entry is not a candidate, and it comes in unflagged: a token used once goes
        before any token in use (a flood of new tokens does not push out the busy ones)."""
        tokens = self._tokens
        if key not in tokens:
            while tokens and len(tokens) >= self.cache_size:
                old_key, old = tokens.popitem(last=False)
                if old.used:  # used since last passed over: keep it, at the end, once more
                    old.used = False
                    tokens[old_key] = old
            # ends: a kept entry loses its flag, so within one round an unflagged one goes
        tokens[key] = verified
        tokens.move_to_end(key)
