"""The identity middleware over canned tokens signed with keys generated here (no network).

A fake :class:`Authenticator` serves the keys, TokenReviews and SubjectAccessReviews; the JWKS
refresh of the real :class:`UpstreamAuthenticator` is driven with its fetch replaced.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import time
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from multidict import CIMultiDict

from proxy.engine import telemetry
from proxy.engine.chain import settle
from proxy.engine.context import Deny, Identity, RequestContext
from proxy.engine.policies import load_policy_set
from proxy.engine.requestinfo import parse_request_info
from proxy.middlewares import identity
from proxy.middlewares.identity import IdentityCheck
from proxy.relay.authn import UpstreamAuthenticator
from proxy.relay.upstream import UpstreamConfig

ISSUER = "https://kubernetes.default.svc.cluster.local"
RSA_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
OTHER_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
EC_KEY = ec.generate_private_key(ec.SECP256R1())
PARSERS = {identity.SECTION: identity.parse_section}
CM = "/api/v1/namespaces/team-a/configmaps"
SECRETS = "/api/v1/namespaces/team-a/secrets"


def jwk(public: Any, kid: str, alg: str) -> dict[str, Any]:
    algorithm = jwt.algorithms.RSAAlgorithm if alg.startswith("RS") else jwt.algorithms.ECAlgorithm
    data = json.loads(algorithm.to_jwk(public))  # type: ignore[attr-defined]
    return {**data, "kid": kid, "alg": alg, "use": "sig"}


KEYS = {"k1": jwt.PyJWK.from_dict(jwk(RSA_KEY.public_key(), "k1", "RS256")),
        "e1": jwt.PyJWK.from_dict(jwk(EC_KEY.public_key(), "e1", "ES256"))}


def claims(ns: str = "ops", name: str = "op", *, aud: Sequence[str] = (ISSUER,),
           exp_in: float = 3600, iss: str = ISSUER) -> dict[str, Any]:
    """A service-account token's claims, valid for ``exp_in`` seconds: an hour by default, as
    the kubelet's projected tokens, because parametrized tokens are made when pytest collects
    and a whole suite takes over 10 minutes (the "bad audience" token expired at 600 s)."""
    now = int(time.time())
    return {"iss": iss, "sub": f"system:serviceaccount:{ns}:{name}", "aud": list(aud),
            "iat": now, "nbf": now, "exp": int(now + exp_in),
            "kubernetes.io": {"namespace": ns, "serviceaccount": {"name": name, "uid": "uid-1"}}}


def sa_token(ns: str = "ops", name: str = "op", *, key: Any = RSA_KEY, kid: str = "k1",
             alg: str = "RS256", **kw: Any) -> str:
    return jwt.encode(claims(ns, name, **kw), key, algorithm=alg, headers={"kid": kid})


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def forged(alg: str, secret: bytes = b"") -> str:
    """A token with ``alg`` none (no signature) or HS256 keyed with ``secret``."""
    head = b64(json.dumps({"alg": alg, "kid": "k1", "typ": "JWT"}).encode())
    body = b64(json.dumps(claims()).encode())
    signing = f"{head}.{body}".encode()
    sig = b64(hmac.new(secret, signing, hashlib.sha256).digest()) if alg == "HS256" else ""
    return f"{head}.{body}.{sig}"


class FakeAuth:
    def __init__(self) -> None:
        self.keys: dict[str, jwt.PyJWK] = dict(KEYS)
        self.reviews: dict[str, tuple[Identity, tuple[str, ...]]] = {}
        self.sar: tuple[bool, str] = (True, "")
        self.calls: list[str] = []
        self.sar_attrs: list[Mapping[str, Any]] = []
        self.fail: Exception | None = None

    async def cluster_issuer(self) -> str | None:
        return ISSUER

    async def keys_for(self, issuer: str, kid: str | None, *,
                       refresh: bool = False) -> Sequence[Any]:
        self.calls.append(f"keys {kid}" + (" again" if refresh else ""))
        if self.fail is not None:
            raise self.fail
        return (self.keys[kid],) if kid in self.keys else ()

    async def token_review(self, token: str) -> tuple[Identity, tuple[str, ...]] | None:
        self.calls.append("review")
        if self.fail is not None:
            raise self.fail
        return self.reviews.get(token)

    async def access_review(self, attrs: Mapping[str, Any]) -> tuple[bool, str]:
        self.calls.append("sar")
        self.sar_attrs.append(attrs)
        return self.sar


POLICY = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: {name}}}
spec:
  mode: {mode}
  failure: {failure}
  identity:
    issuers: [{{kubernetes: {{}}}}]
    allow:
      - serviceAccount: ops/op*
      - group: "system:masters"
    rules:
      - {{verbs: [get, list, watch], resources: ["*"]}}
      - {{name: no-secrets, effect: deny, resources: [secrets]}}
      - {{name: team-configmaps, verbs: [create, delete], resources: [configmaps],
         namespaces: ["team-*"]}}
      - {{name: all-secrets, resources: [secrets]}}
    subjectAccessReview: {sar}
"""


def policy_set(tmp_path: Path, *docs: str) -> Any:
    paths = []
    for i, doc in enumerate(docs):
        path = tmp_path / f"p{i}.yaml"
        path.write_text(doc)
        paths.append(path)
    return load_policy_set(paths, parsers=PARSERS)


def policy(name: str = "ident", *, mode: str = "enforce", sar: bool = False,
           failure: str = "closed") -> str:
    return POLICY.format(name=name, mode=mode, sar=str(sar).lower(), failure=failure)


def ctx_for(policies: Any, method: str, path: str, token: str | None,
            query: str = "") -> RequestContext:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return RequestContext(info=parse_request_info(method, path, query), method=method, path=path,
                          query=query, headers=headers, policies=policies)


def run(check: IdentityCheck, ctx: RequestContext) -> Deny | None:
    decision = asyncio.run(settle(check.entry(ctx)))
    assert decision is None or isinstance(decision, Deny)
    return decision


def body(decision: Deny) -> dict[str, Any]:
    return dict(json.loads(decision.status.body()))


def test_a_good_token_sets_the_identity(tmp_path: Path) -> None:
    ctx = ctx_for(policy_set(tmp_path, policy()), "GET", CM, sa_token())
    assert run(IdentityCheck(authenticator=FakeAuth()), ctx) is None
    assert ctx.identity == Identity(
        user="system:serviceaccount:ops:op", uid="uid-1", source="serviceaccount",
        groups=("system:serviceaccounts", "system:serviceaccounts:ops", "system:authenticated"))


def test_an_es256_token_verifies(tmp_path: Path) -> None:
    ctx = ctx_for(policy_set(tmp_path, policy()), "GET", CM,
                  sa_token(key=EC_KEY, kid="e1", alg="ES256"))
    assert run(IdentityCheck(authenticator=FakeAuth()), ctx) is None


PUBLIC_PEM = RSA_KEY.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)


@pytest.mark.parametrize(("token", "why"), [
    (sa_token(key=OTHER_KEY), "signature does not verify"),
    (forged("none"), "'none' is not accepted"),
    (forged("HS256", PUBLIC_PEM), "'HS256' is not accepted"),
    (sa_token(exp_in=-120), "expired"),
    (sa_token(aud=["vault"]), "the apiserver does not accept it"),  # asked: its audiences
    (sa_token(kid="k9"), "the apiserver does not accept it"),  # asked: a key opgate lacks
    (sa_token(kid="e1"), "signature does not verify"),  # an RS256 token against an EC key
])
def test_bad_tokens_are_401(tmp_path: Path, token: str, why: str) -> None:
    ctx = ctx_for(policy_set(tmp_path, policy()), "GET", CM, token)
    decision = run(IdentityCheck(authenticator=FakeAuth()), ctx)
    assert decision is not None and decision.decision == "unauthorized"
    got = body(decision)
    assert (got["code"], got["reason"], got["kind"]) == (401, "Unauthorized", "Status")
    assert why in got["message"] and "p0.yaml:1" in got["message"]
    assert ctx.identity is None


def test_missing_token_is_401(tmp_path: Path) -> None:
    before = telemetry.IDENTITY_DENIALS.labels("missing_token")._value.get()
    decision = run(IdentityCheck(authenticator=FakeAuth()),
                   ctx_for(policy_set(tmp_path, policy()), "GET", CM, None))
    assert decision is not None and body(decision)["code"] == 401
    assert "no bearer token" in body(decision)["message"]
    assert telemetry.IDENTITY_DENIALS.labels("missing_token")._value.get() == before + 1


@pytest.mark.parametrize(("method", "path", "verdict"), [
    ("GET", CM, None),                      # rules[0]
    ("GET", SECRETS + "/s", None),          # rules[0] wins over no-secrets (first match)
    ("POST", CM, None),                     # team-configmaps
    ("POST", SECRETS, "no-secrets"),        # the deny rule wins over all-secrets below it
    ("POST", "/api/v1/namespaces/prod/configmaps", "no rule"),
    ("PATCH", CM + "/c", "no rule"),
    # resources: ["*"] (rules[0]) is about every resource, which lets a client discover them
    # (RBAC's system:discovery paths), and about no other path: it allowed /metrics, /logs …
    # to a rule meant for "read any resource", then (8731376) not even discovery
    ("GET", "/api", None),
    ("GET", "/apis/apps/v1", None),
    ("GET", "/version", None),
    ("GET", "/openapi/v3", None),
    ("GET", "/metrics", "no rule"),
    ("GET", "/logs/", "no rule"),
    ("GET", "/healthz", "no rule"),
    ("GET", "/debug/pprof/", "no rule"),
])
def test_rules_first_match_wins(tmp_path: Path, method: str, path: str,
                                verdict: str | None) -> None:
    ctx = ctx_for(policy_set(tmp_path, policy()), method, path, sa_token())
    decision = run(IdentityCheck(authenticator=FakeAuth()), ctx)
    if verdict is None:
        assert decision is None
        return
    assert decision is not None and decision.decision == "denied"
    got = body(decision)
    assert (got["code"], got["reason"]) == (403, "Forbidden")
    assert 'user "system:serviceaccount:ops:op" cannot' in got["message"]
    assert 'policy "ident"' in got["message"] and "p0.yaml:1" in got["message"]
    if verdict == "no rule":
        assert "no rule of policy" in got["message"] and "rules at" in got["message"]
    else:
        assert f'rule "{verdict}" (' in got["message"] and "p0.yaml:14)" in got["message"]


@pytest.mark.parametrize("path", ["/api", "/apis/apps", "/version", "/healthz"])
def test_a_rule_naming_no_resources_covers_non_resource_paths(tmp_path: Path, path: str) -> None:
    # the way (besides nonResourceURLs) to write "read anything": leave resources out
    everything = policy().replace(', resources: ["*"]}', "}", 1)
    assert everything != policy()
    assert run(IdentityCheck(authenticator=FakeAuth()),
               ctx_for(policy_set(tmp_path, everything), "GET", path, sa_token())) is None


def test_a_path_no_rule_matches_says_how_to_allow_one(tmp_path: Path) -> None:
    # resources: ["*"] covers discovery, not /metrics: the 403 says what does
    decision = run(IdentityCheck(authenticator=FakeAuth()),
                   ctx_for(policy_set(tmp_path, policy()), "GET", "/metrics", sa_token()))
    assert decision is not None
    assert body(decision)["message"].endswith(
        '; a rule naming resources, apiGroups or namespaces is about resource requests only '
        '(and discovery: /api, /apis, /openapi, /version, when each is left out or "*"): allow '
        "another path with nonResourceURLs, or with a rule naming none of them")
    resource = run(IdentityCheck(authenticator=FakeAuth()), ctx_for(
        policy_set(tmp_path, policy()), "PATCH", CM + "/c", sa_token()))
    assert resource is not None and "nonResourceURLs" not in body(resource)["message"]


def test_a_token_allowed_discovery_is_still_refused_other_paths(tmp_path: Path) -> None:
    # the allowed shapes a cached token remembers tell /api from /metrics: a GET of a path is
    # one shape whatever the path, but for the discovery flag
    auth, token = FakeAuth(), sa_token()
    check, policies = IdentityCheck(authenticator=auth), policy_set(tmp_path, policy())
    for _ in range(2):
        assert run(check, ctx_for(policies, "GET", "/api", token)) is None
        assert run(check, ctx_for(policies, "GET", "/apis/apps/v1", token)) is None
    for path in ("/metrics", "/logs/", "/healthz", "/debug/pprof/"):
        denied = run(check, ctx_for(policies, "GET", path, token))
        assert denied is not None and denied.decision == "denied", path
    assert auth.calls == ["keys k1"]  # one verification: the refusals were not a cache miss


POD_GLOB_POLICY = policy().replace(
    "      - {verbs: [get, list, watch], resources: [\"*\"]}\n",
    "      - {name: pods, verbs: [get, create], resources: [\"pod*\"]}\n")


@pytest.mark.parametrize(("method", "path", "allowed"), [
    ("POST", "/api/v1/namespaces/team-a/pods", True),
    ("GET", "/api/v1/namespaces/team-a/podtemplates/t", True),
    # exec is a create of pods/exec: "pod*" let it in, where RBAC's "pods" does not
    ("POST", "/api/v1/namespaces/team-a/pods/p/exec", False),
    ("GET", "/api/v1/namespaces/team-a/pods/p/log", False),
])
def test_a_resource_glob_stays_out_of_subresources(tmp_path: Path, method: str, path: str,
                                                   allowed: bool) -> None:
    ctx = ctx_for(policy_set(tmp_path, POD_GLOB_POLICY), method, path, sa_token())
    decision = run(IdentityCheck(authenticator=FakeAuth()), ctx)
    assert (decision is None) is allowed


PATHS_POLICY = policy().replace(
    "      - {verbs: [get, list, watch], resources: [\"*\"]}\n",
    "      - {name: health, verbs: [get], nonResourceURLs: [/healthz, \"/readyz/*\", /version]}\n"
    "      - {name: no-other-paths, effect: deny, nonResourceURLs: [\"*\"]}\n"
    "      - {verbs: [get, list, watch], resources: [\"*\"]}\n")


@pytest.mark.parametrize(("method", "path", "verdict"), [
    ("GET", "/healthz", None),                    # exact
    ("GET", "/healthz/etcd", "no-other-paths"),   # an exact entry is no prefix
    ("GET", "/readyz/etcd", None),                # a prefix ending in *
    ("GET", "/readyz", "no-other-paths"),         # "/readyz/*" is not "/readyz"
    ("GET", "/version", None),
    ("POST", "/version", "no-other-paths"),       # health allows get only
    ("GET", "/metrics", "no-other-paths"),
    ("GET", CM, None),                            # no URL rule is about a resource request
    ("GET", "/api/v1/namespaces/team-a/pods/p/log", None),
])
def test_non_resource_urls_narrow_paths_as_rbac(tmp_path: Path, method: str, path: str,
                                                verdict: str | None) -> None:
    """A rule with ``nonResourceURLs`` is about those paths (exact, or a prefix ending in
    ``*``) and about no resource request, as an RBAC rule is."""
    ctx = ctx_for(policy_set(tmp_path, PATHS_POLICY), method, path, sa_token())
    decision = run(IdentityCheck(authenticator=FakeAuth()), ctx)
    if verdict is None:
        assert decision is None
        return
    assert decision is not None and body(decision)["code"] == 403
    assert f'cannot {method.lower()} path "{path}": rule "{verdict}"' in body(decision)["message"]


def test_an_allowed_path_is_not_remembered_for_another(tmp_path: Path) -> None:
    """A token's allowed call shapes are remembered; two paths share a shape, so with rules
    about paths the second is judged on its own."""
    check, policies, token = IdentityCheck(authenticator=FakeAuth()), policy_set(
        tmp_path, PATHS_POLICY), sa_token()
    for _ in range(2):
        assert run(check, ctx_for(policies, "GET", "/healthz", token)) is None
    decision = run(check, ctx_for(policies, "GET", "/metrics", token))
    assert decision is not None and 'rule "no-other-paths"' in body(decision)["message"]


def test_callers_outside_allow_are_403(tmp_path: Path) -> None:
    decision = run(IdentityCheck(authenticator=FakeAuth()),
                   ctx_for(policy_set(tmp_path, policy()), "GET", CM, sa_token(name="intruder")))
    assert decision is not None
    got = body(decision)
    assert got["code"] == 403
    assert ('user "system:serviceaccount:ops:intruder" is not allowed by policy "ident"'
            in got["message"])
    assert "spec.identity.allow (" in got["message"] and "p0.yaml:10" in got["message"]
    assert got["details"] == {"kind": "configmaps"}


@pytest.mark.parametrize(("method", "path", "details"), [
    ("POST", SECRETS, {"kind": "secrets"}),
    ("DELETE", SECRETS + "/s", {"name": "s", "kind": "secrets"}),
    ("PATCH", "/apis/apps/v1/namespaces/team-a/deployments/web/scale",
     {"name": "web", "group": "apps", "kind": "deployments"}),
    ("DELETE", "/apis/rbac.authorization.k8s.io/v1/clusterroles/admin",
     {"name": "admin", "group": "rbac.authorization.k8s.io", "kind": "clusterroles"}),
    ("POST", "/api", {}),  # a non-resource path: the apiserver's 403 has "details":{} too
])
def test_a_403_has_the_details_of_the_apiservers_own(tmp_path: Path, method: str, path: str,
                                                     details: dict[str, str]) -> None:
    """``details`` as the apiserver's Forbidden for the same call (name, group, and the
    resource as ``kind``), opgate's message kept (it names the rule)."""
    ctx = ctx_for(policy_set(tmp_path, policy()), method, path, sa_token())
    decision = run(IdentityCheck(authenticator=FakeAuth()), ctx)
    assert decision is not None
    got = body(decision)
    assert (got["code"], got["details"]) == (403, details)
    assert list(got["details"]) == [k for k in ("name", "group", "kind") if k in details]
    assert got["message"].startswith('opgate: user "system:serviceaccount:ops:op" cannot ')


def test_dryrun_warns_and_never_denies(tmp_path: Path) -> None:
    before = telemetry.DRYRUN_DENIALS.labels("identity")._value.get()
    ctx = ctx_for(policy_set(tmp_path, policy(mode="dryrun")), "POST", SECRETS, None)
    assert run(IdentityCheck(authenticator=FakeAuth()), ctx) is None
    (name, value), = ctx.response_headers
    assert name == "Warning" and value.startswith('299 - "opgate: would deny (dryrun): ')
    assert "no bearer token" in value
    assert telemetry.DRYRUN_DENIALS.labels("identity")._value.get() == before + 1


def test_every_policy_must_pass(tmp_path: Path) -> None:
    strict = policy("strict").replace("ops/op*", "ops/other")
    policies = policy_set(tmp_path, policy("loose"), strict)
    decision = run(IdentityCheck(authenticator=FakeAuth()),
                   ctx_for(policies, "GET", CM, sa_token()))
    assert decision is not None and 'policy "strict"' in body(decision)["message"]
    assert "p1.yaml:1" in body(decision)["message"]


def test_no_identity_section_costs_nothing(tmp_path: Path) -> None:
    auth = FakeAuth()
    policies = policy_set(tmp_path, "apiVersion: opgate.dev/v1alpha1\nkind: Policy\n"
                                    "metadata: {name: p}\nspec: {mode: enforce}\n")
    assert run(IdentityCheck(authenticator=auth), ctx_for(policies, "GET", CM, None)) is None
    assert auth.calls == []


def test_verified_tokens_are_cached(tmp_path: Path) -> None:
    auth, token = FakeAuth(), sa_token()
    check, policies = IdentityCheck(authenticator=auth), policy_set(tmp_path, policy())

    async def calls() -> None:
        await asyncio.gather(*(check.entry(ctx_for(policies, "GET", CM, token))
                               for _ in range(5)))
        await settle(check.entry(ctx_for(policies, "GET", CM, token)))

    asyncio.run(calls())
    assert auth.calls == ["keys k1"]


def test_tokenreview_fallback_for_opaque_tokens(tmp_path: Path) -> None:
    auth = FakeAuth()
    admin = Identity(user="admin", groups=("system:masters", "system:authenticated"),
                     source="tokenreview")
    auth.reviews["opaque-admin-token"] = (admin, ())
    check, policies = IdentityCheck(authenticator=auth), policy_set(tmp_path, policy())
    ctx = ctx_for(policies, "GET", CM, "opaque-admin-token")
    assert run(check, ctx) is None and ctx.identity == admin
    assert run(check, ctx_for(policies, "GET", CM, "opaque-admin-token")) is None
    for _ in range(2):  # a rejected token is remembered briefly too
        decision = run(check, ctx_for(policies, "GET", CM, "garbage"))
        assert decision is not None and body(decision)["code"] == 401
        assert "the apiserver does not accept it" in body(decision)["message"]
    assert auth.calls == ["review", "review"]


def test_a_jwt_of_an_unknown_issuer_goes_to_tokenreview(tmp_path: Path) -> None:
    auth = FakeAuth()
    token = sa_token(iss="https://elsewhere.example.com")
    decision = run(IdentityCheck(authenticator=auth),
                   ctx_for(policy_set(tmp_path, policy()), "GET", CM, token))
    assert decision is not None and body(decision)["code"] == 401
    assert auth.calls == ["review"]


def test_subject_access_review_denies_and_is_cached(tmp_path: Path) -> None:
    auth = FakeAuth()
    auth.sar = (False, "no RBAC policy matched")
    check, policies = IdentityCheck(authenticator=auth), policy_set(tmp_path, policy(sar=True))
    for _ in range(2):
        decision = run(check, ctx_for(policies, "GET", CM + "/c", sa_token()))
        assert decision is not None
        got = body(decision)
        assert got["code"] == 403 and "the apiserver denies it (no RBAC policy matched" in (
            got["message"])
        assert got["details"] == {"name": "c", "kind": "configmaps"}
    assert auth.calls.count("sar") == 1
    assert auth.sar_attrs[0] == {
        "user": "system:serviceaccount:ops:op", "uid": "uid-1",
        "groups": ["system:serviceaccounts", "system:serviceaccounts:ops", "system:authenticated"],
        "resourceAttributes": {"namespace": "team-a", "verb": "get", "group": "", "version": "v1",
                               "resource": "configmaps", "subresource": "", "name": "c"}}
    auth.sar = (True, "")
    ctx = ctx_for(policies, "GET", "/api/v1/namespaces/team-b/configmaps/c", sa_token())
    assert run(check, ctx) is None


@pytest.mark.parametrize(("method", "path", "query", "selectors"), [
    ("GET", "/api/v1/pods", "fieldSelector=spec.nodeName%3Dn1&labelSelector=app+in+(a,b)",
     {"fieldSelector": {"rawSelector": "spec.nodeName=n1"},
      "labelSelector": {"rawSelector": "app in (a,b)"}}),
    ("GET", "/api/v1/pods", "watch=1&fieldSelector=spec.nodeName%3Dn2",
     {"fieldSelector": {"rawSelector": "spec.nodeName=n2"}}),
    ("DELETE", "/api/v1/namespaces/team-a/pods", "labelSelector=x%3Dy",
     {"labelSelector": {"rawSelector": "x=y"}}),
    ("GET", "/api/v1/pods", "fieldSelector=&labelSelector=", {}),  # empty: none, as there
    ("GET", "/api/v1/namespaces/team-a/pods/p", "fieldSelector=spec.nodeName%3Dn1", {}),  # get
    ("GET", "/api/v1/watch/pods", "fieldSelector=spec.nodeName%3Dn1", {}),  # verb in the path
])
def test_a_subject_access_review_carries_the_calls_selectors(
        tmp_path: Path, method: str, path: str, query: str,
        selectors: dict[str, Any]) -> None:
    """As the apiserver's authorizers see a list, watch or deletecollection: with its field and
    label selectors as sent (the Node authorizer lets a node list only its own pods, by
    ``spec.nodeName``; a webhook may decide on them), so a review without them refused a call
    the apiserver serves; each selector is its own question (cached apart)."""
    auth = FakeAuth()
    text = policy(sar=True).replace("    rules:\n", "    rules:\n      - {verbs: [deletecollection]"
                                    ", resources: [pods]}\n", 1)
    check, policies = IdentityCheck(authenticator=auth), policy_set(tmp_path, text)
    for _ in range(2):
        assert run(check, ctx_for(policies, method, path, sa_token(), query)) is None
    asked = [{k: v for k, v in a["resourceAttributes"].items() if k.endswith("Selector")}
             for a in auth.sar_attrs]
    assert asked == [selectors]  # the second call: the cached answer
    if selectors:  # another selector is another question (a second value of one is ignored)
        run(check, ctx_for(policies, method, path, sa_token(), f"labelSelector=z&{query}"))
        run(check, ctx_for(policies, method, path, sa_token(), f"{query}&labelSelector=z"))
        assert len(auth.sar_attrs) == 2
        assert auth.sar_attrs[1]["resourceAttributes"]["labelSelector"] == {"rawSelector": "z"}


def test_a_subject_access_review_names_the_users_extra(tmp_path: Path) -> None:
    """A pod-bound token's extra (credential id, pod) goes to the SubjectAccessReview, as the
    apiserver's authorizers see it; another pod of the same ServiceAccount is asked anew."""
    auth = FakeAuth()
    check, policies = IdentityCheck(authenticator=auth), policy_set(tmp_path, policy(sar=True))

    def bound(pod: str) -> str:
        body = claims()
        body["jti"] = f"jti-{pod}"
        body["kubernetes.io"]["pod"] = {"name": pod, "uid": f"uid-{pod}"}
        return jwt.encode(body, RSA_KEY, algorithm="RS256", headers={"kid": "k1"})

    for pod in ("p1", "p1", "p2"):
        assert run(check, ctx_for(policies, "GET", CM + "/c", bound(pod))) is None
    assert auth.calls.count("sar") == 2  # one per pod: the extra is part of the question
    assert [attrs["extra"] for attrs in auth.sar_attrs] == [
        {"authentication.kubernetes.io/credential-id": [f"JTI=jti-{pod}"],
         "authentication.kubernetes.io/pod-name": [pod],
         "authentication.kubernetes.io/pod-uid": [f"uid-{pod}"]} for pod in ("p1", "p2")]


@pytest.mark.parametrize(("failure", "denied"), [("closed", True), ("open", False)])
def test_an_unreachable_authenticator(tmp_path: Path, failure: str, denied: bool) -> None:
    auth = FakeAuth()
    auth.fail = ConnectionError("upstream down")
    decision = run(IdentityCheck(authenticator=auth),
                   ctx_for(policy_set(tmp_path, policy(failure=failure)), "GET", CM, sa_token()))
    assert (decision is not None) is denied
    if decision is not None:  # (in metrics and the audit log: what was down, not the caller)
        assert (body(decision)["code"], decision.decision) == (503, "unavailable")
        assert dict(decision.status.headers)["Retry-After"] == "1"  # client-go retries it


def test_the_token_is_never_in_a_message_or_a_log(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    auth = FakeAuth()
    check = IdentityCheck(authenticator=auth)
    tokens = [sa_token(key=OTHER_KEY), forged("none"), sa_token(exp_in=-120), "garbage-opaque",
              sa_token(name="intruder"), sa_token(aud=["vault"]), sa_token()]
    texts = []
    for mode in ("enforce", "dryrun"):
        policies = policy_set(tmp_path, policy(mode=mode, sar=True))
        auth.sar = (False, "nope")
        for token in tokens:
            ctx = ctx_for(policies, "POST", SECRETS, token)
            decision = run(check, ctx)
            texts.append(decision.status.body().decode() if decision else "")
            texts.extend(v for _, v in ctx.response_headers)
    auth.fail = RuntimeError("down")
    check = IdentityCheck(authenticator=auth)
    ctx = ctx_for(policy_set(tmp_path, policy()), "GET", CM, "another-opaque-token")
    texts.append(run(check, ctx).status.body().decode())  # type: ignore[union-attr]
    assert any("would deny" in t for t in texts) and caplog.text
    for token in [*tokens, "another-opaque-token"]:
        for part in {token, *token.split(".")} - {""}:
            if len(part) > 30 or "." not in token:
                assert part not in caplog.text
                assert all(part not in t for t in texts)


def test_unknown_kid_refreshes_the_key_set_rate_limited(tmp_path: Path) -> None:
    auth = UpstreamAuthenticator(UpstreamConfig(url="https://127.0.0.1:1"), retry_seconds=60)
    served = [{"keys": [jwk(RSA_KEY.public_key(), "k1", "RS256")]}]
    fetched: list[str] = []

    async def fetch(where: str, *, upstream: bool, accept: str) -> dict[str, Any]:
        fetched.append(where)
        if where.endswith("openid-configuration"):
            return {"issuer": ISSUER, "jwks_uri": f"{ISSUER}/openid/v1/jwks"}
        assert upstream and "jwk-set+json" in accept
        return served[-1]

    reviewed: list[str] = []

    async def post(path: str, doc: dict[str, Any]) -> dict[str, Any]:
        reviewed.append(doc["spec"]["token"])
        return {"status": {"authenticated": False}}

    auth._fetch = fetch  # type: ignore[method-assign]
    auth._post = post  # type: ignore[method-assign]
    check, policies = IdentityCheck(authenticator=auth), policy_set(tmp_path, policy())
    assert run(check, ctx_for(policies, "GET", CM, sa_token())) is None
    assert fetched == ["/.well-known/openid-configuration", "/openid/v1/jwks"]
    served.append({"keys": [jwk(OTHER_KEY.public_key(), "k2", "RS256")]})  # rotation
    auth._keysets[ISSUER].attempted -= 61  # the last fetch was a while ago
    assert run(check, ctx_for(policies, "GET", CM, sa_token(key=OTHER_KEY, kid="k2"))) is None
    assert fetched[-1] == "/openid/v1/jwks" and len(fetched) == 3 and reviewed == []
    k3 = sa_token(key=OTHER_KEY, kid="k3")
    decision = run(check, ctx_for(policies, "GET", CM, k3))
    assert decision is not None and body(decision)["code"] == 401
    assert len(fetched) == 3  # an unknown kid right after a fetch does not fetch again,
    assert reviewed == [k3]  # the apiserver, which knows its keys, is asked instead


def test_a_key_rotated_just_after_a_fetch_is_vouched_for_by_the_apiserver(
        tmp_path: Path) -> None:
    """A token of a new signing key within retry_seconds of opgate's last JWKS fetch: opgate
    cannot fetch again yet, so a TokenReview decides (it was a 401 for up to 10 s)."""
    auth = UpstreamAuthenticator(UpstreamConfig(url="https://127.0.0.1:1"), retry_seconds=60)

    async def fetch(where: str, *, upstream: bool, accept: str) -> dict[str, Any]:
        if where.endswith("openid-configuration"):
            return {"issuer": ISSUER, "jwks_uri": f"{ISSUER}/openid/v1/jwks"}
        return {"keys": [jwk(RSA_KEY.public_key(), "k1", "RS256")]}

    new = sa_token(key=OTHER_KEY, kid="k2")

    async def post(path: str, doc: dict[str, Any]) -> dict[str, Any]:
        assert path.endswith("/tokenreviews") and doc["spec"]["token"] == new
        return {"status": {"authenticated": True, "user": {
            "username": "system:serviceaccount:ops:op",
            "groups": ["system:serviceaccounts", "system:serviceaccounts:ops"]}}}

    auth._fetch = fetch  # type: ignore[method-assign]
    auth._post = post  # type: ignore[method-assign]
    check, policies = IdentityCheck(authenticator=auth), policy_set(tmp_path, policy())
    assert run(check, ctx_for(policies, "GET", CM, sa_token())) is None  # k1 fetched now
    ctx = ctx_for(policies, "GET", CM, new)
    assert run(check, ctx) is None
    assert ctx.identity is not None and ctx.identity.source == "tokenreview"


def test_a_token_reviews_user_extra_is_the_identitys() -> None:
    """``status.user.extra`` as the apiserver returned it (its audit log records the same),
    keys sorted as Go writes a map, values in order; what is not a list of strings left out."""
    auth = UpstreamAuthenticator(UpstreamConfig(url="https://127.0.0.1:1"))
    extra = {"scopes.example.com/z": ["b", "a"], "authentication.kubernetes.io/pod-uid": ["u"],
             "authentication.kubernetes.io/credential-id": ["JTI=j"], "odd": "text",
             "mixed": ["x", 1]}

    async def post(path: str, doc: dict[str, Any]) -> dict[str, Any]:
        return {"status": {"authenticated": True, "audiences": ["api"], "user": {
            "username": "jane", "uid": "7", "groups": ["dev"], "extra": extra}}}

    auth._post = post  # type: ignore[method-assign]
    result = asyncio.run(auth.token_review("opaque"))
    assert result == (Identity(user="jane", groups=("dev",), uid="7", source="tokenreview",
                               extra=(("authentication.kubernetes.io/credential-id", ("JTI=j",)),
                                      ("authentication.kubernetes.io/pod-uid", ("u",)),
                                      ("mixed", ("x",)),
                                      ("scopes.example.com/z", ("b", "a")))), ("api",))
    extra.clear()
    result = asyncio.run(auth.token_review("opaque"))
    assert result is not None and result[0].extra == ()


def test_calls_with_a_new_kid_wait_for_the_refresh_under_way(tmp_path: Path) -> None:
    """Two callers with distinct tokens of a key not yet known (opgate's start, or a rotation):
    the second arrives while the first one's JWKS fetch is under way and waits for it, instead
    of being refused (401) because a fetch was "just attempted"."""
    auth = UpstreamAuthenticator(UpstreamConfig(url="https://127.0.0.1:1"), retry_seconds=60)
    fetched: list[str] = []

    async def go() -> list[Deny | None]:
        release, under_way = asyncio.Event(), asyncio.Event()

        async def fetch(where: str, *, upstream: bool, accept: str) -> dict[str, Any]:
            fetched.append(where)
            if where.endswith("openid-configuration"):
                return {"issuer": ISSUER}
            under_way.set()
            await release.wait()  # the JWKS answer takes a while
            return {"keys": [jwk(RSA_KEY.public_key(), "k1", "RS256")]}

        auth._fetch = fetch  # type: ignore[method-assign]
        check, policies = IdentityCheck(authenticator=auth), policy_set(tmp_path, policy())
        first = asyncio.ensure_future(settle(check.entry(
            ctx_for(policies, "GET", CM, sa_token("ops", "op")))))
        await under_way.wait()  # the first call's fetch is under way
        second = asyncio.ensure_future(settle(check.entry(
            ctx_for(policies, "GET", CM, sa_token("ops", "op2")))))
        for _ in range(50):  # the second call gets as far as it can
            await asyncio.sleep(0)
        release.set()
        return [await first, await second]  # type: ignore[list-item]

    assert asyncio.run(go()) == [None, None]
    assert fetched.count("/openid/v1/jwks") == 1


IDP = "https://idp.example.com/"  # with the trailing slash some providers' issuers carry
OIDC_POLICY = f"""\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: oidc}}
spec:
  identity:
    issuers:
      - oidc: {{issuer: "{IDP}", audiences: [kubernetes], claims: {{groups: groups}}}}
    allow:
      - group: "system:authenticated"
    rules:
      - {{verbs: [get, list], resources: ["*"]}}
"""


def oidc_token(**extra: Any) -> str:
    now = int(time.time())
    body = {"iss": IDP, "sub": "alice", "aud": ["kubernetes"], "iat": now, "exp": now + 600,
            "groups": ["ops"], **extra}
    return jwt.encode(body, RSA_KEY, algorithm="RS256", headers={"kid": "k1"})


def test_an_oidc_issuer_is_matched_as_written(tmp_path: Path) -> None:
    """The token's ``iss`` equals the issuer URL exactly, trailing slash included (as the
    apiserver's ``--oidc-issuer-url``): such a token is verified here, not sent for review."""
    auth = FakeAuth()
    ctx = ctx_for(policy_set(tmp_path, OIDC_POLICY), "GET", CM, oidc_token())
    assert run(IdentityCheck(authenticator=auth), ctx) is None
    assert auth.calls == ["keys k1"]
    assert ctx.identity == Identity(user=f"{IDP}#alice", groups=("ops", "system:authenticated"),
                                    uid="", source="oidc")


@pytest.mark.parametrize("failure", ["closed", "open"])
def test_an_oidc_issuer_whose_keys_cannot_be_fetched_yet_is_unavailable_not_401(
        tmp_path: Path, failure: str) -> None:
    """An OIDC provider unreachable since opgate started (its discovery or JWKS fails: the
    IdP down, egress not ready yet): opgate cannot verify its tokens, which says nothing about
    them, so the answer is the 503 with ``Retry-After`` of an apiserver that cannot be asked
    (``failure: open`` lets the call on), not a 401 sending the caller to a good token. Once
    the keys come, the same token passes."""
    from proxy.relay.authn import AuthnUnavailable

    auth = UpstreamAuthenticator(UpstreamConfig(url="https://127.0.0.1:1"), retry_seconds=60)
    up = False

    async def fetch(where: str, *, upstream: bool, accept: str) -> dict[str, Any]:
        assert not upstream
        if not up:
            raise AuthnUnavailable(f"GET {where}: connection refused")
        if where.endswith("openid-configuration"):
            return {"issuer": IDP, "jwks_uri": "https://idp.example.com/jwks"}
        return {"keys": [jwk(RSA_KEY.public_key(), "k1", "RS256")]}

    auth._fetch = fetch  # type: ignore[method-assign]
    text = OIDC_POLICY.replace("spec:\n", f"spec:\n  failure: {failure}\n", 1)
    check, policies = IdentityCheck(authenticator=auth), policy_set(tmp_path, text)
    token = oidc_token()
    decision = run(check, ctx_for(policies, "GET", CM, token))
    if failure == "open":
        assert decision is None
    else:
        assert decision is not None and decision.decision == "unavailable"
        got = body(decision)
        assert (got["code"], got["reason"]) == (503, "ServiceUnavailable"), got
        assert dict(decision.status.headers)["Retry-After"] == "1"
        assert token not in got["message"]
    up = True
    auth._keysets[IDP].attempted -= 61  # opgate's next attempt, retry_seconds later
    ctx = ctx_for(policies, "GET", CM, token)
    assert run(check, ctx) is None and ctx.identity is not None
    assert ctx.identity.user == f"{IDP}#alice"
    up = False  # down again while the provider rotates: a token of its new key
    auth._keysets[IDP].attempted -= 61
    rotated = jwt.encode(jwt.decode(token, options={"verify_signature": False}), OTHER_KEY,
                         algorithm="RS256", headers={"kid": "k2"})
    decision = run(check, ctx_for(policies, "GET", CM, rotated))
    assert (decision is None) if failure == "open" else (
        decision is not None and body(decision)["code"] == 503)
    assert run(check, ctx_for(policies, "GET", CM, token)) is None  # the known key's still pass


@pytest.mark.parametrize("aud", [{"kubernetes": 1}, 5, ["kubernetes", 5]])
def test_an_aud_claim_of_another_type_is_401(tmp_path: Path, aud: Any) -> None:
    """``aud`` is a string or a list of strings (the apiserver refuses anything else); an object
    is not the list of its keys, a number not a reason for a 503."""
    ctx = ctx_for(policy_set(tmp_path, OIDC_POLICY), "GET", CM, oidc_token(aud=aud))
    decision = run(IdentityCheck(authenticator=FakeAuth()), ctx)
    assert decision is not None and body(decision)["code"] == 401
    assert "aud claim is not a string" in body(decision)["message"]


def timed(kind: str, **offsets: float) -> str:
    """A token of ``kind`` (``kubernetes``, ``oidc``) whose ``exp``/``nbf``/``iat`` are ``now``
    plus the given offsets (``exp`` an hour ahead unless given)."""
    now = int(time.time())
    times = {"exp": now + 3600, "nbf": now, "iat": now,
             **{k: now + int(v) for k, v in offsets.items()}}
    if kind == "oidc":
        return oidc_token(**times)
    return jwt.encode({**claims(), **times}, RSA_KEY, algorithm="RS256", headers={"kid": "k1"})


@pytest.mark.parametrize(("kind", "offsets", "accepted"), [
    # a service-account token: go-jose's one minute either way on exp, nbf and iat
    # (pkg/serviceaccount: Claims.Validate, jwt.DefaultLeeway), e.g. the apiserver's clock 45 s
    # ahead of the node's, or a token kept 45 s past its exp
    ("kubernetes", {"exp": -45}, True),
    ("kubernetes", {"exp": -90}, False),
    ("kubernetes", {"nbf": 45, "iat": 45}, True),
    ("kubernetes", {"nbf": 90, "iat": 90}, False),
    ("kubernetes", {"iat": 90}, False),
    # an OIDC token as go-oidc checks it: exp without leeway, nbf with a minute, iat not at all
    ("oidc", {"exp": -5}, False),
    ("oidc", {"nbf": 45, "iat": 45}, True),
    ("oidc", {"nbf": 90}, False),
    ("oidc", {"iat": 600}, True),
])
def test_time_claims_are_checked_as_the_apiserver_does(
        tmp_path: Path, kind: str, offsets: dict[str, float], accepted: bool) -> None:
    text = OIDC_POLICY if kind == "oidc" else policy()
    ctx = ctx_for(policy_set(tmp_path, text), "GET", CM, timed(kind, **offsets))
    decision = run(IdentityCheck(authenticator=FakeAuth()), ctx)
    if accepted:
        assert decision is None, body(decision)["message"]
    else:
        assert decision is not None and body(decision)["code"] == 401
        assert "invalid bearer token" in body(decision)["message"]


@pytest.mark.parametrize("claim", ["exp", "nbf", "iat"])
def test_a_time_claim_that_is_no_number_is_401(tmp_path: Path, claim: str) -> None:
    token = jwt.encode({**claims(), claim: "soon"}, RSA_KEY, algorithm="RS256",
                       headers={"kid": "k1"})
    decision = run(IdentityCheck(authenticator=FakeAuth()),
                   ctx_for(policy_set(tmp_path, policy()), "GET", CM, token))
    assert decision is not None and body(decision)["code"] == 401
    assert f"{claim} claim is not a number" in body(decision)["message"]


def audience_policy(audiences: str) -> str:
    return policy().replace("issuers: [{kubernetes: {}}]",
                            f"issuers: [{{kubernetes: {audiences}}}]")


SA = Identity(user="system:serviceaccount:ops:op", uid="uid-1", source="tokenreview",
              groups=("system:serviceaccounts", "system:serviceaccounts:ops",
                      "system:authenticated"))


def test_a_token_of_another_apiserver_audience_is_vouched_for_by_the_apiserver(
        tmp_path: Path) -> None:
    """``--api-audiences`` may name audiences besides the issuer: a token of one of them (a
    TokenRequest's ``audiences``) is the apiserver's to judge, not a 401 of opgate's; one it
    refuses stays a 401, and is asked once."""
    auth, extra, vault = FakeAuth(), sa_token(aud=["extra-aud"]), sa_token(aud=["vault"])
    auth.reviews[extra] = (SA, ("extra-aud",))
    check, policies = IdentityCheck(authenticator=auth), policy_set(tmp_path, policy())
    ctx = ctx_for(policies, "GET", CM, extra)
    assert run(check, ctx) is None and ctx.identity == SA
    for _ in range(2):
        decision = run(check, ctx_for(policies, "GET", CM, vault))
        assert decision is not None and body(decision)["code"] == 401
    assert auth.calls == ["keys k1", "review", "keys k1", "review"]
    assert run(check, ctx_for(policies, "GET", CM, sa_token())) is None  # the issuer: offline
    assert auth.calls.count("review") == 2


@pytest.mark.parametrize("kid", ["k1", "k9"])  # verified here, or a key opgate lacks (asked)
def test_listed_audiences_narrow_what_the_apiserver_vouches_for(tmp_path: Path,
                                                                 kid: str) -> None:
    """``kubernetes: {audiences: [...]}`` holds for a token the apiserver vouched for too (a
    key rotated since opgate's last JWKS fetch, an audience opgate does not know)."""
    auth = FakeAuth()
    policies = policy_set(tmp_path, audience_policy("{audiences: [opgate]}"))
    ok, other = sa_token(aud=["opgate"], kid=kid), sa_token(kid=kid)
    auth.reviews[ok] = auth.reviews[other] = (SA, (ISSUER,))
    check = IdentityCheck(authenticator=auth)
    assert run(check, ctx_for(policies, "GET", CM, ok)) is None
    decision = run(check, ctx_for(policies, "GET", CM, other))
    assert decision is not None and body(decision)["code"] == 401
    assert "audience is not accepted" in body(decision)["message"]


def test_a_cached_subject_access_review_is_for_the_same_uid_and_version(tmp_path: Path) -> None:
    """Everything a SubjectAccessReview says is part of its cache key: the uid (a ServiceAccount
    recreated under the same name, a webhook authorizer that reads it) and the API version
    (an authorizer may answer per version) too, not only the user, groups and the call."""
    auth = FakeAuth()
    check, policies = IdentityCheck(authenticator=auth), policy_set(tmp_path, policy(sar=True))

    def token(uid: str) -> str:
        body = claims()
        body["kubernetes.io"]["serviceaccount"]["uid"] = uid
        return jwt.encode(body, RSA_KEY, algorithm="RS256", headers={"kid": "k1"})

    deployments = "/apis/apps/{}/namespaces/team-a/deployments/d"
    for uid, version in (("uid-1", "v1"), ("uid-2", "v1"), ("uid-2", "v1beta1"),
                         ("uid-2", "v1")):
        assert run(check, ctx_for(policies, "GET", deployments.format(version), token(uid))) is None
    assert [(a["uid"], a["resourceAttributes"]["version"]) for a in auth.sar_attrs] == [
        ("uid-1", "v1"), ("uid-2", "v1"), ("uid-2", "v1beta1")]


IMPERSONATING = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {name: impersonation}
spec:
  allowImpersonation: true
"""


@pytest.mark.parametrize("allowed", [True, False], ids=["allowed", "stripped"])
def test_a_subject_access_review_asks_about_the_user_the_call_impersonates(
        tmp_path: Path, allowed: bool) -> None:
    """Where a policy lets Impersonate-* through, the apiserver authorizes the impersonated
    user (after checking the caller may impersonate): the review asks about that user, not the
    caller, who may well not list configmaps themselves (a 403 the apiserver never gives).
    Where the headers are stripped, the call runs as the caller, and the review asks so."""
    auth = FakeAuth()
    docs = (policy(sar=True), IMPERSONATING) if allowed else (policy(sar=True),)
    check, policies = IdentityCheck(authenticator=auth), policy_set(tmp_path, *docs)
    ctx = ctx_for(policies, "GET", CM + "/c", sa_token())
    ctx.headers = CIMultiDict([*ctx.headers.items(), ("Impersonate-User", "tenant"),
                               ("Impersonate-Group", "tenants"), ("Impersonate-Uid", "u-7"),
                               ("Impersonate-Extra-Scopes", "view")])
    auth.sar = (False, "")
    decision = run(check, ctx)
    assert decision is not None
    (attrs,) = auth.sar_attrs
    caller = "system:serviceaccount:ops:op"
    if allowed:
        assert {k: attrs[k] for k in ("user", "uid", "groups", "extra")} == {
            "user": "tenant", "uid": "u-7", "groups": ["tenants", "system:authenticated"],
            "extra": {"scopes": ["view"]}}
        assert body(decision)["message"].startswith(
            f'opgate: user "tenant" (impersonated by "{caller}") cannot get')
    else:
        assert (attrs["user"], attrs["uid"]) == (caller, "uid-1") and "extra" not in attrs
        assert body(decision)["message"].startswith(f'opgate: user "{caller}" cannot get')
    # the caller's own call is another question than the impersonated user's (cached apart)
    auth.sar = (True, "")
    denied = run(check, ctx_for(policies, "GET", CM + "/c", sa_token()))
    assert (denied is None, len(auth.sar_attrs)) == ((True, 2) if allowed else (False, 1))


OLD_ISSUER = "https://old-issuer.example.com"


class NoDiscovery(FakeAuth):
    async def cluster_issuer(self) -> str | None:
        return None  # its discovery failed (opgate retries later)


@pytest.mark.parametrize("auth", [FakeAuth, NoDiscovery])
@pytest.mark.parametrize(("aud", "allowed"), [("opgate", True), (ISSUER, False)])
def test_every_service_account_issuer_is_held_to_the_listed_audiences(
        tmp_path: Path, auth: type[FakeAuth], aud: str, allowed: bool) -> None:
    """A token of a second ``--service-account-issuer`` (which discovery does not name), or of
    the cluster's issuer while its discovery fails, is the apiserver's to judge, then held to
    ``kubernetes: {audiences: [...]}`` as a token opgate verified itself."""
    fake = auth()
    policies = policy_set(tmp_path, audience_policy("{audiences: [opgate]}"))
    iss = ISSUER if auth is NoDiscovery else OLD_ISSUER
    token = sa_token(aud=[aud], iss=iss)
    fake.reviews[token] = (SA, (aud,))
    ctx = ctx_for(policies, "GET", CM, token)
    decision = run(IdentityCheck(authenticator=fake), ctx)
    assert fake.calls == ["review"]
    if allowed:
        assert decision is None and ctx.identity == SA
        return
    assert decision is not None and body(decision)["code"] == 401
    assert "audience is not accepted" in body(decision)["message"]


def test_a_second_issuers_token_needs_the_kubernetes_issuer_listed(tmp_path: Path) -> None:
    """As a token of the discovered issuer: a policy that lists only an OIDC issuer refuses it,
    here beside a policy that lists ``kubernetes`` first."""
    auth = FakeAuth()
    policies = policy_set(tmp_path, policy(), OIDC_POLICY)
    for iss in (ISSUER, OLD_ISSUER):
        token = sa_token(iss=iss)
        auth.reviews[token] = (SA, (ISSUER,))
        decision = run(IdentityCheck(authenticator=auth), ctx_for(policies, "GET", CM, token))
        assert decision is not None and body(decision)["code"] == 401
        assert 'issuer is not one of policy "oidc"' in body(decision)["message"], iss


@pytest.mark.parametrize("others", [(), ("kubernetes",)], ids=["alone", "beside-kubernetes"])
def test_an_oidc_only_policy_refuses_a_service_account_token(tmp_path: Path,
                                                             others: tuple[str, ...]) -> None:
    """A policy that lists only an OIDC issuer refuses the cluster's service-account tokens
    whether or not another policy lists ``kubernetes``: the apiserver still judges the token
    (one TokenReview), and when it takes it for the ServiceAccount its claims name it is a
    ``kubernetes`` token. Alone, such a policy let it through as an opaque token's verdict, so
    whether an operator's token passed a policy depended on the other policies' issuers."""
    auth = FakeAuth()
    docs = (OIDC_POLICY, *(policy() for _ in others))
    policies = policy_set(tmp_path, *docs)
    for iss in (ISSUER, OLD_ISSUER):
        token = sa_token(iss=iss)
        auth.reviews[token] = (SA, (ISSUER,))
        ctx = ctx_for(policies, "GET", CM, token)
        decision = run(IdentityCheck(authenticator=auth), ctx)
        assert decision is not None and body(decision)["code"] == 401, iss
        assert 'issuer is not one of policy "oidc"' in body(decision)["message"], iss


def test_a_legacy_token_has_the_audiences_the_apiserver_gives_it(tmp_path: Path) -> None:
    """A Secret's token (issuer ``kubernetes/serviceaccount``, no ``aud``): the apiserver takes
    it for its own ``--api-audiences``, which TokenReview returns; listed audiences hold."""
    now = int(time.time())
    legacy = jwt.encode({"iss": "kubernetes/serviceaccount", "sub": SA.user,
                         "kubernetes.io/serviceaccount/namespace": "ops", "iat": now},
                        RSA_KEY, algorithm="RS256", headers={"kid": "k1"})
    for audiences, allowed in (("{audiences: [opgate]}", False), ("{}", True),
                               (f"{{audiences: [{ISSUER}]}}", True)):
        auth = FakeAuth()
        auth.reviews[legacy] = (SA, (ISSUER,))
        policies = policy_set(tmp_path, audience_policy(audiences))
        decision = run(IdentityCheck(authenticator=auth), ctx_for(policies, "GET", CM, legacy))
        assert (decision is None) is allowed, audiences


def test_an_other_users_review_of_a_service_account_shaped_jwt_is_the_apiservers(
        tmp_path: Path) -> None:
    """A JWT whose claims name a service account but that the apiserver takes as someone else
    (a webhook's token): not the cluster's issuer's, its verdict stands as the apiserver gave
    it."""
    auth = FakeAuth()
    token = sa_token(iss=OLD_ISSUER)
    admin = Identity(user="admin", groups=("system:masters",), source="tokenreview")
    auth.reviews[token] = (admin, ())
    policies = policy_set(tmp_path, audience_policy("{audiences: [opgate]}"))
    ctx = ctx_for(policies, "GET", CM, token)
    assert run(IdentityCheck(authenticator=auth), ctx) is None and ctx.identity == admin


def oidc_authenticator(served: list[dict[str, Any]],
                       fetched: list[str]) -> UpstreamAuthenticator:
    """The real authenticator, its fetch answering ``served[-1]`` as the provider's JWKS."""
    auth = UpstreamAuthenticator(UpstreamConfig(url="https://127.0.0.1:1"), retry_seconds=60)

    async def fetch(where: str, *, upstream: bool, accept: str) -> dict[str, Any]:
        fetched.append(where)
        if where.endswith("openid-configuration"):
            return {"issuer": IDP, "jwks_uri": "https://idp.example.com/jwks"}
        return served[-1]

    auth._fetch = fetch  # type: ignore[method-assign]
    return auth


def unnamed(public: Any) -> dict[str, Any]:
    """A JWK without ``kid`` (a provider with one signing key need not name it)."""
    return {k: v for k, v in jwk(public, "", "RS256").items() if k != "kid"}


STRANGER_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)  # nobody's


def signed(key: Any, kid: str | None, sub: str = "alice", alg: str = "RS256") -> str:
    """An OIDC token of ``IDP`` signed with ``key``, its header naming ``kid`` (or none)."""
    now = int(time.time())
    body = {"iss": IDP, "sub": sub, "aud": ["kubernetes"], "iat": now, "exp": now + 600}
    return jwt.encode(body, key, algorithm=alg, headers={"kid": kid} if kid else None)


@pytest.mark.parametrize("kid", [None, "k1"])
def test_a_key_replaced_under_the_same_kid_or_none_is_fetched_at_once(
        tmp_path: Path, kid: str | None) -> None:
    """A provider rotating its key without naming the new one differently (a JWKS of unnamed
    keys, or the same ``kid`` over a new key): the apiserver (go-oidc) fetches the JWKS again
    when no cached key verifies the signature, so the new key's tokens pass at once. opgate
    refused them (401) until its key set was 5 minutes old. The refetch is rate-limited as
    for an unknown kid: a forged signature right after costs no fetch."""
    served = [{"keys": [unnamed(RSA_KEY.public_key()) if kid is None
                        else jwk(RSA_KEY.public_key(), kid, "RS256")]}]
    fetched: list[str] = []
    auth = oidc_authenticator(served, fetched)
    check, policies = IdentityCheck(authenticator=auth), policy_set(tmp_path, OIDC_POLICY)
    assert run(check, ctx_for(policies, "GET", CM, signed(RSA_KEY, kid))) is None
    assert fetched.count("https://idp.example.com/jwks") == 1
    served.append({"keys": [unnamed(OTHER_KEY.public_key()) if kid is None
                            else jwk(OTHER_KEY.public_key(), kid, "RS256")]})
    auth._keysets[IDP].attempted -= 61  # a minute after the fetch: the key set is not stale
    decision = run(check, ctx_for(policies, "GET", CM, signed(OTHER_KEY, kid)))
    assert decision is None, body(decision)["message"]
    assert fetched.count("https://idp.example.com/jwks") == 2
    forged = signed(STRANGER_KEY, kid)
    decision = run(check, ctx_for(policies, "GET", CM, forged))
    assert decision is not None and body(decision)["code"] == 401
    assert fetched.count("https://idp.example.com/jwks") == 2  # within retry_seconds


def test_a_token_without_kid_waits_for_the_first_fetch_under_way(tmp_path: Path) -> None:
    """Two callers with tokens of a provider whose keys have no ``kid``, the second arriving
    while the first one's fetch (opgate's first) is under way: it waits for the keys, as a
    token with an unknown ``kid`` does; it was refused (401, "no signing key matches")."""
    fetched: list[str] = []
    auth = UpstreamAuthenticator(UpstreamConfig(url="https://127.0.0.1:1"), retry_seconds=60)

    async def go() -> list[Deny | None]:
        release, under_way = asyncio.Event(), asyncio.Event()

        async def fetch(where: str, *, upstream: bool, accept: str) -> dict[str, Any]:
            fetched.append(where)
            if where.endswith("openid-configuration"):
                return {"issuer": IDP, "jwks_uri": "https://idp.example.com/jwks"}
            under_way.set()
            await release.wait()  # the provider is slow to answer
            return {"keys": [unnamed(RSA_KEY.public_key())]}

        auth._fetch = fetch  # type: ignore[method-assign]
        check, policies = IdentityCheck(authenticator=auth), policy_set(tmp_path, OIDC_POLICY)
        first = asyncio.ensure_future(settle(check.entry(
            ctx_for(policies, "GET", CM, signed(RSA_KEY, None)))))
        await under_way.wait()
        second = asyncio.ensure_future(settle(check.entry(
            ctx_for(policies, "GET", CM, signed(RSA_KEY, None, sub="bob")))))
        for _ in range(50):  # the second call gets as far as it can
            await asyncio.sleep(0)
        release.set()
        return [await first, await second]  # type: ignore[list-item]

    assert asyncio.run(go()) == [None, None]
    assert fetched.count("https://idp.example.com/jwks") == 1


def test_keys_sharing_a_kid_are_each_tried(tmp_path: Path) -> None:
    """A JWKS with two keys under one ``kid`` (a provider that keeps the kid across a
    rotation and publishes both, or an RSA and an EC key named alike): go-oidc tries every key
    of the token's kid; opgate kept the last one only and refused the other's tokens (401)."""
    served = [{"keys": [jwk(RSA_KEY.public_key(), "k1", "RS256"),
                        jwk(OTHER_KEY.public_key(), "k1", "RS256"),
                        jwk(EC_KEY.public_key(), "k1", "ES256")]}]
    fetched: list[str] = []
    check = IdentityCheck(authenticator=oidc_authenticator(served, fetched))
    policies = policy_set(tmp_path, OIDC_POLICY)
    for key, alg in ((RSA_KEY, "RS256"), (OTHER_KEY, "RS256"), (EC_KEY, "ES256")):
        decision = run(check, ctx_for(policies, "GET", CM, signed(key, "k1", alg=alg)))
        assert decision is None, body(decision)["message"]
    assert fetched.count("https://idp.example.com/jwks") == 1


def test_a_stale_key_set_is_refreshed_without_holding_a_call_its_keys_verify(
        tmp_path: Path) -> None:
    """Once the key set is ``jwks_ttl`` old it is fetched again, but a token its keys verify
    does not wait for that (go-oidc tries the cached keys first): with a provider slow or
    black-holed (a fetch held up to the 10 s timeout, twice with discovery), a call with a new
    token of a known key was held that long, one every ``retry_seconds``. The refresh goes on
    meanwhile, and the keys it brings are used once it is done."""
    fetched: list[str] = []
    auth = UpstreamAuthenticator(UpstreamConfig(url="https://127.0.0.1:1"), retry_seconds=60)

    async def go() -> None:
        release = asyncio.Event()
        served = {"keys": [jwk(RSA_KEY.public_key(), "k1", "RS256")]}

        async def fetch(where: str, *, upstream: bool, accept: str) -> dict[str, Any]:
            fetched.append(where)
            if len(fetched) > 2:  # the refresh: the provider is slow now
                await release.wait()
            if where.endswith("openid-configuration"):
                return {"issuer": IDP, "jwks_uri": "https://idp.example.com/jwks"}
            return served

        auth._fetch = fetch  # type: ignore[method-assign]
        check, policies = IdentityCheck(authenticator=auth), policy_set(tmp_path, OIDC_POLICY)
        assert await settle(check.entry(ctx_for(policies, "GET", CM, signed(RSA_KEY, "k1"))))\
            is None
        keys = auth._keysets[IDP]
        keys.fetched -= 301  # five minutes on: stale
        keys.attempted -= 301
        async with asyncio.timeout(5):  # (it waited for release, which never came)
            decision = await settle(check.entry(
                ctx_for(policies, "GET", CM, signed(RSA_KEY, "k1", sub="bob"))))
        assert decision is None
        assert len(fetched) == 3  # the refresh is under way
        served = {"keys": [*served["keys"], jwk(OTHER_KEY.public_key(), "k2", "RS256")]}
        release.set()
        decision = await settle(check.entry(ctx_for(policies, "GET", CM,
                                                    signed(OTHER_KEY, "k2"))))
        assert decision is None  # waited for the refresh under way, which brought k2
        assert len(fetched) == 4
        await auth.close()

    asyncio.run(go())


def test_a_call_waiting_for_a_fetch_that_fails_does_not_start_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A provider that takes longer than ``retry_seconds`` to fail (answering nothing within
    the 10 s timeout): a call that waited for that fetch got the lock once it failed, found the
    last attempt ``retry_seconds`` old and fetched again itself, so it was held for two
    fetches (and the next waiter likewise), not one. It gets the outcome of the one it waited
    for: a 503 as soon as that fails."""
    from proxy.relay import authn
    from proxy.relay.authn import AuthnUnavailable

    late = [0.0]  # seconds the authenticator's clock is ahead (the loop's keeps time)
    monkeypatch.setattr(authn, "time", types.SimpleNamespace(
        monotonic=lambda: time.monotonic() + late[0]))
    fetched: list[str] = []
    auth = UpstreamAuthenticator(UpstreamConfig(url="https://127.0.0.1:1"), retry_seconds=60)

    async def go() -> list[Deny | None]:
        release, under_way = asyncio.Event(), asyncio.Event()

        async def fetch(where: str, *, upstream: bool, accept: str) -> dict[str, Any]:
            fetched.append(where)
            under_way.set()
            await release.wait()
            raise AuthnUnavailable(f"GET {where}: timed out")

        auth._fetch = fetch  # type: ignore[method-assign]
        check, policies = IdentityCheck(authenticator=auth), policy_set(tmp_path, OIDC_POLICY)
        first = asyncio.ensure_future(settle(check.entry(
            ctx_for(policies, "GET", CM, signed(RSA_KEY, "k1")))))
        await under_way.wait()
        second = asyncio.ensure_future(settle(check.entry(
            ctx_for(policies, "GET", CM, signed(RSA_KEY, "k1", sub="bob")))))
        for _ in range(50):  # the second call gets as far as it can: waiting for the fetch
            await asyncio.sleep(0)
        late[0] = 61  # the fetch takes longer than retry_seconds
        release.set()
        async with asyncio.timeout(5):  # (the second fetch never ended)
            return [await first, await second]  # type: ignore[list-item]

    decisions = asyncio.run(go())
    assert [d is not None and body(d)["code"] for d in decisions] == [503, 503]
    assert len(fetched) == 1
