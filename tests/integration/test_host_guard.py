"""The API listener answers only the Host names of --accept-hosts (kubectl proxy's guard against
DNS rebinding, with its default), on both relay cores and in a real `opgate serve`.

A page that points its own name at 127.0.0.1 makes the browser call opgate's loopback port with
``Host: <its name>``; opgate would relay the call with its own credentials (``--token-file``,
the kubeconfig) and the page read the answer. Raw sockets, so the Host sent is the test's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from proxy.engine.context import RequestContext
from proxy.relay.hostguard import DEFAULT_ACCEPT_HOSTS, HostGuard, parse_accept_hosts
from tests.integration.fakes import AiohttpUpstream, ok_handler, running_proxy
from tests.integration.opgate_proc import OpgateProcess

GUARD = HostGuard(parse_accept_hosts(DEFAULT_ACCEPT_HOSTS))


async def call(url_or_path: str, host: bytes | None, *, version: bytes = b"1.1") -> bytes:
    """One GET with ``Host: host`` (none for ``None``), read until the proxy closes."""
    if url_or_path.startswith("unix:"):
        reader, writer = await asyncio.open_unix_connection(url_or_path[5:])
    else:
        address, port = url_or_path.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(address, int(port))
    head = b"GET /api/v1/namespaces/a/secrets HTTP/" + version + b"\r\n"
    if host is not None:
        head += b"Host: " + host + b"\r\n"
    writer.write(head + b"Connection: close\r\n\r\n")
    try:
        return await asyncio.wait_for(reader.read(-1), 5)
    finally:
        writer.close()


@pytest.fixture
async def upstream() -> AsyncIterator[AiohttpUpstream]:
    up = await AiohttpUpstream(ok_handler).start()
    yield up
    await up.close()


@pytest.mark.asyncio
@pytest.mark.usefixtures("each_relay")
@pytest.mark.parametrize(("host", "refused"), [
    (b"127.0.0.1:8001", ""),
    (b"localhost", ""),
    (b"[::1]:8001", ""),
    (b"evil.example:8001", "evil.example"),
    (b"localhost.evil.example", "localhost.evil.example"),
    (None, ""),  # HTTP/1.0 without Host: no browser sends one
])
async def test_only_accepted_host_names_are_relayed(
        upstream: AiohttpUpstream, host: bytes | None, refused: str) -> None:
    async with running_proxy(upstream.url, host_guard=GUARD) as proxy:
        raw = await call(proxy.url, host, version=b"1.0" if host is None else b"1.1")
    status = raw.split(b"\r\n", 1)[0]
    if not refused:
        assert status.split(b" ")[1] == b"200", raw[:300]
        assert len(upstream.seen) == 1
        return
    assert status == b"HTTP/1.1 403 Forbidden", raw[:300]
    got = json.loads(raw.partition(b"\r\n\r\n")[2])
    assert (got["kind"], got["code"], got["reason"]) == ("Status", 403, "Forbidden")
    assert got["message"].startswith(f'opgate: Host "{refused}" is not accepted here')
    assert upstream.seen == []  # nothing relayed


@pytest.mark.asyncio
@pytest.mark.usefixtures("each_relay")
async def test_a_unix_socket_listener_takes_any_host(
        upstream: AiohttpUpstream, tmp_path: Path) -> None:
    """No browser reaches a Unix socket: its directory's permissions guard it."""
    path = tmp_path / "api.sock"
    async with running_proxy(upstream.url, listen=f"unix:{path}", host_guard=GUARD):
        raw = await call(f"unix:{path}", b"evil.example")
    assert raw.split(b" ")[1] == b"200", raw[:300]


@pytest.mark.asyncio
@pytest.mark.parametrize(("args", "answers"), [
    ((), (b"200", b"403")),  # the default: kubectl proxy's
    (("--accept-hosts", r"^opgate$,^evil\.example$"), (b"403", b"200")),
    (("--accept-hosts", ".*"), (b"200", b"200")),
])
async def test_opgate_serve_refuses_other_hosts_by_default(
        upstream: AiohttpUpstream, tmp_path: Path, args: tuple[str, ...],
        answers: tuple[bytes, bytes]) -> None:
    opgate = OpgateProcess("--upstream", upstream.url, "--no-access-log", *args,
                           log_dir=tmp_path)
    try:
        await asyncio.to_thread(opgate.wait_ready)
        local = await call(opgate.url, f"127.0.0.1:{opgate.port}".encode())
        evil = await call(opgate.url, f"evil.example:{opgate.port}".encode())
    finally:
        assert opgate.stop() == 0
    assert (local.split(b" ")[1], evil.split(b" ")[1]) == answers, (local[:200], evil[:200])
    assert len(upstream.seen) == answers.count(b"200")


class Recording:
    """A middleware: what its entry hook saw and what its exit hook (metrics, audit and the
    access log are exit hooks) recorded of each call."""

    name = "recording"
    fail_open = False
    needs_body = False

    def __init__(self) -> None:
        self.entered: list[str] = []
        self.exits: list[tuple[str, str, int, str]] = []
        self.exited = asyncio.Event()

    async def entry(self, ctx: RequestContext) -> None:
        self.entered.append(ctx.path)

    async def exit(self, ctx: RequestContext) -> None:
        self.exits.append((ctx.method, ctx.path, ctx.status_code, ctx.decision))
        self.exited.set()


@pytest.mark.asyncio
@pytest.mark.usefixtures("each_relay")
async def test_a_refused_host_is_recorded_as_opgate_s_own_denial(
        upstream: AiohttpUpstream) -> None:
    """The README: opgate records the calls it answers itself (metrics, the access and the
    audit logs); a DNS-rebinding attempt is one a platform team wants to see. No entry hook
    runs (nothing is decided for such a call), the exit hooks see a 403 denial, and the answer
    names it by its Audit-Id as opgate's other answers do."""
    recording = Recording()
    async with running_proxy(upstream.url, host_guard=GUARD,
                             middlewares=(recording,)) as proxy:
        raw = await call(proxy.url, b"evil.example:8001")
        await asyncio.wait_for(recording.exited.wait(), 5)  # (after the answer went out)
    head = raw.partition(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 403"), raw[:300]
    assert b"\r\naudit-id: " in head, raw[:300]
    assert recording.entered == []
    assert recording.exits == [("GET", "/api/v1/namespaces/a/secrets", 403, "denied")]
    assert upstream.seen == []
