"""The API listener with few file descriptors to spare: a real ``opgate serve`` started with a
low soft ``RLIMIT_NOFILE`` (``prlimit``), as a container runtime may leave it, and hundreds of
clients at once.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.integration.fakes import AiohttpUpstream, ok_handler
from tests.integration.opgate_proc import OpgateProcess

CLIENTS = 400


@pytest.fixture
async def upstream() -> AsyncIterator[AiohttpUpstream]:
    up = await AiohttpUpstream(ok_handler).start()
    yield up
    await up.close()


def _open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def statuses(port: int, clients: int, *, accepted_by: int | None = None
                   ) -> dict[bytes, int]:
    """Open ``clients`` connections first, then make one GET on each, all at once: how many
    got each status line (or the error that ended the call). ``accepted_by``: the server's
    PID, whose descriptors show when it has accepted every connection (the kernel completes
    a connect before the server accepts it): only then are the GETs sent."""
    before = _open_files(accepted_by) if accepted_by is not None else 0
    connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(clients)]
    if accepted_by is not None:
        deadline = asyncio.get_running_loop().time() + 10
        while _open_files(accepted_by) < before + clients:
            assert asyncio.get_running_loop().time() < deadline, _open_files(accepted_by)
            await asyncio.sleep(0.02)  # (another process's descriptors: nothing to await)

    async def get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        writer.write(b"GET /api/v1/namespaces HTTP/1.1\r\nHost: localhost\r\n"
                     b"Connection: close\r\n\r\n")
        try:
            answer = await asyncio.wait_for(reader.read(-1), 10)
        except (OSError, TimeoutError) as exc:
            return type(exc).__name__.encode()
        finally:
            writer.close()
        return answer.split(b"\r\n", 1)[0] or b"closed unanswered"

    counts: dict[bytes, int] = {}
    for line in await asyncio.gather(*(get(*c) for c in connections)):
        counts[line] = counts.get(line, 0) + 1
    return counts


@pytest.mark.asyncio
@pytest.mark.parametrize("relay", ["fast", "aiohttp"])
async def test_the_soft_open_files_limit_is_raised_to_the_hard_one(
        upstream: AiohttpUpstream, tmp_path: Path, relay: str) -> None:
    """Go's runtime raises its soft limit to the hard one at start, so the apiserver and
    kubectl proxy serve as many connections as the hard limit allows: with a soft 256 (1024 is
    what a container gets from a runtime that leaves systemd's default, soft 1024, hard
    524288) each call past ~120 at once (a client and an upstream descriptor each) got 503
    'Too many open files', or was closed unanswered."""
    opgate = OpgateProcess("--upstream", upstream.url, "--relay", relay, "--no-access-log",
                           log_dir=tmp_path, wrapper=("prlimit", "--nofile=256:4096", "--"))
    try:
        await asyncio.to_thread(opgate.wait_ready)
        got = await statuses(opgate.port, CLIENTS)
    finally:
        assert opgate.stop() == 0
    assert got == {b"HTTP/1.1 200 OK": CLIENTS}, (got, opgate.stderr()[-2000:])


@pytest.mark.asyncio
async def test_accepts_failing_for_want_of_descriptors_are_logged_once(
        upstream: AiohttpUpstream, tmp_path: Path) -> None:
    """With --loop asyncio, a listener out of descriptors (a hard limit as low as the soft one)
    logged asyncio's 'socket.accept() out of system resource' with its traceback for every
    connection waiting in the backlog, again every second: over a thousand ERROR lines a
    second. It is one WARNING line per 5 s now; the connections wait in the backlog and are
    served once the clients before them leave."""
    opgate = OpgateProcess("--upstream", upstream.url, "--loop", "asyncio", "--no-access-log",
                           log_dir=tmp_path, wrapper=("prlimit", "--nofile=128:128", "--"))
    try:
        await asyncio.to_thread(opgate.wait_ready)
        held = [await asyncio.open_connection("127.0.0.1", opgate.port) for _ in range(200)]
        log = opgate.stderr_path
        deadline = asyncio.get_running_loop().time() + 10
        while "Too many open files" not in log.read_text():  # the first refused accept
            assert asyncio.get_running_loop().time() < deadline, log.read_text()[-2000:]
            await asyncio.sleep(0.05)  # (another process's log: nothing to await but it)
        for _, writer in held:
            writer.close()
        after = await statuses(opgate.port, 20)  # served again
        failures = log.read_text()
    finally:
        assert opgate.stop() == 0
    assert after == {b"HTTP/1.1 200 OK": 20}, (after, failures[-2000:])
    lines = [line for line in failures.splitlines() if "accept" in line]
    assert len(lines) == 1, failures[-3000:]
    assert "WARNING" in lines[0] and "Too many open files" in lines[0], lines


@pytest.mark.asyncio
async def test_calls_out_of_descriptors_wait_for_one_rather_than_fail(
        upstream: AiohttpUpstream, tmp_path: Path) -> None:
    """With every descriptor of the hard limit taken by client connections (200 clients
    connected, then one GET each, all at once; the limit cannot be raised), a call whose
    upstream connection cannot be opened waits for a descriptor to be freed (an idle pooled
    connection closed for it, a call ending), as Go's servers back off on EMFILE, within the
    connect timeout. Each such call got 503 'Too many open files' at once (141 of 200)."""
    opgate = OpgateProcess("--upstream", upstream.url, "--no-access-log", log_dir=tmp_path,
                           wrapper=("prlimit", "--nofile=256:256", "--"))
    try:
        await asyncio.to_thread(opgate.wait_ready)
        # every client accepted before the GETs: an accept that meets the descriptors the
        # GETs' upstream connections took is closed unanswered by uvloop (libuv's EMFILE
        # trick), which is the accept side, not what this test is about
        got = await statuses(opgate.port, 200, accepted_by=opgate.proc.pid)
    finally:
        assert opgate.stop() == 0
    assert got == {b"HTTP/1.1 200 OK": 200}, (got, opgate.stderr()[-2000:])
