"""Prometheus metrics for every API call, recorded once the response is done.

Labels stay bounded: the verb comes from a fixed set, group/resource from what clients actually
call (capped: past ``MAX_RESOURCES`` distinct pairs new ones are recorded as ``other``, so a
client that invents paths cannot grow the series without bound), never a name or a user.
Long-running calls (watch, exec, logs) are counted but kept out of the duration histogram,
where their minutes would drown the latency of ordinary calls.
"""

from __future__ import annotations

from proxy.engine import telemetry
from proxy.engine.context import RequestContext

MAX_RESOURCES = 512
_VERBS = frozenset({"get", "list", "watch", "create", "update", "patch", "delete",
                    "deletecollection", "proxy", "head", "post", "put", "options"})


class Metrics:
    name = "metrics"
    needs_body = False
    fail_open = True

    def __init__(self) -> None:
        self._resources: set[tuple[str, str]] = set()
        self._counters: dict[tuple[str, str, str, int, str], object] = {}

    def _resource(self, group: str, resource: str) -> tuple[str, str]:
        pair = (group, resource)
        if pair in self._resources:
            return pair
        if len(self._resources) < MAX_RESOURCES:
            self._resources.add(pair)
            return pair
        return ("other", "other")

    async def exit(self, ctx: RequestContext) -> None:
        info = ctx.info
        verb = info.verb if info.verb in _VERBS else "other"
        if info.is_resource_request:
            group, resource = self._resource(info.api_group, info.resource)
        else:
            group, resource = "", ""
        key = (verb, group, resource, ctx.status_code, ctx.decision)
        counter = self._counters.get(key)
        if counter is None:
            counter = telemetry.REQUESTS.labels(verb, group, resource, str(ctx.status_code),
                                                ctx.decision)
            if len(self._counters) < 8 * MAX_RESOURCES:
                self._counters[key] = counter
        counter.inc()  # type: ignore[attr-defined]
        if not info.is_long_running:
            telemetry.REQUEST_DURATION.labels(verb).observe(ctx.duration)
