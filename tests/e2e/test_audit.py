"""The audit log against the real apiserver: kubectl through a TLS opgate with a verified
ServiceAccount token (identity) and ``--audit-log``; the events are audit.k8s.io/v1 Events with
the right user, verb, object, code, stage and level; a denial carries its 403; a Request-level
rule records the request object; no token is ever written."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proxy.envtest.cluster import LocalCluster
from tests.e2e.conftest import Opgate

pytestmark = pytest.mark.e2e

NS = "audit-e2e"
SA_NAME = "auditor"
USER = f"system:serviceaccount:{NS}:{SA_NAME}"
POLICY = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: audit-e2e}}
spec:
  identity:
    issuers:
      - kubernetes: {{}}
    allow:
      - serviceAccount: {ns}/{sa}
    rules:
      - {{name: read, verbs: [get, list, watch], resources: ["*"]}}
      - {{name: no-secrets, effect: deny, resources: [secrets]}}
      - {{name: write-configmaps, verbs: [create, update, patch, delete], apiGroups: [""],
         resources: [configmaps], namespaces: [{ns}]}}
  audit:
    level: Metadata
    rules:
      - level: None
        nonResourceURLs: ["/api", "/apis", "/apis/*", "/openapi/*", "/version"]
      - level: Request
        verbs: [create, update, patch]
        resources: [{{group: "", resources: [configmaps]}}]
"""


@dataclass(frozen=True)
class Setup:
    gate: Opgate
    audit_log: Path
    token: str
    kubeconfig: Path


@pytest.fixture(scope="module")
def setup(cluster: LocalCluster, opgate_factory: Callable[..., Opgate],
          tmp_path_factory: pytest.TempPathFactory) -> Setup:
    rules = [{"apiGroups": [""], "resources": ["configmaps", "secrets"],
              "verbs": ["get", "list", "watch", "create", "delete"]}]
    cluster.create_service_account_with_rbac(NS, SA_NAME, rules)
    base = tmp_path_factory.mktemp("audit")
    token_file = base / "opgate-token"
    token_file.write_text(cluster.admin_token)
    token_file.chmod(0o600)
    audit_log = base / "logs" / "audit.log"
    audit_log.parent.mkdir()
    gate = opgate_factory(policies={"audit.yaml": POLICY.format(ns=NS, sa=SA_NAME)},
                          extra_args=["--token-file", str(token_file),
                                      "--audit-log", str(audit_log)])
    token = cluster.token_request(NS, SA_NAME)
    kubeconfig = cluster.write_kubeconfig(base / "sa.kubeconfig", server=gate.url, token=token,
                                          ca_file=cluster.ca_file)
    return Setup(gate=gate, audit_log=audit_log, token=token, kubeconfig=kubeconfig)


def kubectl_run(kubectl: Path, setup: Setup, *args: str,
                stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(kubectl), "--kubeconfig", str(setup.kubeconfig), "-n", NS, *args],
                          input=stdin, capture_output=True, text=True, timeout=60)


def events(setup: Setup, want: Callable[[list[dict[str, Any]]], bool],
           timeout: float = 10.0) -> list[dict[str, Any]]:
    """The audit log's events once ``want`` holds for them (the writer batches: ~50 ms)."""
    deadline = time.monotonic() + timeout
    found: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        text = setup.audit_log.read_text() if setup.audit_log.exists() else ""
        found = [json.loads(line) for line in text.splitlines()]
        if want(found):
            return found
        time.sleep(0.1)
    pytest.fail(f"audit log never held what was expected; it has {len(found)} events:\n"
                + "\n".join(json.dumps(e) for e in found[-10:]))


def complete(evs: list[dict[str, Any]], verb: str, name: str = "",
             resource: str = "configmaps") -> list[dict[str, Any]]:
    return [e for e in evs if e["stage"] == "ResponseComplete" and e["verb"] == verb
            and e.get("objectRef", {}).get("resource") == resource
            and (not name or e["objectRef"].get("name") == name)]


def test_kubectl_create_get_delete_are_audited_with_the_verified_user(
        kubectl: Path, setup: Setup) -> None:
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "audited"},
          "data": {"color": "blue"}}
    out = kubectl_run(kubectl, setup, "create", "-f", "-", stdin=json.dumps(cm))
    assert out.returncode == 0, out.stderr
    out = kubectl_run(kubectl, setup, "get", "configmap", "audited", "-o", "json")
    assert out.returncode == 0, out.stderr
    out = kubectl_run(kubectl, setup, "delete", "configmap", "audited")
    assert out.returncode == 0, out.stderr

    evs = events(setup, lambda evs: bool(complete(evs, "delete", "audited")))
    (create,) = complete(evs, "create", "audited")
    # (kubectl delete may look the object up again while it waits: the first, found, get)
    get = next(e for e in complete(evs, "get", "audited")
               if e["responseStatus"]["code"] == 200)
    (delete,) = complete(evs, "delete", "audited")
    for ev in (create, get, delete):
        assert (ev["kind"], ev["apiVersion"]) == ("Event", "audit.k8s.io/v1")
        assert ev["user"]["username"] == USER
        assert "system:serviceaccounts" in ev["user"]["groups"]
        assert ev["userAgent"].startswith("kubectl")
        assert ev["sourceIPs"] == ["127.0.0.1"]  # kubectl on loopback, as the apiserver lists it
        assert ev["objectRef"]["namespace"] == NS
        assert ev["objectRef"]["apiVersion"] == "v1"
        assert ev["annotations"]["opgate.dev/decision"] == "allowed"
        assert ev["auditID"]
        assert ev["requestReceivedTimestamp"] <= ev["stageTimestamp"]
    assert (create["level"], create["responseStatus"]["code"]) == ("Request", 201)
    assert create["requestURI"].startswith(f"/api/v1/namespaces/{NS}/configmaps")
    assert create["requestObject"]["data"] == {"color": "blue"}
    assert create["requestObject"]["metadata"]["name"] == "audited"
    assert (get["level"], get["responseStatus"]["code"]) == ("Metadata", 200)
    assert "requestObject" not in get
    assert (delete["level"], delete["responseStatus"]["code"]) == ("Metadata", 200)
    assert len({create["auditID"], get["auditID"], delete["auditID"]}) == 3
    # discovery (a rule with level None) is not there
    assert not [e for e in evs if e["requestURI"] in ("/api", "/apis")]


def test_a_denied_call_is_audited_with_its_403(kubectl: Path, setup: Setup) -> None:
    out = kubectl_run(kubectl, setup, "create", "secret", "generic", "nope",
                      "--from-literal=k=v")
    assert out.returncode != 0
    assert "opgate" in out.stderr and "no-secrets" in out.stderr
    evs = events(setup, lambda evs: bool(complete(evs, "create", resource="secrets")))
    (denied,) = complete(evs, "create", resource="secrets")
    assert denied["user"]["username"] == USER
    assert denied["annotations"]["opgate.dev/decision"] == "denied"
    status = denied["responseStatus"]
    assert (status["code"], status["status"], status["reason"]) == (403, "Failure", "Forbidden")
    assert "no-secrets" in status["message"]
    assert denied["annotations"]["opgate.dev/reason"] == status["message"]


def test_a_watch_gets_response_started_and_complete(cluster: LocalCluster,
                                                    setup: Setup) -> None:
    resp = cluster.call("GET", f"/api/v1/namespaces/{NS}/configmaps?watch=true&timeoutSeconds=2",
                        server=setup.gate.url, token=setup.token)
    assert resp.status == 200

    def watch_events(evs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [e for e in evs if e["verb"] == "watch" and "timeoutSeconds=2" in e["requestURI"]
                and e["user"].get("username") == USER]

    evs = events(setup, lambda evs: len(watch_events(evs)) >= 2)
    started, done = watch_events(evs)[:2]
    assert started["auditID"] == done["auditID"]
    assert (started["stage"], done["stage"]) == ("ResponseStarted", "ResponseComplete")
    assert started["responseStatus"]["code"] == done["responseStatus"]["code"] == 200
    assert started["stageTimestamp"] <= done["stageTimestamp"]


def test_no_token_in_the_audit_log(cluster: LocalCluster, setup: Setup) -> None:
    cluster.call("GET", f"/api/v1/namespaces/{NS}/configmaps?access_token={setup.token}",
                 server=setup.gate.url, token=setup.token)
    evs = events(setup, lambda evs: any("access_token=REDACTED" in e["requestURI"]
                                        for e in evs))
    text = setup.audit_log.read_text()
    assert setup.token not in text
    assert cluster.admin_token not in text
    assert "Bearer" not in text
    assert evs


def test_events_are_counted(setup: Setup) -> None:
    code, text = setup.gate.admin_get("/metrics")
    assert code == 200
    lines = [line for line in text.splitlines()
             if line.startswith('opgate_audit_events_total{level="Metadata"}')]
    assert lines and float(lines[0].split()[-1]) >= 1
    assert "opgate_audit_dropped_total 0.0" in text


def test_the_chart_mounts_an_empty_dir_for_the_audit_log(helm: Path) -> None:
    import yaml

    from proxy.cli import settings_from
    from proxy.cli_parser import build_parser

    chart = Path(__file__).resolve().parents[2] / "helm" / "opgate"
    out = subprocess.run([str(helm), "template", "demo", str(chart), "--set",
                          "sidecar.audit.enabled=true", "--set", "sidecar.audit.maxBackups=2"],
                         capture_output=True, text=True, check=True).stdout
    [deploy] = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment"]
    pod = deploy["spec"]["template"]["spec"]
    [sidecar] = [c for c in pod["containers"] if c["name"] == "opgate"]
    log = settings_from(build_parser().parse_args(sidecar["args"])).log
    assert (log.audit_log, log.audit_log_maxsize, log.audit_log_maxbackup) == (
        "/var/log/opgate/audit.log", 100, 2)
    assert {"name": "opgate-audit", "mountPath": "/var/log/opgate"} in sidecar["volumeMounts"]
    assert {"name": "opgate-audit", "emptyDir": {"sizeLimit": "1Gi"}} in pod["volumes"]
    off = subprocess.run([str(helm), "template", "demo", str(chart)], capture_output=True,
                         text=True, check=True).stdout
    assert "audit" not in off
