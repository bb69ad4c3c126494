"""Real clients honour opgate's 429: kubectl (client-go) waits the advertised Retry-After.

client-go retries a 429 that carries an integer ``Retry-After`` after that many seconds (up to
ten times); a client in a tight loop would hammer opgate instead. This runs the real kubectl
through opgate against the real apiserver with a budget it must exceed, and reads opgate's
access log to see every rejected call retried no sooner than the advertised delay.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest

from proxy.envtest.cluster import LocalCluster

pytestmark = pytest.mark.e2e

NAMESPACE = "e2e-retry-after"
POLICY = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {name: slow-configmap-reads}
spec:
  rateLimits:
    - name: configmap-gets
      match: {verbs: [get], resources: [configmaps]}
      key: "{resource}"
      qps: 0.5
      burst: 1
"""


def _access_log(log: Path) -> list[dict[str, object]]:
    entries = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            entries.append(json.loads(line))
    return entries


def _when(entry: dict[str, object]) -> float:
    return datetime.fromisoformat(str(entry["time"]).replace("Z", "+00:00")).timestamp()


def test_kubectl_waits_for_retry_after(
    cluster: LocalCluster, kubectl: Path, opgate_factory: Callable[..., object],
    tmp_path: Path,
) -> None:
    cluster.create_namespace(NAMESPACE)
    names = [f"cm-{i}" for i in range(3)]
    for name in names:
        cluster.apply({"apiVersion": "v1", "kind": "ConfigMap",
                       "metadata": {"name": name, "namespace": NAMESPACE}, "data": {"k": name}})
    gate = opgate_factory(policies={"slow.yaml": POLICY})
    kubeconfig = cluster.write_kubeconfig(tmp_path / "via.kubeconfig", server=gate.url,  # type: ignore[attr-defined]
                                          token=cluster.admin_token, ca_file=cluster.ca_file)
    started = time.monotonic()
    out = subprocess.run(
        [str(kubectl), "--kubeconfig", str(kubeconfig), "-n", NAMESPACE, "get", "configmap",
         *names, "-o", "name"], capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"configmap/{n}" for n in names]
    # three gets at 0.5/s with a burst of 1: the second and third each wait ~2 s
    assert elapsed >= 3.0, f"kubectl finished in {elapsed:.1f}s: it did not wait"

    time.sleep(0.5)  # the access log line is written when the call ends
    gets = [e for e in _access_log(gate.log)  # type: ignore[attr-defined]
            if e.get("verb") == "get" and e.get("resource") == "configmaps"
            and e.get("namespace") == NAMESPACE]
    throttled = [e for e in gets if e["code"] == 429]
    admitted = [e for e in gets if e["code"] == 200]
    assert [e["name"] for e in admitted] == names
    assert throttled, "the budget was never exceeded: the test proves nothing"
    assert len(throttled) <= 2 * len(names), f"{len(throttled)} rejections: a tight loop"
    for rejected in throttled:
        after = [e for e in gets if e["name"] == rejected["name"] and _when(e) > _when(rejected)]
        assert after, f"{rejected['name']} was never retried"
        wait = _when(after[0]) - _when(rejected)
        assert wait >= 0.9, f"{rejected['name']} retried after {wait:.2f}s, before Retry-After"
