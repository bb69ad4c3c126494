"""The TLS API listener while its certificate is renewed under it (proxy/relay/servingcert.py).

The renewals are made as they come: cert-manager's through a Secret volume (kubelet's atomic
``..data`` symlink swap, cert and key together), a person's by hand (the cert written, the
key after it). A client is Python's ``ssl``; each test runs on both relay cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.engine import limitlog, telemetry
from proxy.relay import servingcert, tlsaccept
from tests.integration.fakes import (
    AiohttpUpstream,
    make_cert,
    ok_handler,
    read_head,
    run_on,
    running_proxy,
)

pytestmark = pytest.mark.usefixtures("each_relay")


class ReloadLog(logging.Handler):
    """The listener's reload records ('…reload failed…', '…reloaded…'), awaitable as they come."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []
        self._grew = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("TLS certificate reload"):
            self.messages.append(record.getMessage())
            self._grew.set()

    async def nth(self, n: int) -> str:
        """The ``n``-th record (1-based), once it has come."""
        async with asyncio.timeout(10):
            while len(self.messages) < n:
                self._grew.clear()
                await self._grew.wait()
        return self.messages[n - 1]


@pytest.fixture
def reloads(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
            ) -> Iterator[ReloadLog]:
    monkeypatch.setattr(servingcert, "TLS_RELOAD_INTERVAL", 0.05)
    caplog.set_level(logging.INFO, logger="opgate.listen")  # ('…reloaded…' is INFO)
    handler = ReloadLog()
    logger = logging.getLogger("opgate.listen")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def der_of(pem_file: str) -> bytes:
    with open(pem_file, encoding="ascii") as f:
        return ssl.PEM_cert_to_DER_cert(f.read())


async def served(address: str, *, ciphers: str | None = None) -> bytes | None:
    """The certificate a new connection is served (``None``: the handshake failed); with
    ``ciphers``, as a TLS 1.2 client offering only those."""
    host, port = address.rsplit(":", 1)
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if ciphers:
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_ciphers(ciphers)
    try:
        _, writer = await asyncio.open_connection(host, int(port), ssl=ctx)
    except (ssl.SSLError, ConnectionError):
        return None
    der: bytes = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    return der


async def get_version(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
    """One keep-alive ``GET /version`` on an open connection; its status line."""
    writer.write(b"GET /version HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    status, headers = await read_head(reader)
    await reader.readexactly(int(headers["content-length"]))
    return status


def install(pair: tuple[str, str], directory: Path) -> tuple[str, str]:
    """The pair as ``tls.crt`` / ``tls.key`` in ``directory``."""
    cert, key = str(directory / "tls.crt"), str(directory / "tls.key")
    shutil.copy(pair[0], cert)
    shutil.copy(pair[1], key)
    return cert, key


def replace(source: str, target: str) -> None:
    """Write ``target`` as a person's tool does: a new file renamed over the old one."""
    shutil.copy(source, target + ".new")
    os.replace(target + ".new", target)


@pytest.mark.asyncio
async def test_a_pair_caught_half_written_never_stops_the_old_one_serving(
    tmp_path: Path, reloads: ReloadLog
) -> None:
    """The new cert written, its key not yet: a reload then must keep serving the old pair
    (it left the live context without a usable key: every handshake failed)."""
    old = make_cert(str(tmp_path), name="old")
    new = make_cert(str(tmp_path), name="new")
    cert, key = install(old, tmp_path)
    up = await AiohttpUpstream(ok_handler).start()
    try:
        async with running_proxy(up.url, tls_cert=cert, tls_key=key) as proxy:
            address = proxy.listener.address
            replace(new[0], cert)
            assert "reload failed" in await reloads.nth(1)
            assert f"--tls-key {key} is not the private key of" in reloads.messages[0]
            assert await served(address) == der_of(old[0])
            replace(new[1], key)
            assert "reloaded" in await reloads.nth(2)
            assert await served(address) == der_of(new[0])
    finally:
        await up.close()


def kubelet_volume(directory: Path, pair: tuple[str, str], version: str) -> tuple[str, str]:
    """A Secret volume as kubelet writes it, or updates it: the files in a timestamped
    directory, ``..data`` a symlink to it swapped atomically, ``tls.crt`` -> ``..data/tls.crt``."""
    versioned = directory / f"..{version}"
    versioned.mkdir()
    shutil.copy(pair[0], versioned / "tls.crt")
    shutil.copy(pair[1], versioned / "tls.key")
    (directory / "..data_tmp").symlink_to(versioned.name)
    os.replace(directory / "..data_tmp", directory / "..data")
    for name in ("tls.crt", "tls.key"):
        if not (directory / name).is_symlink():
            (directory / name).symlink_to(f"..data/{name}")
    return str(directory / "tls.crt"), str(directory / "tls.key")


@pytest.mark.parametrize(("old_rsa", "new_rsa"), [(False, True), (True, False)],
                         ids=["ecdsa-to-rsa", "rsa-to-ecdsa"])
@pytest.mark.asyncio
async def test_a_renewal_with_another_key_type_replaces_the_old_certificate(
    tmp_path: Path, reloads: ReloadLog, old_rsa: bool, new_rsa: bool
) -> None:
    """cert-manager's privateKey.algorithm changed: the new certificate is all that is
    served (OpenSSL keeps an ECDSA and an RSA pair side by side in one context, so the old one
    went on being served, to every client preferring its type), and a keep-alive connection
    made before the renewal goes on working."""
    old = make_cert(str(tmp_path), name="old", rsa_key=old_rsa)
    new = make_cert(str(tmp_path), name="new", rsa_key=new_rsa)
    volume = tmp_path / "volume"
    volume.mkdir()
    cert, key = kubelet_volume(volume, old, "2025_01_01")
    old_ciphers = "ECDHE-RSA-AES128-GCM-SHA256" if old_rsa else "ECDHE-ECDSA-AES128-GCM-SHA256"
    up = await AiohttpUpstream(ok_handler).start()
    try:
        async with running_proxy(up.url, tls_cert=cert, tls_key=key) as proxy:
            address = proxy.listener.address
            host, port = address.rsplit(":", 1)
            trust_old = ssl.create_default_context(cafile=old[0])
            kept = await asyncio.open_connection(host, int(port), ssl=trust_old)
            assert (await get_version(*kept)).endswith(" 200 OK")
            kubelet_volume(volume, new, "2025_02_01")
            assert "reloaded" in await reloads.nth(1)
            assert await served(address) == der_of(new[0])
            assert await served(address, ciphers=old_ciphers) is None  # no old one to give
            assert (await get_version(*kept)).endswith(" 200 OK")
            kept[1].close()
    finally:
        await up.close()


@pytest.mark.asyncio
async def test_a_bad_pair_is_reported_once_not_at_every_poll(
    tmp_path: Path, reloads: ReloadLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pair that stays bad is one warning (it was one every poll, 720 an hour), and the
    next change of the files is tried again."""
    old = make_cert(str(tmp_path), name="old")
    new = make_cert(str(tmp_path), name="new")
    cert, key = install(old, tmp_path)
    polls = asyncio.Event()
    seen: dict[str, Any] = {"stats": 0, "until": 0}
    real_stat = os.stat

    def counting_stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if path == cert:  # once a poll
            seen["stats"] += 1
            if seen["stats"] >= seen["until"]:
                polls.set()
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", counting_stat)
    up = await AiohttpUpstream(ok_handler).start()
    try:
        async with running_proxy(up.url, tls_cert=cert, tls_key=key):
            replace(new[0], cert)
            assert "reload failed" in await reloads.nth(1)
            seen["until"] = seen["stats"] + 3  # two more polls done, a third begun
            polls.clear()
            async with asyncio.timeout(10):
                await polls.wait()
            assert len(reloads.messages) == 1, reloads.messages
            replace(new[1], key)
            assert "reloaded" in await reloads.nth(2)
    finally:
        await up.close()


@pytest.mark.asyncio
async def test_an_expired_renewal_is_refused_and_the_old_pair_serves_on(
    tmp_path: Path, reloads: ReloadLog
) -> None:
    """A consistent pair whose certificate has expired (a backup restored, the wrong Secret)
    is said and not served: it was loaded, and every client then refused opgate."""
    old = make_cert(str(tmp_path), name="old")
    stale = make_cert(str(tmp_path), name="stale", expired=True)
    new = make_cert(str(tmp_path), name="new")
    volume = tmp_path / "volume"
    volume.mkdir()
    cert, key = kubelet_volume(volume, old, "1")
    up = await AiohttpUpstream(ok_handler).start()
    try:
        async with running_proxy(up.url, tls_cert=cert, tls_key=key) as proxy:
            kubelet_volume(volume, stale, "2")
            failed = await reloads.nth(1)
            assert "reload failed" in failed and "expired" in failed, failed
            assert await served(proxy.listener.address) == der_of(old[0])
            kubelet_volume(volume, new, "3")
            assert "reloaded" in await reloads.nth(2)
            assert await served(proxy.listener.address) == der_of(new[0])
    finally:
        await up.close()


@pytest.mark.asyncio
async def test_a_file_gone_is_said_and_the_old_pair_serves_on(
    tmp_path: Path, reloads: ReloadLog
) -> None:
    """The key removed (a Secret's key renamed, a mount gone): one warning naming it, where
    the reloader said nothing; the old pair serves on, and a pair put back is loaded."""
    old = make_cert(str(tmp_path), name="old")
    new = make_cert(str(tmp_path), name="new")
    cert, key = install(old, tmp_path)
    up = await AiohttpUpstream(ok_handler).start()
    try:
        async with running_proxy(up.url, tls_cert=cert, tls_key=key) as proxy:
            os.unlink(key)
            gone = await reloads.nth(1)
            assert f"--tls-key {key}: cannot read it" in gone, gone
            assert await served(proxy.listener.address) == der_of(old[0])
            replace(new[0], cert)
            replace(new[1], key)
            assert "reloaded" in await reloads.nth(2)
            assert await served(proxy.listener.address) == der_of(new[0])
    finally:
        await up.close()


# --- a plain HTTP request to the TLS port (proxy/relay/tlsaccept.py) -------------------------

GO_ANSWER = b"HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS server.\n"


async def curl(*args: str) -> tuple[int, bytes, bytes]:
    proc = await asyncio.create_subprocess_exec(
        "curl", "-sS", "--max-time", "10", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out, err


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_curl_over_plain_http_gets_the_answer_go_gives(
    loop: str, tmp_path: Path, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``curl http://`` against the TLS port got "Empty reply from server"; the apiserver (Go's
    net/http) answers a 400 saying what is wrong, and now opgate does, in one WARNING line
    (rate-limited: a second refusal right after it is counted into the next one), without a
    traceback; ``curl https://`` on the same listener is served as before."""
    cert, key = make_cert(str(tmp_path))
    caplog.set_level(logging.WARNING, logger="opgate.listen")
    monkeypatch.setattr(limitlog, "_last_logged", {})  # no earlier test's line holds it back
    monkeypatch.setattr(limitlog, "_suppressed", {})

    async def main() -> None:
        up = await AiohttpUpstream(ok_handler).start()
        try:
            async with running_proxy(up.url, tls_cert=cert, tls_key=key) as proxy:
                address = proxy.listener.address
                for _ in range(2):
                    code, out, err = await curl("-i", f"http://{address}/api")
                    assert (code, out) == (0, GO_ANSWER), err
                code, out, err = await curl("--cacert", cert, f"https://{address}/version")
                assert (code, out) == (0, b'{"kind":"Fine"}'), err
                assert await served(address) is not None
        finally:
            await up.close()

    run_on(loop, main)
    refused = [r.getMessage() for r in caplog.records if "TLS API listener" in r.getMessage()]
    assert refused == ["an HTTP request from 127.0.0.1 came to the TLS API listener: answered "
                       "400 (its client needs https://)"], refused
    assert limitlog._suppressed == {"plain-http": 1}
    assert all(r.exc_info is None for r in caplog.records)


async def plain_request(address: str, *parts: bytes) -> bytes:
    """What a plain-HTTP client sending ``parts`` (one write each) reads until the server's
    end of stream; a reset before it fails the test."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        for part in parts:
            writer.write(part)
            await writer.drain()
        async with asyncio.timeout(10):
            return await reader.read(-1)
    finally:
        writer.close()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_plain_request_in_pieces_or_with_a_body_gets_the_whole_answer(
    loop: str, tmp_path: Path
) -> None:
    """The five bytes Go looks at may come in two reads; a POST's body left unread must not
    make the close a reset that overtakes the answer (the rest is read and dropped). What is
    neither TLS nor one of Go's five starts is closed unanswered, as Go and the TLS layer do."""
    cert, key = make_cert(str(tmp_path))

    async def main() -> None:
        up = await AiohttpUpstream(ok_handler).start()
        try:
            async with running_proxy(up.url, tls_cert=cert, tls_key=key) as proxy:
                address = proxy.listener.address
                assert await plain_request(address, b"GE", b"T /api HTTP/1.1\r\nHost: x\r\n\r\n"
                                           ) == GO_ANSWER
                body = b"x" * (4 << 20)
                head = f"POST /api/v1/namespaces HTTP/1.1\r\nHost: x\r\nContent-Length: " \
                       f"{len(body)}\r\n\r\n".encode()
                assert await plain_request(address, head + body) == GO_ANSWER
                assert await plain_request(address, b"DELETE /api HTTP/1.1\r\n\r\n") == b""
                assert await served(address) is not None
        finally:
            await up.close()

    run_on(loop, main)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("sent", [b"", b"\x16", b"GET"], ids=["nothing", "a-tls-byte", "GET"])
def test_a_client_that_stalls_before_its_handshake_is_closed_after_the_timeout(
    loop: str, sent: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection that sends nothing (or the start of a ClientHello, or of a request line,
    and no more) holds a descriptor until the handshake timeout from its accept, no longer,
    as the TLS layer held it."""
    monkeypatch.setattr(tlsaccept, "HANDSHAKE_TIMEOUT", 0.5)
    cert, key = make_cert(str(tmp_path))

    async def main() -> None:
        up = await AiohttpUpstream(ok_handler).start()
        try:
            async with running_proxy(up.url, tls_cert=cert, tls_key=key) as proxy:
                host, port = proxy.listener.address.rsplit(":", 1)
                loop_ = asyncio.get_running_loop()
                began = loop_.time()
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(sent)
                async with asyncio.timeout(10):
                    assert await reader.read(-1) == b""
                assert loop_.time() - began >= 0.45
                writer.close()
        finally:
            await up.close()

    run_on(loop, main)


# --- what a failed reload shows besides its log line ----------------------------------------

def expiry_metric(cert: str) -> float | None:
    return telemetry.REGISTRY.get_sample_value(
        "opgate_tls_cert_expiry_timestamp_seconds", {"cert": cert})


def reloads_metric(result: str) -> float:
    value = telemetry.REGISTRY.get_sample_value("opgate_tls_cert_reloads_total",
                                                {"result": result})
    assert value is not None
    return value


def not_after_of(cert: str) -> float:
    ends = servingcert.not_after(cert)
    assert ends is not None
    return ends.timestamp()


@pytest.mark.asyncio
async def test_a_refused_reload_is_seen_in_the_metrics_and_the_serving_cert_check(
    tmp_path: Path, reloads: ReloadLog
) -> None:
    """A changed pair that cannot be served (a key of another cert, an expired renewal) was one
    WARNING line and nothing else: now the expiry gauge goes on showing the certificate that
    still serves, the error count grows, and the ``serving-cert`` check (passing: the old one
    serves) says why; a good pair then moves the gauge and clears the warning."""
    old = make_cert(str(tmp_path), name="old", hours=24)
    new = make_cert(str(tmp_path), name="new", hours=48)
    stale = make_cert(str(tmp_path), name="stale", expired=True)
    volume = tmp_path / "volume"
    volume.mkdir()
    cert, key = kubelet_volume(volume, old, "1")
    errors, successes = reloads_metric("error"), reloads_metric("success")
    up = await AiohttpUpstream(ok_handler).start()
    try:
        async with running_proxy(up.url, tls_cert=cert, tls_key=key) as proxy:
            listener = proxy.listener
            assert expiry_metric(cert) == not_after_of(old[0])
            ok, detail = await listener.serving_cert()
            assert ok and detail.startswith(f"{cert}, notAfter 20"), detail
            kubelet_volume(volume, (new[0], old[1]), "2")  # (a Secret with another's key)
            assert "reload failed" in await reloads.nth(1)
            assert reloads_metric("error") == errors + 1
            assert expiry_metric(cert) == not_after_of(old[0])
            ok, detail = await listener.serving_cert()
            assert ok, detail
            assert detail.startswith(f"warning: the changed files are not served: --tls-key "
                                     f"{key} is not the private key of --tls-cert {cert} "
                                     "(since 20"), detail
            assert detail.endswith(f"; the old certificate serves on ({cert}, notAfter "
                                   f"{servingcert.not_after(old[0]):%Y-%m-%dT%H:%M:%SZ})")
            kubelet_volume(volume, new, "3")
            assert "reloaded" in await reloads.nth(2)
            assert reloads_metric("success") == successes + 1
            assert expiry_metric(cert) == not_after_of(new[0]) != not_after_of(old[0])
            assert (await listener.serving_cert())[1].startswith(f"{cert}, notAfter 20")
            kubelet_volume(volume, stale, "4")
            failed = await reloads.nth(3)
            assert "expired" in failed, failed
            assert reloads_metric("error") == errors + 2
            assert expiry_metric(cert) == not_after_of(new[0])
            assert "the certificate expired at" in (await listener.serving_cert())[1]
    finally:
        await up.close()


async def get_with_the_hello_split(address: str, ca: str) -> bytes:
    """``GET /version`` over TLS whose ClientHello's first byte is sent alone, the rest 0.1 s
    later (a client, or a network, cutting its first write): the answer's body."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ssl.create_default_context(cafile=ca).wrap_bio(incoming, outgoing,
                                                         server_hostname="127.0.0.1")
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    hello = outgoing.read()
    writer.write(hello[:1])
    await writer.drain()
    await asyncio.sleep(0.1)  # (what is tested is a pause: nothing to wait for instead)
    writer.write(hello[1:])
    async with asyncio.timeout(10):
        while True:
            received = await reader.read(65536)
            if not received:
                raise ConnectionError("closed during the handshake")
            incoming.write(received)
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                writer.write(outgoing.read())
        tls.write(b"GET /version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        writer.write(outgoing.read())
        answer = b""
        while chunk := await reader.read(65536):
            incoming.write(chunk)
            try:
                while more := tls.read(65536):
                    answer += more
            except ssl.SSLWantReadError:
                continue
            break  # (b"": its close_notify, after the answer)
    writer.close()
    return answer.partition(b"\r\n\r\n")[2]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_client_hello_whose_first_byte_comes_alone_is_served(loop: str, tmp_path: Path) -> None:
    """The first read decides plain HTTP or TLS and is handed to the TLS layer: one that holds
    a single byte of the ClientHello must leave the layer the rest to read."""
    cert, key = make_cert(str(tmp_path))

    async def main() -> None:
        up = await AiohttpUpstream(ok_handler).start()
        try:
            async with running_proxy(up.url, tls_cert=cert, tls_key=key) as proxy:
                assert await get_with_the_hello_split(proxy.listener.address, cert) \
                    == b'{"kind":"Fine"}'
        finally:
            await up.close()

    run_on(loop, main)
