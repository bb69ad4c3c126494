"""The Helm chart, rendered by the real helm and accepted by the real apiserver.

``helm lint`` and ``helm template`` run the chart; the sidecar's rendered flags must parse with
opgate's own command line, its policies must pass ``opgate check``, and the manifests must be
accepted by kube-apiserver (server-side dry run through kubectl, so schemas are checked).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.cli_parser import build_parser
from proxy.envtest.cluster import LocalCluster
from proxy.stores import REDIS_SCHEMES

pytestmark = pytest.mark.e2e

CHART = Path(__file__).resolve().parents[2] / "helm" / "opgate"


def _helm_template(helm: Path, sets: tuple[str, ...], release: str, chart: Path,
                   strings: tuple[str, ...] = (), kube_version: str = ""
                   ) -> subprocess.CompletedProcess[str]:
    args = [str(helm), "template", release, str(chart), "--namespace", "opgate-helm"]
    if kube_version:  # .Capabilities.KubeVersion; without it, the one helm was built for
        args += ["--kube-version", kube_version]
    for s in sets:
        args += ["--set", s]
    for s in strings:  # --set-string: an env value such as "2" stays a string
        args += ["--set-string", s]
    return subprocess.run(args, capture_output=True, text=True)


def _render(helm: Path, *sets: str, release: str = "demo", chart: Path = CHART,
            kube_version: str = "") -> list[dict[str, Any]]:
    out = _helm_template(helm, sets, release, chart, kube_version=kube_version)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _render_error(helm: Path, *sets: str, strings: tuple[str, ...] = ()) -> str:
    """helm template must refuse these values; its error message."""
    out = _helm_template(helm, sets, "demo", CHART, strings)
    assert out.returncode != 0, out.stdout
    return out.stderr


def _dry_run(kubectl: Path, cluster: LocalCluster, tmp_path: Path,
             docs: list[dict[str, Any]], *output: str) -> str:
    """``kubectl apply --dry-run=server``: the apiserver validates the manifests; its output
    (``output``: e.g. ``-o``, ``json`` for the objects as the apiserver would store them)."""
    cluster.create_namespace("opgate-helm")
    manifest = tmp_path / "chart.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    out = subprocess.run(
        [str(kubectl), "--kubeconfig", cluster.kubeconfig_path, "apply", "--dry-run=server",
         "-n", "opgate-helm", "-f", str(manifest), *output], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _one(docs: list[dict[str, Any]], kind: str, suffix: str = "") -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    return doc


def _sidecar(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    [container] = [c for c in pod["containers"] if c["name"] == "opgate"]
    return container


def test_lint(helm: Path) -> None:
    out = subprocess.run([str(helm), "lint", "--strict", str(CHART)], capture_output=True,
                         text=True)
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


def test_sidecar_sigterm_waits_for_the_operator_to_stop(helm: Path) -> None:
    """kubelet signals every container at once: a preStop sleep keeps opgate serving while the
    operator makes its last calls (lease release), within the pod's grace period."""
    docs = _render(helm)
    sidecar = _sidecar(docs)
    assert sidecar["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    drain = build_parser().parse_args(sidecar["args"]).shutdown_grace
    assert drain == 10
    grace = _one(docs, "Deployment")["spec"]["template"]["spec"].get(
        "terminationGracePeriodSeconds", 30)
    assert grace >= 5 + drain + 5  # the delay, opgate's drain, slack for the operator
    assert grace == 30
    shorter = _sidecar(_render(helm, "sidecar.shutdownGraceSeconds=3"))
    assert build_parser().parse_args(shorter["args"]).shutdown_grace == 3
    assert "lifecycle" not in _sidecar(_render(helm, "sidecar.shutdownDelaySeconds=0"))


def test_redis_and_password_secret(helm: Path) -> None:
    docs = _render(helm, "redis.url=redis://redis:6379/0", "redis.replicas=3",
                   "redis.passwordSecret.name=redis-auth")
    sidecar = _sidecar(docs)
    args = build_parser().parse_args(sidecar["args"])
    assert args.redis_url == "redis://redis:6379/0"
    assert args.replicas == 3
    assert args.redis_password_file == "/etc/opgate/redis/password"
    # by default the replicas that share the budgets are the operator's (each admits
    # qps/replicas while Redis is away: with 1, three replicas admitted three times the qps)
    scaled = _sidecar(_render(helm, "redis.url=redis://redis:6379/0", "operator.replicas=3"))
    assert build_parser().parse_args(scaled["args"]).replicas == 3
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    assert {"name": "opgate-redis", "secret": {"secretName": "redis-auth"}} in pod["volumes"]


def test_a_redis_password_without_redis_is_refused(helm: Path) -> None:
    err = _render_error(helm, "redis.passwordSecret.name=redis-auth")
    assert "redis.passwordSecret.name" in err and "redis.url" in err, err


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
    out = _dry_run(kubectl, cluster, tmp_path, _render(helm, "redis.url=redis://r:6379/0"))
    for kind in ("serviceaccount", "configmap", "deployment.apps", "service",
                 "clusterrole.rbac.authorization.k8s.io"):
        assert kind in out


# ---- a parent chart that lists opgate as a dependency ------------------------------------------

PARENT_DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata: {name: {{ .Release.Name }}-controller}
spec:
  selector: {matchLabels: {app: controller}}
  template:
    metadata: {labels: {app: controller}}
    spec:
      containers:
        - name: controller
          image: example.com/controller:1.0
        {{- include "opgate.sidecar" . | nindent 8 }}
      volumes:
        {{- include "opgate.volumes" . | nindent 8 }}
"""


def _parent_chart(helm: Path, tmp_path: Path, values: str = "",
                  deployment: str = PARENT_DEPLOYMENT) -> Path:
    """A chart of its own (appVersion 9.9.9) with opgate as a ``file://`` dependency."""
    parent = tmp_path / "parent"
    (parent / "templates").mkdir(parents=True)
    (parent / "Chart.yaml").write_text(
        "apiVersion: v2\nname: parent\nversion: 1.0.0\nappVersion: \"9.9.9\"\n"
        f"dependencies:\n  - name: opgate\n    version: 0.1.0\n    repository: file://{CHART}\n")
    (parent / "values.yaml").write_text("opgate:\n  operator: {enabled: false}\n" + values)
    (parent / "templates" / "deployment.yaml").write_text(deployment)
    subprocess.run([str(helm), "dependency", "build", str(parent)], check=True,
                   capture_output=True, text=True)
    return parent


def test_a_parent_chart_injects_the_sidecar(
    helm: Path, kubectl: Path, cluster: LocalCluster, tmp_path: Path
) -> None:
    parent = _parent_chart(helm, tmp_path, "  redis: {url: redis://r:6379/0}\n")
    docs = _render(helm, "opgate.sidecar.logLevel=debug", release="shop", chart=parent)
    # operator.enabled=false: only the parent's Deployment, and opgate's policies for it
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == [
        ("ConfigMap", "shop-opgate-policies"), ("Deployment", "shop-controller")]
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    [sidecar] = [c for c in pod["containers"] if c["name"] == "opgate"]
    assert sidecar["image"] == "ghcr.io/opgate/opgate:0.1.0"  # opgate's appVersion, not 9.9.9
    args = build_parser().parse_args(sidecar["args"])
    assert (args.log_level, args.redis_url) == ("debug", "redis://r:6379/0")
    assert {"name": "opgate-policies", "configMap": {"name": "shop-opgate-policies"}} in (
        pod["volumes"])
    _dry_run(kubectl, cluster, tmp_path, docs)


def test_operator_disabled_leaves_only_the_policies(helm: Path) -> None:
    docs = _render(helm, "operator.enabled=false")
    assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [
        ("ConfigMap", "demo-opgate-policies")]


def test_no_policies_no_policy_mount(
    helm: Path, kubectl: Path, cluster: LocalCluster, tmp_path: Path,
) -> None:
    """Without policies the sidecar runs without --policies: an empty policy directory would
    stop it at start (opgate refuses one), so nothing is mounted."""
    docs = _render(helm, "policies.operator\\.yaml=null")
    assert not [d for d in docs if d["metadata"]["name"].endswith("-policies")]
    sidecar = _sidecar(docs)
    assert build_parser().parse_args(sidecar["args"]).policies is None
    assert "/etc/opgate/policies" not in [m["mountPath"] for m in sidecar["volumeMounts"]]
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    assert "opgate-policies" not in [v["name"] for v in pod["volumes"]]
    _dry_run(kubectl, cluster, tmp_path, docs)


@pytest.mark.parametrize("listen", ["0.0.0.0:9500", "[::]:9500"])
def test_admin_port_follows_admin_listen(helm: Path, listen: str) -> None:
    docs = _render(helm, f"sidecar.adminListen={listen}")
    sidecar = _sidecar(docs)
    assert build_parser().parse_args(sidecar["args"]).admin_listen == listen
    assert sidecar["ports"] == [{"name": "admin", "containerPort": 9500, "protocol": "TCP"}]
    pod = _one(docs, "Deployment")["spec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9500"
    assert _one(docs, "Service", "-metrics")["spec"]["ports"][0]["port"] == 9500


def test_a_stale_admin_port_is_refused(helm: Path) -> None:
    # the same port in both is fine (values files written for the old chart)
    _render(helm, "sidecar.adminListen=0.0.0.0:9500", "sidecar.adminPort=9500")
    err = _render_error(helm, "sidecar.adminListen=0.0.0.0:9500", "sidecar.adminPort=9091")
    assert "sidecar.adminPort" in err and "sidecar.adminListen" in err
    err = _render_error(helm, "sidecar.adminListen=unix:/run/opgate/admin.sock")
    assert "adminListen" in err  # the probes need a TCP port


def _mounts(container: dict[str, Any]) -> dict[str, str]:
    """mountPath -> volume name; a path mounted twice fails here (the apiserver refuses it)."""
    paths = [m["mountPath"] for m in container["volumeMounts"]]
    assert len(paths) == len(set(paths)), paths
    return {m["mountPath"]: m["name"] for m in container["volumeMounts"]}


def test_workers_get_a_writable_tmp(helm: Path) -> None:
    # --workers N > 1 keeps its sockets in a temporary directory; the root filesystem is read-only
    docs = _render(helm, "redis.url=redis://r:6379/0", "sidecar.extraArgs={--workers,2}")
    sidecar = _sidecar(docs)
    assert build_parser().parse_args(sidecar["args"]).workers == 2
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True
    assert _mounts(sidecar)["/tmp"] == "opgate-tmp"
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    assert {"name": "opgate-tmp", "emptyDir": {"sizeLimit": "16Mi"}} in pod["volumes"]


def test_audit_and_capture_share_a_directory(
    helm: Path, kubectl: Path, cluster: LocalCluster, tmp_path: Path
) -> None:
    docs = _render(helm, "sidecar.audit.enabled=true", "sidecar.capture.enabled=true",
                   "sidecar.capture.path=/var/log/opgate/capture.flows",
                   "sidecar.audit.sizeLimit=1200Mi")  # both files' 600Mi
    sidecar = _sidecar(docs)
    args = build_parser().parse_args(sidecar["args"])
    assert (args.audit_log, args.capture) == ("/var/log/opgate/audit.log",
                                              "/var/log/opgate/capture.flows")
    assert _mounts(sidecar)["/var/log/opgate"] == "opgate-audit"  # one volume holds both files
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"] if v["name"].startswith("opgate-capture")] == []
    _dry_run(kubectl, cluster, tmp_path, docs)
    # apart, each has its own volume, as before
    sidecar = _sidecar(_render(helm, "sidecar.audit.enabled=true", "sidecar.capture.enabled=true"))
    assert _mounts(sidecar)["/var/log/opgate-capture"] == "opgate-capture"


@pytest.mark.parametrize(("sets", "says"), [
    (("sidecar.audit.enabled=true", "sidecar.audit.maxSizeMB=500"),
     "sidecar.audit.sizeLimit=1Gi is less than (5 + 1) x 500Mi x 1 worker = 3000Mi"),
    (("sidecar.capture.enabled=true", "sidecar.capture.sizeLimit=512Mi"),
     "sidecar.capture.sizeLimit=512Mi is less than (5 + 1) x 100Mi x 1 worker = 600Mi"),
    (("sidecar.audit.enabled=true", "redis.url=redis://r:6379/0",
      "sidecar.extraArgs={--workers,2}"),
     "sidecar.audit.sizeLimit=1Gi is less than (5 + 1) x 100Mi x 2 workers = 1200Mi"),
    (("sidecar.capture.enabled=true", "redis.url=redis://r:6379/0",
      "sidecar.env[0].name=OPGATE_WORKERS", "sidecar.env[0].value=3",
      "sidecar.capture.sizeLimit=1800M"),
     "sidecar.capture.sizeLimit=1800M is less than (5 + 1) x 100Mi x 3 workers = 1800Mi"),
    # auto: one worker per CPU of limits.cpu, rounded up
    (("sidecar.audit.enabled=true", "redis.url=redis://r:6379/0",
      "sidecar.extraArgs={--workers,auto}", "sidecar.resources.limits.cpu=1500m"),
     "sidecar.audit.sizeLimit=1Gi is less than (5 + 1) x 100Mi x 2 workers = 1200Mi"),
    # one volume for both files: the audit log's sizeLimit holds the two
    (("sidecar.audit.enabled=true", "sidecar.capture.enabled=true",
      "sidecar.capture.path=/var/log/opgate/capture.flows"),
     "sidecar.audit.sizeLimit=1Gi is less than the audit log's (5 + 1) x 100Mi x 1 worker + "
     "the capture's (5 + 1) x 100Mi x 1 worker = 1200Mi"),
])
def test_a_log_volume_its_rotated_files_would_outgrow_is_refused(
    helm: Path, sets: tuple[str, ...], says: str
) -> None:
    """Kubelet evicts the pod (the operator with it) once an emptyDir passes its sizeLimit, and
    a rotated file takes (maxBackups + 1) x maxSizeMB per worker: the 1Gi default held one
    worker's audit log, not two workers' (each rotates its own file), nor the audit log and
    the capture in one directory. values.yaml and the README said so; the chart rendered it."""
    strings = tuple(s for s in sets if s.startswith("sidecar.env"))
    err = _render_error(helm, *(s for s in sets if s not in strings), strings=strings)
    assert says in err and "evict" in err, err


@pytest.mark.parametrize("sets", [
    ("sidecar.audit.enabled=true", "sidecar.capture.enabled=true"),  # the defaults, apart
    ("sidecar.audit.enabled=true", "sidecar.audit.maxSizeMB=0"),  # never rotated: unbounded
    ("sidecar.audit.enabled=true", "sidecar.audit.maxBackups=0"),  # every backup kept
    ("sidecar.audit.enabled=true", "sidecar.audit.path=-"),  # stdout: no volume
    ("sidecar.audit.enabled=true", "sidecar.audit.sizeLimit=1200Mi",
     "redis.url=redis://r:6379/0", "sidecar.extraArgs={--workers,2}"),
    ("sidecar.audit.enabled=true", "sidecar.audit.sizeLimit=1258291200",  # bytes: 1200Mi
     "redis.url=redis://r:6379/0", "sidecar.extraArgs={--workers=2}"),
    ("sidecar.capture.enabled=true", "sidecar.capture.sizeLimit=0.6Gi"),
    ("sidecar.capture.enabled=true", "sidecar.capture.sizeLimit=1e9"),
    ("sidecar.audit.enabled=true", "sidecar.capture.enabled=true",
     "sidecar.capture.path=/var/log/opgate/capture.flows", "sidecar.audit.sizeLimit=2Gi"),
])
def test_a_log_volume_that_holds_its_rotated_files_renders(
    helm: Path, sets: tuple[str, ...]
) -> None:
    _render(helm, *sets)


def test_a_capture_on_another_mount_is_refused(helm: Path) -> None:
    err = _render_error(helm, "sidecar.capture.enabled=true",
                        "sidecar.capture.path=/tmp/capture.flows")
    assert "/tmp" in err and "sidecar.capture.path" in err


def test_extra_volumes_for_another_token_file(
    helm: Path, kubectl: Path, cluster: LocalCluster, tmp_path: Path
) -> None:
    docs = _render(
        helm, "sidecar.tokenFile=/var/run/secrets/opgate/token",
        "extraVolumes[0].name=opgate-token",
        "extraVolumes[0].projected.sources[0].serviceAccountToken.path=token",
        "extraVolumes[0].projected.sources[0].serviceAccountToken.expirationSeconds=3600",
        "sidecar.extraVolumeMounts[0].name=opgate-token",
        "sidecar.extraVolumeMounts[0].mountPath=/var/run/secrets/opgate",
        "sidecar.extraVolumeMounts[0].readOnly=true")
    sidecar = _sidecar(docs)
    assert build_parser().parse_args(sidecar["args"]).token_file == (
        "/var/run/secrets/opgate/token")
    assert _mounts(sidecar)["/var/run/secrets/opgate"] == "opgate-token"
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    assert "opgate-token" in [v["name"] for v in pod["volumes"]]
    _dry_run(kubectl, cluster, tmp_path, docs)


@pytest.mark.parametrize("length", [49, 53])  # 53: the longest release name helm accepts
def test_long_release_names_fit(
    helm: Path, kubectl: Path, cluster: LocalCluster, tmp_path: Path, length: int
) -> None:
    docs = _render(helm, release="r" * length)
    # (the ClusterRole and its binding carry the namespace too: a path segment name, up to 253)
    names = [d["metadata"]["name"] for d in docs if not d["kind"].startswith("Cluster")]
    assert all(len(n) <= 63 and not n.endswith("-") for n in names), names
    for kind, suffix in (("Service", "-metrics"), ("ConfigMap", "-policies"),
                         ("ConfigMap", "-kubeconfig")):
        _one(docs, kind, suffix)  # each keeps its suffix
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    assert {v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v} == {
        _one(docs, "ConfigMap", "-policies")["metadata"]["name"],
        _one(docs, "ConfigMap", "-kubeconfig")["metadata"]["name"]}
    _dry_run(kubectl, cluster, tmp_path, docs)


def _operator(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    [container] = [c for c in pod["containers"] if c["name"] == "operator"]
    return container


def test_operator_args_follow_the_kubeconfig(helm: Path) -> None:
    from examples.reconciler.__main__ import parse_args

    operator = _operator(_render(helm))  # the kubeconfig comes by $KUBECONFIG
    assert parse_args(operator["args"]).all_namespaces
    assert {"name": "KUBECONFIG", "value": "/etc/opgate/kubeconfig/config"} in operator["env"]
    docs = _render(helm, "operator.kubeconfig=false")
    operator = _operator(docs)
    assert "/etc/opgate/kubeconfig/config" not in str(operator)
    assert parse_args(operator["args"]).kubeconfig is None
    assert [d for d in docs if d["metadata"]["name"].endswith("-kubeconfig")] == []
    err = _render_error(helm, "operator.kubeconfig=false",
                        "operator.args={--kubeconfig,/etc/opgate/kubeconfig/config}")
    assert "operator.kubeconfig" in err and "operator.args" in err


def test_a_unix_socket_listener_needs_no_kubeconfig(helm: Path) -> None:
    # client-go cannot dial a Unix socket: a kubeconfig for it would be unusable
    mounted = ("extraVolumes[0].name=sock", "extraVolumes[0].emptyDir.medium=Memory",
               "sidecar.extraVolumeMounts[0].name=sock",
               "sidecar.extraVolumeMounts[0].mountPath=/run/opgate")
    err = _render_error(helm, "sidecar.listen=unix:/run/opgate/api.sock", *mounted)
    assert "sidecar.listen" in err and "operator.kubeconfig" in err
    docs = _render(helm, "sidecar.listen=unix:/run/opgate/api.sock", "operator.kubeconfig=false",
                   *mounted)
    assert build_parser().parse_args(_sidecar(docs)["args"]).listen == "unix:/run/opgate/api.sock"


def test_a_shared_socket_directory(
    helm: Path, kubectl: Path, cluster: LocalCluster, tmp_path: Path
) -> None:
    docs = _render(helm, "sidecar.listen=unix:/run/opgate/api.sock", "operator.kubeconfig=false",
                   "operator.args={--all-namespaces}", "extraVolumes[0].name=sock",
                   "extraVolumes[0].emptyDir.medium=Memory",
                   "sidecar.extraVolumeMounts[0].name=sock",
                   "sidecar.extraVolumeMounts[0].mountPath=/run/opgate",
                   "operator.extraVolumeMounts[0].name=sock",
                   "operator.extraVolumeMounts[0].mountPath=/run/opgate")
    assert _mounts(_sidecar(docs))["/run/opgate"] == "sock"
    assert _mounts(_operator(docs)) == {"/run/opgate": "sock"}
    _dry_run(kubectl, cluster, tmp_path, docs)


@pytest.mark.parametrize("setting", [
    "sidecar.headerTimeout=30s",
    "sidecar.logLevel=loud",
    "operator.replicas=-1",
    "sidecar.audit.maxSizeMB=-5",
    "sidecar.capture.maxBackups=many",
    "sidecar.audit.path=audit.log",
    "sidecar.audit.path=/audit.log",  # an emptyDir mounted at / (the container cannot start)
    "sidecar.capture.path=/capture.flows",
    "sidecar.capture.path=/var/log/",
    "sidecar.audit.sizeLimit=lots",
    "redis.replicas=0",
    "redis.url=localhost:6379",
    "image.pullPolicy=Sometimes",
    "operator.kubeconfig=maybe",
    "sidecar.accessLog=yes please",
    # a misspelt key is refused, not silently ignored
    "sidecar.logLevl=debug",
    "sidecar.audit.maxSize=5",
    "sidecar.capture.maxBackup=2",
    "redis.passwordSecret.nam=redis-auth",
    "redis.passwordSecret.key=../password",  # not a Secret key: no such file in the mount
    "redis.passwordSecret.key=",
    "operator.replica=2",
    "image.tags=1.2",
    "serviceAccount.nam=ops",
    "rbac.creat=false",
    "metrics.podAnnotation=false",
    "sidecar.native=yes",  # true, false or auto
])
def test_the_schema_refuses_bad_values(helm: Path, setting: str) -> None:
    err = _render_error(helm, setting)
    key = setting.split("=")[0].rsplit(".", 1)[-1]
    assert "values don't meet the specifications of the schema" in err and key in err, err


@pytest.mark.parametrize("env", ["sidecar.env", "operator.env"])
def test_an_env_value_must_be_a_string(helm: Path, env: str) -> None:
    """``--set env[0].value=1`` is an integer, which the apiserver refuses in an EnvVar (a
    BadRequest at install); the schema says so first, naming the value."""
    for value in ("1", "true"):
        err = _render_error(helm, f"{env}[0].name=N", f"{env}[0].value={value}")
        assert "schema" in err and "/env/0/value" in err, err
    _render(helm, f"{env}[0].name=N", f"{env}[0].value=x")


def test_the_schema_takes_what_helm_users_write(helm: Path) -> None:
    _render(helm, "image.tag=123", "operator.image.tag=2", "sidecar.headerTimeout=0",
            "sidecar.logLevel=debug", "operator.replicas=0", "sidecar.audit.enabled=true",
            "sidecar.audit.path=-", "sidecar.audit.sizeLimit=512Mi", "sidecar.tmpSizeLimit=1G",
            "redis.url=rediss://r:6380/1", "sidecar.extraArgs={--workers,2}",
            "redis.passwordSecret.name=redis", "rbac.rules=null",
            "policies.extra\\.yaml=kind: Policy", "podAnnotations.a=b")


def test_the_schema_names_every_value() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())

    def resolve(node: dict[str, Any]) -> dict[str, Any]:
        if "$ref" in node:
            node = schema["definitions"][node["$ref"].rsplit("/", 1)[-1]]
        props: dict[str, Any] = {}
        for part in node.get("allOf", [node]):
            props.update(resolve(part).get("properties", {}) if part is not node
                         else node.get("properties", {}))
        return {**node, "properties": props}

    def walk(values: dict[str, Any], node: dict[str, Any], path: str) -> list[str]:
        props = resolve(node)["properties"]
        if not props:  # a free-form map (resources, podAnnotations, policies …)
            return []
        missing = []
        for key, value in values.items():
            if key not in props:
                missing.append(path + key)
            elif isinstance(value, dict):
                missing += walk(value, props[key], f"{path}{key}.")
        return missing

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert walk(values, schema, "") == []


def test_an_existing_service_account(helm: Path) -> None:
    """serviceAccount.create=false: the pod runs as an existing ServiceAccount, the namespace's
    ``default`` unless named, and the ClusterRole is bound to that one (not to a
    ServiceAccount the chart did not create)."""
    for sets, name in ((("serviceAccount.create=false",), "default"),
                       (("serviceAccount.create=false", "serviceAccount.name=ops"), "ops"),
                       ((), "demo-opgate"), (("serviceAccount.name=ops",), "ops")):
        docs = _render(helm, *sets)
        pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == name, sets
        [subject] = _one(docs, "ClusterRoleBinding")["subjects"]
        assert subject["name"] == name, sets
        created = [d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"]
        assert created == ([] if sets[:1] == ("serviceAccount.create=false",) else [name])


def test_a_longer_shutdown_gets_a_longer_grace_period(
    helm: Path, kubectl: Path, cluster: LocalCluster, tmp_path: Path
) -> None:
    """The pod's terminationGracePeriodSeconds is a value: a longer shutdownDelaySeconds
    (an operator with a slow stop) needs a longer one, and less than the delay + opgate's drain
    is refused (kubelet would SIGKILL opgate mid-drain)."""
    err = _render_error(helm, "sidecar.shutdownDelaySeconds=25")
    assert "terminationGracePeriodSeconds" in err and "(35)" in err, err
    docs = _render(helm, "sidecar.shutdownDelaySeconds=25", "terminationGracePeriodSeconds=60")
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 60
    assert _sidecar(docs)["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "25"]
    _dry_run(kubectl, cluster, tmp_path, docs)
    assert "terminationGracePeriodSeconds" in _render_error(
        helm, "terminationGracePeriodSeconds=soon")
    # a release of a chart without the value, upgraded with --reuse-values (which keeps the old
    # chart's values, not the new defaults): kubelet's default, not a failed upgrade
    pod = _one(_render(helm, "terminationGracePeriodSeconds=null"), "Deployment")
    assert pod["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 30
    quick = ("terminationGracePeriodSeconds=0", "sidecar.shutdownDelaySeconds=0",
             "sidecar.shutdownGraceSeconds=0")
    pod = _one(_render(helm, *quick), "Deployment")
    assert pod["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 0


@pytest.mark.parametrize(("key", "text", "says"), [
    ("ratelimits", "kind: Policy", '"ratelimits"'),       # opgate skips a file not *.yaml/*.yml
    ("operator\\.json", "{}", '"operator.json"'),
    ("\\.hidden\\.yaml", "kind: Policy", '".hidden.yaml"'),  # hidden: skipped too
    ("bad\\.yaml", "spec: [unclosed", "bad.yaml is not YAML"),
    ("two\\.yaml", "kind: Policy\n---\nspec: {rateLimits: [}", "two.yaml is not YAML"),
])
def test_a_policy_file_opgate_would_not_read_fails_the_install(
    helm: Path, tmp_path: Path, key: str, text: str, says: str
) -> None:
    source = tmp_path / "policy.txt"
    source.write_text(text)
    out = subprocess.run([str(helm), "template", "demo", str(CHART), "--set-file",
                          f"policies.{key}={source}"], capture_output=True, text=True)
    assert out.returncode != 0 and says in out.stderr, out.stderr


def test_every_shipped_policy_passes_the_charts_check(helm: Path) -> None:
    """No false alarm: the example and demo policy files (multi-document ones too) render."""
    files = sorted((CHART.parents[1] / "policies").glob("*/*.yaml"))
    assert len(files) >= 5
    args = [str(helm), "template", "demo", str(CHART)]
    for f in files:
        args += ["--set-file", "policies.{}={}".format(f.name.replace(".", "\\."), f)]
    out = subprocess.run(args, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert sorted(_one(docs, "ConfigMap", "-policies")["data"]) == sorted(
        ["operator.yaml", *(f.name for f in files)])


EVERYTHING_ON = (
    "redis.url=rediss://redis.redis:6380/1", "redis.replicas=2",
    "redis.passwordSecret.name=redis-auth", "redis.passwordSecret.key=pw",
    "sidecar.audit.enabled=true", "sidecar.capture.enabled=true",
    "sidecar.audit.sizeLimit=2Gi", "sidecar.capture.sizeLimit=2Gi",  # two workers' 1200Mi
    "sidecar.extraArgs={--workers,2}", "sidecar.logLevel=debug", "sidecar.accessLog=false",
    "sidecar.adminListen=[::]:9500", "sidecar.env[0].name=PYTHONFAULTHANDLER",
    "sidecar.env[0].value=x", "sidecar.resources.limits.cpu=1",
    "operator.env[0].name=WATCH_NAMESPACE", "operator.env[0].value=apps",
    "operator.resources.requests.memory=32Mi", "operator.replicas=2",
    "nodeSelector.kubernetes\\.io/os=linux", "tolerations[0].key=dedicated",
    "tolerations[0].operator=Exists", "tolerations[0].effect=NoSchedule",
    "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
    ".nodeSelectorTerms[0].matchExpressions[0].key=kubernetes.io/arch",
    "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
    ".nodeSelectorTerms[0].matchExpressions[0].operator=In",
    "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
    ".nodeSelectorTerms[0].matchExpressions[0].values[0]=amd64",
    "podAnnotations.team=platform", "serviceAccount.annotations.owner=platform",
    "podSecurityContext.fsGroup=65532", "metrics.podAnnotations=false",
    "rbac.sidecarRules[0].apiGroups[0]=authentication.k8s.io",
    "rbac.sidecarRules[0].resources[0]=tokenreviews", "rbac.sidecarRules[0].verbs[0]=create",
    "extraVolumes[0].name=tls", "extraVolumes[0].secret.secretName=opgate-tls",
    "sidecar.extraVolumeMounts[0].name=tls", "sidecar.extraVolumeMounts[0].mountPath=/etc/tls",
    "imagePullSecrets[0].name=regcred",
)


def test_everything_on_is_accepted_and_parses(
    helm: Path, kubectl: Path, cluster: LocalCluster, tmp_path: Path
) -> None:
    """Most values at once (a TLS listener through extraArgs and a mounted Secret, workers,
    Redis with a password, audit + capture, scheduling, annotations): the flags parse, the
    lint is clean and the apiserver takes every object."""
    tls = ("sidecar.extraArgs[2]=--tls-cert=/etc/tls/tls.crt",
           "sidecar.extraArgs[3]=--tls-key=/etc/tls/tls.key")
    # the chart's kubeconfig names http://, which a TLS listener does not answer
    err = _render_error(helm, *EVERYTHING_ON, *tls)
    assert "--tls-cert" in err and "operator.kubeconfig=false" in err, err
    sets = (*EVERYTHING_ON, *tls, "operator.kubeconfig=false")
    docs = _render(helm, *sets)
    sidecar = _sidecar(docs)
    args = build_parser().parse_args(sidecar["args"])
    assert (args.workers, args.tls_cert, args.redis_password_file, args.admin_listen) == (
        2, "/etc/tls/tls.crt", "/etc/opgate/redis/pw", "[::]:9500")
    assert sidecar["ports"][0]["containerPort"] == 9500
    pod = _one(docs, "Deployment")["spec"]["template"]
    assert pod["metadata"]["annotations"] == {"team": "platform"}
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert "/imagePullSecrets/0" in _render_error(helm, "imagePullSecrets[0]=regcred")
    lint = subprocess.run([str(helm), "lint", "--strict", str(CHART),
                           *[a for s in sets for a in ("--set", s)]],
                          capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    _dry_run(kubectl, cluster, tmp_path, docs)


def test_a_chart_version_with_build_metadata(
    helm: Path, kubectl: Path, cluster: LocalCluster, tmp_path: Path
) -> None:
    """A platform team repackages the chart as 0.1.0+acme.3 (SemVer build metadata): the
    helm.sh/chart label cannot hold a "+", so it becomes "_" (as in charts made by helm create)
    and the apiserver takes the labels."""
    import shutil

    chart = tmp_path / "opgate"
    shutil.copytree(CHART, chart)
    meta = chart / "Chart.yaml"
    meta.write_text(meta.read_text().replace("version: 0.1.0", "version: 0.1.0+acme.3", 1))
    docs = _render(helm, chart=chart)
    assert {d["metadata"]["labels"]["helm.sh/chart"] for d in docs} == {"opgate-0.1.0_acme.3"}
    _dry_run(kubectl, cluster, tmp_path, docs)


def test_name_overrides(
    helm: Path, kubectl: Path, cluster: LocalCluster, tmp_path: Path
) -> None:
    """fullnameOverride and nameOverride, as in charts made by helm create: every object, the
    references between them and the selector follow."""
    docs = _render(helm, "fullnameOverride=gate")
    assert sorted(d["metadata"]["name"] for d in docs) == [
        "gate", "gate", "gate-kubeconfig", "gate-metrics", "gate-policies",
        "opgate-helm-gate", "opgate-helm-gate"]  # the ClusterRole, its binding: <namespace>-
    assert _one(docs, "ClusterRoleBinding")["roleRef"]["name"] == "opgate-helm-gate"
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "gate"
    assert {v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v} == {
        "gate-policies", "gate-kubeconfig"}
    _dry_run(kubectl, cluster, tmp_path, docs)
    docs = _render(helm, "nameOverride=proxy")
    assert _one(docs, "Deployment")["metadata"]["name"] == "demo-proxy"
    selector = _one(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    assert selector["app.kubernetes.io/name"] == "proxy"
    assert _one(docs, "Service")["spec"]["selector"] == selector


@pytest.mark.parametrize("listen", ["0.0.0.0:8001", ":8001", "[::]:8001", "10.1.2.3:8001"])
def test_the_api_port_stays_in_the_pod(helm: Path, listen: str) -> None:
    """opgate adds the pod's ServiceAccount token to what it relays: an API port on the pod IP
    would lend the operator's rights to anyone who reaches the pod."""
    err = _render_error(helm, f"sidecar.listen={listen}")
    assert "sidecar.listen" in err and "loopback" in err, err


@pytest.mark.parametrize("listen", ["127.0.0.1:8080", "[::1]:8001", "localhost:8001"])
def test_a_loopback_api_port(helm: Path, listen: str) -> None:
    docs = _render(helm, f"sidecar.listen={listen}")
    assert build_parser().parse_args(_sidecar(docs)["args"]).listen == listen
    config = yaml.safe_load(_one(docs, "ConfigMap", "-kubeconfig")["data"]["config"])
    assert config["clusters"][0]["cluster"]["server"] == f"http://{listen}"


REDIS_URLS = {  # one URL of each scheme opgate's --redis-url takes
    "redis": "redis://redis.redis:6379/0",
    "rediss": "rediss://redis.redis:6380/0?ssl_ca_certs=/etc/redis-tls/ca.crt",
    "unix": "unix:///run/redis/redis.sock",
    "redis+cluster": "redis+cluster://redis-cluster.redis:6379",
    "rediss+cluster": "rediss+cluster://redis-cluster.redis:6379",
    "redis+sentinel": "redis+sentinel://sentinel.redis:26379/mymaster/0",
    "rediss+sentinel": "rediss+sentinel://sentinel.redis:26379/mymaster",
}


@pytest.mark.parametrize("scheme", REDIS_SCHEMES)
def test_every_redis_url_opgate_takes_is_a_valid_value(helm: Path, scheme: str) -> None:
    """The schema's redis.url pattern follows opgate's schemes: a Cluster, a TLS Sentinel or a
    socket URL is not refused at install while opgate would take it."""
    url = REDIS_URLS[scheme]
    args = build_parser().parse_args(_sidecar(_render(helm, f"redis.url={url}"))["args"])
    assert args.redis_url == url


@pytest.mark.parametrize(("extra", "value"), [
    ("{--listen=0.0.0.0:8001}", "sidecar.listen"),      # the API port on the pod IP
    ("{--listen,0.0.0.0:8001}", "sidecar.listen"),
    ("{--lis=0.0.0.0:8001}", "sidecar.listen"),         # argparse takes an abbreviation
    ("{--admin-listen=0.0.0.0:9500}", "sidecar.adminListen"),  # probes on another port
    ("{--policies=/etc/other}", "policies"),            # nothing mounted there
    ("{--token-file,/t}", "sidecar.tokenFile"),
    ("{--redis-url=redis://other:6379/0}", "redis.url"),
])
def test_extra_args_cannot_override_the_charts_flags(helm: Path, extra: str, value: str) -> None:
    """opgate's parser keeps the last of a repeated flag: one in sidecar.extraArgs would win
    over the chart's, out of its checks (the API port stays on loopback) and its mounts."""
    sets = ("redis.url=redis://r:6379/0", f"sidecar.extraArgs={extra}")
    err = _render_error(helm, *sets)
    assert "sidecar.extraArgs" in err and f"set {value} instead" in err, err


def test_extra_args_that_the_chart_does_not_set(helm: Path) -> None:
    sidecar = _sidecar(_render(helm, "policies=null",
                               "sidecar.extraArgs={--policies=/etc/mine,--workers,2,--loop=asyncio}",
                               "redis.url=redis://r:6379/0"))
    args = build_parser().parse_args(sidecar["args"])
    assert (args.policies, args.workers, args.loop, args.listen) == (
        "/etc/mine", 2, "asyncio", "127.0.0.1:8001")


@pytest.mark.parametrize(("listen", "says"), [
    ("127.0.0.1:9091", "loopback"),   # the kubelet's probes come to the pod IP: restarted forever
    ("[::1]:9091", "loopback"),
    ("localhost:9091", "loopback"),
    (":9091", "/sidecar/adminListen"),   # opgate refuses an empty host at start
    ("[]:9091", "/sidecar/adminListen"),
    ("0.0.0.0:0", "from 1 to 65535"),
    ("0.0.0.0:99999", "from 1 to 65535"),
])
def test_an_admin_port_the_probes_cannot_reach_is_refused(
    helm: Path, listen: str, says: str
) -> None:
    err = _render_error(helm, f"sidecar.adminListen={listen}")
    assert "adminListen" in err and says in err, err


def test_the_loopback_refusal_advises_an_address_an_ipv4_pod_ip_reaches(helm: Path) -> None:
    """The refusal said 'listen on 0.0.0.0:PORT or [::]:PORT', as if the two were alike: opgate
    binds [::] IPv6 only (asyncio's create_server sets IPV6_V6ONLY), so on an IPv4 cluster,
    where kubelet probes the pod's IPv4 address, that advice restarted the container for
    failing its startup and liveness probes."""
    err = _render_error(helm, "sidecar.adminListen=127.0.0.1:9091")
    assert "0.0.0.0:PORT" in err, err
    assert "[::]:PORT" not in err or "IPv6 only" in err, err


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "127.0.0.1:99999"])
def test_an_api_port_out_of_range_is_refused(helm: Path, listen: str) -> None:
    """opgate refuses 99999 at start; 0 is a random port the kubeconfig cannot name."""
    err = _render_error(helm, f"sidecar.listen={listen}")
    assert "sidecar.listen" in err and "from 1 to 65535" in err, err


def _readme_install_sets() -> list[str]:
    """The ``--set`` values of the README's ``helm install`` in "the Helm chart" section."""
    import re
    import shlex

    readme = (CHART.parents[1] / "README.md").read_text()
    section = readme.split("### In a cluster: the Helm chart", 1)[1]
    block = re.search(r"```sh\n(helm install .*?)```", section, re.S)
    assert block, "no helm install block in the README's Helm section"
    words = shlex.split(block.group(1).replace("\\\n", " "))
    return [words[i + 1] for i, w in enumerate(words) if w == "--set"]


def test_the_readmes_install_runs_the_operators_image_as_it_is(
    helm: Path, kubectl: Path, cluster: LocalCluster, tmp_path: Path
) -> None:
    """The README installs an operator image of one's own: its pod must not run the sample
    reconciler's command (python -m examples.reconciler), which that image does not hold."""
    sets = _readme_install_sets()
    assert "operator.image.repository=example.com/my-operator" in sets
    docs = _render(helm, *sets)
    operator = _operator(docs)
    assert operator["image"] == "example.com/my-operator:1.2.3"
    assert "command" not in operator and "args" not in operator, operator
    args = build_parser().parse_args(_sidecar(docs)["args"])
    assert (args.redis_url, args.redis_password_file) == (
        "redis://redis-master.redis:6379/0", "/etc/opgate/redis/password")
    _dry_run(kubectl, cluster, tmp_path, docs)


@pytest.mark.parametrize(("key", "path"), [
    ("podAnnotations.prometheus\\.io/port", "/podAnnotations/prometheus.io~1port"),
    ("serviceAccount.annotations.team", "/serviceAccount/annotations/team"),
    ("nodeSelector.pool", "/nodeSelector/pool")])
def test_an_annotation_or_node_selector_value_must_be_a_string(
    helm: Path, kubectl: Path, cluster: LocalCluster, tmp_path: Path, key: str, path: str
) -> None:
    """``--set podAnnotations.prometheus\\.io/port=8080`` is a number, which the apiserver
    refuses in an object's annotations or a pod's nodeSelector (a BadRequest at install that
    names a Go struct); the schema names the value first."""
    for value in ("8080", "true"):
        err = _render_error(helm, f"{key}={value}")
        assert "schema" in err and path in err, err
    args = [str(helm), "template", "demo", str(CHART), "-n", "opgate-helm",
            "--set-string", f"{key}=8080"]  # as a string it is taken
    out = subprocess.run(args, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    _dry_run(kubectl, cluster, tmp_path, [d for d in yaml.safe_load_all(out.stdout) if d])


def test_an_image_tag_written_as_a_number(helm: Path, tmp_path: Path) -> None:
    """In a values file ``tag: 20240101`` is a number (a float to helm), which printed as
    2.0240101e+07, and ``tag: 1.10`` printed as 1.1: an image that does not exist. An integral
    one is printed as written; any other is refused, to be quoted."""
    values = tmp_path / "values.yaml"
    values.write_text("image: {tag: 20240101}\noperator: {image: {tag: 7}}\n")
    out = subprocess.run([str(helm), "template", "demo", str(CHART), "-f", str(values)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert _sidecar(docs)["image"] == "ghcr.io/opgate/opgate:20240101"
    assert _operator(docs)["image"] == "ghcr.io/opgate/opgate:7"
    values.write_text("operator: {image: {tag: 1.10}}\n")
    out = subprocess.run([str(helm), "template", "demo", str(CHART), "-f", str(values)],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "/operator/image/tag" in out.stderr, out.stderr
    values.write_text("operator: {image: {tag: \"1.10\"}}\n")
    out = subprocess.run([str(helm), "template", "demo", str(CHART), "-f", str(values)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert _operator(docs)["image"] == "ghcr.io/opgate/opgate:1.10"


@pytest.mark.parametrize("url", [
    "redis://:s3cret@redis:6379/0", "rediss://app:s3cret@redis:6380/0",
    "redis+sentinel://:s3cret@sentinel:26379/mymaster",
    # redis-py reads a password from the query too (opgate authenticates with it)
    "redis://redis:6379/0?password=s3cret", "unix:///run/redis/redis.sock?db=1&Password=s3cret",
    "redis+sentinel://sentinel:26379/mymaster?sentinel_password=s3cret"])
def test_a_redis_password_never_stands_in_the_pods_args(helm: Path, url: str) -> None:
    """The args are in the Deployment, for whoever may read Deployments: the password comes
    from a Secret (redis.passwordSecret, or the whole URL as OPGATE_REDIS_URL), not from the
    URL. A ?password= or ?sentinel_password= in the query was rendered in clear."""
    err = _render_error(helm, f"redis.url={url}")
    assert "redis.passwordSecret.name" in err and "OPGATE_REDIS_URL" in err, err
    assert "s3cret" not in err, err
    docs = _render(helm, "redis.url=rediss://app@redis:6380/0",
                   "redis.passwordSecret.name=redis-auth")  # a username stays in the URL
    args = build_parser().parse_args(_sidecar(docs)["args"])
    assert (args.redis_url, args.redis_password_file) == (
        "rediss://app@redis:6380/0", "/etc/opgate/redis/password")


@pytest.mark.parametrize(("name", "value"), [
    ("OPGATE_REDIS_PASSWORD", "s3cret"),
    ("OPGATE_REDIS_URL", "redis://:s3cret@redis:6379/0"),
    ("OPGATE_REDIS_URL", "redis+sentinel://sentinel:26379/m?sentinel_password=s3cret")])
def test_a_redis_password_never_stands_in_the_pods_env(helm: Path, name: str, value: str) -> None:
    """opgate's OPGATE_REDIS_* variables in sidecar.env as plain values put the password in
    the Deployment (and `kubectl describe pod`) in clear, the chart's refusal of one in
    redis.url aside; the README's way, valueFrom a Secret, renders."""
    err = _render_error(helm, strings=(f"sidecar.env[0].name={name}",
                                       f"sidecar.env[0].value={value}"))
    assert name in err and "secretKeyRef" in err and "s3cret" not in err, err
    docs = _render(helm, f"sidecar.env[0].name={name}",
                   "sidecar.env[0].valueFrom.secretKeyRef.name=redis",
                   "sidecar.env[0].valueFrom.secretKeyRef.key=k")
    assert _sidecar(docs)["env"][0]["name"] == name
    ok = _helm_template(helm, (), "demo", CHART, (
        "sidecar.env[0].name=OPGATE_REDIS_URL", "sidecar.env[0].value=redis://app@redis:6379/0"))
    assert ok.returncode == 0, ok.stderr  # a username alone is no secret


@pytest.mark.parametrize(("setting", "key"), [
    ("tolerance[0].key=dedicated", "tolerance"),
    ("imagePullSecret[0].name=regcred", "imagePullSecret"),
    ("nodeselector.pool=ops", "nodeselector"),
    ("podAnnotation.team=platform", "podAnnotation"),
    ("extraVolume[0].name=tls", "extraVolume"),
])
def test_a_misspelt_top_level_key_is_refused(helm: Path, setting: str, key: str) -> None:
    """A misspelt top-level key was ignored without a word (no toleration, no pull secret)."""
    err = _render_error(helm, setting)
    assert "schema" in err and f"'{key}' not allowed" in err, err


def test_a_parent_charts_global_values_reach_opgate(helm: Path, tmp_path: Path) -> None:
    """helm hands a subchart the parent's ``global:`` values: the schema takes them."""
    parent = _parent_chart(helm, tmp_path, "global: {team: platform}\n")
    docs = _render(helm, release="shop", chart=parent)
    assert _one(docs, "Deployment")["metadata"]["name"] == "shop-controller"


@pytest.mark.parametrize(("extra", "sets", "says"), [
    ("{--workers,2}", (), "without redis.url"),
    ("{--workers=auto}", (), "without redis.url"),  # one per CPU of the node
    ("{--wor=3}", (), "without redis.url"),          # an abbreviation
    ("{--workers,2}", ("redis.url=redis://r:6379/0", "sidecar.listen=unix:/run/opgate/a.sock",
                       "operator.kubeconfig=false"), "TCP port"),
    # auto without a CPU limit is one worker per CPU of the node (~65 MB each): 64 on a
    # 64-core node, OOM-killed under the chart's 256Mi memory limit, at every restart
    ("{--workers,auto}", ("redis.url=redis://r:6379/0",), "sidecar.resources.limits.cpu"),
    ("{--workers=auto}", ("redis.url=redis://r:6379/0", "sidecar.resources.limits.cpu=null"),
     "sidecar.resources.limits.cpu"),
])
def test_workers_that_opgate_would_refuse_fail_the_install(
    helm: Path, extra: str, sets: tuple[str, ...], says: str
) -> None:
    """opgate refuses --workers N > 1 without Redis or on a unix: socket at start, in a pod
    that would restart forever; the chart says so at install."""
    err = _render_error(helm, f"sidecar.extraArgs={extra}", *sets)
    assert "--workers" in err and says in err, err


def test_workers_with_redis(
    helm: Path, kubectl: Path, cluster: LocalCluster, tmp_path: Path
) -> None:
    for sets in (("redis.url=redis://r:6379/0",),
                 ("sidecar.env[0].name=OPGATE_REDIS_URL",  # a URL from a Secret
                  "sidecar.env[0].valueFrom.secretKeyRef.name=redis-url",
                  "sidecar.env[0].valueFrom.secretKeyRef.key=url")):
        docs = _render(helm, "sidecar.extraArgs={--workers,2}", *sets)
        assert build_parser().parse_args(_sidecar(docs)["args"]).workers == 2
        _dry_run(kubectl, cluster, tmp_path, docs)
    docs = _render(helm, "sidecar.extraArgs={--workers,1}")
    assert build_parser().parse_args(_sidecar(docs)["args"]).workers == 1
    docs = _render(helm, "sidecar.extraArgs={--workers,auto}", "redis.url=redis://r:6379/0",
                   "sidecar.resources.limits.cpu=1500m")  # auto: 2, as the CPU limit says
    assert _sidecar(docs)["args"][-2:] == ["--workers", "auto"]


def test_fractional_seconds_from_set(helm: Path) -> None:
    """``--set`` makes 0.5 a string (only whole numbers become numbers): opgate takes
    fractional seconds, so the schema takes a numeric string, and still refuses "30s"."""
    docs = _render(helm, "sidecar.headerTimeout=0.5", "sidecar.shutdownGraceSeconds=2.5")
    args = build_parser().parse_args(_sidecar(docs)["args"])
    assert (args.header_timeout, args.shutdown_grace) == (0.5, 2.5)
    err = _render_error(helm, "sidecar.shutdownGraceSeconds=40.5")  # 5 + 40.5 > 30
    assert "terminationGracePeriodSeconds" in err and "(45.5)" in err, err
    for bad in ("sidecar.headerTimeout=30s", "sidecar.shutdownGraceSeconds=ten"):
        assert "schema" in _render_error(helm, bad)


def test_an_existing_service_account_without_automount(
    helm: Path, kubectl: Path, cluster: LocalCluster, tmp_path: Path
) -> None:
    """A hardened ServiceAccount (automountServiceAccountToken: false, as CIS benchmarks ask of
    a namespace's default one) would leave opgate without the in-cluster CA and token, which it
    reads from that mount: the pod asks for the mount itself."""
    docs = _render(helm, "serviceAccount.create=false", "serviceAccount.name=hardened")
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True
    assert build_parser().parse_args(_sidecar(docs)["args"]).token_file.startswith(
        "/var/run/secrets/kubernetes.io/serviceaccount/")
    hardened = {"apiVersion": "v1", "kind": "ServiceAccount", "automountServiceAccountToken": False,
                "metadata": {"name": "hardened", "namespace": "opgate-helm"}}
    _dry_run(kubectl, cluster, tmp_path, [hardened, *docs])


def test_a_parent_chart_with_workers(helm: Path, tmp_path: Path) -> None:
    """The sidecar's checks read opgate's values, not the parent's (``$`` there is the
    parent's root context)."""
    parent = _parent_chart(helm, tmp_path, "  redis: {url: redis://r:6379/0}\n"
                           "  sidecar: {extraArgs: [--workers, \"2\"]}\n")
    docs = _render(helm, release="shop", chart=parent)
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    [sidecar] = [c for c in pod["containers"] if c["name"] == "opgate"]
    assert build_parser().parse_args(sidecar["args"]).workers == 2
    err = subprocess.run([str(helm), "template", "shop", str(parent), "--set",
                          "opgate.sidecar.listen=unix:/run/a.sock"], capture_output=True,
                         text=True).stderr
    assert "--workers 2 with sidecar.listen=unix:/run/a.sock" in err, err


@pytest.mark.parametrize("mount", [(), ("sidecar.extraVolumeMounts[0].readOnly=true",),
                                   ("sidecar.extraVolumeMounts[0].mountPath=/run/other",)])
def test_a_socket_on_no_writable_mount_is_refused(helm: Path, mount: tuple[str, ...]) -> None:
    """The sidecar's root filesystem is read-only: opgate could not create a socket outside a
    writable mount (it would stop at start, in a pod that restarts)."""
    sets = ("sidecar.listen=unix:/run/opgate/api.sock", "operator.kubeconfig=false")
    if mount:
        sets += ("extraVolumes[0].name=sock", "extraVolumes[0].emptyDir.medium=Memory",
                 "sidecar.extraVolumeMounts[0].name=sock",
                 "sidecar.extraVolumeMounts[0].mountPath=/run/opgate", *mount)
    err = _render_error(helm, *sets)
    assert "/run/opgate is on no writable mount" in err, err
    # a mount above the socket's directory, or the sidecar's own /tmp, does
    _render(helm, *sets[:2], "extraVolumes[0].name=run", "extraVolumes[0].emptyDir.medium=Memory",
            "sidecar.extraVolumeMounts[0].name=run", "sidecar.extraVolumeMounts[0].mountPath=/run")
    _render(helm, "sidecar.listen=unix:/tmp/api.sock", "operator.kubeconfig=false")


@pytest.mark.parametrize("listen", ["127.0.0.1:8001", "localhost:8001", "[::1]:8001",
                                    "127.0.0.2:8001", "127.10.0.1:8080"])
def test_the_sidecar_answers_the_host_its_kubeconfig_names(helm: Path, listen: str) -> None:
    """opgate answers only the Host names of --accept-hosts (default localhost, 127.0.0.1,
    [::1]: the DNS rebinding guard), and the chart takes any loopback sidecar.listen: on
    127.0.0.2 the kubeconfig's server named a host opgate refused, every call a 403."""
    from urllib.parse import urlsplit

    from proxy.relay.hostguard import HostGuard, parse_accept_hosts

    docs = _render(helm, f"sidecar.listen={listen}")
    args = build_parser().parse_args(_sidecar(docs)["args"])
    guard = HostGuard(parse_accept_hosts(args.accept_hosts))
    config = yaml.safe_load(_one(docs, "ConfigMap", "-kubeconfig")["data"]["config"])
    host = urlsplit(config["clusters"][0]["cluster"]["server"]).netloc
    assert host == listen
    assert guard.accepts(host.encode()), args.accept_hosts
    assert not guard.accepts(b"evil.example:8001")  # the guard itself stays


def test_the_readiness_probe_waits_for_opgates_own_answer(helm: Path) -> None:
    """/readyz asks the apiserver (GET /readyz, then /version where RBAC hides it), giving each
    call PROBE_TIMEOUT: with the kubelet's default timeoutSeconds (1) an apiserver that answers
    in 1.5 s made the probe fail while opgate would have answered ready, and the pod flapped
    out of the metrics Service and stalled a rollout exactly when the apiserver was loaded."""
    from proxy.relay.fast.relay import PROBE_TIMEOUT

    sidecar = _sidecar(_render(helm))
    readiness = sidecar["readinessProbe"]
    assert readiness["timeoutSeconds"] > 2 * PROBE_TIMEOUT


@pytest.mark.parametrize(("env", "sets", "says"), [
    ("OPGATE_WORKERS=2", (), "without redis.url"),
    ("OPGATE_WORKERS=auto", (), "without redis.url"),
    ("OPGATE_WORKERS=2", ("redis.url=redis://r:6379/0", "sidecar.listen=unix:/run/opgate/a.sock",
                          "operator.kubeconfig=false"), "TCP port"),
    ("OPGATE_TLS_CERT=/etc/tls/tls.crt", (), "operator.kubeconfig=false"),
])
def test_an_env_setting_opgate_would_refuse_fails_the_install(
    helm: Path, env: str, sets: tuple[str, ...], says: str
) -> None:
    """Every serve flag has its OPGATE_* variable (flags win over them): one in sidecar.env
    that the chart refuses as a flag in sidecar.extraArgs (--workers without Redis, --tls-cert
    under the chart's http:// kubeconfig) rendered, and the pod restarted forever or the
    operator's every call failed."""
    name, value = env.split("=")
    err = _render_error(helm, *sets, strings=(f"sidecar.env[0].name={name}",
                                              f"sidecar.env[0].value={value}"))
    assert name in err and says in err, err


def test_the_injected_sidecar_passes_the_restricted_pod_security_standard(
    helm: Path, kubectl: Path, cluster: LocalCluster, tmp_path: Path
) -> None:
    """A parent chart's pod whose own container meets the restricted Pod Security Standard
    still had its pods refused in a namespace that enforces it: the injected sidecar set no
    seccompProfile of its own (the chart's pod sets one at pod level, a parent's need not).
    The pod of the rendered template, created in such a namespace (server dry run)."""
    restricted = PARENT_DEPLOYMENT.replace(
        "          image: example.com/controller:1.0\n",
        "          image: example.com/controller:1.0\n"
        "          securityContext: {allowPrivilegeEscalation: false, runAsNonRoot: true,\n"
        "                            capabilities: {drop: [ALL]},\n"
        "                            seccompProfile: {type: RuntimeDefault}}\n")
    assert restricted != PARENT_DEPLOYMENT
    parent = _parent_chart(helm, tmp_path, deployment=restricted)
    template = _one(_render(helm, release="shop", chart=parent), "Deployment")["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "shop-controller-0"},
           "spec": template["spec"]}
    cluster.create_namespace("opgate-restricted",
                             labels={"pod-security.kubernetes.io/enforce": "restricted"})
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(yaml.safe_dump(pod))
    out = subprocess.run(
        [str(kubectl), "--kubeconfig", cluster.kubeconfig_path, "create", "--dry-run=server",
         "-n", "opgate-restricted", "-f", str(manifest)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


# ---- a native sidecar (an init container with restartPolicy: Always) ---------------------------

def _pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod: dict[str, Any] = _one(docs, "Deployment")["spec"]["template"]["spec"]
    return pod


def _is_native(pod: dict[str, Any]) -> bool:
    """Where the opgate container is: first of initContainers with restartPolicy Always (a
    native sidecar), or among containers (a classic one); never both."""
    native = [c for c in pod.get("initContainers") or [] if c["name"] == "opgate"]
    classic = [c for c in pod["containers"] if c["name"] == "opgate"]
    assert len(native) + len(classic) == 1, pod
    if native:
        assert pod["initContainers"][0] is native[0]  # started before any other init container
        assert native[0]["restartPolicy"] == "Always"
        return True
    assert "restartPolicy" not in classic[0]
    return False


@pytest.mark.parametrize(("sets", "kube_version", "native"), [
    ((), "", False),                                  # the default: as before
    (("sidecar.native=false",), "1.35.0", False),
    (("sidecar.native=true",), "", True),
    (("sidecar.native=true",), "1.28.0", True),        # asked for: the apiserver says if it can
    (("sidecar.native=auto",), "1.35.4", True),
    (("sidecar.native=auto",), "1.29.0", True),        # SidecarContainers on by default
    (("sidecar.native=auto",), "v1.30.2-eks-1234", True),  # a provider's pre-release suffix
    (("sidecar.native=auto",), "1.28.9", False),       # alpha, off by default
    (("sidecar.native=auto",), "", True),              # helm template alone: helm's own version
])
def test_the_sidecar_can_be_native(helm: Path, sets: tuple[str, ...], kube_version: str,
                                   native: bool) -> None:
    """Kubelet starts a native sidecar and waits for its startupProbe before the operator, and
    stops it only after the operator has exited: the operator's first call no longer races
    opgate's start, and its last ones no longer need a preStop sleep to hold opgate back."""
    docs = _render(helm, *sets, kube_version=kube_version)
    pod = _pod(docs)
    assert _is_native(pod) is native
    [sidecar] = [c for c in [*(pod.get("initContainers") or []), *pod["containers"]]
                 if c["name"] == "opgate"]
    assert [c["name"] for c in pod["containers"]] == (
        ["operator"] if native else ["operator", "opgate"])
    # what gates the operator's start: /healthz answers once the API port listens
    assert sidecar["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"
    if native:
        assert "lifecycle" not in sidecar  # kubelet orders the stop: no sleep to wait out
    else:
        assert sidecar["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert build_parser().parse_args(sidecar["args"]).listen == "127.0.0.1:8001"
    config = yaml.safe_load(_one(docs, "ConfigMap", "-kubeconfig")["data"]["config"])
    assert config["clusters"][0]["cluster"]["server"] == "http://127.0.0.1:8001"


def test_the_apiserver_keeps_a_native_sidecar(
    helm: Path, kubectl: Path, cluster: LocalCluster, tmp_path: Path
) -> None:
    """kube-apiserver 1.35 validates the init container with restartPolicy Always (probes are
    allowed on it, not on a plain init container) and keeps the field: an apiserver without
    SidecarContainers would drop it, and the pod would wait on opgate forever in Init."""
    docs = _render(helm, "sidecar.native=true", "sidecar.audit.enabled=true",
                   "sidecar.audit.sizeLimit=2Gi", "redis.url=redis://r:6379/0",
                   "sidecar.extraArgs={--workers,2}")
    out = json.loads(_dry_run(kubectl, cluster, tmp_path, docs, "-o", "json"))
    [deployment] = [d for d in out["items"] if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert _is_native(pod)
    assert pod["initContainers"][0]["startupProbe"]["httpGet"]["path"] == "/healthz"


def test_a_native_sidecar_needs_no_shutdown_delay(helm: Path) -> None:
    """A native sidecar gets its SIGTERM once the operator has exited, so
    sidecar.shutdownDelaySeconds (the classic sidecar's preStop sleep) is not counted in the
    grace period; opgate's own drain still is."""
    sets = ("sidecar.native=true", "sidecar.shutdownDelaySeconds=25",
            "terminationGracePeriodSeconds=30")
    assert "lifecycle" not in _is_native_sidecar(_render(helm, *sets))
    err = _render_error(helm, "sidecar.native=true", "sidecar.shutdownGraceSeconds=40")
    assert "terminationGracePeriodSeconds=30" in err and "(40)" in err, err
    assert "(35)" in _render_error(helm, *sets[1:])  # classic: the delay counts


def _is_native_sidecar(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod = _pod(docs)
    assert _is_native(pod)
    sidecar: dict[str, Any] = pod["initContainers"][0]
    return sidecar


PARENT_PLACED = """\
apiVersion: apps/v1
kind: Deployment
metadata: {name: {{ .Release.Name }}-controller}
spec:
  selector: {matchLabels: {app: controller}}
  template:
    metadata: {labels: {app: controller}}
    spec:
      initContainers:
        {{- include "opgate.initContainers" . | nindent 8 }}
      containers:
        - name: controller
          image: example.com/controller:1.0
        {{- include "opgate.containers" . | nindent 8 }}
      volumes:
        {{- include "opgate.volumes" . | nindent 8 }}
"""

@pytest.mark.parametrize(("native", "kube_version", "expected"), [
    ("auto", "", True),
    ("auto", "1.28.0", False),
    ("false", "", False),
    ("true", "1.28.0", True),
])
def test_a_parent_chart_injects_a_native_sidecar(
    helm: Path, kubectl: Path, cluster: LocalCluster, tmp_path: Path, native: str,
    kube_version: str, expected: bool,
) -> None:
    """opgate.initContainers and opgate.containers place the sidecar where sidecar.native (auto
    too, from the parent's cluster version) puts it. The apiserver takes either pod."""
    parent = _parent_chart(helm, tmp_path, f"  sidecar: {{native: {native}}}\n",
                           deployment=PARENT_PLACED)
    docs = _render(helm, release="shop", chart=parent, kube_version=kube_version)
    pod = _pod(docs)
    assert _is_native(pod) is expected
    assert pod["containers"][0]["name"] == "controller"
    _dry_run(kubectl, cluster, tmp_path, docs)


@pytest.mark.parametrize("native", ["true", "auto"])
def test_opgate_sidecar_refuses_a_native_sidecar(helm: Path, tmp_path: Path, native: str) -> None:
    """opgate.sidecar goes under a pod's containers, where kube-apiserver 1.35 takes a
    container with restartPolicy Always: a native sidecar there would run unordered and without
    the preStop sleep, so the include fails naming the helpers that place it."""
    parent = _parent_chart(helm, tmp_path, f"  sidecar: {{native: {native}}}\n")
    out = _helm_template(helm, (), "shop", parent)
    assert out.returncode != 0 and "opgate.initContainers" in out.stderr, out.stderr
    # as before with false, and with auto on a cluster older than 1.29
    _render(helm, "opgate.sidecar.native=false", release="shop", chart=parent)
    if native == "auto":
        _render(helm, release="shop", chart=parent, kube_version="1.28.0")


def test_auto_needs_the_clusters_version(helm: Path, tmp_path: Path) -> None:
    """A parent chart that passes opgate's values in a dict of its own gives the helpers no
    .Capabilities: sidecar.native=auto cannot tell the cluster's version then, and says so."""
    by_dict = PARENT_PLACED.replace(
        'include "opgate.initContainers" .',
        'include "opgate.initContainers" (dict "Values" .Values.opgate "Release" .Release '
        '"Chart" .Chart)')
    parent = _parent_chart(helm, tmp_path, "  sidecar: {native: auto}\n", deployment=by_dict)
    out = _helm_template(helm, (), "shop", parent)
    assert out.returncode != 0 and "Capabilities" in out.stderr, out.stderr
    with_caps = by_dict.replace('"Chart" .Chart)', '"Chart" .Chart "Capabilities" .Capabilities)')
    (parent / "templates" / "deployment.yaml").write_text(with_caps)
    assert _is_native(_pod(_render(helm, release="shop", chart=parent)))


def test_lint_native(helm: Path) -> None:
    for native in ("true", "auto"):
        out = subprocess.run([str(helm), "lint", "--strict", str(CHART), "--set",
                              f"sidecar.native={native}"], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr


# The values added since the chart's first version: a release installed with an older chart
# holds none of them (helm upgrade --reuse-values renders the new templates with the old
# release's values, its chart's defaults included, not this chart's values.yaml).
ADDED_SINCE_THE_FIRST_CHART = (
    "operator.enabled", "operator.extraVolumeMounts", "rbac.sidecarRules", "sidecar.audit",
    "sidecar.capture", "sidecar.extraVolumeMounts", "sidecar.native",
    "sidecar.shutdownDelaySeconds", "sidecar.shutdownGraceSeconds", "sidecar.tmpSizeLimit",
    "terminationGracePeriodSeconds", "extraVolumes", "imagePullSecrets", "nameOverride",
    "fullnameOverride")


def older_values(paths: tuple[str, ...]) -> dict[str, Any]:
    """This chart's values.yaml without ``paths`` (dotted): an older chart's defaults."""
    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    for path in paths:
        *parents, last = path.split(".")
        node = values
        for key in parents:
            node = node[key]
        del node[last]
    return values


@pytest.mark.parametrize("absent", [*[(p,) for p in ADDED_SINCE_THE_FIRST_CHART],
                                    ADDED_SINCE_THE_FIRST_CHART],
                         ids=[*ADDED_SINCE_THE_FIRST_CHART, "all"])
def test_values_an_older_release_lacks_render_as_a_fresh_install(
    helm: Path, tmp_path: Path, absent: tuple[str, ...]
) -> None:
    """`helm upgrade --reuse-values` of a release an older chart made: each value added since
    is absent, and renders as this chart's default would. Absent, operator.enabled removed the
    operator's Deployment, ServiceAccount, RBAC, kubeconfig and Service (only the policies
    ConfigMap was left); sidecar.shutdownGraceSeconds rendered --shutdown-grace= (opgate
    exits 2 at start, a crash loop); sidecar.audit or sidecar.capture failed the upgrade (nil
    pointer); sidecar.tmpSizeLimit left /tmp's emptyDir without a limit."""
    import shutil

    chart = tmp_path / "opgate"
    shutil.copytree(CHART, chart)
    (chart / "values.yaml").write_text(yaml.safe_dump(older_values(absent)))
    sets = ("redis.url=redis://redis:6379/0",)
    assert _render(helm, *sets, chart=chart) == _render(helm, *sets)
