"""Clients written for what ``wrk`` cannot do: open-loop load, watch latency, many open watches.

* ``open_loop``: requests sent on a fixed schedule (``rate`` per second) whether or not earlier
  ones have finished (each its own task: a slow response never delays the next send, so there
  is no coordinated omission), each timed from the moment it is sent to its last body byte
  (not from its scheduled time: the event loop's timer wakes up to 1 ms late, which would add
  noise to every path alike). A realistic operator load is tens of calls per second, not a
  saturated closed loop; this is how "added latency" is measured.
* ``watch_latency``: one watch through a path to :mod:`bench.watchserver`; each event's delay
  is the receive time minus the send stamp inside it (both ``CLOCK_MONOTONIC``).
* ``open_watches``: ``n`` watches held open at once (each has received its first event, so the
  stream is through every hop) while the caller reads the proxy's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator, Mapping

import aiohttp

from bench.upstreams import WATCH

_STAMP = b'sent-ns":"'


def ssl_context(ca_file: str | None) -> ssl.SSLContext | bool:
    return ssl.create_default_context(cafile=ca_file) if ca_file else True


def _session(limit: int, ca_file: str | None) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=limit, ssl=ssl_context(ca_file),
                                     enable_cleanup_closed=True)
    return aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))


async def open_loop(
    url: str, *, rate: float, seconds: float, headers: Mapping[str, str], ca_file: str | None,
) -> tuple[list[float], int]:
    """Latencies in ms of ``rate·seconds`` GETs on a fixed schedule, and the error count."""
    latencies: list[float] = []
    errors = 0
    async with _session(16, ca_file) as session:
        async def one() -> None:
            nonlocal errors
            sent = time.perf_counter()
            try:
                async with session.get(url, headers=headers) as resp:
                    await resp.read()
                    ok = resp.status == 200
            except aiohttp.ClientError:
                ok = False
            if ok:
                latencies.append((time.perf_counter() - sent) * 1e3)
            else:
                errors += 1

        for _ in range(5):  # open the connections before the clock starts
            await one()
        latencies.clear()
        tasks: list[asyncio.Task[None]] = []
        start = time.perf_counter() + 0.05
        for i in range(int(rate * seconds)):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return latencies, errors


async def watch_latency(
    base: str, *, count: int, rate: float, headers: Mapping[str, str], ca_file: str | None,
) -> list[float]:
    """Per-event delay in µs of one ``count``-event watch at ``rate`` events/s."""
    delays: list[float] = []
    url = f"{base}{WATCH}&count={count}&rate={rate:g}"
    async with _session(1, ca_file) as session, session.get(url, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"watch through {base}: HTTP {resp.status}")
        while True:
            line = await resp.content.readline()
            now = time.monotonic_ns()
            if not line:
                break
            at = line.find(_STAMP)
            if at < 0:
                continue
            start = at + len(_STAMP)
            sent = int(line[start:line.index(b'"', start)])
            delays.append((now - sent) / 1e3)
    if len(delays) < count:
        raise RuntimeError(f"watch through {base}: {len(delays)} of {count} events arrived")
    return delays


@contextlib.asynccontextmanager
async def open_watches(
    base: str, *, n: int, headers: Mapping[str, str], ca_file: str | None,
) -> AsyncIterator[int]:
    """Hold ``n`` watches open (each past its first event); yields how many are open."""
    url = f"{base}{WATCH}&count=1&idle=1"
    async with _session(0, ca_file) as session:
        responses: list[aiohttp.ClientResponse] = []
        sem = asyncio.Semaphore(64)  # open them briskly, not all in the same instant

        async def one() -> None:
            async with sem:
                resp = await session.get(url, headers=headers)
                responses.append(resp)
                if resp.status == 200:
                    await resp.content.readline()

        async with asyncio.timeout(120):
            results = await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
        opened = sum(1 for r in results if r is None)
        try:
            yield opened
        finally:
            for resp in responses:
                resp.close()


async def get_status(
    session: aiohttp.ClientSession, url: str, header: str,
) -> tuple[int, str | None]:
    async with session.get(url) as resp:
        await resp.read()
        return resp.status, resp.headers.get(header)


async def get_json(session: aiohttp.ClientSession, url: str) -> dict[str, object]:
    async with session.get(url) as resp:
        data = await resp.json()
        return dict(data)


def new_session(limit: int = 8) -> aiohttp.ClientSession:
    return _session(limit, None)
