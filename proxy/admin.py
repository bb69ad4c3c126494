"""The admin listener: ``/metrics``, ``/healthz``, ``/readyz`` and ``/debug/policies``.

It runs on its own port (default ``127.0.0.1:9091``) because the API port belongs to the
apiserver: ``/healthz`` and ``/metrics`` there are forwarded to it, as clients expect.
``/readyz`` follows the apiserver's convention: 200 ``ok`` when every check passes, else 503
and the failing check; ``?verbose`` lists every check with ``[+]``/``[-]``.

The app is given its checks, its policy view and its metrics: in one process they are the
process's own; under the ``--workers`` supervisor (:mod:`proxy.workers`) each check asks one
worker's admin over its Unix socket (:func:`unix_get`), ``/debug/policies`` shows what the
workers run, and ``/metrics`` adds up every worker's (:func:`multiprocess_metrics`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

ReadyCheck = Callable[[], Awaitable[tuple[bool, str]]]
PolicyView = Callable[[], Awaitable[dict[str, Any]]]  # what /debug/policies shows
MetricsRenderer = Callable[[], bytes]  # the /metrics body


@dataclass(frozen=True, slots=True)
class NamedCheck:
    name: str
    check: ReadyCheck


def registry_metrics(registry: CollectorRegistry) -> MetricsRenderer:
    """``/metrics`` of this process: the metrics in ``registry``."""
    return lambda: generate_latest(registry)


def multiprocess_metrics(path: str) -> MetricsRenderer:
    """``/metrics`` summed over the worker processes that write into ``path``
    (``PROMETHEUS_MULTIPROC_DIR``): counters and histograms add up, gauges as each one's
    ``multiprocess_mode`` says."""
    from prometheus_client import multiprocess

    def render() -> bytes:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=path)  # type: ignore[no-untyped-call]
        return generate_latest(registry)

    return render


async def unix_get(socket_path: str, path: str, *, within: float = 2.0) -> tuple[int, str]:
    """GET ``path`` from an HTTP server on a Unix socket (a worker's admin): status and body."""
    connector = aiohttp.UnixConnector(path=socket_path)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=within)
    ) as session, session.get("http://worker" + path) as resp:
        return resp.status, await resp.text()


class WorkerView(Protocol):
    """What the supervisor's admin knows of one worker process."""

    index: int
    socket: str  # its admin listener (a Unix socket)
    last_exit: str  # how its last process ended

    @property
    def pid(self) -> int | None: ...  # None while it is not running


def worker_checks(workers: Sequence[WorkerView]) -> list[NamedCheck]:
    """``/readyz`` of the supervisor: ``worker-N`` passes while N runs and its ``/readyz``
    passes; else the detail names the worker's failing checks."""

    def check_of(worker: WorkerView) -> ReadyCheck:
        async def check() -> tuple[bool, str]:
            pid = worker.pid
            if pid is None:
                return False, f"not running ({worker.last_exit}; restarting)"
            status, body = await unix_get(worker.socket, "/readyz?verbose")
            if status == 200:
                return True, f"pid {pid}"
            failing = [line for line in body.splitlines() if line.startswith("[-]")]
            return False, f"pid {pid}: " + "; ".join(failing or [f"HTTP {status}"])

        return check

    return [NamedCheck(f"worker-{w.index}", check_of(w)) for w in workers]


def worker_policies(workers: Sequence[WorkerView]) -> PolicyView:
    """``/debug/policies`` of the supervisor: the first running worker's view, and ``workers``
    (each one's pid, digest, load time and last error), to see that all run the same set."""

    async def view_of(worker: WorkerView) -> dict[str, Any] | None:
        if worker.pid is None:
            return None
        try:
            status, body = await unix_get(worker.socket, "/debug/policies")
            return json.loads(body) if status == 200 else None
        except Exception:  # a worker that cannot answer is shown as such
            return None

    async def describe() -> dict[str, Any]:
        views = await asyncio.gather(*(view_of(w) for w in workers))
        first = next((v for v in views if v is not None), None)
        result = dict(first) if first else {"loaded": False, "error": "no worker answered"}
        result["workers"] = [
            {"worker": w.index, "pid": w.pid, "digest": v.get("digest"),
             "loaded_at": v.get("loaded_at"), "last_error": v.get("last_error")}
            if v is not None else {"worker": w.index, "pid": w.pid, "error": w.last_exit}
            for w, v in zip(workers, views, strict=True)
        ]
        return result

    return describe


def build_admin_app(
    *, checks: Sequence[NamedCheck], describe_policies: PolicyView, render_metrics: MetricsRenderer
) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        body = render_metrics()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def run(named: NamedCheck) -> tuple[str, bool, str]:
        try:
            ok, detail = await named.check()
        except Exception as exc:  # a check that breaks is a failed check
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        return named.name, ok, detail

    async def readyz(request: web.Request) -> web.Response:
        results = await asyncio.gather(*(run(named) for named in checks))
        ready = all(ok for _, ok, _ in results)
        if "verbose" in request.query or not ready:
            lines = [f"[{'+' if ok else '-'}]{name} {'ok' if ok else 'failed'}"
                     + (f": {detail}" if detail else "") for name, ok, detail in results]
            lines.append("readyz check passed" if ready else "readyz check failed")
            return web.Response(text="\n".join(lines) + "\n", status=200 if ready else 503)
        return web.Response(text="ok")

    async def debug_policies(_: web.Request) -> web.Response:
        view = await describe_policies()
        return web.Response(text=json.dumps(view, indent=2, default=str) + "\n",
                            content_type="application/json")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/livez", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/debug/policies", debug_policies)
    return app


async def serve_admin(app: web.Application, *, listen: str) -> web.AppRunner:
    """Start the admin app on ``HOST:PORT`` or ``unix:/path``; the caller cleans up the runner."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site: web.BaseSite
    if listen.startswith("unix:"):
        site = web.UnixSite(runner, listen[5:])
    else:
        host, _, port = listen.rpartition(":")
        site = web.TCPSite(runner, host.strip("[]") or "127.0.0.1", int(port))
    await site.start()
    return runner


def bound_address(runner: web.AppRunner) -> str:
    """The address the admin listener really got (useful with port 0)."""
    for site in runner.sites:
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        for sock in sockets:
            addr = sock.getsockname()
            if isinstance(addr, tuple):
                return f"{addr[0]}:{addr[1]}"
            return f"unix:{addr}"
    return ""
