"""How long and how often each measure runs, the shared run state, and the statistics.

``Plan.quick()`` is a smoke run (one round, short durations, the whole suite in a few
minutes); ``Plan.full()`` repeats every measure over several interleaved rounds (A B C A B C…)
and reports medians, so slow drift of a busy machine hits every path alike.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import procstat
from bench.paths import NAMES, Target
from bench.procs import Procs
from bench.procstat import Layout

MEASURES = ("idle", "small-get", "latency", "list", "watch", "open-watches", "reload", "ratelimit",
            "chain")


@dataclass(frozen=True, slots=True)
class Plan:
    quick: bool
    rounds: int
    wrk_seconds: float
    connections: int
    latency_rate: float
    latency_seconds: float
    watch_events: int  # per round
    watch_rate: float
    open_watches: int
    list_mb: tuple[int, ...]
    apiserver_list_mb: int
    reload_repeats: int
    apiserver_list_transfers: int = 5  # LISTs per round and path in the apiserver tier
    # the two measures whose rounds are short and spread widest get more of them: a LIST of
    # 200 MB takes 0.1-0.7 s and moves by ±15% from one transfer to the next; the latency's
    # rounds (8 s each) move with the host's state (bench/README.md, "Rounds")
    list_rounds: int = 0  # the static upstream's LISTs (0: ``rounds``)
    latency_rounds: int = 0  # 0: ``rounds``
    unpinned_rounds: int = 1  # of small GETs, after the pinned ones (its own interleaving)
    measures: tuple[str, ...] = MEASURES
    paths: tuple[str, ...] = NAMES  # + "opgate-aiohttp" with --with-aiohttp

    @classmethod
    def quick_plan(cls) -> Plan:
        return cls(quick=True, rounds=1, wrk_seconds=2, connections=16, latency_rate=50,
                   latency_seconds=2, watch_events=1000, watch_rate=1000, open_watches=1000,
                   list_mb=(64, 200), apiserver_list_mb=8, reload_repeats=3,
                   apiserver_list_transfers=1)

    @classmethod
    def full_plan(cls) -> Plan:
        return cls(quick=False, rounds=3, wrk_seconds=6, connections=16, latency_rate=50,
                   latency_seconds=8, watch_events=500, watch_rate=250, open_watches=1000,
                   list_mb=(64, 200), apiserver_list_mb=32, reload_repeats=8, list_rounds=9,
                   latency_rounds=5, unpinned_rounds=3)


@dataclass(slots=True)
class Bench:
    """Everything the measures share during one run."""

    plan: Plan
    layout: Layout
    procs: Procs
    work: Path
    redis_url: str | None = None
    redis_pid: int | None = None
    support_pids: list[int] = field(default_factory=list)  # upstream servers + redis
    pinning: bool = True  # False for the apiserver tier: every process may use every core

    def place(self, targets: Sequence[Target], *, pinned: bool) -> None:
        """Pin every server to its cores (or release every one of them)."""
        pinned = pinned and self.pinning
        for t in targets:
            if t.pid is not None:
                procstat.pin(t.pid, self.layout.proxy if pinned else None)
        for pid in self.support_pids:
            procstat.pin(pid, self.layout.upstream if pinned else None)

    def gen_cpus(self, pinned: bool) -> set[int] | None:
        return self.layout.gen if pinned and self.pinning else None

    @contextlib.contextmanager
    def as_generator(self, pinned: bool = True) -> Iterator[None]:
        """Run the bench's own Python clients on the load generator's cores."""
        before = os.sched_getaffinity(0)
        if pinned and self.pinning:
            os.sched_setaffinity(0, self.layout.gen)
        try:
            yield
        finally:
            os.sched_setaffinity(0, before)


def pct(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0 to 100), linear between closest ranks; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def per_round(rounds: dict[str, list[list[float]]], *, unit: str) -> dict[str, dict[str, Any]]:
    """p50/p99 per path as the median over rounds of each round's percentile, and the added
    latency as the median over rounds of (path minus ``direct`` in the same round): the rounds
    are interleaved, so each difference compares runs made seconds apart, and one disturbed
    round moves the median less than it moves the pooled samples."""
    out: dict[str, dict[str, Any]] = {}
    base = rounds.get("direct", [])
    for name, runs in rounds.items():
        row: dict[str, Any] = {"samples": sum(len(r) for r in runs), "rounds": len(runs)}
        for q in (50, 99):
            row[f"p{q}_{unit}"] = median([pct(r, q) for r in runs])
            if base and name != "direct":
                row[f"added_p{q}_{unit}"] = median(
                    [pct(r, q) - pct(b, q) for r, b in zip(runs, base, strict=False)])
        out[name] = row
    return out


def rounded(d: dict[str, Any], digits: int = 3) -> dict[str, Any]:
    return {k: round(v, digits) if isinstance(v, float) else v for k, v in d.items()}
