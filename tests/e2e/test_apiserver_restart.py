"""kube-apiserver going away and coming back while watches are open through opgate.

opgate must end each open watch stream cleanly (the client sees the end of the stream, not a
hang), answer with a Status while the upstream is down, let clients re-watch once it is back,
and release what the dead watches held: its TCP connections to the apiserver return to their
idle level and its memory stays within a generous bound.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from kubernetes import client, watch

from proxy.envtest.cluster import LocalCluster
from tests.e2e.conftest import Opgate
from tests.e2e.test_python_client import make_client

pytestmark = pytest.mark.e2e

NS = "restart"
WATCHES = 5


def upstream_sockets(pid: int, port: int) -> int:
    """TCP sockets of process ``pid`` whose remote end is 127.0.0.1:``port`` (any state)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if remote_port == port and fields[9] in inodes:
                count += 1
    return count


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def wait_for(predicate: Callable[[], bool], *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    raise AssertionError(f"{what} not within {timeout:.0f}s")


async def _watch(session: aiohttp.ClientSession, url: str, opened: asyncio.Event,
                 events: list[str]) -> str:
    """Read one watch stream to its end; return how it ended."""
    try:
        async with session.get(url) as resp:
            assert resp.status == 200
            opened.set()
            async for line in resp.content:
                if line.strip():
                    events.append(json.loads(line)["type"])
        return "eof"
    except aiohttp.ClientPayloadError:
        return "truncated"  # the relay may also cut the chunked body: still an end, not a hang
    except aiohttp.ServerDisconnectedError:
        return "disconnected"


@dataclass
class Outcome:
    ends: list[str]          # how each client stream ended: eof / truncated / disconnected
    pending: int             # streams still open 60s after the apiserver stopped
    ended_after: float       # seconds from the stop until the last stream ended
    events: list[list[str]]  # event types each stream delivered
    during: int              # opgate's upstream sockets while the watches were open
    down_status: int         # opgate's answer while the apiserver was down
    down_body: bytes


async def _restart_with_watches(cluster: LocalCluster, opgate: Opgate, *, kill: bool) -> Outcome:
    url = (f"{opgate.url}/api/v1/namespaces/{NS}/configmaps"
           f"?watch=1&allowWatchBookmarks=true&timeoutSeconds=600")
    headers = {"Authorization": f"Bearer {cluster.admin_token}"}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
    connector = aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=cluster.ca_file))
    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=connector) as session:
        opened = [asyncio.Event() for _ in range(WATCHES)]
        events: list[list[str]] = [[] for _ in range(WATCHES)]
        tasks = [asyncio.create_task(_watch(session, url, opened[i], events[i]))
                 for i in range(WATCHES)]
        await asyncio.wait_for(asyncio.gather(*(o.wait() for o in opened)), 30)
        await cluster.request("POST", f"/api/v1/namespaces/{NS}/configmaps",
                              body={"metadata": {"generateName": "before-"}})
        for _ in range(200):  # each stream delivers the event while it is open
            if all("ADDED" in e for e in events):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"the ADDED event did not stream through opgate: {events}")
        during = await asyncio.to_thread(upstream_sockets, opgate.pid, cluster.port)

        stopped = time.monotonic()
        await asyncio.to_thread(cluster.stop_apiserver, kill=kill)
        done, pending = await asyncio.wait(tasks, timeout=60)
        ended_after = time.monotonic() - stopped
        for task in pending:
            task.cancel()
        # while the upstream is down opgate answers at once, with a Status
        async with session.get(f"{opgate.url}/api/v1/namespaces/{NS}/configmaps",
                               timeout=aiohttp.ClientTimeout(total=30)) as resp:
            down_status, down_body = resp.status, await resp.read()
        await asyncio.to_thread(cluster.start_apiserver)
        return Outcome(ends=[t.result() for t in done], pending=len(pending),
                       ended_after=ended_after, events=events, during=during,
                       down_status=down_status, down_body=down_body)


@pytest.fixture(scope="module", params=["fast", "aiohttp"])
def gate(request: pytest.FixtureRequest, opgate_factory: Callable[..., Opgate]) -> Opgate:
    """An opgate of each relay core (passthrough, TLS)."""
    return opgate_factory(extra_args=["--relay", str(request.param)])


@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "sigkill"])
def test_watches_end_cleanly_and_resources_return(
    cluster: LocalCluster, gate: Opgate, kill: bool
) -> None:
    """SIGTERM: the apiserver ends its watch streams, then exits; SIGKILL: its connections
    drop mid-stream. Either way every client watch through opgate ends promptly (after a
    SIGTERM as a complete chunked stream), opgate answers with a Status meanwhile, clients
    re-watch, and opgate's upstream sockets and memory return to their idle level."""
    cluster.create_namespace(NS)
    via = make_client(gate.url, cluster.admin_token, cluster.ca_file)
    api = client.CoreV1Api(via)
    api.list_namespaced_config_map(NS)  # warm the relay's pool, then measure idle
    time.sleep(1)
    idle = upstream_sockets(gate.pid, cluster.port)
    rss_before = rss_bytes(gate.pid)

    out = asyncio.run(_restart_with_watches(cluster, gate, kill=kill))

    assert out.pending == 0, "watch streams still open 60s after the apiserver stopped"
    assert out.ended_after < 30, out
    assert len(out.ends) == WATCHES
    if not kill:  # a complete upstream stream stays complete; after a crash it may be cut
        assert out.ends == ["eof"] * WATCHES, out.ends
    # the count sees the watches' upstream connections (else "back to idle" proves nothing;
    # one of them may be the idle pooled connection, reused)
    assert out.during >= WATCHES, (idle, out.during)
    assert all("ADDED" in e for e in out.events), out.events
    assert out.down_status in (502, 503, 504), out.down_body
    status = json.loads(out.down_body)
    assert status["kind"] == "Status" and status["code"] == out.down_status

    # clients re-list and re-watch through opgate once the apiserver is back
    listed = api.list_namespaced_config_map(NS)
    name = f"after-{'kill' if kill else 'term'}-{gate.port}"
    api.create_namespaced_config_map(NS, {"metadata": {"name": name}})
    seen = [e["object"].metadata.name for e in watch.Watch().stream(
        api.list_namespaced_config_map, NS, resource_version=listed.metadata.resource_version,
        timeout_seconds=3)]
    assert name in seen
    via.close()

    # the watches' upstream connections are gone: back to the idle level (plus the pool's
    # keep-alive connections of the calls just made), and memory did not run away
    wait_for(lambda: upstream_sockets(gate.pid, cluster.port) <= idle + 2, timeout=60,
             what=f"opgate's upstream sockets back to idle ({idle}+2)")
    assert rss_bytes(gate.pid) < rss_before + 64 * 1024 * 1024
    assert gate.proc.alive()
