"""The sample operator (examples/reconciler) as a process behind a real opgate and apiserver.

It authenticates with a ServiceAccount token from the TokenRequest API and the RBAC of
``rbac.yaml``; its kubeconfig points only at opgate. 50 Widgets are created at once, a few are
changed, then all are deleted, and the cluster is checked after each step: ConfigMaps with the
right data and controller reference, finalizers, status. No controller-manager (hence no garbage
collector) runs here, so a ConfigMap that disappears was deleted by the operator's finalizer.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.envtest.cluster import LocalCluster
from proxy.envtest.procs import Proc, free_port, tail
from tests.e2e.conftest import Opgate

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "reconciler"
NAMESPACE = "widgets-e2e"  # namespaces never finish deleting without a controller-manager
WIDGETS = 50
CHANGED = (0, 7, 13, 21, 42)
DEADLINE = 120.0
GROUP_PATH = "/apis/demo.opgate.dev/v1"
THROTTLED_NAMESPACE = "widgets-e2e-throttled"
CHART_NAMESPACE = "widgets-e2e-chart"
EMPTY_NAMESPACE = "widgets-e2e-empty"
OWNED_NAMESPACE = "widgets-e2e-owned"
REFUSED_NAMESPACE = "widgets-e2e-refused"
RESTORED_WITHIN = 10.0  # seconds: a watch event and one reconcile, not a resync
FINALIZER = "demo.opgate.dev/cleanup"
COLORS = ("red", "green", "blue", "amber", "violet")
# every Widget gets its own write budget, keyed by the Opgate-Instance header the operator sends
PER_INSTANCE_POLICY = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {name: e2e-per-widget}
spec:
  mode: enforce
  rateLimits:
    - name: per-widget-writes
      match: {verbs: [create, update, patch, delete]}
      key: "{instance}"
      qps: 1
      burst: 5
      onExceed: reject
"""


@dataclass
class Env:
    cluster: LocalCluster
    gate: Opgate
    kubeconfig: Path
    workdir: Path


@pytest.fixture(scope="module")
def operator_token(cluster: LocalCluster) -> str:
    """CRD and rbac.yaml installed; a TokenRequest token of opgate-demo/sample-operator."""
    cluster.install_crd((EXAMPLE / "widget-crd.yaml").read_text())
    for doc in yaml.safe_load_all((EXAMPLE / "rbac.yaml").read_text()):
        cluster.apply(doc)
    for namespace in (NAMESPACE, THROTTLED_NAMESPACE, EMPTY_NAMESPACE, OWNED_NAMESPACE,
                      REFUSED_NAMESPACE):
        cluster.create_namespace(namespace)
    return cluster.token_request("opgate-demo", "sample-operator", expiration_seconds=3600)


def make_env(cluster: LocalCluster, gate: Opgate, token: str, workdir: Path) -> Env:
    # opgate serves HTTPS with a cert from the cluster CA, so the operator's own token reaches
    # the apiserver and the RBAC of rbac.yaml is what authorizes it
    kubeconfig = cluster.write_kubeconfig(
        workdir / "operator.kubeconfig", server=gate.url, token=token,
        ca_file=cluster.ca_file if gate.url.startswith("https://") else None)
    return Env(cluster=cluster, gate=gate, kubeconfig=kubeconfig, workdir=workdir)


@contextlib.contextmanager
def running_operator(env: Env, *args: str) -> Iterator[Proc]:
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    proc = Proc("reconciler", [
        sys.executable, "-m", "examples.reconciler", "--kubeconfig", str(env.kubeconfig),
        "--log-format", "json", "--workers", "4", *args,
    ], log=env.workdir / "reconciler.log", env=dict(os.environ, PYTHONPATH=pythonpath), cwd=REPO)
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()  # by its process group id (= its pid); a no-op once the test stopped it


# -- expectations ---------------------------------------------------------------------------

def widgets_path(namespace: str) -> str:
    return f"{GROUP_PATH}/namespaces/{namespace}/widgets"


def configmaps_path(namespace: str) -> str:
    return f"/api/v1/namespaces/{namespace}/configmaps"


def name_of(i: int) -> str:
    return f"w-{i:02d}"


def initial_spec(i: int) -> dict[str, Any]:
    return {"color": COLORS[i % len(COLORS)], "data": {"index": str(i), "name": name_of(i)}}


def problems(cluster: LocalCluster, specs: dict[str, dict[str, Any]], namespace: str
             ) -> list[str]:
    """Everything that differs from "every Widget reconciled to ``specs``" (empty: all good)."""
    widgets = {w["metadata"]["name"]: w
               for w in cluster.call("GET", widgets_path(namespace)).ok().json()["items"]}
    cms = {c["metadata"]["name"]: c
           for c in cluster.call("GET", configmaps_path(namespace)).ok().json()["items"]}
    out: list[str] = []
    for name, spec in specs.items():
        w, cm = widgets.get(name), cms.get(name)
        if w is None:
            out.append(f"{name}: widget missing")
            continue
        meta, status = w["metadata"], w.get("status") or {}
        if w["spec"] != spec:
            out.append(f"{name}: spec not yet {spec}")
        if FINALIZER not in (meta.get("finalizers") or []):
            out.append(f"{name}: no finalizer")
        if status.get("observedGeneration") != meta["generation"]:
            out.append(f"{name}: observedGeneration {status.get('observedGeneration')} "
                       f"!= generation {meta['generation']}")
        ready = [c for c in status.get("conditions") or [] if c.get("type") == "Ready"]
        if not ready or (ready[0]["status"], ready[0]["reason"],
                         ready[0].get("observedGeneration")) != ("True", "Reconciled",
                                                                 meta["generation"]):
            out.append(f"{name}: Ready condition {ready}")
        elif not ready[0].get("lastTransitionTime"):
            out.append(f"{name}: Ready has no lastTransitionTime")
        if cm is None:
            out.append(f"{name}: configmap missing")
            continue
        if (cm.get("data") or {}) != spec.get("data", {}):  # the apiserver omits an empty one
            out.append(f"{name}: configmap data {cm.get('data')} != {spec.get('data')}")
        want_ref = {"apiVersion": "demo.opgate.dev/v1", "kind": "Widget", "name": name,
                    "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}
        if cm["metadata"].get("ownerReferences") != [want_ref]:
            out.append(f"{name}: ownerReferences {cm['metadata'].get('ownerReferences')}")
    return out


def leftovers(cluster: LocalCluster, namespace: str) -> list[str]:
    widgets = cluster.call("GET", widgets_path(namespace)).ok().json()["items"]
    cms = cluster.call("GET", configmaps_path(namespace)).ok().json()["items"]
    return ([f"widget {w['metadata']['name']} still there "
             f"(finalizers {w['metadata'].get('finalizers')})" for w in widgets]
            + [f"configmap {c['metadata']['name']} still there" for c in cms])


def wait_for(check: Callable[[], list[str]], *, what: str, env: Env, proc: Proc,
             deadline: float = DEADLINE) -> float:
    started = time.monotonic()
    left = check()
    while left and time.monotonic() - started < deadline:
        if not proc.alive():
            break
        time.sleep(0.5)
        left = check()
    if left:
        pytest.fail(
            f"{what}: {len(left)} problems after {time.monotonic() - started:.0f}s "
            f"(operator {'alive' if proc.alive() else 'exited'}):\n  " + "\n  ".join(left[:15])
            + f"\n--- reconciler log:\n{tail(proc.log, 40)}\n--- opgate log:\n"
            f"{env.gate.log_tail(40)}", pytrace=False)
    return time.monotonic() - started


def all_at_once(calls: list[Callable[[], Any]]) -> None:
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        for future in [pool.submit(call) for call in calls]:
            future.result()


def create_widgets(cluster: LocalCluster, namespace: str, specs: dict[str, dict[str, Any]]
                   ) -> None:
    all_at_once([
        lambda name=name, spec=spec: cluster.call("POST", widgets_path(namespace), body={
            "apiVersion": "demo.opgate.dev/v1", "kind": "Widget",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}).ok()
        for name, spec in specs.items()])


def delete_all_and_wait(cluster: LocalCluster, namespace: str, names: Iterable[str], *,
                        env: Env, proc: Proc) -> float:
    all_at_once([lambda name=name: cluster.call(
        "DELETE", f"{widgets_path(namespace)}/{name}").ok() for name in names])
    return wait_for(lambda: leftovers(cluster, namespace), what="after deleting", env=env,
                    proc=proc)


def patch_widget(cluster: LocalCluster, namespace: str, name: str, patch: dict[str, Any]) -> None:
    cluster.call("PATCH", f"{widgets_path(namespace)}/{name}", body=patch,
                 content_type="application/merge-patch+json").ok()


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines()
            if "Traceback (most recent call last)" in line or " ERROR " in line
            or " CRITICAL " in line or '"level": "ERROR"' in line]


def access_log(gate: Opgate, *, until: Callable[[list[dict[str, Any]]], bool]
               ) -> list[dict[str, Any]]:
    """opgate's access-log entries; a call is logged when it ends (a watch: when the operator
    left), so wait a little for ``until`` to hold."""
    deadline = time.monotonic() + 10
    while True:
        entries = []
        for line in gate.log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    entry = json.loads(line)
                    if isinstance(entry, dict) and "verb" in entry:
                        entries.append(entry)
        if until(entries) or time.monotonic() > deadline:
            return entries
        time.sleep(0.2)


def stop_cleanly(proc: Proc) -> str:
    """SIGTERM to the operator's process group (SIGKILL after 10 s); its log if it exited 0."""
    code = proc.stop()
    text = proc.log.read_text(errors="replace")
    assert code == 0, f"operator exit code {code}:\n{tail(proc.log, 40)}"
    assert '"msg": "stopped"' in text
    assert not error_lines(text), "\n".join(error_lines(text)[:10])
    return text


def has_watch(entries: list[dict[str, Any]]) -> bool:
    return any(e["verb"] == "watch" for e in entries)


# -- the tests ------------------------------------------------------------------------------

def test_widgets_reconciled_through_opgate(
    cluster: LocalCluster, operator_token: str, opgate_factory: Callable[..., Opgate],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    env = make_env(cluster, opgate_factory(), operator_token, tmp_path_factory.mktemp("op"))
    with running_operator(env) as operator:  # all namespaces
        specs = {name_of(i): initial_spec(i) for i in range(WIDGETS)}
        create_widgets(cluster, NAMESPACE, specs)
        took_create = wait_for(lambda: problems(cluster, specs, NAMESPACE),
                               what="after creating 50 widgets", env=env, proc=operator)

        for i in CHANGED:  # merge patch: "name" goes away, "updated" appears, the color changes
            specs[name_of(i)] = {"color": "black", "data": {"index": str(i), "updated": "yes"}}
            patch_widget(cluster, NAMESPACE, name_of(i), {"spec": {
                "color": "black", "data": {"name": None, "updated": "yes"}}})
        took_update = wait_for(lambda: problems(cluster, specs, NAMESPACE),
                               what="after changing 5 widgets", env=env, proc=operator)
        for i in CHANGED:
            cm = cluster.call("GET", f"{configmaps_path(NAMESPACE)}/{name_of(i)}").ok().json()
            assert cm["metadata"]["annotations"]["demo.opgate.dev/color"] == "black"

        all_at_once([lambda name=name: cluster.call(
            "DELETE", f"{widgets_path(NAMESPACE)}/{name}").ok() for name in specs])
        took_delete = wait_for(lambda: leftovers(cluster, NAMESPACE),
                               what="after deleting 50 widgets", env=env, proc=operator)
        op_log = stop_cleanly(operator)

    reconciles = [json.loads(line) for line in op_log.splitlines()
                  if line.startswith("{") and '"msg": "reconciled"' in line]
    created = {e["widget"] for e in reconciles if "configmap-created" in e["result"]}
    finalized = {e["widget"] for e in reconciles if "finalizer-removed" in e["result"]}
    assert created == finalized == {f"{NAMESPACE}/{name}" for name in specs}

    calls = access_log(env.gate, until=has_watch)
    gate_log = env.gate.log.read_text(errors="replace")
    assert not error_lines(gate_log), "\n".join(error_lines(gate_log)[:10])
    assert calls, f"no access-log lines in opgate's log:\n{env.gate.log_tail(20)}"
    assert not [c for c in calls if int(c.get("code") or 0) >= 500], "opgate relayed a 5xx"
    assert ("watch", "widgets.demo.opgate.dev") in {(c["verb"], c.get("resource")) for c in calls}
    assert sum(1 for c in calls if (c["verb"], c.get("resource"), c.get("code"))
               == ("create", "configmaps", 201)) == WIDGETS
    print(f"\n50 widgets created: reconciled in {took_create:.1f}s; 5 changed: "
          f"{took_update:.1f}s; 50 deleted: {took_delete:.1f}s; {len(reconciles)} reconciles, "
          f"{len(calls)} calls through opgate")


def test_noisy_widget_throttled_alone_and_retry_after_honoured(
    cluster: LocalCluster, operator_token: str, opgate_factory: Callable[..., Opgate],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    gate = opgate_factory(policies={"per-widget.yaml": PER_INSTANCE_POLICY})
    env = make_env(cluster, gate, operator_token, tmp_path_factory.mktemp("op-throttled"))
    ns = THROTTLED_NAMESPACE
    with running_operator(env, "--namespace", ns) as operator:
        specs = {f"quiet-{i}": {"data": {"i": str(i)}} for i in range(8)}
        specs["noisy"] = {"data": {"tick": "0"}}
        create_widgets(cluster, ns, specs)
        wait_for(lambda: problems(cluster, specs, ns), what="after creating", env=env,
                 proc=operator)
        for tick in range(1, 13):  # each change costs the operator 2 writes (PUT + status)
            patch_widget(cluster, ns, "noisy", {"spec": {"data": {"tick": str(tick)}}})
            specs["noisy"] = {"data": {"tick": str(tick)}}
            time.sleep(0.15)
        for i in range(8):
            specs[f"quiet-{i}"] = {"data": {"i": str(i), "changed": "yes"}}
            patch_widget(cluster, ns, f"quiet-{i}", {"spec": {"data": {"changed": "yes"}}})
        wait_for(lambda: problems(cluster, specs, ns), what="after the noisy burst", env=env,
                 proc=operator)
        delete_all_and_wait(cluster, ns, specs, env=env, proc=operator)
        stop_cleanly(operator)

    calls = access_log(gate, until=has_watch)
    throttled = [c for c in calls if c["code"] == 429]
    assert throttled, "the noisy widget never hit its budget"
    assert {c.get("name") for c in throttled} == {"noisy"}, "a quiet widget was throttled"
    # each retry of a rejected call came after the server's Retry-After (1 s at qps 1)
    stamp = {id(c): datetime.fromisoformat(c["time"].replace("Z", "+00:00")) for c in calls}
    for c in throttled:
        later = [n for n in calls if stamp[id(n)] > stamp[id(c)] and n["verb"] == c["verb"]
                 and n.get("name") == c.get("name") and n.get("resource") == c.get("resource")
                 and n.get("subresource") == c.get("subresource")]
        assert later, f"a throttled {c['verb']} was never retried"
        gap = (min(stamp[id(n)] for n in later) - stamp[id(c)]).total_seconds()
        assert gap >= 0.9, f"retried {gap:.2f}s after a 429 with Retry-After: 1"


def test_operator_with_the_helm_charts_kubeconfig(
    cluster: LocalCluster, operator_token: str, opgate_factory: Callable[..., Opgate],
    helm: Path, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The chart's set-up: the operator's kubeconfig (rendered by the real helm) names the
    sidecar and no user, so the operator sends no token and opgate adds the pod's own
    (``--token-file``, here the sample operator's ServiceAccount token) to every call."""
    workdir = tmp_path_factory.mktemp("op-chart")
    token_file = workdir / "token"
    token_file.write_text(operator_token)
    gate = opgate_factory(tls=False, extra_args=["--token-file", str(token_file)])
    out = subprocess.run(
        [str(helm), "template", "demo", str(REPO / "helm" / "opgate"),
         "--set", f"sidecar.listen=127.0.0.1:{gate.port}"],
        capture_output=True, text=True, check=True).stdout
    [config_map] = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "ConfigMap"
                    and d["metadata"]["name"].endswith("-kubeconfig")]
    kubeconfig = workdir / "config"
    kubeconfig.write_text(config_map["data"]["config"])
    assert "users" not in yaml.safe_load(kubeconfig.read_text())
    env = Env(cluster=cluster, gate=gate, kubeconfig=kubeconfig, workdir=workdir)
    ns = CHART_NAMESPACE
    cluster.create_namespace(ns)
    with running_operator(env, "--namespace", ns) as operator:
        specs = {f"chart-{i}": {"data": {"i": str(i)}} for i in range(5)}
        create_widgets(cluster, ns, specs)
        wait_for(lambda: problems(cluster, specs, ns), what="after creating", env=env,
                 proc=operator)
        delete_all_and_wait(cluster, ns, specs, env=env, proc=operator)
        stop_cleanly(operator)
    calls = access_log(gate, until=has_watch)
    assert sum(1 for c in calls if (c["verb"], c.get("resource"), c.get("code"))
               == ("create", "configmaps", 201)) == len(specs), "no calls through opgate"
    assert not [c for c in calls if int(c.get("code") or 0) in (401, 403)], \
        "a call was refused: opgate did not add the pod's token"


def _run_it_lines(start: str) -> list[list[str]]:
    """The command lines of the example README's "Run it" that start with ``start`` (comments
    and a trailing ``&`` left out)."""
    text = (EXAMPLE / "README.md").read_text(encoding="utf-8")
    block = text.split("## Run it", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line.split("#", 1)[0].strip().removesuffix("&"))
            for line in block.splitlines() if line.startswith(start)]


def test_the_example_readmes_run_it_steps_reconcile(
    cluster: LocalCluster, operator_token: str, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """examples/reconciler/README.md's "Run it", as written: opgate started with its
    ``opgate serve`` line (the kubeconfig the ``kubectl apply`` lines used is the one at hand,
    and ``<apiserver>`` and ``ca.crt`` stand for the cluster's), the operator with each of its
    lines, a Widget in the namespace it watches. Its ConfigMap must appear: the line without
    opgate's own identity answered every call 503 (no TokenReview without credentials), and
    the line for a namespace the demo policy lets it write nowhere else got 403s only."""
    workdir = tmp_path_factory.mktemp("op-readme")
    [serve] = _run_it_lines("opgate serve")
    operators = _run_it_lines("python -m examples.reconciler")
    assert serve[:2] == ["opgate", "serve"] and operators
    host = cluster.url.removeprefix("https://")
    port, admin_port = free_port(), free_port()
    argv = [sys.executable, "-m", "proxy", *(
        arg.replace("<apiserver>", host).replace("ca.crt", cluster.ca_file) for arg in serve[1:]),
        "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin_port}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "OPGATE_"))}
    env.update(KUBECONFIG=cluster.kubeconfig_path, HOME=str(workdir),
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p))
    gate = Opgate(port=port, admin_port=admin_port, policies_dir=REPO / "policies" / "demo",
                  log=workdir / "opgate.log", tls=False,
                  proc=Proc("opgate", argv, log=workdir / "opgate.log", env=env, cwd=REPO))
    gate.proc.start()
    try:
        kubeconfig = cluster.write_kubeconfig(workdir / "operator.kubeconfig", server=gate.url,
                                              token=operator_token)
        for i, line in enumerate(operators):
            args = line[line.index("--kubeconfig") + 2:]  # the README's own kubeconfig aside
            namespace = args[args.index("-n") + 1] if "-n" in args else "opgate-demo"
            cluster.create_namespace(namespace)
            run = Env(cluster=cluster, gate=gate, kubeconfig=kubeconfig, workdir=workdir)
            with running_operator(run, *args) as operator:
                specs = {f"readme-{i}": {"color": "blue", "data": {"size": "3"}}}
                create_widgets(cluster, namespace, specs)
                wait_for(lambda s=specs, n=namespace: problems(cluster, s, n),
                         what=shlex.join(line), env=run, proc=operator)
                delete_all_and_wait(cluster, namespace, specs, env=run, proc=operator)
                stop_cleanly(operator)
    finally:
        gate.proc.stop()


def reconciles_of(proc: Proc) -> list[dict[str, Any]]:
    return [json.loads(line) for line in proc.log.read_text(errors="replace").splitlines()
            if line.startswith("{") and '"msg": "reconciled"' in line]


def test_a_widget_without_data_is_not_written_again_and_again(
    cluster: LocalCluster, operator_token: str, opgate_factory: Callable[..., Opgate],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The ConfigMap of a Widget with no spec.data (it is optional) comes back from the
    apiserver with no data at all (empty is omitted), which the operator took for {} to
    write: it PUT the ConfigMap again on every reconcile of that Widget, forever, each PUT
    a write against opgate's budgets and the apiserver's."""
    gate = opgate_factory()
    env = make_env(cluster, gate, operator_token, tmp_path_factory.mktemp("op-empty"))
    ns = EMPTY_NAMESPACE
    with running_operator(env, "--namespace", ns) as operator:
        specs: dict[str, dict[str, Any]] = {"bare": {"color": "teal"}, "cleared": {
            "data": {"a": "1"}}}
        create_widgets(cluster, ns, specs)
        wait_for(lambda: problems(cluster, specs, ns), what="after creating", env=env,
                 proc=operator)
        patch_widget(cluster, ns, "cleared", {"spec": {"data": None}})
        specs["cleared"] = {}
        wait_for(lambda: problems(cluster, specs, ns), what="after clearing", env=env,
                 proc=operator)
        for poke in range(3):  # a change of a label: an event, a reconcile, nothing to write
            seen = len(reconciles_of(operator))
            for name in specs:
                patch_widget(cluster, ns, name, {"metadata": {"labels": {"poke": str(poke)}}})
            wait_for(lambda seen=seen: [] if len(reconciles_of(operator)) >= seen + 2 else [
                "the pokes not yet reconciled"], what="after a poke", env=env, proc=operator)
        stop_cleanly(operator)
    updated = [e for e in reconciles_of(operator) if "configmap-updated" in e["result"]]
    assert [e["widget"] for e in updated] == [f"{ns}/cleared"], updated
    calls = access_log(gate, until=has_watch)
    puts = [c.get("name") for c in calls if (c["verb"], c.get("resource")) == (
        "update", "configmaps")]
    assert puts == ["cleared"], puts


def ready_condition(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    widget = cluster.call("GET", f"{widgets_path(namespace)}/{name}").ok().json()
    [ready] = [c for c in widget["status"]["conditions"] if c["type"] == "Ready"]
    return {**ready, "widgetObservedGeneration": widget["status"]["observedGeneration"],
            "generation": widget["metadata"]["generation"]}


def test_a_deleted_or_edited_configmap_is_put_back_without_a_widget_change(
    cluster: LocalCluster, operator_token: str, opgate_factory: Callable[..., Opgate],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The operator watches the ConfigMaps it owns (controller-runtime's Owns()): one deleted,
    one whose data is edited, one whose managed-by label is taken off (it leaves the label
    selector the operator watches with: a DELETED event) are each put back within seconds,
    with no change of their Widget and no resync. They stayed as left, for as long as the
    Widget did not change, while its status went on saying Ready / up to date."""
    gate = opgate_factory()
    env = make_env(cluster, gate, operator_token, tmp_path_factory.mktemp("op-owned"))
    ns = OWNED_NAMESPACE
    with running_operator(env, "--namespace", ns) as operator:
        specs = {name: {"data": {"owner": name}} for name in ("deleted", "edited", "unlabelled")}
        create_widgets(cluster, ns, specs)
        wait_for(lambda: problems(cluster, specs, ns), what="after creating", env=env,
                 proc=operator)
        before = {name: ready_condition(cluster, ns, name) for name in specs}
        cms = configmaps_path(ns)
        cluster.call("DELETE", f"{cms}/deleted").ok()
        cluster.call("PATCH", f"{cms}/edited", body={"data": {"owner": "someone", "x": "y"}},
                     content_type="application/merge-patch+json").ok()
        cluster.call("PATCH", f"{cms}/unlabelled", body={"metadata": {"labels": {
            "app.kubernetes.io/managed-by": None}}},
            content_type="application/merge-patch+json").ok()

        def not_restored() -> list[str]:
            out = problems(cluster, specs, ns)
            for cm in cluster.call("GET", cms).ok().json()["items"]:
                labels = cm["metadata"].get("labels") or {}
                if labels.get("app.kubernetes.io/managed-by") != "opgate-sample-operator":
                    out.append(f"{cm['metadata']['name']}: labels {labels}")
            return out

        wait_for(not_restored, what="after deleting / editing the ConfigMaps", env=env,
                 proc=operator, deadline=RESTORED_WITHIN)
        # Ready all along (the ConfigMap is back as it should be): no flip, no new generation
        assert {name: ready_condition(cluster, ns, name) for name in specs} == before
        delete_all_and_wait(cluster, ns, specs, env=env, proc=operator)
        stop_cleanly(operator)
    writes = sorted((e["widget"].split("/")[1], action) for e in reconciles_of(operator)
                    for action in e["result"].split(",")
                    if action in ("configmap-created", "configmap-updated"))
    assert writes == [("deleted", "configmap-created"), ("deleted", "configmap-created"),
                      ("edited", "configmap-created"), ("edited", "configmap-updated"),
                      ("unlabelled", "configmap-created"), ("unlabelled", "configmap-updated")]


def test_a_configmap_the_apiserver_refuses_is_reported_not_ready(
    cluster: LocalCluster, operator_token: str, opgate_factory: Callable[..., Opgate],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A Widget whose spec.data has a key no ConfigMap can hold: the apiserver answers the
    create 422, again at every retry. The Widget had no status at all (or, after a change,
    the Ready=True of the last generation that worked); now it says Ready=False,
    ConfigMapRefused, with the apiserver's reason, and is Ready again once the key is fixed."""
    gate = opgate_factory()
    env = make_env(cluster, gate, operator_token, tmp_path_factory.mktemp("op-refused"))
    ns = REFUSED_NAMESPACE
    with running_operator(env, "--namespace", ns) as operator:
        create_widgets(cluster, ns, {"bad-key": {"data": {"not a key!": "x"}}})

        def not_reported() -> list[str]:
            widget = cluster.call("GET", f"{widgets_path(ns)}/bad-key").ok().json()
            status = widget.get("status") or {}
            ready = [c for c in status.get("conditions") or [] if c["type"] == "Ready"]
            if ready and (ready[0]["status"], ready[0]["reason"]) == ("False",
                                                                      "ConfigMapRefused"):
                return [] if "422" in ready[0]["message"] else [f"message {ready[0]}"]
            return [f"status {status}"]

        wait_for(not_reported, what="after creating a Widget with a bad key", env=env,
                 proc=operator, deadline=RESTORED_WITHIN)
        patch_widget(cluster, ns, "bad-key", {"spec": {"data": {"not a key!": None,
                                                                "good-key": "x"}}})
        specs = {"bad-key": {"data": {"good-key": "x"}}}
        wait_for(lambda: problems(cluster, specs, ns), what="after fixing the key", env=env,
                 proc=operator)
        delete_all_and_wait(cluster, ns, specs, env=env, proc=operator)
        stop_cleanly(operator)  # the refusals were warnings, not errors
