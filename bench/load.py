"""Closed-loop load from external C programs: ``wrk`` for small GETs, ``curl`` for large LISTs.

Both run as subprocesses, optionally pinned (``taskset``) to the load generator's cores, so the
Python bench never sits on the measured path for throughput. ``wrk --latency`` reports req/s
and the p50/p75/p90/p99 latency (HTTP/1.1, TLS when the URL is https); ``curl`` downloads one
LIST to ``/dev/null`` and reports the mean speed (HTTP/2 when it talks TLS to nginx directly).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def _taskset(cpus: set[int] | None) -> list[str]:
    return ["taskset", "-c", ",".join(str(c) for c in sorted(cpus))] if cpus else []


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if not m:
        raise ValueError(f"cannot read wrk latency {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


@dataclass(frozen=True, slots=True)
class WrkResult:
    requests: int
    errors: int  # non-2xx/3xx responses + socket errors
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    seconds: float


def parse_wrk(out: str) -> WrkResult:
    pct = dict(re.findall(r"^\s+(50|75|90|99)%\s+(\S+)", out, re.M))
    done = re.search(r"(\d+) requests in ([\d.]+)(ms|s|m)", out)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if not (pct and done and rps):
        raise RuntimeError(f"cannot read wrk output:\n{out}")
    errors = sum(int(n) for n in re.findall(r"Non-2xx or 3xx responses: (\d+)", out))
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if sock:
        errors += sum(int(g) for g in sock.groups())
    return WrkResult(
        requests=int(done.group(1)), errors=errors, rps=float(rps.group(1)),
        p50_ms=_ms(pct["50"]), p90_ms=_ms(pct["90"]), p99_ms=_ms(pct["99"]),
        seconds=_ms(done.group(2) + done.group(3)) / 1e3)


def wrk(
    url: str, *, seconds: float, connections: int, headers: Mapping[str, str],
    cpus: set[int] | None, threads: int = 1,
) -> WrkResult:
    """One closed-loop run of ``wrk`` with ``connections`` keep-alive connections."""
    argv = [*_taskset(cpus), "wrk", f"-t{threads}", f"-c{connections}",
            f"-d{max(1, round(seconds))}s", "--latency", "--timeout", "10s"]
    for k, v in headers.items():
        argv += ["-H", f"{k}: {v}"]
    out = subprocess.run([*argv, url], capture_output=True, text=True, timeout=seconds + 60)
    if out.returncode != 0:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stderr or out.stdout}")
    return parse_wrk(out.stdout)


@dataclass(frozen=True, slots=True)
class Download:
    bytes: int
    seconds: float
    http_version: str

    @property
    def mb_s(self) -> float:
        return self.bytes / 1e6 / max(self.seconds, 1e-9)


def curl(
    url: str, *, headers: Mapping[str, str], ca_file: str | None, cpus: set[int] | None,
) -> Download:
    """Download ``url`` to /dev/null; raises unless it answers 200 with a body."""
    argv = [*_taskset(cpus), "curl", "-sS", "-o", "/dev/null", "--max-time", "300",
            "-w", "%{http_code} %{size_download} %{time_total} %{http_version}"]
    if ca_file:
        argv += ["--cacert", ca_file]
    for k, v in headers.items():
        argv += ["-H", f"{k}: {v}"]
    out = subprocess.run([*argv, url], capture_output=True, text=True, timeout=330)
    parts = out.stdout.split()
    if out.returncode != 0 or len(parts) != 4 or parts[0] != "200":
        raise RuntimeError(f"curl {url}: {out.returncode} {out.stdout} {out.stderr}")
    return Download(bytes=int(parts[1]), seconds=float(parts[2]), http_version=parts[3])
