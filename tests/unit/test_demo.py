"""``opgate demo`` that cannot start says why in one line and exits 1 (no traceback); the
running demo is tests/e2e/test_demo.py."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest

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


def test_a_line_caught_half_written_is_shown_once_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo reads opgate's log as it grows: an access-log line read before its end was
    dropped (its two halves parse as JSON neither), and its call went missing from the screen
    and from the counts."""
    from proxy import demo

    log = tmp_path / "opgate.log"
    entry = ('{"time":"2026-12-02T02:19:33.487Z","verb":"get","code":200,"decision":"allowed",'
             '"resource":"configmaps","namespace":"ns","name":"a","user":"u"}\n')
    log.write_text(entry[:40])
    at_end = threading.Event()  # the follower has read all there is and waits for more
    real_sleep = time.sleep

    def pause(seconds: float) -> None:
        at_end.set()
        real_sleep(min(seconds, 0.01))

    monkeypatch.setattr(demo.time, "sleep", pause)
    stop, counts, out = threading.Event(), {}, io.StringIO()
    with redirect_stdout(out):
        follower = threading.Thread(target=demo._follow, args=(log, stop, counts))
        follower.start()
        try:
            assert at_end.wait(10), "the follower never reached the end of the log"
            with log.open("a") as stream:
                stream.write(entry[40:])
            at_end.clear()
            assert at_end.wait(10)
            at_end.clear()
            assert at_end.wait(10)  # a whole pass after the line was completed
        finally:
            stop.set()
            follower.join()
    assert counts == {"allowed": 1}
    assert "ALLOWED   200 get    configmaps" in out.getvalue()
