"""Traffic capture (``--capture FILE``): the calls ``spec.capture`` selects, as mitmproxy flows.

The entry hook (after identity, faults, rate limits and quota, so the caller is known) finds the
call's rule (:mod:`proxy.middlewares.capture_spec`; without any section: every call), draws its
``sample``, and for a selected call sets ``ctx.tap`` to a :class:`CallTap`: the relay then shows
it each request body chunk it forwards, the response head and each response body chunk, and it
keeps at most ``maxBodyBytes`` of each body (counting the rest: the flow says it was
truncated). Nothing is buffered beyond that bound and nothing is held back: the relay forwards
every chunk as before. Calls without a tap cost the relay one attribute check.

The exit hook turns a tapped call into a :class:`CapturedCall` (plain data) and hands it to
``write`` (:class:`proxy.capture.FlowFile`: a bounded queue and a writer thread that builds the
mitmproxy flow, redacts and writes it). opgate's own answers (a denial, throttling, a quota, a
fault, the relay's 503/504/413) are captured too, with their Status as the response, also for
calls answered before this middleware's entry hook ran (denied by identity or a rate limit):
the exit hook then decides and samples. Their request body was never read, so it is missing
unless a middleware read it (``ctx.body``).

Bodies of Secrets (core group ``secrets``, any subresource) are left out unless the rule says
``secretBodies: true``; tokens never reach the file (:mod:`proxy.engine.redact`, applied by the
writer).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from proxy.engine.context import RequestContext
from proxy.engine.policies import PlanPerSet
from proxy.middlewares.capture_spec import (
    SECTION,
    CapturePlan,
    CaptureRule,
    build_plan,
    parse_section,
)

__all__ = ["SECTION", "CallTap", "Capture", "CapturedCall", "parse_section"]

CLIENT_GONE = 499  # what the relay records for a call whose client left before any response
Pairs = list[tuple[Any, Any]]  # header (name, value) pairs, bytes or str


class CallTap:
    """A :class:`~proxy.engine.context.BodyTap` that keeps at most ``limit`` bytes per body."""

    __slots__ = ("limit", "omit", "request_at", "request_chunks", "request_kept", "request_seen",
                 "response_at", "response_chunks", "response_headers", "response_kept",
                 "response_reason", "response_seen", "response_status", "rule")

    def __init__(self, rule: CaptureRule, *, omit: str = "") -> None:
        self.rule = rule
        self.omit = omit  # why bodies are left out ("" keeps them)
        self.limit = 0 if omit else rule.max_body_bytes
        self.request_chunks: list[bytes] = []
        self.request_kept = self.request_seen = 0
        self.request_at = 0.0  # wall time of the last request body chunk
        self.response_status = 0
        self.response_reason: bytes | str = b""
        self.response_headers: Pairs | None = None
        self.response_at = 0.0
        self.response_chunks: list[bytes] = []
        self.response_kept = self.response_seen = 0

    def request_body(self, chunk: bytes) -> None:
        self.request_seen += len(chunk)
        self.request_at = time.time()
        room = self.limit - self.request_kept
        if room > 0:
            part = chunk if len(chunk) <= room else chunk[:room]
            self.request_chunks.append(part)
            self.request_kept += len(part)

    def response_head(self, status: int, reason: bytes | str,
                      headers: Iterable[tuple[bytes | str, bytes | str]]) -> None:
        self.response_status = status
        self.response_reason = reason
        self.response_headers = list(headers)
        self.response_at = time.time()

    def response_body(self, chunk: bytes) -> None:
        self.response_seen += len(chunk)
        room = self.limit - self.response_kept
        if room > 0:
            part = chunk if len(chunk) <= room else chunk[:room]
            self.response_chunks.append(part)
            self.response_kept += len(part)


@dataclass(slots=True)
class CapturedCall:
    """One captured call as plain data, for the writer thread (nothing redacted yet)."""

    trace_id: str
    method: str
    path: str  # decoded, as ctx.path
    raw_path: str  # as sent, when it held escapes ("": path)
    query: str
    request_headers: Pairs
    request_body: bytes | None  # what was kept (None: not seen)
    request_size: int  # bytes the client sent
    started: float  # wall time
    request_done: float
    verb: str
    api_group: str
    resource: str
    subresource: str
    decision: str
    user: str
    rule: str  # file:line, or "default"
    omit: str = ""  # why the bodies were left out
    status: int = 0  # 0: no response (the client left first, or the call broke before one)
    reason: bytes | str = b""
    response_headers: Pairs = field(default_factory=list)
    response_body: bytes | None = None
    response_size: int = 0
    response_started: float = 0.0
    finished: float = 0.0
    answered: bool = False  # the response is opgate's own Status
    answer_reason: str = ""
    answer_message: str = ""
    error: str = ""
    remote: str = ""  # the caller's address ("" on a Unix socket)
    upgrade: bool = False

    @property
    def request_truncated(self) -> bool:
        return self.request_body is not None and len(self.request_body) < self.request_size

    @property
    def response_truncated(self) -> bool:
        return self.response_body is not None and len(self.response_body) < self.response_size


def _is_upgrade(ctx: RequestContext) -> bool:
    """``Upgrade`` with ``Connection: upgrade``: the relay tunnels the call after a 101 (exec,
    attach, port-forward, or a WebSocket to a ``proxy`` subresource)."""
    headers = ctx.headers
    return "Upgrade" in headers and "upgrade" in (headers.get("Connection") or "").lower()


def _is_secret(ctx: RequestContext) -> bool:
    info = ctx.info
    return info.resource == "secrets" and info.api_group == "" and info.is_resource_request


class Capture:
    """The middleware (module docstring). ``write`` takes a :class:`CapturedCall` and must not
    block; ``rng`` returns a float in [0, 1) (seeded in tests)."""

    name = "capture"
    needs_body = False
    fail_open = True  # capture must never break a call

    def __init__(self, *, write: Callable[[CapturedCall], None],
                 rng: Callable[[], float] = random.random) -> None:
        self._write = write
        self._rng = rng
        self.plan = PlanPerSet(SECTION, build_plan, CapturePlan(None))

    def _select(self, ctx: RequestContext) -> CaptureRule | None:
        rule = self.plan(ctx.policies).rule_for(ctx.info, ctx.user)
        if rule is None or rule.sample <= 0.0:
            return None
        if rule.sample < 1.0 and self._rng() >= rule.sample:
            return None
        return rule

    def _tap(self, ctx: RequestContext, rule: CaptureRule) -> CallTap:
        omit = ""
        if _is_secret(ctx) and not rule.secret_bodies:
            omit = "Secret bodies are not captured (secretBodies: true on the rule captures them)"
        elif ctx.info.verb in ("exec", "attach", "portforward") or (
                ctx.info.subresource in ("exec", "attach", "portforward")) or _is_upgrade(ctx):
            omit = "upgrade: only the request and the 101 are captured"
        return CallTap(rule, omit=omit)

    def entry(self, ctx: RequestContext) -> None:
        rule = self._select(ctx)
        if rule is not None:
            ctx.tap = self._tap(ctx, rule)
        else:
            ctx.state[self.name] = False  # decided (and drawn): not captured

    def exit(self, ctx: RequestContext) -> None:
        tap = ctx.tap
        if not isinstance(tap, CallTap):
            if ctx.answer is None or self.name in ctx.state:
                return
            rule = self._select(ctx)  # answered before entry ran (e.g. denied by identity)
            if rule is None:
                return
            tap = self._tap(ctx, rule)
        self._write(self.record(ctx, tap))

    @staticmethod
    def record(ctx: RequestContext, tap: CallTap) -> CapturedCall:
        info = ctx.info
        headers = ctx.headers
        pairs = getattr(headers, "pairs", None)
        request_headers: Pairs = list(pairs() if pairs is not None else headers.items())
        body: bytes | None
        if tap.request_chunks or tap.request_seen:
            body = b"".join(tap.request_chunks)
            size = tap.request_seen
        elif ctx.body is not None:
            size = len(ctx.body)
            body = ctx.body[:tap.limit]
        else:
            size = ctx.bytes_in
            body = b"" if not size else None  # None: streamed before the tap, or never read
        finished = ctx.wall_time + ((ctx.finished or time.monotonic()) - ctx.started)
        call = CapturedCall(
            trace_id=ctx.trace_id, method=ctx.method, path=ctx.path, raw_path=ctx.raw_path,
            query=ctx.query,
            request_headers=request_headers, request_body=body, request_size=size,
            started=ctx.wall_time, request_done=tap.request_at or ctx.wall_time,
            verb=info.verb, api_group=info.api_group, resource=info.resource,
            subresource=info.subresource, decision=ctx.decision, user=ctx.user,
            rule=tap.rule.source or tap.rule.name, omit=tap.omit, finished=finished,
            error=ctx.error, remote=ctx.remote, upgrade=tap.response_status == 101 or (
                tap.omit.startswith("upgrade")))
        if tap.omit and call.request_body:
            call.request_body = b""
        answer = ctx.answer
        if answer is not None:
            content = answer.body()
            call.status = answer.code
            call.reason = answer.reason
            call.response_headers = [*answer.response_headers(), *ctx.response_headers,
                                     ("Content-Length", str(len(content)))]
            call.response_body = content
            call.response_size = len(content)
            call.response_started = finished
            call.answered = True
            call.answer_reason = answer.reason
            call.answer_message = answer.message
        elif tap.response_headers is not None:
            call.status = tap.response_status
            call.reason = tap.response_reason
            call.response_headers = [*tap.response_headers, *ctx.response_headers]
            call.response_body = b"".join(tap.response_chunks)
            call.response_size = tap.response_seen
            call.response_started = tap.response_at
        return call
