"""The fields of an ``audit.k8s.io/v1`` Event as the apiserver fills them, and its JSON text.

What each field holds is told in :mod:`proxy.middlewares.audit` (the middleware, which decides
when a call is recorded and at which level). :func:`event` builds the Event (keys in the
apiserver's JSON order); :func:`joined_line` writes the common case's line from remembered
fragments, with the timestamps of :func:`micro_time` formatted once per second.
"""

from __future__ import annotations

import ipaddress
import re
import time
from typing import Any
from urllib.parse import quote

from proxy.engine.context import RequestContext
from proxy.engine.impersonation import impersonation_of
from proxy.engine.jsonbody import MAX_DEPTH, Encoder, TooDeep, loads
from proxy.engine.protometa import object_ref_fields
from proxy.engine.redact import redact_object, redact_query
from proxy.engine.requestinfo import RequestInfo
from proxy.middlewares.audit_spec import Decision, at_least

__all__ = ["CLIENT_GONE", "ENCODER", "OBJECT_VERBS", "event", "joined_line", "micro_time",
           "object_ref", "request_uri", "source_ips", "user_agent"]

CLIENT_GONE = 499  # what the relay records for a call whose client left before any response
_REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
            409: "Conflict", 413: "RequestEntityTooLarge", 429: "TooManyRequests",
            500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}
_PATH_SAFE = "/:@!$&'()*+,;=-._~"
_NEEDS_QUOTE = re.compile(r"[^A-Za-z0-9/:@!$&'()*+,;=\-._~]")
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
MAX_USER_AGENT = 1024  # the apiserver's maxUserAgentLength
_REF_ORDER = ("resource", "namespace", "name", "uid", "apiGroup", "apiVersion",
              "resourceVersion", "subresource")  # objectRef's fields in its JSON order
OBJECT_VERBS = frozenset({"create", "update"})  # their bodies are objects, the others' not
ENCODER = Encoder(ensure_ascii=False, separators=(",", ":"))  # also a requestObject of any depth
_DECISIONS = {d: ENCODER.encode(d) for d in (
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
# the rest (joined_line; about half the cost of ``:06d``, which goes through the format-spec
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


def user_agent(agent: str) -> str:
    """``userAgent`` as the apiserver logs it: at most its first 1,024 characters (bytes, for
    the ASCII every client sends), then ``...TRUNCATED``, so no client makes each event as
    large as its headers."""
    if len(agent) > MAX_USER_AGENT:
        return agent[:MAX_USER_AGENT] + "...TRUNCATED"
    return agent


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
        obj = loads(body)
    except TooDeep:  # the apiserver cannot decode it either (its 400)
        notes["opgate.dev/request-object"] = (
            f"omitted: nested deeper than {MAX_DEPTH} levels (the apiserver's limit)")
        return None
    except ValueError:
        notes["opgate.dev/request-object"] = (
            f"omitted: not JSON ({ctype.split(';')[0] or 'no content type'})")
        return None
    info = ctx.info
    obj = redact_object(obj, info.api_group, info.resource, info.subresource)
    # omitManagedFields drops them from an object (a create's, an update's), as the apiserver's
    # LogRequestObject; a patch it logs as sent (LogRequestPatch), so one that clears them
    # (managedFields: [{}]) shows it did
    if decision.omit_managed_fields and isinstance(obj, dict) and info.verb in OBJECT_VERBS:
        meta = obj.get("metadata")
        if isinstance(meta, dict) and "managedFields" in meta:
            obj["metadata"] = {k: v for k, v in meta.items() if k != "managedFields"}
    return obj




def _completed_ref(ctx: RequestContext, ref: dict[str, str]) -> dict[str, str]:
    """``ref`` completed from a create's or update's object body, JSON or protobuf (client-go
    sends built-in kinds as protobuf by default), as the apiserver's LogRequestObject does
    at any level: the name when the URL has none, the uid and resourceVersion (client-go's
    Update and UpdateStatus send both)."""
    body = ctx.body
    if not body or ctx.info.verb not in OBJECT_VERBS:
        return ref
    name, uid, version = object_ref_fields(body)
    found = {"name": name, "uid": uid, "resourceVersion": version}
    if not any(v and k not in ref for k, v in found.items()):
        return ref
    merged = {**found, **ref}
    return {k: merged[k] for k in _REF_ORDER if merged.get(k)}


def object_ref(info: RequestInfo) -> dict[str, str] | None:
    """``objectRef`` of a resource request (fields in the apiserver's JSON order), else
    ``None``."""
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
    return ref


def event(ctx: RequestContext, decision: Decision, stage: str, stamp: float, uri: str,
          ref: dict[str, str] | None) -> dict[str, Any]:
    """The ``audit.k8s.io/v1`` Event, keys in the apiserver's JSON order (``uri`` and ``ref``:
    the call's requestURI and objectRef, as :func:`request_uri` and :func:`object_ref` give
    them)."""
    info = ctx.info
    notes: dict[str, str] = {}
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
        ev["userAgent"] = user_agent(agent)
    if ref is not None:
        ev["objectRef"] = _completed_ref(ctx, ref)
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


def joined_line(ctx: RequestContext, fragments: tuple[str, str, str], by_code: dict[int, str],
                code: int, stamp: float) -> str | None:
    """The common line of :meth:`~proxy.middlewares.audit.Audit.exit`, joined from the JSON
    ``fragments`` of a call's event (:meth:`~proxy.middlewares.audit.Audit._fragments`) and
    ``by_code``, where the middle one is completed per response code (``None`` before 1970,
    where the seconds below do not hold: the caller encodes the event then)."""
    head, middle, tail = fragments
    # the JSON from after the audit ID to requestReceivedTimestamp's value, per code
    coded = by_code.get(code)
    if coded is None:
        coded = by_code[code] = f'{middle}{code}}},"requestReceivedTimestamp":"'
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
    outcome = _DECISIONS.get(ctx.decision) or ENCODER.encode(ctx.decision)
    return (f'{head}{ctx.trace_id}{coded}'
            f'{received}{_MILLIS3[micros // 1000]}{_RECEIVED3[micros % 1000]}'
            f'{staged}{_MILLIS3[stage_micros // 1000]}{_STAGED3[stage_micros % 1000]}'
            f'{outcome}{tail}}}}}\n')
