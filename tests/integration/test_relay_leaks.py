"""Connection hygiene, repeated: whichever side goes away mid-call, the other side's connection
is released, every time, and the relay's file descriptors do not grow.

Each scenario runs many times against a raw upstream (an upstream must stall or drop on
demand); every upstream connection must end (``RawUpstream.closed``) soon after its client
left, and the process's open descriptors return to their level before the runs.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable

import pytest

from tests.integration.fakes import RawUpstream, read_head, run_on, running_proxy, wait_closed

pytestmark = pytest.mark.usefixtures("each_relay")  # every test on both relay cores


RUNS = 25
Scenario = Callable[[str, int], Awaitable[None]]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """By path: ``/list`` a LIST that never ends, ``/watch`` events, ``/stall`` no head,
    ``/upload`` reads a body, ``/exec`` an upgrade that echoes, ``/attach`` one that dies after
    one echo, ``/die`` a body cut short."""
    line, _ = await read_head(reader)
    path = line.split(" ")[1]
    chunked = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" \
              b"Transfer-Encoding: chunked\r\n\r\n"
    if path.startswith("/api/v1/pods?limit"):  # a LIST streaming slowly
        writer.write(chunked + b'800\r\n' + b"x" * 0x800 + b"\r\n")
        while True:
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(b"10\r\n" + b"y" * 16 + b"\r\n")
    elif "watch" in path:
        writer.write(chunked + b'14\r\n{"type":"BOOKMARK"}\n\r\n')
        await writer.drain()
        await wait_closed(reader)
    elif path.startswith("/api/v1/namespaces/stall"):
        await wait_closed(reader)  # no response head, ever
    elif path.startswith("/api/v1/namespaces/upload"):
        await wait_closed(reader)  # reads the body as it comes, answers never
    elif path.endswith("/attach"):  # an upgrade whose upstream dies once it answered
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
                     b"Upgrade: SPDY/3.1\r\n\r\n")
        writer.write(await reader.read(65536))
        await writer.drain()
        writer.transport.abort()
    elif path.endswith("/exec"):
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
                     b"Upgrade: SPDY/3.1\r\n\r\n")
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    elif path.startswith("/api/v1/namespaces/die"):
        writer.write(chunked + b'14\r\n{"type":"BOOKMARK"}\n\r\n' + b"400\r\npartial")
        await writer.drain()
        writer.transport.abort()  # the upstream dies mid-body (RST)


async def _connect(host: str, port: int, request: bytes) -> tuple[
        asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(request)
    await writer.drain()
    return reader, writer


async def mid_list(host: str, port: int) -> None:
    reader, writer = await _connect(host, port, b"GET /api/v1/pods?limit=500 HTTP/1.1\r\n"
                                    b"Host: x\r\n\r\n")
    await reader.readexactly(100)
    writer.transport.abort()


async def mid_watch(host: str, port: int) -> None:
    reader, writer = await _connect(host, port, b"GET /api/v1/pods?watch=1 HTTP/1.1\r\n"
                                    b"Host: x\r\n\r\n")
    await reader.readuntil(b"BOOKMARK")
    writer.close()


async def waiting_for_head(host: str, port: int) -> None:
    _, writer = await _connect(host, port, b"GET /api/v1/namespaces/stall/pods HTTP/1.1\r\n"
                               b"Host: x\r\n\r\n")
    await asyncio.sleep(0.05)
    writer.close()


async def mid_upload(host: str, port: int) -> None:
    _, writer = await _connect(
        host, port, b"POST /api/v1/namespaces/upload/configmaps HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n" + b"{" * 70000)
    await asyncio.sleep(0.05)
    writer.transport.abort()


async def mid_tunnel(host: str, port: int) -> None:
    reader, writer = await _connect(
        host, port, b"POST /api/v1/namespaces/a/pods/p/exec HTTP/1.1\r\nHost: x\r\n"
        b"Connection: Upgrade\r\nUpgrade: SPDY/3.1\r\n\r\n")
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"ping")
    assert await reader.readexactly(4) == b"ping"
    writer.close()


async def upstream_dies(host: str, port: int) -> None:
    reader, writer = await _connect(host, port, b"GET /api/v1/namespaces/die/pods HTTP/1.1\r\n"
                                    b"Host: x\r\n\r\n")
    rest = await asyncio.wait_for(reader.read(-1), 5)  # the relay closes the client too
    assert b"BOOKMARK" in rest and not rest.endswith(b"0\r\n\r\n"), rest[-40:]
    writer.close()


async def upstream_dies_mid_tunnel(host: str, port: int) -> None:
    reader, writer = await _connect(
        host, port, b"POST /api/v1/namespaces/a/pods/p/attach HTTP/1.1\r\nHost: x\r\n"
        b"Connection: Upgrade\r\nUpgrade: SPDY/3.1\r\n\r\n")
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"ping")
    rest = await asyncio.wait_for(reader.read(-1), 5)  # then the relay closes the client
    assert rest == b"ping", rest
    writer.close()


SCENARIOS: dict[str, Scenario] = {
    "mid-list": mid_list, "mid-watch": mid_watch, "waiting-for-head": waiting_for_head,
    "mid-upload": mid_upload, "mid-tunnel": mid_tunnel, "upstream-dies": upstream_dies,
    "upstream-dies-mid-tunnel": upstream_dies_mid_tunnel,
}


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])  # opgate's default loop, and asyncio's
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_other_side_is_released_every_time(scenario: str, loop: str) -> None:
    run_on(loop, lambda: _released_every_time(SCENARIOS[scenario]))


async def _released_every_time(run: Scenario) -> None:
    up = await RawUpstream(_upstream).start()
    try:
        async with running_proxy(up.url) as proxy:
            host, port = proxy.listener.address.rsplit(":", 1)
            await run(host, int(port))  # warm up: the pool, lazily made objects
            await asyncio.wait_for(up.closed.get(), 10)
            await asyncio.sleep(0.2)
            before = open_fds()
            for i in range(RUNS):
                await run(host, int(port))
                try:
                    await asyncio.wait_for(up.closed.get(), 10)  # its upstream connection ended
                except TimeoutError:
                    raise AssertionError(f"run {i}: the upstream connection is still open") \
                        from None
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while open_fds() > before + 2:  # the client sides close a moment later
                assert loop.time() < deadline, (before, open_fds(), os.listdir("/proc/self/fd"))
                await asyncio.sleep(0.05)
            assert up.connections == RUNS + 1
    finally:
        await up.close()
