"""What the fast relay's client connection reads off a request head
(proxy/relay/fast/server.py): framing, Expect and Connection, whatever the case of the names."""

from __future__ import annotations

import asyncio
import time

import pytest

from proxy.relay.fast.request import Request
from proxy.relay.fast.server import ClientConnection, FastServer


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
    req = head_of(b"POST /x HTTP/1.1\r\nHost: h\r\n" + name(b"transfer-encoding")
                  + b": chunked\r\n\r\n0\r\n\r\n")
    assert (req.content_length, req.has_body, req.chunked) == (None, True, True)


def test_names_of_the_same_lengths_change_nothing() -> None:
    req = head_of(b"GET /x HTTP/1.1\r\nHost: h\r\nUser-Agent: 0\r\nX-Length-Is-14: 5\r\n"
                  b"X-Seventeen-Chars: chunked\r\nX-Exp-: 100-continue\r\n\r\n")
    assert (req.content_length, req.has_body, req.chunked) == (None, False, False)
    assert not req.expect_continue and not req.connection


# --- one task per connection, the calls in turn ------------------------------------------


class Peer(Transport):
    """A client transport that records what was written and whether it was closed."""

    def __init__(self) -> None:
        self.out = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


GET = b"GET /%d HTTP/1.1\r\nHost: h\r\n\r\n"


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_the_calls_of_a_connection_run_in_turn_in_one_task_that_ends_with_it() -> None:
    async def go() -> None:
        seen: list[tuple[bytes, asyncio.Task[None] | None]] = []
        release = asyncio.Event()

        async def handler(req: Request) -> None:
            seen.append((req.url, asyncio.current_task()))
            assert req.task is asyncio.current_task()
            if req.url == b"/1":
                await release.wait()
            req.conn.write(b"answer " + req.url + b"\n")

        peer = Peer()
        conn = ClientConnection(handler)
        conn.connection_made(peer)  # type: ignore[arg-type]
        conn.data_received(GET % 1 + GET % 2 + GET % 3)  # pipelined: they wait their turn
        await settle()
        assert [u for u, _ in seen] == [b"/1"] and conn.busy
        release.set()
        await settle()
        assert [u for u, _ in seen] == [b"/1", b"/2", b"/3"]
        assert peer.out == b"answer /1\nanswer /2\nanswer /3\n"
        conn.data_received(GET % 4)  # later, on the kept-alive connection: the same task
        await settle()
        assert [u for u, _ in seen][-1] == b"/4" and not conn.busy
        worker = seen[0][1]
        assert worker is not None and all(t is worker for _, t in seen)
        assert not worker.done()  # idle, waiting for the next request
        conn.connection_lost(None)
        await settle()
        assert worker.done() and not worker.cancelled()  # ended with the connection
        assert not peer.closed

    asyncio.run(go())


def test_a_client_that_leaves_cancels_its_call_and_the_connections_task() -> None:
    async def go() -> None:
        started = asyncio.Event()
        cancelled: list[bool] = []

        async def handler(req: Request) -> None:
            started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

        conn = ClientConnection(handler)
        conn.connection_made(Peer())  # type: ignore[arg-type]
        conn.data_received(GET % 1)
        await started.wait()
        task = conn.current.task if conn.current is not None else None
        conn.connection_lost(None)
        await settle()
        assert cancelled == [True] and task is not None and task.cancelled()
        assert not conn.busy

    asyncio.run(go())


def test_a_call_that_fails_closes_the_connection_and_a_later_one_gets_a_new_task() -> None:
    async def go() -> None:
        tasks: list[asyncio.Task[None] | None] = []

        async def handler(req: Request) -> None:
            tasks.append(asyncio.current_task())
            if req.url == b"/1":
                raise RuntimeError("boom")

        peer = Peer()
        conn = ClientConnection(handler)
        conn.connection_made(peer)  # type: ignore[arg-type]
        conn.data_received(GET % 1)
        await settle()
        assert peer.closed and not conn.busy
        assert tasks[0] is not None and tasks[0].done()
        conn.data_received(GET % 2)  # (bytes the transport still hands over)
        await settle()
        assert len(tasks) == 2 and tasks[1] is not tasks[0]

    asyncio.run(go())


def test_a_connection_not_kept_alive_closes_after_its_call() -> None:
    async def go() -> None:
        async def handler(req: Request) -> None:
            req.conn.write(b"answer")

        peer = Peer()
        conn = ClientConnection(handler)
        conn.connection_made(peer)  # type: ignore[arg-type]
        conn.data_received(b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
        await settle()
        assert peer.out == b"answer" and peer.closed

    asyncio.run(go())


def sized_head(size: int) -> bytes:
    """A request head of ``size`` bytes in all (the request line and the blank line too, as
    the aiohttp listener and Go's net/http count them)."""
    line = b"GET /api/v1/pods HTTP/1.1\r\n"
    fields = [b"Host: h\r\n"] + [b"X-F%03d: " % i + b"v" * 59_990 + b"\r\n" for i in range(17)]
    left = size - len(line) - sum(map(len, fields)) - len(b"X-Last: \r\n") - 2
    fields.append(b"X-Last: " + b"v" * left + b"\r\n")
    head = line + b"".join(fields) + b"\r\n"
    assert len(head) == size
    return head


@pytest.mark.parametrize("read", [4096, 300_000, 2 << 20], ids=["4KiB", "300KB", "one-read"])
@pytest.mark.parametrize(("size", "answered"), [(1 << 20, True), ((1 << 20) + 1, False)])
def test_a_head_of_1_mib_passes_and_one_byte_more_gets_431(
    read: int, size: int, answered: bool
) -> None:
    """However the reads split it (a head in one read is measured only when it could be over:
    more than 1 MiB read at once, which asyncio never does)."""
    async def go() -> bytes:
        calls: list[Request] = []

        async def handler(req: Request) -> None:
            calls.append(req)

        peer = Peer()
        conn = ClientConnection(handler)
        conn.connection_made(peer)  # type: ignore[arg-type]
        head = sized_head(size)
        for start in range(0, len(head), read):
            conn.data_received(head[start:start + read])
        await settle()
        assert len(calls) == answered
        return peer.out

    out = asyncio.run(go())
    assert out == b"" if answered else out.startswith(b"HTTP/1.1 431 ")


@pytest.mark.parametrize("line", [
    b"X-Endless: ",  # a header whose value never ends
    b"X-Endless" + b"-" * 1000,  # ... its name
], ids=["value", "name"])
def test_a_head_whose_line_never_ends_is_cut_at_twice_the_heads_limit(line: bytes) -> None:
    """llhttp reports a header line whole, once it has ended: a line that goes on and on is
    refused (431) once the reads of its head pass twice ``MAX_HEAD``, not held in memory until
    the idle timeout."""
    async def go() -> int:
        async def handler(req: Request) -> None:
            raise AssertionError("no call")

        peer = Peer()
        conn = ClientConnection(handler)
        conn.connection_made(peer)  # type: ignore[arg-type]
        sent = 0
        for data in [b"GET / HTTP/1.1\r\nHost: h\r\n" + line] + [b"a" * 4096] * 2000:
            conn.data_received(data)
            sent += len(data)
            if peer.closed:
                break
        assert peer.out.startswith(b"HTTP/1.1 431 "), peer.out[:100]
        return sent

    cut = 2 << 20  # twice MAX_HEAD (the apiserver's 1 MiB)
    assert cut < asyncio.run(go()) <= cut + 4096


def test_close_waits_for_answers_still_in_the_transports_buffer() -> None:
    """A call that ended while its answer still sits in the transport's buffer (a slow reader):
    the server waits (up to its grace) until it is written out, instead of letting the process
    exit with the answer cut short."""

    class Flushing:
        current = None
        busy = False

        def __init__(self, until: float) -> None:
            self.until = until
            self.closes = 0

        def holds_writes(self) -> bool:
            return time.monotonic() < self.until

        def close(self) -> None:
            self.closes += 1

        def abort(self) -> None:
            pass

    async def go() -> float:
        server = FastServer(lambda req: asyncio.sleep(0))  # type: ignore[arg-type,return-value]
        conn = Flushing(time.monotonic() + 0.3)
        server.connections.add(conn)  # type: ignore[arg-type]
        started = time.monotonic()
        await server.close(grace=3.0)
        assert conn.closes >= 1  # closed (after what was written is flushed) at once
        return time.monotonic() - started

    took = asyncio.run(go())
    assert 0.25 < took < 2.0
