"""The quota middleware: ``spec.quotas`` object-count limits, in the apiserver's own words.

A ``create`` of a quota'd resource (no subresource) in a namespace an entry matches is checked
(and so is a server-side apply that creates: a ``PATCH`` with an ``application/apply-patch+…``
body to a named object that the counts do not show in the namespace; an apply to an object that
exists is an update; and a ``PUT`` that creates: services, endpoints, limitranges, events and
leases are created by a PUT to a name that does not exist, :data:`UPSERTS`, and the apiserver's
ResourceQuota admission charges that as a create) against the entry's effective limit: the
smallest of its ``max`` and, with ``alignWith``, the ``count/<resource>[.<group>]`` (or legacy
``configmaps``, ``secrets``…) hard limits of every ResourceQuota in that namespace and of every
ClusterResourceQuota (``quota.openshift.io/v1``, when the cluster serves it) that selects the
namespace (less the objects in the other namespaces it selects: OpenShift counts them
together); events aside, which the apiserver's quota ignores (:data:`QUOTA_IGNORED`: only the
entry's ``max`` limits them). Over it,
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
(``used: count/pods=3,pods=2``). The object's name is the body's ``metadata.name``, JSON,
protobuf or YAML (:mod:`proxy.middlewares.quota_yaml`; the body is read only for such creates:
:meth:`Quota.wants_body`); with ``generateName`` the name is generated as the apiserver does
(the prefix and five random characters); a body in another encoding (CBOR) leaves it out
(``configmaps is forbidden: …``). At the limit, a JSON or protobuf body the apiserver could
not decode gets its 400 BadRequest, and one naming no object goes on to its 422
(:func:`_not_an_object`): both come before the apiserver's own quota admission.

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
the create failed (an apply answered 200 updated an object after all; a 409 AlreadyExists for
a name the watch does not show yet did not: a create of that name, let through on this
reservation, won the race) and otherwise lets it expire within ``settle_seconds``; when this
replica's watch shows the object it is cut to ``linger_seconds`` (the other replicas' watches
catch up meanwhile); and it expires by itself
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
import logging
import random
import secrets
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.engine import telemetry
from proxy.engine.chain import Maybe
from proxy.engine.context import Decision, Deny, RequestContext
from proxy.engine.jsonbody import loads
from proxy.engine.protometa import MAGIC, PROTOBUF, object_names, undecodable
from proxy.engine.selectors import dry_run
from proxy.engine.status import bad_request, forbidden, object_details, service_unavailable
from proxy.middlewares.quota_counts import MemoryQuotaCounts, QuotaCounts
from proxy.middlewares.quota_limits import (
    AlignedQuota,
    Shift,
    denial_message,
    effective_limit,
    exceeded_limit,
    generate_name,
    quota_keys,
)
from proxy.middlewares.quota_spec import (
    CLUSTER_RESOURCE_QUOTA,
    QUOTA_IGNORED,
    RESOURCE_QUOTA,
    SECTION,
    BoundQuota,
    bind_quotas,
    live_key,
    parse_section,
    qualified,
)
from proxy.middlewares.quota_yaml import YAML, read_names
from proxy.stores.base import SHOWN, Reservation, Store
from proxy.stores.memory import MemoryStore

__all__ = ["SECTION", "Quota", "parse_section"]

log = logging.getLogger("opgate.quota")

STATE_KEY = "quota"
RESERVE_SECONDS = 60.0  # a reservation expires by itself this long after its create came in,
SETTLE_SECONDS = 30.0  # this long after the create answered 2xx (or no answer),
LINGER_SECONDS = 5.0  # and this long after this replica's watch showed the object


def _body_name(ctx: RequestContext) -> tuple[str, str]:
    """``(name, generateName)`` from a JSON or protobuf create body (``("", "")`` when there is
    none)."""
    body = ctx.body
    return object_names(body) if body else ("", "")


_NAMED_TYPES = frozenset({"application/json", "application/vnd.kubernetes.protobuf"})


def _names_in_body(ctx: RequestContext) -> bool:
    """Whether the create's body is one whose name :func:`_body_name` reads: JSON, or the
    protobuf that client-go's typed clients send by default."""
    return ctx.media_type in _NAMED_TYPES


def _not_an_object(ctx: RequestContext, names: tuple[str, str]) -> Deny | bool | None:
    """What the apiserver does with a JSON or protobuf create body before any admission runs,
    where that is not its quota's 403: a body it cannot decode as an object is its ``400
    BadRequest`` (:func:`undecodable`; ``apiVersion`` another group or version than the URL's
    too), and one that names no object (neither ``name`` nor ``generateName``) its validation's
    ``422 Invalid``, left to it (``False``: let the call on; it can never make an object).
    ``None``: the quota decides."""
    body = ctx.body
    problem = undecodable(body, protobuf=ctx.media_type == PROTOBUF)
    if problem is None and body and not body.startswith(MAGIC):
        version = loads(body).get("apiVersion")
        info = ctx.info
        expected = f"{info.api_group}/{info.api_version}" if info.api_group else info.api_version
        if version and version != expected:
            problem = (f"the API version in the data ({version}) does not match the expected "
                       f"API version ({expected})")
            return Deny(bad_request(problem))
    if problem is not None:
        return Deny(bad_request(
            f"the object provided is unrecognized (must be a {ctx.info.resource} object): "
            f"{problem} ({_summary(body or b'')})"))
    return False if names == ("", "") else None


def _summary(data: bytes, length: int = 30) -> str:
    """The bytes a decode error shows, as the apiserver shows them: ``<empty>``, the text of
    an object (``{…``), else hex; the first ``length`` bytes, then `` ...``."""
    if not data:
        return "<empty>"
    head = data[:length]
    shown = head.decode("utf-8", "replace") if data[:1] == b"{" else head.hex()
    return shown + (" ..." if len(data) > length else "")


_APPLY_TYPES = frozenset({"application/apply-patch+yaml", "application/apply-patch+json",
                          "application/apply-patch+cbor"})


def _is_apply(ctx: RequestContext) -> bool:
    """A server-side apply: a PATCH whose body is an apply configuration."""
    return ctx.media_type in _APPLY_TYPES


# the quota'd resources whose registry strategy allows create on update (the apiserver answers a
# PUT to a name that does not exist 201 Created, and its quota admission sees a create); for any
# other resource (configmaps, pods, custom resources…) such a PUT is a 404
UPSERTS = frozenset({("", "services"), ("", "endpoints"), ("", "limitranges"), ("", "events"),
                     ("events.k8s.io", "events"), ("coordination.k8s.io", "leases")})


def _may_create(ctx: RequestContext) -> bool:
    """A create, or a call to a named object that creates it when the counts do not show it:
    a server-side apply, or a PUT of a resource the apiserver creates on update."""
    info = ctx.info
    if info.verb == "create":
        return True
    if not info.name:
        return False
    if info.verb == "patch":
        return _is_apply(ctx)
    return info.verb == "update" and (info.api_group, info.resource) in UPSERTS


def _dry_run(ctx: RequestContext) -> bool:
    return dry_run(ctx.query) if ctx.query else False


def _outcome(ctx: RequestContext, upsert: bool = False) -> bool | None:
    """Whether a create answered ``ctx.status_code`` made the object (``None``: cannot tell).
    An apply or a PUT (``upsert``) answered 200 updated an object that existed after all: not a
    create. When the
    relay answered a 503/504 itself, its ``Retry-After`` says the call never left opgate
    (nothing made); without one the apiserver may have had it (the connection closed after
    the request): as unknown as no answer."""
    code = ctx.status_code
    if upsert and code == 200:
        return False
    if 200 <= code < 300:
        return True
    answer = ctx.answer
    if answer is not None and code in (503, 504):
        return False if any(k == "Retry-After" for k, _ in answer.headers) else None
    if code == 0 or code == 504:  # no answer, or the apiserver gave up waiting
        return None
    return False



_CREATING = frozenset({"create", "patch", "update"})  # the verbs _matched can match: see
# _may_create


_CALLED = {"create": "create", "patch": "apply", "update": "update"}  # in dryrun warnings


@dataclass(slots=True)
class _Held:
    """What the exit hook settles: the store's member and what the counter waits for."""

    scope: str
    member: str
    expected: object
    upsert: bool  # an apply or a PUT: a 200 means it updated an object that existed
    name: str  # "" for a generateName create (or a name the body did not say)
    where: tuple[str, str, str]  # (group, resource, namespace)


class Quota:
    name = "quota"
    needs_body = True  # narrowed per call by wants_body: JSON creates a quota entry matches
    fail_open = False
    sections = (SECTION,)
    verbs = _CREATING  # entry counts only creates (applies, PUTs); exit settles what it held

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
        if not _may_create(ctx):
            return None
        bound = self._plan_of(ctx.policies).get((info.api_group, info.resource))
        if not bound:
            return None
        return [b for b in bound if b.applies(info.namespace)] or None

    def wants_body(self, ctx: RequestContext) -> bool:
        """The body of a JSON, protobuf or YAML create that an entry matches (for the object's
        name)."""
        return ctx.method == "POST" and (_names_in_body(ctx) or ctx.media_type == YAML) \
            and self._matched(ctx) is not None

    # --- hooks ------------------------------------------------------------------------------

    def entry(self, ctx: RequestContext) -> Maybe[Decision | None]:
        if ctx.info.verb not in _CREATING:  # reads, updates, deletes: nothing to count
            return None
        matched = self._matched(ctx)
        if matched is None:
            return None
        return self._create(ctx, matched)

    async def _create(self, ctx: RequestContext, matched: list[BoundQuota]) -> Decision | None:
        """``entry`` for a create (or an apply, a PUT) that quotas count."""
        info = ctx.info
        group, resource, namespace = info.api_group, info.resource, info.namespace
        upsert = info.verb != "create"
        if upsert and self.counts.exists(group, resource, namespace, info.name):
            return None  # an apply or PUT to an object that exists is an update, not a create
        observed = self.counts.observed(group, resource, namespace)
        ignored = (group, resource) in QUOTA_IGNORED  # the apiserver's quota never counts them
        rq = not ignored and any(RESOURCE_QUOTA in b.rule.align_with for b in matched)
        crq = not ignored and any(CLUSTER_RESOURCE_QUOTA in b.rule.align_with for b in matched)
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
        names = (info.name, "") if upsert else await _create_names(ctx)
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
        if not reserved.allowed and not upsert and _names_in_body(ctx):
            refused = _not_an_object(ctx, names)
            if refused is not None:  # what the apiserver answers before its quota admission
                return refused or None
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
                         f"{_CALLED[info.verb]} (dryrun): {message}")
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
            ctx.state[STATE_KEY] = _Held(scope, member, expected, upsert, names[0],
                                         (group, resource, namespace))
        return None

    def _shifts(self, group: str, resource: str, namespace: str,
                aligned: Sequence[AlignedQuota]) -> list[Shift]:
        """Per aligned quota, what each key counts besides the namespace's objects and
        reservations (see :func:`exceeded_limit`). ``count/…`` and the legacy names count
        every object; ``pods`` not those Succeeded or Failed, here and in a
        ClusterResourceQuota's other namespaces (asked only of a quota with that key)."""
        if not aligned:
            return []
        keys = quota_keys(group, resource)
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
        created = _outcome(ctx, held.upsert)
        if created is False and ctx.status_code == 409 and held.name and not held.upsert \
                and self.counts.exists(*held.where, held.name) is False:
            created = None  # AlreadyExists, and the watch does not show it yet: made just now
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


async def _create_names(ctx: RequestContext) -> tuple[str, str]:
    """``(name, generateName)`` of a create's body: JSON or protobuf (:func:`_body_name`), or
    YAML (:mod:`proxy.middlewares.quota_yaml`, a large body read off the event loop)."""
    if ctx.media_type == YAML:
        return await read_names(ctx.body) if ctx.body else ("", "")
    return _body_name(ctx)


def _report_usage(group: str, resource: str, namespace: str, count: int) -> None:
    telemetry.set_quota_usage(namespace, qualified(group, resource), count)
