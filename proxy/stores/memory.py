"""The in-process rate-limit backend: GCRA buckets in a dict, one process's view only.

Used when no Redis is configured (one replica), as the fallback while Redis is unreachable
(rules with ``failure: open`` then run at ``qps / replicas``), and by the unit tests. The
arithmetic is :func:`proxy.stores.base.decide`, the same as ``gcra.lua``; the clock is
injectable (a function returning seconds, monotonic by default) so tests control time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from proxy.stores.base import (
    US,
    BucketRequest,
    KeyVerdict,
    Verdict,
    decide,
    gcra_step,
    interval_us,
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
            ok, tat, granted, remaining, retry, reset = gcra_step(
                self._tats.get(r.key, 0.0), at, interval=interval_us(r.rate), burst=r.burst,
                cost=r.cost, extra=r.extra)
            if ok:
                self._tats[r.key] = tat
            if at >= self._next_sweep:
                self._sweep(at)
            key = KeyVerdict(allowed=ok, remaining=int(remaining), retry_after=retry / US,
                             reset=reset / US, granted=int(granted) if ok else 0)
            return Verdict(allowed=ok, keys=(key,), backend=self.backend)
        allowed, results, pending = decide(self._tats, requests, at)
        if allowed:
            self._tats.update(pending)
        if at >= self._next_sweep:
            self._sweep(at)
        return verdict_from(allowed, results, backend=self.backend)

    def _sweep(self, now: float) -> None:
        """Forget buckets that are full again (TAT passed): same outcome, bounded memory."""
        self._tats = {k: v for k, v in self._tats.items() if v > now}
        self._next_sweep = now + SWEEP_EVERY_US

    def __len__(self) -> int:
        return len(self._tats)

    def health(self) -> dict[str, object]:
        return {"backend": self.backend, "buckets": len(self._tats)}

    async def close(self) -> None:
        self._tats.clear()
