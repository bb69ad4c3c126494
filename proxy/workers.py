"""``opgate serve --workers N``: a supervisor process and N worker processes, to use every core.

One Python process relays on one core. With N > 1 the process the user started supervises N
fresh interpreters (``python -m proxy.workers RUN_DIR INDEX FD``), each running exactly the
single-process sidecar (:func:`proxy.app.serve`: its own chain, policy watcher, Redis store and
relay), all listening on the API address with ``SO_REUSEPORT`` so the kernel spreads connections.

* :func:`refusal`: no ``--redis-url`` (each worker's own buckets would admit N times the limits)
  and ``unix:`` listeners (``SO_REUSEPORT`` shares ports, not socket paths) are refused.
* :func:`hold_port`: the address must be free to a plain bind (never join someone else's
  ``SO_REUSEPORT`` group); port 0 is resolved once; a bound, non-listening socket holds the port
  for the supervisor's life, so a restarted worker gets it back.
* The settings go to the workers as JSON in a private (0700) run directory that also holds their
  Prometheus files (``PROMETHEUS_MULTIPROC_DIR``) and admin sockets. Each worker is a replica to
  the rate limits (``--replicas`` x N), since each keeps its own leases and fallback buckets.
* The admin listener opens once every worker's admin socket answers; a worker that exits before
  that stops everything with its status (a configuration error would only repeat). Later a dead
  worker is restarted after a backoff (0.5 s, doubling to 30 s while it dies within 10 s); when
  it is reaped its counts are merged into the archive files and its live gauges' files removed
  (:func:`proxy.engine.metricfiles.retire`): the sums keep its counts, not its last in-flight
  and open-watch levels, and a crash loop leaves no file per restart.
  ``/readyz`` asks each worker's, ``/metrics`` adds all up (:mod:`proxy.admin`).
* ``/healthz`` (liveness: :func:`liveness`) fails once no worker serves and every one has been
  failing (dead, starting, or dying within ``STABLE_AFTER`` of each start) for more than
  ``LIVENESS_GRACE`` (30 s): a crash loop the restarts do not end (a policy file broken since
  the start) then gets the pod restarted by kubelet, not left NotReady for ever. A worker that
  dies once and serves again, or one that serves while the others fail, keeps it passing.
* A worker that serves is asked its ``/healthz`` every ``WATCH_EVERY`` (5 s); one that has not
  answered for ``LIVENESS_GRACE`` (stuck: a deadlock, a loop blocked in a call) is killed, and
  restarted as any dead one: kubelet would restart the whole pod, the others with it.
* SIGTERM/SIGINT go on to the workers as SIGTERM; each finishes its in-flight calls (a second
  signal is passed on too: each cuts what still runs); the supervisor exits when all have
  stopped. Workers also stop when the pipe whose write end only
  the supervisor holds reads EOF, so even a SIGKILLed supervisor leaves no orphan (the last
  worker out removes the run directory). A container killed whole (an OOM kill takes every
  process at once) leaves its run directory in an emptyDir that outlives it: the next
  supervisor removes those no live supervisor holds (:func:`sweep_run_dirs`). SIGHUP goes
  on to the workers too: each reloads its policy files (a worker still starting gets it once
  it serves: until then it would die of it).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import glob
import logging
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from proxy.settings import Settings

log = logging.getLogger("opgate.workers")

START_TIMEOUT = 60.0  # for a worker's admin socket to answer after its start
STOP_MARGIN = 20.0  # seconds past --shutdown-grace for workers to exit after SIGTERM, then KILL
BACKOFF_FIRST = 0.5
BACKOFF_MAX = 30.0
STABLE_AFTER = 10.0  # a worker that ran this long before dying restarts at BACKOFF_FIRST
LIVENESS_GRACE = 30.0  # seconds every worker may fail, none serving, before /healthz fails
WATCH_EVERY = 5.0  # how often a serving worker's admin socket is asked whether it answers


def refusal(settings: Settings) -> str | None:
    """Why ``settings`` cannot run as several workers, or None."""
    n = settings.runtime.workers
    if n <= 1:
        return None
    if not settings.ratelimit.redis_url:
        return (f"--workers {n} needs --redis-url: without Redis each worker keeps its own "
                f"rate-limit buckets, so {n} workers would admit {n} times the policies' limits. "
                "Give a Redis URL (shared by all workers) or run --workers 1.")
    if settings.listen.listen.startswith("unix:"):
        return (f"--workers {n} needs a TCP --listen (HOST:PORT): workers share the port with "
                "SO_REUSEPORT, which a unix: socket cannot do. Use --workers 1 with a Unix "
                "socket.")
    return None


def supervise(settings: Settings) -> int:
    """Run ``settings.runtime.workers`` workers until SIGTERM/SIGINT; the exit status."""
    try:  # in $TMPDIR, else /tmp, /var/tmp, /usr/tmp, the working directory
        run_dir = tempfile.mkdtemp(prefix=RUN_DIR_PREFIX)
        held_run_dir = hold_run_dir(run_dir)  # for this process's life: closed at exit
    except OSError as exc:
        print(f"opgate: --workers {settings.runtime.workers} needs a writable directory for "
              "the workers' shared metrics and admin sockets: set $TMPDIR to one (in a pod with "
              f"a read-only root filesystem, mount an emptyDir at /tmp) ({exc})",
              file=sys.stderr)
        return 2
    metrics_dir = os.path.join(run_dir, "metrics")
    os.mkdir(metrics_dir)
    # before prometheus_client is imported here or in any worker (the workers inherit it)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    _configure_logging(settings)
    sweep_run_dirs(os.path.dirname(run_dir))
    held: list[socket.socket] = []
    try:
        try:
            listen, held = hold_port(settings.listen.listen)
        except (OSError, ValueError) as exc:
            from proxy.relay.listen import listen_failure

            log.error("%s", listen_failure("--listen", settings.listen.listen, exc))
            return 2
        n = settings.runtime.workers
        for_workers = replace(
            settings, listen=replace(settings.listen, listen=listen),
            ratelimit=replace(settings.ratelimit, replicas=settings.ratelimit.replicas * n))
        fd = os.open(os.path.join(run_dir, "settings.json"), os.O_WRONLY | os.O_CREAT, 0o600)
        with open(fd, "w", encoding="utf-8") as out:
            out.write(for_workers.to_json())
        supervisor = Supervisor(settings, run_dir=run_dir, listen=listen)
        try:
            return asyncio.run(supervisor.run())
        except KeyboardInterrupt:
            return 0
    finally:
        for sock in held:
            sock.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        os.close(held_run_dir)


RUN_DIR_PREFIX = "opgate-workers-"
RUN_DIR_LOCK = "supervisor.lock"  # locked (flock) by the supervisor whose run directory it is


def hold_run_dir(run_dir: str) -> int:
    """Lock ``run_dir``'s :data:`RUN_DIR_LOCK` for as long as the returned descriptor is open
    (the kernel lets go of it when the process dies, however it dies). The file is locked
    under another name and renamed: a sweep never finds it unlocked while it is this one's."""
    partial = os.path.join(run_dir, RUN_DIR_LOCK + ".new")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(partial, os.path.join(run_dir, RUN_DIR_LOCK))
    return fd


def sweep_run_dirs(parent: str) -> None:
    """Remove the run directories in ``parent`` whose supervisor is gone: their lock is free
    (one without a lock file is not known to be opgate's, and stays)."""
    for run_dir in glob.glob(os.path.join(glob.escape(parent), RUN_DIR_PREFIX + "*")):
        try:
            fd = os.open(os.path.join(run_dir, RUN_DIR_LOCK), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its supervisor runs
            continue
        else:
            log.info("removing %s, left by a supervisor that is gone", run_dir)
            shutil.rmtree(run_dir, ignore_errors=True)
        finally:
            os.close(fd)


def hold_port(listen: str) -> tuple[str, list[socket.socket]]:
    """Check that ``HOST:PORT`` is free, fix port 0, and hold it: ``(HOST:REALPORT, sockets)``."""
    host, _, port_text = listen.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"expected HOST:PORT or [IPV6]:PORT, got {listen!r}")
    port = int(port_text)
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    held: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):  # unique, in order
            where = (addr[0], port, *addr[2:])
            with _socket(family, kind, proto, reuse_port=False) as probe:
                probe.bind(where)  # fails if anything holds it, an SO_REUSEPORT group included
                port = probe.getsockname()[1]
            hold = _socket(family, kind, proto, reuse_port=True)
            held.append(hold)
            hold.bind((addr[0], port, *addr[2:]))
    except BaseException:
        for sock in held:
            sock.close()
        raise
    return (f"[{host}]:{port}" if ":" in host else f"{host}:{port}"), held


def _socket(family: int, kind: int, proto: int, *, reuse_port: bool) -> socket.socket:
    """A TCP socket set up the way asyncio's ``create_server`` sets up the workers' listeners."""
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    return sock


def admin_socket(run_dir: str, index: int) -> str:
    return os.path.join(run_dir, f"worker-{index}.sock")


@dataclass(eq=False)
class _Worker:
    index: int
    socket: str  # its admin listener
    proc: asyncio.subprocess.Process | None = None
    started: float = 0.0
    up: bool = False  # its admin socket has answered since this start
    spawning: bool = False  # forked, its Process not yet had (proc: None, or the dead one)
    quick_deaths: int = 0
    last_exit: str = "not started"
    # when its failing began (its first death since it last served STABLE_AFTER), or None
    failing_since: float | None = None

    @property
    def pid(self) -> int | None:
        proc = self.proc
        return proc.pid if proc is not None and proc.returncode is None else None


def liveness(workers: Sequence[_Worker], *, now: float,
             grace: float = LIVENESS_GRACE) -> tuple[bool, str]:
    """The supervisor's ``/healthz`` check: fails when no worker serves and every one has been
    failing for more than ``grace`` seconds (``now``: the loop's clock). Passes while any one
    serves: the pod still relays, and a restart would cut what it relays."""
    if any(w.pid is not None and w.up for w in workers):
        return True, ""
    since = [w.failing_since for w in workers]
    if not since or any(s is None or now - s <= grace for s in since):
        return True, ""  # (one never failed: it is still starting)
    latest = max(s for s in since if s is not None)
    return False, (f"no worker has served for {now - latest:.1f}s (more than {grace:g}s): "
                   + "; ".join(map(_failing, workers)))


def _failing(worker: _Worker) -> str:
    tries = f"{worker.quick_deaths} times in a row within {STABLE_AFTER:g}s of its start"
    if worker.pid is None:
        return f"worker {worker.index} {worker.last_exit} ({tries}), restarting"
    return (f"worker {worker.index} (pid {worker.pid}) not serving since its start; it "
            f"{worker.last_exit} before ({tries})")


def release_stop_signals() -> None:
    """Let SIGTERM and SIGINT in, now that their handlers are set: ``opgate serve`` blocks them
    from its start (proxy/cli.py), so that one sent while it starts waits for them rather than
    meeting the default disposition. That killed it, and a container's PID 1 (to which the
    kernel delivers only signals it handles; a blocked one stays pending) dropped it: a pod
    deleted as opgate started hung in Terminating until kubelet's SIGKILL."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGTERM, signal.SIGINT))


class OrphanReaper:
    """What an init does, for opgate as a container's PID 1 (the image's entrypoint): reap the
    processes that end as its children without being its own. A process whose parent exits
    (one a ``kubectl exec`` session left behind) is given to PID 1; once it exits it stays a
    zombie, holding a PID of the pod's limit, until PID 1 waits for it. At each SIGCHLD every
    exited child is reaped but ``ours()`` (the workers: asyncio's child watcher waits for
    those and needs their status); one of ours first in line is left to it and the sweep
    tried again shortly."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *,
                 ours: Callable[[], Collection[int]]) -> None:
        self._loop = loop
        self._ours = ours
        self._later: asyncio.TimerHandle | None = None

    def start(self) -> None:
        # a handler of Python's own (as on_sighup's): uvloop refuses one for SIGCHLD
        def handler(signum: int, frame: object) -> None:
            if not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._sweep)

        signal.signal(signal.SIGCHLD, handler)
        self._sweep()  # those that exited before

    def close(self) -> None:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if self._later is not None:
            self._later.cancel()
            self._later = None

    def _sweep(self) -> None:
        self._later = None
        while True:
            try:  # WNOWAIT: only look, so that one of ours is left as it is
                exited = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # no children at all
                return
            if exited is None:
                return
            if exited.si_pid in self._ours():
                if self._later is None:
                    self._later = self._loop.call_later(0.1, self._sweep)
                return
            with contextlib.suppress(ChildProcessError):
                os.waitpid(exited.si_pid, os.WNOHANG)


def reaper_as_init(loop: asyncio.AbstractEventLoop, *,
                   ours: Callable[[], Collection[int]] = frozenset) -> OrphanReaper | None:
    """An :class:`OrphanReaper`, started, when this process is PID 1 (else None: its init
    reaps)."""
    if os.getpid() != 1:
        return None
    reaper = OrphanReaper(loop, ours=ours)
    reaper.start()
    return reaper


def on_sighup(loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> None:
    """Run ``callback`` on ``loop`` at each SIGHUP, by a handler of Python's own rather than
    ``loop.add_signal_handler``: removing a loop handler puts back SIGHUP's default disposition
    (which ends the process) before SIG_IGN can replace it, and a SIGHUP in that gap killed a
    shutdown. This one goes to SIG_IGN in one ``signal.signal`` call. (The loop's wakeup fd,
    set for its SIGTERM/SIGINT handlers, wakes it to run the handler.)"""
    def handler(signum: int, frame: object) -> None:
        if not loop.is_closed():  # (one caught just before the shutdown ignored them)
            loop.call_soon_threadsafe(callback)
    signal.signal(signal.SIGHUP, handler)


class Supervisor:
    """Starts, watches and stops the workers; serves the admin listener for all of them."""

    def __init__(self, settings: Settings, *, run_dir: str, listen: str) -> None:
        self.settings = settings
        self.run_dir = run_dir
        self.listen = listen
        self.workers = [_Worker(i, admin_socket(run_dir, i))
                        for i in range(settings.runtime.workers)]
        self._stop = asyncio.Event()
        self._pipe = os.pipe()  # workers get the read end; EOF tells them we are gone
        self._hangups: set[asyncio.Task[None]] = set()  # SIGHUPs waiting for a worker to serve

    async def run(self) -> int:
        from proxy.admin import (  # here: prometheus_client only after PROMETHEUS_MULTIPROC_DIR
            NamedCheck,
            bound_address,
            build_admin_app,
            multiprocess_metrics,
            serve_admin,
            worker_checks,
            worker_policies,
        )

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._signalled)
        release_stop_signals()  # (before any worker starts: they inherit the mask)
        on_sighup(loop, self._hangup)
        reaper = reaper_as_init(loop, ours=self._live_pids)
        keepers: list[asyncio.Task[None]] = []
        admin = None
        try:
            for worker in self.workers:
                await self._spawn(worker)
            failed = await self._all_up()
            if failed is not None:
                return failed
            app = build_admin_app(
                checks=worker_checks(self.workers),
                live_checks=[NamedCheck("workers", self._liveness)],
                describe_policies=worker_policies(self.workers),
                render_metrics=multiprocess_metrics(os.environ["PROMETHEUS_MULTIPROC_DIR"]))
            try:
                admin = await serve_admin(app, listen=self.settings.listen.admin_listen)
            except OSError as exc:
                from proxy.relay.listen import listen_failure

                log.error("%s", listen_failure("--admin-listen", self.settings.listen.admin_listen,
                                               exc))
                return 2
            keepers = [asyncio.create_task(self._keep(w)) for w in self.workers]
            log.info("serving the Kubernetes API on %s with %d workers (pids %s); admin on %s",
                     self.listen, len(self.workers), ", ".join(self._pids()),
                     bound_address(admin))
            await self._stop.wait()
            log.info("shutting down %d workers", len(self.workers))
        finally:
            if admin is not None:  # unready while the workers finish their calls
                admin.shutting_down()
            for task in (*keepers, *self._hangups):
                task.cancel()
            await self._stop_workers()
            if admin is not None:
                await admin.cleanup()
            signal.signal(signal.SIGHUP, signal.SIG_IGN)  # not its default (the end): on_sighup
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            for fd in self._pipe:
                os.close(fd)
            if reaper is not None:
                reaper.close()
        return 0

    def _signalled(self) -> None:
        """The first SIGTERM/SIGINT stops the workers (each drains); a second one is passed on
        (each cuts its calls still in flight, then exits)."""
        if not self._stop.is_set():
            self._stop.set()
            return
        for worker in self.workers:
            if worker.pid is not None and worker.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.send_signal(signal.SIGTERM)

    def _hangup(self) -> None:
        """SIGHUP: each worker reloads its policy files (it is passed on). Only to a worker that
        serves: one still starting has SIGHUP's default disposition (a signal the supervisor
        handles is at its default in a new process) and would die of it; it gets it once its
        admin socket answers (it may have read its files before the change). So does one
        being spawned (forked, its process not yet had), which used to be skipped."""
        for worker in self.workers:
            if not worker.spawning and (worker.pid is None or worker.proc is None):
                continue  # not running: it reads its files when it starts
            if worker.up and not worker.spawning:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.send_signal(signal.SIGHUP)
                continue
            task = asyncio.get_running_loop().create_task(self._hangup_once_up(worker))
            self._hangups.add(task)
            task.add_done_callback(self._hangups.discard)

    async def _hangup_once_up(self, worker: _Worker) -> None:
        while worker.spawning and not await self._stopped_within(0.05):
            pass  # (a SIGHUP handled while it is spawned: its process, once had)
        proc = worker.proc
        while (proc is not None and worker.proc is proc and proc.returncode is None
               and not self._stop.is_set()):
            if worker.up or await self._answers(worker):
                worker.up = True  # (its admin socket answered since this start)
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGHUP)
                return
            await self._stopped_within(0.05)

    async def _liveness(self) -> tuple[bool, str]:
        return liveness(self.workers, now=asyncio.get_running_loop().time())

    def _live_pids(self) -> set[int]:
        return {pid for w in self.workers if (pid := w.pid) is not None}

    def _pids(self) -> list[str]:
        return [str(w.proc.pid) for w in self.workers if w.proc is not None]

    async def _spawn(self, worker: _Worker) -> None:
        read_end = self._pipe[0]
        # process_group=0: a group of its own, so a terminal's Ctrl-C (SIGINT to the foreground
        # group) reaches the supervisor alone, which passes it on once: the workers drain
        # rather than take it as the second signal that cuts them
        worker.spawning, worker.up = True, False
        try:
            worker.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "proxy.workers", self.run_dir, str(worker.index),
                str(read_end), stdin=asyncio.subprocess.DEVNULL, pass_fds=(read_end,),
                process_group=0)
        finally:
            worker.spawning = False
        worker.started = asyncio.get_running_loop().time()

    async def _answers(self, worker: _Worker) -> bool:
        from proxy.admin import unix_get

        try:
            status, _ = await unix_get(worker.socket, "/healthz", within=1.0)
        except Exception:  # refused, no socket yet, timed out (aiohttp's errors): not up yet
            return False
        return status == 200

    async def _all_up(self) -> int | None:
        """Wait for every worker's admin socket; an exit status if starting failed."""
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT
        while not self._stop.is_set():
            for worker in self.workers:
                assert worker.proc is not None
                if worker.proc.returncode is not None:
                    code = worker.proc.returncode
                    log.error("worker %d %s while starting; stopping", worker.index,
                              _describe_exit(code))
                    return code if code > 0 else 1
                if not worker.up:
                    worker.up = await self._answers(worker)
            if all(w.up for w in self.workers):
                return None
            if asyncio.get_running_loop().time() > deadline:
                log.error("workers not up after %gs; stopping", START_TIMEOUT)
                return 1
            await self._stopped_within(0.05)
        log.info("shutting down %d workers while they start", len(self.workers))
        return 0

    async def _keep(self, worker: _Worker) -> None:
        """Restart ``worker`` whenever it dies, until the supervisor stops."""
        from proxy.engine.metricfiles import retire

        loop = asyncio.get_running_loop()
        while True:
            assert worker.proc is not None
            code = await self._until_exit(worker, worker.proc)
            if self._stop.is_set():
                return
            now = loop.time()
            ran = now - worker.started
            # in a thread: it waits for a /metrics render under way (up to ~220 ms)
            await asyncio.to_thread(retire, worker.proc.pid, os.environ["PROMETHEUS_MULTIPROC_DIR"])
            if worker.failing_since is None or (worker.up and ran >= STABLE_AFTER):
                worker.failing_since = now  # (a worker that served steadily: failing anew)
            worker.quick_deaths = worker.quick_deaths + 1 if ran < STABLE_AFTER else 0
            delay = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** max(0, worker.quick_deaths - 1))
            worker.last_exit = _describe_exit(code)
            worker.up = False
            log.error("worker %d (pid %d) %s after %.1fs; restarting in %.1fs", worker.index,
                      worker.proc.pid, worker.last_exit, ran, delay)
            while not await self._stopped_within(delay):  # if stopped: the outer check ends it
                try:
                    await self._spawn(worker)
                    log.info("worker %d restarted (pid %d)", worker.index, worker.proc.pid)
                    break
                except OSError as exc:
                    delay = BACKOFF_MAX
                    log.error("cannot start worker %d (%s); retrying in %.0fs", worker.index,
                              exc, delay)

    async def _until_exit(self, worker: _Worker, proc: asyncio.subprocess.Process) -> int:
        """Wait for ``proc`` (``worker``'s) to exit; meanwhile mark the worker up once its
        admin socket answers (a restarted worker stayed down to :func:`liveness`)."""
        watch = asyncio.create_task(self._mark_up(worker, proc))
        try:
            return await proc.wait()
        finally:
            watch.cancel()

    async def _mark_up(self, worker: _Worker, proc: asyncio.subprocess.Process) -> None:
        while not worker.up and proc.returncode is None:
            if await self._answers(worker):
                worker.up = worker.proc is proc
                break
            if await self._stopped_within(0.1):
                return
        await self._watch(worker, proc)

    async def _watch(self, worker: _Worker, proc: asyncio.subprocess.Process) -> None:
        """Kill ``proc`` (``worker``'s, serving) once its admin socket has not answered for
        ``LIVENESS_GRACE``: it runs, but serves nothing (its connections wait for ever)."""
        loop = asyncio.get_running_loop()
        answered = loop.time()
        while not await self._stopped_within(WATCH_EVERY) and proc.returncode is None:
            if await self._answers(worker):
                answered = loop.time()
            elif loop.time() - answered >= LIVENESS_GRACE:
                log.error("worker %d (pid %d) has not answered its admin socket for %.0fs; "
                          "killing it", worker.index, proc.pid, loop.time() - answered)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                return

    async def _stopped_within(self, seconds: float) -> bool:
        """Wait ``seconds`` or until the supervisor stops; whether it stopped."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)
        return self._stop.is_set()

    async def _stop_workers(self) -> None:
        live = [w.proc for w in self.workers if w.proc is not None and w.proc.returncode is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        waits = [asyncio.ensure_future(proc.wait()) for proc in live]
        if not waits:
            return
        within = self.settings.runtime.shutdown_grace + STOP_MARGIN
        _, pending = await asyncio.wait(waits, timeout=within)
        if pending:
            log.warning("%d workers still running %gs after SIGTERM; killing them",
                        len(pending), within)
            for proc in live:
                if proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            await asyncio.wait(waits)


def _describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _configure_logging(settings: Settings) -> None:
    """The supervisor's log: stderr, in the format of :func:`proxy.app.configure_logging`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s [supervisor]: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, settings.log.level.upper(), logging.INFO))


def worker_main(argv: list[str]) -> int:
    """One worker: ``RUN_DIR INDEX FD`` (FD: the pipe that reads EOF when the supervisor dies)."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until serving: see proxy/cli.py
    run_dir, index, parent_fd = argv[0], int(argv[1]), int(argv[2])
    settings = Settings.from_json(Path(run_dir, "settings.json").read_text("utf-8"))
    settings = replace(settings, listen=replace(
        settings.listen, admin_listen="unix:" + admin_socket(run_dir, index)))
    from proxy.app import serve

    try:
        return serve(settings, reuse_port=True, parent_fd=parent_fd, tag=f"worker {index}")
    finally:
        # the supervisor died without cleaning up: the last worker out does. Asked of the pipe
        # (readable only at EOF: nobody writes to it), not of getppid(): a dying process closes
        # its files before its children are given a new parent
        if select.select([parent_fd], [], [], 0)[0]:
            shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(worker_main(sys.argv[1:]))
