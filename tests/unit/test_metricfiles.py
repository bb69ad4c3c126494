"""A dead worker's metric files (:mod:`proxy.engine.metricfiles`): folded into one archive per
kind, the sums unchanged but for the dead workers' live gauges. The files are written by real
worker-like processes (opgate's own metrics, in multiprocess mode)."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.engine import metricfiles
from proxy.engine.metricfiles import Collector, retire

WORKER = """
from proxy.engine import telemetry as t
t.REQUESTS.labels("get", "", "configmaps", "200", "allow").inc({n})
for _ in range({n}):
    t.REQUEST_DURATION.labels("get").observe(0.003)
t.INFLIGHT.set(1)
t.RATELIMIT_BACKEND.labels("redis").set(1)
t.flush()
"""


def _spawn(directory: Path, n: int) -> int:
    """Run a process that counts ``n`` calls into ``directory``, as a worker does; its pid."""
    before = set(os.listdir(directory))
    subprocess.run([sys.executable, "-c", WORKER.format(n=n)], check=True, timeout=60,
                   env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)})
    new, = (f for f in set(os.listdir(directory)) - before if f.startswith("counter_"))
    return int(new.removeprefix("counter_").removesuffix(".db"))


def _scrape(directory: Path) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(Collector(str(directory)))  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    return {sample.name + str(sorted(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_dead_workers_fold_into_one_archive_per_kind(tmp_path: Path) -> None:
    pids = [_spawn(tmp_path, n) for n in (3, 4, 5)]
    before = _scrape(tmp_path)
    requests = "opgate_requests_total" + str(sorted({
        "verb": "get", "group": "", "resource": "configmaps", "code": "200",
        "decision": "allow"}.items()))
    assert before[requests] == 12
    assert before["opgate_inflight_requests[]"] == 3  # livesum: each process's 1
    for pid in pids[:2]:
        retire(pid, str(tmp_path))
    after = _scrape(tmp_path)
    assert after.pop("opgate_inflight_requests[]") == 1  # the dead ones' levels are gone
    before.pop("opgate_inflight_requests[]")
    assert after == before  # every count, bucket and sum: unchanged
    retire(pids[2], str(tmp_path))
    last = _scrape(tmp_path)
    assert last[requests] == 12
    assert last["opgate_request_duration_seconds_count[('verb', 'get')]"] == 12
    assert last["opgate_request_duration_seconds_bucket[('le', '0.005'), ('verb', 'get')]"] == 12
    assert last["opgate_request_duration_seconds_bucket[('le', '0.0025'), ('verb', 'get')]"] == 0
    assert "opgate_inflight_requests[]" not in last  # no live worker: no level at all
    assert sorted(os.listdir(tmp_path)) == ["counter_archive.db", "histogram_archive.db"]


def test_a_merge_that_cannot_be_written_leaves_the_file_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A full (or read-only) metrics directory: the dead worker's file stays as it was, still
    summed, and the supervisor goes on (a raise here ended its restart loop for that worker)."""
    first = _spawn(tmp_path, 2)
    retire(first, str(tmp_path))  # an archive to keep
    pid = _spawn(tmp_path, 3)

    def full(path: str, metrics: object) -> None:
        Path(path).write_bytes(b"\0" * 16)  # began, then the disk was full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(metricfiles, "_write", full)
    with caplog.at_level(logging.WARNING, "opgate.workers"):
        retire(pid, str(tmp_path))
    assert "No space left on device" in caplog.text
    files = set(os.listdir(tmp_path))
    assert f"counter_{pid}.db" in files and "counter_archive.db.new" not in files
    assert f"gauge_livesum_{pid}.db" not in files
    assert sum(v for k, v in _scrape(tmp_path).items()
               if k.startswith("opgate_requests_total")) == 5
