"""The network half of the identity middleware: OIDC discovery, JWKS, TokenReview, SAR.

The identity middleware verifies tokens and decides, but never touches a socket; it calls this
module through its ``Authenticator`` protocol. Everything here uses opgate's own upstream
credentials (like :mod:`proxy.relay.informer`), never the caller's token:

- ``cluster_issuer()``: the apiserver's service-account issuer, from
  ``GET /.well-known/openid-configuration`` on the upstream (once; retried at most every
  ``retry_seconds`` while it fails). Its keys come from the upstream's ``/openid/v1/jwks``.
- ``keys_for(issuer, kid)``: the issuer's signing keys. Other issuers are found by OIDC
  discovery at ``<issuer>/.well-known/openid-configuration`` → ``jwks_uri`` (system CAs). A key
  set is kept for ``jwks_ttl`` seconds (then refreshed in the background, the calls its keys
  verify not waiting; the old keys stay if that fails) and
  fetched again at once, at most every ``retry_seconds``, when a token names an unknown ``kid``,
  has none while no key is known, or ``refresh`` says the keys given did not verify it (a
  provider that replaced a key under the same ``kid``, or its unnamed one: go-oidc fetches
  again then too); a call for which a fetch under way may bring keys waits for it. Every key
  of a ``kid`` is kept (a JWKS may list several, as go-oidc tries them all). No key to verify
  with while the latest fetch failed (an OIDC provider unreachable since opgate started, or
  during a rotation) raises :class:`AuthnUnavailable`: a 503, not a 401 for a good token.
- ``token_review(token)``: ``POST /apis/authentication.k8s.io/v1/tokenreviews``: the apiserver
  decides. ``access_review(attrs)``: a ``SubjectAccessReview``.

The upstream identity needs ``create`` on ``tokenreviews`` and ``subjectaccessreviews``
(``system:auth-delegator``) and the service-account issuer discovery (granted to every service
account by default). Failures raise :class:`AuthnUnavailable` with a message that never holds a
token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from yarl import URL

from proxy.engine.context import Identity, user_extra
from proxy.relay.endpoint import Endpoint, TokenSource, make_ssl_context
from proxy.relay.errors import describe
from proxy.relay.fast.client import UpstreamClient
from proxy.relay.upstream import UpstreamConfig

if TYPE_CHECKING:
    import aiohttp
    import jwt

__all__ = ["AuthnUnavailable", "UpstreamAuthenticator"]

log = logging.getLogger("opgate.authn")

DISCOVERY_PATH = "/.well-known/openid-configuration"
CLUSTER_JWKS_PATH = "/openid/v1/jwks"
JWKS_ACCEPT = "application/jwk-set+json, */*"  # the apiserver refuses a plain application/json
MAX_BODY = 1024 * 1024
USER_AGENT = "opgate-authn"


class AuthnUnavailable(Exception):
    """An issuer or the apiserver could not answer (message without any token)."""


@dataclass(slots=True, eq=False)
class _KeySet:
    keys: dict[str, tuple[jwt.PyJWK, ...]] = field(default_factory=dict)  # by kid
    unnamed: tuple[jwt.PyJWK, ...] = ()
    fetched: float = -1e9  # monotonic time of the last successful fetch
    attempted: float = -1e9
    failed: str = ""  # why the last attempt failed ("" once one succeeds)
    fetches: int = 0  # attempts ended (a call that waited for one knows it ended)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class UpstreamAuthenticator:
    """Implements the identity middleware's ``Authenticator`` protocol against the upstream."""

    def __init__(self, upstream: UpstreamConfig, *, connect_timeout: float = 5.0,
                 timeout: float = 10.0, jwks_ttl: float = 300.0,
                 retry_seconds: float = 10.0) -> None:
        self._endpoint = Endpoint.from_config(upstream, make_ssl_context(upstream))
        self._token = TokenSource(token=upstream.token, token_file=upstream.token_file)
        self._connect_timeout = connect_timeout
        self._timeout = timeout
        self.jwks_ttl = jwks_ttl
        self.retry_seconds = retry_seconds
        self._client: UpstreamClient | None = None  # the apiserver (fast core, no aiohttp)
        self._external: aiohttp.ClientSession | None = None  # other OIDC issuers
        self._cluster_issuer: str | None = None
        self._cluster_attempted = -1e9
        self._cluster_lock = asyncio.Lock()
        self._keysets: dict[str, _KeySet] = {}
        self._background: set[asyncio.Task[None]] = set()  # refreshes of stale key sets

    async def close(self) -> None:
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._client is not None:
            self._client.close()
        if self._external is not None:
            await self._external.close()
        self._client = self._external = None

    # --- the Authenticator protocol -------------------------------------------------------

    async def cluster_issuer(self) -> str | None:
        if self._cluster_issuer is not None:
            return self._cluster_issuer
        async with self._cluster_lock:
            now = time.monotonic()
            if self._cluster_issuer is None and now - self._cluster_attempted >= self.retry_seconds:
                self._cluster_attempted = now
                try:
                    doc = await self._fetch(DISCOVERY_PATH, upstream=True,
                                            accept="application/json")
                    issuer = doc.get("issuer")
                    if isinstance(issuer, str) and issuer:
                        self._cluster_issuer = issuer
                        log.info("the cluster's service-account issuer is %s", issuer)
                except AuthnUnavailable as exc:
                    log.warning("service-account issuer discovery failed (%s); tokens of that "
                                "issuer go to TokenReview meanwhile", exc)
        return self._cluster_issuer

    async def keys_for(self, issuer: str, kid: str | None, *,
                       refresh: bool = False) -> tuple[jwt.PyJWK, ...]:
        """The keys to verify a token of ``issuer`` naming ``kid`` with (module docstring);
        ``refresh``: those given before did not verify it, so fetch again if allowed."""
        ks = self._keysets.setdefault(issuer, _KeySet())
        now = time.monotonic()
        stale = now - ks.fetched >= self.jwks_ttl
        unknown = refresh or (kid not in ks.keys if kid is not None
                              else not (ks.keys or ks.unnamed))
        # such a caller waits for a fetch under way (another token's, at start or after a
        # rotation) rather than being refused because one was just attempted; one whose keys
        # are merely stale verifies with them while they are fetched again (go-oidc's order:
        # a slow or unreachable provider holds no call its known keys verify)
        if unknown and (now - ks.attempted >= self.retry_seconds or ks.lock.locked()):
            await self._refresh_once(issuer, ks)
        elif stale and now - ks.attempted >= self.retry_seconds and not ks.lock.locked():
            task = asyncio.ensure_future(self._refresh_once(issuer, ks))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        if kid is None:
            keys = (*(k for named in ks.keys.values() for k in named), *ks.unnamed)
        else:
            keys = ks.keys.get(kid, ks.unnamed)
        if not keys and ks.failed and issuer != self._cluster_issuer:
            # the issuer could not be asked: that says nothing of the token (the cluster's
            # tokens go to a TokenReview instead, see identity_verify)
            raise AuthnUnavailable(f"no keys of issuer {issuer} to verify with: {ks.failed}")
        return keys

    async def token_review(self, token: str) -> tuple[Identity, tuple[str, ...]] | None:
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                "spec": {"token": token}}
        doc = await self._post("/apis/authentication.k8s.io/v1/tokenreviews", body)
        status = doc.get("status") or {}
        if not status.get("authenticated"):
            return None
        user = status.get("user") or {}
        username = user.get("username")
        if not isinstance(username, str) or not username:
            return None
        groups = tuple(g for g in user.get("groups") or () if isinstance(g, str))
        audiences = tuple(a for a in status.get("audiences") or () if isinstance(a, str))
        extra = user.get("extra")  # as the apiserver gave it (its audit log records the same)
        pairs = ((k, [v for v in values if isinstance(v, str)])
                 for k, values in (extra.items() if isinstance(extra, dict) else ())
                 if isinstance(k, str) and isinstance(values, list))
        return Identity(user=username, groups=groups, uid=str(user.get("uid") or ""),
                        source="tokenreview", extra=user_extra(pairs)), audiences

    async def access_review(self, attrs: Mapping[str, Any]) -> tuple[bool, str]:
        """``attrs``: user, groups, uid, and either ``resourceAttributes`` or
        ``nonResourceAttributes`` as the SubjectAccessReview spec spells them."""
        body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                "spec": dict(attrs)}
        doc = await self._post("/apis/authorization.k8s.io/v1/subjectaccessreviews", body)
        status = doc.get("status") or {}
        return bool(status.get("allowed")), str(status.get("reason") or "")

    # --- fetching ---------------------------------------------------------------------------

    async def _refresh_once(self, issuer: str, ks: _KeySet) -> None:
        """Fetch the keys, unless a fetch just done did, or one under way (awaited: its
        outcome is this call's, even when it took longer than ``retry_seconds``, so a call
        waits for one fetch at most, not one more of its own after it)."""
        seen = ks.fetches
        async with ks.lock:
            if ks.fetches == seen and time.monotonic() - ks.attempted >= self.retry_seconds:
                try:
                    await self._refresh(issuer, ks)
                finally:
                    ks.fetches += 1

    async def _refresh(self, issuer: str, ks: _KeySet) -> None:
        import jwt  # here: PyJWT and cryptography only once a JWT issuer's keys are needed

        ks.attempted = time.monotonic()
        try:
            if issuer == self._cluster_issuer:
                data = await self._fetch(CLUSTER_JWKS_PATH, upstream=True, accept=JWKS_ACCEPT)
            else:
                doc = await self._fetch(issuer.rstrip("/") + DISCOVERY_PATH, upstream=False,
                                        accept="application/json")
                if doc.get("issuer") != issuer or not isinstance(doc.get("jwks_uri"), str):
                    raise AuthnUnavailable(f"the discovery document of {issuer} does not name "
                                           "this issuer and a jwks_uri")
                data = await self._fetch(doc["jwks_uri"], upstream=False, accept=JWKS_ACCEPT)
            keys: dict[str, tuple[jwt.PyJWK, ...]] = {}
            unnamed: list[jwt.PyJWK] = []
            for raw in data.get("keys") or ():
                try:
                    key = jwt.PyJWK.from_dict(raw)
                except (jwt.PyJWKError, jwt.InvalidKeyError, KeyError, TypeError, ValueError):
                    continue  # a key of a type this build cannot use
                if key.key_id:
                    keys[key.key_id] = (*keys.get(key.key_id, ()), key)
                else:
                    unnamed.append(key)
        except AuthnUnavailable as exc:
            log.warning("cannot refresh the keys of issuer %s (%s); keeping %d known keys",
                        issuer, exc, sum(map(len, ks.keys.values())) + len(ks.unnamed))
            ks.failed = str(exc)
            return
        ks.keys, ks.unnamed, ks.fetched = keys, tuple(unnamed), time.monotonic()
        ks.failed = ""
        log.info("keys of issuer %s: %d", issuer, sum(map(len, keys.values())) + len(unnamed))

    def _upstream(self) -> UpstreamClient:
        if self._client is None:
            self._client = UpstreamClient(self._endpoint, self._token,
                                          connect_timeout=self._connect_timeout,
                                          user_agent=USER_AGENT)
        return self._client

    def _session(self) -> aiohttp.ClientSession:
        import aiohttp  # here: loaded with the first call to an issuer other than the cluster

        if self._external is None:
            self._external = aiohttp.ClientSession(
                cookie_jar=aiohttp.DummyCookieJar(), trust_env=False,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout))
        return self._external

    async def _fetch(self, where: str, *, upstream: bool, accept: str) -> dict[str, Any]:
        if upstream:
            return await self._call_upstream("GET", where, accept=accept, body=None)
        return await self._call_external(where, accept=accept)

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call_upstream("POST", path, accept="application/json", body=body)

    async def _call_upstream(self, method: str, path: str, *, accept: str,
                             body: dict[str, Any] | None) -> dict[str, Any]:
        what = f"{method} {path}"
        try:
            answer = await self._upstream().call(method, path, accept=accept, body=body,
                                                 within=self._timeout, limit=MAX_BODY)
        except (TimeoutError, OSError) as exc:
            raise AuthnUnavailable(f"{what}: {describe(exc)}") from None
        if answer.status not in (200, 201):
            raise AuthnUnavailable(f"{what} answered {answer.status}: "
                                   f"{_status_message(answer.body)}")
        return _json_object(what, answer.body)

    async def _call_external(self, url: str, *, accept: str) -> dict[str, Any]:
        import aiohttp

        what = f"GET {URL(url).human_repr()}"
        timeout = aiohttp.ClientTimeout(total=self._timeout,
                                        sock_connect=self._connect_timeout or None)
        headers = {"Accept": accept, "User-Agent": USER_AGENT}
        try:
            async with self._session().get(URL(url), headers=headers, timeout=timeout,
                                           allow_redirects=True) as resp:
                raw = await resp.content.read(MAX_BODY + 1)
                if resp.status != 200:
                    raise AuthnUnavailable(f"{what} answered {resp.status}: "
                                           f"{_status_message(raw)}")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise AuthnUnavailable(f"{what}: {describe(exc)}") from None
        if len(raw) > MAX_BODY:
            raise AuthnUnavailable(f"{what}: answer larger than {MAX_BODY} bytes")
        return _json_object(what, raw)


def _json_object(what: str, raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError:
        raise AuthnUnavailable(f"{what}: answer is not JSON") from None
    if not isinstance(doc, dict):
        raise AuthnUnavailable(f"{what}: answer is not a JSON object")
    return doc


def _status_message(raw: bytes) -> str:
    """The ``message`` of a Status body (never the request, so never a token), shortened."""
    try:
        message = str(json.loads(raw).get("message", ""))
    except (ValueError, AttributeError):
        message = ""
    return (message or raw[:120].decode(errors="replace")).strip()[:300]
