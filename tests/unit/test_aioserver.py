"""How the aiohttp listener counts a request head's bytes (proxy/relay/aioserver.py), however
the reads split it: up to its blank line, never a byte of a body."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.relay.aioserver import HeadTooLarge, _HeadBound


class Body:
    def __init__(self, eof: bool) -> None:
        self.eof = eof

    def is_eof(self) -> bool:
        return self.eof


class Parser:
    """Emits a request at each blank line; its body (``body_eof``) ends with it or not."""

    def __init__(self, *, body_eof: bool = True) -> None:
        self.buffer = b""
        self.body = Body(body_eof)

    def feed_data(self, data: bytes) -> Any:
        self.buffer += data
        head, sep, self.buffer = self.buffer.partition(b"\r\n\r\n")
        if not sep:
            self.buffer = head
            return [], False, b""
        return [(head, self.body)], False, b""


HEAD = b"GET / HTTP/1.1\r\nHost: h\r\nX-Pad: " + b"p" * 100 + b"\r\n\r\n"


def feed(bound: _HeadBound, data: bytes, cuts: tuple[int, ...]) -> None:
    start = 0
    for cut in (*cuts, len(data)):
        bound.feed_data(data[start:cut])
        start = cut


@pytest.mark.parametrize("cut", range(1, len(HEAD)))
def test_a_head_exactly_at_the_limit_passes_and_one_byte_more_does_not(cut: int) -> None:
    """Whichever read its blank line (or any other byte) comes in."""
    feed(_HeadBound(Parser(), len(HEAD)), HEAD, (cut, cut + 1))
    with pytest.raises(HeadTooLarge):
        feed(_HeadBound(Parser(), len(HEAD) - 1), HEAD, (cut, cut + 1))


def test_the_bytes_after_a_head_and_those_of_a_body_are_not_its() -> None:
    bound = _HeadBound(Parser(body_eof=False), len(HEAD))
    bound.feed_data(HEAD + b"b" * 10 * len(HEAD))  # the body in the head's read
    for _ in range(10):
        bound.feed_data(b"b" * 10 * len(HEAD))  # ... and in reads of its own
    bound._body = Body(True)  # (the body ended: the next head is counted again)
    bound.feed_data(HEAD + b"x" * len(HEAD))  # (what follows a head in its read is not it)
    bound._body = Body(True)
    with pytest.raises(HeadTooLarge):
        bound.feed_data(HEAD.replace(b"p", b"pp", 1))


def test_a_refused_head_stays_refused() -> None:
    bound = _HeadBound(Parser(), 10)
    with pytest.raises(HeadTooLarge):
        bound.feed_data(b"GET / HTTP/1.1\r\n")
    with pytest.raises(HeadTooLarge):
        bound.feed_data(b"\r\n")
