"""Which events a policy gives: opgate's ``spec.audit`` against the apiserver's own Policy.

A cluster of this module's own runs kube-apiserver with ``--audit-policy-file`` holding
:data:`RULES`; an opgate in front of it (verifying the caller's ServiceAccount token, letting
``Impersonate-*`` through) has the same rules as ``spec.audit``. Every call of :data:`CALLS` goes
through opgate with an ``Audit-ID`` of its own, and both logs must hold, for each, the same
(stage, level) pairs: none where a rule says ``None`` or omits every stage, ResponseStarted for
the long-running calls, the level of the first rule that matches (users and groups, verbs,
groups and resources with their wildcards and names, namespaces, non-resource URLs). Both
policies omit RequestReceived, which opgate never writes (README, "Audit"). The fields of each
event are compared in tests/e2e/test_audit_apiserver.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proxy.envtest.binaries import KubeBinaries
from proxy.envtest.cluster import LocalCluster
from tests.e2e.conftest import Opgate, start_opgate
from tests.e2e.test_audit_apiserver import admin_token_file, audited_cluster

pytestmark = pytest.mark.e2e

NS = "audit-pol"
SA_NAME = "op"
USER = f"system:serviceaccount:{NS}:{SA_NAME}"
# the rules of both policies, first match wins; no match: no event (the apiserver's default,
# opgate's with level: None)
RULES = f"""\
- level: RequestResponse
  users: ["bob"]
- level: None
  users: ["{USER}"]
  verbs: [watch]
  resources: [{{group: "", resources: [secrets]}}]
- level: Request
  userGroups: ["system:serviceaccounts:{NS}"]
  resources: [{{group: "", resources: [configmaps], resourceNames: [picked]}}]
- level: None
  verbs: [watch]
  resources: [{{group: "", resources: [configmaps]}}]
- level: Request
  verbs: [list]
  resources: [{{group: "", resources: [configmaps]}}]
- level: Metadata
  verbs: [deletecollection]
  omitStages: [ResponseComplete]
- level: Request  # a POST; a GET attach is a get (the apiserver authorizes it as a create)
  verbs: [create]
  resources: [{{group: "", resources: ["pods/attach"]}}]
- level: Request
  resources: [{{group: "", resources: ["pods/*"], resourceNames: [named]}}]
- level: Request
  resources: [{{group: "", resources: ["pods/log"]}}]
- level: Metadata
  resources: [{{group: "", resources: ["pods/*"]}}]
  omitStages: [ResponseStarted]
- level: Request
  resources: [{{group: apps, resources: ["*/status"]}}]
- level: None
  resources: [{{group: apps}}]
- level: Request
  namespaces: ["{NS}"]
  resources: [{{group: "", resources: [namespaces, namespaces/status]}}]
- level: Request
  namespaces: [""]
- level: Metadata
  nonResourceURLs: ["/healthz*", "/version"]
- level: Request
  verbs: [get]
  nonResourceURLs: ["/api*", "/debug/*"]
- level: Metadata
  verbs: [post, put, options]
- level: Metadata
  verbs: [watch]
  resources: [{{group: "", resources: [events]}}]
- level: Metadata
  userGroups: ["system:authenticated"]
  verbs: [get]
"""
APISERVER_POLICY = ("apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\n"
                    "rules:\n" + RULES)
OPGATE_POLICY = f"""\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: audit-pol}}
spec:
  allowImpersonation: true
  identity:
    issuers: [{{kubernetes: {{}}}}]
    allow: [{{serviceAccount: {NS}/{SA_NAME}}}]
    rules:
      - {{name: all, verbs: ["*"]}}
  audit:
    level: None
    omitStages: [RequestReceived]
    rules:
{"".join("      " + line + chr(10) for line in RULES.splitlines())}"""
CM = f"/api/v1/namespaces/{NS}/configmaps"
PODS = f"/api/v1/namespaces/{NS}/pods"
WATCH = "watch=true&timeoutSeconds=1"
# method, path (with its query), extra headers
CALLS: list[tuple[str, str, dict[str, str]]] = [
    ("GET", f"{CM}/picked", {}),
    ("GET", f"{CM}/other", {}),
    ("GET", f"{CM}?fieldSelector=metadata.name%3Dpicked", {}),  # a list naming its object
    ("GET", f"{CM}?{WATCH}", {}),
    ("GET", f"{CM}?{WATCH}&fieldSelector=metadata.name%3Dpicked", {}),
    ("GET", f"{CM}?watch=false", {}),
    ("GET", CM, {}),
    ("DELETE", f"{CM}?labelSelector=x%3Dy", {}),
    ("GET", f"{CM}/x?watch=true", {}),  # a get: only a collection is watched
    ("GET", f"/api/v1/namespaces/{NS}/secrets?{WATCH}", {}),
    ("GET", f"/api/v1/namespaces/{NS}/secrets/s", {}),
    # the apiserver matches the caller, not the user it impersonates
    ("GET", f"{CM}/other", {"Impersonate-User": "bob"}),
    ("GET", f"{PODS}/named", {}),
    ("GET", f"{PODS}/named/exec?command=ls", {}),
    ("GET", f"{PODS}/named/log", {}),
    ("GET", f"{PODS}/other/exec?command=ls", {}),
    ("GET", f"{PODS}/other/attach", {}),
    ("POST", f"{PODS}/other/attach", {}),
    ("GET", f"{PODS}/other/log", {}),
    ("GET", f"{PODS}/other/status", {}),
    ("GET", f"{PODS}/other", {}),
    ("GET", f"/apis/apps/v1/namespaces/{NS}/deployments/d/status", {}),
    ("GET", f"/apis/apps/v1/namespaces/{NS}/deployments?{WATCH}", {}),
    ("GET", f"/apis/apps/v1/namespaces/{NS}/deployments/d/scale", {}),
    ("GET", "/api/v1/nodes", {}),
    ("GET", "/api/v1/pods", {}),  # every namespace: namespace ""
    ("GET", f"/api/v1/namespaces/{NS}", {}),  # the namespace object is in its own namespace
    ("GET", f"/api/v1/namespaces/{NS}/status", {}),
    ("GET", "/api/v1/namespaces", {}),
    ("GET", f"/api/v1/namespaces/{NS}/events?{WATCH}", {}),
    ("GET", f"/api/v1/watch/namespaces/{NS}/events?timeoutSeconds=1", {}),
    ("GET", f"/api/v1/namespaces/{NS}/services/s/proxy/x", {}),
    ("GET", "/healthz", {}),
    ("GET", "/healthz/etcd", {}),
    ("GET", "/version", {}),
    ("GET", "/version/", {}),
    ("HEAD", "/version", {}),
    ("POST", "/version", {}),
    ("OPTIONS", "/version", {}),
    ("GET", "/api", {}),
    ("GET", "/apis", {}),
    ("GET", "/apis/apps/v1", {}),
    ("GET", "/openapi/v2", {}),
    ("GET", "/debug/pprof/heap", {}),  # long-running, though not a resource
    ("GET", "/livez/ping", {}),
]


@dataclass(frozen=True)
class Compared:
    cluster: LocalCluster
    gate: Opgate
    apiserver_log: Path
    opgate_log: Path
    token: str


@pytest.fixture(scope="module")
def compared(kube_binaries: KubeBinaries,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Compared]:
    base = tmp_path_factory.mktemp("audit-pol")
    cluster, apiserver_log = audited_cluster(kube_binaries, base, APISERVER_POLICY)
    gate = None
    try:
        cluster.create_service_account_with_rbac(NS, SA_NAME, [
            {"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]},
            {"nonResourceURLs": ["*"], "verbs": ["*"]}], cluster_wide=True)
        token_file = admin_token_file(cluster, base)
        opgate_log = base / "opgate-audit.log"
        gate = start_opgate(cluster, base / "opgate", policies={"audit.yaml": OPGATE_POLICY},
                            extra_args=["--token-file", str(token_file),
                                        "--audit-log", str(opgate_log)])
        yield Compared(cluster=cluster, gate=gate, apiserver_log=apiserver_log,
                       opgate_log=opgate_log, token=cluster.token_request(NS, SA_NAME))
    finally:
        if gate is not None:
            gate.stop()
        cluster.stop()


def stages(path: Path, prefix: str) -> dict[str, set[tuple[str, str]]]:
    """The (stage, level) pairs of each auditID starting with ``prefix`` in ``path``."""
    found: dict[str, set[tuple[str, str]]] = {}
    for line in path.read_text().splitlines() if path.exists() else ():
        ev: dict[str, Any] = json.loads(line)
        if ev["auditID"].startswith(prefix):
            found.setdefault(ev["auditID"], set()).add((ev["stage"], ev["level"]))
    return found


def logged(path: Path, prefix: str, last: str,
           timeout: float = 30.0) -> dict[str, set[tuple[str, str]]]:
    """:func:`stages` once the ResponseComplete of ``last`` (the call made after all the
    others) is in ``path``: both sides write a call's events in order, as the calls end."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = stages(path, prefix)
        if ("ResponseComplete", "Metadata") in found.get(last, ()):
            return found
        time.sleep(0.1)
    pytest.fail(f"{path.name} lacks the ResponseComplete of {last}")


def send(compared: Compared, audit_id: str, method: str, path: str,
         headers: dict[str, str]) -> int:
    return compared.cluster.call(method, path, token=compared.token,
                                 headers={"Audit-ID": audit_id, **headers},
                                 server=compared.gate.url).status


def test_each_call_gets_the_apiservers_stages_at_its_level(compared: Compared) -> None:
    sent = []
    for i, (method, path, headers) in enumerate(CALLS):
        audit_id = f"pol-{i}-{method.lower()}"
        send(compared, audit_id, method, path, headers)
        sent.append(audit_id)
    last = "pol-end"
    assert send(compared, last, "GET", "/version", {}) == 200
    ours = logged(compared.opgate_log, "pol-", last)
    theirs = logged(compared.apiserver_log, "pol-", last)
    differ = {(audit_id, *CALLS[i][:2]): (sorted(ours.get(audit_id, ())),
                                          sorted(theirs.get(audit_id, ())))
              for i, audit_id in enumerate(sent) if ours.get(audit_id) != theirs.get(audit_id)}
    assert differ == {}, "\n".join(f"{key}: opgate {a}, apiserver {b}"
                                   for key, (a, b) in differ.items())
    # the calls tell the rules apart: nothing, one stage, both; each level
    assert {frozenset(v) for v in theirs.values()} >= {
        frozenset({("ResponseComplete", "Metadata")}), frozenset({("ResponseComplete",
                                                                   "Request")}),
        frozenset({("ResponseStarted", "Request"), ("ResponseComplete", "Request")}),
        frozenset({("ResponseStarted", "Metadata"), ("ResponseComplete", "Metadata")})}
    assert set(sent) - set(theirs)  # and some calls get no event at all
