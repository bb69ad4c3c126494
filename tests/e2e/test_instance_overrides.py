"""``{instance}`` and ``instanceAnnotation`` against the real apiserver.

Two Widgets, one annotated ``opgate.dev/qps: "20"``; one rule ``key: "{instance}"``, qps 1,
burst 1, ``maxQps: 10``. Calls for the annotated Widget are admitted at ~10/s (its annotation,
bounded by maxQps), the other at 1/s; a changed annotation is followed within seconds through
opgate's watch, and the apiserver's own request counters show that opgate never GETs (nor
relists) a Widget while serving those calls. A ConfigMap created with a controller
ownerReference and no header counts against its Widget's bucket, and so does a call for the
Widget itself. A throttled Widget whose annotation is raised goes on at its new rate at once
(not when the debt of the old rate has cleared), and its deletion restores the rule's qps.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.envtest.cluster import LocalCluster
from tests.e2e.conftest import Opgate

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "instance-e2e"
WIDGETS = f"/apis/demo.opgate.dev/v1/namespaces/{NAMESPACE}/widgets"
CONFIGMAPS = f"/api/v1/namespaces/{NAMESPACE}/configmaps"
ANNOTATION = "opgate.dev/qps"
POLICY = f"""\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: e2e-instances}}
spec:
  mode: enforce
  rateLimits:
    - name: per-instance
      match: {{namespaces: [{NAMESPACE}], resources: [configmaps, widgets]}}
      key: "{{instance}}"
      qps: 1
      burst: 1
      instanceAnnotation: {ANNOTATION}
      maxQps: 10
"""


@pytest.fixture(scope="module")
def gate(cluster: LocalCluster, opgate_factory: Callable[..., Opgate],
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Opgate]:
    cluster.install_crd((REPO / "examples" / "reconciler" / "widget-crd.yaml").read_text())
    cluster.create_namespace(NAMESPACE)
    for name, notes in (("fast", {ANNOTATION: "20"}), ("slow", {}), ("owner", {}),
                        ("raised", {ANNOTATION: "0.1"})):
        cluster.apply({"apiVersion": "demo.opgate.dev/v1", "kind": "Widget",
                       "metadata": {"name": name, "namespace": NAMESPACE,
                                    "annotations": notes},
                       "spec": {"color": "red"}})
    token = tmp_path_factory.mktemp("instance") / "token"
    token.write_text(cluster.admin_token + "\n")
    token.chmod(0o600)
    # the informer watches with opgate's own upstream credentials (the sidecar's ServiceAccount)
    yield opgate_factory(policies={"instances.yaml": POLICY},
                         extra_args=["--token-file", str(token)])
    # other modules (the sample operator's) count Widgets and owned ConfigMaps cluster-wide
    for path in (WIDGETS, CONFIGMAPS):
        cluster.call("DELETE", path).ok()


class Client:
    """Calls through opgate as fast as one keep-alive connection allows, counting outcomes."""

    def __init__(self, cluster: LocalCluster, gate: Opgate) -> None:
        self.cluster, self.gate = cluster, gate
        self.ssl = ssl.create_default_context(cafile=cluster.ca_file)
        self.auth = {"Authorization": f"Bearer {cluster.admin_token}"}

    def admitted(self, seconds: float, *, instance: str = "", path: str = CONFIGMAPS + "?limit=1",
                 ) -> int:
        """Calls admitted (not 429) while calling for ``seconds``."""
        headers = dict(self.auth, **({"Opgate-Instance": instance} if instance else {}))

        async def run() -> int:
            ok = 0
            connector = aiohttp.TCPConnector(ssl=self.ssl, limit=1)
            async with aiohttp.ClientSession(connector=connector) as s:
                loop = asyncio.get_running_loop()
                end = loop.time() + seconds
                while loop.time() < end:
                    async with s.get(self.gate.url + path, headers=headers) as r:
                        body = await r.read()
                        assert r.status in (200, 429), (r.status, body[:300])
                        ok += r.status == 200
            return ok

        return asyncio.run(run())

    def until(self, accept: Callable[[int], bool], *, instance: str, timeout: float) -> int:
        """Measure 1 s windows until ``accept(admitted)``; fail after ``timeout``."""
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            seen.append(self.admitted(1.0, instance=instance))
            if accept(seen[-1]):
                return seen[-1]
        pytest.fail(f"admitted per second stayed {seen}; opgate log:\n{self.gate.log_tail()}")

    def call(self, method: str, path: str, *, body: Any = None,
             instance: str = "") -> tuple[int, dict[str, Any]]:
        headers = {"Opgate-Instance": instance} if instance else {}
        resp = self.cluster.call(method, path, body=body, headers=headers, server=self.gate.url)
        return resp.status, resp.json()


def widget_requests(cluster: LocalCluster) -> dict[str, float]:
    """The apiserver's own ``apiserver_request_total`` for widgets, summed per verb."""
    text = cluster.call("GET", "/metrics").ok().body.decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{") or 'resource="widgets"' not in line:
            continue
        verb = re.search(r'verb="([A-Z]+)"', line)
        if verb and 'group="demo.opgate.dev"' in line and 'subresource=""' in line:
            totals[verb.group(1)] = totals.get(verb.group(1), 0) + float(line.rsplit(" ", 1)[1])
    return totals


def test_annotation_sets_the_instance_rate_and_follows_changes_without_gets(
    cluster: LocalCluster, gate: Opgate,
) -> None:
    client = Client(cluster, gate)
    fast, slow = f"{NAMESPACE}/Widget/fast", f"{NAMESPACE}/Widget/slow"
    # the first call naming Widget makes opgate discover and watch widgets: then ~10/s
    client.until(lambda n: n >= 7, instance=fast, timeout=30)
    before = widget_requests(cluster)

    fast_admitted = client.admitted(2.0, instance=fast)
    slow_admitted = client.admitted(2.0, instance=slow)
    assert 14 <= fast_admitted <= 26, fast_admitted  # 20 asked for, bounded by maxQps 10
    assert 1 <= slow_admitted <= 4, slow_admitted  # no annotation: the rule's 1/s

    cluster.call("PATCH", f"{WIDGETS}/fast", body={"metadata": {"annotations": {ANNOTATION: "2"}}},
                 content_type="application/merge-patch+json").ok()
    client.until(lambda n: n <= 4, instance=fast, timeout=10)
    lowered = client.admitted(3.0, instance=fast)
    assert 4 <= lowered <= 9, lowered  # ~2/s: 1 + 2 * 3

    after = widget_requests(cluster)
    calls = fast_admitted + slow_admitted + lowered
    assert after.get("GET", 0) == before.get("GET", 0), (before, after, calls)
    assert after.get("LIST", 0) == before.get("LIST", 0), (before, after)


def test_a_throttled_instance_whose_qps_is_raised_is_let_on_and_its_deletion_restores_the_rule(
    cluster: LocalCluster, gate: Opgate,
) -> None:
    """A Widget at 0.1/s has used its token (the next is 10 s away); its owner raises the
    annotation to 10: calls must go on at the new rate within a couple of seconds, not once
    the 10 s debt of the old rate has cleared. Deleting the Widget restores the rule's 1/s."""
    client = Client(cluster, gate)
    raised = f"{NAMESPACE}/Widget/raised"
    client.until(lambda n: n == 0, instance=raised, timeout=30)  # watched: 0.1/s applies
    deadline = time.monotonic() + 15
    while client.call("GET", CONFIGMAPS + "?limit=1", instance=raised)[0] != 200:
        assert time.monotonic() < deadline, gate.log_tail()
        time.sleep(0.2)
    code, status = client.call("GET", CONFIGMAPS + "?limit=1", instance=raised)
    assert code == 429 and status["details"]["retryAfterSeconds"] >= 9, status

    cluster.call("PATCH", f"{WIDGETS}/raised",
                 body={"metadata": {"annotations": {ANNOTATION: "10"}}},
                 content_type="application/merge-patch+json").ok()
    client.until(lambda n: n >= 5, instance=raised, timeout=5)

    cluster.call("DELETE", f"{WIDGETS}/raised").ok()
    client.until(lambda n: n <= 2, instance=raised, timeout=10)  # the rule's plain 1/s
    assert 1 <= client.admitted(2.0, instance=raised) <= 4


def test_owner_reference_and_the_object_itself_count_against_the_widget(
    cluster: LocalCluster, gate: Opgate,
) -> None:
    client = Client(cluster, gate)
    owner = f"{NAMESPACE}/Widget/owner"
    uid = cluster.call("GET", f"{WIDGETS}/owner").ok().json()["metadata"]["uid"]

    def configmap(*, owned: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": f"cm-{uuid.uuid4().hex[:8]}"}
        if owned:
            meta["ownerReferences"] = [{"apiVersion": "demo.opgate.dev/v1", "kind": "Widget",
                                        "name": "owner", "uid": uid, "controller": True}]
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"k": "v"}}

    # exhaust the Widget's bucket (1/s, burst 1) through the header
    statuses = [client.call("GET", CONFIGMAPS + "?limit=1", instance=owner)[0] for _ in range(3)]
    assert 429 in statuses, statuses
    code, status = client.call("POST", CONFIGMAPS, body=configmap(owned=True))
    assert code == 429, status
    assert 'rate limit "per-instance"' in status["message"]
    code, _ = client.call("POST", CONFIGMAPS, body=configmap(owned=False))  # "-": its own bucket
    assert code == 201

    time.sleep(1.2)  # the Widget's bucket refills; the owned create now takes it
    code, status = client.call("POST", CONFIGMAPS, body=configmap(owned=True))
    assert code == 201, status
    code, _ = client.call("GET", CONFIGMAPS + "?limit=1", instance=owner)
    assert code == 429

    # a call for the Widget itself (no header) is that Widget's too, once widgets are watched
    deadline = time.monotonic() + 15
    while True:
        time.sleep(1.2)
        assert client.call("GET", CONFIGMAPS + "?limit=1", instance=owner)[0] == 200
        code, _ = client.call("GET", f"{WIDGETS}/owner")
        if code == 429:
            break
        assert code == 200
        assert time.monotonic() < deadline, gate.log_tail()


def test_an_annotation_that_is_not_a_qps_is_warned_of_and_a_recreated_widget_gets_its_own(
    cluster: LocalCluster, gate: Opgate,
) -> None:
    """A Widget annotated ``opgate.dev/qps: "0"`` (its author hoping to pause it) gets the
    rule's 1/s, and opgate's log says why, naming it; deleted and created again under the same
    name with ``"10"``, it gets 10/s through the same watch."""
    client = Client(cluster, gate)
    widget = {"apiVersion": "demo.opgate.dev/v1", "kind": "Widget",
              "metadata": {"name": "paused", "namespace": NAMESPACE,
                           "annotations": {ANNOTATION: "0"}}, "spec": {"color": "red"}}
    cluster.call("POST", WIDGETS, body=widget).ok()
    paused = f"{NAMESPACE}/Widget/paused"
    warning = (f'informer: Widget {NAMESPACE}/paused: annotation {ANNOTATION} "0" is not a qps '
               "(a number of at least 1e-09); its calls get the rule's qps")
    client.until(lambda n: n <= 2, instance=paused, timeout=30)
    deadline = time.monotonic() + 10
    while warning not in gate.log.read_text(errors="replace"):
        assert time.monotonic() < deadline, gate.log_tail()
        time.sleep(0.1)
    assert 1 <= client.admitted(2.0, instance=paused) <= 4

    cluster.call("DELETE", f"{WIDGETS}/paused").ok()
    widget["metadata"]["annotations"] = {ANNOTATION: "10"}
    cluster.call("POST", WIDGETS, body=widget).ok()
    client.until(lambda n: n >= 7, instance=paused, timeout=10)
