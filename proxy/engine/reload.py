"""The one task that notices policy file changes and reloads them (hot reload).

It watches the directories that hold the policy files (for a single file: its parent directory,
filtered to that file) with inotify through ``watchfiles``, non-recursively. Watching the
directory rather than the file is what catches a Kubernetes ConfigMap volume update: the kubelet
writes a new ``..<timestamp>`` directory and atomically renames a ``..data_tmp`` symlink over
``..data``, so ``policy.yaml -> ..data/policy.yaml`` changes while no event ever names it.
Changes are grouped until ``debounce_ms`` pass without another one, so an editor's truncate-
then-write is read whole; the reload then runs in a worker thread and swaps atomically.

A slow safety poll compares the files' digest every ``poll_seconds`` (and once right after the
watch starts), in case an event was missed: a watched directory replaced wholesale, a file that
is a symlink to somewhere else, a network filesystem without inotify.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING

from proxy.engine.policies import PolicyStore

if TYPE_CHECKING:
    from watchfiles import Change

log = logging.getLogger("opgate.policies")

_SUFFIXES = (".yaml", ".yml")
_TICK_MS = 1000  # the watch wakes at least this often to run the safety poll when it is due


async def watch_policies(
    store: PolicyStore, *, debounce_ms: int = 50, poll_seconds: float = 10.0
) -> None:
    """Reload ``store`` whenever its files change, until cancelled.

    Start it once, after the first ``store.reload()``. Cancelling it stops the watcher thread
    within about ``debounce_ms``; a reload already running finishes (it is atomic anyway).
    """
    stop = asyncio.Event()
    inner = asyncio.create_task(_watch(store, stop, debounce_ms, poll_seconds))
    try:
        await asyncio.shield(inner)
    except asyncio.CancelledError:
        stop.set()  # wakes the watcher thread, which polls this flag every step
        inner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await inner
        raise


class _Targets:
    """What to watch for a store's paths, and which changes matter."""

    def __init__(self, paths: tuple[str, ...]) -> None:
        self.dirs: set[str] = set()  # policy directories: any *.yaml in them counts
        self.files: set[str] = set()  # single policy files
        for raw in paths:
            path = os.path.abspath(raw)
            if os.path.isdir(path):
                self.dirs.add(path)
            else:
                self.files.add(path)
        self.watched = sorted(self.dirs | {os.path.dirname(f) for f in self.files})

    def existing(self) -> list[str]:
        return [d for d in self.watched if os.path.isdir(d)]

    def matters(self, _change: Change, path: str) -> bool:
        path = os.path.abspath(path)
        if path in self.files or path in self.watched:  # a watched directory itself: re-arm
            return True
        parent, name = os.path.split(path)
        if parent not in self.watched:
            return False
        if name.startswith(".."):  # ConfigMap volume: ..data, ..data_tmp, ..<timestamp>
            return True
        return parent in self.dirs and not name.startswith(".") and name.endswith(_SUFFIXES)


async def _reload(store: PolicyStore) -> None:
    try:
        await asyncio.to_thread(store.reload)
    except Exception:  # reload() reports policy errors itself; this is anything unexpected
        log.exception("policy reload crashed; keeping the active set")


async def _poll(store: PolicyStore) -> None:
    try:
        changed = await asyncio.to_thread(store.changed)
    except Exception:
        log.exception("policy safety poll failed")
        return
    if changed:
        log.info("policy files changed without a file event; reloading")
        await _reload(store)


async def _watch(store: PolicyStore, stop: asyncio.Event, debounce_ms: int,
                 poll_seconds: float) -> None:
    from watchfiles import awatch  # here: loaded only when there are policy files to watch

    next_poll = 0.0  # poll once as soon as the watch is armed: covers changes made before
    warned = False
    while not stop.is_set():
        targets = _Targets(store.paths)
        dirs = targets.existing()
        try:
            if not dirs:
                raise FileNotFoundError(f"none of {targets.watched} exists")
            async for changes in awatch(
                *dirs, watch_filter=targets.matters, debounce=max(debounce_ms, 500),
                step=debounce_ms, stop_event=stop, rust_timeout=_TICK_MS, yield_on_timeout=True,
                recursive=False,
            ):
                warned = False
                if changes:
                    log.debug("policy files changed: %s", sorted(p for _, p in changes))
                    await _reload(store)
                    next_poll = time.monotonic() + poll_seconds
                elif time.monotonic() >= next_poll:
                    await _poll(store)
                    next_poll = time.monotonic() + poll_seconds
                if any(path in targets.watched for _, path in changes):
                    break  # a watched directory was removed or replaced: watch it anew
            else:
                return  # the stop event ended the watch
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not warned:
                log.warning("cannot watch policy files (%s); polling every %gs", exc, poll_seconds)
                warned = True
            await asyncio.sleep(min(poll_seconds, 1.0))
            if time.monotonic() >= next_poll:
                await _poll(store)
                next_poll = time.monotonic() + poll_seconds
