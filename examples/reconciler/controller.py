"""The controller loop: list then watch Widgets and the ConfigMaps they own, reconcile with workers.

Two informers, as controller-runtime's ``For(&Widget{}).Owns(&ConfigMap{})``:

* Widgets, into ``widgets.cache`` (key -> latest Widget): every change enqueues the Widget's key;
* the ConfigMaps this operator made (label-selected with ``app.kubernetes.io/managed-by``, so
  the cache holds no other ConfigMap): a change, an edit by someone else or a deletion,
  enqueues the key of the Widget its controller ``ownerReference`` names, which then puts the
  ConfigMap back. Without it a deleted ConfigMap stayed gone until its Widget changed.

Each informer:

* lists (paged), remembers the list's ``resourceVersion``, notifies every object (and every
  object that went away since the last list);
* watches from that version with ``allowWatchBookmarks=true``; every event, bookmarks included,
  moves the version forward, so a re-watch after the server ends the stream starts where it
  left off instead of relisting;
* on ``410 Gone``, whether the watch request gets it or the stream ends with an ``ERROR`` event of
  code 410, the version is too old: list again;
* 429 waits for ``Retry-After``; other failures back off exponentially with jitter.

A few workers take keys from the queue once the Widgets are listed (a key reconciled before
would find no Widget in the cache); a key is never reconciled by two workers at once, and a
failed key is retried after a per-key growing delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from . import resources as r
from .kube import ApiError, KubeClient
from .reconciler import Reconciler
from .retry import backoff_delay, retry_delay
from .workqueue import ShutDown, WorkQueue

log = logging.getLogger("reconciler")

WATCH_SECONDS = 300
PAGE_SIZE = 500


class Informer:
    """List then watch one collection into ``cache``; ``notify`` hears of every object change.

    ``notify`` is called with the object of every ADDED, MODIFIED or DELETED event, with every
    listed object, and with each cached object a relist no longer returns (its DELETED event was
    missed while no watch was open).
    """

    def __init__(
        self,
        client: KubeClient,
        path: str,
        *,
        kind: str,
        api_version: str,
        notify: Callable[[r.Obj], None],
        label_selector: str = "",
    ) -> None:
        self._client = client
        self.path = path
        self._kind = kind
        self._api_version = api_version
        self._notify = notify
        self._selector = label_selector
        self.cache: dict[str, r.Obj] = {}
        self.resource_version: str | None = None
        self.relists = 0
        self.synced = asyncio.Event()

    def _query(self, **params: str) -> dict[str, str]:
        if self._selector:
            params["labelSelector"] = self._selector
        return params

    async def run(self) -> None:
        attempt = 0
        while True:
            try:
                if self.resource_version is None:
                    await self._list()
                    attempt = 0
                started = time.monotonic()
                if await self._watch_once() or time.monotonic() - started > 1.0:
                    attempt = 0
                else:  # ended at once with nothing: do not spin on a server that closes early
                    await asyncio.sleep(backoff_delay(attempt))
                    attempt += 1
            except ApiError as err:
                if err.code == 410:
                    log.info("%s watch version expired (410 %s); relisting", self._kind,
                             err.reason or "Gone")
                    self.resource_version = None
                    continue
                delay = retry_delay(err.code, attempt=attempt, retry_after=err.retry_after)
                if delay is None:
                    delay = backoff_delay(attempt)
                attempt += 1
                log.warning("%s list/watch failed (%s); retrying in %.1fs", self._kind, err, delay)
                await asyncio.sleep(delay)
            except Exception:  # a malformed answer: start over from a fresh list
                delay = backoff_delay(attempt)
                attempt += 1
                log.exception("%s list/watch crashed; relisting in %.1fs", self._kind, delay)
                self.resource_version = None
                await asyncio.sleep(delay)

    async def _list(self) -> None:
        items: list[r.Obj] = []
        cont = ""
        while True:
            query = self._query(limit=str(PAGE_SIZE))
            if cont:
                query["continue"] = cont
            page = await self._client.request("GET", self.path, query=query)
            for item in page.get("items") or []:
                item.setdefault("apiVersion", self._api_version)
                item.setdefault("kind", self._kind)
                items.append(item)
            meta = page.get("metadata") or {}
            cont = meta.get("continue") or ""
            if not cont:
                version = str(meta.get("resourceVersion") or "")
                break
        fresh = {r.key_of(item): item for item in items}
        gone = [obj for key, obj in self.cache.items() if key not in fresh]
        self.cache = fresh
        self.resource_version = version or None
        self.relists += 1
        for obj in [*fresh.values(), *gone]:
            self._notify(obj)
        self.synced.set()
        log.info("listed %d %ss at resourceVersion %s", len(fresh), self._kind.lower(), version)

    async def _watch_once(self) -> int:
        """Follow one watch stream until the server ends it; return how many events came."""
        query = self._query(
            watch="true", resourceVersion=self.resource_version or "",
            allowWatchBookmarks="true", timeoutSeconds=str(WATCH_SECONDS))
        stream = self._client.watch(self.path, query=query, read_timeout=WATCH_SECONDS + 60)
        count = 0
        async with contextlib.aclosing(stream) as events:
            async for event in events:
                count += 1
                self.handle(event)
        return count

    def handle(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            raise ApiError.from_watch_event(obj)
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if kind == "BOOKMARK":
            if version:
                self.resource_version = version
            return
        key = r.key_of(obj)
        if kind == "DELETED":
            self.cache.pop(key, None)
        elif kind in ("ADDED", "MODIFIED"):
            self.cache[key] = obj
        else:
            log.warning("unknown watch event type %r", kind)
            return
        if version:
            self.resource_version = version
        self._notify(obj)


class Controller:
    def __init__(
        self,
        client: KubeClient,
        *,
        namespace: str | None = None,
        workers: int = 4,
        resync_seconds: float = 0.0,
    ) -> None:
        self._client = client
        self._namespace = namespace
        self._workers = workers
        self._resync = resync_seconds
        self._reconciler = Reconciler(client)
        self.queue = WorkQueue()
        self.widgets = Informer(client, self._collection(f"/apis/{r.GROUP}/{r.VERSION}",
                                                         r.PLURAL),
                                kind=r.KIND, api_version=r.API_VERSION,
                                notify=lambda widget: self.queue.add(r.key_of(widget)))
        self.configmaps = Informer(client, self._collection("/api/v1", "configmaps"),
                                   kind="ConfigMap", api_version="v1",
                                   notify=self._configmap_changed,
                                   label_selector=r.CONFIGMAP_SELECTOR)

    def _collection(self, base: str, plural: str) -> str:
        if self._namespace:
            return f"{base}/namespaces/{self._namespace}/{plural}"
        return f"{base}/{plural}"

    @property
    def cache(self) -> dict[str, r.Obj]:
        """The cached Widgets by key."""
        return self.widgets.cache

    def _configmap_changed(self, configmap: r.Obj) -> None:
        """An owned ConfigMap changed or went away: its Widget must be reconciled again."""
        key = r.owner_key(configmap)
        if key is not None:
            self.queue.add(key)

    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set; then let in-flight reconciles finish (briefly)."""
        informers = [asyncio.create_task(self.widgets.run(), name="widget-informer"),
                     asyncio.create_task(self.configmaps.run(), name="configmap-informer")]
        tasks = list(informers)
        tasks += [asyncio.create_task(self._worker(i), name=f"worker-{i}")
                  for i in range(self._workers)]
        if self._resync > 0:
            tasks.append(asyncio.create_task(self._resync_loop(), name="resync"))
        stopper = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is not stopper and task.exception() is not None:
                log.error("%s crashed: %r", task.get_name(), task.exception())
        self.queue.shutdown()
        self.widgets.synced.set()  # a worker still waiting for the first list: see the shutdown
        for task in informers:
            task.cancel()
        _, pending = await asyncio.wait(tasks, timeout=10)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, stopper, return_exceptions=True)

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(self._resync)
            for key in list(self.cache):
                self.queue.add(key)

    # -- workers --------------------------------------------------------------------------

    async def _worker(self, index: int) -> None:
        await self.widgets.synced.wait()
        while True:
            try:
                key = await self.queue.get()
            except ShutDown:
                return
            try:
                await self._process(key)
            finally:
                self.queue.done(key)

    async def _process(self, key: str) -> None:
        started = time.monotonic()
        fields: dict[str, Any] = {"widget": key}
        try:
            outcome = await self._reconciler.reconcile(self.cache.get(key), key=key)
        except ApiError as err:
            delay = self.queue.failure_delay(key)
            self.queue.add_after(key, delay)
            fields.update(result="error", error=str(err), retry_in=round(delay, 2),
                          ms=round((time.monotonic() - started) * 1000, 1))
            log.warning("reconcile failed", extra={"fields": fields})
            return
        except Exception as exc:  # a bug: keep the operator alive, retry later
            delay = self.queue.failure_delay(key)
            self.queue.add_after(key, delay)
            log.exception("reconcile crashed", extra={"fields": {**fields, "error": repr(exc)}})
            return
        self.queue.forget(key)
        fields["result"] = outcome.summary
        if outcome.generation:
            fields["generation"] = outcome.generation
        fields["ms"] = round((time.monotonic() - started) * 1000, 1)
        if outcome.conflicts:
            fields["conflicts"] = outcome.conflicts
        log.info("reconciled", extra={"fields": fields})
