"""Prometheus metrics for every API call, recorded once the response is done.

Labels stay bounded: the verb comes from a fixed set, group/resource from what the apiserver
actually serves: a pair becomes a label value once the apiserver answered a call to it with a
success (a path a client invents gets 404, or 403 from RBAC, which checks before routing, or an
answer of opgate's own), before that it is ``other``; and past ``MAX_RESOURCES`` distinct pairs
new ones stay ``other``. Never a name or a user.
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

    def _resource(self, group: str, resource: str, served: bool) -> tuple[str, str]:
        pair = (group, resource)
        if pair in self._resources:
            return pair
        if served and len(self._resources) < MAX_RESOURCES:
            self._resources.add(pair)
            return pair
        return ("other", "other")

    def _lookup(self, ctx: RequestContext) -> tuple[tuple[Any, Any], bool]:
        """The request counter and duration histogram (``None``: long-running) of a call, and
        whether they hold for every call of its shape, code and decision (not while its
        resource is ``other`` only for want of a served call)."""
        info = ctx.info
        verb = info.verb if info.verb in _VERBS else "other"
        final = True
        if info.is_resource_request:
            served = ctx.answer is None and 0 < ctx.status_code < 400  # the apiserver's
            group, resource = self._resource(info.api_group, info.resource, served)
            final = group != "other" or len(self._resources) >= MAX_RESOURCES
        else:
            group, resource = "", ""
        counter = telemetry.REQUESTS.labels(verb, group, resource, str(ctx.status_code),
                                            ctx.decision)
        duration = None if info.is_long_running else telemetry.REQUEST_DURATION.labels(verb)
        return (counter, duration), final

    def exit(self, ctx: RequestContext) -> None:
        key = (ctx.info.shape, ctx.status_code, ctx.decision)
        series = self._series.get(key)
        if series is None:
            series, final = self._lookup(ctx)
            if final:
                if len(self._series) >= 8 * MAX_RESOURCES:
                    self._series.clear()
                self._series[key] = series
        counter, duration = series
        counter.inc()
        if duration is not None:
            duration.observe(ctx.duration)
