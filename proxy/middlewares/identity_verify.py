"""Token verification: a verdict on one token (who it names, of which issuer, which audiences).

A JWT of an accepted issuer is verified here (asymmetric signatures only, ``iss``, ``aud``, and
the time claims as the apiserver checks them: :func:`_check_times`) with the keys the
:class:`Authenticator` fetches; any other token goes to the apiserver (a TokenReview) and the
apiserver decides, and so does a service-account token of a key opgate has not fetched (yet: it
fetches at most every ``retry_seconds``; a signature none of the keys it has verifies makes it
fetch again too, as go-oidc does), so a signing-key rotation refuses no valid token, or
of an audience opgate does not know (``--api-audiences`` may name others than the issuer); the
verdict on such a token is then the one opgate's own verification would give
(:meth:`TokenVerifier._vouched`), as on a service-account token of another issuer the apiserver
accepts (a second ``--service-account-issuer``: :meth:`TokenVerifier._other_issuer`). At most
``REVIEWS_IN_FLIGHT`` TokenReviews are in flight at once (per process), so a flood of distinct
tokens is not a flood of TokenReviews: a verification waits up to ``REVIEW_WAIT`` for its turn,
then raises :class:`Busy` (the middleware answers ``429`` with ``Retry-After: 1``: see
:mod:`proxy.middlewares.identity`). PyJWT (and cryptography) are imported the first time a token
that looks like a JWT is verified. The verdicts are cached by the middleware, not here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from proxy.engine import telemetry
from proxy.engine.context import Identity
from proxy.engine.requestinfo import Shape
from proxy.middlewares.identity_claims import identity_from_claims
from proxy.middlewares.identity_spec import KUBERNETES, TOKENREVIEW, Issuer

__all__ = ["LEEWAY", "NEGATIVE_TTL", "REVIEWS_IN_FLIGHT", "REVIEW_WAIT", "TOKEN_TTL",
           "Authenticator", "Busy", "Invalid", "TokenVerifier", "Verified"]

ALGORITHMS = frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512",
                        "ES256", "ES384", "ES512", "EdDSA"})  # never none, never HS*
# seconds of clock skew the apiserver allows a service-account token (go-jose's jwt.DefaultLeeway,
# on exp, nbf and iat: pkg/serviceaccount) and an OIDC token's nbf (go-oidc v2, which gives exp
# none and does not check iat): a stricter opgate refused what the apiserver accepts
LEEWAY = 60.0
TOKEN_TTL = 300.0
NEGATIVE_TTL = 10.0
REVIEWS_IN_FLIGHT = 8  # TokenReviews at once (per process)
REVIEW_WAIT = 1.0  # seconds a verification waits for one of them, then 429


class Authenticator(Protocol):
    """The network half (:class:`proxy.relay.authn.UpstreamAuthenticator`); any exception it
    raises means "cannot tell now" (503, or the call goes on under ``failure: open``)."""

    async def cluster_issuer(self) -> str | None: ...
    # PyJWK-like; refresh: those given before did not verify the token (fetch again if allowed)
    async def keys_for(self, issuer: str, kid: str | None, *,
                       refresh: bool = False) -> Sequence[Any]: ...
    async def token_review(self, token: str) -> tuple[Identity, tuple[str, ...]] | None: ...
    async def access_review(self, attrs: Mapping[str, Any]) -> tuple[bool, str]: ...


@dataclass(slots=True, eq=False)
class Verified:
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


class Invalid(Exception):
    """The token is not acceptable; the message says why and never holds the token."""


class Busy(Exception):
    """``REVIEWS_IN_FLIGHT`` TokenReviews stayed in flight for ``REVIEW_WAIT``: ask again."""


# the cluster's issuer as a policy set that lists none judges its tokens (TokenVerifier.verify)
_CLUSTER = Issuer(kind=KUBERNETES)

# PyJWT checks the signature, iss and that exp is there; _check_times the times
_DECODE = {"verify_aud": False, "verify_exp": False, "verify_nbf": False, "verify_iat": False,
           "require": ["exp", "iss"]}


def _check_times(claims: Mapping[str, Any], *, oidc: bool, now: float) -> None:
    """``exp``, ``nbf`` and ``iat`` as the apiserver checks them (raises :class:`Invalid`).

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
            raise Invalid(f"the token's {name} claim is not a number")
        times[name] = float(value)
    exp, nbf, iat = times.get("exp"), times.get("nbf"), times.get("iat")
    if exp is not None and now - (0.0 if oidc else LEEWAY) > exp:
        raise Invalid("the token has expired")
    if nbf is not None and now + LEEWAY < nbf:
        raise Invalid("the token is not valid yet (nbf)")
    if not oidc and iat is not None and now + LEEWAY < iat:
        raise Invalid("the token is issued in the future (iat)")


def _signed_claims(token: str, keys: Sequence[Any], alg: str,
                   iss: str) -> dict[str, Any] | None:
    """The claims of ``token`` if one of ``keys`` verifies its signature (``None`` if none
    does); raises :class:`Invalid` for a token PyJWT refuses otherwise (``iss``, no ``exp``)."""
    import jwt

    for key in keys:
        try:
            claims: dict[str, Any] = jwt.decode(token, getattr(key, "key", key),
                                                algorithms=[alg], issuer=iss, options=_DECODE)
            return claims
        except (jwt.InvalidSignatureError, jwt.InvalidAlgorithmError, jwt.InvalidKeyError,
                TypeError, ValueError):  # not this key (or not a key of this type)
            continue
        except jwt.PyJWTError as exc:
            raise Invalid(f"{type(exc).__name__}: {exc}") from None
    return None


def _audiences(claims: Mapping[str, Any]) -> tuple[str, ...]:
    """The ``aud`` claim: a string or a list of strings, as the apiserver reads it."""
    aud = claims.get("aud")
    if isinstance(aud, list) and all(isinstance(a, str) for a in aud):
        return tuple(aud)
    if isinstance(aud, str) or aud is None:
        return () if aud is None else (aud,)
    raise Invalid("the token's aud claim is not a string or a list of strings")


class TokenVerifier:
    """Verifies one token at a time (uncached); ``authenticator`` does the network calls."""

    def __init__(self, authenticator: Authenticator) -> None:
        self.auth = authenticator
        self._review_slots = asyncio.Semaphore(REVIEWS_IN_FLIGHT)

    async def verify(self, token: str, *, oidc: Mapping[str, Issuer],
                     kubernetes: Issuer | None) -> Verified:
        """The verdict on ``token``, by the first declaration of each issuer (``oidc`` by URL,
        ``kubernetes`` when a policy lists it: a service-account token is the cluster issuer's
        even when none does, so that a policy's verdict never depends on the others); raises
        :class:`Invalid` for a token that a signature or a claim refuses, :class:`Busy`, or the
        authenticator's exception."""
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
            issuer = oidc.get(iss)
            if issuer is None and kubernetes is not None:
                if await self.auth.cluster_issuer() == iss:
                    issuer = kubernetes
            if issuer is not None:
                return await self._verify_jwt(token, header or {}, claims, issuer, iss)
            # with no policy listing it, still a service-account token is the cluster's issuer's
            # (which those policies then refuse), not an opaque token every policy accepts
            return await self._other_issuer(token, claims, iss, kubernetes or _CLUSTER)
        return await self._review(token, claims)

    async def _other_issuer(self, token: str, claims: Mapping[str, Any], iss: str,
                            kubernetes: Issuer) -> Verified:
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
        return Verified(found.identity, KUBERNETES, iss, audiences or found.audiences,
                         found.expires, vouched=True)

    async def _verify_jwt(self, token: str, header: Mapping[str, Any],
                          unverified: Mapping[str, Any], issuer: Issuer, iss: str) -> Verified:
        alg = header.get("alg")
        if alg not in ALGORITHMS:
            raise Invalid(f"signing algorithm {str(alg)[:20]!r} is not accepted")
        kid = header.get("kid") if isinstance(header.get("kid"), str) else None
        keys = await self.auth.keys_for(iss, kid)
        if not keys:
            if issuer.kind == KUBERNETES:  # a key opgate has not fetched yet (rotated within
                # retry_seconds of its last fetch): the apiserver knows its keys, ask it
                return await self._vouched(token, unverified, iss)
            raise Invalid(f"no signing key of issuer {iss} matches the token's key id")
        claims = _signed_claims(token, keys, alg, iss)
        if claims is None:  # the issuer may have replaced a key under the same kid (or none):
            # as go-oidc, fetch its keys again (rate-limited) and try those that are new
            fresh = [k for k in await self.auth.keys_for(iss, kid, refresh=True)
                     if not any(k is old for old in keys)]
            claims = _signed_claims(token, fresh, alg, iss) if fresh else None
        if claims is None:
            raise Invalid(f"the signature does not verify with the keys of issuer {iss}")
        _check_times(claims, oidc=issuer.kind != KUBERNETES, now=time.time())
        identity = identity_from_claims(issuer, iss, claims)
        if identity is None:
            raise Invalid(f"the token's claims name no {issuer.kind} user")
        audiences = _audiences(claims)
        if issuer.kind == KUBERNETES and not issuer.known(audiences, iss):
            return await self._vouched(token, claims, iss)  # an audience only it knows
        leeway = 0.0 if issuer.kind != KUBERNETES else LEEWAY
        return Verified(identity, issuer.key, iss, audiences, self._expiry(claims, leeway))

    async def _vouched(self, token: str, claims: Mapping[str, Any], iss: str) -> Verified:
        """A token of the cluster's issuer that the apiserver judges (a TokenReview): when it
        accepts it, the verdict is the one opgate's own verification gives (the ``kubernetes``
        issuer, the token's audiences, which each policy's ``audiences`` then narrow), with the
        user the apiserver names."""
        found = await self._review(token, claims)
        if found.identity is None:
            return found
        return Verified(found.identity, KUBERNETES, iss, _audiences(claims), found.expires,
                         vouched=True)

    async def _review(self, token: str, claims: Mapping[str, Any]) -> Verified:
        """A TokenReview, once one of ``REVIEWS_IN_FLIGHT`` is free (module docstring)."""
        slots = self._review_slots
        try:
            async with asyncio.timeout(REVIEW_WAIT):
                await slots.acquire()
        except TimeoutError:
            telemetry.TOKEN_REVIEWS.labels("busy").inc()
            raise Busy from None
        try:
            result = await self.auth.token_review(token)
        except Exception:
            telemetry.TOKEN_REVIEWS.labels("error").inc()
            raise
        finally:
            slots.release()
        telemetry.TOKEN_REVIEWS.labels("rejected" if result is None else "authenticated").inc()
        if result is None:
            return Verified(None, TOKENREVIEW, "", (), time.monotonic() + NEGATIVE_TTL)
        identity, audiences = result
        return Verified(identity, TOKENREVIEW, "", audiences, self._expiry(claims))

    @staticmethod
    def _expiry(claims: Mapping[str, Any], leeway: float = 0.0) -> float:
        """When the cached verdict ends: ``TOKEN_TTL`` from now, or when the token stops being
        accepted (its ``exp``, plus the ``leeway`` it was verified with), whichever is first."""
        ttl = TOKEN_TTL
        exp = claims.get("exp")
        if isinstance(exp, (int, float)) and not isinstance(exp, bool):
            ttl = min(ttl, exp + leeway - time.time())
        return time.monotonic() + max(ttl, 0.0)
