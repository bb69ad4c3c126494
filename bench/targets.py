"""The targets of issue #5, checked against a run's results (the report's "target / met?").

Every target is about the full chain (``opgate-full``: every middleware that exists) and most
are ratios, so a busy machine moves both sides; absolute ones (latency, memory, reload time)
are what an operator's sidecar budget is written in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

FULL = "opgate-full"
KUBECTL = "kubectl-proxy"


@dataclass(frozen=True, slots=True)
class Check:
    what: str
    measured: float | None
    unit: str
    target: str
    ok: bool | None  # None: not measured in this run


def _get(d: Any, *keys: str) -> float | None:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return float(d) if isinstance(d, int | float) and not math.isnan(d) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _check(what: str, value: float | None, unit: str, target: str,
           test: Callable[[float], bool]) -> Check:
    return Check(what, value, unit, target, None if value is None else test(value))


def biggest_list(tier: Any) -> str | None:
    sizes = [int(k) for k in (tier or {}).get("list", {})]
    return str(max(sizes)) if sizes else None


def checks(results: dict[str, Any]) -> list[Check]:
    tiers = results.get("tiers", {})
    tls, http = tiers.get("tls", {}), tiers.get("http", {})
    out: list[Check] = []
    cpu = _ratio(_get(tls, "small_get", "pinned", FULL, "cpu_us"),
                 _get(tls, "small_get", "pinned", KUBECTL, "cpu_us"))
    out.append(_check("CPU per relayed small GET over TLS, full chain vs kubectl proxy", cpu, "x",
                      "≤ 1.0x", lambda v: v <= 1.0))
    rps = _ratio(_get(tls, "small_get", "unpinned", FULL, "rps"),
                 _get(tls, "small_get", "unpinned", KUBECTL, "rps"))
    out.append(_check("small GET req/s unpinned over TLS, full chain vs kubectl proxy", rps, "x",
                      "≥ 1.0x", lambda v: v >= 1.0))
    out.append(_check("added latency at 50 req/s, p50 (TLS, full chain)",
                      _get(tls, "latency", FULL, "added_p50_ms"), "ms", "≤ 0.5 ms",
                      lambda v: v <= 0.5))
    out.append(_check("added latency at 50 req/s, p99 (TLS, full chain)",
                      _get(tls, "latency", FULL, "added_p99_ms"), "ms", "≤ 2 ms",
                      lambda v: v <= 2.0))
    size = biggest_list(http)
    if size:
        out.append(_check(f"LIST {size} MB over plain HTTP, full chain vs direct",
                          _ratio(_get(http, "list", size, FULL, "mb_s"),
                                 _get(http, "list", size, "direct", "mb_s")), "x", "≥ 0.85x",
                          lambda v: v >= 0.85))
    size = biggest_list(tls)
    if size:
        out.append(_check(f"LIST {size} MB over TLS, full chain vs kubectl proxy",
                          _ratio(_get(tls, "list", size, FULL, "mb_s"),
                                 _get(tls, "list", size, KUBECTL, "mb_s")), "x", "≥ 2x",
                          lambda v: v >= 2.0))
    growth = [g for t in (tls, http) if (s := biggest_list(t)) == "200"
              and (g := _get(t, "list", s, FULL, "rss_growth_max_mb")) is not None]
    out.append(_check("RSS growth while relaying 200 MB (full chain, worst run)",
                      max(growth) if growth else None, "MB", "≤ 16 MB", lambda v: v <= 16))
    out.append(_check("watch event added latency p99 (TLS, full chain)",
                      _get(tls, "watch", FULL, "added_p99_us"), "µs", "≤ 1000 µs",
                      lambda v: v <= 1000))
    out.append(_check("RSS with 1,000 open watches (TLS, full chain)",
                      _get(tls, "open_watches", FULL, "rss_open_mb"), "MB", "≤ 150 MB",
                      lambda v: v <= 150))
    out.append(_check("idle RSS (full chain)", _get(tls, "idle", FULL, "rss_mb"), "MB",
                      "≤ 60 MB", lambda v: v <= 60))
    out.append(_check("policy change in effect (worst of the repeats)",
                      _get(results, "reload", "effect_ms_max"), "ms", "≤ 1000 ms",
                      lambda v: v <= 1000))
    return out
