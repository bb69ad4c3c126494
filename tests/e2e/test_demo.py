"""The README's first command works: the demo starts everything, shows calls, stops cleanly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_demo_runs_and_stops_cleanly() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "proxy", "demo", "--duration", "25", "--widgets", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "opgate admin" in out and "/debug/policies" in out
    assert "ALLOWED" in out
    assert "THROTTLED 429" in out  # the noisy widget's writes hit its per-instance budget
    assert "DENIED    403" in out and "opgate-demo:intruder" in out  # the identity policy
    assert "stopped everything" in out
    assert "Traceback" not in out
