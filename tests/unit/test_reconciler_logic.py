"""The sample operator's pure parts: desired ConfigMap, conditions, Retry-After, backoff, queue."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from examples.reconciler import kube
from examples.reconciler import resources as r
from examples.reconciler.config import ClusterConfig, ConfigError, TokenSource, load_kubeconfig
from examples.reconciler.controller import Controller, Informer
from examples.reconciler.kube import ApiError, KubeClient
from examples.reconciler.reconciler import Outcome, Reconciler
from examples.reconciler.retry import (
    MAX_RETRY_AFTER,
    backoff_delay,
    parse_retry_after,
    resend_delay,
    retry_delay,
)
from examples.reconciler.workqueue import ShutDown, WorkQueue

NOW = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)


def widget(
    *,
    data: dict[str, str] | None = None,
    color: str | None = None,
    generation: int = 1,
    status: dict[str, Any] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if data is not None:
        spec["data"] = data
    if color is not None:
        spec["color"] = color
    obj: dict[str, Any] = {
        "apiVersion": "demo.opgate.dev/v1",
        "kind": "Widget",
        "metadata": {"name": "w1", "namespace": "ns", "uid": "uid-1",
                     "generation": generation, "resourceVersion": "7"},
        "spec": spec,
    }
    if status is not None:
        obj["status"] = status
    return obj


# -- desired ConfigMap ----------------------------------------------------------------------

@pytest.mark.parametrize(
    ("data", "color", "want_data", "want_annotations"),
    [
        ({"a": "1", "b": "2"}, None, {"a": "1", "b": "2"}, None),
        (None, None, {}, None),
        ({}, "blue", {}, {r.COLOR_ANNOTATION: "blue"}),
        ({"k": "v"}, "", {"k": "v"}, None),
    ],
)
def test_desired_configmap(data, color, want_data, want_annotations) -> None:
    cm = r.desired_configmap(widget(data=data, color=color))
    assert (cm["apiVersion"], cm["kind"]) == ("v1", "ConfigMap")
    assert cm["metadata"]["name"] == "w1" and cm["metadata"]["namespace"] == "ns"
    assert cm["data"] == want_data
    assert cm["metadata"].get("annotations") == want_annotations
    assert cm["metadata"]["ownerReferences"] == [{
        "apiVersion": "demo.opgate.dev/v1", "kind": "Widget", "name": "w1", "uid": "uid-1",
        "controller": True, "blockOwnerDeletion": True}]
    assert cm["metadata"]["labels"][r.WIDGET_LABEL] == "w1"


def existing(*, data: dict[str, str], refs: list[dict[str, Any]], **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "data": data,
            "metadata": {"name": "w1", "namespace": "ns", "uid": "cm-uid",
                         "resourceVersion": "3", "ownerReferences": refs, **meta}}


OURS = r.owner_reference(widget())
OTHER_CTRL = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "d", "uid": "x",
              "controller": True}
OTHER_REF = {"apiVersion": "v1", "kind": "Secret", "name": "s", "uid": "y"}
LABELS = r.desired_configmap(widget())["metadata"]["labels"]


@pytest.mark.parametrize(
    ("current", "needs_update", "elsewhere", "controlled"),
    [
        (existing(data={"a": "1"}, refs=[OURS], labels=LABELS), False, False, True),
        (existing(data={"a": "2"}, refs=[OURS], labels=LABELS), True, False, True),
        (existing(data={"a": "1"}, refs=[], labels=LABELS), True, False, False),
        (existing(data={"a": "1"}, refs=[OURS]), True, False, True),
        (existing(data={"a": "1"}, refs=[OTHER_REF, OURS], labels=LABELS), False, False, True),
        (existing(data={"a": "1"}, refs=[OTHER_CTRL], labels=LABELS), True, True, False),
    ],
    ids=["same", "data-changed", "no-owner", "labels-missing", "extra-ref-kept", "foreign"],
)
def test_configmap_drift(current, needs_update, elsewhere, controlled) -> None:
    w = widget(data={"a": "1"})
    desired = r.desired_configmap(w)
    assert r.configmap_needs_update(current, desired) is needs_update
    assert r.owned_elsewhere(current, w) is elsewhere
    assert r.is_controlled_by(current, w) is controlled
    merged = r.merge_configmap(current, desired)
    assert merged["data"] == {"a": "1"}
    assert merged["metadata"]["resourceVersion"] == "3"  # PUT keeps the version it read
    assert OURS in merged["metadata"]["ownerReferences"]
    assert not r.configmap_needs_update(merged, desired)


def test_a_configmap_with_no_data_as_the_apiserver_serves_it_is_up_to_date() -> None:
    """A Widget without spec.data: its ConfigMap comes back with no "data" (omitempty), which
    is what it should hold, not a drift to write on every reconcile."""
    desired = r.desired_configmap(widget())  # no spec.data
    served = existing(data={}, refs=[OURS], labels=LABELS)
    del served["data"]
    assert not r.configmap_needs_update(served, desired)
    stale = existing(data={"a": "1"}, refs=[OURS], labels=LABELS)
    assert r.configmap_needs_update(stale, desired)
    assert "data" not in r.merge_configmap(stale, desired)  # PUT without it: cleared


def test_merge_keeps_foreign_labels_and_drops_stale_color() -> None:
    current = existing(data={}, refs=[OURS], labels={"team": "a"},
                       annotations={r.COLOR_ANNOTATION: "red", "note": "x"})
    merged = r.merge_configmap(current, r.desired_configmap(widget()))
    assert merged["metadata"]["labels"]["team"] == "a"
    assert merged["metadata"]["annotations"] == {"note": "x"}


# -- conditions and status ------------------------------------------------------------------

READY_OLD = {"type": "Ready", "status": "True", "reason": "Reconciled", "message": "m",
             "observedGeneration": 1, "lastTransitionTime": "2020-01-01T00:00:00Z"}
OTHER_COND = {"type": "Degraded", "status": "False", "reason": "Fine", "message": "",
              "observedGeneration": 1, "lastTransitionTime": "2020-01-01T00:00:00Z"}


@pytest.mark.parametrize(
    ("status", "ready", "generation", "want_ltt", "want_types"),
    [
        (None, True, 1, "2025-01-02T03:04:05Z", ["Ready"]),
        ({"conditions": [READY_OLD]}, True, 2, "2020-01-01T00:00:00Z", ["Ready"]),
        ({"conditions": [READY_OLD]}, False, 2, "2025-01-02T03:04:05Z", ["Ready"]),
        ({"conditions": [OTHER_COND, READY_OLD]}, True, 1, "2020-01-01T00:00:00Z",
         ["Degraded", "Ready"]),
        ({"conditions": [OTHER_COND]}, True, 3, "2025-01-02T03:04:05Z", ["Degraded", "Ready"]),
    ],
    ids=["first", "same-status-keeps-time", "flip-moves-time", "others-kept", "appended"],
)
def test_desired_status(status, ready, generation, want_ltt, want_types) -> None:
    w = widget(generation=generation, status=status)
    out = r.desired_status(w, ready=ready, reason="Reconciled", message="m",
                           now=r.now_rfc3339(NOW))
    assert out["observedGeneration"] == generation
    assert [c["type"] for c in out["conditions"]] == want_types
    cond = r.find_condition(out["conditions"], "Ready")
    assert cond == {"type": "Ready", "status": "True" if ready else "False",
                    "reason": "Reconciled", "message": "m", "observedGeneration": generation,
                    "lastTransitionTime": want_ltt}


@pytest.mark.parametrize(
    ("status", "generation", "needs"),
    [
        ({"observedGeneration": 1, "conditions": [READY_OLD]}, 1, False),
        ({"observedGeneration": 1, "conditions": [READY_OLD]}, 2, True),
        (None, 1, True),
    ],
)
def test_status_needs_update(status, generation, needs) -> None:
    w = widget(generation=generation, status=status)
    out = r.desired_status(w, ready=True, reason="Reconciled", message="m",
                           now="2030-01-01T00:00:00Z")
    assert r.status_needs_update(w, out) is needs


@pytest.mark.parametrize(
    ("meta", "deleting", "fins"),
    [
        ({}, False, []),
        ({"finalizers": [r.FINALIZER]}, False, [r.FINALIZER]),
        ({"deletionTimestamp": "2025-01-01T00:00:00Z", "finalizers": ["a", r.FINALIZER]}, True,
         ["a", r.FINALIZER]),
    ],
)
def test_finalizer_helpers(meta, deleting, fins) -> None:
    obj = {"metadata": {"name": "n", "namespace": "ns", **meta}}
    assert r.is_deleting(obj) is deleting
    assert r.finalizers(obj) == fins
    assert r.key_of(obj) == "ns/n" and r.split_key("ns/n") == ("ns", "n")
    assert r.instance_header("ns", "n") == "ns/Widget/n"


# -- Retry-After, backoff, retry policy -----------------------------------------------------

@pytest.mark.parametrize(
    ("value", "want"),
    [
        (None, None),
        ("", None),
        ("  ", None),
        ("0", 0.0),
        ("3", 3.0),
        (" 7 ", 7.0),
        ("100000", MAX_RETRY_AFTER),
        ("-1", None),
        ("1.5", None),
        ("soon", None),
        ("Thu, 02 Jan 2025 03:04:15 GMT", 10.0),
        ("Thu, 02 Jan 2025 03:00:00 GMT", 0.0),
        ("Fri, 03 Jan 2025 03:04:05 GMT", MAX_RETRY_AFTER),
    ],
)
def test_parse_retry_after(value, want) -> None:
    assert parse_retry_after(value, now=lambda: NOW) == want


@pytest.mark.parametrize(
    ("attempt", "rand", "want"),
    [
        (0, 0.0, 0.1),
        (0, 1.0, 0.2),
        (1, 0.0, 0.2),
        (3, 0.5, 1.2),
        (20, 0.0, 15.0),
        (20, 1.0, 30.0),
        (-1, 0.0, 0.1),
    ],
)
def test_backoff_delay(attempt, rand, want) -> None:
    assert backoff_delay(attempt, rand=lambda: rand) == pytest.approx(want)


def test_backoff_grows_and_stays_bounded() -> None:
    delays = [backoff_delay(n) for n in range(30)]
    assert all(0 < d <= 30.0 for d in delays)
    assert backoff_delay(5, rand=lambda: 0.0) > backoff_delay(2, rand=lambda: 1.0)


@pytest.mark.parametrize(
    ("code", "retry_after", "want"),
    [
        (429, 4.0, 4.0),
        (429, None, 0.4),  # no header: backoff
        (503, 2.0, 2.0),
        (500, None, 0.4),
        (504, None, 0.4),
        (0, None, 0.4),  # connection error
        (409, None, None),
        (410, None, None),
        (404, 5.0, None),
        (403, None, None),
        (401, None, None),
    ],
)
def test_retry_delay(code, retry_after, want) -> None:
    assert retry_delay(code, attempt=2, retry_after=retry_after, rand=lambda: 0.0) == want


@pytest.mark.parametrize(
    ("method", "code", "retry_after", "reset", "want"),
    [
        ("POST", 429, 3.0, False, 3.0),  # the server said: not done, come back then
        ("POST", 503, 2.0, False, 2.0),
        ("PATCH", 500, 0.0, False, 0.0),
        ("GET", 429, None, False, None),  # no Retry-After: client-go gives up too
        ("GET", 503, None, False, None),
        ("POST", 409, 1.0, False, None),
        ("GET", 404, 1.0, False, None),
        ("GET", 0, None, True, 1.0),  # reset / EOF after sending: a read is safe to redo
        ("get", 0, None, True, 1.0),
        ("POST", 0, None, True, None),  # a write may have been applied
        ("DELETE", 0, None, True, None),
        ("GET", 0, None, False, None),  # refused, timed out: not client-go's reset
    ],
)
def test_resend_delay_is_client_gos_rule(method, code, retry_after, reset, want) -> None:
    assert resend_delay(method, code, retry_after=retry_after, reset=reset) == want


# -- work queue -----------------------------------------------------------------------------

def drain(q: WorkQueue) -> list[str]:
    out = []
    while (key := q.get_nowait()) is not None:
        out.append(key)
    return out


@pytest.mark.parametrize(
    ("adds", "want"),
    [
        (["a", "b", "a", "a", "c", "b"], ["a", "b", "c"]),
        (["x"] * 50, ["x"]),
        ([], []),
    ],
)
def test_queue_dedups_waiting_keys(adds, want) -> None:
    q = WorkQueue()
    for key in adds:
        q.add(key)
    assert len(q) == len(want)
    assert drain(q) == want


def test_queue_never_hands_out_a_key_being_processed() -> None:
    q = WorkQueue()
    q.add("a")
    assert q.get_nowait() == "a"
    q.add("a")  # an event while a worker holds it
    q.add("a")
    assert q.get_nowait() is None  # not given to a second worker
    q.done("a")
    assert drain(q) == ["a"]  # queued once more after done
    q.done("a")
    assert q.get_nowait() is None


def test_queue_failures_back_off_and_forget() -> None:
    q = WorkQueue(base_delay=0.1, max_delay=1.0, rand=lambda: 1.0)
    assert [q.failure_delay("k") for _ in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1, 1])
    assert q.failures("k") == 6
    q.forget("k")
    assert q.failures("k") == 0 and q.failure_delay("k") == pytest.approx(0.1)


def test_queue_async_get_add_after_and_shutdown() -> None:
    async def scenario() -> list[str]:
        q = WorkQueue()
        got: list[str] = []

        async def worker() -> None:
            while True:
                try:
                    key = await q.get()
                except ShutDown:
                    return
                got.append(key)
                q.done(key)

        tasks = [asyncio.create_task(worker()) for _ in range(3)]
        q.add_after("late", 0.05)
        q.add("now")
        await asyncio.sleep(0.15)
        q.add_after("never", 10)
        q.shutdown()
        await asyncio.wait_for(asyncio.gather(*tasks), 2)
        return got

    assert asyncio.run(scenario()) == ["now", "late"]


# -- kubeconfig -----------------------------------------------------------------------------

def test_kubeconfig_token_and_token_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("first\n")
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'http://127.0.0.1:8001/'}}]\n"
        "users: [{name: u, user: {tokenFile: token}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u, namespace: ns}}]\n")
    loaded = load_kubeconfig(cfg)
    assert loaded.server == "http://127.0.0.1:8001"
    assert loaded.ssl_context is None and loaded.namespace == "ns"
    assert loaded.tokens.get() == "first"
    token_file.write_text("second-rotated\n")
    assert loaded.tokens.get() == "second-rotated"


def test_token_source_rereads_periodically(tmp_path: Path) -> None:
    clock = [0.0]
    file = tmp_path / "t"
    file.write_text("one")
    src = TokenSource(token_file=file, reread_seconds=60, clock=lambda: clock[0])
    assert src.get() == "one"
    stat = file.stat()
    file.write_text("two")  # same size; put the old mtime back so only the clock can tell
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    clock[0] = 30.0
    assert src.get() == "one"
    clock[0] = 61.0
    assert src.get() == "two"
    file.unlink()  # a vanished file keeps the last token
    assert src.get() == "two"
    assert TokenSource(token="inline").get() == "inline"


@pytest.mark.parametrize(
    "body",
    [
        "current-context: c\ncontexts: []\n",
        "current-context: c\nclusters: [{name: k, cluster: {server: 'http://x'}}]\n"
        "users: [{name: u, user: {tokenFile: missing}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n",
        "clusters: []\n",
    ],
    ids=["no-context", "unreadable-token-file", "no-current-context"],
)
def test_kubeconfig_errors(tmp_path: Path, body: str) -> None:
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(body)
    with pytest.raises(ConfigError):
        load_kubeconfig(cfg)


@pytest.mark.parametrize("user", ["", "users: [{name: u, user: {}}]\n"], ids=["no-user", "empty"])
def test_kubeconfig_without_credentials_sends_no_token(tmp_path: Path, user: str) -> None:
    """The Helm chart's and docker-compose's kubeconfig: the sidecar, no user (opgate adds the
    pod's token upstream); client-go then sends no Authorization header, and so does this."""
    cfg = tmp_path / "kubeconfig"
    context = "{cluster: k, user: u}" if user else "{cluster: k}"
    cfg.write_text(
        "current-context: c\nclusters: [{name: k, cluster: {server: 'http://127.0.0.1:8001'}}]\n"
        f"{user}contexts: [{{name: c, context: {context}}}]\n")
    loaded = load_kubeconfig(cfg)
    assert loaded.server == "http://127.0.0.1:8001"
    assert loaded.tokens.get() is None
    assert "Authorization" not in KubeClient(loaded)._headers(None, None)


# -- one reconcile against an in-memory API (no network) ------------------------------------

def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


class FakeApi:
    """Just enough apiserver for one Widget and its ConfigMap: versions, conflicts, finalizers."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str, str | None]] = []
        self.version = 100

    def put(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.objects[path] = obj
        return copy.deepcopy(obj)

    async def request(self, method: str, path: str, *, query: Any = None, body: Any = None,
                      content_type: str = "", instance: str | None = None) -> dict[str, Any]:
        self.calls.append((method, path, instance))
        subresource = "status" if path.endswith("/status") else ""
        key = path.removesuffix("/status")
        if method == "POST":
            key = f"{path}/{body['metadata']['name']}"
            if key in self.objects:
                raise ApiError(code=409, reason="AlreadyExists", message="exists")
            return self.put(key, merge_patch(body, {"metadata": {"uid": "cm-uid"}}))
        current = self.objects.get(key)
        if current is None:
            raise ApiError(code=404, reason="NotFound", message=key)
        if method == "GET":
            return copy.deepcopy(current)
        if method == "DELETE":
            assert body["preconditions"]["uid"] == current["metadata"]["uid"]
            del self.objects[key]
            return {}
        sent_rv = body["metadata"].get("resourceVersion")
        if sent_rv is not None and sent_rv != current["metadata"]["resourceVersion"]:
            raise ApiError(code=409, reason="Conflict", message="the object has been modified")
        if method == "PUT":
            return self.put(key, body)
        patch = {"status": body["status"]} if subresource else {
            k: v for k, v in body.items() if k != "status"}
        updated = merge_patch(current, patch)
        if r.is_deleting(updated) and not r.finalizers(updated):
            del self.objects[key]
            return updated
        return self.put(key, updated)


W_PATH = "/apis/demo.opgate.dev/v1/namespaces/ns/widgets/w1"
CM_PATH = "/api/v1/namespaces/ns/configmaps/w1"


def run_reconcile(api: FakeApi, cached: dict[str, Any] | None) -> Outcome:
    return asyncio.run(Reconciler(api).reconcile(cached, key="ns/w1"))  # type: ignore[arg-type]


def stored_widget(api: FakeApi, **kw: Any) -> dict[str, Any]:
    return api.put(W_PATH, widget(**kw))


def test_reconcile_new_widget_then_nothing_to_do() -> None:
    api = FakeApi()
    w = stored_widget(api, data={"a": "1"}, color="red")
    out = run_reconcile(api, w)
    assert out.actions == ["finalizer-added", "configmap-created", "status"]
    assert [c[0] for c in api.calls] == ["PATCH", "GET", "POST", "PATCH"]
    assert {c[2] for c in api.calls} == {"ns/Widget/w1"}  # Opgate-Instance on every call
    cm, w = api.objects[CM_PATH], api.objects[W_PATH]
    assert cm["data"] == {"a": "1"} and r.is_controlled_by(cm, w)
    assert r.finalizers(w) == [r.FINALIZER]
    assert w["status"]["observedGeneration"] == 1
    assert w["status"]["conditions"][0]["reason"] == "Reconciled"
    api.calls.clear()
    assert run_reconcile(api, copy.deepcopy(w)).summary == "unchanged"
    assert api.calls == [("GET", CM_PATH, "ns/Widget/w1")]


def test_reconcile_follows_a_spec_change() -> None:
    api = FakeApi()
    run_reconcile(api, stored_widget(api, data={"a": "1"}))
    w = api.objects[W_PATH]
    w["spec"]["data"] = {"a": "2", "b": "3"}
    w["metadata"]["generation"] = 2
    out = run_reconcile(api, api.put(W_PATH, w))
    assert out.actions == ["configmap-updated", "status"]
    assert api.objects[CM_PATH]["data"] == {"a": "2", "b": "3"}
    assert api.objects[W_PATH]["status"]["observedGeneration"] == 2


def test_reconcile_rereads_after_a_conflict() -> None:
    api = FakeApi()
    stale = stored_widget(api, data={"a": "1"})
    api.put(W_PATH, api.objects[W_PATH])  # someone else wrote meanwhile
    out = run_reconcile(api, stale)
    assert out.conflicts == 1
    assert ("GET", W_PATH, "ns/Widget/w1") in api.calls
    assert r.finalizers(api.objects[W_PATH]) == [r.FINALIZER]
    assert CM_PATH in api.objects


def test_reconcile_deletion_removes_configmap_then_finalizer() -> None:
    api = FakeApi()
    run_reconcile(api, stored_widget(api, data={"a": "1"}))
    w = api.objects[W_PATH]
    w["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    out = run_reconcile(api, api.put(W_PATH, w))
    assert out.actions == ["configmap-deleted", "finalizer-removed"]
    assert api.objects == {}
    api.calls.clear()
    assert run_reconcile(api, None).actions == ["gone"] and api.calls == []


def test_reconcile_stale_cache_of_a_deleted_widget_is_gone() -> None:
    api = FakeApi()
    w = stored_widget(api)
    w["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    w["metadata"]["finalizers"] = [r.FINALIZER]
    del api.objects[W_PATH]
    assert run_reconcile(api, w).actions[-1] == "gone"


def test_reconcile_leaves_a_foreign_configmap_alone() -> None:
    api = FakeApi()
    api.put(CM_PATH, existing(data={"x": "y"}, refs=[OTHER_CTRL]))
    out = run_reconcile(api, stored_widget(api, data={"a": "1"}))
    assert api.objects[CM_PATH]["data"] == {"x": "y"}
    cond = api.objects[W_PATH]["status"]["conditions"][0]
    assert (cond["status"], cond["reason"]) == ("False", "ConfigMapOwnedElsewhere")
    assert "configmap-updated" not in out.actions


# -- list then watch, over canned pages and events ------------------------------------------

def w_obj(name: str, rv: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": rv}}


class ScriptedApi:
    """Answers lists from ``lists`` and watches from ``watches`` (events, or an error to raise)."""

    def __init__(self, lists: list[Any], watches: list[Any]) -> None:
        self.lists = lists
        self.watches = watches
        self.list_queries: list[dict[str, str]] = []
        self.watch_queries: list[dict[str, str]] = []
        self.paths: set[str] = set()
        self.exhausted = asyncio.Event()

    async def request(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        self.paths.add(path)
        self.list_queries.append(dict(kw["query"]))
        return self.lists.pop(0)

    async def watch(self, path: str, *, query: dict[str, str], read_timeout: float,
                    instance: str | None = None) -> Any:
        self.paths.add(path)
        self.watch_queries.append(dict(query))
        if not self.watches:
            self.exhausted.set()
            await asyncio.Event().wait()
        script = self.watches.pop(0)
        if isinstance(script, ApiError):
            raise script
        for event in script:
            yield event


def run_informer(informer: Informer, api: ScriptedApi) -> None:
    """Run ``informer`` until ``api`` has nothing more to answer."""
    async def scenario() -> None:
        task = asyncio.create_task(informer.run())
        await asyncio.wait_for(api.exhausted.wait(), 5)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(scenario())


def page(items: list[dict[str, Any]], rv: str, cont: str = "") -> dict[str, Any]:
    return {"items": items, "metadata": {"resourceVersion": rv, "continue": cont}}


def test_informer_lists_watches_resumes_and_relists_on_410() -> None:
    api = ScriptedApi(
        lists=[[page([w_obj("a", "9")], "", cont="c1"), page([w_obj("z", "10")], "10")],
               [page([w_obj("b", "11")], "20")],
               [page([w_obj("b", "11")], "30")]],
        watches=[
            [{"type": "ADDED", "object": w_obj("b", "11")},
             {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "15"}}}],
            [{"type": "DELETED", "object": w_obj("a", "16")},
             {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}],
            ApiError(code=410, reason="Gone", message="too old resource version"),
            ApiError(code=429, reason="TooManyRequests", message="slow down", retry_after=0.01),
        ])
    api.lists = [item for pages in api.lists for item in pages]  # one answer per GET
    ctl = Controller(api, namespace="ns")  # type: ignore[arg-type]
    run_informer(ctl.widgets, api)
    assert [q.get("continue", "") for q in api.list_queries] == ["", "c1", "", ""]
    assert [q["resourceVersion"] for q in api.watch_queries] == ["10", "15", "20", "30", "30"]
    assert all(q["watch"] == "true" and q["allowWatchBookmarks"] == "true"
               for q in api.watch_queries)
    assert ctl.widgets.relists == 3
    assert api.paths == {"/apis/demo.opgate.dev/v1/namespaces/ns/widgets"}
    assert not any("labelSelector" in q for q in api.list_queries + api.watch_queries)
    assert set(ctl.cache) == {"ns/b"}
    assert ctl.cache["ns/b"]["kind"] == "Widget"  # list items get apiVersion/kind back
    assert sorted(drain(ctl.queue)) == ["ns/a", "ns/b", "ns/z"]


@pytest.mark.parametrize(
    ("event", "rv", "queued"),
    [
        ({"type": "ADDED", "object": w_obj("a", "5")}, "5", ["ns/a"]),
        ({"type": "MODIFIED", "object": w_obj("a", "6")}, "6", ["ns/a"]),
        ({"type": "DELETED", "object": w_obj("a", "7")}, "7", ["ns/a"]),
        ({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "8"}}}, "8", []),
        ({"type": "SURPRISE", "object": w_obj("a", "9")}, "1", []),
    ],
)
def test_watch_event_handling(event, rv, queued) -> None:
    ctl = Controller(None, namespace=None)  # type: ignore[arg-type]
    ctl.widgets.resource_version = "1"
    ctl.widgets.handle(event)
    assert ctl.widgets.resource_version == rv
    assert drain(ctl.queue) == queued
    assert ctl.widgets.path == "/apis/demo.opgate.dev/v1/widgets"
    assert ctl.configmaps.path == "/api/v1/configmaps"


def test_watch_error_event_raises_its_code() -> None:
    ctl = Controller(None)  # type: ignore[arg-type]
    with pytest.raises(ApiError) as info:
        ctl.widgets.handle({"type": "ERROR", "object": {"code": 410, "reason": "Expired"}})
    assert info.value.code == 410


# -- the ConfigMaps it owns: a second informer, events mapped to the owning Widget -----------

def cm_obj(name: str, rv: str, *, owner: dict[str, Any] | None = None) -> dict[str, Any]:
    refs = [owner] if owner is not None else []
    return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": rv,
                         "ownerReferences": refs}}


def widget_ref(name: str, api_version: str = "demo.opgate.dev/v1") -> dict[str, Any]:
    return {"apiVersion": api_version, "kind": "Widget", "name": name, "uid": f"uid-{name}",
            "controller": True, "blockOwnerDeletion": True}


@pytest.mark.parametrize(
    ("refs", "want"),
    [
        ([widget_ref("w1")], "ns/w1"),
        ([widget_ref("w1", "demo.opgate.dev/v2")], "ns/w1"),  # another version, same owner
        ([{**widget_ref("w1"), "controller": False}], None),  # an owner, not the controller
        ([OTHER_REF, widget_ref("w2")], "ns/w2"),
        ([OTHER_CTRL], None),
        ([{**widget_ref("w1"), "apiVersion": "other.example/v1"}], None),  # someone's Widget
        ([], None),
    ],
    ids=["ours", "other-version", "not-controller", "among-others", "foreign", "other-group",
         "none"],
)
def test_owner_key_of_a_configmap(refs, want) -> None:
    assert r.owner_key({"metadata": {"name": "c", "namespace": "ns",
                                     "ownerReferences": refs}}) == want


def test_a_changed_or_deleted_configmap_queues_its_owning_widget() -> None:
    """Someone deletes or edits a Widget's ConfigMap: the Widget is reconciled again (and its
    ConfigMap put back) at once, not at its next change. Only the operator's own ConfigMaps
    are listed and watched (label selector), and events are mapped to the controlling Widget
    by its ownerReference; one the operator's Widgets do not control queues nothing."""
    api = ScriptedApi(
        lists=[page([cm_obj("w1", "5", owner=widget_ref("w1")),
                     cm_obj("w2", "6", owner=widget_ref("w2"))], "10"),
               page([cm_obj("w1", "30", owner=widget_ref("w1"))], "40")],
        watches=[[{"type": "DELETED", "object": cm_obj("w1", "11", owner=widget_ref("w1"))},
                  {"type": "MODIFIED", "object": cm_obj("other", "12", owner=OTHER_CTRL)}],
                 ApiError(code=410, reason="Gone", message="too old resource version")])
    ctl = Controller(api, namespace="ns")  # type: ignore[arg-type]
    ctl.configmaps.cache["ns/w3"] = cm_obj("w3", "1", owner=widget_ref("w3"))  # a past list

    async def first_list() -> list[str]:
        await ctl.configmaps._list()
        return drain(ctl.queue)

    assert sorted(asyncio.run(first_list())) == ["ns/w1", "ns/w2", "ns/w3"]  # w3: gone since
    for key in ("ns/w1", "ns/w2", "ns/w3"):
        ctl.queue.done(key)
    run_informer(ctl.configmaps, api)
    assert api.paths == {"/api/v1/namespaces/ns/configmaps"}
    selector = "app.kubernetes.io/managed-by=opgate-sample-operator"
    assert [q.get("labelSelector") for q in api.list_queries + api.watch_queries] == [
        selector] * 5
    assert sorted(drain(ctl.queue)) == ["ns/w1", "ns/w2"]  # the deletion, then the relist's w2
    assert set(ctl.configmaps.cache) == {"ns/w1"}
    assert ctl.cache == {}  # the Widget cache is the Widgets' alone


def test_the_desired_configmap_carries_the_label_it_is_watched_by() -> None:
    key, _, value = r.CONFIGMAP_SELECTOR.partition("=")
    assert r.desired_configmap(widget())["metadata"]["labels"][key] == value


# -- which failed calls kube.py sends again: client-go's rest.Request rules -----------------

CUT = b""  # the script's "read the request, then close the connection without an answer"


def answer(code: int, *, retry_after: str | None = None, body: bytes = b"{}") -> bytes:
    head = f"HTTP/1.1 {code} X\r\nContent-Type: application/json\r\n"
    if retry_after is not None:
        head += f"Retry-After: {retry_after}\r\n"
    return head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


class ScriptedServer:
    """A raw HTTP/1.1 server on 127.0.0.1: each request gets the next answer of ``script``
    (:data:`CUT`: the connection is closed once the request was read, as a server that died
    while handling it, or ``None``: no answer ever); every request received is recorded."""

    def __init__(self, script: list[bytes | None]) -> None:
        self.script = script
        self.received: list[tuple[str, bytes]] = []
        self._server: asyncio.Server | None = None
        self._hung: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> ScriptedServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        for writer in self._hung:
            writer.close()
        self._server.close()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            lines = head.decode().split("\r\n")
            length = next((int(line.split(":", 1)[1]) for line in lines
                           if line.lower().startswith("content-length:")), 0)
            body = await reader.readexactly(length) if length else b""
            self.received.append((lines[0].split(" ", 1)[0], body))
            reply = self.script.pop(0)
            if reply is None:
                self._hung.append(writer)
                return
            if reply == CUT:
                break
            writer.write(reply)
            await writer.drain()
        writer.close()


def call(server_script: list[bytes | None], method: str, *, body: Any = None,
         request_timeout: float = 30.0) -> tuple[dict[str, Any] | ApiError, list[str]]:
    """Send one call through :class:`KubeClient`; its result (or error) and the methods the
    server received."""
    async def scenario() -> tuple[dict[str, Any] | ApiError, list[str]]:
        async with ScriptedServer(server_script) as server:
            config = ClusterConfig(server=server.url, tokens=TokenSource(token="t"),
                                   ssl_context=None, namespace=None)
            async with KubeClient(config, request_timeout=request_timeout) as client:
                try:
                    result: dict[str, Any] | ApiError = await client.request(
                        method, "/api/v1/namespaces/ns/configmaps", body=body)
                except ApiError as err:
                    result = err
            return result, [m for m, _ in server.received]

    return asyncio.run(scenario())


@pytest.fixture
def no_reset_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """client-go waits 1 s before sending a GET again after a reset connection; not here."""
    monkeypatch.setattr(kube, "CONNECTION_RETRY_DELAY", 0.0)


GENERATE_NAME = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"generateName": "cm-"}}


@pytest.mark.parametrize("code", [500, 503, 504])
def test_a_5xx_without_retry_after_is_not_sent_again(code: int) -> None:
    """client-go sends a call again after a 5xx only when it carries Retry-After: without one
    the server may have done the work (a create with generateName would make a second
    object); the caller's own backoff (the work queue, the informer) decides."""
    result, received = call([answer(code), answer(201)], "POST", body=GENERATE_NAME)
    assert isinstance(result, ApiError) and result.code == code
    assert received == ["POST"]


@pytest.mark.parametrize("method", ["POST", "PATCH"])
def test_a_write_whose_connection_is_cut_is_not_sent_again(no_reset_wait: None,
                                                           method: str) -> None:
    """The request was sent, then the connection went: the apiserver may have applied it."""
    result, received = call([CUT, answer(201)], method, body=GENERATE_NAME)
    assert isinstance(result, ApiError) and result.code == 0
    assert received == [method]


@pytest.mark.parametrize("method", ["PUT", "DELETE"])
def test_a_put_or_delete_whose_connection_is_cut_is_resent_once_by_aiohttp_only(
    no_reset_wait: None, method: str
) -> None:
    """aiohttp itself sends an HTTP-idempotent PUT or DELETE once more when its connection
    is cut (RFC 9112 9.3.1; Go's transport does not); kube.py's loop adds nothing. The
    operator's PUT carries the resourceVersion it read and its DELETE a UID precondition, so
    a second copy can only get a 409 or a 404."""
    result, received = call([CUT, CUT, answer(200)], method, body={"metadata": {}})
    assert isinstance(result, ApiError) and result.code == 0
    assert received == [method, method]


def test_a_get_whose_connection_is_cut_is_sent_again(no_reset_wait: None) -> None:
    result, received = call([CUT, answer(200, body=b'{"items": []}')], "GET")
    assert result == {"items": []}
    assert received == ["GET", "GET"]


def test_a_call_that_times_out_is_not_sent_again() -> None:
    """A timeout is no reset: client-go gives up (its context deadline), GET or not."""
    result, received = call([None, answer(201)], "POST", body=GENERATE_NAME,
                            request_timeout=0.3)
    assert isinstance(result, ApiError) and result.code == 0
    assert received == ["POST"]


@pytest.mark.parametrize(("code", "retry_after"), [(429, "0"), (503, "0"), (500, "0")])
def test_any_verb_is_sent_again_after_the_servers_retry_after(code: int,
                                                              retry_after: str) -> None:
    """With Retry-After the server says it did not do it and when to come back."""
    result, received = call([answer(code, retry_after=retry_after),
                             answer(201, body=b'{"kind": "ConfigMap"}')], "POST",
                            body=GENERATE_NAME)
    assert result == {"kind": "ConfigMap"}
    assert received == ["POST", "POST"]


def test_a_429_without_retry_after_is_not_sent_again() -> None:
    result, received = call([answer(429), answer(201)], "POST", body=GENERATE_NAME)
    assert isinstance(result, ApiError) and result.code == 429
    assert received == ["POST"]


class RefusingApi(FakeApi):
    """A FakeApi whose ConfigMap writes are refused with ``refusal`` while it is set (a quota,
    an admission webhook, opgate's own policy, an invalid key)."""

    def __init__(self, refusal: ApiError) -> None:
        super().__init__()
        self.refusal: ApiError | None = refusal

    async def request(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        if self.refusal is not None and method in ("POST", "PUT") and "/configmaps" in path:
            self.calls.append((method, path, kw.get("instance")))
            raise self.refusal
        return await super().request(method, path, **kw)


@pytest.mark.parametrize("code", [403, 422])
def test_a_refused_configmap_write_is_reported_in_the_status_then_retried(code: int) -> None:
    """The ConfigMap cannot be written (403: a quota, a webhook, opgate's policy; 422: a
    spec.data key a ConfigMap cannot hold): the Widget says so, Ready=False with the server's
    reason, instead of no status at all (a new Widget) or a Ready=True of the last generation
    that worked; the reconcile still fails, so the work queue tries again later, and the
    status flips back once the write goes through."""
    refusal = ApiError(code=code, reason="Forbidden" if code == 403 else "Invalid",
                       message='configmaps "w1" is forbidden: exceeded quota')
    api = RefusingApi(refusal)
    w = stored_widget(api, data={"a": "1"})
    with pytest.raises(ApiError) as info:
        run_reconcile(api, w)
    assert info.value is refusal
    status = api.objects[W_PATH]["status"]
    [ready] = status["conditions"]
    assert (ready["status"], ready["reason"]) == ("False", "ConfigMapRefused")
    assert "exceeded quota" in ready["message"] and str(code) in ready["message"]
    assert status["observedGeneration"] == 1 and CM_PATH not in api.objects
    api.refusal = None
    assert run_reconcile(api, copy.deepcopy(api.objects[W_PATH])).actions == [
        "configmap-created", "status"]
    [ready] = api.objects[W_PATH]["status"]["conditions"]
    assert (ready["status"], ready["reason"]) == ("True", "Reconciled")


@pytest.mark.parametrize("code", [0, 429, 500, 409])
def test_a_passing_configmap_failure_leaves_the_status_alone(code: int) -> None:
    """A connection error, a throttled call (a status write would spend the same budget), a
    5xx, a conflict: nothing to tell the user, the retry will do."""
    api = RefusingApi(ApiError(code=code, reason="X", message="m"))
    w = stored_widget(api, data={"a": "1"})
    with pytest.raises(ApiError):
        run_reconcile(api, w)
    assert "status" not in api.objects[W_PATH]


def test_the_charts_default_rules_are_rbac_yamls() -> None:
    """The chart's default ClusterRole is the sample's: a rule added to one (list/watch on
    configmaps for the informer of the ConfigMaps it owns) and not the other leaves the chart's
    operator failing with 403s its README's RBAC does not have."""
    repo = Path(__file__).resolve().parents[2]
    [role] = [d for d in yaml.safe_load_all((repo / "examples/reconciler/rbac.yaml").read_text())
              if d["kind"] == "ClusterRole"]
    values = yaml.safe_load((repo / "helm/opgate/values.yaml").read_text())
    assert values["rbac"]["rules"] == role["rules"]
    [configmaps] = [rule for rule in role["rules"] if rule["resources"] == ["configmaps"]]
    assert {"list", "watch"} <= set(configmaps["verbs"])
