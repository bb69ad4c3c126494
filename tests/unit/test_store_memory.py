"""The in-process GCRA store, token leasing over it, and the breaker's fallback (no Redis)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from proxy.engine import telemetry
from proxy.stores import build_store
from proxy.stores.base import (
    BucketRequest,
    KeyVerdict,
    StoreUnavailable,
    Verdict,
    gcra_step,
    interval_us,
)
from proxy.stores.breaker import CircuitBreaker, ResilientStore
from proxy.stores.lease import LeasingStore
from proxy.stores.memory import MemoryStore

US = 1_000_000


class Clock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def req(key: str = "k", rate: float = 10, burst: int = 3, **kw: object) -> BucketRequest:
    return BucketRequest(key=key, rate=rate, burst=burst, **kw)  # type: ignore[arg-type]


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_burst_then_one_token_per_interval() -> None:
    clock = Clock()
    store = MemoryStore(clock=clock)
    got = [store.acquire_now([req()]) for _ in range(4)]
    assert [v.allowed for v in got] == [True, True, True, False]
    assert [v.keys[0].remaining for v in got] == [2, 1, 0, 0]
    assert got[3].retry_after == pytest.approx(0.1)
    assert got[2].keys[0].reset == pytest.approx(0.3)  # until the bucket is full again
    clock.now += 0.099
    assert not store.acquire_now([req()]).allowed
    clock.now += 0.001
    assert store.acquire_now([req()]).allowed
    clock.now += 10  # long idle: never more than burst saved
    assert [store.acquire_now([req()]).allowed for _ in range(4)] == [True, True, True, False]


@pytest.mark.parametrize("tat, now, interval, burst, cost, extra, expected", [
    # a missing key (tat 0) is a full bucket
    (0, 1000, 100, 3, 1, 0, (True, 1100, 0, 2, 0, 100)),
    # tat in the future by two intervals: one token left
    (1200, 1000, 100, 3, 1, 0, (True, 1300, 0, 0, 0, 300)),
    # full: retry when the oldest token comes back
    (1300, 1000, 100, 3, 1, 0, (False, 1300, 0, 0, 100, 300)),
    # extra tokens: at most half of what would be left
    (0, 1000, 100, 10, 1, 100, (True, 1100 + 4 * 100, 4, 5, 0, 500)),
    (0, 1000, 100, 10, 1, 2, (True, 1100 + 2 * 100, 2, 7, 0, 300)),
    # near the limit: no extra at all (decisions stay exact)
    (1800, 1000, 100, 10, 1, 50, (True, 1900, 0, 1, 0, 900)),
    # negative cost = refund (never more than full)
    (1300, 1000, 100, 3, -2, 0, (True, 1100, 0, 2, 0, 100)),
    # cost larger than burst can never pass
    (0, 1000, 100, 3, 4, 0, (False, 1000, 0, 3, 100, 0)),
    # the rule's qps raised (or burst lowered) since: a debt deeper than this bucket holds is
    # an empty bucket, whose next token comes at the new rate, not when the old debt clears
    # (the store keeps that cut debt, denied or not: else the next token would stay one
    # interval away from every call until the old debt cleared)
    (1000 + 10 * 5000, 1000, 100, 3, 1, 0, (False, 1300, 0, 0, 100, 300)),
])
def test_gcra_step_table(
    tat: float, now: float, interval: float, burst: int, cost: int, extra: int,
    expected: tuple[object, ...],
) -> None:
    assert gcra_step(tat, now, interval=interval, burst=burst, cost=cost, extra=extra) == expected


def test_interval_rounding() -> None:
    assert interval_us(10) == 100_000
    assert interval_us(3) == 333_333
    assert interval_us(1e9) == 1


def test_all_or_nothing_and_duplicate_keys() -> None:
    clock = Clock()
    store = MemoryStore(clock=clock)
    wide, narrow = req("wide", burst=5), req("narrow", burst=1)
    assert store.acquire_now([wide, narrow]).allowed
    denied = store.acquire_now([wide, narrow])
    assert not denied.allowed
    assert [k.allowed for k in denied.keys] == [True, False]
    assert store.acquire_now([wide]).keys[0].remaining == 3  # charged once, not twice
    twice = store.acquire_now([req("d", burst=2), req("d", burst=2)])
    assert twice.allowed and twice.keys[1].remaining == 0
    assert not store.acquire_now([req("d", burst=2)]).allowed


def test_one_bucket_decides_as_the_general_path() -> None:
    """A single request takes a shortcut; it must answer what decide() + verdict_from() do."""
    import random

    from proxy.stores.base import decide, verdict_from

    rnd = random.Random(7)
    store, tats = MemoryStore(), {}
    now = 1_000_000.0
    for _ in range(3000):
        now += rnd.choice([0, 1, 50, 1000, 20_000, 400_000])
        r = req(rnd.choice("abc"), rate=rnd.choice([0.5, 3, 10, 1e4]), burst=rnd.randint(1, 6),
                cost=rnd.randint(1, 2), extra=rnd.choice([0, 0, 3]))
        allowed, results, writes = decide(tats, [r], now)
        tats.update(writes)  # the charges, or a debt cut to a bucket's new depth
        assert store.acquire_now([r], now=now) == verdict_from(allowed, results, backend="local")


def test_explicit_now_and_sweep() -> None:
    store = MemoryStore(clock=Clock())
    assert run(store.acquire([req("a", burst=1)], now=5 * US)).allowed
    assert not run(store.acquire([req("a", burst=1)], now=5 * US + 1)).allowed
    assert len(store) == 1
    store.acquire_now([req("b")], now=20 * US)  # past the sweep time; "a" is full again
    assert len(store) == 1
    assert store.health() == {"backend": "local", "buckets": 1}


class Remote:
    """A stand-in shared store: a MemoryStore that counts calls and can fail or stall."""

    backend = "redis"

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.tick = 0.0
        self.memory = MemoryStore(clock=clock)
        self.memory.backend = "redis"
        self.calls = 0
        self.failing = False
        self.delay = 0.0
        self.seen: list[list[BucketRequest]] = []

    async def acquire(self, requests: Sequence[BucketRequest]) -> Verdict:
        self.calls += 1
        self.clock.now += self.tick
        self.seen.append(list(requests))
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.failing:
            raise StoreUnavailable("down")
        return self.memory.acquire_now(requests)

    async def ping(self) -> bool:
        return not self.failing

    def health(self) -> dict[str, object]:
        return {"backend": "redis"}

    async def close(self) -> None:
        return None


def test_leasing_serves_hot_keys_locally_without_over_admitting() -> None:
    clock = Clock()
    remote = Remote(clock)
    store = LeasingStore(remote, window=0.1, clock=clock)
    hot = req("hot", rate=5000, burst=500, lease=True)
    throttled = req("throttled", rate=500, burst=50, lease=True)

    async def go(key: BucketRequest) -> int:
        admitted = 0
        for _ in range(2000):  # 2000 calls over 1 s of fake time
            clock.now += 0.0005
            admitted += (await store.acquire([key])).allowed
        return admitted

    assert run(go(hot)) == 2000  # under the limit: everything passes …
    assert remote.calls <= 2000 * 0.1  # … with few shared-store calls
    calls = remote.calls
    admitted = run(go(throttled))
    assert 500 <= admitted <= 50 + 500 * 1.0 + 1  # never over the limit
    # near the limit every call takes one token: one store call per admitted request at most
    assert remote.calls - calls <= admitted + 1
    assert store.health()["leased_keys"] == 2


def test_leasing_shortcut_for_one_request_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One leased request with tokens at hand skips the general loop: same verdicts, same state."""
    import random

    def replay(shortcut: bool) -> tuple[list[Verdict], list[tuple[object, ...]], int, int]:
        rnd, clock = random.Random(11), Clock()
        remote = Remote(clock)
        store = LeasingStore(remote, window=0.1, ttl=0.5, clock=clock)
        if not shortcut:
            monkeypatch.setattr(store, "_serve_one", lambda r: None)
        keys = [req("hot", rate=2000, burst=200, lease=True),
                req("warm", rate=50, burst=10, lease=True), req("plain", rate=100, burst=20)]
        verdicts = []
        for _ in range(4000):
            clock.now += rnd.choice([0.0, 0.0001, 0.001, 0.02, 0.3])
            picked = rnd.sample(keys, rnd.choice([1, 1, 1, 2]))
            verdicts.append(run(store.acquire(picked)))
        leases = sorted((k, v.tokens, v.expires, v.remaining, v.hits, v.rate)
                        for k, v in store._leases.items())
        return verdicts, leases, store.local_hits, remote.calls

    fast, slow = replay(True), replay(False)
    assert fast == slow
    assert fast[2] > 1000  # the shortcut was taken


def test_take_local_answers_what_acquire_would(monkeypatch: pytest.MonkeyPatch) -> None:
    """``take_local``'s ``(remaining, reset)`` is the allowed ``KeyVerdict`` the general
    ``acquire`` gives for the same call, with the same leases and counters afterwards; ``None``
    leaves the decision (and the state) to ``acquire``."""
    import random

    rnd, clock = random.Random(7), Clock()
    fast = LeasingStore(Remote(clock), window=0.1, ttl=0.5, ahead=False, clock=clock)
    slow = LeasingStore(Remote(clock), window=0.1, ttl=0.5, ahead=False, clock=clock)
    monkeypatch.setattr(slow, "_serve_one", lambda r: None)
    keys = [req("hot", rate=2000, burst=200, lease=True), req("cold", rate=15, burst=2, lease=True),
            req("plain", rate=100, burst=20)]
    held_calls = denied = 0
    for _ in range(3000):
        clock.now += 0.3 if rnd.random() < 0.01 else rnd.choice([0.0, 0.0001, 0.001, 0.02])
        r = keys[0] if rnd.random() < 0.9 else rnd.choice(keys[1:])
        expected = run(slow.acquire([r]))
        held = fast.take_local(r)
        if held is None:
            assert run(fast.acquire([r])) == expected
            denied += not expected.allowed
            continue
        held_calls += 1
        assert expected.allowed and expected.backend == "lease"
        assert expected.keys == (KeyVerdict(allowed=True, remaining=held[0], reset=held[1]),)
        assert held[1] >= 0.0
    assert held_calls > 1000 and denied > 10  # both paths were compared
    assert fast.local_hits == slow.local_hits
    assert ({k: (v.tokens, v.expires, v.remaining, v.reset_at, v.hits, v.rate)
             for k, v in fast._leases.items()}
            == {k: (v.tokens, v.expires, v.remaining, v.reset_at, v.hits, v.rate)
                for k, v in slow._leases.items()})


def test_leasing_caches_denials_until_retry_after() -> None:
    clock = Clock()
    remote = Remote(clock)
    store = LeasingStore(remote, clock=clock)
    cold = req("c", rate=1, burst=1, lease=True)
    assert run(store.acquire([cold])).allowed
    assert remote.calls == 1
    for _ in range(50):  # that was the last token: the next one is 1 s away
        verdict = run(store.acquire([cold]))
        assert not verdict.allowed and verdict.retry_after == pytest.approx(1.0)
    assert remote.calls == 1
    clock.now += 1.0
    assert run(store.acquire([cold])).allowed
    other = Remote(clock)  # another replica took the token: a real denial, then cached
    assert run(other.acquire([req("c2", rate=1, burst=1)])).allowed
    store = LeasingStore(other, clock=clock)
    for _ in range(10):
        assert not run(store.acquire([req("c2", rate=1, burst=1, lease=True)])).allowed
    assert other.calls == 2


def test_a_cached_denial_is_not_kept_for_a_bucket_whose_rate_changed() -> None:
    """A policy reload raises the rule's qps: the denial this replica cached at the old rate
    (its Retry-After 100 s away) must not answer for the new one."""
    clock = Clock()
    remote = Remote(clock)
    store = LeasingStore(remote, clock=clock)
    slow = req("r", rate=0.01, burst=1, lease=True)
    assert run(store.acquire([slow])).allowed
    assert not run(store.acquire([slow])).allowed  # cached: the next token is 100 s away
    fast = req("r", rate=100, burst=100, lease=True)
    denied = run(store.acquire([fast]))  # asked afresh: an empty bucket at the new rate
    assert not denied.allowed and denied.retry_after == pytest.approx(0.01)
    assert remote.calls == 2
    clock.now += 0.01  # one token at the new rate
    assert run(store.acquire([fast])).allowed


def test_leasing_one_refill_in_flight_per_key() -> None:
    clock = Clock()
    remote = Remote(clock)
    remote.delay = 0.01
    remote.tick = 0.01
    store = LeasingStore(remote, clock=clock)
    key = req("k", rate=100, burst=100, lease=True)

    async def go() -> list[bool]:
        return [v.allowed for v in await asyncio.gather(*(store.acquire([key]) for _ in range(20)))]

    assert all(run(go()))
    assert remote.calls < 20
    assert all(len(call) == 1 for call in remote.seen)


@pytest.mark.parametrize("ahead", [False, True])
def test_calls_waiting_on_a_refill_that_fails_fail_with_it(ahead: bool) -> None:
    """Redis stalls (every call times out) while 20 calls want a hot leased key: the ones
    waiting for the refill in flight (in line, or ahead of demand) fail when it does, instead
    of each trying Redis in turn after it: the last one waited 20 timeouts (2.5 s behind a
    50 ms --redis-timeout) for its 503."""
    import time

    clock = Clock()
    remote = Remote(clock)
    store = LeasingStore(remote, clock=clock)
    key = req("k", rate=100, burst=100, lease=True)

    async def go() -> tuple[list[object], float]:
        if ahead:  # 100 calls/s for half a second: this replica leases tokens
            for _ in range(50):
                clock.now += 0.01
                assert (await store.acquire([key])).allowed
                await asyncio.sleep(0)
            assert store._leases["k"].tokens > 0
        remote.failing, remote.delay = True, 0.05
        if ahead:  # the calls that leave the lease low start a refill ahead, which stalls
            while "k" not in store._inflight:
                assert store.take_local(key) is not None
            while store.take_local(key) is not None:  # and the lease runs dry meanwhile
                pass
        calls_before, start = remote.calls, time.monotonic()
        answers = await asyncio.gather(*(store.acquire([key]) for _ in range(20)),
                                       return_exceptions=True)
        return [remote.calls - calls_before, *answers], time.monotonic() - start

    (calls, *answers), elapsed = run(go())
    assert all(isinstance(a, StoreUnavailable) for a in answers), answers
    assert calls == 1  # the refill they all waited for: none tried Redis after it
    assert elapsed < 0.05 * 20  # (a generous bound: each in turn took 20 timeouts, and more)


def test_non_leased_requests_go_straight_through() -> None:
    clock = Clock()
    remote = Remote(clock)
    store = LeasingStore(remote, clock=clock)
    for _ in range(5):
        run(store.acquire([req("x", rate=1000, burst=1000)]))
    assert remote.calls == 5
    assert all(r.extra == 0 for call in remote.seen for r in call)


def test_breaker_opens_falls_back_and_recovers() -> None:
    clock = Clock()
    remote = Remote(clock)
    store = ResilientStore(remote, replicas=2, failures=3, reset_after=1.0, clock=clock)
    errors_before = telemetry.REDIS_ERRORS._value.get()  # type: ignore[attr-defined]

    async def go() -> None:
        opened = req("o", rate=10, burst=4, fail_open=True)
        closed = req("c", rate=10, burst=4, fail_open=False)
        assert (await store.acquire([opened])).backend == "redis"
        remote.failing = True
        # each failure falls back to in-process buckets at qps/replicas, burst/replicas (2)
        got = [await store.acquire([opened]) for _ in range(3)]
        assert [v.allowed for v in got] == [True, True, False]
        assert {v.backend for v in got} == {"fallback"}
        assert got[2].retry_after == pytest.approx(0.2)  # 10 qps / 2 replicas
        assert store.breaker.state == "open" and remote.calls == 4
        assert not (await store.acquire([opened])).allowed
        assert remote.calls == 4  # open: no request waits on the shared store any more
        clock.now += 0.2
        assert (await store.acquire([opened])).allowed
        down = await store.acquire([closed, opened])
        assert down.unavailable and not down.allowed
        assert store.health()["backend"] == "fallback"
        assert telemetry.RATELIMIT_BACKEND.labels("fallback")._value.get() == 1  # type: ignore[attr-defined]
        clock.now += 1.0  # half-open: one background probe
        await store.acquire([opened])
        await asyncio.sleep(0)
        assert store.breaker.state == "open"  # probe failed: still down
        remote.failing = False
        clock.now += 1.0
        await store.acquire([opened])
        await asyncio.sleep(0)
        assert store.breaker.state == "closed"
        verdict = await store.acquire([closed])
        assert verdict.allowed and verdict.backend == "redis"
        assert store.health()["ok"] is True

    run(go())
    # the failed probe counts (the primary's own errors are counted by RedisStore itself)
    assert telemetry.REDIS_ERRORS._value.get() == errors_before + 1  # type: ignore[attr-defined]


def test_breaker_counts_consecutive_failures_only() -> None:
    breaker = CircuitBreaker(failures=3, clock=Clock())
    assert not breaker.failure("x") and not breaker.failure("x")
    breaker.success()
    assert not breaker.failure("x") and not breaker.failure("x")
    assert breaker.failure("x") and breaker.state == "open"


def test_breaker_closed_flag_follows_its_state() -> None:
    """``closed`` (what ``allows`` and the leased-token path read) is ``state == "closed"``
    through every transition, and when the state is set directly."""
    clock = Clock()
    breaker = CircuitBreaker(failures=1, reset_after=1.0, clock=clock)
    seen = [(breaker.state, breaker.closed, breaker.allows())]
    breaker.failure("x")
    seen.append((breaker.state, breaker.closed, breaker.allows()))
    clock.now += 2
    assert breaker.probe_due()
    seen.append((breaker.state, breaker.closed, breaker.allows()))
    breaker.success()
    seen.append((breaker.state, breaker.closed, breaker.allows()))
    assert seen == [("closed", True, True), ("open", False, False), ("half-open", False, False),
                    ("closed", True, True)]
    breaker.state = "open"
    assert not breaker.closed and not breaker.allows()


def test_build_store_without_redis_is_local() -> None:
    store = build_store(redis_url=None)
    assert isinstance(store, MemoryStore)
    assert telemetry.RATELIMIT_BACKEND.labels("local")._value.get() == 1  # type: ignore[attr-defined]


def test_build_store_password_sources(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from proxy.stores import redis_password

    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    monkeypatch.setenv("OPGATE_REDIS_PASSWORD", "from-env")
    assert redis_password() == "from-env"
    assert redis_password(password_file=str(secret)) == "s3cret"
    assert redis_password("explicit", str(secret)) == "explicit"
    store = build_store(redis_url="redis://127.0.0.1:1/0", password_file=str(secret))
    assert isinstance(store, ResilientStore)
    assert "s3cret" not in str(store.health())


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
    ("redis://opgate:pw@h/0", "redis://opgate:***@h/0"),
    # redis-py's own form for a socket: the password in the query (so are sentinel's)
    ("unix:///run/redis.sock?db=1&password=pw", "unix:///run/redis.sock?db=1&password=***"),
    ("redis://h:6379/0?password=pw", "redis://h:6379/0?password=***"),
    ("redis+sentinel://s1:26379/m?sentinel_password=pw",
     "redis+sentinel://s1:26379/m?sentinel_password=***"),
    ("rediss://h/0?ssl_ca_certs=/ca.crt", "rediss://h/0?ssl_ca_certs=/ca.crt"),
    ("redis://:p?ss@h/0", "redis://:***@h/0"),  # not percent-encoded: still hidden
    ("redis://h/0?password=p@ss", "redis://h/0?password=***"),
])
def test_redacted_url_hides_every_password_a_url_may_hold(url: str, shown: str) -> None:
    """What /readyz and the start-up error line show of --redis-url: a password given in the
    query, as redis-py's documented ``unix://`` form has it, was shown as typed."""
    from proxy.stores.base import redacted_url

    assert redacted_url(url) == shown


def test_a_password_in_the_query_is_not_in_the_stores_health() -> None:
    store = build_store(redis_url="unix:///run/redis.sock?db=1&password=s3cret")
    assert "s3cret" not in str(store.health())


def test_leasing_at_an_operators_rate_costs_about_two_refills_a_second() -> None:
    """50 calls/s on one key, far from its limit: the default window leases half a second of
    demand per refill, not one store call every few calls."""
    clock = Clock()
    remote = Remote(clock)
    store = LeasingStore(remote, clock=clock)
    key = req("steady", rate=1000, burst=1000, lease=True)

    async def go() -> int:
        admitted = 0
        for _ in range(500):  # 10 s of fake time
            clock.now += 0.02
            admitted += (await store.acquire([key])).allowed
        return admitted

    assert run(go()) == 500
    assert remote.calls <= 2 * 10 + 3  # the first refills learn the rate


async def steady(store: LeasingStore, key: BucketRequest, clock: Clock, *, calls: int,
                 every: float) -> int:
    """``calls`` acquires ``every`` fake seconds apart in one event loop, giving a refill in
    the background (a real 1 ms round trip) the time to land between calls."""
    admitted = 0
    for _ in range(calls):
        clock.now += every
        admitted += (await store.acquire([key])).allowed
        await asyncio.sleep(0.002)
    return admitted


def test_leases_are_refilled_ahead_so_no_call_waits_for_the_store() -> None:
    clock = Clock()
    remote = Remote(clock)
    remote.delay = 0.001  # a round trip: the call that asks waits for it
    store = LeasingStore(remote, clock=clock)
    key = req("steady", rate=1000, burst=1000, lease=True)

    async def go() -> int:
        admitted = await steady(store, key, clock, calls=300, every=0.02)  # 6 s at 50/s
        await store.close()
        return admitted

    assert run(go()) == 300
    in_line = [call for call in remote.seen if call[0].cost > 0]  # a call waited for these
    ahead = [call for call in remote.seen if call[0].cost == 0]
    assert len(in_line) <= 3, in_line  # learning the rate, then never again
    assert store.refills_ahead >= 8 and len(ahead) == store.refills_ahead
    assert len(remote.seen) <= 2 * 6 + 4  # still about two refills a second


def test_refills_ahead_never_admit_more_than_the_limit() -> None:
    """Two replicas on one shared bucket, both asking 4x faster than the limit: together they
    never admit more than burst + rate·t, and near the limit a refill ahead gets nothing and is
    not repeated on every call (the store sees as many calls as without refills ahead)."""

    def load(ahead: bool) -> tuple[int, int]:
        clock = Clock()
        remote = Remote(clock)
        remote.delay = 0.001
        replicas = [LeasingStore(remote, replicas=2, ahead=ahead, clock=clock) for _ in range(2)]
        key = req("shared", rate=100, burst=50, lease=True)

        async def go() -> int:
            admitted = 0
            for i in range(1200):  # 3 s of fake time, 400 calls/s against 100/s
                clock.now += 0.0025
                admitted += (await replicas[i % 2].acquire([key])).allowed
                await asyncio.sleep(0.0005)
            for store in replicas:
                await store.close()
            return admitted

        return run(go()), len(remote.seen)

    admitted, calls = load(ahead=True)
    assert 50 + 100 * 3 * 0.8 <= admitted <= 50 + 100 * 3 + 1
    _, calls_in_line = load(ahead=False)
    assert calls <= calls_in_line + 20


def test_close_cancels_a_refill_ahead_in_flight() -> None:
    clock = Clock()
    remote = Remote(clock)
    store = LeasingStore(remote, clock=clock)
    key = req("k", rate=1000, burst=1000, lease=True)

    async def go() -> None:
        await steady(store, key, clock, calls=20, every=0.02)  # the lease knows the rate
        remote.delay = 30.0  # the store stalls: the next refill ahead hangs
        for _ in range(100):  # until one starts
            clock.now += 0.02
            assert (await store.acquire([key])).allowed
            if store._ahead:
                break
        assert store._ahead
        await asyncio.wait_for(store.close(), 1.0)
        assert not store._ahead and not store._inflight

    run(go())


class Gated:
    """A shared store whose calls fail at once, or hang until the test lets them answer: the
    calls in flight when Redis stalls for a moment (a fork, another client's slow script)."""

    backend = "redis"

    def __init__(self, clock: Clock) -> None:
        self.memory = MemoryStore(clock=clock)
        self.failing = False
        self.gate = asyncio.Event()
        self.pings = 0

    async def acquire(self, requests: Sequence[BucketRequest]) -> Verdict:
        if self.failing:
            raise StoreUnavailable("unreachable: no answer within 0.05s")
        await self.gate.wait()
        return self.memory.acquire_now(requests)

    async def ping(self) -> bool:
        self.pings += 1
        return True

    def health(self) -> dict[str, object]:
        return {"backend": "redis"}

    async def close(self) -> None:
        return None


def test_a_call_answered_after_the_circuit_opened_leaves_its_recovery_to_the_probe(
        caplog: pytest.LogCaptureFixture) -> None:
    """A call sent while the circuit was closed that Redis answers after the circuit opened
    (Redis stalled for a moment: the calls before it timed out) does not close it on its way
    back: the circuit closed so, silently, left ``opgate_ratelimit_backend`` at ``fallback``
    and no "back" line after the "unavailable" one, while ``/readyz`` said closed. The
    probe closes it, with the gauge and the log."""
    clock = Clock()
    remote = Gated(clock)
    store = ResilientStore(remote, replicas=1, failures=3, reset_after=1.0, clock=clock)
    gauge = telemetry.RATELIMIT_BACKEND

    async def go() -> None:
        late = asyncio.ensure_future(store.acquire([req("k")]))
        await asyncio.sleep(0)  # it is in flight, Redis holding its answer
        remote.failing = True
        for _ in range(3):
            await store.acquire([req("k")])
        assert store.breaker.state == "open"
        remote.failing = False
        remote.gate.set()
        assert (await late).allowed
        assert store.breaker.state == "open"  # the late answer is no probe
        assert store.health()["backend"] == "fallback"
        assert gauge.labels("fallback")._value.get() == 1  # type: ignore[attr-defined]
        clock.now += 1.0
        for _ in range(100):  # the recovery loop's probe, within its MIN_PROBE_INTERVAL
            if store.breaker.closed:
                break
            await asyncio.sleep(0.01)
        assert store.breaker.state == "closed" and remote.pings == 1
        assert gauge.labels("redis")._value.get() == 1  # type: ignore[attr-defined]
        assert gauge.labels("fallback")._value.get() == 0  # type: ignore[attr-defined]
        await store.close()

    with caplog.at_level("WARNING", logger="opgate.ratelimit.store"):
        run(go())
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "unavailable after 3 failures" in said[0], said
    assert "is back" in said[1], said
