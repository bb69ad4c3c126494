"""opgate's own shutdown (SIGTERM) in front of the real apiserver, on both relays.

What kubelet and the controller see while the sidecar drains: watches open at that moment end
as complete streams (the last chunk, as the apiserver's own timeout ends them, so clients
re-watch from their last resourceVersion without logging a broken stream); an ordinary call in
flight (here a create whose body is still being uploaded) finishes; ``/readyz`` fails at once
(``shutdown``), so the pod leaves its Services' endpoints while the calls finish; new
connections are refused; the process exits 0 and logs no traceback.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import time
import urllib.error
from collections.abc import Callable, Iterator

import aiohttp
import pytest
from kubernetes import client, watch

from proxy.envtest.cluster import LocalCluster
from tests.e2e.conftest import Opgate
from tests.e2e.test_python_client import make_client
from tests.integration.redis_server import RedisServer

pytestmark = pytest.mark.e2e

NS = "shutdown"
WATCHES = 3


async def _watch(session: aiohttp.ClientSession, url: str, opened: asyncio.Event,
                 events: list[str]) -> str:
    """Read a watch to its end: ``eof`` (complete) or ``cut`` (the body ended early)."""
    try:
        async with session.get(url) as resp:
            assert resp.status == 200, await resp.text()
            opened.set()
            async for line in resp.content:
                if line.strip():
                    events.append(json.loads(line)["type"])  # every line a whole event
        return "eof"
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
        return "cut"


def _python_client_watch(api: client.CoreV1Api, opened: Callable[[], None],
                         seen: list[str]) -> str:
    """The kubernetes client's watch (urllib3): a cut stream raises ``ProtocolError``."""
    try:
        for event in watch.Watch().stream(api.list_namespaced_config_map, NS,
                                          timeout_seconds=600, _request_timeout=120):
            seen.append(event["type"])
            opened()
        return "eof"
    except Exception as exc:  # urllib3's ProtocolError (IncompleteRead), a reset
        return f"cut: {type(exc).__name__}: {exc}"


def _in_flight(gate: Opgate) -> float:
    for line in gate.admin_get("/metrics")[1].splitlines():
        if line.startswith("opgate_inflight_requests "):
            return float(line.split()[1])
    return 0.0


def _readyz(gate: Opgate) -> int:
    try:
        return gate.admin_get("/readyz?verbose", timeout=3)[0]
    except (OSError, urllib.error.URLError):
        return -1  # the admin listener is gone


async def _upload_start(gate: Opgate, cluster: LocalCluster, name: str) -> tuple[
        asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """A create whose chunked body is sent in two parts: in flight until the second one."""
    ctx = ssl.create_default_context(cafile=cluster.ca_file)
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port, ssl=ctx,
                                                   server_hostname="127.0.0.1")
    body = json.dumps({"apiVersion": "v1", "kind": "ConfigMap",
                       "metadata": {"name": name}, "data": {"k": "v"}}).encode()
    head = (f"POST /api/v1/namespaces/{NS}/configmaps HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {cluster.admin_token}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    first, rest = body[:10], body[10:]
    writer.write(head + b"%x\r\n%b\r\n" % (len(first), first))
    await writer.drain()
    return reader, writer, rest


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with RedisServer.launch() as server:
        yield server.url


@pytest.mark.parametrize(("relay", "workers"), [("fast", 1), ("aiohttp", 1), ("fast", 2)],
                         ids=["fast", "aiohttp", "fast-2-workers"])
def test_sigterm_ends_watches_cleanly_fails_readyz_and_lets_calls_finish(
    cluster: LocalCluster, opgate_factory: Callable[..., Opgate], relay: str, workers: int,
    request: pytest.FixtureRequest,
) -> None:
    """With ``--workers 2`` the watches and the create are spread over both workers, which the
    supervisor stops together."""
    cluster.create_namespace(NS)
    more = (["--workers", str(workers), "--redis-url", request.getfixturevalue("redis_url")]
            if workers > 1 else [])
    gate = opgate_factory(extra_args=["--relay", relay, *more])
    name = f"during-{relay}-{workers}"  # the ConfigMap created while opgate shuts down
    api_client = make_client(gate.url, cluster.admin_token, cluster.ca_file)
    api = client.CoreV1Api(api_client)

    async def scenario() -> tuple[list[str], list[list[str]], str, list[str], list[int], bytes,
                                  float]:
        url = f"{gate.url}/api/v1/namespaces/{NS}/configmaps?watch=1&timeoutSeconds=600"
        headers = {"Authorization": f"Bearer {cluster.admin_token}"}
        connector = aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=cluster.ca_file))
        async with aiohttp.ClientSession(
                headers=headers, connector=connector,
                timeout=aiohttp.ClientTimeout(total=None, sock_read=None)) as session:
            opened = [asyncio.Event() for _ in range(WATCHES)]
            events: list[list[str]] = [[] for _ in range(WATCHES)]
            tasks = [asyncio.create_task(_watch(session, url, opened[i], events[i]))
                     for i in range(WATCHES)]
            loop = asyncio.get_running_loop()
            py_opened = asyncio.Event()
            py_seen: list[str] = []
            py_task = asyncio.create_task(asyncio.to_thread(
                _python_client_watch, api, lambda: loop.call_soon_threadsafe(py_opened.set),
                py_seen))
            await asyncio.wait_for(asyncio.gather(*(o.wait() for o in opened)), 30)
            await cluster.request("POST", f"/api/v1/namespaces/{NS}/configmaps",
                                  body={"metadata": {"generateName": "before-"}})
            await asyncio.wait_for(py_opened.wait(), 30)  # (its first event came)
            deadline = loop.time() + 30
            while not all("ADDED" in e for e in events):  # each stream delivered it
                assert loop.time() < deadline, f"no ADDED event through opgate: {events}"
                await asyncio.sleep(0.1)
            reader, writer, rest = await _upload_start(gate, cluster, name)
            deadline = loop.time() + 30  # the create is in flight too (the watches, 1 each)
            while await asyncio.to_thread(_in_flight, gate) < WATCHES + 2:
                assert loop.time() < deadline, gate.admin_get("/metrics")[1][-2000:]
                await asyncio.sleep(0.1)

            os.kill(gate.pid, signal.SIGTERM)
            signalled = loop.time()
            done, pending = await asyncio.wait([*tasks, py_task], timeout=20)
            ended_after = loop.time() - signalled
            for task in pending:
                task.cancel()
            # while the create is still in flight: unready, and not accepting
            readyz = [await asyncio.to_thread(_readyz, gate)]
            while readyz[-1] == 200 and loop.time() < signalled + 10:
                await asyncio.sleep(0.1)
                readyz.append(await asyncio.to_thread(_readyz, gate))
            refused = ""
            try:  # a new connection (the watches' may still be open, kept alive)
                _, probe = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", gate.port), 5)
                probe.close()
                refused = "accepted a new connection"
            except OSError:
                pass
            writer.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(rest), rest))
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 15)
            writer.close()
            ends = [t.result() for t in tasks if t in done]
            py_end = py_task.result() if py_task in done else "still open"
            return ends, events, py_end, py_seen, readyz, answer + refused.encode(), ended_after

    ends, events, py_end, py_seen, readyz, answer, ended_after = asyncio.run(scenario())
    api_client.close()
    deadline = time.monotonic() + 30
    while gate.proc.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    code = gate.stop()
    log = gate.log.read_text()

    # the watches ended at once, as complete streams, for aiohttp and the kubernetes client
    assert ends == ["eof"] * WATCHES, (ends, events)
    assert py_end == "eof", (py_end, py_seen)
    assert ended_after < 5, ended_after  # not after the drain's grace
    # readiness failed at once while the create was still in flight ...
    assert readyz[-1] == 503 and len(readyz) <= 3, readyz
    # ... which then finished; no new connection was taken meanwhile
    assert answer.startswith(b"HTTP/1.1 201 "), answer[:300]
    assert b"accepted" not in answer, answer[-40:]
    api_direct = make_client(cluster.url, cluster.admin_token, cluster.ca_file)
    try:
        client.CoreV1Api(api_direct).read_namespaced_config_map(name, NS)
    finally:
        api_direct.close()
    assert code == 0, (code, log[-3000:])
    assert "shutting down" in log
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
