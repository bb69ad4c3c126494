"""A serving relay with the whole chain keeps what it remembers bounded, however many distinct
calls it sees: distinct tokens, users, namespaces, names, query strings and 404 paths.

Each middleware's per-call memo, the token cache and the RequestInfo cache start over (or evict)
at their documented size; the tests shrink those sizes to 64 so that a few thousand calls are many
times more distinct inputs than each may hold, through a real relay (both cores), identity
verified by TokenReview, rate limits on a real redis-server with leasing, quota, faults, audit,
access log and metrics. The rate-limit and quota keys in Redis expire once the load stops.
bench/soak.py is the longer run of the same, against a serving process.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from bench.soak import POLICY  # the soak harness's whole chain
from proxy.app import section_parsers
from proxy.engine import requestinfo
from proxy.engine.policies import build_policy_set
from proxy.middlewares import accesslog, audit, audit_spec, faults, identity, metrics, ratelimit
from proxy.middlewares.quota import Quota
from proxy.middlewares.quota_counts import MemoryQuotaCounts
from proxy.relay.authn import UpstreamAuthenticator
from proxy.relay.upstream import UpstreamConfig
from proxy.stores import build_store
from tests.integration.fakes import Policies, running_proxy
from tests.integration.redis_server import RedisServer

pytestmark = pytest.mark.redis

BOUND = 64  # every memo's size in these tests
CALLS = 2000  # distinct calls: ~30 times what each memo may hold

@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer.launch() as s:
        yield s


@pytest.fixture
def small_memos(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (ratelimit, faults, audit_spec, audit, accesslog):
        monkeypatch.setattr(module, "MEMO_SIZE", BOUND)
    monkeypatch.setattr(requestinfo, "CACHE_SIZE", BOUND)
    monkeypatch.setattr(identity, "ALLOWED_SHAPES", BOUND)
    monkeypatch.setattr(metrics, "MAX_RESOURCES", BOUND // 8)  # its series memo: 8 times that
    requestinfo._cache.clear()


async def upstream(request: web.BaseRequest) -> web.StreamResponse:
    """Every call under a namespace answers 200, a TokenReview vouches for a user per token
    (one in three tokens share a user), anything else is a 404."""
    if request.path.endswith("/tokenreviews"):
        token = (await request.json())["spec"]["token"]
        user = "u-" + hashlib.sha256(token.encode()).hexdigest()[:12]
        return web.json_response({"kind": "TokenReview", "status": {
            "authenticated": True, "user": {"username": user}}}, status=201)
    if request.path.startswith("/api/v1/namespaces/"):
        return web.json_response({"kind": "ConfigMap", "apiVersion": "v1",
                                  "metadata": {"name": "x"}})
    return web.json_response({"kind": "Status", "code": 404}, status=404)


def call(i: int) -> tuple[str, str, str]:
    """(method, path with query, token) of the i-th distinct call."""
    kind = i % 5
    if kind == 0:
        return "GET", f"/api/v1/namespaces/ns-{i}/configmaps/cm-{i}", f"tok-{i}"
    if kind == 1:
        return "GET", f"/api/v1/namespaces/soak/configmaps?labelSelector=app%3Dx{i}", "tok"
    if kind == 2:
        return "GET", f"/random/{i}/path", "tok"
    if kind == 3:
        return "POST", f"/api/v1/namespaces/ns-{i}/configmaps", f"tok-{i % 7}"
    return "PUT", f"/api/v1/namespaces/soak/configmaps/cm-{i}", f"tok-{i}"


def sizes(chain: dict[str, Any]) -> dict[str, int]:
    ident, rl, fa, au, al = (chain[k] for k in ("identity", "ratelimit", "faults", "audit",
                                                  "accesslog"))
    plan = au.plan(chain["policies"])
    shapes = max((len(v.allowed) for v in ident._tokens.values()), default=0)
    return {
        "requestinfo": len(requestinfo._cache), "identity tokens": len(ident._tokens),
        "identity shapes per token": shapes, "ratelimit memo": len(rl._memo),
        "faults memo": len(fa._memo), "audit plan memo": len(plan._memo),
        "audit plan bodies": len(plan._body), "audit parts": len(au._parts),
        "audit calls": len(au._calls), "audit last": len(au._last),
        "access log parts": len(al._parts), "access log users": len(al._users),
        "audit open": len(au._open), "ratelimit queues": len(rl._queues),
        "metrics series memo": len(chain["metrics"]._series),
    }


@pytest.mark.parametrize("relay", ["fast", "aiohttp"])
def test_distinct_calls_stay_within_every_memo_bound(
        server: RedisServer, small_memos: None, relay: str) -> None:
    pset = build_policy_set([("soak.yaml", POLICY.encode())], parsers=section_parsers())

    async def go() -> tuple[dict[str, int], dict[str, int], int, list[str]]:
        up = web.Server(upstream, access_log=None)
        runner = web.ServerRunner(up)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        up_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        store = build_store(redis_url=server.url, timeout=2.0)
        chain = {
            "identity": identity.IdentityCheck(
                authenticator=UpstreamAuthenticator(UpstreamConfig(url=up_url)),
                cache_size=BOUND),
            "faults": faults.Faults(), "ratelimit": ratelimit.RateLimit(store=store),
            "quota": Quota(counts=MemoryQuotaCounts(), store=store, settle_seconds=1.0),
            "audit": audit.Audit(write=lambda line: None),
            "metrics": metrics.Metrics(),
            "accesslog": accesslog.AccessLog(writer=accesslog.AccessWriter(io.StringIO())),
        }
        codes: dict[int, int] = {}
        try:
            async with running_proxy(up_url, middlewares=tuple(chain.values()),
                                     policies=Policies(pset), relay_kind=relay) as proxy:
                connector = aiohttp.TCPConnector(limit=8)
                async with aiohttp.ClientSession(connector=connector) as session:
                    async def one(i: int) -> None:
                        method, path, token = call(i)
                        body = json.dumps({"apiVersion": "v1", "kind": "ConfigMap",
                                           "metadata": {"name": f"cm-{i}"}}).encode()
                        async with session.request(
                                method, proxy.url + path, data=body if method != "GET" else None,
                                headers={"Authorization": f"Bearer {token}",
                                         "Content-Type": "application/json"}) as resp:
                            await resp.read()
                            codes[resp.status] = codes.get(resp.status, 0) + 1

                    for start in range(0, CALLS, 50):
                        await asyncio.gather(*(one(i) for i in range(start, start + 50)))
                    found = sizes({**chain, "policies": pset})
            await store.close()
            redis = aioredis.from_url(server.url)
            keys = [k async for k in redis.scan_iter(count=1000)]
            no_ttl = [k for k in keys if await redis.ttl(k) == -1]
            # every bucket is full again after 1 s, every create's reservation expires 1 s
            # (settle_seconds) after its answer: their keys are gone
            await asyncio.sleep(3.0)
            left = await redis.dbsize()
            await redis.aclose()
        finally:
            await runner.cleanup()
        return found, codes, left, [str(k) for k in no_ttl]

    found, codes, left, no_ttl = asyncio.run(go())
    assert sum(codes.values()) == CALLS and set(codes) <= {200, 404}, codes
    over = {name: size for name, size in found.items() if size > BOUND}
    assert not over, found
    assert no_ttl == [] and left == 0
