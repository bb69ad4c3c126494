"""exec, attach and port-forward with the real kubectl, through opgate, to a kubelet.

The chain is the real one: kubectl (WebSocket by default, SPDY when told) -> opgate (its
default middlewares: identity, a rate limit, audit, capture) -> kube-apiserver (which
translates WebSocket to SPDY towards the kubelet, or relays the SPDY upgrade as is) -> the fake
kubelet of ``tests/e2e/kubelet``: the kubelet's own streaming server code over a built-in
command set (no container runtime, never a shell) and, for port-forward, a TCP echo server.
Every scenario also runs straight against the apiserver, which is what opgate must match.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from proxy.envtest.binaries import KUBERNETES_VERSION
from proxy.envtest.cluster import LocalCluster
from proxy.envtest.procs import Proc, free_port, tail
from tests.e2e.conftest import Opgate

pytestmark = pytest.mark.e2e

NS = "exec-e2e"
NODE = "opgate-fake-node"
POD = "box"
CONTAINER = "main"
SA = "execer"
DEAD_NODE = "opgate-dead-node"  # its kubelet's port has no listener
ON_DEAD_NODE, ON_NO_NODE = "on-dead-node", "on-no-node"
LOCKED_NS = "exec-e2e-locked"  # RBAC lets the ServiceAccounts exec there, opgate's rules do not
HASTY = "hasty"  # allowed, but with a budget of one exec call
BIG = 8 * 1024 * 1024
POLICY = f"""\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: exec-e2e}}
spec:
  identity:
    issuers:
      - kubernetes: {{}}
    allow:
      - serviceAccount: {NS}/{SA}
      - serviceAccount: {NS}/{HASTY}
    rules:
      - {{name: discovery, nonResourceURLs: [/api, "/api/*", /apis, "/apis/*", /version]}}
      - {{name: pods, verbs: [get, list, watch], resources: [pods]}}
      - {{name: streams, verbs: [get, create], resources: [pods/exec, pods/attach,
         pods/portforward], namespaces: [{NS}]}}
  rateLimits:
    - name: hasty-exec
      match: {{resources: [pods/exec], users: ["system:serviceaccount:{NS}:{HASTY}"]}}
      key: "{{user}}"
      qps: 0.001
      burst: 1
      onExceed: reject
    - name: everything
      key: "{{user}}"
      qps: 1000
  audit:
    level: Metadata
  capture:
    - name: everything
      maxBodyBytes: 65536
"""
MODES = ("websocket", "spdy")
TARGETS = ("direct", "fast", "aiohttp")


@dataclass(frozen=True)
class Kubelet:
    port: int
    proc: Proc

    def stats(self) -> dict[str, int]:
        """The fake kubelet's streaming requests: ``open`` now, ``total`` served (its cert is
        self-signed, as a kubelet's own is: the apiserver does not verify it either)."""
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        with urllib.request.urlopen(f"https://127.0.0.1:{self.port}/stats", context=ctx,
                                    timeout=10) as resp:
            return dict(json.loads(resp.read()))


@dataclass
class Setup:
    cluster: LocalCluster
    kubectl: Path
    home: Path
    kubelet: Kubelet
    gates: dict[str, Opgate]
    kubeconfigs: dict[tuple[str, str], Path]  # (ServiceAccount or "sidecar", target)

    def argv(self, target: str, *args: str, user: str = SA, ns: str = NS) -> list[str]:
        config = self.kubeconfigs[user, target]
        return [str(self.kubectl), f"--kubeconfig={config}", "-n", ns, *args]

    def env(self, mode: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBE")}
        flag = "true" if mode == "websocket" else "false"
        return dict(env, HOME=str(self.home), KUBECTL_REMOTE_COMMAND_WEBSOCKETS=flag,
                    KUBECTL_PORT_FORWARD_WEBSOCKETS=flag)

    def run(self, target: str, mode: str, *args: str, stdin: bytes | None = None,
            user: str = SA, ns: str = NS,
            timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(self.argv(target, *args, user=user, ns=ns), input=stdin,
                              capture_output=True, env=self.env(mode), timeout=timeout)

    def popen(self, target: str, mode: str, *args: str, user: str = SA,
              stdin: int | None = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.argv(target, *args, user=user), stdin=stdin,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=self.env(mode))


def _start_kubelet(binary: Path, workdir: Path) -> Kubelet:
    log = workdir / "kubelet.log"
    proc = Proc("fake-kubelet", [str(binary)], log=log)
    proc.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.alive():
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                return Kubelet(port=int(json.loads(line)["port"]), proc=proc)
        time.sleep(0.05)
    proc.stop()
    pytest.fail(f"the fake kubelet did not start; {log}:\n{tail(log)}", pytrace=False)


def _register_node(cluster: LocalCluster, name: str, kubelet_port: int) -> None:
    """A Node whose kubelet listens on ``kubelet_port`` of 127.0.0.1 (InternalIP and
    daemonEndpoints: what the apiserver's kubelet client reads)."""
    cluster.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
    cluster.call("PATCH", f"/api/v1/nodes/{name}/status", content_type=(
        "application/merge-patch+json"), body={"status": {
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "lastHeartbeatTime": None, "lastTransitionTime": None}]}}).ok()


def _run_pod(cluster: LocalCluster, ns: str, name: str, node: str | None) -> None:
    """A pod bound to ``node`` (or to none), whose status says it runs."""
    cluster.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
                   "spec": {**({"nodeName": node} if node else {}), "containers": [
                       {"name": CONTAINER, "image": "opgate.dev/none",
                        "ports": [{"containerPort": 8080}]}]}})
    cluster.call("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status",
                 content_type="application/merge-patch+json", body={"status": {
                     "phase": "Running",
                     "containerStatuses": [{
                         "name": CONTAINER, "ready": True, "restartCount": 0,
                         "image": "opgate.dev/none", "imageID": "",
                         "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}]}}).ok()


def _register_node_and_pods(cluster: LocalCluster, kubelet_port: int) -> None:
    """The fake kubelet's Node and its pods; a Node whose kubelet is gone and a pod on it; a
    pod on no node."""
    _register_node(cluster, NODE, kubelet_port)
    _register_node(cluster, DEAD_NODE, free_port())
    for ns in (NS, LOCKED_NS):
        cluster.create_namespace(ns)
        _run_pod(cluster, ns, POD, NODE)
    _run_pod(cluster, NS, ON_DEAD_NODE, DEAD_NODE)
    _run_pod(cluster, NS, ON_NO_NODE, None)


@pytest.fixture(scope="module")
def setup(cluster: LocalCluster, kubectl: Path, fake_kubelet: Path,
          opgate_factory: Callable[..., Opgate],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    base = tmp_path_factory.mktemp("exec")
    kubelet = _start_kubelet(fake_kubelet, base)
    try:
        _register_node_and_pods(cluster, kubelet.port)
        rules = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                 {"apiGroups": [""], "resources": ["pods/exec", "pods/attach", "pods/portforward"],
                  "verbs": ["get", "create"]}]
        for name in (SA, HASTY):
            cluster.create_service_account_with_rbac(NS, name, rules, cluster_wide=True)
        token_file = base / "opgate-token"
        token_file.write_text(cluster.admin_token)
        token_file.chmod(0o600)
        gates = {}
        for relay in ("fast", "aiohttp"):
            flows = base / relay / "capture.flows"
            flows.parent.mkdir()
            gates[relay] = opgate_factory(
                policies={"exec.yaml": POLICY},
                extra_args=["--relay", relay, "--token-file", str(token_file),
                            "--audit-log", str(base / relay / "audit.log"),
                            "--capture", str(flows)])
        servers = {"direct": cluster.url, **{k: g.url for k, g in gates.items()}}
        configs = {}
        for name in (SA, HASTY):
            token = cluster.token_request(NS, name)
            for target, url in servers.items():
                configs[name, target] = cluster.write_kubeconfig(
                    base / f"{name}-{target}.kubeconfig", server=url, token=token,
                    ca_file=cluster.ca_file)
        home = base / "home"
        home.mkdir()
        yield Setup(cluster=cluster, kubectl=kubectl, home=home, kubelet=kubelet, gates=gates,
                    kubeconfigs=configs)
    finally:
        kubelet.proc.stop()


def _text(proc: subprocess.CompletedProcess[bytes]) -> tuple[int, str, str]:
    """Exit code, stdout and stderr (without kubectl's stream-end noise: :func:`_errors`)."""
    return proc.returncode, proc.stdout.decode(errors="replace"), _errors(proc.stderr)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("target", TARGETS)
def test_exec_stdout_stderr_and_exit_code(setup: Setup, target: str, mode: str) -> None:
    code, out, err = _text(setup.run(target, mode, "exec", POD, "--", "echo", "hello", "world"))
    assert (code, out) == (0, "hello world\n"), err
    code, out, err = _text(setup.run(target, mode, "exec", POD, "--", "warn", "to", "stderr"))
    assert (code, out, err) == (0, "", "to stderr\n")
    code, out, err = _text(setup.run(target, mode, "exec", POD, "--", "exit", "3"))
    assert (code, out, err) == (3, "", "command terminated with exit code 3\n")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("target", TARGETS)
def test_exec_stdin_is_piped_through(setup: Setup, target: str, mode: str) -> None:
    code, out, err = _text(setup.run(target, mode, "exec", "-i", POD, "--", "cat",
                                     stdin=b"line one\nline two\n"))
    assert (code, out, err) == (0, "line one\nline two\n", "")


def _payload(size: int) -> bytes:
    """Bytes that no repeated block can fake: a counter's digests."""
    blocks = (hashlib.sha256(i.to_bytes(8, "big")).digest() for i in range(size // 32 + 1))
    return b"".join(blocks)[:size]


def _errors(stderr: bytes) -> str:
    """kubectl's stderr without the line its WebSocket executor may log at the end of a stream
    (``Unknown stream id 1, discarding message``: a frame after the stream's close, no data),
    which it logs straight against the apiserver too."""
    return "".join(line for line in stderr.decode(errors="replace").splitlines(keepends=True)
                   if "] Unknown stream id " not in line)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("target", TARGETS)
def test_exec_moves_megabytes_both_ways(setup: Setup, target: str, mode: str) -> None:
    data = _payload(BIG)
    proc = setup.run(target, mode, "exec", "-i", POD, "--", "sha256", stdin=data)
    assert (proc.returncode, _errors(proc.stderr)) == (0, "")
    assert proc.stdout.decode() == f"{BIG} {hashlib.sha256(data).hexdigest()}\n"

    proc = setup.run(target, mode, "exec", POD, "--", "yes", str(BIG))
    assert (proc.returncode, _errors(proc.stderr), len(proc.stdout)) == (0, "", BIG)

    proc = setup.run(target, mode, "exec", "-i", POD, "--", "cat", stdin=data)
    assert (proc.returncode, _errors(proc.stderr)) == (0, "")
    assert hashlib.sha256(proc.stdout).hexdigest() == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("target", TARGETS)
def test_attach(setup: Setup, target: str, mode: str) -> None:
    code, out, err = _text(setup.run(target, mode, "attach", POD))
    assert (code, out) == (0, "attached\n"), err
    code, out, err = _text(setup.run(target, mode, "attach", "-i", POD, stdin=b"typed\n"))
    assert (code, out) == (0, "attached\ntyped\n"), err


def _forwarded_port(proc: subprocess.Popen[bytes]) -> int:
    """The local port of ``kubectl port-forward`` (its first line, once it listens)."""
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert line.startswith("Forwarding from 127.0.0.1:"), line + _stderr(proc)
    return int(line.split(":")[1].split()[0])


def _stderr(proc: subprocess.Popen[bytes]) -> str:
    if proc.poll() is None:
        proc.kill()
    assert proc.stderr is not None
    return proc.stderr.read().decode(errors="replace")


def _echo(port: int, data: bytes) -> bytes:
    """Send ``data`` through the forwarded port while reading its echo, then half-close."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
        sender = threading.Thread(target=lambda: (conn.sendall(data),
                                                  conn.shutdown(socket.SHUT_WR)))
        sender.start()
        got = bytearray()
        while chunk := conn.recv(1 << 16):
            got += chunk
        sender.join()
    return bytes(got)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("target", TARGETS)
def test_port_forward_moves_megabytes_both_ways(setup: Setup, target: str, mode: str) -> None:
    proc = setup.popen(target, mode, "port-forward", f"pod/{POD}", ":8080")
    try:
        port = _forwarded_port(proc)
        assert _echo(port, b"ping\n") == b"ping\n"
        data = _payload(BIG)
        got = _echo(port, data)
        assert (len(got), hashlib.sha256(got).digest()) == (BIG, hashlib.sha256(data).digest())
        # connections at once: streams of one tunnel (SPDY, or SPDY inside the WebSocket)
        datas = [_payload(2 * 1024 * 1024 + i) for i in range(4)]
        with ThreadPoolExecutor(len(datas)) as pool:
            echoes = list(pool.map(lambda sent: _echo(port, sent), datas))
        assert [hashlib.sha256(e).digest() for e in echoes] == [
            hashlib.sha256(d).digest() for d in datas]
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _inflight(gate: Opgate) -> float:
    """opgate's ``opgate_inflight_requests`` (a tunnel counts as one call until it ends)."""
    code, text = gate.admin_get("/metrics")
    assert code == 200
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("opgate_inflight_requests"))


def _until(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        time.sleep(0.05)


def _released(setup: Setup, target: str) -> None:
    """Everything the killed client held is given back: the kubelet serves nothing any more
    (so the apiserver closed its side, so opgate closed its upstream connection), and opgate
    counts no call in flight."""
    _until("the kubelet's streams end", lambda: setup.kubelet.stats()["open"] == 0)
    if target != "direct":
        _until("opgate's tunnel ends", lambda: _inflight(setup.gates[target]) == 0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("target", TARGETS)
def test_killing_kubectl_mid_exec_releases_the_whole_chain(
        setup: Setup, target: str, mode: str) -> None:
    _released(setup, target)
    proc = setup.popen(target, mode, "exec", "-i", POD, "--", "cat", stdin=subprocess.PIPE)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(b"still there?\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == b"still there?\n", _stderr(proc)
        assert setup.kubelet.stats()["open"] == 1
        if target != "direct":
            assert _inflight(setup.gates[target]) >= 1
    finally:
        proc.kill()
        proc.wait(timeout=30)
    _released(setup, target)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("target", TARGETS)
def test_killing_kubectl_mid_port_forward_releases_the_whole_chain(
        setup: Setup, target: str, mode: str) -> None:
    _released(setup, target)
    proc = setup.popen(target, mode, "port-forward", f"pod/{POD}", ":8080")
    try:
        port = _forwarded_port(proc)
        with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
            conn.sendall(b"hello\n")
            assert conn.recv(64) == b"hello\n"
            assert setup.kubelet.stats()["open"] == 1
            proc.kill()
            proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    _released(setup, target)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("relay", ("fast", "aiohttp"))
def test_an_identity_refusal_reaches_kubectl_as_a_forbidden_status(
        setup: Setup, relay: str, mode: str) -> None:
    served = setup.kubelet.stats()["total"]
    code, out, err = _text(setup.run(relay, mode, "exec", POD, "--", "echo", "hi", ns=LOCKED_NS))
    assert (code, out) == (1, ""), err
    # kubectl decoded the Status (WebSocket, then its SPDY fallback) as it does the apiserver's
    assert err.startswith(f'Error from server (Forbidden): opgate: user "system:serviceaccount:'
                          f'{NS}:{SA}" cannot create resource "pods/exec" in API group "" in '
                          f'the namespace "{LOCKED_NS}": no rule of policy "exec-e2e"'), err
    assert setup.kubelet.stats()["total"] == served
    # the same call straight to the apiserver is allowed (RBAC lets it): opgate's rules refused
    assert _text(setup.run("direct", mode, "exec", POD, "--", "echo", "hi", ns=LOCKED_NS)) \
        == (0, "hi\n", "")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("relay", ("fast", "aiohttp"))
def test_a_rate_limited_exec_reaches_kubectl_as_too_many_requests(
        setup: Setup, relay: str, mode: str) -> None:
    # a budget of one exec per user and gate; the first may have been spent by the other mode
    setup.run(relay, mode, "exec", POD, "--", "echo", "first", user=HASTY)
    code, out, err = _text(setup.run(relay, mode, "exec", POD, "--", "echo", "x", user=HASTY))
    assert (code, out) == (1, ""), err
    assert err.startswith("Error from server (TooManyRequests): "), err
    assert "hasty-exec" in err, err


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pod", (ON_DEAD_NODE, ON_NO_NODE))
def test_the_apiservers_refusals_reach_kubectl_as_they_do_directly(
        setup: Setup, pod: str, mode: str) -> None:
    """A pod whose kubelet does not answer (the apiserver's 500 / "error dialing backend"), a
    pod on no node (400): kubectl prints through opgate exactly what it prints directly."""
    for args in (("exec", pod, "--", "echo", "hi"), ("port-forward", f"pod/{pod}", ":8080")):
        results = {target: _text(setup.run(target, mode, *args)) for target in TARGETS}
        assert results["direct"][0] == 1 and results["direct"][2], results["direct"]
        assert results["fast"] == results["direct"], args
        assert results["aiohttp"] == results["direct"], args


SIDECAR_POLICY = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {name: exec-e2e-sidecar}
spec:
  rateLimits:
    - {name: everything, key: "{user}", qps: 1000}
  audit: {level: Metadata}
"""


@pytest.fixture(scope="module")
def sidecars(setup: Setup, opgate_factory: Callable[..., Opgate],
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Kubeconfigs (no credentials) of opgates set up as the chart's sidecar: plain HTTP on
    loopback, their own token (``--token-file``) towards the apiserver."""
    base = tmp_path_factory.mktemp("exec-sidecar")
    token_file = base / "token"
    token_file.write_text(setup.cluster.admin_token)
    token_file.chmod(0o600)
    configs = {}
    for relay in ("fast", "aiohttp"):
        gate = opgate_factory(policies={"sidecar.yaml": SIDECAR_POLICY}, tls=False, extra_args=[
            "--relay", relay, "--token-file", str(token_file),
            "--audit-log", str(base / f"{relay}-audit.log")])
        configs[relay] = setup.cluster.write_kubeconfig(
            base / f"{relay}.kubeconfig", server=gate.url, token="", ca_file=None)
    return configs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("relay", ("fast", "aiohttp"))
def test_exec_and_port_forward_through_a_plain_http_sidecar(
        setup: Setup, sidecars: dict[str, Path], relay: str, mode: str) -> None:
    setup.kubeconfigs["sidecar", relay] = sidecars[relay]
    data = _payload(BIG)
    proc = setup.run(relay, mode, "exec", "-i", POD, "--", "cat", stdin=data, user="sidecar")
    assert (proc.returncode, _errors(proc.stderr)) == (0, "")
    assert hashlib.sha256(proc.stdout).digest() == hashlib.sha256(data).digest()
    proc = setup.run(relay, mode, "exec", POD, "--", "yes", str(BIG), user="sidecar")
    assert (proc.returncode, len(proc.stdout)) == (0, BIG), _errors(proc.stderr)
    forward = setup.popen(relay, mode, "port-forward", f"pod/{POD}", ":8080", user="sidecar")
    try:
        got = _echo(_forwarded_port(forward), data)
        assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    finally:
        forward.kill()
        forward.wait(timeout=30)


def test_the_fake_kubelet_matches_the_apiserver_minor() -> None:
    """The kubelet streaming code the fake serves is the apiserver's own minor's (bumped
    together)."""
    gomod = (Path(__file__).parent / "kubelet" / "go.mod").read_text()
    minor = ".".join(KUBERNETES_VERSION.replace("v1.", "v0.", 1).split(".")[:2])
    assert f"k8s.io/kubelet {minor}." in gomod, "bump tests/e2e/kubelet with the apiserver"
