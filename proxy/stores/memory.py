"""The in-process backend: GCRA buckets and quota reservations in dicts, one process's view only.

Used when no Redis is configured (one replica), as the fallback while Redis is unreachable
(rules with ``failure: open`` then run at ``qps / replicas``), and by the unit tests. The
arithmetic is :func:`proxy.stores.base.decide`, the same as ``gcra.lua``; the clock is
injectable (a function returning seconds, monotonic by default) so tests control time.
Quota reservations follow :func:`proxy.stores.base.reserve_step` / :func:`settle_step`, the
same operations as ``quota.lua``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from proxy.stores.base import (
    US,
    BucketRequest,
    KeyVerdict,
    Reservation,
    Reserved,
    Verdict,
    decide,
    gcra_step,
    interval_us,
    reserve_step,
    settle_step,
    verdict_from,
)

__all__ = ["MemoryStore"]

SWEEP_EVERY_US = 5 * US


class MemoryStore:
    """GCRA buckets in this process. Thread-unsafe by design: one event loop owns it."""

    backend = "local"

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tats: dict[str, float] = {}
        self._reserved: dict[str, dict[str, float]] = {}  # scope -> member -> expiry (µs)
        self._next_sweep = 0.0
        self.calls = 0

    def now_us(self) -> float:
        return float(round(self._clock() * US))

    async def acquire(self, requests: Sequence[BucketRequest], now: float | None = None) -> Verdict:
        """Decide ``requests`` all-or-nothing; ``now`` (µs) overrides the clock (tests)."""
        return self.acquire_now(requests, now)

    def acquire_now(self, requests: Sequence[BucketRequest], now: float | None = None) -> Verdict:
        """The synchronous core of :meth:`acquire` (nothing here ever waits)."""
        self.calls += 1
        at = self.now_us() if now is None else float(now)
        if len(requests) == 1:  # the common case: decide() and verdict_from() for one bucket
            r = requests[0]
            stored = self._tats.get(r.key, 0.0)
            ok, tat, granted, remaining, retry, reset = gcra_step(
                stored, at, interval=interval_us(r.rate), burst=r.burst, cost=r.cost,
                extra=r.extra)
            if ok or tat < stored:  # charged, or a debt cut to the bucket's depth (gcra_step)
                self._tats[r.key] = tat
            if at >= self._next_sweep:
                self._sweep(at)
            key = KeyVerdict(allowed=ok, remaining=int(remaining), retry_after=retry / US,
                             reset=reset / US, granted=int(granted) if ok else 0)
            return Verdict(allowed=ok, keys=(key,), backend=self.backend)
        allowed, results, writes = decide(self._tats, requests, at)
        self._tats.update(writes)
        if at >= self._next_sweep:
            self._sweep(at)
        return verdict_from(allowed, results, backend=self.backend)

    def _sweep(self, now: float) -> None:
        """Forget buckets that are full again (TAT passed) and expired reservations: same
        outcome, bounded memory."""
        self._tats = {k: v for k, v in self._tats.items() if v > now}
        for scope, members in list(self._reserved.items()):
            live = {m: e for m, e in members.items() if e > now}
            if live:
                self._reserved[scope] = live
            else:
                del self._reserved[scope]
        self._next_sweep = now + SWEEP_EVERY_US

    # --- quota reservations ---------------------------------------------------------------

    async def reserve(self, request: Reservation, now: float | None = None) -> Reserved:
        return self.reserve_now(request, now)

    def reserve_now(self, request: Reservation, now: float | None = None) -> Reserved:
        """Admit and reserve in one step (nothing here ever waits); ``now`` in µs (tests)."""
        at = self.now_us() if now is None else float(now)
        members = self._reserved.setdefault(request.scope, {})
        allowed, used = reserve_step(members, at, request)
        if not members:
            del self._reserved[request.scope]
        if at >= self._next_sweep:
            self._sweep(at)
        return Reserved(allowed=allowed, used=used, backend=self.backend)

    async def settle(self, scope: str, member: str, ttl: float | None,
                     now: float | None = None) -> None:
        self.settle_now(scope, member, ttl, now)

    def settle_now(self, scope: str, member: str, ttl: float | None,
                   now: float | None = None) -> bool:
        members = self._reserved.get(scope)
        if members is None:
            return False
        found = settle_step(members, self.now_us() if now is None else float(now), member, ttl)
        if not members:
            del self._reserved[scope]
        return found

    def reservations(self, scope: str, now: float | None = None) -> dict[str, float]:
        """The live members of ``scope`` and their expiries (µs): for tests and health."""
        at = self.now_us() if now is None else float(now)
        return {m: e for m, e in self._reserved.get(scope, {}).items() if e > at}

    def __len__(self) -> int:
        return len(self._tats)

    def health(self) -> dict[str, object]:
        return {"backend": self.backend, "buckets": len(self._tats)}

    async def close(self) -> None:
        self._tats.clear()
        self._reserved.clear()
