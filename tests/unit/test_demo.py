"""``opgate demo`` that cannot start says why in one line and exits 1 (no traceback); the
running demo is tests/e2e/test_demo.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_binaries_it_cannot_find_are_one_clear_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-assets"
    proc = subprocess.run(
        [sys.executable, "-m", "proxy", "demo"], cwd=ROOT, capture_output=True, text=True,
        timeout=60, env={**os.environ, "KUBEBUILDER_ASSETS": str(missing)})
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert (f"demo: could not start: KUBEBUILDER_ASSETS={missing} does not hold executable "
            "etcd and kube-apiserver") in proc.stderr.splitlines()
    assert "demo: stopped everything" in proc.stdout
