"""What each middleware of the bench's full chain costs per call, measured in-process.

The small-GET rounds give the CPU per request of the whole process; this says where the full
chain's share of it goes. It builds the chain ``opgate serve`` builds (identity, faults, rate
limits, quota, audit, metrics, access log) under the bench's own policy (``bench/paths.py``):
the caller's service-account JWT verified once with PyJWT against a generated JWKS and then
cached, a never-firing fault rule, a rate limit with leasing on a real ``redis-server``, a quota
(checked on creates only), the audit log to a real file through its writer thread, the access
log to ``/dev/null``. Each call builds its :class:`RequestContext` as the fast relay does
(``parse_request_info``, :class:`WireHeaders` over the request's header pairs) and runs
``chain.entry`` and ``chain.exit`` for a ~1 KB ConfigMap GET answered 200.

Rows: the whole chain, no middleware at all (the context alone), then the chain without each
middleware in turn; "cost" is the whole chain minus that row. CPU is ``time.process_time`` of
this process (the audit writer thread included) over batches of calls, the chains' batches
interleaved; the table gives the fastest batch (the least disturbed by anything else on the
machine) and the median. Read it on a quiet machine: a busy one moves single figures by more
than the cost of a small middleware.

    python bench/chain_cost.py [--batches 30] [--calls 2000] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import jwt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.caller import ISSUER, JWKS, write_issuer
from bench.paths import _policy
from bench.ratelimit_bench import start_redis
from proxy.app import section_parsers
from proxy.engine.chain import Chain
from proxy.engine.context import RequestContext
from proxy.engine.logfile import RotatingFile
from proxy.engine.policies import PolicySet, build_policy_set
from proxy.engine.requestinfo import parse_request_info
from proxy.middlewares import audit, faults, identity, quota, ratelimit
from proxy.middlewares.accesslog import AccessLog, AccessWriter
from proxy.middlewares.audit_stream import QueuedStream
from proxy.middlewares.metrics import Metrics
from proxy.relay.fast.wire import WireHeaders
from proxy.stores import build_store

PATH = "/api/v1/namespaces/bench/configmaps/small"


class _Issuer:
    """The cluster's issuer as the identity middleware asks for it (no apiserver here)."""

    def __init__(self, jwks: dict[str, list[dict[str, str]]]) -> None:
        self._keys = {k["kid"]: jwt.PyJWK(k) for k in jwks["keys"]}

    async def cluster_issuer(self) -> str:
        return ISSUER

    async def keys_for(self, issuer: str, kid: str | None, *,
                       refresh: bool = False) -> tuple[jwt.PyJWK, ...]:
        key = self._keys.get(kid or "")
        return (key,) if key is not None else ()


def build_chain(redis_url: str, work: Path) -> tuple[list[object], PolicySet, str, AccessWriter]:
    """The middlewares in ``opgate serve``'s order, the bench policy and the caller's token."""
    caller, files = write_issuer(work)
    pset = build_policy_set([("bench.yaml", _policy(probe=False, quota=True).encode())],
                            parsers=section_parsers())
    buckets = build_store(redis_url=redis_url, timeout=1.0)
    audit_writer = AccessWriter(QueuedStream(RotatingFile(str(work / "audit.log"))))
    access = AccessWriter(open(os.devnull, "w"))
    quotas = quota.Quota()
    quotas.prepare(pset)
    middlewares: list[object] = [
        identity.IdentityCheck(authenticator=_Issuer(json.loads(files[JWKS].read_text()))),
        faults.Faults(), ratelimit.RateLimit(store=buckets), quotas,
        audit.Audit(write=audit_writer.write), Metrics(), AccessLog(writer=access)]
    return middlewares, pset, caller.token, audit_writer


async def per_call(chains: Sequence[Chain], pset: PolicySet, token: str, *, batches: int,
                   calls: int) -> list[list[float]]:
    """µs of CPU per call of each chain, one figure per batch; batches interleaved (A B C A B C
    …) so that slow drift of a busy machine hits every chain alike."""
    pairs = [(b"Host", b"127.0.0.1:8001"), (b"User-Agent", b"wrk/4.2"),
             (b"Accept", b"application/json"), (b"Authorization", b"Bearer " + token.encode())]
    serial = 0

    async def one(chain: Chain) -> None:
        nonlocal serial
        serial += 1
        ctx = RequestContext(info=parse_request_info("GET", PATH, ""), method="GET", path=PATH,
                             query="", headers=WireHeaders(pairs), policies=pset,
                             trace_id=f"c0ffee-f{serial:x}")
        status = chain.entry(ctx)  # as the relay does: await only when a hook had to wait
        if asyncio.iscoroutine(status):
            status = await status
        if status is not None:
            raise RuntimeError(f"the bench chain denied a call: {status.code} {status.message}")
        ctx.status_code, ctx.bytes_out = 200, 1100
        ctx.finished = time.monotonic()
        waiting = chain.exit(ctx)
        if waiting is not None:
            await waiting

    for chain in chains:  # warm: the token verified, the lease taken, memos filled
        for _ in range(calls):
            await one(chain)
    out: list[list[float]] = [[] for _ in chains]
    for _ in range(batches):
        for runs, chain in zip(out, chains, strict=True):
            await asyncio.sleep(0.02)  # timers (batched writes, lease refills) run in between
            started = time.process_time()
            for _ in range(calls):
                await one(chain)
            runs.append((time.process_time() - started) / calls * 1e6)
    return out


async def measure(redis_url: str, *, batches: int, calls: int) -> list[tuple[str, float, float]]:
    with tempfile.TemporaryDirectory(prefix="chain-cost-") as tmp:
        middlewares, pset, token, audit_writer = build_chain(redis_url, Path(tmp))
        names = [str(getattr(m, "name", "?")) for m in middlewares]
        variants: list[tuple[str, Sequence[object]]] = [("full chain", middlewares),
                                                        ("no middleware", [])]
        variants += [(f"without {n}", [m for m in middlewares if m is not skip])
                     for n, skip in zip(names, middlewares, strict=True)]
        runs = await per_call([Chain(chosen) for _, chosen in variants], pset, token,
                              batches=batches, calls=calls)
        audit_writer.close()
        return [(label, min(r), statistics.median(r))
                for (label, _), r in zip(variants, runs, strict=True)]


def table(rows: list[tuple[str, float, float]]) -> str:
    full_min, full_median = rows[0][1], rows[0][2]
    lines = [f"{'chain':<22}{'µs/call (fastest)':>19}{'(median)':>10}{'cost (fastest)':>16}"
             f"{'(median)':>10}"]
    for label, fastest, median in rows:
        cost = ("" if label == "full chain"
                else f"{full_min - fastest:16.1f}{full_median - median:10.1f}")
        lines.append(f"{label:<22}{fastest:19.1f}{median:10.1f}{cost}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--redis-url", default=None)
    args = parser.parse_args()
    proc = None
    url = args.redis_url
    if url is None:
        proc, url = start_redis()
    try:
        rows = asyncio.run(measure(url, batches=args.batches, calls=args.calls))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
    print(table(rows))


if __name__ == "__main__":
    main()
