"""What every relay does around a finished call, in one place: time the upstream, and run the
exit hooks of a call whose client went away, in the background and bounded, so metrics still
count it (the handler itself was cancelled with the client).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from proxy.engine import telemetry
from proxy.engine.chain import Chain
from proxy.engine.context import RequestContext

log = logging.getLogger("opgate.relay")

EXIT_HOOK_TIMEOUT = 10.0  # bound for exit hooks that run after the client went away


class Aftercare:
    def __init__(self, chain: Chain) -> None:
        self._chain = chain
        self._background: set[asyncio.Task[None]] = set()
        self._upstream_hist: dict[str, Any] = {}

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
            await asyncio.wait_for(self._chain.exit(ctx), EXIT_HOOK_TIMEOUT)
        except Exception:
            log.exception("exit hooks failed for a cancelled call (trace %s)", ctx.trace_id)

    async def drain(self) -> None:
        """Wait (bounded) for the exit hooks still running in the background."""
        if self._background:
            await asyncio.wait(self._background, timeout=EXIT_HOOK_TIMEOUT)
