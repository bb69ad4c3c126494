"""A real controller-runtime manager (tests/e2e/ctrlruntime) behind opgate's default chain.

Most operator authors use sigs.k8s.io/controller-runtime, not raw client-go: this module runs
its manager (controller-runtime of the apiserver's client-go minor) the way they do — leader
election on a Lease, the cached client (shared informers), a metadata-only watch of the owned
ConfigMaps (``builder.OnlyMetadata``), server-side apply of each Widget's ConfigMap
(``Client.Apply``), status subresource updates, an events.k8s.io recorder, its metrics and
health listeners off — against a real ``opgate serve`` in front of the real apiserver, with
identity (the manager's ServiceAccount token), a rate limit on a real Redis, a quota and the
audit log. What is checked is what the operator's author would look at: the Lease, the
ConfigMaps and statuses, the manager's own calls (it prints one JSON line per request), and
opgate's metrics and audit log.
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from proxy.envtest.binaries import KUBERNETES_VERSION
from proxy.envtest.cluster import LocalCluster
from proxy.envtest.reaper import reaper
from tests.e2e.conftest import Opgate, start_opgate
from tests.e2e.waiting import wait_for
from tests.integration.redis_server import RedisServer

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "examples" / "reconciler" / "widget-crd.yaml"
SA_NAMESPACE, SA_NAME = "ctrl-system", "widget-controller"
USER = f"system:serviceaccount:{SA_NAMESPACE}:{SA_NAME}"
NS, QUOTA_NS, OWNED_NS = "ctrl-widgets", "ctrl-quota", "ctrl-owned"
SUFFIX = {"fast": "", "aiohttp": "-aiohttp"}
WIDGETS = "/apis/demo.opgate.dev/v1/namespaces/{ns}/widgets"
QUOTA_MAX = 3
TIMEOUT = 120.0
POLICY = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: widget-controller}}
spec:
  mode: enforce
  identity:
    issuers: [{{kubernetes: {{}}}}]
    allow: [{{serviceAccount: {sa}}}]
    rules:
      - {{name: everything, verbs: ["*"], resources: ["*"]}}
  rateLimits:
    - name: configmap-writes
      match:
        {{verbs: [create, update, patch], resources: [configmaps], namespaces: [{ns}, {quota_ns}]}}
      key: "{{user}}"
      qps: {qps}
      burst: 2
      onExceed: reject
    - name: per-widget-applies
      match: {{verbs: [patch], resources: [configmaps], namespaces: [{owned_ns}]}}
      key: "{{instance}}"
      qps: 0.05
      burst: 1
      onExceed: reject
  quotas:
    - {{name: widget-configmaps, resources: [configmaps], namespaces: [{quota_ns}], max: {max}}}
"""
RULES = [
    {"apiGroups": ["demo.opgate.dev"], "resources": ["widgets"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["demo.opgate.dev"], "resources": ["widgets/status"], "verbs": ["update"]},
    {"apiGroups": ["demo.opgate.dev"], "resources": ["widgets/finalizers"], "verbs": ["update"]},
    {"apiGroups": [""], "resources": ["configmaps"],
     "verbs": ["get", "list", "watch", "create", "patch"]},
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
     "verbs": ["get", "create", "update"]},
    {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
    # the leader election's own event (client-go's resourcelock) is a core/v1 Event
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
]
Line = dict[str, Any]


def policy(suffix: str, *, qps: float = 2, max_: int = QUOTA_MAX) -> str:
    return POLICY.format(sa=f"{SA_NAMESPACE}/{SA_NAME}", ns=NS + suffix,
                         quota_ns=QUOTA_NS + suffix, owned_ns=OWNED_NS + suffix, qps=qps, max=max_)


@dataclass
class Setup:
    cluster: LocalCluster
    gate: Opgate
    kubeconfig: Path
    audit: Path
    suffix: str  # of the namespaces, one per relay core

    @property
    def ns(self) -> str:
        return NS + self.suffix

    @property
    def quota_ns(self) -> str:
        return QUOTA_NS + self.suffix

    @property
    def owned_ns(self) -> str:
        return OWNED_NS + self.suffix


@pytest.fixture(scope="module", params=["fast", "aiohttp"])
def relay(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def setup(relay: str, cluster: LocalCluster,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """The CRD, the manager's ServiceAccount and RBAC, a redis-server and an opgate on
    ``relay`` with the chain (identity, the Redis rate limit, the quota, audit) whose kubeconfig
    the manager uses. Each relay core gets namespaces of its own (a suffix)."""
    cluster.install_crd(CRD.read_text())
    for namespace in (NS, QUOTA_NS, OWNED_NS):
        cluster.create_namespace(namespace + SUFFIX[relay])
    suffix = SUFFIX[relay]
    cluster.create_service_account_with_rbac(SA_NAMESPACE, SA_NAME, RULES, cluster_wide=True)
    work = tmp_path_factory.mktemp("ctrlruntime")
    own = work / "opgate-token"  # opgate's own credential: TokenReviews, quota counts
    own.write_text(cluster.admin_token)
    own.chmod(0o600)
    audit = work / "audit.log"
    with RedisServer.launch() as redis:
        gate = start_opgate(cluster, work / "opgate", policies={"policy.yaml": policy(suffix)},
                            extra_args=["--token-file", str(own), "--redis-url", redis.url,
                                        "--audit-log", str(audit), "--relay", relay])
        try:
            token = cluster.token_request(SA_NAMESPACE, SA_NAME, expiration_seconds=3600)
            kubeconfig = cluster.write_kubeconfig(work / "manager.kubeconfig", server=gate.url,
                                                  token=token, ca_file=cluster.ca_file)
            wait_for("opgate's quota counts to sync", lambda: quota_synced(gate), 60)
            yield Setup(cluster=cluster, gate=gate, kubeconfig=kubeconfig, audit=audit,
                        suffix=suffix)
        finally:
            gate.stop()


def quota_synced(gate: Opgate) -> bool:
    _, body = gate.admin_get("/readyz?verbose")
    return any("quota-counts" in line and "configmaps=synced" in line
               for line in body.splitlines())


def ready(gate: Opgate) -> bool:
    try:
        return gate.admin_get("/readyz", timeout=3)[0] == 200
    except OSError:  # not listening yet
        return False


class Manager:
    """The program, running; its stdout lines arrive on a queue, its log goes to a file."""

    def __init__(self, binary: Path, setup: Setup, namespace: str, log: Path,
                 *args: str) -> None:
        self.log = log
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(
                [str(binary), "--kubeconfig", str(setup.kubeconfig), "--namespace", namespace,
                 *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, text=True)
        reaper().watch_process(self.proc.pid)  # stopped if pytest dies first
        self.lines: list[Line] = []
        self._queue: queue.Queue[Line | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log.with_suffix(".out"), "w") as out:  # for the post-mortem
            for raw in self.proc.stdout:
                out.write(raw)
                out.flush()
                self._queue.put(json.loads(raw))
        self._queue.put(None)

    def wait_for(self, what: Callable[[Line], bool], why: str, timeout: float = TIMEOUT) -> Line:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                pytest.fail(f"the manager exited ({self.proc.wait()}) before {why}:\n"
                            + self.log.read_text()[-3000:])
            self.lines.append(line)
            if what(line):
                return line
        pytest.fail(f"no {why} within {timeout:.0f}s; the manager printed:\n"
                    + "\n".join(json.dumps(ln) for ln in self.lines[-25:])
                    + "\nand logged:\n" + self.log.read_text()[-3000:])

    def drain(self) -> None:
        """Take the lines printed so far."""
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                return
            if line is not None:
                self.lines.append(line)

    def settle(self, quiet: float, why: str, timeout: float = TIMEOUT) -> None:
        """Take the lines until the manager has printed none for ``quiet`` seconds (it made
        no call: each watch it has open is older than that)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=quiet)
            except queue.Empty:
                return
            if line is None:
                pytest.fail(f"the manager exited ({self.proc.wait()}) before {why}")
            self.lines.append(line)
        pytest.fail(f"the manager did not settle within {timeout:.0f}s before {why}")

    def reconciled(self, names: set[str], why: str) -> None:
        """Wait until each of ``names`` was reconciled (since the manager started)."""
        def missing() -> set[str]:
            return names - {ln["name"] for ln in self.lines if ln["kind"] == "reconciled"}

        if missing():
            self.wait_for(lambda _: not missing(), f"{why}: the reconcile of {sorted(missing())}")

    def http(self, since: int = 0) -> list[Line]:
        return [ln for ln in self.lines[since:] if ln["kind"] == "http"]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


@pytest.fixture
def manager(ctrlruntime: Path, setup: Setup,
            tmp_path: Path) -> Iterator[Callable[..., Manager]]:
    started: list[Manager] = []

    def start(namespace: str, *args: str) -> Manager:
        mgr = Manager(ctrlruntime, setup, namespace, tmp_path / f"manager-{len(started)}.log",
                      "--lease-name", f"widgets-{namespace}", *args)
        started.append(mgr)
        mgr.wait_for(lambda ln: ln["kind"] == "leader", "the leader election")
        return mgr

    yield start
    for mgr in started:
        mgr.stop()


def widget(namespace: str, name: str, **data: str) -> dict[str, Any]:
    return {"apiVersion": "demo.opgate.dev/v1", "kind": "Widget",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"color": "blue", "data": data}}


def create_widgets(cluster: LocalCluster, namespace: str, names: list[str]) -> None:
    for name in names:
        cluster.call("POST", WIDGETS.format(ns=namespace),
                     body=widget(namespace, name, owner=name)).ok()


def configmaps(cluster: LocalCluster, namespace: str) -> dict[str, Any]:
    items = cluster.call("GET", f"/api/v1/namespaces/{namespace}/configmaps").ok().json()["items"]
    return {cm["metadata"]["name"]: cm for cm in items
            if cm["metadata"]["name"] != "kube-root-ca.crt"}


def audit_events(setup: Setup) -> list[Line]:
    return [json.loads(line) for line in setup.audit.read_text().splitlines() if line.strip()]


def metric(gate: Opgate, name: str, **labels: str) -> float:
    """The sum of a counter's samples whose labels include ``labels``."""
    _, text = gate.admin_get("/metrics")
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def lease(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"
    return dict(cluster.call("GET", path).ok().json()["spec"])


def renewed_at(spec: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(str(spec["renewTime"]).replace("Z", "+00:00"))


def test_go_mod_pins_client_go_of_the_apiservers_minor() -> None:
    """controller-runtime v0.23 is the release built on k8s.io/* v0.35: the manager talks to
    the e2e apiserver as a current operator would."""
    gomod = (Path(__file__).parent / "ctrlruntime" / "go.mod").read_text()
    minor = ".".join(KUBERNETES_VERSION.replace("v1.", "v0.", 1).split(".")[:2])
    assert f"k8s.io/client-go {minor}." in gomod
    assert "sigs.k8s.io/controller-runtime v0.23." in gomod


def test_manager_leads_and_reconciles_through_429s(
        setup: Setup, manager: Callable[..., Manager]) -> None:
    """It takes the Lease, and every Widget gets its ConfigMap and Ready status although
    opgate answers many of its applies 429 (client-go waits Retry-After and sends again)."""
    rejects = metric(setup.gate, "opgate_ratelimit_decisions_total", policy="widget-controller",
                     result="denied")
    mgr = manager(setup.ns)
    held = lease(setup.cluster, setup.ns, f"widgets-{setup.ns}")
    assert held["holderIdentity"], held
    names = [f"w-{i}" for i in range(10)]
    create_widgets(setup.cluster, setup.ns, names)
    mgr.reconciled(set(names), "every Widget through the 429s")

    cms = configmaps(setup.cluster, setup.ns)
    assert sorted(cms) == sorted(names)
    for name in names:
        assert cms[name]["data"] == {"owner": name}
        [ref] = cms[name]["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["controller"]) == ("Widget", name, True)
        managers = {f["manager"]: f["operation"] for f in cms[name]["metadata"]["managedFields"]}
        assert managers == {"widget-controller": "Apply"}
        path = f"{WIDGETS.format(ns=setup.ns)}/{name}"
        status = setup.cluster.call("GET", path).ok().json()["status"]
        assert [(c["type"], c["status"]) for c in status["conditions"]] == [("Ready", "True")]

    throttled = [ln for ln in mgr.http() if ln.get("code") == 429]
    assert throttled, "the rate limit never answered 429"
    assert all(ln["retryAfter"].isdigit() for ln in throttled), throttled
    assert not [ln for ln in mgr.lines if ln["kind"] == "error"], "client-go retried the 429s"
    assert metric(setup.gate, "opgate_ratelimit_decisions_total", policy="widget-controller",
                  result="denied") - rejects >= len(throttled)


def test_each_widgets_apply_counts_against_its_own_bucket(
        setup: Setup, manager: Callable[..., Manager]) -> None:
    """``{instance}`` of a server-side apply is the Widget in its controlling ownerReference,
    as for a create or update: three Widgets' first applies each get their own burst of one
    (one shared ``-`` bucket would answer the second and third 429 for 20 s). Each Widget's
    second pass then waits for its own bucket: a worker each, so none holds up the others."""
    mgr = manager(setup.owned_ns, "--workers", "4")
    names = [f"o-{i}" for i in range(3)]
    create_widgets(setup.cluster, setup.owned_ns, names)

    def first_applies() -> dict[str, Line]:
        found: dict[str, Line] = {}
        for ln in mgr.http():
            name = ln["path"].rsplit("/", 1)[-1]
            if ln["method"] == "PATCH" and "/configmaps/" in ln["path"]:
                found.setdefault(name, ln)
        return found

    if len(first_applies()) < len(names):
        mgr.wait_for(lambda _: len(first_applies()) == len(names), "each Widget's first apply")
    assert {n: ln["code"] for n, ln in first_applies().items()} == dict.fromkeys(names, 201)


def test_audit_records_the_managers_user_and_verbs(
        setup: Setup, manager: Callable[..., Manager]) -> None:
    """The audit log names the ServiceAccount and the apiserver's verbs: an apply is a patch,
    the status write an update of widgets/status, the Lease a get/update, events a create."""
    mgr = manager(setup.ns)  # the Lease of the test before: taken over once released
    create_widgets(setup.cluster, setup.ns, ["audited"])
    mgr.reconciled({"audited"}, "the audited Widget")

    def seen(resource: str, verb: str, name: str | None = None) -> list[Line]:
        return [ev for ev in audit_events(setup)
                if ev["stage"] == "ResponseComplete" and ev["verb"] == verb
                and "objectRef" in ev
                and (ev["objectRef"].get("resource"), ev["objectRef"].get("subresource", ""))
                == tuple([*resource.split("/"), ""][:2])
                and (name is None or ev["objectRef"].get("name") == name)]

    # the audit log is written by a thread of its own: wait for the apply that created
    wait_for("the audit of the apply", lambda: any(
        ev["responseStatus"]["code"] == 201 for ev in seen("configmaps", "patch", "audited")), 30)
    assert {ev["responseStatus"]["code"]
            for ev in seen("configmaps", "patch", "audited")} <= {201, 200, 429}
    assert seen("events", "create")
    assert seen("widgets/status", "update", "audited")
    assert seen("leases", "update") or seen("leases", "create")
    # client-go 0.35's informers stream their initial list (watch-list): watches, no LIST
    assert seen("widgets", "watch") and seen("configmaps", "watch")
    assert not seen("widgets", "list") and not seen("configmaps", "list")
    mine = [ev for ev in audit_events(setup) if ev.get("userAgent", "").startswith("opgate-ctrl")
            or ev["user"].get("username") == USER]
    assert mine and all(ev["user"]["username"] == USER for ev in mine)
    assert {ev["objectRef"]["resource"] for ev in mine if "objectRef" in ev} >= {
        "configmaps", "widgets", "leases", "events"}


def test_quota_denies_apply_creates_as_the_apiserver_and_the_manager_requeues(
        setup: Setup, manager: Callable[..., Manager]) -> None:
    """Server-side apply creates count against the quota: the fourth ConfigMap gets the
    apiserver's 403 (apierrors.IsForbidden), the manager logs it and requeues; a hot reload
    that raises the limit lets the requeued Widgets through, and does not make the manager's
    informers list again."""
    mgr = manager(setup.quota_ns)
    names = [f"q-{i}" for i in range(QUOTA_MAX + 2)]
    create_widgets(setup.cluster, setup.quota_ns, names)
    denied = mgr.wait_for(lambda ln: ln["kind"] == "error", "a quota denial")
    assert (denied["code"], denied["forbidden"], denied["reason"]) == (403, True, "Forbidden")
    assert (f'configmaps "{denied["name"]}" is forbidden: exceeded quota: widget-configmaps, '
            f"requested: count/configmaps=1, used: count/configmaps={QUOTA_MAX}, "
            f"limited: count/configmaps={QUOTA_MAX}") in denied["message"]
    # controller-runtime's own log: the reconcile failed with the apiserver's words
    wait_for("the Reconciler error in the manager's log", lambda: any(
        '"Reconciler error"' in line and "exceeded quota: widget-configmaps" in line
        for line in mgr.log.read_text().splitlines()), 30)
    wait_for("the quota'd ConfigMaps",
             lambda: len(configmaps(setup.cluster, setup.quota_ns)) == QUOTA_MAX, TIMEOUT)
    # the requeue: the same Widget is tried again (with backoff) and denied again
    mgr.wait_for(lambda ln: ln["kind"] == "error" and ln["name"] == denied["name"]
                 and ln is not denied, "the requeued apply")
    assert len(configmaps(setup.cluster, setup.quota_ns)) == QUOTA_MAX
    assert metric(setup.gate, "opgate_quota_denials_total", resource="configmaps") >= 2
    # the applies that update an existing ConfigMap (each Widget's second pass) are no creates
    created = set(configmaps(setup.cluster, setup.quota_ns))

    def updated() -> set[str]:
        return {ln["path"].rsplit("/", 1)[-1] for ln in mgr.http()
                if ln["method"] == "PATCH" and "/configmaps/" in ln["path"] and ln["code"] == 200}

    if not updated() >= created:
        mgr.wait_for(lambda _: updated() >= created, "an apply that updates each ConfigMap")
    assert not {ln["name"] for ln in mgr.lines if ln["kind"] == "error"} & created

    mgr.drain()
    before = len(mgr.lines)
    streams = informer_streams(setup)
    reloads = metric(setup.gate, "opgate_policy_reloads_total", result="success")
    (setup.gate.policies_dir / "policy.yaml").write_text(policy(setup.suffix, max_=len(names)))
    wait_for("the reload", lambda: metric(
        setup.gate, "opgate_policy_reloads_total", result="success") > reloads, 30)
    mgr.reconciled(set(names), "the Widgets the raised quota lets through")
    assert sorted(configmaps(setup.cluster, setup.quota_ns)) == sorted(names)
    again = [ln for ln in mgr.http(before)
             if ln["method"] == "GET" and ln["path"].endswith(("/widgets", "/configmaps"))]
    assert not again, f"after the reload the informers listed or watched again: {again}"
    assert streams == 2  # the two informers' watch-lists, before the reload
    assert informer_streams(setup) == streams


def informer_streams(setup: Setup) -> int:
    """The manager's LISTs and started watches of Widgets and ConfigMaps in the quota'd
    namespace, as opgate's audit log has them."""
    def started(ev: Line) -> bool:
        return ev["verb"] == "list" or (ev["verb"] == "watch" and ev["stage"] == "ResponseStarted")

    return sum(1 for ev in audit_events(setup)
               if ev["user"].get("username") == USER and started(ev)
               and ev.get("objectRef", {}).get("namespace") == setup.quota_ns
               and ev["objectRef"].get("resource") in ("widgets", "configmaps"))


def test_leader_keeps_the_lease_across_an_opgate_restart(
        setup: Setup, manager: Callable[..., Manager]) -> None:
    """opgate stops and comes back on the same port within the lease duration: the manager
    keeps leading (it would exit on a lost lease), renews the Lease, and its informers, which
    watch again from their last resourceVersion (opgate ends their watches as the apiserver's
    timeout does: no new initial list), still see new Widgets."""
    (setup.gate.policies_dir / "policy.yaml").write_text(policy(setup.suffix))
    mgr = manager(setup.ns, "--lease-duration", "30s", "--renew-deadline", "20s",
                  "--retry-period", "2s")
    # both informers streaming events, and every watch older than a second: a watch ended
    # within 1 s of its start without an event is one client-go lists again after, whoever
    # ends it (the reconcile's status update starts one more, just before the restart)
    create_widgets(setup.cluster, setup.ns, ["before-restart"])
    mgr.reconciled({"before-restart"}, "a Widget created before the restart")
    mgr.settle(1.5, "the restart")
    since = len(mgr.lines)
    name = f"widgets-{setup.ns}"
    before = lease(setup.cluster, setup.ns, name)
    setup.gate.proc.stop()
    setup.gate.proc.start()
    wait_for("opgate to be ready again", lambda: ready(setup.gate), 60)
    wait_for("the Lease renewed through the new opgate",
             lambda: renewed_at(lease(setup.cluster, setup.ns, name)) > renewed_at(before), 40)
    after = lease(setup.cluster, setup.ns, name)
    assert after["holderIdentity"] == before["holderIdentity"]
    assert after.get("leaseTransitions", 0) == before.get("leaseTransitions", 0)
    create_widgets(setup.cluster, setup.ns, ["after-restart"])
    mgr.reconciled({"after-restart"}, "a Widget created after the restart")
    assert mgr.proc.poll() is None
    watches = [ln for ln in mgr.http(since) if ln["method"] == "GET" and ln.get("code") == 200
               and ln["path"].endswith(("/widgets", "/configmaps"))]
    assert watches, "the informers did not watch again"
    relisted = [ln for ln in watches if "sendInitialEvents=true" in ln["query"]
                or "resourceVersion=" not in ln["query"] or "watch=true" not in ln["query"]]
    # (every call since, so a failure shows what made client-go list again)
    assert not relisted, [(ln['method'], ln['path'], ln['query'], ln.get('code'))
                          for ln in mgr.http(since)]

