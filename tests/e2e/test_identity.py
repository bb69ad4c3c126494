"""spec.identity against the real apiserver: TokenRequest tokens through a TLS opgate.

opgate discovers the cluster's service-account issuer and its JWKS through the upstream and
does TokenReviews and SubjectAccessReviews with its own credentials (``--token-file`` with the
admin token); each client's own token passes through to the apiserver, whose RBAC still applies.
"""

from __future__ import annotations

import base64
import json
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization

from proxy.envtest.binaries import KubeBinaries
from proxy.envtest.cluster import DEFAULT_ISSUER, LocalCluster
from tests.e2e.conftest import Opgate, start_opgate

NS = "idt"
CM = f"/api/v1/namespaces/{NS}/configmaps"
POLICY = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: identity-e2e}}
spec:
  mode: enforce
  identity:
    issuers:
      - kubernetes: {{}}
    allow:
      - serviceAccount: {ns}/allowed
      - group: "system:masters"
    rules:
      - {{name: read, verbs: [get, list, watch], resources: ["*"]}}
      - {{name: no-secrets, effect: deny, resources: [secrets]}}
      - {{name: write-configmaps, verbs: [create, update, patch, delete], apiGroups: [""],
         resources: [configmaps], namespaces: [{ns}]}}
    subjectAccessReview: {sar}
"""


@dataclass(frozen=True)
class Setup:
    allowed: str
    other: str
    wrong_audience: str
    token_file: str


@pytest.fixture(scope="module")
def setup(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Setup:
    rules = [{"apiGroups": [""], "resources": ["configmaps", "secrets"],
              "verbs": ["get", "list", "watch", "create", "delete"]}]
    cluster.create_service_account_with_rbac(NS, "allowed", rules)
    cluster.create_service_account_with_rbac(NS, "other", rules)
    token_file = tmp_path_factory.mktemp("identity") / "opgate-token"
    token_file.write_text(cluster.admin_token)
    token_file.chmod(0o600)
    return Setup(allowed=cluster.token_request(NS, "allowed"),
                 other=cluster.token_request(NS, "other"),
                 wrong_audience=cluster.token_request(NS, "allowed", audiences=["vault"]),
                 token_file=str(token_file))


def start(opgate_factory: Callable[..., Opgate], setup: Setup, *, sar: bool) -> Opgate:
    return opgate_factory(policies={"identity.yaml": POLICY.format(ns=NS, sar=str(sar).lower())},
                          extra_args=["--token-file", setup.token_file])


@pytest.fixture(scope="module")
def gate(opgate_factory: Callable[..., Opgate], setup: Setup) -> Opgate:
    return start(opgate_factory, setup, sar=False)


def status(resp: Any) -> dict[str, Any]:
    return dict(json.loads(resp.body))


def configmap(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name},
            "data": {"k": "v"}}


def test_the_allowed_service_account_passes_and_rbac_still_applies(
        cluster: LocalCluster, gate: Opgate, setup: Setup) -> None:
    listed = cluster.call("GET", CM, server=gate.url, token=setup.allowed)
    assert listed.status == 200, listed.body
    created = cluster.call("POST", CM, body=configmap("via-identity"), server=gate.url,
                           token=setup.allowed)
    assert created.status == 201, created.body
    # opgate's rules allow reading anywhere; the apiserver's RBAC does not
    elsewhere = cluster.call("GET", "/api/v1/namespaces/default/configmaps", server=gate.url,
                             token=setup.allowed)
    assert elsewhere.status == 403
    assert not status(elsewhere)["message"].startswith("opgate:")


def test_calls_outside_the_rules_are_refused_by_opgate(
        cluster: LocalCluster, gate: Opgate, setup: Setup) -> None:
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}}
    denied = cluster.call("POST", f"/api/v1/namespaces/{NS}/secrets", body=secret,
                          server=gate.url, token=setup.allowed)
    assert denied.status == 403
    got = status(denied)
    assert (got["kind"], got["reason"]) == ("Status", "Forbidden")
    assert got["message"].startswith("opgate: ")
    assert 'rule "no-secrets"' in got["message"]
    assert str(Path(gate.policies_dir) / "identity.yaml") in got["message"]
    no_rule = cluster.call("DELETE", f"/api/v1/namespaces/{NS}", server=gate.url,
                           token=setup.allowed)
    assert no_rule.status == 403
    assert "no rule of policy" in status(no_rule)["message"]
    assert "identity.yaml" in status(no_rule)["message"]


def test_a_service_account_not_in_allow_is_refused(
        cluster: LocalCluster, gate: Opgate, setup: Setup) -> None:
    denied = cluster.call("GET", CM, server=gate.url, token=setup.other)
    assert denied.status == 403
    assert (f'user "system:serviceaccount:{NS}:other" is not allowed'
            in status(denied)["message"])
    assert cluster.call("GET", CM, token=setup.other).status == 200  # RBAC alone would allow it


@pytest.mark.parametrize("which", ["none", "garbage", "wrong_audience"])
def test_missing_and_invalid_tokens_are_401(
        cluster: LocalCluster, gate: Opgate, setup: Setup, which: str) -> None:
    token = {"none": "", "garbage": "not-a-token",
             "wrong_audience": setup.wrong_audience}[which]
    resp = cluster.call("GET", CM, server=gate.url, token=token)
    assert resp.status == 401, resp.body
    got = status(resp)
    assert (got["kind"], got["reason"], got["code"]) == ("Status", "Unauthorized", 401)
    if token:
        assert token not in resp.body.decode()
        assert token not in gate.log_tail(400)


def test_an_opaque_token_is_checked_by_tokenreview(
        cluster: LocalCluster, gate: Opgate) -> None:
    # the static admin token is no JWT: the apiserver vouches for it (group system:masters)
    resp = cluster.call("GET", f"/api/v1/namespaces/{NS}/secrets", server=gate.url)
    assert resp.status == 200, resp.body
    assert cluster.admin_token not in gate.log_tail(400)


def test_denials_are_counted(gate: Opgate, cluster: LocalCluster, setup: Setup) -> None:
    cluster.call("GET", CM, server=gate.url, token=setup.other)
    code, text = gate.admin_get("/metrics")
    assert code == 200
    assert 'opgate_identity_denials_total{reason="not_allowed"}' in text


def test_subject_access_review_denies_what_rbac_denies(
        cluster: LocalCluster, opgate_factory: Callable[..., Opgate], setup: Setup) -> None:
    gate = start(opgate_factory, setup, sar=True)
    assert cluster.call("GET", CM, server=gate.url, token=setup.allowed).status == 200
    denied = cluster.call("GET", "/api/v1/namespaces/default/configmaps", server=gate.url,
                          token=setup.allowed)
    assert denied.status == 403
    message = status(denied)["message"]
    assert message.startswith("opgate: ") and "the apiserver denies it" in message
    assert "subjectAccessReview" in message and "identity.yaml" in message


def resigned(cluster: LocalCluster, token: str, **changes: Any) -> str:
    """``token`` with some claims changed, signed again with the cluster's own key (what an
    apiserver with another clock or another ``--service-account-issuer`` would have minted)."""
    head, claims = (json.loads(base64.urlsafe_b64decode(part + "=="))
                    for part in token.split(".")[:2])
    key = serialization.load_pem_private_key((cluster.workdir / "pki" / "sa.key").read_bytes(),
                                             None)
    return jwt.encode({**claims, **changes}, key, algorithm="RS256",
                      headers={"kid": head["kid"]})


@pytest.mark.parametrize("offsets", [{"nbf": 45, "iat": 45}, {"nbf": 90, "iat": 90},
                                     {"exp": -45}, {"exp": -90}],
                         ids=["ahead-45s", "ahead-90s", "expired-45s", "expired-90s"])
def test_time_claims_are_read_as_the_apiserver_reads_them(
        cluster: LocalCluster, gate: Opgate, setup: Setup, offsets: dict[str, int]) -> None:
    """Tokens of the cluster's own key as an apiserver whose clock runs ahead of the node's
    mints them, or read after their exp: opgate accepts what the apiserver accepts (a minute of
    leeway either way) and refuses what it refuses."""
    now = int(time.time())
    token = resigned(cluster, setup.allowed, **{
        "iat": now, "nbf": now, "exp": now + 600, "jti": str(uuid.uuid4()),
        **{claim: now + offset for claim, offset in offsets.items()}})
    direct = cluster.call("GET", CM, token=token).status  # the reference
    assert direct in (200, 401)
    through = cluster.call("GET", CM, server=gate.url, token=token)
    assert through.status == direct, through.body


def test_a_token_of_another_api_audience_passes_as_the_apiserver_lets_it(
        kube_binaries: KubeBinaries, tmp_path: Path) -> None:
    """An apiserver with ``--api-audiences`` beyond its issuer (an istio-ca, a platform's own):
    a TokenRequest for one of them is a token the apiserver accepts, and so does opgate (it
    asks the apiserver about an audience it does not know); another audience stays a 401."""
    with LocalCluster(binaries=kube_binaries, extra_apiserver_args=(
            f"--api-audiences={DEFAULT_ISSUER},extra-aud",)) as cluster:
        rules = [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}]
        cluster.create_service_account_with_rbac(NS, "allowed", rules)
        token_file = tmp_path / "opgate-token"
        token_file.write_text(cluster.admin_token)
        token_file.chmod(0o600)
        gate = start_opgate(cluster, tmp_path / "opgate", policies={
            "identity.yaml": POLICY.format(ns=NS, sar="false")},
            extra_args=["--token-file", str(token_file)])
        try:
            for audience, code in (("extra-aud", 200), ("vault", 401)):
                token = cluster.token_request(NS, "allowed", audiences=[audience])
                assert cluster.call("GET", CM, token=token).status == code  # the reference
                through = cluster.call("GET", CM, server=gate.url, token=token)
                assert through.status == code, through.body
        finally:
            gate.stop()


OLD_ISSUER = "https://old-issuer.example.com"


def test_a_token_of_a_second_issuer_is_held_to_the_listed_audiences(
        kube_binaries: KubeBinaries, tmp_path: Path) -> None:
    """An apiserver migrating issuers (a second ``--service-account-issuer``: it signs as the
    first and accepts both) takes a token of either; ``kubernetes: {audiences: [opgate]}``
    holds for both alike: a token of another audience is a 401, whichever issuer minted it."""
    with LocalCluster(binaries=kube_binaries, extra_apiserver_args=(
            f"--service-account-issuer={OLD_ISSUER}",
            f"--api-audiences={DEFAULT_ISSUER},opgate")) as cluster:
        rules = [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}]
        cluster.create_service_account_with_rbac(NS, "allowed", rules)
        token_file = tmp_path / "opgate-token"
        token_file.write_text(cluster.admin_token)
        token_file.chmod(0o600)
        policy = POLICY.format(ns=NS, sar="false").replace(
            "- kubernetes: {}", "- kubernetes: {audiences: [opgate]}")
        gate = start_opgate(cluster, tmp_path / "opgate", policies={"identity.yaml": policy},
                            extra_args=["--token-file", str(token_file)])
        try:
            for audience, code in (("opgate", 200), (DEFAULT_ISSUER, 401)):
                new = cluster.token_request(NS, "allowed", audiences=[audience])
                for token in (new, resigned(cluster, new, iss=OLD_ISSUER)):
                    assert cluster.call("GET", CM, token=token).status == 200  # the reference
                    through = cluster.call("GET", CM, server=gate.url, token=token)
                    assert through.status == code, (audience, token == new, through.body)
        finally:
            gate.stop()


OIDC_ONLY_POLICY = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {name: humans-only}
spec:
  identity:
    issuers: [{oidc: {issuer: "https://idp.example.com", audiences: [kubernetes]}}]
    allow: [{group: "system:authenticated"}]
    rules: [{verbs: ["*"], resources: ["*"]}]
"""


def test_a_policy_of_oidc_issuers_only_refuses_service_account_tokens(
        cluster: LocalCluster, opgate_factory: Callable[..., Opgate], setup: Setup) -> None:
    """``issuers`` says whose tokens a policy accepts: one listing only an OIDC provider
    refuses a ServiceAccount's TokenRequest token (the apiserver takes it: a 401 of opgate's
    naming the issuer), as it does when another policy lists ``kubernetes``; the static admin
    token, opaque, stays the apiserver's to judge."""
    gate = opgate_factory(policies={"humans.yaml": OIDC_ONLY_POLICY},
                          extra_args=["--token-file", setup.token_file])
    assert cluster.call("GET", CM, token=setup.allowed).status == 200  # the reference
    through = cluster.call("GET", CM, server=gate.url, token=setup.allowed)
    assert through.status == 401, through.body
    assert 'issuer is not one of policy "humans-only"' in status(through)["message"]
    assert cluster.call("GET", CM, server=gate.url).status == 200  # the admin's opaque token


IMPERSONATION_POLICY = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: impersonation-e2e}}
spec:
  allowImpersonation: true
  identity:
    issuers: [{{kubernetes: {{}}}}]
    allow: [{{serviceAccount: {ns}/impersonator}}]
    rules: [{{verbs: [get, list], resources: [configmaps]}}]
    subjectAccessReview: true
"""


def test_a_subject_access_review_asks_about_the_impersonated_user(
        cluster: LocalCluster, opgate_factory: Callable[..., Opgate], setup: Setup) -> None:
    """A ServiceAccount that may impersonate `tenant` (who may list configmaps) and may not list
    them itself: the apiserver serves its impersonating call (it authorizes `tenant`), so does
    opgate, whose review asks about `tenant` too; impersonating `nobody` is refused by both."""
    rbac = "rbac.authorization.k8s.io/v1"
    cluster.create_service_account_with_rbac(NS, "impersonator", [
        {"apiGroups": [""], "resources": ["users"], "verbs": ["impersonate"],
         "resourceNames": ["tenant", "nobody"]}], cluster_wide=True)
    cluster.apply({"apiVersion": rbac, "kind": "Role",
                   "metadata": {"name": "tenant-reads", "namespace": NS},
                   "rules": [{"apiGroups": [""], "resources": ["configmaps"],
                              "verbs": ["list"]}]})
    cluster.apply({"apiVersion": rbac, "kind": "RoleBinding",
                   "metadata": {"name": "tenant-reads", "namespace": NS},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                               "name": "tenant-reads"},
                   "subjects": [{"kind": "User", "name": "tenant",
                                 "apiGroup": "rbac.authorization.k8s.io"}]})
    token = cluster.token_request(NS, "impersonator")
    gate = opgate_factory(policies={"impersonation.yaml": IMPERSONATION_POLICY.format(ns=NS)},
                          extra_args=["--token-file", setup.token_file])
    as_tenant = {"Impersonate-User": "tenant"}
    assert cluster.call("GET", CM, token=token).status == 403  # not the ServiceAccount itself
    assert cluster.call("GET", CM, token=token, headers=as_tenant).status == 200
    served = cluster.call("GET", CM, server=gate.url, token=token, headers=as_tenant)
    assert served.status == 200, served.body
    for server in (None, gate.url):
        refused = cluster.call("GET", CM, server=server, token=token,
                               headers={"Impersonate-User": "nobody"})
        assert refused.status == 403, refused.body
    message = status(refused)["message"]
    assert message.startswith('opgate: user "nobody" (impersonated by '
                              f'"system:serviceaccount:{NS}:impersonator") cannot list'), message


NODE_POLICY = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: node-e2e}}
spec:
  allowImpersonation: true
  identity:
    issuers: [{{kubernetes: {{}}}}]
    allow: [{{serviceAccount: {ns}/node-agent}}]
    rules: [{{verbs: [list, watch], resources: [pods]}}]
    subjectAccessReview: true
"""


def test_a_subject_access_review_carries_the_field_selector_the_node_authorizer_reads(
        cluster: LocalCluster, opgate_factory: Callable[..., Opgate], setup: Setup) -> None:
    """The apiserver's Node authorizer lets a node list the pods bound to it and no others: it
    decides by the list's ``fieldSelector=spec.nodeName=<node>``. Calls made as a node (here
    impersonated) are served by opgate as by the apiserver, with the selector, and refused by
    both without it; opgate's review lacked the selector, so it refused both."""
    cluster.create_service_account_with_rbac(NS, "node-agent", [
        {"apiGroups": [""], "resources": ["users"], "verbs": ["impersonate"],
         "resourceNames": ["system:node:n1"]},
        {"apiGroups": [""], "resources": ["groups"], "verbs": ["impersonate"],
         "resourceNames": ["system:nodes"]}], cluster_wide=True)
    token = cluster.token_request(NS, "node-agent")
    gate = opgate_factory(policies={"node.yaml": NODE_POLICY.format(ns=NS)},
                          extra_args=["--token-file", setup.token_file])
    as_node = {"Impersonate-User": "system:node:n1", "Impersonate-Group": "system:nodes"}
    for query, code in (("?fieldSelector=spec.nodeName%3Dn1", 200),
                        ("?fieldSelector=spec.nodeName%3Dn1&watch=1&timeoutSeconds=1", 200),
                        ("", 403), ("?fieldSelector=spec.nodeName%3Dn2", 403)):
        path = "/api/v1/pods" + query
        assert cluster.call("GET", path, token=token, headers=as_node).status == code  # the ref.
        through = cluster.call("GET", path, server=gate.url, token=token, headers=as_node)
        assert through.status == code, (query, through.body)
    assert "can only list/watch pods with spec.nodeName field selector" in (
        status(through)["message"])


PATHS_POLICY = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: paths-e2e}}
spec:
  identity:
    issuers: [{{kubernetes: {{}}}}]
    allow: [{{serviceAccount: {ns}/allowed}}]
    rules:
      - {{name: discovery, verbs: [get], nonResourceURLs: [/api, "/api/*", /apis, "/apis/*",
                                                          /version]}}
      - {{name: no-other-paths, effect: deny, nonResourceURLs: ["*"]}}
      - {{name: read, verbs: [get, list, watch], resources: ["*"]}}
"""


def test_non_resource_urls_narrow_what_rbac_lets_every_user_read(
        cluster: LocalCluster, opgate_factory: Callable[..., Opgate], setup: Setup,
        kubectl: Path, tmp_path: Path) -> None:
    """RBAC lets every authenticated user read /healthz, /livez and /version
    (system:public-info-viewer) and discovery (system:discovery); a rule with
    ``nonResourceURLs`` narrows that by path as the apiserver reads the path, and kubectl,
    whose discovery those rules allow, still works through opgate."""
    gate = opgate_factory(policies={"paths.yaml": PATHS_POLICY.format(ns=NS)},
                          extra_args=["--token-file", setup.token_file])
    for path, code in (("/version", 200), ("/apis/apps", 200), ("/healthz", 403),
                       ("/livez", 403)):
        assert cluster.call("GET", path, token=setup.allowed).status == 200  # RBAC allows it
        through = cluster.call("GET", path, server=gate.url, token=setup.allowed)
        assert through.status == code, through.body
        if code == 403:
            assert f'cannot get path "{path}": rule "no-other-paths"' in status(through)[
                "message"]
    config = cluster.write_kubeconfig(tmp_path / "kubeconfig", server=gate.url,
                                      token=setup.allowed, ca_file=cluster.ca_file)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(kubectl), "--kubeconfig", str(config), *args],
                              capture_output=True, text=True, timeout=60, check=False)

    listed = run("get", "configmaps", "-n", NS)  # discovery (/api, /apis) then a list
    assert listed.returncode == 0, listed.stderr
    refused = run("get", "--raw", "/healthz")
    assert refused.returncode != 0 and 'rule "no-other-paths"' in refused.stderr, refused.stderr
