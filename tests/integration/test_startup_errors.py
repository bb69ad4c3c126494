"""``python -m proxy serve`` as the user meets it: bad files, addresses and Redis settings give one
line naming the flag and what is wrong (exit code 2), never a traceback.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.envtest.procs import free_port

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


def test_redis_password_file_missing() -> None:
    _one_error(_serve("--redis-url", "redis://127.0.0.1:6379/0", "--redis-password-file",
                      "/nonexistent"), "--redis-password-file", "/nonexistent")


@pytest.mark.parametrize("url", ["http://x", "redis://127.0.0.1:notaport/0"])
def test_redis_url_that_is_not_one(url: str) -> None:
    _one_error(_serve("--redis-url", url), "--redis-url", url)


def test_redis_ca_file_unreadable() -> None:
    _one_error(_serve("--redis-url", "rediss://127.0.0.1:6379/0?ssl_ca_certs=/nonexistent/ca.crt"),
               "--redis-url", "ssl_ca_certs=/nonexistent/ca.crt", "cannot read it")


def test_bad_numeric_variable() -> None:
    _one_error(_serve(env={"OPGATE_HEADER_TIMEOUT": "30s"}), "OPGATE_HEADER_TIMEOUT")
