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

from proxy.engine import metricfiles, telemetry
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


# A metrics directory on a small tmpfs of its own (an emptyDir with a sizeLimit, or medium
# Memory, as the chart's /tmp may be), mounted in a user and mount namespace (`unshare -rm`:
# no privilege needed where user namespaces are allowed) around one Python process, which
# fills it as the test says first. On a full one, prometheus_client's files (grown by
# ftruncate, sparse, then written through their mmap) made the kernel SIGBUS the process.
FULL_DISK = """
import logging, os, sys
logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(name)s: %(message)s")
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
{body}
"""
COUNT = """
from proxy.engine import telemetry as t
for i in range({n}):
    t.REQUESTS.labels("get", "g%d.example.com" % i, "widgets", "200", "allowed").inc()
    t.REQUEST_DURATION.labels("get").observe(0.003)
    t.flush()
print("alive", t.REQUESTS.labels("get", "g0.example.com", "widgets", "200", "allowed")
      ._target._value.get())
from proxy.engine.metricfiles import Collector  # as the supervisor reads every file there
print(sum(1 for f in Collector(sys.argv[1]).collect() if f.name == "opgate_requests") <= 1)
"""


def _on_a_small_tmpfs(tmp_path: Path, body: str, *, size_kb: int,
                      fill_kb: int = 0) -> subprocess.CompletedProcess[str]:
    """Run ``body`` (Python) with its metrics directory (``sys.argv[1]``) on a ``size_kb``
    tmpfs, ``fill_kb`` of it taken first by another file."""
    mnt = tmp_path / "metrics"
    mnt.mkdir()
    fill = (f"dd if=/dev/zero of={mnt}/other bs=1k count={fill_kb} 2>/dev/null; "
            if fill_kb else "")
    shell = (f"mount -t tmpfs -o size={size_kb}k tmpfs {mnt} && {fill}"
             f'exec "$0" -c "$1" {mnt}')
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", shell,
                           sys.executable, FULL_DISK.format(body=body)],
                          capture_output=True, text=True, timeout=120)


def _survived(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout


@pytest.mark.parametrize(("size_kb", "fill_kb", "n"), [
    (128, 128, 50),  # full before the first file: none can be mapped
    (512, 0, 3000),  # room for the first files, not for their growth
], ids=["full-from-the-start", "full-while-counting"])
def test_a_full_metrics_directory_costs_metrics_not_the_worker(
        tmp_path: Path, size_kb: int, fill_kb: int, n: int) -> None:
    """A worker's metrics on a full disk: it goes on counting (in memory, where the supervisor
    does not see it), says so once, and what it left there stays readable to a scrape."""
    done = _on_a_small_tmpfs(tmp_path, COUNT.format(n=n), size_kb=size_kb, fill_kb=fill_kb)
    assert _survived(done).split() == ["alive", "1.0", "True"]
    warned = [line for line in done.stderr.splitlines() if "in memory" in line]
    assert len(warned) == 1, done.stderr
    assert "No space left on device" in warned[0]


def test_a_file_size_limit_costs_metrics_not_the_worker(tmp_path: Path) -> None:
    """``RLIMIT_FSIZE`` (``ulimit -f``): growing a file past it is ``EFBIG`` (Python ignores
    SIGXFSZ), which the library raised into the call that made a new series; the worker goes
    on counting in memory, where no file size limit applies."""
    limited = "import resource\nresource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))\n"
    done = subprocess.run([sys.executable, "-c", FULL_DISK.format(
        body=limited + COUNT.format(n=3000)), str(tmp_path)],
        capture_output=True, text=True, timeout=120)
    assert _survived(done).split() == ["alive", "1.0", "True"]
    warned = [line for line in done.stderr.splitlines() if "in memory" in line]
    assert len(warned) == 1 and "File too large" in warned[0], done.stderr


RETIRE_ON_A_FULL_DISK = """
import subprocess
worker = subprocess.run([sys.executable, "-c", {worker!r}], env=os.environ, check=True)
pid = int(next(f for f in os.listdir(sys.argv[1]) if f.startswith("counter_"))[8:-3])
from prometheus_client.multiprocess import mark_process_dead
mark_process_dead(pid, sys.argv[1])  # (retire's first step: it frees their room)
filler = os.path.join(sys.argv[1], "other")
fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
try:  # the rest of the room taken
    while os.write(fd, b"x" * 4096):
        pass
except OSError:
    os.close(fd)
from proxy.engine.metricfiles import retire
retire(pid, sys.argv[1])
print("alive", sorted(f for f in os.listdir(sys.argv[1]) if f.endswith(".db")) == [
    f"counter_{{pid}}.db", f"histogram_{{pid}}.db"])
"""


def test_retiring_a_worker_on_a_full_disk_keeps_its_files_and_the_supervisor(
        tmp_path: Path) -> None:
    """The supervisor folds a dead worker's counts into the archive: on a full disk it keeps
    the worker's files as they are, says so, and goes on (it died of SIGBUS writing the
    archive's first page)."""
    done = _on_a_small_tmpfs(tmp_path, RETIRE_ON_A_FULL_DISK.format(worker=WORKER.format(n=3)),
                             size_kb=1024)
    assert _survived(done).split() == ["alive", "True"]
    assert "cannot merge" in done.stderr and "No space left on device" in done.stderr


NAMESPACES = """
from proxy.engine import telemetry as t
now = [1000.0]
t._clock = lambda: now[0]
t.set_quota_usage("old-entry", "secrets", 5)
t.clear_quota_usage()  # a reload: the entry that counted secrets is gone
t.set_quota_usage("live", "configmaps", 3)
t.set_quota_usage("reloaded", "configmaps", 2)
for n in range({n}):  # namespaces created, filled, emptied and deleted, a second apart
    t.set_quota_usage(f"ns-{{n}}", "configmaps", 1)
    t.set_quota_usage(f"ns-{{n}}", "configmaps", 0)
    now[0] += 1
now[0] += t.QUOTA_USAGE_ZERO_SECONDS
t.set_quota_usage("emptied", "configmaps", 0)  # the next update removes those at 0 since
t.set_quota_usage("live", "configmaps", 4)
"""


@pytest.mark.parametrize("n", [10, 400])
def test_quota_usage_of_namespaces_gone_leaves_the_sums(tmp_path: Path, n: int) -> None:
    """With --workers, a namespace whose usage stayed at 0 for QUOTA_USAGE_ZERO_SECONDS, and the
    series of an entry a reload dropped, leave the supervisor's /metrics, as they leave a single
    process's: prometheus_client cannot remove a series from a worker's file, so every
    namespace there ever was kept a series at 0 (over the weeks a sidecar runs, CI namespaces
    by the thousand)."""
    subprocess.run([sys.executable, "-c", NAMESPACES.format(n=n)], check=True, timeout=60,
                   env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    usage = {k: v for k, v in _scrape(tmp_path).items() if k.startswith("opgate_quota_usage")}
    assert usage == {
        "opgate_quota_usage[('namespace', 'live'), ('resource', 'configmaps')]": 4,
        "opgate_quota_usage[('namespace', 'reloaded'), ('resource', 'configmaps')]": 2,
        "opgate_quota_usage[('namespace', 'emptied'), ('resource', 'configmaps')]": 0,
    }


def test_a_series_one_worker_removed_shows_while_another_still_has_it(tmp_path: Path) -> None:
    """Usage is the highest live worker's value (livemax): a worker whose reload dropped the
    series does not hide what a worker that has not reloaded yet still shows."""
    keeps = 'from proxy.engine import telemetry as t\nt.set_quota_usage("a", "configmaps", 0)\n'
    removes = keeps + "t.clear_quota_usage()\n"
    for script in (keeps, removes):
        subprocess.run([sys.executable, "-c", script], check=True, timeout=60,
                       env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    assert _scrape(tmp_path)[
        "opgate_quota_usage[('namespace', 'a'), ('resource', 'configmaps')]"] == 0


COMING_AND_GOING = """
import os, tracemalloc
from proxy.engine import telemetry as t
now = [1000.0]
t._clock = lambda: now[0]
t.set_quota_usage("live", "configmaps", 3)
def churn(start, n):
    for i in range(start, start + n):  # preview namespaces, each filled, emptied, deleted
        t.set_quota_usage(f"preview-{{i}}", "configmaps", 1)
        t.set_quota_usage(f"preview-{{i}}", "configmaps", 0)
        now[0] += 1
churn(0, {n})  # the series of the first namespaces gone and the heap settled
tracemalloc.start()
churn({n}, {n})
before, _ = tracemalloc.get_traced_memory()
churn(2 * {n}, {n})
grown = tracemalloc.get_traced_memory()[0] - before
t.set_quota_usage("live", "configmaps", 4)
t.RATELIMIT_BACKEND.labels("redis").set(1)
path = os.path.join(os.environ["PROMETHEUS_MULTIPROC_DIR"], f"gauge_livemax_{{os.getpid()}}.db")
print(os.path.getsize(path), len(t.QUOTA_USAGE._metrics), grown)
"""


def test_namespaces_that_come_and_go_leave_a_workers_file_and_memory_bounded(
        tmp_path: Path) -> None:
    """With --workers, the series of namespaces gone leave the worker's file and memory, not
    only the supervisor's /metrics: each namespace there ever was kept ~200 B of file and
    ~1 KB of heap (its REMOVED entry, its gauge child and prometheus_client's value), so an
    operator that touched a preview or e2e namespace an hour grew for as long as it ran
    (20,000 namespaces: a 4 MiB file that every scrape read, 20 MB of heap)."""
    n = 3000  # ten times the namespaces a 300 s window holds at one a second
    done = subprocess.run([sys.executable, "-c", COMING_AND_GOING.format(n=n)], check=True,
                          timeout=60, capture_output=True, text=True,
                          env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    size, children, grown = map(int, done.stdout.split())
    assert done.stderr == ""  # not prometheus_client's warning that it cannot remove a series
    window = int(telemetry.QUOTA_USAGE_ZERO_SECONDS)  # the namespaces still within 5 minutes
    assert size <= 2 * (1 << 16)  # the 64 KiB to start, at most once doubled
    assert children <= 2 * window
    assert grown < 50 * n  # bytes: not ~1 KB more per namespace
    usage = {k: v for k, v in _scrape(tmp_path).items() if k.startswith("opgate_")}
    assert usage["opgate_quota_usage[('namespace', 'live'), ('resource', 'configmaps')]"] == 4
    assert usage["opgate_ratelimit_backend[('backend', 'redis')]"] == 1
    assert len([k for k in usage if k.startswith("opgate_quota_usage")]) <= 2 * window


CHURNING = """
import sys
from proxy.engine import telemetry as t
now = [1000.0]
t._clock = lambda: now[0]
t.set_quota_usage("live", "configmaps", 3)
t.RATELIMIT_BACKEND.labels("redis").set(1)
print("ready", flush=True)
for i in range({n}):
    t.set_quota_usage(f"preview-{{i}}", "configmaps", 1)
    t.set_quota_usage(f"preview-{{i}}", "configmaps", 0)
    now[0] += 1
"""


def test_a_scrape_while_a_worker_rewrites_its_file_reads_it_whole(tmp_path: Path) -> None:
    """The worker rewrites its live-gauge file without the removed series under another name
    and renames it over the old one: a scrape at any moment reads one file or the other, whole
    (a rewrite in place would show it half written: series missing, a corrupt file)."""
    worker = subprocess.Popen([sys.executable, "-c", CHURNING.format(n=8000)],
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    try:
        assert worker.stdout is not None and worker.stdout.readline() == "ready\n"
        scrapes = 0
        while worker.poll() is None:
            found = _scrape(tmp_path)
            assert found["opgate_quota_usage[('namespace', 'live'), "
                         "('resource', 'configmaps')]"] == 3
            assert found["opgate_ratelimit_backend[('backend', 'redis')]"] == 1
            scrapes += 1
    finally:
        worker.kill()
        worker.wait()
    assert worker.returncode == 0 and scrapes > 3
    assert [f for f in os.listdir(tmp_path) if not f.endswith(".db")] == []


def test_a_quiet_workers_zeros_go_at_its_levels_tick(tmp_path: Path) -> None:
    """With --workers, a usage series at 0 for 5 minutes leaves the supervisor's /metrics at the
    worker's next levels tick (every FLUSH_EVERY: the flush it runs), not only once some other
    usage changes (a quiet cluster kept the zeros of its deleted namespaces)."""
    script = """
from proxy.engine import telemetry as t
now = [1000.0]
t._clock = lambda: now[0]
t.set_quota_usage("live", "configmaps", 3)
t.set_quota_usage("preview-1", "configmaps", 0)
now[0] += t.QUOTA_USAGE_ZERO_SECONDS + 1
t.flush()
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60,
                   env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    usage = {k for k in _scrape(tmp_path) if k.startswith("opgate_quota_usage")}
    assert usage == {"opgate_quota_usage[('namespace', 'live'), ('resource', 'configmaps')]"}
