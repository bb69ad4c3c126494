"""The capture file: captured calls as mitmproxy flows, written off the event loop.

``opgate serve --capture FILE`` writes one mitmproxy ``HTTPFlow`` per captured call
(:mod:`proxy.middlewares.capture` selects and taps them), so ``mitmproxy -r FILE``,
``mitmweb -r FILE`` and ``mitmdump -r FILE`` show what the controller sent and what the
apiserver (or opgate itself) answered. The flows are built and written with mitmproxy's own
classes (``mitmproxy.http``, ``mitmproxy.io.FlowWriter``), imported when capture is on: a
missing mitmproxy is an error at start-up (:func:`load_mitmproxy`), not at the first call.

:class:`FlowFile` never blocks a call: ``write`` (on the event loop) appends the plain
:class:`~proxy.middlewares.capture.CapturedCall` to a queue bounded by ``max_pending`` bytes of
bodies; past it the call is dropped whole and counted in
``opgate_capture_flows_total{result="dropped"}`` (a call larger than the whole bound goes in
when the queue is empty). A writer thread turns each call into a flow
(redacting tokens: :mod:`proxy.engine.redact`), encodes it and appends it to the file, created
0600 and rotated by size as the audit log is (``capture-2026-11-30T05-30-00.123.flows`` next to
it; each file is a complete flow file on its own: one an earlier opgate left ending inside a
flow, killed while writing it, is moved aside at start rather than appended to).

What a flow holds: the request as the client sent it (method, path and query, headers, the body
up to the rule's ``maxBodyBytes``), the response (the apiserver's status, headers and body up
to the bound; a watch's events up to the bound) or opgate's own Status, timestamps, an error
when the call broke, a one-line ``comment`` (mitmweb shows it) when opgate answered itself or a
body was cut (a cut gzip response is kept decoded as far as it goes, 64 MiB at most), and
``metadata["opgate"]``: trace id, verb, decision, user, rule, sizes, what was truncated or left
out.
"""

from __future__ import annotations

import io
import logging
import os
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote, urlsplit

from proxy.engine import telemetry
from proxy.engine.jsonbody import dumps, loads
from proxy.engine.logfile import BackgroundWriter, RotatingFile
from proxy.engine.redact import carries_token, redact_header, redact_object, redact_query
from proxy.middlewares.capture import CapturedCall

__all__ = ["MAX_PENDING_BYTES", "FlowFile", "MitmproxyMissing", "load_mitmproxy", "to_flow"]

log = logging.getLogger("opgate.capture")

MAX_PENDING_BYTES = 32 * 1024 * 1024  # bodies of calls waiting for the writer thread, at most
OVERHEAD = 2048  # what a call counts in the queue beyond its bodies
MAX_DECODED = 64 * 1024 * 1024  # a cut gzip response's decoded start, at most
_PATH_SAFE = "/:@!$&'()*+,;=-._~%"
_LENGTH_DIGITS = 12  # a flow's tnetstring length has at most this many (mitmproxy's reader's)


class MitmproxyMissing(RuntimeError):
    """``--capture`` needs mitmproxy, which is not installed."""


def load_mitmproxy() -> Any:
    """Import what writing flows needs; :class:`MitmproxyMissing` with what to do otherwise."""
    try:
        from mitmproxy import connection, http
        from mitmproxy import flow as mflow
        from mitmproxy import io as mio
    except ImportError as exc:
        raise MitmproxyMissing(
            f"--capture needs mitmproxy, which cannot be imported ({exc}); install it with "
            "`pip install 'opgate[capture]'` (or `pip install 'mitmproxy>=11'`)") from exc
    return connection, http, mio, mflow


def _raw(text: bytes | str) -> bytes:
    return text if isinstance(text, bytes) else text.encode("utf-8", "surrogateescape")


def _text(raw: bytes | str) -> str:
    return raw if isinstance(raw, str) else raw.decode("latin-1")


def _headers(pairs: list[tuple[Any, Any]]) -> tuple[tuple[bytes, bytes], ...]:
    out = []
    for name, value in pairs:
        text = _text(value)
        safe = redact_header(_text(name), text)
        out.append((_raw(name), _raw(value) if safe is text else safe.encode("latin-1")))
    return tuple(out)


def _redact_body(call: CapturedCall, body: bytes | None, notes: dict[str, Any],
                 which: str) -> bytes | None:
    """A body of a token-bearing resource with its token replaced, or left out when it cannot
    be read as JSON (cut short, protobuf): a token never reaches the file."""
    if not body or not carries_token(call.api_group, call.resource, call.subresource):
        return body
    try:
        obj = loads(body)
    except ValueError:
        notes[f"{which}_body_omitted"] = "may hold a token and is not complete JSON"
        return b""
    return dumps(redact_object(obj, call.api_group, call.resource, call.subresource)).encode()


def _decode_cut(call: CapturedCall, headers: tuple[tuple[bytes, bytes], ...],
                notes: dict[str, Any]) -> tuple[bytes | None, tuple[tuple[bytes, bytes], ...]]:
    """A gzip response body cut by the bound, decoded as far as it goes, and the headers
    without its ``Content-Encoding``: mitmproxy cannot decode a cut gzip stream and would show
    the compressed bytes (client-go asks for gzip; the apiserver sends it past 128 KiB)."""
    body = call.response_body
    if not body or not call.response_truncated:
        return body, headers
    encoding = [value for name, value in headers if name.lower() == b"content-encoding"]
    if [value.strip().lower() for value in encoding] != [b"gzip"]:
        return body, headers
    try:  # at most 64 times what was kept (JSON compresses ~50:1, a bomb stops here) and
        # MAX_DECODED: 64 times a rule's largest bound would be gigabytes held for one flow
        decoded = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(
            body, min(64 * len(body), MAX_DECODED))
    except zlib.error:
        return body, headers
    if not decoded:  # cut inside the gzip header: nothing to show either way
        return body, headers
    notes["response_decoded"] = (f"gzip, cut: the {len(body)} compressed bytes kept decode to "
                                 f"{len(decoded)} bytes (Content-Encoding removed)")
    return decoded, tuple(pair for pair in headers if pair[0].lower() != b"content-encoding")


def to_flow(call: CapturedCall, *, upstream: str, mitm: Any = None) -> Any:
    """The mitmproxy ``HTTPFlow`` of one captured call (redacted)."""
    connection, http, _, mflow = mitm or load_mitmproxy()
    parts = urlsplit(upstream)
    scheme = parts.scheme or "https"
    host = parts.hostname or "kubernetes"
    port = parts.port or (443 if scheme == "https" else 80)
    notes: dict[str, Any] = {}
    target = call.raw_path or quote(call.path, safe=_PATH_SAFE)  # as the client sent it
    if call.query:
        target += "?" + redact_query(call.query)
    client = connection.Client(peername=(call.remote, 0), sockname=("", 0),
                               timestamp_start=call.started)
    client.timestamp_end = call.finished
    server = connection.Server(address=(host, port))
    flow = http.HTTPFlow(client, server)
    flow.timestamp_created = call.started
    request_body = _redact_body(call, call.request_body, notes, "request")
    flow.request = http.Request(
        host=host, port=port, method=call.method.encode("ascii", "replace"),
        scheme=scheme.encode(), authority=b"", path=target.encode("ascii", "replace"),
        http_version=b"HTTP/1.1", headers=_headers(call.request_headers),
        content=request_body, trailers=None, timestamp_start=call.started,
        timestamp_end=max(call.request_done, call.started))
    if call.status:
        response_body, response_headers = _decode_cut(call, _headers(call.response_headers),
                                                      notes)
        response_body = _redact_body(call, response_body, notes, "response")
        reason = call.reason if isinstance(call.reason, bytes) else call.reason.encode(
            "latin-1", "replace")
        flow.response = http.Response(
            http_version=b"HTTP/1.1", status_code=call.status, reason=reason,
            headers=response_headers, content=response_body, trailers=None,
            timestamp_start=call.response_started or call.finished,
            timestamp_end=max(call.finished, call.response_started))
    if call.error:
        flow.error = mflow.Error(call.error, call.finished)
    meta: dict[str, Any] = {
        "trace_id": call.trace_id, "verb": call.verb, "decision": call.decision,
        "rule": call.rule, "request_bytes": call.request_size,
        "response_bytes": call.response_size,
    }
    if call.user:
        meta["user"] = call.user
    comments = []
    if call.answered:
        meta["answered_by"] = "opgate"
        meta["reason"] = call.answer_message
        comments.append(f"opgate answered itself ({call.decision}): {call.answer_message}")
    if call.error:
        meta["error"] = call.error
    if call.omit:
        meta["bodies_omitted"] = call.omit
        comments.append(f"bodies left out: {call.omit}")
    elif call.request_body is None and call.request_size:
        meta["request_body"] = "not captured (answered before the body was read)"
    for which, cut in (("request", call.request_truncated), ("response", call.response_truncated)):
        if cut and not call.omit:
            body = call.request_body if which == "request" else call.response_body
            kept = len(body or b"")
            total = call.request_size if which == "request" else call.response_size
            meta[f"{which}_truncated"] = True
            comments.append(f"{which} body truncated: {kept} of {total} bytes captured")
    meta.update(notes)
    flow.metadata["opgate"] = meta
    if comments:
        flow.comment = "; ".join(comments)
    return flow


def ends_with_a_whole_flow(path: str) -> bool:
    """Whether the flow file ``path`` (absent or empty: yes) ends where a flow ends. Each flow
    is a tnetstring, ``<length>:<payload>}``: the file is walked by those lengths, a few bytes
    read per flow whatever its size. An opgate killed while writing one (OOM-killed) leaves
    half of it, and mitmproxy stops reading at a broken flow: nothing appended after it could
    be read."""
    try:
        f = open(path, "rb")
    except OSError:
        return True  # absent, or unreadable: opening it to write says what is wrong
    with f:
        size = os.fstat(f.fileno()).st_size
        at = 0
        while at < size:
            f.seek(at)
            length, colon, _ = f.read(_LENGTH_DIGITS + 1).partition(b":")
            if not colon or not length.isdigit():
                return False
            end = at + len(length) + 1 + int(length)
            f.seek(end)
            if end >= size or f.read(1) != b"}":
                return False
            at = end + 1
    return True


class FlowFile:
    """Captured calls to a mitmproxy flow file (module docstring). ``write`` never blocks."""

    def __init__(self, path: str, *, upstream: str, max_bytes: int = 0, max_backups: int = 0,
                 max_pending: int = MAX_PENDING_BYTES,
                 now: Callable[[], float] = time.time) -> None:
        self._mitm = load_mitmproxy()
        self.path = path
        self._upstream = upstream
        self._max_pending = max_pending
        whole = ends_with_a_whole_flow(path)
        self._target = RotatingFile(path, max_bytes=max_bytes, max_backups=max_backups, now=now)
        if not whole:  # its whole flows stay readable in the backup; new ones in a new file
            self._target.rotate()
            log.warning("the capture file %s ends inside a flow (an earlier opgate stopped "
                        "while writing it): moved to %s, new flows go to a new file", path,
                        self._target.backups()[-1])
        self._written = telemetry.CAPTURE_FLOWS.labels("written")
        dropped = telemetry.CAPTURE_FLOWS.labels("dropped")
        self._failed = telemetry.CAPTURE_FLOWS.labels("failed")
        self._writer: BackgroundWriter[CapturedCall] = BackgroundWriter(
            self._write_batch, name="opgate-capture-writer", max_pending=max_pending,
            dropped=lambda _call: dropped.inc())

    def write(self, call: CapturedCall) -> None:
        size = OVERHEAD + len(call.request_body or b"") + len(call.response_body or b"")
        # a flow larger than the whole queue (a rule keeps up to 64 MiB per body) counts as
        # the whole queue: it goes in when nothing else waits, instead of never
        self._writer.put(call, min(size, self._max_pending))

    def encode(self, call: CapturedCall) -> bytes:
        """One flow in the file format (``FlowWriter``: a tnetstring of its state)."""
        buf = io.BytesIO()
        self._mitm[2].FlowWriter(buf).add(to_flow(call, upstream=self._upstream,
                                                  mitm=self._mitm))
        return buf.getvalue()

    def _write_batch(self, batch: Sequence[CapturedCall]) -> None:
        written = failed = 0
        for call in batch:
            try:  # a flow is written whole (rotating first if needed): never split
                self._target.write_bytes(self.encode(call))
                written += 1
            except Exception as exc:  # a disk error, or a flow mitmproxy refuses
                failed += 1
                self._writer.complain("cannot write to the capture file %s: %s (flows dropped)",
                                      self.path, exc)
        try:
            self._target.flush()
        except OSError as exc:
            self._writer.complain("cannot flush the capture file %s: %s", self.path, exc)
        if written:
            self._written.inc(written)
        if failed:
            self._failed.inc(failed)

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (``timeout`` at most), then close the file."""
        if self._writer.close(timeout):
            self._target.close()
