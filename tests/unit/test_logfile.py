"""The shared background writer and rotating file (proxy/engine/logfile.py)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from proxy.engine.logfile import BackgroundWriter


def test_a_failing_batch_is_logged_and_the_thread_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    seen: list[str] = []
    first = threading.Event()

    def handle(batch: Sequence[str]) -> None:
        if not first.is_set():
            first.set()
            raise OSError("disk full")
        seen.extend(batch)

    writer: BackgroundWriter[str] = BackgroundWriter(handle, name="t", max_pending=100,
                                                     dropped=lambda _: None)
    writer.put("a", 1)
    assert first.wait(5)
    writer.put("b", 1)
    assert writer.close(5)
    assert seen == ["b"]
    assert "t failed: disk full" in caplog.text


def test_past_the_bound_and_after_close_records_are_dropped_not_queued() -> None:
    gate = threading.Event()
    handled: list[str] = []
    dropped: list[str] = []

    def handle(batch: Sequence[str]) -> None:
        gate.wait(5)
        handled.extend(batch)

    writer: BackgroundWriter[str] = BackgroundWriter(handle, name="t", max_pending=10,
                                                     dropped=dropped.append)
    for name in ("a", "b", "c"):
        writer.put(name, 4)  # 12 bytes would pass the bound of 10: "c" is dropped
    gate.set()
    assert writer.close(5)
    writer.put("late", 1)
    assert dropped == ["c", "late"]
    assert sorted(handled) == ["a", "b"]
