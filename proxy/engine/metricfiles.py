"""The ``--workers`` metric files (prometheus_client's multiprocess mode), kept bounded.

Each worker process writes its values to files named after its pid in
``PROMETHEUS_MULTIPROC_DIR`` (``counter_<pid>.db``, ``histogram_<pid>.db``,
``gauge_livesum_<pid>.db``, …) and the supervisor's ``/metrics`` adds up every file there. A
worker that died left its files, and the supervisor restarts it under a new pid: a crash loop
left a new set at every restart, so the directory grew without bound and every scrape read all
of it. When the supervisor reaps a worker, :func:`retire` removes its live gauges' files (a dead
process's in-flight calls and open watches are none: ``mark_process_dead``) and merges its
counters and histograms into one ``<kind>_archive.db`` per kind, which the sums read as any
other file: its counts stay (a counter never goes down), and the directory holds the live
workers' files and one archive per kind. (Gauges of another mode than ``live*`` would keep
their files: opgate has none.) A series a worker removed (a quota's namespace gone) is set to
:data:`REMOVED` in its file, which :class:`Collector` leaves out, and every
:data:`FORGET_AT` of them the worker rewrites the file without them (:func:`forget`): a
namespace gone costs neither file nor memory for long.

Only the supervisor merges and scrapes, and the two exclude each other (:data:`_LOCK`;
:class:`Collector` reads under it): a scrape between the archive's replacement and the dead
file's removal would count the dead worker twice, and the next scrape less, a counter that went
down. Imported only once ``PROMETHEUS_MULTIPROC_DIR`` is set (prometheus_client picks its value
class at import).

A full disk (an emptyDir with a ``sizeLimit``, a small tmpfs) must cost metrics, not processes.
prometheus_client makes and grows its files with ``ftruncate``, which allocates nothing, and
writes through their mmap: the first write to a page the file system then has no room for is a
SIGBUS, which killed every worker, and the supervisor writing an archive. :class:`ReservedFile`
reserves every block with ``posix_fallocate`` before the library maps or grows its file, so
the refusal is an ``ENOSPC`` (an :class:`OSError`) instead: :func:`retire` keeps the dead file
then, and a worker's files (:func:`install` makes the library use :class:`SpillingFile`) go on
in memory, logged once: that worker's counts stop reaching the supervisor's
``/metrics``, its calls go on. (``RLIMIT_FSIZE`` refuses the same way, with ``EFBIG``:
Python ignores SIGXFSZ.)
"""

from __future__ import annotations

import contextlib
import glob
import logging
import mmap
import os
import struct
import threading
from collections.abc import Iterable
from typing import Any

import prometheus_client.values
from prometheus_client.metrics_core import Metric
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

log = logging.getLogger("opgate.workers")
_FIRST_SIZE = 1 << 16  # the size prometheus_client gives a new file (its _INITIAL_MMAP_SIZE)
_USED = struct.Struct("i")  # a file's first 4 bytes: how many of them are used
_spilled_once = False  # whether this process has said that its metrics went to memory

ARCHIVED = ("counter", "histogram", "summary")  # the kinds whose samples add up
# a live gauge's value for "no series": a worker cannot remove one from its file, so it sets
# this (no opgate gauge is ever below 0) and the supervisor's /metrics leaves it out
REMOVED = -1.0
_LOCK = threading.Lock()


def _entry_size(key: str) -> int:
    """The bytes one value takes in a file: its key's length, the key padded to 8, two
    doubles (prometheus_client's layout)."""
    encoded = len(key.encode("utf-8"))
    return 4 + encoded + (8 - (encoded + 4) % 8) + 16


class ReservedFile(MmapedDict):  # type: ignore[misc]
    """prometheus_client's file with its blocks reserved before they are mapped: a full disk
    refuses with an :class:`OSError` (``ENOSPC``), never a SIGBUS on a later write."""

    def __init__(self, filename: str, read_mode: bool = False) -> None:
        if not read_mode:
            _reserve_first(filename)
        super().__init__(filename, read_mode)

    def _init_value(self, key: str) -> None:
        capacity = self._capacity
        while self._used + _entry_size(key) > capacity:
            capacity *= 2
        if capacity > self._capacity:  # the library grows it by ftruncate next: reserve first
            self._grow(capacity)
        super()._init_value(key)

    def _grow(self, capacity: int) -> None:
        os.posix_fallocate(self._f.fileno(), 0, capacity)


def _reserve_first(filename: str) -> None:
    """Give ``filename`` its first blocks, all of them allocated. A new one is made under
    another name (not ``*.db``) and renamed once it has them: a scrape never reads an empty
    file (that would fail it), nor is one left behind by a full disk."""
    if os.path.exists(filename):
        fd = os.open(filename, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, max(os.fstat(fd).st_size, _FIRST_SIZE))
        finally:
            os.close(fd)
        return
    partial = filename + ".new"
    fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.posix_fallocate(fd, 0, _FIRST_SIZE)
        os.replace(partial, filename)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        raise
    finally:
        os.close(fd)


class SpillingFile(ReservedFile):
    """A worker's file: when the disk refuses it blocks, its values go on in anonymous memory
    (no file, so neither a file system nor ``RLIMIT_FSIZE`` limits it) from then on, and this
    process says so once. What the file held stays on the disk (whole entries only), counted
    by the supervisor's scrapes."""

    _in_memory = False

    def __init__(self, filename: str, read_mode: bool = False) -> None:
        try:
            super().__init__(filename, read_mode)
        except OSError as exc:
            _say_spilled(filename, exc)
            self._fname, self._f, self._positions = filename, None, {}
            self._m, self._capacity, self._used = mmap.mmap(-1, _FIRST_SIZE), _FIRST_SIZE, 8
            self._m[0:4] = _USED.pack(8)  # the library's header: the bytes used
            self._in_memory = True

    def _grow(self, capacity: int) -> None:
        if not self._in_memory:
            try:
                super()._grow(capacity)
                return
            except OSError as exc:
                _say_spilled(self._fname, exc)
        memory = mmap.mmap(-1, capacity)  # the library sees the room and grows nothing
        memory[:self._used] = self._m[:self._used]
        if self._f is not None:  # (the library closes its map only with its file)
            self._m.close()
            self._f.close()
            self._f = None
        self._m, self._capacity, self._in_memory = memory, capacity, True


    def drop_removed(self) -> None:
        """Rewrite the file without its :data:`REMOVED` entries: a series removed stays in
        the file as one otherwise (prometheus_client removes none), every namespace there ever
        was. The new file is written under another name and renamed over this one, so a
        scrape reads either whole; on a refusal (a full disk) the file stays as it is. A file
        spilled to memory keeps them (it is this worker's alone, no scrape reads it)."""
        if self._in_memory or self._f is None:  # (None: closed)
            return
        kept = [(k, v, ts) for k, v, ts, _ in self._read_all_values() if v != REMOVED]
        partial = self._fname + ".compact"  # not *.db: a scrape never reads it
        try:
            fresh = ReservedFile(partial)
        except OSError:
            return
        try:
            for key, value, timestamp in kept:
                fresh.write_value(key, value, timestamp)  # type: ignore[no-untyped-call]
            os.replace(partial, self._fname)
        except OSError:
            fresh.close()  # type: ignore[no-untyped-call]
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)
            return
        self.close()  # type: ignore[no-untyped-call]
        self._f, self._m, self._capacity = fresh._f, fresh._m, fresh._capacity
        self._used, self._positions = fresh._used, fresh._positions


def _say_spilled(filename: str, exc: OSError) -> None:
    global _spilled_once
    if not _spilled_once:
        _spilled_once = True
        log.warning("cannot write the metrics file %s (%s): this worker's metrics go on in "
                    "memory from now on, and /metrics no longer counts its calls", filename,
                    exc.strerror or exc)


def install() -> None:
    """Make prometheus_client's values use :class:`SpillingFile` (it looks its file class up
    in ``prometheus_client.values`` when it opens one): before the first metric is made."""
    prometheus_client.values.MmapedDict = SpillingFile  # type: ignore[attr-defined]


FORGET_AT = 256  # series forgotten before their entries and values are let go of
_forgotten: list[Any] = []  # prometheus_client values of series removed since then


def forget(value: Any) -> None:
    """A live gauge's series was set to :data:`REMOVED` and taken out of its metric: let go of
    its prometheus_client ``value`` (the library keeps every value it made in a list of its
    own, to reopen its files after a fork) and, every ``FORGET_AT`` of them, drop the
    entries at :data:`REMOVED` from their files (:meth:`SpillingFile.drop_removed`)."""
    _forgotten.append(value)
    if len(_forgotten) < FORGET_AT:
        return
    gone = {id(v) for v in _forgotten}
    files = {id(f): f for f in (getattr(v, "_file", None) for v in _forgotten)}
    _forgotten.clear()
    made = _library_values()
    if made is not None:
        made[:] = [v for v in made if id(v) not in gone]
    for file in files.values():
        if isinstance(file, SpillingFile):
            file.drop_removed()


def _library_values() -> list[Any] | None:
    """The list in which prometheus_client's multiprocess value class keeps every value it
    made (a variable of its closure; ``None`` if a release keeps them otherwise)."""
    init = prometheus_client.values.ValueClass.__init__
    cells = dict(zip(init.__code__.co_freevars, init.__closure__ or (), strict=True))
    cell = cells.get("values")
    made = cell.cell_contents if cell is not None else None
    return made if isinstance(made, list) else None


def archive_path(path: str, kind: str) -> str:
    return os.path.join(path, f"{kind}_archive.db")


def retire(pid: int, path: str) -> None:
    """Worker ``pid`` has exited: drop its live gauges, fold its counts into the archives.

    A merge that cannot be written (a full or read-only directory) leaves that worker's file
    as it is, still summed, and says so: the worker is restarted all the same."""
    with _LOCK:
        mark_process_dead(pid, path)  # type: ignore[no-untyped-call]
        for partial in glob.glob(os.path.join(path, f"*_{pid}.db.*")):  # a rewrite it left
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)
        for kind in ARCHIVED:
            dead = os.path.join(path, f"{kind}_{pid}.db")
            if not os.path.exists(dead):
                continue
            try:
                _fold(dead, archive_path(path, kind))
            except OSError as exc:
                log.warning("cannot merge %s into the metrics archive (%s): it stays as it is",
                            dead, exc)


def _fold(dead: str, archive: str) -> None:
    """Write archive + dead into a new archive file, replace the archive with it, remove dead."""
    sources = [f for f in (archive, dead) if os.path.exists(f)]
    merged = MultiProcessCollector.merge(sources, accumulate=False)  # type: ignore[no-untyped-call]
    partial = archive + ".new"  # not *.db: a scrape never reads it
    with contextlib.suppress(FileNotFoundError):
        os.unlink(partial)
    try:
        _write(partial, merged)
        os.replace(partial, archive)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        raise
    os.unlink(dead)


def _write(path: str, metrics: Iterable[Metric]) -> None:
    out = ReservedFile(path)
    try:
        for metric in metrics:
            for sample in metric.samples:
                key = mmap_key(metric.name, sample.name, list(sample.labels),
                               list(sample.labels.values()), metric.documentation)
                out.write_value(key, sample.value, 0.0)  # type: ignore[no-untyped-call]
    finally:
        out.close()  # type: ignore[no-untyped-call]


class Collector:
    """Every file's metrics summed (counters and histograms add up, gauges by their mode), read
    under the lock :func:`retire` takes."""

    def __init__(self, path: str) -> None:
        self._path = path

    def collect(self) -> Iterable[Metric]:
        with _LOCK:
            files = glob.glob(os.path.join(self._path, "*.db"))
            merged = list(MultiProcessCollector.merge(files))  # type: ignore[no-untyped-call]
        for metric in merged:
            if metric.type == "gauge":  # livemax: REMOVED once every live worker removed it
                metric.samples = [s for s in metric.samples if s.value > REMOVED]
        return merged
