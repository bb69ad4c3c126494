"""SIGTERM of a test run (``tests/conftest.py`` with ``proxy.envtest.procs``) on a real pytest:
the first interrupts it as Ctrl-C does, so that fixtures' teardown stops what they started;
a second ends it at once (the reaper's case)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.procwatch import read_until

REPO = Path(__file__).resolve().parents[2]
SAID_WITHIN = 60.0
Starter = Callable[..., subprocess.Popen[bytes]]

INNER_TEST = '''
import asyncio, signal, threading

import pytest


@pytest.fixture(scope="session")
def held():
    yield
    print("TEARDOWN STARTED", flush=True)
    if {hang}:
        threading.Event().wait(600)  # a teardown that hangs: only a second SIGTERM ends it
    print("TEARDOWN RAN", flush=True)


def test_an_asyncio_loop_that_handled_sigterm():
    async def main():
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, lambda: None)
        loop.remove_signal_handler(signal.SIGTERM)  # leaves SIGTERM at its default

    asyncio.run(main())


def test_hold(held):
    print("HOLDING", flush=True)
    threading.Event().wait(600)
'''


@pytest.fixture
def inner_pytest(tmp_path: Path) -> Iterator[Starter]:
    started: list[subprocess.Popen[bytes]] = []

    def start(*, hang: bool) -> subprocess.Popen[bytes]:
        (tmp_path / "test_inner.py").write_text(INNER_TEST.format(hang=hang))
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.conftest",
             "-q", "-s", "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def test_sigterm_runs_the_teardown_even_after_a_test_reset_it(inner_pytest: Starter) -> None:
    inner = inner_pytest(hang=False)
    assert inner.stdout is not None
    said = read_until(inner.stdout.fileno(), "HOLDING", SAID_WITHIN)
    assert "HOLDING" in said, said
    inner.send_signal(signal.SIGTERM)
    said += read_until(inner.stdout.fileno(), None, SAID_WITHIN)
    assert inner.wait(timeout=SAID_WITHIN) == pytest.ExitCode.INTERRUPTED, said
    assert "TEARDOWN RAN" in said, said


def test_a_second_sigterm_ends_it_at_once(inner_pytest: Starter) -> None:
    inner = inner_pytest(hang=True)
    assert inner.stdout is not None
    said = read_until(inner.stdout.fileno(), "HOLDING", SAID_WITHIN)
    assert "HOLDING" in said, said
    inner.send_signal(signal.SIGTERM)
    said += read_until(inner.stdout.fileno(), "TEARDOWN STARTED", SAID_WITHIN)
    assert "TEARDOWN STARTED" in said, said
    inner.send_signal(signal.SIGTERM)
    assert inner.wait(timeout=SAID_WITHIN) == -signal.SIGTERM
