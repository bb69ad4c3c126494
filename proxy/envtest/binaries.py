"""Find or build the `etcd` and `kube-apiserver` binaries the real-apiserver tier runs.

Order of preference, as envtest does it:

1. ``$KUBEBUILDER_ASSETS`` (a directory holding ``etcd`` and ``kube-apiserver``);
2. a cache outside the repository (``$OPGATE_CACHE_DIR`` or ``~/.cache/opgate``) filled by an
   earlier build and stamped with ``RECIPE`` (a cache from an older recipe is rebuilt);
3. a build with the local Go toolchain from the Go module proxy, at the pinned versions below.

``k8s.io/kubernetes`` lists its staging modules (``k8s.io/api``, ``k8s.io/apiserver``, …) at
``v0.0.0`` and replaces them with local paths, so a module that depends on it must replace every
one of them with the published ``v0.Y.Z`` (kubernetes/kubernetes#79384). etcd's server module is
built from a three-line ``main`` that calls ``etcdmain.Main``. The apiserver gets the version
stamps kube's own build sets, so ``/version`` says v1.35.4. No binary is ever committed.
``python -m proxy.envtest.binaries`` builds (or finds) them and prints the directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

KUBERNETES_VERSION = "v1.35.4"
ETCD_VERSION = "v3.6.16"

# bump when the build recipe changes: a cache built by an older recipe is rebuilt
RECIPE = "2"
_STAMP = "opgate-build-recipe"
_STAGING_RE = re.compile(r"^\s*(k8s\.io/[\w.-]+)\s+v0\.0\.0\s*$", re.MULTILINE)


class BinariesUnavailable(RuntimeError):
    """The binaries can be neither found nor built; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class KubeBinaries:
    etcd: Path
    kube_apiserver: Path


def cache_root() -> Path:
    """``$OPGATE_CACHE_DIR``, else ``$XDG_CACHE_HOME/opgate`` or ``~/.cache/opgate``."""
    base = os.environ.get("OPGATE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "opgate"
    )
    return Path(base)


def cache_dir() -> Path:
    return cache_root() / f"kube-{KUBERNETES_VERSION}-etcd-{ETCD_VERSION}"


def find_or_build(*, log: bool = True) -> KubeBinaries:
    """Return usable binaries, building them once when nothing provides them."""
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets:
        found = _in_dir(Path(assets))
        if found:
            return found
        raise BinariesUnavailable(
            f"KUBEBUILDER_ASSETS={assets} does not hold executable etcd and kube-apiserver"
        )
    target = cache_dir()
    found = _in_dir(target, stamped=True)
    if found:
        return found
    started = time.monotonic()
    _say(log, f"opgate: building kube-apiserver {KUBERNETES_VERSION} and etcd {ETCD_VERSION} "
              f"into {target} (once; later runs reuse it)")
    build(target)
    found = _in_dir(target, stamped=True)
    if not found:
        raise BinariesUnavailable(f"the build finished but {target} lacks the binaries")
    _say(log, f"opgate: built in {time.monotonic() - started:.0f}s, cached at {target}")
    return found


def _in_dir(path: Path, *, stamped: bool = False) -> KubeBinaries | None:
    etcd, apiserver = path / "etcd", path / "kube-apiserver"
    if stamped:
        try:
            if (path / _STAMP).read_text().strip() != RECIPE:
                return None
        except OSError:
            return None
    if all(p.is_file() and os.access(p, os.X_OK) for p in (etcd, apiserver)):
        return KubeBinaries(etcd=etcd, kube_apiserver=apiserver)
    return None


def _say(enabled: bool, message: str) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)


def _go(args: list[str], *, cwd: Path) -> str:
    go = shutil.which("go")
    if go is None:
        raise BinariesUnavailable(
            "no `go` toolchain on PATH to build etcd and kube-apiserver; install Go or set "
            "KUBEBUILDER_ASSETS to a directory holding both binaries"
        )
    env = dict(os.environ, CGO_ENABLED="0", GOFLAGS="-mod=mod", GOWORK="off")
    proc = subprocess.run([go, *args], cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BinariesUnavailable(f"`go {' '.join(args)}` failed:\n{proc.stderr[-4000:]}")
    return proc.stdout


def build(target: Path) -> None:
    """Build both binaries into ``target`` (atomically: a half build never looks usable)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="opgate-kube-build-") as tmp:
        work = Path(tmp)
        out = work / "out"
        out.mkdir()
        _build_apiserver(work / "apiserver", out)
        _build_etcd(work / "etcd", out)
        staged = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        staged.chmod(0o755)
        for name in ("etcd", "kube-apiserver"):
            shutil.move(str(out / name), staged / name)
        (staged / _STAMP).write_text(RECIPE + "\n")
        if target.exists():
            shutil.rmtree(target)
        staged.rename(target)


def _build_apiserver(mod: Path, out: Path) -> None:
    mod.mkdir()
    info = json.loads(
        _go(["mod", "download", "-json", f"k8s.io/kubernetes@{KUBERNETES_VERSION}"], cwd=mod)
    )
    staging = sorted(set(_STAGING_RE.findall(Path(info["GoMod"]).read_text())))
    minor = KUBERNETES_VERSION.replace("v1.", "v0.", 1)
    lines = ["module opgate.dev/kubebuild", "", "go 1.24", "",
             f"require k8s.io/kubernetes {KUBERNETES_VERSION}", ""]
    lines += [f"replace {name} => {name} {minor}" for name in staging]
    (mod / "go.mod").write_text("\n".join(lines) + "\n")
    _go(["get", f"k8s.io/kubernetes/cmd/kube-apiserver@{KUBERNETES_VERSION}"], cwd=mod)
    _go(["build", "-trimpath", f"-ldflags=-s -w {_version_ldflags()}",
         "-o", str(out / "kube-apiserver"),
         "k8s.io/kubernetes/cmd/kube-apiserver"], cwd=mod)


def _version_ldflags() -> str:
    """What kube's own build stamps in (hack/lib/version.sh), so that ``/version`` reports
    v1.35.4, not v0.0.0-master: helm and kubectl compare it."""
    major, minor = KUBERNETES_VERSION.lstrip("v").split(".")[:2]
    values = {"gitVersion": KUBERNETES_VERSION, "gitMajor": major, "gitMinor": minor,
              "gitTreeState": "clean", "buildDate": "1970-01-01T00:00:00Z"}
    return " ".join(f"-X '{pkg}.{key}={value}'" for pkg in (
        "k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
        for key, value in values.items())


def _build_etcd(mod: Path, out: Path) -> None:
    mod.mkdir()
    (mod / "go.mod").write_text("module opgate.dev/etcdbuild\n\ngo 1.24\n")
    (mod / "main.go").write_text(
        'package main\n\nimport (\n\t"os"\n\n\t"go.etcd.io/etcd/server/v3/etcdmain"\n)\n\n'
        "func main() { etcdmain.Main(os.Args) }\n"
    )
    _go(["get", f"go.etcd.io/etcd/server/v3@{ETCD_VERSION}"], cwd=mod)
    _go(["build", "-trimpath", "-ldflags=-s -w", "-o", str(out / "etcd"), "."], cwd=mod)


def main() -> int:
    try:
        found = find_or_build()
    except BinariesUnavailable as exc:
        print(f"opgate: cannot get etcd/kube-apiserver: {exc}", file=sys.stderr)
        return 1
    print(found.etcd.parent)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
