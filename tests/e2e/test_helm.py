"""The Helm chart, rendered by the real helm and accepted by the real apiserver.

``helm lint`` and ``helm template`` run the chart; the sidecar's rendered flags must parse with
opgate's own command line, its policies must pass ``opgate check``, and the manifests must be
accepted by kube-apiserver (server-side dry run through kubectl, so schemas are checked).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.cli import build_parser
from proxy.envtest.cluster import LocalCluster

pytestmark = pytest.mark.e2e

CHART = Path(__file__).resolve().parents[2] / "helm" / "opgate"


def _render(helm: Path, *sets: str) -> list[dict[str, Any]]:
    args = [str(helm), "template", "demo", str(CHART), "--namespace", "opgate-helm"]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _one(docs: list[dict[str, Any]], kind: str, suffix: str = "") -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    return doc


def _sidecar(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    [container] = [c for c in pod["containers"] if c["name"] == "opgate"]
    return container


def test_lint(helm: Path) -> None:
    out = subprocess.run([str(helm), "lint", str(CHART)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_sidecar_flags_are_opgates_own(helm: Path) -> None:
    sidecar = _sidecar(_render(helm))
    args = build_parser().parse_args(sidecar["args"])
    assert args.command == "serve"
    assert args.listen == "127.0.0.1:8001"  # the API port never leaves the pod
    assert args.token_file == "/var/run/secrets/kubernetes.io/serviceaccount/token"
    assert args.redis_url is None
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True


def test_redis_and_password_secret(helm: Path) -> None:
    docs = _render(helm, "redis.url=redis://redis:6379/0", "redis.replicas=3",
                   "redis.passwordSecret.name=redis-auth")
    sidecar = _sidecar(docs)
    args = build_parser().parse_args(sidecar["args"])
    assert args.redis_url == "redis://redis:6379/0"
    assert args.replicas == 3
    assert args.redis_password_file == "/etc/opgate/redis/password"
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    assert {"name": "opgate-redis", "secret": {"secretName": "redis-auth"}} in pod["volumes"]


def test_sidecar_rules_join_the_operators_cluster_role(helm: Path) -> None:
    plain = _one(_render(helm), "ClusterRole")["rules"]
    docs = _render(helm, "rbac.sidecarRules[0].apiGroups[0]=authentication.k8s.io",
                   "rbac.sidecarRules[0].resources[0]=tokenreviews",
                   "rbac.sidecarRules[0].verbs[0]=create")
    rules = _one(docs, "ClusterRole")["rules"]
    extra = {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
             "verbs": ["create"]}
    assert rules == [*plain, extra]  # the operator's own rules first, unchanged


def test_rendered_policies_are_valid(helm: Path, tmp_path: Path) -> None:
    policies = _one(_render(helm), "ConfigMap", "-policies")["data"]
    for name, text in policies.items():
        (tmp_path / name).write_text(text)
    out = subprocess.run([sys.executable, "-m", "proxy", "check", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_operator_kubeconfig_points_at_the_sidecar(helm: Path) -> None:
    docs = _render(helm)
    config = yaml.safe_load(_one(docs, "ConfigMap", "-kubeconfig")["data"]["config"])
    assert config["clusters"][0]["cluster"]["server"] == "http://127.0.0.1:8001"
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    [operator] = [c for c in pod["containers"] if c["name"] == "operator"]
    assert {"name": "KUBECONFIG", "value": "/etc/opgate/kubeconfig/config"} in operator["env"]


def test_apiserver_accepts_the_manifests(
    helm: Path, kubectl: Path, cluster: LocalCluster, tmp_path: Path
) -> None:
    cluster.create_namespace("opgate-helm")
    manifest = tmp_path / "chart.yaml"
    manifest.write_text(yaml.safe_dump_all(_render(helm, "redis.url=redis://r:6379/0")))
    out = subprocess.run(
        [str(kubectl), "--kubeconfig", cluster.kubeconfig_path, "apply", "--dry-run=server",
         "-n", "opgate-helm", "-f", str(manifest)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for kind in ("serviceaccount", "configmap", "deployment.apps", "service",
                 "clusterrole.rbac.authorization.k8s.io"):
        assert kind in out.stdout
