"""Wires the parts into a running sidecar: the composition root of ``opgate serve``.

Only this module knows every part: it resolves the upstream, loads the policies, builds the
middleware chain in its fixed order, starts the API and admin listeners and the policy watcher,
and stops them in reverse order on SIGTERM or SIGINT. It runs them on uvloop when ``--loop`` asks
for it (``auto``: when uvloop is installed). With ``--workers N`` each worker process of
:mod:`proxy.workers` runs exactly this, on a shared port (``SO_REUSEPORT``), with its admin
listener on a private Unix socket that the supervisor asks, and stops when the supervisor does.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from proxy.admin import (
    NamedCheck,
    bound_address,
    build_admin_app,
    registry_metrics,
    serve_admin,
)
from proxy.engine import telemetry
from proxy.engine.chain import Chain
from proxy.engine.check import check
from proxy.engine.logfile import RotatingFile
from proxy.engine.logformat import KEEP_LINES, OneLineFormatter
from proxy.engine.policies import PolicyStore
from proxy.engine.reload import reload_asked, watch_policies
from proxy.engine.schema import SectionParser
from proxy.middlewares import audit, capture, faults, identity, quota, ratelimit
from proxy.middlewares.accesslog import AccessLog, AccessWriter
from proxy.middlewares.audit_stream import QueuedStream
from proxy.middlewares.metrics import Metrics
from proxy.relay import RelaySettings, relay_core, resolve_upstream, serve_api
from proxy.relay.authn import UpstreamAuthenticator
from proxy.relay.counts import QuotaCounts
from proxy.relay.endpoint import make_ssl_context
from proxy.relay.hostguard import HostGuard, parse_accept_hosts
from proxy.relay.informer import InformerPool
from proxy.relay.listen import TLSFilesError, listen_failure
from proxy.relay.upstream import UpstreamConfigError, check_ca_file
from proxy.settings import Settings
from proxy.stores import Store, StoreConfigError, build_store, redis_password
from proxy.stores.base import redacted_url
from proxy.stores.breaker import ResilientStore
from proxy.workers import on_sighup, reaper_as_init, release_stop_signals

log = logging.getLogger("opgate")


def section_parsers() -> Mapping[str, SectionParser]:
    """The ``spec`` sections this build understands, each owned by its middleware."""
    return {identity.SECTION: identity.parse_section, ratelimit.SECTION: ratelimit.parse_section,
            faults.SECTION: faults.parse_section, quota.SECTION: quota.parse_section,
            audit.SECTION: audit.parse_section, capture.SECTION: capture.parse_section}


def check_paths(paths: Sequence[str]) -> int:
    errors = check(paths, parsers=section_parsers())
    for line in errors:
        print(line)
    if errors:
        return 1
    print(f"opgate: {', '.join(paths)}: valid")
    return 0


def configure_logging(settings: Settings, *, tag: str = "") -> None:
    """Log to stderr; the access log (one JSON line per call) to stdout.

    ``tag`` (``worker 1``) marks the lines of one worker process; access-log lines stay plain
    JSON (their trace ids already differ per process).
    """
    level = getattr(logging, settings.log.level.upper(), logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    where = f" [{tag}]" if tag else ""
    handler.setFormatter(
        OneLineFormatter(f"%(asctime)s %(levelname)s %(name)s{where}: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # watchfiles logs every batch of changes (INFO) and its raw events (DEBUG); opgate logs the
    # reloads itself. Never below WARNING: its own lines written where the policy watcher looks
    # (the log file beside the policy directory) would be changes it reports, without end.
    logging.getLogger("watchfiles").setLevel(logging.WARNING)
    # the access log (and an audit log to "-") writes JSON lines to stdout: a lone surrogate
    # in a claim leaves as its JSON escape, where strict encoding would lose the whole batch
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="backslashreplace")
    access = logging.getLogger("opgate.access")  # the access log writes to stdout itself
    access.propagate = False
    access.handlers[:] = []
    access.setLevel(logging.CRITICAL + 1)


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop ``--loop`` names: None for asyncio's own; ImportError if uvloop is asked
    for and missing."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if name == "uvloop":
            raise
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


# glibc's mallopt parameters (malloc.h) and what opgate sets them to
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 4 * 1024 * 1024
TRIM_THRESHOLD = 8 * 1024 * 1024


def tune_malloc() -> bool:
    """Keep the heap's memory between body chunks (glibc only; ``False`` when not applied).

    Relaying a large body allocates and frees a buffer of up to 256 KiB per read (the TLS
    layer's read size). With glibc's defaults each such free can hand the top of the heap back
    to the kernel and the next read fault the pages in again, zeroed: a third of the CPU of a
    200 MB LIST over TLS went to page faults and ``brk`` (bench/README.md). Serving buffers up to
    ``MMAP_THRESHOLD`` from the heap and trimming it only past ``TRIM_THRESHOLD`` keeps them
    mapped, at the cost of at most that much idle heap. glibc's own ``MALLOC_MMAP_THRESHOLD_``
    / ``MALLOC_TRIM_THRESHOLD_`` variables, when set, win."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or os.environ.get("MALLOC_TRIM_THRESHOLD_"):
        return False
    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return False
    except (ValueError, OSError):  # no such name: not glibc
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def freeze_startup_objects() -> int:
    """Leave what start-up built out of every later garbage collection; how many objects.

    Imports, the policies, the middlewares and the clients leave ~50k objects that live as long
    as the process. A full (generation 2) collection walks every one of them, and pauses the
    event loop for 35-70 ms on the project's machines: an API call or a watch event that comes
    meanwhile waits that long (bench/README.md). ``gc.freeze`` moves them to the permanent
    generation, so a full collection walks only what serving made since. Garbage made while
    starting up is collected first, not frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def serve(
    settings: Settings, *, reuse_port: bool = False, parent_fd: int | None = None, tag: str = ""
) -> int:
    """Run the sidecar until SIGTERM/SIGINT (or, in a worker, until ``parent_fd`` hits EOF)."""
    configure_logging(settings, tag=tag)
    tune_malloc()
    try:
        factory = loop_factory(settings.runtime.loop)
    except ImportError:
        log.error("--loop uvloop: uvloop is not installed (pip install uvloop)")
        return 2
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(_serve(settings, reuse_port=reuse_port, parent_fd=parent_fd,
                                     tag=tag))
    except KeyboardInterrupt:
        return 0


def open_audit_log(settings: Settings, *, tag: str = "") -> tuple[
        AccessWriter, QueuedStream | None] | None:
    """The audit log's batched writer (and, for a file, the thread that writes and rotates it);
    each worker of ``--workers N`` writes its own file (``audit.log`` -> ``audit.worker0.log``,
    ``audit.worker1.log``, …)."""
    path = settings.log.audit_log
    if not path:
        return None
    if path == "-":
        return AccessWriter(sys.stdout, shared=bool(tag)), None  # workers share stdout
    if tag:
        stem, ext = os.path.splitext(path)
        path = f"{stem}.{tag.replace(' ', '')}{ext}"
    stream = QueuedStream(RotatingFile(
        path, max_bytes=settings.log.audit_log_maxsize * 1024 * 1024,
        max_backups=settings.log.audit_log_maxbackup))
    # each batch wakes the writer thread: batched by time however quiet it is (AccessWriter)
    return AccessWriter(stream, prompt=False), stream


def open_capture(settings: Settings, upstream_url: str, *, tag: str = "") -> Any:
    """The capture file's writer (:class:`proxy.capture.FlowFile`; mitmproxy is imported
    here, only when ``--capture`` is set); each worker of ``--workers N`` writes its own file
    (``capture.flows`` -> ``capture.worker0.flows``, ``capture.worker1.flows``, …)."""
    path = settings.log.capture
    if not path:
        return None
    from proxy.capture import FlowFile

    if tag:
        stem, ext = os.path.splitext(path)
        path = f"{stem}.{tag.replace(' ', '')}{ext}"
    return FlowFile(path, upstream=upstream_url,
                    max_bytes=settings.log.capture_maxsize * 1024 * 1024,
                    max_backups=settings.log.capture_maxbackup)


async def _serve(settings: Settings, *, reuse_port: bool, parent_fd: int | None,
                 tag: str = "") -> int:
    up = settings.upstream
    try:
        upstream = resolve_upstream(url=up.url, kubeconfig=up.kubeconfig, ca_file=up.ca_file,
                                    insecure=up.insecure, token_file=up.token_file)
        if up.ca_file:
            check_ca_file(up.ca_file, "--upstream-ca")
        make_ssl_context(upstream)  # a CA or client certificate ssl cannot load: refused now
    except UpstreamConfigError as exc:
        log.error("cannot configure the upstream: %s", exc)
        return 2
    rl = settings.ratelimit
    try:
        buckets = build_store(redis_url=rl.redis_url, password_file=rl.redis_password_file,
                              timeout=rl.redis_timeout, replicas=rl.replicas)
    except StoreConfigError as exc:
        log.error("cannot configure the rate-limit store: %s", exc)
        return 2

    store = PolicyStore(settings.policies.paths, parsers=section_parsers())
    if settings.policies.paths and not store.reload():
        log.error("policies not loaded; fix them (`opgate check`) and start again:\n%s",
                  store.last_error, extra=KEEP_LINES)
        return 1

    try:
        audit_log = open_audit_log(settings, tag=tag)
    except OSError as exc:
        log.error("cannot open the audit log %s: %s", settings.log.audit_log, exc)
        return 2
    try:
        flows = open_capture(settings, upstream.url, tag=tag)
    except Exception as exc:  # MitmproxyMissing, OSError
        log.error("cannot capture to %s: %s", settings.log.capture, exc)
        return 2
    # the CR instances' own qps (instanceAnnotation), watched with opgate's upstream credentials
    informers = InformerPool(upstream, connect_timeout=up.connect_timeout)
    # the workers of --workers N share stdout: AccessWriter keeps their lines whole
    access_writer = (AccessWriter(sys.stdout, shared=bool(tag)) if settings.log.access_log
                     else None)
    after = [Metrics(), AccessLog(writer=access_writer)] if access_writer else [Metrics()]
    auditor = audit.Audit(write=audit_log[0].write) if audit_log else None
    if auditor is None and store.current.section(audit.SECTION):
        log.warning("the policies have spec.audit but no --audit-log is set: no audit events "
                    "are written")
    capturer = capture.Capture(write=flows.write) if flows is not None else None
    if capturer is None and store.current.section(capture.SECTION):
        log.warning("the policies have spec.capture but no --capture is set: no traffic is "
                    "captured")
    authn = UpstreamAuthenticator(upstream, connect_timeout=up.connect_timeout)
    # object counts for spec.quotas: list+watch of the quota'd resources and the quotas
    counts = QuotaCounts(upstream, connect_timeout=up.connect_timeout)
    # reservations in the same store as the buckets: with --redis-url shared by every replica
    quotas = quota.Quota(counts=counts, store=buckets)
    quotas.prepare(store.current)  # start counting now, not at the first create
    # who calls, then what may be injected, then how fast, then how many; capture taps what
    # is relayed (and records what was answered); the audit log, metrics and the access log
    # see the outcome
    limiter = ratelimit.RateLimit(store=buckets, overrides=informers)
    chain = Chain([identity.IdentityCheck(authenticator=authn), faults.Faults(), limiter, quotas,
                   *([capturer] if capturer else []), *([auditor] if auditor else []),
                   *after])
    relay_settings = RelaySettings(
        connect_timeout=up.connect_timeout, header_timeout=up.header_timeout,
        request_timeout=up.request_timeout, watch_idle_timeout=up.watch_idle_timeout)
    relay = relay_core(settings.runtime.relay)(
        upstream=upstream, chain=chain, policies=store, settings=relay_settings)
    await relay.start()
    await informers.start()
    await counts.start(follow=lambda: quotas.prepare(store.current))  # reloads, within 1 s

    redis_check = RedisCheck(settings)

    async def ratelimit_ready() -> tuple[bool, str]:
        # ready either way: a sidecar's readiness must not flap with Redis (the policies'
        # failure modes decide what Redis down means), but the detail says it
        return True, redis_check.describe(buckets)

    async def quota_counts() -> tuple[bool, str]:
        return True, counts.describe()

    async def policies_loaded() -> tuple[bool, str]:
        if not settings.policies.paths:
            return True, "none configured"
        loaded = store.loaded
        return loaded, "" if loaded else store.last_error or "not loaded"

    async def describe_policies() -> dict[str, Any]:
        return store.describe()

    checks = [NamedCheck("policies", policies_loaded),
              NamedCheck("upstream", relay.upstream_ready),
              NamedCheck("ratelimit-store", ratelimit_ready),
              NamedCheck("quota-counts", quota_counts)]
    tasks: list[asyncio.Task[None]] = []
    admin = None
    listener = None
    # from here on: a SIGTERM/SIGINT (also one held since the start) stops it cleanly, a SIGHUP
    # reloads the policies
    signals = _Signals(parent_fd, store if settings.policies.paths else None)
    try:
        try:
            listener = await serve_api(relay, listen=settings.listen.listen,
                                       tls_cert=settings.listen.tls_cert,
                                       tls_key=settings.listen.tls_key, reuse_port=reuse_port,
                                       shutdown_timeout=settings.runtime.shutdown_grace,
                                       host_guard=HostGuard(
                                           parse_accept_hosts(settings.listen.accept_hosts)))
        except (OSError, TLSFilesError, ValueError) as exc:
            log.error("%s", listen_failure("--listen", settings.listen.listen, exc))
            return 2
        if listener.tls:  # what it serves, and a reload that failed (never unready for it)
            checks.append(NamedCheck("serving-cert", listener.serving_cert))
        try:
            admin = await serve_admin(
                build_admin_app(checks=checks, describe_policies=describe_policies,
                                render_metrics=registry_metrics(telemetry.REGISTRY,
                                                               flush=telemetry.flush)),
                listen=settings.listen.admin_listen)
        except (OSError, ValueError) as exc:
            flag = "--admin-listen" if not tag else "the worker's admin socket"
            log.error("%s", listen_failure(flag, settings.listen.admin_listen, exc))
            return 2
        if rl.redis_url:
            tasks.append(asyncio.create_task(redis_check.run(buckets), name="redis-probe"))
        if settings.policies.paths:
            tasks.append(asyncio.create_task(watch_policies(store), name="policy-watch"))
        freeze_startup_objects()
        log.info("serving the Kubernetes API on %s -> %s; admin on %s; policies %s; loop %s; "
                 "relay %s", listener.address, upstream.url, bound_address(admin),
                 ", ".join(settings.policies.paths) or "(none)",
                 type(asyncio.get_running_loop()).__module__.split(".")[0],
                 settings.runtime.relay)
        await signals.stop.wait()
        log.info("shutting down")
        limiter.stop_waiting()  # a call queued by onExceed: wait gets its 429, not cut unanswered
        signals.again = listener.hurry
    finally:
        if admin is not None:  # unready first: no new calls are sent here while these finish
            admin.shutting_down()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if listener is not None:
            await listener.close()
        if admin is not None:
            await admin.cleanup()
        await informers.close()
        await counts.close()
        await authn.close()
        await relay.close()
        await buckets.close()
        if access_writer is not None:
            access_writer.close()
        if flows is not None:
            flows.close()
        if auditor is not None and audit_log is not None:
            auditor.close()
            audit_log[0].close()
            if audit_log[1] is not None:
                audit_log[1].close()
        signals.close()
    return 0


class RedisCheck:
    """The start-up probe of ``--redis-url`` and the ``ratelimit-store`` line of ``/readyz``.

    Once, in the background (startup is not held up), opgate PINGs Redis with a client of its
    own and a short timeout; a failure is logged as ONE error line naming the problem
    (authentication, TLS, unreachable) and opgate goes on. The store's circuit opens at once, so
    the policies' failure modes apply while Redis is away (``opgate_ratelimit_backend`` says
    ``fallback``) until the store's own probes find it back. This check re-PINGs quietly every
    ``retry_every`` seconds until Redis answers (logged once, at info), so that ``/readyz``
    says the store is degraded rather than ok meanwhile; with a breaker, the breaker says
    (the store's probes, every second, close it first)."""

    retry_every = 5.0

    def __init__(self, settings: Settings) -> None:
        self.url = settings.ratelimit.redis_url
        self.password_file = settings.ratelimit.redis_password_file
        self.problem: str | None = None

    async def run(self, store: Store) -> None:
        from proxy.stores.redis import probe

        assert self.url is not None
        password = redis_password(None, self.password_file)
        self.problem = await probe(self.url, password=password)
        if self.problem is None:
            return
        if isinstance(store, ResilientStore):  # no call need wait for Redis to fail it first
            store.trip(self.problem)
        log.error("Redis %s: %s; opgate goes on without it (the policies' failure modes "
                  "apply) and keeps trying", redacted_url(self.url), self.problem)
        while self.problem is not None:
            await asyncio.sleep(self.retry_every)
            try:  # the store reads a password file again for each connection: so does this
                password = redis_password(None, self.password_file)
            except StoreConfigError as exc:
                log.debug("%s (the last password read is used)", exc)
            self.problem = await probe(self.url, password=password)
        log.info("Redis %s answers now", redacted_url(self.url))

    def describe(self, store: Store) -> str:
        health = store.health()
        if not self.url:
            return ", ".join(f"{k}={v}" for k, v in health.items())
        breaker = health.get("breaker")
        if breaker not in (None, "closed"):
            return (f"degraded: Redis unavailable ({health.get('last_error')}), breaker "
                    f"{breaker}; the policies' failure modes apply")
        # a breaker (which ``run`` tripped) closed by the store's own probe: decisions go to
        # Redis again, whatever this check's PING said up to ``retry_every`` seconds ago
        if self.problem is not None and breaker is None:
            return f"degraded: Redis {self.problem}; the policies' failure modes apply"
        return ", ".join(f"{k}={v}" for k, v in health.items())


class _Signals:
    """SIGTERM and SIGINT while serving: the first stops it (the calls in flight get their
    grace), a second one during that cuts the grace short (``again``), and the shutdown goes
    on as usual (logs flushed, exit 0) rather than dying of the signal. In a worker, the
    supervisor's pipe closing (it died) stops it too. SIGHUP reloads the policy files now (as
    Prometheus and nginx read their configuration again), whatever the file watch saw."""

    def __init__(self, parent_fd: int | None, store: PolicyStore | None) -> None:
        self.stop = asyncio.Event()
        self.again: Callable[[], None] | None = None
        self._parent_fd = parent_fd
        self._store = store
        self._reloads: set[asyncio.Task[None]] = set()
        self._loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(sig, self._signalled, sig)
        release_stop_signals()  # one that came while starting is handled now
        on_sighup(self._loop, self._hangup)
        self._reaper = reaper_as_init(self._loop)  # as a container's PID 1, what init does
        if parent_fd is not None:  # readable only at EOF: nobody writes to it
            self._loop.add_reader(parent_fd, self._parent_gone)

    def _signalled(self, sig: signal.Signals) -> None:
        if not self.stop.is_set():
            self.stop.set()
        elif self.again is not None:
            log.warning("%s again: the calls still in flight are cut now", sig.name)
            self.again()
            self.again = None

    def _hangup(self) -> None:
        if self._store is None:
            log.info("SIGHUP: no policy files to reload (--policies)")
            return
        log.info("SIGHUP: reloading the policy files")
        task = self._loop.create_task(reload_asked(self._store))
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)

    def _parent_gone(self) -> None:
        if not self.stop.is_set():
            log.warning("the supervisor is gone; shutting down")
        self.stop.set()
        if self._parent_fd is not None:
            self._loop.remove_reader(self._parent_fd)
            self._parent_fd = None

    def close(self) -> None:
        # SIGHUP ignored again until the process is gone, as before serving (proxy/__main__.py)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.remove_signal_handler(sig)
        if self._reaper is not None:
            self._reaper.close()
        if self._parent_fd is not None:
            self._loop.remove_reader(self._parent_fd)
            self._parent_fd = None
