"""spec.quotas against the real apiserver: counts from its watch, denials in its own words.

opgate counts the quota'd resources with its own credentials (``--token-file`` with the admin
token): a metadata-only list+watch of configmaps and secrets, the ResourceQuotas, and (the
ClusterResourceQuota API installed here as a CRD, as on OpenShift) the ClusterResourceQuotas and
namespaces. Each test uses its own namespace, so the real ResourceQuota admission and opgate can
be compared word for word (also for a server-side apply that creates). Three more opgates
(one of them with ``--workers 2``) share their reservations through a real redis-server and
take a concurrent burst of creates and applies against one limit. No controller-manager runs: a
ResourceQuota's ``status.used`` is raised by admission but never lowered after a delete, so the
delete test has no ResourceQuota, and the pod tests write what the quota controller would once
a pod finished (no kubelet runs either: the test sets the pods' phase through their status).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.envtest.cluster import LocalCluster
from tests.e2e.conftest import Opgate
from tests.e2e.waiting import wait_for
from tests.integration.redis_server import RedisServer

pytestmark = pytest.mark.e2e

BELOW, ABOVE, FREED = "quota-below", "quota-above", "quota-freed"
DRY, CLUSTER, BARE = "quota-dry", "quota-crq", "quota-bare"
SSA, SHARED = "quota-ssa", "quota-shared"
QUANTITY, COMPACT = "quota-quantity", "quota-compact"
PODS, PODS_BOTH, PODS_COUNT = "quota-pods", "quota-pods-both", "quota-pods-count"
PODS_STUCK = "quota-pods-stuck"
BODIES = "quota-bodies"
CRQ_A, CRQ_B = "quota-crq-a", "quota-crq-b"
TERMINATING, COLLECTION, DRY_RUNS = "quota-terminating", "quota-collection", "quota-dry-runs"
UPSERT, YAML_NS, EVENTS = "quota-upsert", "quota-yaml", "quota-events"
POLICY = f"""\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: e2e-quota}}
spec:
  quotas:
    - resources: [configmaps]
      namespaces: [{BELOW}, {ABOVE}, {BARE}, {SSA}, {BODIES}]
      max: 3
      alignWith: [ResourceQuota, ClusterResourceQuota]
    - resources: [secrets]
      namespaces: [{FREED}, {COMPACT}]
      max: 2
    - resources: [configmaps]
      namespaces: [{QUANTITY}]
      alignWith: [ResourceQuota]
    - name: team-crq-mirror
      resources: [configmaps]
      namespaces: [{CLUSTER}, {CRQ_A}, {CRQ_B}]
      max: 5
      alignWith: [ClusterResourceQuota]
    - resources: [pods]
      namespaces: [{PODS}, {PODS_BOTH}, {PODS_COUNT}, {PODS_STUCK}]
      alignWith: [ResourceQuota]
    - resources: [configmaps]
      namespaces: [{TERMINATING}, {COLLECTION}]
      max: 2
    - resources: [configmaps]
      namespaces: [{DRY_RUNS}]
      max: 3
      alignWith: [ResourceQuota]
    - resources: [services]
      namespaces: [{UPSERT}]
      max: 3
      alignWith: [ResourceQuota]
    - resources: [configmaps]
      namespaces: [{YAML_NS}]
      max: 3
      alignWith: [ResourceQuota]
    - resources: [events]
      namespaces: [{EVENTS}]
      max: 3
      alignWith: [ResourceQuota]
---
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: e2e-quota-dryrun}}
spec:
  mode: dryrun
  quotas:
    - resources: [configmaps]
      namespaces: [{DRY}]
      max: 1
"""
CRQ_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "clusterresourcequotas.quota.openshift.io"},
    "spec": {
        "group": "quota.openshift.io", "scope": "Cluster",
        "names": {"plural": "clusterresourcequotas", "singular": "clusterresourcequota",
                  "kind": "ClusterResourceQuota", "listKind": "ClusterResourceQuotaList"},
        "versions": [{"name": "v1", "served": True, "storage": True, "schema": {
            "openAPIV3Schema": {"type": "object",
                                "x-kubernetes-preserve-unknown-fields": True}}}],
    },
}


def configmap(name: str, namespace: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace}, "data": {"k": name}}


def quota_message(name: str, quota: str, used: int, limit: int,
                  resource: str = "configmaps") -> str:
    key = f"count/{resource}"
    return (f'{resource} "{name}" is forbidden: exceeded quota: {quota}, requested: {key}=1, '
            f"used: {key}={used}, limited: {key}={limit}")


def resource_quota(cluster: LocalCluster, namespace: str, name: str, hard: dict[str, str]) -> None:
    cluster.apply({"apiVersion": "v1", "kind": "ResourceQuota",
                   "metadata": {"name": name, "namespace": namespace}, "spec": {"hard": hard}})
    cluster.set_quota_status(namespace, name)


def metric(gate: Opgate, name: str, labels: dict[str, str]) -> float | None:
    _, text = gate.admin_get("/metrics")
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{"):
            got = line[len(name) + 1:line.index("}")]
            if ",".join(sorted(got.split(","))) == want:
                return float(line.rsplit(" ", 1)[1])
    return None


def start_synced(opgate_factory: Callable[..., Opgate], token_file: Path, crq: str) -> Opgate:
    opgate = opgate_factory(policies={"quota.yaml": POLICY},
                            extra_args=["--token-file", str(token_file)])

    def synced() -> bool:
        _, body = opgate.admin_get("/readyz?verbose")
        line = next((x for x in body.splitlines() if "quota-counts" in x), "")
        return ("configmaps=synced" in line and "secrets=synced" in line
                and "pods=synced" in line and "services=synced" in line
                and "events=synced" in line
                and "resourcequotas=synced" in line
                and f"clusterresourcequotas={crq}" in line)

    wait_for("opgate's quota counts to sync", synced, timeout=30)
    return opgate


@pytest.fixture(scope="module")
def token_file(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    for namespace in (BELOW, ABOVE, FREED, DRY, BARE, SSA, SHARED, QUANTITY, PODS, PODS_BOTH,
                      PODS_COUNT, PODS_STUCK, COMPACT, TERMINATING, COLLECTION, DRY_RUNS,
                      BODIES, UPSERT, YAML_NS, EVENTS):
        cluster.create_namespace(namespace)
    cluster.create_namespace(CLUSTER, labels={"team": "crq"})
    for namespace in (CRQ_A, CRQ_B):
        cluster.create_namespace(namespace, labels={"crq-total": "yes"})
    path = tmp_path_factory.mktemp("quota") / "opgate-token"
    path.write_text(cluster.admin_token)
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def bare_gate(opgate_factory: Callable[..., Opgate], token_file: Path) -> Opgate:
    """An opgate started while the cluster serves no ClusterResourceQuota API."""
    return start_synced(opgate_factory, token_file, "absent")


@pytest.fixture(scope="module")
def gate(cluster: LocalCluster, opgate_factory: Callable[..., Opgate], token_file: Path,
         bare_gate: Opgate) -> Any:
    cluster.install_crd(CRQ_CRD)
    yield start_synced(opgate_factory, token_file, "synced")
    cluster.call("DELETE", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
                           f"{CRQ_CRD['metadata']['name']}")


def kubectl_create(kubectl: Path, kubeconfig: Path,
                   obj: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(kubectl), "--kubeconfig", str(kubeconfig), "create", "-f", "-"],
                          input=json.dumps(obj), capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def via(cluster: LocalCluster, gate: Opgate, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cluster.write_kubeconfig(tmp_path_factory.mktemp("quota-kc") / "via.kubeconfig",
                                    server=gate.url, token=cluster.admin_token,
                                    ca_file=cluster.ca_file)


def test_without_the_cluster_resource_quota_api_nothing_fails(
        cluster: LocalCluster, bare_gate: Opgate) -> None:
    path = f"/api/v1/namespaces/{BARE}/configmaps"
    for i in range(3):
        resp = cluster.call("POST", path, body=configmap(f"b-{i}", BARE), server=bare_gate.url)
        assert resp.status == 201, resp.body
    denied = cluster.call("POST", path, body=configmap("b-3", BARE), server=bare_gate.url)
    assert (denied.status, denied.json()["message"]) == (
        403, quota_message("b-3", "e2e-quota", used=3, limit=3))


def test_policy_max_below_a_resource_quota_denies_at_its_count(
        cluster: LocalCluster, gate: Opgate, kubectl: Path, via: Path) -> None:
    resource_quota(cluster, BELOW, "rq-roomy", {"count/configmaps": "5"})
    for i in range(3):
        out = kubectl_create(kubectl, via, configmap(f"cm-{i}", BELOW))
        assert out.returncode == 0, out.stderr
    before = metric(gate, "opgate_quota_denials_total", {"resource": "configmaps"}) or 0.0
    out = kubectl_create(kubectl, via, configmap("cm-3", BELOW))
    assert out.returncode != 0
    expected = quota_message("cm-3", "e2e-quota", used=3, limit=3)
    assert f"Error from server (Forbidden): error when creating \"STDIN\": {expected}" \
        in out.stderr, out.stderr
    resp = cluster.call("POST", f"/api/v1/namespaces/{BELOW}/configmaps",
                        body=configmap("cm-3", BELOW), server=gate.url)
    assert resp.status == 403
    got = resp.json()
    assert (got["kind"], got["reason"], got["code"], got["message"]) == (
        "Status", "Forbidden", 403, expected)
    assert got["details"] == {"name": "cm-3", "kind": "configmaps"}
    assert metric(gate, "opgate_quota_denials_total", {"resource": "configmaps"}) == before + 2
    wait_for("the usage gauge", lambda: metric(
        gate, "opgate_quota_usage", {"namespace": BELOW, "resource": "configmaps"}) == 3)
    # the apiserver itself would still have admitted it (its quota is 5)
    direct = cluster.call("POST", f"/api/v1/namespaces/{BELOW}/configmaps",
                          body=configmap("cm-3", BELOW))
    assert direct.status == 201, direct.body


def test_a_smaller_resource_quota_is_named_exactly_as_the_apiserver_does(
        cluster: LocalCluster, gate: Opgate, kubectl: Path, via: Path) -> None:
    resource_quota(cluster, ABOVE, "rq-tight", {"count/configmaps": "2", "secrets": "9"})
    for i in range(2):
        out = kubectl_create(kubectl, via, configmap(f"cm-{i}", ABOVE))
        assert out.returncode == 0, out.stderr
    path = f"/api/v1/namespaces/{ABOVE}/configmaps"

    def opgate_denies() -> bool:  # a dry-run create is checked too, and counted when denied
        before = metric(gate, "opgate_quota_denials_total", {"resource": "configmaps"}) or 0.0
        cluster.call("POST", path + "?dryRun=All", body=configmap("probe", ABOVE),
                     server=gate.url)
        return (metric(gate, "opgate_quota_denials_total", {"resource": "configmaps"}) or 0.0) \
            > before

    wait_for("opgate to see rq-tight through its watch", opgate_denies)
    before = metric(gate, "opgate_quota_denials_total", {"resource": "configmaps"}) or 0.0
    ours = cluster.call("POST", path, body=configmap("cm-2", ABOVE), server=gate.url)
    theirs = cluster.call("POST", path, body=configmap("cm-2", ABOVE))
    assert (ours.status, theirs.status) == (403, 403)
    assert ours.json()["message"] == theirs.json()["message"] == quota_message(
        "cm-2", "rq-tight", used=2, limit=2)
    assert ours.json()["details"] == theirs.json()["details"]
    # opgate answered itself: its counter moved
    assert metric(gate, "opgate_quota_denials_total", {"resource": "configmaps"}) == before + 1
    # generateName: the name is generated as the apiserver does
    gen = cluster.call("POST", path, body={"metadata": {"generateName": "gen-"}},
                       server=gate.url)
    assert gen.status == 403
    assert re.fullmatch(r'configmaps "gen-[a-z0-9]{5}" is forbidden: exceeded quota: rq-tight, '
                        r"requested: count/configmaps=1, used: count/configmaps=2, "
                        r"limited: count/configmaps=2", gen.json()["message"]), gen.body


PROTO = "application/vnd.kubernetes.protobuf"
ODD_BODIES = {
    "json-garbage": (b"{not json", "application/json"),
    "json-empty": (b"", "application/json"),
    "json-array": (b"[]", "application/json"),
    "json-metadata-a-list": (b'{"apiVersion": "v1", "kind": "ConfigMap", "metadata": []}',
                             "application/json"),
    "json-name-a-number": (b'{"metadata": {"name": 5}}', "application/json"),
    "json-another-group": (b'{"apiVersion": "apps/v1", "kind": "ConfigMap", '
                           b'"metadata": {"name": "odd"}}', "application/json"),
    "json-no-name": (b'{"apiVersion": "v1", "kind": "ConfigMap"}', "application/json"),
    "protobuf-cut": (b"k8s\x00\xff\xff\xff", PROTO),
    "protobuf-no-prefix": (b"hello", PROTO),
    "protobuf-empty": (b"", PROTO),
}


@pytest.mark.parametrize("case", sorted(ODD_BODIES))
def test_a_body_the_apiserver_cannot_take_gets_its_answer_not_a_quota_403(
        cluster: LocalCluster, gate: Opgate, case: str) -> None:
    """A create body the apiserver cannot decode is its 400 BadRequest, one naming no object
    its 422 Invalid, before any quota admission: at a full quota opgate answered its 403."""
    resource_quota(cluster, BODIES, "rq-full", {"count/configmaps": "0"})
    path = f"/api/v1/namespaces/{BODIES}/configmaps"

    def opgate_denies() -> bool:
        probe = cluster.call("POST", path + "?dryRun=All", body=configmap("probe", BODIES),
                             server=gate.url)
        return probe.status == 403
    wait_for("opgate to see rq-full through its watch", opgate_denies)
    body, ctype = ODD_BODIES[case]
    ours = cluster.call("POST", path, body=body, content_type=ctype, server=gate.url)
    theirs = cluster.call("POST", path, body=body, content_type=ctype)
    assert theirs.status in (400, 422), theirs.body
    assert (ours.status, ours.json()["reason"]) == (theirs.status, theirs.json()["reason"]), (
        ours.body, theirs.body)


def test_a_thousand_reads_as_the_apiserver_prints_it(
        cluster: LocalCluster, gate: Opgate) -> None:
    """The apiserver prints counts as canonical quantities: a ResourceQuota's ``hard: 1000``
    reads back ``1k``, and its ``used`` of 1000 too; opgate's 403 says the same."""
    path = f"/api/v1/namespaces/{QUANTITY}/configmaps"
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        codes = set(pool.map(lambda i: cluster.call(
            "POST", path, body={"metadata": {"name": f"k-{i}"}}).status, range(1000)))
    assert codes == {201}
    cluster.apply({"apiVersion": "v1", "kind": "ResourceQuota",
                   "metadata": {"name": "rq-1k", "namespace": QUANTITY},
                   "spec": {"hard": {"count/configmaps": "1000"}}})
    quota_path = f"/api/v1/namespaces/{QUANTITY}/resourcequotas/rq-1k"
    quota = cluster.call("GET", quota_path).ok().json()  # what the quota controller writes
    quota["status"] = {"hard": quota["spec"]["hard"], "used": {"count/configmaps": "1000"}}
    cluster.call("PUT", quota_path + "/status", body=quota).ok()
    wait_for("the watch to count them", lambda: metric(
        gate, "opgate_quota_usage", {"namespace": QUANTITY, "resource": "configmaps"}) == 1000)
    wait_for("opgate to see rq-1k", lambda: cluster.call(
        "POST", path + "?dryRun=All", body={"metadata": {"name": "probe"}},
        server=gate.url).status == 403)
    ours = cluster.call("POST", path, body=configmap("over", QUANTITY), server=gate.url)
    theirs = cluster.call("POST", path, body=configmap("over", QUANTITY))
    assert (ours.status, theirs.status) == (403, 403), (ours.body, theirs.body)
    assert ours.json()["message"] == theirs.json()["message"] == (
        'configmaps "over" is forbidden: exceeded quota: rq-1k, requested: count/configmaps=1, '
        "used: count/configmaps=1k, limited: count/configmaps=1k")


def test_deletes_free_room_and_direct_creates_count(
        cluster: LocalCluster, gate: Opgate) -> None:
    path = f"/api/v1/namespaces/{FREED}/secrets"

    def secret(name: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}}

    assert cluster.call("POST", path, body=secret("direct-0")).status == 201  # not via opgate
    wait_for("the watch to count the direct create", lambda: metric(
        gate, "opgate_quota_usage", {"namespace": FREED, "resource": "secrets"}) == 1)
    assert cluster.call("POST", path, body=secret("s-1"), server=gate.url).status == 201
    denied = cluster.call("POST", path, body=secret("s-2"), server=gate.url)
    assert denied.status == 403
    assert denied.json()["message"] == quota_message("s-2", "e2e-quota", 2, 2, "secrets")
    wait_for("the watch to count s-1", lambda: metric(
        gate, "opgate_quota_usage", {"namespace": FREED, "resource": "secrets"}) == 2)
    # a delete made directly frees the room once the watch reports it
    assert cluster.call("DELETE", f"{path}/direct-0").status == 200
    wait_for("the watch to count the delete", lambda: metric(
        gate, "opgate_quota_usage", {"namespace": FREED, "resource": "secrets"}) == 1)
    assert cluster.call("POST", path, body=secret("s-2"), server=gate.url).status == 201
    assert cluster.call("POST", path, body=secret("s-3"), server=gate.url).status == 403


def test_creates_the_apiserver_refuses_in_a_terminating_namespace_hold_no_room(
        cluster: LocalCluster, gate: Opgate) -> None:
    """A namespace being deleted (no controller-manager runs: it stays Terminating): the
    apiserver refuses every create in it, and each refusal releases the room opgate reserved,
    so the creates past the limit get the apiserver's refusal, not opgate's quota."""
    path = f"/api/v1/namespaces/{TERMINATING}/configmaps"
    assert cluster.call("DELETE", f"/api/v1/namespaces/{TERMINATING}").status == 200
    for i in range(4):  # twice the limit
        ours = cluster.call("POST", path, body=configmap(f"t-{i}", TERMINATING), server=gate.url)
        theirs = cluster.call("POST", path, body=configmap(f"t-{i}", TERMINATING))
        assert (ours.status, ours.body) == (theirs.status, theirs.body)
        assert ours.status == 403 and ours.json()["details"]["causes"][0]["reason"] == \
            "NamespaceTerminating", ours.body


def test_a_deletecollection_by_label_frees_room(cluster: LocalCluster, gate: Opgate) -> None:
    path = f"/api/v1/namespaces/{COLLECTION}/configmaps"
    for i in range(2):
        made = dict(configmap(f"c-{i}", COLLECTION))
        made["metadata"] = dict(made["metadata"], labels={"batch": "one"})
        assert cluster.call("POST", path, body=made, server=gate.url).status == 201
    assert cluster.call("POST", path, body=configmap("c-2", COLLECTION),
                        server=gate.url).status == 403
    gone = cluster.call("DELETE", f"{path}?labelSelector=batch%3Done", server=gate.url)
    assert gone.status == 200 and len(gone.json()["items"]) == 2
    wait_for("the watch to count the deletes", lambda: metric(
        gate, "opgate_quota_usage", {"namespace": COLLECTION, "resource": "configmaps"}) == 0)
    for name in ("c-2", "c-3"):
        assert cluster.call("POST", path, body=configmap(name, COLLECTION),
                            server=gate.url).status == 201
    assert cluster.call("POST", path, body=configmap("c-4", COLLECTION),
                        server=gate.url).status == 403


def test_dry_run_creates_take_no_room_and_are_denied_as_the_apiserver_denies_them(
        cluster: LocalCluster, gate: Opgate) -> None:
    """``?dryRun=All`` (kubectl --dry-run=server): checked, never reserved; over the limit
    refused in the words of the apiserver's own ResourceQuota admission, which checks dry
    runs too."""
    path = f"/api/v1/namespaces/{DRY_RUNS}/configmaps"
    resource_quota(cluster, DRY_RUNS, "rq-dry", {"count/configmaps": "2"})  # below max: 3
    for i in range(4):
        dry = cluster.call("POST", f"{path}?dryRun=All", body=configmap(f"d-{i}", DRY_RUNS),
                           server=gate.url)
        assert dry.status == 201, dry.body
    for name in ("r-0", "r-1"):  # the dry runs left the room free
        assert cluster.call("POST", path, body=configmap(name, DRY_RUNS),
                            server=gate.url).status == 201

    def dry_run() -> Any:
        return cluster.call("POST", f"{path}?dryRun=All", body=configmap("d-9", DRY_RUNS),
                            server=gate.url)

    wait_for("opgate to count r-0 and r-1", lambda: dry_run().status == 403)
    ours = dry_run()
    theirs = cluster.call("POST", f"{path}?dryRun=All", body=configmap("d-9", DRY_RUNS))
    assert (ours.status, theirs.status) == (403, 403), (ours.body, theirs.body)
    assert ours.json()["message"] == theirs.json()["message"] == quota_message(
        "d-9", "rq-dry", used=2, limit=2)


def test_a_burst_through_opgate_does_not_overshoot(cluster: LocalCluster, gate: Opgate) -> None:
    import concurrent.futures

    path = f"/api/v1/namespaces/{FREED}/secrets"
    for name in ("s-1", "s-2"):
        assert cluster.call("DELETE", f"{path}/{name}").status == 200
    wait_for("the deletes to be counted", lambda: metric(
        gate, "opgate_quota_usage", {"namespace": FREED, "resource": "secrets"}) == 0)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda i: cluster.call(
            "POST", path, body={"metadata": {"name": f"burst-{i}"}}, server=gate.url).status,
            range(8)))
    assert sorted(codes) == [201, 201] + [403] * 6, codes
    listed = cluster.call("GET", path).json()["items"]
    assert len(listed) == 2


def test_dryrun_warns_and_does_not_deny(
        cluster: LocalCluster, gate: Opgate, kubectl: Path, via: Path) -> None:
    first = kubectl_create(kubectl, via, configmap("dry-0", DRY))
    assert first.returncode == 0, first.stderr
    assert "Warning" not in first.stderr
    second = kubectl_create(kubectl, via, configmap("dry-1", DRY))
    assert second.returncode == 0, second.stderr
    assert ('Warning: opgate: quota "e2e-quota-dryrun" of policy "e2e-quota-dryrun" would '
            "deny this create (dryrun): " + quota_message("dry-1", "e2e-quota-dryrun", 1, 1)
            ) in second.stderr, second.stderr
    assert cluster.call("GET", f"/api/v1/namespaces/{DRY}/configmaps/dry-1").status == 200


def test_a_cluster_resource_quota_selecting_the_namespace_limits_it(
        cluster: LocalCluster, gate: Opgate) -> None:
    cluster.apply({"apiVersion": "quota.openshift.io/v1", "kind": "ClusterResourceQuota",
                   "metadata": {"name": "crq-team"},
                   "spec": {"selector": {"labels": {"matchLabels": {"team": "crq"}}},
                            "quota": {"hard": {"count/configmaps": "1"}}}})
    path = f"/api/v1/namespaces/{CLUSTER}/configmaps"
    assert cluster.call("POST", path, body=configmap("c-0", CLUSTER), server=gate.url).status \
        == 201

    def probe() -> Any:
        return cluster.call("POST", path + "?dryRun=All", body=configmap("c-1", CLUSTER),
                            server=gate.url)

    wait_for("opgate to see crq-team", lambda: probe().status == 403)
    denied = cluster.call("POST", path, body=configmap("c-1", CLUSTER), server=gate.url)
    assert denied.status == 403
    assert denied.json()["message"] == quota_message("c-1", "crq-team", 1, 1)
    # a namespace the quota does not select is limited by the policy's own max only
    cluster.create_namespace(CLUSTER, labels={"team": "other"})
    wait_for("opgate to see the new labels", lambda: probe().status == 201)
    assert cluster.call("POST", path, body=configmap("c-1", CLUSTER), server=gate.url).status \
        == 201


def test_a_cluster_resource_quota_counts_all_its_namespaces_together(
        cluster: LocalCluster, gate: Opgate) -> None:
    """OpenShift checks a ClusterResourceQuota against its status.total, the objects of all the
    namespaces it selects: objects in one take room in the other, and its 403 says the sum."""
    cluster.apply({"apiVersion": "quota.openshift.io/v1", "kind": "ClusterResourceQuota",
                   "metadata": {"name": "crq-total"},
                   "spec": {"selector": {"labels": {"matchLabels": {"crq-total": "yes"}}},
                            "quota": {"hard": {"count/configmaps": "3"}}}})
    for i in range(2):  # directly, in the other namespace
        assert cluster.call("POST", f"/api/v1/namespaces/{CRQ_B}/configmaps",
                            body=configmap(f"b-{i}", CRQ_B)).status == 201
    wait_for("the watch to count them", lambda: metric(
        gate, "opgate_quota_usage", {"namespace": CRQ_B, "resource": "configmaps"}) == 2)
    path = f"/api/v1/namespaces/{CRQ_A}/configmaps"
    assert cluster.call("POST", path, body=configmap("a-0", CRQ_A), server=gate.url).status \
        == 201
    wait_for("opgate to see crq-total", lambda: cluster.call(
        "POST", path + "?dryRun=All", body=configmap("probe", CRQ_A),
        server=gate.url).status == 403)
    denied = cluster.call("POST", path, body=configmap("a-1", CRQ_A), server=gate.url)
    assert denied.status == 403
    assert denied.json()["message"] == quota_message("a-1", "crq-total", 3, 3)


def test_counts_recover_after_the_apiserver_comes_back(
        cluster: LocalCluster, gate: Opgate) -> None:
    """The watches break while the apiserver is down; opgate relists when it is back, so what
    changed meanwhile (here: right after it came back) is counted."""
    freed = f"/api/v1/namespaces/{FREED}/secrets"
    for item in cluster.call("GET", freed).json()["items"]:  # start from two, made directly
        assert cluster.call("DELETE", f"{freed}/{item['metadata']['name']}").status == 200
    for name in ("r-0", "r-1"):
        assert cluster.call("POST", freed, body={"metadata": {"name": name}}).status == 201
    wait_for("the watch to count them", lambda: metric(
        gate, "opgate_quota_usage", {"namespace": FREED, "resource": "secrets"}) == 2)
    cluster.stop_apiserver()
    try:  # the last counts still hold: opgate answers the over-quota create itself
        down = cluster.call("POST", freed, body={"metadata": {"name": "x"}}, server=gate.url)
        assert down.status == 403, down.body
    finally:
        cluster.start_apiserver()
    assert cluster.call("DELETE", f"{freed}/r-0").status == 200  # directly
    wait_for("opgate to count the delete made after the restart", lambda: metric(
        gate, "opgate_quota_usage", {"namespace": FREED, "resource": "secrets"}) == 1,
        timeout=60)
    assert cluster.call("POST", freed, body={"metadata": {"name": "after-restart"}},
                        server=gate.url).status == 201
    assert cluster.call("POST", freed, body={"metadata": {"name": "one-too-many"}},
                        server=gate.url).status == 403


def test_counts_relist_exactly_after_the_watch_falls_behind_a_compaction(
        cluster: LocalCluster, gate: Opgate) -> None:
    """opgate is away (SIGSTOP) while the apiserver restarts after an etcd compaction and
    objects change: its watch resumes from a resourceVersion etcd no longer has, gets 410 and
    lists again. The count is what the apiserver holds, the deleted object not counted twice
    nor the new ones missed: a create over the limit is refused, a delete frees its room."""
    path = f"/api/v1/namespaces/{COMPACT}/secrets"
    assert cluster.call("POST", path, body={"metadata": {"name": "keep"}}).status == 201
    wait_for("the watch to count it", lambda: metric(
        gate, "opgate_quota_usage", {"namespace": COMPACT, "resource": "secrets"}) == 1)
    os.kill(gate.pid, signal.SIGSTOP)
    try:
        cluster.compact_etcd()
        cluster.restart_apiserver()
        assert cluster.call("DELETE", f"{path}/keep").status == 200
        for name in ("new-0", "new-1"):
            assert cluster.call("POST", path, body={"metadata": {"name": name}}).status == 201
    finally:
        os.kill(gate.pid, signal.SIGCONT)
    over = {"metadata": {"name": "over"}}
    wait_for("opgate to list again and refuse a third", lambda: cluster.call(
        "POST", path + "?dryRun=All", body=over, server=gate.url).status == 403, timeout=60)
    assert metric(gate, "opgate_quota_usage", {"namespace": COMPACT, "resource": "secrets"}) == 2
    denied = cluster.call("POST", path, body=over, server=gate.url)
    assert (denied.status, denied.json()["message"]) == (
        403, quota_message("over", "e2e-quota", 2, 2, "secrets"))
    assert cluster.call("DELETE", f"{path}/new-0").status == 200
    wait_for("the watch to count the delete", lambda: metric(
        gate, "opgate_quota_usage", {"namespace": COMPACT, "resource": "secrets"}) == 1)
    assert cluster.call("POST", path, body=over, server=gate.url).status == 201


def test_the_aiohttp_relay_core_reads_the_name_too(
        cluster: LocalCluster, opgate_factory: Callable[..., Opgate], token_file: Path,
        gate: Opgate) -> None:
    other = opgate_factory(policies={"quota.yaml": POLICY},
                           extra_args=["--token-file", str(token_file), "--relay", "aiohttp"])
    path = f"/api/v1/namespaces/{BELOW}/configmaps"  # full: four, the policy allows three

    def denied() -> Any:
        return cluster.call("POST", path, body=configmap("via-aiohttp", BELOW), server=other.url)

    wait_for("the aiohttp-core opgate to sync", lambda: denied().status == 403)
    assert denied().json()["message"] == quota_message("via-aiohttp", "e2e-quota", 4, 3)


# --- pods: count/pods counts every pod, the legacy pods only those not finished ---------------

def pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}}


def finish_pod(cluster: LocalCluster, namespace: str, name: str, phase: str) -> None:
    """What a kubelet reports once the pod's containers ended (there is none here)."""
    path = f"/api/v1/namespaces/{namespace}/pods/{name}"
    obj = cluster.call("GET", path).ok().json()
    obj["status"]["phase"] = phase
    cluster.call("PUT", path + "/status", body=obj).ok()


def quota_used(cluster: LocalCluster, namespace: str, name: str, used: dict[str, str]) -> None:
    """Write a ResourceQuota's ``status.used`` as the quota controller recounts it (it lowers
    ``pods`` once a pod finished; admission only ever raises it)."""
    path = f"/api/v1/namespaces/{namespace}/resourcequotas/{name}"
    quota = cluster.call("GET", path).ok().json()
    quota["status"]["used"] = used
    cluster.call("PUT", path + "/status", body=quota).ok()


def pod_finishes(cluster: LocalCluster, gate: Opgate, namespace: str, name: str, *, phase: str,
                 quota: str, used: dict[str, str]) -> None:
    """Pod ``name`` ends in ``phase``, the quota controller recounts ``quota``'s ``used``, and
    opgate's watch of the finished pods shows it (a dry-run create passes again)."""
    finish_pod(cluster, namespace, name, phase)
    quota_used(cluster, namespace, quota, used)
    path = f"/api/v1/namespaces/{namespace}/pods"
    wait_for(f"opgate to see {name} finished", lambda: cluster.call(
        "POST", path + "?dryRun=All", body=pod("probe"), server=gate.url).status == 201)


def both_deny(cluster: LocalCluster, gate: Opgate, namespace: str, name: str) -> str:
    """The 403 of opgate and of the apiserver's own admission for one pod create: the same."""
    path = f"/api/v1/namespaces/{namespace}/pods"
    ours = cluster.call("POST", path, body=pod(name), server=gate.url)
    theirs = cluster.call("POST", path, body=pod(name))
    assert (ours.status, theirs.status) == (403, 403), (ours.body, theirs.body)
    assert ours.json()["message"] == theirs.json()["message"]
    assert ours.json()["details"] == theirs.json()["details"] == {"name": name, "kind": "pods"}
    return str(ours.json()["message"])


def test_finished_pods_free_room_under_a_pods_quota(
        cluster: LocalCluster, gate: Opgate) -> None:
    """The apiserver's legacy ``pods`` counts the pods not Succeeded or Failed: with completed
    pods lingering, opgate admits what the apiserver admits and denies in its words."""
    resource_quota(cluster, PODS, "rq-pods", {"pods": "2"})
    path = f"/api/v1/namespaces/{PODS}/pods"
    for name in ("p-0", "p-1"):
        assert cluster.call("POST", path, body=pod(name), server=gate.url).status == 201
    assert both_deny(cluster, gate, PODS, "p-2") == (
        'pods "p-2" is forbidden: exceeded quota: rq-pods, requested: pods=1, used: pods=2, '
        "limited: pods=2")
    pod_finishes(cluster, gate, PODS, "p-0", phase="Succeeded",
                 quota="rq-pods", used={"pods": "1"})
    assert cluster.call("POST", path, body=pod("p-2"), server=gate.url).status == 201
    assert both_deny(cluster, gate, PODS, "p-3") == (
        'pods "p-3" is forbidden: exceeded quota: rq-pods, requested: pods=1, used: pods=2, '
        "limited: pods=2")
    pod_finishes(cluster, gate, PODS, "p-1", phase="Failed",  # Failed is terminal too
                 quota="rq-pods", used={"pods": "1"})
    assert cluster.call("POST", path, body=pod("p-3"), server=gate.url).status == 201
    assert len(cluster.call("GET", path).json()["items"]) == 4  # two finished, two counted


def test_count_pods_counts_finished_pods_and_each_key_says_its_own_used(
        cluster: LocalCluster, gate: Opgate) -> None:
    """``count/pods`` counts every pod in storage, finished or not; over both limits of one
    quota the apiserver says each key's own used (``used: count/pods=3,pods=2``)."""
    resource_quota(cluster, PODS_COUNT, "rq-count", {"count/pods": "1"})
    assert cluster.call("POST", f"/api/v1/namespaces/{PODS_COUNT}/pods", body=pod("c-0"),
                        server=gate.url).status == 201
    finish_pod(cluster, PODS_COUNT, "c-0", "Succeeded")  # its controller recounts: still 1
    assert both_deny(cluster, gate, PODS_COUNT, "c-1") == (
        'pods "c-1" is forbidden: exceeded quota: rq-count, requested: count/pods=1, '
        "used: count/pods=1, limited: count/pods=1")

    resource_quota(cluster, PODS_BOTH, "rq-both", {"count/pods": "3", "pods": "2"})
    path = f"/api/v1/namespaces/{PODS_BOTH}/pods"
    for name in ("b-0", "b-1"):
        assert cluster.call("POST", path, body=pod(name), server=gate.url).status == 201
    assert both_deny(cluster, gate, PODS_BOTH, "b-2") == (
        'pods "b-2" is forbidden: exceeded quota: rq-both, requested: pods=1, used: pods=2, '
        "limited: pods=2")
    pod_finishes(cluster, gate, PODS_BOTH, "b-0", phase="Succeeded",
                 quota="rq-both", used={"count/pods": "2", "pods": "1"})
    assert cluster.call("POST", path, body=pod("b-2"), server=gate.url).status == 201
    assert both_deny(cluster, gate, PODS_BOTH, "b-3") == (
        'pods "b-3" is forbidden: exceeded quota: rq-both, requested: count/pods=1,pods=1, '
        "used: count/pods=3,pods=2, limited: count/pods=3,pods=2")


def test_a_pod_stuck_terminating_past_its_grace_period_frees_room_under_pods(
        cluster: LocalCluster, gate: Opgate) -> None:
    """A pod on a node that is gone stays terminating: once its deletionTimestamp plus its
    grace period has passed, the apiserver's ``pods`` does not count it (``count/pods`` still
    does), so its replacement fits. Here the node is made up and no kubelet ends the pod."""
    resource_quota(cluster, PODS_STUCK, "rq-stuck", {"pods": "1", "count/pods": "2"})
    path = f"/api/v1/namespaces/{PODS_STUCK}/pods"
    stuck = pod("t-0")
    stuck["spec"]["nodeName"] = "lost-node"  # scheduled: deleted gracefully, not at once
    assert cluster.call("POST", path, body=stuck, server=gate.url).status == 201
    assert both_deny(cluster, gate, PODS_STUCK, "t-1") == (
        'pods "t-1" is forbidden: exceeded quota: rq-stuck, requested: pods=1, used: pods=1, '
        "limited: pods=1")
    gone = cluster.call("DELETE", f"{path}/t-0", body={"gracePeriodSeconds": 1})
    assert gone.status == 200, gone.body
    assert gone.json()["metadata"]["deletionGracePeriodSeconds"] == 1
    quota_used(cluster, PODS_STUCK, "rq-stuck", {"pods": "0", "count/pods": "1"})
    wait_for("t-0's grace period to pass", lambda: cluster.call(
        "POST", path + "?dryRun=All", body=pod("probe"), server=gate.url).status == 201)
    assert cluster.call("GET", f"{path}/t-0").status == 200  # still there, terminating
    assert cluster.call("POST", path, body=pod("t-1"), server=gate.url).status == 201
    assert both_deny(cluster, gate, PODS_STUCK, "t-2") == (
        'pods "t-2" is forbidden: exceeded quota: rq-stuck, requested: count/pods=1,pods=1, '
        "used: count/pods=2,pods=1, limited: count/pods=2,pods=1")


# --- server-side apply -----------------------------------------------------------------------

def kubectl_apply(kubectl: Path, kubeconfig: Path,
                  obj: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(kubectl), "--kubeconfig", str(kubeconfig), "apply",
                           "--server-side", "--field-manager", "e2e", "-f", "-"],
                          input=json.dumps(obj), capture_output=True, text=True, timeout=60)


def apply_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/configmaps/{name}?fieldManager=e2e"


def test_a_server_side_apply_that_creates_is_checked_like_a_create(
        cluster: LocalCluster, gate: Opgate, kubectl: Path, via: Path) -> None:
    resource_quota(cluster, SSA, "rq-ssa", {"count/configmaps": "2"})  # smaller than max: 3
    for i in range(2):
        out = kubectl_apply(kubectl, via, configmap(f"ssa-{i}", SSA))
        assert out.returncode == 0, out.stderr
        assert "serverside-applied" in out.stdout, out.stdout
    wait_for("the watch to count the applies", lambda: metric(
        gate, "opgate_quota_usage", {"namespace": SSA, "resource": "configmaps"}) == 2)
    before = metric(gate, "opgate_quota_denials_total", {"resource": "configmaps"}) or 0.0
    out = kubectl_apply(kubectl, via, configmap("ssa-2", SSA))
    assert out.returncode != 0
    expected = quota_message("ssa-2", "rq-ssa", used=2, limit=2)
    assert expected in out.stderr, out.stderr
    assert metric(gate, "opgate_quota_denials_total", {"resource": "configmaps"}) == before + 1
    # word for word what the apiserver's own ResourceQuota admission answers the same apply
    body = yaml_apply(configmap("ssa-2", SSA))
    ours = cluster.call("PATCH", apply_path(SSA, "ssa-2"), body=body,
                        content_type="application/apply-patch+yaml", server=gate.url)
    theirs = cluster.call("PATCH", apply_path(SSA, "ssa-2"), body=body,
                          content_type="application/apply-patch+yaml")
    assert (ours.status, theirs.status) == (403, 403), (ours.body, theirs.body)
    assert ours.json()["message"] == theirs.json()["message"] == expected
    assert ours.json()["details"] == theirs.json()["details"]
    assert metric(gate, "opgate_quota_denials_total", {"resource": "configmaps"}) == before + 2
    # an apply to an object that exists is an update: admitted at the limit
    changed = configmap("ssa-1", SSA)
    changed["data"] = {"k": "changed"}
    out = kubectl_apply(kubectl, via, changed)
    assert out.returncode == 0, out.stderr
    got = cluster.call("GET", f"/api/v1/namespaces/{SSA}/configmaps/ssa-1").json()
    assert got["data"] == {"k": "changed"}
    assert metric(gate, "opgate_quota_denials_total", {"resource": "configmaps"}) == before + 2
    assert len(cluster.call("GET", f"/api/v1/namespaces/{SSA}/configmaps").json()["items"]) == 2


def service(name: str, namespace: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name,
                                                                "namespace": namespace},
            "spec": {"ports": [{"port": 80}]}}


def test_a_put_that_creates_is_checked_like_a_create(cluster: LocalCluster, gate: Opgate) -> None:
    """A PUT to a service that does not exist creates it (the apiserver allows create on update
    for services, endpoints, limitranges, leases, events), and ResourceQuota charges it: opgate
    let such PUTs through uncounted, past its own max. Denied now in the apiserver's words; a
    PUT to a service that exists is an update, admitted at the limit."""
    resource_quota(cluster, UPSERT, "rq-upsert", {"count/services": "2"})  # below max: 3
    path = f"/api/v1/namespaces/{UPSERT}/services"
    for i in range(2):
        made = cluster.call("PUT", f"{path}/s-{i}", body=service(f"s-{i}", UPSERT),
                            server=gate.url)
        assert made.status == 201, made.body
    wait_for("the watch to count the PUTs", lambda: metric(
        gate, "opgate_quota_usage", {"namespace": UPSERT, "resource": "services"}) == 2)
    before = metric(gate, "opgate_quota_denials_total", {"resource": "services"}) or 0.0
    ours = cluster.call("PUT", f"{path}/s-2", body=service("s-2", UPSERT), server=gate.url)
    theirs = cluster.call("PUT", f"{path}/s-2", body=service("s-2", UPSERT))
    assert (ours.status, theirs.status) == (403, 403), (ours.body, theirs.body)
    assert ours.json()["message"] == theirs.json()["message"] == quota_message(
        "s-2", "rq-upsert", used=2, limit=2, resource="services")
    assert ours.json()["details"] == theirs.json()["details"]
    assert metric(gate, "opgate_quota_denials_total", {"resource": "services"}) == before + 1
    # beyond the ResourceQuota, the entry's own max: the apiserver alone would have made it
    cluster.call("DELETE", f"/api/v1/namespaces/{UPSERT}/resourcequotas/rq-upsert").ok()
    assert cluster.call("PUT", f"{path}/s-2", body=service("s-2", UPSERT),
                        server=gate.url).status == 201
    denied = cluster.call("PUT", f"{path}/s-3", body=service("s-3", UPSERT), server=gate.url)
    assert (denied.status, denied.json()["message"]) == (403, quota_message(
        "s-3", "e2e-quota", used=3, limit=3, resource="services"))
    # an update of one that exists: admitted at the limit
    current = cluster.call("GET", f"{path}/s-1").ok().json()
    current["metadata"]["labels"] = {"changed": "yes"}
    assert cluster.call("PUT", f"{path}/s-1", body=current, server=gate.url).status == 200
    assert cluster.call("GET", f"{path}/s-3").status == 404
    assert len(cluster.call("GET", path).json()["items"]) == 3


def event(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Event", "metadata": {"name": name, "namespace": EVENTS},
            "involvedObject": {"kind": "Pod", "name": "p", "namespace": EVENTS},
            "reason": "Tested", "message": "m", "type": "Normal"}


def test_a_resource_quota_does_not_limit_events_as_the_apiserver_ignores_them(
        cluster: LocalCluster, gate: Opgate) -> None:
    """The apiserver's ResourceQuota admission ignores events (they are not counted however
    many a ResourceQuota allows, ``count/events`` included): opgate aligned with that limit
    and denied the event creates the apiserver admits (an operator's event recorder dropping
    its events). The entry's own ``max`` still counts them."""
    resource_quota(cluster, EVENTS, "rq-events", {"count/events": "1"})
    path = f"/api/v1/namespaces/{EVENTS}/events"
    for i in range(2):  # the apiserver alone: past count/events=1
        assert cluster.call("POST", path, body=event(f"e-{i}")).status == 201
    wait_for("the watch to count the events", lambda: metric(
        gate, "opgate_quota_usage", {"namespace": EVENTS, "resource": "events"}) == 2)
    made = cluster.call("POST", path, body=event("e-2"), server=gate.url)
    assert made.status == 201, made.body
    denied = cluster.call("POST", path, body=event("e-3"), server=gate.url)
    assert (denied.status, denied.json()["message"]) == (403, quota_message(
        "e-3", "e2e-quota", used=3, limit=3, resource="events"))


def yaml_configmap(meta: str) -> str:
    """A ConfigMap in YAML as kubectl prints it (``data`` before ``metadata``)."""
    return (f"apiVersion: v1\ndata:\n  k: v\nkind: ConfigMap\nmetadata:\n{meta}"
            f"  namespace: {YAML_NS}\n")


def test_yaml_creates_are_counted_once_and_denied_by_name(
        cluster: LocalCluster, gate: Opgate) -> None:
    """``Content-Type: application/yaml``, which the apiserver accepts for a create: opgate
    read no name from it, so each such create's room was held a second time next to its
    object until its reservation ended (a create denied at 2 of 3), and its denial named no
    object where the apiserver's names it."""
    resource_quota(cluster, YAML_NS, "rq-yaml", {"count/configmaps": "5"})  # above max: 3
    path = f"/api/v1/namespaces/{YAML_NS}/configmaps"
    named = cluster.call("POST", path, body=yaml_configmap("  name: y-0\n"),
                         content_type="application/yaml", server=gate.url)
    assert named.status == 201, named.body
    generated = cluster.call("POST", path, body=yaml_configmap("  generateName: 'y-'\n"),
                             content_type="application/yaml", server=gate.url)
    assert generated.status == 201, generated.body
    wait_for("the watch to count the YAML creates", lambda: metric(
        gate, "opgate_quota_usage", {"namespace": YAML_NS, "resource": "configmaps"}) == 2)
    third = cluster.call("POST", path, body=configmap("y-2", YAML_NS), server=gate.url)
    assert third.status == 201, third.body  # 2 objects, not 2 objects + 2 reservations
    denied = cluster.call("POST", path, body=yaml_configmap('  name: "y-3"\n'),
                          content_type="application/yaml", server=gate.url)
    assert (denied.status, denied.json()["message"]) == (403, quota_message(
        "y-3", "e2e-quota", used=3, limit=3))
    assert denied.json()["details"] == {"name": "y-3", "kind": "configmaps"}


def yaml_apply(obj: dict[str, Any]) -> str:
    return json.dumps(obj)  # JSON is YAML


# --- several replicas, one limit -------------------------------------------------------------

SHARED_MAX = 5
SHARED_POLICY = f"""\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: e2e-shared}}
spec:
  quotas:
    - resources: [configmaps]
      namespaces: [{SHARED}]
      max: {SHARED_MAX}
"""


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer.launch() as server:
        yield server


@pytest.fixture(scope="module")
def replicas(cluster: LocalCluster, opgate_factory: Callable[..., Opgate], token_file: Path,
             redis_server: RedisServer) -> list[Opgate]:
    """Three opgates on one Redis; the third runs two workers (four processes in all)."""
    common = ["--token-file", str(token_file), "--redis-url", redis_server.url,
              "--redis-timeout", "0.5", "--no-access-log"]  # two cores for everything here
    gates = [opgate_factory(policies={"shared.yaml": SHARED_POLICY}, extra_args=common + extra)
             for extra in ([], [], ["--workers", "2"])]

    def synced(gate: Opgate) -> bool:  # until then a create gets 503 (failure: closed)
        path = f"/api/v1/namespaces/{SHARED}/configmaps?dryRun=All"
        return all(cluster.call("POST", path, body=configmap("probe", SHARED),
                                server=gate.url).status == 201
                   for _ in range(8))  # new connections: every worker gets some

    for g in gates:
        wait_for("the replica's counts to sync", lambda g=g: synced(g),  # type: ignore[misc]
                 timeout=30)
    return gates


def burst(cluster: LocalCluster, gates: list[Opgate], calls: list[tuple[str, str, Any, str]]
          ) -> list[int]:
    """All ``calls`` (method, path, body, content type) at once, spread over the replicas."""
    def one(i: int) -> int:
        method, path, body, ctype = calls[i]
        return cluster.call(method, path, body=body, content_type=ctype,
                            server=gates[i % len(gates)].url).status

    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(one, range(len(calls))))


def shared_items(cluster: LocalCluster) -> list[str]:
    items = cluster.call("GET", f"/api/v1/namespaces/{SHARED}/configmaps").json()["items"]
    return sorted(i["metadata"]["name"] for i in items)


def all_see(gates: list[Opgate], count: int) -> Callable[[], bool]:
    return lambda: all(metric(g, "opgate_quota_usage", {"namespace": SHARED,
                                                        "resource": "configmaps"}) == count
                       for g in gates)


def test_replicas_sharing_redis_never_exceed_the_limit_together(
        cluster: LocalCluster, replicas: list[Opgate], redis_server: RedisServer) -> None:
    path = f"/api/v1/namespaces/{SHARED}/configmaps"
    ctype = "application/json"
    # 30 named creates at once over three replicas: exactly max succeed
    codes = burst(cluster, replicas, [("POST", path, configmap(f"b-{i}", SHARED), ctype)
                                      for i in range(30)])
    assert sorted(codes) == [201] * SHARED_MAX + [403] * (30 - SHARED_MAX), codes
    assert len(shared_items(cluster)) == SHARED_MAX
    wait_for("every replica to see them", all_see(replicas, SHARED_MAX))
    # room for two more (deleted directly): a burst of server-side applies that create
    for name in shared_items(cluster)[:2]:
        assert cluster.call("DELETE", f"{path}/{name}").status == 200
    wait_for("every replica to count the deletes", all_see(replicas, SHARED_MAX - 2))
    apply = "application/apply-patch+yaml"
    codes = burst(cluster, replicas, [
        ("PATCH", f"{path}/a-{i}?fieldManager=e2e", json.dumps(configmap(f"a-{i}", SHARED)),
         apply) for i in range(12)])
    assert sorted(codes) == [201] * 2 + [403] * 10, codes
    assert len(shared_items(cluster)) == SHARED_MAX
    wait_for("every replica to see the applies", all_see(replicas, SHARED_MAX))
    # applies to objects that exist are updates, admitted at the limit by every replica
    existing = shared_items(cluster)
    codes = burst(cluster, replicas, [
        ("PATCH", f"{path}/{name}?fieldManager=e2e", json.dumps(configmap(name, SHARED)), apply)
        for name in existing])
    assert codes == [200] * len(existing), codes
    # generateName: never over the limit either
    for name in shared_items(cluster)[:3]:
        assert cluster.call("DELETE", f"{path}/{name}").status == 200
    wait_for("every replica to count the deletes", all_see(replicas, SHARED_MAX - 3))
    codes = burst(cluster, replicas, [
        ("POST", path, {"metadata": {"generateName": "gen-"}}, ctype) for _ in range(15)])
    assert 1 <= codes.count(201) <= 3 and codes.count(201) + codes.count(403) == 15, codes
    assert len(shared_items(cluster)) <= SHARED_MAX
    # the reservations live in Redis, under the scope's hash tag, and expire by themselves
    keys = redis_keys(redis_server)
    assert all(k.startswith("opgate:quota:{/configmaps/") for k in keys), keys


def redis_keys(server: RedisServer) -> list[str]:
    import redis

    client = redis.Redis.from_url(server.url)
    try:
        return sorted(k.decode() for k in client.keys("opgate:quota:*"))
    finally:
        client.close()


def test_readyz_says_why_a_quota_of_a_resource_not_served_never_syncs(
        opgate_factory: Callable[..., Opgate], token_file: Path) -> None:
    """A quota of ``deployments`` without ``apiGroups: [apps]`` counts a core resource the
    apiserver does not serve: it can never sync, and ``/readyz?verbose`` says why next to
    ``syncing`` (it said ``syncing`` for ever, the reason only in one log line)."""
    wrong_group = ("apiVersion: opgate.dev/v1alpha1\nkind: Policy\n"
                   "metadata: {name: wrong-group}\nspec:\n  quotas:\n"
                   f"    - {{resources: [deployments], namespaces: [{BARE}], max: 1}}\n")
    opgate = opgate_factory(policies={"quota.yaml": wrong_group},
                            extra_args=["--token-file", str(token_file)])

    def said() -> str:
        _, body = opgate.admin_get("/readyz?verbose")
        return next((x for x in body.splitlines() if "quota-counts" in x), "")

    wait_for("/readyz to say why deployments never sync",
             lambda: "the apiserver serves no deployments in /api/v1" in said(), timeout=30)
    assert "deployments=syncing (the apiserver serves no deployments in /api/v1)" in said()


GIZMOS = "quota-gizmos"
GIZMO_GROUP = "qv.example.com"


def gizmo_crd(*served: str) -> dict[str, Any]:
    """Gizmos, served in the versions given; the last one is the storage version."""
    schema = {"openAPIV3Schema": {"type": "object",
                                  "x-kubernetes-preserve-unknown-fields": True}}
    versions = [{"name": v, "served": v in served, "storage": v == served[-1], "schema": schema}
                for v in ("v1", "v2") if v in served or v < served[-1]]
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"gizmos.{GIZMO_GROUP}"},
            "spec": {"group": GIZMO_GROUP, "scope": "Namespaced",
                     "names": {"plural": "gizmos", "singular": "gizmo", "kind": "Gizmo",
                               "listKind": "GizmoList"},
                     "versions": versions}}


def test_a_custom_resource_is_counted_on_after_its_served_version_changes(
        cluster: LocalCluster, opgate_factory: Callable[..., Opgate], token_file: Path) -> None:
    """An operator's upgrade serves its CRD in v2 and stops serving v1. opgate kept listing
    and watching the v1 path it had discovered once (404 at every retry, for ever), while
    ``/readyz`` said synced and the quota went on with the counts of that moment: objects
    created by others were never counted, so opgate admitted creates past the limit."""
    cluster.create_namespace(GIZMOS)
    cluster.install_crd(gizmo_crd("v1"))
    policy = ("apiVersion: opgate.dev/v1alpha1\nkind: Policy\nmetadata: {name: gizmos}\n"
              "spec:\n  quotas:\n"
              f"    - {{resources: [gizmos], apiGroups: [{GIZMO_GROUP}], "
              f"namespaces: [{GIZMOS}], max: 3}}\n")
    opgate = opgate_factory(policies={"quota.yaml": policy},
                            extra_args=["--token-file", str(token_file)])

    def usage() -> float | None:
        return metric(opgate, "opgate_quota_usage",
                      {"namespace": GIZMOS, "resource": f"gizmos.{GIZMO_GROUP}"})

    def gizmo(version: str, name: str) -> dict[str, Any]:
        return {"apiVersion": f"{GIZMO_GROUP}/{version}", "kind": "Gizmo",
                "metadata": {"name": name, "namespace": GIZMOS}}

    def path(version: str) -> str:
        return f"/apis/{GIZMO_GROUP}/{version}/namespaces/{GIZMOS}/gizmos"

    assert cluster.call("POST", path("v1"), body=gizmo("v1", "g-0")).status == 201
    wait_for("opgate to count the v1 gizmo", lambda: usage() == 1, timeout=30)
    cluster.install_crd(gizmo_crd("v2"))  # v2 served and stored, v1 no longer served
    wait_for("v1 to be gone", lambda: cluster.call("GET", path("v1")).status == 404)
    for name in ("g-1", "g-2"):  # made directly: only opgate's watch can count them
        assert cluster.call("POST", path("v2"), body=gizmo("v2", name)).status == 201
    wait_for("opgate to count the gizmos made in v2", lambda: usage() == 3, timeout=20)
    denied = cluster.call("POST", path("v2"), body=gizmo("v2", "g-3"), server=opgate.url)
    assert denied.status == 403, denied.body
    assert denied.json()["message"] == quota_message(
        "g-3", "gizmos", used=3, limit=3, resource=f"gizmos.{GIZMO_GROUP}")
