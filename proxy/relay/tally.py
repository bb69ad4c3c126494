"""One quota'd resource's objects as the watch shows them, and this replica's creates waiting
for theirs: pure bookkeeping, no I/O, fed by :mod:`proxy.relay.counts` (or a test).

:class:`Tally` keeps the names of each namespace's objects (one short string per object, so
the middleware can tell an apply that creates from one that updates), the names that appeared
lately (which the quota store must not count a second time) and the :class:`Expected` objects
of admitted creates; :class:`Finished` keeps which pods are at their end of life, which
ResourceQuota's legacy ``pods`` does not count.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

__all__ = ["GONE", "INFLIGHT_SECONDS", "SETTLE_SECONDS", "Expected", "Finished", "Tally",
           "grace_ends"]

log = logging.getLogger("opgate.counts")

INFLIGHT_SECONDS = 60.0  # an admitted create is waited for this long, at most
SETTLE_SECONDS = 30.0  # and, once answered 2xx (or unknown), this long more
RECENT_SECONDS = 60.0  # names that appeared this recently are "seen" (>= INFLIGHT_SECONDS)
RECENT_MAX = 512  # per namespace and resource, the newest
GONE = "/"  # "/<name>" in seen(): appeared lately, then deleted (proxy.stores.base.GONE)


@dataclass(slots=True, eq=False)
class Expected:
    """One of this replica's admitted creates, waiting for its object to show in the watch."""

    tally: Tally
    namespace: str
    name: str
    prefix: str
    token: str
    expires: float
    on_seen: Callable[[], None] | None = None
    settled: bool = False
    done: bool = False


class Tally:
    """The names of one (group, resource)'s objects per namespace (list+watch), the names this
    replica saw appear lately, and this replica's admitted creates not seen yet.

    Pure bookkeeping, fed by the watch loop (or a test): :meth:`replace` after a list,
    :meth:`added` / :meth:`deleted` per event. The count of a namespace is the size of its set
    of names (one short string per object: what knowing whether an apply creates costs).
    ``recent`` is what the quota store's check is told not to count twice: names that appeared
    in the last ``recent_seconds`` and still exist, ``/<name>`` for those deleted since (at
    most ``recent_max`` per namespace, the newest), and ``|<token>`` for this replica's
    generateName creates whose object appeared.
    """

    def __init__(self, *, expect_seconds: float = INFLIGHT_SECONDS,
                 settle_seconds: float = SETTLE_SECONDS,
                 recent_seconds: float = RECENT_SECONDS, recent_max: int = RECENT_MAX,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.synced = False
        self.names: dict[str, set[str]] = {}
        self.recent: dict[str, dict[str, float]] = {}
        self.expected: dict[str, list[Expected]] = {}
        self.expect_seconds = expect_seconds
        self.settle_seconds = settle_seconds
        self.recent_seconds = recent_seconds
        self.recent_max = recent_max
        self.clock = clock
        self._next_sweep = 0.0
        self.finished: Finished | None = None  # pods: those at their end of life

    def count(self, namespace: str) -> int:
        names = self.names.get(namespace)
        return len(names) if names else 0

    def observed(self, namespace: str) -> int | None:
        """Objects in the namespace; ``None`` until the first list is done."""
        return self.count(namespace) if self.synced else None

    def exists(self, namespace: str, name: str) -> bool | None:
        if not self.synced:
            return None
        names = self.names.get(namespace)
        return names is not None and name in names

    def seen(self, namespace: str) -> tuple[str, ...]:
        recent = self.recent.get(namespace)
        if not recent:
            return ()
        horizon = self.clock() - self.recent_seconds
        if next(iter(recent.values())) <= horizon:
            for key in [k for k, at in recent.items() if at <= horizon]:
                del recent[key]
            if not recent:
                del self.recent[namespace]
                return ()
        return tuple(recent)

    def _note(self, namespace: str, key: str) -> None:
        now = self.clock()
        if now >= self._next_sweep:
            self._sweep(now)
        recent = self.recent.setdefault(namespace, {})
        recent.pop(key, None)
        recent[key] = now
        if len(recent) > self.recent_max:
            del recent[next(iter(recent))]

    def _sweep(self, now: float) -> None:
        """Forget the namespaces whose names all appeared before the horizon and those whose
        expected creates all expired: ``seen`` and ``expect`` only tidy the namespace they are
        asked about, and a namespace that is gone is never asked about again (at most once per
        ``recent_seconds``, so memory follows the namespaces in use, not all there ever were)."""
        horizon = now - self.recent_seconds
        for namespace in [ns for ns, recent in self.recent.items()
                          if next(reversed(recent.values()), 0.0) <= horizon]:
            del self.recent[namespace]
        for namespace in [ns for ns, pending in self.expected.items()
                          if all(e.expires <= now for e in pending)]:
            for e in self.expected.pop(namespace):
                e.done = True
        self._next_sweep = now + self.recent_seconds

    def expect(self, namespace: str, name: str, prefix: str, token: str,
               on_seen: Callable[[], None] | None = None) -> Expected:
        """Wait for the object of an admitted create: ``on_seen`` runs when it appears."""
        now = self.clock()
        if now >= self._next_sweep:
            self._sweep(now)
        pending = self.expected.setdefault(namespace, [])
        if pending and any(e.expires <= now for e in pending):
            for e in pending:
                if e.expires <= now:
                    e.done = True
            pending[:] = [e for e in pending if not e.done]
        e = Expected(self, namespace, name, "" if name else prefix, token,
                     now + self.expect_seconds, on_seen)
        pending.append(e)
        return e

    def settle(self, e: Expected, created: bool | None) -> None:
        """The create answered: a failed one is not waited for any more; a created one (or one
        whose outcome is unknown) at most ``settle_seconds`` more."""
        if e.done or e.settled:
            return
        e.settled = True
        if created is False:
            self._drop(e)
        else:
            e.expires = min(e.expires, self.clock() + self.settle_seconds)

    def _drop(self, e: Expected) -> None:
        e.done = True
        pending = self.expected.get(e.namespace)
        if pending and e in pending:
            pending.remove(e)
            if not pending:
                del self.expected[e.namespace]

    def _fulfilled(self, e: Expected) -> None:
        self._drop(e)
        if not e.name:
            self._note(e.namespace, "|" + e.token)
        if e.on_seen is not None:
            try:
                e.on_seen()
            except Exception:
                log.exception("quota: a reservation's on_seen callback failed")

    def _seen(self, namespace: str, name: str, generate_name: str) -> None:
        """A new object appeared: the create it fulfils is not waited for any more."""
        pending = self.expected.get(namespace)
        if not pending:
            return
        for e in pending:
            if e.name and e.name == name:
                self._fulfilled(e)
                return
        if generate_name:
            for e in pending:
                if not e.name and e.prefix == generate_name:
                    self._fulfilled(e)
                    return

    def added(self, namespace: str, name: str, generate_name: str = "") -> None:
        names = self.names.setdefault(namespace, set())
        if name in names:
            return
        names.add(name)
        if self.finished is not None:
            self.finished.appeared(namespace, name)
        self._note(namespace, name)
        self._seen(namespace, name, generate_name)

    def deleted(self, namespace: str, name: str) -> None:
        self._forget(namespace, name)
        names = self.names.get(namespace)
        if names is None or name not in names:
            return
        if self.finished is not None:
            self.finished.vanished(namespace, name)
        names.discard(name)
        if not names:
            del self.names[namespace]

    def _forget(self, namespace: str, name: str) -> None:
        """A name whose object is gone is not "seen" any more: the watch no longer counts it,
        so a reservation of that name (the object deleted and created again) must count. It
        is "/<name>" instead: the reservation of the deleted object itself, which may linger
        a few seconds, is not counted once its creator marked it shown (see ``quota.lua``)."""
        recent = self.recent.get(namespace)
        if recent is not None and recent.pop(name, None) is not None:
            self._note(namespace, GONE + name)

    def replace(self, objects: Iterable[tuple[str, str]]) -> set[str]:
        """A full list of ``(namespace, name)``; returns the namespaces whose count changed.
        Named creates whose object is listed are fulfilled; prefix ones wait for their expiry.
        After the first list, names that were not known before count as seen lately, and
        names no longer listed are not seen any more."""
        names: dict[str, set[str]] = {}
        for namespace, name in objects:
            names.setdefault(namespace, set()).add(name)
        for namespace, before in self.names.items():
            for name in before - names.get(namespace, set()):
                self._forget(namespace, name)
        for namespace, listed in names.items():
            before = self.names.get(namespace, set())
            if self.synced:
                for name in listed - before:
                    self._note(namespace, name)
            pending = self.expected.get(namespace)
            if pending:
                for e in [e for e in pending if e.name and e.name in listed]:
                    self._fulfilled(e)
        changed = {ns for ns in names.keys() | self.names.keys()
                   if len(names.get(ns, ())) != len(self.names.get(ns, ()))}
        self.names = names
        self.synced = True
        if self.finished is not None:
            self.finished.recount()
        return changed


def grace_ends(meta: Mapping[str, Any]) -> float | None:
    """When a pod being deleted stops counting under ``pods`` (wall-clock seconds): once its
    ``deletionTimestamp`` plus its ``deletionGracePeriodSeconds`` has passed, the apiserver's pod
    evaluator takes it for stuck terminating (a lost node) and leaves it out. ``None`` for a
    pod not being deleted, or a time that does not read (it counts: the safe side)."""
    stamp, grace = meta.get("deletionTimestamp"), meta.get("deletionGracePeriodSeconds")
    if not isinstance(stamp, str) or not isinstance(grace, int) or isinstance(grace, bool):
        return None
    try:
        at = datetime.fromisoformat(stamp)
    except ValueError:
        return None
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return at.timestamp() + grace


class Finished:
    """The pods of a :class:`Tally` in a terminal phase (Succeeded, Failed), from a second
    metadata-only list+watch (:data:`proxy.relay.counts.TERMINAL_PODS`): ResourceQuota's
    legacy ``pods`` does not count them, ``count/pods`` does (the apiserver's pod evaluator).
    Nor pods being deleted whose grace period has passed (:func:`grace_ends`, from the pods'
    own watch, which has the metadata): kept per name until the pod is gone, few at any time.

    :meth:`count` is the pods that both watches show, kept up to date per event (the hot path
    reads one dict entry): a pod this watch shows before the pods' watch does counts once that
    one shows it; a pod the pods' watch saw deleted stops counting at once (and a pod created
    again under its name, Pending, does not count). When either watch is behind, a pod counts
    as not finished: the safe side. Only names are kept, of finished pods only.
    """

    def __init__(self, pods: Tally) -> None:
        self.pods = pods
        self.synced = False
        self.names: dict[str, set[str]] = {}
        self.counted: dict[str, int] = {}
        self.deleting: dict[str, dict[str, float]] = {}  # namespace -> name -> grace_ends
        self.wall: Callable[[], float] = time.time  # deletionTimestamps are wall-clock times

    def count(self, namespace: str) -> int:
        counted = self.counted.get(namespace, 0)
        deleting = self.deleting.get(namespace)
        return counted + self._overdue(namespace, deleting) if deleting else counted

    def _overdue(self, namespace: str, deleting: dict[str, float]) -> int:
        """Pods past their grace period, not already counted as finished by phase."""
        now = self.wall()
        done = self.names.get(namespace) or ()
        pods = self.pods.names.get(namespace) or ()
        return sum(1 for name, ends in deleting.items()
                   if ends < now and name not in done and name in pods)

    def deletion(self, namespace: str, name: str, meta: Mapping[str, Any]) -> None:
        """A pod as the pods' watch shows it (ADDED, MODIFIED): being deleted or not."""
        ends = grace_ends(meta)
        if ends is not None:
            self.deleting.setdefault(namespace, {})[name] = ends

    def deletions(self, metas: Iterable[Mapping[str, Any]]) -> None:
        """After a list of the pods' watch: those being deleted."""
        deleting: dict[str, dict[str, float]] = {}
        for meta in metas:
            ends = grace_ends(meta)
            if ends is not None:
                deleting.setdefault(meta.get("namespace") or "", {})[meta.get("name") or ""] = ends
        self.deleting = deleting

    def _move(self, namespace: str, by: int) -> None:
        left = self.counted.get(namespace, 0) + by
        if left > 0:
            self.counted[namespace] = left
        else:
            self.counted.pop(namespace, None)

    def _shown(self, namespace: str, name: str) -> bool:
        names = self.pods.names.get(namespace)
        return names is not None and name in names

    def added(self, namespace: str, name: str) -> None:
        """A pod reached a terminal phase (or was listed in one)."""
        names = self.names.setdefault(namespace, set())
        if name in names:
            return
        names.add(name)
        if self._shown(namespace, name):
            self._move(namespace, 1)

    def deleted(self, namespace: str, name: str) -> None:
        """A finished pod was deleted (or left the phase)."""
        names = self.names.get(namespace)
        if names is None or name not in names:
            return
        names.discard(name)
        if not names:
            del self.names[namespace]
        if self._shown(namespace, name):
            self._move(namespace, -1)

    def replace(self, objects: Iterable[tuple[str, str]]) -> None:
        names: dict[str, set[str]] = {}
        for namespace, name in objects:
            names.setdefault(namespace, set()).add(name)
        self.names = names
        self.synced = True
        self.recount()

    def recount(self) -> None:
        """After a list of either watch."""
        counted: dict[str, int] = {}
        for namespace, names in self.names.items():
            pods = self.pods.names.get(namespace)
            if pods and (n := len(names & pods)):
                counted[namespace] = n
        self.counted = counted

    def appeared(self, namespace: str, name: str) -> None:
        """The pods' watch showed a new pod (told by the :class:`Tally`)."""
        names = self.names.get(namespace)
        if names is not None and name in names:
            self._move(namespace, 1)

    def vanished(self, namespace: str, name: str) -> None:
        """The pods' watch saw a pod deleted: it is not finished any more, whatever this watch
        says later (a pod created again under the name starts Pending)."""
        deleting = self.deleting.get(namespace)
        if deleting is not None and deleting.pop(name, None) is not None and not deleting:
            del self.deleting[namespace]
        names = self.names.get(namespace)
        if names is not None and name in names:
            self._move(namespace, -1)
            names.discard(name)
            if not names:
                del self.names[namespace]
