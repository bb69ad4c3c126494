"""The structured access log: one JSON line per API call, written when it ends.

Fields: time, trace id, verb, group/resource, namespace/name, code, decision, duration, bytes in
and out, the custom-resource instance the controller named (``Opgate-Instance``), and the user
when a middleware verified one. Never a token nor any other header value.
"""

from __future__ import annotations

import json
import logging
import time

from proxy.engine.context import RequestContext

log = logging.getLogger("opgate.access")


class AccessLog:
    name = "accesslog"
    needs_body = False
    fail_open = True

    async def exit(self, ctx: RequestContext) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        info = ctx.info
        entry: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ctx.wall_time))
            + f".{int(ctx.wall_time % 1 * 1000):03d}Z",
            "trace": ctx.trace_id,
            "verb": info.verb,
            "code": ctx.status_code,
            "decision": ctx.decision,
            "duration_ms": round(ctx.duration * 1000, 3),
            "bytes_in": ctx.bytes_in,
            "bytes_out": ctx.bytes_out,
        }
        if info.is_resource_request:
            entry["resource"] = f"{info.resource}.{info.api_group}" if info.api_group \
                else info.resource
            if info.subresource:
                entry["subresource"] = info.subresource
            if info.namespace:
                entry["namespace"] = info.namespace
            if info.name:
                entry["name"] = info.name
        else:
            entry["path"] = info.path
        instance = ctx.headers.get("opgate-instance")
        if instance:
            entry["instance"] = instance[:256]
        if ctx.identity is not None:
            entry["user"] = ctx.identity.user
        if ctx.error:
            entry["error"] = ctx.error
        log.info(json.dumps(entry, separators=(",", ":")))
