"""The structured access log: one JSON line per API call, written when it ends.

Fields: time, trace id, verb, group/resource, namespace/name, code, decision, duration, bytes in
and out, the custom-resource instance the controller named (``Opgate-Instance``), and the user
when a middleware verified one. Never a token nor any other header value. Each line is one line
to any reader: JSON escapes CR and LF, and ``_esc`` the other line breaks.

This runs on every call, so it is built for the hot path: the line is assembled from strings
escaped by the C JSON encoder (no dict, no ``json.dumps``), the fields that depend only on the
call's RequestInfo are escaped once per info (the user's once per user name), the time prefix is
formatted once per second, the line is one f-string, and an :class:`AccessWriter` batches lines
into one ``write`` every few milliseconds under load instead of a flushed write per call.
Without a writer, lines go to the ``opgate.access`` logger.
"""

from __future__ import annotations

import asyncio
import json.encoder
import logging
import select
import time
from collections.abc import Callable, Iterator
from typing import IO

from proxy.engine.context import RequestContext
from proxy.engine.requestinfo import RequestInfo

log = logging.getLogger("opgate.access")

_encode = json.encoder.encode_basestring  # the C encoder: quotes and escapes one string
# line breaks JSON leaves as they are, where a reader that splits lines as Python does
# (str.splitlines) would start a line of the request's choosing; Go's encoding/json (the
# apiserver's audit log) escapes U+2028 and U+2029 too
_BREAKS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def _esc(text: str) -> str:
    """``text`` as a JSON string (``_encode``) with ``_BREAKS`` escaped: an ASCII one (most)
    costs one more flag test."""
    quoted = _encode(text)
    return quoted if quoted.isascii() else quoted.translate(_BREAKS)

FLUSH_SECONDS = 0.05
SPARSE_SECONDS = 0.005  # a line after this long without one is not held (AccessWriter)
FLUSH_BYTES = 64 * 1024
PIPE_BUF = select.PIPE_BUF  # the longest write to a pipe the kernel never interleaves (4096)
MEMO_SIZE = 4096  # calls (RequestInfo) whose escaped fields are remembered
# the end of the timestamp, per millisecond, and the text up to the trace id's value
_MILLIS = tuple(f'.{ms:03d}Z","trace":"' for ms in range(1000))
# 0-999 as text: a status code or a zero bytes_in (most calls send no body) is looked up, not
# formatted (formatting an int in an f-string costs ~600 instructions); both are never negative
_NUMBERS = tuple(str(n) for n in range(1000))


def duration_ms(seconds: float) -> str:
    """``str(round(seconds * 1000, 3))`` at a third of the cost: the same correctly rounded
    digits, trailing zeros dropped down to one decimal (durations never reach 1e16 ms, where
    ``str`` would switch to an exponent)."""
    text = ("%.3f" % (seconds * 1000)).rstrip("0")
    return text + "0" if text[-1] == "." else text


class AccessWriter:
    """Batches access-log lines and writes them with one call per batch.

    While lines come often (less than ``SPARSE_SECONDS`` apart) a batch goes out when it
    reaches ``FLUSH_BYTES`` or ``FLUSH_SECONDS`` after its first line, so a line is never held
    longer than that. With ``prompt``, a line that comes after a quiet spell goes out at the
    end of the event loop's current turn instead, with whatever other lines that turn wrote: at
    an operator's usual few calls a second, a timer per batch would wake the loop once more per
    call, which costs more than the write it saves. A stream whose every write wakes a thread
    (the audit log's :class:`~proxy.middlewares.audit_stream.QueuedStream`) is better batched
    by time however quiet it is: ``prompt=False``. All is written at :meth:`close`.

    A stream other processes write too (``shared``: the stdout of the workers of ``--workers N``,
    a pipe in a container) gets a batch in writes of whole lines of at most ``PIPE_BUF`` bytes
    each (a longer line alone): once the pipe is full the kernel lets another process's write
    into a longer write, cutting a line in two. A stream of one process's own takes a batch in
    one write.
    """

    def __init__(
        self, stream: IO[str], *, prompt: bool = True, shared: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._prompt = prompt
        self._shared = shared
        self._encoding = getattr(stream, "encoding", None) or "utf-8"
        self._stream = stream
        self._clock = clock
        self._lines: list[str] = []
        self._size = 0
        self._timer: asyncio.Handle | None = None  # the pending flush: a timer or a call_soon
        self._last = float("-inf")  # the clock's time of the line before

    def write(self, line: str) -> None:
        self._lines.append(line)
        self._size += len(line)
        now = self._clock()
        quiet = self._prompt and now - self._last >= SPARSE_SECONDS
        self._last = now
        if self._size >= FLUSH_BYTES:
            self.flush()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._timer = (loop.call_soon(self.flush) if quiet
                           else loop.call_later(FLUSH_SECONDS, self.flush))

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._lines:
            return
        lines, self._lines = self._lines, []
        self._size = 0
        try:
            for data in self._pieces(lines) if self._shared else ("".join(lines),):
                self._stream.write(data)
                self._stream.flush()
        except (OSError, ValueError):  # stdout closed: the call itself must not fail
            pass

    def _pieces(self, lines: list[str]) -> Iterator[str]:
        """``lines`` joined into pieces of at most ``PIPE_BUF`` bytes as the stream encodes
        them (an ASCII line, most, is as long as its text), a longer line a piece alone."""
        piece: list[str] = []
        size = 0
        for line in lines:
            length = len(line) if line.isascii() else len(
                line.encode(self._encoding, "backslashreplace"))
            if size + length > PIPE_BUF and piece:
                yield "".join(piece)
                piece, size = [], 0
            piece.append(line)
            size += length
        if piece:
            yield "".join(piece)

    def close(self) -> None:
        self.flush()


class AccessLog:
    name = "accesslog"
    needs_body = False
    fail_open = True

    def __init__(self, *, writer: AccessWriter | None = None) -> None:
        self._writer = writer
        # the line's start up to the milliseconds, for the second from _second_start to
        # _second_next (a time is in it when it lies between them: no int() call per line)
        self._head = ""
        self._second_start = self._second_next = float("nan")
        # per RequestInfo (kept alive here, so its id stays its own): the text from after the
        # trace id to the code's value (with the escaped verb), and the fields that only depend
        # on it; infos are shared by equal calls (parse_request_info)
        self._parts: dict[int, tuple[RequestInfo, str, str]] = {}
        # per decision: its escaped field, and the text up to the duration's value
        self._decisions: dict[str, str] = {}
        self._users: dict[str, str] = {}  # user name: its escaped field

    def _info_parts(self, info: RequestInfo) -> tuple[RequestInfo, str, str]:
        """``(info, the verb field, the resource/path fields)`` of a call, remembered per
        info (the verb's text starts after the trace id and ends before the code's value)."""
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
        hit = self._parts[id(info)] = (info, f'","verb":{_esc(info.verb)},"code":', fields)
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
            decision = self._decisions[ctx.decision] = (
                f',"decision":{_esc(ctx.decision)},"duration_ms":')
        wall = ctx.wall_time
        if self._second_start <= wall < self._second_next:
            millis = _MILLIS[int((wall - self._second_start) * 1000)]
        else:
            millis = self._new_second(wall)
        ms = duration_ms((ctx.finished or time.monotonic()) - ctx.started)  # ctx.duration
        tail = ""  # the optional fields (short strings: concatenating them copies little)
        instance = ctx.headers.get("opgate-instance")
        if instance:
            tail = ',"instance":' + _esc(instance[:256])
        if ctx.identity is not None:
            user = ctx.identity.user
            tail += self._users.get(user) or self._user(user)  # a hit without _user's call
        if ctx.error:
            tail += ',"error":' + _esc(ctx.error)
        code, bytes_in = ctx.status_code, ctx.bytes_in
        # the constant texts between the values are in the remembered pieces (fewer pieces
        # for the f-string to join)
        return (f'{self._head}{millis}{ctx.trace_id}{parts[1]}'
                f'{_NUMBERS[code] if code < 1000 else code}{decision}{ms}'
                f',"bytes_in":{_NUMBERS[bytes_in] if bytes_in < 1000 else bytes_in}'
                f',"bytes_out":{ctx.bytes_out}{parts[2]}{tail}}}\n')

    def _new_second(self, wall: float) -> str:
        """The milliseconds piece of ``wall`` (see ``_MILLIS``) after the line's head is made
        that of ``wall``'s second (formatted once per second)."""
        second = int(wall)
        self._head = '{"time":"' + time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        # before 1970 int() rounds up, toward zero: such times stay out of the bounds
        self._second_start, self._second_next = float(second), float(second + 1)
        return _MILLIS[int((wall - second) * 1000)]

    def exit(self, ctx: RequestContext) -> None:
        if self._writer is not None:
            self._writer.write(self._line(ctx))
        elif log.isEnabledFor(logging.INFO):
            log.info(self.line(ctx))
