"""The relay: the only part of opgate that touches sockets and bodies.

It accepts API calls (:func:`serve_api`), runs them through the middleware chain and streams
them to and from the apiserver (:class:`FastRelay`, asyncio protocols + httptools, the default;
:class:`Relay`, aiohttp's client and server), tunnels upgrades, and keeps header hygiene. The
engine and the middlewares never import it; the CLI wires it up.
"""

from proxy.relay.fast import FastRelay
from proxy.relay.handler import PolicyStoreLike, Relay, RelaySettings
from proxy.relay.listen import Listener, serve_api
from proxy.relay.upstream import UpstreamConfig, UpstreamConfigError, resolve_upstream

__all__ = [
    "FastRelay",
    "Listener",
    "PolicyStoreLike",
    "Relay",
    "RelaySettings",
    "UpstreamConfig",
    "UpstreamConfigError",
    "resolve_upstream",
    "serve_api",
]
