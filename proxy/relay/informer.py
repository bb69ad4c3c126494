"""A watch-fed cache of custom-resource metadata: each CR instance's own qps, no GET per call.

``instanceAnnotation`` (e.g. ``opgate.dev/qps``) lets a CR instance set its own rate. A GET per
call to read it would add to the very load the rate limit protects, so :class:`InformerPool`
runs one list+watch per custom resource (at most ``max_resources``, 16) and keeps only what
``get`` answers from: per ``(namespace, name)`` the valid values of the wanted annotations. It
asks for metadata only (``PartialObjectMetadata[List]``): opgate never holds whole objects.

Interest, simple and explicit (it implements ``proxy.middlewares.instance.InstanceOverrides``):

- ``want(group, version, resource)``: the rate-limit middleware calls it when a call for a custom
  resource needs ``{instance}`` and the resource is not watched yet ("the object itself"). The
  resource's kind and scope come from discovery (``GET /apis/<group>/<version>``) once.
- ``get(namespace, kind, name, annotation)``: a kind not seen yet (named by the
  ``Opgate-Instance`` header or an ownerReference) starts a discovery of the custom API groups
  (each kind at most every ``rediscover_seconds``), and each resource of that kind is wanted.
  An annotation name not seen yet joins the kept set (at most 8) and the running watches relist
  to pick it up; while no annotation is wanted a resource is only discovered (its kind), not
  listed nor watched.
- Until a resource is discovered and listed, ``kind_of`` / ``get`` answer ``None``: such calls
  get ``-`` / the rule's plain qps. Nothing here ever blocks or fails a call.
- A wanted annotation whose value is not a qps (``parse_qps``: "fast", "0", "1e309") is not
  kept, so the rule's qps applies, and a warning names the instance and the value (once per
  value: not again at each relist; at most ``MAX_WARNED`` remembered).

Each watch (kopf's shape): list (pages of 500) → watch from the list's resourceVersion with
``allowWatchBookmarks`` and a server ``timeoutSeconds`` of ~5 min, an inactivity timeout of
``idle_seconds``; a watch that ends or idles resumes from the last resourceVersion; 410 Gone (the
HTTP status or an ERROR event) relists at once; any other failure backs off (1 s doubling up to
60 s, with jitter; up to ``NOT_SERVED_RETRY``, 4 s, for a resource not served: its group's 404,
or a group served whose discovery does not show it yet, the moment after its CRD is created),
then reads the group's preferred version again (a CRD's upgrade may stop
serving the one watched) and relists. Failures are logged at warning once per streak.

Credentials are the upstream's (token, token file or client certificate; ``opgate serve``'s
``--token-file`` / kubeconfig / in-cluster ServiceAccount): that identity needs ``list`` and
``watch`` on the custom resources.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from proxy.engine.kinds import MIN_QPS, is_custom_group, parse_qps
from proxy.relay.endpoint import Endpoint, TokenSource, make_ssl_context
from proxy.relay.listwatch import Absent, Failed, ListWatch, reason
from proxy.relay.upstream import UpstreamConfig

__all__ = ["InformerPool"]

log = logging.getLogger("opgate.informer")

USER_AGENT = "opgate-informer"
MAX_ANNOTATIONS = 8
MAX_WARNED = 1024  # (instance, annotation, value)s already warned of as not a qps
DISCOVERY_GAP = 5.0  # seconds between two discoveries of unknown kinds (headers are free text)


@dataclass(slots=True, eq=False)
class _Resource:
    group: str
    version: str
    resource: str
    kind: str = ""
    namespaced: bool = True
    objects: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None
    failures: int = 0  # in a row; reset once a watch is open again

    @property
    def label(self) -> str:
        return f"{self.resource}.{self.group}"

    @property
    def path(self) -> str:
        return f"/apis/{self.group}/{self.version}/{self.resource}"


class InformerPool:
    """List+watch loops over custom resources (metadata only); see the module docstring."""

    def __init__(
        self, upstream: UpstreamConfig, *, max_resources: int = 16, connect_timeout: float = 5.0,
        page_size: int = 500, watch_seconds: int = 300, idle_seconds: float = 90.0,
        rediscover_seconds: float = 30.0, max_backoff: float = 60.0,
    ) -> None:
        endpoint = Endpoint.from_config(upstream, make_ssl_context(upstream))
        token = TokenSource(token=upstream.token, token_file=upstream.token_file)
        self._lw = ListWatch(endpoint, token, connect_timeout=connect_timeout,
                             user_agent=USER_AGENT, page_size=page_size,
                             watch_seconds=watch_seconds, idle_seconds=idle_seconds,
                             max_backoff=max_backoff)
        self.max_resources = max_resources
        self._rediscover = rediscover_seconds
        self._started = False
        self._resources: dict[tuple[str, str], _Resource] = {}
        self._by_kind: dict[str, list[_Resource]] = {}
        self._annotations: frozenset[str] = frozenset()
        self._kinds_searched: dict[str, float] = {}
        self._pending_kinds: set[str] = set()
        self._discovery: asyncio.Task[None] | None = None
        self._last_discovery = -DISCOVERY_GAP
        self._full_logged = False
        self._warned: set[tuple[str, str, str, str, str]] = set()

    # --- InstanceOverrides (hot path: dict lookups, never blocks, never raises) ---------

    def get(self, namespace: str, kind: str, name: str, annotation: str) -> float | None:
        if annotation not in self._annotations:
            self._want_annotation(annotation)
        found = self._by_kind.get(kind)
        if found is None:
            self._want_kind(kind)
            return None
        for r in found:
            values = r.objects.get((namespace, name))
            if values is not None and annotation in values:
                return values[annotation]
        return None

    def kind_of(self, group: str, resource: str) -> str | None:
        r = self._resources.get((group, resource))
        return r.kind or None if r is not None else None

    def want(self, group: str, version: str, resource: str) -> None:
        self._add(group, version, resource)

    def cluster_scoped(self, kind: str) -> bool:
        found = self._by_kind.get(kind)
        return bool(found) and not any(r.namespaced for r in found or ())

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Start watching what is wanted (connections open only once something is)."""
        self._started = True
        for r in self._resources.values():
            self._spawn(r)
        self._discover_later()

    async def close(self) -> None:
        self._started = False
        await self._lw.stop([*(r.task for r in self._resources.values()), self._discovery])

    # --- interest ----------------------------------------------------------------------

    def _add(self, group: str, version: str, resource: str, *, kind: str = "",
             namespaced: bool = True) -> None:
        if (group, resource) in self._resources or not is_custom_group(group):
            return
        if len(self._resources) >= self.max_resources:
            if not self._full_logged:
                log.warning("informer: already watching %d resources; not watching %s.%s",
                            self.max_resources, resource, group)
                self._full_logged = True
            return
        r = _Resource(group, version, resource, kind=kind, namespaced=namespaced)
        self._resources[(group, resource)] = r
        if kind:
            self._by_kind.setdefault(kind, []).append(r)
        self._spawn(r)

    def _want_annotation(self, annotation: str) -> None:
        if len(self._annotations) >= MAX_ANNOTATIONS or not annotation:
            return
        self._annotations = self._annotations | {annotation}
        for r in self._resources.values():  # relist to keep the new annotation too
            if r.task is not None:
                r.task.cancel()
                r.task = None
            self._spawn(r)

    def _want_kind(self, kind: str) -> None:
        now = time.monotonic()
        last = self._kinds_searched.get(kind)
        if last is not None and now - last < self._rediscover:
            return
        if len(self._kinds_searched) >= 256:
            self._kinds_searched.clear()
        self._kinds_searched[kind] = now
        self._pending_kinds.add(kind)
        self._discover_later()

    def _spawn(self, r: _Resource) -> None:
        if self._started and (r.task is None or r.task.done()):
            r.task = asyncio.get_running_loop().create_task(self._run(r), name=f"watch {r.label}")

    def _discover_later(self) -> None:
        if not self._started or not self._pending_kinds:
            return
        if self._discovery is None or self._discovery.done():
            self._discovery = asyncio.get_running_loop().create_task(
                self._discover_kinds(), name="informer discovery")

    # --- discovery ---------------------------------------------------------------------

    async def _discover_kinds(self) -> None:
        """Find the resources of the pending kinds; runs at least ``DISCOVERY_GAP`` apart."""
        while self._pending_kinds:
            await asyncio.sleep(self._last_discovery + DISCOVERY_GAP - time.monotonic())
            self._last_discovery = time.monotonic()
            kinds, self._pending_kinds = self._pending_kinds, set()
            try:
                groups = await self._get_json("/apis", accept="application/json")
                for group in groups.get("groups") or ():
                    name = group.get("name", "")
                    version = (group.get("preferredVersion") or {}).get("version", "")
                    if not is_custom_group(name) or not version:
                        continue
                    found = await self._get_json(f"/apis/{name}/{version}",
                                                 accept="application/json")
                    for res in found.get("resources") or ():
                        if res.get("kind") in kinds and "/" not in res.get("name", "/"):
                            self._add(name, version, res["name"], kind=res["kind"],
                                      namespaced=bool(res.get("namespaced", True)))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("informer: discovery of %s failed: %s", ", ".join(sorted(kinds)),
                            reason(e))

    async def _discover(self, r: _Resource) -> None:
        found = await self._get_json(f"/apis/{r.group}/{r.version}", accept="application/json")
        for res in found.get("resources") or ():
            if res.get("name") == r.resource:
                r.kind = str(res.get("kind") or "")
                r.namespaced = bool(res.get("namespaced", True))
        if not r.kind:  # its group is served, its CRD not yet: as soon back as a 404
            raise Absent(f"the apiserver serves no {r.label} in {r.group}/{r.version}")
        self._by_kind.setdefault(r.kind, []).append(r)

    async def _follow_version(self, r: _Resource) -> None:
        """After a failed list or watch: the group's preferred version, which a CRD's upgrade
        changes when it stops serving the old one (the objects' metadata is the same in all)."""
        found = await self._get_json(f"/apis/{r.group}", accept="application/json")
        version = str((found.get("preferredVersion") or {}).get("version") or "")
        if version and version != r.version:
            log.info("informer: %s is served in %s now, not %s", r.label, version, r.version)
            r.version = version

    # --- one resource: discover, list, watch --------------------------------------------

    async def _run(self, r: _Resource) -> None:
        async def path() -> str | None:
            if not r.kind:
                await self._discover(r)
            elif r.failures:  # its CRD's upgrade may serve another version now (404 for ever)
                await self._follow_version(r)
            # the kind is all that is needed until an annotation is wanted
            return r.path if self._annotations else None

        def replace(items: list[dict[str, Any]]) -> None:
            objects: dict[tuple[str, str], dict[str, float]] = {}
            for item in items:
                self._keep(r, objects, item.get("metadata") or {})
            if r.failures:
                log.info("informer: watching %s again (%d instances)", r.label, len(objects))
            r.objects = objects

        def failures(streak: int) -> None:
            r.failures = streak

        await self._lw.run(f"informer: {r.label}", path, replace=replace,
                           event=partial(self._event, r), failures=failures)

    def _event(self, r: _Resource, kind: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        if kind in ("ADDED", "MODIFIED"):
            self._keep(r, r.objects, meta)
        elif kind == "DELETED":
            r.objects.pop((meta.get("namespace") or "", meta.get("name") or ""), None)

    def _keep(self, r: _Resource, objects: dict[tuple[str, str], dict[str, float]],
              meta: dict[str, Any]) -> None:
        key = (meta.get("namespace") or "", meta.get("name") or "")
        annotations = meta.get("annotations") or {}
        values: dict[str, float] = {}
        for a in self._annotations:
            raw = annotations.get(a)
            if raw is None:
                continue
            value = parse_qps(raw)
            if value is None:
                self._not_a_qps(r, key, a, raw)
            else:
                values[a] = value
        if values:
            objects[key] = values
        else:
            objects.pop(key, None)

    def _not_a_qps(self, r: _Resource, key: tuple[str, str], annotation: str, raw: object) -> None:
        """Warn that an instance's annotation is ignored, once per value."""
        shown = str(raw)[:64]
        seen = (r.label, *key, annotation, shown)
        if seen in self._warned:
            return
        if len(self._warned) >= MAX_WARNED:
            self._warned.clear()
        self._warned.add(seen)
        where = f"{key[0]}/{key[1]}" if key[0] else key[1]
        log.warning('informer: %s %s: annotation %s "%s" is not a qps (a number of at least '
                    "%g); its calls get the rule's qps", r.kind or r.label, where, annotation,
                    shown, MIN_QPS)

    # --- HTTP ------------------------------------------------------------------------------

    async def _get_json(self, path: str, *, accept: str) -> dict[str, Any]:
        if not self._started:
            raise Failed("the informer pool is closed")
        return await self._lw.get_json(path, accept=accept)
