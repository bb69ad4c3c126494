"""Where a watch's events end: what lets opgate end a watch between two events, never inside one.

The apiserver writes a watch event in one piece, but through Go's chunked writer: when its
2,048-byte buffer fills, the rest of the event goes out as another chunk, a moment later. A
watch that opgate ends (at shutdown, or at its idle timeout) after the chunk in flight may so
end inside an event; client-go then reads a truncated one (an unexpected EOF). So for a watch
the relays follow the event boundaries of the body they have passed on, from its
``Content-Type`` (k8s.io/apimachinery's stream serializers), as cheaply as they can:

- JSON (``application/json``, with ``;stream=watch`` or not): one object per event, each
  followed by a newline; the body so far ends between two events when its last byte is ``\\n``.
- Protobuf (``application/vnd.kubernetes.protobuf;stream=watch``): the length-delimited framer,
  a 4-byte big-endian length, then that many bytes; between two events at a frame's end (a
  countdown of the current frame, across chunks and reads).
- CBOR (``application/cbor-seq``) and anything else: not followed (finding where a CBOR data
  item ends means walking all of it): such a watch ends between two chunks, as before.
"""

from __future__ import annotations

import struct

__all__ = ["EventEnds", "FrameEnds", "LineEnds", "event_ends"]


_LENGTH = struct.Struct(">I").unpack_from  # a protobuf frame's length


class EventEnds:
    """Follows the data of one watch body as it is passed on (:meth:`data` each piece, in
    order): ``between`` says whether what was passed so far ends between two events. This base
    follows nothing (always between: a body whose events are not followed). ``ending``: when
    opgate asked to end the watch inside an event, the loop time by which it gives up waiting
    for the event's end (0: not asked)."""

    __slots__ = ("between", "ending")

    def __init__(self) -> None:
        self.between = True
        self.ending = 0.0

    def data(self, buf: bytes | memoryview, start: int, end: int) -> None:
        """``buf[start:end]`` is the next piece of the body's data."""


class LineEnds(EventEnds):
    """JSON: an event ends with a newline."""

    __slots__ = ()

    def data(self, buf: bytes | memoryview, start: int, end: int) -> None:
        if end > start:
            self.between = buf[end - 1] == 10


class FrameEnds(EventEnds):
    """Protobuf: length-delimited frames (a 4-byte big-endian length, then the frame)."""

    __slots__ = ("_head", "_left")

    def __init__(self) -> None:
        super().__init__()
        self._left = 0  # bytes of the current frame still to come
        self._head = b""  # the part of a length seen so far (split by a piece's end)

    def data(self, buf: bytes | memoryview, start: int, end: int) -> None:
        left = self._left
        if left >= end - start:  # (the usual case: a frame goes on past this piece)
            self._left = left - (end - start)
            self.between = not self._left and not self._head
            return
        pos = start + left
        head = self._head
        while pos < end:
            if head:  # the rest of a length split by the previous piece's end
                need = 4 - len(head)
                if end - pos < need:
                    head += bytes(buf[pos:end])
                    break
                pos += need + _LENGTH(head + bytes(buf[pos:pos + need]))[0]
                head = b""
            elif end - pos < 4:  # a length split by this piece's end
                head = bytes(buf[pos:end])
                break
            else:
                pos += 4 + _LENGTH(buf, pos)[0]
        self._left = pos - end if pos > end else 0  # (the rest of the last frame)
        self._head = head
        self.between = not self._left and not head


def event_ends(content_type: str | bytes) -> EventEnds | None:
    """A follower for a watch body of this ``Content-Type``; ``None`` when its events are not
    followed (CBOR, or a type no watch serializer writes)."""
    if isinstance(content_type, bytes):
        content_type = content_type.decode("latin-1")
    media = content_type.partition(";")[0].strip().lower()
    if media == "application/json":
        return LineEnds()
    if media == "application/vnd.kubernetes.protobuf":
        return FrameEnds()
    return None
