"""The shared background writer and rotating file (proxy/engine/logfile.py)."""

from __future__ import annotations

import json
import os
import resource
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from proxy.engine.logfile import BackgroundWriter, RotatingFile


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


@pytest.fixture
def file_size_limit() -> Iterator[Callable[[int | None], None]]:
    """Sets this process's RLIMIT_FSIZE (``None``: none): a write that crosses it writes what
    fits and fails with EFBIG, as one on a full disk fails with ENOSPC."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error, not a signal

    def limit(size: int | None) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft if size is None else size, hard))

    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_a_record_the_disk_refuses_halfway_leaves_nothing_of_it(
        tmp_path: Path, file_size_limit: Callable[[int | None], None]) -> None:
    """A full disk takes the part of a record that fits, then fails: that part is cut off
    again, so the file holds whole records only (a broken audit line is lost to jq and Falco
    along with the next one; a broken flow stops mitmproxy reading the rest of the file),
    the records after the disk has room again are whole, and the size is the file's."""
    path = tmp_path / "audit.log"
    f = RotatingFile(str(path), max_bytes=10 * 1024 * 1024)
    records = [json.dumps({"i": i, "pad": "x" * 20_000}) + "\n" for i in range(4)]
    f.write(records[0])
    f.flush()
    file_size_limit(f.size + 30_000)  # room for a record and a half
    f.write(records[1])
    f.flush()
    with pytest.raises(OSError):
        f.write(records[2])
        f.flush()
    file_size_limit(None)  # room again
    f.write(records[3])
    f.flush()
    f.close()
    assert path.read_text() == records[0] + records[1] + records[3]
    assert f.size == path.stat().st_size


def test_lines_written_at_once_rotate_between_them_no_file_passes_the_limit(
        tmp_path: Path) -> None:
    """The audit log's writer thread hands a file all the lines that waited at once (up to
    8 MiB when the disk was slow): the file still rotates before it would pass
    ``--audit-log-maxsize`` (the emptyDir's sizeLimit is sized from it), between two lines."""
    clock = iter(1_764_480_600.0 + i for i in range(100))
    path = tmp_path / "audit.log"
    f = RotatingFile(str(path), max_bytes=1000, now=lambda: next(clock))
    lines = [f"{i:03d}" + "x" * 296 + "\n" for i in range(10)]  # 300 bytes: three a file
    f.write(lines[0])
    f.write("".join(lines[1:]))
    f.close()
    files = [*f.backups(), str(path)]
    assert [Path(name).read_text() for name in files] == [
        "".join(lines[:3]), "".join(lines[3:6]), "".join(lines[6:9]), lines[9]]


def test_a_line_longer_than_the_limit_gets_a_file_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    f = RotatingFile(str(path), max_bytes=100, now=iter(range(1, 100)).__next__)
    f.write("a\n" + "b" * 200 + "\nc\n")
    f.close()
    assert [Path(name).read_text() for name in (*f.backups(), str(path))] == [
        "a\n", "b" * 200 + "\n", "c\n"]


def test_backups_of_one_millisecond_are_ordered_oldest_first(tmp_path: Path) -> None:
    """Rotations within one millisecond (a burst) get ``-1``, ``-2`` … after the time; the
    oldest are still the ones removed past ``max_backups``."""
    path = tmp_path / "audit.log"
    f = RotatingFile(str(path), max_bytes=10, max_backups=2, now=lambda: 1_764_480_600.0)
    for i in range(5):
        f.write(f"line {i:03d}\n")  # 9 bytes: one a file
    f.close()
    assert [Path(name).read_text() for name in f.backups()] == ["line 002\n", "line 003\n"]
    assert [os.path.basename(name) for name in f.backups()] == [
        "audit-2025-11-30T05-30-00.000-2.log", "audit-2025-11-30T05-30-00.000-3.log"]
