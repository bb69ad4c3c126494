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

from bench import wakeup

FULL = "opgate-full"
KUBECTL = "kubectl-proxy"


@dataclass(frozen=True, slots=True)
class Check:
    what: str
    measured: float | None
    unit: str
    target: str
    ok: bool | None  # None: not measured in this run
    why: str = ""  # for a missed target: what this run's own numbers say about the miss

    @property
    def limit(self) -> float:
        return float(self.target.partition(" ")[2].split()[0].rstrip("x"))

    @property
    def digits(self) -> int:
        """Decimals that keep a miss from reading as the target itself (0.847 is not 0.85)."""
        if self.ok is not False or self.measured is None:
            return 2
        for digits in (2, 3, 4):
            if round(self.measured, digits) != round(self.limit, digits):
                return digits
        return 4

    @property
    def gap(self) -> str:
        """By how much a missed target is missed: ``"0.18 ms (36%) over"``, ``"0.42x (21%)
        short"`` ("" when met or not measured)."""
        if self.ok is not False or self.measured is None:
            return ""
        sign, limit = self.target.partition(" ")[0], self.limit
        diff = self.measured - limit if sign == "≤" else limit - self.measured
        unit = "x" if self.unit == "x" else f" {self.unit}"
        share = diff / limit
        return (f"{diff:.{self.digits}f}{unit} ({share:.{1 if share < 0.01 else 0}%}) "
                f"{'over' if sign == '≤' else 'short'}")


def _get(d: Any, *keys: str) -> float | None:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return float(d) if isinstance(d, int | float) and not math.isnan(d) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _check(what: str, value: float | None, unit: str, target: str,
           test: Callable[[float], bool], why: Callable[[], str] | None = None) -> Check:
    ok = None if value is None else test(value)
    return Check(what, value, unit, target, ok, why() if ok is False and why else "")


def _us(v: float | None) -> str:
    return "?" if v is None else f"{v:,.0f} µs"


def _ms(v: float | None) -> str:
    return "?" if v is None else f"{v:.2f} ms"


def _more(a: float | None, b: float | None) -> str:
    return "?" if a is None or not b else f"{a / b - 1:+.0%}"


def _why_cpu(tls: Any) -> str:
    def row(name: str) -> float | None:
        return _get(tls, "small_get", "pinned", name, "cpu_us")
    full, plain, kubectl = row(FULL), row("opgate"), row(KUBECTL)
    chain = None if full is None or plain is None else full - plain
    return (f"opgate-full used {_us(full)} of CPU per request, kubectl proxy {_us(kubectl)}; "
            f"opgate without policies {_us(plain)}, so the chain cost {_us(chain)} per call "
            "(its middlewares one by one: \"What each middleware costs per call\").")


def _why_unpinned(tls: Any) -> str:
    def cpu(label: str, name: str) -> float | None:
        return _get(tls, "small_get", label, name, "cpu_us")
    workers = _get(tls, "small_get", "unpinned", FULL, "workers")
    return (f"Unpinned, opgate-full ({workers or 1:.0f} worker processes) used "
            f"{_us(cpu('unpinned', FULL))} of CPU per request against "
            f"{_us(cpu('pinned', FULL))} as one pinned process "
            f"({_more(cpu('unpinned', FULL), cpu('pinned', FULL))}); kubectl proxy "
            f"{_us(cpu('unpinned', KUBECTL))} against {_us(cpu('pinned', KUBECTL))} "
            f"({_more(cpu('unpinned', KUBECTL), cpu('pinned', KUBECTL))}): processes sharing "
            "both cores with wrk, nginx and Redis pay more per request than the threads of one "
            "process. The ratio is of the medians over the unpinned rounds (a full run has 3).")


def _why_latency(tls: Any, key: str, wake: Any) -> str:
    def at(name: str, field: str) -> float | None:
        return _get(tls, "latency", name, field)
    cold, warm = at(FULL, "cpu_us"), _get(tls, "small_get", "pinned", FULL, "cpu_us")
    factor = f"{cold / warm:.1f}x" if cold and warm else "?"
    machine = ""
    if wake and "slowdown" in wake:
        machine = (f" On this machine (`bench/wakeup.py`, same run) {wakeup.describe(wake)}: a "
                   "proxy takes each call across cores four times (client, proxy, upstream, "
                   "proxy, client) where the direct path stays on one core, and runs its "
                   "per-call code on a core woken from idle.")
    return (f"At 50 req/s opgate-full used {_us(cold)} of CPU per call against {_us(warm)} "
            f"per request under load ({factor}).{machine} In the same rounds kubectl proxy "
            f"added {_ms(at(KUBECTL, key))}, opgate without policies {_ms(at('opgate', key))}, "
            f"nginx {_ms(at('nginx-proxy', key))}.")


def _why_list_tls(tls: Any, size: str) -> str:
    def at(name: str, field: str) -> float | None:
        return _get(tls, "list", size, name, field)
    kubectl = at(KUBECTL, "mb_s")
    full_cpu, kubectl_cpu = at(FULL, "cpu_s_per_gb"), at(KUBECTL, "cpu_s_per_gb")
    cpu = (f"opgate-full used {'?' if full_cpu is None else f'{full_cpu:.2f} s'} of CPU per GB, "
           f"kubectl proxy {'?' if kubectl_cpu is None else f'{kubectl_cpu:.2f} s'}")
    proxy, other = at(FULL, "proxy_core_busy"), at(FULL, "other_cores_busy")
    if proxy is not None and other is not None and other >= 95 and proxy < other - 5:
        return (f"opgate was not the bottleneck: during opgate-full's transfers the core of the "
                f"upstream (nginx, encrypting) and of curl was {other:.0f}% busy, opgate's own "
                f"core {proxy:.0f}%. {cpu}. On a machine whose upstream and client have cores "
                "to spare, the ratio follows the CPU per GB.")
    needed = f"{1000 / (2 * kubectl):.2f} s" if kubectl else "?"
    return (f"The proxy's core set the pace: {cpu}; twice kubectl proxy's "
            f"{'?' if kubectl is None else f'{kubectl:.0f}'} MB/s needs at most {needed} per GB. "
            "What is left is AES-GCM, the copy of every ciphertext byte into OpenSSL's memory "
            "BIO and the kernel's copies (bench/README.md, \"TLS upstream I/O\").")


def _why_list_plain(http: Any, size: str) -> str:
    def at(name: str, field: str) -> float | None:
        return _get(http, "list", size, name, field)
    proxy, other = at(FULL, "proxy_core_busy"), at(FULL, "other_cores_busy")
    cpu = at(FULL, "cpu_s_per_gb")
    used = "?" if cpu is None else f"{cpu:.2f} s"
    if proxy is not None and other is not None and other >= 95 and proxy < other - 5:
        return (f"The other core set the pace: during opgate-full's transfers the core of the "
                f"upstream (nginx) and of curl was {other:.0f}% busy, opgate's own core "
                f"{proxy:.0f}% (it used {used} of CPU per GB). `direct` keeps nginx and curl on "
                "that one core with nothing in between; a proxy adds the wake-ups of a second "
                "core to every hand-over (bench/README.md, \"Rounds\", for the spread).")
    return f"opgate-full used {used} of CPU per GB, its core {proxy or 0:.0f}% busy."


def biggest_list(tier: Any) -> str | None:
    sizes = [int(k) for k in (tier or {}).get("list", {})]
    return str(max(sizes)) if sizes else None


def checks(results: dict[str, Any]) -> list[Check]:
    tiers = results.get("tiers", {})
    tls, http = tiers.get("tls", {}), tiers.get("http", {})
    wake = results.get("wakeup")
    out: list[Check] = []
    cpu = _ratio(_get(tls, "small_get", "pinned", FULL, "cpu_us"),
                 _get(tls, "small_get", "pinned", KUBECTL, "cpu_us"))
    out.append(_check("CPU per relayed small GET over TLS, full chain vs kubectl proxy", cpu, "x",
                      "≤ 1.0x", lambda v: v <= 1.0, lambda: _why_cpu(tls)))
    rps = _ratio(_get(tls, "small_get", "unpinned", FULL, "rps"),
                 _get(tls, "small_get", "unpinned", KUBECTL, "rps"))
    out.append(_check("small GET req/s unpinned over TLS, full chain vs kubectl proxy", rps, "x",
                      "≥ 1.0x", lambda v: v >= 1.0, lambda: _why_unpinned(tls)))
    out.append(_check("added latency at 50 req/s, p50 (TLS, full chain)",
                      _get(tls, "latency", FULL, "added_p50_ms"), "ms", "≤ 0.5 ms",
                      lambda v: v <= 0.5, lambda: _why_latency(tls, "added_p50_ms", wake)))
    out.append(_check("added latency at 50 req/s, p99 (TLS, full chain)",
                      _get(tls, "latency", FULL, "added_p99_ms"), "ms", "≤ 2 ms",
                      lambda v: v <= 2.0, lambda: _why_latency(tls, "added_p99_ms", wake)))
    size = biggest_list(http)
    if size:
        out.append(_check(f"LIST {size} MB over plain HTTP, full chain vs direct",
                          _ratio(_get(http, "list", size, FULL, "mb_s"),
                                 _get(http, "list", size, "direct", "mb_s")), "x", "≥ 0.85x",
                          lambda v: v >= 0.85, lambda: _why_list_plain(http, size)))
    size = biggest_list(tls)
    if size:
        out.append(_check(f"LIST {size} MB over TLS, full chain vs kubectl proxy",
                          _ratio(_get(tls, "list", size, FULL, "mb_s"),
                                 _get(tls, "list", size, KUBECTL, "mb_s")), "x", "≥ 2x",
                          lambda v: v >= 2.0, lambda: _why_list_tls(tls, size)))
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
