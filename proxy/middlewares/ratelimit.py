"""The rate-limit middleware: ``spec.rateLimits`` rules decided by a shared GCRA store.

Every rule that matches a call names a bucket (its key template rendered for the call) and the
call must pass all of them, decided in one atomic store call; a call that matches no rule costs
a dict lookup and no store call. Rules are bound to their policy once per :class:`PolicySet`
(mode, failure, metric children), so the hot path only matches and decides.

Watches are counted once, when they start; other long-running calls (exec, attach, port-forward,
log, proxy) only when a rule spells them out (``pods/exec``, ``*/log``). Over the limit,
``onExceed: reject`` answers 429 (integer ``Retry-After``, ``details.retryAfterSeconds``,
``RateLimit-*`` headers) and ``wait`` queues the call (FIFO per bucket, at most ``maxQueue``)
until a token is free or ``maxWait`` has passed; at shutdown (:meth:`RateLimit.stop_waiting`)
queued calls get their 429 at once; one whose client leaves is recorded ``throttled``. A
``dryrun`` rule never rejects: it logs and adds a ``Warning`` saying what enforce would do
(reject, counted; or, for a ``wait`` rule whose next token is within ``maxWait``, delay).
When the store cannot answer, ``failure: open`` rules are decided in-process (see
:mod:`proxy.stores.breaker`) and ``failure: closed`` rules answer 503. Admitted calls get
``RateLimit-*`` headers too: the verdict is already at hand, so they cost three tuples.

``{instance}`` is resolved only for calls that a rule needing it matches
(:mod:`proxy.middlewares.instance`); to find it in a create/update/apply body this middleware
declares ``needs_body`` and narrows it per call with ``wants_body`` (POST/PUT JSON or protobuf
bodies and server-side apply PATCHes without the ``Opgate-Instance`` header that such a rule
matches), so the relay streams every
other body.
An instance's own qps comes from its ``InstanceOverrides`` (the informer pool when serving); a
failure there never fails a call: the rule's plain qps applies.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proxy.engine import telemetry
from proxy.engine.chain import Maybe
from proxy.engine.context import Decision, Deny, RequestContext
from proxy.engine.status import service_unavailable, too_many_requests
from proxy.middlewares.instance import (
    INSTANCE_HEADER,
    InstanceOverrides,
    InstanceResolver,
    MemoryInstanceOverrides,
    header_instance,
    is_readable_write,
)
from proxy.middlewares.ratelimit_spec import SECTION, BoundRule, Plan, bind_rules, parse_section
from proxy.stores.base import BucketRequest, Held, KeyVerdict, Store, StoreUnavailable, Verdict

__all__ = ["SECTION", "InstanceOverrides", "MemoryInstanceOverrides", "RateLimit",
           "header_instance", "parse_section"]

log = logging.getLogger("opgate.ratelimit")


MEMO_SIZE = 4096  # (call shape, user) pairs whose matching rules are remembered per policy set
_SHAPE_ONLY = frozenset({"user", "verb", "group", "resource", "namespace"})


def _or_dash(value: str) -> str:
    return value or "-"


@dataclass(frozen=True, slots=True)
class _Matched:
    """The rules that apply to calls of one (shape, user), split by mode. ``requests``: the
    enforced rules' buckets, when their keys depend on nothing else (else built per call).
    ``one``: the bucket when that is all there is to decide (one enforced rule, those keys,
    no dryrun rule), the call that a leased token can admit right in ``entry``."""

    rules: list[BoundRule]
    enforce: list[BoundRule]
    dryrun: list[BoundRule]
    requests: list[BucketRequest] | None
    one: BucketRequest | None


class RateLimit:
    name = "ratelimit"
    fail_open = False
    sections = (SECTION,)  # entry does nothing under a policy set without one

    def __init__(
        self, *, store: Store, overrides: InstanceOverrides | None = None,
        instance_resolver: Callable[[RequestContext], str | None] | None = None,
        resolve_instance_from_body: bool = True,
    ) -> None:
        self.store = store
        # a token the store's replica already holds (leasing): taken without a coroutine
        self._take: Callable[[BucketRequest], Held | None] | None = getattr(
            store, "take_local", None)
        self.overrides: InstanceOverrides = overrides or MemoryInstanceOverrides()
        self.instance_resolver = instance_resolver or InstanceResolver(self.overrides)
        self.needs_body = resolve_instance_from_body  # narrowed per call by wants_body
        self._plan_for: object = None
        self._plan = Plan(())
        self._memo: dict[tuple[Any, str], _Matched | None] = {}
        self._queues: dict[str, deque[asyncio.Future[None]]] = {}
        self._stopping = False
        self._stop: asyncio.Future[None] | None = None  # done once stop_waiting is called

    def stop_waiting(self) -> None:
        """Answer every queued call (and any that would queue from now on) with its 429 now:
        opgate shuts down, and a wait past ``--shutdown-grace`` would end with the call cut,
        unanswered. A 429 with ``Retry-After`` is what the apiserver answers while it drains."""
        self._stopping = True
        if self._stop is not None and not self._stop.done():
            self._stop.set_result(None)

    def _stop_on(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """The future :meth:`stop_waiting` completes, on the running loop (tests run several)."""
        stop = self._stop
        if stop is None or stop.get_loop() is not loop:
            stop = self._stop = loop.create_future()
            if self._stopping:
                stop.set_result(None)
        return stop

    def _plan_of(self, policies: Any) -> Plan:
        if policies is not self._plan_for:
            self._plan = bind_rules(policies.section(SECTION))
            self._memo = {}
            self._plan_for = policies  # held: identity stays meaningful
        return self._plan

    def _matched(self, ctx: RequestContext, key: tuple[Any, str]) -> _Matched | None:
        """The rules a call of ``key`` (its shape and user) must pass, ``None`` for none; for
        the memo (``entry`` looks there first)."""
        user = key[1]
        found = self._plan.matched(ctx.info, user)
        result = None
        if found:
            enforce = [b for b in found if not b.dryrun]
            requests = None
            if all(b.rule.key.fields <= _SHAPE_ONLY for b in enforce):
                values = self._values(ctx)
                requests = [self._bucket(b, values) for b in enforce]
            dryrun = [b for b in found if b.dryrun]
            one = requests[0] if requests is not None and len(requests) == 1 and not dryrun \
                else None
            result = _Matched(found, enforce, dryrun, requests, one)
        if len(self._memo) >= MEMO_SIZE:
            self._memo.clear()
        self._memo[key] = result
        return result

    @staticmethod
    def _values(ctx: RequestContext) -> dict[str, str]:
        info = ctx.info
        return {"user": _or_dash(ctx.user), "verb": info.policy_verb,
                "group": _or_dash(info.api_group), "resource": _or_dash(info.resource),
                "namespace": _or_dash(info.namespace), "name": _or_dash(info.name),
                "instance": "-"}

    def wants_body(self, ctx: RequestContext) -> bool:
        """Whether the relay should read this call's body: a JSON or protobuf create/update, or
        a server-side apply, without the ``Opgate-Instance`` header that a rule with
        ``{instance}`` in its key may match (the relay asks before the entry hooks, so before
        identity is known: any user)."""
        if not self.needs_body or not is_readable_write(ctx) or ctx.headers.get(INSTANCE_HEADER):
            return False
        plan = self._plan_of(ctx.policies)
        return plan.needs_instance and any(
            b.needs_instance for b in plan.matched(ctx.info, None))

    def _instance(self, ctx: RequestContext) -> str | None:
        try:
            return self.instance_resolver(ctx)
        except Exception:  # never fail a call over its instance: it is "-"
            log.exception("resolving {instance} failed (%s %s)", ctx.method, ctx.path)
            return None

    def entry(self, ctx: RequestContext) -> Maybe[Decision | None]:
        plan = self._plan
        if ctx.policies is not self._plan_for:  # _plan_of's test first: no call per request
            plan = self._plan_of(ctx.policies)
        if not plan.rules:
            return None
        identity = ctx.identity  # ctx.user without the property call
        key = (ctx.info.shape, identity.user if identity else "")
        try:  # the memo, looked up here: no call per request
            found = self._memo[key]
        except KeyError:
            found = self._matched(ctx, key)
        if found is None:
            return None
        one = found.one
        if one is not None and self._take is not None and not self._queues:
            # the hot path, decided here: a token this replica holds (leasing) admits the call
            # synchronously, without the _enforce coroutine and without a Verdict
            held = self._take(one)
            if held is not None:
                self._admit_held(ctx, found.enforce[0], held)
                return None
        enforce = found.enforce
        if found.requests is not None and not found.dryrun:  # the common case
            return self._enforce(ctx, enforce, found.requests)
        return self._enforce_matched(ctx, plan, found)

    async def _enforce_matched(self, ctx: RequestContext, plan: Plan, found: _Matched
                               ) -> Decision | None:
        """``entry`` for calls whose buckets depend on more than their shape, or with dryrun
        rules."""
        enforce = found.enforce
        matched = found.rules
        values = self._values(ctx)
        if plan.needs_instance and any(b.needs_instance for b in matched):
            instance = self._instance(ctx)
            if instance:
                values["instance"] = instance
                ctx.drop_request_headers.add(INSTANCE_HEADER.lower())
        if found.dryrun:
            await self._dryrun(ctx, found.dryrun, values)
        if not enforce:
            return None
        requests = found.requests
        if requests is None:
            requests = [self._bucket(b, values) for b in enforce]
        return await self._enforce(ctx, enforce, requests)

    def _bucket(self, b: BoundRule, values: dict[str, str]) -> BucketRequest:
        rule, rate = b.rule, b.rule.qps
        if rule.instance_annotation and values["instance"] != "-":
            namespace, _, rest = values["instance"].partition("/")
            kind, _, name = rest.partition("/")
            try:
                own = self.overrides.get(namespace, kind, name, rule.instance_annotation)
            except Exception:  # an informer failure never fails a call: the plain qps
                log.exception("instance overrides failed for %s", values["instance"])
                own = None
            if own is not None and own > 0:
                rate = min(own, rule.max_qps)
        return BucketRequest(
            key=b.prefix + rule.key.render(values), rate=rate, burst=rule.burst,
            shard=values["user"] if b.per_user else "", lease=rule.lease, fail_open=b.fail_open)

    async def _acquire(self, rules: list[BoundRule], requests: list[BucketRequest]) -> Verdict:
        try:
            return await self.store.acquire(requests)
        except StoreUnavailable:
            return _unreachable(rules)

    async def _enforce(
        self, ctx: RequestContext, rules: list[BoundRule], requests: list[BucketRequest]
    ) -> Decision | None:
        if self._queues:  # FIFO: a call for a bucket with waiters queues behind them
            for b, r in zip(rules, requests, strict=True):
                if r.key in self._queues and b.rule.on_exceed == "wait":
                    return await self._wait(ctx, rules, requests, None, [rules.index(b)])
        if self._take is not None and len(requests) == 1:
            held = self._take(requests[0])
            if held is not None:
                self._admit_held(ctx, rules[0], held)
                return None
        try:  # _acquire, inlined: one coroutine less on every call
            verdict = await self.store.acquire(requests)
        except StoreUnavailable:
            verdict = _unreachable(rules)
        if verdict.allowed:
            self._admit(ctx, rules, verdict, "allowed")
            return None
        if verdict.unavailable:
            return self._unavailable(ctx, rules, verdict)
        if _waits(rules, verdict):
            denied = [i for i, k in enumerate(verdict.keys) if not k.allowed]
            return await self._wait(ctx, rules, requests, verdict, denied)
        return self._reject(ctx, rules, requests, verdict)

    @staticmethod
    def _admit_held(ctx: RequestContext, b: BoundRule, held: Held) -> None:
        """:meth:`_admit` for one leased token: ``allowed``, and :func:`_headers` for
        ``held`` (whose ``reset`` is never below 0) with the rule's precomputed limit."""
        b.allowed.inc()
        remaining, reset = held
        seconds = math.ceil(reset)
        ctx.response_headers += (
            b.limit_header, ("RateLimit-Remaining", str(remaining if remaining > 0 else 0)),
            _RESET[seconds] if seconds < len(_RESET) else ("RateLimit-Reset", str(seconds)))

    def _admit(
        self, ctx: RequestContext, rules: list[BoundRule], verdict: Verdict, result: str
    ) -> None:
        if verdict.backend == "fallback" and result == "allowed":
            result = "fallback"
        if len(rules) == 1:  # the common case, without the bookkeeping below
            rules[0].counters[result].inc()
            index = 0
        else:
            for counters in {b.policy: b.counters for b in rules}.values():
                counters[result].inc()
            index = min(range(len(rules)), key=lambda i: verdict.keys[i].remaining)
        k = verdict.keys[index]
        ctx.response_headers.extend(_headers(rules[index].rule.burst, k.remaining, k.reset))

    def _reject(self, ctx: RequestContext, rules: list[BoundRule],
                requests: list[BucketRequest], verdict: Verdict) -> Deny:
        """429 for the bucket that frees last, naming the rate it has: an instance's own
        (``instanceAnnotation``) where it got one, which is what the caller ran into."""
        index = max(range(len(rules)), key=lambda i: (not verdict.keys[i].allowed,
                                                     verdict.keys[i].retry_after))
        b, k = rules[index], verdict.keys[index]
        for denied in {r.policy: r.counters for r, v in zip(rules, verdict.keys, strict=True)
                       if not v.allowed}.values():
            denied["denied"].inc()
        retry = max(1, math.ceil(verdict.retry_after))
        log.debug("rate limit %s/%s rejects %s %s (retry after %ds)", b.policy, b.rule.name,
                  ctx.method, ctx.path, retry)
        status = too_many_requests(
            f'opgate: rate limit "{b.rule.name}" of policy "{b.policy}" ({b.where}) exceeded: '
            f"{_num(requests[index].rate)} requests/s, burst {b.rule.burst}; retry after {retry}s",
            retry_after=retry, extra_headers=_headers(b.rule.burst, k.remaining, retry))
        return Deny(status, "throttled")

    def _unavailable(self, ctx: RequestContext, rules: list[BoundRule], verdict: Verdict) -> Deny:
        closed = [b for b in rules if not b.fail_open]
        for counters in {b.policy: b.counters for b in closed}.values():
            counters["unavailable"].inc()
        b = closed[0]
        return Deny(service_unavailable(
            f'opgate: the rate-limit store is unavailable and rate limit "{b.rule.name}" of '
            f'policy "{b.policy}" ({b.where}) fails closed; retry later', retry_after=1),
            "unavailable")

    async def _wait(
        self, ctx: RequestContext, rules: list[BoundRule], requests: list[BucketRequest],
        verdict: Verdict | None, waiting_on: list[int],
    ) -> Decision | None:
        """Queue behind earlier waiters for the same bucket, then retry until ``maxWait``, as
        long as only ``wait`` rules deny (a ``reject`` rule that denies meanwhile: its 429)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(rules[i].rule.max_wait for i in waiting_on)
        qkey = requests[waiting_on[0]].key
        queue = self._queues.setdefault(qkey, deque())
        if self._stopping or len(queue) >= min(rules[i].rule.max_queue for i in waiting_on):
            if not queue:
                del self._queues[qkey]
            return self._reject(ctx, rules, requests,
                                verdict or _queued(requests, waiting_on, len(queue)))
        stop = self._stop_on(loop)
        # what the logs and metrics record if the client leaves meanwhile (cancelled here)
        decided, ctx.decision = ctx.decision, "throttled"
        turn: asyncio.Future[None] = loop.create_future()
        queue.append(turn)
        if len(queue) == 1:
            turn.set_result(None)
        try:
            if not turn.done():
                # (asyncio.wait never cancels these futures: a timeout, or this call cancelled)
                await asyncio.wait((turn, stop), timeout=max(0.0, deadline - loop.time()),
                                   return_when=asyncio.FIRST_COMPLETED)
                if not turn.done() or stop.done():  # maxWait has passed, or opgate stops
                    return self._reject(ctx, rules, requests,
                                        _queued(requests, waiting_on, queue.index(turn)))
                verdict = None  # our turn: the earlier answer is stale
            if verdict is None:
                verdict = await self._acquire(rules, requests)
            while not verdict.allowed:
                if verdict.unavailable:
                    return self._unavailable(ctx, rules, verdict)
                if (loop.time() + verdict.retry_after > deadline or stop.done()
                        or not _waits(rules, verdict)):
                    return self._reject(ctx, rules, requests, verdict)
                await asyncio.wait((stop,), timeout=verdict.retry_after)
                if stop.done():  # (the next token is at most one interval away)
                    return self._reject(ctx, rules, requests, _queued(requests, waiting_on, 0))
                verdict = await self._acquire(rules, requests)
            self._admit(ctx, rules, verdict, "waited")
            ctx.decision = decided
            return None
        finally:
            head = queue[0] is turn
            queue.remove(turn)
            if not queue:
                if self._queues.get(qkey) is queue:
                    del self._queues[qkey]
            elif head and not queue[0].done():
                queue[0].set_result(None)

    async def _dryrun(
        self, ctx: RequestContext, rules: list[BoundRule], values: dict[str, str]
    ) -> None:
        requests = [self._bucket(b, values) for b in rules]
        verdict = await self._acquire(rules, requests)
        if verdict.allowed:
            self._admit(ctx, rules, verdict, "allowed")
            return
        if verdict.unavailable:
            b = next(b for b in rules if not b.fail_open)
            b.counters["unavailable"].inc()
            ctx.warn(f'rate-limit store unavailable: rate limit "{b.rule.name}" of policy '
                     f'"{b.policy}" would answer 503 (dryrun)')
            return
        retry = max(1, math.ceil(verdict.retry_after))
        waits = _waits(rules, verdict)
        bound = min((b.rule.max_wait for b, k in zip(rules, verdict.keys, strict=True)
                     if not k.allowed), default=0.0)
        if waits and verdict.retry_after <= bound:
            self._dryrun_delay(ctx, rules, requests, verdict, bound)
            return
        for b, r, k in zip(rules, requests, verdict.keys, strict=True):
            if k.allowed:
                continue
            telemetry.DRYRUN_DENIALS.labels("ratelimit").inc()
            b.counters["dryrun"].inc()
            log.info("dryrun: rate limit %s/%s would reject %s %s (retry after %ds)",
                     b.policy, b.rule.name, ctx.method, ctx.path, retry)
            ctx.warn(f'rate limit "{b.rule.name}" of policy "{b.policy}" would reject this call '
                     f"(dryrun): {_num(r.rate)} requests/s, burst {b.rule.burst}, "
                     f"retry after {retry}s" + (
                         f" (onExceed: wait, but the next token is {_secs(verdict.retry_after)}"
                         f" away, past maxWait {_secs(bound)})" if waits else ""))

    @staticmethod
    def _dryrun_delay(ctx: RequestContext, rules: list[BoundRule],
                      requests: list[BucketRequest], verdict: Verdict, bound: float) -> None:
        """What enforce does with a call that only ``wait`` rules deny and whose next token is
        within their ``maxWait``: hold it, then let it on; so a trial says it would delay it
        (when the token comes; waiters queued before it, which a trial never holds, would
        make it later), and counts no denial."""
        for b, r, k in zip(rules, requests, verdict.keys, strict=True):
            if k.allowed:
                continue
            log.info("dryrun: rate limit %s/%s would delay %s %s by %s", b.policy,
                     b.rule.name, ctx.method, ctx.path, _secs(k.retry_after))
            ctx.warn(f'rate limit "{b.rule.name}" of policy "{b.policy}" would delay this call '
                     f"(dryrun): {_num(r.rate)} requests/s, burst {b.rule.burst}; onExceed: "
                     f"wait, the next token in {_secs(k.retry_after)} (maxWait {_secs(bound)})")


def _waits(rules: list[BoundRule], verdict: Verdict) -> bool:
    """Whether every rule that denies ``verdict`` says ``onExceed: wait`` (else: 429 now)."""
    return all(b.rule.on_exceed == "wait"
               for b, k in zip(rules, verdict.keys, strict=True) if not k.allowed)


def _unreachable(rules: list[BoundRule]) -> Verdict:
    """The verdict when a bare backend (no breaker) cannot answer: each rule's ``failure``."""
    keys = tuple(KeyVerdict(allowed=b.fail_open, remaining=0) for b in rules)
    ok = all(b.fail_open for b in rules)
    return Verdict(allowed=ok, keys=keys, backend="fallback", unavailable=not ok)


def _queued(requests: list[BucketRequest], waiting_on: list[int], ahead: int) -> Verdict:
    """A denial for a call that got no token from its queue, ``ahead`` calls before it
    (estimated Retry-After: a token for each and one for it)."""
    keys = tuple(
        KeyVerdict(allowed=False, remaining=0, retry_after=(ahead + 1) / r.rate)
        if i in waiting_on else KeyVerdict(allowed=True, remaining=r.burst)
        for i, r in enumerate(requests))
    return Verdict(allowed=False, keys=keys)


def _num(value: float) -> str:
    return f"{value:g}"


def _secs(value: float) -> str:
    """A duration as a person reads it: ``0.5s``, ``10s`` (to the millisecond)."""
    return f"{round(value, 3):g}s"


# the RateLimit-Reset header for the usual few seconds, built once (a str() and a tuple less
# on every call that a leased token admits)
_RESET = tuple(("RateLimit-Reset", str(seconds)) for seconds in range(64))


def _headers(limit: int, remaining: int, reset: float) -> tuple[tuple[str, str], ...]:
    return (("RateLimit-Limit", str(limit)), ("RateLimit-Remaining", str(max(0, remaining))),
            ("RateLimit-Reset", str(max(0, math.ceil(reset)))))
