"""``python -m proxy serve`` as the user meets it: bad files, addresses and Redis settings give one
line naming the flag and what is wrong (exit code 2), never a traceback; a Redis that is down,
refuses the password or does not speak TLS is said once at start, and opgate serves on.

Redis is a real ``redis-server`` started with ``--requirepass``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import subprocess
import sys
import termios
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.envtest import pki
from proxy.envtest.procs import Proc, free_port
from tests.integration.fakes import make_cert
from tests.integration.opgate_proc import OpgateProcess
from tests.integration.redis_server import REDIS_BINARY

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "s3cret"
UPSTREAM = "http://127.0.0.1:1"  # never called: these tests are about starting


def _serve(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--upstream", UPSTREAM, *argv],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def _one_error(done: subprocess.CompletedProcess[str], *words: str) -> str:
    """Exit code 2 and exactly one error line holding ``words``; no traceback."""
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines()
              if " ERROR " in line or line.startswith("opgate")]
    assert len(errors) == 1, done.stderr
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def garbage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("files") / "garbage.pem"
    path.write_text("this is not PEM\n")
    return path


def test_upstream_ca_that_is_not_pem(garbage: Path) -> None:
    _one_error(_serve("--upstream", "https://127.0.0.1:6443", "--upstream-ca", str(garbage)),
               "--upstream-ca", str(garbage), "not a PEM")


@pytest.mark.parametrize("which", ["garbage", "missing"])
def test_tls_pair_that_cannot_be_loaded(garbage: Path, which: str) -> None:
    cert = str(garbage) if which == "garbage" else "/nonexistent/tls.crt"
    line = _one_error(_serve("--tls-cert", cert, "--tls-key", str(garbage)), "--tls-cert", cert)
    if which == "missing":
        assert "cannot read it" in line


@pytest.mark.parametrize(("case", "words"), [
    ("swapped", ("--tls-cert {key}: not a PEM certificate",)),
    ("mismatched", ("--tls-key {other_key} is not the private key of --tls-cert {cert}",)),
    ("key-empty", ("--tls-key {empty}: not a PEM private key",)),
])
def test_a_tls_pair_that_does_not_load_names_the_file_at_fault(
    tmp_path: Path, case: str, words: tuple[str, ...]
) -> None:
    """Each was 'not a PEM certificate and its private key ([SSL] PEM lib (_ssl.c:3905))'
    (or '(KEY_VALUES_MISMATCH)'), naming both files: the two flags given the other's file,
    a key of another certificate, an empty key file."""
    cert, key = make_cert(str(tmp_path), name="mine")
    _, other_key = make_cert(str(tmp_path), name="other")
    empty = tmp_path / "empty.key"
    empty.write_text("")
    given = {"swapped": (key, cert), "mismatched": (cert, other_key),
             "key-empty": (cert, str(empty))}[case]
    names = {"cert": cert, "key": key, "other_key": other_key, "empty": empty}
    _one_error(_serve("--tls-cert", given[0], "--tls-key", given[1]),
               *(word.format(**names) for word in words))


def _take_the_terminal() -> None:
    """(In the child, a session leader:) stdin, a pty, becomes its controlling terminal."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _serve_on_a_terminal(*argv: str) -> tuple[int | None, str]:
    """``opgate serve`` run in a terminal (a pty, its controlling one): the exit code (``None``:
    still running after 30 s, then killed) and what it wrote there."""
    leader, follower = os.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--upstream", UPSTREAM, *argv],
        stdin=follower, stdout=follower, stderr=follower, cwd=ROOT, start_new_session=True,
        preexec_fn=_take_the_terminal, env={**os.environ, "PYTHONPATH": str(ROOT)})
    os.close(follower)
    try:
        code: int | None = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    out = b""
    with contextlib.suppress(OSError):  # EIO once all is read: the terminal has no writer
        while chunk := os.read(leader, 65536):
            out += chunk
    os.close(leader)
    return code, out.decode(errors="replace")


def test_a_key_encrypted_with_a_passphrase_is_one_clear_line_even_on_a_terminal(
    tmp_path: Path
) -> None:
    """OpenSSL asks the terminal for an encrypted key's passphrase and waits: ``opgate serve``
    run in one hung at 'Enter PEM pass phrase:' (a reload would have stopped the event loop
    there); without one it said 'not a PEM certificate and its private key ([Errno 22] Invalid
    argument)'."""
    from cryptography.hazmat.primitives import serialization

    cert, key = make_cert(str(tmp_path))
    with open(key, "rb") as f:
        loaded = serialization.load_pem_private_key(f.read(), None)
    with open(key, "wb") as f:
        f.write(loaded.private_bytes(serialization.Encoding.PEM,
                                     serialization.PrivateFormat.PKCS8,
                                     serialization.BestAvailableEncryption(b"s3cret")))
    code, out = _serve_on_a_terminal("--listen", "127.0.0.1:0", "--admin-listen",
                                     "127.0.0.1:0", "--tls-cert", cert, "--tls-key", key)
    assert code == 2, out
    assert "pass phrase" not in out
    assert f"--tls-key {key}: the key is encrypted with a passphrase" in out
    assert _one_error(_serve("--tls-cert", cert, "--tls-key", key), "--tls-key", key,
                      "encrypted with a passphrase")


@pytest.mark.parametrize(("flag", "value"), [
    ("--listen", "notanaddr"), ("--listen", "127.0.0.1:99999"),
    ("--admin-listen", "notanaddr"), ("--admin-listen", "127.0.0.1:99999"),
])
def test_listen_address_that_is_not_one(flag: str, value: str) -> None:
    _one_error(_serve(flag, value), flag, value)


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("flag", ["--listen", "--admin-listen"])
def test_port_in_use(flag: str, taken_port: int) -> None:
    other = "--admin-listen" if flag == "--listen" else "--listen"
    address = f"127.0.0.1:{taken_port}"
    _one_error(_serve(flag, address, other, f"127.0.0.1:{free_port()}"), flag, address,
               "already in use")


@pytest.mark.parametrize("flag", ["--listen", "--admin-listen"])
def test_port_in_use_with_workers(flag: str, taken_port: int) -> None:
    """The supervisor of --workers holds both ports itself: the same one line, exit 2."""
    other = "--admin-listen" if flag == "--listen" else "--listen"
    address = f"127.0.0.1:{taken_port}"
    done = _serve("--workers", "2", "--redis-url", "redis://127.0.0.1:1/0", flag, address,
                  other, f"127.0.0.1:{free_port()}")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if "cannot listen" in line]
    assert len(lines) == 1, done.stderr
    assert f"{flag} {address}" in lines[0] and "already in use" in lines[0]


def test_redis_password_file_missing() -> None:
    _one_error(_serve("--redis-url", "redis://127.0.0.1:6379/0", "--redis-password-file",
                      "/nonexistent"), "--redis-password-file", "/nonexistent")


@pytest.mark.parametrize("url", [
    "http://x", "redis://127.0.0.1:notaport/0",
    # redis-py reads these from the query, and raised its ValueError out of `opgate serve`
    "unix:///run/redis.sock?db=one", "redis://127.0.0.1:6379?db=1x",
    "redis://127.0.0.1:6379/0?socket_timeout=soon",
    # an unknown one failed every connection (Redis "unavailable" for as long as it ran)
    "redis://127.0.0.1:6379/0?ssl_ca_cert=/etc/ca.crt",
])
def test_redis_url_that_is_not_one(url: str) -> None:
    _one_error(_serve("--redis-url", url), "--redis-url", url)


def test_redis_ca_file_unreadable() -> None:
    _one_error(_serve("--redis-url", "rediss://127.0.0.1:6379/0?ssl_ca_certs=/nonexistent/ca.crt"),
               "--redis-url", "ssl_ca_certs=/nonexistent/ca.crt", "cannot read it")


def test_bad_numeric_variable() -> None:
    _one_error(_serve(env={"OPGATE_HEADER_TIMEOUT": "30s"}), "OPGATE_HEADER_TIMEOUT")


# --- Redis misconfigured or down: said once at start, opgate serves on --------------------


@pytest.fixture(scope="module")
def password_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    tmp = tmp_path_factory.mktemp("redis")
    port = free_port()
    proc = Proc("redis", [REDIS_BINARY, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                          "--appendonly", "no", "--dir", str(tmp), "--requirepass", PASSWORD],
                log=tmp / "redis.log")
    proc.start()
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if b"NOAUTH" in s.recv(64):
                        break
            except OSError:
                time.sleep(0.05)
        yield port
    finally:
        proc.stop()


def _readyz_store_line(opgate: OpgateProcess) -> str:
    try:
        with urllib.request.urlopen(opgate.admin_url + "/readyz?verbose", timeout=5) as resp:
            body = resp.read().decode()
    except urllib.error.HTTPError as exc:  # the fake upstream is down: 503, body still says
        body = exc.read().decode()
    return next(line for line in body.splitlines() if "ratelimit-store" in line)


def _backend_gauge(opgate: OpgateProcess) -> dict[str, float]:
    """``opgate_ratelimit_backend`` by backend, from ``/metrics``."""
    with urllib.request.urlopen(opgate.admin_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    prefix = 'opgate_ratelimit_backend{backend="'
    return {line[len(prefix):].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}


def _wait_for(opgate: OpgateProcess, text: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in opgate.stderr():
        assert opgate.proc.poll() is None, opgate.stderr()
        assert time.monotonic() < deadline, opgate.stderr()
        time.sleep(0.1)


@pytest.mark.parametrize(("url", "problem"), [
    ("redis://:wrong@127.0.0.1:{port}/0", "authentication failed"),
    ("redis://127.0.0.1:{port}/0", "authentication failed"),
    ("rediss://:" + PASSWORD + "@127.0.0.1:{port}/0", "TLS failed"),
    ("redis://127.0.0.1:{free}/0", "unreachable"),
])
def test_redis_problem_is_one_error_line_and_opgate_serves_on(
        password_redis: int, tmp_path: Path, url: str, problem: str) -> None:
    url = url.format(port=password_redis, free=free_port())
    opgate = OpgateProcess("--upstream", UPSTREAM, "--redis-url", url, log_dir=tmp_path)
    try:
        opgate.wait_ready()
        _wait_for(opgate, problem)
        time.sleep(0.3)
        errors = [line for line in opgate.stderr().splitlines() if " ERROR " in line]
        assert len(errors) == 1, opgate.stderr()
        assert problem in errors[0] and "goes on" in errors[0]
        assert PASSWORD not in opgate.stderr() and ":wrong@" not in opgate.stderr()
        store = _readyz_store_line(opgate)
        assert store.startswith("[+]")  # readiness does not flap with Redis
        assert "degraded" in store and problem in store
        # the circuit opened at the probe: no call waits for Redis to fail first, and the
        # gauge says what /readyz says
        assert _backend_gauge(opgate) == {"redis": 0, "local": 0, "fallback": 1}
        assert opgate.proc.poll() is None  # Redis down never takes the proxy down
        assert "Traceback" not in opgate.stderr()
    finally:
        assert opgate.stop() == 0


def _redis_errors(opgate: OpgateProcess) -> float:
    """``opgate_redis_errors_total``: each failed probe of the open circuit adds one."""
    with urllib.request.urlopen(opgate.admin_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    [value] = [line.rsplit(" ", 1)[1] for line in text.splitlines()
               if line.startswith("opgate_redis_errors_total ")]
    return float(value)


@pytest.mark.parametrize(("url", "problem"), [
    ("redis://:wrong@127.0.0.1:{port}/0", "authentication failed"),
    ("redis://127.0.0.1:{free}/0", "unreachable"),
])
def test_redis_still_away_for_the_same_reason_logs_nothing_more(
        password_redis: int, tmp_path: Path, url: str, problem: str) -> None:
    """The start-up ERROR said why; the circuit's probes that fail for that same reason add no
    WARNING (the README: one ERROR line, a WARNING for each new reason), and /readyz keeps the
    reason in the words the ERROR used (the probes said it as redis-py's exception)."""
    url = url.format(port=password_redis, free=free_port())
    opgate = OpgateProcess("--upstream", UPSTREAM, "--redis-url", url, log_dir=tmp_path)
    try:
        opgate.wait_ready()
        _wait_for(opgate, problem)
        failed = _redis_errors(opgate)
        deadline = time.monotonic() + 10
        while _redis_errors(opgate) < failed + 2:  # two probes of the open circuit failed
            assert time.monotonic() < deadline, opgate.stderr()
            time.sleep(0.1)
        warnings = [line for line in opgate.stderr().splitlines() if " WARNING " in line]
        assert not [w for w in warnings if "still unavailable" in w], opgate.stderr()
        store = _readyz_store_line(opgate)
        assert "degraded" in store and problem in store, store
    finally:
        assert opgate.stop() == 0


def test_redis_that_comes_up_later_takes_over(tmp_path: Path) -> None:
    """Redis away at start, then up on its address: the store's probes find it (no call
    needed), the gauge and /readyz say so, and no further error is logged. /readyz said
    ``degraded: Redis unreachable`` (the start-up check's words) for up to 5 s more, until
    that check's own next PING, while the store decided with Redis again."""
    port = free_port()
    opgate = OpgateProcess("--upstream", UPSTREAM, "--redis-url", f"redis://127.0.0.1:{port}/0",
                           log_dir=tmp_path)
    redis = Proc("redis", [REDIS_BINARY, "--bind", "127.0.0.1", "--port", str(port), "--save",
                           "", "--appendonly", "no", "--dir", str(tmp_path)],
                 log=tmp_path / "redis.log")
    try:
        opgate.wait_ready()
        _wait_for(opgate, "unreachable")
        assert _backend_gauge(opgate)["fallback"] == 1
        redis.start()
        deadline = time.monotonic() + 15
        while _backend_gauge(opgate)["redis"] != 1:
            assert time.monotonic() < deadline, (_backend_gauge(opgate), opgate.stderr())
            time.sleep(0.1)
        assert _backend_gauge(opgate)["fallback"] == 0
        _wait_for(opgate, "rate-limit store is back")
        store = _readyz_store_line(opgate)
        assert "degraded" not in store and "breaker=closed" in store, store
        errors = [line for line in opgate.stderr().splitlines() if " ERROR " in line]
        assert len(errors) == 1, opgate.stderr()
    finally:
        assert opgate.stop() == 0
        redis.stop()


def test_redis_ca_that_is_not_the_servers(password_redis: int, tmp_path: Path) -> None:
    """A readable ssl_ca_certs against a server that speaks no TLS: TLS failed, serving on."""
    files = pki.write_pki(tmp_path / "pki")
    url = (f"rediss://:{PASSWORD}@127.0.0.1:{password_redis}/0"
           f"?ssl_ca_certs={files.ca_cert}")
    opgate = OpgateProcess("--upstream", UPSTREAM, "--redis-url", url, log_dir=tmp_path)
    try:
        opgate.wait_ready()
        _wait_for(opgate, "TLS failed")
        assert opgate.proc.poll() is None
    finally:
        assert opgate.stop() == 0


def test_redis_that_answers_is_not_reported(password_redis: int, tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text(PASSWORD + "\n")
    opgate = OpgateProcess("--upstream", UPSTREAM, "--redis-url",
                           f"redis://127.0.0.1:{password_redis}/0", "--redis-password-file",
                           str(secret), log_dir=tmp_path)
    try:
        opgate.wait_ready()
        time.sleep(0.5)  # the probe has answered by now
        assert " ERROR " not in opgate.stderr(), opgate.stderr()
        store = _readyz_store_line(opgate)
        assert store.startswith("[+]") and "degraded" not in store, store
    finally:
        assert opgate.stop() == 0


def test_policy_errors_at_start_are_one_per_line(tmp_path: Path) -> None:
    """Policies that do not load stop opgate with every error on a line of its own, as
    ``file:line: message`` (as ``opgate check`` prints them): the escaping that keeps a
    request from forging a log line leaves these lines, which come from the policy files."""
    policy = tmp_path / "broken.yaml"
    policy.write_text("apiVersion: opgate.dev/v1alpha1\nkind: Policy\nmetadata: {name: b}\n"
                      "spec:\n  mode: sometimes\n  colour: red\n")
    done = _serve("--policies", str(policy))
    assert done.returncode != 0, done.stderr
    lines = [line.strip() for line in done.stderr.splitlines()]
    assert any(line.startswith(f"{policy}:5:") and "mode" in line for line in lines), done.stderr
    assert any(line.startswith(f"{policy}:6:") and "colour" in line for line in lines), \
        done.stderr
