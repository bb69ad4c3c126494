"""Quota reservations in the in-process store: the reference operations, TTL expiry, settling.

``QUOTA_TABLE`` is the contract of ``reserve`` / ``settle``: tests/integration/test_quota_redis.py
runs the very same table through ``quota.lua`` on a real redis-server and expects the same
answers and the same live members, step by step.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.stores import build_store
from proxy.stores.base import Reservation, Reserved, StoreUnavailable, reserve_step, settle_step
from proxy.stores.breaker import ResilientStore
from proxy.stores.lease import LeasingStore
from proxy.stores.memory import MemoryStore

S = 1_000_000  # µs
SCOPE = "/configmaps/team-a"


def res(member: str, observed: int, limit: int, ttl: float = 10.0, *, seen: tuple[str, ...] = (),
        check_only: bool = False, scope: str = SCOPE) -> Reservation:
    return Reservation(scope=scope, member=member, observed=observed, limit=limit, ttl=ttl,
                       seen=seen, check_only=check_only)


# (µs from the start, operation, expected answer, live members after it)
# reserve -> (allowed, used); settle (scope, member, ttl) -> found
QUOTA_TABLE: list[tuple[int, str, Any, Any, tuple[str, ...]]] = [
    (0, "reserve", res("a|t1", 1, 3), (True, 1), ("a|t1",)),
    (0, "reserve", res("b|t2", 1, 3), (True, 2), ("a|t1", "b|t2")),
    (0, "reserve", res("c|t3", 1, 3), (False, 3), ("a|t1", "b|t2")),  # full: nothing added
    # the caller's watch shows "a" (observed 2): its reservation is not counted twice
    (1, "reserve", res("c|t3", 2, 3, seen=("a",)), (False, 3), ("a|t1", "b|t2")),
    (1, "reserve", res("c|t3", 1, 3, seen=("x", "a")), (True, 2), ("a|t1", "b|t2", "c|t3")),
    # a generateName reservation (no name) is "seen" only by its token
    (2, "reserve", res("|t4", 0, 9), (True, 3), ("a|t1", "b|t2", "c|t3", "|t4")),
    (2, "reserve", res("|t5", 1, 9, seen=("|t4",)), (True, 4),
     ("a|t1", "b|t2", "c|t3", "|t4", "|t5")),
    (2, "reserve", res("t4|x", 0, -1, seen=("t4",)), (True, 5),  # a name "t4" is not "|t4"
     ("a|t1", "b|t2", "c|t3", "|t4", "|t5", "t4|x")),
    # check only (dryRun): the answer, no member; limit -1: no limit
    (3, "reserve", res("d|t6", 0, 6, check_only=True), (False, 6),
     ("a|t1", "b|t2", "c|t3", "|t4", "|t5", "t4|x")),
    (3, "reserve", res("d|t6", 0, 7, check_only=True), (True, 6),
     ("a|t1", "b|t2", "c|t3", "|t4", "|t5", "t4|x")),
    # settle: drop (a failed create), cut to a shorter ttl, never lengthen, unknown member
    (4, "settle", (SCOPE, "b|t2", None), True, ("a|t1", "c|t3", "|t4", "|t5", "t4|x")),
    (4, "settle", (SCOPE, "b|t2", None), False, ("a|t1", "c|t3", "|t4", "|t5", "t4|x")),
    (4, "settle", (SCOPE, "a|t1", 0.5), True, ("a|t1", "c|t3", "|t4", "|t5", "t4|x")),
    (4, "settle", (SCOPE, "a|t1", 30.0), True, ("a|t1", "c|t3", "|t4", "|t5", "t4|x")),
    (4, "settle", (SCOPE, "|t4", 2.0), True, ("a|t1", "c|t3", "|t4", "|t5", "t4|x")),
    # a|t1 now expires at 4 + 0.5 s: gone at exactly that time (expiry <= now)
    (4 + S // 2, "reserve", res("e|t7", 0, 5), (True, 4),
     ("c|t3", "|t4", "|t5", "t4|x", "e|t7")),
    # |t4 at 4 + 2 s; the others at 10 s after their reserve
    (2 * S + 4, "reserve", res("f|t8", 0, -1, ttl=1), (True, 4),
     ("c|t3", "|t5", "t4|x", "e|t7", "f|t8")),
    (2 * S + 4, "settle", (SCOPE, "|t4", None), False, ("c|t3", "|t5", "t4|x", "e|t7", "f|t8")),
    (10 * S + 1, "reserve", res("g|t9", 0, 3, check_only=True), (False, 3),  # c|t3 just expired
     ("|t5", "t4|x", "e|t7")),
    (10 * S + 2, "reserve", res("g|t9", 0, 2), (True, 1), ("e|t7", "g|t9")),
    (10 * S + 2, "settle", (SCOPE, "c|t3", 5.0), False, ("e|t7", "g|t9")),  # expired: not found
    # scopes are apart
    (10 * S + 2, "reserve", res("a|u1", 0, 1, scope="/configmaps/team-b"), (True, 0),
     ("e|t7", "g|t9")),
    # the same name as a live reservation: the same object (an apply racing its create), no
    # more room needed and nothing added
    (10 * S + 2, "reserve", res("a|u2", 0, 1, scope="/configmaps/team-b"), (True, 1),
     ("e|t7", "g|t9")),
    (10 * S + 2, "reserve", res("b|u3", 0, 1, scope="/configmaps/team-b"), (False, 1),
     ("e|t7", "g|t9")),
    (30 * S, "reserve", res("h|t10", 0, 1), (True, 0), ("h|t10",)),
    (30 * S, "reserve", res("h|t11", 0, 1), (True, 1), ("h|t10",)),
    (30 * S, "reserve", res("h|t12", 0, 1, check_only=True), (True, 1), ("h|t10",)),
    (30 * S, "reserve", res("i|t13", 0, 1), (False, 1), ("h|t10",)),
    # a name the watch shows is counted in observed, not as this object's reservation
    (30 * S, "reserve", res("h|t14", 1, 1, seen=("h",)), (False, 1), ("h|t10",)),
    (30 * S, "reserve", res("|t15", 0, 2), (True, 1), ("h|t10", "|t15")),
    (30 * S, "reserve", res("|t16", 0, 2), (False, 2), ("h|t10", "|t15")),  # no name: apart
    # its creator's watch shows h: "~" marks it shown, renamed, never lengthened; found
    # marked or not by later settles
    (31 * S, "settle", (SCOPE, "h|t10~", 60.0), True, ("h|t10~", "|t15")),
    (31 * S, "settle", (SCOPE, "h|t10~", 5.0), True, ("h|t10~", "|t15")),
    (31 * S, "settle", (SCOPE, "h|t10", 30.0), True, ("h|t10~", "|t15")),
    (31 * S, "settle", (SCOPE, "|t15~", 5.0), True, ("h|t10~", "|t15~")),
    (31 * S, "settle", (SCOPE, "x|t0~", 5.0), False, ("h|t10~", "|t15~")),
    # h deleted ("/h" seen): its marked reservation is not counted; a new one of h is, and
    # an unmarked one of a deleted name is (a create of it again, on its way)
    (32 * S, "reserve", res("h|t17", 0, 2, seen=("/h",)), (True, 1),
     ("h|t10~", "|t15~", "h|t17")),
    (32 * S, "reserve", res("k|t18", 0, 3, seen=("/h",)), (True, 2),
     ("h|t10~", "|t15~", "h|t17", "k|t18")),
    (32 * S, "reserve", res("m|t19", 0, 3, seen=("/h", "/k")), (False, 3),
     ("h|t10~", "|t15~", "h|t17", "k|t18")),
    (32 * S, "reserve", res("m|t19", 0, 3, seen=("/h", "h")), (True, 2),  # h shown again
     ("h|t10~", "|t15~", "h|t17", "k|t18", "m|t19")),
    (32 * S, "settle", (SCOPE, "h|t10", None), True,  # a marked member dropped by its name
     ("|t15~", "h|t17", "k|t18", "m|t19")),
    (36 * S, "reserve", res("n|t20", 0, -1, check_only=True), (True, 3),  # |t15~ expired
     ("h|t17", "k|t18", "m|t19")),
]


def run_memory_table(store: MemoryStore, t0: float) -> list[tuple[Any, tuple[str, ...]]]:
    out = []
    for at, op, args, _, _ in QUOTA_TABLE:
        now = t0 + at
        if op == "reserve":
            got = store.reserve_now(args, now=now)
            answer: Any = (got.allowed, got.used)
        else:
            answer = store.settle_now(*args, now=now)
        out.append((answer, tuple(store.reservations(SCOPE, now=now))))
    return out


def test_memory_table() -> None:
    store = MemoryStore()
    results = run_memory_table(store, 5_000.0 * S)
    for (at, op, _, answer, live), (got, got_live) in zip(QUOTA_TABLE, results, strict=True):
        assert (got, sorted(got_live)) == (answer, sorted(live)), (at, op)


def test_reference_steps() -> None:
    members: dict[str, float] = {"a|1": 100.0, "|2": 50.0}
    assert reserve_step(members, 50.0, res("b|3", 0, 3, ttl=1e-6)) == (True, 1)  # |2 expired
    assert members == {"a|1": 100.0, "b|3": 51.0}
    assert settle_step(members, 60.0, "b|3", 10) is False  # expired on its own
    assert settle_step(members, 60.0, "a|1", 10 / S) is True and members["a|1"] == 70.0
    assert settle_step(members, 60.0, "a|1", None) is True and members == {}


def test_ttl_expiry_on_the_clock() -> None:
    class Clock:
        now = 1000.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    store = MemoryStore(clock=clock)
    assert store.reserve_now(res("a|1", 0, 1, ttl=60)).allowed
    assert not store.reserve_now(res("b|2", 0, 1, ttl=60)).allowed
    clock.now += 59.9
    assert not store.reserve_now(res("b|2", 0, 1, ttl=60)).allowed
    clock.now += 0.1  # a crashed replica's reservation ends by itself
    assert store.reserve_now(res("b|2", 0, 1, ttl=60)).allowed
    clock.now += 61
    store.acquire_now([])  # the sweep forgets empty scopes too
    assert store.reservations(SCOPE) == {}


def test_async_api_and_leasing_passes_through() -> None:
    async def go() -> tuple[Reserved, Reserved]:
        store = LeasingStore(MemoryStore(), lease_all=True)
        first = await store.reserve(res("a|1", 0, 1))
        await store.settle(SCOPE, "a|1", None)
        return first, await store.reserve(res("b|2", 0, 1))

    first, second = asyncio.run(go())
    assert first.allowed and second.allowed and second.used == 0


class Flaky:
    """A primary that fails while ``down``."""

    def __init__(self) -> None:
        self.down = False
        self.inner = MemoryStore()
        self.settled: list[tuple[str, float | None]] = []

    async def reserve(self, request: Reservation) -> Reserved:
        if self.down:
            raise StoreUnavailable("down")
        return Reserved(**{**_fields(await self.inner.reserve(request)), "backend": "redis"})

    async def settle(self, scope: str, member: str, ttl: float | None) -> None:
        if self.down:
            raise StoreUnavailable("down")
        self.settled.append((member, ttl))
        await self.inner.settle(scope, member, ttl)

    async def ping(self) -> bool:
        return not self.down

    def health(self) -> dict[str, object]:
        return {}

    async def close(self) -> None:
        return None


def _fields(r: Reserved) -> dict[str, Any]:
    return {"allowed": r.allowed, "used": r.used, "backend": r.backend,
            "unavailable": r.unavailable}


def test_breaker_falls_back_to_local_reservations_and_recovers() -> None:
    class Clock:
        now = 0.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    flaky = Flaky()

    async def go() -> None:
        store = ResilientStore(flaky, failures=1, reset_after=1.0, clock=clock)  # type: ignore[arg-type]
        got = await store.reserve(res("a|1", 0, 2))
        assert (got.allowed, got.backend) == (True, "redis")
        flaky.down = True
        got = await store.reserve(res("b|2", 0, 2))  # fails: falls back, circuit opens
        assert (got.allowed, got.used, got.backend) == (True, 0, "fallback")
        assert store.breaker.state == "open"
        closed = await store.reserve(Reservation(SCOPE, "c|3", 0, 2, 10, fail_open=False))
        assert (closed.allowed, closed.unavailable) == (False, True)
        await store.settle(SCOPE, "b|2", None)  # the local one goes; Redis is not asked
        assert store.fallback.reservations(SCOPE) == {}
        flaky.down = False
        clock.now += 1.0
        got = await store.reserve(res("d|4", 0, 2))  # probe due: still local this once
        assert got.backend == "fallback"
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert store.breaker.state == "closed"
        got = await store.reserve(res("e|5", 0, 2))
        assert (got.allowed, got.used, got.backend) == (True, 1, "redis")  # a|1 still there
        await store.settle(SCOPE, "a|1", 5.0)
        assert flaky.settled == [("a|1", 5.0)]

    asyncio.run(go())


def test_build_store_without_redis_reserves_in_process() -> None:
    store = build_store(redis_url=None)
    got = asyncio.run(store.reserve(res("a|1", 0, 1)))
    assert (got.allowed, got.backend) == (True, "local")


@pytest.mark.parametrize("member, seen, counted", [
    ("a|1", (), True), ("a|1", ("a",), False), ("a|1", ("|1",), False), ("|1", ("",), True),
    ("|1", ("|1",), False), ("a|1", ("|a",), True)])
def test_which_members_count(member: str, seen: tuple[str, ...], counted: bool) -> None:
    members = {member: 10.0 * S}
    assert reserve_step(members, 0.0, res("z|9", 0, -1, seen=seen, check_only=True))[1] == int(
        counted)
