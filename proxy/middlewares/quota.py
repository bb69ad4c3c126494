"""The quota middleware: ``spec.quotas`` object-count limits, in the apiserver's own words.

A ``create`` of a quota'd resource (no subresource) in a namespace an entry matches is checked
(and so is a server-side apply that creates: a ``PATCH`` with an ``application/apply-patch+…``
body to a named object that the counts do not show in the namespace; an apply to an object that
exists is an update) against the entry's effective limit: the smallest of its ``max`` and,
with ``alignWith``, the ``count/<resource>[.<group>]`` (or legacy ``configmaps``, ``secrets``…)
hard limits of every ResourceQuota in that namespace and of every ClusterResourceQuota
(``quota.openshift.io/v1``, when the cluster serves it) that selects the namespace (less the
objects in the other namespaces it selects: OpenShift counts them together). Over it,
the call gets the 403 the apiserver's ResourceQuota admission would send, word for word::

    configmaps "cm-7" is forbidden: exceeded quota: team-quota, requested: count/configmaps=1,
    used: count/configmaps=5, limited: count/configmaps=5

naming the policy entry's quota (its ``name``, else the policy's ``metadata.name``) or the
aligned quota whose limit is smaller. Pods are counted as the apiserver's pod evaluator counts
them: ``count/pods`` (and an entry's own ``max``, an object count) every pod, the legacy ``pods``
only those not Succeeded or Failed nor stuck terminating past their grace period
(:meth:`QuotaCounts.finished`); the admit-and-reserve is
still one store call, against the limits in ``count/pods`` terms (a ``pods`` limit plus the
finished pods), so a create reserves room in both, and a denial prints each key's own used
(``used: count/pods=3,pods=2``). The object's name is the body's ``metadata.name``, JSON
or protobuf (the body is read only for such creates: :meth:`Quota.wants_body`); with
``generateName`` the name is generated as the apiserver does (the prefix and five random
characters); a body in another encoding (CBOR) leaves it out (``configmaps is forbidden: …``).

"Used" is the objects the apiserver holds plus the creates on their way. The objects come from
the apiserver, not from opgate's own bookkeeping: the :class:`QuotaCounts`
(``proxy.relay.counts.QuotaCounts`` when serving) keeps a metadata-only list+watch of every
quota'd resource (the objects' names per namespace) and a watch of the ResourceQuotas (and
ClusterResourceQuotas), so objects created or deleted by anyone are counted. The creates on
their way are *reservations* in the store (:meth:`proxy.stores.base.Store.reserve`): in Redis
with ``--redis-url``, so shared by every replica and ``--workers`` process, else in-process.
The entry hook admits and reserves in ONE atomic store call (``quota.lua`` in Redis) that
checks this replica's observed count plus every replica's live reservations against the
smallest enforced limit; reservations whose object this replica's watch already shows
(:meth:`QuotaCounts.seen`: by name, or for a ``generateName`` create of this replica by its
token) are not counted twice. A reservation is ``<name>|<token>``; the exit hook drops it when
the create failed (an apply answered 200 updated an object after all) and otherwise lets it
expire within ``settle_seconds``; when this replica's watch shows the object it is cut to
``linger_seconds`` (the other replicas' watches catch up meanwhile); and it expires by itself
``reserve_seconds`` after the create came in. So a burst over several replicas cannot
overshoot; the rare errors are on the safe side (a ``generateName`` object another replica
already sees is counted twice until its reservation lingers out). Only creates of quota'd
resources reach the store.

When the store cannot answer (Redis down: :class:`proxy.stores.breaker.ResilientStore`), a
create whose enforced entries all have ``failure: open`` is reserved in-process (this replica's
own reservations only, as without Redis) and one with a ``failure: closed`` entry answers 503;
``opgate_quota_reservations_total{backend}`` counts admitted creates by store (``redis``,
``local``, ``fallback``).

Until the counts (and, for aligned entries, the quotas) are synced, an entry fails as its
``failure`` says: ``closed`` answers 503, ``open`` admits. A ``dryrun`` entry never denies: it
counts (``opgate_dryrun_denials_total{middleware="quota"}``), logs and adds a ``Warning``.
``opgate_quota_denials_total{resource}`` counts denials; ``opgate_quota_usage{namespace,
resource}`` is the watched count per quota'd resource in each namespace an entry matches (so
its namespaces are bounded by the policies' ``namespaces`` patterns).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import secrets
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.engine import telemetry
from proxy.engine.chain import Maybe
from proxy.engine.context import Decision, Deny, RequestContext
from proxy.engine.protometa import MAGIC as PROTOBUF_MAGIC
from proxy.engine.protometa import read_meta
from proxy.engine.status import forbidden, object_details, service_unavailable
from proxy.middlewares.quota_spec import (
    CLUSTER_RESOURCE_QUOTA,
    RESOURCE_QUOTA,
    SECTION,
    BoundQuota,
    bind_quotas,
    count_key,
    legacy_key,
    live_key,
    parse_section,
    qualified,
)
from proxy.stores.base import SHOWN, Reservation, Store
from proxy.stores.memory import MemoryStore

__all__ = ["SECTION", "MemoryQuotaCounts", "Quota", "QuotaCounts", "denial_message",
           "format_count", "generate_name", "parse_section"]

log = logging.getLogger("opgate.quota")

# k8s.io/apimachinery/pkg/util/rand: what names generated from generateName are made of
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_MAX_GENERATED_PREFIX = 63 - 5
STATE_KEY = "quota"
RESERVE_SECONDS = 60.0  # a reservation expires by itself this long after its create came in,
SETTLE_SECONDS = 30.0  # this long after the create answered 2xx (or no answer),
LINGER_SECONDS = 5.0  # and this long after this replica's watch showed the object

AlignedQuota = tuple[str, str, Mapping[str, int]]
"""``(kind, name, hard)``: a ResourceQuota or ClusterResourceQuota and its count limits."""
Shift = Mapping[str, int]
"""Per key of an aligned quota, what it counts besides the namespace's objects and reservations
(a ClusterResourceQuota's other namespaces; less the finished pods, for ``pods``)."""
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


def generate_name(prefix: str, rng: random.Random | None = None) -> str:
    """A name as the apiserver generates it from ``generateName`` (``gen-7nlsj``)."""
    choice = (rng or random).choice
    return prefix[:_MAX_GENERATED_PREFIX] + "".join(choice(_NAME_ALPHABET) for _ in range(5))


_DECIMAL_SUFFIXES = ("", "k", "M", "G", "T", "P", "E")


def format_count(count: int) -> str:
    """A count as the apiserver prints a decimal quantity: canonical, so ``1000`` is ``1k``
    and ``1500`` stays ``1500`` (its quota controller writes ``used`` so, and a ``hard: 1000``
    reads back as ``1k``)."""
    if count == 0:
        return "0"
    power = 0
    while count % 1000 == 0 and power < len(_DECIMAL_SUFFIXES) - 1:
        count //= 1000
        power += 1
    return f"{count}{_DECIMAL_SUFFIXES[power]}"


def _limit_text(hard: int) -> str:
    """A limit as the apiserver prints it: an aligned quota's own quantity (its ``text``, as
    ``proxy.relay.quotaobjects.Count`` carries it: ``1Ki`` stays ``1Ki``), else canonically."""
    return getattr(hard, "text", "") or format_count(hard)


Exceeded = tuple[str, int, int]
"""``(key, hard, used)``: one limit a create exceeds, and what that key counts."""


def denial_message(group: str, resource: str, name: str, quota: str,
                   exceeded: Sequence[Exceeded]) -> str:
    """The apiserver's ResourceQuota admission message (``exceeded`` sorted by key; each key
    with its own used, as the quota's status holds them: ``count/pods=3,pods=2``)."""
    what = qualified(group, resource)
    subject = f'{what} "{name}"' if name else what
    requested = ",".join(f"{key}=1" for key, _, _ in exceeded)
    used = ",".join(f"{key}={format_count(count)}" for key, _, count in exceeded)
    limited = ",".join(f"{key}={_limit_text(hard)}" for key, hard, _ in exceeded)
    return (f"{subject} is forbidden: exceeded quota: {quota}, requested: {requested}, "
            f"used: {used}, limited: {limited}")


def exceeded_limit(
    b: BoundQuota, group: str, resource: str, used: int, aligned: Sequence[AlignedQuota],
    shifts: Sequence[Shift] = (),
) -> tuple[str, list[Exceeded]] | None:
    """``(quota name, [(key, hard, used)])`` of the smallest limit that one more object exceeds
    (the entry's own ``max`` on a tie), or ``None`` when the create fits. ``used`` is the
    namespace's objects and reservations; ``shifts[i]`` what each key of ``aligned[i]`` counts
    besides (a ClusterResourceQuota's other namespaces take room here, and its "used" is the
    sum, as OpenShift says it; ``pods`` leaves the finished pods out)."""
    keys = _keys(group, resource)
    found: list[tuple[int, int, str, list[Exceeded]]] = []
    if b.rule.max is not None and used + 1 > b.rule.max:
        found.append((b.rule.max, 0, b.quota_name, [(keys[0], b.rule.max, used)]))
    for order, (kind, name, hard) in enumerate(aligned, start=1):
        if kind not in b.rule.align_with:
            continue
        shift = shifts[order - 1] if order <= len(shifts) else {}
        counted = {k: used + shift.get(k, 0) for k in keys if k in hard}
        over = sorted((k, hard[k], n) for k, n in counted.items() if n + 1 > hard[k])
        if over:
            room = min(h - shift.get(k, 0) for k, h, _ in over)
            found.append((room, order, name, over))
    if not found:
        return None
    _, _, name, over = min(found, key=lambda f: (f[0], f[1]))
    return name, over


def _keys(group: str, resource: str) -> list[str]:
    """The names a quota may count the resource by: ``count/…``, and the legacy one."""
    legacy = legacy_key(group, resource)
    return [count_key(group, resource)] + ([legacy] if legacy else [])


def _body_name(ctx: RequestContext) -> tuple[str, str]:
    """``(name, generateName)`` from a JSON or protobuf create body (``("", "")`` when there is
    none)."""
    body = ctx.body
    if not body:
        return "", ""
    if body.startswith(PROTOBUF_MAGIC):
        meta = read_meta(body)
        return (meta.name, meta.generate_name) if meta is not None else ("", "")
    try:
        meta = json.loads(body).get("metadata") or {}
        name, prefix = meta.get("name") or "", meta.get("generateName") or ""
    except (ValueError, AttributeError):
        return "", ""
    return (name if isinstance(name, str) else ""), (prefix if isinstance(prefix, str) else "")


_NAMED_TYPES = frozenset({"application/json", "application/vnd.kubernetes.protobuf"})


def _names_in_body(ctx: RequestContext) -> bool:
    """Whether the create's body is one whose name :func:`_body_name` reads: JSON, or the
    protobuf that client-go's typed clients send by default."""
    return ctx.media_type in _NAMED_TYPES


_APPLY_TYPES = frozenset({"application/apply-patch+yaml", "application/apply-patch+json",
                          "application/apply-patch+cbor"})


def _is_apply(ctx: RequestContext) -> bool:
    """A server-side apply: a PATCH whose body is an apply configuration."""
    return ctx.media_type in _APPLY_TYPES


def _dry_run(ctx: RequestContext) -> bool:
    return "dryRun=" in ctx.query


def _outcome(code: int, apply: bool = False) -> bool | None:
    """Whether a create answered ``code`` made the object (``None``: cannot tell). An apply
    answered 200 updated an object that existed after all: not a create."""
    if apply and code == 200:
        return False
    if 200 <= code < 300:
        return True
    if code == 0 or code == 504:  # no answer, or the apiserver/opgate gave up waiting
        return None
    return False


def effective_limit(b: BoundQuota, group: str, resource: str,
                    aligned: Sequence[AlignedQuota], shifts: Sequence[Shift] = ()) -> int | None:
    """The most objects (and reservations) an entry lets the namespace hold: its ``max``, and
    its aligned quotas' hard counts less what each key counts besides (``shifts``, as for
    :func:`exceeded_limit`: a ``pods`` limit leaves room for the finished pods, which it does
    not count); ``None`` when nothing limits it here. One number, so a pod create reserves
    room in both pod counts in one store call."""
    keys = _keys(group, resource)
    limits = [b.rule.max] if b.rule.max is not None else []
    for i, (kind, _name, hard) in enumerate(aligned):
        if kind in b.rule.align_with:
            shift = shifts[i] if i < len(shifts) else {}
            limits.extend(max(0, hard[k] - shift.get(k, 0)) for k in keys if k in hard)
    return min(limits) if limits else None


_CREATING = frozenset({"create", "patch"})  # the verbs _matched can match (a patch: an apply)


@dataclass(slots=True)
class _Held:
    """What the exit hook settles: the store's member and what the counter waits for."""

    scope: str
    member: str
    expected: object
    apply: bool


class Quota:
    name = "quota"
    needs_body = True  # narrowed per call by wants_body: JSON creates a quota entry matches
    fail_open = False
    sections = (SECTION,)
    verbs = _CREATING  # entry counts only creates (and applies); exit settles only what it held

    def __init__(self, *, counts: QuotaCounts | None = None, store: Store | None = None,
                 rng: random.Random | None = None, reserve_seconds: float = RESERVE_SECONDS,
                 settle_seconds: float = SETTLE_SECONDS,
                 linger_seconds: float = LINGER_SECONDS) -> None:
        self.counts: QuotaCounts = counts or MemoryQuotaCounts()
        self.store: Store = store if store is not None else MemoryStore()
        self.reserve_seconds = reserve_seconds
        self.settle_seconds = settle_seconds
        self.linger_seconds = linger_seconds
        self._rng = rng
        self._plan_for: object = None
        self._plan: dict[tuple[str, str], list[BoundQuota]] = {}
        self._background: set[asyncio.Task[None]] = set()

    # --- the policy set's entries, and what the counter must watch for them ------------------

    def prepare(self, policies: Any) -> None:
        """Bind the entries of ``policies`` and tell the counter what to watch (at start and
        after a reload; the entry hook does it too for a set it has not seen)."""
        self._plan_of(policies)

    def _plan_of(self, policies: Any) -> dict[tuple[str, str], list[BoundQuota]]:
        if policies is not self._plan_for:
            plan = bind_quotas(policies.section(SECTION))
            rq = any(RESOURCE_QUOTA in b.rule.align_with for bs in plan.values() for b in bs)
            crq = any(CLUSTER_RESOURCE_QUOTA in b.rule.align_with
                      for bs in plan.values() for b in bs)
            interest = {pair: _namespace_filter(bound) for pair, bound in plan.items()}
            telemetry.clear_quota_usage()  # namespaces of the old set's entries
            self.counts.track(interest, resource_quotas=rq, cluster_quotas=crq,
                              on_usage=_report_usage)
            self._plan = plan
            self._plan_for = policies  # held: identity stays meaningful
        return self._plan

    def _matched(self, ctx: RequestContext) -> list[BoundQuota] | None:
        info = ctx.info
        if info.subresource or not info.namespace or not info.is_resource_request:
            return None
        if info.verb != "create" and not (
                info.verb == "patch" and info.name and _is_apply(ctx)):
            return None
        bound = self._plan_of(ctx.policies).get((info.api_group, info.resource))
        if not bound:
            return None
        return [b for b in bound if b.applies(info.namespace)] or None

    def wants_body(self, ctx: RequestContext) -> bool:
        """The body of a JSON or protobuf create that an entry matches (for the object's
        name)."""
        return ctx.method == "POST" and _names_in_body(ctx) and self._matched(ctx) is not None

    # --- hooks ------------------------------------------------------------------------------

    def entry(self, ctx: RequestContext) -> Maybe[Decision | None]:
        if ctx.info.verb not in _CREATING:  # reads, updates, deletes: nothing to count
            return None
        matched = self._matched(ctx)
        if matched is None:
            return None
        return self._create(ctx, matched)

    async def _create(self, ctx: RequestContext, matched: list[BoundQuota]) -> Decision | None:
        """``entry`` for a create (or an apply) that quotas count."""
        info = ctx.info
        group, resource, namespace = info.api_group, info.resource, info.namespace
        apply = info.verb == "patch"
        if apply and self.counts.exists(group, resource, namespace, info.name):
            return None  # an apply to an object that exists is an update, not a create
        observed = self.counts.observed(group, resource, namespace)
        rq = any(RESOURCE_QUOTA in b.rule.align_with for b in matched)
        crq = any(CLUSTER_RESOURCE_QUOTA in b.rule.align_with for b in matched)
        aligned = (self.counts.aligned(namespace, resource_quotas=rq, cluster_quotas=crq)
                   if rq or crq else ())
        checked: list[BoundQuota] = []
        for b in matched:
            if observed is None or (aligned is None and b.rule.align_with):
                if b.dryrun or b.fail_open:
                    log.debug("quota %s of policy %s: counts not synced; %s lets %s through",
                              b.quota_name, b.policy, "dryrun" if b.dryrun else "failure: open",
                              ctx.path)
                    continue
                return Deny(service_unavailable(
                    f"opgate: the object counts of {qualified(group, resource)} are not synced "
                    f'with the apiserver yet and quota "{b.quota_name}" of policy "{b.policy}" '
                    f"({b.where}) fails closed; retry later", retry_after=1), "unavailable")
            checked.append(b)
        if observed is None or not checked:
            return None
        aligned = aligned or ()
        shifts = self._shifts(group, resource, namespace, aligned)
        enforced = [b for b in checked if not b.dryrun]
        limits = [x for b in enforced
                  if (x := effective_limit(b, group, resource, aligned, shifts)) is not None]
        names = (info.name, "") if apply else _body_name(ctx)
        token = secrets.token_hex(8)
        scope = f"{group}/{resource}/{namespace}"
        member = f"{names[0] or info.name}|{token}"
        reserved = await self.store.reserve(Reservation(
            scope=scope, member=member, observed=observed, limit=min(limits, default=-1),
            ttl=self.reserve_seconds, seen=tuple(self.counts.seen(group, resource, namespace)),
            check_only=_dry_run(ctx), fail_open=all(b.fail_open for b in enforced)))
        if reserved.unavailable:
            b = next(b for b in enforced if not b.fail_open)
            return Deny(service_unavailable(
                f'opgate: the quota store is unavailable and quota "{b.quota_name}" of policy '
                f'"{b.policy}" ({b.where}) fails closed; retry later', retry_after=1),
                "unavailable")
        used = reserved.used
        for b in checked:
            over = exceeded_limit(b, group, resource, used, aligned, shifts)
            if over is None:
                continue
            name = names[0] or info.name or (
                generate_name(names[1], self._rng) if names[1] else "")
            message = denial_message(group, resource, name, *over)
            if b.dryrun:
                telemetry.DRYRUN_DENIALS.labels("quota").inc()
                log.info("dryrun: quota %s of policy %s would deny %s: %s", b.quota_name,
                         b.policy, ctx.path, message)
                ctx.warn(f'quota "{b.quota_name}" of policy "{b.policy}" would deny this '
                         f"{'apply' if apply else 'create'} (dryrun): {message}")
                continue
            if reserved.allowed:  # cannot be: the store checked the smallest of these limits
                log.error("quota %s: the store admitted %s at used=%d", b.quota_name, ctx.path,
                          used)
                continue
            telemetry.QUOTA_DENIALS.labels(qualified(group, resource)).inc()
            log.debug("quota %s of policy %s (%s) denies %s: %s", b.quota_name, b.policy,
                      b.where, ctx.path, message)
            details = object_details(group=group, resource=resource, name=name)
            return Deny(forbidden(message, details=details), "quota")
        if reserved.allowed and not _dry_run(ctx):
            telemetry.QUOTA_RESERVATIONS.labels(reserved.backend).inc()
            store = self.store

            def seen() -> None:  # its object is in our watch: let its reservation go soon,
                # marked shown (not counted once the object is deleted: see quota.lua)
                self._spawn(store.settle(scope, member + SHOWN, self.linger_seconds))

            expected = self.counts.expect(group, resource, namespace, names[0], names[1],
                                          token, seen)
            ctx.state[STATE_KEY] = _Held(scope, member, expected, apply)
        return None

    def _shifts(self, group: str, resource: str, namespace: str,
                aligned: Sequence[AlignedQuota]) -> list[Shift]:
        """Per aligned quota, what each key counts besides the namespace's objects and
        reservations (see :func:`exceeded_limit`). ``count/…`` and the legacy names count
        every object; ``pods`` not those Succeeded or Failed, here and in a
        ClusterResourceQuota's other namespaces (asked only of a quota with that key)."""
        if not aligned:
            return []
        keys = _keys(group, resource)
        live = live_key(group, resource)
        finished: int | None = None
        shifts: list[Shift] = []
        for kind, name, hard in aligned:
            crq = kind == CLUSTER_RESOURCE_QUOTA
            elsewhere = self.counts.beyond(group, resource, namespace, name) if crq else 0
            shift = dict.fromkeys(keys, elsewhere)
            if live is not None and live in hard:
                if finished is None:
                    finished = self.counts.finished(group, resource, namespace)
                gone = finished + (self.counts.finished_beyond(group, resource, namespace, name)
                                   if crq else 0)
                shift[live] = elsewhere - gone
            shifts.append(shift)
        return shifts

    def exit(self, ctx: RequestContext) -> Maybe[None]:
        state = ctx.state
        if not state:  # most calls: nothing reserved, and no pop() call to find that out
            return None
        held: _Held | None = state.pop(STATE_KEY, None)
        if held is None:
            return None
        created = _outcome(ctx.status_code, held.apply)
        self.counts.settle(held.expected, created)
        return self.store.settle(held.scope, held.member,
                                 None if created is False else self.settle_seconds)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            task = asyncio.get_running_loop().create_task(work)
        except RuntimeError:  # no loop (a test feeding events by hand): nothing to tell
            work.close()
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _namespace_filter(bound: list[BoundQuota]) -> Callable[[str], bool]:
    entries = tuple(bound)
    return lambda namespace: any(b.applies(namespace) for b in entries)


def _report_usage(group: str, resource: str, namespace: str, count: int) -> None:
    telemetry.set_quota_usage(namespace, qualified(group, resource), count)


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
