"""The admin listener's routes over a real socket: ``/readyz`` as the apiserver's (``?verbose``,
``?exclude=``), ``/metrics`` in the format the scraper asks for, and what a method other than
GET/HEAD gets."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from proxy.admin import (
    RENDER_SWITCH_INTERVAL,
    AdminListener,
    MetricsRenderer,
    NamedCheck,
    _yielding,
    build_admin_app,
    registry_metrics,
    serve_admin,
    worker_checks,
)
from proxy.engine import telemetry


async def _passes() -> tuple[bool, str]:
    return True, ""


async def _fails() -> tuple[bool, str]:
    return False, "upstream /readyz answered 500"


async def _no_policies() -> dict[str, Any]:
    return {}


REGISTRY = CollectorRegistry()
Counter("opgate_requests_total", "Calls.", ["verb"], registry=REGISTRY).labels("get").inc(3)


@pytest.fixture
async def admin() -> AsyncIterator[AdminListener]:
    app = build_admin_app(checks=[NamedCheck("policies", _passes), NamedCheck("upstream", _fails)],
                          describe_policies=_no_policies,
                          render_metrics=registry_metrics(REGISTRY))
    listener = await serve_admin(app, listen="127.0.0.1:0")
    try:
        yield listener
    finally:
        await listener.cleanup()


async def call(listener: AdminListener, target: str, method: str = "GET",
               extra: str = "") -> tuple[str, str]:
    """The head and the body of the admin's answer to ``method target``."""
    host, _, port = listener.address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"{method} {target} HTTP/1.1\r\nHost: admin\r\nContent-Length: 0\r\n"
                     f"{extra}Connection: close\r\n\r\n".encode())
        raw = await asyncio.wait_for(reader.read(-1), 10)
    finally:
        writer.close()
    head, _, body = raw.decode().partition("\r\n\r\n")
    return head, body


async def test_readyz_exclude_skips_a_check_as_the_apiservers_does(admin: AdminListener) -> None:
    head, body = await call(admin, "/readyz")
    assert head.startswith("HTTP/1.1 503") and "[-]upstream failed: upstream /readyz" in body
    head, body = await call(admin, "/readyz?exclude=upstream")
    assert head.startswith("HTTP/1.1 200") and body == "ok"
    head, body = await call(admin, "/readyz?verbose&exclude=upstream&exclude=etcd")
    assert head.startswith("HTTP/1.1 200")
    assert body.splitlines() == [
        "[+]policies ok", "[+]upstream excluded: ok", "[+]shutdown ok",
        'warn: some health checks cannot be excluded: no matches for "etcd"',
        "readyz check passed"]


async def test_readyz_exclude_of_shutdown(admin: AdminListener) -> None:
    admin.shutting_down()
    head, body = await call(admin, "/readyz?exclude=upstream")
    assert head.startswith("HTTP/1.1 503") and "[-]shutdown failed: shutting down" in body
    head, _ = await call(admin, "/readyz?exclude=upstream&exclude=shutdown")
    assert head.startswith("HTTP/1.1 200")


async def test_readyz_of_one_check_as_the_apiservers(admin: AdminListener) -> None:
    """The apiserver serves each check at ``/readyz/<name>`` (``curl .../readyz/etcd``): here
    that path was a 404, as was every check's."""
    head, body = await call(admin, "/readyz/policies")
    assert head.startswith("HTTP/1.1 200") and body == "ok"
    head, body = await call(admin, "/readyz/upstream")
    assert head.startswith("HTTP/1.1 503")
    assert body == "[-]upstream failed: upstream /readyz answered 500\n"
    head, body = await call(admin, "/readyz/shutdown")
    assert head.startswith("HTTP/1.1 200") and body == "ok"
    admin.shutting_down()
    head, body = await call(admin, "/readyz/shutdown")
    assert head.startswith("HTTP/1.1 503") and body.startswith("[-]shutdown failed: ")
    head, _ = await call(admin, "/readyz/etcd")
    assert head.startswith("HTTP/1.1 404")
    head, body = await call(admin, "/readyz/upstream", "HEAD")
    assert head.startswith("HTTP/1.1 503") and body == ""


async def test_healthz_reports_its_checks_as_readyz_does() -> None:
    """/healthz (and /livez) answer over the liveness checks as the apiserver's do: ``ok``
    while they pass, else 503 with the failing check and why; with ``?verbose`` each one (the
    apiserver's ``ping`` first); ``/healthz/NAME`` one alone. A shutdown does not fail it:
    a pod that drains is alive. (It was a bare ``ok`` whatever the supervisor knew.)"""
    failing = [True]

    async def workers() -> tuple[bool, str]:
        return (False, "no worker has served for 31s") if failing[0] else (True, "")

    admin = await serve_admin(build_admin_app(
        checks=[NamedCheck("policies", _passes)], live_checks=[NamedCheck("workers", workers)],
        describe_policies=_no_policies, render_metrics=registry_metrics(REGISTRY)),
        listen="127.0.0.1:0")
    try:
        for path in ("/healthz", "/livez"):
            head, body = await call(admin, path)
            assert head.startswith("HTTP/1.1 503"), head
            kind = path[1:]
            assert body.splitlines() == [
                "[+]ping ok", "[-]workers failed: no worker has served for 31s",
                f"{kind} check failed"]
        head, body = await call(admin, "/healthz/workers")
        assert head.startswith("HTTP/1.1 503")
        assert body == "[-]workers failed: no worker has served for 31s\n"
        head, body = await call(admin, "/healthz?exclude=workers")
        assert head.startswith("HTTP/1.1 200") and body == "ok"
        failing[0] = False
        admin.shutting_down()
        head, body = await call(admin, "/healthz")
        assert head.startswith("HTTP/1.1 200") and body == "ok"
        head, body = await call(admin, "/livez?verbose")
        assert body.splitlines() == ["[+]ping ok", "[+]workers ok", "livez check passed"]
        head, body = await call(admin, "/healthz/ping")
        assert head.startswith("HTTP/1.1 200") and body == "ok"
        head, _ = await call(admin, "/healthz/shutdown")
        assert head.startswith("HTTP/1.1 404")
    finally:
        await admin.cleanup()


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
async def test_other_methods_get_405_with_allow(admin: AdminListener, method: str) -> None:
    head, body = await call(admin, "/metrics", method)
    assert head.startswith("HTTP/1.1 405") and body == "method not allowed\n"
    assert "\r\nAllow: GET, HEAD" in head


def _samples(families: Any) -> dict[str, float]:
    return {sample.name: sample.value for family in families for sample in family.samples}


async def test_metrics_in_the_text_format_or_openmetrics_when_asked(admin: AdminListener) -> None:
    head, body = await call(admin, "/metrics")
    assert "\r\nContent-Type: text/plain; version=" in head
    assert _samples(text_string_to_metric_families(body)) == {"opgate_requests_total": 3.0}
    # Prometheus asks for OpenMetrics first; its parser refuses the text format's counters
    head, body = await call(admin, "/metrics", extra=(
        "Accept: application/openmetrics-text;version=1.0.0;q=0.5,"
        "text/plain;version=0.0.4;q=0.3\r\n"))
    assert "\r\nContent-Type: application/openmetrics-text; version=1.0.0" in head
    assert body.endswith("# EOF\n")
    assert _samples(openmetrics_families(body)) == {"opgate_requests_total": 3.0}


SERIES = 8000  # ~13 times what a busy sidecar has: a render takes ~100 ms or more


async def test_a_metrics_render_leaves_the_event_loop_free() -> None:
    """/metrics is rendered in a thread: the loop that relays the API calls stalls for a GIL
    switch interval at a time (5 ms), not for a whole render (~100 ms here); it stalled for
    every render when the render ran on it. Counts the loop adds meanwhile are not lost."""
    labels = [("get", "loop.test", f"r{i}", "200", "allowed") for i in range(SERIES)]
    for key in labels:
        telemetry.REQUESTS.labels(*key).inc()
    ticks_key = ("list", "loop.test", "ticks", "200", "allowed")
    ticking = telemetry.REQUESTS.labels(*ticks_key)
    app = build_admin_app(checks=[], describe_policies=_no_policies,
                          render_metrics=registry_metrics(telemetry.REGISTRY,
                                                          flush=telemetry.flush))
    listener = await serve_admin(app, listen="127.0.0.1:0")
    ticks, worst = 0, 0.0

    async def tick() -> None:  # the loop's other work: how late does it get its turn?
        nonlocal ticks, worst
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            worst, last = max(worst, now - last), now
            ticking.inc()
            ticks += 1

    # as ``opgate serve`` does at start-up (proxy.app.freeze_startup_objects): else a full
    # collection, which no thread can interrupt, walks pytest's heap and stalls the loop too
    gc.collect()
    gc.freeze()
    ticker = asyncio.create_task(tick())
    renders, stalls, bodies = [], [], []
    try:
        for _ in range(5):
            started = time.perf_counter()  # what a render costs here, on the loop's thread
            generate_latest(telemetry.REGISTRY)
            renders.append(time.perf_counter() - started)
            await asyncio.sleep(0.01)
            worst = 0.0
            bodies.append(await call(listener, "/metrics"))
            stalls.append(worst)
        worst = 0.0
        bodies += await asyncio.gather(*(call(listener, "/metrics") for _ in range(3)))
        stalls.append(worst)
        ticker.cancel()
        counted = telemetry.REGISTRY.get_sample_value(  # (it flushes: on the loop's thread)
            "opgate_requests_total", dict(zip(telemetry.REQUESTS.metric._labelnames, ticks_key,
                                              strict=True)))
    finally:
        gc.unfreeze()
        ticker.cancel()
        await listener.cleanup()
        for key in [*labels, ticks_key]:
            telemetry.REQUESTS.metric.remove(*key)
            del telemetry.REQUESTS._children[key]
    render = sorted(renders)[len(renders) // 2]
    # the longest stall of each scrape: at most a few switch intervals (a loaded machine can
    # stretch one of them: the median must be far below a render, none may reach a render)
    assert sorted(stalls)[len(stalls) // 2] < render / 3, (stalls, render)
    assert max(stalls) < render, (stalls, render)
    assert counted == ticks  # the loop's counts during the renders: none lost
    assert bodies[-1] == bodies[-2] == bodies[-3]  # scrapes at once share one render
    for head, body in bodies:
        assert head.startswith("HTTP/1.1 200")
        assert body.count('group="loop.test"') == SERIES + 1, "a whole render"
    for _, body in bodies[-2:]:
        samples = {(s.name, s.labels.get("resource")): s.value
                   for family in text_string_to_metric_families(body) for s in family.samples}
        assert all(samples[("opgate_requests_total", key[2])] == 1.0 for key in labels)
        assert ("opgate_inflight_requests", None) in samples


async def test_a_render_lets_the_loop_in_within_a_fraction_of_a_switch_interval() -> None:
    """While /metrics renders, the loop waits for the GIL at every wake-up (each read of a
    call's bytes): the render thread held it for Python's 5 ms switch interval each time, so a
    call relayed during a render was late by several of them (API p50 0.5 ms -> 1-7 ms, p99
    2 -> 13-25 ms under back-to-back ~20 ms renders of 1,100 series, fast relay). It now gives
    the GIL up every RENDER_SWITCH_INTERVAL (0.5 ms): p50 0.55 ms, p99 6.5 ms there."""
    registry = CollectorRegistry()
    counter = Counter("loop_test_total", "Series to render.", ["resource"], registry=registry)
    for i in range(SERIES):
        counter.labels(f"r{i}").inc()
    app = build_admin_app(checks=[], describe_policies=_no_policies,
                          render_metrics=registry_metrics(registry))
    listener = await serve_admin(app, listen="127.0.0.1:0")
    gaps: list[float] = []
    rendering = False

    async def tick() -> None:  # a loop woken every millisecond: how long until it runs?
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            if rendering:
                gaps.append(now - last)
            last = now

    gc.collect()
    gc.freeze()  # (as opgate serve does: a full collection would stall the loop too)
    ticker = asyncio.create_task(tick())
    try:
        for _ in range(5):
            await asyncio.sleep(0.01)
            rendering = True
            head, _ = await call(listener, "/metrics")
            rendering = False
            assert head.startswith("HTTP/1.1 200")
    finally:
        gc.unfreeze()
        ticker.cancel()
        await listener.cleanup()
    assert len(gaps) > 20
    # a 1 ms sleep and the wait for the GIL: ~1.6 ms now, ~6 ms with 5 ms switch intervals
    assert sorted(gaps)[len(gaps) // 2] < 0.003, sorted(gaps)[len(gaps) // 2]


async def test_concurrent_scrapes_share_one_render() -> None:
    made = 0

    def registry() -> CollectorRegistry:
        nonlocal made
        made += 1
        time.sleep(0.05)  # (in the render thread)
        return REGISTRY

    render = MetricsRenderer(registry)
    try:
        answers = await asyncio.gather(*(render("") for _ in range(3)))
        assert made == 1 and len(set(answers)) == 1
        openmetrics = await render("application/openmetrics-text; version=1.0.0")
        assert made == 2 and openmetrics[1].endswith(b"# EOF\n")
        await render("")
        assert made == 3  # a scrape after a render ended gets a new one
    finally:
        render.close()


@dataclass
class FakeWorker:
    index: int
    socket: str
    last_exit: str = ""
    pid: int | None = 4242
    up: bool = False


async def test_supervisor_readyz_passes_exclude_on_to_the_workers(tmp_path: Path) -> None:
    """With --workers, the supervisor's /readyz asks each worker's: ``?exclude=upstream`` must
    reach them, or a probe that excludes a worker's check still fails on it."""
    sock = str(tmp_path / "worker-0.sock")
    worker = await serve_admin(build_admin_app(
        checks=[NamedCheck("policies", _passes), NamedCheck("upstream", _fails)],
        describe_policies=_no_policies, render_metrics=registry_metrics(REGISTRY)),
        listen=f"unix:{sock}")
    supervisor = await serve_admin(build_admin_app(
        checks=worker_checks([FakeWorker(0, sock)]), describe_policies=_no_policies,
        render_metrics=registry_metrics(REGISTRY)), listen="127.0.0.1:0")
    try:
        head, body = await call(supervisor, "/readyz")
        assert head.startswith("HTTP/1.1 503")
        assert "[-]worker-0 failed: pid 4242: [-]upstream" in body
        head, body = await call(supervisor, "/readyz?verbose&exclude=upstream")
        assert head.startswith("HTTP/1.1 200"), body
        assert body.splitlines() == ["[+]worker-0 ok: pid 4242", "[+]shutdown ok",
                                     "readyz check passed"]
    finally:
        await supervisor.cleanup()
        await worker.cleanup()


async def test_supervisor_readyz_waits_for_a_workers_slow_upstream_check(tmp_path: Path) -> None:
    """A worker's /readyz asks the apiserver (3 s for /readyz, then 3 s for /version): one
    that answers after 2.5 s is ready, so the supervisor must not give up on it sooner (it
    waited 2 s and called the worker 'not answering its admin socket')."""
    async def slow() -> tuple[bool, str]:
        await asyncio.sleep(2.5)
        return True, "upstream /version answered 200"

    sock = str(tmp_path / "worker-0.sock")
    worker = await serve_admin(build_admin_app(
        checks=[NamedCheck("upstream", slow)], describe_policies=_no_policies,
        render_metrics=registry_metrics(REGISTRY)), listen=f"unix:{sock}")
    supervisor = await serve_admin(build_admin_app(
        checks=worker_checks([FakeWorker(0, sock, up=True)]), describe_policies=_no_policies,
        render_metrics=registry_metrics(REGISTRY)), listen="127.0.0.1:0")
    try:
        head, body = await call(supervisor, "/readyz")
    finally:
        await supervisor.cleanup()
        await worker.cleanup()
    assert head.startswith("HTTP/1.1 200"), body


async def test_supervisor_readyz_says_a_worker_is_starting(tmp_path: Path) -> None:
    """A worker restarted (or starting) runs before its admin socket answers: /readyz says so,
    not the socket's ConnectionRefusedError or FileNotFoundError."""
    supervisor = await serve_admin(build_admin_app(
        checks=worker_checks([FakeWorker(0, str(tmp_path / "not-yet.sock"))]),
        describe_policies=_no_policies, render_metrics=registry_metrics(REGISTRY)),
        listen="127.0.0.1:0")
    try:
        head, body = await call(supervisor, "/readyz?verbose")
    finally:
        await supervisor.cleanup()
    assert head.startswith("HTTP/1.1 503")
    assert "[-]worker-0 failed: pid 4242: starting (its admin socket does not answer yet)" in (
        body), body


async def test_supervisor_readyz_says_which_worker_runs_degraded(tmp_path: Path) -> None:
    """A worker whose rate-limit store is down stays ready, and its ``ratelimit-store`` line
    says ``degraded`` with the reason; with --workers the supervisor's /readyz?verbose said
    only ``pid N`` for it, so Redis being away showed nowhere on /readyz."""
    async def degraded() -> tuple[bool, str]:
        return True, "degraded: Redis unavailable (unreachable: refused), breaker open"

    sock = str(tmp_path / "worker-0.sock")
    worker = await serve_admin(build_admin_app(
        checks=[NamedCheck("policies", _passes), NamedCheck("ratelimit-store", degraded)],
        describe_policies=_no_policies, render_metrics=registry_metrics(REGISTRY)),
        listen=f"unix:{sock}")
    supervisor = await serve_admin(build_admin_app(
        checks=worker_checks([FakeWorker(0, sock)]), describe_policies=_no_policies,
        render_metrics=registry_metrics(REGISTRY)), listen="127.0.0.1:0")
    try:
        head, body = await call(supervisor, "/readyz?verbose")
    finally:
        await supervisor.cleanup()
        await worker.cleanup()
    assert head.startswith("HTTP/1.1 200"), body
    assert body.splitlines()[0] == (
        "[+]worker-0 ok: pid 4242; ratelimit-store degraded: Redis unavailable "
        "(unreachable: refused), breaker open"), body


def test_the_switch_interval_is_set_back_once_every_render_is_done() -> None:
    """Two renderers' renders overlapping (a test's, the admin's): the interval is Python's
    again once both are done, not the faster one for the rest of the process."""
    before = sys.getswitchinterval()
    first_done, second_started = threading.Event(), threading.Event()

    def first() -> bytes:
        second_started.wait(5)
        return b""

    def second() -> bytes:
        second_started.set()
        first_done.wait(5)
        return b""

    threads = [threading.Thread(target=_yielding, args=(first,)),
               threading.Thread(target=_yielding, args=(second,))]
    threads[0].start()
    threads[1].start()
    threads[0].join(5)
    during = sys.getswitchinterval()
    first_done.set()
    threads[1].join(5)
    assert during == RENDER_SWITCH_INTERVAL
    assert sys.getswitchinterval() == before
