"""Token leasing: serve hot keys from tokens taken ahead from the shared store.

One Redis round trip per request is the price of an exact shared limit. For keys marked
``lease`` (per rule, or every key with ``lease_all``), a refill asks for the token it needs plus
up to ``extra`` more, sized from this replica's observed rate (``window`` seconds of demand),
capped by ``rate·window``, by ``burst / (2·replicas)`` and by ``max_lease``. The script grants
extras only out of the upper half of what the bucket holds, so near the limit every call takes
exactly one token and decisions stay exact. Leased tokens were charged in Redis when taken, so
all replicas together still never admit more than ``burst + qps·t``; what a lease can cost is
under-admission, bounded by the tokens a replica holds when it stops or when its lease expires
(``ttl``). The default ``window`` is half a second: at an operator's usual tens of calls per
second a key costs about two refills a second instead of one every few calls (at 50 calls/s, a
0.1 s window meant a round trip for one call in five: ~6% more CPU per call and a higher p99,
bench/README.md), and the caps above bound what it holds all the same. Refills run one at a
time per key (others wait for it, and fail with it when the store does: no call waits longer
than one store timeout for its answer), and a denied key is answered locally until its
Retry-After (and so is a key whose last token was just taken, until the next one is due), so a
throttled hot key costs about one Redis call per admitted request and none for the requests it
rejects.

A lease is refilled ahead: when a call leaves it a quarter or less of what its last refill
gave, a refill for the key runs in the background (one at a time per key, like every refill)
while calls go on taking the tokens left, so at a steady rate no call waits for Redis. It asks
for extras only (``cost`` 0), which the script grants out of the upper half of the bucket like
any extras: near the limit it gets none, and calls go back to one exact decision each. The
tokens left when it lands share the new lease's expiry.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from proxy.stores.base import (
    US,
    BucketRequest,
    Held,
    KeyVerdict,
    Reservation,
    Reserved,
    Store,
    StoreUnavailable,
    Verdict,
    interval_us,
)

__all__ = ["LeasingStore"]

log = logging.getLogger("opgate.ratelimit.store")


@dataclass(slots=True)
class _Lease:
    tokens: int = 0
    expires: float = 0.0
    remaining: int = 0  # the bucket's remaining tokens after the last refill (for headers)
    reset_at: float = 0.0
    hits: int = 0  # requests seen since ``since``, for the rate estimate
    since: float = 0.0
    rate: float = 0.0  # estimated local demand, requests/s
    low: int = 0  # refill ahead once a call leaves this many tokens or fewer


class LeasingStore:
    """Wraps a shared store; only requests with ``lease`` (or all, ``lease_all``) are leased."""

    def __init__(
        self, inner: Store, *, replicas: int = 1, window: float = 0.5, ttl: float = 1.0,
        max_lease: int = 1000, lease_all: bool = False, ahead: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.inner = inner
        self.replicas = max(1, replicas)
        self.window = window
        self.ttl = ttl
        self.max_lease = max_lease
        self.lease_all = lease_all
        self.ahead = ahead  # refill leases ahead of demand (see the module's docstring)
        self._clock = clock
        self._leases: dict[str, _Lease] = {}
        # key -> (until, the denial, the rate and burst it was answered for: a reload that
        # changes them is answered afresh, not by a Retry-After of the old rate)
        self._denied: dict[str, tuple[float, KeyVerdict, float, int]] = {}
        # key -> its refill in flight; the future's result is the refill's StoreUnavailable
        # (None when it answered): who waited for it fails with it, not after a try of its own
        self._inflight: dict[str, asyncio.Future[StoreUnavailable | None]] = {}
        self._ahead: set[asyncio.Task[None]] = set()  # refills running ahead of demand
        self._next_sweep = 0.0
        self.local_hits = 0
        self.refills_ahead = 0  # (for tests and benchmarks)

    @property
    def backend(self) -> str:
        return str(getattr(self.inner, "backend", "redis"))

    def _leased(self, r: BucketRequest) -> bool:
        return r.lease or self.lease_all

    async def acquire(self, requests: Sequence[BucketRequest]) -> Verdict:
        if not self.lease_all:
            for r in requests:
                if r.lease:
                    break
            else:
                return await self.inner.acquire(requests)
        if len(requests) == 1 and not self._denied:
            served = self._serve_one(requests[0])
            if served is not None:
                return served
        while True:
            now = self._clock()
            if now >= self._next_sweep:
                self._sweep(now)
            if self._denied:
                cached = self._cached_denial(requests, now)
                if cached is not None:
                    return cached
            local, remote = self._reserve(requests, now)
            if not remote:
                self.local_hits += 1
                return self._local_verdict(requests, now)
            busy = [self._inflight[r.key] for r in remote if r.key in self._inflight]
            if not busy:
                return await self._refill(requests, local, remote, now)
            self._unreserve(requests, local)
            for r in requests:  # this pass is retried: count its demand once
                if self._leased(r):
                    self._leases[r.key].hits -= 1
            await asyncio.wait([asyncio.shield(f) for f in busy])
            for f in busy:  # the store failed it just now: each waiter trying in turn would
                failed = f.result()  # wait one timeout per caller ahead of it
                if failed is not None:
                    raise StoreUnavailable(str(failed)) from failed

    def take_local(self, r: BucketRequest) -> Held | None:
        """A token this replica holds for one leased request, taken without a round trip:
        ``(remaining, reset)`` of the answer ``acquire([r])`` would give (allowed, the
        :meth:`_lease_verdict`), with the same bookkeeping; ``None`` (nothing changed but the
        sweep) when ``acquire`` must decide (no lease, too few tokens, a cached denial, or not
        a leased request)."""
        if self._denied or not (r.lease or self.lease_all):
            return None
        now = self._clock()
        if now >= self._next_sweep:
            self._sweep(now)
        lease = self._leases.get(r.key)
        if lease is None:
            return None
        if lease.expires <= now:
            lease.tokens = 0
        if lease.tokens < r.cost:
            return None
        lease.hits += 1
        lease.tokens -= r.cost
        self.local_hits += 1
        if lease.tokens <= lease.low and r.key not in self._inflight:
            self._refill_ahead(r, now)
        # _lease_verdict inlined, on the lease already at hand (no second lookup, no KeyVerdict)
        reset = lease.reset_at - now
        return lease.remaining + lease.tokens, reset if reset > 0.0 else 0.0

    def _serve_one(self, r: BucketRequest) -> Verdict | None:
        """:meth:`take_local` as ``acquire``'s first step for one request (the hot path)."""
        held = self.take_local(r)
        if held is None:
            return None
        key = KeyVerdict(allowed=True, remaining=held[0], reset=held[1])
        return Verdict(allowed=True, keys=(key,), backend="lease")

    def _cached_denial(self, requests: Sequence[BucketRequest], now: float) -> Verdict | None:
        hit = False
        keys: list[KeyVerdict] = []
        for r in requests:
            entry = self._denied.get(r.key) if self._leased(r) else None
            if entry is not None and entry[0] > now and entry[2:] == (r.rate, r.burst):
                hit = True
                keys.append(replace(entry[1], retry_after=entry[0] - now))
            else:
                if entry is not None:
                    del self._denied[r.key]
                keys.append(KeyVerdict(allowed=True, remaining=r.burst))
        return Verdict(allowed=False, keys=tuple(keys), backend="lease") if hit else None

    def _reserve(
        self, requests: Sequence[BucketRequest], now: float
    ) -> tuple[list[int], list[BucketRequest]]:
        """Take local tokens where a live lease has enough; the rest must ask the store."""
        local: list[int] = []
        remote: list[BucketRequest] = []
        for index, r in enumerate(requests):
            if not self._leased(r):
                remote.append(r)
                continue
            lease = self._leases.get(r.key)
            if lease is None:
                lease = self._leases[r.key] = _Lease(since=now)
            lease.hits += 1
            if lease.expires <= now:
                lease.tokens = 0
            if lease.tokens >= r.cost:
                lease.tokens -= r.cost
                local.append(index)
                if lease.tokens <= lease.low and r.key not in self._inflight:
                    self._refill_ahead(r, now)
            else:
                remote.append(r)
        return local, remote

    def _unreserve(self, requests: Sequence[BucketRequest], local: list[int]) -> None:
        for index in local:
            r = requests[index]
            self._leases.setdefault(r.key, _Lease()).tokens += r.cost

    def _extra(self, r: BucketRequest, now: float) -> int:
        lease = self._leases.setdefault(r.key, _Lease(since=now))
        elapsed = now - lease.since
        if elapsed > 0:
            observed = lease.hits / elapsed
            lease.rate = observed if lease.rate == 0 else 0.5 * lease.rate + 0.5 * observed
        lease.hits, lease.since = 0, now
        size = min(
            math.ceil(lease.rate * self.window),
            math.floor(r.rate * self.window),
            math.floor(r.burst / (2 * self.replicas)),
            self.max_lease,
        )
        return max(0, size - r.cost)

    async def _refill(
        self, requests: Sequence[BucketRequest], local: list[int],
        remote: list[BucketRequest], now: float,
    ) -> Verdict:
        loop = asyncio.get_running_loop()
        mine: dict[str, asyncio.Future[StoreUnavailable | None]] = {}
        failed: StoreUnavailable | None = None
        asked: list[BucketRequest] = []
        for r in remote:
            if self._leased(r):
                mine[r.key] = self._inflight[r.key] = loop.create_future()
                asked.append(replace(r, extra=self._extra(r, now)))
            else:
                asked.append(r)
        try:
            verdict = await self.inner.acquire(asked)
        except BaseException as exc:  # (a cancelled caller's waiters go on and ask themselves)
            self._unreserve(requests, local)
            failed = exc if isinstance(exc, StoreUnavailable) else None
            raise
        finally:
            for key, future in mine.items():
                del self._inflight[key]
                future.set_result(failed)
        return self._merge(requests, local, asked, verdict)

    def _merge(
        self, requests: Sequence[BucketRequest], local: list[int],
        asked: list[BucketRequest], verdict: Verdict,
    ) -> Verdict:
        now = self._clock()
        answers = dict(zip((r.key for r in asked), verdict.keys, strict=True))
        if not verdict.allowed:
            self._unreserve(requests, local)
            for r in asked:
                answer = answers[r.key]
                if self._leased(r) and not answer.allowed and answer.retry_after > 0:
                    self._denied[r.key] = (now + answer.retry_after, answer, r.rate, r.burst)
            keys = tuple(answers.get(r.key, KeyVerdict(True, r.burst)) for r in requests)
            return replace(verdict, keys=keys)
        for r in asked:
            answer = answers[r.key]
            if self._leased(r):
                lease = self._leases.setdefault(r.key, _Lease(since=now))
                self._grant(lease, answer, now)
                if answer.remaining <= 0 and lease.tokens < r.cost:
                    # that was the last token: the next one is a known time away (the same
                    # retry-after the store would answer), so don't ask before then
                    wait = answer.reset - (r.burst - 1) * interval_us(r.rate) / US
                    if wait > 0:
                        self._denied[r.key] = (now + wait, KeyVerdict(False, 0, wait, answer.reset),
                                               r.rate, r.burst)
        keys = tuple(
            answers[r.key] if r.key in answers else self._lease_verdict(r, now) for r in requests
        )
        return replace(verdict, keys=keys)

    def _refill_ahead(self, r: BucketRequest, now: float) -> None:
        """Start a background refill of ``r``'s lease (see the module's docstring); callers
        that find the lease empty meanwhile wait for it as for any refill in flight."""
        if not self.ahead:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside the event loop: no refill without one
            return
        extra = self._extra(r, now) + r.cost
        if extra <= 0:
            return
        self._inflight[r.key] = done = loop.create_future()
        ask = replace(r, cost=0, extra=extra)
        task = loop.create_task(self._run_ahead(ask, done))
        self._ahead.add(task)
        task.add_done_callback(self._ahead.discard)

    async def _run_ahead(
        self, ask: BucketRequest, done: asyncio.Future[StoreUnavailable | None]
    ) -> None:
        answer: KeyVerdict | None = None
        failed: StoreUnavailable | None = None
        try:
            verdict = await self.inner.acquire([ask])
            answer = verdict.keys[0] if verdict.allowed else None
        except Exception as exc:  # the calls that waited for it fail (and feed the breaker);
            log.debug("refill ahead of %s failed: %s", ask.key, exc)  # the next one asks
            failed = exc if isinstance(exc, StoreUnavailable) else None
        finally:
            if self._inflight.get(ask.key) is done:
                del self._inflight[ask.key]
            done.set_result(failed)
        lease = self._leases.get(ask.key)
        if lease is None:  # forgotten meanwhile (an outage ended): what was granted lapses
            return
        if answer is None or not answer.granted:  # near the limit, or no store: none ahead until
            lease.low = -1  # the next refill in line
            return
        now = self._clock()
        if lease.expires <= now:
            lease.tokens = 0
        self._grant(lease, answer, now)
        self.refills_ahead += 1

    def _grant(self, lease: _Lease, answer: KeyVerdict, now: float) -> None:
        """Add what a refill got to ``lease``: its tokens, their expiry, the bucket's state
        for the headers, and the level at which the next refill starts ahead."""
        lease.tokens += answer.granted
        lease.low = lease.tokens // 4
        lease.expires = now + self.ttl
        lease.remaining = answer.remaining
        lease.reset_at = now + answer.reset

    def _lease_verdict(self, r: BucketRequest, now: float) -> KeyVerdict:
        lease = self._leases.get(r.key) or _Lease()
        return KeyVerdict(allowed=True, remaining=lease.remaining + lease.tokens,
                          reset=max(0.0, lease.reset_at - now))

    def _local_verdict(self, requests: Sequence[BucketRequest], now: float) -> Verdict:
        if len(requests) == 1:
            keys: tuple[KeyVerdict, ...] = (self._lease_verdict(requests[0], now),)
        else:
            keys = tuple([self._lease_verdict(r, now) for r in requests])
        return Verdict(allowed=True, keys=keys, backend="lease")

    def _sweep(self, now: float) -> None:
        """Forget idle leases and lapsed denials so memory follows the set of hot keys."""
        idle = now - 10 * self.ttl
        self._leases = {k: v for k, v in self._leases.items()
                        if v.expires > now or v.since > idle or k in self._inflight}
        self._denied = {k: v for k, v in self._denied.items() if v[0] > now}
        self._next_sweep = now + 5 * self.ttl

    async def reserve(self, request: Reservation) -> Reserved:
        """Quota reservations are never leased: straight to the shared store."""
        return await self.inner.reserve(request)

    async def settle(self, scope: str, member: str, ttl: float | None) -> None:
        await self.inner.settle(scope, member, ttl)

    def forget(self) -> None:
        """Drop every lease and cached denial (after an outage: the store's view wins again)."""
        self._leases.clear()
        self._denied.clear()

    async def ping(self) -> bool:
        ping = getattr(self.inner, "ping", None)
        return bool(await ping()) if ping is not None else True

    def health(self) -> dict[str, object]:
        inner = self.inner.health()
        return {**inner, "leased_keys": len(self._leases), "throttled_keys": len(self._denied)}

    async def close(self) -> None:
        for task in list(self._ahead):
            task.cancel()
        if self._ahead:
            await asyncio.wait(self._ahead)
        await self.inner.close()
