"""Request-level measures, each run over every path in interleaved rounds; medians reported.

* ``idle``: each proxy's RSS once started and warmed up by 50 requests.
* ``small_get``: closed-loop ``wrk`` on the ~1 KB ConfigMap: req/s, p50/p99, the proxy's CPU µs
  per request (``/proc`` utime+stime delta / requests) and, on the full chain, Redis calls per
  admitted request (``INFO commandstats`` delta / 2xx responses). Pinned rounds (every proxy a
  single process on its one core: CPU per request), then unpinned rounds (every process may
  use every core, as in a pod without CPU pinning) in which the full chain runs as
  ``--workers auto`` (one worker process per CPU on one ``SO_REUSEPORT`` port), as the issue's
  throughput target asks ("use every core"); the other paths are as in the pinned rounds.
* ``latency``: 50 req/s on a fixed schedule from a lean blocking client (one keep-alive
  connection, no event loop in the timed section: :func:`bench.clients.paced_gets`); p50/p99,
  the same minus ``direct`` (added latency), and the proxy's CPU µs per call at that rate.
* ``lists``: large LIST MB/s through ``curl``, the proxy's CPU per GB and its RSS growth (peak
  during the transfer minus RSS before it).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

from bench import authcheck, procstat
from bench.clients import open_loop, paced_gets
from bench.load import curl, wrk
from bench.paths import Target, with_workers
from bench.plan import Bench, median, per_round, rounded
from bench.upstreams import LISTS, SMALL

Result = dict[str, Any]


def _log(msg: str) -> None:
    print(f"bench: {msg}", flush=True)


def redis_calls(url: str | None) -> int:
    """Commands Redis has run so far, except ``INFO`` itself."""
    if not url:
        return 0
    import redis

    client = redis.Redis.from_url(url)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")


def idle(bench: Bench, targets: Sequence[Target]) -> Result:
    out: Result = {}
    with bench.as_generator():
        for t in targets:
            if t.pid is None:
                continue
            asyncio.run(open_loop(t.url + SMALL, rate=500, seconds=0.1, headers=t.headers,
                                  ca_file=t.ca_file))
            time.sleep(0.5)
            out[t.name] = {"rss_mb": round(procstat.rss_mb(t.pid), 1)}
    return out


def _wrk_once(bench: Bench, t: Target, *, pinned: bool) -> Result:
    seconds = bench.plan.wrk_seconds
    cpu = procstat.CpuUsage.begin(t.pid) if t.pid is not None else None
    redis_cpu = procstat.CpuUsage.begin(bench.redis_pid) if bench.redis_pid else None
    full = t.full_chain
    calls = redis_calls(bench.redis_url) if full else 0
    r = wrk(t.url + SMALL, seconds=seconds, connections=bench.plan.connections,
            headers=t.headers, cpus=bench.gen_cpus(pinned))
    admitted = r.requests - r.errors
    run: Result = {"rps": r.rps, "p50_ms": r.p50_ms, "p99_ms": r.p99_ms, "requests": r.requests,
                   "errors": r.errors}
    if cpu is not None:
        run["cpu_user_us"], run["cpu_sys_us"] = cpu.split_per(r.requests)
        run["cpu_us"] = run["cpu_user_us"] + run["cpu_sys_us"]
    if full and bench.redis_url:
        run["redis_calls_per_req"] = (redis_calls(bench.redis_url) - calls) / max(1, admitted)
        if redis_cpu is not None:
            run["redis_cpu_us"] = redis_cpu.us_per(r.requests)
    if r.errors:
        _log(f"  {t.name}: {r.errors} errors of {r.requests} requests")
    return run


def _summary(runs: list[Result]) -> Result:
    keys = [k for k in runs[0] if isinstance(runs[0][k], float | int)]
    out = {k: median([float(r[k]) for r in runs if r.get(k) is not None]) for k in keys}
    out["rounds"] = len(runs)
    return rounded(out)


def small_get(bench: Bench, targets: Sequence[Target]) -> Result:
    """Pinned rounds then unpinned ones (only the latter when the bench does not pin)."""
    out: Result = {}
    modes = [("pinned", True, bench.plan.rounds), ("unpinned", False, bench.plan.unpinned_rounds)]
    if not bench.pinning:
        modes = [("unpinned", False, bench.plan.rounds)]
    for label, pinned, rounds in modes:
        swap = (with_workers(bench.procs, bench.work, targets, redis_url=bench.redis_url)
                if not pinned else contextlib.nullcontext(list(targets)))
        with swap as these:
            bench.place(these, pinned=pinned)
            runs: dict[str, list[Result]] = {t.name: [] for t in these}
            copies = [t for t in these if t.workers > 1]
            probes = {t.name: authcheck.probe(t) for t in copies}
            for t in copies:  # fresh processes: let every worker verify the token, open its
                # Redis and upstream connections before the clock starts (as the others have)
                wrk(t.url + SMALL, seconds=1, connections=bench.plan.connections,
                    headers=t.headers, cpus=None)
            for i in range(rounds):
                for t in these:
                    _log(f"  small GET {label} round {i + 1}/{rounds}: {t.name}"
                         + (f" (--workers auto: {t.workers} workers)" if t.workers > 1 else ""))
                    runs[t.name].append(_wrk_once(bench, t, pinned=pinned))
            out[label] = {name: _summary(rs) for name, rs in runs.items() if rs}
            for t in copies:
                out[label][t.name]["workers"] = t.workers
                out.setdefault("identity_workers", {})[t.name] = {
                    "probes": probes[t.name], **authcheck.scrape(t)}
    bench.place(targets, pinned=True)
    return out


def latency(bench: Bench, targets: Sequence[Target]) -> Result:
    plan = bench.plan
    samples: dict[str, list[list[float]]] = {t.name: [] for t in targets}
    errors: dict[str, int] = dict.fromkeys(samples, 0)
    cpu_us: dict[str, list[float]] = {t.name: [] for t in targets if t.pid is not None}
    bench.place(targets, pinned=True)
    with bench.as_generator():
        rounds = plan.latency_rounds or plan.rounds
        for i in range(rounds):
            for t in targets:
                _log(f"  latency at {plan.latency_rate:g} req/s round {i + 1}/{rounds}: "
                     f"{t.name}")
                cpu = procstat.CpuUsage.begin(t.pid) if t.pid is not None else None
                lat, err = paced_gets(t.url + SMALL, rate=plan.latency_rate,
                                      seconds=plan.latency_seconds, headers=t.headers,
                                      ca_file=t.ca_file)
                if cpu is not None:  # includes what the proxy does while idle (timers)
                    cpu_us[t.name].append(cpu.us_per(len(lat) + err))
                samples[t.name].append(lat)
                errors[t.name] += err
    out = {name: {**row, "errors": errors[name]}
           for name, row in per_round(samples, unit="ms").items()}
    for name, values in cpu_us.items():
        out[name]["cpu_us"] = median(values)
    return {name: rounded(row) for name, row in out.items()}


def lists(bench: Bench, targets: Sequence[Target], *, sizes: dict[int, str] | None = None,
          transfers: int = 1, rounds: int = 0) -> Result:
    """MB/s per path and size; ``sizes`` maps a label (MB) to a path (default: nginx's).
    ``transfers``: LISTs back to back per round and path (their CPU summed: the CPU clock ticks
    every 10 ms, a coarse grain for one transfer of a small LIST); ``rounds`` (0: the plan's)."""
    plan = bench.plan
    rounds = rounds or plan.rounds
    paths = sizes or {mb: LISTS[mb] for mb in plan.list_mb}
    bench.place(targets, pinned=True)
    out: Result = {}
    for mb, path in paths.items():
        runs: dict[str, list[Result]] = {t.name: [] for t in targets}
        for i in range(rounds):
            for t in targets:
                _log(f"  LIST {mb} MB round {i + 1}/{rounds}: {t.name}")
                run: Result = {}
                if t.pid is not None:
                    before = procstat.rss_mb(t.pid)
                    procstat.reset_hwm(t.pid)
                    cpu = procstat.CpuUsage.begin(t.pid)
                cores = procstat.CoreBusy.begin()
                done = [curl(t.url + path, headers=t.headers, ca_file=t.ca_file,
                             cpus=bench.gen_cpus(True)) for _ in range(transfers)]
                d = done[0]
                moved = sum(x.bytes for x in done)
                run.update(mb_s=sum(x.mb_s for x in done) / len(done), bytes=d.bytes,
                           http=d.http_version)
                if bench.pinning:  # which core was full: the proxy's, or the other side's
                    run.update(proxy_core_busy=cores.percent(bench.layout.proxy),
                               other_cores_busy=cores.percent(bench.layout.gen
                                                              | bench.layout.upstream))
                if t.pid is not None:
                    run["rss_growth_mb"] = procstat.hwm_mb(t.pid) - before
                    run["rss_before_mb"] = before
                    run["cpu_s_per_gb"] = cpu.us_per(1) / 1e6 / (moved / 1e9)
                runs[t.name].append(run)
        out[str(mb)] = {}
        for name, rs in runs.items():
            row = _summary(rs)
            row["http"] = rs[0]["http"]
            row["rss_growth_max_mb"] = round(max(r.get("rss_growth_mb", 0.0) for r in rs), 1)
            out[str(mb)][name] = row
    return out
