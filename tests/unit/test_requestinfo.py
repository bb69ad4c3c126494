"""proxy.engine.requestinfo: the apiserver's own RequestInfo rules, case by case.

The table holds the examples of k8s.io/apiserver's requestinfo_test.go plus the shapes opgate
meets every day: group and CRD resources, connect subresources, non-resource URLs.
"""

from __future__ import annotations

import dataclasses

import pytest

from proxy.engine import selectors
from proxy.engine.requestinfo import RequestInfo, parse_request_info

# --- builders for the expected values ---------------------------------------------------------


def res(
    verb: str,
    path: str,
    resource: str,
    *,
    parts: tuple[str, ...],
    prefix: str = "api",
    group: str = "",
    version: str = "v1",
    namespace: str = "",
    subresource: str = "",
    name: str = "",
) -> RequestInfo:
    return RequestInfo(
        is_resource_request=True,
        path=path,
        verb=verb,
        api_prefix=prefix,
        api_group=group,
        api_version=version,
        namespace=namespace,
        resource=resource,
        subresource=subresource,
        name=name,
        parts=parts,
    )


def nonres(verb: str, path: str, prefix: str = "") -> RequestInfo:
    return RequestInfo(is_resource_request=False, path=path, verb=verb, api_prefix=prefix)


NS = "/api/v1/namespaces/other"
GRP = "/apis/group/version/resource"
APPS = "/apis/apps/v1/namespaces/ns"
CRD = "/apis/demo.opgate.dev/v1"
POD = "/api/v1/namespaces/ns/pods/p"


def grp(verb: str, name: str = "", parts: tuple[str, ...] = ("resource",)) -> RequestInfo:
    return res(
        verb, GRP, "resource", parts=parts, prefix="apis", group="group", version="version",
        name=name,
    )  # fmt: skip


# (method, path, query, expected)
CASES = [
    # --- resource paths (requestinfo_test.go) ---
    ("GET", "/api/v1/namespaces", "", res("list", "/api/v1/namespaces", "namespaces",
        parts=("namespaces",))),
    ("GET", NS, "", res("get", NS, "namespaces", namespace="other", name="other",
        parts=("namespaces", "other"))),
    ("GET", f"{NS}/pods", "", res("list", f"{NS}/pods", "pods", namespace="other",
        parts=("pods",))),
    ("GET", f"{NS}/pods/foo", "", res("get", f"{NS}/pods/foo", "pods", namespace="other",
        name="foo", parts=("pods", "foo"))),
    ("HEAD", f"{NS}/pods/foo", "", res("get", f"{NS}/pods/foo", "pods", namespace="other",
        name="foo", parts=("pods", "foo"))),
    ("GET", "/api/v1/pods", "", res("list", "/api/v1/pods", "pods", parts=("pods",))),
    ("HEAD", "/api/v1/pods", "", res("list", "/api/v1/pods", "pods", parts=("pods",))),
    # --- verbs in the path (deprecated /proxy/ and /watch/ forms) ---
    ("GET", "/api/v1/proxy/namespaces/other/pods/foo", "", res("proxy",
        "/api/v1/proxy/namespaces/other/pods/foo", "pods", namespace="other", name="foo",
        parts=("pods", "foo"))),
    ("GET", "/api/v1/proxy/namespaces/other/pods/foo/subpath/not/a/subresource", "", res(
        "proxy", "/api/v1/proxy/namespaces/other/pods/foo/subpath/not/a/subresource", "pods",
        namespace="other", name="foo",
        parts=("pods", "foo", "subpath", "not", "a", "subresource"))),
    ("GET", "/api/v1/proxy/nodes/n1/stats", "", res("proxy", "/api/v1/proxy/nodes/n1/stats",
        "nodes", name="n1", parts=("nodes", "n1", "stats"))),
    ("GET", "/api/v1/watch/pods", "", res("watch", "/api/v1/watch/pods", "pods",
        parts=("pods",))),
    ("GET", "/api/v1/watch/namespaces/other/pods", "", res("watch",
        "/api/v1/watch/namespaces/other/pods", "pods", namespace="other", parts=("pods",))),
    ("GET", "/apis/apps/v1/watch/namespaces/ns/deployments/d", "", res("watch",
        "/apis/apps/v1/watch/namespaces/ns/deployments/d", "deployments", prefix="apis",
        group="apps", namespace="ns", name="d", parts=("deployments", "d"))),
    # --- ?watch= ---
    ("GET", "/api/v1/pods", "watch=true", res("watch", "/api/v1/pods", "pods", parts=("pods",))),
    ("GET", "/api/v1/pods", "watch=false", res("list", "/api/v1/pods", "pods", parts=("pods",))),
    ("GET", f"{NS}/pods", "watch=1", res("watch", f"{NS}/pods", "pods", namespace="other",
        parts=("pods",))),
    ("GET", f"{NS}/pods", "watch=0", res("list", f"{NS}/pods", "pods", namespace="other",
        parts=("pods",))),
    ("GET", f"{NS}/pods/foo", "watch=true", res("get", f"{NS}/pods/foo", "pods",
        namespace="other", name="foo", parts=("pods", "foo"))),
    # --- subresources, namespace as an object ---
    ("GET", f"{NS}/pods/foo/status", "", res("get", f"{NS}/pods/foo/status", "pods",
        namespace="other", subresource="status", name="foo", parts=("pods", "foo", "status"))),
    ("GET", f"{NS}/pods/foo/proxy/subpath", "", res("get", f"{NS}/pods/foo/proxy/subpath",
        "pods", namespace="other", subresource="proxy", name="foo",
        parts=("pods", "foo", "proxy", "subpath"))),
    ("PUT", f"{NS}/finalize", "", res("update", f"{NS}/finalize", "namespaces",
        namespace="other", subresource="finalize", name="other",
        parts=("namespaces", "other", "finalize"))),
    ("PUT", f"{NS}/status", "", res("update", f"{NS}/status", "namespaces", namespace="other",
        subresource="status", name="other", parts=("namespaces", "other", "status"))),
    # --- verbs from the HTTP method ---
    ("PATCH", f"{NS}/pods/foo", "", res("patch", f"{NS}/pods/foo", "pods", namespace="other",
        name="foo", parts=("pods", "foo"))),
    ("DELETE", f"{NS}/pods/foo", "", res("delete", f"{NS}/pods/foo", "pods",
        namespace="other", name="foo", parts=("pods", "foo"))),
    ("POST", f"{NS}/pods", "", res("create", f"{NS}/pods", "pods", namespace="other",
        parts=("pods",))),
    ("OPTIONS", f"{NS}/pods", "", res("", f"{NS}/pods", "pods", namespace="other",
        parts=("pods",))),
    # --- deletecollection ---
    ("DELETE", "/api/v1/nodes", "", res("deletecollection", "/api/v1/nodes", "nodes",
        parts=("nodes",))),
    ("DELETE", "/api/v1/namespaces", "", res("deletecollection", "/api/v1/namespaces",
        "namespaces", parts=("namespaces",))),
    ("DELETE", f"{NS}/pods", "", res("deletecollection", f"{NS}/pods", "pods",
        namespace="other", parts=("pods",))),
    ("DELETE", "/apis/extensions/v1/namespaces/other/pods", "", res("deletecollection",
        "/apis/extensions/v1/namespaces/other/pods", "pods", prefix="apis", group="extensions",
        namespace="other", parts=("pods",))),
    # --- api group and version ---
    ("POST", "/apis/extensions/v1/namespaces/other/pods", "", res("create",
        "/apis/extensions/v1/namespaces/other/pods", "pods", prefix="apis", group="extensions",
        namespace="other", parts=("pods",))),
    ("POST", "/apis/extensions/v1beta3/namespaces/other/pods", "", res("create",
        "/apis/extensions/v1beta3/namespaces/other/pods", "pods", prefix="apis",
        group="extensions", version="v1beta3", namespace="other", parts=("pods",))),
    # --- fieldSelector=metadata.name names the object of a list or watch ---
    ("GET", GRP, "", grp("list")),
    ("GET", GRP, "fieldSelector=metadata.name=name1", grp("list", "name1")),
    ("GET", GRP, "watch=true&fieldSelector=metadata.name=name1", grp("watch", "name1")),
    ("GET", GRP, "fieldSelector=metadata.name%3D%3Dname1", grp("list", "name1")),
    ("GET", GRP, "fieldSelector=foo=bar&labelSelector=baz=qux", grp("list")),
    ("GET", GRP, "fieldSelector=metadata.name=name1,foo", grp("list")),
    ("GET", GRP, "fieldSelector=metadata.name=name1,foo&watch=true", grp("watch")),
    ("GET", GRP, "fieldSelector=metadata.name=name1,foo&watch=false", grp("list")),
    ("GET", GRP, "fieldSelector=metadata.name=foo&fieldSelector=metadata.name=bar", grp(
        "list", "foo")),
    ("GET", GRP, "fieldSelector=status.phase=Running,metadata.name=n", grp("list", "n")),
    ("GET", GRP, "fieldSelector=metadata.name!=n", grp("list")),
    ("GET", GRP, "fieldSelector=metadata.name=a/b", grp("list")),
    ("GET", GRP, "fieldSelector=metadata.name=n&labelSelector=a%3D%3D%3Db", grp("list")),
    ("GET", GRP, "fieldSelector=metadata.name=n&limit=ten", grp("list")),
    ("DELETE", GRP, "fieldSelector=metadata.name=n", grp("deletecollection")),
    ("GET", "/apis/group/version/watch/resource", "fieldSelector=metadata.name=foo", res("watch",
        "/apis/group/version/watch/resource", "resource", prefix="apis", group="group",
        version="version", parts=("resource",))),
    ("GET", "/apis/group/version/watch/resource/name", "fieldSelector=metadata.name=foo", res(
        "watch", "/apis/group/version/watch/resource/name", "resource", prefix="apis",
        group="group", version="version", name="name", parts=("resource", "name"))),
    # --- cluster-scoped, groups, CRDs ---
    ("GET", "/api/v1/nodes/n1", "", res("get", "/api/v1/nodes/n1", "nodes", name="n1",
        parts=("nodes", "n1"))),
    ("GET", "/api/v1/nodes/n1/proxy/metrics", "", res("get", "/api/v1/nodes/n1/proxy/metrics",
        "nodes", subresource="proxy", name="n1", parts=("nodes", "n1", "proxy", "metrics"))),
    ("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", "", res("create",
        "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", "selfsubjectaccessreviews",
        prefix="apis", group="authorization.k8s.io", parts=("selfsubjectaccessreviews",))),
    ("GET", f"{APPS}/deployments/d/scale", "", res("get", f"{APPS}/deployments/d/scale",
        "deployments", prefix="apis", group="apps", namespace="ns", subresource="scale",
        name="d", parts=("deployments", "d", "scale"))),
    ("PUT", f"{APPS}/deployments/d/scale", "", res("update", f"{APPS}/deployments/d/scale",
        "deployments", prefix="apis", group="apps", namespace="ns", subresource="scale",
        name="d", parts=("deployments", "d", "scale"))),
    ("PATCH", f"{CRD}/namespaces/ns/widgets/w/status", "", res("patch",
        f"{CRD}/namespaces/ns/widgets/w/status", "widgets", prefix="apis",
        group="demo.opgate.dev", namespace="ns", subresource="status", name="w",
        parts=("widgets", "w", "status"))),
    ("GET", f"{CRD}/widgets", "watch=true&resourceVersion=5", res("watch", f"{CRD}/widgets",
        "widgets", prefix="apis", group="demo.opgate.dev", parts=("widgets",))),
    ("POST", "/api/v1/namespaces/ns/serviceaccounts/sa/token", "", res("create",
        "/api/v1/namespaces/ns/serviceaccounts/sa/token", "serviceaccounts", namespace="ns",
        subresource="token", name="sa", parts=("serviceaccounts", "sa", "token"))),
    # --- connect subresources: SPDY is a POST, WebSocket a GET ---
    ("POST", f"{POD}/exec", "command=ls", res("create", f"{POD}/exec", "pods", namespace="ns",
        subresource="exec", name="p", parts=("pods", "p", "exec"))),
    ("GET", f"{POD}/exec", "command=ls", res("get", f"{POD}/exec", "pods", namespace="ns",
        subresource="exec", name="p", parts=("pods", "p", "exec"))),
    ("POST", f"{POD}/attach", "", res("create", f"{POD}/attach", "pods", namespace="ns",
        subresource="attach", name="p", parts=("pods", "p", "attach"))),
    ("GET", f"{POD}/attach", "", res("get", f"{POD}/attach", "pods", namespace="ns",
        subresource="attach", name="p", parts=("pods", "p", "attach"))),
    ("POST", f"{POD}/portforward", "", res("create", f"{POD}/portforward", "pods",
        namespace="ns", subresource="portforward", name="p",
        parts=("pods", "p", "portforward"))),
    ("GET", f"{POD}/portforward", "ports=80", res("get", f"{POD}/portforward", "pods",
        namespace="ns", subresource="portforward", name="p",
        parts=("pods", "p", "portforward"))),
    ("GET", f"{POD}/log", "follow=true", res("get", f"{POD}/log", "pods", namespace="ns",
        subresource="log", name="p", parts=("pods", "p", "log"))),
    # --- non-resource URLs ---
    ("GET", "/healthz", "", nonres("get", "/healthz")),
    ("GET", "/livez/etcd", "", nonres("get", "/livez/etcd")),
    ("GET", "/version", "", nonres("get", "/version")),
    ("GET", "/openapi/v2", "", nonres("get", "/openapi/v2")),
    ("GET", "/openapi/v3", "", nonres("get", "/openapi/v3")),
    ("GET", "/openapi/v3/apis/apps/v1", "", nonres("get", "/openapi/v3/apis/apps/v1")),
    ("GET", "/metrics", "", nonres("get", "/metrics")),
    ("POST", "/healthz", "", nonres("post", "/healthz")),
    ("GET", "/", "", nonres("get", "/")),
    ("GET", "", "", nonres("get", "")),
    ("GET", "/api", "", nonres("get", "/api")),
    ("GET", "/api/v1", "watch=true", nonres("get", "/api/v1")),
    ("GET", "/apis", "", nonres("get", "/apis")),
    ("GET", "/apis/apps", "", nonres("get", "/apis/apps")),
    ("GET", "/apis/apps/v1", "", nonres("get", "/apis/apps/v1", prefix="apis")),
    ("GET", "/apis/apps/v1/", "", nonres("get", "/apis/apps/v1/", prefix="apis")),
    ("GET", "/badprefix/version/resource", "", nonres("get", "/badprefix/version/resource")),
    # --- odd shapes, kept as the apiserver has them ---
    ("GET", "/api/v1/pods/", "", res("list", "/api/v1/pods/", "pods", parts=("pods",))),
    ("GET", "/api/v1/watch", "", RequestInfo(is_resource_request=True, path="/api/v1/watch",
        verb="get", api_prefix="api", api_version="v1")),
]  # fmt: skip


def _case_id(case: tuple[str, str, str, RequestInfo]) -> str:
    method, path, query, _ = case
    return f"{method} {path or '<empty>'}{'?' + query if query else ''}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(case) for case in CASES])
def test_parse_request_info(case: tuple[str, str, str, RequestInfo]) -> None:
    method, path, query, expected = case
    assert parse_request_info(method, path, query) == expected


def test_table_is_large_enough() -> None:
    assert len(CASES) >= 45


# --- watch values, as the apiserver decodes them (not strconv.ParseBool) -------------------


@pytest.mark.parametrize(
    ("query", "verb"),
    [
        ("watch=true", "watch"),
        ("watch=True", "watch"),
        ("watch=TRUE", "watch"),
        ("watch=1", "watch"),
        ("watch=t", "watch"),
        ("watch=yes", "watch"),
        ("watch=", "watch"),
        ("watch", "watch"),
        ("watch=false", "list"),
        ("watch=FALSE", "list"),
        ("watch=fAlSe", "list"),
        ("watch=0", "list"),
        ("watch=false&watch=true", "list"),
        ("wat%63h=1", "watch"),
        ("watch=true;", "list"),  # Go drops a pair holding ';'
        ("watch=%zz", "list"),  # ... and one with a bad escape
        ("resourceVersion=10&allowWatchBookmarks=true", "list"),
    ],
)
def test_watch_flag(query: str, verb: str) -> None:
    assert parse_request_info("GET", "/api/v1/pods", query).verb == verb


@pytest.mark.parametrize(
    ("query", "name"),
    [
        ("fieldSelector=metadata.name%3Dweb-0", "web-0"),
        ("fieldSelector=metadata.name%3Dweb-0%2Cstatus.phase%3DRunning", "web-0"),
        ("fieldSelector=metadata.name%3Dfoo%2Cmetadata.name%3Dbar", "bar"),  # terms are sorted
        ("fieldSelector=metadata.name%3D", ""),
        ("fieldSelector=metadata.name%3D..", ""),
        ("fieldSelector=metadata.name%3Da%25b", ""),
        ("fieldSelector=metadata.name%3Da%5C%2Cb", "a,b"),
        ("fieldSelector=metadata.name%3Da%5Cb", ""),  # bad escape: selector does not parse
        ("fieldSelector=metadata.namespace%3Dns", ""),
        ("fieldSelector=metadata.name%3Dn&labelSelector=app%3Dweb", "n"),
        ("fieldSelector=metadata.name%3Dn&labelSelector=app+in+(a%2Cb)%2C!gone", "n"),
        ("fieldSelector=metadata.name%3Dn&labelSelector=-bad", ""),
        ("fieldSelector=metadata.name%3Dn&limit=500&timeoutSeconds=30", "n"),
        ("fieldSelector=metadata.name%3Dn&timeoutSeconds=1.5", ""),
    ],
)
def test_name_from_field_selector(query: str, name: str) -> None:
    info = parse_request_info("GET", "/api/v1/namespaces/ns/configmaps", query)
    assert (info.verb, info.name) == ("list", name)


def test_query_is_not_parsed_unless_it_can_matter(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(query: str) -> dict[str, str]:
        raise AssertionError(f"query parsed: {query}")

    monkeypatch.setattr(selectors, "_first_values", boom)
    query = "watch=true&fieldSelector=metadata.name%3Dx"
    assert parse_request_info("GET", "/api/v1/namespaces/ns/pods/p", query).verb == "get"
    assert parse_request_info("POST", "/api/v1/namespaces/ns/pods", query).verb == "create"
    assert parse_request_info("DELETE", "/api/v1/pods", query).verb == "deletecollection"
    assert parse_request_info("GET", "/api/v1/watch/pods", query).name == ""
    assert parse_request_info("GET", "/healthz", query).verb == "get"
    assert parse_request_info("GET", "/api/v1/pods").verb == "list"


# --- derived properties -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "query", "long_running"),
    [
        ("GET", "/api/v1/pods", "watch=true", True),
        ("GET", "/api/v1/watch/namespaces/ns/pods", "", True),
        ("GET", "/api/v1/proxy/namespaces/ns/pods/p", "", True),
        ("POST", f"{POD}/exec", "", True),
        ("GET", f"{POD}/exec", "", True),
        ("POST", f"{POD}/attach", "", True),
        ("GET", f"{POD}/attach", "", True),
        ("POST", f"{POD}/portforward", "", True),
        ("GET", f"{POD}/portforward", "", True),
        ("GET", f"{POD}/log", "", True),
        ("GET", f"{POD}/proxy/healthz", "", True),
        ("GET", "/api/v1/namespaces/ns/services/s:80/proxy/", "", True),
        ("GET", "/api/v1/nodes/n1/proxy/stats", "", True),
        ("GET", "/debug/pprof/profile", "", True),
        ("GET", "/api/v1/pods", "", False),
        ("GET", "/api/v1/pods", "watch=false", False),
        ("GET", POD, "", False),
        ("GET", f"{POD}/status", "", False),
        ("POST", f"{POD}/eviction", "", False),
        ("PUT", f"{APPS}/deployments/d/scale", "", False),
        ("GET", "/healthz", "", False),
        ("GET", "/debug/pprof", "", False),
        ("GET", "/apis/demo.opgate.dev/v1/namespaces/ns/widgets/w/status", "", False),
    ],
)
def test_is_long_running(method: str, path: str, query: str, long_running: bool) -> None:
    assert parse_request_info(method, path, query).is_long_running is long_running


@pytest.mark.parametrize(
    ("method", "path", "query", "verb", "policy_verb"),
    [
        ("POST", f"{POD}/exec", "", "create", "create"),  # SPDY
        ("GET", f"{POD}/exec", "", "get", "create"),  # WebSocket
        ("POST", f"{POD}/attach", "", "create", "create"),
        ("GET", f"{POD}/attach", "", "get", "create"),
        ("POST", f"{POD}/portforward", "", "create", "create"),
        ("GET", f"{POD}/portforward", "", "get", "create"),
        ("GET", f"{POD}/log", "", "get", "get"),
        ("GET", f"{POD}/proxy/x", "", "get", "get"),
        ("GET", POD, "", "get", "get"),
        ("GET", "/api/v1/pods", "watch=1", "watch", "watch"),
        ("GET", "/api/v1/pods", "", "list", "list"),
        ("DELETE", "/api/v1/namespaces/ns/pods", "", "deletecollection", "deletecollection"),
        ("PATCH", f"{APPS}/deployments/d/scale", "", "patch", "patch"),
        # only core pods carry these connect subresources; an aggregated API's keep their verb
        ("GET", "/apis/subresources.kubevirt.io/v1/namespaces/ns/vmis/v/portforward", "",
            "get", "get"),
        ("GET", "/healthz", "", "get", "get"),
    ],
)  # fmt: skip
def test_policy_verb(method: str, path: str, query: str, verb: str, policy_verb: str) -> None:
    info = parse_request_info(method, path, query)
    assert (info.verb, info.policy_verb) == (verb, policy_verb)


def test_request_info_is_frozen_and_slotted() -> None:
    info = parse_request_info("GET", "/api/v1/pods")
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.verb = "watch"  # type: ignore[misc]
    assert not hasattr(info, "__dict__")
    assert hash(info) == hash(parse_request_info("GET", "/api/v1/pods"))


# --- the cache and the shape ------------------------------------------------------------------


def test_repeated_calls_get_the_same_info_and_distinct_ones_their_own() -> None:
    first = parse_request_info("GET", "/api/v1/namespaces/a/configmaps/x", "")
    assert parse_request_info("GET", "/api/v1/namespaces/a/configmaps/x", "") is first
    assert parse_request_info("GET", "/api/v1/namespaces/a/configmaps", "watch=1").verb == "watch"
    assert parse_request_info("GET", "/api/v1/namespaces/a/configmaps", "").verb == "list"
    assert parse_request_info("HEAD", "/api/v1/namespaces/a/configmaps/x", "") is not first


def test_the_cache_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy.engine import requestinfo

    monkeypatch.setattr(requestinfo, "CACHE_SIZE", 8)
    infos = [parse_request_info("GET", f"/api/v1/namespaces/a/configmaps/c{i}") for i in range(50)]
    assert len(requestinfo._cache) <= 8
    again = [parse_request_info("GET", f"/api/v1/namespaces/a/configmaps/c{i}") for i in range(50)]
    assert again == infos  # equal, whether or not still cached


@pytest.mark.parametrize(("method", "path", "query"), [
    ("GET", f"{POD}/exec", ""),
    ("GET", f"{POD}/log", ""),
    ("GET", "/api/v1/pods", "watch=1"),
    ("GET", "/debug/pprof/profile", ""),
    ("GET", "/healthz", ""),
    ("GET", "/apis/apps/v1", ""),
    ("DELETE", f"{APPS}/deployments", ""),
    ("PUT", f"{CRD}/namespaces/n/widgets/w/status", ""),
])
def test_shape_is_what_rules_match_on(method: str, path: str, query: str) -> None:
    info = parse_request_info(method, path, query)
    assert info.shape == (info.policy_verb, info.verb, info.api_group, info.resource,
                          info.subresource, info.namespace, info.is_resource_request,
                          info.is_long_running, info.is_discovery)
    built = dataclasses.replace(info)  # built directly, not parsed: derived all the same
    assert built == info and built.shape == info.shape
    assert "shape" not in repr(info)


def test_calls_that_differ_by_name_share_a_shape() -> None:
    a = parse_request_info("GET", "/api/v1/namespaces/a/configmaps/x")
    b = parse_request_info("GET", "/api/v1/namespaces/a/configmaps/y")
    assert a != b and a.shape == b.shape
    assert parse_request_info("GET", "/api/v1/namespaces/b/configmaps/x").shape != a.shape


@pytest.mark.parametrize(("path", "discovery"), [
    ("/api", True), ("/api/v1", True), ("/apis", True), ("/apis/apps", True),
    ("/apis/apps/v1", True), ("/version", True), ("/version/", True), ("/openapi", True),
    ("/openapi/v2", True), ("/openapi/v3/apis/apps/v1", True),
    ("/metrics", False), ("/logs/", False), ("/healthz", False), ("/livez", False),
    ("/readyz", False), ("/debug/flags/v", False), ("/version/x", False), ("/apis-x", False),
    ("/openapiv2", False), ("/", False),
    ("/api/v1/namespaces/a/pods", False),  # a resource request is never discovery
])
def test_discovery_paths_have_their_own_shape(path: str, discovery: bool) -> None:
    # RBAC's system:discovery paths (a rule about every resource matches them, no other path):
    # the flag is in the shape, or the middlewares' memos would answer /metrics as /api
    info = parse_request_info("GET", path)
    assert info.is_discovery is discovery
    if not info.is_resource_request:
        assert (info.shape == parse_request_info("GET", "/api").shape) is discovery
        assert (info.shape == parse_request_info("GET", "/metrics").shape) is not discovery
