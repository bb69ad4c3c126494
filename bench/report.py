"""Renders a run's results as Markdown (``REPORT.md``, also printed) next to ``latest.json``.

Tables put each path beside ``direct`` and ``kubectl proxy`` as ratios, so a reader sees at a
glance what the proxy costs and how it compares with the tool operators already use; the
targets of issue #5 come first with a "met?" column.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from bench import wakeup
from bench.paths import AIOHTTP
from bench.targets import KUBECTL, checks

TIER_TITLES = {
    "tls": "Static upstream (nginx) over TLS + HTTP/2: the headline",
    "http": "Static upstream (nginx) over plain HTTP",
    "apiserver": "Real kube-apiserver (e2e harness, TLS, unpinned)",
}


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        if abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:.{digits}f}"
    return str(v)


def _ratio(a: Any, b: Any) -> str:
    if not isinstance(a, int | float) or not isinstance(b, int | float) or not b:
        return "-"
    return f"{a / b:.2f}x"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return [*lines, ""]


def _vs(rows: dict[str, Any], name: str, key: str) -> list[str]:
    me = rows[name].get(key)
    return [_ratio(me, rows.get("direct", {}).get(key)), _ratio(me, rows.get(KUBECTL, {}).get(key))]


def _small_get(sg: dict[str, Any], label: str) -> list[str]:
    rows = sg.get(label)
    if not rows:
        return []
    out = [f"**Small GET, {label}** (wrk, closed loop; ~1 KB ConfigMap; CPU of the proxy process "
           "tree per request)", ""]
    multi = [f"`{n}` ({r['workers']} workers)" for n, r in rows.items() if r.get("workers")]
    if multi:
        out += [f"Here {', '.join(multi)} run{'s' if len(multi) == 1 else ''} as `opgate serve "
                "--workers auto`: one worker process per CPU on one SO_REUSEPORT port, under a "
                "supervisor (CPU summed over all of them); every other path is the same single "
                "process as in the pinned rounds.", ""]
    body = [[n, _fmt(r.get("rps")), _fmt(r.get("p50_ms")), _fmt(r.get("p99_ms")),
             _fmt(r.get("cpu_us"), 1), _split(r), *_vs(rows, n, "rps"),
             _ratio(r.get("cpu_us"), rows.get(KUBECTL, {}).get("cpu_us")),
             _fmt(int(r.get("errors", 0)))]
            for n, r in rows.items()]
    return out + _table(["path", "req/s", "p50 ms", "p99 ms", "CPU µs/req", "user + sys µs",
                         "req/s vs direct", "req/s vs kubectl", "CPU vs kubectl",
                         "errors (median)"], body)


def _split(r: dict[str, Any]) -> str:
    """User and kernel CPU per request (medians of their own, so not exactly the total's)."""
    if r.get("cpu_user_us") is None:
        return "-"
    return f"{_fmt(r['cpu_user_us'], 0)} + {_fmt(r.get('cpu_sys_us'), 0)}"


def _busy(row: dict[str, Any]) -> str:
    proxy, other = row.get("proxy_core_busy"), row.get("other_cores_busy")
    if proxy is None or other is None:
        return "-"
    return f"{proxy:.0f} / {other:.0f}"


def _tier(name: str, tier: dict[str, Any]) -> list[str]:
    out = [f"## {TIER_TITLES.get(name, name)}", ""]
    if tier.get("cipher"):
        out += [f"Upstream TLS: {tier['cipher']} for every path (the suite a Go apiserver picks; "
                "bench/README.md, \"Upstreams\").", ""]
    if "small_get" in tier:
        out += _small_get(tier["small_get"], "pinned") + _small_get(tier["small_get"], "unpinned")
    if "latency" in tier:
        rows = tier["latency"]
        out += ["**Latency at 50 req/s** (a fixed schedule from a lean blocking client on one "
                "keep-alive connection; median over rounds of each round's percentile; added = "
                "path minus direct in the same round; CPU = the proxy's CPU per call at this rate, "
                "its idle timers included)", ""]
        out += _table(["path", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms",
                       "CPU µs/call", "samples", "errors"],
                      [[n, _fmt(r["p50_ms"], 3), _fmt(r["p99_ms"], 3),
                        _fmt(r.get("added_p50_ms"), 3), _fmt(r.get("added_p99_ms"), 3),
                        _fmt(r.get("cpu_us"), 0), str(r["samples"]), str(r.get("errors", 0))]
                       for n, r in rows.items()])
    for size, rows in tier.get("list", {}).items():
        out += [f"**LIST {size} MB** (curl to /dev/null; RSS growth = peak during the transfer "
                "minus RSS before it; busy = how much of its time the proxy's core, and the "
                "core(s) of the upstream and curl, were busy during the transfer: the one near "
                "100% set the pace)", ""]
        out += _table(["path", "MB/s", "vs direct", "vs kubectl", "RSS growth MB (max)",
                       "CPU s/GB", "busy % proxy / upstream + curl", "client protocol"],
                      [[n, _fmt(r.get("mb_s"), 0), *_vs(rows, n, "mb_s"),
                        _fmt(r.get("rss_growth_max_mb"), 1), _fmt(r.get("cpu_s_per_gb")),
                        _busy(r), f"HTTP/{r.get('http')}"] for n, r in rows.items()])
    if "watch" in tier:
        out += ["**Watch event latency** (upstream send stamp to client receive; medians over "
                "rounds as above)", ""]
        out += _table(["path", "p50 µs", "p99 µs", "added p50 µs", "added p99 µs", "events"],
                      [[n, _fmt(r["p50_us"], 0), _fmt(r["p99_us"], 0),
                        _fmt(r.get("added_p50_us"), 0), _fmt(r.get("added_p99_us"), 0),
                        str(r["samples"])] for n, r in tier["watch"].items()])
    if "open_watches" in tier:
        out += ["**Open watches** (RSS of the proxy with the watches open)", ""]
        out += _table(["path", "open", "RSS before MB", "RSS open MB", "KB per watch",
                       "seconds to open"],
                      [[n, str(r["opened"]), _fmt(r["rss_before_mb"], 1),
                        _fmt(r["rss_open_mb"], 1), _fmt(r["kb_per_watch"], 1),
                        _fmt(r["open_seconds"], 1)] for n, r in tier["open_watches"].items()])
    if "idle" in tier:
        out += ["**Idle RSS** (started, 50 requests served)", ""]
        out += _table(["path", "RSS MB"], [[n, _fmt(r["rss_mb"], 1)]
                                           for n, r in tier["idle"].items()])
    out += _identity(tier)
    redis = tier.get("small_get", {}).get("pinned", {}).get("opgate-full", {})
    if "redis_calls_per_req" in redis:
        out += [f"Redis calls per admitted request (full chain, leasing on): "
                f"**{redis['redis_calls_per_req']:.4f}**; redis-server CPU "
                f"{_fmt(redis.get('redis_cpu_us'), 2)} µs per request.", ""]
    return out


def _counts(d: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in d.items()) or "none"


def _identity(tier: dict[str, Any]) -> list[str]:
    checks = dict(tier.get("identity", {}))
    for name, check in tier.get("small_get", {}).get("identity_workers", {}).items():
        checks[f"{name} (--workers auto copy)"] = check
    if not checks:
        return []
    out = ["**Identity (and quota) on the full chain** (probe GETs before the measures: the "
           "caller's token, no token, the caller's claims signed by an unpublished key; then "
           "opgate's /metrics after the tier: calls by decision/code, identity denials by "
           "reason; the quota counter's state from /readyz?verbose)", ""]
    rows = []
    for name, c in checks.items():
        p = c.get("probes", {})
        rows.append([name, str(p.get("caller_token")), str(p.get("no_token")),
                     str(p.get("foreign_key")), _counts(c.get("calls", {})),
                     _counts(c.get("identity_denials", {})), c.get("quota_counts") or "-"])
    return out + _table(["path", "caller token", "no token", "foreign key", "calls (decision/code)",
                         "identity denials", "quota counter"], rows)


def _profile(prof: dict[str, Any]) -> list[str]:
    out = ["## Profile: what the hot path spends its time on", ""]
    if "error" in prof:
        return [*out, f"Not profiled: {prof['error']}", ""]
    out += [f"py-spy, {prof.get('samples', 0)} busy samples of opgate's event loop (full chain, "
            f"TLS upstream, under the small-GET load); collapsed stacks in `{prof.get('file')}` "
            f"(speedscope opens them), flame graph in `{prof.get('svg')}`.", ""]
    for key, title in (("areas", "Self time by area"),
                       ("self", "Top functions by self time (the function itself)"),
                       ("inclusive", "Top functions by inclusive time (with what they call)")):
        rows = prof.get(key, [])
        if rows:
            out += [f"{title}:", ""]
            out += _table(["%", "where"], [[f"{r['pct']:.1f}", f"`{r['function']}`"]
                                           for r in rows])
    return out


def _in_run_order(results: dict[str, Any]) -> dict[str, Any]:
    """``results`` with the tiers in TIER_TITLES' order, each tier's rows in the order of its
    paths and LIST sizes ascending: latest.json is written with sorted keys, and a report
    rendered again from it must read as the run's own."""
    def order(value: Any, paths: list[str]) -> Any:
        if not isinstance(value, dict):
            return value
        keys = list(value)
        if keys and all(k in paths for k in keys):
            keys.sort(key=paths.index)
        elif keys and all(k.isdigit() for k in keys):
            keys.sort(key=int)
        return {k: order(value[k], paths) for k in keys}

    tiers = results.get("tiers", {})
    ranked = sorted(tiers, key=lambda n: list(TIER_TITLES).index(n) if n in TIER_TITLES
                    else len(TIER_TITLES))
    return {**results, "tiers": {n: order(tiers[n], list(tiers[n].get("paths", [])))
                                 for n in ranked}}


def markdown(results: dict[str, Any]) -> str:
    results = _in_run_order(results)
    m = results.get("machine", {})
    out = ["# opgate benchmark report", "",
           f"{results.get('date')} · {results.get('mode')} run · "
           f"{results.get('total_seconds')} s · measures: "
           f"{', '.join(results.get('measures', []))}", "",
           f"Machine: {m.get('nproc')} x {m.get('cpu')}, Linux {m.get('kernel')}, Python "
           f"{m.get('python')}, aiohttp {m.get('aiohttp')}, {m.get('nginx')}, {m.get('wrk')}, "
           f"{m.get('redis')}, kubectl {results.get('kubectl_version', '?')}.", "",
           f"opgate runs on Python {m.get('opgate_python', m.get('python'))} (bench/README.md, "
           "\"Which Python\").", "",
           f"Placement: {results.get('layout')} (plus unpinned rounds of small GETs, in which "
           "the full chain runs as `--workers auto`).", "",
           "Paths: `direct` (no proxy), `opgate` (no policies, no access log), `opgate-full` "
           "(identity verifying the caller's service-account JWT, cached; a fault rule that "
           "never fires; "
           + ("a quota on configmaps, counted by list+watch and checked on creates, which the "
              "bench never makes; " if results.get("quota") else
              "no quota: this build has no quota middleware; ")
           + "rate limits in Redis with leasing; metrics; access log and audit log (Metadata "
           "level, every call) to files), "
           "`kubectl-proxy`, `nginx-proxy` (the practical limit)"
           + (", `opgate-aiohttp` (the full chain on `--relay aiohttp`)"
              if AIOHTTP in results.get("plan", {}).get("paths", ()) else "") + ". "
           f"opgate paths run opgate's default relay (`--relay {m.get('opgate_relay', '?')}`) "
           "unless named otherwise. Every client of every path sends the same "
           "`Authorization: Bearer <caller JWT>`.", ""]
    if results.get("note"):
        out += [f"> {results['note']}", ""]
    out += ["## Targets (full chain)", ""]
    out += _table(["measure", "measured", "target", "met?"],
                  [[c.what, f"{_fmt(c.measured, c.digits)} {c.unit}" if c.measured is not None
                    else "-",
                    c.target, {True: "yes", False: "**no**", None: "n/a"}[c.ok]]
                   for c in checks(results)])
    missed = [c for c in checks(results) if c.ok is False]
    if missed:
        out += ["**Missed targets: by how much, and why** (from this run's own numbers)", ""]
        out += [f"* {c.what}: {_fmt(c.measured, c.digits)} {c.unit} against {c.target}, {c.gap}. "
                f"{c.why or 'See the tables below.'}" for c in missed]
        out += [""]
    for name, tier in results.get("tiers", {}).items():
        out += _tier(name, tier)
    if "reload" in results:
        r = results["reload"]
        out += ["## Hot reload", "",
                f"Policy file rewritten (rename) {r['repeats']} times, alternately adding and "
                "removing a rule: new digest on `/debug/policies` after "
                f"{_fmt(r['digest_ms_median'], 0)} ms (median; max {_fmt(r['digest_ms_max'], 0)}"
                f"), request behaviour changed after {_fmt(r['effect_ms_median'], 0)} ms "
                f"(median; max {_fmt(r['effect_ms_max'], 0)}).", ""]
    if "profile" in results:
        out += _profile(results["profile"])
    micro = results.get("ratelimit_micro")
    if micro:
        out += ["## Rate-limit middleware alone (`bench/ratelimit_bench.py`)", ""]
        out += ["```", micro["output"], "```", ""] if "output" in micro else [micro["error"], ""]
    chain = results.get("chain_micro")
    if chain:
        out += ["## What each middleware costs per call (`bench/chain_cost.py`)", "",
                "The full chain of the small-GET rounds, in-process: each call builds its "
                "context as the fast relay does and runs the entry and exit hooks of a 200 "
                "GET; \"cost\" is the whole chain minus the chain without that middleware "
                "(batches interleaved; fastest batch and median). The relay's own work (sockets, "
                "TLS, HTTP parsing) is not in these figures.", ""]
        out += ["```", chain["output"], "```", ""] if "output" in chain else [chain["error"], ""]
    out += ["## Notes on method", "",
            "* Added latency is measured with a lean blocking client (one keep-alive "
            "connection, no event loop in the timed section). The aiohttp client used before "
            "added about half a millisecond of its own to every request and its own hiccups to "
            "the p99; see bench/README.md, \"Added latency at 50 req/s\", and "
            "`python -m bench.latency_probe` to compare both clients, opgate's own request "
            "duration and the CPU per call at several rates.",
            "* At 50 req/s a proxy's core idles between calls and every call runs on cold "
            "caches: compare the latency table's CPU per call with the small-GET CPU per "
            "request (a saturated core) for every path, nginx included."
            + (f" This machine, measured in this run (`python -m bench.wakeup`): "
               f"{wakeup.describe(results['wakeup'])}." if "slowdown" in results.get("wakeup", {})
               else ""),
            "* The full chain's rate-limit rule keeps the default `failure: closed`: a Redis call "
            "slower than `--redis-timeout` (50 ms) on a busy machine makes opgate answer 503, "
            "which the tables count as errors (decision `unavailable` in the identity table's "
            "calls).",
            "* The unpinned small-GET rounds run the full chain as `--workers auto`, a copy "
            "started for them; the pinned rounds and every other measure use the single "
            "process.", ""]
    out += ["---", "Raw numbers: `bench/results/latest.json`.", ""]
    return "\n".join(out)


def write(results: dict[str, Any], directory: Path) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    text = markdown(results)
    (directory / "REPORT.md").write_text(text)
    (directory / "latest.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    return text
