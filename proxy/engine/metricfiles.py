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
their files: opgate has none.)

Only the supervisor merges and scrapes, and the two exclude each other (:data:`_LOCK`;
:class:`Collector` reads under it): a scrape between the archive's replacement and the dead
file's removal would count the dead worker twice, and the next scrape less, a counter that went
down. Imported only once ``PROMETHEUS_MULTIPROC_DIR`` is set (prometheus_client picks its value
class at import).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import threading
from collections.abc import Iterable

from prometheus_client.metrics_core import Metric
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

log = logging.getLogger("opgate.workers")

ARCHIVED = ("counter", "histogram", "summary")  # the kinds whose samples add up
_LOCK = threading.Lock()


def archive_path(path: str, kind: str) -> str:
    return os.path.join(path, f"{kind}_archive.db")


def retire(pid: int, path: str) -> None:
    """Worker ``pid`` has exited: drop its live gauges, fold its counts into the archives.

    A merge that cannot be written (a full or read-only directory) leaves that worker's file
    as it is, still summed, and says so: the worker is restarted all the same."""
    with _LOCK:
        mark_process_dead(pid, path)  # type: ignore[no-untyped-call]
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
    out = MmapedDict(path)  # type: ignore[no-untyped-call]
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
            return list(MultiProcessCollector.merge(files))  # type: ignore[no-untyped-call]
