"""Hostile and odd bearer tokens through a TLS opgate, with the real apiserver as the reference.

Each token is sent to the apiserver directly and through opgate: where the apiserver refuses it
(401), opgate refuses it too, with its own ``Status``, and without writing the token (or a
sizeable piece of it) to its debug-level log.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from proxy.envtest.binaries import KubeBinaries
from proxy.envtest.cluster import LocalCluster
from tests.e2e.conftest import Opgate, start_opgate

NS = "idq"
CM = f"/api/v1/namespaces/{NS}/configmaps"
POLICY = f"""\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: identity-attacks}}
spec:
  identity:
    issuers:
      - kubernetes: {{}}
    allow:
      - serviceAccount: {NS}/op
    rules:
      - {{name: read, verbs: [get, list, watch], resources: ["*"]}}
"""
ATTACKER = rsa.generate_private_key(public_exponent=65537, key_size=2048)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def parts(token: str) -> tuple[dict[str, Any], dict[str, Any]]:
    head, body, _sig = token.split(".")
    return (json.loads(base64.urlsafe_b64decode(head + "==")),
            json.loads(base64.urlsafe_b64decode(body + "==")))


def assemble(header: dict[str, Any], claims: Any, sig: bytes = b"") -> str:
    return f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}.{b64(sig)}"


@pytest.fixture(scope="module")
def good(cluster: LocalCluster) -> str:
    cluster.create_service_account_with_rbac(NS, "op", [
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}])
    return cluster.token_request(NS, "op")


@pytest.fixture(scope="module")
def gate(opgate_factory: Callable[..., Opgate], cluster: LocalCluster,
         tmp_path_factory: pytest.TempPathFactory) -> Opgate:
    token_file = tmp_path_factory.mktemp("idq") / "opgate-token"
    token_file.write_text(cluster.admin_token)
    token_file.chmod(0o600)
    return opgate_factory(policies={"identity.yaml": POLICY},
                          extra_args=["--token-file", str(token_file), "--log-level", "debug"])


def hostile(cluster: LocalCluster, good: str) -> dict[str, str]:
    """Tokens an attacker can make, given a real token (its header, claims) and the JWKS."""
    header, claims = parts(good)
    jwks = cluster.call("GET", "/openid/v1/jwks", headers={"Accept": "application/jwk-set+json"})
    assert jwks.status == 200, jwks.body
    public = jwt.PyJWK.from_dict(json.loads(jwks.body)["keys"][0]).key
    pem = public.public_bytes(serialization.Encoding.PEM,
                              serialization.PublicFormat.SubjectPublicKeyInfo)
    hs_header = {**header, "alg": "HS256"}
    signing = assemble(hs_header, claims).rsplit(".", 1)[0].encode()
    now = int(time.time())
    return {
        "alg none": assemble({**header, "alg": "none"}, claims),
        "HS256 keyed with the public key": assemble(
            hs_header, claims, hmac.new(pem, signing, hashlib.sha256).digest()),
        "the cluster's kid, another key": jwt.encode(claims, ATTACKER, algorithm="RS256",
                                                     headers={"kid": header["kid"]}),
        "an unknown kid": jwt.encode(claims, ATTACKER, algorithm="RS256",
                                     headers={"kid": "not-a-cluster-kid"}),
        "another cluster's issuer": jwt.encode({**claims, "iss": "https://other.example"},
                                               ATTACKER, algorithm="RS256"),
        "expired (forged)": jwt.encode({**claims, "exp": now - 3600}, ATTACKER, algorithm="RS256",
                              headers={"kid": header["kid"]}),
        "another audience (same signature)": assemble(header, {**claims, "aud": ["vault"]},
                                                      base64.urlsafe_b64decode(
                                                          good.split(".")[2] + "==")),
        "bad base64": good[:40] + "!!!" + good[43:],
        "bad JSON": f"{b64(b'{not json')}.{b64(b'{}')}.{b64(b'x')}",
        "claims not an object": assemble(header, ["a", "b"], b"x"),
        "huge": good + "A" * 200_000,
    }


CASES = ["alg none", "HS256 keyed with the public key", "the cluster's kid, another key",
         "an unknown kid", "another cluster's issuer", "expired (forged)",
         "another audience (same signature)", "bad base64", "bad JSON", "claims not an object"]


@pytest.mark.parametrize("case", CASES)
def test_a_hostile_token_is_refused_like_the_apiserver_does(
        cluster: LocalCluster, gate: Opgate, good: str, case: str) -> None:
    token = hostile(cluster, good)[case]
    assert cluster.call("GET", CM, token=token).status == 401  # the reference
    resp = cluster.call("GET", CM, server=gate.url, token=token)
    assert resp.status == 401, resp.body
    got = json.loads(resp.body)
    assert (got["kind"], got["reason"], got["code"]) == ("Status", "Unauthorized", 401)
    assert got["message"].startswith("opgate: ") and "identity.yaml" in got["message"]
    log = gate.log_tail(2000)
    for part in {token, *token.split(".")}:
        if len(part) > 30:
            assert part not in log and part not in got["message"]
    assert cluster.call("GET", CM, server=gate.url, token=good).status == 200


def test_a_huge_token_is_refused(cluster: LocalCluster, gate: Opgate, good: str) -> None:
    token = hostile(cluster, good)["huge"]
    resp = cluster.call("GET", CM, server=gate.url, token=token)
    assert resp.status == 431, resp.body  # opgate's header limit (64 KiB), a Status
    assert json.loads(resp.body)["reason"] == "RequestHeaderFieldsTooLarge"
    assert token[-1000:] not in gate.log_tail(2000)
    assert cluster.call("GET", CM, server=gate.url, token=good).status == 200


def test_the_good_token_is_not_logged_at_debug(gate: Opgate, cluster: LocalCluster,
                                               good: str, tmp_path: Path) -> None:
    assert cluster.call("GET", CM, server=gate.url, token=good).status == 200
    assert " DEBUG opgate." in gate.log_tail(2000)  # the log is at debug level
    for part in good.split("."):
        assert part not in gate.log_tail(2000)


def test_a_signing_key_rotation_needs_no_opgate_restart(
        kube_binaries: KubeBinaries, tmp_path: Path) -> None:
    """The apiserver restarted with a new service-account signing key (its own cluster: the
    session's keeps its key): tokens of the old key are refused, by the apiserver and through
    opgate, and tokens of the new key pass opgate at once (it fetches the new JWKS, or asks
    the apiserver when it fetched them too recently to fetch again)."""
    with LocalCluster(binaries=kube_binaries) as cluster:
        cluster.create_service_account_with_rbac(NS, "op", [
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}])
        token_file = tmp_path / "opgate-token"
        token_file.write_text(cluster.admin_token)
        token_file.chmod(0o600)
        gate = start_opgate(cluster, tmp_path / "opgate", policies={"identity.yaml": POLICY},
                            extra_args=["--token-file", str(token_file)])
        try:
            old = cluster.token_request(NS, "op")
            assert cluster.call("GET", CM, server=gate.url, token=old).status == 200
            key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            pki = cluster.workdir / "pki"
            (pki / "sa.key").write_bytes(key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption()))
            (pki / "sa.pub").write_bytes(key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
            cluster.restart_apiserver()
            new = cluster.token_request(NS, "op")
            assert parts(new)[0]["kid"] != parts(old)[0]["kid"]
            assert cluster.call("GET", CM, token=old).status == 401  # the reference
            assert cluster.call("GET", CM, server=gate.url, token=old).status == 401
            # at once: opgate fetches the new keys, or, having fetched them less than
            # retry_seconds before (10 s), asks the apiserver (a TokenReview)
            got = cluster.call("GET", CM, server=gate.url, token=new)
            assert got.status == 200, got.body
            assert gate.proc.alive()
            other = cluster.token_request(NS, "op")  # another token of the new key: no wait
            assert cluster.call("GET", CM, server=gate.url, token=other).status == 200
        finally:
            gate.stop()
