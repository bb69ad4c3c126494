"""Waiting in e2e tests for what opgate learns through its watches (counts, kinds, events)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(what: str, check: Callable[[], bool], timeout: float = 15.0) -> None:
    """Poll ``check`` every 0.1 s until it holds; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")
