"""``{instance}``: resolution in DESIGN.md's order, when bodies are read, and the informer's cache.

The informer's list+watch loop runs here against a small loopback fake (pages, a watch stream, a
410, metadata Accept headers); tests/e2e/test_instance_overrides.py runs it against the real
apiserver.
"""

from __future__ import annotations

import asyncio
import json
from functools import partial
from typing import Any

import pytest
from aiohttp import web

from proxy.engine.chain import settle
from proxy.engine.context import RequestContext
from proxy.engine.policies import PolicySet, build_policy_set
from proxy.engine.requestinfo import parse_request_info
from proxy.middlewares import identity_spec, instance
from proxy.middlewares.instance import InstanceResolver, MemoryInstanceOverrides
from proxy.middlewares.ratelimit import RateLimit, parse_section
from proxy.relay import UpstreamConfig, listwatch
from proxy.relay.informer import InformerPool, _Resource
from proxy.relay.listwatch import (
    LIST_ACCEPT,
    NOT_SERVED_RETRY,
    WATCH_ACCEPT,
    Absent,
    Failed,
    Gone,
    apply_event,
)
from proxy.stores.memory import MemoryStore
from tests.unit.test_protometa import CONFIGMAP_PB, NAMED_PB, deep

JSON = "application/json"
PROTOBUF = "application/vnd.kubernetes.protobuf"
CM = "/api/v1/namespaces/a/configmaps"
WIDGETS = "/apis/demo.opgate.dev/v1/namespaces/a/widgets"
OWNED = {"metadata": {"name": "cm", "ownerReferences": [
    {"apiVersion": "demo.opgate.dev/v1", "kind": "Widget", "name": "other", "uid": "u0"},
    {"apiVersion": "demo.opgate.dev/v1", "kind": "Widget", "name": "w1", "uid": "u1",
     "controller": True}]}}


def ctx(method: str, path: str, body: Any = None, *, ctype: str | None = JSON,
        header: str | None = None) -> RequestContext:
    headers = {}
    if ctype:
        headers["Content-Type"] = ctype
    if header:
        headers["Opgate-Instance"] = header
    raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    return RequestContext(info=parse_request_info(method, path, ""), method=method, path=path,
                          query="", headers=headers, policies=None, body=raw)  # type: ignore[arg-type]


def overrides() -> MemoryInstanceOverrides:
    o = MemoryInstanceOverrides()
    o.watch("demo.opgate.dev", "widgets", "Widget")
    o.watch("demo.opgate.dev", "clusterwidgets", "ClusterWidget", cluster_scoped=True)
    return o


CASES = [
    ("header wins over the body", ctx("POST", CM, OWNED, header="a/Widget/named"),
     "a/Widget/named"),
    ("controller ownerReference in a create", ctx("POST", CM, OWNED), "a/Widget/w1"),
    ("controller ownerReference in an update", ctx("PUT", CM + "/cm", OWNED), "a/Widget/w1"),
    ("json with charset", ctx("POST", CM, OWNED, ctype="application/json; charset=utf-8"),
     "a/Widget/w1"),
    ("owner that is not the controller", ctx("POST", CM, {"metadata": {"ownerReferences": [
        {"kind": "Widget", "name": "w1", "controller": False}]}}), None),
    ("a patch body is not looked at", ctx("PATCH", CM + "/cm", OWNED,
                                          ctype="application/merge-patch+json"), None),
    ("controller ownerReference in a server-side apply (JSON, as client-go and "
     "controller-runtime send it)",
     ctx("PATCH", CM + "/cm", OWNED, ctype="application/apply-patch+yaml"), "a/Widget/w1"),
    ("apply-patch+json", ctx("PATCH", CM + "/cm", OWNED, ctype="application/apply-patch+json"),
     "a/Widget/w1"),
    ("an apply in YAML is not parsed", ctx(
        "PATCH", CM + "/cm", b"metadata:\n  ownerReferences:\n  - {kind: Widget, name: w1, "
        b"controller: true}\n", ctype="application/apply-patch+yaml"), None),
    ("an apply in CBOR is not decoded", ctx("PATCH", CM + "/cm", b'\xd9\xd9\xf7"ownerReferences"',
                                            ctype="application/apply-patch+cbor"), None),
    ("protobuf body (client-go's default)", ctx("POST", CM, CONFIGMAP_PB, ctype=PROTOBUF),
     "a/Widget/w1"),
    ("protobuf update", ctx("PUT", CM + "/cm", CONFIGMAP_PB, ctype=PROTOBUF), "a/Widget/w1"),
    ("protobuf body without an owner", ctx("POST", CM, NAMED_PB, ctype=PROTOBUF), None),
    ("protobuf that is not", ctx("POST", CM, b'k8s\x00 "ownerReferences" Widget w1',
                                 ctype=PROTOBUF), None),
    ("protobuf to a custom resource is not read (never served)",
     ctx("POST", WIDGETS, CONFIGMAP_PB, ctype=PROTOBUF), None),
    ("cbor body", ctx("POST", CM, b'\xd9\xd9\xf7"ownerReferences"', ctype="application/cbor"),
     None),
    ("malformed json", ctx("POST", CM, b'{"metadata": {"ownerReferences": [{'), None),
    ("not utf-8", ctx("POST", CM, b'{"ownerReferences": "\xff\xfe"}'), None),
    ("json that is not an object", ctx("POST", CM, b'["ownerReferences"]'), None),
    ("owner name with a slash", ctx("POST", CM, {"metadata": {"ownerReferences": [
        {"kind": "Widget", "name": "a/b", "controller": True}]}}), None),
    ("cluster-scoped owner kind", ctx("POST", CM, {"metadata": {"ownerReferences": [
        {"kind": "ClusterWidget", "name": "big", "controller": True}]}}), "/ClusterWidget/big"),
    ("the object itself, watched kind", ctx("PUT", WIDGETS + "/w1/status", {}), "a/Widget/w1"),
    ("the object itself on a get", ctx("GET", WIDGETS + "/w1", ctype=None), "a/Widget/w1"),
    ("create of a watched kind names it", ctx("POST", WIDGETS, {"metadata": {"name": "w2"}}),
     "a/Widget/w2"),
    ("create of a watched kind 2,000 levels deep (beyond Python's json) names it",
     ctx("POST", WIDGETS, b'{"metadata":{"name":"w3"},"spec":' + deep(2000) + b"}"),
     "a/Widget/w3"),
    ("controller ownerReference in a body 2,000 levels deep",
     ctx("POST", CM, b'{"data":' + deep(2000) + b',"metadata":'
         + json.dumps(OWNED["metadata"]).encode() + b"}"), "a/Widget/w1"),
    ("deeper than the apiserver reads (10,001 levels): as unreadable",
     ctx("POST", WIDGETS, b'{"metadata":{"name":"w4"},"spec":' + deep(10000) + b"}"), None),
    ("create with generateName", ctx("POST", WIDGETS, {"metadata": {"generateName": "w-"}}),
     None),
    ("a list of a watched kind", ctx("GET", WIDGETS, ctype=None), None),
    ("cluster-scoped object itself", ctx("DELETE", "/apis/demo.opgate.dev/v1/clusterwidgets/big",
                                         ctype=None), "/ClusterWidget/big"),
    ("built-in group", ctx("PUT", "/apis/apps/v1/namespaces/a/deployments/d", {}), None),
    ("core group", ctx("PUT", CM + "/cm", {"metadata": {"name": "cm"}}), None),
    ("non-resource path", ctx("GET", "/healthz", ctype=None), None),
]


@pytest.mark.parametrize("case, call, expected", CASES, ids=[c[0] for c in CASES])
def test_resolution_order(case: str, call: RequestContext, expected: str | None) -> None:
    assert InstanceResolver(overrides())(call) == expected


def test_unwatched_custom_resource_is_wanted_and_gets_dash() -> None:
    o = MemoryInstanceOverrides()
    resolve = InstanceResolver(o)
    assert resolve(ctx("PUT", WIDGETS + "/w1", {})) is None
    assert resolve(ctx("PUT", "/apis/apps/v1/namespaces/a/deployments/d", {})) is None
    assert resolve(ctx("GET", "/apis/x.example.com/v2/gadgets", ctype=None)) is None
    assert o.wanted == [("demo.opgate.dev", "v1", "widgets"), ("x.example.com", "v2", "gadgets")]


def test_body_is_not_parsed_with_the_header_or_without_the_mark(
        monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[bytes] = []
    real = instance._load
    monkeypatch.setattr(instance, "_load", lambda body: loads.append(body) or real(body))
    resolve = InstanceResolver(overrides())
    assert resolve(ctx("POST", CM, OWNED, header="a/Widget/x")) == "a/Widget/x"
    assert resolve(ctx("POST", CM, {"metadata": {"name": "cm", "labels": {"a": "b"}}})) is None
    assert resolve(ctx("POST", CM, b'"ownerReferences"', ctype=PROTOBUF)) is None
    assert loads == []
    assert resolve(ctx("POST", CM, OWNED)) == "a/Widget/w1"
    assert len(loads) == 1


# --- the middleware: which calls resolve {instance}, which bodies the relay reads -----------


def pset(rules: str) -> PolicySet:
    indented = "\n".join("    " + line for line in rules.strip("\n").splitlines())
    doc = ("apiVersion: opgate.dev/v1alpha1\nkind: Policy\nmetadata: {name: op}\n"
           f"spec:\n  rateLimits:\n{indented}\n")
    if "users:" in rules:  # users match only callers verified by an identity section
        doc += ("  identity:\n    allow: [{group: system:authenticated}]\n"
                "    rules: [{verbs: ['*'], resources: ['*']}]\n")
    parsers = {"rateLimits": parse_section, identity_spec.SECTION: identity_spec.parse_section}
    return build_policy_set([("rl.yaml", doc.encode())], parsers=parsers)


INSTANCE_WRITES = pset(
    "- {name: inst, match: {verbs: [create, update]}, key: '{instance}', qps: 1}")
PER_USER = pset("- {name: user, key: '{user}', qps: 1}")
INSTANCE_PATCHES = pset(
    "- {name: inst, match: {verbs: [create, update, patch]}, key: '{instance}', qps: 1}")
APPLY = "application/apply-patch+yaml"


def with_policies(call: RequestContext, policies: PolicySet) -> RequestContext:
    call.policies = policies
    return call


@pytest.mark.parametrize("call, policies, wanted", [
    (ctx("POST", CM, OWNED), INSTANCE_WRITES, True),
    (ctx("PUT", CM + "/cm", OWNED), INSTANCE_WRITES, True),
    (ctx("POST", CM, OWNED, header="a/Widget/w1"), INSTANCE_WRITES, False),
    (ctx("POST", CM, CONFIGMAP_PB, ctype=PROTOBUF), INSTANCE_WRITES, True),
    (ctx("PUT", WIDGETS + "/w1", b"", ctype=PROTOBUF), INSTANCE_WRITES, False),  # never served
    (ctx("POST", CM, OWNED, ctype="application/cbor"), INSTANCE_WRITES, False),
    (ctx("PATCH", CM + "/cm", OWNED, ctype="application/merge-patch+json"), INSTANCE_WRITES,
     False),
    (ctx("PATCH", CM + "/cm", OWNED, ctype=APPLY), INSTANCE_PATCHES, True),  # apply: verb patch
    (ctx("PATCH", CM + "/cm", OWNED, ctype=APPLY), INSTANCE_WRITES, False),
    (ctx("PATCH", CM + "/cm", OWNED, ctype="application/merge-patch+json"), INSTANCE_PATCHES,
     False),
    (ctx("PATCH", CM + "/cm", OWNED, ctype="application/apply-patch+cbor"), INSTANCE_PATCHES,
     False),
    (ctx("DELETE", CM + "/cm", {}), INSTANCE_WRITES, False),
    (ctx("POST", CM, OWNED), PER_USER, False),  # no rule needs {instance}
    (ctx("POST", CM, OWNED), pset(
        "- {name: reads, match: {verbs: [get]}, key: '{instance}', qps: 1}"), False),
    (ctx("POST", CM, OWNED), pset(  # identity is not known yet when the relay asks
        "- {name: op, match: {users: ['system:serviceaccount:ops:op']}, key: '{instance}', "
        "qps: 1}"), True),
])
def test_wants_body(call: RequestContext, policies: PolicySet, wanted: bool) -> None:
    mw = RateLimit(store=MemoryStore())
    assert mw.needs_body is True
    assert mw.wants_body(with_policies(call, policies)) is wanted
    off = RateLimit(store=MemoryStore(), resolve_instance_from_body=False)
    assert off.needs_body is False and off.wants_body(call) is False


class Counting:
    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.fail = fail

    def __call__(self, call: RequestContext) -> str | None:
        self.calls += 1
        if self.fail:
            raise RuntimeError("boom")
        return "a/Widget/w1"


def test_resolver_runs_only_when_a_matched_rule_needs_instance() -> None:
    resolver = Counting()
    mw = RateLimit(store=MemoryStore(), instance_resolver=resolver)
    both = pset("""
- {name: user, key: '{user}', qps: 100}
- {name: inst, match: {verbs: [create]}, key: '{instance}', qps: 100}
""")
    asyncio.run(settle(mw.entry(with_policies(ctx("GET", CM + "/cm", ctype=None), both))))
    assert resolver.calls == 0  # only the {user} rule matches a get
    asyncio.run(settle(mw.entry(with_policies(ctx("POST", CM, OWNED), both))))
    assert resolver.calls == 1


class RaisingOverrides(MemoryInstanceOverrides):
    def get(self, namespace: str, kind: str, name: str, annotation: str) -> float | None:
        raise RuntimeError("informer broke")


def test_failures_never_fail_the_call() -> None:
    rules = pset("- {name: inst, key: '{instance}', qps: 1, burst: 1, "
                 "instanceAnnotation: opgate.dev/qps, maxQps: 10}")
    store = MemoryStore()
    mw = RateLimit(store=store, instance_resolver=Counting(fail=True))
    assert asyncio.run(settle(mw.entry(with_policies(ctx("POST", CM, OWNED), rules)))) is None
    assert list(store._tats) == ["op/inst/-"]
    store = MemoryStore()
    mw = RateLimit(store=store, overrides=RaisingOverrides())
    assert asyncio.run(settle(mw.entry(with_policies(ctx("POST", CM, OWNED), rules)))) is None
    assert list(store._tats) == ["op/inst/a/Widget/w1"]  # the plain qps, its own bucket


def test_owner_reference_counts_against_the_owner_bucket() -> None:
    rules = pset("- {name: inst, key: '{instance}', qps: 1, burst: 1}")
    mw = RateLimit(store=MemoryStore())
    first = asyncio.run(settle(mw.entry(with_policies(ctx("GET", CM, ctype=None,
                                                   header="a/Widget/w1"), rules))))
    assert first is None
    second = asyncio.run(settle(mw.entry(with_policies(ctx("POST", CM, OWNED), rules))))
    assert second is not None and second.status.code == 429
    unowned = with_policies(ctx("POST", CM, {"metadata": {}}), rules)
    assert asyncio.run(settle(mw.entry(unowned))) is None


# --- the informer pool: its cache, without a network ----------------------------------------


def pool(**kw: Any) -> InformerPool:
    return InformerPool(UpstreamConfig(url="http://127.0.0.1:9"), **kw)


def test_informer_applies_events_and_keeps_only_valid_wanted_annotations() -> None:
    p = pool()
    p.get("a", "Widget", "w1", "opgate.dev/qps")  # wants the annotation and the kind
    p._add("demo.opgate.dev", "v1", "widgets", kind="Widget")
    r = p._resources[("demo.opgate.dev", "widgets")]

    def apply(doc: dict[str, Any], rv: str) -> str:
        return apply_event(doc, partial(p._event, r), rv)

    def event(kind: str, name: str, rv: str, **annotations: str) -> dict[str, Any]:
        return {"type": kind, "object": {"kind": "PartialObjectMetadata", "metadata": {
            "namespace": "a", "name": name, "resourceVersion": rv,
            "annotations": {"opgate.dev/qps": annotations.get("qps"), "big": "x" * 1000}
            if "qps" in annotations else {"big": "x"}}}}

    assert apply(event("ADDED", "w1", "5", qps="20"), "1") == "5"
    assert apply(event("ADDED", "w2", "6", qps="fast"), "5") == "6"
    assert apply(event("ADDED", "w3", "7"), "6") == "7"
    assert r.objects == {("a", "w1"): {"opgate.dev/qps": 20.0}}  # never the other annotations
    assert p.get("a", "Widget", "w1", "opgate.dev/qps") == 20.0
    assert p.get("a", "Widget", "w2", "opgate.dev/qps") is None
    apply(event("MODIFIED", "w1", "8", qps="-3"), "7")
    assert p.get("a", "Widget", "w1", "opgate.dev/qps") is None
    apply(event("MODIFIED", "w1", "9", qps="2.5"), "8")
    assert p.get("a", "Widget", "w1", "opgate.dev/qps") == 2.5
    bookmark = {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "12"}}}
    assert apply(bookmark, "9") == "12"
    apply(event("DELETED", "w1", "13"), "12")
    assert p.get("a", "Widget", "w1", "opgate.dev/qps") is None
    with pytest.raises(Gone):
        apply({"type": "ERROR", "object": {"kind": "Status", "code": 410}}, "13")
    with pytest.raises(Failed):
        apply({"type": "ERROR", "object": {"kind": "Status", "code": 500}}, "13")
    assert p.kind_of("demo.opgate.dev", "widgets") == "Widget"
    assert p.kind_of("demo.opgate.dev", "gadgets") is None
    assert not p.cluster_scoped("Widget")


def test_informer_warns_once_of_an_annotation_that_is_not_a_qps(
        caplog: pytest.LogCaptureFixture) -> None:
    """An instance annotated with what is not a qps ("fast", "0", "-3", "1e309") gets the
    rule's qps, as documented; the log says so, naming the instance and the value (the
    operator author who wrote it otherwise sees the rate ignore it, and nothing else), once
    per value and not again at each relist, and again when the value changes."""
    p = pool()
    p.get("a", "Widget", "w1", "opgate.dev/qps")
    p._add("demo.opgate.dev", "v1", "widgets", kind="Widget")
    r = p._resources[("demo.opgate.dev", "widgets")]

    def meta(name: str, qps: str) -> dict[str, Any]:
        return {"namespace": "a", "name": name, "annotations": {"opgate.dev/qps": qps}}

    def warnings() -> list[str]:
        return [rec.getMessage() for rec in caplog.records if rec.levelname == "WARNING"]

    with caplog.at_level("WARNING", logger="opgate.informer"):
        p._event(r, "ADDED", {"metadata": meta("w1", "fast")})
        p._event(r, "ADDED", {"metadata": meta("w2", "20")})
        assert warnings() == ['informer: Widget a/w1: annotation opgate.dev/qps "fast" is not '
                              "a qps (a number of at least 1e-09); its calls get the rule's qps"]
        p._event(r, "MODIFIED", {"metadata": meta("w1", "fast")})  # a relist, say
        assert len(warnings()) == 1
        p._event(r, "MODIFIED", {"metadata": meta("w1", "1e309")})
        assert len(warnings()) == 2 and '"1e309"' in warnings()[1]
    assert p.get("a", "Widget", "w1", "opgate.dev/qps") is None
    assert p.get("a", "Widget", "w2", "opgate.dev/qps") == 20.0


def test_informer_interest_is_bounded() -> None:
    p = pool(max_resources=2)
    p.want("apps", "v1", "deployments")  # built-in: never watched
    p.want("", "v1", "configmaps")
    for i in range(4):
        p.want("x.example.com", "v1", f"r{i}")
        p.want("x.example.com", "v1", f"r{i}")
    assert sorted(p._resources) == [("x.example.com", "r0"), ("x.example.com", "r1")]
    for i in range(20):
        p.get("a", "Widget", "w", f"opgate.dev/a{i}")
    assert len(p._annotations) == 8
    assert p.get("a", "Gadget", "g", "opgate.dev/a0") is None
    assert p._pending_kinds == {"Widget", "Gadget"}  # searched once the pool is started


# --- the informer pool against a loopback fake apiserver -----------------------------------


class FakeApiserver:
    """Discovery for demo.opgate.dev/v1 widgets, a 2-page list, watches from a script."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str, str]] = []  # path?query, Accept, Authorization, UA
        self.lists = 0
        self.watches = 0
        self.qps = "20"
        self.url = ""
        self._runner: web.ServerRunner | None = None
        self._stop = asyncio.Event()

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        self.seen.append((request.path_qs, request.headers.get("Accept", ""),
                          request.headers.get("Authorization", ""),
                          request.headers.get("User-Agent", "")))
        q = request.query
        if request.path == "/apis/demo.opgate.dev/v1":
            return web.json_response({"kind": "APIResourceList", "resources": [
                {"name": "widgets", "kind": "Widget", "namespaced": True},
                {"name": "widgets/status", "kind": "Widget", "namespaced": True}]})
        if request.path != "/apis/demo.opgate.dev/v1/widgets":
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        if "watch" not in q:
            self.lists += "continue" not in q
            name, more = ("w1", "page2") if "continue" not in q else ("w2", "")
            return web.json_response({
                "kind": "PartialObjectMetadataList",
                "metadata": {"resourceVersion": "10", "continue": more},
                "items": [{"metadata": {"namespace": "a", "name": name,
                                        "annotations": {"opgate.dev/qps": self.qps}}}]})
        self.watches += 1
        if self.watches == 2:  # the resourceVersion is too old: relist
            return web.json_response({"kind": "Status", "code": 410}, status=410)
        resp = web.StreamResponse()
        await resp.prepare(request)
        if self.watches == 1:
            events = [("MODIFIED", "w1", "11", "3"), ("BOOKMARK", "", "12", "")]
            for kind, name, rv, qps in events:
                obj = {"metadata": {"namespace": "a", "name": name, "resourceVersion": rv,
                                    "annotations": {"opgate.dev/qps": qps}}}
                await resp.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
                await asyncio.sleep(0.05)
            return resp  # the server ends this watch: resume from 12
        await self._stop.wait()
        return resp

    async def start(self) -> FakeApiserver:
        server = web.Server(self.handle, access_log=None)
        self._runner = web.ServerRunner(server, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def close(self) -> None:
        self._stop.set()
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.mark.asyncio
async def test_informer_lists_watches_resumes_and_relists_on_410() -> None:
    fake = await FakeApiserver().start()
    p = InformerPool(UpstreamConfig(url=fake.url, token="s3cret"), page_size=1)
    await p.start()
    try:
        assert p.get("a", "Widget", "w1", "opgate.dev/qps") is None  # not watched yet
        p.want("demo.opgate.dev", "v1", "widgets")
        for _ in range(200):
            if fake.lists >= 2 and fake.watches >= 3:
                break
            await asyncio.sleep(0.05)
        assert fake.lists == 2 and fake.watches == 3
        fake.qps = "7"
        assert p.kind_of("demo.opgate.dev", "widgets") == "Widget"
        assert p.get("a", "Widget", "w2", "opgate.dev/qps") == 20.0  # from the second list
        assert p.get("a", "Widget", "w1", "opgate.dev/qps") == 20.0  # relisted after the 410
    finally:
        await p.close()
        await fake.close()
    watches = [s for s in fake.seen if "watch=1" in s[0]]
    assert "resourceVersion=10" in watches[0][0] and "allowWatchBookmarks=true" in watches[0][0]
    assert "resourceVersion=12" in watches[1][0]  # resumed from the bookmark
    assert all(s[1] == WATCH_ACCEPT for s in watches)
    lists = [s for s in fake.seen if s[0].startswith("/apis/demo.opgate.dev/v1/widgets?limit")]
    assert len(lists) == 4 and all(s[1] == LIST_ACCEPT for s in lists)
    assert "continue=page2" in lists[1][0]
    assert all(s[2] == "Bearer s3cret" and s[3] == "opgate-informer" for s in fake.seen)


@pytest.mark.asyncio
async def test_informer_failures_back_off_and_answer_none(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []

    async def forbidden(request: web.BaseRequest) -> web.StreamResponse:
        calls.append(request.path)
        return web.json_response({"kind": "Status", "code": 403, "message": "no list for you"},
                                 status=403)

    runner = web.ServerRunner(web.Server(forbidden, access_log=None), shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    p = InformerPool(UpstreamConfig(url=url), max_backoff=0.2)
    await p.start()
    try:
        p.want("demo.opgate.dev", "v1", "widgets")
        await asyncio.sleep(1.0)
        assert p.kind_of("demo.opgate.dev", "widgets") is None
        assert p.get("a", "Widget", "w1", "opgate.dev/qps") is None
    finally:
        await p.close()
        await runner.cleanup()
    assert 3 <= calls.count("/apis/demo.opgate.dev/v1") <= 12  # retried, backing off
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"
                and "widgets" in r.getMessage()]
    assert len(warnings) == 1 and "HTTP 403" in warnings[0] and "no list for you" in warnings[0]


@pytest.mark.asyncio
async def test_informer_follows_a_crd_upgrade_to_its_new_version() -> None:
    """The CRD's upgrade serves v2 and stops serving v1: the informer lists and watches v2
    from then on. It kept listing the v1 path it had started with (404 at every retry, for
    ever), so the instances' own qps stayed what they were at that moment: a Widget annotated
    afterwards kept the old rate, and a new one got the rule's."""
    served = {"version": "v1", "qps": "20"}
    lists: list[str] = []

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        version = served["version"]
        if request.path == "/apis/demo.opgate.dev":
            return web.json_response({"kind": "APIGroup", "name": "demo.opgate.dev",
                                      "preferredVersion": {"version": version}})
        if request.path == f"/apis/demo.opgate.dev/{version}":
            return web.json_response({"kind": "APIResourceList", "resources": [
                {"name": "widgets", "kind": "Widget", "namespaced": True}]})
        if request.path != f"/apis/demo.opgate.dev/{version}/widgets":
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        if "watch" in request.query:  # ends at once: the loop lists again a second later
            return web.json_response({"kind": "Status", "code": 410}, status=410)
        lists.append(request.path)
        return web.json_response({
            "kind": "PartialObjectMetadataList", "metadata": {"resourceVersion": "10"},
            "items": [{"metadata": {"namespace": "a", "name": "w1",
                                    "annotations": {"opgate.dev/qps": served["qps"]}}}]})

    runner = web.ServerRunner(web.Server(handle, access_log=None), shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    p = InformerPool(UpstreamConfig(url=f"http://127.0.0.1:{runner.addresses[0][1]}"),
                     max_backoff=0.2)
    await p.start()
    try:
        p.get("a", "Widget", "w1", "opgate.dev/qps")  # wants the annotation
        p.want("demo.opgate.dev", "v1", "widgets")
        for _ in range(100):
            if p.get("a", "Widget", "w1", "opgate.dev/qps") == 20.0:
                break
            await asyncio.sleep(0.05)
        assert p.get("a", "Widget", "w1", "opgate.dev/qps") == 20.0
        served.update(version="v2", qps="7")
        for _ in range(100):
            if p.get("a", "Widget", "w1", "opgate.dev/qps") == 7.0:
                break
            await asyncio.sleep(0.05)
        assert p.get("a", "Widget", "w1", "opgate.dev/qps") == 7.0, lists
        assert lists[-1] == "/apis/demo.opgate.dev/v2/widgets"
    finally:
        await p.close()
        await runner.cleanup()


class _Slept(Exception):
    """Ends the informer's loop once enough of its backoff sleeps are recorded."""


@pytest.mark.parametrize("discovered", [
    pytest.param({"kind": "APIResourceList", "resources": []}, id="group-served-resource-not"),
    pytest.param(None, id="group-not-served"),
])
def test_informer_looks_for_a_resource_not_served_yet_every_few_seconds(
        monkeypatch: pytest.MonkeyPatch, discovered: dict[str, Any] | None) -> None:
    """Right after a CRD is created its group is served before its resource shows in the
    group's discovery: the informer backed off up to 60 s on that (a plain failure), so the
    instances' own qps applied up to a minute late, where a 404 (and the quota counts' watch,
    listwatch.py) looks again within NOT_SERVED_RETRY. The loop's sleeps are recorded, not
    slept."""
    slept: list[float] = []

    async def sleep(delay: float) -> None:
        slept.append(delay)
        if len(slept) >= 12:
            raise _Slept

    async def get_json(path: str, *, accept: str) -> dict[str, Any]:
        if discovered is None:
            raise Absent(f"HTTP 404 for {path}")
        return discovered

    monkeypatch.setattr(listwatch.asyncio, "sleep", sleep)
    p = pool()
    monkeypatch.setattr(p, "_get_json", get_json)
    r = _Resource("demo.opgate.dev", "v1", "widgets")  # not spawned: run by hand below
    with pytest.raises(_Slept):
        asyncio.run(p._run(r))
    assert not r.kind
    assert max(slept) <= NOT_SERVED_RETRY and slept[0] < slept[3]
