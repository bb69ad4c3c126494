"""An OIDC issuer, with the real apiserver (``--oidc-*`` flags) as the reference.

The provider is a fake (no real one is available): discovery and JWKS over HTTPS on loopback,
under a CA of its own that the apiserver (``--oidc-ca-file``) and opgate (``SSL_CERT_FILE``)
trust. Its issuer ends with a slash, as some providers' do (Auth0's): the token's ``iss`` must
equal it exactly, for the apiserver and for opgate.
"""

from __future__ import annotations

import http.server
import json
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from proxy.envtest import pki
from proxy.envtest.binaries import KubeBinaries
from proxy.envtest.cluster import LocalCluster
from tests.e2e.conftest import Opgate, start_opgate

KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
REVIEW = "/apis/authentication.k8s.io/v1/selfsubjectreviews"
POLICY = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: oidc}}
spec:
  identity:
    issuers:
      - oidc: {{issuer: "{issuer}", audiences: [kubernetes], claims: {{groups: groups}}}}
    allow:
      - user: "{issuer}#alice"
    rules:
      - {{verbs: [create], apiGroups: [authentication.k8s.io], resources: [selfsubjectreviews]}}
"""


class FakeIdp:
    """OIDC discovery + JWKS over HTTPS on 127.0.0.1 (a thread of this process)."""

    def __init__(self, cert: Path, key: Path) -> None:
        idp = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if idp.down:  # starting, or behind a load balancer with no backend yet
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                docs = {"/.well-known/openid-configuration": idp.discovery(),
                        "/jwks": {"keys": [idp.jwk()]}}
                doc = docs.get(self.path)
                body = json.dumps(doc).encode()
                self.send_response(200 if doc is not None else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.down = False
        self.key, self.kid = KEY, "idp1"  # its signing key, and the kid naming it (or none)
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(cert), str(key))
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.issuer = f"https://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def discovery(self) -> dict[str, Any]:
        return {"issuer": self.issuer, "jwks_uri": f"{self.issuer}jwks",
                "authorization_endpoint": f"{self.issuer}auth",
                "token_endpoint": f"{self.issuer}token", "response_types_supported": ["code"],
                "subject_types_supported": ["public"],
                "id_token_signing_alg_values_supported": ["RS256"]}

    def jwk(self) -> dict[str, Any]:
        public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.key.public_key()))
        return {**public, **({"kid": self.kid} if self.kid else {}), "alg": "RS256",
                "use": "sig"}

    def token(self, **claims: Any) -> str:
        now = int(time.time())
        body = {"iss": self.issuer, "sub": "alice", "aud": "kubernetes", "iat": now,
                "exp": now + 600, "groups": ["devs"], **claims}
        return jwt.encode(body, self.key, algorithm="RS256",
                          headers={"kid": self.kid} if self.kid else None)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def idp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeIdp, Path]]:
    files = pki.write_pki(tmp_path_factory.mktemp("idp-pki"))
    fake = FakeIdp(files.serving_cert, files.serving_key)
    try:
        yield fake, files.ca_cert
    finally:
        fake.stop()


@pytest.fixture(scope="module")
def oidc_cluster(kube_binaries: KubeBinaries,
                 idp: tuple[FakeIdp, Path]) -> Iterator[LocalCluster]:
    fake, ca = idp
    with LocalCluster(binaries=kube_binaries, extra_apiserver_args=(
            f"--oidc-issuer-url={fake.issuer}", "--oidc-client-id=kubernetes",
            f"--oidc-ca-file={ca}", "--oidc-groups-claim=groups")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def gate(oidc_cluster: LocalCluster, idp: tuple[FakeIdp, Path],
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Opgate]:
    fake, ca = idp
    work = tmp_path_factory.mktemp("oidc-gate")
    token_file = work / "opgate-token"  # opgate's own (TokenReviews)
    token_file.write_text(oidc_cluster.admin_token)
    token_file.chmod(0o600)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SSL_CERT_FILE", str(ca))  # opgate's process inherits it: trusts the fake
        started = start_opgate(oidc_cluster, work / "opgate",
                               policies={"oidc.yaml": POLICY.format(issuer=fake.issuer)},
                               extra_args=["--token-file", str(token_file)])
    try:
        yield started
    finally:
        started.stop()


def review(cluster: LocalCluster, token: str, server: str | None = None) -> Any:
    body = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
    return cluster.call("POST", REVIEW, body=body, token=token, server=server)


def accepted_by_the_apiserver(cluster: LocalCluster, fake: FakeIdp) -> None:
    """Wait until the apiserver takes the IdP's tokens (it fetches the discovery and keys on
    its own time): the reference the tests compare opgate with."""
    good = fake.token()
    deadline = time.monotonic() + 60
    while review(cluster, good).status != 201:
        assert time.monotonic() < deadline
        time.sleep(0.5)


def test_a_token_of_an_issuer_with_a_trailing_slash(
        oidc_cluster: LocalCluster, gate: Opgate, idp: tuple[FakeIdp, Path]) -> None:
    fake, _ca = idp
    token = fake.token()
    deadline = time.monotonic() + 60  # the apiserver fetches the provider's keys on its own
    while (direct := review(oidc_cluster, token)).status != 201:
        assert direct.status == 401 and time.monotonic() < deadline, direct.body
        time.sleep(0.5)
    user = json.loads(direct.body)["status"]["userInfo"]
    assert user["username"] == f"{fake.issuer}#alice"
    through = review(oidc_cluster, token, server=gate.url)  # opgate's allow names that user
    assert through.status == 201, through.body
    assert json.loads(through.body)["status"]["userInfo"]["username"] == user["username"]
    log = gate.log.read_text()
    assert f"keys of issuer {fake.issuer}: 1" in log  # verified by opgate, not a TokenReview


def test_a_groups_claim_the_apiserver_refuses(
        oidc_cluster: LocalCluster, gate: Opgate, idp: tuple[FakeIdp, Path]) -> None:
    fake, _ca = idp
    accepted_by_the_apiserver(oidc_cluster, fake)
    token = fake.token(groups=["devs", 7])
    assert review(oidc_cluster, token).status == 401  # the reference
    through = review(oidc_cluster, token, server=gate.url)
    assert through.status == 401, through.body
    assert "opgate: " in json.loads(through.body)["message"]
    assert "claims name no oidc user" in json.loads(through.body)["message"]


@pytest.mark.parametrize("offsets", [{"iat": 120}, {"nbf": 45}, {"nbf": 90}, {"exp": -5}],
                         ids=["iat+120", "nbf+45", "nbf+90", "exp-5"])
def test_time_claims_are_read_as_the_apiserver_reads_them(
        oidc_cluster: LocalCluster, gate: Opgate, idp: tuple[FakeIdp, Path],
        offsets: dict[str, int]) -> None:
    """A provider whose clock runs ahead of the node's (iat, nbf in the future), a token just
    expired: opgate accepts what the apiserver accepts and refuses what it refuses."""
    fake, _ca = idp
    accepted_by_the_apiserver(oidc_cluster, fake)
    now = int(time.time())
    token = fake.token(**{claim: now + offset for claim, offset in offsets.items()})
    direct = review(oidc_cluster, token).status  # the reference
    assert direct in (201, 401)
    through = review(oidc_cluster, token, server=gate.url)
    assert through.status == direct, through.body


def test_a_provider_not_answering_yet_is_a_503_not_a_401(
        oidc_cluster: LocalCluster, idp: tuple[FakeIdp, Path], tmp_path: Path) -> None:
    """A provider that does not answer its discovery when opgate starts (down, or a mesh not
    ready yet), while the apiserver, which fetched its keys before, takes its tokens: opgate
    cannot verify them, which says nothing about them, so the answer is a 503 with
    Retry-After (client-go waits and retries), not a 401 calling a good token bad; once the
    provider answers (opgate asks again 10 s later), the same token passes."""
    fake, ca = idp
    accepted_by_the_apiserver(oidc_cluster, fake)  # the apiserver has the keys: the reference
    token_file = tmp_path / "opgate-token"
    token_file.write_text(oidc_cluster.admin_token)
    token_file.chmod(0o600)
    fake.down = True
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SSL_CERT_FILE", str(ca))
            started = start_opgate(oidc_cluster, tmp_path / "opgate",
                                   policies={"oidc.yaml": POLICY.format(issuer=fake.issuer)},
                                   extra_args=["--token-file", str(token_file)])
        try:
            token = fake.token()
            assert review(oidc_cluster, token).status == 201
            through = review(oidc_cluster, token, server=started.url)
            assert through.status == 503, through.body
            assert through.headers.get("Retry-After") == "1"
            assert json.loads(through.body)["reason"] == "ServiceUnavailable"
            fake.down = False
            deadline = time.monotonic() + 30
            while (through := review(oidc_cluster, token, server=started.url)).status == 503:
                assert time.monotonic() < deadline, through.body
                time.sleep(0.5)
            assert through.status == 201, through.body
        finally:
            started.stop()
    finally:
        fake.down = False


@pytest.mark.parametrize("kid", ["idp1", None], ids=["same-kid", "no-kid"])
def test_a_key_rotated_without_a_new_kid_is_taken_as_the_apiserver_takes_it(
        oidc_cluster: LocalCluster, gate: Opgate, idp: tuple[FakeIdp, Path],
        kid: str | None) -> None:
    """The provider replaces its signing key under the same kid, or serves keys without one
    (its tokens then name none): the apiserver, whose cached key no longer verifies them,
    fetches the JWKS again and takes them at once. opgate refused them (401) until its key set
    was 5 minutes old; it fetches again too (at most every 10 s), so they pass within that."""
    fake, _ca = idp

    def passes_through_opgate(token: str) -> None:
        deadline = time.monotonic() + 30
        while (through := review(oidc_cluster, token, server=gate.url)).status == 401:
            assert time.monotonic() < deadline, through.body
            time.sleep(0.5)
        assert through.status == 201, through.body

    accepted_by_the_apiserver(oidc_cluster, fake)
    # the keys known first: an earlier case put the original key back, which opgate refetches
    # within its 10 s between fetches
    passes_through_opgate(fake.token())
    try:
        fake.key, fake.kid = rsa.generate_private_key(public_exponent=65537, key_size=2048), kid
        token = fake.token()
        assert review(oidc_cluster, token).status == 201  # the reference: at once
        passes_through_opgate(token)
    finally:
        fake.key, fake.kid = KEY, "idp1"
