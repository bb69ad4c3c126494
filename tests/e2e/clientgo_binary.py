"""Build (once) the client-go program of ``tests/e2e/clientgo`` that test_clientgo.py drives.

Its ``go.mod`` pins ``k8s.io/client-go`` to the minor of the e2e kube-apiserver
(``proxy.envtest.binaries.KUBERNETES_VERSION``; a unit test keeps the two in step) and its
``go.sum`` is committed, so the build reads the Go module proxy only for modules that are not
yet in the local module cache (after scripts/bootstrap.sh built kube-apiserver, client-go is).
The binary is cached outside the repository, as the kube binaries are, under a name made of a
hash of the sources and the Go version: an edit rebuilds it, nothing else does.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from proxy.envtest.binaries import BinariesUnavailable, cache_root

SOURCE = Path(__file__).parent / "clientgo"
NAME = "opgate-clientgo"


def _go() -> str:
    go = shutil.which("go")
    if go is None:
        raise BinariesUnavailable(
            "no `go` toolchain on PATH to build the client-go program of tests/e2e/clientgo "
            "(the same Go that scripts/bootstrap.sh needs for kube-apiserver)")
    return go


def _env() -> dict[str, str]:
    # the committed go.sum must match (readonly); no VCS stamp (the worktree may be anywhere)
    return dict(os.environ, CGO_ENABLED="0", GOWORK="off",
                GOFLAGS="-mod=readonly -buildvcs=false")


def binary_path() -> Path:
    """Where the build for the current sources and Go version lives (it may not exist yet)."""
    version = subprocess.run([_go(), "env", "GOVERSION"], capture_output=True, text=True,
                             env=_env(), check=False).stdout.strip()
    digest = hashlib.sha256(version.encode())
    for path in sorted(SOURCE.iterdir()):
        if path.suffix == ".go" or path.name in ("go.mod", "go.sum"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return cache_root() / f"clientgo-{digest.hexdigest()[:16]}" / NAME


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
