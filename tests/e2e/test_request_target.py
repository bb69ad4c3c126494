"""Request targets that are not a plain path, against the real apiserver through opgate.

Go's server (so kube-apiserver) serves an absolute-form target (``GET http://host/api/...``,
which HTTP/1.1 servers must accept) by its path, so opgate must classify it by that path too, or
a client could step around every policy by writing its request line that way. A path with a
malformed percent-escape never reaches the apiserver's handlers (Go answers 400), and ``*`` is
no API call: opgate answers both with a ``BadRequest`` Status of its own. Both relay cores.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from proxy.envtest.cluster import LocalCluster
from tests.e2e.conftest import Opgate

pytestmark = pytest.mark.e2e

FAULTED = "target-faulted"
_WORK: dict[int, Path] = {}  # per opgate (by port): where its audit log and capture are
POLICY = f"""\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: targets}}
spec:
  mode: enforce
  faults:
    - name: faulted-namespace
      match: {{namespaces: [{FAULTED}]}}
      probability: 1
      respond: {{code: 409}}
"""


def _raw(gate: Opgate, method: str, target: str) -> bytes:
    with socket.create_connection(("127.0.0.1", gate.port), timeout=10) as sock:
        sock.sendall(f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     "Connection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def _call(gate: Opgate, method: str, target: str) -> tuple[int, dict[str, object]]:
    head, _, body = _raw(gate, method, target).partition(b"\r\n\r\n")
    code = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    assert body.strip(), f"no body: {head!r}"
    return code, json.loads(body)


def _dechunk(data: bytes) -> bytes:
    out = b""
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if not size:
            return out
        out, data = out + data[:size], data[size + 2:]


@pytest.fixture(scope="module", params=["fast", "aiohttp"])
def relay(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def gate(relay: str, cluster: LocalCluster,
         opgate_factory: Callable[..., Opgate], tmp_path_factory: pytest.TempPathFactory,
         ) -> Opgate:
    cluster.create_namespace(FAULTED)
    for ns in ("default", FAULTED):
        cluster.call("POST", f"/api/v1/namespaces/{ns}/configmaps", body={
            "metadata": {"name": "target-cm"}, "data": {"in": ns}})
    work = tmp_path_factory.mktemp("targets")
    token = work / "token"
    token.write_text(cluster.admin_token)
    gate = opgate_factory(tls=False, policies={"targets.yaml": POLICY},
                          extra_args=["--token-file", str(token), "--relay", relay,
                                      "--audit-log", str(work / "audit.log"),
                                      "--capture", str(work / "capture.flows")])
    _WORK[gate.port] = work
    return gate


def _records(gate: Opgate, marker: str) -> tuple[list[str], list[str]]:
    """The audit log's requestURIs and the capture's request paths that hold ``marker``."""
    from mitmproxy.io import FlowReader

    work = _WORK[gate.port]
    audit = work / "audit.log"
    uris = [json.loads(line)["requestURI"]
            for line in (audit.read_text().splitlines() if audit.exists() else [])
            if marker in line]
    paths: list[str] = []
    flows = work / "capture.flows"
    if flows.exists():
        with flows.open("rb") as f:
            paths = [flow.request.path for flow in FlowReader(f).stream()
                     if marker in flow.request.path]
    return uris, paths


@pytest.mark.parametrize("prefix", ["http://kubernetes.default.svc", "https://10.0.0.1:6443",
                                    "HTTP://opgate"])
def test_an_absolute_form_target_is_relayed_and_judged_by_its_path(gate: Opgate,
                                                                   prefix: str) -> None:
    code, obj = _call(gate, "GET", f"{prefix}/api/v1/namespaces/default/configmaps/target-cm")
    assert code == 200 and obj["data"] == {"in": "default"}, obj
    # the policy sees the call the apiserver serves: the fault of the namespace applies
    code, obj = _call(gate, "GET", f"{prefix}/api/v1/namespaces/{FAULTED}/configmaps/target-cm")
    assert code == 409, obj
    assert "faulted-namespace" in str(obj["message"])


def test_a_query_right_after_the_authority(gate: Opgate) -> None:
    code, obj = _call(gate, "GET", "http://opgate?timeout=5s")
    assert code == 200 and "/api" in obj["paths"], obj  # the apiserver's answer for "/"


@pytest.mark.parametrize(("method", "target"), [
    ("GET", f"/api/v1/namespaces/{FAULTED}/configmaps/%zz"),
    ("GET", "/api/v1/namespaces/default/configmaps/a%2"),
    ("OPTIONS", "*"),
    ("GET", "opgate:8001"),
])
def test_targets_the_apiserver_refuses_get_a_bad_request_status(
    gate: Opgate, relay: str, method: str, target: str,
) -> None:
    if relay == "aiohttp" and target == "opgate:8001":  # aiohttp's own parser refuses it,
        raw = _raw(gate, method, target)  # with a Status of its own message
        assert raw.startswith(b"HTTP/1.1 400 Bad Request\r\n"), raw[:200]
        assert b"\r\nConnection: close\r\n" in raw and b'"reason":"BadRequest"' in raw, raw
        return
    code, obj = _call(gate, method, target)
    assert code == 400, obj
    assert obj["kind"] == "Status" and obj["reason"] == "BadRequest", obj
    assert str(obj["message"]).startswith("opgate: "), obj


def test_percent_escapes_that_are_well_formed_are_decoded_before_judging(gate: Opgate) -> None:
    code, obj = _call(gate, "GET", f"/api/v1/namespaces/{FAULTED}/%63onfigmaps/target-cm")
    assert code == 409, obj
    code, obj = _call(gate, "GET", "/api/v1/namespaces/default/%63onfigmaps/target-cm")
    assert code == 200 and obj["data"] == {"in": "default"}, obj


def test_the_access_log_names_the_call_not_the_absolute_target(gate: Opgate) -> None:
    def logged() -> str:
        return gate.log.read_text(errors="replace")

    before = logged().count('"name":"target-cm"')
    _call(gate, "GET", "http://elsewhere/api/v1/namespaces/default/configmaps/target-cm")
    deadline = time.monotonic() + 10  # access-log lines are written in batches
    while "http://elsewhere" not in logged() and logged().count('"name":"target-cm"') == before:
        assert time.monotonic() < deadline, "the call was never logged"
        time.sleep(0.1)
    assert "http://elsewhere" not in logged()


def test_the_audit_log_and_the_capture_keep_the_path_as_sent(gate: Opgate) -> None:
    """The apiserver's audit log keeps a request's escapes (requestURI as sent); so do opgate's
    audit log and its capture, while the policies judge the decoded path."""
    sent = "/api/v1/namespaces/default/%63onfigmaps/target-cm?x=%41&trace=escapes-kept"
    code, _ = _call(gate, "GET", sent)
    assert code == 200
    deadline = time.monotonic() + 15  # both are written in batches, the capture at a flow's end
    while _records(gate, "escapes-kept") != ([sent], [sent]):
        assert time.monotonic() < deadline, _records(gate, "escapes-kept")
        time.sleep(0.2)
