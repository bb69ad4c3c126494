"""Traffic capture against the real apiserver: kubectl through a TLS opgate with ``--capture``;
the flow file (read with mitmproxy's reader and the real ``mitmdump -r``) shows kubectl's
requests and the apiserver's real answers, a watch's events, opgate's own 409 (a fault) with
its decision, a Secret's call without its data, and no token anywhere in the file."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mitmproxy import io as mio

from proxy.envtest.cluster import LocalCluster
from tests.e2e.conftest import Opgate

pytestmark = pytest.mark.e2e

NS = "capture-e2e"
SECRET_VALUE = "correct-horse-battery-staple"
POLICY = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {name: capture-e2e}
spec:
  faults:
    - name: no-service-deletes
      match: {verbs: [delete], resources: [services]}
      respond: {code: 409}
  capture:
    - name: secrets
      match: {resources: [secrets]}
    - name: everything
      maxBodyBytes: 65536
"""


@dataclass(frozen=True)
class Setup:
    gate: Opgate
    flows_file: Path
    kubeconfig: Path


@pytest.fixture(scope="module")
def setup(cluster: LocalCluster, opgate_factory: Callable[..., Opgate],
          tmp_path_factory: pytest.TempPathFactory) -> Setup:
    cluster.create_namespace(NS)
    base = tmp_path_factory.mktemp("capture")
    flows_file = base / "flows" / "capture.flows"
    flows_file.parent.mkdir()
    gate = opgate_factory(policies={"capture.yaml": POLICY},
                          extra_args=["--capture", str(flows_file)])
    kubeconfig = cluster.write_kubeconfig(base / "via.kubeconfig", server=gate.url,
                                          token=cluster.admin_token, ca_file=cluster.ca_file)
    return Setup(gate=gate, flows_file=flows_file, kubeconfig=kubeconfig)


def kubectl_run(kubectl: Path, setup: Setup, *args: str,
                stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(kubectl), "--kubeconfig", str(setup.kubeconfig), "-n", NS, *args],
                          input=stdin, capture_output=True, text=True, timeout=60)


def read_flows(path: Path) -> list[Any]:
    """The complete flows in the file (the writer may be in the middle of the last one)."""
    flows: list[Any] = []
    if not path.exists():
        return flows
    with open(path, "rb") as f:
        try:
            for flow in mio.FlowReader(f).stream():
                flows.append(flow)
        except Exception:  # a flow being written: the ones before it are complete
            pass
    return flows


def flows_until(setup: Setup, want: Callable[[list[Any]], bool],
                timeout: float = 15.0) -> list[Any]:
    deadline = time.monotonic() + timeout
    found: list[Any] = []
    while time.monotonic() < deadline:
        found = read_flows(setup.flows_file)
        if want(found):
            return found
        time.sleep(0.1)
    pytest.fail("the capture file never held what was expected; it has:\n" + "\n".join(
        f"{f.request.method} {f.request.path} -> {f.response and f.response.status_code}"
        for f in found[-20:]))


def find(flows: list[Any], method: str, path_part: str, code: int | None = None) -> list[Any]:
    return [f for f in flows if f.request.method == method and path_part in f.request.path
            and (code is None or (f.response is not None and f.response.status_code == code))]


def test_kubectl_calls_are_captured_with_the_apiserver_answers(
        kubectl: Path, cluster: LocalCluster, setup: Setup) -> None:
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "captured"},
          "data": {"color": "blue"}}
    out = kubectl_run(kubectl, setup, "create", "-f", "-", stdin=json.dumps(cm))
    assert out.returncode == 0, out.stderr
    out = kubectl_run(kubectl, setup, "get", "configmap", "captured", "-o", "json")
    assert out.returncode == 0, out.stderr
    uid = json.loads(out.stdout)["metadata"]["uid"]
    # a watch the apiserver itself ends after a second
    watch = cluster.call("GET", f"/api/v1/namespaces/{NS}/configmaps?watch=true"
                         "&timeoutSeconds=1", server=setup.gate.url)
    assert watch.status == 200 and b'"ADDED"' in watch.body
    out = kubectl_run(kubectl, setup, "delete", "configmap", "captured")
    assert out.returncode == 0, out.stderr

    flows = flows_until(setup, lambda fs: bool(find(fs, "DELETE", "/configmaps/captured", 200)))
    (create,) = find(flows, "POST", f"/api/v1/namespaces/{NS}/configmaps", 201)
    assert json.loads(create.request.content)["data"] == {"color": "blue"}
    created = json.loads(create.response.content)  # the apiserver's own answer
    assert (created["kind"], created["metadata"]["uid"]) == ("ConfigMap", uid)
    assert create.request.headers["User-Agent"].startswith("kubectl")
    assert create.request.headers["Authorization"] == "Bearer REDACTED"
    assert create.response.headers.get("Audit-Id")  # the apiserver's header, as it sent it
    assert create.metadata["opgate"]["decision"] == "allowed"
    assert create.metadata["opgate"]["rule"].endswith("capture.yaml:12")
    get = find(flows, "GET", f"/api/v1/namespaces/{NS}/configmaps/captured", 200)[0]
    assert json.loads(get.response.content)["metadata"]["uid"] == uid
    (watched,) = find(flows, "GET", "watch=true", 200)
    events = [json.loads(line) for line in watched.response.content.splitlines()]
    assert any(e["type"] == "ADDED" and e["object"]["metadata"]["name"] == "captured"
               for e in events)
    assert watched.metadata["opgate"]["verb"] == "watch"
    dump = subprocess.run([mitmdump_exe(), "-n", "-r", str(setup.flows_file)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HOME": str(setup.flows_file.parent)})
    assert dump.returncode == 0, dump.stderr
    assert f"POST {cluster.url}/api/v1/namespaces/" in dump.stdout  # (mitmdump cuts URLs)
    assert "<< 201 Created" in dump.stdout


def test_opgate_own_answer_and_secrets_and_no_token(
        kubectl: Path, cluster: LocalCluster, setup: Setup) -> None:
    out = kubectl_run(kubectl, setup, "create", "service", "clusterip", "kept",
                      "--tcp=80:8080")
    assert out.returncode == 0, out.stderr
    out = kubectl_run(kubectl, setup, "delete", "service", "kept")
    assert out.returncode != 0 and "injected fault no-service-deletes" in out.stderr
    out = kubectl_run(kubectl, setup, "create", "secret", "generic", "hidden",
                      f"--from-literal=password={SECRET_VALUE}")
    assert out.returncode == 0, out.stderr
    out = kubectl_run(kubectl, setup, "get", "secret", "hidden", "-o", "json")
    assert out.returncode == 0, out.stderr

    flows = flows_until(setup, lambda fs: bool(find(fs, "GET", "/secrets/hidden", 200)))
    (denied,) = find(flows, "DELETE", "/services/kept", 409)
    assert json.loads(denied.response.content)["reason"] == "Conflict"
    assert denied.metadata["opgate"]["decision"] == "fault"
    assert denied.metadata["opgate"]["answered_by"] == "opgate"
    assert "no-service-deletes" in denied.comment
    (created,) = find(flows, "POST", "/secrets", 201)
    got = find(flows, "GET", "/secrets/hidden", 200)[0]
    for flow in (created, got):
        assert flow.request.content in (b"", None) and flow.response.content == b""
        assert "Secret bodies" in flow.metadata["opgate"]["bodies_omitted"]
        assert flow.metadata["opgate"]["rule"].endswith("capture.yaml:10")

    raw = setup.flows_file.read_bytes()
    for secret in (cluster.admin_token, SECRET_VALUE,
                   base64.b64encode(SECRET_VALUE.encode()).decode()):
        assert secret.encode() not in raw
    assert b"Bearer REDACTED" in raw
    metrics = setup.gate.admin_get("/metrics")[1]
    assert 'opgate_capture_flows_total{result="written"}' in metrics


def mitmdump_exe() -> str:
    return shutil.which("mitmdump") or str(Path(sys.executable).with_name("mitmdump"))


def test_the_chart_mounts_an_empty_dir_for_the_capture_file(helm: Path) -> None:
    import yaml

    from proxy.cli import settings_from
    from proxy.cli_parser import build_parser

    chart = Path(__file__).resolve().parents[2] / "helm" / "opgate"
    out = subprocess.run([str(helm), "template", "demo", str(chart), "--set",
                          "sidecar.capture.enabled=true", "--set", "sidecar.capture.maxSizeMB=20",
                          "--set", "sidecar.audit.enabled=true"],
                         capture_output=True, text=True, check=True).stdout
    [deploy] = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment"]
    pod = deploy["spec"]["template"]["spec"]
    [sidecar] = [c for c in pod["containers"] if c["name"] == "opgate"]
    log = settings_from(build_parser().parse_args(sidecar["args"])).log
    assert (log.capture, log.capture_maxsize, log.capture_maxbackup) == (
        "/var/log/opgate-capture/capture.flows", 20, 5)
    assert log.audit_log == "/var/log/opgate/audit.log"  # both, on volumes of their own
    assert {"name": "opgate-capture",
            "mountPath": "/var/log/opgate-capture"} in sidecar["volumeMounts"]
    assert {"name": "opgate-capture", "emptyDir": {"sizeLimit": "1Gi"}} in pod["volumes"]
    off = subprocess.run([str(helm), "template", "demo", str(chart)], capture_output=True,
                         text=True, check=True).stdout
    assert "capture" not in off
