"""Small local upstreams for the relay tests, and a helper that runs opgate's relay in front.

The real apiserver (tests/e2e) cannot stall, drop a connection mid-stream or answer 101 on
demand; these can. Everything listens on 127.0.0.1 with an ephemeral port.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import aiohttp
from aiohttp import web

from proxy.engine.chain import Chain
from proxy.relay import FastRelay, Listener, Relay, RelaySettings, UpstreamConfig, serve_api
from proxy.relay.hostguard import HostGuard

try:
    from proxy.engine.policies import EMPTY as EMPTY_POLICIES
except ImportError:  # pragma: no cover - the policy module is written in parallel
    EMPTY_POLICIES = SimpleNamespace(allow_impersonation=False, section=lambda key: ())


@dataclass
class Policies:
    """Stand-in for the policy store: ``.current`` is all the relay reads."""

    current: Any = EMPTY_POLICIES

    @classmethod
    def allowing_impersonation(cls) -> Policies:
        return cls(SimpleNamespace(allow_impersonation=True, section=lambda key: ()))


@dataclass
class Seen:
    method: str
    raw_path: str
    headers: Any  # CIMultiDictProxy
    body: bytes


@dataclass
class AiohttpUpstream:
    """An aiohttp low-level server running ``handler``; ``seen`` records every request."""

    handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
    read_body: bool = True
    seen: list[Seen] = field(default_factory=list)
    url: str = ""
    _runner: web.ServerRunner | None = None

    async def start(self, *, ssl_context: Any = None, port: int = 0) -> AiohttpUpstream:
        async def record(request: web.BaseRequest) -> web.StreamResponse:
            body = await request.read() if self.read_body else b""
            self.seen.append(Seen(request.method, request.raw_path, request.headers, body))
            return await self.handler(request)

        server = web.Server(record, handler_cancellation=True, access_log=None)
        self._runner = web.ServerRunner(server, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port, ssl_context=ssl_context)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"{'https' if ssl_context else 'http'}://127.0.0.1:{port}"
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


async def status_of(url: str) -> int | str:
    """A GET's status (its body read), or the name of the client error that ended it: a call
    cut short."""
    try:
        async with aiohttp.ClientSession() as s, s.get(url) as resp:
            await resp.read()
            return resp.status
    except aiohttp.ClientError as exc:
        return type(exc).__name__


async def ok_handler(request: web.BaseRequest) -> web.StreamResponse:
    return web.Response(body=b'{"kind":"Fine"}', content_type="application/json")



class Tapping:
    """A middleware that sets a tap on every call, as traffic capture does (the fast relay
    then parses a chunked body rather than passing it through, and never splices): ``body``
    is every response body byte it was shown."""

    name = "tapping"
    fail_open = False
    needs_body = False

    def __init__(self) -> None:
        self.body = bytearray()

    async def entry(self, ctx: Any) -> None:
        ctx.tap = self

    def request_body(self, chunk: bytes) -> None:
        pass

    def response_head(self, status: int, reason: Any, headers: Any) -> None:
        pass

    def response_body(self, chunk: bytes) -> None:
        self.body += chunk

class RawUpstream:
    """``asyncio.start_server`` with a per-connection callback; tracks when connections end."""

    def __init__(
        self, callback: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
    ) -> None:
        self._callback = callback
        self._server: asyncio.Server | None = None
        self.url = ""
        self.connections = 0
        self.closed: asyncio.Queue[float] = asyncio.Queue()  # loop time of each connection end
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, *, ssl_context: Any = None) -> RawUpstream:
        async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            task = asyncio.current_task()
            assert task is not None
            self._tasks.add(task)
            try:
                await self._callback(reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                self._tasks.discard(task)
                self.closed.put_nowait(asyncio.get_running_loop().time())
                writer.close()

        self._server = await asyncio.start_server(run, "127.0.0.1", 0, ssl=ssl_context)
        scheme = "https" if ssl_context else "http"
        self.url = f"{scheme}://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.sleep(0)
            self._server = None


async def read_head(reader: asyncio.StreamReader) -> tuple[str, dict[str, str]]:
    """Read an HTTP head; returns the first line and lower-cased headers (last one wins)."""
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return lines[0], headers


async def wait_closed(reader: asyncio.StreamReader) -> None:
    """Read and discard until the peer closes."""
    while await reader.read(65536):
        pass


RELAYS = ("fast", "aiohttp")
default_relay = "fast"  # set per test by the ``each_relay`` fixture (tests/integration/conftest.py)


@dataclass
class Proxy:
    relay: Relay | FastRelay
    listener: Listener
    url: str


@contextlib.asynccontextmanager
async def running_proxy(
    upstream_url: str,
    *,
    middlewares: tuple[object, ...] = (),
    settings: RelaySettings = RelaySettings(),  # noqa: B008
    policies: Policies | None = None,
    listen: str = "127.0.0.1:0",
    tls_cert: str | None = None,
    tls_key: str | None = None,
    relay_kind: str | None = None,
    shutdown_timeout: float = 1.0,
    host_guard: HostGuard | None = None,
    **upstream: Any,
) -> AsyncIterator[Proxy]:
    relay_class = FastRelay if (relay_kind or default_relay) == "fast" else Relay
    relay = relay_class(
        upstream=UpstreamConfig(url=upstream_url, **upstream),
        chain=Chain(middlewares),
        policies=policies or Policies(),
        settings=settings,
    )
    await relay.start()
    listener = await serve_api(
        relay, listen=listen, tls_cert=tls_cert, tls_key=tls_key,
        shutdown_timeout=shutdown_timeout, host_guard=host_guard,
    )
    scheme = "https" if tls_cert else "http"
    url = "" if listener.address.startswith("unix:") else f"{scheme}://{listener.address}"
    try:
        yield Proxy(relay, listener, url)
    finally:
        await listener.close()
        await relay.close()


def make_cert(
    directory: str, *, name: str = "cert", common_name: str = "127.0.0.1", rsa_key: bool = False,
    expired: bool = False, hours: int = 24,
) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1/localhost (an ECDSA key, or an RSA one; valid
    for ``hours``, or ``expired`` an hour ago); returns (cert path, key path)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import NameOID

    key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey = (
        rsa.generate_private_key(public_exponent=65537, key_size=2048) if rsa_key
        else ec.generate_private_key(ec.SECP256R1()))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=2 if expired else 0, minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=-1 if expired else hours))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path = os.path.join(directory, f"{name}.crt")
    key_path = os.path.join(directory, f"{name}.key")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return cert_path, key_path


def server_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    return ctx


def tls_upstream(tls: bool, directory: str) -> tuple[ssl.SSLContext | None, dict[str, Any]]:
    """For an upstream over TLS (``tls``): its server context and the ``running_proxy`` options
    that trust it (a new self-signed certificate in ``directory``); else ``(None, {})``."""
    if not tls:
        return None, {}
    cert, key = make_cert(directory)
    return server_context(cert, key), {"ca_file": cert}


def run_on(loop: str, main: Callable[[], Awaitable[None]]) -> None:
    """Run ``main()`` on a new event loop of the kind the relay runs on: "asyncio" or
    "uvloop"."""
    if loop == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


def rss_bytes() -> int:
    """This process's resident set size (VmRSS)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")
