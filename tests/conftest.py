"""Hooks of the whole test suite."""

from __future__ import annotations

import pytest

from proxy.envtest.procs import interrupt_on_sigterm


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM (a CI timeout, ``timeout``) interrupts the run as Ctrl-C does, so that the
    fixtures' teardown stops the servers they started; SIGKILL is the reaper's case."""
    interrupt_on_sigterm()


def pytest_runtest_logfinish() -> None:
    """Again after each test: one that ran an asyncio loop's signal handlers in this process
    leaves SIGTERM at its default when it removes them."""
    interrupt_on_sigterm()
