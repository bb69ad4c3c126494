"""Instructions per relayed call of a serving opgate, with each middleware alone: a
deterministic breakdown of the full chain's cost.

CPU time on a small shared VM moves by 15-30% between runs, more than most single changes to
the hot path are worth, and such VMs expose no hardware counters. Valgrind's callgrind counts
the instructions a process executes, the same on every run (±0.5%) whatever else the machine
does, so it tells an A/B of a hot-path change apart where wall-clock rounds cannot. On the
project's machines ~1,000 instructions of opgate's relay are ~0.5 µs of CPU.

Each row is one ``opgate serve`` process under callgrind (counting only while measured), in
front of the bench's static TLS upstream (nginx) with the bench's policy cut down to some of its
sections (:mod:`bench.paths`): the relay alone; the chain with no section (a policy set, Redis,
metrics); each section alone; the access log alone; the audit log alone; everything (the
bench's ``opgate-full``). After a warm-up, ``--calls`` small GETs go over 4 keep-alive
connections one at a time, then an idle window of the same length is counted and subtracted
(timers, the informer), so a row is the net instructions per call. Under callgrind the server
is ~50x slower, so its time-based amortization windows are stretched as much
(:mod:`bench.slowed`). The identity row includes the BLAKE2b of the caller's ~1 KB token (its
cache key), ~12k instructions (~2 µs on the real CPU).

    python bench/instructions.py [--calls 1000] [--rows relay,identity,full] [--keep DIR]

``--keep DIR`` keeps each row's callgrind dump of the measured calls as ``DIR/<row>.callgrind``
(read it with ``callgrind_annotate``: which C functions and libraries the instructions go to).

Needs ``valgrind`` (Debian package) besides what ``python -m bench`` needs. ~30 s per row.
"""

from __future__ import annotations

import argparse
import glob
import http.client
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.interpreter import describe, opgate_python
from bench.paths import REPO, STATIC_TOKEN, _policy, _token_file, quota_supported
from bench.procs import Procs, free_port, wait_http, wait_port
from bench.upstreams import SMALL, Upstream, start_static

SECTIONS = ("identity", "faults", "quotas", "rateLimits")
SLOWDOWN = 50.0  # how much slower a process runs under callgrind (bench.slowed)
WARM_CALLS = 300
CONNECTIONS = 4


@dataclass(frozen=True)
class Row:
    name: str
    sections: tuple[str, ...] | None  # None: no --policies at all (the relay alone)
    access_log: bool = False
    audit_log: bool = False


ROWS = (
    Row("relay", None),
    Row("chain", ()),
    *(Row(s, (s,)) for s in SECTIONS),
    Row("accesslog", (), access_log=True),
    Row("auditlog", (), audit_log=True),
    Row("full", SECTIONS, access_log=True, audit_log=True),
)


def policy_text(sections: tuple[str, ...]) -> str:
    """The bench's policy with only ``sections`` kept."""
    text = _policy(probe=False, quota=quota_supported())
    for section in SECTIONS:
        if section not in sections:
            text, n = re.subn(r"\n  " + section + r":\n(?:    .*\n|\s*#.*\n)*", "\n", text)
            if section != "quotas" or quota_supported():
                assert n == 1, f"section {section} not found in the bench policy"
    return text


def serve_argv(row: Row, work: Path, upstream: Upstream, redis_url: str, port: int,
               admin: int) -> list[str]:
    argv = [opgate_python(), "-m", "bench.slowed", str(SLOWDOWN), "serve",
            "--upstream", upstream.url, "--upstream-ca", str(upstream.ca_file),
            "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}",
            "--token-file", str(_token_file(work, STATIC_TOKEN))]
    if row.sections is not None:
        policies = work / "policies"
        policies.mkdir()
        (policies / "bench.yaml").write_text(policy_text(row.sections))
        argv += ["--policies", str(policies), "--redis-url", redis_url]
    if row.audit_log:  # not in the policy directory's parent, which opgate watches (paths.py)
        (work / "log").mkdir()
        argv += ["--audit-log", str(work / "log" / "audit.log")]
    if not row.access_log:
        argv += ["--no-access-log"]
    return argv


def counted(pid: int, out: str, work: Callable[[], None],
            keep: Path | None = None) -> tuple[int, float]:
    """Instructions the process executed while ``work`` ran, and its seconds (its dump copied
    to ``keep``)."""
    before = set(glob.glob(out + "*"))
    subprocess.run(["callgrind_control", "-i", "on", str(pid)], check=True, capture_output=True)
    started = time.monotonic()
    work()
    seconds = time.monotonic() - started
    subprocess.run(["callgrind_control", "-i", "off", str(pid)], check=True, capture_output=True)
    subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
    total = 0
    for _ in range(50):  # the dump is written asynchronously
        fresh = set(glob.glob(out + "*")) - before
        if fresh:
            break
        time.sleep(0.1)
    time.sleep(0.5)
    for path in fresh:
        text = Path(path).read_text()
        for line in text.splitlines():
            if line.startswith("totals:"):
                total += int(line.split()[1])
        if keep is not None:
            keep.write_text(text)
    return total, seconds


def measure(row: Row, procs: Procs, work: Path, upstream: Upstream, redis_url: str,
            calls: int, headers: dict[str, str], keep: Path | None = None) -> float:
    port, admin = free_port(), free_port()
    out = str(work / "callgrind.out")
    argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
            f"--callgrind-out-file={out}", *serve_argv(row, work, upstream, redis_url, port,
                                                       admin)]
    proc = procs.start(row.name, argv, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        wait_http(f"http://127.0.0.1:{admin}/healthz", proc=proc, timeout=600)
        conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                 for _ in range(CONNECTIONS)]

        def batch(n: int) -> None:
            for i in range(n):
                conn = conns[i % CONNECTIONS]
                conn.request("GET", SMALL, headers=headers)
                answer = conn.getresponse()
                answer.read()
                if answer.status != 200:
                    raise RuntimeError(f"{row.name}: GET {SMALL} answered {answer.status}")

        batch(WARM_CALLS)
        assert proc.pid is not None
        busy, seconds = counted(proc.pid, out, lambda: batch(calls),
                                None if keep is None else keep / f"{row.name}.callgrind")
        idle, idle_seconds = counted(proc.pid, out, lambda: time.sleep(seconds))
        return (busy - idle * seconds / idle_seconds) / calls
    finally:
        procs.stop(proc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rows", default=",".join(r.name for r in ROWS),
                        help="comma-separated: " + ", ".join(r.name for r in ROWS))
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="keep each row's callgrind dump of the measured calls in DIR")
    args = parser.parse_args(argv)
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    wanted = args.rows.split(",")
    unknown = set(wanted) - {r.name for r in ROWS}
    if unknown:
        parser.error(f"unknown rows: {', '.join(sorted(unknown))}")
    rows = [r for r in ROWS if r.name in wanted]
    with tempfile.TemporaryDirectory(prefix="opgate-instructions-") as tmp:
        work = Path(tmp)
        procs = Procs(work)
        try:
            static = start_static(procs, work, big=False)
            upstream = static.tls
            redis_port = free_port()
            redis = procs.start("redis", ["redis-server", "--port", str(redis_port), "--bind",
                                          "127.0.0.1", "--save", "", "--appendonly", "no",
                                          "--dir", str(work)])
            wait_port(redis_port, proc=redis)
            redis_url = f"redis://127.0.0.1:{redis_port}/0"
            headers = upstream.caller.headers if upstream.caller is not None else {}
            results: dict[str, float] = {}
            for row in rows:
                sub = work / row.name
                sub.mkdir()
                results[row.name] = measure(row, procs, sub, upstream, redis_url, args.calls,
                                            headers, args.keep)
                print(f"{row.name:<10} {results[row.name]:>10,.0f} instructions/call",
                      file=sys.stderr, flush=True)
        finally:
            procs.stop_all()
    print(f"opgate on Python {describe()}")
    print(table(results))
    return 0


def table(results: dict[str, float]) -> str:
    """Rows with their cost over the chain with no section (or over the relay alone)."""
    base = results.get("chain", results.get("relay"))
    relay = results.get("relay")
    lines = [f"{'row':<11}{'instructions/call':>18}{'vs relay':>10}{'cost':>10}"]
    for name, value in results.items():
        ratio = f"{value / relay:.2f}x" if relay else "-"
        cost = "-" if base is None or name in ("relay", "chain") else f"{value - base:+,.0f}"
        lines.append(f"{name:<11}{value:>18,.0f}{ratio:>10}{cost:>10}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
