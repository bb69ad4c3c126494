"""What every relay does around a call, in one place: keep the in-flight and open-watch gauges,
time the upstream, and run the exit hooks of a call whose client went away, in the background
and bounded, so metrics still count it (the handler itself was cancelled with the client).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from proxy.engine import telemetry
from proxy.engine.chain import Chain, settle
from proxy.engine.context import RequestContext
from proxy.engine.telemetry import INFLIGHT, WATCHES_OPEN

log = logging.getLogger("opgate.relay")

EXIT_HOOK_TIMEOUT = 10.0  # bound for exit hooks that run after the client went away
CLIENT_GONE = 499  # status recorded for a call whose client left before any response
CUT_AT_SHUTDOWN = "cut short: opgate shut down (--shutdown-grace ran out, or a second signal)"

T = TypeVar("T")


class Aftercare:
    def __init__(self, chain: Chain) -> None:
        self._chain = chain
        self.has_hooks = any(
            getattr(m, "exit", None) or getattr(m, "retry", None) for m in chain.middlewares
        )
        self._background: set[asyncio.Task[None]] = set()
        # set by the listener when its shutdown cuts what still runs: a call cancelled then
        # was cut by opgate, not left by its client
        self.cutting = False
        self._upstream_hist: dict[str, Any] = {}

    async def track(self, ctx: RequestContext, call: Awaitable[T]) -> T:
        """Await ``call`` counted in the gauges; if it is cancelled (the client went away),
        record that and run the exit hooks in the background (:meth:`gone`). Sets
        ``ctx.finished``; the caller runs the exit hooks of a call that completed. (The fast
        relay does the same in its own coroutine, without this extra layer.)"""
        watch = ctx.info.verb == "watch"
        INFLIGHT.now += 1
        if watch:
            WATCHES_OPEN.now += 1
        try:
            result = await call
        except BaseException:  # cancelled: the client has gone
            self.gone(ctx)
            raise
        finally:
            INFLIGHT.now -= 1
            if watch:
                WATCHES_OPEN.now -= 1
        ctx.finished = time.monotonic()
        return result

    def gone(self, ctx: RequestContext) -> None:
        """The call was cancelled (its client went away, or the shutdown cut it): record that,
        and run the exit hooks in the background."""
        ctx.status_code = ctx.status_code or CLIENT_GONE
        ctx.error = ctx.error or self.gone_reason
        ctx.finished = time.monotonic()
        if self.has_hooks:
            self.exit_later(ctx)

    @property
    def gone_reason(self) -> str:
        """What a call cancelled or disconnected now is recorded as (``ctx.error``)."""
        return CUT_AT_SHUTDOWN if self.cutting else "client went away"

    def mark_cut(self) -> None:
        """The listener's shutdown cuts the calls still running now (see ``cutting``)."""
        self.cutting = True

    def observe_upstream(self, verb: str, seconds: float) -> None:
        """Record the time until the upstream's response headers (one histogram child per verb)."""
        child = self._upstream_hist.get(verb)
        if child is None:
            child = self._upstream_hist[verb] = telemetry.UPSTREAM_DURATION.labels(verb)
        child.observe(seconds)

    def exit_later(self, ctx: RequestContext) -> None:
        task = asyncio.get_running_loop().create_task(self._bounded_exit(ctx))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _bounded_exit(self, ctx: RequestContext) -> None:
        try:
            await asyncio.wait_for(settle(self._chain.exit(ctx)), EXIT_HOOK_TIMEOUT)
        except Exception:
            log.exception("exit hooks failed for a cancelled call (trace %s)", ctx.trace_id)

    async def drain(self) -> None:
        """Wait (bounded) for the exit hooks still running in the background."""
        if self._background:
            await asyncio.wait(self._background, timeout=EXIT_HOOK_TIMEOUT)
