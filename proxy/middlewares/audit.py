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

Nothing here blocks a call: an event is built in the exit hook and handed to an
:class:`~proxy.middlewares.accesslog.AccessWriter` (batched, as the access log); for a file, its
batches go to a writer thread through :class:`QueuedStream`, which drops whole batches (counted
in ``opgate_audit_dropped_total``) rather than hold more than ``MAX_PENDING_BYTES``.
:class:`RotatingFile` rotates by size as the apiserver's ``--audit-log-maxsize`` /
``--audit-log-maxbackup`` do (backups named ``audit-2006-01-02T15-04-05.000.log``, UTC).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any
from urllib.parse import quote

from proxy.engine import telemetry
from proxy.engine.context import Identity, RequestContext
from proxy.engine.impersonation import impersonation_of
from proxy.engine.logfile import BackgroundWriter, RotatingFile
from proxy.engine.policies import PlanPerSet
from proxy.engine.protometa import MAGIC as PROTOBUF_MAGIC
from proxy.engine.protometa import read_meta
from proxy.engine.redact import redact_object, redact_query
from proxy.engine.requestinfo import RequestInfo
from proxy.middlewares.audit_spec import (
    SECTION,
    AuditPlan,
    Decision,
    at_least,
    build_plan,
    parse_section,
)

__all__ = ["MAX_PENDING_BYTES", "POLL_SECONDS", "SECTION", "Audit", "QueuedStream",
           "RotatingFile", "micro_time", "parse_section"]

log = logging.getLogger("opgate.audit")

POLL_SECONDS = 0.1  # how often open long-running calls are checked for their response head
MAX_PENDING_BYTES = 8 * 1024 * 1024  # events waiting for the writer thread, at most
MEMO_SIZE = 4096  # calls whose requestURI and objectRef are remembered
CLIENT_GONE = 499  # what the relay records for a call whose client left before any response
_REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
            409: "Conflict", 413: "RequestEntityTooLarge", 429: "TooManyRequests",
            500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}
_PATH_SAFE = "/:@!$&'()*+,;=-._~"
_NEEDS_QUOTE = re.compile(r"[^A-Za-z0-9/:@!$&'()*+,;=\-._~]")
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_DECISIONS = {d: _ENCODER.encode(d) for d in (
    "allowed", "denied", "unauthorized", "throttled", "unavailable", "fault", "error", "quota")}


# the last second _second_text formatted: its text, and where it starts and ends as floats
_last_text = ""
_second_start = _second_next = float("nan")  # no time is in it before the first call


def _second_text(second: int) -> str:
    """``second`` (whole seconds since the epoch) as RFC 3339 UTC without fraction nor zone,
    formatted once per second (the last one is remembered, with its bounds)."""
    global _last_text, _second_start, _second_next
    if second != _second_start:
        _last_text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        _second_start, _second_next = float(second), float(second + 1)
    return _last_text


def micro_time(wall: float) -> str:
    """``metav1.MicroTime`` as JSON: RFC 3339, UTC, six fractional digits."""
    second = int(wall)
    micros = min(int((wall - second) * 1_000_000), 999_999)  # truncated, as Go formats it
    return f"{_second_text(second)}.{micros:06d}Z"


# The six fractional digits of a timestamp as two lookups, by thousands of microseconds and
# the rest (Audit._joined; about half the cost of ``:06d``, which goes through the format-spec
# parser), each with the constant text around it in the line (fewer pieces to join): the point
# before the first three, and after the last three the text up to the next value
_MILLIS3 = tuple(f".{i:03d}" for i in range(1000))
_RECEIVED3 = tuple(f'{i:03d}Z","stageTimestamp":"' for i in range(1000))
_STAGED3 = tuple(f'{i:03d}Z","annotations":{{"opgate.dev/decision":' for i in range(1000))


def _ip(text: str) -> str | None:
    try:
        return str(ipaddress.ip_address(text.strip()))
    except ValueError:
        return None


def source_ips(ctx: RequestContext) -> list[str]:
    """``sourceIPs`` as the apiserver fills it: the valid addresses of ``X-Forwarded-For``,
    then ``X-Real-Ip`` unless already listed, then the caller's own address unless it is the
    last one listed (none on a Unix socket)."""
    found: list[str] = []
    forwarded = ctx.headers.get("x-forwarded-for")
    if forwarded:
        found = [ip for part in forwarded.split(",") if (ip := _ip(part)) is not None]
    real = ctx.headers.get("x-real-ip")
    if real:
        ip = _ip(real)
        if ip is not None and ip not in found:
            found.append(ip)
    remote = _ip(ctx.remote) if ctx.remote else None
    if remote is not None and (not found or found[-1] != remote):
        found.append(remote)
    return found


def request_uri(path: str, query: str, *, escaped: bool = False) -> str:
    """The request URI as the client sent it (a decoded path re-escaped; an ``escaped`` one, as
    sent, kept), secrets in the query redacted."""
    uri = quote(path, safe=_PATH_SAFE) if not escaped and _NEEDS_QUOTE.search(path) else path
    if not query:
        return uri
    return f"{uri}?{redact_query(query)}"


def _status(ctx: RequestContext) -> dict[str, Any]:
    """``responseStatus`` (a ``metav1.Status``, fields in its JSON order)."""
    answer = ctx.answer
    code = ctx.status_code
    if answer is not None:
        out: dict[str, Any] = {"metadata": {}, "status": "Failure", "message": answer.message,
                               "reason": answer.reason or _REASONS.get(answer.code, "")}
        if answer.details is not None:  # (an empty one too: the apiserver logs {} as well)
            out["details"] = answer.details
        out["code"] = answer.code
        return out
    if code >= 400 and (ctx.decision != "allowed" or ctx.error):  # e.g. the client went away
        out = {"metadata": {}, "status": "Failure"}
        if ctx.error:
            out["message"] = ctx.error
        reason = _REASONS.get(code)
        if reason:
            out["reason"] = reason
        out["code"] = code
        return out
    return {"metadata": {}, "code": code}


def _request_object(ctx: RequestContext, decision: Decision,
                    notes: dict[str, str]) -> Any | None:
    """The request body as JSON for ``requestObject`` (None, with a note, when it cannot be)."""
    body = ctx.body
    if body is None:
        if ctx.bytes_in and ctx.method in _BODY_METHODS:
            notes["opgate.dev/request-object"] = "omitted: the body was not read"
        return None
    if not body:
        return None
    ctype = (ctx.headers.get("content-type") or "").lower()
    if "protobuf" in ctype or "cbor" in ctype:
        notes["opgate.dev/request-object"] = f"omitted: not JSON ({ctype.split(';')[0]})"
        return None
    try:
        obj = json.loads(body)
    except ValueError:
        notes["opgate.dev/request-object"] = (
            f"omitted: not JSON ({ctype.split(';')[0] or 'no content type'})")
        return None
    info = ctx.info
    obj = redact_object(obj, info.api_group, info.resource, info.subresource)
    if isinstance(obj, dict):
        if decision.omit_managed_fields:
            meta = obj.get("metadata")
            if isinstance(meta, dict) and "managedFields" in meta:
                obj["metadata"] = {k: v for k, v in meta.items() if k != "managedFields"}
    return obj


def _body_name(ctx: RequestContext) -> str:
    """A create's object name from its JSON or protobuf body (as the apiserver completes
    objectRef; client-go sends built-in kinds as protobuf by default)."""
    body = ctx.body
    if not body or ctx.info.verb != "create":
        return ""
    if body.startswith(PROTOBUF_MAGIC):
        meta = read_meta(body)
        return meta.name if meta is not None else ""
    if not body.lstrip().startswith(b"{"):
        return ""
    try:
        meta = json.loads(body).get("metadata")
    except (ValueError, AttributeError):
        return ""
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) else ""


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
            if ctx.finished:
                continue  # the exit hook decides
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
                or (ctx.body and not info.name)
                or forwarded
                # Impersonate-User is only logged where impersonation is allowed
                or (impersonated and (call.impersonation or ctx.allow_impersonation))):
            line = self._joined(ctx, call, code, stamp)
        if line is None:
            self._emit(ctx, call.decision, "ResponseComplete", stamp)
            return
        self._write(line)
        call.counter.inc()

    def _joined(self, ctx: RequestContext, call: _Call, code: int, stamp: float) -> str | None:
        """:meth:`exit`'s common line, joined from ``call``'s fragments (``None`` before 1970,
        where the seconds below do not hold: the caller encodes the event then)."""
        head, middle, tail = call.fragments or self._fragments(ctx, call)
        # the JSON from after the audit ID to requestReceivedTimestamp's value, per code
        coded = call.coded.get(code)
        if coded is None:
            coded = call.coded[code] = f'{middle}{code}}},"requestReceivedTimestamp":"'
        # requestReceivedTimestamp and stageTimestamp, mostly in the same second: its text is
        # formatted once per second (_second_text) and whether a time is in it is told by
        # comparing floats (an int() call less per timestamp); the microseconds are truncated,
        # as Go formats them, and written as two lookups each (not ``:06d``)
        wall = ctx.wall_time
        if stamp < wall:
            stamp = wall
        if not _second_start <= wall < _second_next:
            _second_text(int(wall))
            if wall < _second_start:  # before 1970: int() rounded up, toward zero
                return None
        received = _last_text
        micros = int((wall - _second_start) * 1_000_000)
        if stamp < _second_next:  # and stamp >= wall: the same second
            staged = received
            stage_micros = int((stamp - _second_start) * 1_000_000)
        else:
            end = int(stamp)
            staged = _second_text(end)
            stage_micros = int((stamp - end) * 1_000_000)
        # a time just below the next second may round up to 1_000_000: clamped by comparison,
        # not min() (a builtin call that parses keywords: ~1.2k instructions each)
        if micros > 999_999:
            micros = 999_999
        if stage_micros > 999_999:
            stage_micros = 999_999
        outcome = _DECISIONS.get(ctx.decision) or _ENCODER.encode(ctx.decision)
        return (f'{head}{ctx.trace_id}{coded}'
                f'{received}{_MILLIS3[micros // 1000]}{_RECEIVED3[micros % 1000]}'
                f'{staged}{_MILLIS3[stage_micros // 1000]}{_STAGED3[stage_micros % 1000]}'
                f'{outcome}{tail}}}}}\n')

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
        """The ``audit.k8s.io/v1`` Event, keys in the apiserver's JSON order."""
        info = ctx.info
        notes: dict[str, str] = {}
        uri, ref = self._info_parts(ctx)
        if ctx.raw_path:  # escapes as the client sent them (c%6Dq stays c%6Dq), as the apiserver
            uri = request_uri(ctx.raw_path, ctx.query, escaped=True)
        ev: dict[str, Any] = {"kind": "Event", "apiVersion": "audit.k8s.io/v1",
                              "level": decision.level, "auditID": ctx.audit_id, "stage": stage,
                              "requestURI": uri, "verb": info.verb}
        identity = ctx.identity
        if identity is not None:
            user: dict[str, Any] = {"username": identity.user}
            if identity.uid:
                user["uid"] = identity.uid
            if identity.groups:
                user["groups"] = list(identity.groups)
            if identity.extra:  # by key, as Go writes a map
                user["extra"] = {key: list(values) for key, values in identity.extra}
            ev["user"] = user
        else:
            ev["user"] = {}
            notes["opgate.dev/user"] = "unverified"
        impersonated = impersonation_of(ctx)
        if impersonated is not None:
            ev["impersonatedUser"] = impersonated
        sources = source_ips(ctx)
        if sources:
            ev["sourceIPs"] = sources
        agent = ctx.headers.get("user-agent")
        if agent:
            ev["userAgent"] = agent
        if ref is not None:
            if not info.name and ctx.body:
                name = _body_name(ctx)
                if name:  # in objectRef's field order: after namespace
                    ref = {**{k: v for k, v in ref.items() if k in ("resource", "namespace")},
                           "name": name,
                           **{k: v for k, v in ref.items() if k not in ("resource", "namespace")}}
            ev["objectRef"] = ref
        if ctx.status_code and (stage == "ResponseComplete" or ctx.status_code != CLIENT_GONE):
            ev["responseStatus"] = _status(ctx)
        if (at_least(decision.level, "Request") and info.is_resource_request
                and stage == "ResponseComplete"):
            obj = _request_object(ctx, decision, notes)
            if obj is not None:
                ev["requestObject"] = obj
        ev["requestReceivedTimestamp"] = micro_time(ctx.wall_time)
        ev["stageTimestamp"] = micro_time(max(stamp, ctx.wall_time))
        annotations = {"opgate.dev/decision": ctx.decision}
        if ctx.answer is not None:
            annotations["opgate.dev/reason"] = ctx.answer.message
        if decision.rule:
            annotations["opgate.dev/audit-rule"] = decision.rule
        if ctx.error:
            annotations["opgate.dev/error"] = ctx.error
        annotations.update(notes)
        ev["annotations"] = annotations
        return ev

    def _info_parts(self, ctx: RequestContext) -> tuple[str, dict[str, str] | None]:
        """``requestURI`` and ``objectRef`` of a call, remembered per RequestInfo (shared by
        identical calls) and query."""
        info = ctx.info
        key = (id(info), ctx.query)
        hit = self._parts.get(key)
        if hit is not None and hit[0] is info:
            return hit[1], hit[2]
        ref: dict[str, str] | None = None
        if info.is_resource_request:
            ref = {"resource": info.resource}
            if info.namespace:
                ref["namespace"] = info.namespace
            if info.name:
                ref["name"] = info.name
            if info.api_group:
                ref["apiGroup"] = info.api_group
            if info.api_version:
                ref["apiVersion"] = info.api_version
            if info.subresource:
                ref["subresource"] = info.subresource
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
        return _ENCODER.encode(self.event(ctx, decision, stage, stamp)) + "\n"

    def _fragments(self, ctx: RequestContext, call: _Call) -> tuple[str, str, str]:
        """For :meth:`exit`'s common case, the JSON up to the audit ID, from after it to the
        response code, and of the annotations after the decision (kept in ``call``)."""
        decision = call.decision
        ev = self.event(ctx, decision, "ResponseComplete", ctx.wall_time)
        head = ('{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":'
                f'{_ENCODER.encode(decision.level)},"auditID":"')
        names = ("requestURI", "verb", "user", "impersonatedUser", "sourceIPs", "userAgent",
                 "objectRef")
        middle = '","stage":"ResponseComplete"' + "".join(
            f",{_ENCODER.encode(k)}:{_ENCODER.encode(ev[k])}" for k in names if k in ev
        ) + ',"responseStatus":{"metadata":{},"code":'
        notes = {k: v for k, v in ev["annotations"].items() if k != "opgate.dev/decision"}
        tail = "".join(f",{_ENCODER.encode(k)}:{_ENCODER.encode(v)}" for k, v in notes.items())
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


# --- where the lines go ------------------------------------------------------------------------

class QueuedStream:
    """A stream for :class:`~proxy.middlewares.accesslog.AccessWriter` whose ``write`` never
    blocks: batches go to a writer thread; past ``max_pending`` bytes waiting, a batch is dropped
    and its lines counted in ``opgate_audit_dropped_total`` (as are lines a failed write lost)."""

    def __init__(self, target: RotatingFile | IO[str], *,
                 max_pending: int = MAX_PENDING_BYTES) -> None:
        self._target = target
        self._writer: BackgroundWriter[str] = BackgroundWriter(
            self._write_batch, name="opgate-audit-writer", max_pending=max_pending,
            dropped=lambda data: telemetry.AUDIT_DROPPED.inc(data.count("\n")))

    def write(self, data: str) -> None:
        self._writer.put(data, len(data))

    def flush(self) -> None:
        """Nothing: the writer thread flushes after each batch."""

    def _write_batch(self, batch: Sequence[str]) -> None:
        data = "".join(batch)
        try:
            self._target.write(data)
            self._target.flush()
        except (OSError, ValueError) as exc:
            telemetry.AUDIT_DROPPED.inc(data.count("\n"))
            self._writer.complain("cannot write the audit log: %s (events dropped)", exc)

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (``timeout`` at most), then close the target."""
        if self._writer.close(timeout):
            close = getattr(self._target, "close", None)
            if close is not None:
                close()
