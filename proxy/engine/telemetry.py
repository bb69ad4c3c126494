"""Every Prometheus metric opgate exports, defined once (prefix ``opgate_``).

Label values always come from bounded sets (verbs, API groups and resources the cluster serves,
status codes, decisions, policy and middleware names): never an object name, a user or a key.
Components import the metric they update from here; the admin listener serves ``REGISTRY``.

With ``--workers N`` every worker writes its values to files in ``PROMETHEUS_MULTIPROC_DIR``
(prometheus_client's multiprocess mode, chosen by that variable at import) and the supervisor's
``/metrics`` adds them up: counters and histograms sum over all workers, dead ones included;
each gauge's ``multiprocess_mode`` says how it combines the live workers' values. In a single
process the mode is ignored.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                    10, 30, 60)

REQUESTS = Counter(
    "opgate_requests_total", "API calls handled, by outcome.",
    ["verb", "group", "resource", "code", "decision"], registry=REGISTRY,
)
REQUEST_DURATION = Histogram(
    "opgate_request_duration_seconds", "Time from accept to the last byte, non-long-running calls.",
    ["verb"], buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)
UPSTREAM_DURATION = Histogram(
    "opgate_upstream_duration_seconds", "Time until the apiserver's response headers arrived.",
    ["verb"], buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)
INFLIGHT = Gauge("opgate_inflight_requests", "Calls being handled now.", registry=REGISTRY,
                 multiprocess_mode="livesum")
WATCHES_OPEN = Gauge("opgate_watches_open", "Watch streams open now.", registry=REGISTRY,
                     multiprocess_mode="livesum")
UPSTREAM_ERRORS = Counter(
    "opgate_upstream_errors_total", "Calls that failed to reach the apiserver.", ["kind"],
    registry=REGISTRY,
)
MIDDLEWARE_ERRORS = Counter(
    "opgate_middleware_errors_total", "Exceptions raised by middleware hooks.",
    ["middleware", "hook"], registry=REGISTRY,
)
RATELIMIT_DECISIONS = Counter(
    "opgate_ratelimit_decisions_total", "Rate-limit decisions.", ["policy", "result"],
    registry=REGISTRY,
)
QUOTA_DENIALS = Counter(
    "opgate_quota_denials_total", "Creates denied by a quota.", ["resource"], registry=REGISTRY,
)
QUOTA_USAGE = Gauge(
    "opgate_quota_usage", "Objects counted against opgate quotas.", ["namespace", "resource"],
    registry=REGISTRY, multiprocess_mode="livemax",  # every worker counts the same objects
)
IDENTITY_DENIALS = Counter(
    "opgate_identity_denials_total", "Calls refused by the identity middleware.", ["reason"],
    registry=REGISTRY,
)
POLICY_RELOADS = Counter(
    "opgate_policy_reloads_total", "Policy reload attempts.", ["result"], registry=REGISTRY,
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
