"""The audit middleware: audit.k8s.io/v1 Events in the apiserver's shape, the stages, bodies at
Request level, no token ever, rotation by size, and a writer that drops instead of blocking."""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from multidict import CIMultiDict

from proxy.app import section_parsers
from proxy.engine import telemetry
from proxy.engine.chain import Chain, settle
from proxy.engine.context import Deny, Identity, RequestContext
from proxy.engine.logfile import RotatingFile
from proxy.engine.policies import EMPTY, PolicySet, build_policy_set, load_policy_set
from proxy.engine.requestinfo import parse_request_info
from proxy.engine.status import (
    StatusError,
    forbidden,
    internal_error,
    service_unavailable,
    unauthorized,
)
from proxy.middlewares import audit as audit_mod
from proxy.middlewares.accesslog import AccessWriter
from proxy.middlewares.audit import Audit
from proxy.middlewares.audit_event import CLIENT_GONE, ENCODER, micro_time, request_uri
from proxy.middlewares.audit_stream import QueuedStream
from proxy.relay.fast.wire import WireHeaders
from tests.unit.test_protometa import NAMED_PB, deep

TOKEN = "eyJhbGciOiJSUzI1NiJ9.c2VjcmV0LXRva2Vu.c2lnbmF0dXJl"
SA = Identity(user="system:serviceaccount:ops:op", uid="4d2c-11",
              groups=("system:serviceaccounts", "system:serviceaccounts:ops",
                      "system:authenticated"), source="serviceaccount")
MICRO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")
# audit.k8s.io/v1 Event: every field, in the order the apiserver's JSON has them
EVENT_FIELDS = ["kind", "apiVersion", "level", "auditID", "stage", "requestURI", "verb", "user",
                "impersonatedUser", "sourceIPs", "userAgent", "objectRef", "responseStatus",
                "requestObject", "responseObject", "requestReceivedTimestamp", "stageTimestamp",
                "annotations"]
REQUIRED = {"kind", "apiVersion", "level", "auditID", "stage", "requestURI", "verb", "user",
            "requestReceivedTimestamp", "stageTimestamp"}
OBJECT_REF_FIELDS = ["resource", "namespace", "name", "uid", "apiGroup", "apiVersion",
                     "resourceVersion", "subresource"]


IDENTITY = ("  identity:\n    allow: [{group: system:authenticated}]\n"
            "    rules: [{verbs: ['*'], resources: ['*']}]\n")  # users need one in the set


def policies(audit: str = "", *, impersonation: bool = False, identity: bool = False
             ) -> PolicySet:
    if not audit and not impersonation:
        return EMPTY
    text = ("apiVersion: opgate.dev/v1alpha1\nkind: Policy\nmetadata: {name: p}\nspec:\n"
            + ("  allowImpersonation: true\n" if impersonation else "")
            + (IDENTITY if identity else "")
            + ("  audit:\n" + audit if audit else ""))
    return build_policy_set([("p.yaml", text.encode())], parsers=section_parsers())


def make_ctx(method: str, path: str, query: str = "", *, pset: PolicySet = EMPTY,
             headers: dict[str, str] | None = None, body: bytes | None = None,
             agent: bool = True, wire: bool = False) -> RequestContext:
    """``wire``: the headers as the fast relay hands them over (:class:`WireHeaders` over the
    bytes received, UTF-8 here), not aiohttp's mapping."""
    hdrs: CIMultiDict[str] = CIMultiDict({"Authorization": f"Bearer {TOKEN}",
                                          "User-Agent": "kubectl/v1.33.0 (linux/amd64)"})
    if not agent:
        del hdrs["User-Agent"]
    hdrs.update(headers or {})
    mapping: Any = hdrs
    if wire:
        mapping = WireHeaders([(k.encode(), v.encode()) for k, v in hdrs.items()])
    ctx = RequestContext(info=parse_request_info(method, path, query), method=method, path=path,
                         query=query, headers=mapping, policies=pset, trace_id="5a1f-f1c")
    ctx.body = body
    return ctx


class Lines:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        assert line.endswith("\n") and "\n" not in line[:-1]
        self.lines.append(line)

    @property
    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.lines]


def finish(ctx: RequestContext, code: int, seconds: float = 0.012) -> None:
    ctx.status_code = code
    ctx.finished = ctx.started + seconds


def run_call(auditor: Audit, ctx: RequestContext, code: int = 200) -> None:
    async def call() -> None:
        assert await settle(auditor.entry(ctx)) is None
        finish(ctx, code)
        await settle(auditor.exit(ctx))
    asyncio.run(call())


def check_shape(ev: dict[str, Any]) -> None:
    """What the apiserver's Event schema demands, and its field order."""
    assert REQUIRED <= set(ev)
    assert set(ev) <= set(EVENT_FIELDS)
    assert list(ev) == [k for k in EVENT_FIELDS if k in ev]
    assert (ev["kind"], ev["apiVersion"]) == ("Event", "audit.k8s.io/v1")
    assert ev["level"] in ("Metadata", "Request", "RequestResponse")
    assert ev["stage"] in ("ResponseStarted", "ResponseComplete")
    assert MICRO.fullmatch(ev["requestReceivedTimestamp"])
    assert MICRO.fullmatch(ev["stageTimestamp"])
    assert ev["stageTimestamp"] >= ev["requestReceivedTimestamp"]
    if "objectRef" in ev:
        assert list(ev["objectRef"]) == [k for k in OBJECT_REF_FIELDS if k in ev["objectRef"]]
    if "responseStatus" in ev:
        keys = list(ev["responseStatus"])
        assert (keys[0], keys[-1]) == ("metadata", "code")
    assert all(isinstance(v, str) for v in ev.get("annotations", {}).values())


def test_metadata_event_for_a_verified_caller() -> None:
    out = Lines()
    auditor = Audit(write=out)
    ctx = make_ctx("GET", "/apis/apps/v1/namespaces/team-a/deployments/web")
    ctx.identity = SA
    ctx.wall_time = 1_764_480_600.25
    run_call(auditor, ctx)
    (ev,) = out.events
    check_shape(ev)
    assert ev == {
        "kind": "Event", "apiVersion": "audit.k8s.io/v1", "level": "Metadata",
        "auditID": "5a1f-f1c", "stage": "ResponseComplete",
        "requestURI": "/apis/apps/v1/namespaces/team-a/deployments/web", "verb": "get",
        "user": {"username": "system:serviceaccount:ops:op", "uid": "4d2c-11",
                 "groups": ["system:serviceaccounts", "system:serviceaccounts:ops",
                            "system:authenticated"]},
        "userAgent": "kubectl/v1.33.0 (linux/amd64)",
        "objectRef": {"resource": "deployments", "namespace": "team-a", "name": "web",
                      "apiGroup": "apps", "apiVersion": "v1"},
        "responseStatus": {"metadata": {}, "code": 200},
        "requestReceivedTimestamp": "2025-11-30T05:30:00.250000Z",
        "stageTimestamp": "2025-11-30T05:30:00.262000Z",
        "annotations": {"opgate.dev/decision": "allowed"},
    }


# a pod-bound service-account token's user as kube-apiserver v1.35 logs it (keys sorted)
POD_BOUND_EXTRA = {
    "authentication.kubernetes.io/credential-id": ["JTI=7f0c2d1e-5b"],
    "authentication.kubernetes.io/node-name": ["node-1"],
    "authentication.kubernetes.io/node-uid": ["9e8d-77"],
    "authentication.kubernetes.io/pod-name": ["op-7d9f"],
    "authentication.kubernetes.io/pod-uid": ["c0ffee-01"]}
POD_BOUND = Identity(user=SA.user, uid=SA.uid, groups=SA.groups, source="serviceaccount",
                     extra=tuple((k, tuple(v)) for k, v in POD_BOUND_EXTRA.items()))


def test_user_extra_is_recorded_after_the_groups_only_when_there_is_some() -> None:
    """``user`` in authentication/v1 UserInfo's field order (username, uid, groups, extra),
    ``extra`` by key as Go writes a map; none at all for an identity without any."""
    out = Lines()
    auditor = Audit(write=out)
    for identity in (POD_BOUND, SA):
        ctx = make_ctx("GET", "/api/v1/namespaces/team-a/configmaps/c")
        ctx.identity = identity
        run_call(auditor, ctx)
    bound, plain = out.events
    check_shape(bound)
    assert list(bound["user"]) == ["username", "uid", "groups", "extra"]
    assert bound["user"]["extra"] == POD_BOUND_EXTRA
    assert list(bound["user"]["extra"]) == sorted(POD_BOUND_EXTRA)
    assert list(plain["user"]) == ["username", "uid", "groups"]


_ODD_AGENT = 'kubectl "quoted" \\ \u00e9\u4e2d\x01'


@pytest.mark.parametrize("case", [
    "plain", "unverified", "odd-agent", "no-agent", "rule", "query-secret", "escaped-path",
    "cluster-scope", "non-resource", "client-gone", "upstream-500", "create-named",
    "create-from-body", "denied", "error", "request-level", "impersonated", "no-status",
    "next-second", "forwarded", "unix-socket", "ipv6", "real-ip", "impersonation-allowed",
    "impersonation-allowed-per-call", "end-of-second", "before-received", "throttled-200",
    "odd-decision", "before-1970", "early-seconds", "audit-id", "extra",
])
@pytest.mark.parametrize("wire", [False, True], ids=["aiohttp-headers", "wire-headers"])
def test_joined_lines_equal_the_encoded_event(case: str, wire: bool) -> None:
    """The exit hook joins JSON fragments it remembers per kind of call in the common case:
    the text must be exactly what encoding :meth:`Audit.event` gives (``Audit.line``), for
    every case, twice (memo miss, hit)."""
    path, method, query, body = "/api/v1/namespaces/a/configmaps/c", "GET", "", None
    headers: dict[str, str] = {}
    pset, code = EMPTY, 200
    if case == "odd-agent":
        headers["User-Agent"] = _ODD_AGENT
    if case == "rule":
        pset = policies("    rules:\n      - level: Metadata\n        verbs: [get]\n")
    if case == "query-secret":
        query = "access_token=abc&labelSelector=a%3Db"
    if case == "escaped-path":
        path = "/api/v1/namespaces/a/configmaps/w\u00e9ird name"
    if case == "cluster-scope":
        path = "/apis/rbac.authorization.k8s.io/v1/clusterroles/admin"
    if case == "non-resource":
        path = "/version"
    if case == "client-gone":
        code = CLIENT_GONE
    if case == "upstream-500":
        code = 500
    if case.startswith("create"):
        method, code = "POST", 201
        path = "/api/v1/namespaces/a/configmaps" + ("/c" if case == "create-named" else "")
        body = b'{"metadata":{"name":"from-body"}}'
    if case == "request-level":
        pset = policies("    rules:\n      - level: Request\n")
        method, body = "PUT", b'{"metadata":{"name":"c"}}'
    if case == "impersonated":
        headers["Impersonate-User"] = "jane"
    if case == "forwarded":
        headers["X-Forwarded-For"] = "10.0.0.1"
    if case == "real-ip":
        headers["X-Real-Ip"] = "10.0.0.3"
    if case == "audit-id":
        headers["Audit-ID"] = 'client "chosen" id'
    if case.startswith("impersonation-allowed"):
        headers["Impersonate-User"] = "jane"
        if case == "impersonation-allowed":
            pset = policies(impersonation=True)
    ctx = make_ctx(method, path, query, pset=pset, headers=headers, body=body,
                   agent=case != "no-agent", wire=wire)
    ctx.allow_impersonation = case == "impersonation-allowed-per-call"
    ctx.remote = {"unix-socket": "", "ipv6": "::1"}.get(case, "127.0.0.1")
    if case != "unverified":
        ctx.identity = POD_BOUND if case == "extra" else SA
    ctx.wall_time = 1_764_480_600.25
    finish(ctx, 0 if case == "no-status" else code)
    if case == "denied":
        ctx.answer = forbidden("denied by rule r in p.yaml")
        ctx.decision, ctx.status_code = "denied", 403
    if case == "error":
        ctx.error, ctx.status_code = "upstream reset", 502
    if case == "end-of-second":
        ctx.wall_time = 1_764_480_600.9999995
    if case == "before-1970":  # int() rounds toward zero: not the second the time is in
        ctx.wall_time = -0.75
    if case == "early-seconds":
        ctx.wall_time = 1.25
    if case == "throttled-200":  # a decision other than allowed, with a code below 400
        ctx.decision = "throttled"
    if case == "odd-decision":  # a label without a remembered JSON text
        ctx.decision = 'we\u00efrd "one"'
    out = Lines()
    auditor = Audit(write=out)
    decision = auditor.plan(ctx.policies).decide(ctx.info, ctx.identity)
    # the call's end as the exit hook works it out (next-second: in the next second;
    # before-received: a clock that went back)
    ctx.finished = ctx.started + {"next-second": 1.9, "before-received": -0.5}.get(case, 0.5)
    end = ctx.wall_time + (ctx.finished - ctx.started)
    expected = ENCODER.encode(auditor.event(ctx, decision, "ResponseComplete", end))
    assert auditor.line(ctx, decision, "ResponseComplete", end) == expected + "\n"
    if case != "before-1970":
        check_shape(json.loads(expected))
    for _ in range(2):
        asyncio.run(settle(auditor.exit(ctx)))
        assert out.lines.pop() == expected + "\n"
    if case.startswith("impersonation-allowed"):
        assert json.loads(expected)["impersonatedUser"] == {
            "username": "jane", "groups": ["system:authenticated"]}
    if case == "impersonated":  # not allowed: the header is not logged
        assert "impersonatedUser" not in json.loads(expected)
    if case == "extra":
        assert json.loads(expected)["user"]["extra"] == POD_BOUND_EXTRA


@pytest.mark.parametrize("wire", [False, True], ids=["aiohttp-headers", "wire-headers"])
def test_joined_lines_follow_each_caller_and_the_policy_set_in_force(wire: bool) -> None:
    """Calls sharing one RequestInfo but not their identity, user agent, address or query, and
    a new policy set for the same calls: each line is still exactly the encoded event."""
    auditor = Audit(write=Lines())
    path = "/api/v1/namespaces/a/configmaps/c"
    other = Identity(user="jane", groups=("dev",))
    kubectl = {"User-Agent": "kubectl/v1.33.0"}
    variants: list[tuple[Any, dict[str, str], str, str]] = [
        (SA, kubectl, "127.0.0.1", ""), (other, kubectl, "127.0.0.1", ""),
        (None, kubectl, "127.0.0.1", ""), (SA, {"User-Agent": "client-go/0.33"}, "127.0.0.1", ""),
        (SA, kubectl, "10.1.2.3", ""), (SA, kubectl, "127.0.0.1", "limit=1"),
        (Identity(user="jane", groups=("dev",)), kubectl, "127.0.0.1", ""),
        # the same memo key as the first, with headers that change the event
        (SA, {**kubectl, "X-Forwarded-For": "10.0.0.1"}, "127.0.0.1", ""),
        (SA, {**kubectl, "X-Real-Ip": "10.0.0.3"}, "127.0.0.1", ""),
        (SA, {**kubectl, "Impersonate-User": "jane"}, "127.0.0.1", ""),
        (SA, {**kubectl, "Audit-ID": "b7e2-client"}, "127.0.0.1", ""),
    ]
    rules = policies("    rules:\n      - level: Metadata\n        users: [jane]\n"
                     "    level: None\n", identity=True)
    for pset in (EMPTY, rules, policies(impersonation=True), EMPTY):
        for _ in range(2):
            for identity, headers, remote, query in variants:
                out = Lines()
                auditor._write = out
                ctx = make_ctx("GET", path, query, pset=pset, headers=headers, wire=wire)
                ctx.identity, ctx.remote, ctx.wall_time = identity, remote, 1_764_480_600.25
                finish(ctx, 200)
                asyncio.run(settle(auditor.exit(ctx)))
                decision = auditor.plan(pset).decide(ctx.info, identity)
                if decision.level == "None":
                    assert out.lines == []
                    continue
                end = ctx.wall_time + (ctx.finished - ctx.started)
                expected = ENCODER.encode(
                    auditor.event(ctx, decision, "ResponseComplete", end))
                assert out.lines == [expected + "\n"]


@pytest.mark.parametrize("wire", [False, True], ids=["aiohttp-headers", "wire-headers"])
def test_the_clients_audit_id_is_the_events_as_the_apiserver_takes_it(wire: bool) -> None:
    """The apiserver logs a call under the ``Audit-ID`` its client sent (opgate forwards it):
    opgate's event for the call carries the same ID (its trace id only when none came), on
    every stage; an empty header counts as none, as the apiserver's."""
    out = Lines()
    auditor = Audit(write=out)
    for value, expected in (("4f0c-client-id", "4f0c-client-id"), ("", "5a1f-f1c")):
        for _ in range(2):  # memo miss, hit
            ctx = make_ctx("GET", "/api/v1/namespaces/a/configmaps/c",
                           headers={"Audit-ID": value}, wire=wire)
            run_call(auditor, ctx)
            assert out.events[-1]["auditID"] == expected
    ctx = make_ctx("GET", "/api/v1/namespaces/a/configmaps", "watch=true",
                   headers={"Audit-ID": "w-1"}, wire=wire)
    ctx.status_code = 200
    auditor._exit_open(ctx, audit_mod._Open(ctx, auditor.plan(EMPTY).decide(ctx.info, None)))
    assert [(e["stage"], e["auditID"]) for e in out.events[-2:]] == [
        ("ResponseStarted", "w-1"), ("ResponseComplete", "w-1")]


@pytest.mark.parametrize(("headers", "expected"), [
    ([("Impersonate-User", "bob")], {"username": "bob", "groups": ["system:authenticated"]}),
    ([("Impersonate-User", "bob"), ("Impersonate-Group", "dev"), ("Impersonate-Group", "ops"),
      ("Impersonate-Uid", "u-1"), ("Impersonate-Extra-Scopes", "openid"),
      ("Impersonate-Extra-Scopes", "profile"), ("Impersonate-Extra-acme.com%2fproject", "p")],
     {"username": "bob", "uid": "u-1", "groups": ["dev", "ops", "system:authenticated"],
      "extra": {"acme.com/project": ["p"], "scopes": ["openid", "profile"]}}),
    ([("Impersonate-User", "bob"), ("Impersonate-Group", "system:unauthenticated")],
     {"username": "bob", "groups": ["system:unauthenticated"]}),
    ([("Impersonate-User", "system:anonymous")],
     {"username": "system:anonymous", "groups": ["system:unauthenticated"]}),
    ([("Impersonate-User", "system:serviceaccount:team-a:op")],
     {"username": "system:serviceaccount:team-a:op",
      "groups": ["system:serviceaccounts", "system:serviceaccounts:team-a",
                 "system:authenticated"]}),
    ([("Impersonate-User", "system:serviceaccount:team-a:op"), ("Impersonate-Group", "g")],
     {"username": "system:serviceaccount:team-a:op", "groups": ["g", "system:authenticated"]}),
    ([("Impersonate-User", "system:serviceaccount:Team_A:op")],  # not a namespace: a user
     {"username": "system:serviceaccount:Team_A:op", "groups": ["system:authenticated"]}),
    # the first Impersonate-Uid is the one (Go's Header.Get): an empty one is none
    ([("Impersonate-User", "bob"), ("Impersonate-Uid", ""), ("Impersonate-Uid", "u-2")],
     {"username": "bob", "groups": ["system:authenticated"]}),
])
@pytest.mark.parametrize("wire", [False, True], ids=["aiohttp-headers", "wire-headers"])
def test_impersonated_user_is_the_user_the_apiserver_switches_to(
        headers: list[tuple[str, str]], expected: dict[str, Any], wire: bool) -> None:
    """The apiserver logs the whole user it impersonates (k8s.io/apiserver's impersonation
    filter): groups, uid, extra, and the group every such user is in."""
    out = Lines()
    ctx = make_ctx("GET", "/api/v1/namespaces/a/configmaps/c", pset=policies(impersonation=True),
                   wire=wire)
    pairs = [(k.encode(), v.encode()) for k, v in [*ctx.headers.items(), *headers]]
    ctx.headers = WireHeaders(pairs) if wire else CIMultiDict(
        [(k.decode(), v.decode()) for k, v in pairs])
    run_call(Audit(write=out), ctx)
    (ev,) = out.events
    check_shape(ev)
    assert json.dumps(ev["impersonatedUser"]) == json.dumps(expected)  # the order, too


@pytest.mark.parametrize(("headers", "dropped", "expected"), [
    ([("Connection", "Impersonate-User"), ("Impersonate-User", "bob")], (), None),
    ([("Connection", "keep-alive, impersonate-group"), ("Impersonate-User", "bob"),
      ("Impersonate-Group", "dev"), ("Impersonate-Extra-Scopes", "s")], (),
     {"username": "bob", "groups": ["system:authenticated"], "extra": {"scopes": ["s"]}}),
    ([("Impersonate-User", "bob"), ("Impersonate-Uid", "u-1")], ("impersonate-uid",),
     {"username": "bob", "groups": ["system:authenticated"]}),
    ([("Impersonate-User", "bob")], ("impersonate-user",), None),
])
@pytest.mark.parametrize("wire", [False, True], ids=["aiohttp-headers", "wire-headers"])
def test_impersonation_headers_the_relay_drops_are_not_the_impersonated_user(
        headers: list[tuple[str, str]], dropped: tuple[str, ...],
        expected: dict[str, Any] | None, wire: bool) -> None:
    """A header named in ``Connection`` (hop-by-hop) or dropped by a middleware never reaches
    the apiserver, which then impersonates without it (or not at all): the event says so."""
    out = Lines()
    ctx = make_ctx("GET", "/api/v1/namespaces/a/configmaps/c", pset=policies(impersonation=True),
                   wire=wire)
    pairs = [(k.encode(), v.encode()) for k, v in [*ctx.headers.items(), *headers]]
    ctx.headers = WireHeaders(pairs) if wire else CIMultiDict(
        [(k.decode(), v.decode()) for k, v in pairs])
    ctx.drop_request_headers.update(dropped)
    run_call(Audit(write=out), ctx)
    (ev,) = out.events
    check_shape(ev)
    assert ev.get("impersonatedUser") == expected


@pytest.mark.parametrize(("method", "path", "query", "verb"), [
    ("GET", "/api/v1/namespaces/a/pods", "", "list"),
    ("GET", "/api/v1/namespaces/a/pods", "watch=true", "watch"),
    ("POST", "/api/v1/namespaces/a/pods", "", "create"),
    ("PUT", "/api/v1/namespaces/a/pods/p", "", "update"),
    ("PATCH", "/api/v1/namespaces/a/pods/p", "", "patch"),
    ("DELETE", "/api/v1/namespaces/a/pods/p", "", "delete"),
    ("DELETE", "/api/v1/namespaces/a/pods", "", "deletecollection"),
    ("GET", "/healthz", "", "get"),
    ("POST", "/logs", "", "post"),
])
def test_verbs_are_the_apiservers(method: str, path: str, query: str, verb: str) -> None:
    out = Lines()
    ctx = make_ctx(method, path, query)
    asyncio.run(_exit(Audit(write=out), ctx, 200))
    (ev,) = out.events
    check_shape(ev)
    assert ev["verb"] == verb
    assert ("objectRef" in ev) is path.startswith("/api/")


async def _exit(auditor: Audit, ctx: RequestContext, code: int) -> None:
    finish(ctx, code)
    await settle(auditor.exit(ctx))


@pytest.mark.parametrize(("remote", "headers", "expected"), [
    ("127.0.0.1", {}, ["127.0.0.1"]),
    ("", {}, []),  # a Unix socket
    ("::1", {}, ["::1"]),
    ("127.0.0.1", {"X-Forwarded-For": "10.0.0.1, not-an-ip , 10.0.0.2"},
     ["10.0.0.1", "10.0.0.2", "127.0.0.1"]),
    ("127.0.0.1", {"X-Forwarded-For": "10.0.0.1, 127.0.0.1"}, ["10.0.0.1", "127.0.0.1"]),
    ("127.0.0.1", {"X-Real-Ip": "10.0.0.3"}, ["10.0.0.3", "127.0.0.1"]),
    ("127.0.0.1", {"X-Forwarded-For": "10.0.0.3", "X-Real-Ip": "10.0.0.3"},
     ["10.0.0.3", "127.0.0.1"]),
    ("127.0.0.1", {"X-Forwarded-For": "2001:DB8::1"}, ["2001:db8::1", "127.0.0.1"]),
])
def test_source_ips_as_the_apiserver_lists_them(remote: str, headers: dict[str, str],
                                               expected: list[str]) -> None:
    out = Lines()
    ctx = make_ctx("GET", "/api/v1/namespaces/a/pods", headers=headers)
    ctx.remote = remote
    run_call(Audit(write=out), ctx)
    (ev,) = out.events
    check_shape(ev)
    assert ev.get("sourceIPs", []) == expected


def test_unverified_caller_subresource_and_cluster_scope() -> None:
    out = Lines()
    ctx = make_ctx("GET", "/api/v1/nodes/n1/proxy/metrics")
    asyncio.run(_exit(Audit(write=out), ctx, 200))
    (ev,) = out.events
    check_shape(ev)
    assert ev["user"] == {}
    assert ev["annotations"]["opgate.dev/user"] == "unverified"
    assert ev["objectRef"] == {"resource": "nodes", "name": "n1", "apiVersion": "v1",
                               "subresource": "proxy"}


def test_a_denial_is_recorded_with_its_status() -> None:
    """Through a real Chain: an earlier middleware denies; the audit exit hook records it."""
    out = Lines()
    status = forbidden('opgate: rule spec.identity.rules[1] (p.yaml:12) denies "delete"')

    class Denier:
        name, needs_body = "identity", False

        async def entry(self, ctx: RequestContext) -> Deny:
            ctx.identity = SA
            return Deny(status, "denied")

    auditor = Audit(write=out)
    chain = Chain([Denier(), auditor])
    ctx = make_ctx("DELETE", "/api/v1/namespaces/kube-system/configmaps/c")

    async def call() -> None:
        denied = await settle(chain.entry(ctx))
        assert denied is status
        ctx.answer = denied  # what the relay does with it
        finish(ctx, denied.code)
        await settle(chain.exit(ctx))
    asyncio.run(call())
    (ev,) = out.events
    check_shape(ev)
    assert ev["user"]["username"] == SA.user
    assert ev["annotations"]["opgate.dev/decision"] == "denied"
    assert ev["responseStatus"]["code"] == 403
    assert ev["responseStatus"]["status"] == "Failure"
    assert ev["responseStatus"]["reason"] == "Forbidden"
    assert ev["responseStatus"]["message"] == status.message
    assert ev["annotations"]["opgate.dev/reason"] == status.message


@pytest.mark.parametrize(("details", "recorded"), [
    ({"name": "c", "kind": "configmaps"}, {"name": "c", "kind": "configmaps"}),
    ({}, {}),  # a non-resource path: the apiserver logs "details":{} as well
    (None, None),
])
def test_a_403_of_opgates_own_records_its_details(details: dict[str, str] | None,
                                                  recorded: dict[str, str] | None) -> None:
    """``responseStatus`` as the apiserver logs its own Forbidden: ``details`` (before the
    code, in metav1.Status' order) as the Status sent had them."""
    out = Lines()
    auditor = Audit(write=out)
    ctx = make_ctx("GET", "/api/v1/namespaces/a/configmaps/c")
    ctx.identity = SA
    ctx.answer = forbidden("opgate: rule r denies", details=details)
    ctx.decision = "denied"
    run_call(auditor, ctx, 403)
    (ev,) = out.events
    check_shape(ev)
    got = ev["responseStatus"]
    assert got.get("details") == recorded
    assert list(got) == ["metadata", "status", "message", "reason",
                         *(["details"] if recorded is not None else []), "code"]


def test_a_protobuf_create_names_its_object_too() -> None:
    """client-go sends built-in kinds as protobuf: the body is left out, its name is not."""
    out = Lines()
    pset = policies("    rules:\n      - level: Request\n        verbs: [create]\n")
    auditor = Audit(write=out)
    ctx = make_ctx("POST", "/api/v1/namespaces/a/configmaps", pset=pset,
                   headers={"Content-Type": "application/vnd.kubernetes.protobuf"},
                   body=NAMED_PB)
    assert auditor.wants_body(ctx)
    ctx.identity = SA
    run_call(auditor, ctx, 201)
    (ev,) = out.events
    check_shape(ev)
    assert ev["objectRef"]["name"] == "cm-1"
    assert "requestObject" not in ev
    assert ev["annotations"]["opgate.dev/request-object"].startswith("omitted: not JSON")


def test_request_level_records_the_request_object() -> None:
    out = Lines()
    pset = policies("    omitManagedFields: true\n"
                    "    rules:\n      - level: Request\n        verbs: [create, update]\n")
    auditor = Audit(write=out)
    obj = {"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": "cfg", "managedFields": [{"manager": "kubectl"}]},
           "data": {"k": "v"}}
    ctx = make_ctx("POST", "/api/v1/namespaces/a/configmaps", pset=pset,
                   headers={"Content-Type": "application/json"},
                   body=json.dumps(obj).encode())
    assert auditor.wants_body(ctx)
    ctx.identity = SA
    run_call(auditor, ctx, 201)
    (ev,) = out.events
    check_shape(ev)
    assert ev["level"] == "Request"
    assert ev["objectRef"]["name"] == "cfg"  # completed from the body, as the apiserver does
    assert ev["requestObject"] == {"apiVersion": "v1", "kind": "ConfigMap",
                                   "metadata": {"name": "cfg"}, "data": {"k": "v"}}
    assert ev["responseStatus"] == {"metadata": {}, "code": 201}
    assert ev["annotations"]["opgate.dev/audit-rule"] == "p.yaml:8"
    # a get under the same policy: no rule matches, the default with rules is None: no event
    get = make_ctx("GET", "/api/v1/namespaces/a/configmaps/cfg", pset=pset)
    assert not auditor.wants_body(get)
    run_call(auditor, get)
    assert len(out.lines) == 1


# metadata.uid (5) and resourceVersion (6) of a ConfigMap's ObjectMeta, as client-go's update
UPDATE_PB = b"k8s\x00" + bytes([0x12, 17, 0x0A, 15, 0x0A, 4]) + b"cm-1" + bytes(
    [0x2A, 3]) + b"u-1" + bytes([0x32, 2]) + b"42"


@pytest.mark.parametrize(("ctype", "body"), [
    ("application/json", json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
        "name": "cm-1", "uid": "u-1", "resourceVersion": "42"}}).encode()),
    ("application/vnd.kubernetes.protobuf", UPDATE_PB),
], ids=["json", "protobuf"])
@pytest.mark.parametrize("level", ["Metadata", "Request"])
def test_an_update_names_its_objects_uid_and_resource_version(ctype: str, body: bytes,
                                                               level: str) -> None:
    """client-go's Update and UpdateStatus send the object with its uid and resourceVersion:
    the apiserver completes objectRef with both from the body it decoded (its
    LogRequestObject, at Metadata too), so does opgate whenever it read the body."""
    out = Lines()
    pset = policies(f"    level: {level}\n")
    for path in ("/api/v1/namespaces/a/configmaps/cm-1",
                 "/apis/apps/v1/namespaces/a/deployments/cm-1/status"):
        ctx = make_ctx("PUT", path, pset=pset, headers={"Content-Type": ctype}, body=body)
        ctx.identity = SA
        run_call(Audit(write=out), ctx, 200)
    first, status = out.events
    for ev in (first, status):
        check_shape(ev)
    assert first["objectRef"] == {"resource": "configmaps", "namespace": "a", "name": "cm-1",
                                  "uid": "u-1", "apiVersion": "v1", "resourceVersion": "42"}
    assert status["objectRef"] == {"resource": "deployments", "namespace": "a", "name": "cm-1",
                                   "uid": "u-1", "apiGroup": "apps", "apiVersion": "v1",
                                   "resourceVersion": "42", "subresource": "status"}


def test_a_patch_or_delete_keeps_objectref_as_the_url_gives_it() -> None:
    """The apiserver completes objectRef from an object body only (a create's, an update's): a
    patch is logged as sent and DeleteOptions have no metadata."""
    out = Lines()
    pset = policies("    level: Request\n")
    body = json.dumps({"metadata": {"uid": "u-1", "resourceVersion": "42"}}).encode()
    for method, ctype in (("PATCH", "application/merge-patch+json"),
                          ("DELETE", "application/json")):
        ctx = make_ctx(method, "/api/v1/namespaces/a/configmaps/cm-1", pset=pset,
                       headers={"Content-Type": ctype}, body=body)
        run_call(Audit(write=out), ctx, 200)
    assert [ev["objectRef"] for ev in out.events] == [
        {"resource": "configmaps", "namespace": "a", "name": "cm-1", "apiVersion": "v1"}] * 2


@pytest.mark.parametrize(("method", "ctype", "kept"), [
    ("PATCH", "application/merge-patch+json", True),
    ("PATCH", "application/strategic-merge-patch+json", True),
    ("PUT", "application/json", False),
    ("POST", "application/json", False),
])
def test_omit_managed_fields_spares_a_patch(method: str, ctype: str, kept: bool) -> None:
    """The apiserver drops managedFields from the objects it logs, and logs a patch as sent:
    one that clears them (``managedFields: [{}]``) keeps them in requestObject."""
    out = Lines()
    pset = policies("    omitManagedFields: true\n    level: Request\n")
    body = {"metadata": {"name": "cm-1", "managedFields": [{}]}}
    path = "/api/v1/namespaces/a/configmaps" + ("" if method == "POST" else "/cm-1")
    ctx = make_ctx(method, path, pset=pset, headers={"Content-Type": ctype},
                   body=json.dumps(body).encode())
    run_call(Audit(write=out), ctx, 200)
    (ev,) = out.events
    assert ev["requestObject"] == (body if kept else {"metadata": {"name": "cm-1"}})


@pytest.mark.parametrize("wire", [False, True], ids=["aiohttp", "fast"])
def test_a_long_user_agent_is_cut_as_the_apiserver_cuts_it(wire: bool) -> None:
    """At most 1,024 characters, then ``...TRUNCATED`` (the apiserver's maxUserAgentLength),
    in the joined lines as in the encoded ones (a second identical call takes the first)."""
    out = Lines()
    auditor = Audit(write=out)
    agent = "ctl/1.0 " + "x" * 1500
    for value in (agent, agent, agent[:1024]):
        run_call(auditor, make_ctx("GET", "/api/v1/namespaces/a/configmaps/c",
                                   headers={"User-Agent": value}, wire=wire))
    assert [ev["userAgent"] for ev in out.events] == [
        agent[:1024] + "...TRUNCATED", agent[:1024] + "...TRUNCATED", agent[:1024]]


def test_non_json_bodies_are_left_out_with_a_note() -> None:
    out = Lines()
    pset = policies("    level: Request\n")
    ctx = make_ctx("POST", "/api/v1/namespaces/a/configmaps", pset=pset,
                   headers={"Content-Type": "application/vnd.kubernetes.protobuf"},
                   body=b"k8s\x00\n\x0fv1\x12\tConfigMap")
    run_call(Audit(write=out), ctx, 201)
    (ev,) = out.events
    check_shape(ev)
    assert "requestObject" not in ev
    assert ev["annotations"]["opgate.dev/request-object"] == \
        "omitted: not JSON (application/vnd.kubernetes.protobuf)"


def test_a_body_as_deep_as_the_apiserver_reads_is_recorded_whole() -> None:
    """A custom resource 2,000 levels deep (preserve-unknown-fields; beyond Python's json):
    its event has the object as sent and its name; managedFields are left out at any depth."""
    out = Lines()
    pset = policies("    omitManagedFields: true\n    level: Request\n")
    spec = deep(2000)
    body = (b'{"kind":"Blob","metadata":{"name":"b1","managedFields":[{"fieldsV1":' + spec
            + b'}]},"spec":' + spec + b"}")
    ctx = make_ctx("POST", "/apis/deep.example.com/v1/namespaces/a/blobs", pset=pset,
                   headers={"Content-Type": "application/json"}, body=body)
    run_call(Audit(write=out), ctx, 201)
    (line,) = out.lines
    assert '"objectRef":{"resource":"blobs","namespace":"a","name":"b1"' in line
    expected = b'{"kind":"Blob","metadata":{"name":"b1"},"spec":' + spec + b"}"
    assert '"requestObject":' + expected.decode() + "," in line
    assert '"responseStatus":{"metadata":{},"code":201}' in line
    assert "opgate.dev/request-object" not in line


def test_a_body_deeper_than_the_apiserver_reads_is_left_out_with_a_note() -> None:
    """10,001 levels: the apiserver answers 400 (``exceeded max depth``); the event says why
    the body is missing."""
    out = Lines()
    pset = policies("    level: Request\n")
    ctx = make_ctx("POST", "/apis/deep.example.com/v1/namespaces/a/blobs", pset=pset,
                   headers={"Content-Type": "application/json"},
                   body=b'{"metadata":{"name":"b2"},"spec":' + deep(10000) + b"}")
    run_call(Audit(write=out), ctx, 400)
    (ev,) = out.events
    check_shape(ev)
    assert "requestObject" not in ev and "name" not in ev["objectRef"]
    assert ev["annotations"]["opgate.dev/request-object"] == \
        "omitted: nested deeper than 10000 levels (the apiserver's limit)"


def test_request_response_level_logs_the_request_only() -> None:
    out = Lines()
    pset = policies("    level: RequestResponse\n")
    ctx = make_ctx("PATCH", "/apis/apps/v1/namespaces/a/deployments/web/scale", pset=pset,
                   headers={"Content-Type": "application/merge-patch+json"},
                   body=b'{"spec":{"replicas":3}}')
    run_call(Audit(write=out), ctx)
    (ev,) = out.events
    check_shape(ev)
    assert ev["level"] == "RequestResponse"
    assert ev["requestObject"] == {"spec": {"replicas": 3}}
    assert "responseObject" not in ev


def test_no_token_ever_reaches_the_log() -> None:
    out = Lines()
    pset = policies("    level: Request\n")
    auditor = Audit(write=out)
    review = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                         "spec": {"token": TOKEN, "audiences": ["api"]}}).encode()
    calls = [
        make_ctx("POST", "/apis/authentication.k8s.io/v1/tokenreviews", pset=pset, body=review,
                 headers={"Content-Type": "application/json"}),
        make_ctx("GET", "/api/v1/namespaces/a/pods/p/exec",
                 f"command=sh&access_token={TOKEN}&stdin=true", pset=pset,
                 headers={"Sec-WebSocket-Protocol":
                          f"base64url.bearer.authorization.k8s.io.{TOKEN}"}),
        make_ctx("GET", "/api/v1/namespaces/a/configmaps", f"id_token={TOKEN}", pset=pset),
    ]
    for ctx in calls:
        ctx.identity = SA
        run_call(auditor, ctx, 201)
    text = "".join(out.lines)
    assert TOKEN not in text
    assert "Bearer" not in text and "uthorization" not in text
    review_ev, exec_ev, list_ev = [e for e in out.events if e["stage"] == "ResponseComplete"]
    assert review_ev["requestObject"]["spec"] == {"token": "REDACTED", "audiences": ["api"]}
    assert exec_ev["requestURI"] == (
        "/api/v1/namespaces/a/pods/p/exec?command=sh&access_token=REDACTED&stdin=true")
    assert list_ev["requestURI"] == "/api/v1/namespaces/a/configmaps?id_token=REDACTED"


def test_request_uri_keeps_the_query_and_escapes_the_path() -> None:
    assert request_uri("/api/v1/namespaces/a/pods", "limit=500&continue=abc%3D") == \
        "/api/v1/namespaces/a/pods?limit=500&continue=abc%3D"
    assert request_uri("/api/v1/namespaces/a/configmaps/a b", "") == \
        "/api/v1/namespaces/a/configmaps/a%20b"


def test_micro_time_is_rfc3339_with_microseconds() -> None:
    assert micro_time(0.0) == "1970-01-01T00:00:00.000000Z"
    assert micro_time(1_764_480_600.1234567) == "2025-11-30T05:30:00.123456Z"


def test_level_none_and_omitted_stages_write_nothing() -> None:
    out = Lines()
    auditor = Audit(write=out)
    none = policies("    level: None\n")
    run_call(auditor, make_ctx("GET", "/api/v1/namespaces/a/pods/p", pset=none))
    omit = policies("    omitStages: [ResponseComplete]\n")
    run_call(auditor, make_ctx("GET", "/api/v1/namespaces/a/pods/p", pset=omit))
    assert out.lines == []


def test_events_are_counted_by_level() -> None:
    def count(level: str) -> float:
        telemetry.flush()
        return telemetry.REGISTRY.get_sample_value("opgate_audit_events_total",
                                                   {"level": level}) or 0.0
    before = count("Metadata")
    run_call(Audit(write=Lines()), make_ctx("GET", "/api/v1/namespaces/a/pods/p"))
    assert count("Metadata") == before + 1


# --- long-running calls: ResponseStarted, then ResponseComplete ----------------------------

def test_watch_gets_response_started_when_its_head_goes_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(audit_mod, "POLL_SECONDS", 0.01)
    out = Lines()
    auditor = Audit(write=out)
    ctx = make_ctx("GET", "/api/v1/namespaces/a/configmaps", "watch=true&resourceVersion=10")
    ctx.identity = SA

    async def call() -> None:
        await settle(auditor.entry(ctx))
        await asyncio.sleep(0.05)
        assert out.lines == []  # no head yet
        ctx.status_code = 200  # the relay, when the upstream's head went out
        await asyncio.sleep(0.05)
        assert [e["stage"] for e in out.events] == ["ResponseStarted"]
        await asyncio.sleep(0.05)
        ctx.finished = time.monotonic()
        await settle(auditor.exit(ctx))
        auditor.close()
    asyncio.run(call())
    started, complete = out.events
    for ev in (started, complete):
        check_shape(ev)
        assert ev["auditID"] == "5a1f-f1c" and ev["verb"] == "watch"
    assert (started["stage"], complete["stage"]) == ("ResponseStarted", "ResponseComplete")
    assert started["responseStatus"] == {"metadata": {}, "code": 200}
    assert started["stageTimestamp"] <= complete["stageTimestamp"]
    assert started["requestReceivedTimestamp"] == complete["requestReceivedTimestamp"]


def test_short_watch_still_gets_both_stages_and_omit_stages_applies() -> None:
    out = Lines()
    auditor = Audit(write=out)
    run_call(auditor, make_ctx("GET", "/api/v1/namespaces/a/pods/p/log", "follow=true"))
    assert [e["stage"] for e in out.events] == ["ResponseStarted", "ResponseComplete"]
    out.lines.clear()
    pset = policies("    omitStages: [ResponseStarted]\n")
    run_call(auditor, make_ctx("GET", "/api/v1/pods", "watch=1", pset=pset))
    assert [e["stage"] for e in out.events] == ["ResponseComplete"]
    out.lines.clear()
    gone = make_ctx("GET", "/api/v1/pods", "watch=1")
    run_call(auditor, gone, 499)  # the client left before any head: no ResponseStarted
    assert [e["stage"] for e in out.events] == ["ResponseComplete"]


@pytest.mark.parametrize(("path", "query"), [
    ("/api/v1/namespaces/a/configmaps", "watch=true"),
    ("/api/v1/namespaces/a/pods/p/exec", "command=ls"),
])
def test_a_long_running_call_opgate_answers_gets_both_stages_as_the_apiservers_own(
        path: str, query: str) -> None:
    """A watch (an exec …) that a fault, a rule or a rate limit answers before this middleware's
    entry hook ran: the apiserver logs its own denial of a long-running call at ResponseStarted
    and ResponseComplete, both with the Status (tests/e2e/test_audit_apiserver.py); so does
    opgate. omitStages still applies; a 401 stays one ResponseComplete (README)."""
    status = internal_error("opgate: injected fault f (policy p)")

    def answered(pset: PolicySet = EMPTY, decision: str = "fault",
                 answer: StatusError = status) -> list[dict[str, Any]]:
        out = Lines()
        ctx = make_ctx("GET", path, query, pset=pset)
        ctx.answer, ctx.decision = answer, decision
        finish(ctx, answer.code)
        asyncio.run(settle(Audit(write=out).exit(ctx)))  # (entry never ran)
        return out.events

    started, complete = answered()
    for ev in (started, complete):
        check_shape(ev)
    assert (started["stage"], complete["stage"]) == ("ResponseStarted", "ResponseComplete")
    assert started["responseStatus"] == complete["responseStatus"] == {
        "metadata": {}, "status": "Failure", "message": status.message,
        "reason": "InternalError", "code": 500}
    assert started["stageTimestamp"] == complete["stageTimestamp"]
    assert started["annotations"] == complete["annotations"]
    omit = policies("    omitStages: [ResponseStarted]\n")
    assert [e["stage"] for e in answered(omit)] == ["ResponseComplete"]
    assert answered(policies("    level: None\n")) == []
    assert [e["stage"] for e in answered(
        decision="unauthorized", answer=unauthorized("opgate: Unauthorized"))] == [
        "ResponseComplete"]


def test_a_long_running_call_the_relay_answers_after_entry_gets_response_started_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A watch the relay answers itself once the chain let it through (the upstream
    unreachable: 503; its head timed out: 504) has its answer's code on the context before
    the exit hook runs: a poll in between must not log ResponseStarted a second time."""
    monkeypatch.setattr(audit_mod, "POLL_SECONDS", 0.01)
    out = Lines()
    auditor = Audit(write=out)
    ctx = make_ctx("GET", "/api/v1/namespaces/a/configmaps", "watch=true")
    ctx.identity = SA

    async def call() -> None:
        await settle(auditor.entry(ctx))
        status = service_unavailable("opgate: the upstream is unreachable")
        ctx.answer, ctx.decision = status, "error"  # as the relays' _answer sets them
        ctx.status_code = status.code
        await asyncio.sleep(0.05)  # polls while the answer is written
        ctx.finished = time.monotonic()
        await settle(auditor.exit(ctx))
        auditor.close()
    asyncio.run(call())
    assert [e["stage"] for e in out.events] == ["ResponseStarted", "ResponseComplete"]
    assert all(e["responseStatus"]["code"] == 503 for e in out.events)


# --- the file: rotation, and a writer that never blocks the loop ---------------------------

def test_rotation_by_size_keeps_max_backups(tmp_path: Path) -> None:
    clock = iter(1_764_480_600.0 + i for i in range(100))
    path = tmp_path / "audit.log"
    f = RotatingFile(str(path), max_bytes=100, max_backups=2, now=lambda: next(clock))
    line = "x" * 39 + "\n"  # 40 bytes: two per file
    for _ in range(9):
        f.write(line)
    f.flush()
    assert path.read_text() == line  # 9 = 2+2+2+2+1
    backups = f.backups()
    assert [os.path.basename(b) for b in backups] == [
        "audit-2025-11-30T05-30-02.000.log", "audit-2025-11-30T05-30-03.000.log"]
    assert all(Path(b).read_text() == line * 2 for b in backups)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    f.close()
    # reopening appends and knows the size
    g = RotatingFile(str(path), max_bytes=100, max_backups=0)
    assert g.size == 40
    g.close()


def test_zero_max_size_never_rotates(tmp_path: Path) -> None:
    f = RotatingFile(str(tmp_path / "a.log"), max_bytes=0)
    for _ in range(100):
        f.write("y" * 99 + "\n")
    f.close()
    assert f.backups() == []
    assert (tmp_path / "a.log").stat().st_size == 10_000


class _Stuck:
    """A target whose writes block until released (a full disk, a hung NFS mount)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.data: list[str] = []

    def write(self, data: str) -> None:
        self.release.wait(5)
        self.data.append(data)

    def flush(self) -> None:
        pass


def test_a_stuck_writer_drops_and_counts_instead_of_blocking() -> None:
    def dropped() -> float:
        return telemetry.REGISTRY.get_sample_value("opgate_audit_dropped_total") or 0.0

    target = _Stuck()
    stream = QueuedStream(target, max_pending=1000)  # type: ignore[arg-type]
    before = dropped()
    line = "z" * 99 + "\n"
    started = time.monotonic()
    for _ in range(30):
        stream.write(line)  # never waits for the stuck target
    assert time.monotonic() - started < 0.5
    assert dropped() >= before + 19
    target.release.set()
    stream.close()
    written = "".join(target.data).count("\n")
    assert written + (dropped() - before) == 30
    assert 1 <= written <= 11


def test_the_whole_path_to_a_file(tmp_path: Path) -> None:
    """Audit → AccessWriter (batched) → QueuedStream (thread) → RotatingFile."""
    path = tmp_path / "audit.log"
    stream = QueuedStream(RotatingFile(str(path), max_bytes=1024 * 1024, max_backups=1))
    writer = AccessWriter(stream)
    auditor = Audit(write=writer.write)

    async def calls() -> None:
        for i in range(20):
            ctx = make_ctx("DELETE", f"/api/v1/namespaces/a/configmaps/c{i}")
            ctx.identity = SA
            finish(ctx, 200)
            await settle(auditor.exit(ctx))
        await asyncio.sleep(0.1)  # the batch goes out within AccessWriter's 50 ms
    asyncio.run(calls())
    writer.close()
    stream.close()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["objectRef"]["name"] for e in events] == [f"c{i}" for i in range(20)]
    for ev in events:
        check_shape(ev)
    assert TOKEN not in path.read_text()


# a claim JSON can carry and Python decodes to a lone surrogate (not encodable as UTF-8)
ODD = Identity(user="oidc:caf\ud800e", uid="u-1", groups=("system:authenticated",),
               source="oidc", extra=(("scopes", ("read\udfff",)),))


def audited_lines(write: Any, count: int) -> None:
    """``count`` DELETEs audited through an AccessWriter batching into ``write``'s stream,
    every other one by the ODD caller."""
    async def calls() -> None:
        for i in range(count):
            ctx = make_ctx("DELETE", f"/api/v1/namespaces/a/configmaps/c{i}")
            ctx.identity = ODD if i % 2 else SA
            finish(ctx, 200)
            await settle(auditor.exit(ctx))
    auditor = Audit(write=write)
    asyncio.run(calls())


def test_a_lone_surrogate_in_a_claim_loses_no_event_in_a_file(tmp_path: Path) -> None:
    """It leaves as the JSON escape it came as; the batch it is in is not dropped."""
    path = tmp_path / "audit.log"
    stream = QueuedStream(RotatingFile(str(path), max_bytes=1024 * 1024, max_backups=1))
    writer = AccessWriter(stream)
    dropped = telemetry.AUDIT_DROPPED._value.get()
    audited_lines(writer.write, 6)
    writer.close()
    stream.close()
    events = [json.loads(line) for line in path.read_bytes().decode("utf-8").splitlines()]
    assert [e["objectRef"]["name"] for e in events] == [f"c{i}" for i in range(6)]
    assert events[1]["user"]["username"] == ODD.user
    assert events[1]["user"]["extra"] == {"scopes": ["read\udfff"]}
    assert telemetry.AUDIT_DROPPED._value.get() == dropped


def test_a_lone_surrogate_in_a_claim_loses_no_line_on_stdout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The access log's (and ``--audit-log -``'s) stdout, as opgate sets it up."""
    import io
    import logging

    from proxy.app import configure_logging
    from proxy.settings import LogSettings, Settings

    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="utf-8", write_through=True)
    monkeypatch.setattr("sys.stdout", out)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging(Settings(log=LogSettings()))
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    writer = AccessWriter(out)
    audited_lines(writer.write, 4)
    writer.close()
    events = [json.loads(line) for line in raw.getvalue().decode("utf-8").splitlines()]
    assert [e["user"]["username"] for e in events] == [SA.user, ODD.user] * 2


def test_the_relays_own_errors_carry_their_message() -> None:
    out = Lines()
    ctx = make_ctx("GET", "/api/v1/namespaces/a/pods/p")
    ctx.error = "upstream unreachable: connection refused"
    ctx.answer = service_unavailable("opgate: the apiserver is unreachable: connection refused")
    asyncio.run(_exit(Audit(write=out), ctx, 503))
    (ev,) = out.events
    check_shape(ev)
    assert ev["responseStatus"]["code"] == 503
    assert ev["responseStatus"]["reason"] == "ServiceUnavailable"
    assert ev["responseStatus"]["message"] == ctx.answer.message
    assert ev["annotations"]["opgate.dev/error"] == ctx.error
    # a client that left mid-response: no answer of opgate's, the relay's note
    out.lines.clear()
    gone = make_ctx("GET", "/api/v1/namespaces/a/pods/p")
    gone.error = "client went away"
    asyncio.run(_exit(Audit(write=out), gone, 499))
    assert out.events[0]["responseStatus"] == {"metadata": {}, "status": "Failure",
                                               "message": "client went away", "code": 499}
    # an apiserver error relayed as it came: only its code (opgate does not read the body)
    out.lines.clear()
    relayed = make_ctx("GET", "/api/v1/namespaces/a/pods/gone")
    asyncio.run(_exit(Audit(write=out), relayed, 404))
    assert out.events[0]["responseStatus"] == {"metadata": {}, "code": 404}


def test_a_caller_opgate_refuses_with_401_is_no_user_to_the_rules_nor_the_event(
        tmp_path: Path) -> None:
    """A token opgate verified but its policy refuses (an audience or an issuer it does not
    accept) gets opgate's 401: as the apiserver evaluates its policy for a failed
    authentication, the call has no user: rules about users do not match it, the event names
    none."""
    from tests.unit.test_identity import CM, FakeAuth, IdentityCheck, audience_policy, run, sa_token
    (tmp_path / "identity.yaml").write_text(audience_policy("{audiences: [opgate]}"))
    (tmp_path / "audit.yaml").write_text(
        "apiVersion: opgate.dev/v1alpha1\nkind: Policy\nmetadata: {name: a}\nspec:\n"
        "  audit:\n    level: Metadata\n    rules:\n"
        "      - {level: None, userGroups: [system:authenticated]}\n")
    pset = load_policy_set(sorted(tmp_path.glob("*.yaml")), parsers=section_parsers())
    ctx = make_ctx("GET", CM, pset=pset, headers={"Authorization": f"Bearer {sa_token()}"})
    denied = run(IdentityCheck(authenticator=FakeAuth()), ctx)
    assert denied is not None and denied.status.code == 401
    ctx.answer, ctx.decision = denied.status, denied.decision  # as the relay answers it
    finish(ctx, 401)
    out = Lines()
    asyncio.run(settle(Audit(write=out).exit(ctx)))
    (ev,) = out.events
    assert (ev["level"], ev["user"], ev["responseStatus"]["code"]) == ("Metadata", {}, 401)
