"""``opgate serve --workers 2``: real processes, a real redis-server, a small local upstream.

Which worker served a call is read from the access log: every process draws its own trace-id
prefix. The workers are the supervisor's children in ``/proc``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)

from proxy.relay import servingcert
from proxy.workers import LIVENESS_GRACE
from tests.integration.fakes import AiohttpUpstream, make_cert, status_of
from tests.integration.opgate_proc import OpgateProcess
from tests.integration.redis_server import RedisServer

POLICY = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: {name}}}
spec:
  mode: enforce
  rateLimits:
    - name: generous
      match: {{verbs: [get, list]}}
      key: "{{user}}"
      qps: 100000
      burst: {burst}
"""
LIST = "/api/v1/namespaces/a/configmaps"
SLOW = "/api/v1/namespaces/slow/configmaps"
STUCK = "/api/v1/namespaces/stuck/configmaps"
WATCH = "/api/v1/namespaces/a/configmaps?watch=true"


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer.launch() as server:
        yield server


@pytest.fixture
async def upstream() -> AsyncIterator[str]:
    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        if request.query.get("watch") == "true":  # a watch that stays open, as the apiserver's
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            await response.write(b'{"type":"BOOKMARK","object":{"kind":"ConfigMap",'
                                 b'"apiVersion":"v1","metadata":{"resourceVersion":"1"}}}\n')
            await asyncio.sleep(60.0)
            return response
        if request.path == SLOW:
            await asyncio.sleep(3.0)
        elif request.path == STUCK:
            await asyncio.sleep(60.0)
        return web.json_response({"kind": "ConfigMapList", "apiVersion": "v1", "items": []})

    up = await AiohttpUpstream(handle).start()
    yield up.url
    await up.close()


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    path = tmp_path / "policies" / "policy.yaml"
    path.parent.mkdir()
    path.write_text(POLICY.format(name="v1", burst=100000))
    return path


@pytest.fixture
async def opgate(upstream: str, redis_server: RedisServer, policy_file: Path,
                 tmp_path: Path) -> AsyncIterator[OpgateProcess]:
    # a loaded CI machine can take longer than the 50 ms default; this is not a Redis test
    proc = OpgateProcess("--upstream", upstream, "--redis-url", redis_server.url,
                         "--redis-timeout", "2", "--policies", str(policy_file.parent),
                         "--workers", "2", log_dir=tmp_path)
    try:
        await asyncio.to_thread(proc.wait_ready)
        await _until(lambda: _get(proc.admin_url + "/readyz"), lambda r: r[0] == 200)
        yield proc
    finally:
        workers = children(proc.proc.pid)
        proc.stop()
        for pid in workers:  # never leave one behind, whatever the test did
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert "Traceback" not in proc.stderr()


def children(pid: int) -> set[int]:
    """The live child processes of ``pid``."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            state, ppid = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if int(ppid) == pid and state != "Z":
            found.add(int(entry))
    return found


def _run_dir(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[3].decode()


async def _children(pid: int) -> set[int]:
    return children(pid)


async def _still_alive(pids: set[int]) -> list[int]:
    return [pid for pid in pids if alive(pid)]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as r:
        return r.status, await r.text()


async def _until(probe, ok, *, within: float = 15.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while True:
        try:
            value = await probe()
            if ok(value):
                return value
        except aiohttp.ClientError:
            value = None
        assert time.monotonic() < deadline, f"gave up waiting; last: {value}"
        await asyncio.sleep(0.1)


async def _calls(url: str, count: int, *, parallel: int = 8) -> list[aiohttp.ClientResponse]:
    """``count`` GETs, each on a new connection (so the kernel picks a worker for each)."""
    responses: list[aiohttp.ClientResponse] = []
    pending = iter(range(count))
    connector = aiohttp.TCPConnector(force_close=True, limit=parallel)
    async with aiohttp.ClientSession(connector=connector) as s:
        async def client() -> None:
            for _ in pending:
                async with s.get(url + LIST) as r:
                    await r.read()
                    responses.append(r)

        await asyncio.gather(*(client() for _ in range(parallel)))
    return responses


def _trace_prefixes(stdout: str) -> list[str]:
    return [json.loads(line)["trace"].split("-")[0] for line in stdout.splitlines()
            if line.startswith("{")]


def _requests_total(metrics: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(
        r'^opgate_requests_total\{[^}]*resource="configmaps"[^}]*\} (\S+)$', metrics, re.M))


@pytest.mark.asyncio
async def test_both_workers_serve_and_metrics_add_up(opgate: OpgateProcess) -> None:
    workers = children(opgate.proc.pid)
    assert len(workers) == 2
    responses = await _calls(opgate.url, 200)
    assert [r.status for r in responses] == [200] * 200
    await asyncio.sleep(0.3)  # the access log line is written after the response
    served_by = _trace_prefixes(opgate.stdout())
    assert len(served_by) == 200
    assert len(set(served_by)) == 2, "both workers must have served calls"
    # each worker hands its counts to the shared files within telemetry.FLUSH_EVERY
    status, metrics = await _until(lambda: _get(opgate.admin_url + "/metrics"),
                                   lambda r: _requests_total(r[1]) == 200)
    assert status == 200
    assert _requests_total(metrics) == 200
    assert "opgate_inflight_requests 0.0" in metrics  # a live-sum gauge, no per-pid label
    assert 'opgate_ratelimit_backend{backend="redis"} 1.0' in metrics
    # the same sums in OpenMetrics, which Prometheus asks for first
    status, text = await _get(opgate.admin_url + "/metrics",
                              {"Accept": "application/openmetrics-text; version=1.0.0"})
    assert status == 200 and text.endswith("# EOF\n")
    assert sum(sample.value for family in openmetrics_families(text) for sample in family.samples
               if sample.name == "opgate_requests_total"
               and sample.labels["resource"] == "configmaps") == 200
    status, ready = await _get(opgate.admin_url + "/readyz?verbose")
    assert status == 200
    for pid in workers:
        assert f"pid {pid}" in ready
    status, body = await _get(opgate.admin_url + "/debug/policies")
    view = json.loads(body)
    assert [p["name"] for p in view["policies"]] == ["v1"]
    assert {w["pid"] for w in view["workers"]} == workers
    assert len({w["digest"] for w in view["workers"]}) == 1


@pytest.mark.asyncio
async def test_killed_worker_is_restarted(opgate: OpgateProcess) -> None:
    before = children(opgate.proc.pid)
    assert [r.status for r in await _calls(opgate.url, 40)] == [200] * 40
    await asyncio.sleep(0.3)  # the access log is written at most 50 ms late: let it out first
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    await _until(lambda: _children(opgate.proc.pid),
                 lambda pids: len(pids) == 2 and victim not in pids)
    assert await _get(opgate.admin_url + "/healthz") == (200, "ok")  # one crash: still alive
    # the survivor serves meanwhile; then the new worker is up and ready
    assert [r.status for r in await _calls(opgate.url, 40)] == [200] * 40
    await _until(lambda: _get(opgate.admin_url + "/readyz"), lambda r: r[0] == 200)
    after = children(opgate.proc.pid)
    assert len(after - before) == 1
    assert [r.status for r in await _calls(opgate.url, 100)] == [200] * 100
    await asyncio.sleep(0.3)
    assert len(set(_trace_prefixes(opgate.stdout()))) == 3  # two workers, then the new one
    _, metrics = await _get(opgate.admin_url + "/metrics")
    assert _requests_total(metrics) == 180  # the dead worker's calls still count
    assert f"(pid {victim}) was killed by SIGKILL" in opgate.stderr()


@pytest.mark.asyncio
async def test_healthz_fails_once_no_worker_has_served_for_the_grace(
    opgate: OpgateProcess, policy_file: Path,
) -> None:
    """Workers that die at every start (their policies broke since: each restart exits with
    "policies not loaded") leave nothing serving. /readyz fails at once; /healthz must fail
    too once that has lasted ``LIVENESS_GRACE``, with the failing check named, so kubelet's
    liveness probe restarts the pod. It answered ``ok`` for ever: the pod sat NotReady."""
    await asyncio.to_thread(policy_file.write_text, "spec: [broken\n")
    killed = time.monotonic()
    for pid in children(opgate.proc.pid):
        os.kill(pid, signal.SIGKILL)
    status, body = await _until(lambda: _get(opgate.admin_url + "/healthz"),
                                lambda r: r[0] != 200, within=LIVENESS_GRACE + 60)
    assert time.monotonic() - killed >= LIVENESS_GRACE  # not before the grace
    assert status == 503
    ping, workers, verdict = body.splitlines()
    assert ping == "[+]ping ok"
    assert workers.startswith("[-]workers failed: no worker has served for "), body
    assert "worker 0 exited with status 1" in workers and "worker 1 exited with status 1" in (
        workers)
    assert verdict == "healthz check failed"
    assert (await _get(opgate.admin_url + "/livez"))[0] == 503
    assert (await _get(opgate.admin_url + "/readyz"))[0] == 503
    assert opgate.stderr().count("policies not loaded") >= 4  # each worker restarted, again


@pytest.mark.asyncio
async def test_a_hung_worker_is_killed_and_replaced(opgate: OpgateProcess) -> None:
    """A worker that runs but no longer answers (stopped here by SIGSTOP; a deadlock, a loop
    stuck in a call) was left as it was: /readyz said it was "starting" and /healthz ok for
    ever, its share of the connections unserved. Once it has not answered its admin socket
    for ``LIVENESS_GRACE`` the supervisor kills it and starts another."""
    before = children(opgate.proc.pid)
    victim = min(before)
    os.kill(victim, signal.SIGSTOP)
    try:
        _, ready = await _until(lambda: _get(opgate.admin_url + "/readyz?verbose"),
                                lambda r: r[0] == 503)
        assert f"pid {victim}: not answering its admin socket" in ready, ready
        await _until(lambda: _children(opgate.proc.pid),
                     lambda pids: len(pids) == 2 and victim not in pids,
                     within=LIVENESS_GRACE + 30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)
    await _until(lambda: _get(opgate.admin_url + "/readyz"), lambda r: r[0] == 200)
    assert f"(pid {victim}) has not answered its admin socket for" in opgate.stderr()
    assert f"(pid {victim}) was killed by SIGKILL" in opgate.stderr()


def _values(metrics_dir: str, kind: str, pid: int) -> dict[str, float]:
    """What worker ``pid`` wrote to its ``kind`` file (``counter``, ``gauge_livesum``): each
    sample's name with its labels, and its value."""
    path = os.path.join(metrics_dir, f"{kind}_{pid}.db")
    return {json.loads(key)[1] + json.dumps(json.loads(key)[2], sort_keys=True): value
            for key, value, _, _ in MmapedDict.read_all_values_from_file(path)}


def _files(directory: str) -> set[str]:
    return set(os.listdir(directory))


def _sample(metrics: str, name: str) -> float | None:
    found = re.search(rf"^{name} (\S+)$", metrics, re.M)
    return float(found.group(1)) if found else None


@pytest.mark.asyncio
async def test_a_killed_workers_gauges_go_its_counts_stay(opgate: OpgateProcess) -> None:
    """A worker killed while it relays a watch leaves its files behind: its counters must still
    count (prometheus multiprocess mode), its live gauges (in flight, watches open) must not
    keep its last values for ever (the supervisor marks its pid dead when it reaps it)."""
    metrics_dir = os.path.join(_run_dir(min(children(opgate.proc.pid))), "metrics")
    assert [r.status for r in await _calls(opgate.url, 40)] == [200] * 40
    await _until(lambda: _get(opgate.admin_url + "/metrics"),
                 lambda r: _requests_total(r[1]) == 40)

    async def watch() -> None:
        async with aiohttp.ClientSession() as s, s.get(opgate.url + WATCH) as r:
            async for _ in r.content:
                pass

    watching = asyncio.create_task(watch())
    try:
        _, metrics = await _until(lambda: _get(opgate.admin_url + "/metrics"),
                                  lambda r: _sample(r[1], "opgate_watches_open") == 1.0)
        assert _sample(metrics, "opgate_inflight_requests") == 1.0
        workers = children(opgate.proc.pid)
        victim, = (pid for pid in workers
                   if _values(metrics_dir, "gauge_livesum", pid).get("opgate_watches_open{}"))
        assert sum(v for k, v in _values(metrics_dir, "counter", victim).items()
                   if k.startswith("opgate_requests_total")) > 0  # it served some of the 40
        os.kill(victim, signal.SIGKILL)
        await _until(lambda: _children(opgate.proc.pid),
                     lambda pids: len(pids) == 2 and victim not in pids)
        await _until(lambda: _get(opgate.admin_url + "/readyz"), lambda r: r[0] == 200)
        status, metrics = await _get(opgate.admin_url + "/metrics")
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
    assert status == 200
    assert _sample(metrics, "opgate_watches_open") == 0.0, metrics
    assert _sample(metrics, "opgate_inflight_requests") == 0.0
    assert _requests_total(metrics) == 40  # the dead worker's calls still count
    files = _files(metrics_dir)
    assert f"gauge_livesum_{victim}.db" not in files


def _duration_count(metrics: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(
        r'^opgate_request_duration_seconds_count\{[^}]*\} (\S+)$', metrics, re.M))


@pytest.mark.asyncio
async def test_restarted_workers_leave_no_files_behind_and_their_counts_stay(
    opgate: OpgateProcess,
) -> None:
    """Each worker that died left its counter and histogram files, a new set at every restart
    of a crash loop: the directory grew without bound and every scrape read all of it. A dead
    worker's counts are merged into one archive file per kind when it is reaped: the sums
    stay (a counter never goes down), the files are the live workers' and the archives'."""
    metrics_dir = os.path.join(_run_dir(min(children(opgate.proc.pid))), "metrics")
    dead: set[int] = set()
    total = 0
    for _ in range(3):
        assert [r.status for r in await _calls(opgate.url, 20)] == [200] * 20
        total += 20
        await _until(lambda: _get(opgate.admin_url + "/metrics"),
                     lambda r, want=total: _requests_total(r[1]) == want)  # flushed
        victim = min(children(opgate.proc.pid))
        os.kill(victim, signal.SIGKILL)
        dead.add(victim)
        await _until(lambda: _children(opgate.proc.pid),
                     lambda pids, gone=victim: len(pids) == 2 and gone not in pids)
        await _until(lambda: _get(opgate.admin_url + "/readyz"), lambda r: r[0] == 200)
    _, metrics = await _get(opgate.admin_url + "/metrics")
    assert _requests_total(metrics) == total
    assert _duration_count(metrics) == total
    live = children(opgate.proc.pid)
    files = _files(metrics_dir)
    assert not [f for f in files if f.removesuffix(".db").rsplit("_", 1)[1] in map(str, dead)]
    assert {f for f in files if f.endswith("_archive.db")} == {
        "counter_archive.db", "histogram_archive.db"}, files
    assert all(f.endswith("_archive.db") or int(f.removesuffix(".db").rsplit("_", 1)[1]) in live
               for f in files), files


@pytest.mark.asyncio
async def test_sigterm_finishes_inflight_calls_and_leaves_no_process(
    opgate: OpgateProcess,
) -> None:
    workers = children(opgate.proc.pid)
    run_dirs = {_run_dir(pid) for pid in workers}  # python -m proxy.workers RUN_DIR INDEX FD
    assert len(run_dirs) == 1 and all(map(os.path.isdir, run_dirs))

    async def slow_call() -> tuple[int, dict[str, object]]:
        async with aiohttp.ClientSession() as s, s.get(opgate.url + SLOW) as resp:
            return resp.status, await resp.json()

    slow = asyncio.create_task(slow_call())
    await asyncio.sleep(0.5)  # the call is in flight in a worker
    opgate.proc.send_signal(signal.SIGTERM)
    # unready at once, while the call is still in flight (kubelet stops sending calls here)
    ready = await _until(lambda: _get(opgate.admin_url + "/readyz?verbose"),
                         lambda r: r[0] != 200, within=10)
    assert ready is not None and ready[0] == 503 and "[-]shutdown failed" in ready[1], ready
    assert not slow.done()
    status, body = await slow
    assert status == 200
    assert body["kind"] == "ConfigMapList"
    code = await asyncio.to_thread(opgate.proc.wait, 20)
    assert code == 0
    assert not [pid for pid in workers if alive(pid)]
    assert not any(map(os.path.exists, run_dirs))
    assert "shutting down 2 workers" in opgate.stderr()


@pytest.mark.asyncio
async def test_a_second_sigterm_reaches_the_workers_and_cuts_their_drain(
    opgate: OpgateProcess,
) -> None:
    workers = children(opgate.proc.pid)
    stuck = asyncio.create_task(status_of(opgate.url + STUCK))
    await _until(lambda: _get(opgate.admin_url + "/metrics"),
                 lambda r: "opgate_inflight_requests 1.0" in r[1])
    opgate.proc.send_signal(signal.SIGTERM)
    await _until(lambda: _get(opgate.admin_url + "/readyz"), lambda r: r[0] == 503)
    await asyncio.sleep(0.3)
    assert not stuck.done()  # a worker drains: the call has its 10 s grace
    opgate.proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(stuck, 5) != 200  # cut now, not after the grace
    code = await asyncio.to_thread(opgate.proc.wait, 20)
    assert code == 0
    assert not [pid for pid in workers if alive(pid)]
    assert "SIGTERM again: the calls still in flight are cut now" in opgate.stderr()


@pytest.mark.asyncio
async def test_workers_stop_when_the_supervisor_is_killed(opgate: OpgateProcess) -> None:
    workers = children(opgate.proc.pid)
    run_dirs = {_run_dir(pid) for pid in workers}
    opgate.proc.kill()
    opgate.proc.wait(10)
    await _until(lambda: _still_alive(workers), lambda orphans: not orphans)
    assert not any(map(os.path.exists, run_dirs))  # the last worker out removed it
    assert opgate.stderr().count("the supervisor is gone; shutting down") == 2


async def test_a_run_dir_a_killed_container_left_goes_at_the_next_start(
        upstream: str, redis_server: RedisServer, policy_file: Path, tmp_path: Path) -> None:
    """A container killed whole (an OOM kill takes the supervisor and its workers at once) left
    its run dir, metric files and all (~400 KiB with 2 workers), in the emptyDir that outlives
    the container: every such restart added one until the pod passed the chart's 16 MiB
    ``sidecar.tmpSizeLimit`` and was evicted. The next supervisor removes the dirs no live
    supervisor holds, and only those (two opgates may share a $TMPDIR)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    running: list[OpgateProcess] = []

    async def start() -> OpgateProcess:
        proc = OpgateProcess("--upstream", upstream, "--redis-url", redis_server.url,
                             "--policies", str(policy_file.parent), "--workers", "2",
                             log_dir=tmp_path, env={"TMPDIR": str(tmp)})
        running.append(proc)
        await asyncio.to_thread(proc.wait_ready)
        return proc

    try:
        killed = await start()
        everyone = {killed.proc.pid, *children(killed.proc.pid)}
        for pid in everyone:
            os.kill(pid, signal.SIGKILL)
        killed.proc.wait(10)
        await _until(lambda: _still_alive(everyone), lambda left: not left)
        [left] = os.listdir(tmp)
        assert os.listdir(tmp / left / "metrics")  # what the next start found
        serving = [await start(), await start()]
        held = {os.path.basename(_run_dir(next(iter(children(p.proc.pid))))) for p in serving}
        assert sorted(os.listdir(tmp)) == sorted(held)
        assert left not in held
    finally:
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                proc.stop()


@pytest.mark.asyncio
async def test_policy_edit_reaches_every_worker(opgate: OpgateProcess, policy_file: Path) -> None:
    responses = await _calls(opgate.url, 20)
    assert {r.headers.get("RateLimit-Limit") for r in responses} == {"100000"}
    marker = len(opgate.stdout().splitlines())
    await asyncio.to_thread(policy_file.write_text, POLICY.format(name="v2", burst=200000))
    started = time.monotonic()

    async def digests() -> tuple[set[str], set[str]]:
        view = json.loads((await _get(opgate.admin_url + "/debug/policies"))[1])
        return {p["name"] for p in view["policies"]}, {w["digest"] for w in view["workers"]}

    await _until(digests, lambda v: v[0] == {"v2"} and len(v[1]) == 1, within=5)
    assert time.monotonic() - started < 3.0  # ~1 s, with slack for a loaded machine
    responses = await _calls(opgate.url, 60)
    assert {r.headers.get("RateLimit-Limit") for r in responses} == {"200000"}
    await asyncio.sleep(0.3)
    assert len(set(_trace_prefixes("\n".join(opgate.stdout().splitlines()[marker:])))) == 2


@pytest.mark.parametrize(("args", "says"), [
    (["--workers", "2"], "--workers 2 needs --redis-url"),
    (["--workers", "2", "--redis-url", "redis://127.0.0.1:1/0", "--listen", "unix:/tmp/x.sock"],
     "needs a TCP --listen"),
])
def test_refused_with_a_clear_message(args: list[str], says: str) -> None:
    run = subprocess.run([sys.executable, "-m", "proxy", "serve", "--upstream",
                          "http://127.0.0.1:1", *args], capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == 2
    assert says in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.asyncio
async def test_ctrl_c_in_a_terminal_drains_the_workers(
    upstream: str, redis_server: RedisServer, policy_file: Path, tmp_path: Path,
) -> None:
    """A terminal's Ctrl-C signals the whole foreground process group: the workers, each in
    a group of its own, get it once, through the supervisor, and drain; they used to get it
    twice (from the terminal, then passed on) and cut the calls in flight at once."""
    proc = OpgateProcess("--upstream", upstream, "--redis-url", redis_server.url,
                         "--redis-timeout", "2", "--policies", str(policy_file.parent),
                         "--workers", "2", log_dir=tmp_path, session=True)
    workers: set[int] = set()
    try:
        await asyncio.to_thread(proc.wait_ready)
        await _until(lambda: _get(proc.admin_url + "/readyz"), lambda r: r[0] == 200)
        workers = children(proc.proc.pid)
        slow = asyncio.create_task(status_of(proc.url + SLOW))
        await _until(lambda: _get(proc.admin_url + "/metrics"),
                     lambda r: "opgate_inflight_requests 1.0" in r[1])
        os.killpg(proc.proc.pid, signal.SIGINT)  # as the terminal does it
        assert await asyncio.wait_for(slow, 20) == 200  # drained, not cut
        assert await asyncio.to_thread(proc.proc.wait, 20) == 0
    finally:
        proc.stop()
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert "again" not in proc.stderr(), proc.stderr()


class Supervised:
    """``opgate serve --workers 2`` on Redis with a policy directory whose ``policy.yaml`` is
    policy v1, or a symlink to ``target``; :meth:`stop` ends it and any worker left over."""

    def __init__(self, upstream: str, redis_server: RedisServer, tmp_path: Path, *,
                 target: Path | None = None) -> None:
        policies = tmp_path / "policies"
        policies.mkdir()
        if target is None:
            (policies / "policy.yaml").write_text(POLICY.format(name="v1", burst=100000))
        else:
            (policies / "policy.yaml").symlink_to(target)
        self.proc = OpgateProcess("--upstream", upstream, "--redis-url", redis_server.url,
                                  "--policies", str(policies), "--workers", "2",
                                  log_dir=tmp_path)
        self.workers: set[int] = set()

    def stop(self) -> int:
        code = self.proc.stop()
        for pid in self.workers:  # never leave one behind, whatever the test did
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        return code


@pytest.mark.asyncio
async def test_sighup_reaches_every_worker(upstream: str, redis_server: RedisServer,
                                           tmp_path: Path) -> None:
    """The supervisor passes SIGHUP on: every worker reloads its policies at once, a change
    made where the file watch cannot see it (a symlink's target elsewhere)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / "real.yaml"
    target.write_text(POLICY.format(name="v1", burst=100000))
    gate = Supervised(upstream, redis_server, tmp_path, target=target)
    proc = gate.proc
    try:
        await asyncio.to_thread(proc.wait_ready)
        workers = gate.workers = children(proc.proc.pid)

        def state(reply: tuple[int, str]) -> tuple[list[str], set[str]]:
            """The first worker's policy names, and every worker's digest."""
            view = json.loads(reply[1])
            return ([p["name"] for p in view["policies"]],
                    {str(w.get("digest")) for w in view["workers"]})

        before = await _until(lambda: _get(proc.admin_url + "/debug/policies"),
                             lambda r: r[0] == 200 and state(r)[0] == ["v1"])
        (old,) = state(before)[1]  # one digest: both workers run v1
        target.write_text(POLICY.format(name="v2", burst=100000))
        proc.proc.send_signal(signal.SIGHUP)
        after = await _until(
            lambda: _get(proc.admin_url + "/debug/policies"),
            lambda r: r[0] == 200 and state(r)[0] == ["v2"] and len(state(r)[1]) == 1,
            within=3)
        assert state(after)[1] != {old}
        assert children(proc.proc.pid) == workers  # none died of it
    finally:
        code = gate.stop()
    assert code == 0, proc.stderr()
    assert proc.stderr().count("SIGHUP: reloading the policy files") == 2, proc.stderr()


@pytest.mark.asyncio
async def test_sighup_while_the_workers_start_ends_none_of_them(
        upstream: str, redis_server: RedisServer, tmp_path: Path) -> None:
    """A SIGHUP that comes while the workers are still starting (a config-management tool
    reloading every opgate it finds) is passed on only once each serves: a worker starts with
    SIGHUP's default disposition (the supervisor's handler is no child's), and it used to die of
    it, which ended the whole opgate ("killed by SIGHUP while starting; stopping")."""
    gate = Supervised(upstream, redis_server, tmp_path)
    proc = gate.proc
    try:
        def spawned() -> set[int]:
            deadline = time.monotonic() + 10
            while len(children(proc.proc.pid)) < 2 and time.monotonic() < deadline:
                time.sleep(0.002)
            return children(proc.proc.pid)

        workers = gate.workers = await asyncio.to_thread(spawned)
        proc.proc.send_signal(signal.SIGHUP)  # the workers are importing opgate by now
        await asyncio.to_thread(proc.wait_ready)
        await _until(lambda: asyncio.to_thread(proc.stderr),
                     lambda err: err.count("SIGHUP: reloading the policy files") == 2, within=5)
        assert children(proc.proc.pid) == workers  # none died of it
    finally:
        code = gate.stop()
    assert code == 0, proc.stderr()
    # each worker reloads (and says the files are unchanged), and nothing else of SIGHUP
    said = [line for line in proc.stderr().splitlines() if "SIGHUP" in line]
    assert all("SIGHUP: reloading" in line or "SIGHUP: the policy files are unchanged" in line
               for line in said), proc.stderr()


@pytest.mark.asyncio
async def test_sighups_during_shutdown_end_neither_supervisor_nor_workers(
        upstream: str, redis_server: RedisServer, tmp_path: Path) -> None:
    """SIGHUPs all through a shutdown: the supervisor passes them on while its workers drain,
    and both still exit 0 (a removed SIGHUP handler leaves the default: the end)."""
    gate = Supervised(upstream, redis_server, tmp_path)
    proc = gate.proc
    try:
        await asyncio.to_thread(proc.wait_ready)
        gate.workers = children(proc.proc.pid)
        proc.proc.send_signal(signal.SIGTERM)
        while proc.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.proc.send_signal(signal.SIGHUP)
            await asyncio.sleep(0.001)
    finally:
        code = gate.stop()
    assert code == 0, proc.stderr()
    assert "killed by SIGHUP" not in proc.stderr(), proc.stderr()


@pytest.mark.asyncio
async def test_sighup_while_a_worker_restarts_ends_it_not(
        upstream: str, redis_server: RedisServer, tmp_path: Path) -> None:
    """A SIGHUP just after the supervisor restarted a worker (one died) reaches the new worker
    once it serves: sent at once, it ended the worker again ("killed by SIGHUP")."""
    gate = Supervised(upstream, redis_server, tmp_path)
    proc = gate.proc
    try:
        await asyncio.to_thread(proc.wait_ready)
        workers = gate.workers = children(proc.proc.pid)
        os.kill(min(workers), signal.SIGKILL)

        def restarted() -> set[int]:
            deadline = time.monotonic() + 10
            while not children(proc.proc.pid) - workers and time.monotonic() < deadline:
                time.sleep(0.002)
            return children(proc.proc.pid)

        workers |= await asyncio.to_thread(restarted)
        proc.proc.send_signal(signal.SIGHUP)  # the new worker is importing opgate by now
        await _until(lambda: asyncio.to_thread(proc.stderr),
                     lambda err: err.count("SIGHUP: reloading the policy files") == 2, within=10)
    finally:
        code = gate.stop()
    assert code == 0, proc.stderr()
    assert "killed by SIGHUP" not in proc.stderr(), proc.stderr()
    assert proc.stderr().count("restarting in") == 1, proc.stderr()


@pytest.mark.asyncio
async def test_sigterm_while_the_workers_start_stops_them_and_says_so(
        upstream: str, redis_server: RedisServer, tmp_path: Path) -> None:
    """A SIGTERM that comes while the workers start (a pod deleted as it starts) stops them,
    exit 0, and the log says so: it said nothing at all, so the pod's log ended on nothing
    (no "serving", no "shutting down"). The workers read their policies from a FIFO here,
    which holds their start until the test has signalled the supervisor."""
    from tests.integration.opgate_proc import open_once_read

    fifo = tmp_path / "policy.yaml"
    os.mkfifo(fifo)
    proc = OpgateProcess("--upstream", upstream, "--redis-url", redis_server.url,
                         "--policies", str(fifo), "--workers", "2", log_dir=tmp_path)
    workers: set[int] = set()
    try:
        # a worker reads it: starting
        fd = await asyncio.to_thread(open_once_read, fifo, proc.proc, proc.stderr)
        try:
            workers = children(proc.proc.pid)
            proc.proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.proc.wait, 20)
        finally:
            os.close(fd)
    finally:
        proc.stop()
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    err = proc.stderr()
    assert code == 0, err
    assert "shutting down 2 workers while they start" in err, err
    assert not [pid for pid in workers if alive(pid)]
    assert "Traceback" not in err, err


def on_a_small_tmpdir(tmpdir: Path, *, size_kb: int, free_kb: int) -> tuple[str, ...]:
    """A wrapper (:class:`OpgateProcess`) that runs opgate with ``$TMPDIR`` on a tmpfs of
    ``size_kb`` of which only ``free_kb`` are free (an emptyDir with a ``sizeLimit`` that the
    audit log or a capture filled), mounted in a user and mount namespace of its own
    (``unshare -rm``: no privilege needed where user namespaces are allowed)."""
    taken = size_kb - free_kb
    script = (f'mount -t tmpfs -o size={size_kb}k tmpfs {tmpdir} && '
              f'dd if=/dev/zero of={tmpdir}/taken bs=1k count={taken} 2>/dev/null; '
              'exec "$@"')
    return ("unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh")


@pytest.mark.asyncio
async def test_workers_serve_on_without_room_for_their_metric_files(
        upstream: str, redis_server: RedisServer, policy_file: Path, tmp_path: Path) -> None:
    """Room for the run directory (settings, sockets) but not for each worker's metric files:
    the workers serve all the same, each says once that its metrics stay in memory (they
    died of SIGBUS at their first metric, and opgate did not start)."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    proc = OpgateProcess("--upstream", upstream, "--redis-url", redis_server.url,
                         "--redis-timeout", "2", "--policies", str(policy_file.parent),
                         "--workers", "2", log_dir=tmp_path, env={"TMPDIR": str(tmpdir)},
                         wrapper=on_a_small_tmpdir(tmpdir, size_kb=512, free_kb=8))
    try:
        await asyncio.to_thread(proc.wait_ready)
        workers = children(proc.proc.pid)
        assert len(workers) == 2
        assert [r.status for r in await _calls(proc.url, 100)] == [200] * 100
        status, _ = await _get(proc.admin_url + "/metrics")
        assert status == 200
        assert children(proc.proc.pid) == workers  # none died, none restarted
    finally:
        workers = children(proc.proc.pid)
        proc.stop()
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    warned = [line for line in proc.stderr().splitlines() if "go on in memory" in line]
    assert 1 <= len(warned) <= 2, proc.stderr()  # once per worker that ran out of room
    assert "Traceback" not in proc.stderr()


@pytest.mark.asyncio
async def test_a_refused_certificate_shows_on_the_supervisors_readyz_and_metrics(
    upstream: str, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Each worker reloads the pair on its own: a changed pair they refuse (the cert renewed,
    its key not) shows on the supervisor's ``/readyz?verbose`` for each worker, still 200
    (the old certificate serves); its ``/metrics`` counts each worker's refusal and keeps the
    old certificate's notAfter; the pair made whole again moves it and clears the warnings."""
    old = make_cert(str(tmp_path), name="old", hours=24)
    new = make_cert(str(tmp_path), name="new", hours=48)
    cert, key = str(tmp_path / "tls.crt"), str(tmp_path / "tls.key")
    shutil.copy(old[0], cert)
    shutil.copy(old[1], key)
    proc = OpgateProcess("--upstream", upstream, "--redis-url", redis_server.url,
                         "--redis-timeout", "2", "--tls-cert", cert, "--tls-key", key,
                         "--workers", "2", log_dir=tmp_path)
    workers: set[int] = set()
    expiry = rf'opgate_tls_cert_expiry_timestamp_seconds{{cert="{re.escape(cert)}"}}'

    async def metrics() -> str:
        return (await _get(proc.admin_url + "/metrics"))[1]

    def not_after(pem: str) -> float:
        ends = servingcert.not_after(pem)
        assert ends is not None
        return ends.timestamp()

    try:
        await asyncio.to_thread(proc.wait_ready)
        workers = children(proc.proc.pid)
        await _until(lambda: _get(proc.admin_url + "/readyz"), lambda r: r[0] == 200)
        await _until(metrics, lambda m: _sample(m, expiry) == not_after(old[0]))
        shutil.copy(new[0], cert + ".new")
        os.replace(cert + ".new", cert)
        warned = "serving-cert ok: warning: the changed files are not served: --tls-key"
        status, body = await _until(lambda: _get(proc.admin_url + "/readyz?verbose"),
                                    lambda r: r[1].count(warned) == 2, within=30)
        assert status == 200, body
        assert re.search(rf"^\[\+\]worker-0 ok: pid \d+; {warned}", body, re.M), body
        found = await _until(metrics, lambda m: _sample(
            m, 'opgate_tls_cert_reloads_total{result="error"}') == 2)
        assert _sample(found, expiry) == not_after(old[0])
        shutil.copy(new[1], key + ".new")
        os.replace(key + ".new", key)
        await _until(metrics, lambda m: _sample(m, expiry) == not_after(new[0]), within=30)
        assert "warning" not in (await _get(proc.admin_url + "/readyz?verbose"))[1]
    finally:
        workers |= children(proc.proc.pid)
        proc.stop()
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert "Traceback" not in proc.stderr()
