"""The default relay core: asyncio protocols and httptools, no HTTP framework on the hot path.

The same engine contract as the aiohttp relay (:mod:`proxy.relay.handler`, ``--relay aiohttp``)
with a fraction of its machinery per call: a request head is parsed into byte pairs
(:mod:`.server`), the chain runs, the upstream head is written from those pairs (:mod:`.wire`)
on a pooled keep-alive connection (:mod:`.upstream`), and the response flows back by protocol
callbacks (:mod:`.exchange`) with backpressure both ways. Upgrades are tunnelled raw after the
upstream's ``101``. ``bench/fast_compare.py`` measures the two cores side by side.
"""

from proxy.relay.fast.relay import FastRelay

__all__ = ["FastRelay"]
