"""A lean relay core for ordinary (non-upgrade) calls: asyncio protocols and httptools.

A prototype for issue #5 (CPU per relayed call): the same engine contract as the aiohttp relay
(:mod:`proxy.relay.handler`) without aiohttp's client and server machinery on the hot path.
Upgrades are refused with 501 and stay with the aiohttp relay.

Not used by ``opgate serve`` yet. Measured ~3x less CPU per small GET than the aiohttp relay
(``bench/fast_compare.py``). Before it can serve: the request and idle timeouts, header size
limits, the upgrade tunnel (or a hand-off), the Unix-socket and TLS listeners, the readiness
probe, and a ``--relay`` switch (see the note on issue #5).
"""

from proxy.relay.fast.relay import FastRelay

__all__ = ["FastRelay"]
