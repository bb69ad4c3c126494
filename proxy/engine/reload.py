"""The one task that notices policy file changes and reloads them (hot reload).

It watches the directories that hold the policy files (for a single file: its parent directory,
filtered to that file) with inotify through ``watchfiles``, non-recursively. Watching the
directory rather than the file is what catches a Kubernetes ConfigMap volume update: the kubelet
writes a new ``..<timestamp>`` directory and atomically renames a ``..data_tmp`` symlink over
``..data``, so ``policy.yaml -> ..data/policy.yaml`` changes while no event ever names it.
Changes are grouped until ``debounce_ms`` pass without another one, so an editor's truncate-
then-write is read whole; the reload then runs in a worker thread and swaps atomically.

It also watches each policy path's parent (its nearest existing ancestor), and the directory
of each symlink on the way to a policy path (git-sync's ``current`` link, swapped by a rename
there), and sets the watches up anew whenever a directory it watches, or should watch, goes,
comes back or is replaced, or such a symlink is: a policy directory deleted and recreated is
watched again as soon as it is back. Whether each
path is a directory or a single file is remembered from when it was first seen.

A slow safety poll compares the files' digest every ``poll_seconds`` (and once right after the
watches are set up), in case an event was missed: a file that is a symlink to somewhere else, a
network filesystem without inotify, a change made while the watches were being set up anew. It
runs on time however many unrelated changes the watched directories see.
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
    """What to watch for a store's paths, and which changes matter.

    ``kinds`` remembers, for each path, whether it is a directory or a single file, from the
    first time it was seen to exist: a policy directory that is deleted is still a directory
    while it is missing and when it comes back (it is not mistaken for a file in the meantime),
    and a single file stays a single file. A path never seen yet is decided when it appears.
    """

    def __init__(self, paths: tuple[str, ...], kinds: dict[str, bool]) -> None:
        self.dirs: set[str] = set()  # policy directories: any *.yaml in them counts
        self.files: set[str] = set()  # single policy files, and paths not seen yet
        for raw in paths:
            path = os.path.abspath(raw)
            if path not in kinds and os.path.exists(path):
                kinds[path] = os.path.isdir(path)
            (self.dirs if kinds.get(path) else self.files).add(path)
        # where a ConfigMap volume's ..data swap counts: a policy directory, a file's directory
        self.homes = self.dirs | {os.path.dirname(f) for f in self.files}
        watched = {d for d in self.dirs if os.path.isdir(d)}
        # each target's nearest existing ancestor too: it sees the target deleted, (re)created
        # or renamed into place, whatever happened to the directories in between
        watched.update(_nearest_dir(os.path.dirname(t)) for t in self.dirs | self.files)
        # a symlink on the way to a target (git-sync's "current", a "current -> release-N"
        # deploy) is swapped by a rename in its own directory, above every watch set so far
        self.links = {a for t in self.dirs | self.files for a in _ancestors(t)
                      if os.path.islink(a)}
        watched.update(_nearest_dir(os.path.dirname(a)) for a in self.links)
        self.watched = sorted(watched)
        self.identity = tuple(_identity(d) for d in self.watched)

    def matters(self, _change: Change, path: str) -> bool:
        """Whether a change may alter the policy set (a reload then tells for sure)."""
        path = os.path.abspath(path)
        if path in self.files or path in self.dirs or path in self.links:
            return True
        parent, name = os.path.split(path)
        if parent not in self.homes:
            return False
        if name.startswith(".."):  # ConfigMap volume: ..data, ..data_tmp, ..<timestamp>
            return True
        return parent in self.dirs and not name.startswith(".") and name.endswith(_SUFFIXES)

    def rearm(self, change: Change, path: str) -> bool:
        """Whether a change means the watches must be set up anew: a policy directory or a
        watched directory removed, replaced or created (a new one may reuse the old inode), or a
        symlink on the way to a target replaced (the watches below it see the old tree)."""
        path = os.path.abspath(path)
        return (path in self.dirs or path in self.links
                or (path in self.watched and change.name != "modified"))


def _ancestors(path: str) -> list[str]:
    """``path``'s directories, from its parent up to (not including) the root."""
    found = []
    path = os.path.dirname(path)
    while os.path.dirname(path) != path:
        found.append(path)
        path = os.path.dirname(path)
    return found


def _nearest_dir(path: str) -> str:
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _identity(path: str) -> tuple[str, int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return (path, -1, -1)
    return (path, st.st_dev, st.st_ino)


async def reload_now(store: PolicyStore) -> None:
    """Reload ``store`` now, in a worker thread (as a file event does; SIGHUP asks for it)."""
    try:
        await asyncio.to_thread(store.reload)
    except Exception:  # reload() reports policy errors itself; this is anything unexpected
        log.exception("policy reload crashed; keeping the active set")


async def reload_asked(store: PolicyStore) -> None:
    """A reload someone asked for (SIGHUP), with its outcome logged when there was nothing
    new to read, so the asker is not left guessing: the set that stays, and that the files
    are still broken when they are (a change logs its own outcome in ``store.reload``)."""
    before = store.seen_digest
    await reload_now(store)
    if store.seen_digest != before:
        return
    active = store.current.digest[:12] or "none"
    if store.failing:
        log.warning("SIGHUP: the policy files are unchanged and still fail to validate "
                    "(/debug/policies has the errors); keeping the active set (sha256 %s)",
                    active)
    else:
        log.info("SIGHUP: the policy files are unchanged; the active set stays (sha256 %s)",
                 active)


async def _poll(store: PolicyStore) -> None:
    try:
        changed = await asyncio.to_thread(store.changed)
    except Exception:
        log.exception("policy safety poll failed")
        return
    if changed:
        log.info("policy files changed without a file event; reloading")
        await reload_now(store)


async def _watch(store: PolicyStore, stop: asyncio.Event, debounce_ms: int,
                 poll_seconds: float) -> None:
    from watchfiles import awatch  # here: loaded only when there are policy files to watch

    kinds: dict[str, bool] = {}  # directory or file, per path, as first seen (see _Targets)
    next_poll = 0.0  # poll once as soon as the watch is armed: covers changes made before
    warned = False
    while not stop.is_set():
        targets = _Targets(store.paths, kinds)
        log.debug("watching %s for policy files %s", targets.watched,
                  sorted(targets.dirs | targets.files))
        try:
            # No watch_filter: awatch drops a batch that the filter empties without yielding,
            # so steady unrelated writes where it looks (a log file) would starve the poll.
            # ignore_permission_denied: a parent we may not read (mode 0711) is left unwatched
            # rather than failing the whole watch; the per-tick identity check covers it.
            async for changes in awatch(
                *targets.watched, debounce=max(debounce_ms, 500), step=debounce_ms,
                stop_event=stop, rust_timeout=_TICK_MS, yield_on_timeout=True, recursive=False,
                ignore_permission_denied=True,
            ):
                warned = False
                relevant = sorted(p for c, p in changes if targets.matters(c, p))
                if relevant:
                    log.debug("policy files changed: %s", relevant)
                    await reload_now(store)
                    next_poll = time.monotonic() + poll_seconds
                elif time.monotonic() >= next_poll:
                    await _poll(store)
                    next_poll = time.monotonic() + poll_seconds
                if (any(targets.rearm(c, p) for c, p in changes)
                        or _Targets(store.paths, kinds).identity != targets.identity):
                    # A directory went, came or was replaced: watch anew, and poll at once
                    # after that, for what changed before the new watches were in place.
                    next_poll = 0.0
                    break
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
