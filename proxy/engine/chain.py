"""The middleware contract and the one place that runs hooks and contains their failures.

A middleware is a plain object (mitmproxy's addon style)::

    class RateLimit:
        name = "ratelimit"        # bounded label for logs and metrics
        needs_body = False        # True: the relay reads the (bounded) body into ctx.body
        fail_open = False         # a crash in this middleware lets the call go on (else 500)
        sections = ("rateLimits",)  # optional: entry acts only on policy sets with one of these

        def wants_body(self, ctx: RequestContext) -> bool: ...  # optional: this call's body?
        async def entry(self, ctx: RequestContext) -> Decision | None: ...  # before relaying
        async def exit(self, ctx: RequestContext) -> None: ...              # after the response
        async def retry(self, ctx: RequestContext) -> None: ...             # after a 409/429/5xx

``needs_body`` says a middleware may want request bodies at all; the optional ``wants_body``
narrows it per call (the relay reads a body, bounded, only when one of them wants it, so every
other body streams). Every hook is optional; the chain looks them up by name once, when it is
built, so the hot path only loops over the hooks that exist; a middleware that declares
``sections`` promises that its ``entry`` does nothing (returns ``None``) under a policy set
without any of them, so the chain skips that hook for such a set (worked out once per set).
An ``entry`` hook returns
``None`` (go on), a :class:`Deny` (the first one ends the chain) or a :class:`Delay` (sleep, then
go on). Middlewares never touch sockets; the relay never knows which middlewares exist.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, runtime_checkable

from proxy.engine import telemetry
from proxy.engine.context import Decision, Delay, Deny, RequestContext
from proxy.engine.status import StatusError, internal_error

log = logging.getLogger("opgate.chain")

EntryHook = Callable[[RequestContext], Awaitable[Decision | None]]
ExitHook = Callable[[RequestContext], Awaitable[None]]

RETRYABLE = frozenset({409, 429})


@runtime_checkable
class Middleware(Protocol):
    name: str
    needs_body: bool


def is_retryable(code: int) -> bool:
    """409, 429 and 5xx: what clients retry, and what the retry hooks see."""
    return code in RETRYABLE or code >= 500


class Chain:
    """An ordered, immutable list of middlewares, with their hooks resolved once."""

    __slots__ = ("_active", "_active_for", "_entry", "_exit", "_retry", "_sections",
                 "middlewares", "needs_body")

    def __init__(self, middlewares: Sequence[object] = ()) -> None:
        self.middlewares = tuple(middlewares)
        self.needs_body = any(getattr(m, "needs_body", False) for m in self.middlewares)
        self._entry = self._hooks("entry")
        self._exit = self._hooks("exit")
        self._retry = self._hooks("retry")
        self._sections: tuple[tuple[str, ...] | None, ...] = tuple(
            None if getattr(m, "sections", None) is None else tuple(m.sections)  # type: ignore[attr-defined]
            for m in self.middlewares if getattr(m, "entry", None) is not None)
        self._active_for: object = None
        self._active = self._entry

    def _entry_hooks(self, policies: object) -> tuple[tuple[str, bool, EntryHook], ...]:
        """The entry hooks that can act under ``policies`` (remembered for the last set)."""
        if policies is not self._active_for:
            section = getattr(policies, "section", None)
            self._active = tuple(
                hook for hook, sections in zip(self._entry, self._sections, strict=True)
                if sections is None or section is None or any(section(s) for s in sections))
            self._active_for = policies  # held: identity stays meaningful
        return self._active  # type: ignore[return-value]

    def _hooks(self, hook: str) -> tuple[tuple[str, bool, Callable[..., Awaitable[object]]], ...]:
        found = []
        for m in self.middlewares:
            fn = getattr(m, hook, None)
            if fn is not None:
                found.append((str(m.name), bool(getattr(m, "fail_open", False)), fn))  # type: ignore[attr-defined]
        return tuple(found)

    async def entry(self, ctx: RequestContext) -> StatusError | None:
        """Run the entry hooks; return the Status to answer with, or ``None`` to relay."""
        for name, fail_open, hook in self._entry_hooks(ctx.policies):
            try:
                decision = await hook(ctx)
            except asyncio.CancelledError:
                raise
            except Exception:
                telemetry.MIDDLEWARE_ERRORS.labels(name, "entry").inc()
                log.exception("middleware %s crashed in entry (%s)", name, ctx.trace_id)
                if fail_open:
                    continue
                ctx.decision = "error"
                return internal_error(f"opgate: middleware {name} failed; see the opgate log")
            if decision is None:
                continue
            if isinstance(decision, Deny):
                ctx.decision = decision.decision
                return decision.status
            if isinstance(decision, Delay) and decision.seconds > 0:
                await asyncio.sleep(decision.seconds)
        return None

    async def exit(self, ctx: RequestContext) -> None:
        """Run the exit hooks, then the retry hooks when the outcome is retryable."""
        for name, _fail_open, hook in self._exit:  # _run_after, inlined: one coroutine less
            try:
                await hook(ctx)
            except asyncio.CancelledError:
                raise
            except Exception:
                telemetry.MIDDLEWARE_ERRORS.labels(name, "exit").inc()
                log.exception("middleware %s crashed in exit (%s)", name, ctx.trace_id)
        if self._retry and is_retryable(ctx.status_code):
            await self._run_after(self._retry, ctx, "retry")

    @staticmethod
    async def _run_after(
        hooks: tuple[tuple[str, bool, Callable[..., Awaitable[object]]], ...],
        ctx: RequestContext,
        point: str,
    ) -> None:
        for name, _fail_open, hook in hooks:
            try:
                await hook(ctx)
            except asyncio.CancelledError:
                raise
            except Exception:
                telemetry.MIDDLEWARE_ERRORS.labels(name, point).inc()
                log.exception("middleware %s crashed in %s (%s)", name, point, ctx.trace_id)
