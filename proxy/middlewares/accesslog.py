"""The structured access log: one JSON line per API call, written when it ends.

Fields: time, trace id, verb, group/resource, namespace/name, code, decision, duration, bytes in
and out, the custom-resource instance the controller named (``Opgate-Instance``), and the user
when a middleware verified one. Never a token nor any other header value.

This runs on every call, so it is built for the hot path: the line is assembled from strings
escaped by the C JSON encoder (no dict, no ``json.dumps``), the fields that depend only on the
call's RequestInfo are escaped once per info (the user's once per user name), the time prefix is
formatted once per second, the line is one f-string, and an :class:`AccessWriter` batches lines
into one ``write`` every few milliseconds instead of a flushed write per call. Without a writer,
lines go to the ``opgate.access`` logger.
"""

from __future__ import annotations

import asyncio
import json.encoder
import logging
import time
from typing import IO

from proxy.engine.context import RequestContext
from proxy.engine.requestinfo import RequestInfo

log = logging.getLogger("opgate.access")

_esc = json.encoder.encode_basestring  # the C encoder: quotes and escapes one string
FLUSH_SECONDS = 0.05
FLUSH_BYTES = 64 * 1024
MEMO_SIZE = 4096  # calls (RequestInfo) whose escaped fields are remembered
_MILLIS = tuple(f".{ms:03d}Z" for ms in range(1000))  # the end of a timestamp, per millisecond


def duration_ms(seconds: float) -> str:
    """``str(round(seconds * 1000, 3))`` at a third of the cost: the same correctly rounded
    digits, trailing zeros dropped down to one decimal (durations never reach 1e16 ms, where
    ``str`` would switch to an exponent)."""
    text = ("%.3f" % (seconds * 1000)).rstrip("0")
    return text + "0" if text[-1] == "." else text


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
        # per RequestInfo (kept alive here, so its id stays its own): the escaped verb and the
        # fields that only depend on it; infos are shared by equal calls (parse_request_info)
        self._parts: dict[int, tuple[RequestInfo, str, str]] = {}
        self._decisions: dict[str, str] = {}
        self._users: dict[str, str] = {}  # user name: its escaped field

    def _info_parts(self, info: RequestInfo) -> tuple[RequestInfo, str, str]:
        """``(info, escaped verb, the resource/path fields)`` of a call, remembered per info."""
        hit = self._parts.get(id(info))
        if hit is not None and hit[0] is info:
            return hit
        if info.is_resource_request:
            resource = f"{info.resource}.{info.api_group}" if info.api_group else info.resource
            fields = ',"resource":' + _esc(resource)
            if info.subresource:
                fields += ',"subresource":' + _esc(info.subresource)
            if info.namespace:
                fields += ',"namespace":' + _esc(info.namespace)
            if info.name:
                fields += ',"name":' + _esc(info.name)
        else:
            fields = ',"path":' + _esc(info.path)
        if len(self._parts) >= MEMO_SIZE:
            self._parts.clear()
        hit = self._parts[id(info)] = (info, _esc(info.verb), fields)
        return hit

    def _user(self, user: str) -> str:
        """``,"user":"<escaped>"``, remembered per user name in ``_users`` (a verified
        identity's own string, so looking it up hashes nothing: a str caches its hash)."""
        if len(self._users) >= MEMO_SIZE:
            self._users.clear()
        field = self._users[user] = ',"user":' + _esc(user)
        return field

    def line(self, ctx: RequestContext) -> str:
        return self._line(ctx)[:-1]

    def _line(self, ctx: RequestContext) -> str:
        """The line and its newline, built by one f-string (one copy of the text; each
        ``+`` of the former build copied the line so far)."""
        info = ctx.info
        parts = self._parts.get(id(info))  # _info_parts' hit, without its call
        if parts is None or parts[0] is not info:
            parts = self._info_parts(info)
        decision = self._decisions.get(ctx.decision)
        if decision is None:
            decision = self._decisions[ctx.decision] = _esc(ctx.decision)
        wall = ctx.wall_time  # _time, inlined: the prefix changes once a second
        second = int(wall)
        if second != self._second:
            self._second = second
            self._prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        # duration_ms(ctx.duration), inlined: a Python call less (~250 instructions)
        ms = ("%.3f" % (((ctx.finished or time.monotonic()) - ctx.started) * 1000)).rstrip("0")
        if ms[-1] == ".":
            ms += "0"
        tail = ""  # the optional fields (short strings: concatenating them copies little)
        instance = ctx.headers.get("opgate-instance")
        if instance:
            tail = ',"instance":' + _esc(instance[:256])
        if ctx.identity is not None:
            user = ctx.identity.user
            tail += self._users.get(user) or self._user(user)  # a hit without _user's call
        if ctx.error:
            tail += ',"error":' + _esc(ctx.error)
        return (f'{{"time":"{self._prefix}{_MILLIS[int((wall - second) * 1000)]}"'
                f',"trace":"{ctx.trace_id}","verb":{parts[1]}'
                f',"code":{ctx.status_code},"decision":{decision}'
                f',"duration_ms":{ms}'
                f',"bytes_in":{ctx.bytes_in},"bytes_out":{ctx.bytes_out}{parts[2]}{tail}}}\n')

    def exit(self, ctx: RequestContext) -> None:
        if self._writer is not None:
            self._writer.write(self._line(ctx))
        elif log.isEnabledFor(logging.INFO):
            log.info(self.line(ctx))
