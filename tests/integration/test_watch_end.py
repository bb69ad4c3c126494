"""A watch that opgate ends (at shutdown, at its idle timeout) ends between two events, never
inside one, on both relays: the apiserver splits an event over two chunks (Go's chunked writer
sends its 2,048-byte buffer, then the rest), and an end after the chunk in flight then cut an
event short (client-go: an unexpected EOF). JSON lines and protobuf frames; the body passed
through as it came (the fast relay's default) and through the parser (a capture tap)."""

from __future__ import annotations

import asyncio
import json

import pytest

from proxy.relay.calls import RelaySettings
from tests.integration.fakes import (
    RawUpstream,
    Tapping,
    read_head,
    running_proxy,
    wait_closed,
)

pytestmark = pytest.mark.usefixtures("each_relay")  # every test on both relay cores

PAUSE = 0.5  # between the two chunks of the split event


def _json_event(i: int, size: int) -> bytes:
    head = b'{"type":"ADDED","object":{"kind":"ConfigMap","n":%d,"data":"' % i
    return head + b"x" * (size - len(head) - 4) + b'"}}\n'


def _frame(i: int, size: int) -> bytes:
    return (size - 4).to_bytes(4, "big") + b"k8s\x00" + bytes([i]) * (size - 8)


KINDS = {
    "json": ("application/json", _json_event),
    "protobuf": ("application/vnd.kubernetes.protobuf;stream=watch", _frame),
}


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class SplitWatch:
    """An apiserver's watch: one event whole, then one split over two chunks (its first
    2,048 bytes, then, after ``go_on``, the rest), then silence."""

    def __init__(self, kind: str) -> None:
        self.content_type, make = KINDS[kind]
        self.first, self.second = make(1, 300), make(2, 3000)
        self.split = asyncio.Event()  # the first half is sent
        self.go_on = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: %b\r\nTransfer-Encoding: chunked\r\n\r\n"
                     % self.content_type.encode() + _chunk(self.first))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(_chunk(self.second[:2048]))
        await writer.drain()
        self.split.set()
        await self.go_on.wait()
        writer.write(_chunk(self.second[2048:]))
        await writer.drain()
        await wait_closed(reader)


async def read_body(reader: asyncio.StreamReader) -> tuple[bytes, bool]:
    """A chunked body's data and whether it ended with the last chunk (else it was cut)."""
    data = b""
    try:
        while True:
            size = int(await reader.readuntil(b"\r\n"), 16)
            if not size:
                return data, await reader.readexactly(2) == b"\r\n"
            data += await reader.readexactly(size)
            assert await reader.readexactly(2) == b"\r\n"
    except (asyncio.IncompleteReadError, ConnectionError):
        return data, False


async def _open_watch(url: str, watch: SplitWatch, *, version: bytes = b"1.1"
                      ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /api/v1/configmaps?watch=1 HTTP/%b\r\nHost: x\r\n\r\n" % version)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.") and head[8:13] == b" 200 ", head
    assert (b"chunked" in head.lower()) == (version == b"1.1"), head
    await asyncio.wait_for(watch.split.wait(), 5)
    await asyncio.sleep(0.1)  # the first half has passed through opgate meanwhile
    return reader, writer


def _whole_events(data: bytes, watch: SplitWatch) -> None:
    assert data in (watch.first, watch.first + watch.second), (
        f"{len(data)} bytes: not whole events ({len(watch.first)} + {len(watch.second)})")
    if watch.content_type == "application/json":
        for line in data.splitlines():
            json.loads(line)


async def _shut_down_inside_an_event(watch: SplitWatch, tapped: bool) -> tuple[bytes, bool]:
    """Open ``watch`` through a proxy, close the listener (SIGTERM's drain) while the upstream
    holds the rest of an event back, let it go on after ``PAUSE``: the body the client read,
    and whether it ended with the last chunk."""
    up = await RawUpstream(watch.serve).start()
    try:
        async with running_proxy(up.url, shutdown_timeout=5.0,
                                 middlewares=(Tapping(),) if tapped else ()) as proxy:
            reader, writer = await _open_watch(proxy.url, watch)
            closing = asyncio.create_task(proxy.listener.close())
            await asyncio.sleep(PAUSE)  # the rest comes within the listener's 1 s
            watch.go_on.set()
            data, clean = await asyncio.wait_for(read_body(reader), 5)
            writer.close()
            await asyncio.wait_for(closing, 8)
    finally:
        await up.close()
    return data, clean


@pytest.mark.asyncio
@pytest.mark.parametrize("tapped", [False, True], ids=["as-it-came", "tapped"])
@pytest.mark.parametrize("kind", list(KINDS))
async def test_shutdown_inside_a_split_event_ends_after_it(kind: str, tapped: bool) -> None:
    """SIGTERM while the apiserver is between the two chunks of an event: the watch ends once
    the event is whole, with the last chunk (before: right after its first half)."""
    watch = SplitWatch(kind)
    data, clean = await _shut_down_inside_an_event(watch, tapped)
    _whole_events(data, watch)
    assert data == watch.first + watch.second
    assert clean, "no last chunk"


class BusyWatch(SplitWatch):
    """A watch whose events come back to back (a backlog: a watch's initial events, a busy
    namespace): the rest of the split event, then one more whole, then half of the next, all
    in one write (one read at the relay), then silence."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        make = KINDS[kind][1]
        self.third, self.fourth = make(3, 300), make(4, 3000)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: %b\r\nTransfer-Encoding: chunked\r\n\r\n"
                     % self.content_type.encode() + _chunk(self.first))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(_chunk(self.second[:2048]))
        await writer.drain()
        self.split.set()
        await self.go_on.wait()
        writer.write(_chunk(self.second[2048:]) + _chunk(self.third)
                     + _chunk(self.fourth[:2048]))
        await writer.drain()
        await wait_closed(reader)


@pytest.mark.asyncio
@pytest.mark.parametrize("tapped", [False, True], ids=["as-it-came", "tapped"])
@pytest.mark.parametrize("kind", list(KINDS))
async def test_shutdown_ends_a_busy_watch_after_the_event_in_flight(kind: str,
                                                                    tapped: bool) -> None:
    """SIGTERM inside an event whose end comes in one read with the next events: the watch
    ends between two events of that read, with the last chunk. The fast relay, passing the
    body on as it came, looked only at where each read ended: inside the next event, so a
    watch whose events came back to back (a backlog of big objects) was cut after 1 s, an
    event short (client-go: an unexpected EOF)."""
    watch = BusyWatch(kind)
    data, clean = await _shut_down_inside_an_event(watch, tapped)
    whole = watch.first + watch.second
    assert data in (whole, whole + watch.third), f"{len(data)} bytes: not whole events"
    assert clean, "no last chunk"


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", list(KINDS))
async def test_shutdown_inside_a_split_event_ends_after_it_for_http10(kind: str) -> None:
    """An HTTP/1.0 client's watch (its body ends with the connection; the fast relay parses
    the chunks) ends after the event too."""
    watch = SplitWatch(kind)
    up = await RawUpstream(watch.serve).start()
    try:
        async with running_proxy(up.url, shutdown_timeout=5.0) as proxy:
            reader, writer = await _open_watch(proxy.url, watch, version=b"1.0")
            closing = asyncio.create_task(proxy.listener.close())
            await asyncio.sleep(PAUSE)
            watch.go_on.set()
            data = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            await asyncio.wait_for(closing, 8)
    finally:
        await up.close()
    _whole_events(data, watch)
    assert data == watch.first + watch.second


@pytest.mark.asyncio
@pytest.mark.parametrize("tapped", [False, True], ids=["as-it-came", "tapped"])
@pytest.mark.parametrize("kind", list(KINDS))
async def test_idle_timeout_inside_a_split_event_ends_after_it(kind: str, tapped: bool) -> None:
    """The watch idle timeout passes while the apiserver is between the two chunks of an event:
    the watch ends once the event is whole (it waits up to 1 s more for it), with the last
    chunk (before: right after its first half)."""
    watch = SplitWatch(kind)
    up = await RawUpstream(watch.serve).start()
    try:
        async with running_proxy(up.url, settings=RelaySettings(watch_idle_timeout=0.3),
                                 middlewares=(Tapping(),) if tapped else ()) as proxy:
            reader, writer = await _open_watch(proxy.url, watch)
            await asyncio.sleep(PAUSE)  # past the idle timeout
            watch.go_on.set()
            data, clean = await asyncio.wait_for(read_body(reader), 5)
            writer.close()
    finally:
        await up.close()
    _whole_events(data, watch)
    assert data == watch.first + watch.second
    assert clean, "no last chunk"


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", list(KINDS))
async def test_shutdown_between_events_ends_at_once(kind: str) -> None:
    """A watch between two events at shutdown still ends at once, with the last chunk."""
    watch = SplitWatch(kind)
    watch.go_on.set()
    up = await RawUpstream(watch.serve).start()
    loop = asyncio.get_running_loop()
    try:
        async with running_proxy(up.url, shutdown_timeout=5.0) as proxy:
            reader, writer = await _open_watch(proxy.url, watch)
            await asyncio.sleep(0.1)  # the second half too
            started = loop.time()
            closing = asyncio.create_task(proxy.listener.close())
            data, clean = await asyncio.wait_for(read_body(reader), 5)
            took = loop.time() - started
            writer.close()
            await asyncio.wait_for(closing, 8)
    finally:
        await up.close()
    assert data == watch.first + watch.second
    assert clean, "no last chunk"
    assert took < 0.5, took


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", list(KINDS))
async def test_shutdown_inside_a_stalled_event_cuts_it_within_the_bound(kind: str) -> None:
    """An event whose rest never comes: the watch is cut (no last chunk: the client sees a
    broken stream, not a short event read as whole) within the listener's 1 s."""
    watch = SplitWatch(kind)
    up = await RawUpstream(watch.serve).start()
    loop = asyncio.get_running_loop()
    try:
        async with running_proxy(up.url, shutdown_timeout=5.0) as proxy:
            reader, writer = await _open_watch(proxy.url, watch)
            started = loop.time()
            closing = asyncio.create_task(proxy.listener.close())
            data, clean = await asyncio.wait_for(read_body(reader), 5)
            took = loop.time() - started
            writer.close()
            await asyncio.wait_for(closing, 8)
    finally:
        watch.go_on.set()
        await up.close()
    assert data == watch.first + watch.second[:2048]
    assert not clean, "a last chunk after half an event"
    assert 0.8 < took < 2.0, took


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", list(KINDS))
async def test_idle_timeout_inside_a_stalled_event_cuts_it(kind: str) -> None:
    """The idle timeout inside an event whose rest never comes: cut 1 s later (no last chunk),
    not ended as if the half event were whole."""
    watch = SplitWatch(kind)
    up = await RawUpstream(watch.serve).start()
    loop = asyncio.get_running_loop()
    try:
        async with running_proxy(up.url, settings=RelaySettings(watch_idle_timeout=0.3)) as proxy:
            reader, writer = await _open_watch(proxy.url, watch)
            started = loop.time()
            data, clean = await asyncio.wait_for(read_body(reader), 5)
            took = loop.time() - started
            writer.close()
    finally:
        watch.go_on.set()
        await up.close()
    assert data == watch.first + watch.second[:2048]
    assert not clean, "a last chunk after half an event"
    assert 0.9 < took < 2.5, took


@pytest.mark.asyncio
async def test_shutdown_lets_a_long_running_length_framed_body_finish() -> None:
    """A pod's log (long-running) with a Content-Length, to a client that asked the connection
    to close after it: at shutdown it gets up to the listener's 1 s to finish (before, the fast
    relay took it for close-delimited and ended it at once, the body short of its length)."""
    body = b"log line\n" * 20_000
    halfway = asyncio.Event()

    async def logs(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n"
                     % len(body) + body[:1000])
        await writer.drain()
        halfway.set()
        await asyncio.sleep(PAUSE)
        writer.write(body[1000:])
        await writer.drain()
        await wait_closed(reader)

    up = await RawUpstream(logs).start()
    try:
        async with running_proxy(up.url, shutdown_timeout=5.0) as proxy:
            host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /api/v1/namespaces/a/pods/p/log HTTP/1.1\r\nHost: x\r\n"
                         b"Connection: close\r\n\r\n")
            _, headers = await asyncio.wait_for(read_head(reader), 5)
            assert headers["content-length"] == str(len(body))
            await asyncio.wait_for(halfway.wait(), 5)
            await asyncio.sleep(0.1)
            closing = asyncio.create_task(proxy.listener.close())
            got = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            await asyncio.wait_for(closing, 8)
    finally:
        await up.close()
    assert got == body
