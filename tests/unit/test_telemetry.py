"""Deferred metrics: what a scrape shows is exactly what per-update prometheus_client shows."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proxy.engine import telemetry
from proxy.engine.telemetry import Deferred

BUCKETS = (0.001, 0.01, 0.1, 1.0)


def samples(registry: CollectorRegistry, prefix: str) -> dict[tuple[str, tuple[tuple[str, str],
                                                                             ...]], float]:
    """Every sample but ``*_created``, the metric name's prefix cut off."""
    found = {}
    for metric in registry.collect():
        for s in metric.samples:
            if s.name.endswith("_created") or not s.name.startswith(prefix):
                continue
            found[(s.name.removeprefix(prefix), tuple(sorted(s.labels.items())))] = s.value
    return found


def pair(kind: type, *labels: str, **kw: object) -> tuple[CollectorRegistry, object, Deferred]:
    """A plain metric and a deferred one of the same kind, in one registry."""
    registry = CollectorRegistry()
    direct = kind("direct_m", "d", list(labels), registry=registry, **kw)
    deferred = Deferred(kind("deferred_m", "d", list(labels), registry=registry, **kw))
    return registry, direct, deferred


def same(registry: CollectorRegistry) -> None:
    telemetry.flush()
    direct, deferred = samples(registry, "direct_m"), samples(registry, "deferred_m")
    assert direct and direct == deferred


def test_counter_children_add_up_like_prometheus_client() -> None:
    registry, direct, deferred = pair(Counter, "verb", "code")
    for verb, code, amount in [("get", "200", 1), ("get", "200", 2.5), ("list", "429", 1),
                               ("get", "200", 1)]:
        direct.labels(verb, code).inc(amount)  # type: ignore[attr-defined]
        deferred.labels(verb, code).inc(amount)
    direct.labels(verb="watch", code="200").inc()  # type: ignore[attr-defined]
    deferred.labels(verb="watch", code="200").inc()
    assert deferred.labels("get", 200) is deferred.labels("get", "200")  # str() like prometheus
    same(registry)


def test_counter_refuses_what_prometheus_client_refuses() -> None:
    _, _, deferred = pair(Counter, "verb")
    with pytest.raises(ValueError, match="non-negative"):
        deferred.labels("get").inc(-1)
    with pytest.raises(ValueError):
        deferred.labels(nope="get")
    with pytest.raises(ValueError):
        deferred.labels("get", "extra")


@pytest.mark.parametrize("values", [
    [0.0005, 0.001, 0.0011, 0.01, 0.5, 1.0, 1.5, math.inf, 0.0],  # bounds fall in their own bucket
    [2.0, 2.0, 3.0],
    [-1.0, 0.05],
])
def test_histogram_buckets_and_sum_like_prometheus_client(values: list[float]) -> None:
    registry, direct, deferred = pair(Histogram, "verb", buckets=BUCKETS)
    for value in values:
        direct.labels("get").observe(value)  # type: ignore[attr-defined]
        deferred.labels("get").observe(value)
    same(registry)
    for value in values:  # a second batch adds to the first
        direct.labels("get").observe(value)  # type: ignore[attr-defined]
        deferred.labels("get").observe(value)
    same(registry)


def test_gauge_inc_dec_set_like_prometheus_client() -> None:
    registry, direct, deferred = pair(Gauge)
    for op, amount in [("inc", 1), ("inc", 2), ("dec", 1), ("set", 7), ("inc", 1), ("dec", 3)]:
        getattr(direct, op)(amount)
        getattr(deferred, op)(amount)
        same(registry)
    registry, direct, deferred = pair(Gauge)
    deferred.inc()
    deferred.set(4)  # a set replaces the updates before it, flushed or not
    direct.set(4)  # type: ignore[attr-defined]
    same(registry)


def test_registry_readers_see_pending_updates_without_a_flush() -> None:
    labels = {"verb": "get", "group": "", "resource": "t-pending", "code": "200",
              "decision": "allowed"}
    before = telemetry.REGISTRY.get_sample_value("opgate_requests_total", labels) or 0.0
    child = telemetry.REQUESTS.labels(*labels.values())
    child.inc()
    child.inc()
    assert telemetry.REGISTRY.get_sample_value("opgate_requests_total", labels) == before + 2
    telemetry.INFLIGHT.inc()
    assert telemetry.REGISTRY.get_sample_value("opgate_inflight_requests") == 1
    telemetry.INFLIGHT.dec()
    assert telemetry.REGISTRY.get_sample_value("opgate_inflight_requests") == 0


def test_a_collect_in_another_thread_leaves_the_flush_to_the_loops_thread() -> None:
    """The admin renders /metrics in a thread of its own while the loop updates: a flush there
    would read and reset sums the loop is adding to. It sees what the loop flushed."""
    labels = {"verb": "get", "group": "", "resource": "t-thread", "code": "200",
              "decision": "allowed"}
    child = telemetry.REQUESTS.labels(*labels.values())
    before = telemetry.REGISTRY.get_sample_value("opgate_requests_total", labels)
    child.inc(2)
    telemetry.INFLIGHT.now += 1
    seen: list[float | None] = []

    def read() -> None:
        seen.append(telemetry.REGISTRY.get_sample_value("opgate_requests_total", labels))
        seen.append(telemetry.REGISTRY.get_sample_value("opgate_inflight_requests"))

    try:
        reader = threading.Thread(target=read)
        reader.start()
        reader.join()
        assert seen == [before, 0.0]  # still pending: nothing was flushed in that thread
        assert telemetry.REGISTRY.get_sample_value("opgate_requests_total", labels) == (
            before or 0.0) + 2
        assert telemetry.REGISTRY.get_sample_value("opgate_inflight_requests") == 1
    finally:
        telemetry.INFLIGHT.now -= 1
        telemetry.flush()


def test_multiprocess_mode_hands_updates_over_within_flush_every(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With --workers the supervisor reads the files, not this process: no scrape flushes them."""
    monkeypatch.setattr(telemetry, "_MULTIPROCESS", True)
    _, _, deferred = pair(Counter, "verb")
    target = deferred.labels("get")._target

    async def go() -> tuple[float, float, float]:
        deferred.labels("get").inc()
        deferred.labels("get").inc()
        pending = target._value.get()
        await asyncio.sleep(0)
        still = target._value.get()  # not per loop iteration: at most FLUSH_EVERY later
        await asyncio.sleep(telemetry.FLUSH_EVERY * 2)
        return pending, still, target._value.get()

    assert asyncio.run(go()) == (0.0, 0.0, 2.0)
    deferred.labels("get").inc()  # no running loop: handed over at once
    assert target._value.get() == 3.0


def test_multiprocess_mode_flushes_on_a_new_loop_after_an_old_one_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flush scheduled on a loop that closed before running it does not stall later ones."""
    monkeypatch.setattr(telemetry, "_MULTIPROCESS", True)
    _, _, deferred = pair(Counter, "verb")
    target = deferred.labels("get")._target
    old = asyncio.new_event_loop()
    old.close()
    monkeypatch.setattr(telemetry, "_flush_loop", old)

    async def update() -> float:
        deferred.labels("get").inc()
        await asyncio.sleep(telemetry.FLUSH_EVERY * 2)
        return float(target._value.get())

    assert asyncio.run(update()) == 1.0


def test_level_is_published_at_a_scrape_and_only_when_it_moved() -> None:
    registry = CollectorRegistry()
    level = telemetry.Level(Gauge("level_m", "d", registry=registry))
    try:
        level.now += 1
        level.now += 1
        assert registry.get_sample_value("level_m") == 0  # a plain number until a flush
        telemetry.flush()
        assert registry.get_sample_value("level_m") == 2
        level.now -= 1
        level.dec()
        level.inc(3)
        telemetry.flush()
        assert registry.get_sample_value("level_m") == 3
        level.metric.set(7)  # (nobody else sets it: a flush that finds no change leaves it)
        telemetry.flush()
        assert registry.get_sample_value("level_m") == 7
        level.set(0)
        telemetry.flush()
        assert registry.get_sample_value("level_m") == 0
    finally:
        telemetry._levels.remove(level)


def test_level_refuses_a_labelled_gauge() -> None:
    with pytest.raises(ValueError, match="without labels"):
        telemetry.Level(Gauge("level_l", "d", ["verb"], registry=CollectorRegistry()))


def test_multiprocess_mode_publishes_levels_every_flush_every(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With --workers nothing calls flush when a level moves: publish_levels keeps them
    published, at most FLUSH_EVERY late, once per loop however often it is called."""
    monkeypatch.setattr(telemetry, "_MULTIPROCESS", True)
    monkeypatch.setattr(telemetry, "_levels_loop", None)
    registry = CollectorRegistry()
    level = telemetry.Level(Gauge("level_mp", "d", registry=registry))

    def shown() -> float | None:
        return level.metric._value.get()  # type: ignore[attr-defined,no-any-return]

    async def go() -> list[float | None]:
        telemetry.publish_levels()
        telemetry.publish_levels()
        seen = []
        level.now += 1
        await asyncio.sleep(0)
        seen.append(shown())
        await asyncio.sleep(telemetry.FLUSH_EVERY * 2)
        seen.append(shown())
        level.now -= 1
        await asyncio.sleep(telemetry.FLUSH_EVERY * 2)
        seen.append(shown())
        return seen

    try:
        assert asyncio.run(go()) == [0.0, 1.0, 0.0]
        level.now += 1  # a new loop publishes again: the old one's ticks died with it
        assert asyncio.run(go()) == [0.0, 2.0, 1.0]
    finally:
        telemetry._levels.remove(level)


def test_single_process_mode_publishes_levels_only_when_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(telemetry, "_MULTIPROCESS", False)
    monkeypatch.setattr(telemetry, "_levels_loop", None)

    async def go() -> None:
        telemetry.publish_levels()

    asyncio.run(go())
    assert telemetry._levels_loop is None


def test_policy_reload_results_are_exported_at_zero_from_the_start() -> None:
    """A broken edit counts one ``error`` and then stays unchanged: a series that appears at 1
    has no increase for ``increase()`` / ``rate()`` to see, so an alert on failed reloads never
    fired for the first (and often only) one. Each result is there at 0 before any reload."""
    import subprocess
    import sys

    code = ("from prometheus_client import generate_latest\n"
            "from proxy.engine import telemetry\n"
            "print(generate_latest(telemetry.REGISTRY).decode())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    for result in ("success", "error", "unchanged"):
        assert f'opgate_policy_reloads_total{{result="{result}"}} 0.0' in out, out
