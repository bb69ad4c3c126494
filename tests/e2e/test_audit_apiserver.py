"""opgate's audit log against the apiserver's own, event by event, for the same calls.

A cluster of this module's own (the session one has no audit flags) runs kube-apiserver with
``--audit-log-path`` and ``--audit-policy-file``; an opgate in front of it verifies the caller's
ServiceAccount token and logs with ``spec.audit`` at the same levels (configmaps at
RequestResponse, deployments at Request, the rest at Metadata; the apiserver's Policy omits no
stage, so it also writes RequestReceived, which opgate never does); a second one accepts no
issuer's keys, so the apiserver vouches for every token (TokenReview). Each call sends its own
``Audit-ID``, so the apiserver's event and opgate's for one call share it and are paired by it.
Both are compared field by field, in the JSON's order, after :func:`normalize`, which takes out
exactly what legitimately differs (each item says why; the README's "Audit" section lists them too).
"""

from __future__ import annotations

import copy
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proxy.envtest.binaries import KubeBinaries
from proxy.envtest.cluster import DEFAULT_ISSUER, LocalCluster
from tests.e2e.conftest import Opgate, start_opgate
from tests.e2e.test_identity_websocket import reviews
from tests.e2e.test_protobuf import MAGIC, PROTOBUF, _field, configmap_protobuf

pytestmark = pytest.mark.e2e

NS = "audit-cmp"
SA_NAME = "compared"
USER = f"system:serviceaccount:{NS}:{SA_NAME}"
# an audience the apiserver accepts (--api-audiences) and opgate does not know: it asks (a
# TokenReview) about a service-account token of it
REVIEWED_AUDIENCE = "audit-cmp.example.com"
MICRO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")
# the same levels on both sides: the apiserver's Policy and opgate's spec.audit
RULES = f"""\
  - level: RequestResponse
    users: ["{USER}"]
    resources: [{{group: "", resources: [configmaps]}}]
  - level: Request
    users: ["{USER}"]
    resources: [{{group: apps, resources: [deployments, deployments/scale, deployments/status]}}]
  - level: Metadata
    users: ["{USER}"]
  - level: Metadata
    resources: [{{group: "", resources: [namespaces]}}]
"""
APISERVER_POLICY = f"""\
apiVersion: audit.k8s.io/v1
kind: Policy
omitManagedFields: true
rules:
{RULES}  - level: None
"""
OPGATE_POLICY = f"""\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: audit-cmp}}
spec:
  allowImpersonation: true
  identity:
    issuers: [{{kubernetes: {{}}}}]
    allow: [{{serviceAccount: {NS}/{SA_NAME}}}]
    rules:
      - {{name: no-secrets, effect: deny, resources: [secrets]}}
      - {{name: no-posts, effect: deny, verbs: [post]}}
      - {{name: no-rs-scale, effect: deny, apiGroups: [apps], resources: [replicasets/scale]}}
      - {{name: all, verbs: ["*"]}}
  audit:
    level: None
    omitManagedFields: true
    rules:
{"".join("  " * 2 + line + chr(10) for line in RULES.splitlines())}"""


@dataclass(frozen=True)
class Setup:
    cluster: LocalCluster
    gate: Opgate
    apiserver_log: Path
    opgate_log: Path
    token: str
    bound: dict[str, str]  # tokens bound to objects, by what they are bound to (BOUND)
    reviewing: Opgate  # a second opgate, its own audit log for the tokens below
    reviewed: dict[str, str]  # tokens of REVIEWED_AUDIENCE: plain, pod-on-node
    reviewed_log: Path


def audited_cluster(binaries: KubeBinaries, base: Path, policy_text: str,
                    *extra_args: str) -> tuple[LocalCluster, Path]:
    """A started kube-apiserver writing its audit log (the path returned) by the audit
    policy ``policy_text``; ``base`` holds both files."""
    policy = base / "apiserver-audit-policy.yaml"
    policy.write_text(policy_text)
    apiserver_log = base / "apiserver-audit.log"
    cluster = LocalCluster(binaries=binaries, extra_apiserver_args=(
        f"--audit-log-path={apiserver_log}", f"--audit-policy-file={policy}", *extra_args))
    try:
        cluster.start()
    except RuntimeError as exc:
        pytest.fail(f"the audited kube-apiserver did not start: {exc}", pytrace=False)
    return cluster, apiserver_log


def admin_token_file(cluster: LocalCluster, base: Path) -> Path:
    """The cluster admin's token in a file only its owner reads: opgate's own credentials."""
    token_file = base / "opgate-token"
    token_file.write_text(cluster.admin_token)
    token_file.chmod(0o600)
    return token_file


@pytest.fixture(scope="module")
def setup(kube_binaries: KubeBinaries,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    base = tmp_path_factory.mktemp("audit-cmp")
    cluster, apiserver_log = audited_cluster(
        kube_binaries, base, APISERVER_POLICY,
        f"--api-audiences={DEFAULT_ISSUER},{REVIEWED_AUDIENCE}")
    gate = reviewing = None
    try:
        cluster.create_namespace(NS)
        rules = [{"apiGroups": ["", "apps"], "verbs": ["*"],
                  "resources": ["configmaps", "events", "deployments", "deployments/scale",
                                "deployments/status"]},
                 {"apiGroups": [""], "resources": ["users"], "verbs": ["impersonate"],
                  "resourceNames": ["bob"]},
                 {"apiGroups": ["authentication.k8s.io"], "verbs": ["impersonate"],
                  "resources": ["userextras/scopes", "userextras/example.com/team"]}]
        cluster.create_service_account_with_rbac(NS, SA_NAME, rules, cluster_wide=True)
        token_file = admin_token_file(cluster, base)
        opgate_log = base / "opgate-audit.log"
        gate = start_opgate(cluster, base / "opgate", policies={"audit.yaml": OPGATE_POLICY},
                            extra_args=["--token-file", str(token_file),
                                        "--audit-log", str(opgate_log)])
        reviewed_log = base / "reviewed-audit.log"
        reviewing = start_opgate(
            cluster, base / "reviewing",
            policies={"audit.yaml": OPGATE_POLICY},
            extra_args=["--token-file", str(token_file), "--audit-log", str(reviewed_log)])
        yield Setup(cluster=cluster, gate=gate, apiserver_log=apiserver_log,
                    opgate_log=opgate_log, token=cluster.token_request(NS, SA_NAME),
                    bound=bound_tokens(cluster), reviewing=reviewing,
                    reviewed=reviewed_tokens(cluster), reviewed_log=reviewed_log)
    finally:
        for started in (gate, reviewing):
            if started is not None:
                started.stop()
        cluster.stop()


NODE = "audit-node"
# what a token is bound to → the keys of user.extra the apiserver gives it, besides its
# credential id (every TokenRequest token has a jti)
BOUND: dict[str, tuple[str, ...]] = {
    "pod-on-node": ("node-name", "node-uid", "pod-name", "pod-uid"),
    "pod-on-missing-node": ("node-name", "pod-name", "pod-uid"),  # TokenRequest found no Node
    "pod-unscheduled": ("pod-name", "pod-uid"),
    "node": ("node-name", "node-uid"),
    "secret": (),
}


def bound_tokens(cluster: LocalCluster) -> dict[str, str]:
    """A token of the compared ServiceAccount bound to each kind of object (:data:`BOUND`),
    as a kubelet asks for a pod's projected token."""
    cluster.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    node_of = {"pod-on-node": NODE, "pod-on-missing-node": "no-such-node", "pod-unscheduled": ""}
    for name, node in node_of.items():
        cluster.apply({"apiVersion": "v1", "kind": "Pod",
                       "metadata": {"name": name, "namespace": NS},
                       "spec": {"serviceAccountName": SA_NAME,
                                **({"nodeName": node} if node else {}),
                                "containers": [{"name": "c", "image": "x"}]}})
    cluster.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "bound-to",
                                                                       "namespace": NS}})
    refs = {**{name: {"kind": "Pod", "name": name} for name in node_of},
            "node": {"kind": "Node", "name": NODE}, "secret": {"kind": "Secret",
                                                                "name": "bound-to"}}
    return {what: cluster.token_request(NS, SA_NAME, bound_to={"apiVersion": "v1", **ref})
            for what, ref in refs.items()}


def reviewed_tokens(cluster: LocalCluster) -> dict[str, str]:
    """Tokens of the compared ServiceAccount for :data:`REVIEWED_AUDIENCE` only, one of them
    bound to the pod on the node (made by :func:`bound_tokens`)."""
    pod = {"apiVersion": "v1", "kind": "Pod", "name": "pod-on-node"}
    return {bound: cluster.token_request(NS, SA_NAME, audiences=[REVIEWED_AUDIENCE],
                                         bound_to=pod if bound == "pod-on-node" else None)
            for bound in ("plain", "pod-on-node")}


def read_events(path: Path) -> list[dict[str, Any]]:
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines()]


def by_id(path: Path, want: set[tuple[str, str]],
          timeout: float = 30.0) -> dict[tuple[str, str], dict[str, Any]]:
    """The events of ``path`` by (auditID, stage), once all of ``want`` are there."""
    deadline = time.monotonic() + timeout
    found: dict[tuple[str, str], dict[str, Any]] = {}
    while time.monotonic() < deadline:
        found = {(e["auditID"], e["stage"]): e for e in read_events(path)}
        if want <= set(found):
            return found
        time.sleep(0.1)
    pytest.fail(f"{path.name} lacks {sorted(want - set(found))}")


def subset(part: Any, whole: Any) -> bool:
    """Whether ``whole`` has everything ``part`` has (the apiserver adds defaults)."""
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(
            k in whole and subset(v, whole[k]) for k, v in part.items())
    if isinstance(part, list):
        return (isinstance(whole, list) and len(part) == len(whole)
                and all(subset(p, w) for p, w in zip(part, whole, strict=True)))
    return bool(part == whole)


def normalize(ours: dict[str, Any], theirs: dict[str, Any]) -> tuple[dict[str, Any],
                                                                      dict[str, Any]]:
    """Both events without what legitimately differs; what is taken out is checked here."""
    ours, theirs = copy.deepcopy(ours), copy.deepcopy(theirs)
    for ev in (ours, theirs):
        # moments of two processes: only their format and order can be the same
        for key in ("requestReceivedTimestamp", "stageTimestamp"):
            assert MICRO.fullmatch(ev[key]), ev[key]
        assert ev["requestReceivedTimestamp"] <= ev.pop("stageTimestamp")
        del ev["requestReceivedTimestamp"]
    # each side annotates its own decision: opgate's opgate.dev/*, the apiserver's authorization
    assert ours.pop("annotations")["opgate.dev/decision"] in ("allowed", "denied",
                                                               "unauthorized")
    theirs.pop("annotations", None)
    # responseObject: opgate streams response bodies (RequestResponse logs what Request does)
    assert "responseObject" not in ours
    theirs.pop("responseObject", None)
    # responseStatus: opgate does not read the apiserver's error or Status bodies, only the code
    if ours["responseStatus"].keys() == {"metadata", "code"}:
        theirs["responseStatus"] = {"metadata": {}, "code": theirs["responseStatus"]["code"]}
    # requestObject: the apiserver logs the object decoded and defaulted (a protobuf body too);
    # opgate the JSON as sent
    if "requestObject" in ours:
        assert subset(ours.pop("requestObject"), theirs.pop("requestObject"))
    elif ours["verb"] in ("create", "update") and "requestObject" in theirs:
        assert ours["objectRef"]["resource"] == "configmaps"  # the protobuf one
        del theirs["requestObject"]
    # a create's name at Metadata: opgate reads no body for it (the README says so)
    if ours["verb"] == "create" and ours["level"] == "Metadata" and "name" not in ours.get(
            "objectRef", {}):
        theirs.get("objectRef", {}).pop("name", None)
    return ours, theirs


def assert_same(ours: dict[str, Any], theirs: dict[str, Any], key: object = "") -> None:
    """The same fields with the same values, in the same order (as JSON text)."""
    a, b = json.dumps(ours), json.dumps(theirs)
    assert a == b, f"{key}\nopgate:    {a}\napiserver: {b}"


def send(setup: Setup, audit_id: str, method: str, path: str, body: Any = None,
         ctype: str | None = None, headers: dict[str, str] | None = None,
         server: str | None = None) -> int:
    resp = setup.cluster.call(method, path, body=body, content_type=ctype,
                              headers={"Audit-ID": audit_id, "User-Agent": "audit-cmp/1.0",
                                       **(headers or {})},
                              token=setup.token, server=server or setup.gate.url)
    return resp.status


CM = f"/api/v1/namespaces/{NS}/configmaps"
DEPLOY = f"/apis/apps/v1/namespaces/{NS}/deployments"


def configmap(name: str = "", **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {**({"name": name} if name else {}), **meta}, "data": {"k": "v"}}


DEPLOYMENT = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
              "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "d"}},
                       "template": {"metadata": {"labels": {"app": "d"}},
                                    "spec": {"containers": [{"name": "c", "image": "x"}]}}}}
MERGE, STRATEGIC, JSONPATCH, APPLY = (
    "application/merge-patch+json", "application/strategic-merge-patch+json",
    "application/json-patch+json", "application/apply-patch+yaml")
def calls() -> list[tuple[str, str, Any, str | None, dict[str, str], int]]:
    """Every kind of call: method, path, body, content type, extra headers, and the code."""
    return [
        ("POST", CM, configmap("a", labels={"set": "x"}), None, {}, 201),
        ("POST", CM, configmap(generateName="g-"), None, {}, 201),
        ("POST", CM, configmap_protobuf(NS, "pb", {"k": "v"}), PROTOBUF, {}, 201),
        ("GET", f"{CM}/a", None, None, {}, 200),
        ("GET", f"{CM}?limit=5", None, None, {}, 200),
        ("GET", f"{CM}?watch=true&timeoutSeconds=1", None, None, {}, 200),
        ("PUT", f"{CM}/a", {**configmap("a", labels={"set": "x"}), "data": {"k": "v2"}}, None,
         {}, 200),
        ("PATCH", f"{CM}/a", {"data": {"m": "1"}}, MERGE, {}, 200),
        ("PATCH", f"{CM}/a", {"data": {"s": "1"}}, STRATEGIC, {}, 200),
        ("PATCH", f"{CM}/a", [{"op": "add", "path": "/data/j", "value": "1"}], JSONPATCH, {}, 200),
        ("PATCH", f"{CM}/b?fieldManager=cmp", configmap("b"), APPLY, {}, 201),
        ("POST", f"{CM}?dryRun=All", configmap("dry"), None, {}, 201),
        ("GET", f"{CM}/missing", None, None, {}, 404),
        ("GET", f"{CM}/a", None, None, {"Impersonate-User": "bob"}, 403),
        ("GET", f"{CM}/a", None, None, {"Impersonate-User": "bob",
                                        "Impersonate-Extra-Scopes": "view",
                                        "Impersonate-Extra-Example.com%2fteam": "a"}, 403),
        ("POST", f"/api/v1/namespaces/{NS}/events",
         {"apiVersion": "v1", "kind": "Event", "metadata": {"name": "e1"},
          "involvedObject": {"kind": "ConfigMap", "name": "a", "namespace": NS},
          "reason": "Compared", "message": "m"}, None, {}, 201),
        ("POST", DEPLOY, DEPLOYMENT, None, {}, 201),
        ("GET", f"{DEPLOY}/d/scale", None, None, {}, 200),
        ("PATCH", f"{DEPLOY}/d/scale", {"spec": {"replicas": 2}}, MERGE, {}, 200),
        ("GET", f"{DEPLOY}/d/status", None, None, {}, 200),
        ("GET", "/version", None, None, {}, 200),
        ("GET", "/healthz", None, None, {}, 200),
        ("DELETE", f"{CM}/a", None, None, {}, 200),
        ("DELETE", f"{CM}?labelSelector=set%3Dx", None, None, {}, 200),
    ]


def test_each_event_is_the_apiservers_for_the_same_call(setup: Setup) -> None:
    sent = []
    for i, (method, path, body, ctype, headers, code) in enumerate(calls()):
        audit_id = f"cmp-{i}-{method.lower()}"
        got = send(setup, audit_id, method, path, body, ctype, headers)
        assert got == code, (method, path, got)
        sent.append(audit_id)
    want = {(i, "ResponseComplete") for i in sent} | {(sent[5], "ResponseStarted")}
    ours = by_id(setup.opgate_log, want)
    theirs = by_id(setup.apiserver_log, want | {(i, "RequestReceived") for i in sent})
    # the same stages, but for RequestReceived: opgate never writes it (as if omitStages had it)
    assert {k for k in ours if k[0].startswith("cmp-")} == want
    assert {k for k in theirs if k[0].startswith("cmp-")} == want | {
        (i, "RequestReceived") for i in sent}
    for key in sorted(want):
        a, b = normalize(ours[key], theirs[key])
        assert_same(a, b, key)


def test_an_update_is_logged_with_its_objects_uid_and_resource_version(setup: Setup) -> None:
    """client-go's Update and UpdateStatus send the object they read, uid and resourceVersion
    included (JSON, or protobuf for a built-in kind): the apiserver's objectRef has both, from
    the body it decoded; so has opgate's."""
    cluster = setup.cluster
    cluster.call("POST", CM, body=configmap("upd")).ok()
    cluster.call("POST", DEPLOY, body={**DEPLOYMENT, "metadata": {"name": "upd"}}).ok()
    cm = cluster.call("GET", f"{CM}/upd").ok().json()
    deploy = cluster.call("GET", f"{DEPLOY}/upd").ok().json()
    json_update = {**cm, "data": {"k": "json"}}
    status_update = {**deploy, "status": {"observedGeneration": 1}}
    sent = [("upd-json", f"{CM}/upd", json_update, None),
            ("upd-status", f"{DEPLOY}/upd/status", status_update, None)]
    for audit_id, path, body, ctype in sent:
        assert send(setup, audit_id, "PUT", path, body, ctype) == 200, audit_id
    meta = cluster.call("GET", f"{CM}/upd").ok().json()["metadata"]
    pb_meta = b"".join(_field(n, meta[k].encode()) for n, k in (
        (1, "name"), (3, "namespace"), (5, "uid"), (6, "resourceVersion")))
    pb_body = MAGIC + _field(1, _field(1, b"v1") + _field(2, b"ConfigMap")) + _field(
        2, _field(1, pb_meta) + _field(2, _field(1, b"k") + _field(2, b"pb")))
    assert send(setup, "upd-pb", "PUT", f"{CM}/upd", pb_body, PROTOBUF) == 200
    want = {(i, "ResponseComplete") for i in ("upd-json", "upd-status", "upd-pb")}
    ours, theirs = by_id(setup.opgate_log, want), by_id(setup.apiserver_log, want)
    for key in sorted(want):
        assert {"uid", "resourceVersion"} <= set(theirs[key]["objectRef"]), key
        a, b = normalize(ours[key], theirs[key])
        assert_same(a, b, key)


def test_managed_fields_are_omitted_from_objects_not_from_patches(setup: Setup) -> None:
    """``omitManagedFields`` (both policies): the apiserver drops ``metadata.managedFields``
    from the objects it logs (a create's, an update's) but logs a patch as it was sent, so a
    patch that clears them (``managedFields: [{}]``, the documented way) shows it did."""
    setup.cluster.call("POST", CM, body=configmap("mf")).ok()
    cleared = {"metadata": {"managedFields": [{}]}}
    sent = [("mf-merge", "PATCH", f"{CM}/mf", cleared, MERGE),
            ("mf-strategic", "PATCH", f"{CM}/mf", cleared, STRATEGIC),
            ("mf-create", "POST", CM, {**configmap("mf2"), "metadata": {
                "name": "mf2", "managedFields": [{"manager": "m", "operation": "Update",
                                                  "apiVersion": "v1"}]}}, None)]
    for audit_id, method, path, body, ctype in sent:
        assert send(setup, audit_id, method, path, body, ctype) in (200, 201), audit_id
    want = {(audit_id, "ResponseComplete") for audit_id, *_ in sent}
    ours, theirs = by_id(setup.opgate_log, want), by_id(setup.apiserver_log, want)
    for patch in ("mf-merge", "mf-strategic"):  # logged as sent: the same, not a subset
        key = (patch, "ResponseComplete")
        assert ours[key]["requestObject"] == theirs[key]["requestObject"] == cleared
    assert "managedFields" not in theirs[("mf-create", "ResponseComplete")]["requestObject"][
        "metadata"]
    for key in sorted(want):
        a, b = normalize(ours[key], theirs[key])
        assert_same(a, b, key)


def test_a_long_user_agent_is_cut_as_the_apiserver_cuts_it(setup: Setup) -> None:
    """The apiserver logs at most 1,024 bytes of a User-Agent, then ``...TRUNCATED``: a
    client cannot make each event as large as its headers."""
    agent = "audit-cmp/1.0 " + "x" * 2000
    for audit_id in ("ua-long", "ua-1024"):
        value = agent if audit_id == "ua-long" else agent[:1024]
        assert send(setup, audit_id, "GET", f"{CM}?labelSelector=ua%3D{audit_id}",
                    headers={"User-Agent": value}) == 200
    want = {("ua-long", "ResponseComplete"), ("ua-1024", "ResponseComplete")}
    ours, theirs = by_id(setup.opgate_log, want), by_id(setup.apiserver_log, want)
    assert theirs[("ua-long", "ResponseComplete")]["userAgent"] == agent[:1024] + "...TRUNCATED"
    assert theirs[("ua-1024", "ResponseComplete")]["userAgent"] == agent[:1024]
    for key in sorted(want):
        a, b = normalize(ours[key], theirs[key])
        assert_same(a, b, key)


@pytest.mark.parametrize(("method", "path", "rule", "denial", "details"), [
    ("GET", f"/api/v1/namespaces/{NS}/secrets", "no-secrets", "secrets is forbidden",
     {"kind": "secrets"}),
    ("GET", f"/api/v1/namespaces/{NS}/secrets/s", "no-secrets", 'secrets "s" is forbidden',
     {"name": "s", "kind": "secrets"}),
    ("PATCH", f"/apis/apps/v1/namespaces/{NS}/replicasets/r/scale", "no-rs-scale",
     'replicasets.apps "r" is forbidden', {"name": "r", "group": "apps", "kind": "replicasets"}),
    ("POST", "/apis", "no-posts", "forbidden: User", {}),
    ("GET", f"/api/v1/namespaces/{NS}/secrets?watch=true", "no-secrets", "secrets is forbidden",
     {"kind": "secrets"}),
], ids=["list", "named", "group-subresource", "non-resource", "watch"])
def test_a_call_opgate_denies_is_logged_as_the_apiserver_logs_its_own_denial(
        setup: Setup, method: str, path: str, rule: str, denial: str,
        details: dict[str, str]) -> None:
    """The same call through opgate (its rule denies) and straight to the apiserver (RBAC
    denies): the same Status but for its message (opgate's names its rule) and the same
    event, ``responseStatus.details`` included, but for that message (a watch: both its
    events, ResponseStarted and ResponseComplete). client-go and kubectl read the Status'
    reason and code (tests/e2e/test_clientgo.py); its details are the apiserver's."""
    body = {"spec": {"replicas": 1}} if method == "PATCH" else {} if method == "POST" else None
    ctype = "application/merge-patch+json" if method == "PATCH" else None
    mine = f"deny-{rule}-{method}-{path}"
    answers = {}
    for audit_id, server in ((f"{mine}-opgate", setup.gate.url),
                             (f"{mine}-apiserver", setup.cluster.url)):
        resp = setup.cluster.call(method, path, body=body, content_type=ctype, token=setup.token,
                                  server=server, headers={"Audit-ID": audit_id,
                                                          "User-Agent": "audit-cmp/1.0"})
        assert resp.status == 403, (server, resp.body)
        answers[server] = resp.json()
    ours_body, theirs_body = answers[setup.gate.url], answers[setup.cluster.url]
    assert rule in ours_body.pop("message")
    assert theirs_body.pop("message").startswith(denial)
    assert_same(ours_body, theirs_body)  # the same fields, in the same order
    assert theirs_body["details"] == details
    stages = ("ResponseStarted", "ResponseComplete") if "watch" in path else (
        "ResponseComplete",)
    ours_all = by_id(setup.opgate_log, {(f"{mine}-opgate", stage) for stage in stages})
    theirs_all = by_id(setup.apiserver_log, {(f"{mine}-apiserver", stage) for stage in stages})
    assert {k for k in ours_all if k[0] == f"{mine}-opgate"} == {
        (f"{mine}-opgate", stage) for stage in stages}
    assert {k for k in theirs_all if k[0] == f"{mine}-apiserver"} == {
        (f"{mine}-apiserver", stage) for stage in stages} | {
        (f"{mine}-apiserver", "RequestReceived")}
    for stage in stages:
        ours, theirs = ours_all[(f"{mine}-opgate", stage)], theirs_all[(f"{mine}-apiserver", stage)]
        assert ours["annotations"]["opgate.dev/decision"] == "denied"
        assert rule in ours["responseStatus"].pop("message")
        assert theirs["responseStatus"].pop("message").startswith(denial)
        theirs["auditID"] = f"{mine}-opgate"
        a, b = normalize(ours, theirs)
        assert_same(a, b, stage)
        assert b["responseStatus"] == {"metadata": {}, "status": "Failure",
                                       "reason": "Forbidden", "details": details, "code": 403}


@pytest.mark.parametrize("bound", sorted(BOUND))
def test_user_extra_is_the_apiservers_for_tokens_bound_to_objects(setup: Setup,
                                                                  bound: str) -> None:
    """``user.extra`` of a token bound to a pod (on a node, on a node that does not exist, on
    none), to a node, to a secret: the apiserver's own for the same call, key by key (the
    plain token's credential id: every call of the first test)."""
    audit_id = f"extra-{bound}"
    resp = setup.cluster.call("GET", f"{CM}?labelSelector=extra%3D{bound}",
                              token=setup.bound[bound], server=setup.gate.url,
                              headers={"Audit-ID": audit_id, "User-Agent": "audit-cmp/1.0"})
    assert resp.status == 200
    key = (audit_id, "ResponseComplete")
    ours = by_id(setup.opgate_log, {key})[key]
    theirs = by_id(setup.apiserver_log, {key})[key]
    prefix = "authentication.kubernetes.io/"
    assert list(theirs["user"]["extra"]) == [
        prefix + k for k in sorted(("credential-id", *BOUND[bound]))]
    assert theirs["user"]["extra"][prefix + "credential-id"][0].startswith("JTI=")
    a, b = normalize(ours, theirs)
    assert_same(a, b)


def test_an_invalid_token_is_logged_as_the_apiserver_logs_its_own_401(setup: Setup) -> None:
    """opgate's 401 and the apiserver's own for the same call: the same event, user ``{}``,
    but for the Status' message and the stage: the apiserver logs a failed authentication
    once, at ResponseStarted; opgate at ResponseComplete, as every call it answers."""
    path = f"/api/v1/namespaces/{NS}"
    for audit_id, server in (("401-opgate", setup.gate.url), ("401-apiserver", setup.cluster.url)):
        resp = setup.cluster.call("GET", path, token="not-a-token", server=server,
                                  headers={"Audit-ID": audit_id, "User-Agent": "audit-cmp/1.0"})
        assert resp.status == 401
    key = ("401-opgate", "ResponseComplete")
    ours = by_id(setup.opgate_log, {key})[key]
    theirs = by_id(setup.apiserver_log, {("401-apiserver", "ResponseStarted")})[
        ("401-apiserver", "ResponseStarted")]
    assert not [e for e in read_events(setup.apiserver_log)
                if e["auditID"] == "401-apiserver" and e["stage"] != "ResponseStarted"]
    assert ours["annotations"]["opgate.dev/user"] == "unverified"
    assert ours["responseStatus"].pop("message").startswith("opgate: Unauthorized")
    assert theirs["responseStatus"].pop("message") == "Unauthorized"
    theirs["auditID"], theirs["stage"] = "401-opgate", "ResponseComplete"
    a, b = normalize(ours, theirs)
    assert_same(a, b)
    assert (b["user"], b["responseStatus"]) == ({}, {"metadata": {}, "status": "Failure",
                                                     "reason": "Unauthorized", "code": 401})


def test_a_call_without_an_audit_id_has_one_name_in_both_logs(setup: Setup) -> None:
    """client-go and kubectl send no ``Audit-ID``: opgate sends its trace id upstream, so the
    apiserver's event, opgate's and the ``Audit-Id`` the client gets all name the call alike;
    opgate's own answers carry one too, as the apiserver's do."""
    path = f"/api/v1/namespaces/{NS}/configmaps?labelSelector=audit-id%3Dnone"
    resp = setup.cluster.call("GET", path, token=setup.token, server=setup.gate.url)
    assert resp.status == 200
    audit_id = {k.lower(): v for k, v in resp.headers.items()}["audit-id"]
    key = (audit_id, "ResponseComplete")
    ours = by_id(setup.opgate_log, {key})[key]
    theirs = by_id(setup.apiserver_log, {key})[key]
    assert ours["requestURI"] == theirs["requestURI"] == path
    denied = setup.cluster.call("GET", f"/api/v1/namespaces/{NS}/secrets", token=setup.token,
                                server=setup.gate.url)
    assert denied.status == 403
    audit_id = {k.lower(): v for k, v in denied.headers.items()}["audit-id"]
    key = (audit_id, "ResponseComplete")
    assert by_id(setup.opgate_log, {key})[key]["responseStatus"]["code"] == 403


@pytest.mark.parametrize("bound", ["plain", "pod-on-node"])
def test_user_extra_of_a_token_the_apiserver_vouched_for_is_its_own(setup: Setup,
                                                                     bound: str) -> None:
    """A service-account token of an audience opgate does not know, which the apiserver's
    ``--api-audiences`` holds, is the apiserver's to judge (a TokenReview): ``user.extra`` is
    its ``status.user.extra``, the same as the apiserver logs for the call."""
    audit_id = f"reviewed-{bound}"
    token = setup.reviewed[bound]
    before = reviews(setup.reviewing)["authenticated"]
    resp = setup.cluster.call("GET", f"{CM}?labelSelector=reviewed%3D{bound}", token=token,
                              server=setup.reviewing.url,
                              headers={"Audit-ID": audit_id, "User-Agent": "audit-cmp/1.0"})
    assert resp.status == 200
    key = (audit_id, "ResponseComplete")
    ours = by_id(setup.reviewed_log, {key})[key]
    theirs = by_id(setup.apiserver_log, {key})[key]
    assert reviews(setup.reviewing)["authenticated"] == before + 1  # the apiserver vouched
    assert len(theirs["user"]["extra"]) == 1 + len(BOUND.get(bound, ()))
    a, b = normalize(ours, theirs)
    assert_same(a, b)
