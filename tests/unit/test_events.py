"""Where a watch's events end (proxy/relay/events.py): the same answer wherever the body is cut
into pieces, for JSON lines and protobuf frames, also when followed through the chunked framing
of a body passed through as it came (proxy/relay/fast/chunked.py)."""

from __future__ import annotations

import random

import pytest

from proxy.relay.events import EventEnds, FrameEnds, LineEnds, event_ends
from proxy.relay.fast.chunked import ChunkedFraming


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


JSON_EVENTS = [b'{"type":"ADDED","object":{"a":"x\\ny"}}\n', b"{}\n",
               b'{"b":' + b"1" * 3000 + b"}\n"]
PROTO_EVENTS = [frame(b"k8s\x00" + bytes(range(256)) * 3), frame(b""), frame(b"\n" * 10),
                frame(b"z" * 70000)]


def ends_of(events: list[bytes]) -> set[int]:
    """The offsets in the joined stream where an event ends (0: before the first)."""
    ends, at = {0}, 0
    for event in events:
        at += len(event)
        ends.add(at)
    return ends


@pytest.mark.parametrize(("kind", "events"), [(LineEnds, JSON_EVENTS), (FrameEnds, PROTO_EVENTS)],
                         ids=["json", "protobuf"])
@pytest.mark.parametrize("seed", range(20))
def test_between_events_wherever_the_pieces_end(
    kind: type[EventEnds], events: list[bytes], seed: int
) -> None:
    stream = b"".join(events)
    ends = ends_of(events)
    rng = random.Random(seed)
    follower = kind()
    at = 0
    while at < len(stream):
        size = rng.choice([1, 2, 3, 4, 5, 7, 100, 2048, 5000])
        piece = memoryview(stream[at:at + size]) if seed % 2 else stream[at:at + size]
        follower.data(piece, 0, len(piece))
        at += len(piece)
        assert follower.between == (at in ends), at


@pytest.mark.parametrize("cut", range(1, 40))
def test_a_length_split_over_pieces(cut: int) -> None:
    """A protobuf frame's 4-byte length split anywhere (also one byte at a time)."""
    stream = b"".join(PROTO_EVENTS[:3])
    ends = ends_of(PROTO_EVENTS[:3])
    follower = FrameEnds()
    for at in range(0, len(stream), cut):
        piece = stream[at:at + cut]
        follower.data(b"xx" + piece + b"yy", 2, 2 + len(piece))  # (a piece inside a read)
        assert follower.between == (at + len(piece) in ends)


@pytest.mark.parametrize(("kind", "events"), [(LineEnds, JSON_EVENTS), (FrameEnds, PROTO_EVENTS)],
                         ids=["json", "protobuf"])
@pytest.mark.parametrize("seed", range(10))
def test_followed_through_the_chunked_framing(
    kind: type[EventEnds], events: list[bytes], seed: int
) -> None:
    """The apiserver's chunks (events split at 2,048 bytes, as Go's chunked writer does), in
    reads cut anywhere: after each read, ``between`` as for the data passed so far."""
    rng = random.Random(seed)
    stream = b"".join(events)
    ends = ends_of(events)
    body = b""
    for event in events:
        for at in range(0, len(event), 2048):
            piece = event[at:at + 2048]
            body += b"%x\r\n%b\r\n" % (len(piece), piece)
    body += b"0\r\n\r\n"
    follower = kind()
    framing = ChunkedFraming(follower)
    at = 0
    while at < len(body):
        size = rng.choice([1, 3, 6, 2000, 2060, 9000])
        framing.feed(body[at:at + size])
        at += size
        assert follower.between == (framing.body in ends)
    assert framing.ended and framing.body == len(stream)


@pytest.mark.parametrize(("content_type", "kind"), [
    (b"application/json", LineEnds),
    ("application/json;stream=watch", LineEnds),
    (b"application/json;as=Table;v=v1;g=meta.k8s.io", LineEnds),
    (b"application/vnd.kubernetes.protobuf;stream=watch", FrameEnds),
    (b"Application/Vnd.Kubernetes.Protobuf ; stream=watch", FrameEnds),
    (b"application/cbor-seq", None),
    (b"text/plain", None),
    (b"", None),
])
def test_followed_by_content_type(content_type: bytes | str, kind: type | None) -> None:
    follower = event_ends(content_type)
    assert (None if follower is None else type(follower)) is kind
