"""How an upstream connection of the fast relay reads a response's framing
(proxy/relay/fast/upstream.py): whatever the case of the header names."""

from __future__ import annotations

import asyncio
import socket
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


# --- long bodies: the BodyReader ---------------------------------------------------------


class LowatSocket:
    """Records the ``SO_RCVLOWAT`` the connection asks for; the kernel's default is 1."""

    def __init__(self) -> None:
        self.lowat = 1
        self.settings: list[int] = []

    def setsockopt(self, level: int, option: int, value: int) -> None:
        assert (level, option) == (socket.SOL_SOCKET, socket.SO_RCVLOWAT)
        self.lowat = value
        self.settings.append(value)


class SwitchingTransport:
    """A transport that hands reads to whichever protocol is set, the way asyncio and uvloop
    do: ``get_buffer`` + ``buffer_updated`` for a buffered protocol, else ``data_received``.
    ``due``: what the upstream is still to send; the socket's low-water mark must never exceed
    it (the kernel would not report the last bytes)."""

    def __init__(self, protocol: Any, due: int = 0) -> None:
        self.protocol = protocol
        self.reading = True
        self.closed = False
        self.sock = LowatSocket()
        self.due = due

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.sock if name == "socket" else default

    def set_protocol(self, protocol: Any) -> None:
        self.protocol = protocol

    def is_reading(self) -> bool:
        return self.reading

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def feed(self, data: bytes) -> None:
        while data and not self.closed:
            if hasattr(self.protocol, "get_buffer"):
                buffer = self.protocol.get_buffer(len(data))
                n = min(len(buffer), len(data))
                buffer[:n] = data[:n]
                self.due -= n
                self.protocol.buffer_updated(n)
            else:
                n = len(data)
                self.due -= n
                self.protocol.data_received(data)
            data = data[n:]
            assert self.sock.lowat <= max(1, self.due), (self.sock.lowat, self.due)


class Keeper(Recorder):
    """An exchange that keeps every ``keep``-th view it is shown (as a client transport with
    a full write buffer does) and says so; what it kept must not change afterwards."""

    def __init__(self, keep: int) -> None:
        super().__init__()
        self.keep = keep
        self.views = 0
        self.kept: list[tuple[memoryview, bytes]] = []

    def on_view(self, view: memoryview) -> bool:
        self.body += view.tobytes()
        self.views += 1
        if self.views % self.keep:
            return False
        self.kept.append((view, view.tobytes()))
        return True


@pytest.mark.parametrize("keep", [1, 2, 10_000], ids=["keeps-all", "keeps-half", "keeps-none"])
def test_a_long_body_goes_to_the_exchange_as_views_and_the_connection_back_to_the_pool(
    keep: int,
) -> None:
    from proxy.relay.fast.upstream import LONG_BODY, LOWAT, READ_SIZE, BodyReader

    body = bytes(range(256)) * ((2 * LONG_BODY) // 256 + 7)
    response = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body

    async def go() -> None:
        pool = UpstreamPool(host="127.0.0.1", port=1, tls=None, server_hostname=None,
                            connect_timeout=1.0)
        conn = UpstreamConnection(pool, asyncio.get_running_loop())
        transport = SwitchingTransport(conn, due=len(response))
        conn.transport = transport  # type: ignore[assignment]
        keeper = Keeper(keep)
        conn.send(keeper, b"GET / HTTP/1.1\r\n\r\n")  # type: ignore[arg-type]
        transport.feed(response[:1000])  # the head and the body's first bytes: the parser's
        assert isinstance(transport.protocol, BodyReader)
        for at in range(1000, len(response), READ_SIZE // 3):
            transport.feed(response[at:at + READ_SIZE // 3])
        assert keeper.complete and keeper.body == body
        assert keeper.views >= (len(body) - 1000) // (READ_SIZE // 3)
        for view, seen in keeper.kept:  # no later read went into a buffer still in use
            assert view.tobytes() == seen
        assert transport.protocol is conn and transport.reading
        assert transport.sock.settings == [LOWAT, 1]  # fuller reads, then back to the default
        assert pool.take() is conn  # given back, and it parses the next response as usual
        recorder = Recorder()
        conn.send(recorder, b"GET / HTTP/1.1\r\n\r\n")  # type: ignore[arg-type]
        transport.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        assert recorder.body == b"ok" and recorder.complete

    asyncio.run(go())


def test_a_long_body_with_bytes_past_its_end_closes_the_connection() -> None:
    from proxy.relay.fast.upstream import LONG_BODY

    body = b"x" * LONG_BODY
    response = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)

    async def go() -> None:
        pool = UpstreamPool(host="127.0.0.1", port=1, tls=None, server_hostname=None,
                            connect_timeout=1.0)
        conn = UpstreamConnection(pool, asyncio.get_running_loop())
        extra = b"HTTP/1.1 200 OK\r\n"
        transport = SwitchingTransport(conn, due=len(response) + len(body) + len(extra))
        conn.transport = transport  # type: ignore[assignment]
        keeper = Keeper(10_000)
        conn.send(keeper, b"GET / HTTP/1.1\r\n\r\n")  # type: ignore[arg-type]
        transport.feed(response)
        transport.feed(body + extra)  # nobody asked for a second response
        assert keeper.complete and keeper.body == body
        assert transport.closed and conn.closed and pool.take() is None

    asyncio.run(go())
