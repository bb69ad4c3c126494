"""Rate-limit benchmark (not a test): decisions/s and the latency the middleware adds.

Runs the real middleware (``RateLimit.entry``) on one core over: a call no rule matches, the
in-process store, Redis without leasing, Redis with leasing on a hot key, and a hot key held at
its limit. Redis calls per admitted request come from the server (``INFO commandstats``, EVALSHA
calls after ``CONFIG RESETSTAT``). Starts a local ``redis-server`` on a loopback port pinned to
another core unless ``--redis-url`` is given.

    python bench/ratelimit_bench.py [--seconds 2] [--concurrency 1,16] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.engine.context import Identity, RequestContext
from proxy.engine.policies import PolicySet, build_policy_set
from proxy.engine.requestinfo import parse_request_info
from proxy.middlewares.ratelimit import RateLimit, parse_section
from proxy.stores import build_store
from proxy.stores.memory import MemoryStore

RULES = {
    "hot": "- {name: hot, match: {verbs: [get]}, key: '{user}', qps: 1000000, burst: 100000%s}",
    "limited": "- {name: limited, match: {verbs: [get]}, key: '{user}', qps: 200, burst: 50%s}",
    "nomatch": "- {name: writes, match: {verbs: [create]}, key: '{user}', qps: 1, burst: 1}",
}


def policy_set(rules: str) -> PolicySet:
    doc = ("apiVersion: opgate.dev/v1alpha1\nkind: Policy\nmetadata: {name: bench}\nspec:\n"
           "  rateLimits:\n    " + rules + "\n")
    return build_policy_set([("bench.yaml", doc.encode())], parsers={"rateLimits": parse_section})


def context(pset: PolicySet) -> RequestContext:
    path = "/api/v1/namespaces/a/configmaps/c"
    return RequestContext(info=parse_request_info("GET", path, ""), method="GET", path=path,
                          query="", headers={}, policies=pset,
                          identity=Identity(user="system:serviceaccount:ops:op"))


async def drive(mw: RateLimit, pset: PolicySet, *, seconds: float, concurrency: int
                ) -> tuple[int, int, list[float], float]:
    latencies: list[float] = []
    admitted = 0
    end = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal admitted
        ctx = context(pset)
        clock = time.perf_counter
        while clock() < end:
            ctx.response_headers.clear()
            t0 = clock()
            result = mw.entry(ctx)  # a held token answers at once, else a coroutine
            if asyncio.iscoroutine(result):
                result = await result
            latencies.append(clock() - t0)
            admitted += result is None
            await asyncio.sleep(0)  # a real server yields between requests too

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len(latencies), admitted, latencies, time.perf_counter() - start


async def evalsha_calls(client: Any) -> int:
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def run_case(name: str, rules: str, store: Any, *, seconds: float, concurrency: int,
                   client: Any) -> dict[str, Any]:
    pset = policy_set(rules)
    mw = RateLimit(store=store)
    await drive(mw, pset, seconds=0.3, concurrency=concurrency)  # warm up: connections, plan
    for _ in range(40):  # a cold burst may have tripped the breaker: measure the steady state
        if store.health().get("ok", True):
            break
        await asyncio.sleep(0.05)
        await drive(mw, pset, seconds=0.01, concurrency=1)
    trips = store.health().get("trips", 0)
    if client is not None:
        await client.config_resetstat()
    count, admitted, latencies, elapsed = await drive(mw, pset, seconds=seconds,
                                                      concurrency=concurrency)
    calls = await evalsha_calls(client) if client is not None else None
    latencies.sort()
    return {
        "case": name, "c": concurrency, "rate": count / elapsed,
        "p50": statistics.median(latencies) * 1e6,
        "p99": latencies[int(len(latencies) * 0.99)] * 1e6,
        "admitted": admitted / max(1, count),
        "calls": None if calls is None else calls / max(1, admitted),
        "trips": store.health().get("trips", 0) - trips,
    }


def start_redis() -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cores = sorted(os.sched_getaffinity(0))
    other = {cores[-1]} if len(cores) > 1 else set(cores)
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        preexec_fn=lambda: os.sched_setaffinity(0, other))
    for _ in range(500):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.1) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            time.sleep(0.01)
    return proc, f"redis://127.0.0.1:{port}/0"


async def main(args: argparse.Namespace) -> None:
    proc = None
    url = args.redis_url
    if url is None:
        proc, url = start_redis()
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[0]})  # one core for opgate
    rows = []
    try:
        for c in args.concurrency:
            cases: list[tuple[str, str, Any]] = [
                ("no rule matches", RULES["nomatch"], MemoryStore()),
                ("in-process store", RULES["hot"] % "", MemoryStore()),
                ("redis, no leasing", RULES["hot"] % "", build_store(redis_url=url)),
                ("redis, leasing, hot key", RULES["hot"] % ", lease: true",
                 build_store(redis_url=url)),
                ("redis, leasing, at limit", RULES["limited"] % ", lease: true",
                 build_store(redis_url=url)),
            ]
            for name, rules, store in cases:
                client = None
                primary = getattr(store, "primary", None)
                if primary is not None:
                    client = primary.inner.client
                rows.append(await run_case(name, rules, store, seconds=args.seconds,
                                           concurrency=c, client=client))
                await store.close()
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    print(f"rate-limit middleware, one core, {args.seconds:g} s per case (c = concurrent "
          "callers; latency = time inside RateLimit.entry; trips = breaker openings while "
          "measuring)")
    header = (f"{'case':<26}{'c':>4}{'decisions/s':>13}{'p50 µs':>9}{'p99 µs':>9}"
              f"{'admitted':>10}{'redis calls/admitted':>22}{'trips':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        calls = "-" if r["calls"] is None else f"{r['calls']:.4f}"
        print(f"{r['case']:<26}{r['c']:>4}{r['rate']:>13,.0f}{r['p50']:>9.1f}{r['p99']:>9.1f}"
              f"{r['admitted']:>10.1%}{calls:>22}{r['trips']:>7}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 16])
    parser.add_argument("--redis-url", default=None)
    asyncio.run(main(parser.parse_args()))
