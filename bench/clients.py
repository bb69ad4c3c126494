"""Clients written for what ``wrk`` cannot do: paced latency, watch latency, many open watches.

* ``paced_gets``: the latency measure's client. GETs on a fixed schedule (``rate`` per second)
  over one persistent keep-alive connection (TCP_NODELAY; TLS set up once, when the path is
  TLS), from a plain blocking socket: the request is pre-built bytes, the response is read
  until its body is complete, each timed with ``perf_counter_ns`` from its send to its last
  byte. No event loop and no HTTP library sits in the timed section, so the client adds as
  little as a client can (an aiohttp client added ~0.7 ms to each request's p50 on the
  project's 2-core machine, and its own hiccups to the p99; see bench/README.md). No
  coordinated omission: when a response arrives after the next send was due, that next request
  is timed from when it was due, so a slow response also counts the wait it causes.
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
import socket
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

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


class _Conn:
    """One blocking HTTP/1.1 keep-alive connection that reads whole responses."""

    def __init__(self, url: str, ca_file: str | None) -> None:
        parts = urlsplit(url)
        sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80),
                                        timeout=30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if parts.scheme == "https":  # the upstream's serving cert names localhost
            sock = ssl.create_default_context(cafile=ca_file).wrap_socket(
                sock, server_hostname="localhost")
        self.sock = sock
        self.buf = b""

    def _more(self) -> None:
        chunk = self.sock.recv(262144)
        if not chunk:
            raise ConnectionError("connection closed by the server")
        self.buf += chunk

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._more()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _line(self) -> bytes:
        while (end := self.buf.find(b"\r\n")) < 0:
            self._more()
        out, self.buf = self.buf[:end], self.buf[end + 2:]
        return out

    def response(self) -> int:
        """Read one response to the end of its body; returns the status code."""
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            self._more()
        head, self.buf = self.buf[:end].lower(), self.buf[end + 4:]
        status = int(head[9:12])
        if b"\r\ntransfer-encoding: chunked" in head:
            while (size := int(self._line().split(b";")[0], 16)) > 0:
                self._take(size + 2)
            while self._line():  # trailers, then the empty line
                pass
        elif (at := head.find(b"\r\ncontent-length:")) >= 0:
            self._take(int(head[at + 17:].split(b"\r\n", 1)[0]))
        return status

    def close(self) -> None:
        self.sock.close()


def paced_gets(
    url: str, *, rate: float, seconds: float, headers: Mapping[str, str], ca_file: str | None,
) -> tuple[list[float], int]:
    """Latencies in ms of ``rate·seconds`` GETs on a fixed schedule, and the non-200 count."""
    parts = urlsplit(url)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    request = "".join([f"GET {target} HTTP/1.1\r\nHost: {parts.netloc}\r\nAccept: */*\r\n",
                       *(f"{k}: {v}\r\n" for k, v in headers.items()), "\r\n"]).encode()
    conn = _Conn(url, ca_file)
    latencies: list[float] = []
    errors = 0
    try:
        for _ in range(5):  # open the connection (and TLS) before the clock starts
            conn.sock.sendall(request)
            conn.response()
        interval_ns = int(1e9 / rate)
        start = time.perf_counter_ns() + 50_000_000
        for i in range(int(rate * seconds)):
            due = start + i * interval_ns
            now = time.perf_counter_ns()
            if due > now:
                time.sleep((due - now) / 1e9)
                sent = time.perf_counter_ns()
            else:  # the previous response came after this send was due: count the wait
                sent = due
            conn.sock.sendall(request)
            ok = conn.response() == 200
            if ok:
                latencies.append((time.perf_counter_ns() - sent) / 1e6)
            else:
                errors += 1
    finally:
        conn.close()
    return latencies, errors


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
    headers: Mapping[str, str] | None = None,
) -> tuple[int, str | None]:
    async with session.get(url, headers=headers) as resp:
        await resp.read()
        return resp.status, resp.headers.get(header)


async def get_json(session: aiohttp.ClientSession, url: str) -> dict[str, object]:
    async with session.get(url) as resp:
        data = await resp.json()
        return dict(data)


def new_session(limit: int = 8) -> aiohttp.ClientSession:
    return _session(limit, None)
