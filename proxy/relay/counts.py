"""Object counts and quotas as the apiserver sees them, for the quota middleware.

:class:`QuotaCounts` implements ``proxy.middlewares.quota.QuotaCounts``. For every quota'd
(group, resource) it runs one metadata-only list+watch over all namespaces
(``PartialObjectMetadata``, as :mod:`proxy.relay.informer` does) and keeps only a count per
namespace; objects created or deleted by anyone are counted. With ``resource_quotas`` it
watches every ResourceQuota (their ``spec.hard``); with ``cluster_quotas`` it discovers
``quota.openshift.io`` and, only when the cluster serves it, watches the ClusterResourceQuotas
and the namespaces' labels and annotations (metadata only) that their selectors match. When the
API is absent nothing fails: no ClusterResourceQuota applies (it is looked for again every
``rediscover_seconds``).

A create the middleware admitted is *reserved* (:class:`Reservation`) from its entry hook on:
counted in :meth:`QuotaCounts.used` until the watch reports the object (``ADDED`` with its name,
or for a ``generateName`` create the next new object with that prefix), or the create fails
(:meth:`QuotaCounts.settle` ``False``). A reservation whose create succeeded (or whose outcome
is unknown) but whose object the watch never showed expires after ``settle_seconds`` (it was
deleted at once, or a relist counted it); one still in flight after ``inflight_seconds``.
This is what keeps a burst of concurrent creates from overshooting between a 201 and its watch
event.

The watch loops follow the informer's: list (pages of ``page_size``) → watch from the list's
resourceVersion with bookmarks and a server timeout of ~5 min; resume from the last
resourceVersion; 410 Gone relists; any other failure backs off (1 s doubling up to 60 s, with
jitter). A resource the apiserver does not serve (yet) is looked for again with the same
backoff. Until a pair's first list is done, ``used`` answers ``None`` (the middleware then
fails as the policy says); until the quotas are listed, ``aligned`` does.

Credentials are the upstream's (``--token-file``, the kubeconfig or the pod's ServiceAccount):
that identity needs ``list`` and ``watch`` on the quota'd resources in every namespace, on
``resourcequotas`` (``alignWith: [ResourceQuota]``) and on ``namespaces`` and
``clusterresourcequotas.quota.openshift.io`` (``ClusterResourceQuota``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from proxy.relay.endpoint import Endpoint, TokenSource, make_ssl_context
from proxy.relay.listwatch import Absent, Failed, ListWatch, reason
from proxy.relay.upstream import UpstreamConfig

__all__ = ["QuotaCounts", "Reservation", "Tally", "parse_count", "selects"]

log = logging.getLogger("opgate.counts")

USER_AGENT = "opgate-quota"
CRQ_GROUP = "quota.openshift.io"
INFLIGHT_SECONDS = 600.0
SETTLE_SECONDS = 60.0

UsageCallback = Callable[[str, str, str, int], None]
AlignedQuota = tuple[str, str, Mapping[str, int]]


# --- quantities and selectors --------------------------------------------------------------

_QUANTITY = re.compile(r"([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)")
_SUFFIXES = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
             "m": Decimal("0.001")}


def parse_count(raw: object) -> int | None:
    """A Kubernetes quantity as an object count (``"10"``, ``"1k"``, ``5``), rounded up as
    the apiserver's ``Value()`` does; ``None`` when it is not one."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return raw
    if not isinstance(raw, str):
        return None
    m = _QUANTITY.fullmatch(raw.strip())
    if m is None or m.group(2) not in _SUFFIXES:
        return None
    try:
        value = Decimal(m.group(1)) * _SUFFIXES[m.group(2)]
    except InvalidOperation:
        return None
    whole = int(value.to_integral_value(rounding="ROUND_CEILING"))
    return whole if whole >= 0 else None


def _hard(raw: object) -> dict[str, int]:
    if not isinstance(raw, dict):
        return {}
    out = {}
    for key, value in raw.items():
        count = parse_count(value)
        if count is not None and isinstance(key, str):
            out[key] = count
    return out


def _requirement(req: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, op = req.get("key", ""), req.get("operator", "")
    values = req.get("values") or ()
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    return False  # an operator this code does not know selects nothing


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str],
            annotations: Mapping[str, str]) -> bool:
    """Whether a ClusterResourceQuota's ``spec.selector`` (``labels``: a LabelSelector, null =
    every namespace; ``annotations``: all must be equal) selects a namespace."""
    if not selector:
        return False
    label_selector = selector.get("labels")
    if label_selector is not None:
        for key, value in (label_selector.get("matchLabels") or {}).items():
            if labels.get(key) != value:
                return False
        for req in label_selector.get("matchExpressions") or ():
            if not _requirement(req, labels):
                return False
    for key, value in (selector.get("annotations") or {}).items():
        if annotations.get(key) != value:
            return False
    return True


# --- one resource's count, with reservations ------------------------------------------------

@dataclass(slots=True, eq=False)
class Reservation:
    """One admitted create, counted until its object is seen or the create fails."""

    tally: Tally
    namespace: str
    name: str
    prefix: str
    expires: float
    settled: bool = False
    done: bool = False


class Tally:
    """Objects of one (group, resource) per namespace (list+watch), plus reservations.

    Pure bookkeeping, fed by the watch loop (or a test): :meth:`replace` after a list,
    :meth:`added` / :meth:`deleted` per event.
    """

    def __init__(self, *, inflight_seconds: float = INFLIGHT_SECONDS,
                 settle_seconds: float = SETTLE_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.synced = False
        self.counts: dict[str, int] = {}
        self.reserved: dict[str, list[Reservation]] = {}
        self.inflight_seconds = inflight_seconds
        self.settle_seconds = settle_seconds
        self.clock = clock

    def used(self, namespace: str) -> int | None:
        if not self.synced:
            return None
        return self.counts.get(namespace, 0) + self._live(namespace)

    def _live(self, namespace: str) -> int:
        pending = self.reserved.get(namespace)
        if not pending:
            return 0
        now = self.clock()
        if any(r.expires <= now for r in pending):
            for r in pending:
                if r.expires <= now:
                    r.done = True
            pending[:] = [r for r in pending if not r.done]
            if not pending:
                del self.reserved[namespace]
        return len(pending)

    def reserve(self, namespace: str, name: str, prefix: str) -> Reservation:
        r = Reservation(self, namespace, name, "" if name else prefix,
                        self.clock() + self.inflight_seconds)
        self.reserved.setdefault(namespace, []).append(r)
        return r

    def settle(self, r: Reservation, created: bool | None) -> None:
        if r.done or r.settled:
            return
        r.settled = True
        if created is False:
            self._drop(r)
        else:
            r.expires = self.clock() + self.settle_seconds

    def _drop(self, r: Reservation) -> None:
        r.done = True
        pending = self.reserved.get(r.namespace)
        if pending and r in pending:
            pending.remove(r)
            if not pending:
                del self.reserved[r.namespace]

    def _seen(self, namespace: str, name: str, generate_name: str) -> None:
        """A new object appeared: the reservation it fulfils ends."""
        pending = self.reserved.get(namespace)
        if not pending:
            return
        for r in pending:
            if r.name and r.name == name:
                self._drop(r)
                return
        if generate_name:
            for r in pending:
                if not r.name and r.prefix == generate_name:
                    self._drop(r)
                    return

    def added(self, namespace: str, name: str, generate_name: str = "") -> None:
        self.counts[namespace] = self.counts.get(namespace, 0) + 1
        self._seen(namespace, name, generate_name)

    def deleted(self, namespace: str) -> None:
        left = self.counts.get(namespace, 0) - 1
        if left > 0:
            self.counts[namespace] = left
        else:
            self.counts.pop(namespace, None)

    def replace(self, objects: Iterable[tuple[str, str]]) -> set[str]:
        """A full list of ``(namespace, name)``; returns the namespaces whose count changed.
        Named reservations whose object is listed end; prefix ones wait for their expiry."""
        counts: dict[str, int] = {}
        for namespace, name in objects:
            counts[namespace] = counts.get(namespace, 0) + 1
            pending = self.reserved.get(namespace)
            if pending:
                for r in pending:
                    if r.name == name:
                        self._drop(r)
                        break
        changed = {ns for ns in counts.keys() | self.counts.keys()
                   if counts.get(ns, 0) != self.counts.get(ns, 0)}
        self.counts = counts
        self.synced = True
        return changed


# --- the watches ------------------------------------------------------------------------------

@dataclass(slots=True, eq=False)
class _Counted:
    group: str
    resource: str
    namespaces: Callable[[str], bool]
    tally: Tally = field(default_factory=Tally)
    path: str = ""
    task: asyncio.Task[None] | None = None

    @property
    def label(self) -> str:
        return f"{self.resource}.{self.group}" if self.group else self.resource


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
            if counted.task is not None:
                counted.task.cancel()
        for (group, resource), namespaces in resources.items():
            counted = self._counted.get((group, resource))
            if counted is None:
                counted = _Counted(group, resource, namespaces, Tally(
                    settle_seconds=self._settle_seconds))
                self._counted[(group, resource)] = counted
            counted.namespaces = namespaces
            if counted.tally.synced:
                for namespace in counted.tally.counts:
                    self._report(counted, namespace)
            self._spawn_counted(counted)
        self._want_rq = resource_quotas
        self._want_crq = cluster_quotas
        self._spawn_quotas()

    def used(self, group: str, resource: str, namespace: str) -> int | None:
        counted = self._counted.get((group, resource))
        return None if counted is None else counted.tally.used(namespace)

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

    def reserve(self, group: str, resource: str, namespace: str, name: str,
                generate_name: str) -> object:
        counted = self._counted.get((group, resource))
        if counted is None:
            return None
        return counted.tally.reserve(namespace, name, generate_name)

    def settle(self, reservation: object, created: bool | None) -> None:
        if isinstance(reservation, Reservation):
            reservation.tally.settle(reservation, created)

    def describe(self) -> str:
        """One line for ``/readyz?verbose``: what is synced."""
        parts = [f"{c.label}={'synced' if c.tally.synced else 'syncing'}"
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
        tasks = [c.task for c in self._counted.values()]
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

    # --- quota'd resources --------------------------------------------------------------------

    def _report(self, counted: _Counted, namespace: str) -> None:
        if self._on_usage is not None and counted.namespaces(namespace):
            try:
                self._on_usage(counted.group, counted.resource, namespace,
                               counted.tally.counts.get(namespace, 0))
            except Exception:
                log.exception("quota usage callback failed")

    async def _run_counted(self, c: _Counted) -> None:
        tally = c.tally

        def replace(items: list[dict[str, Any]]) -> None:
            metas = [(i.get("metadata") or {}) for i in items]
            changed = tally.replace((m.get("namespace") or "", m.get("name") or "")
                                    for m in metas)
            for namespace in changed:
                self._report(c, namespace)

        def event(kind: str, obj: dict[str, Any]) -> None:
            meta = obj.get("metadata") or {}
            namespace = meta.get("namespace") or ""
            if kind == "ADDED":
                tally.added(namespace, meta.get("name") or "", meta.get("generateName") or "")
            elif kind == "DELETED":
                tally.deleted(namespace)
            else:
                return
            self._report(c, namespace)

        async def path() -> str:
            if not c.path:
                c.path = await self._resource_path(c.group, c.resource)
            return c.path

        await self._list_watch(c.label, path, replace, event, metadata_only=True)

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
        raise Failed(f"the apiserver serves no {resource} in {base}")

    # --- ResourceQuotas -------------------------------------------------------------------------

    async def _run_rq(self) -> None:
        def keep(store: dict[str, dict[str, dict[str, int]]], obj: dict[str, Any]) -> None:
            meta = obj.get("metadata") or {}
            namespace, name = meta.get("namespace") or "", meta.get("name") or ""
            spec = obj.get("spec") or {}
            if spec.get("scopes") or spec.get("scopeSelector"):  # pods only: not object counts
                store.get(namespace, {}).pop(name, None)
                return
            store.setdefault(namespace, {})[name] = _hard(spec.get("hard"))

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
                self._rq.get(meta.get("namespace") or "", {}).pop(meta.get("name") or "", None)

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
            self._crq[meta.get("name") or ""] = (
                spec.get("selector") or {}, _hard((spec.get("quota") or {}).get("hard")))

        def replace(items: list[dict[str, Any]]) -> None:
            self._crq = {}
            for item in items:
                keep(item)
            self._crq_synced = True

        def event(kind: str, obj: dict[str, Any]) -> None:
            if kind in ("ADDED", "MODIFIED"):
                keep(obj)
            elif kind == "DELETED":
                self._crq.pop((obj.get("metadata") or {}).get("name") or "", None)

        async def path() -> str:
            return self._crq_path

        await self._list_watch("clusterresourcequotas", path, replace, event,
                               metadata_only=False)

    async def _run_namespaces(self) -> None:
        def keep(meta: dict[str, Any]) -> None:
            self._ns[meta.get("name") or ""] = (dict(meta.get("labels") or {}),
                                               dict(meta.get("annotations") or {}))

        def replace(items: list[dict[str, Any]]) -> None:
            self._ns = {}
            for item in items:
                keep(item.get("metadata") or {})
            self._ns_synced = True

        def event(kind: str, obj: dict[str, Any]) -> None:
            meta = obj.get("metadata") or {}
            if kind in ("ADDED", "MODIFIED"):
                keep(meta)
            elif kind == "DELETED":
                self._ns.pop(meta.get("name") or "", None)

        async def path() -> str:
            return "/api/v1/namespaces"

        await self._list_watch("namespaces", path, replace, event, metadata_only=True)

    # --- list+watch -------------------------------------------------------------------------------

    async def _list_watch(
        self, label: str, path: Callable[[], Awaitable[str]],
        replace: Callable[[list[dict[str, Any]]], None],
        event: Callable[[str, dict[str, Any]], None], *, metadata_only: bool,
    ) -> None:
        await self._lw.run(f"quota: counting {label}", path, replace=replace, event=event,
                           metadata_only=metadata_only)

    async def _get_json(self, path: str) -> dict[str, Any]:
        if not self._started:
            raise Failed("the quota counter is closed")
        return await self._lw.get_json(path)
