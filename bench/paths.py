"""The paths a request can take to one upstream, each a running server the bench measures.

``direct`` (no proxy), ``opgate`` (no policies, no access log: the relay alone), ``opgate-full``
(every middleware that exists: identity verifying the caller's JWT, cached after the first
verification; fault injection with a rule the bench never triggers; a quota on configmaps
(when this opgate has the quota middleware) that the bench's reads never reach; rate limits in
Redis with leasing under a generous rule that rejects nothing; metrics; and the access log
written to a file as a real deployment writes it to stdout), ``kubectl-proxy`` (the real
binary, pointed at the upstream by a kubeconfig) and ``nginx-proxy`` (nginx as a streaming
reverse proxy with a keep-alive pool: the practical limit). ``opgate-aiohttp`` (optional,
``--with-aiohttp``) is the full chain on ``--relay aiohttp`` instead of the default relay, to
compare the two relay cores.

Every proxy listens on plain HTTP on loopback, as kubectl proxy does. Every client of every
path sends the same ``Authorization: Bearer <caller token>`` (:mod:`bench.caller`): the full
chain needs it to know its caller, and so no path gets a cheaper request than another. Each
proxy forwards the client's token and adds its own (``--token-file``, the kubeconfig's user,
nginx's ``map``) only to a request that has none, as opgate and client-go do.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from bench import procstat
from bench.caller import NAME as CALLER_NAME
from bench.caller import NAMESPACE as CALLER_NAMESPACE
from bench.interpreter import opgate_python
from bench.procs import Procs, free_port, wait_http, wait_port
from bench.upstreams import Upstream

REPO = Path(__file__).resolve().parent.parent
NAMES = ("direct", "opgate", "opgate-full", "kubectl-proxy", "nginx-proxy")
AIOHTTP = "opgate-aiohttp"  # the full chain on --relay aiohttp (--with-aiohttp)
FULL_CHAIN = ("opgate-full", AIOHTTP)
STATIC_TOKEN = "opgate-bench-token"

POLICY = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {name: bench}
spec:
  mode: enforce
  identity:
    # the caller's JWT is verified against the upstream's JWKS once, then cached
    issuers: [{kubernetes: {}}]
    allow:
      - serviceAccount: @CALLER@
    rules:
      - {name: reads, verbs: [get, list, watch]}
  faults:
    # matched against every call, never fires here (the bench never deletes widgets)
    - name: never-in-bench
      match: {verbs: [delete], resources: [widgets]}
      respond: {code: 503}
@QUOTA@  rateLimits:
    # generous: nothing is ever rejected, but every read is decided (Redis + leasing)
    - name: reads
      match: {verbs: [get, list, watch], resources: [configmaps]}
      key: "{user}/{resource}"
      qps: 1000000
      burst: 1000000
      lease: true
@EXTRA@""".replace("@CALLER@", f"{CALLER_NAMESPACE}/{CALLER_NAME}")

QUOTA = """\
  quotas:
    # counted by a metadata-only list+watch of every configmap; checked on creates only (the
    # bench never creates: this is what the middleware costs a read, and its informer's upkeep)
    - name: configmaps-per-namespace
      resources: [configmaps]
      max: 100000
"""

PROBE_RULE = """\
    - name: probe
      match: {verbs: [get], resources: [secrets]}
      key: "{user}"
      qps: 1000000
      burst: 1000000
"""


@dataclass(frozen=True, slots=True)
class Target:
    """One path: where clients send requests, and the process to measure (``None``: direct)."""

    name: str
    url: str
    pid: int | None
    upstream: Upstream
    admin: str | None = None  # opgate's admin listener
    policy_file: Path | None = None
    relay: str | None = None  # opgate's --relay (None: its default)
    workers: int = 1  # opgate's worker processes (--workers)

    @property
    def headers(self) -> dict[str, str]:
        """What a client of this path sends: the caller's token, the same on every path."""
        if self.upstream.caller is not None:
            return self.upstream.caller.headers
        token = self.upstream.token or STATIC_TOKEN
        return {"Authorization": f"Bearer {token}"} if self.pid is None else {}

    @property
    def ca_file(self) -> str | None:
        return self.upstream.ca_file if self.pid is None else None

    @property
    def full_chain(self) -> bool:
        return self.policy_file is not None


def _policy(*, probe: bool, quota: bool) -> str:
    return (POLICY.replace("@EXTRA@", PROBE_RULE if probe else "")
            .replace("@QUOTA@", QUOTA if quota else ""))


@functools.cache
def quota_supported() -> bool:
    """Whether this opgate knows ``spec.quotas`` (``opgate check`` accepts the bench's policy
    with it): the full chain includes a quota as soon as the middleware exists."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "bench.yaml"
        path.write_text(_policy(probe=False, quota=True))
        out = subprocess.run([sys.executable, "-m", "proxy", "check", str(path)], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    if out.returncode == 0:
        return True
    if 'unknown field "quotas"' in out.stdout + out.stderr:
        return False
    raise RuntimeError(f"opgate check refuses the bench's policy:\n{out.stdout}{out.stderr}")


def write_policy(path: Path, *, probe: bool) -> None:
    """The full chain's policy; ``probe`` adds a rule the reload measure watches for. Written
    to a temp file and renamed, as an editor or the kubelet would, so a reader never sees half."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(_policy(probe=probe, quota=quota_supported()))
    os.replace(tmp, path)


def _token_file(work: Path, token: str) -> Path:
    path = work / "token"
    path.write_text(token)
    path.chmod(0o600)
    return path


def start_opgate(
    procs: Procs, work: Path, *, upstream: Upstream, full: bool, redis_url: str | None,
    name: str, wrapper: tuple[str, ...] = (), relay: str | None = None, workers: str = "1",
) -> Target:
    """opgate on a free port; ``wrapper`` runs it under another command (py-spy); ``relay``
    ``None`` keeps opgate's default relay; ``workers`` is passed to ``--workers``."""
    port, admin = free_port(), free_port()
    argv = [*wrapper, opgate_python(), "-m", "proxy", "serve", "--upstream", upstream.url,
            "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}",
            "--token-file", str(_token_file(work, upstream.token or STATIC_TOKEN))]
    if upstream.ca_file:
        argv += ["--upstream-ca", upstream.ca_file]
    if relay is not None:
        argv += ["--relay", relay]
    if workers != "1":
        argv += ["--workers", workers]
    policy = None
    if full:
        policies = work / "policies"
        policies.mkdir(exist_ok=True)
        policy = policies / "bench.yaml"
        write_policy(policy, probe=False)
        # the audit log at its default level (Metadata for every call), to a file in a
        # directory of its own, as the chart has it (/var/log/opgate): opgate watches the policy
        # directory's parent too (a ConfigMap's ..data swap), where each audit write would be
        # an event for its watcher thread that no deployment sees
        logs = work / "log"
        logs.mkdir(exist_ok=True)
        argv += ["--policies", str(policies), "--audit-log", str(logs / f"audit-{name}.log")]
        if redis_url:
            argv += ["--redis-url", redis_url]
    else:
        argv += ["--no-access-log"]
    proc = procs.start(name, argv, cwd=REPO)
    # the admin listener opens once every worker answers; then through the proxy to the
    # upstream with the caller's token (opgate's /readyz stays 503 without --policies)
    wait_http(f"http://127.0.0.1:{admin}/healthz", proc=proc, timeout=90)
    target = Target(name, f"http://127.0.0.1:{port}", proc.pid, upstream,
                    admin=f"http://127.0.0.1:{admin}", policy_file=policy, relay=relay)
    wait_http(target.url + "/version", proc=proc, timeout=60, headers=target.headers)
    assert proc.pid is not None
    return replace(target, workers=max(1, len(procstat.descendants(proc.pid)) - 1)
                   if workers != "1" else 1)


def start_kubectl_proxy(procs: Procs, work: Path, *, upstream: Upstream, kubectl: Path,
                        name: str) -> Target:
    port = free_port()
    cluster: dict[str, object] = {"server": upstream.url}
    if upstream.ca_file:
        cluster["certificate-authority"] = upstream.ca_file
    config = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "up", "cluster": cluster}],
        "users": [{"name": "u", "user": {"token": upstream.token or STATIC_TOKEN}}],
        "contexts": [{"name": "c", "context": {"cluster": "up", "user": "u"}}],
        "current-context": "c",
    }
    kubeconfig = work / "kubeconfig"
    kubeconfig.touch(mode=0o600)
    kubeconfig.write_text(json.dumps(config))
    proc = procs.start(name, [str(kubectl), "proxy", f"--kubeconfig={kubeconfig}",
                              "--address=127.0.0.1", f"--port={port}", "--accept-hosts=.*",
                              "--disable-filter=true"])
    wait_port(port, proc=proc)
    assert proc.pid is not None
    return Target(name, f"http://127.0.0.1:{port}", proc.pid, upstream)


def nginx_proxy_conf(work: Path, *, upstream: Upstream, port: int) -> str:
    host_port = upstream.url.split("://", 1)[1]
    scheme = "https" if upstream.tls else "http"
    tls = ""
    if upstream.tls:
        tls = (f"proxy_ssl_trusted_certificate {upstream.ca_file}; proxy_ssl_verify on;\n"
               "    proxy_ssl_name localhost; proxy_ssl_server_name on; "
               "proxy_ssl_session_reuse on;\n")
    token = upstream.token or STATIC_TOKEN
    return f"""\
worker_processes 1;
daemon off;
pid {work}/nginx.pid;
error_log {work}/nginx.error.log warn;
worker_rlimit_nofile 20000;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {work}/tmp/body; proxy_temp_path {work}/tmp/proxy;
  fastcgi_temp_path {work}/tmp/fcgi; uwsgi_temp_path {work}/tmp/uwsgi;
  scgi_temp_path {work}/tmp/scgi;
  keepalive_requests 100000000; keepalive_timeout 600s;
  # the client's token when it sent one, else the proxy's own (as opgate and client-go do)
  map $http_authorization $upstream_authorization {{
    "" "Bearer {token}";
    default $http_authorization;
  }}
  upstream up {{ server {host_port}; keepalive 64; keepalive_requests 100000000; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
      proxy_pass {scheme}://up; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_set_header Authorization $upstream_authorization;
      proxy_buffering off; proxy_request_buffering off; proxy_read_timeout 3600s;
    {tls}  }}
  }}
}}
"""


def start_nginx_proxy(procs: Procs, work: Path, *, upstream: Upstream, name: str) -> Target:
    port = free_port()
    (work / "tmp").mkdir(exist_ok=True)
    conf = work / "nginx.conf"
    conf.write_text(nginx_proxy_conf(work, upstream=upstream, port=port))
    proc = procs.start(name, ["nginx", "-p", str(work), "-c", str(conf)])
    wait_port(port, proc=proc)
    assert proc.pid is not None
    return Target(name, f"http://127.0.0.1:{port}", proc.pid, upstream)


def _path_dir(work: Path, label: str) -> Path:
    d = work / label
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o755)
    return d


def start_paths(
    procs: Procs, work: Path, *, upstream: Upstream, kubectl: Path | None, redis_url: str | None,
    names: tuple[str, ...] = NAMES,
) -> list[Target]:
    """Start every path of ``names`` in front of ``upstream`` (each in its own work dir)."""
    targets: list[Target] = []
    for name in names:
        label = f"{upstream.name}-{name}"
        d = _path_dir(work, label)
        if name == "direct":
            targets.append(Target(name, upstream.url, None, upstream))
        elif name in ("opgate", *FULL_CHAIN):
            targets.append(start_opgate(procs, d, upstream=upstream, full=name in FULL_CHAIN,
                                        redis_url=redis_url, name=label,
                                        relay="aiohttp" if name == AIOHTTP else None))
        elif name == "kubectl-proxy" and kubectl is not None:
            targets.append(start_kubectl_proxy(procs, d, upstream=upstream, kubectl=kubectl,
                                               name=label))
        elif name == "nginx-proxy":
            targets.append(start_nginx_proxy(procs, d, upstream=upstream, name=label))
    return [replace(t, name=n) for t, n in zip(targets, names_started(names, kubectl), strict=True)]


def names_started(names: tuple[str, ...], kubectl: Path | None) -> list[str]:
    return [n for n in names if n != "kubectl-proxy" or kubectl is not None]


@contextlib.contextmanager
def with_workers(procs: Procs, work: Path, targets: Sequence[Target], *,
                 redis_url: str | None) -> Iterator[list[Target]]:
    """``targets`` with each full-chain opgate replaced by a copy on ``--workers auto`` (one
    worker per CPU on one SO_REUSEPORT port; needs Redis, which the full chain has), under the
    same name; the copies are stopped on exit. Without Redis the targets are kept as they are."""
    started: list[Target] = []
    out: list[Target] = []
    try:
        for t in targets:
            if t.full_chain and redis_url:
                label = f"{t.upstream.name}-{t.name}-workers"
                copy = start_opgate(procs, _path_dir(work, label), upstream=t.upstream,
                                    full=True, redis_url=redis_url, name=label, relay=t.relay,
                                    workers="auto")
                started.append(copy)
                out.append(replace(copy, name=t.name))
            else:
                out.append(t)
        yield out
    finally:
        procs.stop_pids({t.pid for t in started if t.pid is not None})
