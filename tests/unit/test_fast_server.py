"""What the fast relay's client connection reads off a request head
(proxy/relay/fast/server.py): framing, Expect and Connection, whatever the case of the names."""

from __future__ import annotations

import asyncio

import pytest

from proxy.relay.fast.request import Request
from proxy.relay.fast.server import ClientConnection


class Transport:
    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass

    def set_write_buffer_limits(self, high: int) -> None:
        pass

    def get_extra_info(self, name: str) -> object:
        return ("127.0.0.1", 1)


def head_of(request: bytes) -> Request:
    seen: list[Request] = []

    async def handler(req: Request) -> None:
        seen.append(req)

    async def go() -> None:
        conn = ClientConnection(handler)
        conn.connection_made(Transport())  # type: ignore[arg-type]
        conn.data_received(request)
        await asyncio.sleep(0)
        conn.connection_lost(None)

    asyncio.run(go())
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("case", [bytes.title, bytes.lower, bytes.upper])
def test_framing_expect_and_connection_whatever_the_case(case: object) -> None:
    def name(n: bytes) -> bytes:
        return case(n)  # type: ignore[operator,no-any-return]

    req = head_of(b"POST /x HTTP/1.1\r\nHost: h\r\n" + name(b"content-length") + b": 3\r\n"
                  + name(b"expect") + b": 100-Continue\r\n" + name(b"connection")
                  + b": keep-alive\r\nUser-Agent: a-ten-char\r\n\r\nabc")
    assert (req.content_length, req.has_body, req.chunked) == (b"3", True, False)
    assert req.expect_continue and req.connection
    req = head_of(b"POST /x HTTP/1.1\r\n" + name(b"transfer-encoding") + b": chunked\r\n\r\n"
                  b"0\r\n\r\n")
    assert (req.content_length, req.has_body, req.chunked) == (None, True, True)


def test_names_of_the_same_lengths_change_nothing() -> None:
    req = head_of(b"GET /x HTTP/1.1\r\nUser-Agent: 0\r\nX-Length-Is-14: 5\r\n"
                  b"X-Seventeen-Chars: chunked\r\nX-Exp-: 100-continue\r\n\r\n")
    assert (req.content_length, req.has_body, req.chunked) == (None, False, False)
    assert not req.expect_continue and not req.connection
