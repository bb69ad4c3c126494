"""``opgate serve`` with its time-based amortization windows stretched, for runs under valgrind.

Under callgrind a process runs ~50x slower, so work that opgate amortizes over *time* rather
than over calls would be charged to far fewer calls than under real load: a rate-limit lease
sized from the last 0.5 s of demand holds a handful of tokens instead of hundreds (a Redis
round trip every few calls), and the access and audit logs flush a batch of a few lines every
50 ms instead of hundreds. Stretching those windows by the slowdown keeps the per-call share of
that work as it is in a loaded process, so instruction counts per call compare with real runs.

    python -m bench.slowed FACTOR serve --upstream ... (any ``opgate`` arguments)
"""

from __future__ import annotations

import sys
from typing import Any


def stretch(factor: float) -> None:
    """Scale the lease window/TTL and the log writers' flush interval by ``factor``."""
    from proxy.middlewares import accesslog
    from proxy.stores import lease

    accesslog.FLUSH_SECONDS *= factor
    original = lease.LeasingStore.__init__
    defaults = original.__kwdefaults__ or {}

    def init(self: lease.LeasingStore, inner: Any, **kw: Any) -> None:
        kw["window"] = kw.get("window", defaults["window"]) * factor
        kw["ttl"] = kw.get("ttl", defaults["ttl"]) * factor
        original(self, inner, **kw)

    lease.LeasingStore.__init__ = init  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    stretch(float(argv[0]))
    from proxy.cli import main as opgate

    return opgate(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
