"""Traffic capture through the real relay, on both cores: what the client sent and what the
upstream answered end up as mitmproxy flows (read back with mitmproxy's reader and with the
real ``mitmdump -r``); a watch's events still reach the client at once; opgate's own answers
are flows with their decision; an upgrade is its request and 101 only; no token in the file.
Then ``opgate serve --capture`` as a process, and its clear refusal without mitmproxy."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from mitmproxy import io as mio

from proxy.app import section_parsers
from proxy.capture import FlowFile
from proxy.engine.context import Deny, RequestContext
from proxy.engine.policies import build_policy_set
from proxy.engine.status import forbidden
from proxy.middlewares.capture import Capture, CapturedCall
from tests.integration.fakes import (
    AiohttpUpstream,
    Policies,
    RawUpstream,
    read_head,
    running_proxy,
)
from tests.integration.opgate_proc import OpgateProcess

TOKEN = "eyJhbGciOiJSUzI1NiJ9.Y2FwdHVyZS10b2tlbg.c2lnbmF0dXJlLWNhcHR1cmU"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def capture_policies(rules: str) -> Policies:
    text = ("apiVersion: opgate.dev/v1alpha1\nkind: Policy\nmetadata: {name: cap}\nspec:\n"
            "  capture:\n" + rules)
    return Policies(build_policy_set([("cap.yaml", text.encode())], parsers=section_parsers()))


def read_flows(path: Path) -> list[Any]:
    with open(path, "rb") as f:
        return list(mio.FlowReader(f).stream())


class Recorder:
    """A FlowFile plus the calls handed to it, so a test can wait for the exit hooks."""

    def __init__(self, path: Path, upstream: str) -> None:
        self.path = path
        self.file = FlowFile(str(path), upstream=upstream)
        self.calls: list[CapturedCall] = []
        self._arrived = asyncio.Event()

    def write(self, call: CapturedCall) -> None:
        self.calls.append(call)
        self.file.write(call)
        self._arrived.set()

    async def flows(self, count: int) -> list[Any]:
        """The flows in the file once ``count`` calls were handed over (10 s at most)."""
        async with asyncio.timeout(10):
            while len(self.calls) < count:
                self._arrived.clear()
                await self._arrived.wait()
        self.file.close()
        return read_flows(self.path)


def mitmdump(path: Path, *args: str) -> str:
    exe = shutil.which("mitmdump") or str(Path(sys.executable).with_name("mitmdump"))
    out = subprocess.run([exe, "-n", "-r", str(path), *args], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "HOME": str(path.parent)})
    assert out.returncode == 0, out.stderr
    return out.stdout


async def echo(request: web.BaseRequest) -> web.StreamResponse:
    body = await request.read()
    return web.Response(status=201 if request.method == "POST" else 200, body=b"got:" + body,
                        content_type="application/json", headers={"Audit-Id": "a-1"})


@pytest.mark.usefixtures("each_relay")
async def test_calls_become_flows_with_bodies_both_ways_and_no_token(
        tmp_path: Path, each_relay: str) -> None:
    up = await AiohttpUpstream(echo, read_body=False).start()
    rec = Recorder(tmp_path / "c.flows", up.url)
    big = os.urandom(200_000)

    async def chunked() -> Any:
        for i in range(0, len(big), 50_000):
            yield big[i:i + 50_000]

    try:
        async with running_proxy(up.url, middlewares=(Capture(write=rec.write),),
                                 policies=capture_policies("    - {maxBodyBytes: 100000}\n")
                                 ) as proxy, aiohttp.ClientSession() as c:
            async with c.get(proxy.url + f"/api/v1/namespaces/a/configmaps?access_token={TOKEN}"
                                         "&limit=5", headers=AUTH) as r:
                assert (r.status, await r.read()) == (200, b"got:")
            async with c.post(proxy.url + "/api/v1/namespaces/a/configmaps", headers=AUTH,
                              data=b'{"kind":"ConfigMap"}') as r:
                assert (r.status, await r.read()) == (201, b'got:{"kind":"ConfigMap"}')
            async with c.put(proxy.url + "/api/v1/namespaces/a/configmaps/big",
                             data=chunked()) as r:  # streamed, chunked, past the bound
                assert (r.status, len(await r.read())) == (200, 4 + len(big))
            flows = await rec.flows(3)
    finally:
        await up.close()
    get, post, put = sorted(flows, key=lambda f: f.request.timestamp_start)
    assert get.request.method == "GET"
    assert get.client_conn.peername[0] == "127.0.0.1"  # the caller, as the listener saw it
    assert get.request.path == "/api/v1/namespaces/a/configmaps?access_token=REDACTED&limit=5"
    assert get.request.headers["Authorization"] == "Bearer REDACTED"
    assert (get.response.status_code, get.response.content) == (200, b"got:")
    assert get.response.headers["Audit-Id"] == "a-1"
    assert (post.request.content, post.response.status_code) == (b'{"kind":"ConfigMap"}', 201)
    assert post.response.content == b'got:{"kind":"ConfigMap"}'
    assert put.request.content == big[:100_000]
    assert put.response.content == (b"got:" + big)[:100_000]
    meta = put.metadata["opgate"]
    assert meta["request_truncated"] and meta["response_truncated"]
    assert (meta["request_bytes"], meta["response_bytes"]) == (len(big), len(big) + 4)
    assert put.request.timestamp_start <= put.response.timestamp_start
    raw = (tmp_path / "c.flows").read_bytes()
    assert TOKEN.encode() not in raw
    dump = mitmdump(tmp_path / "c.flows")
    assert f"GET {up.url}/api/v1/namespaces/a/configmaps" in dump
    assert "<< 201" in dump and "<< 200" in dump
    assert TOKEN not in mitmdump(tmp_path / "c.flows", "--flow-detail", "3")


@pytest.mark.usefixtures("each_relay")
async def test_a_captured_watch_streams_each_event_at_once(tmp_path: Path) -> None:
    released = asyncio.Event()
    seen_by_client: list[float] = []
    events = [json.dumps({"type": "ADDED", "object": {"n": i}}).encode() + b"\n"
              for i in range(5)]

    async def watch(request: web.BaseRequest) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        for event in events:
            released.clear()
            await resp.write(event)
            # the next event only once the client has this one: nothing may sit in opgate
            await asyncio.wait_for(released.wait(), 5)
        return resp

    up = await AiohttpUpstream(watch).start()
    rec = Recorder(tmp_path / "w.flows", up.url)
    try:
        async with running_proxy(up.url, middlewares=(Capture(write=rec.write),),
                                 policies=capture_policies("    - {maxBodyBytes: 60}\n")
                                 ) as proxy, aiohttp.ClientSession() as c:
            async with c.get(proxy.url + "/api/v1/namespaces/a/pods?watch=true") as r:
                for event in events:
                    line = await asyncio.wait_for(r.content.readline(), 5)
                    assert line == event
                    seen_by_client.append(time.monotonic())
                    released.set()
                assert await r.read() == b""
            (flow,) = await rec.flows(1)
    finally:
        await up.close()
    assert len(seen_by_client) == 5
    assert flow.request.path == "/api/v1/namespaces/a/pods?watch=true"
    assert flow.response.content == b"".join(events)[:60]
    assert flow.metadata["opgate"]["response_truncated"] is True
    assert flow.metadata["opgate"]["response_bytes"] == sum(map(len, events))
    assert flow.metadata["opgate"]["verb"] == "watch"
    assert "truncated" in flow.comment


class DenyDeletes:
    name = "deny"
    needs_body = False
    fail_open = False

    async def entry(self, ctx: RequestContext) -> Deny | None:
        if ctx.method == "DELETE":
            return Deny(forbidden("opgate: rule no-deletes of policy p (p.yaml:7) denies it"))
        return None


@pytest.mark.usefixtures("each_relay")
async def test_opgate_answers_are_flows_with_their_decision(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "d.flows", "http://127.0.0.1:1")
    async with running_proxy("http://127.0.0.1:1",
                             middlewares=(DenyDeletes(), Capture(write=rec.write))) as proxy, \
            aiohttp.ClientSession() as c:
        async with c.delete(proxy.url + "/api/v1/namespaces/a/configmaps/c",
                            headers=AUTH) as r:
            assert r.status == 403
        async with c.get(proxy.url + "/api/v1/namespaces/a/configmaps/c") as r:
            assert r.status == 503  # nothing listens upstream: the relay's own answer
        flows = await rec.flows(2)
    denied, unreachable = sorted(flows, key=lambda f: f.request.timestamp_start)
    assert denied.response.status_code == 403
    assert json.loads(denied.response.content)["reason"] == "Forbidden"
    assert denied.metadata["opgate"]["decision"] == "denied"
    assert denied.metadata["opgate"]["answered_by"] == "opgate"
    assert "rule no-deletes" in denied.comment
    assert denied.request.headers["Authorization"] == "Bearer REDACTED"
    assert unreachable.response.status_code == 503
    assert unreachable.metadata["opgate"]["answered_by"] == "opgate"
    assert "answered itself" in unreachable.comment
    dump = mitmdump(tmp_path / "d.flows")
    assert "<< 403 Forbidden" in dump and "<< 503" in dump


@pytest.mark.usefixtures("each_relay")
@pytest.mark.parametrize(("target", "protocol"), [
    ("/api/v1/namespaces/a/pods/p/exec?command=sh&stdin=true", "SPDY/3.1"),
    ("/api/v1/namespaces/a/services/s/proxy/ws?x=1", "websocket"),  # any upgrade, not just exec
])
async def test_an_upgrade_is_its_request_and_101_only(tmp_path: Path, target: str,
                                                      protocol: str) -> None:
    greeting = b"\x80\x03\x00\x02tunnelled-bytes-not-captured"

    async def upgrader(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
                     b"Upgrade: " + protocol.encode() + b"\r\n"
                     b"X-Stream-Protocol-Version: v4.channel.k8s.io\r\n\r\n" + greeting)
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()

    up = await RawUpstream(upgrader).start()
    rec = Recorder(tmp_path / "u.flows", up.url)
    try:
        async with running_proxy(up.url, middlewares=(Capture(write=rec.write),)) as proxy:
            host, port = proxy.listener.address.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST " + target.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                         b"Connection: Upgrade\r\nUpgrade: " + protocol.encode() + b"\r\n"
                         b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
                         b"Content-Length: 0\r\n\r\n")
            status, _ = await read_head(reader)
            assert status.startswith("HTTP/1.1 101")
            assert await reader.readexactly(len(greeting)) == greeting
            writer.write(b"typed-into-the-shell")
            assert await reader.readexactly(20) == b"typed-into-the-shell"
            writer.close()
            (flow,) = await rec.flows(1)
    finally:
        await up.close()
    assert flow.request.path == target
    assert flow.response.status_code == 101
    assert flow.response.headers["Upgrade"] == protocol
    assert flow.response.content == b""
    meta = flow.metadata["opgate"]  # says why there are no bodies, and nothing else
    assert meta["bodies_omitted"] == "upgrade: only the request and the 101 are captured"
    assert "request_body" not in meta
    raw = (tmp_path / "u.flows").read_bytes()
    assert greeting not in raw and b"typed-into-the-shell" not in raw
    assert TOKEN.encode() not in raw
    assert "<< 101" in mitmdump(tmp_path / "u.flows")


@pytest.mark.parametrize("relay", ["fast", "aiohttp"])
async def test_opgate_serve_with_capture(tmp_path: Path, relay: str) -> None:
    up = await AiohttpUpstream(echo, read_body=False).start()
    policy = tmp_path / "policies" / "cap.yaml"
    policy.parent.mkdir()
    policy.write_text("apiVersion: opgate.dev/v1alpha1\nkind: Policy\nmetadata: {name: cap}\n"
                      "spec:\n  capture:\n    - {match: {verbs: [list]}, sample: 0}\n"
                      "    - {match: {verbs: ['*']}}\n")
    path = tmp_path / "out" / "capture.flows"
    path.parent.mkdir()
    gate = OpgateProcess("--upstream", up.url, "--relay", relay, "--policies", str(policy),
                         "--capture", str(path), "--no-access-log", log_dir=tmp_path)
    try:
        await asyncio.to_thread(gate.wait_ready)
        async with aiohttp.ClientSession() as c:
            async with c.post(gate.url + "/api/v1/namespaces/a/configmaps", headers=AUTH,
                              data=b'{"kind":"ConfigMap"}') as r:
                assert r.status == 201
            async with c.get(gate.url + "/api/v1/namespaces/a/configmaps") as r:
                assert r.status == 200  # a list: sample 0, not captured

        def metrics() -> str:
            with urllib.request.urlopen(gate.admin_url + "/metrics", timeout=5) as resp:
                return resp.read().decode()

        deadline = time.monotonic() + 10
        while 'opgate_capture_flows_total{result="written"} 1.0' not in (text := metrics()):
            assert time.monotonic() < deadline, text[-2000:]
            await asyncio.sleep(0.1)
    finally:
        assert gate.stop() == 0, gate.stderr()
        await up.close()
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    (flow,) = read_flows(path)
    assert (flow.request.method, flow.response.status_code) == ("POST", 201)
    assert flow.request.headers["Authorization"] == "Bearer REDACTED"
    assert flow.metadata["opgate"]["rule"] == f"{policy}:7"
    assert TOKEN.encode() not in path.read_bytes()


def test_capture_without_mitmproxy_is_refused_at_start(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow" / "mitmproxy"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('mitmproxy is not installed here')\n")
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "proxy", "serve", "--upstream",
                          "http://127.0.0.1:1", "--capture", str(tmp_path / "c.flows")],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2
    assert "--capture needs mitmproxy" in out.stderr
    assert "pip install 'opgate[capture]'" in out.stderr
    assert not (tmp_path / "c.flows").exists()
