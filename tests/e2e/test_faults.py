"""Injected faults as a real client-go (tests/e2e/clientgo) reads them, through opgate to the real
kube-apiserver: the Status of each code decodes to the apierrors reason the apiserver's own
would (``AlreadyExists`` for a create's 409, ``TooManyRequests``, ``Timeout``,
``ServiceUnavailable``), and client-go
retries exactly the faults the apiserver would have it retry: a 429 (always with
``Retry-After``) and a 5xx given a ``retryAfter``, after that many seconds; a 5xx without one
reaches the caller at once (an outage, rehearsed). And where faults sit in the chain: after
identity, before rate limits and quota."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from proxy.envtest.cluster import LocalCluster
from tests.e2e.conftest import Opgate
from tests.e2e.test_clientgo import configmap, of, run
from tests.e2e.test_quota import wait_for

pytestmark = pytest.mark.e2e

NS, THROTTLED = "faults-e2e", "faults-e2e-throttled"
POLICY = f"""\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: faults-e2e}}
spec:
  faults:
    - name: timeouts
      match: {{verbs: [get], resources: [configmaps], namespaces: [{NS}]}}
      respond: {{code: 504, retryAfter: 1s}}
    - name: outage
      match: {{verbs: [list], resources: [configmaps], namespaces: [{NS}]}}
      respond: {{code: 503}}
    - name: create-conflicts
      match: {{verbs: [create], resources: [configmaps], namespaces: [{NS}]}}
      respond: {{code: 409}}
    - name: throttled
      match: {{verbs: [get], resources: [configmaps], namespaces: [{THROTTLED}]}}
      respond: {{code: 429}}
"""


@pytest.fixture(scope="module")
def kubeconfig(cluster: LocalCluster, opgate_factory: Callable[..., Opgate],
               tmp_path_factory: pytest.TempPathFactory) -> Path:
    for ns in (NS, THROTTLED):
        cluster.create_namespace(ns)
        cluster.apply(configmap(ns, "target", v="1"))
    gate = opgate_factory(policies={"faults.yaml": POLICY})
    return cluster.write_kubeconfig(tmp_path_factory.mktemp("faults") / "faults.kubeconfig",
                                    server=gate.url, token=cluster.admin_token,
                                    ca_file=cluster.ca_file)


@pytest.mark.parametrize(("ns", "code", "reason"), [
    (NS, 504, "Timeout"),
    (THROTTLED, 429, "TooManyRequests"),
], ids=["504-retryAfter", "429"])
def test_client_go_retries_a_fault_that_says_when(clientgo: Path, kubeconfig: Path, ns: str,
                                                  code: int, reason: str) -> None:
    started = time.monotonic()
    lines = run(clientgo, "get", kubeconfig, "--namespace", ns, "--name", "target",
                "--max-retries", "2")
    elapsed = time.monotonic() - started
    calls = of(lines, "http")
    assert [(c["code"], c["retryAfter"]) for c in calls] == [(code, "1")] * 3, calls
    assert elapsed >= 1.8, f"client-go retried after {elapsed:.1f}s in all, not Retry-After"
    (err,) = of(lines, "error")
    assert (err["code"], err["reason"], err["retryAfterSeconds"]) == (code, reason, 1), err


def test_a_5xx_without_retry_after_reaches_the_caller_at_once(clientgo: Path,
                                                              kubeconfig: Path) -> None:
    lines = run(clientgo, "list", kubeconfig, "--namespace", NS)
    calls = of(lines, "http")
    assert [(c["code"], c["retryAfter"]) for c in calls] == [(503, "")], calls
    (err,) = of(lines, "error")
    assert (err["code"], err["reason"]) == (503, "ServiceUnavailable"), err


def test_a_409_to_a_create_is_already_exists_to_client_go(clientgo: Path,
                                                         kubeconfig: Path) -> None:
    lines = run(clientgo, "create", kubeconfig, "--namespace", NS, "--name", "again")
    (err,) = of(lines, "error")
    assert (err["code"], err["reason"], err["conflict"]) == (409, "AlreadyExists", False), err


ORDER_NS = "faults-e2e-order"
ORDER_POLICY = f"""\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: order-e2e}}
spec:
  identity:
    issuers: [{{kubernetes: {{}}}}]
    allow: [{{group: "system:masters"}}]
    rules: [{{verbs: [get, list, watch, create, update, patch, delete], resources: ["*"]}}]
  faults:
    - name: update-conflicts
      match: {{verbs: [update], resources: [configmaps], namespaces: [{ORDER_NS}]}}
      respond: {{code: 409}}
  rateLimits:
    - name: one-write
      match: {{verbs: [create, update], resources: [configmaps], namespaces: [{ORDER_NS}]}}
      key: "{{user}}"
      qps: 0.001
      burst: 1
  quotas:
    - resources: [configmaps]
      namespaces: [{ORDER_NS}]
      max: 0
"""


def test_the_middlewares_run_identity_faults_rate_limits_then_quota(
        cluster: LocalCluster, opgate_factory: Callable[..., Opgate], tmp_path: Path) -> None:
    """The order README's policy section gives (DESIGN.md lists the concerns, not their order):
    an unauthenticated call is refused before a fault can answer it; an injected fault answers
    before the rate limiter counts the call (three faulted updates leave the one token of the
    bucket); a create takes that token before the quota refuses it, so the next create is
    throttled, not refused by the quota again."""
    cluster.create_namespace(ORDER_NS)
    token_file = tmp_path / "token"
    token_file.write_text(cluster.admin_token)
    gate = opgate_factory(policies={"order.yaml": ORDER_POLICY},
                          extra_args=["--token-file", str(token_file)])

    def synced() -> bool:
        _, body = gate.admin_get("/readyz?verbose")
        return any("quota-counts" in x and "configmaps=synced" in x for x in body.splitlines())

    wait_for("opgate's quota counts to sync", synced, timeout=30)
    cm = f"/api/v1/namespaces/{ORDER_NS}/configmaps"
    update = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}}

    def code(method: str, path: str, token: str | None = None) -> tuple[int, str]:
        resp = cluster.call(method, path, server=gate.url, body=update, token=token)
        return resp.status, resp.json().get("reason", "")

    assert code("PUT", f"{cm}/c", token="") == (401, "Unauthorized")
    assert [code("PUT", f"{cm}/c") for _ in range(3)] == [(409, "Conflict")] * 3
    assert code("POST", cm) == (403, "Forbidden")  # the bucket's token, then the quota
    assert code("POST", cm) == (429, "TooManyRequests")
