"""How an upstream connection of the fast relay reads a response's framing
(proxy/relay/fast/upstream.py): whatever the case of the header names."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.relay.fast.upstream import UpstreamConnection, UpstreamPool


class Recorder:
    """An exchange that keeps what the connection told it."""

    def __init__(self) -> None:
        self.heads: list[tuple[int, bytes | None, bool]] = []
        self.body = b""
        self.complete = False
        self.lost: BaseException | None = None

    def on_head(self, status: int, reason: bytes, headers: Any, *, length: bytes | None,
                chunked: bool) -> None:
        self.heads.append((status, length, chunked))

    def on_switch(self, reason: bytes, headers: Any) -> None:
        raise AssertionError("no upgrade here")

    def on_body(self, chunk: bytes) -> None:
        self.body += chunk

    def on_complete(self) -> None:
        self.complete = True

    def on_lost(self, exc: BaseException) -> None:
        self.lost = exc

    def on_deadline(self) -> None:
        pass


class Transport:
    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


def receive(response: bytes) -> tuple[Recorder, UpstreamConnection]:
    async def go() -> tuple[Recorder, UpstreamConnection]:
        pool = UpstreamPool(host="127.0.0.1", port=1, tls=None, server_hostname=None,
                            connect_timeout=1.0)
        conn = UpstreamConnection(pool, asyncio.get_running_loop())
        conn.transport = Transport()  # type: ignore[assignment]
        recorder = Recorder()
        conn.send(recorder, b"GET / HTTP/1.1\r\n\r\n")  # type: ignore[arg-type]
        for i in range(0, len(response), 7):  # in pieces, as a network hands them over
            conn.data_received(response[i : i + 7])
        conn.close()
        return recorder, conn

    return asyncio.run(go())


@pytest.mark.parametrize("name", [b"Content-Length", b"content-length", b"CONTENT-LENGTH"])
def test_a_length_framed_body_whatever_the_case_of_its_header(name: bytes) -> None:
    recorder, _ = receive(b"HTTP/1.1 200 OK\r\nContent-Type: a/b\r\nX-Length-Is-14: 3\r\n"
                          + name + b": 10\r\n\r\n0123456789")
    assert recorder.heads == [(200, b"10", False)]
    assert recorder.body == b"0123456789" and recorder.complete


@pytest.mark.parametrize("name", [b"Transfer-Encoding", b"transfer-ENCODING"])
def test_a_chunked_body_whatever_the_case_of_its_header(name: bytes) -> None:
    recorder, _ = receive(b"HTTP/1.1 200 OK\r\nX-Seventeen-Chars: 1\r\n" + name
                          + b": Chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
    assert recorder.heads == [(200, None, True)]
    assert recorder.body == b"abc" and recorder.complete


def test_names_of_the_same_lengths_frame_nothing() -> None:
    """Neither a 14- nor a 17-character name that is not a framing header frames the body."""
    recorder, conn = receive(b"HTTP/1.1 200 OK\r\nX-Length-Is-14: 3\r\nX-Seventeen-Chars: "
                             b"chunked\r\n\r\nuntil close")
    assert recorder.heads == [(200, None, False)]
    assert conn._until_close


def test_acquire_judges_an_idle_connection_at_the_callers_instant() -> None:
    async def go() -> None:
        pool = UpstreamPool(host="127.0.0.1", port=1, tls=None, server_hostname=None,
                            connect_timeout=1.0, keepalive=30.0)
        loop = asyncio.get_running_loop()
        kept, stale = UpstreamConnection(pool, loop), UpstreamConnection(pool, loop)
        for conn, since in ((stale, 100.0), (kept, 200.0)):
            conn.transport = Transport()  # type: ignore[assignment]
            conn.idle_since = since
            pool._idle.append(conn)
        assert await pool.acquire(now=229.0) == (kept, True)
        pool._idle.append(kept)
        with pytest.raises(OSError):  # both too old at 231: closed, and a new one fails here
            await pool.acquire(now=231.0)
        assert kept.closed and stale.closed and not pool._idle

    asyncio.run(go())
