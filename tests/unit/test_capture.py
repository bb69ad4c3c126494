"""Traffic capture: spec.capture (file:line errors, first match, sample, the default), the tap's
bounds, the flows mitmproxy reads back (request, response, opgate's own answers, truncation),
no token ever, Secret bodies left out, a writer that drops whole flows instead of blocking,
0600 and rotation."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
from mitmproxy import io as mio
from multidict import CIMultiDict

from proxy import capture as capture_file
from proxy.app import section_parsers
from proxy.capture import FlowFile, to_flow
from proxy.engine import telemetry
from proxy.engine.chain import settle
from proxy.engine.check import check
from proxy.engine.context import Identity, RequestContext
from proxy.engine.logfile import RotatingFile
from proxy.engine.policies import EMPTY, PolicySet, build_policy_set
from proxy.engine.redact import redact_header, redact_object, redact_query
from proxy.engine.requestinfo import parse_request_info
from proxy.engine.schema import PolicyError
from proxy.engine.status import forbidden
from proxy.engine.yamlload import parse_yaml_documents
from proxy.middlewares.capture import CallTap, Capture, CapturedCall
from proxy.middlewares.capture_spec import DEFAULT_MAX_BODY, parse_section
from tests.unit.test_protometa import deep

TOKEN = "eyJhbGciOiJSUzI1NiJ9.c2VjcmV0LXRva2Vu.c2lnbmF0dXJl"
UPSTREAM = "https://10.0.0.1:6443"


IDENTITY = ("  identity:\n    allow: [{group: system:authenticated}]\n"
            "    rules: [{verbs: ['*'], resources: ['*']}]\n")  # users need one in the set


def policies(capture: str, *, identity: bool = False) -> PolicySet:
    text = ("apiVersion: opgate.dev/v1alpha1\nkind: Policy\nmetadata: {name: p}\nspec:\n"
            + (IDENTITY if identity else "") + "  capture:\n" + capture)
    return build_policy_set([("p.yaml", text.encode())], parsers=section_parsers())


def make_ctx(method: str, path: str, query: str = "", *, pset: PolicySet = EMPTY,
             headers: dict[str, str] | None = None, body: bytes | None = None,
             user: str = "") -> RequestContext:
    ctx = RequestContext(info=parse_request_info(method, path, query), method=method, path=path,
                         query=query, headers=CIMultiDict(headers or {}), policies=pset,
                         trace_id="t-1", body=body)
    if user:
        ctx.identity = Identity(user=user)
    return ctx


def flows_of(path: Path) -> list[Any]:
    with open(path, "rb") as f:
        return list(mio.FlowReader(f).stream())


def counted(result: str) -> float:
    return telemetry.REGISTRY.get_sample_value("opgate_capture_flows_total",
                                               {"result": result}) or 0.0


# --- spec.capture -----------------------------------------------------------------------------

def parse(text: str) -> tuple[Any, list[str]]:
    errors: list[PolicyError] = []
    docs = parse_yaml_documents(text, file="c.yaml", errors=errors)
    rules = parse_section(docs[0], errors)
    return rules, [str(e) for e in errors]


def test_rules_parse_with_their_defaults() -> None:
    rules, errors = parse(
        "- name: writes\n"
        "  match: {verbs: [create, update], resources: [configmaps], namespaces: ['team-*']}\n"
        "  sample: 0.5\n"
        "  maxBodyBytes: 1024\n"
        "- match: {resources: [secrets]}\n"
        "  secretBodies: true\n")
    assert errors == []
    first, second = rules
    assert (first.name, first.sample, first.max_body_bytes, first.secret_bodies,
            first.source) == ("writes", 0.5, 1024, False, "c.yaml:1")
    assert (second.name, second.sample, second.max_body_bytes, second.secret_bodies) == (
        "capture-1", 1.0, DEFAULT_MAX_BODY, True)


def test_bad_rules_are_errors_with_file_and_line() -> None:
    _, errors = parse(
        "- match: {verbs: [get], colour: [red]}\n"
        "- sample: 2\n"
        "- maxBodyBytes: -1\n"
        "- secretBodies: yes please\n"
        "- bodies: true\n"
        "- {name: a}\n"
        "- {name: a}\n")
    assert 'c.yaml:1: unknown field "colour" in spec.capture[0].match' in errors
    assert "c.yaml:2: spec.capture[1].sample: must be at most 1.0 (got 2.0)" in errors
    assert "c.yaml:3: spec.capture[2].maxBodyBytes: must be at least 0 (got -1)" in errors
    assert ("c.yaml:4: spec.capture[3].secretBodies: expected true or false, got a string"
            in errors)
    assert 'c.yaml:5: unknown field "bodies" in spec.capture[4]' in errors
    # at the duplicate, not at the list
    assert 'c.yaml:7: spec.capture[6]: two rules are named "a" (also at c.yaml:6)' in errors


def test_opgate_check_validates_the_section(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text("apiVersion: opgate.dev/v1alpha1\nkind: Policy\nmetadata: {name: p}\n"
                      "spec:\n  capture:\n    - match: {verbs: [get]}\n      sample: -0.5\n")
    assert check([str(policy)], parsers=section_parsers()) == [
        f"{policy}:7: spec.capture[0].sample: must be at least 0.0 (got -0.5)"]
    policy.write_text("apiVersion: opgate.dev/v1alpha1\nkind: Policy\nmetadata: {name: p}\n"
                      "spec:\n  capture:\n    - match: {verbs: [get]}\n")
    assert check([str(policy)], parsers=section_parsers()) == []


EXAMPLE = Path(__file__).resolve().parents[2] / "policies" / "examples" / "capture.yaml"


async def test_the_example_policy_is_valid_and_does_what_it_says() -> None:
    example, identity = EXAMPLE, EXAMPLE.with_name("identity.yaml")  # its users need one
    assert check([str(example), str(identity)], parsers=section_parsers()) == []
    pset = build_policy_set([(str(f), f.read_bytes()) for f in (example, identity)],
                            parsers=section_parsers())
    cap = Capture(write=lambda call: None, rng=lambda: 0.5)
    cases = [("PUT", "/apis/coordination.k8s.io/v1/namespaces/a/leases/op", None),
             ("PATCH", "/apis/apps/v1/namespaces/a/deployments/d", 262144),
             ("GET", "/api/v1/namespaces/a/configmaps", None),  # a list, not drawn
             ("GET", "/apis/demo.opgate.dev/v1/namespaces/a/widgets/w", DEFAULT_MAX_BODY),
             ("GET", "/api/v1/namespaces/a/configmaps/c", None)]
    for method, path, limit in cases:
        ctx = make_ctx(method, path, pset=pset)
        await settle(cap.entry(ctx))
        assert (ctx.tap.limit if isinstance(ctx.tap, CallTap) else None) == limit, path


async def test_without_a_section_every_call_is_tapped() -> None:
    cap = Capture(write=lambda call: None)
    for method, path in (("GET", "/api/v1/pods"), ("POST", "/apis/apps/v1/namespaces/a/x"),
                         ("GET", "/healthz")):
        ctx = make_ctx(method, path)
        await settle(cap.entry(ctx))
        assert isinstance(ctx.tap, CallTap)
        assert ctx.tap.limit == DEFAULT_MAX_BODY


async def test_first_matching_rule_decides_and_unmatched_calls_are_not_tapped() -> None:
    pset = policies("    - {name: skip-leases, match: {resources: [leases]}, sample: 0}\n"
                    "    - {match: {verbs: [create]}, maxBodyBytes: 10}\n"
                    "    - {match: {users: ['system:serviceaccount:ops:*']}}\n", identity=True)
    cap = Capture(write=lambda call: None)
    cases = [("POST", "/apis/coordination.k8s.io/v1/namespaces/a/leases", "", None),
             ("POST", "/api/v1/namespaces/a/configmaps", "", 10),
             ("GET", "/api/v1/namespaces/a/configmaps", "", None),
             ("GET", "/api/v1/namespaces/a/configmaps", "system:serviceaccount:ops:op",
              DEFAULT_MAX_BODY)]
    for method, path, user, limit in cases:
        ctx = make_ctx(method, path, pset=pset, user=user)
        await settle(cap.entry(ctx))
        got = ctx.tap.limit if isinstance(ctx.tap, CallTap) else None
        assert got == limit, (method, path, user)


async def test_sample_draws_per_call() -> None:
    draws = iter([0.05, 0.5, 0.09])
    cap = Capture(write=lambda call: None, rng=lambda: next(draws))
    pset = policies("    - {match: {verbs: [get]}, sample: 0.1}\n")
    tapped = []
    for _ in range(3):
        ctx = make_ctx("GET", "/api/v1/namespaces/a/pods/p", pset=pset)
        await settle(cap.entry(ctx))
        tapped.append(ctx.tap is not None)
    assert tapped == [True, False, True]


async def test_a_reloaded_policy_set_decides_from_then_on() -> None:
    cap = Capture(write=lambda call: None)
    before = policies("    - {match: {verbs: [get]}}\n")
    after = policies("    - {match: {verbs: [get]}, sample: 0}\n")
    decided = []
    for pset in (before, after, before):
        ctx = make_ctx("GET", "/api/v1/namespaces/a/pods/p", pset=pset)
        await settle(cap.entry(ctx))
        decided.append(ctx.tap is not None)
    assert decided == [True, False, True]


async def test_a_call_not_drawn_at_entry_is_not_drawn_again_when_opgate_answers() -> None:
    draws = iter([0.9, 0.0])
    written: list[CapturedCall] = []
    cap = Capture(write=written.append, rng=lambda: next(draws))
    ctx = make_ctx("GET", "/api/v1/namespaces/a/pods/p",
                   pset=policies("    - {match: {verbs: [get]}, sample: 0.5}\n"))
    await settle(cap.entry(ctx))  # 0.9: not this one
    ctx.answer = forbidden("opgate: upstream unreachable")
    await settle(cap.exit(ctx))
    assert written == []


# --- the tap ----------------------------------------------------------------------------------

def test_the_tap_keeps_at_most_its_bound_and_counts_the_rest() -> None:
    rule = parse("- {maxBodyBytes: 10}\n")[0][0]
    tap = CallTap(rule)
    for chunk in (b"abcd", b"efghij", b"klmnop"):
        tap.request_body(chunk)
        tap.response_body(chunk)
    assert b"".join(tap.request_chunks) == b"abcdefghij"
    assert b"".join(tap.response_chunks) == b"abcdefghij"
    assert (tap.request_kept, tap.request_seen, tap.response_seen) == (10, 16, 16)
    tap.response_body(b"x" * 1_000_000)  # nothing more is kept
    assert tap.response_kept == 10 and tap.response_seen == 1_000_016


# --- flows ------------------------------------------------------------------------------------

def tapped_call(ctx: RequestContext, *, request: list[bytes] = (), status: int = 200,  # type: ignore[assignment]
                headers: list[tuple[bytes, bytes]] | None = None,
                response: list[bytes] = (), limit: str = "") -> CapturedCall:  # type: ignore[assignment]
    cap = Capture(write=lambda call: None)
    rule = parse(limit or "- {}\n")[0][0]
    tap = cap._tap(ctx, rule)
    for chunk in request:
        tap.request_body(chunk)
    tap.response_head(status, b"OK", headers or [(b"Content-Type", b"application/json")])
    for chunk in response:
        tap.response_body(chunk)
    ctx.status_code = status
    ctx.finished = ctx.started + 0.25
    return Capture.record(ctx, tap)


def write_and_read(tmp_path: Path, *calls: CapturedCall) -> list[Any]:
    path = tmp_path / "c.flows"
    out = FlowFile(str(path), upstream=UPSTREAM)
    for call in calls:
        out.write(call)
    out.close()
    return flows_of(path)


def test_a_relayed_call_becomes_an_http_flow(tmp_path: Path) -> None:
    ctx = make_ctx("POST", "/api/v1/namespaces/a/configmaps", "fieldManager=kubectl",
                   headers={"Content-Type": "application/json", "User-Agent": "kubectl/v1.33"})
    body = b'{"kind":"ConfigMap","metadata":{"name":"c"}}'
    call = tapped_call(ctx, request=[body[:10], body[10:]], status=201,
                       response=[b'{"kind":"ConfigMap"}'])
    (flow,) = write_and_read(tmp_path, call)
    req, resp = flow.request, flow.response
    assert (req.method, req.scheme, req.host, req.port) == ("POST", "https", "10.0.0.1", 6443)
    assert req.path == "/api/v1/namespaces/a/configmaps?fieldManager=kubectl"
    assert req.headers["User-Agent"] == "kubectl/v1.33"
    assert req.content == body
    assert (resp.status_code, resp.content) == (201, b'{"kind":"ConfigMap"}')
    assert resp.headers["Content-Type"] == "application/json"
    assert req.timestamp_start <= resp.timestamp_start <= resp.timestamp_end
    meta = flow.metadata["opgate"]
    assert (meta["trace_id"], meta["verb"], meta["decision"]) == ("t-1", "create", "allowed")
    assert meta["request_bytes"] == len(body) and "request_truncated" not in meta
    assert not flow.comment


def test_bodies_beyond_the_bound_are_truncated_and_marked(tmp_path: Path) -> None:
    ctx = make_ctx("GET", "/api/v1/namespaces/a/configmaps", "watch=true")
    events = [b'{"type":"ADDED","object":{}}\n'] * 5
    call = tapped_call(ctx, response=events, limit="- {maxBodyBytes: 40}\n")
    (flow,) = write_and_read(tmp_path, call)
    assert flow.response.content == b"".join(events)[:40]
    meta = flow.metadata["opgate"]
    assert meta["response_truncated"] is True
    assert meta["response_bytes"] == sum(map(len, events))
    assert "response body truncated: 40 of 145 bytes captured" in flow.comment


def test_a_cut_gzip_response_is_decoded_as_far_as_it_goes(tmp_path: Path) -> None:
    """client-go asks for gzip and the apiserver compresses a big LIST: a cut gzip stream is
    one mitmproxy cannot decode, so the flow holds the decoded start, not compressed bytes."""
    items = [{"metadata": {"name": f"c{i}"}, "data": {"k": os.urandom(40).hex()}}
             for i in range(3000)]
    plain = json.dumps({"kind": "ConfigMapList", "items": items}).encode()
    packed = gzip.compress(plain)
    assert len(packed) > 4096
    headers = [(b"Content-Type", b"application/json"), (b"Content-Encoding", b"gzip")]
    whole, cut = (
        tapped_call(make_ctx("GET", "/api/v1/configmaps"), headers=headers,
                    response=[packed[:1000], packed[1000:]], limit=limit)
        for limit in ("- {maxBodyBytes: 1048576}\n", "- {maxBodyBytes: 4096}\n"))
    kept_whole, kept_cut = write_and_read(tmp_path, whole, cut)
    # a whole one stays as sent: mitmproxy decodes it itself
    assert kept_whole.response.headers["Content-Encoding"] == "gzip"
    assert kept_whole.response.raw_content == packed and kept_whole.response.content == plain
    resp, meta = kept_cut.response, kept_cut.metadata["opgate"]
    assert "Content-Encoding" not in resp.headers
    assert len(resp.content) > 4096 and plain.startswith(resp.content)
    assert meta["response_truncated"] is True and meta["response_bytes"] == len(packed)
    assert "gzip" in meta["response_decoded"]
    assert f"response body truncated: 4096 of {len(packed)} bytes" in kept_cut.comment
    # cut inside the gzip header: nothing decodes, the bytes stay as they came
    (tmp_path / "tiny").mkdir()
    (tiny,) = write_and_read(tmp_path / "tiny", tapped_call(
        make_ctx("GET", "/api/v1/configmaps"), headers=headers, response=[packed],
        limit="- {maxBodyBytes: 8}\n"))
    assert tiny.response.headers["Content-Encoding"] == "gzip"
    assert tiny.response.raw_content == packed[:8]
    assert "response_decoded" not in tiny.metadata["opgate"]


def test_a_cut_gzip_response_decodes_to_at_most_max_decoded_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """64 times what was kept is 4 GiB for a rule's largest bound (64 MiB): the writer thread
    would hold gigabytes for one flow (an apiserver's gzip of a LIST decodes ~10:1). The
    decoded start stops at ``MAX_DECODED`` (64 MiB; 256 KiB here)."""
    monkeypatch.setattr(capture_file, "MAX_DECODED", 256 * 1024)
    plain = json.dumps({"kind": "ConfigMapList", "items": [
        {"metadata": {"name": f"c{i}"}, "data": {"k": "v" * 50}} for i in range(50_000)]}).encode()
    packed = gzip.compress(plain, compresslevel=1)  # the apiserver's level
    headers = [(b"Content-Type", b"application/json"), (b"Content-Encoding", b"gzip")]
    (flow,) = write_and_read(tmp_path, tapped_call(
        make_ctx("GET", "/api/v1/configmaps"), headers=headers, response=[packed],
        limit="- {maxBodyBytes: 65536}\n"))  # 64 KiB kept: 4 MiB at 64:1
    assert len(packed) > 65536 and len(plain) > 4 * 1024 * 1024
    assert flow.response.content == plain[:256 * 1024]
    assert "Content-Encoding" not in flow.response.headers


def test_opgate_own_answer_is_the_response_with_the_decision(tmp_path: Path) -> None:
    ctx = make_ctx("DELETE", "/api/v1/namespaces/a/configmaps/c")
    ctx.answer = forbidden("opgate: rule no-deletes of policy p (p.yaml:3) denies this call")
    ctx.decision = "denied"
    ctx.status_code = 403
    ctx.warn("opgate: dryrun says hi")
    calls: list[CapturedCall] = []
    asyncio.run(settle(Capture(write=calls.append).exit(ctx)))  # denied before capture's entry ran
    (flow,) = write_and_read(tmp_path, *calls)
    assert flow.response.status_code == 403
    status = json.loads(flow.response.content)
    assert (status["kind"], status["reason"]) == ("Status", "Forbidden")
    assert flow.response.headers["Warning"].startswith("299")
    meta = flow.metadata["opgate"]
    assert (meta["decision"], meta["answered_by"]) == ("denied", "opgate")
    assert "rule no-deletes" in meta["reason"]
    assert flow.comment.startswith("opgate answered itself (denied): opgate: rule no-deletes")


def test_a_call_whose_client_left_has_an_error_and_no_response(tmp_path: Path) -> None:
    ctx = make_ctx("GET", "/api/v1/pods")
    tap = Capture(write=lambda c: None)._tap(ctx, parse("- {}\n")[0][0])
    ctx.status_code, ctx.error = 499, "client went away"
    (flow,) = write_and_read(tmp_path, Capture.record(ctx, tap))
    assert flow.response is None
    assert flow.error.msg == "client went away"


# --- never a token ----------------------------------------------------------------------------

def test_redaction_helpers() -> None:
    assert redact_header("Authorization", f"Bearer {TOKEN}") == "Bearer REDACTED"
    assert redact_header("authorization", "Basic dXNlcjpwYXNz") == "Basic REDACTED"
    assert redact_header("X-Auth-Token", TOKEN) == "REDACTED"
    assert redact_header("Cookie", "a=b") == "REDACTED"
    assert redact_header("Sec-WebSocket-Protocol",
                         f"v5.channel.k8s.io, base64url.bearer.authorization.k8s.io.{TOKEN}"
                         ) == ("v5.channel.k8s.io, "
                               "base64url.bearer.authorization.k8s.io.REDACTED")
    assert redact_header("User-Agent", "kubectl") == "kubectl"
    assert redact_query(f"watch=1&access_token={TOKEN}&x=y") == (
        "watch=1&access_token=REDACTED&x=y")
    # a name is judged as the apiserver decodes it
    assert redact_query(f"%74oken={TOKEN}&a%5Fpassword={TOKEN}&x%3Dy=1") == (
        "%74oken=REDACTED&a%5Fpassword=REDACTED&x%3Dy=1")
    assert redact_query("label%53elector=a") == "label%53elector=a"
    review = {"kind": "TokenReview", "spec": {"token": TOKEN, "audiences": ["a"]}}
    assert redact_object(review, "authentication.k8s.io", "tokenreviews")["spec"] == {
        "token": "REDACTED", "audiences": ["a"]}
    assert review["spec"]["token"] == TOKEN  # not changed in place
    minted = {"kind": "TokenRequest", "status": {"token": TOKEN, "expirationTimestamp": "x"}}
    assert redact_object(minted, "", "serviceaccounts", "token")["status"]["token"] == "REDACTED"


def test_no_token_reaches_the_file(tmp_path: Path) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    review = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                         "spec": {"token": TOKEN}}).encode()
    calls = [
        tapped_call(make_ctx("GET", "/api/v1/namespaces/a/pods/p/exec",
                             f"command=sh&access_token={TOKEN}", headers=auth), status=101),
        tapped_call(make_ctx("POST", "/apis/authentication.k8s.io/v1/tokenreviews",
                             headers=auth), request=[review], status=201, response=[review]),
        # cut short: cannot be parsed, so it is left out entirely
        tapped_call(make_ctx("POST", "/apis/authentication.k8s.io/v1/tokenreviews",
                             headers=auth), request=[review], limit="- {maxBodyBytes: 30}\n"),
        tapped_call(make_ctx("POST", "/api/v1/namespaces/a/serviceaccounts/sa/token",
                             headers=auth), status=201,
                    response=[json.dumps({"status": {"token": TOKEN}}).encode()]),
    ]
    flows = write_and_read(tmp_path, *calls)
    raw = (tmp_path / "c.flows").read_bytes()
    assert TOKEN.encode() not in raw
    assert TOKEN[:20].encode() not in raw
    assert flows[0].request.headers["Authorization"] == "Bearer REDACTED"
    assert "access_token=REDACTED" in flows[0].request.path
    assert json.loads(flows[1].request.content)["spec"]["token"] == "REDACTED"
    assert json.loads(flows[1].response.content)["spec"]["token"] == "REDACTED"
    assert flows[2].request.content == b""
    assert flows[2].metadata["opgate"]["request_body_omitted"]
    assert json.loads(flows[3].response.content)["status"]["token"] == "REDACTED"


def test_a_token_is_redacted_from_a_body_as_deep_as_the_apiserver_reads(tmp_path: Path) -> None:
    """A TokenReview with 2,000 levels in it (beyond Python's json; the apiserver reads up to
    10,000) is written with its token replaced, the rest as sent."""
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    nest = deep(2000)
    review = (b'{"kind":"TokenReview","spec":{"token":"' + TOKEN.encode() + b'","x":' + nest
              + b"}}")
    call = tapped_call(make_ctx("POST", "/apis/authentication.k8s.io/v1/tokenreviews",
                                headers=auth), request=[review], status=201, response=[review],
                       limit="- {maxBodyBytes: 1000000}\n")
    (flow,) = write_and_read(tmp_path, call)
    redacted = b'{"kind":"TokenReview","spec":{"token":"REDACTED","x":' + nest + b"}}"
    assert (flow.request.content, flow.response.content) == (redacted, redacted)
    assert TOKEN.encode() not in (tmp_path / "c.flows").read_bytes()


def test_secret_bodies_are_left_out_unless_a_rule_opts_in(tmp_path: Path) -> None:
    secret = b'{"kind":"Secret","data":{"password":"aHVudGVyMg=="}}'
    plain = tapped_call(make_ctx("GET", "/api/v1/namespaces/a/secrets/s"), response=[secret])
    opted = tapped_call(make_ctx("GET", "/api/v1/namespaces/a/secrets/s"), response=[secret],
                        limit="- {secretBodies: true}\n")
    left_out, kept = write_and_read(tmp_path, plain, opted)
    assert left_out.response.content == b""
    assert "Secret bodies are not captured" in left_out.metadata["opgate"]["bodies_omitted"]
    assert "bodies left out" in left_out.comment
    assert kept.response.content == secret


# --- the writer -------------------------------------------------------------------------------

def test_the_file_is_0600_and_rotates_between_flows(tmp_path: Path) -> None:
    path = tmp_path / "capture.flows"
    out = FlowFile(str(path), upstream=UPSTREAM, max_bytes=3000, max_backups=2)
    call = tapped_call(make_ctx("GET", "/api/v1/pods"), response=[b"x" * 1000])
    for _ in range(8):
        out.write(call)
    out.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    backups = sorted(p for p in tmp_path.iterdir() if p.name.startswith("capture-"))
    assert len(backups) == 2
    total = 0
    for file in (*backups, path):  # each file a complete flow file
        flows = flows_of(file)
        assert flows and all(f.response.content == b"x" * 1000 for f in flows)
        total += len(flows)
    assert total < 8  # the oldest backups were removed


@pytest.mark.parametrize("cut", [False, True], ids=["whole", "cut-short"])
def test_a_file_an_earlier_run_left_is_appended_to_only_when_it_ends_with_a_whole_flow(
        tmp_path: Path, cut: bool, caplog: pytest.LogCaptureFixture) -> None:
    # an opgate killed while writing a flow (OOM-killed, SIGKILL) leaves half of it; the next
    # run's flows appended after it would be unreadable: mitmproxy stops at the broken flow
    path = tmp_path / "capture.flows"
    call = tapped_call(make_ctx("GET", "/api/v1/pods"), response=[b"x" * 1000])
    first = FlowFile(str(path), upstream=UPSTREAM)
    whole = first.encode(call)
    first.close()
    path.write_bytes(whole * 2 + (whole[:len(whole) // 2] if cut else b""))
    out = FlowFile(str(path), upstream=UPSTREAM)
    out.write(call)
    out.close()
    backups = [p for p in tmp_path.iterdir() if p.name.startswith("capture-")]
    if not cut:
        assert len(flows_of(path)) == 3 and not backups
        return
    assert len(flows_of(path)) == 1  # this run's, in a file of its own
    (backup,) = backups
    with open(backup, "rb") as f:  # the earlier run's whole flows are still there
        reader = mio.FlowReader(f).stream()
        assert [next(reader).response.content for _ in range(2)] == [b"x" * 1000] * 2
    assert "ends inside a flow" in caplog.text and backup.name in caplog.text


def test_a_stalled_writer_drops_whole_flows_and_counts_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real = RotatingFile.write_bytes

    def stalled(self: Any, raw: bytes) -> None:
        gate.wait(10)
        real(self, raw)

    monkeypatch.setattr(RotatingFile, "write_bytes", stalled)
    before_dropped, before_written = counted("dropped"), counted("written")
    out = FlowFile(str(tmp_path / "c.flows"), upstream=UPSTREAM, max_pending=64 * 1024)
    call = tapped_call(make_ctx("GET", "/api/v1/pods"), response=[b"y" * 20_000])
    for _ in range(10):
        out.write(call)  # returns at once, whatever the disk does
    gate.set()
    out.close()
    written = counted("written") - before_written
    dropped = counted("dropped") - before_dropped
    assert written + dropped == 10
    assert dropped >= 6
    assert len(flows_of(tmp_path / "c.flows")) == written


def test_a_flow_larger_than_the_queue_is_written_when_nothing_else_waits(
        tmp_path: Path) -> None:
    # a rule may keep up to 64 MiB per body, twice the queue's 32 MiB: such a flow must not be
    # dropped by an idle writer (here: a 64 KiB queue and a 100 KB body)
    before = counted("dropped")
    out = FlowFile(str(tmp_path / "c.flows"), upstream=UPSTREAM, max_pending=64 * 1024)
    body = b"z" * 100_000
    out.write(tapped_call(make_ctx("GET", "/api/v1/pods"), response=[body],
                          limit="- {maxBodyBytes: 200000}\n"))
    out.close()
    assert counted("dropped") == before
    (flow,) = flows_of(tmp_path / "c.flows")
    assert flow.response.content == body


def test_a_flow_that_fails_to_encode_is_counted_not_fatal(tmp_path: Path) -> None:
    before = counted("failed")
    out = FlowFile(str(tmp_path / "c.flows"), upstream=UPSTREAM)
    bad = tapped_call(make_ctx("GET", "/api/v1/pods"))
    bad.request_headers = [(None, None)]  # not a header: the flow cannot be built
    out.write(bad)
    out.write(tapped_call(make_ctx("GET", "/api/v1/pods")))
    out.close()
    assert counted("failed") - before == 1
    assert len(flows_of(tmp_path / "c.flows")) == 1


def test_to_flow_needs_no_file() -> None:
    flow = to_flow(tapped_call(make_ctx("GET", "/api/v1/namespaces/a/pods")), upstream=UPSTREAM)
    assert flow.request.url == "https://10.0.0.1:6443/api/v1/namespaces/a/pods"


def test_the_flags_reach_the_settings_and_each_worker_writes_its_own_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy.app import open_capture
    from proxy.cli import settings_from
    from proxy.cli_parser import build_parser
    from proxy.settings import Settings

    path = tmp_path / "capture.flows"
    settings = settings_from(build_parser().parse_args(
        ["serve", "--capture", str(path), "--capture-maxsize", "7",
         "--capture-maxbackup", "0"]))
    assert (settings.log.capture, settings.log.capture_maxsize,
            settings.log.capture_maxbackup) == (str(path), 7, 0)
    assert Settings.from_json(settings.to_json()) == settings  # handed to --workers as JSON
    monkeypatch.setenv("OPGATE_CAPTURE", "/tmp/x.flows")
    assert settings_from(build_parser().parse_args(["serve"])).log.capture == "/tmp/x.flows"
    assert open_capture(Settings(), UPSTREAM) is None
    flows = open_capture(settings, UPSTREAM, tag="worker 2")
    try:
        assert flows.path == str(tmp_path / "capture.worker2.flows")
    finally:
        flows.close()
