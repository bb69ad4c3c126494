"""Where records of calls go off the event loop: a size-rotated file and a bounded writer thread.

The audit log (:mod:`proxy.middlewares.audit`) and traffic capture (:mod:`proxy.capture`) both
hand records to a :class:`BackgroundWriter`, whose ``put`` never blocks a call: records wait in
a queue bounded in bytes (past the bound, or after ``close``, a record is dropped and the
``dropped`` callback counts it) and one daemon thread hands them, in batches, to ``handle``.
Their files are :class:`RotatingFile`: append-only, mode 0600, rotated by size as the
apiserver's ``--audit-log-maxsize`` / ``--audit-log-maxbackup`` do (backups named
``<name>-2006-01-02T15-04-05.000<ext>``, UTC).
"""

from __future__ import annotations

import collections
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Generic, TypeVar

__all__ = ["BackgroundWriter", "RotatingFile"]

log = logging.getLogger("opgate.files")

T = TypeVar("T")
COMPLAIN_EVERY = 10.0  # seconds between two error logs of one writer


class BackgroundWriter(Generic[T]):
    """A queue of records, bounded by their sizes, emptied by a daemon thread into ``handle``
    (one call per batch; what it raises is logged, at most every ``COMPLAIN_EVERY`` s)."""

    def __init__(self, handle: Callable[[Sequence[T]], None], *, name: str, max_pending: int,
                 dropped: Callable[[T], None]) -> None:
        self._handle = handle
        self._dropped = dropped
        self._max = max_pending
        self._queue: collections.deque[tuple[T, int]] = collections.deque()
        self._pending = 0
        self._cond = threading.Condition()
        self._closing = False
        self._complained = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, record: T, size: int) -> None:
        with self._cond:
            if self._closing or self._pending + size > self._max:
                self._dropped(record)
                return
            self._queue.append((record, size))
            self._pending += size
            self._cond.notify()

    def complain(self, message: str, *args: object) -> None:
        """``log.error`` at most every ``COMPLAIN_EVERY`` seconds (a full disk fails every
        batch)."""
        now = time.monotonic()
        if now - self._complained > COMPLAIN_EVERY:
            self._complained = now
            log.error(message, *args)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                batch = list(self._queue)
                self._queue.clear()
            try:
                self._handle([record for record, _ in batch])
            except Exception as exc:  # the handler's own failures are its business; never die
                self.complain("%s failed: %s", self._thread.name, exc)
            with self._cond:
                self._pending -= sum(size for _, size in batch)

    def close(self, timeout: float = 5.0) -> bool:
        """Write what is queued (``timeout`` at most); whether the thread finished."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)
        return not self._thread.is_alive()


class RotatingFile:
    """An append-only file rotated by size, as the apiserver's audit log (lumberjack) does.

    Before a write would take the file past ``max_bytes`` (0: never), it is renamed to
    ``<name>-<UTC time 2006-01-02T15-04-05.000><ext>`` next to it (``-1``, ``-2`` … after the
    time when one millisecond saw several) and a new one opened; only the newest
    ``max_backups`` such files are kept (0: all). New files are created mode 0600.

    Records are written whole or not at all: the file is written unbuffered, and a write the
    disk refuses halfway (full, over quota) is cut back off before the error goes up, so a
    reader (jq, Falco, mitmproxy, which stops at a broken flow) never meets half a record,
    and the records after it, once the disk has room, are whole.
    """

    def __init__(self, path: str, *, max_bytes: int = 0, max_backups: int = 0,
                 now: Callable[[], float] = time.time) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.max_backups = max_backups
        self._now = now
        folder, base = os.path.split(path)
        self._dir = folder or "."
        self._stem, self._ext = os.path.splitext(base)
        stamp = r"(\d{4}-\d\d-\d\dT\d\d-\d\d-\d\d\.\d{3})(?:-(\d+))?"
        self._backup = re.compile(re.escape(self._stem) + "-" + stamp + re.escape(self._ext))
        self._fd = -1  # -1: not open (a rotation could not reopen it: the next write tries)
        self.size = 0
        self._open()

    def _open(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.size = os.fstat(fd).st_size
        self._fd = fd

    def write(self, data: str) -> None:
        """Append ``data``, whole lines: where the next line would take the file past
        ``max_bytes``, the file is rotated between the two (a writer that fell behind hands
        over megabytes of lines at once)."""
        # a lone surrogate (a token's claim may hold one: JSON's "\ud800") leaves as the JSON
        # escape it came as, inside its JSON string, instead of losing the whole batch
        raw = data.encode("utf-8", "backslashreplace")
        if not self.max_bytes or self.size + len(raw) <= self.max_bytes:
            self.write_bytes(raw)
            return
        view = memoryview(raw)
        start = 0
        while start < len(raw):
            room = self.max_bytes - self.size
            if len(raw) - start <= room:
                end = len(raw)
            else:
                end = raw.rfind(b"\n", start, start + max(room, 0)) + 1
                if end <= start:  # not one more line fits: the next file, or one of its own
                    end = (raw.find(b"\n", start) + 1 or len(raw)) if not self.size else start
            if end > start:
                self.write_bytes(view[start:end])
            start = end
            if start < len(raw) and self.size:
                self.rotate()

    def write_bytes(self, raw: bytes | memoryview) -> None:
        """Append ``raw`` whole (rotating first if it would not fit: a record is never split
        across files), or nothing of it (class docstring)."""
        if self._fd < 0:
            self._open()
        if self.max_bytes and self.size and self.size + len(raw) > self.max_bytes:
            self.rotate()
        done = 0
        try:
            while done < len(raw):
                done += os.write(self._fd, raw[done:])
        except OSError:
            if done:  # what fitted goes again (O_APPEND: it is the file's last bytes)
                try:
                    os.ftruncate(self._fd, os.fstat(self._fd).st_size - done)
                except OSError as exc:
                    log.warning("cannot cut a half-written record off %s: %s", self.path, exc)
            raise
        self.size += done

    def flush(self) -> None:
        """Nothing: every write goes to the file at once."""

    def backups(self) -> list[str]:
        """The rotated files, oldest first."""
        found = []
        for name in os.listdir(self._dir):
            m = self._backup.fullmatch(name)
            if m:
                found.append((m.group(1), int(m.group(2) or 0), name))
        return [os.path.join(self._dir, name) for _, _, name in sorted(found)]

    def rotate(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        stamp = datetime.fromtimestamp(self._now(), UTC).strftime("%Y-%m-%dT%H-%M-%S.%f")[:-3]
        # after the newest of the same millisecond (one the oldest were removed from: not in
        # a gap it left, which would sort it first)
        taken = [int(m.group(2) or 0) for name in os.listdir(self._dir)
                 if (m := self._backup.fullmatch(name)) and m.group(1) == stamp]
        suffix = f"-{max(taken) + 1}" if taken else ""
        target = os.path.join(self._dir, f"{self._stem}-{stamp}{suffix}{self._ext}")
        try:
            os.rename(self.path, target)
        finally:
            self._open()
        if self.max_backups:
            for old in self.backups()[:-self.max_backups]:
                try:
                    os.remove(old)
                except OSError as exc:
                    log.warning("cannot remove old log file %s: %s", old, exc)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
