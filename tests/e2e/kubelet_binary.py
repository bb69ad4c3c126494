"""Build (once) the fake kubelet of ``tests/e2e/kubelet`` that test_exec.py drives.

The same recipe as ``clientgo_binary``: a committed ``go.mod``/``go.sum`` pinning
``k8s.io/kubelet`` (whose ``pkg/cri/streaming`` is the kubelet's own exec / attach /
port-forward server code) to the e2e kube-apiserver's version, so the build reads the Go module
proxy only for what the local module cache lacks (scripts/bootstrap.sh's kube-apiserver build
leaves nearly all of it there); the binary is cached outside the repository under a hash of the
sources and the Go version, so an edit rebuilds it and nothing else does.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
import time
from pathlib import Path

from proxy.envtest.binaries import BinariesUnavailable, cache_root
from tests.e2e.clientgo_binary import _env, _go

SOURCE = Path(__file__).parent / "kubelet"
NAME = "opgate-fake-kubelet"


def binary_path() -> Path:
    """Where the build for the current sources and Go version lives (it may not exist yet)."""
    version = subprocess.run([_go(), "env", "GOVERSION"], capture_output=True, text=True,
                             env=_env(), check=False).stdout.strip()
    digest = hashlib.sha256(version.encode())
    for path in sorted(SOURCE.iterdir()):
        if path.suffix == ".go" or path.name in ("go.mod", "go.sum"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return cache_root() / f"kubelet-{digest.hexdigest()[:16]}" / NAME


def find_or_build() -> tuple[Path, float]:
    """The binary and the seconds its build took (0 when it was cached)."""
    target = binary_path()
    if target.is_file() and os.access(target, os.X_OK):
        return target, 0.0
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"{NAME}.", dir=target.parent) as tmp:
        out = Path(tmp) / NAME
        proc = subprocess.run([_go(), "build", "-trimpath", "-ldflags=-s -w", "-o", str(out),
                               "."], cwd=SOURCE, env=_env(), capture_output=True, text=True)
        if proc.returncode != 0:
            raise BinariesUnavailable(
                f"`go build` of {SOURCE} failed:\n{proc.stderr[-4000:]}")
        out.rename(target)  # same directory: a half-written binary never looks usable
    return target, time.monotonic() - started
