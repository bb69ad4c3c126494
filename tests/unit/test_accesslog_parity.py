"""The access log's line, built on the hot path from memoized escaped pieces and one f-string,
is byte for byte the line a plain ``json.dumps`` of the same fields gives (the format as it was
written before the pieces were memoized), over many calls through one AccessLog (so the memos
are hit, missed and cleared) and through its writer."""

from __future__ import annotations

import asyncio
import io
import json
import random
import time
from typing import Any

import pytest

from proxy.engine.chain import settle
from proxy.engine.context import Identity, RequestContext
from proxy.engine.policies import EMPTY
from proxy.engine.requestinfo import parse_request_info
from proxy.middlewares import accesslog as accesslog_mod
from proxy.middlewares.accesslog import AccessLog, AccessWriter
from proxy.relay.fast.wire import WireHeaders

PATHS = ["/api/v1/namespaces/a/configmaps/x", "/apis/apps/v1/deployments",
         "/api/v1/namespaces/b/pods/p/log", "/healthz", '/api/v1/namespaces/a/configmaps/we"ird',
         "/apis/g.example/v1/namespaces/n/things/ünï\ncode\u2028", "/version", "/api/v1/nodes/n1",
         "/apis/apps/v1/namespaces/a/deployments/d/scale"]
USERS = ["alice", "system:serviceaccount:a:b", 'q"u\\o', "ünï", "tab\there", "nel\x85"]


def reference(ctx: RequestContext) -> str:
    """The line from a dict, in the documented field order."""
    info, wall = ctx.info, ctx.wall_time
    second = int(wall)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
    doc: dict[str, Any] = {
        "time": f"{stamp}.{int((wall - second) * 1000):03d}Z", "trace": ctx.trace_id,
        "verb": info.verb, "code": ctx.status_code, "decision": ctx.decision,
        "duration_ms": round(ctx.duration * 1000, 3), "bytes_in": ctx.bytes_in,
        "bytes_out": ctx.bytes_out}
    if info.is_resource_request:
        doc["resource"] = f"{info.resource}.{info.api_group}" if info.api_group else info.resource
        for key in ("subresource", "namespace", "name"):
            if getattr(info, key):
                doc[key] = getattr(info, key)
    else:
        doc["path"] = info.path
    instance = ctx.headers.get("opgate-instance")
    if instance:
        doc["instance"] = instance[:256]
    if ctx.identity is not None:
        doc["user"] = ctx.identity.user
    if ctx.error:
        doc["error"] = ctx.error
    # with the line breaks JSON leaves raw escaped (U+2028, U+2029, NEL)
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).translate(
        {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"})


def random_ctx(rnd: random.Random) -> RequestContext:
    method = rnd.choice(["GET", "POST", "DELETE", "PATCH", "PUT"])
    path = rnd.choice(PATHS)
    pairs = [(b"Host", b"h"), (b"Accept", b"*/*")]
    if rnd.random() < 0.3:
        pairs.append((b"Opgate-Instance", rnd.choice([b"ns/Kind/n", b'we"ird\xe9', b"x" * 300])))
    headers: Any = WireHeaders(pairs) if rnd.random() < 0.7 else {"opgate-instance": "a/B/c"}
    ctx = RequestContext(info=parse_request_info(method, path, ""), method=method, path=path,
                         query="", headers=headers, policies=EMPTY,
                         trace_id=f"{rnd.getrandbits(64):016x}")
    ctx.wall_time = 1_764_480_600 + rnd.random() * 5
    ctx.started = 100.0
    ctx.finished = 100.0 + rnd.random() * 10 ** rnd.uniform(-7, 3)
    ctx.status_code = rnd.choice([0, 200, 201, 404, 429, 499, 503, 1000, 1234])
    ctx.bytes_in = rnd.choice([0, 999, 1000, rnd.randrange(1000), rnd.randrange(10**6)])
    ctx.bytes_out = rnd.choice([0, rnd.randrange(1000), rnd.randrange(10**9)])
    ctx.decision = rnd.choice(["allowed", "denied", "throttled", 'we"ird'])
    if rnd.random() < 0.6:
        ctx.identity = Identity(user=rnd.choice(USERS))
    if rnd.random() < 0.2:
        ctx.error = rnd.choice(["upstream refused", 'x"\n'])
    return ctx


@pytest.mark.parametrize("memo_size", [accesslog_mod.MEMO_SIZE, 3])
def test_lines_are_the_reference_lines(monkeypatch: pytest.MonkeyPatch, memo_size: int) -> None:
    monkeypatch.setattr(accesslog_mod, "MEMO_SIZE", memo_size)
    rnd = random.Random(11)
    log = AccessLog()
    for _ in range(3000):
        ctx = random_ctx(rnd)
        assert log.line(ctx) == reference(ctx)
    assert len(log._users) <= max(memo_size, len(USERS))


def test_the_writer_gets_the_reference_lines() -> None:
    rnd = random.Random(12)
    out = io.StringIO()
    contexts = [random_ctx(rnd) for _ in range(300)]

    async def main() -> None:
        writer = AccessWriter(out)
        log = AccessLog(writer=writer)
        for ctx in contexts:
            await settle(log.exit(ctx))
        writer.close()

    asyncio.run(main())
    assert out.getvalue() == "".join(reference(ctx) + "\n" for ctx in contexts)


def test_an_unfinished_call_counts_its_duration_up_to_now() -> None:
    ctx = random_ctx(random.Random(13))
    ctx.finished = 0.0
    ctx.started = time.monotonic() - 2.0
    duration = json.loads(AccessLog().line(ctx))["duration_ms"]
    assert 2000.0 <= duration < 60_000.0
