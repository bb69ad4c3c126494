"""The identity middleware (``spec.identity``): who is calling, and may they make this call?

First in the chain. It takes the bearer token of ``Authorization`` or, when that one does not
authenticate, of a WebSocket upgrade's ``base64url.bearer.authorization.k8s.io.`` subprotocol (the
apiserver's order and rules: :mod:`proxy.engine.subprotocol`) — never logged, never put in a
message — verifies it once, and caches the result (keyed by a BLAKE2b-256 digest of the token,
never the token itself, until the token expires or 5 minutes, whichever is first), so a known
token costs a hash, a dict lookup and the rule matching. BLAKE2b rather than SHA-256: CPython's
own BLAKE2b is compact code, while ``hashlib.sha256`` goes through OpenSSL's provider machinery
on every call, whose cold code cost ~35 µs of a call's latency on a core woken from idle (an
operator's pace: a call every 20 ms or more), BLAKE2b's ~15 µs (bench/README.md, "Latency at an
operator's pace"). The cache is bounded (``CACHE_SIZE`` tokens) and evicts by *second chance*
(CLOCK), an approximation of least-recently-used that costs a hit one flag store instead of
moving the entry to the end: the oldest entry goes, unless a call used it since it was inserted
or last passed over, in which case it is moved to the end, unflagged, and the next oldest is
considered.

A JWT of an accepted issuer is verified here (asymmetric signatures only, ``iss``, ``aud``, and
the time claims as the apiserver checks them: :func:`_check_times`) with the keys the
:class:`Authenticator` fetches; any other
token goes to the apiserver (a TokenReview) and the apiserver decides, and so does a
service-account token of a key opgate has not fetched (yet: it fetches at most every
``retry_seconds``), so a signing-key rotation refuses no valid token, or of an audience opgate
does not know (``--api-audiences`` may name others than the issuer); the verdict on such a
token is then the one opgate's own verification would give (:meth:`IdentityCheck._vouched`),
as on a service-account token of another issuer the apiserver accepts (a second
``--service-account-issuer``: :meth:`IdentityCheck._other_issuer`).
Its refusals are cached too (``NEGATIVE_TTL``, by digest): a bad token repeated costs one
TokenReview. At most
``REVIEWS_IN_FLIGHT`` TokenReviews are in flight at once (per process), so a flood of distinct
tokens is not a flood of TokenReviews: a verification waits up to ``REVIEW_WAIT`` for its turn,
then the call gets ``429`` with ``Retry-After: 1`` (goes on under ``failure: open``). ``429``
because that is how the apiserver sheds load itself (max-in-flight and API Priority and
Fairness answer ``429``, ``Retry-After: 1``; so do opgate's rate limits), and client-go waits and
retries it. Not the ``503`` without ``Retry-After`` opgate answers when the apiserver cannot be
asked (client-go does not retry it), nor the ``401`` the apiserver answers when its own token
webhook is overloaded (a failed webhook call is a failed authentication): a client would take its
token for bad.
PyJWT (and cryptography) are imported the first time a token that looks like a JWT is verified.

Then each policy with an identity section must pass, in order: the token is accepted (401
otherwise), the caller is in ``allow`` and the first rule that matches allows the call (403
naming the rule, or saying no rule matches, and the policy file), and, with
``subjectAccessReview: true``, the apiserver agrees (a SubjectAccessReview, cached ~10 s). A
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
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from proxy.engine import telemetry
from proxy.engine.chain import Maybe
from proxy.engine.context import Decision, Deny, Identity, RequestContext, user_extra
from proxy.engine.impersonation import impersonation_of
from proxy.engine.limitlog import log_limited
from proxy.engine.requestinfo import RequestInfo, Shape
from proxy.engine.status import (
    call_details,
    forbidden,
    service_unavailable,
    too_many_requests,
    unauthorized,
)
from proxy.engine.subprotocol import subprotocol_token
from proxy.middlewares.identity_spec import (
    KUBERNETES,
    SECTION,
    TOKENREVIEW,
    IdentitySpec,
    Issuer,
    identity_from_claims,
    parse_section,
)

__all__ = ["SECTION", "Authenticator", "IdentityCheck", "parse_section"]

log = logging.getLogger("opgate.identity")

ALGORITHMS = frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512",
                        "ES256", "ES384", "ES512", "EdDSA"})  # never none, never HS*
# seconds of clock skew the apiserver allows a service-account token (go-jose's jwt.DefaultLeeway,
# on exp, nbf and iat: pkg/serviceaccount) and an OIDC token's nbf (go-oidc v2, which gives exp
# none and does not check iat): a stricter opgate refused what the apiserver accepts
LEEWAY = 60.0
TOKEN_TTL = 300.0
NEGATIVE_TTL = 10.0
SAR_TTL = 10.0
CACHE_SIZE = 4096
ALLOWED_SHAPES = 256  # per cached token: the call shapes every policy allowed
REVIEWS_IN_FLIGHT = 8  # TokenReviews at once (per process)
REVIEW_WAIT = 1.0  # seconds a verification waits for one of them, then 429


class Authenticator(Protocol):
    """The network half (:class:`proxy.relay.authn.UpstreamAuthenticator`); any exception it
    raises means "cannot tell now" (503, or the call goes on under ``failure: open``)."""

    async def cluster_issuer(self) -> str | None: ...
    async def keys_for(self, issuer: str, kid: str | None) -> Sequence[Any]: ...  # PyJWK-like
    async def token_review(self, token: str) -> tuple[Identity, tuple[str, ...]] | None: ...
    async def access_review(self, attrs: Mapping[str, Any]) -> tuple[bool, str]: ...


@dataclass(slots=True, eq=False)
class _Verified:
    identity: Identity | None  # None: the apiserver said no (kept NEGATIVE_TTL)
    issuer: str  # issuer key: "kubernetes", an OIDC issuer URL, or "tokenreview"
    issuer_url: str
    audiences: tuple[str, ...]
    expires: float  # monotonic
    # a cluster-issuer token the apiserver vouched for (a TokenReview): any audience it took
    vouched: bool = False
    # call shapes that every policy of the current plan allowed (the plan clears the cache)
    allowed: set[Shape] = field(default_factory=set, repr=False)
    # second chance: a call used the entry since eviction last passed over it (with
    # ``allowed``, the only field that changes)
    used: bool = field(default=False, repr=False)


class _Invalid(Exception):
    """The token is not acceptable; the message says why and never holds the token."""


class _Busy(Exception):
    """``REVIEWS_IN_FLIGHT`` TokenReviews stayed in flight for ``REVIEW_WAIT``: ask again."""


@dataclass(frozen=True, slots=True)
class _Plan:
    section: tuple[tuple[Any, IdentitySpec], ...]
    oidc: Mapping[str, Issuer]
    kubernetes: Issuer | None
    memo: bool = True  # whether allowed shapes may be remembered (no subjectAccessReview)
    # a rule is about paths (nonResourceURLs), which a shape does not hold: a non-resource
    # call's verdict is then not remembered
    paths: bool = False


def _bearer(headers: Mapping[str, str]) -> str | None:
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


def _token_key(token: bytes) -> bytes:
    """The token cache's key: a 32-byte BLAKE2b digest of the token's bytes (module docstring)."""
    return hashlib.blake2b(token, digest_size=32).digest()


def _bearer_bytes(headers: Mapping[str, str]) -> bytes | None:
    """The bytes of the token :func:`_bearer` finds (the cache key is their :func:`_token_key`).

    With the fast relay's headers (``raw``: the value as received) this is :func:`_bearer` on
    bytes, so a ~1 KB token is neither decoded nor encoded per call; the same token, because
    ``_STRIP`` is what ``str.strip`` strips from latin-1 text and ``bytes.lower`` lowers the
    ASCII letters, the only ones that lower into ``bearer``. Any other mapping: ``_bearer``,
    encoded as before."""
    raw = getattr(headers, "raw", None)
    if raw is None:
        token = _bearer(headers)
        return None if token is None else token.encode()
    value: bytes = raw("Authorization") or b""
    scheme, space, rest = value.strip(_STRIP).partition(b" ")
    if not space or scheme.lower() != b"bearer":
        return None
    return rest.partition(b" ")[0] or None


def _credentials(headers: Mapping[str, str], key: bytes | None,
                 problems: list[str]) -> Iterator[tuple[str, bytes]]:
    """The caller's tokens, with their cache keys, in the apiserver's order: ``Authorization``'s,
    then a WebSocket upgrade's subprotocol token (a subprotocol the apiserver refuses adds its
    message to ``problems``). The apiserver's caller is the first that authenticates; opgate's
    too, but with both, a second that authenticates must be the same user: the apiserver may
    refuse a token opgate accepts (of a ServiceAccount deleted since, say) and then run the call
    as the other one."""
    bearer = _bearer(headers)
    if bearer is not None:  # (key: _bearer_bytes's, which agrees with _bearer)
        yield bearer, key if key is not None else _token_key(bearer.encode())
    if "Upgrade" in headers:  # (subprotocol_token: None unless a WebSocket upgrade)
        try:
            token = subprotocol_token(headers)
        except ValueError as exc:
            problems.append(f"invalid bearer token: {exc}")
            return
        if token is not None and token != bearer:
            yield token, _token_key(token.encode())


# PyJWT checks the signature, iss and that exp is there; _check_times the times
_DECODE = {"verify_aud": False, "verify_exp": False, "verify_nbf": False, "verify_iat": False,
           "require": ["exp", "iss"]}


def _check_times(claims: Mapping[str, Any], *, oidc: bool, now: float) -> None:
    """``exp``, ``nbf`` and ``iat`` as the apiserver checks them (raises :class:`_Invalid`).

    A service-account token as go-jose's ``Claims.Validate``: ``LEEWAY`` either way on all
    three (a kubelet's token read 45 s after its exp, or minted by an apiserver whose clock is
    45 s ahead of the node's, passes); an OIDC token as go-oidc's verifier: expired at its
    ``exp``, ``nbf`` with ``LEEWAY``, ``iat`` unchecked. Each, when present, must be a number."""
    times: dict[str, float] = {}
    for name in ("exp", "nbf", "iat"):
        value = claims.get(name)
        if value is None:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _Invalid(f"the token's {name} claim is not a number")
        times[name] = float(value)
    exp, nbf, iat = times.get("exp"), times.get("nbf"), times.get("iat")
    if exp is not None and now - (0.0 if oidc else LEEWAY) > exp:
        raise _Invalid("the token has expired")
    if nbf is not None and now + LEEWAY < nbf:
        raise _Invalid("the token is not valid yet (nbf)")
    if not oidc and iat is not None and now + LEEWAY < iat:
        raise _Invalid("the token is issued in the future (iat)")


def _audiences(claims: Mapping[str, Any]) -> tuple[str, ...]:
    """The ``aud`` claim: a string or a list of strings, as the apiserver reads it."""
    aud = claims.get("aud")
    if isinstance(aud, list) and all(isinstance(a, str) for a in aud):
        return tuple(aud)
    if isinstance(aud, str) or aud is None:
        return () if aud is None else (aud,)
    raise _Invalid("the token's aud claim is not a string or a list of strings")


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


def _same_caller(one: Identity | None, other: Identity | None) -> bool:
    return (one is not None and other is not None and one.user == other.user
            and set(one.groups) == set(other.groups))


def _action(info: RequestInfo, verb: str) -> str:
    """The call in the apiserver's words (``create resource "configmaps" in API group ""…``)."""
    if not info.is_resource_request:
        return f'{verb} path "{info.path}"'
    resource = f"{info.resource}/{info.subresource}" if info.subresource else info.resource
    where = f' in the namespace "{info.namespace}"' if info.namespace else " at the cluster scope"
    return f'{verb} resource "{resource}" in API group "{info.api_group}"{where}'


class IdentityCheck:
    """The middleware; ``authenticator`` does the network calls (see the module docstring)."""

    name = "identity"
    needs_body = False
    fail_open = False
    sections = (SECTION,)  # entry does nothing under a policy set without one

    def __init__(self, *, authenticator: Authenticator, cache_size: int = CACHE_SIZE) -> None:
        self.auth = authenticator
        self.cache_size = cache_size
        self._tokens: OrderedDict[bytes, _Verified] = OrderedDict()
        self._inflight: dict[bytes, asyncio.Future[_Verified]] = {}
        self._sar: OrderedDict[tuple[Any, ...], tuple[bool, str, float]] = OrderedDict()
        self._review_slots = asyncio.Semaphore(REVIEWS_IN_FLIGHT)
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
        raw = _bearer_bytes(ctx.headers)
        key = None
        if raw is not None:
            key = _token_key(raw)  # the one hash of the call (_verify reuses it)
            hit = self._tokens.get(key)
            # a live token (negative entries allow nothing) that every policy already let make
            # a call of this shape: nothing else to work out
            if (hit is not None and ctx.info.shape in hit.allowed
                    and hit.expires > time.monotonic()
                    and "Sec-WebSocket-Protocol" not in ctx.headers):  # (see _credentials)
                hit.used = True  # instead of move_to_end (see the module docstring)
                ctx.identity = hit.identity
                return None
        return self._decide(ctx, plan, key)  # verifies the token: awaited by the chain

    async def _decide(self, ctx: RequestContext, plan: _Plan,
                      key: bytes | None) -> Decision | None:
        """Every check, for a call that the remembered shapes of its token do not cover."""
        verified: _Verified | None = None
        problems: list[str] = []
        for token, token_key in _credentials(ctx.headers, key, problems):
            try:
                found = await self._verify(token, token_key, plan)
            except _Invalid as exc:
                problems.append(f"invalid bearer token: {str(exc).replace(token, '<token>')}")
                continue
            except asyncio.CancelledError:
                raise
            except _Busy:
                return self._unavailable(ctx, plan, "too many TokenReviews in flight", token,
                                         busy=True)
            except Exception as exc:  # the authenticator cannot tell now
                return self._unavailable(ctx, plan, f"{type(exc).__name__}: {exc}", token)
            if verified is None:
                verified = found
            elif not _same_caller(verified.identity, found.identity):  # see _credentials
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
                    denial = await self._sar_denial(ctx, policy, verified.identity, sar)
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
                return Deny(unauthorized(f"opgate: Unauthorized: {message}"), "unauthorized")
            return Deny(forbidden(f"opgate: {message}", details=call_details(ctx.info)),
                        "denied")
        if (silent and plan.memo and verified is not None and plan is self._plan
                and (ctx.info.is_resource_request or not plan.paths)
                and len(verified.allowed) < ALLOWED_SHAPES):
            verified.allowed.add(ctx.info.shape)
        return None

    def _check(self, ctx: RequestContext, spec: IdentitySpec, policy: Any,
               verified: _Verified | None, problem: str,
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
                return 403, "rule_denied", (f'user "{identity.user}" cannot {_action(info, verb)}:'
                                            f' rule "{rule.name}" ({rule.source}) of {where} '
                                            "denies it")
        return 403, "no_rule", (f'user "{identity.user}" cannot {_action(info, verb)}: no rule '
                                f"of {where} matches (spec.identity.rules at {spec.rules_where})")

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

    async def _verify(self, token: str, key: bytes, plan: _Plan) -> _Verified:
        """The cached verdict on ``token`` (``key``: :func:`_token_key` of its bytes), else a new
        one; raises :class:`_Invalid` for a token the apiserver or a signature does not accept."""
        hit = self._tokens.get(key)
        if hit is not None:
            if hit.expires > time.monotonic():
                hit.used = True
                if hit.identity is None:
                    raise _Invalid("the apiserver does not accept it")
                return hit
            del self._tokens[key]
        future = self._inflight.get(key)
        if future is None:  # one verification per token, however many calls wait for it
            future = asyncio.ensure_future(self._verify_uncached(token, plan))
            self._inflight[key] = future
            future.add_done_callback(
                lambda done: self._inflight.get(key) is done and self._inflight.pop(key))
        result = await asyncio.shield(future)
        if plan is self._plan:  # not a verdict of a set replaced meanwhile (see _plan_of)
            self._remember_token(key, result)
        if result.identity is None:
            raise _Invalid("the apiserver does not accept it")
        return result

    def _remember_token(self, key: bytes, verified: _Verified) -> None:
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

    def _remember(self, cache: OrderedDict[Any, Any], key: Any, value: Any) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > self.cache_size:
            cache.popitem(last=False)

    async def _verify_uncached(self, token: str, plan: _Plan) -> _Verified:
        if token.count(".") < 2:  # not a JWT (PyJWT would say "Not enough segments")
            return await self._review(token, {})
        import jwt

        try:
            header = jwt.get_unverified_header(token)
            claims = jwt.decode(token, options={"verify_signature": False})
        except (jwt.PyJWTError, ValueError, TypeError):
            header, claims = None, {}
        iss = claims.get("iss") if header is not None else None
        if isinstance(iss, str) and iss:
            issuer = plan.oidc.get(iss)
            if issuer is None and plan.kubernetes is not None:
                if await self.auth.cluster_issuer() == iss:
                    issuer = plan.kubernetes
            if issuer is not None:
                return await self._verify_jwt(token, header or {}, claims, issuer, iss)
            if plan.kubernetes is not None:
                return await self._other_issuer(token, claims, iss, plan.kubernetes)
        return await self._review(token, claims)

    async def _other_issuer(self, token: str, claims: Mapping[str, Any], iss: str,
                            kubernetes: Issuer) -> _Verified:
        """A JWT of an issuer opgate does not verify itself, which the apiserver judges (a
        TokenReview). When the apiserver takes it as the service account its claims name, it is
        a service-account token of the cluster, whichever issuer signed it: another of its
        ``--service-account-issuer`` flags (all are accepted; discovery names the first only),
        the legacy Secret tokens' ``kubernetes/serviceaccount``, or the discovered one while
        discovery fails. It is then the ``kubernetes`` issuer's, held to each policy's issuers
        and audiences as a token opgate verified (:meth:`_vouched`); a token without ``aud``
        (a legacy one) has those the apiserver gives it (its own ``--api-audiences``)."""
        claimed = identity_from_claims(kubernetes, iss, claims)
        if claimed is None:  # no service account: the apiserver's verdict as it stands
            return await self._review(token, claims)
        audiences = _audiences(claims)
        found = await self._review(token, claims)
        if found.identity is None or found.identity.user != claimed.user:
            return found
        return _Verified(found.identity, KUBERNETES, iss, audiences or found.audiences,
                         found.expires, vouched=True)

    async def _verify_jwt(self, token: str, header: Mapping[str, Any],
                          unverified: Mapping[str, Any], issuer: Issuer, iss: str) -> _Verified:
        import jwt

        alg = header.get("alg")
        if alg not in ALGORITHMS:
            raise _Invalid(f"signing algorithm {str(alg)[:20]!r} is not accepted")
        kid = header.get("kid") if isinstance(header.get("kid"), str) else None
        keys = await self.auth.keys_for(iss, kid)
        if not keys:
            if issuer.kind == KUBERNETES:  # a key opgate has not fetched yet (rotated within
                # retry_seconds of its last fetch): the apiserver knows its keys, ask it
                return await self._vouched(token, unverified, iss)
            raise _Invalid(f"no signing key of issuer {iss} matches the token's key id")
        claims: dict[str, Any] | None = None
        for key in keys:
            try:
                claims = jwt.decode(token, getattr(key, "key", key), algorithms=[alg],
                                    issuer=iss, options=_DECODE)
                break
            except (jwt.InvalidSignatureError, jwt.InvalidAlgorithmError, jwt.InvalidKeyError,
                    TypeError, ValueError):  # not this key (or not a key of this type)
                continue
            except jwt.PyJWTError as exc:
                raise _Invalid(f"{type(exc).__name__}: {exc}") from None
        if claims is None:
            raise _Invalid(f"the signature does not verify with the keys of issuer {iss}")
        _check_times(claims, oidc=issuer.kind != KUBERNETES, now=time.time())
        identity = identity_from_claims(issuer, iss, claims)
        if identity is None:
            raise _Invalid(f"the token's claims name no {issuer.kind} user")
        audiences = _audiences(claims)
        if issuer.kind == KUBERNETES and not issuer.known(audiences, iss):
            return await self._vouched(token, claims, iss)  # an audience only it knows
        leeway = 0.0 if issuer.kind != KUBERNETES else LEEWAY
        return _Verified(identity, issuer.key, iss, audiences, self._expiry(claims, leeway))

    async def _vouched(self, token: str, claims: Mapping[str, Any], iss: str) -> _Verified:
        """A token of the cluster's issuer that the apiserver judges (a TokenReview): when it
        accepts it, the verdict is the one opgate's own verification gives (the ``kubernetes``
        issuer, the token's audiences, which each policy's ``audiences`` then narrow), with the
        user the apiserver names."""
        found = await self._review(token, claims)
        if found.identity is None:
            return found
        return _Verified(found.identity, KUBERNETES, iss, _audiences(claims), found.expires,
                         vouched=True)

    async def _review(self, token: str, claims: Mapping[str, Any]) -> _Verified:
        """A TokenReview, once one of ``REVIEWS_IN_FLIGHT`` is free (module docstring)."""
        slots = self._review_slots
        try:
            async with asyncio.timeout(REVIEW_WAIT):
                await slots.acquire()
        except TimeoutError:
            telemetry.TOKEN_REVIEWS.labels("busy").inc()
            raise _Busy from None
        try:
            result = await self.auth.token_review(token)
        except Exception:
            telemetry.TOKEN_REVIEWS.labels("error").inc()
            raise
        finally:
            slots.release()
        telemetry.TOKEN_REVIEWS.labels("rejected" if result is None else "authenticated").inc()
        if result is None:
            return _Verified(None, TOKENREVIEW, "", (), time.monotonic() + NEGATIVE_TTL)
        identity, audiences = result
        return _Verified(identity, TOKENREVIEW, "", audiences, self._expiry(claims))

    @staticmethod
    def _expiry(claims: Mapping[str, Any], leeway: float = 0.0) -> float:
        """When the cached verdict ends: ``TOKEN_TTL`` from now, or when the token stops being
        accepted (its ``exp``, plus the ``leeway`` it was verified with), whichever is first."""
        ttl = TOKEN_TTL
        exp = claims.get("exp")
        if isinstance(exp, (int, float)) and not isinstance(exp, bool):
            ttl = min(ttl, exp + leeway - time.time())
        return time.monotonic() + max(ttl, 0.0)

    # --- SubjectAccessReview (cached) ---------------------------------------------------------

    async def _sar_denial(self, ctx: RequestContext, policy: Any, identity: Identity | None,
                          done: list[tuple[bool, str]]) -> tuple[int, str, str] | None:
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
            f'{who} cannot {_action(ctx.info, ctx.info.policy_verb)}: the '
            f'apiserver denies it ({reason or "no RBAC rule allows it"}; subjectAccessReview '
            f'of policy "{policy.name}" ({policy.source}))')

    async def _access_review(self, ctx: RequestContext, identity: Identity) -> tuple[bool, str]:
        """May ``identity`` (the user the apiserver authorizes) make the call? Cached."""
        info, verb = ctx.info, ctx.info.policy_verb
        # everything the review below says (an allow for one is never another's)
        key = (identity.user, identity.uid, identity.groups, identity.extra, verb,
               info.api_group, info.api_version, info.resource, info.subresource,
               info.namespace, info.name, "" if info.is_resource_request else info.path)
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
        else:
            attrs["nonResourceAttributes"] = {"path": info.path, "verb": verb}
        allowed, reason = await self.auth.access_review(attrs)
        self._remember(self._sar, key, (allowed, reason, now + SAR_TTL))
        return allowed, reason
