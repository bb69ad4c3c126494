"""A real etcd + kube-apiserver on loopback, for tests that must face the real API.

Fakes cannot tell whether opgate relays watches, discovery, protobuf, TokenRequest or RBAC the
way kube-apiserver answers them; this starts the real thing (as controller-runtime's envtest
does, but written for this project), with what opgate's identity tier needs: a service-account
issuer with OIDC discovery and JWKS, TokenRequest, RBAC, ResourceQuota admission.

Harness API (stable; the e2e tests and the sample reconciler's tests use it)::

    with LocalCluster() as cluster:          # or: async with LocalCluster() ...; or start()/stop()
        cluster.url, cluster.ca_file, cluster.admin_token, cluster.kubeconfig_path, cluster.issuer
        cluster.call("GET", "/api/v1/namespaces")        # sync, as admin -> ApiResponse
        await cluster.request("GET", "/version")         # the same, awaitable
        cluster.create_namespace("team-a")
        cluster.create_service_account_with_rbac("team-a", "op", rules=[{...PolicyRule...}])
        token = cluster.token_request("team-a", "op", audiences=None, expiration_seconds=3600)
        cluster.install_crd(crd_manifest)                # waits until Established and served
        cluster.write_kubeconfig(path, server=url, token=token, ca_file=None, insecure=False)
        cluster.restart_apiserver(kill=False)             # same port, same etcd
        cluster.stop_apiserver(kill=False); cluster.start_apiserver()
        cluster.exited()                                  # etcd or kube-apiserver if it died
        cluster.issue_serving_cert("opgate")              # (cert, key) signed by ca_file
        cluster.compact_etcd()                            # old resourceVersions -> 410

No controller-manager runs: namespaces never finish deleting, ServiceAccounts get no token
Secrets, and a ResourceQuota enforces only once its ``status`` is written (``set_quota_status``).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import secrets
import shutil
import ssl
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from proxy.envtest import pki
from proxy.envtest.api import AdminApi, ApiError, ApiResponse
from proxy.envtest.binaries import KubeBinaries, find_or_build
from proxy.envtest.procs import Proc, free_port, http_ok, port_open, tail
from proxy.envtest.reaper import reaper

DEFAULT_ISSUER = "https://kubernetes.default.svc.cluster.local"


class LocalCluster(AdminApi):
    """etcd + kube-apiserver in a temp dir; see the module docstring for the API."""

    def __init__(
        self,
        *,
        binaries: KubeBinaries | None = None,
        issuer: str = DEFAULT_ISSUER,
        startup_timeout: float = 180.0,
        extra_apiserver_args: tuple[str, ...] = (),
    ) -> None:
        self._binaries = binaries
        self.issuer = issuer
        self.startup_timeout = startup_timeout
        self._extra_args = extra_apiserver_args
        self.workdir = Path()
        self.port = 0
        self.url = ""
        self.ca_file = ""
        self.kubeconfig_path = ""
        self.admin_token = ""
        self.etcd_url = ""
        self._etcd: Proc | None = None
        self._apiserver: Proc | None = None
        self._apiserver_args: list[str] = []
        self._ssl: ssl.SSLContext | None = None
        # keep the temp dir (logs, certs, etcd data) at stop(): $OPGATE_KEEP_CLUSTER_DIR, or set
        # by a test session that failed
        self.keep_workdir = bool(os.environ.get("OPGATE_KEEP_CLUSTER_DIR"))

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> LocalCluster:
        bins = self._binaries or find_or_build()
        watcher = reaper()  # first: its atexit then runs after this cluster's stop
        self.workdir = Path(tempfile.mkdtemp(prefix="opgate-envtest-"))
        if not self.keep_workdir:
            watcher.remove_at_death(self.workdir)  # if this process dies without stop()
        atexit.register(self.stop)
        try:
            self._start(bins)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, bins: KubeBinaries) -> None:
        work = self.workdir
        files = pki.write_pki(work / "pki")
        self.ca_file = str(files.ca_cert)
        self.admin_token = secrets.token_urlsafe(32)
        tokens = work / "pki" / "tokens.csv"
        tokens.write_text(f'{self.admin_token},opgate-e2e-admin,opgate-e2e-admin,"system:masters"\n')
        tokens.chmod(0o600)

        client_port, peer_port = free_port(), free_port()
        self._etcd = Proc("etcd", [
            str(bins.etcd), "--name=default", f"--data-dir={work / 'etcd-data'}",
            f"--listen-client-urls=http://127.0.0.1:{client_port}",
            f"--advertise-client-urls=http://127.0.0.1:{client_port}",
            f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
            "--unsafe-no-fsync", "--log-level=warn",
        ], log=work / "etcd.log")
        self._etcd.start()
        self.etcd_url = f"http://127.0.0.1:{client_port}"
        self._wait(lambda: http_ok(f"{self.etcd_url}/health"), self._etcd, what="etcd /health")

        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self._ssl = None
        self._apiserver_args = [
            str(bins.kube_apiserver),
            f"--etcd-servers=http://127.0.0.1:{client_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={self.port}", f"--cert-dir={work / 'certs'}",
            f"--tls-cert-file={files.serving_cert}", f"--tls-private-key-file={files.serving_key}",
            f"--client-ca-file={files.ca_cert}", f"--token-auth-file={tokens}",
            f"--service-account-issuer={self.issuer}",
            f"--service-account-key-file={files.sa_public}",
            f"--service-account-signing-key-file={files.sa_private}",
            f"--service-account-jwks-uri={self.url}/openid/v1/jwks",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NamespaceLifecycle,NodeRestriction,ResourceQuota",
            # no token controller runs, so no "default" ServiceAccount: envtest disables it too
            "--disable-admission-plugins=ServiceAccount",
            "--service-cluster-ip-range=10.0.0.0/24", "--allow-privileged=true",
            "--anonymous-auth=true", "--profiling=false", "--v=1",
            # on SIGTERM, end open watches at once (then exit) instead of holding them until
            # the HTTP server's shutdown timeout: a restart takes ~1s, not 60s
            "--shutdown-watch-termination-grace-period=5s",
            *self._extra_args,
        ]
        self.start_apiserver()
        self.kubeconfig_path = str(self.write_kubeconfig(
            work / "admin.kubeconfig", server=self.url, token=self.admin_token,
            ca_file=self.ca_file))

    def start_apiserver(self) -> None:
        """Start kube-apiserver (again) with the same flags and port; waits for /readyz."""
        if self._apiserver is not None and self._apiserver.alive():
            return
        self._apiserver = Proc("kube-apiserver", self._apiserver_args,
                               log=self.workdir / "kube-apiserver.log")
        self._apiserver.start()
        self._wait(self._ready, self._apiserver, what="kube-apiserver /readyz")

    def _ready(self) -> bool:
        try:
            return self.call("GET", "/readyz", timeout=5).status == 200
        except OSError:
            return False

    def _wait(self, probe: Any, proc: Proc, *, what: str) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if probe():
                return
            if not proc.alive():
                break
            time.sleep(0.25)
        state = "exited" if not proc.alive() else f"not ready after {self.startup_timeout:.0f}s"
        raise RuntimeError(f"{what}: {proc.name} {state}; last lines of {proc.log}:\n"
                           f"{tail(proc.log)}")

    def restart_apiserver(self, *, kill: bool = False) -> None:
        """Stop kube-apiserver and start it again on the same port (see ``stop_apiserver``)."""
        self.stop_apiserver(kill=kill)
        deadline = time.monotonic() + 30
        while port_open(self.port) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.start_apiserver()

    def stop_apiserver(self, *, kill: bool = False) -> None:
        """Stop kube-apiserver only (an unreachable upstream); etcd keeps running.

        Gracefully by default (SIGTERM: it ends open watch streams, then exits; SIGKILL after
        30s); ``kill=True`` is a crash (SIGKILL: connections just drop).
        ``start_apiserver()`` brings it back on the same port."""
        if self._apiserver is not None:
            self._apiserver.stop(grace=0 if kill else 30)

    def exited(self) -> Proc | None:
        """etcd or kube-apiserver if it is no longer running (e.g. killed), else ``None``."""
        for proc in (self._etcd, self._apiserver):
            if proc is not None and proc.pid is not None and not proc.alive():
                return proc
        return None

    @property
    def apiserver_pid(self) -> int | None:
        return self._apiserver.pid if self._apiserver else None

    def issue_serving_cert(self, name: str) -> tuple[str, str]:
        """A loopback serving cert + key signed by the cluster CA (``ca_file`` verifies it),
        e.g. for opgate's own TLS listener; returns ``(cert_path, key_path)``."""
        cert, key = pki.issue_serving_cert(self.workdir / "pki", name=name)
        return str(cert), str(key)

    def issue_client_cert(self, name: str, groups: tuple[str, ...] = ()) -> tuple[str, str]:
        """A client cert + key of the user ``name`` in ``groups``, signed by the CA the
        apiserver trusts for clients (``--client-ca-file``); returns ``(cert_path, key_path)``."""
        cert, key = pki.issue_client_cert(self.workdir / "pki", name=name, groups=groups)
        return str(cert), str(key)

    def compact_etcd(self) -> int:
        """Compact etcd up to its current revision (what the apiserver does every 5 minutes);
        returns that revision. Reads at older resourceVersions then fail with 410 Gone."""
        def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
            req = urllib.request.Request(self.etcd_url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            with opener.open(req, timeout=30) as resp:
                return dict(json.loads(resp.read()))

        revision = int(post("/v3/kv/range", {"key": "AA=="})["header"]["revision"])
        post("/v3/kv/compaction", {"revision": str(revision), "physical": True})
        return revision

    def stop(self) -> None:
        """Kill both processes (by process group) and remove the temp dir; idempotent."""
        for proc in (self._apiserver, self._etcd):
            if proc is not None:
                proc.stop()
        self._apiserver = self._etcd = None
        if self.workdir != Path():
            if not self.keep_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)
            reaper().keep(self.workdir)  # removed, or kept for the post-mortem
        atexit.unregister(self.stop)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> LocalCluster:
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)


__all__ = ["DEFAULT_ISSUER", "ApiError", "ApiResponse", "LocalCluster"]
