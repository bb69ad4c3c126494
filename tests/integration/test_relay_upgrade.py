"""Upgrades (exec/attach/port-forward): the 101 and a raw byte tunnel, SPDY/3.1 and WebSocket."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import threading
from pathlib import Path
from typing import Any

import pytest

from proxy.engine.context import Deny, RequestContext
from proxy.engine.status import StatusError
from proxy.envtest.procs import free_port
from tests.integration.fakes import (
    RawUpstream,
    make_cert,
    read_head,
    run_on,
    running_proxy,
    server_context,
    wait_closed,
)

pytestmark = pytest.mark.usefixtures("each_relay")  # every test on both relay cores

PROTOCOLS = {
    "SPDY/3.1": (
        b"POST /api/v1/namespaces/a/pods/p/exec?command=sh&stdin=true&stdout=true HTTP/1.1\r\n"
        b"Host: x\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n"
        b"X-Stream-Protocol-Version: v4.channel.k8s.io\r\n"
        b"X-Stream-Protocol-Version: channel.k8s.io\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n"
        b"X-Stream-Protocol-Version: v4.channel.k8s.io\r\n\r\n",
    ),
    "websocket": (
        b"GET /api/v1/namespaces/a/pods/p/portforward?ports=80 HTTP/1.1\r\nHost: x\r\n"
        b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"Sec-WebSocket-Protocol: v4.channel.k8s.io\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n"
        b"Sec-WebSocket-Protocol: v4.channel.k8s.io\r\n\r\n",
    ),
}
GREETING = b"\x80\x03\x00\x02server-speaks-first" + os.urandom(64)


class Upgrader:
    """A fake apiserver that answers 101, greets, then echoes until the client half closes."""

    def __init__(self, answer: bytes, *, hang_up_after: int | None = None) -> None:
        self.answer = answer
        self.hang_up_after = hang_up_after
        self.heads: list[tuple[str, dict[str, str]]] = []
        self.received = 0

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.heads.append(await read_head(reader))
        writer.write(self.answer + GREETING)  # the 101 and the first frame in one segment
        while data := await reader.read(65536):
            self.received += len(data)
            writer.write(data)
            await writer.drain()
            if self.hang_up_after is not None and self.received >= self.hang_up_after:
                return


async def open_tunnel(
    address: str, protocol: str, *, tls: ssl.SSLContext | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str, dict[str, str]]:
    if address.startswith("unix:"):
        reader, writer = await asyncio.open_unix_connection(address.removeprefix("unix:"))
    else:
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port), ssl=tls)
    writer.write(PROTOCOLS[protocol][0])
    status, headers = await read_head(reader)
    return reader, writer, status, headers


class CountEntries:
    name = "count"
    needs_body = False
    fail_open = False

    def __init__(self) -> None:
        self.entries = 0
        self.exits: list[tuple[int, int, int]] = []

    async def entry(self, ctx: RequestContext) -> None:
        self.entries += 1

    async def exit(self, ctx: RequestContext) -> None:
        self.exits.append((ctx.status_code, ctx.bytes_in, ctx.bytes_out))


@pytest.mark.asyncio
@pytest.mark.parametrize("protocol", list(PROTOCOLS))
async def test_tunnel_is_byte_exact_both_ways_and_client_close_ends_it(protocol: str) -> None:
    fake = Upgrader(PROTOCOLS[protocol][1])
    up = await RawUpstream(fake).start()
    counter = CountEntries()
    payload = os.urandom(3 * 1024 * 1024)
    loop = asyncio.get_running_loop()
    try:
        async with running_proxy(up.url, middlewares=(counter,), token="t0k") as proxy:
            reader, writer, status, headers = await open_tunnel(proxy.listener.address, protocol)
            assert status.startswith("HTTP/1.1 101")
            assert headers["upgrade"] == protocol
            assert headers["connection"].lower() == "upgrade"
            assert "server" not in headers and "content-length" not in headers
            if protocol == "websocket":
                assert headers["sec-websocket-accept"] == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
            assert await reader.readexactly(len(GREETING)) == GREETING

            async def send() -> None:
                for i in range(0, len(payload), 100_000):
                    writer.write(payload[i : i + 100_000])
                    await writer.drain()

            sender = asyncio.create_task(send())
            echoed = await asyncio.wait_for(reader.readexactly(len(payload)), 20)
            await sender
            assert echoed == payload
            left = loop.time()
            writer.close()
            ended = await asyncio.wait_for(up.closed.get(), 5)
            assert ended - left < 1.0
            for _ in range(100):
                if counter.exits:
                    break
                await asyncio.sleep(0.02)
    finally:
        await up.close()
    first_line, up_headers = fake.heads[0]
    assert first_line.split(" ")[1] == PROTOCOLS[protocol][0].split(b" ")[1].decode()
    assert up_headers["upgrade"] == protocol
    assert up_headers["connection"] == "Upgrade"
    assert up_headers["authorization"] == "Bearer t0k"
    assert up_headers["host"] == up.url.removeprefix("http://")
    assert counter.entries == 1
    assert counter.exits and counter.exits[0][0] == 101
    assert counter.exits[0][1] == len(payload)
    assert counter.exits[0][2] == len(GREETING) + len(payload)


@pytest.mark.asyncio
@pytest.mark.parametrize("protocol", list(PROTOCOLS))
async def test_upstream_closing_the_tunnel_closes_the_client(protocol: str) -> None:
    up = await RawUpstream(Upgrader(PROTOCOLS[protocol][1], hang_up_after=5)).start()
    loop = asyncio.get_running_loop()
    try:
        async with running_proxy(up.url) as proxy:
            reader, writer, status, _ = await open_tunnel(proxy.listener.address, protocol)
            assert status.startswith("HTTP/1.1 101")
            await reader.readexactly(len(GREETING))
            writer.write(b"hello")
            assert await reader.readexactly(5) == b"hello"
            await asyncio.wait_for(up.closed.get(), 5)
            hung_up = loop.time()
            await asyncio.wait_for(wait_closed(reader), 5)
            assert loop.time() - hung_up < 1.0
            writer.close()
            # the listener still serves after a tunnel
            reader, writer, status, _ = await open_tunnel(proxy.listener.address, protocol)
            assert status.startswith("HTTP/1.1 101")
            writer.close()
    finally:
        await up.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("framing", ["length", "chunked"])
async def test_refused_upgrade_is_relayed_as_a_normal_response(framing: str) -> None:
    body = b'{"kind":"Status","apiVersion":"v1","status":"Failure","code":403}'
    if framing == "length":
        answer = b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\n"
        answer += b"Content-Length: %d\r\n\r\n" % len(body) + body
    else:
        answer = b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\n"
        answer += b"Transfer-Encoding: chunked\r\n\r\n"
        answer += b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(answer)
        await writer.drain()
        await wait_closed(reader)

    up = await RawUpstream(refuse).start()
    try:
        async with running_proxy(up.url) as proxy:
            reader, writer, status, headers = await open_tunnel(proxy.listener.address, "SPDY/3.1")
            assert status.startswith("HTTP/1.1 403")
            assert headers["content-type"] == "application/json"
            if framing == "length":
                assert await reader.readexactly(len(body)) == body
            else:
                assert headers["transfer-encoding"] == "chunked"
                data = await asyncio.wait_for(reader.read(), 5)
                assert body in data and data.endswith(b"0\r\n\r\n")
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed after it
            writer.close()
    finally:
        await up.close()


@pytest.mark.asyncio
async def test_tunnel_over_tls_on_both_sides(tmp_path: Any) -> None:
    cert, key = make_cert(str(tmp_path))
    listener_cert, listener_key = make_cert(str(tmp_path), name="listener")
    alpn: list[str | None] = []

    async def upgrade(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        alpn.append(writer.get_extra_info("ssl_object").selected_alpn_protocol())
        await Upgrader(PROTOCOLS["SPDY/3.1"][1])(reader, writer)

    context = server_context(cert, key)
    context.set_alpn_protocols(["h2", "http/1.1"])
    up = await RawUpstream(upgrade).start(ssl_context=context)
    try:
        async with running_proxy(
            up.url, ca_file=cert, tls_cert=listener_cert, tls_key=listener_key
        ) as proxy:
            trust = ssl.create_default_context(cafile=listener_cert)
            reader, writer, status, _ = await open_tunnel(
                proxy.listener.address, "SPDY/3.1", tls=trust
            )
            assert status.startswith("HTTP/1.1 101")
            assert await reader.readexactly(len(GREETING)) == GREETING
            payload = os.urandom(1024 * 1024)
            writer.write(payload)
            assert await asyncio.wait_for(reader.readexactly(len(payload)), 20) == payload
            writer.close()
            await asyncio.wait_for(up.closed.get(), 5)
    finally:
        await up.close()
    assert alpn == ["http/1.1"]


@pytest.mark.asyncio
async def test_upgrade_to_an_unreachable_upstream_is_a_503() -> None:
    async with running_proxy(f"http://127.0.0.1:{free_port()}") as proxy:
        reader, writer, status, headers = await open_tunnel(proxy.listener.address, "websocket")
        assert status.startswith("HTTP/1.1 503")
        body = await reader.readexactly(int(headers["content-length"]))
        assert b'"reason":"ServiceUnavailable"' in body
        writer.close()


class DenyExec:
    name = "deny-exec"
    needs_body = False
    fail_open = False

    async def entry(self, ctx: RequestContext) -> Deny | None:
        if ctx.info.subresource == "exec":
            ctx.warn("exec is off")
            return Deny(StatusError(403, "exec denied by test", "Forbidden"))
        return None


@pytest.mark.asyncio
async def test_denied_upgrade_gets_a_status_and_the_connection_closes() -> None:
    fake = Upgrader(PROTOCOLS["SPDY/3.1"][1])
    up = await RawUpstream(fake).start()
    try:
        async with running_proxy(up.url, middlewares=(DenyExec(),)) as proxy:
            reader, writer, status, headers = await open_tunnel(proxy.listener.address, "SPDY/3.1")
            assert status.startswith("HTTP/1.1 403")
            assert "exec is off" in headers["warning"]
            body = await reader.readexactly(int(headers["content-length"]))
            assert b'"reason":"Forbidden"' in body
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
            reader, writer, status, _ = await open_tunnel(proxy.listener.address, "websocket")
            assert status.startswith("HTTP/1.1 101")  # port-forward is not denied
            writer.close()
    finally:
        await up.close()
    assert len(fake.heads) == 1


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])  # opgate's default loop, and asyncio's
def test_every_byte_the_upstream_sent_before_closing_reaches_the_client(
        loop: str, tmp_path: Any) -> None:
    """kubectl exec's output ends with the apiserver (Go's TLS) closing the connection right
    after its last bytes: all of them reach the client, also one that reads them only later."""
    run_on(loop, lambda: _upstream_closes_right_after_its_last_bytes(tmp_path))


def _send_then_close(listener: socket.socket, context: ssl.SSLContext, data: bytes,
                     done: threading.Event) -> None:
    """One TLS connection that gets ``data`` and then at once the TCP FIN (Go's tls.Conn does
    not wait for the peer's close_notify), served by a thread: nothing of the loop's."""
    conn, _ = listener.accept()
    with context.wrap_socket(conn, server_side=True) as tls:
        head = b""
        while b"\r\n\r\n" not in head:
            head += tls.recv(65536)
        tls.sendall(data)
    done.set()


async def _upstream_closes_right_after_its_last_bytes(tmp: Path) -> None:
    """The client (on a Unix socket: a fixed send buffer, no TCP autotuning) reads nothing until
    the upstream has sent everything and closed, so the relay has paused reading the upstream
    when the FIN comes, with some of the last bytes still in the TLS layer: where exactly
    depends on the buffers, hence a range of sizes (on a Linux default, the relay pauses at
    about 1 MB, and every size between that and 256 KiB more lost bytes: 1-1.2 MB)."""
    cert, key = make_cert(str(tmp))
    context = server_context(cert, key)
    for size in range(600_000, 1_700_000, 50_000):  # all fit in the buffers on the way
        payload = os.urandom(size)
        listener = socket.create_server(("127.0.0.1", 0))
        done = threading.Event()
        thread = threading.Thread(target=_send_then_close, daemon=True, args=(
            listener, context, PROTOCOLS["SPDY/3.1"][1] + payload, done))
        thread.start()
        try:
            async with running_proxy(f"https://127.0.0.1:{listener.getsockname()[1]}",
                                     ca_file=cert, listen=f"unix:{tmp}/api.sock") as proxy:
                reader, writer, status, _ = await open_tunnel(proxy.listener.address, "SPDY/3.1")
                assert status.startswith("HTTP/1.1 101")
                assert await asyncio.to_thread(done.wait, 30), f"{size}: the upstream is stuck"
                got = await asyncio.wait_for(reader.read(), 60)
                writer.close()
                assert (size, len(got), got == payload) == (size, size, True)
        finally:
            listener.close()
            thread.join(10)
