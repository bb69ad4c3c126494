"""The admin port's ``/metrics`` against the real apiserver, as a scraper reads it: calls of known
outcomes (the apiserver's 200/201/404, opgate's own 429 and quota 403, a watch) are counted
exactly once each under the documented names and labels, in the text format and in OpenMetrics
(Prometheus asks for it first), both read with prometheus_client's parsers; the gauges of calls
in flight and open watches go back to 0; the API port forwards ``/metrics`` and ``/readyz`` to
the apiserver."""

from __future__ import annotations

import http.client
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from proxy.envtest.cluster import LocalCluster
from tests.e2e.conftest import Opgate

pytestmark = pytest.mark.e2e

NS, QUOTA_NS = "metrics-e2e", "metrics-e2e-quota"
POLICY = f"""\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: e2e-metrics}}
spec:
  rateLimits:
    - name: creates
      match: {{verbs: [create], namespaces: [{NS}]}}
      key: "{{namespace}}"
      qps: 0.001
      burst: 2
  quotas:
    - resources: [configmaps]
      namespaces: [{QUOTA_NS}]
      max: 1
"""
# the labels DESIGN.md and the README name; none of them ever carries a name, user or key
LABELS = {
    "opgate_requests_total": {"verb", "group", "resource", "code", "decision"},
    "opgate_request_duration_seconds": {"verb"},
    "opgate_upstream_duration_seconds": {"verb"},
    "opgate_inflight_requests": set(),
    "opgate_watches_open": set(),
    "opgate_ratelimit_decisions_total": {"policy", "result"},
    "opgate_quota_denials_total": {"resource"},
    "opgate_quota_usage": {"namespace", "resource"},
    "opgate_policy_reloads_total": {"result"},
    "opgate_redis_errors_total": set(),
    "opgate_ratelimit_backend": {"backend"},
}


@pytest.fixture(scope="module")
def gate(cluster: LocalCluster, opgate_factory: Callable[..., Opgate],
         tmp_path_factory: pytest.TempPathFactory) -> Opgate:
    for namespace in (NS, QUOTA_NS):
        cluster.create_namespace(namespace)
    token = tmp_path_factory.mktemp("metrics") / "token"
    token.write_text(cluster.admin_token)
    token.chmod(0o600)
    gate = opgate_factory(policies={"metrics.yaml": POLICY}, tls=False,
                          extra_args=["--token-file", str(token)])
    deadline = time.monotonic() + 30
    while "configmaps=synced" not in gate.admin_get("/readyz?verbose")[1]:
        assert time.monotonic() < deadline, gate.admin_get("/readyz?verbose")[1]
        time.sleep(0.1)
    return gate


def scrape(gate: Opgate, accept: str = "") -> tuple[str, str]:
    req = urllib.request.Request(gate.admin_url + "/metrics",
                                 headers={"Accept": accept} if accept else {})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=10) as resp:
        return resp.headers["Content-Type"], resp.read().decode()


def samples(families: Any) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in families for s in family.samples}


def value(found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


def call(cluster: LocalCluster, gate: Opgate, method: str, path: str, body: Any = None) -> int:
    return cluster.call(method, path, body=body, server=gate.url, token="").status


def configmap(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}}


def test_each_call_is_counted_once_under_the_documented_labels(
        cluster: LocalCluster, gate: Opgate) -> None:
    made = [
        *(call(cluster, gate, "GET", f"/api/v1/namespaces/{NS}") for _ in range(3)),
        *(call(cluster, gate, "GET", f"/api/v1/namespaces/{NS}/configmaps/no-such-{i}")
          for i in range(2)),
        call(cluster, gate, "GET", f"/api/v1/namespaces/{NS}/no-such-resource"),
        *(call(cluster, gate, "POST", f"/api/v1/namespaces/{NS}/configmaps", configmap(f"m{i}"))
          for i in range(3)),
        call(cluster, gate, "GET", f"/api/v1/namespaces/{NS}/configmaps/no-such-2"),
        *(call(cluster, gate, "POST", f"/api/v1/namespaces/{QUOTA_NS}/configmaps",
               configmap(f"q{i}")) for i in range(2)),
        call(cluster, gate, "GET", f"/api/v1/namespaces/{NS}/configmaps?watch=1&timeoutSeconds=1"),
    ]
    assert made == [200] * 3 + [404] * 3 + [201, 201, 429, 404] + [201, 403] + [200]

    # a call is counted by the exit hooks, after its client has the answer; the quota's usage
    # comes from opgate's watch of configmaps: wait for both
    deadline = time.monotonic() + 15
    while True:
        content_type, text = scrape(gate)
        found = samples(text_string_to_metric_families(text))
        counted = sum(n for (name, _), n in found.items() if name == "opgate_requests_total")
        usage = value(found, "opgate_quota_usage", namespace=QUOTA_NS, resource="configmaps")
        if (counted, usage) == (len(made), 1) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert content_type.startswith("text/plain; version=")
    requests = {dict(labels)["verb"] + " " + dict(labels)["resource"] + " "
                + dict(labels)["code"] + " " + dict(labels)["decision"]: n
                for (name, labels), n in found.items() if name == "opgate_requests_total"}
    assert requests == {
        "get namespaces 200 allowed": 3,
        # a resource gets its own label once the apiserver has served it (README)
        "get other 404 allowed": 2, "list other 404 allowed": 1, "get configmaps 404 allowed": 1,
        "create configmaps 201 allowed": 3, "create configmaps 429 throttled": 1,
        "create configmaps 403 quota": 1, "watch configmaps 200 allowed": 1}
    # the watch is counted, not timed; opgate's own answers never went upstream
    assert value(found, "opgate_request_duration_seconds_count", verb="get") == 6
    assert value(found, "opgate_request_duration_seconds_count", verb="list") == 1
    assert value(found, "opgate_request_duration_seconds_count", verb="create") == 5
    assert value(found, "opgate_request_duration_seconds_count", verb="watch") == 0
    assert value(found, "opgate_upstream_duration_seconds_count", verb="get") == 6
    assert value(found, "opgate_upstream_duration_seconds_count", verb="list") == 1
    assert value(found, "opgate_upstream_duration_seconds_count", verb="create") == 3
    assert value(found, "opgate_upstream_duration_seconds_count", verb="watch") == 1
    assert value(found, "opgate_ratelimit_decisions_total", policy="e2e-metrics",
                 result="allowed") == 2
    assert value(found, "opgate_ratelimit_decisions_total", policy="e2e-metrics",
                 result="denied") == 1
    assert value(found, "opgate_quota_denials_total", resource="configmaps") == 1
    assert value(found, "opgate_quota_usage", namespace=QUOTA_NS, resource="configmaps") == 1
    assert value(found, "opgate_policy_reloads_total", result="success") == 1
    assert value(found, "opgate_inflight_requests") == 0
    assert value(found, "opgate_watches_open") == 0
    names = {"m0", "m1", "m2", "q0", "q1", "no-such-0", "no-such-1", "no-such-2",
             "no-such-resource"}
    for family in text_string_to_metric_families(text):
        if family.name in LABELS:
            for sample in family.samples:
                assert set(sample.labels) - {"le"} == LABELS[family.name], sample
                assert not names & set(sample.labels.values()), sample

    # what Prometheus asks for first: OpenMetrics, read by its own (stricter) parser
    content_type, text = scrape(
        gate, "application/openmetrics-text;version=1.0.0;q=0.6,text/plain;version=0.0.4;q=0.3")
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    assert samples(openmetrics_families(text)) == found


def test_an_open_watch_is_in_the_gauges_until_it_ends(cluster: LocalCluster,
                                                      gate: Opgate) -> None:
    def gauges() -> tuple[float, float]:
        found = samples(text_string_to_metric_families(scrape(gate)[1]))
        return (value(found, "opgate_inflight_requests"), value(found, "opgate_watches_open"))

    def until(want: tuple[float, float]) -> None:
        deadline = time.monotonic() + 15
        while gauges() != want:
            assert time.monotonic() < deadline, f"gauges {gauges()}, expected {want}"
            time.sleep(0.05)

    conn = http.client.HTTPConnection("127.0.0.1", gate.port, timeout=30)
    try:
        conn.request("GET", f"/api/v1/namespaces/{NS}/configmaps?watch=1")
        assert conn.getresponse().status == 200
        until((1, 1))
    finally:
        conn.close()  # the client goes away mid-stream
    until((0, 0))


def test_the_api_port_forwards_the_apiservers_own_paths(cluster: LocalCluster,
                                                         gate: Opgate) -> None:
    metrics = cluster.call("GET", "/metrics", server=gate.url, token="")
    assert metrics.status == 200
    assert b"apiserver_request_total" in metrics.body and b"opgate_" not in metrics.body
    verbose = cluster.call("GET", "/readyz?verbose&exclude=etcd", server=gate.url, token="")
    assert verbose.status == 200 and b"[+]etcd excluded: ok" in verbose.body
    assert call(cluster, gate, "GET", "/debug/policies") == 404  # the apiserver has none
    # and the admin's own /readyz excludes the same way
    code, body = gate.admin_get("/readyz?verbose&exclude=upstream")
    assert code == 200 and "[+]upstream excluded: ok" in body.splitlines()
