"""Where the added latency at 50 req/s comes from (issue #5). A diagnostic, not part of the suite.

The suite's latency measure, with an aiohttp client (``bench/clients.py:open_loop``) on the
default asyncio loop, reported opgate's added p50 as ~1.3 ms where kubectl proxy added ~0.6 ms
and nginx ~0.14 ms. This asks two questions about that number, on the same static nginx
upstream and the same placement as the suite (client on the load generator's core, proxy on
its own core, upstream with the client):

1. Is the client fair? Each path is timed by two clients: the aiohttp client the suite used
   before (``open_loop``: one task per request on the default asyncio loop) and the lean
   blocking client it uses now (``paced_gets``: one persistent keep-alive connection,
   TCP_NODELAY, the request pre-built as bytes, ``sendall`` + ``recv`` until the body is
   complete, timed with ``perf_counter_ns``, no event loop). Where both show the same added
   latency, the number is the proxy's, not the client's.
2. Is the time spent inside opgate? For opgate, ``opgate_request_duration_seconds`` (accept to
   last byte, measured by opgate itself) gives the mean server-side time per call over the run,
   and the proxy's CPU time per call (``/proc`` utime+stime delta over the run, minus the same
   process's idle CPU over an equal quiet period) says how much of it is computation. A rate
   sweep (50 and 200 req/s; others with ``--rates``) shows whether a lone request at 50 req/s
   pays for a cold core (caches, frequency, wake-up) that a busier proxy does not. (The lean
   client is one sequential connection: at a rate where a call takes longer than the interval
   it falls behind, and the wait is counted; read high rates only where latency < 1/rate.)

    python -m bench.latency_probe [--seconds 8] [--rates 50,200] [--tls]
                                  [--paths direct,opgate,...]

Every process it starts is stopped by PID at the end. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import procstat
from bench.clients import open_loop, paced_gets
from bench.plan import pct
from bench.procs import Procs, free_port, wait_port
from bench.procstat import Layout
from bench.upstreams import SMALL, start_static

DEFAULT_PATHS = ("direct", "opgate", "opgate-full", "opgate-aiohttp", "kubectl-proxy",
                 "nginx-proxy")


def _histogram(admin: str) -> tuple[float, float]:
    """(sum seconds, count) of opgate_request_duration_seconds over every verb."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(admin + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != "opgate_request_duration_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                total += sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
    return total, count


def main() -> None:
    from bench.paths import start_paths
    from bench.run import _kubectl

    p = argparse.ArgumentParser(prog="python -m bench.latency_probe",
                                description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=8)
    p.add_argument("--rates", default="50,200")
    p.add_argument("--tls", action="store_true", help="the TLS upstream (default: plain HTTP)")
    p.add_argument("--paths", default=",".join(DEFAULT_PATHS))
    args = p.parse_args()
    rates = [float(r) for r in args.rates.split(",") if r]
    names = tuple(n for n in args.paths.split(",") if n)
    work = Path(tempfile.mkdtemp(prefix="opgate-latprobe-"))
    procs = Procs(work)
    layout = Layout.for_machine()
    try:
        rport = free_port()
        redis = procs.start("redis", ["redis-server", "--port", str(rport), "--bind",
                                      "127.0.0.1", "--save", "", "--appendonly", "no",
                                      "--dir", str(work)])
        wait_port(rport, proc=redis)
        static = start_static(procs, work, big=False)
        upstream = static.tls if args.tls else static.http
        targets = start_paths(procs, work, upstream=upstream, kubectl=_kubectl(),
                              redis_url=f"redis://127.0.0.1:{rport}/0", names=names)
        for t in targets:
            if t.pid is not None:
                procstat.pin(t.pid, layout.proxy)
        for pid in (static.nginx_pid, static.watch_pid, redis.pid):
            assert pid is not None
            procstat.pin(pid, layout.upstream)
        os.sched_setaffinity(0, layout.gen)
        idle: dict[str, float] = {}
        for t in targets:  # idle CPU per second of each proxy (timers, watchers), to subtract
            if t.pid is not None:
                quiet = procstat.CpuUsage.begin(t.pid)
                time.sleep(3)
                idle[t.name] = quiet.us_per(1) / 3
        print(f"upstream {upstream.name}; placement: {layout.describe()}; {args.seconds:g} s "
              "per cell; ms; CPU = proxy CPU µs per call minus its idle CPU\n")
        print("| rate | path | aiohttp p50 | aiohttp p99 | lean p50 | lean p99 | lean added p50 "
              "| opgate server mean | proxy CPU µs/call |")
        print("|---|---|---|---|---|---|---|---|---|")
        for rate in rates:
            base = None
            for t in targets:
                lat_a, _ = asyncio.run(open_loop(t.url + SMALL, rate=rate, seconds=args.seconds,
                                                 headers=t.headers, ca_file=t.ca_file))
                hist = _histogram(t.admin) if t.admin else None
                cpu = procstat.CpuUsage.begin(t.pid) if t.pid is not None else None
                began = time.perf_counter()
                lat_r, errors = paced_gets(t.url + SMALL, rate=rate, seconds=args.seconds,
                                           headers=t.headers, ca_file=t.ca_file)
                if errors:
                    print(f"  ({t.name}: {errors} non-200 answers)", flush=True)
                took = time.perf_counter() - began
                cpu_us = "-"
                if cpu is not None and t.pid is not None:
                    used = cpu.us_per(1) - idle.get(t.name, 0.0) * took
                    cpu_us = f"{used / (len(lat_r) + errors):.0f}"
                server = "-"
                if hist is not None and t.admin:
                    after = _histogram(t.admin)
                    n = after[1] - hist[1]
                    server = f"{(after[0] - hist[0]) / max(n, 1) * 1e3:.3f}"
                p50 = statistics.median(lat_r)
                base = p50 if t.name == "direct" else base
                added = f"{p50 - base:.3f}" if base is not None and t.name != "direct" else "-"
                print(f"| {rate:g} | {t.name} | {pct(lat_a, 50):.3f} | {pct(lat_a, 99):.3f} "
                      f"| {p50:.3f} | {pct(lat_r, 99):.3f} | {added} | {server} | {cpu_us} |",
                      flush=True)
    finally:
        procs.stop_all()


if __name__ == "__main__":
    main()
