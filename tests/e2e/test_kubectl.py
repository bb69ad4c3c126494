"""kubectl through opgate prints exactly what it prints against kube-apiserver directly.

Each scenario runs twice with the real kubectl binary, once per kubeconfig (same admin token),
on the same objects, and the outputs (stdout, stderr, exit code) are compared byte for byte
after ``normalize`` blanks the per-write values it lists. A fresh kubectl cache directory per
call makes every call go through discovery, i.e. through opgate.
"""

from __future__ import annotations

import asyncio
import difflib
import itertools
import json
import os
import queue
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from proxy.envtest.cluster import LocalCluster
from tests.e2e import normalize
from tests.e2e.conftest import Kubeconfigs, Opgate

pytestmark = pytest.mark.e2e

Norm = Callable[[str], str]
Result = tuple[int, str, str]


@dataclass
class Kubectl:
    binary: Path
    kubeconfigs: Kubeconfigs
    home: Path

    def _argv(self, target: str, args: tuple[str, ...]) -> list[str]:
        config = self.kubeconfigs.direct if target == "direct" else self.kubeconfigs.via_opgate
        cache = self.home / f"cache-{time.monotonic_ns()}"
        return [str(self.binary), f"--kubeconfig={config}", f"--cache-dir={cache}", *args]

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBE")}
        return dict(env, HOME=str(self.home))

    def run(self, target: str, *args: str, stdin: str | None = None,
            timeout: float = 120) -> Result:
        proc = subprocess.run(self._argv(target, args), input=stdin, capture_output=True,
                              text=True, env=self._env(), timeout=timeout)
        return proc.returncode, proc.stdout, proc.stderr

    def popen(self, target: str, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(self._argv(target, args), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=self._env(),
                                stdin=subprocess.DEVNULL, start_new_session=True)

    def both(self, *args: str, norm: Norm = lambda s: s, stdin: str | None = None) -> Result:
        """Run once direct, once via opgate; assert the normalized results are identical."""
        direct = self.run("direct", *args, stdin=stdin)
        via = self.run("opgate", *args, stdin=stdin)
        assert_same(direct, via, norm, what=" ".join(args))
        return via


def diff(direct: str, via: str, *, limit: int = 40) -> str:
    """A short unified diff (direct -> via opgate) for assertion messages."""
    lines = difflib.unified_diff(direct.splitlines(), via.splitlines(), "direct", "via opgate",
                                 lineterm="", n=1)
    return "\n".join(line[:300] for line in itertools.islice(lines, limit))


def assert_same(direct: Result, via: Result, norm: Norm, *, what: str) -> None:
    assert via[0] == direct[0], (
        f"exit code of `{what}`: {via[0]} via opgate, {direct[0]} direct; stderr via opgate:\n"
        f"{via[2][-1500:]}\nstderr direct:\n{direct[2][-1500:]}")
    for stream, d, v in (("stdout", direct[1], via[1]), ("stderr", direct[2], via[2])):
        d, v = norm(d), norm(v)
        assert v == d, f"{stream} of `{what}` differs:\n{diff(d, v)}"


@pytest.fixture(scope="module")
def kc(
    kubectl: Path, kubeconfigs: Kubeconfigs, tmp_path_factory: pytest.TempPathFactory
) -> Kubectl:
    return Kubectl(kubectl, kubeconfigs, tmp_path_factory.mktemp("kubectl-home"))


def configmap(namespace: str, name: str, **data: str) -> dict[str, object]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace, "labels": {"app": "e2e"}},
            "data": data}


@pytest.fixture(scope="module")
def get_ns(cluster: LocalCluster) -> str:
    ns = "kc-get"
    cluster.create_namespace(ns)
    for i in range(3):
        cluster.call("POST", f"/api/v1/namespaces/{ns}/configmaps",
                     body=configmap(ns, f"cm-{i}", key=f"value-{i}")).ok()
    return ns


GET_CASES: list[tuple[list[str], Norm]] = [
    (["get", "cm", "-o", "json"], normalize.json_text),
    (["get", "cm", "-o", "yaml"], normalize.yaml_text),
    (["get", "cm"], normalize.table_text),
    (["get", "cm", "-o", "wide", "--show-labels"], normalize.table_text),
    (["get", "cm", "-o", "name"], lambda s: s),
    (["get", "cm", "-l", "app=e2e", "-o", "jsonpath={.items[*].metadata.name}"], lambda s: s),
    (["get", "cm", "cm-1", "-o", "json"], normalize.json_text),
    (["get", "cm", "missing"], lambda s: s),
    (["get", "cm", "-l", "app=nothing"], lambda s: s),
    (["get", "ns", "kc-get", "-o", "yaml"], normalize.yaml_text),
    (["get", "--raw", "/api/v1/namespaces/kc-get/configmaps/cm-2"], normalize.json_text),
    (["auth", "can-i", "delete", "configmaps"], lambda s: s),
]


@pytest.mark.parametrize(("args", "norm"), GET_CASES, ids=[" ".join(a) for a, _ in GET_CASES])
def test_get(kc: Kubectl, get_ns: str, args: list[str], norm: Norm) -> None:
    code, out, _ = kc.both("-n", get_ns, *args, norm=norm)
    if "missing" in args:
        assert code == 1 and "NotFound" in kc.run("opgate", "-n", get_ns, *args)[2]
    elif "-o" in args and "json" in args:
        assert json.loads(out)


def _manifest(name: str, value: str) -> str:
    return json.dumps(configmap("kc-apply", name, value=value, fixed="yes"))


@pytest.mark.parametrize("mode", [[], ["--server-side", "--field-manager=e2e"]],
                         ids=["client-side", "server-side"])
def test_apply(kc: Kubectl, cluster: LocalCluster, mode: list[str]) -> None:
    cluster.create_namespace("kc-apply")

    def scenario(target: str) -> list[Result]:
        ns = ["-n", "kc-apply"]
        steps = [
            kc.run(target, "apply", *mode, "-f", "-", stdin=_manifest("applied", "1")),
            kc.run(target, "apply", *mode, "-f", "-", stdin=_manifest("applied", "1")),
            kc.run(target, *ns, "get", "cm", "applied", "-o", "json"),
            kc.run(target, "apply", *mode, "-f", "-", stdin=_manifest("applied", "2")),
            kc.run(target, *ns, "get", "cm", "applied", "-o", "yaml"),
            kc.run(target, "apply", *mode, "--dry-run=server", "-f", "-",
                   stdin=_manifest("applied", "3")),
            kc.run(target, *ns, "delete", "cm", "applied"),
        ]
        return steps

    direct, via = scenario("direct"), scenario("opgate")
    norms = [normalize.json_text, normalize.json_text, normalize.json_text,
             normalize.json_text, normalize.yaml_text, normalize.json_text, normalize.json_text]
    for i, (d, v, norm) in enumerate(zip(direct, via, norms, strict=True)):
        assert_same(d, v, norm, what=f"apply {mode} step {i}")
    assert via[0][0] == 0 and ("created" in via[0][1] or "serverside-applied" in via[0][1])
    assert json.loads(via[2][1])["data"]["value"] == "1"


def test_patch(kc: Kubectl, cluster: LocalCluster) -> None:
    cluster.create_namespace("kc-patch")

    def scenario(target: str) -> list[Result]:
        ns = ["-n", "kc-patch"]
        return [
            kc.run(target, *ns, "create", "configmap", "p", "--from-literal=a=1"),
            kc.run(target, *ns, "patch", "cm", "p", "--type=merge", "-p", '{"data":{"b":"2"}}'),
            kc.run(target, *ns, "patch", "cm", "p", "--type=json",
                   "-p", '[{"op":"replace","path":"/data/a","value":"9"}]'),
            kc.run(target, *ns, "patch", "cm", "p", "--type=strategic",
                   "-p", '{"metadata":{"labels":{"x":"y"}}}'),
            kc.run(target, *ns, "patch", "cm", "p", "--type=json",  # a failing test op: 422
                   "-p", '[{"op":"test","path":"/data/a","value":"nope"}]'),
            kc.run(target, *ns, "patch", "cm", "absent", "--type=merge", "-p", "{}"),
            kc.run(target, *ns, "get", "cm", "p", "-o", "json"),
            kc.run(target, *ns, "delete", "cm", "p"),
        ]

    direct, via = scenario("direct"), scenario("opgate")
    for i, (d, v) in enumerate(zip(direct, via, strict=True)):
        assert_same(d, v, normalize.json_text, what=f"patch step {i}")
    assert json.loads(via[6][1])["data"] == {"a": "9", "b": "2"}
    assert via[4][0] != 0 and via[5][0] != 0


def test_delete(kc: Kubectl, cluster: LocalCluster) -> None:
    cluster.create_namespace("kc-delete")

    def scenario(target: str) -> list[Result]:
        ns = ["-n", "kc-delete"]
        for name in ("d-1", "d-2", "d-3"):
            cluster.call("POST", "/api/v1/namespaces/kc-delete/configmaps",
                         body=configmap("kc-delete", name)).ok()
        return [
            kc.run(target, *ns, "delete", "cm", "d-1"),
            kc.run(target, *ns, "delete", "cm", "d-1"),
            kc.run(target, *ns, "delete", "cm", "d-1", "--ignore-not-found"),
            kc.run(target, *ns, "delete", "cm", "-l", "app=e2e", "--dry-run=server"),
            kc.run(target, *ns, "delete", "cm", "-l", "app=e2e"),
            kc.run(target, *ns, "get", "cm", "-o", "name"),
        ]

    direct, via = scenario("direct"), scenario("opgate")
    for i, (d, v) in enumerate(zip(direct, via, strict=True)):
        assert_same(d, v, normalize.json_text, what=f"delete step {i}")
    assert via[1][0] == 1 and via[5][1] == ""


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    out: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.put(line.rstrip("\n"))

    threading.Thread(target=pump, daemon=True).start()
    return out


def _expect(lines: queue.Queue[str], pattern: str, seen: list[str], *, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not any(re.search(pattern, line) for line in seen):
        try:
            seen.append(lines.get(timeout=max(0.05, deadline - time.monotonic())))
        except queue.Empty:
            raise AssertionError(
                f"no line matching {pattern!r} within {timeout}s: {seen}") from None


def test_watch(kc: Kubectl, cluster: LocalCluster) -> None:
    ns = "kc-watch"
    cluster.create_namespace(ns)
    path = f"/api/v1/namespaces/{ns}/configmaps"
    cluster.call("POST", path, body=configmap(ns, "w-0", v="0")).ok()
    args = ("-n", ns, "get", "cm", "-w", "--output-watch-events",
            "-o", "custom-columns=EVENT:.type,NAME:.object.metadata.name,V:.object.data.v")
    procs = {t: kc.popen(t, *args) for t in ("direct", "opgate")}
    try:
        streams = {t: _lines(p) for t, p in procs.items()}
        seen: dict[str, list[str]] = {t: [] for t in procs}

        def expect(pattern: str) -> None:
            for target in procs:  # each event must arrive while the watch is open: streamed
                _expect(streams[target], pattern, seen[target])

        expect(r"ADDED\s+w-0\s+0")
        cluster.call("POST", path, body=configmap(ns, "w-1", v="1")).ok()
        expect(r"ADDED\s+w-1\s+1")
        cluster.call("PATCH", f"{path}/w-1", body={"data": {"v": "2"}},
                     content_type="application/merge-patch+json").ok()
        expect(r"MODIFIED\s+w-1\s+2")
        cluster.call("DELETE", f"{path}/w-1").ok()
        expect(r"DELETED\s+w-1\s+2")
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait(timeout=30)
    assert seen["opgate"] == seen["direct"]
    assert seen["opgate"][0].split() == ["EVENT", "NAME", "V"]


@pytest.mark.parametrize("args", [["api-resources"], ["api-resources", "-o", "wide"],
                                  ["api-versions"], ["explain", "configmap.data"],
                                  ["version", "-o", "json"]])
def test_discovery(kc: Kubectl, args: list[str]) -> None:
    code, out, _ = kc.both(*args)
    assert code == 0 and out


def test_openapi_v3(kc: Kubectl) -> None:
    code, index, _ = kc.both("get", "--raw", "/openapi/v3")
    assert code == 0
    paths = json.loads(index)["paths"]
    core = paths["api/v1"]["serverRelativeURL"]
    code, doc, _ = kc.both("get", "--raw", core)
    assert code == 0 and json.loads(doc)["openapi"].startswith("3.")


CHUNK_NS = "kc-chunk"
CHUNK_COUNT = 2000


async def _create_many(cluster: LocalCluster, count: int) -> None:
    ssl_ctx = cluster.ssl_context()
    headers = {"Authorization": f"Bearer {cluster.admin_token}"}
    url = f"{cluster.url}/api/v1/namespaces/{CHUNK_NS}/configmaps"
    limit = asyncio.Semaphore(32)
    connector = aiohttp.TCPConnector(ssl=ssl_ctx, limit=32)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def one(i: int) -> None:
            async with limit, session.post(
                url, json=configmap(CHUNK_NS, f"c-{i:05d}", i=str(i))
            ) as resp:
                assert resp.status in (201, 409), await resp.text()

        await asyncio.gather(*(one(i) for i in range(count)))


@pytest.fixture(scope="module")
def many_configmaps(cluster: LocalCluster) -> Iterator[int]:
    cluster.create_namespace(CHUNK_NS)
    asyncio.run(_create_many(cluster, CHUNK_COUNT))
    yield CHUNK_COUNT


def test_chunked_list(kc: Kubectl, many_configmaps: int) -> None:
    code, names, _ = kc.both("-n", CHUNK_NS, "get", "cm", "--chunk-size=250", "-o", "name")
    assert code == 0 and len(names.splitlines()) == many_configmaps
    code, out, _ = kc.both("-n", CHUNK_NS, "get", "cm", "--chunk-size=300", "-o", "json",
                           norm=normalize.json_text)
    assert len(json.loads(out)["items"]) == many_configmaps
    # the pages really went through opgate, each with its continue token
    code, _, log = kc.run("opgate", "-n", CHUNK_NS, "get", "cm", "--chunk-size=250", "-o",
                          "name", "-v=6")
    pages = re.findall(r'"Response" verb="GET" url="https://127\.0\.0\.1:\d+/api/v1/namespaces/'
                       r'kc-chunk/configmaps\?([^"]*limit=250[^"]*)" status="200 OK"', log)
    assert code == 0 and len(pages) == many_configmaps // 250, log[-2000:]
    assert sum("continue=" in p for p in pages) == len(pages) - 1


def test_plain_http_listener_with_token_file(
    kc: Kubectl, cluster: LocalCluster, opgate_factory: Callable[..., Opgate], get_ns: str,
    tmp_path: Path,
) -> None:
    """The sidecar setup: the controller talks plain HTTP on loopback and sends no token (a
    kubeconfig's token is never sent over http), opgate adds its own from --token-file."""
    token_file = tmp_path / "token"
    token_file.write_text(cluster.admin_token + "\n")
    token_file.chmod(0o600)
    gate = opgate_factory(tls=False, extra_args=["--token-file", str(token_file)])
    plain = tmp_path / "plain.kubeconfig"
    cluster.write_kubeconfig(plain, server=gate.url, token="ignored-over-http")
    sidecar = Kubectl(kc.binary, Kubeconfigs(direct=kc.kubeconfigs.direct, via_opgate=plain),
                      kc.home)
    code, out, _ = sidecar.both("-n", get_ns, "get", "cm", "-o", "json", norm=normalize.json_text)
    assert code == 0 and len(json.loads(out)["items"]) >= 3


@pytest.mark.parametrize("relay", ["fast", "aiohttp"])
def test_a_body_past_the_apiservers_limit_gets_its_413_on_the_plain_http_listener(
    kc: Kubectl, cluster: LocalCluster, opgate_factory: Callable[..., Opgate], get_ns: str,
    tmp_path: Path, relay: str,
) -> None:
    """kubectl creating a ConfigMap of 15 MB: the apiserver answers 413 at once, before it
    reads the body, and kubectl, still sending it, prints that answer. opgate closed its client
    connection with the rest of the body unread, and the kernel's reset overtook the answer
    now and then (one time in six: 'write: connection reset by peer'). A few tries each."""
    token_file = tmp_path / "token"
    token_file.write_text(cluster.admin_token + "\n")
    gate = opgate_factory(tls=False, extra_args=["--token-file", str(token_file),
                                                 "--relay", relay])
    plain = tmp_path / "plain.kubeconfig"
    cluster.write_kubeconfig(plain, server=gate.url, token="ignored-over-http")
    sidecar = Kubectl(kc.binary, Kubeconfigs(direct=kc.kubeconfigs.direct, via_opgate=plain),
                      kc.home)
    data = tmp_path / "data.txt"
    data.write_bytes(os.urandom(8 * 1024 * 1024).hex().encode()[:15_000_000])
    for _ in range(8):
        code, _, err = sidecar.both("-n", get_ns, "create", "configmap", "huge",
                                    f"--from-file={data}", "--dry-run=server")
        assert code == 1 and "Request entity too large: limit is 3145728" in err, err


@pytest.mark.parametrize("relay", ["fast", "aiohttp"])
def test_http_to_the_tls_port_is_answered_as_the_apiserver_answers_it(
    kc: Kubectl, cluster: LocalCluster, opgate_factory: Callable[..., Opgate], get_ns: str,
    tmp_path: Path, relay: str,
) -> None:
    """A kubeconfig (or curl) saying ``http://`` for a TLS port: the apiserver answers its
    400 'Client sent an HTTP request to an HTTPS server.', and kubectl says at once 'the server
    rejected our request'; opgate closed the connection unanswered, and kubectl retried for
    50 s to say 'Unable to connect to the server: EOF'. Now the same bytes, the same output."""
    gate = opgate_factory(extra_args=["--relay", relay])
    plain_direct, plain_via = tmp_path / "direct.kubeconfig", tmp_path / "via.kubeconfig"
    cluster.write_kubeconfig(plain_direct, server=cluster.url.replace("https://", "http://"),
                             token="ignored-over-http")
    cluster.write_kubeconfig(plain_via, server=gate.url.replace("https://", "http://"),
                             token="ignored-over-http")
    wrong = Kubectl(kc.binary, Kubeconfigs(direct=plain_direct, via_opgate=plain_via), kc.home)
    klog = re.compile(r"^E\d{4} [\d:.]+ +\d+ ", re.MULTILINE)  # (its time and pid)
    code, _, err = wrong.both("-n", get_ns, "get", "cm", norm=lambda s: klog.sub("E ", s))
    assert code == 1 and "the server rejected our request for an unknown reason" in err, err
    answers = [subprocess.run(["curl", "-sS", "-i", "--max-time", "10",
                               url.replace("https://", "http://") + "/api"],
                              capture_output=True, timeout=30)
               for url in (cluster.url, gate.url)]
    assert answers[1].stdout == answers[0].stdout, (answers[0], answers[1])
    assert answers[0].stdout.startswith(b"HTTP/1.0 400 Bad Request\r\n")
