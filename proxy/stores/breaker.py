"""What the rate limiter does while the shared store is down, and how it finds its way back.

:class:`ResilientStore` wraps the shared backend with a circuit breaker. Each failed or timed-out
call counts; after ``failures`` in a row the circuit opens and no request waits on Redis any
more. While it is open every bucket request follows its rule's ``failure`` setting: ``open``
rules are decided by an in-process bucket at ``qps / replicas`` (``burst / replicas``), ``closed``
rules get an "unavailable" verdict (the middleware answers 503). Every ``reset_after`` seconds a
background probe (the store's ``ping``: for Redis a script call that writes, as decisions do, so
a Redis that answers but refuses writes stays "down") tries the store (half-open), whether calls
come or not; the first success closes the circuit, with no restart of anything. Transitions are
logged and counted (``opgate_redis_errors_total``, ``opgate_ratelimit_backend{backend}``), and
:meth:`ResilientStore.health` reports them.

Quota reservations share the breaker: while it is open (or when a call fails), a reservation
whose entries all have ``failure: open`` is admitted and reserved in-process (this replica's
reservations only, as without Redis), and one with a ``failure: closed`` entry is
"unavailable" (503). Settlements go to both tables (a member is only in one of them); while the
circuit is open the Redis one is skipped and its members expire by themselves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from proxy.engine import telemetry
from proxy.stores.base import (
    BucketRequest,
    Held,
    KeyVerdict,
    Reservation,
    Reserved,
    Store,
    StoreUnavailable,
    Verdict,
)
from proxy.stores.memory import MemoryStore

__all__ = ["CircuitBreaker", "ResilientStore", "set_backend_gauge"]

T = TypeVar("T")

log = logging.getLogger("opgate.ratelimit.store")

BACKENDS = ("redis", "local", "fallback")
MIN_PROBE_INTERVAL = 0.05  # seconds: the recovery loop never spins, whatever reset_after is


def set_backend_gauge(active: str) -> None:
    """``opgate_ratelimit_backend{backend}``: 1 for the backend in use, 0 for the others."""
    for name in BACKENDS:
        telemetry.RATELIMIT_BACKEND.labels(name).set(1 if name == active else 0)


class CircuitBreaker:
    """closed → (``failures`` in a row) → open → (``reset_after``) → half-open probe → closed."""

    def __init__(
        self, *, failures: int = 3, reset_after: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold = max(1, failures)
        self.reset_after = reset_after
        self.clock = clock
        self.state = "closed"  # the setter also sets ``closed``, the flag read per call
        self.consecutive = 0
        self.opened_at = 0.0
        self.last_error = ""
        self.trips = 0

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        self._state = value
        self.closed = value == "closed"

    def allows(self) -> bool:
        return self.closed

    def probe_due(self) -> bool:
        """True once per ``reset_after`` while open: the caller runs one probe."""
        if self.state == "open" and self.clock() - self.opened_at >= self.reset_after:
            self.state = "half-open"
            return True
        return False

    def success(self) -> bool:
        """Record a probe's success; True when this closed an open circuit."""
        self.consecutive = 0
        if self.state != "closed":
            self.state = "closed"
            return True
        return False

    def answered(self) -> None:
        """A call's success: the failures in a row start again from none while closed. A call
        sent while closed that a stalled Redis answers after the circuit opened closes
        nothing: recovery is the probe's (:meth:`success`), which also sets the backend gauge
        back, drops the leases and logs it; closed by that call, the circuit said ``redis``
        on ``/readyz`` and ``fallback`` in ``opgate_ratelimit_backend``, with no "back" line."""
        if self.closed:
            self.consecutive = 0

    def failure(self, error: str) -> bool:
        """Record a failure; True when this opened the circuit."""
        self.consecutive += 1
        self.last_error = error
        if self.state == "half-open" or (
            self.state == "closed" and self.consecutive >= self.threshold
        ):
            return self.open(error)
        return False

    def open(self, error: str) -> bool:
        """Open the circuit now (or again, after a failed probe); True when it was closed."""
        opened = self.state == "closed"
        self.state = "open"
        self.opened_at = self.clock()
        self.last_error = error
        self.trips += opened
        return opened


class ResilientStore:
    """A shared store behind a circuit breaker, with an in-process fallback for open rules."""

    def __init__(
        self, primary: Store, *, replicas: int = 1, failures: int = 3, reset_after: float = 1.0,
        fallback: MemoryStore | None = None, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.primary = primary
        self.fallback = fallback or MemoryStore(clock=clock)
        self.replicas = max(1, replicas)
        self.breaker = CircuitBreaker(failures=failures, reset_after=reset_after, clock=clock)
        # the primary's take_local, looked up once (not on every call)
        self._take_primary: Callable[[BucketRequest], Held | None] | None = getattr(
            primary, "take_local", None)
        self._probe: asyncio.Task[None] | None = None
        self._recovery: asyncio.Task[None] | None = None  # probes while open, calls or not
        set_backend_gauge("redis")

    @property
    def backend(self) -> str:
        return "redis" if self.breaker.allows() else "fallback"

    def take_local(self, r: BucketRequest) -> Held | None:
        """The primary's :meth:`~proxy.stores.lease.LeasingStore.take_local` while the breaker
        is closed (a leased token needs no round trip, so it tells nothing about the store's
        health); ``None`` otherwise."""
        take = self._take_primary
        return take(r) if take is not None and self.breaker.closed else None

    async def _primary(self, call: Callable[[], Awaitable[T]]) -> T | None:
        """``call()`` on the primary store while the breaker lets it through, counting the
        outcome; ``None`` when the breaker is open or the call failed (then the caller
        degrades). An open breaker past ``reset_after`` starts one probe."""
        if self.breaker.allows():
            try:
                result = await call()
            except StoreUnavailable as exc:
                if self.breaker.failure(str(exc)):
                    self._opened()
            else:
                self.breaker.answered()
                return result
        elif self.breaker.probe_due():
            self._probe = asyncio.get_running_loop().create_task(self._run_probe())
        return None

    async def acquire(self, requests: Sequence[BucketRequest]) -> Verdict:
        verdict = await self._primary(lambda: self.primary.acquire(requests))
        return verdict if verdict is not None else await self._degraded(requests)

    async def _degraded(self, requests: Sequence[BucketRequest]) -> Verdict:
        if not all(r.fail_open for r in requests):
            keys = tuple(KeyVerdict(allowed=r.fail_open, remaining=0) for r in requests)
            return Verdict(allowed=False, keys=keys, backend="fallback", unavailable=True)
        local = [
            replace(r, rate=r.rate / self.replicas, burst=max(1, r.burst // self.replicas),
                    extra=0, lease=False)
            for r in requests
        ]
        verdict = await self.fallback.acquire(local)
        return replace(verdict, backend="fallback")

    async def reserve(self, request: Reservation) -> Reserved:
        reserved = await self._primary(lambda: self.primary.reserve(request))
        if reserved is not None:
            return reserved
        if not request.fail_open:
            return Reserved(allowed=False, used=0, backend="fallback", unavailable=True)
        return replace(self.fallback.reserve_now(request), backend="fallback")

    async def settle(self, scope: str, member: str, ttl: float | None) -> None:
        self.fallback.settle_now(scope, member, ttl)
        if not self.breaker.allows():
            return  # its Redis members expire by themselves
        try:
            await self.primary.settle(scope, member, ttl)
        except StoreUnavailable as exc:
            if self.breaker.failure(str(exc)):
                self._opened()
        else:
            self.breaker.answered()

    async def _run_probe(self) -> None:
        ping = getattr(self.primary, "ping", None)
        error = ""
        try:
            ok = bool(await ping()) if ping is not None else True
        except StoreUnavailable as exc:  # why, as a failed decision says it
            ok, error = False, str(exc)
        except Exception as exc:  # a probe never takes anything down
            ok, error = False, f"{type(exc).__name__}: {exc}"
        if ok:
            self.breaker.success()
            forget = getattr(self.primary, "forget", None)
            if forget is not None:
                forget()
            set_backend_gauge("redis")
            log.warning("rate-limit store is back: deciding with Redis again")
        else:
            telemetry.REDIS_ERRORS.inc()
            error = error or "ping failed"
            if error != self.breaker.last_error:  # a new reason (refused, then a password)
                log.warning("rate-limit store still unavailable, now: %s", error)
            self.breaker.failure(error)

    def trip(self, error: str) -> None:
        """Open the circuit without waiting for calls to fail: a start-up probe found the store
        away. Calls take the policies' failure modes at once instead of each waiting for the
        store's timeout first, the backend gauge says ``fallback`` as ``/readyz`` says
        degraded, and the recovery probes close the circuit when the store answers. Not
        logged: the caller has said why."""
        if self.breaker.open(error):
            self._degrade()

    def _degrade(self) -> None:
        set_backend_gauge("fallback")
        if self._recovery is None or self._recovery.done():
            self._recovery = asyncio.get_running_loop().create_task(self._recover())

    def _opened(self) -> None:
        self._degrade()
        log.warning(
            "rate-limit store unavailable after %d failures (%s): failure=open rules use "
            "in-process buckets at qps/%d (and quotas in-process reservations), failure=closed "
            "rules and quotas answer 503; probing every %.1fs",
            self.breaker.consecutive, self.breaker.last_error, self.replicas,
            self.breaker.reset_after,
        )

    async def _recover(self) -> None:
        """Probe every ``reset_after`` while the circuit is open, also when no call comes (a
        controller that only watches): else ``/readyz`` and the backend gauge would say
        "fallback" long after Redis is back. A call that finds a probe due runs one too; one
        probe at a time (half-open)."""
        while not self.breaker.closed:
            await asyncio.sleep(max(self.breaker.reset_after, MIN_PROBE_INTERVAL))
            if self.breaker.probe_due():
                await self._run_probe()

    def health(self) -> dict[str, object]:
        b = self.breaker
        info: dict[str, Any] = {
            "backend": self.backend,
            "ok": b.state == "closed",
            "breaker": b.state,
            "consecutive_failures": b.consecutive,
            "trips": b.trips,
            "last_error": b.last_error,
            "replicas": self.replicas,
            "primary": self.primary.health(),
        }
        if b.state != "closed":
            info["degraded_seconds"] = round(b.clock() - b.opened_at, 3)
        return info

    async def close(self) -> None:
        for task in (self._probe, self._recovery):
            if task is not None and not task.done():
                task.cancel()
        await self.primary.close()
