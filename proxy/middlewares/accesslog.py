"""The structured access log: one JSON line per API call, written when it ends.

Fields: time, trace id, verb, group/resource, namespace/name, code, decision, duration, bytes in
and out, the custom-resource instance the controller named (``Opgate-Instance``), and the user
when a middleware verified one. Never a token nor any other header value.

This runs on every call, so it is built for the hot path: the line is assembled from strings
escaped by the C JSON encoder (no dict, no ``json.dumps``), the time prefix is formatted once per
second, and an :class:`AccessWriter` batches lines into one ``write`` every few milliseconds
instead of a flushed write per call. Without a writer, lines go to the ``opgate.access`` logger.
"""

from __future__ import annotations

import asyncio
import json.encoder
import logging
import time
from typing import IO

from proxy.engine.context import RequestContext

log = logging.getLogger("opgate.access")

_esc = json.encoder.encode_basestring  # the C encoder: quotes and escapes one string
FLUSH_SECONDS = 0.05
FLUSH_BYTES = 64 * 1024


class AccessWriter:
    """Batches access-log lines and writes them with one call per batch.

    A batch goes out when it reaches ``FLUSH_BYTES`` or ``FLUSH_SECONDS`` after its first line
    (so a line is never held longer than that), and at :meth:`close`.
    """

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._lines: list[str] = []
        self._size = 0
        self._timer: asyncio.TimerHandle | None = None

    def write(self, line: str) -> None:
        self._lines.append(line)
        self._size += len(line)
        if self._size >= FLUSH_BYTES:
            self.flush()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._timer = loop.call_later(FLUSH_SECONDS, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._lines:
            return
        data = "".join(self._lines)
        self._lines.clear()
        self._size = 0
        try:
            self._stream.write(data)
            self._stream.flush()
        except (OSError, ValueError):  # stdout closed: the call itself must not fail
            pass

    def close(self) -> None:
        self.flush()


class AccessLog:
    name = "accesslog"
    needs_body = False
    fail_open = True

    def __init__(self, *, writer: AccessWriter | None = None) -> None:
        self._writer = writer
        self._second = -1
        self._prefix = ""

    def _time(self, wall: float) -> str:
        second = int(wall)
        if second != self._second:
            self._second = second
            self._prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._prefix}.{int((wall - second) * 1000):03d}Z"

    def line(self, ctx: RequestContext) -> str:
        info = ctx.info
        parts = [
            '{"time":"', self._time(ctx.wall_time), '","trace":"', ctx.trace_id,
            '","verb":', _esc(info.verb), ',"code":', str(ctx.status_code),
            ',"decision":', _esc(ctx.decision),
            ',"duration_ms":', str(round(ctx.duration * 1000, 3)),
            ',"bytes_in":', str(ctx.bytes_in), ',"bytes_out":', str(ctx.bytes_out),
        ]
        if info.is_resource_request:
            resource = f"{info.resource}.{info.api_group}" if info.api_group else info.resource
            parts += (',"resource":', _esc(resource))
            if info.subresource:
                parts += (',"subresource":', _esc(info.subresource))
            if info.namespace:
                parts += (',"namespace":', _esc(info.namespace))
            if info.name:
                parts += (',"name":', _esc(info.name))
        else:
            parts += (',"path":', _esc(info.path))
        instance = ctx.headers.get("opgate-instance")
        if instance:
            parts += (',"instance":', _esc(instance[:256]))
        if ctx.identity is not None:
            parts += (',"user":', _esc(ctx.identity.user))
        if ctx.error:
            parts += (',"error":', _esc(ctx.error))
        parts.append("}")
        return "".join(parts)

    async def exit(self, ctx: RequestContext) -> None:
        if self._writer is not None:
            self._writer.write(self.line(ctx) + "\n")
        elif log.isEnabledFor(logging.INFO):
            log.info(self.line(ctx))
