"""Object counts and quotas as the apiserver sees them, for the quota middleware.

:class:`QuotaCounts` implements ``proxy.middlewares.quota_counts.QuotaCounts``. For every quota'd
(group, resource) it runs one metadata-only list+watch over all namespaces
(``PartialObjectMetadata``, as :mod:`proxy.relay.informer` does) and keeps only a count per
namespace; objects created or deleted by anyone are counted. Pods get a second one, of the pods
in a terminal phase (a field selector; :class:`proxy.relay.tally.Finished`), as ResourceQuota's
legacy ``pods`` counts only the others (``count/pods`` every pod). With ``resource_quotas`` it
watches every ResourceQuota (their ``spec.hard``); with ``cluster_quotas`` it discovers
``quota.openshift.io`` and, only when the cluster serves it, watches the ClusterResourceQuotas
and the namespaces' labels and annotations (metadata only) that their selectors match; such a
quota limits all its namespaces together, so :meth:`QuotaCounts.beyond` sums the objects of its
other namespaces. When the API is absent nothing fails: no ClusterResourceQuota applies (it is
looked for again every ``rediscover_seconds``).

It keeps the names, not only the count, of each namespace's objects (one short string per
object: :class:`proxy.relay.tally.Tally`), so the middleware can tell a server-side apply that
creates an object from one that updates it (:meth:`QuotaCounts.exists`); the quotas' ``hard``
counts and selectors are read by :mod:`proxy.relay.quotaobjects`. The reservations themselves
live in the store (:meth:`proxy.stores.base.Store.reserve`: Redis when configured, so shared by
every replica); this module tells the middleware what its watch shows:
:meth:`QuotaCounts.observed` (objects), :meth:`QuotaCounts.seen` (names that appeared lately,
whose reservations must not be counted a second time) and, through :meth:`QuotaCounts.expect`,
when the object of one of this replica's admitted creates appears (``ADDED`` with its name, or
for a ``generateName`` create the next new object with that prefix; a relist shows named ones
too), so its reservation can be let go. One whose create failed is not waited for; one created
(or unknown) at most ``settle_seconds`` more; one still in flight after ``INFLIGHT_SECONDS``.

The watch loops follow the informer's: list (pages of ``page_size``) → watch from the list's
resourceVersion with bookmarks and a server timeout of ~5 min; resume from the last
resourceVersion; 410 Gone relists; any other failure backs off (1 s doubling up to 60 s, with
jitter). A resource the apiserver does not serve (yet) is looked for again within
``NOT_SERVED_RETRY`` (4 s); its path is discovered at each (re)list (a CRD's upgrade may
serve another version and stop serving the one discovered before). Until a pair's first list
is done, ``observed`` answers ``None`` (the middleware then fails as the policy says); until the
quotas are listed, ``aligned`` does.

Credentials are the upstream's (``--token-file``, the kubeconfig or the pod's ServiceAccount):
that identity needs ``list`` and ``watch`` on the quota'd resources in every namespace, on
``resourcequotas`` (``alignWith: [ResourceQuota]``) and on ``namespaces`` and
``clusterresourcequotas.quota.openshift.io`` (``ClusterResourceQuota``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

from proxy.relay.endpoint import Endpoint, TokenSource, make_ssl_context
from proxy.relay.listwatch import Absent, Failed, ListWatch, reason
from proxy.relay.quotaobjects import hard_counts, selects
from proxy.relay.tally import SETTLE_SECONDS, Expected, Finished, Tally
from proxy.relay.upstream import UpstreamConfig

__all__ = ["TERMINAL_PODS", "QuotaCounts"]

log = logging.getLogger("opgate.counts")

USER_AGENT = "opgate-quota"
CRQ_GROUP = "quota.openshift.io"
# the pods in a terminal phase (Succeeded, Failed): a field selector has no "or", so "none of the
# others"; a pod is Pending when created, so a new pod never shows in this watch first
TERMINAL_PODS = urlencode({"fieldSelector": "status.phase!=Pending,status.phase!=Running,"
                                            "status.phase!=Unknown"})

UsageCallback = Callable[[str, str, str, int], None]
AlignedQuota = tuple[str, str, Mapping[str, int]]


# --- the watches ------------------------------------------------------------------------------

@dataclass(slots=True, eq=False)
class _Counted:
    group: str
    resource: str
    namespaces: Callable[[str], bool]
    tally: Tally = field(default_factory=Tally)
    path: str = ""
    problem: str = ""  # why its resource cannot be found (/readyz?verbose says it)
    task: asyncio.Task[None] | None = None
    terminal_task: asyncio.Task[None] | None = None  # pods: the watch of Tally.finished

    @property
    def label(self) -> str:
        return f"{self.resource}.{self.group}" if self.group else self.resource

    @property
    def synced(self) -> bool:
        finished = self.tally.finished
        return self.tally.synced and (finished is None or finished.synced)


class QuotaCounts:
    """List+watch loops for the quota middleware; see the module docstring."""

    def __init__(
        self, upstream: UpstreamConfig, *, connect_timeout: float = 5.0, page_size: int = 500,
        watch_seconds: int = 300, idle_seconds: float = 90.0, max_backoff: float = 60.0,
        rediscover_seconds: float = 60.0, settle_seconds: float = SETTLE_SECONDS,
    ) -> None:
        self._lw = ListWatch(
            Endpoint.from_config(upstream, make_ssl_context(upstream)),
            TokenSource(token=upstream.token, token_file=upstream.token_file),
            connect_timeout=connect_timeout, user_agent=USER_AGENT, page_size=page_size,
            watch_seconds=watch_seconds, idle_seconds=idle_seconds, max_backoff=max_backoff)
        self._rediscover = rediscover_seconds
        self._settle_seconds = settle_seconds
        self._started = False
        self._counted: dict[tuple[str, str], _Counted] = {}
        self._on_usage: UsageCallback | None = None
        # ResourceQuotas: namespace -> name -> hard
        self._want_rq = False
        self._rq: dict[str, dict[str, dict[str, int]]] = {}
        self._rq_synced = False
        self._rq_task: asyncio.Task[None] | None = None
        # ClusterResourceQuotas (quota.openshift.io) and the namespaces they select
        self._want_crq = False
        self._crq_state = "unknown"  # unknown | absent | present
        self._crq: dict[str, tuple[Mapping[str, Any], dict[str, int]]] = {}
        self._crq_synced = False
        self._ns: dict[str, tuple[dict[str, str], dict[str, str]]] = {}
        self._ns_synced = False
        self._selected: dict[str, frozenset[str]] = {}  # CRQ -> namespaces; cleared on change
        self._crq_task: asyncio.Task[None] | None = None
        self._ns_task: asyncio.Task[None] | None = None
        self._crq_path = ""
        self._follow_task: asyncio.Task[None] | None = None

    # --- the middleware's QuotaCounts (hot path: dict lookups, never blocks) ---------------

    def track(self, resources: Mapping[tuple[str, str], Callable[[str], bool]], *,
              resource_quotas: bool, cluster_quotas: bool,
              on_usage: UsageCallback | None = None) -> None:
        self._on_usage = on_usage
        for pair in [p for p in self._counted if p not in resources]:
            counted = self._counted.pop(pair)
            for task in (counted.task, counted.terminal_task):
                if task is not None:
                    task.cancel()
        for (group, resource), namespaces in resources.items():
            counted = self._counted.get((group, resource))
            if counted is None:
                counted = _Counted(group, resource, namespaces, Tally(
                    settle_seconds=self._settle_seconds))
                if (group, resource) == ("", "pods"):
                    counted.tally.finished = Finished(counted.tally)
                self._counted[(group, resource)] = counted
            counted.namespaces = namespaces
            if counted.tally.synced:
                for namespace in counted.tally.names:
                    self._report(counted, namespace)
            self._spawn_counted(counted)
        self._want_rq = resource_quotas
        self._want_crq = cluster_quotas
        self._spawn_quotas()

    def observed(self, group: str, resource: str, namespace: str) -> int | None:
        counted = self._counted.get((group, resource))
        if counted is None or not counted.synced:
            return None
        return counted.tally.count(namespace)

    def exists(self, group: str, resource: str, namespace: str, name: str) -> bool | None:
        counted = self._counted.get((group, resource))
        return None if counted is None else counted.tally.exists(namespace, name)

    def seen(self, group: str, resource: str, namespace: str) -> tuple[str, ...]:
        counted = self._counted.get((group, resource))
        return () if counted is None else counted.tally.seen(namespace)

    def aligned(self, namespace: str, *, resource_quotas: bool,
                cluster_quotas: bool) -> Sequence[AlignedQuota] | None:
        found: list[AlignedQuota] = []
        if resource_quotas:
            if not self._rq_synced:
                return None
            found.extend(("ResourceQuota", name, hard)
                         for name, hard in sorted(self._rq.get(namespace, {}).items()))
        if cluster_quotas and self._crq_state != "absent":
            if self._crq_state == "unknown" or not (self._crq_synced and self._ns_synced):
                return None
            labels, annotations = self._ns.get(namespace, ({}, {}))
            found.extend(("ClusterResourceQuota", name, hard)
                         for name, (selector, hard) in sorted(self._crq.items())
                         if selects(selector, labels, annotations))
        return found

    def beyond(self, group: str, resource: str, namespace: str, quota: str) -> int:
        """Objects of (group, resource) in the other namespaces ClusterResourceQuota ``quota``
        selects: its limit is for all of them together (OpenShift checks its status.total)."""
        counted = self._counted.get((group, resource))
        if counted is None:
            return 0
        tally = counted.tally
        return sum(tally.count(ns) for ns in self._selected_by(quota) if ns != namespace)

    def finished(self, group: str, resource: str, namespace: str) -> int:
        """Pods Succeeded or Failed in the namespace, or stuck terminating past their grace
        period (0 for other resources)."""
        counted = self._counted.get((group, resource))
        finished = None if counted is None else counted.tally.finished
        return 0 if finished is None else finished.count(namespace)

    def finished_beyond(self, group: str, resource: str, namespace: str, quota: str) -> int:
        counted = self._counted.get((group, resource))
        finished = None if counted is None else counted.tally.finished
        if finished is None:
            return 0
        return sum(finished.count(ns) for ns in self._selected_by(quota) if ns != namespace)

    def _selected_by(self, quota: str) -> frozenset[str]:
        """The namespaces ClusterResourceQuota ``quota`` selects (cached until a change)."""
        if quota not in self._crq:
            return frozenset()
        selected = self._selected.get(quota)
        if selected is None:
            selector = self._crq[quota][0]
            selected = frozenset(ns for ns, (labels, annotations) in self._ns.items()
                                 if selects(selector, labels, annotations))
            self._selected[quota] = selected
        return selected

    def expect(self, group: str, resource: str, namespace: str, name: str, generate_name: str,
               token: str, on_seen: Callable[[], None] | None = None) -> object:
        counted = self._counted.get((group, resource))
        if counted is None:
            return None
        return counted.tally.expect(namespace, name, generate_name, token, on_seen)

    def settle(self, expected: object, created: bool | None) -> None:
        if isinstance(expected, Expected):
            expected.tally.settle(expected, created)

    def describe(self) -> str:
        """One line for ``/readyz?verbose``: what is synced."""
        parts = [f"{c.label}=synced" if c.synced else
                 f"{c.label}=syncing ({c.problem})" if c.problem else f"{c.label}=syncing"
                 for c in self._counted.values()]
        if self._want_rq:
            parts.append(f"resourcequotas={'synced' if self._rq_synced else 'syncing'}")
        if self._want_crq:
            state = self._crq_state if self._crq_state != "present" else (
                "synced" if self._crq_synced and self._ns_synced else "syncing")
            parts.append(f"clusterresourcequotas={state}")
        return ", ".join(parts) or "no quotas"

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self, *, follow: Callable[[], None] | None = None) -> None:
        """Start the watches; ``follow`` (the middleware's interest in the active policy set)
        is called every second, so that a reload's quotas are counted without waiting for a
        create."""
        self._started = True
        if follow is not None and self._follow_task is None:
            self._follow_task = asyncio.get_running_loop().create_task(
                self._follow(follow), name="quota interest")
        for counted in self._counted.values():
            self._spawn_counted(counted)
        self._spawn_quotas()

    async def close(self) -> None:
        tasks = [t for c in self._counted.values() for t in (c.task, c.terminal_task)]
        tasks += [self._rq_task, self._crq_task, self._ns_task, self._follow_task]
        self._follow_task = None
        self._started = False
        await self._lw.stop(tasks)

    @staticmethod
    async def _follow(follow: Callable[[], None]) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                follow()
            except Exception:
                log.exception("quota: following the policy set failed")

    def _spawn(self, task: asyncio.Task[None] | None, make: Callable[[], Awaitable[None]],
               name: str) -> asyncio.Task[None] | None:
        if not self._started or (task is not None and not task.done()):
            return task
        return asyncio.get_running_loop().create_task(make(), name=name)  # type: ignore[arg-type]

    def _spawn_counted(self, counted: _Counted) -> None:
        counted.task = self._spawn(counted.task, lambda: self._run_counted(counted),
                                   f"count {counted.label}")
        if counted.tally.finished is not None:
            counted.terminal_task = self._spawn(
                counted.terminal_task, lambda: self._run_terminal(counted),
                f"count {counted.label} (terminal)")

    def _spawn_quotas(self) -> None:
        if self._want_rq:
            self._rq_task = self._spawn(self._rq_task, self._run_rq, "watch resourcequotas")
        elif self._rq_task is not None:
            self._rq_task.cancel()
            self._rq_task, self._rq_synced, self._rq = None, False, {}
        if self._want_crq:
            self._crq_task = self._spawn(self._crq_task, self._run_crq,
                                         "watch clusterresourcequotas")
        elif self._crq_task is not None:
            for task in (self._crq_task, self._ns_task):
                if task is not None:
                    task.cancel()
            self._crq_task = self._ns_task = None
            self._crq_state, self._crq_synced, self._ns_synced = "unknown", False, False
            self._crq, self._ns = {}, {}
            self._selected.clear()

    # --- quota'd resources --------------------------------------------------------------------

    def _report(self, counted: _Counted, namespace: str) -> None:
        if self._on_usage is not None and counted.namespaces(namespace):
            try:
                self._on_usage(counted.group, counted.resource, namespace,
                               counted.tally.count(namespace))
            except Exception:
                log.exception("quota usage callback failed")

    async def _run_counted(self, c: _Counted) -> None:
        tally = c.tally
        finished = tally.finished  # pods: also which are being deleted

        def replace(items: list[dict[str, Any]]) -> None:
            metas = [(i.get("metadata") or {}) for i in items]
            changed = tally.replace((m.get("namespace") or "", m.get("name") or "")
                                    for m in metas)
            if finished is not None:
                finished.deletions(metas)
            for namespace in changed:
                self._report(c, namespace)

        def event(kind: str, obj: dict[str, Any]) -> None:
            meta = obj.get("metadata") or {}
            namespace = meta.get("namespace") or ""
            if kind == "ADDED":
                tally.added(namespace, meta.get("name") or "", meta.get("generateName") or "")
                if finished is not None:
                    finished.deletion(namespace, meta.get("name") or "", meta)
            elif kind == "DELETED":
                tally.deleted(namespace, meta.get("name") or "")
            else:
                if finished is not None and kind == "MODIFIED":
                    finished.deletion(namespace, meta.get("name") or "", meta)
                return
            self._report(c, namespace)

        async def path() -> str:
            # discovered at each (re)list, not once: a CRD's upgrade may serve another version
            # and stop serving the one found before, whose path would answer 404 for ever
            try:  # a resource not served (a group left out) never syncs: say why
                c.path = await self._resource_path(c.group, c.resource)
            except Failed as exc:
                c.problem = str(exc)
                raise
            c.problem = ""
            return c.path

        await self._list_watch(c.label, path, replace, event, metadata_only=True)

    async def _run_terminal(self, c: _Counted) -> None:
        """The second watch of pods: those in a terminal phase. A pod that reaches one arrives
        ``ADDED``; one deleted, or (never, in practice) leaving it, ``DELETED``."""
        finished = c.tally.finished
        assert finished is not None

        def replace(items: list[dict[str, Any]]) -> None:
            metas = [(i.get("metadata") or {}) for i in items]
            finished.replace((m.get("namespace") or "", m.get("name") or "") for m in metas)

        def event(kind: str, obj: dict[str, Any]) -> None:
            meta = obj.get("metadata") or {}
            namespace, name = meta.get("namespace") or "", meta.get("name") or ""
            if kind == "ADDED":
                finished.added(namespace, name)
            elif kind == "DELETED":
                finished.deleted(namespace, name)

        async def path() -> str:
            if not c.path:
                c.path = await self._resource_path(c.group, c.resource)
            return c.path

        await self._list_watch(f"{c.label} (terminal)", path, replace, event,
                               metadata_only=True, query=TERMINAL_PODS)

    async def _resource_path(self, group: str, resource: str) -> str:
        if group:
            found = await self._get_json(f"/apis/{group}")
            version = (found.get("preferredVersion") or {}).get("version", "")
            base = f"/apis/{group}/{version}"
        else:
            base = "/api/v1"
        listing = await self._get_json(base)
        for res in listing.get("resources") or ():
            if res.get("name") == resource:
                if not res.get("namespaced", False):
                    raise Failed(f"{resource} is cluster-scoped: it has no namespace quota")
                return f"{base}/{resource}"
        raise Absent(f"the apiserver serves no {resource} in {base}")

    # --- ResourceQuotas -------------------------------------------------------------------------

    async def _run_rq(self) -> None:
        def drop(store: dict[str, dict[str, dict[str, int]]], namespace: str, name: str) -> None:
            held = store.get(namespace)
            if held is not None:
                held.pop(name, None)
                if not held:  # a namespace without quotas is not kept (namespaces come and go)
                    del store[namespace]

        def keep(store: dict[str, dict[str, dict[str, int]]], obj: dict[str, Any]) -> None:
            meta = obj.get("metadata") or {}
            namespace, name = meta.get("namespace") or "", meta.get("name") or ""
            spec = obj.get("spec") or {}
            if spec.get("scopes") or spec.get("scopeSelector"):  # pods only: not object counts
                drop(store, namespace, name)
                return
            store.setdefault(namespace, {})[name] = hard_counts(spec.get("hard"))

        def replace(items: list[dict[str, Any]]) -> None:
            store: dict[str, dict[str, dict[str, int]]] = {}
            for item in items:
                keep(store, item)
            self._rq = store
            self._rq_synced = True

        def event(kind: str, obj: dict[str, Any]) -> None:
            if kind in ("ADDED", "MODIFIED"):
                keep(self._rq, obj)
            elif kind == "DELETED":
                meta = obj.get("metadata") or {}
                drop(self._rq, meta.get("namespace") or "", meta.get("name") or "")

        async def path() -> str:
            return "/api/v1/resourcequotas"

        await self._list_watch("resourcequotas", path, replace, event, metadata_only=False)

    # --- ClusterResourceQuotas and namespaces ---------------------------------------------------

    async def _run_crq(self) -> None:
        while True:  # discover quota.openshift.io; absent: look again later, never fail
            try:
                found = await self._get_json(f"/apis/{CRQ_GROUP}")
                version = (found.get("preferredVersion") or {}).get("version", "")
                listing = await self._get_json(f"/apis/{CRQ_GROUP}/{version}")
                if not any(r.get("name") == "clusterresourcequotas"
                           for r in listing.get("resources") or ()):
                    raise Absent
                self._crq_path = f"/apis/{CRQ_GROUP}/{version}/clusterresourcequotas"
                break
            except asyncio.CancelledError:
                raise
            except (Absent, Failed) as e:  # not served (or not shown to us): none applies
                if self._crq_state != "absent":
                    log.info("quota: no ClusterResourceQuota API (%s: %s): none applies",
                             CRQ_GROUP, reason(e))
                self._crq_state = "absent"
            except Exception as e:  # no answer at all: cannot tell yet
                log.warning("quota: discovery of %s failed (%s)", CRQ_GROUP, reason(e))
                await asyncio.sleep(min(5.0, self._rediscover))
                continue
            await asyncio.sleep(self._rediscover)
        log.info("quota: watching ClusterResourceQuotas (%s)", self._crq_path)
        self._ns_task = self._spawn(self._ns_task, self._run_namespaces, "watch namespaces")
        self._crq_state = "present"

        def keep(obj: dict[str, Any]) -> None:
            meta = obj.get("metadata") or {}
            spec = obj.get("spec") or {}
            self._selected.clear()
            self._crq[meta.get("name") or ""] = (
                spec.get("selector") or {}, hard_counts((spec.get("quota") or {}).get("hard")))

        def replace(items: list[dict[str, Any]]) -> None:
            self._crq = {}
            self._selected.clear()
            for item in items:
                keep(item)
            self._crq_synced = True

        def event(kind: str, obj: dict[str, Any]) -> None:
            if kind in ("ADDED", "MODIFIED"):
                keep(obj)
            elif kind == "DELETED":
                self._crq.pop((obj.get("metadata") or {}).get("name") or "", None)
                self._selected.clear()

        async def path() -> str:
            return self._crq_path

        await self._list_watch("clusterresourcequotas", path, replace, event,
                               metadata_only=False)

    async def _run_namespaces(self) -> None:
        def keep(meta: dict[str, Any]) -> None:
            name = meta.get("name") or ""
            held = (dict(meta.get("labels") or {}), dict(meta.get("annotations") or {}))
            if self._ns.get(name) != held:  # a namespace's status changes select nothing new
                self._ns[name] = held
                self._selected.clear()

        def replace(items: list[dict[str, Any]]) -> None:
            self._ns = {}
            self._selected.clear()
            for item in items:
                keep(item.get("metadata") or {})
            self._ns_synced = True

        def event(kind: str, obj: dict[str, Any]) -> None:
            meta = obj.get("metadata") or {}
            if kind in ("ADDED", "MODIFIED"):
                keep(meta)
            elif kind == "DELETED":
                self._ns.pop(meta.get("name") or "", None)
                self._selected.clear()

        async def path() -> str:
            return "/api/v1/namespaces"

        await self._list_watch("namespaces", path, replace, event, metadata_only=True)

    # --- list+watch -------------------------------------------------------------------------------

    async def _list_watch(
        self, label: str, path: Callable[[], Awaitable[str]],
        replace: Callable[[list[dict[str, Any]]], None],
        event: Callable[[str, dict[str, Any]], None], *, metadata_only: bool,
        query: str = "",
    ) -> None:
        await self._lw.run(f"quota: counting {label}", path, replace=replace, event=event,
                           metadata_only=metadata_only, query=query)

    async def _get_json(self, path: str) -> dict[str, Any]:
        if not self._started:
            raise Failed("the quota counter is closed")
        return await self._lw.get_json(path)
