"""List, then watch from the list's resourceVersion: what opgate's informers share (the CR
instances' own qps, :mod:`proxy.relay.informer`; the quota counts, :mod:`proxy.relay.counts`).

The loop is kopf's and client-go's reflector's shape: list in pages (``limit``/``continue``),
watch from the list's resourceVersion with ``allowWatchBookmarks`` and a server
``timeoutSeconds`` of ~5 min (jittered), resume a watch that ends or idles from the last
resourceVersion, relist at once on 410 Gone (the HTTP status or an ERROR event), and back off on
any other failure (1 s doubling up to ``max_backoff``, with jitter; up to ``NOT_SERVED_RETRY``
for an API not served, :class:`Absent`: a CRD may be installed any time), logging once per
streak.
Requests go over an :class:`~proxy.relay.fast.client.UpstreamClient` (opgate's credentials,
no aiohttp), opened at the first call.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from urllib.parse import quote

from proxy.relay.endpoint import Endpoint, TokenSource
from proxy.relay.errors import describe
from proxy.relay.fast.client import Answer, UpstreamClient, json_lines

__all__ = [
    "JSON",
    "LIST_ACCEPT",
    "WATCH_ACCEPT",
    "Absent",
    "Failed",
    "Gone",
    "ListWatch",
    "apply_event",
    "reason",
]

log = logging.getLogger("opgate.informer")

JSON = "application/json"
# metadata only: opgate never holds whole objects it does not need
LIST_ACCEPT = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"
WATCH_ACCEPT = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json"

Replace = Callable[[list[dict[str, Any]]], None]  # every listed object, at the list's end
Event = Callable[[str, dict[str, Any]], None]  # ADDED/MODIFIED/DELETED and the object


# a resource not served (yet) is looked for again at least this often, however long it was
# missing: one discovery GET, so a CRD installed after opgate started counts within seconds
NOT_SERVED_RETRY = 4.0


class Gone(Exception):
    """410: the resourceVersion (or continue token) is too old; relist."""


class Failed(Exception):
    """An answer other than the one expected (status and a short, token-free reason)."""


class Absent(Failed):
    """404 for a path without a query: the API is not served (an optional CRD, say)."""


def reason(exc: BaseException) -> str:
    """A short, token-free account of a failure, for the log."""
    if isinstance(exc, Failed | Gone):
        return str(exc) or type(exc).__name__
    if isinstance(exc, ValueError):
        return f"bad JSON from the apiserver ({exc})"
    return describe(exc)


def _status_reason(answer: Answer, path: str) -> str:
    message = answer.message()
    return f"HTTP {answer.status} for {path.partition('?')[0]}" + (
        f": {message}" if message else "")


class ListWatch:
    """List+watch calls against one upstream, and the loop that keeps one resource in sync."""

    def __init__(
        self, endpoint: Endpoint, token: TokenSource, *, connect_timeout: float,
        user_agent: str, page_size: int = 500, watch_seconds: int = 300,
        idle_seconds: float = 90.0, max_backoff: float = 60.0,
    ) -> None:
        self._endpoint, self._token = endpoint, token
        self._connect_timeout = connect_timeout
        self._agent = user_agent
        self.page_size = page_size
        self.watch_seconds = watch_seconds
        self.idle_seconds = idle_seconds
        self.max_backoff = max_backoff
        self._client: UpstreamClient | None = None

    def client(self) -> UpstreamClient:
        if self._client is None:
            self._client = UpstreamClient(self._endpoint, self._token,
                                          connect_timeout=self._connect_timeout,
                                          user_agent=self._agent)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    async def stop(self, tasks: Iterable[asyncio.Task[None] | None]) -> None:
        """Cancel the loops (``run``) in ``tasks``, wait for them, close the connections."""
        running = [t for t in tasks if t is not None]
        for task in running:
            task.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)
        self.close()

    async def get_json(self, path: str, *, accept: str = JSON) -> dict[str, Any]:
        answer = await self.client().call("GET", path, accept=accept, within=60)
        if answer.status == 410:
            raise Gone
        if answer.status == 404 and "?" not in path:
            raise Absent(_status_reason(answer, path))
        if answer.status != 200:
            raise Failed(_status_reason(answer, path))
        doc = answer.json()
        if not isinstance(doc, dict):
            raise Failed(f"GET {path.partition('?')[0]}: not a JSON object")
        return doc

    async def list(
        self, path: str, *, accept: str = LIST_ACCEPT, query: str = "",
    ) -> tuple[list[dict[str, Any]], str]:
        """Every object of ``path`` (``query``: more parameters, a ``fieldSelector=…``), page
        by page, and the list's resourceVersion."""
        items: list[dict[str, Any]] = []
        token = ""
        more = f"&{query}" if query else ""
        while True:
            page_query = f"?limit={self.page_size}{more}" + (
                f"&continue={quote(token)}" if token else "")
            page = await self.get_json(path + page_query, accept=accept)
            items.extend(i for i in page.get("items") or () if isinstance(i, dict))
            meta = page.get("metadata") or {}
            token = meta.get("continue") or ""
            if not token:
                return items, str(meta.get("resourceVersion") or "")

    async def watch(self, path: str, resource_version: str, event: Event, *,
                    accept: str = WATCH_ACCEPT, query: str = "") -> str:
        """One watch stream (``query`` as for :meth:`list`); the resourceVersion to resume
        from (bookmarks move it too). With a field selector, an object that stops matching it
        arrives as ``DELETED``."""
        seconds = int(self.watch_seconds * (0.8 + random.random() * 0.4))
        where = (f"{path}?watch=1&allowWatchBookmarks=true"
                 f"&resourceVersion={quote(resource_version)}&timeoutSeconds={seconds}"
                 + (f"&{query}" if query else ""))
        async with self.client().stream(where, accept=accept,
                                        idle=self.idle_seconds or None) as (status, chunks):
            if status == 410:
                raise Gone
            if status != 200:
                raise Failed(_status_reason(Answer(status, b"".join(
                    [c async for c in chunks])), path))
            try:
                async for doc in json_lines(chunks):
                    resource_version = apply_event(doc, event, resource_version)
            except TimeoutError:  # idle: resume (a dead connection fails the next watch)
                pass
        return resource_version

    async def run(
        self, label: str, path: Callable[[], Awaitable[str | None]], *, replace: Replace,
        event: Event, metadata_only: bool = True,
        failures: Callable[[int], None] | None = None, query: str = "",
    ) -> None:
        """Keep ``path()``'s objects in sync until ``path()`` answers ``None``: ``replace``
        with every listed object, then ``event`` per watch event; ``failures(n)`` hears the
        failure streak (0 once listed again). ``query`` narrows the list and the watch alike
        (``fieldSelector=…``, already encoded)."""
        streak = 0
        list_accept, watch_accept = (LIST_ACCEPT, WATCH_ACCEPT) if metadata_only else (JSON, JSON)
        while True:
            try:
                where = await path()
                if where is None:
                    return
                items, version = await self.list(where, accept=list_accept, query=query)
                replace(items)
                if streak:
                    log.info("%s: in sync again", label)
                streak = 0
                if failures is not None:
                    failures(0)
                while version:
                    started = time.monotonic()
                    version = await self.watch(where, version, event, accept=watch_accept,
                                               query=query)
                    if time.monotonic() - started < 1.0:  # ended at once: do not spin
                        await asyncio.sleep(1.0)
            except asyncio.CancelledError:
                raise
            except Gone:
                continue
            except Exception as e:
                streak += 1
                if failures is not None:
                    failures(streak)
                ceiling = NOT_SERVED_RETRY if isinstance(e, Absent) else self.max_backoff
                delay = min(ceiling, 2.0 ** (streak - 1)) * (0.5 + random.random() / 2)
                level = logging.WARNING if streak == 1 else logging.DEBUG
                log.log(level, "%s failed (%s); retrying in %.1fs", label, reason(e), delay)
                await asyncio.sleep(delay)


def apply_event(doc: Any, event: Event, resource_version: str) -> str:
    """One watch event to ``event`` (not bookmarks); the resourceVersion it moves to.
    ERROR events raise: 410 ``Gone`` (relist), anything else ``Failed``."""
    if not isinstance(doc, dict):
        raise Failed("a watch event that is not a JSON object")
    kind = str(doc.get("type") or "")
    obj = doc.get("object") or {}
    if kind == "ERROR":
        if obj.get("code") == 410:
            raise Gone
        raise Failed(f"watch error {obj.get('code')}: {str(obj.get('message'))[:200]}")
    meta = obj.get("metadata") or {}
    resource_version = str(meta.get("resourceVersion") or resource_version)
    if kind != "BOOKMARK":
        event(kind, obj)
    return resource_version
