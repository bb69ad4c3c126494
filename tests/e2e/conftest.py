"""Session fixtures for the real-apiserver tier: one cluster, kubectl, and opgate in front of it.

Fixtures (session-scoped; other e2e modules such as the reconciler's tests rely on these names):

- ``cluster``: a started ``proxy.envtest.LocalCluster`` (etcd + kube-apiserver on loopback).
  If the binaries can be neither found nor built, every test using it FAILS saying why.
- ``kube_tools`` / ``kubectl`` / ``helm``: real binaries (``proxy.envtest.tools``).
- ``opgate``: an ``Opgate`` process (``python -m proxy serve``) relaying to ``cluster`` with
  ``PASSTHROUGH_POLICY`` only, its API listener on HTTPS (cert from the cluster CA, so
  ``cluster.ca_file`` verifies it); ``.url``, ``.admin_url``, ``.pid``, ``.policies_dir``,
  ``.log``, ``.admin_get(path)``.
- ``opgate_factory``: ``opgate_factory(policies={"p.yaml": text}, extra_args=[...])`` starts
  another opgate (stopped at session end), e.g. with identity or quota policies; without
  ``policies`` it gets ``PASSTHROUGH_POLICY`` (valid, configures no middleware);
  ``tls=False`` for a plain-HTTP listener (then pass ``--token-file``: see ``start_opgate``).
- ``clientgo`` / ``ctrlruntime`` / ``fake_kubelet``: the paths of the Go programs of
  ``tests/e2e/clientgo``, ``tests/e2e/ctrlruntime`` and ``tests/e2e/kubelet`` (the fake kubelet
  of exec / attach / port-forward), built once with Go and cached (see ``clientgo_binary``);
  each only built when a collected test uses it.
- ``kubeconfigs``: ``.direct`` and ``.via_opgate`` admin kubeconfigs (the client sends the admin
  bearer token either way; opgate forwards it). Call the API through opgate from Python with
  ``cluster.call(method, path, server=opgate.url, token=...)``.

``$OPGATE_E2E_SERVE_CMD`` replaces ``python -m proxy serve`` (e.g. ``opgate serve`` from an
installed wheel); the flags stay the same.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from proxy.envtest.binaries import BinariesUnavailable, KubeBinaries, find_or_build
from proxy.envtest.cluster import LocalCluster
from proxy.envtest.procs import Proc, free_port, tail
from proxy.envtest.tools import KubeTools, find_tools
from tests.e2e import clientgo_binary

REPO = Path(__file__).resolve().parents[2]
OPGATE_READY_TIMEOUT = 90.0
# a valid policy that configures no middleware: opgate relays everything as it comes
PASSTHROUGH_POLICY = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {name: e2e-passthrough}
spec:
  mode: enforce
"""


@dataclass
class Opgate:
    """One running opgate process on loopback (plain HTTP API port + admin port)."""

    port: int
    admin_port: int
    policies_dir: Path
    log: Path
    tls: bool
    proc: Proc = field(repr=False)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def admin_get(self, path: str, *, timeout: float = 10.0) -> tuple[int, str]:
        try:
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            with opener.open(self.admin_url + path, timeout=timeout) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return tail(self.log, lines)

    def stop(self) -> int | None:
        return self.proc.stop()


def _serve_cmd() -> list[str]:
    custom = os.environ.get("OPGATE_E2E_SERVE_CMD")
    return shlex.split(custom) if custom else [sys.executable, "-m", "proxy", "serve"]


def start_opgate(
    cluster: LocalCluster,
    workdir: Path,
    *,
    policies: dict[str, str] | None = None,
    extra_args: list[str] | None = None,
    tls: bool = True,
    upstream_args: list[str] | None = None,
) -> Opgate:
    """Start opgate in front of ``cluster`` and wait for its admin ``/readyz`` (or fail).

    With ``tls`` (the default) the API listener serves HTTPS with a cert from the cluster's
    CA: kubectl and client-go send a kubeconfig's bearer token only over TLS (clientcmd drops
    credentials for an ``http://`` server), so only then does the client's own token reach
    opgate. Without it, give opgate ``--token-file`` in ``extra_args`` (the sidecar setup).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    policies_dir = workdir / "policies"
    policies_dir.mkdir(exist_ok=True)
    for name, text in (policies or {"passthrough.yaml": PASSTHROUGH_POLICY}).items():
        (policies_dir / name).write_text(text)
    port, admin_port = free_port(), free_port()
    if upstream_args is None:
        upstream_args = ["--upstream", cluster.url, "--upstream-ca", cluster.ca_file]
    argv = [*_serve_cmd(), *upstream_args,
            "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin_port}",
            "--policies", str(policies_dir), "--log-level", "info"]
    if tls:
        cert, key = cluster.issue_serving_cert(f"opgate-{port}")
        argv += ["--tls-cert", cert, "--tls-key", key]
    argv += extra_args or []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    log = workdir / "opgate.log"
    proc = Proc("opgate", argv, log=log, env=env, cwd=REPO)
    proc.start()
    gate = Opgate(port=port, admin_port=admin_port, policies_dir=policies_dir, log=log, tls=tls,
                  proc=proc)
    deadline = time.monotonic() + OPGATE_READY_TIMEOUT
    while time.monotonic() < deadline and proc.alive():
        try:
            if gate.admin_get("/readyz", timeout=3)[0] == 200:
                return gate
        except OSError:
            pass
        time.sleep(0.2)
    state = "exited" if not proc.alive() else f"not ready after {OPGATE_READY_TIMEOUT:.0f}s"
    proc.stop()
    pytest.fail(f"opgate ({shlex.join(argv[:4])} ...) {state}; last lines of {log}:\n"
                f"{tail(log)}", pytrace=False)


_PREPARED: dict[str, object] = {}


def _prepare(what: str) -> object:
    """Find or build the binaries once; remember a failure so that every test that needs them
    fails with the same message (never skips)."""
    if what not in _PREPARED:
        try:
            if what in clientgo_binary.PROGRAMS:
                _PREPARED[what] = clientgo_binary.PROGRAMS[what].find_or_build()
            else:
                _PREPARED[what] = find_or_build() if what == "kube" else find_tools()
        except BinariesUnavailable as exc:
            _PREPARED[what] = exc
    return _PREPARED[what]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build or fetch the binaries before the first e2e test starts, so that a first build
    (several minutes) does not count against that test's timeout."""
    here = Path(__file__).parent
    if not any(here in Path(str(item.path)).parents for item in session.items):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    started = time.monotonic()
    for what in ("kube", "tools"):
        _prepare(what)
    for program in clientgo_binary.PROGRAMS:
        if any(isinstance(item, pytest.Function) and program in item.fixturenames
               for item in session.items):
            _prepare(program)
    if reporter is not None and time.monotonic() - started > 5:
        reporter.write_line(f"opgate e2e: binaries ready in {time.monotonic() - started:.0f}s")


@pytest.fixture(scope="session")
def kube_binaries() -> KubeBinaries:
    found = _prepare("kube")
    if isinstance(found, BinariesUnavailable):
        pytest.fail(f"e2e needs etcd and kube-apiserver: {found}", pytrace=False)
    assert isinstance(found, KubeBinaries)
    return found


@pytest.fixture(scope="session")
def cluster(kube_binaries: KubeBinaries, request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    local = LocalCluster(binaries=kube_binaries)
    try:
        local.start()
    except RuntimeError as exc:
        pytest.fail(f"the local kube-apiserver did not start: {exc}", pytrace=False)
    try:
        yield local
    finally:
        if request.session.testsfailed:
            local.keep_workdir = True  # etcd.log and kube-apiserver.log for the post-mortem
            print(f"\nopgate e2e: cluster files kept in {local.workdir}", file=sys.stderr)
        local.stop()


@pytest.fixture(scope="session")
def kube_tools() -> KubeTools:
    found = _prepare("tools")
    if isinstance(found, BinariesUnavailable):
        pytest.fail(f"e2e needs kubectl and helm: {found}", pytrace=False)
    assert isinstance(found, KubeTools)
    return found


def _go_program(what: str, tests: str) -> Path:
    found = _prepare(what)
    if isinstance(found, BinariesUnavailable):
        pytest.fail(f"the {tests} e2e tests need their Go program: {found}", pytrace=False)
    assert isinstance(found, tuple)
    binary, seconds = found
    if seconds:
        print(f"\nopgate e2e: built {binary} in {seconds:.0f}s", file=sys.stderr)
    return Path(binary)


@pytest.fixture(scope="session")
def clientgo() -> Path:
    return _go_program("clientgo", "client-go")


@pytest.fixture(scope="session")
def ctrlruntime() -> Path:
    return _go_program("ctrlruntime", "controller-runtime")


@pytest.fixture(scope="session")
def fake_kubelet() -> Path:
    return _go_program("fake_kubelet", "exec")


@pytest.fixture(scope="session")
def kubectl(kube_tools: KubeTools) -> Path:
    return kube_tools.kubectl


@pytest.fixture(scope="session")
def helm(kube_tools: KubeTools) -> Path:
    return kube_tools.helm


@pytest.fixture(scope="session")
def opgate_factory(
    cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., Opgate]]:
    started: list[Opgate] = []

    def factory(*, policies: dict[str, str] | None = None,
                extra_args: list[str] | None = None, tls: bool = True,
                upstream_args: list[str] | None = None) -> Opgate:
        gate = start_opgate(cluster, tmp_path_factory.mktemp("opgate"), policies=policies,
                            extra_args=extra_args, tls=tls, upstream_args=upstream_args)
        started.append(gate)
        return gate

    try:
        yield factory
    finally:
        for gate in started:
            gate.stop()


@pytest.fixture(scope="session")
def opgate(opgate_factory: Callable[..., Opgate]) -> Opgate:
    return opgate_factory()


@dataclass(frozen=True)
class Kubeconfigs:
    direct: Path
    via_opgate: Path


@pytest.fixture(scope="session")
def kubeconfigs(
    cluster: LocalCluster, opgate: Opgate, tmp_path_factory: pytest.TempPathFactory
) -> Kubeconfigs:
    base = tmp_path_factory.mktemp("kubeconfigs")
    direct = cluster.write_kubeconfig(base / "direct.kubeconfig", server=cluster.url,
                                      token=cluster.admin_token, ca_file=cluster.ca_file)
    via = cluster.write_kubeconfig(base / "opgate.kubeconfig", server=opgate.url,
                                   token=cluster.admin_token, ca_file=cluster.ca_file)
    return Kubeconfigs(direct=direct, via_opgate=via)
