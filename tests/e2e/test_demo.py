"""The README's first command works: the demo starts everything, shows calls, stops cleanly.

Whatever stops it, a Ctrl-C, a SIGTERM or the SIGHUP of a closed terminal, and whenever (while
it starts too), it stops every process it started (each in a session of its own, so no signal
reaches them but the demo's) and says so: none is left running, orphaned.
"""

from __future__ import annotations

import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proxy.envtest.reaper import reaper
from tests.e2e.waiting import wait_for

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
STARTED = "Ctrl-C stops everything."
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# and three Pythons: opgate, the reconciler and the harness's reaper (proxy/envtest/reaper.py)
STARTS = ("etcd", "kube-apiserver", "redis-server")


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


def _children(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``: their pid and command name."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm, _, rest = stat.partition("(")[2].rpartition(")")
        if int(rest.split()[1]) == pid:
            found[int(entry.name)] = comm
    return found


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _read_until(proc: subprocess.Popen[str], text: str, *, timeout: float) -> str:
    """The demo's output up to the line holding ``text``, as it prints it."""
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(deadline - time.monotonic()):
                break
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if text in line:
                return "".join(seen)
    raise AssertionError(f"the demo never printed {text!r}:\n{''.join(seen)[-4000:]}")


def _start_demo() -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "demo", "--widgets", "1"], cwd=ROOT,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    reaper().watch_group(proc.pid)  # stopped (with its cluster) if pytest dies first
    return proc


def _kill(proc: subprocess.Popen[str]) -> None:
    """A failed test's demo and what it started, at once."""
    children = _children(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for pid in children:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)


def _stop_and_check(proc: subprocess.Popen[str], sig: signal.Signals,
                    started: dict[int, str]) -> str:
    """Send ``sig``; the demo must exit 0 having stopped every process in ``started``."""
    try:
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            _kill(proc)
    left = {pid: name for pid, name in started.items() if _running(pid)}
    for pid in left:  # leave nothing behind whatever the outcome
        os.kill(pid, signal.SIGKILL)
    assert not left, f"left running after {sig.name}: {left}\n{out[-3000:]}"
    assert proc.returncode == 0, out[-3000:]
    assert "stopped everything" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    return out


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_stop_signal_once_running_stops_every_process(sig: signal.Signals) -> None:
    """Closing the terminal `make demo` runs in (SIGHUP) or a SIGTERM ended the demo alone,
    with no cleanup: etcd, kube-apiserver, Redis, opgate and the reconciler ran on, orphaned."""
    proc = _start_demo()
    try:
        _read_until(proc, STARTED, timeout=240)
        started = _children(proc.pid)
    except BaseException:
        _kill(proc)
        raise
    others = sorted(name for name in started.values() if not name.startswith("python"))
    assert others == sorted(STARTS) and len(started) == len(STARTS) + 3, started
    _stop_and_check(proc, sig, started)


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_stop_signal_while_starting_stops_what_was_started(sig: signal.Signals) -> None:
    """A Ctrl-C while the cluster starts printed a KeyboardInterrupt traceback; a SIGTERM or a
    SIGHUP then left etcd and kube-apiserver running."""
    proc = _start_demo()
    try:
        _read_until(proc, "starting etcd + kube-apiserver", timeout=60)
        wait_for("kube-apiserver started by the demo",
                 lambda: "kube-apiserver" in _children(proc.pid).values(), timeout=120)
        started = _children(proc.pid)
    except BaseException:
        _kill(proc)
        raise
    _stop_and_check(proc, sig, started)


def test_an_edit_of_the_policies_shows_whether_it_applies(tmp_path: Path) -> None:
    """The demo says "edit them now: changes apply within a second", but showed of a broken
    edit only "policy reload failed, keeping the active set (…): 1 error(s)", not which error
    (the file:line: message on the log's next line), and nothing of an edit that applied."""
    policies = tmp_path / "policies"
    shutil.copytree(ROOT / "policies" / "demo", policies)
    policy = policies / "sample-operator.yaml"
    good = policy.read_text()
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "demo", "--widgets", "1", "--policies", str(policies)],
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True)
    try:
        _read_until(proc, STARTED, timeout=240)
        started = _children(proc.pid)
        assert "      qps: 1\n" in good
        policy.write_text(good.replace("      qps: 1\n", "      qps: -1\n", 1))
        out = _read_until(proc, "policy reload failed", timeout=30)
        out += _read_until(proc, "spec.rateLimits[0].qps: must be at least 0", timeout=5)
        assert f"opgate: {policy}:" in out, out[-3000:]
        policy.write_text(good.replace("burst: 3", "burst: 4", 1))
        _read_until(proc, "opgate.policies: loaded 2 policies", timeout=30)
    except BaseException:
        _kill(proc)
        raise
    _stop_and_check(proc, signal.SIGINT, started)


def _kept_log(out: str, name: str) -> Path:
    """The directory the demo kept, whose log of ``name`` its message names: it must still
    be there to read."""
    found = re.search(rf"(/\S+/{re.escape(name)}\.log)", out)
    kept = re.search(r"demo: logs kept in (/\S+)", out)
    assert found and kept, out[-3000:]
    log = Path(found.group(1))
    assert log.is_file(), f"the demo named {log}, which it removed:\n{out[-3000:]}"
    assert log.is_relative_to(kept.group(1)), out[-3000:]
    return Path(kept.group(1))


def test_an_opgate_that_cannot_start_says_why(tmp_path: Path) -> None:
    """A policy opgate refuses stopped the demo with "could not start: opgate exited; its log:
    …/opgate.log", a file the demo had removed with the rest of its directory as it stopped:
    no way to learn why."""
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "broken.yaml").write_text(
        "apiVersion: opgate.dev/v1alpha1\nkind: Policy\nmetadata: {name: broken}\nspec:\n"
        "  rateLimits:\n    - {name: a, key: '{user}', qps: -1}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "proxy", "demo", "--policies", str(policies)], cwd=ROOT,
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    shutil.rmtree(_kept_log(out, "opgate"))
    assert proc.returncode == 1, out[-3000:]
    assert "spec.rateLimits[0].qps: must be at least 0" in proc.stderr, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


def test_a_process_that_dies_while_the_demo_runs_is_said_with_its_log() -> None:
    proc = _start_demo()
    try:
        _read_until(proc, STARTED, timeout=240)
        started = _children(proc.pid)
        _read_until(proc, "200 list   widgets", timeout=60)  # the reconciler has listed
        [reconciler] = [pid for pid in started if "examples.reconciler" in Path(
            f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")]
        os.kill(reconciler, signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    except BaseException:
        _kill(proc)
        raise
    shutil.rmtree(_kept_log(out, "reconciler"))
    assert proc.returncode == 1, out[-3000:]
    said = out.partition("demo: reconciler exited unexpectedly")[2]
    last_lines = said.partition("demo: stopped everything")[0]
    assert re.search(r"\n\d{4}-\d\d-\d\d [\d:,]+ (INFO|WARNING) ", last_lines), out[-3000:]
    assert not [pid for pid in started if _running(pid)], out[-3000:]


def test_a_proxy_in_the_environment_is_not_used_on_loopback() -> None:
    """With http_proxy set (as on many a company laptop) and no no_proxy naming 127.0.0.1, the
    demo's own HTTP calls (waiting for opgate's /readyz, the intruder's calls) went to that
    proxy: "…/readyz did not answer within 30s" while opgate served."""
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: a proxy that refuses every call
    proxy = f"http://127.0.0.1:{dead.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if k.lower() != "no_proxy"}
    env.update(http_proxy=proxy, HTTP_PROXY=proxy, https_proxy=proxy, HTTPS_PROXY=proxy)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "proxy", "demo", "--duration", "10", "--widgets", "1"],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=300)
    finally:
        dead.close()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "DENIED    403" in out and "opgate-demo:intruder" in out, out[-3000:]


@pytest.mark.parametrize("name", ["etcd", "kube-apiserver"])
def test_the_cluster_dying_while_the_demo_runs_is_said(name: str) -> None:
    """The demo watched only the processes it started itself (Redis, opgate, the reconciler):
    with etcd or kube-apiserver dead it ran on, every call failing, and said nothing."""
    proc = _start_demo()
    try:
        _read_until(proc, STARTED, timeout=240)
        started = _children(proc.pid)
        _read_until(proc, "calls every 3 s and is denied", timeout=60)  # the last of the start
        [pid] = [pid for pid, comm in started.items() if comm == name]
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    except BaseException:
        _kill(proc)
        raise
    shutil.rmtree(_kept_log(out, name))
    assert proc.returncode == 1, out[-3000:]
    assert f"demo: {name} exited unexpectedly" in out, out[-3000:]
    assert not [pid for pid in started if _running(pid)], out[-3000:]
