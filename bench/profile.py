"""``--profile``: sample opgate with py-spy under the small-GET load; top functions for the report.

py-spy attaches to the running full-chain opgate (TLS upstream) by PID in ``--nonblocking``
mode (it reads the interpreter's memory without stopping it), while ``wrk`` drives the same
load as the small-GET measure, in an extra run that no median includes. Two samplers run at
once: one writes the collapsed stacks (``profile.txt``: the tables in the report, and
speedscope opens it), the other a flame graph (``profile.svg``). Idle samples (the event loop
waiting in ``epoll``) are left out, so the percentages are of the time opgate is busy.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path

from bench.load import wrk
from bench.measures import Result, _log
from bench.paths import Target
from bench.plan import Bench
from bench.upstreams import SMALL

RESULTS = Path(__file__).parent / "results"
_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>.*?)(?::\d+)?\)$")


def _short(frame: str) -> str:
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    path = m.group("file")
    for marker in ("site-packages/", "/lib/python3.", "/work/main/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            if marker.startswith("/lib/python3."):
                path = path.split("/", 1)[-1]
            break
    return f"{m.group('fn')} ({path})"


_WRAPPERS = ("<frozen runpy>", "asyncio/runners.py", "asyncio/base_events.py", "asyncio/events.py",
             "proxy/cli.py", "proxy/app.py", "proxy/__main__.py")
_AREAS = (("proxy/", "opgate (proxy/)"), ("aiohttp/", "aiohttp"), ("yarl/", "aiohttp"),
          ("multidict/", "aiohttp"), ("asyncio/", "asyncio"), ("selectors.py", "asyncio"),
          ("ssl.py", "ssl"), ("logging/", "logging + json"), ("json/", "logging + json"),
          ("prometheus_client/", "prometheus_client"), ("redis/", "redis client"))


def _area(frame: str) -> str:
    return next((name for marker, name in _AREAS if marker in frame), "other")


def top_functions(raw: str, *, limit: int = 15) -> Result:
    """Self time, inclusive time and self time per area, from py-spy's collapsed stacks of the
    event loop's thread (other threads, such as the file watcher's, are left out)."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit() or stack.startswith("Thread._bootstrap"):
            continue
        n = int(count)
        frames = [_short(f) for f in stack.split(";")]
        total += n
        own[frames[-1]] += n
        areas[_area(frames[-1])] += n
        for f in set(frames):
            if not any(w in f for w in _WRAPPERS):
                incl[f] += n

    def rows(c: Counter[str], k: int) -> list[Result]:
        return [{"function": f, "pct": round(100 * n / max(1, total), 1)}
                for f, n in c.most_common(k)]

    return {"samples": total, "self": rows(own, limit), "inclusive": rows(incl, limit),
            "areas": rows(areas, len(areas))}


def profile(bench: Bench, target: Target) -> Result:
    spy = shutil.which("py-spy")
    if spy is None:
        return {"error": "py-spy not found: pip install py-spy"}
    assert target.pid is not None
    seconds = max(6.0, bench.plan.wrk_seconds)
    RESULTS.mkdir(exist_ok=True)
    raw, svg = RESULTS / "profile.txt", RESULTS / "profile.svg"
    cpus = ",".join(str(c) for c in sorted(bench.layout.gen))
    samplers = [subprocess.Popen(
        ["taskset", "-c", cpus, spy, "record", "--pid", str(target.pid), "--rate", "200",
         "--duration", str(int(seconds)), "--nonblocking", "--format", fmt, "-o", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for fmt, out in (("raw", raw), ("flamegraph", svg))]
    try:
        bench.place([target], pinned=True)
        time.sleep(0.5)
        _log(f"  profiling {target.name} with py-spy for {seconds:.0f} s under wrk")
        wrk(target.url + SMALL, seconds=seconds - 1, connections=bench.plan.connections,
            headers=target.headers, cpus=bench.gen_cpus(True))
        errors = [p.communicate(timeout=60)[1] for p in samplers]
    finally:
        for p in samplers:
            if p.poll() is None:
                p.kill()
                p.wait()
    if not raw.exists():
        return {"error": "py-spy wrote nothing: " + " | ".join(e.strip()[-300:] for e in errors)}
    return {**top_functions(raw.read_text()), "file": "bench/results/profile.txt",
            "svg": "bench/results/profile.svg" if svg.exists() else None}
