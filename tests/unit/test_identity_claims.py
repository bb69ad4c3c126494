"""A verified token's claims → the caller (proxy.middlewares.identity_claims), as the
apiserver's service-account and OIDC authenticators name it."""

from __future__ import annotations

import pytest

from proxy.engine.context import Identity
from proxy.middlewares.identity_claims import identity_from_claims
from proxy.middlewares.identity_spec import KUBERNETES, Issuer

SA_CLAIMS = {"iss": "https://kubernetes.default.svc.cluster.local",
             "sub": "system:serviceaccount:ops:op",
             "kubernetes.io": {"namespace": "ops", "serviceaccount": {"name": "op", "uid": "u1"}}}


def test_service_account_claims() -> None:
    identity = identity_from_claims(Issuer(kind=KUBERNETES), "https://k", SA_CLAIMS)
    assert identity == Identity(
        user="system:serviceaccount:ops:op", uid="u1", source="serviceaccount",
        groups=("system:serviceaccounts", "system:serviceaccounts:ops", "system:authenticated"))


CRED = "authentication.kubernetes.io/credential-id"
POD_NAME, POD_UID = "authentication.kubernetes.io/pod-name", "authentication.kubernetes.io/pod-uid"
NODE_NAME = "authentication.kubernetes.io/node-name"
NODE_UID = "authentication.kubernetes.io/node-uid"


def _bound(**refs: object) -> dict[str, object]:
    return {**SA_CLAIMS, "jti": "j-1",
            "kubernetes.io": {**SA_CLAIMS["kubernetes.io"], **refs}}  # type: ignore[dict-item]


@pytest.mark.parametrize(("claims", "extra"), [
    (SA_CLAIMS, {}),  # no jti (a token of an apiserver before v1.29): none
    ({**SA_CLAIMS, "jti": "j-1"}, {CRED: ["JTI=j-1"]}),
    ({**SA_CLAIMS, "jti": ""}, {}),
    ({**SA_CLAIMS, "jti": 7}, {}),
    (_bound(pod={"name": "p", "uid": "pu"}),
     {CRED: ["JTI=j-1"], POD_NAME: ["p"], POD_UID: ["pu"]}),
    # a pod on a node: its node too (ServiceAccountTokenPodNodeInfo, GA in v1.32); a node
    # TokenRequest did not find has no uid in the token, so none in extra
    (_bound(pod={"name": "p", "uid": "pu"}, node={"name": "n", "uid": "nu"}),
     {CRED: ["JTI=j-1"], NODE_NAME: ["n"], NODE_UID: ["nu"], POD_NAME: ["p"], POD_UID: ["pu"]}),
    (_bound(pod={"name": "p", "uid": "pu"}, node={"name": "n"}),
     {CRED: ["JTI=j-1"], NODE_NAME: ["n"], POD_NAME: ["p"], POD_UID: ["pu"]}),
    (_bound(node={"name": "n", "uid": "nu"}), {CRED: ["JTI=j-1"], NODE_NAME: ["n"],
                                               NODE_UID: ["nu"]}),
    (_bound(secret={"name": "s", "uid": "su"}), {CRED: ["JTI=j-1"]}),
    (_bound(pod={"name": "p"}), {CRED: ["JTI=j-1"]}),  # the apiserver wants both
])
def test_service_account_extra_is_the_apiservers(claims: dict[str, object],
                                                  extra: dict[str, list[str]]) -> None:
    """``user.extra`` as kube-apiserver v1.35's service-account authenticator fills it
    (pkg/serviceaccount/claims.go, k8s.io/apiserver serviceaccount/util.go), keys sorted."""
    identity = identity_from_claims(Issuer(kind=KUBERNETES), "https://k", claims)
    assert identity is not None
    assert identity.extra == tuple((k, tuple(v)) for k, v in extra.items())
    assert [k for k, _ in identity.extra] == sorted(extra)


@pytest.mark.parametrize(("jti", "extra"), [
    ("abc", ((CRED, ("JTI=abc",)),)), ("", ()), (None, ()), (5, ()), (["abc"], ())])
def test_oidc_extra_is_the_credential_id(jti: object, extra: object) -> None:
    """The apiserver's OIDC authenticator adds only the credential id of a string ``jti``
    (without an AuthenticationConfiguration's CEL ``extra`` mappings, which opgate has not)."""
    issuer = Issuer(kind="oidc", url="https://dex")
    claims = {"sub": "1"} if jti is None else {"sub": "1", "jti": jti}
    identity = identity_from_claims(issuer, issuer.url, claims)
    assert identity is not None and identity.extra == extra


@pytest.mark.parametrize("claims", [
    {"sub": "alice"},
    {"sub": "system:serviceaccount:ops"},
    {**SA_CLAIMS, "kubernetes.io": {"namespace": "other",
                                    "serviceaccount": {"name": "op", "uid": "u1"}}},
])
def test_service_account_claims_that_name_nobody(claims: dict[str, object]) -> None:
    assert identity_from_claims(Issuer(kind=KUBERNETES), "https://k", claims) is None


@pytest.mark.parametrize(("issuer", "claims", "user", "groups"), [
    (Issuer(kind="oidc", url="https://dex"), {"sub": "123"}, "https://dex#123",
     ("system:authenticated",)),
    (Issuer(kind="oidc", url="https://dex", username_claim="email"),
     {"sub": "1", "email": "a@b.c"}, "a@b.c", ("system:authenticated",)),
    (Issuer(kind="oidc", url="https://dex", username_prefix="dex:", groups_claim="groups",
            groups_prefix="dex:"), {"sub": "1", "groups": ["ops", "dev"]}, "dex:1",
     ("dex:ops", "dex:dev", "system:authenticated")),
    (Issuer(kind="oidc", url="https://dex", username_prefix="-", groups_claim="groups"),
     {"sub": "1", "groups": "ops"}, "1", ("ops", "system:authenticated")),
])
def test_oidc_claims(issuer: Issuer, claims: dict[str, object], user: str,
                     groups: tuple[str, ...]) -> None:
    identity = identity_from_claims(issuer, issuer.url, claims)
    assert identity is not None
    assert (identity.user, identity.groups, identity.source) == (user, groups, "oidc")


@pytest.mark.parametrize("verified", [False, "false", "true", None, 1])
def test_unverified_email_names_nobody(verified: object) -> None:
    """As the apiserver: an ``email_verified`` claim, when present, must be the JSON true."""
    issuer = Issuer(kind="oidc", url="https://dex", username_claim="email")
    assert identity_from_claims(issuer, "https://dex",
                                {"email": "a@b.c", "email_verified": verified}) is None
    assert identity_from_claims(issuer, "https://dex",
                                {"email": "a@b.c", "email_verified": True}) is not None


@pytest.mark.parametrize("groups", [[1, "ops"], {"ops": True}, 5, True])
def test_a_groups_claim_of_another_type_names_nobody(groups: object) -> None:
    """As the apiserver: the groups claim is a string or a list of strings (or absent, or
    null); anything else refuses the token rather than dropping the groups it cannot read."""
    issuer = Issuer(kind="oidc", url="https://dex", groups_claim="groups")
    assert identity_from_claims(issuer, "https://dex", {"sub": "1", "groups": groups}) is None
    for fine in ("ops", ["ops"], [], None):
        assert identity_from_claims(issuer, "https://dex", {"sub": "1", "groups": fine})
