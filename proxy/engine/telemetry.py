"""Every Prometheus metric opgate exports, defined once (prefix ``opgate_``).

Label values always come from bounded sets (verbs, API groups and resources the cluster serves,
status codes, decisions, policy and middleware names): never an object name, a user or a key.
Components import the metric they update from here; the admin listener serves ``REGISTRY``.

With ``--workers N`` every worker writes its values to files in ``PROMETHEUS_MULTIPROC_DIR``
(prometheus_client's multiprocess mode, chosen by that variable at import) and the supervisor's
``/metrics`` adds them up: counters and histograms sum over all workers, dead ones included;
each gauge's ``multiprocess_mode`` says how it combines the live workers' values. In a single
process the mode is ignored.

The metrics updated on every call (requests, durations, rate-limit decisions) are
:class:`Deferred`: their children add up in plain floats, without prometheus_client's lock (nor,
in multiprocess mode, its ``getpid`` and mmap write per update), and hand the sums to the real
prometheus_client children in :func:`flush`. The gauges of calls in flight and watches open are
:class:`Level`: the relay keeps their value in a plain number (``INFLIGHT.now += 1``, no call at
all) and ``flush`` sets the gauge to it. ``flush`` runs before anything reads ``REGISTRY`` (a
collector registered first does it), so what ``/metrics`` shows is exactly what it would be with
an update per call. In multiprocess mode the supervisor reads the files, not this process: there
``flush`` runs ``FLUSH_EVERY`` (50 ms) after an update, the levels are published every
``FLUSH_EVERY`` (:func:`publish_levels`, started by the relay), and all of it at exit, so the
supervisor's ``/metrics`` is at most that much behind, and a worker killed by SIGKILL loses at
most its last 50 ms of counts (a flush per loop iteration measured ~15% more CPU per call with 2
workers).
Updates come from the event loop's thread only (as every hot-path update does), which is the
main thread: ``flush`` changes what they change, so it runs there only. The admin renders
``/metrics`` in a thread of its own (:class:`proxy.admin.MetricsRenderer`): it flushes on the
loop, then hands the render over; a collect in another thread does not flush.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
import time
from bisect import bisect_left
from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.metrics import MetricWrapperBase

# no ``*_created`` series (one per counter and histogram child, the process's start time):
# they double what /metrics sends and Prometheus does not need them
disable_created_metrics()

# prometheus_client picks its value class from this variable when it is imported, so it is
# read here the same way: in multiprocess mode the files must follow the updates promptly.
_MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR")
                     or os.environ.get("prometheus_multiproc_dir"))
if _MULTIPROCESS:  # before the first metric opens a file: a full disk must not SIGBUS us
    from proxy.engine.metricfiles import install

    install()

FLUSH_EVERY = 0.05  # seconds a worker's updates may wait before they reach the shared files
_dirty: list[_Child] = []
_flush_loop: asyncio.AbstractEventLoop | None = None  # the loop a flush is scheduled on
_levels: list[Level] = []
_levels_loop: asyncio.AbstractEventLoop | None = None  # the loop publishing the levels


def flush() -> None:
    """Hand every pending sum to its prometheus_client child, every level to its gauge."""
    global _flush_loop
    _flush_loop = None
    while _dirty:
        pending = _dirty[:]
        _dirty.clear()
        for child in pending:
            child.flush()
    _publish_levels()


def _publish_levels() -> None:
    for level in _levels:
        level.publish()
    if _quota_zero:  # (nothing at 0: nothing to sweep)
        _sweep_quota_usage(_clock())


def publish_levels() -> None:
    """In multiprocess mode, publish every :class:`Level` each ``FLUSH_EVERY`` on the running
    loop from now on (once per loop): a level changes without a call that could schedule a
    flush. In a single process nothing: a scrape flushes."""
    global _levels_loop
    loop = asyncio.get_running_loop()
    if not _MULTIPROCESS or _levels_loop is loop:
        return
    _levels_loop = loop

    def tick() -> None:
        _publish_levels()
        loop.call_later(FLUSH_EVERY, tick)

    loop.call_later(FLUSH_EVERY, tick)


if _MULTIPROCESS:  # a worker that stops between an update and the next loop iteration
    atexit.register(flush)


def _schedule() -> None:
    global _flush_loop
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no loop in this thread: nothing would run a deferred flush
        flush()
        return
    if _flush_loop is not loop:
        _flush_loop = loop
        loop.call_later(FLUSH_EVERY, flush)


class _Child:
    """One labelled series: pending updates, and the prometheus_client child they go to."""

    __slots__ = ("_queued", "_target")

    def __init__(self, target: Any) -> None:
        self._target = target
        self._queued = False

    def _mark(self) -> None:
        self._queued = True
        _dirty.append(self)
        if _MULTIPROCESS:
            _schedule()

    def flush(self) -> None:
        raise NotImplementedError


class CounterChild(_Child):
    __slots__ = ("_pending",)

    def __init__(self, target: Any) -> None:
        super().__init__(target)
        self._pending = 0.0

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self._pending += amount
        if not self._queued:
            self._mark()

    def flush(self) -> None:
        self._queued = False
        amount, self._pending = self._pending, 0.0
        if amount:
            self._target.inc(amount)


class GaugeChild(_Child):
    __slots__ = ("_pending",)

    def __init__(self, target: Any) -> None:
        super().__init__(target)
        self._pending = 0.0

    def inc(self, amount: float = 1) -> None:
        self._pending += amount
        if not self._queued:
            self._mark()

    def dec(self, amount: float = 1) -> None:
        self._pending -= amount
        if not self._queued:
            self._mark()

    def set(self, value: float) -> None:
        self._pending = 0.0
        self._target.set(value)

    def flush(self) -> None:
        self._queued = False
        amount, self._pending = self._pending, 0.0
        if amount:
            self._target.inc(amount)


class HistogramChild(_Child):
    __slots__ = ("_bounds", "_counts", "_sum")

    def __init__(self, target: Any) -> None:
        super().__init__(target)
        self._bounds: list[float] = list(target._upper_bounds)
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0

    def observe(self, amount: float) -> None:
        self._sum += amount
        if amount == amount:  # NaN falls in no bucket, as in prometheus_client
            self._counts[bisect_left(self._bounds, amount)] += 1
        if not self._queued:
            self._mark()

    def flush(self) -> None:
        self._queued = False
        counts, target = self._counts, self._target
        total, self._sum = self._sum, 0.0
        target._sum.inc(total)
        for i, n in enumerate(counts):
            if n:
                counts[i] = 0
                target._buckets[i].inc(n)


_CHILD_TYPES: dict[type[MetricWrapperBase], type[_Child]] = {
    Counter: CounterChild, Gauge: GaugeChild, Histogram: HistogramChild}


class Deferred:
    """A prometheus_client metric whose updates are summed here and flushed (module docstring).

    ``labels`` takes the label values positionally or by name, as prometheus_client does; a
    metric without labels is updated directly (``.inc()`` on the Deferred itself).
    """

    __slots__ = ("_children", "_kind", "_self", "metric")

    def __init__(self, metric: MetricWrapperBase) -> None:
        self.metric = metric
        self._kind = _CHILD_TYPES[type(metric)]
        self._children: dict[tuple[str, ...], Any] = {}
        self._self: Any = None if metric._labelnames else self._kind(metric)

    def labels(self, *values: object, **named: object) -> Any:
        if named:
            names = self.metric._labelnames
            if values or sorted(named) != sorted(names):
                self.metric.labels(*values, **named)  # raises prometheus_client's own error
            values = tuple(named[n] for n in names)
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._kind(self.metric.labels(*key))
        return child

    def inc(self, amount: float = 1) -> None:
        self._self.inc(amount)

    def dec(self, amount: float = 1) -> None:
        self._self.dec(amount)

    def observe(self, amount: float) -> None:
        self._self.observe(amount)

    def set(self, value: float) -> None:
        self._self.set(value)


class Level:
    """A gauge without labels whose value its owner keeps in ``now``, a plain number: the relay
    counts each call in and out with ``INFLIGHT.now += 1`` and ``-= 1``, no call at all.
    :func:`flush` (every scrape) sets the gauge to ``now`` when it changed; in multiprocess mode
    :func:`publish_levels` does it every ``FLUSH_EVERY`` too. ``inc``/``dec``/``set`` for
    callers off the hot path."""

    __slots__ = ("_shown", "metric", "now")

    def __init__(self, metric: Gauge) -> None:
        if metric._labelnames:
            raise ValueError("a Level is a gauge without labels")
        self.metric = metric
        self.now: float = 0
        self._shown: float = 0  # the value the gauge was last set to (it starts at 0)
        _levels.append(self)

    def inc(self, amount: float = 1) -> None:
        self.now += amount

    def dec(self, amount: float = 1) -> None:
        self.now -= amount

    def set(self, value: float) -> None:
        self.now = value

    def publish(self) -> None:
        now = self.now
        if now != self._shown:
            self._shown = now
            self.metric.set(now)


class _Flusher:
    """Registered first in ``REGISTRY``: whatever collects it on the main thread sees every
    pending update. Another thread (the admin's render thread) sees what the loop last flushed:
    a flush there would race the loop's updates (a sum read and reset while the loop adds to
    it, a series queued while the queue is emptied)."""

    def describe(self) -> Iterable[Any]:
        return ()

    def collect(self) -> Iterable[Any]:
        if threading.current_thread() is threading.main_thread():
            flush()
        return ()


REGISTRY = CollectorRegistry(auto_describe=True)
REGISTRY.register(_Flusher())

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                    10, 30, 60)

REQUESTS = Deferred(Counter(
    "opgate_requests_total", "API calls handled, by outcome.",
    ["verb", "group", "resource", "code", "decision"], registry=REGISTRY,
))
REQUEST_DURATION = Deferred(Histogram(
    "opgate_request_duration_seconds", "Time from accept to the last byte, non-long-running calls.",
    ["verb"], buckets=_LATENCY_BUCKETS, registry=REGISTRY,
))
UPSTREAM_DURATION = Deferred(Histogram(
    "opgate_upstream_duration_seconds", "Time until the apiserver's response headers arrived.",
    ["verb"], buckets=_LATENCY_BUCKETS, registry=REGISTRY,
))
INFLIGHT = Level(Gauge("opgate_inflight_requests", "Calls being handled now.",
                       registry=REGISTRY, multiprocess_mode="livesum"))
WATCHES_OPEN = Level(Gauge("opgate_watches_open", "Watch streams open now.", registry=REGISTRY,
                           multiprocess_mode="livesum"))
UPSTREAM_ERRORS = Counter(
    "opgate_upstream_errors_total", "Calls that failed to reach the apiserver.", ["kind"],
    registry=REGISTRY,
)
MIDDLEWARE_ERRORS = Counter(
    "opgate_middleware_errors_total", "Exceptions raised by middleware hooks.",
    ["middleware", "hook"], registry=REGISTRY,
)
RATELIMIT_DECISIONS = Deferred(Counter(
    "opgate_ratelimit_decisions_total", "Rate-limit decisions.", ["policy", "result"],
    registry=REGISTRY,
))
QUOTA_DENIALS = Counter(
    "opgate_quota_denials_total", "Creates denied by a quota.", ["resource"], registry=REGISTRY,
)
QUOTA_USAGE = Gauge(
    "opgate_quota_usage", "Objects counted against opgate quotas.", ["namespace", "resource"],
    registry=REGISTRY, multiprocess_mode="livemax",  # every worker counts the same objects
)
_QUOTA_USAGE_SET: set[tuple[str, str]] = set()  # the label sets this process has set
QUOTA_USAGE_ZERO_SECONDS = 300.0  # a series at 0 this long is removed (its namespace may be gone)
_quota_zero: dict[tuple[str, str], float] = {}  # label sets at 0, since when (monotonic)
_quota_zero_sweep = 0.0
_clock = time.monotonic


def set_quota_usage(namespace: str, resource: str, count: int) -> None:
    """Set a namespace's usage. One that stays at 0 for ``QUOTA_USAGE_ZERO_SECONDS`` loses its
    series (as one that never held an object has none): namespaces come and go over the weeks
    a sidecar runs, and each kept a series forever. Removed at the next update or scrape after
    that (in multiprocess mode, where prometheus_client cannot remove one, see
    :func:`_remove_usage`)."""
    labels = (namespace, resource)
    QUOTA_USAGE.labels(namespace, resource).set(count)
    _QUOTA_USAGE_SET.add(labels)
    now = _clock()
    if count:
        _quota_zero.pop(labels, None)
    elif labels not in _quota_zero:
        _quota_zero[labels] = now
    _sweep_quota_usage(now)


def _sweep_quota_usage(now: float) -> None:
    """Remove the usage series at 0 for ``QUOTA_USAGE_ZERO_SECONDS`` (looked for every half of
    it): at each update, and at each :func:`flush` (before every scrape; with ``--workers``
    every ``FLUSH_EVERY`` too), so they go when nothing else changes after them too."""
    global _quota_zero_sweep
    if now < _quota_zero_sweep:
        return
    _quota_zero_sweep = now + QUOTA_USAGE_ZERO_SECONDS / 2
    horizon = now - QUOTA_USAGE_ZERO_SECONDS
    for stale in [k for k, since in _quota_zero.items() if since <= horizon]:
        del _quota_zero[stale]
        _QUOTA_USAGE_SET.discard(stale)
        _remove_usage(stale)


def _remove_usage(labels: tuple[str, str]) -> None:
    """Remove one usage series. prometheus_client cannot remove a series from a worker's file
    in multiprocess mode (``--workers``): there it is set to ``metricfiles.REMOVED``, which the
    supervisor's ``/metrics`` leaves out (each namespace there ever was kept a series at 0),
    and forgotten (:func:`metricfiles.forget`): every so often the file is rewritten without
    them, and this process lets go of their values (each kept ~200 B of file, ~1 KB of heap)."""
    if _MULTIPROCESS:
        from proxy.engine.metricfiles import REMOVED, forget

        child = QUOTA_USAGE.labels(*labels)
        child.set(REMOVED)
        # out of the metric, the entry left in the file until forget drops it (not remove():
        # it warns on stderr that it leaves the file as it is)
        with QUOTA_USAGE._lock:
            QUOTA_USAGE._metrics.pop(labels, None)
        forget(child._value)
    else:
        QUOTA_USAGE.remove(*labels)


def clear_quota_usage() -> None:
    """Forget the quota usage series (the entries they were for are gone)."""
    if _MULTIPROCESS:
        for labels in _QUOTA_USAGE_SET:
            _remove_usage(labels)
    else:
        QUOTA_USAGE.clear()
    _QUOTA_USAGE_SET.clear()
    _quota_zero.clear()


IDENTITY_DENIALS = Counter(
    "opgate_identity_denials_total", "Calls refused by the identity middleware.", ["reason"],
    registry=REGISTRY,
)
TOKEN_REVIEWS = Counter(
    "opgate_identity_token_reviews_total", "TokenReviews the identity middleware asked, by "
    "answer: authenticated, rejected, error (no answer); busy: not asked, none of the "
    "TokenReviews allowed at once was free in time.", ["result"],
    registry=REGISTRY,
)
POLICY_RELOADS = Counter(
    "opgate_policy_reloads_total", "Policy reload attempts.", ["result"], registry=REGISTRY,
)
# each result at 0 from the start: a broken edit counts one error, then its files stay
# unchanged, and a series born at 1 has no increase for an alert's increase() to see
for _result in ("success", "error", "unchanged"):
    POLICY_RELOADS.labels(result=_result)
TLS_CERT_EXPIRY = Gauge(
    "opgate_tls_cert_expiry_timestamp_seconds", "The notAfter of the certificate the TLS API "
    "listener serves new connections, as a Unix time; cert: the --tls-cert file (no series "
    "without TLS: a 0 would read as expired).", ["cert"], registry=REGISTRY,
    multiprocess_mode="livemin",  # the soonest any live worker's ends
)
TLS_CERT_RELOADS = Counter(
    "opgate_tls_cert_reloads_total", "Reloads of the TLS API listener's certificate and key "
    "after their files changed, by result (error: not served, the old pair serves on).",
    ["result"], registry=REGISTRY,
)
for _result in ("success", "error"):  # (at 0 from the start, as the policy reloads)
    TLS_CERT_RELOADS.labels(result=_result)
QUOTA_RESERVATIONS = Counter(
    "opgate_quota_reservations_total",
    "Quota'd creates admitted and reserved, by the store that reserved them (redis: shared by "
    "every replica; local: no Redis configured; fallback: in-process while Redis is down).",
    ["backend"], registry=REGISTRY,
)
REDIS_ERRORS = Counter(
    "opgate_redis_errors_total", "Failed or timed-out Redis calls.", registry=REGISTRY,
)
RATELIMIT_BACKEND = Gauge(
    "opgate_ratelimit_backend", "1 for the rate-limit backend in use now.", ["backend"],
    registry=REGISTRY, multiprocess_mode="livemax",  # 1 when any live worker uses it
)
DRYRUN_DENIALS = Counter(
    "opgate_dryrun_denials_total", "Denials a dryrun policy would have made.", ["middleware"],
    registry=REGISTRY,
)
AUDIT_EVENTS = Deferred(Counter(
    "opgate_audit_events_total", "Audit events handed to the audit log, by level.", ["level"],
    registry=REGISTRY,
))
AUDIT_DROPPED = Counter(
    "opgate_audit_dropped_total", "Audit events dropped: the audit log writer fell behind or "
    "failed.", registry=REGISTRY,
)
CAPTURE_FLOWS = Counter(
    "opgate_capture_flows_total", "Captured calls (--capture), by result: written to the flow "
    "file, dropped (the writer fell behind), failed (a write or encoding error).", ["result"],
    registry=REGISTRY,
)
