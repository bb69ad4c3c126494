"""Injected faults as a real client-go (tests/e2e/clientgo) reads them, through opgate to the real
kube-apiserver: the Status of each code decodes to the apierrors reason the apiserver's own
would (``AlreadyExists`` for a create's 409, ``TooManyRequests``, ``Timeout``,
``ServiceUnavailable``), and client-go
retries exactly the faults the apiserver would have it retry: a 429 (always with
``Retry-After``) and a 5xx given a ``retryAfter``, after that many seconds; a 5xx without one
reaches the caller at once (an outage, rehearsed)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from proxy.envtest.cluster import LocalCluster
from tests.e2e.conftest import Opgate
from tests.e2e.test_clientgo import configmap, of, run

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
