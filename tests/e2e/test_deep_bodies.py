"""Deeply nested JSON bodies against the real apiserver: what it stores, opgate relays.

The apiserver decodes JSON up to 10,000 levels of nesting (sigs.k8s.io/json's
``maxNestingDepth``); a custom resource whose schema has ``x-kubernetes-preserve-unknown-fields``
keeps whatever it is given, so a Blob 2,000 levels deep is stored (and its ``managedFields`` are
as deep). Python's ``json`` gives up at about 1,000. Through an opgate that reads bodies (quota
on blobs, the audit log at ``Request``, a ``{instance}`` rate-limit key) such a create is
answered as the apiserver answers it, its audit event holds the object and its name, its
instance is the Blob itself, and the quota's metadata watch of blobs counts deep objects (and
denies at its limit in the apiserver's words). A body deeper than the apiserver's limit gets
the apiserver's own 400.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from proxy.envtest.cluster import LocalCluster
from tests.e2e import waiting
from tests.e2e.conftest import Opgate
from tests.e2e.test_quota import metric

pytestmark = pytest.mark.e2e

NAMESPACE, COUNTED = "deep-e2e", "deep-e2e-counted"
GROUP = "deep.opgate.dev"
BLOBS = f"/apis/{GROUP}/v1/namespaces/{NAMESPACE}/blobs"
CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": f"blobs.{GROUP}"},
    "spec": {
        "group": GROUP, "scope": "Namespaced",
        "names": {"plural": "blobs", "singular": "blob", "kind": "Blob", "listKind": "BlobList"},
        "versions": [{"name": "v1", "served": True, "storage": True, "schema": {
            "openAPIV3Schema": {"type": "object",
                                "x-kubernetes-preserve-unknown-fields": True}}}],
    },
}
POLICY = f"""\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: e2e-deep}}
spec:
  quotas:
    - resources: [blobs]
      apiGroups: [{GROUP}]
      namespaces: [{NAMESPACE}]
      max: 50
    - name: two-blobs
      resources: [blobs]
      apiGroups: [{GROUP}]
      namespaces: [{COUNTED}]
      max: 2
  rateLimits:
    - name: per-blob
      match: {{namespaces: [{NAMESPACE}], resources: [blobs]}}
      key: "{{instance}}"
      qps: 0.01
      burst: 1
  audit:
    level: Request
"""
STORED = 2000  # levels of nesting the apiserver stores (and Python's json cannot read)
TOO_DEEP = 10001  # one more than the apiserver decodes


def blob(name: str, depth: int) -> str:
    """A Blob nested ``depth`` levels deep, its top-level object included."""
    inner = depth - 1  # spec's value and the objects in it
    nest = '{"a":' * inner + "1" + "}" * inner
    return (f'{{"apiVersion":"{GROUP}/v1","kind":"Blob","metadata":{{"name":"{name}"}},'
            f'"spec":{nest}}}')


def wait_for(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    waiting.wait_for(what, check, timeout)  # (the apiserver's CRD and opgate's informers: 30 s)


def blobs_synced(gate: Opgate) -> bool:
    _, body = gate.admin_get("/readyz?verbose")
    line = next((x for x in body.splitlines() if "quota-counts" in x), "")
    return f"blobs.{GROUP}=synced" in line


@pytest.fixture(scope="module")
def gate(cluster: LocalCluster, opgate_factory: Callable[..., Opgate],
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Opgate, Path]]:
    cluster.install_crd(CRD)
    cluster.create_namespace(NAMESPACE)
    cluster.create_namespace(COUNTED)
    base = tmp_path_factory.mktemp("deep")
    token = base / "token"
    token.write_text(cluster.admin_token)
    token.chmod(0o600)
    audit_log = base / "audit.log"
    opgate = opgate_factory(policies={"deep.yaml": POLICY},
                            extra_args=["--token-file", str(token), "--audit-log", str(audit_log)])
    wait_for("opgate's quota counts of blobs to sync", lambda: blobs_synced(opgate))
    # a list's instance is "-": it spends that bucket and has opgate discover the Blob kind;
    # once it knows it, a get's instance is the Blob's (admitted, then the apiserver's 404)
    assert cluster.call("GET", BLOBS, server=opgate.url).status == 200
    probes = itertools.count()
    wait_for("opgate to know the Blob kind", lambda: cluster.call(
        "GET", f"{BLOBS}/probe-{next(probes)}", server=opgate.url).status == 404)
    yield opgate, audit_log
    cluster.call("DELETE", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
                           f"{CRD['metadata']['name']}")


def audit_line(audit_log: Path, name: str) -> str:
    """The ResponseComplete event of the create of ``name`` (as text: it is too deep for
    Python's json)."""
    found: list[str] = []

    def written() -> bool:
        found[:] = [line for line in audit_log.read_text().splitlines()
                    if '"stage":"ResponseComplete"' in line and '"verb":"create"' in line
                    and f'"name":"{name}"' in line]
        return bool(found)

    wait_for(f"the audit event of the create of {name}", written, timeout=10)
    return found[0]


def test_a_create_the_apiserver_stores_passes_opgate_as_it_is(
    cluster: LocalCluster, gate: tuple[Opgate, Path],
) -> None:
    opgate, audit_log = gate
    direct = cluster.call("POST", BLOBS, body=blob("direct", STORED))
    assert direct.status == 201, direct.body[:300]
    wait_for("the quota's watch to take the deep Blob", lambda: blobs_synced(opgate))

    body = blob("via", STORED)
    via = cluster.call("POST", BLOBS, body=body, server=opgate.url)
    assert via.status == 201, (via.body[:300], opgate.log_tail())

    line = audit_line(audit_log, "via")
    assert '"objectRef":{"resource":"blobs","namespace":"deep-e2e","name":"via"' in line
    assert f'"requestObject":{body}' in line
    assert '"responseStatus":{"metadata":{},"code":201}' in line

    # the create was for the Blob itself: its instance's bucket (burst 1) is spent
    again = cluster.call("GET", f"{BLOBS}/via", server=opgate.url)
    assert again.status == 429, again.body[:300]
    assert 'rate limit "per-blob"' in again.json()["message"]


def test_the_quota_counts_deep_objects_and_denies_at_its_limit(
    cluster: LocalCluster, gate: tuple[Opgate, Path],
) -> None:
    """Its metadata-only watch carries the deep managedFields: the deep Blob is counted."""
    opgate, _ = gate
    path = f"/apis/{GROUP}/v1/namespaces/{COUNTED}/blobs"
    labels = {"namespace": COUNTED, "resource": f"blobs.{GROUP}"}

    def used(count: int) -> Callable[[], bool]:
        return lambda: metric(opgate, "opgate_quota_usage", labels) == count

    assert cluster.call("POST", path, body=blob("deep", STORED)).status == 201
    wait_for("the quota to count the deep Blob", used(1))
    flat = cluster.call("POST", path, body=blob("flat", 2), server=opgate.url)
    assert flat.status == 201, (flat.body[:300], opgate.log_tail())
    wait_for("the quota to count both", used(2))
    over = cluster.call("POST", path, body=blob("over", STORED), server=opgate.url)
    key = f"count/blobs.{GROUP}"
    assert (over.status, over.json()["message"]) == (403, (
        f'blobs.{GROUP} "over" is forbidden: exceeded quota: two-blobs, requested: {key}=1, '
        f"used: {key}=2, limited: {key}=2")), over.body[:300]
    assert blobs_synced(opgate), opgate.log_tail()


def test_a_body_deeper_than_the_apiserver_reads_gets_its_400(
    cluster: LocalCluster, gate: tuple[Opgate, Path],
) -> None:
    opgate, _ = gate
    body = blob("too-deep", TOO_DEEP)
    direct = cluster.call("POST", BLOBS, body=body)
    via = cluster.call("POST", BLOBS, body=body, server=opgate.url,  # (its name is unread)
                       headers={"Opgate-Instance": f"{NAMESPACE}/Blob/too-deep"})
    assert direct.status == 400, direct.body[:300]
    assert (via.status, via.json()["reason"]) == (400, "BadRequest"), via.body[:300]
    assert "exceeded max depth" in via.json()["message"]
    assert json.loads(via.body)["message"] == json.loads(direct.body)["message"]
