"""Where a chunked body ends, read from its raw bytes: what lets the fast relay pass an
upstream's chunked body to an HTTP/1.1 client as it came, framing and all.

A kube-apiserver sends every LIST and watch chunked (a 2,048-byte chunk, then the rest of each
object, for JSON and protobuf alike). Through the parser each chunk was a callback, a framing of
its own and a client write; passed through, a whole read is one client write, and all the relay
still has to know is where the body ends: that is what :class:`ChunkedFraming` works out, by
reading only the framing (chunk-size lines, the CRLF after each chunk's data, the trailer
section) and skipping the data. A watch's data is shown, piece by piece, to its
:class:`~proxy.relay.events.EventEnds` (which looks at a piece's last byte, or at a protobuf
frame's length), so that opgate can end it between two events.

It is as strict as the parser it stands in for (llhttp): CRLF line ends, a chunk size of hex
digits (extensions after ``;`` allowed), a CRLF after each chunk's data, bounded size lines and
trailers; anything else raises :class:`FramingError`, and the relay then ends the call as it
does on a parse error (the connection closed, the client's response cut short).
"""

from __future__ import annotations

from proxy.relay.events import EventEnds

__all__ = ["ChunkedFraming", "FramingError"]

MAX_SIZE_LINE = 4096  # a chunk-size line with its extensions
MAX_TRAILERS = 64 * 1024  # the whole trailer section
_HEX = b"0123456789abcdefABCDEF"
_CRLF = b"\r\n"
_LAST = b"0\r\n\r\n"


class FramingError(ValueError):
    """The upstream's chunked framing is malformed."""


class ChunkedFraming:
    """Follows one chunked body through the reads it arrives in (:meth:`feed` each of them in
    order), counting its data bytes (``body``), and shows each piece of data to ``events`` (a
    watch's: where its events end) when there is one."""

    __slots__ = ("_carry", "_first", "_skip", "_trailers", "body", "ended", "events", "stop")

    def __init__(self, events: EventEnds | None = None) -> None:
        self.events = events
        self._skip = 0  # data bytes of the current chunk still to come
        self._carry = b""  # framing split by the end of a read: parsed again with the next one
        self._first = True  # no chunk yet: no CRLF before the next size line
        self._trailers = False  # after the last chunk: trailer lines until an empty one
        self.body = 0  # data bytes seen
        self.ended = False
        # a watch asked to end inside an event (``events.ending``): the offset in the read
        # just past the chunk that ended that event, when more followed it in the same read
        # (the watch ends there; the rest is never read); -1: not stopped
        self.stop = -1

    def feed(self, data: bytes) -> int:
        """The offset in ``data`` just past the body's end, or -1 when the body goes on past
        ``data`` (or :attr:`stop` was set: nothing after it is looked at). Raises
        :class:`FramingError` on malformed framing."""
        if self.stop >= 0:
            return -1
        carry = self._carry
        if carry:
            buf = carry + data
            self._carry = b""
        else:
            buf = data
        base = len(buf) - len(data)  # where data starts in buf
        n = len(buf)
        pos = 0
        events = self.events
        skip = self._skip
        if skip:  # the rest of a chunk's data (never with a carry: that is framing)
            if skip >= n:
                self._skip = skip - n
                self.body += n
                if events is not None:
                    events.data(buf, 0, n)
                return -1
            self._skip = 0
            self.body += skip
            pos = skip
            if events is not None:
                events.data(buf, 0, pos)
                if events.ending and events.between:
                    self.stop = pos
                    return -1
        while True:
            start = pos  # framing from here: what is carried when a read ends in it
            if self._trailers:
                eol = buf.find(_CRLF, pos)
                lf = buf.find(b"\n", pos)
                if lf >= 0 and (eol < 0 or lf != eol + 1):
                    raise FramingError("trailer line without CR")
                if eol < 0:
                    break
                if eol == pos:  # the empty line: the body's end
                    self.ended = True
                    return eol + 2 - base
                pos = eol + 2
                continue
            if not self._first:  # the CRLF that ends the previous chunk's data
                if n - pos < 2:
                    if buf[pos:] != _CRLF[: n - pos]:
                        raise FramingError("no CRLF after a chunk's data")
                    break
                if buf[pos] != 13 or buf[pos + 1] != 10:
                    raise FramingError("no CRLF after a chunk's data")
                pos += 2
            eol = buf.find(_CRLF, pos)
            if eol < 0:
                if n - pos > MAX_SIZE_LINE:
                    raise FramingError("chunk-size line too long")
                if buf.find(b"\n", pos) >= 0:
                    raise FramingError("chunk-size line without CR")
                break
            size = _size(buf[pos:eol])
            pos = eol + 2
            self._first = False
            if not size:
                self._trailers = True
                continue
            if n - pos <= size:  # the data reaches the end of this read (or beyond)
                self._skip = size - (n - pos)
                self.body += n - pos
                if events is not None:
                    events.data(buf, pos, n)
                return -1
            self.body += size
            if events is not None:
                events.data(buf, pos, pos + size)
                if events.ending and events.between:  # (right after the data: no carry)
                    self.stop = pos + size - base
                    return -1
            pos += size
        carried = buf[start:]
        if self._trailers and len(carried) > MAX_TRAILERS:
            raise FramingError("trailer section too long")
        self._carry = carried
        return -1

    def closing(self) -> bytes | None:
        """The bytes that end the body cleanly after what was fed so far (a watch ended by
        opgate's idle timeout), or ``None`` when it stopped inside a chunk or its framing."""
        if self._skip or self._trailers:
            return None
        if self._first:
            return None if self._carry else _LAST
        if not self._carry:  # right after a chunk's data
            return _CRLF + _LAST
        return _LAST if self._carry == _CRLF else None


def _size(line: bytes) -> int:
    """A chunk-size line's size (hex digits, then optional ``;`` extensions; no whitespace
    before them, as llhttp wants)."""
    semi = line.find(b";")
    if semi >= 0:
        if b"\n" in line:
            raise FramingError("chunk extension with a line feed")
        line = line[:semi]
    if not line or len(line) > 16 or line.strip(_HEX):
        raise FramingError(f"malformed chunk size {line[:32]!r}")
    return int(line, 16)
