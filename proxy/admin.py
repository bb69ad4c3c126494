"""The admin listener: ``/metrics``, ``/healthz``, ``/readyz`` and ``/debug/policies``.

It runs on its own port (default ``127.0.0.1:9091``) because the API port belongs to the
apiserver: ``/healthz`` and ``/metrics`` there are forwarded to it, as clients expect.
``/readyz`` follows the apiserver's convention: 200 ``ok`` when every check passes, else 503
and the failing check; ``?verbose`` lists every check with ``[+]``/``[-]``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.engine import telemetry
from proxy.engine.policies import PolicyStore

ReadyCheck = Callable[[], Awaitable[tuple[bool, str]]]


@dataclass(frozen=True, slots=True)
class NamedCheck:
    name: str
    check: ReadyCheck


def build_admin_app(*, store: PolicyStore, checks: Sequence[NamedCheck]) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(telemetry.REGISTRY)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(request: web.Request) -> web.Response:
        results: list[tuple[str, bool, str]] = []
        loaded = store.loaded
        results.append(("policies", loaded, "" if loaded else store.last_error or "not loaded"))
        for named in checks:
            try:
                ok, detail = await named.check()
            except Exception as exc:  # a check that breaks is a failed check
                ok, detail = False, f"{type(exc).__name__}: {exc}"
            results.append((named.name, ok, detail))
        ready = all(ok for _, ok, _ in results)
        if "verbose" in request.query or not ready:
            lines = [f"[{'+' if ok else '-'}]{name} {'ok' if ok else 'failed'}"
                     + (f": {detail}" if detail else "") for name, ok, detail in results]
            lines.append("readyz check passed" if ready else "readyz check failed")
            return web.Response(text="\n".join(lines) + "\n", status=200 if ready else 503)
        return web.Response(text="ok")

    async def debug_policies(_: web.Request) -> web.Response:
        return web.Response(text=json.dumps(store.describe(), indent=2, default=str) + "\n",
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
