"""Whose credentials the apiserver reads on a call through opgate, against the real apiserver.

opgate's own upstream credentials may be a client certificate (a kubeconfig user such as kind's
admin). The apiserver authenticates a connection's client certificate before any bearer token,
so a call carrying the caller's own token must not go over a connection that presents opgate's
certificate: the apiserver would run it as opgate. Raw HTTP, both relay cores, plain calls and
an upgrade.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from proxy.envtest import pki
from proxy.envtest.binaries import KubeBinaries
from proxy.envtest.cluster import LocalCluster
from tests.e2e.conftest import Opgate, start_opgate

pytestmark = pytest.mark.e2e

NS = "creds"
CERT_USER = "opgate-cert-admin"
REVIEW = json.dumps({"apiVersion": "authentication.k8s.io/v1",
                     "kind": "SelfSubjectReview"}).encode()
REVIEWS = "/apis/authentication.k8s.io/v1/selfsubjectreviews"


@pytest.fixture(scope="module", params=["fast", "aiohttp"])
def relay(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def reader(cluster: LocalCluster) -> str:
    """A token of a ServiceAccount that may read configmaps of ``NS`` (not secrets)."""
    cluster.create_service_account_with_rbac(NS, "reader", [
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]}])
    return cluster.token_request(NS, "reader")


@pytest.fixture(scope="module")
def gate(relay: str, cluster: LocalCluster, opgate_factory: Callable[..., Opgate],
         tmp_path_factory: pytest.TempPathFactory) -> Opgate:
    """opgate whose own credentials are a client certificate of a cluster admin (a plain-HTTP
    sidecar listener: the calls carry the caller's token as they are sent)."""
    cert, key = cluster.issue_client_cert(CERT_USER, ("system:masters",))
    kubeconfig = _kubeconfig(tmp_path_factory.mktemp("creds") / "cert.kubeconfig", cluster,
                             cert, key)
    return opgate_factory(tls=False, upstream_args=["--kubeconfig", str(kubeconfig)],
                          extra_args=["--relay", relay])


def _kubeconfig(path: Path, cluster: LocalCluster, cert: str, key: str, **token: str) -> Path:
    """A kubeconfig whose user authenticates with the client certificate ``cert`` (and
    ``token=`` too, when given)."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": cluster.url,
                                                "certificate-authority": cluster.ca_file}}],
        "users": [{"name": "u", "user": {"client-certificate": cert, "client-key": key,
                                         **token}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x"}))
    return path


def raw(gate: Opgate, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """Send one request as is (its head without the final empty line, ``Connection: close``
    added unless it names a ``Connection``); the status code and what came back until opgate
    closed or the head of a 101 ended."""
    if b"\r\nConnection:" not in head:
        head += b"Connection: close\r\n"
    with socket.create_connection(("127.0.0.1", gate.port), timeout=30) as sock:
        sock.sendall(head + b"Host: 127.0.0.1\r\n\r\n" + body)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
            if got.startswith(b"HTTP/1.1 101 ") and b"\r\n\r\n" in got:
                break  # a tunnel: it would stay open
    return int(got.split(b" ", 2)[1]), got


def whoami(gate: Opgate, authorization: bytes | None, more: bytes = b"") -> tuple[int, str]:
    """The user the apiserver takes a call through opgate for (a SelfSubjectReview), with the
    header lines ``more``."""
    auth = b"Authorization: " + authorization + b"\r\n" if authorization is not None else b""
    code, got = raw(gate, b"POST " + REVIEWS.encode() + b" HTTP/1.1\r\n" + auth + more
                    + b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(REVIEW),
                    REVIEW)
    if code != 201:
        return code, ""
    body = got.partition(b"\r\n\r\n")[2]
    if b"Transfer-Encoding: chunked" in got.partition(b"\r\n\r\n")[0]:
        body = body.partition(b"\r\n")[2].rpartition(b"\r\n0\r\n")[0]
    return code, json.loads(body)["status"]["userInfo"]["username"]


def test_the_apiserver_authenticates_the_callers_token_not_opgates_certificate(
        gate: Opgate, cluster: LocalCluster, reader: str) -> None:
    """The caller's token is whom the apiserver runs the call as, and a bad one is a 401, as
    when it is sent to the apiserver directly; a call without credentials is opgate's."""
    assert cluster.call("POST", REVIEWS, body=REVIEW, token=reader).json()["status"][
        "userInfo"]["username"] == f"system:serviceaccount:{NS}:reader"  # the reference
    assert cluster.call("POST", REVIEWS, body=REVIEW, token="not-a-token").status == 401
    assert whoami(gate, b"Bearer " + reader.encode()) == (
        201, f"system:serviceaccount:{NS}:reader")
    assert whoami(gate, b"Bearer not-a-token")[0] == 401
    assert whoami(gate, None) == (201, CERT_USER)
    # a token listed in Connection is dropped (hop-by-hop): the call goes with no credentials,
    # as anonymous (who may not review itself), never opgate's
    assert cluster.call("POST", REVIEWS, body=REVIEW, token="").status == 403
    assert whoami(gate, b"Bearer " + reader.encode(),
                  b"Connection: Authorization, close\r\n") == (403, "")
    # and so the apiserver authorizes the caller: no secrets for the reader
    secrets = f"GET /api/v1/namespaces/{NS}/secrets HTTP/1.1\r\n".encode()
    assert cluster.call("GET", f"/api/v1/namespaces/{NS}/secrets", token=reader).status == 403
    assert raw(gate, secrets + b"Authorization: Bearer " + reader.encode() + b"\r\n")[0] == 403
    assert raw(gate, secrets)[0] == 200  # (opgate's own: an admin)


def test_an_upgrade_with_the_callers_token_is_authenticated_by_it(
        gate: Opgate, cluster: LocalCluster, reader: str) -> None:
    """A WebSocket watch (an upgrade: its own upstream connection) with a bad token is the
    apiserver's 401, not a 101 for opgate's certificate; the reader's token may watch."""
    def upgrade(token: bytes) -> int:
        return raw(gate, f"GET /api/v1/namespaces/{NS}/configmaps?watch=true HTTP/1.1\r\n"
                         "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                         "Sec-WebSocket-Version: 13\r\nOrigin: http://127.0.0.1\r\n"
                         "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n".encode()
                   + b"Authorization: Bearer " + token + b"\r\n")[0]

    assert upgrade(b"not-a-token") == 401
    assert upgrade(reader.encode()) == 101
    assert upgrade(_denied_watch_token(cluster)) == 403


def _denied_watch_token(cluster: LocalCluster) -> bytes:
    """A token of a ServiceAccount with no rights at all."""
    cluster.create_service_account_with_rbac(NS, "nobody", [])
    return cluster.token_request(NS, "nobody").encode()


def test_request_header_identities_never_reach_opgates_front_proxy_certificate(
        kube_binaries: KubeBinaries, tmp_path: Path) -> None:
    """An apiserver that trusts a front proxy (``--requestheader-*``, as kubeadm sets up for
    aggregated APIs) takes the user of ``X-Remote-User`` / ``-Group`` / ``-Extra-*`` from any
    connection whose certificate its requestheader CA signed. opgate's own certificate may be
    one: a client's such headers, on a call going with opgate's credentials, would make it any
    user it names. opgate drops them, so the call is opgate's own."""
    front = tmp_path / "front-proxy"
    pki.write_pki(front)  # (its CA is the front proxy's)
    cert, key = pki.issue_client_cert(front, name="front-proxy-client")
    with LocalCluster(binaries=kube_binaries, extra_apiserver_args=(
            f"--requestheader-client-ca-file={front / 'ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-")) as cluster:
        kubeconfig = _kubeconfig(tmp_path / "cert.kubeconfig", cluster, str(cert), str(key),
                                 token=cluster.admin_token)
        gates = [start_opgate(cluster, tmp_path / relay, tls=False,
                              upstream_args=["--kubeconfig", str(kubeconfig)],
                              extra_args=["--relay", relay]) for relay in ("fast", "aiohttp")]
        try:
            for gate in gates:
                plain = whoami(gate, None)  # (the front proxy's certificate and a token)
                forged = b"X-Remote-User: evil\r\nx-remote-group: system:masters\r\n" \
                         b"X-Remote-Extra-Scopes: all\r\nX-REMOTE-UID: 1\r\n"
                assert plain == (201, "opgate-e2e-admin")
                assert whoami(gate, None, forged) == plain
        finally:
            for gate in gates:
                gate.stop()
