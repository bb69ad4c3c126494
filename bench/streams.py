"""Long-lived measures: watch event latency, the memory of open watches, hot-reload time.

* ``watch``: ``rounds`` x ``watch_events`` timestamped events through each path (≥ 1,000 per
  path); p50/p99 of the per-event delay, and the same minus ``direct``.
* ``open_watches``: the proxy's RSS with 1,000 watches open through it (each past its first
  event), and the growth over its RSS before they opened.
* ``reload``: rewrite the full chain's policy file (add, then remove, a rule for ``secrets``)
  and time, from the rename, (a) until ``/debug/policies`` shows the new digest and (b) until
  a request's behaviour changes: the probe GET of a secret starts (or stops) carrying the
  ``RateLimit-Limit`` header the new rule adds. Probes run back to back, about 1 or 2 ms apart.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence

from bench import procstat
from bench.clients import get_json, get_status, new_session, open_watches, watch_latency
from bench.measures import Result, _log
from bench.paths import Target, write_policy
from bench.plan import Bench, median, per_round, rounded
from bench.upstreams import PROBE

GIVE_UP = 10.0  # seconds after which a reload counts as never seen (NaN)


def watch(bench: Bench, targets: Sequence[Target]) -> Result:
    plan = bench.plan
    delays: dict[str, list[list[float]]] = {t.name: [] for t in targets}
    bench.place(targets, pinned=True)
    with bench.as_generator():
        for i in range(plan.rounds):
            for t in targets:
                _log(f"  watch events round {i + 1}/{plan.rounds}: {t.name}")
                delays[t.name].append(asyncio.run(watch_latency(
                    t.url, count=plan.watch_events, rate=plan.watch_rate, headers=t.headers,
                    ca_file=t.ca_file)))
    return {name: rounded(row, 1) for name, row in per_round(delays, unit="us").items()}


def open_watch_memory(bench: Bench, targets: Sequence[Target]) -> Result:
    n = bench.plan.open_watches
    out: Result = {}

    async def hold(t: Target) -> Result:
        assert t.pid is not None
        before = procstat.rss_mb(t.pid)
        started = time.perf_counter()
        async with open_watches(t.url, n=n, headers=t.headers, ca_file=t.ca_file) as opened:
            took = time.perf_counter() - started
            await asyncio.sleep(0.5)
            during = procstat.rss_mb(t.pid)
        return rounded({"opened": opened, "rss_before_mb": before, "rss_open_mb": during,
                        "growth_mb": during - before, "kb_per_watch": (during - before) * 1024
                        / max(1, opened), "open_seconds": took}, 1)

    bench.place(targets, pinned=True)
    with bench.as_generator():
        for t in targets:
            if t.pid is None:
                continue
            _log(f"  {n} open watches: {t.name}")
            out[t.name] = asyncio.run(hold(t))
            time.sleep(0.5)  # let the proxy and the upstreams drop the closed streams
    return out


async def _until_changed(t: Target, *, digest: str, header_wanted: bool
                         ) -> tuple[float, float]:
    """Rewrite the policy, then probe; returns (ms to the new digest, ms to the new behaviour)."""
    assert t.policy_file is not None and t.admin is not None
    debug = t.admin + "/debug/policies"
    async with new_session() as session:
        start = time.perf_counter()
        write_policy(t.policy_file, probe=header_wanted)
        seen_digest = seen_effect = float("nan")

        async def probe_digest() -> None:
            nonlocal seen_digest
            while time.perf_counter() - start < GIVE_UP:
                if (await get_json(session, debug))["digest"] != digest:
                    seen_digest = (time.perf_counter() - start) * 1e3
                    return
                await asyncio.sleep(0.001)

        async def probe_effect() -> None:
            nonlocal seen_effect
            while time.perf_counter() - start < GIVE_UP:
                _, limit = await get_status(session, t.url + PROBE, "RateLimit-Limit",
                                            t.headers)
                if (limit is not None) == header_wanted:
                    seen_effect = (time.perf_counter() - start) * 1e3
                    return

        await asyncio.gather(probe_digest(), probe_effect())
        return seen_digest, seen_effect


def _worst(values: list[float]) -> float:
    """The largest value; NaN (a change never seen) counts as the worst of all."""
    return math.inf if any(math.isnan(v) for v in values) else max(values, default=math.nan)


def reload(bench: Bench, target: Target) -> Result:
    assert target.admin is not None and target.policy_file is not None
    debug, policy = target.admin + "/debug/policies", target.policy_file

    async def run() -> Result:
        digests: list[float] = []
        effects: list[float] = []
        async with new_session() as session:
            for i in range(bench.plan.reload_repeats):
                digest = str((await get_json(session, debug))["digest"])
                add = i % 2 == 0
                d, e = await _until_changed(target, digest=digest, header_wanted=add)
                _log(f"  reload {i + 1}/{bench.plan.reload_repeats} ({'add' if add else 'remove'}"
                     f" a rule): digest after {d:.0f} ms, behaviour after {e:.0f} ms")
                digests.append(d)
                effects.append(e)
                await asyncio.sleep(0.3)
        write_policy(policy, probe=False)
        never = sum(1 for e in effects if math.isnan(e))  # not seen within GIVE_UP
        return rounded({"digest_ms_median": median(digests), "digest_ms_max": _worst(digests),
                        "effect_ms_median": median(effects), "effect_ms_max": _worst(effects),
                        "repeats": len(effects), "never_seen": never}, 1)

    with bench.as_generator():
        return asyncio.run(run())
