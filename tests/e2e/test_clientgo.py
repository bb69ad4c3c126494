"""A real client-go program (tests/e2e/clientgo, client-go of the apiserver's minor) through opgate.

What operators built on client-go / controller-runtime rely on, against the real kube-apiserver,
on both relay cores: shared informers (a streaming watch-list with bookmarks, or a list and then
a watch) that see another client's creates, updates and deletes at once and list again after an
apiserver restart; a 410 Expired for a resourceVersion etcd compacted; paginated LISTs;
protobuf; server-side apply with field managers and conflicts; and opgate's own answers as
client-go decodes them: a 429 it retries after ``Retry-After``, a 403 that is ``IsForbidden``,
``Warning`` headers that reach its WarningHandler. The program prints JSON lines (``http`` for
each request it made, ``warning``, ``error`` with the ``apierrors.Is*`` verdicts, and each
subcommand's own lines).

client-go resumes a plain watch at its last resourceVersion only after a watch that ended
cleanly (its own timeout is 5-10 minutes; a watch cut by an apiserver restart makes it list
again at once). So the 410 test has opgate end idle watches (``--watch-idle-timeout``) while the
informer's process is stopped (SIGSTOP), etcd is compacted and the apiserver restarted (its
watch cache then starts past the informer's resourceVersion): resumed, the informer reads the
clean end, watches from its old resourceVersion, gets 410 Expired and lists again.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest

from proxy.envtest.binaries import KUBERNETES_VERSION
from proxy.envtest.cluster import LocalCluster
from proxy.envtest.reaper import reaper
from proxy.relay.calls import IMPERSONATION_DROPPED
from tests.e2e.conftest import Kubeconfigs, Opgate

pytestmark = pytest.mark.e2e

PROTOBUF = "application/vnd.kubernetes.protobuf"
Line = dict[str, Any]


@pytest.fixture(scope="module", params=["fast", "aiohttp"])
def relay(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def ns(relay: str, cluster: LocalCluster) -> str:
    name = f"clientgo-{relay}"
    cluster.create_namespace(name)
    return name


@pytest.fixture(scope="module")
def via(relay: str, cluster: LocalCluster, opgate_factory: Callable[..., Opgate],
        tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kubeconfig for a pass-through opgate on ``relay`` (TLS: the admin token reaches it)."""
    gate = opgate_factory(extra_args=["--relay", relay])
    return cluster.write_kubeconfig(tmp_path_factory.mktemp("clientgo") / "via.kubeconfig",
                                    server=gate.url, token=cluster.admin_token,
                                    ca_file=cluster.ca_file)


@pytest.fixture(scope="module")
def idle_via(relay: str, cluster: LocalCluster, opgate_factory: Callable[..., Opgate],
             tmp_path_factory: pytest.TempPathFactory) -> Path:
    """As ``via``, but opgate ends a watch idle for 3 s (cleanly: client-go watches again)."""
    gate = opgate_factory(extra_args=["--relay", relay, "--watch-idle-timeout", "3"])
    return cluster.write_kubeconfig(tmp_path_factory.mktemp("clientgo") / "idle.kubeconfig",
                                    server=gate.url, token=cluster.admin_token,
                                    ca_file=cluster.ca_file)


POLICIES = {
    "enforce.yaml": """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: clientgo-enforce}}
spec:
  mode: enforce
  identity:
    issuers: [{{kubernetes: {{}}}}]
    allow: [{{group: "system:masters"}}]
    rules:
      - {{name: no-secrets, effect: deny, resources: [secrets], namespaces: [{ns}]}}
      - {{name: everything, verbs: ["*"], resources: ["*"]}}
  rateLimits:
    - name: slow-gets
      match: {{verbs: [get], resources: [configmaps], namespaces: [{ns}]}}
      key: "{{resource}}"
      qps: 0.5
      burst: 1
    - name: per-owner-creates
      match: {{verbs: [create], resources: [configmaps], namespaces: [{ns}-owned]}}
      key: "{{instance}}"
      qps: 0.25
      burst: 1
  quotas:
    - {{name: four-configmaps, resources: [configmaps], namespaces: [{ns}-quota], max: 4}}
""",
    "dryrun.yaml": """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: clientgo-dryrun}}
spec:
  mode: dryrun
  identity:
    issuers: [{{kubernetes: {{}}}}]
    allow: [{{group: "system:masters"}}]
    rules:
      - {{name: reads-only, verbs: [get, list, watch], resources: ["*"]}}
""",
}


@pytest.fixture(scope="module")
def policed(relay: str, ns: str, cluster: LocalCluster, opgate_factory: Callable[..., Opgate],
            tmp_path_factory: pytest.TempPathFactory) -> tuple[Opgate, Path]:
    """An opgate on ``relay`` with an identity rule, a rate limit and a dryrun policy, and a
    kubeconfig for it."""
    for suffix in ("quota", "owned"):
        cluster.create_namespace(f"{ns}-{suffix}")
    work = tmp_path_factory.mktemp("clientgo-policed")
    token = work / "token"  # opgate's own credential for its TokenReviews
    token.write_text(cluster.admin_token)
    token.chmod(0o600)
    gate = opgate_factory(policies={k: v.format(ns=ns) for k, v in POLICIES.items()},
                          extra_args=["--relay", relay, "--token-file", str(token)])
    kubeconfig = cluster.write_kubeconfig(work / "policed.kubeconfig", server=gate.url,
                                          token=cluster.admin_token, ca_file=cluster.ca_file)
    return gate, kubeconfig


def run(clientgo: Path, cmd: str, kubeconfig: Path, *args: str,
        timeout: float = 90) -> list[Line]:
    proc = subprocess.run([str(clientgo), cmd, "--kubeconfig", str(kubeconfig), *args],
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"opgate-clientgo {cmd} exited {proc.returncode}:\n{proc.stderr}"
    return [json.loads(line) for line in proc.stdout.splitlines()]


def of(lines: list[Line], kind: str) -> list[Line]:
    return [line for line in lines if line["kind"] == kind]


def query(line: Line) -> dict[str, str]:
    return {k: v[-1] for k, v in parse_qs(line["query"]).items()}


def configmap(ns: str, name: str, **data: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": ns}, "data": data}


class Informer:
    """The program's ``informer`` subcommand, running; its lines arrive on a queue."""

    def __init__(self, clientgo: Path, kubeconfig: Path, *args: str, watch_list: bool) -> None:
        # client-go reads its feature gates from KUBE_FEATURE_*; without WatchListClient (as
        # before 1.35, and in many controllers still) the informer lists, then watches
        env = dict(os.environ, KUBE_FEATURE_WatchListClient=str(watch_list).lower())
        self.proc = subprocess.Popen(
            [str(clientgo), "informer", "--kubeconfig", str(kubeconfig), *args], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        reaper().watch_process(self.proc.pid)  # stopped if pytest dies first
        self.lines: list[Line] = []
        self._queue: queue.Queue[Line | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._queue.put(json.loads(raw))
        self._queue.put(None)

    def wait_for(self, what: Callable[[Line], bool], timeout: float, why: str) -> Line:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                stderr = self.proc.stderr.read() if self.proc.stderr else ""
                pytest.fail(f"the informer exited before {why}: {stderr[-2000:]}")
            self.lines.append(line)
            if what(line):
                return line
        pytest.fail(f"no {why} within {timeout}s; the informer printed:\n"
                    + "\n".join(json.dumps(line) for line in self.lines[-30:]))

    def event(self, type_: str, name: str, timeout: float = 5.0) -> Line:
        return self.wait_for(lambda ln: ln["kind"] == "event" and ln["type"] == type_
                             and ln["name"] == name, timeout, f"{type_} event for {name}")

    def store(self) -> list[str]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("store?\n")
        self.proc.stdin.flush()
        return list(self.wait_for(lambda ln: ln["kind"] == "store", 5, "the store")["keys"])

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # EOF: the program returns
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def informer(clientgo: Path) -> Iterator[Callable[..., Informer]]:
    started: list[Informer] = []

    def start(kubeconfig: Path, *args: str, watch_list: bool = True) -> Informer:
        started.append(Informer(clientgo, kubeconfig, *args, watch_list=watch_list))
        return started[-1]

    yield start
    for inf in started:
        inf.stop()


def test_client_go_matches_the_apiserver_minor(clientgo: Path, via: Path) -> None:
    gomod = (Path(__file__).parent / "clientgo" / "go.mod").read_text()
    minor = ".".join(KUBERNETES_VERSION.replace("v1.", "v0.", 1).split(".")[:2])
    assert f"k8s.io/client-go {minor}." in gomod, "bump tests/e2e/clientgo with the apiserver"
    (version,) = of(run(clientgo, "version", via), "version")
    assert version["gitVersion"] == KUBERNETES_VERSION


@pytest.mark.parametrize("mode", ["watch-list", "list-watch"])
def test_an_informer_sees_another_clients_changes_at_once(
        cluster: LocalCluster, ns: str, via: Path, informer: Callable[..., Informer],
        mode: str) -> None:
    before, name = f"inf-before-{mode}", f"inf-new-{mode}"
    cluster.apply(configmap(ns, before, v="0"))
    inf = informer(via, "--namespace", ns, "--protobuf", watch_list=mode == "watch-list")
    synced = inf.wait_for(lambda ln: ln["kind"] == "synced", 30, "cache sync")
    assert synced["items"] >= 1
    assert any(ln["kind"] == "event" and ln["name"] == before for ln in inf.lines)
    calls = [ln for ln in inf.lines if ln["kind"] == "http"]
    if mode == "watch-list":  # the initial state as a stream (client-go 1.35 and the apiserver)
        q = query(calls[0])
        assert (q.get("watch"), q.get("sendInitialEvents"), q.get("allowWatchBookmarks"),
                q.get("resourceVersionMatch")) == ("true", "true", "true", "NotOlderThan"), calls
        watch_call = calls[0]
    else:  # a LIST, then a watch from its resourceVersion
        if len(calls) < 2:
            calls.append(inf.wait_for(lambda ln: ln["kind"] == "http", 10, "the watch"))
        watch_call = calls[1]
        assert "watch" not in query(calls[0]) and calls[0]["code"] == 200, calls
        assert calls[0]["rctype"] == PROTOBUF
        q = query(watch_call)
        assert (q.get("watch"), q.get("allowWatchBookmarks"), q.get("resourceVersion")) == (
            "true", "true", synced["rv"]), watch_call
    assert watch_call["code"] == 200, watch_call
    assert watch_call["rctype"] == PROTOBUF + ";stream=watch", watch_call

    base = f"/api/v1/namespaces/{ns}/configmaps"
    for step, call in enumerate([
            lambda: cluster.call("POST", base, body=configmap(ns, name, v="1")).ok(),
            lambda: cluster.call("PUT", f"{base}/{name}", body=configmap(ns, name, v="2")).ok(),
            lambda: cluster.call("DELETE", f"{base}/{name}").ok()]):
        started = time.monotonic()
        call()
        line = inf.event(("add", "update", "delete")[step], name)
        took = time.monotonic() - started
        assert took < 2.0, f"{line} took {took:.1f}s"
        if step < 2:
            assert line["data"] == {"v": str(step + 1)}
    assert not of(inf.lines, "error"), of(inf.lines, "error")
    assert len(of(inf.lines, "http")) == (1 if mode == "watch-list" else 2)  # one watch all along


def test_informers_list_again_after_an_apiserver_restart(
        cluster: LocalCluster, ns: str, via: Path, informer: Callable[..., Informer]) -> None:
    """While the apiserver restarts opgate answers 503 (its Status); both kinds of informer
    (watch-list, and list-then-watch) list again once it is back and then see changes again."""
    cluster.apply(configmap(ns, "restart-before", v="0"))
    informers = {mode: informer(via, "--namespace", ns, watch_list=mode == "watch-list")
                 for mode in ("watch-list", "list-watch")}
    for inf in informers.values():
        inf.wait_for(lambda ln: ln["kind"] == "synced", 30, "cache sync")
    cluster.compact_etcd()
    cluster.restart_apiserver()
    cluster.apply(configmap(ns, "restart-after", v="1"))
    for mode, inf in informers.items():
        inf.event("add", "restart-after", timeout=60)
        calls = [ln for ln in inf.lines if ln["kind"] == "http"]
        # while it is away: opgate's 503 (or, as it starts, the apiserver's 429), as a Status
        assert all(c["rctype"] == "application/json" for c in calls
                   if c.get("code") not in (None, 200)), calls
        first = 1 if mode == "watch-list" else 2  # the calls before the restart
        later = calls[first:]
        # a list (or a watch-list) again, then watching again
        assert any(c["code"] == 200 and ("watch" not in query(c)
                                         or query(c).get("sendInitialEvents") == "true")
                   for c in later), later
        if "watch" not in query(later[-1]):  # the object came in the list: its watch follows
            later.append(inf.wait_for(lambda ln: ln["kind"] == "http", 10, "the watch"))
        assert later[-1]["code"] == 200 and query(later[-1]).get("watch") == "true", later
        assert {f"{ns}/restart-before", f"{ns}/restart-after"} <= set(inf.store())


@pytest.mark.parametrize("mode", ["watch-list", "list-watch"])
def test_a_watch_resumed_past_compaction_gets_410_and_the_reflector_lists_again(
        cluster: LocalCluster, ns: str, idle_via: Path, informer: Callable[..., Informer],
        mode: str) -> None:
    before, after = f"gone-before-{mode}", f"gone-after-{mode}"
    cluster.apply(configmap(ns, before, v="0"))
    inf = informer(idle_via, "--namespace", ns, watch_list=mode == "watch-list")
    inf.wait_for(lambda ln: ln["kind"] == "synced", 30, "cache sync")
    os.kill(inf.proc.pid, signal.SIGSTOP)  # the client is away
    try:
        time.sleep(5)  # opgate ends its idle watch (3 s) meanwhile: a clean end, read on return
        cluster.create_namespace(f"{ns}-elsewhere")  # etcd's revision moves on
        cluster.apply(configmap(f"{ns}-elsewhere", f"bump-{mode}", v="1"))
        compacted = cluster.compact_etcd()
        cluster.restart_apiserver()
    finally:
        os.kill(inf.proc.pid, signal.SIGCONT)
    err = inf.wait_for(lambda ln: ln["kind"] == "error", 60, "the resumed watch's 410")
    assert (err["op"], err["code"], err["reason"], err["expired"]) == (
        "watch-event", 410, "Expired", True), err  # an ERROR event in a 200 watch
    watches = [ln for ln in inf.lines if ln["kind"] == "http" and "resourceVersion" in query(ln)
               and query(ln).get("watch") == "true" and "sendInitialEvents" not in query(ln)]
    assert watches and int(query(watches[-1])["resourceVersion"]) < compacted, watches
    assert f"too old resource version: {query(watches[-1])['resourceVersion']} (" in (
        err["message"]), (err, watches[-1])
    relist = inf.wait_for(lambda ln: ln["kind"] == "http" and ln["code"] == 200 and (
        "watch" not in query(ln) or query(ln).get("sendInitialEvents") == "true"), 30,
        "the list after the 410")
    assert relist["rctype"].startswith(PROTOBUF), relist
    cluster.apply(configmap(ns, after, v="1"))
    inf.event("add", after, timeout=15)
    assert {f"{ns}/{before}", f"{ns}/{after}"} <= set(inf.store())


def test_a_list_at_a_compacted_resource_version_is_expired_to_client_go(
        cluster: LocalCluster, ns: str, via: Path, clientgo: Path) -> None:
    cluster.compact_etcd()
    lines = run(clientgo, "list", via, "--namespace", ns, "--resource-version", "2",
                "--resource-version-match", "Exact", "--protobuf")
    (call,) = of(lines, "http")
    assert call["code"] == 410, call
    (err,) = of(lines, "error")
    assert (err["code"], err["reason"], err["expired"], err["gone"]) == (
        410, "Expired", True, False), err


@pytest.mark.parametrize("encoding", ["protobuf", "json"])
def test_a_paginated_list(cluster: LocalCluster, relay: str, via: Path, clientgo: Path,
                          encoding: str) -> None:
    ns = f"clientgo-pages-{relay}-{encoding}"
    cluster.create_namespace(ns)
    names = [f"page-{i}" for i in range(5)]
    for name in names:
        cluster.apply(configmap(ns, name, blob="x" * 2000))
    lines = run(clientgo, "list", via, "--namespace", ns, "--limit", "2",
                f"--{encoding}")
    assert not of(lines, "error"), of(lines, "error")
    pages = of(lines, "page")
    assert [(p["items"], p["continue"]) for p in pages] == [(2, True), (2, True), (1, False)]
    assert [p["remaining"] for p in pages[:2]] == [3, 1]
    assert len({p["rv"] for p in pages}) == 1  # one snapshot across the pages
    (listed,) = of(lines, "list")
    assert listed["names"] == names
    calls = of(lines, "http")
    assert [query(c).get("limit") for c in calls] == ["2"] * 3
    assert ["continue" in query(c) for c in calls] == [False, True, True]
    assert all(c["code"] == 200 for c in calls)
    want = PROTOBUF if encoding == "protobuf" else "application/json"
    assert all(c["rctype"] == want for c in calls), calls


def test_protobuf_create(ns: str, via: Path, clientgo: Path) -> None:
    lines = run(clientgo, "create", via, "--namespace", ns, "--name", "pb-created",
                "--protobuf")
    assert of(lines, "created"), lines
    (call,) = of(lines, "http")
    assert (call["method"], call["code"], call["ctype"], call["rctype"]) == (
        "POST", 201, PROTOBUF, PROTOBUF)


def test_server_side_apply_with_field_managers(ns: str, via: Path, clientgo: Path) -> None:
    def apply(manager: str, data: str, *extra: str) -> list[Line]:
        return run(clientgo, "apply", via, "--namespace", ns, "--name", "ssa",
                   "--manager", manager, "--data", data, *extra)

    first = apply("alpha", "a=1,b=1")
    (applied,) = of(first, "applied")
    assert applied["data"] == {"a": "1", "b": "1"}
    assert applied["managers"] == ["alpha/Apply"]
    (call,) = of(first, "http")
    assert (call["method"], call["ctype"], call["code"]) == (
        "PATCH", "application/apply-patch+yaml", 201)
    assert query(call) == {"fieldManager": "alpha", "force": "false"}

    clash = apply("beta", "a=2")
    (err,) = of(clash, "error")
    assert (err["code"], err["reason"], err["conflict"]) == (409, "Conflict", True), err
    assert 'conflict with "alpha"' in err["message"]

    forced = apply("beta", "a=2", "--force")
    (applied,) = of(forced, "applied")
    assert applied["data"] == {"a": "2", "b": "1"}
    assert applied["managers"] == ["alpha/Apply", "beta/Apply"]
    assert query(of(forced, "http")[0]) == {"fieldManager": "beta", "force": "true"}


def _access_log(gate: Opgate) -> list[Line]:
    return [json.loads(line) for line in gate.log.read_text(errors="replace").splitlines()
            if line.startswith("{")]


def _when(entry: Line) -> float:
    return datetime.fromisoformat(str(entry["time"]).replace("Z", "+00:00")).timestamp()


def test_a_429_is_retried_after_retry_after(cluster: LocalCluster, ns: str, clientgo: Path,
                                            policed: tuple[Opgate, Path]) -> None:
    gate, kubeconfig = policed
    cluster.apply(configmap(ns, "limited", v="1"))
    started = time.monotonic()
    lines = run(clientgo, "get", kubeconfig, "--namespace", ns, "--name", "limited",
                "--count", "3")
    elapsed = time.monotonic() - started
    assert len(of(lines, "got")) == 3 and not of(lines, "error"), lines
    # three gets at 0.5/s with a burst of 1: the second and third each wait ~2 s
    assert elapsed >= 3.0, f"client-go finished in {elapsed:.1f}s: it did not wait"
    seen = of(lines, "http")
    rejected = [c for c in seen if c["code"] == 429]
    assert rejected, "the budget was never exceeded: the test proves nothing"
    assert all(c["retryAfter"].isdigit() and int(c["retryAfter"]) >= 1 for c in rejected)
    assert [c["code"] for c in seen].count(200) == 3

    time.sleep(0.5)  # the access log line is written when the call ends
    gets = [e for e in _access_log(gate) if e.get("verb") == "get"
            and e.get("namespace") == ns and e.get("name") == "limited"]
    assert [e["code"] for e in gets] == [c["code"] for c in seen]  # each retry went through
    for i, entry in enumerate(gets):
        if entry["code"] == 429:
            wait = _when(gets[i + 1]) - _when(entry)
            assert wait >= 0.9, f"retried after {wait:.2f}s, before Retry-After"

    # without retries left, client-go hands the 429 to the caller as IsTooManyRequests
    lines = run(clientgo, "get", kubeconfig, "--namespace", ns, "--name", "limited",
                "--count", "2", "--max-retries", "0")
    errors = of(lines, "error")
    assert errors, lines
    for err in errors:
        assert (err["code"], err["reason"], err["tooManyRequests"]) == (
            429, "TooManyRequests", True), err
        assert err["retryAfterSeconds"] >= 1


def test_an_opgate_denial_is_forbidden_to_client_go(ns: str, clientgo: Path,
                                                   policed: tuple[Opgate, Path]) -> None:
    _, kubeconfig = policed
    lines = run(clientgo, "create", kubeconfig, "--namespace", ns, "--resource", "secrets",
                "--name", "denied")
    (err,) = of(lines, "error")
    assert (err["code"], err["reason"], err["forbidden"]) == (403, "Forbidden", True), err
    assert 'rule "no-secrets"' in err["message"] and "enforce.yaml" in err["message"]
    # the apiserver's own details (a create names no object: the name is in the body)
    assert err["details"] == {"name": "", "group": "", "kind": "secrets"}, err


def test_dryrun_warnings_reach_the_warning_handler(ns: str, clientgo: Path,
                                                  policed: tuple[Opgate, Path]) -> None:
    _, kubeconfig = policed
    lines = run(clientgo, "create", kubeconfig, "--namespace", ns, "--name", "warned")
    assert of(lines, "created"), lines  # dryrun never denies
    warnings = of(lines, "warning")
    assert [w["code"] for w in warnings] == [299], lines
    assert warnings[0]["text"].startswith("opgate: would deny (dryrun)"), warnings
    assert "clientgo-dryrun" in warnings[0]["text"]


def test_a_quota_counts_client_gos_protobuf_creates_once(ns: str, clientgo: Path,
                                                        policed: tuple[Opgate, Path]) -> None:
    """client-go 1.35's typed clients send built-in objects as protobuf by default: opgate must
    read their names, or each create stays reserved beside its object (counted twice) and the
    denial names no object, unlike the apiserver's."""
    _, kubeconfig = policed
    quota_ns = f"{ns}-quota"
    lines = run(clientgo, "create", kubeconfig, "--namespace", quota_ns, "--name", "q",
                "--count", "4")
    assert all(c["ctype"] == PROTOBUF for c in of(lines, "http")), lines
    assert not of(lines, "error"), of(lines, "error")
    assert [c["name"] for c in of(lines, "created")] == [f"q-{i}" for i in range(4)]
    for args in (["--name", "q-over"], ["--name", "gen-", "--generate-name"]):
        (err,) = of(run(clientgo, "create", kubeconfig, "--namespace", quota_ns, *args), "error")
        assert (err["code"], err["forbidden"]) == (403, True), err
        name = "q-over" if "q-over" in args else err["message"].split('"')[1]
        assert name.startswith("gen-") or name == "q-over", err
        assert err["message"] == (
            f'configmaps "{name}" is forbidden: exceeded quota: four-configmaps, requested: '
            "count/configmaps=1, used: count/configmaps=4, limited: count/configmaps=4"), err
        assert err["details"] == {"name": name, "group": "", "kind": "configmaps"}, err
    # server-side apply: to an object that exists it is an update, else a create that counts
    applied = run(clientgo, "apply", kubeconfig, "--namespace", quota_ns, "--name", "q-0",
                  "--data", "a=1")
    assert of(applied, "applied"), applied
    (err,) = of(run(clientgo, "apply", kubeconfig, "--namespace", quota_ns, "--name", "q-new",
                    "--data", "a=1"), "error")
    assert (err["code"], err["forbidden"]) == (403, True), err
    assert err["message"].startswith('configmaps "q-new" is forbidden: exceeded quota: '), err


def test_the_instance_of_a_protobuf_create_is_its_controlling_owner(
        ns: str, clientgo: Path, policed: tuple[Opgate, Path]) -> None:
    """A rate limit keyed by ``{instance}``: creates for two owners do not share a bucket, two
    for the same owner do (client-go waits out the 429)."""
    _, kubeconfig = policed
    owned = f"{ns}-owned"

    def create(name: str, owner: str) -> list[Line]:
        lines = run(clientgo, "create", kubeconfig, "--namespace", owned, "--name", name,
                    "--owner", owner)
        assert of(lines, "created") and all(c["ctype"] == PROTOBUF for c in of(lines, "http"))
        return [c["code"] for c in of(lines, "http")]

    assert create("a-1", "Widget/a") == [201]
    assert create("b-1", "Widget/b") == [201], "another owner's create shared a's bucket"
    assert create("a-2", "Widget/a")[0] == 429, "the same owner's second create was not limited"


def test_an_exec_the_apiserver_refuses_reaches_client_go_as_its_status(
        cluster: LocalCluster, ns: str, via: Path, kubeconfigs: Kubeconfigs,
        clientgo: Path) -> None:
    """kubectl's executor (WebSocket, then SPDY) for a pod on no node (envtest runs no
    kubelet): the apiserver answers the upgrade 400 and client-go reports its Status, the same
    through opgate as directly."""
    if cluster.call("GET", f"/api/v1/namespaces/{ns}/pods/nowhere").status == 404:
        cluster.call("POST", f"/api/v1/namespaces/{ns}/pods", body={
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "nowhere"},
            "spec": {"containers": [{"name": "c", "image": "busybox"}]}}).ok()

    def shown(kubeconfig: Path) -> list[Line]:
        lines = run(clientgo, "exec", kubeconfig, "--namespace", ns, "--pod", "nowhere")
        return [{k: v for k, v in ln.items() if k not in ("proto", "gunzipped")}
                for ln in lines]

    direct, through = shown(kubeconfigs.direct), shown(via)
    assert through == direct
    (err,) = of(through, "error")
    assert (err["code"], err["reason"]) == (400, "BadRequest"), err
    assert err["message"] == "pod nowhere does not have a host assigned"
    websocket, spdy = of(through, "http")
    assert websocket["method"] == "GET" and "unable to upgrade" in websocket["err"]
    assert (spdy["method"], spdy["code"]) == ("POST", 400)


def test_dropped_impersonation_is_a_warning_to_client_go(ns: str, via: Path,
                                                        clientgo: Path) -> None:
    """``rest.Config.Impersonate`` (``kubectl --as``) through opgate, which allows none: the call
    runs as the caller and client-go's WarningHandler hears why."""
    lines = run(clientgo, "create", via, "--namespace", ns, "--name", "as-bob", "--as", "bob")
    assert of(lines, "created"), lines  # bob may do nothing: it ran as the admin
    (warning,) = of(lines, "warning")
    assert warning["code"] == 299 and warning["text"] == f"opgate: {IMPERSONATION_DROPPED}"
