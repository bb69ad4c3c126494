"""The middleware contract and the one place that runs hooks and contains their failures.

A middleware is a plain object (mitmproxy's addon style)::

    class RateLimit:
        name = "ratelimit"        # bounded label for logs and metrics
        needs_body = False        # True: the relay reads the (bounded) body into ctx.body
        fail_open = False         # a crash in this middleware lets the call go on (else 500)
        sections = ("rateLimits",)  # optional: entry acts only on policy sets with one of these
        verbs = frozenset({"create"})  # optional: entry and exit act only on these verbs

        def wants_body(self, ctx: RequestContext) -> bool: ...  # optional: this call's body?
        def entry(self, ctx: RequestContext) -> Decision | None: ...  # before relaying
        def exit(self, ctx: RequestContext) -> None: ...              # after the response
        def retry(self, ctx: RequestContext) -> None: ...             # after a 409/429/5xx

``needs_body`` says a middleware may want request bodies at all; the optional ``wants_body``
narrows it per call (the relay reads a body, bounded, only when one of them wants it, so every
other body streams). Every hook is optional; the chain looks them up by name once, when it is
built, so the hot path only loops over the hooks that exist; a middleware that declares
``sections`` promises that its ``entry`` does nothing (returns ``None``) under a policy set
without any of them, so the chain skips that hook for such a set (worked out once per set);
one that declares ``verbs`` promises that its ``entry`` and ``exit`` do nothing for a call of
another verb (``ctx.info.verb``), so the chain skips both for such a call (worked out once per
verb). An ``entry`` hook returns
``None`` (go on), a :class:`Deny` (the first one ends the chain) or a :class:`Delay` (sleep, then
go on). Middlewares never touch sockets; the relay never knows which middlewares exist.

A hook is a plain function or a coroutine function. A plain one answers at once, which is what
the hot path wants: awaiting a coroutine per hook and per call costs more than most hooks' own
work. When it has to wait (a Redis round trip, a token to verify) it returns a coroutine (it
calls an ``async def``), and the chain awaits that. So :meth:`Chain.entry` and
:meth:`Chain.exit` answer at once too when no hook had to wait, and return a coroutine
otherwise; :func:`settle` awaits whichever came back, for callers off the hot path.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from proxy.engine import telemetry
from proxy.engine.context import Delay, Deny, RequestContext
from proxy.engine.status import StatusError, internal_error

log = logging.getLogger("opgate.chain")

T = TypeVar("T")
Maybe = T | Coroutine[Any, Any, T]  # what a hook or the chain returns: an answer, or its wait
# (name, fail_open, the hook, the verbs it acts on: None for all)
Hook = tuple[str, bool, Callable[[RequestContext], Any], frozenset[str] | None]
Hooks = tuple[Hook, ...]

RETRYABLE = frozenset({409, 429})
MAX_VERBS = 64  # verbs whose hooks are remembered (a non-resource call's verb is its method)


@runtime_checkable
class Middleware(Protocol):
    name: str
    needs_body: bool


def is_retryable(code: int) -> bool:
    """409, 429 and 5xx: what clients retry, and what the retry hooks see."""
    return code in RETRYABLE or code >= 500


def _acts_on(hook: Hook, verb: str) -> bool:
    verbs = hook[3]
    return verbs is None or verb in verbs


def _index(hooks: Hooks, entry: Hook) -> int:
    """Where ``entry`` is in ``hooks``, found off the hot path (the loops keep no index). By
    identity: each entry is a tuple of its own, even for a middleware listed twice."""
    return next(i for i, e in enumerate(hooks) if e is entry)


async def settle(result: Maybe[T]) -> T:
    """``result`` itself, or what it answers once awaited: for callers of a hook or of
    :meth:`Chain.entry` / :meth:`Chain.exit` that may await (tests, the aiohttp core)."""
    if inspect.isawaitable(result):
        return await result  # type: ignore[no-any-return]
    return result


class Chain:
    """An ordered, immutable list of middlewares, with their hooks resolved once."""

    __slots__ = ("_active", "_active_for", "_before_body", "_entry", "_exit", "_exits",
                 "_retry", "_sections", "middlewares", "needs_body")

    def __init__(self, middlewares: Sequence[object] = ()) -> None:
        self.middlewares = tuple(middlewares)
        self.needs_body = any(getattr(m, "needs_body", False) for m in self.middlewares)
        self._entry = self._hooks("entry")
        # the entry hooks of the middlewares before the first that reads bodies (identity,
        # faults): run before a body is read for the others (entry_before_body)
        lead = 0
        for m in self.middlewares:
            if getattr(m, "needs_body", False):
                break
            lead += getattr(m, "entry", None) is not None
        self._before_body = frozenset(id(e) for e in self._entry[:lead])
        self._exit = self._hooks("exit")
        self._retry = self._hooks("retry")
        self._sections: tuple[tuple[str, ...] | None, ...] = tuple(
            None if getattr(m, "sections", None) is None else tuple(m.sections)  # type: ignore[attr-defined]
            for m in self.middlewares if getattr(m, "entry", None) is not None)
        self._active_for: object = None
        self._active: dict[str, Hooks] = {}  # per verb: the entry hooks for _active_for
        self._exits: dict[str, Hooks] = {}  # per verb: the exit hooks

    def _entry_hooks(self, policies: object) -> dict[str, Hooks]:
        """The entry hooks that can act under ``policies``, per verb as :meth:`_of_verb` fills
        it (remembered for the last set)."""
        if policies is not self._active_for:
            self._active = {}
            self._active_for = policies  # held: identity stays meaningful
        return self._active

    def _of_verb(self, point: str, verb: str) -> Hooks:
        """The ``entry`` (under ``_active_for``) or ``exit`` hooks that can act on ``verb``
        (remembered, for the first verbs)."""
        if point == "entry":
            section = getattr(self._active_for, "section", None)
            hooks, cache = tuple(
                hook for hook, sections in zip(self._entry, self._sections, strict=True)
                if sections is None or section is None or any(section(s) for s in sections)
            ), self._active
        else:
            hooks, cache = self._exit, self._exits
        found = tuple(hook for hook in hooks if _acts_on(hook, verb))
        if len(cache) < MAX_VERBS:
            cache[verb] = found
        return found

    def _hooks(self, hook: str) -> Hooks:
        found = []
        for m in self.middlewares:
            fn = getattr(m, hook, None)
            if fn is not None:
                verbs = getattr(m, "verbs", None)
                found.append((str(m.name), bool(getattr(m, "fail_open", False)), fn,  # type: ignore[attr-defined]
                              None if verbs is None else frozenset(verbs)))
        return tuple(found)

    def entry(self, ctx: RequestContext) -> Maybe[StatusError | None]:
        """Run the entry hooks; return the Status to answer with, or ``None`` to relay (or a
        coroutine answering that, once a hook has to wait)."""
        active = self._active  # _entry_hooks' answer while the same set is in force, uncalled
        if ctx.policies is not self._active_for:
            active = self._entry_hooks(ctx.policies)
        verb = ctx.info.verb
        try:  # a subscript, not a get() call
            hooks = active[verb]
        except KeyError:
            hooks = self._of_verb("entry", verb)
        return self._run_entry(ctx, hooks)

    def entry_before_body(self, ctx: RequestContext) -> Maybe[StatusError | None]:
        """:meth:`entry` for a call whose body is read for a middleware, before the read: the
        hooks of the middlewares ahead of the first that reads bodies (who calls, what is
        injected), so a caller refused there (a ``401``) never makes opgate read its body."""
        return self._entry_part(ctx, before=True)

    def entry_after_body(self, ctx: RequestContext) -> Maybe[StatusError | None]:
        """The rest of :meth:`entry` once the body is in ``ctx.body``."""
        return self._entry_part(ctx, before=False)

    def _entry_part(self, ctx: RequestContext, *, before: bool) -> Maybe[StatusError | None]:
        if ctx.policies is not self._active_for:
            self._entry_hooks(ctx.policies)
        verb = ctx.info.verb
        hooks = self._active.get(verb) or self._of_verb("entry", verb)
        lead = self._before_body
        return self._run_entry(ctx, tuple(h for h in hooks if (id(h) in lead) is before))

    def _run_entry(self, ctx: RequestContext, hooks: Hooks) -> Maybe[StatusError | None]:
        for entry in hooks:  # no enumerate(): ~250 instructions a hook (see _index)
            name, fail_open, hook, _verbs = entry
            try:
                decision = hook(ctx)
            except Exception:
                if self._crashed(ctx, name, fail_open):
                    continue
                return internal_error(f"opgate: middleware {name} failed; see the opgate log")
            if decision is None:
                continue
            if isinstance(decision, Deny):
                ctx.decision = decision.decision
                return decision.status
            # a coroutine, or a Delay
            return self._entry_waiting(ctx, hooks, _index(hooks, entry), decision)
        return None

    async def _entry_waiting(self, ctx: RequestContext, hooks: Hooks, at: int,
                             pending: object) -> StatusError | None:
        """:meth:`entry` from hook ``at`` on, whose answer ``pending`` has to be awaited (or
        is a :class:`Delay` to sleep)."""
        for name, fail_open, hook, _verbs in hooks[at:]:
            try:
                decision = hook(ctx) if pending is None else pending
                pending = None
                if decision is not None and inspect.isawaitable(decision):
                    decision = await decision
            except asyncio.CancelledError:
                raise
            except Exception:
                if self._crashed(ctx, name, fail_open):
                    continue
                return internal_error(f"opgate: middleware {name} failed; see the opgate log")
            if isinstance(decision, Deny):
                ctx.decision = decision.decision
                return decision.status
            if isinstance(decision, Delay) and decision.seconds > 0:
                await asyncio.sleep(decision.seconds)
        return None

    @staticmethod
    def _crashed(ctx: RequestContext, name: str, fail_open: bool) -> bool:
        """Count and log the entry hook that raised; whether the call goes on (fail open)."""
        telemetry.MIDDLEWARE_ERRORS.labels(name, "entry").inc()
        log.exception("middleware %s crashed in entry (%s)", name, ctx.trace_id)
        if not fail_open:
            ctx.decision = "error"
        return fail_open

    def exit(self, ctx: RequestContext) -> Maybe[None]:
        """Run the exit hooks, then the retry hooks when the outcome is retryable (returns a
        coroutine that does the rest once a hook has to wait)."""
        verb = ctx.info.verb
        try:
            hooks = self._exits[verb]
        except KeyError:
            hooks = self._of_verb("exit", verb)
        for entry in hooks:  # no enumerate(), as in entry
            name, _fail_open, hook, _verbs = entry
            try:
                done = hook(ctx)
            except Exception:
                telemetry.MIDDLEWARE_ERRORS.labels(name, "exit").inc()
                log.exception("middleware %s crashed in exit (%s)", name, ctx.trace_id)
                continue
            if done is not None:
                return self._exit_waiting(ctx, hooks, _index(hooks, entry), done)
        if self._retry and is_retryable(ctx.status_code):
            return self._run_after(self._retry, ctx, "retry")
        return None

    async def _exit_waiting(self, ctx: RequestContext, hooks: Hooks, at: int,
                            pending: object) -> None:
        await self._run_after(hooks[at:], ctx, "exit", pending)
        if self._retry and is_retryable(ctx.status_code):
            await self._run_after(self._retry, ctx, "retry")

    @staticmethod
    async def _run_after(hooks: Hooks, ctx: RequestContext, point: str,
                         pending: object = None) -> None:
        """Run exit or retry ``hooks`` in turn, awaiting what they return; ``pending`` is what
        the first one already returned."""
        for name, _fail_open, hook, _verbs in hooks:
            try:
                done = hook(ctx) if pending is None else pending
                pending = None
                if done is not None and inspect.isawaitable(done):
                    await done
            except asyncio.CancelledError:
                raise
            except Exception:
                telemetry.MIDDLEWARE_ERRORS.labels(name, point).inc()
                log.exception("middleware %s crashed in %s (%s)", name, point, ctx.trace_id)
