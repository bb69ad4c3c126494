"""Where a chunked body ends (proxy/relay/fast/chunked.py): the same answer whatever reads the
body arrives in, malformed framing refused as llhttp refuses it, and a clean end after any
chunk for a watch that opgate ends."""

from __future__ import annotations

import random

import httptools
import pytest

from proxy.relay.fast.chunked import MAX_SIZE_LINE, ChunkedFraming, FramingError

BODIES = [
    b"0\r\n\r\n",
    b"3\r\nabc\r\n0\r\n\r\n",
    b"800\r\n" + b"x" * 0x800 + b"\r\n1A3;ext=1;b=\"q s\"\r\n" + b"y" * 0x1A3 + b"\r\n0\r\n\r\n",
    b"2;a=b\r\nab\r\n0\r\nExpires: never\r\nX-T: 1\r\n\r\n",
    b"00000002\r\n\r\n\r\n0000\r\n\r\n",  # leading zeros; data that looks like framing
]


def data_of(body: bytes) -> bytes:
    """The data of a whole chunked body, as llhttp (the relay's parser) reads it."""
    got: list[bytes] = []
    ended: list[bool] = []

    class Sink:
        def on_body(self, chunk: bytes) -> None:
            got.append(chunk)

        def on_message_complete(self) -> None:
            ended.append(True)

    httptools.HttpResponseParser(Sink()).feed_data(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
    assert ended, "the parser saw no end"
    return b"".join(got)


def feed_all(reads: list[bytes]) -> tuple[ChunkedFraming, int, int]:
    """``(framing, index of the read the body ended in, offset in it)``; -1, -1: not ended."""
    framing = ChunkedFraming()
    for i, read in enumerate(reads):
        end = framing.feed(read)
        if end >= 0:
            return framing, i, end
    return framing, -1, -1


@pytest.mark.parametrize("body", BODIES)
def test_the_end_and_the_data_count_in_every_split_into_two_reads(body: bytes) -> None:
    tail = b"HTTP/1.1 200 OK\r\n"  # the next response: never part of this body
    whole = body + tail
    for cut in range(len(whole) + 1):
        reads = [whole[:cut], whole[cut:]] if cut else [whole]
        framing, at, end = feed_all(reads)
        assert at >= 0 and framing.ended, cut
        assert sum(len(r) for r in reads[:at]) + end == len(body), cut
        assert framing.body == len(data_of(body)), cut


@pytest.mark.parametrize("body", BODIES)
def test_any_reads_at_all(body: bytes) -> None:
    rng = random.Random(len(body))
    for _ in range(200):
        reads, rest = [], body
        while rest:
            n = rng.randint(1, 9)
            reads.append(rest[:n])
            rest = rest[n:]
        framing, at, end = feed_all(reads)
        assert at == len(reads) - 1 and end == len(reads[-1]) and framing.ended
        assert framing.body == len(data_of(body))


def test_a_body_that_goes_on_is_not_ended() -> None:
    framing = ChunkedFraming()
    assert framing.feed(b"5\r\nab") == -1 and framing.feed(b"cde\r\n") == -1
    assert framing.body == 5 and not framing.ended


@pytest.mark.parametrize("body", [
    b"x\r\n", b"2 ;a\r\nab\r\n", b"2\t;a\r\nab\r\n", b"2;a\nb\r\nab\r\n",
    b"-1\r\n", b"+1\r\n", b"0x1\r\n", b"1_0\r\n", b" 1\r\n", b"\r\n",
    b"11111111111111111\r\n",  # more than 16 hex digits
    b"1\nA\r\n", b"1\r\nab\r\n", b"1\r\na\n0\r\n\r\n", b"0\r\nX: y\n\r\n",
])
def test_malformed_framing_is_refused_as_the_parser_refuses_it(body: bytes) -> None:
    with pytest.raises(httptools.HttpParserError):
        data_of(body + b"0\r\n\r\n")  # the parser refuses it too
    for cut in range(1, len(body) + 1):
        with pytest.raises(FramingError):
            feed_all([body[:cut], body[cut:] + b"0\r\n\r\n"])


def test_framing_without_end_is_bounded() -> None:
    with pytest.raises(FramingError):
        feed_all([b"1" * (MAX_SIZE_LINE + 10)])
    framing = ChunkedFraming()
    framing.feed(b"0\r\n")
    with pytest.raises(FramingError):
        for _ in range(100):
            framing.feed(b"X-Trailer: " + b"v" * 1000)


@pytest.mark.parametrize(("fed", "closing"), [
    (b"", b"0\r\n\r\n"),
    (b"3\r\nabc", b"\r\n0\r\n\r\n"),  # right after a chunk's data
    (b"3\r\nabc\r\n", b"0\r\n\r\n"),  # and after its CRLF
    (b"3\r\nabc\r\n2\r\nde\r\n", b"0\r\n\r\n"),
    (b"3\r\nab", None),  # inside a chunk
    (b"3\r\nabc\r", None),
    (b"3\r\nabc\r\n1", None),  # inside a size line
    (b"1", None),
    (b"3\r\nabc\r\n0\r\n", None),  # in the trailers: the upstream is ending it
])
def test_a_clean_end_after_any_whole_chunk(fed: bytes, closing: bytes | None) -> None:
    framing = ChunkedFraming()
    assert framing.feed(fed) == -1
    assert framing.closing() == closing
    if closing is not None:  # what the client then gets is a whole body, for llhttp too
        data_of(fed + closing)
        assert framing.feed(closing) == len(closing) and framing.ended


@pytest.mark.parametrize("split", [0, 5, 9, 13, 20], ids=lambda n: f"read-split-at-{n}")
def test_a_watch_asked_to_end_stops_after_the_chunk_that_ends_its_event(split: int) -> None:
    """Asked to end inside an event (``events.ending``), the framing stops right after the
    chunk whose data ends it, even with more chunks in the same read: ``stop`` is the offset in
    that read, what was fed up to it closes cleanly, and nothing after it is looked at (not
    even framing that is malformed)."""
    from proxy.relay.events import LineEnds

    first, second, third = b"4\r\n{\"a\"\r\n", b"3\r\n:1}\r\n", b"2\r\n\n{\r\n"
    body = first + second + b"2\r\n}\n\r\n" + third + b"zz"  # (the 'zz' never read)
    events = LineEnds()
    framing = ChunkedFraming(events)
    if split:
        assert framing.feed(body[:split]) == -1
    events.ending = 1.0  # (the shutdown, while the event '{"a":1}}\n' is in flight)
    assert framing.feed(body[split:]) == -1
    assert split + framing.stop == len(first + second + b"2\r\n}\n")
    assert framing.closing() == b"\r\n0\r\n\r\n"
    assert framing.feed(b"more") == -1 and framing.stop >= 0
