"""The audit log: one ``audit.k8s.io/v1`` ``Event`` per line, as kube-apiserver writes it.

What a call records is decided by ``spec.audit`` (:mod:`proxy.middlewares.audit_spec`, the
apiserver's audit Policy); without any such section every call is recorded at ``Metadata``.
The events are the apiserver's own format (``kind: Event``, ``apiVersion: audit.k8s.io/v1``), so
the tools that read its ``--audit-log-path`` files read opgate's too:

* ``auditID`` is the client's ``Audit-ID`` header when it sent one (as the apiserver, which
  then logs the same ID: opgate forwards the header), else opgate's trace id; ``verb`` the
  apiserver's audit verb (``get``, ``list``, ``watch``, ``create``, ``update``, ``patch``,
  ``delete``, ``deletecollection``; the lower-case HTTP method for non-resource URLs);
  ``requestURI`` path and query as sent (a query parameter whose name contains ``token`` is
  redacted).
* ``user`` is the identity opgate verified (``spec.identity``), with the ``extra`` the
  apiserver's authenticator gives the same token (a service-account token's credential id and
  the pod or node it is bound to, an OIDC token's credential id, a TokenReview's ``extra``):
  ``{}`` when none was verified, with the annotation ``opgate.dev/user: unverified``.
  ``impersonatedUser`` when the call forwards ``Impersonate-User``: the user the apiserver
  switches to (groups, uid, extra from the ``Impersonate-*`` headers, as
  :func:`proxy.engine.impersonation.impersonated_user`). ``sourceIPs`` as the apiserver lists
  them: ``X-Forwarded-For``, ``X-Real-Ip``, then the caller's address (on a loopback sidecar
  the controller's 127.0.0.1; none on a Unix socket).
* ``responseStatus`` has the code; for an answer opgate gave itself (a denial, throttling, a
  fault, a quota, the relay's own 4xx/5xx) also ``status``, ``message``, ``reason``, ``details``
  of the Status it sent. The apiserver's own error bodies are not read (only their code).
* ``annotations``: ``opgate.dev/decision`` (allowed, denied, throttled, quota, fault, unavailable,
  unauthorized, error), ``opgate.dev/reason`` (the message of opgate's own answer: it names the
  rule and the policy file), ``opgate.dev/audit-rule`` (``file:line`` of the audit rule that set
  the level), ``opgate.dev/error`` when the relay recorded one.
* Levels: ``Metadata``; ``Request`` adds ``requestObject``, the JSON request body of resource
  requests (read only for calls a rule may log at Request; bounded by the relay's 3 MiB, the
  apiserver's own limit; a body that is not JSON, e.g. protobuf, is left out with the annotation
  ``opgate.dev/request-object``; a TokenReview's ``spec.token`` is redacted);
  ``RequestResponse`` is accepted and logs what ``Request`` does: **responseObject is not
  recorded** (the relay streams response bodies and does not hand them to middlewares).
* Stages: ``ResponseComplete`` when a call ends. Long-running calls (watch, exec, attach,
  port-forward, logs, proxy) also get ``ResponseStarted`` once their response head went out
  (seen on the context, at most ``POLL_SECONDS`` late; one opgate answered itself before the
  entry hook ran, both at its end, as the apiserver logs its own denial of one, but a 401:
  one ResponseComplete). ``RequestReceived`` is never emitted (as
  if every policy had ``omitStages: [RequestReceived]``), nor ``Panic``.

Nothing here blocks a call: an event is built in the exit hook (its fields:
:mod:`proxy.middlewares.audit_event`) and its line handed on, for a file to a writer thread
(:mod:`proxy.middlewares.audit_stream`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proxy.engine import telemetry
from proxy.engine.context import Identity, RequestContext
from proxy.engine.policies import PlanPerSet
from proxy.engine.requestinfo import RequestInfo
from proxy.middlewares.audit_event import (
    CLIENT_GONE,
    ENCODER,
    OBJECT_VERBS,
    event,
    joined_line,
    object_ref,
    request_uri,
)
from proxy.middlewares.audit_spec import (
    SECTION,
    AuditPlan,
    Decision,
    build_plan,
    parse_section,
)

__all__ = ["POLL_SECONDS", "SECTION", "Audit", "parse_section"]

log = logging.getLogger("opgate.audit")

POLL_SECONDS = 0.1  # how often open long-running calls are checked for their response head
MEMO_SIZE = 4096  # calls whose requestURI and objectRef are remembered


@dataclass(slots=True)
class _Open:
    """A long-running call between its entry hook and its end."""

    ctx: RequestContext
    decision: Decision
    started_sent: bool = False


@dataclass(slots=True)
class _Call:
    """What every call of one RequestInfo, identity, query, user agent and caller address has
    in common under the policy set in force (see :meth:`Audit.exit`). Holding ``info`` and
    ``identity`` keeps their ids (the memo key) their own."""

    info: RequestInfo
    identity: Identity | None
    query: str
    agent: str | None
    remote: str
    decision: Decision
    completes: bool  # a ResponseComplete event is written (level not None, stage not omitted)
    joinable: bool  # no requestObject possible (Metadata, or not a resource request)
    impersonation: bool  # the policy set lets callers impersonate (Impersonate-User is logged)
    counter: Any  # opgate_audit_events_total{level}
    # the JSON fragments of :meth:`Audit.exit`'s common case, once one was joined, and the
    # middle one completed per response code
    fragments: tuple[str, str, str] | None = None
    coded: dict[int, str] = field(default_factory=dict)


class Audit:
    """The audit middleware (module docstring). ``write`` takes one line (with its newline)."""

    name = "audit"
    needs_body = True  # narrowed per call by wants_body: only calls a rule may log at Request
    fail_open = True

    def __init__(self, *, write: Callable[[str], None],
                 clock: Callable[[], float] = time.time) -> None:
        self._write = write
        self._clock = clock
        self.plan = PlanPerSet(SECTION, build_plan, AuditPlan())
        self._open: dict[int, _Open] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._counters: dict[str, Any] = {}
        self._parts: dict[tuple[int, str], tuple[Any, str, dict[str, str] | None]] = {}
        # _Call records of the policy set ``_calls_for``, by (id(info), id(identity), query,
        # user agent, caller address), and the last one found of each info by id(info) alone:
        # see exit
        self._calls: dict[tuple[Any, ...], _Call] = {}
        self._last: dict[int, _Call] = {}
        self._calls_for: object = None

    def wants_body(self, ctx: RequestContext) -> bool:
        return self.plan(ctx.policies).may_want_body(ctx.info)

    def entry(self, ctx: RequestContext) -> None:
        """Remember long-running calls, to record ResponseStarted when their head goes out."""
        if not ctx.info.is_long_running:
            return
        decision = self.plan(ctx.policies).decide(ctx.info, ctx.identity)
        if decision.level == "None" or "ResponseStarted" in decision.omit_stages:
            return
        self._open[id(ctx)] = _Open(ctx, decision)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(POLL_SECONDS, self._poll)

    def _poll(self) -> None:
        self._timer = None
        for key, item in list(self._open.items()):
            ctx = item.ctx
            if ctx.finished or ctx.answer is not None:
                # the exit hook decides; an answer of opgate's own (the relay's 503, 504) is
                # logged there at both stages, and from here too it would be twice
                continue
            if ctx.status_code and not item.started_sent:
                item.started_sent = True
                self._emit(ctx, item.decision, "ResponseStarted", self._clock())
            if item.started_sent:
                del self._open[key]
        if any(not item.started_sent for item in self._open.values()):
            self._timer = asyncio.get_running_loop().call_later(POLL_SECONDS, self._poll)

    def exit(self, ctx: RequestContext) -> None:
        if self._open:  # long-running calls under way: is this one of them?
            item = self._open.pop(id(ctx), None)
            if item is not None and item.ctx is ctx:
                self._exit_open(ctx, item)
                return
        if ctx.answer is not None and ctx.info.is_long_running and ctx.decision != "unauthorized":
            self._exit_answered(ctx)
            return
        # every other call: its _Call record (remembered per policy set, by the ids of the
        # RequestInfo, shared by identical calls, and the identity it holds, and by query, user
        # agent and caller address) has the decision, the counter and the line's fragments:
        # no plan lookup nor decision per call. The record last found for the RequestInfo is
        # tried first: comparing its fields costs ~800 instructions less than building and
        # hashing the memo's key.
        info, identity = ctx.info, ctx.identity
        if ctx.policies is not self._calls_for:
            self._calls.clear()
            self._last.clear()
            self._calls_for = ctx.policies
        headers = ctx.headers
        by_name = getattr(headers, "by_name", None)
        if by_name is not None:  # the fast relay's headers: one dict for the names read here
            index = by_name()
            raw_agent = index.get(b"user-agent")
            agent = None if raw_agent is None else raw_agent.decode("latin-1")
            # (a client's Audit-ID, too, takes the encoded path: it is the event's auditID)
            forwarded = (b"x-forwarded-for" in index or b"x-real-ip" in index
                         or b"audit-id" in index)
            impersonated = b"impersonate-user" in index
        else:
            agent = headers.get("user-agent")
            forwarded = ("x-forwarded-for" in headers or "x-real-ip" in headers
                         or "audit-id" in headers)
            impersonated = "impersonate-user" in headers
        call = self._last.get(id(info))
        if (call is None or call.info is not info or call.identity is not identity
                or call.agent != agent or call.query != ctx.query or call.remote != ctx.remote):
            call = self._call(ctx, agent)
        if not call.completes:
            return
        stamp = ctx.wall_time + ((ctx.finished or time.monotonic()) - ctx.started)
        code = ctx.status_code
        # The common case (nothing but the code to tell: no answer of opgate's own, no error,
        # no request object, no forwarded addresses nor impersonation to log) is joined from
        # the record's JSON fragments; the rest is encoded from event(). Both give the same
        # text (tests/unit/test_audit.py).
        line = None
        if not (not code or ctx.answer is not None or ctx.error or not call.joinable
                or (code >= 400 and ctx.decision != "allowed")
                or (ctx.body and info.verb in OBJECT_VERBS)  # objectRef from the body
                or forwarded
                # Impersonate-User is only logged where impersonation is allowed
                or (impersonated and (call.impersonation or ctx.allow_impersonation))):
            line = joined_line(ctx, call.fragments or self._fragments(ctx, call),
                               call.coded, code, stamp)
        if line is None:
            self._emit(ctx, call.decision, "ResponseComplete", stamp)
            return
        self._write(line)
        call.counter.inc()

    def _exit_open(self, ctx: RequestContext, item: _Open) -> None:
        """The end of a long-running call (ResponseStarted first if the poll has not sent it)."""
        decision = item.decision
        if not item.started_sent and ctx.status_code and ctx.status_code != CLIENT_GONE:
            self._emit(ctx, decision, "ResponseStarted", self._clock())
        if "ResponseComplete" in decision.omit_stages:
            return
        end = ctx.wall_time + ((ctx.finished or time.monotonic()) - ctx.started)
        self._emit(ctx, decision, "ResponseComplete", end)

    def _exit_answered(self, ctx: RequestContext) -> None:
        """A long-running call opgate answered before :meth:`entry` ran (a rule, a fault, a
        rate limit): ResponseStarted and ResponseComplete, as the apiserver logs its own denial
        of one (its 401 excepted: one event, README)."""
        decision = self.plan(ctx.policies).decide(ctx.info, ctx.identity)
        if decision.level == "None":
            return
        end = ctx.wall_time + ((ctx.finished or time.monotonic()) - ctx.started)
        for stage in ("ResponseStarted", "ResponseComplete"):
            if stage not in decision.omit_stages:
                self._emit(ctx, decision, stage, end)

    def event(self, ctx: RequestContext, decision: Decision, stage: str,
              stamp: float) -> dict[str, Any]:
        """The ``audit.k8s.io/v1`` Event (:func:`~proxy.middlewares.audit_event.event`) with
        this call's remembered requestURI and objectRef."""
        return event(ctx, decision, stage, stamp, *self._info_parts(ctx))

    def _info_parts(self, ctx: RequestContext) -> tuple[str, dict[str, str] | None]:
        """``requestURI`` and ``objectRef`` of a call, remembered per RequestInfo (shared by
        identical calls) and query."""
        info = ctx.info
        key = (id(info), ctx.query)
        hit = self._parts.get(key)
        if hit is not None and hit[0] is info:
            return hit[1], hit[2]
        ref = object_ref(info)
        uri = request_uri(ctx.path, ctx.query)
        if len(self._parts) >= MEMO_SIZE:
            self._parts.clear()
        self._parts[key] = (info, uri, ref)
        return uri, ref

    def _call(self, ctx: RequestContext, agent: str | None) -> _Call:
        """The :class:`_Call` record of ``ctx`` (sent with User-Agent ``agent``) from
        :meth:`exit`'s memo, or a new one; it becomes its RequestInfo's last record."""
        info, identity = ctx.info, ctx.identity
        key = (id(info), id(identity), ctx.query, agent, ctx.remote)
        call = self._calls.get(key)
        if call is None or call.info is not info or call.identity is not identity:
            call = self._remember(ctx, agent, key)
        if len(self._last) >= MEMO_SIZE:
            self._last.clear()
        self._last[id(info)] = call
        return call

    def _remember(self, ctx: RequestContext, agent: str | None, key: tuple[Any, ...]) -> _Call:
        """A new :class:`_Call` record for :meth:`exit`'s memo (its key in ``key``)."""
        info = ctx.info
        decision = self.plan(ctx.policies).decide(info, ctx.identity)
        completes = decision.level != "None" and "ResponseComplete" not in decision.omit_stages
        call = _Call(
            info, ctx.identity, ctx.query, agent, ctx.remote, decision, completes=completes,
            joinable=decision.level == "Metadata" or not info.is_resource_request,
            impersonation=bool(getattr(ctx.policies, "allow_impersonation", False)),
            # the counter child exists once the first event is written
            counter=telemetry.AUDIT_EVENTS.labels(decision.level) if completes else None)
        if len(self._calls) >= MEMO_SIZE:
            self._calls.clear()
        self._calls[key] = call
        return call

    def line(self, ctx: RequestContext, decision: Decision, stage: str, stamp: float) -> str:
        """:meth:`event` as its JSON line (with its newline); :meth:`exit` joins the same text
        from remembered fragments in the common case."""
        return ENCODER.encode(self.event(ctx, decision, stage, stamp)) + "\n"

    def _fragments(self, ctx: RequestContext, call: _Call) -> tuple[str, str, str]:
        """For :meth:`exit`'s common case, the JSON up to the audit ID, from after it to the
        response code, and of the annotations after the decision (kept in ``call``)."""
        decision = call.decision
        ev = self.event(ctx, decision, "ResponseComplete", ctx.wall_time)
        head = ('{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":'
                f'{ENCODER.encode(decision.level)},"auditID":"')
        names = ("requestURI", "verb", "user", "impersonatedUser", "sourceIPs", "userAgent",
                 "objectRef")
        middle = '","stage":"ResponseComplete"' + "".join(
            f",{ENCODER.encode(k)}:{ENCODER.encode(ev[k])}" for k in names if k in ev
        ) + ',"responseStatus":{"metadata":{},"code":'
        notes = {k: v for k, v in ev["annotations"].items() if k != "opgate.dev/decision"}
        tail = "".join(f",{ENCODER.encode(k)}:{ENCODER.encode(v)}" for k, v in notes.items())
        call.fragments = (head, middle, tail)
        return call.fragments

    def _emit(self, ctx: RequestContext, decision: Decision, stage: str, stamp: float) -> None:
        self._write(self.line(ctx, decision, stage, stamp))
        counter = self._counters.get(decision.level)
        if counter is None:
            counter = self._counters[decision.level] = telemetry.AUDIT_EVENTS.labels(
                decision.level)
        counter.inc()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
