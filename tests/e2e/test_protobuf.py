"""Protobuf bodies (what client-go sends and asks for by default) pass through opgate untouched.

A GET and a LIST with ``Accept: application/vnd.kubernetes.protobuf`` return the same bytes
through opgate as directly; a create with a protobuf request body works through opgate too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from proxy.envtest.api import ApiResponse
from proxy.envtest.cluster import LocalCluster
from tests.e2e.conftest import Opgate

pytestmark = pytest.mark.e2e

NS = "proto"
PROTOBUF = "application/vnd.kubernetes.protobuf"
MAGIC = b"k8s\x00"


@pytest.fixture(scope="module")
def proto_ns(cluster: LocalCluster) -> str:
    cluster.create_namespace(NS)
    for i in range(5):
        cluster.apply({"apiVersion": "v1", "kind": "ConfigMap",
                       "metadata": {"name": f"pb-{i}", "namespace": NS, "labels": {"i": str(i)}},
                       "data": {"blob": "x" * (100 * i), "utf8": "\u00e9\u6f22\u5b57"}})
    return NS


def _get(cluster: LocalCluster, opgate: Opgate, path: str) -> tuple[ApiResponse, ApiResponse]:
    headers = {"Accept": PROTOBUF}
    direct = cluster.call("GET", path, headers=headers)
    via = cluster.call("GET", path, headers=headers, server=opgate.url)
    return direct, via


def _assert_same(direct: ApiResponse, via: ApiResponse) -> None:
    assert direct.status == via.status == 200, via.body[:300]
    assert via.headers["Content-Type"] == direct.headers["Content-Type"] == PROTOBUF
    assert via.body.startswith(MAGIC)
    assert via.body == direct.body


def test_get_protobuf(cluster: LocalCluster, opgate: Opgate, proto_ns: str) -> None:
    _assert_same(*_get(cluster, opgate, f"/api/v1/namespaces/{proto_ns}/configmaps/pb-3"))


def test_list_protobuf_at_a_fixed_resource_version(
    cluster: LocalCluster, opgate: Opgate, proto_ns: str
) -> None:
    listed = cluster.call("GET", f"/api/v1/namespaces/{proto_ns}/configmaps").ok().json()
    rv = listed["metadata"]["resourceVersion"]
    path = (f"/api/v1/namespaces/{proto_ns}/configmaps"
            f"?resourceVersion={rv}&resourceVersionMatch=Exact")
    _assert_same(*_get(cluster, opgate, path))


def test_list_protobuf_latest(cluster: LocalCluster, opgate: Opgate, proto_ns: str) -> None:
    """A plain (most recent) LIST: equal whenever nothing in the cluster wrote in between;
    the apiserver's own lease updates may, so a run brackets opgate's call by two direct ones
    and retries when those differ."""
    path = f"/api/v1/namespaces/{proto_ns}/configmaps?limit=500"
    headers = {"Accept": PROTOBUF}
    for _ in range(10):
        before = cluster.call("GET", path, headers=headers).ok()
        via = cluster.call("GET", path, headers=headers, server=opgate.url)
        after = cluster.call("GET", path, headers=headers).ok()
        if before.body == after.body:
            _assert_same(before, via)
            return
    pytest.fail("the list changed under every one of 10 attempts")


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def configmap_protobuf(namespace: str, name: str, data: dict[str, str]) -> bytes:
    """A ConfigMap as client-go would send it: ``k8s\\0`` + runtime.Unknown{typeMeta, raw}."""
    meta = _field(1, name.encode()) + _field(3, namespace.encode())  # ObjectMeta name, namespace
    entries = b"".join(_field(2, _field(1, k.encode()) + _field(2, v.encode()))  # map data = 2
                       for k, v in sorted(data.items()))
    type_meta = _field(1, b"v1") + _field(2, b"ConfigMap")
    return MAGIC + _field(1, type_meta) + _field(2, _field(1, meta) + entries)


def test_create_with_protobuf_body(cluster: LocalCluster, opgate: Opgate, proto_ns: str) -> None:
    """A protobuf request body through opgate creates the object; creating it again is a 409
    whose Status is itself protobuf and byte-identical to the direct answer."""
    data = {"k": "v", "utf8": "\u00e9"}
    body = configmap_protobuf(proto_ns, "pb-created", data)
    headers = {"Accept": PROTOBUF, "Content-Type": PROTOBUF}
    path = f"/api/v1/namespaces/{proto_ns}/configmaps"
    created = cluster.call("POST", path, body=body, headers=headers, server=opgate.url)
    assert created.status == 201, created.body[:500]
    assert created.headers["Content-Type"] == PROTOBUF and created.body.startswith(MAGIC)
    assert cluster.call("GET", f"{path}/pb-created").ok().json()["data"] == data
    direct = cluster.call("POST", path, body=body, headers=headers)
    via = cluster.call("POST", path, body=body, headers=headers, server=opgate.url)
    assert (via.status, direct.status) == (409, 409)
    assert via.headers["Content-Type"] == direct.headers["Content-Type"] == PROTOBUF
    assert via.body == direct.body and via.body.startswith(MAGIC)


QUOTA_NS = "proto-quota"
QUOTA_POLICY = f"""\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: proto-quota}}
spec:
  quotas:
    - resources: [configmaps]
      namespaces: [{QUOTA_NS}]
      alignWith: [ResourceQuota]
"""


def test_protobuf_creates_count_once_and_are_refused_as_the_apiserver_does(
    cluster: LocalCluster, opgate_factory: Callable[..., Opgate], tmp_path: Path
) -> None:
    """client-go's typed clients create in protobuf: opgate reads the name from it, so a
    create's reservation ends when the watch shows its object (it was counted next to the
    object for 30 s: the third of three creates under a limit of 3 was refused) and the 403
    names the object exactly as the apiserver's ResourceQuota admission does."""
    from tests.e2e.test_quota import metric, resource_quota, wait_for

    cluster.create_namespace(QUOTA_NS)
    resource_quota(cluster, QUOTA_NS, "rq-pb", {"count/configmaps": "3"})
    token = tmp_path / "token"
    token.write_text(cluster.admin_token)
    gate = opgate_factory(policies={"quota.yaml": QUOTA_POLICY},
                          extra_args=["--token-file", str(token)])
    wait_for("the quota counts to sync", lambda: "configmaps=synced, resourcequotas=synced"
             in gate.admin_get("/readyz?verbose")[1], timeout=30)
    path = f"/api/v1/namespaces/{QUOTA_NS}/configmaps"
    headers = {"Accept": "application/json", "Content-Type": PROTOBUF}
    for i in range(3):
        body = configmap_protobuf(QUOTA_NS, f"pb-{i}", {"k": "v"})
        created = cluster.call("POST", path, body=body, headers=headers, server=gate.url)
        assert created.status == 201, created.body[:300]
        wait_for("the watch to count it", lambda n=i + 1: metric(
            gate, "opgate_quota_usage", {"namespace": QUOTA_NS, "resource": "configmaps"}) == n)
    body = configmap_protobuf(QUOTA_NS, "pb-3", {"k": "v"})
    ours = cluster.call("POST", path, body=body, headers=headers, server=gate.url)
    theirs = cluster.call("POST", path, body=body, headers=headers)
    assert (ours.status, theirs.status) == (403, 403)
    assert ours.json()["message"] == theirs.json()["message"] == (
        'configmaps "pb-3" is forbidden: exceeded quota: rq-pb, requested: count/configmaps=1, '
        "used: count/configmaps=3, limited: count/configmaps=3")
    assert ours.json()["details"] == theirs.json()["details"]
