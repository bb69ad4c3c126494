"""The official ``kubernetes`` Python client behaves the same through opgate as directly.

list + watch with bookmarks, the 410 Gone of a too-old resourceVersion, and the apiserver's
Status bodies for 401/403/404/409/422 (byte-identical: opgate must neither rewrite nor wrap
them).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from proxy.envtest.cluster import LocalCluster
from tests.e2e import normalize
from tests.e2e.conftest import Opgate

pytestmark = pytest.mark.e2e

NS = "py-client"
OTHER_NS = "py-client-other"
GROUP, VERSION, PLURAL = "e2e.opgate.dev", "v1", "gadgets"
GADGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": f"{PLURAL}.{GROUP}"},
    "spec": {"group": GROUP, "scope": "Namespaced",
             "names": {"plural": PLURAL, "singular": "gadget", "kind": "Gadget"},
             "versions": [{"name": VERSION, "served": True, "storage": True,
                           "schema": {"openAPIV3Schema": {
                               "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]},
}
TARGETS = ("direct", "opgate")


def make_client(server: str, token: str, ca_file: str | None) -> client.ApiClient:
    cfg = client.Configuration()
    cfg.host = server
    cfg.api_key = {"authorization": token}
    cfg.api_key_prefix = {"authorization": "Bearer"}
    if ca_file:
        cfg.ssl_ca_cert = ca_file
    return client.ApiClient(cfg)


@pytest.fixture(scope="module")
def clients(cluster: LocalCluster, opgate: Opgate) -> Iterator[dict[str, client.CoreV1Api]]:
    cluster.create_namespace(NS)
    cluster.create_namespace(OTHER_NS)
    direct = make_client(cluster.url, cluster.admin_token, cluster.ca_file)
    via = make_client(opgate.url, cluster.admin_token, cluster.ca_file)
    yield {"direct": client.CoreV1Api(direct), "opgate": client.CoreV1Api(via)}
    direct.close()
    via.close()


def cm_body(name: str, **data: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": NS}, "data": data}


@pytest.mark.parametrize("target", TARGETS)
def test_list_then_watch_with_bookmarks(
    clients: dict[str, client.CoreV1Api], target: str
) -> None:
    """The apiserver sends a BOOKMARK ~2s before a watch's timeout when the resource's cache
    has moved past the last event sent to this watch: here by a write in another namespace
    made while the watch is open."""
    api = clients[target]
    listed = api.list_namespaced_config_map(NS)
    name = f"watched-{target}"
    api.create_namespaced_config_map(NS, cm_body(name, v="1"))
    # a write the watch does not see, made while it is open: the cache moves past its last event
    elsewhere = threading.Timer(1.0, api.create_namespaced_config_map,
                                (OTHER_NS, {"metadata": {"name": name}}))
    elsewhere.start()
    events: list[tuple[str, str]] = []
    w = watch.Watch()
    for event in w.stream(api.list_namespaced_config_map, NS,
                          resource_version=listed.metadata.resource_version,
                          allow_watch_bookmarks=True, timeout_seconds=5):
        obj = event["raw_object"]
        events.append((event["type"], obj["metadata"].get("name", "")))
    elsewhere.join()
    api.delete_namespaced_config_map(name, NS)
    api.delete_namespaced_config_map(name, OTHER_NS)
    assert ("ADDED", name) in events
    bookmarks = [e for e in events if e[0] == "BOOKMARK"]
    assert bookmarks, f"no BOOKMARK before the watch's timeout: {events}"
    assert int(w.resource_version) >= int(listed.metadata.resource_version)


def _events(body: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in body.splitlines() if line.strip()]


def test_watch_list_initial_events_end_bookmark(cluster: LocalCluster, opgate: Opgate) -> None:
    """sendInitialEvents=true: ADDED for what exists, then the initial-events-end BOOKMARK."""
    for i in range(3):
        cluster.apply(cm_body(f"initial-{i}", i=str(i)))
    query = ("?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan"
             "&allowWatchBookmarks=true&timeoutSeconds=2&labelSelector=")
    path = f"/api/v1/namespaces/{NS}/configmaps{query}"
    results = {t: cluster.call("GET", path, server=None if t == "direct" else opgate.url)
               for t in TARGETS}
    for resp in results.values():
        assert resp.status == 200 and resp.headers["Content-Type"] == "application/json"
    direct, via = (_events(results[t].body) for t in TARGETS)
    shape = [(e["type"], e["object"]["metadata"].get("name")) for e in via]
    assert shape == [(e["type"], e["object"]["metadata"].get("name")) for e in direct]
    bookmark = next(e for e in via if e["type"] == "BOOKMARK")
    assert bookmark["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
    assert {"initial-0", "initial-1", "initial-2"} <= {n for t, n in shape if t == "ADDED"}
    assert normalize.obj([e for e in via if e["type"] == "ADDED"]) == normalize.obj(
        [e for e in direct if e["type"] == "ADDED"])


def test_too_old_resource_version_is_410(
    cluster: LocalCluster, opgate: Opgate, clients: dict[str, client.CoreV1Api]
) -> None:
    """A watch from a resourceVersion older than the watch cache's window: the apiserver
    accepts the watch (200) and sends one ERROR event carrying a 410 Expired Status, then ends
    the stream. A custom resource is used because its cache starts when the CRD is installed,
    so resourceVersion 1 is always outside its window."""
    cluster.install_crd(GADGET_CRD)
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}"
    cluster.call("POST", path, body={"apiVersion": f"{GROUP}/{VERSION}", "kind": "Gadget",
                                     "metadata": {"name": "g"}}).ok()
    query = "?watch=1&resourceVersion=1&timeoutSeconds=5"
    raw = {t: cluster.call("GET", path + query, server=None if t == "direct" else opgate.url)
           for t in TARGETS}
    for resp in raw.values():
        assert resp.status == 200, resp.body
        (event,) = _events(resp.body)
        assert event["type"] == "ERROR"
        status = event["object"]
        assert (status["kind"], status["code"], status["reason"]) == ("Status", 410, "Expired")
        assert status["message"].startswith("too old resource version: 1 (")
    assert normalize.json_text(raw["opgate"].body.decode()) == normalize.json_text(
        raw["direct"].body.decode())
    # the official client retries once, then raises ApiException(410), the same both ways
    reasons = {}
    for target in TARGETS:
        custom = client.CustomObjectsApi(clients[target].api_client)
        with pytest.raises(ApiException) as err:
            for _ in watch.Watch().stream(custom.list_namespaced_custom_object, GROUP, VERSION,
                                          NS, PLURAL, resource_version="1", timeout_seconds=5):
                pass
        assert err.value.status == 410
        reasons[target] = normalize.obj(err.value.reason)
    assert reasons["opgate"] == reasons["direct"]


def test_list_at_compacted_resource_version_is_410(cluster: LocalCluster, opgate: Opgate) -> None:
    """After etcd compaction an exact-resourceVersion LIST below it is a plain HTTP 410."""
    cluster.compact_etcd()
    path = f"/api/v1/namespaces/{NS}/configmaps?resourceVersion=2&resourceVersionMatch=Exact"
    direct = cluster.call("GET", path)
    via = cluster.call("GET", path, server=opgate.url)
    assert (via.status, direct.status) == (410, 410)
    assert via.body == direct.body
    assert json.loads(via.body)["reason"] == "Expired"


def _error(call: Any) -> ApiException:
    with pytest.raises(ApiException) as err:
        call()
    return err.value


@pytest.mark.parametrize("code", [404, 409, 422])
def test_status_bodies_pass_through(
    cluster: LocalCluster, clients: dict[str, client.CoreV1Api], code: int
) -> None:
    cluster.apply(cm_body("exists", a="1"))
    errors = {}
    for target, api in clients.items():
        calls = {
            404: lambda api=api: api.read_namespaced_config_map("missing", NS),
            409: lambda api=api: api.create_namespaced_config_map(NS, cm_body("exists")),
            422: lambda api=api: api.create_namespaced_config_map(NS, cm_body("Not_Valid")),
        }
        errors[target] = _error(calls[code])
    direct, via = errors["direct"], errors["opgate"]
    assert via.status == direct.status == code
    assert via.body == direct.body  # byte-identical, nothing normalized
    assert via.headers["Content-Type"] == direct.headers["Content-Type"] == "application/json"
    assert json.loads(via.body)["code"] == code


def test_401_and_403_status_bodies(cluster: LocalCluster, opgate: Opgate) -> None:
    cluster.create_service_account_with_rbac(
        NS, "reader", rules=[{"apiGroups": [""], "resources": ["configmaps"],
                              "verbs": ["get", "list"]}])
    token = cluster.token_request(NS, "reader", expiration_seconds=600)
    cases = {
        "forbidden": ("DELETE", f"/api/v1/namespaces/{NS}/configmaps/exists", token, 403),
        "allowed": ("GET", f"/api/v1/namespaces/{NS}/configmaps/missing", token, 404),
        "bad token": ("GET", f"/api/v1/namespaces/{NS}/configmaps", "not-a-token", 401),
    }
    for what, (method, path, bearer, code) in cases.items():
        direct = cluster.call(method, path, token=bearer)
        via = cluster.call(method, path, token=bearer, server=opgate.url)
        assert (via.status, direct.status) == (code, code), (what, via.body)
        assert via.body == direct.body, what
    who = cluster.call("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                       token=token, server=opgate.url,
                       body={"apiVersion": "authentication.k8s.io/v1",
                             "kind": "SelfSubjectReview"}).ok().json()
    assert who["status"]["userInfo"]["username"] == f"system:serviceaccount:{NS}:reader"
