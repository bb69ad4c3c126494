"""What the quota middleware asks of the objects the apiserver holds: the :class:`QuotaCounts`
protocol, and :class:`MemoryQuotaCounts`, its in-process stand-in.

When serving, ``proxy.relay.counts.QuotaCounts`` implements the protocol with a list+watch of
every quota'd resource and of the quotas (the relay never imports the middlewares; the CLI wires
it up); tests and ``opgate demo`` set objects and quotas by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from proxy.middlewares.quota_limits import AlignedQuota
from proxy.middlewares.quota_spec import CLUSTER_RESOURCE_QUOTA

__all__ = ["MemoryQuotaCounts", "QuotaCounts", "UsageCallback"]

UsageCallback = Callable[[str, str, str, int], None]
"""``(group, resource, namespace, count)``: a watched count changed."""


class QuotaCounts(Protocol):
    """What the apiserver says exists (a list+watch when serving, a dict in tests).

    Every method is non-blocking and cheap: the hot path calls them.
    """

    def track(self, resources: Mapping[tuple[str, str], Callable[[str], bool]], *,
              resource_quotas: bool, cluster_quotas: bool,
              on_usage: UsageCallback | None = None) -> None:
        """Count these (group, resource) pairs (each with the namespaces whose counts are
        reported to ``on_usage``), and watch ResourceQuotas / ClusterResourceQuotas or not.
        Replaces the previous interest; idempotent; never blocks."""
        ...

    def observed(self, group: str, resource: str, namespace: str) -> int | None:
        """Objects in the namespace as the watch shows them; ``None`` until synced."""
        ...

    def exists(self, group: str, resource: str, namespace: str, name: str) -> bool | None:
        """Whether the watch shows this object; ``None`` until synced."""
        ...

    def seen(self, group: str, resource: str, namespace: str) -> Sequence[str]:
        """Names that appeared lately (and ``|<token>`` of this replica's generateName creates
        whose object appeared): their reservations must not be counted a second time."""
        ...

    def aligned(self, namespace: str, *, resource_quotas: bool,
                cluster_quotas: bool) -> Sequence[AlignedQuota] | None:
        """The namespace's ResourceQuotas and the ClusterResourceQuotas that select it (none
        when the cluster serves no such API); ``None`` until synced."""
        ...

    def beyond(self, group: str, resource: str, namespace: str, quota: str) -> int:
        """Objects of the resource in the other namespaces that ClusterResourceQuota ``quota``
        selects (its limit is for all of them together)."""
        ...

    def finished(self, group: str, resource: str, namespace: str) -> int:
        """Objects of ``observed`` at their end of life, which :func:`live_key` does not count:
        pods Succeeded or Failed, or deleted and past their grace period (0 for other
        resources)."""
        ...

    def finished_beyond(self, group: str, resource: str, namespace: str, quota: str) -> int:
        """:meth:`finished` in the other namespaces ClusterResourceQuota ``quota`` selects."""
        ...

    def expect(self, group: str, resource: str, namespace: str, name: str, generate_name: str,
               token: str, on_seen: Callable[[], None] | None = None) -> object:
        """Wait for the object of an admitted create; ``on_seen`` runs when it appears."""
        ...

    def settle(self, expected: object, created: bool | None) -> None:
        """The create answered: ``True`` 2xx, ``False`` failed, ``None`` unknown (timeout)."""
        ...



class MemoryQuotaCounts:
    """Objects and quotas set by hand (tests, ``opgate demo``); every pair is synced at once
    unless :meth:`unsync` says otherwise. :meth:`add` plays a watch event."""

    def __init__(self) -> None:
        self.names: dict[tuple[str, str, str], set[str]] = {}
        self.ended: dict[tuple[str, str, str], set[str]] = {}
        self.recent: dict[tuple[str, str, str], list[str]] = {}
        self.quotas: list[tuple[str, str, frozenset[str] | None, dict[str, int]]] = []
        self.expected: dict[int, tuple[tuple[str, str, str], str, str, str,
                                       Callable[[], None] | None]] = {}
        self.unsynced: set[tuple[str, str]] = set()
        self.quotas_synced = True
        self.interest: dict[str, Any] = {}
        self.settled: list[bool | None] = []
        self._next = 0

    def set(self, group: str, resource: str, namespace: str, count: int) -> None:
        """``count`` objects (named ``existing-<i>``) in the namespace, none seen lately."""
        self.names[(group, resource, namespace)] = {f"existing-{i}" for i in range(count)}

    def add(self, group: str, resource: str, namespace: str, name: str,
            generate_name: str = "") -> None:
        """An object appeared in the watch."""
        key = (group, resource, namespace)
        self.names.setdefault(key, set()).add(name)
        self.recent.setdefault(key, []).append(name)
        for handle, (where, want, prefix, token, on_seen) in list(self.expected.items()):
            if where == key and ((want and want == name) or (
                    not want and generate_name and prefix == generate_name)):
                del self.expected[handle]
                if not want:
                    self.recent[key].append("|" + token)
                if on_seen is not None:
                    on_seen()
                break

    def finish(self, group: str, resource: str, namespace: str, name: str) -> None:
        """An object reached its end of life (a pod Succeeded): still there, not ``live``."""
        self.ended.setdefault((group, resource, namespace), set()).add(name)

    def unsync(self, group: str, resource: str) -> None:
        self.unsynced.add((group, resource))

    def add_quota(self, kind: str, name: str, hard: Mapping[str, int], *,
                  namespaces: Sequence[str] | None = None) -> None:
        """A ResourceQuota (``namespaces=[its namespace]``) or ClusterResourceQuota (the
        namespaces it selects)."""
        self.quotas.append((kind, name, None if namespaces is None else frozenset(namespaces),
                            dict(hard)))

    def track(self, resources: Mapping[tuple[str, str], Callable[[str], bool]], *,
              resource_quotas: bool, cluster_quotas: bool,
              on_usage: UsageCallback | None = None) -> None:
        self.interest = {"resources": dict(resources), "resource_quotas": resource_quotas,
                         "cluster_quotas": cluster_quotas}

    def observed(self, group: str, resource: str, namespace: str) -> int | None:
        if (group, resource) in self.unsynced:
            return None
        return len(self.names.get((group, resource, namespace), ()))

    def exists(self, group: str, resource: str, namespace: str, name: str) -> bool | None:
        if (group, resource) in self.unsynced:
            return None
        return name in self.names.get((group, resource, namespace), ())

    def seen(self, group: str, resource: str, namespace: str) -> Sequence[str]:
        return tuple(self.recent.get((group, resource, namespace), ()))

    def aligned(self, namespace: str, *, resource_quotas: bool,
                cluster_quotas: bool) -> Sequence[AlignedQuota] | None:
        if not self.quotas_synced:
            return None
        return [(kind, name, hard) for kind, name, where, hard in self.quotas
                if where is None or namespace in where]

    def beyond(self, group: str, resource: str, namespace: str, quota: str) -> int:
        return sum(len(self.names.get((group, resource, ns), ()))
                   for kind, name, where, _hard in self.quotas
                   if kind == CLUSTER_RESOURCE_QUOTA and name == quota and where is not None
                   for ns in where if ns != namespace)

    def finished(self, group: str, resource: str, namespace: str) -> int:
        key = (group, resource, namespace)
        return len(self.ended.get(key, set()) & self.names.get(key, set()))

    def finished_beyond(self, group: str, resource: str, namespace: str, quota: str) -> int:
        return sum(self.finished(group, resource, ns)
                   for kind, name, where, _hard in self.quotas
                   if kind == CLUSTER_RESOURCE_QUOTA and name == quota and where is not None
                   for ns in where if ns != namespace)

    def expect(self, group: str, resource: str, namespace: str, name: str, generate_name: str,
               token: str, on_seen: Callable[[], None] | None = None) -> object:
        self._next += 1
        self.expected[self._next] = ((group, resource, namespace), name,
                                     "" if name else generate_name, token, on_seen)
        return self._next

    def settle(self, expected: object, created: bool | None) -> None:
        self.settled.append(created)
        if created is False:
            self.expected.pop(expected, None)  # type: ignore[call-overload]
