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
from typing import IO, Generic, TypeVar

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
    ``<name>-<UTC time 2006-01-02T15-04-05.000><ext>`` next to it and a new one opened; only the
    newest ``max_backups`` such files are kept (0: all). New files are created mode 0600.
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
        stamp = r"(\d{4}-\d\d-\d\dT\d\d-\d\d-\d\d\.\d{3})(?:-\d+)?"
        self._backup = re.compile(re.escape(self._stem) + "-" + stamp + re.escape(self._ext))
        self._file = self._open()
        self.size = os.fstat(self._file.fileno()).st_size

    def _open(self) -> IO[bytes]:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        return os.fdopen(fd, "ab")

    def write(self, data: str) -> None:
        # a lone surrogate (a token's claim may hold one: JSON's "\ud800") leaves as the JSON
        # escape it came as, inside its JSON string, instead of losing the whole batch
        self.write_bytes(data.encode("utf-8", "backslashreplace"))

    def write_bytes(self, raw: bytes) -> None:
        """Append ``raw`` whole (rotating first if it would not fit: a record is never split
        across files)."""
        if self.max_bytes and self.size and self.size + len(raw) > self.max_bytes:
            self.rotate()
        self._file.write(raw)
        self.size += len(raw)

    def flush(self) -> None:
        self._file.flush()

    def backups(self) -> list[str]:
        """The rotated files, oldest first."""
        found = []
        for name in os.listdir(self._dir):
            m = self._backup.fullmatch(name)
            if m:
                found.append((m.group(1), name))
        return [os.path.join(self._dir, name) for _, name in sorted(found)]

    def rotate(self) -> None:
        self._file.close()
        stamp = datetime.fromtimestamp(self._now(), UTC).strftime("%Y-%m-%dT%H-%M-%S.%f")[:-3]
        target = os.path.join(self._dir, f"{self._stem}-{stamp}{self._ext}")
        n = 1
        while os.path.exists(target):
            target = os.path.join(self._dir, f"{self._stem}-{stamp}-{n}{self._ext}")
            n += 1
        try:
            os.rename(self.path, target)
        finally:
            self._file = self._open()
            self.size = os.fstat(self._file.fileno()).st_size
        if self.max_backups:
            for old in self.backups()[:-self.max_backups]:
                try:
                    os.remove(old)
                except OSError as exc:
                    log.warning("cannot remove old log file %s: %s", old, exc)

    def close(self) -> None:
        self._file.close()
