"""Quota reservations in Redis (``quota.lua``) on a real redis-server: the same table as the
in-process store, real expiry on the server's clock, script reloads, and the quota middleware
through a Redis outage (failure open: in-process reservations; closed: 503) and back."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from redis.asyncio import Redis

from proxy.app import section_parsers
from proxy.engine import telemetry
from proxy.engine.chain import settle
from proxy.engine.context import Deny, RequestContext
from proxy.engine.policies import PolicySet, build_policy_set
from proxy.engine.requestinfo import parse_request_info
from proxy.middlewares.quota import Quota
from proxy.middlewares.quota_counts import MemoryQuotaCounts
from proxy.stores import build_store
from proxy.stores.base import Reservation
from proxy.stores.memory import MemoryStore
from proxy.stores.redis import RedisStore
from tests.integration.redis_server import RedisServer
from tests.unit.test_store_quota import QUOTA_TABLE, SCOPE, res, run_memory_table

pytestmark = pytest.mark.redis
T0 = 1_700_000_000_000_000  # an explicit "now" in µs for the table


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer.launch() as s:
        yield s


async def live_members(client: Redis, key: str, now: float) -> dict[str, float]:
    pairs = await client.zrange(key, 0, -1, withscores=True)
    return {m.decode(): float(score) for m, score in pairs if score > now}


def test_lua_matches_in_process_table(server: RedisServer) -> None:
    memory = MemoryStore()
    expected = run_memory_table(memory, float(T0))

    async def go() -> list[tuple[Any, dict[str, float]]]:
        store = RedisStore.from_url(server.url, timeout=2.0, quota_prefix="opgate:qt:")
        client = Redis.from_url(server.url)
        out = []
        try:
            for at, op, args, _, _ in QUOTA_TABLE:
                now = T0 + at
                if op == "reserve":
                    got = await store.reserve(args, now=now)
                    assert got.backend == "redis"
                    answer: Any = (got.allowed, got.used)
                else:
                    answer = await store.settle_found(*args, now=now)
                out.append((answer, await live_members(client, store.quota_key(SCOPE), now)))
        finally:
            await store.close()
            await client.aclose()
        return out

    in_redis = asyncio.run(go())
    # the expiries too, to the microsecond: replay the memory table keeping them
    memory2 = MemoryStore()
    for (at, op, args, answer, live), (got, members), (mem_answer, _) in zip(
            QUOTA_TABLE, in_redis, expected, strict=True):
        now = T0 + at
        if op == "reserve":
            memory2.reserve_now(args, now=now)
        else:
            memory2.settle_now(*args, now=now)
        assert got == answer == mem_answer, (at, op, args)
        assert members == memory2.reservations(SCOPE, now=now), (at, op)
        assert sorted(members) == sorted(live), (at, op)


def test_server_time_expiry_key_ttl_and_noscript(server: RedisServer) -> None:
    async def go() -> None:
        store = RedisStore.from_url(server.url, timeout=2.0)
        client = Redis.from_url(server.url)
        key = store.quota_key("apps/deployments/ns-x")
        assert key == "opgate:quota:{apps/deployments/ns-x}"  # one hash tag: one Cluster slot
        try:
            one = res("d|1", 0, 1, ttl=0.3, scope="apps/deployments/ns-x")
            assert (await store.reserve(one)).allowed
            assert 0 < await client.pttl(key) <= 300  # the key expires with its last member
            two = res("e|2", 0, 1, ttl=0.3, scope="apps/deployments/ns-x")
            assert not (await store.reserve(two)).allowed
            await asyncio.sleep(0.35)  # a crashed replica's reservation ends on its own
            assert await client.exists(key) == 0
            assert (await store.reserve(res("d|2", 0, 1, ttl=30, scope="apps/deployments/ns-x"))
                    ).allowed
            assert 29_000 < await client.pttl(key) <= 30_000
            await store.settle("apps/deployments/ns-x", "d|2", 0.5)  # shorter: the key too
            assert 0 < await client.pttl(key) <= 500
            await store.settle("apps/deployments/ns-x", "d|2", 60)  # never longer
            assert 0 < await client.pttl(key) <= 500
            await store.settle("apps/deployments/ns-x", "d|2", None)
            assert await client.exists(key) == 0
            await client.script_flush()  # NOSCRIPT: reloaded by the client
            assert (await store.reserve(res("d|3", 0, 1, scope="apps/deployments/ns-x"))).allowed
        finally:
            await store.close()
            await client.aclose()

    asyncio.run(go())


def test_concurrent_reservations_from_many_clients_never_overshoot(server: RedisServer) -> None:
    """Eight independent stores (as eight replicas) race for the last 5 places of 10."""

    async def go() -> list[bool]:
        stores = [RedisStore.from_url(server.url, timeout=2.0, quota_prefix="opgate:race:")
                  for _ in range(8)]
        try:
            return list(await asyncio.gather(*(
                _reserved(stores[i % 8], Reservation("/configmaps/race", f"cm-{i}|{i}", 5, 10,
                                                     30)) for i in range(40))))
        finally:
            for s in stores:
                await s.close()

    got = asyncio.run(go())
    assert sum(got) == 5


async def _reserved(store: RedisStore, request: Reservation) -> bool:
    return (await store.reserve(request)).allowed


# --- the middleware through an outage ------------------------------------------------------------

POLICY = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: q}}
spec:
  failure: {failure}
  quotas:
    - {{resources: [configmaps], max: 3}}
"""


def policies(failure: str) -> PolicySet:
    return build_policy_set([("q.yaml", POLICY.format(failure=failure).encode())],
                            parsers=section_parsers())


def create(pset: PolicySet, name: str) -> RequestContext:
    path = "/api/v1/namespaces/ns/configmaps"
    ctx = RequestContext(info=parse_request_info("POST", path, ""), method="POST", path=path,
                         query="", headers={"Content-Type": "application/json"}, policies=pset)
    ctx.body = json.dumps({"metadata": {"name": name}}).encode()
    return ctx


def metric(name: str, labels: dict[str, str] | None = None) -> float:
    return telemetry.REGISTRY.get_sample_value(name, labels or {}) or 0.0


def test_quota_through_a_redis_outage(server: RedisServer,
                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="opgate.ratelimit.store")
    closed, opened = policies("closed"), policies("open")

    async def go() -> None:
        store: Any = build_store(redis_url=server.url, timeout=0.05, breaker_failures=2,
                                 breaker_reset=0.3)
        counts = MemoryQuotaCounts()
        counts.set("", "configmaps", "ns", 1)
        # a second replica on the same Redis, with the same view of the cluster
        other_store: Any = build_store(redis_url=server.url, timeout=0.5)
        mw = Quota(counts=counts, store=store)
        other = Quota(counts=counts, store=other_store)
        redis_before = metric("opgate_quota_reservations_total", {"backend": "redis"})
        assert await settle(mw.entry(create(closed, "a"))) is None
        assert await settle(other.entry(create(closed, "b"))) is None  # sees "a" at once: 1 + 2 = 3
        denied = await settle(mw.entry(create(closed, "c")))
        assert isinstance(denied, Deny) and denied.status.code == 403
        assert "used: count/configmaps=3, limited: count/configmaps=3" in denied.status.message
        assert metric("opgate_quota_reservations_total", {"backend": "redis"}) \
            == redis_before + 2

        errors = metric("opgate_redis_errors_total")
        fallback_before = metric("opgate_quota_reservations_total", {"backend": "fallback"})
        server.stop()
        start = time.monotonic()
        down = [await settle(mw.entry(create(closed, f"x-{i}"))) for i in range(3)]
        assert all(isinstance(d, Deny) and d.status.code == 503 for d in down)
        assert "quota store is unavailable" in down[0].status.message  # type: ignore[union-attr]
        # failure: open: in-process reservations (this replica's own: 1 object + 2 places)
        local = [await settle(mw.entry(create(opened, f"o-{i}"))) for i in range(3)]
        assert [d is None for d in local] == [True, True, False]
        assert time.monotonic() - start < 1.0  # nothing waits on a dead Redis
        assert metric("opgate_redis_errors_total") >= errors + 2
        assert metric("opgate_quota_reservations_total", {"backend": "fallback"}) \
            == fallback_before + 2
        assert store.health()["breaker"] == "open"
        assert "rate-limit store unavailable after 2 failures" in caplog.text

        server.start()
        deadline = time.monotonic() + 5
        while store.health()["breaker"] != "closed":
            assert time.monotonic() < deadline, store.health()
            await settle(mw.entry(create(opened, "probe")))
            await asyncio.sleep(0.05)
        # back on Redis: the reservations in it were lost with the server (it kept no data)
        fresh = [await settle(mw.entry(create(closed, f"r-{i}"))) for i in range(3)]
        assert [d is None for d in fresh] == [True, True, False]
        await store.close()
        await other_store.close()

    asyncio.run(go())


POD_POLICY = build_policy_set([("q.yaml", b"""\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {name: q}
spec:
  quotas:
    - {resources: [pods], alignWith: [ResourceQuota]}
""")], parsers=section_parsers())


def pod_create(name: str) -> RequestContext:
    path = "/api/v1/namespaces/ns/pods"
    ctx = RequestContext(info=parse_request_info("POST", path, ""), method="POST", path=path,
                         query="", headers={"Content-Type": "application/json"},
                         policies=POD_POLICY)
    ctx.body = json.dumps({"metadata": {"name": name}}).encode()
    return ctx


def test_a_pod_burst_over_replicas_holds_both_pod_counts(server: RedisServer) -> None:
    """A legacy ``pods`` limit leaves the finished pods out, ``count/pods`` does not: one Redis
    reservation per create holds room in both, so a burst over two replicas stops at whichever
    is reached first, and a pod that finishes frees room under ``pods`` only."""
    async def go() -> None:
        stores = [RedisStore.from_url(server.url, timeout=2.0, quota_prefix="opgate:pods:")
                  for _ in range(2)]
        counts = MemoryQuotaCounts()  # both replicas' watches show the same
        counts.set("", "pods", "ns", 4)
        for name in ("existing-0", "existing-1"):
            counts.finish("", "pods", "ns", name)  # 2 of 4 still count under "pods"
        counts.add_quota("ResourceQuota", "rq", {"count/pods": 6, "pods": 3},
                         namespaces=["ns"])
        replicas = [Quota(counts=counts, store=s) for s in stores]
        try:
            got = await asyncio.gather(*(settle(replicas[i % 2].entry(pod_create(f"a-{i}")))
                                         for i in range(10)))
            assert sum(d is None for d in got) == 1  # pods: 2 + 1 of 3
            denied = next(d for d in got if isinstance(d, Deny))
            assert denied.status.message.endswith(
                "requested: pods=1, used: pods=3, limited: pods=3")
            for name in ("existing-2", "existing-3"):  # all Succeeded: room for 2 under pods
                counts.finish("", "pods", "ns", name)
            got = await asyncio.gather(*(settle(replicas[i % 2].entry(pod_create(f"b-{i}")))
                                         for i in range(10)))
            assert sum(d is None for d in got) == 1  # but count/pods: 4 + 1 + 1 of 6
            denied = next(d for d in got if isinstance(d, Deny))
            assert denied.status.message.endswith(
                "requested: count/pods=1, used: count/pods=6, limited: count/pods=6")
        finally:
            for s in stores:
                await s.close()

    asyncio.run(go())
