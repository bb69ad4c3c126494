"""Prometheus metrics for every API call, recorded once the response is done.

Labels stay bounded: the verb comes from a fixed set, group/resource from what clients actually
call (capped: past ``MAX_RESOURCES`` distinct pairs new ones are recorded as ``other``, so a
client that invents paths cannot grow the series without bound), never a name or a user.
Long-running calls (watch, exec, logs) are counted but kept out of the duration histogram,
where their minutes would drown the latency of ordinary calls. The series a call updates are
looked up once per (call shape, code, decision) and remembered.
"""

from __future__ import annotations

from typing import Any

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
        self._series: dict[tuple[object, int, str], tuple[Any, Any]] = {}

    def _resource(self, group: str, resource: str) -> tuple[str, str]:
        pair = (group, resource)
        if pair in self._resources:
            return pair
        if len(self._resources) < MAX_RESOURCES:
            self._resources.add(pair)
            return pair
        return ("other", "other")

    def _lookup(self, ctx: RequestContext) -> tuple[Any, Any]:
        """The request counter and duration histogram (``None``: long-running) of a call."""
        info = ctx.info
        verb = info.verb if info.verb in _VERBS else "other"
        if info.is_resource_request:
            group, resource = self._resource(info.api_group, info.resource)
        else:
            group, resource = "", ""
        counter = telemetry.REQUESTS.labels(verb, group, resource, str(ctx.status_code),
                                            ctx.decision)
        duration = None if info.is_long_running else telemetry.REQUEST_DURATION.labels(verb)
        return counter, duration

    def exit(self, ctx: RequestContext) -> None:
        key = (ctx.info.shape, ctx.status_code, ctx.decision)
        series = self._series.get(key)
        if series is None:
            series = self._lookup(ctx)
            if len(self._series) >= 8 * MAX_RESOURCES:
                self._series.clear()
            self._series[key] = series
        counter, duration = series
        counter.inc()
        if duration is not None:
            duration.observe(ctx.duration)
