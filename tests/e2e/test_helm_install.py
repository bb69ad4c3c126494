"""The Helm chart installed, upgraded, rolled back and uninstalled in the real kube-apiserver.

There is no kubelet (pods never run), but helm's releases, the objects the apiserver accepts and
its RBAC answers (``kubectl auth can-i`` as the chart's ServiceAccount) are real. Rendering-only
checks live in ``test_helm.py``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.cli_parser import build_parser
from proxy.envtest.cluster import LocalCluster
from tests.e2e.test_helm import ADDED_SINCE_THE_FIRST_CHART, older_values

pytestmark = pytest.mark.e2e

CHART = Path(__file__).resolve().parents[2] / "helm" / "opgate"


class Kube:
    """helm and kubectl against ``cluster``, in one namespace."""

    def __init__(self, helm: Path, kubectl: Path, cluster: LocalCluster, namespace: str) -> None:
        self.helm, self.kubectl, self.cluster, self.ns = helm, kubectl, cluster, namespace
        cluster.create_namespace(namespace)

    def run_helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        out = subprocess.run([str(self.helm), "--kubeconfig", self.cluster.kubeconfig_path,
                              "-n", self.ns, *args], capture_output=True, text=True)
        if check:
            assert out.returncode == 0, out.stdout + out.stderr
        return out

    def get(self, kind: str, name: str) -> dict[str, Any]:
        out = subprocess.run([str(self.kubectl), "--kubeconfig", self.cluster.kubeconfig_path,
                              "-n", self.ns, "get", kind, name, "-o", "json"],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        doc: dict[str, Any] = json.loads(out.stdout)
        return doc

    def names(self, kinds: str) -> list[str]:
        out = subprocess.run([str(self.kubectl), "--kubeconfig", self.cluster.kubeconfig_path,
                              "-n", self.ns, "get", kinds, "-l",
                              "app.kubernetes.io/managed-by=Helm", "-o", "name"],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return sorted(out.stdout.split())

    def can_i(self, sa: str, verb: str, what: str, *, namespace: str = "") -> bool:
        """Whether the apiserver lets the ServiceAccount ``sa`` of this namespace (with the
        groups its token carries) do ``verb`` on ``what`` (``resource[.group]`` in
        ``namespace``, every one when empty, or a ``/path``): a SubjectAccessReview."""
        attrs: dict[str, Any]
        if what.startswith("/"):
            attrs = {"nonResourceAttributes": {"verb": verb, "path": what}}
        else:
            resource, _, group = what.partition(".")
            attrs = {"resourceAttributes": {"verb": verb, "resource": resource, "group": group,
                                            "namespace": namespace}}
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                  "spec": {"user": f"system:serviceaccount:{self.ns}:{sa}",
                           "groups": ["system:serviceaccounts",
                                      f"system:serviceaccounts:{self.ns}",
                                      "system:authenticated"], **attrs}}
        out = subprocess.run([str(self.kubectl), "--kubeconfig", self.cluster.kubeconfig_path,
                              "create", "-o", "json", "-f", "-"], input=json.dumps(review),
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return bool(json.loads(out.stdout)["status"].get("allowed"))


def _sidecar_args(deployment: dict[str, Any]) -> list[str]:
    [sidecar] = [c for c in deployment["spec"]["template"]["spec"]["containers"]
                 if c["name"] == "opgate"]
    return list(sidecar["args"])


def test_install_upgrade_rollback_uninstall(
    helm: Path, kubectl: Path, cluster: LocalCluster, tmp_path: Path
) -> None:
    """A policies-only upgrade changes the ConfigMap and leaves the pod template alone (opgate
    hot-reloads it; no rollout); a flag change rolls the pods; rollback and uninstall too."""
    kube = Kube(helm, kubectl, cluster, "helm-life")
    out = kube.run_helm("install", "life", str(CHART), "--set", "redis.url=redis://r:6379/0")
    assert "life-opgate-policies" in out.stdout  # NOTES name the ConfigMap to edit
    assert kube.names("deploy,cm,svc,sa") == [
        "configmap/life-opgate-kubeconfig", "configmap/life-opgate-policies",
        "deployment.apps/life-opgate", "service/life-opgate-metrics",
        "serviceaccount/life-opgate"]
    first = kube.get("deployment", "life-opgate")
    build_parser().parse_args(_sidecar_args(first))

    policy = tmp_path / "values.yaml"
    policy.write_text(yaml.safe_dump({"policies": {"operator.yaml": (
        "apiVersion: opgate.dev/v1alpha1\nkind: Policy\nmetadata: {name: operator}\n"
        "spec:\n  mode: observe\n")}}))
    kube.run_helm("upgrade", "life", str(CHART), "--reuse-values", "-f", str(policy))
    after_policy = kube.get("deployment", "life-opgate")
    assert after_policy["metadata"]["generation"] == first["metadata"]["generation"]
    assert after_policy["spec"]["template"] == first["spec"]["template"]
    cm = kube.get("configmap", "life-opgate-policies")
    assert "mode: observe" in cm["data"]["operator.yaml"]

    kube.run_helm("upgrade", "life", str(CHART), "--reuse-values", "--set",
                  "sidecar.logLevel=debug")
    after_flag = kube.get("deployment", "life-opgate")
    assert after_flag["metadata"]["generation"] == first["metadata"]["generation"] + 1
    assert build_parser().parse_args(_sidecar_args(after_flag)).log_level == "debug"

    kube.run_helm("rollback", "life", "1")
    rolled = kube.get("deployment", "life-opgate")
    assert rolled["spec"]["template"] == first["spec"]["template"]
    assert "mode: enforce" in kube.get("configmap", "life-opgate-policies")["data"][
        "operator.yaml"]

    kube.run_helm("uninstall", "life")
    assert kube.names("deploy,cm,svc,sa") == []
    assert kube.names("clusterrole,clusterrolebinding") == []


def test_no_policies_notes_name_no_configmap(
    helm: Path, kubectl: Path, cluster: LocalCluster
) -> None:
    kube = Kube(helm, kubectl, cluster, "helm-nopol")
    out = kube.run_helm("install", "bare", str(CHART), "--set", "policies=null")
    assert kube.names("cm") == ["configmap/bare-opgate-kubeconfig"]
    assert "bare-opgate-policies" not in out.stdout, out.stdout  # no such ConfigMap to edit
    assert "without --policies" in out.stdout
    kube.run_helm("uninstall", "bare")

    # policies of one's own (a ConfigMap of extraVolumes) by --policies in sidecar.extraArgs
    out = kube.run_helm("install", "own", str(CHART), "--set", "policies=null",
                        "--set", "sidecar.extraArgs={--policies=/etc/corp-policies}",
                        "--set", "extraVolumes[0].name=corp",
                        "--set", "extraVolumes[0].configMap.name=corp-policies",
                        "--set", "sidecar.extraVolumeMounts[0].name=corp",
                        "--set", "sidecar.extraVolumeMounts[0].mountPath=/etc/corp-policies")
    assert "without --policies" not in out.stdout, out.stdout
    assert "--policies of sidecar.extraArgs" in out.stdout, out.stdout
    kube.run_helm("uninstall", "own")


def _documented_sidecar_rules() -> list[dict[str, Any]]:
    """The rbac.sidecarRules that values.yaml's comment lists (``#     - {apiGroups: ...}``)."""
    text = (CHART / "values.yaml").read_text()
    rules = [yaml.safe_load(m) for m in re.findall(r"^ *# +- (\{apiGroups:.*\})$", text, re.M)]
    assert len(rules) >= 5, rules
    return rules


def test_documented_sidecar_rules_cover_opgates_calls(
    helm: Path, kubectl: Path, cluster: LocalCluster, tmp_path: Path
) -> None:
    """Each call opgate makes with the pod's ServiceAccount (identity: TokenReview,
    SubjectAccessReview, the cluster's JWKS; spec.quotas: list/watch of the counted resources,
    ResourceQuotas, namespaces, ClusterResourceQuotas) is allowed with the rules values.yaml
    documents, and none of them without (the chart grants nothing it is not given) but what
    the operator's own rules hold (the sample reconciler lists and watches its ConfigMaps)."""
    kube = Kube(helm, kubectl, cluster, "helm-rbac")
    calls = [("create", "tokenreviews.authentication.k8s.io"),
             ("create", "subjectaccessreviews.authorization.k8s.io"),
             ("list", "configmaps"), ("watch", "configmaps"),
             ("list", "resourcequotas"), ("watch", "resourcequotas"),
             ("list", "namespaces"), ("watch", "namespaces"),
             ("list", "clusterresourcequotas.quota.openshift.io"),
             ("watch", "clusterresourcequotas.quota.openshift.io")]
    operators = {("list", "configmaps"), ("watch", "configmaps")}  # rbac.rules' defaults
    kube.run_helm("install", "plain", str(CHART))
    for call in calls:
        assert kube.can_i("plain-opgate", *call) == (call in operators), call
    # the cluster's OIDC discovery, for identity's service-account tokens, and API discovery
    # (the quota counter's and the instanceAnnotation informers'): any ServiceAccount
    for url in ("/.well-known/openid-configuration", "/openid/v1/jwks", "/apis",
                "/apis/demo.opgate.dev/v1", "/api/v1"):
        assert kube.can_i("plain-opgate", "get", url), url
    values = tmp_path / "rbac.yaml"
    values.write_text(yaml.safe_dump({"rbac": {"sidecarRules": _documented_sidecar_rules()}}))
    kube.run_helm("upgrade", "plain", str(CHART), "-f", str(values))
    for call in calls:
        assert kube.can_i("plain-opgate", *call), call
    # the operator's own rules (the sample reconciler's) still hold, nothing more
    assert kube.can_i("plain-opgate", "patch", "widgets.demo.opgate.dev")
    assert not kube.can_i("plain-opgate", "get", "secrets")
    kube.run_helm("uninstall", "plain")


def test_policy_files_reach_the_configmap_as_written(
    helm: Path, kubectl: Path, cluster: LocalCluster, tmp_path: Path
) -> None:
    """What opgate reads under --policies is each file byte for byte: one starting with an
    indented comment (which broke the chart's ``|`` block), one without a final newline, one
    with trailing spaces."""
    files = {
        "indented.yaml": "  # the team's header, indented\napiVersion: opgate.dev/v1alpha1\n"
                         "kind: Policy\nmetadata: {name: indented}\nspec: {mode: enforce}\n",
        "bare.yaml": "apiVersion: opgate.dev/v1alpha1\nkind: Policy\nmetadata: {name: bare}\n"
                     "spec: {mode: observe}",
        "spaces.yaml": "apiVersion: opgate.dev/v1alpha1  \nkind: Policy\n"
                       "metadata: {name: spaces}\nspec: {mode: enforce}\n",
    }
    values = tmp_path / "policies.yaml"
    values.write_text(yaml.safe_dump({"policies": files}))
    kube = Kube(helm, kubectl, cluster, "helm-files")
    kube.run_helm("install", "files", str(CHART), "-f", str(values))
    data = kube.get("configmap", "files-opgate-policies")["data"]
    assert {k: data[k] for k in files} == files
    deployment = kube.get("deployment", "files-opgate")
    assert build_parser().parse_args(_sidecar_args(deployment)).policies == (
        "/etc/opgate/policies")
    kube.run_helm("uninstall", "files")


def test_one_release_name_in_two_namespaces(
    helm: Path, kubectl: Path, cluster: LocalCluster
) -> None:
    """A platform team installs the same operator chart as ``my-op`` in each team's namespace:
    the ClusterRole and its binding are cluster-scoped, so they must not be named after the
    release alone (helm refused the second install: the first release owned "my-op-opgate").
    Each binds its own namespace's ServiceAccount, and uninstalling one leaves the other's."""
    team_a = Kube(helm, kubectl, cluster, "helm-team-a")
    team_b = Kube(helm, kubectl, cluster, "helm-team-b")
    team_a.run_helm("install", "my-op", str(CHART))
    team_b.run_helm("install", "my-op", str(CHART))
    for kube in (team_a, team_b):
        assert kube.can_i("my-op-opgate", "patch", "widgets.demo.opgate.dev")
    team_a.run_helm("uninstall", "my-op")
    assert not team_a.can_i("my-op-opgate", "patch", "widgets.demo.opgate.dev")
    assert team_b.can_i("my-op-opgate", "patch", "widgets.demo.opgate.dev")
    team_b.run_helm("uninstall", "my-op")
    assert team_b.names("clusterrole,clusterrolebinding") == []


def test_auto_native_follows_the_clusters_version(
    helm: Path, kubectl: Path, cluster: LocalCluster
) -> None:
    """At helm install .Capabilities.KubeVersion is the apiserver's (1.35 here), not helm's
    guess: sidecar.native=auto makes opgate a native sidecar, which the apiserver stores as
    such; an upgrade back to false moves it among the pod's containers again."""
    kube = Kube(helm, kubectl, cluster, "helm-native")
    kube.run_helm("install", "gate", str(CHART), "--set", "sidecar.native=auto")
    pod = kube.get("deployment", "gate-opgate")["spec"]["template"]["spec"]
    [sidecar] = pod["initContainers"]
    assert (sidecar["name"], sidecar["restartPolicy"]) == ("opgate", "Always")
    assert "lifecycle" not in sidecar
    assert [c["name"] for c in pod["containers"]] == ["operator"]
    build_parser().parse_args(sidecar["args"])

    kube.run_helm("upgrade", "gate", str(CHART), "--reuse-values", "--set", "sidecar.native=false")
    pod = kube.get("deployment", "gate-opgate")["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    assert [c["name"] for c in pod["containers"]] == ["operator", "opgate"]
    kube.run_helm("uninstall", "gate")


def test_reuse_values_upgrade_of_a_release_an_older_chart_made(
    helm: Path, kubectl: Path, cluster: LocalCluster, tmp_path: Path
) -> None:
    """A platform team upgrades a release the first chart made with `helm upgrade
    --reuse-values` (helm then renders with that release's values, its chart's defaults
    included: none of the values added since). The upgrade leaves the same objects and pod as
    a fresh install: it removed the operator's Deployment, ServiceAccount, RBAC, kubeconfig and
    metrics Service (operator.enabled absent), leaving the policies ConfigMap alone."""
    old = tmp_path / "opgate-old"
    (old / "templates").mkdir(parents=True)
    shutil.copy(CHART / "Chart.yaml", old / "Chart.yaml")
    # the older chart's values and a template reading them; its objects are the new one's
    (old / "values.yaml").write_text(yaml.safe_dump(older_values(ADDED_SINCE_THE_FIRST_CHART)))
    (old / "templates" / "configmap.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: {{ .Release.Name }}-opgate-policies}\n"
        "data: {{- toYaml .Values.policies | nindent 2 }}\n")
    upgraded = Kube(helm, kubectl, cluster, "helm-reuse-old")
    upgraded.run_helm("install", "op", str(old), "--set", "redis.url=redis://r:6379/0")
    upgraded.run_helm("upgrade", "op", str(CHART), "--reuse-values")
    fresh = Kube(helm, kubectl, cluster, "helm-reuse-new")
    fresh.run_helm("install", "op", str(CHART), "--set", "redis.url=redis://r:6379/0")
    assert upgraded.names("deploy,cm,svc,sa") == fresh.names("deploy,cm,svc,sa")
    template = upgraded.get("deployment", "op-opgate")["spec"]["template"]
    assert template == fresh.get("deployment", "op-opgate")["spec"]["template"]
    assert build_parser().parse_args(_sidecar_args({"spec": {"template": template}})).replicas
    assert upgraded.can_i("op-opgate", "patch", "widgets.demo.opgate.dev")
    for kube in (upgraded, fresh):
        kube.run_helm("uninstall", "op")


def _notes_command(notes: str, what: str) -> str:
    """The command NOTES print on the line of ``what`` (e.g. ``policies``)."""
    [line] = [ln for ln in notes.splitlines() if ln.strip().startswith(what + " ")]
    return line.strip()[len(what):].strip()


def test_the_notes_way_to_change_the_policies_keeps_the_release_upgradable(
    helm: Path, kubectl: Path, cluster: LocalCluster, tmp_path: Path
) -> None:
    """The policy change the install's NOTES tell, run as printed (CHART and FILE filled in):
    the ConfigMap holds the new policy, the pods stay (opgate reloads it), and the release's
    next upgrade still goes through and keeps it. The NOTES said `kubectl edit configmap`:
    the edit took .data from helm's field manager, and every later `helm upgrade` (helm 4
    applies server-side) failed with 'conflict with "kubectl-edit"' until --force-conflicts,
    which would put the chart's policies back."""
    kube = Kube(helm, kubectl, cluster, "helm-notes")
    out = kube.run_helm("install", "gate", str(CHART))
    command = _notes_command(out.stdout, "policies")
    first = kube.get("deployment", "gate-opgate")
    policy = ("apiVersion: opgate.dev/v1alpha1\nkind: Policy\nmetadata: {name: operator}\n"
              "spec:\n  mode: observe\n")
    (tmp_path / "operator.yaml").write_text(policy)
    editor = tmp_path / "editor.py"  # what a person does in $EDITOR, for a `kubectl edit`
    editor.write_text("import sys, yaml\nf = sys.argv[1]\ndoc = yaml.safe_load(open(f))\n"
                      f"doc['data'] = {{'operator.yaml': {policy!r}}}\n"
                      "open(f, 'w').write(yaml.safe_dump(doc))\n")
    env = {"PATH": f"{helm.parent}:{kubectl.parent}:/usr/bin:/bin",
           "KUBECONFIG": cluster.kubeconfig_path, "EDITOR": f"{sys.executable} {editor}",
           "HOME": str(tmp_path)}
    ran = subprocess.run(command.replace("CHART", str(CHART)).replace("FILE", "operator.yaml"),
                         shell=True, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert ran.returncode == 0, command + "\n" + ran.stdout + ran.stderr
    assert kube.get("configmap", "gate-opgate-policies")["data"] == {"operator.yaml": policy}
    assert kube.get("deployment", "gate-opgate")["spec"]["template"] == first["spec"]["template"]

    kube.run_helm("upgrade", "gate", str(CHART), "--reuse-values",
                  "--set", "sidecar.logLevel=debug")
    assert kube.get("configmap", "gate-opgate-policies")["data"] == {"operator.yaml": policy}
    kube.run_helm("uninstall", "gate")


def test_the_notes_know_a_redis_url_from_a_secret(
    helm: Path, kubectl: Path, cluster: LocalCluster
) -> None:
    """The README's way for a URL that must hold a secret (OPGATE_REDIS_URL in sidecar.env from
    a Secret, redis.url empty) shares the budgets through Redis: the NOTES said 'no
    redis.url: rate-limit buckets and quota reservations are per pod' all the same."""
    kube = Kube(helm, kubectl, cluster, "helm-notes-redis")
    out = kube.run_helm("install", "gate", str(CHART),
                        "--set", "sidecar.env[0].name=OPGATE_REDIS_URL",
                        "--set", "sidecar.env[0].valueFrom.secretKeyRef.name=redis-url",
                        "--set", "sidecar.env[0].valueFrom.secretKeyRef.key=url")
    assert "per pod" not in out.stdout, out.stdout
    kube.run_helm("uninstall", "gate")
    out = kube.run_helm("install", "gate", str(CHART))
    assert "no redis.url: rate-limit buckets and quota reservations are per pod" in out.stdout
    kube.run_helm("uninstall", "gate")
