"""Build (once) the Go programs of the e2e tier: ``tests/e2e/clientgo`` (test_clientgo.py),
``tests/e2e/ctrlruntime`` (test_ctrlruntime.py, a controller-runtime manager) and
``tests/e2e/kubelet`` (test_exec.py, a fake kubelet: ``k8s.io/kubelet``'s own exec / attach /
port-forward server code over a built-in command set).

Each ``go.mod`` pins ``k8s.io/client-go`` to the minor of the e2e kube-apiserver
(``proxy.envtest.binaries.KUBERNETES_VERSION``; a test keeps the two in step) and its ``go.sum``
is committed, so the build reads the Go module proxy only for modules that are not yet in the
local module cache (after scripts/bootstrap.sh built kube-apiserver, client-go is;
controller-runtime and its few own dependencies are fetched once).
A binary is cached outside the repository, as the kube binaries are, under a name made of a
hash of its sources and the Go version: an edit rebuilds it, nothing else does.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from proxy.envtest.binaries import BinariesUnavailable, cache_root

HERE = Path(__file__).parent


@dataclass(frozen=True)
class GoProgram:
    """One Go module of tests/e2e with a ``main`` package, and where its build is cached."""

    source: Path
    name: str
    prefix: str  # the cache directory is ``<prefix>-<hash>``

    def binary_path(self) -> Path:
        """Where the build for the current sources and Go version lives (it may not exist)."""
        version = subprocess.run([_go(self.source), "env", "GOVERSION"], capture_output=True,
                                 text=True, env=_env(), check=False).stdout.strip()
        digest = hashlib.sha256(version.encode())
        for path in sorted(self.source.iterdir()):
            if path.suffix == ".go" or path.name in ("go.mod", "go.sum"):
                digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        return cache_root() / f"{self.prefix}-{digest.hexdigest()[:16]}" / self.name

    def find_or_build(self) -> tuple[Path, float]:
        """The binary and the seconds its build took (0 when it was cached)."""
        target = self.binary_path()
        if target.is_file() and os.access(target, os.X_OK):
            return target, 0.0
        target.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"{self.name}.", dir=target.parent) as tmp:
            out = Path(tmp) / self.name
            proc = subprocess.run([_go(self.source), "build", "-trimpath", "-ldflags=-s -w",
                                   "-o", str(out), "."], cwd=self.source, env=_env(),
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise BinariesUnavailable(
                    f"`go build` of {self.source} failed:\n{proc.stderr[-4000:]}")
            out.rename(target)  # same directory: a half-written binary never looks usable
        return target, time.monotonic() - started


CLIENTGO = GoProgram(source=HERE / "clientgo", name="opgate-clientgo", prefix="clientgo")
CTRLRUNTIME = GoProgram(source=HERE / "ctrlruntime", name="opgate-ctrlruntime",
                        prefix="ctrlruntime")
FAKE_KUBELET = GoProgram(source=HERE / "kubelet", name="opgate-fake-kubelet", prefix="kubelet")
PROGRAMS = {"clientgo": CLIENTGO, "ctrlruntime": CTRLRUNTIME, "fake_kubelet": FAKE_KUBELET}


def _go(source: Path) -> str:
    go = shutil.which("go")
    if go is None:
        raise BinariesUnavailable(
            f"no `go` toolchain on PATH to build the program of {source} "
            "(the same Go that scripts/bootstrap.sh needs for kube-apiserver)")
    return go


def _env() -> dict[str, str]:
    # the committed go.sum must match (readonly); no VCS stamp (the worktree may be anywhere)
    return dict(os.environ, CGO_ENABLED="0", GOWORK="off",
                GOFLAGS="-mod=readonly -buildvcs=false")

