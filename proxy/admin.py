"""The admin listener: ``/metrics`` (OpenMetrics when ``Accept`` asks), ``/healthz``, ``/readyz``
and ``/debug/policies``.

It runs on its own port (default ``127.0.0.1:9091``) because the API port belongs to the
apiserver: ``/healthz`` and ``/metrics`` there are forwarded to it, as clients expect.
``/readyz`` follows the apiserver's convention: 200 ``ok`` when every check passes, else 503
and the failing check; ``?verbose`` lists every check with ``[+]``/``[-]``; ``?exclude=NAME``
(repeatable) skips a check (``[+]NAME excluded: ok``, a ``warn:`` line for a name no check has);
``/readyz/NAME`` runs that check alone. ``/healthz`` and ``/livez`` (liveness) are answered the
same way over their own checks: ``ping``, and in the supervisor ``workers`` (it fails while the
workers crash-loop, :func:`proxy.workers.liveness`); never ``shutdown``: a pod that drains is
alive.

The app is given its checks, its policy view and its metrics: in one process they are the
process's own; under the ``--workers`` supervisor (:mod:`proxy.workers`) each check asks one
worker's admin over its Unix socket (:func:`unix_get`), ``/debug/policies`` shows what the
workers run, and ``/metrics`` adds up every worker's (:func:`multiprocess_metrics`).

``/metrics`` is rendered in a thread of its own (:class:`MetricsRenderer`), not on the event
loop that relays the API calls: a render takes ~17 ms with 600 series, ~220 ms at the bound of
512 resources, and the loop relayed nothing meanwhile. The thread still takes the GIL, but
while it renders the switch interval is ``RENDER_SWITCH_INTERVAL`` (0.5 ms, not Python's 5 ms):
the loop waits that long at most each time it wakes up (:func:`_yielding`).

It is served by the fast relay's own HTTP/1.1 server (:class:`~proxy.relay.fast.server.FastServer`,
httptools), so a sidecar on the default relay never loads an HTTP framework it does not use.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Protocol
from urllib.parse import parse_qs, quote

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from proxy.relay.fast.request import Request
from proxy.relay.fast.server import FastServer

ReadyCheck = Callable[[], Awaitable[tuple[bool, str]]]
PolicyView = Callable[[], Awaitable[dict[str, Any]]]  # what /debug/policies shows


@dataclass(frozen=True, slots=True)
class NamedCheck:
    name: str
    check: ReadyCheck
    forwards_exclude: bool = False  # asks another /readyz, passing it ``?exclude=`` (EXCLUDED)


# the ``?exclude=`` names of the /readyz being answered, for checks that ask a worker's /readyz
EXCLUDED: ContextVar[frozenset[str]] = ContextVar("opgate_readyz_excluded", default=frozenset())


class MetricsRenderer:
    """``/metrics``: the content type and body for the scraper's ``Accept`` (OpenMetrics when
    asked), encoded in a thread of its own, one render at a time; a scrape that asks for the
    same format while one runs shares its answer.

    ``registry()`` (called in that thread) gives what to encode; ``flush``, if given, runs on
    the loop just before a render is handed to the thread (:func:`proxy.engine.telemetry.flush`,
    which touches what only the loop's thread may)."""

    def __init__(self, registry: Callable[[], CollectorRegistry], *,
                 flush: Callable[[], None] | None = None) -> None:
        self._registry = registry
        self._flush = flush
        self._executor: ThreadPoolExecutor | None = None
        self._running: dict[str, asyncio.Future[bytes]] = {}  # by content type

    async def __call__(self, accept: str) -> tuple[str, bytes]:
        encode, content_type = choose_encoder(accept)
        running = self._running.get(content_type)
        if running is None or running.done():
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="opgate-metrics")
            if self._flush is not None:
                self._flush()
            registry = self._registry
            running = asyncio.get_running_loop().run_in_executor(
                self._executor, _yielding, lambda: encode(registry()))
            self._running[content_type] = running
            running.add_done_callback(self._finished(content_type))
        # shielded: a scraper that goes away does not cancel the render the others wait for
        return content_type, await asyncio.shield(running)

    def _finished(self, content_type: str) -> Callable[[asyncio.Future[bytes]], None]:
        def forget(done: asyncio.Future[bytes]) -> None:
            if self._running.get(content_type) is done:
                del self._running[content_type]

        return forget

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


RENDER_SWITCH_INTERVAL = 0.0005  # seconds the render holds the GIL before the loop may take it
_rendering = 0  # renders under way in this process
_interval_before = 0.005  # the switch interval before they began
_rendering_lock = threading.Lock()


def _yielding(render: Callable[[], bytes]) -> bytes:
    """Run ``render`` (in the render thread) with the GIL switch interval at
    ``RENDER_SWITCH_INTERVAL``: each time the loop wakes up (a call's bytes arrived) it waits
    that long at most for the GIL, not Python's 5 ms. A call waits for the GIL at each of its
    reads, so during a render each call was late by several 5 ms: ~7 ms at the median, 25 ms
    at the tail, with a 19 ms render going on. Set back once the render is done."""
    global _rendering, _interval_before
    with _rendering_lock:  # (renders of two renderers at once: the first one saves it)
        if not _rendering:
            _interval_before = sys.getswitchinterval()
            sys.setswitchinterval(min(_interval_before, RENDER_SWITCH_INTERVAL))
        _rendering += 1
    try:
        return render()
    finally:
        with _rendering_lock:
            _rendering -= 1
            if not _rendering:
                sys.setswitchinterval(_interval_before)


def registry_metrics(registry: CollectorRegistry, *,
                     flush: Callable[[], None] | None = None) -> MetricsRenderer:
    """``/metrics`` of this process: the metrics in ``registry``."""
    return MetricsRenderer(lambda: registry, flush=flush)


def multiprocess_metrics(path: str) -> MetricsRenderer:
    """``/metrics`` summed over the worker processes that write into ``path``
    (``PROMETHEUS_MULTIPROC_DIR``): counters and histograms add up, gauges as each one's
    ``multiprocess_mode`` says. (A worker that died: its counts are in the archive files, its
    live gauges gone, :mod:`proxy.engine.metricfiles`.)"""
    from proxy.engine.metricfiles import Collector

    def registry() -> CollectorRegistry:
        summed = CollectorRegistry()
        summed.register(Collector(path))  # type: ignore[arg-type]
        return summed

    return MetricsRenderer(registry)


async def unix_get(socket_path: str, path: str, *, within: float = 2.0) -> tuple[int, str]:
    """GET ``path`` from an HTTP server on a Unix socket (a worker's admin): status and body.

    The admin server answers with ``Content-Length`` and closes on ``Connection: close``, so the
    body is whatever follows the head until the end of the stream."""
    async with asyncio.timeout(within):
        reader, writer = await asyncio.open_unix_connection(socket_path)
        try:
            writer.write(f"GET {path} HTTP/1.1\r\nHost: worker\r\nConnection: close\r\n\r\n"
                         .encode("latin-1"))
            raw = await reader.read(-1)
        finally:
            writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = head.split(b" ", 2)
    if len(status) < 2 or not status[1].isdigit():
        raise ConnectionError(f"{socket_path}: not an HTTP answer")
    return int(status[1]), body.decode("utf-8", "replace")


class WorkerView(Protocol):
    """What the supervisor's admin knows of one worker process."""

    index: int
    socket: str  # its admin listener (a Unix socket)
    last_exit: str  # how its last process ended
    up: bool  # its admin socket has answered since this start

    @property
    def pid(self) -> int | None: ...  # None while it is not running


# How long the supervisor waits for a worker's /readyz: its upstream check may take two of the
# relay's 3 s probes (/readyz, then /version); the chart's readiness probe waits 7 s
WORKER_READYZ_WITHIN = 6.5


def worker_checks(workers: Sequence[WorkerView]) -> list[NamedCheck]:
    """``/readyz`` of the supervisor: ``worker-N`` passes while N runs and its ``/readyz``
    passes (with the same ``?exclude=``), its detail then repeating a passing check's
    ``warning:`` (a certificate the worker refused); else the detail names the worker's
    failing checks."""

    def check_of(worker: WorkerView) -> ReadyCheck:
        async def check() -> tuple[bool, str]:
            pid = worker.pid
            if pid is None:
                return False, f"not running ({worker.last_exit}; restarting)"
            path = "/readyz?verbose" + "".join(f"&exclude={quote(name, safe='')}"
                                               for name in sorted(EXCLUDED.get()))
            try:
                status, body = await unix_get(worker.socket, path, within=WORKER_READYZ_WITHIN)
            except OSError:  # (a worker just (re)started has no admin socket yet)
                if worker.up:  # it answered: now it is stuck
                    return False, f"pid {pid}: not answering its admin socket"
                return False, f"pid {pid}: starting (its admin socket does not answer yet)"
            if status == 200:  # ready, but say what runs degraded or warns (Redis away, a
                # refused certificate)
                return True, "; ".join([f"pid {pid}", *_degraded(body)])
            failing = [line for line in body.splitlines() if line.startswith("[-]")]
            return False, f"pid {pid}: " + "; ".join(failing or [f"HTTP {status}"])

        return check

    return [NamedCheck(f"worker-{w.index}", check_of(w), forwards_exclude=True)
            for w in workers]


def _degraded(verbose: str) -> list[str]:
    """``NAME degraded: why`` for each passing check of a verbose ``/readyz`` whose detail
    says ``degraded`` (a rate-limit store that is down leaves a worker ready), and ``NAME ok:
    warning: why`` for each that warns (a certificate change it refused)."""
    found = []
    for line in verbose.splitlines():
        if not line.startswith("[+]"):
            continue
        name, sep, detail = line[3:].partition(" ok: degraded")
        if sep:
            found.append(f"{name} degraded{detail}")
        elif " ok: warning: " in line:
            found.append(line[3:])
    return found


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


Answer = tuple[int, str, bytes]  # status, content type, body


async def _ping() -> tuple[bool, str]:
    """The apiserver's ``ping`` check: this process answers."""
    return True, ""


class AdminApp:
    """The admin routes (``GET``/``HEAD`` only), each answering a whole small body."""

    def __init__(
        self, *, checks: Sequence[NamedCheck], describe_policies: PolicyView,
        render_metrics: MetricsRenderer, live_checks: Sequence[NamedCheck] = (),
    ) -> None:
        self._checks = checks
        self._live = [NamedCheck("ping", _ping), *live_checks]
        self._stopping = False
        self._describe = describe_policies
        self._render = render_metrics
        self._routes: dict[str, Callable[[dict[str, list[str]], Request], Awaitable[Answer]]] = {
            "/metrics": self._metrics, "/healthz": self._report("healthz", self._live),
            "/livez": self._report("livez", self._live),
            "/readyz": self._report("readyz", self._ready_checks()),
            "/debug/policies": self._policies,
        }
        self._prefixes = {"/readyz/": self._ready_checks(), "/healthz/": self._live,
                          "/livez/": self._live}

    def _ready_checks(self) -> list[NamedCheck]:
        return [*self._checks, NamedCheck("shutdown", self._shutdown_check)]

    def close(self) -> None:
        """Stop the render thread (a render under way finishes in it)."""
        self._render.close()

    def shutting_down(self) -> None:
        """From now on ``/readyz`` fails (``shutdown``, as the apiserver's does while it
        drains): kubelet takes the pod out of its Services' endpoints while the calls in flight
        finish."""
        self._stopping = True

    async def handle(self, req: Request) -> None:
        url = req.url.decode("latin-1")
        path, _, query = url.partition("?")
        route = self._routes.get(path)
        for prefix, checks in self._prefixes.items():
            if route is None and path.startswith(prefix):
                route = self._one_check(checks, path.removeprefix(prefix))
        extra = ""
        if req.method not in (b"GET", b"HEAD"):
            answer: Answer = (405, "text/plain", b"method not allowed\n")
            extra = "Allow: GET, HEAD\r\n"  # a 405 must say what is allowed (RFC 9110)
        elif route is None:
            answer = (404, "text/plain", b"not found\n")
        else:
            answer = await route(parse_qs(query, keep_blank_values=True), req)
        code, content_type, body = answer
        close = "" if req.keep_alive else "Connection: close\r\n"
        head = (f"HTTP/1.1 {code} {HTTPStatus(code).phrase}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n{extra}{close}\r\n").encode("latin-1")
        req.conn.write(head if req.method == b"HEAD" else head + body)

    async def _metrics(self, _: dict[str, list[str]], req: Request) -> Answer:
        accept = b", ".join(value for name, value in req.headers if name.lower() == b"accept")
        return 200, *await self._render(accept.decode("latin-1"))

    async def _run(self, named: NamedCheck) -> tuple[str, bool, str]:
        try:
            ok, detail = await named.check()
        except Exception as exc:  # a check that breaks is a failed check
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        return named.name, ok, detail

    async def _excluded(self, named: NamedCheck) -> tuple[str, bool, str]:
        return named.name, True, ""

    def _report(self, kind: str, checks: Sequence[NamedCheck]) -> Callable[..., Awaitable[Answer]]:
        """``/readyz``, ``/healthz`` or ``/livez`` (``kind``) over ``checks``."""
        async def answer(query: dict[str, list[str]], _: Request) -> Answer:
            return await self._checked(kind, checks, query)

        return answer

    async def _checked(self, kind: str, checks: Sequence[NamedCheck],
                       query: dict[str, list[str]]) -> Answer:
        # ?exclude=NAME as the apiserver's /readyz: the check is skipped and shown as passed
        excluded = set(query.get("exclude", ()))
        EXCLUDED.set(frozenset(excluded))  # seen by the checks' tasks (a copy of this context)
        results = await asyncio.gather(*(
            self._excluded(named) if named.name in excluded else self._run(named)
            for named in checks))
        ready = all(ok for _, ok, _ in results)
        if "verbose" in query or not ready:
            lines = [f"[{'+' if ok else '-'}]{name}"
                     + (" excluded: ok" if name in excluded else " ok" if ok else " failed")
                     + (f": {detail}" if detail else "") for name, ok, detail in results]
            unknown = excluded.difference(named.name for named in checks)
            if unknown and not any(named.forwards_exclude for named in checks):
                lines.append("warn: some health checks cannot be excluded: no matches for "
                             + ",".join(f'"{name}"' for name in sorted(unknown)))
            lines.append(f"{kind} check passed" if ready else f"{kind} check failed")
            text = "\n".join(lines) + "\n"
            return 200 if ready else 503, "text/plain; charset=utf-8", text.encode()
        return 200, "text/plain; charset=utf-8", b"ok"

    def _one_check(self, checks: Sequence[NamedCheck],
                   name: str) -> Callable[..., Awaitable[Answer]] | None:
        """``/readyz/<name>`` (or ``/healthz/``, ``/livez/``): that check alone (200 ``ok``,
        else 503 and why), as the apiserver serves each of its checks; None for a name no
        check has."""
        named = next((c for c in checks if c.name == name), None)
        if named is None:
            return None

        async def answer(*_: object) -> Answer:
            EXCLUDED.set(frozenset())
            _, ok, detail = await self._run(named)
            if ok:
                return 200, "text/plain; charset=utf-8", b"ok"
            text = f"[-]{name} failed" + (f": {detail}" if detail else "") + "\n"
            return 503, "text/plain; charset=utf-8", text.encode()

        return answer

    async def _shutdown_check(self) -> tuple[bool, str]:
        if self._stopping:
            return False, "shutting down: calls in flight finish, new connections are refused"
        return True, ""

    async def _policies(self, *_: object) -> Answer:
        view = await self._describe()
        return 200, "application/json", (json.dumps(view, indent=2, default=str) + "\n").encode()


def build_admin_app(
    *, checks: Sequence[NamedCheck], describe_policies: PolicyView, render_metrics: MetricsRenderer,
    live_checks: Sequence[NamedCheck] = (),
) -> AdminApp:
    """The admin app: ``checks`` for ``/readyz``, ``live_checks`` (with ``ping``) for
    ``/healthz`` and ``/livez``."""
    return AdminApp(checks=checks, describe_policies=describe_policies,
                    render_metrics=render_metrics, live_checks=live_checks)


class AdminListener:
    """A running admin listener; :meth:`cleanup` stops it."""

    def __init__(self, server: FastServer, address: str, app: AdminApp) -> None:
        self.server = server
        self.address = address
        self.app = app

    def shutting_down(self) -> None:
        """``/readyz`` fails from now on (:meth:`AdminApp.shutting_down`)."""
        self.app.shutting_down()

    async def cleanup(self) -> None:
        await self.server.close(1.0)
        self.app.close()


async def serve_admin(app: AdminApp, *, listen: str) -> AdminListener:
    """Start the admin app on ``HOST:PORT`` or ``unix:/path``; the caller cleans it up."""
    server = FastServer(app.handle)
    if listen.startswith("unix:"):
        await server.listen_unix(listen[5:], tls=None)
        return AdminListener(server, listen, app)
    host, _, port = listen.rpartition(":")
    bound = await server.listen_tcp(host.strip("[]") or "127.0.0.1", int(port), tls=None,
                                    reuse_port=False)
    return AdminListener(server, ":".join(str(part) for part in bound[0]), app)


def bound_address(listener: AdminListener) -> str:
    """The address the admin listener really got (useful with port 0)."""
    return listener.address
