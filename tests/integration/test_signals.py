"""Signals to a real ``opgate serve`` process, on both relays: SIGTERM and SIGINT drain (calls
in flight finish, exit 0); a second one during the drain cuts the calls still running and the
shutdown goes on as usual (exit 0, the access log written, no traceback) instead of the process
dying of the signal (exit 143, the last access and audit records lost)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from proxy.relay.aftercare import CUT_AT_SHUTDOWN
from tests.integration.fakes import AiohttpUpstream, status_of
from tests.integration.opgate_proc import OpgateProcess, open_once_read

SLOW = "/api/v1/namespaces/slow/configmaps"
POLICY = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {name: p}
spec: {mode: enforce}
"""


@pytest.fixture
async def upstream() -> AsyncIterator[str]:
    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        await asyncio.sleep(float(request.query.get("sleep", "0")))
        return web.json_response({"kind": "ConfigMapList", "apiVersion": "v1", "items": []})

    up = await AiohttpUpstream(handle).start()
    yield up.url
    await up.close()


async def _until_in_flight(opgate: OpgateProcess, calls: int) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(200):
            async with s.get(opgate.admin_url + "/metrics") as resp:
                if f"opgate_inflight_requests {calls}.0" in await resp.text():
                    return
            await asyncio.sleep(0.05)
    raise AssertionError("the call is not in flight")


@pytest.mark.asyncio
@pytest.mark.parametrize("relay", ["fast", "aiohttp"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_second_signal_cuts_the_drain_short_and_exits_cleanly(
    upstream: str, tmp_path: Path, relay: str, sig: signal.Signals
) -> None:
    opgate = OpgateProcess("--upstream", upstream, "--relay", relay, log_dir=tmp_path)
    try:
        await asyncio.to_thread(opgate.wait_ready)
        slow = asyncio.create_task(status_of(opgate.url + SLOW + "?sleep=60"))
        await _until_in_flight(opgate, 1)
        opgate.proc.send_signal(sig)
        deadline = time.monotonic() + 20
        while "shutting down" not in opgate.stderr():
            assert time.monotonic() < deadline, opgate.stderr()
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        assert opgate.proc.poll() is None  # draining: the call has its grace
        opgate.proc.send_signal(sig)
        code = await asyncio.to_thread(opgate.proc.wait, 20)
        outcome = await asyncio.wait_for(slow, 10)
    finally:
        opgate.stop()
    assert code == 0, opgate.stderr()
    assert outcome != 200, outcome  # cut, not waited for
    err = opgate.stderr()
    assert f"{sig.name} again: the calls still in flight are cut now" in err, err
    assert "Traceback" not in err, err
    assert_cut_by_opgate(opgate)


def assert_cut_by_opgate(opgate: OpgateProcess) -> None:
    """The call cut at shutdown is recorded, as cut by opgate (not as left by its client)."""
    records = [json.loads(line) for line in opgate.stdout().splitlines() if line.startswith("{")]
    assert [r["verb"] for r in records] == ["list"], records
    assert records[0]["error"] == CUT_AT_SHUTDOWN, records


def _two_calls_on_one_connection(url: str) -> tuple[int, str]:
    """A slow call, then at once a second on the same kept-alive connection (as Go's transport
    reuses one): the first's status, and the second's or the error that ended it."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=20)
    try:
        conn.request("GET", SLOW + "?sleep=1")
        first = conn.getresponse()
        first.read()
        try:
            conn.request("GET", SLOW)
            second = conn.getresponse()
            second.read()
            return first.status, str(second.status)
        except (OSError, http.client.HTTPException) as exc:
            return first.status, type(exc).__name__
    finally:
        conn.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("relay", ["fast", "aiohttp"])
async def test_a_kept_alive_connection_takes_no_new_call_once_draining(
        upstream: str, tmp_path: Path, relay: str) -> None:
    """During the drain a call in flight finishes, and its connection is closed after it: a
    call the client sends next on it (a controller's informer watching again the moment opgate
    ended its watch) is not started only to be ended at once (client-go takes a watch ended
    within a second without an event for a failure and lists everything again); the client
    dials again and is refused, which it retries."""
    opgate = OpgateProcess("--upstream", upstream, "--relay", relay, log_dir=tmp_path)
    try:
        await asyncio.to_thread(opgate.wait_ready)
        calls = asyncio.create_task(asyncio.to_thread(_two_calls_on_one_connection, opgate.url))
        await _until_in_flight(opgate, 1)
        opgate.proc.send_signal(signal.SIGTERM)
        first, second = await asyncio.wait_for(calls, 20)
        code = await asyncio.to_thread(opgate.proc.wait, 20)
    finally:
        opgate.stop()
    assert code == 0, opgate.stderr()
    assert first == 200
    assert second != "200", "a call was started on a connection of a draining opgate"


async def _idle_kept_alive(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that has had one call answered and is kept alive, idle."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET {SLOW} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
    assert head.startswith("http/1.1 200") and "connection: close" not in head, head
    length = head.split("content-length:", 1)[1].split("\r\n", 1)[0]
    await reader.readexactly(int(length))
    return reader, writer


@pytest.mark.asyncio
@pytest.mark.parametrize("relay", ["fast", "aiohttp"])
async def test_an_idle_kept_alive_connection_is_closed_as_the_drain_starts(
        upstream: str, tmp_path: Path, relay: str) -> None:
    """An idle keep-alive connection is closed at SIGTERM, not when the drain ends: its client
    (Go's transport sees the EOF and drops it from its pool) dials again for its next call and
    is refused at once. On the aiohttp relay the connection stayed open, unread, until the
    calls in flight had finished (up to the grace): a call its client sent on it meanwhile was
    never answered, and got an EOF only as opgate exited."""
    opgate = OpgateProcess("--upstream", upstream, "--relay", relay, "--shutdown-grace", "30",
                           log_dir=tmp_path)
    try:
        await asyncio.to_thread(opgate.wait_ready)
        reader, writer = await _idle_kept_alive(opgate.url)
        slow = asyncio.create_task(status_of(opgate.url + SLOW + "?sleep=60"))
        await _until_in_flight(opgate, 1)
        opgate.proc.send_signal(signal.SIGTERM)
        try:
            left = await asyncio.wait_for(reader.read(), 10)  # (the grace is 30 s)
        finally:
            writer.close()
        assert opgate.proc.poll() is None  # still draining: the slow call has its grace
        opgate.proc.send_signal(signal.SIGTERM)  # (cut it: the test is done)
        code = await asyncio.to_thread(opgate.proc.wait, 20)
        await asyncio.wait_for(slow, 10)
    finally:
        opgate.stop()
    assert left == b"", left
    assert code == 0, opgate.stderr()


@pytest.mark.asyncio
@pytest.mark.parametrize("relay", ["fast", "aiohttp"])
async def test_an_answer_written_while_draining_says_connection_close(
        upstream: str, tmp_path: Path, relay: str) -> None:
    """A call in flight at SIGTERM is answered with ``Connection: close``, as the apiserver
    answers while it shuts down (Go's server turns keep-alives off): its client then never
    sends another call on the connection. Without it the connection was closed after the
    answer unannounced, and a client that took it from its pool for its next call before it
    saw the FIN lost that call (Go retries only a replayable one)."""
    opgate = OpgateProcess("--upstream", upstream, "--relay", relay, log_dir=tmp_path)
    try:
        await asyncio.to_thread(opgate.wait_ready)
        host, port = opgate.url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"GET {SLOW}?sleep=1 HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        await _until_in_flight(opgate, 1)
        opgate.proc.send_signal(signal.SIGTERM)
        try:
            head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)).lower()
            rest = await asyncio.wait_for(reader.read(), 20)
        finally:
            writer.close()
        code = await asyncio.to_thread(opgate.proc.wait, 20)
    finally:
        opgate.stop()
    assert head.startswith(b"http/1.1 200"), head
    assert b"\r\nconnection: close\r\n" in head, head
    assert rest.endswith(b"[]}"), rest  # the whole answer, then the connection's end
    assert code == 0, opgate.stderr()


@pytest.mark.asyncio
@pytest.mark.parametrize("relay", ["fast", "aiohttp"])
async def test_a_list_read_slowly_through_the_drain_reaches_its_client_whole(
        tmp_path: Path, relay: str) -> None:
    """A LIST in flight at SIGTERM, read slowly by its client (a busy controller), reaches it
    whole within the grace, its last bytes included: opgate is done with the call only once
    its answer has left opgate's write buffer. The aiohttp relay took a connection whose call
    had been relayed to its end for idle while that buffer still held the answer's last bytes,
    and (cutting what was left at the end of the drain) dropped them: the client saw a body
    short of its Content-Length."""
    size = 24 * 1024 * 1024  # (more than the kernel's socket buffers hold)

    async def big(request: web.BaseRequest) -> web.StreamResponse:
        return web.Response(body=b"x" * size, content_type="application/json")

    up = await AiohttpUpstream(big).start()
    opgate = OpgateProcess("--upstream", up.url, "--relay", relay, "--shutdown-grace", "30",
                           log_dir=tmp_path)
    try:
        await asyncio.to_thread(opgate.wait_ready)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", opgate.port))
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(b"GET /api/v1/pods HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        await reader.readuntil(b"\r\n\r\n")
        try:
            got = len(await reader.read(65536))
            opgate.proc.send_signal(signal.SIGTERM)
            while chunk := await asyncio.wait_for(reader.read(65536), 30):
                got += len(chunk)
                await asyncio.sleep(0.002)  # (a slow reader: opgate's buffers stay full)
        finally:
            writer.close()
        code = await asyncio.to_thread(opgate.proc.wait, 20)
    finally:
        opgate.stop()
        await up.close()
    assert code == 0, opgate.stderr()
    assert got == size, f"{size - got} bytes of the answer lost"


@pytest.mark.asyncio
@pytest.mark.parametrize("relay", ["fast", "aiohttp"])
async def test_sigint_drains_like_sigterm(upstream: str, tmp_path: Path, relay: str) -> None:
    opgate = OpgateProcess("--upstream", upstream, "--relay", relay, log_dir=tmp_path)
    try:
        await asyncio.to_thread(opgate.wait_ready)
        slow = asyncio.create_task(status_of(opgate.url + SLOW + "?sleep=1.5"))
        await _until_in_flight(opgate, 1)
        opgate.proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(slow, 20) == 200
        code = await asyncio.to_thread(opgate.proc.wait, 20)
    finally:
        opgate.stop()
    assert code == 0
    assert "Traceback" not in opgate.stderr()


@pytest.mark.asyncio
@pytest.mark.parametrize("relay", ["fast", "aiohttp"])
async def test_shutdown_grace_bounds_the_drain(upstream: str, tmp_path: Path, relay: str) -> None:
    """``--shutdown-grace`` replaces the 10 s default: a call that would take a minute is cut
    once it has passed, and the process exits well before the default would have let it."""
    opgate = OpgateProcess("--upstream", upstream, "--relay", relay, "--shutdown-grace", "0.5",
                           log_dir=tmp_path)
    try:
        await asyncio.to_thread(opgate.wait_ready)
        slow = asyncio.create_task(status_of(opgate.url + SLOW + "?sleep=60"))
        await _until_in_flight(opgate, 1)
        opgate.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = await asyncio.to_thread(opgate.proc.wait, 20)
        took = time.monotonic() - signalled
        outcome = await asyncio.wait_for(slow, 10)
    finally:
        opgate.stop()
    assert code == 0, opgate.stderr()
    assert outcome != 200, outcome
    assert took < 7.0, f"exited {took:.1f} s after SIGTERM with a 0.5 s grace"
    assert "Traceback" not in opgate.stderr()
    assert_cut_by_opgate(opgate)


@pytest.mark.asyncio
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_signal_while_starting_stops_it_cleanly(
    upstream: str, tmp_path: Path, sig: signal.Signals
) -> None:
    """A SIGTERM that comes before opgate serves (a pod deleted as it starts) stops it as one
    that comes later does: exit 0 after a clean stop. It used to meet the signal's default
    disposition: killed (143) outside a container and, as a container's PID 1 (to which the
    kernel delivers only signals with a handler), ignored, so the pod hung in Terminating for
    its whole grace period until kubelet's SIGKILL. opgate reads its policies from a FIFO
    here, which holds its start until the test has signalled it."""
    fifo = tmp_path / "policy.yaml"
    os.mkfifo(fifo)
    opgate = OpgateProcess("--upstream", upstream, "--policies", str(fifo), log_dir=tmp_path)
    try:
        fd = await asyncio.to_thread(open_once_read, fifo, opgate.proc, opgate.stderr)
        opgate.proc.send_signal(sig)
        os.write(fd, POLICY.encode())  # the policies: the start goes on
        os.close(fd)
        code = await asyncio.to_thread(opgate.proc.wait, 20)
    finally:
        opgate.stop()
    err = opgate.stderr()
    assert code == 0, err
    assert "shutting down" in err, err
    assert "Traceback" not in err, err
