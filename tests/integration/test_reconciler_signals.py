"""The sample operator stops cleanly on a SIGTERM that comes while it starts (a pod deleted as
it starts): as a container's PID 1 a signal with no handler yet is dropped, and the pod hangs in
Terminating until kubelet's SIGKILL; outside one it is killed (143) mid-start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.integration.opgate_proc import open_once_read

REPO = Path(__file__).resolve().parents[2]
KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "http://127.0.0.1:9"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
"""


def test_a_sigterm_while_starting_stops_the_reconciler_cleanly(tmp_path: Path) -> None:
    fifo = tmp_path / "kubeconfig"
    os.mkfifo(fifo)
    proc = subprocess.Popen(
        [sys.executable, "-m", "examples.reconciler", "--kubeconfig", str(fifo)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        fd = open_once_read(fifo, proc, lambda: "the reconciler never read its kubeconfig")
        proc.send_signal(signal.SIGTERM)
        os.write(fd, KUBECONFIG.encode())
        os.close(fd)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "stopped" in err, err
