"""The Redis store on a real redis-server: the Lua script against the in-process arithmetic,
expiry, script reloads, shards, Sentinel and Cluster URLs, and accuracy across processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.engine.kinds import MAX_BURST, MAX_QPS, MIN_QPS
from proxy.envtest.reaper import reaper
from proxy.stores.base import BucketRequest, Verdict
from proxy.stores.memory import MemoryStore
from proxy.stores.redis import RedisStore
from tests.integration.redis_server import REDIS_BINARY, RedisServer, free_port, ping

pytestmark = pytest.mark.redis
ROOT = Path(__file__).resolve().parents[2]
T0 = 1_700_000_000_000_000  # an explicit "now" in µs for the table tests


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer.launch() as s:
        yield s


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


async def both(url: str, steps: list[tuple[int, list[BucketRequest]]]) -> list[tuple[Verdict, ...]]:
    redis_store = RedisStore.from_url(url, timeout=2.0)
    memory = MemoryStore()
    out = []
    try:
        for at, requests in steps:
            a = await redis_store.acquire(requests, now=T0 + at)
            b = await memory.acquire(requests, now=T0 + at)
            out.append((a, b))
    finally:
        await redis_store.close()
    return out


def r(key: str, rate: float, burst: int, cost: int = 1, extra: int = 0) -> BucketRequest:
    return BucketRequest(key=key, rate=rate, burst=burst, cost=cost, extra=extra, shard="t")


TABLE = [  # (µs after T0, requests) — burst, refill, multi-key all-or-nothing, leases, refunds
    (0, [r("a", 10, 3)]), (0, [r("a", 10, 3)]), (0, [r("a", 10, 3)]), (0, [r("a", 10, 3)]),
    (99_999, [r("a", 10, 3)]), (100_000, [r("a", 10, 3)]),
    (100_000, [r("b", 1, 5), r("a", 10, 3)]),  # a is empty: b must not be charged
    (100_001, [r("b", 1, 5)]),
    (200_000, [r("c", 1000, 100, extra=40)]), (200_000, [r("c", 1000, 100, extra=40)]),
    (200_000, [r("c", 1000, 100, extra=40)]),
    (250_000, [r("c", 1000, 100, cost=-30)]),
    (250_000, [r("d", 3, 2), r("d", 3, 2), r("d", 3, 2)]),
    (5_000_000, [r("a", 10, 3), r("b", 1, 5), r("c", 1000, 100, cost=7)]),
    (5_000_000, [r("e", 0.25, 1, cost=2)]),  # cost above burst never passes
    # the qps raised (a reload, an instance's annotation): the old debt is no deeper than
    # the new bucket, whose next token comes at the new rate
    (6_000_000, [r("f", 0.1, 2)]), (6_000_000, [r("f", 0.1, 2)]), (6_000_000, [r("f", 0.1, 2)]),
    (6_000_000, [r("f", 100, 100)]), (6_010_000, [r("f", 100, 100)]),
]


def test_lua_matches_in_process_table(server: RedisServer) -> None:
    results = run(both(server.url, TABLE))
    for (at, _), (in_redis, in_memory) in zip(TABLE, results, strict=True):
        assert (in_redis.allowed, in_redis.keys) == (in_memory.allowed, in_memory.keys), at
    allowed = [a.allowed for a, _ in results]
    assert allowed[:8] == [True, True, True, False, False, True, False, True]
    assert [results[i][0].keys[0].granted for i in (8, 9, 10)] == [40, 29, 14]  # half of the rest
    assert allowed[-5:] == [True, True, False, False, True]


def test_lua_matches_in_process_random(server: RedisServer) -> None:
    rnd = random.Random(7)
    steps, at = [], 0
    for _ in range(1500):
        at += rnd.choice([0, 0, 1, 999, 50_000, 333_333, 2_000_000])
        steps.append((at, [
            BucketRequest(key=f"rand-{rnd.randint(0, 4)}", rate=rnd.choice([0.3, 1, 7, 20, 1e4]),
                          burst=rnd.randint(1, 12), cost=rnd.choice([1, 1, 1, 2, -1]),
                          extra=rnd.choice([0, 0, 3, 50]), shard="r")
            for _ in range(rnd.randint(1, 3))]))
    results = run(both(server.url, steps))
    mismatches = [i for i, (a, b) in enumerate(results)
                  if (a.allowed, a.keys) != (b.allowed, b.keys)]
    assert mismatches == []
    assert 0 < sum(a.allowed for a, _ in results) < len(results)


@pytest.mark.parametrize(("rate", "burst"), [(MIN_QPS, MAX_BURST), (MIN_QPS, 1),
                                             (MAX_QPS, MAX_BURST), (MAX_QPS, 1)])
def test_the_bounds_a_policy_may_set_are_buckets_redis_keeps(
        server: RedisServer, rate: float, burst: int) -> None:
    """At the edges the policy schema allows (ratelimit_spec), the script's arithmetic and the
    key's PEXPIRE stay within what Redis takes: a rate of 1e-300 (an instance's annotation
    could say so) made every decision an error, and the breaker then tripped for every rule."""
    async def go() -> None:
        store = RedisStore.from_url(server.url, timeout=1.0, prefix="edge:")
        req = BucketRequest(key=f"b-{rate:g}-{burst}", rate=rate, burst=burst, shard="u")
        try:
            first = await store.acquire([req])
            # (a bucket spanning 1e21 µs is exact to ~1e5 µs: one token of rounding)
            assert first.allowed and burst - 2 <= first.keys[0].remaining <= burst - 1
            if rate == MIN_QPS:  # the key lives until the bucket is full again
                assert await store.client.pttl(store.redis_key(req)) > 1e9
            if rate == MIN_QPS and burst == 1:  # the next token in ~31.7 years
                second = await store.acquire([req])
                assert not second.allowed and second.keys[0].retry_after > 9e8
        finally:
            await store.close()

    run(go())


def test_redis_time_expiry_and_noscript(server: RedisServer) -> None:
    async def go() -> None:
        store = RedisStore.from_url(server.url, timeout=1.0, prefix="t:")
        req = BucketRequest(key="timed", rate=2, burst=3, shard="u")
        try:
            got = [await store.acquire([req]) for _ in range(4)]
            assert [v.allowed for v in got] == [True, True, True, False]
            assert 0.4 < got[3].retry_after <= 0.5  # from Redis TIME
            assert store.redis_key(req) == "t:{u}:timed"
            ttl = await store.client.pttl("t:{u}:timed")
            assert 1000 < ttl <= 1500  # expires when the bucket is full again
            await store.client.script_flush()  # NOSCRIPT: the script is loaded again
            assert not (await store.acquire([req])).allowed
            await store.client.delete("t:{u}:timed")  # a missing key is a full bucket
            assert (await store.acquire([req])).keys[0].remaining == 2
        finally:
            await store.close()

    run(go())


def test_calls_spanning_shards_give_tokens_back(server: RedisServer) -> None:
    async def go() -> None:
        client_store = RedisStore.from_url(server.url, timeout=1.0, prefix="sh:")
        store = RedisStore(client_store.client, cluster=True, timeout=1.0, prefix="sh:")
        a = BucketRequest(key="one", rate=1, burst=3, shard="s1")
        b = BucketRequest(key="two", rate=1, burst=1, shard="s2")
        try:
            assert (await store.acquire([a, b])).allowed
            denied = await store.acquire([a, b])
            assert not denied.allowed and [k.allowed for k in denied.keys] == [True, False]
            assert store.calls == 5  # 2 + 2 + the refund of "one"
            assert (await store.acquire([a])).keys[0].remaining == 1  # refunded
        finally:
            await client_store.close()

    run(go())


def test_sentinel_url(server: RedisServer, tmp_path: Path) -> None:
    port = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
                    f"sentinel monitor opgate 127.0.0.1 {server.port} 1\n")
    proc = subprocess.Popen([REDIS_BINARY, str(conf), "--sentinel"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    reaper().watch_process(proc.pid)  # stopped if pytest dies first
    try:
        deadline = time.monotonic() + 10
        while not ping(port):
            assert proc.poll() is None and time.monotonic() < deadline, "sentinel did not start"
            time.sleep(0.05)

        async def go() -> None:
            store = RedisStore.from_url(f"redis+sentinel://127.0.0.1:{port}/opgate/0",
                                        timeout=1.0)
            try:
                verdict = await store.acquire([BucketRequest(key="sent", rate=1, burst=2)])
                assert verdict.allowed and verdict.keys[0].remaining == 1
            finally:
                await store.close()

        run(go())
    finally:
        proc.kill()
        proc.wait()


def _accepts(port: int) -> bool:
    """Whether a TLS-only server's port takes connections (it answers no plain PING)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def test_sentinel_over_tls_with_the_ca_named_in_the_url(tmp_path: Path) -> None:
    """``rediss+sentinel://…?ssl_ca_certs=`` with a private CA, as a platform team's TLS
    Sentinel has it: the CA reached the master's connections but not the Sentinels', whose
    handshakes then failed (system CAs), so the store never found its master."""
    from proxy.envtest import pki

    files = pki.write_pki(tmp_path / "pki")
    cert, key = pki.issue_serving_cert(tmp_path / "pki", name="redis")
    tls = (f"tls-cert-file {cert}\ntls-key-file {key}\ntls-ca-cert-file {files.ca_cert}\n"
           "tls-auth-clients no\n")
    master_port, sentinel_port = free_port(), free_port()
    (tmp_path / "master.conf").write_text(
        f"port 0\ntls-port {master_port}\nbind 127.0.0.1\ndir {tmp_path}\nsave \"\"\n{tls}")
    (tmp_path / "sentinel.conf").write_text(
        f"port 0\ntls-port {sentinel_port}\nbind 127.0.0.1\ndir {tmp_path}\n{tls}"
        f"tls-replication yes\nsentinel monitor opgate 127.0.0.1 {master_port} 1\n")
    procs = [subprocess.Popen([REDIS_BINARY, str(tmp_path / "master.conf")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
             subprocess.Popen([REDIS_BINARY, str(tmp_path / "sentinel.conf"), "--sentinel"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    for proc in procs:
        reaper().watch_process(proc.pid)  # stopped if pytest dies first
    url = f"rediss+sentinel://127.0.0.1:{sentinel_port}/opgate/0?ssl_ca_certs={files.ca_cert}"
    try:
        deadline = time.monotonic() + 10
        while not all(_accepts(port) for port in (master_port, sentinel_port)):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
            time.sleep(0.05)

        async def go() -> Verdict:
            store = RedisStore.from_url(url, timeout=1.0)
            try:
                return await store.acquire([BucketRequest(key="tls", rate=1, burst=2)])
            finally:
                await store.close()

        verdict = run(go())
        assert verdict.allowed and verdict.keys[0].remaining == 1
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def _cluster() -> Iterator[list[RedisServer]]:
    """Three redis-server nodes made one Redis Cluster (no replicas), ready."""
    servers = [RedisServer(kind="binary", port=free_port(cluster=True)) for _ in range(3)]
    try:
        for s in servers:
            s.extra_args = ("--cluster-enabled", "yes", "--cluster-config-file",
                            f"nodes-{s.port}.conf")
            s.start()
        subprocess.run(["redis-cli", "--cluster", "create",
                        *(f"127.0.0.1:{s.port}" for s in servers),
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=30)
        deadline = time.monotonic() + 20
        while b"cluster_state:ok" not in subprocess.run(
                ["redis-cli", "-p", str(servers[0].port), "cluster", "info"],
                capture_output=True, timeout=5).stdout:
            assert time.monotonic() < deadline, "the cluster did not become ready"
            time.sleep(0.1)
        yield servers
    finally:
        for s in servers:
            s.close()


def test_cluster_url() -> None:
    async def go(port: int) -> None:
        store = RedisStore.from_url(f"redis+cluster://127.0.0.1:{port}", timeout=2.0)
        try:
            same = [BucketRequest(key=f"k{i}", rate=1, burst=2, shard="alice")
                    for i in range(3)]
            assert (await store.acquire(same)).allowed
            spread = [BucketRequest(key=f"user-less-{i}", rate=1, burst=1) for i in range(6)]
            assert (await store.acquire(spread)).allowed  # slots on several nodes
            assert not (await store.acquire(spread[:2])).allowed
        finally:
            await store.close()

    with _cluster() as servers:
        run(go(servers[0].port))


def test_a_burst_of_calls_on_a_cluster_waits_for_connections_not_fails() -> None:
    """300 calls at once for buckets on one node (one user's): redis-py's Cluster client
    refuses the 101st call in flight to a node ("MaxConnectionsError"), so a burst failed
    calls and tripped the breaker with the Cluster fine; they now wait their turn for one of
    at most MAX_CONNECTIONS connections per node (within their own timeout)."""
    from proxy.stores.redis import MAX_CONNECTIONS

    async def go(port: int) -> tuple[list[str], int]:
        store = RedisStore.from_url(f"redis+cluster://127.0.0.1:{port}", timeout=2.0)
        requests = [BucketRequest(key=f"cb-{i % 3}", rate=1e6, burst=1000, shard="bob")
                    for i in range(300)]
        try:
            answers = await asyncio.gather(*(store.acquire([q]) for q in requests),
                                           return_exceptions=True)
            node = store.client.get_node_from_key(store.redis_key(requests[0]))
            clients = (await store.client.info("clients", target_nodes=node))["connected_clients"]
        finally:
            await store.close()
        return [str(a) for a in answers if isinstance(a, BaseException)], clients

    with _cluster() as servers:
        failed, clients = run(go(servers[0].port))
    assert failed == []
    assert clients <= MAX_CONNECTIONS + 3  # (+ the other nodes' cluster bus links)

WORKER = r"""
import asyncio, json, sys, time
from proxy.stores.base import BucketRequest
from proxy.stores.lease import LeasingStore
from proxy.stores.redis import RedisStore

url, key, lease = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
start, duration = float(sys.argv[4]), float(sys.argv[5])

async def main():
    redis_store = RedisStore.from_url(url, timeout=1.0)
    store = LeasingStore(redis_store, replicas=3) if lease else redis_store
    req = BucketRequest(key=key, rate=20, burst=20, shard=key, lease=lease)
    await redis_store.ping()
    counts = {"admitted": 0, "denied": 0}
    while time.time() < start:
        await asyncio.sleep(0.001)
    end = start + duration

    async def hammer():
        while time.time() < end:
            verdict = await store.acquire([req])
            counts["admitted" if verdict.allowed else "denied"] += 1
            await asyncio.sleep(0)

    first = time.time()  # later than start when this process came up late (a busy machine)
    await asyncio.gather(*(hammer() for _ in range(4)))
    counts["window"] = [first, time.time()]
    counts["redis_calls"] = redis_store.calls
    print(json.dumps(counts))
    await redis_store.close()

asyncio.run(main())
"""


def test_three_leasing_processes_share_one_limit(server: RedisServer) -> None:
    """The store alone (no HTTP): 3 processes with leasing on one key; real ``opgate serve``
    replicas are in test_ratelimit_redis.py (both exact and leased rules)."""
    lease = True
    key = f"accuracy-{lease}-{time.time_ns()}"
    start, duration = time.time() + 3.0, 10.0  # a loaded machine imports slowly
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, server.url, key, "1" if lease else "0",
                               str(start), str(duration)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
             for _ in range(3)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()
        results.append(json.loads(out))
    admitted = sum(r["admitted"] for r in results)
    # the bucket: its burst, then 20/s while any process hammers (from the first one that
    # started to the last one that stopped; a process that came up late shortens nothing)
    window = max(r["window"][1] for r in results) - min(r["window"][0] for r in results)
    assert window >= 0.5 * duration, results  # enough tokens for a 5% bound either way
    expected = 20 + 20 * window
    assert abs(admitted - expected) <= 0.05 * expected, results
    assert all(r["denied"] > 0 for r in results)  # every process really hammered
    if lease:  # throttled: each replica asks about once per token; cached denials cost nothing
        assert sum(r["redis_calls"] for r in results) <= 3 * 1.2 * admitted, results


def test_unreachable_redis_fails_fast() -> None:
    async def go() -> None:
        store = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout=0.05)
        started = time.monotonic()
        with pytest.raises(Exception) as info:
            await store.acquire([BucketRequest(key="x", rate=1, burst=1)])
        assert type(info.value).__name__ == "StoreUnavailable"
        assert time.monotonic() - started < 0.5
        with pytest.raises(Exception) as info:
            await store.ping()
        assert type(info.value).__name__ == "StoreUnavailable"
        assert str(info.value).startswith("unreachable: ")  # why, for the breaker's last_error
        await store.close()

    run(go())


def test_a_burst_of_first_calls_shares_a_bounded_pool(server: RedisServer) -> None:
    """100 calls at once as a fresh store's first traffic (a controller starting its
    informers): none fails, and they share at most MAX_CONNECTIONS connections instead of
    opening one each, whose handshakes missed the 50 ms timeout and tripped the breaker. The
    timeout here is 1 s: a loaded CI machine made 50 ms miss even on a bounded pool, and the
    pool's bound is what the connection count asserts."""
    from proxy.stores.redis import MAX_CONNECTIONS

    async def burst() -> tuple[list[BaseException], int]:
        store = RedisStore.from_url(server.url, timeout=1.0)
        requests = [r(f"burst-{i % 3}", 1000, 1000) for i in range(100)]
        try:
            answers = await asyncio.gather(*(store.acquire([q]) for q in requests),
                                           return_exceptions=True)
            info = await store.client.info("clients")
        finally:
            await store.close()
        return [a for a in answers if isinstance(a, BaseException)], info["connected_clients"]

    failed, clients = run(burst())
    assert failed == []
    assert clients <= MAX_CONNECTIONS + 1  # (+1: another test's client may still be there)


def test_connections_from_before_a_redis_restart_are_replaced_not_failed() -> None:
    """Redis restarted (a pod rolled, a failover) while opgate idled: every pooled connection
    is dead. The first call on each must reconnect and be decided, not fail: sixteen stale
    connections tripped the breaker, and ``failure: closed`` rules answered 503 for a second
    with Redis already back."""
    from proxy.stores import build_store
    from proxy.stores.redis import MAX_CONNECTIONS

    async def go(server: RedisServer) -> tuple[list[Verdict], dict[str, object]]:
        store = build_store(redis_url=server.url, timeout=0.5)
        requests = [BucketRequest(key=f"restart-{i}", rate=1000, burst=1000, fail_open=False)
                    for i in range(MAX_CONNECTIONS)]
        try:
            await asyncio.gather(*(store.acquire([q]) for q in requests))  # a full pool
            server.restart()
            answers = list(await asyncio.gather(*(store.acquire([q]) for q in requests)))
            answers += [await store.acquire([q]) for q in requests]
            return answers, store.health()
        finally:
            await store.close()

    with RedisServer.launch() as server:
        answers, health = run(go(server))
    assert [a.backend for a in answers if a.backend != "redis" or not a.allowed] == []
    assert (health["trips"], health["breaker"]) == (0, "closed"), health


def _sentinel(tmp_path: Path, name: str, master_port: int) -> tuple[int, subprocess.Popen[bytes]]:
    """A ``redis-sentinel`` watching the master on ``master_port``, answering on its port."""
    port = free_port()
    work = tmp_path / name
    work.mkdir()
    conf = work / "sentinel.conf"
    conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {work}\n"
                    f"sentinel monitor opgate 127.0.0.1 {master_port} 1\n")
    proc = subprocess.Popen([REDIS_BINARY, str(conf), "--sentinel"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not ping(port):
        assert proc.poll() is None and time.monotonic() < deadline, "sentinel did not start"
        time.sleep(0.05)
    return port, proc


def test_a_sentinel_that_hangs_does_not_keep_a_restarted_master_away(tmp_path: Path) -> None:
    """Two Sentinels, the one asked first hung (its node gone dark: connections open, nothing
    answers), then the master restarted: every connection must be made again, and each first
    asks the hung Sentinel, which takes one call's timeout before the other one is asked. The
    breaker's probes were bound by that same timeout, so none got through and the store stayed
    "down" for as long as that Sentinel hung, the master and the other Sentinel fine. A probe
    may take the time to connect afresh (then the Sentinel that answered is asked first)."""
    from proxy.stores import build_store

    with RedisServer.launch() as master:
        dark_port, dark = _sentinel(tmp_path, "dark", master.port)
        good_port, good = _sentinel(tmp_path, "good", master.port)

        async def go() -> tuple[bool, dict[str, object]]:
            store = build_store(
                redis_url=f"redis+sentinel://127.0.0.1:{dark_port},127.0.0.1:{good_port}/opgate/0",
                timeout=0.1, breaker_reset=0.2)
            request = BucketRequest(key="dark", rate=1000, burst=1000, fail_open=True)
            try:
                assert (await store.acquire([request])).backend == "redis"
                dark.send_signal(signal.SIGSTOP)
                await asyncio.to_thread(master.restart)
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline:
                    if (await store.acquire([request])).backend == "redis":
                        return True, store.health()
                    await asyncio.sleep(0.05)
                return False, store.health()
            finally:
                await store.close()

        try:
            back, health = run(go())
        finally:
            for proc in (dark, good):
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()
    assert back, json.dumps(health, default=str)


def test_a_sentinel_that_is_down_is_skipped_for_the_next_one(tmp_path: Path) -> None:
    """The first Sentinel of the URL down (its pod gone: connections refused): the store asks
    the next one at once, from the first call on. redis-py's default for the Sentinel clients
    (10 tries, with backoff) spent every call's timeout, and every probe's, on the one that
    was down, so opgate never reached a master the other Sentinel named."""
    from proxy.stores import build_store

    with RedisServer.launch() as master:
        good_port, good = _sentinel(tmp_path, "good", master.port)

        async def go() -> list[str]:
            store = build_store(
                redis_url=f"redis+sentinel://127.0.0.1:{free_port()},127.0.0.1:{good_port}"
                          "/opgate/0", timeout=0.2)
            request = BucketRequest(key="down", rate=1000, burst=1000, fail_open=True)
            try:
                return [(await store.acquire([request])).backend for _ in range(5)]
            finally:
                await store.close()

        try:
            backends = run(go())
        finally:
            good.kill()
            good.wait()
    assert backends == ["redis"] * 5


def test_a_burst_of_first_calls_through_sentinel_shares_a_bounded_pool(
        server: RedisServer, tmp_path: Path) -> None:
    """As ``test_a_burst_of_first_calls_shares_a_bounded_pool``, through a Sentinel: the
    master's pool was redis-py's Sentinel pool, which opens a connection per call (each asking
    the Sentinel first) and refuses the 101st call in flight with "Too many connections", so a
    controller's start (or a Redis slow for a moment under load) failed calls and tripped the
    breaker with Redis fine."""
    from proxy.stores.redis import MAX_CONNECTIONS

    port, sentinel = _sentinel(tmp_path, "burst", server.port)

    async def burst() -> tuple[list[BaseException], int]:
        store = RedisStore.from_url(f"redis+sentinel://127.0.0.1:{port}/opgate/0", timeout=1.0)
        requests = [r(f"sburst-{i % 3}", 1e6, 1000) for i in range(300)]
        try:
            answers = await asyncio.gather(*(store.acquire([q]) for q in requests),
                                           return_exceptions=True)
            info = await store.client.info("clients")
        finally:
            await store.close()
        return [a for a in answers if isinstance(a, BaseException)], info["connected_clients"]

    try:
        failed, clients = run(burst())
    finally:
        sentinel.kill()
        sentinel.wait()
    assert [str(f) for f in failed] == []
    assert clients <= MAX_CONNECTIONS + 2  # (+2: the Sentinel's own, another test's client)
