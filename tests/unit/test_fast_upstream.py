"""How an upstream connection of the fast relay reads a response's framing
(proxy/relay/fast/upstream.py): whatever the case of the header names; a chunked body passed
through as it came, whatever reads it comes in; a long length-framed body read into views."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from proxy.relay.fast.chunked import ChunkedFraming, FramingError
from proxy.relay.fast.upstream import UpstreamConnection, UpstreamPool


class Recorder:
    """An exchange that keeps what the connection told it (``raw``: it takes a chunked body
    as it came, as the relay's exchange does for an HTTP/1.1 client)."""

    def __init__(self, raw: bool = False) -> None:
        self.heads: list[tuple[int, bytes | None, bool]] = []
        self.body = b""
        self.complete = False
        self.lost: BaseException | None = None
        self.raw = raw
        self.framing: ChunkedFraming | None = None
        self.raw_body = b""
        self.raw_size = 0

    def on_head(self, status: int, reason: bytes, headers: Any, *, length: bytes | None,
                chunked: bool) -> None:
        self.heads.append((status, length, chunked))

    def on_switch(self, reason: bytes, headers: Any) -> None:
        raise AssertionError("no upgrade here")

    def on_body(self, chunk: bytes) -> None:
        self.body += chunk

    def pass_chunked(self) -> ChunkedFraming | None:
        self.framing = ChunkedFraming() if self.raw else None
        return self.framing

    def on_raw(self, data: bytes, size: int) -> None:
        assert self.raw and not self.complete
        self.raw_body += data
        self.raw_size += size

    def splice_to(self) -> int | None:
        return None  # no client socket here: long bodies go to on_view

    def on_spliced(self, size: int) -> None:
        raise AssertionError("splice_to answered None")

    def abort_client(self) -> None:
        raise AssertionError("splice_to answered None")

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


def receive(response: bytes, *, piece: int = 7, raw: bool = False,
            calls: int = 1) -> tuple[Recorder, UpstreamConnection]:
    """``response`` through a connection in reads of ``piece`` bytes, ``calls`` times in a
    row on the same connection (each time to a new recorder; the last one is returned)."""
    async def go() -> tuple[Recorder, UpstreamConnection]:
        pool = UpstreamPool(host="127.0.0.1", port=1, tls=None, server_hostname=None,
                            connect_timeout=1.0)
        conn = UpstreamConnection(pool, asyncio.get_running_loop())
        conn.transport = Transport()  # type: ignore[assignment]
        for _ in range(calls):
            assert pool.take() in (None, conn)  # the pool lends it again
            recorder = Recorder(raw)
            conn.send(recorder, b"GET / HTTP/1.1\r\n\r\n")  # type: ignore[arg-type]
            for i in range(0, len(response), piece):  # in pieces, as a network hands them over
                conn.data_received(response[i : i + piece])
                if conn.closed:
                    break
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


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
CHUNKED = (b"800\r\n" + b"a" * 0x800 + b"\r\n" + b"5;name=value\r\n{\"x\"}\r\n"
           b"1\r\n\n\r\n0\r\nX-Trailer: t\r\n\r\n")
DATA = b"a" * 0x800 + b"{\"x\"}" + b"\n"


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 7, 64, 2053, 4096])
def test_a_chunked_body_is_passed_through_as_it_came_whatever_the_reads(piece: int) -> None:
    """Framing, extensions and trailers go to the exchange untouched; the body ends where
    its framing says, the connection goes back to the pool and carries the next call."""
    recorder, conn = receive(HEAD + CHUNKED, piece=piece, raw=True, calls=2)
    assert recorder.heads == [(200, None, True)]
    assert recorder.raw_body == CHUNKED and recorder.raw_size == len(DATA)
    assert recorder.body == b"" and recorder.complete and recorder.lost is None
    assert not conn.closed and conn._framing is None and conn._pool._idle == [conn]


@pytest.mark.parametrize("piece", [1, 2, 4, 30, 10_000])
def test_a_passed_through_body_after_an_interim_head(piece: int) -> None:
    """Where the body starts is where llhttp stopped, also after an interim head and the
    CR/LF bytes llhttp skips between messages, whatever reads they come in."""
    recorder, conn = receive(b"HTTP/1.1 100 Continue\r\n\r\n\r\n\r\n" + HEAD + CHUNKED,
                             piece=piece, raw=True)
    assert recorder.heads == [(200, None, True)]
    assert recorder.raw_body == CHUNKED and recorder.complete and not conn.closed


def test_bytes_after_a_passed_through_body_close_the_connection() -> None:
    recorder, conn = receive(HEAD + CHUNKED + b"HTTP/1.1 200 OK\r\n", piece=10_000, raw=True)
    assert recorder.raw_body == CHUNKED and recorder.complete
    assert conn.closed and conn._pool.take() is None  # never lent again


@pytest.mark.parametrize("body", [b"zz\r\nab\r\n0\r\n\r\n", b"2\r\nabXY0\r\n\r\n",
                                  b"2\nab\r\n0\r\n\r\n", b"-2\r\nab\r\n0\r\n\r\n"])
def test_malformed_passed_through_framing_loses_the_call_and_the_connection(body: bytes) -> None:
    recorder, conn = receive(HEAD + body, piece=3, raw=True)
    assert isinstance(recorder.lost, FramingError) and not recorder.complete
    assert conn.closed


def test_an_exchange_that_declines_gets_the_data_through_the_parser() -> None:
    recorder, conn = receive(HEAD + CHUNKED, piece=5, raw=False, calls=2)
    assert recorder.body == DATA and recorder.raw_body == b"" and recorder.complete
    assert not conn.closed


def test_a_response_head_without_end_fails_the_call() -> None:
    from proxy.relay.fast.upstream import MAX_HEAD

    endless = b"HTTP/1.1 200 OK\r\n" + b"X-Filler: " + b"y" * (MAX_HEAD + 10)
    recorder, conn = receive(endless, piece=64 * 1024)
    assert recorder.heads == [] and conn.closed
    assert recorder.lost is not None and "longer than" in str(recorder.lost)


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


class PausableTransport(Transport):
    def __init__(self) -> None:
        self.reading = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


def test_a_connection_paused_when_its_response_ends_reads_again_in_the_pool() -> None:
    """The client's write buffer filled up (its pause_writing paused this connection) in the
    same read that ended the response: the call is over, the client's resume_writing no longer
    reaches this connection, so the pool must resume it, or the next call on it never reads
    its answer."""
    async def go() -> None:
        pool = UpstreamPool(host="127.0.0.1", port=1, tls=None, server_hostname=None,
                            connect_timeout=1.0)
        conn = UpstreamConnection(pool, asyncio.get_running_loop())
        transport = PausableTransport()
        conn.transport = transport  # type: ignore[assignment]

        class FullClient(Recorder):
            def on_body(self, chunk: bytes) -> None:
                super().on_body(chunk)
                conn.pause_reading()  # what the client's pause_writing does (flow)

        first = FullClient()
        conn.send(first, b"GET / HTTP/1.1\r\n\r\n")  # type: ignore[arg-type]
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
        assert first.complete and first.body == b"hello"
        assert pool.take() is conn
        assert transport.reading and not conn.paused
        second = Recorder()
        conn.send(second, b"GET / HTTP/1.1\r\n\r\n")  # type: ignore[arg-type]
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        assert second.complete and second.body == b"ok"

    asyncio.run(go())
