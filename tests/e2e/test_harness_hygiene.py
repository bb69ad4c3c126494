"""The harness leaves nothing behind when the pytest that started it dies, however it dies.

A real pytest (in a subprocess) starts etcd + kube-apiserver (``LocalCluster``), a
``redis-server`` (``RedisServer``) and an opgate (``start_opgate``), then is ended from outside:
SIGTERM (a CI timeout, ``timeout``) must run the fixtures' teardown as Ctrl-C does; SIGKILL
runs nothing in it, so the reaper (``proxy.envtest.reaper``) must stop what it started and
remove the temp dirs. Either way every process it started ends within a bound, their ports are
free and their temp dirs are gone. Processes are identified by parentage (the dead pytest's
descendants, read from /proc before the kill) and awaited through pidfds; nothing is killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.envtest.binaries import KubeBinaries
from proxy.envtest.procs import port_open
from tests.integration.procwatch import Ends, command, descendants, read_until

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
STARTED_WITHIN = 180.0
GONE_WITHIN = {signal.SIGKILL: 30.0, signal.SIGTERM: 60.0}

INNER_TEST = '''
import json, threading

import pytest

from proxy.envtest.cluster import LocalCluster
from tests.e2e.conftest import start_opgate
from tests.integration.redis_server import RedisServer


@pytest.fixture(scope="session")
def parts(tmp_path_factory):
    with LocalCluster() as cluster, RedisServer.launch() as redis:
        gate = start_opgate(cluster, tmp_path_factory.mktemp("gate"))
        try:
            yield cluster, redis, gate
        finally:
            gate.stop()
            print("TEARDOWN RAN", flush=True)


def test_hold(parts):
    cluster, redis, gate = parts
    print("STARTED " + json.dumps({
        "ports": [cluster.port, int(cluster.etcd_url.rsplit(":", 1)[1]), redis.port,
                  gate.port, gate.admin_port],
        "dirs": [str(cluster.workdir), redis._dir],
    }), flush=True)
    threading.Event().wait(600)  # held here until the outer test ends this pytest
'''


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_a_killed_pytest_leaves_no_process_port_or_temp_dir(
    sig: signal.Signals, kube_binaries: KubeBinaries, tmp_path: Path
) -> None:
    (tmp_path / "test_inner.py").write_text(INNER_TEST)
    env = dict(os.environ, KUBEBUILDER_ASSETS=str(kube_binaries.etcd.parent),
               PYTHONPATH=str(REPO))
    env.pop("OPGATE_KEEP_CLUSTER_DIR", None)
    inner = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.conftest",
         "-q", "-s", "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
        cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True)
    assert inner.stdout is not None
    out = inner.stdout.fileno()
    try:
        said = read_until(out, "STARTED ", STARTED_WITHIN)
        line = next((x for x in said.splitlines() if "STARTED " in x), None)
        assert line is not None, said
        started = json.loads(line.split("STARTED ", 1)[1])
        children = Ends(descendants(inner.pid))
        inner.send_signal(sig)
        said += read_until(out, None, GONE_WITHIN[sig])
        inner.wait(timeout=GONE_WITHIN[sig])
    finally:
        if inner.poll() is None:
            inner.kill()
            inner.wait()
        inner.stdout.close()
    running = children.wait(GONE_WITHIN[sig])
    assert not running, [(pid, command(pid)) for pid in running]
    assert [port for port in started["ports"] if port_open(port)] == []
    assert [d for d in started["dirs"] if Path(d).exists()] == []
    if sig == signal.SIGTERM:
        assert "TEARDOWN RAN" in said, said
