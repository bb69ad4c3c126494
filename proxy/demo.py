"""``opgate demo``: the whole picture on one machine, live.

Starts a real etcd + kube-apiserver (the test harness), Redis when a ``redis-server`` binary is
there (else in-process buckets, said on screen), opgate with ``policies/demo``, and the sample
operator behind it with its ServiceAccount token. It creates a few Widgets, then keeps one of
them noisy (its spec changes several times a second) so that its writes get throttled while the
quiet ones are not; another ServiceAccount calls now and then and is denied by the identity
policy; a fault turns a few status writes into conflicts. Every call opgate handles is printed
as it happens. Ctrl-C stops everything.

Every process it starts runs in a session of its own (``proxy.envtest.procs``), so no signal
reaches them but through the demo: whatever stops it, a Ctrl-C, a SIGTERM or the SIGHUP of a
closed terminal, and whenever, while it starts too, it stops them all before it exits, as
nothing else would (an ``atexit`` hook never runs on a signal's default action). A failure to
start, or a process that dies, is said in a ``demo:`` line with the last lines of the log that
says why, exit code 1; the logs are then kept (where the message names them).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from proxy.envtest.api import ApiError
from proxy.envtest.cluster import LocalCluster
from proxy.envtest.procs import Proc, free_port, tail

NAMESPACE = "opgate-demo"
ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "reconciler"  # its *.yaml are package data (pyproject.toml)
DEFAULT_POLICIES = "policies/demo"

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# every call the demo makes is to 127.0.0.1: never through the environment's http_proxy
# (urllib's default opener sends loopback calls there unless no_proxy names them)
_LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))

# the head of one of opgate's log records (proxy/app.py's format): its level and logger
_RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ([A-Z]+) ([\w.]+)")
_SHOWN_LEVELS = frozenset({"WARNING", "ERROR", "CRITICAL"})

_COLOURS = {"allowed": "32", "throttled": "33", "denied": "31", "unauthorized": "31",
            "error": "31", "fault": "35"}


def _paint(text: str, decision: str) -> str:
    if not sys.stdout.isatty():
        return text
    return f"\033[{_COLOURS.get(decision, '0')}m{text}\033[0m"


def _say(message: str) -> None:
    print(f"demo: {message}", flush=True)


def _wait_http(url: str, *, timeout: float, proc: Proc) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited; {_last_lines(proc)}")
        with contextlib.suppress(OSError):
            with _LOOPBACK.open(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f}s; {_last_lines(proc)}")


def _last_lines(proc: Proc) -> str:
    """Why ``proc`` failed, as far as its log says (the log is kept: ``run_demo``)."""
    return f"the last lines of {proc.log}:\n{tail(proc.log, 20)}"


def _widget(name: str, color: str) -> dict[str, Any]:
    return {"apiVersion": "demo.opgate.dev/v1", "kind": "Widget",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"color": color, "data": {"owner": "demo", "size": "small"}}}


def _line(entry: dict[str, Any]) -> str:
    decision = str(entry.get("decision", ""))
    target = entry.get("resource") or entry.get("path", "")
    if entry.get("subresource"):
        target = f"{target}/{entry['subresource']}"
    where = "/".join(str(entry[k]) for k in ("namespace", "name") if entry.get(k))
    text = (f"{entry.get('time', '')[11:23]} {decision.upper():<9} {entry.get('code', ''):>3} "
            f"{entry.get('verb', ''):<6} {target:<31} {where:<24} {entry.get('duration_ms', '')}ms"
            f"  {str(entry.get('user', '')).removeprefix('system:serviceaccount:')}")
    return _paint(text, decision)


class _LogView:
    """What the demo shows of opgate's log, line by line: every access-log entry (a JSON line),
    and each warning, error or policy load (``opgate.policies``) with the lines of its message
    after the first: a refused edit's ``file:line: message`` comes on those, and the banner
    invites editing the policies, so an edit is seen to apply, or why not."""

    def __init__(self, counts: dict[str, int]) -> None:
        self._counts = counts
        self._showing = False  # the log record these lines belong to is shown

    def show(self, line: str) -> str | None:
        """The text to print for one whole line of the log, or ``None``."""
        if line.startswith("{"):
            self._showing = False
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if isinstance(entry, dict):
                    decision = str(entry.get("decision", ""))
                    self._counts[decision] = self._counts.get(decision, 0) + 1
                    return _line(entry)
            return None
        record = _RECORD.match(line)
        if record is not None:
            level, logger = record.groups()
            self._showing = level in _SHOWN_LEVELS or logger == "opgate.policies"
        return f"opgate: {line.rstrip()}" if self._showing else None


def _follow(log: Path, stop: threading.Event, counts: dict[str, int]) -> None:
    """Print what :class:`_LogView` shows of opgate's log as it is written (a line is taken
    whole: one caught half-written is completed by the next read)."""
    view = _LogView(counts)
    pending = ""
    with log.open("r", errors="replace") as stream:
        while not stop.is_set():
            pending += stream.readline()
            if not pending.endswith("\n"):
                time.sleep(0.1)
                continue
            text, pending = view.show(pending), ""
            if text is not None:
                print(text, flush=True)


def _noisy(cluster: LocalCluster, stop: threading.Event) -> None:
    """Keep widget-1 busy: its spec changes 4 times a second, so its writes get throttled."""
    n = 0
    while not stop.wait(0.25):
        n += 1
        with contextlib.suppress(ApiError, OSError):
            cluster.call("PATCH", f"/apis/demo.opgate.dev/v1/namespaces/{NAMESPACE}/widgets/"
                         "widget-1", body={"spec": {"data": {"tick": str(n)}}},
                         content_type="application/merge-patch+json")


def _intruder(url: str, token: str, stop: threading.Event) -> None:
    """Another ServiceAccount with a valid token (and RBAC to read ConfigMaps) tries its luck
    every few seconds: opgate's identity policy answers 403 before the apiserver sees it."""
    request = urllib.request.Request(f"{url}/api/v1/namespaces/{NAMESPACE}/configmaps",
                                     headers={"Authorization": f"Bearer {token}"})
    while not stop.wait(3.0):
        with contextlib.suppress(OSError):
            _LOOPBACK.open(request, timeout=5).close()


class _Stopped(BaseException):
    """A stop signal came while the demo started: unwinds the start (as KeyboardInterrupt
    would, but for SIGTERM and SIGHUP too) so that what was started is stopped."""


class _Stopper:
    """The handler of :data:`STOP_SIGNALS`: the first one sets ``event``, and while the demo
    starts (``unwind``) also raises :class:`_Stopped`; later ones are ignored, so that a
    second Ctrl-C cannot cut the stopping short and leave processes behind."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.unwind = True

    def __call__(self, signum: int, frame: object) -> None:
        if self.event.is_set():
            return
        self.event.set()
        if self.unwind:
            raise _Stopped(signum)


def _start(proc: Proc, procs: list[Proc]) -> None:
    """Start ``proc``, listed first: a signal between the two cannot leave it unlisted."""
    procs.append(proc)
    proc.start()


def run_demo(*, policies: str, widgets: int, duration: float) -> int:
    policies_path = Path(policies).resolve()
    if not policies_path.exists() and policies == DEFAULT_POLICIES:
        policies_path = ROOT / DEFAULT_POLICIES  # a checkout, run from another directory
    if not policies_path.exists():
        print(f"demo: {policies}: no such policy file or directory; run the demo from a "
              "checkout of opgate (`make demo`) or pass --policies PATH", file=sys.stderr)
        return 2
    procs: list[Proc] = []
    stop = threading.Event()
    counts: dict[str, int] = {}
    stopper = _Stopper()
    previous = {sig: signal.signal(sig, stopper) for sig in STOP_SIGNALS}
    cluster = LocalCluster()
    keep = cluster.keep_workdir
    cluster.keep_workdir = True  # a failure's logs stay to be read (its message names them)
    failed = True
    try:
        _say("starting etcd + kube-apiserver (the first run builds them, once)")
        cluster.start()
        work = Path(cluster.workdir) / "demo"
        work.mkdir(exist_ok=True)
        redis_args: list[str] = []
        redis = shutil.which("redis-server")
        if redis:
            port = free_port()
            _start(Proc("redis", [redis, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                  "--appendonly", "no"], log=work / "redis.log"), procs)
            redis_args = ["--redis-url", f"redis://127.0.0.1:{port}/0"]
            _say(f"redis-server on 127.0.0.1:{port}: rate-limit buckets live in Redis")
        else:
            _say("no redis-server binary: rate-limit buckets are in-process (one replica)")

        for doc in yaml.safe_load_all((EXAMPLE / "rbac.yaml").read_text()):
            if doc:
                cluster.apply(doc)
        cluster.install_crd((EXAMPLE / "widget-crd.yaml").read_text())
        token = cluster.token_request(NAMESPACE, "sample-operator", audiences=None,
                                      expiration_seconds=3600)
        cluster.create_service_account_with_rbac(NAMESPACE, "intruder", [
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}])
        intruder = cluster.token_request(NAMESPACE, "intruder", audiences=None,
                                         expiration_seconds=3600)
        # opgate's own identity upstream: discovery, JWKS, TokenReview (never sent for a
        # client that brings its own token)
        own_token = work / "opgate.token"
        own_token.write_text(cluster.admin_token)
        own_token.chmod(0o600)

        api_port, admin_port = free_port(), free_port()
        opgate = Proc("opgate", [sys.executable, "-m", "proxy", "serve",
                                 "--upstream", cluster.url, "--upstream-ca", cluster.ca_file,
                                 "--listen", f"127.0.0.1:{api_port}",
                                 "--admin-listen", f"127.0.0.1:{admin_port}",
                                 "--policies", str(policies_path), "--token-file", str(own_token),
                                 *redis_args],
                      log=work / "opgate.log", cwd=ROOT)
        _start(opgate, procs)
        admin = f"http://127.0.0.1:{admin_port}"
        _wait_http(admin + "/readyz", timeout=30, proc=opgate)

        kubeconfig = work / "operator.kubeconfig"
        cluster.write_kubeconfig(kubeconfig, server=f"http://127.0.0.1:{api_port}", token=token)
        operator = Proc("reconciler", [sys.executable, "-m", "examples.reconciler",
                                       "--kubeconfig", str(kubeconfig), "--namespace", NAMESPACE],
                        log=work / "reconciler.log", cwd=ROOT,
                        env={**os.environ, "PYTHONPATH": str(ROOT)})
        _start(operator, procs)

        print(f"""
  kube-apiserver   {cluster.url}   (admin kubeconfig: {cluster.kubeconfig_path})
  opgate API       http://127.0.0.1:{api_port}   -> the operator's kubeconfig: {kubeconfig}
  opgate admin     {admin}/metrics  {admin}/debug/policies  {admin}/readyz?verbose
  policies         {policies_path}   (edit them now: changes apply within a second)
  logs             {work}
  Ctrl-C stops everything.
""", flush=True)
        follower = threading.Thread(target=_follow, args=(opgate.log, stop, counts), daemon=True)
        follower.start()
        colors = ["red", "green", "blue", "amber", "teal", "plum", "lime", "navy"]
        for i in range(1, widgets + 1):
            cluster.apply(_widget(f"widget-{i}", colors[i % len(colors)]))
        _say(f"created {widgets} Widgets; widget-1 is noisy and will be throttled")
        threading.Thread(target=_noisy, args=(cluster, stop), daemon=True).start()
        threading.Thread(target=_intruder, args=(f"http://127.0.0.1:{api_port}", intruder, stop),
                         daemon=True).start()
        _say("the ServiceAccount opgate-demo/intruder calls every 3 s and is denied")

        stopper.unwind = False  # started: from now on a signal ends the loop below
        code = _run(procs, cluster, stopper.event, duration=duration)
        failed = code != 0
        return code
    except _Stopped:
        failed = False
        return 0
    except (RuntimeError, OSError) as exc:  # BinariesUnavailable, ApiError, a start that failed
        dead = cluster.exited()  # the reason for a call that failed, if it died
        reason = f"{dead.name} exited; {_last_lines(dead)}" if dead is not None else exc
        print(f"demo: could not start: {reason}", file=sys.stderr, flush=True)
        return 1
    finally:
        stopper.unwind = False
        stop.set()
        for proc in reversed(procs):
            proc.stop()
        cluster.keep_workdir = keep or failed
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        summary = ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"
        with contextlib.suppress(OSError):  # the terminal may be gone (SIGHUP)
            _say(f"stopped everything; calls seen by opgate: {summary}")
            if cluster.keep_workdir and cluster.workdir != Path():
                _say(f"logs kept in {cluster.workdir}")


def _run(procs: list[Proc], cluster: LocalCluster, stopped: threading.Event, *,
         duration: float) -> int:
    """Wait for a stop signal or the end of ``duration``: 0; 1 once a process died, the
    cluster's own included (with etcd or kube-apiserver gone every call fails)."""
    deadline = time.monotonic() + duration if duration > 0 else None
    while not stopped.wait(1.0):
        if deadline is not None and time.monotonic() > deadline:
            break
        dead = next((proc for proc in procs if not proc.alive()), None) or cluster.exited()
        if dead is not None:
            _say(f"{dead.name} exited unexpectedly; {_last_lines(dead)}")
            return 1
    return 0
