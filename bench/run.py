"""One bench run: start the upstreams, then for each tier start every path and run the measures.

Tiers, in order: the static upstream over TLS + HTTP/2 (the headline: a real apiserver is TLS),
the same over plain HTTP, then the real kube-apiserver of the e2e harness (unpinned, fewer
measures: it is the realistic check, not the proxy's isolated cost). Each tier's proxies are
started fresh and stopped when it ends; everything still running is stopped in ``finally``,
also on Ctrl-C. Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench import authcheck, measures, streams, wakeup
from bench.caller import NAME as CALLER_NAME
from bench.caller import NAMESPACE as CALLER_NAMESPACE
from bench.caller import Caller, foreign_like
from bench.interpreter import opgate_python
from bench.measures import Result, _log
from bench.paths import Target, quota_supported, start_paths
from bench.plan import Bench, Plan
from bench.procs import Procs, free_port, wait_port
from bench.procstat import Layout
from bench.upstreams import LISTS, SMALL, Upstream, negotiated_cipher, start_static


def start_redis(bench: Bench) -> None:
    port = free_port()
    proc = bench.procs.start("redis", [
        "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
        "--appendonly", "no", "--dir", str(bench.work), "--protected-mode", "yes"])
    wait_port(port, proc=proc)
    assert proc.pid is not None
    bench.redis_url, bench.redis_pid = f"redis://127.0.0.1:{port}/0", proc.pid
    bench.support_pids.append(proc.pid)


def _kubectl() -> Path | None:
    try:
        from proxy.envtest.tools import find_tools

        return find_tools().kubectl
    except Exception as exc:  # no kubectl: the run goes on without that path
        _log(f"kubectl proxy skipped: {exc}")
        return None


def _timed(name: str, fn: Callable[[], Result], into: Result) -> None:
    started = time.monotonic()
    _log(f"{name} …")
    into[name] = fn()
    into.setdefault("seconds", {})[name] = round(time.monotonic() - started, 1)


def run_tier(bench: Bench, targets: Sequence[Target], *, static: bool) -> Result:
    want = bench.plan.measures
    out: Result = {"paths": [t.name for t in targets]}
    full = [t for t in targets if t.full_chain]
    checks = {t.name: {"probes": authcheck.probe(t)} for t in full}
    for name, check in checks.items():
        if not authcheck.expected(check["probes"]):
            _log(f"identity probes of {name} did not answer as expected: {check['probes']}")
    if "idle" in want:
        _timed("idle", lambda: measures.idle(bench, targets), out)
    if "small-get" in want:
        _timed("small_get", lambda: measures.small_get(bench, targets), out)
    if "latency" in want:
        _timed("latency", lambda: measures.latency(bench, targets), out)
    if "list" in want:
        sizes = None if static else {bench.plan.apiserver_list_mb: LISTS[64]}
        transfers = 1 if static else bench.plan.apiserver_list_transfers
        rounds = bench.plan.list_rounds if static else 0  # (the apiserver's: 5 LISTs a round)
        _timed("list", lambda: measures.lists(bench, targets, sizes=sizes, transfers=transfers,
                                              rounds=rounds), out)
    if static and "watch" in want:
        _timed("watch", lambda: streams.watch(bench, targets), out)
    if static and "open-watches" in want:
        _timed("open_watches", lambda: streams.open_watch_memory(bench, targets), out)
    for t in full:  # how opgate decided every call of the tier (reload runs after: not in it)
        checks[t.name].update(authcheck.scrape(t))
    if checks:
        out["identity"] = checks
    return out


@contextlib.contextmanager
def tier_paths(bench: Bench, upstream: Upstream, kubectl: Path | None) -> Iterator[list[Target]]:
    targets = start_paths(bench.procs, bench.work, upstream=upstream, kubectl=kubectl,
                          redis_url=bench.redis_url, names=bench.plan.paths)
    try:
        yield targets
    finally:
        bench.procs.stop_pids({t.pid for t in targets if t.pid is not None})


def static_tiers(bench: Bench, *, profile: bool, results: Result) -> None:
    big = 200 in bench.plan.list_mb and "list" in bench.plan.measures
    _log("generating data and starting nginx + the watch upstream")
    static = start_static(bench.procs, bench.work, big=big)
    bench.support_pids += [static.nginx_pid, static.watch_pid]
    kubectl = _kubectl()
    tiers = results.setdefault("tiers", {})
    for upstream in (static.tls, static.http):
        _log(f"tier {upstream.name}: starting the paths in front of {upstream.url}")
        with tier_paths(bench, upstream, kubectl) as targets:
            tiers[upstream.name] = run_tier(bench, targets, static=True)
            if upstream.cipher:
                tiers[upstream.name]["cipher"] = upstream.cipher
            full = next((t for t in targets if t.name == "opgate-full"), None)
            if full is not None and upstream.name == "http" and "reload" in bench.plan.measures:
                _timed("reload", functools.partial(streams.reload, bench, full), results)
            if full is not None and upstream.name == "tls" and profile:
                from bench.profile import profile as run_profile

                _timed("profile", functools.partial(run_profile, bench, full), results)
    bench.procs.stop_pids({static.nginx_pid, static.watch_pid})
    bench.support_pids = [p for p in bench.support_pids
                          if p not in (static.nginx_pid, static.watch_pid)]


def apiserver_tier(bench: Bench, results: Result) -> None:
    from proxy.envtest.cluster import LocalCluster

    _log("starting etcd + kube-apiserver (e2e harness)")
    cluster = LocalCluster().start()
    try:
        cluster.create_namespace("bench")
        cluster.create_namespace("list64")
        cluster.apply({"apiVersion": "v1", "kind": "ConfigMap",
                       "metadata": {"name": "small", "namespace": "bench"},
                       "data": {"config.yaml": "k" * 700}})
        chunk = "v" * 1_000_000
        for i in range(bench.plan.apiserver_list_mb):
            cluster.call("POST", "/api/v1/namespaces/list64/configmaps", body={
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": f"big-{i:03d}"}, "data": {"v": chunk}}).ok()
        assert cluster.call("GET", SMALL).ok()
        # the caller: a real ServiceAccount that may read configmaps, with a TokenRequest token
        # (its issuer's JWKS is the apiserver's own); the proxies' own token is the admin's
        cluster.create_service_account_with_rbac(
            CALLER_NAMESPACE, CALLER_NAME, cluster_wide=True,
            rules=[{"apiGroups": [""], "resources": ["configmaps"],
                    "verbs": ["get", "list", "watch"]}])
        token = cluster.token_request(CALLER_NAMESPACE, CALLER_NAME, expiration_seconds=6 * 3600)
        pid = cluster.apiserver_pid
        assert pid is not None
        upstream = Upstream("apiserver", cluster.url, cluster.ca_file, pid,
                            token=cluster.admin_token, caller=Caller(token, foreign_like(token)),
                            cipher=negotiated_cipher(urlsplit(cluster.url).port or 443,
                                                     cluster.ca_file))
        bench.pinning = False
        with tier_paths(bench, upstream, _kubectl()) as targets:
            tier = results.setdefault("tiers", {})["apiserver"] = run_tier(
                bench, targets, static=False)
            tier["cipher"] = upstream.cipher
    finally:
        bench.pinning = True
        cluster.stop()


def ratelimit_micro(plan: Plan) -> Result:
    """The rate-limit middleware's own micro-benchmark (``bench/ratelimit_bench.py``), if any."""
    script = Path(__file__).parent / "ratelimit_bench.py"
    if not script.exists():
        return {"error": f"{script.name} not found"}
    seconds = "0.5" if plan.quick else "2"
    out = subprocess.run([opgate_python(), str(script), "--seconds", seconds],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        return {"error": f"exit {out.returncode}: {out.stderr.strip()[-500:]}"}
    return {"output": out.stdout.rstrip()}


def chain_micro(plan: Plan, redis_url: str | None) -> Result:
    """What each middleware of the full chain costs per call (``bench/chain_cost.py``)."""
    script = Path(__file__).parent / "chain_cost.py"
    argv = [opgate_python(), str(script), "--batches", "5" if plan.quick else "30"]
    if redis_url:
        argv += ["--redis-url", redis_url]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        return {"error": f"exit {out.returncode}: {out.stderr.strip()[-500:]}"}
    return {"output": out.stdout.rstrip()}


def _wakeup(layout: Layout) -> Result:
    """:func:`bench.wakeup.probe` from the load generator's core to the proxy's; a failure is
    recorded, not fatal (the report then leaves the machine effects out)."""
    try:
        return wakeup.probe(min(layout.gen), min(layout.proxy))
    except OSError as e:  # a timeout or a receiver that did not start
        return {"error": f"{type(e).__name__}: {e}"}


def run(plan: Plan, *, apiserver: bool, profile: bool) -> dict[str, Any]:
    """The whole suite; returns the results (the report is written by the caller)."""
    work = Path(tempfile.mkdtemp(prefix="opgate-bench-"))
    procs = Procs(work)
    layout = Layout.for_machine()
    bench = Bench(plan=plan, layout=layout, procs=procs, work=work)
    results: Result = {"layout": layout.describe(), "work": str(work),
                       "quota": quota_supported()}
    started = time.monotonic()
    try:
        start_redis(bench)
        if "latency" in plan.measures and len(layout.gen | layout.proxy) > 1:
            _timed("wakeup", lambda: _wakeup(layout), results)
        if set(plan.measures) - {"ratelimit", "chain"} or profile:
            static_tiers(bench, profile=profile, results=results)
        if apiserver and set(plan.measures) & {"idle", "small-get", "latency", "list"}:
            apiserver_tier(bench, results)
        if "ratelimit" in plan.measures:
            _timed("ratelimit_micro", lambda: ratelimit_micro(plan), results)
        if "chain" in plan.measures:
            _timed("chain_micro", lambda: chain_micro(plan, bench.redis_url), results)
    finally:
        procs.stop_all()
        results["total_seconds"] = round(time.monotonic() - started, 1)
        shutil.rmtree(work, ignore_errors=True)
    return results
