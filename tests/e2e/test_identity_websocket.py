"""A browser's WebSocket through opgate against the real apiserver: its bearer token travels as a
subprotocol (``base64url.bearer.authorization.k8s.io.<token>``), and the apiserver must run the
call as that ServiceAccount, not as opgate (``--token-file`` holds the admin token here, as a
sidecar's ServiceAccount token), with the identity middleware on and off; and a flood of
distinct opaque tokens through an identity opgate is refused or reviewed, never unbounded.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from proxy.envtest.cluster import LocalCluster
from tests.e2e.conftest import Opgate

NS = "idws"
USER = f"system:serviceaccount:{NS}:browser"
POLICY = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: identity-websocket}}
spec:
  mode: enforce
  identity:
    issuers:
      - kubernetes: {{}}
    allow:
      - serviceAccount: {ns}/browser
      - group: "system:masters"
    rules:
      - {{name: read, verbs: [get, list, watch], resources: ["*"]}}
"""


@pytest.fixture(scope="module")
def token(cluster: LocalCluster) -> str:
    rules = [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]}]
    assert cluster.create_service_account_with_rbac(NS, "browser", rules) == USER
    return cluster.token_request(NS, "browser")


def sidecar(identity: bool, opgate_factory: Callable[..., Opgate], cluster: LocalCluster,
            tmp_path_factory: pytest.TempPathFactory) -> Opgate:
    """A plain-HTTP sidecar opgate with the admin token as its own (``--token-file``)."""
    token_file = tmp_path_factory.mktemp("idws") / "opgate-token"
    token_file.write_text(cluster.admin_token)
    token_file.chmod(0o600)
    policies = {"identity.yaml": POLICY.format(ns=NS)} if identity else None
    return opgate_factory(policies=policies, tls=False,
                          extra_args=["--token-file", str(token_file)])


@pytest.fixture(scope="module", params=["identity", "no-identity"])
def gate(request: pytest.FixtureRequest, opgate_factory: Callable[..., Opgate],
         cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Opgate:
    return sidecar(request.param == "identity", opgate_factory, cluster, tmp_path_factory)


@pytest.fixture(scope="module")
def identity_gate(opgate_factory: Callable[..., Opgate], cluster: LocalCluster,
                  tmp_path_factory: pytest.TempPathFactory) -> Opgate:
    return sidecar(True, opgate_factory, cluster, tmp_path_factory)


def websocket_watch(gate: Opgate, namespace: str, protocols: str) -> tuple[int, dict[str, object]]:
    """A WebSocket watch of ConfigMaps, as a browser opens one: its status, and the Status body
    of a refusal ({} for a 101)."""
    request = (f"GET /api/v1/namespaces/{namespace}/configmaps?watch=true HTTP/1.1\r\n"
               f"Host: 127.0.0.1:{gate.port}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
               "Origin: http://127.0.0.1\r\nSec-WebSocket-Version: 13\r\n"
               "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
               f"Sec-WebSocket-Protocol: {protocols}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", gate.port), timeout=20) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        code = int(head.split(b" ", 2)[1])
        if code == 101:
            return code, {}
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), None)
        while (length is None or len(body) < length) and (chunk := sock.recv(65536)):
            body += chunk  # (without a length: until the end)
    try:
        status = json.loads(body)
    except ValueError:
        status = None
    return code, status if isinstance(status, dict) else {"body": body.decode(errors="replace")}


def subprotocol(token: str) -> str:
    encoded = base64.urlsafe_b64encode(token.encode()).rstrip(b"=").decode()
    return f"base64url.bearer.authorization.k8s.io.{encoded}, base64.binary.k8s.io"


def test_the_apiserver_runs_a_subprotocol_token_call_as_its_service_account(
        gate: Opgate, token: str) -> None:
    code, _ = websocket_watch(gate, NS, subprotocol(token))
    assert code == 101
    # outside the ServiceAccount's Role: the apiserver refuses it, naming the user it ran the
    # call as (as opgate, the admin, it would be a 101)
    code, status = websocket_watch(gate, "default", subprotocol(token))
    assert code == 403, status
    assert str(status["message"]).startswith(f'configmaps is forbidden: User "{USER}"'), status


def test_a_call_without_a_token_of_its_own_is_opgates(gate: Opgate) -> None:
    """(What the other test tells apart: a WebSocket without a token subprotocol runs as
    opgate, the admin, when opgate lets it on.)"""
    code, status = websocket_watch(gate, "default", "base64.binary.k8s.io")
    assert code == (401 if identity_on(gate) else 101), status


def identity_on(gate: Opgate) -> bool:
    return Path(gate.policies_dir, "identity.yaml").exists()


def reviews(gate: Opgate) -> dict[str, float]:
    code, text = gate.admin_get("/metrics")
    assert code == 200
    found = {"authenticated": 0.0, "rejected": 0.0, "error": 0.0, "busy": 0.0}
    for line in text.splitlines():
        if line.startswith("opgate_identity_token_reviews_total{"):
            labels, _, value = line.rpartition(" ")
            found[labels.split('"')[1]] = float(value)
    return found


def test_a_flood_of_distinct_opaque_tokens(identity_gate: Opgate, cluster: LocalCluster) -> None:
    """100 calls at once, each with a token of its own the apiserver does not know: each is a
    401 after its TokenReview, or a 429 when none of the reviews allowed at once was free in
    time; then one bad token 20 times costs one TokenReview."""
    gate = identity_gate
    before = reviews(gate)

    def call(i: int) -> int:
        return cluster.call("GET", f"/api/v1/namespaces/{NS}/configmaps", server=gate.url,
                            token=f"flood-{i}-not-a-token", timeout=30).status

    with concurrent.futures.ThreadPoolExecutor(max_workers=100) as pool:
        codes = list(pool.map(call, range(100)))
    after = reviews(gate)
    assert set(codes) <= {401, 429}, codes
    assert after["rejected"] - before["rejected"] == codes.count(401)
    assert after["busy"] - before["busy"] == codes.count(429)
    assert after["error"] == before["error"]
    for _ in range(20):
        assert call(1000) == 401
    assert reviews(gate)["rejected"] == after["rejected"] + 1
