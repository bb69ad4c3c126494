"""Fault injection (``spec.faults``): make the apiserver look slow or failing, on purpose.

An operator must survive conflicts, throttling and outages; this middleware lets a team rehearse
them on a real cluster without touching it. A fault matches calls like any rule (verbs, groups,
resources, namespaces, users), fires with a probability, and either answers in the apiserver's
place (a Kubernetes Status with the chosen code: a 409 Conflict, a 429 with ``Retry-After``, a
500 or 503 …; ``retryAfter`` gives any code a ``Retry-After`` and ``details.retryAfterSeconds``,
as the apiserver's Status of a 504 Timeout has them: client-go retries a 429 or a 5xx after
it), or delays the call and then relays it, or both (delay, then answer). In a
``dryrun`` policy a fault never fires: it says, in a ``Warning`` header and the log, what it
would have done, and counts it as a would-be denial when it would have answered (a fault that
only delays denies nothing).

    faults:
      - name: widget-conflicts
        match: {verbs: [update, patch], resources: [widgets]}
        probability: 0.1
        respond: {code: 409, reason: Conflict}
      - name: slow-lists
        match: {verbs: [list]}
        delay: 250ms
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from proxy.engine import telemetry
from proxy.engine.chain import Maybe
from proxy.engine.context import Decision, Delay, Deny, RequestContext
from proxy.engine.match import Match, parse_match
from proxy.engine.schema import Fields, Located, PolicyError, sequence
from proxy.engine.status import StatusError, call_details, too_many_requests

__all__ = ["SECTION", "Fault", "Faults", "parse_section"]

SECTION = "faults"
log = logging.getLogger("opgate.faults")

_REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
            405: "MethodNotAllowed", 408: "Timeout", 409: "Conflict", 410: "Expired",
            413: "RequestEntityTooLarge", 415: "UnsupportedMediaType", 422: "Invalid",
            429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable",
            504: "Timeout"}


def _reason(code: int, ctx: RequestContext) -> str:
    """The apiserver's reason for ``code`` on this call: a create's 409 is ``AlreadyExists``
    (client-go's ``IsAlreadyExists``; it names a POST's bare 409 so too), others by code."""
    if code == 409 and ctx.info.verb == "create":
        return "AlreadyExists"
    return _REASONS.get(code, "")


def _would(ctx: RequestContext, fault: Fault) -> str:
    """What a fault would do to this call, for a dryrun's warning and log line."""
    answer = (f"answer {fault.code} {fault.reason or _reason(fault.code, ctx) or 'Failure'}"
              if fault.code else "")
    if not fault.delay:
        return f"would {answer}"
    delay = f"would delay this call by {round(fault.delay, 3):g}s"
    return f"{delay}, then {answer}" if answer else delay


@dataclass(frozen=True, slots=True)
class Fault:
    name: str
    match: Match
    probability: float = 1.0
    code: int = 0  # 0: no answer, only the delay
    reason: str = ""
    message: str = ""
    retry_after: float | None = None  # None: not given (a 429 then says 1 s)
    delay: float = 0.0
    mode: str | None = None  # None: the policy's


def _parse_fault(node: Located, what: str, index: int,
                 errors: list[PolicyError]) -> Fault | None:
    f = Fields(node, what=what, errors=errors)
    if not f.ok:
        return None
    name = f.str("name", default=f"fault-{index}") or f"fault-{index}"
    match = parse_match(f.node("match"), f"{what}.match", errors)
    probability = f.number("probability", default=1.0, minimum=0.0, maximum=1.0)
    delay = f.duration("delay", default=0.0) or 0.0
    mode = f.str("mode", choices=("enforce", "dryrun"))
    respond = f.node("respond")
    code, reason, message, retry_after = 0, "", "", None
    if respond is not None:
        r = Fields(respond, what=f"{what}.respond", errors=errors)
        code = r.int("code", required=True, minimum=400, maximum=599) or 0
        reason = r.str("reason", default="") or ""  # "": the code's (_reason), when it fires
        message = r.str("message", default="") or ""
        if r.node("retryAfter") is not None:
            retry_after = r.duration("retryAfter")
        r.finish()
    elif not delay:
        f.fail("respond", "a fault needs `respond` (a code to answer with), `delay`, or both")
    f.finish()
    return Fault(name=name, match=match, probability=probability or 0.0, code=code,
                 reason=reason, message=message, retry_after=retry_after, delay=delay, mode=mode)


def parse_section(node: Located, errors: list[PolicyError]) -> tuple[Fault, ...]:
    items = sequence(node, what="spec.faults", errors=errors)
    faults = [_parse_fault(item, f"spec.faults[{i}]", i, errors) for i, item in enumerate(items)]
    seen: dict[str, str] = {}
    for index, (item, fault) in enumerate(zip(items, faults, strict=True)):
        if fault is None:
            continue
        if fault.name in seen:  # at the second one (a set's order made the output vary by run)
            errors.append(item.error(f'spec.faults[{index}]: two faults are named '
                                     f'"{fault.name}" (also at {seen[fault.name]})'))
        else:
            seen[fault.name] = item.where()
    return tuple(x for x in faults if x is not None)


MEMO_SIZE = 4096  # (call shape, user) pairs whose matching faults are remembered per policy set


class Faults:
    """The middleware. ``rng`` returns a float in [0, 1) (seeded in tests).

    Which faults match depends only on the call's shape and user
    (:attr:`~proxy.engine.requestinfo.RequestInfo.shape`), so it is worked out once per pair and
    policy set; a call that no fault matches costs one lookup.
    """

    name = "faults"
    needs_body = False
    sections = (SECTION,)  # entry does nothing under a policy set without one
    fail_open = True  # a broken fault must never break the operator it is rehearsing with

    def __init__(self, *, rng: Callable[[], float] = random.random) -> None:
        self._rng = rng
        self._memo_for: object = None
        self._memo: dict[tuple[Any, str], tuple[tuple[Any, Fault], ...]] = {}

    def _matching(self, ctx: RequestContext, key: tuple[Any, str]) -> tuple[tuple[Any, Fault], ...]:
        """``(policy, fault)`` for every fault that matches a call of ``key`` (its shape and
        user), in order; for the memo (``entry`` looks there first)."""
        info = ctx.info
        verb, user = info.policy_verb, key[1]
        found = tuple((policy, fault) for policy, faults in ctx.policies.section(SECTION)
                      for fault in faults  # type: ignore[attr-defined]
                      if fault.match.matches(info, verb, user))
        if len(self._memo) >= MEMO_SIZE:
            self._memo.clear()
        self._memo[key] = found
        return found

    def entry(self, ctx: RequestContext) -> Maybe[Decision | None]:
        # the chain runs this hook only under a policy set with a faults section (``sections``)
        if ctx.policies is not self._memo_for:
            self._memo = {}
            self._memo_for = ctx.policies  # held: identity stays meaningful
        identity = ctx.identity  # ctx.user without the property call
        key = (ctx.info.shape, identity.user if identity is not None else "")
        matching = self._memo.get(key)  # looked up here: no call per request
        if matching is None:
            matching = self._matching(ctx, key)
        if not matching:
            return None
        for policy, fault in matching:
            if fault.probability < 1.0 and self._rng() >= fault.probability:
                continue
            if "dryrun" in (fault.mode, policy.mode):  # a dryrun policy never denies
                if fault.code:  # a fault that only delays denies nothing
                    telemetry.DRYRUN_DENIALS.labels("faults").inc()
                would = _would(ctx, fault)
                log.info("dryrun: fault %s of policy %s %s (%s %s, trace %s)", fault.name,
                         policy.name, would, ctx.method, ctx.path, ctx.trace_id)
                ctx.warn(f"fault {fault.name} of policy {policy.name} {would} (dryrun)")
                continue
            return self._fire(ctx, fault, policy.name)
        return None

    async def _fire(self, ctx: RequestContext, fault: Fault, policy: str) -> Decision:
        log.info("fault %s of policy %s fired (%s %s, trace %s)", fault.name, policy,
                 ctx.method, ctx.path, ctx.trace_id)
        if not fault.code:
            return Delay(fault.delay)
        message = fault.message or f"opgate: injected fault {fault.name} (policy {policy})"
        if fault.code == 429:  # the reason it was given, as for any other code
            status = too_many_requests(message, retry_after=fault.retry_after or 1.0)
            if fault.reason:
                status = replace(status, reason=fault.reason)
        else:  # a 403 with the details of the apiserver's own (client-go reads them alike)
            details = call_details(ctx.info) if fault.code == 403 else None
            headers: tuple[tuple[str, str], ...] = ()
            if fault.retry_after is not None:  # as the apiserver's 504 Timeout has it
                seconds = max(1, math.ceil(fault.retry_after))
                details = {**(details or {}), "retryAfterSeconds": seconds}
                headers = (("Retry-After", str(seconds)),)
            status = StatusError(fault.code, message, fault.reason or _reason(fault.code, ctx),
                                 details, headers)
        if fault.delay:
            await asyncio.sleep(fault.delay)
        return Deny(status, "fault")
